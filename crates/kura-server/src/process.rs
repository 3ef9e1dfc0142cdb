//! The server as a system service runs it, with memcached's options: in the background
//! (`-d`), with a pid file (`-P`), as an unprivileged user (`-u`), its memory locked (`-k`),
//! leaving core dumps (`-r`).
//!
//! `-d` forks before any thread starts. The parent stays until the child has bound its
//! sockets and opened the store, or failed to: the child tells it through a pipe, and the
//! parent exits 0 or prints the child's error and exits 1. So `kura serve -d` returns when
//! the server answers, as a service manager's `Type=forking` expects, and a mistake (a
//! port in use, a store that will not open) is seen by whoever started it.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, IsTerminal as _, Read as _, Write as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _};
use std::path::{Path, PathBuf};

/// A message from the daemon to the waiting parent: ready, or why it failed.
const READY: &[u8] = b"ready";
/// Bytes of an error message the parent reads from the daemon at most.
const ERROR_MESSAGE_BYTES_MAX: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("-u {0}: no such user")]
    NoSuchUser(String),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> ProcessError {
    let what = what.into();
    move |source| ProcessError::Io { what, source }
}

/// The daemon's end of the pipe to the parent waiting in [`daemonize`].
#[derive(Debug)]
pub struct Daemon {
    to_parent: File,
}

impl Daemon {
    /// The server is up: the parent exits 0.
    pub fn ready(mut self) {
        let _ = self.to_parent.write_all(READY);
    }

    /// The server could not start: the parent prints `error` and exits 1.
    pub fn failed(mut self, error: &dyn std::fmt::Display) {
        let _ = self.to_parent.write_all(error.to_string().as_bytes());
    }
}

/// Forks into the background: returns in the child (a new session, working directory `/`,
/// stdin and stdout on /dev/null, stderr too when it is a terminal); the parent waits for the
/// child's word and exits. Must run before the process starts any thread.
pub fn daemonize() -> Result<Daemon, ProcessError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io_error("creating a pipe")(io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just made and are owned by nothing else.
    let (mut from_child, to_parent) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // SAFETY: no other thread runs yet (the caller's contract), so the child may go on
    // running Rust code after the fork.
    match unsafe { libc::fork() } {
        -1 => Err(io_error("fork")(io::Error::last_os_error())),
        0 => {
            drop(from_child);
            // SAFETY: setsid has no preconditions; it fails only for a group leader, which a
            // forked child is not.
            unsafe { libc::setsid() };
            std::env::set_current_dir("/").map_err(io_error("changing to /"))?;
            let null = File::options().read(true).write(true).open("/dev/null").map_err(io_error("opening /dev/null"))?;
            let mut targets = vec![libc::STDIN_FILENO, libc::STDOUT_FILENO];
            if io::stderr().is_terminal() {
                targets.push(libc::STDERR_FILENO);
            }
            for target in targets {
                // SAFETY: dup2 onto a standard descriptor of this process from one we own.
                if unsafe { libc::dup2(null.as_raw_fd(), target) } < 0 {
                    return Err(io_error("redirecting to /dev/null")(io::Error::last_os_error()));
                }
            }
            Ok(Daemon { to_parent })
        }
        child => {
            drop(to_parent);
            let mut word = Vec::new();
            let _ = (&mut from_child).take(ERROR_MESSAGE_BYTES_MAX).read_to_end(&mut word);
            if word == READY {
                std::process::exit(0);
            }
            if word.is_empty() {
                eprintln!("kura serve -d: the server (pid {child}) exited before it was ready");
            } else {
                eprintln!("kura serve -d: {}", String::from_utf8_lossy(&word));
            }
            std::process::exit(1);
        }
    }
}

/// Paths made absolute from the working directory, before [`daemonize`] leaves it.
pub fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A pid file: written at [`PidFile::create`], removed when dropped if it still holds this
/// process's id.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
}

impl PidFile {
    pub fn create(path: &Path) -> Result<Self, ProcessError> {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .map_err(io_error(format!("writing the pid file {}", path.display())))?;
        Ok(Self { path: path.to_path_buf() })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path).is_ok_and(|s| s.trim() == std::process::id().to_string());
        if ours && let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "cannot remove the pid file");
        }
    }
}

/// Runs the process as `user` (its group and supplementary groups too) when it runs as root;
/// otherwise, as memcached, leaves it as it is. glibc changes the ids of every thread.
pub fn drop_privileges(user: &str) -> Result<(), ProcessError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tracing::debug!(user, "not root: -u has nothing to do");
        return Ok(());
    }
    let name = CString::new(user).map_err(|_| ProcessError::NoSuchUser(user.to_owned()))?;
    // SAFETY: passwd is plain data; getpwnam_r fills it and points its strings into `buf`.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: valid pointers to a passwd, a buffer of the given length and a result pointer,
    // all ours and alive for the call.
    let rc = unsafe { libc::getpwnam_r(name.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc != 0 {
        return Err(io_error(format!("looking up user {user}"))(io::Error::from_raw_os_error(rc)));
    }
    if found.is_null() {
        return Err(ProcessError::NoSuchUser(user.to_owned()));
    }
    let (uid, gid) = (pwd.pw_uid, pwd.pw_gid);
    // SAFETY: a NUL-terminated name and a gid; initgroups sets this process's supplementary
    // groups (glibc applies it to every thread).
    if unsafe { libc::initgroups(name.as_ptr(), gid) } != 0 {
        return Err(io_error(format!("setting the groups of {user}"))(io::Error::last_os_error()));
    }
    // SAFETY: setgid and setuid take plain ids; glibc applies them to every thread. The group
    // goes first: after setuid the process may no longer change it.
    if unsafe { libc::setgid(gid) } != 0 {
        return Err(io_error(format!("setgid {gid}"))(io::Error::last_os_error()));
    }
    // SAFETY: as above.
    if unsafe { libc::setuid(uid) } != 0 {
        return Err(io_error(format!("setuid {uid}"))(io::Error::last_os_error()));
    }
    tracing::info!(user, uid, gid, "running as");
    Ok(())
}

/// memcached's `-r`: the core file size limit raised to the hard limit (a warning if that
/// fails).
pub fn enable_coredumps() {
    // SAFETY: getrlimit and setrlimit read and write the rlimit struct we own.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_CORE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_CORE, &limit) == 0 {
                tracing::info!(core_limit = limit.rlim_cur, "-r: core file size limit raised");
                return;
            }
        }
    }
    tracing::warn!(error = %io::Error::last_os_error(), "-r: failed to raise the core file size limit");
}

/// memcached's `-k`: every page of the process, now and to come, locked in RAM. A refusal
/// (RLIMIT_MEMLOCK too low, no CAP_IPC_LOCK) is a warning, and the server runs unlocked, as
/// memcached does.
pub fn lock_memory() {
    // SAFETY: mlockall takes flags only.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } == 0 {
        tracing::info!("-k: memory locked");
    } else {
        tracing::warn!(error = %io::Error::last_os_error(), "-k: mlockall failed; running with memory unlocked");
    }
}
