//! A worker's queue of flash reads: io_uring, with completions signalled on an
//! eventfd that the worker's event loop polls beside its sockets.
//!
//! Reads are pushed while requests are parsed and issued together by one
//! `io_uring_enter` per loop turn ([`ReadQueue::submit`]); completions are
//! reaped from the shared ring without a syscall. Where io_uring is not
//! available the queue reads synchronously at submit time and reports the
//! completions as ready at once.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use kura_engine::{AlignedBuf, Device};

/// A finished read: its token and the bytes, or the error.
pub struct Completion {
    pub token: u64,
    pub result: io::Result<AlignedBuf>,
}

pub struct ReadQueue {
    kind: Kind,
    /// Reads waiting for a free slot in the ring, in arrival order.
    backlog: VecDeque<(u64, usize, u64)>,
}

enum Kind {
    // Boxed: the ring is large and the fallback small.
    Uring(Box<UringReads>),
    Sync {
        device: Arc<dyn Device>,
        done: Vec<Completion>,
    },
}

struct UringReads {
    ring: io_uring::IoUring,
    fd: RawFd,
    eventfd: OwnedFd,
    /// Keeps `fd` open while reads are in flight.
    _device: Arc<dyn Device>,
    slots: Vec<Option<(u64, AlignedBuf)>>,
    free: Vec<u32>,
    unsubmitted: usize,
}

impl ReadQueue {
    /// A queue of `depth` reads in flight on `device`.
    pub fn new(device: &Arc<dyn Device>, depth: usize) -> Self {
        let kind = match device.raw_fd() {
            Some(fd) => match UringReads::new(Arc::clone(device), fd, depth) {
                Ok(uring) => Kind::Uring(Box::new(uring)),
                Err(error) => {
                    tracing::warn!(%error, "io_uring unavailable; flash reads will block the worker");
                    Kind::Sync {
                        device: Arc::clone(device),
                        done: Vec::new(),
                    }
                }
            },
            None => Kind::Sync {
                device: Arc::clone(device),
                done: Vec::new(),
            },
        };
        Self {
            kind,
            backlog: VecDeque::new(),
        }
    }

    /// The descriptor that becomes readable when reads complete (io_uring only).
    pub fn eventfd(&self) -> Option<RawFd> {
        match &self.kind {
            Kind::Uring(u) => Some(u.eventfd.as_raw_fd()),
            Kind::Sync { .. } => None,
        }
    }

    /// Reads queued or in flight.
    pub fn outstanding(&self) -> usize {
        self.backlog.len()
            + match &self.kind {
                Kind::Uring(u) => u.slots.len() - u.free.len(),
                Kind::Sync { done, .. } => done.len(),
            }
    }

    /// Queues a read of `len_bytes` at `offset_bytes`; issued at the next [`Self::submit`].
    pub fn push(&mut self, offset_bytes: u64, len_bytes: usize, token: u64) {
        self.backlog.push_back((offset_bytes, len_bytes, token));
    }

    /// Issues queued reads (one syscall for all of them).
    pub fn submit(&mut self) -> io::Result<()> {
        match &mut self.kind {
            Kind::Uring(u) => {
                while !u.free.is_empty() {
                    let Some((offset, len, token)) = self.backlog.pop_front() else {
                        break;
                    };
                    u.push(offset, AlignedBuf::zeroed(len), token);
                }
                u.submit()
            }
            Kind::Sync { device, done } => {
                for (offset, len, token) in self.backlog.drain(..) {
                    let mut buf = AlignedBuf::zeroed(len);
                    let result = device.read_at(offset, &mut buf).map(|()| buf);
                    done.push(Completion { token, result });
                }
                Ok(())
            }
        }
    }

    /// Whether completions are ready without waiting for the eventfd.
    pub fn has_ready(&self) -> bool {
        match &self.kind {
            Kind::Uring(_) => false,
            Kind::Sync { done, .. } => !done.is_empty(),
        }
    }

    /// Moves finished reads to `out`. `signalled`: the eventfd woke the loop,
    /// so its count is cleared first (a completion landing meanwhile signals
    /// again). Otherwise it is left alone: with edge-triggered epoll every
    /// signal wakes the loop whatever the count, so reading it on every turn
    /// would only cost a syscall.
    pub fn reap(&mut self, out: &mut Vec<Completion>, signalled: bool) {
        match &mut self.kind {
            Kind::Uring(u) => {
                if signalled {
                    u.drain_eventfd();
                }
                u.reap(out);
            }
            Kind::Sync { done, .. } => out.append(done),
        }
    }
}

impl UringReads {
    fn new(device: Arc<dyn Device>, fd: RawFd, depth: usize) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let ring = io_uring::IoUring::new(depth.next_power_of_two() as u32)?;
        // SAFETY: eventfd(2) takes plain integers and returns a new descriptor or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor we just created and nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        Ok(Self {
            ring,
            fd,
            eventfd,
            _device: device,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth as u32).rev().collect(),
            unsubmitted: 0,
        })
    }

    fn push(&mut self, offset_bytes: u64, mut buf: AlignedBuf, token: u64) {
        let slot = self.free.pop().expect("caller checked for a free slot");
        let len = u32::try_from(buf.len()).expect("engine reads are far below 4 GiB");
        let entry =
            io_uring::opcode::Read::new(io_uring::types::Fd(self.fd), buf.as_mut_ptr(), len)
                .offset(offset_bytes)
                .build()
                .user_data(u64::from(slot));
        // SAFETY: the buffer's heap memory stays valid and untouched until its completion is
        // reaped: it moves into `self.slots[slot]` below and is handed out only in `reap`
        // (or dropped by `Drop`, which first waits for every read in flight). The file
        // descriptor is kept open by `_device`. The submission queue has room: it is at least
        // as deep as `slots`, and every slot's entry is submitted before the slot is reused.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        assert!(
            pushed.is_ok(),
            "submission queue is as deep as the slot table"
        );
        self.slots[slot as usize] = Some((token, buf));
        self.unsubmitted += 1;
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted == 0 {
            return Ok(());
        }
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) => return Err(error),
            }
        }
        self.unsubmitted = 0;
        Ok(())
    }

    fn drain_eventfd(&self) {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd; EAGAIN
        // (nothing signalled) is expected and harmless.
        let _ = unsafe { libc::read(self.eventfd.as_raw_fd(), (&raw mut count).cast(), 8) };
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            let slot = cqe.user_data() as usize;
            let (token, buf) = self.slots[slot]
                .take()
                .expect("completion for an empty slot");
            self.free.push(slot as u32);
            let result = match cqe.result() {
                n if n < 0 => Err(io::Error::from_raw_os_error(-n)),
                n if n as usize != buf.len() => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "short read from the store",
                )),
                _ => Ok(buf),
            };
            out.push(Completion { token, result });
        }
    }
}

impl Drop for UringReads {
    /// Buffers may be freed only once the kernel is done with them.
    fn drop(&mut self) {
        let _ = self.submit();
        let mut sink = Vec::new();
        while self.free.len() < self.slots.len() {
            let in_flight = self.slots.len() - self.free.len();
            match self.ring.submit_and_wait(in_flight) {
                Ok(_) => {}
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) => {
                    // Leaking the buffers is the only safe choice if the ring cannot be waited on.
                    tracing::error!(%error, "cannot wait for flash reads in flight; leaking their buffers");
                    for slot in &mut self.slots {
                        if let Some((_, buf)) = slot.take() {
                            std::mem::forget(buf);
                        }
                    }
                    return;
                }
            }
            self.reap(&mut sink);
            sink.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kura_engine::{FileDevice, FileDeviceOptions};

    #[test]
    fn reads_complete_through_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        let options = FileDeviceOptions {
            create: true,
            size_bytes: Some(1 << 20),
            direct_io: true,
        };
        let device: Arc<dyn Device> = Arc::new(FileDevice::open(&path, &options).unwrap());
        let mut page = AlignedBuf::zeroed(4096);
        page.fill(7);
        device.write_at(8192, &page).unwrap();
        let mut queue = ReadQueue::new(&device, 2);
        for token in 0..5 {
            queue.push(8192, 4096, token);
        }
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while done.len() < 5 {
            queue.submit().unwrap();
            queue.reap(&mut done, true);
            assert!(
                std::time::Instant::now() < deadline,
                "reads never completed"
            );
        }
        assert_eq!(queue.outstanding(), 0);
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, vec![0, 1, 2, 3, 4]);
        assert!(
            done.iter()
                .all(|c| c.result.as_ref().unwrap().iter().all(|&b| b == 7))
        );
    }
}
