//! Which chunks of a file are known to be holes: sorted, disjoint, non-adjacent ranges of
//! chunk indexes `[start, end)`, kept in the inode record ([`crate::layout::Inode::holes`]) so
//! that `st_blocks` can tell a sparse file (`du`, `ls -s`, and the `st_blocks < st_size / 512`
//! test with which `cp` and `tar` decide to look for holes) from a dense one.
//!
//! The set only ever under-states the holes, never the data, by design of its updates: a
//! chunk joins it after the chunk was deleted (written as zeros, punched, or past a size that
//! grew), and leaves it after data was stored in it (see `Fs::write_back_meta`). Where it
//! must be cut to [`HOLE_RANGES_MAX`] ranges, the smallest holes are forgotten (counted as
//! data). And `st_blocks` of a non-empty file is never 0 ([`allocated_blocks`]): GNU tar takes
//! a file with no blocks as all holes without reading it, so a set left wrong by two processes
//! racing on one chunk must not make a file empty there. `SEEK_DATA`/`SEEK_HOLE` never use
//! the set: they ask the pool which chunks exist.

/// Ranges of holes an inode record keeps, at most (16 bytes each).
pub const HOLE_RANGES_MAX: usize = 64;

/// Ranges of chunk indexes a process gathers between two write-backs of a file's size, at
/// most, per kind (written with data, deleted as zeros).
pub const PENDING_RANGES_MAX: usize = 1024;

/// A range of chunk indexes, `start..end`.
pub type ChunkRange = (u64, u64);

/// Adds `start..end` to `set`, merging the ranges it touches.
pub fn add(set: &mut Vec<ChunkRange>, (start, end): ChunkRange) {
    if start >= end {
        return;
    }
    // The first range that ends at or after `start` (it may touch the new one).
    let first = set.partition_point(|&(_, e)| e < start);
    // The ranges from `first` that start at or before `end` merge with it.
    let last = first + set[first..].partition_point(|&(s, _)| s <= end);
    let merged = if first < last { (set[first].0.min(start), set[last - 1].1.max(end)) } else { (start, end) };
    set.splice(first..last, [merged]);
}

/// Removes `start..end` from `set`, splitting a range it falls inside.
pub fn remove(set: &mut Vec<ChunkRange>, (start, end): ChunkRange) {
    if start >= end {
        return;
    }
    let first = set.partition_point(|&(_, e)| e <= start);
    let last = first + set[first..].partition_point(|&(s, _)| s < end);
    if first == last {
        return;
    }
    let mut kept = Vec::with_capacity(2);
    if set[first].0 < start {
        kept.push((set[first].0, start));
    }
    if set[last - 1].1 > end {
        kept.push((end, set[last - 1].1));
    }
    set.splice(first..last, kept);
}

/// Drops everything at or after chunk `end`.
pub fn clip(set: &mut Vec<ChunkRange>, end: u64) {
    remove(set, (end, u64::MAX));
}

/// Forgets the smallest ranges until at most `max` are left (they count as data).
pub fn cap(set: &mut Vec<ChunkRange>, max: usize) {
    if set.len() <= max {
        return;
    }
    let mut by_len: Vec<u64> = set.iter().map(|&(s, e)| e - s).collect();
    by_len.sort_unstable_by(|a, b| b.cmp(a));
    let keep_min = by_len[max - 1];
    // Ranges of the cut-off length are kept front to back until `max` are.
    let mut longer = by_len.iter().take(max).filter(|&&len| len > keep_min).count();
    set.retain(|&(s, e)| {
        let len = e - s;
        if len > keep_min {
            true
        } else if len == keep_min && longer < max {
            longer += 1;
            true
        } else {
            false
        }
    });
}

/// Chunks of a file of `size_bytes` in `set`, in bytes (the last chunk counts for what of it
/// is inside the file).
pub fn hole_bytes(set: &[ChunkRange], chunk_bytes: u64, size_bytes: u64) -> u64 {
    set.iter()
        .map(|&(s, e)| {
            let from = s.saturating_mul(chunk_bytes).min(size_bytes);
            let to = e.saturating_mul(chunk_bytes).min(size_bytes);
            to - from
        })
        .sum()
}

/// `st_blocks` (512-byte units) of a file of `size_bytes` with holes `set`: at least one for a
/// non-empty file (see the module's documentation).
pub fn allocated_blocks(set: &[ChunkRange], chunk_bytes: u64, size_bytes: u64) -> u64 {
    let data_bytes = size_bytes - hole_bytes(set, chunk_bytes, size_bytes).min(size_bytes);
    let blocks = data_bytes.div_ceil(512);
    if size_bytes > 0 { blocks.max(1) } else { 0 }
}

/// What a process did to a file's chunks since it last wrote the file's size back: which it
/// stored data in and which it deleted as zeros (the last of the two for a chunk counts).
#[derive(Debug, Default, Clone)]
pub struct ChunkChanges {
    data: Vec<ChunkRange>,
    zeros: Vec<ChunkRange>,
    /// More ranges of data than [`PENDING_RANGES_MAX`]: every hole the record has is
    /// forgotten at the next write-back instead.
    data_overflow: bool,
}

impl ChunkChanges {
    /// Chunk `index` was stored: deleted as zeros (`zeros`) or with data.
    pub fn note(&mut self, index: u64, zeros: bool) {
        if zeros { self.zeros(index) } else { self.data(index) }
    }

    /// Chunk `index` was stored with data.
    pub fn data(&mut self, index: u64) {
        remove(&mut self.zeros, (index, index + 1));
        if !self.data_overflow {
            add(&mut self.data, (index, index + 1));
            if self.data.len() > PENDING_RANGES_MAX {
                self.data.clear();
                self.data_overflow = true;
            }
        }
    }

    /// Chunk `index` was deleted as zeros.
    pub fn zeros(&mut self, index: u64) {
        remove(&mut self.data, (index, index + 1));
        add(&mut self.zeros, (index, index + 1));
        // Past the bound the hole is not recorded (it counts as data). One chunk's range
        // adds a range only when it touches none, so taking it out again leaves the set
        // as it was.
        if self.zeros.len() > PENDING_RANGES_MAX {
            remove(&mut self.zeros, (index, index + 1));
        }
    }

    /// Applies these changes to `holes` of a file whose record's size goes from `old_size`
    /// to `new_size` bytes: chunks the size now covers that were never written are holes,
    /// then zeros join and data leaves.
    pub fn apply(&self, holes: &mut Vec<ChunkRange>, chunk_bytes: u64, old_size: u64, new_size: u64) {
        if self.data_overflow {
            holes.clear();
        }
        if new_size > old_size {
            add(holes, (old_size.div_ceil(chunk_bytes), new_size.div_ceil(chunk_bytes)));
        }
        for &range in &self.zeros {
            add(holes, range);
        }
        for &range in &self.data {
            remove(holes, range);
        }
        clip(holes, new_size.max(old_size).div_ceil(chunk_bytes));
        cap(holes, HOLE_RANGES_MAX);
    }

    /// The record's holes are forgotten at the next write-back (they may no longer be).
    pub fn forget_holes(&mut self) {
        self.data.clear();
        self.data_overflow = true;
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty() && self.zeros.is_empty() && !self.data_overflow
    }
}

/// Whether `set` is well formed: sorted, disjoint, non-adjacent, non-empty ranges.
pub fn is_valid(set: &[ChunkRange]) -> bool {
    set.iter().all(|&(s, e)| s < e) && set.windows(2).all(|w| w[0].1 < w[1].0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn members(set: &[ChunkRange]) -> BTreeSet<u64> {
        set.iter().flat_map(|&(s, e)| s..e).collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u64, u64),
        Remove(u64, u64),
        Clip(u64),
        Cap(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..64, 0u64..12).prop_map(|(s, n)| Op::Add(s, s + n)),
            3 => (0u64..64, 0u64..12).prop_map(|(s, n)| Op::Remove(s, s + n)),
            1 => (0u64..80).prop_map(Op::Clip),
            1 => (1usize..6).prop_map(Op::Cap),
        ]
    }

    proptest! {
        /// Against a set of chunk indexes: add, remove and clip are exact; cap keeps at most
        /// `max` ranges, each one the set had, and the longest ones.
        #[test]
        fn ranges_match_a_set_of_indexes(ops in proptest::collection::vec(op(), 1..60)) {
            let mut set = Vec::new();
            let mut model = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Add(s, e) => { add(&mut set, (s, e)); model.extend(s..e); }
                    Op::Remove(s, e) => { remove(&mut set, (s, e)); for i in s..e { model.remove(&i); } }
                    Op::Clip(end) => { clip(&mut set, end); model.retain(|&i| i < end); }
                    Op::Cap(max) => {
                        let before = set.clone();
                        cap(&mut set, max);
                        prop_assert!(set.len() <= max);
                        prop_assert!(set.iter().all(|r| before.contains(r)));
                        let shortest_kept = set.iter().map(|&(s, e)| e - s).min().unwrap_or(u64::MAX);
                        prop_assert!(before.iter().filter(|r| !set.contains(r)).all(|&(s, e)| e - s <= shortest_kept));
                        model = members(&set);
                    }
                }
                prop_assert!(is_valid(&set), "{set:?}");
                prop_assert_eq!(members(&set), model.clone());
            }
        }
    }

    #[test]
    fn changes_apply_in_order_and_past_their_bound_forget_holes() {
        let mut changes = ChunkChanges::default();
        changes.data(3);
        changes.zeros(3);
        changes.zeros(7);
        changes.data(7);
        changes.data(12);
        // The file grew from 1 to 16 chunks: 1..16 never written but 12 and 7 (zeros then
        // data), 3 zeros after data.
        let mut holes = Vec::new();
        changes.apply(&mut holes, 4096, 4096, 16 * 4096);
        assert_eq!(holes, [(1, 7), (8, 12), (13, 16)]);
        let mut many = ChunkChanges::default();
        for i in 0..=PENDING_RANGES_MAX as u64 {
            many.data(2 * i);
        }
        let mut holes = vec![(1, 2), (5000, 6000)];
        many.apply(&mut holes, 4096, 10_000 * 4096, 10_000 * 4096);
        assert!(holes.is_empty(), "{holes:?}");
    }

    #[test]
    fn blocks_count_what_is_not_a_hole_and_never_nothing() {
        let chunk = 4096;
        // A dense file: its size in 512-byte units, as before holes were kept.
        assert_eq!(allocated_blocks(&[], chunk, 6), 1);
        assert_eq!(allocated_blocks(&[], chunk, 10_000), 20);
        assert_eq!(allocated_blocks(&[], chunk, 0), 0);
        // `truncate -s 1G`: all holes, yet one block (see the module).
        assert_eq!(allocated_blocks(&[(0, 262_144)], chunk, 1 << 30), 1);
        // One chunk of data in the middle of 1 MiB.
        assert_eq!(allocated_blocks(&[(0, 100), (101, 256)], chunk, 1 << 20), 8);
        // A hole past the size counts for nothing; a last partial chunk for its part.
        assert_eq!(hole_bytes(&[(1, 5)], chunk, 6000), 6000 - 4096);
    }
}
