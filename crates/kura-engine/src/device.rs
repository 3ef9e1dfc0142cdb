//! The one I/O seam: everything the engine persists goes through [`Device`].
//!
//! [`FileDevice`] is a regular file or a raw block device, opened with `O_DIRECT` where the file
//! system allows it. [`SimDevice`] is an in-memory device for crash tests: it keeps unsynced
//! writes apart so a simulated crash can drop them, apply them or tear them sector by sector,
//! and it can fail the Nth operation.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::aligned::AlignedBuf;

/// Block storage addressed by byte offset. Offsets, lengths and buffer addresses must be
/// multiples of [`Device::alignment_bytes`] (the `O_DIRECT` rule, enforced by the simulator).
pub trait Device: Send + Sync + 'static {
    fn len_bytes(&self) -> u64;
    /// Smallest offset and length granularity for I/O (the logical sector size).
    fn alignment_bytes(&self) -> u32;
    fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write_at(&self, offset_bytes: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;
    /// A file descriptor that io_uring may read from directly, when the device has one.
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }
    /// Whether reads bypass the page cache.
    fn is_direct(&self) -> bool {
        false
    }
    /// Makes later writes to a range that is overwritten often plain data writes. A regular
    /// file allocated up front has unwritten extents: the first write to each makes the next
    /// `fdatasync` commit file-system metadata too (on ext4 a journal commit, about a second
    /// write and flush), so the file writes zeros over the range once. Others do nothing.
    fn materialize(&self, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        let _ = (offset_bytes, len_bytes);
        Ok(())
    }
}

/// Zeros written at once by [`FileDevice::materialize`].
const MATERIALIZE_WRITE_BYTES: usize = 4 << 20;

/// A finished queued read.
#[derive(Debug)]
pub struct ReadCompletion {
    pub token: u64,
    pub buf: AlignedBuf,
    pub result: io::Result<()>,
}

/// A per-thread queue of reads kept in flight together (io_uring on files).
pub trait IoQueue: Send {
    /// Queues a read of `buf.len()` bytes; it is issued at the next [`IoQueue::wait`].
    fn submit_read(&mut self, offset_bytes: u64, buf: AlignedBuf, token: u64) -> io::Result<()>;
    fn in_flight(&self) -> usize;
    fn depth(&self) -> usize;
    /// Issues queued reads and waits until at least `min_complete` have finished.
    fn wait(&mut self, min_complete: usize, out: &mut Vec<ReadCompletion>) -> io::Result<()>;
    /// Like [`IoQueue::wait`], but also returns, with `true`, as soon as one of `watch`
    /// (descriptors the caller keeps open while this queue lives, at most
    /// [`WATCHED_FDS_MAX`]) has data to read, so a thread that waits for its reads still
    /// notices new requests on its socket or a wake-up. A queue that cannot watch descriptors
    /// ([`IoQueue::can_watch`] is false) just waits and returns `false`.
    fn wait_watching(&mut self, min_complete: usize, watch: &[RawFd], out: &mut Vec<ReadCompletion>) -> io::Result<bool> {
        let _ = watch;
        self.wait(min_complete, out)?;
        Ok(false)
    }
    /// Whether [`IoQueue::wait_watching`] watches its descriptors.
    fn can_watch(&self) -> bool {
        false
    }
    /// Issues queued reads without waiting (so a batch of completions being processed does not
    /// hold back the reads it produces).
    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// Reads queued but not yet issued.
    fn unsubmitted(&self) -> usize {
        0
    }
    /// Takes the reads that have finished, without waiting and without a system call (a
    /// synchronous queue does its queued reads here: they finish when asked for).
    fn reap(&mut self, out: &mut Vec<ReadCompletion>);
    /// An eventfd the kernel signals whenever a read finishes, for a caller that waits in
    /// epoll beside other descriptors (see [`io_queue_notifying`]); `None` when reads finish
    /// only in [`IoQueue::wait`] or [`IoQueue::reap`].
    fn completion_fd(&self) -> Option<RawFd> {
        None
    }
    /// Resets [`IoQueue::completion_fd`]'s counter once its signal has been seen (one
    /// syscall; an edge-triggered poller is signalled again by the next completion anyway).
    fn clear_completion_fd(&self) {}
}

/// An io_uring queue when the device exposes a file descriptor and the kernel allows it;
/// otherwise reads are done synchronously at `wait`.
pub fn io_queue(device: &Arc<dyn Device>, depth: usize) -> Box<dyn IoQueue> {
    new_io_queue(device, depth, false)
}

/// Like [`io_queue`], with an io_uring queue also signalling an eventfd
/// ([`IoQueue::completion_fd`]) on every completion, for an event loop that polls it beside
/// sockets and takes completions with [`IoQueue::reap`].
pub fn io_queue_notifying(device: &Arc<dyn Device>, depth: usize) -> Box<dyn IoQueue> {
    new_io_queue(device, depth, true)
}

fn new_io_queue(device: &Arc<dyn Device>, depth: usize, notify: bool) -> Box<dyn IoQueue> {
    if let Some(fd) = device.raw_fd() {
        match UringQueue::new(device.clone(), fd, depth, notify) {
            Ok(queue) => return Box::new(queue),
            Err(error) => tracing::warn!(%error, "io_uring unavailable; reads will be synchronous"),
        }
    }
    Box::new(SyncQueue { device: device.clone(), depth, queued: Vec::new() })
}

struct SyncQueue {
    device: Arc<dyn Device>,
    depth: usize,
    queued: Vec<(u64, AlignedBuf, u64)>,
}

impl IoQueue for SyncQueue {
    fn submit_read(&mut self, offset_bytes: u64, buf: AlignedBuf, token: u64) -> io::Result<()> {
        if self.queued.len() >= self.depth {
            return Err(io::Error::other("I/O queue full"));
        }
        self.queued.push((offset_bytes, buf, token));
        Ok(())
    }
    fn in_flight(&self) -> usize {
        self.queued.len()
    }
    fn depth(&self) -> usize {
        self.depth
    }
    fn wait(&mut self, _min_complete: usize, out: &mut Vec<ReadCompletion>) -> io::Result<()> {
        self.reap(out);
        Ok(())
    }
    fn reap(&mut self, out: &mut Vec<ReadCompletion>) {
        for (offset, mut buf, token) in self.queued.drain(..) {
            let result = self.device.read_at(offset, &mut buf);
            out.push(ReadCompletion { token, buf, result });
        }
    }
}

struct UringQueue {
    ring: io_uring::IoUring,
    fd: RawFd,
    /// Keeps the file descriptor open while reads are in flight.
    _device: Arc<dyn Device>,
    slots: Vec<Option<(u64, AlignedBuf)>>,
    free_slots: Vec<u32>,
    unsubmitted: usize,
    /// Signalled by the kernel on every completion ([`io_queue_notifying`]).
    eventfd: Option<EventFd>,
    /// The descriptors a one-shot poll is armed on ([`IoQueue::wait_watching`]).
    watch_armed: Vec<RawFd>,
    /// One of those polls fired since the last wait.
    watch_fired: bool,
}

/// Largest io_uring queue (reads in flight per queue).
const URING_DEPTH_MAX: usize = 4096;

impl UringQueue {
    fn new(device: Arc<dyn Device>, fd: RawFd, depth: usize, notify: bool) -> io::Result<Self> {
        let depth = depth.clamp(1, URING_DEPTH_MAX);
        let entries = depth.next_power_of_two() as u32;
        // Completions wait for the thread's next system call instead of interrupting it
        // (Linux 5.19+); older kernels refuse the flag and get a plain ring.
        let ring = match io_uring::IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(ring) => ring,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => io_uring::IoUring::new(entries)?,
            Err(e) => return Err(e),
        };
        let ring = crate::fd::keep_ring_high(ring)?;
        let eventfd = if notify {
            let eventfd = EventFd::new()?;
            ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
            Some(eventfd)
        } else {
            None
        };
        Ok(Self {
            ring,
            fd,
            _device: device,
            slots: (0..depth).map(|_| None).collect(),
            free_slots: (0..depth as u32).rev().collect(),
            unsubmitted: 0,
            eventfd,
            watch_armed: Vec::with_capacity(WATCHED_FDS_MAX),
            watch_fired: false,
        })
    }

    /// Issues queued reads, waits until `want` completions are posted and collects them.
    fn enter(&mut self, want: usize, out: &mut Vec<ReadCompletion>) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) => return Err(error),
            }
        }
        self.unsubmitted = 0;
        self.collect(out);
        Ok(())
    }

    /// Moves every posted completion to `out`, handing each read's buffer back.
    fn collect(&mut self, out: &mut Vec<ReadCompletion>) {
        for cqe in self.ring.completion() {
            if let Some(fd) = watched_fd(cqe.user_data()) {
                // Readable, hung up or failed (a closed socket): the caller finds out which
                // when it reads.
                self.watch_armed.retain(|&armed| armed != fd);
                self.watch_fired = true;
                continue;
            }
            let slot = cqe.user_data() as usize;
            let (token, buf) = self.slots[slot].take().expect("completion for an empty slot");
            self.free_slots.push(slot as u32);
            let result = match cqe.result() {
                n if n < 0 => Err(io::Error::from_raw_os_error(-n)),
                n if n as usize != buf.len() => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short read")),
                _ => Ok(()),
            };
            out.push(ReadCompletion { token, buf, result });
        }
    }
}

impl IoQueue for UringQueue {
    fn submit_read(&mut self, offset_bytes: u64, mut buf: AlignedBuf, token: u64) -> io::Result<()> {
        let Some(slot) = self.free_slots.pop() else { return Err(io::Error::other("I/O queue full")) };
        let entry = io_uring::opcode::Read::new(io_uring::types::Fd(self.fd), buf.as_mut_ptr(), buf.len() as u32)
            .offset(offset_bytes)
            .build()
            .user_data(u64::from(slot));
        // SAFETY: the buffer's heap memory stays valid and untouched until its completion is
        // reaped: it is owned by `self.slots[slot]` and only handed back in `wait`. The file
        // descriptor is kept open by `_device`.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            self.free_slots.push(slot);
            return Err(io::Error::other("io_uring submission queue full"));
        }
        self.slots[slot as usize] = Some((token, buf));
        self.unsubmitted += 1;
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted > 0 {
            self.ring.submit()?;
            self.unsubmitted = 0;
        }
        Ok(())
    }

    fn unsubmitted(&self) -> usize {
        self.unsubmitted
    }

    fn wait(&mut self, min_complete: usize, out: &mut Vec<ReadCompletion>) -> io::Result<()> {
        self.enter(min_complete.min(self.in_flight()), out)
    }

    fn wait_watching(&mut self, min_complete: usize, watch: &[RawFd], out: &mut Vec<ReadCompletion>) -> io::Result<bool> {
        for &fd in watch {
            if self.watch_armed.contains(&fd) || self.watch_armed.len() >= WATCHED_FDS_MAX {
                continue;
            }
            let entry = io_uring::opcode::PollAdd::new(io_uring::types::Fd(fd), libc::POLLIN as u32).build().user_data(WATCH_TOKEN_FLAG | fd as u64);
            // SAFETY: a poll refers to no memory of ours; the caller keeps `fd` open while
            // this queue lives (and an armed poll holds its own reference to the file).
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                self.watch_armed.push(fd);
            }
        }
        self.watch_fired = false;
        // Only the polls asked for now count as completions to wait for: one armed by an
        // earlier call may fire meanwhile, and then returns early too.
        let watched = self.watch_armed.iter().filter(|fd| watch.contains(fd)).count();
        self.enter(min_complete.min(self.in_flight() + usize::from(watched > 0)), out)?;
        Ok(std::mem::take(&mut self.watch_fired))
    }

    fn can_watch(&self) -> bool {
        true
    }

    fn reap(&mut self, out: &mut Vec<ReadCompletion>) {
        self.collect(out);
    }

    fn completion_fd(&self) -> Option<RawFd> {
        self.eventfd.as_ref().map(AsRawFd::as_raw_fd)
    }

    fn clear_completion_fd(&self) {
        if let Some(eventfd) = &self.eventfd {
            eventfd.clear();
        }
    }
}

/// A non-blocking eventfd: one thread [`EventFd::signal`]s it, another's io_uring wait
/// watches it ([`IoQueue::wait_watching`]) and [`EventFd::clear`]s it after waking.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no memory arguments; its result is checked before use.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        Ok(Self(crate::fd::keep_high(unsafe { OwnedFd::from_raw_fd(raw) })))
    }

    /// Makes it readable (one `write`). A counter already at its maximum refuses the write,
    /// and is readable anyway.
    pub fn signal(&self) -> io::Result<()> {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a local u64 to our own eventfd.
        let n = unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
        if n == 8 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.kind() == io::ErrorKind::WouldBlock { Ok(()) } else { Err(error) }
    }

    /// Resets the counter (one `read`; with nothing signalled it fails with EAGAIN).
    pub fn clear(&self) {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a local u64 from our own non-blocking eventfd.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), (&raw mut count).cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// `user_data` of the cancellation a dropped queue sends (read slots are below 2^32).
const CANCEL_TOKEN: u64 = u64::MAX;
/// `user_data` of a poll [`IoQueue::wait_watching`] arms: this bit and the descriptor.
const WATCH_TOKEN_FLAG: u64 = 1 << 62;
/// Descriptors one [`IoQueue::wait_watching`] watches at most.
pub const WATCHED_FDS_MAX: usize = 4;

/// The descriptor of a watch poll's completion (`None` for reads and the drop's cancel).
fn watched_fd(user_data: u64) -> Option<RawFd> {
    (user_data != CANCEL_TOKEN && user_data & WATCH_TOKEN_FLAG != 0).then(|| (user_data & u64::from(u32::MAX)) as RawFd)
}

impl Drop for UringQueue {
    /// Closing the ring does not wait for reads in flight, and the kernel writes into their
    /// buffers until they finish (with `O_DIRECT`, into the pages themselves): a queue dropped
    /// mid-read (a caller returning early on an error) would free memory the kernel still
    /// writes. Cancel what can be cancelled, then wait for the rest (reads of a file always
    /// finish) before the buffers are freed; if waiting fails, leak them instead.
    fn drop(&mut self) {
        if self.in_flight() == 0 {
            return;
        }
        let cancel = io_uring::opcode::AsyncCancel2::new(io_uring::types::CancelBuilder::any()).build().user_data(CANCEL_TOKEN);
        // SAFETY: a cancellation refers to no memory. A kernel without it fails it, and the
        // loop below then waits for every read to finish.
        let _ = unsafe { self.ring.submission().push(&cancel) };
        while self.in_flight() > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) => {
                    tracing::error!(%error, in_flight = self.in_flight(), "cannot wait for reads in flight; leaking their buffers");
                    for (_, buf) in self.slots.iter_mut().filter_map(Option::take) {
                        std::mem::forget(buf);
                    }
                    return;
                }
            }
            for cqe in self.ring.completion() {
                let slot = cqe.user_data() as usize;
                if slot < self.slots.len() && self.slots[slot].take().is_some() {
                    self.free_slots.push(slot as u32);
                }
            }
        }
    }
}

/// How to open a [`FileDevice`].
#[derive(Debug, Clone)]
pub struct FileDeviceOptions {
    /// Create the file if it does not exist.
    pub create: bool,
    /// Size to give a regular file (allocated up front, so a full disk fails here, not later).
    pub size_bytes: Option<u64>,
    /// Use `O_DIRECT` when the file system supports it.
    pub direct_io: bool,
}

/// A regular file or a raw block device.
pub struct FileDevice {
    file: File,
    len_bytes: u64,
    alignment_bytes: u32,
    direct: bool,
    /// A regular file (not a block device).
    regular: bool,
    /// A second open of the store holding its exclusive `flock` for as long as the device
    /// lives ([`FileDevice::lock`]).
    _lock: File,
}

/// How long [`FileDevice::open`] waits for another open of the store to let go of it (a
/// process that is exiting, a server being stopped) before it refuses.
pub const STORE_LOCK_WAIT_MS_MAX: u64 = 500;

impl FileDevice {
    /// Opens (or creates) the store at `path`, which no other open may be using: two engines
    /// on one file would each fill and reclaim blocks the other thinks its own, and neither
    /// would see the other's writes (a second `kura serve` on a data directory, programs
    /// preloaded on one embedded store). A second open fails with `WouldBlock` ("in use").
    pub fn open(path: &Path, options: &FileDeviceOptions) -> io::Result<Self> {
        let (file, direct) = Self::open_file(path, options)?;
        let lock = Self::lock(path)?;
        let meta = file.metadata()?;
        let is_block = meta.file_type().is_block_device();
        let len_bytes = if is_block {
            block_device_size_bytes(&file)?
        } else {
            if let Some(size) = options.size_bytes
                && meta.len() < size
            {
                allocate(&file, size)?;
            }
            file.metadata()?.len()
        };
        let alignment_bytes = if is_block { block_device_sector_bytes(&file)? } else { dio_offset_alignment_bytes(&file).unwrap_or(512) };
        Ok(Self { file, len_bytes, alignment_bytes: alignment_bytes.max(512), direct, regular: !is_block, _lock: lock })
    }

    /// An exclusive `flock` of the store, on a descriptor of its own: the one the engine reads
    /// through is also io_uring's, and a ring's requests hold its file after the process that
    /// made them is gone (the ring is torn down after the process is reaped), so a lock on it
    /// would outlive a `kill -9`; this one goes when the process's descriptors close.
    /// Waits up to [`STORE_LOCK_WAIT_MS_MAX`] for a holder that is going away.
    fn lock(path: &Path) -> io::Result<File> {
        let file = OpenOptions::new().read(true).open(path).map(crate::fd::keep_high)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(STORE_LOCK_WAIT_MS_MAX);
        loop {
            // SAFETY: flock on a descriptor this function owns; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(file);
            }
            let error = io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(error);
            }
            if std::time::Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "{} is in use by another open of it (another kura process, or this one): a store has one engine at a time; stop the other, or serve the store with `kura serve` and reach it through kura:// URLs",
                        path.display()
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    fn open_file(path: &Path, options: &FileDeviceOptions) -> io::Result<(File, bool)> {
        let open = |direct: bool| {
            let with = |noatime: bool| {
                let mut opts = OpenOptions::new();
                opts.read(true).write(true).create(options.create);
                // O_NOATIME: reads need not update the file's access time (a check on every
                // read otherwise); only the owner (or root) may ask, so others open without it.
                opts.custom_flags(if direct { libc::O_DIRECT } else { 0 } | if noatime { libc::O_NOATIME } else { 0 });
                opts.open(path).map(crate::fd::keep_high)
            };
            match with(true) {
                Err(error) if error.raw_os_error() == Some(libc::EPERM) => with(false),
                other => other,
            }
        };
        if options.direct_io {
            match open(true) {
                Ok(file) => return Ok((file, true)),
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(path = %path.display(), "file system refuses O_DIRECT; using buffered I/O");
                }
                Err(error) => return Err(error),
            }
        }
        Ok((open(false)?, false))
    }
}

fn allocate(file: &File, size_bytes: u64) -> io::Result<()> {
    // SAFETY: plain syscall on a valid descriptor.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size_bytes as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => file.set_len(size_bytes),
        _ => Err(error),
    }
}

fn block_device_size_bytes(file: &File) -> io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

fn block_device_sector_bytes(file: &File) -> io::Result<u32> {
    const BLKSSZGET: libc::c_ulong = 0x1268;
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut size as *mut libc::c_int) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size as u32)
}

/// The file system's direct-I/O offset alignment (statx `STATX_DIOALIGN`, Linux 6.1+).
fn dio_offset_alignment_bytes(file: &File) -> Option<u32> {
    const STATX_DIOALIGN: u32 = 0x2000;
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, empty path with AT_EMPTY_PATH, and a valid out pointer.
    let rc = unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some(stx.stx_dio_offset_align)
}

impl Device for FileDevice {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
    fn alignment_bytes(&self) -> u32 {
        self.alignment_bytes
    }
    fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset_bytes)
    }
    fn write_at(&self, offset_bytes: u64, buf: &[u8]) -> io::Result<()> {
        self.file.write_all_at(buf, offset_bytes)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn raw_fd(&self) -> Option<RawFd> {
        Some(self.file.as_raw_fd())
    }
    fn is_direct(&self) -> bool {
        self.direct
    }
    fn materialize(&self, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        if !self.regular {
            return Ok(());
        }
        let end = offset_bytes.checked_add(len_bytes).filter(|&end| end <= self.len_bytes).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let zeros = AlignedBuf::zeroed(MATERIALIZE_WRITE_BYTES.min(len_bytes as usize).max(1));
        let mut at = offset_bytes;
        while at < end {
            let n = (end - at).min(zeros.len() as u64) as usize;
            self.write_at(at, &zeros[..n])?;
            at += n as u64;
        }
        Ok(())
    }
}

/// What a simulated fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// Only the chosen operation fails.
    Once,
    /// The chosen operation and every later one fail (a dead disk).
    Sticky,
}

/// An in-memory device that forgets, applies or tears unsynced writes on a simulated crash.
pub struct SimDevice {
    len_bytes: u64,
    alignment_bytes: u32,
    state: Mutex<SimState>,
}

struct SimState {
    /// What survives a crash for certain.
    durable: Vec<u8>,
    /// Writes since the last sync, in order; reads see them.
    pending: Vec<(u64, Vec<u8>)>,
    ops: u64,
    fail_at_op: Option<(u64, FaultMode)>,
    failed: bool,
    writes: u64,
    syncs: u64,
}

impl SimDevice {
    pub fn new(len_bytes: u64, alignment_bytes: u32) -> Arc<Self> {
        Self::from_image(vec![0; len_bytes as usize], alignment_bytes)
    }

    fn from_image(durable: Vec<u8>, alignment_bytes: u32) -> Arc<Self> {
        Arc::new(Self {
            len_bytes: durable.len() as u64,
            alignment_bytes,
            state: Mutex::new(SimState { durable, pending: Vec::new(), ops: 0, fail_at_op: None, failed: false, writes: 0, syncs: 0 }),
        })
    }

    /// Makes the operation `ops_from_now` operations ahead (0 = the next one) fail with EIO.
    pub fn fail_after(&self, ops_from_now: u64, mode: FaultMode) {
        let mut state = self.state.lock();
        state.fail_at_op = Some((state.ops + ops_from_now, mode));
    }

    pub fn clear_faults(&self) {
        let mut state = self.state.lock();
        state.fail_at_op = None;
        state.failed = false;
    }

    /// Operations (reads, writes, syncs) performed so far.
    pub fn ops(&self) -> u64 {
        self.state.lock().ops
    }

    pub fn writes(&self) -> u64 {
        self.state.lock().writes
    }

    pub fn syncs(&self) -> u64 {
        self.state.lock().syncs
    }

    /// The device as a machine would find it after power loss now: every synced write, and each
    /// unsynced write applied whole, dropped, or torn (a random subset of its sectors).
    pub fn crash(&self, seed: u64) -> Arc<SimDevice> {
        let state = self.state.lock();
        let mut image = state.durable.clone();
        let mut rng = SplitMix64(seed);
        let sector = self.alignment_bytes as usize;
        for (offset, data) in &state.pending {
            let offset = *offset as usize;
            match rng.next() % 3 {
                0 => {}
                1 => image[offset..offset + data.len()].copy_from_slice(data),
                _ => {
                    for start in (0..data.len()).step_by(sector) {
                        if rng.next().is_multiple_of(2) {
                            let end = (start + sector).min(data.len());
                            image[offset + start..offset + end].copy_from_slice(&data[start..end]);
                        }
                    }
                }
            }
        }
        Self::from_image(image, self.alignment_bytes)
    }

    /// The device after a clean shutdown: everything written, synced or not.
    pub fn reboot_clean(&self) -> Arc<SimDevice> {
        let state = self.state.lock();
        let mut image = state.durable.clone();
        for (offset, data) in &state.pending {
            image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
        }
        Self::from_image(image, self.alignment_bytes)
    }

    /// Flips bits in durable storage (media corruption).
    pub fn corrupt(&self, offset_bytes: u64, mask: u8) {
        let mut state = self.state.lock();
        state.durable[offset_bytes as usize] ^= mask;
        for (offset, data) in state.pending.iter_mut() {
            if (*offset..*offset + data.len() as u64).contains(&offset_bytes) {
                data[(offset_bytes - *offset) as usize] ^= mask;
            }
        }
    }

    fn check(&self, state: &mut SimState, offset_bytes: u64, len: usize, ptr: *const u8) -> io::Result<()> {
        state.ops += 1;
        if let Some((at, mode)) = state.fail_at_op
            && state.ops > at
        {
            if std::env::var("KURA_SIM_FAULT_TRACE").is_ok() {
                eprintln!("sim fault at op {} (offset {offset_bytes}, len {len}): {}", state.ops, std::backtrace::Backtrace::force_capture());
            }
            if mode == FaultMode::Once {
                state.fail_at_op = None;
            }
            state.failed = mode == FaultMode::Sticky;
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if state.failed {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let align = u64::from(self.alignment_bytes);
        if !offset_bytes.is_multiple_of(align) || !(len as u64).is_multiple_of(align) || !(ptr as usize).is_multiple_of(512) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("unaligned I/O at {offset_bytes} len {len}")));
        }
        if offset_bytes + len as u64 > self.len_bytes {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(())
    }
}

impl Device for SimDevice {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
    fn alignment_bytes(&self) -> u32 {
        self.alignment_bytes
    }
    fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        self.check(&mut state, offset_bytes, buf.len(), buf.as_ptr())?;
        let start = offset_bytes as usize;
        buf.copy_from_slice(&state.durable[start..start + buf.len()]);
        let end = offset_bytes + buf.len() as u64;
        for (offset, data) in &state.pending {
            let (w_start, w_end) = (*offset, *offset + data.len() as u64);
            let (lo, hi) = (w_start.max(offset_bytes), w_end.min(end));
            if lo < hi {
                buf[(lo - offset_bytes) as usize..(hi - offset_bytes) as usize].copy_from_slice(&data[(lo - w_start) as usize..(hi - w_start) as usize]);
            }
        }
        Ok(())
    }
    fn write_at(&self, offset_bytes: u64, buf: &[u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        self.check(&mut state, offset_bytes, buf.len(), buf.as_ptr())?;
        state.writes += 1;
        state.pending.push((offset_bytes, buf.to_vec()));
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        let mut state = self.state.lock();
        self.check(&mut state, 0, 0, std::ptr::null())?;
        state.syncs += 1;
        let pending = std::mem::take(&mut state.pending);
        for (offset, data) in pending {
            state.durable[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
}

/// Tiny deterministic generator for crash choices (so a seed replays a crash exactly).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_has_one_open_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let options = FileDeviceOptions { create: true, size_bytes: Some(1 << 20), direct_io: false };
        let first = FileDevice::open(&path, &options).unwrap();
        let started = std::time::Instant::now();
        let refused = FileDevice::open(&path, &options).err().expect("a second open while the first lives");
        assert!(started.elapsed() >= std::time::Duration::from_millis(STORE_LOCK_WAIT_MS_MAX), "refused before the wait");
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
        assert!(refused.to_string().contains("in use"), "{refused}");
        // From another process too (the lock is the kernel's, not this process's).
        let flock = std::process::Command::new("flock").args(["-n", "-x"]).arg(&path).arg("true").status();
        if let Ok(status) = flock {
            assert!(!status.success(), "flock(1) got the lock of an open store");
        }
        // A holder that goes away within the wait hands the store over.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(STORE_LOCK_WAIT_MS_MAX / 5));
            drop(first);
        });
        FileDevice::open(&path, &options).expect("open once the first is dropped");
        releaser.join().unwrap();
    }

    fn page(byte: u8) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(4096);
        buf.fill(byte);
        buf
    }

    #[test]
    fn sim_unsynced_writes_are_visible_then_lost() {
        let dev = SimDevice::new(1 << 20, 512);
        dev.write_at(4096, &page(1)).unwrap();
        dev.sync().unwrap();
        dev.write_at(8192, &page(2)).unwrap();
        let mut buf = AlignedBuf::zeroed(4096);
        dev.read_at(8192, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 2));
        let mut dropped = 0;
        for seed in 0..64 {
            let after = dev.crash(seed);
            after.read_at(4096, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 1), "synced write lost");
            after.read_at(8192, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 0 || b == 2));
            dropped += usize::from(buf.iter().all(|&b| b == 0));
        }
        assert!(dropped > 0 && dropped < 64);
    }

    #[test]
    fn sim_tears_writes_at_sector_granularity() {
        let dev = SimDevice::new(1 << 20, 512);
        dev.write_at(0, &page(9)).unwrap();
        let torn = (0..64).any(|seed| {
            let mut buf = AlignedBuf::zeroed(4096);
            dev.crash(seed).read_at(0, &mut buf).unwrap();
            let nines = buf.iter().filter(|&&b| b == 9).count();
            nines > 0 && nines < 4096 && nines % 512 == 0
        });
        assert!(torn);
    }

    #[test]
    fn sim_faults_and_alignment() {
        let dev = SimDevice::new(1 << 20, 512);
        dev.fail_after(1, FaultMode::Once);
        dev.write_at(0, &page(1)).unwrap();
        assert_eq!(dev.write_at(0, &page(1)).unwrap_err().raw_os_error(), Some(libc::EIO));
        dev.write_at(0, &page(1)).unwrap();
        dev.fail_after(0, FaultMode::Sticky);
        assert!(dev.sync().is_err());
        assert!(dev.sync().is_err());
        dev.clear_faults();
        let buf = AlignedBuf::zeroed(4096);
        assert_eq!(dev.write_at(100, &buf).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(dev.write_at(1 << 20, &buf).unwrap_err().raw_os_error(), Some(libc::ENOSPC));
    }

    #[test]
    fn file_device_direct_io_round_trip() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("dev");
        let opts = FileDeviceOptions { create: true, size_bytes: Some(1 << 20), direct_io: true };
        let dev: Arc<dyn Device> = Arc::new(FileDevice::open(&path, &opts).unwrap());
        assert_eq!(dev.len_bytes(), 1 << 20);
        dev.write_at(8192, &page(5)).unwrap();
        dev.sync().unwrap();
        let mut queue = io_queue(&dev, 4);
        queue.submit_read(8192, AlignedBuf::zeroed(4096), 7).unwrap();
        queue.submit_read(0, AlignedBuf::zeroed(4096), 8).unwrap();
        let mut done = Vec::new();
        while done.len() < 2 {
            queue.wait(1, &mut done).unwrap();
        }
        let first = done.iter().find(|c| c.token == 7).unwrap();
        first.result.as_ref().unwrap();
        assert!(first.buf.iter().all(|&b| b == 5));
        assert_eq!(queue.in_flight(), 0);
    }

    /// A "device" whose reads wait until the test writes to the other end of a socket pair,
    /// so that reads stay in flight as long as the test wants.
    struct SocketDevice(std::os::unix::net::UnixStream);

    impl Device for SocketDevice {
        fn len_bytes(&self) -> u64 {
            1 << 40
        }
        fn alignment_bytes(&self) -> u32 {
            512
        }
        fn read_at(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Err(io::Error::other("not used"))
        }
        fn write_at(&self, _: u64, _: &[u8]) -> io::Result<()> {
            Err(io::Error::other("not used"))
        }
        fn sync(&self) -> io::Result<()> {
            Ok(())
        }
        fn raw_fd(&self) -> Option<RawFd> {
            use std::os::fd::AsRawFd;
            Some(self.0.as_raw_fd())
        }
    }

    #[test]
    fn dropping_a_queue_with_reads_blocked_in_flight_returns() {
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let device: Arc<dyn Device> = Arc::new(SocketDevice(ours));
        let mut queue = io_queue(&device, 8);
        for token in 0..8 {
            queue.submit_read(0, AlignedBuf::zeroed(512), token).unwrap();
        }
        queue.submit().unwrap();
        // Half of the reads can finish, the rest stay blocked on the socket until cancelled.
        use std::io::Write;
        theirs.write_all(&[7u8; 512 * 4]).unwrap();
        let started = std::time::Instant::now();
        drop(queue);
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "the drop returned");
        drop(theirs);
    }

    #[test]
    fn a_notifying_queue_signals_its_eventfd_and_reaps_without_waiting() {
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let device: Arc<dyn Device> = Arc::new(SocketDevice(ours));
        let mut queue = io_queue_notifying(&device, 4);
        let fd = queue.completion_fd().expect("an io_uring queue on a descriptor has an eventfd");
        assert!(io_queue(&device, 4).completion_fd().is_none(), "only asked-for queues notify");
        queue.submit_read(0, AlignedBuf::zeroed(512), 41).unwrap();
        queue.submit().unwrap();
        let mut done = Vec::new();
        queue.reap(&mut done);
        assert!(done.is_empty(), "nothing was sent yet");
        use std::io::Write;
        theirs.write_all(&[5u8; 512]).unwrap();
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the call's duration.
        let ready = unsafe { libc::poll(&mut pfd, 1, 10_000) };
        assert_eq!(ready, 1, "the eventfd was signalled");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while done.is_empty() {
            queue.reap(&mut done);
            assert!(std::time::Instant::now() < deadline, "the completion was never posted");
        }
        assert_eq!(done[0].token, 41);
        done[0].result.as_ref().unwrap();
        assert!(done[0].buf.iter().all(|&b| b == 5));
        assert_eq!(queue.in_flight(), 0);
    }

    #[test]
    fn a_wait_watching_a_socket_returns_when_the_socket_has_data() {
        use std::io::{Read, Write};
        use std::time::{Duration, Instant};
        // The device's reads finish only when `theirs` sends; the watched socket is a
        // server's client connection, `peer` the client.
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let device: Arc<dyn Device> = Arc::new(SocketDevice(ours));
        let mut queue = io_queue(&device, 4);
        let (mut client, peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = client.as_raw_fd();
        queue.submit_read(0, AlignedBuf::zeroed(512), 9).unwrap();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            (&peer).write_all(b"request").unwrap();
            peer
        });
        let mut done = Vec::new();
        let started = Instant::now();
        assert!(queue.wait_watching(1, &[fd], &mut done).unwrap(), "woken by the client, not by the read");
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(100) && elapsed < Duration::from_secs(5), "{elapsed:?}");
        assert!(done.is_empty());
        let mut peer = sender.join().unwrap();
        let mut request = [0u8; 7];
        client.read_exact(&mut request).unwrap();
        // With the client quiet, the wait is for the read.
        theirs.write_all(&[3u8; 512]).unwrap();
        assert!(!queue.wait_watching(1, &[fd], &mut done).unwrap(), "the client sent nothing new");
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].token, 9);
        assert!(done[0].buf.iter().all(|&b| b == 3));
        // The poll is still armed from that wait: the next request wakes the next wait.
        peer.write_all(b"x").unwrap();
        queue.submit_read(0, AlignedBuf::zeroed(512), 10).unwrap();
        done.clear();
        assert!(queue.wait_watching(1, &[fd], &mut done).unwrap());
        assert!(done.is_empty());
        // A plain wait ignores the socket (the read finishes when its data comes).
        client.read_exact(&mut request[..1]).unwrap();
        theirs.write_all(&[4u8; 512]).unwrap();
        queue.wait(1, &mut done).unwrap();
        assert_eq!(done.len(), 1);
        queue.submit_read(0, AlignedBuf::zeroed(512), 11).unwrap();
        assert!(!queue.wait_watching(0, &[fd], &mut done).unwrap());
        // Dropped with a read in flight and the poll armed, the queue still returns.
        let started = Instant::now();
        drop(queue);
        assert!(started.elapsed() < Duration::from_secs(5), "the drop returned");
    }

    #[test]
    fn an_event_fd_signalled_by_another_thread_ends_a_wait_watching_it() {
        use std::io::Write;
        use std::time::{Duration, Instant};
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let device: Arc<dyn Device> = Arc::new(SocketDevice(ours));
        let mut queue = io_queue(&device, 4);
        assert!(queue.can_watch());
        let (client, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let wake = Arc::new(EventFd::new().unwrap());
        let watched = [client.as_raw_fd(), wake.as_raw_fd()];
        queue.submit_read(0, AlignedBuf::zeroed(512), 1).unwrap();
        let from = Arc::clone(&wake);
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            from.signal().unwrap();
        });
        let mut done = Vec::new();
        let started = Instant::now();
        assert!(queue.wait_watching(1, &watched, &mut done).unwrap());
        assert!(started.elapsed() >= Duration::from_millis(100), "{:?}", started.elapsed());
        assert!(done.is_empty());
        waker.join().unwrap();
        // Cleared, it no longer wakes: the wait is for the read again.
        wake.clear();
        theirs.write_all(&[1u8; 512]).unwrap();
        assert!(!queue.wait_watching(1, &watched, &mut done).unwrap());
        assert_eq!(done.len(), 1);
        // A signal sent while nobody waits ends the next wait at once.
        wake.signal().unwrap();
        wake.signal().unwrap();
        queue.submit_read(0, AlignedBuf::zeroed(512), 2).unwrap();
        assert!(queue.wait_watching(1, &watched, &mut done).unwrap());
        assert_eq!(done.len(), 1, "the read is still in flight");
        // Synchronous queues cannot watch.
        let sim: Arc<dyn Device> = SimDevice::new(1 << 20, 512);
        assert!(!io_queue(&sim, 4).can_watch());
    }

    #[test]
    fn file_device_materialize_writes_zeros_in_range_only() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("dev");
        let opts = FileDeviceOptions { create: true, size_bytes: Some(1 << 20), direct_io: true };
        let dev = FileDevice::open(&path, &opts).unwrap();
        for offset in [0, 4096, 12288] {
            dev.write_at(offset, &page(9)).unwrap();
        }
        dev.materialize(4096, 8192).unwrap();
        let mut buf = AlignedBuf::zeroed(16384);
        dev.read_at(0, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 9) && buf[4096..12288].iter().all(|&b| b == 0) && buf[12288..].iter().all(|&b| b == 9));
        assert!(dev.materialize(1 << 20, 4096).is_err(), "past the end");
    }
}
