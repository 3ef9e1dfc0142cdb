//! Which paths are kura's: absolute paths under the mount prefix, relative paths while the
//! working directory is inside the mount, and paths relative to a kura directory descriptor.

use std::ffi::{CStr, c_char};
use std::sync::Arc;

use kura_fs::ROOT_INO;

use crate::fds::OpenFile;
use crate::state::State;

/// The first address above x86-64 user space (the last page below 2^47 is never mapped).
pub(crate) const USER_SPACE_END: usize = 0x0000_7fff_ffff_f000;

/// Where a path goes.
pub enum Target {
    /// To the kernel, as the caller gave it.
    Kernel,
    /// To the kernel, as this absolute path (NUL-terminated): the working directory is
    /// inside the mount, or a kura symlink leads out of it.
    KernelAbs(Vec<u8>),
    /// Into the file system: `rel` resolved from directory `start`; `abs` is the lexical
    /// absolute path (for the working directory and descriptor paths).
    Kura { start: u64, rel: Vec<u8>, abs: Vec<u8> },
}

/// Lexically normalises an absolute path: no `//`, `.` or `..` (a `..` above `/` stays at `/`).
pub fn normalise(path: &[u8]) -> Vec<u8> {
    let mut parts: Vec<&[u8]> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let mut out = Vec::with_capacity(path.len() + 1);
    for p in &parts {
        out.push(b'/');
        out.extend_from_slice(p);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}

/// The bytes of a C path (`None` for NULL: the kernel answers EFAULT).
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
pub unsafe fn bytes<'a>(path: *const c_char) -> Option<&'a [u8]> {
    // Above user space nothing is mapped (x86-64): the kernel answers EFAULT, and reading
    // there would crash the caller.
    if path.is_null() || path as usize >= USER_SPACE_END {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    Some(unsafe { CStr::from_ptr(path) }.to_bytes())
}

fn kura_abs(state: &State, abs: Vec<u8>) -> Option<Target> {
    let rel = kura_fs::path::rel_in_mount(&abs, &state.mount)?;
    Some(Target::Kura { start: ROOT_INO, rel, abs: normalise(&abs) })
}

/// A path naming one of this process's kura descriptors — `/dev/fd/N`, `/proc/self/fd/N`,
/// `/proc/thread-self/fd/N`, `/proc/<own pid>/fd/N`, `/dev/stdin`, `/dev/stdout`,
/// `/dev/stderr` — and what follows it (under a directory's). For the kernel these lead to
/// the descriptor's placeholder memfd; they must lead to the kura file, as they lead to the
/// open file on Linux (`echo x > /dev/stdout`, glibc's `freopen(NULL, …)`, `cat /dev/fd/3`).
pub fn descriptor_link<'a>(state: &State, path: &'a [u8]) -> Option<(Arc<OpenFile>, &'a [u8])> {
    let (fd, rest): (i32, &[u8]) = if let Some(std) = path.strip_prefix(b"/dev/std") {
        let fd = [&b"in"[..], b"out", b"err"].iter().position(|name| std == *name)?;
        (fd as i32, b"")
    } else {
        let tail = if let Some(t) = path.strip_prefix(b"/dev/fd/") {
            t
        } else {
            let proc = path.strip_prefix(b"/proc/")?;
            let slash = proc.iter().position(|&b| b == b'/')?;
            let (who, t) = (&proc[..slash], proc[slash + 1..].strip_prefix(b"fd/")?);
            let mine = who == b"self" || who == b"thread-self" || who == std::process::id().to_string().as_bytes();
            if !mine {
                return None;
            }
            t
        };
        let digits = tail.iter().take_while(|b| b.is_ascii_digit()).count();
        let fd = std::str::from_utf8(&tail[..digits]).ok()?.parse().ok()?;
        (fd, &tail[digits..])
    };
    if !rest.is_empty() && rest[0] != b'/' {
        return None;
    }
    Some((state.fds.get(fd)?, rest))
}

/// Classifies `path` relative to `dirfd` (`AT_FDCWD` or a descriptor).
pub fn classify(state: &State, dirfd: i32, path: &[u8]) -> Result<Target, i32> {
    kura_fs::path::check_path_len(path).map_err(|e| e.errno())?;
    if path.is_empty() {
        return Ok(Target::Kernel);
    }
    if path[0] == b'/'
        && let Some((of, rest)) = descriptor_link(state, path)
    {
        // The file's path at its open (a file renamed since is not followed).
        let mut abs = of.path.clone();
        abs.extend_from_slice(rest);
        return kura_abs(state, abs).ok_or(libc::ENOENT);
    }
    if path[0] == b'/' {
        return Ok(kura_abs(state, path.to_vec()).unwrap_or(Target::Kernel));
    }
    if dirfd == libc::AT_FDCWD {
        let cwd = state.cwd.read().clone();
        let Some(cwd) = cwd else {
            return Ok(into_mount_from_host(state, dirfd, path).unwrap_or(Target::Kernel));
        };
        let mut abs = cwd;
        abs.push(b'/');
        abs.extend_from_slice(path);
        return Ok(match kura_abs(state, abs.clone()) {
            Some(t) => t,
            None => {
                let mut out = normalise(&abs);
                out.push(0);
                Target::KernelAbs(out)
            }
        });
    }
    let Some(dir) = state.fds.get(dirfd) else {
        return Ok(into_mount_from_host(state, dirfd, path).unwrap_or(Target::Kernel));
    };
    if !dir.is_dir {
        return Err(libc::ENOTDIR);
    }
    let mut abs = dir.path.clone();
    abs.push(b'/');
    abs.extend_from_slice(path);
    Ok(Target::Kura { start: dir.ino, rel: path.to_vec(), abs: normalise(&abs) })
}

/// A relative path from a host directory (the working directory, or a directory descriptor
/// of the kernel's) that leads into the mount: `kura/f` from `/`, `../kura/f` from `/tmp`
/// (rsync walks its destination from `/` with `openat`). Only a path that could — one with a
/// `..`, or whose first component is one of the mount prefix's — costs a look at where the
/// directory is (`getcwd` or `/proc/self/fd/N`); any other stays the kernel's, untouched.
fn into_mount_from_host(state: &State, dirfd: i32, path: &[u8]) -> Option<Target> {
    let mut components = path.split(|&b| b == b'/');
    let first = components.next().unwrap_or(b"");
    let may_reach = first == b".." || state.mount.split(|&b| b == b'/').any(|c| !c.is_empty() && c == first) || components.any(|c| c == b"..");
    if !may_reach {
        return None;
    }
    let mut base = host_dir_path(dirfd)?;
    base.push(b'/');
    base.extend_from_slice(path);
    kura_abs(state, base)
}

/// Where a directory of the kernel's is: the working directory for `AT_FDCWD`, else the
/// descriptor's (`None` when the kernel cannot tell, as for a directory removed since).
fn host_dir_path(dirfd: i32) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    let len = if dirfd == libc::AT_FDCWD {
        // SAFETY: `buf` is writable for its length; the kernel writes the path and its NUL.
        let n = unsafe { crate::raw_syscall!(libc::SYS_getcwd, buf.as_mut_ptr(), buf.len()) };
        usize::try_from(n).ok()?.checked_sub(1)?
    } else {
        crate::hooks::raw::readlink(format!("/proc/self/fd/{dirfd}\0").as_bytes(), &mut buf).ok()?
    };
    buf.truncate(len);
    (buf.first() == Some(&b'/')).then_some(buf)
}

/// A NUL-terminated copy.
pub fn c_path(path: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(path.len() + 1);
    v.extend_from_slice(path);
    v.push(0);
    v
}
