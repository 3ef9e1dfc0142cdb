//! memcached's ASCII authentication (`-Y FILE`): until a connection has authenticated, the
//! only request it may send is a `set` whose data is `<user> <password>`; the key, flags and
//! TTL are ignored, and the reply is `STORED` (even with `noreply`) or an error. Anything else
//! gets `CLIENT_ERROR unauthenticated`; the connection stays, unauthenticated. Checked against
//! memcached 1.6.18 (`try_read_command_asciiauth` and `authfile.c`), which differs in one way:
//! of several requests that arrive together before authentication it answers only the last.
//!
//! Two parts, both pure: [`parse_auth`] reads one attempt from a connection's buffer, and
//! [`AuthFile`] parses the file of `user:password` lines and checks credentials.

/// A first line of an unauthenticated connection this long with no `\n` in it is junk: the
/// connection is closed without a reply (memcached's 1024 bytes).
pub const AUTH_LINE_LENGTH_MAX: usize = 1024;
/// Most entries in an auth file. memcached keeps the first 8 and drops the rest without a
/// word; kura takes more, and refuses a file over this limit with an error at startup.
pub const AUTH_ENTRIES_MAX: usize = 1024;
/// Longest line of an auth file, `user:password` (memcached reads lines of up to 256 bytes).
pub const AUTH_ENTRY_LENGTH_MAX: usize = 255;
/// Most data bytes of an authentication `set` that are read as credentials; longer data
/// cannot hold an entry's user and password, is discarded as it arrives, and fails.
pub const AUTH_DATA_LENGTH_MAX: usize = 1024;

/// One step of an unauthenticated connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthStep<'a> {
    /// More bytes are needed.
    Incomplete,
    /// Not an authentication `set`: reply [`AuthStep::UNAUTHENTICATED`]; the connection
    /// stays unauthenticated.
    Unauthenticated {
        /// Bytes of the request (the line).
        consumed_bytes: usize,
    },
    /// No `\n` within [`AUTH_LINE_LENGTH_MAX`] bytes: close without a reply.
    Junk,
    /// Data longer than [`AUTH_DATA_LENGTH_MAX`]: reply [`AuthStep::FAILURE`], discard the
    /// data (and its `\r\n`) as it arrives; the connection stays unauthenticated.
    TooLong {
        /// Bytes of the line.
        consumed_bytes: usize,
        /// Bytes to discard after it.
        data_bytes: usize,
    },
    /// The data did not end with `\r\n`: reply [`AuthStep::BAD_TERMINATION`]; the connection
    /// stays unauthenticated.
    BadTermination {
        /// Bytes of the line and the data.
        consumed_bytes: usize,
    },
    /// The data was not two words: reply [`AuthStep::BAD_FORMAT`]; the connection stays
    /// unauthenticated.
    BadFormat {
        /// Bytes of the line and the data.
        consumed_bytes: usize,
    },
    /// Credentials to check: reply `STORED` and go on authenticated if they match, else
    /// [`AuthStep::FAILURE`] and stay unauthenticated.
    Credentials {
        /// The first word of the data.
        user: &'a [u8],
        /// The second word (more words are ignored).
        password: &'a [u8],
        /// Bytes of the line and the data.
        consumed_bytes: usize,
    },
}

impl AuthStep<'_> {
    /// The reply to a request before authentication.
    pub const UNAUTHENTICATED: &'static [u8] = b"CLIENT_ERROR unauthenticated\r\n";
    /// The reply to data not ending with `\r\n`.
    pub const BAD_TERMINATION: &'static [u8] = b"CLIENT_ERROR bad command line termination\r\n";
    /// The reply to data that is not `<user> <password>`.
    pub const BAD_FORMAT: &'static [u8] = b"CLIENT_ERROR bad authentication token format\r\n";
    /// The reply to credentials that do not match.
    pub const FAILURE: &'static [u8] = b"CLIENT_ERROR authentication failure\r\n";
    /// The reply to credentials that match.
    pub const STORED: &'static [u8] = b"STORED\r\n";
}

/// Words separated by spaces (memcached's `tokenize_command`: runs of spaces are one
/// separator; a tab or `\r` belongs to the word).
fn words(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b' ').filter(|w| !w.is_empty())
}

/// `<bytes>` of the line: an optional `+` and digits, ending the word or followed by
/// whitespace (memcached's `safe_strtoul`, which reads `12\r` as 12), at most `u32::MAX`.
fn data_length(word: &[u8]) -> Option<u64> {
    let digits = word.strip_prefix(b"+").unwrap_or(word);
    let end = digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len());
    if end == 0 || !digits[end..].first().is_none_or(|b| b.is_ascii_whitespace()) {
        return None;
    }
    let n: u64 = std::str::from_utf8(&digits[..end]).ok()?.parse().ok()?;
    (n <= u64::from(u32::MAX)).then_some(n)
}

/// Reads one authentication attempt from the front of `buf`.
pub fn parse_auth(buf: &[u8]) -> AuthStep<'_> {
    let Some(newline) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() > AUTH_LINE_LENGTH_MAX { AuthStep::Junk } else { AuthStep::Incomplete };
    };
    let line = &buf[..newline];
    let line_bytes = newline + 1;
    let fields: Vec<&[u8]> = words(line).take(5).collect();
    let length = match fields.as_slice() {
        [b"set", _, _, _, length] => data_length(length),
        _ => None,
    };
    let Some(length) = length else {
        return AuthStep::Unauthenticated { consumed_bytes: line_bytes };
    };
    let Some(length) = usize::try_from(length).ok().filter(|&n| n <= AUTH_DATA_LENGTH_MAX) else {
        return AuthStep::TooLong { consumed_bytes: line_bytes, data_bytes: length as usize + 2 };
    };
    let data_end = line_bytes + length + 2;
    if buf.len() < data_end {
        return AuthStep::Incomplete;
    }
    let consumed_bytes = data_end;
    if &buf[data_end - 2..data_end] != b"\r\n" {
        return AuthStep::BadTermination { consumed_bytes };
    }
    let mut credentials = words(&buf[line_bytes..line_bytes + length]);
    match (credentials.next(), credentials.next()) {
        (Some(user), Some(password)) => AuthStep::Credentials { user, password, consumed_bytes },
        _ => AuthStep::BadFormat { consumed_bytes },
    }
}

/// Why an auth file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthFileError {
    /// A line is not `user:password`.
    #[error("line {line} is not user:password")]
    Malformed {
        /// 1-based.
        line: usize,
    },
    /// A line is longer than [`AUTH_ENTRY_LENGTH_MAX`].
    #[error("line {line} is longer than {AUTH_ENTRY_LENGTH_MAX} bytes")]
    LineTooLong {
        /// 1-based.
        line: usize,
    },
    /// More than [`AUTH_ENTRIES_MAX`] entries.
    #[error("more than {AUTH_ENTRIES_MAX} entries")]
    TooManyEntries,
}

/// The users of an auth file: lines `user:password` (the password runs to the line's end, a
/// `\r` before the `\n` not included; it may hold `:`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AuthFile {
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for AuthFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the passwords.
        f.debug_struct("AuthFile").field("users", &self.entries.len()).finish()
    }
}

impl AuthFile {
    /// Parses the file's bytes. An empty file is valid (and lets nobody in, as memcached's).
    pub fn parse(text: &[u8]) -> Result<Self, AuthFileError> {
        let text = text.strip_suffix(b"\n").unwrap_or(text);
        let mut entries = Vec::new();
        if text.is_empty() {
            return Ok(Self { entries });
        }
        for (index, line) in text.split(|&b| b == b'\n').enumerate() {
            let line_number = index + 1;
            if line.len() > AUTH_ENTRY_LENGTH_MAX {
                return Err(AuthFileError::LineTooLong { line: line_number });
            }
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|&b| b == b':').ok_or(AuthFileError::Malformed { line: line_number })?;
            if line[..colon].contains(&0) || line[colon + 1..].contains(&0) || line[colon + 1..].contains(&b'\r') {
                return Err(AuthFileError::Malformed { line: line_number });
            }
            if entries.len() == AUTH_ENTRIES_MAX {
                return Err(AuthFileError::TooManyEntries);
            }
            entries.push((line[..colon].to_vec(), line[colon + 1..].to_vec()));
        }
        Ok(Self { entries })
    }

    /// Entries in the file.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the file has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `user` and `password` are an entry's. Every entry is compared whole, whatever
    /// matched before, so the time taken does not tell how much of a password was right.
    pub fn check(&self, user: &[u8], password: &[u8]) -> bool {
        let mut matched = false;
        for (u, p) in &self.entries {
            matched |= same_bytes(u, user) & same_bytes(p, password);
        }
        matched
    }
}

/// Equality whose time depends on the lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_reads_the_line_and_the_data() {
        let buf = b"set x 0 0 12\r\nalice secret\r\nget x\r\n";
        assert_eq!(parse_auth(buf), AuthStep::Credentials { user: b"alice", password: b"secret", consumed_bytes: 28 });
        // A bare \n ends the line; leading and repeated spaces separate; more words and
        // noreply are ignored.
        assert_eq!(
            parse_auth(b" set  k 1 2 18 noreply\nalice  secret more\r\n"),
            AuthStep::Credentials { user: b"alice", password: b"secret", consumed_bytes: 43 }
        );
        assert_eq!(parse_auth(b"set x 0 0 +3\r\na b\r\n"), AuthStep::Credentials { user: b"a", password: b"b", consumed_bytes: 19 });
    }

    #[test]
    fn partial_attempts_wait_for_more() {
        let buf = b"set x 0 0 12\r\nalice secret\r\n";
        for end in 0..buf.len() {
            assert_eq!(parse_auth(&buf[..end]), AuthStep::Incomplete, "{end}");
        }
    }

    #[test]
    fn anything_but_a_set_is_unauthenticated() {
        for line in [&b"get a\r\n"[..], b"set x 0 0\r\n", b"sett x 0 0 1\r\n", b"set x 0 0 abc\r\n", b"set x 0 0 -1\r\n", b"set x 0 0 1x\r\n", b"mg a v\r\n", b"\r\n", b"set x 0 0 99999999999\r\n"] {
            assert_eq!(parse_auth(line), AuthStep::Unauthenticated { consumed_bytes: line.len() }, "{}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn bad_data_is_refused_with_memcacheds_replies() {
        assert_eq!(parse_auth(b"set x 0 0 5\r\nalicexx"), AuthStep::BadTermination { consumed_bytes: 20 });
        assert_eq!(parse_auth(b"set x 0 0 5\r\nalice\r\n"), AuthStep::BadFormat { consumed_bytes: 20 });
        assert_eq!(parse_auth(b"set x 0 0 0\r\n\r\n"), AuthStep::BadFormat { consumed_bytes: 15 });
        // Words are separated by spaces only: one word holding a line break.
        assert_eq!(parse_auth(b"set x 0 0 11\r\nalice\r\nsecr\r\n"), AuthStep::BadFormat { consumed_bytes: 27 });
    }

    #[test]
    fn junk_and_oversized_data_close() {
        assert_eq!(parse_auth(&[b'x'; AUTH_LINE_LENGTH_MAX]), AuthStep::Incomplete);
        assert_eq!(parse_auth(&[b'x'; AUTH_LINE_LENGTH_MAX + 1]), AuthStep::Junk);
        assert_eq!(parse_auth(b"set x 0 0 1025\r\n"), AuthStep::TooLong { consumed_bytes: 16, data_bytes: 1027 });
        assert_eq!(parse_auth(b"set x 0 0 1024\r\n"), AuthStep::Incomplete);
    }

    #[test]
    fn files_are_memcacheds_user_password_lines() {
        let file = AuthFile::parse(b"alice:secret\r\nbob:pw:with:colons\n:empty-user\nnopass:\n").unwrap();
        assert_eq!(file.len(), 4);
        assert!(file.check(b"alice", b"secret"));
        assert!(file.check(b"bob", b"pw:with:colons"));
        assert!(file.check(b"", b"empty-user"));
        assert!(file.check(b"nopass", b""));
        assert!(!file.check(b"alice", b"secre"));
        assert!(!file.check(b"alice", b"secret "));
        assert!(!file.check(b"bob", b"secret"));
        assert!(AuthFile::parse(b"").unwrap().is_empty());
        assert!(!AuthFile::parse(b"").unwrap().check(b"", b""));
        assert_eq!(AuthFile::parse(b"a:b\nnocolon\n"), Err(AuthFileError::Malformed { line: 2 }));
        assert_eq!(AuthFile::parse(b"a:b\n\nc:d\n"), Err(AuthFileError::Malformed { line: 2 }));
        let long = format!("u:{}\n", "p".repeat(AUTH_ENTRY_LENGTH_MAX));
        assert_eq!(AuthFile::parse(long.as_bytes()), Err(AuthFileError::LineTooLong { line: 1 }));
        let many: String = (0..=AUTH_ENTRIES_MAX).map(|i| format!("u{i}:p\n")).collect();
        assert_eq!(AuthFile::parse(many.as_bytes()), Err(AuthFileError::TooManyEntries));
        assert!(!format!("{file:?}").contains("secret"));
    }
}
