//! A served store's change counter and log, shared with the processes of its host.
//!
//! A kura server counts every change to what it serves (each write, delete and `flush_all`)
//! in a file beside the store (`STORE.changes`), mapped by the server and by clients on the
//! same host. A client that keeps records it read (the file system's metadata) may answer
//! from its copies for as long as the counter has not moved since it read them (nothing in
//! the store changed in between, whoever wrote), or, through the log below, for as long as
//! no change was to their keys. The server bumps the counter after a change is visible to
//! readers and before it acknowledges it, so a change a client could know of has always
//! moved the counter.
//!
//! The file also names the server's instance (`kura_instance_id` of `stats`, which is how a
//! client finds that the file is this server's) and carries a heartbeat the server renews
//! every [`CHANGES_HEARTBEAT_MS`]: a server killed with `kill -9` or replaced by one on
//! another store stops renewing it, and clients stop trusting the counter after
//! [`CHANGES_HEARTBEAT_STALE_MS`]. A server that stops cleanly clears the instance at once.
//! A server that opens the store again reuses the file and bumps the counter first, so that
//! holders of the old mapping see a change.
//!
//! Beside the counter, the file keeps a log of which keys the last [`CHANGES_LOG_ENTRIES`]
//! changes were to: entry `n % CHANGES_LOG_ENTRIES` names change number `n` (the counter's
//! value once it was counted) by its key's [`change_tag`] and the round `n /
//! CHANGES_LOG_ENTRIES` (its low 16 bits), so a reader tells an entry of change `n` from an
//! older one not yet overwritten, or a newer one that overwrote it. A client that read the
//! counter at `a` and finds it at `b` learns from entries `a + 1 ..= b` which keys changed
//! meanwhile, and keeps its copies of all the others. A change of no one key (`flush_all`, a
//! server starting or stopping) is logged with tag 0: everything changed. The entry is
//! written just after the change is counted: a reader that finds an entry of another round
//! where it expected change `n` does not know what changed, and drops everything, as it does
//! when more than [`CHANGES_LOG_ENTRIES`] changes went by.
//!
//! Layout (native-endian words, each written and read atomically):
//!
//! | offset | word |
//! |---|---|
//! | 0 | magic `CHANGES_MAGIC` |
//! | 8 | format version `CHANGES_FORMAT_VERSION` |
//! | 16 | instance id (0: no server) |
//! | 64 | change counter |
//! | 128 | heartbeat: `CLOCK_MONOTONIC` milliseconds |
//! | 4096 + 8 × i | log entry i: key tag (48 bits) << 16 \| round (16 bits) |

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use crate::mapped::MappedWords;

/// "KURACHG1", little-endian.
pub const CHANGES_MAGIC: u64 = u64::from_le_bytes(*b"KURACHG1");
pub const CHANGES_FORMAT_VERSION: u64 = 2;
/// Changes the log names the keys of: the last this many (512 KiB of the file).
pub const CHANGES_LOG_ENTRIES: u64 = 1 << 16;
/// Bytes of the header page, before the log.
const HEADER_BYTES: usize = 4096;
/// Bytes of the file (and of each mapping).
pub const CHANGES_FILE_BYTES: usize = HEADER_BYTES + CHANGES_LOG_ENTRIES as usize * 8;
/// How often the server renews the heartbeat.
pub const CHANGES_HEARTBEAT_MS: u64 = 500;
/// A heartbeat older than this is a server that is gone (or stalled): the counter is not
/// trusted.
pub const CHANGES_HEARTBEAT_STALE_MS: u64 = 3000;

const WORD_MAGIC: usize = 0;
const WORD_VERSION: usize = 1;
const WORD_INSTANCE: usize = 2;
const WORD_COUNTER: usize = 8;
const WORD_HEARTBEAT: usize = 16;
const WORD_LOG: usize = HEADER_BYTES / 8;
/// The tag of a change to everything (or to no key in particular).
pub const CHANGE_TAG_ALL: u64 = 0;
const ROUND_BITS: u32 = 16;
const ROUND_MASK: u64 = (1 << ROUND_BITS) - 1;

/// The tag the log names a change to `key` by: 48 bits of its hash, never
/// [`CHANGE_TAG_ALL`]. Keys with one tag are told apart by no one: a change to one looks like
/// a change to both (a copy dropped for nothing, never one kept wrongly).
pub fn change_tag(key: &[u8]) -> u64 {
    (xxhash_rust::xxh3::xxh3_64(key) >> ROUND_BITS).max(1)
}

/// The log entry of change number `n` to a key of tag `tag`.
fn log_entry(n: u64, tag: u64) -> u64 {
    (tag << ROUND_BITS) | ((n / CHANGES_LOG_ENTRIES) & ROUND_MASK)
}

/// The word of the log entry of change number `n`.
fn log_word(n: u64) -> usize {
    WORD_LOG + (n % CHANGES_LOG_ENTRIES) as usize
}

/// The changes file of the store at `store_path`.
pub fn changes_path(store_path: &Path) -> PathBuf {
    let mut name = store_path.as_os_str().to_owned();
    name.push(".changes");
    PathBuf::from(name)
}

/// `CLOCK_MONOTONIC` in milliseconds: one clock for every process of the host.
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The server's side: the counter it bumps and the heartbeat it renews.
pub struct ChangeFile {
    map: MappedWords,
    path: PathBuf,
    instance_id: u64,
}

impl std::fmt::Debug for ChangeFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeFile").field("path", &self.path).field("instance_id", &self.instance_id).finish()
    }
}

impl ChangeFile {
    /// Opens (making it, mode 0644) the changes file at `path` for the server instance
    /// `instance_id` (nonzero); the caller holds the store's lock, so no other server uses it.
    pub fn create(path: &Path, instance_id: u64) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o644).custom_flags(libc::O_CLOEXEC).open(path)?;
        if file.metadata()?.len() != CHANGES_FILE_BYTES as u64 {
            file.set_len(CHANGES_FILE_BYTES as u64)?;
        }
        let map = MappedWords::map(&file, CHANGES_FILE_BYTES / 8, true)?;
        // Holders of an earlier server's mapping see a change before they see the new
        // instance (either makes them read again).
        let changes = Self { map, path: path.to_owned(), instance_id };
        changes.bump_all();
        changes.map.word(WORD_MAGIC).store(CHANGES_MAGIC, Ordering::Release);
        changes.map.word(WORD_VERSION).store(CHANGES_FORMAT_VERSION, Ordering::Release);
        changes.map.word(WORD_HEARTBEAT).store(monotonic_ms(), Ordering::Release);
        changes.map.word(WORD_INSTANCE).store(instance_id, Ordering::Release);
        changes.bump_all();
        Ok(changes)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more change, to `key`: call after the change is visible to readers, before
    /// acknowledging it.
    pub fn bump(&self, key: &[u8]) {
        self.count(change_tag(key));
    }

    /// One more change, to everything (`flush_all`).
    pub fn bump_all(&self) {
        self.count(CHANGE_TAG_ALL);
    }

    fn count(&self, tag: u64) {
        let n = self.map.word(WORD_COUNTER).fetch_add(1, Ordering::AcqRel) + 1;
        self.map.word(log_word(n)).store(log_entry(n, tag), Ordering::Release);
    }

    /// Renews the heartbeat (every [`CHANGES_HEARTBEAT_MS`]).
    pub fn beat(&self) {
        self.map.word(WORD_HEARTBEAT).store(monotonic_ms(), Ordering::Release);
    }

    /// The server stops: clients stop trusting the counter at once.
    pub fn close(&self) {
        self.map.word(WORD_INSTANCE).store(0, Ordering::Release);
        self.bump_all();
    }
}

/// A client's read-only view of a server's changes file.
pub struct ChangeView {
    map: MappedWords,
    instance_id: u64,
    path: PathBuf,
}

impl std::fmt::Debug for ChangeView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeView").field("instance_id", &self.instance_id).field("counter", &self.counter()).finish()
    }
}

impl ChangeView {
    /// Maps the changes file at `path`, which must belong to the server instance
    /// `instance_id` (as its `stats` said) and be alive.
    pub fn open(path: &Path, instance_id: u64) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(path)?;
        if file.metadata()?.len() != CHANGES_FILE_BYTES as u64 {
            return Err(invalid("not a kura changes file (its size)"));
        }
        // Read only: a view never stores.
        let map = MappedWords::map(&file, CHANGES_FILE_BYTES / 8, false)?;
        if map.word(WORD_MAGIC).load(Ordering::Acquire) != CHANGES_MAGIC || map.word(WORD_VERSION).load(Ordering::Acquire) != CHANGES_FORMAT_VERSION {
            return Err(invalid("not a kura changes file of this version"));
        }
        let view = Self { map, instance_id, path: path.to_owned() };
        if view.counter().is_none() {
            return Err(invalid("belongs to another server instance, or its server is gone"));
        }
        Ok(view)
    }

    /// The change counter, while the file is the server's and the server is alive; `None`
    /// when it cannot be trusted (the view is then of no more use: the server changed).
    pub fn counter(&self) -> Option<u64> {
        let counter = self.map.word(WORD_COUNTER).load(Ordering::Acquire);
        let alive = self.map.word(WORD_INSTANCE).load(Ordering::Acquire) == self.instance_id
            && monotonic_ms().saturating_sub(self.map.word(WORD_HEARTBEAT).load(Ordering::Acquire)) <= CHANGES_HEARTBEAT_STALE_MS;
        alive.then_some(counter)
    }

    /// Calls `each` with the tag of every change after the counter stood at `from` up to
    /// `to` (as [`ChangeView::counter`] gave them), oldest first; `false` (having called it
    /// for some) when the log cannot tell them all: more than [`CHANGES_LOG_ENTRIES`] went by
    /// (or `to` is before `from`), an entry was overwritten or is still being written, or a
    /// change was to everything.
    pub fn changes_between(&self, from: u64, to: u64, mut each: impl FnMut(u64)) -> bool {
        if to < from || to - from > CHANGES_LOG_ENTRIES {
            return false;
        }
        for n in from + 1..=to {
            let entry = self.map.word(log_word(n)).load(Ordering::Acquire);
            let tag = entry >> ROUND_BITS;
            if entry & ROUND_MASK != (n / CHANGES_LOG_ENTRIES) & ROUND_MASK || tag == CHANGE_TAG_ALL {
                return false;
            }
            each(tag);
        }
        true
    }

    /// The server instance this view belongs to.
    pub fn instance_id(&self) -> u64 {
        self.instance_id
    }

    /// The file mapped: one per store, whatever the server's port or start.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_follows_the_counter_of_its_server_and_stops_at_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = changes_path(&dir.path().join("store"));
        let server = ChangeFile::create(&path, 7).unwrap();
        let view = ChangeView::open(&path, 7).unwrap();
        let first = view.counter().unwrap();
        assert_eq!(view.counter(), Some(first));
        server.bump(b"k");
        assert_eq!(view.counter(), Some(first + 1));
        assert!(ChangeView::open(&path, 8).is_err(), "another instance's file is refused");
        // A new server on the same store: the old view is done.
        drop(server);
        let _next = ChangeFile::create(&path, 9).unwrap();
        assert_eq!(view.counter(), None);
        let next_view = ChangeView::open(&path, 9).unwrap();
        assert!(next_view.counter().unwrap() > first + 1, "the counter only grows");
    }

    #[test]
    fn a_closed_or_silent_server_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.changes");
        let server = ChangeFile::create(&path, 3).unwrap();
        let view = ChangeView::open(&path, 3).unwrap();
        server.map.word(WORD_HEARTBEAT).store(monotonic_ms() - CHANGES_HEARTBEAT_STALE_MS - 1, Ordering::Release);
        assert_eq!(view.counter(), None, "a stale heartbeat");
        server.beat();
        assert!(view.counter().is_some());
        server.close();
        assert_eq!(view.counter(), None, "closed");
        std::fs::write(dir.path().join("other"), b"x").unwrap();
        assert!(ChangeView::open(&dir.path().join("other"), 3).is_err());
    }

    #[test]
    fn the_log_names_the_keys_changed_until_it_wraps_or_a_change_is_to_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.changes");
        let server = ChangeFile::create(&path, 5).unwrap();
        let view = ChangeView::open(&path, 5).unwrap();
        let start = view.counter().unwrap();
        let tags = |from: u64, to: u64| {
            let mut seen = Vec::new();
            view.changes_between(from, to, |tag| seen.push(tag)).then_some(seen)
        };
        assert_eq!(tags(start, start), Some(vec![]));
        server.bump(b"a");
        server.bump(b"b");
        server.bump(b"a");
        let now = view.counter().unwrap();
        assert_eq!(now, start + 3);
        assert_eq!(tags(start, now), Some(vec![change_tag(b"a"), change_tag(b"b"), change_tag(b"a")]));
        assert_eq!(tags(start + 1, now), Some(vec![change_tag(b"b"), change_tag(b"a")]));
        assert_eq!(tags(now, start), None, "backwards");
        assert_ne!(change_tag(b"a"), change_tag(b"b"));
        assert_ne!(change_tag(b""), CHANGE_TAG_ALL);
        // A server's start and stop are changes to everything.
        assert_eq!(tags(start - 1, now), None);
        server.bump_all();
        assert_eq!(tags(now, now + 1), None);
        // Counted but its entry not yet written: the entry of the change a round before.
        let n = server.map.word(WORD_COUNTER).fetch_add(1, Ordering::AcqRel) + 1;
        let later = view.counter().unwrap();
        assert_eq!(later, n);
        assert_eq!(tags(later - 1, later), None, "an entry still being written");
        server.map.word(log_word(n)).store(log_entry(n, change_tag(b"c")), Ordering::Release);
        assert_eq!(tags(later - 1, later), Some(vec![change_tag(b"c")]));
        // A full round later every entry was overwritten.
        for i in 0..CHANGES_LOG_ENTRIES {
            server.bump(&i.to_le_bytes());
        }
        let last = view.counter().unwrap();
        assert_eq!(tags(later - 1, last), None, "more changes than the log holds");
        assert_eq!(tags(later - 1, later), None, "an overwritten entry");
        let mut count = 0;
        assert!(view.changes_between(last - CHANGES_LOG_ENTRIES, last, |_| count += 1));
        assert_eq!(count, CHANGES_LOG_ENTRIES);
    }
}
