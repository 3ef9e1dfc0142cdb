//! Unix-domain sockets named by paths in the mount.
//!
//! The kernel cannot make a socket file under the mount prefix (it knows no `/kura`), so for
//! an `AF_UNIX` address whose path is kura's:
//!
//! * `bind` creates an `S_IFSOCK` node there (mode `0777 & ~umask`, as the kernel makes it; an
//!   existing name is `EADDRINUSE`) and binds the socket to a Linux abstract-namespace name
//!   made of the file system's identity and the node's inode number
//!   (`"\0kura-sock/<identity>/<ino>"`): nothing is created on the host.
//! * `connect`, `sendto` and `sendmsg` find the node (following symlinks; write permission
//!   needed, as the kernel asks) and address that name instead: a kura file that is not a
//!   socket is `ECONNREFUSED`, a missing one `ENOENT`, as the kernel answers.
//! * `getsockname` and `getpeername` show the path again for names this process bound or
//!   connected to (the abstract name otherwise, e.g. after `exec`).
//!
//! The identity is a hash of the file system's name and the pool's URLs, so every process of
//! one `kura fs run` (and every run sharing its local server) meets at the same names, and
//! other pools on the host do not collide. Inode numbers are never reused, so a socket file
//! bound again after its `unlink` gets a fresh name, as with the kernel's inodes.
//!
//! Limits: abstract names belong to the network namespace and carry no permissions (a process
//! that knows the name can connect without write permission on the node); a socket bound
//! through the FUSE mount and one bound under the preload do not meet; `accept`, `recvfrom`
//! and `recvmsg` report a peer bound to a kura path by its abstract name. Other families,
//! unnamed and abstract addresses, and paths outside the mount go to the kernel untouched.

use std::collections::HashMap;
use std::ffi::{c_int, c_long, c_void};
use std::mem::{offset_of, size_of};

use kura_fs::path::Resolved;
use kura_fs::sync::{Mutex, MutexGuard};
use kura_fs::{Fs, FsError};

use crate::hooks::{active, cred, errno, fs_errno, guard, owner, resolve, ret, ret_int, umask_now, with_fs};
use crate::paths::{Target, USER_SPACE_END, classify};
use crate::state::State;

/// Where `sun_path` starts in a `sockaddr_un`.
const SUN_PATH_OFFSET: usize = offset_of!(libc::sockaddr_un, sun_path);
/// Room for the path (the kernel takes a path of exactly this many bytes without its NUL).
const SUN_PATH_BYTES: usize = size_of::<libc::sockaddr_un>() - SUN_PATH_OFFSET;
/// Every abstract name of a kura socket starts with this (after the leading NUL).
const NAME_TAG: &[u8] = b"kura-sock/";
/// Names remembered for `getsockname`/`getpeername`; past this the memory starts over.
const NAMES_MAX: usize = 4096;

/// The abstract-name prefix of the file system `fs_name` in the pool at `pool_urls`:
/// `"\0kura-sock/<16 hex digits>/"` (see [`fs_hash`]).
pub fn name_prefix(fs_name: &str, pool_urls: &[String]) -> Vec<u8> {
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(NAME_TAG);
    prefix.extend_from_slice(format!("{:016x}/", fs_hash(fs_name, pool_urls)).as_bytes());
    prefix
}

/// Names the file system `fs_name` in the pool at `pool_urls` on this host (its sockets'
/// names, its lock files): FNV-1a of the name and the sorted URLs, so that every build agrees.
pub fn fs_hash(fs_name: &str, pool_urls: &[String]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut urls: Vec<&str> = pool_urls.iter().map(String::as_str).collect();
    urls.sort_unstable();
    urls.dedup();
    let mut h = FNV_OFFSET;
    for part in std::iter::once(fs_name).chain(urls) {
        // A separator no name or URL contains, so ("ab", "c") and ("a", "bc") differ.
        for &b in part.as_bytes().iter().chain(&[0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
    }
    h
}

/// The paths this process bound or connected kura sockets to, by abstract name.
#[derive(Default)]
pub struct SocketNames {
    paths: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
}

impl SocketNames {
    fn remember(&self, name: Vec<u8>, path: &[u8]) {
        let mut paths = self.paths.lock();
        if paths.len() >= NAMES_MAX && !paths.contains_key(&name) {
            paths.clear();
        }
        paths.insert(name, path.to_vec());
    }

    fn path_of(&self, name: &[u8]) -> Option<Vec<u8>> {
        self.paths.lock().get(name).cloned()
    }

    /// Locks the names for `fork` until the result drops (in the parent and in the child).
    pub fn lock_for_fork(&self) -> SocketNamesForkLock<'_> {
        SocketNamesForkLock { _paths: self.paths.lock() }
    }
}

/// The socket names' lock, held across `fork` (see [`SocketNames::lock_for_fork`]).
pub struct SocketNamesForkLock<'a> {
    _paths: MutexGuard<'a, HashMap<Vec<u8>, Vec<u8>>>,
}

/// An address to give the kernel in place of the caller's.
struct Addr {
    sun: libc::sockaddr_un,
    len: libc::socklen_t,
}

impl Addr {
    /// `bytes` in `sun_path`: an abstract name (leading NUL, no terminator) or a path (NUL
    /// added when there is room, as the kernel accepts a full `sun_path` without one).
    fn new(bytes: &[u8]) -> Result<Self, i32> {
        if bytes.len() > SUN_PATH_BYTES {
            return Err(libc::ENAMETOOLONG);
        }
        // SAFETY: sockaddr_un is plain data; all-zero is a valid one.
        let mut sun: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (dst, &src) in sun.sun_path.iter_mut().zip(bytes) {
            *dst = src as libc::c_char;
        }
        let is_abstract = bytes.first() == Some(&0);
        let used = if is_abstract { bytes.len() } else { (bytes.len() + 1).min(SUN_PATH_BYTES) };
        Ok(Self { sun, len: (SUN_PATH_OFFSET + used) as libc::socklen_t })
    }

    fn ptr(&self) -> *const libc::sockaddr {
        (&raw const self.sun).cast()
    }
}

/// The path of an `AF_UNIX` address, as the kernel reads it (up to `len` or the first NUL);
/// `None` for any other address: another family, unnamed (autobind), abstract, longer than a
/// `sockaddr_un` (the kernel's `EINVAL`), or not a readable pointer (the kernel's `EFAULT`).
///
/// # Safety
/// `addr` is NULL or points to `len` readable bytes (the socket calls' contract).
unsafe fn unix_path<'a>(addr: *const libc::sockaddr, len: libc::socklen_t) -> Option<&'a [u8]> {
    let len = len as usize;
    if addr.is_null() || addr as usize >= USER_SPACE_END || len <= SUN_PATH_OFFSET || len > size_of::<libc::sockaddr_un>() {
        return None;
    }
    // SAFETY: the caller's `len` bytes, at least the family and one byte of `sun_path`.
    let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) };
    let family = libc::sa_family_t::from_ne_bytes([bytes[0], bytes[1]]);
    let path = &bytes[SUN_PATH_OFFSET..];
    if c_int::from(family) != libc::AF_UNIX || path[0] == 0 {
        return None;
    }
    Some(path.iter().position(|&b| b == 0).map_or(path, |end| &path[..end]))
}

/// Whether `fd` is an `AF_UNIX` socket (`false` for anything else, a bad descriptor
/// included: the kernel gives those their errors without touching a path).
fn is_unix_socket(fd: c_int) -> bool {
    let mut domain: c_int = 0;
    let mut len = size_of::<c_int>() as libc::socklen_t;
    // SAFETY: an int-sized option into our own int.
    let r = unsafe { crate::raw_syscall!(libc::SYS_getsockopt, fd, libc::SOL_SOCKET, libc::SO_DOMAIN, &raw mut domain, &raw mut len) };
    r == 0 && domain == libc::AF_UNIX
}

/// Whether `fd` (a socket) has an address already.
fn is_bound(fd: c_int) -> Result<bool, i32> {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid one.
    let mut sun: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: our own buffer and its length.
    let r = unsafe { crate::raw_syscall!(libc::SYS_getsockname, fd, &raw mut sun, &raw mut len) };
    if r < 0 { Err(errno()) } else { Ok(len as usize > size_of::<libc::sa_family_t>()) }
}

/// The abstract name of kura socket `ino` (leading NUL included).
fn abstract_name(state: &State, ino: u64) -> Vec<u8> {
    let mut name = state.sock_prefix.clone();
    name.extend_from_slice(ino.to_string().as_bytes());
    name
}

/// What a socket call does with an `AF_UNIX` address.
enum Route {
    /// The caller's address, untouched.
    Kernel,
    /// This address instead (a path outside the mount, or a kura socket's abstract name).
    Addr(Addr),
}

fn raw_bind(fd: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    // SAFETY: the address is the caller's or ours, with its length.
    unsafe { crate::raw_syscall!(libc::SYS_bind, fd, addr, len) as c_int }
}

fn raw_connect(fd: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    // SAFETY: as above.
    unsafe { crate::raw_syscall!(libc::SYS_connect, fd, addr, len) as c_int }
}

/// Binds `fd` at kura path `rel` (from directory `start`): a new socket node and its
/// abstract name. `Ok(Some(addr))`: a symlink led outside the mount; the kernel binds there.
fn kura_bind(state: &State, fs: &Fs, fd: c_int, start: u64, rel: &[u8], path: &[u8]) -> Result<Option<Addr>, i32> {
    let (parent, name) = match crate::hooks::resolve_parent(state, fs, start, rel, false)? {
        // The kernel's EEXIST from creating the file, reported as a socket's error.
        Resolved::Found { .. } => return Err(libc::EADDRINUSE),
        Resolved::Outside(abs) => return Addr::new(&abs).map(Some),
        Resolved::Missing { parent, name } => (parent, name),
    };
    cred().check_create(&fs.getattr_fresh(parent).map_err(fs_errno)?).map_err(fs_errno)?;
    if is_bound(fd)? {
        return Err(libc::EINVAL);
    }
    let mode = libc::S_IFSOCK | (0o777 & !umask_now());
    let (inode, _) = fs.create(parent, &name, mode, 0, b"", owner(), true).map_err(|e| match e {
        FsError::Exists => libc::EADDRINUSE,
        e => fs_errno(e),
    })?;
    let sock_name = abstract_name(state, inode.ino);
    let addr = Addr::new(&sock_name)?;
    if raw_bind(fd, addr.ptr(), addr.len) < 0 {
        let e = errno();
        // Nothing may be left behind by a bind that failed (the kernel unlinks it too).
        let _ = fs.unlink(parent, &name);
        return Err(e);
    }
    state.sock_names.remember(sock_name, path);
    Ok(None)
}

/// The address a `connect` or `sendto` to kura path `rel` goes to.
fn kura_peer(state: &State, fs: &Fs, start: u64, rel: &[u8], path: &[u8]) -> Result<Addr, i32> {
    let entry = match resolve(state, fs, start, rel, true)? {
        Resolved::Found { entry, .. } => entry,
        Resolved::Missing { .. } => return Err(libc::ENOENT),
        Resolved::Outside(abs) => return Addr::new(&abs),
    };
    let inode = fs.getattr(entry.ino).map_err(fs_errno)?;
    // The kernel's order (`unix_find_bsd`): write permission, then the file type.
    cred().check_access(&inode, kura_fs::ns::MAY_WRITE).map_err(fs_errno)?;
    if kura_fs::layout::file_type(inode.mode) != libc::S_IFSOCK {
        return Err(libc::ECONNREFUSED);
    }
    let sock_name = abstract_name(state, inode.ino);
    let addr = Addr::new(&sock_name)?;
    state.sock_names.remember(sock_name, path);
    Ok(addr)
}

/// Where a `connect`, `sendto` or `sendmsg` to `addr` goes: the kernel's address, another
/// one, or (`Err`) nowhere.
///
/// # Safety
/// `addr` is NULL or points to `len` readable bytes.
unsafe fn peer_route(fd: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> Result<Route, i32> {
    let Some(state) = active() else { return Ok(Route::Kernel) };
    // SAFETY: the caller's promise.
    let Some(path) = (unsafe { unix_path(addr, len) }) else { return Ok(Route::Kernel) };
    match classify(state, libc::AT_FDCWD, path)? {
        Target::Kernel => Ok(Route::Kernel),
        Target::KernelAbs(abs) => Addr::new(&abs[..abs.len() - 1]).map(Route::Addr),
        Target::Kura { start, rel, .. } => {
            if !is_unix_socket(fd) {
                return Ok(Route::Kernel);
            }
            with_fs(state, |fs| kura_peer(state, fs, start, &rel, path)).map(Route::Addr)
        }
    }
}

pub extern "C" fn h_bind(fd: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    guard(-1, || {
        let Some(state) = active() else { return raw_bind(fd, addr, len) };
        // SAFETY: the caller's address of `len` bytes (bind's contract).
        let Some(path) = (unsafe { unix_path(addr, len) }) else { return raw_bind(fd, addr, len) };
        let route = match classify(state, libc::AT_FDCWD, path) {
            Err(e) => Err(e),
            Ok(Target::Kernel) => Ok(Route::Kernel),
            Ok(Target::KernelAbs(abs)) => Addr::new(&abs[..abs.len() - 1]).map(Route::Addr),
            // Another family's socket: the kernel refuses the address without making a file.
            Ok(Target::Kura { .. }) if !is_unix_socket(fd) => Ok(Route::Kernel),
            Ok(Target::Kura { start, rel, .. }) => match with_fs(state, |fs| kura_bind(state, fs, fd, start, &rel, path)) {
                Ok(None) => return 0,
                Ok(Some(outside)) => Ok(Route::Addr(outside)),
                Err(e) => Err(e),
            },
        };
        match route {
            Ok(Route::Kernel) => raw_bind(fd, addr, len),
            Ok(Route::Addr(a)) => raw_bind(fd, a.ptr(), a.len),
            Err(e) => ret_int(Err(e)),
        }
    })
}

pub extern "C" fn h_connect(fd: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    guard(-1, || {
        // SAFETY: the caller's address of `len` bytes (connect's contract).
        match unsafe { peer_route(fd, addr, len) } {
            Ok(Route::Kernel) => raw_connect(fd, addr, len),
            // Outside `with_fs`: a connect may wait for the listener's backlog.
            Ok(Route::Addr(a)) => raw_connect(fd, a.ptr(), a.len),
            Err(e) => ret_int(Err(e)),
        }
    })
}

pub extern "C" fn h_sendto(fd: c_int, buf: *const c_void, n: usize, flags: c_int, addr: *const libc::sockaddr, len: libc::socklen_t) -> isize {
    guard(-1, || {
        let raw_call = |addr: *const libc::sockaddr, len: libc::socklen_t| {
            // SAFETY: the caller's buffer, flags and address (or ours, with its length).
            unsafe { crate::raw_syscall!(libc::SYS_sendto, fd, buf, n, flags, addr, len) as isize }
        };
        // SAFETY: the caller's address of `len` bytes (sendto's contract).
        match unsafe { peer_route(fd, addr, len) } {
            Ok(Route::Kernel) => raw_call(addr, len),
            Ok(Route::Addr(a)) => raw_call(a.ptr(), a.len),
            Err(e) => ret(Err(e)) as isize,
        }
    })
}

pub extern "C" fn h_sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> isize {
    guard(-1, || {
        let raw_call = |msg: *const libc::msghdr| {
            // SAFETY: the caller's message (or a copy naming our address instead).
            unsafe { crate::raw_syscall!(libc::SYS_sendmsg, fd, msg, flags) as isize }
        };
        if msg.is_null() || msg as usize >= USER_SPACE_END {
            return raw_call(msg);
        }
        // SAFETY: a non-NULL message header in user space (sendmsg's contract).
        let header = unsafe { &*msg };
        // SAFETY: the header's address of `msg_namelen` bytes (sendmsg's contract).
        match unsafe { peer_route(fd, header.msg_name.cast_const().cast(), header.msg_namelen) } {
            Ok(Route::Kernel) => raw_call(msg),
            Ok(Route::Addr(a)) => {
                // SAFETY: msghdr is plain data: a copy with our address in place of the caller's.
                let mut copy: libc::msghdr = unsafe { std::ptr::read(msg) };
                copy.msg_name = a.ptr().cast_mut().cast();
                copy.msg_namelen = a.len;
                raw_call(&raw const copy)
            }
            Err(e) => ret(Err(e)) as isize,
        }
    })
}

/// `getsockname`/`getpeername` (`call`): the kernel's answer, with the path in place of a kura
/// socket's abstract name when this process knows it.
fn name_call(call: c_long, fd: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int {
    let raw_call = || {
        // SAFETY: passing the caller's buffer and length to the kernel.
        unsafe { crate::raw_syscall!(call, fd, addr, len) as c_int }
    };
    let Some(state) = active() else { return raw_call() };
    if addr.is_null() || len.is_null() || addr as usize >= USER_SPACE_END || len as usize >= USER_SPACE_END {
        return raw_call();
    }
    // SAFETY: a non-NULL length in user space (the calls' contract: the buffer's room).
    let room = unsafe { *len } as usize;
    let r = raw_call();
    // SAFETY: the kernel just wrote the name's full length there.
    let full = unsafe { *len } as usize;
    // A name of ours is short: one the caller's room truncated is left as it is.
    if r < 0 || full > room || full <= SUN_PATH_OFFSET + 1 || full > size_of::<libc::sockaddr_un>() {
        return r;
    }
    // SAFETY: the kernel wrote `full` bytes of the name into the caller's buffer.
    let written = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), full) };
    let family = libc::sa_family_t::from_ne_bytes([written[0], written[1]]);
    let name = &written[SUN_PATH_OFFSET..];
    if c_int::from(family) != libc::AF_UNIX || !name.starts_with(&state.sock_prefix) {
        return r;
    }
    let Some(path) = state.sock_names.path_of(name) else { return r };
    let Ok(out) = Addr::new(&path) else { return r };
    // SAFETY: the caller's buffer holds `room` bytes; as the kernel does, at most that much of
    // the name goes there, and its full length to `len`.
    unsafe {
        std::ptr::copy_nonoverlapping((&raw const out.sun).cast::<u8>(), addr.cast::<u8>(), (out.len as usize).min(room));
        *len = out.len;
    }
    r
}

pub extern "C" fn h_getsockname(fd: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int {
    guard(-1, || name_call(libc::SYS_getsockname, fd, addr, len))
}

pub extern "C" fn h_getpeername(fd: c_int, addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> c_int {
    guard(-1, || name_call(libc::SYS_getpeername, fd, addr, len))
}
