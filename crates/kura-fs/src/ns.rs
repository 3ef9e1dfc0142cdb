//! The namespace: inodes and directory entries, every change a compare-and-swap on one record
//! so that processes (and hosts) sharing the pool never corrupt it.
//!
//! Ordering makes every intermediate state safe: a new inode is written before the entry that
//! names it (a crash leaves at worst an unreferenced inode, never an entry without its inode);
//! an entry is removed before its inode's link count drops; `rename` first points the new name
//! at the inode (atomically replacing any target, so the target name never disappears) and then
//! removes the old name.

use std::sync::Arc;
use std::time::Instant;

use crate::Fs;
use crate::bounded::BytesBounded;
use crate::error::{FsError, Result};
use crate::kv::{Cond, Versioned, WriteOp};
use crate::layout::{Bucket, DIR_BUCKETS, DirEntry, Inode, NLINK_MAX, ROOT_INO, SYMLINK_BYTES_MAX, bucket_of, check_name, dtype_of, file_type, is_dir};

/// CAS retries of one record before the operation gives up with `EIO` (contention this high
/// means something is wrong).
const CAS_RETRIES_MAX: u32 = 10_000;
/// Inode records a process remembers as it last read or wrote them, at most (for the first
/// try of its next compare-and-swap on them).
pub(crate) const RECENT_INODES_MAX: usize = 1024;
/// `fstat` of a file this process has open answers from the record as this process read or
/// wrote it at most this long ago, without a pool round trip: the open that just recorded the
/// process in the file (or the lookup before it) followed by the program's `fstat`, which
/// nearly every program does. Another process's change in that window cannot be told from one
/// made just after the `fstat` (NFS caches attributes for 3 s or more).
pub const ATTR_FRESH_US: u64 = 1000;
/// Bytes of directory buckets a process remembers as it last read or wrote them, at most (all
/// are dropped when more would be kept). A bucket read by the path walk just before a change
/// (a create, an unlink, a rename) is checked from that copy and changed by one
/// compare-and-swap from it; a process adding file after file to a directory changes the
/// bucket from the copy its last swap left. A stale copy only fails the swap.
pub(crate) const RECENT_BUCKETS_BYTES_MAX: usize = 1 << 20;
/// Zeros one `fallocate` step writes at a time.
const FALLOCATE_STEP_BYTES: usize = 128 << 10;
/// Times `rename` starts over when its target changed between its checks and its CAS.
const RENAME_RETRIES_MAX: u32 = 1000;
const RENAME_RACE: &str = "rename target changed concurrently";
/// Directory levels `rename` walks up to refuse moving a directory into itself.
const DEPTH_MAX: usize = 4096;

/// Directory buckets as this process last read or wrote them (see [`RECENT_BUCKETS_BYTES_MAX`]).
#[derive(Debug, Default)]
pub(crate) struct RecentBuckets {
    /// (directory, bucket) → the record (`None`: absent) and when it was read or written.
    map: BytesBounded<(u64, u32), (Versioned, Instant), RECENT_BUCKETS_BYTES_MAX>,
}

impl RecentBuckets {
    fn put(&mut self, key: (u64, u32), record: Versioned) {
        let charge = 64 + record.as_ref().map_or(0, |(bytes, _)| bytes.len());
        self.map.insert(key, (record, Instant::now()), charge);
    }

    fn take(&mut self, key: (u64, u32)) -> Option<Versioned> {
        self.map.remove(&key).map(|(record, _)| record)
    }

    fn fresh(&self, key: (u64, u32)) -> Option<Versioned> {
        self.map.get(&key).filter(|(_, at)| is_fresh(*at)).map(|(record, _)| record.clone())
    }

    pub(crate) fn forget_dir(&mut self, dir: u64) {
        for b in 0..DIR_BUCKETS {
            self.take((dir, b));
        }
    }
}

/// A directory's record after its entries changed: times now, link count moved by
/// `nlink_delta`.
fn set_dir_changed(dir: &mut Inode, now: i64, nlink_delta: i32) {
    dir.mtime_ns = now;
    dir.ctime_ns = now;
    dir.nlink = dir.nlink.saturating_add_signed(nlink_delta);
}

/// `NotDir` unless `inode` is a directory, `NotFound` when it was removed (no link left).
fn live_dir(inode: &Inode) -> Result<()> {
    if !is_dir(inode.mode) {
        return Err(FsError::NotDir);
    }
    if inode.nlink == 0 {
        return Err(FsError::NotFound);
    }
    Ok(())
}

/// Whether a record this process read or wrote at `at` is younger than [`ATTR_FRESH_US`].
fn is_fresh(at: Instant) -> bool {
    at.elapsed().as_micros() < u128::from(ATTR_FRESH_US)
}

/// Attribute changes (`chmod`, `chown`, `truncate`, `utimensat`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SetAttr {
    /// Permission bits (the type bits are kept).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime_ns: Option<i64>,
    pub mtime_ns: Option<i64>,
}

/// Who creates a file.
#[derive(Debug, Clone, Copy)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Who asks, for the permission checks of callers that the kernel does not check for us (the
/// preload; through FUSE the kernel checks, `default_permissions`). The rules are Linux's
/// (`generic_permission`, `may_delete`, `setattr_prepare`), without capabilities beyond root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cred {
    /// Effective user and group ids.
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

/// Access bits asked of [`Cred::check_access`] (as `R_OK`, `W_OK`, `X_OK`).
pub const MAY_READ: u32 = 4;
pub const MAY_WRITE: u32 = 2;
pub const MAY_EXEC: u32 = 1;

impl Cred {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    /// May this caller read, write or execute/search (`mask`, of `MAY_*`) `inode`? `EACCES`.
    /// Root may do anything but execute a file without any execute bit.
    pub fn check_access(&self, inode: &Inode, mask: u32) -> Result<()> {
        debug_assert_eq!(mask & !7, 0, "mask is MAY_* bits");
        if self.is_root() {
            let exec_denied = mask & MAY_EXEC != 0 && !is_dir(inode.mode) && inode.mode & 0o111 == 0;
            return if exec_denied { Err(FsError::Access) } else { Ok(()) };
        }
        let shift = if self.uid == inode.uid {
            6
        } else if self.in_group(inode.gid) {
            3
        } else {
            0
        };
        if (inode.mode >> shift) & mask == mask { Ok(()) } else { Err(FsError::Access) }
    }

    /// May this caller add an entry to directory `dir`? Write and search on it.
    pub fn check_create(&self, dir: &Inode) -> Result<()> {
        self.check_access(dir, MAY_WRITE | MAY_EXEC)
    }

    /// May this caller remove (or rename away) `victim`, an entry of `dir`? Write and search on
    /// `dir` (`EACCES`); in a sticky directory also owning `dir` or `victim` (`EPERM`).
    pub fn check_delete(&self, dir: &Inode, victim: &Inode) -> Result<()> {
        self.check_create(dir)?;
        let sticky = dir.mode & libc::S_ISVTX != 0;
        if sticky && !self.is_root() && self.uid != dir.uid && self.uid != victim.uid {
            return Err(FsError::Perm);
        }
        Ok(())
    }

    /// May this caller make the changes of `attr` to `inode`? `times_now`: the times asked are
    /// "now" (`utimensat` with `NULL` or both `UTIME_NOW`), which write permission suffices
    /// for. Returns `attr` as it is to be applied: a set-group-ID bit the caller may not set
    /// is dropped, as Linux does, rather than refused.
    pub fn check_setattr(&self, inode: &Inode, attr: SetAttr, times_now: bool) -> Result<SetAttr> {
        let owner = self.is_root() || self.uid == inode.uid;
        let mut attr = attr;
        if let Some(uid) = attr.uid
            && !self.is_root()
            && (uid != inode.uid || self.uid != inode.uid)
        {
            return Err(FsError::Perm);
        }
        if let Some(gid) = attr.gid
            && !self.is_root()
            && (self.uid != inode.uid || (gid != inode.gid && !self.in_group(gid)))
        {
            return Err(FsError::Perm);
        }
        if let Some(mode) = attr.mode {
            if !owner {
                return Err(FsError::Perm);
            }
            let gid = attr.gid.unwrap_or(inode.gid);
            if mode & libc::S_ISGID != 0 && !self.is_root() && !self.in_group(gid) {
                attr.mode = Some(mode & !libc::S_ISGID);
            }
        }
        if (attr.atime_ns.is_some() || attr.mtime_ns.is_some()) && !owner {
            if !times_now {
                return Err(FsError::Perm);
            }
            self.check_access(inode, MAY_WRITE)?;
        }
        if attr.size.is_some() {
            if is_dir(inode.mode) {
                return Err(FsError::IsDir);
            }
            self.check_access(inode, MAY_WRITE)?;
        }
        Ok(attr)
    }
}

/// `renameat2` flags.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// A symbolic link's target (`EINVAL` for anything but a link, as `readlink(2)`).
pub fn link_target(inode: Inode) -> Result<Vec<u8>> {
    if file_type(inode.mode) != libc::S_IFLNK {
        return Err(FsError::Invalid);
    }
    Ok(inode.target)
}

pub fn now_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid one we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// What [`Fs::setattr`] changes in a record, but its size: mode, owner, times; the change
/// time becomes `now`. (Also for a directory removed while open, which has no record left.)
pub fn apply_setattr(i: &mut Inode, attr: &SetAttr, now: i64) {
    if let Some(mode) = attr.mode {
        i.mode = file_type(i.mode) | (mode & 0o7777);
    }
    if let Some(uid) = attr.uid {
        i.uid = uid;
    }
    if let Some(gid) = attr.gid {
        i.gid = gid;
    }
    if (attr.uid.is_some() || attr.gid.is_some()) && !is_dir(i.mode) && attr.mode.is_none() {
        // chown clears set-user-ID and set-group-ID on executables (as Linux does).
        if i.mode & 0o111 != 0 {
            i.mode &= !(libc::S_ISUID | libc::S_ISGID);
        }
    }
    if let Some(t) = attr.atime_ns {
        i.atime_ns = t;
    }
    if let Some(t) = attr.mtime_ns {
        i.mtime_ns = t;
    }
    i.ctime_ns = now;
}

impl Fs {
    /// Reads an inode record and its version (and remembers both, see `recent_inodes`).
    pub(crate) fn load_inode(&self, ino: u64) -> Result<(Inode, u64)> {
        let key = self.keys.inode(ino);
        self.decode_inode(&key, self.kv.get_versioned(&key)?)?.ok_or(FsError::NotFound)
    }

    /// The inode record of `key` as read (`None`: absent), remembered as [`Fs::load_inode`]
    /// remembers it.
    pub(crate) fn decode_inode(&self, key: &[u8], record: Versioned) -> Result<Option<(Inode, u64)>> {
        let Some((bytes, version)) = record else { return Ok(None) };
        let inode = Inode::decode(key, &bytes)?;
        self.remember_inode(&inode, version);
        Ok(Some((inode, version)))
    }

    /// Notes the record of an inode as last read or written by this process.
    pub(crate) fn remember_inode(&self, inode: &Inode, version: u64) {
        let mut recent = self.recent_inodes.lock();
        if recent.len() >= RECENT_INODES_MAX {
            recent.clear();
        }
        recent.insert(inode.ino, (inode.clone(), version, std::time::Instant::now()));
    }

    /// Applies `change` to an inode by compare-and-swap, retrying on conflict. The first try
    /// starts from the record as this process last read or wrote it, if it did recently (one
    /// round trip instead of two when nobody changed it since; a stale copy just fails the
    /// swap, and an error `change` finds in a copy is checked again on the record read anew).
    pub(crate) fn update_inode(&self, ino: u64, change: impl FnMut(&mut Inode) -> Result<()>) -> Result<Inode> {
        self.update_inode_reading(ino, change, None).map(|(inode, _)| inode)
    }

    /// [`Fs::update_inode`], reading the data value `also` in the round trip of the first
    /// swap (see [`crate::Kv::put_cond_reading`]): the value read, or `None` when it was not.
    pub(crate) fn update_inode_reading(&self, ino: u64, mut change: impl FnMut(&mut Inode) -> Result<()>, mut also: Option<&[u8]>) -> Result<(Inode, crate::kv::AlsoRead)> {
        let key = self.keys.inode(ino);
        let mut recent = self.recent_inodes.lock().remove(&ino).map(|(inode, version, _)| (inode, version));
        let mut read = None;
        for _ in 0..CAS_RETRIES_MAX {
            let (mut inode, version, from_copy) = match recent.take() {
                Some((inode, version)) => (inode, version, true),
                None => {
                    let (inode, version) = self.load_inode(ino)?;
                    (inode, version, false)
                }
            };
            match change(&mut inode) {
                Err(_) if from_copy => continue,
                result => result?,
            }
            let written = match also.take() {
                Some(also) => {
                    let (written, value) = self.kv.put_cond_reading(&key, &inode.encode(), Cond::Version(version), also)?;
                    read = value;
                    written
                }
                None => self.kv.put_cond(&key, &inode.encode(), Cond::Version(version))?,
            };
            if let Some(new_version) = written {
                self.remember_inode(&inode, new_version);
                return Ok((inode, read));
            }
        }
        Err(FsError::Io(format!("inode {ino}: too much contention")))
    }

    /// The inode record this process read or wrote less than [`ATTR_FRESH_US`] ago (by the
    /// path walk of the call in progress, typically).
    fn fresh_inode(&self, ino: u64) -> Option<Inode> {
        self.recent_inodes.lock().get(&ino).filter(|(_, _, at)| is_fresh(*at)).map(|(inode, _, _)| inode.clone())
    }

    /// [`Fs::getattr`], answered from the record when this process read or wrote it less than
    /// [`ATTR_FRESH_US`] ago: for the permission checks of a change right after the path walk
    /// that read the directory (the kernel's checks are no more atomic with the change).
    pub fn getattr_fresh(&self, ino: u64) -> Result<Inode> {
        match self.fresh_inode(ino) {
            Some(mut inode) => {
                self.overlay_local(&mut inode);
                Ok(inode)
            }
            None => self.getattr(ino),
        }
    }

    /// Notes a directory bucket's record as this process just read or wrote it.
    pub(crate) fn remember_bucket(&self, dir: u64, bucket: u32, record: Versioned) {
        self.recent_buckets.lock().put((dir, bucket), record);
    }

    fn decode_bucket(&self, dir: u64, bucket: u32, record: &Versioned) -> Result<(Bucket, Option<u64>)> {
        match record {
            Some((bytes, version)) => Ok((Bucket::decode(&self.keys.bucket(dir, bucket), bytes)?, Some(*version))),
            None => Ok((Bucket::default(), None)),
        }
    }

    fn load_bucket(&self, dir: u64, bucket: u32) -> Result<(Bucket, Option<u64>)> {
        let record = self.kv.get_versioned(&self.keys.bucket(dir, bucket))?;
        let decoded = self.decode_bucket(dir, bucket, &record)?;
        self.remember_bucket(dir, bucket, record);
        Ok(decoded)
    }

    /// The entry `name` of `dir`, and whether it comes from a copy: the bucket as this process
    /// read it less than [`ATTR_FRESH_US`] ago (the path walk of the call in progress), when the
    /// name is in it (the change that follows checks it again by compare-and-swap); otherwise
    /// read now, so that a missing name is never taken from a copy.
    fn lookup_fresh(&self, dir: u64, name: &[u8]) -> Result<Option<(DirEntry, bool)>> {
        let bucket = bucket_of(name);
        let fresh = self.recent_buckets.lock().fresh((dir, bucket));
        if let Some(record) = fresh
            && let Some(entry) = self.decode_bucket(dir, bucket, &record)?.0.find(name)
        {
            return Ok(Some((entry.clone(), true)));
        }
        Ok(self.lookup(dir, name)?.map(|entry| (entry, false)))
    }

    /// Directory `dir` (checked to be a live one) and its entry `name`, from records this
    /// process read less than [`ATTR_FRESH_US`] ago (the path walk just before), the others
    /// read in one round trip. What would end the caller's change early (not a directory, no
    /// longer one, the name taken) is never taken from a copy: it is read again.
    fn dir_and_entry(&self, dir: u64, name: &[u8]) -> Result<(Inode, Option<DirEntry>)> {
        let bucket = bucket_of(name);
        let parent = self.fresh_inode(dir);
        let record = self.recent_buckets.lock().fresh((dir, bucket));
        let (parent_copied, record_copied) = (parent.is_some(), record.is_some());
        let (mut parent, record) = match (parent, record) {
            (Some(parent), Some(record)) => (parent, record),
            (parent, record) => {
                let mut keys = Vec::with_capacity(2);
                if parent.is_none() {
                    keys.push(self.keys.inode(dir));
                }
                if record.is_none() {
                    keys.push(self.keys.bucket(dir, bucket));
                }
                let mut read = self.kv.get_versioned_many(&keys)?.into_iter();
                if read.len() != keys.len() {
                    return Err(FsError::Io("a batched get returned too few values".into()));
                }
                let parent = match parent {
                    Some(parent) => parent,
                    None => self.decode_inode(&keys[0], read.next().flatten())?.ok_or(FsError::NotFound)?.0,
                };
                let record = match record {
                    Some(record) => record,
                    None => {
                        let record = read.next().flatten();
                        self.remember_bucket(dir, bucket, record.clone());
                        record
                    }
                };
                (parent, record)
            }
        };
        if parent_copied && live_dir(&parent).is_err() {
            parent = self.load_inode(dir)?.0;
        }
        live_dir(&parent)?;
        let entry = self.decode_bucket(dir, bucket, &record)?.0.find(name).cloned();
        if entry.is_some() && record_copied {
            return Ok((parent, self.lookup(dir, name)?));
        }
        self.memo.note(dir, name, entry.as_ref());
        Ok((parent, entry))
    }

    /// Applies `change` to the bucket of `dir` holding `name` by compare-and-swap. The first
    /// try starts from the bucket as this process last read or wrote it, as
    /// [`Fs::update_inode`] does.
    fn update_bucket<T>(&self, dir: u64, name: &[u8], change: impl FnMut(&mut Bucket) -> Result<T>) -> Result<T> {
        Ok(self.update_bucket_touching(dir, name, change, false)?.0)
    }

    /// [`Fs::update_bucket`], and with `touch` the directory's times set to now: when this
    /// process has a copy of the directory's record and the bucket is written (not deleted),
    /// both compare-and-swaps go out together, one round trip (a time set by a swap whose
    /// bucket then lost the race is a change the directory did see, another process's).
    /// `true` with the result when the times were set; otherwise the caller sets them.
    fn update_bucket_touching<T>(&self, dir: u64, name: &[u8], change: impl FnMut(&mut Bucket) -> Result<T>, touch: bool) -> Result<(T, bool)> {
        self.update_bucket_creating(dir, name, change, touch, None).map(|(out, touched, _)| (out, touched))
    }

    /// [`Fs::update_bucket_touching`], and with `create` a record (key, value) written if
    /// absent in the same round trip, ahead of the bucket on the first try (a later try, after
    /// another process changed the bucket, does not send it again): a new file's inode goes
    /// out with the entry that names it. The writes of one batch reach a node in order, and a
    /// batch over several nodes goes node after node ([`Kv::write_many`]), so no process finds
    /// the name before the record. Also returns the record's version when this call wrote it
    /// (`None`: it was there already, or none was asked for).
    fn update_bucket_creating<T>(
        &self,
        dir: u64,
        name: &[u8],
        mut change: impl FnMut(&mut Bucket) -> Result<T>,
        touch: bool,
        mut create: Option<(&[u8], &[u8])>,
    ) -> Result<(T, bool, Option<u64>)> {
        let bucket = bucket_of(name);
        let key = self.keys.bucket(dir, bucket);
        let mut recent = self.recent_buckets.lock().take((dir, bucket));
        let mut touched = false;
        let mut created = None;
        for _ in 0..CAS_RETRIES_MAX {
            let ((mut entries, version), from_copy) = match recent.take() {
                Some(record) => match self.decode_bucket(dir, bucket, &record) {
                    Ok(decoded) => (decoded, true),
                    Err(_) => (self.load_bucket(dir, bucket)?, false),
                },
                None => (self.load_bucket(dir, bucket)?, false),
            };
            let out = match change(&mut entries) {
                Err(_) if from_copy => continue,
                out => out?,
            };
            let cond = version.map_or(Cond::Absent, Cond::Version);
            // A bucket left empty is deleted.
            let encoded = (!entries.entries.is_empty() || version.is_none()).then(|| entries.encode());
            let write = match &encoded {
                Some(bytes) => WriteOp::Put(&key, bytes, cond),
                None => WriteOp::Delete(&key, cond),
            };
            let parent = if touch && !touched { self.recent_inodes.lock().get(&dir).map(|(inode, version, _)| (inode.clone(), *version)) } else { None };
            let parent = parent.map(|(mut parent, parent_version)| {
                set_dir_changed(&mut parent, now_ns(), 0);
                let bytes = parent.encode();
                (parent, parent_version, bytes)
            });
            let parent_key = parent.as_ref().map(|_| self.keys.inode(dir));
            let mut batch = Vec::with_capacity(3);
            let lead = match create.take() {
                Some((key, value)) => {
                    batch.push(WriteOp::Put(key, value, Cond::Absent));
                    1
                }
                None => 0,
            };
            batch.push(write);
            if let (Some((_, parent_version, bytes)), Some(parent_key)) = (&parent, &parent_key) {
                batch.push(WriteOp::Put(parent_key, bytes, Cond::Version(*parent_version)));
            }
            let results = if batch.len() == 1 { vec![write.apply(&*self.kv)?] } else { self.kv.write_many(&batch)? };
            if lead == 1 {
                created = results.first().copied().flatten();
            }
            if let Some((parent, _, _)) = parent {
                match results.get(lead + 1).copied().flatten() {
                    Some(new_version) => {
                        self.remember_inode(&parent, new_version);
                        touched = true;
                    }
                    None => {
                        self.recent_inodes.lock().remove(&dir);
                    }
                }
            }
            if let Some(new_version) = results.get(lead).copied().flatten() {
                self.remember_bucket(dir, bucket, encoded.map(|bytes| (bytes, new_version)));
                self.memo.note(dir, name, entries.find(name));
                return Ok((out, touched, created));
            }
        }
        Err(FsError::Io(format!("directory {dir}: too much contention")))
    }

    /// The entry `name` of directory `dir`.
    pub fn lookup(&self, dir: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        if name.len() > crate::layout::NAME_BYTES_MAX {
            return Err(FsError::NameTooLong);
        }
        let (bucket, _) = self.load_bucket(dir, bucket_of(name))?;
        let entry = bucket.find(name).cloned();
        self.memo.note(dir, name, entry.as_ref());
        Ok(entry)
    }

    /// The entry `name` of directory `dir` and the inode it names. Another process may
    /// replace or remove the name between reading the entry and reading the inode (a rename
    /// over it drops the old inode): the name is then read again, so that a name that always
    /// existed is never `ENOENT`. A name this process has seen is read with its inode in one
    /// round trip (see [`crate::memo`]).
    pub fn lookup_inode(&self, dir: u64, name: &[u8]) -> Result<Option<(DirEntry, Inode)>> {
        for _ in 0..CAS_RETRIES_MAX {
            let Some((entry, inode)) = self.lookup_read_ahead(dir, name)? else { return Ok(None) };
            match inode {
                Some(inode) => return Ok(Some((entry, inode))),
                None => continue,
            }
        }
        Err(FsError::Io(format!("directory {dir}: the entry keeps naming removed inodes")))
    }

    /// Every entry of `dir` (without `.` and `..`), read in one batch.
    pub fn readdir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let keys: Vec<Vec<u8>> = (0..DIR_BUCKETS).map(|b| self.keys.bucket(dir, b)).collect();
        let mut out = Vec::new();
        for (key, value) in keys.iter().zip(self.kv.get_meta_many(&keys)?) {
            if let Some(bytes) = value {
                out.extend(Bucket::decode(key, &bytes)?.entries);
            }
        }
        self.memo.note_all(dir, &out);
        Ok(out)
    }

    /// The inode as this process sees it: the pool's record, with the size and times of data
    /// still in this process's cache.
    pub fn getattr(&self, ino: u64) -> Result<Inode> {
        let (mut inode, _) = self.load_inode(ino)?;
        self.overlay_local(&mut inode);
        Ok(inode)
    }

    /// [`Fs::getattr`] of a file this process has open: its inode being gone means another
    /// process removed the file (`ESTALE`, as NFS reports it), not that a name is missing.
    /// It answers from the record as this process saw it less than [`ATTR_FRESH_US`] ago.
    /// Not for a file shared with another process this one knows of (a forked child, an
    /// opener seen at the open): those write through to the pool and are read from it.
    pub fn getattr_open(&self, ino: u64) -> Result<Inode> {
        let private = self.nodes.lock().get(&ino).is_some_and(|node| !node.is_shared());
        let fresh = if private { self.fresh_inode(ino) } else { None };
        match fresh {
            Some(mut inode) => {
                self.overlay_local(&mut inode);
                Ok(inode)
            }
            None => self.getattr(ino).map_err(FsError::gone_is_stale),
        }
    }

    /// Directory `dir`, checked to be a live one (from the record as read less than
    /// [`ATTR_FRESH_US`] ago, if it was).
    fn dir_inode(&self, dir: u64) -> Result<Inode> {
        let inode = match self.fresh_inode(dir).filter(|inode| live_dir(inode).is_ok()) {
            Some(inode) => inode,
            None => self.load_inode(dir)?.0,
        };
        live_dir(&inode)?;
        Ok(inode)
    }

    /// Updates a directory's times (and link count) after its entries changed.
    fn touch_dir(&self, dir: u64, nlink_delta: i32) -> Result<()> {
        let now = now_ns();
        self.update_inode(dir, |d| {
            set_dir_changed(d, now, nlink_delta);
            Ok(())
        })
        .map(|_| ())
    }

    /// Creates `name` in `dir` (any type but directory; `target` for symlinks). With
    /// `exclusive` an existing name is `EEXIST`; otherwise the existing inode is returned
    /// (`false`: not created).
    #[allow(clippy::too_many_arguments)] // mknod's, symlink's and open's arguments in one place
    pub fn create(&self, dir: u64, name: &[u8], mode: u32, rdev: u32, target: &[u8], owner: Owner, exclusive: bool) -> Result<(Inode, bool)> {
        self.create_as(dir, name, mode, rdev, target, owner, exclusive, false)
    }

    /// [`Fs::create`] of a regular file that the caller opens next: a file it makes lists
    /// this process among its openers from the start, so that its open
    /// ([`Fs::open_node_created`]) needs no compare-and-swap of its own (an existing file, the
    /// `false` case, is opened with [`Fs::open_node`] as usual).
    pub fn create_open(&self, dir: u64, name: &[u8], perm: u32, owner: Owner, exclusive: bool) -> Result<(Inode, bool)> {
        self.create_as(dir, name, libc::S_IFREG | (perm & 0o7777), 0, b"", owner, exclusive, true)
    }

    #[allow(clippy::too_many_arguments)] // create's, and whether the new file is opened
    fn create_as(&self, dir: u64, name: &[u8], mode: u32, rdev: u32, target: &[u8], owner: Owner, exclusive: bool, opened: bool) -> Result<(Inode, bool)> {
        check_name(name)?;
        if target.len() > SYMLINK_BYTES_MAX {
            return Err(FsError::NameTooLong);
        }
        let (parent, existing) = self.dir_and_entry(dir, name)?;
        if let Some(existing) = existing {
            if exclusive {
                return Err(FsError::Exists);
            }
            return Ok((self.getattr(existing.ino)?, false));
        }
        let gid = if parent.mode & libc::S_ISGID != 0 { parent.gid } else { owner.gid };
        let mut inode = Inode::new(self.allocate_ino()?, mode, owner.uid, gid, now_ns());
        inode.rdev = rdev;
        if is_dir(mode) {
            inode.parent = dir;
            if parent.mode & libc::S_ISGID != 0 {
                inode.mode |= libc::S_ISGID;
            }
        }
        if file_type(mode) == libc::S_IFLNK {
            inode.target = target.to_vec();
            inode.size = target.len() as u64;
        }
        if opened {
            inode.openers.push(self.opener());
        }
        let (inode_key, inode_bytes) = (self.keys.inode(inode.ino), inode.encode());
        let entry = DirEntry { name: name.to_vec(), ino: inode.ino, dtype: dtype_of(mode) };
        // The record goes out with the entry, one round trip. A new directory adds a link to
        // its parent, which must follow the entry: only other files' times go with it.
        let added = self.update_bucket_creating(
            dir,
            name,
            |b| match b.find(name) {
                Some(e) => Ok(Some(e.clone())),
                None => {
                    b.upsert(entry.clone());
                    Ok(None)
                }
            },
            !is_dir(mode),
            Some((&inode_key, &inode_bytes)),
        );
        let added = match added {
            Ok((out, touched, Some(version))) => {
                self.remember_inode(&inode, version);
                Ok((out, touched))
            }
            // The record goes out with the bucket's first write, so this is a record already
            // there: a number the allocator gave out before.
            Ok((out, _, None)) => {
                if out.is_none() {
                    // The entry now names a record this call did not write: take it back.
                    self.update_bucket(dir, name, |b| {
                        if b.find(name).is_some_and(|e| e.ino == inode.ino) {
                            b.remove(name);
                        }
                        Ok(())
                    })?;
                }
                return Err(FsError::Io(format!("inode {} already exists: the allocator is broken", inode.ino)));
            }
            Err(e) => Err(e),
        };
        let touched = match added {
            Ok((None, touched)) => touched,
            Ok((Some(existing), _)) => {
                // Another process created it first.
                self.kv.delete_cond(&self.keys.inode(inode.ino), Cond::Always)?;
                if exclusive {
                    return Err(FsError::Exists);
                }
                return Ok((self.getattr(existing.ino)?, false));
            }
            Err(e) => {
                self.kv.delete_cond(&self.keys.inode(inode.ino), Cond::Always)?;
                return Err(e);
            }
        };
        if !touched {
            self.touch_dir(dir, if is_dir(mode) { 1 } else { 0 })?;
        }
        Ok((inode, true))
    }

    pub fn mkdir(&self, dir: u64, name: &[u8], perm: u32, owner: Owner) -> Result<Inode> {
        Ok(self.create(dir, name, libc::S_IFDIR | (perm & 0o7777), 0, b"", owner, true)?.0)
    }

    pub fn symlink(&self, dir: u64, name: &[u8], target: &[u8], owner: Owner) -> Result<Inode> {
        if target.is_empty() {
            return Err(FsError::NotFound);
        }
        Ok(self.create(dir, name, libc::S_IFLNK | 0o777, 0, target, owner, true)?.0)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        link_target(self.load_inode(ino)?.0)
    }

    /// A hard link `dir/name` to `ino`. A file with no name left is `NotFound`, unless it is
    /// an unnamed file made by [`Fs::create_unnamed`] to be linked ([`Inode::linkable_unnamed`]),
    /// which this gives its first name: it leaves the orphan list. Any link ends that
    /// linkability, as Linux clears `I_LINKABLE` (a name removed again leaves the file gone).
    pub fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Inode> {
        check_name(name)?;
        self.dir_inode(dir)?;
        let now = now_ns();
        // The directory an unnamed file was made in, when this link names it.
        let mut unnamed_in = 0;
        let inode = self.update_inode(ino, |i| {
            if is_dir(i.mode) {
                return Err(FsError::Perm);
            }
            if i.nlink == 0 && !i.linkable_unnamed() {
                return Err(FsError::NotFound);
            }
            if i.nlink >= NLINK_MAX {
                return Err(FsError::TooManyLinks);
            }
            unnamed_in = if i.nlink == 0 { i.parent } else { 0 };
            i.nlink += 1;
            i.parent = 0;
            i.ctime_ns = now;
            Ok(())
        })?;
        let entry = DirEntry { name: name.to_vec(), ino, dtype: dtype_of(inode.mode) };
        let added = self.update_bucket_touching(
            dir,
            name,
            |b| {
                if b.find(name).is_some() {
                    return Err(FsError::Exists);
                }
                b.upsert(entry.clone());
                Ok(())
            },
            true,
        );
        match added {
            Err(e) if unnamed_in != 0 => {
                self.unname_again(ino, unnamed_in)?;
                return Err(e);
            }
            Err(e) => {
                self.drop_link(ino)?;
                return Err(e);
            }
            Ok(((), false)) => self.touch_dir(dir, 0)?,
            Ok(((), true)) => {}
        }
        if unnamed_in != 0 {
            self.remove_orphan(ino)?;
        }
        let mut inode = inode;
        self.overlay_local(&mut inode);
        Ok(inode)
    }

    /// Undoes the count of a first link of an unnamed file whose name could not be added: no
    /// link again and linkable, still an orphan (not [`Fs::drop_link`], which would take it
    /// for a file unlinked here and delete it at the close).
    fn unname_again(&self, ino: u64, made_in: u64) -> Result<()> {
        self.update_inode(ino, |i| {
            i.nlink = i.nlink.saturating_sub(1);
            if i.nlink == 0 {
                i.parent = made_in;
            }
            Ok(())
        })
        .map(|_| ())
    }

    /// A regular file without a name in directory `dir` (`open` with `O_TMPFILE`), to be opened
    /// by this process next ([`Fs::open_node_created`]): `nlink` 0, this process its only
    /// opener, and on the orphan list from the start, so that it goes as a file unlinked while
    /// open goes: at its last close, or at the next sweep when its openers died. `linkable`
    /// (no `O_EXCL`): [`Fs::link`] may give it a name. The directory's times do not change
    /// (nothing in it does), as on Linux.
    pub fn create_unnamed(&self, dir: u64, perm: u32, owner: Owner, linkable: bool) -> Result<Inode> {
        let parent = self.dir_inode(dir)?;
        let gid = if parent.mode & libc::S_ISGID != 0 { parent.gid } else { owner.gid };
        let mut inode = Inode::new(self.allocate_ino()?, libc::S_IFREG | (perm & 0o7777), owner.uid, gid, now_ns());
        inode.nlink = 0;
        if linkable {
            inode.parent = dir;
        }
        inode.openers.push(self.opener());
        debug_assert_eq!(inode.linkable_unnamed(), linkable);
        // The record first, as a new inode comes before the entry that names it: a process
        // dying before the orphan list names it leaves one record without data.
        match self.kv.put_cond(&self.keys.inode(inode.ino), &inode.encode(), Cond::Absent)? {
            Some(version) => self.remember_inode(&inode, version),
            None => return Err(FsError::Io(format!("inode {} already exists: the allocator is broken", inode.ino))),
        }
        if let Err(e) = self.add_orphan(inode.ino) {
            self.kv.delete_cond(&self.keys.inode(inode.ino), Cond::Always)?;
            self.forget_deleted(inode.ino, false);
            return Err(e);
        }
        Ok(inode)
    }

    /// Removes the non-directory `dir/name`.
    pub fn unlink(&self, dir: u64, name: &[u8]) -> Result<()> {
        let (removed, touched) = self.remove_entry(dir, name, |entry| if entry.dtype == libc::DT_DIR { Err(FsError::IsDir) } else { Ok(()) }, true)?;
        if !touched {
            self.touch_dir(dir, 0)?;
        }
        self.drop_link(removed.ino)
    }

    /// Removes the empty directory `dir/name`.
    pub fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()> {
        if name == b"." {
            return Err(FsError::Invalid);
        }
        if name == b".." {
            return Err(FsError::NotEmpty);
        }
        let (removed, _) = self.remove_entry(dir, name, |entry| {
            if entry.dtype != libc::DT_DIR {
                return Err(FsError::NotDir);
            }
            if !self.readdir(entry.ino)?.is_empty() {
                return Err(FsError::NotEmpty);
            }
            Ok(())
        }, false)?;
        self.touch_dir(dir, -1)?;
        self.kv.delete_cond(&self.keys.inode(removed.ino), Cond::Always)?;
        self.forget_deleted(removed.ino, true);
        Ok(())
    }

    /// Removes the entry `name` of `dir` if `check` allows, by compare-and-swap on the entry
    /// as looked up (from the walk's copy of the bucket when there is one: an entry that
    /// copy no longer matches is looked up again, and checked again); with `touch`, setting
    /// the directory's times in the same round trip when it can (see
    /// [`Fs::update_bucket_touching`]: `true` when it did).
    fn remove_entry(&self, dir: u64, name: &[u8], check: impl Fn(&DirEntry) -> Result<()>, touch: bool) -> Result<(DirEntry, bool)> {
        let (mut entry, mut copied) = self.lookup_fresh(dir, name)?.ok_or(FsError::NotFound)?;
        loop {
            if let Err(e) = check(&entry) {
                // What ends the change early is never taken from a copy: the name may name
                // another file by now (renamed over by another process).
                if !copied {
                    return Err(e);
                }
                (entry, copied) = (self.lookup(dir, name)?.ok_or(FsError::NotFound)?, false);
                continue;
            }
            let (removed, touched) = self.update_bucket_touching(
                dir,
                name,
                |b| match b.find(name) {
                    Some(e) if e.ino == entry.ino => Ok(b.remove(name)),
                    Some(_) | None => Ok(None),
                },
                touch,
            )?;
            match removed {
                Some(removed) => return Ok((removed, touched)),
                None if copied => (entry, copied) = (self.lookup(dir, name)?.ok_or(FsError::NotFound)?, false),
                None => return Err(FsError::NotFound),
            }
        }
    }

    /// One name of `ino` went away: drops its link count and, at zero, its data and record,
    /// unless a process (this one or another) still has it open: then at the last close.
    pub(crate) fn drop_link(&self, ino: u64) -> Result<()> {
        if self.delete_last_link(ino)? {
            return Ok(());
        }
        let now = now_ns();
        let inode = match self.update_inode(ino, |i| {
            i.nlink = i.nlink.saturating_sub(if is_dir(i.mode) { i.nlink } else { 1 });
            i.ctime_ns = now;
            Ok(())
        }) {
            Ok(inode) => inode,
            Err(FsError::NotFound) => return Ok(()),
            Err(e) => return Err(e),
        };
        if inode.nlink > 0 {
            return Ok(());
        }
        let open_here = self.defer_delete_if_open(ino);
        if open_here || self.open_elsewhere(&inode) {
            // The last opener's close deletes it; if that one dies first, a later sweep does.
            return self.add_orphan(ino);
        }
        self.delete_inode(&inode)
    }

    /// The common case of [`Fs::drop_link`] in one round trip: the last name of a file that no
    /// process has open went away, as the record this process last read or wrote says (the
    /// path walk of the unlink read it). The record is deleted by compare-and-swap from that
    /// copy, then the file's data. `false` (nothing done): the copy says otherwise, or the
    /// record changed since (another process opened or linked the file), for the general way.
    fn delete_last_link(&self, ino: u64) -> Result<bool> {
        let Some((inode, version, _)) = self.recent_inodes.lock().get(&ino).cloned() else { return Ok(false) };
        if is_dir(inode.mode) || inode.nlink != 1 || self.open_elsewhere(&inode) || self.open_here(ino) {
            return Ok(false);
        }
        if !self.kv.delete_cond(&self.keys.inode(ino), Cond::Version(version))? {
            self.recent_inodes.lock().remove(&ino);
            return Ok(false);
        }
        // Inode numbers are never reused: a crash before the data goes leaves only chunks
        // nothing names, as a crash between the two steps of the general way leaves both.
        if file_type(inode.mode) == libc::S_IFREG {
            self.delete_chunks(ino, inode.size)?;
        }
        self.forget_deleted(ino, false);
        Ok(true)
    }

    /// Drops what this process and this host keep of deleted inode `ino`: its node and its
    /// record's copy, a directory's buckets' copies, and this host's files standing for it
    /// (see [`crate::FsConfig::host_files_prefix`]), so that they do not pile up; those of
    /// other hosts stay. Nobody can open the inode any more (it has no name and no opener),
    /// and a process that still has one of those files open keeps it as the kernel keeps an
    /// unlinked file.
    pub(crate) fn forget_deleted(&self, ino: u64, was_dir: bool) {
        self.forget_node(ino);
        if was_dir {
            self.recent_buckets.lock().forget_dir(ino);
        }
        let Some(prefix) = &self.config.host_files_prefix else { return };
        for suffix in crate::host_files::ALL {
            let mut path = prefix.clone().into_os_string();
            path.push(format!("{ino:x}{suffix}"));
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::trace!(ino, ?path, "host file removed"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => tracing::debug!(ino, ?path, %error, "could not remove a host file"),
            }
        }
    }

    /// Deletes the chunks of a file of `size` bytes (and any this process holds beyond it).
    pub(crate) fn delete_chunks(&self, ino: u64, size: u64) -> Result<()> {
        let chunks = size.div_ceil(self.chunk as u64).max(self.local_chunk_count(ino));
        let keys: Vec<Vec<u8>> = (0..chunks).map(|i| self.keys.chunk(ino, i)).collect();
        self.kv.delete_many(&keys)
    }

    /// Deletes an unlinked inode's chunks and record.
    pub(crate) fn delete_inode(&self, inode: &Inode) -> Result<()> {
        if file_type(inode.mode) == libc::S_IFREG {
            self.delete_chunks(inode.ino, inode.size)?;
        }
        if is_dir(inode.mode) {
            let keys: Vec<Vec<u8>> = (0..DIR_BUCKETS).map(|b| self.keys.bucket(inode.ino, b)).collect();
            self.kv.delete_many(&keys)?;
        }
        self.kv.delete_cond(&self.keys.inode(inode.ino), Cond::Always)?;
        self.forget_deleted(inode.ino, is_dir(inode.mode));
        Ok(())
    }

    /// Moves `sdir/sname` to `ddir/dname`, atomically replacing an existing target.
    pub fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8], flags: RenameFlags) -> Result<()> {
        for _ in 0..RENAME_RETRIES_MAX {
            match self.rename_once(sdir, sname, ddir, dname, flags) {
                Err(FsError::Io(why)) if why == RENAME_RACE => continue,
                other => return other,
            }
        }
        Err(FsError::Io("rename: too much contention".into()))
    }

    fn rename_once(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8], flags: RenameFlags) -> Result<()> {
        if sname == b"." || sname == b".." || dname == b"." || dname == b".." {
            return Err(FsError::Invalid);
        }
        if flags.exchange {
            // Linux: both flags at once are EINVAL.
            return if flags.noreplace { Err(FsError::Invalid) } else { self.exchange_once(sdir, sname, ddir, dname) };
        }
        check_name(dname)?;
        // Read now, not from a copy: the new name is written before the old one is removed.
        let src = self.lookup(sdir, sname)?.ok_or(FsError::NotFound)?;
        self.dir_inode(ddir)?;
        let src_is_dir = src.dtype == libc::DT_DIR;
        if src_is_dir && sdir != ddir {
            self.refuse_cycle(src.ino, ddir)?;
        }
        // The target is checked again under the compare-and-swap that replaces it; what would
        // refuse the rename is never taken from a copy (see `Fs::dir_and_entry`).
        let mut found = self.lookup_fresh(ddir, dname)?;
        let mut verdict = found.as_ref().map(|(t, _)| self.rename_target_verdict(&src, sdir, t, flags));
        if let (Some((_, true)), Some(Err(_))) = (&found, &verdict) {
            found = self.lookup(ddir, dname)?.map(|t| (t, false));
            verdict = found.as_ref().map(|(t, _)| self.rename_target_verdict(&src, sdir, t, flags));
        }
        if verdict.transpose()? == Some(true) {
            return Ok(()); // the same file: POSIX says do nothing
        }
        let target = found.map(|(t, _)| t);
        let moved = DirEntry { name: dname.to_vec(), ino: src.ino, dtype: src.dtype };
        let replaced = if sdir == ddir && bucket_of(sname) == bucket_of(dname) {
            // One record holds both names: one compare-and-swap does it all.
            let replaced = self.update_bucket(sdir, sname, |b| {
                match b.find(sname) {
                    Some(e) if e.ino == src.ino => {}
                    _ => return Err(FsError::NotFound),
                }
                check_target(b.find(dname), &target, flags)?;
                b.remove(sname);
                Ok(b.upsert(moved.clone()))
            })?;
            self.memo.note(ddir, dname, Some(&moved));
            replaced
        } else {
            let replaced = self.update_bucket(ddir, dname, |b| {
                check_target(b.find(dname), &target, flags)?;
                Ok(b.upsert(moved.clone()))
            })?;
            self.update_bucket(sdir, sname, |b| {
                if b.find(sname).is_some_and(|e| e.ino == src.ino) {
                    b.remove(sname);
                }
                Ok(())
            })?;
            replaced
        };
        let now = now_ns();
        let touched = if src_is_dir && sdir != ddir {
            self.update_inode(src.ino, |i| {
                i.parent = ddir;
                i.ctime_ns = now;
                Ok(())
            })
        } else {
            self.update_inode(src.ino, |i| {
                i.ctime_ns = now;
                Ok(())
            })
        };
        match touched {
            // Once the new name is in place another process may rename something over it and
            // drop the last link of the moved inode before this one gets here: the rename
            // happened (and was then replaced), so that is success, not ENOENT.
            Ok(_) | Err(FsError::NotFound) => {}
            Err(e) => return Err(e),
        }
        let replaced_dir = replaced.as_ref().is_some_and(|r| r.dtype == libc::DT_DIR);
        let (sdelta, ddelta) = match (src_is_dir && sdir != ddir, replaced_dir) {
            (true, true) => (-1, 0),
            (true, false) => (-1, 1),
            (false, true) => (0, -1),
            (false, false) => (0, 0),
        };
        self.touch_dir(sdir, sdelta)?;
        if ddir != sdir || ddelta != 0 {
            self.touch_dir(ddir, ddelta)?;
        }
        if let Some(r) = replaced {
            self.drop_link(r.ino)?;
        }
        Ok(())
    }

    /// Whether a rename of `src` (in `sdir`) may replace the existing `target`: `Ok(true)` when
    /// both are one file (nothing to do), `Ok(false)` when it may, or the error Linux gives.
    fn rename_target_verdict(&self, src: &DirEntry, sdir: u64, target: &DirEntry, flags: RenameFlags) -> Result<bool> {
        // Linux checks RENAME_NOREPLACE first: onto itself too, it is EEXIST.
        if flags.noreplace {
            return Err(FsError::Exists);
        }
        if target.ino == src.ino {
            return Ok(true);
        }
        match (src.dtype == libc::DT_DIR, target.dtype == libc::DT_DIR) {
            (true, false) => Err(FsError::NotDir),
            // Linux: a target that holds the source is ENOTEMPTY whatever the source is.
            (false, true) => Err(if self.is_within(sdir, target.ino)? { FsError::NotEmpty } else { FsError::IsDir }),
            (true, true) if !self.readdir(target.ino)?.is_empty() => Err(FsError::NotEmpty),
            _ => Ok(false),
        }
    }

    /// `renameat2(…, RENAME_EXCHANGE)`: `sdir/sname` and `ddir/dname`, which must both exist,
    /// swap names. In one directory record (both names in one bucket) one compare-and-swap;
    /// otherwise `dname` takes the source first, then `sname` the target (as a plain rename
    /// writes its new name before it removes the old: in between, and after a crash there, the
    /// source has both names). Should another process have renamed something over `sname`
    /// meanwhile, that rename counts as coming after the exchange: the target, which it
    /// replaced, loses that link.
    fn exchange_once(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()> {
        let src = self.lookup(sdir, sname)?.ok_or(FsError::NotFound)?;
        let dst = self.lookup(ddir, dname)?.ok_or(FsError::NotFound)?;
        self.dir_inode(sdir)?;
        self.dir_inode(ddir)?;
        if src.ino == dst.ino {
            return Ok(());
        }
        let (src_is_dir, dst_is_dir) = (src.dtype == libc::DT_DIR, dst.dtype == libc::DT_DIR);
        if sdir != ddir {
            // Neither directory may end up inside itself.
            if src_is_dir {
                self.refuse_cycle(src.ino, ddir)?;
            }
            if dst_is_dir {
                self.refuse_cycle(dst.ino, sdir)?;
            }
        }
        let at_dname = DirEntry { name: dname.to_vec(), ino: src.ino, dtype: src.dtype };
        let at_sname = DirEntry { name: sname.to_vec(), ino: dst.ino, dtype: dst.dtype };
        let is = |entry: Option<&DirEntry>, want: &DirEntry| entry.is_some_and(|e| e.ino == want.ino);
        let mut replaced_meanwhile = None;
        if sdir == ddir && bucket_of(sname) == bucket_of(dname) {
            self.update_bucket(sdir, sname, |b| {
                if !is(b.find(sname), &src) || !is(b.find(dname), &dst) {
                    return Err(FsError::Io(RENAME_RACE.into()));
                }
                b.upsert(at_dname.clone());
                b.upsert(at_sname.clone());
                Ok(())
            })?;
            // The swap noted `sname` as it now reads; `dname` changed in the same record.
            self.memo.note(ddir, dname, Some(&at_dname));
        } else {
            self.update_bucket(ddir, dname, |b| {
                if !is(b.find(dname), &dst) {
                    return Err(FsError::Io(RENAME_RACE.into()));
                }
                b.upsert(at_dname.clone());
                Ok(())
            })?;
            replaced_meanwhile = self.update_bucket(sdir, sname, |b| match b.find(sname) {
                Some(e) if e.ino != src.ino => Ok(Some(e.clone())),
                _ => {
                    b.upsert(at_sname.clone());
                    Ok(None)
                }
            })?;
        }
        let now = now_ns();
        for (entry, new_parent) in [(&src, ddir), (&dst, sdir)] {
            let moved_dir = entry.dtype == libc::DT_DIR && sdir != ddir;
            let touched = self.update_inode(entry.ino, |i| {
                if moved_dir {
                    i.parent = new_parent;
                }
                i.ctime_ns = now;
                Ok(())
            });
            match touched {
                // Renamed over and deleted by another process since: the exchange happened.
                Ok(_) | Err(FsError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        // A directory that changes parents moves its `..` link with it.
        let delta = if sdir == ddir { 0 } else { i32::from(dst_is_dir) - i32::from(src_is_dir) };
        self.touch_dir(sdir, delta)?;
        if ddir != sdir {
            self.touch_dir(ddir, -delta)?;
        }
        if replaced_meanwhile.is_some() {
            self.drop_link(dst.ino)?;
        }
        Ok(())
    }

    /// Refuses to move directory `moving` under `new_parent` when that is inside `moving`.
    fn refuse_cycle(&self, moving: u64, new_parent: u64) -> Result<()> {
        if self.is_within(new_parent, moving)? { Err(FsError::Invalid) } else { Ok(()) }
    }

    /// Whether directory `dir` is `ancestor` or inside it.
    fn is_within(&self, dir: u64, ancestor: u64) -> Result<bool> {
        let mut at = dir;
        for _ in 0..DEPTH_MAX {
            if at == ancestor {
                return Ok(true);
            }
            if at == ROOT_INO {
                return Ok(false);
            }
            at = self.load_inode(at)?.0.parent;
        }
        Err(FsError::Loop)
    }

    /// `fallocate(2)` on an open file: mode 0 (and `FALLOC_FL_KEEP_SIZE`) extends the size
    /// (chunks are not reserved: the pool has no reservations), `FALLOC_FL_PUNCH_HOLE` (with
    /// `KEEP_SIZE`, as Linux requires) and `FALLOC_FL_ZERO_RANGE` write zeros, which write-back
    /// turns into holes (whole zero chunks are deleted). Other modes: `EOPNOTSUPP`.
    pub fn fallocate(&self, node: &Arc<crate::Node>, mode: i32, offset: i64, len: i64) -> Result<()> {
        if offset < 0 || len <= 0 {
            return Err(FsError::Invalid);
        }
        let end = (offset as u64).checked_add(len as u64).ok_or(FsError::TooBig)?;
        let size = self.size_of(node)?;
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 => {}
            m if m == libc::FALLOC_FL_PUNCH_HOLE || m == libc::FALLOC_FL_ZERO_RANGE => {
                if m == libc::FALLOC_FL_PUNCH_HOLE && !keep {
                    return Err(FsError::NotSupported);
                }
                let stop = if keep { end.min(size) } else { end };
                let mut at = offset as u64;
                let zeros = vec![0u8; FALLOCATE_STEP_BYTES];
                while at < stop {
                    let n = ((stop - at) as usize).min(FALLOCATE_STEP_BYTES);
                    self.write(node, at, &zeros[..n], crate::cache::WriteMode::Buffered)?;
                    at += n as u64;
                }
                return Ok(());
            }
            _ => return Err(FsError::NotSupported),
        }
        if !keep && end > size {
            self.setattr(node.ino, SetAttr { size: Some(end), ..SetAttr::default() })?;
        }
        Ok(())
    }

    /// `chmod`, `chown`, `truncate`, `utimensat`.
    pub fn setattr(&self, ino: u64, attr: SetAttr) -> Result<Inode> {
        let truncated = attr.size.map(|size| self.truncate(ino, size)).transpose()?;
        if attr.mode.is_none() && attr.uid.is_none() && attr.gid.is_none() && attr.atime_ns.is_none() && attr.mtime_ns.is_none() {
            // The record the size change left, read again only when there was none.
            return match truncated {
                Some(inode) => Ok(inode),
                None => self.getattr(ino),
            };
        }
        let now = now_ns();
        if attr.mtime_ns.is_some() {
            self.discard_local_mtime(ino);
        }
        let mut inode = self.update_inode(ino, |i| {
            apply_setattr(i, &attr, now);
            Ok(())
        })?;
        self.overlay_local(&mut inode);
        Ok(inode)
    }

    /// Takes an inode number from this process's range, refilling it from the shared counter
    /// by compare-and-swap (a fork starts a fresh range: parent and child must not share one).
    pub(crate) fn allocate_ino(&self) -> Result<u64> {
        let pid = std::process::id();
        let mut range = self.inos.lock();
        if range.pid != pid || range.next >= range.end {
            let key = self.keys.next_ino();
            let mut taken = None;
            for _ in 0..CAS_RETRIES_MAX {
                let (start, cond) = match self.kv.get_versioned(&key)? {
                    Some((bytes, version)) => {
                        let start = u64::from_le_bytes(bytes.as_slice().try_into().map_err(|_| FsError::Corrupt {
                            key: String::from_utf8_lossy(&key).into_owned(),
                            why: "inode counter is not 8 bytes",
                        })?);
                        (start, Cond::Version(version))
                    }
                    None => (ROOT_INO + 1, Cond::Absent),
                };
                let end = start + crate::layout::INO_BATCH;
                if self.kv.put_cond(&key, &end.to_le_bytes(), cond)?.is_some() {
                    taken = Some((start, end));
                    break;
                }
            }
            let (start, end) = taken.ok_or_else(|| FsError::Io("inode counter: too much contention".into()))?;
            *range = crate::InoRange { pid, next: start, end };
        }
        let ino = range.next;
        range.next += 1;
        Ok(ino)
    }

    /// Writes the root directory of a new file system (unless another process just did).
    pub(crate) fn format_root(&self, owner: Owner) -> Result<()> {
        let root_key = self.keys.inode(ROOT_INO);
        let mut root = Inode::new(ROOT_INO, libc::S_IFDIR | 0o755, owner.uid, owner.gid, now_ns());
        root.parent = ROOT_INO;
        self.kv.put_cond(&root_key, &root.encode(), Cond::Absent)?;
        Ok(())
    }

    /// File system totals for `statfs`: the pool's capacity, free and available room as its
    /// nodes report them (looked up at most every [`STATFS_CACHE_MS`]), in chunks; a pool
    /// whose nodes do not say gets large constants, as network file systems report.
    pub fn statfs(&self) -> Result<libc::statfs> {
        let space = {
            let mut cached = self.space_cache.lock();
            match *cached {
                Some((at, space)) if at.elapsed() < std::time::Duration::from_millis(STATFS_CACHE_MS) => space,
                _ => {
                    let space = self.kv.space()?;
                    *cached = Some((std::time::Instant::now(), space));
                    space
                }
            }
        };
        let chunk = self.chunk as u64;
        let (blocks, free, available) = match space {
            Some(space) => (space.total_bytes / chunk, space.free_bytes / chunk, space.available_bytes / chunk),
            None => (STATFS_BYTES / chunk, STATFS_BYTES / chunk / 2, STATFS_BYTES / chunk / 2),
        };
        // SAFETY: statfs is plain old data; all zeroes is a valid value.
        let mut s: libc::statfs = unsafe { std::mem::zeroed() };
        s.f_type = KURA_FS_MAGIC;
        s.f_bsize = self.chunk as _;
        s.f_frsize = self.chunk as _;
        s.f_blocks = blocks;
        s.f_bfree = free;
        s.f_bavail = available;
        // No inode table: as btrfs, report no inode counts when the room is known (`df -i`
        // shows none); an inode is a record in the same room as the data.
        s.f_files = if space.is_some() { 0 } else { STATFS_FILES };
        s.f_ffree = if space.is_some() { 0 } else { STATFS_FILES / 2 };
        s.f_namelen = crate::layout::NAME_BYTES_MAX as _;
        Ok(s)
    }
}

/// How long `statfs` answers from the pool's room as last looked up.
pub const STATFS_CACHE_MS: u64 = 1000;
/// `statfs` `f_type` of a kura file system ("kura" in ASCII).
pub const KURA_FS_MAGIC: libc::__fsword_t = 0x6b75_7261;
const STATFS_BYTES: u64 = 1 << 40;
const STATFS_FILES: u64 = 1 << 32;

/// Inside `rename`'s CAS: the target must still be what was checked before.
fn check_target(now: Option<&DirEntry>, checked: &Option<DirEntry>, flags: RenameFlags) -> Result<()> {
    match (now, checked) {
        (None, None) => Ok(()),
        (Some(_), None) if flags.noreplace => Err(FsError::Exists),
        (Some(n), Some(c)) if n.ino == c.ino => Ok(()),
        // Changed under us: the caller's checks no longer hold.
        _ => Err(FsError::Io(RENAME_RACE.into())),
    }
}

#[allow(dead_code)]
fn _assert_send_sync(fs: Arc<Fs>) -> impl Send + Sync {
    fs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode(mode: u32, uid: u32, gid: u32) -> Inode {
        Inode::new(9, mode, uid, gid, 0)
    }

    fn user(uid: u32, gid: u32) -> Cred {
        Cred { uid, gid, groups: vec![] }
    }

    #[test]
    fn access_follows_owner_group_other() {
        let f = inode(libc::S_IFREG | 0o640, 10, 20);
        assert_eq!(user(10, 1).check_access(&f, MAY_READ | MAY_WRITE), Ok(()));
        assert_eq!(user(11, 20).check_access(&f, MAY_READ), Ok(()));
        assert_eq!(user(11, 20).check_access(&f, MAY_WRITE), Err(FsError::Access));
        assert_eq!(Cred { uid: 11, gid: 1, groups: vec![20] }.check_access(&f, MAY_READ), Ok(()));
        assert_eq!(user(12, 1).check_access(&f, MAY_READ), Err(FsError::Access));
        // The owner class decides even when group or other would allow more.
        assert_eq!(user(10, 1).check_access(&inode(libc::S_IFREG | 0o077, 10, 1), MAY_READ), Err(FsError::Access));
        assert_eq!(user(0, 0).check_access(&f, MAY_WRITE), Ok(()));
        assert_eq!(user(0, 0).check_access(&f, MAY_EXEC), Err(FsError::Access));
        assert_eq!(user(0, 0).check_access(&inode(libc::S_IFDIR, 10, 20), MAY_EXEC), Ok(()));
    }

    #[test]
    fn delete_needs_write_on_the_directory_and_respects_sticky() {
        let dir = inode(libc::S_IFDIR | 0o1777, 0, 0);
        let theirs = inode(libc::S_IFREG | 0o666, 11, 11);
        assert_eq!(user(10, 10).check_delete(&dir, &theirs), Err(FsError::Perm));
        assert_eq!(user(11, 11).check_delete(&dir, &theirs), Ok(()));
        assert_eq!(user(0, 0).check_delete(&dir, &theirs), Ok(()));
        let closed = inode(libc::S_IFDIR | 0o755, 0, 0);
        assert_eq!(user(11, 11).check_delete(&closed, &theirs), Err(FsError::Access));
    }

    #[test]
    fn setattr_rules_of_linux() {
        let f = inode(libc::S_IFREG | 0o666, 10, 10);
        let chmod = SetAttr { mode: Some(0o600), ..SetAttr::default() };
        assert_eq!(user(11, 11).check_setattr(&f, chmod, false).unwrap_err(), FsError::Perm);
        assert!(user(10, 10).check_setattr(&f, chmod, false).is_ok());
        // Set-group-ID for a group the owner is not in is dropped, not refused.
        let sgid = SetAttr { mode: Some(0o2755), ..SetAttr::default() };
        let g = inode(libc::S_IFREG | 0o644, 10, 99);
        assert_eq!(user(10, 10).check_setattr(&g, sgid, false).unwrap().mode, Some(0o755));
        // chown: only root gives a file away; the owner may change the group to one of theirs.
        let give = SetAttr { uid: Some(11), ..SetAttr::default() };
        assert_eq!(user(10, 10).check_setattr(&f, give, false).unwrap_err(), FsError::Perm);
        assert!(user(0, 0).check_setattr(&f, give, false).is_ok());
        let chgrp = SetAttr { gid: Some(30), ..SetAttr::default() };
        assert_eq!(user(10, 10).check_setattr(&f, chgrp, false).unwrap_err(), FsError::Perm);
        assert!(Cred { uid: 10, gid: 10, groups: vec![30] }.check_setattr(&f, chgrp, false).is_ok());
        // Times: "now" needs write permission, a chosen time ownership.
        let times = SetAttr { atime_ns: Some(1), mtime_ns: Some(1), ..SetAttr::default() };
        assert!(user(11, 11).check_setattr(&f, times, true).is_ok());
        assert_eq!(user(11, 11).check_setattr(&f, times, false).unwrap_err(), FsError::Perm);
        let ro = inode(libc::S_IFREG | 0o644, 10, 10);
        assert_eq!(user(11, 11).check_setattr(&ro, times, true).unwrap_err(), FsError::Access);
        // truncate: write permission.
        let size = SetAttr { size: Some(0), ..SetAttr::default() };
        assert_eq!(user(11, 11).check_setattr(&ro, size, false).unwrap_err(), FsError::Access);
        assert!(user(10, 10).check_setattr(&ro, size, false).is_ok());
    }
}
