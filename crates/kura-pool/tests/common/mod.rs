//! Real servers for the pool's tests: kura servers (the workspace's `kura-server` binary),
//! stock memcached, redis-server, a Redis Cluster, and small misbehaving TCP servers.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_testkit::{ChildGuard, build_workspace_packages, free_tcp_port, require_cmd, spawn_listening, wait_for_tcp};

pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The `kura-server` binary next to this test's executable (`target/<profile>/`), built or
/// brought up to date with the same profile and target directory (`cargo test -p kura-pool`
/// alone does not build other packages' binaries).
pub fn kura_server_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_workspace_packages(&["kura-server"]).join("kura-server"))
}

fn quiet(cmd: &mut Command) -> &mut Command {
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    if std::env::var_os("KURA_TEST_SERVER_LOGS").is_none() {
        cmd.stderr(Stdio::null());
    }
    cmd
}

/// A `kura-server` on its own port and store; restarts keep both.
pub struct KuraNode {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<ChildGuard>,
    args: Vec<String>,
}

impl KuraNode {
    /// Starts a server with a small store; `extra` are more `kura serve` flags.
    pub fn start(extra: &[&str]) -> Self {
        let mut node = Self { port: free_tcp_port().expect("port"), dir: tempfile::tempdir().expect("tempdir"), child: None, args: extra.iter().map(|s| s.to_string()).collect() };
        node.launch();
        node
    }

    fn launch(&mut self) {
        let mut cmd = Command::new(kura_server_bin());
        cmd.args(["-l", "127.0.0.1", "-p", &self.port.to_string(), "--size", "64M", "-I", "64k", "-t", "1", "-m", "8", "--path"])
            .arg(self.dir.path().join("store.kura"))
            .args(&self.args)
            .env("RUST_LOG", "warn");
        self.child = Some(ChildGuard::spawn("kura-server", quiet(&mut cmd)).expect("start kura-server"));
        wait_for_tcp(("127.0.0.1", self.port), START_TIMEOUT).expect("kura-server listening");
    }

    pub fn url(&self) -> String {
        format!("kura://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILL: nothing is synced that was not already.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.child_mut().kill().expect("kill");
        child.child_mut().wait().expect("reap");
    }

    /// SIGTERM and wait (the server syncs).
    pub fn stop(&mut self) {
        self.child.take().expect("running").terminate(Duration::from_secs(20)).expect("terminate");
    }

    /// Starts again on the same port and store.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill first");
        self.launch();
    }

    /// `kill -STOP` (the process keeps running, answering nothing) or `kill -CONT`.
    pub fn signal(&self, signal: &str) {
        send_signal(self.child.as_ref().expect("running").id(), signal);
    }
}

/// `kill -<signal> <pid>`; after `STOP`, waits until every thread of the process has stopped.
/// The stop is delivered asynchronously: a thread running on the other core could still
/// answer a request sent right after `kill` returned (CI saw a get answered that should have
/// timed out).
pub fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
    if signal != "STOP" {
        return;
    }
    let stopped = |stat: &str| stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with(['T', 't']));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let tasks: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|dir| dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok()).collect())
            .unwrap_or_default();
        if !tasks.is_empty() && tasks.iter().all(|t| stopped(t)) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "process {pid} not stopped 5 s after kill -STOP");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Stock memcached, all in RAM.
pub struct Memcached {
    pub port: u16,
    child: Option<ChildGuard>,
    bin: PathBuf,
}

impl Memcached {
    pub fn start() -> Result<Self, String> {
        Self::start_with(&[])
    }

    /// With more memcached flags (not kept for [`Memcached::restart`]).
    pub fn start_with(extra: &[&str]) -> Result<Self, String> {
        let bin = require_cmd("memcached")?;
        let (child, port) = spawn_listening("memcached", START_TIMEOUT, |port| {
            let mut cmd = Self::command(&bin, port);
            cmd.args(extra);
            cmd
        })
        .map_err(|e| e.to_string())?;
        Ok(Self { port, child: Some(child), bin })
    }

    fn command(bin: &Path, port: u16) -> Command {
        let mut cmd = Command::new(bin);
        cmd.args(["-u", "root", "-U", "0", "-l", "127.0.0.1", "-p", &port.to_string(), "-m", "64", "-t", "1"]);
        quiet(&mut cmd);
        cmd
    }

    pub fn url(&self) -> String {
        format!("memcached://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, and a new process on the same port (empty: memcached keeps nothing).
    pub fn restart(&mut self) {
        let mut child = self.child.take().expect("running");
        child.child_mut().kill().expect("kill");
        child.child_mut().wait().expect("reap");
        self.child = Some(ChildGuard::spawn("memcached", &mut Self::command(&self.bin, self.port)).expect("start memcached"));
        wait_for_tcp(("127.0.0.1", self.port), START_TIMEOUT).expect("memcached listening");
    }

    /// `kill -STOP` or `kill -CONT`.
    pub fn signal(&self, signal: &str) {
        send_signal(self.child.as_ref().expect("running").id(), signal);
    }
}

/// A redis-server (no persistence unless `extra` asks).
pub struct Redis {
    pub port: u16,
    pub child: Option<ChildGuard>,
    dir: tempfile::TempDir,
    bin: PathBuf,
    extra: Vec<String>,
}

impl Redis {
    pub fn start(extra: &[&str]) -> Result<Self, String> {
        let bin = require_cmd("redis-server")?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let (child, port) = spawn_listening("redis-server", START_TIMEOUT, |port| Self::command(&bin, port, dir.path(), &extra)).map_err(|e| e.to_string())?;
        Ok(Self { port, child: Some(child), dir, bin, extra })
    }

    fn command(bin: &Path, port: u16, dir: &Path, extra: &[String]) -> Command {
        let mut cmd = Command::new(bin);
        // Replicas sync at once (Redis 7 waits 5 s for more replicas before a diskless sync).
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--repl-diskless-sync-delay", "0", "--dir"])
            .arg(dir)
            .args(extra);
        quiet(&mut cmd);
        cmd
    }

    /// SIGKILL, and a new process on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Some(ChildGuard::spawn("redis-server", &mut Self::command(&self.bin, self.port, self.dir.path(), &self.extra)).expect("start redis-server"));
        wait_for_tcp(("127.0.0.1", self.port), START_TIMEOUT).expect("redis-server listening");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.child_mut().kill().expect("kill");
            child.child_mut().wait().expect("reap");
        }
    }
}

/// `redis-cli -p <port> <args…>`, its output.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Six redis-servers made into a cluster of three masters with a replica each.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    pub fn start() -> Result<Self, String> {
        require_cmd("redis-cli")?;
        let mut nodes = Vec::new();
        for _ in 0..6 {
            nodes.push(Redis::start(&["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf"])?);
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("redis-cli --cluster create failed: {}", String::from_utf8_lossy(&out.stdout)));
        }
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(30))?;
        cluster.wait_replicas_online(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Waits until every live node reports `cluster_state:ok` and knows 3 masters with slots.
    pub fn wait_ok(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = redis_cli(n.port, &["cluster", "info"]);
                info.contains("cluster_state:ok") && info.contains("cluster_size:3")
            });
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("the cluster did not become ok".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every live master has a replica in sync (`state=online`).
    pub fn wait_replicas_online(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let masters = self.master_ports();
            if masters.len() == 3 && masters.iter().all(|&p| redis_cli(p, &["info", "replication"]).contains("state=online")) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("replicas did not come online".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn seed_url(&self) -> String {
        format!("redis+cluster://127.0.0.1:{},127.0.0.1:{}", self.nodes[0].port, self.nodes[1].port)
    }

    /// Ports of the nodes that are masters now (as seen by a live node).
    pub fn master_ports(&self) -> Vec<u16> {
        let live = self.nodes.iter().find(|n| n.child.is_some()).expect("a live node");
        redis_cli(live.port, &["cluster", "nodes"])
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| l.split(' ').nth(1)?.split('@').next()?.rsplit(':').next()?.parse().ok())
            .collect()
    }

    pub fn node_mut(&mut self, port: u16) -> &mut Redis {
        self.nodes.iter_mut().find(|n| n.port == port).expect("a node on that port")
    }
}

/// What a [`FakeServer`] does after answering the memcached handshake.
#[derive(Clone, Copy)]
pub enum Misbehaviour {
    /// Answers every read with bytes that are not the protocol.
    Garbage,
    /// Reads and never answers.
    Silent,
    /// Answers the handshake with garbage.
    GarbageHandshake,
    /// Answers this many requests (lines) `HD`, then closes its side of the connection.
    HangUpAfter(usize),
}

/// A tiny TCP server for error handling tests (it stands in for no backend: it only
/// misbehaves). Stops when dropped.
pub struct FakeServer {
    pub port: u16,
    stop: Arc<AtomicBool>,
}

impl FakeServer {
    pub fn start(behaviour: Misbehaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stopped.load(Ordering::Relaxed) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let stopped = Arc::clone(&stopped);
                        std::thread::spawn(move || serve_fake(stream, behaviour, &stopped));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { port, stop }
    }

    pub fn url(&self) -> String {
        format!("memcached://127.0.0.1:{}", self.port)
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve_fake(mut stream: std::net::TcpStream, behaviour: Misbehaviour, stop: &AtomicBool) {
    stream.set_read_timeout(Some(Duration::from_millis(50))).ok();
    let mut buf = [0u8; 65536];
    let mut handshaken = false;
    let mut lines_seen = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if let (Misbehaviour::HangUpAfter(answers), true) = (behaviour, handshaken) {
                    let lines = buf[..n].iter().filter(|&&b| b == b'\n').count();
                    let answered = lines.min(answers.saturating_sub(lines_seen));
                    lines_seen += lines;
                    if stream.write_all(&b"HD\r\n".repeat(answered)).is_err() {
                        return;
                    }
                    if answered > 0 && lines_seen >= answers {
                        // FIN, not RST: the replies sent reach the client before the close,
                        // and what it sent after them is read and dropped until it closes.
                        let _ = stream.shutdown(std::net::Shutdown::Write);
                    }
                    continue;
                }
                let reply: &[u8] = match (behaviour, handshaken) {
                    (Misbehaviour::GarbageHandshake, _) => b"HTTP/1.1 400 Bad Request\r\n\r\n",
                    // `stats` refused: the instance stays unknown.
                    (_, false) => b"VERSION 1.6.18\r\nMN\r\nERROR\r\n",
                    (Misbehaviour::Garbage, true) => b"\x00\x01 WHAT IS THIS \xff\r\n",
                    (Misbehaviour::Silent | Misbehaviour::HangUpAfter(_), true) => b"",
                };
                handshaken = true;
                if stream.write_all(reply).is_err() {
                    return;
                }
            }
            Err(_) => {}
        }
    }
}

/// A pool over `url` whose requests and connects time out after 300 ms.
pub fn impatient_pool(url: &str) -> kura_pool::Pool {
    let mut config = kura_pool::PoolConfig::from_urls(&[url]).unwrap();
    config.request_timeout = Duration::from_millis(300);
    config.connect_timeout = Duration::from_millis(300);
    kura_pool::Pool::open(config).unwrap()
}

/// A get that times out while the server is stopped (`signal("STOP")`, then `"CONT"`): its
/// connection closes, and the same server process goes on.
pub fn time_out_a_get(ctx: &mut kura_pool::Context, signal: impl Fn(&str)) {
    let disconnects = ctx.io_stats().disconnects;
    signal("STOP");
    let e = ctx.get(b"k").unwrap_err();
    signal("CONT");
    assert!(matches!(e, kura_pool::Error::Timeout { .. }), "{e}");
    assert_eq!(ctx.io_stats().disconnects, disconnects + 1);
}

/// `result` (a flush) is `WritesMayBeLost` naming `node`.
pub fn assert_writes_may_be_lost(result: kura_pool::Result<()>, node: &str) {
    match result {
        Err(kura_pool::Error::WritesMayBeLost { node: named }) => assert_eq!(named, node),
        other => panic!("expected WritesMayBeLost naming {node}, got {other:?}"),
    }
}

/// Distinct 4 KiB values, checkable.
pub fn value_of(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    v
}

/// The same scenario through the one interface, whatever the backend: pipelined sets and
/// gets with many in flight, multi-get, overwrite, delete, misses, a flush; binary keys when
/// the backend can carry them. Returns the context's I/O counters.
pub fn exercise(pool: &kura_pool::Pool, binary_keys: bool) -> kura_pool::IoStats {
    use kura_pool::{Outcome, block_key};
    const KEYS: u64 = 300;
    const DEPTH: usize = 32;
    let mut ctx = pool.context().expect("context");
    // Sets, DEPTH in flight.
    let mut next = 0u64;
    let mut done = 0u64;
    while done < KEYS {
        while next < KEYS && ctx.in_flight() < DEPTH {
            ctx.submit_set(&block_key(1, next), &value_of(next), next).expect("submit set");
            next += 1;
        }
        ctx.poll(None, &mut |c| {
            c.result.unwrap_or_else(|e| panic!("set {}: {e}", c.token));
            done += 1;
        })
        .expect("poll");
    }
    ctx.flush().expect("flush");
    // Gets, DEPTH in flight, values checked in the callback (borrowed from the buffer).
    let (mut next, mut done) = (0u64, 0u64);
    while done < KEYS {
        while next < KEYS && ctx.in_flight() < DEPTH {
            ctx.submit_get(&block_key(1, next), next).expect("submit get");
            next += 1;
        }
        ctx.poll(None, &mut |c| match c.result {
            Ok(Outcome::Value(v)) => {
                assert!(v == value_of(c.token).as_slice(), "wrong value for {}", c.token);
                done += 1;
            }
            other => panic!("get {}: {other:?}", c.token),
        })
        .expect("poll");
    }
    // Multi-get with a miss in the middle, overwrite, delete.
    let keys = [block_key(1, 3), block_key(9, 9), block_key(1, 5)];
    let got = ctx.get_many(&keys).expect("get_many");
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(value_of(3).as_slice()));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert_eq!(got[2].as_ref().unwrap().as_deref(), Some(value_of(5).as_slice()));
    ctx.set(&block_key(1, 3), b"short").expect("overwrite");
    assert_eq!(ctx.get(&block_key(1, 3)).unwrap().as_deref(), Some(&b"short"[..]));
    ctx.set(&block_key(1, 4), b"").expect("empty value");
    assert_eq!(ctx.get(&block_key(1, 4)).unwrap().as_deref(), Some(&b""[..]));
    ctx.delete(&block_key(1, 5)).expect("delete");
    ctx.delete(&block_key(1, 5)).expect("delete again");
    assert_eq!(ctx.get(&block_key(1, 5)).unwrap(), None);
    if binary_keys {
        let key = b"bin\x00key with spaces\r\n\xff";
        ctx.set(key, b"binary").expect("binary key");
        assert_eq!(ctx.get(key).unwrap().as_deref(), Some(&b"binary"[..]));
        let value: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        ctx.set(b"v", &value).expect("binary value");
        assert_eq!(ctx.get(b"v").unwrap().as_deref(), Some(value.as_slice()));
    }
    // Input errors are refused at submit, nothing in flight.
    assert!(matches!(ctx.submit_get(b"", 0), Err(kura_pool::Error::KeyEmpty)));
    assert!(matches!(ctx.submit_get(&[b'k'; 251], 0), Err(kura_pool::Error::KeyTooLong { .. })));
    let big = vec![0u8; pool.config().value_size_max_bytes + 1];
    assert!(matches!(ctx.submit_set(b"k", &big, 0), Err(kura_pool::Error::ValueTooLarge { .. })));
    assert_eq!(ctx.in_flight(), 0);
    ctx.flush().expect("flush");
    ctx.io_stats()
}
