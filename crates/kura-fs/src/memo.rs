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

use crate::kv::Versioned;
use crate::layout::DirEntry;
use crate::sync::Mutex;

/// Names remembered for predictions, at most (each costs its name and ~64 bytes; the memo
/// starts over when full).
pub const NAME_MEMO_ENTRIES_MAX: usize = 16_384;
/// Records one walk reads ahead in one batch, at most (a path of ~20 components with the
/// search permission checks and the last inode).
pub const READ_AHEAD_KEYS_MAX: usize = 48;

/// A name in a directory: `(directory inode, name)`.
type DirName = (u64, Vec<u8>);

/// `(directory, name) → (inode, type)` as this process last saw it.
#[derive(Debug, Default)]
pub(crate) struct NameMemo {
    names: Mutex<HashMap<DirName, (u64, u8)>>,
}

impl NameMemo {
    /// The inode and type `name` in `dir` had when this process last looked.
    pub fn get(&self, dir: u64, name: &[u8]) -> Option<(u64, u8)> {
        // A borrowed tuple key cannot be looked up without building one.
        self.names.lock().get(&(dir, name.to_vec())).copied()
    }

    /// Notes what `name` in `dir` is now (`None`: absent).
    pub fn note(&self, dir: u64, name: &[u8], entry: Option<&DirEntry>) {
        let mut names = self.names.lock();
        match entry {
            Some(entry) => {
                if names.len() >= NAME_MEMO_ENTRIES_MAX && !names.contains_key(&(dir, name.to_vec())) {
                    names.clear();
                }
                names.insert((dir, name.to_vec()), (entry.ino, entry.dtype));
            }
            None => {
                names.remove(&(dir, name.to_vec()));
            }
        }
    }

    /// Notes every entry of a directory just listed.
    pub fn note_all(&self, dir: u64, entries: &[DirEntry]) {
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
