//! The command line of `kura serve` (and of the `kura-server` binary), with
//! memcached's option names where memcached has the option.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::config::{
    self, Allowed, Bytes, LISTEN_BACKLOG_DEFAULT, MAX_CONNECTIONS_DEFAULT, MEMORY_LIMIT_MB_DEFAULT,
    ModeArg, PORT_DEFAULT, ProcessConfig, Protocol, ServerConfig, SyncPolicy, UnixSocket,
};
use kura_engine::Mode;
use kura_proto::CrawlerCommand;

/// Serve the memcached protocol from a kura store: values on flash, hot items in RAM.
///
/// Any memcached client works unchanged (text and meta protocol; the binary
/// protocol is refused). Data survives restarts in both modes. Stop with
/// SIGTERM or Ctrl-C: the server stops accepting, answers what is in flight,
/// syncs and exits 0.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Print kura's license and exit (memcached -i prints memcached's).
    #[arg(short = 'i', long = "license")]
    pub license: bool,
    /// TCP port to listen on (memcached -p).
    #[arg(short = 'p', long = "port", default_value_t = PORT_DEFAULT)]
    pub port: u16,
    /// Address to listen on; several separated by commas, each ADDR, ADDR:PORT or [IPV6]:PORT
    /// (the port is -p's when not given), prefixed notls: for one that stays plain under -Z
    /// (memcached -l).
    #[arg(short = 'l', long = "listen", default_value = "127.0.0.1")]
    pub listen: String,
    /// Listen on this Unix socket instead of TCP (memcached -s: -p and -l are then not
    /// used). A socket left there by an earlier run is replaced; the file goes at exit.
    #[arg(short = 's', long = "unix-socket")]
    pub unix_socket: Option<PathBuf>,
    /// Permissions of the -s socket, in octal (memcached -a).
    #[arg(short = 'a', long = "unix-mask", default_value = "700", value_parser = parse_octal_mode)]
    pub unix_mask: u32,
    /// Let a client stop the server with `shutdown` or `shutdown graceful` (memcached -A):
    /// both stop it as SIGTERM does, syncing the store. Without -A, `shutdown` is refused.
    #[arg(short = 'A', long = "enable-shutdown")]
    pub enable_shutdown: bool,
    /// Run in the background (memcached -d): the command returns once the server listens
    /// (exit 0) or failed to start (its error, exit 1). The server's working directory
    /// becomes /, so relative paths are taken from where it was started; its log goes to
    /// stderr when stderr is not a terminal (a file, the journal), else nowhere.
    #[arg(short = 'd', long = "daemon")]
    pub daemon: bool,
    /// Write the server's process id to this file (memcached -P), removed at a clean exit.
    #[arg(short = 'P', long = "pidfile")]
    pub pidfile: Option<PathBuf>,
    /// When started as root, run as this user once the sockets are bound and the store is
    /// open (memcached -u); the store's files stay as root made them. Ignored when not root.
    #[arg(short = 'u', long = "user")]
    pub user: Option<String>,
    /// Never evict (memcached -M): the same as --mode store; a full store answers
    /// "SERVER_ERROR out of memory".
    #[arg(short = 'M', long = "disable-evictions")]
    pub disable_evictions: bool,
    /// Refuse flush_all ("CLIENT_ERROR flush_all not allowed"; memcached -F).
    #[arg(short = 'F', long = "disable-flush-all")]
    pub disable_flush_all: bool,
    /// Refuse lru_crawler metadump and mgdump (memcached -X).
    #[arg(short = 'X', long = "disable-dumping")]
    pub disable_dumping: bool,
    /// Refuse watch (memcached -W).
    #[arg(short = 'W', long = "disable-watch")]
    pub disable_watch: bool,
    /// Turn CAS off (memcached -C): every item's CAS value is 0 (`gets`, `mg c`, metadump),
    /// so a `cas` never stores (EXISTS, or NOT_FOUND), `ms`/`md`/`ma` with `C<n>` match only
    /// `C0`... as memcached's do, and `E` is refused.
    #[arg(short = 'C', long = "disable-cas")]
    pub disable_cas: bool,
    /// ASCII authentication (memcached -Y): FILE holds `user:password` lines. A connection's
    /// first request must then be `set <any key> <flags> <ttl> <bytes>` with `<user>
    /// <password>` as its data; it answers STORED, or "CLIENT_ERROR authentication failure"
    /// (the client may try again); any other request is answered "CLIENT_ERROR
    /// unauthenticated".
    #[arg(short = 'Y', long = "auth-file", value_name = "FILE")]
    pub auth_file: Option<PathBuf>,
    /// Requests per connection per event (memcached -R), at least 1; shown by `stats
    /// settings`. kura's workers bound each connection's turn by what one read of its input
    /// buffer holds, which already keeps a pipelining client from starving the others.
    #[arg(short = 'R', long = "max-reqs-per-event", default_value_t = config::REQS_PER_EVENT_DEFAULT)]
    pub max_reqs_per_event: u32,
    /// Growth factor of memcached's slab classes (memcached -f), above 1: kura has no slab
    /// allocator, but numbers items' classes as memcached would in `lru_crawler metadump`,
    /// `watch`, and the class lists of the crawler's commands.
    #[arg(short = 'f', long = "slab-growth-factor", default_value_t = config::SLAB_GROWTH_FACTOR_DEFAULT)]
    pub slab_growth_factor: f64,
    /// Bytes for key, value and flags in memcached's smallest slab chunk (memcached -n), at
    /// least 1: like -f, it only numbers classes.
    #[arg(short = 'n', long = "slab-min-size", default_value_t = config::SLAB_CHUNK_SIZE_DEFAULT)]
    pub slab_min_size: u32,
    /// The character that ends a key's prefix for per-prefix stats (memcached -D); giving
    /// it turns them on (`stats detail on` does too; `stats detail dump` lists them).
    #[arg(short = 'D', long = "detail-delimiter", value_name = "CHAR")]
    pub detail_delimiter: Option<String>,
    /// The protocol to speak (memcached -B): ascii, or auto (the same here). kura speaks
    /// memcached's text and meta protocols; binary is refused with an error.
    #[arg(short = 'B', long = "protocol", default_value = "auto")]
    pub protocol: String,
    /// Lock all of the server's memory into RAM (memcached -k: mlockall). When the system
    /// refuses (RLIMIT_MEMLOCK), a warning says so and the server runs unlocked, as
    /// memcached does.
    #[arg(short = 'k', long = "lock-memory")]
    pub lock_memory: bool,
    /// Raise the core file size limit to its maximum (memcached -r), so a crash leaves a
    /// core dump.
    #[arg(short = 'r', long = "enable-coredumps")]
    pub enable_coredumps: bool,
    /// memcached -L (large pages for its item memory): taken, with no effect (kura's RAM is
    /// its index, write buffers and cache; the kernel's transparent huge pages apply to it).
    #[arg(short = 'L', long = "enable-largepages")]
    pub enable_largepages: bool,
    /// memcached -S (SASL): refused with an error, as it needs memcached's binary protocol,
    /// which kura does not speak; use -Y.
    #[arg(short = 'S', long = "enable-sasl", hide_short_help = true)]
    pub enable_sasl: bool,
    /// memcached -e (item memory in a file, to restart with it): refused with an error; kura's
    /// items are in its store (--path), which every restart reopens.
    #[arg(short = 'e', long = "memory-file", value_name = "FILE", hide_short_help = true)]
    pub memory_file: Option<PathBuf>,
    /// TLS on every TCP listener but those given to -l as notls:ADDR (memcached -Z). The
    /// certificate comes from -o ssl_chain_cert=FILE (PEM, the server's certificate first)
    /// and ssl_key=FILE (PEM; the chain's file when not given); -o ssl_ca_cert=FILE with
    /// ssl_verify_mode=1 (ask for client certificates) or 2 (require them) checks clients';
    /// ssl_min_version=3 allows TLS 1.3 only (TLS 1.2 and 1.3 otherwise); ssl_ciphers=LIST
    /// (OpenSSL's syntax, e.g. ECDHE+AESGCM:!aRSA) chooses TLS 1.2's ciphers among kura's
    /// ECDHE AES-GCM and ChaCha20-Poly1305 suites; ssl_session_cache lets clients resume
    /// sessions. `refresh_certs` reloads the files. Unix sockets stay plain.
    #[arg(short = 'Z', long = "enable-ssl")]
    pub enable_ssl: bool,
    /// Connections the kernel queues for the server before it accepts them (memcached -b).
    #[arg(short = 'b', long = "listen-backlog", default_value_t = LISTEN_BACKLOG_DEFAULT)]
    pub listen_backlog: u32,
    /// memcached's extended options, comma-separated (memcached -o). idle_timeout=N,
    /// lru_crawler, no_lru_crawler, lru_crawler_sleep=N and lru_crawler_tocrawl=N act as in
    /// memcached; the options of its slab allocator, LRU, hash table and extstore are taken
    /// and logged as having no effect (kura has none of those: values live in its own flash
    /// store); an option memcached does not have is an error, as in memcached.
    #[arg(short = 'o', long = "extended", value_delimiter = ',')]
    pub extended: Vec<String>,
    /// UDP port (memcached -U). kura speaks TCP only, so 0 (off, memcached's default) is the only value accepted.
    #[arg(short = 'U', long = "udp-port", default_value_t = 0)]
    pub udp_port: u16,
    /// Most client connections at once; past it a new connection gets
    /// "ERROR Too many open connections" and is closed (memcached -c).
    #[arg(short = 'c', long = "max-connections", default_value_t = MAX_CONNECTIONS_DEFAULT)]
    pub max_connections: usize,
    /// Worker threads, each with its own connections and flash read queue
    /// (memcached -t). Default: one per CPU.
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// RAM for the cache of hot items in front of flash, in MiB (memcached -m;
    /// data lives on flash, so this bounds RAM, not capacity). 0 turns the cache off.
    #[arg(short = 'm', long = "memory-limit-mb", visible_alias = "memory-limit", default_value_t = MEMORY_LIMIT_MB_DEFAULT)]
    pub memory_limit_mb: u64,
    /// Largest item (memcached -I): bytes, or with a k/m suffix. As in memcached
    /// the limit counts the item's key and header (kura's is 40 bytes plus the
    /// `VALUE` line), so the largest value is a little smaller.
    #[arg(short = 'I', long = "max-item-size", default_value = "1m")]
    pub max_item_size: Bytes,
    /// The store: a file (created when missing) or a block device.
    #[arg(long, default_value = "kura-data/kura.kura")]
    pub path: PathBuf,
    /// Size of the store file when it is created (e.g. 1G, 64G); ignored for an existing store.
    #[arg(long, default_value = "1G")]
    pub size: Bytes,
    /// cache: when full, drop the oldest data (a SET never waits); store: never
    /// drop, answer "SERVER_ERROR out of memory" when live data fills the device.
    /// Default: the existing store's mode, or cache for a new one.
    #[arg(long)]
    pub mode: Option<ModeArg>,
    /// When writes become durable: always (before each reply), never (only at a
    /// clean shutdown), or an interval such as 1000ms or 5s. A clean SIGTERM
    /// always syncs; with an interval a crash loses at most that much.
    #[arg(long, default_value = "1000ms")]
    pub sync: SyncPolicy,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9150).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Close connections idle this many seconds; 0 never does (memcached's idle_timeout).
    #[arg(long, default_value_t = 0)]
    pub idle_timeout_s: u64,
    /// Block size of a new store; default: the smallest power of two, at least
    /// 4M, that holds four of the largest item.
    #[arg(long)]
    pub block_size: Option<Bytes>,
    /// Engine threads that write full blocks to flash in the background.
    #[arg(long, default_value_t = 2)]
    pub seal_threads: usize,
    /// Most key-hash partitions of a new store. Each keeps a block-sized write buffer in RAM;
    /// fewer partitions need a slightly larger index per key to keep misses off flash.
    #[arg(long, default_value_t = config::PARTITIONS_MAX_DEFAULT)]
    pub partitions_max: u32,
    /// Microseconds a worker thread with nothing to do keeps looking for new requests and
    /// finished flash reads before it sleeps, trading up to that much CPU time per idle spell
    /// for round trips without a wake-up (on a 2-core virtual machine a loopback round trip
    /// took ~70 µs against a sleeping server, ~22-31 µs against a spinning one). The spin
    /// ends early when another thread wants the CPU; an idle server spins once after its
    /// last request, then sleeps. 0: always sleep at once, as memcached does.
    #[arg(long, default_value_t = config::POLL_SPIN_US_DEFAULT, value_parser = clap::value_parser!(u64).range(0..=config::POLL_SPIN_US_MAX))]
    pub poll_spin_us: u64,
}

impl ServeArgs {
    /// The server configuration these arguments describe.
    pub fn to_config(&self) -> Result<ServerConfig, String> {
        if self.udp_port != 0 {
            return Err(format!(
                "-U {}: kura serves memcached over TCP only; UDP is not supported (use -U 0, the default)",
                self.udp_port
            ));
        }
        let mut listen = Vec::new();
        let mut listen_notls = Vec::new();
        // memcached: -s turns the network off.
        let hosts = if self.unix_socket.is_some() { "" } else { self.listen.as_str() };
        for entry in hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
        {
            let (notls, host_port) = match entry.strip_prefix("notls:") {
                Some(rest) => (true, rest),
                None => (false, entry),
            };
            let (host, port) = split_host_port(host_port, self.port).map_err(|e| format!("-l {entry}: {e}"))?;
            let addrs: Vec<SocketAddr> = (host, port)
                .to_socket_addrs()
                .map_err(|e| format!("-l {entry}: {e}"))?
                .collect();
            if notls {
                listen_notls.extend(addrs.iter().copied());
            }
            listen.extend(addrs);
        }
        listen.dedup();
        let threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get()));
        let item_size_max_bytes =
            usize::try_from(self.max_item_size.0).map_err(|_| "-I is too large".to_owned())?;
        let block_size_bytes = self
            .block_size
            .map(|b| u32::try_from(b.0).map_err(|_| "--block-size must be below 4G".to_owned()))
            .transpose()?;
        let unix_socket = self.unix_socket.clone().map(|path| UnixSocket { path, mode: self.unix_mask });
        let mode = match (self.mode.map(|m| m.0), self.disable_evictions) {
            (Some(Mode::Cache), true) => return Err("-M (never evict) contradicts --mode cache".to_owned()),
            (_, true) => Some(Mode::Store),
            (mode, false) => mode,
        };
        let protocol = self.to_protocol()?;
        let extended = Extended::parse(&self.extended)?;
        for option in &extended.no_effect {
            tracing::warn!(option, "-o {option}: memcached's option has no effect in kura (no slab allocator, LRU, hash table or extstore to tune)");
        }
        let idle_timeout_s = extended.idle_timeout_s.unwrap_or(self.idle_timeout_s);
        let mut tls = extended.tls;
        tls.enabled = self.enable_ssl;
        if tls.enabled {
            if listen.iter().all(|a| listen_notls.contains(a)) {
                return Err("-Z: TLS needs a TCP listener (memcached: \"You cannot enable SSL without a TCP port\"); a Unix socket (-s) stays plain".to_owned());
            }
            tls.options()?;
            if tls.min_version < 2 {
                tracing::warn!("-o ssl_min_version={}: kura speaks TLS 1.2 and 1.3 only", tls.min_version);
            }
            if tls.kernel_tls {
                tracing::warn!("-o ssl_kernel_tls has no effect: kura encrypts in user space");
            }
        }
        let allowed = Allowed {
            shutdown: self.enable_shutdown,
            flush_all: !self.disable_flush_all,
            dumping: !self.disable_dumping,
            watch: !self.disable_watch,
        };
        let config = ServerConfig {
            listen,
            listen_notls,
            tls,
            unix_socket,
            allowed,
            protocol,
            listen_backlog: self.listen_backlog,
            crawler_setup: extended.crawler,
            max_connections: self.max_connections,
            threads,
            memory_limit_bytes: self.memory_limit_mb.saturating_mul(1 << 20),
            item_size_max_bytes,
            path: self.path.clone(),
            size_bytes: self.size.0,
            mode,
            block_size_bytes,
            sync: self.sync,
            metrics_addr: self.metrics_addr,
            idle_timeout: (idle_timeout_s > 0).then(|| Duration::from_secs(idle_timeout_s)),
            output_high_bytes: config::OUTPUT_HIGH_BYTES_DEFAULT,
            pending_reads_per_conn_max: config::PENDING_READS_PER_CONN_MAX,
            read_queue_depth: config::READ_QUEUE_DEPTH_DEFAULT,
            seal_threads: self.seal_threads,
            partitions_max: self.partitions_max,
            poll_spin: Duration::from_micros(self.poll_spin_us),
        };
        config.validate()?;
        Ok(config)
    }

    /// `-C -Y -R -f -n -D -B`, checked as memcached checks them, and the options kura
    /// refuses (`-S -e -Z`) with the reason.
    fn to_protocol(&self) -> Result<Protocol, String> {
        if self.enable_sasl {
            return Err("-S: SASL authentication needs memcached's binary protocol, which kura does not speak; use -Y FILE (ASCII authentication)".to_owned());
        }
        if let Some(file) = &self.memory_file {
            return Err(format!("-e {}: kura keeps items in its store (--path), which a restart reopens; it has no memory file", file.display()));
        }
        match self.protocol.as_str() {
            "auto" | "ascii" => {}
            "binary" => return Err("-B binary: kura speaks memcached's text and meta protocols, not the binary one (use -B ascii or auto)".to_owned()),
            other => return Err(format!("-B {other}: invalid value for binding protocol (one of auto, binary or ascii)")),
        }
        if self.max_reqs_per_event == 0 {
            return Err("-R: number of requests per event must be greater than 0".to_owned());
        }
        // memcached compares with 1.0 and takes NaN; kura refuses it too.
        if !(self.slab_growth_factor > 1.0 && self.slab_growth_factor.is_finite()) {
            return Err(format!("-f {}: factor must be greater than 1", self.slab_growth_factor));
        }
        if self.slab_min_size == 0 {
            return Err("-n: chunk size must be greater than 0".to_owned());
        }
        let detail_delimiter = match self.detail_delimiter.as_deref() {
            None => None,
            Some(d) => match d.as_bytes() {
                [c] => Some(*c),
                [] => return Err("-D: no delimiter specified".to_owned()),
                _ => return Err(format!("-D {d:?}: the delimiter is one character (byte)")),
            },
        };
        let auth = self.auth_file.as_deref().map(config::Auth::load).transpose()?;
        if self.enable_largepages {
            tracing::warn!("-L: memcached's large pages have no effect in kura (no item memory to place in them)");
        }
        Ok(Protocol {
            cas_enabled: !self.disable_cas,
            auth,
            reqs_per_event: self.max_reqs_per_event,
            slab_growth_factor: self.slab_growth_factor,
            slab_chunk_size: self.slab_min_size,
            detail_delimiter,
        })
    }

    /// What the server's process does besides serving.
    pub fn to_process_config(&self) -> ProcessConfig {
        ProcessConfig {
            daemon: self.daemon,
            pidfile: self.pidfile.clone(),
            user: self.user.clone(),
            lock_memory: self.lock_memory,
            enable_coredumps: self.enable_coredumps,
        }
    }
}

/// What `-i` prints: kura's licence (memcached's code is not in kura: kura speaks its
/// protocol).
pub const LICENSE_NOTICE: &str = concat!(
    "kura is licensed under either of the Apache License, Version 2.0\n",
    "(https://www.apache.org/licenses/LICENSE-2.0) or the MIT license below, at your option.\n",
    "It speaks memcached's protocol and contains none of memcached's code.\n\n",
    include_str!("../../../LICENSE-MIT"),
);

/// What `-o` asked for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Extended {
    idle_timeout_s: Option<u64>,
    crawler: Vec<CrawlerCommand>,
    /// Options memcached has that mean nothing here (logged).
    no_effect: Vec<String>,
    /// `ssl_*` (`enabled` is -Z's).
    tls: crate::tls::TlsSettings,
}

/// memcached 1.6's `-o` options that tune what kura does not have: its slab allocator, LRU
/// segments, hash table, connection buffers, logging buffers, and extstore (`ext_*`).
const EXTENDED_NO_EFFECT: &[&str] = &[
    "maxconns_fast", "no_maxconns_fast", "hashpower", "tail_repair_time", "hash_algorithm",
    "read_buf_mem_limit", "lru_maintainer", "no_lru_maintainer", "hot_lru_pct", "warm_lru_pct",
    "hot_max_factor", "warm_max_factor", "temporary_ttl", "slab_chunk_max", "slab_reassign",
    "no_slab_reassign", "slab_automove", "slab_automove_ratio", "slab_automove_window",
    "slab_automove_freeratio", "track_sizes", "no_hashexpand", "modern", "no_modern",
    "watcher_logbuf_size", "worker_logbuf_size", "resp_obj_mem_limit", "inline_ascii_response",
    "no_inline_ascii_response", "lru_segmented", "no_lru_segmented", "drop_privileges",
    "no_drop_privileges", "large_memory_pages",
];

impl Extended {
    fn parse(items: &[String]) -> Result<Self, String> {
        let mut out = Self::default();
        for item in items.iter().map(|i| i.trim()).filter(|i| !i.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            let number = |what: &str| -> Result<u64, String> {
                value
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("-o {item}: {what} takes a number ({key}=N)"))
            };
            match key {
                "idle_timeout" => out.idle_timeout_s = Some(number("idle_timeout")?),
                "lru_crawler" => out.crawler.push(CrawlerCommand::Enable),
                "no_lru_crawler" => out.crawler.push(CrawlerCommand::Disable),
                "lru_crawler_sleep" => {
                    let us = number("lru_crawler_sleep")?;
                    if us > 1_000_000 {
                        return Err(format!("-o {item}: at most 1000000 microseconds"));
                    }
                    out.crawler.push(CrawlerCommand::Sleep(us as u32));
                }
                "lru_crawler_tocrawl" => out.crawler.push(CrawlerCommand::ToCrawl(u32::try_from(number("lru_crawler_tocrawl")?).unwrap_or(u32::MAX))),
                "ssl_chain_cert" | "ssl_key" | "ssl_ca_cert" | "ssl_ciphers" => {
                    let text = value.filter(|v| !v.is_empty()).ok_or_else(|| format!("-o {item}: {key} takes a value ({key}=…)"))?;
                    match key {
                        "ssl_chain_cert" => out.tls.chain_cert = Some(text.into()),
                        "ssl_key" => out.tls.key = Some(text.into()),
                        "ssl_ca_cert" => out.tls.ca_cert = Some(text.into()),
                        _ => out.tls.ciphers = Some(text.to_owned()),
                    }
                }
                "ssl_verify_mode" | "ssl_min_version" => {
                    // memcached's own two messages.
                    let n = value.and_then(|v| v.parse::<u32>().ok()).ok_or_else(|| format!("-o {item}: could not parse argument to {key}"))?;
                    if n > crate::tls::VERIFY_MODE_MAX {
                        return Err(format!("-o {item}: Invalid {key}. Use help to see valid options (0 to 3)."));
                    }
                    if key == "ssl_verify_mode" {
                        out.tls.verify_mode = n;
                    } else {
                        out.tls.min_version = n;
                    }
                }
                "ssl_keyformat" => out.tls.keyformat = u32::try_from(number("ssl_keyformat")?).unwrap_or(u32::MAX),
                "ssl_wbuf_size" => out.tls.wbuf_size_kib = u32::try_from(number("ssl_wbuf_size")?).unwrap_or(u32::MAX),
                "ssl_session_cache" => out.tls.session_cache = true,
                "ssl_kernel_tls" => out.tls.kernel_tls = true,
                _ if EXTENDED_NO_EFFECT.contains(&key) || key.starts_with("ext_") => out.no_effect.push(item.to_owned()),
                _ => return Err(format!("-o {item}: not an extended option of memcached's (Illegal suboption \"{key}\")")),
            }
        }
        Ok(out)
    }
}

/// One `-l` entry's host and port: `HOST`, `HOST:PORT`, `[IPV6]`, `[IPV6]:PORT` or a bare
/// IPv6 address (two colons or more), the port `default_port` when not given.
fn split_host_port(entry: &str, default_port: u16) -> Result<(&str, u16), String> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| format!("{p:?} is not a port"));
    if let Some(rest) = entry.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("an IPv6 address opened with [ is not closed with ]")?;
        return match after {
            "" => Ok((host, default_port)),
            _ => Ok((host, port(after.strip_prefix(':').ok_or("expected :PORT after ]")?)?)),
        };
    }
    match entry.matches(':').count() {
        1 => {
            let (host, p) = entry.split_once(':').expect("one colon");
            Ok((host, port(p)?))
        }
        _ => Ok((entry, default_port)),
    }
}

/// `-a`'s octal permissions (`700`, `0770`).
fn parse_octal_mode(s: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(s, 8).map_err(|_| format!("{s:?} is not octal permissions (e.g. 700, 770)"))?;
    if mode > 0o777 {
        return Err(format!("{s}: permissions are at most 777"));
    }
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn config(args: &[&str]) -> Result<ServerConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("kura-server").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.serve.to_config()
    }

    #[test]
    fn defaults_are_memcacheds() {
        let c = config(&[]).unwrap();
        assert_eq!(
            c.listen,
            vec!["127.0.0.1:11211".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(c.max_connections, 1024);
        assert_eq!(c.memory_limit_bytes, 64 << 20);
        assert_eq!(c.item_size_max_bytes, 1 << 20);
        assert_eq!(c.sync, SyncPolicy::Every(Duration::from_secs(1)));
        assert_eq!(c.idle_timeout, None);
        assert!(c.threads >= 1);
        assert_eq!(c.poll_spin, Duration::from_micros(config::POLL_SPIN_US_DEFAULT));
    }

    #[test]
    fn the_poll_spin_is_bounded_and_can_be_off() {
        assert_eq!(config(&["--poll-spin-us", "0"]).unwrap().poll_spin, Duration::ZERO);
        assert_eq!(config(&["--poll-spin-us", "200"]).unwrap().poll_spin, Duration::from_micros(200));
        let too_long = (config::POLL_SPIN_US_MAX + 1).to_string();
        assert!(config(&["--poll-spin-us", &too_long]).unwrap_err().contains("poll-spin-us"));
    }

    #[test]
    fn a_unix_socket_turns_tcp_off() {
        let c = config(&["-s", "/run/kura.sock", "-a", "0770", "-A"]).unwrap();
        assert!(c.listen.is_empty());
        assert_eq!(c.unix_socket, Some(UnixSocket { path: "/run/kura.sock".into(), mode: 0o770 }));
        assert!(c.allowed.shutdown);
        let c = config(&["-s", "k.sock"]).unwrap();
        assert_eq!(c.unix_socket.unwrap().mode, config::UNIX_MASK_DEFAULT);
        assert!(!config(&[]).unwrap().allowed.shutdown);
        assert!(config(&["-s", "k.sock", "-a", "778"]).unwrap_err().contains("not octal"));
        assert!(config(&["-s", "k.sock", "-a", "1000"]).unwrap_err().contains("at most 777"));
    }

    #[test]
    fn listen_entries_take_ports_and_notls() {
        assert_eq!(split_host_port("10.0.0.1", 11211), Ok(("10.0.0.1", 11211)));
        assert_eq!(split_host_port("10.0.0.1:2000", 11211), Ok(("10.0.0.1", 2000)));
        assert_eq!(split_host_port("[::1]:2000", 11211), Ok(("::1", 2000)));
        assert_eq!(split_host_port("[::1]", 11211), Ok(("::1", 11211)));
        assert_eq!(split_host_port("::1", 11211), Ok(("::1", 11211)));
        assert!(split_host_port("[::1", 1).is_err() && split_host_port("h:x", 1).is_err() && split_host_port("[::1]x", 1).is_err());
        let c = config(&["-l", "notls:127.0.0.1:2001,127.0.0.1", "-p", "2000"]).unwrap();
        let (a, b): (SocketAddr, SocketAddr) = ("127.0.0.1:2001".parse().unwrap(), "127.0.0.1:2000".parse().unwrap());
        assert_eq!(c.listen, vec![a, b]);
        assert_eq!(c.listen_notls, vec![a]);
        assert!(!c.tls.enabled);
    }

    #[test]
    fn tls_options_are_checked_as_memcached_checks_them() {
        let c = config(&["-Z", "-o", "ssl_chain_cert=/c.pem,ssl_verify_mode=2,ssl_ca_cert=/ca.pem,ssl_min_version=3,ssl_session_cache,ssl_wbuf_size=32"]).unwrap();
        assert!(c.tls.enabled);
        assert_eq!(c.tls.chain_cert.as_deref(), Some(std::path::Path::new("/c.pem")));
        assert_eq!((c.tls.verify_mode, c.tls.min_version, c.tls.session_cache, c.tls.wbuf_size_kib), (2, 3, true, 32));
        let options = c.tls.options().unwrap();
        assert_eq!(options.key, std::path::PathBuf::from("/c.pem"), "the key is in the chain's file when not given");
        assert_eq!(options.client_auth, kura_tls::ClientAuth::Require);
        assert_eq!(options.min_version, kura_tls::MinVersion::Tls13);
        assert!(config(&["-Z"]).unwrap_err().contains("ssl_chain_cert"));
        assert!(config(&["-Z", "-s", "/k.sock", "-o", "ssl_chain_cert=/c"]).unwrap_err().contains("TCP"));
        assert!(config(&["-Z", "-l", "notls:127.0.0.1", "-o", "ssl_chain_cert=/c"]).unwrap_err().contains("TCP"));
        assert!(config(&["-Z", "-o", "ssl_chain_cert=/c,ssl_verify_mode=1"]).unwrap_err().contains("ssl_ca_cert"));
        assert!(config(&["-Z", "-o", "ssl_chain_cert=/c,ssl_keyformat=2"]).unwrap_err().contains("PEM"));
        assert!(config(&["-o", "ssl_verify_mode=4"]).unwrap_err().contains("Invalid ssl_verify_mode"));
        assert!(config(&["-o", "ssl_min_version=tlsv1.3"]).unwrap_err().contains("could not parse argument to ssl_min_version"));
        assert!(config(&["-o", "ssl_chain_cert"]).unwrap_err().contains("takes a value"));
        // Without -Z the options are kept (stats settings shows them) and nothing is checked.
        let c = config(&["-o", "ssl_verify_mode=2"]).unwrap();
        assert!(!c.tls.enabled && c.tls.verify_mode == 2);
    }

    #[test]
    fn extended_options_act_or_are_taken_without_effect() {
        let items = |s: &str| s.split(',').map(str::to_owned).collect::<Vec<_>>();
        let e = Extended::parse(&items("idle_timeout=30,no_lru_crawler,lru_crawler_sleep=50,lru_crawler_tocrawl=9,hashpower=20,ext_path=/x:1G,modern")).unwrap();
        assert_eq!(e.idle_timeout_s, Some(30));
        assert_eq!(e.crawler, [CrawlerCommand::Disable, CrawlerCommand::Sleep(50), CrawlerCommand::ToCrawl(9)]);
        assert_eq!(e.no_effect, ["hashpower=20", "ext_path=/x:1G", "modern"]);
        assert!(Extended::parse(&items("lru_crawler_sleep=2000000")).unwrap_err().contains("at most"));
        assert!(Extended::parse(&items("hashpowr=20")).unwrap_err().contains("Illegal suboption"));
        let c = config(&["-o", "idle_timeout=5", "--idle-timeout-s", "9"]).unwrap();
        assert_eq!(c.idle_timeout, Some(Duration::from_secs(5)));
        let c = config(&["-M", "-F", "-X", "-W", "-b", "64"]).unwrap();
        assert_eq!(c.mode, Some(Mode::Store));
        assert_eq!(c.allowed, Allowed { shutdown: false, flush_all: false, dumping: false, watch: false });
        assert_eq!(c.listen_backlog, 64);
        assert_eq!(config(&[]).unwrap().allowed, Allowed::default());
    }

    #[test]
    fn debians_memcached_conf_is_accepted() {
        let args = ["-m", "64", "-p", "11211", "-u", "memcache", "-l", "127.0.0.1", "-P", "/var/run/memcached/memcached.pid", "-d"];
        let cli = Cli::try_parse_from(std::iter::once("kura-server").chain(args)).unwrap();
        assert_eq!(
            cli.serve.to_process_config(),
            ProcessConfig { daemon: true, pidfile: Some("/var/run/memcached/memcached.pid".into()), user: Some("memcache".into()), ..ProcessConfig::default() }
        );
        assert!(cli.serve.to_config().is_ok());
    }

    #[test]
    fn memcached_style_options() {
        let c = config(&[
            "-p",
            "22000",
            "-l",
            "127.0.0.1,::1",
            "-c",
            "10",
            "-t",
            "3",
            "-m",
            "128",
            "-I",
            "2m",
            "--mode",
            "store",
            "--sync",
            "always",
            "--idle-timeout-s",
            "7",
        ])
        .unwrap();
        assert_eq!(c.listen.len(), 2);
        assert!(c.listen.iter().all(|a| a.port() == 22000));
        assert_eq!(
            (
                c.max_connections,
                c.threads,
                c.memory_limit_bytes,
                c.item_size_max_bytes
            ),
            (10, 3, 128 << 20, 2 << 20)
        );
        assert_eq!(c.mode, Some(kura_engine::Mode::Store));
        assert_eq!(c.sync, SyncPolicy::Always);
        assert_eq!(c.idle_timeout, Some(Duration::from_secs(7)));
    }

    #[test]
    fn udp_is_refused_with_a_reason() {
        assert!(config(&["-U", "0"]).is_ok());
        let error = config(&["-U", "11211"]).unwrap_err();
        assert!(error.contains("UDP is not supported"), "{error}");
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(config(&["-I", "10"]).unwrap_err().contains("max-item-size"));
        assert!(config(&["-t", "0"]).is_err());
        assert!(config(&["--sync", "sometimes"]).is_err());
        assert!(config(&["--mode", "both"]).is_err());
    }
}
