//! The network backends' context: an edge-triggered epoll loop ([`crate::fd`]: its
//! descriptors kept high) over this context's own connections, one per node. Requests are encoded into the node's send buffer at submit and leave
//! together at the next poll (one `write` for all of them); replies are parsed straight out of
//! the receive buffer (one `read` for all that arrived) and handed to the caller borrowed.
//! Replies come back in request order on each connection, so a FIFO matches them.
//!
//! Failures: a node that refuses connections is retried with exponential back-off, and
//! requests for it fail at once with `NodeDown` meanwhile (never a hang); a request not
//! answered within the timeout closes its connection. Redis Cluster requests are kept whole
//! and sent again after `MOVED`/`ASK`, `TRYAGAIN`/`CLUSTERDOWN` or a lost connection (a
//! fail-over), with the slot map refreshed, until their deadline.
//!
//! A node that acknowledged writes and then restarted may have lost them (a kura server syncs
//! them only now and then); a flush over a new connection would succeed and promise them
//! durable. So each connection's handshake learns which process start of the node answers
//! ([`crate::instance`]: kura's `kura_instance_id`, memcached's pid and start time from
//! `stats`, Redis' `run_id`), in the same round trip as the rest of the handshake and before
//! any request is sent on it. The pool remembers the last instance per node; a connection that
//! finds another one counts a loss, as does a broken connection whose instance is unknown (a
//! server that does not say, a Redis Cluster node). A connection closed by an idle or request
//! timeout or a network error, the same server still running, counts nothing. Each context's
//! first flush after a loss counted in any context of the pool fails (`WritesMayBeLost`), once.
//! The flush connects to every node first, so a restart is found before it completes.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_engine::device::EventFd;

use crate::fd::Epoll;

use crate::cluster;
use crate::config::{Backend, FlushMode, NodeSpec};
use crate::conn::{self, Conn, FlushPart, Op, Owned, Sent, SentOp, Wire};
use crate::error::{Error, Result};
use crate::key;
use crate::pool::{Completion, Outcome, Shared};
use crate::proto::memcache::{self, Reply as McReply};
use crate::proto::resp::{self, Resp};
use crate::stats::IoStats;
use crate::stream::NodeStream;

/// Send at once (not only at the next poll) when this much is waiting in one send buffer.
const EAGER_WRITE_BYTES: usize = 256 << 10;
/// Events taken from one `epoll_wait`.
const EVENTS_MAX: usize = 256;
/// The epoll token of the context's [`crate::Waker`] (connections use their index).
const WAKE_TOKEN: u64 = u64::MAX;
/// The descriptor a caller asked [`NetContext::poll`] to watch.
const WATCH_TOKEN: u64 = u64::MAX - 1;
/// Pause before a Redis Cluster request is routed again after a failure.
const CLUSTER_RETRY_DELAY: Duration = Duration::from_millis(50);
/// Slot-map refreshes of one cluster, at most one per this interval.
const REFRESH_INTERVAL_MIN: Duration = Duration::from_millis(100);
/// Redirections of one request before it fails.
const REDIRECTS_MAX: u32 = 16;
const NO_CONN: u32 = u32::MAX;

enum Member {
    Node { conn: usize },
    Cluster(Box<ClusterRoute>),
}

struct ClusterRoute {
    /// Connection index per slot (`NO_CONN`: unknown).
    slots: Vec<u32>,
    /// Current masters: connection and one slot each owns (for the flush's scratch key).
    masters: Vec<(usize, Vec<u8>)>,
    stale: bool,
    last_refresh: Option<Instant>,
    /// Why the last refresh found no slot map (each node's `CLUSTER SLOTS` failed), for
    /// the message of the requests that wait on it.
    refresh_error: Option<String>,
}

/// A Redis Cluster request waiting to be routed again.
struct Retry {
    at: Instant,
    token: u64,
    deadline: Instant,
    member: usize,
    owned: Box<Owned>,
    /// `MOVED`/`ASK` target.
    target: Option<String>,
    asking: bool,
    cause: String,
}

struct FlushState {
    token: u64,
    remaining: usize,
    error: Option<Error>,
}

/// Why a connection is being closed.
enum Failure {
    Lost(String),
    Protocol(String),
    TimedOut,
}

/// Everything the reply handlers touch besides the connection itself.
struct Sink {
    shared: Arc<Shared>,
    /// `Shared::losses` as of this context's last flush (or its start).
    lost_seen: u64,
    ready: VecDeque<(u64, Result<Outcome<'static>>)>,
    retries: VecDeque<Retry>,
    flushes: HashMap<u64, FlushState>,
    /// Clusters whose slot map needs a refresh, and slots learnt from `MOVED`.
    stale: Vec<usize>,
    moved: Vec<(usize, u16, String)>,
    in_flight: usize,
    delivered: usize,
    stats: IoStats,
    request_timeout_ms: u64,
}

impl Sink {
    fn complete(&mut self, token: u64, result: Result<Outcome<'_>>, on_complete: &mut dyn FnMut(Completion<'_>)) {
        self.in_flight -= 1;
        self.delivered += 1;
        on_complete(Completion { token, result });
    }

    fn flush_part_done(&mut self, id: u64, result: Result<()>) {
        let state = self.flushes.get_mut(&id).expect("a part of a flush in progress");
        if let Err(e) = result {
            state.error.get_or_insert(e);
        }
        state.remaining -= 1;
        if state.remaining == 0 {
            let mut state = self.flushes.remove(&id).expect("just seen");
            let (lost, node) = self.shared.losses.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if std::mem::replace(&mut self.lost_seen, lost) != lost {
                state.error.get_or_insert(Error::WritesMayBeLost { node });
            }
            self.ready.push_back((state.token, state.error.map_or(Ok(Outcome::Done), Err)));
        }
    }

    fn flush_part_error(&mut self, id: u64, error: Error) {
        if let Some(state) = self.flushes.get_mut(&id) {
            state.error.get_or_insert(error);
        }
    }
}

pub(crate) struct NetContext {
    shared: Arc<Shared>,
    poll: Epoll,
    events: Vec<libc::epoll_event>,
    conns: Vec<Conn>,
    by_addr: HashMap<String, usize>,
    members: Vec<Member>,
    sink: Sink,
    next_flush_id: u64,
    /// Connections an `epoll_wait` reported: (index, readable, writable, hung up).
    woken: Vec<(usize, bool, bool, bool)>,
    /// Made by the first [`NetContext::waker`] call.
    waker: Option<Arc<EventFd>>,
    /// The caller's descriptor registered for [`NetContext::poll`] to return on.
    watched: Option<RawFd>,
}

impl NetContext {
    pub fn new(shared: Arc<Shared>) -> Result<Self> {
        let config = &shared.config;
        let lost_seen = shared.losses.lock().unwrap_or_else(|e| e.into_inner()).0;
        let sink = Sink {
            shared: Arc::clone(&shared),
            lost_seen,
            ready: VecDeque::new(),
            retries: VecDeque::new(),
            flushes: HashMap::new(),
            stale: Vec::new(),
            moved: Vec::new(),
            in_flight: 0,
            delivered: 0,
            stats: IoStats::default(),
            request_timeout_ms: config.request_timeout.as_millis() as u64,
        };
        let mut ctx = Self {
            poll: Epoll::new()?,
            events: Vec::with_capacity(EVENTS_MAX),
            conns: Vec::new(),
            by_addr: HashMap::new(),
            members: Vec::new(),
            sink,
            next_flush_id: 0,
            woken: Vec::new(),
            waker: None,
            watched: None,
            shared: Arc::clone(&shared),
        };
        for (index, node) in shared.config.nodes.iter().enumerate() {
            let member = if node.backend == Backend::RedisCluster {
                Member::Cluster(Box::new(ClusterRoute { slots: vec![NO_CONN; cluster::SLOTS], masters: Vec::new(), stale: true, last_refresh: None, refresh_error: None }))
            } else {
                Member::Node { conn: ctx.conn_for(&node.addrs[0], index) }
            };
            ctx.members.push(member);
        }
        // Connect now so the first requests do not wait; a node that is down is only noted
        // (its requests fail fast until it is back), but a node over its connection limit
        // refuses the context.
        for index in 0..ctx.members.len() {
            match &ctx.members[index] {
                Member::Node { conn } => {
                    let conn = *conn;
                    if let Err(e @ Error::ConnectionLimit { .. }) = ctx.ensure_connected(conn) {
                        return Err(e);
                    }
                }
                Member::Cluster(_) => ctx.refresh(index, Instant::now()),
            }
        }
        Ok(ctx)
    }

    pub fn in_flight(&self) -> usize {
        self.sink.in_flight
    }

    pub fn in_flight_max(&self) -> usize {
        self.shared.config.in_flight_max
    }

    /// A handle that makes a [`NetContext::poll`] in progress (or the next one) return.
    pub fn waker(&mut self) -> Result<Arc<EventFd>> {
        if let Some(waker) = &self.waker {
            return Ok(Arc::clone(waker));
        }
        // Edge-triggered: each signal is one wake-up, and nothing needs to read the counter.
        let waker = Arc::new(EventFd::new()?);
        self.poll.register(waker.as_raw_fd(), WAKE_TOKEN, true, false)?;
        self.waker = Some(Arc::clone(&waker));
        Ok(waker)
    }

    pub fn stats(&self) -> IoStats {
        self.sink.stats
    }

    /// Registers the caller's descriptor for [`NetContext::poll`] to return on (edge
    /// triggered: on data that arrives after this), replacing the one registered before. It
    /// stays registered while polls do not ask to watch it (their wake-ups for it are
    /// ignored), so a caller that switches watching on and off pays no system call for it.
    fn watch(&mut self, fd: RawFd) -> Result<()> {
        if let Some(old) = self.watched.take() {
            // It may be closed already (then epoll dropped it by itself).
            let _ = self.poll.deregister(old);
        }
        self.poll.register(fd, WATCH_TOKEN, true, false)?;
        self.watched = Some(fd);
        Ok(())
    }

    fn spec(&self, member: usize) -> &NodeSpec {
        &self.shared.config.nodes[member]
    }

    /// The connection to `addr` for pool member `member`, made (unconnected) if new.
    fn conn_for(&mut self, addr: &str, member: usize) -> usize {
        if let Some(&index) = self.by_addr.get(addr) {
            return index;
        }
        let backend = self.shared.config.nodes[member].backend;
        self.conns.push(Conn::new(addr.to_owned(), member, backend, self.shared.config.backoff_min));
        self.by_addr.insert(addr.to_owned(), self.conns.len() - 1);
        self.conns.len() - 1
    }

    /// Connects `ci` unless it is connected or in back-off. An idle connection is first
    /// checked for a close by the node (a restart while nothing was in flight), so that the
    /// next requests go on a new connection instead of failing on the old one.
    fn ensure_connected(&mut self, ci: usize) -> Result<()> {
        if self.conns[ci].stream.is_some() && self.conns[ci].sent.is_empty() {
            self.sink.stats.recv_syscalls += 1;
            match self.conns[ci].stream.as_ref().map(NodeStream::peek_nonblocking) {
                Some(Ok(0)) => self.conn_failed(ci, Failure::Lost("closed by the node while idle".into())),
                Some(Err(e)) if e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::Interrupted => {
                    self.conn_failed(ci, Failure::Lost(e.to_string()));
                }
                _ => {}
            }
        }
        let config = &self.shared.config;
        let conn = &mut self.conns[ci];
        if conn.stream.is_some() {
            return Ok(());
        }
        let now = Instant::now();
        if conn.down_until.is_some_and(|until| now < until) {
            return Err(Error::NodeDown { node: conn.addr.clone(), reason: format!("{} (retrying with back-off)", conn.last_error) });
        }
        let spec = &config.nodes[conn.member];
        if !conn.reserved {
            self.shared.reserve_connection(&conn.addr, spec.max_connections.unwrap_or(config.connections_per_node_max))?;
            conn.reserved = true;
        }
        match conn::connect(&conn.addr, conn.backend, spec.text_protocol, spec.credentials.as_ref(), spec.tls.as_ref(), config.connect_timeout) {
            Ok((stream, (wire, instance))) => {
                stream.set_nonblocking(true)?;
                self.poll.register(stream.as_raw_fd(), ci as u64, true, true)?;
                if let Some(instance) = &instance {
                    self.shared.note_instance(&conn.addr, instance);
                }
                conn.instance_known = instance.is_some();
                conn.stream = Some(stream);
                conn.wire = wire;
                conn.down_until = None;
                conn.backoff = config.backoff_min;
                conn.reset_buffers();
                self.sink.stats.connects += 1;
                Ok(())
            }
            Err(reason) => {
                conn.down_until = Some(now + conn.backoff);
                conn.backoff = (conn.backoff * 2).min(config.backoff_max);
                conn.last_error = reason.clone();
                conn.reserved = false;
                self.shared.release_connection(&conn.addr);
                Err(Error::NodeDown { node: conn.addr.clone(), reason })
            }
        }
    }

    fn admit(&mut self, k: &[u8], value: &[u8]) -> Result<()> {
        key::check(k)?;
        let max = self.shared.config.value_size_max_bytes;
        if value.len() > max {
            return Err(Error::ValueTooLarge { len: value.len(), max });
        }
        if self.sink.in_flight >= self.shared.config.in_flight_max {
            return Err(Error::QueueFull { max: self.shared.config.in_flight_max });
        }
        self.sink.in_flight += 1;
        Ok(())
    }

    pub fn submit_get(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.submit(Op::Get, k, &[], token)
    }

    pub fn submit_exists(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.submit(Op::Exists, k, &[], token)
    }

    pub fn submit_set(&mut self, k: &[u8], value: &[u8], token: u64) -> Result<()> {
        self.submit(Op::Set, k, value, token)
    }

    pub fn submit_delete(&mut self, k: &[u8], token: u64) -> Result<()> {
        self.submit(Op::Delete, k, &[], token)
    }

    fn submit(&mut self, op: Op, k: &[u8], value: &[u8], token: u64) -> Result<()> {
        self.admit(k, value)?;
        let deadline = Instant::now() + self.shared.config.request_timeout;
        let member = self.shared.ring.locate(k);
        match &self.members[member] {
            Member::Node { conn } => {
                let ci = *conn;
                self.send_request(ci, op, k, value, Sent { token, op: SentOp::Request(op), deadline, retry: None });
            }
            Member::Cluster(_) => {
                let owned = Box::new(Owned { op, key: k.to_vec(), value: value.to_vec(), redirects: 0 });
                self.route_cluster(Retry { at: Instant::now(), token, deadline, member, owned, target: None, asking: false, cause: String::new() });
            }
        }
        Ok(())
    }

    /// Queues a request on a single node's connection, or fails it at once.
    fn send_request(&mut self, ci: usize, op: Op, k: &[u8], value: &[u8], sent: Sent) {
        if let Err(e) = self.ensure_connected(ci) {
            self.sink.ready.push_back((sent.token, Err(e)));
            return;
        }
        let conn = &mut self.conns[ci];
        if let Wire::Memcache(dialect) = conn.wire
            && let Some(reason) = memcache::key_problem(dialect, k)
        {
            let e = Error::KeyNotRepresentable { node: conn.addr.clone(), key: String::from_utf8_lossy(k).into_owned(), reason };
            self.sink.ready.push_back((sent.token, Err(e)));
            return;
        }
        conn.push_request(op, k, value, sent);
        self.write_if_large(ci);
    }

    fn write_if_large(&mut self, ci: usize) {
        if self.conns[ci].unsent_bytes() >= EAGER_WRITE_BYTES {
            self.write_conn(ci);
        }
    }

    /// Routes a Redis Cluster request: to its redirection target, else by slot. When the
    /// node is unknown or down, it waits (slot map marked stale) and is tried again.
    fn route_cluster(&mut self, mut retry: Retry) {
        let ci = match retry.target.take() {
            Some(addr) => self.conn_for(&addr, retry.member),
            None => {
                let Member::Cluster(route) = &self.members[retry.member] else { unreachable!("cluster member") };
                match route.slots[usize::from(cluster::slot(&retry.owned.key))] {
                    NO_CONN => {
                        retry.cause = match &route.refresh_error {
                            Some(why) => format!("no master known for the key's slot (the slot map could not be read: {why})"),
                            None => "no master known for the key's slot".into(),
                        };
                        self.retry_later(retry);
                        return;
                    }
                    ci => ci as usize,
                }
            }
        };
        if let Err(e) = self.ensure_connected(ci) {
            if let Error::ConnectionLimit { .. } = e {
                self.sink.ready.push_back((retry.token, Err(e)));
                return;
            }
            retry.cause = e.to_string();
            retry.asking = false;
            self.retry_later(retry);
            return;
        }
        let conn = &mut self.conns[ci];
        if retry.asking {
            conn.push_control(Sent { token: retry.token, op: SentOp::Asking, deadline: retry.deadline, retry: None }, &[], 0);
        }
        let Retry { token, deadline, owned, .. } = retry;
        let op = owned.op;
        conn.encode_request(op, &owned.key, &owned.value);
        conn.record(Sent { token, op: SentOp::Request(op), deadline, retry: Some(owned) });
        self.write_if_large(ci);
    }

    fn retry_later(&mut self, mut retry: Retry) {
        self.sink.stale.push(retry.member);
        retry.at = Instant::now() + CLUSTER_RETRY_DELAY;
        self.sink.retries.push_back(retry);
    }

    pub fn submit_flush(&mut self, token: u64) -> Result<()> {
        if self.sink.in_flight >= self.shared.config.in_flight_max {
            return Err(Error::QueueFull { max: self.shared.config.in_flight_max });
        }
        self.sink.in_flight += 1;
        let id = self.next_flush_id;
        self.next_flush_id += 1;
        self.sink.flushes.insert(id, FlushState { token, remaining: 0, error: None });
        let deadline = Instant::now() + self.shared.config.request_timeout;
        let mut targets: Vec<(usize, Vec<u8>)> = Vec::new();
        for (member, entry) in self.members.iter().enumerate() {
            match entry {
                Member::Node { conn } => targets.push((*conn, cluster::key_in_slot(0))),
                Member::Cluster(route) if route.masters.is_empty() => {
                    let e = Error::Cluster { detail: format!("no master of {} is known", self.spec(member).name()) };
                    self.sink.flush_part_error(id, e);
                }
                Member::Cluster(route) => targets.extend(route.masters.iter().cloned()),
            }
        }
        // One part per target, plus one settled below, so the flush cannot finish before
        // every part is queued.
        self.sink.flushes.get_mut(&id).expect("just made").remaining = targets.len() + 1;
        for (ci, scratch_key) in targets {
            if let Err(e) = self.ensure_connected(ci) {
                self.sink.flush_part_done(id, Err(e));
                continue;
            }
            let spec = self.spec(self.conns[ci].member).clone();
            let wait_ms = self.shared.config.wait_timeout.as_millis() as u64;
            let sent = |part| Sent { token, op: SentOp::Flush { id, part }, deadline, retry: None };
            let conn = &mut self.conns[ci];
            match (spec.backend, spec.flush) {
                (Backend::Kura, FlushMode::Sync) => conn.push_control(sent(FlushPart::Sync), &[], 0),
                (Backend::Kura | Backend::Memcached, _) => conn.push_control(sent(FlushPart::Noop), &[], 0),
                (_, _) if spec.replicas == 0 => conn.push_control(sent(FlushPart::Ping), &[], 0),
                (_, _) => {
                    conn.push_control(sent(FlushPart::ScratchWrite), &scratch_key, 0);
                    conn.push_control(sent(FlushPart::Wait { replicas: spec.replicas }), &[], wait_ms);
                }
            }
        }
        self.sink.flush_part_done(id, Ok(()));
        Ok(())
    }

    pub fn poll(&mut self, timeout: Option<Duration>, watch: Option<RawFd>, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<usize> {
        if let Some(fd) = watch
            && self.watched != Some(fd)
        {
            self.watch(fd)?;
        }
        let until = timeout.map(|t| Instant::now() + t);
        self.sink.delivered = 0;
        loop {
            let now = Instant::now();
            self.apply_moves();
            self.refresh_stale(now);
            self.run_retries(now);
            for ci in 0..self.conns.len() {
                if self.conns[ci].unsent_bytes() > 0 {
                    self.write_conn(ci);
                }
            }
            self.deliver_ready(on_complete);
            if self.sink.delivered > 0 || self.sink.in_flight == 0 {
                break;
            }
            let now = Instant::now();
            let mut wake = self.next_wake().unwrap_or(now + Duration::from_secs(1));
            if let Some(until) = until {
                if now >= until {
                    break;
                }
                wake = wake.min(until);
            }
            self.sink.stats.polls += 1;
            // Look for the replies without sleeping for a while first (`poll_spin`): waking
            // a sleeping thread is most of a round trip on a virtual machine.
            let spun = self.spin_for_events(wake);
            let waited = if spun { Ok(()) } else { self.poll.wait(&mut self.events, Some(wake.saturating_duration_since(Instant::now()))) };
            match waited {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
            self.woken.clear();
            let mut woken_up = false;
            for event in self.events.iter().map(crate::fd::ready) {
                if event.token == WAKE_TOKEN {
                    woken_up = true;
                    continue;
                }
                if event.token == WATCH_TOKEN {
                    woken_up |= watch.is_some();
                    continue;
                }
                self.woken.push((event.token as usize, event.readable, event.writable, event.hung_up));
            }
            for i in 0..self.woken.len() {
                let (ci, readable, writable, hung_up) = self.woken[i];
                if readable {
                    self.read_conn(ci, hung_up, on_complete);
                }
                if writable && self.conns[ci].unsent_bytes() > 0 {
                    self.write_conn(ci);
                }
            }
            self.check_timeouts(Instant::now());
            if woken_up {
                self.deliver_ready(on_complete);
                break;
            }
        }
        Ok(self.sink.delivered)
    }

    /// Polls without sleeping, yielding the CPU between looks, until an event comes (`true`,
    /// in `self.events`), or `false` when `poll_spin` has passed, `wake` has come or the CPU
    /// is wanted (see [`kura_engine::spin`]).
    fn spin_for_events(&mut self, wake: Instant) -> bool {
        let spin = self.shared.config.poll_spin;
        if spin.is_zero() {
            return false;
        }
        kura_engine::spin::look_for(spin, || match self.poll.wait(&mut self.events, Some(Duration::ZERO)) {
            Ok(()) if !self.events.is_empty() => Some(true),
            Err(e) if e.kind() != std::io::ErrorKind::Interrupted => Some(false),
            _ => (Instant::now() >= wake).then_some(false),
        })
        .unwrap_or(false)
    }

    /// The earliest request deadline, retry or refresh.
    fn next_wake(&self) -> Option<Instant> {
        let deadlines = self.conns.iter().filter_map(|c| c.sent.front().map(|s| s.deadline));
        let retries = self.sink.retries.iter().map(|r| r.at);
        deadlines.chain(retries).min()
    }

    fn deliver_ready(&mut self, on_complete: &mut dyn FnMut(Completion<'_>)) {
        while let Some((token, result)) = self.sink.ready.pop_front() {
            self.sink.complete(token, result, on_complete);
        }
    }

    fn write_conn(&mut self, ci: usize) {
        if let Err(e) = self.conns[ci].write_out(&mut self.sink.stats) {
            self.conn_failed(ci, Failure::Lost(format!("send: {e}")));
        }
    }

    /// Reads what arrived and handles every complete reply. After a hang-up it reads on to
    /// the end of the stream (a node that answers part of a batch and closes at once sends
    /// both in one edge), so the rest fail now as lost, not later by the timeout.
    fn read_conn(&mut self, ci: usize, hung_up: bool, on_complete: &mut dyn FnMut(Completion<'_>)) {
        let config = &self.shared.config;
        let buffer_max = config.read_buffer_bytes.max(config.value_size_max_bytes + 4096);
        let (buffer_bytes, value_max) = (config.read_buffer_bytes, config.value_size_max_bytes);
        let failure = loop {
            let conn = &mut self.conns[ci];
            match conn.read_some(buffer_bytes, buffer_max, &mut self.sink.stats) {
                Ok(None) => break None,
                Ok(Some((_, more))) => {
                    if let Err(detail) = handle_replies(conn, &mut self.sink, value_max, on_complete) {
                        break Some(Failure::Protocol(detail));
                    }
                    if !more && !hung_up {
                        break None;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => break Some(Failure::Protocol(e.to_string())),
                Err(e) => break Some(Failure::Lost(e.to_string())),
            }
        };
        if let Some(failure) = failure {
            self.conn_failed(ci, failure);
        }
    }

    fn check_timeouts(&mut self, now: Instant) {
        for ci in 0..self.conns.len() {
            if self.conns[ci].sent.front().is_some_and(|s| s.deadline <= now) {
                self.conn_failed(ci, Failure::TimedOut);
            }
        }
    }

    /// Closes a connection and settles every request on it.
    fn conn_failed(&mut self, ci: usize, failure: Failure) {
        let now = Instant::now();
        let conn = &mut self.conns[ci];
        if let Some(stream) = conn.stream.take() {
            let _ = self.poll.deregister(stream.as_raw_fd());
            self.sink.stats.disconnects += 1;
            // Of a known instance, the next connection's handshake tells whether it restarted.
            if !conn.instance_known {
                self.shared.note_loss(&conn.addr);
            }
        }
        if conn.reserved {
            conn.reserved = false;
            self.shared.release_connection(&conn.addr);
        }
        conn.reset_buffers();
        let addr = conn.addr.clone();
        match &failure {
            // A node that answers garbage is not asked again at once.
            Failure::Protocol(detail) => {
                conn.down_until = Some(now + conn.backoff);
                conn.backoff = (conn.backoff * 2).min(self.shared.config.backoff_max);
                conn.last_error = format!("protocol error: {detail}");
                tracing::warn!(node = addr, detail, "closing a connection after a protocol error");
            }
            Failure::Lost(reason) => {
                conn.last_error = reason.clone();
                tracing::debug!(node = addr, reason, "connection lost");
            }
            Failure::TimedOut => conn.last_error = "a request timed out".into(),
        }
        let member = conn.member;
        let timeout_ms = self.sink.request_timeout_ms;
        let error = |deadline: Instant| match &failure {
            Failure::Lost(reason) => Error::ConnectionLost { node: addr.clone(), reason: reason.clone() },
            Failure::Protocol(detail) => Error::Protocol { node: addr.clone(), detail: detail.clone() },
            Failure::TimedOut if deadline <= now => Error::Timeout { node: addr.clone(), timeout_ms },
            Failure::TimedOut => Error::ConnectionLost { node: addr.clone(), reason: "closed after an earlier request timed out".into() },
        };
        let sent: Vec<Sent> = self.conns[ci].sent.drain(..).collect();
        for s in sent {
            match s.op {
                SentOp::Asking => {}
                SentOp::Flush { id, part: FlushPart::ScratchWrite } => self.sink.flush_part_error(id, error(s.deadline)),
                SentOp::Flush { id, .. } => self.sink.flush_part_done(id, Err(error(s.deadline))),
                SentOp::Request(_) => match s.retry {
                    Some(owned) if s.deadline > now && !matches!(failure, Failure::Protocol(_)) => {
                        self.sink.stats.redirects += 1;
                        let cause = error(s.deadline).to_string();
                        self.retry_later(Retry { at: now, token: s.token, deadline: s.deadline, member, owned, target: None, asking: false, cause });
                    }
                    _ => self.sink.ready.push_back((s.token, Err(error(s.deadline)))),
                },
            }
        }
    }

    fn run_retries(&mut self, now: Instant) {
        let count = self.sink.retries.len();
        for _ in 0..count {
            let retry = self.sink.retries.pop_front().expect("counted");
            if retry.at > now {
                self.sink.retries.push_back(retry);
            } else if retry.deadline <= now {
                let detail = format!("no answer within {} ms: {}", self.sink.request_timeout_ms, retry.cause);
                self.sink.ready.push_back((retry.token, Err(Error::Cluster { detail })));
            } else {
                self.route_cluster(retry);
            }
        }
    }

    fn apply_moves(&mut self) {
        for (member, slot, addr) in std::mem::take(&mut self.sink.moved) {
            let ci = self.conn_for(&addr, member) as u32;
            if let Member::Cluster(route) = &mut self.members[member] {
                route.slots[usize::from(slot)] = ci;
                route.stale = true;
            }
        }
    }

    fn refresh_stale(&mut self, now: Instant) {
        for member in std::mem::take(&mut self.sink.stale) {
            if let Member::Cluster(route) = &mut self.members[member] {
                route.stale = true;
            }
        }
        for member in 0..self.members.len() {
            let due = match &self.members[member] {
                Member::Cluster(route) => route.stale && route.last_refresh.is_none_or(|t| now.duration_since(t) >= REFRESH_INTERVAL_MIN),
                Member::Node { .. } => false,
            };
            if due {
                self.refresh(member, now);
            }
        }
    }

    /// Asks the cluster's nodes for the slot map (blocking, each bounded by the connect
    /// timeout): the current masters first, then the seeds.
    fn refresh(&mut self, member: usize, now: Instant) {
        let Member::Cluster(route) = &self.members[member] else { return };
        let mut candidates: Vec<String> = route.masters.iter().map(|(ci, _)| self.conns[*ci].addr.clone()).collect();
        candidates.extend(self.spec(member).addrs.iter().cloned());
        candidates.extend(self.conns.iter().filter(|c| c.member == member).map(|c| c.addr.clone()));
        candidates.dedup();
        self.sink.stats.topology_refreshes += 1;
        let timeout = self.shared.config.connect_timeout;
        let mut ranges = None;
        let mut error = None;
        for addr in &candidates {
            // Nodes known to be down are skipped while in back-off.
            if self.by_addr.get(addr).is_some_and(|&ci| self.conns[ci].down_until.is_some_and(|t| now < t)) {
                continue;
            }
            match conn::cluster_slots(addr, self.spec(member).credentials.as_ref(), self.spec(member).tls.as_ref(), timeout) {
                Ok(r) if !r.is_empty() => {
                    ranges = Some(r);
                    break;
                }
                Ok(_) => {
                    tracing::debug!(addr, "CLUSTER SLOTS: no slots assigned yet");
                    error = Some(format!("{addr}: no slots assigned yet"));
                }
                Err(e) => {
                    tracing::debug!(addr, error = e, "CLUSTER SLOTS failed");
                    error = Some(format!("{addr}: {e}"));
                }
            }
        }
        let mut slots = vec![NO_CONN; cluster::SLOTS];
        let mut masters: Vec<(usize, Vec<u8>)> = Vec::new();
        if let Some(ranges) = &ranges {
            for range in ranges {
                let ci = self.conn_for(&range.master, member);
                slots[usize::from(range.first)..=usize::from(range.last)].fill(ci as u32);
                if !masters.iter().any(|(c, _)| *c == ci) {
                    masters.push((ci, cluster::key_in_slot(range.first)));
                }
            }
        }
        let Member::Cluster(route) = &mut self.members[member] else { return };
        route.last_refresh = Some(now);
        route.refresh_error = if ranges.is_some() { None } else { error };
        if ranges.is_some() {
            route.slots = slots;
            route.masters = masters;
            route.stale = false;
        }
    }
}

impl Drop for NetContext {
    fn drop(&mut self) {
        for conn in &self.conns {
            if conn.reserved {
                self.shared.release_connection(&conn.addr);
            }
        }
    }
}

/// Parses and settles every complete reply in `conn`'s receive buffer. `Err` is a protocol
/// violation: the request it was for stays at the head of `conn.sent`.
fn handle_replies(conn: &mut Conn, sink: &mut Sink, value_max: usize, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<(), String> {
    while conn.in_start < conn.in_end {
        let buf = &conn.inbuf[conn.in_start..conn.in_end];
        let used = match conn.wire {
            Wire::Memcache(_) => {
                let Some((reply, used)) = memcache::parse_reply(buf, value_max)? else { break };
                let sent = conn.sent.pop_front().ok_or("a reply to no request")?;
                if let Err((detail, sent)) = settle_memcache(sent, reply, &conn.addr, sink, on_complete) {
                    conn.sent.push_front(sent);
                    return Err(detail);
                }
                used
            }
            Wire::Resp => {
                let Some((reply, used)) = resp::parse_reply(buf, value_max)? else { break };
                let sent = conn.sent.pop_front().ok_or("a reply to no request")?;
                if let Err((detail, sent)) = settle_resp(sent, reply, &conn.addr, conn.member, sink, on_complete) {
                    conn.sent.push_front(sent);
                    return Err(detail);
                }
                used
            }
        };
        sink.stats.replies_received += 1;
        conn.in_start += used;
    }
    Ok(())
}

fn server_error(addr: &str, kind: &str, message: &[u8]) -> Error {
    Error::Server { node: addr.to_owned(), message: format!("{kind} {}", String::from_utf8_lossy(message)).trim().to_owned() }
}

fn settle_memcache(sent: Sent, reply: McReply<'_>, addr: &str, sink: &mut Sink, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<(), (String, Sent)> {
    let result: Result<Outcome<'_>> = match (sent.op, reply) {
        (_, McReply::ServerError(m)) => Err(server_error(addr, "SERVER_ERROR", m)),
        (_, McReply::ClientError(m)) => Err(server_error(addr, "CLIENT_ERROR", m)),
        (SentOp::Request(Op::Get), McReply::Value(data) | McReply::TextValue { data, .. }) => Ok(Outcome::Value(data)),
        (SentOp::Request(Op::Get), McReply::Miss) => Ok(Outcome::Missing),
        // `HD` to `mg <key>`; a text-only server's value to the `get` that stands in for it.
        (SentOp::Request(Op::Exists), McReply::Hd | McReply::Value(_) | McReply::TextValue { .. }) => Ok(Outcome::Done),
        (SentOp::Request(Op::Exists), McReply::Miss) => Ok(Outcome::Missing),
        (SentOp::Request(Op::Set), McReply::Hd | McReply::Stored) => Ok(Outcome::Done),
        (SentOp::Request(Op::Set), McReply::NotStored) => Err(Error::Server { node: addr.to_owned(), message: "not stored".into() }),
        (SentOp::Request(Op::Delete), McReply::Hd | McReply::Deleted | McReply::NotFound) => Ok(Outcome::Done),
        (SentOp::Flush { part: FlushPart::Sync, .. }, McReply::Ok) => Ok(Outcome::Done),
        (SentOp::Flush { part: FlushPart::Sync, .. }, McReply::Error) => Err(Error::FlushUnsupported {
            node: addr.to_owned(),
            reason: "it answered ERROR to `sync` (a kura server without the sync command, or not a kura server); \
                     run it with --sync always and name it kura://…?flush=ack"
                .into(),
        }),
        (SentOp::Flush { part: FlushPart::Noop, .. }, McReply::Noop | McReply::Version(_)) => Ok(Outcome::Done),
        (_, McReply::Error) => Err(Error::Server { node: addr.to_owned(), message: "ERROR (unknown command)".into() }),
        (op, other) => return Err((format!("{other:?} is no answer to {op:?}"), sent)),
    };
    match sent.op {
        SentOp::Flush { id, .. } => sink.flush_part_done(id, result.map(|_| ())),
        _ => sink.complete(sent.token, result, on_complete),
    }
    Ok(())
}

/// A Redis Cluster error that means "ask elsewhere or later".
enum Redirect {
    Moved { slot: u16, addr: String },
    Ask { addr: String },
    Later,
}

fn redirect(message: &[u8]) -> Option<Redirect> {
    let text = std::str::from_utf8(message).ok()?;
    let mut words = text.split(' ');
    match words.next()? {
        "MOVED" => Some(Redirect::Moved { slot: words.next()?.parse().ok()?, addr: words.next()?.to_owned() }),
        "ASK" => {
            words.next()?;
            Some(Redirect::Ask { addr: words.next()?.to_owned() })
        }
        "TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN" => Some(Redirect::Later),
        _ => None,
    }
}

fn settle_resp(sent: Sent, reply: Resp<'_>, addr: &str, member: usize, sink: &mut Sink, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<(), (String, Sent)> {
    if let (Resp::Error(message), Some(_)) = (&reply, &sent.retry)
        && let Some(redirect) = redirect(message)
    {
        let mut owned = sent.retry.expect("checked");
        owned.redirects += 1;
        sink.stats.redirects += 1;
        if owned.redirects > REDIRECTS_MAX {
            let detail = format!("more than {REDIRECTS_MAX} redirections; last: {}", String::from_utf8_lossy(message));
            sink.complete(sent.token, Err(Error::Cluster { detail }), on_complete);
            return Ok(());
        }
        let cause = String::from_utf8_lossy(message).into_owned();
        let mut retry = Retry { at: Instant::now(), token: sent.token, deadline: sent.deadline, member, owned, target: None, asking: false, cause };
        match redirect {
            Redirect::Moved { slot, addr } => {
                sink.moved.push((member, slot, addr.clone()));
                retry.target = Some(addr);
            }
            Redirect::Ask { addr } => {
                retry.target = Some(addr);
                retry.asking = true;
            }
            Redirect::Later => {
                sink.stale.push(member);
                retry.at += CLUSTER_RETRY_DELAY;
            }
        }
        sink.retries.push_back(retry);
        return Ok(());
    }
    let result: Result<Outcome<'_>> = match (sent.op, &reply) {
        (SentOp::Asking, Resp::Simple(b"OK")) => return Ok(()),
        (SentOp::Flush { part: FlushPart::ScratchWrite, .. }, Resp::Simple(b"OK")) => return Ok(()),
        (SentOp::Flush { id, part: FlushPart::ScratchWrite }, Resp::Error(m)) => {
            sink.flush_part_error(id, server_error(addr, "", m));
            return Ok(());
        }
        (_, Resp::Error(m)) => Err(server_error(addr, "", m)),
        (SentOp::Request(Op::Get), Resp::Bulk(data)) => Ok(Outcome::Value(data)),
        (SentOp::Request(Op::Get), Resp::Nil) => Ok(Outcome::Missing),
        (SentOp::Request(Op::Exists), Resp::Int(1)) => Ok(Outcome::Done),
        (SentOp::Request(Op::Exists), Resp::Int(0)) => Ok(Outcome::Missing),
        (SentOp::Request(Op::Set), Resp::Simple(b"OK")) => Ok(Outcome::Done),
        (SentOp::Request(Op::Delete), Resp::Int(_)) => Ok(Outcome::Done),
        (SentOp::Flush { part: FlushPart::Ping, .. }, Resp::Simple(b"PONG")) => Ok(Outcome::Done),
        (SentOp::Flush { part: FlushPart::Wait { replicas }, .. }, Resp::Int(acked)) if *acked >= i64::from(replicas) => Ok(Outcome::Done),
        (SentOp::Flush { part: FlushPart::Wait { replicas }, .. }, Resp::Int(acked)) => Err(Error::FlushIncomplete { node: addr.to_owned(), acked: *acked, wanted: replicas }),
        (op, other) => return Err((format!("{other:?} is no answer to {op:?}"), sent)),
    };
    match sent.op {
        SentOp::Flush { id, .. } => sink.flush_part_done(id, result.map(|_| ())),
        _ => sink.complete(sent.token, result, on_complete),
    }
    Ok(())
}
