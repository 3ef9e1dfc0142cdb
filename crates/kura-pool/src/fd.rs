//! The pool's own descriptors (connections, the context's epoll, its waker) live high in
//! the descriptor table, where the program they serve does not reach.
//!
//! Under the file system's preload (`kura fs run`) the pool lives inside someone else's
//! program, and that program owns the low descriptor numbers: a shell's `exec 3>>log`
//! `dup2`s onto 3 whatever is open there, and a descriptor made by the kernel's "lowest free
//! number" rule (the pool's first connection, made at the first kura call) is exactly what
//! it overwrites. The pool then spoke to the program's file instead of its node, and on the
//! error that followed closed the program's descriptor 3 as its own (found: `sh -c 'exec
//! 3>>/kura/log; …'` under the preload: `write-back before fork failed: … Socket operation
//! on non-socket`, then `3: Bad file descriptor`). So every descriptor the pool makes is
//! moved at once to the lowest free number at or above [`high_base`], which programs leave
//! alone (they `dup2` onto 0–9 or so, and take new numbers from the bottom).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub use kura_engine::fd::{HIGH_FD_BASE_MAX, high_base, keep_high};

fn cvt(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 { Err(io::Error::last_os_error()) } else { Ok(result) }
}

/// An edge-triggered epoll instance (as mio's, which cannot be moved: it keeps its number).
pub(crate) struct Epoll {
    fd: OwnedFd,
}

/// What one ready descriptor reported.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ready {
    pub token: u64,
    /// Data, end of stream, hang-up or an error: a read will tell which.
    pub readable: bool,
    pub writable: bool,
    /// The peer closed (or the connection failed): the end of stream is queued behind any
    /// data, and no further edge will announce it, so a reader reads until it gets there.
    pub hung_up: bool,
}

impl Epoll {
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1 takes a flag and returns a new descriptor or -1.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: the descriptor was just made and nothing else owns it.
        Ok(Self { fd: keep_high(unsafe { OwnedFd::from_raw_fd(fd) }) })
    }

    /// Watches `fd` (edge-triggered, with peer hang-ups) under `token`.
    pub fn register(&self, fd: RawFd, token: u64, readable: bool, writable: bool) -> io::Result<()> {
        let mut events = libc::EPOLLET | libc::EPOLLRDHUP;
        if readable {
            events |= libc::EPOLLIN;
        }
        if writable {
            events |= libc::EPOLLOUT;
        }
        let mut event = libc::epoll_event { events: events as u32, u64: token };
        // SAFETY: epoll_ctl reads the event we pass; the descriptors are integers.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) }).map(drop)
    }

    pub fn deregister(&self, fd: RawFd) -> io::Result<()> {
        let mut event = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: as in `register` (the event is ignored for a delete).
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut event) }).map(drop)
    }

    /// Waits up to `timeout` (rounded up to a millisecond) for events, into `events` (at
    /// most its capacity). `Interrupted` when a signal came first.
    pub fn wait(&self, events: &mut Vec<libc::epoll_event>, timeout: Option<Duration>) -> io::Result<()> {
        let timeout_ms = timeout.map_or(-1, |t| t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int);
        events.clear();
        events.reserve(1);
        let capacity = events.capacity().min(i32::MAX as usize);
        // SAFETY: the kernel writes at most `capacity` events into the vector's spare room.
        let n = cvt(unsafe { libc::epoll_wait(self.fd.as_raw_fd(), events.as_mut_ptr(), capacity as libc::c_int, timeout_ms) })?;
        // SAFETY: the kernel initialised the first `n` (≤ capacity) events.
        unsafe { events.set_len(n as usize) };
        Ok(())
    }
}

/// A connection that can be read without waiting ([`crate::stream::NodeStream::read_now`]):
/// `Some(bytes)` (0: end of stream), or `None` when nothing has come.
pub trait ReadNow: io::Read {
    fn read_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>>;
}

/// Reads of a blocking socket that first look for data without sleeping, for up to `spin`
/// (see [`kura_engine::spin`]), and only then sleep in the kernel's blocking read.
pub struct SpinningReader<S> {
    stream: S,
    spin: Duration,
}

impl<S: ReadNow> SpinningReader<S> {
    /// `spin` zero: plain blocking reads.
    pub fn new(stream: S, spin: Duration) -> Self {
        Self { stream, spin }
    }

    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }
}

impl<S: ReadNow> io::Read for SpinningReader<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(n) = recv_spinning(&mut self.stream, buf, self.spin)? {
            return Ok(n);
        }
        self.stream.read(buf)
    }
}

/// Looks for data on `stream` without blocking for up to `spin` (yielding the CPU between
/// looks, and giving up early when it is wanted: [`kura_engine::spin::Spin`]): `Some(bytes
/// read)` (0: end of stream), or `None` when none came in time. `errno`
/// is left as it was (the host program of the file system's preload reads it).
pub fn recv_spinning<S: ReadNow>(stream: &mut S, buf: &mut [u8], spin: Duration) -> io::Result<Option<usize>> {
    if spin.is_zero() || buf.is_empty() {
        return Ok(None);
    }
    keeping_errno(|| kura_engine::spin::look_for(spin, || stream.read_now(buf).transpose()).transpose())
}

/// Runs `f`, leaving the calling thread's `errno` as it found it: system calls expected to
/// fail (a look that finds nothing) must not change what the host program of the file
/// system's preload reads there after a kura call that succeeded.
pub fn keeping_errno<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: __errno_location is the calling thread's errno, valid while the thread lives.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    let saved = unsafe { *errno };
    let result = f();
    // SAFETY: as above.
    unsafe { *errno = saved };
    result
}

/// What an event says, read out of the kernel's packed struct.
pub(crate) fn ready(event: &libc::epoll_event) -> Ready {
    let (flags, token) = (event.events as libc::c_int, event.u64);
    let read_side = libc::EPOLLIN | libc::EPOLLPRI | libc::EPOLLHUP | libc::EPOLLRDHUP | libc::EPOLLERR;
    let hang_up = libc::EPOLLHUP | libc::EPOLLRDHUP | libc::EPOLLERR;
    Ready { token, readable: flags & read_side != 0, writable: flags & libc::EPOLLOUT != 0, hung_up: flags & hang_up != 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_move_above_the_base_and_keep_working() {
        let epoll = Epoll::new().unwrap();
        assert!(epoll.fd.as_raw_fd() >= high_base(), "epoll at {}", epoll.fd.as_raw_fd());
        let waker = kura_engine::device::EventFd::new().unwrap();
        assert!(waker.as_raw_fd() >= high_base());
        epoll.register(waker.as_raw_fd(), 7, true, false).unwrap();
        let mut events = Vec::with_capacity(4);
        epoll.wait(&mut events, Some(Duration::ZERO)).unwrap();
        assert!(events.is_empty(), "nothing woke it yet");
        waker.signal().unwrap();
        epoll.wait(&mut events, Some(Duration::from_secs(5))).unwrap();
        assert_eq!(events.len(), 1);
        let got = ready(&events[0]);
        assert_eq!((got.token, got.readable, got.writable), (7, true, false));
        // Edge-triggered: a second wake is a second event, without reading the eventfd.
        waker.signal().unwrap();
        epoll.wait(&mut events, Some(Duration::from_secs(5))).unwrap();
        assert_eq!(events.len(), 1);
        // The low number it was made at is free again.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let b = keep_high(OwnedFd::from(b));
        assert!(b.as_raw_fd() >= high_base());
        assert!(a.as_raw_fd() < high_base());
    }

    #[test]
    fn a_spinning_reader_reads_what_is_there_what_comes_later_and_the_end() {
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut reader = SpinningReader::new(crate::stream::NodeStream::Unix(b), Duration::from_micros(200));
        let mut buf = [0u8; 16];
        // Already there: taken while spinning.
        a.write_all(b"now").unwrap();
        assert_eq!(recv_spinning(reader.get_mut(), &mut buf, Duration::from_micros(200)).unwrap(), Some(3));
        assert_eq!(&buf[..3], b"now");
        // Nothing comes within the spin: `None`, and errno is what it was.
        // SAFETY: the calling thread's errno.
        unsafe { *libc::__errno_location() = libc::ENOENT };
        assert_eq!(recv_spinning(reader.get_mut(), &mut buf, Duration::from_micros(200)).unwrap(), None);
        // SAFETY: as above.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::ENOENT);
        // Data that comes long after the spin: the blocking read gets it.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a.write_all(b"later").unwrap();
            a
        });
        let n = reader.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"later");
        // The end of the stream is a read of 0 bytes, whether seen spinning or blocked.
        drop(writer.join().unwrap());
        assert_eq!(reader.read(&mut buf).unwrap(), 0);
        // Spin zero: a plain blocking read.
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut plain = SpinningReader::new(crate::stream::NodeStream::Unix(b), Duration::ZERO);
        a.write_all(b"x").unwrap();
        assert_eq!(plain.read(&mut buf).unwrap(), 1);
    }
}
