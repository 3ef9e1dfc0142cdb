//! Compare-and-swap on a redis-server (or Valkey) node, over one blocking RESP2 connection of
//! the calling thread.
//!
//! Redis has no version per key, so the file system keeps its own in the value: a metadata
//! value is `version (8 bytes, little-endian) ‖ record`. Every write picks a fresh random
//! nonzero version, so a key that is deleted and made again never shows an old version to a
//! writer that read it before (no ABA). Data chunks never carry the prefix: they go through
//! the pool's context as they are.
//!
//! | operation                | command                                             |
//! |--------------------------|-----------------------------------------------------|
//! | versioned get            | `GET k` → split the prefix                           |
//! | put, `Always`            | `SET k v'`                                           |
//! | put, `Absent`            | `SET k v' NX`                                        |
//! | put/delete, `Version(n)` | [`CAS_SCRIPT`] by `EVALSHA` (`EVAL` on `NOSCRIPT`)   |
//! | delete, `Always`         | `DEL k`                                              |
//! | delete, `Absent`         | `EXISTS k` (nothing to delete)                       |
//!
//! The script runs atomically on the server: it compares the stored prefix with the expected
//! version and writes (or deletes) only when they are equal. Replies are parsed by
//! `kura_pool`'s strict RESP parser with a bound on their size; anything unexpected is an
//! I/O error (the caller drops the connection), never a panic.

use std::io::{Read, Write};
use kura_pool::NodeSpec;
use kura_pool::stream::NodeStream;
use std::time::{Duration, Instant};

use kura_pool::proto::resp::{self, Resp};

use super::{Cond, META_IO_TIMEOUT_MS, META_VALUE_BYTES_MAX, connect_stream};
use crate::error::{FsError, Result};

/// Bytes of the version in front of every metadata value on Redis.
pub const VERSION_BYTES: usize = 8;

/// `KEYS[1]`: the key; `ARGV[1]`: the expected version (8 bytes); `ARGV[2]`, when given: the
/// new value (version included) to write, else the key is deleted. Returns 1 when it wrote
/// or deleted, 0 when the stored version differs (or the key is absent: `GETRANGE` of a
/// missing key is empty).
pub const CAS_SCRIPT: &str = "if redis.call('GETRANGE', KEYS[1], 0, 7) ~= ARGV[1] then return 0 end \
     if #ARGV >= 2 then redis.call('SET', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end \
     return 1";

/// Bytes read from the socket at a time.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// Length of a SHA-1 in hex, as `SCRIPT LOAD` answers.
const SHA1_HEX_BYTES: usize = 40;

/// Splits a stored metadata value into its version and the record (in place).
pub(crate) fn strip_version(key: &[u8], stored: &mut Vec<u8>) -> Result<u64> {
    if stored.len() < VERSION_BYTES {
        return Err(FsError::Corrupt { key: String::from_utf8_lossy(key).into_owned(), why: "no version prefix (a value the file system did not write?)" });
    }
    let version = u64::from_le_bytes(stored[..VERSION_BYTES].try_into().expect("8 bytes"));
    stored.drain(..VERSION_BYTES);
    Ok(version)
}

/// A fresh random nonzero version: the kernel's random bytes (each call its own, so a forked
/// child never repeats its parent's), or, if they are unavailable, a mix of the clock, the
/// process and a counter.
pub(crate) fn fresh_version() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let mut bytes = [0u8; 8];
        // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer we own.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), libc::GRND_NONBLOCK) };
        let version = if n == bytes.len() as isize {
            u64::from_le_bytes(bytes)
        } else {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            let count = COUNTER.fetch_add(1, Ordering::Relaxed);
            splitmix64(nanos ^ (u64::from(crate::process_id()) << 32) ^ splitmix64(count))
        };
        if version != 0 {
            return version;
        }
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A reply, owned (the receive buffer is reused).
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Simple(Vec<u8>),
    Error(String),
    Int(i64),
    Bulk(Vec<u8>),
    Nil,
    /// Arrays: no command here answers with one.
    Array,
}

/// Whether the server still has to learn the CAS script.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Script {
    /// Not loaded on this connection yet.
    Unknown,
    /// `SCRIPT LOAD` answered this SHA-1: run it with `EVALSHA`.
    Sha(Vec<u8>),
    /// `SCRIPT LOAD` was refused (renamed or disabled): send the script with `EVAL`.
    EvalOnly,
}

/// One blocking RESP2 connection to a redis-server, for the metadata.
pub(crate) struct RespConn {
    stream: NodeStream,
    /// Received bytes not yet parsed.
    input: Vec<u8>,
    out: Vec<u8>,
    node: String,
    script: Script,
    /// Largest value written, version included: the pool's value limit, so that the pool's
    /// own connections (a directory listing) can read every metadata value back.
    write_max: usize,
    /// Largest bulk reply accepted.
    read_max: usize,
    /// How long a wait for a reply looks for it before sleeping.
    spin: Duration,
}

impl RespConn {
    /// The connection (to look at it while idle).
    pub(crate) fn stream(&self) -> &NodeStream {
        &self.stream
    }

    /// `value_max`: the pool's value limit; `spin`: how long a wait for a reply looks for it
    /// before sleeping.
    pub(crate) fn connect(node: &NodeSpec, value_max: usize, spin: Duration) -> Result<Self> {
        let addr = &node.addrs[0];
        let stream = connect_stream(node)?;
        let read_max = value_max.max(META_VALUE_BYTES_MAX + VERSION_BYTES);
        Ok(Self { stream, input: Vec::new(), out: Vec::new(), node: addr.to_owned(), script: Script::Unknown, write_max: value_max, read_max, spin })
    }

    fn io(&self, what: impl std::fmt::Display) -> FsError {
        FsError::Io(format!("{}: {what}", self.node))
    }

    /// Sends one command and waits for its reply (at most [`META_IO_TIMEOUT_MS`] in all).
    fn request(&mut self, args: &[&[u8]]) -> Result<Reply> {
        if !self.input.is_empty() {
            return Err(self.io("unrequested bytes from the server"));
        }
        self.out.clear();
        resp::encode_command(&mut self.out, args);
        if let Err(e) = self.stream.write_all(&self.out) {
            return Err(self.io(e));
        }
        let deadline = Instant::now() + Duration::from_millis(META_IO_TIMEOUT_MS);
        let mut chunk = vec![0u8; READ_CHUNK_BYTES];
        loop {
            match resp::parse_reply(&self.input, self.read_max) {
                Ok(Some((reply, used))) => {
                    let reply = owned(reply);
                    self.input.drain(..used);
                    if !self.input.is_empty() {
                        return Err(self.io("more than one reply to one command"));
                    }
                    return Ok(reply);
                }
                Ok(None) => {}
                Err(why) => return Err(self.io(format_args!("malformed reply: {why}"))),
            }
            if Instant::now() >= deadline {
                return Err(self.io(format_args!("no whole reply within {META_IO_TIMEOUT_MS} ms")));
            }
            let got = match kura_pool::fd::recv_spinning(&mut self.stream, &mut chunk, self.spin) {
                Ok(Some(n)) => Ok(n),
                Ok(None) => self.stream.read(&mut chunk),
                Err(e) => Err(e),
            };
            match got {
                Ok(0) => return Err(self.io("connection closed")),
                Ok(n) => self.input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io(e)),
            }
        }
    }

    /// An error reply as the file system's error: `OOM` (maxmemory reached, also from inside
    /// the script) is a full pool.
    fn server_error(&self, message: &str) -> FsError {
        if message.starts_with("OOM") || message.contains("OOM command not allowed") {
            FsError::NoSpace
        } else if ["MOVED ", "ASK ", "CLUSTERDOWN"].iter().any(|p| message.starts_with(p)) {
            self.io(format_args!("{message} (a Redis Cluster node: the file system cannot use a cluster)"))
        } else {
            self.io(message)
        }
    }

    fn unexpected(&self, command: &str, reply: &Reply) -> FsError {
        match reply {
            Reply::Error(message) => self.server_error(message),
            other => self.io(format_args!("unexpected reply to {command}: {other:?}")),
        }
    }

    /// `(maxmemory, used_memory)` from `INFO memory`; without a `maxmemory`, the machine's
    /// memory (`total_system_memory`) is the limit.
    pub(crate) fn space(&mut self) -> Result<Option<(u64, u64)>> {
        let text = match self.request(&[b"INFO", b"memory"])? {
            Reply::Bulk(text) => text,
            other => return Err(self.unexpected("INFO memory", &other)),
        };
        Ok(parse_info_space(&String::from_utf8_lossy(&text)))
    }

    pub(crate) fn get(&mut self, key: &[u8]) -> Result<Option<(Vec<u8>, u64)>> {
        match self.request(&[b"GET", key])? {
            Reply::Nil => Ok(None),
            Reply::Bulk(mut value) => {
                let version = strip_version(key, &mut value)?;
                Ok(Some((value, version)))
            }
            other => Err(self.unexpected("GET", &other)),
        }
    }

    pub(crate) fn set(&mut self, key: &[u8], value: &[u8], cond: Cond) -> Result<Option<u64>> {
        if VERSION_BYTES + value.len() > self.write_max {
            return Err(self.io(format_args!("a metadata value of {} bytes is above the pool's value limit", value.len())));
        }
        let version = fresh_version();
        let mut stored = Vec::with_capacity(VERSION_BYTES + value.len());
        stored.extend_from_slice(&version.to_le_bytes());
        stored.extend_from_slice(value);
        let written = match cond {
            Cond::Always => match self.request(&[b"SET", key, &stored])? {
                Reply::Simple(ok) if ok == b"OK" => true,
                other => return Err(self.unexpected("SET", &other)),
            },
            Cond::Absent => match self.request(&[b"SET", key, &stored, b"NX"])? {
                Reply::Simple(ok) if ok == b"OK" => true,
                Reply::Nil => false,
                other => return Err(self.unexpected("SET NX", &other)),
            },
            Cond::Version(expected) => self.cas(key, expected, Some(&stored))?,
        };
        Ok(written.then_some(version))
    }

    pub(crate) fn delete(&mut self, key: &[u8], cond: Cond) -> Result<bool> {
        match cond {
            Cond::Always => match self.request(&[b"DEL", key])? {
                Reply::Int(_) => Ok(true),
                other => Err(self.unexpected("DEL", &other)),
            },
            Cond::Absent => match self.request(&[b"EXISTS", key])? {
                Reply::Int(n) => Ok(n == 0),
                other => Err(self.unexpected("EXISTS", &other)),
            },
            Cond::Version(expected) => self.cas(key, expected, None),
        }
    }

    /// Runs [`CAS_SCRIPT`]: writes `value` (deletes, without one) if the stored version is
    /// `expected`.
    fn cas(&mut self, key: &[u8], expected: u64, value: Option<&[u8]>) -> Result<bool> {
        if self.script == Script::Unknown {
            self.load_script()?;
        }
        let expected = expected.to_le_bytes();
        let mut args: Vec<&[u8]> = vec![b"EVALSHA", b"", b"1", key, &expected];
        args.extend(value);
        let sha = match &self.script {
            Script::Sha(sha) => Some(sha.clone()),
            Script::Unknown | Script::EvalOnly => None,
        };
        let by_sha = match &sha {
            Some(sha) => {
                args[1] = sha;
                Some(self.request(&args)?)
            }
            None => None,
        };
        let reply = match by_sha {
            // The server forgot it (SCRIPT FLUSH, a restart behind a proxy): EVAL, which also
            // caches it again for the next EVALSHA.
            Some(Reply::Error(m)) if m.starts_with("NOSCRIPT") => None,
            other => other,
        };
        let reply = match reply {
            Some(reply) => reply,
            None => {
                args[0] = b"EVAL";
                args[1] = CAS_SCRIPT.as_bytes();
                self.request(&args)?
            }
        };
        match reply {
            Reply::Int(1) => Ok(true),
            Reply::Int(0) => Ok(false),
            other => Err(self.unexpected("the compare-and-swap script", &other)),
        }
    }

    fn load_script(&mut self) -> Result<()> {
        self.script = match self.request(&[b"SCRIPT", b"LOAD", CAS_SCRIPT.as_bytes()])? {
            Reply::Bulk(sha) if sha.len() == SHA1_HEX_BYTES && sha.iter().all(u8::is_ascii_hexdigit) => Script::Sha(sha),
            Reply::Error(message) if !message.starts_with("OOM") => {
                tracing::debug!(node = %self.node, %message, "SCRIPT LOAD refused; sending the script with EVAL");
                Script::EvalOnly
            }
            other => return Err(self.unexpected("SCRIPT LOAD", &other)),
        };
        Ok(())
    }
}

fn owned(reply: Resp<'_>) -> Reply {
    match reply {
        Resp::Simple(s) => Reply::Simple(s.to_vec()),
        Resp::Error(m) => Reply::Error(String::from_utf8_lossy(m).into_owned()),
        Resp::Int(n) => Reply::Int(n),
        Resp::Bulk(b) => Reply::Bulk(b.to_vec()),
        Resp::Nil => Reply::Nil,
        Resp::Array(_) => Reply::Array,
    }
}


/// `(capacity, used)` from the text of `INFO memory`.
fn parse_info_space(info: &str) -> Option<(u64, u64)> {
    let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<u64>().ok());
    let used = field("used_memory")?;
    let capacity = match field("maxmemory")? {
        0 => field("total_system_memory")?,
        limit => limit,
    };
    Some((capacity, used))
}

#[cfg(test)]
mod tests {
    #[test]
    fn info_memory_gives_the_limit_or_the_machines_memory() {
        let limited = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\ntotal_system_memory:8000000000\r\nmaxmemory:104857600\r\n";
        assert_eq!(super::parse_info_space(limited), Some((104_857_600, 1_048_576)));
        let unlimited = "used_memory:2048\r\nmaxmemory:0\r\ntotal_system_memory:8000000000\r\n";
        assert_eq!(super::parse_info_space(unlimited), Some((8_000_000_000, 2048)));
        assert_eq!(super::parse_info_space("used_memory:1\r\n"), None);
    }

    use super::*;

    #[test]
    fn versions_are_nonzero_and_differ() {
        let versions: std::collections::HashSet<u64> = (0..1000).map(|_| fresh_version()).collect();
        assert_eq!(versions.len(), 1000);
        assert!(!versions.contains(&0));
    }

    #[test]
    fn prefix_splits_or_is_corrupt() {
        let mut stored = 7u64.to_le_bytes().to_vec();
        stored.extend_from_slice(b"rec");
        assert_eq!(strip_version(b"k", &mut stored), Ok(7));
        assert_eq!(stored, b"rec");
        let mut empty_record = 9u64.to_le_bytes().to_vec();
        assert_eq!(strip_version(b"k", &mut empty_record), Ok(9));
        assert!(empty_record.is_empty());
        let mut short = b"short".to_vec();
        assert!(matches!(strip_version(b"k", &mut short), Err(FsError::Corrupt { .. })));
    }
}
