//! What the kernel still holds of a connection's output.
//!
//! Closing a TCP socket whose input was not all read makes Linux answer with
//! a reset and throw away the output it has not yet sent (RFC 2525 §2.17), so
//! a server that stops reading a connection and closes it can cut its last
//! replies short. [`unacked_bytes`] tells when the peer has taken everything,
//! after which the close loses nothing.
//!
//! Also the server's two kinds of socket, TCP and Unix (`-s`), as one [`Listener`] and one
//! [`Stream`] type for the acceptor and the workers.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use mio::event::Source;
use mio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use mio::{Interest, Registry, Token};

use crate::stats::ConnAddr;

/// A client connection, over TCP or a Unix socket.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        }
    }

    /// The peer, as `stats conns` shows it (a Unix socket's peer has no name: `unix:`).
    pub fn peer(&self) -> Option<ConnAddr> {
        match self {
            Self::Tcp(s) => s.peer_addr().ok().map(ConnAddr::Tcp),
            Self::Unix(_) => Some(ConnAddr::Unix(String::new())),
        }
    }

    /// The address the connection came in on.
    pub fn local(&self) -> Option<ConnAddr> {
        match self {
            Self::Tcp(s) => s.local_addr().ok().map(ConnAddr::Tcp),
            Self::Unix(s) => s.local_addr().ok().map(|a| ConnAddr::Unix(a.as_pathname().map(|p| p.display().to_string()).unwrap_or_default())),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write_vectored(bufs),
            Self::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Source for Stream {
    fn register(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.register(registry, token, interests),
            Self::Unix(s) => s.register(registry, token, interests),
        }
    }

    fn reregister(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.reregister(registry, token, interests),
            Self::Unix(s) => s.reregister(registry, token, interests),
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.deregister(registry),
            Self::Unix(s) => s.deregister(registry),
        }
    }
}

/// A listening socket: TCP, or a Unix socket at a path (removed when the listener drops).
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    /// `inode`: the socket file's (device, inode), so that the drop removes only the file
    /// this listener made, not one a later server bound at the path.
    Unix { listener: UnixListener, path: PathBuf, inode: (u64, u64) },
}

impl Listener {
    /// A Unix socket at `path` with permissions `mode` (memcached's `-s` and `-a`). As
    /// memcached, a socket left at the path by an earlier run is replaced; any other file
    /// there is an error.
    pub fn bind_unix(path: &Path, mode: u32, backlog: u32) -> io::Result<Self> {
        use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, "a file that is not a socket is there")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        let listener = Self::Unix { listener, path: path.to_path_buf(), inode: file_id(path)? };
        listener.set_backlog(backlog)?;
        Ok(listener)
    }

    /// Connections the kernel queues before they are accepted (memcached's `-b`): `listen`
    /// again on the bound socket, which Linux takes as a new backlog.
    pub fn set_backlog(&self, backlog: u32) -> io::Result<()> {
        let backlog = libc::c_int::try_from(backlog).unwrap_or(libc::c_int::MAX);
        // SAFETY: listen on a descriptor this listener owns.
        if unsafe { libc::listen(self.as_raw_fd(), backlog) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn addr(&self) -> Option<ConnAddr> {
        match self {
            Self::Tcp(l) => l.local_addr().ok().map(ConnAddr::Tcp),
            Self::Unix { path, .. } => Some(ConnAddr::Unix(path.display().to_string())),
        }
    }

    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Self::Tcp(l) => {
                let (stream, _) = l.accept()?;
                let _ = stream.set_nodelay(true);
                Ok(Stream::Tcp(stream))
            }
            Self::Unix { listener, .. } => Ok(Stream::Unix(listener.accept()?.0)),
        }
    }
}

fn file_id(path: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::symlink_metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Self::Tcp(l) => l.as_raw_fd(),
            Self::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }
}

impl Source for Listener {
    fn register(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        match self {
            Self::Tcp(l) => l.register(registry, token, interests),
            Self::Unix { listener, .. } => listener.register(registry, token, interests),
        }
    }

    fn reregister(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        match self {
            Self::Tcp(l) => l.reregister(registry, token, interests),
            Self::Unix { listener, .. } => listener.reregister(registry, token, interests),
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            Self::Tcp(l) => l.deregister(registry),
            Self::Unix { listener, .. } => listener.deregister(registry),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix { path, inode, .. } = self
            && file_id(path).ok() == Some(*inode)
        {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Bytes written to a TCP socket that the peer has not acknowledged yet (unsent ones
/// included, and the FIN after `shutdown(SHUT_WR)`): `SIOCOUTQ`, see tcp(7).
pub fn unacked_bytes(stream: &impl AsRawFd) -> io::Result<usize> {
    let mut bytes: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one c_int through the pointer, which points to a
    // c_int we own; the descriptor is borrowed from a live socket.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut bytes) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(bytes).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn unacknowledged_output_is_counted_until_the_peer_takes_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        assert_eq!(unacked_bytes(&server).unwrap(), 0);
        // Far more than the peer's receive window while it reads nothing.
        server.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 64 * 1024];
        let mut written = 0;
        while written < 64 << 20 {
            match server.write(&chunk) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(unacked_bytes(&server).unwrap() > 0, "the peer read nothing");
        server.shutdown(std::net::Shutdown::Write).unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), written);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while unacked_bytes(&server).unwrap() > 0 {
            assert!(std::time::Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
