//! The item record: what the server stores as an engine value, in one place.
//!
//! A record is the paper's *ready response*: after a small fixed prefix comes
//! the exact bytes a `get` hit sends, so a hit from flash is one read and one
//! send straight from the read buffer.
//!
//! ```text
//! [ prefix, PREFIX_BYTES ][ VALUE <key> <flags> <bytes>\r\n ][ <data> ][ \r\n ]
//!                         ^ get_response() ................................^
//!                                                             ^ data_with_crlf() ^
//! ```
//!
//! Prefix fields (little-endian):
//!
//! | offset | type | field |
//! |---|---|---|
//! | 0 | u8 | magic [`RECORD_MAGIC`] |
//! | 1 | u8 | bits: [`BIT_STALE`], [`BIT_TOKEN_SENT`] |
//! | 2 | u16 | length of the `VALUE` line, `\r\n` included |
//! | 4 | u32 | client flags |
//! | 8 | u32 | data length |
//! | 12 | u32 | reserved, zero |
//! | 16 | i64 | expiry, Unix seconds; 0 never |
//! | 24 | u64 | set time, the server clock's µs stamp (flush_all compares it) |
//! | 32 | u64 | CAS override; 0: the engine's record version is the CAS value |
//!
//! The CAS override exists because memcached keeps an item's CAS value across
//! `touch` and `gat`, while every engine write gets a new version; `ms E`
//! sets it explicitly. Overrides are always versions the key had before, or
//! values the client chose, so they never collide with a newer write's version.

use std::fmt;

use kura_proto::encode::value_header_len;

pub const RECORD_MAGIC: u8 = 0xC7;
pub const BIT_STALE: u8 = 1;
pub const BIT_TOKEN_SENT: u8 = 2;
const BITS_KNOWN: u8 = BIT_STALE | BIT_TOKEN_SENT;

const OFFSET_MAGIC: usize = 0;
const OFFSET_BITS: usize = OFFSET_MAGIC + 1;
const OFFSET_HEADER_LEN: usize = OFFSET_BITS + 1;
const OFFSET_CLIENT_FLAGS: usize = OFFSET_HEADER_LEN + 2;
const OFFSET_DATA_LEN: usize = OFFSET_CLIENT_FLAGS + 4;
const OFFSET_RESERVED: usize = OFFSET_DATA_LEN + 4;
const OFFSET_EXPIRE_AT: usize = OFFSET_RESERVED + 4;
const OFFSET_SET_TIME: usize = OFFSET_EXPIRE_AT + 8;
const OFFSET_CAS: usize = OFFSET_SET_TIME + 8;
/// Bytes before the `VALUE` line.
pub const PREFIX_BYTES: usize = OFFSET_CAS + 8;

const _: () = assert!(PREFIX_BYTES == 40);
const _: () = assert!(
    OFFSET_EXPIRE_AT.is_multiple_of(8)
        && OFFSET_SET_TIME.is_multiple_of(8)
        && OFFSET_CAS.is_multiple_of(8)
);

/// Longest `VALUE` line: `VALUE ` + a 250-byte key + ` ` + u32 + ` ` + u32 + `\r\n`.
pub const VALUE_LINE_BYTES_MAX: usize = 6 + kura_proto::KEY_LENGTH_MAX + 1 + 10 + 1 + 10 + 2;
/// What a record adds to its data, at most.
pub const RECORD_OVERHEAD_BYTES_MAX: usize = PREFIX_BYTES + VALUE_LINE_BYTES_MAX + 2;
/// What a record adds to its data, at least (a one-byte key, flags 0, a one-digit length).
pub const RECORD_OVERHEAD_BYTES_MIN: usize = PREFIX_BYTES + b"VALUE k 0 0\r\n".len() + 2;

/// An item's metadata, as stored in the prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ItemMeta {
    pub client_flags: u32,
    /// Unix seconds at which the item expires; 0: never.
    pub expire_at_s: i64,
    /// The server clock's stamp when the item was stored.
    pub set_time_us: u64,
    /// The CAS value clients see, when it is not the engine version.
    pub cas_override: u64,
    /// `md I` / `ms I`: the item is stale (meta protocol).
    pub stale: bool,
    /// A client was handed the right to recache it (meta `W`).
    pub token_sent: bool,
}

impl ItemMeta {
    /// The CAS value of a record stored with engine `version`.
    pub fn cas(&self, version: u64) -> u64 {
        if self.cas_override != 0 {
            self.cas_override
        } else {
            version
        }
    }

    fn bits(&self) -> u8 {
        (if self.stale { BIT_STALE } else { 0 })
            | (if self.token_sent { BIT_TOKEN_SENT } else { 0 })
    }
}

/// Why stored bytes are not a record (another writer, or corruption the
/// engine's checksums did not catch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordError {
    Truncated,
    BadMagic(u8),
    BadBits(u8),
    BadValueLine,
    LengthMismatch { expected: usize, found: usize },
    BadTerminator,
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => write!(f, "record shorter than its prefix"),
            Self::BadMagic(m) => write!(f, "bad record magic {m:#x}"),
            Self::BadBits(b) => write!(f, "unknown record bits {b:#x}"),
            Self::BadValueLine => write!(f, "record's VALUE line is malformed"),
            Self::LengthMismatch { expected, found } => {
                write!(f, "record is {found} bytes, its prefix says {expected}")
            }
            Self::BadTerminator => write!(f, "record data does not end with \\r\\n"),
        }
    }
}

impl std::error::Error for RecordError {}

/// Length of the record for `key` with `data_len` bytes of data.
pub fn record_len(key_len: usize, client_flags: u32, data_len: usize) -> usize {
    PREFIX_BYTES + value_header_len(key_len, client_flags, data_len, None) + data_len + 2
}

/// Builds the record for `key` whose data is the concatenation of `parts`
/// (append and prepend pass the old and new data without joining them first).
pub fn encode(key: &[u8], meta: &ItemMeta, parts: &[&[u8]]) -> Vec<u8> {
    let data_len: usize = parts.iter().map(|p| p.len()).sum();
    let total = record_len(key.len(), meta.client_flags, data_len);
    let mut out = Vec::with_capacity(total);
    out.resize(PREFIX_BYTES, 0);
    kura_proto::encode::value_header(&mut out, key, meta.client_flags, data_len, None);
    let header_len = out.len() - PREFIX_BYTES;
    for part in parts {
        out.extend_from_slice(part);
    }
    out.extend_from_slice(b"\r\n");
    debug_assert_eq!(out.len(), total);
    write_prefix(&mut out, meta, header_len, data_len);
    debug_assert!(
        RecordView::parse(&out).is_ok(),
        "an encoded record must parse"
    );
    out
}

fn write_prefix(out: &mut [u8], meta: &ItemMeta, header_len: usize, data_len: usize) {
    let header_len = u16::try_from(header_len).expect("VALUE line fits u16 (key ≤ 250 bytes)");
    let data_len = u32::try_from(data_len).expect("data length fits u32 (item size limit)");
    out[OFFSET_MAGIC] = RECORD_MAGIC;
    out[OFFSET_BITS] = meta.bits();
    out[OFFSET_HEADER_LEN..OFFSET_HEADER_LEN + 2].copy_from_slice(&header_len.to_le_bytes());
    out[OFFSET_CLIENT_FLAGS..OFFSET_CLIENT_FLAGS + 4]
        .copy_from_slice(&meta.client_flags.to_le_bytes());
    out[OFFSET_DATA_LEN..OFFSET_DATA_LEN + 4].copy_from_slice(&data_len.to_le_bytes());
    out[OFFSET_RESERVED..OFFSET_RESERVED + 4].copy_from_slice(&0u32.to_le_bytes());
    out[OFFSET_EXPIRE_AT..OFFSET_EXPIRE_AT + 8].copy_from_slice(&meta.expire_at_s.to_le_bytes());
    out[OFFSET_SET_TIME..OFFSET_SET_TIME + 8].copy_from_slice(&meta.set_time_us.to_le_bytes());
    out[OFFSET_CAS..OFFSET_CAS + 8].copy_from_slice(&meta.cas_override.to_le_bytes());
}

/// A record's fields and the ranges of its parts, checked on the way in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordView {
    pub meta: ItemMeta,
    header_len: usize,
    data_len: usize,
}

impl RecordView {
    /// Parses and checks a record: prefix, `VALUE` line against the prefix,
    /// length, and the final `\r\n`.
    pub fn parse(bytes: &[u8]) -> Result<Self, RecordError> {
        let prefix = bytes.get(..PREFIX_BYTES).ok_or(RecordError::Truncated)?;
        if prefix[OFFSET_MAGIC] != RECORD_MAGIC {
            return Err(RecordError::BadMagic(prefix[OFFSET_MAGIC]));
        }
        let bits = prefix[OFFSET_BITS];
        if bits & !BITS_KNOWN != 0 {
            return Err(RecordError::BadBits(bits));
        }
        let u16_at = |o: usize| u16::from_le_bytes([prefix[o], prefix[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(prefix[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(prefix[o..o + 8].try_into().expect("8 bytes"));
        let header_len = usize::from(u16_at(OFFSET_HEADER_LEN));
        let data_len = u32_at(OFFSET_DATA_LEN) as usize;
        let meta = ItemMeta {
            client_flags: u32_at(OFFSET_CLIENT_FLAGS),
            expire_at_s: u64_at(OFFSET_EXPIRE_AT) as i64,
            set_time_us: u64_at(OFFSET_SET_TIME),
            cas_override: u64_at(OFFSET_CAS),
            stale: bits & BIT_STALE != 0,
            token_sent: bits & BIT_TOKEN_SENT != 0,
        };
        let expected = PREFIX_BYTES + header_len + data_len + 2;
        if bytes.len() != expected {
            return Err(RecordError::LengthMismatch {
                expected,
                found: bytes.len(),
            });
        }
        let line = &bytes[PREFIX_BYTES..PREFIX_BYTES + header_len];
        if !line.starts_with(b"VALUE ") || !line.ends_with(b"\r\n") {
            return Err(RecordError::BadValueLine);
        }
        if !bytes.ends_with(b"\r\n") {
            return Err(RecordError::BadTerminator);
        }
        let view = Self {
            meta,
            header_len,
            data_len,
        };
        let key_len = header_len
            .checked_sub(value_header_len(0, meta.client_flags, data_len, None))
            .ok_or(RecordError::BadValueLine)?;
        if value_header_len(key_len, meta.client_flags, data_len, None) != header_len {
            return Err(RecordError::BadValueLine);
        }
        Ok(view)
    }

    /// The key, as it appears in the `VALUE` line.
    pub fn key<'b>(&self, bytes: &'b [u8]) -> &'b [u8] {
        let key_len =
            self.header_len - value_header_len(0, self.meta.client_flags, self.data_len, None);
        &bytes[PREFIX_BYTES + 6..PREFIX_BYTES + 6 + key_len]
    }

    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// Offset of the ready `get` response (`VALUE` line, data, `\r\n`).
    pub fn response_start(&self) -> usize {
        PREFIX_BYTES
    }

    /// Offset of the data.
    pub fn data_start(&self) -> usize {
        PREFIX_BYTES + self.header_len
    }

    /// Offset just past the record.
    pub fn end(&self) -> usize {
        PREFIX_BYTES + self.header_len + self.data_len + 2
    }

    /// The data, without its `\r\n`.
    pub fn data<'b>(&self, bytes: &'b [u8]) -> &'b [u8] {
        &bytes[self.data_start()..self.data_start() + self.data_len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ItemMeta {
        ItemMeta {
            client_flags: 42,
            expire_at_s: 1_900_000_000,
            set_time_us: 77,
            cas_override: 0,
            stale: false,
            token_sent: true,
        }
    }

    #[test]
    fn round_trip_and_ready_response() {
        let rec = encode(b"key", &meta(), &[b"hel", b"lo"]);
        assert_eq!(rec.len(), record_len(3, 42, 5));
        let view = RecordView::parse(&rec).unwrap();
        assert_eq!(view.meta, meta());
        assert_eq!(view.key(&rec), b"key");
        assert_eq!(view.data(&rec), b"hello");
        assert_eq!(
            &rec[view.response_start()..view.end()],
            b"VALUE key 42 5\r\nhello\r\n"
        );
        assert_eq!(&rec[view.data_start()..view.end()], b"hello\r\n");
    }

    #[test]
    fn empty_and_binary_data() {
        let rec = encode(b"k", &ItemMeta::default(), &[]);
        let view = RecordView::parse(&rec).unwrap();
        assert_eq!(view.data(&rec), b"");
        assert_eq!(&rec[view.response_start()..], b"VALUE k 0 0\r\n\r\n");
        let data: Vec<u8> = (0..=255).collect();
        let rec = encode(
            b"bin",
            &ItemMeta {
                client_flags: u32::MAX,
                ..meta()
            },
            &[&data],
        );
        let view = RecordView::parse(&rec).unwrap();
        assert_eq!(view.data(&rec), &data[..]);
        assert_eq!(view.meta.client_flags, u32::MAX);
    }

    #[test]
    fn cas_override() {
        let m = ItemMeta {
            cas_override: 9,
            ..meta()
        };
        assert_eq!(m.cas(100), 9);
        assert_eq!(meta().cas(100), 100);
    }

    #[test]
    fn corrupt_records_are_refused() {
        let rec = encode(b"key", &meta(), &[b"hello"]);
        assert_eq!(RecordView::parse(&rec[..10]), Err(RecordError::Truncated));
        let mut bad = rec.clone();
        bad[0] = 0;
        assert_eq!(RecordView::parse(&bad), Err(RecordError::BadMagic(0)));
        let mut bad = rec.clone();
        bad[1] = 0x80;
        assert_eq!(RecordView::parse(&bad), Err(RecordError::BadBits(0x80)));
        assert!(matches!(
            RecordView::parse(&rec[..rec.len() - 1]),
            Err(RecordError::LengthMismatch { .. })
        ));
        let mut bad = rec.clone();
        let n = bad.len();
        bad[n - 1] = b'x';
        assert_eq!(RecordView::parse(&bad), Err(RecordError::BadTerminator));
        let mut bad = rec;
        bad[PREFIX_BYTES] = b'v';
        assert_eq!(RecordView::parse(&bad), Err(RecordError::BadValueLine));
    }

    #[test]
    fn overhead_bounds() {
        assert_eq!(record_len(1, 0, 0), RECORD_OVERHEAD_BYTES_MIN);
        assert!(record_len(1, 0, 5) >= RECORD_OVERHEAD_BYTES_MIN + 5);
    }

    #[test]
    fn overhead_bound_holds_for_the_longest_key() {
        let key = vec![b'k'; kura_proto::KEY_LENGTH_MAX];
        let rec = encode(
            &key,
            &ItemMeta {
                client_flags: u32::MAX,
                ..meta()
            },
            &[&vec![0u8; 1_000_000]],
        );
        assert!(rec.len() - 1_000_000 <= RECORD_OVERHEAD_BYTES_MAX);
    }
}
