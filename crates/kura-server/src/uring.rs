//! A worker's queue of flash reads: the engine's io_uring queue
//! ([`kura_engine::device::io_queue_notifying`]), with completions signalled
//! on an eventfd that the worker's event loop polls beside its sockets.
//!
//! Reads are pushed while requests are parsed and issued together by one
//! `io_uring_enter` per loop turn, or sooner once many wait ([`ReadQueue::submit`]); completions
//! are reaped from the shared ring without a syscall. Reads beyond the ring's
//! depth wait in a backlog, in arrival order. Where io_uring is not available
//! the engine's queue reads synchronously when reaped, and the queue reports
//! those reads as ready at once ([`ReadQueue::has_ready`]).

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use kura_engine::device::{IoQueue, ReadCompletion, io_queue_notifying};
use kura_engine::{AlignedBuf, Device, ReadBuffers};

/// Read buffers a worker keeps for its next reads (each a few KiB: a page, or a large
/// record's slot), so that a read neither allocates nor zeroes one.
pub const SPARE_READ_BUFFERS_MAX: usize = 256;

/// A finished read: its token and the bytes, or the error.
pub struct Completion {
    pub token: u64,
    pub result: io::Result<AlignedBuf>,
}

pub struct ReadQueue {
    queue: Box<dyn IoQueue>,
    /// Reads waiting for room in the queue, in arrival order: (offset, length, token).
    backlog: VecDeque<(u64, usize, u64)>,
    /// Reads the queue refused, reported as failed at the next reap.
    refused: Vec<Completion>,
    /// Reused between reaps.
    finished: Vec<ReadCompletion>,
    /// Buffers of sent replies, for the next reads (at most [`SPARE_READ_BUFFERS_MAX`]).
    spare: ReadBuffers,
}

impl ReadQueue {
    /// A queue keeping up to `depth` reads in flight on `device`.
    pub fn new(device: &Arc<dyn Device>, depth: usize) -> Self {
        Self {
            queue: io_queue_notifying(device, depth),
            backlog: VecDeque::new(),
            refused: Vec::new(),
            finished: Vec::new(),
            spare: ReadBuffers::new(SPARE_READ_BUFFERS_MAX),
        }
    }

    /// Keeps a buffer whose bytes were sent for a later read.
    pub fn recycle(&mut self, buf: AlignedBuf) {
        self.spare.put(buf);
    }

    /// The eventfd to poll for completions (`None` when reads are synchronous).
    pub fn eventfd(&self) -> Option<RawFd> {
        self.queue.completion_fd()
    }

    /// Reads queued, in flight or finished but not yet reaped.
    pub fn outstanding(&self) -> usize {
        self.backlog.len() + self.queue.in_flight() + self.refused.len()
    }

    /// Reads queued and not yet issued.
    pub fn queued(&self) -> usize {
        self.backlog.len()
    }

    /// Queues a read of `len_bytes` at `offset_bytes`; it is issued at the next [`Self::submit`].
    pub fn push(&mut self, offset_bytes: u64, len_bytes: usize, token: u64) {
        self.backlog.push_back((offset_bytes, len_bytes, token));
    }

    /// Issues queued reads, as many as the queue has room for, with one syscall.
    pub fn submit(&mut self) -> io::Result<()> {
        while self.queue.in_flight() < self.queue.depth() {
            let Some((offset, len, token)) = self.backlog.pop_front() else {
                break;
            };
            let buf = self.spare.take(len);
            if let Err(error) = self.queue.submit_read(offset, buf, token) {
                self.refused.push(Completion {
                    token,
                    result: Err(error),
                });
            }
        }
        self.queue.submit()
    }

    /// Whether reads are finished without a signal on the eventfd (synchronous reads, refusals).
    pub fn has_ready(&self) -> bool {
        !self.refused.is_empty() || (self.queue.completion_fd().is_none() && self.queue.in_flight() > 0)
    }

    /// Moves finished reads to `out`. `signalled`: the eventfd was reported readable, so its
    /// counter is reset (with edge-triggered polling it would also signal again unreset).
    pub fn reap(&mut self, out: &mut Vec<Completion>, signalled: bool) {
        if signalled {
            self.queue.clear_completion_fd();
        }
        out.append(&mut self.refused);
        self.queue.reap(&mut self.finished);
        out.extend(self.finished.drain(..).map(|done| Completion {
            token: done.token,
            result: done.result.map(|()| done.buf),
        }));
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

    /// A simulated device (no io_uring: reads are synchronous) with `len` bytes of `byte` at `offset`.
    fn sim_device_with(offset: u64, len: usize, byte: u8) -> Arc<dyn Device> {
        let device: Arc<dyn Device> = kura_engine::SimDevice::new(1 << 20, 512);
        let mut data = AlignedBuf::zeroed(len);
        data.fill(byte);
        device.write_at(offset, &data).unwrap();
        device.sync().unwrap();
        device
    }

    #[test]
    fn without_io_uring_reads_are_ready_at_once_and_the_backlog_drains() {
        let device = sim_device_with(4096, 4096, 3);
        let mut queue = ReadQueue::new(&device, 2);
        assert!(queue.eventfd().is_none());
        for token in 0..5 {
            queue.push(4096, 4096, token);
        }
        assert!(!queue.has_ready(), "nothing issued yet");
        let mut done = Vec::new();
        while queue.outstanding() > 0 {
            queue.submit().unwrap();
            assert!(queue.has_ready(), "issued synchronous reads are ready");
            queue.reap(&mut done, false);
        }
        let tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        assert_eq!(tokens, vec![0, 1, 2, 3, 4], "in arrival order");
        assert!(done.iter().all(|c| c.result.as_ref().unwrap().iter().all(|&b| b == 3)));
    }

    #[test]
    fn recycled_buffers_serve_later_reads_and_are_overwritten_whole() {
        let device = sim_device_with(0, 4608, 9);
        let mut queue = ReadQueue::new(&device, 4);
        let mut old = AlignedBuf::zeroed(8192);
        old.fill(0xAA);
        let old_ptr = old.as_ptr();
        queue.recycle(old);
        queue.recycle(AlignedBuf::zeroed(512)); // too small for the read: dropped, not used
        queue.push(0, 4608, 1);
        queue.submit().unwrap();
        let mut done = Vec::new();
        queue.reap(&mut done, false);
        let buf = done.pop().unwrap().result.unwrap();
        assert_eq!(buf.len(), 4608);
        assert!(buf.iter().all(|&b| b == 9), "the read replaced every old byte");
        assert_eq!(buf.as_ptr(), old_ptr, "the spare buffer was reused");
        for _ in 0..SPARE_READ_BUFFERS_MAX + 10 {
            queue.recycle(AlignedBuf::zeroed(4096));
        }
        assert_eq!(queue.spare.len(), SPARE_READ_BUFFERS_MAX, "spares are bounded");
    }
}
