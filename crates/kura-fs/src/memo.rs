//! Read-ahead for path walks: the names this process has seen predict which records a walk
//! will read, so that those reads go out together, in one round trip, instead of one round
//! trip per component.
//!
//! A prediction is never an answer. Every record a walk uses is read from the pool during
//! the walk, and read in the order a walk without predictions would read it: the walk takes
//! the records read ahead front to back, each only if it is the very record the walk needs
//! next, and drops the rest at the first one that is not (a name that now leads elsewhere, a
//! `..`, a symbolic link). A wrong or stale prediction therefore costs the reads after it and
//! nothing else; what the walk returns is what a walk reading one record at a time could have
//! returned. On pools of several nodes, consecutive records of one node go out together (see
//! [`crate::Kv::get_versioned_in_order`]), so the order holds there too.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use kura_engine::mapped::MappedWords;

use crate::kv::Versioned;
use crate::layout::DirEntry;
use crate::sync::Mutex;

/// Names remembered for predictions, at most (each costs its name and ~64 bytes; the memo
/// starts over when full).
pub const NAME_MEMO_ENTRIES_MAX: usize = 16_384;
/// Records one walk reads ahead in one batch, at most (a path of ~20 components with the
/// search permission checks and the last inode).
pub const READ_AHEAD_KEYS_MAX: usize = 48;

/// Slots of the table of names shared by the processes of a host ([`SharedNames`]), each
/// three 8-byte words: 1.5 MiB.
pub const SHARED_NAMES_SLOTS: usize = 1 << 16;
/// Slots a lookup or a note in the shared table looks at, from the name's own.
const SHARED_NAMES_PROBES: usize = 4;
const SHARED_NAMES_WORDS_PER_SLOT: usize = 3;

/// A name in a directory: `(directory inode, name)`.
type DirName = (u64, Vec<u8>);

/// `(directory, name) → (inode, type)` as this process last saw it, and as the host's other
/// processes saw it ([`SharedNames`]), for a process's first walks.
#[derive(Debug, Default)]
pub(crate) struct NameMemo {
    names: Mutex<HashMap<DirName, (u64, u8)>>,
    shared: Option<SharedNames>,
}

impl NameMemo {
    /// A memo that also reads and writes the host's table at `path` (made when missing; left
    /// out, with a warning, when it cannot be mapped).
    pub fn with_shared(path: Option<&Path>) -> Self {
        let shared = path.and_then(|path| match SharedNames::open(path, SHARED_NAMES_SLOTS) {
            Ok(table) => Some(table),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot map the shared name table: each process learns names alone");
                None
            }
        });
        Self { names: Mutex::default(), shared }
    }

    /// The inode and type `name` in `dir` had when this process (or, failing that, another
    /// of the host's) last looked.
    pub fn get(&self, dir: u64, name: &[u8]) -> Option<(u64, u8)> {
        // A borrowed tuple key cannot be looked up without building one.
        let own = self.names.lock().get(&(dir, name.to_vec())).copied();
        own.or_else(|| self.shared.as_ref()?.get(dir, name))
    }

    /// Notes what `name` in `dir` is now (`None`: absent).
    pub fn note(&self, dir: u64, name: &[u8], entry: Option<&DirEntry>) {
        if let Some(shared) = &self.shared {
            shared.note(dir, name, entry.map(|e| (e.ino, e.dtype)));
        }
        let key = (dir, name.to_vec());
        let mut names = self.names.lock();
        match entry {
            Some(entry) => {
                if names.len() >= NAME_MEMO_ENTRIES_MAX && !names.contains_key(&key) {
                    names.clear();
                }
                names.insert(key, (entry.ino, entry.dtype));
            }
            None => {
                names.remove(&key);
            }
        }
    }

    /// Notes every entry of a directory just listed.
    pub fn note_all(&self, dir: u64, entries: &[DirEntry]) {
        if let Some(shared) = &self.shared {
            for entry in entries.iter().take(NAME_MEMO_ENTRIES_MAX) {
                shared.note(dir, &entry.name, Some((entry.ino, entry.dtype)));
            }
        }
        let mut names = self.names.lock();
        if names.len() + entries.len() > NAME_MEMO_ENTRIES_MAX {
            names.clear();
        }
        for entry in entries.iter().take(NAME_MEMO_ENTRIES_MAX) {
            names.insert((dir, entry.name.clone()), (entry.ino, entry.dtype));
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.names.lock().len()
    }
}

/// A table of names in a file shared by the processes of a host that use one file system
/// (one per user: the preload puts it beside its lock files), mapped by each: a new process
/// (a shell's next command) predicts its first walks from what the others saw, instead of
/// walking one component at a time.
///
/// Slots are written without locks, by any number of processes at once: a reader may see a
/// slot half rewritten, or another name whose hash took the slot. Either is a wrong
/// prediction, which a walk detects like any other (module documentation): the table holds
/// hints, never answers, and its contents cannot make a walk return anything else. A slot
/// is `[hash of (directory, name), inode, type]`, the hash never 0 (0: an empty slot).
#[derive(Debug)]
pub struct SharedNames {
    words: MappedWords,
    slots: usize,
}

impl SharedNames {
    /// Maps the table at `path`, making it (mode 0600) or growing it to `slots` slots first.
    pub fn open(path: &Path, slots: usize) -> std::io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        if let Some(dir) = path.parent().filter(|d| !d.exists()) {
            // Shared by the host's users, as the preload's lock directory it is (sticky).
            let _ = std::fs::DirBuilder::new().recursive(true).mode(0o1777).create(dir);
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).custom_flags(libc::O_CLOEXEC).open(path)?;
        let len_bytes = slots * SHARED_NAMES_WORDS_PER_SLOT * 8;
        if file.metadata()?.len() < len_bytes as u64 {
            file.set_len(len_bytes as u64)?;
        }
        Ok(Self { words: MappedWords::map(&file, slots * SHARED_NAMES_WORDS_PER_SLOT, true)?, slots })
    }

    fn hash(dir: u64, name: &[u8]) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(name, dir) | 1
    }

    /// The three words of slot `at`.
    fn slot(&self, at: usize) -> &[AtomicU64] {
        self.words.words(at * SHARED_NAMES_WORDS_PER_SLOT, SHARED_NAMES_WORDS_PER_SLOT)
    }

    fn get(&self, dir: u64, name: &[u8]) -> Option<(u64, u8)> {
        let hash = Self::hash(dir, name);
        for probe in 0..SHARED_NAMES_PROBES {
            let slot = self.slot((hash as usize).wrapping_add(probe) % self.slots);
            if slot[0].load(Ordering::Acquire) == hash {
                return Some((slot[1].load(Ordering::Relaxed), slot[2].load(Ordering::Relaxed) as u8));
            }
        }
        None
    }

    /// Notes `name` in `dir` (`None`: absent, its slot emptied).
    fn note(&self, dir: u64, name: &[u8], entry: Option<(u64, u8)>) {
        let hash = Self::hash(dir, name);
        let home = hash as usize;
        let mut free = None;
        for probe in 0..SHARED_NAMES_PROBES {
            let at = home.wrapping_add(probe) % self.slots;
            match self.slot(at)[0].load(Ordering::Relaxed) {
                h if h == hash => {
                    free = Some(at);
                    break;
                }
                0 if free.is_none() => free = Some(at),
                _ => {}
            }
        }
        let slot = self.slot(free.unwrap_or(home % self.slots));
        match entry {
            Some((ino, dtype)) => {
                if slot[0].load(Ordering::Relaxed) == hash && slot[1].load(Ordering::Relaxed) == ino && slot[2].load(Ordering::Relaxed) == u64::from(dtype) {
                    return;
                }
                slot[0].store(0, Ordering::Relaxed);
                slot[1].store(ino, Ordering::Relaxed);
                slot[2].store(u64::from(dtype), Ordering::Relaxed);
                slot[0].store(hash, Ordering::Release);
            }
            None => {
                let _ = slot[0].compare_exchange(hash, 0, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
    }
}

/// Records one walk read ahead, in the order they were read.
#[derive(Debug, Default)]
pub(crate) struct ReadAhead {
    records: VecDeque<(Vec<u8>, Versioned)>,
}

impl ReadAhead {
    /// The record of `key` if it is the next one read ahead. Otherwise every record read
    /// ahead is dropped: each was read before the record the walk needs now would be, and
    /// using it after that read would reorder the walk's reads.
    pub fn take(&mut self, key: &[u8]) -> Option<Versioned> {
        match self.records.front() {
            Some((next, _)) if next.as_slice() == key => self.records.pop_front().map(|(_, record)| record),
            _ => {
                self.records.clear();
                None
            }
        }
    }

    /// Holds `records`, read in the order of `keys`, for [`ReadAhead::take`].
    pub fn load(&mut self, keys: Vec<Vec<u8>>, records: Vec<Versioned>) {
        self.records = keys.into_iter().zip(records).collect();
    }

    /// Drops every record read ahead (the walk read something else in between).
    pub fn clear(&mut self) {
        self.records.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &[u8], ino: u64) -> DirEntry {
        DirEntry { name: name.to_vec(), ino, dtype: libc::DT_DIR }
    }

    #[test]
    fn records_are_taken_only_in_the_order_read() {
        let mut ahead = ReadAhead::default();
        ahead.load(vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()], vec![Some((b"1".to_vec(), 1)), None, Some((b"3".to_vec(), 3))]);
        assert_eq!(ahead.take(b"a"), Some(Some((b"1".to_vec(), 1))));
        // Skipping "b" drops "c" too: it was read before whatever is read next.
        assert_eq!(ahead.take(b"c"), None);
        assert_eq!(ahead.take(b"c"), None);
        ahead.load(vec![b"a".to_vec(), b"b".to_vec()], vec![None, None]);
        assert_eq!(ahead.take(b"a"), Some(None));
        ahead.clear();
        assert_eq!(ahead.take(b"b"), None);
    }

    #[test]
    fn the_shared_table_is_seen_by_other_mappings_and_survives_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("names");
        let a = NameMemo::with_shared(Some(&path));
        let b = NameMemo::with_shared(Some(&path));
        a.note(1, b"x", Some(&entry(b"x", 7)));
        assert_eq!(b.get(1, b"x"), Some((7, libc::DT_DIR)), "another mapping sees the name");
        a.note(1, b"x", None);
        assert_eq!(b.get(1, b"x"), None);
        // More names than slots: older ones make room, lookups stay within their probes.
        let small = SharedNames::open(&dir.path().join("small"), 8).unwrap();
        for i in 0..100u64 {
            small.note(i, b"n", Some((i, libc::DT_REG)));
        }
        assert_eq!(small.get(99, b"n"), Some((99, libc::DT_REG)));
        // A table full of garbage gives wrong hints, never a crash.
        std::fs::write(dir.path().join("junk"), vec![0xffu8; 8 * 3 * 8]).unwrap();
        let junk = SharedNames::open(&dir.path().join("junk"), 8).unwrap();
        assert_eq!(junk.get(1, b"x"), None);
        junk.note(1, b"x", Some((5, libc::DT_DIR)));
        assert_eq!(junk.get(1, b"x"), Some((5, libc::DT_DIR)));
    }

    #[test]
    fn the_memo_is_bounded_and_forgets_removed_names() {
        let memo = NameMemo::default();
        memo.note(1, b"x", Some(&entry(b"x", 7)));
        assert_eq!(memo.get(1, b"x"), Some((7, libc::DT_DIR)));
        memo.note(1, b"x", None);
        assert_eq!(memo.get(1, b"x"), None);
        for i in 0..(NAME_MEMO_ENTRIES_MAX as u64 + 10) {
            memo.note(2, format!("n{i}").as_bytes(), Some(&entry(b"", i)));
            assert!(memo.len() <= NAME_MEMO_ENTRIES_MAX);
        }
        let many: Vec<DirEntry> = (0..NAME_MEMO_ENTRIES_MAX as u64 + 5).map(|i| entry(format!("m{i}").as_bytes(), i)).collect();
        memo.note_all(3, &many);
        assert!(memo.len() <= NAME_MEMO_ENTRIES_MAX);
    }
}
