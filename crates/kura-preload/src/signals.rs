//! Written data survives `SIGTERM`, `SIGHUP` and `SIGINT`, as the kernel's page cache
//! survives a killed process: a program under the preload keeps its buffered writes in its
//! own page cache, and `timeout`, `kill`, `systemctl stop`, a closed terminal or Ctrl-C
//! ending it by a signal's default action would lose what it wrote in the last write-back
//! interval (the `exit` hook never runs). For each of [`SIGNALS`] whose disposition is the
//! default when the library loads, a handler is installed that has the process's dirty pages
//! written back and then ends the process by the same signal, with the default action (the
//! exit status is unchanged). `SIGKILL` cannot be caught: what a process killed by it wrote
//! since the last write-back is lost. `KURA_FS_SIGNAL_WRITEBACK=0` turns this off.
//!
//! The program never sees kura's handler: `sigaction` (and `signal`, which glibc builds on
//! it) is hooked ([`h_sigaction`]) to report the default action where kura's stands in for it;
//! a program that installs a handler or ignores the signal simply replaces it (Python
//! installs `KeyboardInterrupt` for `SIGINT` only where it finds the default), and one that
//! asks for the default action gets kura's again. The hook
//! speaks the kernel's `rt_sigaction` itself, with a signal-return trampoline of its own, as
//! glibc's `sigaction` does (the patched original cannot be called).
//!
//! A handler may only do async-signal-safe things, and the interrupted code may hold any
//! lock (malloc's, the cache's). So the handler asks this process's write-back service
//! thread (which blocks every signal) through a pipe. Interrupting user code, it waits for
//! the answer for at most [`WRITEBACK_WAIT_MS`] and ends the process. Interrupting a kura call
//! (which may hold the locks the write-back needs), it returns at once and the service ends the
//! process itself; threads leaving kura calls meanwhile stop there ([`stop_if_ending`]), so
//! the program does not run on after the signal. Either way the service first waits for the kura calls in progress to
//! finish and keeps new ones out ([`CALLS_FINISH_WAIT_MS`]), so a write is in the pool whole
//! or not at all. The pipes, the service's process id and which signals carry kura's handler
//! live in statics: a signal handler cannot reach anything else.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

use crate::hooks::{complain, errno, raw, set_errno};
use crate::state;

/// The signals whose default action is handled.
pub const SIGNALS: [c_int; 3] = [libc::SIGTERM, libc::SIGHUP, libc::SIGINT];
/// Signal numbers the kernel knows (1..=64).
const SIGNAL_MAX: usize = 64;
/// glibc's own signals (thread cancellation, setxid), which its `sigaction` refuses.
const GLIBC_INTERNAL_SIGNALS: [c_int; 2] = [32, 33];

/// Whether kura's handlers are wanted (`KURA_FS_SIGNAL_WRITEBACK` is not 0).
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Whether kura's handler stands in for the default action of each signal (by number).
static STANDS_IN: [AtomicBool; SIGNAL_MAX + 1] = [const { AtomicBool::new(false) }; SIGNAL_MAX + 1];

/// The kernel's `struct sigaction` on x86-64 (`rt_sigaction(2)`; the mask is 64 bits).
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// `SA_RESTORER`: the kernel returns from a handler through `restorer` (x86-64 needs one).
const SA_RESTORER: u64 = 0x0400_0000;

// The signal-return trampoline glibc's `sigaction` installs too (`__restore_rt`): a handler
// returns here and the kernel restores the interrupted context.
std::arch::global_asm!(
    ".globl kura_restore_rt",
    ".type kura_restore_rt,@function",
    "kura_restore_rt:",
    "mov rax, 15", // rt_sigreturn
    "syscall",
);

unsafe extern "C" {
    fn kura_restore_rt();
}

/// `rt_sigaction` as glibc's `sigaction` calls it: `act` with kura's restorer.
fn rt_sigaction(sig: c_int, act: Option<&KernelSigaction>, old: Option<&mut KernelSigaction>) -> Result<(), c_int> {
    let act = act.map(|a| KernelSigaction { flags: a.flags | SA_RESTORER, restorer: kura_restore_rt as *const () as usize, ..*a });
    let act_ptr = act.as_ref().map_or(std::ptr::null(), |a| a as *const KernelSigaction);
    let old_ptr = old.map_or(std::ptr::null_mut(), |o| o as *mut KernelSigaction);
    // SAFETY: both pointers are null or point to KernelSigaction values that live across the
    // call; the size argument is the kernel's sigset size (8 bytes).
    let r = unsafe { crate::raw_syscall!(libc::SYS_rt_sigaction, sig, act_ptr, old_ptr, 8usize) };
    if r < 0 { Err(errno()) } else { Ok(()) }
}

/// `sigaction` (and `__sigaction`; `signal`, `sigset` and `bsd_signal` call it): the kernel's
/// answer, except that where kura's handler stands in for the default action the program
/// is told the default action, and setting any action replaces kura's.
pub extern "C" fn h_sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    if sig <= 0 || sig as usize > SIGNAL_MAX || GLIBC_INTERNAL_SIGNALS.contains(&sig) {
        set_errno(libc::EINVAL);
        return -1;
    }
    let stands_in = &STANDS_IN[sig as usize];
    let kernel_act = (!act.is_null()).then(|| {
        // SAFETY: the caller's struct sigaction (sigaction(2)'s contract).
        let a = unsafe { &*act };
        // SAFETY: sigset_t is plain memory at least 8 bytes long; its first word is the
        // kernel's mask (what glibc copies).
        let mask = unsafe { *(&a.sa_mask as *const libc::sigset_t).cast::<u64>() };
        KernelSigaction { handler: a.sa_sigaction, flags: a.sa_flags as u32 as u64, restorer: 0, mask }
    });
    // The program asks for the default action of one of kura's signals: kura's handler
    // gives it (after the write-back).
    let kernel_act = match kernel_act {
        Some(a) if a.handler == libc::SIG_DFL && ENABLED.load(Ordering::Acquire) && SIGNALS.contains(&sig) => {
            let mut kernel_old = KernelSigaction::default();
            let was_ours = stands_in.load(Ordering::Acquire);
            if let Err(e) = rt_sigaction(sig, Some(&handler_action()), (!was_ours).then_some(&mut kernel_old)) {
                set_errno(e);
                return -1;
            }
            stands_in.store(true, Ordering::Release);
            report(old, &kernel_old);
            return 0;
        }
        other => other,
    };
    let mut kernel_old = KernelSigaction::default();
    let result = if stands_in.load(Ordering::Acquire) {
        // What the program would have: the default action (what kura's replaced).
        match kernel_act.as_ref() {
            Some(a) => rt_sigaction(sig, Some(a), None).map(|()| stands_in.store(false, Ordering::Release)),
            None => Ok(()),
        }
    } else {
        rt_sigaction(sig, kernel_act.as_ref(), (!old.is_null()).then_some(&mut kernel_old))
    };
    if let Err(e) = result {
        set_errno(e);
        return -1;
    }
    report(old, &kernel_old);
    0
}

/// Fills the caller's `old` (when given) from the kernel's answer, as glibc does.
fn report(old: *mut libc::sigaction, kernel_old: &KernelSigaction) {
    if old.is_null() {
        return;
    }
    // SAFETY: the caller's struct sigaction to fill (sigaction(2)'s contract); a restorer the
    // kernel reports is a function address some `sigaction` call installed.
    unsafe {
        let o = &mut *old;
        o.sa_sigaction = kernel_old.handler;
        libc::sigemptyset(&mut o.sa_mask);
        *(&mut o.sa_mask as *mut libc::sigset_t).cast::<u64>() = kernel_old.mask;
        o.sa_flags = kernel_old.flags as c_int;
        o.sa_restorer = (kernel_old.restorer != 0).then(|| std::mem::transmute::<usize, extern "C" fn()>(kernel_old.restorer));
    }
}

/// Kura's handler as the kernel takes it.
fn handler_action() -> KernelSigaction {
    KernelSigaction { handler: on_signal as extern "C" fn(c_int) as usize, flags: libc::SA_RESTART as u64, restorer: 0, mask: 0 }
}

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

/// Installs the handlers (at load time, with the hooks in place: no program code ran yet).
pub fn install() {
    if std::env::var("KURA_FS_SIGNAL_WRITEBACK").is_ok_and(|v| v == "0") {
        return;
    }
    ENABLED.store(true, Ordering::Release);
    for sig in SIGNALS {
        let mut old = KernelSigaction::default();
        if rt_sigaction(sig, None, Some(&mut old)).is_err() || old.handler != libc::SIG_DFL {
            continue;
        }
        if rt_sigaction(sig, Some(&handler_action()), None).is_ok() {
            STANDS_IN[sig as usize].store(true, Ordering::Release);
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
    kura_fs::block_signals_in_this_thread();
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
        && let Err(e) = fs.writeback_before_leaving()
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
        // it finish, then writes back and ends the process. The call's thread stops at its
        // end ([`stop_if_ending`]) instead of running on into the program.
        ENDING_BY.store(sig, Ordering::Release);
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

/// The signal the write-back service is ending the process by (0: none).
static ENDING_BY: AtomicI32 = AtomicI32::new(0);

/// Called at the end of a thread's outermost kura call: when the service is ending the
/// process by a signal, this thread waits for it (the service writes back first, at most
/// [`CALLS_FINISH_WAIT_MS`] after the calls it waits for), then ends the process itself if it
/// still runs.
pub fn stop_if_ending() {
    let sig = ENDING_BY.load(Ordering::Acquire);
    if sig == 0 || SERVICE_PID.load(Ordering::Acquire) != kura_fs::process_id() {
        return;
    }
    std::thread::sleep(std::time::Duration::from_millis(CALLS_FINISH_WAIT_MS + WRITEBACK_WAIT_MS as u64));
    die(sig);
}

/// Ends the process by `sig` with its default action (async-signal-safe calls only).
fn die(sig: c_int) {
    STANDS_IN[sig as usize].store(false, Ordering::Release);
    let default = KernelSigaction { handler: libc::SIG_DFL, ..KernelSigaction::default() };
    let _ = rt_sigaction(sig, Some(&default), None);
    // SAFETY: sigprocmask and raise are async-signal-safe; the set is ours.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        // To this thread, where it is unblocked: the default action ends the process now.
        libc::raise(sig);
    }
}
