//! Named limits of the protocol and the parser's configuration.

/// Longest key memcached accepts, in bytes (memcached `KEY_MAX_LENGTH`).
pub const KEY_LENGTH_MAX: usize = 250;

/// Longest command line, its final `\n` excluded: memcached closes a
/// connection once more than 2048 bytes have arrived without a `\n`
/// (`try_read_command_ascii`).
pub const LINE_LENGTH_MAX: usize = 2048;

/// Default bound on a `get`/`gets`/`gat`/`gats` line. memcached exempts
/// multi-gets from [`LINE_LENGTH_MAX`] and grows its buffer without bound; kura
/// bounds them.
pub const RETRIEVAL_LINE_LENGTH_MAX: usize = 64 * 1024;

/// Default number of keys one retrieval command may name (memcached: no bound).
pub const KEYS_PER_GET_MAX: usize = 4096;

/// Default largest value, in bytes (memcached's default `-I 1m`).
pub const ITEM_SIZE_MAX_BYTES: usize = 1024 * 1024;

/// Largest `<bytes>` field memcached can represent: the value plus its `\r\n`
/// must fit in a C `int`. Larger fields are a format error, not "too large".
pub const DATA_LENGTH_MAX_BYTES: usize = i32::MAX as usize - 2;

/// Tokens one meta command line may hold, command and key included
/// (memcached `MFLAG_MAX_OPT_LENGTH` = 20, which counts a terminal token).
pub const META_TOKENS_MAX: usize = 19;

/// Flags one meta command may carry: [`META_TOKENS_MAX`] less command and key
/// (`ms` has one fewer because its `<datalen>` takes a token).
pub const META_FLAGS_MAX: usize = META_TOKENS_MAX - 2;

/// Longest opaque token, its leading `O` included (memcached
/// `MFLAG_MAX_OPAQUE_LENGTH`), so an opaque value holds at most 31 bytes.
pub const OPAQUE_TOKEN_LENGTH_MAX: usize = 32;

/// First byte of every binary-protocol request.
pub const BINARY_REQUEST_MAGIC: u8 = 0x80;

/// Tokens the line splitter keeps (memcached `MAX_TOKENS`); lines with more are
/// reported as "more than this", which every command's token-count check rejects.
pub(crate) const LINE_TOKENS_CAP: usize = 24;

const _: () = assert!(KEY_LENGTH_MAX < LINE_LENGTH_MAX);
const _: () = assert!(LINE_LENGTH_MAX <= RETRIEVAL_LINE_LENGTH_MAX);
const _: () = assert!(ITEM_SIZE_MAX_BYTES <= DATA_LENGTH_MAX_BYTES);
const _: () = assert!(META_TOKENS_MAX < LINE_TOKENS_CAP);

/// Limits the parser enforces on untrusted input. Passed to [`crate::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParserLimits {
    /// Longest key in bytes; values above [`KEY_LENGTH_MAX`] are treated as it.
    pub key_length_max: usize,
    /// Largest data block of a storage command; larger ones are answered with
    /// `SERVER_ERROR object too large for cache` and swallowed. memcached counts
    /// its item header and key against `-I` too; kura counts the value alone.
    pub item_size_max_bytes: usize,
    /// Longest non-retrieval command line, its `\n` excluded.
    pub line_length_max: usize,
    /// Longest retrieval (`get`, `gets`, `gat`, `gats`) line, its `\n` excluded.
    pub retrieval_line_length_max: usize,
    /// Most keys one retrieval command may name.
    pub keys_per_get_max: usize,
}

impl Default for ParserLimits {
    fn default() -> Self {
        Self {
            key_length_max: KEY_LENGTH_MAX,
            item_size_max_bytes: ITEM_SIZE_MAX_BYTES,
            line_length_max: LINE_LENGTH_MAX,
            retrieval_line_length_max: RETRIEVAL_LINE_LENGTH_MAX,
            keys_per_get_max: KEYS_PER_GET_MAX,
        }
    }
}

impl ParserLimits {
    /// The key limit in force: the configured one, capped at the protocol's.
    pub(crate) fn key_length_max(&self) -> usize {
        self.key_length_max.min(KEY_LENGTH_MAX)
    }

    /// The retrieval line limit in force: never below the ordinary line limit.
    pub(crate) fn retrieval_line_length_max(&self) -> usize {
        self.retrieval_line_length_max.max(self.line_length_max)
    }
}
