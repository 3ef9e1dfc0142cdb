//! Sealed blocks: building the on-flash image, and the small RAM index that finds a key's page.
//!
//! A block's records are sorted by key hash (thesis ch. 6.2, "sorted block"). Small records are
//! packed into pages; large ones get sector-aligned slots, so a 4 KiB value costs one read of
//! 4 KiB plus one sector. The RAM index keeps, per record, the top `log2(n) + fingerprint_bits`
//! bits of its hash in an Elias–Fano sequence: an equal value gives the record's rank, and
//! hence its page (the thesis' centralised page index, ch. 9.3); no equal value proves the key
//! absent without touching flash.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::aligned::AlignedBuf;
use crate::bloom::{BloomFilter, class_m_bits, optimal_k};
use crate::ef::EliasFano;
use crate::format::{
    BlockKind, FOOTER_BYTES, Footer, FormatError, LARGE_HEADER_BYTES, LargeHeader, PAGE_HEADER_BYTES, PageHeader,
    RECORD_HEADER_BYTES, Reader, RecordHeader, RecordKind, SUMMARY_HEADER_BYTES, SummaryHeader, crc, digests_len_bytes, encode_digests,
};
use crate::hash::{KeyHash, fastrange64};

/// RAM per block in the engine's tables beyond its `BlockIndex` (the `Arc`, the partition's
/// block table, the slot table and the age-ordered set), charged against the index budget.
pub const BLOCK_TABLE_ENTRY_BYTES: usize = 112;

/// Every byte a block costs in RAM before its page index and Bloom filter column.
pub fn block_overhead_bytes() -> usize {
    std::mem::size_of::<BlockIndex>() + BLOCK_TABLE_ENTRY_BYTES
}

/// A block's share of its partition's write-buffer index, when the partition holds the
/// intended number of blocks: charged to the index budget so the whole stays within it.
fn buffer_index_share_bytes(geo: &BlockGeometry, with_small_records: bool) -> usize {
    crate::buffer::WriteBuffer::index_bytes(geo, with_small_records) / crate::config::BLOCKS_PER_PARTITION_TARGET as usize
}

/// Sizes that shape blocks; derived from the superblock.
#[derive(Debug, Clone)]
pub struct BlockGeometry {
    pub store_id: u64,
    pub page_size: usize,
    pub sector: usize,
    pub block_size: usize,
    pub index_bits_per_key: u32,
    pub fingerprint_bits: u32,
}

impl BlockGeometry {
    pub fn payload(&self) -> usize {
        self.page_size - PAGE_HEADER_BYTES
    }

    /// Records up to this many bytes (header included) are packed into pages.
    pub fn small_record_max(&self) -> usize {
        self.payload() / 4
    }

    pub fn small_bytes(key_len: usize, value_len: usize) -> usize {
        RECORD_HEADER_BYTES + key_len + value_len
    }

    pub fn large_bytes(&self, key_len: usize, value_len: usize) -> usize {
        LargeHeader::record_bytes(key_len, value_len).next_multiple_of(self.sector)
    }

    pub fn is_small(&self, key_len: usize, value_len: usize) -> bool {
        Self::small_bytes(key_len, value_len) <= self.small_record_max()
    }

    pub fn footer_offset(&self) -> usize {
        self.block_size - self.page_size
    }

    /// An upper bound on the bytes a block holding `tally` occupies (data, summary, footer).
    pub fn sealed_bytes_bound(&self, tally: &Tally) -> usize {
        let packed_pages = self.packed_pages_bound(tally);
        let data = packed_pages * self.page_size + tally.large_bytes.next_multiple_of(self.page_size);
        let fp = self.fingerprint_bits as usize;
        let ef_bound = |n: usize, bits: usize| 40 + (n * bits).div_ceil(8) + 16;
        let summary = SUMMARY_HEADER_BYTES
            + (self.index_bits_per_key as usize * tally.records).div_ceil(8)
            + 16
            + ef_bound(tally.small_count, fp + 4)
            + ef_bound(packed_pages, 16)
            + ef_bound(tally.large_count, fp + 4)
            + ef_bound(tally.large_count, 40)
            + 16 * DEAD_SAMPLES_MAX;
        data + digests_len_bytes(tally.large_count, self.page_size) + summary.next_multiple_of(self.page_size) + self.page_size
    }

    fn packed_pages_bound(&self, tally: &Tally) -> usize {
        if tally.small_count == 0 {
            return 0;
        }
        // Greedy packing leaves less than one record of slack per page.
        let per_page_min = self.payload() - tally.small_max + 1;
        tally.small_bytes.div_ceil(per_page_min)
    }

    pub fn fits(&self, tally: &Tally) -> bool {
        self.sealed_bytes_bound(tally) <= self.block_size
    }
}

/// Running totals of records destined for one block, in on-disk bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub records: usize,
    pub small_count: usize,
    pub small_bytes: usize,
    pub small_max: usize,
    pub large_count: usize,
    pub large_bytes: usize,
}

impl Tally {
    pub fn add(&mut self, geo: &BlockGeometry, key_len: usize, value_len: usize) {
        self.records += 1;
        if geo.is_small(key_len, value_len) {
            let bytes = BlockGeometry::small_bytes(key_len, value_len);
            self.small_count += 1;
            self.small_bytes += bytes;
            self.small_max = self.small_max.max(bytes);
        } else {
            self.large_count += 1;
            self.large_bytes += geo.large_bytes(key_len, value_len);
        }
    }

    /// Removes a record added before; `small_max` stays (a safe over-estimate).
    pub fn remove(&mut self, geo: &BlockGeometry, key_len: usize, value_len: usize) {
        self.records -= 1;
        if geo.is_small(key_len, value_len) {
            self.small_count -= 1;
            self.small_bytes -= BlockGeometry::small_bytes(key_len, value_len);
        } else {
            self.large_count -= 1;
            self.large_bytes -= geo.large_bytes(key_len, value_len);
        }
    }
}

/// One record to be written into a block.
#[derive(Debug, Clone, Copy)]
pub struct RecordRef<'a> {
    pub hash: KeyHash,
    pub version: u64,
    pub kind: RecordKind,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Sort order of records inside a block.
pub fn record_order(a: &RecordRef<'_>, b: &RecordRef<'_>) -> std::cmp::Ordering {
    a.hash.sort.cmp(&b.hash.sort).then_with(|| a.key.cmp(b.key))
}

/// How many of `records` (in order) fit one block.
pub fn records_fitting(geo: &BlockGeometry, records: &[RecordRef<'_>]) -> usize {
    let mut tally = Tally::default();
    for (i, r) in records.iter().enumerate() {
        tally.add(geo, r.key.len(), r.value.len());
        if !geo.fits(&tally) {
            return i;
        }
    }
    records.len()
}

/// Where the large slots of a block are.
#[derive(Debug)]
enum LargeSlots {
    /// Every slot has the same length.
    Uniform { len_bytes: u32 },
    /// Sector offsets from the start of the large region; a slot ends where the next begins.
    Offsets { sectors: Box<EliasFano>, region_end_sectors: u64 },
}

/// Page index of the packed small records.
#[derive(Debug)]
struct SmallRegion {
    fp_universe: u64,
    fingerprints: EliasFano,
    page_first_ranks: EliasFano,
}

/// Slot index of the large records.
#[derive(Debug)]
struct LargeRegion {
    fp_universe: u64,
    fingerprints: EliasFano,
    offset_bytes: u64,
    slots: LargeSlots,
}

impl SmallRegion {
    fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.fingerprints.memory_bytes() + self.page_first_ranks.memory_bytes()
    }
}

impl LargeRegion {
    fn memory_bytes(&self) -> usize {
        let slots = match &self.slots {
            LargeSlots::Uniform { .. } => 0,
            LargeSlots::Offsets { sectors, .. } => sectors.memory_bytes(),
        };
        std::mem::size_of::<Self>() + self.fingerprints.memory_bytes() + slots
    }
}

/// The RAM index of one sealed block.
#[derive(Debug)]
pub struct BlockIndex {
    pub slot: u32,
    pub device_offset_bytes: u64,
    pub block_seq: u64,
    pub partition: u32,
    pub kind: BlockKind,
    pub min_version: u64,
    pub max_version: u64,
    pub record_count: u32,
    pub tombstone_count: u32,
    pub user_bytes: u64,
    pub data_end_bytes: u64,
    page_size: u32,
    sector: u32,
    small: Option<Box<SmallRegion>>,
    large: Option<Box<LargeRegion>>,
    /// Whether the block has key digests (see `format::encode_digests`), at the first page
    /// after its data (a flag, not an offset: the struct's size is charged to the index).
    pub has_digests: bool,
    /// Records found (by sampling) to be shadowed by newer versions.
    pub dead_records_est: AtomicU32,
    /// Set once the block is removed from the index; its slot may be reused.
    pub retired: AtomicBool,
}

/// A read that may hold a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub offset_bytes: u64,
    pub len_bytes: u32,
    pub large: bool,
}

impl BlockIndex {
    fn new(
        geo: &BlockGeometry,
        slot: u32,
        device_offset_bytes: u64,
        h: &SummaryHeader,
        regions: (Option<Box<SmallRegion>>, Option<Box<LargeRegion>>),
        summary_offset_bytes: u64,
    ) -> Self {
        let (small, large) = regions;
        // The digests sit between the data and the summary, exactly filling the gap.
        let digests_at = h.data_end_bytes.next_multiple_of(geo.page_size as u64);
        let digests_len = digests_len_bytes(h.large_count as usize, geo.page_size) as u64;
        let has_digests = h.large_count > 0 && summary_offset_bytes == digests_at + digests_len;
        Self {
            slot,
            device_offset_bytes,
            block_seq: h.block_seq,
            partition: h.partition,
            kind: h.kind,
            min_version: h.min_version,
            max_version: h.max_version,
            record_count: h.record_count,
            tombstone_count: h.tombstone_count,
            user_bytes: h.user_bytes,
            data_end_bytes: h.data_end_bytes,
            page_size: geo.page_size as u32,
            sector: geo.sector as u32,
            small,
            large,
            has_digests,
            dead_records_est: AtomicU32::new(0),
            retired: AtomicBool::new(false),
        }
    }

    /// Order in which blocks are searched: newest versions first. GC output blocks sort by the
    /// newest version they carry, which keeps every key's newest version first (see DESIGN).
    pub fn order_key(&self) -> (u64, u64) {
        (self.max_version, self.block_seq)
    }

    /// RAM held by this block's page index (its regions).
    pub fn memory_bytes(&self) -> usize {
        self.small.as_ref().map_or(0, |r| r.memory_bytes()) + self.large.as_ref().map_or(0, |r| r.memory_bytes())
    }

    pub fn live_records_est(&self) -> u32 {
        self.record_count.saturating_sub(self.dead_records_est.load(Ordering::Relaxed))
    }

    /// Whether the fingerprints say the key may be here (no flash access).
    pub fn may_contain(&self, hash: &KeyHash) -> bool {
        self.small.as_ref().is_some_and(|r| !r.fingerprints.equal_range(fingerprint(hash, r.fp_universe)).is_empty())
            || self.large.as_ref().is_some_and(|r| !r.fingerprints.equal_range(fingerprint(hash, r.fp_universe)).is_empty())
    }

    /// Starts loading what [`BlockIndex::locate`] reads first for `hash` (see
    /// [`EliasFano::prefetch`]): stage 0 the regions, 1 the select samples, 2 the words.
    pub fn prefetch_locate(&self, hash: &KeyHash, stage: u8) {
        let regions = [self.small.as_deref().map(|r| (r.fp_universe, &r.fingerprints)), self.large.as_deref().map(|r| (r.fp_universe, &r.fingerprints))];
        for (universe, fingerprints) in regions.into_iter().flatten() {
            match stage {
                0 => crate::ef::prefetch_line(std::ptr::from_ref(fingerprints).cast()),
                _ => fingerprints.prefetch(fingerprint(hash, universe), stage - 1),
            }
        }
    }

    /// Appends the reads that may hold the key (usually none or one).
    pub fn locate(&self, hash: &KeyHash, out: &mut impl Extend<Span>) {
        if let Some(r) = &self.small {
            let ranks = r.fingerprints.equal_range(fingerprint(hash, r.fp_universe));
            if !ranks.is_empty() {
                let first = r.page_first_ranks.predecessor_rank(ranks.start as u64).expect("rank 0 starts page 0");
                let last = r.page_first_ranks.predecessor_rank(ranks.end as u64 - 1).expect("rank 0 starts page 0");
                for page in first..=last {
                    let offset = self.device_offset_bytes + page as u64 * u64::from(self.page_size);
                    out.extend(Some(Span { offset_bytes: offset, len_bytes: self.page_size, large: false }));
                }
            }
        }
        if let Some(r) = &self.large {
            for rank in r.fingerprints.equal_range(fingerprint(hash, r.fp_universe)) {
                let (start, len) = self.large_slot(r, rank);
                out.extend(Some(Span { offset_bytes: self.device_offset_bytes + start, len_bytes: len, large: true }));
            }
        }
    }

    /// Byte offset in the block and length of large slot `rank`.
    fn large_slot(&self, r: &LargeRegion, rank: usize) -> (u64, u32) {
        match &r.slots {
            LargeSlots::Uniform { len_bytes } => (r.offset_bytes + rank as u64 * u64::from(*len_bytes), *len_bytes),
            LargeSlots::Offsets { sectors, region_end_sectors } => {
                let start = sectors.get(rank);
                let end = if rank + 1 < sectors.len() { sectors.get(rank + 1) } else { *region_end_sectors };
                let sector = u64::from(self.sector);
                (r.offset_bytes + start * sector, ((end - start) * sector) as u32)
            }
        }
    }

    pub fn packed_pages(&self) -> u32 {
        self.small.as_ref().map_or(0, |r| r.page_first_ranks.len() as u32)
    }

    pub fn large_count(&self) -> usize {
        self.large.as_ref().map_or(0, |r| r.fingerprints.len())
    }

    /// The read that fetches the block's key digests (device offset, length), if it has them.
    pub fn digests_span(&self) -> Option<(u64, usize)> {
        if !self.has_digests {
            return None;
        }
        let at = self.data_end_bytes.next_multiple_of(u64::from(self.page_size));
        Some((self.device_offset_bytes + at, digests_len_bytes(self.large_count(), self.page_size as usize)))
    }

    /// Every read that covers the block's records (for GC).
    pub fn all_spans(&self) -> Vec<Span> {
        let mut spans: Vec<Span> = (0..self.packed_pages())
            .map(|p| Span { offset_bytes: self.device_offset_bytes + u64::from(p) * u64::from(self.page_size), len_bytes: self.page_size, large: false })
            .collect();
        if let Some(r) = &self.large {
            for rank in 0..r.fingerprints.len() {
                let (start, len) = self.large_slot(r, rank);
                spans.push(Span { offset_bytes: self.device_offset_bytes + start, len_bytes: len, large: true });
            }
        }
        spans
    }
}

/// The regions of a block, from their parts (built or decoded).
fn regions(
    small: (u64, EliasFano, EliasFano),
    large: (u64, EliasFano, u64, LargeSlots),
) -> (Option<Box<SmallRegion>>, Option<Box<LargeRegion>>) {
    let (fp_universe, fingerprints, page_first_ranks) = small;
    let small = (!fingerprints.is_empty()).then(|| Box::new(SmallRegion { fp_universe, fingerprints, page_first_ranks }));
    let (fp_universe, fingerprints, offset_bytes, slots) = large;
    let large = (!fingerprints.is_empty()).then(|| Box::new(LargeRegion { fp_universe, fingerprints, offset_bytes, slots }));
    (small, large)
}

/// Records per block whose key hashes are kept to estimate dead records (on average), and
/// the most kept.
pub const DEAD_SAMPLES_PER_BLOCK: usize = 128;
pub const DEAD_SAMPLES_MAX: usize = 2 * DEAD_SAMPLES_PER_BLOCK;

/// Key hashes of a deterministic sample of a block's records (those whose Bloom hash is a
/// multiple of `every`): each one found in an older block marks about `every` records there
/// as superseded. Kept in the summary so the estimate survives a reopen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadSamples {
    pub every: u64,
    pub hashes: Vec<KeyHash>,
}

impl DeadSamples {
    fn of(records: &[RecordRef<'_>]) -> Self {
        let every = (records.len() / DEAD_SAMPLES_PER_BLOCK).max(1).next_power_of_two() as u64;
        let mut hashes: Vec<KeyHash> = records.iter().filter(|r| r.hash.bloom % every == 0).map(|r| r.hash).collect();
        hashes.truncate(DEAD_SAMPLES_MAX);
        Self { every, hashes }
    }
}

/// A block image ready to write, and what to remember about it.
pub struct Built {
    pub index: BlockIndex,
    pub filter: BloomFilter,
    pub samples: DeadSamples,
    pub footer: Footer,
    /// Bytes at the start of the image to write (data and summary).
    pub write_len: usize,
}

/// What [`build`] needs besides the records.
pub struct BuildSpec {
    pub slot: u32,
    pub device_offset_bytes: u64,
    pub block_seq: u64,
    pub partition: u32,
    pub kind: BlockKind,
}

/// Lays `records` (sorted by [`record_order`], fitting one block) out in `image` (a whole
/// block) and returns the block's index. The footer is not written into the image: it must
/// reach the device only after the rest is durable.
pub fn build(geo: &BlockGeometry, spec: &BuildSpec, records: &[RecordRef<'_>], image: &mut AlignedBuf) -> Built {
    assert_eq!(image.len(), geo.block_size);
    let (small, large): (Vec<&RecordRef<'_>>, Vec<&RecordRef<'_>>) =
        records.iter().partition(|r| geo.is_small(r.key.len(), r.value.len()));
    let mut tally = Tally::default();
    records.iter().for_each(|r| tally.add(geo, r.key.len(), r.value.len()));
    assert!(geo.fits(&tally), "build called with records that do not fit a block");

    let page_first_ranks = pack_small(geo, spec.block_seq, &small, image);
    let large_offset = page_first_ranks.len() * geo.page_size;
    let large_lens: Vec<usize> = large.iter().map(|r| geo.large_bytes(r.key.len(), r.value.len())).collect();
    let data_end = write_large(geo, spec.block_seq, &large, large_offset, image);
    let digests_offset = data_end.next_multiple_of(geo.page_size);
    image[data_end..digests_offset].fill(0);
    let digests_len = digests_len_bytes(large.len(), geo.page_size);
    if digests_len > 0 {
        let digests: Vec<(u64, u64)> = large.iter().map(|r| (r.hash.sort, crate::hash::key_digest(geo.store_id, r.key))).collect();
        let section = &mut image[digests_offset..digests_offset + digests_len];
        section.fill(0);
        encode_digests(spec.block_seq, &digests, section);
    }
    let summary_offset = digests_offset + digests_len;

    let small_fp_universe = fingerprint_universe(geo, small.len());
    let large_fp_universe = fingerprint_universe(geo, large.len());
    let fingerprints = |rs: &[&RecordRef<'_>], universe: u64| {
        let values: Vec<u64> = rs.iter().map(|r| fingerprint(&r.hash, universe)).collect();
        EliasFano::new(&values, universe)
    };
    let small_ef = fingerprints(&small, small_fp_universe);
    let large_ef = fingerprints(&large, large_fp_universe);
    let ranks: Vec<u64> = page_first_ranks.iter().map(|&r| r as u64).collect();
    let ranks_ef = EliasFano::new(&ranks, small.len().max(1) as u64);
    let region_end_sectors = ((data_end - large_offset) / geo.sector) as u64;
    let (large_slots, uniform) = large_slots_for(&large_lens, geo.sector, region_end_sectors);

    let index_ram = small_ef.memory_bytes() + ranks_ef.memory_bytes() + large_ef.memory_bytes() + 2 * std::mem::size_of::<LargeRegion>();
    let filter = bloom_filter(geo, records, index_ram + buffer_index_share_bytes(geo, !small.is_empty()));
    let samples = DeadSamples::of(records);
    let header = SummaryHeader {
        block_seq: spec.block_seq,
        partition: spec.partition,
        kind: spec.kind,
        record_count: records.len() as u32,
        small_count: small.len() as u32,
        large_count: large.len() as u32,
        tombstone_count: records.iter().filter(|r| r.kind == RecordKind::Tombstone).count() as u32,
        min_version: records.iter().map(|r| r.version).min().unwrap_or(0),
        max_version: records.iter().map(|r| r.version).max().unwrap_or(0),
        packed_pages: page_first_ranks.len() as u32,
        sector_bytes: geo.sector as u32,
        large_offset_bytes: large_offset as u64,
        data_end_bytes: data_end as u64,
        user_bytes: records.iter().map(|r| (r.key.len() + r.value.len()) as u64).sum(),
        bloom_m_bits: filter.m_bits(),
        bloom_k: filter.k(),
        large_uniform_bytes: uniform.unwrap_or(0) as u32,
        small_fingerprint_universe: small_fp_universe,
        large_fingerprint_universe: large_fp_universe,
        dead_sample_count: samples.hashes.len() as u16,
        dead_sample_every_log2: samples.every.trailing_zeros() as u8,
    };
    let summary = encode_summary(geo, &header, &filter, [&small_ef, &ranks_ef, &large_ef], &large_slots, &samples);
    let write_len = summary_offset + summary.len().next_multiple_of(geo.page_size);
    assert!(write_len <= geo.footer_offset(), "summary overruns the footer: bound was wrong");
    image[summary_offset..summary_offset + summary.len()].copy_from_slice(&summary);
    image[summary_offset + summary.len()..write_len].fill(0);
    let footer = Footer {
        block_seq: spec.block_seq,
        summary_offset_bytes: summary_offset as u64,
        summary_len_bytes: summary.len() as u64,
        summary_crc: crc(&summary),
        partition: spec.partition,
        max_version: header.max_version,
        kind: spec.kind,
    };
    let regions = regions((small_fp_universe, small_ef, ranks_ef), (large_fp_universe, large_ef, large_offset as u64, large_slots));
    let index = BlockIndex::new(geo, spec.slot, spec.device_offset_bytes, &header, regions, summary_offset as u64);
    Built { index, filter, samples, footer, write_len }
}

/// How to find large slot `i`: one length for all when they are equal, else sector offsets.
fn large_slots_for(lens: &[usize], sector: usize, region_end_sectors: u64) -> (LargeSlots, Option<usize>) {
    let uniform = lens.first().filter(|&&first| lens.iter().all(|&l| l == first)).copied();
    let slots = match uniform {
        Some(len) => LargeSlots::Uniform { len_bytes: len as u32 },
        None if lens.is_empty() => LargeSlots::Uniform { len_bytes: 0 },
        None => {
            let mut starts = Vec::with_capacity(lens.len());
            let mut at = 0u64;
            for &len in lens {
                starts.push(at);
                at += (len / sector) as u64;
            }
            LargeSlots::Offsets { sectors: Box::new(EliasFano::with_access(&starts, region_end_sectors.max(1))), region_end_sectors }
        }
    };
    (slots, uniform)
}

/// The summary: header, Bloom filter words, then the Elias–Fano sections (see `format`).
fn encode_summary(geo: &BlockGeometry, header: &SummaryHeader, filter: &BloomFilter, sections: [&EliasFano; 3], large_slots: &LargeSlots, samples: &DeadSamples) -> Vec<u8> {
    let mut summary = vec![0u8; SUMMARY_HEADER_BYTES];
    header.encode(geo.store_id, &mut summary);
    for word in filter.words() {
        summary.extend_from_slice(&word.to_le_bytes());
    }
    for section in sections {
        section.encode(&mut summary);
    }
    if let LargeSlots::Offsets { sectors, .. } = large_slots {
        sectors.encode(&mut summary);
    }
    for h in &samples.hashes {
        summary.extend_from_slice(&h.sort.to_le_bytes());
        summary.extend_from_slice(&h.bloom.to_le_bytes());
    }
    summary
}

/// Fingerprints of `n` records range over `n << fingerprint_bits`: the Elias–Fano high part
/// then costs 2 bits per record, and an absent key matches with probability `2^-fingerprint_bits`.
fn fingerprint_universe(geo: &BlockGeometry, n: usize) -> u64 {
    (n.max(1) as u64) << geo.fingerprint_bits
}

/// A key's fingerprint: its sort hash scaled onto `universe`, so order is preserved.
fn fingerprint(hash: &KeyHash, universe: u64) -> u64 {
    fastrange64(hash.sort, universe)
}

fn bloom_filter(geo: &BlockGeometry, records: &[RecordRef<'_>], index_ram_bytes: usize) -> BloomFilter {
    let n = records.len();
    let spent_bits = 8 * (index_ram_bytes + block_overhead_bytes()) as u64;
    let budget = (u64::from(geo.index_bits_per_key) * n as u64).saturating_sub(spent_bits);
    let m = class_m_bits(budget);
    let mut filter = BloomFilter::new(m, optimal_k(m, n));
    records.iter().for_each(|r| filter.insert(&r.hash));
    filter
}

/// Packs small records greedily into pages; returns each page's first record rank.
fn pack_small(geo: &BlockGeometry, block_seq: u64, small: &[&RecordRef<'_>], image: &mut [u8]) -> Vec<usize> {
    let mut firsts = Vec::new();
    let (mut page, mut used, mut count) = (0usize, 0usize, 0u32);
    let finish = |image: &mut [u8], page: usize, used: usize, count: u32| {
        let bytes = &mut image[page * geo.page_size..(page + 1) * geo.page_size];
        bytes[PAGE_HEADER_BYTES + used..].fill(0);
        PageHeader { block_seq, record_count: count, used_bytes: used as u32 }.seal(geo.store_id, bytes);
    };
    for (rank, r) in small.iter().enumerate() {
        let len = BlockGeometry::small_bytes(r.key.len(), r.value.len());
        if firsts.is_empty() || used + len > geo.payload() {
            if !firsts.is_empty() {
                finish(image, page, used, count);
                page += 1;
            }
            firsts.push(rank);
            (used, count) = (0, 0);
        }
        let at = page * geo.page_size + PAGE_HEADER_BYTES + used;
        let header = RecordHeader { version: r.version, value_len: r.value.len() as u32, key_len: r.key.len() as u8, kind: r.kind };
        header.encode(&mut image[at..at + RECORD_HEADER_BYTES]);
        let key_at = at + RECORD_HEADER_BYTES;
        image[key_at..key_at + r.key.len()].copy_from_slice(r.key);
        image[key_at + r.key.len()..key_at + r.key.len() + r.value.len()].copy_from_slice(r.value);
        used += len;
        count += 1;
    }
    if !firsts.is_empty() {
        finish(image, page, used, count);
    }
    firsts
}

/// Writes large records in sector-aligned slots from `offset`; returns the region's end.
fn write_large(geo: &BlockGeometry, block_seq: u64, large: &[&RecordRef<'_>], mut offset: usize, image: &mut [u8]) -> usize {
    for r in large {
        let len = geo.large_bytes(r.key.len(), r.value.len());
        let slot = &mut image[offset..offset + len];
        slot[LargeHeader::record_bytes(r.key.len(), r.value.len())..].fill(0);
        let key_at = LARGE_HEADER_BYTES;
        slot[key_at..key_at + r.key.len()].copy_from_slice(r.key);
        slot[key_at + r.key.len()..key_at + r.key.len() + r.value.len()].copy_from_slice(r.value);
        let record = RecordHeader { version: r.version, value_len: r.value.len() as u32, key_len: r.key.len() as u8, kind: r.kind };
        LargeHeader { block_seq, record }.seal(geo.store_id, slot);
        offset += len;
    }
    offset
}

/// Rebuilds a block's index from its footer and summary bytes (at reopen).
pub fn open_summary(
    geo: &BlockGeometry,
    slot: u32,
    device_offset_bytes: u64,
    footer: &Footer,
    summary: &[u8],
) -> Result<(BlockIndex, BloomFilter, DeadSamples), FormatError> {
    if crc(summary) != footer.summary_crc {
        return Err(FormatError::BadChecksum);
    }
    let h = SummaryHeader::decode(summary, geo.store_id)?;
    let bad = |field: &'static str, value: u64| FormatError::OutOfRange { field, value };
    if h.block_seq != footer.block_seq || h.partition != footer.partition || h.max_version != footer.max_version {
        return Err(bad("summary identity", h.block_seq));
    }
    if h.data_end_bytes > footer.summary_offset_bytes || h.sector_bytes as usize != geo.sector {
        return Err(bad("summary data end", h.data_end_bytes));
    }
    let mut r = Reader::at(summary, SUMMARY_HEADER_BYTES);
    let words = (h.bloom_m_bits as usize).div_ceil(64);
    let filter_bytes = r.bytes(8 * words)?;
    let filter_words = filter_bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    let filter = BloomFilter::from_words(h.bloom_m_bits, h.bloom_k, filter_words).ok_or(bad("bloom geometry", u64::from(h.bloom_m_bits)))?;
    let next_ef = |r: &mut Reader<'_>, access: bool| -> Result<EliasFano, FormatError> {
        let rest = r.bytes(0).map(|_| &summary[r.pos()..])?;
        let (ef, used) = EliasFano::decode(rest, access).ok_or(bad("Elias-Fano section", r.pos() as u64))?;
        r.bytes(used)?;
        Ok(ef)
    };
    let small = next_ef(&mut r, false)?;
    let page_first_ranks = next_ef(&mut r, false)?;
    let large = next_ef(&mut r, false)?;
    if small.len() != h.small_count as usize || large.len() != h.large_count as usize || page_first_ranks.len() != h.packed_pages as usize {
        return Err(bad("summary section lengths", u64::from(h.record_count)));
    }
    if h.large_offset_bytes != u64::from(h.packed_pages) * geo.page_size as u64 || h.large_offset_bytes > h.data_end_bytes {
        return Err(bad("large region offset", h.large_offset_bytes));
    }
    let region_end_sectors = (h.data_end_bytes - h.large_offset_bytes) / geo.sector as u64;
    let large_slots = if h.large_uniform_bytes != 0 || h.large_count == 0 {
        let len = u64::from(h.large_uniform_bytes);
        if len * u64::from(h.large_count) != h.data_end_bytes - h.large_offset_bytes || len % geo.sector as u64 != 0 {
            return Err(bad("uniform large slots", len));
        }
        LargeSlots::Uniform { len_bytes: h.large_uniform_bytes }
    } else {
        let sectors = next_ef(&mut r, true)?;
        let monotone_inside = sectors.len() == h.large_count as usize && sectors.get(sectors.len() - 1) < region_end_sectors;
        if !monotone_inside {
            return Err(bad("large slot offsets", region_end_sectors));
        }
        LargeSlots::Offsets { sectors: Box::new(sectors), region_end_sectors }
    };
    let regions = regions((h.small_fingerprint_universe, small, page_first_ranks), (h.large_fingerprint_universe, large, h.large_offset_bytes, large_slots));
    let index = BlockIndex::new(geo, slot, device_offset_bytes, &h, regions, footer.summary_offset_bytes);
    let mut hashes = Vec::with_capacity(usize::from(h.dead_sample_count));
    for _ in 0..h.dead_sample_count {
        hashes.push(KeyHash { sort: r.u64()?, bloom: r.u64()? });
    }
    let samples = DeadSamples { every: 1 << h.dead_sample_every_log2.min(31), hashes };
    Ok((index, filter, samples))
}

/// What a read of a span says about a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpanLookup {
    Found { version: u64, kind: RecordKind, value_start: usize, value_len: usize },
    NotHere,
}

/// Why a span's bytes could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpanError {
    /// The slot now holds another block: the index was stale; search again.
    Stale,
    Corrupt(FormatError),
}

/// Looks for `key` in the bytes of `span`, verifying the checksum first.
pub fn find_in_span(span: &Span, bytes: &[u8], store_id: u64, block_seq: u64, key: &[u8]) -> Result<SpanLookup, SpanError> {
    let mut found = SpanLookup::NotHere;
    visit_span(span, bytes, store_id, block_seq, |header, k, value_start| {
        if k == key {
            found = SpanLookup::Found { version: header.version, kind: header.kind, value_start, value_len: header.value_len as usize };
            false
        } else {
            true
        }
    })?;
    Ok(found)
}

/// Calls `visit(header, key, value_offset)` for every record in a span until it returns false.
pub fn visit_span(
    span: &Span,
    bytes: &[u8],
    store_id: u64,
    block_seq: u64,
    mut visit: impl FnMut(&RecordHeader, &[u8], usize) -> bool,
) -> Result<(), SpanError> {
    let corrupt = SpanError::Corrupt;
    if span.large {
        let header = LargeHeader::open(bytes, store_id).map_err(|e| stale_or(e, bytes, block_seq, 16))?;
        if header.block_seq != block_seq {
            return Err(SpanError::Stale);
        }
        let key_len = usize::from(header.record.key_len);
        visit(&header.record, &bytes[LARGE_HEADER_BYTES..LARGE_HEADER_BYTES + key_len], LARGE_HEADER_BYTES + key_len);
        return Ok(());
    }
    let header = PageHeader::open(bytes, store_id).map_err(|e| stale_or(e, bytes, block_seq, 16))?;
    if header.block_seq != block_seq {
        return Err(SpanError::Stale);
    }
    let end = PAGE_HEADER_BYTES + header.used_bytes as usize;
    let mut pos = PAGE_HEADER_BYTES;
    for _ in 0..header.record_count {
        let record = RecordHeader::decode(bytes.get(pos..end).ok_or(corrupt(FormatError::Truncated))?).map_err(corrupt)?;
        let key_at = pos + RECORD_HEADER_BYTES;
        let value_at = key_at + usize::from(record.key_len);
        if value_at + record.value_len as usize > end {
            return Err(corrupt(FormatError::Truncated));
        }
        if !visit(&record, &bytes[key_at..value_at], value_at) {
            return Ok(());
        }
        pos = value_at + record.value_len as usize;
    }
    Ok(())
}

/// A checksum failure on a slot that now belongs to a newer block is staleness, not corruption.
fn stale_or(error: FormatError, bytes: &[u8], block_seq: u64, seq_at: usize) -> SpanError {
    let seq = bytes.get(seq_at..seq_at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    match error {
        FormatError::ForeignStore { .. } => SpanError::Corrupt(error),
        _ if seq.is_some_and(|s| s != block_seq) => SpanError::Stale,
        _ => SpanError::Corrupt(error),
    }
}

/// Bytes of a footer page for `footer`.
pub fn footer_page(geo: &BlockGeometry, footer: &Footer) -> AlignedBuf {
    let mut page = AlignedBuf::zeroed(geo.page_size);
    footer.encode(geo.store_id, &mut page[..FOOTER_BYTES]);
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> BlockGeometry {
        BlockGeometry { store_id: 42, page_size: 4096, sector: 512, block_size: 256 * 1024, index_bits_per_key: 16, fingerprint_bits: 8 }
    }

    struct Owned {
        key: Vec<u8>,
        value: Vec<u8>,
        version: u64,
        kind: RecordKind,
    }

    fn owned(n: usize, value_len: impl Fn(usize) -> usize) -> Vec<Owned> {
        (0..n)
            .map(|i| Owned { key: format!("key-{i}").into_bytes(), value: vec![(i % 251) as u8; value_len(i)], version: i as u64 + 1, kind: if i % 17 == 5 { RecordKind::Tombstone } else { RecordKind::Put } })
            .collect()
    }

    fn refs(records: &[Owned]) -> Vec<RecordRef<'_>> {
        let mut refs: Vec<RecordRef<'_>> = records
            .iter()
            .map(|o| RecordRef { hash: KeyHash::of(&o.key), version: o.version, kind: o.kind, key: &o.key, value: if o.kind == RecordKind::Tombstone { &[] } else { &o.value } })
            .collect();
        refs.sort_by(record_order);
        refs
    }

    fn read_span<'a>(image: &'a [u8], span: &Span) -> &'a [u8] {
        &image[span.offset_bytes as usize..span.offset_bytes as usize + span.len_bytes as usize]
    }

    /// The block struct is charged to the RAM index budget (`block_overhead_bytes`): keep it
    /// from growing unnoticed.
    #[test]
    fn block_index_stays_small() {
        assert!(std::mem::size_of::<BlockIndex>() <= 96, "{}", std::mem::size_of::<BlockIndex>());
    }

    /// Blocks with large records carry their keys' digests between data and summary, found
    /// again at reopen; blocks without large records, or laid out without digests (older
    /// stores), have none.
    #[test]
    fn key_digests_of_large_records() {
        let geo = geo();
        let records = owned(60, |i| if i % 3 == 0 { 100 } else { 4096 });
        let all = refs(&records);
        let refs = &all[..records_fitting(&geo, &all)];
        let mut image = AlignedBuf::zeroed(geo.block_size);
        let spec = BuildSpec { slot: 3, device_offset_bytes: 1 << 20, block_seq: 9, partition: 1, kind: BlockKind::Normal };
        let built = build(&geo, &spec, refs, &mut image);
        let (offset, len) = built.index.digests_span().expect("a block with large records has digests");
        let at = (offset - (1 << 20)) as usize;
        let large: Vec<&RecordRef<'_>> = refs.iter().filter(|r| !geo.is_small(r.key.len(), r.value.len())).collect();
        let digests = crate::format::decode_digests(&image[at..at + len], 9, large.len()).unwrap();
        assert_eq!(digests, large.iter().map(|r| (r.hash.sort, crate::hash::key_digest(geo.store_id, r.key))).collect::<Vec<_>>());
        assert!(digests.windows(2).all(|w| w[0].0 <= w[1].0), "digests are sorted by key hash");
        // The digest is keyed by the store's id: another store's digests of the same keys differ.
        assert!(large.iter().all(|r| crate::hash::key_digest(geo.store_id, r.key) != crate::hash::key_digest(geo.store_id + 1, r.key)));
        // The first layout's magic (unkeyed digests) is refused: such blocks are collected by reads.
        let mut first_layout = image[at..at + len].to_vec();
        first_layout[..4].copy_from_slice(b"KDG1");
        assert_eq!(crate::format::decode_digests(&first_layout, 9, large.len()), Err(FormatError::BadMagic));
        // Another block's digests, a wrong count, a flipped bit: refused.
        assert!(crate::format::decode_digests(&image[at..at + len], 10, large.len()).is_err());
        assert!(crate::format::decode_digests(&image[at..at + len], 9, large.len() - 1).is_err());
        let mut damaged = image[at..at + len].to_vec();
        damaged[40] ^= 1;
        assert_eq!(crate::format::decode_digests(&damaged, 9, large.len()), Err(FormatError::BadChecksum));
        // Reopened from the summary: the same place.
        let summary = &image[built.footer.summary_offset_bytes as usize..][..built.footer.summary_len_bytes as usize];
        let (reopened, _, _) = open_summary(&geo, 3, 1 << 20, &built.footer, summary).unwrap();
        assert_eq!(reopened.digests_span(), Some((offset, len)));
        // A summary right after the data (the layout before digests): none.
        let old_layout = Footer { summary_offset_bytes: built.index.data_end_bytes.next_multiple_of(geo.page_size as u64), ..built.footer };
        let (old, _, _) = open_summary(&geo, 3, 1 << 20, &old_layout, summary).unwrap();
        assert_eq!(old.digests_span(), None);
        // Small records only: none.
        let small = owned(50, |_| 100);
        let small_refs = self::refs(&small);
        let mut image = AlignedBuf::zeroed(geo.block_size);
        let built = build(&geo, &spec, &small_refs, &mut image);
        assert_eq!(built.index.digests_span(), None);
        assert_eq!(built.footer.summary_offset_bytes, built.index.data_end_bytes.next_multiple_of(geo.page_size as u64));
    }

    fn check_block(records: &[Owned]) {
        let geo = geo();
        let refs = refs(records);
        let fit = records_fitting(&geo, &refs);
        let refs = &refs[..fit];
        let mut image = AlignedBuf::zeroed(geo.block_size);
        let spec = BuildSpec { slot: 3, device_offset_bytes: 0, block_seq: 9, partition: 1, kind: BlockKind::Normal };
        let built = build(&geo, &spec, refs, &mut image);
        let summary = &image[built.footer.summary_offset_bytes as usize..][..built.footer.summary_len_bytes as usize];
        let (reopened, filter, samples) = open_summary(&geo, 3, 0, &built.footer, summary).unwrap();
        assert_eq!(filter, built.filter);
        assert_eq!(samples, built.samples);
        let mut reads = 0;
        for r in refs {
            for index in [&built.index, &reopened] {
                let mut spans = Vec::new();
                index.locate(&r.hash, &mut spans);
                assert!(filter.contains(&r.hash));
                let found = spans.iter().find_map(|s| match find_in_span(s, read_span(&image, s), 42, 9, r.key).unwrap() {
                    SpanLookup::Found { version, kind, value_start, value_len } => {
                        Some((version, kind, read_span(&image, s)[value_start..value_start + value_len].to_vec()))
                    }
                    SpanLookup::NotHere => None,
                });
                assert_eq!(found, Some((r.version, r.kind, r.value.to_vec())));
                reads += spans.len();
            }
        }
        assert!(reads as f64 <= 2.0 * refs.len() as f64 * 1.05, "{reads} reads for {} lookups", 2 * refs.len());
        let mut miss_reads = 0;
        for i in 0..5000 {
            let key = format!("absent-{i}");
            let mut spans = Vec::new();
            reopened.locate(&KeyHash::of(key.as_bytes()), &mut spans);
            for s in &spans {
                assert_eq!(find_in_span(s, read_span(&image, s), 42, 9, key.as_bytes()).unwrap(), SpanLookup::NotHere);
            }
            miss_reads += spans.len();
        }
        assert!(miss_reads < 5000 / 40, "{miss_reads} reads for 5000 misses");
        assert!(matches!(find_in_span(&Span { offset_bytes: 0, len_bytes: 4096, large: false }, &image[..4096], 42, 10, b"x"), Err(SpanError::Stale) | Ok(_)));
    }

    #[test]
    fn small_records_block() {
        check_block(&owned(3000, |_| 60));
    }

    #[test]
    fn large_uniform_block() {
        check_block(&owned(60, |_| 4096));
    }

    #[test]
    fn mixed_block() {
        check_block(&owned(400, |i| [10, 300, 900, 1500, 5000][i % 5]));
    }

    #[test]
    fn corrupt_page_is_detected_not_returned() {
        let geo = geo();
        let records = owned(100, |_| 100);
        let refs = refs(&records);
        let mut image = AlignedBuf::zeroed(geo.block_size);
        let spec = BuildSpec { slot: 0, device_offset_bytes: 0, block_seq: 5, partition: 0, kind: BlockKind::Normal };
        let built = build(&geo, &spec, &refs, &mut image);
        let mut spans = Vec::new();
        built.index.locate(&refs[0].hash, &mut spans);
        let span = spans[0];
        let mut page = read_span(&image, &span).to_vec();
        page[200] ^= 4;
        assert_eq!(find_in_span(&span, &page, 42, 5, refs[0].key), Err(SpanError::Corrupt(FormatError::BadChecksum)));
        let summary = &image[built.footer.summary_offset_bytes as usize..][..built.footer.summary_len_bytes as usize];
        let mut bad = summary.to_vec();
        bad[SUMMARY_HEADER_BYTES + 3] ^= 1;
        assert!(open_summary(&geo, 0, 0, &built.footer, &bad).is_err());
    }

    #[test]
    fn ram_index_stays_within_budget() {
        let geo = BlockGeometry { block_size: 4 << 20, ..geo() };
        for (n, len) in [(40_000usize, 100usize), (1200, 4096)] {
            let records = owned(n, |_| len);
            let refs = refs(&records);
            let fit = records_fitting(&geo, &refs);
            let mut image = AlignedBuf::zeroed(geo.block_size);
            let spec = BuildSpec { slot: 0, device_offset_bytes: 0, block_seq: 1, partition: 0, kind: BlockKind::Normal };
            let built = build(&geo, &spec, &refs[..fit], &mut image);
            let bits = 8.0 * (built.index.memory_bytes() + built.filter.words().len() * 8 + block_overhead_bytes()) as f64 / fit as f64;
            eprintln!("{fit} records of {len} bytes: {bits:.2} index bits per key, bloom m/n {:.2}", built.filter.m_bits() as f64 / fit as f64);
            assert!(bits <= 16.5, "{bits} bits per key for {fit} records of {len} bytes");
            assert!(fit as f64 > 0.85 * (geo.block_size / (len + 40)) as f64, "only {fit} records of {len} bytes fit");
        }
    }
}

