//! `watch`: memcached's log streams, for operators who want to see what clients do.
//!
//! A connection that sends `watch [streams]` gets `OK` and from then on one line per event of
//! those streams (nothing it sends afterwards is run, as in memcached):
//!
//! - `fetchers`: `ts=<s.µs> gid=<n> type=item_get key=<key> status=found|not_found
//!   clsid=<class> cfd=<fd> size=<bytes>` for each key a `get`/`gets`/`gat`/`gats`/`mg` looks up;
//! - `mutations`: `… type=item_store key=<key> status=stored|not_stored|exists|not_found
//!   cmd=set|add|replace|append|prepend|cas ttl=<s> clsid=<class> cfd=<fd> size=<bytes>` for
//!   each storage command and `ms`;
//! - `connevents`: `… type=conn_new rip=<ip> rport=<port> transport=tcp cfd=<fd>` and
//!   `… type=conn_close rip=… rport=… transport=tcp reason=normal|error|idle_timeout|shutdown
//!   cfd=<fd>`.
//!
//! Keys are URI-encoded, `clsid`/`size` are what memcached's default slab classes would say (as
//! in `lru_crawler metadump`), `gid` counts every line of the server. Unlike memcached, `ts`
//! has its microseconds zero-padded (memcached prints `1795727468.20766` for .020766 s). The
//! other streams memcached 1.6.18 accepts (`rawcmds`, `evictions`, `sysevents`, the proxy's) are
//! accepted and stay silent: kura drops whole blocks, not items, and has no proxy.
//!
//! Cost: when nobody watches, one relaxed atomic load per event. Each watcher has a bounded
//! buffer ([`WATCH_BUFFER_BYTES_MAX`]) that the workers append to and the watcher's own worker
//! moves into its output while that has room; a watcher that does not keep up loses lines and
//! is told how many with a `skipped=<n>` line, as memcached's logger does, and never holds
//! back the clients it watches.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kura_proto::WatchFlags;

use crate::metadump::{SlabClasses, uri_encode};

/// Bytes of lines a watcher may have waiting for its worker; more are skipped (counted).
pub const WATCH_BUFFER_BYTES_MAX: usize = 256 * 1024;
/// Watchers at once in a server (memcached's `WATCHER_LIMIT`); more get an error.
pub const WATCHERS_MAX: usize = 20;
/// The reply when [`WATCHERS_MAX`] watchers are connected.
pub const TOO_MANY_REPLY: &[u8] = b"WATCHER_TOO_MANY log watcher limit reached\r\n";

/// Every watcher of the server.
#[derive(Default)]
pub struct Watchers {
    /// The streams at least one watcher wants (what the hot paths look at).
    wanted: AtomicU32,
    next_gid: AtomicU64,
    /// Lines handed to watchers, and lines a watcher's full buffer lost (`stats`:
    /// `log_watcher_sent`, `log_watcher_skipped`).
    sent: AtomicU64,
    skipped: AtomicU64,
    list: Mutex<Vec<Arc<Watcher>>>,
}

/// What a `type=item_store` line tells.
pub struct StoreLine<'a> {
    pub key: &'a [u8],
    /// `stored`, `not_stored`, `exists` or `not_found`.
    pub status: &'static str,
    /// The storage command: `set`, `add`, `replace`, `append`, `prepend` or `cas`.
    pub cmd: &'static str,
    /// Seconds the item has to live; 0 when it does not expire.
    pub ttl_s: i64,
    pub client_flags: u32,
    pub size_bytes: usize,
    /// The client's socket.
    pub cfd: i32,
}

/// One watching connection's side: what it wants and the lines waiting for it.
pub struct Watcher {
    flags: WatchFlags,
    pending: Mutex<Pending>,
    /// Wakes the watcher's worker when lines arrive in an empty buffer.
    wake: Arc<dyn Fn() + Send + Sync>,
}

#[derive(Default)]
struct Pending {
    lines: Vec<u8>,
    skipped: u64,
}

impl std::fmt::Debug for Watchers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchers").field("wanted", &self.wanted.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

impl Watchers {
    /// Whether anyone watches `stream` (one relaxed load: call it before formatting a line).
    pub fn wants(&self, stream: WatchFlags) -> bool {
        self.wanted.load(Ordering::Relaxed) & stream.0 != 0
    }

    /// Registers a watcher of `flags`; `None` when [`WATCHERS_MAX`] are connected.
    pub fn add(&self, flags: WatchFlags, wake: Arc<dyn Fn() + Send + Sync>) -> Option<Arc<Watcher>> {
        let mut list = self.lock();
        if list.len() >= WATCHERS_MAX {
            return None;
        }
        let watcher = Arc::new(Watcher { flags, pending: Mutex::default(), wake });
        list.push(Arc::clone(&watcher));
        self.wanted.fetch_or(flags.0, Ordering::Relaxed);
        Some(watcher)
    }

    /// Removes a watcher whose connection closed.
    pub fn remove(&self, watcher: &Arc<Watcher>) {
        let mut list = self.lock();
        list.retain(|w| !Arc::ptr_eq(w, watcher));
        let wanted = list.iter().fold(0, |all, w| all | w.flags.0);
        self.wanted.store(wanted, Ordering::Relaxed);
    }

    /// Watchers connected.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Lines handed to watchers so far.
    pub fn lines_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Lines lost to watchers that did not keep up.
    pub fn lines_skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Watcher>>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends a line of `stream` to every watcher of it: `ts=… gid=… ` then what `body`
    /// writes, then `\n`.
    pub fn log(&self, stream: WatchFlags, body: impl FnOnce(&mut Vec<u8>)) {
        if !self.wants(stream) {
            return;
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let gid = self.next_gid.fetch_add(1, Ordering::Relaxed) + 1;
        let mut line = format!("ts={}.{:06} gid={gid} ", now.as_secs(), now.subsec_micros()).into_bytes();
        body(&mut line);
        line.push(b'\n');
        let list = self.lock();
        for watcher in list.iter().filter(|w| w.flags.contains(stream)) {
            let was_empty = {
                let mut pending = watcher.pending.lock().unwrap_or_else(|e| e.into_inner());
                if pending.lines.len() + line.len() > WATCH_BUFFER_BYTES_MAX {
                    pending.skipped += 1;
                    self.skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                self.sent.fetch_add(1, Ordering::Relaxed);
                let was_empty = pending.lines.is_empty() && pending.skipped == 0;
                pending.lines.extend_from_slice(&line);
                was_empty
            };
            if was_empty {
                (watcher.wake)();
            }
        }
    }

    /// `type=item_get`: a lookup a client asked for; `found` is (client flags, data bytes).
    pub fn item_get(&self, slabs: &SlabClasses, key: &[u8], found: Option<(u32, usize)>, cfd: i32) {
        self.log(WatchFlags::FETCHERS, |out| {
            out.extend_from_slice(b"type=item_get key=");
            uri_encode(out, key);
            let (status, class, size) = match found {
                Some((flags, size)) => ("found", slabs.class_of(key.len(), flags, size), size),
                None => ("not_found", 0, 0),
            };
            out.extend_from_slice(format!(" status={status} clsid={class} cfd={cfd} size={size}").as_bytes());
        });
    }

    /// `type=item_store`: a store and its outcome.
    pub fn item_store(&self, slabs: &SlabClasses, store: &StoreLine<'_>) {
        self.log(WatchFlags::MUTATIONS, |out| {
            out.extend_from_slice(b"type=item_store key=");
            uri_encode(out, store.key);
            let StoreLine { status, cmd, ttl_s, cfd, size_bytes, .. } = store;
            let class = slabs.class_of(store.key.len(), store.client_flags, *size_bytes);
            out.extend_from_slice(format!(" status={status} cmd={cmd} ttl={ttl_s} clsid={class} cfd={cfd} size={size_bytes}").as_bytes());
        });
    }

    /// `type=conn_new` / `type=conn_close` (with its reason).
    pub fn conn_event(&self, peer: Option<&crate::stats::ConnAddr>, cfd: i32, closed_because: Option<&str>) {
        use crate::stats::ConnAddr;
        self.log(WatchFlags::CONNEVENTS, |out| {
            let (ip, port, transport) = match peer {
                Some(ConnAddr::Tcp(a)) => (a.ip().to_string(), a.port(), "tcp"),
                Some(ConnAddr::Unix(_)) => (String::new(), 0, "local"),
                None => ("?".to_owned(), 0, "tcp"),
            };
            let kind = if closed_because.is_some() { "conn_close" } else { "conn_new" };
            out.extend_from_slice(format!("type={kind} rip={ip} rport={port} transport={transport}").as_bytes());
            if let Some(reason) = closed_because {
                out.extend_from_slice(format!(" reason={reason}").as_bytes());
            }
            out.extend_from_slice(format!(" cfd={cfd}").as_bytes());
        });
    }
}

impl Watcher {
    /// Moves waiting lines into `out` (a `skipped=<n>` line first if lines were lost), at most
    /// `room` bytes' worth. Whether lines remain.
    pub fn drain(&self, room: usize, out: &mut crate::output::Output) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if room == 0 {
            return !pending.lines.is_empty() || pending.skipped > 0;
        }
        if pending.skipped > 0 {
            out.push_bytes(format!("skipped={}\n", pending.skipped).as_bytes());
            pending.skipped = 0;
        }
        if pending.lines.len() <= room {
            out.push_bytes(&pending.lines);
            pending.lines.clear();
            return false;
        }
        // Whole lines only.
        let cut = pending.lines[..room].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        out.push_bytes(&pending.lines[..cut]);
        pending.lines.drain(..cut);
        true
    }

    /// Whether lines wait for the watcher.
    pub fn has_pending(&self) -> bool {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        !pending.lines.is_empty() || pending.skipped > 0
    }
}
