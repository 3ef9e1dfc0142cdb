//! Elias–Fano coding of a non-decreasing sequence, with predecessor and equality search.
//!
//! A sealed block's page index is one of these over the top bits of its records' sorted key
//! hashes: about `2 + low_bits` bits per record, and a lookup that finds no equal value proves
//! the key absent from the block without reading flash (a fingerprint filter).

use std::ops::Range;

/// Zeros (or ones) between two select samples.
const SELECT_SAMPLE_EVERY: usize = 128;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EliasFano {
    len: usize,
    low_bits: u32,
    /// Unary-coded high parts: element `i` sets bit `(value_i >> low_bits) + i`.
    high: Vec<u64>,
    high_len_bits: usize,
    low: Vec<u64>,
    /// Position of every `SELECT_SAMPLE_EVERY`-th zero / one in `high`.
    zero_samples: Vec<u32>,
    one_samples: Vec<u32>,
}

impl EliasFano {
    /// Encodes `values` (non-decreasing, each `< universe`).
    pub fn new(values: &[u64], universe: u64) -> Self {
        let len = values.len();
        let low_bits = if len == 0 || universe <= len as u64 { 0 } else { (universe / len as u64).ilog2() };
        let max_high = values.last().map_or(0, |&v| v >> low_bits) as usize;
        let high_len_bits = len + max_high + 1;
        let mut high = vec![0u64; high_len_bits.div_ceil(64)];
        let mut low = vec![0u64; (len * low_bits as usize).div_ceil(64)];
        let mut prev = 0;
        for (i, &value) in values.iter().enumerate() {
            assert!(value >= prev, "EliasFano input must be non-decreasing");
            assert!(value < universe.max(1), "EliasFano value beyond universe");
            prev = value;
            let pos = (value >> low_bits) as usize + i;
            high[pos / 64] |= 1 << (pos % 64);
            set_bits(&mut low, i * low_bits as usize, low_bits, value);
        }
        let mut ef = Self { len, low_bits, high, high_len_bits, low, zero_samples: Vec::new(), one_samples: Vec::new() };
        ef.build_samples();
        ef
    }

    fn build_samples(&mut self) {
        let (mut zeros, mut ones) = (0usize, 0usize);
        for pos in 0..self.high_len_bits {
            if self.high[pos / 64] >> (pos % 64) & 1 == 1 {
                if ones % SELECT_SAMPLE_EVERY == 0 {
                    self.one_samples.push(pos as u32);
                }
                ones += 1;
            } else {
                if zeros % SELECT_SAMPLE_EVERY == 0 {
                    self.zero_samples.push(pos as u32);
                }
                zeros += 1;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of RAM used.
    pub fn memory_bytes(&self) -> usize {
        8 * (self.high.len() + self.low.len()) + 4 * (self.zero_samples.len() + self.one_samples.len())
    }

    /// The `i`-th value.
    pub fn get(&self, i: usize) -> u64 {
        assert!(i < self.len);
        let high = (self.select(i, true) - i) as u64;
        (high << self.low_bits) | self.low_at(i)
    }

    /// Ranks of the values equal to `x` (empty if none).
    pub fn equal_range(&self, x: u64) -> Range<usize> {
        if self.len == 0 {
            return 0..0;
        }
        let bucket = self.bucket(x);
        let want = x & self.low_mask();
        let mut start = bucket.start;
        while start < bucket.end && self.low_at(start) < want {
            start += 1;
        }
        let mut end = start;
        while end < bucket.end && self.low_at(end) == want {
            end += 1;
        }
        start..end
    }

    /// Rank of the last value `<= x`.
    pub fn predecessor_rank(&self, x: u64) -> Option<usize> {
        let bucket = self.bucket(x);
        let want = x & self.low_mask();
        let mut end = bucket.end;
        while end > bucket.start && self.low_at(end - 1) > want {
            end -= 1;
        }
        end.checked_sub(1)
    }

    /// Ranks of the values whose high part equals `x`'s: one select for the bucket's start,
    /// then a scan to the zero that ends it (buckets hold about one value).
    fn bucket(&self, x: u64) -> Range<usize> {
        let b = x >> self.low_bits;
        let zeros_total = self.high_len_bits - self.len;
        if self.len == 0 || b >= zeros_total as u64 {
            return self.len..self.len;
        }
        let b = b as usize;
        let (start, mut pos) = if b == 0 { (0, 0) } else {
            let zero = self.select(b - 1, false);
            (zero - (b - 1), zero + 1)
        };
        let mut end = start;
        loop {
            let shift = pos % 64;
            // Ones from `pos` on; bits shifted in at the top are zeros, so this stops in-word.
            let ones = (!(self.high[pos / 64] >> shift)).trailing_zeros() as usize;
            end += ones;
            if ones < 64 - shift {
                return start..end;
            }
            pos += ones;
        }
    }

    fn low_mask(&self) -> u64 {
        if self.low_bits == 0 { 0 } else { u64::MAX >> (64 - self.low_bits) }
    }

    fn low_at(&self, i: usize) -> u64 {
        get_bits(&self.low, i * self.low_bits as usize, self.low_bits)
    }

    /// Position of the `rank`-th (0-based) one (or zero) in `high`.
    fn select(&self, rank: usize, ones: bool) -> usize {
        let samples = if ones { &self.one_samples } else { &self.zero_samples };
        let mut pos = samples[rank / SELECT_SAMPLE_EVERY] as usize;
        let mut remaining = rank % SELECT_SAMPLE_EVERY;
        if remaining == 0 {
            return pos;
        }
        pos += 1;
        loop {
            let word_index = pos / 64;
            let raw = self.high[word_index];
            let word = (if ones { raw } else { !raw }) >> (pos % 64);
            let count = word.count_ones() as usize;
            if remaining <= count {
                return pos + select_in_word(word, remaining - 1);
            }
            remaining -= count;
            pos = (word_index + 1) * 64;
        }
    }

    /// Serialises into `out` (little-endian words).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.len as u64).to_le_bytes());
        out.extend_from_slice(&u64::from(self.low_bits).to_le_bytes());
        out.extend_from_slice(&(self.high_len_bits as u64).to_le_bytes());
        for word in self.high.iter().chain(&self.low) {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }

    pub fn encoded_bytes(&self) -> usize {
        24 + 8 * (self.high.len() + self.low.len())
    }

    /// Decodes what [`EliasFano::encode`] wrote, checking it is well formed (it comes from disk).
    pub fn decode(bytes: &[u8]) -> Option<(Self, usize)> {
        let word = |i: usize| bytes.get(8 * i..8 * i + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        let len = usize::try_from(word(0)?).ok()?;
        let low_bits = u32::try_from(word(1)?).ok().filter(|&b| b < 64)?;
        let high_len_bits = usize::try_from(word(2)?).ok()?;
        if len > (1 << 32) || high_len_bits > (1 << 34) || high_len_bits < len {
            return None;
        }
        let high_words = high_len_bits.div_ceil(64);
        let low_words = (len * low_bits as usize).div_ceil(64);
        let total_words = 3 + high_words + low_words;
        if bytes.len() < 8 * total_words {
            return None;
        }
        let high: Vec<u64> = (3..3 + high_words).map(|i| word(i).expect("checked")).collect();
        let low: Vec<u64> = (3 + high_words..total_words).map(|i| word(i).expect("checked")).collect();
        let ones: usize = high.iter().map(|w| w.count_ones() as usize).sum();
        let tail_clean = high_len_bits % 64 == 0 || high.last().is_none_or(|w| w >> (high_len_bits % 64) == 0);
        if ones != len || !tail_clean || (high_len_bits > len && high[(high_len_bits - 1) / 64] >> ((high_len_bits - 1) % 64) & 1 == 1) {
            return None;
        }
        let mut ef = Self { len, low_bits, high, high_len_bits, low, zero_samples: Vec::new(), one_samples: Vec::new() };
        ef.build_samples();
        Some((ef, 8 * total_words))
    }
}

/// Position of the `rank`-th (0-based) set bit of `word` (broadword: find the byte by
/// prefix popcounts, then the bit within it).
fn select_in_word(word: u64, rank: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let mut counts = word - ((word >> 1) & 0x5555_5555_5555_5555);
    counts = (counts & 0x3333_3333_3333_3333) + ((counts >> 2) & 0x3333_3333_3333_3333);
    counts = (counts + (counts >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    let prefix = counts.wrapping_mul(ONES);
    let mut byte = 0;
    while byte < 7 && ((prefix >> (8 * byte)) & 0xff) as usize <= rank {
        byte += 1;
    }
    let before = if byte == 0 { 0 } else { ((prefix >> (8 * (byte - 1))) & 0xff) as usize };
    let mut bits = (word >> (8 * byte)) & 0xff;
    for _ in 0..rank - before {
        bits &= bits - 1;
    }
    8 * byte + bits.trailing_zeros() as usize
}

fn get_bits(words: &[u64], bit: usize, width: u32) -> u64 {
    if width == 0 {
        return 0;
    }
    let (index, shift) = (bit / 64, bit % 64);
    let mut value = words[index] >> shift;
    if shift + width as usize > 64 {
        value |= words[index + 1] << (64 - shift);
    }
    value & (u64::MAX >> (64 - width))
}

fn set_bits(words: &mut [u64], bit: usize, width: u32, value: u64) {
    if width == 0 {
        return;
    }
    let value = value & (u64::MAX >> (64 - width));
    let (index, shift) = (bit / 64, bit % 64);
    words[index] |= value << shift;
    if shift + width as usize > 64 {
        words[index + 1] |= value >> (64 - shift);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_against_model(values: &[u64], universe: u64) {
        let ef = EliasFano::new(values, universe);
        for (i, &v) in values.iter().enumerate() {
            assert_eq!(ef.get(i), v);
        }
        let mut probes: Vec<u64> = values.iter().flat_map(|&v| [v.saturating_sub(1), v, v + 1]).collect();
        probes.extend([0, universe.saturating_sub(1), universe / 2]);
        for x in probes {
            let eq: Vec<usize> = (0..values.len()).filter(|&i| values[i] == x).collect();
            let range = ef.equal_range(x);
            assert_eq!(range.clone().collect::<Vec<_>>(), eq, "equal_range({x})");
            let pred = values.iter().rposition(|&v| v <= x);
            assert_eq!(ef.predecessor_rank(x), pred, "predecessor_rank({x})");
        }
        let mut bytes = Vec::new();
        ef.encode(&mut bytes);
        assert_eq!(bytes.len(), ef.encoded_bytes());
        let (decoded, used) = EliasFano::decode(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(decoded, ef);
    }

    #[test]
    fn edge_cases() {
        check_against_model(&[], 10);
        check_against_model(&[0], 1);
        check_against_model(&[5, 5, 5], 6);
        check_against_model(&[0, 1, 2, 3], 4);
        let dense: Vec<u64> = (0..1000).collect();
        check_against_model(&dense, 1000);
        let sparse: Vec<u64> = (0..1000).map(|i| i * 1_000_003).collect();
        check_against_model(&sparse, 1_000_003_000);
    }

    #[test]
    fn fingerprint_space_per_element() {
        let n = 100_000u64;
        let universe = n.next_power_of_two() << 8;
        let mut values: Vec<u64> = (0..n).map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) % universe).collect();
        values.sort_unstable();
        let ef = EliasFano::new(&values, universe);
        let bits_per = ef.memory_bytes() as f64 * 8.0 / n as f64;
        assert!(bits_per < 8.0 + 2.0 + 1.5, "{bits_per} bits per element");
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(EliasFano::decode(&[0xff; 64]).is_none());
        assert!(EliasFano::decode(&[1, 2, 3]).is_none());
        let mut bytes = Vec::new();
        EliasFano::new(&[1, 7, 9], 16).encode(&mut bytes);
        bytes[24] ^= 0x10;
        assert!(EliasFano::decode(&bytes).is_none());
    }

    proptest! {
        #[test]
        fn matches_sorted_vec(mut values in proptest::collection::vec(0u64..5000, 0..600), extra in 0u64..100_000) {
            values.sort_unstable();
            check_against_model(&values, 5000 + extra);
        }

        #[test]
        fn wide_values(mut values in proptest::collection::vec(any::<u64>(), 1..200)) {
            values.sort_unstable();
            let universe = values.last().unwrap().saturating_add(1).max(1);
            if universe > *values.last().unwrap() {
                check_against_model(&values, universe);
            }
        }
    }
}
