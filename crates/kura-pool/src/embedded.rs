//! The embedded backend: the engine in this process. Gets use the engine's split-phase
//! lookup with this context's own io_uring queue, so many reads are in flight per thread; an
//! existence probe is the same lookup with the value dropped (the engine keeps only a hash of
//! the key in RAM, so telling a key from a colliding one takes the record's read anyway);
//! sets and deletes go into the engine's RAM write buffers at submit; a flush is the engine's
//! `sync()` (shared with concurrent callers), run at submit.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use kura_engine::device::{EventFd, IoQueue, ReadCompletion, io_queue};
use kura_engine::{Engine, GetPlan, GetStep, Item, ReadBuffers};

use crate::config::PoolConfig;
use crate::error::{Error, Result};
use crate::key;
use crate::pool::{Completion, Outcome};
use crate::stats::IoStats;

/// Reads one io_uring queue keeps in flight, at most (the engine's queue limit).
const QUEUE_DEPTH_MAX: usize = 4096;
/// Read buffers of delivered values a context keeps for its next reads.
const SPARE_READ_BUFFERS_MAX: usize = 256;

enum Finished {
    Item(Item),
    Missing,
    Done,
}

/// A lookup in progress: whose, and whether the caller wants the value or only to know
/// that there is one.
#[derive(Clone, Copy)]
struct Lookup {
    token: u64,
    probe: bool,
}

pub(crate) struct EmbeddedContext {
    engine: Engine,
    queue: Box<dyn IoQueue>,
    /// Lookups waiting for a read, by queue slot.
    plans: Vec<Option<(Lookup, GetPlan)>>,
    free_slots: Vec<usize>,
    ready: VecDeque<(u64, Result<Finished>)>,
    completions: Vec<ReadCompletion>,
    /// Buffers of delivered values, for the next reads.
    spare: ReadBuffers,
    in_flight: usize,
    in_flight_max: usize,
    value_size_max_bytes: usize,
    /// Made by the first [`EmbeddedContext::waker`] call; watched by every wait.
    wake_fd: Option<Arc<EventFd>>,
    pub stats: IoStats,
}

impl EmbeddedContext {
    pub fn new(engine: Engine, config: &PoolConfig) -> Self {
        let depth = config.in_flight_max.min(QUEUE_DEPTH_MAX);
        Self {
            queue: io_queue(engine.device(), depth),
            engine,
            plans: (0..depth).map(|_| None).collect(),
            free_slots: (0..depth).rev().collect(),
            ready: VecDeque::new(),
            completions: Vec::new(),
            spare: ReadBuffers::new(SPARE_READ_BUFFERS_MAX),
            in_flight: 0,
            in_flight_max: depth,
            value_size_max_bytes: config.value_size_max_bytes,
            wake_fd: None,
            stats: IoStats::default(),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// An eventfd that ends this context's waits when written (see [`crate::Waker`]);
    /// `None` when reads are synchronous (no io_uring), so waits cannot be woken.
    pub fn waker(&mut self) -> Result<Option<Arc<EventFd>>> {
        if !self.queue.can_watch() {
            return Ok(None);
        }
        if let Some(fd) = &self.wake_fd {
            return Ok(Some(Arc::clone(fd)));
        }
        let fd = Arc::new(EventFd::new()?);
        self.wake_fd = Some(Arc::clone(&fd));
        Ok(Some(fd))
    }

    pub fn in_flight_max(&self) -> usize {
        self.in_flight_max
    }

    fn admit(&mut self, k: &[u8]) -> Result<()> {
        key::check(k)?;
        if self.in_flight >= self.in_flight_max {
            return Err(Error::QueueFull { max: self.in_flight_max });
        }
        self.in_flight += 1;
        Ok(())
    }

    pub fn submit_get(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.start_lookup(k, Lookup { token, probe: false })
    }

    pub fn submit_exists(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.start_lookup(k, Lookup { token, probe: true })
    }

    fn start_lookup(&mut self, k: &[u8], lookup: Lookup) -> Result<()> {
        self.admit(k)?;
        match self.engine.get_start(k) {
            Ok((plan, step)) => self.step(lookup, plan, Ok(step)),
            Err(e) => self.ready.push_back((lookup.token, Err(e.into()))),
        }
        Ok(())
    }

    /// Follows a lookup's next step: done, or a read queued in a free slot.
    fn step(&mut self, lookup: Lookup, plan: GetPlan, step: kura_engine::Result<GetStep>) {
        let token = lookup.token;
        match step {
            Ok(GetStep::Done(Some(item))) if lookup.probe => {
                if let Some(buf) = item.into_read_buffer() {
                    self.spare.put(buf);
                }
                self.ready.push_back((token, Ok(Finished::Done)));
            }
            Ok(GetStep::Done(Some(item))) => self.ready.push_back((token, Ok(Finished::Item(item)))),
            Ok(GetStep::Done(None)) => self.ready.push_back((token, Ok(Finished::Missing))),
            Ok(GetStep::Read { offset_bytes, len_bytes }) => {
                let slot = self.free_slots.pop().expect("a slot per request in flight");
                if let Err(e) = self.queue.submit_read(offset_bytes, self.spare.take(len_bytes), slot as u64) {
                    self.free_slots.push(slot);
                    self.ready.push_back((token, Err(e.into())));
                    return;
                }
                self.plans[slot] = Some((lookup, plan));
            }
            Err(e) => self.ready.push_back((token, Err(e.into()))),
        }
    }

    pub fn submit_set(&mut self, k: &[u8], value: &[u8], token: u64) -> Result<()> {
        if value.len() > self.value_size_max_bytes {
            return Err(Error::ValueTooLarge { len: value.len(), max: self.value_size_max_bytes });
        }
        self.admit(k)?;
        let result = self.engine.put(k, value).map(|_| Finished::Done).map_err(Error::from);
        self.ready.push_back((token, result));
        Ok(())
    }

    pub fn submit_delete(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.admit(k)?;
        let result = self.engine.delete(k).map(|()| Finished::Done).map_err(Error::from);
        self.ready.push_back((token, result));
        Ok(())
    }

    pub fn submit_flush(&mut self, token: u64) -> Result<()> {
        if self.in_flight >= self.in_flight_max {
            return Err(Error::QueueFull { max: self.in_flight_max });
        }
        self.in_flight += 1;
        let result = self.engine.sync().map(|()| Finished::Done).map_err(Error::from);
        self.ready.push_back((token, result));
        Ok(())
    }

    /// Hands over what is ready; otherwise waits for reads (they always complete, so the
    /// timeout only matters when it is zero: then nothing blocks).
    pub fn poll(&mut self, timeout: Option<Duration>, watch: Option<RawFd>, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<usize> {
        let mut delivered = self.deliver_ready(on_complete);
        if delivered > 0 || self.queue.in_flight() == 0 {
            // Reads queued meanwhile leave now; the caller comes back for their completions.
            if self.queue.unsubmitted() > 0 {
                self.queue.submit()?;
                self.stats.send_syscalls += 1;
            }
            return Ok(delivered);
        }
        // One io_uring_enter both issues the queued reads and waits for the first completion
        // (counted once, as a receive).
        let min_complete = usize::from(timeout != Some(Duration::ZERO));
        let mut watched = [0; 2];
        let mut watching = 0;
        for fd in watch.into_iter().chain(self.wake_fd.as_ref().map(|fd| fd.as_raw_fd())) {
            watched[watching] = fd;
            watching += 1;
        }
        if self.queue.wait_watching(min_complete, &watched[..watching], &mut self.completions)?
            && let Some(wake_fd) = &self.wake_fd
        {
            wake_fd.clear();
        }
        self.stats.recv_syscalls += 1;
        let mut completions = std::mem::take(&mut self.completions);
        for completion in completions.drain(..) {
            self.stats.replies_received += 1;
            let slot = completion.token as usize;
            let (lookup, mut plan) = self.plans[slot].take().expect("a completion for a slot in use");
            self.free_slots.push(slot);
            let step = match completion.result {
                Ok(()) => self.engine.get_continue(&mut plan, completion.buf),
                Err(source) => Err(kura_engine::Error::Io { op: "read", offset_bytes: 0, source }),
            };
            self.step(lookup, plan, step);
        }
        self.completions = completions;
        delivered += self.deliver_ready(on_complete);
        Ok(delivered)
    }

    fn deliver_ready(&mut self, on_complete: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut delivered = 0;
        while let Some((token, result)) = self.ready.pop_front() {
            self.in_flight -= 1;
            delivered += 1;
            match result {
                Ok(Finished::Item(item)) => {
                    on_complete(Completion { token, result: Ok(Outcome::Value(item.value())) });
                    if let Some(buf) = item.into_read_buffer() {
                        self.spare.put(buf);
                    }
                }
                Ok(Finished::Missing) => on_complete(Completion { token, result: Ok(Outcome::Missing) }),
                Ok(Finished::Done) => on_complete(Completion { token, result: Ok(Outcome::Done) }),
                Err(e) => on_complete(Completion { token, result: Err(e) }),
            }
        }
        delivered
    }
}
