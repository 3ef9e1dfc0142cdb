//! Renders requests back to the wire, as a client would send them (this
//! allocates; the parser does not). [`crate::parse`] of the output yields an
//! equal request.

use crate::encode::{push_i64, push_u64};
use crate::lex::Tokens;
use crate::meta::{ArithmeticOp, MetaFlag, MetaFlags};
use crate::request::{CrawlerCommand, MetadumpClasses, Request, ShutdownMode, Storage, TuningReply, WatchFlags};

const CRLF: &[u8] = b"\r\n";

/// Appends `request` in wire form, data block included. Meta modes are taken
/// from the flags (`M`), which is where the parser found them.
pub fn render_request(out: &mut Vec<u8>, request: &Request<'_>) {
    match request {
        Request::Storage(storage) => render_storage(out, storage),
        Request::Retrieval(retrieval) => {
            out.extend_from_slice(retrieval.command.name());
            if let Some(exptime_s) = retrieval.exptime_s {
                out.push(b' ');
                push_i64(out, exptime_s);
            }
            push_tokens(out, &retrieval.keys);
        }
        Request::Stats { args } => {
            out.extend_from_slice(b"stats");
            push_tokens(out, args);
        }
        Request::MetaGet(get) => meta_line(out, b"mg", get.key, None, &get.flags),
        Request::MetaDelete(delete) => meta_line(out, b"md", delete.key, None, &delete.flags),
        Request::MetaArithmetic(ma) => meta_line(out, b"ma", ma.key, None, &ma.flags),
        Request::MetaSet(set) => {
            meta_line(out, b"ms", set.key, Some(set.data.len()), &set.flags);
            out.extend_from_slice(CRLF);
            out.extend_from_slice(set.data);
        }
        Request::Metadump(classes) => {
            out.extend_from_slice(b"lru_crawler metadump ");
            out.extend_from_slice(&classes_spec(classes));
        }
        Request::Watch(flags) => {
            out.extend_from_slice(b"watch");
            for (name, stream) in WatchFlags::NAMES {
                if flags.contains(stream) {
                    out.push(b' ');
                    out.extend_from_slice(name);
                }
            }
        }
        Request::Mgdump(classes) => {
            out.extend_from_slice(b"lru_crawler mgdump ");
            out.extend_from_slice(&classes_spec(classes));
        }
        Request::LruCrawler(command) => {
            out.extend_from_slice(b"lru_crawler ");
            match command {
                CrawlerCommand::Crawl(classes) => {
                    out.extend_from_slice(b"crawl ");
                    out.extend_from_slice(&classes_spec(classes));
                }
                CrawlerCommand::Enable => out.extend_from_slice(b"enable"),
                CrawlerCommand::Disable => out.extend_from_slice(b"disable"),
                CrawlerCommand::Sleep(us) => {
                    out.extend_from_slice(b"sleep ");
                    push_u64(out, u64::from(*us));
                }
                CrawlerCommand::ToCrawl(items) => {
                    out.extend_from_slice(b"tocrawl ");
                    push_u64(out, u64::from(*items));
                }
            }
        }
        // A request memcached answers with that reply.
        Request::Tuning(reply) => out.extend_from_slice(match reply {
            TuningReply::Ok => b"slabs automove 1",
            TuningReply::NoSpare => b"slabs reassign 1 2",
            TuningReply::BadClass => b"slabs reassign 1 64",
            TuningReply::HotWarmOver80 => b"lru tune 90 25 0.1 2",
        }),
        other => render_simple(out, other),
    }
    out.extend_from_slice(CRLF);
}

/// The classes argument of `lru_crawler metadump` and `crawl`.
fn classes_spec(classes: &MetadumpClasses) -> Vec<u8> {
    match classes {
        MetadumpClasses::All => b"all".to_vec(),
        MetadumpClasses::Hash => b"hash".to_vec(),
        MetadumpClasses::Classes(bits) => (1..=MetadumpClasses::CLASS_MAX)
            .filter(|&c| bits & (1 << c) != 0)
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",")
            .into_bytes(),
        MetadumpClasses::Invalid => b"0".to_vec(),
    }
}

/// Commands that are a name, fixed arguments and maybe `noreply`.
fn render_simple(out: &mut Vec<u8>, request: &Request<'_>) {
    let (name, args, noreply): (&[u8], Vec<Arg<'_>>, bool) = match *request {
        Request::Delete { key, noreply } => (b"delete", vec![Arg::Bytes(key)], noreply),
        Request::Arithmetic {
            op: ArithmeticOp::Incr,
            key,
            delta,
            noreply,
        } => (
            b"incr",
            vec![Arg::Bytes(key), Arg::Unsigned(delta)],
            noreply,
        ),
        Request::Arithmetic {
            op: ArithmeticOp::Decr,
            key,
            delta,
            noreply,
        } => (
            b"decr",
            vec![Arg::Bytes(key), Arg::Unsigned(delta)],
            noreply,
        ),
        Request::Touch {
            key,
            exptime_s,
            noreply,
        } => (
            b"touch",
            vec![Arg::Bytes(key), Arg::Signed(exptime_s)],
            noreply,
        ),
        Request::FlushAll { delay_s, noreply } => (
            b"flush_all",
            delay_s.map(Arg::Signed).into_iter().collect(),
            noreply,
        ),
        Request::Verbosity { level, noreply } => {
            (b"verbosity", vec![Arg::Unsigned(level.into())], noreply)
        }
        Request::CacheMemlimit { limit_mb, noreply } => (
            b"cache_memlimit",
            vec![Arg::Unsigned(limit_mb.into())],
            noreply,
        ),
        Request::Shutdown(ShutdownMode::Immediate) => (b"shutdown", vec![], false),
        Request::Shutdown(ShutdownMode::Graceful) => {
            (b"shutdown", vec![Arg::Bytes(b"graceful")], false)
        }
        Request::Shutdown(ShutdownMode::Invalid) => {
            (b"shutdown", vec![Arg::Bytes(b"invalid")], false)
        }
        Request::Quit => (b"quit", vec![], false),
        Request::RefreshCerts { noreply } => (b"refresh_certs", vec![], noreply),
        Request::MetaNoop => (b"mn", vec![], false),
        Request::MetaDebug {
            key,
            base64_key: true,
        } => (b"me", vec![Arg::Bytes(key), Arg::Bytes(b"b")], false),
        Request::MetaDebug {
            key,
            base64_key: false,
        } => (b"me", vec![Arg::Bytes(key)], false),
        Request::Version => (b"version", vec![], false),
        Request::Sync { noreply } => (b"sync", vec![], noreply),
        Request::Storage(_)
        | Request::Retrieval(_)
        | Request::Stats { .. }
        | Request::Metadump(_)
        | Request::Mgdump(_)
        | Request::Watch(_)
        | Request::LruCrawler(_)
        | Request::Tuning(_)
        | Request::MetaGet(_)
        | Request::MetaSet(_)
        | Request::MetaDelete(_)
        | Request::MetaArithmetic(_) => unreachable!("rendered by render_request"),
    };
    line(out, name, &args, noreply);
}

/// One argument of a classic command line.
enum Arg<'v> {
    Bytes(&'v [u8]),
    Unsigned(u64),
    Signed(i64),
}

fn line(out: &mut Vec<u8>, name: &[u8], args: &[Arg<'_>], noreply: bool) {
    out.extend_from_slice(name);
    for arg in args {
        out.push(b' ');
        match arg {
            Arg::Bytes(bytes) => out.extend_from_slice(bytes),
            Arg::Unsigned(value) => push_u64(out, *value),
            Arg::Signed(value) => push_i64(out, *value),
        }
    }
    if noreply {
        out.extend_from_slice(b" noreply");
    }
}

fn render_storage(out: &mut Vec<u8>, storage: &Storage<'_>) {
    let mut args = [
        Arg::Bytes(storage.key),
        Arg::Unsigned(u64::from(storage.client_flags)),
        Arg::Signed(storage.exptime_s),
        Arg::Unsigned(storage.data.len() as u64),
        Arg::Bytes(b""),
    ];
    let count = match (storage.cas_unique, args.get_mut(4)) {
        (Some(cas), Some(slot)) => {
            *slot = Arg::Unsigned(cas);
            5
        }
        _ => 4,
    };
    line(
        out,
        storage.command.name(),
        args.get(..count).unwrap_or_default(),
        storage.noreply,
    );
    out.extend_from_slice(CRLF);
    out.extend_from_slice(storage.data);
}

fn push_tokens(out: &mut Vec<u8>, tokens: &Tokens<'_>) {
    for token in tokens {
        out.push(b' ');
        out.extend_from_slice(token);
    }
}

fn meta_line(
    out: &mut Vec<u8>,
    name: &[u8],
    key: &[u8],
    data_len: Option<usize>,
    flags: &MetaFlags<'_>,
) {
    out.extend_from_slice(name);
    out.push(b' ');
    out.extend_from_slice(key);
    if let Some(len) = data_len {
        out.push(b' ');
        push_u64(out, len as u64);
    }
    for flag in flags.iter() {
        out.push(b' ');
        out.push(flag.as_byte());
        flag_token(out, flag, flags);
    }
}

/// The token after a flag character, from the flag's parsed value. `P` and
/// `L` tokens are not kept, so they render bare.
fn flag_token(out: &mut Vec<u8>, flag: MetaFlag, flags: &MetaFlags<'_>) {
    let unsigned = match flag {
        MetaFlag::ClientFlags => flags.client_flags().map(u64::from),
        MetaFlag::CompareCas => flags.compare_cas(),
        MetaFlag::NewCas => flags.new_cas(),
        MetaFlag::Initial => flags.initial(),
        MetaFlag::Delta => flags.delta(),
        _ => None,
    };
    let signed = match flag {
        MetaFlag::Ttl => flags.ttl_s(),
        MetaFlag::Vivify => flags.vivify_ttl_s(),
        MetaFlag::Recache => flags.recache_ttl_s(),
        _ => None,
    };
    if let Some(value) = unsigned {
        push_u64(out, value);
    } else if let Some(value) = signed {
        push_i64(out, value);
    } else if flag == MetaFlag::Opaque {
        out.extend_from_slice(flags.opaque().unwrap_or_default());
    } else if let (MetaFlag::Mode, Some(mode)) = (flag, flags.mode()) {
        out.push(mode);
    }
}
