//! The meta commands, with memcached's check order and error strings. Meta
//! errors are always sent, `q` or not.

use super::Head;
use super::classic::data_length;
use crate::base64::is_base64_key;
use crate::error::{ErrorKind, LineError};
use crate::lex::{Line, key_is_valid, parse_i64};
use crate::limits::{META_TOKENS_MAX, ParserLimits};
use crate::meta::{ArithmeticOp, MetaFlags, SetMode, check_opaque, parse_flags};
use crate::request::{MetaArithmetic, MetaRequest, MetaSet, Request};

/// Which keyed meta command (`ms` and `me` have their own shapes).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keyed {
    Get,
    Delete,
    Arithmetic,
}

/// Dispatches `m<code>`.
pub(super) fn parse<'a>(
    code: u8,
    line: &Line<'a>,
    limits: &ParserLimits,
) -> Result<Head<'a>, LineError> {
    match code {
        b'n' => Ok(Head::Complete(Request::MetaNoop)),
        b'e' => debug(line, limits).map(Head::Complete),
        b'g' => keyed(Keyed::Get, line, limits).map(Head::Complete),
        b'd' => keyed(Keyed::Delete, line, limits).map(Head::Complete),
        b'a' => keyed(Keyed::Arithmetic, line, limits).map(Head::Complete),
        b's' => set(line, limits),
        _ => Err(LineError::unknown()),
    }
}

/// `mg`, `md`, `ma <key> <flags>*`.
fn keyed<'a>(
    command: Keyed,
    line: &Line<'a>,
    limits: &ParserLimits,
) -> Result<Request<'a>, LineError> {
    if line.count() < 2 {
        return Err(LineError::unknown());
    }
    let key = line.get(1);
    if !key_is_valid(key, limits.key_length_max()) {
        return Err(ErrorKind::BadCommandLineFormat.into());
    }
    if line.count() > META_TOKENS_MAX {
        let kind = match command {
            Keyed::Get => ErrorKind::MetaGetFlagsTooLong,
            _ => ErrorKind::FlagsTooLong,
        };
        return Err(kind.into());
    }
    let flags = parse_flags(line.from(2), key).map_err(|kind| match command {
        Keyed::Get => kind,
        // memcached does not tell md and ma flag errors apart.
        _ => ErrorKind::InvalidOrDuplicateFlag,
    })?;
    let request = match command {
        Keyed::Get => Request::MetaGet(MetaRequest { key, flags }),
        Keyed::Delete => Request::MetaDelete(MetaRequest { key, flags }),
        Keyed::Arithmetic => {
            let op = ArithmeticOp::from_flags(&flags)?;
            Request::MetaArithmetic(MetaArithmetic { key, flags, op })
        }
    };
    check_opaque(&flags)?;
    Ok(request)
}

/// `ms <key> <datalen> <flags>*`. Errors found after `<datalen>` swallow the
/// data block.
fn set<'a>(line: &Line<'a>, limits: &ParserLimits) -> Result<Head<'a>, LineError> {
    if line.count() < 2 {
        return Err(LineError::unknown());
    }
    let key = line.get(1);
    if !key_is_valid(key, limits.key_length_max()) || line.count() == 2 {
        return Err(ErrorKind::BadCommandLineFormat.into());
    }
    if line.count() > META_TOKENS_MAX {
        return Err(ErrorKind::FlagsTooLong.into());
    }
    let data_len_bytes = parse_i64(line.get(2))
        .and_then(data_length)
        .ok_or(ErrorKind::BadCommandLineFormat)?;
    let swallow = |kind: ErrorKind| LineError::new(kind).swallow(data_len_bytes);
    let flags = parse_flags(line.from(3), key).map_err(swallow)?;
    let mode = set_mode(&flags).map_err(swallow)?;
    if data_len_bytes > limits.item_size_max_bytes {
        return Err(swallow(ErrorKind::ObjectTooLarge));
    }
    let request = Request::MetaSet(MetaSet {
        key,
        flags,
        mode,
        data: &[],
    });
    Ok(Head::NeedsData {
        request,
        data_len_bytes,
        noreply: false,
    })
}

/// memcached checks the mode before reporting a bad opaque token.
fn set_mode(flags: &MetaFlags<'_>) -> Result<SetMode, ErrorKind> {
    let mode = SetMode::from_flags(flags)?;
    check_opaque(flags)?;
    Ok(mode)
}

/// `me <key> [b]`; other tokens are ignored. Every error is `bad command line format`.
fn debug<'a>(line: &Line<'a>, limits: &ParserLimits) -> Result<Request<'a>, LineError> {
    let key = line.get(1);
    let base64_key = line.get(2) == b"b";
    let valid = key_is_valid(key, limits.key_length_max()) && (!base64_key || is_base64_key(key));
    if !valid {
        return Err(ErrorKind::BadCommandLineFormat.into());
    }
    Ok(Request::MetaDebug { key, base64_key })
}
