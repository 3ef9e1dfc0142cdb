//! Stopping a process this program did not start, by the pid it recorded, without ever
//! signalling another process that took the pid since.
//!
//! `kura fs` records the pid of the local server it starts (`server.json`) and a later `kura fs`
//! stops it: SIGTERM, then SIGKILL after a grace period. A pid alone does not name a process:
//! once the server has exited and been reaped, the kernel hands its number to the next process
//! or *thread* (`pid_max` is 32,768 by default, and a busy machine goes round it in minutes).
//! `kill(2)` of a thread's id signals that thread's whole process. Sending the grace period's
//! SIGKILL to a number that had meanwhile become a thread of a test program killed the test
//! program in a CI run. So a process is named here by its pid *and* its start time, and
//! signalled only through a pidfd opened while that pair was checked.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A process's start time: clock ticks after boot (field 22 of `/proc/PID/stat`). With the pid
/// it names one process for as long as the machine runs. `None` when no such process (or the
/// pid is a thread's that is not its process's first).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_ticks(&stat)
}

/// Field 22 of a `/proc/PID/stat` line. The command name (field 2, in parentheses) may itself
/// hold spaces and parentheses, so fields are counted from the last `)`.
fn parse_start_ticks(stat: &str) -> Option<u64> {
    // After the last ')' come field 3 (the state) and on: field 22 is the 20th.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// A handle on one running process (a pidfd): signals sent through it reach that process or
/// none, even after its pid is reused.
pub struct ProcessHandle {
    fd: OwnedFd,
}

impl ProcessHandle {
    /// The process `pid` if it runs and started at `started_ticks` (any process `pid` when
    /// `started_ticks` is `None`: a record written before start times were kept).
    pub fn open(pid: u32, started_ticks: Option<u64>) -> Option<Self> {
        let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
        // SAFETY: pidfd_open(2) takes two integers and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Checked *after* the pidfd is open: if the process that has the pid now is the one
        // that started at `start_ticks`, it had the pid already when the pidfd was opened
        // (a process's life is one stretch), so the pidfd is that process's.
        if let Some(expected) = started_ticks
            && start_ticks(pid as u32) != Some(expected)
        {
            return None;
        }
        Some(Self { fd })
    }

    /// Sends `signal`; false when the process has exited already.
    pub fn signal(&self, signal: i32) -> bool {
        // SAFETY: pidfd_send_signal(2) with our open pidfd, a signal number, no siginfo (NULL)
        // and no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        rc == 0
    }

    /// Waits until the process has exited (a zombie counts), at most `timeout`; true if it has.
    pub fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            // Rounded up: poll's own rounding never ends the wait early.
            let left_ms = deadline
                .saturating_duration_since(Instant::now())
                .as_micros()
                .div_ceil(1000)
                .min(i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd that lives across the call.
            let n = unsafe { libc::poll(&mut pfd, 1, left_ms) };
            if n > 0 {
                return true;
            }
            if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return false;
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }
}

/// How [`stop`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// No such process was running (it had exited, or the pid is another process's now).
    NotRunning,
    /// It exited within the grace period after SIGTERM.
    Exited,
    /// It was still running after the grace period and got SIGKILL.
    Killed,
}

/// Stops process `pid` that started at `start_ticks`: SIGTERM, and SIGKILL if it has not
/// exited after `grace`. Never signals any other process.
pub fn stop(pid: u32, start_ticks: Option<u64>, grace: Duration) -> Stopped {
    let Some(process) = ProcessHandle::open(pid, start_ticks) else {
        return Stopped::NotRunning;
    };
    if !process.signal(libc::SIGTERM) {
        return Stopped::NotRunning;
    }
    if process.wait_exit(grace) {
        return Stopped::Exited;
    }
    process.signal(libc::SIGKILL);
    process.wait_exit(grace);
    Stopped::Killed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Child, Command};

    fn spawn(script: &str) -> Child {
        let child = Command::new("sh").args(["-c", script]).spawn().unwrap();
        // Let the shell set its traps before it is signalled.
        std::thread::sleep(Duration::from_millis(200));
        child
    }

    #[test]
    fn start_ticks_are_field_22_even_with_parentheses_in_the_name() {
        let stat = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 12345 67 18446744073709551615";
        assert_eq!(parse_start_ticks(stat), Some(987654));
        assert_eq!(parse_start_ticks("4242 (short) S 1"), None);
        assert!(start_ticks(std::process::id()).is_some());
    }

    #[test]
    fn a_process_that_obeys_sigterm_exits() {
        let mut child = spawn("sleep 30");
        let ticks = start_ticks(child.id());
        assert!(ticks.is_some());
        assert_eq!(
            stop(child.id(), ticks, Duration::from_secs(10)),
            Stopped::Exited
        );
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn a_process_that_ignores_sigterm_is_killed_after_the_grace_period() {
        let mut child = spawn("trap '' TERM; while :; do sleep 0.05; done");
        let ticks = start_ticks(child.id());
        let started = Instant::now();
        assert_eq!(
            stop(child.id(), ticks, Duration::from_millis(300)),
            Stopped::Killed
        );
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    /// The pid of a process that started at another time than recorded is another process's:
    /// it is left alone.
    #[test]
    fn a_process_with_the_pid_but_another_start_time_is_left_alone() {
        let mut child = spawn("sleep 30");
        let ticks = start_ticks(child.id()).unwrap();
        assert_eq!(
            stop(child.id(), Some(ticks + 1), Duration::from_millis(100)),
            Stopped::NotRunning
        );
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "the process must still run"
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A thread's id is not a process: pidfd_open refuses it, so a pid reused by a thread of
    /// some program never gets that program signalled.
    #[test]
    fn a_thread_id_is_not_taken_for_a_process() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // SAFETY: gettid(2) has no arguments.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_ne!(tid, std::process::id());
        assert!(ProcessHandle::open(tid, None).is_none());
        assert_eq!(
            stop(tid, None, Duration::from_millis(100)),
            Stopped::NotRunning
        );
        done_tx.send(()).unwrap();
        thread.join().unwrap();
    }

    #[test]
    fn nothing_runs_at_pid_zero_or_at_an_exited_pid() {
        assert_eq!(
            stop(0, None, Duration::from_millis(10)),
            Stopped::NotRunning
        );
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // Reaped: the pid is free (or another process's, which then started later).
        assert_eq!(
            stop(pid, Some(0), Duration::from_millis(10)),
            Stopped::NotRunning
        );
    }
}
