//! `posix_spawn` and `posix_spawnp`, and through them glibc's `system` and `popen` (which call
//! the same code): a child made by `fork` that applies the file actions and attributes, then
//! `exec`s, each step through the hooks.
//!
//! glibc runs a spawned child with `clone(CLONE_VM | CLONE_VFORK)`: in the parent's memory, on
//! the calling thread's stack, while the parent's other threads go on, but with a descriptor
//! table of its own. Its `chdir` and `open` actions and its `execve` reach the hooks there, and
//! what they did to the preload's state (a virtual working directory, a descriptor or a pool
//! connection recorded for a descriptor number only the child had) stayed in the parent after
//! the child's `exec`: cargo's first build in a kura directory failed with EINVAL from the pool
//! or hung a later child. A child made by `fork` runs the hooks in memory of its own, after the
//! fork handlers made that safe (dirty data written back, no lock held by a thread it lacks).
//!
//! Where glibc's file actions are laid out otherwise than [`SpawnAction`] says (another glibc
//! than the one checked), the functions are not patched and glibc's run ([`layout_matches`]).

use std::ffi::{c_char, c_int, c_short};

use crate::hooks::{guard, raw};

/// glibc's `struct __spawn_action` (`posix/spawn_int.h`, glibc 2.35+): a tag, then a union of
/// the actions' arguments. Checked against glibc at first use ([`layout_matches`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct SpawnAction {
    tag: c_int,
    action: ActionArgs,
}

#[repr(C)]
#[derive(Clone, Copy)]
union ActionArgs {
    /// close, fchdir, closefrom, tcsetpgrp: one descriptor.
    fd: c_int,
    dup2: Dup2Args,
    open: OpenArgs,
    chdir: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Dup2Args {
    fd: c_int,
    newfd: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct OpenArgs {
    fd: c_int,
    path: *const c_char,
    oflag: c_int,
    mode: libc::mode_t,
}

const DO_CLOSE: c_int = 0;
const DO_DUP2: c_int = 1;
const DO_OPEN: c_int = 2;
const DO_CHDIR: c_int = 3;
const DO_FCHDIR: c_int = 4;
const DO_CLOSEFROM: c_int = 5;
const DO_TCSETPGRP: c_int = 6;

/// glibc's `posix_spawn_file_actions_t`.
#[repr(C)]
struct FileActions {
    allocated: c_int,
    used: c_int,
    actions: *const SpawnAction,
    pad: [c_int; 16],
}

const _: () = assert!(std::mem::size_of::<FileActions>() == std::mem::size_of::<libc::posix_spawn_file_actions_t>());

// The attribute flags of `<spawn.h>`.
const RESETIDS: c_short = 0x01;
const SETPGROUP: c_short = 0x02;
const SETSIGDEF: c_short = 0x04;
const SETSIGMASK: c_short = 0x08;
const SETSCHEDPARAM: c_short = 0x10;
const SETSCHEDULER: c_short = 0x20;
const SETSID: c_short = 0x80;

unsafe extern "C" {
    // glibc 2.29+ / 2.34+ / 2.35+; not in the libc crate.
    fn posix_spawn_file_actions_addchdir_np(actions: *mut libc::posix_spawn_file_actions_t, path: *const c_char) -> c_int;
    fn posix_spawn_file_actions_addfchdir_np(actions: *mut libc::posix_spawn_file_actions_t, fd: c_int) -> c_int;
    fn posix_spawn_file_actions_addclosefrom_np(actions: *mut libc::posix_spawn_file_actions_t, from: c_int) -> c_int;
    fn posix_spawn_file_actions_addtcsetpgrp_np(actions: *mut libc::posix_spawn_file_actions_t, fd: c_int) -> c_int;
}

/// Whether glibc records file actions as [`SpawnAction`] says: one of each, built with its
/// own functions, read back. When not (another glibc), spawning stays glibc's.
pub(crate) fn layout_matches() -> bool {
    static MATCHES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MATCHES.get_or_init(|| {
        // SAFETY: a zeroed value is what posix_spawn_file_actions_init overwrites; every call
        // gets the initialised object, which is destroyed at the end.
        unsafe {
            let mut fa: libc::posix_spawn_file_actions_t = std::mem::zeroed();
            if libc::posix_spawn_file_actions_init(&mut fa) != 0 {
                return false;
            }
            let ok = libc::posix_spawn_file_actions_addclose(&mut fa, 11) == 0
                && libc::posix_spawn_file_actions_adddup2(&mut fa, 12, 13) == 0
                && libc::posix_spawn_file_actions_addopen(&mut fa, 14, c"/o".as_ptr(), libc::O_RDWR, 0o640) == 0
                && posix_spawn_file_actions_addchdir_np(&mut fa, c"/c".as_ptr()) == 0
                && posix_spawn_file_actions_addfchdir_np(&mut fa, 15) == 0
                && posix_spawn_file_actions_addclosefrom_np(&mut fa, 16) == 0
                && posix_spawn_file_actions_addtcsetpgrp_np(&mut fa, 17) == 0;
            let view = &*(&fa as *const libc::posix_spawn_file_actions_t).cast::<FileActions>();
            let matches = ok && view.used == 7 && !view.actions.is_null() && {
                let a = std::slice::from_raw_parts(view.actions, 7);
                let is = |p: *const c_char, want: &std::ffi::CStr| !p.is_null() && std::ffi::CStr::from_ptr(p) == want;
                a[0].tag == DO_CLOSE
                    && a[0].action.fd == 11
                    && a[1].tag == DO_DUP2
                    && (a[1].action.dup2.fd, a[1].action.dup2.newfd) == (12, 13)
                    && a[2].tag == DO_OPEN
                    && a[2].action.open.fd == 14
                    && is(a[2].action.open.path, c"/o")
                    && (a[2].action.open.oflag, a[2].action.open.mode) == (libc::O_RDWR, 0o640)
                    && a[3].tag == DO_CHDIR
                    && is(a[3].action.chdir, c"/c")
                    && a[4].tag == DO_FCHDIR
                    && a[4].action.fd == 15
                    && a[5].tag == DO_CLOSEFROM
                    && a[5].action.fd == 16
                    && a[6].tag == DO_TCSETPGRP
                    && a[6].action.fd == 17
            };
            libc::posix_spawn_file_actions_destroy(&mut fa);
            matches
        }
    })
}

pub(crate) extern "C" fn h_posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    guard(libc::EIO, || spawn(pid, path, actions, attr, argv, envp, false))
}

pub(crate) extern "C" fn h_posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    guard(libc::EIO, || spawn(pid, file, actions, attr, argv, envp, true))
}

/// The attributes a child applies, read through glibc's getters.
struct Attributes {
    flags: c_short,
    pgroup: libc::pid_t,
    sigdefault: libc::sigset_t,
    sigmask: libc::sigset_t,
    policy: c_int,
    param: libc::sched_param,
}

fn attributes(attr: *const libc::posix_spawnattr_t) -> Option<Attributes> {
    if attr.is_null() {
        return None;
    }
    // SAFETY: zeroed sigsets and sched_param are valid values; the getters write into them
    // and read the caller's initialised attribute object.
    unsafe {
        let mut a = Attributes { flags: 0, pgroup: 0, sigdefault: std::mem::zeroed(), sigmask: std::mem::zeroed(), policy: 0, param: std::mem::zeroed() };
        libc::posix_spawnattr_getflags(attr, &mut a.flags);
        libc::posix_spawnattr_getpgroup(attr, &mut a.pgroup);
        libc::posix_spawnattr_getsigdefault(attr, &mut a.sigdefault);
        libc::posix_spawnattr_getsigmask(attr, &mut a.sigmask);
        libc::posix_spawnattr_getschedpolicy(attr, &mut a.policy);
        libc::posix_spawnattr_getschedparam(attr, &mut a.param);
        Some(a)
    }
}

/// `fork`, the child's steps, `exec`; the parent learns a failure's errno through a
/// close-on-exec pipe (end of file: the `exec` happened).
fn spawn(
    pid_out: *mut libc::pid_t,
    path: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
    search: bool,
) -> c_int {
    let attrs = attributes(attr);
    let actions: &[SpawnAction] = if actions.is_null() {
        &[]
    } else {
        // SAFETY: the caller's initialised file actions, whose layout layout_matches checked;
        // `used` entries of `actions` are initialised.
        unsafe {
            let fa = &*actions.cast::<FileActions>();
            if fa.used <= 0 || fa.actions.is_null() { &[] } else { std::slice::from_raw_parts(fa.actions, fa.used as usize) }
        }
    };
    // Before the fork: PATH as the caller's environment has it (as glibc searches).
    let search_path: Option<Vec<u8>> = search.then(|| std::env::var_os("PATH").map_or_else(|| b"/bin:/usr/bin".to_vec(), std::os::unix::ffi::OsStringExt::into_vec));
    let mut pipe = [0 as c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { crate::raw_syscall!(libc::SYS_pipe2, pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return crate::hooks::errno();
    }
    // Signals wait until the child has its own dispositions and mask (as glibc's does).
    // SAFETY: sigsets written by sigfillset and pthread_sigmask.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // SAFETY: glibc's fork (not patched): the preload's fork handlers run.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        raw::close(pipe[0]);
        let mut report = pipe[1];
        let e = child(path, actions, attrs.as_ref(), &old, argv, envp, search_path.as_deref(), &mut report);
        report_and_exit(report, e);
    }
    let fork_errno = crate::hooks::errno();
    // SAFETY: restoring the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    raw::close(pipe[1]);
    if pid < 0 {
        raw::close(pipe[0]);
        return fork_errno;
    }
    let mut e = [0u8; 4];
    let n = loop {
        // SAFETY: reading into our buffer.
        let n = unsafe { crate::raw_syscall!(libc::SYS_read, pipe[0], e.as_mut_ptr(), e.len()) };
        if n < 0 && crate::hooks::errno() == libc::EINTR {
            continue;
        }
        break n;
    };
    raw::close(pipe[0]);
    if n == 4 {
        // The child failed before its exec and exited: reap it, as glibc does.
        let mut status = 0;
        // SAFETY: waiting for our own child.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 && crate::hooks::errno() == libc::EINTR {}
        return c_int::from_ne_bytes(e);
    }
    if !pid_out.is_null() {
        // SAFETY: the caller's pid_t.
        unsafe { *pid_out = pid };
    }
    0
}

/// Sends the errno of the step that failed to the parent and exits (127, as glibc's child).
fn report_and_exit(pipe: c_int, e: c_int) -> ! {
    let bytes = e.to_ne_bytes();
    // SAFETY: writing our buffer; then exit_group, which does not return (the hooked _exit
    // would write back, and a child that never ran its program has nothing to write).
    unsafe {
        crate::raw_syscall!(libc::SYS_write, pipe, bytes.as_ptr(), bytes.len());
        crate::raw_syscall!(libc::SYS_exit_group, 127);
    }
    unreachable!("exit_group returned")
}

/// The child's steps in glibc's order (`__spawni_child`); returns the errno of the one that
/// failed. Every call goes through the hooks: an action on a kura path opens or enters it.
#[allow(clippy::too_many_arguments, reason = "posix_spawn's arguments, split")]
fn child(
    path: *const c_char,
    actions: &[SpawnAction],
    attrs: Option<&Attributes>,
    parent_mask: &libc::sigset_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
    search_path: Option<&[u8]>,
    pipe: &mut c_int,
) -> c_int {
    // Our pipe out of the way of the actions' descriptors.
    // SAFETY: integers.
    let high = unsafe { crate::raw_syscall!(libc::SYS_fcntl, *pipe, libc::F_DUPFD_CLOEXEC, kura_engine::fd::high_base()) } as c_int;
    if high >= 0 {
        raw::close(*pipe);
        *pipe = high;
    }
    // SAFETY: libc calls with integers, the caller's strings and sets, and structures that
    // live across each call; the union fields read are the ones each action's tag names.
    unsafe {
        let flags = attrs.map_or(0, |a| a.flags);
        if let Some(a) = attrs.filter(|_| flags & SETSIGDEF != 0) {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            for sig in (1..=libc::SIGRTMAX()).filter(|&sig| sig != libc::SIGKILL && sig != libc::SIGSTOP) {
                if libc::sigismember(&a.sigdefault, sig) == 1 {
                    libc::sigaction(sig, &sa, std::ptr::null_mut());
                }
            }
        }
        if let Some(a) = attrs {
            if flags & SETSCHEDULER != 0 {
                if libc::sched_setscheduler(0, a.policy, &a.param) == -1 {
                    return crate::hooks::errno();
                }
            } else if flags & SETSCHEDPARAM != 0 && libc::sched_setparam(0, &a.param) == -1 {
                return crate::hooks::errno();
            }
            if flags & SETSID != 0 && libc::setsid() < 0 {
                return crate::hooks::errno();
            }
            if flags & SETPGROUP != 0 && libc::setpgid(0, a.pgroup) != 0 {
                return crate::hooks::errno();
            }
            if flags & RESETIDS != 0 && (libc::setgid(libc::getgid()) != 0 || libc::setuid(libc::getuid()) != 0) {
                return crate::hooks::errno();
            }
        }
        for action in actions {
            match action.tag {
                DO_CLOSE => {
                    let fd = action.action.fd;
                    if fd == *pipe {
                        *pipe = move_pipe(*pipe);
                    }
                    // glibc fails only for a descriptor out of range; closing one that is not
                    // open is fine.
                    if libc::close(fd) != 0 && crate::hooks::errno() == libc::EBADF && !fd_in_range(fd) {
                        return libc::EBADF;
                    }
                }
                DO_DUP2 => {
                    let Dup2Args { fd, newfd } = action.action.dup2;
                    if newfd == *pipe {
                        *pipe = move_pipe(*pipe);
                    }
                    if fd == newfd {
                        // POSIX 2024 (glibc 2.29): the descriptor stays open across exec.
                        let f = libc::fcntl(fd, libc::F_GETFD);
                        if f < 0 || libc::fcntl(fd, libc::F_SETFD, f & !libc::FD_CLOEXEC) < 0 {
                            return crate::hooks::errno();
                        }
                    } else if libc::dup2(fd, newfd) != newfd {
                        return crate::hooks::errno();
                    }
                }
                DO_OPEN => {
                    let OpenArgs { fd, path, oflag, mode } = action.action.open;
                    if fd == *pipe {
                        *pipe = move_pipe(*pipe);
                    }
                    let opened = libc::open(path, oflag, mode as c_int);
                    if opened < 0 {
                        return crate::hooks::errno();
                    }
                    if opened != fd {
                        if libc::dup2(opened, fd) != fd {
                            return crate::hooks::errno();
                        }
                        libc::close(opened);
                    }
                }
                DO_CHDIR => {
                    if libc::chdir(action.action.chdir) != 0 {
                        return crate::hooks::errno();
                    }
                }
                DO_FCHDIR => {
                    if libc::fchdir(action.action.fd) != 0 {
                        return crate::hooks::errno();
                    }
                }
                DO_CLOSEFROM => {
                    // Around our pipe, which stays open until the exec.
                    let from = action.action.fd.max(0) as u32;
                    let p = *pipe as u32;
                    let r = if p >= from {
                        let below = if p > from { libc::close_range(from, p - 1, 0) } else { 0 };
                        let above = libc::close_range(p + 1, u32::MAX, 0);
                        if below != 0 { below } else { above }
                    } else {
                        libc::close_range(from, u32::MAX, 0)
                    };
                    if r != 0 {
                        return crate::hooks::errno();
                    }
                }
                DO_TCSETPGRP => {
                    if libc::tcsetpgrp(action.action.fd, libc::getpgrp()) != 0 {
                        return crate::hooks::errno();
                    }
                }
                _ => return libc::EINVAL,
            }
        }
        let mask = match attrs {
            Some(a) if flags & SETSIGMASK != 0 => &a.sigmask,
            _ => parent_mask,
        };
        libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut());
        exec(path, argv, envp, search_path)
    }
}

/// A descriptor number the actions are about to use, moved elsewhere.
fn move_pipe(pipe: c_int) -> c_int {
    // SAFETY: integers.
    let moved = unsafe { crate::raw_syscall!(libc::SYS_fcntl, pipe, libc::F_DUPFD_CLOEXEC, pipe + 1) } as c_int;
    if moved < 0 {
        return pipe;
    }
    raw::close(pipe);
    moved
}

fn fd_in_range(fd: c_int) -> bool {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only the struct it is given.
    fd >= 0 && (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || (fd as u64) < limit.rlim_cur)
}

/// `execve` (hooked: kura programs and scripts run), searching `search_path` for a name
/// without a slash as glibc's `posix_spawnp` does; the errno when nothing ran.
fn exec(path: *const c_char, argv: *const *mut c_char, envp: *const *mut c_char, search_path: Option<&[u8]>) -> c_int {
    // SAFETY: the caller's NUL-terminated path.
    let name = unsafe { std::ffi::CStr::from_ptr(path) }.to_bytes();
    let Some(search_path) = search_path.filter(|_| !name.contains(&b'/')) else {
        // SAFETY: the caller's arguments.
        unsafe { libc::execve(path, argv.cast(), envp.cast()) };
        return crate::hooks::errno();
    };
    if name.is_empty() {
        return libc::ENOENT;
    }
    let mut last = libc::ENOENT;
    let mut denied = false;
    for dir in search_path.split(|&b| b == b':') {
        let mut full = if dir.is_empty() { b".".to_vec() } else { dir.to_vec() };
        full.push(b'/');
        full.extend_from_slice(name);
        full.push(0);
        // SAFETY: a NUL-terminated path we own, the caller's argv and envp.
        unsafe { libc::execve(full.as_ptr().cast(), argv.cast(), envp.cast()) };
        last = crate::hooks::errno();
        match last {
            libc::EACCES => denied = true,
            libc::ENOENT | libc::ENOTDIR | libc::ENAMETOOLONG | libc::ELOOP | libc::ENODEV | libc::ETIMEDOUT | libc::ESTALE => {}
            _ => return last,
        }
    }
    if denied { libc::EACCES } else { last }
}
