//! Copies of metadata records shared by the processes of a host (and user): a table in a
//! file every process of the file system maps, so that a process started after another read
//! a record (a shell's next command: `ls -l`, then `du`, then `git status`) finds it there
//! instead of asking the pool.
//!
//! Each copy is tagged with the pool it was read from ([`crate::kv`]'s servers' instance
//! ids, hashed) and the change counter of its key's server it is current at: a reader takes
//! a copy only of its own pool, and only when that server's change log names no change to
//! the key since that count (see `kv::Changes`), so a copy taken is exactly what the server
//! would answer, as a process's own copies are. A stale copy is never taken; it is only
//! overwritten.
//!
//! The table is [`SHARED_COPIES_SLOTS`] slots of [`SLOT_WORDS`] 64-bit words, written and
//! read only through atomics. A slot is a sequence lock (an odd count while a writer fills
//! it; a reader that sees the count move or odd takes nothing), the tags, the key's hash,
//! the lengths and the record's version, then the key and value bytes packed in words. A key
//! may live in any slot of its group of [`SLOT_WAYS`]; a new copy goes to the slot holding
//! the key, else to one holding nothing current, else over one of the others. A writer that
//! finds a slot being written leaves it; a writer killed mid-write leaves that slot odd, and
//! lost, until the file is made again. Records larger than a slot (a directory bucket of more
//! than ~20 names) are not shared. Garbage in the file (another program of the same user
//! writing into it) can only give records that fail to decode: the file is the user's own
//! (mode 0600), like the processes that could corrupt it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use kura_engine::mapped::MappedWords;

use crate::kv::Versioned;

/// The table's layout, in its file's name (see [`shared_copies_file_name`]): a change of
/// layout makes a new file instead of reading an old one wrongly.
pub const SHARED_COPIES_FORMAT: u32 = 2;

/// The table's file name, for the pool `stores` (a hash of its servers' stores: the same
/// table whatever port or start of them a process reaches) and user `uid`.
pub fn shared_copies_file_name(stores: u64, uid: u32) -> String {
    format!("{stores:016x}.copies{SHARED_COPIES_FORMAT}.{uid}")
}

/// Where the tables are kept: in memory, where writing a page of a table costs no file
/// system journal and no write-back to a disk.
pub const SHARED_COPIES_DIR_DEFAULT: &str = "/dev/shm/kura-fs-copies";

/// The directory of the tables: `lock_dir`, the preload's lock directory when one is set
/// (`KURA_FS_LOCK_DIR`: tests, whose tables then go with it), else
/// [`SHARED_COPIES_DIR_DEFAULT`] (or the temporary directory's `kura-fs-copies` without
/// `/dev/shm`). The preload and `kura fs mount` use the same, so they share their copies.
pub fn shared_copies_dir(lock_dir: Option<std::ffi::OsString>) -> std::path::PathBuf {
    match lock_dir {
        Some(dir) => dir.into(),
        None if Path::new("/dev/shm").is_dir() => SHARED_COPIES_DIR_DEFAULT.into(),
        None => std::env::temp_dir().join("kura-fs-copies"),
    }
}

/// A table no process has opened for this long is removed by the next process of its user
/// that opens one (its pages are memory, in `/dev/shm`).
pub const SHARED_COPIES_IDLE_S: u64 = 24 * 3600;

/// Slots of the table (32 MiB with [`SLOT_WORDS`] of 64; pages no process touched take no
/// memory).
pub const SHARED_COPIES_SLOTS: usize = 1 << 16;
/// Words per slot.
const SLOT_WORDS: usize = 64;
/// Slots a key may live in: an aligned group of this many.
const SLOT_WAYS: usize = 4;
const WORD_SEQ: usize = 0;
const WORD_POOL: usize = 1;
/// The change counter of the key's server the copy is current at.
const WORD_AT: usize = 2;
const WORD_HASH: usize = 3;
/// Key length (bits 0..16), value length (16..48), whether there is a record (bit 63).
const WORD_LENS: usize = 4;
const WORD_VERSION: usize = 5;
const WORD_PAYLOAD: usize = 6;
/// Key and value bytes a slot holds, together.
pub const SLOT_PAYLOAD_BYTES_MAX: usize = (SLOT_WORDS - WORD_PAYLOAD) * 8;
const PRESENT: u64 = 1 << 63;

/// The shared table, mapped.
#[derive(Debug)]
pub struct SharedCopies {
    words: MappedWords,
    slots: usize,
}

/// Removes this user's tables in `dir` (other than `keep`) that no process opened for
/// [`SHARED_COPIES_IDLE_S`]: tables of pools and stores no longer used.
fn remove_idle(dir: &Path, uid: u32, keep: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let ending = format!(".{uid}");
    let idle = std::time::Duration::from_secs(SHARED_COPIES_IDLE_S);
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.contains(".copies") || !name.ends_with(&ending) || entry.path() == keep {
            continue;
        }
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.is_file() && meta.uid() == uid && meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age > idle) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl SharedCopies {
    /// Maps the table at `path`, making it (mode 0600) or growing it to `slots` slots first.
    /// A file that is not this user's own, or that others may write, is refused: what it
    /// holds is taken as the pool's records (a file another user made at this name in the
    /// shared lock directory could otherwise feed this user's programs any metadata).
    pub fn open(path: &Path, slots: usize) -> std::io::Result<Self> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        if let Some(dir) = path.parent().filter(|d| !d.exists()) {
            // Shared by the host's users, each with files of their own (sticky, as /tmp; set
            // after making it, past the umask).
            use std::os::unix::fs::PermissionsExt;
            if std::fs::DirBuilder::new().recursive(true).create(dir).is_ok() {
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
            }
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW).open(path)?;
        let meta = file.metadata()?;
        // SAFETY: geteuid cannot fail and touches no memory.
        let uid = unsafe { libc::geteuid() };
        if meta.uid() != uid || meta.mode() & 0o022 != 0 || !meta.is_file() {
            return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{} is not this user's own file (owner {}, mode {:o})", path.display(), meta.uid(), meta.mode() & 0o7777)));
        }
        // In use: not idle (see `remove_idle`).
        let _ = file.set_modified(std::time::SystemTime::now());
        if let Some(dir) = path.parent() {
            remove_idle(dir, uid, path);
        }
        let len_bytes = slots * SLOT_WORDS * 8;
        if meta.len() < len_bytes as u64 {
            file.set_len(len_bytes as u64)?;
        }
        Ok(Self { words: MappedWords::map(&file, slots * SLOT_WORDS, true)?, slots })
    }

    fn slot(&self, at: usize) -> &[AtomicU64] {
        self.words.words(at * SLOT_WORDS, SLOT_WORDS)
    }

    fn hash(key: &[u8]) -> u64 {
        xxhash_rust::xxh3::xxh3_64(key) | 1
    }

    /// The slots `key` may live in.
    fn candidates(&self, hash: u64) -> std::ops::Range<usize> {
        let groups = (self.slots / SLOT_WAYS).max(1);
        let start = ((hash as usize) % groups) * SLOT_WAYS;
        start..(start + SLOT_WAYS).min(self.slots)
    }

    /// The copy of `key` from `pool`, if the table holds one, and the change counter of its
    /// server it is current at.
    pub fn get(&self, pool: u64, key: &[u8]) -> Option<(u64, Versioned)> {
        let hash = Self::hash(key);
        self.candidates(hash).find_map(|at| Self::read(self.slot(at), pool, hash, key))
    }

    fn read(slot: &[AtomicU64], pool: u64, hash: u64, key: &[u8]) -> Option<(u64, Versioned)> {
        let seq = slot[WORD_SEQ].load(Ordering::Acquire);
        if seq % 2 == 1 || slot[WORD_HASH].load(Ordering::Relaxed) != hash || slot[WORD_POOL].load(Ordering::Relaxed) != pool {
            return None;
        }
        let current_at = slot[WORD_AT].load(Ordering::Relaxed);
        let lens = slot[WORD_LENS].load(Ordering::Relaxed);
        let version = slot[WORD_VERSION].load(Ordering::Relaxed);
        let (key_len, value_len) = ((lens & 0xffff) as usize, ((lens >> 16) & 0xffff_ffff) as usize);
        if key_len != key.len() || key_len + value_len > SLOT_PAYLOAD_BYTES_MAX {
            return None;
        }
        let mut payload = vec![0u8; (key_len + value_len).next_multiple_of(8)];
        for (chunk, word) in payload.chunks_exact_mut(8).zip(&slot[WORD_PAYLOAD..]) {
            chunk.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        fence(Ordering::Acquire);
        if slot[WORD_SEQ].load(Ordering::Relaxed) != seq || &payload[..key_len] != key {
            return None;
        }
        if lens & PRESENT == 0 {
            return Some((current_at, None));
        }
        payload.truncate(key_len + value_len);
        payload.drain(..key_len);
        Some((current_at, Some((payload, version))))
    }

    /// Keeps `record` as `key`'s copy from `pool`, current at its server's change counter
    /// `current_at` (unless it is too large, the table holds a copy of the key current at a
    /// later count, or the slot is being written).
    pub fn put(&self, pool: u64, current_at: u64, key: &[u8], record: &Versioned) {
        let value: &[u8] = record.as_ref().map_or(&[], |(value, _)| value);
        if key.len() > 0xffff || key.len() + value.len() > SLOT_PAYLOAD_BYTES_MAX {
            return;
        }
        let hash = Self::hash(key);
        let candidates = self.candidates(hash);
        // The slot that holds this key already, else one of another pool, else the one whose
        // copy is of the oldest count.
        let word = |at: usize, word: usize| self.slot(at)[word].load(Ordering::Relaxed);
        let holds = |at: &usize| word(*at, WORD_HASH) == hash && word(*at, WORD_POOL) == pool;
        let Some(at) = candidates
            .clone()
            .find(holds)
            .or_else(|| candidates.clone().find(|at| word(*at, WORD_POOL) != pool))
            .or_else(|| candidates.clone().min_by_key(|at| word(*at, WORD_AT)))
        else {
            return;
        };
        let slot = self.slot(at);
        let seq = slot[WORD_SEQ].load(Ordering::Relaxed);
        if seq % 2 == 1 || slot[WORD_SEQ].compare_exchange(seq, seq + 1, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return;
        }
        fence(Ordering::Release);
        if slot[WORD_HASH].load(Ordering::Relaxed) == hash && slot[WORD_POOL].load(Ordering::Relaxed) == pool && slot[WORD_AT].load(Ordering::Relaxed) > current_at {
            // A newer copy of the key (or of one of its hash): left as it is.
            slot[WORD_SEQ].store(seq, Ordering::Release);
            return;
        }
        let mut payload = Vec::with_capacity((key.len() + value.len()).next_multiple_of(8));
        payload.extend_from_slice(key);
        payload.extend_from_slice(value);
        payload.resize(payload.len().next_multiple_of(8), 0);
        for (chunk, word) in payload.chunks_exact(8).zip(&slot[WORD_PAYLOAD..]) {
            word.store(u64::from_le_bytes(chunk.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
        let present = if record.is_some() { PRESENT } else { 0 };
        slot[WORD_LENS].store(key.len() as u64 | ((value.len() as u64) << 16) | present, Ordering::Relaxed);
        slot[WORD_VERSION].store(record.as_ref().map_or(0, |(_, version)| *version), Ordering::Relaxed);
        slot[WORD_HASH].store(hash, Ordering::Relaxed);
        slot[WORD_POOL].store(pool, Ordering::Relaxed);
        slot[WORD_AT].store(current_at, Ordering::Relaxed);
        slot[WORD_SEQ].store(seq + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_taken_only_from_its_pool_and_the_newest_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copies");
        let writer = SharedCopies::open(&path, 64).unwrap();
        let reader = SharedCopies::open(&path, 64).unwrap();
        let record = Some((b"inode".to_vec(), 42));
        writer.put(7, 100, b"k", &record);
        writer.put(7, 100, b"gone", &None);
        assert_eq!(reader.get(7, b"k"), Some((100, record.clone())));
        assert_eq!(reader.get(7, b"gone"), Some((100, None)));
        assert_eq!(reader.get(8, b"k"), None, "another pool");
        assert_eq!(reader.get(7, b"kk"), None, "another key");
        writer.put(7, 101, b"k", &Some((b"new".to_vec(), 43)));
        assert_eq!(reader.get(7, b"k"), Some((101, Some((b"new".to_vec(), 43)))));
        writer.put(7, 99, b"k", &record);
        assert_eq!(reader.get(7, b"k"), Some((101, Some((b"new".to_vec(), 43)))), "an older copy does not replace a newer");
        writer.put(7, 101, b"big", &Some((vec![1; SLOT_PAYLOAD_BYTES_MAX], 1)));
        assert_eq!(reader.get(7, b"big"), None, "too large to share");
    }

    /// A tree's worth of records (a git checkout's: 8,000 inodes and buckets) fits: at most
    /// one in a hundred is pushed out by others of its group.
    #[test]
    fn a_trees_records_stay() {
        let dir = tempfile::tempdir().unwrap();
        let table = SharedCopies::open(&dir.path().join("copies"), SHARED_COPIES_SLOTS).unwrap();
        let key = |i: u64| format!("kfs/default/i/{i:x}").into_bytes();
        for i in 0..8000u64 {
            table.put(5, 9, &key(i), &Some((vec![1; 79], i)));
        }
        let missing = (0..8000u64).filter(|&i| table.get(5, &key(i)).is_none()).count();
        assert!(missing <= 80, "{missing} of 8,000 pushed out");
    }

    #[test]
    fn a_table_others_may_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copies");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(SharedCopies::open(&path, 8).is_err());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(SharedCopies::open(&path, 8).is_ok());
        std::os::unix::fs::symlink(&path, dir.path().join("link")).unwrap();
        assert!(SharedCopies::open(&dir.path().join("link"), 8).is_err(), "not through a symlink");
    }

    #[test]
    fn tables_idle_for_a_day_go_when_another_is_opened() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid cannot fail.
        let uid = unsafe { libc::geteuid() };
        let old = dir.path().join(shared_copies_file_name(1, uid));
        let recent = dir.path().join(shared_copies_file_name(2, uid));
        let other = dir.path().join("unrelated");
        for path in [&old, &recent, &other] {
            std::fs::write(path, b"").unwrap();
        }
        let day_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(SHARED_COPIES_IDLE_S + 60);
        for path in [&old, &other] {
            std::fs::File::options().write(true).open(path).unwrap().set_modified(day_ago).unwrap();
        }
        let _table = SharedCopies::open(&dir.path().join(shared_copies_file_name(3, uid)), 8).unwrap();
        assert!(!old.exists(), "an idle table is removed");
        assert!(recent.exists() && other.exists(), "a table in use and other files stay");
    }

    #[test]
    fn a_slot_being_written_gives_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let table = SharedCopies::open(&dir.path().join("copies"), 8).unwrap();
        table.put(1, 1, b"k", &Some((b"v".to_vec(), 1)));
        let at = table.candidates(SharedCopies::hash(b"k")).find(|&at| table.slot(at)[WORD_HASH].load(Ordering::Relaxed) == SharedCopies::hash(b"k")).unwrap();
        table.slot(at)[WORD_SEQ].fetch_add(1, Ordering::Relaxed);
        assert_eq!(table.get(1, b"k"), None);
        table.put(1, 1, b"k", &Some((b"w".to_vec(), 2)));
        assert_eq!(table.get(1, b"k"), None, "a writer leaves a slot being written alone");
    }

    #[test]
    fn readers_racing_a_writer_take_whole_copies_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copies");
        let writer = SharedCopies::open(&path, 4).unwrap();
        let reader = SharedCopies::open(&path, 4).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..20_000u64 {
                    let byte = (i % 251) as u8;
                    writer.put(1, 1, b"k", &Some((vec![byte; 400], i)));
                }
                done.store(true, Ordering::Relaxed);
            });
            let mut seen = 0;
            while !done.load(Ordering::Relaxed) {
                if let Some((1, Some((value, version)))) = reader.get(1, b"k") {
                    let byte = (version % 251) as u8;
                    assert!(value.len() == 400 && value.iter().all(|&b| b == byte), "a torn copy of version {version}");
                    seen += 1;
                }
            }
            assert!(seen > 0 || reader.get(1, b"k").is_some());
        });
    }
}
