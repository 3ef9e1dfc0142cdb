//! Helpers for the wire-level tests: start the real server binary on a free
//! port with its own store, and speak to it over TCP.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kura_testkit::ChildGuard;

pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_kura-server");
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `kura-server` with its store in a temporary directory.
pub struct Kura {
    pub port: u16,
    pub child: Option<ChildGuard>,
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    args: Vec<String>,
}

/// Arguments every test server gets unless it says otherwise: a small store
/// and item limit so stores are quick to create.
pub const SMALL: &[&str] = &["--size", "64M", "-I", "64k", "-t", "2", "-m", "16"];

impl Kura {
    /// Starts a server with `SMALL` plus `extra` (later flags win).
    pub fn start(extra: &[&str]) -> Self {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_path_buf();
        let mut args: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut kura = Self {
            port: 0,
            child: None,
            dir,
            _tmp: Some(tmp),
            args,
        };
        kura.launch();
        kura
    }

    /// The store file.
    pub fn store_path(&self) -> PathBuf {
        self.dir.join("store.kura")
    }

    /// Starts the server on a free port (another one if that port was taken meanwhile, see
    /// `kura_testkit::spawn_listening`).
    fn launch(&mut self) {
        let (child, port) = kura_testkit::spawn_listening("kura-server", START_TIMEOUT, |port| {
            let mut cmd = Command::new(SERVER_BIN);
            cmd.args(["-p", &port.to_string(), "--path"])
                .arg(self.store_path())
                .args(&self.args);
            cmd.env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            );
            cmd.stdin(Stdio::null());
            cmd
        })
        .unwrap_or_else(|e| panic!("kura-server did not start: {e}"));
        self.child = Some(child);
        self.port = port;
    }

    /// SIGTERM, and wait for a clean exit.
    pub fn stop(&mut self) -> ExitStatus {
        let child = self.child.take().expect("server running");
        child.terminate(Duration::from_secs(20)).expect("terminate")
    }

    /// SIGKILL: no chance to sync.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("server running");
        child.child_mut().kill().expect("kill");
        child.child_mut().wait().expect("reap");
    }

    /// Starts the server again on the same store (and a new port).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill first");
        self.launch();
    }

    /// Starts again with different extra arguments.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.args = SMALL.iter().map(|s| s.to_string()).collect();
        self.args.extend(extra.iter().map(|s| s.to_string()));
        self.restart();
    }

    pub fn client(&self) -> Client {
        Client::connect(self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }
}

/// A blocking text-protocol client.
pub struct Client {
    pub reader: BufReader<TcpStream>,
    pub stream: TcpStream,
}

impl Client {
    pub fn connect(port: u16) -> Self {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        }
    }

    pub fn send(&mut self, bytes: impl AsRef<[u8]>) {
        self.stream.write_all(bytes.as_ref()).expect("send");
    }

    /// One reply line, `\r\n` included.
    pub fn line(&mut self) -> String {
        let mut line = Vec::new();
        self.reader
            .read_until(b'\n', &mut line)
            .expect("read reply line");
        String::from_utf8_lossy(&line).into_owned()
    }

    /// Exactly `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        let mut got = 0;
        while got < n {
            match self.reader.read(&mut buf[got..]) {
                Ok(0) => panic!("connection closed after {got} of {n} reply bytes"),
                Ok(k) => got += k,
                Err(e) => panic!(
                    "read reply bytes: {e} after {got} of {n}: ...{:?}",
                    String::from_utf8_lossy(&buf[got.saturating_sub(40)..got])
                ),
            }
        }
        buf
    }

    /// Sends `request` and checks that the reply is exactly `expected`.
    pub fn expect(&mut self, request: impl AsRef<[u8]>, expected: impl AsRef<[u8]>) {
        self.send(request.as_ref());
        let expected = expected.as_ref();
        let got = self.bytes(expected.len());
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(expected),
            "request {:?}",
            String::from_utf8_lossy(request.as_ref())
        );
    }

    /// Sends `request` and checks its one-line reply, which holds a TTL flag
    /// (`t<N>`): a second may tick between store and reply, so `t<N-1>` passes too.
    pub fn expect_ttl_line(&mut self, request: impl AsRef<[u8]>, expected: &str) {
        self.send(request);
        let got = self.line();
        let earlier: String = expected
            .split(' ')
            .map(|t| {
                match t
                    .strip_prefix('t')
                    .and_then(|n| n.trim_end().parse::<u64>().ok())
                {
                    Some(n) if n > 0 => format!(
                        "t{}{}",
                        n - 1,
                        if t.ends_with("\r\n") { "\r\n" } else { "" }
                    ),
                    _ => t.to_owned(),
                }
            })
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            got == expected || got == earlier,
            "got {got:?}, expected {expected:?}"
        );
    }

    /// Sends `request` and returns reply lines up to and including `END\r\n`.
    pub fn until_end(&mut self, request: impl AsRef<[u8]>) -> String {
        self.send(request);
        let mut out = String::new();
        loop {
            let line = self.line();
            assert!(
                !line.is_empty(),
                "connection closed before END; got {out:?}"
            );
            out.push_str(&line);
            if line == "END\r\n" {
                return out;
            }
        }
    }

    pub fn set(&mut self, key: &str, value: &[u8]) {
        self.send(format!("set {key} 0 0 {}\r\n", value.len()));
        self.send(value);
        self.expect("\r\n", "STORED\r\n");
    }

    /// `get` of one key: its value, or `None`.
    pub fn get(&mut self, key: &str) -> Option<Vec<u8>> {
        self.send(format!("get {key}\r\n"));
        let line = self.line();
        if line == "END\r\n" {
            return None;
        }
        let parts: Vec<&str> = line.trim_end().split(' ').collect();
        assert_eq!(parts[0], "VALUE", "unexpected {line:?}");
        let len: usize = parts[3].parse().unwrap();
        let data = self.bytes(len + 2);
        assert_eq!(&data[len..], b"\r\n");
        assert_eq!(self.line(), "END\r\n");
        Some(data[..len].to_vec())
    }

    /// `gets` of one key: (value, cas).
    pub fn gets(&mut self, key: &str) -> Option<(Vec<u8>, u64)> {
        self.send(format!("gets {key}\r\n"));
        let line = self.line();
        if line == "END\r\n" {
            return None;
        }
        let parts: Vec<&str> = line.trim_end().split(' ').collect();
        let len: usize = parts[3].parse().unwrap();
        let cas: u64 = parts[4].parse().unwrap();
        let data = self.bytes(len + 2);
        assert_eq!(self.line(), "END\r\n");
        Some((data[..len].to_vec(), cas))
    }

    /// `stats`, as name → value.
    pub fn stats(&mut self) -> std::collections::HashMap<String, String> {
        let text = self.until_end("stats\r\n");
        text.lines()
            .filter_map(|l| l.strip_prefix("STAT "))
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// `stats settings` as name → value.
    pub fn settings(&mut self) -> std::collections::HashMap<String, String> {
        self.until_end("stats settings\r\n")
            .lines()
            .filter_map(|l| l.strip_prefix("STAT "))
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    pub fn stat(&mut self, name: &str) -> u64 {
        self.stats()
            .get(name)
            .unwrap_or_else(|| panic!("no stat {name}"))
            .parse()
            .unwrap()
    }

    /// Reads until the server closes; returns what came (`None` if it did not close in time).
    pub fn read_to_close(&mut self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        match self.reader.read_to_end(&mut out) {
            Ok(_) => Some(out),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(out),
            Err(_) => None,
        }
    }

    pub fn shutdown_write(&self) {
        self.stream.shutdown(Shutdown::Write).unwrap();
    }
}

/// Sends a whole script on a fresh connection, half-closes, and returns
/// everything the server answered before it closed.
pub fn transcript(port: u16, script: &[u8]) -> Vec<u8> {
    let mut client = Client::connect(port);
    // The server may close mid-script (a line too long, the binary protocol); keep what it said.
    if client.stream.write_all(script).is_ok() {
        let _ = client.stream.shutdown(Shutdown::Write);
    }
    client.read_to_close().expect("server closes after EOF")
}

/// Polls `f` until it is true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// A stock memcached for differential checks, when installed.
pub struct Memcached {
    pub port: u16,
    _child: ChildGuard,
}

impl Memcached {
    pub fn start(extra: &[&str]) -> Result<Self, String> {
        let bin = kura_testkit::require_cmd("memcached")?;
        let (child, port) = kura_testkit::spawn_listening("memcached", START_TIMEOUT, |port| {
            let mut cmd = Command::new(&bin);
            cmd.args([
                "-p",
                &port.to_string(),
                "-l",
                "127.0.0.1",
                "-U",
                "0",
                "-u",
                "root",
            ])
            .args(extra);
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            cmd
        })
        .map_err(|e| e.to_string())?;
        Ok(Self {
            port,
            _child: child,
        })
    }
}

pub fn path_exists(p: &Path) -> bool {
    p.exists()
}
