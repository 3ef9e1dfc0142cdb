//! The request engine every frontend shares: one [`BlockQueue`] per thread (per NBD
//! connection, per ublk queue, per FUSE worker), owning that thread's pool [`Context`].
//!
//! A block request is split into one pool operation per 4 KiB block ([`Split`]); they are
//! submitted together (the pool sends all that go to one node in one syscall) and the
//! completions are reassembled into the request's buffer as they arrive, each value copied
//! once, from the pool's receive buffer to where it belongs. A block the request covers only
//! partly is a read-modify-write: get, patch, set, under a per-block lock shared by every
//! queue of the volume in this process, so that writes to different sectors of one block
//! never undo each other, whichever connection or queue they come from. Whole blocks written
//! or deleted hold the lock too, while in flight, so that a read-modify-write never puts back
//! what they replaced: each request changes each block atomically, one after another.
//!
//! `FLUSH` and `FUA` use the pool's durability barrier, which covers every write any context
//! had acknowledged before it: that is what lets NBD advertise `CAN_MULTI_CONN`. Barriers are
//! coalesced: while one is in flight, the requests that need another wait and share the next.
//! `DISCARD` and `WRITE_ZEROES` delete whole blocks, so space comes back and the blocks read as
//! zeros again; the partial blocks at their ends are zeroed by read-modify-write
//! (`WRITE_ZEROES`) or left alone (`DISCARD` is advisory). A whole block written with zeros is
//! deleted as well, rather than stored.

use std::collections::{HashSet, VecDeque};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kura_pool::{Completion, Context, Outcome, block_key};

use crate::error::{BlockError, Result};
use crate::layout::{BLOCK_SIZE_BYTES, Segment, Split, ZERO_BLOCK};
use crate::volume::VolumeMeta;

/// Pool operations one queue keeps in flight, at most (also bounded by the pool's own
/// `in_flight_max`).
pub const WINDOW_MAX: usize = 4096;
/// Requests in flight in one queue, at most (the token has 24 bits for the slot).
pub const REQUESTS_MAX: usize = 1 << 20;
/// How long a queue waits before trying again for a block another thread is
/// read-modify-writing.
/// A frontend answers requests that finished together this many at a time, and between
/// groups takes in the requests that arrived meanwhile and sends them to the pool
/// ([`BlockQueue::send`]). The device completes a client's reads in batches (a virtual disk
/// answers what it was given at once) and a client sends its next requests as replies reach
/// it: answered in one piece, a batch kept the client from sending anything until its last
/// reply was out, and the device idled until the next batch came in, in waves of the
/// client's queue depth. `kura bench block` (fio randread at queue depth 32): NBD over the
/// pool's GET rate 0.75 and 0.77 in one piece, 0.93-1.09 in groups of 2, 4 or 8 on the
/// embedded engine (0.73-0.76 and 0.80-0.86 on a kura server).
pub const REPLIES_PER_GROUP: usize = 4;
const LOCK_RETRY_INTERVAL: Duration = Duration::from_micros(200);
/// Shards of the per-volume block lock table.
const LOCK_SHARDS: usize = 64;

// A pool token: request slot (24 bits) | kind (2 bits) | segment index (38 bits: every block
// of the largest volume).
const TOKEN_INDEX_BITS: u32 = 38;
const TOKEN_KIND_SHIFT: u32 = TOKEN_INDEX_BITS;
const TOKEN_SLOT_SHIFT: u32 = TOKEN_INDEX_BITS + 2;
const _: () = assert!(crate::volume::VOLUME_SIZE_BYTES_MAX / BLOCK_SIZE_BYTES <= 1 << TOKEN_INDEX_BITS);
const _: () = assert!(REQUESTS_MAX <= 1 << (64 - TOKEN_SLOT_SHIFT));
const KIND_SEGMENT: u64 = 0;
const KIND_RMW_GET: u64 = 1;
const KIND_RMW_SET: u64 = 2;
const KIND_FLUSH: u64 = 3;

fn token(slot: u32, kind: u64, index: u64) -> u64 {
    (u64::from(slot) << TOKEN_SLOT_SHIFT) | (kind << TOKEN_KIND_SHIFT) | index
}

fn untoken(token: u64) -> (u32, u64, u64) {
    ((token >> TOKEN_SLOT_SHIFT) as u32, (token >> TOKEN_KIND_SHIFT) & 3, token & ((1 << TOKEN_INDEX_BITS) - 1))
}

/// Blocks being read-modify-written, per volume, shared by every queue of this process.
pub struct BlockLocks {
    shards: Box<[Mutex<HashSet<u64>>]>,
}

impl Default for BlockLocks {
    fn default() -> Self {
        Self { shards: (0..LOCK_SHARDS).map(|_| Mutex::new(HashSet::new())).collect() }
    }
}

impl BlockLocks {
    fn shard(&self, lba: u64) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.shards[(lba as usize) % LOCK_SHARDS].lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn try_lock(&self, lba: u64) -> bool {
        self.shard(lba).insert(lba)
    }

    pub fn unlock(&self, lba: u64) {
        let was_locked = self.shard(lba).remove(&lba);
        assert!(was_locked, "unlocking block {lba}, which is not locked");
    }
}

/// A volume being served: its record and the lock table its queues share.
pub struct Volume {
    pub meta: VolumeMeta,
    pub locks: Arc<BlockLocks>,
}

impl Volume {
    pub fn new(meta: VolumeMeta) -> Arc<Self> {
        Arc::new(Self { meta, locks: Arc::new(BlockLocks::default()) })
    }
}

/// Where a read's data goes: the first `len` bytes of it.
pub trait ReadBuf {
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl ReadBuf for Vec<u8> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A finished request.
pub struct Done<B> {
    pub tag: u64,
    pub result: Result<()>,
    /// The read buffer given at submit (reads only).
    pub buf: Option<B>,
    /// A read found none of its blocks in the pool: it read only zeros (a hole).
    pub hole: bool,
}

/// What [`BlockQueue::submit_block_status`] finds of a block, one byte per block.
///
/// Only whether the block is stored: the pool is asked whether its key exists
/// ([`Context::submit_exists`]), so the 4 KiB value does not cross the network. A stored
/// block that holds only zeros (written with `no_hole`, or before zero blocks were deleted)
/// is therefore `Data`, never told apart: "data" is always a correct answer to a block
/// status (NBD's `STATE_ZERO` is a hint), and looking at the value would cost as much as
/// reading the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockState {
    /// Stored (its contents unknown: possibly all zeros).
    Data = 0,
    /// Not in the pool: reads as zeros and takes no room.
    Absent = 1,
}

impl BlockState {
    pub fn from_byte(b: u8) -> Self {
        match b {
            0 => Self::Data,
            _ => Self::Absent,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Read,
    /// Which blocks are stored (an existence probe per block: no value is sent).
    Status,
    Write,
    Flush,
    Discard,
    /// `no_hole`: write zero blocks instead of deleting them.
    Zeroes { no_hole: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RmwStage {
    /// Waiting for the block's lock.
    Locking,
    Reading,
    /// Read and patched; the set is to be submitted.
    Patched,
    Writing,
    Finished,
}

/// A partial block's read-modify-write.
struct Rmw {
    seg: Segment,
    /// The bytes to put at `seg.in_block()`; `None`: zeros.
    patch: Option<Box<[u8]>>,
    block: Box<[u8]>,
    stage: RmwStage,
}

struct Req<B> {
    tag: u64,
    cmd: Cmd,
    fua: bool,
    volume: Arc<Volume>,
    split: Split,
    /// Next segment to submit.
    next: u64,
    /// Operations submitted (or waiting for a lock) and not finished.
    outstanding: u64,
    buf: Option<B>,
    /// A write's data, kept when it could not all be submitted at once.
    data: Option<Vec<u8>>,
    /// The partial first and last blocks of a write or write-zeroes.
    rmw: [Option<Rmw>; 2],
    /// Whole blocks it writes or deletes whose lock it holds (operations in flight).
    locked: HashSet<u64>,
    error: Option<BlockError>,
    /// A read's blocks found in the pool.
    found: u64,
    /// Waiting for its barrier.
    flushing: bool,
    /// Handed to the done list.
    finished: bool,
}

impl<B> Req<B> {
    fn fail(&mut self, error: BlockError) {
        self.error.get_or_insert(error);
    }

    fn all_submitted(&self) -> bool {
        self.next >= self.split.count()
    }

    fn rmw_index(&self, seg: &Segment) -> usize {
        usize::from(seg.lba != self.split.first_lba())
    }
}

#[derive(Default)]
struct Flusher {
    in_flight: bool,
    current: Vec<u32>,
    waiting: Vec<u32>,
    /// A barrier failed and only FUA writes waited for it: the next `FLUSH` fails with its
    /// error too. The pool reports writes it may have lost (a node that restarted) to one
    /// barrier only, and a client learns of them from its FLUSHes.
    loss_unreported: Option<String>,
}

/// Everything but the pool context, so that completion callbacks (which run while the
/// context is borrowed) can update it.
struct State<B> {
    reqs: Vec<Option<Req<B>>>,
    free: Vec<u32>,
    /// Requests with segments not yet submitted, oldest first.
    active: VecDeque<u32>,
    /// Read-modify-writes whose set is ready, and ones waiting for their block's lock.
    patched: Vec<(u32, usize)>,
    locking: Vec<(u32, usize)>,
    done: VecDeque<u32>,
    flusher: Flusher,
    window: usize,
    live: usize,
}

/// One thread's block request engine (see the module documentation).
pub struct BlockQueue<B> {
    ctx: Context,
    st: State<B>,
}

impl<B: ReadBuf> BlockQueue<B> {
    /// A queue over `ctx`, keeping at most `window` pool operations in flight (capped by
    /// [`WINDOW_MAX`]).
    pub fn new(ctx: Context, window: usize) -> Self {
        let st = State {
            reqs: Vec::new(),
            free: Vec::new(),
            active: VecDeque::new(),
            patched: Vec::new(),
            locking: Vec::new(),
            done: VecDeque::new(),
            flusher: Flusher::default(),
            window: window.clamp(1, WINDOW_MAX),
            live: 0,
        };
        Self { ctx, st }
    }

    /// Requests submitted and not yet handed back.
    pub fn requests(&self) -> usize {
        self.st.live
    }

    pub fn is_idle(&self) -> bool {
        self.st.live == 0
    }

    /// The pool context (for its I/O counters).
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    fn insert(&mut self, req: Req<B>) -> Result<u32> {
        if self.st.live >= REQUESTS_MAX {
            return Err(BlockError::Invalid(format!("{REQUESTS_MAX} requests already in flight on this queue")));
        }
        self.st.live += 1;
        let slot = match self.st.free.pop() {
            Some(slot) => slot,
            None => {
                self.st.reqs.push(None);
                (self.st.reqs.len() - 1) as u32
            }
        };
        self.st.reqs[slot as usize] = Some(req);
        Ok(slot)
    }

    #[allow(clippy::too_many_arguments)] // one request's fields, as the frontends hand them over
    fn new_req(&self, tag: u64, cmd: Cmd, fua: bool, volume: &Arc<Volume>, offset_bytes: u64, len_bytes: u64, buf: Option<B>) -> Req<B> {
        Req {
            tag,
            cmd,
            fua,
            volume: Arc::clone(volume),
            split: Split::new(offset_bytes, len_bytes),
            next: 0,
            outstanding: 0,
            buf,
            data: None,
            rmw: [None, None],
            locked: HashSet::new(),
            error: None,
            found: 0,
            flushing: false,
            finished: false,
        }
    }

    /// Checks the range; a bad one finishes the request at once with the error.
    fn admit(&mut self, req: Req<B>) -> Result<u32> {
        let size_bytes = req.volume.meta.size_bytes;
        let (offset_bytes, len_bytes) = (req.split.offset_bytes, req.split.len_bytes);
        let slot = self.insert(req)?;
        if offset_bytes.checked_add(len_bytes).is_none_or(|end| end > size_bytes) {
            let req = self.st.req(slot);
            req.fail(BlockError::OutOfRange { offset_bytes, len_bytes, size_bytes });
            req.next = req.split.count();
            self.st.maybe_finish(slot);
        }
        Ok(slot)
    }

    /// Reads `len_bytes` at `offset_bytes` into the first `len_bytes` of `buf`.
    pub fn submit_read(&mut self, tag: u64, volume: &Arc<Volume>, offset_bytes: u64, len_bytes: u64, mut buf: B) -> Result<()> {
        assert!(buf.bytes_mut().len() as u64 >= len_bytes, "read buffer smaller than the read");
        let req = self.new_req(tag, Cmd::Read, false, volume, offset_bytes, len_bytes, Some(buf));
        let slot = self.admit(req)?;
        self.start(slot);
        Ok(())
    }

    /// Finds which blocks of the range are stored: `buf`'s byte `i` becomes the
    /// [`BlockState`] of the range's block `i` (from the block holding `offset_bytes`).
    pub fn submit_block_status(&mut self, tag: u64, volume: &Arc<Volume>, offset_bytes: u64, len_bytes: u64, mut buf: B) -> Result<()> {
        let req = self.new_req(tag, Cmd::Status, false, volume, offset_bytes, len_bytes, None);
        assert!(buf.bytes_mut().len() as u64 >= req.split.count(), "status buffer smaller than the blocks");
        let slot = self.admit(Req { buf: Some(buf), ..req })?;
        self.start(slot);
        Ok(())
    }

    /// Writes `data` at `offset_bytes`; `fua`: durable before it completes. `data` is only
    /// borrowed for the call: what cannot be submitted at once is copied.
    pub fn submit_write(&mut self, tag: u64, volume: &Arc<Volume>, offset_bytes: u64, data: &[u8], fua: bool) -> Result<()> {
        let req = self.new_req(tag, Cmd::Write, fua, volume, offset_bytes, data.len() as u64, None);
        let slot = self.admit(req)?;
        if self.st.req(slot).all_submitted() {
            self.st.maybe_finish(slot);
            return Ok(());
        }
        self.prepare_rmw(slot, Some(data));
        self.submit_segments(slot, Some(data));
        let req = self.st.req(slot);
        if !req.all_submitted() && req.error.is_none() {
            req.data = Some(data.to_vec());
            self.st.active.push_back(slot);
        }
        self.st.maybe_finish(slot);
        Ok(())
    }

    /// A durability barrier over every write completed before it.
    pub fn submit_flush(&mut self, tag: u64, volume: &Arc<Volume>) -> Result<()> {
        let req = self.new_req(tag, Cmd::Flush, true, volume, 0, 0, None);
        let slot = self.insert(req)?;
        self.st.maybe_finish(slot);
        Ok(())
    }

    /// Drops the blocks wholly inside the range (they read as zeros and their space comes
    /// back); partial blocks at the ends are left as they are.
    pub fn submit_discard(&mut self, tag: u64, volume: &Arc<Volume>, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> {
        let req = self.new_req(tag, Cmd::Discard, fua, volume, offset_bytes, len_bytes, None);
        let slot = self.admit(req)?;
        self.start(slot);
        Ok(())
    }

    /// Makes the range read as zeros: whole blocks are deleted (or, with `no_hole`, written
    /// as zero blocks), partial ones zeroed by read-modify-write.
    pub fn submit_write_zeroes(&mut self, tag: u64, volume: &Arc<Volume>, offset_bytes: u64, len_bytes: u64, fua: bool, no_hole: bool) -> Result<()> {
        let req = self.new_req(tag, Cmd::Zeroes { no_hole }, fua, volume, offset_bytes, len_bytes, None);
        let slot = self.admit(req)?;
        if !self.st.req(slot).all_submitted() {
            self.prepare_rmw(slot, None);
        }
        self.start(slot);
        Ok(())
    }

    fn start(&mut self, slot: u32) {
        if self.st.req(slot).all_submitted() {
            self.st.maybe_finish(slot);
            return;
        }
        self.submit_segments(slot, None);
        if !self.st.req(slot).all_submitted() {
            self.st.active.push_back(slot);
        }
        self.st.maybe_finish(slot);
    }

    /// Sets up the read-modify-writes of a write's (or write-zeroes') partial end blocks.
    fn prepare_rmw(&mut self, slot: u32, data: Option<&[u8]>) {
        let req = self.st.reqs[slot as usize].as_mut().expect("a live request");
        let count = req.split.count();
        let ends = if count == 1 { vec![0] } else { vec![0, count - 1] };
        for index in ends {
            let seg = req.split.segment(index);
            if seg.is_full() {
                continue;
            }
            let which = req.rmw_index(&seg);
            let patch = data.map(|d| d[seg.in_buf()].to_vec().into_boxed_slice());
            req.rmw[which] = Some(Rmw { seg, patch, block: vec![0u8; BLOCK_SIZE_BYTES as usize].into_boxed_slice(), stage: RmwStage::Locking });
            req.outstanding += 1;
            self.st.locking.push((slot, which));
        }
    }

    /// Submits the request's remaining whole-block operations (reads: every block) while
    /// the window has room.
    fn submit_segments(&mut self, slot: u32, borrowed: Option<&[u8]>) {
        let window = self.st.window;
        let ctx = &mut self.ctx;
        let req = self.st.reqs[slot as usize].as_mut().expect("a live request");
        let volume_id = req.volume.meta.id;
        while !req.all_submitted() && ctx.in_flight() < window {
            let index = req.next;
            let seg = req.split.segment(index);
            req.next += 1;
            let key = block_key(volume_id, seg.lba);
            let tok = token(slot, KIND_SEGMENT, index);
            let changes = !matches!(req.cmd, Cmd::Read | Cmd::Status);
            if changes && !seg.is_full() {
                continue; // read-modify-write (or nothing, for a discard)
            }
            // A whole block written or deleted holds the block's lock while in flight, as a
            // read-modify-write does: landing between the get and the set of another queue's
            // read-modify-write of the block, it would be undone by that set.
            if changes && !req.volume.locks.try_lock(seg.lba) {
                req.next -= 1;
                break;
            }
            let submitted = match req.cmd {
                Cmd::Read => ctx.submit_get(&key, tok),
                Cmd::Status => ctx.submit_exists(&key, tok),
                Cmd::Write => {
                    let data = borrowed.or(req.data.as_deref()).expect("a write's data");
                    let block = &data[seg.in_buf()];
                    // A block of zeros is deleted, not stored: it reads as zeros either way
                    // (thin provisioning), and a guest zeroing its disk frees the pool.
                    if kura_pool::is_zeros(block) { ctx.submit_delete(&key, tok) } else { ctx.submit_set(&key, block, tok) }
                }
                Cmd::Zeroes { no_hole: true } => ctx.submit_set(&key, &ZERO_BLOCK, tok),
                Cmd::Discard | Cmd::Zeroes { no_hole: false } => ctx.submit_delete(&key, tok),
                Cmd::Flush => unreachable!("a flush has no segments"),
            };
            match submitted {
                Ok(()) => {
                    req.outstanding += 1;
                    if changes {
                        req.locked.insert(seg.lba);
                    }
                    continue;
                }
                Err(kura_pool::Error::QueueFull { .. }) => req.next -= 1,
                Err(e) => {
                    req.fail(BlockError::from_pool(e));
                    req.next = req.split.count();
                }
            }
            if changes {
                req.volume.locks.unlock(seg.lba);
            }
            if !req.all_submitted() {
                break;
            }
        }
    }

    /// Submits what waits: the barrier, patched blocks, locked blocks' reads, and the
    /// remaining segments of active requests, oldest first.
    fn pump(&mut self) {
        self.pump_flush();
        for (slot, which) in std::mem::take(&mut self.st.patched) {
            self.submit_rmw_set(slot, which);
        }
        let locking = std::mem::take(&mut self.st.locking);
        for (slot, which) in locking {
            self.try_rmw(slot, which);
        }
        while let Some(&slot) = self.st.active.front() {
            if self.ctx.in_flight() >= self.st.window {
                break;
            }
            self.submit_segments(slot, None);
            if !self.st.req(slot).all_submitted() {
                break;
            }
            self.st.active.pop_front();
            self.st.req(slot).data = None;
            self.st.maybe_finish(slot);
        }
    }

    fn pump_flush(&mut self) {
        let flusher = &mut self.st.flusher;
        if flusher.in_flight || flusher.waiting.is_empty() {
            return;
        }
        match self.ctx.submit_flush(token(0, KIND_FLUSH, 0)) {
            Ok(()) => {
                flusher.in_flight = true;
                flusher.current = std::mem::take(&mut flusher.waiting);
            }
            Err(kura_pool::Error::QueueFull { .. }) => {}
            Err(e) => {
                let message = e.to_string();
                for slot in std::mem::take(&mut flusher.waiting) {
                    self.st.req(slot).fail(BlockError::FlushFailed(message.clone()));
                    self.st.finish(slot);
                }
            }
        }
    }

    fn try_rmw(&mut self, slot: u32, which: usize) {
        let window_full = self.ctx.in_flight() >= self.st.window;
        let req = self.st.reqs[slot as usize].as_mut().expect("a live request");
        // Locks are taken in block order (the first block before the last), so two requests
        // that need the same two blocks cannot each hold one and wait for the other.
        let head_waits = which == 1 && req.rmw[0].as_ref().is_some_and(|r| r.stage == RmwStage::Locking);
        let rmw = req.rmw[which].as_mut().expect("a prepared read-modify-write");
        debug_assert_eq!(rmw.stage, RmwStage::Locking);
        let locked = !head_waits && !window_full && req.volume.locks.try_lock(rmw.seg.lba);
        if !locked {
            self.st.locking.push((slot, which));
            return;
        }
        rmw.stage = RmwStage::Reading;
        let key = block_key(req.volume.meta.id, rmw.seg.lba);
        if let Err(e) = self.ctx.submit_get(&key, token(slot, KIND_RMW_GET, which as u64)) {
            self.st.rmw_failed(slot, which, BlockError::from_pool(e));
        }
    }

    fn submit_rmw_set(&mut self, slot: u32, which: usize) {
        let req = self.st.reqs[slot as usize].as_mut().expect("a live request");
        let rmw = req.rmw[which].as_mut().expect("a prepared read-modify-write");
        debug_assert_eq!(rmw.stage, RmwStage::Patched);
        rmw.stage = RmwStage::Writing;
        let key = block_key(req.volume.meta.id, rmw.seg.lba);
        match self.ctx.submit_set(&key, &rmw.block, token(slot, KIND_RMW_SET, which as u64)) {
            Ok(()) => {}
            Err(kura_pool::Error::QueueFull { .. }) => {
                rmw.stage = RmwStage::Patched;
                self.st.patched.push((slot, which));
            }
            Err(e) => self.st.rmw_failed(slot, which, BlockError::from_pool(e)),
        }
    }

    /// Sends what was submitted, waits up to `timeout` (`None`: until some pool operation
    /// finishes) and hands every finished request to `on_done`. Returns how many it handed
    /// over, which may be 0 when a completion only moved a request on (call it again while
    /// [`BlockQueue::requests`] is above 0).
    pub fn poll(&mut self, timeout: Option<Duration>, on_done: &mut dyn FnMut(Done<B>)) -> Result<usize> {
        self.poll_watching(timeout, None, on_done)
    }

    /// Sends what was submitted to the pool without waiting, and hands every request that has
    /// finished meanwhile to `on_done` (how many it handed over). [`BlockQueue::poll`] with a
    /// zero timeout returns before sending when finished requests are already waiting.
    pub fn send(&mut self, on_done: &mut dyn FnMut(Done<B>)) -> Result<usize> {
        self.pump();
        if self.ctx.in_flight() > 0 {
            let st = &mut self.st;
            self.ctx.poll(Some(Duration::ZERO), &mut |c| st.on_completion(c)).map_err(BlockError::from_pool)?;
            self.pump();
        }
        Ok(self.deliver(on_done))
    }

    /// [`BlockQueue::poll`] that also returns early when new data arrives on `watch` (the
    /// client socket; see [`kura_pool::Context::poll_watching`]).
    pub fn poll_watching(&mut self, timeout: Option<Duration>, watch: Option<RawFd>, on_done: &mut dyn FnMut(Done<B>)) -> Result<usize> {
        self.pump();
        let mut delivered = self.deliver(on_done);
        if delivered > 0 || self.st.live == 0 {
            return Ok(delivered);
        }
        if self.ctx.in_flight() == 0 {
            // Only read-modify-writes waiting for a block another queue holds: try again soon.
            let pause = timeout.map_or(LOCK_RETRY_INTERVAL, |t| t.min(LOCK_RETRY_INTERVAL));
            std::thread::sleep(pause);
        } else {
            let st = &mut self.st;
            self.ctx.poll_watching(timeout, watch, &mut |c| st.on_completion(c)).map_err(BlockError::from_pool)?;
        }
        self.pump();
        delivered += self.deliver(on_done);
        Ok(delivered)
    }

    fn deliver(&mut self, on_done: &mut dyn FnMut(Done<B>)) -> usize {
        let mut delivered = 0;
        while let Some(slot) = self.st.done.pop_front() {
            let req = self.st.reqs[slot as usize].take().expect("a finished request");
            self.st.free.push(slot);
            self.st.live -= 1;
            delivered += 1;
            let hole = req.cmd == Cmd::Read && req.found == 0;
            on_done(Done { tag: req.tag, result: req.error.map_or(Ok(()), Err), buf: req.buf, hole });
        }
        delivered
    }
}

impl<B: ReadBuf> State<B> {
    fn req(&mut self, slot: u32) -> &mut Req<B> {
        self.reqs[slot as usize].as_mut().expect("a live request")
    }

    /// Finishes the request if nothing of it is left; a request that needs a barrier joins
    /// the flusher first.
    fn maybe_finish(&mut self, slot: u32) {
        let req = self.req(slot);
        if req.outstanding > 0 || !req.all_submitted() || req.flushing || req.finished {
            return;
        }
        if req.fua && req.error.is_none() {
            req.flushing = true;
            self.flusher.waiting.push(slot);
        } else {
            self.finish(slot);
        }
    }

    fn finish(&mut self, slot: u32) {
        let req = self.req(slot);
        debug_assert!(!req.finished);
        req.finished = true;
        req.flushing = false;
        self.done.push_back(slot);
    }

    fn rmw_failed(&mut self, slot: u32, which: usize, error: BlockError) {
        let req = self.req(slot);
        let rmw = req.rmw[which].as_mut().expect("a prepared read-modify-write");
        rmw.stage = RmwStage::Finished;
        let lba = rmw.seg.lba;
        req.volume.locks.unlock(lba);
        req.fail(error);
        req.outstanding -= 1;
        self.maybe_finish(slot);
    }

    fn on_completion(&mut self, c: Completion<'_>) {
        let (slot, kind, index) = untoken(c.token);
        match kind {
            KIND_FLUSH => self.flush_done(c.result.map(|_| ())),
            KIND_SEGMENT => {
                let req = self.req(slot);
                match c.result {
                    Ok(outcome) if req.cmd == Cmd::Read => {
                        let seg = req.split.segment(index);
                        let volume_id = req.volume.meta.id;
                        let buf = req.buf.as_mut().expect("a read's buffer").bytes_mut();
                        if matches!(outcome, Outcome::Value(_)) {
                            req.found += 1;
                        }
                        match outcome {
                            Outcome::Value(v) if v.len() as u64 == BLOCK_SIZE_BYTES => buf[seg.in_buf()].copy_from_slice(&v[seg.in_block()]),
                            Outcome::Value(v) => req.fail(BlockError::CorruptBlock { volume_id, lba: seg.lba, len_bytes: v.len(), expected_bytes: BLOCK_SIZE_BYTES as usize }),
                            _ => buf[seg.in_buf()].fill(0),
                        }
                    }
                    Ok(outcome) if req.cmd == Cmd::Status => {
                        let state = if outcome == Outcome::Missing { BlockState::Absent } else { BlockState::Data };
                        req.buf.as_mut().expect("a status buffer").bytes_mut()[index as usize] = state as u8;
                    }
                    Ok(_) => {}
                    Err(e) => req.fail(BlockError::from_pool(e)),
                }
                if !matches!(req.cmd, Cmd::Read | Cmd::Status) {
                    let lba = req.split.segment(index).lba;
                    let was_locked = req.locked.remove(&lba);
                    debug_assert!(was_locked, "block {lba} written without its lock");
                    req.volume.locks.unlock(lba);
                }
                req.outstanding -= 1;
                self.maybe_finish(slot);
            }
            KIND_RMW_GET => {
                let which = index as usize;
                let req = self.req(slot);
                let volume_id = req.volume.meta.id;
                let rmw = req.rmw[which].as_mut().expect("a prepared read-modify-write");
                let problem = match c.result {
                    Ok(Outcome::Value(v)) if v.len() as u64 == BLOCK_SIZE_BYTES => {
                        rmw.block.copy_from_slice(v);
                        None
                    }
                    Ok(Outcome::Value(v)) => Some(BlockError::CorruptBlock { volume_id, lba: rmw.seg.lba, len_bytes: v.len(), expected_bytes: BLOCK_SIZE_BYTES as usize }),
                    Ok(_) => {
                        rmw.block.fill(0);
                        None
                    }
                    Err(e) => Some(BlockError::from_pool(e)),
                };
                match problem {
                    Some(error) => self.rmw_failed(slot, which, error),
                    None => {
                        let range = rmw.seg.in_block();
                        match &rmw.patch {
                            Some(patch) => rmw.block[range].copy_from_slice(patch),
                            None => rmw.block[range].fill(0),
                        }
                        rmw.stage = RmwStage::Patched;
                        self.patched.push((slot, which));
                    }
                }
            }
            KIND_RMW_SET => {
                let which = index as usize;
                let req = self.req(slot);
                let rmw = req.rmw[which].as_mut().expect("a prepared read-modify-write");
                debug_assert_eq!(rmw.stage, RmwStage::Writing);
                rmw.stage = RmwStage::Finished;
                let lba = rmw.seg.lba;
                req.volume.locks.unlock(lba);
                if let Err(e) = c.result {
                    req.fail(BlockError::from_pool(e));
                }
                req.outstanding -= 1;
                self.maybe_finish(slot);
            }
            _ => unreachable!("token kind {kind}"),
        }
    }

    fn flush_done(&mut self, result: std::result::Result<(), kura_pool::Error>) {
        self.flusher.in_flight = false;
        let batch = std::mem::take(&mut self.flusher.current);
        let message = result.err().map(|e| e.to_string());
        let flush_message = if batch.iter().any(|&slot| self.req(slot).cmd == Cmd::Flush) {
            message.clone().or(self.flusher.loss_unreported.take())
        } else {
            if message.is_some() {
                self.flusher.loss_unreported.clone_from(&message);
            }
            None
        };
        for slot in batch {
            let req = self.req(slot);
            if let Some(m) = if req.cmd == Cmd::Flush { &flush_message } else { &message } {
                req.fail(BlockError::FlushFailed(m.clone()));
            }
            self.finish(slot);
        }
    }
}

impl<B> Drop for BlockQueue<B> {
    /// Releases the block locks of read-modify-writes that never finished (the queue is
    /// dropped with requests in flight, e.g. after its client disconnected), so that other
    /// queues of the volume do not wait for them forever.
    fn drop(&mut self) {
        for req in self.st.reqs.iter().flatten() {
            for &lba in &req.locked {
                req.volume.locks.unlock(lba);
            }
            for rmw in req.rmw.iter().flatten() {
                if matches!(rmw.stage, RmwStage::Reading | RmwStage::Patched | RmwStage::Writing) {
                    req.volume.locks.unlock(rmw.seg.lba);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for (slot, kind, index) in [(0, 0, 0), (5, 3, 1), ((REQUESTS_MAX - 1) as u32, 2, (1 << TOKEN_INDEX_BITS) - 1)] {
            assert_eq!(untoken(token(slot, kind, index)), (slot, kind, index));
        }
    }

    #[test]
    fn locks_exclude() {
        let locks = BlockLocks::default();
        assert!(locks.try_lock(7));
        assert!(!locks.try_lock(7));
        assert!(locks.try_lock(7 + LOCK_SHARDS as u64));
        locks.unlock(7);
        assert!(locks.try_lock(7));
    }
}
