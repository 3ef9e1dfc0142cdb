//! Every hash the engine derives from a key comes from one 128-bit xxh3.

/// The two 64-bit halves of a key's xxh3-128.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    /// Orders records inside blocks; its top bits are the page index's fingerprints.
    pub sort: u64,
    /// Feeds the Bloom filters.
    pub bloom: u64,
}

impl KeyHash {
    pub fn of(key: &[u8]) -> Self {
        let h = xxhash_rust::xxh3::xxh3_128(key);
        Self { sort: h as u64, bloom: (h >> 64) as u64 }
    }

    /// The key-hash partition (write stream) a key belongs to.
    pub fn partition(&self, partitions: u32) -> u32 {
        let mixed = (self.sort ^ self.bloom.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        fastrange32((mixed >> 32) as u32, partitions)
    }

    /// Bit positions in a Bloom filter of `m_bits` with `k` probes (Kirsch–Mitzenmacher
    /// double hashing).
    pub fn bloom_positions(&self, m_bits: u32, k: u32) -> impl Iterator<Item = u32> {
        double_hash(self.bloom as u32, (self.bloom >> 32) as u32 | 1, m_bits, k)
    }

    /// Positions in the write buffer's overflow page filter, independent of the block filter.
    pub fn overflow_positions(&self, m_bits: u32, k: u32) -> impl Iterator<Item = u32> {
        double_hash((self.bloom >> 16) as u32 ^ (self.sort >> 40) as u32, self.sort as u32 | 1, m_bits, k)
    }

    /// The `bits` most significant bits of the sort hash.
    pub fn fingerprint(&self, bits: u32) -> u64 {
        truncate(self.sort, bits)
    }
}

/// The second half of the key of [`key_digest`]'s SipHash (the first is the store's id).
const KEY_DIGEST_SALT: u64 = 0x6b75_7261_2d64_6967; // "kura-dig"

/// A key's digest in a block's key-digest section (`format::encode_digests`): SipHash-1-3
/// under a key made of the store's random id, which never leaves the store file. With the
/// `KeyHash` `sort` half beside it, two keys match only if they agree on 128 bits of which 64
/// a client cannot compute.
pub fn key_digest(store_id: u64, key: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(store_id, KEY_DIGEST_SALT);
    h.write(key);
    h.finish()
}

/// The `bits` most significant bits of `hash` (0 bits gives 0).
pub fn truncate(hash: u64, bits: u32) -> u64 {
    if bits == 0 { 0 } else { hash >> (64 - bits.min(64)) }
}

fn double_hash(h1: u32, h2: u32, m_bits: u32, k: u32) -> impl Iterator<Item = u32> {
    (0..k).map(move |i| fastrange32(h1.wrapping_add(i.wrapping_mul(h2)), m_bits))
}

/// Maps a uniform `x` into `0..n` without division (Lemire).
pub fn fastrange32(x: u32, n: u32) -> u32 {
    ((u64::from(x) * u64::from(n)) >> 32) as u32
}

/// Maps a uniform 64-bit `x` into `0..n`.
pub fn fastrange64(x: u64, n: u64) -> u64 {
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_balanced() {
        let mut counts = [0u32; 8];
        for i in 0..80_000u32 {
            counts[KeyHash::of(&i.to_le_bytes()).partition(8) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn positions_in_range_and_distinct_streams() {
        let h = KeyHash::of(b"key");
        assert!(h.bloom_positions(1000, 7).all(|p| p < 1000));
        let a: Vec<_> = h.bloom_positions(1 << 20, 4).collect();
        let b: Vec<_> = h.overflow_positions(1 << 20, 4).collect();
        assert_ne!(a, b);
        assert_eq!(truncate(u64::MAX, 3), 7);
        assert_eq!(truncate(1, 0), 0);
        assert_eq!(truncate(5, 64), 5);
    }
}
