//! Base64 (RFC 4648, standard alphabet, padded) for meta `b` keys.
//!
//! memcached's decoder stops at the first padding (`bTE=junk` decodes);
//! this one refuses anything after padding. Like memcached, it ignores
//! non-zero bits left over in the last sextet (`bR==` decodes to `m`), and
//! [`encode_base64`] renders the canonical form.

use crate::limits::KEY_LENGTH_MAX;

/// Why a base64 key did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Base64Error {
    /// Length is zero or not a multiple of four.
    #[error("base64 key length is not a positive multiple of four")]
    Length,
    /// A byte outside the alphabet, or misplaced padding.
    #[error("base64 key holds an invalid byte")]
    Byte,
    /// The decoded key exceeds [`KEY_LENGTH_MAX`].
    #[error("decoded key is longer than {KEY_LENGTH_MAX} bytes")]
    TooLong,
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const PAD: u8 = b'=';

/// Decodes the base64 key `encoded` into `out`, returning the decoded bytes.
pub fn decode_base64_key<'b>(
    encoded: &[u8],
    out: &'b mut [u8; KEY_LENGTH_MAX],
) -> Result<&'b [u8], Base64Error> {
    if encoded.is_empty() || !encoded.len().is_multiple_of(4) {
        return Err(Base64Error::Length);
    }
    let mut written = 0;
    let quads = encoded.len() / 4;
    for (index, quad) in encoded.chunks_exact(4).enumerate() {
        let (bytes, count) = decode_quad(quad, index + 1 == quads)?;
        let dest = out
            .get_mut(written..written + count)
            .ok_or(Base64Error::TooLong)?;
        dest.copy_from_slice(bytes.get(..count).unwrap_or_default());
        written += count;
    }
    Ok(out.get(..written).unwrap_or_default())
}

/// Decodes one group of four; padding is allowed only in the last group.
fn decode_quad(quad: &[u8], last: bool) -> Result<([u8; 3], usize), Base64Error> {
    let &[a, b, c, d] = quad else {
        return Err(Base64Error::Length);
    };
    let count = match (c == PAD, d == PAD) {
        (false, false) => 3,
        (false, true) if last => 2,
        (true, true) if last => 1,
        _ => return Err(Base64Error::Byte),
    };
    let value = |byte: u8, padded: bool| if padded { Ok(0) } else { sextet(byte) };
    let word = (value(a, false)? << 18)
        | (value(b, false)? << 12)
        | (value(c, count < 2)? << 6)
        | value(d, count < 3)?;
    let [_, x, y, z] = word.to_be_bytes();
    Ok(([x, y, z], count))
}

fn sextet(byte: u8) -> Result<u32, Base64Error> {
    let value = match byte {
        b'A'..=b'Z' => byte - b'A',
        b'a'..=b'z' => byte - b'a' + 26,
        b'0'..=b'9' => byte - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return Err(Base64Error::Byte),
    };
    Ok(u32::from(value))
}

/// Whether `encoded` is a base64 key that decodes within [`KEY_LENGTH_MAX`].
pub(crate) fn is_base64_key(encoded: &[u8]) -> bool {
    decode_base64_key(encoded, &mut [0; KEY_LENGTH_MAX]).is_ok()
}

/// Appends the padded base64 encoding of `data` to `out`.
pub fn encode_base64(data: &[u8], out: &mut Vec<u8>) {
    out.reserve(data.len().div_ceil(3) * 4);
    for group in data.chunks(3) {
        let [x, y, z] = [0, 1, 2].map(|i| group.get(i).copied().unwrap_or(0));
        let word = u32::from_be_bytes([0, x, y, z]);
        for (position, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            let symbol = if position <= group.len() {
                let index = usize::try_from((word >> shift) & 0x3f).unwrap_or(0);
                ALPHABET.get(index).copied().unwrap_or(PAD)
            } else {
                PAD
            };
            out.push(symbol);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(encoded: &[u8]) -> Result<Vec<u8>, Base64Error> {
        decode_base64_key(encoded, &mut [0; KEY_LENGTH_MAX]).map(<[u8]>::to_vec)
    }

    fn encode(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_base64(data, &mut out);
        out
    }

    #[test]
    fn rfc4648_vectors() {
        let vectors: [(&[u8], &[u8]); 6] = [
            (b"f", b"Zg=="),
            (b"fo", b"Zm8="),
            (b"foo", b"Zm9v"),
            (b"foob", b"Zm9vYg=="),
            (b"fooba", b"Zm9vYmE="),
            (b"foobar", b"Zm9vYmFy"),
        ];
        for (plain, encoded) in vectors {
            assert_eq!(encode(plain), encoded);
            assert_eq!(decode(encoded).unwrap(), plain);
        }
        assert_eq!(encode(b""), b"");
    }

    #[test]
    fn matches_memcached_on_its_edge_cases() {
        // Observed against memcached 1.6.18: bQ== and bR== both decode to "m".
        assert_eq!(decode(b"bQ==").unwrap(), b"m");
        assert_eq!(decode(b"bR==").unwrap(), b"m");
        assert_eq!(decode(b"+/+/").unwrap(), [0xfb, 0xff, 0xbf]);
        assert_eq!(decode(b"AAAA").unwrap(), [0, 0, 0]);
        for bad in [&b"bQ"[..], b"bQ=", b"b===", b"====", b"-_-_", b"bTE=x"] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn refuses_data_after_padding() {
        assert_eq!(decode(b"bTE=bTE="), Err(Base64Error::Byte));
        assert_eq!(decode(b"b=E="), Err(Base64Error::Byte));
    }

    #[test]
    fn longest_key_fits() {
        let key = [0xa5u8; KEY_LENGTH_MAX];
        let encoded = encode(&key);
        assert_eq!(decode(&encoded).unwrap(), key);
        let too_long = encode(&[0u8; KEY_LENGTH_MAX + 1]);
        assert_eq!(decode(&too_long), Err(Base64Error::TooLong));
    }
}
