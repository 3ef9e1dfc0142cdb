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
        block_count.div_ceil(BLOCKS_PER_PARTITION_TARGET).clamp(1, PARTITIONS_AUTO_MAX)
    }
}
