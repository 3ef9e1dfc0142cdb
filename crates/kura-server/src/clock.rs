//! Time: memcached's expiration rules and the flush horizon.
//!
//! Expiry is kept as absolute Unix seconds, so it means the same after a
//! restart. `flush_all` is not a scan: every record carries the µs stamp of
//! its store, and a record is flushed when its stamp is at or below the
//! *flush horizon*. The stamps come from [`Clock::tick`], strictly increasing
//! in this process and, after a restart, above every horizon that was saved.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// An exptime up to this many seconds is relative; above, a Unix time
/// (memcached `REALTIME_MAXDELTA`).
pub const RELATIVE_EXPTIME_MAX_S: i64 = 60 * 60 * 24 * 30;
/// Expiry stored for an item that is already expired (any past time works;
/// memcached uses 1 as well).
pub const EXPIRED_AT_S: i64 = 1;

pub fn unix_now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

pub fn unix_now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The absolute expiry of an exptime sent at `now_s`: 0 stays 0 (never),
/// negative is already expired, up to 30 days is relative, above is a Unix
/// time. memcached reads exptimes as 32-bit numbers, so they are clamped to that range first.
pub fn expire_at_s(exptime_s: i64, now_s: i64) -> i64 {
    let exptime_s = exptime_s.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
    match exptime_s {
        0 => 0,
        e if e < 0 => EXPIRED_AT_S,
        e if e > RELATIVE_EXPTIME_MAX_S => e.max(EXPIRED_AT_S),
        e => now_s + e,
    }
}

/// Whether an item with this expiry is expired at `now_s`.
pub fn is_expired(expire_at_s: i64, now_s: i64) -> bool {
    expire_at_s != 0 && expire_at_s <= now_s
}

/// Seconds left to live, as meta `t` reports it: -1 for no expiry.
pub fn ttl_s(expire_at_s: i64, now_s: i64) -> i64 {
    if expire_at_s == 0 {
        -1
    } else {
        (expire_at_s - now_s).max(0)
    }
}

/// The µs stamps records carry.
#[derive(Debug)]
pub struct Clock {
    last_us: AtomicU64,
}

impl Clock {
    /// A clock whose stamps are all above `floor_us`.
    pub fn new(floor_us: u64) -> Self {
        Self {
            last_us: AtomicU64::new(floor_us),
        }
    }

    /// A stamp above every earlier one: the wall clock in µs, or one more
    /// than the last stamp when the wall clock has not moved on (or went back).
    pub fn tick(&self) -> u64 {
        let now = unix_now_us();
        let prev = self
            .last_us
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
                Some(now.max(last + 1))
            });
        let prev = prev.unwrap_or_else(|last| last);
        now.max(prev + 1)
    }

    /// Raises the floor: every later stamp is above `us`.
    pub fn raise_to(&self, us: u64) {
        self.last_us.fetch_max(us, Ordering::AcqRel);
    }
}

/// The flush horizon: records stamped at or below it are gone. A delayed
/// `flush_all` is *pending* until its time comes; a newer `flush_all`
/// replaces a pending one, as in memcached, but never undoes one that took
/// effect.
#[derive(Debug, Default)]
pub struct FlushHorizon {
    applied_us: AtomicU64,
    pending_us: AtomicU64,
}

/// The horizon's two stamps, as saved in the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushState {
    pub applied_us: u64,
    /// 0: none pending.
    pub pending_us: u64,
}

const FLUSH_STATE_MAGIC: &[u8; 8] = b"KFLUSH01";
pub const FLUSH_STATE_BYTES: usize = 24;

impl FlushState {
    pub fn encode(&self) -> [u8; FLUSH_STATE_BYTES] {
        let mut out = [0u8; FLUSH_STATE_BYTES];
        out[..8].copy_from_slice(FLUSH_STATE_MAGIC);
        out[8..16].copy_from_slice(&self.applied_us.to_le_bytes());
        out[16..24].copy_from_slice(&self.pending_us.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != FLUSH_STATE_BYTES || &bytes[..8] != FLUSH_STATE_MAGIC {
            return None;
        }
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        Some(Self {
            applied_us: u64_at(8),
            pending_us: u64_at(16),
        })
    }

    /// The largest stamp this state can ever flush.
    pub fn max_us(&self) -> u64 {
        self.applied_us.max(self.pending_us)
    }
}

impl FlushHorizon {
    pub fn new(state: FlushState) -> Self {
        Self {
            applied_us: AtomicU64::new(state.applied_us),
            pending_us: AtomicU64::new(state.pending_us),
        }
    }

    /// The horizon at `now_us`.
    pub fn at(&self, now_us: u64) -> u64 {
        let applied = self.applied_us.load(Ordering::Acquire);
        let pending = self.pending_us.load(Ordering::Acquire);
        if pending != 0 && pending <= now_us {
            applied.max(pending)
        } else {
            applied
        }
    }

    pub fn state(&self) -> FlushState {
        FlushState {
            applied_us: self.applied_us.load(Ordering::Acquire),
            pending_us: self.pending_us.load(Ordering::Acquire),
        }
    }

    /// Flushes everything stamped up to `stamp_us` now. Callers serialise
    /// flushes (the store holds its flush lock).
    pub fn flush_now(&self, stamp_us: u64, now_us: u64) -> FlushState {
        let effective = self.at(now_us);
        self.applied_us
            .store(effective.max(stamp_us), Ordering::Release);
        self.pending_us.store(0, Ordering::Release);
        self.state()
    }

    /// Flushes, at `at_us`, everything stamped up to then.
    pub fn flush_later(&self, at_us: u64, now_us: u64) -> FlushState {
        let effective = self.at(now_us);
        self.applied_us.store(effective, Ordering::Release);
        self.pending_us.store(at_us, Ordering::Release);
        self.state()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exptime_rules() {
        let now = 1_700_000_000;
        assert_eq!(expire_at_s(0, now), 0);
        assert_eq!(expire_at_s(-1, now), EXPIRED_AT_S);
        assert_eq!(expire_at_s(10, now), now + 10);
        assert_eq!(
            expire_at_s(RELATIVE_EXPTIME_MAX_S, now),
            now + RELATIVE_EXPTIME_MAX_S
        );
        assert_eq!(
            expire_at_s(RELATIVE_EXPTIME_MAX_S + 1, now),
            RELATIVE_EXPTIME_MAX_S + 1
        );
        assert!(is_expired(
            expire_at_s(RELATIVE_EXPTIME_MAX_S + 1, now),
            now
        ));
        assert_eq!(expire_at_s(now + 100, now), now + 100);
        assert!(!is_expired(now + 100, now));
        assert!(is_expired(now, now));
        assert!(is_expired(expire_at_s(-5, now), now));
        assert!(!is_expired(0, now));
        assert_eq!(expire_at_s(i64::MAX, now), i64::from(i32::MAX));
        assert_eq!(ttl_s(0, now), -1);
        assert_eq!(ttl_s(now + 7, now), 7);
    }

    #[test]
    fn ticks_strictly_increase_past_the_floor() {
        let floor = unix_now_us() + 10_000_000;
        let clock = Clock::new(floor);
        let a = clock.tick();
        let b = clock.tick();
        assert!(a > floor && b > a);
        clock.raise_to(b + 1000);
        assert!(clock.tick() > b + 1000);
    }

    #[test]
    fn flush_horizon() {
        let h = FlushHorizon::default();
        assert_eq!(h.at(100), 0);
        h.flush_now(50, 60);
        assert_eq!(h.at(100), 50);
        h.flush_later(200, 100);
        assert_eq!(h.at(150), 50, "pending flush not yet in force");
        assert_eq!(h.at(200), 200);
        // A newer delayed flush replaces the pending one but keeps what took effect.
        h.flush_later(500, 300);
        assert_eq!(h.at(300), 200);
        assert_eq!(h.at(600), 500);
        let state = h.state();
        assert_eq!(FlushState::decode(&state.encode()), Some(state));
        assert_eq!(FlushState::decode(b"nope"), None);
    }
}
