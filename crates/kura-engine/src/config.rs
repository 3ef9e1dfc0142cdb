//! Engine configuration: every limit has a name and a default.

use crate::format::{KEY_SIZE_BYTES_MAX, Mode, PAGE_SIZE_BYTES_UNIT, PARTITIONS_MAX};

pub const PAGE_SIZE_BYTES_DEFAULT: u32 = 4096;
pub const BLOCK_SIZE_BYTES_DEFAULT: u32 = 8 << 20;
pub const INDEX_BITS_PER_KEY_DEFAULT: u32 = 16;
pub const FINGERPRINT_BITS_DEFAULT: u32 = 9;
pub const VALUE_SIZE_BYTES_MAX_DEFAULT: usize = 1 << 20;
/// With `partitions = 0`, one partition per this many blocks: it bounds the blocks a lookup
/// considers, so that a miss costs under ~0.05 flash reads at the default index budget (each
/// block lets an absent key through with probability ~6e-4). More partitions mean fewer false
/// reads but more RAM in write buffers (each partition fills a whole block in RAM).
pub const BLOCKS_PER_PARTITION_TARGET: u32 = 44;
pub const PARTITIONS_AUTO_MAX: u32 = 32;
/// Most fingerprint bits [`EngineConfig::index_bits_for`] adds for a capped partition count.
pub const FINGERPRINT_BITS_EXTRA_MAX: u32 = 8;
pub const SEAL_THREADS_DEFAULT: usize = 4;
pub const SEAL_THREADS_MAX: usize = 64;

/// How to create or open a store.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Page size; a multiple of 4 KiB. Fixed at format time.
    pub page_size_bytes: u32,
    /// Block (segment) size; a multiple of the page size. Fixed at format time.
    pub block_size_bytes: u32,
    /// Key-hash partitions (independent write streams and Bloom Filter Maps); 0 = derived from
    /// the number of blocks. Fixed at format time.
    pub partitions: u32,
    /// With `partitions = 0`: at most this many. Each partition holds a block-sized write
    /// buffer in RAM, so fewer partitions save RAM; when the cap leaves a partition more
    /// blocks than [`BLOCKS_PER_PARTITION_TARGET`], each doubling adds one fingerprint bit
    /// (and one index bit per key), so a miss still costs under ~0.05 flash reads.
    pub partitions_max: u32,
    /// RAM index budget per key: Bloom filter bits plus page-index bits. Fixed at format time.
    pub index_bits_per_key: u32,
    /// Hash bits per record kept in the page index beyond those that address it; each one
    /// halves the chance that a miss costs a flash read. Fixed at format time.
    pub fingerprint_bits: u32,
    /// Cache (drop oldest) or store (never drop). Fixed at format time (cache when unset);
    /// opening a store formatted in another mode is refused.
    pub mode: Option<Mode>,
    /// Longest key accepted.
    pub key_size_max: usize,
    /// Largest value accepted.
    pub value_size_max_bytes: usize,
    /// Logical journal pages; 0 = enough for every partition's buffers twice over.
    pub journal_logical_pages: u32,
    /// Size of a regular file created for the store.
    pub size_bytes: Option<u64>,
    /// Use `O_DIRECT` where the file system allows it.
    pub direct_io: bool,
    /// Background threads that write sealed blocks, so writers keep filling new buffers
    /// meanwhile; 0 seals on the writing thread.
    pub seal_threads: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size_bytes: PAGE_SIZE_BYTES_DEFAULT,
            block_size_bytes: BLOCK_SIZE_BYTES_DEFAULT,
            partitions: 0,
            partitions_max: PARTITIONS_AUTO_MAX,
            index_bits_per_key: INDEX_BITS_PER_KEY_DEFAULT,
            fingerprint_bits: FINGERPRINT_BITS_DEFAULT,
            mode: None,
            key_size_max: KEY_SIZE_BYTES_MAX,
            value_size_max_bytes: VALUE_SIZE_BYTES_MAX_DEFAULT,
            journal_logical_pages: 0,
            size_bytes: None,
            direct_io: true,
            seal_threads: SEAL_THREADS_DEFAULT,
        }
    }
}

impl EngineConfig {
    /// Checks the parts that are independent of the device.
    pub fn validate(&self) -> Result<(), String> {
        let page = self.page_size_bytes;
        if page < PAGE_SIZE_BYTES_UNIT || !page.is_multiple_of(PAGE_SIZE_BYTES_UNIT) || page > (1 << 20) {
            return Err(format!("page size {page} must be a multiple of 4096 up to 1 MiB"));
        }
        if !self.block_size_bytes.is_multiple_of(page) || self.block_size_bytes < 16 * page {
            return Err(format!("block size {} must be a multiple of the page size and at least 16 pages", self.block_size_bytes));
        }
        if self.partitions > PARTITIONS_MAX {
            return Err(format!("at most {PARTITIONS_MAX} partitions"));
        }
        if !(4..=64).contains(&self.index_bits_per_key) {
            return Err("index bits per key must be 4..=64".into());
        }
        if !(1..=24).contains(&self.fingerprint_bits) {
            return Err("fingerprint bits must be 1..=24".into());
        }
        if self.key_size_max == 0 || self.key_size_max > KEY_SIZE_BYTES_MAX {
            return Err(format!("key size limit must be 1..={KEY_SIZE_BYTES_MAX}"));
        }
        if self.partitions_max == 0 {
            return Err("partitions_max must be at least 1".into());
        }
        if self.seal_threads > SEAL_THREADS_MAX {
            return Err(format!("at most {SEAL_THREADS_MAX} seal threads"));
        }
        let value_room = self.block_size_bytes as usize / 4;
        if self.value_size_max_bytes > value_room {
            return Err(format!(
                "value size limit {} exceeds a quarter of the block size ({value_room}); use larger blocks",
                self.value_size_max_bytes
            ));
        }
        Ok(())
    }

    pub fn partitions_for(&self, block_count: u32) -> u32 {
        if self.partitions != 0 {
            return self.partitions;
        }
        block_count.div_ceil(BLOCKS_PER_PARTITION_TARGET).clamp(1, self.partitions_max.clamp(1, PARTITIONS_AUTO_MAX))
    }

    /// Fingerprint bits and index bits per key for a store of `block_count` blocks in
    /// `partitions` partitions: the configured ones, plus one of each for every doubling of
    /// blocks per partition beyond [`BLOCKS_PER_PARTITION_TARGET`] when the partition count was
    /// capped by `partitions_max` (an explicit count keeps the configured bits).
    pub fn index_bits_for(&self, block_count: u32, partitions: u32) -> (u32, u32) {
        let mut extra = 0;
        if self.partitions == 0 {
            let per_partition = block_count.div_ceil(partitions.max(1));
            while per_partition > BLOCKS_PER_PARTITION_TARGET << extra && extra < FINGERPRINT_BITS_EXTRA_MAX {
                extra += 1;
            }
        }
        ((self.fingerprint_bits + extra).min(24), (self.index_bits_per_key + extra).min(64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_partitions_widen_fingerprints_per_doubling() {
        let uncapped = EngineConfig::default();
        assert_eq!(uncapped.partitions_for(880), 20);
        assert_eq!(uncapped.index_bits_for(880, 20), (FINGERPRINT_BITS_DEFAULT, INDEX_BITS_PER_KEY_DEFAULT));
        let capped = EngineConfig { partitions_max: 4, ..EngineConfig::default() };
        assert_eq!(capped.partitions_for(880), 4);
        // 220 blocks per partition: 5x the target, so three doublings.
        assert_eq!(capped.index_bits_for(880, 4), (FINGERPRINT_BITS_DEFAULT + 3, INDEX_BITS_PER_KEY_DEFAULT + 3));
        assert_eq!(capped.partitions_for(100), 3);
        assert_eq!(capped.index_bits_for(100, 3), (FINGERPRINT_BITS_DEFAULT, INDEX_BITS_PER_KEY_DEFAULT));
        let explicit = EngineConfig { partitions: 1, ..EngineConfig::default() };
        assert_eq!(explicit.index_bits_for(880, 1), (FINGERPRINT_BITS_DEFAULT, INDEX_BITS_PER_KEY_DEFAULT));
        assert!(EngineConfig { partitions_max: 0, ..EngineConfig::default() }.validate().is_err());
    }
}
