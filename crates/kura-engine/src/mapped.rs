//! A file of 64-bit words mapped shared (`MAP_SHARED`), for the small tables the processes of
//! a host share through a file: a served store's change counter and log ([`crate::changes`]),
//! and the file system's shared names and copies (`kura_fs::memo`, `kura_fs::copies`). The
//! words are read and written only through atomics; what they mean, and how readers cope
//! with other processes writing them at any moment, is each table's own.

use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicU64;

/// The first `len` words of a file, mapped; unmapped when dropped.
pub struct MappedWords {
    words: *const AtomicU64,
    len: usize,
}

// SAFETY: the mapping lives as long as the value (unmapped in Drop) and is only accessed
// through atomics, so any thread may use it.
unsafe impl Send for MappedWords {}
// SAFETY: as above.
unsafe impl Sync for MappedWords {}

impl std::fmt::Debug for MappedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedWords").field("len", &self.len).finish()
    }
}

impl MappedWords {
    /// Maps the first `len` words of `file`, which must be at least that long; `writable`:
    /// read and write, else read only (then nothing may store into the words: a store
    /// faults).
    pub fn map(file: &std::fs::File, len: usize, writable: bool) -> std::io::Result<Self> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a new shared mapping of `len` words of a file the caller made at least that
        // long; the result is checked before use.
        let map = unsafe { libc::mmap(std::ptr::null_mut(), len * 8, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { words: map.cast::<AtomicU64>().cast_const(), len })
    }

    /// Words `at .. at + count`.
    ///
    /// # Panics
    /// When they are not all inside the mapping.
    pub fn words(&self, at: usize, count: usize) -> &[AtomicU64] {
        assert!(at.checked_add(count).is_some_and(|end| end <= self.len), "words {at}..+{count} of a mapping of {}", self.len);
        // SAFETY: the words are inside the mapping (checked above), which outlives `self`;
        // AtomicU64 has the size and alignment of u64, and the page-aligned mapping keeps
        // every word aligned.
        unsafe { std::slice::from_raw_parts(self.words.add(at), count) }
    }

    /// Word `at`.
    pub fn word(&self, at: usize) -> &AtomicU64 {
        &self.words(at, 1)[0]
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of this length, not used after this.
        unsafe { libc::munmap(self.words.cast_mut().cast(), self.len * 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_of_a_file_share_its_words_and_stay_inside_it() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(4096).unwrap();
        let writer = MappedWords::map(&file, 512, true).unwrap();
        let reader = MappedWords::map(&file, 512, false).unwrap();
        writer.word(511).store(7, Ordering::Release);
        assert_eq!(reader.word(511).load(Ordering::Acquire), 7);
        assert_eq!(reader.words(510, 2).len(), 2);
        assert!(std::panic::catch_unwind(|| reader.words(511, 2).len()).is_err(), "past the end");
        assert!(std::panic::catch_unwind(|| reader.words(usize::MAX, 2).len()).is_err(), "an overflowing range");
    }
}
