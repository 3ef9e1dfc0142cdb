//! A connection to a node: TCP (`host:port`), or a Unix socket when the node's address is a
//! path (`kura:///run/kura.sock`, a `kura serve -s` on this host). A loopback round trip over
//! a Unix socket skips TCP's work (on the 2-core VM kura is measured on, a `version` to a
//! spinning server: ~13-15 µs against ~17 µs over TCP).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs as _};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// An open connection to a node.
#[derive(Debug)]
pub enum NodeStream {
    Tcp(TcpStream),
    Unix(UnixStream),
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

    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_nonblocking(nonblocking),
            Self::Unix(s) => s.set_nonblocking(nonblocking),
        }
    }

    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(timeout),
            Self::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(timeout),
            Self::Unix(s) => s.set_write_timeout(timeout),
        }
    }

    /// Another handle on the same connection, high in the descriptor table.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(crate::fd::keep_high(s.try_clone()?)),
            Self::Unix(s) => Self::Unix(crate::fd::keep_high(s.try_clone()?)),
        })
    }

    /// Looks at the next byte without taking it and without waiting: `Ok(0)` when the peer
    /// closed, `WouldBlock` when nothing is there.
    pub fn peek_nonblocking(&self) -> io::Result<usize> {
        let mut byte = 0u8;
        // SAFETY: recv into one byte we own, on a descriptor this stream owns.
        let n = unsafe { libc::recv(self.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }
}

impl Read for NodeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for NodeStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write_vectored(bufs),
            Self::Unix(s) => s.write_vectored(bufs),
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
        }
    }
}

impl From<NodeStream> for OwnedFd {
    fn from(stream: NodeStream) -> Self {
        match stream {
            NodeStream::Tcp(s) => s.into(),
            NodeStream::Unix(s) => s.into(),
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
