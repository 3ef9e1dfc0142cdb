//! Waiting without sleeping, for a while: a thread that expects an answer within tens of
//! microseconds looks for it in a loop before it sleeps.
//!
//! On a virtual machine, a thread that sleeps leaves its virtual CPU idle, and waking an idle
//! virtual CPU is most of a round trip to a server on the same host: on the 2-core VM kura is
//! measured on, a loopback request to memcached took ~88 µs (median) to a client that slept
//! for the reply and ~30 µs to one that kept looking; a kura server that keeps looking for
//! the next request too brings it to ~12 µs. Spinning costs CPU time, so a spin is bounded
//! twice: by its length, and by the CPU being wanted — between looks the thread yields, and
//! a yield that let something else run for a while ([`YIELD_BUSY_US`]) ends the spin, so a
//! loaded machine (a benchmark's client on the same cores) gets the CPU back.

use std::time::{Duration, Instant};

/// A yield that came back after this long ran another thread: the CPU is wanted, and the
/// spin ends (a yield with nothing else to run takes about a microsecond).
pub const YIELD_BUSY_US: u64 = 20;

/// One bounded spin: call [`Spin::go_on`] after each look that found nothing.
#[derive(Debug)]
pub struct Spin {
    started: Instant,
    limit: Duration,
}

impl Spin {
    /// A spin of at most `limit` (zero: none).
    pub fn new(limit: Duration) -> Self {
        Self { started: Instant::now(), limit }
    }

    /// Yields the CPU once and says whether to look again: `false` when the spin's time is
    /// up, or the yield ran something else for a while (then sleep instead).
    pub fn go_on(&mut self) -> bool {
        let before = Instant::now();
        if before.duration_since(self.started) >= self.limit {
            return false;
        }
        std::thread::yield_now();
        before.elapsed() < Duration::from_micros(YIELD_BUSY_US)
    }
}

/// Calls `look` until it gives an answer, yielding the CPU between calls, for at most `limit`
/// and while the CPU is not wanted ([`Spin::go_on`]): the answer, or `None` when the spin ended
/// first (then sleep).
pub fn look_for<T>(limit: Duration, mut look: impl FnMut() -> Option<T>) -> Option<T> {
    let mut spin = Spin::new(limit);
    loop {
        if let Some(found) = look() {
            return Some(found);
        }
        if !spin.go_on() {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looking_ends_with_the_answer_or_the_spin() {
        assert_eq!(look_for(Duration::from_secs(10), || Some("at once")), Some("at once"));
        // Found at the third look, unless the spin ended before it because the CPU was wanted
        // (another test's busy thread on this one's CPU).
        let mut calls = 0;
        let found = look_for(Duration::from_secs(10), || {
            calls += 1;
            (calls == 3).then_some("found")
        });
        assert!(found == Some("found") && calls == 3 || found.is_none() && calls < 3, "{found:?} after {calls} looks");
        let started = Instant::now();
        assert_eq!(look_for(Duration::from_millis(2), || None::<()>), None);
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_spin_ends_at_its_limit() {
        let mut none = Spin::new(Duration::ZERO);
        assert!(!none.go_on());
        let started = Instant::now();
        let mut spin = Spin::new(Duration::from_millis(2));
        // It stops, and before its time only at a yield that let something else run (a busy
        // test machine): the call that ended it took at least YIELD_BUSY_US then.
        let last_call = loop {
            let before = Instant::now();
            if !spin.go_on() {
                break before.elapsed();
            }
        };
        assert!(
            started.elapsed() >= Duration::from_millis(2) || last_call >= Duration::from_micros(YIELD_BUSY_US),
            "ended after {:?}, its last call taking {last_call:?}",
            started.elapsed()
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_spin_ends_when_another_thread_wants_the_cpu() {
        // Pin this thread and a busy one to one CPU: the first yield runs the other thread
        // for its time slice, far longer than YIELD_BUSY_US, and the spin ends there.
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
        let mut one = unsafe { std::mem::zeroed::<libc::cpu_set_t>() };
        // SAFETY: CPU 0 is within the set's bounds.
        unsafe { libc::CPU_SET(0, &mut one) };
        let pin = |set: &libc::cpu_set_t| {
            // SAFETY: sets the calling thread's affinity from a valid set.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) }
        };
        assert_eq!(pin(&one), 0);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                assert_eq!(pin(&one), 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let started = Instant::now();
        let mut spin = Spin::new(Duration::from_secs(10));
        while spin.go_on() {}
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.join().unwrap();
        assert!(took < Duration::from_secs(5), "a 10 s spin beside a busy thread on its CPU went on for {took:?}");
    }
}
