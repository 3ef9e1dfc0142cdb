//! Lexical pieces: space-separated tokens, numbers, keys.
//!
//! Like memcached, tokens are separated by runs of `' '` only; a tab is part of
//! a token. Numbers are stricter than memcached's `strtol` family: no leading
//! or trailing whitespace, no `-` on unsigned fields, and no silent truncation
//! of values too wide for their field.

use crate::limits::LINE_TOKENS_CAP;

/// Space-separated tokens borrowed from a request line: the keys of a
/// retrieval, the arguments of `stats`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tokens<'a> {
    raw: &'a [u8],
    len: usize,
}

impl<'a> Tokens<'a> {
    /// The tokens of `raw`, split on runs of spaces. Validation is the parser's.
    pub fn new(raw: &'a [u8]) -> Self {
        Self {
            raw,
            len: TokenIter::new(raw).count(),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokens, in order.
    pub fn iter(&self) -> TokenIter<'a> {
        TokenIter::new(self.raw)
    }

    /// The first token.
    pub fn first(&self) -> Option<&'a [u8]> {
        self.iter().next()
    }
}

impl PartialEq for Tokens<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Tokens<'_> {}

impl<'a> IntoIterator for Tokens<'a> {
    type Item = &'a [u8];
    type IntoIter = TokenIter<'a>;

    fn into_iter(self) -> TokenIter<'a> {
        self.iter()
    }
}

impl<'a> IntoIterator for &Tokens<'a> {
    type Item = &'a [u8];
    type IntoIter = TokenIter<'a>;

    fn into_iter(self) -> TokenIter<'a> {
        self.iter()
    }
}

/// Iterator over space-separated, non-empty tokens.
#[derive(Debug, Clone)]
pub struct TokenIter<'a> {
    rest: &'a [u8],
}

impl<'a> TokenIter<'a> {
    pub(crate) fn new(raw: &'a [u8]) -> Self {
        Self { rest: raw }
    }

    /// The bytes not yet split, leading spaces included.
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.rest
    }
}

impl<'a> Iterator for TokenIter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let start = self.rest.iter().position(|&b| b != b' ')?;
        let rest = self.rest.get(start..).unwrap_or_default();
        let end = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
        let (token, after) = rest.split_at(end);
        self.rest = after;
        Some(token)
    }
}

/// A command line split into at most [`LINE_TOKENS_CAP`] tokens.
pub(crate) struct Line<'a> {
    tokens: [&'a [u8]; LINE_TOKENS_CAP],
    len: usize,
    truncated: bool,
}

impl<'a> Line<'a> {
    pub(crate) fn split(line: &'a [u8]) -> Self {
        let mut tokens: [&'a [u8]; LINE_TOKENS_CAP] = [b""; LINE_TOKENS_CAP];
        let mut iter = TokenIter::new(line);
        let mut len = 0;
        for (slot, token) in tokens.iter_mut().zip(iter.by_ref()) {
            *slot = token;
            len += 1;
        }
        let truncated = len == LINE_TOKENS_CAP && iter.next().is_some();
        Self {
            tokens,
            len,
            truncated,
        }
    }

    /// Number of tokens; a line with more than the cap counts as cap + 1.
    pub(crate) fn count(&self) -> usize {
        self.len + usize::from(self.truncated)
    }

    /// Token `index`, or an empty slice past the end.
    pub(crate) fn get(&self, index: usize) -> &'a [u8] {
        self.from(index).first().copied().unwrap_or_default()
    }

    /// The last token (memcached looks for `noreply` there).
    pub(crate) fn last(&self) -> &'a [u8] {
        self.from(0).last().copied().unwrap_or_default()
    }

    /// Tokens from `start` on.
    pub(crate) fn from(&self, start: usize) -> &[&'a [u8]] {
        self.tokens.get(start..self.len).unwrap_or_default()
    }
}

/// Whether the last token is `noreply`.
pub(crate) fn says_noreply(line: &Line<'_>) -> bool {
    line.last() == b"noreply"
}

/// A key memcached would accept, less control characters (which memcached
/// lets through; protocol.txt forbids them).
pub(crate) fn key_is_valid(key: &[u8], key_length_max: usize) -> bool {
    !key.is_empty() && key.len() <= key_length_max && is_text_key(key)
}

/// Whether memcached's text protocol can carry `key` as it is: no space, no control byte
/// (a key that cannot goes base64-encoded with the meta commands' `b` flag).
pub fn is_text_key(key: &[u8]) -> bool {
    !key.iter().any(|&b| is_control(b))
}

/// Control characters and space: never part of a key or an opaque token.
pub(crate) fn is_control(byte: u8) -> bool {
    byte <= b' ' || byte == 0x7f
}

/// An unsigned decimal: optional `+`, then digits, no overflow.
pub(crate) fn parse_u64(token: &[u8]) -> Option<u64> {
    let digits = token.strip_prefix(b"+").unwrap_or(token);
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |acc, &b| {
        let digit = decimal_digit(b)?;
        acc.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// An unsigned decimal that fits in 32 bits.
pub(crate) fn parse_u32(token: &[u8]) -> Option<u32> {
    parse_u64(token).and_then(|v| u32::try_from(v).ok())
}

/// A signed decimal: optional sign, then digits, within `i64` (C `long`).
pub(crate) fn parse_i64(token: &[u8]) -> Option<i64> {
    let (negative, digits) = match token.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, token),
    };
    if digits.is_empty() {
        return None;
    }
    // Accumulate toward the sign so that i64::MIN parses.
    digits.iter().try_fold(0i64, |acc, &b| {
        let digit = i64::from(decimal_digit(b)?);
        let shifted = acc.checked_mul(10)?;
        if negative {
            shifted.checked_sub(digit)
        } else {
            shifted.checked_add(digit)
        }
    })
}

fn decimal_digit(byte: u8) -> Option<u8> {
    byte.is_ascii_digit().then(|| byte - b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_on_space_runs_only() {
        let tokens: Vec<&[u8]> = TokenIter::new(b"  get a\tb   c ").collect();
        assert_eq!(tokens, vec![&b"get"[..], b"a\tb", b"c"]);
        assert_eq!(Tokens::new(b"   ").len(), 0);
        assert_eq!(Tokens::new(b"a  b"), Tokens::new(b" a b "));
    }

    #[test]
    fn line_caps_tokens_and_reports_more() {
        let many = "t ".repeat(LINE_TOKENS_CAP + 5);
        let line = Line::split(many.as_bytes());
        assert_eq!(line.count(), LINE_TOKENS_CAP + 1);
        let exact = "t ".repeat(LINE_TOKENS_CAP);
        assert_eq!(Line::split(exact.as_bytes()).count(), LINE_TOKENS_CAP);
        let short = Line::split(b"set k 0");
        assert_eq!(short.get(1), b"k");
        assert_eq!(short.get(9), b"");
        assert_eq!(short.last(), b"0");
    }

    #[test]
    fn unsigned_numbers() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"+7"), Some(7));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64(b"18446744073709551616"), None);
        for bad in [
            &b""[..],
            b"+",
            b"-1",
            b"-0",
            b"1x",
            b"0x10",
            b" 1",
            b"1\t",
            b"1.0",
        ] {
            assert_eq!(parse_u64(bad), None, "{bad:?}");
        }
        assert_eq!(parse_u32(b"4294967295"), Some(u32::MAX));
        assert_eq!(parse_u32(b"4294967296"), None);
    }

    #[test]
    fn signed_numbers() {
        assert_eq!(parse_i64(b"-1"), Some(-1));
        assert_eq!(parse_i64(b"+1"), Some(1));
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_i64(b"9223372036854775808"), None);
        assert_eq!(parse_i64(b"-9223372036854775809"), None);
        for bad in [&b""[..], b"-", b"+", b"--1", b"1-", b"x"] {
            assert_eq!(parse_i64(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn keys() {
        assert!(key_is_valid(b"a", 250));
        assert!(key_is_valid("ключ".as_bytes(), 250));
        assert!(key_is_valid(&[b'k'; 250], 250));
        assert!(!key_is_valid(&[b'k'; 251], 250));
        assert!(!key_is_valid(b"", 250));
        for bad in [&b"a\tb"[..], b"a\rb", b"a\0", b"a b", b"\x7f"] {
            assert!(!key_is_valid(bad, 250), "{bad:?}");
        }
    }
}
