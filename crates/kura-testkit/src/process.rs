//! Ports, child processes and required commands.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

const WAIT_POLL_INTERVAL_MS: u64 = 20;
const CONNECT_TIMEOUT_MS: u64 = 200;

/// Builds the workspace `packages` (their binaries and libraries) into the target directory
/// and profile of the running test executable, and returns that profile directory
/// (`target/<profile>`) where they are. `cargo test -p X` builds no other package's binaries,
/// so tests that start `kura`, `kura-server` or load `libkura_fs.so` call this first; cargo
/// does nothing when they are up to date.
pub fn build_workspace_packages(packages: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf();
    let target_dir = profile_dir.parent().expect("target dir");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build.args(["build", "--quiet"]).env("CARGO_TARGET_DIR", target_dir).current_dir(crate::workspace_root());
    for package in packages {
        build.args(["-p", package]);
    }
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "cargo build of {packages:?} failed");
    profile_dir
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it for a listener that
/// is closed again). Another process may take it before the caller binds it: tests start the
/// server and then wait with [`wait_for_tcp`], which fails rather than hangs if that happened.
///
/// Never the same port twice in one process: tests of one binary run in parallel, and the OS
/// may hand a just-released port to the next `bind(0)` before the first test's server has bound
/// it — the second test would then talk to the first one's server.
pub fn free_tcp_port() -> io::Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    const ATTEMPTS_MAX: usize = 64;
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..ATTEMPTS_MAX {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, "no fresh free TCP port"))
}

/// Times [`spawn_listening`] tries a fresh port when its server exits at start.
const SPAWN_LISTENING_ATTEMPTS_MAX: usize = 5;

/// Starts a server on a free port of 127.0.0.1: `command(port)` builds its command line. Waits
/// until the server itself listens on the port (its own socket, found through `/proc`: a
/// connection that succeeds may have reached another process that holds the port for a
/// moment); a server that exited (its port was taken between [`free_tcp_port`] and its bind)
/// is started again on another port.
pub fn spawn_listening(name: &str, timeout: Duration, mut command: impl FnMut(u16) -> Command) -> io::Result<(ChildGuard, u16)> {
    let mut why = String::new();
    for _ in 0..SPAWN_LISTENING_ATTEMPTS_MAX {
        let port = free_tcp_port()?;
        let mut child = ChildGuard::spawn(name, &mut command(port))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                why = format!("{name} exited at start on port {port} ({status}; port taken?)");
                break;
            }
            if process_listens_on(child.id(), port) {
                return Ok((child, port));
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, format!("{name} did not listen on port {port} within {timeout:?}")));
            }
            thread::sleep(Duration::from_millis(WAIT_POLL_INTERVAL_MS));
        }
    }
    Err(io::Error::new(io::ErrorKind::AddrInUse, why))
}

/// Whether process `pid` holds a socket listening on TCP `port` (IPv4 or IPv6), from
/// `/proc/net/tcp{,6}` and the process's descriptors.
pub fn process_listens_on(pid: u32, port: u16) -> bool {
    // A line: `sl local_address rem_address st … uid timeout inode …`; LISTEN is state 0A.
    let listening: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| {
            text.lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let local_port = u16::from_str_radix(fields.get(1)?.rsplit(':').next()?, 16).ok()?;
                    (local_port == port && *fields.get(3)? == "0A").then(|| format!("socket:[{}]", fields.get(9).copied().unwrap_or_default()))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    if listening.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().filter_map(|fd| std::fs::read_link(fd.path()).ok()).any(|link| listening.iter().any(|s| link.as_os_str() == s.as_str()))
}

/// Waits until something accepts TCP connections on `addr`, for at most `timeout`.
///
/// A connection to a local port nobody listens on can succeed by connecting to itself (TCP
/// simultaneous open, when the kernel picks that very port as the ephemeral source port; the
/// ports [`free_tcp_port`] hands out come from the same range): such a connection is not
/// counted, or a test would go on before its server listens.
pub fn wait_for_tcp(addr: impl ToSocketAddrs, timeout: Duration) -> io::Result<()> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    let Some(&first) = addrs.first() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "address resolves to nothing",
        ));
    };
    let deadline = Instant::now() + timeout;
    loop {
        for a in &addrs {
            if let Ok(stream) = TcpStream::connect_timeout(a, Duration::from_millis(CONNECT_TIMEOUT_MS))
                && !is_self_connected(&stream)
            {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("nothing accepted connections on {first} within {timeout:?}"),
            ));
        }
        thread::sleep(Duration::from_millis(WAIT_POLL_INTERVAL_MS));
    }
}

/// Whether `stream` is connected to itself (see [`wait_for_tcp`]).
pub fn is_self_connected(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(local), Ok(peer)) if local == peer)
}

/// The full path of the executable `name`, looked up in `PATH` and then in the sbin
/// directories (mkfs.*, e2fsck, losetup live there and a user's `PATH` may lack them);
/// `Err(reason)` for a test to [`skip`](crate::skip) with when it is not installed.
pub fn require_cmd(name: &str) -> Result<PathBuf, String> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let extra = ["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from);
    std::env::split_paths(&path_var)
        .chain(extra)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| {
            format!("`{name}` is not installed (./scripts/test.sh installs the test tools)")
        })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A child process that is killed (SIGKILL) and reaped when the guard is dropped, so a failing
/// test does not leave servers running.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    name: String,
}

impl ChildGuard {
    /// Spawns `command`. `name` is used in messages.
    pub fn spawn(name: &str, command: &mut Command) -> io::Result<Self> {
        let child = command
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start {name}: {e}")))?;
        Ok(Self {
            child: Some(child),
            name: name.to_owned(),
        })
    }

    /// Takes ownership of an already started child.
    pub fn from_child(name: &str, child: Child) -> Self {
        Self {
            child: Some(child),
            name: name.to_owned(),
        }
    }

    pub fn id(&self) -> u32 {
        self.child().id()
    }

    pub fn child(&self) -> &Child {
        self.child
            .as_ref()
            .expect("ChildGuard holds its child until dropped")
    }

    pub fn child_mut(&mut self) -> &mut Child {
        self.child
            .as_mut()
            .expect("ChildGuard holds its child until dropped")
    }

    /// `Some(status)` if the child has exited (it is then reaped).
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child_mut().try_wait()
    }

    /// Sends SIGTERM and waits up to `grace` for the child to exit, then SIGKILLs it. Returns
    /// its exit status.
    pub fn terminate(mut self, grace: Duration) -> io::Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .expect("ChildGuard holds its child until dropped");
        if child.try_wait()?.is_none() {
            let pid = libc::pid_t::try_from(child.id()).expect("Linux pids fit in pid_t");
            // SAFETY: kill(2) takes plain integers and touches no memory of ours; `pid` is our
            // own child, not yet reaped (try_wait just said so), so it cannot name another process.
            let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            let deadline = Instant::now() + grace;
            while child.try_wait()?.is_none() {
                if Instant::now() >= deadline {
                    child.kill()?;
                    break;
                }
                thread::sleep(Duration::from_millis(WAIT_POLL_INTERVAL_MS));
            }
        }
        child.wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if matches!(child.try_wait(), Ok(None)) {
                let pid = child.id();
                child.kill().unwrap_or_else(|e| {
                    eprintln!("ChildGuard: cannot kill {} (pid {pid}): {e}", self.name)
                });
            }
            // Reap it; an error here means it is already gone.
            let _ = child.wait();
        }
    }
}

/// A statistic of a memcached-protocol server at `127.0.0.1:<port>` (kura's or memcached's
/// `stats`), on a connection of its own. Panics if the server does not answer or has no such
/// statistic: a test that asks needs it.
pub fn memcache_stat(port: u16, name: &str) -> u64 {
    use std::io::{BufRead, BufReader, Write};
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect for stats");
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("set a read timeout");
    stream.write_all(b"stats\r\n").expect("send stats");
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        assert_ne!(reader.read_line(&mut line).expect("read stats"), 0, "stats ended without {name}");
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() == 3 && words[1] == name {
            return words[2].parse().unwrap_or_else(|_| panic!("{name} is not a number: {line:?}"));
        }
        assert_ne!(line, "END\r\n", "no {name} in stats");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests here that open TCP sockets: a port `free_tcp_port` hands out can be
    /// taken by another test's ephemeral source port before it is bound, so they run one at
    /// a time.
    static SOCKET_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn socket_test() -> std::sync::MutexGuard<'static, ()> {
        SOCKET_TESTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn free_port_can_be_bound_and_waited_for() {
        let _serial = socket_test();
        let port = free_tcp_port().unwrap();
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        wait_for_tcp(("127.0.0.1", port), Duration::from_secs(5)).unwrap();
        drop(listener);
    }

    /// The listener is found as this process's, and only while it listens, and not as
    /// another process's.
    #[test]
    fn a_listener_is_told_by_its_process() {
        let _serial = socket_test();
        let port = free_tcp_port().unwrap();
        assert!(!process_listens_on(std::process::id(), port));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        assert!(process_listens_on(std::process::id(), port));
        let mut other = ChildGuard::spawn("sleep", Command::new("sleep").arg("5")).unwrap();
        assert!(!process_listens_on(other.id(), port));
        other.child_mut().kill().unwrap();
        drop(listener);
        assert!(!process_listens_on(std::process::id(), port));
    }

    /// A server that never listens on its port is a timeout; one that does is returned.
    #[test]
    fn spawn_listening_waits_for_the_server_itself() {
        let _serial = socket_test();
        let err = spawn_listening("sleep", Duration::from_millis(200), |_| {
            let mut cmd = Command::new("sleep");
            cmd.arg("5");
            cmd
        })
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let script = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(5)";
        let (mut child, port) = spawn_listening("python3", Duration::from_secs(10), |port| {
            let mut cmd = Command::new("python3");
            cmd.args(["-c", script, &port.to_string()]);
            cmd
        })
        .unwrap();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        child.child_mut().kill().unwrap();
    }

    #[test]
    fn wait_for_tcp_times_out_on_a_closed_port() {
        let _serial = socket_test();
        let port = free_tcp_port().unwrap();
        let err = wait_for_tcp(("127.0.0.1", port), Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    /// A socket bound to a port and connected to that same port connects to itself; such a
    /// connection must not pass for a listening server.
    #[test]
    fn a_self_connection_is_told_apart() {
        use std::os::fd::FromRawFd;
        let _serial = socket_test();
        // SAFETY: plain socket calls on a descriptor this test owns; `addr` is a properly
        // initialised sockaddr_in whose size is passed with it; the descriptor is handed to
        // `TcpStream`, which closes it.
        let stream = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            addr.sin_family = libc::AF_INET as libc::sa_family_t;
            addr.sin_addr.s_addr = u32::from(Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&raw const addr).cast(), len), 0);
            let mut bound: libc::sockaddr_in = std::mem::zeroed();
            let mut bound_len = len;
            assert_eq!(libc::getsockname(fd, (&raw mut bound).cast(), &mut bound_len), 0);
            assert_eq!(libc::connect(fd, (&raw const bound).cast(), len), 0, "{}", io::Error::last_os_error());
            TcpStream::from_raw_fd(fd)
        };
        assert!(is_self_connected(&stream));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let real = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!is_self_connected(&real));
    }

    #[test]
    fn require_cmd_finds_sh_and_rejects_nonsense() {
        assert!(require_cmd("sh").unwrap().is_absolute());
        let reason = require_cmd("kura-no-such-command").unwrap_err();
        assert!(reason.contains("kura-no-such-command"), "{reason}");
    }

    #[test]
    fn child_guard_kills_on_drop() {
        let guard = ChildGuard::spawn("sleep", Command::new("sleep").arg("1000")).unwrap();
        let pid = guard.id();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        drop(guard);
        // Reaped by the guard, so the pid is gone (or reused by an unrelated process, which
        // would not be our `sleep`).
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        assert_ne!(comm.trim(), "sleep");
    }

    #[test]
    fn child_guard_terminate_sends_sigterm() {
        use std::os::unix::process::ExitStatusExt as _;
        let guard = ChildGuard::spawn("sleep", Command::new("sleep").arg("1000")).unwrap();
        let status = guard.terminate(Duration::from_secs(5)).unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn spawn_error_names_the_program() {
        let err = ChildGuard::spawn("ghost", &mut Command::new("/nonexistent/ghost")).unwrap_err();
        assert!(err.to_string().contains("ghost"), "{err}");
    }
}
