//! Real processes for the block tests: the `kura` binary (volumes, `kura block …`, `kura
//! serve`), stock memcached and redis-server on free ports, and a few client helpers.

#![allow(dead_code)]

pub mod raw_client;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kura_testkit::{ChildGuard, build_workspace_packages, free_tcp_port, require_cmd, wait_for_tcp};

pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The `kura` binary of this build (`target/<profile>/kura`), built or brought up to date with
/// the same profile and target directory (`cargo test -p kura-block` alone does not build it).
pub fn kura_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_workspace_packages(&["kura"]).join("kura"))
}

fn quiet(cmd: &mut Command) -> &mut Command {
    cmd.stdin(Stdio::null());
    if std::env::var_os("KURA_TEST_SERVER_LOGS").is_none() {
        cmd.stderr(Stdio::null());
    }
    cmd
}

/// Runs `kura ARGS` to completion; panics with its output unless it succeeds.
pub fn kura(args: &[&str]) -> String {
    let out = Command::new(kura_bin()).args(args).env("RUST_LOG", "warn").stdin(Stdio::null()).output().expect("run kura");
    assert!(out.status.success(), "kura {args:?} failed ({}):\n{}\n{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command to completion; `Err` with its output if it fails.
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let path = require_cmd(program).unwrap_or_else(|_| PathBuf::from(program));
    let out = Command::new(&path).args(args).stdin(Stdio::null()).output().map_err(|e| format!("{program}: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(text) } else { Err(format!("{program} {args:?} failed ({}):\n{text}", out.status)) }
}

/// A pool backend the tests run on.
pub enum Backend {
    Embedded { dir: tempfile::TempDir },
    Kura(KuraServer),
    Memcached { port: u16, _child: ChildGuard },
    Redis { port: u16, _child: ChildGuard, _dir: tempfile::TempDir },
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Embedded { .. } => "embedded",
            Backend::Kura(_) => "kura",
            Backend::Memcached { .. } => "memcached",
            Backend::Redis { .. } => "redis",
        }
    }

    pub fn embedded() -> Self {
        Backend::Embedded { dir: tempfile::tempdir_in(scratch_dir()).expect("tempdir") }
    }

    pub fn kura() -> Self {
        Backend::Kura(KuraServer::start())
    }

    pub fn memcached() -> Result<Self, String> {
        let bin = require_cmd("memcached")?;
        let (child, port) = kura_testkit::spawn_listening("memcached", START_TIMEOUT, |port| {
            let mut cmd = Command::new(&bin);
            cmd.args(["-u", "root", "-U", "0", "-l", "127.0.0.1", "-p", &port.to_string(), "-m", "512", "-t", "2"]);
            quiet(&mut cmd).stdout(Stdio::null());
            cmd
        })
        .map_err(|e| e.to_string())?;
        Ok(Backend::Memcached { port, _child: child })
    }

    pub fn redis() -> Result<Self, String> {
        let bin = require_cmd("redis-server")?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let (child, port) = kura_testkit::spawn_listening("redis-server", START_TIMEOUT, |port| {
            let mut cmd = Command::new(&bin);
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir"]).arg(dir.path());
            quiet(&mut cmd).stdout(Stdio::null());
            cmd
        })
        .map_err(|e| e.to_string())?;
        Ok(Backend::Redis { port, _child: child, _dir: dir })
    }

    /// Every backend whose server is installed (embedded and kura always are).
    pub fn all() -> Vec<Backend> {
        let mut all = vec![Backend::embedded(), Backend::kura()];
        for extra in [Backend::memcached(), Backend::redis()] {
            match extra {
                Ok(b) => all.push(b),
                Err(reason) => kura_testkit::skip(&reason),
            }
        }
        all
    }

    /// The `--pool` URL.
    pub fn url(&self) -> String {
        match self {
            Backend::Embedded { dir } => format!("embedded:{}?size=1G", dir.path().join("pool.kura").display()),
            Backend::Kura(s) => format!("kura://127.0.0.1:{}", s.port),
            Backend::Memcached { port, .. } => format!("memcached://127.0.0.1:{port}"),
            Backend::Redis { port, .. } => format!("redis://127.0.0.1:{port}"),
        }
    }

    pub fn create_volume(&self, name: &str, size: &str) {
        kura(&["volume", "create", name, "--size", size, "--pool", &self.url()]);
    }
}

/// A directory on a disk-backed file system (O_DIRECT works there; tmpfs refuses it).
pub fn scratch_dir() -> PathBuf {
    let dir = PathBuf::from("/var/tmp/kura-block-tests");
    std::fs::create_dir_all(&dir).expect("create /var/tmp/kura-block-tests");
    dir
}

/// `kura serve` in store mode on its own port and store; restarts keep both.
pub struct KuraServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<ChildGuard>,
}

impl KuraServer {
    pub fn start() -> Self {
        let mut s = Self { port: free_tcp_port().expect("port"), dir: tempfile::tempdir_in(scratch_dir()).expect("tempdir"), child: None };
        s.launch();
        s
    }

    fn launch(&mut self) {
        let mut cmd = Command::new(kura_bin());
        cmd.args(["serve", "-l", "127.0.0.1", "-p", &self.port.to_string(), "--size", "1G", "--mode", "store", "-t", "2", "-m", "16", "--path"])
            .arg(self.dir.path().join("store.kura"))
            .env("RUST_LOG", "warn");
        self.child = Some(ChildGuard::spawn("kura serve", quiet(&mut cmd).stdout(Stdio::null())).expect("start kura serve"));
        wait_for_tcp(("127.0.0.1", self.port), START_TIMEOUT).expect("kura serve listening");
    }

    /// SIGKILL: nothing is synced that was not already.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.child_mut().kill().expect("kill");
        child.child_mut().wait().expect("reap");
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "kill first");
        self.launch();
    }
}

/// `kura block nbd` on a free port, serving the volumes of `pool_url`.
pub struct NbdProcess {
    pub addr: String,
    child: Option<ChildGuard>,
    pool_url: String,
    extra: Vec<String>,
}

impl NbdProcess {
    pub fn start(pool_url: &str, extra: &[&str]) -> Self {
        let mut p = Self { addr: String::new(), child: None, pool_url: pool_url.to_owned(), extra: extra.iter().map(|s| s.to_string()).collect() };
        p.launch("127.0.0.1:0");
        p
    }

    fn launch(&mut self, listen: &str) {
        let mut cmd = Command::new(kura_bin());
        cmd.args(["block", "nbd", "--listen", listen, "--print-address", "--pool", &self.pool_url]).args(&self.extra).env("RUST_LOG", "warn").stdout(Stdio::piped());
        let mut child = ChildGuard::spawn("kura block nbd", quiet(&mut cmd)).expect("start kura block nbd");
        let stdout = child.child_mut().stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read the address");
        assert!(!line.trim().is_empty(), "kura block nbd printed no address (did it fail to start?)");
        self.addr = line.trim().to_owned();
        self.child = Some(child);
    }

    pub fn uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn port(&self) -> u16 {
        self.addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.child_mut().kill().expect("kill");
        child.child_mut().wait().expect("reap");
    }

    /// SIGTERM and wait: the server finishes its requests and flushes.
    pub fn stop(&mut self) {
        let status = self.child.take().expect("running").terminate(Duration::from_secs(30)).expect("terminate");
        assert!(status.success(), "kura block nbd exited with {status}");
    }

    /// Starts again on the same port.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "kill or stop first");
        let listen = self.addr.clone();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            // The old socket may linger a moment after a kill.
            let mut cmd_ok = true;
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.launch(&listen)));
            if result.is_err() {
                cmd_ok = false;
            }
            if cmd_ok || Instant::now() > deadline {
                assert!(cmd_ok, "kura block nbd did not restart on {listen}");
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
