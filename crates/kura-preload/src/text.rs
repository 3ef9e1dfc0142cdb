//! `ETXTBSY`, as Linux answers a write to a program someone is running. The exec of a kura
//! program takes a read lock (an OFD lock) on byte 0 of `<lock dir>/<fs>-<ino>.text` through
//! a descriptor the new image inherits, before the exec, so the program is busy from the
//! moment it runs; the new image's preload makes that descriptor close-on-exec, so the lock
//! lasts as long as the image and the children it forks (which share its text), and ends at
//! its next exec. An open for writing or truncating, and `truncate`, of a kura file look for
//! such a lock first. (A program that does not load the preload, a static binary, keeps the
//! descriptor across its own execs.)

use std::ffi::c_int;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};

use crate::hooks::raw;

/// Tells the new image `<ino>:<descriptor>` of the text lock it inherits (removed from its
/// environment at load).
pub const TEXT_ENV: &str = "KURA_FS_TEXT";
/// The text lock file's suffix beside the inode's lock file.
const TEXT_SUFFIX: &str = kura_fs::host_files::TEXT;

fn byte_zero(kind: c_int) -> libc::flock {
    libc::flock { l_type: kind as i16, l_whence: libc::SEEK_SET as i16, l_start: 0, l_len: 1, l_pid: 0 }
}

/// Before the exec of kura program `ino`: a descriptor holding its text lock that the new
/// image inherits (high, not close-on-exec), for [`TEXT_ENV`]. `None` when the lock file
/// cannot be made (the program then runs unprotected).
pub fn lock_for_exec(ino: u64) -> Option<c_int> {
    let (_, path) = crate::fds::host_file_path(ino, TEXT_SUFFIX); // makes the directory
    // SAFETY: a NUL-terminated path; flags and mode.
    let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o666) } as c_int;
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let fd = kura_engine::fd::keep_high(unsafe { OwnedFd::from_raw_fd(fd) }).into_raw_fd();
    let lock = byte_zero(libc::F_RDLCK);
    // SAFETY: our descriptor and a struct flock that lives across each call.
    let locked = unsafe {
        crate::raw_syscall!(libc::SYS_fcntl, fd, libc::F_OFD_SETLK, &lock as *const libc::flock) == 0 && crate::raw_syscall!(libc::SYS_fcntl, fd, libc::F_SETFD, 0) == 0
    };
    if !locked {
        raw::close(fd);
        return None;
    }
    Some(fd)
}

/// At load time: the text lock this image inherited (see [`lock_for_exec`]) becomes
/// close-on-exec, once its descriptor is checked to be that lock file.
pub fn hold_at_init() {
    let Some(value) = std::env::var_os(TEXT_ENV) else { return };
    // SAFETY: at load time, before the program runs any thread of its own.
    unsafe { std::env::remove_var(TEXT_ENV) };
    let Some((ino, fd)) = value.to_str().and_then(|v| v.split_once(':')).and_then(|(i, f)| Some((i.parse::<u64>().ok()?, f.parse::<c_int>().ok()?))) else { return };
    // SAFETY: zeroed stats are valid values; fstat and stat write only into them.
    let (mut held, mut want): (libc::stat, libc::stat) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    let path = crate::fds::host_file_name(ino, TEXT_SUFFIX);
    // SAFETY: a descriptor number, a NUL-terminated path and writable structs.
    let same = unsafe {
        crate::raw_syscall!(libc::SYS_fstat, fd, &mut held as *mut libc::stat) == 0
            && crate::raw_syscall!(libc::SYS_newfstatat, libc::AT_FDCWD, path.as_ptr(), &mut want as *mut libc::stat, 0) == 0
    } && (held.st_dev, held.st_ino) == (want.st_dev, want.st_ino);
    if same {
        // SAFETY: integers.
        unsafe { crate::raw_syscall!(libc::SYS_fcntl, fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

/// Whether kura file `ino` is a program that some process is running.
pub fn busy(ino: u64) -> bool {
    let path = crate::fds::host_file_name(ino, TEXT_SUFFIX);
    // SAFETY: a NUL-terminated path (one system call when no program ran from the file).
    if unsafe { crate::raw_syscall!(libc::SYS_faccessat, libc::AT_FDCWD, path.as_ptr(), libc::F_OK) } != 0 {
        return false;
    }
    // SAFETY: a NUL-terminated path; flags.
    let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) } as c_int;
    if fd < 0 {
        return false;
    }
    let mut probe = byte_zero(libc::F_WRLCK);
    // SAFETY: our descriptor and a struct flock that lives across the call.
    let r = unsafe { crate::raw_syscall!(libc::SYS_fcntl, fd, libc::F_OFD_GETLK, &mut probe as *mut libc::flock) };
    raw::close(fd);
    r == 0 && c_int::from(probe.l_type) != libc::F_UNLCK
}
