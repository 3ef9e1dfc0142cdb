//! Kura descriptors: kernel placeholders (`memfd`s holding the open file description's shared
//! state) and the table from descriptor number to this process's [`OpenFile`].

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use kura_fs::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use kura_fs::{DirEntry, Inode, Node};

use crate::hooks::raw;

/// Lock files live here (one per inode), for `flock` and `fcntl` locks between processes.
const LOCK_DIR_DEFAULT: &str = "/tmp/kura-fs-locks";

/// The directory of lock files and inode `ino`'s lock file (both NUL-terminated):
/// `$KURA_FS_LOCK_DIR` (default [`LOCK_DIR_DEFAULT`]), `<fs>-<ino:x>`, where `<fs>` names the
/// file system and its pool (`KURA_FS_NAME`, `KURA_FS_POOL`: [`crate::sock::fs_hash`]), so
/// that two file systems of one name in different pools never share a lock.
pub fn lock_file_path(ino: u64) -> (Vec<u8>, Vec<u8>) {
    let dir = lock_dir();
    let file = format!("{dir}/{:016x}-{ino:x}\0", fs_tag()).into_bytes();
    (format!("{dir}\0").into_bytes(), file)
}

/// This process's open descriptors, in order (from `/proc/self/fd`; none when it cannot be
/// read).
pub fn open_descriptors() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    let mut fds: Vec<i32> = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
    fds.sort_unstable();
    fds
}

/// The inode number of `fd` if it may be a placeholder: a regular file of
/// [`SHARED_BYTES`] with no name (a memfd's `nlink` is 0).
fn placeholder_like(fd: i32) -> Option<u64> {
    let st = raw::fstat(fd).ok()?;
    (st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_size == SHARED_BYTES as i64 && st.st_nlink == 0).then_some(st.st_ino)
}

/// The name of a host file kura keeps beside the lock file of `ino`: that file's name plus
/// `suffix` (a shared mapping's backing file, a FIFO's kernel FIFO, a program's text lock),
/// NUL-terminated.
pub fn host_file_name(ino: u64, suffix: &str) -> Vec<u8> {
    let (_, mut file) = lock_file_path(ino);
    file.pop();
    file.extend_from_slice(suffix.as_bytes());
    file.push(0);
    file
}

/// [`host_file_name`], and the lock directory, made if missing (both NUL-terminated).
pub fn host_file_path(ino: u64, suffix: &str) -> (Vec<u8>, Vec<u8>) {
    let file = host_file_name(ino, suffix);
    let dir = format!("{}\0", lock_dir()).into_bytes();
    // SAFETY: dir is NUL-terminated.
    unsafe { crate::raw_syscall!(libc::SYS_mkdirat, libc::AT_FDCWD, dir.as_ptr(), 0o1777) };
    (dir, file)
}

/// `$KURA_FS_LOCK_DIR`, default [`LOCK_DIR_DEFAULT`].
pub fn lock_dir() -> String {
    std::env::var("KURA_FS_LOCK_DIR").unwrap_or_else(|_| LOCK_DIR_DEFAULT.to_owned())
}

/// This process's file system and pool, as [`crate::sock::fs_hash`] names them.
pub fn fs_tag() -> u64 {
    let fs_name = std::env::var("KURA_FS_NAME").unwrap_or_else(|_| "default".into());
    let pool_urls: Vec<String> = std::env::var("KURA_FS_POOL").map(|v| v.split(',').map(str::to_owned).collect()).unwrap_or_default();
    crate::sock::fs_hash(&fs_name, &pool_urls)
}

/// Name of a placeholder memfd (what `/proc/self/fd/N` shows, after `/memfd:`).
pub const PLACEHOLDER_NAME: &[u8] = b"kura-fd\0";
/// Bytes of a placeholder (its shared state).
const SHARED_BYTES: usize = 8192;
const SHARED_MAGIC: u64 = 0x6b75_7261_6664_0001;
/// Longest path kept in the shared state.
const SHARED_PATH_BYTES_MAX: usize = SHARED_BYTES - 64;
/// Descriptor numbers the table covers (placeholders above it are moved below it).
pub const FD_TABLE_MAX: usize = 1 << 16;
/// Descriptors scanned for inherited placeholders after `exec`.
const INHERITED_SCAN_MAX: usize = 4096;

/// The open file description's state, shared (through the memfd) by every descriptor and
/// every process that has it.
#[repr(C)]
struct Shared {
    magic: u64,
    ino: u64,
    flags: AtomicU32,
    is_dir: u32,
    offset: AtomicU64,
    path_len: u32,
    /// The lock file's descriptor number + 1 (0: none yet), as the process that opened it
    /// numbered it; a new image after `exec` finds it there (see [`lock_file_path`]).
    lock_fd_plus_one: AtomicU32,
    path: [u8; SHARED_PATH_BYTES_MAX],
}

const _: () = assert!(std::mem::size_of::<Shared>() <= SHARED_BYTES);

/// One open file description, as this process holds it.
pub struct OpenFile {
    shared: *mut Shared,
    pub ino: u64,
    pub is_dir: bool,
    /// Absolute path at open (for `fchdir`, `/proc`-less `openat` bases and messages).
    pub path: Vec<u8>,
    /// Regular files: the cached inode (opened at first use after an `exec`).
    node: OnceLock<Arc<Node>>,
    /// Directories: the listing `getdents64` walks, taken at offset 0.
    pub listing: Mutex<Option<Vec<DirEntry>>>,
    /// Directories: the inode as last read here, for `fstat` after an `rmdir` deleted its record.
    pub dir_inode: Mutex<Option<Inode>>,
    /// A descriptor of this inode's lock file, for `flock` and `fcntl` locks.
    pub lock_fd: Mutex<Option<i32>>,
}

// SAFETY: `shared` points to a MAP_SHARED mapping owned by this OpenFile for its whole life
// and is only accessed through atomics or fields written once before it is shared.
unsafe impl Send for OpenFile {}
// SAFETY: as above.
unsafe impl Sync for OpenFile {}

impl OpenFile {
    fn shared(&self) -> &Shared {
        // SAFETY: the mapping lives as long as self (unmapped in Drop) and is SHARED_BYTES long.
        unsafe { &*self.shared }
    }

    pub fn flags(&self) -> i32 {
        self.shared().flags.load(Ordering::Relaxed) as i32
    }

    pub fn set_flags(&self, flags: i32) {
        self.shared().flags.store(flags as u32, Ordering::Relaxed);
    }

    pub fn offset(&self) -> u64 {
        self.shared().offset.load(Ordering::Relaxed)
    }

    /// Records the lock file's number for a later `exec`, unless another process of this
    /// description recorded its own first (a description received over a socket).
    pub fn record_lock_fd(&self, fd: i32) {
        let _ = self.shared().lock_fd_plus_one.compare_exchange(0, fd as u32 + 1, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub fn set_offset(&self, offset: u64) {
        self.shared().offset.store(offset, Ordering::Relaxed);
    }

    pub fn node(&self) -> Option<&Arc<Node>> {
        self.node.get()
    }

    pub fn set_node(&self, node: Arc<Node>) -> &Arc<Node> {
        let _ = self.node.set(node);
        self.node.get().expect("set above")
    }

    /// Whether the node was opened (so the last close must release it).
    pub fn take_node(&mut self) -> Option<Arc<Node>> {
        self.node.take()
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this OpenFile owns; nothing refers to it afterwards.
        unsafe { raw::munmap(self.shared.cast(), SHARED_BYTES) };
        if let Some(fd) = self.lock_fd.get_mut().take() {
            raw::close(fd);
        }
    }
}

/// Makes a placeholder descriptor and its open file. `cloexec` as `O_CLOEXEC` asks.
pub fn create_placeholder(ino: u64, is_dir: bool, flags: i32, path: &[u8]) -> Result<(i32, OpenFile), i32> {
    let mfd_flags = if flags & libc::O_CLOEXEC != 0 { libc::MFD_CLOEXEC } else { 0 };
    let fd = raw::memfd_create(PLACEHOLDER_NAME, mfd_flags)?;
    let made = (|| {
        raw::ftruncate(fd, SHARED_BYTES as i64)?;
        let shared = raw::mmap_shared(fd, SHARED_BYTES)?.cast::<Shared>();
        let path = &path[..path.len().min(SHARED_PATH_BYTES_MAX)];
        // SAFETY: a fresh zero-filled mapping of SHARED_BYTES, not yet visible to anyone else.
        unsafe {
            (*shared).ino = ino;
            (*shared).is_dir = u32::from(is_dir);
            (*shared).flags.store((flags & !libc::O_CLOEXEC) as u32, Ordering::Relaxed);
            (*shared).path_len = path.len() as u32;
            (&mut (*shared).path)[..path.len()].copy_from_slice(path);
            std::ptr::write_volatile(&mut (*shared).magic, SHARED_MAGIC);
        }
        Ok(shared)
    })();
    let shared = match made {
        Ok(s) => s,
        Err(e) => {
            raw::close(fd);
            return Err(e);
        }
    };
    let fd = match move_below_table_max(fd, flags & libc::O_CLOEXEC != 0) {
        Ok(fd) => fd,
        Err(e) => {
            // SAFETY: unmapping what we just mapped.
            unsafe { raw::munmap(shared.cast(), SHARED_BYTES) };
            return Err(e);
        }
    };
    Ok((fd, OpenFile::from_shared(shared, ino, is_dir, path.to_vec())))
}

fn move_below_table_max(fd: i32, cloexec: bool) -> Result<i32, i32> {
    if (fd as usize) < FD_TABLE_MAX {
        return Ok(fd);
    }
    let cmd = if cloexec { libc::F_DUPFD_CLOEXEC } else { libc::F_DUPFD };
    let low = raw::fcntl(fd, cmd, 0);
    raw::close(fd);
    let low = low?;
    if low as usize >= FD_TABLE_MAX {
        raw::close(low);
        return Err(libc::EMFILE);
    }
    Ok(low)
}

impl OpenFile {
    fn from_shared(shared: *mut Shared, ino: u64, is_dir: bool, path: Vec<u8>) -> Self {
        Self { shared, ino, is_dir, path, node: OnceLock::new(), listing: Mutex::new(None), dir_inode: Mutex::new(None), lock_fd: Mutex::new(None) }
    }

    /// A placeholder inherited across `exec`: maps it and reads its state back.
    fn adopt(fd: i32) -> Option<Self> {
        let shared = raw::mmap_shared(fd, SHARED_BYTES).ok()?.cast::<Shared>();
        // SAFETY: a mapping of SHARED_BYTES of a kura placeholder (checked by the magic next).
        let s = unsafe { &*shared };
        // SAFETY: magic is plain memory in our mapping.
        if unsafe { std::ptr::read_volatile(&s.magic) } != SHARED_MAGIC || s.path_len as usize > SHARED_PATH_BYTES_MAX {
            // SAFETY: unmapping what we just mapped.
            unsafe { raw::munmap(shared.cast(), SHARED_BYTES) };
            return None;
        }
        let path = s.path[..s.path_len as usize].to_vec();
        let file = Self::from_shared(shared, s.ino, s.is_dir != 0, path);
        *file.lock_fd.lock() = file.inherited_lock_fd();
        Some(file)
    }

    /// The lock file the image before `exec` left open for this description: the recorded
    /// number, if it is still open on this inode's lock file. It goes back to close-on-exec
    /// (see `lock_files_across_exec` in the hooks).
    fn inherited_lock_fd(&self) -> Option<i32> {
        let fd = (self.shared().lock_fd_plus_one.load(Ordering::Relaxed) as i32).checked_sub(1).filter(|fd| *fd >= 0)?;
        let (_, path) = lock_file_path(self.ino);
        (raw::fstat_id(fd).ok()? == raw::stat_id(&path).ok()?).then_some(())?;
        raw::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC.into()).ok()?;
        Some(fd)
    }
}

/// The descriptor table's lock, held across `fork` (see [`FdTable::lock_for_fork`]).
pub struct FdTableForkLock<'a> {
    _entries: RwLockWriteGuard<'a, Vec<Option<Arc<OpenFile>>>>,
}

/// Descriptor number → open file, for this process.
pub struct FdTable {
    entries: RwLock<Vec<Option<Arc<OpenFile>>>>,
    /// Kura descriptors open: while 0, hooks skip the table entirely.
    count: AtomicUsize,
    /// Inodes this process took POSIX record locks on (a few: a process locks few files).
    posix_locked: Mutex<Vec<u64>>,
}

impl FdTable {
    pub fn new() -> Self {
        Self { entries: RwLock::new(Vec::new()), count: AtomicUsize::new(0), posix_locked: Mutex::new(Vec::new()) }
    }

    /// The open file behind `fd`, if it is a kura descriptor.
    #[inline]
    pub fn get(&self, fd: i32) -> Option<Arc<OpenFile>> {
        if self.count.load(Ordering::Relaxed) == 0 || fd < 0 {
            return None;
        }
        self.entries.read().get(fd as usize)?.clone()
    }

    /// Whether `fd` is a kura descriptor (no reference taken).
    #[inline]
    pub fn contains(&self, fd: i32) -> bool {
        if self.count.load(Ordering::Relaxed) == 0 || fd < 0 {
            return false;
        }
        self.entries.read().get(fd as usize).is_some_and(Option::is_some)
    }

    /// Puts `file` at `fd`, returning what was there.
    pub fn install(&self, fd: i32, file: Arc<OpenFile>) -> Option<Arc<OpenFile>> {
        let mut entries = self.entries.write();
        let i = fd as usize;
        if entries.len() <= i {
            entries.resize(i + 1, None);
        }
        let old = entries[i].replace(file);
        if old.is_none() {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        old
    }

    pub fn remove(&self, fd: i32) -> Option<Arc<OpenFile>> {
        if fd < 0 {
            return None;
        }
        let mut entries = self.entries.write();
        let old = entries.get_mut(fd as usize)?.take();
        if old.is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        old
    }

    /// Notes that this process took a POSIX record lock on `ino`.
    pub fn note_posix_lock(&self, ino: u64) {
        let mut locked = self.posix_locked.lock();
        if !locked.contains(&ino) {
            locked.push(ino);
        }
    }

    /// Whether this process may hold POSIX record locks on `ino`, forgetting it.
    pub fn take_posix_locked(&self, ino: u64) -> bool {
        let mut locked = self.posix_locked.lock();
        let before = locked.len();
        locked.retain(|&i| i != ino);
        locked.len() != before
    }

    /// Every kura descriptor (for write-back before exec and at exit).
    pub fn all(&self) -> Vec<(i32, Arc<OpenFile>)> {
        let entries = self.entries.read();
        entries.iter().enumerate().filter_map(|(i, e)| e.clone().map(|f| (i as i32, f))).collect()
    }

    /// Locks the table for `fork` until the result drops (in the parent and in the child).
    pub fn lock_for_fork(&self) -> FdTableForkLock<'_> {
        FdTableForkLock { _entries: self.entries.write() }
    }

    /// Finds kura placeholders inherited across `exec` (by their memfd name) and adopts them.
    pub fn recover_inherited(&self) {
        let fds: Vec<i32> = open_descriptors().into_iter().take(INHERITED_SCAN_MAX).collect();
        // Descriptors of one description (one memfd) share one open file, as before `exec`.
        let mut adopted: Vec<(u64, Arc<OpenFile>)> = Vec::new();
        for fd in fds {
            // A placeholder looks like one to fstat (no path to walk, as a readlink of
            // /proc/self/fd/N has: this runs at every program's start); its magic decides.
            let Some(memfd_ino) = placeholder_like(fd) else { continue };
            if fd as usize >= FD_TABLE_MAX {
                continue;
            }
            if let Some((_, file)) = adopted.iter().find(|(ino, _)| *ino == memfd_ino) {
                self.install(fd, file.clone());
            } else if let Some(file) = OpenFile::adopt(fd) {
                let file = Arc::new(file);
                adopted.push((memfd_ino, file.clone()));
                self.install(fd, file);
            }
        }
    }

    pub fn read_guard(&self) -> RwLockReadGuard<'_, Vec<Option<Arc<OpenFile>>>> {
        self.entries.read()
    }
}
