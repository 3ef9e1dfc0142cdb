//! The engine's descriptors (the store's file, io_uring rings, eventfds) live high in the
//! descriptor table, where the program the engine is embedded in does not reach: under the
//! file system's preload (`kura fs run --pool embedded`) the program owns the low numbers,
//! and a shell's `exec 3>>log` `dup2`s onto 3 whatever is open there — the store's file,
//! made by the kernel's "lowest free number" rule at the first kura call, would then have
//! been the program's log, and the engine's writes would have gone into it. Every descriptor
//! is moved at once to the lowest free number at or above [`high_base`], which programs leave
//! alone (they `dup2` onto 0–9 or so and take new numbers from the bottom). kura-pool moves
//! its connections, epolls and eventfds the same way.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

/// kura's descriptors go at or above this number, or three quarters of the soft limit
/// on open files if that is lower.
pub const HIGH_FD_BASE_MAX: u32 = 1024;

/// Where [`keep_high`] moves descriptors to: `min(HIGH_FD_BASE_MAX, 3/4 × RLIMIT_NOFILE)`.
pub fn high_base() -> RawFd {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 { limit.rlim_cur } else { 1024 };
    (soft / 4 * 3).min(u64::from(HIGH_FD_BASE_MAX)) as RawFd
}

/// A close-on-exec duplicate of `fd` at the lowest free number at or above [`high_base`];
/// `None` when `fd` is there already or there is no room up there.
fn duplicate_high(fd: RawFd) -> Option<OwnedFd> {
    let base = high_base();
    if fd >= base {
        return None;
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a descriptor of ours returns a new one or -1.
    let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, base) };
    // SAFETY: `high` was just made and nothing else owns it.
    (high >= 0).then(|| unsafe { OwnedFd::from_raw_fd(high) })
}

/// Moves a descriptor kura owns (a file, a socket, an epoll, an eventfd) to the lowest free
/// number at or above [`high_base`], close-on-exec; where there is no room up there it
/// stays where it is.
pub fn keep_high<T: From<OwnedFd> + Into<OwnedFd>>(owner: T) -> T {
    let fd: OwnedFd = owner.into();
    // The low descriptor closes with `fd` when a high one replaces it.
    T::from(duplicate_high(fd.as_raw_fd()).unwrap_or(fd))
}

/// Moves an io_uring ring to a high descriptor: the same ring, mapped again through the new
/// number ([`io_uring::IoUring::from_fd`]), and the low one closed.
pub fn keep_ring_high(ring: io_uring::IoUring) -> io::Result<io_uring::IoUring> {
    let Some(high) = duplicate_high(ring.as_raw_fd()) else { return Ok(ring) };
    let params = ring.params().clone();
    // SAFETY: `high` refers to this ring and is handed over (from_fd owns it from here), and
    // `params` are what the kernel filled in when it made the ring.
    let moved = unsafe { io_uring::IoUring::from_fd(high.into_raw_fd(), params) }?;
    drop(ring);
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_rings_move_above_the_base_and_keep_working() {
        let file = keep_high(tempfile::tempfile().unwrap());
        assert!(file.as_raw_fd() >= high_base());
        std::os::unix::fs::FileExt::write_all_at(&file, b"kura", 0).unwrap();
        let mut ring = keep_ring_high(io_uring::IoUring::new(4).unwrap()).unwrap();
        assert!(ring.as_raw_fd() >= high_base());
        let mut buf = [0u8; 4];
        let read = io_uring::opcode::Read::new(io_uring::types::Fd(file.as_raw_fd()), buf.as_mut_ptr(), 4).build().user_data(9);
        // SAFETY: `buf` outlives the read, which completes before the ring is dropped.
        unsafe { ring.submission().push(&read).unwrap() };
        ring.submit_and_wait(1).unwrap();
        let done = ring.completion().next().unwrap();
        assert_eq!((done.user_data(), done.result()), (9, 4));
        assert_eq!(&buf, b"kura");
    }
}
