//! The RAM cache of hot records in front of flash (`-m`).
//!
//! Sharded by key hash; each shard is a map plus a CLOCK ring (an LRU
//! approximation: a hit sets a bit, the hand clears bits and evicts the first
//! entry whose bit is clear). Entries hold whole records, shared with the
//! connections sending them (`Arc`), so a hit is sent without a copy.
//!
//! Admission: a record read from flash enters only on its key's second miss
//! within a while (a TinyLFU-style *doorkeeper*: a direct-mapped table of
//! recent missing key hashes), so a scan or a uniform random load does not
//! copy every record it reads into RAM only to evict it again.
//!
//! Coherence: writers update or remove a key's entry while they hold the
//! key's write stripe (see `store`), and bump the shard's *epoch*. A reader
//! that missed here and went to flash inserts what it read only if the epoch
//! it saw at the miss is still current, so a read that raced with a write
//! never puts an older record back.

use std::mem::size_of;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::record::{RecordError, RecordView};

/// Shards of the cache (a power of two).
pub const SHARDS: usize = 64;
/// Heap bytes an allocation of `size_bytes` takes, with the allocator's chunk
/// header and rounding (glibc: 8 bytes of header, 16-byte granules, 32 bytes
/// at least). `-m` bounds what the cache really holds, so charges use this.
pub const fn heap_bytes(size_bytes: usize) -> usize {
    let chunk = (size_bytes + 8 + 15) & !15;
    if chunk < 32 { 32 } else { chunk }
}
/// Bytes charged per entry besides its record's bytes: the shared
/// `CachedRecord` allocation, and the shard's bookkeeping — its slot (the
/// slot vector may be twice the entries after growth), its hash-table bucket
/// (4-byte slot number and 1 control byte, at most 8/7 × 2 buckets per entry)
/// and a free-list entry.
pub const ENTRY_OVERHEAD_BYTES: usize =
    heap_bytes(2 * size_of::<usize>() + size_of::<CachedRecord>())
        + 2 * size_of::<Option<Slot>>()
        + 12
        + 4;
/// The doorkeeper gets one 4-byte slot per this many bytes of cache (about
/// one slot per cached record of 64 bytes or more, so 1/16 of `-m`).
const DOORKEEPER_BYTES_PER_SLOT: u64 = 64;
/// Bounds on the doorkeeper's size, in slots.
const DOORKEEPER_SLOTS_MIN: usize = 1 << 12;
const DOORKEEPER_SLOTS_MAX: usize = 1 << 22;

const _: () = assert!(SHARDS.is_power_of_two());

/// A record held in RAM, with its engine version and access facts for the
/// meta protocol's `h` and `l` flags.
#[derive(Debug)]
pub struct CachedRecord {
    pub bytes: Box<[u8]>,
    pub view: RecordView,
    pub version: u64,
    fetched: AtomicBool,
    last_access_s: AtomicI64,
}

impl CachedRecord {
    pub fn new(bytes: Box<[u8]>, view: RecordView, version: u64, now_s: i64) -> Self {
        Self {
            bytes,
            view,
            version,
            fetched: AtomicBool::new(false),
            last_access_s: AtomicI64::new(now_s),
        }
    }

    /// A record from its encoded bytes, checked (see [`RecordView::parse`]).
    pub fn parse(bytes: Box<[u8]>, version: u64, now_s: i64) -> Result<Self, RecordError> {
        let view = RecordView::parse(&bytes)?;
        Ok(Self::new(bytes, view, version, now_s))
    }

    pub fn key(&self) -> &[u8] {
        self.view.key(&self.bytes)
    }

    /// Whether a client fetched it before, and when it was last accessed.
    pub fn access(&self) -> (bool, i64) {
        (
            self.fetched.load(Ordering::Relaxed),
            self.last_access_s.load(Ordering::Relaxed),
        )
    }

    /// Records a fetch (memcached's LRU bump).
    pub fn touch(&self, now_s: i64) {
        self.fetched.store(true, Ordering::Relaxed);
        self.last_access_s.store(now_s, Ordering::Relaxed);
    }

    fn charge_bytes(&self) -> usize {
        heap_bytes(self.bytes.len()) + ENTRY_OVERHEAD_BYTES
    }
}

/// What a lookup found.
pub enum Probe {
    Hit(Arc<CachedRecord>),
    /// Not cached; pass `epoch` to [`RamCache::fill`] with what flash returns.
    Miss {
        epoch: u64,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: u64,
    pub bytes: u64,
    pub limit_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

pub struct RamCache {
    shards: Box<[Mutex<Shard>]>,
    /// Fingerprints of keys that missed recently (0: empty slot).
    doorkeeper: Box<[AtomicU32]>,
    limit_bytes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Slot {
    record: Arc<CachedRecord>,
    referenced: bool,
}

/// A key's hash within its shard's table (the shard is picked by other bits
/// of the same hash, see [`RamCache::shard`]).
fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

struct Shard {
    /// Slot numbers, found by key hash; the key itself lives in the record,
    /// so it is not stored twice.
    map: HashTable<u32>,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    hand: usize,
    bytes: usize,
    epoch: u64,
    evictions: u64,
}

impl Shard {
    fn new() -> Self {
        Self {
            map: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            hand: 0,
            bytes: 0,
            epoch: 0,
            evictions: 0,
        }
    }

    fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let slots = &self.slots;
        self.map
            .find(hash, |&slot| Self::holds(slots, slot, key))
            .copied()
    }

    fn holds(slots: &[Option<Slot>], slot: u32, key: &[u8]) -> bool {
        slots[slot as usize]
            .as_ref()
            .is_some_and(|entry| entry.record.key() == key)
    }

    fn remove(&mut self, hash: u64, key: &[u8]) {
        let slots = &self.slots;
        let found = self
            .map
            .find_entry(hash, |&slot| Self::holds(slots, slot, key));
        if let Ok(entry) = found {
            let (slot, _) = entry.remove();
            self.release(slot);
        }
    }

    /// Frees `slot`, already out of the table.
    fn release(&mut self, slot: u32) {
        let old = self.slots[slot as usize]
            .take()
            .expect("mapped slot holds an entry");
        self.bytes -= old.record.charge_bytes();
        self.free.push(slot);
    }

    fn insert(&mut self, hash: u64, record: Arc<CachedRecord>, limit_bytes: usize) {
        self.remove(hash, record.key());
        let charge = record.charge_bytes();
        if charge > limit_bytes {
            return;
        }
        while self.bytes + charge > limit_bytes && self.evict_one() {}
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                u32::try_from(self.slots.len() - 1).expect("cache slots fit u32")
            }
        };
        self.bytes += charge;
        self.slots[slot as usize] = Some(Slot {
            record,
            referenced: false,
        });
        let slots = &self.slots;
        self.map.insert_unique(hash, slot, |&other| {
            key_hash(
                slots[other as usize]
                    .as_ref()
                    .expect("mapped slot holds an entry")
                    .record
                    .key(),
            )
        });
    }

    /// Advances the CLOCK hand to an unreferenced entry and evicts it.
    fn evict_one(&mut self) -> bool {
        if self.map.is_empty() {
            return false;
        }
        // Two sweeps clear every bit, so an entry is found within them.
        for _ in 0..2 * self.slots.len() {
            let index = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            if slot.referenced {
                slot.referenced = false;
                continue;
            }
            let hash = key_hash(slot.record.key());
            let victim = index as u32;
            let entry = self
                .map
                .find_entry(hash, |&s| s == victim)
                .expect("a slot in the ring is in the table");
            entry.remove();
            self.release(victim);
            self.evictions += 1;
            return true;
        }
        unreachable!("a non-empty CLOCK ring always has a victim within two sweeps")
    }

    fn shrink_to(&mut self, limit_bytes: usize) {
        while self.bytes > limit_bytes && self.evict_one() {}
        if self.map.is_empty() {
            self.slots.clear();
            self.free.clear();
            self.hand = 0;
        }
    }
}

impl RamCache {
    pub fn new(limit_bytes: u64) -> Self {
        let slots = ((limit_bytes / DOORKEEPER_BYTES_PER_SLOT) as usize)
            .clamp(DOORKEEPER_SLOTS_MIN, DOORKEEPER_SLOTS_MAX)
            .next_power_of_two();
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::new())).collect(),
            doorkeeper: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            limit_bytes: AtomicU64::new(limit_bytes),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The shard of a key hash: bits 32.. of it, since the table inside uses
    /// the low bits for buckets and the top 7 as tags.
    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[((hash >> 32) as usize) & (SHARDS - 1)]
    }

    fn shard_limit(&self) -> usize {
        (self.limit_bytes.load(Ordering::Relaxed) / SHARDS as u64) as usize
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes.load(Ordering::Relaxed)
    }

    /// Looks `key` up; a hit counts as a reference for eviction.
    pub fn probe(&self, key: &[u8]) -> Probe {
        let hash = key_hash(key);
        let mut shard = self.shard(hash).lock();
        if let Some(slot) = shard.find(hash, key) {
            let entry = shard.slots[slot as usize]
                .as_mut()
                .expect("mapped slot holds an entry");
            entry.referenced = true;
            let record = Arc::clone(&entry.record);
            drop(shard);
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Probe::Hit(record);
        }
        let epoch = shard.epoch;
        drop(shard);
        self.misses.fetch_add(1, Ordering::Relaxed);
        Probe::Miss { epoch }
    }

    /// Whether a record just read from flash for `key` should be cached: yes
    /// when the key missed recently too; otherwise the miss is remembered.
    pub fn admits(&self, key: &[u8]) -> bool {
        if self.limit_bytes() == 0 {
            return false;
        }
        let hash = xxh3_64(key);
        let fingerprint = (hash >> 32) as u32 | 1;
        let slot = &self.doorkeeper[hash as usize & (self.doorkeeper.len() - 1)];
        if slot.load(Ordering::Relaxed) == fingerprint {
            slot.store(0, Ordering::Relaxed);
            return true;
        }
        slot.store(fingerprint, Ordering::Relaxed);
        false
    }

    /// Inserts what a reader fetched from flash after a miss at `epoch`,
    /// unless a writer touched the shard since. Returns whether it did.
    pub fn fill(&self, record: Arc<CachedRecord>, epoch: u64) -> bool {
        let limit = self.shard_limit();
        let hash = key_hash(record.key());
        let mut shard = self.shard(hash).lock();
        if shard.epoch != epoch {
            return false;
        }
        shard.insert(hash, record, limit);
        true
    }

    /// A writer's update, under the key's write stripe: `Some` replaces the
    /// entry (inserting it only when `insert` is set), `None` removes it.
    pub fn update(&self, key: &[u8], record: Option<Arc<CachedRecord>>, insert: bool) {
        let limit = self.shard_limit();
        let hash = key_hash(key);
        let mut shard = self.shard(hash).lock();
        shard.epoch += 1;
        match record {
            Some(record) if insert || shard.find(hash, key).is_some() => {
                shard.insert(hash, record, limit)
            }
            _ => shard.remove(hash, key),
        }
    }

    /// Drops every entry (flush_all).
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.epoch += 1;
            shard.shrink_to(0);
        }
    }

    /// Changes the size limit (`cache_memlimit`), evicting down to it.
    pub fn set_limit(&self, limit_bytes: u64) {
        self.limit_bytes.store(limit_bytes, Ordering::Relaxed);
        let limit = self.shard_limit();
        for shard in self.shards.iter() {
            shard.lock().shrink_to(limit);
        }
    }

    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats {
            limit_bytes: self.limit_bytes(),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            ..CacheStats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.entries += shard.map.len() as u64;
            stats.bytes += shard.bytes as u64;
            stats.evictions += shard.evictions;
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{ItemMeta, encode};

    fn rec(key: &str, data_len: usize, version: u64) -> Arc<CachedRecord> {
        let bytes = encode(
            key.as_bytes(),
            &ItemMeta::default(),
            &[&vec![b'x'; data_len]],
        );
        Arc::new(CachedRecord::parse(bytes.into_boxed_slice(), version, 0).unwrap())
    }

    fn hit(cache: &RamCache, key: &str) -> Option<u64> {
        match cache.probe(key.as_bytes()) {
            Probe::Hit(r) => Some(r.version),
            Probe::Miss { .. } => None,
        }
    }

    fn epoch(cache: &RamCache, key: &str) -> u64 {
        match cache.probe(key.as_bytes()) {
            Probe::Miss { epoch } => epoch,
            Probe::Hit(_) => panic!("expected a miss"),
        }
    }

    #[test]
    fn the_doorkeeper_admits_on_the_second_miss() {
        let cache = RamCache::new(1 << 20);
        assert!(!cache.admits(b"a"));
        assert!(cache.admits(b"a"));
        assert!(!cache.admits(b"a"), "admitting clears the slot");
        assert!(!RamCache::new(0).admits(b"a"));
        assert!(
            !RamCache::new(0).admits(b"a"),
            "a disabled cache admits nothing"
        );
    }

    #[test]
    fn fill_then_hit() {
        let cache = RamCache::new(1 << 20);
        let e = epoch(&cache, "a");
        assert!(cache.fill(rec("a", 10, 1), e));
        assert_eq!(hit(&cache, "a"), Some(1));
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.hits, stats.misses), (1, 1, 1));
    }

    #[test]
    fn a_write_between_miss_and_fill_wins() {
        let cache = RamCache::new(1 << 20);
        let e = epoch(&cache, "a");
        cache.update(b"a", Some(rec("a", 10, 2)), true);
        assert!(
            !cache.fill(rec("a", 10, 1), e),
            "stale fill must be refused"
        );
        assert_eq!(hit(&cache, "a"), Some(2));
        cache.update(b"a", None, false);
        assert_eq!(hit(&cache, "a"), None);
    }

    #[test]
    fn update_without_insert_only_replaces() {
        let cache = RamCache::new(1 << 20);
        cache.update(b"a", Some(rec("a", 10, 1)), false);
        assert_eq!(hit(&cache, "a"), None);
        let e = epoch(&cache, "a");
        cache.fill(rec("a", 10, 1), e);
        cache.update(b"a", Some(rec("a", 10, 5)), false);
        assert_eq!(hit(&cache, "a"), Some(5));
    }

    #[test]
    fn stays_within_its_limit_and_keeps_referenced_entries() {
        let limit = (SHARDS * 4 * (1000 + 200)) as u64;
        let cache = RamCache::new(limit);
        for i in 0..2000 {
            let key = format!("k{i}");
            let e = epoch(&cache, &key);
            cache.fill(rec(&key, 1000, i), e);
            // Keep k0 hot.
            let _ = hit(&cache, "k0");
        }
        let stats = cache.stats();
        assert!(stats.bytes <= limit, "{} > {limit}", stats.bytes);
        assert!(stats.evictions > 0);
        assert_eq!(
            hit(&cache, "k0"),
            Some(0),
            "a referenced entry survives the clock"
        );
        cache.set_limit(0);
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn too_large_entries_are_not_cached_and_clear_empties() {
        let cache = RamCache::new((SHARDS * 500) as u64);
        let e = epoch(&cache, "big");
        assert!(cache.fill(rec("big", 10_000, 1), e));
        assert_eq!(hit(&cache, "big"), None);
        let e = epoch(&cache, "s");
        cache.fill(rec("s", 10, 1), e);
        cache.clear();
        assert_eq!(hit(&cache, "s"), None);
    }
}
