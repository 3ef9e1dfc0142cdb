//! One connection of a context to one node: send and receive buffers, the FIFO of requests
//! awaiting replies, the blocking connect and handshake, and the syscall counters.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use crate::stream::NodeStream;
use std::time::{Duration, Instant};

use crate::config::{Backend, Credentials, TlsSpec};
use crate::instance::Instance;
use crate::proto::memcache::{self, Dialect};
use crate::proto::resp::{self, Resp};
use crate::stats::IoStats;

/// How a connection talks (decided at the handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    Memcache(Dialect),
    Resp,
}

/// A request of the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Get,
    /// Whether the key exists, its value not sent (see [`crate::Context::submit_exists`]).
    Exists,
    Set,
    Delete,
}

/// One part of a flush on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlushPart {
    /// kura: `sync` → `OK`.
    Sync,
    /// memcached: `mn` → `MN` (or `version`): every earlier write is acknowledged.
    Noop,
    /// Redis without replicas to wait for: `PING`.
    Ping,
    /// Redis: a write of a scratch key, so that the `WAIT` after it covers every write the
    /// master acknowledged before (not only this connection's). Its reply completes nothing.
    ScratchWrite,
    /// Redis: `WAIT replicas timeout` → the number of replicas that acknowledged.
    Wait { replicas: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SentOp {
    Request(Op),
    Flush { id: u64, part: FlushPart },
    /// Redis Cluster `ASKING` before a request redirected with `ASK`; its `+OK` completes nothing.
    Asking,
}

/// A Redis Cluster request kept whole so it can be sent again after `MOVED`/`ASK` or a
/// fail-over.
#[derive(Debug)]
pub(crate) struct Owned {
    pub op: Op,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub redirects: u32,
}

/// A request written (or queued to be written) on a connection, awaiting its reply.
#[derive(Debug)]
pub(crate) struct Sent {
    pub token: u64,
    pub op: SentOp,
    pub deadline: Instant,
    pub retry: Option<Box<Owned>>,
}

pub(crate) struct Conn {
    pub addr: String,
    /// Index of the node (pool member) in the configuration.
    pub member: usize,
    pub backend: Backend,
    pub wire: Wire,
    pub stream: Option<NodeStream>,
    /// The open connection's handshake named the node's instance (see [`crate::instance`]).
    pub instance_known: bool,
    /// After a failed connect: no new attempt before this.
    pub down_until: Option<Instant>,
    pub backoff: Duration,
    pub last_error: String,
    /// Holds one of the node's connection slots.
    pub reserved: bool,
    pub out: Vec<u8>,
    pub out_at: usize,
    /// End offsets in `out` of requests not yet completely sent.
    pub out_ends: VecDeque<usize>,
    /// Receive buffer: [`INBUF_START_BYTES`] at the first read, doubled (up to the pool's
    /// `read_buffer_bytes`) by every read that fills it. A short-lived client (a process that
    /// reads one file of the file system) does not zero and fault in the whole buffer.
    pub inbuf: Vec<u8>,
    pub in_start: usize,
    pub in_end: usize,
    pub sent: VecDeque<Sent>,
}

/// Compact the send buffer once this much of it has been sent.
const OUT_COMPACT_BYTES: usize = 1 << 20;

impl Conn {
    pub fn new(addr: String, member: usize, backend: Backend, backoff: Duration) -> Self {
        let wire = if matches!(backend, Backend::Redis | Backend::RedisCluster) { Wire::Resp } else { Wire::Memcache(Dialect::Meta) };
        Self {
            addr,
            member,
            backend,
            wire,
            stream: None,
            instance_known: false,
            down_until: None,
            backoff,
            last_error: String::new(),
            reserved: false,
            out: Vec::new(),
            out_at: 0,
            out_ends: VecDeque::new(),
            inbuf: Vec::new(),
            in_start: 0,
            in_end: 0,
            sent: VecDeque::new(),
        }
    }

    /// Request bytes not yet taken by the socket (a TLS connection's ciphertext that waits
    /// for it counts as one).
    pub fn unsent_bytes(&self) -> usize {
        self.out.len() - self.out_at + usize::from(self.stream.as_ref().is_some_and(NodeStream::write_pending))
    }

    /// Appends a request to the send buffer and remembers it.
    pub fn push_request(&mut self, op: Op, key: &[u8], value: &[u8], sent: Sent) {
        self.encode_request(op, key, value);
        self.record(sent);
    }

    /// Appends a request's bytes; [`Conn::record`] must follow.
    pub fn encode_request(&mut self, op: Op, key: &[u8], value: &[u8]) {
        match self.wire {
            Wire::Memcache(dialect) => match op {
                Op::Get => memcache::encode_get(&mut self.out, dialect, key),
                Op::Exists => memcache::encode_exists(&mut self.out, dialect, key),
                Op::Set => memcache::encode_set(&mut self.out, dialect, key, value),
                Op::Delete => memcache::encode_delete(&mut self.out, dialect, key),
            },
            Wire::Resp => match op {
                Op::Get => resp::encode_command(&mut self.out, &[b"GET", key]),
                Op::Exists => resp::encode_command(&mut self.out, &[b"EXISTS", key]),
                Op::Set => resp::encode_command(&mut self.out, &[b"SET", key, value]),
                Op::Delete => resp::encode_command(&mut self.out, &[b"DEL", key]),
            },
        }
    }

    /// Remembers the request whose bytes were just appended.
    pub fn record(&mut self, sent: Sent) {
        self.out_ends.push_back(self.out.len());
        self.sent.push_back(sent);
    }

    /// Appends a command that is not a caller's request (flush parts, `ASKING`).
    pub fn push_control(&mut self, sent: Sent, scratch_key: &[u8], wait_timeout_ms: u64) {
        match (self.wire, sent.op) {
            (Wire::Memcache(_), SentOp::Flush { part: FlushPart::Sync, .. }) => memcache::encode_sync(&mut self.out),
            (Wire::Memcache(dialect), SentOp::Flush { part: FlushPart::Noop, .. }) => memcache::encode_noop(&mut self.out, dialect),
            (Wire::Resp, SentOp::Flush { part: FlushPart::Ping, .. }) => resp::encode_command(&mut self.out, &[b"PING"]),
            (Wire::Resp, SentOp::Flush { part: FlushPart::ScratchWrite, .. }) => resp::encode_command(&mut self.out, &[b"SET", scratch_key, b"1"]),
            (Wire::Resp, SentOp::Flush { part: FlushPart::Wait { replicas }, .. }) => {
                let (replicas, timeout) = (replicas.to_string(), wait_timeout_ms.to_string());
                resp::encode_command(&mut self.out, &[b"WAIT", replicas.as_bytes(), timeout.as_bytes()]);
            }
            (Wire::Resp, SentOp::Asking) => resp::encode_command(&mut self.out, &[b"ASKING"]),
            (wire, op) => unreachable!("{op:?} is not sent on {wire:?}"),
        }
        self.out_ends.push_back(self.out.len());
        self.sent.push_back(sent);
    }

    /// Writes as much of the send buffer as the socket takes. `Err` means the connection broke.
    ///
    /// To memcached over TLS each request goes into TLS records of its own, begun only once
    /// the socket took every earlier record: memcached reads a TLS connection with one
    /// `SSL_read` of what it needs and then waits for the socket, so a record that runs on
    /// past the end of what it asked for leaves the rest inside OpenSSL, unseen, and the
    /// connection stalls (it answered none of a pipelined batch's last requests).
    pub fn write_out(&mut self, stats: &mut IoStats) -> io::Result<()> {
        let Some(stream) = self.stream.as_mut() else { return Ok(()) };
        let per_request = self.backend == Backend::Memcached && stream.is_tls();
        if stream.write_pending() {
            stream.flush_pending()?;
        }
        while self.out_at < self.out.len() {
            let end = match per_request {
                false => self.out.len(),
                // Nothing more while earlier records wait for the socket.
                true if stream.write_pending() => break,
                true => self.out_ends.iter().copied().find(|&end| end > self.out_at).unwrap_or(self.out.len()),
            };
            match stream.write(&self.out[self.out_at..end]) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took nothing")),
                Ok(n) => {
                    stats.send_syscalls += 1;
                    self.out_at += n;
                    while self.out_ends.front().is_some_and(|&end| end <= self.out_at) {
                        self.out_ends.pop_front();
                        stats.requests_sent += 1;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    stats.send_syscalls += 1;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
        } else if self.out_at >= OUT_COMPACT_BYTES {
            self.out.drain(..self.out_at);
            for end in &mut self.out_ends {
                *end -= self.out_at;
            }
            self.out_at = 0;
        }
        Ok(())
    }

    /// Reads once into the receive buffer (growing it up to `buffer_max` for one long
    /// reply). `Ok(None)`: nothing there; `Ok(Some(n))`: `n` bytes and whether the socket
    /// may hold more (the read filled the space).
    pub fn read_some(&mut self, buffer_bytes: usize, buffer_max: usize, stats: &mut IoStats) -> io::Result<Option<(usize, bool)>> {
        let Some(stream) = self.stream.as_mut() else { return Ok(None) };
        if self.inbuf.is_empty() {
            self.inbuf.resize(buffer_bytes.min(INBUF_START_BYTES), 0);
        }
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.in_end == self.inbuf.len() && self.in_start > 0 {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        if self.in_end == self.inbuf.len() {
            if self.inbuf.len() >= buffer_max {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a reply longer than {buffer_max} bytes")));
            }
            let grown = (self.inbuf.len() * 2).min(buffer_max);
            self.inbuf.resize(grown, 0);
        }
        loop {
            let space = self.inbuf.len() - self.in_end;
            match stream.read(&mut self.inbuf[self.in_end..]) {
                Ok(0) => {
                    stats.recv_syscalls += 1;
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the node closed the connection"));
                }
                Ok(n) => {
                    stats.recv_syscalls += 1;
                    self.in_end += n;
                    let filled = n == space;
                    if filled && self.inbuf.len() < buffer_bytes {
                        let grown = (self.inbuf.len() * 2).min(buffer_bytes);
                        self.inbuf.resize(grown, 0);
                    }
                    return Ok(Some((n, filled)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    stats.recv_syscalls += 1;
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Forgets buffered bytes (after the connection closed).
    pub fn reset_buffers(&mut self) {
        self.out.clear();
        self.out_at = 0;
        self.out_ends.clear();
        self.in_start = 0;
        self.in_end = 0;
    }
}

/// What a handshake learnt: how to talk to the node, and which process start of it answered
/// (`None`: the node did not say, or the backend is a Redis Cluster, whose fail-overs move
/// masters between addresses).
pub(crate) type Handshake = (Wire, Option<Instance>);

/// Opens a connection and learns how to talk to the node and which instance of it answers
/// (blocking, bounded by `timeout`; one round trip).
pub(crate) fn connect(addr: &str, backend: Backend, text_only: bool, credentials: Option<&Credentials>, tls: Option<&TlsSpec>, timeout: Duration) -> Result<(NodeStream, Handshake), String> {
    let mut stream = NodeStream::connect(addr, timeout).map_err(|e| format!("connect: {e}"))?;
    let setup = (|| {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))
    })();
    setup.map_err(|e| format!("socket setup: {e}"))?;
    if let Some(tls) = tls {
        stream = stream.start_tls(addr, tls).map_err(|e| tls_failure(&e))?;
    }
    if let Some(credentials) = credentials {
        authenticate(&mut stream, backend, credentials)?;
    }
    let handshake = handshake(&mut stream, addr, backend, text_only)?;
    stream.set_read_timeout(None).and_then(|()| stream.set_write_timeout(None)).map_err(|e| e.to_string())?;
    Ok((stream, handshake))
}

/// Why a TLS handshake failed, in words a user can act on (the pool's connections and the
/// file system's own alike).
pub fn tls_failure(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "no answer to the TLS handshake in time (is the node started with TLS, -Z?)".to_owned(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => format!("the node closed the connection during the TLS handshake ({e}; does it ask for a client certificate, cert=?)"),
        // A plain server's first reply (an `ERROR` line) is no TLS record.
        io::ErrorKind::InvalidData if e.to_string().contains("InvalidContentType") => format!("TLS handshake: {e} (the node does not speak TLS on this port: is it started with -Z?)"),
        _ => format!("TLS handshake: {e}"),
    }
}

/// A connection's receive buffer at its first read (see [`Conn::inbuf`]).
pub(crate) const INBUF_START_BYTES: usize = 16 << 10;

/// Longest `INFO server` reply accepted (Redis' is about 1.5 KiB).
const INFO_REPLY_BYTES_MAX: usize = 64 << 10;

/// memcached's answer to a request before `-Y` authentication.
const UNAUTHENTICATED: &[u8] = kura_proto::auth::AuthStep::UNAUTHENTICATED;
/// What a node that asks for credentials the URL did not give says (the pool's and the file
/// system's connections alike).
pub const NEEDS_CREDENTIALS: &str = "the node asks clients to authenticate (-Y): give the pool its USER:PASSWORD@ in the URL";

/// Authenticates a new connection (blocking, bounded by the stream's timeouts): Redis' `AUTH
/// [user] password`; for a kura
/// server or memcached, the `set` of `-Y` authentication, sent only once a probe (`mn`) was
/// answered "unauthenticated", so that a server without `-Y` does not store the password as
/// an item.
pub fn authenticate(stream: &mut NodeStream, backend: Backend, credentials: &Credentials) -> Result<(), String> {
    match backend {
        Backend::Redis | Backend::RedisCluster => {
            let mut request = Vec::new();
            let user = credentials.user.as_bytes();
            let words: Vec<&[u8]> = if user.is_empty() { vec![b"AUTH", credentials.password.as_bytes()] } else { vec![b"AUTH", user, credentials.password.as_bytes()] };
            resp::encode_command(&mut request, &words);
            match exchange_resp(stream, &request)?.as_slice() {
                b"+OK\r\n" => Ok(()),
                other => Err(format!("authentication refused: {}", String::from_utf8_lossy(other).trim_end())),
            }
        }
        Backend::Kura | Backend::Memcached => {
            stream.write_all(b"mn\r\n").map_err(|e| format!("authentication: {e}"))?;
            let probe = read_line(stream)?;
            if probe != UNAUTHENTICATED {
                tracing::debug!(reply = %String::from_utf8_lossy(&probe).trim_end(), "credentials given, but the node does not ask for them");
                return Ok(());
            }
            let data = format!("{} {}", credentials.user, credentials.password);
            let request = format!("set auth 0 0 {}\r\n{data}\r\n", data.len());
            stream.write_all(request.as_bytes()).map_err(|e| format!("authentication: {e}"))?;
            match read_line(stream)?.as_slice() {
                b"STORED\r\n" => Ok(()),
                other => Err(format!("authentication refused: {}", String::from_utf8_lossy(other).trim_end())),
            }
        }
        Backend::Embedded => Ok(()),
    }
}

/// The one-line reply to one request (blocking, as the handshake's reads: [`read_more`]).
fn read_line(stream: &mut NodeStream) -> Result<Vec<u8>, String> {
    const LINE_MAX: usize = 4 << 10;
    let mut line = Vec::new();
    while !line.ends_with(b"\n") {
        read_more(stream, &mut line)?;
        if line.len() > LINE_MAX {
            return Err("authentication reply too long".into());
        }
    }
    Ok(line)
}

fn handshake(stream: &mut NodeStream, addr: &str, backend: Backend, text_only: bool) -> Result<Handshake, String> {
    match backend {
        Backend::RedisCluster => {
            let reply = exchange_resp(stream, b"*1\r\n$4\r\nPING\r\n")?;
            match reply.as_slice() {
                b"+PONG\r\n" => Ok((Wire::Resp, None)),
                other if other.starts_with(b"-NOAUTH") => Err(format!("{}: give the pool the password in the URL (redis+cluster://:PASSWORD@host:port)", String::from_utf8_lossy(&other[1..]).trim_end())),
                other => Err(format!("PING answered {:?}", String::from_utf8_lossy(other))),
            }
        }
        Backend::Redis => {
            stream.write_all(b"*1\r\n$4\r\nPING\r\n*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n").map_err(|e| format!("handshake: {e}"))?;
            let mut buf = Vec::new();
            loop {
                read_more(stream, &mut buf)?;
                let Some((pong, used)) = resp::parse_reply(&buf, INFO_REPLY_BYTES_MAX)? else { continue };
                match pong {
                    Resp::Simple(b"PONG") => {}
                    Resp::Error(text) if text.starts_with(b"NOAUTH") => {
                        return Err(format!("{}: give the pool the password in the URL (redis://:PASSWORD@host or redis://USER:PASSWORD@host)", String::from_utf8_lossy(text)));
                    }
                    Resp::Error(text) => return Err(format!("PING answered -{}", String::from_utf8_lossy(text))),
                    other => return Err(format!("PING answered {other:?}")),
                }
                let Some((info, _)) = resp::parse_reply(&buf[used..], INFO_REPLY_BYTES_MAX)? else { continue };
                let instance = match info {
                    Resp::Bulk(text) => Instance::from_redis_info(text),
                    _ => None,
                };
                tracing::debug!(addr, ?instance, "connected");
                return Ok((Wire::Resp, instance));
            }
        }
        _ => {
            // `version` names the server; `mn` tells whether it has meta commands (memcached
            // before 1.6 answers ERROR); `stats` which process start of it this is.
            stream.write_all(b"version\r\nmn\r\nstats\r\n").map_err(|e| format!("handshake: {e}"))?;
            let mut buf = Vec::new();
            let (version, dialect, instance) = loop {
                read_more(stream, &mut buf)?;
                if buf.starts_with(UNAUTHENTICATED) {
                    return Err(NEEDS_CREDENTIALS.into());
                }
                if let Some(learnt) = memcache_handshake(&buf, text_only).map_err(|e| format!("handshake: {e}"))? {
                    break learnt;
                }
            };
            if backend == Backend::Kura && !version.contains("kura") {
                tracing::warn!(addr, version, "a kura:// node is not a kura server (its flush will fail); use memcached://");
            }
            tracing::debug!(addr, version, ?dialect, ?instance, "connected");
            Ok((Wire::Memcache(dialect), instance))
        }
    }
}

/// The replies to `version`, `mn` and `stats` at the start of `buf`, once all are there.
fn memcache_handshake(buf: &[u8], text_only: bool) -> Result<Option<(String, Dialect, Option<Instance>)>, String> {
    let Some((first, used)) = memcache::parse_reply(buf, 0)? else { return Ok(None) };
    let memcache::Reply::Version(version) = first else { return Err(format!("version answered {first:?}")) };
    let Some((second, more)) = memcache::parse_reply(&buf[used..], 0)? else { return Ok(None) };
    let dialect = match second {
        memcache::Reply::Noop if text_only => Dialect::Text,
        memcache::Reply::Noop => Dialect::Meta,
        memcache::Reply::Error => Dialect::Text,
        other => return Err(format!("mn answered {other:?}")),
    };
    let Some((stats, _)) = memcache::parse_stats(&buf[used + more..])? else { return Ok(None) };
    let instance = match stats {
        memcache::StatsReply::Stats(stats) => Instance::from_stats(&stats),
        memcache::StatsReply::Refused => None,
    };
    Ok(Some((String::from_utf8_lossy(version).into_owned(), dialect, instance)))
}

fn read_more(stream: &mut NodeStream, buf: &mut Vec<u8>) -> Result<(), String> {
    const HANDSHAKE_REPLY_MAX: usize = 4 << 20;
    let mut chunk = [0u8; 16 << 10];
    // A signal to the host program (a timer's, a child's) ends a read that has a receive
    // timeout with EINTR even under SA_RESTART (signal(7)): it is no answer from the node, so
    // the read is made again, without counting the wait it cut towards the timeout.
    let n = loop {
        match stream.read(&mut chunk) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Err("no answer to the handshake in time".to_owned()),
            Err(e) => return Err(format!("handshake: {e}")),
            Ok(n) => break n,
        }
    };
    if n == 0 {
        return Err("the node closed the connection during the handshake".into());
    }
    buf.extend_from_slice(&chunk[..n]);
    if buf.len() > HANDSHAKE_REPLY_MAX {
        return Err("handshake reply too long".into());
    }
    Ok(())
}

/// Sends one RESP command on a blocking socket and returns its whole reply's bytes.
pub(crate) fn exchange_resp(stream: &mut NodeStream, request: &[u8]) -> Result<Vec<u8>, String> {
    stream.write_all(request).map_err(|e| format!("send: {e}"))?;
    let mut buf = Vec::new();
    loop {
        read_more(stream, &mut buf)?;
        if let Some((_, used)) = resp::parse_reply(&buf, 1 << 20)? {
            buf.truncate(used);
            return Ok(buf);
        }
    }
}

/// `CLUSTER SLOTS` from one node (blocking).
pub(crate) fn cluster_slots(addr: &str, credentials: Option<&Credentials>, tls: Option<&TlsSpec>, timeout: Duration) -> Result<Vec<crate::cluster::SlotRange>, String> {
    let (mut stream, _) = connect(addr, Backend::RedisCluster, false, credentials, tls, timeout)?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let bytes = exchange_resp(&mut stream, b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n")?;
    let (reply, _) = resp::parse_reply(&bytes, 1 << 20)?.ok_or("incomplete CLUSTER SLOTS reply")?;
    if let Resp::Error(e) = reply {
        return Err(format!("CLUSTER SLOTS: {}", String::from_utf8_lossy(e)));
    }
    crate::cluster::parse_slots(&reply, addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::os::unix::thread::JoinHandleExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    extern "C" fn ignore_signal(_: libc::c_int) {}

    /// A host program's signals (qemu-img's timers, a shell's SIGCHLD) arrive while the pool
    /// waits for a node's handshake reply; the connection must still be made. This once failed
    /// `lseek(SEEK_DATA)` under the preload with "handshake: Interrupted system call".
    #[test]
    fn signals_during_the_handshake_do_not_fail_the_connection() {
        // SAFETY: a handler that does nothing, installed without SA_RESTART, so that a blocked
        // read returns EINTR as in a program whose handlers do not ask for restarts; the
        // sigaction struct is zeroed and then filled as sigaction(2) documents.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()), 0);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let node = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut chunk = [0u8; 256];
            while !request.ends_with(b"stats\r\n") {
                let n = stream.read(&mut chunk).unwrap();
                assert!(n > 0);
                request.extend_from_slice(&chunk[..n]);
            }
            // A slow node: the client sits in its read while the signals come.
            std::thread::sleep(Duration::from_millis(400));
            stream.write_all(b"VERSION 1.6.18\r\nMN\r\nSTAT pid 7\r\nSTAT uptime 3\r\nEND\r\n").unwrap();
        });
        let done = Arc::new(AtomicBool::new(false));
        let addr = path.to_str().unwrap().to_owned();
        let client = {
            let done = done.clone();
            std::thread::spawn(move || {
                let result = connect(&addr, Backend::Memcached, false, None, None, Duration::from_secs(5));
                done.store(true, Ordering::SeqCst);
                result.map(|(_, (wire, _))| wire)
            })
        };
        let thread = client.as_pthread_t();
        let mut sent = 0;
        while !done.load(Ordering::SeqCst) {
            // SAFETY: the client thread is joined only below, so its pthread_t is live here.
            unsafe { libc::pthread_kill(thread, libc::SIGUSR2) };
            sent += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
        let wire = client.join().unwrap().expect("the handshake survives the signals");
        assert_eq!(wire, Wire::Memcache(Dialect::Meta));
        assert!(sent > 10, "signals were sent while the handshake waited ({sent})");
        node.join().unwrap();
    }
}
