//! Path resolution inside the file system: components, `.` and `..`, symbolic links (relative,
//! absolute into the mount, or out of it), trailing slashes, `ELOOP`.

use crate::Fs;
use crate::error::{FsError, Result};
use crate::kv::Versioned;
use crate::layout::{Bucket, DirEntry, Inode, ROOT_INO, bucket_of, is_dir};
use crate::memo::{READ_AHEAD_KEYS_MAX, ReadAhead};
use crate::ns::{Cred, MAY_EXEC};

/// Symbolic links one resolution follows, at most (Linux's limit).
pub const SYMLINK_FOLLOWS_MAX: u32 = 40;
/// Times [`Fs::resolve_inode`] resolves a path again after the inode it named vanished
/// (another process unlinked or replaced it) before it gives up with `EIO`.
pub const RESOLVE_RETRIES_MAX: u32 = 1000;
/// PATH_MAX: a path string must be shorter (the count includes its terminating NUL).
pub const PATH_BYTES_MAX: usize = 4096;

/// Where a path leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// An existing file: its entry in `parent` (the root is its own parent, named "").
    Found { parent: u64, name: Vec<u8>, entry: DirEntry },
    /// The last component does not exist; its directory does. `name` ends in '/' when it
    /// came from a symbolic link whose target does (`l -> new/`): the walk asked for a
    /// directory there, which cannot be created through the link ([`Fs::resolve_for_create`]
    /// refuses it with EISDIR). (Only a walk that follows its last link gives one;
    /// [`Fs::resolve_parent`] never does.)
    Missing { parent: u64, name: Vec<u8> },
    /// The path leaves the file system (a symlink or `..` out of the mount): this absolute
    /// path is the kernel's to resolve.
    Outside(Vec<u8>),
}

impl Resolved {
    pub fn ino(&self) -> Option<u64> {
        match self {
            Resolved::Found { entry, .. } => Some(entry.ino),
            _ => None,
        }
    }
}

/// What a path's tail demands, and whose search permission the walk checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Follow<'a> {
    /// Follow a symlink in the last component.
    pub last: bool,
    /// Check that this caller may search (execute) every directory the walk looks a name up
    /// in (`EACCES`), as the kernel's path walk does. `None`: no check (root, or a caller such
    /// as FUSE whose kernel already checked).
    pub searcher: Option<&'a Cred>,
}

fn root_entry() -> DirEntry {
    DirEntry { name: Vec::new(), ino: ROOT_INO, dtype: libc::DT_DIR }
}

/// The last name of `path`, slashes after it ignored (`a/b//` -> `b`); `None` for the root
/// and the empty path.
pub fn last_name(path: &[u8]) -> Option<&[u8]> {
    path.split(|&b| b == b'/').rev().find(|c| !c.is_empty())
}

/// Whether the last name of `path` is `.` (`d/.`, `d/./`).
fn ends_in_dot(path: &[u8]) -> bool {
    last_name(path) == Some(b".".as_slice())
}

/// Puts `path`'s components on the walk's stack (`todo`, walked from its end), in front of
/// what is there: no empty ones, no `.`.
fn push_components(todo: &mut Vec<Vec<u8>>, path: &[u8]) {
    todo.extend(path.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").map(<[u8]>::to_vec).rev());
}

/// Ends a path that leaves the mount as the caller's did, for the kernel to see: `/.` after
/// a last `.`, else `/` when `slash`.
fn keep_tail(out: &mut Vec<u8>, dot_last: bool, slash: bool) {
    if dot_last {
        out.extend_from_slice(b"/.");
    } else if slash {
        out.push(b'/');
    }
}

/// Splits `mount`'s parent off, for `..` out of the root.
fn mount_parent(mount: &[u8]) -> &[u8] {
    match mount.iter().rposition(|&b| b == b'/') {
        Some(0) | None => b"/",
        Some(i) => &mount[..i],
    }
}

fn join_outside(base: &[u8], rest: &[Vec<u8>]) -> Vec<u8> {
    let mut out = base.to_vec();
    for c in rest {
        if out.last() != Some(&b'/') {
            out.push(b'/');
        }
        out.extend_from_slice(c);
    }
    out
}

/// Whether `path` is `mount` or inside it; returns the part after the mount (no leading '/').
pub fn strip_mount<'a>(path: &'a [u8], mount: &[u8]) -> Option<&'a [u8]> {
    let rest = path.strip_prefix(mount)?;
    if rest.is_empty() {
        return Some(rest);
    }
    rest.strip_prefix(b"/")
}

/// `path` without its trailing slashes (`/` stays).
pub fn trim_slashes(path: &[u8]) -> &[u8] {
    match path.iter().rposition(|&b| b != b'/') {
        Some(i) => &path[..=i],
        None => path,
    }
}

/// The directory a path's last name is in, as a path that must name a directory: `a/b/c` ->
/// `a/b/.`, `c` -> `.`, `d/..` -> `d/.`, `/x` and `/` -> `/.`.
pub fn parent_dir_of(path: &[u8]) -> Vec<u8> {
    let trimmed = trim_slashes(path);
    let mut out = match trimmed.iter().rposition(|&b| b == b'/') {
        Some(i) => trimmed[..=i].to_vec(),
        None => b"./".to_vec(),
    };
    out.push(b'.');
    out
}

/// The part of absolute `path` after the point where it enters `mount`, as the caller wrote
/// it. The host's part is taken lexically (`/tmp/../kura/f` enters at `kura`); what follows
/// is left to [`Fs::resolve`], which follows kura's symbolic links before a `..`
/// and fails `f/.` on a file, as the kernel's walk does (`/kura/l/..` with `l` a link to
/// `a/b` is `/kura/a`, not `/kura`). `None`: the path never enters the mount.
pub fn rel_in_mount(path: &[u8], mount: &[u8]) -> Option<Vec<u8>> {
    let want: Vec<&[u8]> = mount.split(|&b| b == b'/').filter(|c| !c.is_empty()).collect();
    let mut parts: Vec<&[u8]> = Vec::new();
    let mut at = 0;
    for c in path.split(|&b| b == b'/') {
        at += c.len() + 1;
        match c {
            b"" | b"." => continue,
            b".." => {
                parts.pop();
                continue;
            }
            c => parts.push(c),
        }
        if parts == want {
            let rest = path.get(at..).unwrap_or(b"");
            let start = rest.iter().position(|&b| b != b'/').unwrap_or(rest.len());
            return Some(rest[start..].to_vec());
        }
    }
    None
}

/// The kernel's length check of a path string, made before it resolves anything: a path of
/// `PATH_MAX` bytes or more (with its NUL, more than `PATH_MAX`) is `ENAMETOOLONG`. The preload
/// must apply it to the path as the caller gave it, before joining it to a working directory or
/// normalising it.
pub fn check_path_len(path: &[u8]) -> Result<()> {
    if path.len() >= PATH_BYTES_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

/// What an operation does with the last component of its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameOp {
    /// `mkdir`, `mknod`, `mkfifo`, `symlink`, `link`'s new name.
    Create,
    Unlink,
    Rmdir,
    /// Either name of `rename`.
    Rename,
}

/// Refuses `.`, `..` or nothing (the root) as the entry an operation creates, removes or
/// renames, with the errno Linux gives (`fs/namei.c`: the last component is not a normal
/// name). Lexical: it must see the caller's path before `.` and `..` are normalised away, or
/// `rmdir("d/.")` removes `d`.
pub fn check_last_component(path: &[u8], op: NameOp) -> Result<()> {
    let last = last_name(path);
    let errno_of = |is_dot: bool| match op {
        NameOp::Create => FsError::Exists,
        NameOp::Unlink => FsError::IsDir,
        NameOp::Rmdir if is_dot => FsError::Invalid,
        NameOp::Rmdir => FsError::NotEmpty,
        NameOp::Rename => FsError::Busy,
    };
    match last {
        Some(b".") => Err(errno_of(true)),
        Some(b"..") => Err(errno_of(false)),
        Some(_) => Ok(()),
        // "/" or "": the root itself.
        None if path.is_empty() => Ok(()),
        None => Err(match op {
            NameOp::Rmdir | NameOp::Rename => FsError::Busy,
            NameOp::Create => FsError::Exists,
            NameOp::Unlink => FsError::IsDir,
        }),
    }
}

impl Fs {
    /// Resolves `path` (relative: to directory `start`; absolute paths are the caller's to
    /// strip of the mount prefix first) with `mount` the prefix for absolute symlink targets.
    pub fn resolve(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<Resolved> {
        self.walk(start, path, follow, mount, Plan::of(follow, path, false, false)).map(|(resolved, _)| resolved)
    }

    /// [`Fs::resolve`] and the inode the path names (with `Found`, and only with it; as
    /// [`Fs::getattr`] returns it). A path this process walked before costs one round trip in
    /// all (see [`crate::memo`]). Another process may replace or remove the name between the
    /// lookup and the read of its inode (a rename over it drops the old inode): the path is
    /// then resolved again, so that a reader sees the old file or the new one, never `ENOENT`
    /// for a name that always existed.
    pub fn resolve_inode(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<(Resolved, Option<Inode>)> {
        self.resolve_inode_as(start, path, follow, mount, false)
    }

    /// [`Fs::resolve_inode`] for a change to the path's last name (a create, a removal, a
    /// rename): the walk also reads the inode of the last directory, in the same round trip,
    /// for the permission checks and the change that follow (see [`Fs::getattr_fresh`]).
    pub fn resolve_for_change(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<(Resolved, Option<Inode>)> {
        self.resolve_inode_as(start, path, follow, mount, true)
    }

    /// [`Fs::resolve_for_change`] for `open(O_CREAT)`: as the kernel's `open_last_lookups`, a
    /// last name that a followed link's target ends in '/' is EISDIR before it is looked up
    /// (`l -> a/` with `a` a file, or a link that loops, is EISDIR, not ENOTDIR or ELOOP).
    pub fn resolve_for_create(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<(Resolved, Option<Inode>)> {
        let plan = Plan { create: true, ..Plan::of(follow, path, true, true) };
        self.resolve_inode_planned(start, path, follow, mount, plan, None)
    }

    /// [`Fs::resolve`] for a new name (`mkdir`, `symlink`, `link`, `mknod`): the walk also
    /// reads the inode of the last directory, as [`Fs::resolve_for_change`] does, and not the
    /// inode of an existing last name.
    /// As the kernel's `filename_create`, a trailing slash neither follows a symbolic link
    /// there nor asks for a directory: an existing name is `Found` (EEXIST) whatever it is; a
    /// missing one is for the caller to allow (`mkdir`) or refuse (ENOENT).
    pub fn resolve_parent(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<Resolved> {
        let path = trim_slashes(path);
        self.walk(start, path, follow, mount, Plan::of(follow, path, false, true)).map(|(resolved, _)| resolved)
    }

    /// [`Fs::resolve_inode`] from the root, with the physical path of what it found (as
    /// [`Fs::resolve_physical`] gives it) in `names`.
    pub fn resolve_inode_physical(&self, path: &[u8], follow: Follow, mount: &[u8], names: &mut Vec<Vec<u8>>) -> Result<(Resolved, Option<Inode>)> {
        self.resolve_inode_tracking(ROOT_INO, path, follow, mount, false, Some(names))
    }

    fn resolve_inode_as(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8], want_parent: bool) -> Result<(Resolved, Option<Inode>)> {
        self.resolve_inode_tracking(start, path, follow, mount, want_parent, None)
    }

    fn resolve_inode_tracking(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8], want_parent: bool, names: Option<&mut Vec<Vec<u8>>>) -> Result<(Resolved, Option<Inode>)> {
        self.resolve_inode_planned(start, path, follow, mount, Plan::of(follow, path, true, want_parent), names)
    }

    fn resolve_inode_planned(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8], plan: Plan, mut names: Option<&mut Vec<Vec<u8>>>) -> Result<(Resolved, Option<Inode>)> {
        for _ in 0..RESOLVE_RETRIES_MAX {
            if let Some(names) = names.as_deref_mut() {
                names.clear();
            }
            match self.walk_tracking(start, path, follow, mount, plan, names.as_deref_mut())? {
                (resolved @ Resolved::Found { .. }, Some(None)) => tracing::trace!(?resolved, "inode gone after its lookup; resolving again"),
                (resolved, inode) => return Ok((resolved, inode.flatten())),
            }
        }
        Err(FsError::Io(format!("{}: the name keeps naming removed inodes", String::from_utf8_lossy(path))))
    }

    /// Resolves `path`, and with `plan.want_inode` reads the inode it names: `Some(None)` when
    /// that inode is gone.
    fn walk(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8], plan: Plan) -> Result<(Resolved, Option<Option<Inode>>)> {
        self.walk_tracking(start, path, follow, mount, plan, None)
    }

    /// [`Fs::resolve`] from the root, with the physical path of what the walk found (or of the
    /// directory a missing last name would be in): the names walked from the root, symbolic
    /// links followed and `..` taken as the directory's parent, as `getcwd` reports a
    /// directory after `chdir`. Components, without the mount prefix; none for the root.
    pub fn resolve_physical(&self, path: &[u8], follow: Follow, mount: &[u8]) -> Result<(Resolved, Vec<Vec<u8>>)> {
        let mut names = Vec::new();
        let (resolved, _) = self.walk_tracking(ROOT_INO, path, follow, mount, Plan::of(follow, path, false, false), Some(&mut names))?;
        Ok((resolved, names))
    }

    /// The walk; with `phys`, the names from the root to the current directory are kept there
    /// (`start` must then be the root).
    fn walk_tracking(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8], plan: Plan, mut phys: Option<&mut Vec<Vec<u8>>>) -> Result<(Resolved, Option<Option<Inode>>)> {
        debug_assert!(phys.is_none() || start == ROOT_INO);
        check_path_len(path)?;
        // `d/.` names `d` as `d/` does: it must be a directory, and a symlink there is followed.
        let mut dot_last = ends_in_dot(path);
        let mut trailing_slash = path.ends_with(b"/") || dot_last;
        // The last name came from a link's target ending in '/' (see `Resolved::Missing`).
        let mut link_slash = false;
        // Components still to walk, in reverse (a stack, so symlink targets splice in front).
        let mut todo: Vec<Vec<u8>> = Vec::new();
        push_components(&mut todo, path);
        let mut ahead = ReadAhead::default();
        let mut dir = start;
        let mut current = if start == ROOT_INO {
            root_entry()
        } else {
            let key = self.keys.inode(start);
            let record = self.take_ahead(&mut ahead, &key, || self.predict(Some(start), start, &todo, plan))?;
            self.dir_entry_of(&key, start, record)?
        };
        let mut parent = dir;
        let mut name = Vec::new();
        let mut follows = 0;
        while let Some(component) = todo.pop() {
            if !is_dir_type(&current) {
                return Err(FsError::NotDir);
            }
            dir = current.ino;
            if component == b".." {
                if dir == ROOT_INO {
                    let mut rest: Vec<Vec<u8>> = todo.iter().rev().cloned().collect();
                    rest.retain(|c| !c.is_empty());
                    let mut out = join_outside(mount_parent(mount), &rest);
                    // `/kura/../kura/f`: out of the root and back in (with at least the mount's
                    // last name fewer to walk).
                    if let Some(inside) = strip_mount(&out, mount) {
                        ahead.clear();
                        todo.clear();
                        push_components(&mut todo, inside);
                        (current, parent) = (root_entry(), ROOT_INO);
                        name.clear();
                        phys.as_deref_mut().map(Vec::clear);
                        continue;
                    }
                    keep_tail(&mut out, dot_last, trailing_slash && !rest.is_empty());
                    return Ok((Resolved::Outside(out), None));
                }
                ahead.clear();
                let (inode, _) = self.load_inode(dir)?;
                if let Some(cred) = follow.searcher {
                    cred.check_access(&inode, MAY_EXEC)?;
                }
                let up = inode.parent;
                current = self.entry_of_dir(up)?;
                parent = current.ino;
                name.clear();
                if let Some(phys) = phys.as_deref_mut() {
                    phys.pop();
                }
                continue;
            }
            if component.len() > crate::layout::NAME_BYTES_MAX {
                return Err(FsError::NameTooLong);
            }
            let is_last = todo.is_empty();
            // Not after `/.` (the kernel's last name is then the dot: `l/.` follows `l` whole).
            if is_last && link_slash && plan.create && !dot_last {
                return Err(FsError::IsDir);
            }
            let found = self.lookup_ahead(&mut ahead, dir, &component, &todo, follow.searcher, plan)?;
            let Some(entry) = found else {
                if is_last && !dot_last {
                    let mut name = component;
                    if link_slash {
                        name.push(b'/');
                    }
                    return Ok((Resolved::Missing { parent: dir, name }, None));
                }
                return Err(FsError::NotFound);
            };
            if entry.dtype == libc::DT_LNK && (!is_last || follow.last || trailing_slash) {
                follows += 1;
                if follows > SYMLINK_FOLLOWS_MAX {
                    return Err(FsError::Loop);
                }
                ahead.clear();
                let target = self.readlink(entry.ino)?;
                // A target's own `/` or `/.` at the end applies to the walk's last name.
                if is_last && ends_in_dot(&target) {
                    (dot_last, trailing_slash) = (true, true);
                } else if is_last && target.ends_with(b"/") {
                    (trailing_slash, link_slash) = (true, true);
                }
                if target.first() == Some(&b'/') {
                    let rest: Vec<Vec<u8>> = todo.iter().rev().cloned().collect();
                    match strip_mount(&target, mount) {
                        Some(inside) => {
                            push_components(&mut todo, inside);
                            (current, parent) = (root_entry(), ROOT_INO);
                            name.clear();
                            phys.as_deref_mut().map(Vec::clear);
                            continue;
                        }
                        None => {
                            let mut out = join_outside(&target, &rest);
                            keep_tail(&mut out, dot_last, trailing_slash && !rest.is_empty());
                            return Ok((Resolved::Outside(out), None));
                        }
                    }
                }
                push_components(&mut todo, &target);
                // Stay in `dir`: the target is relative to the link's directory.
                current = self.entry_of_dir(dir)?;
                continue;
            }
            parent = dir;
            if let Some(phys) = phys.as_deref_mut() {
                // The walk goes on from `entry` only if it is a directory; a last name that is
                // not one is the end.
                phys.push(component.clone());
            }
            name = component;
            current = entry;
        }
        if trailing_slash && !is_dir_type(&current) {
            return Err(FsError::NotDir);
        }
        let inode = if plan.want_inode { Some(self.inode_ahead(&mut ahead, current.ino)?) } else { None };
        Ok((Resolved::Found { parent, name, entry: current }, inode))
    }

    /// The record of `key`: the next one read ahead, or else read now together with the
    /// records `predict` names (which start with `key`).
    fn take_ahead(&self, ahead: &mut ReadAhead, key: &[u8], predict: impl FnOnce() -> Vec<Vec<u8>>) -> Result<Versioned> {
        if let Some(record) = ahead.take(key) {
            return Ok(record);
        }
        let keys = predict();
        debug_assert_eq!(keys.first().map(Vec::as_slice), Some(key));
        let records = self.kv.get_versioned_in_order(&keys)?;
        if records.len() != keys.len() {
            return Err(FsError::Io("a batched get returned too few values".into()));
        }
        ahead.load(keys, records);
        ahead.take(key).ok_or_else(|| FsError::Io("a read-ahead lost its first record".into()))
    }

    /// The records a walk will read from here if the names it is about to look up still lead
    /// where they did: `lead`'s inode first (the start directory, checked to be one), then for
    /// each component its directory's inode (with a search check, or for the last one with
    /// `plan.want_parent`) and the bucket holding the name, and the inode of the last one.
    /// Stops at the first name this process has not seen, at `..`, and at anything but a
    /// directory before the last component.
    fn predict(&self, lead: Option<u64>, dir: u64, todo: &[Vec<u8>], plan: Plan) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        if let Some(ino) = lead {
            keys.push(self.keys.inode(ino));
        }
        let mut dir = dir;
        let mut names = todo.iter().rev().peekable();
        while let Some(name) = names.next() {
            if name == b".." || name.len() > crate::layout::NAME_BYTES_MAX || keys.len() + 3 > READ_AHEAD_KEYS_MAX {
                break;
            }
            if plan.searcher || (plan.want_parent && names.peek().is_none()) {
                keys.push(self.keys.inode(dir));
            }
            keys.push(self.keys.bucket(dir, bucket_of(name)));
            let Some((ino, dtype)) = self.memo.get(dir, name) else { break };
            if names.peek().is_none() {
                if plan.want_inode && !(dtype == libc::DT_LNK && plan.last_follows) {
                    keys.push(self.keys.inode(ino));
                }
                break;
            }
            if dtype != libc::DT_DIR {
                break;
            }
            dir = ino;
        }
        keys
    }

    /// The entry `name` of `dir` and the inode it names (`None` inside: that inode is gone),
    /// read together when this process has seen the name.
    pub(crate) fn lookup_read_ahead(&self, dir: u64, name: &[u8]) -> Result<Option<(DirEntry, Option<Inode>)>> {
        if name.len() > crate::layout::NAME_BYTES_MAX {
            return Err(FsError::NameTooLong);
        }
        let mut ahead = ReadAhead::default();
        let plan = Plan { searcher: false, last_follows: false, want_inode: true, want_parent: false, create: false };
        let Some(entry) = self.lookup_ahead(&mut ahead, dir, name, &[], None, plan)? else { return Ok(None) };
        let inode = self.inode_ahead(&mut ahead, entry.ino)?;
        Ok(Some((entry, inode)))
    }

    /// Inode `ino` as [`Fs::getattr`] returns it, the next record read ahead or read now
    /// (`None`: it is gone).
    fn inode_ahead(&self, ahead: &mut ReadAhead, ino: u64) -> Result<Option<Inode>> {
        let key = self.keys.inode(ino);
        let record = match ahead.take(&key) {
            Some(record) => record,
            None => self.kv.get_versioned(&key)?,
        };
        Ok(self.decode_inode(&key, record)?.map(|(mut inode, _)| {
            self.overlay_local(&mut inode);
            inode
        }))
    }

    /// Looks `name` up in `dir` (checking `searcher` may search it) through the records read
    /// ahead, reading ahead again when the next one is not the one needed; `rest` is the walk's
    /// stack of components after `name`.
    fn lookup_ahead(&self, ahead: &mut ReadAhead, dir: u64, name: &[u8], rest: &[Vec<u8>], searcher: Option<&Cred>, plan: Plan) -> Result<Option<DirEntry>> {
        let predict = || {
            let mut todo = rest.to_vec();
            todo.push(name.to_vec());
            self.predict(None, dir, &todo, plan)
        };
        // The directory's inode comes first when predicted (see `predict`).
        let dir_inode_first = searcher.is_some() || (plan.want_parent && rest.is_empty());
        if dir_inode_first {
            let key = self.keys.inode(dir);
            let record = self.take_ahead(ahead, &key, predict)?;
            let inode = self.decode_inode(&key, record)?;
            if let Some(cred) = searcher {
                let (inode, _) = inode.ok_or(FsError::NotFound)?;
                cred.check_access(&inode, MAY_EXEC)?;
            }
        }
        let bucket = bucket_of(name);
        let key = self.keys.bucket(dir, bucket);
        let record = self.take_ahead(ahead, &key, || {
            let mut keys = predict();
            if dir_inode_first {
                // Only when the directory's inode was taken but its bucket was not next.
                keys.remove(0);
            }
            keys
        })?;
        let entry = match &record {
            Some((bytes, _)) => Bucket::decode(&key, bytes)?.find(name).cloned(),
            None => None,
        };
        self.remember_bucket(dir, bucket, record);
        self.memo.note(dir, name, entry.as_ref());
        Ok(entry)
    }

    /// A directory's own entry (for walking from it), checked to be a live directory.
    fn entry_of_dir(&self, ino: u64) -> Result<DirEntry> {
        if ino == ROOT_INO {
            return Ok(root_entry());
        }
        let key = self.keys.inode(ino);
        self.dir_entry_of(&key, ino, self.kv.get_versioned(&key)?)
    }

    /// [`Fs::entry_of_dir`] from the directory's inode record as read.
    fn dir_entry_of(&self, key: &[u8], ino: u64, record: Versioned) -> Result<DirEntry> {
        let (inode, _) = self.decode_inode(key, record)?.ok_or(FsError::NotFound)?;
        if !is_dir(inode.mode) {
            return Err(FsError::NotDir);
        }
        Ok(DirEntry { name: Vec::new(), ino, dtype: libc::DT_DIR })
    }
}

/// What a walk reads besides the names' buckets.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Each directory's inode, for the search permission check.
    searcher: bool,
    /// A symbolic link as the last component is followed.
    last_follows: bool,
    /// The last component's inode.
    want_inode: bool,
    /// The inode of the last component's directory.
    want_parent: bool,
    /// For `open(O_CREAT)` (see [`Fs::resolve_for_create`]).
    create: bool,
}

impl Plan {
    /// What a walk of `path` under `follow` reads, with the last inode and its directory's.
    fn of(follow: Follow, path: &[u8], want_inode: bool, want_parent: bool) -> Self {
        Self { searcher: follow.searcher.is_some(), last_follows: follow.last || path.ends_with(b"/"), want_inode, want_parent, create: false }
    }
}

fn is_dir_type(e: &DirEntry) -> bool {
    e.dtype == libc::DT_DIR
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_prefixes() {
        assert_eq!(strip_mount(b"/kura/a/b", b"/kura"), Some(&b"a/b"[..]));
        assert_eq!(strip_mount(b"/kura", b"/kura"), Some(&b""[..]));
        assert_eq!(strip_mount(b"/kurax", b"/kura"), None);
        assert_eq!(mount_parent(b"/kura"), b"/");
        assert_eq!(mount_parent(b"/mnt/kura"), b"/mnt");
        assert_eq!(join_outside(b"/", &[b"etc".to_vec(), b"passwd".to_vec()]), b"/etc/passwd");
    }

    #[test]
    fn where_a_path_enters_the_mount() {
        let rel = |p: &[u8]| rel_in_mount(p, b"/kura").map(|r| String::from_utf8(r).unwrap());
        assert_eq!(rel(b"/kura/a/b"), Some("a/b".into()));
        assert_eq!(rel(b"/kura"), Some("".into()));
        assert_eq!(rel(b"/kura/"), Some("".into()));
        assert_eq!(rel(b"//kura//a/"), Some("a/".into()));
        // What follows the entry is the walk's, as written: links before `..` are kura's.
        assert_eq!(rel(b"/kura/l/../x/."), Some("l/../x/.".into()));
        assert_eq!(rel(b"/kura/../etc"), Some("../etc".into()));
        // The host's part is lexical.
        assert_eq!(rel(b"/tmp/../kura/f"), Some("f".into()));
        assert_eq!(rel(b"/./kura/./f"), Some("./f".into()));
        assert_eq!(rel(b"/kurax/f"), None);
        assert_eq!(rel(b"/tmp/kura/f"), None);
        assert_eq!(rel(b"/"), None);
        assert_eq!(rel_in_mount(b"/mnt/k/x", b"/mnt/k").as_deref(), Some(&b"x"[..]));
        assert_eq!(rel_in_mount(b"/mnt/x/../k", b"/mnt/k").as_deref(), Some(&b""[..]));
    }

    #[test]
    fn parents_and_slashes() {
        assert_eq!(parent_dir_of(b"a/b/c"), b"a/b/.");
        assert_eq!(parent_dir_of(b"c"), b"./.");
        assert_eq!(parent_dir_of(b"d/.."), b"d/.");
        assert_eq!(parent_dir_of(b"d/x//"), b"d/.");
        assert_eq!(parent_dir_of(b"/x"), b"/.");
        assert_eq!(parent_dir_of(b"/"), b"/.");
        assert_eq!(parent_dir_of(b""), b"./.");
        assert_eq!(trim_slashes(b"a/b//"), b"a/b");
        assert_eq!(trim_slashes(b"/"), b"/");
        assert_eq!(trim_slashes(b"a"), b"a");
        assert_eq!(last_name(b"a/b//"), Some(&b"b"[..]));
        assert_eq!(last_name(b"/"), None);
        assert_eq!(last_name(b"d/."), Some(&b"."[..]));
    }

    #[test]
    fn path_length_counts_the_nul() {
        assert_eq!(check_path_len(&[b'a'; PATH_BYTES_MAX - 1]), Ok(()));
        assert_eq!(check_path_len(&[b'a'; PATH_BYTES_MAX]), Err(FsError::NameTooLong));
    }

    #[test]
    fn dot_and_dotdot_are_refused_as_linux_does() {
        use NameOp::*;
        assert_eq!(check_last_component(b"/kura/d/.", Rmdir), Err(FsError::Invalid));
        assert_eq!(check_last_component(b"d/..", Rmdir), Err(FsError::NotEmpty));
        assert_eq!(check_last_component(b"d/./", Rename), Err(FsError::Busy));
        assert_eq!(check_last_component(b"..", Unlink), Err(FsError::IsDir));
        assert_eq!(check_last_component(b"d/.", Create), Err(FsError::Exists));
        assert_eq!(check_last_component(b"/", Rmdir), Err(FsError::Busy));
        assert_eq!(check_last_component(b"d/.x", Rmdir), Ok(()));
        assert_eq!(check_last_component(b"./d/", Rename), Ok(()));
        assert_eq!(check_last_component(b"../d", Unlink), Ok(()));
    }
}
