//! Keys: limits, and the canonical key of a 4 KiB block of a volume; and the one kind of value
//! the layers above store as absent (zeros).

use crate::error::{Error, Result};

/// Longest key the pool accepts on any backend (memcached's and the engine's limit).
pub const KEY_SIZE_BYTES_MAX: usize = 250;
/// Longest key that a meta-protocol node can take when it has to be sent base64 (memcached
/// limits the encoded key to 250 bytes).
pub const BINARY_KEY_SIZE_BYTES_MAX: usize = KEY_SIZE_BYTES_MAX / 4 * 3;
/// Bytes of a [`block_key`].
pub const BLOCK_KEY_BYTES: usize = 1 + 16 + 1 + 16;

/// The key of the 4 KiB block `lba` of volume `volume`: `v<16 hex>.<16 hex>`, fixed width so
/// that it is text-safe on every backend (memcached's text protocol included) and costs no
/// base64 on meta nodes.
pub fn block_key(volume: u64, lba: u64) -> [u8; BLOCK_KEY_BYTES] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut key = [0u8; BLOCK_KEY_BYTES];
    key[0] = b'v';
    key[17] = b'.';
    for i in 0..16 {
        key[1 + i] = HEX[((volume >> (60 - 4 * i)) & 0xf) as usize];
        key[18 + i] = HEX[((lba >> (60 - 4 * i)) & 0xf) as usize];
    }
    key
}

/// Whether `value` is all zero bytes (compared eight at a time). The block volumes and the file
/// system read a missing block or chunk as zeros, so they delete one written with zeros
/// instead of storing it.
pub fn is_zeros(value: &[u8]) -> bool {
    let (words, rest) = value.split_at(value.len() / 8 * 8);
    words.chunks_exact(8).all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0) && rest.iter().all(|&b| b == 0)
}

/// Checks the limits every backend shares.
pub fn check(key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(Error::KeyEmpty);
    }
    if key.len() > KEY_SIZE_BYTES_MAX {
        return Err(Error::KeyTooLong { len: key.len(), max: KEY_SIZE_BYTES_MAX });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_keys_are_fixed_width_text_and_distinct() {
        let k = block_key(1, 0x1234);
        assert_eq!(&k, b"v0000000000000001.0000000000001234");
        assert!(kura_proto::is_text_key(&k));
        assert_ne!(block_key(1, 2), block_key(2, 1));
        assert_eq!(&block_key(u64::MAX, u64::MAX)[..], b"vffffffffffffffff.ffffffffffffffff");
    }

    #[test]
    fn zeros_are_told_apart_at_every_length_and_offset() {
        for len in [0, 1, 7, 8, 9, 4095, 4096] {
            assert!(is_zeros(&vec![0u8; len]));
            for at in [0, len / 2, len.saturating_sub(1)].into_iter().filter(|&at| at < len) {
                let mut v = vec![0u8; len];
                v[at] = 1;
                assert!(!is_zeros(&v), "a one at {at} of {len}");
            }
        }
    }

    #[test]
    fn limits() {
        assert!(matches!(check(b""), Err(Error::KeyEmpty)));
        assert!(check(&[b'a'; 250]).is_ok());
        assert!(matches!(check(&[b'a'; 251]), Err(Error::KeyTooLong { len: 251, max: 250 })));
        assert!(!kura_proto::is_text_key(b"a b"));
        assert!(!kura_proto::is_text_key(b"a\r\n"));
        assert!(!kura_proto::is_text_key(b"\x7f"));
        assert!(kura_proto::is_text_key("é".as_bytes()));
        // 186 bytes encode to 248 base64 characters, 187 to 252.
        assert_eq!(BINARY_KEY_SIZE_BYTES_MAX, 186);
    }
}
