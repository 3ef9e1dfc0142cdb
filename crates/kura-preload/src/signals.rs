//! Written data survives `SIGTERM` and `SIGHUP`, as the kernel's page cache survives a killed
//! process: a program under the preload keeps its buffered writes in its own page cache, and
//! `timeout`, `kill`, `systemctl stop`, `docker stop` or a closed terminal ending it by a
//! signal's default action would lose what it wrote in the last write-back interval (the
//! `exit` hook never runs). For each of [`SIGNALS`] whose disposition is the default when the
//! library loads, a handler is installed that has the process's dirty pages written back and
//! then ends the process by the same signal, with the default action (the exit status is
//! unchanged). A program that installs its own handler replaces it, and its own exit path
//! writes back as before; `SIGINT` is left alone (Python and shells look whether it is the
//! default to install theirs). `SIGKILL` cannot be caught: what a process killed by it wrote
//! since the last write-back is lost. `KURA_FS_SIGNAL_WRITEBACK=0` turns this off.
//!
//! A handler may only do async-signal-safe things, and the interrupted code may hold any
//! lock (malloc's, the cache's). So the handler asks this process's write-back service
//! thread (which blocks every signal) through a pipe. Interrupting user code, it waits for
//! the answer for at most [`WRITEBACK_WAIT_MS`] and ends the process. Interrupting a kura call
//! (which may hold the locks the write-back needs), it returns at once and the service ends the
//! process itself. Either way the service first waits for the kura calls in progress to
//! finish and keeps new ones out ([`CALLS_FINISH_WAIT_MS`]), so a write is in the pool whole
//! or not at all. The pipes and
//! the service's process id live in statics: a signal handler cannot reach anything else.

use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use crate::hooks::{complain, raw};
use crate::state;

/// The signals whose default action is handled.
pub const SIGNALS: [c_int; 2] = [libc::SIGTERM, libc::SIGHUP];
/// How long a handler waits for the write-back before it ends the process anyway.
const WRITEBACK_WAIT_MS: c_int = 10_000;
/// How long the service waits for kura calls in progress to finish before it writes back.
const CALLS_FINISH_WAIT_MS: u64 = 5_000;
/// A request byte: write back and answer (any other byte is a signal to end the process by).
const REQUEST_WRITEBACK: u8 = 0;

/// The write end of the service's request pipe (-1: no service).
static REQUEST_FD: AtomicI32 = AtomicI32::new(-1);
/// The read end of the service's answer pipe.
static DONE_FD: AtomicI32 = AtomicI32::new(-1);
/// The process the service runs in (a forked child has none until it starts its own).
static SERVICE_PID: AtomicU32 = AtomicU32::new(0);

/// Installs the handlers (at load time).
pub fn install() {
    if std::env::var("KURA_FS_SIGNAL_WRITEBACK").is_ok_and(|v| v == "0") {
        return;
    }
    for sig in SIGNALS {
        // SAFETY: a zeroed sigaction is a valid value; sigaction reads and writes only these.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying the current action into `old`.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 || old.sa_sigaction != libc::SIG_DFL {
            continue;
        }
        // SAFETY: as above.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_signal as extern "C" fn(c_int) as usize;
        act.sa_flags = libc::SA_RESTART;
        // SAFETY: `act.sa_mask` is ours to fill; then the handler is installed.
        unsafe {
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// Starts this process's write-back service unless it runs (cheap when it does: one load).
/// Called when the process first writes to a kura file, and again in a forked child.
#[inline]
pub fn ensure_service() {
    if SERVICE_PID.load(Ordering::Acquire) != kura_fs::process_id() {
        start_service();
    }
}

/// After `fork`, in the child: the parent's service thread is not here.
pub fn forget_service() {
    SERVICE_PID.store(0, Ordering::Release);
}

#[cold]
fn start_service() {
    // One starter per process, without a lock a forked child could inherit held: a thread
    // that finds another starting returns (its next write looks again).
    static STARTING_PID: AtomicU32 = AtomicU32::new(0);
    let pid = kura_fs::process_id();
    let starting = STARTING_PID.load(Ordering::Acquire);
    if starting == pid || STARTING_PID.compare_exchange(starting, pid, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return;
    }
    let (Some((req_r, req_w)), Some((done_r, done_w))) = (pipe(), pipe()) else {
        complain("libkura_fs: no pipe for the signal write-back service");
        return;
    };
    let spawned = std::thread::Builder::new().name("kura-fs-signals".into()).spawn(move || serve(req_r, done_w));
    if let Err(e) = spawned {
        complain(&format!("libkura_fs: cannot start the signal write-back service: {e}"));
        return;
    }
    for old in [REQUEST_FD.swap(req_w, Ordering::AcqRel), DONE_FD.swap(done_r, Ordering::AcqRel)] {
        if old >= 0 {
            raw::close(old); // the parent's, inherited across fork
        }
    }
    SERVICE_PID.store(pid, Ordering::Release);
}

/// A close-on-exec pipe, both ends moved high where programs do not `dup2`.
fn pipe() -> Option<(c_int, c_int)> {
    use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: both descriptors were just made and nothing else owns them.
    let high = |fd: c_int| kura_engine::fd::keep_high(unsafe { OwnedFd::from_raw_fd(fd) }).into_raw_fd();
    Some((high(fds[0]), high(fds[1])))
}

/// The service thread: every signal blocked (so none is handled here, inside kura code);
/// each request byte is one write-back of every dirty file, answered with one byte.
fn serve(requests: c_int, done: c_int) {
    // SAFETY: a full set blocks every signal this thread could be sent.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: reading one byte into our buffer.
        let n = unsafe { libc::read(requests, byte.as_mut_ptr().cast(), 1) };
        if n == 0 {
            return;
        }
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if SERVICE_PID.load(Ordering::Acquire) != kura_fs::process_id() {
            return; // a forked child's copy of the pipe: not this process's service
        }
        write_back_for_exit();
        if byte[0] == REQUEST_WRITEBACK {
            // SAFETY: writing one byte from our buffer.
            unsafe { libc::write(done, byte.as_ptr().cast(), 1) };
        } else {
            die(c_int::from(byte[0])); // the handler returned into a kura call
        }
    }
}

/// Writes back every dirty file once no thread is inside a kura call, and lets none start
/// again (the process is about to end): what it wrote is then in the pool whole, never a
/// write cut by the write-back (the kernel, too, ends a process between system calls).
fn write_back_for_exit() {
    let Some(state) = state::get() else { return };
    if !state.fork_gate.close_for_exit(std::time::Duration::from_millis(CALLS_FINISH_WAIT_MS)) {
        complain("libkura_fs: a kura call did not finish before the process ends; writing back what there is");
    }
    let _busy = state::Busy::enter();
    if let Some(fs) = state.fs_if_open()
        && let Err(e) = fs.writeback_all()
    {
        complain(&format!("libkura_fs: write-back before the process ends failed: {e}"));
    }
}

extern "C" fn on_signal(sig: c_int) {
    let (request, done) = (REQUEST_FD.load(Ordering::Acquire), DONE_FD.load(Ordering::Acquire));
    // SAFETY: getpid is async-signal-safe.
    if request < 0 || SERVICE_PID.load(Ordering::Acquire) != unsafe { libc::getpid() } as u32 {
        return die(sig); // nothing written here yet (or a child before its first write)
    }
    if state::busy() {
        // Inside a kura call, which may hold the locks a write-back needs: the service lets
        // it finish, then writes back and ends the process.
        let byte = [sig as u8];
        // SAFETY: write is async-signal-safe; the buffer is ours.
        if unsafe { libc::write(request, byte.as_ptr().cast(), 1) } == 1 {
            return;
        }
        return die(sig);
    }
    let byte = [REQUEST_WRITEBACK];
    // SAFETY: write, poll and read are async-signal-safe; the buffers are ours.
    unsafe {
        if libc::write(request, byte.as_ptr().cast(), 1) == 1 {
            let mut pfd = libc::pollfd { fd: done, events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut pfd, 1, WRITEBACK_WAIT_MS) == 1 {
                let mut answer = [0u8; 1];
                libc::read(done, answer.as_mut_ptr().cast(), 1);
            }
        }
    }
    die(sig);
}

/// Ends the process by `sig` with its default action (async-signal-safe calls only).
fn die(sig: c_int) {
    // SAFETY: sigaction, sigprocmask and kill are async-signal-safe; the structs are ours.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(sig, &act, std::ptr::null_mut());
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        // To this thread, where it is unblocked: the default action ends the process now.
        libc::raise(sig);
    }
}
