//! Error handling: nodes that are down, silent, or answer garbage. Every case ends in a
//! clear error within the timeout, never a hang.

mod common;

use std::time::{Duration, Instant};

use common::{FakeServer, Misbehaviour};
use kura_pool::{Error, Pool, PoolConfig, block_key};

fn pool(url: String, timeout_ms: u64) -> Pool {
    let mut config = PoolConfig::from_urls(&[url]).unwrap();
    config.request_timeout = Duration::from_millis(timeout_ms);
    config.connect_timeout = Duration::from_millis(timeout_ms);
    Pool::open(config).unwrap()
}

#[test]
fn a_node_nobody_listens_on_is_down_at_once() {
    let port = kura_testkit::free_tcp_port().unwrap();
    for url in [format!("kura://127.0.0.1:{port}"), format!("redis://127.0.0.1:{port}")] {
        let pool = pool(url, 2000);
        let mut ctx = pool.context().expect("a context even with its node down");
        for _ in 0..3 {
            let started = Instant::now();
            let e = ctx.get(b"k").unwrap_err();
            assert!(started.elapsed() < Duration::from_millis(500));
            assert!(matches!(e, Error::NodeDown { .. }), "{e}");
            assert!(e.to_string().contains(&port.to_string()), "{e}");
        }
        assert!(ctx.flush().is_err());
    }
}

#[test]
fn garbage_replies_close_the_connection_with_a_protocol_error() {
    let server = FakeServer::start(Misbehaviour::Garbage);
    let pool = pool(server.url(), 2000);
    let mut ctx = pool.context().unwrap();
    for i in 0..8 {
        ctx.submit_get(&block_key(0, i), i).unwrap();
    }
    let mut errors = Vec::new();
    while ctx.in_flight() > 0 {
        ctx.poll(None, &mut |c| errors.push(c.result.unwrap_err())).unwrap();
    }
    assert_eq!(errors.len(), 8);
    assert!(errors.iter().all(|e| matches!(e, Error::Protocol { .. })), "{errors:?}");
    assert_eq!(ctx.io_stats().disconnects, 1);
    // In back-off now: the next request fails at once, naming the protocol error.
    let e = ctx.get(b"k").unwrap_err();
    assert!(matches!(e, Error::NodeDown { .. }) && e.to_string().contains("protocol error"), "{e}");
}

#[test]
fn a_garbage_handshake_is_a_node_down_with_the_reason() {
    let server = FakeServer::start(Misbehaviour::GarbageHandshake);
    let pool = pool(server.url(), 2000);
    let mut ctx = pool.context().unwrap();
    let e = ctx.get(b"k").unwrap_err();
    assert!(matches!(e, Error::NodeDown { .. }), "{e}");
    assert!(e.to_string().contains("handshake") || e.to_string().contains("unexpected reply"), "{e}");
}

#[test]
fn a_silent_node_times_out() {
    let server = FakeServer::start(Misbehaviour::Silent);
    let pool = pool(server.url(), 300);
    let mut ctx = pool.context().unwrap();
    let started = Instant::now();
    ctx.submit_set(b"a", b"1", 1).unwrap();
    ctx.submit_get(b"b", 2).unwrap();
    let mut errors = Vec::new();
    while ctx.in_flight() > 0 {
        ctx.poll(None, &mut |c| errors.push(c.result.unwrap_err())).unwrap();
    }
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(2), "{elapsed:?}");
    assert!(errors.iter().all(|e| matches!(e, Error::Timeout { timeout_ms: 300, .. })), "{errors:?}");
    // A poll with a timeout returns when it runs out, with nothing.
    ctx.submit_get(b"c", 3).unwrap();
    let started = Instant::now();
    assert_eq!(ctx.poll(Some(Duration::from_millis(50)), &mut |_| panic!("no reply expected")).unwrap(), 0);
    assert!(started.elapsed() < Duration::from_millis(250));
    assert_eq!(ctx.in_flight(), 1);
}

/// A server thread waiting for a slow node also wakes when its own client sends more (the
/// NBD export waits like that, so requests start as they arrive).
#[test]
fn a_watched_socket_ends_a_wait_for_a_silent_node() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let server = FakeServer::start(Misbehaviour::Silent);
    let pool = pool(server.url(), 30_000);
    let mut ctx = pool.context().unwrap();
    let (mut client, peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let fd = client.as_raw_fd();
    ctx.submit_get(b"a", 1).unwrap();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        (&peer).write_all(b"next").unwrap();
        peer
    });
    let started = Instant::now();
    assert_eq!(ctx.poll_watching(None, Some(fd), &mut |_| panic!("no reply expected")).unwrap(), 0);
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(100) && elapsed < Duration::from_secs(5), "{elapsed:?}");
    assert_eq!(ctx.in_flight(), 1, "the request is still in flight");
    let mut peer = sender.join().unwrap();
    let mut got = [0u8; 4];
    client.read_exact(&mut got).unwrap();
    // Once read, what arrived does not wake the next wait: it runs to its timeout.
    let started = Instant::now();
    assert_eq!(ctx.poll_watching(Some(Duration::from_millis(300)), Some(fd), &mut |_| panic!("no reply expected")).unwrap(), 0);
    assert!(started.elapsed() >= Duration::from_millis(290), "{:?}", started.elapsed());
    // New data does, also when it came before the wait began.
    peer.write_all(b"more").unwrap();
    let started = Instant::now();
    assert_eq!(ctx.poll_watching(None, Some(fd), &mut |_| panic!("no reply expected")).unwrap(), 0);
    assert!(started.elapsed() < Duration::from_secs(5));
    // A plain poll ignores the socket.
    client.read_exact(&mut got).unwrap();
    peer.write_all(b"late").unwrap();
    let started = Instant::now();
    assert_eq!(ctx.poll(Some(Duration::from_millis(300)), &mut |_| panic!("no reply expected")).unwrap(), 0);
    assert!(started.elapsed() >= Duration::from_millis(290), "{:?}", started.elapsed());
}

/// A thread that waits for a slow node can be woken by another one (the FUSE export's
/// dispatchers wait like that for both completions and new requests).
#[test]
fn a_waker_ends_a_wait_for_a_silent_node() {
    let server = FakeServer::start(Misbehaviour::Silent);
    let pool = pool(server.url(), 30_000);
    let mut ctx = pool.context().unwrap();
    let waker = ctx.waker().unwrap().expect("a networked pool's context can be woken");
    ctx.submit_get(b"a", 1).unwrap();
    let started = Instant::now();
    let wake_from = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        waker.wake();
    });
    assert_eq!(ctx.poll(None, &mut |_| panic!("no reply expected")).unwrap(), 0);
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(100) && elapsed < Duration::from_secs(5), "{elapsed:?}");
    assert_eq!(ctx.in_flight(), 1, "the request is still in flight");
    wake_from.join().unwrap();
    // A wake-up sent while nobody waits ends the next wait at once.
    ctx.waker().unwrap().unwrap().wake();
    let started = Instant::now();
    assert_eq!(ctx.poll(None, &mut |_| panic!("no reply expected")).unwrap(), 0);
    assert!(started.elapsed() < Duration::from_secs(5));
}
