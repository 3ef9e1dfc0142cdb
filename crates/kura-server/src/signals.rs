//! SIGTERM and SIGINT as events: blocked in every thread (the mask is set
//! before any thread starts and is inherited), and taken by the main thread
//! with `sigtimedwait`. They stay blocked after the server stops, so a second
//! SIGTERM during shutdown cannot kill the process before its final sync.

use std::io;
use std::time::Duration;

/// The termination signals, blocked in the calling thread.
pub struct TerminationSignals {
    set: libc::sigset_t,
}

impl TerminationSignals {
    /// Blocks SIGTERM and SIGINT in this thread (and every thread it starts later).
    pub fn block() -> io::Result<Self> {
        // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointers to sigset_t values we own.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGINT);
        }
        // SAFETY: valid pointers; pthread_sigmask only changes this thread's mask.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(Self { set })
    }

    /// Waits up to `timeout` for one of the signals; returns its number.
    pub fn wait(&self, timeout: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: valid set and timespec; a null siginfo pointer is allowed.
        let signal = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (signal > 0).then_some(signal)
    }
}
