//! A connection to a node: TCP (`host:port`), or a Unix socket when the node's address is a
//! path (`kura:///run/kura.sock`, a `kura serve -s` on this host). A loopback round trip over
//! a Unix socket skips TCP's work (on the 2-core VM kura is measured on, a `version` to a
//! spinning server: ~13-15 µs against ~17 µs over TCP).
//!
//! Or TLS over TCP (`kura+tls://`, `memcached+tls://`, `rediss://`): a rustls client session
//! ([`kura_tls::TlsSession`]) between the caller and the socket. Its handles
//! ([`NodeStream::try_clone`]) share the one session; they must not wait in a read on one
//! thread while another writes (kura reads and writes a connection from one thread at a
//! time).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs as _};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kura_tls::TlsSession;

use crate::config::TlsSpec;

/// An open connection to a node.
#[derive(Debug)]
pub enum NodeStream {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(TlsStream),
}

/// A TLS connection: the socket and the session its handles share.
#[derive(Debug)]
pub struct TlsStream {
    sock: TcpStream,
    shared: Arc<TlsShared>,
}

struct TlsShared {
    session: Mutex<TlsSession>,
    /// The socket's `O_NONBLOCK` (shared by every handle, as the flag is the open file's).
    nonblocking: AtomicBool,
}

impl std::fmt::Debug for TlsShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsShared").field("nonblocking", &self.nonblocking).finish_non_exhaustive()
    }
}

impl TlsStream {
    fn session(&self) -> MutexGuard<'_, TlsSession> {
        // A panic while a handle held the session leaves nothing half-done that matters here:
        // the session's own state is consistent between its calls.
        self.shared.session.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn nonblocking(&self) -> bool {
        self.shared.nonblocking.load(Ordering::Relaxed)
    }
}

/// A socket read and written without waiting (`MSG_DONTWAIT`), whatever its `O_NONBLOCK`:
/// how a TLS session is looked at on a blocking socket.
struct DontWait<'a>(&'a TcpStream);

impl Read for DontWait<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: a receive into `buf`, valid for its length across the call.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }
}

impl Write for DontWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: a send from `buf`, valid for its length across the call; MSG_NOSIGNAL: a
        // closed peer is an EPIPE error, not a SIGPIPE for the host program.
        let n = unsafe { libc::send(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether a node address names a Unix socket (an absolute path) rather than `host:port`.
pub fn is_unix_addr(addr: &str) -> bool {
    addr.starts_with('/')
}

impl NodeStream {
    /// Connects to `addr` (`host:port`, every address it resolves to in turn, or a socket
    /// path), moved high in the descriptor table ([`crate::fd::keep_high`]), with Nagle off
    /// for TCP.
    pub fn connect(addr: &str, timeout: Duration) -> io::Result<Self> {
        if is_unix_addr(addr) {
            // A Unix connect does not wait for the other side: it succeeds or fails at once,
            // unless a signal to the host program cuts it short (then it is made again).
            let stream = loop {
                match UnixStream::connect(addr) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => break crate::fd::keep_high(other?),
                }
            };
            return Ok(Self::Unix(stream));
        }
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(stream) => {
                    let stream = crate::fd::keep_high(stream);
                    stream.set_nodelay(true)?;
                    return Ok(Self::Tcp(stream));
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Runs a TLS client handshake over this (blocking) TCP connection to `addr` and returns
    /// the TLS connection (the socket's timeouts bound the handshake).
    pub fn start_tls(self, addr: &str, tls: &TlsSpec) -> io::Result<Self> {
        let Self::Tcp(mut sock) = self else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "TLS is spoken over TCP only (a Unix socket is plain)"));
        };
        let host = match &tls.server_name {
            Some(name) => name.as_str(),
            None => addr.rsplit_once(':').map_or(addr, |(host, _)| host),
        };
        let name = kura_tls::server_name(host).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut session = TlsSession::client(&tls.config, name)?;
        session.handshake(&mut sock)?;
        Ok(Self::Tls(TlsStream { sock, shared: Arc::new(TlsShared { session: Mutex::new(session), nonblocking: AtomicBool::new(false) }) }))
    }

    /// Whether this is a TLS connection.
    pub fn is_tls(&self) -> bool {
        matches!(self, Self::Tls(_))
    }

    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_nonblocking(nonblocking),
            Self::Unix(s) => s.set_nonblocking(nonblocking),
            Self::Tls(s) => {
                s.sock.set_nonblocking(nonblocking)?;
                s.shared.nonblocking.store(nonblocking, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(timeout),
            Self::Unix(s) => s.set_read_timeout(timeout),
            Self::Tls(s) => s.sock.set_read_timeout(timeout),
        }
    }

    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(timeout),
            Self::Unix(s) => s.set_write_timeout(timeout),
            Self::Tls(s) => s.sock.set_write_timeout(timeout),
        }
    }

    /// Another handle on the same connection, high in the descriptor table (a TLS
    /// connection's handles share its session).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(crate::fd::keep_high(s.try_clone()?)),
            Self::Unix(s) => Self::Unix(crate::fd::keep_high(s.try_clone()?)),
            Self::Tls(s) => Self::Tls(TlsStream { sock: crate::fd::keep_high(s.sock.try_clone()?), shared: Arc::clone(&s.shared) }),
        })
    }

    /// Looks at what came without taking it and without waiting: `Ok(0)` when the peer
    /// closed, `Ok(n)` when there is something to read, `WouldBlock` when nothing is there.
    /// On a TLS connection what is there is read into the session (a session ticket, which
    /// TLS 1.3 servers send after the handshake, is not something to read; `close_notify` is
    /// a close).
    pub fn peek_nonblocking(&self) -> io::Result<usize> {
        if let Self::Tls(s) = self {
            return s.session().peek(&mut DontWait(&s.sock));
        }
        let mut byte = 0u8;
        // SAFETY: recv into one byte we own, on a descriptor this stream owns.
        let n = unsafe { libc::recv(self.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Reads what has come without waiting: `Some(bytes)` (0: end of stream), `None` when
    /// nothing has (the caller may look again, or wait in [`Read::read`]).
    pub fn read_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let got = match self {
            Self::Tls(s) => {
                let mut sock = DontWait(&s.sock);
                s.session().read(&mut sock, buf, false)
            }
            // SAFETY: a receive into `buf`, valid for its length across the call.
            _ => match unsafe { libc::recv(self.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) } {
                n if n >= 0 => Ok(n as usize),
                _ => Err(io::Error::last_os_error()),
            },
        };
        match got {
            Ok(n) => Ok(Some(n)),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// TLS ciphertext the socket did not take yet ([`NodeStream::flush_pending`] sends it):
    /// a caller that polls the socket must wait until it can write, not only read.
    pub fn write_pending(&self) -> bool {
        match self {
            Self::Tls(s) => s.session().write_pending(),
            _ => false,
        }
    }

    /// Sends what [`NodeStream::write_pending`] says waits, as far as the socket takes it.
    pub fn flush_pending(&mut self) -> io::Result<()> {
        match self {
            Self::Tls(s) => match s.session().flush(&mut &s.sock) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
                other => other,
            },
            _ => Ok(()),
        }
    }
}

impl crate::fd::ReadNow for NodeStream {
    fn read_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        NodeStream::read_now(self, buf)
    }
}

impl Read for NodeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
            // Non-blocking: until `buf` is full or the socket is empty, so that a short read
            // means what it means on a plain socket (the next bytes wake epoll).
            Self::Tls(s) => {
                let blocking = !s.nonblocking();
                s.session().read(&mut &s.sock, buf, blocking)
            }
        }
    }
}

impl Write for NodeStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
            Self::Tls(s) => s.session().write_vectored(&mut &s.sock, &[io::IoSlice::new(buf)]),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write_vectored(bufs),
            Self::Unix(s) => s.write_vectored(bufs),
            Self::Tls(s) => s.session().write_vectored(&mut &s.sock, bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for NodeStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
            Self::Tls(s) => s.sock.as_raw_fd(),
        }
    }
}

impl Drop for TlsStream {
    /// The last handle says `close_notify` if the socket takes it at once.
    fn drop(&mut self) {
        if Arc::strong_count(&self.shared) == 1 {
            self.session().close(&mut DontWait(&self.sock));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_a_unix_socket_and_both_kinds_carry_bytes() {
        assert!(is_unix_addr("/run/kura.sock"));
        assert!(!is_unix_addr("127.0.0.1:11211") && !is_unix_addr("[::1]:5"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let client = NodeStream::connect(path.to_str().unwrap(), Duration::from_secs(1)).unwrap();
        assert!(matches!(client, NodeStream::Unix(_)));
        let (mut server, _) = listener.accept().unwrap();
        assert_eq!(client.peek_nonblocking().unwrap_err().kind(), io::ErrorKind::WouldBlock);
        server.write_all(b"hi").unwrap();
        assert_eq!(client.peek_nonblocking().unwrap(), 1);
        let mut got = [0u8; 2];
        client.try_clone().unwrap().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
        drop(server);
        assert_eq!(client.peek_nonblocking().unwrap(), 0, "the close shows");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = NodeStream::connect(&tcp.local_addr().unwrap().to_string(), Duration::from_secs(1)).unwrap();
        assert!(matches!(client, NodeStream::Tcp(_)));
        let missing = dir.path().join("none.sock");
        assert!(NodeStream::connect(missing.to_str().unwrap(), Duration::from_secs(1)).is_err());
    }
}
