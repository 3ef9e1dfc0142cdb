//! The classic text commands, with memcached 1.6's token counts, check order
//! and replies. Once memcached has seen `noreply` as the last token, its
//! errors are silent too; a wrong token count is always answered `ERROR`.

use super::Head;
use crate::error::{ErrorKind, LineError};
use crate::lex::{
    Line, TokenIter, Tokens, key_is_valid, parse_i64, parse_u32, parse_u64, says_noreply,
};
use crate::limits::{DATA_LENGTH_MAX_BYTES, ParserLimits};
use crate::meta::ArithmeticOp;
use crate::request::{
    CrawlerCommand, MetadumpClasses, Request, Retrieval, RetrievalCommand, ShutdownMode, Storage,
    StorageCommand, TuningReply, WatchFlags,
};

/// `get`/`gets <key>*`, `gat`/`gats <exptime> <key>*`. `words` follows the name.
pub(super) fn parse_retrieval<'a>(
    command: RetrievalCommand,
    mut words: TokenIter<'a>,
    limits: &ParserLimits,
) -> Result<Head<'a>, LineError> {
    let exptime_s = if command.touches() {
        let token = words.next().ok_or_else(LineError::unknown)?;
        Some(parse_i64(token).ok_or(ErrorKind::InvalidExptime)?)
    } else {
        None
    };
    let keys = Tokens::new(words.rest());
    if keys.is_empty() && !command.touches() {
        return Err(LineError::unknown());
    }
    if keys.len() > limits.keys_per_get_max {
        return Err(ErrorKind::TooManyKeys.into());
    }
    if !keys
        .iter()
        .all(|key| key_is_valid(key, limits.key_length_max()))
    {
        return Err(ErrorKind::BadCommandLineFormat.into());
    }
    Ok(Head::Complete(Request::Retrieval(Retrieval {
        command,
        exptime_s,
        keys,
    })))
}

/// Every other classic command. `rest` is the line after the name.
pub(super) fn parse<'a>(
    name: &[u8],
    rest: &'a [u8],
    line: &Line<'a>,
    limits: &ParserLimits,
) -> Result<Head<'a>, LineError> {
    if let Some(command) = StorageCommand::from_name(name) {
        return parse_storage(command, line, limits);
    }
    let request = match name {
        b"incr" => arithmetic(ArithmeticOp::Incr, line, limits)?,
        b"decr" => arithmetic(ArithmeticOp::Decr, line, limits)?,
        b"delete" => delete(line, limits)?,
        b"touch" => touch(line, limits)?,
        b"flush_all" => flush_all(line)?,
        b"verbosity" => verbosity(line)?,
        b"cache_memlimit" => cache_memlimit(line)?,
        b"version" => Request::Version,
        b"sync" => sync(line)?,
        b"quit" => Request::Quit,
        b"refresh_certs" => Request::RefreshCerts { noreply: says_noreply(line) },
        b"stats" => Request::Stats {
            args: Tokens::new(rest),
        },
        b"shutdown" => Request::Shutdown(shutdown_mode(line)),
        b"lru_crawler" => lru_crawler(line)?,
        b"slabs" => Request::Tuning(slabs(line)?),
        b"lru" => Request::Tuning(lru(line)?),
        b"watch" => Request::Watch(watch(line)?),
        _ => return Err(LineError::unknown()),
    };
    Ok(Head::Complete(request))
}

/// `<cmd> <key> <flags> <exptime> <bytes> [<cas unique>] [noreply]`.
fn parse_storage<'a>(
    command: StorageCommand,
    line: &Line<'a>,
    limits: &ParserLimits,
) -> Result<Head<'a>, LineError> {
    let arguments = if command == StorageCommand::Cas { 5 } else { 4 };
    require_tokens(line, 1 + arguments, 2 + arguments)?;
    let noreply = says_noreply(line);
    let fail = |kind: ErrorKind| LineError::new(kind).noreply(noreply);
    let bad_format = || fail(ErrorKind::BadCommandLineFormat);
    let key = valid_key(line.get(1), limits).ok_or_else(bad_format)?;
    let client_flags = parse_u32(line.get(2)).ok_or_else(bad_format)?;
    let exptime_s = parse_i64(line.get(3)).ok_or_else(bad_format)?;
    let data_len = parse_i64(line.get(4)).ok_or_else(bad_format)?;
    let cas_unique = match command {
        StorageCommand::Cas => Some(parse_u64(line.get(5)).ok_or_else(bad_format)?),
        _ => None,
    };
    let data_len_bytes = data_length(data_len).ok_or_else(bad_format)?;
    if data_len_bytes > limits.item_size_max_bytes {
        return Err(fail(ErrorKind::ObjectTooLarge).swallow(data_len_bytes));
    }
    let storage = Storage {
        command,
        key,
        client_flags,
        exptime_s,
        cas_unique,
        noreply,
        data: &[],
    };
    Ok(Head::NeedsData {
        request: Request::Storage(storage),
        data_len_bytes,
        noreply,
    })
}

/// `incr`/`decr <key> <value> [noreply]`; any extra token is ignored.
fn arithmetic<'a>(
    op: ArithmeticOp,
    line: &Line<'a>,
    limits: &ParserLimits,
) -> Result<Request<'a>, LineError> {
    require_tokens(line, 3, 4)?;
    let noreply = says_noreply(line);
    let fail = |kind: ErrorKind| LineError::new(kind).noreply(noreply);
    let key =
        valid_key(line.get(1), limits).ok_or_else(|| fail(ErrorKind::BadCommandLineFormat))?;
    let delta = parse_u64(line.get(2)).ok_or_else(|| fail(ErrorKind::InvalidDeltaArgument))?;
    Ok(Request::Arithmetic {
        op,
        key,
        delta,
        noreply,
    })
}

/// `delete <key> [0] [noreply]`: the `0` is a relic some clients still send.
fn delete<'a>(line: &Line<'a>, limits: &ParserLimits) -> Result<Request<'a>, LineError> {
    require_tokens(line, 2, 4)?;
    let mut noreply = false;
    if line.count() > 2 {
        let hold_is_zero = line.get(2) == b"0";
        noreply = says_noreply(line);
        let valid = match line.count() {
            3 => hold_is_zero || noreply,
            _ => hold_is_zero && noreply,
        };
        if !valid {
            return Err(LineError::new(ErrorKind::DeleteUsage).noreply(noreply));
        }
    }
    let bad_format = || LineError::new(ErrorKind::BadCommandLineFormat).noreply(noreply);
    let key = valid_key(line.get(1), limits).ok_or_else(bad_format)?;
    Ok(Request::Delete { key, noreply })
}

/// `touch <key> <exptime> [noreply]`.
fn touch<'a>(line: &Line<'a>, limits: &ParserLimits) -> Result<Request<'a>, LineError> {
    require_tokens(line, 3, 4)?;
    let noreply = says_noreply(line);
    let fail = |kind: ErrorKind| LineError::new(kind).noreply(noreply);
    let key =
        valid_key(line.get(1), limits).ok_or_else(|| fail(ErrorKind::BadCommandLineFormat))?;
    let exptime_s = parse_i64(line.get(2)).ok_or_else(|| fail(ErrorKind::InvalidExptime))?;
    Ok(Request::Touch {
        key,
        exptime_s,
        noreply,
    })
}

/// `flush_all [delay] [noreply]`; a third token is ignored.
fn flush_all<'a>(line: &Line<'a>) -> Result<Request<'a>, LineError> {
    require_tokens(line, 1, 3)?;
    let noreply = says_noreply(line);
    let bare = if noreply { 2 } else { 1 };
    let delay_s = if line.count() == bare {
        None
    } else {
        let fail = || LineError::new(ErrorKind::InvalidExptime).noreply(noreply);
        Some(parse_i64(line.get(1)).ok_or_else(fail)?)
    };
    Ok(Request::FlushAll { delay_s, noreply })
}

/// `sync [noreply]`.
fn sync<'a>(line: &Line<'a>) -> Result<Request<'a>, LineError> {
    require_tokens(line, 1, 2)?;
    let noreply = says_noreply(line);
    if line.count() == 2 && !noreply {
        return Err(LineError::new(ErrorKind::BadCommandLineFormat));
    }
    Ok(Request::Sync { noreply })
}

/// `verbosity <level> [noreply]`.
fn verbosity<'a>(line: &Line<'a>) -> Result<Request<'a>, LineError> {
    require_tokens(line, 2, 3)?;
    let noreply = says_noreply(line);
    let fail = || LineError::new(ErrorKind::BadCommandLineFormat).noreply(noreply);
    let level = parse_u32(line.get(1)).ok_or_else(fail)?;
    Ok(Request::Verbosity { level, noreply })
}

/// `cache_memlimit <megabytes> [noreply]`; memcached answers a bad number `ERROR`.
fn cache_memlimit<'a>(line: &Line<'a>) -> Result<Request<'a>, LineError> {
    require_tokens(line, 2, 3)?;
    let noreply = says_noreply(line);
    let fail = || LineError::unknown().noreply(noreply);
    let limit_mb = parse_u32(line.get(1)).ok_or_else(fail)?;
    Ok(Request::CacheMemlimit { limit_mb, noreply })
}

fn shutdown_mode(line: &Line<'_>) -> ShutdownMode {
    match (line.count(), line.get(1)) {
        (1, _) => ShutdownMode::Immediate,
        (2, b"graceful") => ShutdownMode::Graceful,
        _ => ShutdownMode::Invalid,
    }
}

/// memcached's `process_lru_crawler_command`: `crawl`, `metadump`, `mgdump`, `sleep` and `tocrawl`
/// take one argument, `enable` and `disable` none; anything else is `ERROR`.
fn lru_crawler(line: &Line<'_>) -> Result<Request<'static>, LineError> {
    const SLEEP_US_MAX: u64 = 1_000_000;
    let number = || parse_u64(line.get(2)).ok_or_else(|| LineError::new(ErrorKind::BadCommandLineFormat));
    Ok(match (line.count(), line.get(1)) {
        (3, b"metadump") => Request::Metadump(metadump_classes(line.get(2))),
        (3, b"mgdump") => Request::Mgdump(metadump_classes(line.get(2))),
        (3, b"crawl") => Request::LruCrawler(CrawlerCommand::Crawl(metadump_classes(line.get(2)))),
        (3, b"tocrawl") => Request::LruCrawler(CrawlerCommand::ToCrawl(number()? as u32)),
        (3, b"sleep") => match number()? {
            us @ 0..=SLEEP_US_MAX => Request::LruCrawler(CrawlerCommand::Sleep(us as u32)),
            _ => return Err(LineError::new(ErrorKind::CrawlerSleepTooLong)),
        },
        (2, b"enable") => Request::LruCrawler(CrawlerCommand::Enable),
        (2, b"disable") => Request::LruCrawler(CrawlerCommand::Disable),
        _ => return Err(LineError::unknown()),
    })
}

/// `watch [<stream> ...]`, memcached 1.6.18's names; none means `fetchers`; an unknown name
/// is `ERROR`.
fn watch(line: &Line<'_>) -> Result<WatchFlags, LineError> {
    if line.count() == 1 {
        return Ok(WatchFlags::FETCHERS);
    }
    let mut flags = WatchFlags::default();
    for i in 1..line.count() {
        let stream = WatchFlags::NAMES.iter().find(|(name, _)| *name == line.get(i)).ok_or_else(LineError::unknown)?;
        flags = flags.with(stream.1);
    }
    Ok(flags)
}

/// `slabs automove <0|1|2>` and `slabs reassign <src> <dst>`, as memcached 1.6.18 answers
/// them (arguments after those are ignored, as there).
fn slabs(line: &Line<'_>) -> Result<TuningReply, LineError> {
    let bad_format = || LineError::new(ErrorKind::BadCommandLineFormat);
    match (line.count(), line.get(1)) {
        (3.., b"automove") => match parse_u32(line.get(2)).ok_or_else(bad_format)? {
            0..=2 => Ok(TuningReply::Ok),
            _ => Err(LineError::unknown()),
        },
        (4.., b"reassign") => {
            let class = |token: &[u8]| parse_i64(token).ok_or_else(bad_format);
            let (src, dst) = (class(line.get(2))?, class(line.get(3))?);
            let max = i64::from(MetadumpClasses::CLASS_MAX);
            Ok(if (0..=max).contains(&src) && (1..=max).contains(&dst) { TuningReply::NoSpare } else { TuningReply::BadClass })
        }
        _ => Err(LineError::unknown()),
    }
}

/// `lru mode flat|segmented`, `lru tune <hot %> <warm %> <factor> <max age>`, `lru temp_ttl
/// <seconds>`, as memcached 1.6.18 answers them; anything else, and numbers that do not
/// parse, are `ERROR`.
fn lru(line: &Line<'_>) -> Result<TuningReply, LineError> {
    const HOT_WARM_PERCENT_MAX: u64 = 80;
    match (line.count(), line.get(1)) {
        (3, b"mode") if matches!(line.get(2), b"flat" | b"segmented") => Ok(TuningReply::Ok),
        (6, b"tune") => {
            let (hot, warm) = (parse_u32(line.get(2)), parse_u32(line.get(3)));
            let factor = std::str::from_utf8(line.get(4)).ok().and_then(|f| f.parse::<f64>().ok());
            match (hot, warm, factor, parse_u64(line.get(5))) {
                (Some(hot), Some(warm), Some(_), Some(_)) if u64::from(hot) + u64::from(warm) > HOT_WARM_PERCENT_MAX => Ok(TuningReply::HotWarmOver80),
                (Some(_), Some(_), Some(_), Some(_)) => Ok(TuningReply::Ok),
                _ => Err(LineError::unknown()),
            }
        }
        (3, b"temp_ttl") if parse_i64(line.get(2)).is_some() => Ok(TuningReply::Ok),
        _ => Err(LineError::unknown()),
    }
}

/// `all`, `hash`, or class ids 1..=63 separated by commas (empty ones skipped, as
/// memcached's `strtok` does).
fn metadump_classes(spec: &[u8]) -> MetadumpClasses {
    match spec {
        b"all" => return MetadumpClasses::All,
        b"hash" => return MetadumpClasses::Hash,
        _ => {}
    }
    let mut bits = 0u64;
    for id in spec.split(|&b| b == b',').filter(|id| !id.is_empty()) {
        match parse_u32(id) {
            Some(class @ 1..=MetadumpClasses::CLASS_MAX) => bits |= 1 << class,
            _ => return MetadumpClasses::Invalid,
        }
    }
    if bits == 0 { MetadumpClasses::Invalid } else { MetadumpClasses::Classes(bits) }
}

/// memcached's `WANT_TOKENS`: a token count outside the range is `ERROR`.
fn require_tokens(line: &Line<'_>, min: usize, max: usize) -> Result<(), LineError> {
    if (min..=max).contains(&line.count()) {
        Ok(())
    } else {
        Err(LineError::unknown())
    }
}

fn valid_key<'a>(key: &'a [u8], limits: &ParserLimits) -> Option<&'a [u8]> {
    key_is_valid(key, limits.key_length_max()).then_some(key)
}

/// A `<bytes>` field memcached can hold: 0 ..= [`DATA_LENGTH_MAX_BYTES`].
pub(super) fn data_length(value: i64) -> Option<usize> {
    usize::try_from(value)
        .ok()
        .filter(|&len| len <= DATA_LENGTH_MAX_BYTES)
}
