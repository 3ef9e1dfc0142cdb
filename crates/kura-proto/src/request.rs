//! Typed requests, borrowing from the connection's buffer.

use crate::lex::Tokens;
use crate::meta::{ArithmeticOp, MetaFlags, SetMode};

/// One parsed request. Keys, data and opaque tokens borrow from the buffer
/// handed to [`crate::parse`]; nothing is copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request<'a> {
    /// `set`, `add`, `replace`, `append`, `prepend`, `cas`.
    Storage(Storage<'a>),
    /// `get`, `gets`, `gat`, `gats`.
    Retrieval(Retrieval<'a>),
    /// `delete <key> [0] [noreply]`.
    Delete {
        /// Key to delete.
        key: &'a [u8],
        /// Send no reply.
        noreply: bool,
    },
    /// `incr`/`decr <key> <value> [noreply]`.
    Arithmetic {
        /// Increment or decrement.
        op: ArithmeticOp,
        /// Key of the counter.
        key: &'a [u8],
        /// Amount to add or subtract.
        delta: u64,
        /// Send no reply.
        noreply: bool,
    },
    /// `touch <key> <exptime> [noreply]`.
    Touch {
        /// Key to touch.
        key: &'a [u8],
        /// New exptime (see [`Storage::exptime_s`]).
        exptime_s: i64,
        /// Send no reply.
        noreply: bool,
    },
    /// `flush_all [delay] [noreply]`.
    FlushAll {
        /// Delay before the flush, in exptime form; `None` means now.
        delay_s: Option<i64>,
        /// Send no reply.
        noreply: bool,
    },
    /// `version` (arguments ignored, as by memcached).
    Version,
    /// `sync [noreply]` (kura's extension; memcached answers `ERROR`): reply `OK` once every
    /// write acknowledged before it is durable.
    Sync {
        /// Send no reply (the barrier still holds for later requests on the connection).
        noreply: bool,
    },
    /// `verbosity <level> [noreply]`.
    Verbosity {
        /// Requested level.
        level: u32,
        /// Send no reply.
        noreply: bool,
    },
    /// `refresh_certs [… noreply]` (memcached built with TLS): reload the TLS certificate and
    /// key. memcached looks only at whether the last token is `noreply`.
    RefreshCerts {
        /// Send no reply when it succeeds (a failure is answered anyway, as by memcached).
        noreply: bool,
    },
    /// `quit` (arguments ignored): close the connection, no reply.
    Quit,
    /// `stats [group [args]]`; the server answers `ERROR` for unknown groups.
    Stats {
        /// Tokens after `stats`.
        args: Tokens<'a>,
    },
    /// `shutdown [graceful]`; a server may reject it
    /// (memcached: `ERROR: shutdown not enabled`).
    Shutdown(ShutdownMode),
    /// `lru_crawler metadump <classes>`: one line per item, then `END`.
    Metadump(MetadumpClasses),
    /// `lru_crawler mgdump <classes>` (memcached 1.6.19+): an `mg <key>` line per item, a
    /// command that can be sent back as it is, then `EN`.
    Mgdump(MetadumpClasses),
    /// The other `lru_crawler` commands.
    LruCrawler(CrawlerCommand),
    /// `watch [fetchers|mutations|evictions|connevents|rawcmds|sysevents|proxy…]`: `OK`, then
    /// the connection receives log lines of those streams, and nothing it sends is run.
    Watch(WatchFlags),
    /// `slabs automove|reassign …` and `lru mode|tune|temp_ttl …`: memcached's tuning of its
    /// slab allocator and LRUs, which kura has not; the answer memcached gives.
    Tuning(TuningReply),
    /// `cache_memlimit <megabytes> [noreply]`.
    CacheMemlimit {
        /// New memory limit, in MiB.
        limit_mb: u32,
        /// Send no reply.
        noreply: bool,
    },
    /// `mg <key> <flags>*`.
    MetaGet(MetaRequest<'a>),
    /// `ms <key> <datalen> <flags>*` and its data block.
    MetaSet(MetaSet<'a>),
    /// `md <key> <flags>*`.
    MetaDelete(MetaRequest<'a>),
    /// `ma <key> <flags>*`.
    MetaArithmetic(MetaArithmetic<'a>),
    /// `mn`: reply `MN`.
    MetaNoop,
    /// `me <key> [b]`: debug dump of an item.
    MetaDebug {
        /// Key token; base64 when `base64_key`.
        key: &'a [u8],
        /// The key token is base64.
        base64_key: bool,
    },
}

impl<'a> Request<'a> {
    /// The data block slot of a storage request.
    pub(crate) fn data_mut(&mut self) -> Option<&mut &'a [u8]> {
        match self {
            Self::Storage(storage) => Some(&mut storage.data),
            Self::MetaSet(set) => Some(&mut set.data),
            _ => None,
        }
    }
}

/// The six classic storage commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageCommand {
    /// `set`: store.
    Set,
    /// `add`: store only if absent.
    Add,
    /// `replace`: store only if present.
    Replace,
    /// `append`: add after the present value (flags and exptime ignored).
    Append,
    /// `prepend`: add before the present value (flags and exptime ignored).
    Prepend,
    /// `cas`: store only if the CAS value still matches.
    Cas,
}

impl StorageCommand {
    /// The command name on the wire.
    pub fn name(self) -> &'static [u8] {
        match self {
            Self::Set => b"set",
            Self::Add => b"add",
            Self::Replace => b"replace",
            Self::Append => b"append",
            Self::Prepend => b"prepend",
            Self::Cas => b"cas",
        }
    }

    pub(crate) fn from_name(name: &[u8]) -> Option<Self> {
        [
            Self::Set,
            Self::Add,
            Self::Replace,
            Self::Append,
            Self::Prepend,
            Self::Cas,
        ]
        .into_iter()
        .find(|command| command.name() == name)
    }
}

/// A classic storage request with its data block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Storage<'a> {
    /// Which command.
    pub command: StorageCommand,
    /// Key, at most [`crate::KEY_LENGTH_MAX`] bytes, no control characters.
    pub key: &'a [u8],
    /// Opaque client flags, stored and returned.
    pub client_flags: u32,
    /// Expiration: 0 never; up to 30 days, seconds from now; above, a Unix
    /// time; negative, already expired. memcached truncates it to 32 bits.
    pub exptime_s: i64,
    /// The CAS value to compare; `Some` exactly for [`StorageCommand::Cas`].
    pub cas_unique: Option<u64>,
    /// Send no reply.
    pub noreply: bool,
    /// The data block, without its `\r\n`.
    pub data: &'a [u8],
}

/// The four retrieval commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetrievalCommand {
    /// `get <key>*`.
    Get,
    /// `gets <key>*`: also return CAS values.
    Gets,
    /// `gat <exptime> <key>*`: get and touch.
    Gat,
    /// `gats <exptime> <key>*`: get and touch, with CAS values.
    Gats,
}

impl RetrievalCommand {
    /// The command name on the wire.
    pub fn name(self) -> &'static [u8] {
        match self {
            Self::Get => b"get",
            Self::Gets => b"gets",
            Self::Gat => b"gat",
            Self::Gats => b"gats",
        }
    }

    /// Whether `VALUE` lines carry the CAS value.
    pub fn returns_cas(self) -> bool {
        matches!(self, Self::Gets | Self::Gats)
    }

    /// Whether the command takes an exptime and touches what it finds.
    pub fn touches(self) -> bool {
        matches!(self, Self::Gat | Self::Gats)
    }

    pub(crate) fn from_name(name: &[u8]) -> Option<Self> {
        [Self::Get, Self::Gets, Self::Gat, Self::Gats]
            .into_iter()
            .find(|c| c.name() == name)
    }
}

/// A retrieval request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retrieval<'a> {
    /// Which command.
    pub command: RetrievalCommand,
    /// New exptime; `Some` exactly for `gat` and `gats`.
    pub exptime_s: Option<i64>,
    /// Keys, each valid. At least one for `get`/`gets`; `gat`/`gats` may have
    /// none (memcached answers `END`).
    pub keys: Tokens<'a>,
}

/// How `shutdown` was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShutdownMode {
    /// `shutdown`.
    Immediate,
    /// `shutdown graceful`.
    Graceful,
    /// Anything else; memcached (when shutdown is enabled) replies
    /// `CLIENT_ERROR invalid shutdown mode`.
    Invalid,
}

/// The log streams a `watch` asks for (memcached's `LOG_*` bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WatchFlags(pub u32);

impl WatchFlags {
    /// Item lookups clients ask for (`type=item_get`).
    pub const FETCHERS: Self = Self(1 << 0);
    /// Item stores (`type=item_store`).
    pub const MUTATIONS: Self = Self(1 << 1);
    /// Items evicted.
    pub const EVICTIONS: Self = Self(1 << 2);
    /// Connections opened and closed (`type=conn_new`, `type=conn_close`).
    pub const CONNEVENTS: Self = Self(1 << 3);
    /// Every command line as received.
    pub const RAWCMDS: Self = Self(1 << 4);
    /// Server events (memcached: extstore and the like).
    pub const SYSEVENTS: Self = Self(1 << 5);
    /// memcached's proxy: requests.
    pub const PROXYREQS: Self = Self(1 << 6);
    /// memcached's proxy: events.
    pub const PROXYEVENTS: Self = Self(1 << 7);
    /// memcached's proxy: its scripts' own lines.
    pub const PROXYUSER: Self = Self(1 << 8);
    /// Every stream by its `watch` name, as memcached 1.6.18 spells them.
    pub const NAMES: [(&'static [u8], Self); 9] = [
        (b"rawcmds", Self::RAWCMDS),
        (b"evictions", Self::EVICTIONS),
        (b"fetchers", Self::FETCHERS),
        (b"mutations", Self::MUTATIONS),
        (b"sysevents", Self::SYSEVENTS),
        (b"connevents", Self::CONNEVENTS),
        (b"proxyreqs", Self::PROXYREQS),
        (b"proxyevents", Self::PROXYEVENTS),
        (b"proxyuser", Self::PROXYUSER),
    ];

    /// Both sets of streams.
    #[must_use]
    pub fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether every stream of `other` (at least one) is among these.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0 && other.0 != 0
    }
}

/// What memcached answers a well-formed `slabs` or `lru` tuning command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TuningReply {
    /// `OK`: `slabs automove 0|1|2`, `lru mode flat|segmented`, `lru tune` within bounds,
    /// `lru temp_ttl <n>`.
    Ok,
    /// `slabs reassign` of valid classes: `NOSPARE source class has no spare pages`.
    NoSpare,
    /// `slabs reassign` of a class outside 0..=63 (source) or 1..=63 (destination).
    BadClass,
    /// `lru tune` whose hot and warm percentages add up past 80.
    HotWarmOver80,
}

impl TuningReply {
    /// The reply line.
    pub fn line(self) -> &'static [u8] {
        match self {
            Self::Ok => b"OK\r\n",
            Self::NoSpare => b"NOSPARE source class has no spare pages\r\n",
            Self::BadClass => b"BADCLASS invalid src or dst class id\r\n",
            Self::HotWarmOver80 => b"ERROR hot and warm pcts must not exceed 80\r\n",
        }
    }
}

/// `lru_crawler crawl|enable|disable|sleep|tocrawl`, as memcached 1.6 takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrawlerCommand {
    /// `crawl <classes>`: reclaim the expired items of these classes (memcached answers
    /// `BADCLASS invalid class id` for bad ones, and an error for `hash`).
    Crawl(MetadumpClasses),
    /// `enable`: memcached answers `ERROR failed to start lru crawler thread` when it runs.
    Enable,
    /// `disable`.
    Disable,
    /// `sleep <microseconds>` (at most a second) between batches of items.
    Sleep(u32),
    /// `tocrawl <items>`: items looked at per class and crawl, at most (0: all). As
    /// memcached, a number above `u32::MAX` keeps its low 32 bits.
    ToCrawl(u32),
}

/// Which items `lru_crawler metadump` lists, by memcached's slab class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetadumpClasses {
    /// `all`.
    All,
    /// `hash`: every item, in hash-table order (memcached's; the order differs).
    Hash,
    /// Classes from `1,3,10`: bit `i` set for class `i`.
    Classes(u64),
    /// Not `all`, `hash` or classes 1..=63: memcached answers `BADCLASS invalid class id`.
    Invalid,
}

impl MetadumpClasses {
    /// Largest slab class id memcached takes.
    pub const CLASS_MAX: u32 = 63;

    /// Whether an item of slab class `class` is listed.
    pub fn includes(&self, class: u32) -> bool {
        match *self {
            Self::All | Self::Hash => true,
            Self::Classes(bits) => class <= Self::CLASS_MAX && bits & (1 << class) != 0,
            Self::Invalid => false,
        }
    }
}

/// `mg` or `md`: a key and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    /// Key token; base64 when `flags.base64_key()` (the decoded key is what
    /// the command names, see [`crate::decode_base64_key`]).
    pub key: &'a [u8],
    /// The flags, in request order.
    pub flags: MetaFlags<'a>,
}

/// `ms` with its data block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaSet<'a> {
    /// Key token (see [`MetaRequest::key`]).
    pub key: &'a [u8],
    /// The flags, in request order.
    pub flags: MetaFlags<'a>,
    /// The storage mode, from the `M` flag.
    pub mode: SetMode,
    /// The data block, without its `\r\n`.
    pub data: &'a [u8],
}

/// `ma`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaArithmetic<'a> {
    /// Key token (see [`MetaRequest::key`]).
    pub key: &'a [u8],
    /// The flags, in request order.
    pub flags: MetaFlags<'a>,
    /// Increment or decrement, from the `M` flag.
    pub op: ArithmeticOp,
}

impl MetaArithmetic<'_> {
    /// The delta to apply: `D`, or memcached's default of 1.
    pub fn delta(&self) -> u64 {
        self.flags.delta().unwrap_or(1)
    }

    /// The value of a vivified counter: `J`, or memcached's default of 0.
    pub fn initial(&self) -> u64 {
        self.flags.initial().unwrap_or(0)
    }
}
