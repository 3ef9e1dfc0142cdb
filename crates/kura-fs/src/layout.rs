//! The file system's layout in the pool, in one place: every key and every record.
//!
//! ```text
//! kfs/<fs>/sb                      superblock: magic, format version, chunk size
//! kfs/<fs>/next                    the next unallocated inode number (processes take ranges by CAS)
//! kfs/<fs>/i/<ino:x>               inode: mode, nlink, uid, gid, size, times, parent, generation, symlink
//!                                  target, and the processes that have the file open (openers)
//! kfs/<fs>/orphans                 inodes unlinked while other processes had them open (deleted at
//!                                  their last close, or when they are found dead)
//! kfs/<fs>/d/<ino:x>/<bucket:x>    one of a directory's DIR_BUCKETS hash buckets of entries (name, ino, type)
//! kfs/<fs>/c/<ino:x>/<index:x>     chunk `index` of a file's data (chunk_size bytes; shorter at EOF; absent = zeros)
//! ```
//!
//! Keys are ASCII (safe on every backend, memcached's text protocol included). Records are
//! little-endian with fixed-width fields and a magic byte; the pool's backends checksum values.
//! Every metadata record is changed only by compare-and-swap on its version, so concurrent
//! processes never lose each other's updates.

use crate::error::{FsError, Result};

/// Chunk size of a new file system when none is given.
pub const CHUNK_SIZE_BYTES_DEFAULT: u32 = 4096;
/// Chunks are between these sizes (a chunk is one pool value).
pub const CHUNK_SIZE_BYTES_MIN: u32 = 512;
pub const CHUNK_SIZE_BYTES_MAX: u32 = 512 << 10;
/// Hash buckets per directory: a lookup reads one, a listing reads all (in one batch).
pub const DIR_BUCKETS: u32 = 16;
/// POSIX NAME_MAX.
pub const NAME_BYTES_MAX: usize = 255;
/// Longest symbolic link target (PATH_MAX).
pub const SYMLINK_BYTES_MAX: usize = 4095;
/// Largest file: chunk indexes stay well inside u64 and sizes inside i64 (off_t).
pub const FILE_SIZE_BYTES_MAX: u64 = 1 << 50;
/// Longest file system name (it is part of every key).
pub const FS_NAME_BYTES_MAX: usize = 64;
/// Inode numbers a process takes from `next` at once.
pub const INO_BATCH: u64 = 1024;
/// The root directory's inode number.
pub const ROOT_INO: u64 = 1;
/// Hard links to one inode, at most.
pub const NLINK_MAX: u32 = 65_000;
/// Processes recorded as having one file open, at most (a process past it still opens the
/// file, but another process's unlink no longer waits for its close).
pub const OPENERS_MAX: usize = 256;
/// Inodes on the orphan list, at most (past it an unlinked file that other processes have
/// open still waits for their last close, but leaks if the last of them dies first).
pub const ORPHANS_MAX: usize = 4096;

/// Longest extended attribute name, namespace prefix included (Linux's `XATTR_NAME_MAX`).
pub const XATTR_NAME_BYTES_MAX: usize = 255;
/// Largest extended attribute value (Linux's `XATTR_SIZE_MAX`: `E2BIG` past it).
pub const XATTR_VALUE_BYTES_MAX: usize = 64 << 10;
/// Names and values of one inode's extended attributes together, at most (`ENOSPC` past it,
/// as XFS's limit): they live in the inode record, which every lookup and `stat` reads.
pub const XATTRS_BYTES_MAX: usize = 64 << 10;

const SUPERBLOCK_MAGIC: u32 = 0x6b75_7246; // "Fruk"
const FORMAT_VERSION: u32 = 1;
const INODE_MAGIC: u8 = 0xa1;
const BUCKET_MAGIC: u8 = 0xb2;
const ORPHANS_MAGIC: u8 = 0xc3;
/// Bytes of one encoded opener.
const OPENER_BYTES: usize = 8 + 8 + 4 + 8 + 4;
/// Fixed part of an encoded inode.
const INODE_FIXED_BYTES: usize = 1 + 4 * 5 + 8 * 7 + 2;
const _: () = assert!(INODE_FIXED_BYTES == 79);
const _: () = assert!(CHUNK_SIZE_BYTES_DEFAULT >= CHUNK_SIZE_BYTES_MIN && CHUNK_SIZE_BYTES_DEFAULT <= CHUNK_SIZE_BYTES_MAX);
const _: () = assert!(DIR_BUCKETS.is_power_of_two());

/// Builds the keys of one file system.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(fs_name: &str) -> Result<Self> {
        let ok = !fs_name.is_empty()
            && fs_name.len() <= FS_NAME_BYTES_MAX
            && fs_name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok {
            return Err(FsError::Invalid);
        }
        Ok(Self { prefix: format!("kfs/{fs_name}/") })
    }

    pub fn superblock(&self) -> Vec<u8> {
        format!("{}sb", self.prefix).into_bytes()
    }

    pub fn next_ino(&self) -> Vec<u8> {
        format!("{}next", self.prefix).into_bytes()
    }

    pub fn inode(&self, ino: u64) -> Vec<u8> {
        format!("{}i/{ino:x}", self.prefix).into_bytes()
    }

    pub fn bucket(&self, dir: u64, bucket: u32) -> Vec<u8> {
        format!("{}d/{dir:x}/{bucket:x}", self.prefix).into_bytes()
    }

    pub fn chunk(&self, ino: u64, index: u64) -> Vec<u8> {
        format!("{}c/{ino:x}/{index:x}", self.prefix).into_bytes()
    }

    pub fn orphans(&self) -> Vec<u8> {
        format!("{}orphans", self.prefix).into_bytes()
    }
}

/// A process (one file system instance in it) that has a file open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opener {
    /// Hash of the host's machine id (processes elsewhere cannot be checked for life).
    pub machine: u64,
    /// Hash of the host's boot id: a process of an earlier boot is dead.
    pub boot: u64,
    pub pid: u32,
    /// The process's start time (clock ticks since boot): tells a reused pid apart.
    pub start_ticks: u64,
    /// Tells apart file system instances of one process.
    pub instance: u32,
}

impl Opener {
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.machine.to_le_bytes());
        out.extend_from_slice(&self.boot.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.start_ticks.to_le_bytes());
        out.extend_from_slice(&self.instance.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Self {
        Self { machine: u64_at(b, 0), boot: u64_at(b, 8), pid: u32_at(b, 16), start_ticks: u64_at(b, 20), instance: u32_at(b, 28) }
    }
}

/// The orphan list: inodes with no name left that other processes still had open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Orphans {
    pub inos: Vec<u64>,
}

impl Orphans {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + 8 * self.inos.len());
        out.push(ORPHANS_MAGIC);
        out.extend_from_slice(&(self.inos.len() as u32).to_le_bytes());
        for ino in &self.inos {
            out.extend_from_slice(&ino.to_le_bytes());
        }
        out
    }

    pub fn decode(key: &[u8], b: &[u8]) -> Result<Self> {
        let corrupt = |why| FsError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), why };
        if b.len() < 5 || b[0] != ORPHANS_MAGIC {
            return Err(corrupt("not an orphan list"));
        }
        let count = u32_at(b, 1) as usize;
        if b.len() != 5 + 8 * count {
            return Err(corrupt("orphan list length does not match its count"));
        }
        Ok(Self { inos: (0..count).map(|i| u64_at(b, 5 + 8 * i)).collect() })
    }
}

/// The bucket of a directory that holds `name`.
pub fn bucket_of(name: &[u8]) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(name) as u32) & (DIR_BUCKETS - 1)
}

/// Checks a single path component.
pub fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Invalid);
    }
    if name.len() > NAME_BYTES_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

/// The superblock: what must agree between every process using the file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub chunk_size_bytes: u32,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(12);
        out.extend_from_slice(&SUPERBLOCK_MAGIC.to_le_bytes());
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&self.chunk_size_bytes.to_le_bytes());
        out
    }

    pub fn decode(key: &[u8], bytes: &[u8]) -> Result<Self> {
        let corrupt = |why| FsError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), why };
        if bytes.len() != 12 || u32_at(bytes, 0) != SUPERBLOCK_MAGIC {
            return Err(corrupt("not a kura file system superblock"));
        }
        if u32_at(bytes, 4) != FORMAT_VERSION {
            return Err(corrupt("unknown format version"));
        }
        let chunk_size_bytes = u32_at(bytes, 8);
        if !(CHUNK_SIZE_BYTES_MIN..=CHUNK_SIZE_BYTES_MAX).contains(&chunk_size_bytes) {
            return Err(corrupt("chunk size out of range"));
        }
        Ok(Self { chunk_size_bytes })
    }
}

/// File type bits of a mode (`S_IFMT`).
pub fn file_type(mode: u32) -> u32 {
    mode & libc::S_IFMT
}

pub fn is_dir(mode: u32) -> bool {
    file_type(mode) == libc::S_IFDIR
}

/// The `d_type` of a directory entry for `mode`.
pub fn dtype_of(mode: u32) -> u8 {
    match file_type(mode) {
        libc::S_IFDIR => libc::DT_DIR,
        libc::S_IFREG => libc::DT_REG,
        libc::S_IFLNK => libc::DT_LNK,
        libc::S_IFIFO => libc::DT_FIFO,
        libc::S_IFSOCK => libc::DT_SOCK,
        libc::S_IFCHR => libc::DT_CHR,
        libc::S_IFBLK => libc::DT_BLK,
        _ => libc::DT_UNKNOWN,
    }
}

/// An inode record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub ino: u64,
    /// Type and permission bits (`st_mode`).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub size: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    /// Directories: the parent directory (for `..`). A regular file made without a name by
    /// `open` with `O_TMPFILE` and without `O_EXCL`: the directory it was made in, until a
    /// link gives it a name (Linux's `I_LINKABLE`: such a file may be linked with no link
    /// left, see [`Inode::linkable_unnamed`]). Others: 0.
    pub parent: u64,
    /// Bumped whenever a process changes the file's data in the pool, so other processes know
    /// their cached pages are stale (close-to-open consistency).
    pub generation: u64,
    /// Symbolic links: the target.
    pub target: Vec<u8>,
    /// The processes that have the file open (at most [`OPENERS_MAX`]), so that an unlink
    /// elsewhere leaves its data until their last close. Encoded after the target, only when
    /// there are any or extended attributes follow (a record with neither is the first
    /// format's).
    pub openers: Vec<Opener>,
    /// Extended attributes, `(name, value)` in the order they were first set (names with their
    /// namespace prefix; see [`XATTRS_BYTES_MAX`]). Encoded after the openers, only when there
    /// are any or holes follow.
    pub xattrs: Vec<Xattr>,
    /// Regular files: chunks known to be holes, for `st_blocks` (see [`crate::holes`]; at most
    /// [`crate::holes::HOLE_RANGES_MAX`] ranges). Encoded after the extended attributes, only
    /// when there are any.
    pub holes: Vec<crate::holes::ChunkRange>,
}

/// One extended attribute: `(name, value)`.
pub type Xattr = (Vec<u8>, Vec<u8>);

impl Inode {
    pub fn new(ino: u64, mode: u32, uid: u32, gid: u32, now_ns: i64) -> Self {
        Self {
            ino,
            mode,
            nlink: if is_dir(mode) { 2 } else { 1 },
            uid,
            gid,
            rdev: 0,
            size: 0,
            atime_ns: now_ns,
            mtime_ns: now_ns,
            ctime_ns: now_ns,
            parent: 0,
            generation: 0,
            target: Vec::new(),
            openers: Vec::new(),
            xattrs: Vec::new(),
            holes: Vec::new(),
        }
    }

    /// Whether a link may give this file a name although it has none: it was made by `open`
    /// with `O_TMPFILE` without `O_EXCL` and never linked since (see [`Inode::parent`]).
    pub fn linkable_unnamed(&self) -> bool {
        self.nlink == 0 && file_type(self.mode) == libc::S_IFREG && self.parent != 0
    }

    /// `st_size`: a directory shows one chunk, as ext4 shows a directory of a few entries one
    /// block (its record has no size of its own); anything else its size.
    pub fn size_bytes(&self, chunk_bytes: u64) -> u64 {
        if is_dir(self.mode) { self.size.max(chunk_bytes) } else { self.size }
    }

    /// `st_blocks`: 512-byte units of the file that are not known holes (see
    /// [`crate::holes::allocated_blocks`]); a directory's [`Inode::size_bytes`]; none for a
    /// symbolic link, whose target is in its record (as ext4's short links are in the inode).
    pub fn blocks(&self, chunk_bytes: u64) -> u64 {
        match file_type(self.mode) {
            libc::S_IFDIR => return self.size_bytes(chunk_bytes).div_ceil(512),
            libc::S_IFLNK => return 0,
            _ => {}
        }
        crate::holes::allocated_blocks(&self.holes, chunk_bytes, self.size)
    }

    /// Bytes of names and values of the extended attributes (counted against
    /// [`XATTRS_BYTES_MAX`]).
    pub fn xattr_bytes(&self) -> usize {
        self.xattrs.iter().map(|(n, v)| n.len() + v.len()).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        assert!(self.target.len() <= SYMLINK_BYTES_MAX, "symlink target checked at entry");
        assert!(self.openers.len() <= OPENERS_MAX, "openers bounded where they are added");
        let mut out = Vec::with_capacity(INODE_FIXED_BYTES + self.target.len() + 2 + OPENER_BYTES * self.openers.len());
        out.push(INODE_MAGIC);
        for v in [self.mode, self.nlink, self.uid, self.gid, self.rdev] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.size, self.atime_ns as u64, self.mtime_ns as u64, self.ctime_ns as u64, self.parent, self.generation, self.ino] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.target.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.target);
        let holes = !self.holes.is_empty();
        if !self.openers.is_empty() || !self.xattrs.is_empty() || holes {
            out.extend_from_slice(&(self.openers.len() as u16).to_le_bytes());
            for opener in &self.openers {
                opener.encode_into(&mut out);
            }
        }
        if !self.xattrs.is_empty() || holes {
            assert!(self.xattrs.len() <= usize::from(u16::MAX) && self.xattr_bytes() <= XATTRS_BYTES_MAX, "xattrs bounded where they are set");
            out.extend_from_slice(&(self.xattrs.len() as u16).to_le_bytes());
            for (name, value) in &self.xattrs {
                assert!(!name.is_empty() && name.len() <= XATTR_NAME_BYTES_MAX && value.len() <= XATTR_VALUE_BYTES_MAX, "xattr checked where it is set");
                out.push(name.len() as u8);
                out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                out.extend_from_slice(name);
                out.extend_from_slice(value);
            }
        }
        if holes {
            assert!(self.holes.len() <= crate::holes::HOLE_RANGES_MAX && crate::holes::is_valid(&self.holes), "holes bounded where they change");
            out.extend_from_slice(&(self.holes.len() as u16).to_le_bytes());
            for &(start, end) in &self.holes {
                out.extend_from_slice(&start.to_le_bytes());
                out.extend_from_slice(&end.to_le_bytes());
            }
        }
        debug_assert_eq!(Inode::decode(b"", &out).as_ref(), Ok(self));
        out
    }

    pub fn decode(key: &[u8], b: &[u8]) -> Result<Self> {
        let corrupt = |why| FsError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), why };
        if b.len() < INODE_FIXED_BYTES || b[0] != INODE_MAGIC {
            return Err(corrupt("not an inode"));
        }
        let target_len = u16::from_le_bytes([b[INODE_FIXED_BYTES - 2], b[INODE_FIXED_BYTES - 1]]) as usize;
        let openers_at = INODE_FIXED_BYTES + target_len;
        let (openers, xattrs, holes) = match b.len().checked_sub(openers_at) {
            Some(0) => (Vec::new(), Vec::new(), Vec::new()),
            Some(rest) if rest >= 2 => {
                let count = u16::from_le_bytes([b[openers_at], b[openers_at + 1]]) as usize;
                let xattrs_at = openers_at + 2 + OPENER_BYTES * count;
                // No openers is written only in front of extended attributes.
                if count > OPENERS_MAX || xattrs_at > b.len() || (count == 0 && xattrs_at == b.len()) {
                    return Err(corrupt("inode length does not match its openers"));
                }
                let openers = (0..count).map(|i| Opener::decode(&b[openers_at + 2 + OPENER_BYTES * i..])).collect();
                let (xattrs, holes) = if xattrs_at == b.len() { (Vec::new(), Vec::new()) } else { decode_xattrs_and_holes(&b[xattrs_at..]).map_err(corrupt)? };
                (openers, xattrs, holes)
            }
            _ => return Err(corrupt("inode length does not match its symlink target")),
        };
        let w = |i: usize| u32_at(b, 1 + 4 * i);
        let q = |i: usize| u64_at(b, 21 + 8 * i);
        Ok(Self {
            mode: w(0),
            nlink: w(1),
            uid: w(2),
            gid: w(3),
            rdev: w(4),
            size: q(0),
            atime_ns: q(1) as i64,
            mtime_ns: q(2) as i64,
            ctime_ns: q(3) as i64,
            parent: q(4),
            generation: q(5),
            ino: q(6),
            target: b[INODE_FIXED_BYTES..openers_at].to_vec(),
            openers,
            xattrs,
            holes,
        })
    }
}

/// The sections after the openers: extended attributes (a count of 0 only when holes
/// follow), then, if anything is left, the holes: a count (at least one), then each range's
/// first and end chunk (u64 each); nothing after the last.
fn decode_xattrs_and_holes(b: &[u8]) -> std::result::Result<(Vec<Xattr>, Vec<crate::holes::ChunkRange>), &'static str> {
    let (xattrs, at) = decode_xattrs(b)?;
    if at == b.len() {
        if xattrs.is_empty() {
            return Err("an empty extended attributes section");
        }
        return Ok((xattrs, Vec::new()));
    }
    let rest = &b[at..];
    const TRUNCATED: &str = "inode length does not match its holes";
    if rest.len() < 2 {
        return Err(TRUNCATED);
    }
    let count = u16::from_le_bytes([rest[0], rest[1]]) as usize;
    if count == 0 || count > crate::holes::HOLE_RANGES_MAX {
        return Err("a holes section out of bounds");
    }
    if rest.len() != 2 + 16 * count {
        return Err(TRUNCATED);
    }
    let holes: Vec<_> = (0..count).map(|i| (u64_at(rest, 2 + 16 * i), u64_at(rest, 10 + 16 * i))).collect();
    if !crate::holes::is_valid(&holes) {
        return Err("holes out of order");
    }
    Ok((xattrs, holes))
}

/// An inode's extended attributes section: a count, then each attribute's name length (u8),
/// value length (u32), name and value; and where the section ends.
fn decode_xattrs(b: &[u8]) -> std::result::Result<(Vec<Xattr>, usize), &'static str> {
    const TRUNCATED: &str = "inode length does not match its extended attributes";
    if b.len() < 2 {
        return Err(TRUNCATED);
    }
    let count = u16::from_le_bytes([b[0], b[1]]) as usize;
    let mut xattrs = Vec::with_capacity(count.min(b.len() / 6));
    let mut at = 2;
    let mut total = 0usize;
    for _ in 0..count {
        let header = b.get(at..at + 5).ok_or(TRUNCATED)?;
        let name_len = usize::from(header[0]);
        let value_len = u32_at(header, 1) as usize;
        if name_len == 0 || value_len > XATTR_VALUE_BYTES_MAX {
            return Err("an extended attribute out of bounds");
        }
        total += name_len + value_len;
        if total > XATTRS_BYTES_MAX {
            return Err("extended attributes over their bound");
        }
        let name = b.get(at + 5..at + 5 + name_len).ok_or(TRUNCATED)?;
        let value = b.get(at + 5 + name_len..at + 5 + name_len + value_len).ok_or(TRUNCATED)?;
        xattrs.push((name.to_vec(), value.to_vec()));
        at += 5 + name_len + value_len;
    }
    Ok((xattrs, at))
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    pub dtype: u8,
}

/// The entries of one directory bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bucket {
    pub entries: Vec<DirEntry>,
}

impl Bucket {
    pub fn find(&self, name: &[u8]) -> Option<&DirEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Removes `name`, returning its entry.
    pub fn remove(&mut self, name: &[u8]) -> Option<DirEntry> {
        let i = self.entries.iter().position(|e| e.name == name)?;
        Some(self.entries.swap_remove(i))
    }

    /// Adds or replaces `entry`, returning what it replaced.
    pub fn upsert(&mut self, entry: DirEntry) -> Option<DirEntry> {
        match self.entries.iter_mut().find(|e| e.name == entry.name) {
            Some(slot) => Some(std::mem::replace(slot, entry)),
            None => {
                self.entries.push(entry);
                None
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.entries.iter().map(|e| e.name.len() + 11).sum::<usize>());
        out.push(BUCKET_MAGIC);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            assert!(e.name.len() <= NAME_BYTES_MAX, "names are checked at entry");
            out.push(e.name.len() as u8);
            out.extend_from_slice(&e.name);
            out.extend_from_slice(&e.ino.to_le_bytes());
            out.push(e.dtype);
        }
        out
    }

    pub fn decode(key: &[u8], b: &[u8]) -> Result<Self> {
        let corrupt = |why| FsError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), why };
        if b.len() < 5 || b[0] != BUCKET_MAGIC {
            return Err(corrupt("not a directory bucket"));
        }
        let count = u32_at(b, 1) as usize;
        let mut entries = Vec::with_capacity(count.min(b.len() / 10));
        let mut at = 5;
        for _ in 0..count {
            let len = *b.get(at).ok_or_else(|| corrupt("truncated bucket"))? as usize;
            let end = at + 1 + len + 9;
            if end > b.len() {
                return Err(corrupt("truncated bucket"));
            }
            let name = b[at + 1..at + 1 + len].to_vec();
            let ino = u64_at(b, at + 1 + len);
            entries.push(DirEntry { name, ino, dtype: b[end - 1] });
            at = end;
        }
        if at != b.len() {
            return Err(corrupt("trailing bytes in bucket"));
        }
        Ok(Self { entries })
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_round_trips() {
        let mut inode = Inode::new(77, libc::S_IFLNK | 0o777, 1000, 100, 1_700_000_000_123_456_789);
        inode.target = b"../x/y".to_vec();
        inode.size = 6;
        inode.generation = 9;
        let bytes = inode.encode();
        assert_eq!(Inode::decode(b"k", &bytes).unwrap(), inode);
        assert!(Inode::decode(b"k", &bytes[..bytes.len() - 1]).is_err());
        assert!(Inode::decode(b"k", b"").is_err());
        inode.openers = vec![Opener { machine: 1, boot: 2, pid: 3, start_ticks: 4, instance: 5 }, Opener { machine: 6, boot: 7, pid: 8, start_ticks: 9, instance: 10 }];
        let bytes = inode.encode();
        assert_eq!(Inode::decode(b"k", &bytes).unwrap(), inode);
        for cut in INODE_FIXED_BYTES + inode.target.len() + 1..bytes.len() {
            assert!(Inode::decode(b"k", &bytes[..cut]).is_err(), "cut at {cut}");
        }
        // Extended attributes, with openers and without.
        inode.xattrs = vec![(b"user.a".to_vec(), b"1".to_vec()), (b"trusted.empty".to_vec(), Vec::new()), (b"user.big".to_vec(), vec![7; 5000])];
        for openers in [inode.openers.clone(), Vec::new()] {
            inode.openers = openers;
            let bytes = inode.encode();
            assert_eq!(Inode::decode(b"k", &bytes).unwrap(), inode);
            // Cut just before the attributes, a record is the same inode without them (the
            // pool returns whole values, checked, so a cut is only ever a bug of ours).
            let xattrs_at = INODE_FIXED_BYTES + inode.target.len() + 2 + OPENER_BYTES * inode.openers.len();
            for cut in (INODE_FIXED_BYTES + inode.target.len() + 1..bytes.len()).filter(|&c| c != xattrs_at || inode.openers.is_empty()) {
                assert!(Inode::decode(b"k", &bytes[..cut]).is_err(), "cut at {cut}");
            }
        }
        // Holes, with and without openers and extended attributes before them.
        inode.mode = libc::S_IFREG | 0o644;
        inode.target.clear();
        inode.holes = vec![(0, 3), (5, 1 << 40)];
        for (openers, xattrs) in [(true, true), (false, true), (true, false), (false, false)] {
            let mut with = inode.clone();
            if !openers {
                with.openers.clear();
            }
            if !xattrs {
                with.xattrs.clear();
            }
            let bytes = with.encode();
            assert_eq!(Inode::decode(b"k", &bytes).unwrap(), with);
            for cut in INODE_FIXED_BYTES + 1..bytes.len() {
                assert!(Inode::decode(b"k", &bytes[..cut]).map_or(true, |i| i.holes.is_empty()), "cut at {cut} kept the holes");
            }
        }
        // Holes out of order, or an empty holes section, are refused.
        let mut bad = Inode::new(5, libc::S_IFREG | 0o644, 0, 0, 1).encode();
        bad.extend_from_slice(&0u16.to_le_bytes());
        bad.extend_from_slice(&0u16.to_le_bytes());
        let mut unordered = bad.clone();
        unordered.extend_from_slice(&1u16.to_le_bytes());
        unordered.extend_from_slice(&4u64.to_le_bytes());
        unordered.extend_from_slice(&4u64.to_le_bytes());
        assert!(Inode::decode(b"k", &unordered).is_err());
        bad.extend_from_slice(&0u16.to_le_bytes());
        assert!(Inode::decode(b"k", &bad).is_err());
        // An openers count of zero with nothing after it is not a record kura writes.
        let mut bare = Inode::new(5, libc::S_IFREG | 0o644, 0, 0, 1).encode();
        bare.extend_from_slice(&0u16.to_le_bytes());
        assert!(Inode::decode(b"k", &bare).is_err());
    }

    proptest::proptest! {
        /// Any inode with openers and extended attributes comes back as it was; any bytes, and
        /// any encoding with a byte changed, decode to an inode or an error, never a panic.
        #[test]
        fn inodes_round_trip_and_garbage_never_panics(
            openers in proptest::collection::vec((proptest::num::u64::ANY, proptest::num::u32::ANY), 0..4),
            xattrs in proptest::collection::vec((proptest::collection::vec(1u8..=255, 1..40), proptest::collection::vec(proptest::num::u8::ANY, 0..300)), 0..6),
            holes in proptest::collection::vec((0u64..1000, 1u64..50), 0..8),
            garbage in proptest::collection::vec(proptest::num::u8::ANY, 0..400),
            flip in (proptest::num::usize::ANY, 1u8..=255),
        ) {
            let mut inode = Inode::new(3, libc::S_IFREG | 0o600, 1, 2, 3);
            inode.openers = openers.iter().map(|&(machine, pid)| Opener { machine, boot: 1, pid, start_ticks: 2, instance: 3 }).collect();
            inode.xattrs = xattrs;
            for (start, len) in holes {
                crate::holes::add(&mut inode.holes, (start, start + len));
            }
            let bytes = inode.encode();
            proptest::prop_assert_eq!(Inode::decode(b"k", &bytes).unwrap(), inode);
            let _ = Inode::decode(b"k", &garbage);
            let mut changed = bytes.clone();
            let at = flip.0 % changed.len();
            changed[at] ^= flip.1;
            let _ = Inode::decode(b"k", &changed);
        }
    }

    #[test]
    fn only_unnamed_o_tmpfile_files_are_linkable() {
        let mut file = Inode::new(5, libc::S_IFREG | 0o600, 0, 0, 1);
        assert!(!file.linkable_unnamed(), "a file with a name");
        file.nlink = 0;
        assert!(!file.linkable_unnamed(), "a file unlinked while open");
        file.parent = ROOT_INO;
        assert!(file.linkable_unnamed(), "an O_TMPFILE file made without O_EXCL");
        assert_eq!(Inode::decode(b"k", &file.encode()).unwrap(), file, "kept in the record");
        file.nlink = 1;
        assert!(!file.linkable_unnamed(), "named already");
        let mut dir = Inode::new(6, libc::S_IFDIR | 0o755, 0, 0, 1);
        dir.nlink = 0;
        dir.parent = ROOT_INO;
        assert!(!dir.linkable_unnamed(), "a removed directory");
    }

    #[test]
    fn orphans_round_trip() {
        let list = Orphans { inos: vec![5, 1 << 40, 7] };
        let bytes = list.encode();
        assert_eq!(Orphans::decode(b"k", &bytes).unwrap(), list);
        for cut in 0..bytes.len() {
            assert!(Orphans::decode(b"k", &bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn bucket_round_trips_and_rejects_garbage() {
        let mut b = Bucket::default();
        assert_eq!(b.upsert(DirEntry { name: b"a".to_vec(), ino: 2, dtype: libc::DT_REG }), None);
        b.upsert(DirEntry { name: vec![b'z'; 255], ino: 3, dtype: libc::DT_DIR });
        assert!(b.upsert(DirEntry { name: b"a".to_vec(), ino: 4, dtype: libc::DT_REG }).is_some());
        let bytes = b.encode();
        let back = Bucket::decode(b"k", &bytes).unwrap();
        assert_eq!(back, b);
        assert_eq!(back.find(b"a").unwrap().ino, 4);
        for cut in 0..bytes.len() {
            assert!(Bucket::decode(b"k", &bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn names_and_keys() {
        assert!(check_name(b"ok").is_ok());
        assert_eq!(check_name(&[b'a'; 256]), Err(FsError::NameTooLong));
        assert_eq!(check_name(b"a/b"), Err(FsError::Invalid));
        assert_eq!(check_name(b".."), Err(FsError::Invalid));
        let k = Keys::new("default").unwrap();
        assert_eq!(k.chunk(255, 16), b"kfs/default/c/ff/10");
        assert!(Keys::new("bad name").is_err());
        assert!(bucket_of(b"x") < DIR_BUCKETS);
    }
}
