//! `dlopen` of a library in the mount: the dynamic loader opens and maps files with its own
//! system calls, which the hooks never see, so it is given a host copy of the kura file
//! (`<lock dir>/<fs>-<ino>.so`, rewritten when the kura file's size or mtime changed). rustc
//! loads procedural macros from the target directory this way, Python its C extensions from
//! a virtualenv. The libraries such a library needs from beside it in the mount (`$ORIGIN`
//! in its run path) are loaded first, the same way.
//!
//! This `dlopen` interposes libc's by symbol (the library is preloaded), not by patching: it
//! decides the path, then jumps to libc's function with the caller's return address still on
//! the stack, so libc sees the program as the caller (its namespace, its `DT_RPATH` for a bare
//! name), as without the preload. Only paths with a slash can be kura paths here; a bare name
//! found through `LD_LIBRARY_PATH` or an absolute `RUNPATH` into the mount is not (`kura fs
//! run --fuse` covers them).

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use kura_fs::sync::Mutex;

use crate::hooks::{active, guard, raw};
use crate::paths::{Target, classify};
use crate::state::State;

/// libc's `dlopen`, found at the first call (not exported: the jump reaches it relative to
/// the instruction).
static KURA_REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);

/// Bytes copied per read while making a host copy.
const COPY_CHUNK_BYTES: usize = 1 << 20;

/// The host copies made by this process, by inode: their paths live as long as the process
/// (libc keeps its own copy of a loaded library's name, but a path handed to it must outlive
/// the call, and the same library is usually opened again).
#[derive(Default)]
pub struct HostCopies(Mutex<HashMap<u64, CString>>);

/// The program's `dlopen`: [`dlopen_path`] picks the path, then libc's `dlopen` runs as if
/// called by the program.
///
/// # Safety
/// As libc's `dlopen`.
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    // Entry: rsp = 8 mod 16 (the caller's return address). Keep `mode` (rsi) across the call,
    // which also aligns the stack; the path comes back in rax; then a jump, not a call, so
    // libc's dlopen finds the program's return address where its own would be.
    core::arch::naked_asm!(
        "push rsi",
        "call {decide}",
        "pop rsi",
        "mov rdi, rax",
        "jmp qword ptr [rip + {real}]",
        decide = sym dlopen_path,
        real = sym KURA_REAL_DLOPEN,
    )
}

/// The path libc's `dlopen` gets: a host copy for a kura library, else the caller's.
extern "C" fn dlopen_path(file: *const c_char) -> *const c_char {
    if KURA_REAL_DLOPEN.load(Ordering::Acquire) == 0 {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the definition after ours.
        let real = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlopen".as_ptr()) };
        KURA_REAL_DLOPEN.store(real as usize, Ordering::Release);
    }
    if file.is_null() {
        return file;
    }
    guard(file, || host_copy(file).unwrap_or(file))
}

fn host_copy(file: *const c_char) -> Option<*const c_char> {
    let state = active()?;
    // SAFETY: the caller's NUL-terminated path.
    let path = unsafe { std::ffi::CStr::from_ptr(file) }.to_bytes();
    if !path.contains(&b'/') || crate::exec::kernel_sees_mount(state) {
        return None;
    }
    let Ok(Target::Kura { abs, .. }) = classify(state, libc::AT_FDCWD, path) else { return None };
    // Through the hooks: the kura file.
    // SAFETY: the caller's path; flags.
    let fd = unsafe { libc::open(file, libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let copy = copy_of(state, fd);
    // SAFETY: our descriptor (through the hooks, a kura one).
    unsafe { libc::close(fd) };
    let (copy, ino) = copy?;
    load_dependencies_in_the_mount(copy, ino, &abs);
    Some(copy)
}

thread_local! {
    /// Libraries being loaded by [`load_dependencies_in_the_mount`] on this thread (a cycle of
    /// dependencies ends at the first repeat) and how deep.
    static LOADING: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Dependencies loaded ahead of a library, nested at most this deep.
const DEPENDENCY_DEPTH_MAX: usize = 16;

/// Before the loader maps the copy of kura library `abs`: every `DT_NEEDED` library that its
/// run path finds through `$ORIGIN` in the mount is loaded first (through this `dlopen`, so
/// from its own host copy), and the loader then finds it loaded under its name (its
/// `DT_SONAME`), as numpy's extensions find the libraries in `numpy.libs`. A name the run path
/// finds first in a host directory is the loader's. Each library loaded this way stays loaded.
fn load_dependencies_in_the_mount(copy: *const c_char, ino: u64, abs: &[u8]) {
    let entered = LOADING.with(|l| {
        let mut l = l.borrow_mut();
        if l.contains(&ino) || l.len() >= DEPENDENCY_DEPTH_MAX {
            return false;
        }
        l.push(ino);
        true
    });
    if !entered {
        return;
    }
    if let Some(needs) = HostMap::of(copy).and_then(|map| kura_fs::elf::dynamic_needs(map.bytes())) {
        let origin = &abs[..abs.iter().rposition(|&b| b == b'/').unwrap_or(0).max(1)];
        for name in needs.needed.iter().filter(|n| !n.contains(&b'/')) {
            for dir in &needs.search {
                let (mut candidate, in_mount) = match kura_fs::elf::expand_origin(dir, origin) {
                    Some(expanded) => (expanded, true),
                    None => (dir.clone(), false),
                };
                candidate.push(b'/');
                candidate.extend_from_slice(name);
                candidate.push(0);
                if !in_mount {
                    if host_file_exists(&candidate) {
                        break; // the loader finds it there
                    }
                    continue;
                }
                // Through the hooks: a kura path (or a host one, if `..` led out of the mount).
                // SAFETY: a NUL-terminated path we own.
                if unsafe { libc::access(candidate.as_ptr().cast(), libc::F_OK) } == 0 {
                    // SAFETY: our own dlopen with a NUL-terminated path; the handle is kept.
                    unsafe { dlopen(candidate.as_ptr().cast(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
                    break;
                }
            }
        }
    }
    LOADING.with(|l| l.borrow_mut().pop());
}

/// A host file mapped read-only, for reading its ELF headers without copying the library
/// (numpy's OpenBLAS is tens of megabytes; the loader reads a few pages of it).
struct HostMap {
    addr: *mut libc::c_void,
    len: usize,
}

impl HostMap {
    /// `path` (NUL-terminated) mapped whole; `None` for an empty file, one larger than
    /// [`kura_fs::elf::ELF_BYTES_MAX`], or an error.
    fn of(path: *const c_char) -> Option<Self> {
        // SAFETY: NUL-terminated path; flags.
        let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path, libc::O_RDONLY | libc::O_CLOEXEC) } as c_int;
        if fd < 0 {
            return None;
        }
        // SAFETY: a zeroed stat is a valid value; fstat writes only into it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: our descriptor and a writable struct.
        let sized = unsafe { crate::raw_syscall!(libc::SYS_fstat, fd, &mut st as *mut libc::stat) } == 0;
        let len = usize::try_from(st.st_size).unwrap_or(0);
        let addr = if sized && len > 0 && len <= kura_fs::elf::ELF_BYTES_MAX {
            // SAFETY: a new private read-only mapping of our descriptor (the system call: the
            // hooked mmap is for kura descriptors).
            unsafe { crate::raw_syscall!(libc::SYS_mmap, std::ptr::null_mut::<libc::c_void>(), len, libc::PROT_READ, libc::MAP_PRIVATE, fd, 0 as libc::off_t) as *mut libc::c_void }
        } else {
            libc::MAP_FAILED
        };
        raw::close(fd);
        (addr != libc::MAP_FAILED).then_some(Self { addr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` readable bytes are mapped at `addr` until drop.
        unsafe { std::slice::from_raw_parts(self.addr.cast::<u8>(), self.len) }
    }
}

impl Drop for HostMap {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping, which nothing refers to afterwards.
        unsafe { crate::raw_syscall!(libc::SYS_munmap, self.addr, self.len) };
    }
}

fn host_file_exists(path: &[u8]) -> bool {
    // SAFETY: a NUL-terminated path.
    unsafe { crate::raw_syscall!(libc::SYS_faccessat, libc::AT_FDCWD, path.as_ptr(), libc::F_OK) == 0 }
}

/// The host copy of kura descriptor `fd`'s file, made or refreshed, and the file's inode.
fn copy_of(state: &State, fd: c_int) -> Option<(*const c_char, u64)> {
    // SAFETY: a zeroed stat is a valid value; fstat (hooked) writes it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return None;
    }
    let (_, target) = crate::fds::host_file_path(st.st_ino, kura_fs::host_files::LIBRARY);
    if !current(&target, &st) {
        refresh(fd, &target, &st)?;
    }
    let mut copies = state.dl_copies.0.lock();
    // The CString's heap buffer does not move when the map grows.
    let path = copies.entry(st.st_ino).or_insert_with(|| CString::from_vec_with_nul(target).expect("one NUL at the end"));
    Some((path.as_ptr(), st.st_ino))
}

/// Whether `target` (NUL-terminated) is this user's copy of a file with `st`'s size and mtime
/// that nobody else may write.
fn current(target: &[u8], st: &libc::stat) -> bool {
    // SAFETY: a zeroed stat is a valid value; the raw stat writes it.
    let mut have: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: NUL-terminated path, a writable struct.
    let r = unsafe { crate::raw_syscall!(libc::SYS_newfstatat, libc::AT_FDCWD, target.as_ptr(), &mut have as *mut libc::stat, 0) };
    // SAFETY: geteuid touches no memory.
    let euid = unsafe { libc::geteuid() };
    r == 0
        && have.st_uid == euid
        && have.st_mode & 0o022 == 0
        && have.st_size == st.st_size
        && (have.st_mtime, have.st_mtime_nsec) == (st.st_mtime, st.st_mtime_nsec)
}

/// Writes the kura file into a temporary host file and renames it over `target`: a copy that
/// some process has mapped keeps its old contents.
fn refresh(fd: c_int, target: &[u8], st: &libc::stat) -> Option<()> {
    let mut tmp = target[..target.len() - 1].to_vec();
    tmp.extend_from_slice(format!(".{}.tmp\0", std::process::id()).as_bytes());
    // SAFETY: NUL-terminated path; flags and mode.
    let out = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, tmp.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0o755) } as c_int;
    if out < 0 {
        return None;
    }
    let copied = copy_all(fd, out);
    let times = [libc::timespec { tv_sec: st.st_mtime, tv_nsec: st.st_mtime_nsec }; 2];
    // SAFETY: our descriptor and two timespecs that live across the call.
    let stamped = unsafe { crate::raw_syscall!(libc::SYS_utimensat, out, std::ptr::null::<c_char>(), times.as_ptr(), 0) } == 0;
    raw::close(out);
    // SAFETY: NUL-terminated paths.
    if !(copied && stamped) || unsafe { crate::raw_syscall!(libc::SYS_renameat, libc::AT_FDCWD, tmp.as_ptr(), libc::AT_FDCWD, target.as_ptr()) } != 0 {
        // SAFETY: NUL-terminated path.
        unsafe { crate::raw_syscall!(libc::SYS_unlinkat, libc::AT_FDCWD, tmp.as_ptr(), 0) };
        return None;
    }
    Some(())
}

/// Copies `from` (read through the hooks from its start) into host descriptor `to`.
fn copy_all(from: c_int, to: c_int) -> bool {
    let mut buf = vec![0u8; COPY_CHUNK_BYTES];
    let mut offset: i64 = 0;
    loop {
        // SAFETY: reading into our buffer (pread: the hooked read of a kura descriptor).
        let n = unsafe { libc::pread(from, buf.as_mut_ptr().cast(), buf.len(), offset) };
        if n < 0 {
            return false;
        }
        if n == 0 {
            return true;
        }
        let mut done = 0usize;
        while done < n as usize {
            // SAFETY: writing our buffer's filled part to our host descriptor.
            let w = unsafe { crate::raw_syscall!(libc::SYS_write, to, buf[done..n as usize].as_ptr(), n as usize - done) };
            if w <= 0 {
                return false;
            }
            done += w as usize;
        }
        offset += n as i64;
    }
}
