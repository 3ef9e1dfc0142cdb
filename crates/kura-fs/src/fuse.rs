//! The FUSE adapter (`kura fs mount`): the same namespace and layout as the preload library,
//! through the kernel, for programs that cannot be preloaded (static binaries) and for the rest
//! of the system. Permission checks are the kernel's (`default_permissions`); attributes and
//! entries are not cached by the kernel (time-to-live zero), because other processes change
//! the namespace through the pool directly.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::cache::{Node, WriteMode};
use crate::error::FsError;
use crate::layout::{DirEntry, Inode, file_type};
use crate::ns::{Cred, Owner, RenameFlags, SetAttr, now_ns};
use crate::xattr::XattrFlags;
use crate::sync::Mutex;
use crate::Fs;

/// Kernel threads reading FUSE requests.
const FUSE_THREADS: usize = 4;
/// How long the kernel keeps entries and attributes by default: nothing, each use asks
/// kura, so changes by other processes and hosts are seen at once.
pub const CACHE_TIMEOUT_DEFAULT: Duration = Duration::ZERO;
/// The longest cache timeout accepted.
pub const CACHE_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

enum Handle {
    File { node: Arc<Node>, flags: i32 },
    /// `ino`: the directory, whose attributes [`KuraFuse::open_dirs`] keeps.
    Dir { entries: Vec<DirEntry>, ino: u64 },
}

/// A directory some handles have open: how many, and its attributes as last seen, for
/// `fstat` after an `rmdir` deleted its record.
struct OpenDir {
    handles: usize,
    inode: Inode,
}

/// The file system as a FUSE server.
pub struct KuraFuse {
    fs: Arc<Fs>,
    handles: Mutex<HashMap<u64, Handle>>,
    /// The directories open handles have, by inode number (a getattr looks here, not
    /// through every handle).
    open_dirs: Mutex<HashMap<u64, OpenDir>>,
    next_handle: AtomicU64,
    /// How long the kernel may answer lookups and `stat` from its own cache.
    ttl: Duration,
}

fn errno(e: FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 { UNIX_EPOCH + Duration::from_nanos(ns as u64) } else { UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs()) }
}

fn ns_of(t: TimeOrNow) -> i64 {
    match t {
        TimeOrNow::Now => now_ns(),
        TimeOrNow::SpecificTime(t) => match t.duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_nanos() as i64,
            Err(e) => -(e.duration().as_nanos() as i64),
        },
    }
}

fn kind(mode: u32) -> FileType {
    match file_type(mode) {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn dtype_kind(dtype: u8) -> FileType {
    match dtype {
        libc::DT_DIR => FileType::Directory,
        libc::DT_LNK => FileType::Symlink,
        libc::DT_FIFO => FileType::NamedPipe,
        libc::DT_CHR => FileType::CharDevice,
        libc::DT_BLK => FileType::BlockDevice,
        libc::DT_SOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

impl KuraFuse {
    /// `ttl`: how long the kernel may keep the entries and attributes it is given (the FUSE
    /// entry and attribute timeouts), at most [`CACHE_TIMEOUT_MAX`].
    pub fn new(fs: Arc<Fs>, ttl: Duration) -> Self {
        Self { fs, handles: Mutex::new(HashMap::new()), open_dirs: Mutex::new(HashMap::new()), next_handle: AtomicU64::new(1), ttl: ttl.min(CACHE_TIMEOUT_MAX) }
    }

    fn attr(&self, inode: &Inode) -> FileAttr {
        FileAttr {
            ino: INodeNo(inode.ino),
            size: inode.size_bytes(self.fs.chunk_size_bytes() as u64),
            blocks: inode.blocks(self.fs.chunk_size_bytes() as u64),
            atime: time(inode.atime_ns),
            mtime: time(inode.mtime_ns),
            ctime: time(inode.ctime_ns),
            crtime: time(inode.ctime_ns),
            kind: kind(inode.mode),
            perm: (inode.mode & 0o7777) as u16,
            nlink: inode.nlink,
            uid: inode.uid,
            gid: inode.gid,
            rdev: inode.rdev,
            blksize: self.fs.chunk_size_bytes() as u32,
            flags: 0,
        }
    }

    fn add_handle(&self, handle: Handle) -> FileHandle {
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, handle);
        FileHandle(fh)
    }

    fn node(&self, fh: FileHandle) -> Result<(Arc<Node>, i32), Errno> {
        match self.handles.lock().get(&fh.0) {
            Some(Handle::File { node, flags }) => Ok((Arc::clone(node), *flags)),
            _ => Err(Errno::EBADF),
        }
    }

    /// A directory removed while open stays, as on Linux, a directory with no links (its
    /// record went at `rmdir`; the kernel asks for its attributes without the handle).
    fn removed_open_dir(&self, ino: u64) -> Option<Inode> {
        let mut inode = self.open_dirs.lock().get(&ino)?.inode.clone();
        inode.nlink = 0;
        Some(inode)
    }

    /// Keeps the copies open handles of directory `inode` hold up to date, for
    /// [`KuraFuse::removed_open_dir`] (a chmod before the rmdir shows, as on Linux).
    fn refresh_open_dir(&self, inode: &Inode) {
        if crate::layout::is_dir(inode.mode) {
            self.update_open_dir(inode.ino, |held| *held = inode.clone());
        }
    }

    /// Changes the copy kept of open directory `ino`, if it is open.
    fn update_open_dir(&self, ino: u64, change: impl FnOnce(&mut Inode)) {
        if let Some(open) = self.open_dirs.lock().get_mut(&ino) {
            change(&mut open.inode);
        }
    }

    /// A handle of directory `inode` opens: its attributes as of now are kept.
    fn open_dir(&self, entries: Vec<DirEntry>, inode: Inode) -> FileHandle {
        let ino = inode.ino;
        match self.open_dirs.lock().entry(ino) {
            Entry::Occupied(mut open) => {
                let open = open.get_mut();
                open.handles += 1;
                open.inode = inode;
            }
            Entry::Vacant(slot) => {
                slot.insert(OpenDir { handles: 1, inode });
            }
        }
        self.add_handle(Handle::Dir { entries, ino })
    }

    /// A handle of directory `ino` is released.
    fn close_dir(&self, ino: u64) {
        let mut open_dirs = self.open_dirs.lock();
        if let Some(open) = open_dirs.get_mut(&ino) {
            open.handles -= 1;
            if open.handles == 0 {
                open_dirs.remove(&ino);
            }
        }
    }

    fn entry(&self, inode: &Inode, reply: ReplyEntry) {
        reply.entry(&self.ttl, &self.attr(inode), Generation(0));
    }
}

fn owner(req: &Request) -> Owner {
    Owner { uid: req.uid(), gid: req.gid() }
}

impl Filesystem for KuraFuse {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.fs.lookup_inode(parent.0, name.as_bytes()) {
            Ok(Some((_, inode))) => self.entry(&inode, reply),
            Ok(None) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(inode) => {
                self.refresh_open_dir(&inode);
                reply.attr(&self.ttl, &self.attr(&inode));
            }
            Err(FsError::NotFound) if let Some(inode) = self.removed_open_dir(ino.0) => reply.attr(&self.ttl, &self.attr(&inode)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let attr = SetAttr { mode, uid, gid, size, atime_ns: atime.map(ns_of), mtime_ns: mtime.map(ns_of) };
        match self.fs.setattr(ino.0, attr) {
            Ok(inode) => {
                self.refresh_open_dir(&inode);
                reply.attr(&self.ttl, &self.attr(&inode));
            }
            // A directory removed while open changes in its handles' copies, as on Linux.
            Err(FsError::NotFound) if attr.size.is_none() && self.removed_open_dir(ino.0).is_some() => {
                let now = crate::ns::now_ns();
                self.update_open_dir(ino.0, |held| crate::ns::apply_setattr(held, &attr, now));
                match self.removed_open_dir(ino.0) {
                    Some(inode) => reply.attr(&self.ttl, &self.attr(&inode)),
                    None => reply.error(Errno::ENOENT),
                }
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        match self.fs.create(parent.0, name.as_bytes(), mode & !(umask & 0o777), rdev, b"", owner(req), true) {
            Ok((inode, _)) => self.entry(&inode, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        match self.fs.mkdir(parent.0, name.as_bytes(), mode & !umask & 0o7777, owner(req)) {
            Ok(inode) => self.entry(&inode, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.unlink(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.rmdir(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        match self.fs.symlink(parent.0, link_name.as_bytes(), target.as_os_str().as_bytes(), owner(req)) {
            Ok(inode) => self.entry(&inode, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rename(&self, _req: &Request, parent: INodeNo, name: &OsStr, newparent: INodeNo, newname: &OsStr, flags: fuser::RenameFlags, reply: ReplyEmpty) {
        let rf = RenameFlags { noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE), exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE) };
        match self.fs.rename(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), rf) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        match self.fs.link(ino.0, newparent.0, newname.as_bytes()) {
            Ok(inode) => self.entry(&inode, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.getattr(ino.0) {
            Ok(inode) if file_type(inode.mode) == libc::S_IFREG => match if flags.0 & libc::O_ACCMODE != libc::O_WRONLY && flags.0 & (libc::O_TRUNC | libc::O_DIRECT) == 0 { self.fs.open_node_reading(&inode) } else { self.fs.open_node(&inode) } {
                Ok(node) => {
                    let fh = self.add_handle(Handle::File { node, flags: flags.0 });
                    reply.opened(fh, FopenFlags::empty());
                }
                // Unlinked since the kernel looked the name up: ESTALE makes it look again.
                Err(e) => reply.error(errno(e.gone_is_stale())),
            },
            Ok(_) => reply.error(Errno::from_i32(libc::ENXIO)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        let (node, _) = match self.node(fh) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match self.fs.fallocate(&node, mode, offset as i64, length as i64) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// The kernel asks only for `SEEK_DATA` and `SEEK_HOLE` (it moves the offset itself for
    /// the others).
    fn lseek(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let (node, _) = match self.node(fh) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        if !matches!(whence, libc::SEEK_DATA | libc::SEEK_HOLE) {
            return reply.error(Errno::EINVAL);
        }
        match self.fs.seek_data_or_hole(&node, offset, whence == libc::SEEK_HOLE) {
            Ok(Some(at)) => reply.offset(at as i64),
            Ok(None) => reply.error(Errno::from_i32(libc::ENXIO)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, size: u32, _flags: OpenFlags, _lock: Option<LockOwner>, reply: ReplyData) {
        let (node, flags) = match self.node(fh) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let mut buf = vec![0u8; size as usize];
        let read = if flags & libc::O_DIRECT != 0 { self.fs.read_direct(&node, offset, &mut buf) } else { self.fs.read(&node, offset, &mut buf) };
        match read {
            Ok(n) => reply.data(&buf[..n]),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, data: &[u8], _wf: WriteFlags, _flags: OpenFlags, _lock: Option<LockOwner>, reply: ReplyWrite) {
        let (node, flags) = match self.node(fh) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let mode = match (flags & libc::O_DIRECT != 0, flags & libc::O_DSYNC != 0) {
            (false, false) => WriteMode::Buffered,
            (false, true) => WriteMode::Sync,
            (true, false) => WriteMode::Direct,
            (true, true) => WriteMode::DirectSync,
        };
        match self.fs.write(&node, offset, data, mode) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _lock: LockOwner, reply: ReplyEmpty) {
        // close(): make the data visible to other processes of the pool.
        match self.node(fh) {
            Ok((node, _)) => match self.fs.writeback(&node) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            },
            Err(_) => reply.ok(),
        }
    }

    fn release(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, _lock: Option<LockOwner>, _flush: bool, reply: ReplyEmpty) {
        // The handle table is not held across the write-back.
        let removed = self.handles.lock().remove(&fh.0);
        match removed {
            Some(Handle::File { node, .. }) => match self.fs.release(&node) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            },
            Some(Handle::Dir { ino, .. }) => {
                self.close_dir(ino);
                reply.ok()
            }
            None => reply.ok(),
        }
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.node(fh) {
            Ok((node, _)) => match self.fs.fsync(&node) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            },
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let listing = self.fs.getattr(ino.0).and_then(|dir| {
            if file_type(dir.mode) != libc::S_IFDIR {
                return Err(FsError::NotDir);
            }
            let mut entries = vec![
                DirEntry { name: b".".to_vec(), ino: ino.0, dtype: libc::DT_DIR },
                DirEntry { name: b"..".to_vec(), ino: dir.parent.max(1), dtype: libc::DT_DIR },
            ];
            entries.extend(self.fs.readdir(ino.0)?);
            Ok((entries, dir))
        });
        match listing {
            Ok((entries, inode)) => reply.opened(self.open_dir(entries, inode), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let handles = self.handles.lock();
        let Some(Handle::Dir { entries, .. }) = handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        for (i, e) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(e.ino), (i + 1) as u64, dtype_kind(e.dtype), OsStr::from_bytes(&e.name)) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        let removed = self.handles.lock().remove(&fh.0);
        if let Some(Handle::Dir { ino, .. }) = removed {
            self.close_dir(ino);
        }
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.fs.kv().flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs() {
            Ok(s) => reply.statfs(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize as u32, s.f_namelen as u32, s.f_frsize as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    // The kernel checked the caller (`xattr_permission`, with `default_permissions`) before
    // these: no credentials are passed, except to hide `trusted.` names from a listing.
    fn setxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, value: &[u8], flags: i32, _position: u32, reply: ReplyEmpty) {
        match XattrFlags::from_bits(flags).and_then(|flags| self.fs.setxattr(ino.0, name.as_bytes(), value, flags, None)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.fs.getxattr(ino.0, name.as_bytes(), None) {
            Ok(value) => reply_xattr(reply, size, &value),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let cred = Cred { uid: req.uid(), gid: req.gid(), groups: Vec::new() };
        match self.fs.listxattr(ino.0, Some(&cred)) {
            Ok(names) => reply_xattr(reply, size, &names),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.fs.removexattr(ino.0, name.as_bytes(), None) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        match self.fs.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let kind = if file_type(mode) == 0 { libc::S_IFREG } else { file_type(mode) };
        let (perm, excl) = (mode & 0o7777 & !umask, flags & libc::O_EXCL != 0);
        let created = if kind == libc::S_IFREG {
            self.fs.create_open(parent.0, name.as_bytes(), perm, owner(req), excl)
        } else {
            self.fs.create(parent.0, name.as_bytes(), kind | perm, 0, b"", owner(req), excl)
        };
        match created {
            Ok((inode, made)) => match if made && kind == libc::S_IFREG { self.fs.open_node_created(&inode) } else { self.fs.open_node(&inode) } {
                Ok(node) => {
                    let fh = self.add_handle(Handle::File { node, flags });
                    reply.created(&self.ttl, &self.attr(&inode), Generation(0), fh, FopenFlags::empty());
                }
                Err(e) => reply.error(errno(e)),
            },
            Err(e) => reply.error(errno(e)),
        }
    }
}

/// Mounts `fs` at `mountpoint` and serves it until unmounted; `cache_timeout`: see
/// [`KuraFuse::new`].
pub fn mount(fs: Arc<Fs>, mountpoint: &Path, allow_other: bool, cache_timeout: Duration) -> std::io::Result<()> {
    let mut config = Config::default();
    config.mount_options = vec![MountOption::FSName("kura".into()), MountOption::Subtype("kura".into()), MountOption::DefaultPermissions];
    if allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(FUSE_THREADS);
    fuser::mount(KuraFuse::new(fs, cache_timeout), mountpoint, &config)
}

/// A `getxattr`/`listxattr` answer: the length when asked with size 0, `ERANGE` when `data`
/// does not fit `size`.
fn reply_xattr(reply: ReplyXattr, size: u32, data: &[u8]) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if data.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(data);
    }
}
