//! Bad input and bad clients: memcached's replies (or a close where it
//! closes), other clients unaffected, memory bounded.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Client, Kura, eventually, transcript};

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[test]
fn malformed_requests_get_memcacheds_replies() {
    let kura = Kura::start(&[]);
    let long_key = "k".repeat(251);
    let cases: Vec<(Vec<u8>, &[u8])> = vec![
        (b"bogus\r\n".to_vec(), b"ERROR\r\n"),
        (b"\r\n".to_vec(), b"ERROR\r\n"),
        (b"GET a\r\n".to_vec(), b"ERROR\r\n"),
        (b"set a\r\n".to_vec(), b"ERROR\r\n"),
        (b"set a 0 0\r\n".to_vec(), b"ERROR\r\n"),
        (b"get\r\n".to_vec(), b"ERROR\r\n"),
        (b"incr a\r\n".to_vec(), b"ERROR\r\n"),
        (
            b"set a x 0 1\r\nz\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\nERROR\r\n",
        ),
        (
            b"set a 0 x 1\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            b"set a 0 0 -1\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            b"set a 0 0 x\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            b"cas a 0 0 1 x\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            format!("set {long_key} 0 0 1\r\nz\r\n").into_bytes(),
            b"CLIENT_ERROR bad command line format\r\nERROR\r\n",
        ),
        (
            format!("get {long_key}\r\n").into_bytes(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            format!("delete {long_key}\r\n").into_bytes(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        // kura is stricter than memcached here: control characters in keys.
        (
            b"get a\x01b\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            b"set a\tb 0 0 1\r\nz\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\nERROR\r\n",
        ),
        (
            b"set a 0 0 1\r\nzz\r\n".to_vec(),
            b"CLIENT_ERROR bad data chunk\r\nERROR\r\n",
        ),
        (b"set a 0 0 1 noreply\r\nzz\r\n".to_vec(), b"ERROR\r\n"),
        (
            b"incr a x\r\n".to_vec(),
            b"CLIENT_ERROR invalid numeric delta argument\r\n",
        ),
        (
            b"touch a x\r\n".to_vec(),
            b"CLIENT_ERROR invalid exptime argument\r\n",
        ),
        (
            b"verbosity x\r\n".to_vec(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (b"mg\r\n".to_vec(), b"ERROR\r\n"),
        (b"mz a\r\n".to_vec(), b"ERROR\r\n"),
        (
            format!("mg {long_key} v\r\n").into_bytes(),
            b"CLIENT_ERROR bad command line format\r\n",
        ),
        (
            b"ms a 1 S\r\nz\r\n".to_vec(),
            b"CLIENT_ERROR invalid flag\r\n",
        ),
        (
            b"ms a 2 Oaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\nzz\r\n".to_vec(),
            b"CLIENT_ERROR opaque token too long\r\n",
        ),
    ];
    // The same requests against a stock memcached, when installed, prove the expectations.
    let memcached = common::Memcached::start(&[])
        .map_err(|reason| eprintln!("memcached not compared: {reason}"))
        .ok();
    for (request, expected) in cases {
        let mut script = request.clone();
        script.extend_from_slice(b"mn\r\n");
        let mut expected = expected.to_vec();
        expected.extend_from_slice(b"MN\r\n");
        let got = transcript(kura.port, &script);
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&expected),
            "request {:?}",
            String::from_utf8_lossy(&request)
        );
        let stricter = request.iter().any(|&b| b == b'\t' || b == 1);
        if let Some(memcached) = memcached.as_ref().filter(|_| !stricter) {
            let theirs = transcript(memcached.port, &script);
            assert_eq!(
                String::from_utf8_lossy(&theirs),
                String::from_utf8_lossy(&expected),
                "memcached disagrees on {:?}",
                String::from_utf8_lossy(&request)
            );
        }
    }
    // The server is still fine.
    let mut c = kura.client();
    c.set("ok", b"1");
    assert!(c.stat("kura_protocol_errors") > 10);
}

#[test]
fn lines_that_never_end_and_binary_garbage_close_the_connection() {
    let kura = Kura::start(&[]);
    let mut bystander = kura.client();
    bystander.set("b", b"still here");
    // A command line past 2048 bytes without a newline: closed (with kura's reason).
    let got = transcript(kura.port, &[b'x'; 4096]);
    assert_eq!(got, b"CLIENT_ERROR line too long\r\n");
    // Exactly 2048 bytes is still a line in progress (memcached's limit).
    let mut edge = Client::connect(kura.port);
    edge.send([b'x'; 2048]);
    edge.expect("\n", "ERROR\r\n");
    // A line over the limit sent slowly, in pieces, is closed too.
    let mut slow = Client::connect(kura.port);
    for _ in 0..10 {
        if slow.stream.write_all(&[b'y'; 300]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        slow.read_to_close().is_some(),
        "the server closes an endless line"
    );
    // A multi-get may be longer, up to its own bound.
    let keys: String = (0..3000).map(|i| format!(" key{i}")).collect();
    assert_eq!(bystander.until_end(format!("get{keys}\r\n")), "END\r\n");
    // Binary protocol: refused with a reason, then closed.
    let got = transcript(
        kura.port,
        &[
            0x80, 0x00, 0x00, 0x05, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            b'h', b'e', b'l', b'l', b'o',
        ],
    );
    assert_eq!(got, b"CLIENT_ERROR binary protocol is not supported\r\n");
    // Random bytes: whatever they parse as, the server survives and stays correct.
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..20 {
        let len = rng.random_range(1..5000);
        let garbage: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let _ = transcript(kura.port, &garbage);
    }
    assert_eq!(bystander.get("b"), Some(b"still here".to_vec()));
}

#[test]
fn silent_and_vanishing_clients() {
    let kura = Kura::start(&["--idle-timeout-s", "1"]);
    // A client that connects and says nothing is closed after the idle timeout.
    let mut silent = TcpStream::connect(("127.0.0.1", kura.port)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 16];
    assert_eq!(
        silent.read(&mut buf).unwrap_or(0),
        0,
        "closed by the server"
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    // A client that vanishes mid-value leaves nothing behind.
    {
        let mut gone = TcpStream::connect(("127.0.0.1", kura.port)).unwrap();
        gone.write_all(b"set half 0 0 1000\r\nabc").unwrap();
    }
    let mut c = kura.client();
    assert_eq!(c.get("half"), None);
    // A client that announces a big value and stalls does not block others.
    let mut stalled = TcpStream::connect(("127.0.0.1", kura.port)).unwrap();
    stalled.write_all(b"set big 0 0 60000\r\nabc").unwrap();
    let mut other = kura.client();
    other.set("fine", b"yes");
    assert_eq!(other.get("fine"), Some(b"yes".to_vec()));
    assert!(c.stat("idle_kicks") >= 1);
}

#[test]
fn connection_limit() {
    let kura = Kura::start(&["-c", "4"]);
    // The start-up probe's connection may not be closed yet: wait until only ours counts.
    let mut first = kura.client();
    assert!(eventually(Duration::from_secs(5), || first
        .stat("curr_connections")
        == 1));
    let mut held: Vec<Client> = std::iter::once(first)
        .chain((0..3).map(|_| kura.client()))
        .collect();
    for c in &mut held {
        c.expect("mn\r\n", "MN\r\n");
    }
    let mut refused = kura.client();
    assert_eq!(
        refused.read_to_close().unwrap(),
        b"ERROR Too many open connections\r\n"
    );
    drop(held.pop());
    let mut again = None;
    assert!(
        eventually(Duration::from_secs(5), || {
            let mut c = kura.client();
            c.send("mn\r\n");
            let ok = c.line() == "MN\r\n";
            if ok {
                again = Some(c);
            }
            ok
        }),
        "a slot frees when a client leaves"
    );
    let mut c = again.unwrap();
    let stats = c.stats();
    assert!(stats["rejected_connections"].parse::<u64>().unwrap() >= 1);
    assert_eq!(stats["curr_connections"], "4");
}

#[test]
fn a_client_that_never_reads_cannot_grow_server_memory() {
    let kura = Kura::start(&["-I", "64k", "-m", "16"]);
    let mut c = kura.client();
    let value = vec![b'v'; 60_000];
    c.set("big", &value);
    let base = rss_bytes(kura.pid());
    // 20,000 gets of a 60 kB value: 1.2 GB of replies that the client never reads.
    let mut flood = TcpStream::connect(("127.0.0.1", kura.port)).unwrap();
    flood
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let request = b"get big\r\n".repeat(20_000);
    // The server stops reading once its output is full, so this write stalls.
    let _ = flood.write_all(&request);
    std::thread::sleep(Duration::from_millis(300));
    let grown = rss_bytes(kura.pid()).saturating_sub(base);
    assert!(
        grown < 64 << 20,
        "server RSS grew by {grown} bytes for a client that does not read"
    );
    // Others are served meanwhile.
    let mut other = kura.client();
    assert_eq!(other.get("big").map(|v| v.len()), Some(60_000));
    drop(flood);
    other.set("after", b"ok");
}

/// CPU time (user and system) of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / per_second)
}

/// Workers look for work a while before sleeping (`--poll-spin-us`), but only a while: a
/// client that asks now and then costs the server a little CPU time per request, and an idle
/// server costs none.
#[test]
fn an_idle_server_sleeps_after_its_spin() {
    let kura = Kura::start(&[]);
    let mut client = kura.client();
    client.set("k", b"first");
    let (before, started) = (cpu_time(kura.pid()), Instant::now());
    for _ in 0..100 {
        client.set("k", b"v");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (sparse, wall) = (cpu_time(kura.pid()) - before, started.elapsed());
    // Each request 5 ms after the last finds the worker asleep, after a spin that found
    // nothing; the counters say so.
    assert!(client.stat("kura_poll_spin_slept") >= 50, "{:?}", client.stats());
    // 100 requests with a 50 µs spin after each are ~5 ms of the ~500 ms; a worker that
    // kept spinning would use all of it.
    assert!(sparse < wall / 4, "{sparse:?} of CPU time over {wall:?} of requests every 5 ms");
    let before = cpu_time(kura.pid());
    std::thread::sleep(Duration::from_secs(1));
    let idle = cpu_time(kura.pid()) - before;
    assert!(idle <= Duration::from_millis(50), "{idle:?} of CPU time in a second without requests");
}
