//! The memcached text and meta protocol, as memcached 1.6 speaks it: a pure,
//! allocation-free request parser and a response encoder.
//!
//! A connection feeds its buffered bytes to [`parse`] and gets back either
//! [`Parsed::Incomplete`], a [`Request`] borrowing from the buffer with the
//! bytes it used, or a [`ParseError`] carrying memcached's exact reply and
//! what to do next ([`Recovery`]: go on, swallow a data block, or close).
//! Execution is the server's; replies are written with [`encode`].
//!
//! ```
//! use kura_proto::{parse, Parsed, ParserLimits, Request};
//!
//! let buf = b"set k 0 0 2\r\nhi\r\nget k\r\n";
//! let limits = ParserLimits::default();
//! let Ok(Parsed::Complete { request, consumed_bytes }) = parse(buf, &limits) else { panic!() };
//! assert!(matches!(request, Request::Storage(s) if s.data == b"hi"));
//! let Ok(Parsed::Complete { request, .. }) = parse(&buf[consumed_bytes..], &limits) else { panic!() };
//! assert!(matches!(request, Request::Retrieval(_)));
//! ```
//!
//! Replies and recoveries were checked against memcached 1.6.18. Where kura
//! is deliberately stricter than memcached:
//! - keys may not hold control characters (memcached accepts tabs, and cuts
//!   the line at a NUL), as protocol.txt requires;
//! - numbers allow an optional sign and digits only (memcached's `strtol`
//!   also takes leading and trailing whitespace), and numbers too wide for
//!   their field are refused where memcached truncates them (flags above
//!   2^32, `<bytes>` above 2^31);
//! - line limits are exact: a line over its limit is refused however it
//!   arrives (memcached refuses it only if 2048 bytes arrive without `\n`
//!   in one read), and multi-get lines are bounded too;
//! - base64 keys may not continue after their padding;
//! - opaque tokens may not hold control characters.
//!
//! Not parsed (answered `ERROR`, like any unknown command): memcached's admin
//! commands `extstore`, `debugtime`, `misbehave`, and the obsolete `bget`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod auth;
mod base64;
pub mod encode;
mod error;
mod lex;
mod limits;
mod meta;
mod parse;
mod render;
mod request;

pub use base64::{Base64Error, decode_base64_key, encode_base64};
pub use error::{ErrorKind, ParseError, Recovery};
pub use lex::{TokenIter, Tokens, is_text_key};
pub use limits::{
    BINARY_REQUEST_MAGIC, DATA_LENGTH_MAX_BYTES, ITEM_SIZE_MAX_BYTES, KEY_LENGTH_MAX,
    KEYS_PER_GET_MAX, LINE_LENGTH_MAX, META_FLAGS_MAX, META_TOKENS_MAX, OPAQUE_TOKEN_LENGTH_MAX,
    ParserLimits, RETRIEVAL_LINE_LENGTH_MAX,
};
pub use meta::{ArithmeticOp, MetaFlag, MetaFlags, SetMode};
pub use parse::{Parsed, is_binary_protocol, parse};
pub use render::render_request;
pub use request::{
    CrawlerCommand, MetaArithmetic, MetaRequest, MetaSet, MetadumpClasses, Request, Retrieval,
    RetrievalCommand, ShutdownMode, Storage, StorageCommand, TuningReply, WatchFlags,
};

/// The key a meta request names: `raw` itself, or its base64 decoding into
/// `buf` when the request carried the `b` flag.
pub fn meta_key<'k>(
    raw: &'k [u8],
    base64_key: bool,
    buf: &'k mut [u8; KEY_LENGTH_MAX],
) -> Result<&'k [u8], Base64Error> {
    if base64_key {
        decode_base64_key(raw, buf)
    } else {
        Ok(raw)
    }
}
