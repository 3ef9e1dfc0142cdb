//! Writable shared mappings (`mmap(MAP_SHARED, PROT_WRITE)`) of kura files.
//!
//! The kernel cannot page a kura file, so a writable shared mapping maps a *backing file* on
//! the host instead: one per file system and inode, `<lock dir>/<fs tag>-<ino>.map` (beside
//! the lock files, see [`crate::fds::lock_file_path`]). Every process of the host that maps
//! the file maps that same backing file, so they see each other's stores at once, as
//! processes mapping one file do through the kernel's page cache — which is what sqlite's
//! WAL index (`-shm`) needs.
//!
//! * The first process to map the file (no other holds the *users* lock) loads the backing
//!   file from kura; later mappings find it loaded and only extend it to the file's size.
//! * The mapped bytes go to the kura file at `msync`, at the last `munmap` of the file in the
//!   process, at `exit` and `exec` (as a kernel page cache writes dirty mapped pages back),
//!   and a process that truncates the file truncates the backing file too.
//! * `write`s go to the backing file too: the mapping process's own ([`SharedMaps::wrote`]),
//!   and those of other processes while some process maps the file ([`wrote_elsewhere`]; they
//!   read and write the file through the pool, since the mapping process has it open), so a
//!   mapping sees every write made on the host at once, as with the kernel's page cache
//!   (LMDB, and sqlite with `mmap_size`, write with `pwrite` and read through the mapping).
//!   The mapping process's `read`s come from the backing file ([`SharedMaps::read`]), so they
//!   see its stores. Other processes' `read`s see a mapping's stores at `msync`, `munmap` and
//!   exit; a mapping process killed with `SIGKILL` loses what it stored since.
//! * Two POSIX record locks on the backing file, far past any data: the *turn* (exclusive,
//!   while a process loads, extends or writes back) and the *users* lock (shared, held by
//!   every process that maps the file). The last user to leave removes the backing file; a
//!   process that opened it just before re-checks, under the turn, that the path is still
//!   its file, and opens it again if not.
//!
//! Every `MAP_SHARED` mapping maps the backing file (a read-only one too, so that it sees
//! writes); private mappings are copies of the file's bytes (see `h_mmap`).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kura_fs::{Fs, Node, WriteMode};
use kura_fs::sync::Mutex;

use crate::hooks::{errno, fs_errno};

/// The backing file's turn lock byte and users lock byte (past any file's data).
const TURN_LOCK_BYTE: i64 = i64::MAX - 2;
const USERS_LOCK_BYTE: i64 = i64::MAX - 1;
/// Bytes copied per step between the pool and a backing file.
const COPY_STEP_BYTES: usize = 128 << 10;
/// How many times a mapping re-opens a backing file that the last user removed meanwhile.
const REOPEN_TRIES_MAX: usize = 8;

/// One mapped range of a backing file in this process.
struct Range {
    start: usize,
    end: usize,
    ino: u64,
}

/// A backing file this process maps.
struct Backing {
    fd: OwnedFd,
    /// Holds the kura file open while it is mapped (a mapping outlives its descriptor).
    node: Arc<Node>,
    /// This process mapped it writable: its stores go to the kura file at `msync`, `munmap`
    /// and exit. Read-only mappings have nothing to give back, and writing the backing file
    /// over the kura file would undo writes that did not reach the backing file (those of a
    /// process that does not know yet that another maps the file).
    stores: bool,
}

/// This process's writable shared mappings of kura files.
#[derive(Default)]
pub struct SharedMaps {
    inner: Mutex<MapsInner>,
    /// Ranges mapped: `munmap`'s fast path when there are none.
    ranges: AtomicUsize,
}

#[derive(Default)]
struct MapsInner {
    ranges: Vec<Range>,
    backings: HashMap<u64, Backing>,
}

/// [`kura_fs::cache::record_lock`] on byte `byte` of a backing file, with an errno.
fn lock(fd: c_int, byte: i64, kind: c_int) -> Result<(), i32> {
    kura_fs::cache::record_lock(fd, byte as u64, kind).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
}

/// Whether another process holds the users lock of `fd`.
fn others_map(fd: c_int) -> Result<bool, i32> {
    let mut fl = libc::flock { l_type: libc::F_WRLCK as i16, l_whence: libc::SEEK_SET as i16, l_start: USERS_LOCK_BYTE, l_len: 1, l_pid: 0 };
    // SAFETY: as above.
    if unsafe { crate::raw_syscall!(libc::SYS_fcntl, fd, libc::F_GETLK, &mut fl as *mut libc::flock) } != 0 {
        return Err(errno());
    }
    Ok(fl.l_type != libc::F_UNLCK as i16)
}

/// Holds the turn on a backing file until dropped.
struct Turn(c_int);

impl Turn {
    fn take(fd: c_int) -> Result<Self, i32> {
        lock(fd, TURN_LOCK_BYTE, libc::F_WRLCK)?;
        Ok(Self(fd))
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let _ = lock(self.0, TURN_LOCK_BYTE, libc::F_UNLCK);
    }
}

fn backing_path(ino: u64) -> Vec<u8> {
    crate::fds::host_file_path(ino, kura_fs::host_files::MAP).1
}

fn file_size(fd: c_int) -> Result<u64, i32> {
    // SAFETY: a zeroed stat is a valid value; fstat writes only into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable and lives across the call.
    if unsafe { crate::raw_syscall!(libc::SYS_fstat, fd, &mut st as *mut libc::stat) } != 0 {
        return Err(errno());
    }
    Ok(st.st_size as u64)
}

/// Whether `path` (NUL-terminated) still names the file open as `fd`.
fn still_named(fd: c_int, path: &[u8]) -> bool {
    let Ok(at_fd) = crate::hooks::raw::fstat_id(fd) else { return false };
    crate::hooks::raw::stat_id(path).is_ok_and(|at_path| at_path == at_fd)
}

/// Opens the backing file of `ino` and takes its turn: the file, its turn, and whether it
/// must be loaded from kura (no other process maps it).
fn open_backing(ino: u64) -> Result<(OwnedFd, Turn, bool), i32> {
    let path = backing_path(ino);
    for _ in 0..REOPEN_TRIES_MAX {
        // SAFETY: path is NUL-terminated.
        let raw = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600) };
        if raw < 0 {
            return Err(errno());
        }
        // SAFETY: a descriptor just opened, owned from here.
        let fd = kura_engine::fd::keep_high(unsafe { OwnedFd::from_raw_fd(raw as c_int) });
        let turn = Turn::take(fd.as_raw_fd())?;
        if !still_named(fd.as_raw_fd(), &path) {
            continue; // the last user removed it before our turn
        }
        let load = !others_map(fd.as_raw_fd())?;
        return Ok((fd, turn, load));
    }
    Err(libc::EAGAIN)
}

/// Copies kura bytes `[from, to)` of `node` into the backing file.
fn load(fs: &Arc<Fs>, node: &Arc<Node>, fd: c_int, from: u64, to: u64) -> Result<(), i32> {
    let mut buf = vec![0u8; COPY_STEP_BYTES];
    let mut at = from;
    while at < to {
        let want = ((to - at) as usize).min(buf.len());
        let n = fs.read(node, at, &mut buf[..want]).map_err(fs_errno)?;
        if n == 0 {
            break;
        }
        pwrite_all(fd, &buf[..n], at)?;
        at += n as u64;
    }
    // SAFETY: integers.
    if unsafe { crate::raw_syscall!(libc::SYS_ftruncate, fd, to as i64) } != 0 {
        return Err(errno());
    }
    Ok(())
}

fn pwrite_all(fd: c_int, mut data: &[u8], mut at: u64) -> Result<(), i32> {
    while !data.is_empty() {
        // SAFETY: writing our buffer to our file.
        let n = unsafe { crate::raw_syscall!(libc::SYS_pwrite64, fd, data.as_ptr(), data.len(), at as i64) };
        if n <= 0 {
            return Err(if n < 0 { errno() } else { libc::EIO });
        }
        data = &data[n as usize..];
        at += n as u64;
    }
    Ok(())
}

/// Writes the backing file's bytes (up to the kura file's size) into the kura file and
/// writes it back to the pool.
fn store(fs: &Arc<Fs>, node: &Arc<Node>, fd: c_int) -> Result<(), i32> {
    let end = file_size(fd)?.min(fs.size_of(node).map_err(fs_errno)?);
    let mut buf = vec![0u8; COPY_STEP_BYTES];
    let mut at = 0u64;
    while at < end {
        let want = ((end - at) as usize).min(buf.len());
        // SAFETY: reading into our buffer.
        let n = unsafe { crate::raw_syscall!(libc::SYS_pread64, fd, buf.as_mut_ptr(), want, at as i64) };
        if n <= 0 {
            return Err(if n < 0 { errno() } else { libc::EIO });
        }
        fs.write(node, at, &buf[..n as usize], WriteMode::Buffered).map_err(fs_errno)?;
        at += n as u64;
    }
    fs.writeback(node).map_err(fs_errno)
}

impl SharedMaps {
    /// Maps `[offset, offset + len)` of kura file `node` (inode `ino`) shared, as `mmap`
    /// would: the address, or an errno.
    #[allow(clippy::too_many_arguments)]
    pub fn map(&self, fs: &Arc<Fs>, node: &Arc<Node>, ino: u64, addr: *mut c_void, len: usize, prot: c_int, flags: c_int, offset: i64) -> Result<*mut c_void, i32> {
        let mut inner = self.inner.lock();
        let size = fs.size_of(node).map_err(fs_errno)?;
        let (fd, _turn) = match inner.backings.get(&ino) {
            Some(backing) => {
                let fd = backing.fd.as_raw_fd();
                (fd, Turn::take(fd)?)
            }
            None => {
                let (fd, turn, load_all) = open_backing(ino)?;
                if load_all {
                    // SAFETY: integers.
                    unsafe { crate::raw_syscall!(libc::SYS_ftruncate, fd.as_raw_fd(), 0i64) };
                    load(fs, node, fd.as_raw_fd(), 0, size)?;
                }
                lock(fd.as_raw_fd(), USERS_LOCK_BYTE, libc::F_RDLCK)?;
                let inode = fs.getattr_open(ino).map_err(fs_errno)?;
                let held = fs.open_node(&inode).map_err(fs_errno)?;
                let raw = fd.as_raw_fd();
                inner.backings.insert(ino, Backing { fd, node: held, stores: false });
                (raw, turn)
            }
        };
        // The file grew (through `write` or `ftruncate`, here or elsewhere): so does the
        // backing file, with the new bytes.
        let backing_size = file_size(fd)?;
        if size > backing_size {
            load(fs, node, fd, backing_size, size)?;
        }
        let map_flags = flags & !libc::MAP_SHARED_VALIDATE | libc::MAP_SHARED;
        // SAFETY: the caller's address, length and protection, on our backing file.
        let p = unsafe { crate::raw_syscall!(libc::SYS_mmap, addr, len, prot, map_flags, fd, offset) };
        if p == -1 {
            let e = errno();
            self.release_if_unmapped(fs, &mut inner, ino);
            return Err(e);
        }
        if prot & libc::PROT_WRITE != 0
            && let Some(backing) = inner.backings.get_mut(&ino)
        {
            backing.stores = true;
        }
        let start = p as usize;
        // MAP_FIXED replaced whatever was mapped there.
        Self::forget_range(&mut inner, start, start + len);
        inner.ranges.push(Range { start, end: start + len, ino });
        self.ranges.store(inner.ranges.len(), Ordering::Release);
        Ok(p as *mut c_void)
    }

    /// Whether any range is mapped (`munmap` and `msync`'s fast path).
    pub fn any(&self) -> bool {
        self.ranges.load(Ordering::Acquire) > 0
    }

    /// Removes `[start, end)` from the ranges; the inodes that had a range there.
    fn forget_range(inner: &mut MapsInner, start: usize, end: usize) -> Vec<u64> {
        let mut touched = Vec::new();
        let mut kept = Vec::with_capacity(inner.ranges.len());
        for r in inner.ranges.drain(..) {
            if r.end <= start || r.start >= end {
                kept.push(r);
                continue;
            }
            touched.push(r.ino);
            if r.start < start {
                kept.push(Range { start: r.start, end: start, ino: r.ino });
            }
            if r.end > end {
                kept.push(Range { start: end, end: r.end, ino: r.ino });
            }
        }
        inner.ranges = kept;
        touched
    }

    /// After `munmap(start, len)`: files no longer mapped here are written to kura and their
    /// backing files released.
    pub fn unmapped(&self, fs: Option<&Arc<Fs>>, start: usize, len: usize) {
        let mut inner = self.inner.lock();
        let mut touched = Self::forget_range(&mut inner, start, start.saturating_add(len));
        self.ranges.store(inner.ranges.len(), Ordering::Release);
        touched.sort_unstable();
        touched.dedup();
        if let Some(fs) = fs {
            for ino in touched {
                self.release_if_unmapped(fs, &mut inner, ino);
            }
        }
    }

    fn release_if_unmapped(&self, fs: &Arc<Fs>, inner: &mut MapsInner, ino: u64) {
        if inner.ranges.iter().any(|r| r.ino == ino) {
            return;
        }
        let Some(backing) = inner.backings.remove(&ino) else { return };
        let fd = backing.fd.as_raw_fd();
        if let Ok(turn) = Turn::take(fd) {
            if backing.stores
                && let Err(e) = store(fs, &backing.node, fd)
            {
                crate::hooks::complain(&format!("libkura_fs: writing a shared mapping back failed: errno {e}"));
            }
            let _ = lock(fd, USERS_LOCK_BYTE, libc::F_UNLCK);
            if others_map(fd) == Ok(false) {
                let path = backing_path(ino);
                if still_named(fd, &path) {
                    // SAFETY: path is NUL-terminated.
                    unsafe { crate::raw_syscall!(libc::SYS_unlinkat, libc::AT_FDCWD, path.as_ptr(), 0) };
                }
            }
            drop(turn);
        }
        let _ = fs.release(&backing.node);
    }

    /// `msync` of `[start, start + len)`, or every mapping (`None`, before `exit`/`exec`):
    /// the mapped files' bytes go to kura.
    pub fn sync(&self, fs: &Arc<Fs>, range: Option<(usize, usize)>) -> Result<(), i32> {
        let inner = self.inner.lock();
        let mut inos: Vec<u64> = match range {
            Some((start, len)) => inner.ranges.iter().filter(|r| r.start < start.saturating_add(len) && r.end > start).map(|r| r.ino).collect(),
            None => inner.backings.keys().copied().collect(),
        };
        inos.sort_unstable();
        inos.dedup();
        for ino in inos {
            let Some(backing) = inner.backings.get(&ino).filter(|b| b.stores) else { continue };
            let fd = backing.fd.as_raw_fd();
            let _turn = Turn::take(fd)?;
            store(fs, &backing.node, fd)?;
        }
        Ok(())
    }

    /// The kura file `ino` was truncated or extended to `size` by this process: so is its
    /// backing file, if it maps it.
    pub fn resized(&self, ino: u64, size: u64) {
        let inner = self.inner.lock();
        if let Some(backing) = inner.backings.get(&ino) {
            let fd = backing.fd.as_raw_fd();
            if let Ok(_turn) = Turn::take(fd) {
                // SAFETY: integers.
                unsafe { crate::raw_syscall!(libc::SYS_ftruncate, fd, size as i64) };
            }
        }
    }

    /// After this process wrote `data` at `offset` of kura file `ino`: the backing file gets
    /// it too, if this process maps the file.
    pub fn wrote(&self, ino: u64, offset: u64, data: &[u8]) -> Result<(), i32> {
        let inner = self.inner.lock();
        let Some(backing) = inner.backings.get(&ino) else { return Ok(()) };
        let fd = backing.fd.as_raw_fd();
        let _turn = Turn::take(fd)?;
        pwrite_all(fd, data, offset)
    }

    /// A read of kura file `ino` that this process maps: from the backing file, which holds
    /// the mapping's stores (`None` when it does not map the file).
    pub fn read(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Option<Result<usize, i32>> {
        let inner = self.inner.lock();
        let backing = inner.backings.get(&ino)?;
        let fd = backing.fd.as_raw_fd();
        // SAFETY: reading into the caller's buffer, writable for its length.
        let n = unsafe { crate::raw_syscall!(libc::SYS_pread64, fd, buf.as_mut_ptr(), buf.len(), offset as i64) };
        Some(if n < 0 { Err(errno()) } else { Ok(n as usize) })
    }

    /// In a child after `fork`: it maps what its parent mapped, so it is a user too (POSIX
    /// record locks are not inherited).
    pub fn after_fork_in_child(&self) {
        let inner = self.inner.lock();
        for backing in inner.backings.values() {
            let _ = lock(backing.fd.as_raw_fd(), USERS_LOCK_BYTE, libc::F_RDLCK);
        }
    }
}

/// After this process wrote `data` at `offset` of kura file `ino`, which it does not map and
/// other processes have open: when some process of the host maps the file, its backing file
/// gets the write too (under the turn), so the mapping sees it at once.
pub fn wrote_elsewhere(ino: u64, offset: u64, data: &[u8]) -> Result<(), i32> {
    let path = backing_path(ino);
    // SAFETY: path is NUL-terminated; an open of our own that creates nothing.
    let raw = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Ok(()); // nobody maps it
    }
    // SAFETY: a descriptor just opened, owned from here.
    let fd = unsafe { OwnedFd::from_raw_fd(raw as c_int) };
    let _turn = Turn::take(fd.as_raw_fd())?;
    // Only a file some process maps now is current; one its last user left (removing it) or
    // a killed user left behind is not.
    if still_named(fd.as_raw_fd(), &path) && others_map(fd.as_raw_fd())? {
        pwrite_all(fd.as_raw_fd(), data, offset)?;
    }
    Ok(())
}
