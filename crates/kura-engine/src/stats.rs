//! Counters and the stats snapshot.

use std::sync::atomic::AtomicU64;

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub gets: AtomicU64,
    pub get_hits_ram: AtomicU64,
    pub puts: AtomicU64,
    pub deletes: AtomicU64,
    pub flash_reads: AtomicU64,
    pub flash_read_bytes: AtomicU64,
    pub flash_writes: AtomicU64,
    pub flash_write_bytes: AtomicU64,
    pub syncs: AtomicU64,
    pub device_syncs: AtomicU64,
    pub seals: AtomicU64,
    pub evicted_blocks: AtomicU64,
    pub evicted_records: AtomicU64,
    pub gc_runs: AtomicU64,
    pub gc_background_runs: AtomicU64,
    pub gc_records_moved: AtomicU64,
    pub gc_blocks_freed: AtomicU64,
    pub gc_digest_hits: AtomicU64,
    pub gc_liveness_reads: AtomicU64,
}

/// RAM held by each structure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RamUsage {
    /// The bit-sliced Bloom Filter Maps (block search).
    pub bloom_filter_map_bytes: u64,
    /// Per-block page indexes (Elias–Fano fingerprints, page ranks, slot offsets).
    pub page_index_bytes: u64,
    /// Per-block bookkeeping (struct, maps).
    pub block_table_bytes: u64,
    /// Write buffers' lookup structures (buckets, overflow page filters, large-record table).
    pub write_buffer_index_bytes: u64,
    /// Write buffers' records (data not yet sealed, a cache of the newest writes).
    pub write_buffer_data_bytes: u64,
}

impl RamUsage {
    /// Every index structure (everything but buffered record data).
    pub fn index_bytes(&self) -> u64 {
        self.bloom_filter_map_bytes + self.page_index_bytes + self.block_table_bytes + self.write_buffer_index_bytes
    }
}

/// A snapshot of the engine's state. Fields named `_estimate` come from sampling.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub keys_estimate: u64,
    pub records: u64,
    pub blocks_total: u64,
    pub blocks_used: u64,
    pub blocks_free: u64,
    pub partitions: u64,
    pub capacity_bytes: u64,
    pub bytes_live_estimate: u64,
    pub bytes_dead_estimate: u64,
    pub gets: u64,
    pub get_hits_ram: u64,
    pub puts: u64,
    pub deletes: u64,
    pub flash_reads: u64,
    pub flash_read_bytes: u64,
    pub flash_writes: u64,
    pub flash_write_bytes: u64,
    pub syncs: u64,
    /// fdatasync calls on the device (seals, syncs, frees).
    pub device_syncs: u64,
    pub seals: u64,
    pub evicted_blocks: u64,
    pub evicted_records_estimate: u64,
    /// Garbage-collection passes (store mode), and how many of them the background collector
    /// ran (the rest ran on a writer that found no free block).
    pub gc_runs: u64,
    pub gc_background_runs: u64,
    pub gc_records_moved: u64,
    pub gc_blocks_freed: u64,
    /// Records of collected blocks found superseded from a newer block's key digests (no
    /// read), and liveness reads of newer blocks' records (where digests did not decide).
    pub gc_digest_hits: u64,
    pub gc_liveness_reads: u64,
    pub ram: RamUsage,
}
