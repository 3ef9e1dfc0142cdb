//! kura's POSIX file system on the pool (paper 004's EvFS, with its namespace in the pool so
//! that many processes and hosts share it).
//!
//! * [`layout`]: every key and record — inodes, directory buckets, data chunks.
//! * [`kv`]: the small store interface the file system needs (versioned get, CAS put/delete,
//!   batched data get/set/delete, flush) and [`PoolKv`], its implementation over `kura_pool`
//!   (embedded engine, kura servers, memcached, redis-server; not Redis Cluster).
//! * [`ns`]: namespace operations, each change a compare-and-swap.
//! * [`cache`]: the user-level page cache — a memory limit, a dirty threshold (20 % by
//!   default) written back by a background worker, writers waiting when memory is full,
//!   `O_DIRECT` around it, `O_SYNC` through it, `fsync` as a barrier.
//! * [`path`]: path resolution (symlinks, `..`, mount prefix).
//! * [`fuse`]: the same namespace through the kernel (`kura fs mount`).
//! * [`sync`]: the locks, which a `fork` can hold (std's futex words, not parking_lot's).
//!
//! Consistency between processes is close-to-open (as NFS): a process's buffered writes
//! reach the pool at the latest when it closes the file, calls `fsync`, forks, execs or exits;
//! a process opening a file sees what was written back before. Metadata (names, links,
//! attributes) is never cached: every change is a CAS on the pool's record, and every lookup
//! reads the pool (names seen before only let a path walk read its records together, see
//! [`memo`]). Files open in a
//! process when it forks are *shared* by parent and child (one open file description, one
//! offset): until their last close there, reads and writes of such a file go straight to the
//! pool, one at a time across the processes of the host ([`Fs::shared_io`]), so each sees
//! the other's writes at once and appends and shared offsets never overlap, as on Linux.

mod bounded;
pub mod cache;
pub mod copies;
pub mod elf;
pub mod error;
pub mod fuse;
pub mod holes;
pub mod kv;
pub mod layout;
pub mod memo;
pub mod ns;
mod openers;
pub mod path;
pub mod shebang;
pub mod sync;
pub mod xattr;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Once};

use crate::sync::Mutex;

pub use cache::{Node, SharedIoGuard, WriteMode, WritebackPause};
pub use error::{FsError, Result};
pub use kv::{Cond, Kv, PoolKv, PoolSpace};
pub use layout::{DirEntry, Inode, ROOT_INO};
pub use ns::{Owner, RenameFlags, SetAttr};
pub use xattr::XattrFlags;

/// Page cache size when none is given.
pub const CACHE_BYTES_DEFAULT: u64 = 256 << 20;
/// Dirty share of the cache above which write-back starts (the paper's 20 %).
pub const DIRTY_PERCENT_DEFAULT: u32 = 20;
/// Dirty data older than this is written back even below the threshold.
pub const WRITEBACK_INTERVAL_MS_DEFAULT: u64 = 5000;
/// Pages read ahead on a sequential read miss.
pub const READAHEAD_PAGES_DEFAULT: u32 = 32;
/// The smallest cache accepted (a few pages per thread would deadlock writers).
pub const CACHE_BYTES_MIN: u64 = 1 << 20;

/// This process's id as [`process_id`] last read it; 0 when unknown (at start, and in the child
/// of a `fork`). Inherently process-wide: it caches a property of the process.
static PROCESS_ID: AtomicU32 = AtomicU32::new(0);
static PROCESS_ID_ATFORK: Once = Once::new();

extern "C" fn forget_process_id() {
    PROCESS_ID.store(0, Ordering::Relaxed);
}

/// This process's id, without a system call on the data path. `getpid` is one (glibc stopped
/// caching it), and the cache and the pool contexts check the process on every request to
/// notice a `fork`. The cached id is dropped in the child of every `fork` that runs the
/// atfork handlers (glibc's `fork`, `vfork`-as-`fork`); a child made by a raw `clone` system
/// call would see its parent's id.
#[inline]
pub fn process_id() -> u32 {
    let pid = PROCESS_ID.load(Ordering::Relaxed);
    if pid != 0 {
        return pid;
    }
    PROCESS_ID_ATFORK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(forget_process_id)) };
    });
    let pid = std::process::id();
    PROCESS_ID.store(pid, Ordering::Relaxed);
    pid
}

/// Blocks every signal in the calling thread, a thread of kura's own: the program's signals
/// are handled by its threads, never by one in the middle of kura's work.
pub fn block_signals_in_this_thread() {
    // SAFETY: a full set blocks every signal this thread could be sent; both calls only read
    // and write the set given.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
}

/// A number telling file system instances of one process apart (from the time and the
/// instance's address).
fn instance_id(me: &std::sync::Weak<Fs>) -> u32 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let seed = [now.to_le_bytes(), (me.as_ptr() as usize as u64).to_le_bytes()].concat();
    xxhash_rust::xxh3::xxh3_64(&seed) as u32
}

/// How one process uses a file system.
#[derive(Debug, Clone)]
pub struct FsConfig {
    /// The file system's name in the pool (several can share one pool).
    pub name: String,
    /// Chunk size of a new file system (an existing one keeps its own).
    pub chunk_size_bytes: u32,
    /// Page cache memory limit.
    pub cache_bytes_max: u64,
    /// Dirty share (percent of the cache) that starts write-back.
    pub dirty_percent: u32,
    pub writeback_interval_ms: u64,
    pub readahead_pages: u32,
    /// A local file whose byte `ino` (a POSIX record lock) serializes the reads and writes of
    /// the processes of this host that share open file `ino` (see [`Node::is_shared`]); the
    /// preload sets it. `None`: only this process's threads are serialized.
    pub shared_io_lock_path: Option<std::path::PathBuf>,
    /// A file mapped by every process of this host (and user) using the file system, where
    /// they share the names they have seen as hints for their path walks (see
    /// [`memo::SharedNames`]); the preload sets it. `None`: each process learns names alone.
    pub shared_names_path: Option<std::path::PathBuf>,
    /// Where this host keeps files that stand for inodes (a lock file, a FIFO, a shared
    /// mapping's backing, a program's text lock, a loaded library's copy): the start of
    /// their paths, to which the inode number in hex and one of [`host_files::ALL`] are
    /// added; the preload sets it. A file deleted by this process has them removed (see
    /// [`Fs::forget_deleted`]). `None`: there are none.
    pub host_files_prefix: Option<std::path::PathBuf>,
}

/// The endings of the host files of an inode (see [`FsConfig::host_files_prefix`]).
pub mod host_files {
    /// The lock file of `flock` and `fcntl` locks.
    pub const LOCK: &str = "";
    /// A shared mapping's backing file.
    pub const MAP: &str = ".map";
    /// A loaded library's copy.
    pub const LIBRARY: &str = ".so";
    /// A running program's text lock.
    pub const TEXT: &str = ".text";
    /// The kernel FIFO standing for a kura FIFO.
    pub const FIFO: &str = ".fifo";
    pub const ALL: [&str; 5] = [LOCK, MAP, LIBRARY, TEXT, FIFO];
}

impl Default for FsConfig {
    fn default() -> Self {
        Self {
            name: "default".to_owned(),
            chunk_size_bytes: layout::CHUNK_SIZE_BYTES_DEFAULT,
            cache_bytes_max: CACHE_BYTES_DEFAULT,
            dirty_percent: DIRTY_PERCENT_DEFAULT,
            writeback_interval_ms: WRITEBACK_INTERVAL_MS_DEFAULT,
            readahead_pages: READAHEAD_PAGES_DEFAULT,
            shared_io_lock_path: None,
            shared_names_path: None,
            host_files_prefix: None,
        }
    }
}

/// This process's range of inode numbers (taken from the pool's counter).
#[derive(Debug, Default)]
pub(crate) struct InoRange {
    pub pid: u32,
    pub next: u64,
    pub end: u64,
}

/// One process's handle on a file system in the pool. Cheap to share (`Arc`); every method
/// takes `&self` and is safe from many threads.
pub struct Fs {
    pub(crate) kv: Arc<dyn Kv>,
    pub(crate) keys: layout::Keys,
    /// Chunk (and cache page) size.
    pub(crate) chunk: usize,
    pub(crate) config: FsConfig,
    pub(crate) inos: Mutex<InoRange>,
    /// Inodes this process has open or cached pages of.
    pub(crate) nodes: Mutex<HashMap<u64, Arc<Node>>>,
    pub(crate) cache: cache::CacheState,
    /// This file system itself, for the write-back worker it starts.
    pub(crate) me: std::sync::Weak<Fs>,
    /// Tells this instance apart from others in the same process (see [`layout::Opener`]).
    pub(crate) instance: u32,
    /// How this instance is recorded in the files it opens (renewed after `fork`).
    pub(crate) opener: Mutex<Option<layout::Opener>>,
    /// Inode records as this process last read or wrote them, with their versions and when
    /// (at most `ns::RECENT_INODES_MAX`).
    pub(crate) recent_inodes: Mutex<HashMap<u64, (Inode, u64, std::time::Instant)>>,
    /// Directory buckets as this process last read or wrote them (at most
    /// `ns::RECENT_BUCKETS_BYTES_MAX` bytes).
    pub(crate) recent_buckets: Mutex<ns::RecentBuckets>,
    /// Names this process has seen, which predict the records a path walk reads.
    pub(crate) memo: memo::NameMemo,
    /// `config.shared_io_lock_path` opened (at its first use; `None` inside when it cannot be).
    pub(crate) shared_io_lock: std::sync::OnceLock<Option<std::os::fd::OwnedFd>>,
    /// The pool's room as `statfs` last looked it up, and when.
    pub(crate) space_cache: Mutex<Option<(std::time::Instant, Option<kv::PoolSpace>)>>,
}

impl Fs {
    /// Opens the file system `config.name` in `kv`, formatting it when the pool has none.
    pub fn open(kv: Arc<dyn Kv>, config: FsConfig, owner: Owner) -> Result<Arc<Self>> {
        let keys = layout::Keys::new(&config.name)?;
        let sb_key = keys.superblock();
        let wanted = layout::Superblock { chunk_size_bytes: config.chunk_size_bytes };
        if !(layout::CHUNK_SIZE_BYTES_MIN..=layout::CHUNK_SIZE_BYTES_MAX).contains(&wanted.chunk_size_bytes) {
            return Err(FsError::Invalid);
        }
        if config.cache_bytes_max < CACHE_BYTES_MIN || !(1..=100).contains(&config.dirty_percent) {
            return Err(FsError::Invalid);
        }
        // The superblock, the root and the orphan list in one round trip: every process that
        // touches the file system starts here.
        let mut found = kv.get_versioned_many(&[sb_key.clone(), keys.inode(ROOT_INO), keys.orphans()])?.into_iter();
        let (sb_found, root_found, orphans_found) = match (found.next(), found.next(), found.next()) {
            (Some(sb), Some(root), Some(orphans)) => (sb, root.is_some(), orphans),
            _ => return Err(FsError::Io("a batched get returned too few values".into())),
        };
        let sb = match sb_found {
            Some((bytes, _)) => layout::Superblock::decode(&sb_key, &bytes)?,
            None => {
                kv.put_cond(&sb_key, &wanted.encode(), Cond::Absent)?;
                let (bytes, _) = kv.get_versioned(&sb_key)?.ok_or_else(|| FsError::Io("superblock vanished".into()))?;
                layout::Superblock::decode(&sb_key, &bytes)?
            }
        };
        let chunk = sb.chunk_size_bytes as usize;
        let memo = memo::NameMemo::with_shared(config.shared_names_path.as_deref());
        let fs = Arc::new_cyclic(|me| Self {
            cache: cache::CacheState::new(&config, chunk),
            kv,
            keys,
            chunk,
            config,
            inos: Mutex::new(InoRange::default()),
            nodes: Mutex::new(HashMap::new()),
            me: me.clone(),
            instance: instance_id(me),
            opener: Mutex::new(None),
            recent_inodes: Mutex::new(HashMap::new()),
            recent_buckets: Mutex::new(ns::RecentBuckets::default()),
            memo,
            shared_io_lock: std::sync::OnceLock::new(),
            space_cache: Mutex::new(None),
        });
        if !root_found {
            fs.format_root(owner)?;
        }
        // Unlinked files whose last openers died (killed) are deleted by the next instance.
        if let Err(error) = fs.sweep_orphan_list(orphans_found) {
            tracing::warn!(%error, "could not sweep the orphan list");
        }
        Ok(fs)
    }

    pub fn chunk_size_bytes(&self) -> usize {
        self.chunk
    }

    pub fn config(&self) -> &FsConfig {
        &self.config
    }

    pub fn kv(&self) -> &Arc<dyn Kv> {
        &self.kv
    }
}
