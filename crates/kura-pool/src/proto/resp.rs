//! RESP2 (Redis' protocol) from the client's side: commands as arrays of bulk strings, and a
//! strict incremental reply parser that borrows from the receive buffer. Only replies that
//! nest (`CLUSTER SLOTS`) allocate.

/// Longest simple line (`+…`, `-…`, `:…`, headers) accepted.
pub const LINE_LENGTH_MAX: usize = 4096;
/// Deepest nesting of arrays accepted.
pub const DEPTH_MAX: usize = 8;
/// Most elements in one array.
pub const ARRAY_ELEMENTS_MAX: usize = 1 << 16;

/// One reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp<'a> {
    Simple(&'a [u8]),
    Error(&'a [u8]),
    Int(i64),
    Bulk(&'a [u8]),
    /// `$-1` or `*-1`.
    Nil,
    Array(Vec<Resp<'a>>),
}

/// Appends a command: `*<n>\r\n` and each argument as `$<len>\r\n<arg>\r\n`.
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    push_decimal(out, args.len());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        out.push(b'$');
        push_decimal(out, arg.len());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

fn push_decimal(out: &mut Vec<u8>, n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
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

fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, String> {
    let window = &buf[..buf.len().min(LINE_LENGTH_MAX)];
    match window.iter().position(|&b| b == b'\n') {
        Some(0) => Err("bare \\n".into()),
        Some(i) if buf[i - 1] != b'\r' => Err("line ends in \\n without \\r".into()),
        Some(i) => Ok(Some((&buf[..i - 1], i + 1))),
        None if buf.len() >= LINE_LENGTH_MAX => Err(format!("no line end within {LINE_LENGTH_MAX} bytes")),
        None => Ok(None),
    }
}

fn integer(text: &[u8]) -> Result<i64, String> {
    let (negative, digits) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(format!("{:?} is not an integer", String::from_utf8_lossy(&text[..text.len().min(32)])));
    }
    let n = digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
    Ok(if negative { -n } else { n })
}

/// Parses the reply at the start of `buf`: `Ok(None)` if incomplete, else the reply and its
/// length. Bulk strings longer than `bulk_max` and anything that is not RESP2 are errors.
pub fn parse_reply(buf: &[u8], bulk_max: usize) -> Result<Option<(Resp<'_>, usize)>, String> {
    parse_at(buf, bulk_max, 0)
}

fn parse_at(buf: &[u8], bulk_max: usize, depth: usize) -> Result<Option<(Resp<'_>, usize)>, String> {
    let Some((text, used)) = line(buf)? else { return Ok(None) };
    let (kind, rest) = text.split_first().ok_or("empty line")?;
    match kind {
        b'+' => Ok(Some((Resp::Simple(rest), used))),
        b'-' => Ok(Some((Resp::Error(rest), used))),
        b':' => Ok(Some((Resp::Int(integer(rest)?), used))),
        b'$' => {
            let len = integer(rest)?;
            if len == -1 {
                return Ok(Some((Resp::Nil, used)));
            }
            let len = usize::try_from(len).map_err(|_| format!("bulk length {len}"))?;
            if len > bulk_max {
                return Err(format!("bulk string of {len} bytes exceeds the limit of {bulk_max}"));
            }
            if buf.len() < used + len + 2 {
                return Ok(None);
            }
            if &buf[used + len..used + len + 2] != b"\r\n" {
                return Err("bulk string not followed by \\r\\n".into());
            }
            Ok(Some((Resp::Bulk(&buf[used..used + len]), used + len + 2)))
        }
        b'*' => {
            let count = integer(rest)?;
            if count == -1 {
                return Ok(Some((Resp::Nil, used)));
            }
            let count = usize::try_from(count).map_err(|_| format!("array length {count}"))?;
            if count > ARRAY_ELEMENTS_MAX || depth >= DEPTH_MAX {
                return Err(format!("array of {count} elements at depth {depth} is beyond the limits"));
            }
            let mut items = Vec::with_capacity(count.min(64));
            let mut at = used;
            for _ in 0..count {
                let Some((item, n)) = parse_at(&buf[at..], bulk_max, depth + 1)? else { return Ok(None) };
                items.push(item);
                at += n;
            }
            Ok(Some((Resp::Array(items), at)))
        }
        other => Err(format!("unexpected reply type byte {:?}", char::from(*other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(buf: &[u8]) -> (Resp<'_>, usize) {
        parse_reply(buf, 1 << 20).unwrap().unwrap()
    }

    #[test]
    fn commands() {
        let mut out = Vec::new();
        encode_command(&mut out, &[b"SET", b"k", b"a\r\nb"]);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n");
    }

    #[test]
    fn replies() {
        assert_eq!(one(b"+OK\r\n"), (Resp::Simple(b"OK"), 5));
        assert_eq!(one(b"-MOVED 1 h:1\r\n").0, Resp::Error(b"MOVED 1 h:1"));
        assert_eq!(one(b":-12\r\n").0, Resp::Int(-12));
        assert_eq!(one(b"$3\r\nabc\r\n"), (Resp::Bulk(b"abc"), 9));
        assert_eq!(one(b"$0\r\n\r\n").0, Resp::Bulk(b""));
        assert_eq!(one(b"$-1\r\n").0, Resp::Nil);
        assert_eq!(one(b"*-1\r\n").0, Resp::Nil);
        assert_eq!(one(b"*2\r\n:1\r\n*1\r\n$1\r\nx\r\n").0, Resp::Array(vec![Resp::Int(1), Resp::Array(vec![Resp::Bulk(b"x")])]));
    }

    #[test]
    fn incomplete() {
        let whole = b"*2\r\n$3\r\nabc\r\n:7\r\n";
        for cut in 0..whole.len() {
            assert_eq!(parse_reply(&whole[..cut], 100), Ok(None));
        }
    }

    #[test]
    fn garbage() {
        for bad in [&b"hello\r\n"[..], b"\r\n", b"$x\r\n", b"$-2\r\n", b"$2\r\nabcd", b":1.5\r\n", b"*-5\r\n", b"+ok\n", b"%1\r\n"] {
            assert!(parse_reply(bad, 100).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(parse_reply(b"$101\r\n", 100).unwrap_err().contains("limit"));
        let deep = "*1\r\n".repeat(DEPTH_MAX + 1);
        assert!(parse_reply(deep.as_bytes(), 100).is_err());
    }

    #[test]
    fn never_panics_on_random_bytes() {
        use proptest::prelude::*;
        proptest!(|(bytes in proptest::collection::vec(any::<u8>(), 0..300))| {
            let _ = parse_reply(&bytes, 64);
        });
        proptest!(|(bytes in proptest::collection::vec(prop_oneof![Just(b'*'), Just(b'$'), Just(b'1'), Just(b'-'), Just(b'\r'), Just(b'\n'), Just(b':')], 0..60))| {
            let _ = parse_reply(&bytes, 64);
        });
    }
}
