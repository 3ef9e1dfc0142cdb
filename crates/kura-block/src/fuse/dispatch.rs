//! Pipelined pool queues for the FUSE export.
//!
//! A FUSE thread serves one request at a time: with its own pool connection, each request
//! was one round trip on its own connection, and a kura server answered 32 connections one
//! request each (a send, a receive and an epoll wake-up per request on both sides). Here the
//! FUSE threads share a few [`Dispatcher`]s, each one [`BlockQueue`] (one connection per
//! node): whatever has arrived is submitted together and each request is answered as it
//! completes, so requests leave and their replies arrive in batches, as over one NBD
//! connection. The thread driving a queue waits for pool completions and new requests at
//! once: a FUSE thread that hands over a request while it waits wakes it
//! ([`kura_pool::Waker`]).
//!
//! On the embedded engine a queue is one io_uring ring: reads are submitted in batches and a
//! wake-up is an eventfd its wait watches. An engine without io_uring reads synchronously and
//! cannot be woken; an export on it keeps one pool context per FUSE thread.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fuser::{Errno, ReplyData, ReplyEmpty, ReplyWrite};
use kura_pool::{Pool, Waker};

use crate::error::BlockError;
use super::KuraFs;
use crate::queue::{BlockQueue, Done, REPLIES_PER_GROUP, Volume};

/// Requests one dispatcher keeps in flight, at most (the kernel sends at most
/// `max_background` asynchronous ones; the rest wait in the inbox).
pub const DISPATCH_REQUESTS_MAX: usize = 1024;
/// Spare read buffers a dispatcher keeps for reuse, at most, and the largest it keeps.
const SPARE_BUFFERS_MAX: usize = 256;
const SPARE_BUFFER_BYTES_MAX: usize = 128 << 10;
/// Pause after a failed wait before the queue is tried again with a new pool context.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// A request handed from a FUSE thread to a dispatcher, with the reply to send.
pub(super) enum Job {
    Read { volume: Arc<Volume>, offset: u64, len: u64, reply: ReplyData },
    Write { volume: Arc<Volume>, offset: u64, data: Vec<u8>, fua: bool, reply: ReplyWrite },
    Flush { volume: Arc<Volume>, reply: ReplyEmpty },
    /// `fallocate(PUNCH_HOLE | ZERO_RANGE)`: the range reads as zeros afterwards.
    Zeroes { volume: Arc<Volume>, offset: u64, len: u64, reply: ReplyEmpty },
}

/// The reply a request in flight is waiting to send.
enum Pending {
    Read { reply: ReplyData, len: usize },
    Write { reply: ReplyWrite, len: u32 },
    Empty(ReplyEmpty),
}

impl Pending {
    fn fail(self, errno: Errno) {
        match self {
            Pending::Read { reply, .. } => reply.error(errno),
            Pending::Write { reply, .. } => reply.error(errno),
            Pending::Empty(reply) => reply.error(errno),
        }
    }
}

struct Inbox {
    jobs: VecDeque<Job>,
    /// Wakes the driver's pool context (replaced with the context).
    waker: Waker,
    /// A FUSE thread is driving the queue: it takes the jobs handed over meanwhile.
    driving: bool,
    /// A wake-up was sent since the driver last looked (one is enough).
    wake_sent: bool,
}

/// One pipelined pool queue that the FUSE threads share. It has no thread of its own: the
/// FUSE thread that hands over a request while nobody drives the queue drives it (submits,
/// waits, replies) until nothing is left, and requests handed over meanwhile are its to
/// submit. At queue depth 1 a request is thus served by the thread that received it, with
/// no hand-off between threads, and under load one thread sends and receives for all.
pub(super) struct Dispatcher {
    inbox: Mutex<Inbox>,
    driver: Mutex<Driver>,
}

impl Dispatcher {
    /// A dispatcher on a new pool context, or `Ok(None)` when the pool's contexts cannot be
    /// woken (an embedded engine without io_uring).
    pub(super) fn new(pool: &Pool, window: usize) -> std::io::Result<Option<Self>> {
        let mut ctx = pool.context().map_err(std::io::Error::other)?;
        let Some(waker) = ctx.waker().map_err(std::io::Error::other)? else { return Ok(None) };
        let inbox = Inbox { jobs: VecDeque::new(), waker, driving: false, wake_sent: false };
        let driver = Driver {
            pool: pool.clone(),
            window,
            queue: BlockQueue::new(ctx, window),
            pending: Vec::new(),
            free: Vec::new(),
            spare: Vec::new(),
            batch: VecDeque::new(),
            finished: Vec::new(),
        };
        Ok(Some(Self { inbox: Mutex::new(inbox), driver: Mutex::new(driver) }))
    }

    fn lock_inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands `job` over; its reply is sent when it completes. Returns at once when another
    /// thread drives the queue; otherwise drives it until nothing is in flight.
    pub(super) fn run(&self, job: Job) {
        let mut inbox = self.lock_inbox();
        inbox.jobs.push_back(job);
        if inbox.driving {
            if !inbox.wake_sent {
                inbox.wake_sent = true;
                let waker = inbox.waker.clone();
                drop(inbox);
                waker.wake();
            }
            return;
        }
        inbox.driving = true;
        drop(inbox);
        self.driver.lock().unwrap_or_else(|e| e.into_inner()).drive(self);
    }
}

/// The queue and the requests in flight on it (used by the driving thread only).
struct Driver {
    pool: Pool,
    window: usize,
    queue: BlockQueue<Vec<u8>>,
    /// Requests in flight by tag (the slot index); `free` lists the empty slots.
    pending: Vec<Option<Pending>>,
    free: Vec<usize>,
    spare: Vec<Vec<u8>>,
    batch: VecDeque<Job>,
    finished: Vec<Done<Vec<u8>>>,
}

impl Driver {
    fn drive(&mut self, dispatcher: &Dispatcher) {
        while self.take_jobs(dispatcher) {
            self.submit_batch();
            if self.queue.requests() == 0 {
                continue;
            }
            let finished = &mut self.finished;
            match self.queue.poll(None, &mut |done| finished.push(done)) {
                Ok(_) => {
                    if let Err(e) = self.reply_taking_jobs(dispatcher) {
                        self.recover(dispatcher, &e);
                    }
                }
                Err(e) => self.recover(dispatcher, &e),
            }
        }
    }

    fn submit_batch(&mut self) {
        while let Some(job) = self.batch.pop_front() {
            self.submit(job);
        }
    }

    /// Replies to the requests that finished, [`REPLIES_PER_GROUP`] at a time, and between
    /// groups submits the requests handed over meanwhile and sends them to the pool (why: see
    /// [`REPLIES_PER_GROUP`]; each reply is a write to `/dev/fuse`).
    fn reply_taking_jobs(&mut self, dispatcher: &Dispatcher) -> Result<(), BlockError> {
        let mut finished = std::mem::take(&mut self.finished);
        let mut result = Ok(());
        while !finished.is_empty() {
            for done in finished.drain(..REPLIES_PER_GROUP.min(finished.len())) {
                self.reply(done);
            }
            if finished.is_empty() || result.is_err() || !self.take_handed_over(dispatcher) {
                continue;
            }
            self.submit_batch();
            if let Err(e) = self.queue.send(&mut |done| finished.push(done)) {
                result = Err(e);
            }
        }
        self.finished = finished;
        result
    }

    /// Takes what the inbox holds (as much as fits in flight). Returns false, and stops
    /// driving, when nothing is in flight or waiting.
    fn take_jobs(&mut self, dispatcher: &Dispatcher) -> bool {
        let mut inbox = dispatcher.lock_inbox();
        inbox.wake_sent = false;
        if inbox.jobs.is_empty() && self.queue.requests() == 0 {
            inbox.driving = false;
            return false;
        }
        self.take_from(&mut inbox);
        true
    }

    /// Takes the jobs handed over while this thread drives (as much as fits in flight); a
    /// wake-up already sent for them is left for the next wait to consume. Returns whether
    /// it took any.
    fn take_handed_over(&mut self, dispatcher: &Dispatcher) -> bool {
        let mut inbox = dispatcher.lock_inbox();
        self.take_from(&mut inbox);
        !self.batch.is_empty()
    }

    fn take_from(&mut self, inbox: &mut Inbox) {
        let room = DISPATCH_REQUESTS_MAX.saturating_sub(self.queue.requests());
        if inbox.jobs.len() <= room {
            std::mem::swap(&mut self.batch, &mut inbox.jobs);
        } else {
            self.batch.extend(inbox.jobs.drain(..room));
        }
    }

    fn slot(&mut self, pending: Pending) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.pending[slot] = Some(pending);
                slot
            }
            None => {
                self.pending.push(Some(pending));
                self.pending.len() - 1
            }
        }
    }

    fn submit(&mut self, job: Job) {
        let (slot, submitted) = match job {
            Job::Read { volume, offset, len, reply } => {
                let mut buf = self.spare.pop().unwrap_or_default();
                buf.resize(len as usize, 0);
                let slot = self.slot(Pending::Read { reply, len: len as usize });
                (slot, self.queue.submit_read(slot as u64, &volume, offset, len, buf))
            }
            Job::Write { volume, offset, data, fua, reply } => {
                let slot = self.slot(Pending::Write { reply, len: data.len() as u32 });
                (slot, self.queue.submit_write(slot as u64, &volume, offset, &data, fua))
            }
            Job::Flush { volume, reply } => {
                let slot = self.slot(Pending::Empty(reply));
                (slot, self.queue.submit_flush(slot as u64, &volume))
            }
            Job::Zeroes { volume, offset, len, reply } => {
                let slot = self.slot(Pending::Empty(reply));
                (slot, self.queue.submit_write_zeroes(slot as u64, &volume, offset, len, false, false))
            }
        };
        if let Err(e) = submitted {
            let pending = self.pending[slot].take().expect("just stored");
            self.free.push(slot);
            pending.fail(KuraFs::errno(&e));
        }
    }

    fn reply(&mut self, done: Done<Vec<u8>>) {
        let slot = done.tag as usize;
        let pending = self.pending[slot].take().expect("a completion for a request in flight");
        self.free.push(slot);
        match (pending, done.result) {
            (Pending::Read { reply, len }, Ok(())) => {
                let buf = done.buf.expect("a read returns its buffer");
                reply.data(&buf[..len]);
                if self.spare.len() < SPARE_BUFFERS_MAX && buf.capacity() <= SPARE_BUFFER_BYTES_MAX {
                    self.spare.push(buf);
                }
            }
            (Pending::Write { reply, len }, Ok(())) => reply.written(len),
            (Pending::Empty(reply), Ok(())) => reply.ok(),
            (pending, Err(e)) => pending.fail(KuraFs::errno(&e)),
        }
    }

    /// The pool context failed as a whole (not one request): every request in flight fails
    /// with EIO and the queue goes on with a new context.
    fn recover(&mut self, dispatcher: &Dispatcher, error: &BlockError) {
        tracing::error!(%error, in_flight = self.queue.requests(), "fuse: the pool queue failed; failing its requests");
        for pending in self.pending.iter_mut().filter_map(Option::take) {
            pending.fail(Errno::EIO);
        }
        self.free = (0..self.pending.len()).collect();
        std::thread::sleep(RETRY_PAUSE);
        loop {
            match self.pool.context().and_then(|mut ctx| Ok((ctx.waker()?, ctx))) {
                Ok((Some(waker), ctx)) => {
                    self.queue = BlockQueue::new(ctx, self.window);
                    dispatcher.lock_inbox().waker = waker;
                    return;
                }
                Ok((None, _)) => unreachable!("the pool's contexts could be woken before"),
                Err(e) => {
                    tracing::error!(error = %e, "fuse: no pool context; trying again");
                    std::thread::sleep(RETRY_PAUSE * 10);
                }
            }
        }
    }
}
