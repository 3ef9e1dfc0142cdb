//! The server as a service manager runs memcached, with memcached's options: a Unix socket
//! (`-s`, `-a`), in the background (`-d`) with a pid file (`-P`), as an unprivileged user
//! (`-u`), stopped by a client's `shutdown` (`-A`). Debian's `/etc/memcached.conf` says
//! `-d -m 64 -p 11211 -u memcache -l 127.0.0.1 -P /var/run/memcached/memcached.pid`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Client, SERVER_BIN, SMALL, eventually};
use kura_testkit::ChildGuard;

const START_TIMEOUT: Duration = Duration::from_secs(20);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

fn server(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(SERVER_BIN);
    cmd.args(SMALL).arg("--path").arg(dir.join("store.kura")).args(args);
    cmd.env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()));
    cmd.stdin(Stdio::null());
    cmd
}

/// A line-at-a-time client on a Unix socket.
struct UnixClient {
    reader: BufReader<UnixStream>,
}

impl UnixClient {
    fn connect(path: &Path) -> std::io::Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(common::READ_TIMEOUT))?;
        Ok(Self { reader: BufReader::new(stream) })
    }

    fn send(&mut self, bytes: &[u8]) {
        self.reader.get_mut().write_all(bytes).unwrap();
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line
    }

    fn until_end(&mut self, request: &[u8]) -> Vec<String> {
        self.send(request);
        let mut lines = Vec::new();
        loop {
            let line = self.line();
            assert!(!line.is_empty(), "closed before END: {lines:?}");
            if line == "END\r\n" {
                return lines;
            }
            lines.push(line);
        }
    }
}

/// Waits until a client can connect to the socket at `path`.
fn wait_for_socket(path: &Path, child: &mut ChildGuard) -> UnixClient {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(client) = UnixClient::connect(path) {
            return client;
        }
        assert!(child.try_wait().unwrap().is_none(), "the server exited before it listened on {}", path.display());
        assert!(Instant::now() < deadline, "no socket at {} after {START_TIMEOUT:?}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_unix_socket_serves_with_its_permissions_and_no_tcp() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("memcached.sock");
    let port = kura_testkit::free_tcp_port().unwrap();
    let port_arg = port.to_string();
    let args = ["-s", socket.to_str().unwrap(), "-a", "770", "-p", &port_arg];
    let mut child = ChildGuard::spawn("kura-server -s", &mut server(tmp.path(), &args)).unwrap();
    let mut client = wait_for_socket(&socket, &mut child);

    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o770);
    // memcached: -s turns the network off, -p notwithstanding.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "listens on TCP port {port} too");

    client.send(b"set k 5 0 5\r\nhello\r\n");
    assert_eq!(client.line(), "STORED\r\n");
    assert_eq!(client.until_end(b"get k\r\n"), ["VALUE k 5 5\r\n", "hello\r\n"]);
    let conns = client.until_end(b"stats conns\r\n");
    let listener = format!("addr unix:{}\r\n", socket.display());
    assert!(conns.iter().any(|l| l.ends_with(&listener)), "{conns:?}");
    assert!(conns.iter().any(|l| l.ends_with(":addr unix:\r\n")), "{conns:?}");
    assert!(conns.iter().any(|l| l.ends_with(&format!("listen_addr unix:{}\r\n", socket.display()))), "{conns:?}");
    drop(client);

    // A clean stop removes the socket; a killed server leaves it, and the next one replaces it.
    assert!(child.terminate(STOP_TIMEOUT).unwrap().success());
    assert!(!socket.exists(), "the socket file outlived the server");
    let mut child = ChildGuard::spawn("kura-server -s", &mut server(tmp.path(), &args)).unwrap();
    wait_for_socket(&socket, &mut child);
    child.child_mut().kill().unwrap();
    child.child_mut().wait().unwrap();
    assert!(socket.exists());
    let mut child = ChildGuard::spawn("kura-server -s", &mut server(tmp.path(), &args)).unwrap();
    let mut client = wait_for_socket(&socket, &mut child);
    assert_eq!(client.until_end(b"get k\r\n"), ["VALUE k 5 5\r\n", "hello\r\n"]);
    drop(client);
    assert!(child.terminate(STOP_TIMEOUT).unwrap().success());
}

#[test]
fn a_unix_socket_path_holding_another_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("not-a-socket");
    std::fs::write(&path, b"keep me").unwrap();
    let out = server(tmp.path(), &["-s", path.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on the Unix socket") && stderr.contains("not a socket"), "{stderr}");
    assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
    // Bad permissions are refused before anything starts.
    let out = server(tmp.path(), &["-s", "x.sock", "-a", "1777"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 777"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = server(tmp.path(), &["-s", "x.sock", "-a", "9"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("not octal"));
}

/// Whether process `pid` has ended (gone, or a zombie nobody reaped yet: the daemon's parent
/// is whatever adopted it).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

fn read_pid(path: &Path) -> u32 {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.ends_with('\n'), "{text:?}");
    text.trim().parse().unwrap()
}

/// Runs `kura-server -d` to its return, its stderr into a file: the daemon keeps stderr when
/// it is not a terminal, so a pipe would stay open as long as the daemon runs.
fn run_to_end(cmd: &mut Command) -> Output {
    let log = tempfile::NamedTempFile::new().unwrap();
    cmd.stdout(Stdio::null()).stderr(log.reopen().unwrap());
    let child = cmd.spawn().unwrap();
    let mut guard = ChildGuard::from_child("kura-server -d", child);
    let deadline = Instant::now() + START_TIMEOUT;
    let status = loop {
        if let Some(status) = guard.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "kura-server -d did not return");
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: Vec::new(), stderr: std::fs::read(log.path()).unwrap() }
}

/// Stops a daemon with SIGTERM and waits for it to end.
struct Daemon(u32);

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill with a pid and a signal number.
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

#[test]
fn a_daemon_returns_once_it_serves_and_keeps_a_pid_file() {
    let tmp = tempfile::tempdir().unwrap();
    let port = kura_testkit::free_tcp_port().unwrap();
    // Relative paths, from the directory it was started in (the daemon runs in /).
    let mut cmd = Command::new(SERVER_BIN);
    cmd.current_dir(tmp.path())
        .args(SMALL)
        .args(["-d", "-P", "run/kura.pid", "--path", "data/store.kura", "-p", &port.to_string()]);
    std::fs::create_dir(tmp.path().join("run")).unwrap();
    let out = run_to_end(&mut cmd);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pidfile = tmp.path().join("run/kura.pid");
    let pid = read_pid(&pidfile);
    let daemon = Daemon(pid);
    assert!(!ended(pid));
    assert!(tmp.path().join("data/store.kura").is_file());
    // Ready when the command returned: no wait for the port.
    let mut client = Client::connect(port);
    client.set("k", b"from the daemon");
    assert_eq!(client.get("k").as_deref(), Some(&b"from the daemon"[..]));
    assert_eq!(client.stat("pid"), u64::from(pid));
    drop(client);
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
    assert_eq!(cwd, PathBuf::from("/"));

    // SAFETY: kill with a pid and a signal number.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    assert!(eventually(STOP_TIMEOUT, || ended(pid)), "the daemon did not stop");
    assert!(!pidfile.exists(), "the pid file outlived the daemon");
    std::mem::forget(daemon);

    // A daemon that cannot start says why, and the command fails: here the port is taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port().to_string();
    let out = run_to_end(server(tmp.path(), &["-d", "-p", &taken_port]).current_dir(tmp.path()));
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot listen on 127.0.0.1:") && stderr.contains("in use"), "{stderr}");
}

#[test]
fn root_runs_as_the_user_it_is_told() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return kura_testkit::skip("-u changes user only when started as root");
    }
    let mut kura = common::Kura::start(&["-u", "nobody", "--sync", "always"]);
    let status = std::fs::read_to_string(format!("/proc/{}/status", kura.pid())).unwrap();
    let ids = |field: &str| status.lines().find(|l| l.starts_with(field)).unwrap().split_whitespace().skip(1).map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(ids("Uid:"), ["65534"; 4]);
    assert_eq!(ids("Gid:"), ["65534"; 4]);
    // Its store still takes writes and syncs them: the files stay root's, opened before the
    // change.
    let mut client = kura.client();
    client.set("k", b"as nobody");
    drop(client);
    assert!(kura.stop().success());
    kura.restart_with(&[]);
    assert_eq!(kura.client().get("k").as_deref(), Some(&b"as nobody"[..]));

    let tmp = tempfile::tempdir().unwrap();
    let out = server(tmp.path(), &["-u", "no-such-user-here", "-p", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-u no-such-user-here: no such user"));
}

#[test]
fn shutdown_stops_the_server_only_when_enabled() {
    let mut kura = common::Kura::start(&[]);
    let mut client = kura.client();
    client.expect("shutdown\r\n", "ERROR: shutdown not enabled\r\n");
    client.expect("shutdown graceful\r\n", "ERROR: shutdown not enabled\r\n");
    client.set("still", b"here");
    drop(client);
    assert!(kura.stop().success());

    kura.restart_with(&["-A", "--sync", "never"]);
    let mut client = kura.client();
    client.expect("shutdown sometime\r\n", "CLIENT_ERROR invalid shutdown mode\r\n");
    // Written but not yet synced: the stop syncs it, as SIGTERM's does.
    client.set("unsynced", b"kept");
    client.send("shutdown graceful\r\n");
    assert_eq!(client.read_to_close().as_deref(), Some(&b""[..]), "no reply, then the close");
    let child = kura.child.as_mut().unwrap();
    assert!(eventually(STOP_TIMEOUT, || child.try_wait().unwrap().is_some()), "the server did not stop");
    assert!(child.try_wait().unwrap().unwrap().success());
    kura.child = None;
    kura.restart_with(&["-A"]);
    let mut client = kura.client();
    assert_eq!(client.get("unsynced").as_deref(), Some(&b"kept"[..]));
    assert_eq!(client.get("still").as_deref(), Some(&b"here"[..]));
    client.send("shutdown\r\n");
    assert_eq!(client.read_to_close().as_deref(), Some(&b""[..]));
    let child = kura.child.as_mut().unwrap();
    assert!(eventually(STOP_TIMEOUT, || child.try_wait().unwrap().is_some()), "the server did not stop");
    kura.child = None;
}


#[test]
fn memcacheds_switches_answer_as_memcached_does() {
    // -F -X -W turn commands off, -b sets the backlog, -o idle_timeout the idle timeout, -M
    // never evicts; the other -o options are memcached's tuning, taken without effect.
    let switches = ["-F", "-X", "-W", "-M", "-b", "16", "-o", "idle_timeout=600,hashpower=20"];
    let kura = common::Kura::start(&switches);
    let memcached = kura_testkit::try_or_skip!(common::Memcached::start(&switches));
    let script = b"flush_all\r\nflush_all 10\r\nflush_all noreply\r\nlru_crawler metadump all\r\nset k 0 0 1\r\nx\r\nwatch\r\n";
    let (ours, theirs) = (common::transcript(kura.port, script), common::transcript(memcached.port, script));
    assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&theirs));
    assert!(ours.starts_with(b"CLIENT_ERROR flush_all not allowed\r\n"), "{}", String::from_utf8_lossy(&ours));
    let (mut ours, mut theirs) = (kura.client(), Client::connect(memcached.port));
    let (ours, theirs) = (ours.settings(), theirs.settings());
    for name in ["flush_enabled", "dump_enabled", "tcp_backlog", "idle_timeout", "evictions", "shutdown_command", "domain_socket", "umask"] {
        assert_eq!(ours.get(name), theirs.get(name), "stats settings {name}");
    }
    assert_eq!(ours["watch_enabled"], "no");
    assert_eq!(ours["tcp_backlog"], "16");
    // The kernel's backlog of the listening socket is -b's.
    let ss = Command::new("ss").args(["-ltnH", &format!("sport = :{}", kura.port)]).output();
    if let Some(ss) = ss.ok().filter(|o| o.status.success()) {
        let line = String::from_utf8_lossy(&ss.stdout);
        assert_eq!(line.split_whitespace().nth(2), Some("16"), "{line}");
    }
    // A flush_all refused is still counted, as memcached counts it.
    assert_eq!(kura.client().stat("cmd_flush"), 3);

    // What memcached refuses, kura refuses, with the reason.
    let tmp = tempfile::tempdir().unwrap();
    for (args, reason) in [
        (&["-o", "no_such_option"][..], "Illegal suboption \"no_such_option\""),
        (&["-o", "idle_timeout=soon"], "idle_timeout takes a number"),
        (&["-M", "--mode", "cache"], "-M (never evict) contradicts --mode cache"),
    ] {
        let out = server(tmp.path(), args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(reason), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}
