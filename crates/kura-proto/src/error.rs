//! Protocol errors: what memcached would answer and what the connection does next.

use std::fmt;

/// Why a request was refused. [`ErrorKind::reply`] is the exact line
/// memcached 1.6 sends for it (without `\r\n`); the three kinds marked
/// "kura" have no memcached counterpart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Unknown command, wrong number of tokens, or a bad `cache_memlimit` argument.
    UnknownCommand,
    /// Malformed line: bad key, bad number, bad `<bytes>`.
    BadCommandLineFormat,
    /// `delete` with arguments other than `0` and `noreply`.
    DeleteUsage,
    /// A data block not followed by `\r\n`.
    BadDataChunk,
    /// Exptime of `touch`, `gat`, `gats` or `flush_all` is not a number.
    InvalidExptime,
    /// Delta of `incr`/`decr` is not an unsigned 64-bit number.
    InvalidDeltaArgument,
    /// A value larger than [`crate::ParserLimits::item_size_max_bytes`].
    ObjectTooLarge,
    /// kura: a line longer than its limit. memcached closes without a reply.
    LineTooLong,
    /// kura: a retrieval naming more than [`crate::ParserLimits::keys_per_get_max`] keys.
    TooManyKeys,
    /// kura: a binary-protocol request (first byte [`crate::BINARY_REQUEST_MAGIC`]).
    BinaryProtocol,
    /// Meta: unknown flag (`mg`, `ms`).
    InvalidFlag,
    /// Meta: a flag given twice (`mg`, `ms`).
    DuplicateFlag,
    /// Meta: any flag error of `md` and `ma`, which memcached does not tell apart.
    InvalidOrDuplicateFlag,
    /// Meta: a bad `N`, `T`, `R`, `C` or `E` token.
    BadToken,
    /// Meta: more than [`crate::META_TOKENS_MAX`] tokens on an `mg` line.
    MetaGetFlagsTooLong,
    /// Meta: more than [`crate::META_TOKENS_MAX`] tokens on an `ms`, `md` or `ma` line.
    FlagsTooLong,
    /// Meta: an opaque token longer than [`crate::OPAQUE_TOKEN_LENGTH_MAX`].
    OpaqueTooLong,
    /// Meta: an `M` token that is not exactly one mode character.
    ModeTokenLength,
    /// Meta: an `ms` mode other than `E A P R S`.
    InvalidSetMode,
    /// Meta: an `ma` mode other than `I + D -`.
    InvalidArithmeticMode,
    /// Meta: a `b` key that is not base64.
    KeyDecode,
    /// Meta: a bad `J` (initial value) token.
    InvalidInitial,
    /// Meta: a bad `D` (delta) token.
    InvalidDelta,
    /// `lru_crawler sleep` above 1,000,000 microseconds.
    CrawlerSleepTooLong,
}

impl ErrorKind {
    /// The reply line, without its `\r\n`.
    pub fn reply(self) -> &'static str {
        match self {
            Self::UnknownCommand => "ERROR",
            Self::BadCommandLineFormat => "CLIENT_ERROR bad command line format",
            Self::DeleteUsage => {
                "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]"
            }
            Self::BadDataChunk => "CLIENT_ERROR bad data chunk",
            Self::InvalidExptime => "CLIENT_ERROR invalid exptime argument",
            Self::InvalidDeltaArgument => "CLIENT_ERROR invalid numeric delta argument",
            Self::ObjectTooLarge => "SERVER_ERROR object too large for cache",
            Self::LineTooLong => "CLIENT_ERROR line too long",
            Self::TooManyKeys => "CLIENT_ERROR too many keys",
            Self::BinaryProtocol => "CLIENT_ERROR binary protocol is not supported",
            Self::InvalidFlag => "CLIENT_ERROR invalid flag",
            Self::DuplicateFlag => "CLIENT_ERROR duplicate flag",
            Self::InvalidOrDuplicateFlag => "CLIENT_ERROR invalid or duplicate flag",
            Self::BadToken => "CLIENT_ERROR bad token in command line format",
            Self::MetaGetFlagsTooLong => "CLIENT_ERROR options flags are too long",
            Self::FlagsTooLong => "CLIENT_ERROR options flags too long",
            Self::OpaqueTooLong => "CLIENT_ERROR opaque token too long",
            Self::ModeTokenLength => "CLIENT_ERROR incorrect length for M token",
            Self::InvalidSetMode => "CLIENT_ERROR invalid mode for ms M token",
            Self::InvalidArithmeticMode => "CLIENT_ERROR invalid mode for ma M token",
            Self::KeyDecode => "CLIENT_ERROR error decoding key",
            Self::InvalidInitial => "CLIENT_ERROR invalid numeric initial value",
            Self::InvalidDelta => "CLIENT_ERROR invalid numeric delta value",
            Self::CrawlerSleepTooLong => "CLIENT_ERROR sleep must be one second or less",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reply())
    }
}

impl std::error::Error for ErrorKind {}

/// What the connection does after an error reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recovery {
    /// Drop [`ParseError::consumed_bytes`] and parse on.
    Continue,
    /// Drop [`ParseError::consumed_bytes`], then discard the next `data_bytes`
    /// bytes of input unread (the data block and its `\r\n`), whatever they hold.
    Swallow {
        /// Bytes to discard after the line; some may not have arrived yet.
        data_bytes: usize,
    },
    /// Send the reply (if any) and close the connection.
    Close,
}

/// A request the parser refused, with memcached's reply and recovery.
///
/// Invariant: `consumed_bytes` ≤ the buffer's length, and is 0 only when
/// `recovery` is [`Recovery::Close`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct ParseError {
    /// What went wrong; its [`ErrorKind::reply`] is the reply line.
    pub kind: ErrorKind,
    /// Bytes of the buffer the refused request occupies (its line, plus the
    /// data block for [`ErrorKind::BadDataChunk`]).
    pub consumed_bytes: usize,
    /// What the connection does next.
    pub recovery: Recovery,
    /// memcached sends no reply: a classic command said `noreply` before failing.
    pub noreply: bool,
}

impl ParseError {
    /// The reply line to send, without `\r\n`, or `None` under `noreply`.
    pub fn reply(&self) -> Option<&'static str> {
        (!self.noreply).then(|| self.kind.reply())
    }

    pub(crate) fn closing(kind: ErrorKind) -> Self {
        Self {
            kind,
            consumed_bytes: 0,
            recovery: Recovery::Close,
            noreply: false,
        }
    }
}

/// An error found on one command line, before its length on the wire is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LineError {
    kind: ErrorKind,
    recovery: Recovery,
    noreply: bool,
}

impl LineError {
    pub(crate) fn new(kind: ErrorKind) -> Self {
        Self {
            kind,
            recovery: Recovery::Continue,
            noreply: false,
        }
    }

    /// `ERROR`, which memcached sends even under `noreply`.
    pub(crate) fn unknown() -> Self {
        Self::new(ErrorKind::UnknownCommand)
    }

    pub(crate) fn noreply(self, noreply: bool) -> Self {
        Self { noreply, ..self }
    }

    /// The data block of `data_len_bytes` (plus `\r\n`) must be swallowed.
    pub(crate) fn swallow(self, data_len_bytes: usize) -> Self {
        let data_bytes = data_len_bytes.saturating_add(2);
        Self {
            recovery: Recovery::Swallow { data_bytes },
            ..self
        }
    }

    pub(crate) fn at(self, line_bytes: usize) -> ParseError {
        ParseError {
            kind: self.kind,
            consumed_bytes: line_bytes,
            recovery: self.recovery,
            noreply: self.noreply,
        }
    }
}

impl From<ErrorKind> for LineError {
    fn from(kind: ErrorKind) -> Self {
        Self::new(kind)
    }
}
