//! memcached's protocol from the client's side: request encoding (meta commands, or the text
//! commands for servers without them) and a strict, incremental reply parser that borrows
//! from the receive buffer.
//!
//! Requests: `mg <key> v`, `ms <key> <len>` + data, `md <key>`, `mn`, and the existence probe
//! `mg <key>` (no flags: `HD` or `EN`, no value sent); keys that memcached's text protocol
//! cannot carry go base64 with the `b` flag. Text: `get`, `set <key> 0 0 <len>`, `delete`, and
//! `version` as the ordering barrier; a text-only server has no existence probe, so there the
//! probe is a `get` whose value is dropped. kura's durability barrier: `sync` (answered
//! `OK` once every write the server acknowledged before it is durable; memcached answers
//! `ERROR`). At connect, `stats` tells which process start of the server answers (see
//! [`crate::instance`]).

use crate::key;

/// Which commands a memcached-protocol node understands (found at connect: `mn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Meta,
    Text,
}

/// Longest reply line accepted (a `VALUE` line with a 250-byte key is under 300 bytes; a
/// `SERVER_ERROR` message may be longer).
pub const LINE_LENGTH_MAX: usize = 2048;

/// Appends `key`, base64 with a trailing ` b` flag marker returned as `true` when needed.
fn push_key(out: &mut Vec<u8>, k: &[u8]) -> bool {
    if kura_proto::is_text_key(k) {
        out.extend_from_slice(k);
        false
    } else {
        kura_proto::encode_base64(k, out);
        true
    }
}

fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Why a key cannot go to a node with this dialect, if it cannot.
pub fn key_problem(dialect: Dialect, k: &[u8]) -> Option<&'static str> {
    match dialect {
        _ if kura_proto::is_text_key(k) => None,
        Dialect::Text => Some("memcached's text protocol cannot carry spaces or control bytes in keys (the server lacks meta commands)"),
        Dialect::Meta if k.len() > key::BINARY_KEY_SIZE_BYTES_MAX => Some("keys with spaces or control bytes go base64, which allows at most 186 bytes"),
        Dialect::Meta => None,
    }
}

pub fn encode_get(out: &mut Vec<u8>, dialect: Dialect, k: &[u8]) {
    match dialect {
        Dialect::Meta => {
            out.extend_from_slice(b"mg ");
            let b = push_key(out, k);
            out.extend_from_slice(if b { b" b v\r\n" } else { b" v\r\n" });
        }
        Dialect::Text => {
            out.extend_from_slice(b"get ");
            out.extend_from_slice(k);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// Asks whether `k` exists without its value: `mg <key>` with no flags is answered `HD`
/// (hit) or `EN` (miss) by memcached 1.6 and kura. The text protocol has no such command
/// (`touch` would change the expiry), so a text-only server gets a `get` (value dropped).
pub fn encode_exists(out: &mut Vec<u8>, dialect: Dialect, k: &[u8]) {
    match dialect {
        Dialect::Meta => {
            out.extend_from_slice(b"mg ");
            let b = push_key(out, k);
            out.extend_from_slice(if b { b" b\r\n" } else { b"\r\n" });
        }
        Dialect::Text => encode_get(out, dialect, k),
    }
}

pub fn encode_set(out: &mut Vec<u8>, dialect: Dialect, k: &[u8], value: &[u8]) {
    match dialect {
        Dialect::Meta => {
            out.extend_from_slice(b"ms ");
            let b = push_key(out, k);
            out.push(b' ');
            push_decimal(out, value.len());
            out.extend_from_slice(if b { b" b\r\n" } else { b"\r\n" });
        }
        Dialect::Text => {
            out.extend_from_slice(b"set ");
            out.extend_from_slice(k);
            out.extend_from_slice(b" 0 0 ");
            push_decimal(out, value.len());
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

pub fn encode_delete(out: &mut Vec<u8>, dialect: Dialect, k: &[u8]) {
    match dialect {
        Dialect::Meta => {
            out.extend_from_slice(b"md ");
            let b = push_key(out, k);
            out.extend_from_slice(if b { b" b\r\n" } else { b"\r\n" });
        }
        Dialect::Text => {
            out.extend_from_slice(b"delete ");
            out.extend_from_slice(k);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// A request answered only after every earlier request on the connection.
pub fn encode_noop(out: &mut Vec<u8>, dialect: Dialect) {
    out.extend_from_slice(match dialect {
        Dialect::Meta => b"mn\r\n",
        Dialect::Text => b"version\r\n",
    });
}

/// kura's durability barrier: answered `OK` once every write the server acknowledged before
/// it is durable.
pub fn encode_sync(out: &mut Vec<u8>) {
    out.extend_from_slice(b"sync\r\n");
}

/// Asks for the general statistics (memcached's and kura's hold `pid`, `time`, `uptime`;
/// kura's also `kura_instance_id`).
pub fn encode_stats(out: &mut Vec<u8>) {
    out.extend_from_slice(b"stats\r\n");
}

/// Longest `stats` reply accepted (memcached's and kura's are about 3 KiB).
pub const STATS_REPLY_BYTES_MAX: usize = 64 << 10;

/// A reply to `stats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatsReply<'a> {
    /// The `STAT <name> <value>` lines up to `END`, as (name, value).
    Stats(Vec<(&'a [u8], &'a [u8])>),
    /// `ERROR`, `CLIENT_ERROR …` or `SERVER_ERROR …`: the server tells nothing.
    Refused,
}

/// Parses the `stats` reply at the start of `buf`: `Ok(None)` when it is not complete yet,
/// else the reply and the bytes it used. Longer than [`STATS_REPLY_BYTES_MAX`] or not the
/// protocol: `Err`.
pub fn parse_stats(buf: &[u8]) -> Result<Option<(StatsReply<'_>, usize)>, String> {
    let too_long = || format!("a stats reply longer than {STATS_REPLY_BYTES_MAX} bytes");
    let mut stats = Vec::new();
    let mut at = 0;
    loop {
        let Some((text, used)) = line(&buf[at..])? else {
            return if buf.len() > STATS_REPLY_BYTES_MAX { Err(too_long()) } else { Ok(None) };
        };
        at += used;
        if at > STATS_REPLY_BYTES_MAX {
            return Err(too_long());
        }
        if text == b"END" {
            return Ok(Some((StatsReply::Stats(stats), at)));
        }
        if let Some(stat) = text.strip_prefix(b"STAT ") {
            let space = stat.iter().position(|&b| b == b' ').ok_or("a STAT line without a value")?;
            stats.push((&stat[..space], &stat[space + 1..]));
            continue;
        }
        let refusal = text == b"ERROR" || text.starts_with(b"CLIENT_ERROR") || text.starts_with(b"SERVER_ERROR");
        if refusal && stats.is_empty() {
            return Ok(Some((StatsReply::Refused, at)));
        }
        return Err(format!("unexpected line in a stats reply: {:?}", String::from_utf8_lossy(&text[..text.len().min(64)])));
    }
}

/// One reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply<'a> {
    /// `VA <len> …` + data (meta hit).
    Value(&'a [u8]),
    /// `VALUE <key> <flags> <len> [<cas>]` + data + `END` (text hit of a one-key get).
    TextValue { key: &'a [u8], data: &'a [u8] },
    /// `EN` (meta miss) or `END` (text miss).
    Miss,
    /// `HD`: a meta command succeeded.
    Hd,
    /// `NS`, `EX`, `NF`: a meta write not stored, exists, not found.
    NotStored,
    Exists,
    NotFound,
    /// `MN`.
    Noop,
    Stored,
    Deleted,
    Ok,
    Version(&'a [u8]),
    /// `ERROR`: the command is unknown to the server.
    Error,
    ClientError(&'a [u8]),
    ServerError(&'a [u8]),
}

/// The line at the start of `buf` (without `\r\n`) and the bytes it spans, if complete.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, String> {
    let window = &buf[..buf.len().min(LINE_LENGTH_MAX)];
    match window.iter().position(|&b| b == b'\n') {
        Some(0) => Err("empty line (a bare \\n)".into()),
        Some(i) if buf[i - 1] != b'\r' => Err("line ends in \\n without \\r".into()),
        Some(i) => Ok(Some((&buf[..i - 1], i + 1))),
        None if buf.len() >= LINE_LENGTH_MAX => Err(format!("no line end within {LINE_LENGTH_MAX} bytes")),
        None => Ok(None),
    }
}

fn number(token: Option<&[u8]>, max: usize) -> Result<usize, String> {
    let token = token.ok_or("a length is missing")?;
    if token.is_empty() || token.len() > 19 || !token.iter().all(u8::is_ascii_digit) {
        return Err(format!("{:?} is not a length", String::from_utf8_lossy(token)));
    }
    let n = token.iter().fold(0usize, |n, d| n * 10 + usize::from(d - b'0'));
    if n > max {
        return Err(format!("value of {n} bytes exceeds the limit of {max}"));
    }
    Ok(n)
}

/// `len` bytes of data after `start`, followed by `\r\n`: their end, if all there.
fn data_block(buf: &[u8], start: usize, len: usize) -> Result<Option<usize>, String> {
    let end = start + len;
    if buf.len() < end + 2 {
        return Ok(None);
    }
    if &buf[end..end + 2] != b"\r\n" {
        return Err("value data not followed by \\r\\n".into());
    }
    Ok(Some(end + 2))
}

/// Parses the reply at the start of `buf`: `Ok(None)` when it is not complete yet, else the
/// reply and the bytes it used. Anything that is not memcached's protocol is an `Err` (the
/// connection cannot be trusted after it).
pub fn parse_reply(buf: &[u8], value_size_max: usize) -> Result<Option<(Reply<'_>, usize)>, String> {
    let Some((text, used)) = line(buf)? else { return Ok(None) };
    let mut tokens = text.split(|&b| b == b' ');
    let word = tokens.next().unwrap_or_default();
    let message = || text.get(word.len() + 1..).unwrap_or_default();
    let simple = match word {
        b"EN" => Reply::Miss,
        b"END" => Reply::Miss,
        b"HD" => Reply::Hd,
        b"NS" => Reply::NotStored,
        b"EX" => Reply::Exists,
        b"NF" => Reply::NotFound,
        b"MN" => Reply::Noop,
        b"STORED" => Reply::Stored,
        b"NOT_STORED" => Reply::NotStored,
        b"EXISTS" => Reply::Exists,
        b"NOT_FOUND" => Reply::NotFound,
        b"DELETED" => Reply::Deleted,
        b"OK" => Reply::Ok,
        b"ERROR" => Reply::Error,
        b"VERSION" => Reply::Version(message()),
        b"CLIENT_ERROR" => Reply::ClientError(message()),
        b"SERVER_ERROR" => Reply::ServerError(message()),
        b"VA" => {
            let len = number(tokens.next(), value_size_max)?;
            return Ok(data_block(buf, used, len)?.map(|end| (Reply::Value(&buf[used..used + len]), end)));
        }
        b"VALUE" => return parse_text_value(buf, text, used, value_size_max),
        _ => return Err(format!("unexpected reply line {:?}", String::from_utf8_lossy(&text[..text.len().min(64)]))),
    };
    let bare = matches!(simple, Reply::Miss | Reply::Noop | Reply::Stored | Reply::NotStored | Reply::Exists | Reply::NotFound | Reply::Deleted | Reply::Ok | Reply::Error);
    if bare && word.len() != text.len() && !word.starts_with(b"N") && word != b"EN" {
        return Err(format!("unexpected text after {}", String::from_utf8_lossy(word)));
    }
    Ok(Some((simple, used)))
}

fn parse_text_value<'a>(buf: &'a [u8], text: &'a [u8], used: usize, value_size_max: usize) -> Result<Option<(Reply<'a>, usize)>, String> {
    let mut tokens = text.split(|&b| b == b' ').skip(1);
    let key = tokens.next().filter(|k| !k.is_empty()).ok_or("VALUE without a key")?;
    let _flags = number(tokens.next(), usize::MAX)?;
    let len = number(tokens.next(), value_size_max)?;
    let Some(end) = data_block(buf, used, len)? else { return Ok(None) };
    let Some((after, more)) = line(&buf[end..])? else { return Ok(None) };
    if after != b"END" {
        return Err("a one-key get's VALUE not followed by END".into());
    }
    Ok(Some((Reply::TextValue { key, data: &buf[used..used + len] }, end + more)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kura_proto::{Parsed, ParserLimits, Request, parse};

    fn one(buf: &[u8]) -> (Reply<'_>, usize) {
        parse_reply(buf, 1 << 20).unwrap().unwrap()
    }

    #[test]
    fn replies() {
        assert_eq!(one(b"VA 2\r\nhi\r\n"), (Reply::Value(b"hi"), 10));
        assert_eq!(one(b"VA 0 t5\r\n\r\n"), (Reply::Value(b""), 11));
        assert_eq!(one(b"EN\r\nrest"), (Reply::Miss, 4));
        assert_eq!(one(b"HD\r\n"), (Reply::Hd, 4));
        assert_eq!(one(b"NF\r\n"), (Reply::NotFound, 4));
        assert_eq!(one(b"MN\r\n"), (Reply::Noop, 4));
        assert_eq!(one(b"VERSION 1.6.18\r\n"), (Reply::Version(b"1.6.18"), 16));
        assert_eq!(one(b"SERVER_ERROR object too large for cache\r\n").0, Reply::ServerError(b"object too large for cache"));
        assert_eq!(one(b"VALUE k 0 3\r\nabc\r\nEND\r\n"), (Reply::TextValue { key: b"k", data: b"abc" }, 23));
        assert_eq!(one(b"VALUE k 5 3 99\r\nabc\r\nEND\r\n").0, Reply::TextValue { key: b"k", data: b"abc" });
        assert_eq!(one(b"END\r\n"), (Reply::Miss, 5));
        assert_eq!(one(b"STORED\r\n").0, Reply::Stored);
        assert_eq!(one(b"ERROR\r\n").0, Reply::Error);
    }

    #[test]
    fn incomplete_replies_wait_for_more() {
        for whole in [&b"VA 5\r\nhello\r\n"[..], b"VALUE k 0 1\r\nx\r\nEND\r\n", b"HD\r\n"] {
            for cut in 0..whole.len() {
                assert_eq!(parse_reply(&whole[..cut], 100), Ok(None), "{:?}", String::from_utf8_lossy(&whole[..cut]));
            }
            assert!(parse_reply(whole, 100).unwrap().is_some());
        }
    }

    #[test]
    fn garbage_is_an_error() {
        for bad in [
            &b"HELLO\r\n"[..],
            b"\n",
            b"HD\n",
            b"VA x\r\n",
            b"VA -1\r\n",
            b"VA 99999999999999999999\r\n",
            b"VA 2\r\nhiXX",
            b"VALUE k 0 1\r\nx\r\nVALUE k\r\n",
            b"VALUE k 0 1\r\nx\r\nEND\rX\r\n",
            b"STORED extra\r\n",
            b"\x00\x01\x02\r\n",
        ] {
            assert!(parse_reply(bad, 100).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(parse_reply(&[b'a'; LINE_LENGTH_MAX], 100).is_err());
        assert!(parse_reply(b"VA 101\r\n", 100).unwrap_err().contains("limit"));
    }

    #[test]
    fn never_panics_on_random_bytes() {
        use proptest::prelude::*;
        proptest!(|(bytes in proptest::collection::vec(any::<u8>(), 0..300))| {
            let _ = parse_reply(&bytes, 64);
        });
        proptest!(|(len in 0usize..70, tail in proptest::collection::vec(any::<u8>(), 0..80))| {
            let mut b = format!("VA {len}\r\n").into_bytes();
            b.extend_from_slice(&tail);
            let _ = parse_reply(&b, 64);
        });
    }

    /// Our requests, read back by kura's own server-side parser.
    #[test]
    fn requests_parse_as_memcached_requests() {
        let limits = ParserLimits::default();
        let mut out = Vec::new();
        encode_get(&mut out, Dialect::Meta, b"v0001.0002");
        encode_set(&mut out, Dialect::Meta, b"k", b"hello");
        encode_delete(&mut out, Dialect::Meta, b"k");
        encode_get(&mut out, Dialect::Meta, b"with space\x00");
        encode_set(&mut out, Dialect::Meta, b"with space\x00", b"");
        encode_noop(&mut out, Dialect::Meta);
        encode_get(&mut out, Dialect::Text, b"k");
        encode_set(&mut out, Dialect::Text, b"k", b"a\r\nb");
        encode_delete(&mut out, Dialect::Text, b"k");
        encode_exists(&mut out, Dialect::Meta, b"v0001.0002");
        encode_exists(&mut out, Dialect::Meta, b"with space\x00");
        encode_exists(&mut out, Dialect::Text, b"k");
        let mut seen = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let Ok(Parsed::Complete { request, consumed_bytes }) = parse(&out[at..], &limits) else { panic!("unparsable at {at}") };
            seen.push(format!("{request:?}"));
            match (seen.len(), &request) {
                (1, Request::MetaGet(m)) => assert_eq!(m.key, b"v0001.0002"),
                (2, Request::MetaSet(s)) => assert_eq!((s.key, s.data), (&b"k"[..], &b"hello"[..])),
                (3, Request::MetaDelete(_)) => {}
                (4, Request::MetaGet(m)) => {
                    let mut buf = [0u8; kura_proto::KEY_LENGTH_MAX];
                    assert_eq!(kura_proto::meta_key(m.key, m.flags.base64_key(), &mut buf).unwrap(), b"with space\x00");
                }
                (5, Request::MetaSet(_)) => {}
                (6, Request::MetaNoop) => {}
                (7, Request::Retrieval(_)) => {}
                (8, Request::Storage(s)) => assert_eq!(s.data, b"a\r\nb"),
                (9, Request::Delete { .. }) => {}
                // The existence probe: a meta get that asks for no value (nor anything else).
                (10, Request::MetaGet(m)) => assert!(m.key == b"v0001.0002" && !m.flags.return_value() && !m.flags.base64_key()),
                (11, Request::MetaGet(m)) => {
                    let mut buf = [0u8; kura_proto::KEY_LENGTH_MAX];
                    assert!(!m.flags.return_value());
                    assert_eq!(kura_proto::meta_key(m.key, m.flags.base64_key(), &mut buf).unwrap(), b"with space\x00");
                }
                (12, Request::Retrieval(_)) => {}
                (n, other) => panic!("request {n}: {other:?}"),
            }
            at += consumed_bytes;
        }
        assert_eq!(seen.len(), 12);
    }

    #[test]
    fn stats_replies() {
        let whole = b"STAT pid 7\r\nSTAT version 1.6.18\r\nSTAT libevent 2.1 stable\r\nEND\r\nMN\r\n";
        let (reply, used) = parse_stats(whole).unwrap().unwrap();
        assert_eq!(used, whole.len() - 4);
        assert_eq!(reply, StatsReply::Stats(vec![(&b"pid"[..], &b"7"[..]), (b"version", b"1.6.18"), (b"libevent", b"2.1 stable")]));
        for cut in 0..used {
            assert_eq!(parse_stats(&whole[..cut]), Ok(None));
        }
        assert_eq!(parse_stats(b"END\r\n").unwrap().unwrap().0, StatsReply::Stats(Vec::new()));
        for refusal in [&b"ERROR\r\n"[..], b"SERVER_ERROR out of memory\r\n", b"CLIENT_ERROR no\r\n"] {
            assert_eq!(parse_stats(refusal).unwrap().unwrap(), (StatsReply::Refused, refusal.len()));
        }
    }

    #[test]
    fn hostile_stats_replies_are_errors() {
        for bad in [&b"STAT pid\r\nEND\r\n"[..], b"STAT a 1\r\nERROR\r\n", b"VALUE k 0 1\r\n", b"STAT a 1\n"] {
            assert!(parse_stats(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // Endless STAT lines stop at the limit, complete or not.
        let endless = b"STAT name value\r\n".repeat(STATS_REPLY_BYTES_MAX / 17 + 1);
        assert!(parse_stats(&endless).unwrap_err().contains("longer"));
        let mut long = endless.clone();
        long.extend_from_slice(b"END\r\n");
        assert!(parse_stats(&long).unwrap_err().contains("longer"));
        use proptest::prelude::*;
        proptest!(|(bytes in proptest::collection::vec(any::<u8>(), 0..300))| {
            let _ = parse_stats(&bytes);
        });
    }

    #[test]
    fn key_problems() {
        assert_eq!(key_problem(Dialect::Text, b"ok"), None);
        assert!(key_problem(Dialect::Text, b"a b").is_some());
        assert_eq!(key_problem(Dialect::Meta, b"a b"), None);
        assert!(key_problem(Dialect::Meta, &[0u8; 187]).is_some());
        assert_eq!(key_problem(Dialect::Meta, &[0u8; 186]), None);
    }
}
