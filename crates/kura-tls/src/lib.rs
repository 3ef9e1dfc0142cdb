//! kura's TLS, shared by the NBD server (`NBD_OPT_STARTTLS`), the memcached server (`-Z`) and
//! the pool's connections to TLS nodes (`kura+tls://`, `memcached+tls://`, `rediss://`):
//! certificate and key files read once at start, a server or client configuration built from
//! them, and a TLS session's I/O over a socket the caller polls itself (blocking during a
//! handshake, non-blocking otherwise).
//!
//! The session is rustls with the ring provider. Two things poll(2) on the socket cannot see
//! are the caller's to handle (see [`TlsSession::read_pending`] and
//! [`TlsSession::write_pending`]): plaintext the session decrypted but nobody read yet, and
//! ciphertext the socket did not take yet.

use std::io::{self, IoSlice, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

pub use rustls;
pub use rustls_pki_types;

mod ciphers;
pub use ciphers::{CIPHER_LIST_BYTES_MAX, CipherListError, tls12_cipher_suites};

/// Ciphertext one session holds for the socket, at most (rustls' `set_buffer_limit`): a
/// connection's replies move into it as they are encrypted, so it bounds what TLS adds to a
/// connection's memory. 16 records of 16 KiB: one `writev` each time the socket
/// drains.
pub const SEND_BUFFER_BYTES_MAX: usize = 256 << 10;
/// Largest PEM file read (a certificate chain or a CA bundle is a few KiB; a system CA bundle
/// is about 200 KiB).
pub const PEM_FILE_BYTES_MAX: u64 = 4 << 20;

/// Why the TLS configuration cannot be built (reported at start, before any client).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{} is larger than {PEM_FILE_BYTES_MAX} bytes: not a PEM certificate or key file", path.display())]
    TooLarge { path: PathBuf },
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} is not valid PEM: {detail}", path.display())]
    BadPem { path: PathBuf, detail: String },
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC)", path.display())]
    NoKey { path: PathBuf },
    #[error("certificate {} and key {} do not go together: {source}", cert.display(), key.display())]
    CertKey { cert: PathBuf, key: PathBuf, source: rustls::Error },
    #[error("CA file {}: {detail}", path.display())]
    BadCa { path: PathBuf, detail: String },
    #[error("client certificates are asked for but no CA file says which to accept")]
    NoClientCa,
    #[error("no CA file to check the server's certificate with: {SYSTEM_CA_FILE} is missing; give one (ca=PATH)")]
    NoServerCa,
    #[error("a client certificate needs its key too (cert= and key=, or one file holding both)")]
    CertWithoutKey,
    #[error("{name:?} cannot name a TLS server (a DNS name or an IP address): {detail}")]
    BadServerName { name: String, detail: String },
    #[error("cipher list: {0}")]
    CipherList(#[from] CipherListError),
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Client certificates (memcached's `ssl_verify_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAuth {
    /// None asked for (memcached 0).
    #[default]
    None,
    /// Asked for; a client without one is served, a certificate the CA file did not sign is
    /// refused (memcached 1, "request", and 3, "once": rustls never renegotiates).
    Request,
    /// A client must present a certificate the CA file signed (memcached 2, "require").
    Require,
}

/// Oldest TLS version a client may speak (rustls has no TLS 1.0 or 1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MinVersion {
    #[default]
    Tls12,
    Tls13,
}

/// What a server's TLS configuration is built from.
#[derive(Debug, Clone)]
pub struct ServerTlsOptions {
    /// PEM certificate chain, the server's certificate first.
    pub cert_chain: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key: PathBuf,
    /// PEM CA certificates that sign acceptable client certificates.
    pub client_ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    pub min_version: MinVersion,
    /// Keep sessions so that a client can resume one without a full handshake.
    pub session_cache: bool,
    /// Give clients session tickets (the server keeps nothing; a client resumes with its
    /// ticket), as OpenSSL does unless told not to.
    pub tickets: bool,
    /// OpenSSL's cipher list for TLS 1.2 (see [`tls12_cipher_suites`]); all of kura's when
    /// `None`. TLS 1.3's suites are not chosen by it, as with OpenSSL.
    pub tls12_ciphers: Option<String>,
}

/// Sessions the server keeps for resumption when [`ServerTlsOptions::session_cache`] is set.
pub const SESSION_CACHE_ENTRIES_MAX: usize = 1024;

/// Builds a server configuration from PEM files. Every problem (a missing file, no PEM, a key
/// that is not the certificate's, client certificates asked for with no CA to check them
/// against) is an error here, not at the first client.
pub fn server_config(options: &ServerTlsOptions) -> Result<Arc<ServerConfig>, TlsError> {
    if options.client_auth != ClientAuth::None && options.client_ca.is_none() {
        return Err(TlsError::NoClientCa);
    }
    let chain = read_certificates(&options.cert_chain)?;
    let key_der = read_key(&options.key)?;
    let mut provider = rustls::crypto::ring::default_provider();
    if let Some(list) = &options.tls12_ciphers {
        let tls12 = tls12_cipher_suites(list)?;
        provider.cipher_suites.retain(|s| s.version() == &rustls::version::TLS13);
        provider.cipher_suites.extend(tls12);
    }
    let provider = Arc::new(provider);
    let versions: &[&rustls::SupportedProtocolVersion] = match options.min_version {
        MinVersion::Tls12 => rustls::DEFAULT_VERSIONS,
        MinVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider)).with_protocol_versions(versions)?;
    // A CA file is read (and must be good) even when client certificates are not asked for.
    let roots = match options.client_ca.as_deref() {
        None => None,
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for der in read_certificates(ca)? {
                roots.add(der).map_err(|e| TlsError::BadCa { path: ca.to_owned(), detail: e.to_string() })?;
            }
            Some((roots, ca))
        }
    };
    let builder = match (options.client_auth, roots) {
        (ClientAuth::None, _) | (_, None) => builder.with_no_client_auth(),
        (auth, Some((roots, ca))) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if auth == ClientAuth::Request { verifier.allow_unauthenticated() } else { verifier };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| TlsError::BadCa { path: ca.to_owned(), detail: e.to_string() })?)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key_der)
        .map_err(|source| TlsError::CertKey { cert: options.cert_chain.clone(), key: options.key.clone(), source })?;
    config.session_storage = if options.session_cache { rustls::server::ServerSessionMemoryCache::new(SESSION_CACHE_ENTRIES_MAX) } else { Arc::new(NoServerSessionStorage {}) };
    if options.tickets {
        config.ticketer = rustls::crypto::ring::Ticketer::new()?;
    }
    Ok(Arc::new(config))
}

/// The CA bundle a client checks servers' certificates against when it is given none
/// (Debian's, from the `ca-certificates` package).
pub const SYSTEM_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// What a client's TLS configuration is built from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTlsOptions {
    /// PEM CA certificates that sign acceptable server certificates ([`SYSTEM_CA_FILE`] when
    /// not given).
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain, for a server that asks for one (memcached's
    /// `ssl_verify_mode`); its key is read from `key`, or from the same file.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Builds a client configuration from PEM files (TLS 1.2 and 1.3, sessions resumed across
/// connections). Every problem is an error here, not at the first connection.
pub fn client_config(options: &ClientTlsOptions) -> Result<Arc<ClientConfig>, TlsError> {
    let ca = match &options.ca {
        Some(ca) => ca.clone(),
        None if Path::new(SYSTEM_CA_FILE).exists() => PathBuf::from(SYSTEM_CA_FILE),
        None => return Err(TlsError::NoServerCa),
    };
    let mut roots = RootCertStore::empty();
    for der in read_certificates(&ca)? {
        roots.add(der).map_err(|e| TlsError::BadCa { path: ca.clone(), detail: e.to_string() })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider).with_protocol_versions(rustls::DEFAULT_VERSIONS)?.with_root_certificates(roots);
    let config = match (&options.cert, &options.key) {
        (None, None) => builder.with_no_client_auth(),
        (None, Some(_)) => return Err(TlsError::CertWithoutKey),
        (Some(cert), key) => {
            let key = key.as_ref().unwrap_or(cert);
            let chain = read_certificates(cert)?;
            let key_der = read_key(key)?;
            let mut config = builder.with_client_auth_cert(chain, key_der).map_err(|source| TlsError::CertKey { cert: cert.clone(), key: key.clone(), source })?;
            // An OpenSSL server that checks client certificates and sets no session ID
            // context (memcached 1.6 -Z with ssl_verify_mode) fails the resumption of a
            // session with an internal error alert: with a certificate, every connection
            // makes a full handshake.
            config.resumption = rustls::client::Resumption::disabled();
            config
        }
    };
    Ok(Arc::new(config))
}

/// The name a client checks the server's certificate for: `host` of `host:port` (an IP
/// address is checked against the certificate's IP addresses).
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    ServerName::try_from(bare.to_owned()).map_err(|e| TlsError::BadServerName { name: host.to_owned(), detail: e.to_string() })
}

fn read_pem_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    let file = std::fs::File::open(path).map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    let mut bytes = Vec::new();
    file.take(PEM_FILE_BYTES_MAX + 1).read_to_end(&mut bytes).map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    if bytes.len() as u64 > PEM_FILE_BYTES_MAX {
        return Err(TlsError::TooLarge { path: path.to_owned() });
    }
    Ok(bytes)
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_pem_file(path)?;
    let chain = CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(|e| TlsError::BadPem { path: path.to_owned(), detail: e.to_string() })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate { path: path.to_owned() });
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_pem_file(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoKey { path: path.to_owned() },
        e => TlsError::BadPem { path: path.to_owned(), detail: e.to_string() },
    })
}

/// A session and its socket as one [`Write`]: plaintext written is encrypted and sent (see
/// [`TlsSession::write_vectored`]).
pub struct TlsWriter<'a, S> {
    pub session: &'a mut TlsSession,
    pub sock: &'a mut S,
}

impl<S: Read + Write> Write for TlsWriter<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.session.write_vectored(self.sock, &[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.session.write_vectored(self.sock, bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.session.flush(self.sock)
    }
}

/// One connection's TLS session, a server's or a client's. The socket is passed to each call
/// (it stays the connection's, so that the plain path needs no indirection).
pub struct TlsSession {
    conn: Connection,
    /// A write to the socket failed for good: what is still buffered will never go, and
    /// must not keep the connection waiting for it.
    broken: bool,
}

impl TlsSession {
    /// A server's session, for a client that just connected.
    pub fn new(config: &Arc<ServerConfig>) -> io::Result<Self> {
        let conn = ServerConnection::new(Arc::clone(config)).map_err(io::Error::other)?;
        Ok(Self::of(Connection::Server(conn)))
    }

    /// A client's session with the server `name` (see [`server_name`]).
    pub fn client(config: &Arc<ClientConfig>, name: ServerName<'static>) -> io::Result<Self> {
        let conn = ClientConnection::new(Arc::clone(config), name).map_err(io::Error::other)?;
        Ok(Self::of(Connection::Client(conn)))
    }

    fn of(mut conn: Connection) -> Self {
        conn.set_buffer_limit(Some(SEND_BUFFER_BYTES_MAX));
        Self { conn, broken: false }
    }

    /// Runs the TLS handshake to its end over a blocking socket (its timeouts bound it). A
    /// signal that cuts a read or write short (EINTR) does not end it.
    pub fn handshake<S: Read + Write>(&mut self, sock: &mut S) -> io::Result<()> {
        let peer = if matches!(self.conn, Connection::Server(_)) { "client" } else { "server" };
        while self.conn.is_handshaking() {
            let (read, written) = match self.conn.complete_io(sock) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => other?,
            };
            if read == 0 && written == 0 && self.conn.is_handshaking() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("the {peer} left during the TLS handshake")));
            }
        }
        self.flush(sock)
    }

    /// Reads plaintext into `buf`. On a non-blocking socket it reads until `buf` is full or
    /// the socket has nothing more (so a short read means what a short read of a plain socket
    /// means: nothing more has arrived, and poll(2) on the socket sees whatever comes next);
    /// on a blocking one it returns as soon as it has anything. `Ok(0)`: the client closed
    /// the session (with `close_notify` or not: NBD clients often just close the socket).
    pub fn read<S: Read + Write>(&mut self, sock: &mut S, buf: &mut [u8], blocking: bool) -> io::Result<usize> {
        let mut filled = 0;
        loop {
            match self.conn.reader().read(&mut buf[filled..]) {
                Ok(0) => return Ok(filled),
                Ok(n) => {
                    filled += n;
                    if filled == buf.len() || blocking {
                        return Ok(filled);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(filled),
                Err(e) => return if filled > 0 { Ok(filled) } else { Err(e) },
            }
            // More ciphertext is needed. What the session read is all decrypted by the
            // `process_new_packets` below, so the plaintext buffer is empty here and
            // `read_tls` cannot fail for a full one.
            match self.conn.read_tls(sock) {
                Ok(_) => {}
                Err(e) if filled > 0 && matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => return Ok(filled),
                // The error comes again on the next call, when there is nothing to return.
                Err(_) if filled > 0 => return Ok(filled),
                Err(e) => return Err(e),
            }
            if let Err(e) = self.conn.process_new_packets() {
                // The alert rustls queued for the client goes out if it can.
                let _ = self.conn.write_tls(sock);
                return if filled > 0 { Ok(filled) } else { Err(io::Error::new(io::ErrorKind::InvalidData, e)) };
            }
        }
    }

    /// Encrypts what fits of `bufs` into the session and writes what the socket takes. Returns
    /// the plaintext bytes taken; `WouldBlock` only when it took none (the socket is full and
    /// so is the session's buffer).
    pub fn write_vectored<S: Read + Write>(&mut self, sock: &mut S, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "an earlier write to the socket failed"));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        loop {
            let taken = self.conn.writer().write_vectored(bufs)?;
            match self.flush(sock) {
                // All sent: a buffer that was full has room now.
                Ok(()) if taken == 0 && total > 0 => continue,
                Ok(()) => return Ok(taken),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && taken > 0 => return Ok(taken),
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes the ciphertext the session holds until none is left or the socket is full
    /// (`WouldBlock`; a write a signal cut short is made again).
    pub fn flush<S: Read + Write>(&mut self, sock: &mut S) -> io::Result<()> {
        while self.write_pending() {
            match self.conn.write_tls(sock) {
                Ok(0) => return self.fail(io::Error::new(io::ErrorKind::WriteZero, "the socket took no TLS bytes")),
                Ok(_) => {}
                // No byte went: the write is made again (returning EINTR here would lose
                // count of the plaintext `write_vectored` already took, and a caller's retry
                // would send it twice).
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(e),
                Err(e) => return self.fail(e),
            }
        }
        Ok(())
    }

    fn fail(&mut self, e: io::Error) -> io::Result<()> {
        self.broken = true;
        Err(e)
    }

    /// The handshake has not finished (a failure now is a failed handshake).
    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// Ciphertext waits for the socket: the caller must wait for POLLOUT, not only POLLIN.
    pub fn write_pending(&self) -> bool {
        !self.broken && self.conn.wants_write()
    }

    /// Something to read without the socket: decrypted plaintext, the client's
    /// `close_notify`, or a session error (which the next read reports). Poll on the socket
    /// would not wake for any of these.
    pub fn read_pending(&mut self) -> bool {
        match self.conn.process_new_packets() {
            Ok(state) => state.plaintext_bytes_to_read() > 0 || state.peer_has_closed(),
            Err(_) => true,
        }
    }

    /// Takes the ciphertext a non-blocking socket holds into the session without reading
    /// plaintext out (for a look at an idle connection): `Ok(0)` when the peer closed (with
    /// `close_notify` or not), `Ok(n)` when `n` bytes of plaintext wait, `WouldBlock` when
    /// nothing does (records that carry no data, as TLS 1.3's session tickets, are taken in).
    pub fn peek<S: Read + Write>(&mut self, sock: &mut S) -> io::Result<usize> {
        loop {
            match self.conn.process_new_packets() {
                Ok(state) if state.plaintext_bytes_to_read() > 0 => return Ok(state.plaintext_bytes_to_read()),
                Ok(state) if state.peer_has_closed() => return Ok(0),
                Ok(_) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            match self.conn.read_tls(sock) {
                Ok(0) => return Ok(0),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends `close_notify` if the socket takes it at once (the connection ends right after).
    pub fn close<S: Read + Write>(&mut self, sock: &mut S) {
        self.conn.send_close_notify();
        let _ = self.flush(sock);
    }
}

#[cfg(test)]
mod tests {
    //! A session over a Unix socket pair, a rustls client on the other end: what the
    //! transmission loop relies on when the socket is non-blocking.

    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use kura_testkit::{TestCerts, try_or_skip};

    use super::*;

    type Client = rustls::StreamOwned<rustls::ClientConnection, UnixStream>;

    fn options(cert: &Path, key: &Path) -> ServerTlsOptions {
        ServerTlsOptions { cert_chain: cert.to_owned(), key: key.to_owned(), client_ca: None, client_auth: ClientAuth::None, min_version: MinVersion::Tls12, session_cache: true, tickets: false, tls12_ciphers: None }
    }

    /// A session after its handshake, its (now non-blocking) socket, and the client.
    fn connected(certs: &TestCerts) -> (TlsSession, UnixStream, Client) {
        let config = server_config(&options(&certs.path("server.pem"), &certs.path("server-key.pem"))).unwrap();
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(certs.path("ca.pem")).unwrap()).unwrap();
        let client_config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider())).with_safe_default_protocol_versions().unwrap().with_root_certificates(roots).with_no_client_auth();
        let (mut server_sock, client_sock) = UnixStream::pair().unwrap();
        let client = std::thread::spawn(move || {
            let name = rustls_pki_types::ServerName::try_from("localhost".to_owned()).unwrap();
            let mut client = rustls::StreamOwned::new(rustls::ClientConnection::new(Arc::new(client_config), name).unwrap(), client_sock);
            while client.conn.is_handshaking() {
                client.conn.complete_io(&mut client.sock).unwrap();
            }
            client
        });
        let mut session = TlsSession::new(&config).unwrap();
        session.handshake(&mut server_sock).unwrap();
        let client = client.join().unwrap();
        server_sock.set_nonblocking(true).unwrap();
        (session, server_sock, client)
    }

    fn wait(sock: &UnixStream, events: i16) {
        let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events, revents: 0 };
        // SAFETY: one valid pollfd that lives across the call; poll(2) writes only `revents`.
        let rc = unsafe { libc::poll(&mut pfd, 1, 10_000) };
        assert_eq!(rc, 1, "the socket became ready within 10 s");
    }

    #[test]
    fn nonblocking_reads_fill_the_buffer_or_drain_the_socket() {
        let certs = try_or_skip!(TestCerts::make());
        let (mut session, mut sock, mut client) = connected(&certs);
        const SENT_BYTES: usize = 3 << 20;
        let data: Vec<u8> = (0..SENT_BYTES).map(|i| (i * 7 + i / 4099) as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            client.write_all(&sent).unwrap();
            client.flush().unwrap();
            client.conn.send_close_notify();
            client.conn.complete_io(&mut client.sock).unwrap();
            client
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 100_000];
        loop {
            match session.read(&mut sock, &mut buf, false) {
                Ok(0) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    // A short read took everything decrypted: nothing is left that poll on
                    // the socket would not announce.
                    if n < buf.len() {
                        assert!(!session.read_pending() || got.len() == SENT_BYTES, "plaintext left after a short read");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(!session.read_pending(), "WouldBlock with plaintext pending");
                    wait(&sock, libc::POLLIN);
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(got == data, "{} bytes read of {SENT_BYTES}", got.len());
        drop(writer.join().unwrap());
    }

    #[test]
    fn nonblocking_writes_keep_what_the_socket_refuses_until_it_drains() {
        let certs = try_or_skip!(TestCerts::make());
        let (mut session, mut sock, mut client) = connected(&certs);
        const SENT_BYTES: usize = 4 << 20;
        let data: Vec<u8> = (0..SENT_BYTES).map(|i| (i * 13 + i / 8191) as u8).collect();
        // Nobody reads yet: the socket fills, then the session's buffer, then WouldBlock.
        let mut taken = 0;
        loop {
            match session.write_vectored(&mut sock, &[IoSlice::new(&data[taken..])]) {
                Ok(n) => taken += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
            assert!(taken < SENT_BYTES, "the socket and the session's buffer cannot hold 4 MiB");
        }
        assert!(session.write_pending(), "a full session holds ciphertext");
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; SENT_BYTES];
            client.read_exact(&mut got).unwrap();
            got
        });
        while taken < SENT_BYTES || session.write_pending() {
            if taken < SENT_BYTES {
                match session.write_vectored(&mut sock, &[IoSlice::new(&data[taken..])]) {
                    Ok(n) => {
                        taken += n;
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            } else {
                match session.flush(&mut sock) {
                    Ok(()) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            }
            wait(&sock, libc::POLLOUT);
        }
        assert!(reader.join().unwrap() == data);
    }

    #[test]
    fn a_cipher_list_chooses_the_tls12_suites_and_keeps_tls13s() {
        let certs = try_or_skip!(TestCerts::make());
        let mut chosen = options(&certs.path("server.pem"), &certs.path("server-key.pem"));
        chosen.tls12_ciphers = Some("ECDHE-ECDSA-CHACHA20-POLY1305".to_owned());
        let config = server_config(&chosen).unwrap();
        let suites: Vec<_> = config.crypto_provider().cipher_suites.iter().map(|s| (s.version().version, s.suite())).collect();
        let tls13 = rustls::crypto::ring::DEFAULT_CIPHER_SUITES.iter().filter(|s| s.version() == &rustls::version::TLS13).count();
        assert_eq!(suites.len(), tls13 + 1, "{suites:?}");
        assert!(suites.contains(&(rustls::ProtocolVersion::TLSv1_2, rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256)), "{suites:?}");
        chosen.tls12_ciphers = Some("RC4-SHA".to_owned());
        assert!(matches!(server_config(&chosen).unwrap_err(), TlsError::CipherList(CipherListError::NoCipher { .. })));
    }

    #[test]
    fn bad_files_are_refused_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "junk\n").unwrap();
        let err = server_config(&options(&missing, &missing)).unwrap_err();
        assert!(matches!(err, TlsError::Read { .. }) && err.to_string().contains("missing.pem"), "{err}");
        let err = server_config(&options(&junk, &junk)).unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate { .. }) && err.to_string().contains("junk.pem"), "{err}");
        let mut asking = options(&junk, &junk);
        asking.client_auth = ClientAuth::Require;
        assert!(matches!(server_config(&asking).unwrap_err(), TlsError::NoClientCa));
    }
}
