//! The FUSE single-file export: a mount where each volume is one regular file of the
//! volume's size, for `losetup` to attach (`losetup --direct-io=on` is best) — a real kernel
//! block device on the pool on machines without the nbd or ublk drivers.
//!
//! The FUSE threads share a few pipelined pool queues ([`dispatch`]): a request goes to the
//! queue's driving thread, or its receiver drives the queue itself, and each is answered as it
//! completes. With `queues: 0` (or a pool whose waits cannot be woken: an embedded engine
//! without io_uring) every FUSE thread serves one request at a time with its own pool context
//! (a [`Worker`]). Either way a read or write is split into
//! 4 KiB pool operations submitted together;
//! `fsync` is the pool's durability barrier; `fallocate(PUNCH_HOLE | ZERO_RANGE)` (what a loop
//! device sends for discard and write-zeroes) deletes the whole blocks and zeroes the ends.
//! Files are opened in FUSE `direct_io` mode (no page cache in between, so nothing is dirty
//! in the kernel when `fsync` returns) with parallel direct writes, and the kernel may keep
//! many asynchronous direct requests in flight (`FUSE_ASYNC_DIO`), which the threads share.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, SessionACL, WriteFlags,
};
use kura_pool::Pool;

use crate::error::BlockError;
use crate::queue::{BlockQueue, Done, Volume};

mod dispatch;

pub const THREADS_DEFAULT: usize = 32;
pub const THREADS_MAX: usize = 256;
/// Pipelined pool queues the FUSE threads of an export share.
pub const QUEUES_DEFAULT: usize = 2;
pub const QUEUES_MAX: usize = 64;
/// Largest read or write the kernel sends in one FUSE request.
pub const REQUEST_BYTES_MAX: u32 = 1 << 20;
/// Asynchronous (direct I/O) requests the kernel keeps in flight, at most.
const MAX_BACKGROUND: u16 = 128;
/// How long the kernel may cache names and attributes (they change only with a remount).
const ATTR_TTL: Duration = Duration::from_secs(1);
const ROOT_INO: u64 = 1;
/// Volume `i` is inode `FIRST_FILE_INO + i`.
const FIRST_FILE_INO: u64 = 2;
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

/// How to export.
#[derive(Debug, Clone)]
pub struct FuseConfig {
    pub read_only: bool,
    /// FUSE threads. They share the `queues`; without queues each serves one request at a
    /// time with its own pool context.
    pub threads: usize,
    /// Pipelined pool queues (each one connection per node on a networked pool, one io_uring
    /// ring on the embedded engine); 0: none (every FUSE thread waits for its own requests).
    pub queues: usize,
    /// Let other users than the one mounting use the files (`allow_other`).
    pub allow_other: bool,
    /// Pool operations one request keeps in flight, at most.
    pub window: usize,
}

impl Default for FuseConfig {
    fn default() -> Self {
        Self { read_only: false, threads: THREADS_DEFAULT, queues: QUEUES_DEFAULT, allow_other: false, window: crate::queue::WINDOW_MAX }
    }
}

/// One thread's pool context and request engine.
struct Worker {
    queue: BlockQueue<Vec<u8>>,
    buf: Vec<u8>,
}

struct KuraFs {
    pool: Pool,
    volumes: Vec<Arc<Volume>>,
    config: FuseConfig,
    workers: Mutex<Vec<Worker>>,
    /// The shared queues; empty with `queues: 0` or when the pool's waits cannot be woken.
    dispatchers: Vec<dispatch::Dispatcher>,
    next_dispatcher: AtomicUsize,
    mounted_at: SystemTime,
    uid: u32,
    gid: u32,
}

impl KuraFs {
    fn volume(&self, ino: INodeNo) -> Option<&Arc<Volume>> {
        ino.0.checked_sub(FIRST_FILE_INO).and_then(|i| self.volumes.get(i as usize))
    }

    fn file_attr(&self, index: usize) -> FileAttr {
        let volume = &self.volumes[index];
        let created = UNIX_EPOCH + Duration::from_secs(volume.meta.created_unix_s);
        FileAttr {
            ino: INodeNo(FIRST_FILE_INO + index as u64),
            size: volume.meta.size_bytes,
            blocks: volume.meta.size_bytes / 512,
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: created,
            kind: FileType::RegularFile,
            perm: if self.config.read_only { 0o400 } else { 0o600 },
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn root_attr(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo(ROOT_INO),
            size: 0,
            blocks: 0,
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// The queue to hand the next request to (round robin), if there are any.
    fn dispatcher(&self) -> Option<&dispatch::Dispatcher> {
        if self.dispatchers.is_empty() {
            return None;
        }
        let next = self.next_dispatcher.fetch_add(1, Ordering::Relaxed);
        Some(&self.dispatchers[next % self.dispatchers.len()])
    }

    fn take_worker(&self) -> Result<Worker, Errno> {
        if let Some(worker) = self.workers.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(worker);
        }
        match self.pool.context() {
            Ok(ctx) => Ok(Worker { queue: BlockQueue::new(ctx, self.config.window), buf: Vec::new() }),
            Err(e) => {
                tracing::error!(error = %e, "fuse: no pool context");
                Err(Errno::EIO)
            }
        }
    }

    fn give_back(&self, worker: Worker) {
        self.workers.lock().unwrap_or_else(|e| e.into_inner()).push(worker);
    }

    /// Runs one submitted request to completion on `worker`.
    fn wait(worker: &mut Worker) -> Result<Option<Vec<u8>>, BlockError> {
        let mut finished: Option<Done<Vec<u8>>> = None;
        while finished.is_none() {
            worker.queue.poll(None, &mut |done| finished = Some(done))?;
        }
        let done = finished.expect("one request, one completion");
        done.result.map(|()| done.buf)
    }

    fn errno(e: &BlockError) -> Errno {
        tracing::debug!(error = %e, "fuse: request failed");
        Errno::from_i32(e.errno())
    }

    /// Runs `submit` then waits, on a worker of this thread's choosing.
    fn run(&self, submit: impl FnOnce(&mut Worker) -> Result<(), BlockError>) -> Result<Option<Vec<u8>>, Errno> {
        let mut worker = self.take_worker()?;
        let result = submit(&mut worker).and_then(|()| Self::wait(&mut worker));
        self.give_back(worker);
        result.map_err(|e| Self::errno(&e))
    }
}

impl Filesystem for KuraFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // Optional speed-ups: an older kernel without them still works.
        for flag in [InitFlags::FUSE_ASYNC_DIO, InitFlags::FUSE_MAX_PAGES] {
            if let Err(missing) = config.add_capabilities(flag) {
                tracing::info!(?missing, "fuse: the kernel lacks a capability");
            }
        }
        let _ = config.set_max_write(REQUEST_BYTES_MAX);
        let _ = config.set_max_readahead(REQUEST_BYTES_MAX);
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND * 3 / 4);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent.0 != ROOT_INO {
            return reply.error(Errno::ENOENT);
        }
        match self.volumes.iter().position(|v| OsStr::new(&v.meta.name) == name) {
            Some(index) => reply.entry(&ATTR_TTL, &self.file_attr(index), fuser::Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == ROOT_INO {
            return reply.attr(&ATTR_TTL, &self.root_attr());
        }
        match self.volume(ino) {
            Some(_) => reply.attr(&ATTR_TTL, &self.file_attr((ino.0 - FIRST_FILE_INO) as usize)),
            None => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(volume) = self.volume(ino) else {
            return reply.error(if ino.0 == ROOT_INO { Errno::EPERM } else { Errno::ENOENT });
        };
        // A volume file's size is the volume's: `kura volume resize` changes it.
        if size.is_some_and(|s| s != volume.meta.size_bytes) {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&ATTR_TTL, &self.file_attr((ino.0 - FIRST_FILE_INO) as usize));
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.volume(ino).is_none() {
            return reply.error(if ino.0 == ROOT_INO { Errno::EISDIR } else { Errno::ENOENT });
        }
        if self.config.read_only && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);
    }

    fn read(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, size: u32, _flags: OpenFlags, _lock_owner: Option<LockOwner>, reply: ReplyData) {
        let Some(volume) = self.volume(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let len = u64::from(size).min(volume.meta.size_bytes.saturating_sub(offset));
        if len == 0 {
            return reply.data(&[]);
        }
        if let Some(dispatcher) = self.dispatcher() {
            return dispatcher.run(dispatch::Job::Read { volume: Arc::clone(volume), offset, len, reply });
        }
        let mut worker = match self.take_worker() {
            Ok(w) => w,
            Err(e) => return reply.error(e),
        };
        let mut buf = std::mem::take(&mut worker.buf);
        buf.resize(len as usize, 0);
        let result = worker.queue.submit_read(0, volume, offset, len, buf).and_then(|()| Self::wait(&mut worker));
        match result {
            Ok(buf) => {
                let buf = buf.expect("a read returns its buffer");
                reply.data(&buf[..len as usize]);
                worker.buf = buf;
            }
            Err(e) => reply.error(Self::errno(&e)),
        }
        self.give_back(worker);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(volume) = self.volume(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if self.config.read_only {
            return reply.error(Errno::EROFS);
        }
        if offset.checked_add(data.len() as u64).is_none_or(|end| end > volume.meta.size_bytes) {
            return reply.error(Errno::EFBIG);
        }
        let sync = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        if let Some(dispatcher) = self.dispatcher() {
            return dispatcher.run(dispatch::Job::Write { volume: Arc::clone(volume), offset, data: data.to_vec(), fua: sync, reply });
        }
        match self.run(|w| w.queue.submit_write(0, volume, offset, data, sync)) {
            Ok(_) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: fuser::ReplyXattr) {
        // ENOSYS: the kernel stops asking (it would otherwise ask for security.capability
        // before every write).
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // close(2): nothing is cached here (direct I/O), durability is fsync's job.
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let Some(volume) = self.volume(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(dispatcher) = self.dispatcher() {
            return dispatcher.run(dispatch::Job::Flush { volume: Arc::clone(volume), reply });
        }
        match self.run(|w| w.queue.submit_flush(0, volume)) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 != ROOT_INO {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries: Vec<(u64, FileType, &str)> = vec![(ROOT_INO, FileType::Directory, "."), (ROOT_INO, FileType::Directory, "..")];
        for (i, v) in self.volumes.iter().enumerate() {
            entries.push((FIRST_FILE_INO + i as u64, FileType::RegularFile, &v.meta.name));
        }
        for (i, (entry_ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(entry_ino), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fallocate(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        let Some(volume) = self.volume(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if offset.checked_add(length).is_none_or(|end| end > volume.meta.size_bytes) {
            return reply.error(Errno::EFBIG);
        }
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) == 0 {
            // Plain allocation inside the file: blocks are thin, there is nothing to reserve.
            return if mode & !FALLOC_FL_KEEP_SIZE == 0 { reply.ok() } else { reply.error(Errno::EOPNOTSUPP) };
        }
        if self.config.read_only {
            return reply.error(Errno::EROFS);
        }
        if length == 0 {
            return reply.ok();
        }
        // Both read as zeros afterwards: whole blocks are deleted, the ends zeroed.
        if let Some(dispatcher) = self.dispatcher() {
            return dispatcher.run(dispatch::Job::Zeroes { volume: Arc::clone(volume), offset, len: length, reply });
        }
        match self.run(|w| w.queue.submit_write_zeroes(0, volume, offset, length, false, false)) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

/// A mounted export; unmounts when dropped or with [`FuseExport::unmount`].
pub struct FuseExport {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

impl FuseExport {
    /// Mounts `volumes` (already opened) as files under `mountpoint` and serves them.
    pub fn mount(pool: Pool, volumes: Vec<Arc<Volume>>, mountpoint: &Path, config: FuseConfig) -> io::Result<Self> {
        if !(1..=THREADS_MAX).contains(&config.threads) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("threads must be 1..={THREADS_MAX}")));
        }
        if config.queues > QUEUES_MAX {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("queues must be 0..={QUEUES_MAX}")));
        }
        let mut dispatchers = Vec::new();
        for _ in 0..config.queues {
            match dispatch::Dispatcher::new(&pool, config.window)? {
                Some(dispatcher) => dispatchers.push(dispatcher),
                None => break, // waits cannot be woken: a pool context per FUSE thread
            }
        }
        // SAFETY: getuid/getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let fs = KuraFs { pool, volumes, config: config.clone(), workers: Mutex::new(Vec::new()), dispatchers, next_dispatcher: AtomicUsize::new(0), mounted_at: SystemTime::now(), uid, gid };
        let mut options = Config::default();
        options.mount_options = vec![MountOption::FSName("kura".into()), MountOption::Subtype("kura-volumes".into()), MountOption::DefaultPermissions, MountOption::NoExec, MountOption::NoSuid, MountOption::NoDev];
        if config.read_only {
            options.mount_options.push(MountOption::RO);
        }
        options.acl = if config.allow_other { SessionACL::All } else { SessionACL::Owner };
        options.n_threads = Some(config.threads);
        options.clone_fd = true;
        let session = fuser::Session::new(fs, mountpoint, &options)?.spawn()?;
        Ok(Self { session: Some(session), mountpoint: mountpoint.to_owned() })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and waits for the FUSE threads. Fails while a file is in use (a loop device
    /// still attached): detach it first.
    pub fn unmount(mut self) -> io::Result<()> {
        self.session.take().expect("mounted").umount_and_join()
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if let Some(session) = self.session.take()
            && let Err(e) = session.umount_and_join()
        {
            tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e, "fuse: unmount failed");
        }
    }
}
