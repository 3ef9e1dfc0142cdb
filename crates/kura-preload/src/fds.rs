//! Kura descriptors: kernel placeholders (`memfd`s holding the open file description's shared
//! state) and the table from descriptor number to this process's [`OpenFile`].

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use kura_fs::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use kura_fs::{DirEntry, Inode, Node};

use crate::hooks::raw;

/// Name of a placeholder memfd (what `/proc/self/fd/N` shows, after `/memfd:`).
pub const PLACEHOLDER_NAME: &[u8] = b"kura-fd\0";
const PLACEHOLDER_LINK_PREFIX: &[u8] = b"/memfd:kura-fd";
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
    _pad: u32,
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
        Some(Self::from_shared(shared, s.ino, s.is_dir != 0, path))
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
}

impl FdTable {
    pub fn new() -> Self {
        Self { entries: RwLock::new(Vec::new()), count: AtomicUsize::new(0) }
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
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return;
        };
        let fds: Vec<i32> = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).take(INHERITED_SCAN_MAX).collect();
        let mut link = [0u8; 256];
        for fd in fds {
            let proc_path = format!("/proc/self/fd/{fd}\0");
            let Ok(n) = raw::readlink(proc_path.as_bytes(), &mut link) else {
                continue;
            };
            if !link[..n].starts_with(PLACEHOLDER_LINK_PREFIX) || fd as usize >= FD_TABLE_MAX {
                continue;
            }
            if let Some(file) = OpenFile::adopt(fd) {
                self.install(fd, Arc::new(file));
            }
        }
    }

    #[allow(dead_code)]
    pub fn read_guard(&self) -> RwLockReadGuard<'_, Vec<Option<Arc<OpenFile>>>> {
        self.entries.read()
    }
}
