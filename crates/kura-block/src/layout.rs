//! How a volume's bytes map to pool values: block `lba` is one 4 KiB value under
//! [`kura_pool::block_key`]`(volume_id, lba)` (paper 000 §3.3). A byte range splits into one
//! [`Segment`] per block it touches; a segment that covers its whole block is written with one
//! set, a partial one needs a read-modify-write.

/// Bytes of one block, i.e. of one pool value.
pub const BLOCK_SHIFT: u32 = 12;
pub const BLOCK_SIZE_BYTES: u64 = 1 << BLOCK_SHIFT;
/// The sector of the block layer: the smallest unit NBD, ublk and loop devices address.
pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE_BYTES: u64 = 1 << SECTOR_SHIFT;
const _: () = assert!(BLOCK_SIZE_BYTES.is_multiple_of(SECTOR_SIZE_BYTES));
const _: () = assert!(BLOCK_SIZE_BYTES == 4096, "paper 000: one 4 KiB value per block");

/// A block of zeros: what a block that was never written (or was trimmed) reads as.
pub static ZERO_BLOCK: [u8; BLOCK_SIZE_BYTES as usize] = [0; BLOCK_SIZE_BYTES as usize];

/// One block's share of a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The block.
    pub lba: u64,
    /// Where the range starts inside the block.
    pub offset_in_block: u32,
    pub len_bytes: u32,
    /// Where this part starts inside the request's buffer.
    pub buf_offset: usize,
}

impl Segment {
    /// Covers its whole block: written with one set, no read needed.
    pub fn is_full(&self) -> bool {
        u64::from(self.len_bytes) == BLOCK_SIZE_BYTES
    }

    pub fn in_block(&self) -> std::ops::Range<usize> {
        self.offset_in_block as usize..(self.offset_in_block + self.len_bytes) as usize
    }

    pub fn in_buf(&self) -> std::ops::Range<usize> {
        self.buf_offset..self.buf_offset + self.len_bytes as usize
    }
}

/// The blocks of the byte range `[offset_bytes, offset_bytes + len_bytes)`, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

impl Split {
    pub fn new(offset_bytes: u64, len_bytes: u64) -> Self {
        assert!(offset_bytes.checked_add(len_bytes).is_some(), "range end overflows u64");
        Self { offset_bytes, len_bytes }
    }

    pub fn first_lba(&self) -> u64 {
        self.offset_bytes >> BLOCK_SHIFT
    }

    /// Blocks touched.
    pub fn count(&self) -> u64 {
        if self.len_bytes == 0 {
            return 0;
        }
        let last = (self.offset_bytes + self.len_bytes - 1) >> BLOCK_SHIFT;
        last - self.first_lba() + 1
    }

    /// The `index`-th block's segment (`index < count()`).
    pub fn segment(&self, index: u64) -> Segment {
        debug_assert!(index < self.count(), "segment {index} of {}", self.count());
        let lba = self.first_lba() + index;
        let block_start = lba << BLOCK_SHIFT;
        let start = self.offset_bytes.max(block_start);
        let end = (self.offset_bytes + self.len_bytes).min(block_start + BLOCK_SIZE_BYTES);
        Segment {
            lba,
            offset_in_block: (start - block_start) as u32,
            len_bytes: (end - start) as u32,
            buf_offset: (start - self.offset_bytes) as usize,
        }
    }

    pub fn segments(&self) -> impl Iterator<Item = Segment> + '_ {
        (0..self.count()).map(|i| self.segment(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn aligned_and_unaligned() {
        let s = Split::new(4096, 8192);
        assert_eq!(s.count(), 2);
        assert!(s.segments().all(|g| g.is_full()));
        assert_eq!(s.segment(1), Segment { lba: 2, offset_in_block: 0, len_bytes: 4096, buf_offset: 4096 });
        let s = Split::new(512, 4096);
        assert_eq!(s.count(), 2);
        assert_eq!(s.segment(0), Segment { lba: 0, offset_in_block: 512, len_bytes: 3584, buf_offset: 0 });
        assert_eq!(s.segment(1), Segment { lba: 1, offset_in_block: 0, len_bytes: 512, buf_offset: 3584 });
        let s = Split::new(1000, 10);
        assert_eq!(s.count(), 1);
        assert_eq!(s.segment(0).in_block(), 1000..1010);
        assert_eq!(Split::new(123, 0).count(), 0);
    }

    proptest! {
        /// Segments tile the range exactly, in order, each inside its own block.
        #[test]
        fn segments_tile_the_range(offset in 0u64..(1 << 40), len in 0u64..(1 << 20)) {
            let split = Split::new(offset, len);
            let mut pos = offset;
            let mut buf = 0usize;
            let mut prev_lba = None;
            for seg in split.segments() {
                prop_assert!(seg.len_bytes > 0);
                prop_assert_eq!((seg.lba << BLOCK_SHIFT) + u64::from(seg.offset_in_block), pos);
                prop_assert!(u64::from(seg.offset_in_block + seg.len_bytes) <= BLOCK_SIZE_BYTES);
                prop_assert_eq!(seg.buf_offset, buf);
                if let Some(p) = prev_lba { prop_assert_eq!(seg.lba, p + 1); }
                // Only the first and the last segment may be partial.
                prop_assert!(seg.is_full() || seg.lba == split.first_lba() || seg.lba == split.first_lba() + split.count() - 1);
                prev_lba = Some(seg.lba);
                pos += u64::from(seg.len_bytes);
                buf += seg.len_bytes as usize;
            }
            prop_assert_eq!(pos, offset + len);
        }
    }
}
