//! The write buffer: the partition's block being filled, held in RAM until it is sealed.
//!
//! Keys are placed by hash into page-sized buckets (thesis ch. 9.2, the "improved hash table"):
//! a key lives in its home bucket unless that is full, in which case it goes to a nearby bucket
//! and only then is recorded in a small bit-sliced page filter, so most lookups scan one bucket.
//! Records themselves sit in an append-only arena; a replaced record is marked dead and the
//! arena is compacted when dead space grows. Large records (more than a quarter page) hang off
//! their home bucket's chain without counting against its page capacity: they get slots of
//! their own when sealed. Records not yet journaled are the arena's tail past a watermark.

use crate::block::{BlockGeometry, RecordRef, Tally};
use crate::format::RecordKind;
use crate::hash::{KeyHash, fastrange64};

const NIL: u32 = u32::MAX;
const ARENA_HEADER_BYTES: usize = 40;
const FLAG_DEAD: u8 = 1;
const FLAG_LARGE: u8 = 2;
/// Buckets per data page of a block: spare room so home buckets rarely overflow.
const BUCKETS_PER_PAGE: f64 = 1.25;
/// Buckets tried after a full home bucket.
const PROBE_BUCKETS_MAX: u32 = 16;
const OVERFLOW_FILTER_ROWS: u32 = 64;
const OVERFLOW_FILTER_K: u32 = 4;
/// Share of the block kept for tombstones, so deletes still work when puts no longer fit.
const TOMBSTONE_RESERVE_DIVISOR: usize = 64;

/// A record found in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found<'a> {
    pub version: u64,
    pub kind: RecordKind,
    pub value: &'a [u8],
}

/// Why an insert was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferFull;

/// A partition's in-memory block being filled.
pub struct WriteBuffer {
    geo: BlockGeometry,
    arena: Vec<u8>,
    arena_capacity: usize,
    dead_arena_bytes: usize,
    bucket_head: Vec<u32>,
    /// Payload bytes of small records placed in each bucket (at most a page).
    bucket_used: Vec<u16>,
    overflow: OverflowFilter,
    /// Records at arena offsets from here on are not yet written to the journal.
    journaled_upto: usize,
    tally: Tally,
    tombstones: usize,
    max_version: u64,
}

impl WriteBuffer {
    pub fn new(geo: &BlockGeometry) -> Self {
        Self::with_arena(geo, Vec::new())
    }

    /// Buckets a buffer for `geo` has.
    fn bucket_count(geo: &BlockGeometry) -> usize {
        (((geo.block_size / geo.page_size) as f64 * BUCKETS_PER_PAGE).ceil() as usize).max(1)
    }

    /// The RAM a buffer's lookup structures take (for the index budget): the bucket arrays,
    /// plus the overflow filter when small records (the only ones that overflow) are stored.
    pub fn index_bytes(geo: &BlockGeometry, with_small_records: bool) -> usize {
        let buckets = Self::bucket_count(geo);
        6 * buckets + if with_small_records { OVERFLOW_FILTER_ROWS as usize * buckets.div_ceil(8) } else { 0 }
    }

    /// A buffer that reuses `arena`'s allocation (its contents are discarded).
    pub fn with_arena(geo: &BlockGeometry, mut arena: Vec<u8>) -> Self {
        arena.clear();
        let arena_capacity = geo.block_size + geo.block_size / 2;
        if arena.capacity() < arena_capacity {
            arena.reserve_exact(arena_capacity);
        }
        let buckets = Self::bucket_count(geo);
        Self {
            geo: geo.clone(),
            arena,
            arena_capacity,
            dead_arena_bytes: 0,
            bucket_head: vec![NIL; buckets],
            bucket_used: vec![0; buckets],
            overflow: OverflowFilter::new(buckets),
            journaled_upto: 0,
            tally: Tally::default(),
            tombstones: 0,
            max_version: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tally.records == 0
    }

    pub fn len(&self) -> usize {
        self.tally.records
    }

    pub fn tombstones(&self) -> usize {
        self.tombstones
    }

    pub fn max_version(&self) -> u64 {
        self.max_version
    }

    /// Sum of key and value bytes of live records.
    pub fn user_bytes(&self) -> u64 {
        self.live_offsets().map(|o| (self.header(o).key_len + self.header(o).value_len) as u64).sum()
    }

    /// RAM used by the lookup structures (not the records).
    pub fn index_memory_bytes(&self) -> usize {
        6 * self.bucket_head.len() + self.overflow.memory_bytes()
    }

    /// RAM holding records.
    pub fn data_memory_bytes(&self) -> usize {
        self.arena.capacity()
    }

    pub fn get(&self, hash: &KeyHash, key: &[u8]) -> Option<Found<'_>> {
        let offset = self.find(hash, key)?;
        let h = self.header(offset);
        let value_at = offset as usize + ARENA_HEADER_BYTES + h.key_len;
        Some(Found { version: h.version, kind: h.kind, value: &self.arena[value_at..value_at + h.value_len] })
    }

    /// Adds a record, replacing the key's previous one. `version` is called only on success,
    /// so versions are assigned in insertion order.
    pub fn insert(
        &mut self,
        hash: &KeyHash,
        key: &[u8],
        value: &[u8],
        kind: RecordKind,
        version: impl FnOnce() -> u64,
    ) -> Result<u64, BufferFull> {
        let record_arena_bytes = (ARENA_HEADER_BYTES + key.len() + value.len()).next_multiple_of(8);
        if self.arena.len() + record_arena_bytes > self.arena_capacity {
            self.compact();
            if self.arena.len() + record_arena_bytes > self.arena_capacity {
                return Err(BufferFull);
            }
        }
        let previous = self.find(hash, key);
        let mut tally = self.tally.clone();
        if let Some(old) = previous {
            let h = self.header(old);
            tally.remove(&self.geo, h.key_len, h.value_len);
        }
        tally.add(&self.geo, key.len(), value.len());
        let reserve = if kind == RecordKind::Tombstone { 0 } else { self.geo.block_size / TOMBSTONE_RESERVE_DIVISOR };
        if self.geo.sealed_bytes_bound(&tally) + reserve > self.geo.block_size {
            return Err(BufferFull);
        }
        let small = self.geo.is_small(key.len(), value.len());
        let bucket = if small { self.choose_bucket(hash, BlockGeometry::small_bytes(key.len(), value.len())).ok_or(BufferFull)? } else { self.home_bucket(hash) as u32 };
        if let Some(old) = previous {
            self.unlink(old);
        }
        let version = version();
        let offset = self.append(hash, key, value, kind, version, bucket, if small { 0 } else { FLAG_LARGE });
        self.link(offset);
        self.tally = tally;
        self.tombstones += usize::from(kind == RecordKind::Tombstone);
        self.max_version = self.max_version.max(version);
        Ok(version)
    }

    /// Gives back the record arena for reuse.
    pub fn into_arena(self) -> Vec<u8> {
        self.arena
    }

    /// Takes the records not yet journaled (skipping ones already replaced), oldest first.
    pub fn take_pending(&mut self) -> Vec<u32> {
        let mut pending = Vec::new();
        let mut pos = self.journaled_upto;
        while pos < self.arena.len() {
            let h = ArenaHeader::read(&self.arena, pos as u32);
            if h.flags & FLAG_DEAD == 0 {
                pending.push(pos as u32);
            }
            pos += h.arena_bytes();
        }
        self.journaled_upto = self.arena.len();
        pending
    }

    /// The record at an arena offset (from [`WriteBuffer::take_pending`]).
    pub fn record_at(&self, offset: u32) -> RecordRef<'_> {
        let h = self.header(offset);
        let key_at = offset as usize + ARENA_HEADER_BYTES;
        RecordRef {
            hash: KeyHash { sort: h.sort, bloom: h.bloom },
            version: h.version,
            kind: h.kind,
            key: &self.arena[key_at..key_at + h.key_len],
            value: &self.arena[key_at + h.key_len..key_at + h.key_len + h.value_len],
        }
    }

    /// Live records sorted for sealing.
    pub fn sorted_records(&self) -> Vec<RecordRef<'_>> {
        let mut records: Vec<RecordRef<'_>> = self.live_offsets().map(|o| self.record_at(o)).collect();
        records.sort_unstable_by(crate::block::record_order);
        records
    }

    fn live_offsets(&self) -> impl Iterator<Item = u32> + '_ {
        self.bucket_head.iter().flat_map(move |&head| self.chain(head))
    }

    fn chain(&self, head: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((head != NIL).then_some(head), move |&o| {
            let next = self.header(o).next;
            (next != NIL).then_some(next)
        })
    }

    fn find(&self, hash: &KeyHash, key: &[u8]) -> Option<u32> {
        let matches = |o: &u32| {
            let h = self.header(*o);
            h.sort == hash.sort && self.key_at(*o, h.key_len) == key
        };
        let home = self.home_bucket(hash);
        if let Some(found) = self.chain(self.bucket_head[home]).find(matches) {
            return Some(found);
        }
        if self.overflow.count == 0 {
            return None;
        }
        let mut buckets = Vec::new();
        self.overflow.candidates(hash, &mut buckets);
        buckets.into_iter().filter(|&b| b as usize != home).find_map(|b| self.chain(self.bucket_head[b as usize]).find(matches))
    }

    fn home_bucket(&self, hash: &KeyHash) -> usize {
        fastrange64(hash.sort, self.bucket_head.len() as u64) as usize
    }

    /// The home bucket if the record fits, else a nearby one (recorded in the page filter).
    fn choose_bucket(&mut self, hash: &KeyHash, bytes: usize) -> Option<u32> {
        let buckets = self.bucket_head.len();
        let home = self.home_bucket(hash);
        let payload = self.geo.payload();
        for probe in 0..=PROBE_BUCKETS_MAX as usize {
            let bucket = (home + probe) % buckets;
            if usize::from(self.bucket_used[bucket]) + bytes <= payload {
                if probe > 0 {
                    self.overflow.insert(hash, bucket as u32);
                }
                return Some(bucket as u32);
            }
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn append(&mut self, hash: &KeyHash, key: &[u8], value: &[u8], kind: RecordKind, version: u64, bucket: u32, flags: u8) -> u32 {
        let offset = self.arena.len();
        assert!(offset < NIL as usize);
        let mut header = [0u8; ARENA_HEADER_BYTES];
        header[0..8].copy_from_slice(&hash.sort.to_le_bytes());
        header[8..16].copy_from_slice(&hash.bloom.to_le_bytes());
        header[16..24].copy_from_slice(&version.to_le_bytes());
        header[24..28].copy_from_slice(&(value.len() as u32).to_le_bytes());
        header[28..32].copy_from_slice(&NIL.to_le_bytes());
        header[32..36].copy_from_slice(&bucket.to_le_bytes());
        header[36] = key.len() as u8;
        header[37] = kind as u8;
        header[38] = flags;
        self.arena.extend_from_slice(&header);
        self.arena.extend_from_slice(key);
        self.arena.extend_from_slice(value);
        self.arena.resize(self.arena.len().next_multiple_of(8), 0);
        offset as u32
    }

    fn link(&mut self, offset: u32) {
        let h = self.header(offset);
        if h.flags & FLAG_LARGE == 0 {
            self.bucket_used[h.bucket as usize] += BlockGeometry::small_bytes(h.key_len, h.value_len) as u16;
        }
        let head = std::mem::replace(&mut self.bucket_head[h.bucket as usize], offset);
        self.set_next(offset, head);
    }

    fn unlink(&mut self, offset: u32) {
        let h = self.header(offset);
        let bucket = h.bucket as usize;
        if self.bucket_head[bucket] == offset {
            self.bucket_head[bucket] = h.next;
        } else {
            let prev = self.chain(self.bucket_head[bucket]).find(|&o| self.header(o).next == offset).expect("record is in its chain");
            self.set_next(prev, h.next);
        }
        if h.flags & FLAG_LARGE == 0 {
            self.bucket_used[bucket] -= BlockGeometry::small_bytes(h.key_len, h.value_len) as u16;
        }
        self.tombstones -= usize::from(h.kind == RecordKind::Tombstone);
        self.arena[offset as usize + 38] |= FLAG_DEAD;
        self.dead_arena_bytes += h.arena_bytes();
    }

    /// Rewrites the arena without dead records, keeping order (and the journal watermark).
    fn compact(&mut self) {
        if self.dead_arena_bytes == 0 {
            return;
        }
        let old = std::mem::take(&mut self.arena);
        self.arena.reserve_exact(self.arena_capacity);
        let mut journaled_upto = None;
        let mut pos = 0usize;
        while pos < old.len() {
            let h = ArenaHeader::read(&old, pos as u32);
            if pos >= self.journaled_upto && journaled_upto.is_none() {
                journaled_upto = Some(self.arena.len());
            }
            if h.flags & FLAG_DEAD == 0 {
                self.arena.extend_from_slice(&old[pos..pos + h.arena_bytes()]);
            }
            pos += h.arena_bytes();
        }
        self.journaled_upto = journaled_upto.unwrap_or(self.arena.len());
        self.dead_arena_bytes = 0;
        self.bucket_head.fill(NIL);
        self.bucket_used.fill(0);
        let mut pos = 0usize;
        while pos < self.arena.len() {
            self.link(pos as u32);
            pos += self.header(pos as u32).arena_bytes();
        }
    }

    fn header(&self, offset: u32) -> ArenaHeader {
        ArenaHeader::read(&self.arena, offset)
    }

    fn key_at(&self, offset: u32, key_len: usize) -> &[u8] {
        let at = offset as usize + ARENA_HEADER_BYTES;
        &self.arena[at..at + key_len]
    }

    fn set_next(&mut self, offset: u32, next: u32) {
        let at = offset as usize + 28;
        self.arena[at..at + 4].copy_from_slice(&next.to_le_bytes());
    }
}

#[derive(Debug, Clone, Copy)]
struct ArenaHeader {
    sort: u64,
    bloom: u64,
    version: u64,
    value_len: usize,
    next: u32,
    bucket: u32,
    key_len: usize,
    kind: RecordKind,
    flags: u8,
}

impl ArenaHeader {
    /// Bytes the record takes in the arena (header, key, value, padding).
    fn arena_bytes(&self) -> usize {
        (ARENA_HEADER_BYTES + self.key_len + self.value_len).next_multiple_of(8)
    }

    fn read(arena: &[u8], offset: u32) -> Self {
        let b = &arena[offset as usize..offset as usize + ARENA_HEADER_BYTES];
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Self {
            sort: u64_at(0),
            bloom: u64_at(8),
            version: u64_at(16),
            value_len: u32_at(24) as usize,
            next: u32_at(28),
            bucket: u32_at(32),
            key_len: usize::from(b[36]),
            kind: RecordKind::from_u8(b[37]).expect("arena holds valid kinds"),
            flags: b[38],
        }
    }
}

/// Bit-sliced Bloom filters over the buffer's buckets, holding only keys that overflowed their
/// home bucket (the thesis' page-search BFM). Allocated at the first overflow: workloads whose
/// records never overflow (large values) never pay for it.
struct OverflowFilter {
    stride_bytes: usize,
    rows: Vec<u8>,
    count: usize,
}

impl OverflowFilter {
    fn new(buckets: usize) -> Self {
        Self { stride_bytes: buckets.div_ceil(8), rows: Vec::new(), count: 0 }
    }

    fn memory_bytes(&self) -> usize {
        self.rows.capacity()
    }

    fn insert(&mut self, hash: &KeyHash, bucket: u32) {
        if self.rows.is_empty() {
            self.rows = vec![0; OVERFLOW_FILTER_ROWS as usize * self.stride_bytes];
        }
        for row in hash.overflow_positions(OVERFLOW_FILTER_ROWS, OVERFLOW_FILTER_K) {
            self.rows[row as usize * self.stride_bytes + bucket as usize / 8] |= 1 << (bucket % 8);
        }
        self.count += 1;
    }

    fn candidates(&self, hash: &KeyHash, out: &mut Vec<u32>) {
        if self.rows.is_empty() {
            return;
        }
        let rows: Vec<usize> = hash.overflow_positions(OVERFLOW_FILTER_ROWS, OVERFLOW_FILTER_K).map(|r| r as usize * self.stride_bytes).collect();
        for byte in 0..self.stride_bytes {
            let acc = rows.iter().fold(0xffu8, |acc, &row| acc & self.rows[row + byte]);
            for bit in 0..8 {
                if acc >> bit & 1 == 1 {
                    out.push((byte * 8 + bit) as u32);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn geo(block_size: usize) -> BlockGeometry {
        BlockGeometry { store_id: 1, page_size: 4096, sector: 512, block_size, index_bits_per_key: 16, fingerprint_bits: 8 }
    }

    #[test]
    fn fills_to_block_capacity_with_few_overflows() {
        let geo = geo(1 << 20);
        let mut buf = WriteBuffer::new(&geo);
        let mut version = 0;
        let mut n = 0u32;
        while buf.insert(&KeyHash::of(&n.to_le_bytes()), &n.to_le_bytes(), &[7u8; 100], RecordKind::Put, || { version += 1; version }).is_ok() {
            n += 1;
        }
        let capacity = (1 << 20) / (16 + 4 + 100);
        assert!(n as f64 > 0.9 * capacity as f64, "only {n} of ~{capacity} records fit");
        assert!(buf.overflow.count < n as usize / 10, "{} overflowed of {n}", buf.overflow.count);
        for i in 0..n {
            let found = buf.get(&KeyHash::of(&i.to_le_bytes()), &i.to_le_bytes()).unwrap();
            assert_eq!(found.version, u64::from(i) + 1);
        }
        let sorted = buf.sorted_records();
        assert_eq!(sorted.len(), n as usize);
        assert!(geo.fits(&{
            let mut t = Tally::default();
            sorted.iter().for_each(|r| t.add(&geo, r.key.len(), r.value.len()));
            t
        }));
    }

    #[test]
    fn tombstones_fit_when_puts_do_not() {
        let geo = geo(64 * 1024);
        let mut buf = WriteBuffer::new(&geo);
        let mut n = 0u32;
        while buf.insert(&KeyHash::of(&n.to_le_bytes()), &n.to_le_bytes(), &[1u8; 200], RecordKind::Put, || 1).is_ok() {
            n += 1;
        }
        let key = b"deleted";
        assert!(buf.insert(&KeyHash::of(key), key, &[], RecordKind::Tombstone, || 2).is_ok());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, usize),
        Delete(u8),
        TakePending,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<u8>(), prop_oneof![0usize..40, 900usize..1100, 4090usize..4100]).prop_map(|(k, l)| Op::Put(k, l)),
            1 => any::<u8>().prop_map(Op::Delete),
            1 => Just(Op::TakePending),
        ]
    }

    proptest! {
        #[test]
        fn matches_model(ops in proptest::collection::vec(op(), 1..400)) {
            let geo = geo(256 * 1024);
            let mut buf = WriteBuffer::new(&geo);
            let mut model: BTreeMap<u8, (u64, Option<Vec<u8>>)> = BTreeMap::new();
            let mut journaled: BTreeMap<u8, u64> = BTreeMap::new();
            let mut version = 0u64;
            for op in ops {
                match op {
                    Op::Put(_, _) | Op::Delete(_) => {
                        let (k, kind, value) = match op {
                            Op::Put(k, len) => (k, RecordKind::Put, vec![k; len]),
                            Op::Delete(k) => (k, RecordKind::Tombstone, Vec::new()),
                            Op::TakePending => unreachable!(),
                        };
                        let key = [b'k', k];
                        if let Ok(v) = buf.insert(&KeyHash::of(&key), &key, &value, kind, || { version += 1; version }) {
                            model.insert(k, (v, (kind == RecordKind::Put).then_some(value)));
                        }
                    }
                    Op::TakePending => {
                        for o in buf.take_pending() {
                            let r = buf.record_at(o);
                            journaled.insert(r.key[1], r.version);
                        }
                    }
                }
                prop_assert_eq!(buf.len(), model.len());
            }
            for (k, (v, value)) in &model {
                let key = [b'k', *k];
                let found = buf.get(&KeyHash::of(&key), &key).unwrap();
                prop_assert_eq!(found.version, *v);
                match value {
                    Some(value) => { prop_assert_eq!(found.kind, RecordKind::Put); prop_assert_eq!(found.value, &value[..]); }
                    None => prop_assert_eq!(found.kind, RecordKind::Tombstone),
                }
            }
            // Everything live is journaled once the pending list is drained.
            for o in buf.take_pending() {
                let r = buf.record_at(o);
                journaled.insert(r.key[1], r.version);
            }
            for (k, (v, _)) in &model {
                prop_assert_eq!(journaled.get(k), Some(v));
            }
            prop_assert_eq!(buf.sorted_records().len(), model.len());
        }
    }
}
