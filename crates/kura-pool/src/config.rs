//! A pool's description: its nodes (from URLs on the command line or a TOML file) and the
//! limits every context obeys.
//!
//! ```text
//! kura://[USER:PASSWORD@]host[:port][?weight=N&flush=sync|ack&max_connections=N]
//!                                                                    a kura server (meta protocol)
//! kura:///PATH[?...]                                                 one on a Unix socket (`kura serve -s PATH`)
//! memcached://host[:port][?weight=N&max_connections=N&protocol=text] stock memcached (meta, or text if old)
//! memcached:///PATH[?...]                                            one on a Unix socket (`memcached -s PATH`)
//! redis://host[:port][?weight=N&replicas=N]                          one redis-server / Valkey
//! redis+cluster://host:port[,host:port...][?replicas=N]             a Redis Cluster, from seed nodes
//! embedded:PATH[?size=1G]                                            an in-process engine (alone)
//! kura+tls://host[:port][?ca=PATH&cert=PATH&key=PATH&sni=NAME&...]   TLS to a kura serve -Z
//! memcached+tls://host[:port][?ca=...]                               TLS to a memcached -Z
//! rediss://host[:port][?ca=...]                                      TLS to a redis-server --tls-port
//! rediss+cluster://host:port[,host:port...][?ca=...]                 TLS to a Redis Cluster (tls-cluster yes)
//! ```
//!
//! Over TLS the server's certificate is checked against `ca` (the system's CA bundle,
//! [`kura_tls::SYSTEM_CA_FILE`], when not given) for the host's name (or `sni`); `cert` (and
//! `key`, when not in the same file) is the client certificate for a server that asks for one
//! (memcached's `ssl_verify_mode`, Redis' `tls-auth-clients`). A Redis Cluster's nodes are
//! reached at the addresses they announce, so each node's certificate must name the address
//! it announces (an IP address or a host name), or all of them the one name `sni` gives.
//!
//! `USER:PASSWORD@` (percent-encoded) before a host or a socket path (`kura://u:p@/PATH`)
//! authenticates each connection: to a kura server or memcached started with `-Y` (ASCII
//! authentication), or with Redis' `AUTH` (`redis://:PASSWORD@host` for `requirepass`).
//!
//! TOML: top-level limits (`request_timeout_ms`, ...) and `nodes`, a list of URLs or of tables
//! `{ url = "...", weight = 2 }`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::ring::WEIGHT_MAX;

pub const MEMCACHED_PORT_DEFAULT: u16 = 11211;
pub const REDIS_PORT_DEFAULT: u16 = 6379;
pub const REQUEST_TIMEOUT_MS_DEFAULT: u64 = 5000;
pub const CONNECT_TIMEOUT_MS_DEFAULT: u64 = 1000;
pub const BACKOFF_MS_MIN_DEFAULT: u64 = 50;
pub const BACKOFF_MS_MAX_DEFAULT: u64 = 2000;
pub const IN_FLIGHT_MAX_DEFAULT: usize = 4096;
/// memcached's default item limit (`-I 1m`) less room for its item header.
pub const VALUE_SIZE_BYTES_MAX_DEFAULT: usize = (1 << 20) - 1024;
pub const CONNECTIONS_PER_NODE_MAX_DEFAULT: usize = 256;
pub const READ_BUFFER_BYTES_DEFAULT: usize = 256 << 10;
/// How long a Redis flush waits for replicas (`WAIT n <timeout>`), at most.
pub const WAIT_TIMEOUT_MS_DEFAULT: u64 = 2000;
/// Nodes in one pool, at most.
pub const NODES_MAX: usize = 1024;
/// How long a context waiting for replies keeps looking for them before it sleeps
/// (`poll_spin_us`). On a virtual machine, waking a thread whose virtual CPU went idle is
/// most of a round trip: on the 2-core VM kura is measured on, a loopback request answered
/// by memcached took ~88 µs (median) to a client that slept for the reply and ~30 µs to one
/// that kept looking (~12 µs with a kura server that also spins, see `kura serve
/// --poll-spin-us`). A reply slower than this costs this much more CPU time than sleeping.
pub const POLL_SPIN_US_DEFAULT: u64 = 50;
/// Largest `poll_spin_us`.
pub const POLL_SPIN_US_MAX: u64 = 100_000;
/// Embedded store size when a new file is created without `?size=`.
pub const EMBEDDED_SIZE_BYTES_DEFAULT: u64 = 1 << 30;

/// What a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `kura serve`: memcached meta protocol; `flush` asks it to sync (`sync`).
    Kura,
    /// Stock memcached: meta protocol (text for servers without it); data lives in RAM, so
    /// `flush` is an ordering barrier only.
    Memcached,
    /// One redis-server/Valkey (RESP).
    Redis,
    /// A Redis Cluster reached through seed nodes (slot routing, MOVED/ASK, fail-over).
    RedisCluster,
    /// The engine in this process.
    Embedded,
}

/// How `flush` makes a kura node's writes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushMode {
    /// Send `sync` and wait for `OK` (the server syncs its engine).
    Sync,
    /// Only wait until every earlier write is acknowledged: exact for a server running
    /// `--sync always`; with `--sync <interval>` writes become durable within the interval.
    Ack,
}

/// A user and password a node's connections authenticate with (never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("user", &self.user).finish_non_exhaustive()
    }
}

/// `%XX` sequences decoded (a URL's user and password may hold `@`, `:`, `/` so written).
fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
            out.push(hex.ok_or("a % in the user or password is not followed by two hex digits")?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the user or password is not UTF-8".to_owned())
}

/// `url` with the password replaced by `***` (for messages).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    match rest.find('@').filter(|&at| !rest[..at].contains('/')) {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// One member of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub backend: Backend,
    /// `host:port` (cluster: the seeds); for `Embedded`, the store's path.
    pub addrs: Vec<String>,
    pub weight: u32,
    pub flush: FlushMode,
    /// Redis: replicas that must acknowledge the writes before `flush` returns (`WAIT`).
    pub replicas: u32,
    /// Connections to this node (one per context), at most.
    pub max_connections: Option<usize>,
    /// Embedded: size of a new store file.
    pub size_bytes: Option<u64>,
    /// memcached protocol: use the text commands even if the server has meta commands
    /// (`protocol=text`, for proxies that pass only the text protocol).
    pub text_protocol: bool,
    /// `USER:PASSWORD@` of the URL.
    pub credentials: Option<Credentials>,
    /// TLS (`kura+tls://`, `memcached+tls://`, `rediss://`).
    pub tls: Option<TlsSpec>,
}

/// How a node's connections speak TLS: the client configuration, built once (its files read
/// when the URL is parsed), from these options.
#[derive(Clone)]
pub struct TlsSpec {
    pub options: kura_tls::ClientTlsOptions,
    /// The name the server's certificate must carry (`sni=`; else the URL's host).
    pub server_name: Option<String>,
    pub config: std::sync::Arc<kura_tls::rustls::ClientConfig>,
}

impl TlsSpec {
    fn new(options: kura_tls::ClientTlsOptions, server_name: Option<String>) -> Result<Self, String> {
        if let Some(name) = &server_name {
            kura_tls::server_name(name).map_err(|e| e.to_string())?;
        }
        let config = kura_tls::client_config(&options).map_err(|e| e.to_string())?;
        Ok(Self { options, server_name, config })
    }
}

impl std::fmt::Debug for TlsSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSpec").field("options", &self.options).field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl PartialEq for TlsSpec {
    fn eq(&self, other: &Self) -> bool {
        self.options == other.options && self.server_name == other.server_name
    }
}

impl Eq for TlsSpec {}

impl NodeSpec {
    /// The name used in messages and for placement on the ring (`host:port`).
    pub fn name(&self) -> String {
        self.addrs.join(",")
    }

    /// Parses one node URL (see the module documentation).
    pub fn parse(url: &str) -> Result<Self> {
        let shown = redact_url(url);
        let bad = |why: &str| Error::Config(format!("{shown:?}: {why}"));
        let (scheme, rest) = url.split_once(':').ok_or_else(|| bad("expected scheme:..., e.g. kura://host:port"))?;
        let (body, query) = match rest.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (rest, None),
        };
        let (backend, tls) = match scheme {
            "kura" => (Backend::Kura, false),
            "memcached" | "memcache" => (Backend::Memcached, false),
            "redis" => (Backend::Redis, false),
            "redis+cluster" => (Backend::RedisCluster, false),
            "embedded" => (Backend::Embedded, false),
            "kura+tls" => (Backend::Kura, true),
            "memcached+tls" | "memcache+tls" => (Backend::Memcached, true),
            "rediss" | "redis+tls" => (Backend::Redis, true),
            "rediss+cluster" | "redis+cluster+tls" => (Backend::RedisCluster, true),
            other => return Err(bad(&format!("unknown scheme {other:?}; use kura, memcached, redis, redis+cluster, embedded, or kura+tls, memcached+tls, rediss, rediss+cluster"))),
        };
        let mut node = NodeSpec {
            backend,
            addrs: Vec::new(),
            weight: 1,
            flush: if backend == Backend::Kura { FlushMode::Sync } else { FlushMode::Ack },
            replicas: u32::from(backend == Backend::RedisCluster),
            max_connections: None,
            size_bytes: None,
            text_protocol: false,
            credentials: None,
            tls: None,
        };
        if backend == Backend::Embedded {
            let path = body.strip_prefix("//").unwrap_or(body);
            if path.is_empty() {
                return Err(bad("embedded needs a path, e.g. embedded:kura-data/pool.kura"));
            }
            node.addrs.push(path.to_owned());
        } else {
            let mut hosts = body.strip_prefix("//").ok_or_else(|| bad("expected scheme://host:port"))?;
            if let Some(at) = hosts.find('@').filter(|&at| !hosts[..at].contains('/')) {
                let (user, password) = hosts[..at].split_once(':').ok_or_else(|| bad("credentials are USER:PASSWORD@ (the user may be empty)"))?;
                let credentials = Credentials { user: percent_decode(user).map_err(|why| bad(&why))?, password: percent_decode(password).map_err(|why| bad(&why))? };
                if matches!(backend, Backend::Kura | Backend::Memcached)
                    && (credentials.user.is_empty() || credentials.user.contains(char::is_whitespace) || credentials.password.contains(char::is_whitespace))
                {
                    return Err(bad("memcached's authentication (-Y) takes a user and a password without spaces"));
                }
                node.credentials = Some(credentials);
                hosts = &hosts[at + 1..];
            }
            if crate::stream::is_unix_addr(hosts) {
                if !matches!(backend, Backend::Kura | Backend::Memcached) {
                    return Err(bad("a Unix socket path is for kura:// and memcached:// nodes"));
                }
                node.addrs.push(hosts.to_owned());
            } else {
                let port = if matches!(backend, Backend::Redis | Backend::RedisCluster) { REDIS_PORT_DEFAULT } else { MEMCACHED_PORT_DEFAULT };
                for host in hosts.split(',') {
                    node.addrs.push(host_port(host, port).map_err(|why| bad(&why))?);
                }
            }
            if node.addrs.len() > 1 && backend != Backend::RedisCluster {
                return Err(bad("only redis+cluster takes several hosts (list the others as nodes of their own)"));
            }
        }
        let (mut tls_options, mut server_name) = (kura_tls::ClientTlsOptions::default(), None);
        for pair in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').ok_or_else(|| bad(&format!("option {pair:?} needs a value")))?;
            match name {
                "ca" | "cert" | "key" | "sni" if !tls => return Err(bad(&format!("option {name:?} is for TLS nodes (kura+tls://, memcached+tls://, rediss://, rediss+cluster://)"))),
                "ca" => tls_options.ca = Some(PathBuf::from(percent_decode(value).map_err(|why| bad(&why))?)),
                "cert" => tls_options.cert = Some(PathBuf::from(percent_decode(value).map_err(|why| bad(&why))?)),
                "key" => tls_options.key = Some(PathBuf::from(percent_decode(value).map_err(|why| bad(&why))?)),
                "sni" => server_name = Some(value.to_owned()),
                _ => node.set_option(name, value).map_err(|why| bad(&why))?,
            }
        }
        if tls {
            if node.addrs.iter().any(|a| crate::stream::is_unix_addr(a)) {
                return Err(bad("TLS is spoken over TCP only: a Unix socket path takes kura:// or memcached://"));
            }
            node.tls = Some(TlsSpec::new(tls_options, server_name).map_err(|why| bad(&why))?);
        }
        Ok(node)
    }

    fn set_option(&mut self, name: &str, value: &str) -> Result<(), String> {
        let number = |v: &str| v.parse::<u64>().map_err(|_| format!("{name}={v}: not a number"));
        match name {
            "weight" => {
                let weight = number(value)?;
                if !(1..=u64::from(WEIGHT_MAX)).contains(&weight) {
                    return Err(format!("weight must be 1..={WEIGHT_MAX}"));
                }
                self.weight = weight as u32;
            }
            "flush" if self.backend == Backend::Kura => {
                self.flush = match value {
                    "sync" => FlushMode::Sync,
                    "ack" => FlushMode::Ack,
                    _ => return Err("flush must be sync or ack".into()),
                }
            }
            "replicas" if matches!(self.backend, Backend::Redis | Backend::RedisCluster) => self.replicas = u32::try_from(number(value)?).map_err(|e| e.to_string())?,
            "max_connections" => self.max_connections = Some(number(value)?.max(1) as usize),
            "size" if self.backend == Backend::Embedded => self.size_bytes = Some(parse_size(value)?),
            "protocol" if matches!(self.backend, Backend::Kura | Backend::Memcached) => {
                self.text_protocol = match value {
                    "auto" => false,
                    "text" => true,
                    _ => return Err("protocol must be auto or text".into()),
                }
            }
            _ => return Err(format!("option {name:?} does not apply to this node")),
        }
        Ok(())
    }
}

fn host_port(host: &str, default_port: u16) -> Result<String, String> {
    if host.is_empty() {
        return Err("empty host".into());
    }
    if host.starts_with('[') || host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        return Ok(host.to_owned());
    }
    if host.contains(':') {
        return Err(format!("{host:?}: bad port"));
    }
    Ok(format!("{host}:{default_port}"))
}

/// `1024`, `64K`, `16M`, `2G`, `1T` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&text[..text.len() - 1], 10),
        Some('M') => (&text[..text.len() - 1], 20),
        Some('G') => (&text[..text.len() - 1], 30),
        Some('T') => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{text:?}: not a size (e.g. 64M, 1G)"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?}: too large"))
}

/// The whole pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub nodes: Vec<NodeSpec>,
    /// A request not answered within this fails with `Timeout` (Redis Cluster requests keep
    /// being retried through a fail-over until then).
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// Back-off after a failed connection: doubles from min to max.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Requests in flight on one context, at most.
    pub in_flight_max: usize,
    pub value_size_max_bytes: usize,
    /// Default per-node connection limit (a node's `max_connections` overrides it).
    pub connections_per_node_max: usize,
    /// Receive buffer of one connection, at its fullest under load: it starts at 16 KiB and
    /// doubles each time a read fills it (a reply larger than this grows it further, up to
    /// one value).
    pub read_buffer_bytes: usize,
    pub wait_timeout: Duration,
    /// How long a wait for replies keeps looking for them before it sleeps (zero: sleeps at
    /// once); see [`POLL_SPIN_US_DEFAULT`].
    pub poll_spin: Duration,
    /// Engine settings for an embedded node (its size comes from the node's `size`).
    pub engine: kura_engine::EngineConfig,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            request_timeout: Duration::from_millis(REQUEST_TIMEOUT_MS_DEFAULT),
            connect_timeout: Duration::from_millis(CONNECT_TIMEOUT_MS_DEFAULT),
            backoff_min: Duration::from_millis(BACKOFF_MS_MIN_DEFAULT),
            backoff_max: Duration::from_millis(BACKOFF_MS_MAX_DEFAULT),
            in_flight_max: IN_FLIGHT_MAX_DEFAULT,
            value_size_max_bytes: VALUE_SIZE_BYTES_MAX_DEFAULT,
            connections_per_node_max: CONNECTIONS_PER_NODE_MAX_DEFAULT,
            read_buffer_bytes: READ_BUFFER_BYTES_DEFAULT,
            wait_timeout: Duration::from_millis(WAIT_TIMEOUT_MS_DEFAULT),
            poll_spin: Duration::from_micros(POLL_SPIN_US_DEFAULT),
            engine: kura_engine::EngineConfig::default(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlPool {
    #[serde(default)]
    nodes: Vec<TomlNode>,
    request_timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    backoff_min_ms: Option<u64>,
    backoff_max_ms: Option<u64>,
    in_flight_max: Option<usize>,
    value_size_max_bytes: Option<usize>,
    connections_per_node_max: Option<usize>,
    read_buffer_bytes: Option<usize>,
    wait_timeout_ms: Option<u64>,
    poll_spin_us: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TomlNode {
    Url(String),
    Table(TomlNodeTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlNodeTable {
    url: String,
    weight: Option<u32>,
    flush: Option<String>,
    replicas: Option<u32>,
    max_connections: Option<usize>,
    size: Option<String>,
    protocol: Option<String>,
}

impl PoolConfig {
    /// A pool of the nodes named by `urls` (none: an embedded store at `kura-data/pool.kura`).
    pub fn from_urls<S: AsRef<str>>(urls: &[S]) -> Result<Self> {
        let nodes = urls.iter().map(|u| NodeSpec::parse(u.as_ref())).collect::<Result<Vec<_>>>()?;
        let config = Self { nodes, ..Self::default() };
        config.validate()?;
        Ok(config)
    }

    /// An embedded engine at `path` (created with `size_bytes` when new).
    pub fn embedded(path: &Path, size_bytes: u64) -> Self {
        let node = NodeSpec {
            backend: Backend::Embedded,
            addrs: vec![path.display().to_string()],
            weight: 1,
            flush: FlushMode::Ack,
            replicas: 0,
            max_connections: None,
            size_bytes: Some(size_bytes),
            text_protocol: false,
            credentials: None,
            tls: None,
        };
        Self { nodes: vec![node], ..Self::default() }
    }

    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        Self::from_toml_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    pub fn from_toml_str(text: &str) -> Result<Self> {
        let parsed: TomlPool = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        let mut config = Self::default();
        for node in parsed.nodes {
            config.nodes.push(match node {
                TomlNode::Url(url) => NodeSpec::parse(&url)?,
                TomlNode::Table(t) => {
                    let mut node = NodeSpec::parse(&t.url)?;
                    let options = [
                        ("weight", t.weight.map(|v| v.to_string())),
                        ("flush", t.flush),
                        ("replicas", t.replicas.map(|v| v.to_string())),
                        ("max_connections", t.max_connections.map(|v| v.to_string())),
                        ("size", t.size),
                        ("protocol", t.protocol),
                    ];
                    for (name, value) in options {
                        if let Some(value) = value {
                            node.set_option(name, &value).map_err(|why| Error::Config(format!("{}: {why}", redact_url(&t.url))))?;
                        }
                    }
                    node
                }
            });
        }
        let ms = Duration::from_millis;
        if let Some(v) = parsed.request_timeout_ms {
            config.request_timeout = ms(v);
        }
        if let Some(v) = parsed.connect_timeout_ms {
            config.connect_timeout = ms(v);
        }
        if let Some(v) = parsed.backoff_min_ms {
            config.backoff_min = ms(v);
        }
        if let Some(v) = parsed.backoff_max_ms {
            config.backoff_max = ms(v);
        }
        if let Some(v) = parsed.wait_timeout_ms {
            config.wait_timeout = ms(v);
        }
        if let Some(v) = parsed.poll_spin_us {
            config.poll_spin = Duration::from_micros(v);
        }
        config.in_flight_max = parsed.in_flight_max.unwrap_or(config.in_flight_max);
        config.value_size_max_bytes = parsed.value_size_max_bytes.unwrap_or(config.value_size_max_bytes);
        config.connections_per_node_max = parsed.connections_per_node_max.unwrap_or(config.connections_per_node_max);
        config.read_buffer_bytes = parsed.read_buffer_bytes.unwrap_or(config.read_buffer_bytes);
        config.validate()?;
        Ok(config)
    }

    /// Checks what the constructors cannot: counts, limits, and that names are distinct.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(why));
        if self.nodes.len() > NODES_MAX {
            return bad(format!("{} nodes; at most {NODES_MAX}", self.nodes.len()));
        }
        if self.nodes.iter().any(|n| n.backend == Backend::Embedded) && self.nodes.len() > 1 {
            return bad("an embedded engine cannot share a pool with other nodes".into());
        }
        let mut names: Vec<String> = self.nodes.iter().map(NodeSpec::name).collect();
        names.sort();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("node {} is listed twice", w[0]));
        }
        if self.in_flight_max == 0 || self.connections_per_node_max == 0 {
            return bad("in_flight_max and connections_per_node_max must be above 0".into());
        }
        if self.read_buffer_bytes < 4096 {
            return bad("read_buffer_bytes must be at least 4096".into());
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be above 0".into());
        }
        if self.poll_spin > Duration::from_micros(POLL_SPIN_US_MAX) {
            return bad(format!("poll_spin_us must be at most {POLL_SPIN_US_MAX}"));
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return bad("backoff_min must be above 0 and at most backoff_max".into());
        }
        Ok(())
    }
}

/// Resolves `kura-data/pool.kura` when no node is named (the embedded default).
pub fn default_embedded_path() -> PathBuf {
    PathBuf::from("kura-data/pool.kura")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let n = NodeSpec::parse("kura://127.0.0.1:11311?weight=3&flush=ack").unwrap();
        assert_eq!((n.backend, n.addrs.clone(), n.weight, n.flush), (Backend::Kura, vec!["127.0.0.1:11311".to_string()], 3, FlushMode::Ack));
        assert_eq!(NodeSpec::parse("kura://h").unwrap().flush, FlushMode::Sync);
        assert_eq!(NodeSpec::parse("memcached://h").unwrap().addrs, ["h:11211"]);
        assert_eq!(NodeSpec::parse("redis://h").unwrap().addrs, ["h:6379"]);
        let c = NodeSpec::parse("redis+cluster://a:7000,b:7001?replicas=1").unwrap();
        assert_eq!((c.backend, c.addrs.len(), c.replicas), (Backend::RedisCluster, 2, 1));
        let e = NodeSpec::parse("embedded:kura-data/x.kura?size=64M").unwrap();
        assert_eq!((e.addrs[0].as_str(), e.size_bytes), ("kura-data/x.kura", Some(64 << 20)));
        assert_eq!(NodeSpec::parse("embedded:///tmp/x").unwrap().addrs[0], "/tmp/x");
        assert_eq!(NodeSpec::parse("kura://[::1]:5").unwrap().addrs[0], "[::1]:5");
        // A Unix socket: the path is the address.
        let n = NodeSpec::parse("kura:///run/kura/s.sock?flush=ack").unwrap();
        assert_eq!((n.addrs.as_slice(), n.flush), (&["/run/kura/s.sock".to_owned()][..], FlushMode::Ack));
        assert_eq!(NodeSpec::parse("memcached:///tmp/mc.sock").unwrap().addrs, ["/tmp/mc.sock"]);
        let n = NodeSpec::parse("kura://alice:p%40ss%3Aw%2Fd@h:5?weight=2").unwrap();
        assert_eq!((n.addrs.as_slice(), n.weight), (&["h:5".to_owned()][..], 2));
        assert_eq!(n.credentials, Some(Credentials { user: "alice".into(), password: "p@ss:w/d".into() }));
        assert!(!format!("{n:?}").contains("p@ss"), "never the password");
        let n = NodeSpec::parse("memcached://bob:pw@/run/mc.sock").unwrap();
        assert_eq!((n.addrs.as_slice(), n.credentials.unwrap().user.as_str()), (&["/run/mc.sock".to_owned()][..], "bob"));
        let n = NodeSpec::parse("redis://:secret@h").unwrap();
        assert_eq!(n.credentials, Some(Credentials { user: String::new(), password: "secret".into() }));
        assert_eq!(redact_url("redis://u:secret@h:1?x=y"), "redis://u:***@h:1?x=y");
        assert_eq!(redact_url("kura:///run/a@b.sock"), "kura:///run/a@b.sock");
        assert!(NodeSpec::parse("redis:///tmp/r.sock").unwrap_err().to_string().contains("Unix socket"));
    }

    #[test]
    fn bad_urls_say_why() {
        for (url, why) in [
            ("nope", "scheme"),
            ("ftp://x", "unknown scheme"),
            ("kura:x", "host:port"),
            ("kura://a:1,b:2", "several hosts"),
            ("kura://nopassword@h", "USER:PASSWORD@"),
            ("kura://:pw@h", "without spaces"),
            ("memcached://a b:pw@h", "without spaces"),
            ("kura://u:%zz@h", "two hex digits"),
            ("kura://h:99999", "bad port"),
            ("kura://h?weight=0", "weight"),
            ("kura://h?weight=x", "not a number"),
            ("memcached://h?flush=sync", "does not apply"),
            ("kura://h?replicas=1", "does not apply"),
            ("kura://h?weight", "needs a value"),
            ("embedded:", "path"),
        ] {
            let e = NodeSpec::parse(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
    }

    #[test]
    fn toml_files() {
        let c = PoolConfig::from_toml_str(
            r#"
            request_timeout_ms = 250
            in_flight_max = 64
            nodes = ["kura://a:1", { url = "memcached://b:2", weight = 2 }, { url = "kura://c:3", flush = "ack", max_connections = 4 }]
            "#,
        )
        .unwrap();
        assert_eq!(c.request_timeout, Duration::from_millis(250));
        assert_eq!(c.in_flight_max, 64);
        assert_eq!(c.nodes.len(), 3);
        assert_eq!(c.nodes[1].weight, 2);
        assert_eq!((c.nodes[2].flush, c.nodes[2].max_connections), (FlushMode::Ack, Some(4)));
        assert!(PoolConfig::from_toml_str("nodes = [\"kura://a:1\"]\nbogus = 1").unwrap_err().to_string().contains("bogus"));
        assert!(PoolConfig::from_toml_str("nodes = [\"kura://a:1\", \"kura://a:1\"]").unwrap_err().to_string().contains("twice"));
        assert!(PoolConfig::from_toml_str("nodes = [\"embedded:x\", \"kura://a:1\"]").unwrap_err().to_string().contains("embedded"));
    }

    #[test]
    fn the_poll_spin_has_a_default_a_key_and_a_limit() {
        assert_eq!(PoolConfig::default().poll_spin, Duration::from_micros(POLL_SPIN_US_DEFAULT));
        let off = PoolConfig::from_toml_str("nodes = [\"kura://a:1\"]\npoll_spin_us = 0").unwrap();
        assert_eq!(off.poll_spin, Duration::ZERO);
        let too_long = format!("nodes = [\"kura://a:1\"]\npoll_spin_us = {}", POLL_SPIN_US_MAX + 1);
        assert!(PoolConfig::from_toml_str(&too_long).unwrap_err().to_string().contains("poll_spin_us"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
