//! Items as memcached sees them, over the engine and the RAM cache.
//!
//! Reads that may go to flash are split-phase and belong to the worker's event
//! loop ([`Store::probe`], then the engine's `get_start`/`get_continue`, then
//! [`Store::admit`]). Everything that writes runs here, synchronously, under
//! the key's *write stripe*: the stripe serialises every writer of a key, so a
//! read-modify-write (append, incr, cas, touch, ...) reads the live record,
//! computes, and writes without racing another writer, and the RAM cache is
//! updated in the same critical section (see `cache` for why readers never
//! put an older record back).
//!
//! An item is *live* when it is present, not expired, and stored after the
//! flush horizon (`clock`). Dead records are treated as absent; they are
//! overwritten, deleted, or dropped by the engine's eviction and garbage
//! collection like any other dead data.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kura_engine::{Condition, Engine, EngineConfig, Item, Mode, RecordKind};
use kura_proto::{ArithmeticOp, KEY_LENGTH_MAX};
use parking_lot::{Mutex, MutexGuard};
use xxhash_rust::xxh3::xxh3_64;

use crate::cache::{CacheStats, CachedRecord, Probe, RamCache};
use crate::clock::{self, Clock, FlushHorizon, FlushState};
use crate::record::{self, ItemMeta, RecordView};

/// Write stripes (a power of two).
const WRITE_STRIPES: usize = 4096;
const _: () = assert!(WRITE_STRIPES.is_power_of_two());

/// The key under which the flush horizon is saved: 250 bytes starting with
/// NUL, which no client can name (text keys may not hold control characters,
/// and base64 keys decode to at most 187 bytes).
pub const FLUSH_STATE_KEY: [u8; KEY_LENGTH_MAX] = reserved_key(b"\0kura/flush-state");

const fn reserved_key(name: &[u8]) -> [u8; KEY_LENGTH_MAX] {
    let mut key = [b'.'; KEY_LENGTH_MAX];
    let mut i = 0;
    while i < name.len() {
        key[i] = name[i];
        i += 1;
    }
    key
}

/// Errors a command can meet; each maps to memcached's reply line.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object too large for cache")]
    TooLarge,
    #[error("out of memory storing object")]
    OutOfMemory,
    #[error("{0}")]
    Engine(#[from] kura_engine::Error),
    #[error("corrupt item record for a key: {0}")]
    Corrupt(#[from] record::RecordError),
}

impl StoreError {
    /// The text after `SERVER_ERROR `.
    pub fn server_error_text(&self) -> String {
        match self {
            Self::TooLarge | Self::OutOfMemory => self.to_string(),
            Self::Engine(kura_engine::Error::StoreFull { .. }) => {
                "out of memory storing object".to_owned()
            }
            Self::Engine(kura_engine::Error::ValueTooLarge { .. }) => {
                "object too large for cache".to_owned()
            }
            other => other.to_string(),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Where a found record's bytes live.
pub enum Holder {
    /// The engine's read buffer (or write buffer copy).
    Flash(Item),
    Cached(Arc<CachedRecord>),
}

/// A live record found by a lookup.
pub struct Found {
    pub holder: Holder,
    pub view: RecordView,
    pub version: u64,
    /// memcached's `-C` off: the CAS value shown and compared is 0.
    pub cas_enabled: bool,
}

impl Found {
    pub fn bytes(&self) -> &[u8] {
        match &self.holder {
            Holder::Flash(item) => item.value(),
            Holder::Cached(record) => &record.bytes,
        }
    }

    pub fn meta(&self) -> &ItemMeta {
        &self.view.meta
    }

    /// The item's CAS value (0 with `-C`).
    pub fn cas(&self) -> u64 {
        if self.cas_enabled { self.view.meta.cas(self.version) } else { 0 }
    }

    pub fn data(&self) -> &[u8] {
        self.view.data(self.bytes())
    }

    /// Whether a client fetched it before, and seconds since its last
    /// access, as far as the RAM cache knows (flash-only items: never
    /// fetched, last accessed when stored).
    pub fn access(&self, now_s: i64) -> (bool, u64) {
        match &self.holder {
            Holder::Cached(record) => {
                let (fetched, last) = record.access();
                (fetched, (now_s - last).max(0) as u64)
            }
            Holder::Flash(_) => {
                let set_s = (self.view.meta.set_time_us / 1_000_000) as i64;
                (false, (now_s - set_s).max(0) as u64)
            }
        }
    }
}

/// Why a record is not live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Live,
    Expired,
    Flushed,
}

/// The six storage modes (classic commands and `ms M`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    Set,
    Add,
    Replace,
    Append,
    Prepend,
    Cas,
}

/// A storage request, classic or meta.
#[derive(Debug, Clone, Copy)]
pub struct StoreRequest<'a> {
    pub mode: StoreMode,
    pub key: &'a [u8],
    pub client_flags: u32,
    pub exptime_s: i64,
    pub data: &'a [u8],
    /// CAS value to compare (0 compares nothing, as in memcached).
    pub compare_cas: u64,
    /// `ms E`: the CAS value the new item gets.
    pub new_cas: Option<u64>,
    /// `ms I`: a CAS older than the item's stores it as stale instead of failing.
    pub invalidate: bool,
    /// `ms N` with append/prepend: create the item (with this exptime) when missing.
    pub vivify_exptime_s: Option<i64>,
}

impl<'a> StoreRequest<'a> {
    pub fn new(mode: StoreMode, key: &'a [u8], data: &'a [u8]) -> Self {
        Self {
            mode,
            key,
            client_flags: 0,
            exptime_s: 0,
            data,
            compare_cas: 0,
            new_cas: None,
            invalidate: false,
            vivify_exptime_s: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    Stored { cas: u64 },
    NotStored,
    Exists,
    NotFound,
}

/// What `md` does to a found item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteMode {
    Remove,
    /// `I`: keep it, marked stale, with a new CAS (and exptime, with `T`).
    MarkStale {
        exptime_s: Option<i64>,
    },
    /// `x`: keep the key with an empty value, these flags and this exptime.
    RemoveValue {
        client_flags: u32,
        exptime_s: i64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteOutcome {
    Deleted,
    NotFound,
    Exists,
}

/// An `incr`/`decr`/`ma` request.
#[derive(Debug, Clone, Copy)]
pub struct ArithRequest<'a> {
    pub key: &'a [u8],
    pub op: ArithmeticOp,
    pub delta: u64,
    /// CAS value to compare (0 compares nothing).
    pub compare_cas: u64,
    pub new_cas: Option<u64>,
    /// `ma N`/`J`: create a missing counter with this initial value and exptime
    /// (the caller resolves `T` against `N`, as for `mg`).
    pub vivify: Option<(u64, i64)>,
    /// `ma T`: the new exptime.
    pub exptime_s: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArithOutcome {
    Value {
        value: u64,
        cas: u64,
        meta: ItemMeta,
        created: bool,
        /// The expiry before this request (0 for a created item).
        old_expire_at_s: i64,
    },
    NotFound,
    Exists,
    NonNumeric,
}

/// What `mg` asks of the write path.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetaGetOptions {
    /// `T`: new exptime.
    pub exptime_s: Option<i64>,
    /// `N`: create an empty item with this exptime when missing, and win it
    /// (the caller resolves `T` against `N`: the later flag sets a created item's TTL).
    pub vivify_exptime_s: Option<i64>,
    /// `R`: win the recache when less than this exptime is left.
    pub recache_exptime_s: Option<i64>,
    /// `u`: do not count this as an access.
    pub no_update: bool,
}

/// `mg`'s result after the write path ran.
pub struct MetaGetResult {
    pub found: Found,
    /// Another client already won the recache (`Z`).
    pub win_sent: bool,
    /// This client won (`W`).
    pub won: bool,
    /// The item was created by `N`.
    pub created: bool,
    pub hit_before: bool,
    pub last_access_s: u64,
    /// The expiry before this request (0 for a created item).
    pub old_expire_at_s: i64,
}

/// Counters the store keeps (the workers keep the per-command ones).
#[derive(Debug, Default)]
pub struct StoreCounters {
    pub total_items: AtomicU64,
    pub get_expired: AtomicU64,
    pub get_flushed: AtomicU64,
    pub cache_fills: AtomicU64,
    pub syncs: AtomicU64,
    pub sync_failures: AtomicU64,
}

/// How the store is opened.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Largest record (`-I`): the value with its key and header, as memcached
    /// counts its item header and key against `-I`.
    pub item_size_max_bytes: usize,
    pub cache_limit_bytes: u64,
    /// Used when the store is created.
    pub size_bytes: u64,
    /// `None`: the existing store's mode, or cache when creating.
    pub mode: Option<Mode>,
    /// `None`: derived from the item size limit.
    pub block_size_bytes: Option<u32>,
    pub seal_threads: usize,
    /// Used when the store is created: see [`crate::config::PARTITIONS_MAX_DEFAULT`].
    pub partitions_max: u32,
    /// memcached's `-C` turns CAS off: every item's CAS value is 0.
    pub cas_enabled: bool,
    /// How memcached with the server's `-f -n -C` would class items.
    pub slab_classes: crate::metadump::SlabClasses,
}

/// The smallest block size (a power of two, at least 4 MiB) that holds the
/// largest record four times, as the engine requires.
pub fn block_size_for(item_size_max_bytes: usize) -> u64 {
    (4 * item_size_max_bytes as u64)
        .next_power_of_two()
        .max(4 << 20)
}

pub struct Store {
    engine: Engine,
    cache: RamCache,
    clock: Clock,
    flush: FlushHorizon,
    flush_lock: Mutex<()>,
    stripes: Box<[Mutex<()>]>,
    item_size_max_bytes: usize,
    mode: Mode,
    /// `-C` off: CAS values are 0 (see [`Found::cas`], [`Store::item_cas`]).
    cas_enabled: bool,
    slab_classes: crate::metadump::SlabClasses,
    /// Writes so far (bumped after each engine write) and the count a completed sync covered:
    /// a sync is needed while `writes_synced < writes`.
    writes: AtomicU64,
    writes_synced: AtomicU64,
    /// One engine sync at a time, so a caller that finds one running waits for it and then
    /// checks whether it covered its writes (group commit).
    sync_lock: Mutex<()>,
    pub counters: StoreCounters,
    /// The change counter clients on this host read (see [`kura_engine::changes`]), once
    /// the server publishes it.
    changes: std::sync::OnceLock<kura_engine::changes::ChangeFile>,
}

impl Store {
    /// Opens (creating when new) the store at `path`.
    pub fn open(path: &Path, config: &StoreConfig) -> StoreResult<Self> {
        let block_size = config
            .block_size_bytes
            .map_or_else(|| block_size_for(config.item_size_max_bytes), u64::from);
        let block_size_bytes = u32::try_from(block_size).map_err(|_| {
            kura_engine::Error::InvalidConfig(format!(
                "block size {block_size} for a {}-byte item limit is too large",
                config.item_size_max_bytes
            ))
        })?;
        let record_max = config.item_size_max_bytes;
        let engine_config = EngineConfig {
            block_size_bytes,
            mode: config.mode,
            size_bytes: Some(config.size_bytes),
            value_size_max_bytes: record_max,
            seal_threads: config.seal_threads,
            partitions_max: config.partitions_max,
            ..EngineConfig::default()
        };
        let engine = Engine::open(path, &engine_config)?;
        let store_block = engine.superblock().block_size_bytes as usize;
        if store_block / 4 < record_max {
            return Err(StoreError::Engine(kura_engine::Error::InvalidConfig(
                format!(
                    "{} has {store_block}-byte blocks, which hold items up to {} bytes; lower -I/--max-item-size",
                    path.display(),
                    store_block / 4
                ),
            )));
        }
        Self::with_engine(engine, config)
    }

    pub fn with_engine(engine: Engine, config: &StoreConfig) -> StoreResult<Self> {
        let flush_state = match engine.get(&FLUSH_STATE_KEY)? {
            Some(item) => FlushState::decode(item.value()).unwrap_or_else(|| {
                tracing::warn!("the saved flush_all state is unreadable; ignoring it");
                FlushState::default()
            }),
            None => FlushState::default(),
        };
        let now_us = clock::unix_now_us();
        let horizon = FlushHorizon::new(flush_state);
        let mode = engine.superblock().mode;
        Ok(Self {
            clock: Clock::new(horizon.at(now_us).max(flush_state.applied_us)),
            flush: horizon,
            flush_lock: Mutex::new(()),
            cache: RamCache::new(config.cache_limit_bytes),
            stripes: (0..WRITE_STRIPES).map(|_| Mutex::new(())).collect(),
            item_size_max_bytes: config.item_size_max_bytes,
            mode,
            writes: AtomicU64::new(0),
            writes_synced: AtomicU64::new(0),
            sync_lock: Mutex::new(()),
            counters: StoreCounters::default(),
            cas_enabled: config.cas_enabled,
            slab_classes: config.slab_classes.clone(),
            changes: std::sync::OnceLock::new(),
            engine,
        })
    }

    /// Counts every later change in `changes` (once; a second call is refused).
    pub fn publish_changes(&self, changes: kura_engine::changes::ChangeFile) -> Result<(), kura_engine::changes::ChangeFile> {
        self.changes.set(changes)
    }

    /// The published change counter, if any.
    pub fn changes(&self) -> Option<&kura_engine::changes::ChangeFile> {
        self.changes.get()
    }

    /// A change to `key` is visible to readers (RAM cache included) and not yet acknowledged.
    fn changed(&self, key: &[u8]) {
        if let Some(changes) = self.changes.get() {
            changes.bump(key);
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn item_size_max_bytes(&self) -> usize {
        self.item_size_max_bytes
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    pub fn set_cache_limit(&self, limit_bytes: u64) {
        self.cache.set_limit(limit_bytes);
    }

    /// Makes every write acknowledged before this call durable, if any happened since the last
    /// sync. Concurrent callers share one engine sync when it covers their writes, and never
    /// return before the sync that covers them has completed.
    pub fn sync_if_dirty(&self) -> StoreResult<()> {
        let target = self.writes.load(Ordering::Acquire);
        if self.writes_synced.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let _one_at_a_time = self.sync_lock.lock();
        if self.writes_synced.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let covered = self.writes.load(Ordering::Acquire);
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        self.engine.sync().inspect_err(|_| {
            self.counters.sync_failures.fetch_add(1, Ordering::Relaxed);
        })?;
        self.writes_synced.fetch_max(covered, Ordering::AcqRel);
        Ok(())
    }

    fn stripe(&self, key: &[u8]) -> MutexGuard<'_, ()> {
        self.stripes[(xxh3_64(key) as usize) & (WRITE_STRIPES - 1)].lock()
    }

    // ---- reads ----

    /// The RAM cache's answer for `key`.
    pub fn probe(&self, key: &[u8]) -> Probe {
        self.cache.probe(key)
    }

    /// The `flush_all` horizon now: items stored at or before it (microseconds) are gone.
    pub fn flush_horizon_us(&self) -> u64 {
        self.flush.at(clock::unix_now_us())
    }

    /// Whether a record is live now.
    pub fn liveness(&self, meta: &ItemMeta) -> Liveness {
        if clock::is_expired(meta.expire_at_s, clock::unix_now_s()) {
            Liveness::Expired
        } else if meta.set_time_us <= self.flush.at(clock::unix_now_us()) {
            Liveness::Flushed
        } else {
            Liveness::Live
        }
    }

    /// Checks a record for a read: live, or counted as expired or flushed.
    pub fn check_live(&self, meta: &ItemMeta) -> bool {
        match self.liveness(meta) {
            Liveness::Live => true,
            Liveness::Expired => {
                self.counters.get_expired.fetch_add(1, Ordering::Relaxed);
                false
            }
            Liveness::Flushed => {
                self.counters.get_flushed.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// The CAS value of a record written with engine `version` (0 with `-C`).
    pub fn item_cas(&self, meta: &ItemMeta, version: u64) -> u64 {
        if self.cas_enabled { meta.cas(version) } else { 0 }
    }

    /// How memcached would class items (`cls=` of metadump, `clsid=` of watch).
    pub fn slab_classes(&self) -> &crate::metadump::SlabClasses {
        &self.slab_classes
    }

    /// Whether CAS values are kept (memcached's `-C` turns them off).
    pub fn cas_enabled(&self) -> bool {
        self.cas_enabled
    }

    /// Turns an engine item into a live record, or `None`.
    pub fn found_from_flash(&self, item: Item) -> StoreResult<Option<Found>> {
        let view = RecordView::parse(item.value())?;
        if !self.check_live(&view.meta) {
            return Ok(None);
        }
        let version = item.version;
        Ok(Some(Found {
            cas_enabled: self.cas_enabled,
            holder: Holder::Flash(item),
            view,
            version,
        }))
    }

    /// A cache hit as a live record, or `None`.
    pub fn found_from_cache(&self, record: Arc<CachedRecord>) -> Option<Found> {
        if !self.check_live(&record.view.meta) {
            return None;
        }
        Some(Found {
            cas_enabled: self.cas_enabled,
            view: record.view,
            version: record.version,
            holder: Holder::Cached(record),
        })
    }

    /// Copies a record read from flash into the RAM cache (after a miss at
    /// `epoch`), if the cache's admission policy takes it.
    pub fn admit(&self, found: &Found, epoch: u64) {
        if let Holder::Flash(item) = &found.holder
            && self.cache.admits(found.view.key(item.value()))
        {
            let record = CachedRecord::new(
                item.value().into(),
                found.view,
                found.version,
                clock::unix_now_s(),
            );
            record.touch(clock::unix_now_s());
            if self.cache.fill(Arc::new(record), epoch) {
                self.counters.cache_fills.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Reads `key`'s live record, blocking on flash if need be (write paths only).
    fn read_live(&self, key: &[u8]) -> StoreResult<Option<Found>> {
        match self.cache.probe(key) {
            Probe::Hit(record) => Ok(self.found_from_cache_quiet(record)),
            Probe::Miss { .. } => match self.engine.get(key)? {
                Some(item) => {
                    let view = RecordView::parse(item.value())?;
                    if self.liveness(&view.meta) != Liveness::Live {
                        return Ok(None);
                    }
                    Ok(Some(Found {
                        cas_enabled: self.cas_enabled,
                        version: item.version,
                        holder: Holder::Flash(item),
                        view,
                    }))
                }
                None => Ok(None),
            },
        }
    }

    fn found_from_cache_quiet(&self, record: Arc<CachedRecord>) -> Option<Found> {
        (self.liveness(&record.view.meta) == Liveness::Live).then(|| Found {
            cas_enabled: self.cas_enabled,
            view: record.view,
            version: record.version,
            holder: Holder::Cached(record),
        })
    }

    /// A blocking lookup for commands that are rare or write anyway (`me`).
    pub fn get_blocking(&self, key: &[u8]) -> StoreResult<Option<Found>> {
        self.read_live(key)
    }

    // ---- writes (each under the key's stripe) ----

    /// Writes `record` for `key` and updates the RAM cache; returns the version.
    fn put_record(
        &self,
        key: &[u8],
        record: Vec<u8>,
        cache_insert: bool,
    ) -> StoreResult<(u64, RecordView)> {
        let view = RecordView::parse(&record)?;
        let version = match self
            .engine
            .write(key, &record, RecordKind::Put, Condition::Always)?
        {
            kura_engine::WriteOutcome::Written { version } => version,
            kura_engine::WriteOutcome::ConditionFailed { .. } => {
                unreachable!("unconditional write")
            }
        };
        self.writes.fetch_add(1, Ordering::AcqRel);
        let now_s = clock::unix_now_s();
        let cached = Arc::new(CachedRecord::new(
            record.into_boxed_slice(),
            view,
            version,
            now_s,
        ));
        self.cache.update(
            key,
            Some(cached),
            cache_insert && self.cache.limit_bytes() > 0,
        );
        self.changed(key);
        Ok((version, view))
    }

    fn count_item(&self) {
        self.counters.total_items.fetch_add(1, Ordering::Relaxed);
    }

    fn new_meta(&self, client_flags: u32, exptime_s: i64, new_cas: Option<u64>) -> ItemMeta {
        ItemMeta {
            client_flags,
            expire_at_s: clock::expire_at_s(exptime_s, clock::unix_now_s()),
            set_time_us: self.clock.tick(),
            cas_override: new_cas.unwrap_or(0),
            stale: false,
            token_sent: false,
        }
    }

    /// `set`, `add`, `replace`, `append`, `prepend`, `cas` and `ms`, as memcached's `do_store_item`.
    pub fn store(&self, req: &StoreRequest<'_>) -> StoreResult<StoreOutcome> {
        if record::record_len(req.key.len(), req.client_flags, req.data.len())
            > self.item_size_max_bytes
        {
            return Err(StoreError::TooLarge);
        }
        let _stripe = self.stripe(req.key);
        if req.mode == StoreMode::Set {
            // A plain set does not depend on what is there: no read (which could go to flash).
            return self.store_new(req, req.exptime_s);
        }
        let old = self.read_live(req.key)?;
        let Some(old) = old else {
            return match req.mode {
                StoreMode::Set | StoreMode::Add => self.store_new(req, req.exptime_s),
                StoreMode::Cas => Ok(StoreOutcome::NotFound),
                StoreMode::Append | StoreMode::Prepend => match req.vivify_exptime_s {
                    Some(exptime_s) => self.store_new(req, exptime_s),
                    None => Ok(StoreOutcome::NotStored),
                },
                StoreMode::Replace => Ok(StoreOutcome::NotStored),
            };
        };
        let old_cas = old.cas();
        // With `-C`, memcached keeps no CAS on the request's new item, which is what it
        // compares: a `cas` finds nothing to match (EXISTS), and an append or prepend
        // compares nothing.
        let compare_cas = if self.cas_enabled { req.compare_cas } else { 0 };
        let cas_matches = compare_cas == 0 || compare_cas == old_cas;
        match req.mode {
            StoreMode::Add => Ok(StoreOutcome::NotStored),
            StoreMode::Set | StoreMode::Replace => self.store_new(req, req.exptime_s),
            StoreMode::Cas if compare_cas != 0 && compare_cas == old_cas => {
                self.store_new(req, req.exptime_s)
            }
            StoreMode::Cas
                if req.invalidate && compare_cas != 0 && compare_cas < old_cas =>
            {
                // A late write from an older CAS: stored, but stale, keeping the TTL and win state.
                let meta = ItemMeta {
                    stale: true,
                    token_sent: old.meta().token_sent,
                    expire_at_s: old.meta().expire_at_s,
                    ..self.new_meta(req.client_flags, 0, req.new_cas)
                };
                let record = record::encode(req.key, &meta, &[req.data]);
                let (version, _) = self.put_record(req.key, record, false)?;
                self.count_item();
                Ok(StoreOutcome::Stored {
                    cas: self.item_cas(&meta, version),
                })
            }
            StoreMode::Cas => Ok(StoreOutcome::Exists),
            StoreMode::Append | StoreMode::Prepend if !cas_matches => Ok(StoreOutcome::Exists),
            StoreMode::Append | StoreMode::Prepend => {
                let combined = old.data().len() + req.data.len();
                if record::record_len(req.key.len(), old.meta().client_flags, combined)
                    > self.item_size_max_bytes
                {
                    return Ok(StoreOutcome::NotStored);
                }
                let meta = ItemMeta {
                    expire_at_s: old.meta().expire_at_s,
                    ..self.new_meta(old.meta().client_flags, 0, req.new_cas)
                };
                let parts: [&[u8]; 2] = if req.mode == StoreMode::Append {
                    [old.data(), req.data]
                } else {
                    [req.data, old.data()]
                };
                let record = record::encode(req.key, &meta, &parts);
                let (version, _) = self.put_record(req.key, record, true)?;
                self.count_item();
                Ok(StoreOutcome::Stored {
                    cas: self.item_cas(&meta, version),
                })
            }
        }
    }

    fn store_new(&self, req: &StoreRequest<'_>, exptime_s: i64) -> StoreResult<StoreOutcome> {
        let meta = self.new_meta(req.client_flags, exptime_s, req.new_cas);
        let record = record::encode(req.key, &meta, &[req.data]);
        let insert = req.mode == StoreMode::Cas;
        let (version, _) = self.put_record(req.key, record, insert)?;
        self.count_item();
        Ok(StoreOutcome::Stored {
            cas: self.item_cas(&meta, version),
        })
    }

    /// `delete` and `md`. A `compare_cas` (`md C`) must equal the item's CAS value, even 0.
    pub fn delete(
        &self,
        key: &[u8],
        compare_cas: Option<u64>,
        new_cas: Option<u64>,
        mode: DeleteMode,
    ) -> StoreResult<DeleteOutcome> {
        let _stripe = self.stripe(key);
        let Some(old) = self.read_live(key)? else {
            return Ok(DeleteOutcome::NotFound);
        };
        if compare_cas.is_some_and(|cas| cas != old.cas()) {
            return Ok(DeleteOutcome::Exists);
        }
        match mode {
            DeleteMode::Remove => {
                self.engine
                    .write(key, &[], RecordKind::Tombstone, Condition::Always)?;
                self.writes.fetch_add(1, Ordering::AcqRel);
                self.cache.update(key, None, false);
                self.changed(key);
            }
            DeleteMode::MarkStale { exptime_s } => {
                let old_meta = *old.meta();
                let expire_at_s = exptime_s.map_or(old_meta.expire_at_s, |e| {
                    clock::expire_at_s(e, clock::unix_now_s())
                });
                let meta = ItemMeta {
                    stale: true,
                    token_sent: false,
                    expire_at_s,
                    cas_override: new_cas.unwrap_or(0),
                    ..old_meta
                };
                let record = record::encode(key, &meta, &[old.data()]);
                self.put_record(key, record, false)?;
            }
            DeleteMode::RemoveValue {
                client_flags,
                exptime_s,
            } => {
                let meta = self.new_meta(client_flags, exptime_s, new_cas);
                self.put_record(key, record::encode(key, &meta, &[]), false)?;
            }
        }
        Ok(DeleteOutcome::Deleted)
    }

    /// Deletes `key` if its record is still version `version`, which the crawler found
    /// expired or flushed: a tombstone, so that garbage collection frees the record's room. An
    /// item stored again since is left alone. Returns whether it was deleted.
    pub fn reclaim(&self, key: &[u8], version: u64) -> StoreResult<bool> {
        let _stripe = self.stripe(key);
        match self.engine.write(key, &[], RecordKind::Tombstone, Condition::IfVersion(version))? {
            kura_engine::WriteOutcome::Written { .. } => {
                self.writes.fetch_add(1, Ordering::AcqRel);
                self.cache.update(key, None, false);
                self.changed(key);
                Ok(true)
            }
            kura_engine::WriteOutcome::ConditionFailed { .. } => Ok(false),
        }
    }

    /// `incr`, `decr` and `ma`, as memcached's `do_add_delta`.
    pub fn arith(&self, req: &ArithRequest<'_>) -> StoreResult<ArithOutcome> {
        let _stripe = self.stripe(req.key);
        let now_s = clock::unix_now_s();
        let Some(old) = self.read_live(req.key)? else {
            let Some((initial, vivify_exptime_s)) = req.vivify else {
                return Ok(ArithOutcome::NotFound);
            };
            let meta = self.new_meta(0, vivify_exptime_s, req.new_cas);
            let record = record::encode(req.key, &meta, &[initial.to_string().as_bytes()]);
            let (version, _) = self.put_record(req.key, record, true)?;
            self.count_item();
            return Ok(ArithOutcome::Value {
                value: initial,
                cas: self.item_cas(&meta, version),
                meta,
                created: true,
                old_expire_at_s: 0,
            });
        };
        // memcached's do_add_delta refuses an empty value before it compares CAS values.
        if old.data().is_empty() {
            return Ok(ArithOutcome::NonNumeric);
        }
        if req.compare_cas != 0 && req.compare_cas != old.cas() {
            return Ok(ArithOutcome::Exists);
        }
        let Some(current) = parse_counter(old.data()) else {
            return Ok(ArithOutcome::NonNumeric);
        };
        let value = match req.op {
            ArithmeticOp::Incr => current.wrapping_add(req.delta),
            ArithmeticOp::Decr => current.saturating_sub(req.delta),
        };
        let mut digits = value.to_string().into_bytes();
        // memcached rewrites in place when the number fits, padding with spaces,
        // and the item stays stale and won (`md I`, `mg` W) as it was; a longer
        // number goes to a new item, fresh.
        let in_place = digits.len() <= old.data().len();
        if in_place {
            digits.resize(old.data().len(), b' ');
        }
        let old_meta = *old.meta();
        let expire_at_s = req
            .exptime_s
            .map_or(old_meta.expire_at_s, |e| clock::expire_at_s(e, now_s));
        let meta = ItemMeta {
            expire_at_s,
            stale: in_place && old_meta.stale,
            token_sent: in_place && old_meta.token_sent,
            ..self.new_meta(old_meta.client_flags, 0, req.new_cas)
        };
        let record = record::encode(req.key, &meta, &[&digits]);
        let (version, _) = self.put_record(req.key, record, true)?;
        Ok(ArithOutcome::Value {
            value,
            cas: self.item_cas(&meta, version),
            meta,
            created: false,
            old_expire_at_s: old_meta.expire_at_s,
        })
    }

    /// `touch` and `gat`: a new exptime, the same CAS value. Returns the touched record.
    pub fn touch(&self, key: &[u8], exptime_s: i64) -> StoreResult<Option<Found>> {
        let _stripe = self.stripe(key);
        let Some(old) = self.read_live(key)? else {
            return Ok(None);
        };
        let meta = ItemMeta {
            expire_at_s: clock::expire_at_s(exptime_s, clock::unix_now_s()),
            cas_override: old.cas(),
            ..*old.meta()
        };
        let record = record::encode(key, &meta, &[old.data()]);
        let (version, view) = self.put_record(key, record, true)?;
        Ok(self.found_after_write(key, version, view))
    }

    /// The record just written (from the RAM cache, which holds it unless it is off or too small).
    fn found_after_write(&self, key: &[u8], version: u64, view: RecordView) -> Option<Found> {
        match self.cache.probe(key) {
            Probe::Hit(record) if record.version == version => Some(Found {
                cas_enabled: self.cas_enabled,
                view,
                version,
                holder: Holder::Cached(record),
            }),
            _ => self
                .engine
                .get(key)
                .ok()
                .flatten()
                .filter(|item| item.version == version)
                .map(|item| Found {
                    cas_enabled: self.cas_enabled,
                    holder: Holder::Flash(item),
                    view,
                    version,
                }),
        }
    }

    /// `mg` with flags that may write (`T`, `N`, `R`, or a stale item to win).
    pub fn meta_get(
        &self,
        key: &[u8],
        options: &MetaGetOptions,
    ) -> StoreResult<Option<MetaGetResult>> {
        let _stripe = self.stripe(key);
        let now_s = clock::unix_now_s();
        let Some(old) = self.read_live(key)? else {
            let Some(vivify_exptime_s) = options.vivify_exptime_s else {
                return Ok(None);
            };
            let meta = ItemMeta {
                token_sent: true,
                ..self.new_meta(0, vivify_exptime_s, None)
            };
            let (version, view) = self.put_record(key, record::encode(key, &meta, &[]), true)?;
            let Some(found) = self.found_after_write(key, version, view) else {
                return Ok(None);
            };
            return Ok(Some(MetaGetResult {
                found,
                win_sent: false,
                won: true,
                created: true,
                hit_before: false,
                last_access_s: 0,
                old_expire_at_s: 0,
            }));
        };
        let (hit_before, last_access_s) = old.access(now_s);
        let mut meta = *old.meta();
        let win_sent = meta.token_sent;
        let mut won = false;
        if let Some(exptime_s) = options.exptime_s {
            meta.expire_at_s = clock::expire_at_s(exptime_s, now_s);
        }
        if let Some(recache_s) = options.recache_exptime_s
            && !meta.token_sent
            && meta.expire_at_s != 0
            && meta.expire_at_s < clock::expire_at_s(recache_s, now_s)
        {
            won = true;
        }
        if meta.stale && !meta.token_sent {
            won = true;
        }
        meta.token_sent |= won;
        let old_expire_at_s = old.meta().expire_at_s;
        let result = |found: Found| MetaGetResult {
            found,
            win_sent,
            won,
            created: false,
            hit_before,
            last_access_s,
            old_expire_at_s,
        };
        if meta == *old.meta() {
            if !options.no_update
                && let Holder::Cached(record) = &old.holder
            {
                record.touch(now_s);
            }
            return Ok(Some(result(old)));
        }
        let meta = ItemMeta {
            cas_override: old.cas(),
            ..meta
        };
        let (version, view) =
            self.put_record(key, record::encode(key, &meta, &[old.data()]), true)?;
        Ok(self.found_after_write(key, version, view).map(result))
    }

    /// `flush_all [delay]`: a new flush horizon, saved and synced.
    pub fn flush_all(&self, delay_s: Option<i64>) -> StoreResult<()> {
        let _flush = self.flush_lock.lock();
        let now_s = clock::unix_now_s();
        let now_us = clock::unix_now_us();
        let state = match delay_s {
            Some(delay) if delay > 0 => {
                let at_s = clock::expire_at_s(delay, now_s);
                if at_s > now_s {
                    self.flush.flush_later(at_s as u64 * 1_000_000, now_us)
                } else {
                    self.flush.flush_now(self.clock.tick(), now_us)
                }
            }
            _ => self.flush.flush_now(self.clock.tick(), now_us),
        };
        if state.pending_us == 0 {
            self.cache.clear();
        }
        self.engine.put(&FLUSH_STATE_KEY, &state.encode())?;
        self.engine.sync()?;
        // A delayed flush takes effect later without a change of its own: clients' copies
        // of records may outlive it until the next change (kura's file system writes no
        // expiring or flushed keys).
        if let Some(changes) = self.changes.get() {
            changes.bump_all();
        }
        Ok(())
    }

    /// Items the engine holds (an estimate that still counts expired items), less the reserved key.
    pub fn curr_items(&self, engine_stats: &kura_engine::Stats) -> u64 {
        engine_stats
            .keys_estimate
            .saturating_sub(u64::from(self.flush.state() != FlushState::default()))
    }
}

/// memcached's `safe_strtoull` over a counter's data: optional leading white
/// space and sign, decimal digits, then white space or the end; no overflow,
/// and a `-` only where the result is small (so `-0` is 0 and `-1` is refused).
pub fn parse_counter(data: &[u8]) -> Option<u64> {
    let is_space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r');
    let start = data.iter().position(|&b| !is_space(b))?;
    let rest = &data[start..];
    let (negative, digits_at) = match rest.first() {
        Some(b'-') => (true, 1),
        Some(b'+') => (false, 1),
        _ => (false, 0),
    };
    let digits = &rest[digits_at..];
    let len = digits
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    if len == 0 {
        return None;
    }
    if let Some(&next) = digits.get(len)
        && !is_space(next)
    {
        return None;
    }
    let mut value: u64 = 0;
    for &d in &digits[..len] {
        value = value.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    if negative {
        let negated = value.wrapping_neg();
        // strtoull negates; safe_strtoull refuses results that look negative as signed.
        return if (negated as i64) < 0 {
            None
        } else {
            Some(negated)
        };
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse_as_memcached() {
        assert_eq!(parse_counter(b"0"), Some(0));
        assert_eq!(parse_counter(b"42"), Some(42));
        assert_eq!(parse_counter(b"  7"), Some(7));
        assert_eq!(parse_counter(b"+3"), Some(3));
        assert_eq!(parse_counter(b"9 "), Some(9));
        assert_eq!(parse_counter(b"12 abc"), Some(12));
        assert_eq!(parse_counter(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_counter(b"18446744073709551616"), None);
        assert_eq!(parse_counter(b"-0"), Some(0));
        assert_eq!(parse_counter(b"-1"), None);
        assert_eq!(parse_counter(b""), None);
        assert_eq!(parse_counter(b"   "), None);
        assert_eq!(parse_counter(b"abc"), None);
        assert_eq!(parse_counter(b"12abc"), None);
        assert_eq!(parse_counter(b"-"), None);
    }

    #[test]
    fn block_sizes_hold_four_of_the_largest_item() {
        assert_eq!(block_size_for(1 << 20), 4 << 20);
        assert_eq!(block_size_for(2 << 20), 8 << 20);
        assert_eq!(block_size_for(64 << 10), 4 << 20);
        for limit in [1024, 100_000, 1 << 20, 5 << 20] {
            assert!(block_size_for(limit) / 4 >= limit as u64);
        }
    }

    #[test]
    fn reserved_key_is_unreachable() {
        assert_eq!(FLUSH_STATE_KEY.len(), KEY_LENGTH_MAX);
        assert_eq!(FLUSH_STATE_KEY[0], 0);
    }
}
