//! Extended attributes (`getxattr`, `setxattr`, `listxattr`, `removexattr`), kept in the inode
//! record (see [`Inode::xattrs`]): a change is one compare-and-swap of the record, so it is
//! atomic and shared by every process at once, and reading them costs nothing more than the
//! inode. Namespaces `user.`, `trusted.` and `security.`, with Linux's rules
//! (`fs/xattr.c` `xattr_permission`, `cap_inode_setxattr`) for a caller without capabilities
//! beyond root. `system.` (POSIX ACLs): kura has none, and says so as a Linux file system
//! without ACL support does (ext4 mounted `noacl`, FUSE without `FUSE_POSIX_ACL`): reading or
//! setting one is `EOPNOTSUPP`. `ls -l`, `cp -a` and `tar --acls` take that as "no ACLs here";
//! `ls` then stops asking for the rest of the file system's files (one round trip per file
//! fewer: `ENODATA` would be asked again for every file).

use crate::error::{FsError, Result};
use crate::layout::{Inode, XATTR_NAME_BYTES_MAX, XATTR_VALUE_BYTES_MAX, XATTRS_BYTES_MAX, file_type};
use crate::ns::{Cred, MAY_READ, MAY_WRITE, now_ns};
use crate::Fs;

/// `setxattr` flags (`XATTR_CREATE`, `XATTR_REPLACE`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XattrFlags {
    /// Fail with `EEXIST` if the attribute exists.
    pub create: bool,
    /// Fail with `ENODATA` unless the attribute exists.
    pub replace: bool,
}

impl XattrFlags {
    /// From `setxattr(2)`'s flags; `EINVAL` for unknown bits.
    pub fn from_bits(flags: i32) -> Result<Self> {
        if flags & !(libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            return Err(FsError::Invalid);
        }
        Ok(Self { create: flags & libc::XATTR_CREATE != 0, replace: flags & libc::XATTR_REPLACE != 0 })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Namespace {
    User,
    Trusted,
    Security,
    System,
}

/// The namespace of an attribute name: `EOPNOTSUPP` for unknown prefixes, `EINVAL` for a bare
/// prefix, `ERANGE` for a name over [`XATTR_NAME_BYTES_MAX`].
fn namespace(name: &[u8]) -> Result<Namespace> {
    if name.len() > XATTR_NAME_BYTES_MAX {
        return Err(FsError::Range);
    }
    let (ns, rest) = if let Some(rest) = name.strip_prefix(b"user.") {
        (Namespace::User, rest)
    } else if let Some(rest) = name.strip_prefix(b"trusted.") {
        (Namespace::Trusted, rest)
    } else if let Some(rest) = name.strip_prefix(b"security.") {
        (Namespace::Security, rest)
    } else if let Some(rest) = name.strip_prefix(b"system.") {
        (Namespace::System, rest)
    } else {
        return Err(FsError::NotSupported);
    };
    if rest.is_empty() {
        return Err(FsError::Invalid);
    }
    Ok(ns)
}

/// May `cred` (`None`: checked already, by the kernel through FUSE, or root) read (`write`
/// false) or change an attribute of namespace `ns` on `inode`? Linux's `xattr_permission`.
fn check(cred: Option<&Cred>, inode: &Inode, ns: Namespace, write: bool) -> Result<()> {
    let kind = file_type(inode.mode);
    // user. attributes belong to regular files and directories only, for root too.
    if ns == Namespace::User && kind != libc::S_IFREG && kind != libc::S_IFDIR {
        return Err(if write { FsError::Perm } else { FsError::NoAttr });
    }
    let Some(cred) = cred.filter(|c| !c.is_root()) else {
        return Ok(());
    };
    match ns {
        // Invisible to a caller without CAP_SYS_ADMIN.
        Namespace::Trusted => Err(if write { FsError::Perm } else { FsError::NoAttr }),
        Namespace::Security if write => Err(FsError::Perm),
        Namespace::Security | Namespace::System => Ok(()),
        Namespace::User => {
            if write && kind == libc::S_IFDIR && inode.mode & libc::S_ISVTX != 0 && cred.uid != inode.uid {
                return Err(FsError::Perm);
            }
            cred.check_access(inode, if write { MAY_WRITE } else { MAY_READ })
        }
    }
}

impl Fs {
    /// The value of attribute `name` of `ino` (`ENODATA` when it has none).
    pub fn getxattr(&self, ino: u64, name: &[u8], cred: Option<&Cred>) -> Result<Vec<u8>> {
        if namespace(name)? == Namespace::System {
            return Err(FsError::NotSupported);
        }
        getxattr_of(&self.getattr(ino)?, name, cred)
    }

    /// The names of `ino`'s attributes that `cred` may see, each followed by a NUL (the list
    /// `listxattr(2)` returns).
    pub fn listxattr(&self, ino: u64, cred: Option<&Cred>) -> Result<Vec<u8>> {
        Ok(listxattr_of(&self.getattr(ino)?, cred))
    }

    /// Sets attribute `name` of `ino` to `value` (`flags`: create only, replace only). The
    /// inode's change time moves, as on Linux.
    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: XattrFlags, cred: Option<&Cred>) -> Result<()> {
        let ns = namespace(name)?;
        if ns == Namespace::System {
            return Err(FsError::NotSupported);
        }
        if value.len() > XATTR_VALUE_BYTES_MAX {
            return Err(FsError::ArgTooBig);
        }
        let now = now_ns();
        self.update_inode(ino, |inode| {
            check(cred, inode, ns, true)?;
            let found = inode.xattrs.iter().position(|(n, _)| n == name);
            let old_bytes = found.map_or(0, |i| name.len() + inode.xattrs[i].1.len());
            match found {
                Some(_) if flags.create => return Err(FsError::Exists),
                None if flags.replace => return Err(FsError::NoAttr),
                None if inode.xattrs.len() >= usize::from(u16::MAX) => return Err(FsError::NoSpace),
                _ => {}
            }
            if inode.xattr_bytes() - old_bytes + name.len() + value.len() > XATTRS_BYTES_MAX {
                return Err(FsError::NoSpace);
            }
            match found {
                Some(i) => inode.xattrs[i].1 = value.to_vec(),
                None => inode.xattrs.push((name.to_vec(), value.to_vec())),
            }
            inode.ctime_ns = now;
            Ok(())
        })?;
        Ok(())
    }

    /// Removes attribute `name` of `ino` (`ENODATA` when it has none).
    pub fn removexattr(&self, ino: u64, name: &[u8], cred: Option<&Cred>) -> Result<()> {
        let ns = namespace(name)?;
        if ns == Namespace::System {
            return Err(FsError::NotSupported);
        }
        let now = now_ns();
        self.update_inode(ino, |inode| {
            check(cred, inode, ns, true)?;
            let i = inode.xattrs.iter().position(|(n, _)| n == name).ok_or(FsError::NoAttr)?;
            inode.xattrs.remove(i);
            inode.ctime_ns = now;
            Ok(())
        })?;
        Ok(())
    }
}

/// [`Fs::getxattr`] of an inode already read.
pub fn getxattr_of(inode: &Inode, name: &[u8], cred: Option<&Cred>) -> Result<Vec<u8>> {
    let ns = namespace(name)?;
    if ns == Namespace::System {
        return Err(FsError::NotSupported);
    }
    check(cred, inode, ns, false)?;
    inode.xattrs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).ok_or(FsError::NoAttr)
}

/// [`Fs::listxattr`] of an inode already read.
pub fn listxattr_of(inode: &Inode, cred: Option<&Cred>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, _) in &inode.xattrs {
        if namespace(name).is_ok_and(|ns| check(cred, inode, ns, false).is_ok()) {
            out.extend_from_slice(name);
            out.push(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_as_linux_resolves_them() {
        assert_eq!(namespace(b"user.a"), Ok(Namespace::User));
        assert_eq!(namespace(b"trusted.overlay.opaque"), Ok(Namespace::Trusted));
        assert_eq!(namespace(b"security.selinux"), Ok(Namespace::Security));
        assert_eq!(namespace(b"system.posix_acl_access"), Ok(Namespace::System));
        assert_eq!(namespace(b"nonamespace"), Err(FsError::NotSupported));
        assert_eq!(namespace(b"user."), Err(FsError::Invalid));
        let long = [b"user.".as_slice(), &[b'x'; 251]].concat();
        assert_eq!(namespace(&long), Err(FsError::Range));
        assert_eq!(namespace(&long[..255]), Ok(Namespace::User));
    }

    #[test]
    fn permissions_as_xattr_permission() {
        let file = Inode::new(9, libc::S_IFREG | 0o640, 1000, 100, 0);
        let owner = Cred { uid: 1000, gid: 100, groups: vec![] };
        let group = Cred { uid: 1001, gid: 100, groups: vec![] };
        let other = Cred { uid: 1002, gid: 200, groups: vec![] };
        let root = Cred::default();
        assert_eq!(check(Some(&owner), &file, Namespace::User, true), Ok(()));
        assert_eq!(check(Some(&group), &file, Namespace::User, false), Ok(()));
        assert_eq!(check(Some(&group), &file, Namespace::User, true), Err(FsError::Access));
        assert_eq!(check(Some(&other), &file, Namespace::User, false), Err(FsError::Access));
        assert_eq!(check(Some(&owner), &file, Namespace::Trusted, false), Err(FsError::NoAttr));
        assert_eq!(check(Some(&owner), &file, Namespace::Trusted, true), Err(FsError::Perm));
        assert_eq!(check(Some(&root), &file, Namespace::Trusted, true), Ok(()));
        assert_eq!(check(Some(&other), &file, Namespace::Security, false), Ok(()));
        assert_eq!(check(Some(&owner), &file, Namespace::Security, true), Err(FsError::Perm));
        let link = Inode::new(10, libc::S_IFLNK | 0o777, 1000, 100, 0);
        assert_eq!(check(Some(&owner), &link, Namespace::User, true), Err(FsError::Perm));
        assert_eq!(check(Some(&owner), &link, Namespace::User, false), Err(FsError::NoAttr));
        assert_eq!(check(None, &link, Namespace::User, true), Err(FsError::Perm));
        assert_eq!(check(Some(&root), &link, Namespace::Trusted, true), Ok(()));
        let sticky = Inode::new(11, libc::S_IFDIR | 0o1777, 0, 0, 0);
        assert_eq!(check(Some(&owner), &sticky, Namespace::User, true), Err(FsError::Perm));
        assert_eq!(check(Some(&owner), &sticky, Namespace::User, false), Ok(()));
        assert_eq!(XattrFlags::from_bits(4), Err(FsError::Invalid));
        assert_eq!(XattrFlags::from_bits(3), Ok(XattrFlags { create: true, replace: true }));
    }
}
