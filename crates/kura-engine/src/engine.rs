//! The engine: partitions of write buffers and sealed blocks over one device.
//!
//! Keys are split by hash into partitions, each an independent write stream with its own
//! Bloom Filter Map, so a lookup considers only its partition's blocks. A lookup checks the
//! partition's write buffers, then asks the map for candidate blocks, orders them newest first,
//! and asks each block's page index for the one page (or slot) to read.
//!
//! Durability: a full buffer is sealed into a block (data + summary, fdatasync, footer,
//! fdatasync, checkpoint of the partition's watermark, fdatasync): a valid footer implies a
//! whole block, and a watermark is durable only after the block it points to. `sync()` writes records still in
//! buffers to the journal and fdatasyncs. Recovery reads superblock, checkpoint, every block's
//! footer and summary, and the journal; it never scans block data.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar as StdCondvar, Mutex as StdMutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;

use crate::aligned::{AlignedBuf, ReadBuffers};
use crate::bloom::{BfmColumn, BloomFilter, BloomFilterMap};
use crate::block::{self, BlockGeometry, BlockIndex, BuildSpec, RecordRef, Span, SpanError, SpanLookup};
use crate::buffer::{BufferFull, WriteBuffer};
use crate::config::EngineConfig;
use crate::device::{Device, FileDevice, FileDeviceOptions, IoQueue, io_queue};
use crate::error::{Error, Result};
use crate::format::{
    self, BLOCK_REGION_ALIGNMENT_BYTES, BlockKind, CHECKPOINT_OFFSETS_BYTES, Checkpoint, Footer, FormatError, JournalEntryHeader,
    META_PAGE_SIZE_BYTES, META_REGION_BYTES, Mode, RecordHeader, RecordKind, SUPERBLOCK_OFFSETS_BYTES, Superblock,
};
use crate::hash::KeyHash;
use crate::journal::{self, JournalWriter};
use crate::stats::{Counters, RamUsage, Stats};

/// Key stripes serialising writes to the same key (conditional writes read then write).
const WRITE_STRIPES: usize = 1024;
/// Free block slots a normal seal leaves in store mode: one for sealing deletions so they can
/// take effect, one for garbage collection's output.
const GC_RESERVE_SLOTS: usize = 2;
/// Store mode, with background threads: the collector thread starts when free block slots drop
/// to the reserve plus this many (fewer on small stores, see `gc_background_free_slots`), so
/// writers seldom wait for a collection themselves.
const GC_BACKGROUND_FREE_SLOTS: usize = 4;
/// The collector thread looks at the free slots at least this often even when not woken.
const GC_BACKGROUND_POLL_MS: u64 = 100;
/// Most blocks compacted together by one garbage-collection pass.
const GC_VICTIMS_MAX: usize = 8;
/// A block is not worth collecting when more than this share of it is live.
const GC_LIVE_FRACTION_MAX: f64 = 0.95;
/// The most zero bytes written between a block's summary and its footer to make one write of
/// the whole block.
const FOOTER_WRITE_GAP_BYTES_MAX: usize = 1 << 20;
/// Seals between confirmation rounds (one fdatasync and a checkpoint): bounds the blocks a
/// crash leaves to verify at open, and how long journal pages stay pinned without `sync()`.
const CONFIRM_EVERY_SEALS: u64 = 8;
/// Samples checked per acquisition of the partition lock (writers get in between).
const DEAD_SAMPLES_PER_LOCK: usize = 16;
/// Blocks whose live records one garbage-collection pass examines exactly, at most.
const GC_EXAMINE_MAX: usize = 16;
/// Liveness reads of one garbage-collection pass issued together (each at most a page or a
/// large record's slot, so this bounds the pass's read buffers to a few MiB).
const GC_LIVENESS_READS_BATCH: usize = 256;
/// ... and at most about this many bytes of them (large records' slots are read whole).
const GC_LIVENESS_READ_BYTES_MAX: u64 = 8 << 20;
/// Key digests (see `format::encode_digests`) garbage collection keeps in RAM between passes,
/// at most (about 36 K blocks of 4 KiB values); past it the cache starts over.
const GC_DIGEST_CACHE_BYTES_MAX: usize = 64 << 20;
/// RAM charged to the digest cache per block beyond its digests (map entry, `Arc` header).
const GC_DIGEST_CACHE_ENTRY_BYTES: usize = 64;
/// Candidate blocks of a lookup whose page indexes are prefetched together.
const PREFETCH_CANDIDATES_MAX: usize = 64;
/// Times a lookup restarts after finding its block reused under it.
const GET_RESTARTS_MAX: u32 = 16;
/// Reads in flight while loading block summaries at open.
const RECOVERY_QUEUE_DEPTH: usize = 64;

/// When a conditional write proceeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    Always,
    /// Only if the key has no live value (memcached `add`).
    IfAbsent,
    /// Only if the key has a live value (memcached `replace`).
    IfPresent,
    /// Only if the live value has this version (memcached `cas`).
    IfVersion(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written { version: u64 },
    /// The condition did not hold; `current` is the live version, if any.
    ConditionFailed { current: Option<u64> },
}

/// A value read from the store.
#[derive(Debug)]
pub struct Item {
    pub version: u64,
    value: ValueBytes,
}

#[derive(Debug)]
enum ValueBytes {
    Owned(Vec<u8>),
    /// A slice of the page or slot read from flash (no copy).
    Read { buf: AlignedBuf, start: usize, len: usize },
}

impl Item {
    pub fn value(&self) -> &[u8] {
        match &self.value {
            ValueBytes::Owned(v) => v,
            ValueBytes::Read { buf, start, len } => &buf[*start..*start + *len],
        }
    }

    /// The flash read buffer the value is a slice of, for a caller that reuses read buffers
    /// (`None` when the value is owned bytes, e.g. from a write buffer).
    pub fn into_read_buffer(self) -> Option<AlignedBuf> {
        match self.value {
            ValueBytes::Read { buf, .. } => Some(buf),
            ValueBytes::Owned(_) => None,
        }
    }

    pub fn into_vec(self) -> Vec<u8> {
        match self.value {
            ValueBytes::Owned(v) => v,
            ValueBytes::Read { .. } => self.value().to_vec(),
        }
    }
}

/// A lookup's key, candidate blocks and reads are held inline up to these sizes (most keys
/// are short, and a lookup has a few candidates and one or two reads), so that planning a
/// lookup does not allocate: on the server's GET path these small allocations, and their
/// growth, were ~5 % of its CPU time.
type PlanKey = SmallVec<[u8; 64]>;
type PlanCandidates = SmallVec<[u32; 16]>;
type PlanSpans = SmallVec<[Span; 4]>;

/// A lookup in progress, for callers that keep many reads in flight (see [`Engine::get_start`]).
#[derive(Debug)]
pub struct GetPlan {
    key: PlanKey,
    hash: KeyHash,
    /// The partition's blocks when the lookup was planned (one reference count for the whole
    /// lookup, instead of one per candidate block on a counter every thread touches).
    view: Option<BlockView>,
    /// Candidate blocks (ids into `view`), newest first; their page indexes are consulted one
    /// at a time, so a hit in a new block never pays for probing older ones.
    candidates: PlanCandidates,
    next_block: usize,
    /// Reads the current block's page index named, and the next to try.
    spans: PlanSpans,
    next_span: usize,
    restarts: u32,
    /// The bytes of the read after the current one, read by the caller beside it
    /// ([`Engine::get_continue_with`]): (device offset, bytes).
    prefetched: Option<(u64, AlignedBuf)>,
}

impl GetPlan {
    /// The read after the one just asked for, if the lookup has one: the next candidate page
    /// (of this block or the next candidate block), which the lookup reads only if the
    /// current one does not hold the key. A caller that reads it at the same time and hands
    /// both to [`Engine::get_continue_with`] turns a lookup's two reads one after the other
    /// into two at once, at the cost of reading it when it was not needed. `None` after
    /// [`GetStep::Done`] and when the current read is the lookup's last candidate.
    pub fn companion_read(&self) -> Option<(u64, usize)> {
        if self.next_block == 0 || self.next_span >= self.spans.len() {
            return None;
        }
        let span = match self.spans.get(self.next_span + 1) {
            Some(&span) => span,
            None => {
                // The first span of the next candidate block that has one (most have none:
                // their page index rules the key out).
                let view = self.view.as_ref()?;
                let mut spans = PlanSpans::new();
                let mut rest = self.candidates[self.next_block..].iter();
                loop {
                    Inner::view_block(view, *rest.next()?).locate(&self.hash, &mut spans);
                    if let Some(&first) = spans.first() {
                        break first;
                    }
                }
            }
        };
        Some((span.offset_bytes, span.len_bytes as usize))
    }
}

/// What a lookup needs next.
#[derive(Debug)]
pub enum GetStep {
    Done(Option<Item>),
    /// Read `len_bytes` at `offset_bytes` (aligned) and pass the bytes to [`Engine::get_continue`].
    Read { offset_bytes: u64, len_bytes: usize },
}

/// A store. Cheap to clone; safe to use from many threads.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
    /// Shared by every clone; when the last one drops, the sealers stop and the store syncs.
    _owner: Arc<Owner>,
}

/// Background sealer threads and the collector, joined (and the store synced) when the last
/// handle drops.
struct Owner {
    inner: Arc<Inner>,
    threads: Vec<std::thread::JoinHandle<()>>,
    collector: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(collector) = self.collector.take() {
            self.inner.gc_signal.0.lock().expect("gc signal poisoned").stop = true;
            self.inner.gc_signal.1.notify_all();
            let _ = collector.join();
        }
        if let Some(tx) = self.inner.seal_tx.lock().take() {
            for _ in &self.threads {
                let _ = tx.send(SealMsg::Stop);
            }
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        if !self.inner.failed.load(Ordering::Acquire)
            && let Err(error) = self.inner.sync()
        {
            tracing::error!(%error, "sync on close failed; unsynced writes may be lost");
        }
    }
}

enum SealMsg {
    Seal { partition: usize, slot: u32, frozen: Arc<WriteBuffer>, ticket: u64 },
    Stop,
}

struct Inner {
    device: Arc<dyn Device>,
    sb: Superblock,
    geo: BlockGeometry,
    key_size_max: usize,
    value_size_max_bytes: usize,
    partitions: Vec<Partition>,
    slots: Mutex<Slots>,
    last_version: AtomicU64,
    last_block_seq: AtomicU64,
    journal: Mutex<JournalState>,
    checkpoint: Mutex<CheckpointState>,
    /// Device syncs: the ticket of the newest one started, and the highest ticket completed.
    /// A write that completed when `sync_started` read `t` is durable once `sync_completed > t`.
    sync_started: AtomicU64,
    sync_completed: AtomicU64,
    /// Serialises device syncs, so callers that arrive during one can share the next.
    sync_lock: Mutex<()>,
    /// Block footers written but not yet known durable.
    unconfirmed: Mutex<Vec<Unconfirmed>>,
    /// Sequence numbers of blocks being written or not yet known durable.
    unconfirmed_seqs: Mutex<BTreeSet<u64>>,
    /// Seals since the last confirmation round (a sync making recent blocks durable).
    seals_since_confirm: AtomicU64,
    /// Held by a garbage-collection pass; holds what passes reuse: the buffer victims are read
    /// into (zeroing and faulting in a fresh block-sized buffer cost every pass a few ms of
    /// CPU), the liveness reads' queue and buffers, and the newer blocks' key digests.
    gc_lock: Mutex<GcScratch>,
    /// Wakes the background collector (store mode with background threads).
    gc_signal: (StdMutex<GcSignal>, StdCondvar),
    stripes: Box<[Mutex<()>]>,
    seals: Seals,
    counters: Counters,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Block images to build blocks in, kept for reuse: they are in huge pages (see
    /// `AlignedBuf::zeroed_huge`), which cost more to fault in than to keep.
    images: Mutex<Vec<AlignedBuf>>,
    /// Arenas of sealed write buffers, reused so buffers do not regrow from empty.
    spare_arenas: Mutex<Vec<Vec<u8>>>,
    /// Where frozen buffers go to be sealed in the background (none: seal inline).
    seal_tx: Mutex<Option<std::sync::mpsc::Sender<SealMsg>>>,
}

#[derive(Default)]
struct GcSignal {
    wake: bool,
    stop: bool,
}

struct Partition {
    state: RwLock<PartitionState>,
    /// Sync ticket when this partition's last normal block's footer was written: the next one's
    /// footer waits until that block is durable, so a crash never keeps a newer block of a
    /// partition while losing an older one (which the watermark would then wrongly cover).
    last_footer_ticket: AtomicU64,
}

struct PartitionState {
    active: WriteBuffer,
    sealing: Option<Arc<WriteBuffer>>,
    blocks: BlockTable,
    bfm: BloomFilterMap,
    journal_first_active: Option<u64>,
    journal_first_sealing: Option<u64>,
}

/// A partition's blocks under dense partition-local ids (the ids its Bloom Filter Map returns),
/// so the table grows with the partition, not with the device.
struct BlockTable {
    entries: Vec<Option<(Arc<BlockIndex>, BfmColumn)>>,
    free_ids: Vec<u32>,
    id_of_slot: HashMap<u32, u32>,
    /// The blocks by id, rebuilt on every insert and remove (once per sealed or retired
    /// block), for lookups to hold across their reads.
    view: BlockView,
}

/// A partition's blocks by id at one moment.
type BlockView = Arc<[Option<Arc<BlockIndex>>]>;

impl BlockTable {
    fn new() -> Self {
        Self { entries: Vec::new(), free_ids: Vec::new(), id_of_slot: HashMap::new(), view: Arc::from(Vec::new()) }
    }

    fn rebuild_view(&mut self) {
        self.view = self.entries.iter().map(|e| e.as_ref().map(|(b, _)| Arc::clone(b))).collect();
    }

    fn get(&self, id: u32) -> Option<&(Arc<BlockIndex>, BfmColumn)> {
        self.entries.get(id as usize)?.as_ref()
    }

    /// An id for the next block; pass it to `insert` with the block.
    fn next_id(&self) -> u32 {
        self.free_ids.last().copied().unwrap_or(self.entries.len() as u32)
    }

    fn insert(&mut self, id: u32, entry: (Arc<BlockIndex>, BfmColumn)) {
        assert_eq!(id, self.next_id());
        let slot = entry.0.slot;
        if self.free_ids.pop().is_none() {
            self.entries.push(None);
        }
        self.entries[id as usize] = Some(entry);
        assert!(self.id_of_slot.insert(slot, id).is_none(), "slot {slot} already holds a block");
        self.rebuild_view();
    }

    fn remove(&mut self, slot: u32) -> Option<(Arc<BlockIndex>, BfmColumn)> {
        let id = self.id_of_slot.remove(&slot)?;
        self.free_ids.push(id);
        let removed = self.entries[id as usize].take();
        self.rebuild_view();
        removed
    }

    fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Option<(Arc<BlockIndex>, BfmColumn)>>()
            + 4 * self.free_ids.capacity()
            + 16 * self.id_of_slot.capacity()
            + std::mem::size_of::<Option<Arc<BlockIndex>>>() * self.view.len()
    }
}

/// An io_uring queue and spare buffers for batches of reads ([`Inner::read_batch`]).
struct BatchReads {
    queue: Option<Box<dyn IoQueue>>,
    buffers: ReadBuffers,
}

impl BatchReads {
    fn new() -> Self {
        Self { queue: None, buffers: ReadBuffers::new(RECOVERY_QUEUE_DEPTH) }
    }
}

struct GcScratch {
    victim: Option<AlignedBuf>,
    reads: BatchReads,
    digests: DigestCache,
}

/// One block's key digests (`KeyHash` `sort`, [`crate::hash::key_digest`]), sorted by `sort`.
type Digests = Arc<[(u64, u64)]>;

/// Key digests of sealed blocks, by (slot, block sequence number); `None` for a block whose
/// digest section could not be used (its records are then read instead).
#[derive(Default)]
struct DigestCache {
    blocks: HashMap<(u32, u64), Option<Digests>>,
    bytes: usize,
}

impl DigestCache {
    /// Whether block `b`'s digests (loaded) list the key of `hash` and keyed `digest`; `None`
    /// if they are not loaded.
    fn lists(&self, b: &BlockIndex, hash: &KeyHash, digest: u64) -> Option<bool> {
        let digests = self.blocks.get(&(b.slot, b.block_seq))?.as_ref()?;
        let from = digests.partition_point(|d| d.0 < hash.sort);
        Some(digests[from..].iter().take_while(|d| d.0 == hash.sort).any(|d| d.1 == digest))
    }

    fn insert(&mut self, b: &BlockIndex, digests: Option<Vec<(u64, u64)>>) {
        let bytes = digests.as_ref().map_or(0, |d| format::DIGEST_BYTES * d.len()) + GC_DIGEST_CACHE_ENTRY_BYTES;
        if self.bytes + bytes > GC_DIGEST_CACHE_BYTES_MAX {
            self.blocks.clear();
            self.bytes = 0;
        }
        self.bytes += bytes;
        self.blocks.insert((b.slot, b.block_seq), digests.map(Arc::from));
    }
}

struct Slots {
    free: Vec<u32>,
    /// Live blocks, oldest first (by search order).
    by_age: BTreeSet<(u64, u64, u32)>,
    live: HashMap<u32, Arc<BlockIndex>>,
}

struct JournalState {
    writer: JournalWriter,
}

/// Watermarks: what sealed blocks durably hold (confirmed), what the last checkpoint page
/// says (written), and what a checkpoint known to be durable says.
struct CheckpointState {
    seq: u64,
    confirmed: Vec<u64>,
    written: Vec<u64>,
    /// Sync ticket when the last checkpoint was written (durable once a later sync completed);
    /// `None` for the one found at open, which is durable.
    written_ticket: Option<u64>,
    durable: Vec<u64>,
    /// Every block with a sequence number up to this is durable (confirmed / last written).
    confirmed_block_seq: u64,
    written_block_seq: u64,
}

/// A sealed block whose footer is written but not yet known durable: until it is, its
/// records' journal pages stay pinned and its watermark stays out of checkpoints.
struct Unconfirmed {
    ticket: u64,
    block_seq: u64,
    partition: usize,
    watermark: u64,
    journal_first: Option<u64>,
}

/// Seals in flight, so `sync()` can wait for the ones that started before it.
struct Seals {
    state: StdMutex<(u64, BTreeSet<u64>)>,
    done: StdCondvar,
}

impl Engine {
    /// Opens the store at `path`, creating and formatting it when the file is new or empty.
    pub fn open(path: &Path, config: &EngineConfig) -> Result<Self> {
        config.validate().map_err(Error::InvalidConfig)?;
        let is_new = std::fs::metadata(path).map(|m| m.is_file() && m.len() == 0).unwrap_or(true);
        if is_new && config.size_bytes.is_none() {
            return Err(Error::InvalidConfig(format!("{} does not exist; give a size to create it", path.display())));
        }
        if is_new {
            return Self::create_at(path, config);
        }
        let options = FileDeviceOptions { create: false, size_bytes: None, direct_io: config.direct_io };
        let device = FileDevice::open(path, &options).map_err(|source| Error::Io { op: "open", offset_bytes: 0, source })?;
        match Self::open_device(Arc::new(device), config) {
            Err(Error::NotAKuraStore { .. }) => Err(Error::NotAKuraStore { path: path.display().to_string() }),
            other => other,
        }
    }

    /// Creates the store at `path` whole or not at all: it is formatted under a name of its
    /// own ([`creating_path`], locked as every open store is) and renamed into place once
    /// durable. A process killed while it created a store used to leave a file of the full
    /// size with no superblock yet, which the next open refused as not a store; now it leaves
    /// only that other file, which the next creation starts again from.
    fn create_at(path: &Path, config: &EngineConfig) -> Result<Self> {
        let io = |op: &'static str| move |source: std::io::Error| Error::Io { op, offset_bytes: 0, source };
        let creating = creating_path(path);
        remove_if_abandoned(&creating).map_err(io("remove an unfinished creation"))?;
        let options = FileDeviceOptions { create: true, size_bytes: config.size_bytes, direct_io: config.direct_io };
        let device = FileDevice::open(&creating, &options).map_err(io("create"))?;
        let engine = Self::create(Arc::new(device), config)?;
        std::fs::rename(&creating, path).map_err(io("rename the new store into place"))?;
        sync_parent_dir(path).map_err(io("sync the store's directory"))?;
        Ok(engine)
    }

    /// Formats `device` as a new, empty store (whatever it held is forgotten).
    pub fn create(device: Arc<dyn Device>, config: &EngineConfig) -> Result<Self> {
        config.validate().map_err(Error::InvalidConfig)?;
        let sb = layout(device.len_bytes(), config)?;
        // The journal ring is rewritten at every sync: its first lap must not pay for
        // file-system metadata (see `Device::materialize`). Made durable by the sync below.
        let journal_bytes = sb.blocks_offset_bytes - sb.journal_offset_bytes;
        device.materialize(sb.journal_offset_bytes, journal_bytes).map_err(|source| Error::Io { op: "format journal", offset_bytes: sb.journal_offset_bytes, source })?;
        let mut page = AlignedBuf::zeroed(META_PAGE_SIZE_BYTES as usize);
        for offset in CHECKPOINT_OFFSETS_BYTES {
            device.write_at(offset, &page).map_err(|source| Error::Io { op: "format", offset_bytes: offset, source })?;
        }
        sb.encode(&mut page);
        for offset in SUPERBLOCK_OFFSETS_BYTES {
            device.write_at(offset, &page).map_err(|source| Error::Io { op: "format", offset_bytes: offset, source })?;
        }
        device.sync().map_err(|source| Error::Io { op: "format sync", offset_bytes: 0, source })?;
        tracing::info!(blocks = sb.block_count, partitions = sb.partitions, block_size_bytes = sb.block_size_bytes, mode = ?sb.mode, "formatted a new kura store");
        Self::open_device(device, config)
    }

    /// Opens an existing store on `device`.
    pub fn open_device(device: Arc<dyn Device>, config: &EngineConfig) -> Result<Self> {
        let started = Instant::now();
        let sb = read_superblock(device.as_ref())?;
        if let Some(mode) = config.mode
            && mode != sb.mode
        {
            return Err(Error::InvalidConfig(format!("the store was formatted in {:?} mode, not {:?}", sb.mode, mode)));
        }
        let geo = BlockGeometry {
            store_id: sb.store_id,
            page_size: sb.page_size_bytes as usize,
            sector: device.alignment_bytes().max(512) as usize,
            block_size: sb.block_size_bytes as usize,
            index_bits_per_key: sb.index_bits_per_key,
            fingerprint_bits: sb.fingerprint_bits,
        };
        if geo.sector > geo.page_size {
            return Err(Error::InvalidConfig(format!("device sector {} exceeds the page size", geo.sector)));
        }
        let checkpoint = read_checkpoint(device.as_ref(), &sb);
        let inner = Arc::new(Inner::new(device, sb, geo, config, checkpoint));
        // Recovery seals (if replay fills a buffer) run inline: the sealers start afterwards.
        let blocks = inner.load_blocks()?;
        let replayed = inner.replay_journal()?;
        let threads = spawn_sealers(&inner, config.seal_threads)?;
        // Like the sealers, the collector is a background thread: none when sealing is inline.
        let collector = if config.seal_threads > 0 && inner.sb.mode == Mode::Store { Some(spawn_collector(&inner)?) } else { None };
        let owner = Arc::new(Owner { threads, collector, inner: Arc::clone(&inner) });
        tracing::info!(blocks, replayed, elapsed_ms = started.elapsed().as_millis() as u64, "opened kura store");
        Ok(Self { inner, _owner: owner })
    }

    pub fn superblock(&self) -> &Superblock {
        &self.inner.sb
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// Reads `key`'s live value.
    pub fn get(&self, key: &[u8]) -> Result<Option<Item>> {
        self.inner.get(key)
    }

    /// Starts a lookup without doing I/O: the answer, or the first read it needs.
    pub fn get_start(&self, key: &[u8]) -> Result<(GetPlan, GetStep)> {
        self.inner.get_start(key)
    }

    /// Continues a lookup with the bytes of the read it asked for.
    pub fn get_continue(&self, plan: &mut GetPlan, buf: AlignedBuf) -> Result<GetStep> {
        self.inner.advance(plan, buf)
    }

    /// [`Engine::get_continue`] with, beside the bytes of the read the lookup asked for, those
    /// of its [`GetPlan::companion_read`] (read at the same time); the lookup uses them if it
    /// gets that far instead of asking for the read again.
    pub fn get_continue_with(&self, plan: &mut GetPlan, buf: AlignedBuf, companion: AlignedBuf) -> Result<GetStep> {
        self.inner.counters.flash_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.counters.flash_read_bytes.fetch_add(companion.len() as u64, Ordering::Relaxed);
        plan.prefetched = plan.companion_read().map(|(offset, _)| (offset, companion));
        self.inner.advance(plan, buf)
    }

    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        match self.write(key, value, RecordKind::Put, Condition::Always)? {
            WriteOutcome::Written { version } => Ok(version),
            WriteOutcome::ConditionFailed { .. } => unreachable!("unconditional write"),
        }
    }

    /// Deletes `key` (writes a tombstone; whether it existed is not checked).
    pub fn delete(&self, key: &[u8]) -> Result<()> {
        self.write(key, &[], RecordKind::Tombstone, Condition::Always).map(|_| ())
    }

    /// Writes (or, with `RecordKind::Tombstone`, deletes) when `condition` holds.
    pub fn write(&self, key: &[u8], value: &[u8], kind: RecordKind, condition: Condition) -> Result<WriteOutcome> {
        self.inner.write(key, value, kind, condition)
    }

    /// Makes every write acknowledged before this call durable.
    pub fn sync(&self) -> Result<()> {
        self.inner.sync()
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Every live block's Bloom filter, re-read from the summaries on flash (for the index
    /// benchmark; the engine itself keeps only the bit-sliced map in RAM).
    pub fn block_filters(&self) -> Result<Vec<(u32, BloomFilter)>> {
        let live: Vec<Arc<BlockIndex>> = self.inner.slots.lock().live.values().cloned().collect();
        let mut out = Vec::new();
        for block in live {
            if let Some((_, filter)) = self.inner.read_block_summary(block.slot)? {
                out.push((block.slot, filter));
            }
        }
        Ok(out)
    }

    /// Visits the newest record of every key that is not deleted, until `visit` returns
    /// false; returns how many it visited. Partition by partition: the records in the write
    /// buffers first, then each sealed block, read whole once (memory: one block and its
    /// records at a time), whose records are checked for newer versions as garbage
    /// collection checks them. Not a snapshot (as memcached's LRU crawler is not): a key
    /// written or deleted during the scan may be visited with its old or its new value, or
    /// not at all, and one that garbage collection moves or eviction drops meanwhile may be
    /// missed; every other key is visited exactly once.
    pub fn scan(&self, visit: &mut dyn FnMut(ScanRecord<'_>) -> bool) -> Result<u64> {
        self.inner.scan(visit)
    }

    /// The candidate blocks the Bloom Filter Map gives for `key` (in-memory, for benchmarks).
    pub fn bfm_candidates(&self, key: &[u8], out: &mut Vec<u32>) {
        let hash = KeyHash::of(key);
        let p = hash.partition(self.inner.sb.partitions) as usize;
        self.inner.partitions[p].state.read().bfm.candidates(&hash, out);
    }

    /// Syncs and closes this handle (other clones stay open). Dropping the last handle also
    /// syncs, but can only log a failure.
    pub fn close(self) -> Result<()> {
        self.inner.sync()
    }

    /// The I/O seam's alignment, for callers issuing their own reads.
    pub fn read_alignment_bytes(&self) -> usize {
        self.inner.geo.sector
    }
}

/// Starts `count` threads that seal frozen write buffers; 0 keeps sealing on writer threads.
fn spawn_sealers(inner: &Arc<Inner>, count: usize) -> Result<Vec<std::thread::JoinHandle<()>>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let (tx, rx) = std::sync::mpsc::channel::<SealMsg>();
    let rx = Arc::new(StdMutex::new(rx));
    let mut threads = Vec::with_capacity(count);
    for i in 0..count {
        let (inner, rx) = (Arc::clone(inner), Arc::clone(&rx));
        let thread = std::thread::Builder::new().name(format!("kura-seal-{i}")).spawn(move || {
            loop {
                let msg = rx.lock().expect("seal queue poisoned").recv();
                match msg {
                    Ok(SealMsg::Seal { partition, slot, frozen, ticket }) => inner.finish_seal(partition, slot, frozen, ticket),
                    Ok(SealMsg::Stop) | Err(_) => return,
                }
            }
        });
        threads.push(thread.map_err(|source| Error::Io { op: "spawn sealer thread", offset_bytes: 0, source })?);
    }
    *inner.seal_tx.lock() = Some(tx);
    Ok(threads)
}

/// Starts the store-mode collector: it keeps `gc_background_free_slots` slots free ahead of the
/// writers, so that a seal seldom has to collect garbage first.
fn spawn_collector(inner: &Arc<Inner>) -> Result<std::thread::JoinHandle<()>> {
    let inner = Arc::clone(inner);
    std::thread::Builder::new()
        .name("kura-gc".into())
        .spawn(move || {
            loop {
                {
                    let (lock, wake) = &inner.gc_signal;
                    let mut signal = lock.lock().expect("gc signal poisoned");
                    if !signal.wake && !signal.stop {
                        signal = wake.wait_timeout(signal, std::time::Duration::from_millis(GC_BACKGROUND_POLL_MS)).expect("gc signal poisoned").0;
                    }
                    if signal.stop {
                        return;
                    }
                    signal.wake = false;
                }
                if inner.failed.load(Ordering::Acquire) {
                    continue;
                }
                let target = inner.gc_background_free_slots();
                while inner.slots.lock().free.len() <= target && !inner.gc_signal.0.lock().expect("gc signal poisoned").stop {
                    let runs_before = inner.counters.gc_runs.load(Ordering::Relaxed);
                    let result = inner.collect_garbage(target);
                    let runs = inner.counters.gc_runs.load(Ordering::Relaxed) - runs_before;
                    inner.counters.gc_background_runs.fetch_add(runs, Ordering::Relaxed);
                    match result {
                        Ok(true) => {}
                        // Nothing worth collecting now: wait for more writes.
                        Ok(false) => break,
                        Err(error) => {
                            // A writer that needs the space runs the collection itself and gets the error.
                            tracing::warn!(%error, "background garbage collection failed");
                            break;
                        }
                    }
                }
            }
        })
        .map_err(|source| Error::Io { op: "spawn collector thread", offset_bytes: 0, source })
}

/// Computes the geometry of a new store on a device of `device_bytes`.
fn layout(device_bytes: u64, config: &EngineConfig) -> Result<Superblock> {
    let page = u64::from(config.page_size_bytes);
    let block = u64::from(config.block_size_bytes);
    let journal_offset = META_REGION_BYTES.next_multiple_of(page);
    let estimate_blocks = (device_bytes.saturating_sub(journal_offset) / block) as u32;
    let partitions = config.partitions_for(estimate_blocks);
    let journal_pages = if config.journal_logical_pages != 0 {
        config.journal_logical_pages
    } else {
        (2 * u64::from(partitions) * (block / page) + 64).min(u64::from(u32::MAX)) as u32
    };
    let blocks_offset = (journal_offset + 2 * u64::from(journal_pages) * page).next_multiple_of(BLOCK_REGION_ALIGNMENT_BYTES.max(page));
    let block_count = (device_bytes.saturating_sub(blocks_offset) / block) as u32;
    let (fingerprint_bits, index_bits_per_key) = config.index_bits_for(block_count, partitions);
    let needed = 2 * partitions + 2 + GC_RESERVE_SLOTS as u32;
    if block_count < needed {
        return Err(Error::InvalidConfig(format!(
            "{device_bytes} bytes hold only {block_count} blocks of {block} bytes after a {} byte journal; {partitions} partitions need at least {needed}",
            blocks_offset
        )));
    }
    let sb = Superblock {
        store_id: random_u64(),
        created_unix_s: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        device_size_bytes: device_bytes,
        page_size_bytes: config.page_size_bytes,
        block_size_bytes: config.block_size_bytes,
        block_count,
        partitions,
        journal_offset_bytes: journal_offset,
        journal_logical_pages: journal_pages,
        blocks_offset_bytes: blocks_offset,
        mode: config.mode.unwrap_or(Mode::Cache),
        index_bits_per_key,
        fingerprint_bits,
    };
    sb.validate().map_err(|e| Error::InvalidConfig(e.to_string()))?;
    Ok(sb)
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `len` bytes into the valid buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(bytes);
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// Where a store at `path` is formatted before it is renamed into place (`NAME.creating`).
pub fn creating_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".creating");
    path.with_file_name(name)
}

/// Removes a store creation's file that no process holds (its creator was killed): nothing
/// in it was ever acknowledged. One that is held is left to the open, which waits for it.
fn remove_if_abandoned(creating: &Path) -> std::io::Result<()> {
    let file = match std::fs::File::open(creating) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        std::fs::remove_file(creating)?;
    }
    Ok(())
}

/// Makes a rename in `path`'s directory durable.
fn sync_parent_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

fn read_superblock(device: &dyn Device) -> Result<Superblock> {
    let mut region = AlignedBuf::zeroed(2 * META_PAGE_SIZE_BYTES as usize);
    if device.len_bytes() < META_REGION_BYTES {
        return Err(Error::NotAKuraStore { path: String::new() });
    }
    device.read_at(0, &mut region).map_err(|source| Error::Io { op: "read superblock", offset_bytes: 0, source })?;
    let mut last_error = None;
    for offset in SUPERBLOCK_OFFSETS_BYTES {
        let page = &region[offset as usize..offset as usize + META_PAGE_SIZE_BYTES as usize];
        match Superblock::decode(page) {
            Ok(sb) if sb.device_size_bytes <= device.len_bytes() => return Ok(sb),
            Ok(sb) => {
                return Err(Error::Corrupt {
                    what: "superblock (device smaller than the store)",
                    offset_bytes: offset,
                    source: FormatError::OutOfRange { field: "device_size_bytes", value: sb.device_size_bytes },
                });
            }
            Err(e) => last_error = Some((offset, e)),
        }
    }
    match last_error {
        Some((offset, e @ (FormatError::BadChecksum | FormatError::UnsupportedVersion(_) | FormatError::OutOfRange { .. }))) => {
            Err(Error::Corrupt { what: "superblock", offset_bytes: offset, source: e })
        }
        _ => Err(Error::NotAKuraStore { path: String::new() }),
    }
}

fn read_checkpoint(device: &dyn Device, sb: &Superblock) -> Checkpoint {
    let mut best = Checkpoint { seq: 0, confirmed_block_seq: 0, watermarks: vec![0; sb.partitions as usize] };
    for offset in CHECKPOINT_OFFSETS_BYTES {
        let mut page = AlignedBuf::zeroed(META_PAGE_SIZE_BYTES as usize);
        if device.read_at(offset, &mut page).is_err() {
            continue;
        }
        if let Ok(cp) = Checkpoint::decode(&page, sb.store_id)
            && cp.seq > best.seq
            && cp.watermarks.len() == sb.partitions as usize
        {
            best = cp;
        }
    }
    best
}

impl Inner {
    fn new(device: Arc<dyn Device>, sb: Superblock, geo: BlockGeometry, config: &EngineConfig, checkpoint: Checkpoint) -> Self {
        let partitions = (0..sb.partitions)
            .map(|_| Partition {
                last_footer_ticket: AtomicU64::new(0),
                state: RwLock::new(PartitionState {
                    active: WriteBuffer::new(&geo),
                    sealing: None,
                    blocks: BlockTable::new(),
                    bfm: BloomFilterMap::new(),
                    journal_first_active: None,
                    journal_first_sealing: None,
                }),
            })
            .collect();
        Self {
            journal: Mutex::new(JournalState { writer: JournalWriter::new(&sb, 0, 0) }),
            slots: Mutex::new(Slots { free: Vec::new(), by_age: BTreeSet::new(), live: HashMap::new() }),
            device,
            geo,
            key_size_max: config.key_size_max,
            value_size_max_bytes: config.value_size_max_bytes,
            partitions,
            last_version: AtomicU64::new(0),
            last_block_seq: AtomicU64::new(0),
            checkpoint: Mutex::new(CheckpointState {
                seq: checkpoint.seq,
                confirmed: checkpoint.watermarks.clone(),
                written: checkpoint.watermarks.clone(),
                durable: checkpoint.watermarks,
                written_ticket: None,
                confirmed_block_seq: checkpoint.confirmed_block_seq,
                written_block_seq: checkpoint.confirmed_block_seq,
            }),
            unconfirmed_seqs: Mutex::new(BTreeSet::new()),
            seals_since_confirm: AtomicU64::new(0),
            sync_started: AtomicU64::new(0),
            sync_completed: AtomicU64::new(0),
            sync_lock: Mutex::new(()),
            unconfirmed: Mutex::new(Vec::new()),
            gc_lock: Mutex::new(GcScratch { victim: None, reads: BatchReads::new(), digests: DigestCache::default() }),
            gc_signal: (StdMutex::new(GcSignal::default()), StdCondvar::new()),
            stripes: (0..WRITE_STRIPES).map(|_| Mutex::new(())).collect(),
            seals: Seals { state: StdMutex::new((0, BTreeSet::new())), done: StdCondvar::new() },
            counters: Counters::default(),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            images: Mutex::new(Vec::new()),
            spare_arenas: Mutex::new(Vec::new()),
            seal_tx: Mutex::new(None),
            sb,
        }
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::KeyEmpty);
        }
        if key.len() > self.key_size_max {
            return Err(Error::KeyTooLong { len: key.len(), max: self.key_size_max });
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        if self.failed.load(Ordering::Acquire) {
            let why = self.failure.lock().clone().unwrap_or_default();
            return Err(Error::Failed(why));
        }
        Ok(())
    }

    /// Stops accepting writes after an I/O failure on the write path: what was acknowledged
    /// stays readable, and a restart recovers from the last durable state.
    fn fail(&self, error: &Error) {
        tracing::error!(%error, "write path failed; the engine now refuses writes");
        self.failure.lock().get_or_insert_with(|| error.to_string());
        self.failed.store(true, Ordering::Release);
        self.seals.done.notify_all();
    }

    fn io<T>(&self, op: &'static str, offset_bytes: u64, result: std::io::Result<T>) -> Result<T> {
        result.map_err(|source| Error::Io { op, offset_bytes, source })
    }

    // ---- reads ----

    fn get(&self, key: &[u8]) -> Result<Option<Item>> {
        let (mut plan, mut step) = self.get_start(key)?;
        loop {
            match step {
                GetStep::Done(item) => return Ok(item),
                GetStep::Read { offset_bytes, len_bytes } => {
                    let mut buf = AlignedBuf::zeroed(len_bytes);
                    self.io("read", offset_bytes, self.device.read_at(offset_bytes, &mut buf))?;
                    step = self.advance(&mut plan, buf)?;
                }
            }
        }
    }

    fn get_start(&self, key: &[u8]) -> Result<(GetPlan, GetStep)> {
        self.check_key(key)?;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let mut plan = GetPlan { key: PlanKey::from_slice(key), hash: KeyHash::of(key), view: None, candidates: PlanCandidates::new(), next_block: 0, spans: PlanSpans::new(), next_span: 0, restarts: 0, prefetched: None };
        let step = self.plan(&mut plan);
        Ok((plan, step))
    }

    /// Looks in the write buffers, then asks the Bloom Filter Map for candidate blocks.
    fn plan(&self, plan: &mut GetPlan) -> GetStep {
        plan.view = None;
        plan.prefetched = None;
        plan.candidates.clear();
        plan.spans.clear();
        (plan.next_block, plan.next_span) = (0, 0);
        let p = plan.hash.partition(self.sb.partitions) as usize;
        let state = self.partitions[p].state.read();
        let buffers = std::iter::once(&state.active).chain(state.sealing.as_deref());
        for buffer in buffers {
            if let Some(found) = buffer.get(&plan.hash, &plan.key) {
                self.counters.get_hits_ram.fetch_add(1, Ordering::Relaxed);
                return GetStep::Done((found.kind == RecordKind::Put).then(|| Item { version: found.version, value: ValueBytes::Owned(found.value.to_vec()) }));
            }
        }
        state.bfm.candidates(&plan.hash, &mut plan.candidates);
        let view = Arc::clone(&state.blocks.view);
        drop(state);
        plan.candidates.retain(|id| view.get(*id as usize).is_some_and(Option::is_some));
        plan.candidates.sort_unstable_by_key(|&id| std::cmp::Reverse(Self::view_block(&view, id).order_key()));
        // Most candidates are ruled out by their page index alone, each after a few dependent
        // cache misses: start them for every candidate at once, one level at a time.
        for stage in 0..3 {
            for &id in plan.candidates.iter().take(PREFETCH_CANDIDATES_MAX) {
                Self::view_block(&view, id).prefetch_locate(&plan.hash, stage);
            }
        }
        plan.view = Some(view);
        self.next_read(plan)
    }

    /// A block of a view, by an id the view holds (checked when the lookup was planned).
    fn view_block(view: &BlockView, id: u32) -> &BlockIndex {
        view[id as usize].as_deref().expect("a planned candidate is in its view")
    }

    /// The next read to try: the current block's next span, else the next candidate block's.
    fn next_read(&self, plan: &mut GetPlan) -> GetStep {
        while plan.next_span == plan.spans.len() {
            let Some(&id) = plan.candidates.get(plan.next_block) else { return GetStep::Done(None) };
            let view = plan.view.as_ref().expect("candidates come with the view they index");
            plan.next_block += 1;
            plan.spans.clear();
            plan.next_span = 0;
            Self::view_block(view, id).locate(&plan.hash, &mut plan.spans);
        }
        let span = plan.spans[plan.next_span];
        GetStep::Read { offset_bytes: span.offset_bytes, len_bytes: span.len_bytes as usize }
    }

    fn advance(&self, plan: &mut GetPlan, buf: AlignedBuf) -> Result<GetStep> {
        self.advance_counted(plan, buf, true)
    }

    /// `count`: whether `buf` is a read not yet counted (a companion read was counted when
    /// it was handed over).
    fn advance_counted(&self, plan: &mut GetPlan, buf: AlignedBuf, count: bool) -> Result<GetStep> {
        let span = *plan.spans.get(plan.next_span).expect("get_continue called after Done");
        let view = plan.view.as_ref().expect("get_continue called after Done");
        let block = Self::view_block(view, plan.candidates[plan.next_block - 1]);
        let (block_seq, retired) = (block.block_seq, block.retired.load(Ordering::Acquire));
        if count {
            self.counters.flash_reads.fetch_add(1, Ordering::Relaxed);
            self.counters.flash_read_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        assert_eq!(buf.len(), span.len_bytes as usize, "read length differs from the span asked for");
        match block::find_in_span(&span, &buf, self.sb.store_id, block_seq, &plan.key) {
            Ok(SpanLookup::Found { version, kind, value_start, value_len }) => {
                let item = (kind == RecordKind::Put).then_some(Item { version, value: ValueBytes::Read { buf, start: value_start, len: value_len } });
                Ok(GetStep::Done(item))
            }
            Ok(SpanLookup::NotHere) => {
                plan.next_span += 1;
                let step = self.next_read(plan);
                // The caller already read the next page: go on with it.
                if let (GetStep::Read { offset_bytes, .. }, Some((offset, buf))) = (&step, plan.prefetched.take())
                    && *offset_bytes == offset
                {
                    return self.advance_counted(plan, buf, false);
                }
                Ok(step)
            }
            Err(SpanError::Stale) => self.restart(plan),
            Err(SpanError::Corrupt(_)) if retired => self.restart(plan),
            Err(SpanError::Corrupt(source)) => Err(Error::Corrupt { what: "block page", offset_bytes: span.offset_bytes, source }),
        }
    }

    fn restart(&self, plan: &mut GetPlan) -> Result<GetStep> {
        plan.restarts += 1;
        if plan.restarts > GET_RESTARTS_MAX {
            return Err(Error::Corrupt { what: "block slot keeps changing under a lookup", offset_bytes: 0, source: FormatError::BadMagic });
        }
        Ok(self.plan(plan))
    }

    /// Whether a sealed block searched before `above` holds the key (any version, hence a newer
    /// one). Write buffers do not count: their records are not durable until sealed, and a GC
    /// that dropped a record for one would lose both versions in a crash.
    /// The pages of blocks newer than `above` that may hold a version of the key with `hash`.
    fn newer_spans(&self, p: usize, hash: &KeyHash, above: (u64, u64)) -> Vec<(Arc<BlockIndex>, Span)> {
        let state = self.partitions[p].state.read();
        let mut ids = Vec::new();
        state.bfm.candidates(hash, &mut ids);
        let (mut spans, mut found) = (Vec::new(), Vec::new());
        for id in ids {
            if let Some((b, _)) = state.blocks.get(id).filter(|(b, _)| b.order_key() > above) {
                b.locate(hash, &mut found);
                spans.extend(found.drain(..).map(|s| (Arc::clone(b), s)));
            }
        }
        spans
    }

    /// For each record of a block being collected, whether a newer sealed block holds a version
    /// of its key: decided from the newer blocks' key digests where they list it, otherwise by
    /// reading the candidate pages, together through an io_uring queue, in batches of
    /// `GC_LIVENESS_READS_BATCH`.
    fn newer_versions_sealed(&self, io: &mut BatchReads, digests: &mut DigestCache, p: usize, records: &[OwnedRecord], above: (u64, u64)) -> Result<Vec<bool>> {
        let mut newer = vec![false; records.len()];
        self.load_newer_digests(io, digests, p, above)?;
        let mut reads: Vec<(usize, Arc<BlockIndex>, Span)> = Vec::new();
        let mut check = |reads: &mut Vec<(usize, Arc<BlockIndex>, Span)>, newer: &mut [bool]| -> Result<()> {
            let mut outcome: Result<()> = Ok(());
            self.read_batch(io, reads.iter().enumerate().map(|(token, (_, _, span))| (span.offset_bytes, span.len_bytes as usize, token as u64)), |token, result| {
                let (record, block, span) = &reads[token as usize];
                let buf = self.io("gc liveness read", span.offset_bytes, result)?;
                self.counters.flash_reads.fetch_add(1, Ordering::Relaxed);
                self.counters.gc_liveness_reads.fetch_add(1, Ordering::Relaxed);
                match block::find_in_span(span, buf, self.sb.store_id, block.block_seq, &records[*record].key) {
                    Ok(SpanLookup::Found { .. }) => newer[*record] = true,
                    Ok(SpanLookup::NotHere) | Err(SpanError::Stale) => {}
                    Err(SpanError::Corrupt(source)) => {
                        if outcome.is_ok() {
                            outcome = Err(Error::Corrupt { what: "block page", offset_bytes: span.offset_bytes, source });
                        }
                    }
                }
                Ok(())
            })?;
            reads.clear();
            outcome
        };
        let mut batch_bytes = 0u64;
        for (i, record) in records.iter().enumerate() {
            let spans = self.newer_spans(p, &record.hash, above);
            // A newer block whose digests list the key holds a version of it: no read needed.
            let digest = crate::hash::key_digest(self.sb.store_id, &record.key);
            if spans.iter().any(|(b, _)| digests.lists(b, &record.hash, digest) == Some(true)) {
                newer[i] = true;
                self.counters.gc_digest_hits.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            for (b, span) in spans {
                batch_bytes += u64::from(span.len_bytes);
                reads.push((i, b, span));
            }
            if reads.len() >= GC_LIVENESS_READS_BATCH || batch_bytes >= GC_LIVENESS_READ_BYTES_MAX {
                check(&mut reads, &mut newer)?;
                batch_bytes = 0;
            }
        }
        check(&mut reads, &mut newer)?;
        Ok(newer)
    }

    // ---- writes ----

    fn write(&self, key: &[u8], value: &[u8], kind: RecordKind, condition: Condition) -> Result<WriteOutcome> {
        self.check_key(key)?;
        if value.len() > self.value_size_max_bytes {
            return Err(Error::ValueTooLarge { len: value.len(), max: self.value_size_max_bytes });
        }
        self.check_writable()?;
        let hash = KeyHash::of(key);
        let _stripe = self.stripes[(hash.bloom as usize) % WRITE_STRIPES].lock();
        if condition != Condition::Always {
            let current = self.get(key)?.map(|item| item.version);
            let holds = match condition {
                Condition::Always => true,
                Condition::IfAbsent => current.is_none(),
                Condition::IfPresent => current.is_some(),
                Condition::IfVersion(v) => current == Some(v),
            };
            if !holds {
                return Ok(WriteOutcome::ConditionFailed { current });
            }
        }
        let version = self.insert(&hash, key, value, kind, None)?;
        match kind {
            RecordKind::Put => self.counters.puts.fetch_add(1, Ordering::Relaxed),
            RecordKind::Tombstone => self.counters.deletes.fetch_add(1, Ordering::Relaxed),
        };
        Ok(WriteOutcome::Written { version })
    }

    /// Puts a record into its partition's buffer, sealing the buffer when it is full.
    /// `version` is given when replaying the journal.
    fn insert(&self, hash: &KeyHash, key: &[u8], value: &[u8], kind: RecordKind, version: Option<u64>) -> Result<u64> {
        let p = hash.partition(self.sb.partitions) as usize;
        loop {
            {
                let mut state = self.partitions[p].state.write();
                let was_empty = state.active.is_empty();
                let assign = || version.unwrap_or_else(|| self.last_version.fetch_add(1, Ordering::AcqRel) + 1);
                match state.active.insert(hash, key, value, kind, assign) {
                    Ok(v) => return Ok(v),
                    Err(BufferFull) if was_empty => {
                        return Err(Error::ValueTooLarge { len: value.len(), max: self.geo.block_size / 4 });
                    }
                    Err(BufferFull) => {}
                }
            }
            self.seal_partition(p)?;
            self.check_writable()?;
        }
    }

    /// Seals partition `p`'s buffer into a block (or waits for a seal already running).
    fn seal_partition(&self, p: usize) -> Result<()> {
        self.seal_partition_for(p, SlotPurpose::Seal)
    }

    fn seal_partition_for(&self, p: usize, purpose: SlotPurpose) -> Result<()> {
        if self.partitions[p].state.read().sealing.is_some() {
            return self.wait_for_partition_seal(p);
        }
        let slot = self.reserve_slot(purpose)?;
        // The seal is registered before it freezes the buffer: a sync that could miss the
        // buffer's records (they leave the active buffer here) waits for their block instead.
        let ticket = self.seals.begin();
        let frozen = {
            let mut state = self.partitions[p].state.write();
            if state.sealing.is_some() || state.active.is_empty() {
                drop(state);
                self.slots.lock().free.push(slot);
                self.seals.end(ticket);
                return Ok(());
            }
            let fresh = WriteBuffer::with_arena(&self.geo, self.spare_arenas.lock().pop().unwrap_or_default());
            let frozen = Arc::new(std::mem::replace(&mut state.active, fresh));
            state.sealing = Some(Arc::clone(&frozen));
            state.journal_first_sealing = state.journal_first_active.take();
            frozen
        };
        let sender = self.seal_tx.lock().clone();
        match sender {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(SealMsg::Seal { partition, slot, frozen, ticket })) = tx.send(SealMsg::Seal { partition: p, slot, frozen, ticket }) {
                    self.finish_seal(partition, slot, frozen, ticket);
                }
                Ok(())
            }
            None => {
                self.finish_seal(p, slot, frozen, ticket);
                self.check_writable()
            }
        }
    }

    /// Writes a frozen buffer as a block and publishes it (on a sealer thread, or inline).
    fn finish_seal(&self, p: usize, slot: u32, frozen: Arc<WriteBuffer>, ticket: u64) {
        match self.seal_buffer(p, slot, &frozen) {
            Ok(()) => {
                let done = {
                    let mut state = self.partitions[p].state.write();
                    state.journal_first_sealing = None;
                    state.sealing.take()
                };
                // Wake writers waiting for this partition (they check under the seal lock).
                drop(self.seals.state.lock().expect("seal lock poisoned"));
                self.seals.done.notify_all();
                drop(frozen);
                // Nobody else holds the frozen buffer once it left the partition: reuse its arena.
                if let Some(arena) = done.and_then(|b| Arc::try_unwrap(b).ok()).map(WriteBuffer::into_arena) {
                    self.spare_arenas.lock().push(arena);
                }
                // The confirmation round's sync runs after the partition can seal again, so a
                // writer that filled its next buffer meanwhile does not wait for it.
                if let Err(error) = self.confirm_round_if_due() {
                    self.fail(&error);
                }
            }
            Err(error) => {
                self.slots.lock().free.push(slot);
                self.fail(&error);
            }
        }
        self.seals.end(ticket);
    }

    fn wait_for_partition_seal(&self, p: usize) -> Result<()> {
        let mut guard = self.seals.state.lock().expect("seal lock poisoned");
        while self.partitions[p].state.read().sealing.is_some() && !self.failed.load(Ordering::Acquire) {
            guard = self.seals.done.wait_timeout(guard, std::time::Duration::from_millis(50)).expect("seal lock poisoned").0;
        }
        drop(guard);
        self.check_writable()
    }

    /// Writes a frozen buffer as a block, made durable by a later device sync (see
    /// `confirm_footers`).
    fn seal_buffer(&self, p: usize, slot: u32, frozen: &WriteBuffer) -> Result<()> {
        let records = frozen.sorted_records();
        assert_eq!(block::records_fitting(&self.geo, &records), records.len(), "a write buffer outgrew its block");
        let (index, filter, samples, ticket) = self.write_block(p, slot, BlockKind::Normal, &records)?;
        self.estimate_dead(p, &samples, index.order_key());
        let journal_first = self.partitions[p].state.read().journal_first_sealing;
        self.unconfirmed.lock().push(Unconfirmed { ticket, block_seq: index.block_seq, partition: p, watermark: frozen.max_version(), journal_first });
        self.publish(p, index, &filter);
        self.counters.seals.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Builds and writes one block (data and summary, then its footer) without waiting for it
    /// to be durable. Returns the block's index and the sync ticket after which it is: until
    /// then the block is unconfirmed, and if a crash comes first, open verifies its pages.
    fn write_block(&self, p: usize, slot: u32, kind: BlockKind, records: &[RecordRef<'_>]) -> Result<(BlockIndex, BloomFilter, block::DeadSamples, u64)> {
        let chained = kind == BlockKind::Normal;
        let offset = self.sb.block_offset_bytes(slot);
        let block_seq = {
            let mut seqs = self.unconfirmed_seqs.lock();
            let seq = self.last_block_seq.fetch_add(1, Ordering::AcqRel) + 1;
            seqs.insert(seq);
            seq
        };
        let spec = BuildSpec { slot, device_offset_bytes: offset, block_seq, partition: p as u32, kind };
        let mut image = self.images.lock().pop().unwrap_or_else(|| AlignedBuf::zeroed_huge(self.geo.block_size));
        let built = block::build(&self.geo, &spec, records, &mut image);
        if chained && self.sync_completed.load(Ordering::SeqCst) <= self.partitions[p].last_footer_ticket.load(Ordering::Acquire) {
            self.device_sync("partition order sync")?;
        }
        let footer_at = self.geo.footer_offset();
        let gap = footer_at - built.write_len;
        let write = if gap <= FOOTER_WRITE_GAP_BYTES_MAX {
            // One write for data, summary and footer: nothing orders them (open verifies blocks
            // sealed since the last confirmation), and one large I/O beats a small one queued
            // behind other seals.
            image[built.write_len..footer_at].fill(0);
            image[footer_at..].copy_from_slice(&block::footer_page(&self.geo, &built.footer));
            self.device.write_at(offset, &image)
        } else {
            self.device.write_at(offset, &image[..built.write_len]).and_then(|()| self.device.write_at(offset + footer_at as u64, &block::footer_page(&self.geo, &built.footer)))
        };
        self.images.lock().push(image);
        self.io("block write", offset, write)?;
        let ticket = self.sync_started.load(Ordering::SeqCst);
        if chained {
            self.partitions[p].last_footer_ticket.store(ticket, Ordering::Release);
        }
        self.counters.flash_writes.fetch_add(2, Ordering::Relaxed);
        self.counters.flash_write_bytes.fetch_add((built.write_len + self.geo.page_size) as u64, Ordering::Relaxed);
        Ok((built.index, built.filter, built.samples, ticket))
    }

    /// Every few seals, one device sync makes the recent blocks durable and a checkpoint
    /// records it.
    fn confirm_round_if_due(&self) -> Result<()> {
        if self.seals_since_confirm.fetch_add(1, Ordering::AcqRel) + 1 < CONFIRM_EVERY_SEALS {
            return Ok(());
        }
        self.seals_since_confirm.store(0, Ordering::Release);
        self.confirm_footers();
        self.write_checkpoint_if_stale()?;
        self.device_sync("confirmation sync")?;
        self.confirm_footers();
        Ok(())
    }

    /// Makes every write completed before this call durable: waits for a device sync that
    /// starts after now. Concurrent callers share one fdatasync (group commit).
    fn device_sync(&self, op: &'static str) -> Result<()> {
        let after = self.sync_started.load(Ordering::SeqCst);
        let _one_at_a_time = self.sync_lock.lock();
        if self.sync_completed.load(Ordering::SeqCst) > after {
            return Ok(());
        }
        let ticket = self.sync_started.fetch_add(1, Ordering::SeqCst) + 1;
        self.io(op, 0, self.device.sync())?;
        self.sync_completed.fetch_max(ticket, Ordering::SeqCst);
        self.counters.device_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Moves footers made durable by a completed sync into the confirmed watermarks (and
    /// unpins their journal pages); notes a written checkpoint as durable likewise.
    fn confirm_footers(&self) {
        let completed = self.sync_completed.load(Ordering::SeqCst);
        let done: Vec<Unconfirmed> = {
            let mut pending = self.unconfirmed.lock();
            let (done, keep) = std::mem::take(&mut *pending).into_iter().partition(|u| u.ticket < completed);
            *pending = keep;
            done
        };
        let confirmed_block_seq = {
            let mut seqs = self.unconfirmed_seqs.lock();
            for u in &done {
                seqs.remove(&u.block_seq);
            }
            seqs.first().map_or(self.last_block_seq.load(Ordering::Acquire), |first| first - 1)
        };
        let mut cp = self.checkpoint.lock();
        for u in done {
            cp.confirmed[u.partition] = cp.confirmed[u.partition].max(u.watermark);
        }
        cp.confirmed_block_seq = cp.confirmed_block_seq.max(confirmed_block_seq);
        if cp.written_ticket.is_some_and(|t| t < completed) {
            cp.durable = cp.written.clone();
        }
    }

    /// Writes a checkpoint of the confirmed watermarks if it would say something new; it is
    /// durable after the next device sync.
    fn write_checkpoint_if_stale(&self) -> Result<()> {
        let mut cp = self.checkpoint.lock();
        loop {
            if cp.confirmed == cp.written && cp.confirmed_block_seq == cp.written_block_seq {
                return Ok(());
            }
            // The two slots alternate: this write overwrites the checkpoint before the last
            // one, so the last one must be durable first, or a crash could leave neither.
            if cp.written_ticket.is_none_or(|t| t < self.sync_completed.load(Ordering::SeqCst)) {
                break;
            }
            drop(cp);
            self.device_sync("checkpoint order sync")?;
            cp = self.checkpoint.lock();
        }
        cp.seq += 1;
        let checkpoint = Checkpoint { seq: cp.seq, confirmed_block_seq: cp.confirmed_block_seq, watermarks: cp.confirmed.clone() };
        let mut page = AlignedBuf::zeroed(META_PAGE_SIZE_BYTES as usize);
        checkpoint.encode(self.sb.store_id, &mut page);
        let offset = CHECKPOINT_OFFSETS_BYTES[(cp.seq % 2) as usize];
        self.io("checkpoint write", offset, self.device.write_at(offset, &page))?;
        cp.written = checkpoint.watermarks;
        cp.written_block_seq = checkpoint.confirmed_block_seq;
        cp.written_ticket = Some(self.sync_started.load(Ordering::SeqCst));
        self.counters.flash_writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Makes sure a durable checkpoint covers `watermark` for partition `p` (before a block
    /// that carries it may be dropped, so the journal never replays what it held).
    fn make_watermark_durable(&self, p: usize, watermark: u64) -> Result<()> {
        loop {
            self.confirm_footers();
            let (durable, confirmed) = {
                let cp = self.checkpoint.lock();
                (cp.durable[p], cp.confirmed[p])
            };
            if durable >= watermark {
                return Ok(());
            }
            if confirmed >= watermark {
                self.write_checkpoint_if_stale()?;
            }
            self.device_sync("checkpoint sync")?;
        }
    }

    /// Checks a block's sampled keys against the blocks searched after it: one found there
    /// makes about `every` of that block's records dead. Feeds GC victim choice and the live
    /// key estimate; never used for correctness.
    fn estimate_dead(&self, p: usize, samples: &block::DeadSamples, newer_than: (u64, u64)) {
        let mut ids = Vec::new();
        let mut candidates: Vec<(usize, Arc<BlockIndex>)> = Vec::new();
        for batch in samples.hashes.chunks(DEAD_SAMPLES_PER_LOCK) {
            // Only the in-RAM map lookups hold the partition lock; page indexes are probed after.
            candidates.clear();
            {
                let state = self.partitions[p].state.read();
                for (i, hash) in batch.iter().enumerate() {
                    ids.clear();
                    state.bfm.candidates(hash, &mut ids);
                    let older = ids.iter().filter_map(|id| state.blocks.get(*id)).filter(|(b, _)| b.order_key() < newer_than);
                    candidates.extend(older.map(|(b, _)| (i, Arc::clone(b))));
                }
            }
            for (i, hash) in batch.iter().enumerate() {
                let newest_older = candidates.iter().filter(|(j, b)| *j == i && b.may_contain(hash)).map(|(_, b)| b).max_by_key(|b| b.order_key());
                if let Some(block) = newest_older {
                    block.dead_records_est.fetch_add(samples.every as u32, Ordering::Relaxed);
                }
            }
        }
    }

    fn publish(&self, p: usize, index: BlockIndex, filter: &BloomFilter) {
        let index = Arc::new(index);
        {
            let mut state = self.partitions[p].state.write();
            let id = state.blocks.next_id();
            let column = state.bfm.insert(id, filter);
            state.blocks.insert(id, (Arc::clone(&index), column));
        }
        let mut slots = self.slots.lock();
        slots.by_age.insert((index.max_version, index.block_seq, index.slot));
        slots.live.insert(index.slot, index);
    }

    /// Removes a block from the index and marks its slot free on the device.
    fn retire(&self, block: &Arc<BlockIndex>) -> Result<()> {
        if block.kind == BlockKind::Normal {
            self.make_watermark_durable(block.partition as usize, block.max_version)?;
        }
        {
            let mut state = self.partitions[block.partition as usize].state.write();
            if let Some((_, column)) = state.blocks.remove(block.slot) {
                state.bfm.remove(column);
            }
        }
        block.retired.store(true, Ordering::Release);
        let mut page = AlignedBuf::zeroed(self.geo.page_size);
        Footer::encode_free(self.sb.store_id, &mut page);
        let offset = block.device_offset_bytes + self.geo.footer_offset() as u64;
        self.io("free footer write", offset, self.device.write_at(offset, &page))?;
        self.device_sync("free footer sync")?;
        let mut slots = self.slots.lock();
        slots.by_age.remove(&(block.max_version, block.block_seq, block.slot));
        slots.live.remove(&block.slot);
        slots.free.push(block.slot);
        Ok(())
    }

    fn reserve_slot(&self, purpose: SlotPurpose) -> Result<u32> {
        let mut flushed = vec![false; self.partitions.len()];
        loop {
            {
                let mut slots = self.slots.lock();
                let keep = match (self.sb.mode, purpose) {
                    (Mode::Cache, _) => 0,
                    (Mode::Store, SlotPurpose::Seal) => GC_RESERVE_SLOTS,
                    (Mode::Store, SlotPurpose::SealDeletions) => GC_RESERVE_SLOTS - 1,
                };
                if slots.free.len() > keep {
                    let slot = slots.free.pop().expect("non-empty");
                    if self.sb.mode == Mode::Store && slots.free.len() <= self.gc_background_free_slots() {
                        drop(slots);
                        self.wake_collector();
                    }
                    return Ok(slot);
                }
            }
            match (self.sb.mode, purpose) {
                (Mode::Cache, _) => self.evict_oldest()?,
                (Mode::Store, SlotPurpose::SealDeletions) => return Err(self.store_full()),
                (Mode::Store, SlotPurpose::Seal) => {
                    if self.collect_garbage(GC_RESERVE_SLOTS)? {
                        continue;
                    }
                    // Blocks being sealed may hold the tombstones or newer versions that make
                    // records dead: let them land, then try once more.
                    self.seals.wait_for_started_before_now();
                    if self.collect_garbage(GC_RESERVE_SLOTS)? {
                        continue;
                    }
                    // Deletions still in write buffers free nothing until sealed: seal them
                    // into the reserve, then collect again.
                    let Some(q) = (0..self.partitions.len()).find(|&q| !flushed[q] && self.partitions[q].state.read().active.tombstones() > 0) else {
                        return Err(self.store_full());
                    };
                    flushed[q] = true;
                    self.seal_partition_for(q, SlotPurpose::SealDeletions)?;
                    self.seals.wait_for_started_before_now();
                }
            }
        }
    }

    fn store_full(&self) -> Error {
        let stats = self.stats();
        Error::StoreFull { live_bytes: stats.bytes_live_estimate, capacity_bytes: stats.capacity_bytes }
    }

    /// Cache mode: drops the oldest block whole.
    fn evict_oldest(&self) -> Result<()> {
        let victim = {
            let mut slots = self.slots.lock();
            let Some(&oldest) = slots.by_age.iter().next() else {
                return if slots.free.is_empty() { Err(Error::InvalidConfig("store too small for its partitions".into())) } else { Ok(()) };
            };
            slots.by_age.remove(&oldest);
            slots.live.get(&oldest.2).cloned()
        };
        if let Some(block) = victim {
            self.retire(&block)?;
            self.counters.evicted_blocks.fetch_add(1, Ordering::Relaxed);
            self.counters.evicted_records.fetch_add(u64::from(block.live_records_est()), Ordering::Relaxed);
        }
        Ok(())
    }

    // ---- garbage collection (store mode) ----

    /// Free slots below which (inclusive) the background collector works: the reserve plus
    /// `GC_BACKGROUND_FREE_SLOTS`, but at most an eighth of the store beyond the reserve.
    fn gc_background_free_slots(&self) -> usize {
        GC_RESERVE_SLOTS + GC_BACKGROUND_FREE_SLOTS.min(self.sb.block_count as usize / 8)
    }

    fn wake_collector(&self) {
        let (lock, wake) = &self.gc_signal;
        lock.lock().expect("gc signal poisoned").wake = true;
        wake.notify_one();
    }

    /// Moves the live records of the emptiest blocks of one partition into fewer new blocks,
    /// unless more than `free_slots_target` slots are free (someone else collected meanwhile).
    /// Candidates are chosen by estimate, then examined exactly; returns whether a block slot
    /// was freed (or enough were free).
    fn collect_garbage(&self, free_slots_target: usize) -> Result<bool> {
        let mut scratch = self.gc_lock.lock();
        let scratch = &mut *scratch;
        if self.slots.lock().free.len() > free_slots_target {
            return Ok(true);
        }
        let mut examined = 0;
        for (p, candidates) in self.gc_candidates() {
            let mut victims: Vec<(Arc<BlockIndex>, Vec<OwnedRecord>)> = Vec::new();
            for block in candidates {
                if examined == GC_EXAMINE_MAX {
                    return Ok(false);
                }
                examined += 1;
                let mut live = Vec::new();
                self.collect_live(p, &block, scratch, &mut live)?;
                block.dead_records_est.store(block.record_count - live.len() as u32, Ordering::Relaxed);
                victims.push((block, live));
                if self.output_blocks(&victims) < victims.len() {
                    self.compact_into_new_blocks(p, victims)?;
                    return Ok(true);
                }
                if victims.len() == GC_VICTIMS_MAX {
                    break;
                }
            }
        }
        Ok(false)
    }

    /// Blocks worth examining, grouped by partition (most estimated dead space first), each
    /// group emptiest first.
    fn gc_candidates(&self) -> Vec<(usize, Vec<Arc<BlockIndex>>)> {
        let blocks: Vec<Arc<BlockIndex>> = self.slots.lock().live.values().cloned().collect();
        let capacity = self.geo.block_size as f64;
        // Estimates change under concurrent seals: read each once, then sort on the snapshot.
        let mut groups: HashMap<u32, Vec<(f64, Arc<BlockIndex>)>> = HashMap::new();
        for b in blocks {
            let live = b.data_end_bytes as f64 * f64::from(b.live_records_est()) / f64::from(b.record_count.max(1));
            if live < GC_LIVE_FRACTION_MAX * capacity {
                groups.entry(b.partition).or_default().push((live, b));
            }
        }
        type Group = (f64, usize, Vec<(f64, Arc<BlockIndex>)>);
        let mut groups: Vec<Group> = groups
            .into_iter()
            .map(|(p, mut group)| {
                group.sort_by(|a, b| a.0.total_cmp(&b.0));
                let dead: f64 = group.iter().map(|(live, _)| capacity - live).sum();
                (dead, p as usize, group)
            })
            .collect();
        groups.sort_by(|a, b| b.0.total_cmp(&a.0));
        groups.into_iter().map(|(_, p, group)| (p, group.into_iter().map(|(_, b)| b).collect())).collect()
    }

    /// How many blocks the victims' live records need, cut as `compact_into_new_blocks` cuts them.
    fn output_blocks(&self, victims: &[(Arc<BlockIndex>, Vec<OwnedRecord>)]) -> usize {
        let records: Vec<RecordRef<'_>> = victims.iter().flat_map(|(_, live)| live.iter().map(OwnedRecord::as_ref)).collect();
        let (mut blocks, mut rest) = (0, &records[..]);
        while !rest.is_empty() {
            rest = &rest[block::records_fitting(&self.geo, rest).max(1)..];
            blocks += 1;
        }
        blocks
    }

    /// Writes the victims' live records into new blocks, in victim order, retiring each victim
    /// as soon as all its records are written, so one free slot is always enough.
    fn compact_into_new_blocks(&self, p: usize, victims: Vec<(Arc<BlockIndex>, Vec<OwnedRecord>)>) -> Result<()> {
        self.counters.gc_runs.fetch_add(1, Ordering::Relaxed);
        let victim_count = victims.len();
        let mut queue: Vec<(usize, OwnedRecord)> = Vec::new();
        let mut blocks = Vec::new();
        for (i, (block, live)) in victims.into_iter().enumerate() {
            queue.extend(live.into_iter().map(|r| (i, r)));
            blocks.push(block);
        }
        let moved = queue.len();
        if queue.is_empty() {
            // The victims' records are all dead because of newer blocks that may not be
            // durable yet; freeing a victim must never outlive them in a crash.
            self.device_sync("gc order sync")?;
        }
        let (mut outputs, mut retired, mut start) = (0, 0, 0);
        while start < queue.len() {
            let mut chunk: Vec<RecordRef<'_>> = queue[start..].iter().map(|(_, r)| r.as_ref()).collect();
            let n = block::records_fitting(&self.geo, &chunk);
            assert!(n > 0, "a record larger than a block reached garbage collection");
            chunk.truncate(n);
            chunk.sort_unstable_by(block::record_order);
            let slot = self.slots.lock().free.pop().ok_or_else(|| Error::Failed("garbage collection has no free slot".into()))?;
            let (index, filter, _, ticket) = self.write_block(p, slot, BlockKind::Gc, &chunk)?;
            self.unconfirmed.lock().push(Unconfirmed { ticket, block_seq: index.block_seq, partition: p, watermark: 0, journal_first: None });
            // The output must be durable before any victim is freed.
            self.device_sync("gc output sync")?;
            self.confirm_footers();
            self.publish(p, index, &filter);
            outputs += 1;
            start += n;
            let written_through = if start < queue.len() { queue[start].0 } else { blocks.len() };
            while retired < written_through {
                self.retire(&blocks[retired])?;
                retired += 1;
            }
        }
        while retired < blocks.len() {
            self.retire(&blocks[retired])?;
            retired += 1;
        }
        self.counters.gc_records_moved.fetch_add(moved as u64, Ordering::Relaxed);
        self.counters.gc_blocks_freed.fetch_add(victim_count.saturating_sub(outputs) as u64, Ordering::Relaxed);
        tracing::debug!(victims = victim_count, outputs, moved, "garbage collection pass");


        Ok(())
    }

    /// [`Engine::scan`].
    fn scan(&self, visit: &mut dyn FnMut(ScanRecord<'_>) -> bool) -> Result<u64> {
        let mut scratch = GcScratch { victim: None, reads: BatchReads::new(), digests: DigestCache::default() };
        let mut visited = 0u64;
        for (p, partition) in self.partitions.iter().enumerate() {
            // The write buffers' records, newest first: the active buffer's, then those of
            // the one being sealed that the active one does not have. Their keys are newer
            // than any sealed block's. The partition's sealed blocks are listed at the same
            // moment: a seal publishes its block before it lets go of the buffer, so every
            // record is in one or the other.
            let (buffered, sealed) = {
                let state = partition.state.read();
                let mut sealed: Vec<Arc<BlockIndex>> = state.blocks.view.iter().flatten().cloned().collect();
                sealed.sort_by_key(|b| std::cmp::Reverse(b.order_key()));
                let owned = |r: RecordRef<'_>| OwnedRecord { hash: r.hash, version: r.version, kind: r.kind, key: r.key.to_vec(), value: r.value.to_vec() };
                let mut records: Vec<OwnedRecord> = state.active.sorted_records().into_iter().map(owned).collect();
                if let Some(sealing) = &state.sealing {
                    let newer: std::collections::HashSet<&[u8]> = records.iter().map(|r| r.key.as_slice()).collect();
                    let older: Vec<OwnedRecord> = sealing.sorted_records().into_iter().filter(|r| !newer.contains(r.key)).map(owned).collect();
                    records.extend(older);
                }
                (records, sealed)
            };
            let in_buffers: std::collections::HashSet<&[u8]> = buffered.iter().map(|r| r.key.as_slice()).collect();
            for r in buffered.iter().filter(|r| r.kind != RecordKind::Tombstone) {
                visited += 1;
                if !visit(ScanRecord { key: &r.key, value: &r.value, version: r.version }) {
                    return Ok(visited);
                }
            }
            let mut live = Vec::new();
            for block in &sealed {
                live.clear();
                if let Err(e) = self.collect_live(p, block, &mut scratch, &mut live) {
                    // Retired since the list was taken (its slot may be being written
                    // again): its live records were moved to a newer block or dropped with it.
                    let retired = self.slots.lock().live.get(&block.slot).is_none_or(|b| b.block_seq != block.block_seq);
                    if retired {
                        continue;
                    }
                    return Err(e);
                }
                for r in live.iter().filter(|r| r.kind != RecordKind::Tombstone && !in_buffers.contains(r.key.as_slice())) {
                    visited += 1;
                    if !visit(ScanRecord { key: &r.key, value: &r.value, version: r.version }) {
                        return Ok(visited);
                    }
                }
            }
        }
        Ok(visited)
    }

    /// Reads a victim block and keeps the records that are still the newest of their keys.
    fn collect_live(&self, p: usize, victim: &Arc<BlockIndex>, scratch: &mut GcScratch, out: &mut Vec<OwnedRecord>) -> Result<()> {
        let len = (victim.data_end_bytes as usize).next_multiple_of(self.geo.sector).max(self.geo.sector);
        if scratch.victim.as_ref().is_none_or(|buf| buf.capacity() < len) {
            scratch.victim = Some(AlignedBuf::zeroed_huge(len.max(self.geo.block_size)));
        }
        let buf = scratch.victim.as_mut().expect("set above");
        buf.set_len(len);
        let data: &mut [u8] = buf;
        self.io("gc read", victim.device_offset_bytes, self.device.read_at(victim.device_offset_bytes, data))?;
        self.counters.flash_reads.fetch_add(1, Ordering::Relaxed);
        let mut found: Vec<OwnedRecord> = Vec::new();
        for span in victim.all_spans() {
            let start = (span.offset_bytes - victim.device_offset_bytes) as usize;
            let bytes = &data[start..start + span.len_bytes as usize];
            block::visit_span(&span, bytes, self.sb.store_id, victim.block_seq, |header, key, value_at| {
                found.push(OwnedRecord::new(header, key, &bytes[value_at..value_at + header.value_len as usize]));
                true
            })
            .map_err(|e| match e {
                SpanError::Corrupt(source) => Error::Corrupt { what: "block being collected", offset_bytes: span.offset_bytes, source },
                SpanError::Stale => Error::Corrupt { what: "block being collected changed", offset_bytes: span.offset_bytes, source: FormatError::BadMagic },
            })?;
        }
        let newer = self.newer_versions_sealed(&mut scratch.reads, &mut scratch.digests, p, &found, victim.order_key())?;
        for (record, newer) in found.into_iter().zip(newer) {
            if newer {
                continue;
            }
            if record.kind == RecordKind::Tombstone && !self.older_block_may_contain(p, &record.hash, victim.order_key()) {
                continue;
            }
            out.push(record);
        }
        Ok(())
    }

    fn older_block_may_contain(&self, p: usize, hash: &KeyHash, below: (u64, u64)) -> bool {
        let state = self.partitions[p].state.read();
        let mut ids = Vec::new();
        state.bfm.candidates(hash, &mut ids);
        ids.iter().filter_map(|id| state.blocks.get(*id)).any(|(b, _)| b.order_key() < below && b.may_contain(hash))
    }

    // ---- sync ----

    fn sync(&self) -> Result<()> {
        self.check_writable()?;
        let mut journal = self.journal.lock();
        let mut staged: Vec<(JournalEntryHeader, Vec<u8>)> = Vec::new();
        for (p, partition) in self.partitions.iter().enumerate() {
            let mut state = partition.state.write();
            let pending = state.active.take_pending();
            if pending.is_empty() {
                continue;
            }
            if state.journal_first_active.is_none() {
                state.journal_first_active = Some(journal.writer.head());
            }
            for offset in pending {
                let r = state.active.record_at(offset);
                let header = JournalEntryHeader { partition: p as u16, record: RecordHeader { version: r.version, value_len: r.value.len() as u32, key_len: r.key.len() as u8, kind: r.kind } };
                staged.push((header, [r.key, r.value].concat()));
            }
        }
        // Records no longer pending above left with a seal that froze their buffer before
        // this sync took them, and that seal has begun by now (seals register before they
        // freeze): wait for its block, which the device sync below makes durable.
        self.seals.wait_for_started_before_now();
        self.check_writable()?;
        let bytes: usize = staged.iter().map(|(_, kv)| JournalWriter::entry_bytes(kv.len(), 0)).sum();
        self.make_journal_room(&mut journal, bytes)?;
        for (header, kv) in &staged {
            let key_len = usize::from(header.record.key_len);
            journal.writer.append(header, &kv[..key_len], &kv[key_len..]);
        }
        // Footers already durable go into a checkpoint that this sync makes durable too.
        self.confirm_footers();
        let flushed = self
            .write_checkpoint_if_stale()
            .and_then(|()| journal.writer.flush(self.device.as_ref()))
            .and_then(|()| self.device_sync("journal sync"));
        self.confirm_footers();
        if let Err(error) = &flushed {
            self.fail(error);
        }
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        flushed
    }

    /// Seals the partitions holding the oldest journal pages until `bytes` more fit the ring.
    fn make_journal_room(&self, journal: &mut JournalState, bytes: usize) -> Result<()> {
        let capacity = journal.writer.logical_pages();
        loop {
            let head_after = journal.writer.head_after(bytes);
            let tail = self.journal_tail().unwrap_or(journal.writer.head());
            if head_after < tail + capacity {
                return Ok(());
            }
            if self.unconfirmed.lock().iter().any(|u| u.journal_first == Some(tail)) {
                // The pages are held only until a sealed block's footer is durable.
                self.device_sync("journal room sync")?;
                self.confirm_footers();
                continue;
            }
            let oldest = self.partitions.iter().position(|part| {
                let s = part.state.read();
                s.journal_first_active == Some(tail) || s.journal_first_sealing == Some(tail)
            });
            let Some(p) = oldest else { return Err(Error::InvalidConfig("journal too small for one sync".into())) };
            tracing::debug!(partition = p, "sealing a partition early to free journal space");
            self.seal_partition(p)?;
            self.seals.wait_for_started_before_now();
        }
    }

    fn journal_tail(&self) -> Option<u64> {
        let unconfirmed = self.unconfirmed.lock().iter().filter_map(|u| u.journal_first).min();
        self.partitions
            .iter()
            .flat_map(|part| {
                let s = part.state.read();
                [s.journal_first_active, s.journal_first_sealing]
            })
            .flatten()
            .chain(unconfirmed)
            .min()
    }

    /// Loads into `cache` the key digests of the partition's sealed blocks newer than `above`
    /// (those that have them and are not loaded yet), in one batch of reads.
    fn load_newer_digests(&self, io: &mut BatchReads, cache: &mut DigestCache, p: usize, above: (u64, u64)) -> Result<()> {
        let wanted: Vec<(Arc<BlockIndex>, (u64, usize))> = {
            let state = self.partitions[p].state.read();
            let newer = state.blocks.view.iter().flatten().filter(|b| b.order_key() > above && !cache.blocks.contains_key(&(b.slot, b.block_seq)));
            newer.filter_map(|b| Some((Arc::clone(b), b.digests_span()?))).collect()
        };
        if wanted.is_empty() {
            return Ok(());
        }
        let reads = wanted.iter().enumerate().map(|(i, (_, (offset, len)))| (*offset, *len, i as u64));
        self.read_batch(io, reads, |i, result| {
            let b = &wanted[i as usize].0;
            self.counters.flash_reads.fetch_add(1, Ordering::Relaxed);
            let digests = match result {
                Ok(bytes) => match format::decode_digests(bytes, b.block_seq, b.large_count()) {
                    Ok(digests) => Some(digests),
                    Err(error) => {
                        // Stale (the slot was reused) or damaged: read this block's records instead.
                        tracing::debug!(slot = b.slot, block_seq = b.block_seq, %error, "key digests unusable");
                        None
                    }
                },
                Err(source) => return Err(Error::Io { op: "gc digests read", offset_bytes: b.device_offset_bytes, source }),
            };
            cache.insert(b, digests);
            Ok(())
        })
    }

    // ---- recovery ----

    /// Reads every block's footer and summary and rebuilds the RAM index.
    fn load_blocks(&self) -> Result<usize> {
        let sb = &self.sb;
        let mut footers = Vec::new();
        let footer_offset = |slot: u32| sb.block_offset_bytes(slot) + self.geo.footer_offset() as u64;
        let mut io = BatchReads::new();
        self.read_batch(&mut io, (0..sb.block_count).map(|slot| (footer_offset(slot), self.geo.page_size, u64::from(slot))), |slot, result| {
            let slot = slot as u32;
            let page = self.io("footer read", footer_offset(slot), result)?;
            match Footer::decode(page, sb.store_id, u64::from(sb.block_size_bytes)) {
                Ok(Some(footer)) => footers.push((slot, footer)),
                Ok(None) => {}
                Err(error) => tracing::debug!(slot, %error, "ignoring a damaged footer (an interrupted seal)"),
            }
            Ok(())
        })?;
        let mut loaded = Vec::new();
        let reads = footers.iter().map(|(slot, f)| {
            let start = sb.block_offset_bytes(*slot) + f.summary_offset_bytes;
            let len = (f.summary_len_bytes as usize).next_multiple_of(self.geo.page_size);
            (start, len, u64::from(*slot))
        });
        let by_slot: HashMap<u32, Footer> = footers.iter().copied().collect();
        // Blocks sealed after the last durable checkpoint may be torn: verify their pages. New
        // blocks must be numbered above every number the checkpoint vouches for.
        let confirmed_seq = self.checkpoint.lock().confirmed_block_seq;
        self.last_block_seq.fetch_max(confirmed_seq, Ordering::AcqRel);
        let mut unconfirmed = Vec::new();
        self.read_batch(&mut io, reads, |slot, result| {
            let slot = slot as u32;
            let footer = &by_slot[&slot];
            let offset = sb.block_offset_bytes(slot);
            let bytes = self.io("summary read", offset, result)?;
            self.last_block_seq.fetch_max(footer.block_seq, Ordering::AcqRel);
            let recent = footer.block_seq > confirmed_seq;
            match block::open_summary(&self.geo, slot, offset, footer, &bytes[..footer.summary_len_bytes as usize]) {
                Ok(found) if recent => unconfirmed.push(found),
                Ok(found) => loaded.push(found),
                Err(error) if recent => tracing::info!(slot, %error, "dropping a block torn by a crash while it was sealed"),
                Err(source) if sb.mode == Mode::Store => return Err(Error::Corrupt { what: "block summary", offset_bytes: offset + footer.summary_offset_bytes, source }),
                Err(error) => tracing::warn!(slot, %error, "dropping a block whose summary is corrupt (cache mode)"),
            }
            Ok(())
        })?;
        let mut torn: Vec<u32> = footers.iter().filter(|(_, f)| f.block_seq > confirmed_seq).map(|(slot, _)| *slot).collect();
        for found in unconfirmed {
            if self.block_data_intact(&found.0)? {
                torn.retain(|&slot| slot != found.0.slot);
                loaded.push(found);
            } else {
                tracing::info!(slot = found.0.slot, "dropping a block torn by a crash while it was sealed");
            }
        }
        // A torn block's footer must not outlive this open: a later checkpoint would vouch for it.
        self.free_footers(&torn)?;
        let count = loaded.len();
        let mut watermarks = self.checkpoint.lock().confirmed.clone();
        for (index, _, _) in &loaded {
            if index.kind == BlockKind::Normal {
                let w = &mut watermarks[index.partition as usize];
                *w = (*w).max(index.max_version);
            }
            self.last_version.fetch_max(index.max_version, Ordering::AcqRel);
            self.last_block_seq.fetch_max(index.block_seq, Ordering::AcqRel);
        }
        // Versions at or below a watermark may live only in blocks GC has since rewritten:
        // new versions must start above every watermark, or replay would skip them.
        for &w in &watermarks {
            self.last_version.fetch_max(w, Ordering::AcqRel);
        }
        self.checkpoint.lock().confirmed = watermarks;
        let mut used = vec![false; sb.block_count as usize];
        let mut estimates = Vec::with_capacity(loaded.len());
        for (index, filter, samples) in loaded {
            used[index.slot as usize] = true;
            if index.partition >= sb.partitions {
                return Err(Error::Corrupt { what: "block partition", offset_bytes: index.device_offset_bytes, source: FormatError::OutOfRange { field: "partition", value: u64::from(index.partition) } });
            }
            estimates.push((index.partition as usize, index.order_key(), samples));
            self.publish(index.partition as usize, index, &filter);
        }
        for (p, order_key, samples) in &estimates {
            self.estimate_dead(*p, samples, *order_key);
        }
        self.slots.lock().free = (0..sb.block_count).rev().filter(|&s| !used[s as usize]).collect();
        Ok(count)
    }

    /// Marks block slots free on the device (durably).
    fn free_footers(&self, slots: &[u32]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let mut page = AlignedBuf::zeroed(self.geo.page_size);
        Footer::encode_free(self.sb.store_id, &mut page);
        for &slot in slots {
            let offset = self.sb.block_offset_bytes(slot) + self.geo.footer_offset() as u64;
            self.io("free footer write", offset, self.device.write_at(offset, &page))?;
        }
        self.device_sync("free footer sync")
    }

    /// Whether every page and slot of a block reads back with its checksum and sequence number
    /// (used at open for blocks sealed after the last durable checkpoint).
    fn block_data_intact(&self, index: &BlockIndex) -> Result<bool> {
        let len = (index.data_end_bytes as usize).next_multiple_of(self.geo.sector).max(self.geo.sector);
        let mut data = AlignedBuf::zeroed(len);
        self.io("verify read", index.device_offset_bytes, self.device.read_at(index.device_offset_bytes, &mut data))?;
        Ok(index.all_spans().iter().all(|span| {
            let start = (span.offset_bytes - index.device_offset_bytes) as usize;
            let bytes = &data[start..start + span.len_bytes as usize];
            block::visit_span(span, bytes, self.sb.store_id, index.block_seq, |_, _, _| true).is_ok()
        }))
    }

    /// Issues reads through an io_uring queue and hands each result to `on_done`.
    fn read_batch(
        &self,
        io: &mut BatchReads,
        reads: impl Iterator<Item = (u64, usize, u64)>,
        mut on_done: impl FnMut(u64, std::io::Result<&[u8]>) -> Result<()>,
    ) -> Result<()> {
        let BatchReads { queue, buffers } = io;
        let q = queue.get_or_insert_with(|| io_queue(&self.device, RECOVERY_QUEUE_DEPTH));
        let mut done = Vec::new();
        let mut reads = reads.peekable();
        let mut outcome = Ok(());
        // A failed callback stops new reads; those in flight are waited for (their buffers
        // belong to the kernel until then), so the queue serves the next batch.
        while (outcome.is_ok() && reads.peek().is_some()) || q.in_flight() > 0 {
            while outcome.is_ok() && q.in_flight() < q.depth() {
                let Some((offset, len, token)) = reads.next() else { break };
                if let Err(source) = q.submit_read(offset, buffers.take(len), token) {
                    outcome = Err(Error::Io { op: "queue read", offset_bytes: offset, source });
                }
            }
            if let Err(source) = q.wait(1, &mut done) {
                // Reads of this batch may still be in flight: the next batch gets a new queue
                // (dropping this one cancels them or waits for them).
                *queue = None;
                return Err(Error::Io { op: "queue wait", offset_bytes: 0, source });
            }
            for completion in done.drain(..) {
                if outcome.is_ok() {
                    outcome = on_done(completion.token, completion.result.map(|()| &completion.buf[..]));
                }
                buffers.put(completion.buf);
            }
        }
        outcome
    }

    /// Puts journaled records that no durable block holds back into the write buffers.
    fn replay_journal(&self) -> Result<usize> {
        let recovered = journal::recover(self.device.as_ref(), &self.sb, self.value_size_max_bytes)?;
        let watermarks = self.checkpoint.lock().confirmed.clone();
        let mut replayed = 0;
        for entry in &recovered.entries {
            let p = usize::from(entry.header.partition);
            let version = entry.header.record.version;
            self.last_version.fetch_max(version, Ordering::AcqRel);
            let hash = KeyHash::of(&entry.key);
            if version <= watermarks[p] || hash.partition(self.sb.partitions) as usize != p {
                continue;
            }
            let newer_in_buffer = self.partitions[p].state.read().active.get(&hash, &entry.key).is_some_and(|f| f.version >= version);
            if newer_in_buffer {
                continue;
            }
            self.insert(&hash, &entry.key, &entry.value, entry.header.record.kind, Some(version))?;
            let mut state = self.partitions[p].state.write();
            let first = state.journal_first_active.get_or_insert(entry.logical_page);
            *first = (*first).min(entry.logical_page);
            replayed += 1;
        }
        for partition in &self.partitions {
            partition.state.write().active.take_pending();
        }
        let mut journal = self.journal.lock();
        journal.writer = JournalWriter::new(&self.sb, recovered.next_head, recovered.next_write_seq);
        if recovered.pages_damaged > 0 {
            tracing::info!(pages = recovered.pages_damaged, "journal pages from an interrupted sync were ignored");
        }
        Ok(replayed)
    }

    fn read_block_summary(&self, slot: u32) -> Result<Option<(BlockIndex, BloomFilter)>> {
        let offset = self.sb.block_offset_bytes(slot);
        let mut page = AlignedBuf::zeroed(self.geo.page_size);
        let footer_at = offset + self.geo.footer_offset() as u64;
        self.io("footer read", footer_at, self.device.read_at(footer_at, &mut page))?;
        let Ok(Some(footer)) = Footer::decode(&page, self.sb.store_id, u64::from(self.sb.block_size_bytes)) else { return Ok(None) };
        let mut summary = AlignedBuf::zeroed((footer.summary_len_bytes as usize).next_multiple_of(self.geo.page_size));
        let at = offset + footer.summary_offset_bytes;
        self.io("summary read", at, self.device.read_at(at, &mut summary))?;
        Ok(block::open_summary(&self.geo, slot, offset, &footer, &summary[..footer.summary_len_bytes as usize]).ok().map(|(index, filter, _)| (index, filter)))
    }

    // ---- stats ----

    fn stats(&self) -> Stats {
        let mut ram = RamUsage::default();
        let (mut buffer_records, mut buffer_tombstones, mut buffer_user_bytes) = (0u64, 0u64, 0u64);
        for partition in &self.partitions {
            let s = partition.state.read();
            ram.bloom_filter_map_bytes += s.bfm.memory_bytes() as u64;
            ram.block_table_bytes += s.blocks.memory_bytes() as u64;
            for buffer in std::iter::once(&s.active).chain(s.sealing.as_deref()) {
                ram.write_buffer_index_bytes += buffer.index_memory_bytes() as u64;
                ram.write_buffer_data_bytes += buffer.data_memory_bytes() as u64;
                buffer_records += buffer.len() as u64;
                buffer_tombstones += buffer.tombstones() as u64;
                buffer_user_bytes += buffer.user_bytes();
            }
        }
        let slots = self.slots.lock();
        let (mut records, mut dead, mut tombstones, mut live_bytes, mut dead_bytes) = (0u64, 0u64, 0u64, 0u64, 0u64);
        for b in slots.live.values() {
            ram.page_index_bytes += b.memory_bytes() as u64;
            ram.block_table_bytes += block::block_overhead_bytes() as u64;
            records += u64::from(b.record_count);
            let d = u64::from(b.record_count - b.live_records_est());
            dead += d;
            tombstones += u64::from(b.tombstone_count);
            let per_record = b.user_bytes / u64::from(b.record_count.max(1));
            dead_bytes += d * per_record;
            live_bytes += b.user_bytes.saturating_sub(d * per_record);
        }
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            keys_estimate: (records + buffer_records).saturating_sub(dead + tombstones + buffer_tombstones),
            records: records + buffer_records,
            blocks_total: u64::from(self.sb.block_count),
            blocks_used: slots.live.len() as u64,
            blocks_free: slots.free.len() as u64,
            partitions: u64::from(self.sb.partitions),
            capacity_bytes: u64::from(self.sb.block_count) * u64::from(self.sb.block_size_bytes),
            bytes_live_estimate: live_bytes + buffer_user_bytes,
            bytes_dead_estimate: dead_bytes,
            gets: load(&c.gets),
            get_hits_ram: load(&c.get_hits_ram),
            puts: load(&c.puts),
            deletes: load(&c.deletes),
            flash_reads: load(&c.flash_reads),
            flash_read_bytes: load(&c.flash_read_bytes),
            flash_writes: load(&c.flash_writes),
            flash_write_bytes: load(&c.flash_write_bytes),
            syncs: load(&c.syncs),
            device_syncs: load(&c.device_syncs),
            seals: load(&c.seals),
            evicted_blocks: load(&c.evicted_blocks),
            evicted_records_estimate: load(&c.evicted_records),
            gc_runs: load(&c.gc_runs),
            gc_background_runs: load(&c.gc_background_runs),
            gc_records_moved: load(&c.gc_records_moved),
            gc_blocks_freed: load(&c.gc_blocks_freed),
            gc_digest_hits: load(&c.gc_digest_hits),
            gc_liveness_reads: load(&c.gc_liveness_reads),
            ram,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotPurpose {
    /// A full write buffer.
    Seal,
    /// A buffer sealed early so the deletions in it let garbage collection free space.
    SealDeletions,
}

impl Seals {
    fn begin(&self) -> u64 {
        let mut s = self.state.lock().expect("seal lock poisoned");
        s.0 += 1;
        let ticket = s.0;
        s.1.insert(ticket);
        ticket
    }

    fn end(&self, ticket: u64) {
        self.state.lock().expect("seal lock poisoned").1.remove(&ticket);
        self.done.notify_all();
    }

    /// Waits for every seal that began before this call.
    fn wait_for_started_before_now(&self) {
        let mut s = self.state.lock().expect("seal lock poisoned");
        let last = s.0;
        while s.1.first().is_some_and(|&t| t <= last) {
            s = self.done.wait(s).expect("seal lock poisoned");
        }
    }
}

/// A record [`Engine::scan`] visits: the newest version of its key, not a deletion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanRecord<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    /// The record's version (as [`Item::version`]).
    pub version: u64,
}

/// A record copied out of a block being collected.
struct OwnedRecord {
    hash: KeyHash,
    version: u64,
    kind: RecordKind,
    key: Vec<u8>,
    value: Vec<u8>,
}

impl OwnedRecord {
    fn new(header: &RecordHeader, key: &[u8], value: &[u8]) -> Self {
        Self { hash: KeyHash::of(key), version: header.version, kind: header.kind, key: key.to_vec(), value: value.to_vec() }
    }

    fn as_ref(&self) -> RecordRef<'_> {
        RecordRef { hash: self.hash, version: self.version, kind: self.kind, key: &self.key, value: &self.value }
    }
}
