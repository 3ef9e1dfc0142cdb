//! Patching libc: each hooked function's entry is overwritten with an absolute jump to its
//! handler, so every caller — the program through the PLT and libc itself through internal
//! aliases (`__write`, `__libc_write`, `__open64`, `__lseek64`, `__fstat64`, ...) — arrives
//! in the handler. Handlers never call the original, so nothing else of the function is kept.

use std::collections::HashSet;
use std::ffi::{CStr, c_void};

use crate::hooks::hooks;

/// `jmp *0(%rip)` followed by the 8-byte target: clobbers no register.
const JUMP_BYTES: usize = 14;
const PAGE_BYTES: usize = 4096;
/// `dladdr1`'s request for the symbol table entry.
const RTLD_DL_SYMENT: i32 = 1;

#[repr(C)]
struct Elf64Sym {
    st_name: u32,
    st_info: u8,
    st_other: u8,
    st_shndx: u16,
    st_value: u64,
    st_size: u64,
}

unsafe extern "C" {
    fn dladdr1(addr: *const c_void, info: *mut libc::Dl_info, extra: *mut *mut c_void, flags: i32) -> i32;
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
        Some((*(sym as *const Elf64Sym)).st_size)
    }
}

/// Overwrites the entry of the function at `target` with a jump to `handler`.
///
/// # Safety
/// `target` must be the entry of a function at least [`JUMP_BYTES`] long that no thread is
/// executing, and `handler` a function with the same calling convention and arguments.
unsafe fn write_jump(target: *mut u8, handler: usize) -> Result<(), String> {
    let page = (target as usize) & !(PAGE_BYTES - 1);
    let span = (target as usize + JUMP_BYTES) - page;
    let len = span.div_ceil(PAGE_BYTES) * PAGE_BYTES;
    let rwx = libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC;
    // SAFETY: changing the protection of libc's own text pages, which stay mapped.
    if unsafe { libc::mprotect(page as *mut c_void, len, rwx) } != 0 {
        return Err(format!("mprotect: {}", std::io::Error::last_os_error()));
    }
    let mut code = [0u8; JUMP_BYTES];
    code[..6].copy_from_slice(&[0xff, 0x25, 0, 0, 0, 0]);
    code[6..].copy_from_slice(&(handler as u64).to_le_bytes());
    // SAFETY: the caller guarantees the function is at least JUMP_BYTES long and idle; the
    // pages are writable now.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), target, JUMP_BYTES) };
    // SAFETY: as above: restoring the text's protection.
    if unsafe { libc::mprotect(page as *mut c_void, len, libc::PROT_READ | libc::PROT_EXEC) } != 0 {
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
    let mut patched: HashSet<usize> = HashSet::new();
    let mut skipped = Vec::new();
    for (name, handler) in hooks() {
        let name: &CStr = name;
        // SAFETY: dlsym with a valid handle and NUL-terminated name.
        let addr = unsafe { libc::dlsym(libc_handle, name.as_ptr()) };
        if addr.is_null() || patched.contains(&(addr as usize)) {
            continue;
        }
        match symbol_size(addr) {
            Some(size) if size as usize >= JUMP_BYTES => {}
            other => {
                skipped.push(format!("{} ({other:?} bytes)", name.to_string_lossy()));
                continue;
            }
        }
        // SAFETY: `addr` is the entry of a libc function of at least JUMP_BYTES (checked
        // above); the constructor runs before the program starts threads; the handler has
        // the function's prototype (see HOOKS).
        unsafe { write_jump(addr as *mut u8, handler)? };
        patched.insert(addr as usize);
    }
    if std::env::var_os("KURA_FS_DEBUG").is_some() && !skipped.is_empty() {
        crate::hooks::complain(&format!("libkura_fs: not patched (too short): {}", skipped.join(", ")));
    }
    Ok(())
}
