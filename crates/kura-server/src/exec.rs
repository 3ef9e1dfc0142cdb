//! Executing parsed requests: the memcached semantics of each command, with
//! replies encoded by `kura_proto::encode`.
//!
//! Retrievals (`get`, `gets`, plain `mg`) are split-phase: a RAM cache hit or
//! a write-buffer hit answers at once; otherwise the lookup's first flash read
//! is queued and the reply's place is held in the connection's output until
//! the worker finishes the lookup ([`finish_lookup`]). Everything else runs
//! synchronously against the [`Store`].

use std::sync::atomic::{AtomicU64, Ordering};

use kura_engine::{GetPlan, GetStep};
use kura_proto::encode::{
    self, MetaCode, MetaCommand, MetaDebugInfo, MetaItem, Reply, quiet_suppresses,
};
use kura_proto::{
    ErrorKind, KEY_LENGTH_MAX, WatchFlags, MetaArithmetic, MetaFlag, MetaFlags, MetaRequest, MetaSet, MetadumpClasses,
    Parsed, ParserLimits, Request, Retrieval, SetMode, ShutdownMode, Storage, StorageCommand,
};

use crate::cache::Probe;
use crate::clock;
use crate::detail::DetailOp;
use crate::metadump::DumpFormat;
use crate::output::{Body, Output, Response, Seq};
use crate::record::RecordView;
use crate::stats::{StatValue, StatsSources, WorkerStats};
use crate::store::{
    ArithOutcome, ArithRequest, DeleteMode, DeleteOutcome, Found, Holder, MetaGetOptions, Store,
    StoreError, StoreMode, StoreOutcome, StoreRequest,
};
use crate::uring::ReadQueue;

/// memcached's answer to `shutdown` when it was not enabled with `-A`.
const SHUTDOWN_DISABLED: &[u8] = b"ERROR: shutdown not enabled\r\n";
const SHUTDOWN_INVALID: &[u8] = b"CLIENT_ERROR invalid shutdown mode\r\n";
/// `cache_memlimit` below this many MiB is refused (memcached's floor).
const CACHE_MEMLIMIT_MB_MIN: u32 = 8;

pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What a pending lookup answers.
pub enum LookupKind {
    /// `get` (`cas: false`) or `gets`.
    Get { cas: bool },
    /// `mg`; the request line is kept to render the reply's flags.
    Meta { line: Box<[u8]> },
}

/// A lookup waiting for a flash read.
pub struct Lookup {
    pub conn: usize,
    pub conn_gen: u64,
    pub seq: Seq,
    pub plan: GetPlan,
    pub key: Box<[u8]>,
    pub kind: LookupKind,
    /// The RAM cache's epoch at the miss (see `cache`).
    pub epoch: u64,
}

/// A worker's lookups in flight, addressed by the read queue's tokens.
#[derive(Default)]
pub struct Lookups {
    slots: Vec<Option<Lookup>>,
    free: Vec<usize>,
}

impl Lookups {
    pub fn insert(&mut self, lookup: Lookup) -> u64 {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[index] = Some(lookup);
        index as u64
    }

    pub fn get_mut(&mut self, token: u64) -> Option<&mut Lookup> {
        self.slots.get_mut(token as usize)?.as_mut()
    }

    pub fn remove(&mut self, token: u64) -> Option<Lookup> {
        let lookup = self.slots.get_mut(token as usize)?.take()?;
        self.free.push(token as usize);
        Some(lookup)
    }

    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What executing a request asks of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Close once the replies queued so far are sent.
    Close,
}

/// Everything a request may touch.
pub struct Ctx<'a> {
    pub store: &'a Store,
    pub sources: &'a StatsSources,
    pub stats: &'a WorkerStats,
    pub lookups: &'a mut Lookups,
    pub reads: &'a mut ReadQueue,
    pub conn: usize,
    pub conn_gen: u64,
    /// The connection's socket (how `stats conns` names it).
    pub conn_fd: i32,
    pub out: &'a mut Output,
    /// Set when the request wrote (for `--sync always`).
    pub wrote: &'a mut bool,
    /// Set by `sync`: make every acknowledged write durable before this turn's replies leave.
    pub sync_requested: &'a mut bool,
    /// Set by `lru_crawler metadump` and `mgdump` (the worker starts the dump and reads no
    /// further request of the connection until it has sent it) and by `watch` (the
    /// connection becomes a watcher).
    pub handover: &'a mut Option<Handover>,
}

/// What a request hands over to the connection's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// `lru_crawler metadump|mgdump`.
    Dump(MetadumpClasses, DumpFormat),
    /// `watch`.
    Watch(kura_proto::WatchFlags),
}

/// Whether a request must wait for the connection's pending reads: it writes,
/// so running it before an earlier read finishes could let that read see it.
pub fn needs_barrier(request: &Request<'_>) -> bool {
    match request {
        Request::Retrieval(r) => r.command.touches(),
        Request::MetaGet(m) => meta_get_writes(&m.flags),
        Request::Storage(_)
        | Request::Delete { .. }
        | Request::Arithmetic { .. }
        | Request::Touch { .. }
        | Request::FlushAll { .. }
        | Request::MetaSet(_)
        | Request::MetaDelete(_)
        | Request::MetaArithmetic(_) => true,
        _ => false,
    }
}

fn meta_get_writes(flags: &MetaFlags<'_>) -> bool {
    flags.ttl_s().is_some() || flags.vivify_ttl_s().is_some() || flags.recache_ttl_s().is_some()
}

/// Runs one request. `raw` is the request's bytes on the wire.
pub fn execute(ctx: &mut Ctx<'_>, request: Request<'_>, raw: &[u8]) -> Flow {
    match request {
        Request::Storage(s) => storage(ctx, &s),
        Request::Retrieval(r) => retrieval(ctx, &r),
        Request::Delete { key, noreply } => delete(ctx, key, noreply),
        Request::Arithmetic {
            op,
            key,
            delta,
            noreply,
        } => {
            let req = ArithRequest {
                key,
                op,
                delta,
                compare_cas: 0,
                new_cas: None,
                vivify: None,
                exptime_s: None,
            };
            arithmetic(ctx, &req, noreply);
        }
        Request::Touch {
            key,
            exptime_s,
            noreply,
        } => touch(ctx, key, exptime_s, noreply),
        Request::FlushAll { delay_s, noreply } => {
            // Counted even when refused, as memcached does.
            bump(&ctx.stats.cmd_flush);
            if !ctx.sources.info.allowed.flush_all {
                if !noreply {
                    ctx.out.push_bytes(b"CLIENT_ERROR flush_all not allowed\r\n");
                }
                return Flow::Continue;
            }
            match ctx.store.flush_all(delay_s) {
                Ok(()) => reply(ctx, Reply::Ok, noreply),
                Err(error) => server_error(ctx, &error, noreply),
            }
            *ctx.wrote = true;
        }
        Request::Version => ctx
            .out
            .push_with(|out| encode::version(out, crate::stats::VERSION.as_bytes())),
        Request::Sync { noreply } => {
            *ctx.sync_requested = true;
            reply(ctx, Reply::Ok, noreply);
        }
        Request::Verbosity { noreply, .. } => reply(ctx, Reply::Ok, noreply),
        Request::Quit => return Flow::Close,
        // memcached's replies: a failure is answered even with noreply.
        Request::RefreshCerts { noreply } => match ctx.sources.tls.as_ref().map(|tls| tls.refresh()) {
            None => ctx.out.push_bytes(b"Error TLS not enabled\r\n"),
            Some(Ok(())) => reply(ctx, Reply::Ok, noreply),
            Some(Err(error)) => {
                tracing::warn!(%error, "refresh_certs failed; the certificate loaded before stays in use");
                // One line, whatever the message holds (a path may hold a line break).
                ctx.out.push_with(|out| {
                    out.extend(error.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
                    out.extend_from_slice(b"\r\n");
                });
            }
        },
        Request::Stats { args } => stats(ctx, &args),
        // kura has no slab allocator or LRU segments to tune: memcached's answer.
        Request::Tuning(reply) => ctx.out.push_bytes(reply.line()),
        Request::Shutdown(_) if !ctx.sources.info.allowed.shutdown => ctx.out.push_bytes(SHUTDOWN_DISABLED),
        Request::Shutdown(ShutdownMode::Invalid) => ctx.out.push_bytes(SHUTDOWN_INVALID),
        // memcached closes the connection without a reply and stops (graceful or not); kura
        // always stops as at SIGTERM: in-flight replies sent, the store synced.
        Request::Shutdown(_) => {
            ctx.sources.stop_requested.store(true, std::sync::atomic::Ordering::Release);
            return Flow::Close;
        }
        Request::Metadump(_) if !ctx.sources.info.allowed.dumping => ctx.out.push_bytes(b"ERROR metadump not allowed\r\n"),
        Request::Mgdump(_) if !ctx.sources.info.allowed.dumping => ctx.out.push_bytes(b"ERROR mgdump not allowed\r\n"),
        Request::Watch(_) if !ctx.sources.info.allowed.watch => ctx.out.push_bytes(b"CLIENT_ERROR watch commands not allowed\r\n"),
        Request::Metadump(_) | Request::Mgdump(_) if !ctx.sources.crawler.enabled() => ctx.out.push_bytes(crate::crawler::DISABLED_REPLY),
        Request::Metadump(MetadumpClasses::Invalid) | Request::Mgdump(MetadumpClasses::Invalid) => ctx.out.push_bytes(crate::metadump::BADCLASS_REPLY),
        Request::LruCrawler(command) => {
            let reply = ctx.sources.crawler.command(command);
            ctx.out.push_bytes(reply);
        }
        Request::Metadump(classes) => *ctx.handover = Some(Handover::Dump(classes, DumpFormat::Metadump)),
        Request::Mgdump(classes) => *ctx.handover = Some(Handover::Dump(classes, DumpFormat::Mg)),
        Request::Watch(flags) => *ctx.handover = Some(Handover::Watch(flags)),
        Request::CacheMemlimit { limit_mb, noreply } => {
            if limit_mb < CACHE_MEMLIMIT_MB_MIN {
                ctx.out
                    .push_bytes(b"MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m\r\n");
            } else {
                ctx.store.set_cache_limit(u64::from(limit_mb) << 20);
                reply(ctx, Reply::Ok, noreply);
            }
        }
        Request::MetaGet(m) => meta_get(ctx, &m, raw),
        Request::MetaSet(m) => meta_set(ctx, &m),
        Request::MetaDelete(m) => meta_delete(ctx, &m),
        Request::MetaArithmetic(m) => meta_arithmetic(ctx, &m),
        Request::MetaNoop => ctx.out.push_bytes(Reply::MetaNoop.as_bytes()),
        Request::MetaDebug { key, base64_key } => meta_debug(ctx, key, base64_key),
    }
    Flow::Continue
}

fn reply(ctx: &mut Ctx<'_>, reply: Reply, noreply: bool) {
    if !noreply {
        ctx.out.push_bytes(reply.as_bytes());
    }
}

fn server_error(ctx: &mut Ctx<'_>, error: &StoreError, noreply: bool) {
    bump(&ctx.stats.server_errors);
    match error {
        StoreError::TooLarge | StoreError::Engine(kura_engine::Error::ValueTooLarge { .. }) => bump(&ctx.stats.store_too_large),
        StoreError::OutOfMemory | StoreError::Engine(kura_engine::Error::StoreFull { .. }) => bump(&ctx.stats.store_no_memory),
        _ => {}
    }
    let full = matches!(error, StoreError::Engine(kura_engine::Error::StoreFull { .. }));
    if full {
        // Expired items may be what fills it.
        ctx.sources.crawler.store_full();
    }
    // A full store (store mode) is the client's answer, not the server's trouble.
    if !full && !matches!(error, StoreError::TooLarge | StoreError::OutOfMemory) {
        tracing::warn!(%error, "command failed");
    }
    if !noreply {
        let text = error.server_error_text();
        ctx.out
            .push_with(|out| encode::server_error(out, text.as_bytes()));
    }
}

// ---- classic storage ----

fn storage(ctx: &mut Ctx<'_>, s: &Storage<'_>) {
    bump(&ctx.stats.cmd_set);
    let mode = match s.command {
        StorageCommand::Set => StoreMode::Set,
        StorageCommand::Add => StoreMode::Add,
        StorageCommand::Replace => StoreMode::Replace,
        StorageCommand::Append => StoreMode::Append,
        StorageCommand::Prepend => StoreMode::Prepend,
        StorageCommand::Cas => StoreMode::Cas,
    };
    let req = StoreRequest {
        client_flags: s.client_flags,
        exptime_s: s.exptime_s,
        compare_cas: s.cas_unique.unwrap_or(0),
        ..StoreRequest::new(mode, s.key, s.data)
    };
    *ctx.wrote = true;
    ctx.sources.detail.record(s.key, DetailOp::Set);
    let stored = ctx.store.store(&req);
    log_store(ctx, &req, &stored);
    match stored {
        Ok(outcome) => {
            count_cas(ctx, mode, &outcome);
            let r = match outcome {
                StoreOutcome::Stored { .. } => Reply::Stored,
                StoreOutcome::NotStored => Reply::NotStored,
                StoreOutcome::Exists => Reply::Exists,
                StoreOutcome::NotFound => Reply::NotFound,
            };
            reply(ctx, r, s.noreply);
        }
        Err(error) => server_error(ctx, &error, s.noreply),
    }
}

/// `watch fetchers`: a lookup's line (`found`: the item, if it was).
fn log_fetch(ctx: &Ctx<'_>, key: &[u8], found: Option<&Found>) {
    let watchers = &ctx.sources.watchers;
    if watchers.wants(WatchFlags::FETCHERS) {
        watchers.item_get(ctx.store.slab_classes(), key, found.map(|f| (f.meta().client_flags, f.view.data_len())), ctx.conn_fd);
    }
}

/// `watch mutations`: a store's line, as memcached's (`cmd` the storage mode; `ttl` the
/// seconds the item has to live, 0 when it does not expire).
fn log_store(ctx: &Ctx<'_>, req: &StoreRequest<'_>, stored: &Result<StoreOutcome, StoreError>) {
    let watchers = &ctx.sources.watchers;
    if !watchers.wants(WatchFlags::MUTATIONS) {
        return;
    }
    let Ok(outcome) = stored else { return };
    let status = match outcome {
        StoreOutcome::Stored { .. } => "stored",
        StoreOutcome::NotStored => "not_stored",
        StoreOutcome::Exists => "exists",
        StoreOutcome::NotFound => "not_found",
    };
    let cmd = match req.mode {
        StoreMode::Set => "set",
        StoreMode::Add => "add",
        StoreMode::Replace => "replace",
        StoreMode::Append => "append",
        StoreMode::Prepend => "prepend",
        StoreMode::Cas => "cas",
    };
    let now_s = clock::unix_now_s();
    let ttl_s = match clock::expire_at_s(req.exptime_s, now_s) {
        0 => 0,
        at => (at - now_s).max(-1),
    };
    watchers.item_store(ctx.store.slab_classes(), &crate::watch::StoreLine { key: req.key, status, cmd, ttl_s, client_flags: req.client_flags, size_bytes: req.data.len(), cfd: ctx.conn_fd });
}

fn count_cas(ctx: &mut Ctx<'_>, mode: StoreMode, outcome: &StoreOutcome) {
    if mode != StoreMode::Cas {
        return;
    }
    match outcome {
        StoreOutcome::Stored { .. } => bump(&ctx.stats.cas_hits),
        StoreOutcome::Exists => bump(&ctx.stats.cas_badval),
        StoreOutcome::NotFound => bump(&ctx.stats.cas_misses),
        StoreOutcome::NotStored => {}
    }
}

// ---- retrieval ----

fn retrieval(ctx: &mut Ctx<'_>, r: &Retrieval<'_>) {
    let cas = r.command.returns_cas();
    if let Some(exptime_s) = r.exptime_s {
        for key in r.keys.iter() {
            get_and_touch(ctx, key, exptime_s, cas);
        }
    } else {
        for key in r.keys.iter() {
            start_get(ctx, key, LookupKind::Get { cas });
        }
    }
    ctx.out.push_bytes(Reply::End.as_bytes());
}

fn get_and_touch(ctx: &mut Ctx<'_>, key: &[u8], exptime_s: i64, cas: bool) {
    bump(&ctx.stats.cmd_touch);
    *ctx.wrote = true;
    let touched = ctx.store.touch(key, exptime_s);
    if let Ok(found) = &touched {
        log_fetch(ctx, key, found.as_ref());
        ctx.sources.detail.record(key, DetailOp::Get { hit: found.is_some() });
    }
    match touched {
        Ok(Some(found)) => {
            bump(&ctx.stats.touch_hits);
            ctx.out.push_response(value_response(found, cas));
        }
        Ok(None) => bump(&ctx.stats.touch_misses),
        Err(error) => server_error(ctx, &error, false),
    }
}

/// The `VALUE` response for a hit: the record's ready bytes for `get` (no
/// copy), or a generated header with the CAS value before the record's data
/// for `gets`.
pub fn value_response(found: Found, cas: bool) -> Response {
    let view = found.view;
    let (head, start) = if cas {
        let mut head = Vec::with_capacity(64);
        let key = view.key(found.bytes());
        encode::value_header(
            &mut head,
            key,
            view.meta.client_flags,
            view.data_len(),
            Some(found.cas()),
        );
        (head, view.data_start())
    } else {
        (Vec::new(), view.response_start())
    };
    Response {
        head,
        body: into_body(found, start, view.end()),
    }
}

/// Moves a found record into a response body without copying.
fn into_body(found: Found, start: usize, end: usize) -> Body {
    match found.holder {
        Holder::Cached(record) => Body::Cached { record, start, end },
        Holder::Flash(item) => Body::Flash { item, start, end },
    }
}

/// Starts a split-phase lookup: answers at once from RAM, or queues a flash read.
fn start_get(ctx: &mut Ctx<'_>, key: &[u8], kind: LookupKind) {
    bump(&ctx.stats.cmd_get);
    let epoch = match ctx.store.probe(key) {
        Probe::Hit(record) => {
            bump(&ctx.stats.ram_cache_hits);
            record.touch(clock::unix_now_s());
            let found = ctx.store.found_from_cache(record);
            let response = render_lookup(ctx, key, &kind, found);
            ctx.out.push_response(response);
            return;
        }
        Probe::Miss { epoch } => epoch,
    };
    match ctx.store.engine().get_start(key) {
        Ok((_, GetStep::Done(item))) => {
            let found = match item
                .map(|item| ctx.store.found_from_flash(item))
                .transpose()
            {
                Ok(found) => found.flatten(),
                Err(error) => return server_error(ctx, &error, false),
            };
            let response = render_lookup(ctx, key, &kind, found);
            ctx.out.push_response(response);
        }
        Ok((
            plan,
            GetStep::Read {
                offset_bytes,
                len_bytes,
            },
        )) => {
            bump(&ctx.stats.flash_gets);
            let seq = ctx.out.push_pending();
            let lookup = Lookup {
                conn: ctx.conn,
                conn_gen: ctx.conn_gen,
                seq,
                plan,
                key: key.into(),
                kind,
                epoch,
            };
            let token = ctx.lookups.insert(lookup);
            ctx.reads.push(offset_bytes, len_bytes, token);
        }
        Err(error) => server_error(ctx, &StoreError::Engine(error), false),
    }
}

/// Renders a finished lookup; counts hits and misses.
fn render_lookup(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: &LookupKind,
    found: Option<Found>,
) -> Response {
    match found {
        Some(_) => bump(&ctx.stats.get_hits),
        None => bump(&ctx.stats.get_misses),
    }
    log_fetch(ctx, key, found.as_ref());
    match kind {
        LookupKind::Get { cas } => {
            ctx.sources.detail.record(key, DetailOp::Get { hit: found.is_some() });
            found.map_or_else(Response::empty, |found| value_response(found, *cas))
        }
        LookupKind::Meta { line } => {
            let limits = ParserLimits::default();
            let Ok(Parsed::Complete {
                request: Request::MetaGet(m),
                ..
            }) = kura_proto::parse(line, &limits)
            else {
                unreachable!("a kept mg line parses as it did")
            };
            let mut response = Response::empty();
            meta_get_reply(ctx, &mut response, &m.flags, key, found.map(MetaHit::plain));
            response
        }
    }
}

/// Completes a lookup whose read finished: continue it, or render its reply.
/// Returns the lookup when it needs another read (the caller re-queues it).
pub fn finish_lookup(
    ctx: &mut Ctx<'_>,
    mut lookup: Lookup,
    read: std::io::Result<kura_engine::AlignedBuf>,
) -> Option<(Lookup, u64, usize)> {
    let step = read
        .map_err(|e| {
            StoreError::Engine(kura_engine::Error::Io {
                op: "read",
                offset_bytes: 0,
                source: e,
            })
        })
        .and_then(|buf| {
            ctx.store
                .engine()
                .get_continue(&mut lookup.plan, buf)
                .map_err(StoreError::Engine)
        });
    let item = match step {
        Ok(GetStep::Read {
            offset_bytes,
            len_bytes,
        }) => return Some((lookup, offset_bytes, len_bytes)),
        Ok(GetStep::Done(item)) => item,
        Err(error) => {
            bump(&ctx.stats.server_errors);
            tracing::warn!(%error, "flash lookup failed");
            let mut response = Response::empty();
            encode::server_error(&mut response.head, error.server_error_text().as_bytes());
            ctx.out.complete(lookup.seq, response);
            return None;
        }
    };
    bump(&ctx.stats.flash_reads);
    let found = match item
        .map(|item| ctx.store.found_from_flash(item))
        .transpose()
    {
        Ok(found) => found.flatten(),
        Err(error) => {
            let mut response = Response::empty();
            bump(&ctx.stats.server_errors);
            encode::server_error(&mut response.head, error.server_error_text().as_bytes());
            ctx.out.complete(lookup.seq, response);
            return None;
        }
    };
    if let Some(found) = &found {
        ctx.store.admit(found, lookup.epoch);
    }
    let response = render_lookup(ctx, &lookup.key, &lookup.kind, found);
    ctx.out.complete(lookup.seq, response);
    None
}

// ---- delete, arithmetic, touch ----

fn delete(ctx: &mut Ctx<'_>, key: &[u8], noreply: bool) {
    *ctx.wrote = true;
    ctx.sources.detail.record(key, DetailOp::Delete);
    match ctx.store.delete(key, None, None, DeleteMode::Remove) {
        Ok(DeleteOutcome::Deleted) => {
            bump(&ctx.stats.delete_hits);
            reply(ctx, Reply::Deleted, noreply);
        }
        Ok(_) => {
            bump(&ctx.stats.delete_misses);
            reply(ctx, Reply::NotFound, noreply);
        }
        Err(error) => server_error(ctx, &error, noreply),
    }
}

const NON_NUMERIC: &[u8] = b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n";

fn arithmetic(ctx: &mut Ctx<'_>, req: &ArithRequest<'_>, noreply: bool) {
    *ctx.wrote = true;
    let incr = req.op == kura_proto::ArithmeticOp::Incr;
    match ctx.store.arith(req) {
        Ok(ArithOutcome::Value { value, .. }) => {
            bump(if incr {
                &ctx.stats.incr_hits
            } else {
                &ctx.stats.decr_hits
            });
            if !noreply {
                ctx.out.push_with(|out| encode::number(out, value));
            }
        }
        Ok(ArithOutcome::NotFound) => {
            bump(if incr {
                &ctx.stats.incr_misses
            } else {
                &ctx.stats.decr_misses
            });
            reply(ctx, Reply::NotFound, noreply);
        }
        Ok(ArithOutcome::NonNumeric) => {
            if !noreply {
                ctx.out.push_bytes(NON_NUMERIC);
            }
        }
        Ok(ArithOutcome::Exists) => reply(ctx, Reply::Exists, noreply),
        Err(error) => server_error(ctx, &error, noreply),
    }
}

fn touch(ctx: &mut Ctx<'_>, key: &[u8], exptime_s: i64, noreply: bool) {
    bump(&ctx.stats.cmd_touch);
    *ctx.wrote = true;
    match ctx.store.touch(key, exptime_s) {
        Ok(Some(_)) => {
            bump(&ctx.stats.touch_hits);
            reply(ctx, Reply::Touched, noreply);
        }
        Ok(None) => {
            bump(&ctx.stats.touch_misses);
            reply(ctx, Reply::NotFound, noreply);
        }
        Err(error) => server_error(ctx, &error, noreply),
    }
}

// ---- stats ----

fn stats(ctx: &mut Ctx<'_>, args: &kura_proto::Tokens<'_>) {
    let mut words = args.iter();
    let lines = match words.next() {
        None => ctx.sources.general(),
        Some(b"settings") => ctx.sources.settings(),
        // kura's: the instance and the change counter's file (kura_engine::changes), what a
        // client keeping copies of records asks for when it connects.
        Some(b"changes") => ctx.sources.changes(),
        Some(b"reset") if args.len() == 1 => {
            ctx.sources.reset();
            ctx.out.push_bytes(Reply::Reset.as_bytes());
            return;
        }
        // memcached's slab and item groups describe its slab allocator; kura has none (what
        // memcached with no slabs in use says).
        Some(b"slabs") => vec![("active_slabs", StatValue::U64(0)), ("total_malloced", StatValue::U64(0))],
        Some(b"sizes") => vec![("sizes_status", StatValue::Text("disabled".to_owned()))],
        Some(b"items") => Vec::new(),
        Some(b"conns") => {
            let now_s = ctx.sources.info.uptime_s_at(std::time::Instant::now());
            let lines = ctx.sources.conns.registry.lines(ctx.conn_fd, now_s);
            ctx.out.push_with(|out| {
                for (name, value) in &lines {
                    encode::stat(out, name.as_bytes(), value.as_bytes());
                }
                encode::reply(out, Reply::End);
            });
            return;
        }
        // Per-prefix statistics (`crate::detail`).
        Some(b"detail") => {
            let detail = &ctx.sources.detail;
            match words.next() {
                Some(b"on") => detail.set_enabled(true),
                Some(b"off") => detail.set_enabled(false),
                Some(b"dump") => {
                    let dump = detail.dump();
                    ctx.out.push_with(|out| out.extend_from_slice(&dump));
                    return;
                }
                _ => {
                    ctx.out.push_bytes(b"CLIENT_ERROR usage: stats detail on|off|dump\r\n");
                    return;
                }
            }
            ctx.out.push_bytes(b"OK\r\n");
            return;
        }
        Some(_) => {
            ctx.out.push_bytes(Reply::Error.as_bytes());
            return;
        }
    };
    ctx.out.push_with(|out| {
        for (name, value) in &lines {
            match value {
                StatValue::U64(v) => encode::stat_u64(out, name.as_bytes(), *v),
                StatValue::Text(t) => encode::stat(out, name.as_bytes(), t.as_bytes()),
            }
        }
        encode::reply(out, Reply::End);
    });
}

// ---- meta commands ----

/// Decodes a meta key (base64 with `b`); `None` after replying with the error.
fn meta_key<'k>(
    ctx: &mut Ctx<'_>,
    raw: &'k [u8],
    base64: bool,
    buf: &'k mut [u8; KEY_LENGTH_MAX],
) -> Option<&'k [u8]> {
    match kura_proto::meta_key(raw, base64, buf) {
        Ok(key) if !key.is_empty() => Some(key),
        _ => {
            bump(&ctx.stats.protocol_errors);
            ctx.out.push_bytes(b"CLIENT_ERROR error decoding key\r\n");
            None
        }
    }
}

/// What an `mg` reply reports about a hit.
pub struct MetaHit {
    found: Found,
    win_sent: bool,
    won: bool,
    hit_before: bool,
    last_access_s: u64,
    /// The exptime the `t` flag reports (see [`ttl_at_t`]).
    ttl_expire_at_s: i64,
}

impl MetaHit {
    fn plain(found: Found) -> Self {
        let (hit_before, last_access_s) = found.access(clock::unix_now_s());
        let meta = found.view.meta;
        Self {
            found,
            win_sent: meta.token_sent,
            won: false,
            hit_before,
            last_access_s,
            ttl_expire_at_s: meta.expire_at_s,
        }
    }
}

/// The TTL an item created by `N` ends with. memcached walks the flags in
/// request order, and on a created item both `T` and `N` set the TTL, so the
/// later one wins: `mg k T100 N30` creates an item that lives 30 s, `mg k N30
/// T0` one that never expires.
fn created_ttl_s(flags: &MetaFlags<'_>) -> Option<i64> {
    let vivify_s = flags.vivify_ttl_s()?;
    let last = flags
        .iter()
        .filter(|f| matches!(f, MetaFlag::Ttl | MetaFlag::Vivify))
        .last();
    Some(match (last, flags.ttl_s()) {
        (Some(MetaFlag::Ttl), Some(ttl_s)) => ttl_s,
        _ => vivify_s,
    })
}

/// The exptime each of `T` and `N` sets as memcached walks the flags, for
/// [`ttl_at_t`]: on a hit `T` sets the item's new exptime and `N` nothing; on
/// an item this request created (which starts with no expiry) each sets its own.
fn ttl_updates(
    flags: &MetaFlags<'_>,
    created: bool,
    new_expire_at_s: i64,
    now_s: i64,
) -> [(MetaFlag, Option<i64>); 2] {
    if created {
        let at = |ttl_s: Option<i64>| ttl_s.map(|t| clock::expire_at_s(t, now_s));
        [
            (MetaFlag::Ttl, at(flags.ttl_s())),
            (MetaFlag::Vivify, at(flags.vivify_ttl_s())),
        ]
    } else {
        [
            (MetaFlag::Ttl, flags.ttl_s().map(|_| new_expire_at_s)),
            (MetaFlag::Vivify, None),
        ]
    }
}

/// The exptime memcached reports for `t`: it walks the flags in request
/// order, so a `T` (or a vivifying `N`) after `t` is not yet applied.
fn ttl_at_t(flags: &MetaFlags<'_>, before: i64, updates: &[(MetaFlag, Option<i64>)]) -> i64 {
    let mut expire = before;
    for flag in flags.iter() {
        if flag == MetaFlag::ReturnTtl {
            return expire;
        }
        if let Some((_, Some(new))) = updates.iter().find(|(f, _)| *f == flag) {
            expire = *new;
        }
    }
    expire
}

/// With `-C`, memcached refuses a meta request's `E` (the new item's CAS value): `mg` and `ms`
/// with "invalid flag", `md` and `ma` with "invalid or duplicate flag".
fn new_cas_refused(ctx: &mut Ctx<'_>, flags: &MetaFlags<'_>, error: ErrorKind) -> bool {
    if ctx.store.cas_enabled() || flags.new_cas().is_none() {
        return false;
    }
    ctx.out.push_with(|out| encode::error(out, error));
    true
}

fn meta_get(ctx: &mut Ctx<'_>, m: &MetaRequest<'_>, raw: &[u8]) {
    if new_cas_refused(ctx, &m.flags, ErrorKind::InvalidFlag) {
        return;
    }
    let mut buf = [0u8; KEY_LENGTH_MAX];
    let Some(key) = meta_key(ctx, m.key, m.flags.base64_key(), &mut buf) else {
        return;
    };
    if !meta_get_writes(&m.flags) {
        // A stale item's first reader wins it, which writes; finish_lookup cannot, so
        // such hits are redone below on the write path (rare: only after `md I`).
        let line: Box<[u8]> = raw.into();
        start_get(ctx, key, LookupKind::Meta { line });
        return;
    }
    bump(&ctx.stats.cmd_get);
    *ctx.wrote = true;
    let now_s = clock::unix_now_s();
    let options = MetaGetOptions {
        exptime_s: m.flags.ttl_s(),
        vivify_exptime_s: created_ttl_s(&m.flags),
        recache_exptime_s: m.flags.recache_ttl_s(),
        no_update: m.flags.contains(MetaFlag::NoLruBump),
    };
    let result = match ctx.store.meta_get(key, &options) {
        Ok(result) => result,
        Err(error) => return server_error(ctx, &error, false),
    };
    let hit = result.map(|r| {
        let new_expire = r.found.view.meta.expire_at_s;
        let updates = ttl_updates(&m.flags, r.created, new_expire, now_s);
        let ttl_expire_at_s = ttl_at_t(&m.flags, r.old_expire_at_s, &updates);
        MetaHit {
            found: r.found,
            win_sent: r.win_sent,
            won: r.won,
            hit_before: r.hit_before,
            last_access_s: r.last_access_s,
            ttl_expire_at_s,
        }
    });
    let mut response = Response::empty();
    meta_get_reply(ctx, &mut response, &m.flags, key, hit);
    ctx.out.push_response(response);
}

/// Renders an `mg` reply into `response`; a plain hit on a stale item that
/// nobody won yet goes through the write path first.
fn meta_get_reply(
    ctx: &mut Ctx<'_>,
    response: &mut Response,
    flags: &MetaFlags<'_>,
    key: &[u8],
    hit: Option<MetaHit>,
) {
    let hit = match hit {
        Some(h) if h.found.view.meta.stale && !h.found.view.meta.token_sent && !h.won => {
            *ctx.wrote = true;
            match ctx.store.meta_get(
                key,
                &MetaGetOptions {
                    no_update: flags.contains(MetaFlag::NoLruBump),
                    ..MetaGetOptions::default()
                },
            ) {
                Ok(r) => r.map(|r| MetaHit {
                    ttl_expire_at_s: r.found.view.meta.expire_at_s,
                    found: r.found,
                    win_sent: r.win_sent,
                    won: r.won,
                    hit_before: r.hit_before,
                    last_access_s: r.last_access_s,
                }),
                Err(error) => {
                    bump(&ctx.stats.server_errors);
                    encode::server_error(&mut response.head, error.server_error_text().as_bytes());
                    return;
                }
            }
        }
        other => other,
    };
    let Some(hit) = hit else {
        if !(flags.quiet() && quiet_suppresses(MetaCommand::Get, MetaCode::En)) {
            encode::meta_header(
                &mut response.head,
                MetaCode::En,
                flags,
                &MetaItem::miss(key),
            );
        }
        return;
    };
    let now_s = clock::unix_now_s();
    let view: RecordView = hit.found.view;
    let item = MetaItem {
        key,
        cas: Some(hit.found.cas()),
        client_flags: Some(view.meta.client_flags),
        hit_before: Some(hit.hit_before),
        last_access_s: Some(hit.last_access_s),
        size_bytes: Some(view.data_len() as u64),
        ttl_s: Some(clock::ttl_s(hit.ttl_expire_at_s, now_s)),
        win_sent: hit.win_sent,
        stale: view.meta.stale,
        won: hit.won,
    };
    if flags.return_value() {
        encode::meta_header(
            &mut response.head,
            MetaCode::Va {
                data_len_bytes: view.data_len(),
            },
            flags,
            &item,
        );
        response.body = into_body(hit.found, view.data_start(), view.end());
    } else {
        encode::meta_header(&mut response.head, MetaCode::Hd, flags, &item);
    }
}

fn meta_set(ctx: &mut Ctx<'_>, m: &MetaSet<'_>) {
    if new_cas_refused(ctx, &m.flags, ErrorKind::InvalidFlag) {
        return;
    }
    bump(&ctx.stats.cmd_set);
    let mut buf = [0u8; KEY_LENGTH_MAX];
    let Some(key) = meta_key(ctx, m.key, m.flags.base64_key(), &mut buf) else {
        return;
    };
    let compare_cas = m.flags.compare_cas().unwrap_or(0);
    let mut mode = match m.mode {
        SetMode::Set => StoreMode::Set,
        SetMode::Add => StoreMode::Add,
        SetMode::Replace => StoreMode::Replace,
        SetMode::Append => StoreMode::Append,
        SetMode::Prepend => StoreMode::Prepend,
    };
    // memcached upgrades set and replace with a CAS value to a compare-and-swap.
    if m.flags.compare_cas().is_some() && matches!(mode, StoreMode::Set | StoreMode::Replace) {
        mode = StoreMode::Cas;
    }
    let req = StoreRequest {
        client_flags: m.flags.client_flags().unwrap_or(0),
        exptime_s: m.flags.ttl_s().unwrap_or(0),
        compare_cas,
        new_cas: m.flags.new_cas(),
        invalidate: m.flags.contains(MetaFlag::Invalidate),
        vivify_exptime_s: m.flags.vivify_ttl_s(),
        ..StoreRequest::new(mode, key, m.data)
    };
    *ctx.wrote = true;
    let stored = ctx.store.store(&req);
    log_store(ctx, &req, &stored);
    let (code, cas) = match stored {
        Ok(outcome) => {
            count_cas(ctx, mode, &outcome);
            match outcome {
                StoreOutcome::Stored { cas } => (MetaCode::Hd, cas),
                StoreOutcome::NotStored => (MetaCode::Ns, 0),
                StoreOutcome::Exists => (MetaCode::Ex, 0),
                StoreOutcome::NotFound => (MetaCode::Nf, 0),
            }
        }
        Err(error) => return server_error(ctx, &error, false),
    };
    if m.flags.quiet() && quiet_suppresses(MetaCommand::Set, code) {
        return;
    }
    let item = MetaItem {
        key,
        cas: Some(cas),
        ..MetaItem::default()
    };
    ctx.out
        .push_with(|out| encode::meta_header(out, code, &m.flags, &item));
}

fn meta_delete(ctx: &mut Ctx<'_>, m: &MetaRequest<'_>) {
    if new_cas_refused(ctx, &m.flags, ErrorKind::InvalidOrDuplicateFlag) {
        return;
    }
    let mut buf = [0u8; KEY_LENGTH_MAX];
    let Some(key) = meta_key(ctx, m.key, m.flags.base64_key(), &mut buf) else {
        return;
    };
    let mode = if m.flags.contains(MetaFlag::Invalidate) {
        DeleteMode::MarkStale {
            exptime_s: m.flags.ttl_s(),
        }
    } else if m.flags.contains(MetaFlag::RemoveValue) {
        DeleteMode::RemoveValue {
            client_flags: m.flags.client_flags().unwrap_or(0),
            exptime_s: m.flags.ttl_s().unwrap_or(0),
        }
    } else {
        DeleteMode::Remove
    };
    *ctx.wrote = true;
    // `C0` compares too: memcached's mdelete checks any `C` it was given.
    let code = match ctx
        .store
        .delete(key, m.flags.compare_cas(), m.flags.new_cas(), mode)
    {
        Ok(DeleteOutcome::Deleted) => {
            bump(&ctx.stats.delete_hits);
            MetaCode::Hd
        }
        Ok(DeleteOutcome::NotFound) => {
            bump(&ctx.stats.delete_misses);
            MetaCode::Nf
        }
        Ok(DeleteOutcome::Exists) => {
            bump(&ctx.stats.delete_misses);
            MetaCode::Ex
        }
        Err(error) => return server_error(ctx, &error, false),
    };
    if m.flags.quiet() && quiet_suppresses(MetaCommand::Delete, code) {
        return;
    }
    ctx.out
        .push_with(|out| encode::meta_header(out, code, &m.flags, &MetaItem::miss(key)));
}

fn meta_arithmetic(ctx: &mut Ctx<'_>, m: &MetaArithmetic<'_>) {
    if new_cas_refused(ctx, &m.flags, ErrorKind::InvalidOrDuplicateFlag) {
        return;
    }
    let mut buf = [0u8; KEY_LENGTH_MAX];
    let Some(key) = meta_key(ctx, m.key, m.flags.base64_key(), &mut buf) else {
        return;
    };
    let req = ArithRequest {
        key,
        op: m.op,
        delta: m.delta(),
        compare_cas: m.flags.compare_cas().unwrap_or(0),
        new_cas: m.flags.new_cas(),
        vivify: created_ttl_s(&m.flags).map(|ttl| (m.initial(), ttl)),
        exptime_s: m.flags.ttl_s(),
    };
    *ctx.wrote = true;
    let incr = m.op == kura_proto::ArithmeticOp::Incr;
    let outcome = match ctx.store.arith(&req) {
        Ok(outcome) => outcome,
        Err(error) => return server_error(ctx, &error, false),
    };
    let now_s = clock::unix_now_s();
    match outcome {
        ArithOutcome::Value {
            value,
            cas,
            meta,
            created,
            old_expire_at_s,
        } => {
            bump(if incr {
                &ctx.stats.incr_hits
            } else {
                &ctx.stats.decr_hits
            });
            let digits = value.to_string();
            let code = if m.flags.return_value() {
                MetaCode::Va {
                    data_len_bytes: digits.len(),
                }
            } else {
                MetaCode::Hd
            };
            if m.flags.quiet() && quiet_suppresses(MetaCommand::Arithmetic, code) && !created {
                return;
            }
            let updates = ttl_updates(&m.flags, created, meta.expire_at_s, now_s);
            let ttl = clock::ttl_s(ttl_at_t(&m.flags, old_expire_at_s, &updates), now_s);
            let item = MetaItem {
                key,
                cas: Some(cas),
                ttl_s: Some(ttl),
                ..MetaItem::default()
            };
            ctx.out.push_with(|out| {
                encode::meta_header(out, code, &m.flags, &item);
                if m.flags.return_value() {
                    out.extend_from_slice(digits.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
            });
        }
        ArithOutcome::NonNumeric => ctx.out.push_bytes(NON_NUMERIC),
        ArithOutcome::NotFound | ArithOutcome::Exists => {
            let code = if outcome == ArithOutcome::NotFound {
                bump(if incr {
                    &ctx.stats.incr_misses
                } else {
                    &ctx.stats.decr_misses
                });
                MetaCode::Nf
            } else {
                MetaCode::Ex
            };
            ctx.out
                .push_with(|out| encode::meta_header(out, code, &m.flags, &MetaItem::miss(key)));
        }
    }
}

fn meta_debug(ctx: &mut Ctx<'_>, raw_key: &[u8], base64_key: bool) {
    bump(&ctx.stats.cmd_meta);
    let mut buf = [0u8; KEY_LENGTH_MAX];
    let key = match kura_proto::meta_key(raw_key, base64_key, &mut buf) {
        Ok(key) if !key.is_empty() => key,
        _ => {
            ctx.out
                .push_bytes(b"CLIENT_ERROR bad command line format\r\n");
            return;
        }
    };
    match ctx.store.get_blocking(key) {
        Ok(Some(found)) => {
            let now_s = clock::unix_now_s();
            let meta = found.view.meta;
            let (fetched, last_access_s) = found.access(now_s);
            let (size_bytes, slab_class) = ctx.store.slab_classes().size_and_class(key, &found.view);
            let info = MetaDebugInfo {
                // memcached prints `current_time - exptime`: negative while the item lives.
                exptime_s: if meta.expire_at_s == 0 {
                    -1
                } else {
                    now_s - meta.expire_at_s
                },
                last_access_s,
                cas: found.cas(),
                fetched,
                slab_class,
                size_bytes: size_bytes as u64,
            };
            ctx.out
                .push_with(|out| encode::meta_debug(out, key, base64_key, &info));
        }
        Ok(None) => ctx.out.push_bytes(b"EN\r\n"),
        Err(error) => server_error(ctx, &error, false),
    }
}
