//! Elias–Fano coding of a non-decreasing sequence, with predecessor and equality search.
//!
//! A sealed block's page index is one of these over the top bits of its records' sorted key
//! hashes: about `2 + low_bits` bits per record, and a lookup that finds no equal value proves
//! the key absent from the block without reading flash (a fingerprint filter).

use std::ops::Range;

/// Zeros (or ones) between two select samples: 1/8 bit per value, and a select scans about
/// four words.
const SELECT_SAMPLE_EVERY: usize = 256;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EliasFano {
    len: u32,
    low_bits: u32,
    /// Bits in the unary high part: element `i` sets bit `(value_i >> low_bits) + i`.
    high_len_bits: u32,
    /// The high part's words, then the packed low bits.
    words: Box<[u64]>,
    /// Positions in the high part of every `SELECT_SAMPLE_EVERY`-th zero, then of every
    /// `SELECT_SAMPLE_EVERY`-th one.
    samples: Box<[u32]>,
    zero_samples: u32,
}

impl EliasFano {
    /// Encodes `values` (non-decreasing, each `< universe`) for search; [`EliasFano::get`]
    /// needs [`EliasFano::with_access`].
    pub fn new(values: &[u64], universe: u64) -> Self {
        Self::build(values, universe, false)
    }

    /// Like [`EliasFano::new`], also supporting [`EliasFano::get`] (select samples on ones).
    pub fn with_access(values: &[u64], universe: u64) -> Self {
        Self::build(values, universe, true)
    }

    fn build(values: &[u64], universe: u64, access: bool) -> Self {
        let len = values.len();
        assert!(len < u32::MAX as usize, "EliasFano holds at most u32::MAX values");
        let low_bits = if len == 0 || universe <= len as u64 { 0 } else { (universe / len as u64).ilog2() };
        let max_high = values.last().map_or(0, |&v| v >> low_bits) as usize;
        let high_len_bits = len + max_high + 1;
        assert!(high_len_bits < u32::MAX as usize, "EliasFano universe too large for its length");
        let high_words = high_len_bits.div_ceil(64);
        let mut words = vec![0u64; high_words + (len * low_bits as usize).div_ceil(64)];
        let mut prev = 0;
        for (i, &value) in values.iter().enumerate() {
            assert!(value >= prev, "EliasFano input must be non-decreasing");
            assert!(value < universe.max(1), "EliasFano value beyond universe");
            prev = value;
            let pos = (value >> low_bits) as usize + i;
            words[pos / 64] |= 1 << (pos % 64);
            set_bits(&mut words[high_words..], i * low_bits as usize, low_bits, value);
        }
        Self::from_parts(len as u32, low_bits, high_len_bits as u32, words.into_boxed_slice(), access)
    }

    fn from_parts(len: u32, low_bits: u32, high_len_bits: u32, words: Box<[u64]>, access: bool) -> Self {
        let mut ef = Self { len, low_bits, high_len_bits, words, samples: Box::default(), zero_samples: 0 };
        let (mut zeros, mut ones) = (Vec::new(), Vec::new());
        let (mut zero_count, mut one_count) = (0usize, 0usize);
        for pos in 0..high_len_bits as usize {
            if ef.words[pos / 64] >> (pos % 64) & 1 == 1 {
                if access && one_count % SELECT_SAMPLE_EVERY == 0 {
                    ones.push(pos as u32);
                }
                one_count += 1;
            } else {
                if zero_count % SELECT_SAMPLE_EVERY == 0 {
                    zeros.push(pos as u32);
                }
                zero_count += 1;
            }
        }
        ef.zero_samples = zeros.len() as u32;
        zeros.extend(ones);
        ef.samples = zeros.into_boxed_slice();
        ef
    }

    fn high(&self) -> &[u64] {
        &self.words[..(self.high_len_bits as usize).div_ceil(64)]
    }

    fn low(&self) -> &[u64] {
        &self.words[(self.high_len_bits as usize).div_ceil(64)..]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of RAM used (the struct and its heap parts).
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + 8 * self.words.len() + 4 * self.samples.len()
    }

    /// The `i`-th value.
    pub fn get(&self, i: usize) -> u64 {
        assert!(i < self.len());
        assert!(self.samples.len() > self.zero_samples as usize || self.len == 0, "EliasFano::get needs with_access");
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
        let len = self.len();
        let zeros_total = self.high_len_bits as usize - len;
        if len == 0 || b >= zeros_total as u64 {
            return len..len;
        }
        let b = b as usize;
        let (start, mut pos) = if b == 0 {
            (0, 0)
        } else {
            let zero = self.select(b - 1, false);
            (zero - (b - 1), zero + 1)
        };
        let high = self.high();
        let mut end = start;
        loop {
            let shift = pos % 64;
            // Ones from `pos` on; bits shifted in at the top are zeros, so this stops in-word.
            let ones = (!(high[pos / 64] >> shift)).trailing_zeros() as usize;
            end += ones;
            if ones < 64 - shift {
                return start..end;
            }
            pos += ones;
        }
    }

    /// Starts loading into the CPU cache what [`EliasFano::equal_range`] for `x` reads first:
    /// at `stage` 0 the select sample of `x`'s bucket, at stage 1 (once that sample is cached)
    /// the high-part words the select scans from it. Lookups in many sequences at once (a key's
    /// candidate blocks) then wait for their memory together instead of one after another.
    pub fn prefetch(&self, x: u64, stage: u8) {
        let b = (x >> self.low_bits) as usize;
        let zeros_total = self.high_len_bits as usize - self.len();
        if self.len == 0 || b == 0 || b >= zeros_total {
            return;
        }
        let sample = (b - 1) / SELECT_SAMPLE_EVERY;
        match stage {
            0 => prefetch_line(self.samples.as_ptr().wrapping_add(sample).cast()),
            _ => {
                let pos = self.samples[sample] as usize;
                prefetch_line(self.words.as_ptr().wrapping_add(pos / 64).cast());
                // The bucket's first rank, estimated: the ones before the sampled zero, plus
                // the average number of ones per zero times the zeros between it and the bucket.
                let ones_before_sample = pos - sample * SELECT_SAMPLE_EVERY;
                let zeros_after_sample = (b - 1) % SELECT_SAMPLE_EVERY;
                let rank = (ones_before_sample + zeros_after_sample * self.len() / zeros_total).min(self.len() - 1);
                let high_words = (self.high_len_bits as usize).div_ceil(64);
                let low_word = high_words + rank * self.low_bits as usize / 64;
                prefetch_line(self.words.as_ptr().wrapping_add(low_word).cast());
            }
        }
    }

    fn low_mask(&self) -> u64 {
        if self.low_bits == 0 { 0 } else { u64::MAX >> (64 - self.low_bits) }
    }

    fn low_at(&self, i: usize) -> u64 {
        get_bits(self.low(), i * self.low_bits as usize, self.low_bits)
    }

    /// Position of the `rank`-th (0-based) one (or zero) in `high`.
    fn select(&self, rank: usize, ones: bool) -> usize {
        let split = self.zero_samples as usize;
        let samples = if ones { &self.samples[split..] } else { &self.samples[..split] };
        let mut pos = samples[rank / SELECT_SAMPLE_EVERY] as usize;
        let mut remaining = rank % SELECT_SAMPLE_EVERY;
        if remaining == 0 {
            return pos;
        }
        pos += 1;
        loop {
            let word_index = pos / 64;
            let raw = self.high()[word_index];
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
        out.extend_from_slice(&u64::from(self.len).to_le_bytes());
        out.extend_from_slice(&u64::from(self.low_bits).to_le_bytes());
        out.extend_from_slice(&u64::from(self.high_len_bits).to_le_bytes());
        for word in self.words.iter() {
            out.extend_from_slice(&word.to_le_bytes());
        }
    }

    pub fn encoded_bytes(&self) -> usize {
        24 + 8 * self.words.len()
    }

    /// Decodes what [`EliasFano::encode`] wrote, checking it is well formed (it comes from disk);
    /// `access` as in [`EliasFano::with_access`].
    pub fn decode(bytes: &[u8], access: bool) -> Option<(Self, usize)> {
        let word = |i: usize| bytes.get(8 * i..8 * i + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        let len = u32::try_from(word(0)?).ok().filter(|&l| l < u32::MAX)?;
        let low_bits = u32::try_from(word(1)?).ok().filter(|&b| b < 64)?;
        let high_len_bits = u32::try_from(word(2)?).ok().filter(|&h| h < u32::MAX && h >= len)?;
        let high_words = (high_len_bits as usize).div_ceil(64);
        let low_words = (len as usize * low_bits as usize).div_ceil(64);
        let total_words = 3 + high_words + low_words;
        if bytes.len() < 8 * total_words {
            return None;
        }
        let words: Box<[u64]> = (3..total_words).map(|i| word(i).expect("checked")).collect();
        let high = &words[..high_words];
        let ones: usize = high.iter().map(|w| w.count_ones() as usize).sum();
        let tail = high_len_bits as usize % 64;
        let tail_clean = tail == 0 || high.last().is_none_or(|w| w >> tail == 0);
        let last_is_zero = high_len_bits == len || high[(high_len_bits as usize - 1) / 64] >> ((high_len_bits as usize - 1) % 64) & 1 == 0;
        if ones != len as usize || !tail_clean || !last_is_zero {
            return None;
        }
        Some((Self::from_parts(len, low_bits, high_len_bits, words, access), 8 * total_words))
    }
}

/// Asks the CPU to start loading the cache line at `ptr` (a hint: never faults, any address).
#[inline]
pub(crate) fn prefetch_line(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults or changes memory, whatever the
    // address, and SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
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
        let ef = EliasFano::with_access(values, universe);
        for (i, &v) in values.iter().enumerate() {
            assert_eq!(ef.get(i), v);
        }
        let mut probes: Vec<u64> = values.iter().flat_map(|&v| [v.saturating_sub(1), v, v + 1]).collect();
        probes.extend([0, universe.saturating_sub(1), universe / 2]);
        probes.push(u64::MAX);
        for x in probes {
            // Prefetching is a hint, but its address arithmetic must hold for any probe.
            ef.prefetch(x, 0);
            ef.prefetch(x, 1);
            if x == u64::MAX {
                continue;
            }
            let eq: Vec<usize> = (0..values.len()).filter(|&i| values[i] == x).collect();
            let range = ef.equal_range(x);
            assert_eq!(range.clone().collect::<Vec<_>>(), eq, "equal_range({x})");
            let pred = values.iter().rposition(|&v| v <= x);
            assert_eq!(ef.predecessor_rank(x), pred, "predecessor_rank({x})");
        }
        let mut bytes = Vec::new();
        ef.encode(&mut bytes);
        assert_eq!(bytes.len(), ef.encoded_bytes());
        let (decoded, used) = EliasFano::decode(&bytes, true).unwrap();
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
        // As the engine sizes fingerprints: `n << 8`, so 8 low bits and 2 high bits per value.
        let universe = n << 8;
        let mut values: Vec<u64> = (0..n).map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) % universe).collect();
        values.sort_unstable();
        let ef = EliasFano::new(&values, universe);
        let bits_per = ef.memory_bytes() as f64 * 8.0 / n as f64;
        assert!(bits_per < 8.0 + 2.0 + 0.5, "{bits_per} bits per element");
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(EliasFano::decode(&[0xff; 64], false).is_none());
        assert!(EliasFano::decode(&[1, 2, 3], false).is_none());
        let mut bytes = Vec::new();
        EliasFano::new(&[1, 7, 9], 16).encode(&mut bytes);
        bytes[24] ^= 0x10;
        assert!(EliasFano::decode(&bytes, false).is_none());
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
