//! Per-prefix statistics, as memcached keeps them (`stats detail on|off|dump`, `-D`): for
//! each key prefix (the key up to its first delimiter, `:` by default), how many `get`s
//! looked for such keys and how many found one, how many storage commands and `delete`s named
//! one. As in memcached (checked against 1.6.18): keys without the delimiter are not counted,
//! an empty prefix is (`:x`), the classic commands count and the meta ones do not, a
//! `get` of several keys counts each, a `gat` counts as a `get`, `incr`/`decr`/`touch` do not
//! count, a storage command or `delete` counts whatever its outcome, `off` stops counting
//! without forgetting, and `stats reset` forgets.
//!
//! Off (the default), a command pays one relaxed load. On, each counted key takes a mutex
//! and a hash lookup: it is a debugging aid, as in memcached.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Prefixes counted at most; keys of further prefixes are not counted. memcached has no
/// limit, so a client making a new prefix per key grows its table without bound.
pub const DETAIL_PREFIXES_MAX: usize = 10_000;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    get: u64,
    hit: u64,
    set: u64,
    del: u64,
}

impl Counts {
    fn add(&mut self, op: DetailOp) {
        match op {
            DetailOp::Get { hit } => {
                self.get += 1;
                self.hit += u64::from(hit);
            }
            DetailOp::Set => self.set += 1,
            DetailOp::Delete => self.del += 1,
        }
    }
}

/// What a counted command did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetailOp {
    /// A retrieval, and whether it found the item.
    Get { hit: bool },
    /// A storage command.
    Set,
    /// A `delete`.
    Delete,
}

/// The per-prefix counters of a server.
#[derive(Debug)]
pub struct Detail {
    enabled: AtomicBool,
    delimiter: u8,
    prefixes: Mutex<HashMap<Box<[u8]>, Counts>>,
}

impl Detail {
    /// On from the start when `-D` gave a delimiter; else off, with memcached's `:`.
    pub fn new(delimiter: Option<u8>) -> Self {
        Self {
            enabled: AtomicBool::new(delimiter.is_some()),
            delimiter: delimiter.unwrap_or(crate::config::DETAIL_DELIMITER_DEFAULT),
            prefixes: Mutex::new(HashMap::new()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn delimiter(&self) -> u8 {
        self.delimiter
    }

    /// `stats detail on|off`.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Counts `op` on `key` when the detail is on and the key has a prefix.
    #[inline]
    pub fn record(&self, key: &[u8], op: DetailOp) {
        if !self.enabled() {
            return;
        }
        let Some(end) = key.iter().position(|&b| b == self.delimiter) else { return };
        let prefix = &key[..end];
        let mut prefixes = self.prefixes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A prefix counted before: one lookup; a new one: a second, to insert it.
        if let Some(counts) = prefixes.get_mut(prefix) {
            counts.add(op);
        } else if prefixes.len() < DETAIL_PREFIXES_MAX {
            prefixes.entry(prefix.into()).or_default().add(op);
        }
    }

    /// `stats reset`.
    pub fn clear(&self) {
        self.prefixes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    }

    /// `stats detail dump`: a `PREFIX` line per prefix (sorted; memcached's order is its hash
    /// table's), then `END`.
    pub fn dump(&self) -> Vec<u8> {
        let mut lines: Vec<(Box<[u8]>, Counts)> = {
            let prefixes = self.prefixes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            prefixes.iter().map(|(p, c)| (p.clone(), *c)).collect()
        };
        lines.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut out = Vec::new();
        for (prefix, c) in lines {
            out.extend_from_slice(b"PREFIX ");
            out.extend_from_slice(&prefix);
            let mut rest = String::new();
            let _ = write!(rest, " get {} hit {} set {} del {}\r\n", c.get, c.hit, c.set, c.del);
            out.extend_from_slice(rest.as_bytes());
        }
        out.extend_from_slice(b"END\r\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_as_memcached_does() {
        let d = Detail::new(None);
        d.record(b"a:1", DetailOp::Set);
        assert_eq!(d.dump(), b"END\r\n", "off by default");
        d.set_enabled(true);
        for (key, op) in [
            (&b"a:1"[..], DetailOp::Set),
            (b"a:1", DetailOp::Get { hit: true }),
            (b"a:2", DetailOp::Get { hit: false }),
            (b"b:1", DetailOp::Get { hit: false }),
            (b"nodelim", DetailOp::Get { hit: true }),
            (b"a:1", DetailOp::Delete),
            (b":x", DetailOp::Set),
            (b"a::b", DetailOp::Set),
        ] {
            d.record(key, op);
        }
        let want = "PREFIX  get 0 hit 0 set 1 del 0\r\nPREFIX a get 2 hit 1 set 2 del 1\r\nPREFIX b get 1 hit 0 set 0 del 0\r\nEND\r\n";
        assert_eq!(String::from_utf8(d.dump()).unwrap(), want);
        d.set_enabled(false);
        d.record(b"a:1", DetailOp::Set);
        assert_eq!(String::from_utf8(d.dump()).unwrap(), want, "off keeps what was counted");
        d.clear();
        assert_eq!(d.dump(), b"END\r\n");
    }

    #[test]
    fn a_delimiter_turns_it_on_and_prefixes_are_bounded() {
        let d = Detail::new(Some(b'/'));
        assert!(d.enabled());
        for i in 0..DETAIL_PREFIXES_MAX + 10 {
            d.record(format!("p{i}/k").as_bytes(), DetailOp::Set);
        }
        d.record(b"p0/k", DetailOp::Set);
        let dump = String::from_utf8(d.dump()).unwrap();
        assert_eq!(dump.lines().count(), DETAIL_PREFIXES_MAX + 1);
        assert!(dump.contains("PREFIX p0 get 0 hit 0 set 2 del 0\r\n"));
        assert!(!dump.contains(&format!("PREFIX p{} ", DETAIL_PREFIXES_MAX)));
    }
}
