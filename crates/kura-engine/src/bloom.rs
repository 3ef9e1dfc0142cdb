//! Per-block Bloom filters and the bit-sliced **Bloom Filter Map** (thesis ch. 6.1).
//!
//! The map stores the filters of many blocks transposed: row `r` holds bit `r` of every block's
//! filter, one bit per block (a column). A lookup reads the key's `k` rows and ANDs them; every
//! set bit left is a candidate block. Cost is `k` row reads of `blocks / 8` bytes, instead of
//! `k` scattered cache misses per block when filters are probed one by one.
//!
//! Blocks holding different numbers of keys get different filter sizes; sizes are quantised
//! into classes (eight per octave) and each class is its own bit-sliced map.

use crate::hash::KeyHash;

pub const BLOOM_K_MAX: u32 = 16;
/// Filter size classes per doubling of size.
const CLASSES_PER_OCTAVE: f64 = 8.0;

/// The largest class size (bits) not above `budget_bits` (at least 64).
pub fn class_m_bits(budget_bits: u64) -> u32 {
    if budget_bits < 64 {
        return 64;
    }
    let steps = (CLASSES_PER_OCTAVE * (budget_bits as f64 / 64.0).log2()).floor();
    let mut m = (64.0 * (steps / CLASSES_PER_OCTAVE).exp2()).floor() as u64;
    while m > budget_bits {
        m -= 1;
    }
    m.clamp(64, u64::from(u32::MAX)) as u32
}

/// The probe count that minimises false positives for `n` keys in `m` bits.
pub fn optimal_k(m_bits: u32, n: usize) -> u32 {
    let k = (std::f64::consts::LN_2 * f64::from(m_bits) / n.max(1) as f64).round();
    (k as u32).clamp(1, BLOOM_K_MAX)
}

/// One block's filter, as stored in its summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BloomFilter {
    m_bits: u32,
    k: u32,
    words: Vec<u64>,
}

impl BloomFilter {
    pub fn new(m_bits: u32, k: u32) -> Self {
        assert!(m_bits > 0 && (1..=BLOOM_K_MAX).contains(&k));
        Self { m_bits, k, words: vec![0; (m_bits as usize).div_ceil(64)] }
    }

    pub fn from_words(m_bits: u32, k: u32, words: Vec<u64>) -> Option<Self> {
        let ok = m_bits > 0 && (1..=BLOOM_K_MAX).contains(&k) && words.len() == (m_bits as usize).div_ceil(64);
        ok.then_some(Self { m_bits, k, words })
    }

    pub fn m_bits(&self) -> u32 {
        self.m_bits
    }
    pub fn k(&self) -> u32 {
        self.k
    }
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn insert(&mut self, hash: &KeyHash) {
        for pos in hash.bloom_positions(self.m_bits, self.k) {
            self.words[pos as usize / 64] |= 1 << (pos % 64);
        }
    }

    pub fn contains(&self, hash: &KeyHash) -> bool {
        hash.bloom_positions(self.m_bits, self.k).all(|pos| self.words[pos as usize / 64] >> (pos % 64) & 1 == 1)
    }

    fn set_positions(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| BitIter(word).map(move |bit| (i * 64 + bit) as u32))
    }
}

struct BitIter(u64);

impl Iterator for BitIter {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

/// Where a block's filter sits in a [`BloomFilterMap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BfmColumn {
    class: u32,
    column: u32,
}

/// Bit-sliced filters of a set of blocks, each block named by a `u32` id.
#[derive(Debug, Default)]
pub struct BloomFilterMap {
    classes: Vec<BfmClass>,
}

#[derive(Debug)]
struct BfmClass {
    m_bits: u32,
    k: u32,
    /// Bytes per row; columns `0..8 * stride_bytes`.
    stride_bytes: usize,
    /// `m_bits` rows, then 8 bytes of padding so the last row can be read a word at a time.
    rows: Vec<u8>,
    columns: Vec<Option<u32>>,
    free_columns: Vec<u32>,
}

impl BloomFilterMap {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a block's filter; returns where it went (needed to remove it).
    pub fn insert(&mut self, id: u32, filter: &BloomFilter) -> BfmColumn {
        let class = match self.classes.iter().position(|c| c.m_bits == filter.m_bits && c.k == filter.k) {
            Some(i) => i,
            None => {
                self.classes.push(BfmClass::new(filter.m_bits, filter.k));
                self.classes.len() - 1
            }
        };
        let column = self.classes[class].insert(id, filter);
        BfmColumn { class: class as u32, column }
    }

    pub fn remove(&mut self, at: BfmColumn) {
        self.classes[at.class as usize].remove(at.column);
    }

    /// Appends the ids of every block whose filter may contain the key (unordered).
    pub fn candidates(&self, hash: &KeyHash, out: &mut impl Extend<u32>) {
        for class in &self.classes {
            class.candidates(hash, out);
        }
    }

    pub fn memory_bytes(&self) -> usize {
        self.classes.iter().map(|c| c.rows.len() + 4 * c.columns.len() + 4 * c.free_columns.capacity()).sum()
    }

    pub fn len(&self) -> usize {
        self.classes.iter().map(|c| c.columns.iter().filter(|c| c.is_some()).count()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BfmClass {
    fn new(m_bits: u32, k: u32) -> Self {
        Self { m_bits, k, stride_bytes: 0, rows: vec![0; 8], columns: Vec::new(), free_columns: Vec::new() }
    }

    fn insert(&mut self, id: u32, filter: &BloomFilter) -> u32 {
        let column = match self.free_columns.pop() {
            Some(column) => column,
            None => {
                if self.columns.len() == 8 * self.stride_bytes {
                    self.widen();
                }
                self.columns.push(None);
                (self.columns.len() - 1) as u32
            }
        };
        self.columns[column as usize] = Some(id);
        let (byte, bit) = (column as usize / 8, column % 8);
        for pos in filter.set_positions() {
            self.rows[pos as usize * self.stride_bytes + byte] |= 1 << bit;
        }
        column
    }

    /// Adds a byte (eight columns) to every row, growing by an eighth at larger sizes.
    fn widen(&mut self) {
        let new_stride = (self.stride_bytes + 1).max(self.stride_bytes + self.stride_bytes / 8);
        let mut rows = vec![0u8; self.m_bits as usize * new_stride + 8];
        for r in 0..self.m_bits as usize {
            let old = &self.rows[r * self.stride_bytes..(r + 1) * self.stride_bytes];
            rows[r * new_stride..r * new_stride + self.stride_bytes].copy_from_slice(old);
        }
        self.rows = rows;
        self.stride_bytes = new_stride;
    }

    fn remove(&mut self, column: u32) {
        assert!(self.columns[column as usize].take().is_some(), "removing an empty BFM column");
        let (byte, mask) = (column as usize / 8, !(1u8 << (column % 8)));
        for r in 0..self.m_bits as usize {
            self.rows[r * self.stride_bytes + byte] &= mask;
        }
        self.free_columns.push(column);
    }

    fn candidates(&self, hash: &KeyHash, out: &mut impl Extend<u32>) {
        if self.columns.is_empty() {
            return;
        }
        let mut positions = [0usize; BLOOM_K_MAX as usize];
        for (slot, pos) in positions.iter_mut().zip(hash.bloom_positions(self.m_bits, self.k)) {
            *slot = pos as usize * self.stride_bytes;
        }
        let positions = &positions[..self.k as usize];
        let columns = self.columns.len();
        for chunk in 0..columns.div_ceil(64) {
            let mut acc = u64::MAX;
            for &row in positions {
                let at = row + chunk * 8;
                acc &= u64::from_le_bytes(self.rows[at..at + 8].try_into().expect("8 bytes"));
                if acc == 0 {
                    break;
                }
            }
            let valid = columns - chunk * 64;
            if valid < 64 {
                acc &= (1u64 << valid) - 1;
            }
            for bit in BitIter(acc) {
                if let Some(id) = self.columns[chunk * 64 + bit] {
                    out.extend(Some(id));
                }
            }
        }
    }
}

/// The traditional layout the thesis compares against: one filter per block, probed in turn.
#[derive(Debug, Default)]
pub struct SequentialFilters {
    filters: Vec<(u32, BloomFilter)>,
}

impl SequentialFilters {
    pub fn push(&mut self, id: u32, filter: BloomFilter) {
        self.filters.push((id, filter));
    }

    pub fn candidates(&self, hash: &KeyHash, out: &mut Vec<u32>) {
        for (id, filter) in &self.filters {
            if filter.contains(hash) {
                out.push(*id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn filter_of(keys: std::ops::Range<u32>, m: u32, k: u32) -> BloomFilter {
        let mut f = BloomFilter::new(m, k);
        for key in keys {
            f.insert(&KeyHash::of(&key.to_le_bytes()));
        }
        f
    }

    #[test]
    fn class_sizes_quantise_down() {
        for budget in [64u64, 100, 1000, 12_345, 1 << 20] {
            let m = class_m_bits(budget);
            assert!(u64::from(m) <= budget && f64::from(m) > budget as f64 * 0.9, "{budget} -> {m}");
        }
        assert_eq!(class_m_bits(10), 64);
        assert_eq!(optimal_k(1600, 100), 11);
    }

    #[test]
    fn map_agrees_with_sequential_probing() {
        let mut map = BloomFilterMap::new();
        let mut seq = SequentialFilters::default();
        let mut placed = Vec::new();
        for block in 0..150u32 {
            let m = if block % 3 == 0 { 2048 } else { 4096 };
            let f = filter_of(block * 200..block * 200 + 200, m, 6);
            placed.push(map.insert(block, &f));
            seq.push(block, f);
        }
        for key in (0..30_000u32).step_by(7).chain(1_000_000..1_001_000) {
            let h = KeyHash::of(&key.to_le_bytes());
            let (mut a, mut b) = (Vec::new(), Vec::new());
            map.candidates(&h, &mut a);
            seq.candidates(&h, &mut b);
            let (a, b): (BTreeSet<_>, BTreeSet<_>) = (a.into_iter().collect(), b.into_iter().collect());
            assert_eq!(a, b);
            if key < 30_000 {
                assert!(a.contains(&(key / 200)), "false negative for {key}");
            }
        }
        // Removing a block removes exactly its candidates; its column is reused.
        map.remove(placed[4]);
        let h = KeyHash::of(&(4 * 200u32 + 5).to_le_bytes());
        let mut c = Vec::new();
        map.candidates(&h, &mut c);
        assert!(!c.contains(&4));
        let again = map.insert(999, &filter_of(800..1000, 4096, 6));
        assert_eq!(again, placed[4]);
        c.clear();
        map.candidates(&h, &mut c);
        assert!(c.contains(&999));
        assert_eq!(map.len(), 150);
    }

    #[test]
    fn false_positive_rate_matches_theory() {
        let n = 2000;
        let m = 16 * n;
        let f = filter_of(0..n, m, optimal_k(m, n as usize));
        let fp = (n..n + 200_000).filter(|k| f.contains(&KeyHash::of(&k.to_le_bytes()))).count();
        let rate = fp as f64 / 200_000.0;
        assert!(rate < 0.0015, "false positive rate {rate}");
    }
}
