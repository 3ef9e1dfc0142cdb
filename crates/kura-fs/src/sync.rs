//! The locks of the file system and of the preload library: std's, which on Linux are each
//! one futex word inside the lock, with nothing kept anywhere else in the process.
//!
//! That is what makes them safe to hold across `fork` (the preload's atfork handlers do, see
//! `kura-preload`'s `state.rs`): the child gets each lock's word as it was, and the thread
//! that forked unlocks what it holds. A lock that keeps its waiters outside itself is not:
//! parking_lot queues them in a process-wide hash table, and a parent thread that was parking
//! at the instant of `fork` (on a lock the fork holds, or timing out of a condvar wait) left
//! the child a half-linked queue, on which the child's write-back worker crashed (SIGSEGV in
//! `Condvar::wait_until_internal`, about one in 600-1,800 forks of the preload's
//! `tests/c/fork_threads.c`).
//!
//! So nothing a forked child runs takes a parking_lot lock: not this crate (the FUSE adapter
//! included, though the preload never runs it), not the preload, not `kura_pool`'s networked
//! contexts (std locks only). The embedded engine (`kura_engine`) keeps parking_lot: a child
//! never uses its parent's engine (the preload refuses it, see `State::fs` there).
//!
//! The wrappers only drop poisoning: a panic while a lock is held (the preload catches panics
//! at its hooks) leaves the data as the panicking code left it, as parking_lot's locks did,
//! and the next `lock` takes it as it is.

use std::sync::PoisonError;
use std::time::Duration;

pub use std::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

/// [`std::sync::Mutex`] whose `lock` ignores poisoning.
#[derive(Debug, Default)]
pub struct Mutex<T>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Self(std::sync::Mutex::new(value))
    }

    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The guard when the lock is free now, else `None`.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`std::sync::RwLock`] whose `read` and `write` ignore poisoning.
#[derive(Debug, Default)]
pub struct RwLock<T>(std::sync::RwLock<T>);

impl<T> RwLock<T> {
    pub const fn new(value: T) -> Self {
        Self(std::sync::RwLock::new(value))
    }

    #[inline]
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`std::sync::Condvar`] for [`Mutex`], ignoring poisoning.
#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    pub const fn new() -> Self {
        Self(std::sync::Condvar::new())
    }

    /// Unlocks `guard`'s mutex, waits for a notification or `timeout` (or a spurious wake-up),
    /// and locks it again.
    pub fn wait_for<'a, T>(&self, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
        match self.0.wait_timeout(guard, timeout) {
            Ok((guard, _)) => guard,
            Err(e) => e.into_inner().0,
        }
    }

    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic while a lock is held leaves the data usable: the next `lock`, `read`, `write`
    /// and condvar wait take it as the panicking thread left it.
    #[test]
    fn a_panic_under_a_lock_does_not_poison_it() {
        let mutex = Mutex::new(1);
        let rwlock = RwLock::new(1);
        std::thread::scope(|s| {
            let panicked = s.spawn(|| {
                let mut m = mutex.lock();
                let mut w = rwlock.write();
                *m = 2;
                *w = 2;
                panic!("on purpose, under both locks");
            });
            assert!(panicked.join().is_err());
        });
        assert_eq!(*mutex.lock(), 2);
        assert_eq!(*mutex.try_lock().expect("free"), 2);
        assert_eq!(*rwlock.read(), 2);
        *rwlock.write() = 3;
        assert_eq!(*rwlock.read(), 3);
        let guard = Condvar::new().wait_for(mutex.lock(), Duration::from_millis(1));
        assert_eq!(*guard, 2);
        let held = std::thread::scope(|s| s.spawn(|| mutex.try_lock().is_none()).join().unwrap());
        assert!(held, "held by the guard");
    }
}
