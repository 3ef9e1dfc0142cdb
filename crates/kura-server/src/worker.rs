//! A worker thread: an event loop over its own connections and its own queue
//! of flash reads.
//!
//! One loop turn: wait on epoll (sockets, the read queue's eventfd, a waker
//! for new connections and shutdown); finish the lookups whose reads
//! completed and send their replies; then read, parse and execute on the
//! connections that are ready, issuing their flash reads together with one
//! syscall (early, once enough wait) and taking up reads that finished
//! meanwhile; with `--sync always`, make this turn's writes durable; then
//! send every connection's ready replies, each with one `writev`. A client
//! whose reads are on flash never holds up another: its replies wait in its
//! own output.
//!
//! Limits per connection: input up to one frame (a command line and its data
//! block); reading stops while its unsent replies exceed
//! [`WorkerLimits::output_high_bytes`] or its reads in flight exceed
//! [`WorkerLimits::pending_reads_max`], so a client that pipelines without
//! reading its replies cannot grow the server's memory.
//!
//! Shutdown ([`Worker::begin_drain`]): no new connections; each connection
//! stops parsing, finishes the requests it started (their flash reads
//! included) and hands every reply to the kernel. Then it *lingers*: its
//! write side is shut and its input read and thrown away until the client
//! has acknowledged every byte or sent EOF, and only then is it closed. A
//! socket closed with input unread is reset by the kernel, which drops the
//! replies it had not yet sent ([`crate::socket`]): a client that pipelined
//! more than was parsed would get a reply cut in the middle. The worker
//! stops when every connection is closed, or after [`DRAIN_TIMEOUT`] (a
//! client that does not read) closes the rest anyway.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use kura_proto::auth::AuthStep;
use kura_proto::{Parsed, ParserLimits, Recovery};
use crate::socket::Stream;
use kura_tls::{TlsSession, TlsWriter};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::exec::{self, Ctx, Flow, Lookups, bump, finish_lookup};
use crate::metadump::{self, Dump};
use crate::watch;
use crate::output::Output;
use crate::stats::{ConnEntry, ConnStats, StatsSources, WorkerStats};
use crate::store::Store;
use crate::uring::{Completion, ReadQueue};

pub const WAKER: Token = Token(0);
const READS: Token = Token(1);
const CONN_TOKEN_BASE: usize = 2;

/// Bytes a connection's input buffer starts with and reads at a time.
const INPUT_CHUNK_BYTES: usize = 16 * 1024;
/// An idle input buffer larger than this is given back.
const INPUT_KEEP_BYTES_MAX: usize = 64 * 1024;
/// Reads from one connection per loop turn, so one busy client cannot starve the others.
const READS_PER_TURN: usize = 4;
/// Flash reads queued by the connections served so far in a loop turn that are issued at
/// once, before the turn's other connections are served; fewer wait for the end of the turn,
/// so that one `io_uring_enter` (and one doorbell to the disk) carries many.
const READS_SUBMIT_BATCH: usize = 32;
/// How often idle connections are looked for.
const IDLE_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// How long shutdown waits for replies to drain before closing anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a shutting-down worker looks whether its lingering connections' clients have
/// acknowledged everything (nothing signals it).
const LINGER_CHECK_INTERVAL: Duration = Duration::from_millis(5);

/// Limits and policies each worker applies.
#[derive(Debug, Clone)]
pub struct WorkerLimits {
    pub parser: ParserLimits,
    /// Largest input buffer: the longest frame the parser accepts.
    pub input_max_bytes: usize,
    /// Stop reading a connection while this many reply bytes are unsent.
    pub output_high_bytes: usize,
    /// Stop reading a connection while this many of its reads are on flash.
    pub pending_reads_max: usize,
    /// Flash reads in flight per worker.
    pub read_queue_depth: usize,
    pub idle_timeout: Option<Duration>,
    /// Sync before replying to writes (`--sync always`).
    pub sync_always: bool,
    /// How long the loop keeps looking for work before it sleeps (`--poll-spin-us`).
    pub poll_spin: Duration,
}

/// What every worker shares.
pub struct Shared {
    pub store: Arc<Store>,
    pub sources: StatsSources,
    pub conns: Arc<ConnStats>,
    pub limits: WorkerLimits,
    pub shutdown: std::sync::atomic::AtomicBool,
}

struct Conn {
    stream: Stream,
    /// `-Z` on this connection's listener: what it reads and writes goes through the session.
    tls: Option<Box<TlsSession>>,
    /// What `stats conns` shows of it.
    entry: Arc<ConnEntry>,
    /// It sent `watch`: log lines go to it, its input is dropped.
    watch: Option<Arc<watch::Watcher>>,
    generation: u64,
    /// Unparsed input is `input[start..end]`; the buffer's length is its capacity.
    input: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes of a refused data block still to discard as they arrive.
    swallow: usize,
    out: Output,
    /// Close once the queued replies are sent (quit, a closing error, shutdown).
    closing: bool,
    /// Shutdown: every reply is with the kernel and the write side is shut; waiting for the
    /// client to acknowledge them, input discarded (see the module docs).
    lingering: bool,
    /// The client sent EOF: run what it sent, reply, then close.
    eof: bool,
    /// Parsing stopped at an incomplete request (so EOF leaves nothing to run).
    stalled: bool,
    /// Length of the incomplete request at the front, when the parser knows it.
    frame_hint: usize,
    /// The socket may have more input (edge-triggered readiness not yet drained).
    readable: bool,
    /// The peer shut its side: read to the EOF (no further edge will say so).
    peer_closed: bool,
    /// Parsing stopped at a write that must wait for this connection's reads.
    barrier: bool,
    /// Wrote since the last sync (for `--sync always`).
    unsynced: bool,
    last_active: Instant,
    in_ready: bool,
    in_dirty: bool,
    /// An `lru_crawler metadump` being sent: nothing more is parsed until it ends.
    dump: Option<Dump>,
    /// It may send requests: always without `-Y`, else once it sent matching credentials
    /// (see `kura_proto::auth`).
    authenticated: bool,
}

impl Conn {
    fn blocked(&self, limits: &WorkerLimits) -> bool {
        self.out.queued_bytes() >= limits.output_high_bytes
            || self.out.pending() >= limits.pending_reads_max
            || (self.barrier && self.out.pending() > 0)
            || self.dump.is_some()
    }

    /// Makes room to read at least `want` more bytes, up to `max` buffered.
    fn reserve(&mut self, want: usize, max: usize) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.input.len() - self.end >= want.min(INPUT_CHUNK_BYTES) {
            return;
        }
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let target = (self.end + want.max(INPUT_CHUNK_BYTES)).min(max.max(self.end + 1));
        if target > self.input.len() {
            self.input.resize(target, 0);
        }
    }

    /// A TLS connection whose handshake has not finished.
    fn handshaking(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.is_handshaking())
    }

    /// Every reply is with the kernel: none queued, and no ciphertext left in the session.
    fn output_drained(&self) -> bool {
        self.out.is_empty() && self.tls.as_ref().is_none_or(|tls| !tls.write_pending())
    }

    fn shrink_if_idle(&mut self) {
        if self.start == self.end && self.input.len() > INPUT_KEEP_BYTES_MAX {
            self.input = vec![0; INPUT_CHUNK_BYTES];
            self.start = 0;
            self.end = 0;
        }
    }
}

pub struct Worker {
    shared: Arc<Shared>,
    stats: Arc<WorkerStats>,
    poll: Poll,
    inbox: Receiver<(Stream, bool)>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    next_gen: u64,
    lookups: Lookups,
    reads: ReadQueue,
    ready: VecDeque<usize>,
    dirty: Vec<usize>,
    completions: Vec<Completion>,
    wrote: bool,
    /// A `sync` command ran this turn.
    sync_requested: bool,
    draining_since: Option<Instant>,
    /// Wakes this worker's poll (handed to metadump threads).
    waker: Arc<Waker>,
    /// Connections sending a metadump.
    dumps: usize,
    /// Connections that are watchers.
    watches: usize,
    /// Threads of dumps whose connection closed before they ended (joined when the worker
    /// stops; they stop at their next item).
    dump_threads: Vec<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// A worker whose `poll` already has the waker registered under [`WAKER`].
    pub fn new(
        shared: Arc<Shared>,
        stats: Arc<WorkerStats>,
        poll: Poll,
        waker: Arc<Waker>,
        inbox: Receiver<(Stream, bool)>,
    ) -> io::Result<Self> {
        let reads = ReadQueue::new(
            shared.store.engine().device(),
            shared.limits.read_queue_depth,
        );
        if let Some(fd) = reads.eventfd() {
            poll.registry()
                .register(&mut SourceFd(&fd), READS, Interest::READABLE)?;
        }
        Ok(Self {
            shared,
            stats,
            poll,
            inbox,
            conns: Vec::new(),
            free: Vec::new(),
            next_gen: 1,
            lookups: Lookups::default(),
            reads,
            ready: VecDeque::new(),
            dirty: Vec::new(),
            completions: Vec::new(),
            wrote: false,
            sync_requested: false,
            draining_since: None,
            waker,
            dumps: 0,
            watches: 0,
            dump_threads: Vec::new(),
        })
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut last_sweep = Instant::now();
        loop {
            let timeout = if !self.ready.is_empty() || self.reads.has_ready() || self.dumps_want_room() || self.watches_want_room() {
                Duration::ZERO
            } else if self.draining_since.is_some() {
                LINGER_CHECK_INTERVAL
            } else {
                IDLE_SWEEP_INTERVAL
            };
            // Look for work without sleeping for a while first (`--poll-spin-us`): waking a
            // sleeping thread is most of a round trip on a virtual machine.
            let spun = !timeout.is_zero() && self.spin_for_events(&mut events);
            if !spun && let Err(error) = self.poll.poll(&mut events, Some(timeout))
                && error.kind() != io::ErrorKind::Interrupted
            {
                tracing::error!(%error, "worker poll failed; closing its connections");
                break;
            }
            let mut reads_signalled = false;
            for event in events.iter() {
                match event.token() {
                    WAKER => self.accept_handed_over(),
                    READS => reads_signalled = true,
                    Token(t) => {
                        let index = t - CONN_TOKEN_BASE;
                        if let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) {
                            if event.is_readable() || event.is_read_closed() || event.is_error() {
                                conn.readable = true;
                            }
                            if event.is_read_closed() || event.is_error() {
                                conn.peer_closed = true;
                            }
                            self.queue_ready(index);
                            if event.is_writable() {
                                self.queue_dirty(index);
                            }
                        }
                    }
                }
            }
            if self.shared.shutdown.load(Ordering::Acquire) && self.draining_since.is_none() {
                self.begin_drain();
            }
            // Replies whose reads finished go out before new input is parsed,
            // so a burst of requests does not hold them back.
            self.finish_reads(reads_signalled);
            self.pump_dumps();
            self.pump_watches();
            self.sync_writes();
            self.flush_dirty();
            self.serve_ready();
            self.submit_reads();
            self.sync_writes();
            self.flush_dirty();
            if self.draining_since.is_some() {
                self.advance_lingering();
            }
            if last_sweep.elapsed() >= IDLE_SWEEP_INTERVAL {
                last_sweep = Instant::now();
                self.sweep_idle();
            }
            if let Some(since) = self.draining_since
                && (self.conns.iter().all(Option::is_none) || since.elapsed() >= DRAIN_TIMEOUT)
            {
                break;
            }
        }
        for index in 0..self.conns.len() {
            self.close(index, "shutdown");
        }
        for thread in self.dump_threads.drain(..) {
            let _ = thread.join();
        }
    }

    /// Polls without sleeping, yielding the CPU between looks, until an event comes (`true`,
    /// in `events`), or `false` when `poll_spin` has passed or the CPU is wanted (see
    /// [`kura_engine::spin`]).
    fn spin_for_events(&mut self, events: &mut Events) -> bool {
        let spin = self.shared.limits.poll_spin;
        if spin.is_zero() {
            return false;
        }
        let found = kura_engine::spin::look_for(spin, || match self.poll.poll(events, Some(Duration::ZERO)) {
            Ok(()) if !events.is_empty() => Some(true),
            Err(error) if error.kind() != io::ErrorKind::Interrupted => Some(false),
            _ => self.shared.shutdown.load(Ordering::Acquire).then_some(false),
        })
        .unwrap_or(false);
        bump(if found { &self.stats.poll_spin_found } else { &self.stats.poll_spin_slept });
        found
    }

    /// Moves the lines of running metadumps into their connections' output while it has
    /// room; a dump that ended lets its connection parse again.
    fn pump_dumps(&mut self) {
        if self.dumps == 0 {
            return;
        }
        self.dump_threads.retain(|t| !t.is_finished());
        let high = self.shared.limits.output_high_bytes;
        for index in 0..self.conns.len() {
            let Some(conn) = self.conns[index].as_mut() else { continue };
            let Some(dump) = conn.dump.as_mut() else { continue };
            let before = conn.out.queued_bytes();
            let ended = metadump::drain(dump, high.saturating_sub(before), &mut conn.out);
            if conn.out.queued_bytes() != before {
                conn.last_active = Instant::now();
                self.queue_dirty(index);
            }
            if ended {
                let conn = self.conns[index].as_mut().expect("checked above");
                if let Some(dump) = conn.dump.take() {
                    let _ = dump.thread.join();
                }
                self.dumps -= 1;
                self.queue_ready(index);
                self.queue_dirty(index);
            }
        }
    }

    /// Whether a metadump stopped for a full output that has drained since: its next chunks
    /// are taken at once (no event would announce that room).
    fn dumps_want_room(&self) -> bool {
        let high = self.shared.limits.output_high_bytes;
        self.dumps > 0 && self.conns.iter().flatten().any(|c| c.dump.as_ref().is_some_and(|d| d.room_limited) && c.out.queued_bytes() < high)
    }

    /// Wakes this worker's poll: handed to metadump threads and to the watchers' loggers.
    fn wake_fn(&self) -> Arc<dyn Fn() + Send + Sync> {
        let waker = Arc::clone(&self.waker);
        Arc::new(move || {
            let _ = waker.wake();
        })
    }

    /// Makes connection `index` a watcher of `flags` (or answers that there are too many).
    fn start_watch(&mut self, index: usize, flags: kura_proto::WatchFlags) {
        let wake = self.wake_fn();
        let Some(conn) = self.conns[index].as_mut() else { return };
        match self.shared.sources.watchers.add(flags, wake) {
            Some(watcher) => {
                conn.out.push_bytes(b"OK\r\n");
                conn.start = conn.end;
                conn.entry.set_watching();
                conn.watch = Some(watcher);
                self.watches += 1;
            }
            None => conn.out.push_bytes(watch::TOO_MANY_REPLY),
        }
        self.queue_dirty(index);
    }

    /// Moves waiting log lines into watchers' output while it has room.
    fn pump_watches(&mut self) {
        if self.watches == 0 {
            return;
        }
        let high = self.shared.limits.output_high_bytes;
        for index in 0..self.conns.len() {
            let Some(conn) = self.conns[index].as_mut() else { continue };
            let Some(watcher) = conn.watch.as_ref() else { continue };
            let before = conn.out.queued_bytes();
            watcher.drain(high.saturating_sub(before), &mut conn.out);
            if conn.out.queued_bytes() != before {
                self.queue_dirty(index);
            }
        }
    }

    /// Whether a watcher has lines waiting and room for them (no event would announce it).
    fn watches_want_room(&self) -> bool {
        let high = self.shared.limits.output_high_bytes;
        self.watches > 0 && self.conns.iter().flatten().any(|c| c.watch.as_ref().is_some_and(|w| w.has_pending()) && c.out.queued_bytes() < high)
    }

    /// Starts the metadump a request on connection `index` asked for (or answers `BUSY`).
    fn start_dump(&mut self, index: usize, (classes, format): (kura_proto::MetadumpClasses, metadump::DumpFormat)) {
        let wake = self.wake_fn();
        let Some(conn) = self.conns[index].as_mut() else { return };
        let running = &self.shared.conns.lru_crawler_running;
        if running.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
            conn.out.push_bytes(metadump::BUSY_REPLY);
            return;
        }
        match metadump::start(Arc::clone(&self.shared.store), classes, format, wake, Arc::clone(running)) {
            Ok(dump) => {
                if self.draining_since.is_some() {
                    dump.shutdown.store(true, Ordering::Release);
                }
                conn.dump = Some(dump);
                self.dumps += 1;
                bump(&self.shared.conns.lru_crawler_starts);
            }
            Err(error) => {
                running.store(false, Ordering::Release);
                tracing::error!(%error, "metadump: cannot start its thread");
                conn.out.push_bytes(b"SERVER_ERROR cannot start the metadump\r\n");
            }
        }
    }

    fn accept_handed_over(&mut self) {
        while let Ok((mut stream, tls)) = self.inbox.try_recv() {
            if self.draining_since.is_some() {
                self.shared
                    .conns
                    .curr_connections
                    .fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let tls = match tls.then(|| self.shared.sources.tls.as_ref().map(|t| t.session())).flatten() {
                None => None,
                Some(Ok(session)) => Some(Box::new(session)),
                Some(Err(error)) => {
                    tracing::warn!(%error, "cannot start a TLS session for a new connection");
                    self.shared.conns.curr_connections.fetch_sub(1, Ordering::Relaxed);
                    continue;
                }
            };
            let index = self.free.pop().unwrap_or_else(|| {
                self.conns.push(None);
                self.conns.len() - 1
            });
            let token = Token(index + CONN_TOKEN_BASE);
            if let Err(error) = self.poll.registry().register(
                &mut stream,
                token,
                Interest::READABLE | Interest::WRITABLE,
            ) {
                tracing::warn!(%error, "cannot watch a new connection");
                self.free.push(index);
                self.shared
                    .conns
                    .curr_connections
                    .fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let generation = self.next_gen;
            self.next_gen += 1;
            let now_s = self.shared.sources.info.uptime_s_at(Instant::now());
            let entry = Arc::new(ConnEntry::connection(stream.peer(), stream.local(), now_s));
            self.shared.conns.registry.insert(stream.as_raw_fd(), Arc::clone(&entry));
            self.shared.sources.watchers.conn_event(entry.addr.as_ref(), stream.as_raw_fd(), None);
            self.conns[index] = Some(Conn {
                stream,
                tls,
                entry,
                watch: None,
                generation,
                input: vec![0; INPUT_CHUNK_BYTES],
                start: 0,
                end: 0,
                swallow: 0,
                out: Output::default(),
                closing: false,
                lingering: false,
                eof: false,
                peer_closed: false,
                stalled: false,
                frame_hint: 0,
                readable: true,
                barrier: false,
                unsynced: false,
                last_active: Instant::now(),
                in_ready: false,
                in_dirty: false,
                dump: None,
                authenticated: self.shared.sources.info.protocol.auth.is_none(),
            });
            self.queue_ready(index);
        }
    }

    fn begin_drain(&mut self) {
        self.draining_since = Some(Instant::now());
        self.accept_handed_over();
        for index in 0..self.conns.len() {
            if let Some(conn) = self.conns[index].as_mut() {
                conn.closing = true;
                if let Some(dump) = &conn.dump {
                    dump.shutdown.store(true, Ordering::Release);
                }
                self.queue_dirty(index);
            }
        }
    }

    fn queue_ready(&mut self, index: usize) {
        if let Some(conn) = self.conns[index].as_mut()
            && !conn.in_ready
        {
            conn.in_ready = true;
            self.ready.push_back(index);
        }
    }

    fn queue_dirty(&mut self, index: usize) {
        if let Some(conn) = self.conns[index].as_mut()
            && !conn.in_dirty
        {
            conn.in_dirty = true;
            self.dirty.push(index);
        }
    }

    /// Continues every lookup whose flash read finished.
    fn finish_reads(&mut self, signalled: bool) {
        let mut completions = std::mem::take(&mut self.completions);
        self.reads.reap(&mut completions, signalled);
        for completion in completions.drain(..) {
            let Some(lookup) = self.lookups.remove(completion.token) else {
                continue;
            };
            let conn_index = lookup.conn;
            let alive = self
                .conns
                .get(conn_index)
                .and_then(Option::as_ref)
                .is_some_and(|c| c.generation == lookup.conn_gen);
            if !alive {
                // The client left; the read's buffer is simply dropped.
                continue;
            }
            let conn = self.conns[conn_index].as_mut().expect("checked alive");
            let mut wrote = false;
            // A lookup's completion never hands anything over.
            let mut handover = None;
            let mut ctx = Ctx {
                store: &self.shared.store,
                sources: &self.shared.sources,
                stats: &self.stats,
                lookups: &mut self.lookups,
                reads: &mut self.reads,
                conn: conn_index,
                conn_gen: conn.generation,
                conn_fd: conn.stream.as_raw_fd(),
                out: &mut conn.out,
                wrote: &mut wrote,
                sync_requested: &mut self.sync_requested,
                handover: &mut handover,
            };
            if let Some((lookup, offset_bytes, len_bytes)) =
                finish_lookup(&mut ctx, lookup, completion.result)
            {
                let token = self.lookups.insert(lookup);
                self.reads.push(offset_bytes, len_bytes, token);
            }
            if wrote {
                conn.unsynced = true;
                self.wrote = true;
            }
            self.queue_dirty(conn_index);
            self.queue_ready(conn_index);
        }
        self.completions = completions;
    }

    fn serve_ready(&mut self) {
        for _ in 0..self.ready.len() {
            let Some(index) = self.ready.pop_front() else {
                break;
            };
            let Some(conn) = self.conns[index].as_mut() else {
                continue;
            };
            conn.in_ready = false;
            self.serve(index);
            // The reads queued so far go out together once there are enough of them (the
            // rest at the end of the turn): each `io_uring_enter` costs a syscall and a
            // doorbell to the disk, which were most of the CPU per flash GET when every
            // connection's few reads had their own. Reads that finished meanwhile are taken
            // up rather than waiting for the end of a turn that may serve many connections.
            if self.reads.queued() >= READS_SUBMIT_BATCH {
                self.submit_reads();
            }
            self.finish_reads(false);
        }
    }

    fn submit_reads(&mut self) {
        if let Err(error) = self.reads.submit() {
            tracing::error!(%error, "cannot issue flash reads");
        }
    }

    /// Parses and executes what a connection sent, reading more while it may.
    fn serve(&mut self, index: usize) {
        let limits = self.shared.limits.clone();
        for _ in 0..READS_PER_TURN {
            self.execute_buffered(index);
            let Some(conn) = self.conns[index].as_mut() else {
                return;
            };
            if conn.lingering {
                self.linger(index);
                return;
            }
            if conn.closing
                || conn.eof
                || conn.blocked(&limits)
                || !conn.readable
                || self.draining_since.is_some()
            {
                self.queue_dirty(index);
                return;
            }
            match self.read_into(index) {
                ReadResult::Data => {}
                ReadResult::Drained => {
                    self.queue_dirty(index);
                    return;
                }
                ReadResult::Closed => return,
            }
        }
        // More may be waiting: come back next turn, after the others.
        self.queue_ready(index);
        self.queue_dirty(index);
    }

    fn read_into(&mut self, index: usize) -> ReadResult {
        let input_max = self.shared.limits.input_max_bytes;
        let conn = self.conns[index]
            .as_mut()
            .expect("serving a live connection");
        let buffered = conn.end - conn.start;
        let want = if conn.swallow > 0 {
            conn.swallow.min(INPUT_CHUNK_BYTES)
        } else {
            conn.frame_hint
                .saturating_sub(buffered)
                .max(INPUT_CHUNK_BYTES)
        };
        conn.reserve(want, input_max);
        if conn.end == conn.input.len() {
            // A full buffer the parser could not use: only a frame over the limit does this.
            conn.closing = true;
            return ReadResult::Drained;
        }
        let read = match conn.tls.as_mut() {
            // Reads until the buffer is full or the socket has nothing more, so a short read
            // means what it means on a plain socket.
            Some(tls) => tls.read(&mut conn.stream, &mut conn.input[conn.end..], false),
            None => conn.stream.read(&mut conn.input[conn.end..]),
        };
        match read {
            Ok(0) => {
                // The client is done sending: answer what it sent, then close.
                conn.readable = false;
                conn.eof = true;
                // Gone before the session was up: memcached counts it as a failed handshake.
                count_if_handshaking(conn, self.shared.sources.tls.as_deref());
                ReadResult::Drained
            }
            Ok(n) => {
                // A short read emptied the socket: with edge-triggered epoll the
                // next arrival is signalled, so no read is spent on EAGAIN (unless
                // the peer already closed: its EOF will not be signalled again).
                if conn.end + n < conn.input.len() && !conn.peer_closed {
                    conn.readable = false;
                }
                conn.end += n;
                let now = Instant::now();
                conn.last_active = now;
                conn.entry.touch(self.shared.sources.info.uptime_s_at(now));
                bump_by(&self.stats.bytes_read, n);
                ReadResult::Data
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                conn.readable = false;
                ReadResult::Drained
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => ReadResult::Data,
            Err(error) => {
                if count_if_handshaking(conn, self.shared.sources.tls.as_deref()) {
                    tracing::debug!(%error, "TLS handshake failed");
                }
                self.close(index, "error");
                ReadResult::Closed
            }
        }
    }

    /// Runs every complete request in the input buffer, until one is
    /// incomplete or the connection must wait.
    fn execute_buffered(&mut self, index: usize) {
        while let Some(handover) = self.execute_buffered_until_handover(index) {
            match handover {
                exec::Handover::Dump(classes, format) => self.start_dump(index, (classes, format)),
                exec::Handover::Watch(flags) => {
                    self.start_watch(index, flags);
                    return;
                }
            }
            if self.conns[index].as_ref().is_none_or(|c| c.dump.is_some()) {
                return;
            }
        }
    }

    /// [`Worker::execute_buffered`] up to a request that hands the connection over
    /// (`lru_crawler metadump|mgdump`, `watch`), which it returns.
    fn execute_buffered_until_handover(&mut self, index: usize) -> Option<exec::Handover> {
        let limits = self.shared.limits.clone();
        let conn = self.conns[index].as_mut()?;
        if conn.watch.is_some() {
            // A watcher's input is dropped unread, as memcached does.
            conn.start = conn.end;
            return None;
        }
        let mut asked = None;
        conn.barrier = false;
        conn.stalled = false;
        conn.frame_hint = 0;
        loop {
            if conn.swallow > 0 {
                let n = conn.swallow.min(conn.end - conn.start);
                conn.start += n;
                conn.swallow -= n;
                if conn.swallow > 0 {
                    conn.stalled = true;
                    break;
                }
            }
            if conn.closing || conn.blocked(&limits) || conn.start == conn.end {
                break;
            }
            let conn_fd = conn.stream.as_raw_fd();
            let Conn {
                input,
                start,
                end,
                out,
                generation,
                unsynced,
                closing,
                swallow,
                barrier,
                stalled,
                frame_hint,
                authenticated,
                ..
            } = conn;
            let buf = &input[*start..*end];
            if !*authenticated {
                let Some(auth) = &self.shared.sources.info.protocol.auth else { unreachable!("a connection waits for credentials only with -Y") };
                match kura_proto::auth::parse_auth(buf) {
                    AuthStep::Incomplete => {
                        *stalled = true;
                        break;
                    }
                    AuthStep::Junk => {
                        bump(&self.stats.protocol_errors);
                        *closing = true;
                        break;
                    }
                    AuthStep::Unauthenticated { consumed_bytes } => {
                        out.push_bytes(AuthStep::UNAUTHENTICATED);
                        *start += consumed_bytes;
                    }
                    AuthStep::BadTermination { consumed_bytes } => {
                        out.push_bytes(AuthStep::BAD_TERMINATION);
                        *start += consumed_bytes;
                    }
                    AuthStep::BadFormat { consumed_bytes } => {
                        out.push_bytes(AuthStep::BAD_FORMAT);
                        *start += consumed_bytes;
                    }
                    AuthStep::TooLong { consumed_bytes, data_bytes } => {
                        bump(&self.stats.auth_cmds);
                        bump(&self.stats.auth_errors);
                        out.push_bytes(AuthStep::FAILURE);
                        *start += consumed_bytes;
                        *swallow = data_bytes;
                    }
                    AuthStep::Credentials { user, password, consumed_bytes } => {
                        bump(&self.stats.auth_cmds);
                        if auth.users.check(user, password) {
                            *authenticated = true;
                            out.push_bytes(AuthStep::STORED);
                        } else {
                            bump(&self.stats.auth_errors);
                            tracing::info!(fd = conn_fd, "-Y: a client's credentials did not match");
                            out.push_bytes(AuthStep::FAILURE);
                        }
                        *start += consumed_bytes;
                    }
                }
                continue;
            }
            let mut wrote = false;
            let mut handover = None;
            match kura_proto::parse(buf, &limits.parser) {
                Ok(Parsed::Incomplete { frame_bytes }) => {
                    *stalled = true;
                    *frame_hint = frame_bytes.unwrap_or(0);
                    if *frame_hint > limits.input_max_bytes {
                        // The parser bounds frames by the item size limit; this is a bug guard.
                        *closing = true;
                    }
                    break;
                }
                Ok(Parsed::Complete {
                    request,
                    consumed_bytes,
                }) => {
                    if exec::needs_barrier(&request) && out.pending() > 0 {
                        *barrier = true;
                        break;
                    }
                    let raw = &buf[..consumed_bytes];
                    let mut ctx = Ctx {
                        store: &self.shared.store,
                        sources: &self.shared.sources,
                        stats: &self.stats,
                        lookups: &mut self.lookups,
                        reads: &mut self.reads,
                        conn: index,
                        conn_gen: *generation,
                        conn_fd,
                        out,
                        wrote: &mut wrote,
                        sync_requested: &mut self.sync_requested,
                        handover: &mut handover,
                    };
                    let flow = exec::execute(&mut ctx, request, raw);
                    *start += consumed_bytes;
                    if flow == Flow::Close {
                        *closing = true;
                    }
                }
                Err(error) => {
                    bump(&self.stats.protocol_errors);
                    if error.kind == kura_proto::ErrorKind::ObjectTooLarge {
                        bump(&self.stats.store_too_large);
                    }
                    if let Some(reply) = error.reply() {
                        out.push_with(|o| {
                            o.extend_from_slice(reply.as_bytes());
                            o.extend_from_slice(b"\r\n");
                        });
                    }
                    *start += error.consumed_bytes;
                    match error.recovery {
                        Recovery::Continue => {}
                        Recovery::Swallow { data_bytes } => *swallow = data_bytes,
                        Recovery::Close => *closing = true,
                    }
                }
            }
            if wrote {
                *unsynced = true;
                self.wrote = true;
            }
            if handover.is_some() {
                // Nothing after it is parsed until the dump has been sent (or refused); a
                // watcher's input is never run.
                asked = handover;
                break;
            }
        }
        conn.shrink_if_idle();
        asked
    }

    /// `--sync always` or a `sync` command: make this turn's writes (every acknowledged write,
    /// for `sync`) durable before any reply leaves.
    fn sync_writes(&mut self) {
        let sync_requested = std::mem::take(&mut self.sync_requested);
        let wrote = std::mem::take(&mut self.wrote);
        if !sync_requested && !wrote {
            return;
        }
        if !sync_requested && !self.shared.limits.sync_always {
            for conn in self.conns.iter_mut().flatten() {
                conn.unsynced = false;
            }
            return;
        }
        if let Err(error) = self.shared.store.sync_if_dirty() {
            tracing::error!(%error, "sync failed; closing the connections whose writes it covered");
            for index in 0..self.conns.len() {
                if self.conns[index]
                    .as_ref()
                    .is_some_and(|c| c.unsynced || sync_requested)
                {
                    self.close(index, "error");
                }
            }
            return;
        }
        for conn in self.conns.iter_mut().flatten() {
            conn.unsynced = false;
        }
    }

    fn flush_dirty(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        for &index in &dirty {
            let Some(conn) = self.conns[index].as_mut() else {
                continue;
            };
            conn.in_dirty = false;
            let before_blocked = conn.blocked(&self.shared.limits);
            let reads = &mut self.reads;
            let mut spent = |item: kura_engine::Item| {
                if let Some(buf) = item.into_read_buffer() {
                    reads.recycle(buf);
                }
            };
            let written = match conn.tls.as_mut() {
                Some(tls) => match tls.flush(&mut conn.stream) {
                    Ok(()) => conn.out.write_to(&mut TlsWriter { session: tls, sock: &mut conn.stream }, &mut spent),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => Ok(0),
                    Err(e) => Err(e),
                },
                None => conn.out.write_to(&mut conn.stream, &mut spent),
            };
            match written {
                Ok(n) => {
                    if n > 0 {
                        conn.last_active = Instant::now();
                        bump_by(&self.stats.bytes_written, n);
                    }
                    conn.entry.set_writing(!conn.output_drained());
                }
                Err(_) => {
                    self.close(index, "error");
                    continue;
                }
            }
            let finished = conn.dump.is_none() && (conn.closing || (conn.eof && (conn.start == conn.end || conn.stalled)));
            if finished && conn.output_drained() {
                if self.draining_since.is_some() {
                    self.linger(index);
                } else {
                    self.close(index, "normal");
                }
                continue;
            }
            if before_blocked && !conn.blocked(&self.shared.limits) {
                self.queue_ready(index);
            }
        }
        self.dirty = dirty;
        self.dirty.clear();
    }

    /// Closes each lingering connection whose client took every reply.
    fn advance_lingering(&mut self) {
        for index in 0..self.conns.len() {
            if self.conns[index].as_ref().is_some_and(|c| c.lingering) {
                self.linger(index);
            }
        }
    }

    /// A shutting-down connection with every reply handed to the kernel: shuts its write side
    /// (the client sees EOF after the last reply), throws away what it sends, and closes it
    /// once it has acknowledged every byte or sent EOF. Closing before that, with input
    /// unread, would reset the connection and drop the replies still in the socket.
    fn linger(&mut self, index: usize) {
        let Some(conn) = self.conns[index].as_mut() else {
            return;
        };
        debug_assert!(conn.output_drained(), "lingers with every reply handed over");
        if !conn.lingering {
            conn.lingering = true;
            if let Some(tls) = conn.tls.as_mut() {
                tls.close(&mut conn.stream);
            }
            if conn.stream.shutdown(std::net::Shutdown::Write).is_err() {
                self.close(index, "shutdown");
                return;
            }
        }
        let done = match discard_input(conn) {
            Discarded::Eof | Discarded::Failed => true,
            // What arrives after this check and before the close may still reset the
            // connection, but then the client has every reply already.
            Discarded::Pending => match crate::socket::unacked_bytes(&conn.stream) {
                Ok(unacked_bytes) => unacked_bytes == 0,
                Err(_) => true,
            },
        };
        if done {
            self.close(index, "shutdown");
        }
    }

    fn sweep_idle(&mut self) {
        let Some(timeout) = self.shared.limits.idle_timeout else {
            return;
        };
        for index in 0..self.conns.len() {
            let idle = self.conns[index]
                .as_ref()
                .is_some_and(|c| c.out.pending() == 0 && c.dump.is_none() && c.watch.is_none() && c.last_active.elapsed() >= timeout);
            if idle {
                bump(&self.shared.conns.idle_kicks);
                self.close(index, "idle_timeout");
            }
        }
    }

    /// Closes connection `index`; `reason` is what `watch connevents` says of it (memcached's
    /// `normal`, `error`, `idle_timeout`, `shutdown`).
    fn close(&mut self, index: usize, reason: &str) {
        let Some(mut conn) = self.conns[index].take() else {
            return;
        };
        if let Some(dump) = conn.dump.take() {
            dump.stop.store(true, Ordering::Release);
            self.dump_threads.push(dump.thread);
            self.dumps -= 1;
        }
        let watchers = &self.shared.sources.watchers;
        if let Some(watcher) = conn.watch.take() {
            watchers.remove(&watcher);
            self.watches -= 1;
        }
        if reason != "error"
            && !conn.lingering
            && !conn.handshaking()
            && let Some(tls) = conn.tls.as_mut()
        {
            // close_notify, if the socket takes it at once.
            tls.close(&mut conn.stream);
        }
        let fd = conn.stream.as_raw_fd();
        watchers.conn_event(conn.entry.addr.as_ref(), fd, Some(reason));
        let _ = self.poll.registry().deregister(&mut conn.stream);
        self.shared.conns.registry.remove(fd, &conn.entry);
        self.free.push(index);
        self.shared
            .conns
            .curr_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a TLS connection that ended or failed before its handshake did in
/// `ssl_handshake_errors` (as memcached counts it); whether it was one.
fn count_if_handshaking(conn: &Conn, server_tls: Option<&crate::tls::ServerTls>) -> bool {
    let handshaking = conn.handshaking();
    if handshaking && let Some(server_tls) = server_tls {
        server_tls.count_handshake_error();
    }
    handshaking
}

enum Discarded {
    /// The client sent EOF: nothing unread can reset the connection.
    Eof,
    /// The socket failed (a reset, most likely).
    Failed,
    /// Everything arrived so far is read (or this turn's share of it).
    Pending,
}

/// Reads and drops what a lingering connection's client sends, a bounded amount per turn.
fn discard_input(conn: &mut Conn) -> Discarded {
    conn.start = 0;
    conn.end = 0;
    for _ in 0..READS_PER_TURN {
        match conn.stream.read(&mut conn.input) {
            Ok(0) => return Discarded::Eof,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Discarded::Pending,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Discarded::Failed,
        }
    }
    Discarded::Pending
}

enum ReadResult {
    /// Bytes arrived; parse them.
    Data,
    /// Nothing more to read for now (or EOF, which marks the connection closing).
    Drained,
    /// The connection is gone.
    Closed,
}

fn bump_by(counter: &std::sync::atomic::AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}
