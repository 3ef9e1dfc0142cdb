//! Path resolution inside the file system: components, `.` and `..`, symbolic links (relative,
//! absolute into the mount, or out of it), trailing slashes, `ELOOP`.

use crate::Fs;
use crate::error::{FsError, Result};
use crate::layout::{DirEntry, ROOT_INO, is_dir};

/// Symbolic links one resolution follows, at most (Linux's limit).
pub const SYMLINK_FOLLOWS_MAX: u32 = 40;
/// Longest path accepted (PATH_MAX).
pub const PATH_BYTES_MAX: usize = 4096;

/// Where a path leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// An existing file: its entry in `parent` (the root is its own parent, named "").
    Found { parent: u64, name: Vec<u8>, entry: DirEntry },
    /// The last component does not exist; its directory does.
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

/// What a path's tail demands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Follow {
    /// Follow a symlink in the last component.
    pub last: bool,
}

fn root_entry() -> DirEntry {
    DirEntry { name: Vec::new(), ino: ROOT_INO, dtype: libc::DT_DIR }
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

impl Fs {
    /// Resolves `path` (relative: to directory `start`; absolute paths are the caller's to
    /// strip of the mount prefix first) with `mount` the prefix for absolute symlink targets.
    pub fn resolve(&self, start: u64, path: &[u8], follow: Follow, mount: &[u8]) -> Result<Resolved> {
        if path.len() > PATH_BYTES_MAX {
            return Err(FsError::NameTooLong);
        }
        let trailing_slash = path.ends_with(b"/");
        // Components still to walk, in reverse (a stack, so symlink targets splice in front).
        let mut todo: Vec<Vec<u8>> = path.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").map(<[u8]>::to_vec).rev().collect();
        let mut dir = start;
        let mut current = if start == ROOT_INO { root_entry() } else { self.entry_of_dir(start)? };
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
                    let mut rest: Vec<Vec<u8>> = todo.into_iter().rev().collect();
                    rest.retain(|c| !c.is_empty());
                    return Ok(Resolved::Outside(join_outside(mount_parent(mount), &rest)));
                }
                let up = self.load_inode(dir)?.0.parent;
                current = self.entry_of_dir(up)?;
                parent = current.ino;
                name.clear();
                continue;
            }
            if component.len() > crate::layout::NAME_BYTES_MAX {
                return Err(FsError::NameTooLong);
            }
            let is_last = todo.is_empty();
            let Some(entry) = self.lookup(dir, &component)? else {
                if is_last {
                    return Ok(Resolved::Missing { parent: dir, name: component });
                }
                return Err(FsError::NotFound);
            };
            if entry.dtype == libc::DT_LNK && (!is_last || follow.last || trailing_slash) {
                follows += 1;
                if follows > SYMLINK_FOLLOWS_MAX {
                    return Err(FsError::Loop);
                }
                let target = self.readlink(entry.ino)?;
                if target.first() == Some(&b'/') {
                    let rest: Vec<Vec<u8>> = todo.iter().rev().cloned().collect();
                    match strip_mount(&target, mount) {
                        Some(inside) => {
                            todo.extend(inside.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").map(<[u8]>::to_vec).rev());
                            current = root_entry();
                            parent = ROOT_INO;
                            name.clear();
                            continue;
                        }
                        None => {
                            let mut out = join_outside(&target, &rest);
                            if trailing_slash && !rest.is_empty() {
                                out.push(b'/');
                            }
                            return Ok(Resolved::Outside(out));
                        }
                    }
                }
                todo.extend(target.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").map(<[u8]>::to_vec).rev());
                // Stay in `dir`: the target is relative to the link's directory.
                current = self.entry_of_dir(dir)?;
                continue;
            }
            parent = dir;
            name = component;
            current = entry;
        }
        if trailing_slash && !is_dir_type(&current) {
            return Err(FsError::NotDir);
        }
        Ok(Resolved::Found { parent, name, entry: current })
    }

    /// A directory's own entry (for walking from it), checked to be a live directory.
    fn entry_of_dir(&self, ino: u64) -> Result<DirEntry> {
        if ino == ROOT_INO {
            return Ok(root_entry());
        }
        let (inode, _) = self.load_inode(ino)?;
        if !is_dir(inode.mode) {
            return Err(FsError::NotDir);
        }
        Ok(DirEntry { name: Vec::new(), ino, dtype: libc::DT_DIR })
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
}
