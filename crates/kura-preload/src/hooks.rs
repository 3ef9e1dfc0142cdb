//! The handlers patched over libc's functions. Each one: kura descriptor or path → the file
//! system; anything else → the kernel, by raw system call (never the patched original).
//! Every handler catches panics (a bug here must not unwind into C) and reports them as EIO.

use std::ffi::{c_char, c_int, c_long, c_uint, c_void};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use kura_fs::path::{Follow, Resolved};
use kura_fs::{Fs, FsError, Inode, Owner, RenameFlags, SetAttr, WriteMode};

use crate::fds::{self, OpenFile, create_placeholder};
use crate::paths::{Target, bytes, c_path, classify};
use crate::state::{self, Busy, State};

mod by_number;

/// fchmodat2(2), Linux 6.6 (not yet in the libc crate).
const SYS_FCHMODAT2: c_long = 452;
/// `st_dev` of every kura file.
const KURA_DEV_MAJOR: u32 = 0;
const KURA_DEV_MINOR: u32 = 0x6b75;
/// Bytes copied per step when emulating `copy_file_range`/`sendfile`.
const COPY_STEP_BYTES: usize = 128 << 10;
/// `getcwd(NULL, 0)` allocates this much at most.
const CWD_BYTES_MAX: usize = 4096;

/// Raw system calls (the kernel's answer; -1 and errno on failure, see [`crate::sys`]).
pub mod raw {
    use std::ffi::{c_long, c_void};

    pub fn close(fd: i32) {
        // SAFETY: close takes an integer.
        unsafe { crate::raw_syscall!(libc::SYS_close, fd) };
    }

    fn res(r: c_long) -> Result<c_long, i32> {
        if r < 0 { Err(super::errno()) } else { Ok(r) }
    }

    pub fn memfd_create(name: &[u8], flags: u32) -> Result<i32, i32> {
        debug_assert_eq!(name.last(), Some(&0));
        // SAFETY: name is NUL-terminated.
        res(unsafe { crate::raw_syscall!(libc::SYS_memfd_create, name.as_ptr(), flags) }).map(|fd| fd as i32)
    }

    pub fn ftruncate(fd: i32, len: i64) -> Result<(), i32> {
        // SAFETY: integers only.
        res(unsafe { crate::raw_syscall!(libc::SYS_ftruncate, fd, len) }).map(|_| ())
    }

    pub fn fcntl(fd: i32, cmd: i32, arg: c_long) -> Result<i32, i32> {
        // SAFETY: the commands used here take integer arguments.
        res(unsafe { crate::raw_syscall!(libc::SYS_fcntl, fd, cmd, arg) }).map(|r| r as i32)
    }

    pub fn mmap_shared(fd: i32, len: usize) -> Result<*mut c_void, i32> {
        // SAFETY: a new shared mapping of `fd`; the kernel picks the address.
        let p = unsafe { crate::raw_syscall!(libc::SYS_mmap, 0usize, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0i64) };
        if (p as isize) < 0 && (p as isize) > -4096 { Err(-(p as isize) as i32) } else if p == -1 { Err(super::errno()) } else { Ok(p as *mut c_void) }
    }

    /// # Safety
    /// `addr..addr+len` must be a mapping nothing uses any more.
    pub unsafe fn munmap(addr: *mut c_void, len: usize) {
        // SAFETY: the caller's promise.
        unsafe { crate::raw_syscall!(libc::SYS_munmap, addr, len) };
    }

    /// The kernel's `stat` of `fd`.
    pub fn fstat(fd: i32) -> Result<libc::stat, i32> {
        // SAFETY: a zeroed stat is a valid value; fstat writes only into it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is writable and lives across the call.
        res(unsafe { crate::raw_syscall!(libc::SYS_fstat, fd, &mut st as *mut libc::stat) })?;
        Ok(st)
    }

    /// The kernel's `(st_dev, st_ino)` of `fd`.
    pub fn fstat_id(fd: i32) -> Result<(u64, u64), i32> {
        fstat(fd).map(|st| (st.st_dev, st.st_ino))
    }

    /// The kernel's `(st_dev, st_ino)` of the file at `path` (NUL-terminated).
    pub fn stat_id(path: &[u8]) -> Result<(u64, u64), i32> {
        debug_assert_eq!(path.last(), Some(&0));
        // SAFETY: a zeroed stat is a valid value; fstatat writes only into it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: path is NUL-terminated; `st` is writable and lives across the call.
        res(unsafe { crate::raw_syscall!(libc::SYS_newfstatat, libc::AT_FDCWD, path.as_ptr(), &mut st as *mut libc::stat, 0) })?;
        Ok((st.st_dev, st.st_ino))
    }

    pub fn readlink(path: &[u8], buf: &mut [u8]) -> Result<usize, i32> {
        debug_assert_eq!(path.last(), Some(&0));
        // SAFETY: path is NUL-terminated; buf is writable for its length.
        res(unsafe { crate::raw_syscall!(libc::SYS_readlinkat, libc::AT_FDCWD, path.as_ptr(), buf.as_mut_ptr(), buf.len()) }).map(|n| n as usize)
    }
}

pub fn errno() -> i32 {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() }
}

pub(crate) fn set_errno(e: i32) {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = e };
}

/// Writes `msg` to stderr (raw, so it never re-enters the hooks).
pub fn complain(msg: &str) {
    if std::env::var_os("KURA_FS_QUIET").is_some() {
        return;
    }
    let line = format!("{msg}\n");
    // SAFETY: writing our own buffer to fd 2.
    unsafe { crate::raw_syscall!(libc::SYS_write, 2, line.as_ptr(), line.len()) };
}

pub(crate) fn fs_errno(e: FsError) -> i32 {
    if matches!(e, FsError::Io(_) | FsError::Corrupt { .. }) && std::env::var_os("KURA_FS_DEBUG").is_some() {
        complain(&format!("libkura_fs: {e}"));
    }
    e.errno()
}

/// -1 with errno, or the value.
pub(crate) fn ret(r: Result<c_long, i32>) -> c_long {
    match r {
        Ok(v) => v,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

pub(crate) fn ret_int(r: Result<c_int, i32>) -> c_int {
    ret(r.map(c_long::from)) as c_int
}

/// Runs a hook body, catching panics (EIO).
pub(crate) fn guard<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(_) => {
            set_errno(libc::EIO);
            on_panic
        }
    }
}

/// The state when hooks are active and this thread is not inside kura code.
#[inline]
pub(crate) fn active() -> Option<&'static State> {
    let s = state::get()?;
    if state::busy() || !s.active.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    Some(s)
}

/// Runs `f` with the file system (as kura code: nested libc calls go to the kernel), inside
/// the fork gate (a `fork` waits for it to finish).
pub(crate) fn with_fs<T>(state: &State, f: impl FnOnce(&Arc<Fs>) -> Result<T, i32>) -> Result<T, i32> {
    let _call = state.enter_call();
    let fs = state.fs().map_err(fs_errno)?;
    f(fs)
}

/// The caller's credentials, for the permission checks the kernel would make.
pub(crate) fn cred() -> kura_fs::ns::Cred {
    const GROUPS_MAX: usize = 256;
    let mut groups = vec![0u32; GROUPS_MAX];
    // SAFETY: getgroups writes at most GROUPS_MAX ids into the buffer; the id getters cannot fail.
    unsafe {
        let n = libc::getgroups(GROUPS_MAX as c_int, groups.as_mut_ptr());
        groups.truncate(n.max(0) as usize);
        kura_fs::ns::Cred { uid: libc::geteuid(), gid: libc::getegid(), groups }
    }
}

/// The caller's credentials when it is not root: the permission checks root would pass are
/// skipped, and with them the inode reads they need.
pub(crate) fn cred_unless_root() -> Option<kura_fs::ns::Cred> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 { None } else { Some(cred()) }
}

/// May the caller add an entry to directory `parent` (write and search on it)? `EACCES`.
fn check_create_in(fs: &Fs, parent: u64) -> Result<(), i32> {
    let Some(cred) = cred_unless_root() else { return Ok(()) };
    cred.check_create(&fs.getattr_fresh(parent).map_err(fs_errno)?).map_err(fs_errno)
}

/// May the caller open `inode` with open(2)'s `flags`? Read for `O_RDONLY`/`O_RDWR`, write for
/// `O_WRONLY`/`O_RDWR` and for `O_TRUNC` (the kernel's `may_open`). `EACCES`.
fn check_open(inode: &Inode, flags: c_int) -> Result<(), i32> {
    let Some(cred) = cred_unless_root() else { return Ok(()) };
    let accmode = flags & libc::O_ACCMODE;
    let mut mask = 0;
    if accmode != libc::O_WRONLY {
        mask |= kura_fs::ns::MAY_READ;
    }
    if accmode != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
        mask |= kura_fs::ns::MAY_WRITE;
    }
    cred.check_access(inode, mask).map_err(fs_errno)
}

pub(crate) fn owner() -> Owner {
    // SAFETY: geteuid/getegid cannot fail.
    unsafe { Owner { uid: libc::geteuid(), gid: libc::getegid() } }
}

pub(crate) fn umask_now() -> u32 {
    // SAFETY: umask takes and returns integers; the old mask is put back at once.
    unsafe {
        let m = crate::raw_syscall!(libc::SYS_umask, 0);
        crate::raw_syscall!(libc::SYS_umask, m);
        m as u32
    }
}

/// The node of an open regular file (opened now if this process inherited the descriptor).
#[inline]
fn node_of<'a>(fs: &Arc<Fs>, of: &'a OpenFile) -> Result<&'a Arc<kura_fs::Node>, i32> {
    match of.node() {
        Some(n) => Ok(n),
        None => open_node_of(fs, of),
    }
}

#[cold]
fn open_node_of<'a>(fs: &Arc<Fs>, of: &'a OpenFile) -> Result<&'a Arc<kura_fs::Node>, i32> {
    no_io(of)?;
    let inode = fs.getattr_open(of.ino).map_err(fs_errno)?;
    let node = fs.open_node(&inode).map_err(|e| fs_errno(e.gone_is_stale()))?;
    Ok(of.set_node(node))
}

/// Sets the attributes every descriptor of this process keeps of the directory `inode` names,
/// for when it is removed (or, removed, changed): they show in `fstat` until the last close.
fn keep_dir_attributes(state: &State, inode: &Inode) {
    for of in state.fds.read_guard().iter().flatten().filter(|of| of.is_dir && of.ino == inode.ino) {
        *of.dir_inode.lock() = Some(inode.clone());
    }
}

/// The inode of an open descriptor. A directory removed while open stays, as on Linux, a
/// directory with no links (its record went at `rmdir`): its inode as last read, nlink 0.
fn open_inode(fs: &Fs, of: &OpenFile) -> Result<Inode, i32> {
    match fs.getattr_open(of.ino) {
        Ok(inode) if of.is_dir => {
            *of.dir_inode.lock() = Some(inode.clone());
            Ok(inode)
        }
        Err(FsError::Stale) if of.is_dir => {
            let mut inode = of.dir_inode.lock().clone().ok_or(libc::ESTALE)?;
            inode.nlink = 0;
            Ok(inode)
        }
        other => other.map_err(fs_errno),
    }
}

/// Resolves a kura target.
pub(crate) fn resolve(state: &State, fs: &Fs, start: u64, rel: &[u8], follow_last: bool) -> Result<Resolved, i32> {
    let searcher = cred_unless_root();
    fs.resolve(start, rel, Follow { last: follow_last, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)
}

/// [`resolve`], following the last name, and the absolute path of what it found, for the
/// working directory: the physical path the walk took, symbolic links followed (`l/..` with
/// `l` a link to `a/b` is `a`), as `getcwd` says after `chdir`. Only a walk from the root can
/// tell it; from a directory descriptor `abs` (lexical) stands.
pub(crate) fn resolve_with_path(state: &State, fs: &Fs, start: u64, rel: &[u8], abs: &[u8]) -> Result<(Resolved, Vec<u8>), i32> {
    if start != kura_fs::ROOT_INO {
        let lexical = abs.strip_suffix(b"/").filter(|a| !a.is_empty()).unwrap_or(abs).to_vec();
        return Ok((resolve(state, fs, start, rel, true)?, lexical));
    }
    let searcher = cred_unless_root();
    let (resolved, names) = fs.resolve_physical(rel, Follow { last: true, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)?;
    Ok((resolved, mount_path(state, &names)))
}

/// The absolute path of the names walked from the mount's root.
fn mount_path(state: &State, names: &[Vec<u8>]) -> Vec<u8> {
    let mut path = state.mount.clone();
    for name in names {
        path.push(b'/');
        path.extend_from_slice(name);
    }
    path
}

/// Resolves a kura target and reads the inode it names. Another process may replace or remove
/// the name between the lookup and the read (a rename over it drops the old inode): the path
/// is then resolved again, so that a reader sees the old file or the new one, never `ENOENT`
/// for a name that always existed. The inode comes with `Found` and only with it.
pub(crate) fn resolve_inode(state: &State, fs: &Fs, start: u64, rel: &[u8], follow_last: bool) -> Result<(Resolved, Option<Inode>), i32> {
    let searcher = cred_unless_root();
    fs.resolve_inode(start, rel, Follow { last: follow_last, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)
}

/// [`resolve_inode`] for a change to the path's last name: the walk also reads the last
/// directory's inode, for the permission checks and the change ([`Fs::resolve_for_change`]).
pub(crate) fn resolve_for_change(state: &State, fs: &Fs, start: u64, rel: &[u8], follow_last: bool) -> Result<(Resolved, Option<Inode>), i32> {
    let searcher = cred_unless_root();
    fs.resolve_for_change(start, rel, Follow { last: follow_last, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)
}

/// [`resolve`] for a new name: the walk also reads the last directory's inode, for the
/// permission check and the create ([`Fs::resolve_parent`]). A missing name with a trailing
/// slash asks for a directory: ENOENT unless one is made (`dir`, for `mkdir`), as the
/// kernel's `filename_create`.
pub(crate) fn resolve_parent(state: &State, fs: &Fs, start: u64, rel: &[u8], dir: bool) -> Result<Resolved, i32> {
    let searcher = cred_unless_root();
    match fs.resolve_parent(start, rel, Follow { last: false, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)? {
        Resolved::Missing { .. } if !dir && rel.ends_with(b"/") => Err(libc::ENOENT),
        resolved => Ok(resolved),
    }
}

/// The inode that `parent/name` (looked up as `entry`) names, for the permission checks of a
/// removal or a rename. Another process may remove or replace the name between the lookup
/// and the read of its inode (the kernel holds the directory's lock here; the pool has none):
/// the name is then looked up again ([`Fs::lookup_inode`]). `None`: the name is gone.
fn victim_of(fs: &Fs, parent: u64, name: &[u8], entry: kura_fs::DirEntry, walked: Option<Inode>) -> Result<Option<Inode>, i32> {
    if let Some(inode) = walked.filter(|inode| inode.ino == entry.ino) {
        return Ok(Some(inode));
    }
    match fs.getattr(entry.ino) {
        Ok(inode) => Ok(Some(inode)),
        Err(FsError::NotFound) => Ok(fs.lookup_inode(parent, name).map_err(fs_errno)?.map(|(_, inode)| inode)),
        Err(e) => Err(fs_errno(e)),
    }
}

// ---------------------------------------------------------------------------------------
// stat

fn fill_stat(st: *mut libc::stat, inode: &Inode, chunk: usize) {
    // SAFETY: the caller's buffer is a struct stat; all-zero is a valid one.
    let s = unsafe { &mut *st };
    // SAFETY: as above.
    *s = unsafe { std::mem::zeroed() };
    s.st_dev = libc::makedev(KURA_DEV_MAJOR, KURA_DEV_MINOR);
    s.st_ino = inode.ino;
    s.st_nlink = u64::from(inode.nlink);
    s.st_mode = inode.mode;
    s.st_uid = inode.uid;
    s.st_gid = inode.gid;
    s.st_rdev = u64::from(inode.rdev);
    s.st_size = inode.size_bytes(chunk as u64) as i64;
    s.st_blksize = chunk as i64;
    s.st_blocks = inode.blocks(chunk as u64) as i64;
    s.st_atime = inode.atime_ns.div_euclid(1_000_000_000);
    s.st_atime_nsec = inode.atime_ns.rem_euclid(1_000_000_000);
    s.st_mtime = inode.mtime_ns.div_euclid(1_000_000_000);
    s.st_mtime_nsec = inode.mtime_ns.rem_euclid(1_000_000_000);
    s.st_ctime = inode.ctime_ns.div_euclid(1_000_000_000);
    s.st_ctime_nsec = inode.ctime_ns.rem_euclid(1_000_000_000);
}

fn fill_statx(st: *mut libc::statx, inode: &Inode, chunk: usize) {
    // SAFETY: the caller's buffer is a struct statx; all-zero is a valid one.
    let s = unsafe { &mut *st };
    // SAFETY: as above.
    *s = unsafe { std::mem::zeroed() };
    let ts = |ns: i64| {
        // SAFETY: statx_timestamp is plain data; all-zero is valid.
        let mut t: libc::statx_timestamp = unsafe { std::mem::zeroed() };
        t.tv_sec = ns.div_euclid(1_000_000_000);
        t.tv_nsec = ns.rem_euclid(1_000_000_000) as u32;
        t
    };
    s.stx_mask = libc::STATX_BASIC_STATS;
    s.stx_blksize = chunk as u32;
    s.stx_nlink = inode.nlink;
    s.stx_uid = inode.uid;
    s.stx_gid = inode.gid;
    s.stx_mode = inode.mode as u16;
    s.stx_ino = inode.ino;
    s.stx_size = inode.size_bytes(chunk as u64);
    s.stx_blocks = inode.blocks(chunk as u64);
    s.stx_atime = ts(inode.atime_ns);
    s.stx_mtime = ts(inode.mtime_ns);
    s.stx_ctime = ts(inode.ctime_ns);
    s.stx_btime = ts(inode.ctime_ns);
    s.stx_rdev_major = libc::major(u64::from(inode.rdev));
    s.stx_rdev_minor = libc::minor(u64::from(inode.rdev));
    s.stx_dev_major = KURA_DEV_MAJOR;
    s.stx_dev_minor = KURA_DEV_MINOR;
}

/// A kura inode with the chunk size, or (`Err`) the absolute path the kernel answers for.
type StatTarget = Result<(Inode, usize), Vec<u8>>;

/// The inode a stat-like call names: a kura descriptor (`AT_EMPTY_PATH`) or path. `Ok(None)`:
/// the kernel's.
fn stat_target(state: &State, dirfd: c_int, path: *const c_char, flags: c_int) -> Result<Option<StatTarget>, i32> {
    // SAFETY: libc's contract: path is NULL or NUL-terminated.
    let p = unsafe { bytes(path) };
    if p.is_none_or(<[u8]>::is_empty) {
        if flags & libc::AT_EMPTY_PATH != 0
            && let Some(of) = state.fds.get(dirfd)
        {
            return with_fs(state, |fs| Ok(Some(Ok((open_inode(fs, &of)?, fs.chunk_size_bytes())))));
        }
        return Ok(None);
    }
    let p = p.expect("checked");
    match classify(state, dirfd, p)? {
        Target::Kernel => Ok(None),
        Target::KernelAbs(abs) => Ok(Some(Err(abs))),
        Target::Kura { start, rel, .. } => with_fs(state, |fs| match resolve_inode(state, fs, start, &rel, flags & libc::AT_SYMLINK_NOFOLLOW == 0)? {
            (Resolved::Found { .. }, Some(inode)) => Ok(Some(Ok((inode, fs.chunk_size_bytes())))),
            (Resolved::Outside(abs), _) => Ok(Some(Err(c_path(&abs)))),
            (Resolved::Found { .. } | Resolved::Missing { .. }, _) => Err(libc::ENOENT),
        }),
    }
}

extern "C" fn h_fstatat(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |dirfd: c_int, path: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_newfstatat, dirfd, path, buf, flags) as c_int }
        };
        let Some(state) = active() else { return raw_call(dirfd, path) };
        match stat_target(state, dirfd, path, flags) {
            Ok(None) => raw_call(dirfd, path),
            Ok(Some(Err(abs))) => raw_call(libc::AT_FDCWD, abs.as_ptr().cast()),
            Ok(Some(Ok((inode, chunk)))) => {
                fill_stat(buf, &inode, chunk);
                0
            }
            Err(e) => ret_int(Err(e)),
        }
    })
}

extern "C" fn h_stat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    h_fstatat(libc::AT_FDCWD, path, buf, 0)
}

extern "C" fn h_lstat(path: *const c_char, buf: *mut libc::stat) -> c_int {
    h_fstatat(libc::AT_FDCWD, path, buf, libc::AT_SYMLINK_NOFOLLOW)
}

extern "C" fn h_fstat(fd: c_int, buf: *mut libc::stat) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret_int(with_fs(state, |fs| {
                fill_stat(buf, &open_inode(fs, &of)?, fs.chunk_size_bytes());
                Ok(0)
            }));
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_fstat, fd, buf) as c_int }
    })
}

extern "C" fn h_xstat(_ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    h_stat(path, buf)
}

extern "C" fn h_lxstat(_ver: c_int, path: *const c_char, buf: *mut libc::stat) -> c_int {
    h_lstat(path, buf)
}

extern "C" fn h_fxstat(_ver: c_int, fd: c_int, buf: *mut libc::stat) -> c_int {
    h_fstat(fd, buf)
}

extern "C" fn h_fxstatat(_ver: c_int, dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    h_fstatat(dirfd, path, buf, flags)
}

extern "C" fn h_statx(dirfd: c_int, path: *const c_char, flags: c_int, mask: c_uint, buf: *mut libc::statx) -> c_int {
    guard(-1, || {
        let raw_call = |dirfd: c_int, path: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_statx, dirfd, path, flags, mask, buf) as c_int }
        };
        let Some(state) = active() else { return raw_call(dirfd, path) };
        match stat_target(state, dirfd, path, flags) {
            Ok(None) => raw_call(dirfd, path),
            Ok(Some(Err(abs))) => raw_call(libc::AT_FDCWD, abs.as_ptr().cast()),
            Ok(Some(Ok((inode, chunk)))) => {
                fill_statx(buf, &inode, chunk);
                0
            }
            Err(e) => ret_int(Err(e)),
        }
    })
}

// ---------------------------------------------------------------------------------------
// open, close, dup

/// What opening a kura path gave.
enum Opened {
    /// A descriptor: kura's, or the kernel's when a symlink led outside.
    Fd(c_int),
    /// A kura FIFO: the kernel FIFO standing for it (NUL-terminated path), which the caller
    /// opens outside any kura call, since that open waits for the other end.
    Fifo(Vec<u8>),
}

/// Opens a kura path.
fn kura_open(state: &State, fs: &Arc<Fs>, start: u64, rel: &[u8], abs: &[u8], flags: c_int, mode: c_uint) -> Result<Opened, i32> {
    // Another process may rename over or remove the name between its lookup and the open
    // (the open then finds the file without a name, `ESTALE`): resolve the path again, so that
    // the open sees the old file or the new one, never `ENOENT` for a name that always existed.
    for _ in 0..kura_fs::path::RESOLVE_RETRIES_MAX {
        match kura_open_once(state, fs, start, rel, abs, flags, mode) {
            Err(libc::ESTALE) => continue,
            result => return result,
        }
    }
    Err(libc::ENOENT)
}

fn kura_open_once(state: &State, fs: &Arc<Fs>, start: u64, rel: &[u8], abs: &[u8], flags: c_int, mode: c_uint) -> Result<Opened, i32> {
    // `O_PATH` first: the kernel drops every other flag but a few before it looks at them.
    if flags & libc::O_PATH != 0 {
        return open_path_only(state, fs, start, rel, abs, flags);
    }
    if flags & O_TMPFILE_BIT != 0 {
        return open_unnamed(state, fs, start, rel, abs, flags, mode);
    }
    let creat = flags & libc::O_CREAT != 0;
    // Linux (since 6.4) refuses the pair before it looks at the path.
    if creat && flags & libc::O_DIRECTORY != 0 {
        return Err(libc::EINVAL);
    }
    let excl = flags & libc::O_EXCL != 0;
    let follow = flags & libc::O_NOFOLLOW == 0 && !(creat && excl);
    if creat && rel.ends_with(b"/") {
        // The kernel refuses a trailing slash with O_CREAT before it looks at (or follows)
        // the last name.
        return Err(after_parent_walk(state, fs, start, rel, libc::EISDIR));
    }
    // A path with `..` from the root: the descriptor's path is the one the walk took (the
    // working directory after `fchdir`, `/proc/self/fd/N`), not the lexical one, which
    // `l/..` with `l` a link would get wrong.
    let mut physical = None;
    let (resolved, found) = if creat {
        let searcher = cred_unless_root();
        fs.resolve_for_create(start, rel, Follow { last: follow, searcher: searcher.as_ref() }, &state.mount).map_err(fs_errno)?
    } else if start == kura_fs::ROOT_INO && rel.split(|&b| b == b'/').any(|c| c == b"..") {
        let searcher = cred_unless_root();
        let mut names = Vec::new();
        let found = fs.resolve_inode_physical(rel, Follow { last: follow, searcher: searcher.as_ref() }, &state.mount, &mut names).map_err(fs_errno)?;
        physical = Some(mount_path(state, &names));
        found
    } else {
        resolve_inode(state, fs, start, rel, follow)?
    };
    // A file this open made lists this process among its openers already.
    let mut made = false;
    let inode = match resolved {
        Resolved::Outside(abs) => {
            let p = c_path(&abs);
            // SAFETY: a NUL-terminated path of ours and the caller's flags and mode.
            let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, p.as_ptr(), flags, mode) };
            return if fd < 0 { Err(errno()) } else { Ok(Opened::Fd(fd as c_int)) };
        }
        Resolved::Missing { parent, name } => {
            if !creat {
                return Err(libc::ENOENT);
            }
            check_create_in(fs, parent)?;
            let perm = mode & 0o7777 & !umask_now();
            let (inode, created) = fs.create_open(parent, &name, perm, owner(), excl).map_err(fs_errno)?;
            made = created;
            // Made by another process since the walk: an existing file, truncated as below.
            if !created && flags & libc::O_TRUNC != 0 && inode.mode & libc::S_IFMT == libc::S_IFREG {
                truncate_at_open(fs, inode.ino)?
            } else {
                inode
            }
        }
        Resolved::Found { parent, .. } => {
            if creat && excl {
                return Err(libc::EEXIST);
            }
            let found = found.ok_or(libc::ENOENT)?;
            if creat && found.mode & libc::S_IFMT != libc::S_IFDIR {
                check_create_in_sticky(fs, parent, &found)?;
            }
            match open_existing(fs, found, flags)? {
                Ok(inode) => inode,
                Err(fifo) => return Ok(fifo),
            }
        }
    };
    install_open(state, fs, inode, made, flags, physical.as_deref().unwrap_or(abs))
}

/// `open(O_CREAT)` of an existing file (not a directory: EISDIR comes first) in directory
/// `parent`, as Linux's `may_create_in_sticky`: in a sticky directory, a file that neither the
/// directory's owner nor the caller owns is EACCES when the directory is world-writable (or
/// group-writable, at level 2) — regular files and FIFOs only as `fs.protected_regular` and
/// `fs.protected_fifos` say, every other kind (a link opened `O_NOFOLLOW`) always. Before
/// the checks of the file itself (ELOOP for a link).
fn check_create_in_sticky(fs: &Fs, parent: u64, inode: &Inode) -> Result<(), i32> {
    // The caller's own file, the common case (`>` onto a file): nothing more to read.
    // SAFETY: geteuid cannot fail.
    if inode.uid == unsafe { libc::geteuid() } {
        return Ok(());
    }
    let protected = |name: &str| std::fs::read_to_string(format!("/proc/sys/fs/{name}")).ok().and_then(|v| v.trim().parse::<u32>().ok()).unwrap_or(0);
    let level = match inode.mode & libc::S_IFMT {
        libc::S_IFREG => Some(protected("protected_regular")),
        libc::S_IFIFO => Some(protected("protected_fifos")),
        _ => None,
    };
    if level == Some(0) {
        return Ok(());
    }
    let dir = fs.getattr(parent).map_err(fs_errno)?;
    if dir.mode & libc::S_ISVTX == 0 || inode.uid == dir.uid {
        return Ok(());
    }
    if dir.mode & 0o002 != 0 || (dir.mode & 0o020 != 0 && level.is_some_and(|l| l >= 2)) {
        return Err(libc::EACCES);
    }
    Ok(())
}

/// The checks and the truncation of an `open` of an existing file (`inode`), as Linux makes
/// them; `Err(fifo)` for a kura FIFO, which the caller opens as a kernel one.
fn open_existing(fs: &Arc<Fs>, mut inode: Inode, flags: c_int) -> Result<Result<Inode, Opened>, i32> {
    let (accmode, creat) = (flags & libc::O_ACCMODE, flags & libc::O_CREAT != 0);
    match inode.mode & libc::S_IFMT {
        // Linux checks O_DIRECTORY before it refuses the link (O_NOFOLLOW).
        libc::S_IFLNK => return Err(if flags & libc::O_DIRECTORY != 0 { libc::ENOTDIR } else { libc::ELOOP }),
        libc::S_IFDIR => {
            if accmode != libc::O_RDONLY || creat || flags & libc::O_TRUNC != 0 {
                return Err(libc::EISDIR);
            }
            check_open(&inode, flags)?;
        }
        libc::S_IFREG => {
            if flags & libc::O_DIRECTORY != 0 {
                return Err(libc::ENOTDIR);
            }
            check_open(&inode, flags)?;
            if (accmode != libc::O_RDONLY || flags & libc::O_TRUNC != 0) && crate::text::busy(inode.ino) {
                return Err(libc::ETXTBSY);
            }
            // Linux truncates for O_RDONLY too (POSIX leaves it undefined), and an empty
            // file too: its mtime and ctime are set (`: > stamp` marks a build step).
            if flags & libc::O_TRUNC != 0 {
                inode = truncate_at_open(fs, inode.ino)?;
            }
        }
        libc::S_IFIFO if flags & libc::O_DIRECTORY == 0 => {
            check_open(&inode, flags)?;
            return host_fifo(inode.ino).map(|fifo| Err(Opened::Fifo(fifo)));
        }
        _ => return Err(if flags & libc::O_DIRECTORY != 0 { libc::ENOTDIR } else { libc::ENXIO }),
    }
    Ok(Ok(inode))
}

/// A new open file description of `inode` (`made`: by this open) at descriptor path `path`.
fn install_open(state: &State, fs: &Arc<Fs>, inode: Inode, made: bool, flags: c_int, path: &[u8]) -> Result<Opened, i32> {
    let accmode = flags & libc::O_ACCMODE;
    let is_dir = kura_fs::layout::is_dir(inode.mode);
    // A file unlinked since the lookup fails here, before a descriptor exists.
    let node = match (is_dir, made) {
        (true, _) => None,
        (false, true) => Some(fs.open_node_created(&inode).map_err(fs_errno)?),
        // To be read: a small file's first chunk comes with the swap that records the opener.
        (false, false) if accmode != libc::O_WRONLY && flags & (libc::O_TRUNC | libc::O_DIRECT) == 0 => Some(fs.open_node_reading(&inode).map_err(|e| fs_errno(e.gone_is_stale()))?),
        (false, false) => Some(fs.open_node(&inode).map_err(|e| fs_errno(e.gone_is_stale()))?),
    };
    let (fd, file) = match create_placeholder(inode.ino, is_dir, flags, path) {
        Ok(placeholder) => placeholder,
        Err(e) => {
            if let Some(node) = &node {
                let _ = fs.release(node);
            }
            return Err(e);
        }
    };
    if let Some(node) = node {
        file.set_node(node);
    } else {
        *file.dir_inode.lock() = Some(inode);
    }
    state.fds.install(fd, Arc::new(file));
    Ok(Opened::Fd(fd))
}

/// `open` of `/proc/self/fd/N`, `/dev/fd/N`, `/dev/stdin` and the like for a kura descriptor:
/// as the kernel's magic link, the file that descriptor has open, wherever it is now — renamed
/// since, unlinked, or an `O_TMPFILE` file, which have no name — in a new description with its
/// own offset. The link is a symbolic link to the kernel: `O_NOFOLLOW` is ELOOP, `O_CREAT` with
/// `O_EXCL` EEXIST.
fn reopen(state: &State, fs: &Arc<Fs>, of: &OpenFile, flags: c_int) -> Result<Opened, i32> {
    let creat = flags & libc::O_CREAT != 0;
    if creat && flags & libc::O_DIRECTORY != 0 {
        return Err(libc::EINVAL);
    }
    if flags & libc::O_NOFOLLOW != 0 {
        return Err(libc::ELOOP);
    }
    if creat && flags & libc::O_EXCL != 0 {
        return Err(libc::EEXIST);
    }
    let inode = if of.is_dir { open_inode(fs, of)? } else { fs.getattr(of.ino).map_err(fs_errno)? };
    match open_existing(fs, inode, flags)? {
        Ok(inode) => install_open(state, fs, inode, false, flags, &of.path),
        Err(fifo) => Ok(fifo),
    }
}

/// `O_TMPFILE` without `O_DIRECTORY`, which it includes (the kernel's `__O_TMPFILE`).
const O_TMPFILE_BIT: c_int = libc::O_TMPFILE & !libc::O_DIRECTORY;

/// `O_TMPFILE`: a regular file without a name in the directory `rel` names, open for writing,
/// as Linux's `do_tmpfile` makes it: `EINVAL` without write access or with `O_CREAT` (before
/// the path is looked at), `ENOTDIR` when the path names no directory, `EACCES` without write
/// and search on it; no permission on the new file itself is checked (its mode may allow
/// nothing). It is a file unlinked while open from the start ([`Fs::create_unnamed`]); without
/// `O_EXCL` a `linkat` of the descriptor may name it. The descriptor's path is the one Linux
/// shows for it, `DIR/#INO (deleted)`.
fn open_unnamed(state: &State, fs: &Arc<Fs>, start: u64, rel: &[u8], abs: &[u8], flags: c_int, mode: c_uint) -> Result<Opened, i32> {
    if flags & (O_TMPFILE_BIT | libc::O_DIRECTORY | libc::O_CREAT) != libc::O_TMPFILE || flags & libc::O_ACCMODE == libc::O_RDONLY {
        return Err(libc::EINVAL);
    }
    let dir = match resolve_inode(state, fs, start, rel, flags & libc::O_NOFOLLOW == 0)? {
        (Resolved::Found { .. }, Some(inode)) if kura_fs::layout::is_dir(inode.mode) => inode,
        (Resolved::Found { .. }, Some(_)) => return Err(libc::ENOTDIR),
        (Resolved::Found { .. }, None) | (Resolved::Missing { .. }, _) => return Err(libc::ENOENT),
        (Resolved::Outside(abs), _) => {
            let p = c_path(&abs);
            // SAFETY: a NUL-terminated path of ours and the caller's flags and mode.
            let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, p.as_ptr(), flags, mode) };
            return if fd < 0 { Err(errno()) } else { Ok(Opened::Fd(fd as c_int)) };
        }
    };
    check_create_in(fs, dir.ino)?;
    let perm = mode & 0o7777 & !umask_now();
    let inode = fs.create_unnamed(dir.ino, perm, owner(), flags & libc::O_EXCL == 0).map_err(fs_errno)?;
    let node = fs.open_node_created(&inode).map_err(fs_errno)?;
    let mut path = abs.strip_suffix(b"/").unwrap_or(abs).to_vec();
    path.extend_from_slice(format!("/#{} (deleted)", inode.ino).as_bytes());
    // The description keeps no creation flags, as Linux's.
    let (fd, file) = match create_placeholder(inode.ino, false, flags & !(libc::O_EXCL | libc::O_TRUNC), &path) {
        Ok(placeholder) => placeholder,
        Err(e) => {
            let _ = fs.release(&node);
            return Err(e);
        }
    };
    file.set_node(node);
    state.fds.install(fd, Arc::new(file));
    Ok(Opened::Fd(fd))
}

/// `O_TRUNC` of an existing regular file: size 0 and times now, whatever its size; the record
/// as left.
fn truncate_at_open(fs: &Fs, ino: u64) -> Result<Inode, i32> {
    fs.setattr(ino, SetAttr { size: Some(0), ..SetAttr::default() }).map_err(fs_errno)
}

/// `O_PATH`: a descriptor that names the file without opening it for I/O (the kernel keeps
/// only O_DIRECTORY, O_NOFOLLOW and O_CLOEXEC of the flags): no permission on the file
/// itself is needed, a symbolic link with O_NOFOLLOW is one to the link, and the process is
/// no opener of it. `fstat`, `fchdir`, `dup`, `close` and the `*at` calls take it; reads,
/// writes and the rest are EBADF ([`no_io`]).
fn open_path_only(state: &State, fs: &Arc<Fs>, start: u64, rel: &[u8], abs: &[u8], flags: c_int) -> Result<Opened, i32> {
    let flags = flags & (libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC);
    let (inode, path) = match resolve_inode(state, fs, start, rel, flags & libc::O_NOFOLLOW == 0)? {
        (Resolved::Found { .. }, Some(inode)) => (inode, abs),
        (Resolved::Found { .. }, None) | (Resolved::Missing { .. }, _) => return Err(libc::ENOENT),
        (Resolved::Outside(abs), _) => {
            let p = c_path(&abs);
            // SAFETY: a NUL-terminated path of ours and the caller's flags.
            let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, p.as_ptr(), flags, 0) };
            return if fd < 0 { Err(errno()) } else { Ok(Opened::Fd(fd as c_int)) };
        }
    };
    let is_dir = kura_fs::layout::is_dir(inode.mode);
    if flags & libc::O_DIRECTORY != 0 && !is_dir {
        return Err(libc::ENOTDIR);
    }
    let (fd, file) = create_placeholder(inode.ino, is_dir, flags, path)?;
    if is_dir {
        *file.dir_inode.lock() = Some(inode);
    }
    state.fds.install(fd, Arc::new(file));
    Ok(Opened::Fd(fd))
}

/// `errno`, once the directory `rel`'s last name is in has been walked: the kernel looks up a
/// path's parent before it refuses its last name (so a missing or bad directory wins).
fn after_parent_walk(state: &State, fs: &Fs, start: u64, rel: &[u8], errno: i32) -> i32 {
    match resolve(state, fs, start, &kura_fs::path::parent_dir_of(rel), true) {
        Err(walk) => walk,
        Ok(_) => errno,
    }
}

/// EBADF for a descriptor opened with `O_PATH` (the kernel's `fdget` of I/O calls skips them).
fn no_io(of: &OpenFile) -> Result<(), i32> {
    if of.flags() & libc::O_PATH != 0 { Err(libc::EBADF) } else { Ok(()) }
}

/// The kernel FIFO that stands for kura FIFO `ino` on this host (made if missing), beside
/// the inode's lock file: processes of the host that open the kura FIFO meet there, as they
/// would at a FIFO of the kernel's.
fn host_fifo(ino: u64) -> Result<Vec<u8>, i32> {
    let (_, path) = fds::host_file_path(ino, kura_fs::host_files::FIFO);
    // SAFETY: a NUL-terminated path of ours.
    if unsafe { crate::raw_syscall!(libc::SYS_mknodat, libc::AT_FDCWD, path.as_ptr(), libc::S_IFIFO | 0o666, 0) } == 0 {
        // Not narrowed by the umask: kura checked the caller's permission on its own node.
        // SAFETY: as above.
        unsafe { crate::raw_syscall!(libc::SYS_fchmodat, libc::AT_FDCWD, path.as_ptr(), 0o666) };
    } else if errno() != libc::EEXIST {
        return Err(errno());
    }
    Ok(path)
}

extern "C" fn h_openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    guard(-1, || {
        let raw_call = |dirfd: c_int, path: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_openat, dirfd, path, flags, mode) as c_int }
        };
        let Some(state) = active() else { return raw_call(dirfd, path) };
        // SAFETY: libc's contract.
        let Some(p) = (unsafe { bytes(path) }) else { return raw_call(dirfd, path) };
        if flags & (libc::O_PATH | O_TMPFILE_BIT) == 0
            && p.first() == Some(&b'/')
            && let Some((of, b"")) = crate::paths::descriptor_link(state, p)
        {
            return match with_fs(state, |fs| reopen(state, fs, &of, flags)) {
                Ok(Opened::Fd(fd)) => fd,
                Ok(Opened::Fifo(host)) => raw_call(libc::AT_FDCWD, host.as_ptr().cast()),
                Err(e) => ret_int(Err(e)),
            };
        }
        match classify(state, dirfd, p) {
            Err(e) => ret_int(Err(e)),
            Ok(Target::Kernel) => raw_call(dirfd, path),
            Ok(Target::KernelAbs(abs)) => raw_call(libc::AT_FDCWD, abs.as_ptr().cast()),
            Ok(Target::Kura { start, rel, abs }) => match with_fs(state, |fs| kura_open(state, fs, start, &rel, &abs, flags, mode)) {
                Ok(Opened::Fd(fd)) => fd,
                // Outside the kura call: this open waits for the FIFO's other end.
                Ok(Opened::Fifo(host)) => raw_call(libc::AT_FDCWD, host.as_ptr().cast()),
                Err(e) => ret_int(Err(e)),
            },
        }
    })
}

extern "C" fn h_open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    h_openat(libc::AT_FDCWD, path, flags, mode)
}

extern "C" fn h_open_2(path: *const c_char, flags: c_int) -> c_int {
    h_openat(libc::AT_FDCWD, path, flags, 0)
}

extern "C" fn h_openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    h_openat(dirfd, path, flags, 0)
}

extern "C" fn h_creat(path: *const c_char, mode: c_uint) -> c_int {
    h_openat(libc::AT_FDCWD, path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, mode)
}

/// A descriptor of `of` closed (by `close`, or by `dup2`/`dup3` onto it). Linux drops every
/// POSIX record lock the process holds on the file at the close of any of its descriptors,
/// whichever description took them; kura's live on the inode's lock file, where an unlock
/// of the whole file through any descriptor of it does the same.
fn descriptor_closed(state: &State, of: &OpenFile) {
    if !state.fds.take_posix_locked(of.ino) {
        return;
    }
    let lfd = *of.lock_fd.lock();
    let lfd = lfd.or_else(|| state.fds.all().into_iter().find_map(|(_, o)| if o.ino == of.ino { *o.lock_fd.lock() } else { None }));
    if let Some(lfd) = lfd {
        written_back_before_unlock(state);
        let mut all = libc::flock { l_type: libc::F_UNLCK as i16, l_whence: libc::SEEK_SET as i16, l_start: 0, l_len: 0, l_pid: 0 };
        // SAFETY: `all` is a struct flock that lives across the call.
        unsafe { crate::raw_syscall!(libc::SYS_fcntl, lfd, libc::F_SETLK, &mut all as *mut libc::flock) };
    }
}

/// The last reference of this process to an open file went away: release its node.
fn final_release(state: &State, of: Arc<OpenFile>) -> Result<(), i32> {
    descriptor_closed(state, &of);
    let Ok(mut file) = Arc::try_unwrap(of) else {
        return Ok(());
    };
    let Some(node) = file.take_node() else {
        return Ok(());
    };
    with_fs(state, |fs| fs.release(&node).map_err(fs_errno))
}

extern "C" fn h_close(fd: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.remove(fd)
        {
            raw::close(fd);
            return ret_int(final_release(state, of).map(|()| 0));
        }
        // SAFETY: close takes an integer.
        unsafe { crate::raw_syscall!(libc::SYS_close, fd) as c_int }
    })
}

/// `close_range(2)` (and glibc's `closefrom`, which calls it): a program closing "every
/// descriptor from N up" before an `exec` or after a `fork` (Python's `subprocess`, daemons)
/// closes its kura descriptors as `close` would, and leaves kura's own ones alone: the pool's
/// connections, the engine's files and the lock files live at or above
/// [`kura_engine::fd::high_base`], close-on-exec, so the `exec` that usually follows closes them
/// anyway, and until then the exec itself (of a kura file: read from the pool) needs them.
/// A close-on-exec descriptor of the program's own that high is kept open too.
extern "C" fn h_close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    guard(-1, || {
        let kernel = |first: c_uint, last: c_uint| {
            // SAFETY: close_range takes integers.
            unsafe { crate::raw_syscall!(libc::SYS_close_range, first, last, flags) as c_int }
        };
        let known = libc::CLOSE_RANGE_UNSHARE | libc::CLOSE_RANGE_CLOEXEC;
        let Some(state) = active() else { return kernel(first, last) };
        if first > last || flags as c_uint & !known != 0 {
            return kernel(first, last);
        }
        let in_range = |fd: c_int| fd >= 0 && (first..=last).contains(&(fd as c_uint));
        let cloexec_only = flags as c_uint & libc::CLOSE_RANGE_CLOEXEC != 0;
        if !cloexec_only {
            if flags as c_uint & libc::CLOSE_RANGE_UNSHARE != 0 {
                // Unshare first, so that the kura descriptors closed below are this table's.
                // SAFETY: unshare takes an integer.
                if unsafe { crate::raw_syscall!(libc::SYS_unshare, libc::CLONE_FILES) } < 0 {
                    return -1;
                }
            }
            for (fd, _) in state.fds.all().into_iter().filter(|(fd, _)| in_range(*fd)) {
                if let Some(of) = state.fds.remove(fd) {
                    raw::close(fd);
                    let _ = final_release(state, of);
                }
            }
        }
        let base = kura_engine::fd::high_base();
        let kept: Vec<c_int> = {
            let _busy = Busy::enter();
            let from = base.max(first.min(c_int::MAX as c_uint) as c_int);
            fds::open_descriptors()
                .into_iter()
                .filter(|&fd| fd >= from)
                .filter(|&fd| in_range(fd) && raw::fcntl(fd, libc::F_GETFD, 0).is_ok_and(|f| f & libc::FD_CLOEXEC != 0))
                .collect()
        };
        // The range minus the kept descriptors, in pieces.
        let mut from = first;
        for fd in kept {
            let fd = fd as c_uint;
            if fd > from && kernel(from, fd - 1) < 0 {
                return -1;
            }
            from = fd.saturating_add(1);
            if fd == c_uint::MAX {
                return 0;
            }
        }
        if from <= last { kernel(from, last) } else { 0 }
    })
}

fn install_dup(state: &State, of: Arc<OpenFile>, newfd: c_long) -> c_int {
    if newfd >= 0
        && let Some(prev) = state.fds.install(newfd as c_int, of)
    {
        let _ = final_release(state, prev);
    }
    newfd as c_int
}

extern "C" fn h_dup(fd: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: dup takes an integer.
        let newfd = unsafe { crate::raw_syscall!(libc::SYS_dup, fd) };
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return install_dup(state, of, newfd);
        }
        newfd as c_int
    })
}

extern "C" fn h_dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: dup3 takes integers.
        let r = unsafe { crate::raw_syscall!(libc::SYS_dup3, old, new, flags) };
        let Some(state) = active() else { return r as c_int };
        if r < 0 {
            return r as c_int;
        }
        match state.fds.get(old) {
            Some(of) => install_dup(state, of, r),
            None => {
                if let Some(prev) = state.fds.remove(new) {
                    let _ = final_release(state, prev);
                }
                r as c_int
            }
        }
    })
}

extern "C" fn h_dup2(old: c_int, new: c_int) -> c_int {
    guard(-1, || {
        if old == new {
            // dup2 onto itself only checks that `old` is open.
            // SAFETY: fcntl with F_GETFD takes integers.
            let r = unsafe { crate::raw_syscall!(libc::SYS_fcntl, old, libc::F_GETFD) };
            return if r < 0 { -1 } else { new };
        }
        h_dup3(old, new, 0)
    })
}

// ---------------------------------------------------------------------------------------
// read, write, seek

fn kura_read(state: &State, of: &OpenFile, buf: *mut u8, count: usize, at: Option<u64>) -> Result<c_long, i32> {
    no_io(of)?;
    if of.is_dir {
        return Err(libc::EISDIR);
    }
    let flags = of.flags();
    if flags & libc::O_ACCMODE == libc::O_WRONLY {
        return Err(libc::EBADF);
    }
    if count == 0 {
        return Ok(0);
    }
    if buf.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller's buffer is writable for `count` bytes (read(2)'s contract).
    let out = unsafe { std::slice::from_raw_parts_mut(buf, count) };
    with_fs(state, |fs| {
        let node = node_of(fs, of)?;
        let _shared = fs.shared_io(node).map_err(fs_errno)?;
        let offset = at.unwrap_or_else(|| of.offset());
        // A file this process maps: its backing file holds the mapping's stores.
        let mapped = if state.maps.any() { state.maps.read(of.ino, offset, out) } else { None };
        let n = match mapped {
            Some(n) => n?,
            None => if flags & libc::O_DIRECT != 0 { fs.read_direct(node, offset, out) } else { fs.read(node, offset, out) }.map_err(fs_errno)?,
        };
        if at.is_none() {
            of.set_offset(offset + n as u64);
        }
        Ok(n as c_long)
    })
}

fn kura_write(state: &State, of: &OpenFile, buf: *const u8, count: usize, at: Option<u64>) -> Result<c_long, i32> {
    no_io(of)?;
    let flags = of.flags();
    // A directory is open read-only: EBADF, as Linux checks the access mode first.
    if flags & libc::O_ACCMODE == libc::O_RDONLY || of.is_dir {
        return Err(libc::EBADF);
    }
    if count == 0 {
        return Ok(0);
    }
    if buf.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller's buffer is readable for `count` bytes (write(2)'s contract).
    let data = unsafe { std::slice::from_raw_parts(buf, count) };
    // What this process writes survives SIGTERM and SIGHUP (see crate::signals).
    crate::signals::ensure_service();
    let mode = match (flags & libc::O_DIRECT != 0, flags & libc::O_DSYNC != 0) {
        (false, false) => WriteMode::Buffered,
        (false, true) => WriteMode::Sync,
        (true, false) => WriteMode::Direct,
        (true, true) => WriteMode::DirectSync,
    };
    with_fs(state, |fs| {
        let node = node_of(fs, of)?;
        // Another process may write through this description too: its offset and the end
        // of file are read and moved under the shared-file lock.
        let _shared = fs.shared_io(node).map_err(fs_errno)?;
        let (offset, n) = if flags & libc::O_APPEND != 0 {
            // At the end, whichever process appends (pwrite too, as on Linux).
            fs.append(node, data, mode).map_err(fs_errno)?
        } else {
            let offset = at.unwrap_or_else(|| of.offset());
            (offset, fs.write(node, offset, data, mode).map_err(fs_errno)?)
        };
        if at.is_none() {
            of.set_offset(offset + n as u64);
        }
        drop(_shared);
        // Shared mappings of the file see the write at once (see crate::maps).
        if state.maps.any() {
            state.maps.wrote(of.ino, offset, &data[..n])?;
        }
        if node.is_shared() {
            crate::maps::wrote_elsewhere(of.ino, offset, &data[..n])?;
        }
        // A process that maps a file shared with others (sqlite's WAL index) publishes through
        // the mapping at once what its writes describe (a WAL commit's frames): the writes go
        // to the pool first, so that another process never reads past them.
        if state.maps.any() && !node.is_shared() && mode == WriteMode::Buffered {
            fs.writeback(node).map_err(fs_errno)?;
        }
        Ok(n as c_long)
    })
}

extern "C" fn h_read(fd: c_int, buf: *mut c_void, count: usize) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret(kura_read(state, &of, buf.cast(), count, None)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_read, fd, buf, count) as isize }
    })
}

extern "C" fn h_write(fd: c_int, buf: *const c_void, count: usize) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret(kura_write(state, &of, buf.cast(), count, None)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_write, fd, buf, count) as isize }
    })
}

extern "C" fn h_pread(fd: c_int, buf: *mut c_void, count: usize, offset: i64) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            if offset < 0 {
                return ret(Err(libc::EINVAL)) as isize;
            }
            return ret(kura_read(state, &of, buf.cast(), count, Some(offset as u64))) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_pread64, fd, buf, count, offset) as isize }
    })
}

extern "C" fn h_pwrite(fd: c_int, buf: *const c_void, count: usize, offset: i64) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            if offset < 0 {
                return ret(Err(libc::EINVAL)) as isize;
            }
            return ret(kura_write(state, &of, buf.cast(), count, Some(offset as u64))) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_pwrite64, fd, buf, count, offset) as isize }
    })
}

/// The iovecs as slices.
///
/// # Safety
/// `iov` points to `cnt` iovecs, each valid for its length.
unsafe fn iovecs<'a>(iov: *const libc::iovec, cnt: c_int) -> Result<&'a [libc::iovec], i32> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return Err(libc::EINVAL);
    }
    if cnt == 0 {
        return Ok(&[]);
    }
    // SAFETY: the caller's promise.
    Ok(unsafe { std::slice::from_raw_parts(iov, cnt as usize) })
}

fn kura_readv(state: &State, of: &OpenFile, iov: *const libc::iovec, cnt: c_int, at: Option<u64>) -> Result<c_long, i32> {
    // SAFETY: readv(2)'s contract.
    let iov = unsafe { iovecs(iov, cnt)? };
    // Nothing to read is 0 once the descriptor may read, a directory too (the kernel's
    // do_iter_read stops before the file's read, which a directory refuses).
    if iov.iter().all(|v| v.iov_len == 0) {
        no_io(of)?;
        return if of.flags() & libc::O_ACCMODE == libc::O_WRONLY { Err(libc::EBADF) } else { Ok(0) };
    }
    let mut total: c_long = 0;
    let mut offset = at;
    for v in iov {
        let n = kura_read(state, of, v.iov_base.cast(), v.iov_len, offset)?;
        total += n;
        if let Some(o) = offset.as_mut() {
            *o += n as u64;
        }
        if (n as usize) < v.iov_len {
            break;
        }
    }
    Ok(total)
}

fn kura_writev(state: &State, of: &OpenFile, iov: *const libc::iovec, cnt: c_int, at: Option<u64>) -> Result<c_long, i32> {
    // SAFETY: writev(2)'s contract.
    let iov = unsafe { iovecs(iov, cnt)? };
    // One write, so the data lands at one offset (O_APPEND) as writev promises.
    let mut all = Vec::with_capacity(iov.iter().map(|v| v.iov_len).sum());
    for v in iov.iter().filter(|v| v.iov_len > 0) {
        // SAFETY: each iovec is readable for its length.
        all.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) });
    }
    kura_write(state, of, all.as_ptr(), all.len(), at)
}

extern "C" fn h_readv(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret(kura_readv(state, &of, iov, cnt, None)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_readv, fd, iov, cnt) as isize }
    })
}

extern "C" fn h_writev(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret(kura_writev(state, &of, iov, cnt, None)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_writev, fd, iov, cnt) as isize }
    })
}

extern "C" fn h_preadv(fd: c_int, iov: *const libc::iovec, cnt: c_int, offset: i64) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            let at = if offset == -1 { None } else { Some(offset as u64) };
            return ret(kura_readv(state, &of, iov, cnt, at)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel (offset split as the ABI wants).
        unsafe { crate::raw_syscall!(libc::SYS_preadv, fd, iov, cnt, offset, 0) as isize }
    })
}

extern "C" fn h_pwritev(fd: c_int, iov: *const libc::iovec, cnt: c_int, offset: i64) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            let at = if offset == -1 { None } else { Some(offset as u64) };
            return ret(kura_writev(state, &of, iov, cnt, at)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_pwritev, fd, iov, cnt, offset, 0) as isize }
    })
}

extern "C" fn h_preadv2(fd: c_int, iov: *const libc::iovec, cnt: c_int, offset: i64, flags: c_int) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return h_preadv(fd, iov, cnt, offset);
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_preadv2, fd, iov, cnt, offset, 0, flags) as isize }
    })
}

extern "C" fn h_pwritev2(fd: c_int, iov: *const libc::iovec, cnt: c_int, offset: i64, flags: c_int) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return h_pwritev(fd, iov, cnt, offset);
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_pwritev2, fd, iov, cnt, offset, 0, flags) as isize }
    })
}

fn kura_lseek(state: &State, of: &OpenFile, offset: i64, whence: c_int) -> Result<c_long, i32> {
    no_io(of)?;
    if of.is_dir {
        if whence != libc::SEEK_SET || offset < 0 {
            return Err(libc::EINVAL);
        }
        if offset == 0 {
            *of.listing.lock() = None;
        }
        of.set_offset(offset as u64);
        return Ok(offset as c_long);
    }
    if matches!(whence, libc::SEEK_DATA | libc::SEEK_HOLE) {
        // It reads the size itself (after writing back this process's dirty pages).
        let found = with_fs(state, |fs| fs.seek_data_or_hole(node_of(fs, of)?, offset, whence == libc::SEEK_HOLE).map_err(fs_errno))
            .inspect_err(|&e| {
                // A program that gets an error here (not ENXIO, the end) takes the whole file
                // as data: say why when asked.
                if std::env::var_os("KURA_FS_DEBUG").is_some() {
                    complain(&format!("libkura_fs: lseek(SEEK_{}, {offset}): {}", if whence == libc::SEEK_HOLE { "HOLE" } else { "DATA" }, std::io::Error::from_raw_os_error(e)));
                }
            })?;
        let new = found.ok_or(libc::ENXIO)?;
        of.set_offset(new);
        return Ok(new as c_long);
    }
    let size = with_fs(state, |fs| fs.size_of(node_of(fs, of)?).map_err(fs_errno))? as i64;
    let new = match whence {
        libc::SEEK_SET => offset,
        libc::SEEK_CUR => (of.offset() as i64).checked_add(offset).ok_or(libc::EOVERFLOW)?,
        libc::SEEK_END => size.checked_add(offset).ok_or(libc::EOVERFLOW)?,
        _ => return Err(libc::EINVAL),
    };
    if new < 0 {
        return Err(libc::EINVAL);
    }
    of.set_offset(new as u64);
    Ok(new as c_long)
}

extern "C" fn h_lseek(fd: c_int, offset: i64, whence: c_int) -> i64 {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret(kura_lseek(state, &of, offset, whence));
        }
        // SAFETY: integers only.
        unsafe { crate::raw_syscall!(libc::SYS_lseek, fd, offset, whence) }
    })
}

// ---------------------------------------------------------------------------------------
// sync, truncate, allocate

extern "C" fn h_fsync(fd: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret_int(with_fs(state, |fs| {
                no_io(&of)?;
                if of.is_dir {
                    fs.kv().flush().map_err(fs_errno)?;
                } else {
                    fs.fsync(node_of(fs, &of)?).map_err(fs_errno)?;
                }
                Ok(0)
            }));
        }
        // SAFETY: an integer.
        unsafe { crate::raw_syscall!(libc::SYS_fsync, fd) as c_int }
    })
}

extern "C" fn h_fdatasync(fd: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return h_fsync(fd);
        }
        // SAFETY: an integer.
        unsafe { crate::raw_syscall!(libc::SYS_fdatasync, fd) as c_int }
    })
}

extern "C" fn h_sync() {
    guard((), || {
        if let Some(state) = active()
            && let Some(fs) = state.fs_if_open()
        {
            let _call = state.enter_call();
            let _ = fs.sync_all();
        }
        // SAFETY: no arguments.
        unsafe { crate::raw_syscall!(libc::SYS_sync) };
    })
}

extern "C" fn h_syncfs(fd: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return ret_int(with_fs(state, |fs| fs.sync_all().map(|()| 0).map_err(fs_errno)));
        }
        // SAFETY: an integer.
        unsafe { crate::raw_syscall!(libc::SYS_syncfs, fd) as c_int }
    })
}

fn kura_set_size(state: &State, of: &OpenFile, size: i64) -> Result<c_int, i32> {
    no_io(of)?;
    if size < 0 {
        return Err(libc::EINVAL);
    }
    // Linux: EINVAL for anything but a regular file open for writing, directories included.
    if of.is_dir || of.flags() & libc::O_ACCMODE == libc::O_RDONLY {
        return Err(libc::EINVAL);
    }
    with_fs(state, |fs| {
        node_of(fs, of)?;
        fs.setattr(of.ino, SetAttr { size: Some(size as u64), ..SetAttr::default() }).map_err(fs_errno)?;
        state.maps.resized(of.ino, size as u64);
        Ok(0)
    })
}

extern "C" fn h_ftruncate(fd: c_int, len: i64) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret_int(kura_set_size(state, &of, len));
        }
        // SAFETY: integers.
        unsafe { crate::raw_syscall!(libc::SYS_ftruncate, fd, len) as c_int }
    })
}

extern "C" fn h_truncate(path: *const c_char, len: i64) -> c_int {
    guard(-1, || {
        let raw_call = |p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_truncate, p, len) as c_int }
        };
        let Some(state) = active() else { return raw_call(path) };
        // SAFETY: libc's contract.
        let Some(p) = (unsafe { bytes(path) }) else { return raw_call(path) };
        match classify(state, libc::AT_FDCWD, p) {
            Err(e) => ret_int(Err(e)),
            Ok(Target::Kernel) => raw_call(path),
            Ok(Target::KernelAbs(abs)) => raw_call(abs.as_ptr().cast()),
            Ok(Target::Kura { start, rel, .. }) => ret_int(with_fs(state, |fs| {
                if len < 0 {
                    return Err(libc::EINVAL);
                }
                match resolve(state, fs, start, &rel, true)? {
                    Resolved::Found { entry, .. } => {
                        if crate::text::busy(entry.ino) {
                            return Err(libc::ETXTBSY);
                        }
                        set(fs, entry.ino, SetAttr { size: Some(len as u64), ..SetAttr::default() })?;
                        state.maps.resized(entry.ino, len as u64);
                        Ok(0)
                    }
                    Resolved::Missing { .. } => Err(libc::ENOENT),
                    Resolved::Outside(abs) => {
                        let p = c_path(&abs);
                        let r = raw_call(p.as_ptr().cast());
                        if r < 0 { Err(errno()) } else { Ok(r) }
                    }
                }
            })),
        }
    })
}

fn kura_fallocate(state: &State, of: &OpenFile, mode: c_int, offset: i64, len: i64) -> Result<c_int, i32> {
    no_io(of)?;
    if offset < 0 || len <= 0 {
        return Err(libc::EINVAL);
    }
    if of.flags() & libc::O_ACCMODE == libc::O_RDONLY {
        return Err(libc::EBADF);
    }
    with_fs(state, |fs| fs.fallocate(node_of(fs, of)?, mode, offset, len).map(|()| 0).map_err(fs_errno))
}

extern "C" fn h_fallocate(fd: c_int, mode: c_int, offset: i64, len: i64) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret_int(kura_fallocate(state, &of, mode, offset, len));
        }
        // SAFETY: integers.
        unsafe { crate::raw_syscall!(libc::SYS_fallocate, fd, mode, offset, len) as c_int }
    })
}

/// posix_fallocate returns the error number instead of setting errno.
extern "C" fn h_posix_fallocate(fd: c_int, offset: i64, len: i64) -> c_int {
    guard(libc::EIO, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return kura_fallocate(state, &of, 0, offset, len).err().unwrap_or(0);
        }
        // SAFETY: integers.
        let r = unsafe { crate::raw_syscall!(libc::SYS_fallocate, fd, 0, offset, len) };
        if r < 0 { errno() } else { 0 }
    })
}

extern "C" fn h_posix_fadvise(fd: c_int, offset: i64, len: i64, advice: c_int) -> c_int {
    guard(libc::EIO, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return 0;
        }
        // SAFETY: integers.
        let r = unsafe { crate::raw_syscall!(libc::SYS_fadvise64, fd, offset, len, advice) };
        if r < 0 { errno() } else { 0 }
    })
}

// ---------------------------------------------------------------------------------------
// fcntl, flock

/// The kernel file whose locks stand for `of`'s (made at the first lock, or before a `fork`
/// for every description that has none yet: see [`lock_files_before_fork`]). Inside the fork
/// gate: a child must not inherit the slot's lock held; the lock operation itself, which may
/// wait for another process, runs outside.
fn lock_fd(state: &State, of: &OpenFile) -> Result<c_int, i32> {
    let _gate = state.fork_gate.enter();
    let mut slot = of.lock_fd.lock();
    match *slot {
        Some(fd) => Ok(fd),
        None => open_lock_file(of, &mut slot),
    }
}

/// Opens `of`'s lock file (one kernel open file description per kura one, so that `flock`
/// and OFD locks belong to the description as Linux's do), moved high where programs do not
/// `dup2` onto it, and records its number in the description's shared state for the image
/// after an `exec` ([`crate::fds::FdTable::recover_inherited`]).
fn open_lock_file(of: &OpenFile, slot: &mut Option<c_int>) -> Result<c_int, i32> {
    let (dir, file) = fds::lock_file_path(of.ino);
    // SAFETY: NUL-terminated path; the result (EEXIST included) is checked by the open below.
    unsafe { crate::raw_syscall!(libc::SYS_mkdirat, libc::AT_FDCWD, dir.as_ptr(), 0o1777) };
    // SAFETY: NUL-terminated path, integer flags.
    let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, file.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o666) };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let fd = kura_engine::fd::keep_high(unsafe { OwnedFd::from_raw_fd(fd as c_int) }).into_raw_fd();
    *slot = Some(fd);
    of.record_lock_fd(fd);
    Ok(fd)
}

/// Before `fork` (the gate closed, no kura call in progress): gives every open regular file
/// its lock file, so that parent and child share one (a `flock` either takes after the fork
/// is the other's too, as on one kernel description).
pub(crate) fn lock_files_before_fork(state: &State) {
    for (_, of) in state.fds.all() {
        if of.is_dir {
            continue;
        }
        let mut slot = of.lock_fd.lock();
        if slot.is_none()
            && let Err(e) = open_lock_file(&of, &mut slot)
        {
            complain(&format!("libkura_fs: opening a lock file before fork failed: {}", std::io::Error::from_raw_os_error(e)));
        }
    }
}

/// Before `exec`: a lock file stays open in the new image exactly when some descriptor of its
/// description does (no `FD_CLOEXEC`), so that a lock taken through an inherited descriptor
/// (`exec 9>f; flock 9` runs flock(1) in a new image) is held by the description, not by
/// the image that took it.
pub(crate) fn lock_files_across_exec(state: &State) {
    let mut lock_fds: Vec<(c_int, bool)> = Vec::new();
    for (fd, of) in state.fds.all() {
        let Some(lfd) = *of.lock_fd.lock() else { continue };
        let inherited = raw::fcntl(fd, libc::F_GETFD, 0).is_ok_and(|f| f & libc::FD_CLOEXEC == 0);
        match lock_fds.iter_mut().find(|(l, _)| *l == lfd) {
            Some((_, any)) => *any |= inherited,
            None => lock_fds.push((lfd, inherited)),
        }
    }
    for (lfd, inherited) in lock_fds {
        let _ = raw::fcntl(lfd, libc::F_SETFD, if inherited { 0 } else { c_long::from(libc::FD_CLOEXEC) });
    }
}

/// A record lock on `of`, taken on its lock file. A range relative to the current offset or
/// the end is made absolute first: the lock file's own offset and size are not the file's.
fn kura_lock(state: &State, of: &OpenFile, cmd: c_int, user: *mut libc::flock) -> Result<c_int, i32> {
    if user.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller's struct flock, as fcntl(2) takes it.
    let mut fl = unsafe { *user };
    let base = match c_int::from(fl.l_whence) {
        libc::SEEK_SET => 0,
        libc::SEEK_CUR => of.offset() as i64,
        libc::SEEK_END => with_fs(state, |fs| fs.size_of(node_of(fs, of)?).map_err(fs_errno))? as i64,
        _ => return Err(libc::EINVAL),
    };
    fl.l_start = base.checked_add(fl.l_start).ok_or(libc::EOVERFLOW)?;
    fl.l_whence = libc::SEEK_SET as i16;
    let _busy = Busy::enter();
    let lfd = lock_fd(state, of)?;
    let sets = matches!(cmd, libc::F_SETLK | libc::F_SETLKW | libc::F_OFD_SETLK | libc::F_OFD_SETLKW);
    let unlocks = sets && c_int::from(fl.l_type) == libc::F_UNLCK;
    if matches!(cmd, libc::F_SETLK | libc::F_SETLKW) && !unlocks {
        state.fds.note_posix_lock(of.ino);
    }
    if unlocks {
        written_back_before_unlock(state);
    }
    // SAFETY: `fl` is a struct flock that lives across the call.
    let r = unsafe { crate::raw_syscall!(libc::SYS_fcntl, lfd, cmd, &mut fl as *mut libc::flock) };
    if r < 0 {
        return Err(errno());
    }
    if sets && !unlocks {
        revalidated_after_lock(state, of.ino);
    }
    if matches!(cmd, libc::F_GETLK | libc::F_OFD_GETLK) {
        // F_GETLK answers in the caller's struct: the conflicting lock, or only F_UNLCK in
        // `l_type` (the rest left as the caller wrote it).
        // SAFETY: as above.
        unsafe {
            if fl.l_type == libc::F_UNLCK as i16 {
                (*user).l_type = fl.l_type;
            } else {
                *user = fl;
            }
        }
    }
    Ok(r as c_int)
}

/// Locks make the page cache coherent between processes, as NFS's do: a process writes its
/// files back before it releases a lock, and revalidates its cache after it takes one
/// ([`Fs::before_unlock`], [`Fs::after_lock`]: every file's, since a lock may guard others). A write-back that fails here leaves the data
/// dirty for the next write-back, whose `fsync` or `close` reports it; the unlock goes on.
/// Called outside any kura call of this thread (they take the fork gate here).
fn written_back_before_unlock(state: &State) {
    let _gate = state.fork_gate.enter();
    let _busy = Busy::enter();
    if let Some(fs) = state.fs_if_open()
        && let Err(e) = fs.before_unlock()
    {
        complain(&format!("libkura_fs: write-back before an unlock failed: {e}"));
    }
}

fn revalidated_after_lock(state: &State, ino: u64) {
    let _gate = state.fork_gate.enter();
    let _busy = Busy::enter();
    if let Some(fs) = state.fs_if_open() {
        fs.after_lock(ino);
    }
}

/// Whether `fd` (kura's or the kernel's) was opened with `O_APPEND`.
extern "C" fn h_flock(fd: c_int, op: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            let _busy = Busy::enter();
            let unlocks = op & libc::LOCK_UN != 0;
            return ret_int(lock_fd(state, &of).and_then(|lfd| {
                if unlocks && !of.is_dir {
                    written_back_before_unlock(state);
                }
                // SAFETY: integers.
                let r = unsafe { crate::raw_syscall!(libc::SYS_flock, lfd, op) };
                if r < 0 {
                    return Err(errno());
                }
                if !unlocks && !of.is_dir {
                    revalidated_after_lock(state, of.ino);
                }
                Ok(0)
            }));
        }
        // SAFETY: integers.
        unsafe { crate::raw_syscall!(libc::SYS_flock, fd, op) as c_int }
    })
}

/// Flags `F_SETFL` may change.
const SETFL_MASK: c_int = libc::O_APPEND | libc::O_NONBLOCK | libc::O_DIRECT | libc::O_NOATIME | libc::O_ASYNC;

extern "C" fn h_fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    guard(-1, || {
        let raw_call = || {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_fcntl, fd, cmd, arg) as c_int }
        };
        let Some(state) = active() else { return raw_call() };
        let Some(of) = state.fds.get(fd) else {
            return raw_call();
        };
        match cmd {
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
                let r = raw_call();
                if r < 0 {
                    return r;
                }
                install_dup(state, of, c_long::from(r))
            }
            libc::F_GETFL => of.flags() & !libc::O_CLOEXEC,
            libc::F_SETFL => {
                let flags = (of.flags() & !SETFL_MASK) | (arg as c_int & SETFL_MASK);
                of.set_flags(flags);
                0
            }
            libc::F_GETLK | libc::F_SETLK | libc::F_SETLKW | libc::F_OFD_GETLK | libc::F_OFD_SETLK | libc::F_OFD_SETLKW => ret_int(kura_lock(state, &of, cmd, arg as *mut libc::flock)),
            libc::F_GETFD | libc::F_SETFD => raw_call(),
            libc::F_SETLEASE | libc::F_GETLEASE | libc::F_NOTIFY | libc::F_SETPIPE_SZ | libc::F_GETPIPE_SZ | libc::F_ADD_SEALS | libc::F_GET_SEALS => ret_int(Err(libc::EINVAL)),
            _ => raw_call(),
        }
    })
}

// ---------------------------------------------------------------------------------------
// namespace

/// Runs a path operation: the kernel's `raw_call(dirfd, path)` or `kura(fs, start, rel)`.
fn path_op(dirfd: c_int, path: *const c_char, raw_call: impl Fn(c_int, *const c_char) -> c_int, kura: impl FnOnce(&State, &Arc<Fs>, u64, &[u8], &[u8]) -> Result<c_int, i32>) -> c_int {
    let Some(state) = active() else { return raw_call(dirfd, path) };
    // SAFETY: libc's contract.
    let Some(p) = (unsafe { bytes(path) }) else { return raw_call(dirfd, path) };
    match classify(state, dirfd, p) {
        Err(e) => ret_int(Err(e)),
        Ok(Target::Kernel) => raw_call(dirfd, path),
        Ok(Target::KernelAbs(abs)) => raw_call(libc::AT_FDCWD, abs.as_ptr().cast()),
        Ok(Target::Kura { start, rel, abs }) => ret_int(with_fs(state, |fs| kura(state, fs, start, &rel, &abs))),
    }
}

/// For operations that follow the kernel after a symlink led outside.
fn outside(abs: &[u8], raw_call: &dyn Fn(c_int, *const c_char) -> c_int) -> Result<c_int, i32> {
    let p = c_path(abs);
    let r = raw_call(libc::AT_FDCWD, p.as_ptr().cast());
    if r < 0 { Err(errno()) } else { Ok(r) }
}

/// `.`, `..` or the root as the entry to create, remove or rename: refused as Linux does,
/// on the caller's path (the walk would take `d/..` to `d`'s parent and change that).
fn refuse_dots(dirfd: c_int, path: *const c_char, op: kura_fs::path::NameOp) -> Result<(), i32> {
    refuse_dots_of(&[(dirfd, path, op)])
}

/// [`refuse_dots`] for the paths of one call, in the kernel's order: each path's directory is
/// walked first (`mkdir("gone/.")` is ENOENT, `rename("gone/a", "d/..")` too: the kernel looks
/// up every parent before it looks at the last names), then the first refused name's errno.
fn refuse_dots_of(paths: &[(c_int, *const c_char, kura_fs::path::NameOp)]) -> Result<(), i32> {
    let Some(state) = active() else { return Ok(()) };
    let mut refused = None;
    let mut targets = Vec::with_capacity(paths.len());
    for &(dirfd, path, op) in paths {
        // SAFETY: libc's contract.
        let Some(p) = (unsafe { bytes(path) }) else { return Ok(()) };
        if let Target::Kura { start, rel, .. } = classify(state, dirfd, p)? {
            if let Err(e) = kura_fs::path::check_last_component(p, op) {
                refused.get_or_insert(e.errno());
            }
            targets.push((start, rel));
        }
    }
    let Some(refused) = refused else { return Ok(()) };
    with_fs(state, |fs| {
        for (start, rel) in &targets {
            resolve(state, fs, *start, &kura_fs::path::parent_dir_of(rel), true)?;
        }
        Ok(())
    })?;
    Err(refused)
}

extern "C" fn h_mkdirat(dirfd: c_int, path: *const c_char, mode: c_uint) -> c_int {
    guard(-1, || {
        if let Err(e) = refuse_dots(dirfd, path, kura_fs::path::NameOp::Create) {
            return ret_int(Err(e));
        }
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_mkdirat, d, p, mode) as c_int }
        };
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| match resolve_parent(state, fs, start, rel, true)? {
            Resolved::Found { .. } => Err(libc::EEXIST),
            Resolved::Missing { parent, name } => {
                check_create_in(fs, parent)?;
                fs.mkdir(parent, &name, mode & 0o7777 & !umask_now(), owner()).map_err(fs_errno)?;
                Ok(0)
            }
            Resolved::Outside(abs) => outside(&abs, &raw_call),
        })
    })
}

extern "C" fn h_mkdir(path: *const c_char, mode: c_uint) -> c_int {
    h_mkdirat(libc::AT_FDCWD, path, mode)
}

extern "C" fn h_mknodat(dirfd: c_int, path: *const c_char, mode: c_uint, dev: libc::dev_t) -> c_int {
    guard(-1, || {
        if let Err(e) = refuse_dots(dirfd, path, kura_fs::path::NameOp::Create) {
            return ret_int(Err(e));
        }
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_mknodat, d, p, mode, dev) as c_int }
        };
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| match resolve_parent(state, fs, start, rel, false)? {
            Resolved::Found { .. } => Err(libc::EEXIST),
            Resolved::Missing { parent, name } => {
                let kind = if mode & libc::S_IFMT == 0 { libc::S_IFREG } else { mode & libc::S_IFMT };
                check_create_in(fs, parent)?;
                let perm = mode & 0o7777 & !umask_now();
                fs.create(parent, &name, kind | perm, dev as u32, b"", owner(), true).map_err(fs_errno)?;
                Ok(0)
            }
            Resolved::Outside(abs) => outside(&abs, &raw_call),
        })
    })
}

extern "C" fn h_mknod(path: *const c_char, mode: c_uint, dev: libc::dev_t) -> c_int {
    h_mknodat(libc::AT_FDCWD, path, mode, dev)
}

extern "C" fn h_unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    guard(-1, || {
        let op = if flags & libc::AT_REMOVEDIR != 0 { kura_fs::path::NameOp::Rmdir } else { kura_fs::path::NameOp::Unlink };
        if let Err(e) = refuse_dots(dirfd, path, op) {
            return ret_int(Err(e));
        }
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_unlinkat, d, p, flags) as c_int }
        };
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| {
            let rmdir = flags & libc::AT_REMOVEDIR != 0;
            if rmdir {
                match kura_fs::path::last_name(rel) {
                    Some(b".") => return Err(libc::EINVAL),
                    Some(b"..") => return Err(libc::ENOTEMPTY),
                    _ => {}
                }
            }
            // The last name is not followed, slash or not; `unlink("f/")` is ENOTDIR.
            let trimmed = kura_fs::path::trim_slashes(rel);
            match resolve_for_change(state, fs, start, trimmed, false)? {
                (Resolved::Found { entry, .. }, _) if !rmdir && trimmed.len() < rel.len() => Err(if entry.dtype == libc::DT_DIR { libc::EISDIR } else { libc::ENOTDIR }),
                (Resolved::Found { parent, name, entry }, walked) => {
                    if name.is_empty() {
                        return Err(libc::EBUSY);
                    }
                    let dir = fs.getattr_fresh(parent).map_err(fs_errno)?;
                    let victim = victim_of(fs, parent, &name, entry.clone(), walked)?.ok_or(libc::ENOENT)?;
                    cred().check_delete(&dir, &victim).map_err(fs_errno)?;
                    if rmdir {
                        fs.rmdir(parent, &name).map_err(fs_errno)?;
                        // This process's descriptors of the directory keep its last attributes
                        // (a chmod since their open shows in their fstat, as on Linux).
                        keep_dir_attributes(state, &victim);
                    } else {
                        if entry.dtype == libc::DT_DIR {
                            return Err(libc::EISDIR);
                        }
                        fs.unlink(parent, &name).map_err(fs_errno)?;
                    }
                    Ok(0)
                }
                (Resolved::Missing { .. }, _) => Err(libc::ENOENT),
                (Resolved::Outside(abs), _) => outside(&abs, &raw_call),
            }
        })
    })
}

extern "C" fn h_unlink(path: *const c_char) -> c_int {
    h_unlinkat(libc::AT_FDCWD, path, 0)
}

extern "C" fn h_rmdir(path: *const c_char) -> c_int {
    h_unlinkat(libc::AT_FDCWD, path, libc::AT_REMOVEDIR)
}

extern "C" fn h_renameat2(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char, flags: c_uint) -> c_int {
    guard(-1, || {
        // The kernel refuses RENAME_EXCHANGE with RENAME_NOREPLACE or RENAME_WHITEOUT before
        // it looks at either path.
        if flags & libc::RENAME_EXCHANGE != 0 && flags & (libc::RENAME_NOREPLACE | libc::RENAME_WHITEOUT) != 0 {
            return ret_int(Err(libc::EINVAL));
        }
        // With RENAME_NOREPLACE a new name of `.` or `..` is EEXIST (the kernel's do_renameat2).
        let new_op = if flags & libc::RENAME_NOREPLACE != 0 { kura_fs::path::NameOp::Create } else { kura_fs::path::NameOp::Rename };
        if let Err(e) = refuse_dots_of(&[(olddir, old, kura_fs::path::NameOp::Rename), (newdir, new, new_op)]) {
            return ret_int(Err(e));
        }
        let raw_call = |od: c_int, o: *const c_char, nd: c_int, n: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_renameat2, od, o, nd, n, flags) as c_int }
        };
        let Some(state) = active() else { return raw_call(olddir, old, newdir, new) };
        // SAFETY: libc's contract.
        let (Some(o), Some(n)) = (unsafe { bytes(old) }, unsafe { bytes(new) }) else {
            // The kernel may look the good one up first (ENOENT for a kura path), not EFAULT.
            return ret_int(Err(libc::EFAULT));
        };
        let (ot, nt) = match (classify(state, olddir, o), classify(state, newdir, n)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return ret_int(Err(e)),
        };
        let kernel_path = |t: &Target, dir: c_int, p: *const c_char| -> Option<(c_int, *const c_char)> {
            match t {
                Target::Kernel => Some((dir, p)),
                Target::KernelAbs(abs) => Some((libc::AT_FDCWD, abs.as_ptr().cast())),
                Target::Kura { .. } => None,
            }
        };
        match (kernel_path(&ot, olddir, old), kernel_path(&nt, newdir, new)) {
            (Some((od, op)), Some((nd, np))) => return raw_call(od, op, nd, np),
            (None, None) => {}
            _ => return ret_int(Err(libc::EXDEV)),
        }
        let (Target::Kura { start: os, rel: orel, .. }, Target::Kura { start: ns, rel: nrel, .. }) = (ot, nt) else {
            unreachable!("both kura: checked above")
        };
        ret_int(with_fs(state, |fs| {
            let cred = cred();
            // Linux walks to both parents before it looks at either name: a bad directory on
            // the new path (ENOTDIR, ELOOP) wins over a missing source.
            // Neither last name is followed, trailing slash or not (the kernel's rename lookups);
            // a slash only asks the source to be a directory.
            let (otrim, ntrim) = (kura_fs::path::trim_slashes(&orel), kura_fs::path::trim_slashes(&nrel));
            let slashed = otrim.len() < orel.len() || ntrim.len() < nrel.len();
            let (old_resolved, new_resolved) = (resolve_for_change(state, fs, os, otrim, false), resolve_for_change(state, fs, ns, ntrim, false));
            let ((old_resolved, old_walked), (new_resolved, new_walked)) = (old_resolved?, new_resolved?);
            let rf = RenameFlags { noreplace: flags & libc::RENAME_NOREPLACE != 0, exchange: flags & libc::RENAME_EXCHANGE != 0 };
            // The kernel's order once both names are looked up: no source, then a target that
            // RENAME_NOREPLACE refuses, then a slash after a source that is not a directory.
            if let Resolved::Found { entry, .. } = &old_resolved {
                if rf.noreplace && matches!(new_resolved, Resolved::Found { .. }) {
                    return Err(libc::EEXIST);
                }
                if slashed && entry.dtype != libc::DT_DIR {
                    return Err(libc::ENOTDIR);
                }
            }
            let (sp, sname) = match old_resolved {
                Resolved::Found { parent, name, entry } if !name.is_empty() => {
                    let victim = victim_of(fs, parent, &name, entry, old_walked)?.ok_or(libc::ENOENT)?;
                    cred.check_delete(&fs.getattr_fresh(parent).map_err(fs_errno)?, &victim).map_err(fs_errno)?;
                    (parent, name)
                }
                Resolved::Found { .. } => return Err(libc::EBUSY),
                Resolved::Missing { .. } => return Err(libc::ENOENT),
                Resolved::Outside(_) => return Err(libc::EXDEV),
            };
            let (dp, dname, replaced) = match new_resolved {
                Resolved::Found { parent, name, entry } if !name.is_empty() => {
                    // The target may be unlinked or replaced by another process meanwhile: the
                    // rename then creates the name, or replaces the new file (which fs.rename
                    // re-checks under its compare-and-swap).
                    let dir = fs.getattr_fresh(parent).map_err(fs_errno)?;
                    let target = victim_of(fs, parent, &name, entry, new_walked)?;
                    match &target {
                        Some(target) => cred.check_delete(&dir, target).map_err(fs_errno)?,
                        None => cred.check_create(&dir).map_err(fs_errno)?,
                    }
                    (parent, name, target)
                }
                Resolved::Found { .. } => return Err(libc::EBUSY),
                Resolved::Missing { parent, name } => {
                    cred.check_create(&fs.getattr_fresh(parent).map_err(fs_errno)?).map_err(fs_errno)?;
                    (parent, name, None)
                }
                Resolved::Outside(_) => return Err(libc::EXDEV),
            };
            fs.rename(sp, &sname, dp, &dname, rf).map_err(fs_errno)?;
            // A directory renamed over is removed: this process's descriptors of it keep its
            // last attributes, as after rmdir.
            if let Some(replaced) = replaced.filter(|t| !rf.exchange && kura_fs::layout::is_dir(t.mode)) {
                keep_dir_attributes(state, &replaced);
            }
            Ok(0)
        }))
    })
}

extern "C" fn h_renameat(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char) -> c_int {
    h_renameat2(olddir, old, newdir, new, 0)
}

extern "C" fn h_rename(old: *const c_char, new: *const c_char) -> c_int {
    h_renameat2(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0)
}

extern "C" fn h_linkat(olddir: c_int, old: *const c_char, newdir: c_int, new: *const c_char, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |od: c_int, o: *const c_char, nd: c_int, n: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_linkat, od, o, nd, n, flags) as c_int }
        };
        let Some(state) = active() else { return raw_call(olddir, old, newdir, new) };
        // SAFETY: libc's contract.
        let (Some(o), Some(n)) = (unsafe { bytes(old) }, unsafe { bytes(new) }) else {
            // The kernel may look the good one up first (ENOENT for a kura path), not EFAULT.
            return ret_int(Err(libc::EFAULT));
        };
        if let Some(source) = link_source(state, olddir, o, flags) {
            return ret_int(match classify(state, newdir, n) {
                Err(e) => Err(e),
                Ok(Target::Kura { start, rel, .. }) => with_fs(state, |fs| link_new_name(state, fs, source, n, start, &rel)),
                Ok(_) => Err(libc::EXDEV),
            });
        }
        match (classify(state, olddir, o), classify(state, newdir, n)) {
            (Err(e), _) | (_, Err(e)) => ret_int(Err(e)),
            (Ok(Target::Kura { start: os, rel: orel, .. }), Ok(Target::Kura { start: ns, rel: nrel, .. })) => ret_int(with_fs(state, |fs| {
                let ino = match resolve(state, fs, os, &orel, flags & libc::AT_SYMLINK_FOLLOW != 0)? {
                    Resolved::Found { entry, .. } => entry.ino,
                    Resolved::Missing { .. } => return Err(libc::ENOENT),
                    Resolved::Outside(_) => return Err(libc::EXDEV),
                };
                link_new_name(state, fs, Some(ino), n, ns, &nrel)
            })),
            // An empty old path names nothing without `AT_EMPTY_PATH`.
            (Ok(Target::Kura { .. }), _) | (_, Ok(Target::Kura { .. })) if o.is_empty() && flags & libc::AT_EMPTY_PATH == 0 => ret_int(Err(libc::ENOENT)),
            (Ok(Target::Kura { .. }), _) | (_, Ok(Target::Kura { .. })) => ret_int(Err(libc::EXDEV)),
            (Ok(ot), Ok(nt)) => {
                let (od, op) = match &ot {
                    Target::KernelAbs(a) => (libc::AT_FDCWD, a.as_ptr().cast()),
                    _ => (olddir, old),
                };
                let (nd, np) = match &nt {
                    Target::KernelAbs(a) => (libc::AT_FDCWD, a.as_ptr().cast()),
                    _ => (newdir, new),
                };
                raw_call(od, op, nd, np)
            }
        }
    })
}

/// `linkat`'s old file when a kura descriptor names it: `AT_EMPTY_PATH` with an empty path
/// (`olddir` itself), or `/proc/self/fd/N` and the like ([`crate::paths::descriptor_link`]),
/// which Linux follows with `AT_SYMLINK_FOLLOW` to the open file itself, whatever its name is
/// now (an `O_TMPFILE` file has none): `Some(Some(ino))`. Without that flag such a path names
/// procfs's own link, a file outside the mount: `Some(None)`. `None`: a path to walk, or not
/// kura's. (Linux before 6.10 let `AT_EMPTY_PATH` through only with `CAP_DAC_READ_SEARCH`;
/// since, also for a file the caller opened itself, as every kura descriptor is.)
fn link_source(state: &State, olddir: c_int, old: &[u8], flags: c_int) -> Option<Option<u64>> {
    if old.is_empty() {
        if flags & libc::AT_EMPTY_PATH == 0 {
            return None;
        }
        return state.fds.get(olddir).map(|of| Some(of.ino));
    }
    match crate::paths::descriptor_link(state, old)? {
        (of, b"") => Some((flags & libc::AT_SYMLINK_FOLLOW != 0).then_some(of.ino)),
        _ => None,
    }
}

/// `linkat`'s new name `n` (`rel` from `start`, in the mount) for inode `ino` (`None`: a file
/// outside the mount, `EXDEV`), after the old file's lookup, with the kernel's checks in its
/// order: the name, the directory, `EEXIST`, `EXDEV`, `EACCES`, then the file's own
/// (`EPERM` for a directory, `ENOENT` for a file without a name that may not get one).
fn link_new_name(state: &State, fs: &Fs, ino: Option<u64>, n: &[u8], start: u64, rel: &[u8]) -> Result<c_int, i32> {
    // `.` or `..` as the new name, after the old name's lookup (as the kernel).
    if let Err(refused) = kura_fs::path::check_last_component(n, kura_fs::path::NameOp::Create) {
        return Err(after_parent_walk(state, fs, start, rel, refused.errno()));
    }
    match resolve_parent(state, fs, start, rel, false)? {
        Resolved::Missing { parent, name } => {
            let ino = ino.ok_or(libc::EXDEV)?;
            check_create_in(fs, parent)?;
            fs.link(ino, parent, &name).map_err(fs_errno)?;
            Ok(0)
        }
        Resolved::Found { .. } => Err(libc::EEXIST),
        Resolved::Outside(_) => Err(libc::EXDEV),
    }
}

extern "C" fn h_link(old: *const c_char, new: *const c_char) -> c_int {
    h_linkat(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0)
}

extern "C" fn h_symlinkat(target: *const c_char, dirfd: c_int, path: *const c_char) -> c_int {
    guard(-1, || {
        if let Err(e) = refuse_dots(dirfd, path, kura_fs::path::NameOp::Create) {
            return ret_int(Err(e));
        }
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_symlinkat, target, d, p) as c_int }
        };
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| {
            // SAFETY: libc's contract.
            let t = unsafe { bytes(target) }.ok_or(libc::EFAULT)?;
            kura_fs::path::check_path_len(t).map_err(|e| e.errno())?;
            match resolve_parent(state, fs, start, rel, false)? {
                Resolved::Found { .. } => Err(libc::EEXIST),
                Resolved::Missing { parent, name } => {
                    check_create_in(fs, parent)?;
                    fs.symlink(parent, &name, t, owner()).map_err(fs_errno)?;
                    Ok(0)
                }
                Resolved::Outside(abs) => outside(&abs, &raw_call),
            }
        })
    })
}

extern "C" fn h_symlink(target: *const c_char, path: *const c_char) -> c_int {
    h_symlinkat(target, libc::AT_FDCWD, path)
}

/// `/proc/self/fd/N` (or this pid's) of a kura descriptor: its path.
fn proc_fd_path(state: &State, p: &[u8]) -> Option<Vec<u8>> {
    match crate::paths::descriptor_link(state, p)? {
        (of, b"") => Some(of.path.clone()),
        _ => None,
    }
}

extern "C" fn h_readlinkat(dirfd: c_int, path: *const c_char, buf: *mut c_char, size: usize) -> isize {
    guard(-1, || {
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_readlinkat, d, p, buf, size) as c_int }
        };
        // SAFETY: libc's contract.
        if unsafe { bytes(path) }.is_some_and(|p| p.starts_with(b"/dev/std")) {
            // /dev/stdout and the like are the kernel's symlinks to /proc/self/fd/N.
            return raw_call(dirfd, path) as isize;
        }
        if let Some(state) = active()
            // SAFETY: libc's contract.
            && let Some(p) = unsafe { bytes(path) }
            && let Some(target) = proc_fd_path(state, p)
        {
            return copy_link(&target, buf, size) as isize;
        }
        // An empty path names the descriptor's own file: a link opened with O_PATH|O_NOFOLLOW.
        if let Some(state) = active()
            // SAFETY: libc's contract.
            && unsafe { bytes(path) }.is_some_and(<[u8]>::is_empty)
            && let Some(of) = state.fds.get(dirfd)
        {
            return ret(with_fs(state, |fs| {
                let target = kura_fs::ns::link_target(fs.getattr(of.ino).map_err(fs_errno)?).map_err(|_| libc::ENOENT)?;
                if size == 0 {
                    return Err(libc::EINVAL);
                }
                Ok(copy_link(&target, buf, size) as c_long)
            })) as isize;
        }
        // The link's inode comes with the walk (one round trip for a path walked before).
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| match resolve_inode(state, fs, start, rel, false)? {
            (Resolved::Found { .. }, Some(inode)) => {
                if size == 0 {
                    return Err(libc::EINVAL);
                }
                let target = kura_fs::ns::link_target(inode).map_err(fs_errno)?;
                Ok(copy_link(&target, buf, size) as c_int)
            }
            (Resolved::Found { .. }, None) | (Resolved::Missing { .. }, _) => Err(libc::ENOENT),
            (Resolved::Outside(abs), _) => outside(&abs, &raw_call),
        }) as isize
    })
}

/// readlink(2)'s copy: as much of `target` as `size` bytes hold, no NUL; the bytes copied.
fn copy_link(target: &[u8], buf: *mut c_char, size: usize) -> usize {
    let n = target.len().min(size);
    // SAFETY: the caller's buffer holds `size` bytes (readlink(2)'s contract).
    unsafe { std::ptr::copy_nonoverlapping(target.as_ptr(), buf.cast::<u8>(), n) };
    n
}

extern "C" fn h_readlink(path: *const c_char, buf: *mut c_char, size: usize) -> isize {
    h_readlinkat(libc::AT_FDCWD, path, buf, size)
}

pub(crate) fn check_access(inode: &Inode, mode: c_int, effective: bool) -> Result<c_int, i32> {
    if mode & !(libc::R_OK | libc::W_OK | libc::X_OK) != 0 {
        return Err(libc::EINVAL);
    }
    // SAFETY: id getters cannot fail.
    let (uid, gid) = unsafe { if effective { (libc::geteuid(), libc::getegid()) } else { (libc::getuid(), libc::getgid()) } };
    let want = (mode & 7) as u32;
    if want == 0 {
        return Ok(0);
    }
    if uid == 0 {
        if want & libc::X_OK as u32 != 0 && !kura_fs::layout::is_dir(inode.mode) && inode.mode & 0o111 == 0 {
            return Err(libc::EACCES);
        }
        return Ok(0);
    }
    let bits = if uid == inode.uid {
        (inode.mode >> 6) & 7
    } else if gid == inode.gid {
        (inode.mode >> 3) & 7
    } else {
        inode.mode & 7
    };
    if bits & want == want { Ok(0) } else { Err(libc::EACCES) }
}

extern "C" fn h_faccessat(dirfd: c_int, path: *const c_char, mode: c_int, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel (faccessat2 takes flags).
            unsafe { crate::raw_syscall!(libc::SYS_faccessat2, d, p, mode, flags) as c_int }
        };
        path_op(dirfd, path, raw_call, |state, fs, start, rel, _| match resolve_inode(state, fs, start, rel, flags & libc::AT_SYMLINK_NOFOLLOW == 0)? {
            (Resolved::Found { .. }, Some(inode)) => check_access(&inode, mode, flags & libc::AT_EACCESS != 0),
            (Resolved::Outside(abs), _) => outside(&abs, &raw_call),
            (Resolved::Found { .. } | Resolved::Missing { .. }, _) => Err(libc::ENOENT),
        })
    })
}

extern "C" fn h_access(path: *const c_char, mode: c_int) -> c_int {
    h_faccessat(libc::AT_FDCWD, path, mode, 0)
}

extern "C" fn h_euidaccess(path: *const c_char, mode: c_int) -> c_int {
    h_faccessat(libc::AT_FDCWD, path, mode, libc::AT_EACCESS)
}

/// The inode a `*at` attribute call names (`AT_EMPTY_PATH`/NULL path: `dirfd` itself).
/// `change` gets the inode as the path walk just read it (for a descriptor: as
/// [`Fs::getattr_open`] answers, from the record the open wrote when that is fresh): the
/// permission check needs no read of its own, and the change's compare-and-swap starts from
/// that record (one round trip each for a path walked before).
fn attr_op(dirfd: c_int, path: *const c_char, flags: c_int, raw_call: impl Fn(c_int, *const c_char) -> c_int, attr: SetAttr, times_now: bool) -> c_int {
    let Some(state) = active() else { return raw_call(dirfd, path) };
    // SAFETY: libc's contract.
    let p = unsafe { bytes(path) };
    if p.is_none_or(<[u8]>::is_empty) {
        if let Some(of) = state.fds.get(dirfd) {
            // fchmod(fd) and futimens(fd) are I/O on the descriptor; the AT_EMPTY_PATH forms
            // (a path of "") name the file, and take an O_PATH one.
            if let (None, Err(e)) = (p, no_io(&of)) {
                return ret_int(Err(e));
            }
            return ret_int(with_fs(state, |fs| match fs.getattr_open(of.ino) {
                // A directory removed while open: its attributes live on in this process's
                // descriptors until they close, and change there, as on Linux: in every
                // description of it (one inode, however many opens).
                Err(FsError::Stale) if of.is_dir => {
                    let mut inode = open_inode(fs, &of)?;
                    let attr = cred().check_setattr(&inode, attr, times_now).map_err(fs_errno)?;
                    kura_fs::ns::apply_setattr(&mut inode, &attr, kura_fs::ns::now_ns());
                    keep_dir_attributes(state, &inode);
                    *of.dir_inode.lock() = Some(inode);
                    Ok(0)
                }
                known => set_checked(fs, of.ino, attr, times_now, known.ok()).map(|()| 0),
            }));
        }
        return raw_call(dirfd, path);
    }
    path_op(dirfd, path, &raw_call, |state, fs, start, rel, _| match resolve_inode(state, fs, start, rel, flags & libc::AT_SYMLINK_NOFOLLOW == 0)? {
        (Resolved::Found { entry, .. }, inode) => set_checked(fs, entry.ino, attr, times_now, inode).map(|()| 0),
        (Resolved::Missing { .. }, _) => Err(libc::ENOENT),
        (Resolved::Outside(abs), _) => outside(&abs, &raw_call),
    })
}

fn set(fs: &Arc<Fs>, ino: u64, attr: SetAttr) -> Result<(), i32> {
    set_checked(fs, ino, attr, false, None)
}

/// `setattr` after the permission checks; `times_now`: the times asked are "now"; `known`:
/// the inode as read during this call (else it is read here).
fn set_checked(fs: &Arc<Fs>, ino: u64, attr: SetAttr, times_now: bool, known: Option<Inode>) -> Result<(), i32> {
    let inode = match known {
        Some(inode) => inode,
        None => fs.getattr(ino).map_err(fs_errno)?,
    };
    let attr = cred().check_setattr(&inode, attr, times_now).map_err(fs_errno)?;
    fs.setattr(ino, attr).map(|_| ()).map_err(fs_errno)
}

/// utimensat's times are all "now" or omitted (write permission suffices for those).
fn times_are_now(times: *const libc::timespec) -> bool {
    if times.is_null() {
        return true;
    }
    // SAFETY: utimensat(2)'s contract: two timespecs.
    let t = unsafe { std::slice::from_raw_parts(times, 2) };
    t.iter().all(|ts| ts.tv_nsec == libc::UTIME_NOW || ts.tv_nsec == libc::UTIME_OMIT)
}

extern "C" fn h_fchmodat(dirfd: c_int, path: *const c_char, mode: c_uint, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |d: c_int, p: *const c_char| {
            if flags == 0 {
                // SAFETY: passing the caller's arguments to the kernel.
                return unsafe { crate::raw_syscall!(libc::SYS_fchmodat, d, p, mode) as c_int };
            }
            // fchmodat2 (Linux 6.6) takes the flags glibc otherwise emulates: a symlink with
            // AT_SYMLINK_NOFOLLOW is EOPNOTSUPP, as glibc answers.
            // SAFETY: passing the caller's arguments to the kernel.
            let r = unsafe { crate::raw_syscall!(SYS_FCHMODAT2, d, p, mode, flags) as c_int };
            if r < 0 && errno() == libc::ENOSYS {
                set_errno(libc::EOPNOTSUPP);
            }
            r
        };
        attr_op(dirfd, path, flags, raw_call, SetAttr { mode: Some(mode), ..SetAttr::default() }, false)
    })
}

extern "C" fn h_chmod(path: *const c_char, mode: c_uint) -> c_int {
    h_fchmodat(libc::AT_FDCWD, path, mode, 0)
}

extern "C" fn h_fchmod(fd: c_int, mode: c_uint) -> c_int {
    guard(-1, || {
        // SAFETY: integers.
        let raw_call = |_: c_int, _: *const c_char| unsafe { crate::raw_syscall!(libc::SYS_fchmod, fd, mode) as c_int };
        attr_op(fd, std::ptr::null(), 0, raw_call, SetAttr { mode: Some(mode), ..SetAttr::default() }, false)
    })
}

fn id(v: c_uint) -> Option<u32> {
    (v != u32::MAX).then_some(v)
}

extern "C" fn h_fchownat(dirfd: c_int, path: *const c_char, uid: c_uint, gid: c_uint, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_fchownat, d, p, uid, gid, flags) as c_int }
        };
        attr_op(dirfd, path, flags, raw_call, SetAttr { uid: id(uid), gid: id(gid), ..SetAttr::default() }, false)
    })
}

extern "C" fn h_chown(path: *const c_char, uid: c_uint, gid: c_uint) -> c_int {
    h_fchownat(libc::AT_FDCWD, path, uid, gid, 0)
}

extern "C" fn h_lchown(path: *const c_char, uid: c_uint, gid: c_uint) -> c_int {
    h_fchownat(libc::AT_FDCWD, path, uid, gid, libc::AT_SYMLINK_NOFOLLOW)
}

extern "C" fn h_fchown(fd: c_int, uid: c_uint, gid: c_uint) -> c_int {
    guard(-1, || {
        // SAFETY: integers.
        let raw_call = |_: c_int, _: *const c_char| unsafe { crate::raw_syscall!(libc::SYS_fchown, fd, uid, gid) as c_int };
        attr_op(fd, std::ptr::null(), 0, raw_call, SetAttr { uid: id(uid), gid: id(gid), ..SetAttr::default() }, false)
    })
}

fn times_attr(times: *const libc::timespec) -> SetAttr {
    let now = kura_fs::ns::now_ns();
    if times.is_null() {
        return SetAttr { atime_ns: Some(now), mtime_ns: Some(now), ..SetAttr::default() };
    }
    // SAFETY: utimensat(2)'s contract: two timespecs.
    let t = unsafe { std::slice::from_raw_parts(times, 2) };
    let pick = |ts: &libc::timespec| match ts.tv_nsec {
        libc::UTIME_OMIT => None,
        libc::UTIME_NOW => Some(now),
        n => Some(ts.tv_sec * 1_000_000_000 + n),
    };
    SetAttr { atime_ns: pick(&t[0]), mtime_ns: pick(&t[1]), ..SetAttr::default() }
}

extern "C" fn h_utimensat(dirfd: c_int, path: *const c_char, times: *const libc::timespec, flags: c_int) -> c_int {
    guard(-1, || {
        let raw_call = |d: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_utimensat, d, p, times, flags) as c_int }
        };
        attr_op(dirfd, path, flags, raw_call, times_attr(times), times_are_now(times))
    })
}

extern "C" fn h_futimens(fd: c_int, times: *const libc::timespec) -> c_int {
    h_utimensat(fd, std::ptr::null(), times, 0)
}

fn timeval_pair(tv: *const libc::timeval) -> Option<[libc::timespec; 2]> {
    if tv.is_null() {
        return None;
    }
    // SAFETY: utimes(2)'s contract: two timevals.
    let t = unsafe { std::slice::from_raw_parts(tv, 2) };
    Some([0, 1].map(|i| &t[i]).map(|v| libc::timespec { tv_sec: v.tv_sec, tv_nsec: v.tv_usec * 1000 }))
}

extern "C" fn h_utimes(path: *const c_char, tv: *const libc::timeval) -> c_int {
    let ts = timeval_pair(tv);
    h_utimensat(libc::AT_FDCWD, path, ts.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()), 0)
}

extern "C" fn h_lutimes(path: *const c_char, tv: *const libc::timeval) -> c_int {
    let ts = timeval_pair(tv);
    h_utimensat(libc::AT_FDCWD, path, ts.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()), libc::AT_SYMLINK_NOFOLLOW)
}

extern "C" fn h_futimes(fd: c_int, tv: *const libc::timeval) -> c_int {
    let ts = timeval_pair(tv);
    h_utimensat(fd, std::ptr::null(), ts.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()), 0)
}

extern "C" fn h_utime(path: *const c_char, buf: *const libc::utimbuf) -> c_int {
    if buf.is_null() {
        return h_utimensat(libc::AT_FDCWD, path, std::ptr::null(), 0);
    }
    // SAFETY: utime(2)'s contract.
    let b = unsafe { &*buf };
    let ts = [libc::timespec { tv_sec: b.actime, tv_nsec: 0 }, libc::timespec { tv_sec: b.modtime, tv_nsec: 0 }];
    h_utimensat(libc::AT_FDCWD, path, ts.as_ptr(), 0)
}

// ---------------------------------------------------------------------------------------
// extended attributes (kept in the inode record: kura_fs::xattr)

/// One extended attribute call, on a kura inode.
#[derive(Clone, Copy)]
enum Xattr {
    Get { name: *const c_char, value: *mut c_void, size: usize },
    List { list: *mut c_char, size: usize },
    Set { name: *const c_char, value: *const c_void, size: usize, flags: c_int },
    Remove { name: *const c_char },
}

impl Xattr {
    /// Does it for `ino`: `getxattr(2)`'s and `listxattr(2)`'s length (with size 0, the
    /// length needed; `ERANGE` when the buffer is too small), 0 for the others.
    fn on(self, fs: &Fs, ino: u64) -> Result<c_int, i32> {
        self.on_read(fs, ino, None)
    }

    /// [`Xattr::on`], with the inode as just read by a path walk when there is one (reading
    /// calls need nothing else).
    fn on_read(self, fs: &Fs, ino: u64, inode: Option<&Inode>) -> Result<c_int, i32> {
        let cred = cred_unless_root();
        // SAFETY: the caller's NUL-terminated name (libc's contract; null is EFAULT).
        let name = |n: *const c_char| unsafe { bytes(n) }.ok_or(libc::EFAULT);
        let copy_out = |data: Vec<u8>, buf: *mut u8, size: usize| -> Result<c_int, i32> {
            if size == 0 {
                return Ok(data.len() as c_int);
            }
            if data.len() > size {
                return Err(libc::ERANGE);
            }
            // SAFETY: the caller's buffer holds `size` bytes, at least `data.len()`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len()) };
            Ok(data.len() as c_int)
        };
        match self {
            Xattr::Get { name: n, value, size } => {
                let value_read = match inode {
                    Some(inode) => kura_fs::xattr::getxattr_of(inode, name(n)?, cred.as_ref()),
                    None => fs.getxattr(ino, name(n)?, cred.as_ref()),
                };
                copy_out(value_read.map_err(fs_errno)?, value.cast(), size)
            }
            Xattr::List { list, size } => {
                let names = match inode {
                    Some(inode) => Ok(kura_fs::xattr::listxattr_of(inode, cred.as_ref())),
                    None => fs.listxattr(ino, cred.as_ref()),
                };
                copy_out(names.map_err(fs_errno)?, list.cast(), size)
            }
            Xattr::Set { name: n, value, size, flags } => {
                if size > kura_fs::layout::XATTR_VALUE_BYTES_MAX {
                    return Err(libc::E2BIG);
                }
                let value: &[u8] = if size == 0 {
                    &[]
                } else {
                    // SAFETY: the caller's value of `size` bytes.
                    unsafe { std::slice::from_raw_parts(value.cast(), size) }
                };
                let flags = kura_fs::XattrFlags::from_bits(flags).map_err(fs_errno)?;
                fs.setxattr(ino, name(n)?, value, flags, cred.as_ref()).map_err(fs_errno)?;
                Ok(0)
            }
            Xattr::Remove { name: n } => {
                fs.removexattr(ino, name(n)?, cred.as_ref()).map_err(fs_errno)?;
                Ok(0)
            }
        }
    }
}

/// `getxattr`, `setxattr`, ... of a path (`follow`: of what a final symlink leads to).
fn xattr_path(path: *const c_char, follow: bool, call: Xattr, raw_call: impl Fn(c_int, *const c_char) -> c_int) -> isize {
    guard(-1, || {
        let reads = matches!(call, Xattr::Get { .. } | Xattr::List { .. });
        path_op(libc::AT_FDCWD, path, &raw_call, |state, fs, start, rel, _| {
            // A reading call takes the inode from the walk (one round trip for a path walked
            // before); a change reads it afresh for its compare-and-swap.
            let (resolved, inode) = if reads { resolve_inode(state, fs, start, rel, follow)? } else { (resolve(state, fs, start, rel, follow)?, None) };
            match resolved {
                Resolved::Found { entry, .. } => call.on_read(fs, entry.ino, inode.as_ref()),
                Resolved::Missing { .. } => Err(libc::ENOENT),
                Resolved::Outside(abs) => outside(&abs, &raw_call),
            }
        }) as isize
    })
}

/// `fgetxattr`, `fsetxattr`, ... of a descriptor.
fn xattr_fd(fd: c_int, call: Xattr, raw_call: impl FnOnce() -> isize) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            return ret_int(with_fs(state, |fs| call.on(fs, of.ino).map_err(|e| if e == libc::ENOENT { libc::ESTALE } else { e }))) as isize;
        }
        raw_call()
    })
}

extern "C" fn h_getxattr(path: *const c_char, name: *const c_char, value: *mut c_void, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, true, Xattr::Get { name, value, size }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_getxattr, p, name, value, size) as c_int })
}

extern "C" fn h_lgetxattr(path: *const c_char, name: *const c_char, value: *mut c_void, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, false, Xattr::Get { name, value, size }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_lgetxattr, p, name, value, size) as c_int })
}

extern "C" fn h_fgetxattr(fd: c_int, name: *const c_char, value: *mut c_void, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_fd(fd, Xattr::Get { name, value, size }, || unsafe { crate::raw_syscall!(libc::SYS_fgetxattr, fd, name, value, size) as isize })
}

extern "C" fn h_listxattr(path: *const c_char, list: *mut c_char, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, true, Xattr::List { list, size }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_listxattr, p, list, size) as c_int })
}

extern "C" fn h_llistxattr(path: *const c_char, list: *mut c_char, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, false, Xattr::List { list, size }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_llistxattr, p, list, size) as c_int })
}

extern "C" fn h_flistxattr(fd: c_int, list: *mut c_char, size: usize) -> isize {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_fd(fd, Xattr::List { list, size }, || unsafe { crate::raw_syscall!(libc::SYS_flistxattr, fd, list, size) as isize })
}

extern "C" fn h_setxattr(path: *const c_char, name: *const c_char, value: *const c_void, size: usize, flags: c_int) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, true, Xattr::Set { name, value, size, flags }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_setxattr, p, name, value, size, flags) as c_int }) as c_int
}

extern "C" fn h_lsetxattr(path: *const c_char, name: *const c_char, value: *const c_void, size: usize, flags: c_int) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, false, Xattr::Set { name, value, size, flags }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_lsetxattr, p, name, value, size, flags) as c_int }) as c_int
}

extern "C" fn h_fsetxattr(fd: c_int, name: *const c_char, value: *const c_void, size: usize, flags: c_int) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_fd(fd, Xattr::Set { name, value, size, flags }, || unsafe { crate::raw_syscall!(libc::SYS_fsetxattr, fd, name, value, size, flags) as isize }) as c_int
}

extern "C" fn h_removexattr(path: *const c_char, name: *const c_char) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, true, Xattr::Remove { name }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_removexattr, p, name) as c_int }) as c_int
}

extern "C" fn h_lremovexattr(path: *const c_char, name: *const c_char) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_path(path, false, Xattr::Remove { name }, |_, p| unsafe { crate::raw_syscall!(libc::SYS_lremovexattr, p, name) as c_int }) as c_int
}

extern "C" fn h_fremovexattr(fd: c_int, name: *const c_char) -> c_int {
    // SAFETY: passing the caller's arguments to the kernel.
    xattr_fd(fd, Xattr::Remove { name }, || unsafe { crate::raw_syscall!(libc::SYS_fremovexattr, fd, name) as isize }) as c_int
}

// ---------------------------------------------------------------------------------------
// statfs

extern "C" fn h_statfs(path: *const c_char, buf: *mut libc::statfs) -> c_int {
    guard(-1, || {
        let raw_call = |_: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_statfs, p, buf) as c_int }
        };
        path_op(libc::AT_FDCWD, path, raw_call, |state, fs, start, rel, _| match resolve(state, fs, start, rel, true)? {
            Resolved::Found { .. } => {
                let s = fs.statfs().map_err(fs_errno)?;
                // SAFETY: the caller's buffer is a struct statfs.
                unsafe { *buf = s };
                Ok(0)
            }
            Resolved::Missing { .. } => Err(libc::ENOENT),
            Resolved::Outside(abs) => outside(&abs, &raw_call),
        })
    })
}

extern "C" fn h_fstatfs(fd: c_int, buf: *mut libc::statfs) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && state.fds.contains(fd)
        {
            return ret_int(with_fs(state, |fs| {
                let s = fs.statfs().map_err(fs_errno)?;
                // SAFETY: the caller's buffer is a struct statfs.
                unsafe { *buf = s };
                Ok(0)
            }));
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_fstatfs, fd, buf) as c_int }
    })
}

// ---------------------------------------------------------------------------------------
// working directory

extern "C" fn h_chdir(path: *const c_char) -> c_int {
    guard(-1, || {
        let raw_call = |_: c_int, p: *const c_char| {
            // SAFETY: passing the caller's arguments to the kernel.
            unsafe { crate::raw_syscall!(libc::SYS_chdir, p) as c_int }
        };
        let Some(state) = active() else { return raw_call(0, path) };
        // SAFETY: libc's contract.
        let Some(p) = (unsafe { bytes(path) }) else { return raw_call(0, path) };
        let target = match classify(state, libc::AT_FDCWD, p) {
            Ok(t) => t,
            Err(e) => return ret_int(Err(e)),
        };
        let kernel = |p: *const c_char| {
            let r = raw_call(0, p);
            if r == 0 {
                *state.cwd.write() = None;
            }
            r
        };
        match target {
            Target::Kernel => kernel(path),
            Target::KernelAbs(abs) => kernel(abs.as_ptr().cast()),
            Target::Kura { start, rel, abs } => ret_int(with_fs(state, |fs| match resolve_with_path(state, fs, start, &rel, &abs)? {
                (Resolved::Found { entry, .. }, path) => {
                    if entry.dtype != libc::DT_DIR {
                        return Err(libc::ENOTDIR);
                    }
                    if let Some(cred) = cred_unless_root() {
                        cred.check_access(&fs.getattr(entry.ino).map_err(fs_errno)?, kura_fs::ns::MAY_EXEC).map_err(fs_errno)?;
                    }
                    *state.cwd.write() = Some(path);
                    Ok(0)
                }
                (Resolved::Missing { .. }, _) => Err(libc::ENOENT),
                (Resolved::Outside(abs), _) => {
                    let c = c_path(&abs);
                    let r = kernel(c.as_ptr().cast());
                    if r < 0 { Err(errno()) } else { Ok(0) }
                }
            })),
        }
    })
}

extern "C" fn h_fchdir(fd: c_int) -> c_int {
    guard(-1, || {
        if let Some(state) = active()
            && let Some(of) = state.fds.get(fd)
        {
            if !of.is_dir {
                return ret_int(Err(libc::ENOTDIR));
            }
            if let Some(cred) = cred_unless_root()
                && let Err(e) = with_fs(state, |fs| cred.check_access(&open_inode(fs, &of)?, kura_fs::ns::MAY_EXEC).map_err(fs_errno))
            {
                return ret_int(Err(e));
            }
            // The directory's physical path, as chdir's, if its path at the open still leads
            // to it (a directory renamed since keeps the old path).
            let physical = kura_fs::path::rel_in_mount(&of.path, &state.mount).and_then(|rel| {
                with_fs(state, |fs| match resolve_with_path(state, fs, kura_fs::ROOT_INO, &rel, &of.path)? {
                    (Resolved::Found { entry, .. }, path) if entry.ino == of.ino => Ok(Some(path)),
                    _ => Ok(None),
                })
                .ok()
                .flatten()
            });
            *state.cwd.write() = Some(physical.unwrap_or_else(|| of.path.clone()));
            return 0;
        }
        // SAFETY: an integer.
        let r = unsafe { crate::raw_syscall!(libc::SYS_fchdir, fd) as c_int };
        if r == 0
            && let Some(state) = state::get()
        {
            *state.cwd.write() = None;
        }
        r
    })
}

extern "C" fn h_getcwd(buf: *mut c_char, size: usize) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let virtual_cwd = state::get().and_then(|s| s.cwd.read().clone());
        let (text, from_kernel) = match virtual_cwd {
            Some(p) => (p, false),
            None => {
                let mut tmp = vec![0u8; CWD_BYTES_MAX];
                // SAFETY: our buffer of CWD_BYTES_MAX bytes.
                let n = unsafe { crate::raw_syscall!(libc::SYS_getcwd, tmp.as_mut_ptr(), tmp.len()) };
                if n < 0 {
                    return std::ptr::null_mut();
                }
                tmp.truncate(n as usize - 1);
                (tmp, true)
            }
        };
        let _ = from_kernel;
        let need = text.len() + 1;
        let out = if buf.is_null() {
            let len = if size == 0 { need } else { size };
            if len < need {
                set_errno(libc::ERANGE);
                return std::ptr::null_mut();
            }
            // SAFETY: malloc, freed by the caller (getcwd's contract).
            let p = unsafe { libc::malloc(len) }.cast::<c_char>();
            if p.is_null() {
                set_errno(libc::ENOMEM);
                return p;
            }
            p
        } else {
            if size == 0 {
                set_errno(libc::EINVAL);
                return std::ptr::null_mut();
            }
            if size < need {
                set_errno(libc::ERANGE);
                return std::ptr::null_mut();
            }
            buf
        };
        // SAFETY: `out` holds at least `need` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), text.len());
            *out.add(text.len()) = 0;
        }
        out
    })
}

// ---------------------------------------------------------------------------------------
// mmap, copy_file_range, sendfile

extern "C" fn h_mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, offset: i64) -> *mut c_void {
    guard(libc::MAP_FAILED, || {
        let raw_call = |flags: c_int, fd: c_int, offset: i64, prot: c_int| {
            // SAFETY: passing the caller's arguments to the kernel.
            let p = unsafe { crate::raw_syscall!(libc::SYS_mmap, addr, len, prot, flags, fd, offset) };
            if p == -1 { libc::MAP_FAILED } else { p as *mut c_void }
        };
        let Some(state) = active() else { return raw_call(flags, fd, offset, prot) };
        let Some(of) = state.fds.get(fd) else { return raw_call(flags, fd, offset, prot) };
        if flags & libc::MAP_ANONYMOUS != 0 {
            return raw_call(flags, fd, offset, prot);
        }
        let shared = flags & libc::MAP_SHARED_VALIDATE & libc::MAP_SHARED != 0;
        if of.is_dir || offset < 0 || offset % 4096 != 0 || len == 0 {
            set_errno(if of.is_dir { libc::ENODEV } else { libc::EINVAL });
            return libc::MAP_FAILED;
        }
        if shared {
            // As the kernel: every shared mapping needs a descriptor open for reading, a
            // writable one a descriptor open for reading and writing, not appending.
            let accmode = of.flags() & libc::O_ACCMODE;
            let writable = accmode == libc::O_RDWR && of.flags() & libc::O_APPEND == 0;
            if accmode == libc::O_WRONLY || (prot & libc::PROT_WRITE != 0 && !writable) {
                set_errno(libc::EACCES);
                return libc::MAP_FAILED;
            }
            let mapped = with_fs(state, |fs| state.maps.map(fs, node_of(fs, &of)?, of.ino, addr, len, prot, flags, offset));
            return match mapped {
                Ok(p) => p,
                Err(e) => {
                    set_errno(e);
                    libc::MAP_FAILED
                }
            };
        }
        // A private copy of the file's bytes.
        let anon_flags = (flags & !libc::MAP_SHARED_VALIDATE) | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let p = raw_call(anon_flags, -1, 0, libc::PROT_READ | libc::PROT_WRITE);
        if p == libc::MAP_FAILED {
            return p;
        }
        // SAFETY: `p` is our fresh mapping of `len` bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
        let filled = with_fs(state, |fs| {
            let node = node_of(fs, &of)?;
            fs.read(node, offset as u64, dst).map_err(fs_errno)
        });
        if let Err(e) = filled {
            // SAFETY: unmapping our own fresh mapping.
            unsafe { raw::munmap(p, len) };
            set_errno(e);
            return libc::MAP_FAILED;
        }
        // SAFETY: changing our own mapping's protection to what the caller asked.
        unsafe { crate::raw_syscall!(libc::SYS_mprotect, p, len, prot) };
        p
    })
}

extern "C" fn h_munmap(addr: *mut c_void, len: usize) -> c_int {
    guard(-1, || {
        // SAFETY: passing the caller's arguments to the kernel.
        let r = unsafe { crate::raw_syscall!(libc::SYS_munmap, addr, len) as c_int };
        if r == 0
            && let Some(state) = active()
            && state.maps.any()
        {
            let _call = state.enter_call();
            state.maps.unmapped(state.fs_if_open(), addr as usize, len);
        }
        r
    })
}

extern "C" fn h_msync(addr: *mut c_void, len: usize, flags: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: passing the caller's arguments to the kernel.
        let r = unsafe { crate::raw_syscall!(libc::SYS_msync, addr, len, flags) as c_int };
        if r == 0
            && flags & libc::MS_INVALIDATE == 0
            && let Some(state) = active()
            && state.maps.any()
        {
            return ret_int(with_fs(state, |fs| state.maps.sync(fs, Some((addr as usize, len))).map(|()| 0)));
        }
        r
    })
}

/// Copies between descriptors of which at least one is kura's, through a buffer.
fn copy_between(in_fd: c_int, in_off: *mut i64, out_fd: c_int, out_off: *mut i64, len: usize) -> Result<c_long, i32> {
    let mut buf = vec![0u8; len.clamp(1, COPY_STEP_BYTES)];
    let mut total: usize = 0;
    while total < len {
        let want = (len - total).min(buf.len());
        let n = if in_off.is_null() {
            h_read(in_fd, buf.as_mut_ptr().cast(), want)
        } else {
            // SAFETY: the caller's offset pointer.
            h_pread(in_fd, buf.as_mut_ptr().cast(), want, unsafe { *in_off })
        };
        if n < 0 {
            return if total > 0 { Ok(total as c_long) } else { Err(errno()) };
        }
        if n == 0 {
            break;
        }
        let mut written = 0usize;
        while written < n as usize {
            let w = if out_off.is_null() {
                h_write(out_fd, buf[written..].as_ptr().cast(), n as usize - written)
            } else {
                // SAFETY: the caller's offset pointer.
                h_pwrite(out_fd, buf[written..].as_ptr().cast(), n as usize - written, unsafe { *out_off } + written as i64)
            };
            if w <= 0 {
                return if total + written > 0 { Ok((total + written) as c_long) } else { Err(errno()) };
            }
            written += w as usize;
        }
        if !in_off.is_null() {
            // SAFETY: the caller's offset pointer.
            unsafe { *in_off += n as i64 };
        }
        if !out_off.is_null() {
            // SAFETY: the caller's offset pointer.
            unsafe { *out_off += n as i64 };
        }
        total += n as usize;
    }
    Ok(total as c_long)
}

/// A `copy_file_range` within one file: Linux cuts the length to what the source holds from
/// its offset before it copies (so the copy never reads what it wrote past the old end), and
/// refuses (EINVAL) source and destination ranges that then overlap. Other copies keep `len`.
fn within_one_file(state: &State, in_fd: c_int, in_off: *const i64, out_fd: c_int, out_off: *const i64, len: usize) -> Result<usize, i32> {
    let (Some(src), Some(dst)) = (state.fds.get(in_fd), state.fds.get(out_fd)) else { return Ok(len) };
    if src.ino != dst.ino || src.is_dir {
        return Ok(len);
    }
    // SAFETY: the caller's offset pointers, when given.
    let at = |off: *const i64, of: &OpenFile| if off.is_null() { of.offset() as i64 } else { unsafe { *off } };
    let (pos_in, pos_out) = (at(in_off, &src), at(out_off, &dst));
    if pos_in < 0 || pos_out < 0 {
        return Ok(len); // the copy itself answers EINVAL
    }
    let size = with_fs(state, |fs| fs.size_of(node_of(fs, &src)?).map_err(fs_errno))? as i64;
    let count = (size - pos_in).clamp(0, len.min(i64::MAX as usize) as i64);
    if pos_out < pos_in.saturating_add(count) && pos_in < pos_out.saturating_add(count) {
        return Err(libc::EINVAL);
    }
    Ok(count as usize)
}

/// A descriptor's status flags and whether it is a directory or a regular file, kura's or the
/// kernel's (EBADF when it is not open).
fn copy_end(state: &State, fd: c_int) -> Result<(c_int, bool, bool), i32> {
    if let Some(of) = state.fds.get(fd) {
        return Ok((of.flags(), of.is_dir, !of.is_dir));
    }
    let flags = raw::fcntl(fd, libc::F_GETFL, 0)?;
    let kind = raw::fstat(fd)?.st_mode & libc::S_IFMT;
    Ok((flags, kind == libc::S_IFDIR, kind == libc::S_IFREG))
}

/// The kernel's checks of a copy's two ends, before anything is copied, a length of 0 too:
/// for `copy_file_range` (`generic_file_rw_checks`: EISDIR, EINVAL for other than regular
/// files, EBADF for a source not open for reading or a target not open for writing or
/// appending), for `sendfile` (`do_sendfile`: EBADF for either end's access mode, then
/// EINVAL for reading a directory, or for sending onto an O_APPEND file).
fn check_copy_ends(state: &State, in_fd: c_int, out_fd: c_int, sendfile: bool, len: usize) -> Result<(), i32> {
    let readable = |flags: c_int| flags & libc::O_ACCMODE != libc::O_WRONLY;
    let writable = |flags: c_int| flags & libc::O_ACCMODE != libc::O_RDONLY;
    let (in_flags, in_dir, in_reg) = copy_end(state, in_fd)?;
    if sendfile {
        if !readable(in_flags) {
            return Err(libc::EBADF);
        }
        let (out_flags, _, _) = copy_end(state, out_fd)?;
        if !writable(out_flags) {
            return Err(libc::EBADF);
        }
        // A directory cannot be spliced from (asked for nothing, nothing is tried).
        if in_dir && len > 0 {
            return Err(libc::EINVAL);
        }
        // Linux refuses to send onto an O_APPEND file (EINVAL; EBADF for copy_file_range).
        return if out_flags & libc::O_APPEND != 0 { Err(libc::EINVAL) } else { Ok(()) };
    }
    let (out_flags, out_dir, out_reg) = copy_end(state, out_fd)?;
    if in_dir || out_dir {
        return Err(libc::EISDIR);
    }
    if !in_reg || !out_reg {
        return Err(libc::EINVAL);
    }
    if !readable(in_flags) || !writable(out_flags) || out_flags & libc::O_APPEND != 0 {
        return Err(libc::EBADF);
    }
    Ok(())
}

extern "C" fn h_copy_file_range(in_fd: c_int, in_off: *mut i64, out_fd: c_int, out_off: *mut i64, len: usize, flags: c_uint) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && (state.fds.contains(in_fd) || state.fds.contains(out_fd))
        {
            if flags != 0 {
                return ret(Err(libc::EINVAL)) as isize;
            }
            if let Err(e) = check_copy_ends(state, in_fd, out_fd, false, len) {
                return ret(Err(e)) as isize;
            }
            let len = match within_one_file(state, in_fd, in_off, out_fd, out_off, len) {
                Ok(len) => len,
                Err(e) => return ret(Err(e)) as isize,
            };
            return ret(copy_between(in_fd, in_off, out_fd, out_off, len)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_copy_file_range, in_fd, in_off, out_fd, out_off, len, flags) as isize }
    })
}

extern "C" fn h_sendfile(out_fd: c_int, in_fd: c_int, offset: *mut i64, count: usize) -> isize {
    guard(-1, || {
        if let Some(state) = active()
            && (state.fds.contains(in_fd) || state.fds.contains(out_fd))
        {
            if let Err(e) = check_copy_ends(state, in_fd, out_fd, true, count) {
                return ret(Err(e)) as isize;
            }
            return ret(copy_between(in_fd, offset, out_fd, std::ptr::null_mut(), count)) as isize;
        }
        // SAFETY: passing the caller's arguments to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_sendfile, out_fd, in_fd, offset, count) as isize }
    })
}

// ---------------------------------------------------------------------------------------
// process lifetime: exec, exit, vfork

/// Writes back every dirty file of the process (visibility for the next image or process).
pub(crate) fn writeback_before_leaving() {
    if let Some(state) = state::get()
        && let Some(fs) = state.fs_if_open()
    {
        let _call = state.enter_call();
        if state.maps.any()
            && let Err(e) = state.maps.sync(fs, None)
        {
            complain(&format!("libkura_fs: writing shared mappings back failed: errno {e}"));
        }
        if let Err(e) = fs.writeback_before_leaving() {
            complain(&format!("libkura_fs: write-back failed: {e}"));
        }
    }
}

extern "C" fn h_exit(status: c_int) -> ! {
    let _ = std::panic::catch_unwind(writeback_before_leaving);
    // SAFETY: exit_group ends the process; it does not return.
    unsafe { crate::raw_syscall!(libc::SYS_exit_group, status) };
    unreachable!("exit_group returned")
}

extern "C" fn h_vfork() -> libc::pid_t {
    // vfork may behave as fork (POSIX); a real fork lets the child run kura code safely.
    // SAFETY: fork() is the plain libc function (not patched); the atfork handlers run.
    unsafe { libc::fork() }
}

// ---------------------------------------------------------------------------------------

/// Every patched function and its handler (same prototype). Aliases of one code address are
/// patched once; names this libc lacks are skipped.
pub fn hooks() -> Vec<(&'static std::ffi::CStr, usize)> {
    let mut hooks = vec![
    (c"open", h_open as *const () as usize),
    (c"open64", h_open as *const () as usize),
    (c"__open_2", h_open_2 as *const () as usize),
    (c"__open64_2", h_open_2 as *const () as usize),
    (c"openat", h_openat as *const () as usize),
    (c"openat64", h_openat as *const () as usize),
    (c"__openat_2", h_openat_2 as *const () as usize),
    (c"__openat64_2", h_openat_2 as *const () as usize),
    (c"creat", h_creat as *const () as usize),
    (c"creat64", h_creat as *const () as usize),
    (c"close", h_close as *const () as usize),
    (c"close_range", h_close_range as *const () as usize),
    (c"munmap", h_munmap as *const () as usize),
    (c"msync", h_msync as *const () as usize),
    (c"__close_nocancel", h_close as *const () as usize),
    (c"dup", h_dup as *const () as usize),
    (c"dup2", h_dup2 as *const () as usize),
    (c"dup3", h_dup3 as *const () as usize),
    (c"read", h_read as *const () as usize),
    (c"write", h_write as *const () as usize),
    (c"pread64", h_pread as *const () as usize),
    (c"pwrite64", h_pwrite as *const () as usize),
    (c"readv", h_readv as *const () as usize),
    (c"writev", h_writev as *const () as usize),
    (c"preadv64", h_preadv as *const () as usize),
    (c"pwritev64", h_pwritev as *const () as usize),
    (c"preadv64v2", h_preadv2 as *const () as usize),
    (c"pwritev64v2", h_pwritev2 as *const () as usize),
    (c"preadv2", h_preadv2 as *const () as usize),
    (c"pwritev2", h_pwritev2 as *const () as usize),
    (c"lseek64", h_lseek as *const () as usize),
    (c"fsync", h_fsync as *const () as usize),
    (c"fdatasync", h_fdatasync as *const () as usize),
    (c"sync", h_sync as *const () as usize),
    (c"syncfs", h_syncfs as *const () as usize),
    (c"truncate64", h_truncate as *const () as usize),
    (c"ftruncate64", h_ftruncate as *const () as usize),
    (c"fallocate64", h_fallocate as *const () as usize),
    (c"posix_fallocate64", h_posix_fallocate as *const () as usize),
    (c"posix_fallocate", h_posix_fallocate as *const () as usize),
    (c"posix_fadvise64", h_posix_fadvise as *const () as usize),
    (c"stat64", h_stat as *const () as usize),
    (c"lstat64", h_lstat as *const () as usize),
    (c"fstat64", h_fstat as *const () as usize),
    (c"fstatat64", h_fstatat as *const () as usize),
    (c"__xstat64", h_xstat as *const () as usize),
    (c"__lxstat64", h_lxstat as *const () as usize),
    (c"__fxstat64", h_fxstat as *const () as usize),
    (c"__fxstatat64", h_fxstatat as *const () as usize),
    (c"statx", h_statx as *const () as usize),
    (c"access", h_access as *const () as usize),
    (c"faccessat", h_faccessat as *const () as usize),
    (c"euidaccess", h_euidaccess as *const () as usize),
    (c"unlink", h_unlink as *const () as usize),
    (c"unlinkat", h_unlinkat as *const () as usize),
    (c"rmdir", h_rmdir as *const () as usize),
    (c"mkdir", h_mkdir as *const () as usize),
    (c"mkdirat", h_mkdirat as *const () as usize),
    (c"mknod", h_mknod as *const () as usize),
    (c"mknodat", h_mknodat as *const () as usize),
    (c"rename", h_rename as *const () as usize),
    (c"renameat", h_renameat as *const () as usize),
    (c"renameat2", h_renameat2 as *const () as usize),
    (c"link", h_link as *const () as usize),
    (c"linkat", h_linkat as *const () as usize),
    (c"symlink", h_symlink as *const () as usize),
    (c"symlinkat", h_symlinkat as *const () as usize),
    (c"readlink", h_readlink as *const () as usize),
    (c"readlinkat", h_readlinkat as *const () as usize),
    (c"chmod", h_chmod as *const () as usize),
    (c"fchmod", h_fchmod as *const () as usize),
    (c"fchmodat", h_fchmodat as *const () as usize),
    (c"chown", h_chown as *const () as usize),
    (c"lchown", h_lchown as *const () as usize),
    (c"fchown", h_fchown as *const () as usize),
    (c"fchownat", h_fchownat as *const () as usize),
    (c"utimensat", h_utimensat as *const () as usize),
    (c"futimens", h_futimens as *const () as usize),
    (c"utimes", h_utimes as *const () as usize),
    (c"lutimes", h_lutimes as *const () as usize),
    (c"futimes", h_futimes as *const () as usize),
    (c"utime", h_utime as *const () as usize),
    (c"getxattr", h_getxattr as *const () as usize),
    (c"lgetxattr", h_lgetxattr as *const () as usize),
    (c"listxattr", h_listxattr as *const () as usize),
    (c"llistxattr", h_llistxattr as *const () as usize),
    (c"setxattr", h_setxattr as *const () as usize),
    (c"lsetxattr", h_lsetxattr as *const () as usize),
    (c"removexattr", h_removexattr as *const () as usize),
    (c"lremovexattr", h_lremovexattr as *const () as usize),
    (c"fgetxattr", h_fgetxattr as *const () as usize),
    (c"flistxattr", h_flistxattr as *const () as usize),
    (c"fsetxattr", h_fsetxattr as *const () as usize),
    (c"fremovexattr", h_fremovexattr as *const () as usize),
    (c"statfs64", h_statfs as *const () as usize),
    (c"fstatfs64", h_fstatfs as *const () as usize),
    (c"flock", h_flock as *const () as usize),
    (c"fcntl64", h_fcntl as *const () as usize),
    (c"chdir", h_chdir as *const () as usize),
    (c"fchdir", h_fchdir as *const () as usize),
    (c"getcwd", h_getcwd as *const () as usize),
    (c"mmap64", h_mmap as *const () as usize),
    (c"copy_file_range", h_copy_file_range as *const () as usize),
    (c"sendfile64", h_sendfile as *const () as usize),
    (c"execve", crate::exec::h_execve as *const () as usize),
    (c"execveat", crate::exec::h_execveat as *const () as usize),
    (c"fexecve", crate::exec::h_fexecve as *const () as usize),
    (c"_exit", h_exit as *const () as usize),
    (c"vfork", h_vfork as *const () as usize),
    (c"sigaction", crate::signals::h_sigaction as *const () as usize),
    (c"__sigaction", crate::signals::h_sigaction as *const () as usize),
    (c"opendir", crate::dir::h_opendir as *const () as usize),
    (c"fdopendir", crate::dir::h_fdopendir as *const () as usize),
    (c"closedir", crate::dir::h_closedir as *const () as usize),
    (c"readdir64", crate::dir::h_readdir as *const () as usize),
    (c"readdir64_r", crate::dir::h_readdir_r as *const () as usize),
    (c"rewinddir", crate::dir::h_rewinddir as *const () as usize),
    (c"telldir", crate::dir::h_telldir as *const () as usize),
    (c"seekdir", crate::dir::h_seekdir as *const () as usize),
    (c"scandir64", crate::dir::h_scandir as *const () as usize),
    (c"scandirat64", crate::dir::h_scandirat as *const () as usize),
    (c"getdents64", crate::dir::h_getdents64 as *const () as usize),
    (c"bind", crate::sock::h_bind as *const () as usize),
    (c"connect", crate::sock::h_connect as *const () as usize),
    (c"sendto", crate::sock::h_sendto as *const () as usize),
    (c"sendmsg", crate::sock::h_sendmsg as *const () as usize),
    (c"getsockname", crate::sock::h_getsockname as *const () as usize),
    (c"getpeername", crate::sock::h_getpeername as *const () as usize),
    (c"syscall", by_number::h_syscall as *const () as usize),
    ];
    // glibc's spawned child shares the parent's memory; ours is a fork (see spawn.rs), made
    // only where glibc's file actions are laid out as spawn.rs reads them.
    if crate::spawn::layout_matches() {
        hooks.push((c"posix_spawn", crate::spawn::h_posix_spawn as *const () as usize));
        hooks.push((c"posix_spawnp", crate::spawn::h_posix_spawnp as *const () as usize));
    }
    hooks
}

/// For the directory code: dispatches like the patched functions.
pub fn dispatch_openat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    h_openat(dirfd, path, flags, 0)
}

pub fn dispatch_close(fd: c_int) -> c_int {
    h_close(fd)
}

pub fn dispatch_lseek(fd: c_int, offset: i64) -> i64 {
    h_lseek(fd, offset, libc::SEEK_SET)
}

pub fn dispatch_fstat(fd: c_int, st: *mut libc::stat) -> c_int {
    h_fstat(fd, st)
}

/// `getdents64` on a kura directory: its listing (taken at offset 0), `.` and `..` first.
pub fn kura_getdents(state: &State, of: &OpenFile, buf: *mut u8, count: usize) -> Result<c_long, i32> {
    no_io(of)?;
    if !of.is_dir {
        return Err(libc::ENOTDIR);
    }
    with_fs(state, |fs| {
        let mut listing = of.listing.lock();
        let pos = of.offset() as usize;
        if listing.is_none() || pos == 0 {
            let inode = fs.getattr(of.ino).map_err(fs_errno)?;
            let mut all = vec![
                kura_fs::DirEntry { name: b".".to_vec(), ino: of.ino, dtype: libc::DT_DIR },
                kura_fs::DirEntry { name: b"..".to_vec(), ino: inode.parent.max(1), dtype: libc::DT_DIR },
            ];
            all.extend(fs.readdir(of.ino).map_err(fs_errno)?);
            *listing = Some(all);
        }
        let entries = listing.as_ref().expect("filled above");
        let mut used = 0usize;
        let mut i = pos;
        while i < entries.len() {
            let e = &entries[i];
            let reclen = (19 + e.name.len() + 1).next_multiple_of(8);
            if used + reclen > count {
                break;
            }
            // SAFETY: the caller's buffer holds `count` bytes; we write within used..used+reclen.
            unsafe {
                let rec = buf.add(used);
                std::ptr::write_bytes(rec, 0, reclen);
                (rec as *mut u64).write_unaligned(e.ino);
                (rec.add(8) as *mut i64).write_unaligned((i + 1) as i64);
                (rec.add(16) as *mut u16).write_unaligned(reclen as u16);
                *rec.add(18) = e.dtype;
                std::ptr::copy_nonoverlapping(e.name.as_ptr(), rec.add(19), e.name.len());
            }
            used += reclen;
            i += 1;
        }
        if used == 0 && i < entries.len() {
            return Err(libc::EINVAL);
        }
        of.set_offset(i as u64);
        Ok(used as c_long)
    })
}

pub fn active_state() -> Option<&'static State> {
    active()
}
