//! Server counters: memcached's `stats` fields and the Prometheus exposition.
//!
//! Each worker counts into its own [`WorkerStats`] (relaxed atomics, written
//! by one thread); `stats` and `/metrics` add them up.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::store::Store;

macro_rules! counters {
    ($(#[$doc:meta])* $name:ident { $($field:ident),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Default)]
        pub struct $name {
            $(pub $field: AtomicU64,)*
        }

        impl $name {
            /// Every counter, by its memcached name.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field.load(Ordering::Relaxed)),)*]
            }

            /// Every counter back to 0 (`stats reset`).
            pub fn reset(&self) {
                $(self.$field.store(0, Ordering::Relaxed);)*
            }
        }
    };
}

counters!(
    /// Per-worker command counters (memcached's names).
    WorkerStats {
        cmd_get, cmd_set, cmd_flush, cmd_touch, cmd_meta,
        get_hits, get_misses,
        delete_misses, delete_hits,
        incr_misses, incr_hits, decr_misses, decr_hits,
        cas_misses, cas_hits, cas_badval,
        touch_hits, touch_misses,
        auth_cmds, auth_errors,
        bytes_read, bytes_written,
        ram_cache_hits, flash_gets, flash_reads,
        protocol_errors, server_errors,
        store_too_large, store_no_memory,
        poll_spin_found, poll_spin_slept,
    }
);

/// Connection counters, shared by the acceptor and the workers.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub curr_connections: AtomicU64,
    pub total_connections: AtomicU64,
    pub rejected_connections: AtomicU64,
    pub idle_kicks: AtomicU64,
    /// An `lru_crawler metadump` or `crawl` is running (one at a time in the server, as
    /// memcached's crawler); jobs started.
    pub lru_crawler_running: Arc<std::sync::atomic::AtomicBool>,
    pub lru_crawler_starts: AtomicU64,
    /// Every listener and connection, for `stats conns`.
    pub registry: ConnRegistry,
}

/// The listeners and open connections by file descriptor, as `stats conns` lists them
/// (memcached walks its table of connections by fd). A connection registers when a worker
/// takes it and leaves when it closes; at most `-c` connections plus the listeners.
#[derive(Debug, Default)]
pub struct ConnRegistry {
    entries: std::sync::Mutex<std::collections::BTreeMap<i32, Arc<ConnEntry>>>,
}

/// A listener's or a connection's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnAddr {
    Tcp(SocketAddr),
    /// A Unix socket's path (empty for a client's end, which has no name).
    Unix(String),
}

/// One listener or connection in the [`ConnRegistry`].
#[derive(Debug)]
pub struct ConnEntry {
    /// The peer's address (a listener's own); `None` if the socket could not tell.
    pub addr: Option<ConnAddr>,
    /// A listener (`conn_listening`, no `listen_addr`).
    listener: bool,
    /// The address a connection was accepted on.
    listen_addr: Option<ConnAddr>,
    /// Seconds from the server's start to the last command read (to the accept, before
    /// one): `secs_since_last_cmd` is the time since.
    last_cmd_s: AtomicU64,
    /// Replies are waiting for the client to read them (`conn_mwrite`).
    writing: std::sync::atomic::AtomicBool,
    /// The client has sent something (until then memcached lists it as `conn_new_cmd`).
    spoke: std::sync::atomic::AtomicBool,
    /// The connection sent `watch` (`conn_watch`).
    watching: std::sync::atomic::AtomicBool,
}

impl ConnEntry {
    /// A listener on `addr`, there since the server started.
    pub fn listener(addr: ConnAddr) -> Self {
        Self::new(Some(addr), true, None, 0)
    }

    /// A connection from `peer`, accepted on `listen_addr` `now_s` seconds after the start.
    pub fn connection(peer: Option<ConnAddr>, listen_addr: Option<ConnAddr>, now_s: u64) -> Self {
        Self::new(peer, false, listen_addr, now_s)
    }

    fn new(addr: Option<ConnAddr>, listener: bool, listen_addr: Option<ConnAddr>, now_s: u64) -> Self {
        Self { addr, listener, listen_addr, last_cmd_s: AtomicU64::new(now_s), writing: Default::default(), spoke: Default::default(), watching: Default::default() }
    }

    /// A command arrived `now_s` seconds after the server's start.
    pub fn touch(&self, now_s: u64) {
        self.last_cmd_s.store(now_s, Ordering::Relaxed);
        self.spoke.store(true, Ordering::Relaxed);
    }

    /// Whether replies wait for the client to read them.
    pub fn set_writing(&self, writing: bool) {
        self.writing.store(writing, Ordering::Relaxed);
    }

    /// The connection became a watcher.
    pub fn set_watching(&self) {
        self.watching.store(true, Ordering::Relaxed);
    }
}

fn yes_no(yes: bool) -> StatValue {
    StatValue::Text(if yes { "yes" } else { "no" }.to_owned())
}

/// memcached's form of an address in `stats conns`: `tcp:<ip>:<port>`, `tcp6:[<ip>]:<port>`,
/// `unix:<path>`.
fn conn_addr(addr: &Option<ConnAddr>) -> String {
    match addr {
        Some(ConnAddr::Tcp(SocketAddr::V4(a))) => format!("tcp:{a}"),
        Some(ConnAddr::Tcp(SocketAddr::V6(a))) => format!("tcp6:{a}"),
        Some(ConnAddr::Unix(path)) => format!("unix:{path}"),
        None => "tcp:?".to_owned(),
    }
}

impl ConnRegistry {
    pub fn insert(&self, fd: i32, entry: Arc<ConnEntry>) {
        self.lock().insert(fd, entry);
    }

    /// Removes `fd`'s entry if it is still `entry` (a descriptor closed and reused by a newer
    /// connection keeps the newer one's).
    pub fn remove(&self, fd: i32, entry: &Arc<ConnEntry>) {
        let mut entries = self.lock();
        if entries.get(&fd).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            entries.remove(&fd);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<i32, Arc<ConnEntry>>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `stats conns`' lines, memcached's: for each descriptor in order `<fd>:addr`,
    /// `<fd>:listen_addr` (connections), `<fd>:state` and `<fd>:secs_since_last_cmd`. The
    /// asking connection (`asking_fd`) is `conn_parse_cmd`, one whose replies wait for its
    /// client `conn_mwrite`, a watcher `conn_watch`, one that has sent nothing yet `conn_new_cmd`, the others
    /// `conn_read` (waiting for a command), listeners `conn_listening`.
    pub fn lines(&self, asking_fd: i32, now_s: u64) -> Vec<(String, String)> {
        let entries = self.lock();
        let mut lines = Vec::with_capacity(entries.len() * 4);
        for (fd, entry) in entries.iter() {
            lines.push((format!("{fd}:addr"), conn_addr(&entry.addr)));
            let state = match entry.listener {
                true => "conn_listening",
                false => {
                    lines.push((format!("{fd}:listen_addr"), conn_addr(&entry.listen_addr)));
                    if *fd == asking_fd {
                        "conn_parse_cmd"
                    } else if entry.watching.load(Ordering::Relaxed) {
                        "conn_watch"
                    } else if entry.writing.load(Ordering::Relaxed) {
                        "conn_mwrite"
                    } else if !entry.spoke.load(Ordering::Relaxed) {
                        "conn_new_cmd"
                    } else {
                        "conn_read"
                    }
                }
            };
            lines.push((format!("{fd}:state"), state.to_owned()));
            let since = now_s.saturating_sub(entry.last_cmd_s.load(Ordering::Relaxed));
            lines.push((format!("{fd}:secs_since_last_cmd"), since.to_string()));
        }
        lines
    }
}

/// What the `stats` command reports besides counters.
pub struct ServerInfo {
    pub started: Instant,
    pub started_unix_s: i64,
    pub threads: usize,
    pub max_connections: usize,
    pub item_size_max_bytes: usize,
    pub port: u16,
    /// Commands turned on or off (`-A -F -X -W`).
    pub allowed: crate::config::Allowed,
    /// What `stats settings` tells of the listeners: the Unix socket and its permissions,
    /// the backlog, and the idle timeout.
    pub domain_socket: Option<crate::config::UnixSocket>,
    pub tcp_backlog: u32,
    pub idle_timeout_s: u64,
    /// `-C -Y -R -f -n -D`.
    pub protocol: crate::config::Protocol,
    /// Random per process start ([`new_instance_id`]): a client that sees it change knows
    /// the server restarted (and may have lost writes it acknowledged but had not synced).
    pub instance_id: u64,
}

impl ServerInfo {
    /// Whole seconds from the server's start to `now` (`uptime`, and the clock of `stats
    /// conns`).
    pub fn uptime_s_at(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.started).as_secs()
    }
}

/// A number unlikely to repeat across process starts, for `kura_instance_id`. std's
/// `RandomState` is seeded from the OS's random source; the pid and the clock are mixed in
/// for good measure.
pub fn new_instance_id() -> u64 {
    use std::hash::BuildHasher as _;
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::hash::RandomState::new().hash_one((std::process::id(), now_ns))
}

/// Everything `stats` and `/metrics` read.
pub struct StatsSources {
    pub info: ServerInfo,
    pub conns: Arc<ConnStats>,
    pub workers: Vec<Arc<WorkerStats>>,
    pub store: Arc<Store>,
    /// `lru_crawler crawl` and the other crawler commands (its counters and settings).
    pub crawler: Arc<crate::crawler::Crawler>,
    /// `watch`ing connections and what they are sent.
    pub watchers: Arc<crate::watch::Watchers>,
    /// A client sent `shutdown` (with `-A`): the server stops as at SIGTERM.
    pub stop_requested: std::sync::atomic::AtomicBool,
    /// `stats detail`'s per-prefix counters.
    pub detail: crate::detail::Detail,
    /// The `-o ssl_*` options (`stats settings` shows them with TLS off too, as memcached).
    pub tls_settings: crate::tls::TlsSettings,
    /// `-Z`: the configuration new connections get, and its counters.
    pub tls: Option<Arc<crate::tls::ServerTls>>,
}

pub const VERSION: &str = concat!("1.6.18-kura-", env!("CARGO_PKG_VERSION"));

/// One `STAT` line's value.
pub enum StatValue {
    U64(u64),
    Text(String),
}

impl StatsSources {
    fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut total: Vec<(&'static str, u64)> = WorkerStats::default().snapshot();
        for worker in &self.workers {
            for (slot, (_, v)) in total.iter_mut().zip(worker.snapshot()) {
                slot.1 += v;
            }
        }
        total
    }

    /// `stats reset`, as memcached's: the counters go back to 0 (the command counters, the
    /// connections accepted and refused, idle kicks, crawler starts, items stored, expired
    /// and flushed reads) and the per-prefix counts are forgotten; what describes the present
    /// (items, bytes, connections open) stays.
    pub fn reset(&self) {
        for worker in &self.workers {
            worker.reset();
        }
        for counter in [&self.conns.total_connections, &self.conns.rejected_connections, &self.conns.idle_kicks, &self.conns.lru_crawler_starts] {
            counter.store(0, Ordering::Relaxed);
        }
        let store = &self.store.counters;
        for counter in [&store.total_items, &store.get_expired, &store.get_flushed] {
            counter.store(0, Ordering::Relaxed);
        }
        self.detail.clear();
    }

    /// The general `stats` fields, in memcached's order where it has them.
    pub fn general(&self) -> Vec<(&'static str, StatValue)> {
        use StatValue::{Text, U64};
        let counters = self.counters();
        let counter = |name: &str| {
            counters
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, v)| *v)
        };
        let engine = self.store.engine().stats();
        let cache = self.store.cache_stats();
        let store = &self.store.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let uptime_s = self.info.uptime_s_at(Instant::now());
        let (user, system) = rusage();
        let mut out = vec![
            ("pid", U64(u64::from(std::process::id()))),
            ("uptime", U64(uptime_s)),
            ("time", U64(crate::clock::unix_now_s() as u64)),
            ("version", Text(VERSION.to_owned())),
            ("pointer_size", U64(64)),
            ("rusage_user", Text(user)),
            ("rusage_system", Text(system)),
            ("max_connections", U64(self.info.max_connections as u64)),
            ("curr_connections", U64(load(&self.conns.curr_connections))),
            (
                "total_connections",
                U64(load(&self.conns.total_connections)),
            ),
            (
                "rejected_connections",
                U64(load(&self.conns.rejected_connections)),
            ),
            (
                "connection_structures",
                U64(load(&self.conns.curr_connections)),
            ),
        ];
        for name in [
            "cmd_get",
            "cmd_set",
            "cmd_flush",
            "cmd_touch",
            "cmd_meta",
            "get_hits",
            "get_misses",
        ] {
            out.push((name, U64(counter(name))));
        }
        out.push(("get_expired", U64(load(&store.get_expired))));
        out.push(("get_flushed", U64(load(&store.get_flushed))));
        for name in [
            "delete_misses",
            "delete_hits",
            "incr_misses",
            "incr_hits",
            "decr_misses",
            "decr_hits",
            "cas_misses",
            "cas_hits",
            "cas_badval",
            "touch_hits",
            "touch_misses",
            "auth_cmds",
            "auth_errors",
            "bytes_read",
            "bytes_written",
        ] {
            out.push((name, U64(counter(name))));
        }
        out.extend([
            ("limit_maxbytes", U64(engine.capacity_bytes)),
            ("accepting_conns", U64(1)),
            // kura refuses connections over `-c` (`rejected_connections`) and never stops
            // listening, as memcached does when it runs out.
            ("listen_disabled_num", U64(0)),
            ("time_in_listen_disabled_us", U64(0)),
            ("idle_kicks", U64(load(&self.conns.idle_kicks))),
            ("threads", U64(self.info.threads as u64)),
        ]);
        if self.crawler.enabled() {
            // memcached lists these only while its crawler is enabled.
            out.extend([
                ("lru_crawler_running", U64(u64::from(self.conns.lru_crawler_running.load(Ordering::Relaxed)))),
                ("lru_crawler_starts", U64(load(&self.conns.lru_crawler_starts))),
            ]);
        }
        let (crawler_items_checked, crawler_reclaimed) = self.crawler.counters();
        out.extend([
            ("bytes", U64(engine.bytes_live_estimate)),
            ("curr_items", U64(self.store.curr_items(&engine))),
            ("total_items", U64(load(&store.total_items))),
            ("evictions", U64(engine.evicted_records_estimate)),
            ("crawler_reclaimed", U64(crawler_reclaimed)),
            ("crawler_items_checked", U64(crawler_items_checked)),
            // Stores refused: an item over `-I`; no room (store mode, live data fills it).
            ("store_too_large", U64(counter("store_too_large"))),
            ("store_no_memory", U64(counter("store_no_memory"))),
            ("log_watchers", U64(self.watchers.count() as u64)),
            ("log_watcher_sent", U64(self.watchers.lines_sent())),
            ("log_watcher_skipped", U64(self.watchers.lines_skipped())),
        ]);
        if let Some(tls) = &self.tls {
            // memcached lists these only with -Z.
            out.extend([
                ("ssl_handshake_errors", U64(tls.handshake_errors.load(Ordering::Relaxed))),
                ("time_since_server_cert_refresh", U64(tls.seconds_since_refresh())),
            ]);
        }
        out.extend([
            (
                "kura_mode",
                Text(format!("{:?}", self.store.mode()).to_lowercase()),
            ),
            ("kura_ram_cache_limit_bytes", U64(cache.limit_bytes)),
            ("kura_ram_cache_bytes", U64(cache.bytes)),
            ("kura_ram_cache_items", U64(cache.entries)),
            ("kura_ram_cache_hits", U64(counter("ram_cache_hits"))),
            ("kura_ram_cache_evictions", U64(cache.evictions)),
            ("kura_ram_cache_fills", U64(load(&store.cache_fills))),
            ("kura_flash_gets", U64(counter("flash_gets"))),
            ("kura_flash_reads", U64(engine.flash_reads)),
            ("kura_flash_read_bytes", U64(engine.flash_read_bytes)),
            ("kura_flash_writes", U64(engine.flash_writes)),
            ("kura_flash_write_bytes", U64(engine.flash_write_bytes)),
            ("kura_blocks_total", U64(engine.blocks_total)),
            ("kura_blocks_used", U64(engine.blocks_used)),
            ("kura_evicted_blocks", U64(engine.evicted_blocks)),
            ("kura_gc_runs", U64(engine.gc_runs)),
            ("kura_seals", U64(engine.seals)),
            ("kura_syncs", U64(load(&store.syncs))),
            ("kura_sync_failures", U64(load(&store.sync_failures))),
            ("kura_index_bytes", U64(engine.ram.index_bytes())),
            (
                "kura_write_buffer_bytes",
                U64(engine.ram.write_buffer_data_bytes),
            ),
            // Idle spells of the workers' `--poll-spin-us` that found work without sleeping,
            // and those that ended in a sleep.
            ("kura_poll_spin_found", U64(counter("poll_spin_found"))),
            ("kura_poll_spin_slept", U64(counter("poll_spin_slept"))),
            ("kura_protocol_errors", U64(counter("protocol_errors"))),
            ("kura_server_errors", U64(counter("server_errors"))),
        ]);
        out.extend(self.changes());
        out
    }

    /// `stats changes` (kura's, and the end of `stats`): `kura_instance_id` (text, not a
    /// number: an identity, not a metric), and `kura_changes_file`, where clients on this host
    /// read the change counter (kura_engine::changes), when the store publishes it.
    pub fn changes(&self) -> Vec<(&'static str, StatValue)> {
        let mut out = vec![("kura_instance_id", StatValue::Text(format!("{:016x}", self.info.instance_id)))];
        if let Some(changes) = self.store.changes() {
            out.push(("kura_changes_file", StatValue::Text(changes.path().display().to_string())));
        }
        out
    }

    /// `stats settings`.
    pub fn settings(&self) -> Vec<(&'static str, StatValue)> {
        use StatValue::{Text, U64};
        vec![
            ("maxbytes", U64(self.store.engine().stats().capacity_bytes)),
            ("maxconns", U64(self.info.max_connections as u64)),
            ("tcpport", U64(u64::from(self.info.port))),
            ("udpport", U64(0)),
            ("num_threads", U64(self.info.threads as u64)),
            ("growth_factor", Text(format!("{:.2}", self.info.protocol.slab_growth_factor))),
            ("chunk_size", U64(u64::from(self.info.protocol.slab_chunk_size))),
            ("stat_key_prefix", Text(char::from(self.detail.delimiter()).to_string())),
            ("detail_enabled", yes_no(self.detail.enabled())),
            ("reqs_per_event", U64(u64::from(self.info.protocol.reqs_per_event))),
            ("cas_enabled", yes_no(self.info.protocol.cas_enabled)),
            ("item_size_max", U64(self.info.item_size_max_bytes as u64)),
            (
                "evictions",
                Text(
                    if self.store.mode() == kura_engine::Mode::Cache {
                        "on"
                    } else {
                        "off"
                    }
                    .to_owned(),
                ),
            ),
            ("domain_socket", Text(self.info.domain_socket.as_ref().map_or_else(|| "NULL".to_owned(), |u| u.path.display().to_string()))),
            ("umask", Text(format!("{:o}", self.info.domain_socket.as_ref().map_or(crate::config::UNIX_MASK_DEFAULT, |u| u.mode)))),
            ("shutdown_command", yes_no(self.info.allowed.shutdown)),
            ("tcp_backlog", U64(u64::from(self.info.tcp_backlog))),
            ("idle_timeout", U64(self.info.idle_timeout_s)),
            ("flush_enabled", yes_no(self.info.allowed.flush_all)),
            ("dump_enabled", yes_no(self.info.allowed.dumping)),
            ("watch_enabled", yes_no(self.info.allowed.watch)),
            ("lru_crawler", Text(if self.crawler.enabled() { "yes" } else { "no" }.to_owned())),
            ("lru_crawler_sleep", U64(u64::from(self.crawler.settings().0))),
            ("lru_crawler_tocrawl", U64(u64::from(self.crawler.settings().1))),
            ("binding_protocol", Text("ascii".to_owned())),
            ("auth_enabled_sasl", yes_no(false)),
            ("auth_enabled_ascii", Text(self.info.protocol.auth.as_ref().map_or_else(|| "no".to_owned(), |a| a.path.display().to_string()))),
            // memcached's, with or without -Z.
            ("ssl_enabled", yes_no(self.tls_settings.enabled)),
            ("ssl_chain_cert", Text(path_or(self.tls_settings.chain_cert.as_deref(), "(null)"))),
            ("ssl_key", Text(path_or(self.tls_settings.key.as_deref(), "(null)"))),
            ("ssl_verify_mode", U64(u64::from(self.tls_settings.verify_mode))),
            ("ssl_keyformat", U64(u64::from(self.tls_settings.keyformat))),
            ("ssl_ciphers", Text(self.tls_settings.ciphers.clone().unwrap_or_else(|| "NULL".to_owned()))),
            ("ssl_ca_cert", Text(path_or(self.tls_settings.ca_cert.as_deref(), "NULL"))),
            ("ssl_wbuf_size", U64(u64::from(self.tls_settings.wbuf_size_kib) * 1024)),
            ("ssl_session_cache", yes_no(self.tls_settings.session_cache)),
            ("ssl_kernel_tls", yes_no(self.tls_settings.kernel_tls)),
            ("ssl_min_version", Text(self.tls_settings.min_version_name().to_owned())),
            (
                "kura_ram_cache_limit_bytes",
                U64(self.store.cache_stats().limit_bytes),
            ),
        ]
    }

    /// The Prometheus text exposition (version 0.0.4) of the general stats.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        for (name, value) in self.general() {
            let StatValue::U64(v) = value else { continue };
            let metric = if name.starts_with("kura_") {
                name.to_owned()
            } else {
                format!("memcached_{name}")
            };
            let kind = if is_gauge(name) { "gauge" } else { "counter" };
            let _ = writeln!(out, "# TYPE {metric} {kind}\n{metric} {v}");
        }
        out
    }
}

/// A path as memcached's `stats settings` prints it, or its word for none.
fn path_or(path: Option<&std::path::Path>, none: &str) -> String {
    path.map_or_else(|| none.to_owned(), |p| p.display().to_string())
}

fn is_gauge(name: &str) -> bool {
    matches!(
        name,
        "pid"
            | "uptime"
            | "time"
            | "pointer_size"
            | "max_connections"
            | "curr_connections"
            | "connection_structures"
            | "limit_maxbytes"
            | "accepting_conns"
            | "threads"
            | "bytes"
            | "curr_items"
            | "log_watchers"
            | "time_since_server_cert_refresh"
            | "kura_ram_cache_limit_bytes"
            | "kura_ram_cache_bytes"
            | "kura_ram_cache_items"
            | "kura_blocks_total"
            | "kura_blocks_used"
            | "kura_index_bytes"
            | "kura_write_buffer_bytes"
    )
}

fn rusage() -> (String, String) {
    // SAFETY: rusage is plain data; getrusage fills it for RUSAGE_SELF.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage struct.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    if rc != 0 {
        return ("0.000000".to_owned(), "0.000000".to_owned());
    }
    let fmt = |t: libc::timeval| format!("{}.{:06}", t.tv_sec, t.tv_usec);
    (fmt(usage.ru_utime), fmt(usage.ru_stime))
}
