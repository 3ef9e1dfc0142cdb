//! Server configuration: a plain struct with named limits, and the parsers
//! for the command line's values.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use kura_engine::Mode;

/// memcached's default port.
pub const PORT_DEFAULT: u16 = 11211;
/// memcached's default `-c`.
pub const MAX_CONNECTIONS_DEFAULT: usize = 1024;
/// memcached's default `-m`, in MiB.
pub const MEMORY_LIMIT_MB_DEFAULT: u64 = 64;
/// memcached's default `-I`.
pub const ITEM_SIZE_MAX_BYTES_DEFAULT: usize = 1 << 20;
/// memcached refuses `-I` below 1 KiB.
pub const ITEM_SIZE_MAX_BYTES_MIN: usize = 1024;
/// kura's largest `-I` (blocks must hold four items).
pub const ITEM_SIZE_MAX_BYTES_MAX: usize = 64 << 20;
/// Default store size when creating one.
pub const STORE_SIZE_BYTES_DEFAULT: u64 = 1 << 30;
/// Default interval of `--sync`.
pub const SYNC_INTERVAL_DEFAULT: Duration = Duration::from_millis(1000);
/// Reply bytes a connection may have unsent before the server stops reading from it.
pub const OUTPUT_HIGH_BYTES_DEFAULT: usize = 4 << 20;
/// Flash reads one connection may have in flight before the server stops reading from it.
pub const PENDING_READS_PER_CONN_MAX: usize = 256;
/// Flash reads in flight per worker.
pub const READ_QUEUE_DEPTH_DEFAULT: usize = 256;
/// Engine partitions a new store gets at most (`--partitions-max`). Each holds a block-sized
/// write buffer in RAM (4 MiB blocks by default, so ~5 MiB with its spare room); past the
/// engine's target of blocks per partition, the index spends a bit per key per doubling to
/// keep misses off flash. Four keep a server's fixed RAM small and writes parallel.
pub const PARTITIONS_MAX_DEFAULT: u32 = 4;

/// How long a worker thread keeps looking for work (`--poll-spin-us`) before it sleeps.
/// On a virtual machine, waking a thread whose virtual CPU went idle is most of a round
/// trip's time: on the 2-core VM kura is measured on, a loopback request to a server that
/// sleeps between requests took ~90 µs (median), ~22 µs when the server kept looking for the
/// next one; 50 µs catches the next request of a client that works between them (a program
/// under `kura fs run`) as well as 200 µs did. An idle server spins once after its last
/// request, then sleeps.
pub const POLL_SPIN_US_DEFAULT: u64 = 50;
/// Largest `--poll-spin-us`.
pub const POLL_SPIN_US_MAX: u64 = 100_000;

/// memcached's default `-b`: connections the kernel queues before the server takes them.
pub const LISTEN_BACKLOG_DEFAULT: u32 = 1024;

/// The commands an operator may turn off or on, as memcached's options do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    /// `shutdown` (memcached's `-A` turns it on).
    pub shutdown: bool,
    /// `flush_all` (`-F` turns it off).
    pub flush_all: bool,
    /// `lru_crawler metadump` and `lru_crawler mgdump` (`-X` turns them off).
    pub dumping: bool,
    /// `watch` (`-W` turns it off).
    pub watch: bool,
}

impl Default for Allowed {
    fn default() -> Self {
        Self { shutdown: false, flush_all: true, dumping: true, watch: true }
    }
}

/// memcached's default `-R`: requests one connection may have run per event.
pub const REQS_PER_EVENT_DEFAULT: u32 = 20;
/// memcached's default `-f`: each slab class's chunk size over the one before.
pub const SLAB_GROWTH_FACTOR_DEFAULT: f64 = 1.25;
/// memcached's default `-n`: bytes for key, value and flags in the smallest chunk.
pub const SLAB_CHUNK_SIZE_DEFAULT: u32 = 48;
/// memcached's default `-D`: what ends a key's prefix in `stats detail`.
pub const DETAIL_DELIMITER_DEFAULT: u8 = b':';

/// ASCII authentication (memcached's `-Y FILE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The file, as given (what `stats settings` shows).
    pub path: PathBuf,
    pub users: std::sync::Arc<kura_proto::auth::AuthFile>,
}

impl Auth {
    /// Reads and checks the file, as memcached does at startup.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read(path).map_err(|e| format!("-Y {}: could not open the auth file for reading: {e}", path.display()))?;
        let users = kura_proto::auth::AuthFile::parse(&text).map_err(|e| format!("-Y {}: {e}", path.display()))?;
        if users.is_empty() {
            tracing::warn!(path = %path.display(), "-Y: the auth file has no entries: no client can authenticate");
        }
        Ok(Self { path: path.to_owned(), users: std::sync::Arc::new(users) })
    }
}

/// memcached's switches that change what clients see besides which commands are allowed:
/// `-C`, `-Y`, `-R`, `-f`, `-n` and `-D`.
#[derive(Debug, Clone, PartialEq)]
pub struct Protocol {
    /// CAS values (`-C` turns them off: every item's is 0, `gets` and `mg c` say 0, a `cas`
    /// never stores, `E` is refused; as in memcached).
    pub cas_enabled: bool,
    /// `-Y`: clients authenticate first.
    pub auth: Option<Auth>,
    /// `-R`, shown by `stats settings`. kura's workers read a bounded slice of each
    /// connection per turn (`READS_PER_TURN` reads of at most the input buffer), which is
    /// what keeps one client from starving the others; the number is not used otherwise.
    pub reqs_per_event: u32,
    /// `-f` and `-n`: memcached's slab classes, which kura has none of but names in the
    /// `cls=` of `lru_crawler metadump`, `watch` and the crawler's class lists.
    pub slab_growth_factor: f64,
    pub slab_chunk_size: u32,
    /// `-D`: what ends a key's prefix in `stats detail`; given, it turns the detail on.
    pub detail_delimiter: Option<u8>,
}

impl Default for Protocol {
    fn default() -> Self {
        Self {
            cas_enabled: true,
            auth: None,
            reqs_per_event: REQS_PER_EVENT_DEFAULT,
            slab_growth_factor: SLAB_GROWTH_FACTOR_DEFAULT,
            slab_chunk_size: SLAB_CHUNK_SIZE_DEFAULT,
            detail_delimiter: None,
        }
    }
}

/// memcached's default `-a`: the Unix socket only for its owner.
pub const UNIX_MASK_DEFAULT: u32 = 0o700;

/// A Unix socket to listen on (memcached's `-s` and `-a`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocket {
    pub path: PathBuf,
    /// The socket file's permissions (`-a`, octal on the command line).
    pub mode: u32,
}

/// What `kura serve` does as a process besides serving (memcached's `-d`, `-P`, `-u`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessConfig {
    /// Detach from the terminal and run in the background once the server is up.
    pub daemon: bool,
    /// A file to write the server's process id to (removed at exit).
    pub pidfile: Option<PathBuf>,
    /// When started as root: the user to run as once the sockets are bound and the store
    /// is open.
    pub user: Option<String>,
    /// `-k`: mlockall (a warning when refused).
    pub lock_memory: bool,
    /// `-r`: the core file size limit raised to its hard limit.
    pub enable_coredumps: bool,
}

/// When writes are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Before each reply to a write (writes of one loop turn share one sync).
    Always,
    /// Every interval, when something was written.
    Every(Duration),
    /// Only at a clean shutdown (and when the engine's buffers fill).
    Never,
}

impl FromStr for SyncPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" => return Ok(Self::Always),
            "never" => return Ok(Self::Never),
            _ => {}
        }
        let (digits, unit_ms) = if let Some(d) = s.strip_suffix("ms") {
            (d, 1)
        } else if let Some(d) = s.strip_suffix('s') {
            (d, 1000)
        } else {
            (s, 1)
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?}: use always, never, or an interval like 1000ms or 5s"))?;
        if n == 0 {
            return Err("a sync interval must be above 0 (or say never)".to_owned());
        }
        Ok(Self::Every(Duration::from_millis(
            n.saturating_mul(unit_ms),
        )))
    }
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Always => write!(f, "always"),
            Self::Never => write!(f, "never"),
            Self::Every(d) => write!(f, "{}ms", d.as_millis()),
        }
    }
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModeArg(pub Mode);

impl FromStr for ModeArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cache" => Ok(Self(Mode::Cache)),
            "store" => Ok(Self(Mode::Store)),
            _ => Err(format!("{s:?}: use cache or store")),
        }
    }
}

/// A byte size as memcached's `-I` takes it (`1m`, `512k`, `1048576`) or
/// kura's `--size` (`1G`, `64M`, `2GiB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl FromStr for Bytes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a size (try 4096, 64k, 1m, 1G)"))?;
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            "t" | "tb" | "tib" => 40,
            other => return Err(format!("unknown size unit {other:?} (use k, m, g or t)")),
        };
        n.checked_mul(1 << shift)
            .map(Bytes)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

/// Everything the server needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Addresses to listen on (memcached's `-l`, resolved); none with a Unix socket.
    pub listen: Vec<SocketAddr>,
    /// Those of `listen` that stay plain under `-Z` (memcached's `-l notls:…`).
    pub listen_notls: Vec<SocketAddr>,
    /// `-Z` and the `-o ssl_*` options.
    pub tls: crate::tls::TlsSettings,
    /// A Unix socket to listen on instead (memcached's `-s`).
    pub unix_socket: Option<UnixSocket>,
    /// Commands turned on or off (`-A -F -X -W`).
    pub allowed: Allowed,
    /// `-C -Y -R -f -n -D`.
    pub protocol: Protocol,
    /// The listening sockets' backlog (memcached's `-b`).
    pub listen_backlog: u32,
    /// Crawler settings from `-o` (`no_lru_crawler`, `lru_crawler_sleep`, ...), applied at
    /// the start as the `lru_crawler` commands would.
    pub crawler_setup: Vec<kura_proto::CrawlerCommand>,
    pub max_connections: usize,
    pub threads: usize,
    pub memory_limit_bytes: u64,
    pub item_size_max_bytes: usize,
    pub path: PathBuf,
    pub size_bytes: u64,
    pub mode: Option<Mode>,
    pub block_size_bytes: Option<u32>,
    pub sync: SyncPolicy,
    pub metrics_addr: Option<SocketAddr>,
    pub idle_timeout: Option<Duration>,
    pub output_high_bytes: usize,
    pub pending_reads_per_conn_max: usize,
    pub read_queue_depth: usize,
    /// Engine threads that write sealed blocks.
    pub seal_threads: usize,
    pub partitions_max: u32,
    /// How long an idle worker keeps looking for work before it sleeps (0: never).
    pub poll_spin: Duration,
}

impl ServerConfig {
    /// Checks values that depend on each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.listen.is_empty() && self.unix_socket.is_none() {
            return Err("nothing to listen on".to_owned());
        }
        if let Some(unix) = &self.unix_socket
            && unix.mode > 0o777
        {
            return Err(format!("-a/--unix-mask {:o}: permissions are at most 777 (octal)", unix.mode));
        }
        if self.threads == 0 {
            return Err("-t/--threads must be at least 1".to_owned());
        }
        if self.partitions_max == 0 {
            return Err("--partitions-max must be at least 1".to_owned());
        }
        if self.max_connections == 0 {
            return Err("-c/--max-connections must be at least 1".to_owned());
        }
        if !(ITEM_SIZE_MAX_BYTES_MIN..=ITEM_SIZE_MAX_BYTES_MAX).contains(&self.item_size_max_bytes)
        {
            return Err(format!(
                "-I/--max-item-size must be between {ITEM_SIZE_MAX_BYTES_MIN} bytes and {} MiB",
                ITEM_SIZE_MAX_BYTES_MAX >> 20
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_policies() {
        assert_eq!("always".parse(), Ok(SyncPolicy::Always));
        assert_eq!("never".parse(), Ok(SyncPolicy::Never));
        assert_eq!(
            "250ms".parse(),
            Ok(SyncPolicy::Every(Duration::from_millis(250)))
        );
        assert_eq!("5s".parse(), Ok(SyncPolicy::Every(Duration::from_secs(5))));
        assert_eq!(
            "100".parse(),
            Ok(SyncPolicy::Every(Duration::from_millis(100)))
        );
        assert!("0ms".parse::<SyncPolicy>().is_err());
        assert!("sometimes".parse::<SyncPolicy>().is_err());
        assert_eq!(
            SyncPolicy::Every(Duration::from_millis(250)).to_string(),
            "250ms"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!("1m".parse(), Ok(Bytes(1 << 20)));
        assert_eq!("512k".parse(), Ok(Bytes(512 << 10)));
        assert_eq!("1G".parse(), Ok(Bytes(1 << 30)));
        assert_eq!("4096".parse(), Ok(Bytes(4096)));
        assert!("1q".parse::<Bytes>().is_err());
        assert!("x".parse::<Bytes>().is_err());
    }

    #[test]
    fn modes() {
        assert_eq!("cache".parse(), Ok(ModeArg(Mode::Cache)));
        assert_eq!("store".parse(), Ok(ModeArg(Mode::Store)));
        assert!("both".parse::<ModeArg>().is_err());
    }
}
