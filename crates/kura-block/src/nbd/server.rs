//! The NBD server: one export per volume, over TCP and Unix sockets.
//!
//! Each connection has its own thread, its own pool context and [`BlockQueue`] (the paper's
//! per-core design: nothing is shared on the request path but the per-volume block locks).
//! A thread reads whatever requests have arrived with one `read`, turns them into pool
//! requests submitted together, and writes every finished reply with one `writev`. While pool
//! requests are in flight it waits on the pool and the socket together (new requests start as
//! soon as they arrive); when nothing is in flight it waits on the socket alone.
//!
//! With TLS ([`NbdConfig::tls`], see [`super::tls`]) a client's `NBD_OPT_STARTTLS` turns the
//! connection's [`Stream`] into a TLS session for the rest of the handshake and for
//! transmission; the loop stays the same, with two additions, because poll(2) on the socket
//! sees only ciphertext: requests the session decrypted ahead are read without waiting for the
//! socket (`read_pending`), and ciphertext the socket did not take keeps the wait on POLLOUT
//! (`write_pending`) until it is flushed. A read over TLS goes on until the buffer is full or
//! the socket is empty, so a short read means what it means on a plain socket.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kura_pool::{Context, Pool};

use super::proto::{self, ClientOption, Command, ExportLimits, ProtoError};
use super::tls::{NbdTls, TlsSession};
use crate::error::BlockError;
use crate::layout::{BLOCK_SIZE_BYTES, SECTOR_SIZE_BYTES};
use crate::queue::{BlockLocks, BlockQueue, BlockState, Done, REPLIES_PER_GROUP, Volume};
use crate::volume::{VolumeMeta, Volumes};

/// The NBD port (IANA).
pub const PORT_DEFAULT: u16 = 10809;
/// Largest read or write a client may send (advertised in `NBD_INFO_BLOCK_SIZE`).
pub const MAX_BLOCK_BYTES_DEFAULT: u32 = 32 << 20;
pub const MAX_BLOCK_BYTES_MAX: u32 = 64 << 20;
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// Longest busy poll a connection may be given ([`NbdConfig::busy_poll_us`]).
pub const BUSY_POLL_US_MAX: u32 = 10_000;
/// A handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Options one handshake may send before the server hangs up.
const OPTIONS_MAX: usize = 1024;
/// Longest option data accepted (an export name is at most 4 KiB).
const OPTION_DATA_BYTES_MAX: u32 = proto::STRING_BYTES_MAX as u32 + 64;
/// Requests one connection keeps in flight before it stops reading new ones.
const REQUESTS_IN_FLIGHT_MAX: usize = 1024;
/// Bytes of reads and writes one connection keeps in flight before it stops reading.
const IN_FLIGHT_BYTES_MAX: u64 = 256 << 20;
/// Bytes of replies waiting for the socket before the connection stops reading.
const OUT_BYTES_MAX: usize = 256 << 20;
/// The receive buffer's initial size (it grows to hold one whole write).
const INBUF_BYTES: usize = 256 << 10;
/// Replies per `writev`.
const REPLIES_PER_WRITE_MAX: usize = 256;
/// Read buffers kept for reuse per connection, at most, and their bytes in all.
const SPARE_BUFFERS_MAX: usize = 64;
const SPARE_BYTES_MAX: usize = 8 << 20;
/// Spare buffers' bytes a connection keeps while it waits for its client with nothing in
/// flight (its receive buffer goes back to [`INBUF_BYTES`] then too).
const SPARE_IDLE_BYTES_MAX: usize = 256 << 10;
/// Bytes of requests in flight, replies waiting for their sockets and buffers grown to hold
/// large requests, over all connections, past which a connection takes no new read or write
/// — except one at a time when it has none in flight or unanswered, so that clients which do not read
/// their replies cannot keep the others from being served: memory stays under this plus one
/// largest request per connection, whatever the clients do.
pub const MEMORY_BYTES_MAX_DEFAULT: u64 = 1 << 30;
/// How long a connection held back by [`NbdConfig::memory_max_bytes`] waits before it looks
/// again (others' completions free the room; nothing wakes it).
const OVER_BUDGET_RETRY_MS: i32 = 5;
/// Most bytes one `NBD_CMD_BLOCK_STATUS` reply describes (an existence probe per block; the
/// protocol lets the reply cover less than asked, and clients ask again from where it ended).
pub const BLOCK_STATUS_BYTES_MAX: u32 = 16 << 20;
/// How often idle listeners and connections look at the stop flag.
const STOP_CHECK_INTERVAL_MS: i32 = 200;
/// How long `stop` waits for connections to finish their requests.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// How to serve.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    /// Listen on this TCP address (e.g. `127.0.0.1:10809`).
    pub tcp: Option<SocketAddr>,
    /// Listen on this Unix socket (created; an existing socket file is replaced).
    pub unix: Option<PathBuf>,
    /// The volumes exported; `None`: every volume of the pool (looked up at each handshake).
    pub volumes: Option<Vec<String>>,
    pub read_only: bool,
    pub connections_max: usize,
    /// Pool operations each connection keeps in flight, at most.
    pub window: usize,
    pub max_block_bytes: u32,
    /// After its last reply goes out, a connection with nothing in flight watches the socket
    /// this long without sleeping before it waits for the client (0: it sleeps at once). A
    /// client at queue depth 1 sends its next request within microseconds of a reply, and
    /// finding it without a wake-up halves the latency of requests the disk does not serve
    /// (writes, flushes of nothing, cached reads), at the cost of CPU while polling.
    pub busy_poll_us: u32,
    /// Memory for requests and replies over all connections (see [`MEMORY_BYTES_MAX_DEFAULT`]);
    /// at least `max_block_bytes`, so that any one request fits.
    pub memory_max_bytes: u64,
    /// TLS offered to clients (`NBD_OPT_STARTTLS`), and whether they must use it; `None`:
    /// STARTTLS is refused (`NBD_REP_ERR_POLICY`).
    pub tls: Option<NbdTls>,
}

impl Default for NbdConfig {
    fn default() -> Self {
        Self {
            tcp: None,
            unix: None,
            volumes: None,
            read_only: false,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            window: crate::queue::WINDOW_MAX,
            max_block_bytes: MAX_BLOCK_BYTES_DEFAULT,
            busy_poll_us: 0,
            memory_max_bytes: MEMORY_BYTES_MAX_DEFAULT,
            tls: None,
        }
    }
}

/// Counters of a running server.
#[derive(Debug, Default)]
pub struct NbdStats {
    pub connections_accepted: AtomicU64,
    pub connections_refused: AtomicU64,
    pub connections_active: AtomicUsize,
    pub requests: AtomicU64,
    pub error_replies: AtomicU64,
    /// Connections closed for a protocol violation.
    pub protocol_errors: AtomicU64,
}

struct Shared {
    pool: Pool,
    config: NbdConfig,
    stop: AtomicBool,
    /// Block locks per volume id, shared by every connection to the volume.
    locks: Mutex<HashMap<u64, Arc<BlockLocks>>>,
    stats: NbdStats,
    /// What the connections hold against [`NbdConfig::memory_max_bytes`].
    charged_bytes: AtomicU64,
}

/// A running NBD server; [`NbdServer::stop`] ends it.
pub struct NbdServer {
    shared: Arc<Shared>,
    acceptors: Vec<JoinHandle<()>>,
    tcp_addr: Option<SocketAddr>,
    unix_path: Option<PathBuf>,
}

impl NbdServer {
    /// Binds the listeners and starts serving.
    pub fn start(pool: Pool, config: NbdConfig) -> io::Result<Self> {
        if config.tcp.is_none() && config.unix.is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no TCP address and no Unix socket to listen on"));
        }
        if !(BLOCK_SIZE_BYTES as u32..=MAX_BLOCK_BYTES_MAX).contains(&config.max_block_bytes) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("max block size must be 4096..={MAX_BLOCK_BYTES_MAX}")));
        }
        if config.memory_max_bytes < u64::from(config.max_block_bytes) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the memory limit ({} bytes) must hold one largest request ({} bytes)", config.memory_max_bytes, config.max_block_bytes),
            ));
        }
        let tcp = config.tcp.map(TcpListener::bind).transpose()?;
        let tcp_addr = tcp.as_ref().map(TcpListener::local_addr).transpose()?;
        let unix = match &config.unix {
            Some(path) => {
                if std::fs::symlink_metadata(path).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())) {
                    std::fs::remove_file(path)?;
                }
                Some(UnixListener::bind(path)?)
            }
            None => None,
        };
        let unix_path = config.unix.clone();
        let shared = Arc::new(Shared { pool, config, stop: AtomicBool::new(false), locks: Mutex::new(HashMap::new()), stats: NbdStats::default(), charged_bytes: AtomicU64::new(0) });
        let mut acceptors = Vec::new();
        if let Some(listener) = tcp {
            listener.set_nonblocking(true)?;
            let shared = Arc::clone(&shared);
            acceptors.push(std::thread::Builder::new().name("nbd-accept-tcp".into()).spawn(move || accept_loop(&shared, &Listener::Tcp(listener)))?);
        }
        if let Some(listener) = unix {
            listener.set_nonblocking(true)?;
            let shared = Arc::clone(&shared);
            acceptors.push(std::thread::Builder::new().name("nbd-accept-unix".into()).spawn(move || accept_loop(&shared, &Listener::Unix(listener)))?);
        }
        Ok(Self { shared, acceptors, tcp_addr, unix_path })
    }

    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn unix_path(&self) -> Option<&Path> {
        self.unix_path.as_deref()
    }

    pub fn stats(&self) -> &NbdStats {
        &self.shared.stats
    }

    /// Stops accepting, lets every connection finish the requests it has read (new ones are
    /// not read), closes them and removes the Unix socket.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for handle in self.acceptors.drain(..) {
            let _ = handle.join();
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while self.shared.stats.connections_active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(path) = &self.unix_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        if !self.acceptors.is_empty() {
            self.shutdown();
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A client's socket.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write_vectored(bufs),
            Socket::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A client connection: its socket, and once the client sent `NBD_OPT_STARTTLS`, the TLS
/// session every later byte goes through. Without TLS, reads and writes go straight to the
/// socket (one branch more, no copy, no syscall).
struct Stream {
    sock: Socket,
    tls: Option<Box<TlsSession>>,
    nonblocking: bool,
}

impl Stream {
    fn new(sock: Socket) -> Self {
        Self { sock, tls: None, nonblocking: false }
    }

    fn set_nonblocking(&mut self, on: bool) -> io::Result<()> {
        match &self.sock {
            Socket::Tcp(s) => s.set_nonblocking(on)?,
            Socket::Unix(s) => s.set_nonblocking(on)?,
        }
        self.nonblocking = on;
        Ok(())
    }

    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.sock {
            Socket::Tcp(s) => s.set_read_timeout(timeout).and_then(|()| s.set_write_timeout(timeout)),
            Socket::Unix(s) => s.set_read_timeout(timeout).and_then(|()| s.set_write_timeout(timeout)),
        }
    }

    /// Ends the connection: TLS's `close_notify` first (if the socket takes it at once), then
    /// both directions of the socket.
    fn shutdown(&mut self) {
        if let Some(tls) = &mut self.tls {
            tls.close(&mut self.sock);
        }
        let _ = match &self.sock {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Upgrades the (blocking) connection to TLS, after `NBD_REP_ACK` to `NBD_OPT_STARTTLS`
    /// went out in plain text.
    fn start_tls(&mut self, config: &Arc<kura_tls::rustls::ServerConfig>) -> io::Result<()> {
        debug_assert!(self.tls.is_none() && !self.nonblocking);
        let mut tls = Box::new(TlsSession::new(config)?);
        tls.handshake(&mut self.sock)?;
        self.tls = Some(tls);
        Ok(())
    }

    /// Input that poll(2) on the socket cannot see: plaintext TLS decrypted ahead.
    fn read_pending(&mut self) -> bool {
        self.tls.as_mut().is_some_and(|tls| tls.read_pending())
    }

    /// Output waiting in the TLS session for the socket to drain.
    fn write_pending(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.write_pending())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match &self.sock {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.tls {
            None => self.sock.read(buf),
            Some(tls) => tls.read(&mut self.sock, buf, !self.nonblocking),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.tls {
            None => self.sock.write(buf),
            Some(tls) => tls.write_vectored(&mut self.sock, &[IoSlice::new(buf)]),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match &mut self.tls {
            None => self.sock.write_vectored(bufs),
            Some(tls) => tls.write_vectored(&mut self.sock, bufs),
        }
    }

    /// Writes what the TLS session holds (`WouldBlock`: the socket is full).
    fn flush(&mut self) -> io::Result<()> {
        match &mut self.tls {
            None => Ok(()),
            Some(tls) => tls.flush(&mut self.sock),
        }
    }
}

/// Waits until `fd` is readable (if `read`) or writable (if `write`), or `timeout_ms`
/// passes. Returns (readable, writable); a hang-up or error counts as readable.
fn wait_fd(fd: RawFd, read: bool, write: bool, timeout_ms: i32) -> io::Result<(bool, bool)> {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    let mut pfd = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: `pfd` is one valid pollfd that lives across the call; poll(2) writes only its
    // `revents`.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok((false, false)) } else { Err(e) };
    }
    let r = pfd.revents;
    Ok((r & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0, r & libc::POLLOUT != 0))
}

fn accept_loop(shared: &Arc<Shared>, listener: &Listener) {
    let fd = match listener {
        Listener::Tcp(l) => l.as_raw_fd(),
        Listener::Unix(l) => l.as_raw_fd(),
    };
    while !shared.stop.load(Ordering::SeqCst) {
        match wait_fd(fd, true, false, STOP_CHECK_INTERVAL_MS) {
            Ok((true, _)) => {}
            Ok(_) => continue,
            Err(e) => {
                tracing::error!(error = %e, "nbd: poll on the listener failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        let accepted = match listener {
            Listener::Tcp(l) => l.accept().map(|(s, peer)| {
                let _ = s.set_nodelay(true);
                (Stream::new(Socket::Tcp(s)), peer.to_string())
            }),
            Listener::Unix(l) => l.accept().map(|(s, _)| (Stream::new(Socket::Unix(s)), "unix".to_owned())),
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "nbd: accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let active = shared.stats.connections_active.fetch_add(1, Ordering::SeqCst);
        if active >= shared.config.connections_max {
            shared.stats.connections_active.fetch_sub(1, Ordering::SeqCst);
            shared.stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer, max = shared.config.connections_max, "nbd: too many connections; closing the new one");
            continue;
        }
        shared.stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
        let conn_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new().name("nbd-conn".into()).spawn(move || {
            if let Err(e) = serve_connection(&conn_shared, stream, &peer) {
                tracing::debug!(peer, error = %e, "nbd: connection ended with an error");
            }
            conn_shared.stats.connections_active.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            shared.stats.connections_active.fetch_sub(1, Ordering::SeqCst);
            tracing::error!(error = %e, "nbd: cannot start a connection thread");
        }
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("protocol violation: {0}")]
    Proto(#[from] ProtoError),
    #[error("{0}")]
    Refused(String),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Block(#[from] BlockError),
}

fn serve_connection(shared: &Arc<Shared>, mut stream: Stream, peer: &str) -> Result<(), ConnError> {
    stream.set_timeouts(Some(HANDSHAKE_TIMEOUT))?;
    let mut ctx = match shared.pool.context() {
        Ok(ctx) => ctx,
        Err(e) => {
            tracing::warn!(peer, error = %e, "nbd: no pool context for a new connection; closing it");
            return Err(ConnError::Block(BlockError::from_pool(e)));
        }
    };
    let negotiated = match handshake(shared, &mut stream, &mut ctx) {
        Ok(n) => n,
        Err(e) => {
            if matches!(e, ConnError::Proto(_) | ConnError::Refused(_)) {
                shared.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
            }
            stream.shutdown();
            return Err(e);
        }
    };
    let Some((volume, limits)) = negotiated else {
        stream.shutdown();
        return Ok(());
    };
    tracing::debug!(peer, volume = volume.meta.name, "nbd: transmission");
    stream.set_timeouts(None)?;
    stream.set_nonblocking(true)?;
    let queue = BlockQueue::new(ctx, shared.config.window);
    let mut t = Transmission::new(shared, stream, queue, volume, limits);
    let result = t.run();
    if let Err(ConnError::Proto(_)) = &result {
        shared.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }
    t.stream.shutdown();
    result
}

fn transmission_flags(read_only: bool, structured: bool) -> u16 {
    let mut flags = proto::FLAG_HAS_FLAGS
        | proto::FLAG_SEND_FLUSH
        | proto::FLAG_SEND_FUA
        | proto::FLAG_SEND_TRIM
        | proto::FLAG_SEND_WRITE_ZEROES
        | proto::FLAG_SEND_FAST_ZERO
        // Flushes are pool-wide barriers, so they cover writes of every connection.
        | proto::FLAG_CAN_MULTI_CONN;
    if read_only {
        flags |= proto::FLAG_READ_ONLY;
    }
    if structured {
        // A read is always answered with one chunk.
        flags |= proto::FLAG_SEND_DF;
    }
    flags
}

/// The names exported: the configured ones, or every volume of the pool.
fn export_names(shared: &Shared, ctx: &mut Context) -> Result<Vec<String>, BlockError> {
    match &shared.config.volumes {
        Some(names) => Ok(names.clone()),
        None => Ok(Volumes::new(ctx).list()?.into_iter().filter(|m| m.state == crate::volume::VolumeState::Active).map(|m| m.name).collect()),
    }
}

/// The volume behind an export name ("" is the default export: the only one, if there is
/// exactly one).
fn resolve(shared: &Shared, ctx: &mut Context, name: &[u8]) -> Result<Arc<Volume>, BlockError> {
    let name = std::str::from_utf8(name).map_err(|_| BlockError::VolumeNotFound(String::from_utf8_lossy(name).into_owned()))?;
    let name = if name.is_empty() {
        let names = export_names(shared, ctx)?;
        match names.as_slice() {
            [only] => only.clone(),
            _ => return Err(BlockError::VolumeNotFound(format!("(default export: {} volumes are exported, name one)", names.len()))),
        }
    } else {
        if shared.config.volumes.as_ref().is_some_and(|v| !v.iter().any(|n| n == name)) {
            return Err(BlockError::VolumeNotFound(name.to_owned()));
        }
        name.to_owned()
    };
    let meta = Volumes::new(ctx).open(&name)?;
    let locks = Arc::clone(shared.locks.lock().unwrap_or_else(|e| e.into_inner()).entry(meta.id).or_default());
    Ok(Arc::new(Volume { meta, locks }))
}

fn description(meta: &VolumeMeta) -> String {
    format!("kura volume {} (id {}, {} bytes)", meta.name, meta.id, meta.size_bytes)
}

fn read_exact_or_eof(stream: &mut Stream, buf: &mut [u8]) -> Result<bool, ConnError> {
    match stream.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The fixed newstyle handshake. `Ok(None)`: the client aborted or left.
fn handshake(shared: &Shared, stream: &mut Stream, ctx: &mut Context) -> Result<Option<(Arc<Volume>, ExportLimits)>, ConnError> {
    stream.write_all(&proto::greeting())?;
    let mut flags = [0u8; 4];
    if !read_exact_or_eof(stream, &mut flags)? {
        return Ok(None);
    }
    let (_fixed, no_zeroes) = proto::parse_client_flags(&flags)?;
    let read_only = shared.config.read_only;
    let max_block = shared.config.max_block_bytes;
    // NBD_OPT_STRUCTURED_REPLY was acknowledged; the volume NBD_OPT_SET_META_CONTEXT last
    // selected base:allocation for (it holds only for that export).
    let mut structured = false;
    let mut allocation_of: Option<String> = None;
    let tls = shared.config.tls.as_ref();
    let mut out = Vec::new();
    let mut data = Vec::new();
    for _ in 0..OPTIONS_MAX {
        let mut header = [0u8; proto::OPTION_HEADER_BYTES];
        if !read_exact_or_eof(stream, &mut header)? {
            return Ok(None);
        }
        let (option, len) = proto::parse_option_header(&header)?;
        if len > OPTION_DATA_BYTES_MAX {
            return Err(ConnError::Refused(format!("option {option} with {len} bytes of data (at most {OPTION_DATA_BYTES_MAX})")));
        }
        data.resize(len as usize, 0);
        if !read_exact_or_eof(stream, &mut data)? {
            return Ok(None);
        }
        out.clear();
        if shared.stop.load(Ordering::SeqCst) {
            proto::option_reply(&mut out, option, proto::REP_ERR_SHUTDOWN, b"server shutting down");
            stream.write_all(&out)?;
            continue;
        }
        if tls.is_some_and(|t| t.required) && !stream.is_tls() {
            match option {
                proto::OPT_STARTTLS | proto::OPT_ABORT => {}
                // It cannot be answered with an error: the protocol says to end the session.
                proto::OPT_EXPORT_NAME => return Err(ConnError::Refused("NBD_OPT_EXPORT_NAME without TLS, which this server requires".into())),
                _ => {
                    proto::option_reply(&mut out, option, proto::REP_ERR_TLS_REQD, b"this server requires TLS: send NBD_OPT_STARTTLS first");
                    stream.write_all(&out)?;
                    continue;
                }
            }
        }
        let parsed = match proto::parse_option(option, &data) {
            Ok(parsed) => parsed,
            Err(invalid) => {
                proto::option_reply(&mut out, option, proto::REP_ERR_INVALID, invalid.0.as_bytes());
                stream.write_all(&out)?;
                continue;
            }
        };
        match parsed {
            ClientOption::ExportName(name) => {
                // This option cannot be answered with an error: an unknown export ends the session.
                let volume = resolve(shared, ctx, name).map_err(|e| ConnError::Refused(format!("NBD_OPT_EXPORT_NAME: {e}")))?;
                proto::export_name_reply(&mut out, volume.meta.size_bytes, transmission_flags(read_only, structured), no_zeroes);
                stream.write_all(&out)?;
                let base_allocation = allocation_of.as_deref() == Some(volume.meta.name.as_str());
                let limits = ExportLimits { size_bytes: volume.meta.size_bytes, min_block_bytes: 1, max_block_bytes: max_block, read_only, structured, base_allocation };
                return Ok(Some((volume, limits)));
            }
            ClientOption::Abort => {
                proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
                let _ = stream.write_all(&out);
                return Ok(None);
            }
            ClientOption::List => match export_names(shared, ctx) {
                Ok(names) => {
                    for name in names {
                        proto::server_entry(&mut out, option, name.as_bytes(), &[]);
                    }
                    proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
                }
                Err(e) => proto::option_reply(&mut out, option, proto::REP_ERR_UNSUP, e.to_string().as_bytes()),
            },
            ClientOption::StartTls => match tls {
                None => proto::option_reply(&mut out, option, proto::REP_ERR_POLICY, b"this server does not offer TLS"),
                Some(_) if stream.is_tls() => proto::option_reply(&mut out, option, proto::REP_ERR_INVALID, b"TLS is already active"),
                Some(tls) => {
                    proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
                    stream.write_all(&out)?;
                    // A failed TLS handshake ends the session: the acknowledgement went out,
                    // there is no way back to plain text.
                    stream.start_tls(&tls.config)?;
                    // Nothing negotiated in plain text survives the upgrade (the protocol says
                    // so: a man in the middle may have chosen it).
                    structured = false;
                    allocation_of = None;
                    continue;
                }
            },
            ClientOption::StructuredReply => {
                structured = true;
                proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
            }
            ClientOption::ListMetaContext(meta) | ClientOption::SetMetaContext(meta) => {
                let listing = matches!(parsed, ClientOption::ListMetaContext(_));
                if !structured {
                    proto::option_reply(&mut out, option, proto::REP_ERR_INVALID, b"metadata contexts need structured replies, negotiated first");
                } else {
                    match resolve(shared, ctx, meta.name) {
                        Ok(volume) => {
                            let selected = meta.selects_base_allocation(listing);
                            if selected {
                                // Listed contexts have no id: the protocol reserves 0 for them.
                                let id = if listing { 0 } else { proto::CONTEXT_ID_BASE_ALLOCATION };
                                proto::meta_context_entry(&mut out, option, id, proto::CONTEXT_BASE_ALLOCATION);
                            }
                            if !listing {
                                allocation_of = selected.then(|| volume.meta.name.clone());
                            }
                            proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
                        }
                        Err(e @ (BlockError::VolumeNotFound(_) | BlockError::VolumeDeleting(_) | BlockError::BadName { .. })) => {
                            proto::option_reply(&mut out, option, proto::REP_ERR_UNKNOWN, e.to_string().as_bytes());
                        }
                        Err(e) => proto::option_reply(&mut out, option, proto::REP_ERR_SHUTDOWN, format!("cannot read the volume: {e}").as_bytes()),
                    }
                }
            }
            ClientOption::Info(info) | ClientOption::Go(info) => match resolve(shared, ctx, info.name) {
                Ok(volume) => {
                    let meta = &volume.meta;
                    proto::option_reply(&mut out, option, proto::REP_INFO, &proto::info_export(meta.size_bytes, transmission_flags(read_only, structured)));
                    if info.wants(proto::INFO_NAME) {
                        proto::option_reply(&mut out, option, proto::REP_INFO, &proto::info_string(proto::INFO_NAME, meta.name.as_bytes()));
                    }
                    if info.wants(proto::INFO_DESCRIPTION) {
                        proto::option_reply(&mut out, option, proto::REP_INFO, &proto::info_string(proto::INFO_DESCRIPTION, description(meta).as_bytes()));
                    }
                    // A client that asks for block sizes promises to honour them; one that
                    // does not gets byte granularity (read-modify-write does the rest).
                    let min_block = if info.wants(proto::INFO_BLOCK_SIZE) { SECTOR_SIZE_BYTES as u32 } else { 1 };
                    proto::option_reply(&mut out, option, proto::REP_INFO, &proto::info_block_size(min_block, BLOCK_SIZE_BYTES as u32, max_block));
                    proto::option_reply(&mut out, option, proto::REP_ACK, &[]);
                    if matches!(parsed, ClientOption::Go(_)) {
                        stream.write_all(&out)?;
                        let base_allocation = allocation_of.as_deref() == Some(meta.name.as_str());
                        let limits = ExportLimits { size_bytes: meta.size_bytes, min_block_bytes: min_block, max_block_bytes: max_block, read_only, structured, base_allocation };
                        return Ok(Some((volume, limits)));
                    }
                }
                Err(e @ (BlockError::VolumeNotFound(_) | BlockError::VolumeDeleting(_) | BlockError::BadName { .. })) => {
                    proto::option_reply(&mut out, option, proto::REP_ERR_UNKNOWN, e.to_string().as_bytes());
                }
                Err(e) => proto::option_reply(&mut out, option, proto::REP_ERR_SHUTDOWN, format!("cannot read the volume: {e}").as_bytes()),
            },
            ClientOption::Unsupported(_) => proto::option_reply(&mut out, option, proto::REP_ERR_UNSUP, &[]),
        }
        stream.write_all(&out)?;
    }
    Err(ConnError::Refused(format!("more than {OPTIONS_MAX} options")))
}

/// Bytes of the longest reply header: a structured read's hole chunk.
const REPLY_HEADER_BYTES_MAX: usize = proto::OFFSET_HOLE_REPLY_BYTES;

/// A reply waiting for the socket.
struct OutReply {
    /// The simple reply header or the structured chunk header (and the chunk's fixed fields).
    header: [u8; REPLY_HEADER_BYTES_MAX],
    header_len: u8,
    data: Option<Vec<u8>>,
    /// Bytes of header + data already written.
    written: usize,
}

impl OutReply {
    fn new(header: &[u8], data: Option<Vec<u8>>) -> Self {
        let mut h = [0u8; REPLY_HEADER_BYTES_MAX];
        h[..header.len()].copy_from_slice(header);
        Self { header: h, header_len: header.len() as u8, data, written: 0 }
    }

    fn header(&self) -> &[u8] {
        &self.header[..usize::from(self.header_len)]
    }

    fn len(&self) -> usize {
        usize::from(self.header_len) + self.data.as_ref().map_or(0, Vec::len)
    }
}

/// What the reply of a request in flight needs to know of it.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Read { offset: u64 },
    Write,
    Status { offset: u64, len: u32, req_one: bool },
}

/// A request in flight whose reply is not a bare simple reply, or whose bytes count
/// towards the connection's limit.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    bytes: u64,
    pending: Pending,
}

/// The receive buffer: bytes `start..end` are read and not yet parsed.
struct InBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        debug_assert!(self.start <= self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Makes room for `bytes` unparsed bytes in all (so a whole write fits).
    fn reserve_total(&mut self, bytes: usize) {
        if self.buf.len() - self.start >= bytes {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        if self.buf.len() < bytes {
            self.buf.resize(bytes, 0);
        }
    }

    /// Reads what the socket has into the free space: (bytes read, whether that was less
    /// than the space, i.e. the socket had nothing more at that moment).
    fn fill(&mut self, stream: &mut Stream) -> io::Result<(usize, bool)> {
        if self.end == self.buf.len() {
            if self.start == 0 {
                return Ok((usize::MAX, false)); // full: parse first
            }
            self.reserve_total(self.buf.len() - self.start + 1);
        }
        let space = self.buf.len() - self.end;
        let n = stream.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok((n, n < space))
    }
}

/// One connection's transmission phase.
struct Transmission<'a> {
    shared: &'a Shared,
    stream: Stream,
    queue: BlockQueue<Vec<u8>>,
    volume: Arc<Volume>,
    limits: ExportLimits,
    inbuf: InBuf,
    /// Payload bytes of a refused write still to be skipped.
    skip_bytes: u64,
    out: VecDeque<OutReply>,
    out_bytes: usize,
    in_flight_bytes: u64,
    /// This connection's share of [`Shared::charged_bytes`], and whether the budget held a
    /// request back.
    charged_bytes: u64,
    over_budget: bool,
    spare_bytes: usize,
    /// Reads, writes and block statuses in flight, by handle (to keep `in_flight_bytes`, and
    /// for what their replies say).
    requests: HashMap<u64, InFlight>,
    spare: Vec<Vec<u8>>,
    /// The client sent `NBD_CMD_DISC`, closed its side, or the server is stopping: no more
    /// requests are read.
    closing: bool,
}

impl<'a> Transmission<'a> {
    fn new(shared: &'a Shared, stream: Stream, queue: BlockQueue<Vec<u8>>, volume: Arc<Volume>, limits: ExportLimits) -> Self {
        Self {
            shared,
            stream,
            queue,
            volume,
            limits,
            inbuf: InBuf { buf: vec![0; INBUF_BYTES], start: 0, end: 0 },
            skip_bytes: 0,
            out: VecDeque::new(),
            out_bytes: 0,
            in_flight_bytes: 0,
            charged_bytes: 0,
            over_budget: false,
            spare_bytes: 0,
            requests: HashMap::new(),
            spare: Vec::new(),
            closing: false,
        }
    }

    fn backpressured(&self) -> bool {
        self.queue.requests() >= REQUESTS_IN_FLIGHT_MAX || self.in_flight_bytes >= IN_FLIGHT_BYTES_MAX || self.out_bytes >= OUT_BYTES_MAX
    }

    /// Brings this connection's share of the server's memory budget up to date.
    fn recharge(&mut self) {
        let excess_inbuf = self.inbuf.buf.len().saturating_sub(INBUF_BYTES) as u64;
        let now = self.in_flight_bytes + self.out_bytes as u64 + excess_inbuf + self.spare_bytes as u64;
        match now.cmp(&self.charged_bytes) {
            std::cmp::Ordering::Greater => self.shared.charged_bytes.fetch_add(now - self.charged_bytes, Ordering::AcqRel),
            std::cmp::Ordering::Less => self.shared.charged_bytes.fetch_sub(self.charged_bytes - now, Ordering::AcqRel),
            std::cmp::Ordering::Equal => return,
        };
        self.charged_bytes = now;
    }

    /// Nothing in flight or to send: gives back what a burst of large requests left (a grown
    /// receive buffer, spare read buffers) before waiting for the client.
    fn trim_idle(&mut self) {
        if self.inbuf.buf.len() > INBUF_BYTES && self.inbuf.data().is_empty() {
            self.inbuf = InBuf { buf: vec![0; INBUF_BYTES], start: 0, end: 0 };
        }
        self.drop_spares(SPARE_IDLE_BYTES_MAX);
    }

    /// Gives back spare read buffers until they hold at most `keep_bytes`.
    fn drop_spares(&mut self, keep_bytes: usize) {
        while self.spare_bytes > keep_bytes {
            let buf = self.spare.pop().expect("spare bytes belong to spare buffers");
            self.spare_bytes -= buf.capacity();
        }
        self.recharge();
    }

    /// Whether a request needing `bytes` may start now under the server's memory budget:
    /// there is room, or this connection has no request of its own in flight or unanswered
    /// (its spare buffers do not count: they go back first).
    fn within_budget(&mut self, bytes: u64) -> bool {
        let max = self.shared.config.memory_max_bytes;
        if self.shared.charged_bytes.load(Ordering::Acquire) + bytes <= max || self.in_flight_bytes + self.out_bytes as u64 == 0 {
            return true;
        }
        self.drop_spares(0);
        self.shared.charged_bytes.load(Ordering::Acquire) + bytes <= max
    }

    fn run(&mut self) -> Result<(), ConnError> {
        let result = self.serve();
        // What is still charged (requests the pool never finished, replies never sent) goes
        // back to the budget with the connection.
        self.in_flight_bytes = 0;
        self.out_bytes = 0;
        self.spare_bytes = 0;
        self.inbuf.buf = Vec::new();
        self.recharge();
        result
    }

    fn serve(&mut self) -> Result<(), ConnError> {
        let mut readable = false;
        loop {
            if self.shared.stop.load(Ordering::Relaxed) {
                self.closing = true;
            }
            self.recharge();
            let busy = self.queue.requests() > 0;
            // Held back by the budget: the requests already in the buffer are tried again
            // (the socket may have nothing new to wake a read).
            if std::mem::take(&mut self.over_budget) && !self.closing && !self.backpressured() {
                self.parse_requests()?;
            }
            if !self.closing && !self.backpressured() && !self.over_budget && (readable || busy) {
                self.read_requests()?;
            }
            self.recharge();
            readable = false;
            self.write_replies()?;
            if self.queue.requests() > 0 {
                // Waits for the pool and, unless no more requests may start, for the client:
                // a request that arrives meanwhile starts at once instead of after the next
                // completion, so the pool sees the client's whole queue depth. Not with one
                // request in flight: a client at queue depth 1 sends nothing until it has
                // the reply, and the watch (still armed when the reply goes out) would fire
                // on its next request, for an extra wake-up per request.
                // Nor while the memory budget holds requests back: the socket would stay
                // readable with requests it may not take, and the wait would spin.
                let watch = (self.queue.requests() > 1 && !self.closing && !self.backpressured() && !self.over_budget).then(|| self.stream.as_raw_fd());
                // Requests TLS decrypted ahead wait for no socket event: look at the pool
                // without sleeping, and read them on the next turn.
                let timeout = (watch.is_some() && self.stream.read_pending()).then_some(Duration::ZERO);
                let queue = &mut self.queue;
                let mut finished = Vec::new();
                queue.poll_watching(timeout, watch, &mut |done| finished.push(done))?;
                for done in finished {
                    self.reply(done);
                }
                self.write_replies_taking_requests()?;
                continue;
            }
            let write_pending = !self.out.is_empty() || self.stream.write_pending();
            if self.closing && !write_pending {
                return Ok(());
            }
            let want_read = !self.closing && !self.backpressured();
            if self.out.is_empty() {
                self.trim_idle();
            }
            // TLS may hold requests it decrypted ahead, which no poll on the socket announces.
            if want_read && !self.over_budget && self.stream.read_pending() {
                readable = true;
                continue;
            }
            if want_read && !write_pending && self.busy_poll() {
                readable = true;
                continue;
            }
            let timeout_ms = if self.over_budget { OVER_BUDGET_RETRY_MS } else { STOP_CHECK_INTERVAL_MS };
            let (r, _) = wait_fd(self.stream.as_raw_fd(), want_read && !self.over_budget, write_pending, timeout_ms)?;
            readable = r;
        }
    }

    /// Watches the socket without sleeping for up to [`NbdConfig::busy_poll_us`]: whether a
    /// request (or a hang-up) arrived meanwhile.
    fn busy_poll(&self) -> bool {
        let busy_poll_us = self.shared.config.busy_poll_us.min(BUSY_POLL_US_MAX);
        if busy_poll_us == 0 {
            return false;
        }
        let until = Instant::now() + Duration::from_micros(u64::from(busy_poll_us));
        loop {
            match wait_fd(self.stream.as_raw_fd(), true, false, 0) {
                Ok((true, _)) => return true,
                Ok((false, _)) if Instant::now() < until => std::hint::spin_loop(),
                // Nothing came, or poll failed: the sleeping wait reports its error.
                _ => return false,
            }
        }
    }

    /// Reads what has arrived and starts every complete request.
    fn read_requests(&mut self) -> Result<(), ConnError> {
        loop {
            // A short read drained the socket: parse, and read again only on the next turn
            // (an extra read here would mostly fail with EAGAIN, one syscall per request at
            // queue depth 1).
            let drained = match self.inbuf.fill(&mut self.stream) {
                Ok((0, _)) => {
                    self.closing = true; // the client closed its side
                    break;
                }
                Ok((_, short)) => short,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe) => {
                    self.closing = true;
                    self.out.clear();
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            let wanted_more = self.parse_requests()?;
            if drained || self.closing || self.backpressured() || !wanted_more {
                break;
            }
        }
        Ok(())
    }

    /// Starts every complete request in the buffer. Returns whether it needs more bytes.
    fn parse_requests(&mut self) -> Result<bool, ConnError> {
        loop {
            if self.skip_bytes > 0 {
                let n = (self.inbuf.data().len() as u64).min(self.skip_bytes);
                self.inbuf.consume(n as usize);
                self.skip_bytes -= n;
                if self.skip_bytes > 0 {
                    return Ok(true);
                }
            }
            if self.closing || self.backpressured() {
                return Ok(false);
            }
            let Some(request) = proto::parse_request(self.inbuf.data())? else {
                self.inbuf.reserve_total(proto::REQUEST_HEADER_BYTES);
                return Ok(true);
            };
            // A read's buffer, a write's payload: taken only if the server's budget has room.
            let cost = match request.kind {
                proto::CMD_READ | proto::CMD_WRITE => u64::from(request.len.min(self.limits.max_block_bytes)),
                _ => 0,
            };
            self.recharge();
            if cost > 0 && !self.within_budget(cost) {
                self.over_budget = true;
                return Ok(false);
            }
            self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
            let command = match proto::validate(&request, &self.limits) {
                Ok(command) => command,
                Err(error) => {
                    self.inbuf.consume(proto::REQUEST_HEADER_BYTES);
                    self.skip_bytes = request.payload_bytes();
                    self.push_error(error, request.handle);
                    continue;
                }
            };
            let handle = request.handle;
            match command {
                Command::Write { offset, len, fua } => {
                    let total = proto::REQUEST_HEADER_BYTES + len as usize;
                    if self.inbuf.data().len() < total {
                        self.inbuf.reserve_total(total);
                        return Ok(true);
                    }
                    let data = &self.inbuf.data()[proto::REQUEST_HEADER_BYTES..total];
                    self.queue.submit_write(handle, &self.volume, offset, data, fua)?;
                    self.track(handle, u64::from(len), Pending::Write);
                    self.inbuf.consume(total);
                    continue;
                }
                Command::Read { offset, len } => {
                    let buf = self.take_buffer(len as usize);
                    self.queue.submit_read(handle, &self.volume, offset, u64::from(len), buf)?;
                    self.track(handle, u64::from(len), Pending::Read { offset });
                }
                Command::BlockStatus { offset, len, req_one } => {
                    let len = len.min(BLOCK_STATUS_BYTES_MAX);
                    let blocks = crate::layout::Split::new(offset, u64::from(len)).count() as usize;
                    let buf = self.take_buffer(blocks);
                    self.queue.submit_block_status(handle, &self.volume, offset, u64::from(len), buf)?;
                    self.track(handle, u64::from(len), Pending::Status { offset, len, req_one });
                }
                Command::Flush => self.queue.submit_flush(handle, &self.volume)?,
                Command::Trim { offset, len, fua } => self.queue.submit_discard(handle, &self.volume, offset, u64::from(len), fua)?,
                Command::WriteZeroes { offset, len, fua, no_hole } => self.queue.submit_write_zeroes(handle, &self.volume, offset, u64::from(len), fua, no_hole)?,
                Command::Disconnect => self.closing = true,
            }
            self.inbuf.consume(proto::REQUEST_HEADER_BYTES);
        }
    }

    fn track(&mut self, handle: u64, bytes: u64, pending: Pending) {
        self.in_flight_bytes += bytes;
        // A handle reused while in flight (a client's bug) keeps the bytes of both.
        self.requests.entry(handle).and_modify(|r| r.bytes += bytes).or_insert(InFlight { bytes, pending });
    }

    fn take_buffer(&mut self, len: usize) -> Vec<u8> {
        match self.spare.pop() {
            // Every byte of a read is written before the buffer is sent (a block's value or
            // zeros), so a reused buffer needs no clearing.
            Some(mut buf) => {
                self.spare_bytes -= buf.capacity();
                buf.resize(len, 0);
                buf
            }
            None => vec![0; len],
        }
    }

    fn reply(&mut self, done: Done<Vec<u8>>) {
        let pending = self.requests.remove(&done.tag).map(|r| {
            self.in_flight_bytes -= r.bytes;
            r.pending
        });
        let handle = done.tag;
        match (done.result, pending) {
            (Ok(()), Some(Pending::Read { offset })) if self.limits.structured => {
                let data = done.buf.expect("a read's buffer");
                if done.hole {
                    // No block of the range is stored: 32 bytes instead of its zeros.
                    let reply = OutReply::new(&proto::offset_hole_reply(handle, offset, data.len() as u32), None);
                    self.recycle(data);
                    self.push_reply(reply);
                } else {
                    self.push_reply(OutReply::new(&proto::offset_data_reply(handle, offset, data.len() as u32), Some(data)));
                }
            }
            (Ok(()), Some(Pending::Status { offset, len, req_one })) => {
                let states = done.buf.expect("a status buffer");
                let flags: Vec<u32> = states.iter().map(|&b| allocation_flags(BlockState::from_byte(b))).collect();
                self.recycle(states);
                let mut extents = Vec::new();
                let count = proto::allocation_extents(&mut extents, offset, len, crate::layout::BLOCK_SIZE_BYTES, &flags, req_one);
                self.push_reply(OutReply::new(&proto::block_status_reply(handle, proto::CONTEXT_ID_BASE_ALLOCATION, count), Some(extents)));
            }
            (Ok(()), _) => self.push_reply(OutReply::new(&proto::simple_reply(0, handle), done.buf)),
            (Err(e), _) => {
                tracing::debug!(handle, error = %e, "nbd: request failed");
                if let Some(buf) = done.buf {
                    self.recycle(buf);
                }
                self.push_error(nbd_error(&e), handle);
            }
        }
    }

    /// An error reply: simple, or once structured replies are negotiated an error chunk
    /// (which reads and block statuses need, and which is valid for every command).
    fn push_error(&mut self, error: u32, handle: u64) {
        self.shared.stats.error_replies.fetch_add(1, Ordering::Relaxed);
        let reply = if self.limits.structured { OutReply::new(&proto::error_reply(handle, error), None) } else { OutReply::new(&proto::simple_reply(error, handle), None) };
        self.push_reply(reply);
    }

    fn push_reply(&mut self, reply: OutReply) {
        self.out_bytes += reply.len();
        self.out.push_back(reply);
    }

    fn recycle(&mut self, buf: Vec<u8>) {
        if self.spare.len() < SPARE_BUFFERS_MAX && self.spare_bytes + buf.capacity() <= SPARE_BYTES_MAX {
            self.spare_bytes += buf.capacity();
            self.spare.push(buf);
        }
    }

    /// Writes the replies of requests that finished together, [`REPLIES_PER_GROUP`] at a time,
    /// and between groups reads the requests that arrived meanwhile and sends them to the pool
    /// (why: see [`REPLIES_PER_GROUP`]).
    fn write_replies_taking_requests(&mut self) -> Result<(), ConnError> {
        loop {
            let socket_full = !self.write_replies_upto(REPLIES_PER_GROUP)?;
            if socket_full || self.out.is_empty() {
                return Ok(());
            }
            if self.closing || self.backpressured() {
                return self.write_replies();
            }
            let before = self.queue.requests();
            self.read_requests()?;
            if self.queue.requests() > before {
                let mut finished = Vec::new();
                self.queue.send(&mut |done| finished.push(done))?;
                for done in finished {
                    self.reply(done);
                }
            }
        }
    }

    /// Writes finished replies, many per `writev`, until the socket is full.
    fn write_replies(&mut self) -> Result<(), ConnError> {
        self.write_replies_upto(usize::MAX).map(drop)
    }

    /// Writes up to `replies_max` finished replies, many per `writev`. Returns false when the
    /// socket is full (the rest waits for it to drain).
    fn write_replies_upto(&mut self, replies_max: usize) -> Result<bool, ConnError> {
        let mut left = replies_max;
        while !self.out.is_empty() && left > 0 {
            let replies = REPLIES_PER_WRITE_MAX.min(left).min(self.out.len());
            left -= replies;
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * replies);
            for reply in self.out.iter().take(replies) {
                let header = reply.header();
                let header_len = header.len();
                if reply.written < header_len {
                    slices.push(IoSlice::new(&header[reply.written..]));
                }
                if let Some(data) = &reply.data {
                    let from = reply.written.saturating_sub(header_len);
                    slices.push(IoSlice::new(&data[from..]));
                }
            }
            let written = match self.stream.write_vectored(&slices) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    left += replies;
                    continue;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
                    // The client is gone: nothing more can be sent.
                    self.closing = true;
                    self.out.clear();
                    self.out_bytes = 0;
                    return Ok(true);
                }
                Err(e) => return Err(e.into()),
            };
            drop(slices);
            self.advance(written);
        }
        self.flush_tls()
    }

    /// Writes the ciphertext a TLS session still holds for replies already taken from
    /// [`Self::out`]. Returns false when the socket is full.
    fn flush_tls(&mut self) -> Result<bool, ConnError> {
        if !self.stream.write_pending() {
            return Ok(true);
        }
        match self.stream.flush() {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(false),
            Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {
                // The client is gone (the session no longer counts what it holds as pending).
                self.closing = true;
                self.out.clear();
                self.out_bytes = 0;
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn advance(&mut self, mut written: usize) {
        self.out_bytes -= written;
        while written > 0 {
            let front = self.out.front_mut().expect("written bytes belong to queued replies");
            let left = front.len() - front.written;
            if written < left {
                front.written += written;
                return;
            }
            written -= left;
            let done = self.out.pop_front().expect("front exists");
            if let Some(buf) = done.data {
                self.recycle(buf);
            }
        }
    }
}

/// A block's `base:allocation` flags. A stored block is data even when it holds zeros (see
/// [`BlockState`]): without `STATE_ZERO` a client reads it, which is always correct.
fn allocation_flags(state: BlockState) -> u32 {
    match state {
        BlockState::Data => 0,
        BlockState::Absent => proto::STATE_HOLE | proto::STATE_ZERO,
    }
}

/// The NBD error value for a failed request (the protocol allows only a few).
fn nbd_error(e: &BlockError) -> u32 {
    match e.errno() {
        libc::EPERM => proto::EPERM,
        libc::EINVAL => proto::EINVAL,
        libc::ENOSPC => proto::ENOSPC,
        libc::ENOMEM => proto::ENOMEM,
        libc::EOVERFLOW => proto::EOVERFLOW,
        libc::ESHUTDOWN => proto::ESHUTDOWN,
        libc::ENOTSUP => proto::ENOTSUP,
        _ => proto::EIO,
    }
}
