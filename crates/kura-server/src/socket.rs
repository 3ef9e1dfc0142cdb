//! What the kernel still holds of a connection's output.
//!
//! Closing a TCP socket whose input was not all read makes Linux answer with
//! a reset and throw away the output it has not yet sent (RFC 2525 §2.17), so
//! a server that stops reading a connection and closes it can cut its last
//! replies short. [`unacked_bytes`] tells when the peer has taken everything,
//! after which the close loses nothing.

use std::io;
use std::os::fd::AsRawFd;

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
