//! Patching libc: each hooked function's entry is overwritten with an absolute jump to its
//! handler, so every caller — the program through the PLT and libc itself through internal
//! aliases (`__write`, `__libc_write`, `__open64`, `__lseek64`, `__fstat64`, ...) — arrives
//! in the handler. Handlers never call the original, so nothing else of the function is kept.

use std::ffi::{CStr, c_void};

use kura_fs::elf::{DT_GNU_HASH, DT_NULL, DT_SYMTAB};

use crate::hooks::hooks;

/// `jmp *0(%rip)` followed by the 8-byte target: clobbers no register.
const JUMP_BYTES: usize = 14;
const PAGE_BYTES: usize = 4096;
/// `dladdr1`'s request for the symbol table entry.
const RTLD_DL_SYMENT: i32 = 1;
/// Symbols of one object read into [`SymbolSizes`], at most (libc has ~3,000).
const SYMBOLS_MAX: usize = 1 << 16;

/// The public head of glibc's `struct link_map`.
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const libc::c_char,
    l_ld: *const Elf64Dyn,
}

#[repr(C)]
struct Elf64Dyn {
    d_tag: i64,
    d_val: u64,
}

unsafe extern "C" {
    fn dladdr1(addr: *const c_void, info: *mut libc::Dl_info, extra: *mut *mut c_void, flags: i32) -> i32;
}

/// The sizes of some functions of libc, from one pass over its dynamic symbol table.
/// `dladdr1` scans the whole table at every call: asked for each of ~130 functions, it was
/// 38 % of the time a preloaded `/bin/true` took.
struct SymbolSizes {
    /// The functions' addresses, sorted, and their sizes (`None`: not seen in the table).
    addrs: Vec<usize>,
    sizes: Vec<Option<u64>>,
}

/// Bits of the filter that lets the pass over libc's ~3,000 symbols skip, with one test,
/// those that are none of the ~130 functions (a binary search each was 5 % of a preloaded
/// `cat`'s time).
const ADDR_FILTER_BITS: usize = 4096;

/// The filter's bit for a function at `addr` (functions are 16-byte aligned).
fn filter_bit(addr: usize) -> usize {
    (addr >> 4) % ADDR_FILTER_BITS
}

impl SymbolSizes {
    /// The sizes of the functions at `addrs` (sorted, no duplicates) in libc (`libc_handle`);
    /// none when its tables cannot be read ([`SymbolSizes::size`] then asks `dladdr1`).
    fn of(libc_handle: *mut c_void, addrs: Vec<usize>) -> Self {
        let mut sizes = vec![None; addrs.len()];
        let mut filter = [0u64; ADDR_FILTER_BITS / 64];
        for &addr in &addrs {
            filter[filter_bit(addr) / 64] |= 1 << (filter_bit(addr) % 64);
        }
        // SAFETY: the link map, dynamic section, symbol table and GNU hash table belong to a
        // loaded object (libc), which stays loaded; every read stays within the tables as
        // their own headers describe them, bounded by SYMBOLS_MAX.
        unsafe {
            // The link map straight from the handle (`dladdr1` would scan the symbols for it).
            let mut map: *mut c_void = std::ptr::null_mut();
            if libc::dlinfo(libc_handle, libc::RTLD_DI_LINKMAP, &mut map as *mut *mut c_void as *mut c_void) != 0 || map.is_null() {
                return Self { addrs, sizes };
            }
            let map = &*(map as *const LinkMap);
            // glibc rewrites these entries as addresses when it loads an object; an offset
            // (smaller than the base) is taken as one.
            let at = |v: u64| if (v as usize) < map.l_addr { map.l_addr + v as usize } else { v as usize };
            let (mut symtab, mut gnu_hash) = (0usize, 0usize);
            let mut dyn_entry = map.l_ld;
            while !dyn_entry.is_null() && (*dyn_entry).d_tag != DT_NULL {
                match (*dyn_entry).d_tag {
                    DT_SYMTAB => symtab = at((*dyn_entry).d_val),
                    DT_GNU_HASH => gnu_hash = at((*dyn_entry).d_val),
                    _ => {}
                }
                dyn_entry = dyn_entry.add(1);
            }
            if symtab == 0 || gnu_hash == 0 {
                return Self { addrs, sizes };
            }
            // GNU hash: nbuckets, symoffset, bloom words, shift; the bloom filter; the buckets
            // (the first symbol of each chain); the chains (low bit set on a chain's last).
            let header = gnu_hash as *const u32;
            let (nbuckets, symoffset, bloom_words) = (*header as usize, *header.add(1) as usize, *header.add(2) as usize);
            let buckets = (gnu_hash + 16 + 8 * bloom_words) as *const u32;
            let chains = buckets.add(nbuckets);
            let last_start = (0..nbuckets).map(|b| *buckets.add(b) as usize).max().unwrap_or(0);
            let mut count = symoffset;
            if last_start >= symoffset {
                let mut i = last_start;
                while i < SYMBOLS_MAX && *chains.add(i - symoffset) & 1 == 0 {
                    i += 1;
                }
                count = i + 1;
            }
            let syms = symtab as *const libc::Elf64_Sym;
            for i in 0..count.min(SYMBOLS_MAX) {
                let sym = &*syms.add(i);
                let addr = map.l_addr + sym.st_value as usize;
                if sym.st_value == 0 || sym.st_shndx == 0 || filter[filter_bit(addr) / 64] & (1 << (filter_bit(addr) % 64)) == 0 {
                    continue;
                }
                if let Ok(at) = addrs.binary_search(&addr) {
                    sizes[at] = Some(sizes[at].unwrap_or(0).max(sym.st_size));
                }
            }
        }
        Self { addrs, sizes }
    }

    /// The size found in the pass, if any.
    fn found(&self, addr: *const c_void) -> Option<u64> {
        self.addrs.binary_search(&(addr as usize)).ok().and_then(|at| self.sizes[at])
    }

    fn size(&self, addr: *const c_void) -> Option<u64> {
        self.found(addr).or_else(|| symbol_size(addr))
    }
}

/// The size of the function at `addr`, from libc's dynamic symbol table.
fn symbol_size(addr: *const c_void) -> Option<u64> {
    // SAFETY: Dl_info is plain data; dladdr1 fills it and points `sym` into the loaded
    // object's symbol table, which lives as long as the object (libc: forever).
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let mut sym: *mut c_void = std::ptr::null_mut();
        if dladdr1(addr, &mut info, &mut sym, RTLD_DL_SYMENT) == 0 || sym.is_null() {
            return None;
        }
        Some((*(sym as *const libc::Elf64_Sym)).st_size)
    }
}

/// The pages holding `start..end`: `(first page, length)`.
fn page_span(start: usize, end: usize) -> (usize, usize) {
    let page = start & !(PAGE_BYTES - 1);
    (page, (end - page).div_ceil(PAGE_BYTES) * PAGE_BYTES)
}

/// Overwrites the entry of the function at `target` with a jump to `handler`.
///
/// # Safety
/// `target` must be the entry of a function at least [`JUMP_BYTES`] long that no thread is
/// executing, and `handler` a function with the same calling convention and arguments; the
/// pages holding it must be writable.
unsafe fn write_jump(target: *mut u8, handler: usize) {
    let mut code = [0u8; JUMP_BYTES];
    code[..6].copy_from_slice(&[0xff, 0x25, 0, 0, 0, 0]);
    code[6..].copy_from_slice(&(handler as u64).to_le_bytes());
    // SAFETY: the caller guarantees the function is at least JUMP_BYTES long, idle, and on
    // writable pages.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), target, JUMP_BYTES) };
}

/// Sets the protection of the pages holding `start..end`.
fn protect(start: usize, end: usize, prot: i32) -> Result<(), String> {
    let (page, len) = page_span(start, end);
    // SAFETY: changing the protection of libc's own text pages, which stay mapped.
    if unsafe { libc::mprotect(page as *mut c_void, len, prot) } != 0 {
        return Err(format!("mprotect: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Patches every function of [`hooks`] that this libc has (once per code address: aliases
/// share one). Functions too short for the jump are left alone and listed with
/// `KURA_FS_DEBUG=1`.
pub fn install() -> Result<(), String> {
    // SAFETY: dlopen of an already loaded library with RTLD_NOLOAD only returns its handle.
    let libc_handle = unsafe { libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if libc_handle.is_null() {
        return Err("libc.so.6 is not loaded".into());
    }
    let debug = std::env::var_os("KURA_FS_DEBUG").is_some();
    let mut found: Vec<(&CStr, usize, usize)> = Vec::new();
    for (name, handler) in hooks() {
        // SAFETY: dlsym with a valid handle and NUL-terminated name.
        let addr = unsafe { libc::dlsym(libc_handle, name.as_ptr()) };
        if !addr.is_null() {
            found.push((name, addr as usize, handler));
        }
    }
    // Once per code address (aliases share one), the first name listed winning (a stable sort
    // keeps their order).
    found.sort_by_key(|f| f.1);
    found.dedup_by_key(|f| f.1);
    let sizes = SymbolSizes::of(libc_handle, found.iter().map(|f| f.1).collect());
    let mut targets: Vec<(usize, usize)> = Vec::new();
    let mut skipped = Vec::new();
    for (name, addr, handler) in found {
        let addr = addr as *const c_void;
        if debug {
            let (one_pass, asked) = (sizes.found(addr), symbol_size(addr));
            if one_pass != asked {
                crate::hooks::complain(&format!("libkura_fs: {} has size {one_pass:?} in one pass over the symbols, {asked:?} from dladdr1", name.to_string_lossy()));
            }
        }
        match sizes.size(addr) {
            Some(size) if size as usize >= JUMP_BYTES => targets.push((addr as usize, handler)),
            other => skipped.push(format!("{} ({other:?} bytes)", name.to_string_lossy())),
        }
    }
    // libc's text is one mapping: its pages from the first entry to the last are made
    // writable once and executable again once (two mprotect calls where one pair per function
    // took 260, a millisecond of every program's start on this machine).
    let (Some(start), Some(end)) = (targets.iter().map(|t| t.0).min(), targets.iter().map(|t| t.0 + JUMP_BYTES).max()) else {
        return Ok(());
    };
    protect(start, end, libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC)?;
    for &(addr, handler) in &targets {
        // SAFETY: `addr` is the entry of a libc function of at least JUMP_BYTES (checked
        // above) on a page made writable just above; the constructor runs before the program
        // starts threads; the handler has the function's prototype (see HOOKS).
        unsafe { write_jump(addr as *mut u8, handler) };
    }
    protect(start, end, libc::PROT_READ | libc::PROT_EXEC)?;
    if debug && !skipped.is_empty() {
        crate::hooks::complain(&format!("libkura_fs: not patched (too short): {}", skipped.join(", ")));
    }
    Ok(())
}
