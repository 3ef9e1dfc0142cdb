//! Framing: find the command line, dispatch it, attach the data block.

mod classic;
mod meta;
#[cfg(test)]
mod tests;

use crate::error::{ErrorKind, LineError, ParseError, Recovery};
use crate::lex::{Line, TokenIter};
use crate::limits::{BINARY_REQUEST_MAGIC, ParserLimits};
use crate::request::{Request, RetrievalCommand};

/// What [`parse`] found at the start of the buffer.
// One per request, on the stack; boxing the request would allocate.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// The request is not all there yet; read more and call again with the
    /// same bytes at the start of the buffer.
    Incomplete {
        /// Length of the whole request once known (storage commands: line,
        /// data block and `\r\n`), so the buffer can be sized to it.
        frame_bytes: Option<usize>,
    },
    /// A whole request.
    Complete {
        /// The request, borrowing from the buffer.
        request: Request<'a>,
        /// Bytes it occupies at the start of the buffer; always ≥ 1.
        consumed_bytes: usize,
    },
}

/// Whether `buf` starts a binary-protocol request, which kura does not speak.
pub fn is_binary_protocol(buf: &[u8]) -> bool {
    buf.first() == Some(&BINARY_REQUEST_MAGIC)
}

/// Parses the request at the start of `buf`, the bytes a connection has
/// buffered. Allocates nothing; never reads past `buf`.
///
/// A command line ends at `\n`, with or without a `\r` before it (memcached
/// accepts both); a data block must end with `\r\n`. Errors carry memcached's
/// reply and what the connection does next (see [`ParseError`]).
pub fn parse<'a>(buf: &'a [u8], limits: &ParserLimits) -> Result<Parsed<'a>, ParseError> {
    if is_binary_protocol(buf) {
        return Err(ParseError::closing(ErrorKind::BinaryProtocol));
    }
    let Some(newline) = find_newline(buf, limits)? else {
        return Ok(Parsed::Incomplete { frame_bytes: None });
    };
    let line_bytes = newline + 1;
    let line = buf.get(..newline).unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    match parse_line(line, limits) {
        Ok(Head::Complete(request)) => Ok(Parsed::Complete {
            request,
            consumed_bytes: line_bytes,
        }),
        Ok(Head::NeedsData {
            request,
            data_len_bytes,
            noreply,
        }) => attach_data(buf, line_bytes, request, data_len_bytes, noreply),
        Err(error) => Err(error.at(line_bytes)),
    }
}

/// A parsed command line.
pub(crate) enum Head<'a> {
    Complete(Request<'a>),
    /// A storage request whose data block follows the line.
    NeedsData {
        request: Request<'a>,
        data_len_bytes: usize,
        /// A bad data chunk gets no reply.
        noreply: bool,
    },
}

/// Index of the line's `\n`, `None` if it has not arrived, or an error once
/// more than the limit has arrived without one (memcached's rule).
fn find_newline(buf: &[u8], limits: &ParserLimits) -> Result<Option<usize>, ParseError> {
    let limit = line_length_limit(buf, limits);
    let window = buf.get(..limit.saturating_add(1)).unwrap_or(buf);
    match window.iter().position(|&b| b == b'\n') {
        Some(index) => Ok(Some(index)),
        None if buf.len() > limit => Err(ParseError::closing(ErrorKind::LineTooLong)),
        None => Ok(None),
    }
}

/// Retrieval lines may be longer than others; like memcached, tell them by
/// their prefix before the line is complete.
fn line_length_limit(buf: &[u8], limits: &ParserLimits) -> usize {
    let head = buf.get(..limits.line_length_max).unwrap_or(buf);
    let start = head.iter().position(|&b| b != b' ').unwrap_or(head.len());
    let head = head.get(start..).unwrap_or_default();
    let prefixes: [&[u8]; 4] = [b"get ", b"gets ", b"gat ", b"gats "];
    if prefixes.iter().any(|prefix| head.starts_with(prefix)) {
        limits.retrieval_line_length_max()
    } else {
        limits.line_length_max
    }
}

/// Dispatches a line (terminator stripped) on its command name.
fn parse_line<'a>(line: &'a [u8], limits: &ParserLimits) -> Result<Head<'a>, LineError> {
    let mut words = TokenIter::new(line);
    let Some(name) = words.next() else {
        return Err(LineError::unknown());
    };
    match name {
        [b'm', code] => meta::parse(*code, &Line::split(line), limits),
        _ if name.len() < 2 => Err(LineError::unknown()),
        _ => match RetrievalCommand::from_name(name) {
            Some(command) => classic::parse_retrieval(command, words, limits),
            None => classic::parse(name, words.rest(), &Line::split(line), limits),
        },
    }
}

/// Completes a storage request with its data block, once all of it is here.
fn attach_data<'a>(
    buf: &'a [u8],
    line_bytes: usize,
    mut request: Request<'a>,
    data_len_bytes: usize,
    noreply: bool,
) -> Result<Parsed<'a>, ParseError> {
    let data_end = line_bytes.saturating_add(data_len_bytes);
    let frame_bytes = data_end.saturating_add(2);
    let (Some(data), Some(terminator)) = (
        buf.get(line_bytes..data_end),
        buf.get(data_end..frame_bytes),
    ) else {
        return Ok(Parsed::Incomplete {
            frame_bytes: Some(frame_bytes),
        });
    };
    if terminator != b"\r\n" {
        return Err(ParseError {
            kind: ErrorKind::BadDataChunk,
            consumed_bytes: frame_bytes,
            recovery: Recovery::Continue,
            noreply,
        });
    }
    if let Some(slot) = request.data_mut() {
        *slot = data;
    }
    Ok(Parsed::Complete {
        request,
        consumed_bytes: frame_bytes,
    })
}
