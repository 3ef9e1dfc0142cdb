//! The file system's view of the pool: versioned gets and compare-and-swap writes for
//! metadata, plain batched gets/sets/deletes for data chunks, and a durability barrier.
//!
//! [`PoolKv`] implements it over `kura_pool`: data goes through the calling thread's own pool
//! [`Context`] (the paper's per-thread channel; requests of one call leave together). The
//! pool has no compare-and-swap yet, so [`PoolKv`] speaks it itself, per node the pool places
//! the key on, over a small blocking side connection of this thread to that node (timeouts,
//! bounded replies, made again in the child after a `fork`):
//!
//! * embedded pool: the engine directly (its versions and conditional writes);
//! * memcached-protocol nodes (`kura serve`, memcached): the meta protocol's CAS (`mg k v c`,
//!   `ms k n C<cas>`, `ms k n ME`, `md k C<cas>`);
//! * redis-server / Valkey nodes (`redis://`): RESP, see [`redis`]. A metadata value is stored
//!   as an 8-byte little-endian version followed by the record; the version is a random
//!   nonzero u64 chosen for each write (a deleted and re-created key never gets an old
//!   version back: no ABA). A conditional write or delete is one server-side Lua script
//!   (`EVALSHA`, `EVAL` on `NOSCRIPT`) that compares the stored prefix with the expected one;
//!   `Absent` is `SET … NX`, `Always` a plain `SET`/`DEL`, a read a plain `GET`.
//! * Redis Cluster (`redis+cluster://`) is refused: a side connection would have to follow
//!   the cluster's slot routing (`MOVED`/`ASK`, fail-over), which only the pool's own
//!   connections do.
//!
//! Metadata keys (superblock, inode counter, inodes, directory buckets) are read only through
//! [`Kv::get_versioned`] and [`Kv::get_meta_many`] (which strips the Redis version prefix);
//! the plain data calls carry chunks, whose values are stored as they are on every backend.
//! The one plain call on metadata keys is `delete_many` of a removed directory's buckets,
//! which is a plain delete on every backend. [`Kv::flush`] is the pool's barrier and covers the
//! side connections' writes too: on Redis it is `PING` per node, or, with `replicas=N`, a
//! scratch write and `WAIT`, which waits for every write the master acknowledged before it
//! (the scripts' writes are replicated like any other). When the pool gains versioned get
//! and CAS set/delete, [`PoolKv`]'s CAS half becomes three calls on the context.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use kura_pool::stream::NodeStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kura_engine::{Condition, Engine, RecordKind, WriteOutcome};
use kura_pool::{Backend, Context, NodeSpec, Outcome, Pool};
use kura_pool::fd::keeping_errno;

use crate::bounded::BytesBounded;
use crate::error::{FsError, Result, is_out_of_space};

pub mod redis;

use redis::RespConn;

/// A value and its version, when the key has one.
pub type Versioned = Option<(Vec<u8>, u64)>;

/// When a conditional write proceeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    Always,
    /// Only if the key has no value.
    Absent,
    /// Only if the key's value has this version.
    Version(u64),
}

/// A data value read along with a write ([`Kv::put_cond_reading`]): `None` when it was not
/// read, `Some(None)` when it is absent.
pub type AlsoRead = Option<Option<Vec<u8>>>;

/// One write of [`Kv::write_many`].
#[derive(Debug, Clone, Copy)]
pub enum WriteOp<'a> {
    /// [`Kv::put_cond`]: `Some(new version)`, or `None` when the condition did not hold.
    Put(&'a [u8], &'a [u8], Cond),
    /// [`Kv::delete_cond`]: `Some(0)` when deleted, `None` when the condition did not hold.
    Delete(&'a [u8], Cond),
}

impl WriteOp<'_> {
    fn key(&self) -> &[u8] {
        match *self {
            WriteOp::Put(key, _, _) | WriteOp::Delete(key, _) => key,
        }
    }

    /// The write alone, through `kv`'s single-record calls.
    pub fn apply<K: Kv + ?Sized>(&self, kv: &K) -> Result<Option<u64>> {
        match *self {
            WriteOp::Put(key, value, cond) => kv.put_cond(key, value, cond),
            WriteOp::Delete(key, cond) => Ok(kv.delete_cond(key, cond)?.then_some(0)),
        }
    }
}

/// What the file system needs from a key-value store.
pub trait Kv: Send + Sync {
    /// The value and its version (a CAS token).
    fn get_versioned(&self, key: &[u8]) -> Result<Option<(Vec<u8>, u64)>>;
    /// Writes when `cond` holds: `Some(new version)`, or `None` when it did not hold.
    fn put_cond(&self, key: &[u8], value: &[u8], cond: Cond) -> Result<Option<u64>>;
    /// [`Kv::put_cond`], and a read of the data value `also` (a small file's first chunk, at
    /// the swap that records its opener) in the same round trip where the backend allows: the
    /// value read, or `None` when it was not read.
    fn put_cond_reading(&self, key: &[u8], value: &[u8], cond: Cond, also: &[u8]) -> Result<(Option<u64>, AlsoRead)> {
        let _ = also;
        Ok((self.put_cond(key, value, cond)?, None))
    }
    /// Deletes when `cond` holds (`Always`: whether or not it existed; `Absent`: nothing to
    /// delete); `false` when it did not.
    fn delete_cond(&self, key: &[u8], cond: Cond) -> Result<bool>;
    /// Several [`Kv::get_versioned`] at once: one result per key, in order (one round trip per
    /// node where the backend allows).
    fn get_versioned_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        keys.iter().map(|key| self.get_versioned(key)).collect()
    }
    /// Several [`Kv::get_versioned`] read in the order given, as one after another would read
    /// them (a path walk's records, see [`crate::memo`]): consecutive keys of one node go out
    /// together, in one round trip, and a node's batch only after the previous node answered.
    fn get_versioned_in_order(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        keys.iter().map(|key| self.get_versioned(key)).collect()
    }
    /// Several conditional writes, each decided on its own (not a transaction: a later one is
    /// applied whatever an earlier one's outcome), in the order given; consecutive writes to
    /// one node go out together, in one round trip, where the backend allows. One result per
    /// write, in order (see [`WriteOp`]).
    fn write_many(&self, writes: &[WriteOp]) -> Result<Vec<Option<u64>>> {
        writes.iter().map(|write| write.apply(self)).collect()
    }
    /// Gets many metadata values at once, as [`Kv::get_versioned`] would return them (without
    /// the versions); one result per key, in order.
    fn get_meta_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        keys.iter().map(|key| Ok(self.get_versioned(key)?.map(|(value, _)| value))).collect()
    }
    /// Gets many data values at once (one result per key, in order).
    fn get_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>>;
    /// Which of many data keys hold a value (one result per key, in order), without the
    /// values crossing the network where the backend can tell (see
    /// [`kura_pool::Context::submit_exists`]).
    fn exists_many(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>> {
        Ok(self.get_many(keys)?.into_iter().map(|value| value.is_some()).collect())
    }
    /// Gets one data value into `out` (cleared first); `false` when absent.
    fn get_into(&self, key: &[u8], out: &mut Vec<u8>) -> Result<bool>;
    fn set_many(&self, items: &[(Vec<u8>, Vec<u8>)]) -> Result<()>;
    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<()>;
    /// A durability barrier over every write acknowledged before it.
    fn flush(&self) -> Result<()>;
    /// Whether the store lives in this process (an embedded engine): what it was given and
    /// not yet made durable ([`Kv::flush`]) is in this process's memory only, and gone for the
    /// next process when this one ends.
    fn in_process(&self) -> bool {
        false
    }
    /// The pool's room as its nodes report it (`statfs`); `None` when they cannot tell.
    fn space(&self) -> Result<Option<PoolSpace>> {
        Ok(None)
    }
}

/// How much the pool holds and has room for, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpace {
    /// Every node's capacity, summed.
    pub total_bytes: u64,
    /// Every node's unused capacity, summed.
    pub free_bytes: u64,
    /// What can be written before the first node is full: keys spread over the nodes by
    /// weight, so the node with the least room for its share ends the writes.
    pub available_bytes: u64,
}

impl PoolSpace {
    /// The pool's room from each node's `(capacity, used, weight)`.
    pub fn of_nodes(nodes: &[(u64, u64, u32)]) -> Self {
        let total_bytes = nodes.iter().map(|n| n.0).sum();
        let free_bytes = nodes.iter().map(|n| n.0.saturating_sub(n.1)).sum();
        let weights: u64 = nodes.iter().map(|n| u64::from(n.2)).sum();
        let available_bytes = nodes
            .iter()
            .filter(|n| n.2 > 0)
            .map(|&(capacity, used, weight)| (u128::from(capacity.saturating_sub(used)) * u128::from(weights) / u128::from(weight)).min(u128::from(u64::MAX)) as u64)
            .min()
            .unwrap_or(0)
            .min(free_bytes);
        Self { total_bytes, free_bytes, available_bytes }
    }
}

/// How long a metadata connection waits to connect, and for an answer.
const META_CONNECT_TIMEOUT_MS: u64 = 1000;
const META_IO_TIMEOUT_MS: u64 = 5000;
/// Largest value a metadata reply may carry (a directory bucket or inode).
const META_VALUE_BYTES_MAX: usize = 1 << 20;
/// Lines of a `stats` reply read, at most (memcached 1.6 sends about 90).
const STATS_LINES_MAX: usize = 1000;

/// Distinguishes pools, for the per-thread state.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's pool context (per pool), and the process it was made in: after `fork` a
    /// child must not use its parent's connections.
    static CONTEXTS: RefCell<Vec<(u64, u32, Context)>> = const { RefCell::new(Vec::new()) };
    /// This thread's metadata connections, per node (backend and address), and the process
    /// each was made in.
    static META_CONNS: RefCell<HashMap<String, (u32, SideConn)>> = RefCell::new(HashMap::new());
}

/// [`Kv`] over a `kura_pool` pool (see the module documentation).
pub struct PoolKv {
    pool: Pool,
    id: u64,
    /// The embedded engine, whose locks are parking_lot's: no forked child reaches it (the
    /// preload refuses a child its parent's engine; see [`crate::sync`]).
    engine: Option<Engine>,
    /// Some node is a redis-server: its metadata values carry a version prefix.
    redis: bool,
    /// Metadata records kept in RAM: the embedded engine's (always current: every change
    /// passes through here), or, on a pool of kura servers on this host, copies trusted while
    /// the servers' change counters stand still (see [`Changes`]).
    meta_cache: MetaCache,
    /// The servers' change counters, on a pool of kura servers only.
    changes: Option<crate::sync::Mutex<Changes>>,
    /// The directory where copies are shared with the host's other processes (see
    /// [`crate::copies`]), and the table, mapped once the counters are found (`None` inside
    /// when it cannot be).
    shared_copies_dir: Option<std::path::PathBuf>,
    shared_copies: std::sync::OnceLock<Option<crate::copies::SharedCopies>>,
    /// The pool's servers, as the shared copies tell pools apart: a hash of their instance ids
    /// (0 until the counters are found).
    pool_tag: AtomicU64,
    /// The pool's stores, which name the shared table: a hash of their change files' paths.
    stores_tag: AtomicU64,
    /// Each node's log as read for the shared table's copies.
    change_index: crate::sync::Mutex<Vec<ChangeIndex>>,
}

/// Metadata reads on a networked pool before the file system looks for its servers' change
/// counters: the first read makes the metadata connections, which ask each kura server for
/// its counter's file with their first request (`stats changes`, in the same round trip), so
/// the look after it costs no round trip.
pub const CHANGES_DISCOVER_AFTER_READS: u32 = 1;
/// How long after a failed look, or after a counter stopped being trusted (a server gone,
/// restarted or silent), the next look is made.
pub const CHANGES_RETRY_MS: u64 = 10_000;

/// Whether copies of metadata records read from a pool of kura servers may be trusted.
///
/// Each kura server on this host publishes a counter of the changes to its store, and a log
/// of the keys the latest changes were to ([`kura_engine::changes`]), counted after each
/// change is visible and before it is acknowledged. A copy of a record read when its node's
/// counter stood at `a` is what a read would return now, at `b`, when no change `a + 1 ..= b`
/// was to its key: a `stat` is then answered without a round trip, and a change elsewhere in
/// the pool (a program appending to a log, `git status` writing its index) leaves the other
/// copies be. When the log cannot tell (more changes went by than it holds, or one was to
/// everything) every copy goes. Nodes on other hosts publish no counter this process can
/// map, and nothing is kept.
enum Changes {
    /// Not looked for yet: the metadata reads so far.
    Unknown { reads: u32 },
    /// Every node's counter and log, in the pool's node order.
    Views(std::sync::Arc<Vec<kura_engine::changes::ChangeView>>),
    /// Not available (or no longer trusted); looked for again at this `monotonic_ms`.
    Unavailable { retry_at_ms: u64 },
}

/// The pool's change counters and logs, as the copies read them: the servers' change files,
/// or a model of them in tests.
trait ChangeLog {
    /// Every node's change counter now, in the pool's node order; `None` when one is not
    /// trusted.
    fn counters(&self) -> Option<Vec<u64>>;
    /// Calls `each` with the key tag ([`kura_engine::changes::change_tag`]) of every change
    /// of node `node` after its counter stood at `from` up to `to`; `false` when its log
    /// cannot tell them all (see [`kura_engine::changes::ChangeView::changes_between`]).
    fn changes_between(&self, node: usize, from: u64, to: u64, each: impl FnMut(u64)) -> bool;
}

impl ChangeLog for [kura_engine::changes::ChangeView] {
    fn counters(&self) -> Option<Vec<u64>> {
        self.iter().map(kura_engine::changes::ChangeView::counter).collect()
    }

    fn changes_between(&self, node: usize, from: u64, to: u64, each: impl FnMut(u64)) -> bool {
        self[node].changes_between(from, to, each)
    }
}

/// Changes a read (or a process's own write) may span and still be kept as a copy: what
/// went by between the counters loaded before it and after it, scanned for its keys.
const KEEP_CHANGES_MAX: u64 = 4096;

/// One node's log as far as this process read it for the shared table's copies: the last
/// change to each key tag among changes `lo + 1 ..= hi`. A shared copy kept when the node's
/// counter stood at `a`, `lo <= a`, is current at `hi` when its tag has no change after `a`.
/// Each entry of the log is read once per process, not once per copy taken (a new process
/// takes hundreds of copies kept before the same few thousand changes); at most a log's
/// worth ([`kura_engine::changes::CHANGES_LOG_ENTRIES`]) is indexed.
#[derive(Debug, Default)]
struct ChangeIndex {
    lo: u64,
    hi: u64,
    last: HashMap<u64, u64>,
}

impl ChangeIndex {
    /// Extends the index to changes `from + 1 ..= to` of node `node` (from where it is);
    /// whether it now covers them.
    fn cover(&mut self, log: &(impl ChangeLog + ?Sized), node: usize, from: u64, to: u64) -> bool {
        if self.hi < to {
            // Nothing indexed yet (a server's counter starts above 0), or more than a log's worth.
            let start = if self.hi == 0 || to - self.lo > kura_engine::changes::CHANGES_LOG_ENTRIES { to } else { self.hi };
            if start == to {
                *self = Self { lo: to, hi: to, last: HashMap::new() };
            } else {
                let mut n = start;
                let last = &mut self.last;
                if !log.changes_between(node, start, to, |tag| {
                    n += 1;
                    last.insert(tag, n);
                }) {
                    *self = Self { lo: to, hi: to, last: HashMap::new() };
                } else {
                    self.hi = to;
                }
            }
        }
        if from < self.lo {
            // Older changes: a tag seen later keeps its later change.
            let mut n = from;
            let mut older = HashMap::new();
            if !log.changes_between(node, from, self.lo, |tag| {
                n += 1;
                older.insert(tag, n);
            }) {
                return false;
            }
            for (tag, n) in older {
                self.last.entry(tag).or_insert(n);
            }
            self.lo = from;
        }
        from >= self.lo && to <= self.hi
    }

    /// Whether the key of tag `tag` changed after change `after` (within the index).
    fn changed_after(&self, tag: u64, after: u64) -> bool {
        self.last.get(&tag).is_some_and(|&n| n > after)
    }
}

/// Bytes of metadata records (keys and values) [`MetaCache`] keeps, at most; it starts over
/// when full.
pub const META_CACHE_BYTES_MAX: usize = 8 << 20;
/// Bytes charged per cached record besides its key and value.
const META_CACHE_ENTRY_OVERHEAD_BYTES: usize = 64;

/// Metadata records (inodes, directory buckets, and the absence of records looked up) kept
/// in RAM.
///
/// The embedded engine's, as last read or written here: an embedded engine has one user,
/// this process (a child may not use it, see `kura-preload`), so every change to a record
/// passes through [`PoolKv`] and updates its copy: the copy is never stale, and a `stat`
/// does not read the device. A read that raced with a write does not put what it read back
/// (see [`MetaCache::fill`]).
///
/// On a pool of kura servers, copies current at the nodes' change counters in `at`, brought
/// forward by their change logs (see [`Changes`]).
#[derive(Debug, Default)]
struct MetaCache {
    inner: crate::sync::Mutex<MetaCacheInner>,
}

#[derive(Debug, Default)]
struct MetaCacheInner {
    /// By the key's change tag: the key and its record (a key that shares its tag with
    /// another takes the other's place).
    records: BytesBounded<u64, (Box<[u8]>, Versioned), META_CACHE_BYTES_MAX>,
    /// Changes made so far (see [`MetaCache::fill`]).
    writes: u64,
    /// On a networked pool: each node's change counter the copies are current at (empty
    /// before the first look).
    at: Vec<u64>,
}

impl MetaCacheInner {
    fn charge(key: &[u8], record: &Versioned) -> usize {
        key.len() + record.as_ref().map_or(0, |(value, _)| value.len()) + META_CACHE_ENTRY_OVERHEAD_BYTES
    }

    fn get(&self, key: &[u8]) -> Option<&Versioned> {
        self.records.get(&kura_engine::changes::change_tag(key)).filter(|(held, _)| **held == *key).map(|(_, record)| record)
    }

    fn put(&mut self, key: &[u8], record: Versioned) {
        let charge = Self::charge(key, &record);
        self.records.insert(kura_engine::changes::change_tag(key), (key.into(), record), charge);
    }

    fn remove(&mut self, key: &[u8]) {
        self.records.remove(&kura_engine::changes::change_tag(key));
    }

    /// Networked pool: brings the copies forward to the nodes' counters now, dropping those
    /// whose keys changed meanwhile (all of them when a log cannot tell); `false` (and no
    /// copies) when a counter is not trusted.
    fn catch_up(&mut self, log: &(impl ChangeLog + ?Sized)) -> bool {
        let Some(now) = log.counters() else {
            *self = Self { writes: self.writes, ..Self::default() };
            return false;
        };
        if self.at.len() != now.len() {
            self.records = BytesBounded::default();
        } else {
            for (node, (&was, &is)) in self.at.iter().zip(&now).enumerate() {
                if was != is {
                    let records = &mut self.records;
                    if !log.changes_between(node, was, is, |tag| {
                        records.remove(&tag);
                    }) {
                        *records = BytesBounded::default();
                    }
                }
            }
        }
        self.at = now;
        true
    }
}

impl MetaCache {
    fn get(&self, key: &[u8]) -> Option<Versioned> {
        self.inner.lock().get(key).cloned()
    }

    /// The change count before a read of the engine, for [`MetaCache::fill`].
    fn begin_read(&self) -> u64 {
        self.inner.lock().writes
    }

    /// Keeps what a read found, unless some record changed since the read began (the read may
    /// have found the record before a change that already updated the copy).
    fn fill(&self, key: &[u8], record: &Versioned, began: u64) {
        let mut inner = self.inner.lock();
        if inner.writes == began {
            inner.put(key, record.clone());
        }
    }

    /// A record changed: `Some`: to this (`Some(None)`: deleted); `None`: unknown (forget it).
    fn wrote(&self, key: &[u8], record: Option<Versioned>) {
        let mut inner = self.inner.lock();
        inner.writes += 1;
        match record {
            Some(record) => inner.put(key, record),
            None => inner.remove(key),
        }
    }

    /// Networked pool: the copies of `keys` current now (`None` for a key not held), and the
    /// nodes' counters they are current at; `None` when a counter is not trusted.
    fn get_many_now(&self, keys: &[Vec<u8>], log: &(impl ChangeLog + ?Sized)) -> Option<(Vec<Option<Versioned>>, Vec<u64>)> {
        let mut inner = self.inner.lock();
        if !inner.catch_up(log) {
            return None;
        }
        Some((keys.iter().map(|key| inner.get(key).cloned()).collect(), inner.at.clone()))
    }

    /// Networked pool: keeps `records`, each `(key, record, own)`: the record as a read found
    /// it, or as this process's own `own` changes to it left it, after the nodes' counters
    /// stood at `from`. A record is kept when the logs name its key exactly `own` times since
    /// `from`: no one else changed it since it was read, or since this process changed it.
    /// Returns the counters the copies are now current at, and which records were kept.
    fn keep(&self, log: &(impl ChangeLog + ?Sized), from: &[u64], records: &[(&[u8], &Versioned, u32)]) -> Option<(Vec<u64>, Vec<bool>)> {
        let mut inner = self.inner.lock();
        if !inner.catch_up(log) || inner.at.len() != from.len() {
            return None;
        }
        // The keys changed since `from`, counted. Changes of other nodes can only name one of
        // these keys by a tag shared with another key: a copy not kept for nothing.
        let mut changed: HashMap<u64, u32> = HashMap::new();
        for (node, (&was, &is)) in from.iter().zip(&inner.at).enumerate() {
            if is != was && (is < was || is - was > KEEP_CHANGES_MAX || !log.changes_between(node, was, is, |tag| *changed.entry(tag).or_default() += 1)) {
                return None;
            }
        }
        let mut kept = vec![false; records.len()];
        for ((key, record, own), kept) in records.iter().zip(kept.iter_mut()) {
            if changed.get(&kura_engine::changes::change_tag(key)).copied().unwrap_or(0) == *own {
                inner.put(key, (*record).clone());
                *kept = true;
            }
        }
        Some((inner.at.clone(), kept))
    }

    /// Networked pool: drops every copy and the counters they were current at (the pool's
    /// servers changed).
    fn restart(&self) {
        *self.inner.lock() = MetaCacheInner::default();
    }

    /// Forgets `keys` (written or deleted without their new state at hand).
    fn forget<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) {
        let mut inner = self.inner.lock();
        inner.writes += 1;
        for key in keys {
            inner.remove(key);
        }
    }
}

impl PoolKv {
    /// Refuses pools with nodes it cannot do compare-and-swap on (Redis Cluster).
    pub fn new(pool: Pool) -> Result<Self> {
        let engine = pool.engine().cloned();
        if engine.is_none() {
            for node in &pool.config().nodes {
                match node.backend {
                    Backend::Kura | Backend::Memcached | Backend::Redis => {}
                    Backend::RedisCluster => {
                        return Err(FsError::Io(format!(
                            "the file system cannot use the Redis Cluster {}: it needs compare-and-swap, which \
                             kura_pool does not offer yet, and speaks it itself (a Lua script on a connection \
                             of its own) only to single redis-server nodes (redis://), not through a cluster's \
                             slot routing (MOVED/ASK, fail-over); use kura://, memcached:// or redis:// nodes",
                            node.name()
                        )));
                    }
                    Backend::Embedded => {
                        return Err(FsError::Io(format!("the embedded node {} is not open in this pool", node.name())));
                    }
                }
            }
        }
        let redis = engine.is_none() && pool.config().nodes.iter().any(|n| n.backend == Backend::Redis);
        let changes = (engine.is_none() && pool.config().nodes.iter().all(|n| n.backend == Backend::Kura))
            .then(|| crate::sync::Mutex::new(Changes::Unknown { reads: 0 }));
        Ok(Self {
            pool,
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            engine,
            redis,
            meta_cache: MetaCache::default(),
            changes,
            shared_copies_dir: None,
            shared_copies: std::sync::OnceLock::new(),
            pool_tag: AtomicU64::new(0),
            stores_tag: AtomicU64::new(0),
            change_index: crate::sync::Mutex::default(),
        })
    }

    /// Shares copies of records with the host's other processes that use the same pool, in a
    /// table in `dir` (one per user and the pool's stores, made when missing; see
    /// [`crate::copies`]), on pools where copies are kept at all.
    pub fn with_shared_copies(mut self, dir: std::path::PathBuf) -> Self {
        self.shared_copies_dir = Some(dir);
        self
    }

    /// The shared table, when there is one (mapped at the first use, once the counters are
    /// found).
    fn shared(&self) -> Option<&crate::copies::SharedCopies> {
        let dir = self.shared_copies_dir.as_ref()?;
        self.shared_copies
            .get_or_init(|| {
                // SAFETY: geteuid cannot fail and touches no memory.
                let uid = unsafe { libc::geteuid() };
                let path = dir.join(crate::copies::shared_copies_file_name(self.stores_tag.load(Ordering::Relaxed), uid));
                keeping_errno(|| crate::copies::SharedCopies::open(&path, crate::copies::SHARED_COPIES_SLOTS))
                    .map_err(|error| tracing::debug!(path = %path.display(), %error, "not sharing copies of records"))
                    .ok()
            })
            .as_ref()
    }

    /// Takes, for the keys of `keys` not held (`None` in `held`), the shared table's copies
    /// that are current at the nodes' counters `at` (as [`MetaCache::get_many_now`] gave
    /// them): the table's copy of a key is current at its node's counter when it was kept,
    /// and still is when the log names no change to the key since. Those taken are kept as
    /// this process's own, and the table's brought forward.
    fn take_shared(&self, log: &[kura_engine::changes::ChangeView], keys: &[Vec<u8>], held: &mut [Option<Versioned>], at: &[u64]) {
        let Some(shared) = self.shared() else {
            return;
        };
        let pool = self.pool_tag.load(Ordering::Relaxed);
        let mut taken: Vec<(&[u8], Versioned)> = Vec::new();
        let mut index = self.change_index.lock();
        if index.len() != at.len() {
            *index = at.iter().map(|_| ChangeIndex::default()).collect();
        }
        for (key, slot) in keys.iter().zip(held.iter_mut()).filter(|(_, h)| h.is_none()) {
            let Some((kept_at, record)) = shared.get(pool, key) else {
                continue;
            };
            let node = self.pool.node_index_of(key);
            let Some(&now) = at.get(node) else {
                continue;
            };
            let current = kept_at == now
                || (kept_at < now && index[node].cover(log, node, kept_at, now) && !index[node].changed_after(kura_engine::changes::change_tag(key), kept_at));
            if current {
                *slot = Some(record.clone());
                taken.push((key, record));
            }
        }
        drop(index);
        if !taken.is_empty() {
            let records: Vec<(&[u8], &Versioned, u32)> = taken.iter().map(|(key, record)| (*key, record, 0)).collect();
            self.keep(log, at, &records);
        }
    }

    /// Keeps `records` (see [`MetaCache::keep`]) as this process's copies and, those kept,
    /// in the shared table.
    fn keep(&self, log: &[kura_engine::changes::ChangeView], from: &[u64], records: &[(&[u8], &Versioned, u32)]) {
        let Some((at, kept)) = self.meta_cache.keep(log, from, records) else {
            return;
        };
        if let Some(shared) = self.shared() {
            let pool = self.pool_tag.load(Ordering::Relaxed);
            for ((key, record, _), _) in records.iter().zip(kept).filter(|(_, kept)| *kept) {
                if let Some(&node_at) = at.get(self.pool.node_index_of(key)) {
                    shared.put(pool, node_at, key, record);
                }
            }
        }
    }

    /// The pool's change counters and logs once found, `None` otherwise (see [`Changes`]);
    /// their users load the counters, and a counter not trusted ends them
    /// ([`PoolKv::distrust`]). `discover`: count this as a metadata read and look for the
    /// counters when it is time.
    fn change_log(&self, discover: bool) -> Option<std::sync::Arc<Vec<kura_engine::changes::ChangeView>>> {
        let changes = self.changes.as_ref()?;
        let mut state = changes.lock();
        let look = match &mut *state {
            Changes::Views(views) => return Some(std::sync::Arc::clone(views)),
            Changes::Unknown { reads } => {
                *reads += u32::from(discover);
                discover && *reads > CHANGES_DISCOVER_AFTER_READS
            }
            Changes::Unavailable { retry_at_ms } => discover && kura_engine::changes::monotonic_ms() >= *retry_at_ms,
        };
        if !look {
            return None;
        }
        // One look at a time: the others go on without copies meanwhile.
        *state = Changes::Unavailable { retry_at_ms: kura_engine::changes::monotonic_ms() + CHANGES_RETRY_MS };
        drop(state);
        let views = keeping_errno(|| self.look_for_changes())?;
        views.counters()?;
        let instances: Vec<u8> = views.iter().flat_map(|view| view.instance_id().to_le_bytes()).collect();
        let stores: Vec<u8> = views.iter().flat_map(|view| view.path().as_os_str().as_encoded_bytes().iter().copied().chain([0])).collect();
        self.stores_tag.store(xxhash_rust::xxh3::xxh3_64(&stores), Ordering::Relaxed);
        self.pool_tag.store(xxhash_rust::xxh3::xxh3_64(&instances) | 1, Ordering::Relaxed);
        // Counts of other servers (a restarted pool, a store made again) say nothing of the
        // copies kept before: they go.
        self.meta_cache.restart();
        self.change_index.lock().clear();
        let views = std::sync::Arc::new(views);
        *changes.lock() = Changes::Views(std::sync::Arc::clone(&views));
        Some(views)
    }

    /// Every node's change counter, mapped from the file its `stats` names (`None` when a node
    /// names none, or its file is not reachable here: another host).
    fn look_for_changes(&self) -> Option<Vec<kura_engine::changes::ChangeView>> {
        let mut views = Vec::new();
        for node in &self.pool.config().nodes {
            let found = match self.with_meta_node(node, SideConn::changes_file) {
                Ok(Some((path, instance_id))) => kura_engine::changes::ChangeView::open(std::path::Path::new(&path), instance_id).map_err(|e| e.to_string()),
                Ok(None) => Err("it publishes no change counter".to_owned()),
                Err(e) => Err(e.to_string()),
            };
            match found {
                Ok(view) => views.push(view),
                Err(error) => {
                    tracing::debug!(node = %node.name(), %error, "no change counter of this node here; not keeping copies of records");
                    return None;
                }
            }
        }
        tracing::debug!(nodes = views.len(), "keeping copies of metadata records while the servers' change counters stand still");
        Some(views)
    }

    /// A counter of `log` is no longer trusted (its server restarted, stopped or went
    /// silent): no copies until the next look, [`CHANGES_RETRY_MS`] later (unless another
    /// thread found the counters anew meanwhile).
    fn distrust(&self, log: &std::sync::Arc<Vec<kura_engine::changes::ChangeView>>) {
        let Some(changes) = self.changes.as_ref() else {
            return;
        };
        let mut state = changes.lock();
        if matches!(&*state, Changes::Views(views) if std::sync::Arc::ptr_eq(views, log)) {
            tracing::debug!("a server's change counter is no longer trusted (restarted, stopped or silent); not keeping copies of records");
            *state = Changes::Unavailable { retry_at_ms: kura_engine::changes::monotonic_ms() + CHANGES_RETRY_MS };
        }
    }

    /// Networked pool: `keys`' records, from the copies current now where there are, the
    /// others through `fetch` (given the missing keys, in order), then kept.
    fn through_copies(&self, keys: &[Vec<u8>], fetch: impl FnOnce(&[Vec<u8>]) -> Result<Vec<Versioned>>) -> Result<Vec<Versioned>> {
        let Some(log) = self.change_log(true) else {
            return fetch(keys);
        };
        let Some((mut held, from)) = self.meta_cache.get_many_now(keys, &log[..]) else {
            self.distrust(&log);
            return fetch(keys);
        };
        if held.iter().any(Option::is_none) {
            self.take_shared(&log, keys, &mut held, &from);
        }
        let missing: Vec<Vec<u8>> = keys.iter().zip(&held).filter(|(_, h)| h.is_none()).map(|(key, _)| key.clone()).collect();
        if !missing.is_empty() {
            let fetched = fetch(&missing)?;
            let records: Vec<(&[u8], &Versioned, u32)> = missing.iter().zip(&fetched).map(|(key, record)| (key.as_slice(), record, 0)).collect();
            self.keep(&log, &from, &records);
            let mut fetched = fetched.into_iter();
            for slot in held.iter_mut().filter(|h| h.is_none()) {
                *slot = Some(fetched.next().expect("one record per missing key"));
            }
        }
        Ok(held.into_iter().map(|h| h.expect("every key held or fetched")).collect())
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `f` with this thread's context (made on first use, and again after a fork; a
    /// temporary one while the thread's locals are being destroyed, e.g. in exit handlers).
    fn with_context<T>(&self, f: impl FnOnce(&mut Context) -> Result<T>) -> Result<T> {
        let pid = crate::process_id();
        let mut f = Some(f);
        let cached = CONTEXTS.try_with(|cell| {
            let mut contexts = cell.borrow_mut();
            contexts.retain(|(_, p, _)| *p == pid);
            let at = match contexts.iter().position(|(id, _, _)| *id == self.id) {
                Some(at) => at,
                None => {
                    contexts.push((self.id, pid, self.pool.context()?));
                    contexts.len() - 1
                }
            };
            (f.take().expect("called once"))(&mut contexts[at].2)
        });
        match cached {
            Ok(result) => result,
            Err(_) => (f.take().expect("not called"))(&mut self.pool.context()?),
        }
    }

    /// The runs of consecutive keys (of `count`, the `i`th `key_of(i)`) placed on one node, in
    /// order: what one node is asked together before the next node is.
    fn node_runs<'k>(&self, count: usize, key_of: impl Fn(usize) -> &'k [u8]) -> Vec<(&NodeSpec, std::ops::Range<usize>)> {
        let mut runs: Vec<(&NodeSpec, std::ops::Range<usize>)> = Vec::new();
        for i in 0..count {
            let node = self.pool.node_of(key_of(i));
            match runs.last_mut() {
                Some((last, run)) if std::ptr::eq(*last, node) => run.end = i + 1,
                _ => runs.push((node, i..i + 1)),
            }
        }
        runs
    }

    /// Networked pool: runs writes (`write`) and keeps as copies the records they left, as
    /// `changed` tells them from their outcome — `(key, Some(record))`: the record now
    /// (`Some(None)`: deleted); `(key, None)`: changed, record unknown (`None`: nothing is
    /// known) — of the keys no one else changed meanwhile (see [`MetaCache::keep`]): a
    /// process that writes a directory it lists keeps its copies of it.
    fn writing<'k, T>(&self, write: impl FnOnce() -> Result<T>, changed: impl FnOnce(&T) -> Option<Vec<(&'k [u8], Option<Versioned>)>>) -> Result<T> {
        let Some(log) = self.change_log(false) else {
            return write();
        };
        let Some(before) = log.counters() else {
            self.distrust(&log);
            return write();
        };
        let outcome = write()?;
        if let Some(changes) = changed(&outcome) {
            let own = |key: &[u8]| changes.iter().filter(|(k, _)| *k == key).count() as u32;
            let records: Vec<(&[u8], &Versioned, u32)> = changes.iter().filter_map(|(key, record)| Some((*key, record.as_ref()?, own(key)))).collect();
            if !records.is_empty() {
                self.keep(&log, &before, &records);
            }
        }
        Ok(outcome)
    }

    /// Networked pool: each node's keys of `keys` together on its metadata connection.
    fn fetch_versioned_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        // The keys of each node go out together on its metadata connection.
        let mut by_node: Vec<(&NodeSpec, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let node = self.pool.node_of(key);
            match by_node.iter_mut().find(|(n, _)| std::ptr::eq(*n, node)) {
                Some((_, at)) => at.push(i),
                None => by_node.push((node, vec![i])),
            }
        }
        let mut out = vec![None; keys.len()];
        for (node, at) in by_node {
            let node_keys: Vec<&[u8]> = at.iter().map(|&i| keys[i].as_slice()).collect();
            let values = self.with_meta_node(node, |c| c.get_many(&node_keys))?;
            for (i, value) in at.into_iter().zip(values) {
                out[i] = value;
            }
        }
        Ok(out)
    }

    /// Networked pool: the keys in order, consecutive keys of one node together.
    fn fetch_versioned_in_order(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        let mut out = Vec::with_capacity(keys.len());
        for (node, run) in self.node_runs(keys.len(), |i| &keys[i]) {
            let run: Vec<&[u8]> = keys[run].iter().map(Vec::as_slice).collect();
            out.extend(self.with_meta_node(node, |c| c.get_many(&run))?);
        }
        Ok(out)
    }

    /// Runs `f` with this thread's metadata connection to the node `key` is placed on (made on
    /// first use, again after a fork, and again after an I/O error).
    fn with_meta<T>(&self, key: &[u8], f: impl FnOnce(&mut SideConn) -> Result<T>) -> Result<T> {
        self.with_meta_node(self.pool.node_of(key), f)
    }

    /// [`PoolKv::with_meta`] for a node named directly.
    fn with_meta_node<T>(&self, node: &NodeSpec, f: impl FnOnce(&mut SideConn) -> Result<T>) -> Result<T> {
        // Per node and credentials: another pool in this thread with other credentials (or
        // none) for the same node gets a connection of its own.
        let credentials = node.credentials.as_ref().map(|c| {
            use std::hash::{Hash as _, Hasher as _};
            let mut hasher = std::hash::DefaultHasher::new();
            (&c.user, &c.password).hash(&mut hasher);
            hasher.finish()
        });
        let id = format!("{:?}/{}/{credentials:?}", node.backend, node.addrs[0]);
        let (value_max, spin) = (self.pool.config().value_size_max_bytes, self.pool.config().poll_spin);
        let pid = crate::process_id();
        let mut f = Some(f);
        let cached = META_CONNS.try_with(|cell| {
            let mut conns = cell.borrow_mut();
            if conns.get(&id).is_some_and(|(p, _)| *p != pid) {
                // Inherited across fork: the parent owns that socket's stream; closing our
                // copy of the descriptor does not disturb it.
                conns.remove(&id);
            }
            if conns.get(&id).is_some_and(|(_, conn)| conn.closed_while_idle()) {
                // The node closed it while nothing was asked (a server restarted): the
                // request goes on a new connection instead of failing on this one, as the
                // pool's own connections do.
                conns.remove(&id);
            }
            if !conns.contains_key(&id) {
                conns.insert(id.clone(), (pid, SideConn::connect(node, value_max, spin)?));
            }
            let result = (f.take().expect("called once"))(&mut conns.get_mut(&id).expect("inserted").1);
            if matches!(result, Err(FsError::Io(_))) {
                conns.remove(&id);
            }
            result
        });
        match cached {
            Ok(result) => result,
            Err(_) => (f.take().expect("not called"))(&mut SideConn::connect(node, value_max, spin)?),
        }
    }
}

fn engine_cond(cond: Cond) -> Condition {
    match cond {
        Cond::Always => Condition::Always,
        Cond::Absent => Condition::IfAbsent,
        Cond::Version(v) => Condition::IfVersion(v),
    }
}

impl Kv for PoolKv {
    fn get_versioned(&self, key: &[u8]) -> Result<Option<(Vec<u8>, u64)>> {
        match &self.engine {
            Some(engine) => {
                if let Some(record) = self.meta_cache.get(key) {
                    return Ok(record);
                }
                let began = self.meta_cache.begin_read();
                let record = engine.get(key)?.map(|item| {
                    let version = item.version;
                    (item.into_vec(), version)
                });
                self.meta_cache.fill(key, &record, began);
                Ok(record)
            }
            None if self.changes.is_some() => Ok(self.through_copies(&[key.to_vec()], |keys| Ok(vec![self.with_meta(&keys[0], |c| c.get(&keys[0]))?]))?.pop().expect("one key")),
            None => self.with_meta(key, |c| c.get(key)),
        }
    }

    fn get_versioned_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        if self.engine.is_some() {
            return keys.iter().map(|key| self.get_versioned(key)).collect();
        }
        if self.changes.is_some() {
            return self.through_copies(keys, |keys| self.fetch_versioned_many(keys));
        }
        self.fetch_versioned_many(keys)
    }

    fn get_versioned_in_order(&self, keys: &[Vec<u8>]) -> Result<Vec<Versioned>> {
        if self.engine.is_some() {
            return keys.iter().map(|key| self.get_versioned(key)).collect();
        }
        if self.changes.is_some() {
            return self.through_copies(keys, |keys| self.fetch_versioned_in_order(keys));
        }
        self.fetch_versioned_in_order(keys)
    }

    fn put_cond(&self, key: &[u8], value: &[u8], cond: Cond) -> Result<Option<u64>> {
        match &self.engine {
            Some(engine) => {
                let written = engine.write(key, value, RecordKind::Put, engine_cond(cond));
                let version = match written {
                    Ok(WriteOutcome::Written { version }) => Some(version),
                    Ok(WriteOutcome::ConditionFailed { .. }) | Err(_) => None,
                };
                self.meta_cache.wrote(key, version.map(|v| Some((value.to_vec(), v))));
                written?;
                Ok(version)
            }
            None => self.writing(
                || self.with_meta(key, |c| c.set(key, value, cond)),
                |version| Some(version.map_or_else(Vec::new, |v| vec![(key, Some(Some((value.to_vec(), v))))])),
            ),
        }
    }

    fn put_cond_reading(&self, key: &[u8], value: &[u8], cond: Cond, also: &[u8]) -> Result<(Option<u64>, AlsoRead)> {
        let node = self.pool.node_of(key);
        // On one node's metadata connection, pipelined (data values of Redis nodes are not
        // read there).
        if self.engine.is_some() || node.backend == Backend::Redis || !std::ptr::eq(node, self.pool.node_of(also)) {
            return Ok((self.put_cond(key, value, cond)?, None));
        }
        let mut read = None;
        let version = self.writing(
            || {
                self.with_meta(key, |c| {
                    let (version, value) = c.set_and_get(key, value, cond, also)?;
                    read = value;
                    Ok(version)
                })
            },
            |version| Some(version.map_or_else(Vec::new, |v| vec![(key, Some(Some((value.to_vec(), v))))])),
        )?;
        Ok((version, read))
    }

    fn write_many(&self, writes: &[WriteOp]) -> Result<Vec<Option<u64>>> {
        if self.engine.is_some() {
            return writes.iter().map(|write| write.apply(self)).collect();
        }
        let write = || {
            let mut out = Vec::with_capacity(writes.len());
            for (node, run) in self.node_runs(writes.len(), |i| writes[i].key()) {
                out.extend(self.with_meta_node(node, |c| c.write_many(&writes[run]))?);
            }
            Ok(out)
        };
        self.writing(write, |outcomes: &Vec<Option<u64>>| {
            let mut changed = Vec::new();
            for (write, outcome) in writes.iter().zip(outcomes) {
                match (*write, *outcome) {
                    (_, None) | (WriteOp::Delete(_, Cond::Absent), _) => {}
                    (WriteOp::Put(key, value, _), Some(version)) => changed.push((key, Some(Some((value.to_vec(), version))))),
                    (WriteOp::Delete(key, Cond::Version(_)), Some(_)) => changed.push((key, Some(None))),
                    // Deleted or not there (a server counts only the first).
                    (WriteOp::Delete(_, Cond::Always), Some(_)) => return None,
                }
            }
            Some(changed)
        })
    }

    fn delete_cond(&self, key: &[u8], cond: Cond) -> Result<bool> {
        match &self.engine {
            Some(engine) => {
                let deleted = if cond == Cond::Always {
                    engine.delete(key).map(|_| true)
                } else {
                    engine.write(key, &[], RecordKind::Tombstone, engine_cond(cond)).map(|outcome| matches!(outcome, WriteOutcome::Written { .. }))
                };
                self.meta_cache.wrote(key, matches!(deleted, Ok(true)).then_some(None));
                Ok(deleted?)
            }
            None => self.writing(
                || self.with_meta(key, |c| c.delete(key, cond)),
                |&deleted| match cond {
                    Cond::Version(_) if deleted => Some(vec![(key, Some(None))]),
                    Cond::Version(_) | Cond::Absent => Some(Vec::new()),
                    // Deleted or not there (a server counts only the first).
                    Cond::Always => None,
                },
            ),
        }
    }

    fn get_meta_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        if self.engine.is_some() {
            // Through the metadata cache.
            return keys.iter().map(|key| Ok(self.get_versioned(key)?.map(|(value, _)| value))).collect();
        }
        if self.changes.is_some() {
            // With their versions, on the metadata connections, so that they can be kept as
            // copies (a listing's buckets and its entries' inodes, read again by the next `ls`).
            return Ok(self.get_versioned_many(keys)?.into_iter().map(|record| record.map(|(value, _)| value)).collect());
        }
        let mut values = self.get_many(keys)?;
        if self.redis {
            for (key, value) in keys.iter().zip(values.iter_mut()) {
                if let Some(stored) = value
                    && self.pool.node_of(key).backend == Backend::Redis
                {
                    redis::strip_version(key, stored)?;
                }
            }
        }
        Ok(values)
    }

    fn get_many(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let results = self.with_context(|ctx| Ok(ctx.get_many(keys)?))?;
        results.into_iter().map(|r| r.map_err(FsError::from)).collect()
    }

    fn exists_many(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let results = self.with_context(|ctx| Ok(ctx.exists_many(keys)?))?;
        results.into_iter().map(|r| r.map_err(FsError::from)).collect()
    }

    fn get_into(&self, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        out.clear();
        if let Some(engine) = &self.engine {
            return Ok(match engine.get(key)? {
                Some(item) => {
                    out.extend_from_slice(item.value());
                    true
                }
                None => false,
            });
        }
        self.with_context(|ctx| {
            let mut found = Ok(false);
            ctx.submit_get(key, 0)?;
            while ctx.in_flight() > 0 {
                ctx.poll(None, &mut |c| {
                    found = match c.result {
                        Ok(Outcome::Value(v)) => {
                            out.extend_from_slice(v);
                            Ok(true)
                        }
                        Ok(_) => Ok(false),
                        Err(e) => Err(FsError::from(e)),
                    }
                })?;
            }
            found
        })
    }

    fn set_many(&self, items: &[(Vec<u8>, Vec<u8>)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        if self.engine.is_some() {
            let result = self.with_context(|ctx| Ok(ctx.set_many(items)?));
            self.meta_cache.forget(items.iter().map(|(key, _)| key.as_slice()));
            return result;
        }
        // Chunks, which have no copies (forgotten all the same).
        self.writing(|| self.with_context(|ctx| Ok(ctx.set_many(items)?)), |_| Some(items.iter().map(|(key, _)| (key.as_slice(), None)).collect()))
    }

    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        if let Some(engine) = &self.engine {
            let deleted = keys.iter().try_for_each(|key| engine.delete(key).map(|_| ()));
            self.meta_cache.forget(keys.iter().map(Vec::as_slice));
            return Ok(deleted?);
        }
        self.with_context(|ctx| {
            let mut first_error = None;
            let mut next = 0;
            while next < keys.len() || ctx.in_flight() > 0 {
                while next < keys.len() && ctx.in_flight() < DELETE_WINDOW {
                    ctx.submit_delete(&keys[next], next as u64)?;
                    next += 1;
                }
                ctx.poll(None, &mut |c| {
                    if let Err(e) = c.result {
                        first_error.get_or_insert(e);
                    }
                })?;
            }
            first_error.map_or(Ok(()), |e| Err(e.into()))
        })
    }

    fn in_process(&self) -> bool {
        self.engine.is_some()
    }

    fn flush(&self) -> Result<()> {
        self.with_context(|ctx| Ok(ctx.flush()?))
    }

    fn space(&self) -> Result<Option<PoolSpace>> {
        if let Some(engine) = &self.engine {
            let stats = engine.stats();
            return Ok(Some(PoolSpace::of_nodes(&[(stats.capacity_bytes, stats.bytes_live_estimate, 1)])));
        }
        let mut nodes = Vec::new();
        for node in &self.pool.config().nodes {
            match self.with_meta_node(node, SideConn::space)? {
                Some((capacity, used)) => nodes.push((capacity, used, node.weight)),
                None => return Ok(None),
            }
        }
        Ok(Some(PoolSpace::of_nodes(&nodes)))
    }
}

/// Takes a kura server's change counter file and instance from a `STAT` line's name and value.
fn note_changes_stat((name, value): (&str, &str), path: &mut Option<String>, instance: &mut Option<u64>) {
    match name {
        "kura_changes_file" => *path = Some(value.to_owned()),
        "kura_instance_id" => *instance = u64::from_str_radix(value, 16).ok(),
        _ => {}
    }
}

/// What a metadata connection to a kura server sends with its first request.
const CHANGES_REQUEST: &[u8] = b"stats changes\r\n";

/// Deletes one call keeps in flight.
const DELETE_WINDOW: usize = 256;

/// A metadata connection to one node, in its protocol.
enum SideConn {
    Memcache(MetaConn),
    Redis(RespConn),
}

impl SideConn {
    /// Whether the node closed the connection, or sent what nothing asked for, while it was
    /// idle (looked at without waiting).
    fn closed_while_idle(&self) -> bool {
        let stream = match self {
            SideConn::Memcache(c) => {
                if !c.reader.buffer().is_empty() {
                    return true;
                }
                c.reader.get_ref().get_ref()
            }
            SideConn::Redis(c) => c.stream(),
        };
        // An idle connection answers EAGAIN, which is not the host program's business.
        keeping_errno(|| match stream.peek_nonblocking() {
            Ok(_) => true,
            Err(e) => !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)),
        })
    }

    /// `value_max`: the pool's value limit (a Redis metadata value, version included, stays
    /// within it, so that the pool's own connections can read it too); `spin`: how long a
    /// wait for a reply looks for it before sleeping (the pool's `poll_spin`).
    fn connect(node: &NodeSpec, value_max: usize, spin: Duration) -> Result<Self> {
        Ok(match node.backend {
            Backend::Redis => SideConn::Redis(RespConn::connect(node, value_max, spin)?),
            _ => SideConn::Memcache(MetaConn::connect(node, node.backend == Backend::Kura, spin)?),
        })
    }

    fn get(&mut self, key: &[u8]) -> Result<Option<(Vec<u8>, u64)>> {
        match self {
            SideConn::Memcache(c) => c.get(key),
            SideConn::Redis(c) => c.get(key),
        }
    }

    /// The node's `(capacity, used)` bytes: memcached's and kura's `limit_maxbytes` and
    /// `bytes`, Redis' `maxmemory` (or, without a limit, the machine's memory) and
    /// `used_memory`; `None` when it does not say.
    fn space(&mut self) -> Result<Option<(u64, u64)>> {
        match self {
            SideConn::Memcache(c) => c.space(),
            SideConn::Redis(c) => c.space(),
        }
    }

    /// The `(path, instance id)` of a kura server's change counter, from `stats`; `None` from
    /// other servers.
    fn changes_file(&mut self) -> Result<Option<(String, u64)>> {
        match self {
            SideConn::Memcache(c) => c.changes_file(),
            SideConn::Redis(_) => Ok(None),
        }
    }

    /// Several gets: pipelined on memcached, one by one on Redis.
    fn get_many(&mut self, keys: &[&[u8]]) -> Result<Vec<Versioned>> {
        match self {
            SideConn::Memcache(c) => c.get_many(keys),
            SideConn::Redis(c) => keys.iter().map(|key| c.get(key)).collect(),
        }
    }

    fn set(&mut self, key: &[u8], value: &[u8], cond: Cond) -> Result<Option<u64>> {
        match self {
            SideConn::Memcache(c) => c.set(key, value, cond),
            SideConn::Redis(c) => c.set(key, value, cond),
        }
    }

    /// A set and a get (of a data value: no version prefix) in one round trip on memcached;
    /// the set alone on Redis.
    fn set_and_get(&mut self, key: &[u8], value: &[u8], cond: Cond, also: &[u8]) -> Result<(Option<u64>, AlsoRead)> {
        match self {
            SideConn::Memcache(c) => c.set_and_get(key, value, cond, also),
            SideConn::Redis(c) => Ok((c.set(key, value, cond)?, None)),
        }
    }

    /// Several writes: pipelined on memcached, one by one on Redis (and on memcached when a
    /// delete only if absent, which is no single request, is among them).
    fn write_many(&mut self, writes: &[WriteOp]) -> Result<Vec<Option<u64>>> {
        match self {
            SideConn::Memcache(c) if !writes.iter().any(|write| matches!(write, WriteOp::Delete(_, Cond::Absent))) => c.write_many(writes),
            _ => writes
                .iter()
                .map(|write| match *write {
                    WriteOp::Put(key, value, cond) => self.set(key, value, cond),
                    WriteOp::Delete(key, cond) => Ok(self.delete(key, cond)?.then_some(0)),
                })
                .collect(),
        }
    }

    fn delete(&mut self, key: &[u8], cond: Cond) -> Result<bool> {
        match self {
            SideConn::Memcache(c) => c.delete(key, cond),
            SideConn::Redis(c) => c.delete(key, cond),
        }
    }
}

/// A blocking connection to `node` (TCP, or a Unix socket for a path) with the metadata
/// timeouts, high in the descriptor table, out of the host program's way (kura_pool::fd),
/// authenticated when its URL gave credentials.
fn connect_stream(node: &NodeSpec) -> Result<NodeStream> {
    let addr = &node.addrs[0];
    let io = |e: std::io::Error| FsError::Io(format!("{addr}: {e}"));
    let mut stream = NodeStream::connect(addr, Duration::from_millis(META_CONNECT_TIMEOUT_MS)).map_err(io)?;
    stream.set_read_timeout(Some(Duration::from_millis(META_IO_TIMEOUT_MS))).map_err(io)?;
    stream.set_write_timeout(Some(Duration::from_millis(META_IO_TIMEOUT_MS))).map_err(io)?;
    if let Some(tls) = &node.tls {
        stream = stream.start_tls(addr, tls).map_err(|e| FsError::Io(format!("{addr}: {}", kura_pool::tls_failure(&e))))?;
    }
    if let Some(credentials) = &node.credentials {
        kura_pool::authenticate(&mut stream, node.backend, credentials).map_err(|e| FsError::Io(format!("{addr}: {e}")))?;
    }
    Ok(stream)
}

/// One blocking memcached meta-protocol connection, for compare-and-swap.
struct MetaConn {
    reader: BufReader<kura_pool::fd::SpinningReader<NodeStream>>,
    writer: NodeStream,
    line: String,
    node: String,
    /// A kura server's: `stats changes` goes out with the first request (no round trip of its
    /// own); then its answer is read first; then what it said, if anything.
    ask_changes: bool,
    changes_pending: bool,
    changes: Option<(String, u64)>,
    /// memcached over TLS: each request of a batch is sent in TLS records of its own (see
    /// [`MetaConn::send_batch`]).
    record_per_request: bool,
}

impl MetaConn {
    /// `ask_changes`: the node is a kura server, whose change counter is asked for with the
    /// first request; `spin`: how long a wait for a reply looks for it before sleeping.
    fn connect(node: &NodeSpec, ask_changes: bool, spin: Duration) -> Result<Self> {
        let addr = &node.addrs[0];
        let stream = connect_stream(node)?;
        let writer = stream.try_clone().map_err(|e| FsError::Io(format!("{addr}: {e}")))?;
        let record_per_request = stream.is_tls() && node.backend == Backend::Memcached;
        Ok(Self { reader: BufReader::new(kura_pool::fd::SpinningReader::new(stream, spin)), writer, line: String::new(), node: addr.to_owned(), ask_changes, changes_pending: false, changes: None, record_per_request })
    }

    /// Pipelined requests, `ends` where each ends. memcached reads a TLS connection with one
    /// `SSL_read` of what it needs and then waits for the socket, so a TLS record that runs on
    /// into the next request would leave that request inside OpenSSL, unseen: to memcached
    /// over TLS each request goes in a write (and so in TLS records) of its own.
    fn send_batch(&mut self, requests: &[u8], ends: &[usize]) -> Result<()> {
        if !self.record_per_request {
            return self.send(requests, None);
        }
        let mut start = 0;
        for &end in ends {
            self.send(&requests[start..end], None)?;
            start = end;
        }
        Ok(())
    }

    fn io(&self, e: std::io::Error) -> FsError {
        FsError::Io(format!("{}: {e}", self.node))
    }

    fn send(&mut self, head: &[u8], body: Option<&[u8]>) -> Result<()> {
        let mut msg = Vec::with_capacity(head.len() + body.map_or(0, |b| b.len() + 2) + CHANGES_REQUEST.len());
        if std::mem::take(&mut self.ask_changes) {
            msg.extend_from_slice(CHANGES_REQUEST);
            self.changes_pending = true;
        }
        msg.extend_from_slice(head);
        if let Some(body) = body {
            msg.extend_from_slice(body);
            msg.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&msg).map_err(|e| self.io(e))
    }

    fn read_line(&mut self) -> Result<&str> {
        if std::mem::take(&mut self.changes_pending) {
            self.read_changes_reply()?;
        }
        self.read_raw_line()?;
        let line = self.line.trim_end();
        if line == "CLIENT_ERROR unauthenticated" {
            return Err(FsError::Io(format!("{}: {line}: {}", self.node, kura_pool::NEEDS_CREDENTIALS)));
        }
        if line.starts_with("SERVER_ERROR") || line.starts_with("CLIENT_ERROR") || line == "ERROR" {
            return Err(if is_out_of_space(line) { FsError::NoSpace } else { FsError::Io(format!("{}: {line}", self.node)) });
        }
        Ok(line)
    }

    /// The answer to `stats changes` (an error line from a server that does not know it is
    /// no answer).
    fn read_changes_reply(&mut self) -> Result<()> {
        let (mut path, mut instance) = (None, None);
        for _ in 0..STATS_LINES_MAX {
            self.read_raw_line()?;
            match self.line.trim_end().strip_prefix("STAT ") {
                Some(stat) => note_changes_stat(stat.split_once(' ').unwrap_or((stat, "")), &mut path, &mut instance),
                None => {
                    // END, or ERROR.
                    self.changes = path.zip(instance);
                    return Ok(());
                }
            }
        }
        Err(FsError::Io(format!("{}: stats changes longer than {STATS_LINES_MAX} lines", self.node)))
    }

    /// Reads one line into `self.line`.
    fn read_raw_line(&mut self) -> Result<()> {
        self.line.clear();
        let n = self.reader.read_line(&mut self.line).map_err(|e| FsError::Io(format!("{}: {e}", self.node)))?;
        if n == 0 || !self.line.ends_with("\r\n") {
            return Err(FsError::Io(format!("{}: connection closed", self.node)));
        }
        Ok(())
    }

    fn get(&mut self, key: &[u8]) -> Result<Option<(Vec<u8>, u64)>> {
        self.send(&[b"mg ", key, b" v c\r\n"].concat(), None)?;
        self.read_get_reply()
    }

    /// Sends `stats` and gives `visit` each `STAT` line's name and value (the rest of the line).
    fn stats(&mut self, mut visit: impl FnMut(&str, &str)) -> Result<()> {
        self.send(b"stats\r\n", None)?;
        for _ in 0..STATS_LINES_MAX {
            let line = self.read_line()?;
            if line == "END" {
                return Ok(());
            }
            match line.strip_prefix("STAT ").map(|stat| stat.split_once(' ').unwrap_or((stat, ""))) {
                Some((name, value)) => visit(name, value),
                None => {
                    let line = line.to_owned();
                    return Err(FsError::Io(format!("{}: unexpected line in stats: {line:?}", self.node)));
                }
            }
        }
        Err(FsError::Io(format!("{}: stats longer than {STATS_LINES_MAX} lines", self.node)))
    }

    /// `limit_maxbytes` and `bytes` from `stats`.
    fn space(&mut self) -> Result<Option<(u64, u64)>> {
        let (mut capacity, mut used) = (None, None);
        self.stats(|name, value| match name {
            "limit_maxbytes" => capacity = value.parse().ok(),
            "bytes" => used = value.parse().ok(),
            _ => {}
        })?;
        Ok(capacity.zip(used))
    }

    /// `kura_changes_file` and `kura_instance_id`: as `stats changes` said with the first
    /// request, else from `stats` (a kura server's).
    fn changes_file(&mut self) -> Result<Option<(String, u64)>> {
        if let Some(changes) = &self.changes {
            return Ok(Some(changes.clone()));
        }
        let (mut path, mut instance) = (None, None);
        self.stats(|name, value| note_changes_stat((name, value), &mut path, &mut instance))?;
        Ok(path.zip(instance))
    }

    /// `mg` of every key in one write, then their replies in order.
    fn get_many(&mut self, keys: &[&[u8]]) -> Result<Vec<Versioned>> {
        let mut requests = Vec::with_capacity(keys.iter().map(|k| k.len() + 10).sum());
        let mut ends = Vec::with_capacity(keys.len());
        for key in keys {
            requests.extend_from_slice(b"mg ");
            requests.extend_from_slice(key);
            requests.extend_from_slice(b" v c\r\n");
            ends.push(requests.len());
        }
        self.send_batch(&requests, &ends)?;
        self.read_replies(keys.len(), |c, _| c.read_get_reply())
    }

    /// The reply to one `mg <key> v c`.
    fn read_get_reply(&mut self) -> Result<Option<(Vec<u8>, u64)>> {
        let line = self.read_line()?.to_owned();
        if line == "EN" {
            return Ok(None);
        }
        let mut words = line.split(' ');
        let (Some("VA"), Some(len)) = (words.next(), words.next()) else {
            return Err(FsError::Io(format!("{}: unexpected reply {line:?}", self.node)));
        };
        let len: usize = len.parse().map_err(|_| FsError::Io(format!("{}: bad length in {line:?}", self.node)))?;
        if len > META_VALUE_BYTES_MAX {
            return Err(FsError::Io(format!("{}: value of {len} bytes", self.node)));
        }
        let cas = cas_flag(words).ok_or_else(|| FsError::Io(format!("{}: no cas in {line:?}", self.node)))?;
        let mut value = vec![0u8; len + 2];
        self.reader.read_exact(&mut value).map_err(|e| FsError::Io(format!("{}: {e}", self.node)))?;
        value.truncate(len);
        Ok(Some((value, cas)))
    }

    fn set(&mut self, key: &[u8], value: &[u8], cond: Cond) -> Result<Option<u64>> {
        self.send(&set_request(key, value, cond), None)?;
        self.read_set_reply()
    }

    /// `ms` of `key` and `mg` of `also` in one send, then both replies.
    fn set_and_get(&mut self, key: &[u8], value: &[u8], cond: Cond, also: &[u8]) -> Result<(Option<u64>, AlsoRead)> {
        let mut requests = set_request(key, value, cond);
        let set_end = requests.len();
        requests.extend_from_slice(b"mg ");
        requests.extend_from_slice(also);
        requests.extend_from_slice(b" v c\r\n");
        self.send_batch(&requests, &[set_end, requests.len()])?;
        let mut replies = self.read_replies(2, |c, i| if i == 0 { c.read_set_reply().map(|v| (v, None)) } else { c.read_get_reply().map(|r| (None, Some(r.map(|(value, _)| value)))) })?;
        let (_, read) = replies.pop().expect("two replies");
        let (version, _) = replies.pop().expect("two replies");
        Ok((version, read))
    }

    /// `ms` and `md` of every write in one send, then their replies in order (see
    /// [`MetaConn::read_replies`]); not for a delete only if absent, which is no single
    /// request ([`SideConn::write_many`] sends such a batch one write at a time).
    fn write_many(&mut self, writes: &[WriteOp]) -> Result<Vec<Option<u64>>> {
        let mut requests = Vec::new();
        let mut ends = Vec::with_capacity(writes.len());
        for write in writes {
            match *write {
                WriteOp::Put(key, value, cond) => requests.extend(set_request(key, value, cond)),
                WriteOp::Delete(key, cond) => requests.extend(delete_request(key, cond)),
            }
            ends.push(requests.len());
        }
        self.send_batch(&requests, &ends)?;
        self.read_replies(writes.len(), |c, i| match writes[i] {
            WriteOp::Put(..) => c.read_set_reply(),
            WriteOp::Delete(_, cond) => c.read_delete_reply(cond).map(|deleted| deleted.then_some(0)),
        })
    }

    /// The replies to `count` pipelined requests, the `i`th read by `read(self, i)`. Every
    /// reply is read, so that none is left for the next request, unless the connection itself
    /// broke (the caller then drops it); the first other error is returned after them.
    fn read_replies<T>(&mut self, count: usize, mut read: impl FnMut(&mut Self, usize) -> Result<T>) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(count);
        let mut first_error = None;
        for i in 0..count {
            match read(self, i) {
                Ok(reply) => out.push(reply),
                Err(e @ FsError::Io(_)) => return Err(e),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(out), Err)
    }

    /// The reply to one `ms … c`: the new version, or `None` when the condition failed.
    fn read_set_reply(&mut self) -> Result<Option<u64>> {
        let line = self.read_line()?.to_owned();
        match line.split(' ').next() {
            Some("HD") => {
                let cas = cas_flag(line.split(' ').skip(1)).ok_or_else(|| FsError::Io(format!("no cas in {line:?}")))?;
                Ok(Some(cas))
            }
            Some("NS" | "EX" | "NF") => Ok(None),
            _ => Err(FsError::Io(format!("{}: unexpected reply {line:?}", self.node))),
        }
    }

    fn delete(&mut self, key: &[u8], cond: Cond) -> Result<bool> {
        if cond == Cond::Absent {
            // Holds when there is nothing to delete.
            return Ok(self.get(key)?.is_none());
        }
        self.send(&delete_request(key, cond), None)?;
        self.read_delete_reply(cond)
    }

    /// The reply to one `md`: whether `cond` held (see [`Kv::delete_cond`]).
    fn read_delete_reply(&mut self, cond: Cond) -> Result<bool> {
        let line = self.read_line()?.to_owned();
        match line.as_str() {
            "HD" => Ok(true),
            "NF" => Ok(cond == Cond::Always),
            "EX" => Ok(false),
            _ => Err(FsError::Io(format!("{}: unexpected reply {line:?}", self.node))),
        }
    }
}

/// `ms <key> <len> [ME|C<version>] c` and the value, as one request.
fn set_request(key: &[u8], value: &[u8], cond: Cond) -> Vec<u8> {
    let flags = match cond {
        Cond::Always => String::new(),
        Cond::Absent => " ME".to_owned(),
        Cond::Version(v) => format!(" C{v}"),
    };
    [b"ms ", key, format!(" {}{flags} c\r\n", value.len()).as_bytes(), value, b"\r\n"].concat()
}

/// `md <key> [C<version>]` (not for [`Cond::Absent`], which is no single request).
fn delete_request(key: &[u8], cond: Cond) -> Vec<u8> {
    let flags = match cond {
        Cond::Version(v) => format!(" C{v}"),
        Cond::Absent | Cond::Always => String::new(),
    };
    [b"md ", key, flags.as_bytes(), b"\r\n"].concat()
}

fn cas_flag<'a>(mut words: impl Iterator<Item = &'a str>) -> Option<u64> {
    words.find_map(|w| w.strip_prefix('c').and_then(|v| v.parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::{ChangeLog, META_CACHE_BYTES_MAX, MetaCache, PoolSpace, Versioned};
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A server as the copies see it: records, the count of changes and the log of the keys
    /// of the last [`MODEL_LOG_ENTRIES`].
    #[derive(Default)]
    struct ModelServer {
        records: HashMap<u8, (Vec<u8>, u64)>,
        changes: u64,
        /// The tag of change `n` at `n - 1`.
        log: Vec<u64>,
    }

    const MODEL_LOG_ENTRIES: u64 = 8;

    impl ModelServer {
        fn write(&mut self, key: u8, value: Option<u8>) -> Versioned {
            self.changes += 1;
            self.log.push(kura_engine::changes::change_tag(&[key]));
            match value {
                Some(v) => {
                    self.records.insert(key, (vec![v], self.changes));
                }
                None => {
                    self.records.remove(&key);
                }
            }
            self.records.get(&key).cloned()
        }

        fn flush_all(&mut self) {
            self.changes += 1;
            self.log.push(kura_engine::changes::CHANGE_TAG_ALL);
            self.records.clear();
        }
    }

    impl ChangeLog for ModelServer {
        fn counters(&self) -> Option<Vec<u64>> {
            Some(vec![self.changes])
        }

        fn changes_between(&self, node: usize, from: u64, to: u64, mut each: impl FnMut(u64)) -> bool {
            assert_eq!(node, 0);
            if to < from || to - from > MODEL_LOG_ENTRIES || to > self.changes {
                return false;
            }
            for n in from + 1..=to {
                let tag = self.log[n as usize - 1];
                if tag == kura_engine::changes::CHANGE_TAG_ALL {
                    return false;
                }
                each(tag);
            }
            true
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Another process changes a record.
        Other(u8, Option<u8>),
        /// Another process changes records this process never reads: more than the log holds.
        Flood,
        /// `flush_all`: a change to everything.
        FlushAll,
        /// This process changes a record; `race` 1: another's change to another key lands
        /// while it does, 2: to the same key before it, 3: to the same key after it.
        Own(u8, Option<u8>, u8),
        /// This process reads a record; `race` 1: another's change lands before the fetch,
        /// 2: after it, before the read is kept.
        Read(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..4, prop::option::of(any::<u8>())).prop_map(|(k, v)| Op::Other(k, v)),
            1 => Just(Op::Flood),
            1 => Just(Op::FlushAll),
            4 => (0u8..4, prop::option::of(any::<u8>()), 0u8..4).prop_map(|(k, v, r)| Op::Own(k, v, r)),
            4 => (0u8..4, 0u8..3).prop_map(|(k, r)| Op::Read(k, r)),
            8 => (0u8..4).prop_map(|k| Op::Read(k, 0)),
        ]
    }

    proptest! {
        /// Against a model server: a read answered through the copies (one kept since the log
        /// names no change to its key, or a fetch kept when the log names none while it ran)
        /// returns what the server holds, whatever this process and others wrote, and however
        /// their changes fell between the loads of the counter (PoolKv::through_copies and
        /// PoolKv::writing).
        #[test]
        fn copies_read_what_the_server_holds(ops in prop::collection::vec(op(), 1..150)) {
            let cache = MetaCache::default();
            let mut server = ModelServer::default();
            for op in ops {
                match op {
                    Op::Other(key, value) => {
                        server.write(key, value);
                    }
                    Op::Flood => {
                        for i in 0..=MODEL_LOG_ENTRIES {
                            server.write(100 + i as u8, Some(0));
                        }
                    }
                    Op::FlushAll => server.flush_all(),
                    Op::Own(key, value, race) => {
                        let before = server.counters().unwrap();
                        match race {
                            1 => {
                                server.write(key.wrapping_add(1) % 4, Some(0));
                            }
                            2 => {
                                server.write(key, Some(3));
                            }
                            _ => {}
                        }
                        let record = server.write(key, value);
                        if race == 3 {
                            server.write(key, Some(4));
                        }
                        cache.keep(&server, &before, &[(&[key][..], &record, 1)]);
                    }
                    Op::Read(key, race) => {
                        let (mut held, from) = cache.get_many_now(&[vec![key]], &server).unwrap();
                        let got = match held.pop().unwrap() {
                            Some(record) => record,
                            None => {
                                if race == 1 {
                                    server.write(key, Some(1));
                                }
                                let fetched = server.records.get(&key).cloned();
                                if race == 2 {
                                    server.write(key, Some(2));
                                }
                                cache.keep(&server, &from, &[(&[key][..], &fetched, 0)]);
                                fetched
                            }
                        };
                        if race == 0 {
                            prop_assert_eq!(got, server.records.get(&key).cloned(), "read of {}", key);
                        }
                    }
                }
            }
        }
    }

    proptest! {
        /// Against the log read whole: the index of a node's log tells whether a key changed
        /// after a count exactly, wherever the windows asked of it start and end.
        #[test]
        fn the_change_index_tells_what_changed_after_a_count(steps in prop::collection::vec((prop::option::of(0u8..6), 0u64..12), 1..80)) {
            let mut server = ModelServer::default();
            let mut index = super::ChangeIndex::default();
            for (write, back) in steps {
                if let Some(key) = write {
                    server.write(key, Some(0));
                }
                let to = server.changes;
                let from = to.saturating_sub(back);
                if index.cover(&server, 0, from, to) {
                    for key in 0u8..6 {
                        let tag = kura_engine::changes::change_tag(&[key]);
                        for after in from..=to {
                            let changed = server.log[after as usize..to as usize].contains(&tag);
                            prop_assert_eq!(index.changed_after(tag, after), changed, "key {} after {} (at {})", key, after, to);
                        }
                    }
                } else {
                    prop_assert!(back > MODEL_LOG_ENTRIES, "the log holds changes {}..={}", from + 1, to);
                }
            }
        }
    }

    /// Copies stay while others change other keys, and go when their key changes.
    #[test]
    fn a_change_drops_only_the_copy_of_its_key() {
        let cache = MetaCache::default();
        let mut server = ModelServer::default();
        server.write(1, Some(1));
        server.write(2, Some(2));
        for key in [1u8, 2] {
            let (_, from) = cache.get_many_now(&[vec![key]], &server).unwrap();
            let record = server.records.get(&key).cloned();
            assert_eq!(cache.keep(&server, &from, &[(&[key][..], &record, 0)]).unwrap().1, vec![true]);
        }
        server.write(3, Some(3));
        server.write(2, Some(5));
        let (held, _) = cache.get_many_now(&[vec![1], vec![2]], &server).unwrap();
        assert_eq!(held, vec![Some(Some((vec![1], 1))), None]);
        server.flush_all();
        let (held, _) = cache.get_many_now(&[vec![1]], &server).unwrap();
        assert_eq!(held, vec![None], "a change to everything");
    }

    #[test]
    fn a_read_that_raced_with_a_write_is_not_kept() {
        let cache = MetaCache::default();
        let old = Some((b"old".to_vec(), 1));
        let new = Some((b"new".to_vec(), 2));
        // A reader read the old record; a write changed it before the reader kept it.
        let began = cache.begin_read();
        cache.wrote(b"k", Some(new.clone()));
        cache.fill(b"k", &old, began);
        assert_eq!(cache.get(b"k"), Some(new.clone()));
        // A write the cache learns nothing from (a failed swap, set_many) forgets the key.
        let began = cache.begin_read();
        cache.forget([&b"k"[..]].into_iter());
        cache.fill(b"k", &old, began);
        assert_eq!(cache.get(b"k"), None);
        // Undisturbed, a read is kept, absence too.
        let began = cache.begin_read();
        cache.fill(b"k", &new, began);
        cache.fill(b"gone", &None, began);
        assert_eq!((cache.get(b"k"), cache.get(b"gone")), (Some(new), Some(None)));
        cache.wrote(b"k", None);
        assert_eq!(cache.get(b"k"), None);
    }

    #[test]
    fn the_metadata_cache_stays_within_its_bytes() {
        let cache = MetaCache::default();
        let value = vec![7u8; 4096];
        for i in 0..(2 * META_CACHE_BYTES_MAX / value.len()) {
            let began = cache.begin_read();
            cache.fill(format!("key{i}").as_bytes(), &Some((value.clone(), i as u64)), began);
            assert!(cache.inner.lock().records.bytes() <= META_CACHE_BYTES_MAX);
        }
        let inner = cache.inner.lock();
        let counted: usize = inner.records.iter().map(|(_, (k, r))| super::MetaCacheInner::charge(k, r)).sum();
        assert_eq!(counted, inner.records.bytes());
    }

    #[test]
    fn pool_space_sums_the_nodes_and_the_fullest_share_ends_the_writes() {
        // One node: what it has.
        assert_eq!(PoolSpace::of_nodes(&[(100, 30, 1)]), PoolSpace { total_bytes: 100, free_bytes: 70, available_bytes: 70 });
        // Equal weights: the node with 10 free takes half the writes, so 20 can be written.
        assert_eq!(PoolSpace::of_nodes(&[(100, 30, 1), (50, 40, 1)]), PoolSpace { total_bytes: 150, free_bytes: 80, available_bytes: 20 });
        // Weight 3 to 1: the big node takes three quarters; 60 free there lasts for 80.
        assert_eq!(PoolSpace::of_nodes(&[(100, 40, 3), (100, 0, 1)]), PoolSpace { total_bytes: 200, free_bytes: 160, available_bytes: 80 });
        // Never more than is free, and a node over its limit (memcached counts loosely) has none.
        assert_eq!(PoolSpace::of_nodes(&[(100, 120, 1), (100, 0, 1)]).available_bytes, 0);
        assert_eq!(PoolSpace::of_nodes(&[]), PoolSpace { total_bytes: 0, free_bytes: 0, available_bytes: 0 });
    }
}
