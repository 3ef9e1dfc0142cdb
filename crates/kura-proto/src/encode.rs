//! Response encoders: each appends one memcached response to a `Vec<u8>`.
//!
//! Meta return flags follow memcached 1.6 (`proto_text.c`): each requested
//! flag is rendered in request order, as a space, the flag character and its
//! value; `O` echoes the opaque token and `k` the key (base64, followed by a
//! ` b` flag, when the request said `b`). Flags whose value the server does
//! not supply are left out, which is how memcached answers a miss: only `O`
//! and `k`. `mg` then appends `Z`, `X` and `W`, in that order.

use crate::base64::encode_base64;
use crate::error::ErrorKind;
use crate::meta::{MetaFlag, MetaFlags};

const CRLF: &[u8] = b"\r\n";

/// Fixed one-line replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reply {
    /// `STORED`.
    Stored,
    /// `NOT_STORED`.
    NotStored,
    /// `EXISTS`.
    Exists,
    /// `NOT_FOUND`.
    NotFound,
    /// `DELETED`.
    Deleted,
    /// `TOUCHED`.
    Touched,
    /// `OK`.
    Ok,
    /// `END`, closing a retrieval or `stats`.
    End,
    /// `ERROR`.
    Error,
    /// `RESET`, after `stats reset`.
    Reset,
    /// `MN`, the meta no-op.
    MetaNoop,
}

impl Reply {
    /// The reply line, `\r\n` included.
    pub fn as_bytes(self) -> &'static [u8] {
        match self {
            Self::Stored => b"STORED\r\n",
            Self::NotStored => b"NOT_STORED\r\n",
            Self::Exists => b"EXISTS\r\n",
            Self::NotFound => b"NOT_FOUND\r\n",
            Self::Deleted => b"DELETED\r\n",
            Self::Touched => b"TOUCHED\r\n",
            Self::Ok => b"OK\r\n",
            Self::End => b"END\r\n",
            Self::Error => b"ERROR\r\n",
            Self::Reset => b"RESET\r\n",
            Self::MetaNoop => b"MN\r\n",
        }
    }
}

/// Appends a fixed reply.
pub fn reply(out: &mut Vec<u8>, reply: Reply) {
    out.extend_from_slice(reply.as_bytes());
}

/// Appends the reply for a refused request.
pub fn error(out: &mut Vec<u8>, kind: ErrorKind) {
    out.extend_from_slice(kind.reply().as_bytes());
    out.extend_from_slice(CRLF);
}

/// Appends `CLIENT_ERROR <message>`; line breaks in `message` become spaces.
pub fn client_error(out: &mut Vec<u8>, message: &[u8]) {
    error_line(out, b"CLIENT_ERROR ", message);
}

/// Appends `SERVER_ERROR <message>`; line breaks in `message` become spaces.
pub fn server_error(out: &mut Vec<u8>, message: &[u8]) {
    error_line(out, b"SERVER_ERROR ", message);
}

fn error_line(out: &mut Vec<u8>, prefix: &[u8], message: &[u8]) {
    out.extend_from_slice(prefix);
    out.extend(
        message
            .iter()
            .map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    out.extend_from_slice(CRLF);
}

/// Appends one retrieval hit: `VALUE <key> <flags> <bytes> [<cas>]\r\n<data>\r\n`.
pub fn value(out: &mut Vec<u8>, key: &[u8], client_flags: u32, data: &[u8], cas: Option<u64>) {
    value_header(out, key, client_flags, data.len(), cas);
    out.extend_from_slice(data);
    out.extend_from_slice(CRLF);
}

/// Appends `VALUE <key> <flags> <bytes> [<cas>]\r\n`, the part of a `get` hit
/// before its data, which a server can store ready-made beside the value.
pub fn value_header(
    out: &mut Vec<u8>,
    key: &[u8],
    client_flags: u32,
    data_len_bytes: usize,
    cas: Option<u64>,
) {
    out.extend_from_slice(b"VALUE ");
    out.extend_from_slice(key);
    out.push(b' ');
    push_u64(out, u64::from(client_flags));
    out.push(b' ');
    push_u64(out, data_len_bytes as u64);
    if let Some(cas) = cas {
        out.push(b' ');
        push_u64(out, cas);
    }
    out.extend_from_slice(CRLF);
}

/// Length in bytes of what [`value_header`] appends.
pub fn value_header_len(
    key_len_bytes: usize,
    client_flags: u32,
    data_len_bytes: usize,
    cas: Option<u64>,
) -> usize {
    let cas_len = cas.map_or(0, |cas| 1 + decimal_len(cas));
    b"VALUE ".len()
        + key_len_bytes
        + 1
        + decimal_len(u64::from(client_flags))
        + 1
        + decimal_len(data_len_bytes as u64)
        + cas_len
        + CRLF.len()
}

/// Appends an `incr`/`decr` result.
pub fn number(out: &mut Vec<u8>, value: u64) {
    push_u64(out, value);
    out.extend_from_slice(CRLF);
}

/// Appends `VERSION <version>`.
pub fn version(out: &mut Vec<u8>, version: &[u8]) {
    out.extend_from_slice(b"VERSION ");
    out.extend_from_slice(version);
    out.extend_from_slice(CRLF);
}

/// Appends `STAT <name> <value>`; close the list with [`Reply::End`].
pub fn stat(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(b"STAT ");
    out.extend_from_slice(name);
    out.push(b' ');
    out.extend_from_slice(value);
    out.extend_from_slice(CRLF);
}

/// Appends `STAT <name> <value>` for a number.
pub fn stat_u64(out: &mut Vec<u8>, name: &[u8], value: u64) {
    out.extend_from_slice(b"STAT ");
    out.extend_from_slice(name);
    out.push(b' ');
    push_u64(out, value);
    out.extend_from_slice(CRLF);
}

/// Which meta command a response answers (for [`quiet_suppresses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaCommand {
    /// `mg`.
    Get,
    /// `ms`.
    Set,
    /// `md`.
    Delete,
    /// `ma`.
    Arithmetic,
}

/// Meta response codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaCode {
    /// `VA <size>`: a value follows.
    Va {
        /// Size of the value, in bytes.
        data_len_bytes: usize,
    },
    /// `HD`: success, no value.
    Hd,
    /// `EN`: miss (`mg`, `me`).
    En,
    /// `NF`: not found.
    Nf,
    /// `NS`: not stored.
    Ns,
    /// `EX`: CAS mismatch.
    Ex,
}

/// Whether a `q` request gets no response with this code. memcached 1.6.18
/// hides `EN` for `mg`, `HD` for `ms` and `md`, and every success (`HD` and
/// `VA`) for `ma` except the reply for a counter its `N` flag just created;
/// all other codes and all errors are sent.
pub fn quiet_suppresses(command: MetaCommand, code: MetaCode) -> bool {
    matches!(
        (command, code),
        (MetaCommand::Get, MetaCode::En)
            | (
                MetaCommand::Set | MetaCommand::Delete | MetaCommand::Arithmetic,
                MetaCode::Hd
            )
            | (MetaCommand::Arithmetic, MetaCode::Va { .. })
    )
}

/// What a server knows about the item a meta response reports. A return flag
/// is rendered only if requested and its value is `Some`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaItem<'a> {
    /// The key (decoded, if it was sent in base64), for `k`.
    pub key: &'a [u8],
    /// `c`: CAS value (`ms` reports 0 when nothing was stored).
    pub cas: Option<u64>,
    /// `f`: client flags.
    pub client_flags: Option<u32>,
    /// `h`: whether the item had been fetched before this request.
    pub hit_before: Option<bool>,
    /// `l`: seconds since the last access before this request.
    pub last_access_s: Option<u64>,
    /// `s`: value size.
    pub size_bytes: Option<u64>,
    /// `t`: seconds left to live; -1 for no expiry.
    pub ttl_s: Option<i64>,
    /// `Z` (`mg`): another client already holds the recache win.
    pub win_sent: bool,
    /// `X` (`mg`): the item is stale.
    pub stale: bool,
    /// `W` (`mg`): this client won the right to recache.
    pub won: bool,
}

impl<'a> MetaItem<'a> {
    /// An item known only by its key: a miss renders just `O` and `k`.
    pub fn miss(key: &'a [u8]) -> Self {
        Self {
            key,
            ..Self::default()
        }
    }
}

/// Appends a meta response line: the code, then the return flags.
pub fn meta_header(out: &mut Vec<u8>, code: MetaCode, flags: &MetaFlags<'_>, item: &MetaItem<'_>) {
    match code {
        MetaCode::Va { data_len_bytes } => {
            out.extend_from_slice(b"VA ");
            push_u64(out, data_len_bytes as u64);
        }
        MetaCode::Hd => out.extend_from_slice(b"HD"),
        MetaCode::En => out.extend_from_slice(b"EN"),
        MetaCode::Nf => out.extend_from_slice(b"NF"),
        MetaCode::Ns => out.extend_from_slice(b"NS"),
        MetaCode::Ex => out.extend_from_slice(b"EX"),
    }
    for flag in flags.iter() {
        return_flag(out, flag, flags, item);
    }
    for (set, byte) in [(item.win_sent, b'Z'), (item.stale, b'X'), (item.won, b'W')] {
        if set {
            out.extend_from_slice(&[b' ', byte]);
        }
    }
    out.extend_from_slice(CRLF);
}

/// Appends `VA <size> <flags>*\r\n<data>\r\n`.
pub fn meta_value(out: &mut Vec<u8>, flags: &MetaFlags<'_>, item: &MetaItem<'_>, data: &[u8]) {
    meta_header(
        out,
        MetaCode::Va {
            data_len_bytes: data.len(),
        },
        flags,
        item,
    );
    out.extend_from_slice(data);
    out.extend_from_slice(CRLF);
}

/// A return flag's value, before rendering.
enum FlagValue<'v> {
    Bytes(&'v [u8]),
    Key,
    Unsigned(u64),
    Signed(i64),
}

fn return_flag(out: &mut Vec<u8>, flag: MetaFlag, flags: &MetaFlags<'_>, item: &MetaItem<'_>) {
    let value = match flag {
        MetaFlag::Opaque => Some(FlagValue::Bytes(flags.opaque().unwrap_or_default())),
        MetaFlag::ReturnKey => Some(FlagValue::Key),
        MetaFlag::ReturnCas => item.cas.map(FlagValue::Unsigned),
        MetaFlag::ReturnClientFlags => item.client_flags.map(|v| FlagValue::Unsigned(v.into())),
        MetaFlag::ReturnHit => item.hit_before.map(|v| FlagValue::Unsigned(v.into())),
        MetaFlag::ReturnLastAccess => item.last_access_s.map(FlagValue::Unsigned),
        MetaFlag::ReturnSize => item.size_bytes.map(FlagValue::Unsigned),
        MetaFlag::ReturnTtl => item.ttl_s.map(FlagValue::Signed),
        _ => None,
    };
    let Some(value) = value else { return };
    out.extend_from_slice(&[b' ', flag.as_byte()]);
    match value {
        FlagValue::Bytes(bytes) => out.extend_from_slice(bytes),
        FlagValue::Key if flags.base64_key() => {
            encode_base64(item.key, out);
            out.extend_from_slice(b" b");
        }
        FlagValue::Key => out.extend_from_slice(item.key),
        FlagValue::Unsigned(v) => push_u64(out, v),
        FlagValue::Signed(v) => push_i64(out, v),
    }
}

/// Item facts for `me`, in memcached's field order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaDebugInfo {
    /// `exp`: seconds until expiry, -1 for none.
    pub exptime_s: i64,
    /// `la`: seconds since last access.
    pub last_access_s: u64,
    /// `cas`: CAS value.
    pub cas: u64,
    /// `fetch`: fetched since stored.
    pub fetched: bool,
    /// `cls`: memcached's slab class; storage-specific elsewhere.
    pub slab_class: u32,
    /// `size`: total item size.
    pub size_bytes: u64,
}

/// Appends `ME <key> exp=.. la=.. cas=.. fetch=yes|no cls=.. size=..`; the key
/// is base64-encoded when `base64_key`. A miss is `MetaCode::En`.
pub fn meta_debug(out: &mut Vec<u8>, key: &[u8], base64_key: bool, info: &MetaDebugInfo) {
    out.extend_from_slice(b"ME ");
    if base64_key {
        encode_base64(key, out);
    } else {
        out.extend_from_slice(key);
    }
    out.extend_from_slice(b" exp=");
    push_i64(out, info.exptime_s);
    out.extend_from_slice(b" la=");
    push_u64(out, info.last_access_s);
    out.extend_from_slice(b" cas=");
    push_u64(out, info.cas);
    out.extend_from_slice(if info.fetched {
        b" fetch=yes"
    } else {
        b" fetch=no"
    });
    out.extend_from_slice(b" cls=");
    push_u64(out, u64::from(info.slab_class));
    out.extend_from_slice(b" size=");
    push_u64(out, info.size_bytes);
    out.extend_from_slice(CRLF);
}

/// Appends the decimal digits of `value`.
pub(crate) fn push_u64(out: &mut Vec<u8>, value: u64) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = value;
    for slot in digits.iter_mut().rev() {
        *slot = b'0' + (rest % 10) as u8;
        rest /= 10;
        start -= 1;
        if rest == 0 {
            break;
        }
    }
    out.extend_from_slice(digits.get(start..).unwrap_or_default());
}

/// Appends `value` in decimal, with a `-` if negative.
pub(crate) fn push_i64(out: &mut Vec<u8>, value: i64) {
    if value < 0 {
        out.push(b'-');
    }
    push_u64(out, value.unsigned_abs());
}

fn decimal_len(value: u64) -> usize {
    value.checked_ilog10().map_or(1, |log| log as usize + 1)
}

#[cfg(test)]
mod tests {
    //! Expected bytes are memcached 1.6.18's answers to the same requests.
    use super::*;
    use crate::{MetaFlags, Parsed, ParserLimits, Request, parse};

    fn flags(request_line: &[u8]) -> MetaFlags<'_> {
        match parse(request_line, &ParserLimits::default()) {
            Ok(Parsed::Complete { request, .. }) => match request {
                Request::MetaGet(r) | Request::MetaDelete(r) => r.flags,
                Request::MetaSet(s) => s.flags,
                Request::MetaArithmetic(a) => a.flags,
                other => panic!("not meta: {other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }

    fn written(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        f(&mut out);
        out
    }

    #[test]
    fn mg_hit_renders_flags_in_request_order() {
        let flags = flags(b"mg m1 s v f t c k Oabc q h l\r\n");
        let item = MetaItem {
            key: b"m1",
            cas: Some(16),
            client_flags: Some(5),
            hit_before: Some(false),
            last_access_s: Some(0),
            size_bytes: Some(2),
            ttl_s: Some(-1),
            ..MetaItem::default()
        };
        let out = written(|out| meta_value(out, &flags, &item, b"hi"));
        assert_eq!(out, b"VA 2 s2 f5 t-1 c16 km1 Oabc h0 l0\r\nhi\r\n");
    }

    #[test]
    fn misses_render_only_opaque_and_key() {
        let flags = flags(b"mg missing k Oxx v c\r\n");
        let out =
            written(|out| meta_header(out, MetaCode::En, &flags, &MetaItem::miss(b"missing")));
        assert_eq!(out, b"EN kmissing Oxx\r\n");
        let out = written(|out| {
            meta_header(
                out,
                MetaCode::En,
                &self::flags(b"mg a O\r\n"),
                &MetaItem::miss(b"a"),
            )
        });
        assert_eq!(out, b"EN O\r\n");
        let flags = self::flags(b"ma nope k O1\r\n");
        assert_eq!(
            written(|out| meta_header(out, MetaCode::Nf, &flags, &MetaItem::miss(b"nope"))),
            b"NF knope O1\r\n"
        );
    }

    #[test]
    fn base64_keys_come_back_encoded_with_b() {
        let flags = flags(b"mg bTE= b k v c\r\n");
        let item = MetaItem {
            key: b"m1",
            cas: Some(18),
            ..MetaItem::default()
        };
        assert_eq!(
            written(|out| meta_value(out, &flags, &item, b"hi")),
            b"VA 2 kbTE= b c18\r\nhi\r\n"
        );
        // memcached re-encodes, so a non-canonical key comes back canonical.
        let flags = self::flags(b"ms bR== 1 b k\r\nx\r\n");
        let out = written(|out| meta_header(out, MetaCode::Hd, &flags, &MetaItem::miss(b"m")));
        assert_eq!(out, b"HD kbQ== b\r\n");
    }

    #[test]
    fn ms_and_ma_responses() {
        let flags = flags(b"ms m2 2 ME k c O1 q\r\nhi\r\n");
        let item = MetaItem {
            key: b"m2",
            cas: Some(0),
            ..MetaItem::default()
        };
        assert_eq!(
            written(|out| meta_header(out, MetaCode::Ns, &flags, &item)),
            b"NS km2 c0 O1\r\n"
        );
        let flags = self::flags(b"ma a MD v t c k O9\r\n");
        let item = MetaItem {
            key: b"a",
            cas: Some(30),
            ttl_s: Some(-1),
            ..MetaItem::default()
        };
        assert_eq!(
            written(|out| meta_value(out, &flags, &item, b"5")),
            b"VA 1 t-1 c30 ka O9\r\n5\r\n"
        );
    }

    #[test]
    fn mg_win_flags_come_last_in_z_x_w_order() {
        let flags = flags(b"mg qd v c\r\n");
        let item = MetaItem {
            key: b"qd",
            cas: Some(57),
            stale: true,
            won: true,
            ..MetaItem::default()
        };
        assert_eq!(
            written(|out| meta_value(out, &flags, &item, b"")),
            b"VA 0 c57 X W\r\n\r\n"
        );
        let item = MetaItem {
            win_sent: true,
            won: false,
            ..item
        };
        assert_eq!(
            written(|out| meta_value(out, &flags, &item, b"")),
            b"VA 0 c57 Z X\r\n\r\n"
        );
    }

    #[test]
    fn every_code() {
        let none = MetaFlags::new();
        let item = MetaItem::miss(b"k");
        for (code, text) in [
            (MetaCode::Hd, &b"HD\r\n"[..]),
            (MetaCode::En, b"EN\r\n"),
            (MetaCode::Nf, b"NF\r\n"),
            (MetaCode::Ns, b"NS\r\n"),
            (MetaCode::Ex, b"EX\r\n"),
            (MetaCode::Va { data_len_bytes: 12 }, b"VA 12\r\n"),
        ] {
            assert_eq!(written(|out| meta_header(out, code, &none, &item)), text);
        }
        assert_eq!(written(|out| reply(out, Reply::MetaNoop)), b"MN\r\n");
    }

    #[test]
    fn quiet_mode_matches_memcached() {
        use MetaCode::*;
        use MetaCommand::*;
        assert!(quiet_suppresses(Get, En));
        assert!(!quiet_suppresses(Get, Hd) && !quiet_suppresses(Get, Va { data_len_bytes: 1 }));
        assert!(
            quiet_suppresses(Set, Hd) && !quiet_suppresses(Set, Ns) && !quiet_suppresses(Set, Ex)
        );
        assert!(
            quiet_suppresses(Delete, Hd)
                && !quiet_suppresses(Delete, Nf)
                && !quiet_suppresses(Delete, Ex)
        );
        assert!(
            quiet_suppresses(Arithmetic, Hd)
                && quiet_suppresses(Arithmetic, Va { data_len_bytes: 1 })
        );
        assert!(!quiet_suppresses(Arithmetic, Nf) && !quiet_suppresses(Arithmetic, Ex));
    }

    #[test]
    fn meta_debug_line() {
        let info = MetaDebugInfo {
            exptime_s: -1,
            last_access_s: 0,
            cas: 34,
            fetched: false,
            slab_class: 1,
            size_bytes: 63,
        };
        let out = written(|out| meta_debug(out, b"mee", false, &info));
        assert_eq!(out, b"ME mee exp=-1 la=0 cas=34 fetch=no cls=1 size=63\r\n");
        let out = written(|out| {
            meta_debug(
                out,
                b"m1",
                true,
                &MetaDebugInfo {
                    fetched: true,
                    ..info
                },
            )
        });
        assert_eq!(
            out,
            b"ME bTE= exp=-1 la=0 cas=34 fetch=yes cls=1 size=63\r\n"
        );
    }

    #[test]
    fn classic_values() {
        assert_eq!(
            written(|out| value(out, b"qc", 7, b"5", Some(55))),
            b"VALUE qc 7 1 55\r\n5\r\n"
        );
        assert_eq!(
            written(|out| value(out, b"a", 0, b"b", None)),
            b"VALUE a 0 1\r\nb\r\n"
        );
        for (key, flags, len, cas) in [
            (&b"k"[..], 0, 0, None),
            (b"key", u32::MAX, 1 << 20, Some(u64::MAX)),
            (b"", 10, 9, Some(0)),
        ] {
            let header = written(|out| value_header(out, key, flags, len, cas));
            assert_eq!(header.len(), value_header_len(key.len(), flags, len, cas));
        }
    }

    #[test]
    fn fixed_and_numeric_replies() {
        let all = written(|out| {
            for r in [
                Reply::Stored,
                Reply::NotStored,
                Reply::Exists,
                Reply::NotFound,
                Reply::Deleted,
                Reply::Touched,
                Reply::Ok,
                Reply::End,
                Reply::Error,
                Reply::Reset,
            ] {
                reply(out, r);
            }
            number(out, 0);
            number(out, u64::MAX);
            version(out, b"1.6.18");
            stat(out, b"pid", b"7");
            stat_u64(out, b"curr_items", 12);
        });
        let expected = "STORED\r\nNOT_STORED\r\nEXISTS\r\nNOT_FOUND\r\nDELETED\r\nTOUCHED\r\nOK\r\nEND\r\nERROR\r\nRESET\r\n\
            0\r\n18446744073709551615\r\nVERSION 1.6.18\r\nSTAT pid 7\r\nSTAT curr_items 12\r\n";
        assert_eq!(String::from_utf8(all).unwrap(), expected);
    }

    #[test]
    fn error_lines() {
        assert_eq!(
            written(|out| error(out, ErrorKind::BadDataChunk)),
            b"CLIENT_ERROR bad data chunk\r\n"
        );
        assert_eq!(
            written(|out| client_error(out, b"a\r\nb")),
            b"CLIENT_ERROR a  b\r\n"
        );
        assert_eq!(
            written(|out| server_error(out, b"out of memory")),
            b"SERVER_ERROR out of memory\r\n"
        );
    }

    #[test]
    fn integers() {
        for value in [0u64, 9, 10, 99, 100, 12345, u64::MAX] {
            assert_eq!(
                written(|out| push_u64(out, value)),
                value.to_string().as_bytes()
            );
            assert_eq!(decimal_len(value), value.to_string().len());
        }
        for value in [0i64, -1, i64::MIN, i64::MAX] {
            assert_eq!(
                written(|out| push_i64(out, value)),
                value.to_string().as_bytes()
            );
        }
    }
}
