//! The existence probe ([`Context::submit_exists`], [`Context::exists_many`]) on every kind of
//! node: keys present, never written, deleted, expired; batches larger than one pipeline
//! window; values that do not cross the network (the node's own byte counters); a node that
//! goes away with probes in flight fails them with a clear error, never a hang.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{FakeServer, KuraNode, Memcached, Misbehaviour, Redis, redis_cli, value_of};
use kura_pool::{Context, Error, Outcome, Pool, PoolConfig, block_key};
use kura_testkit::{memcache_stat, try_or_skip};

/// Probes in one batch: more than the blocking helpers' window of 1024.
const BATCH_KEYS: u64 = 3000;

/// Sets every other key of a batch, then probes them all (present, never written) and a
/// deleted one, by the blocking helper and by submit/poll; and a binary key (sent base64 to
/// meta-protocol nodes) when the backend can carry one.
fn present_missing_and_deleted(pool: &Pool, binary_keys: bool) {
    let mut ctx = pool.context().unwrap();
    let written: Vec<(Vec<u8>, Vec<u8>)> = (0..BATCH_KEYS).step_by(2).map(|i| (block_key(7, i).to_vec(), value_of(i))).collect();
    ctx.set_many(&written).unwrap();
    let keys: Vec<_> = (0..BATCH_KEYS).map(|i| block_key(7, i)).collect();
    let found: Vec<bool> = ctx.exists_many(&keys).unwrap().into_iter().map(Result::unwrap).collect();
    let want: Vec<bool> = (0..BATCH_KEYS).map(|i| i % 2 == 0).collect();
    assert_eq!(found, want, "{}: every written key and no other", pool.config().nodes[0].name());

    ctx.delete(&block_key(7, 10)).unwrap();
    ctx.set(b"empty-value", b"").unwrap();
    for (token, key, present) in [(1, &block_key(7, 10)[..], false), (2, &block_key(7, 12)[..], true), (3, b"empty-value", true), (4, b"never", false)] {
        ctx.submit_exists(key, token).unwrap();
        let mut outcome = None;
        while ctx.in_flight() > 0 {
            ctx.poll(None, &mut |c| outcome = Some((c.token, c.result.map(|o| o == Outcome::Done).map_err(|e| e.to_string())))).unwrap();
        }
        assert_eq!(outcome, Some((token, Ok(present))), "{:?}", String::from_utf8_lossy(key));
    }
    if binary_keys {
        let key = b"bin\x00key with spaces\r\n\xff";
        ctx.set(key, b"binary").unwrap();
        let found = ctx.exists_many(&[&key[..], b"bin\x00other key"]).unwrap();
        assert!(matches!(found[..], [Ok(true), Ok(false)]), "{found:?}");
    }
    // Bad input is refused at submit, as for a get.
    assert!(matches!(ctx.submit_exists(b"", 0), Err(Error::KeyEmpty)));
    assert!(matches!(ctx.submit_exists(&[b'k'; 251], 0), Err(Error::KeyTooLong { .. })));
    assert_eq!(ctx.in_flight(), 0);
}

/// One line of a text-protocol exchange with a memcached-protocol server.
fn memcache_command(port: u16, command: &[u8], reply_end: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    stream.write_all(command).unwrap();
    let mut reader = BufReader::new(stream);
    let mut reply = String::new();
    while !reply.ends_with(reply_end) {
        assert_ne!(reader.read_line(&mut reply).unwrap(), 0, "closed after {reply:?}");
    }
    reply
}

/// Probes of `count` written 4 KiB values: what the server sent, in bytes.
fn bytes_sent_for_probes(ctx: &mut Context, count: u64, bytes_sent: &dyn Fn() -> u64) -> u64 {
    let keys: Vec<_> = (0..count).map(|i| block_key(7, 100 + i * 2)).collect();
    let before = bytes_sent();
    assert!(ctx.exists_many(&keys).unwrap().into_iter().all(|r| r.unwrap()));
    bytes_sent() - before
}

/// A key written with a TTL of a second on a memcached-protocol server, gone after it.
fn expires(port: u16, ctx: &mut Context) {
    assert_eq!(memcache_command(port, b"set short-lived 0 1 5\r\nhello\r\n", "\r\n"), "STORED\r\n");
    assert!(ctx.exists_many(&[b"short-lived"]).unwrap()[0].as_ref().unwrap());
    std::thread::sleep(Duration::from_millis(2100));
    assert!(!ctx.exists_many(&[b"short-lived"]).unwrap()[0].as_ref().unwrap(), "expired");
}

#[test]
fn memcached_answers_probes_without_values() {
    let server = try_or_skip!(Memcached::start());
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    present_missing_and_deleted(&pool, true);
    let mut ctx = pool.context().unwrap();
    expires(server.port, &mut ctx);
    let sent = bytes_sent_for_probes(&mut ctx, 1000, &|| memcache_stat(server.port, "bytes_written"));
    // `HD\r\n` per probe, and the `stats` reply that reads the counter (about 3 KiB).
    assert!(sent < 1000 * 4 + 8192, "memcached sent {sent} bytes for 1000 probes of 4 KiB values");
    // The same keys by get: the values cross.
    let keys: Vec<_> = (0..1000).map(|i| block_key(7, i * 2)).collect();
    let before = memcache_stat(server.port, "bytes_written");
    ctx.get_many(&keys).unwrap();
    assert!(memcache_stat(server.port, "bytes_written") - before > 1000 * 4096);
}

#[test]
fn memcached_text_protocol_probes_by_get() {
    let server = try_or_skip!(Memcached::start());
    let pool = Pool::open(PoolConfig::from_urls(&[format!("{}?protocol=text", server.url())]).unwrap()).unwrap();
    present_missing_and_deleted(&pool, false);
}

#[test]
fn kura_server_answers_probes_without_values() {
    let server = KuraNode::start(&[]);
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    present_missing_and_deleted(&pool, true);
    let mut ctx = pool.context().unwrap();
    expires(server.port, &mut ctx);
    let sent = bytes_sent_for_probes(&mut ctx, 1000, &|| memcache_stat(server.port, "bytes_written"));
    assert!(sent < 1000 * 4 + 8192, "the kura server sent {sent} bytes for 1000 probes of 4 KiB values");
}

#[test]
fn redis_answers_probes_with_exists() {
    let server = try_or_skip!(Redis::start(&[]));
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    present_missing_and_deleted(&pool, true);
    let mut ctx = pool.context().unwrap();
    assert_eq!(redis_cli(server.port, &["set", "short-lived", "hello", "px", "200"]).trim(), "OK");
    assert!(ctx.exists_many(&[b"short-lived"]).unwrap()[0].as_ref().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(!ctx.exists_many(&[b"short-lived"]).unwrap()[0].as_ref().unwrap(), "expired");
    let output_bytes = || -> u64 {
        let info = redis_cli(server.port, &["info", "stats"]);
        let line = info.lines().find(|l| l.starts_with("total_net_output_bytes:")).expect("total_net_output_bytes");
        line.trim_end().rsplit(':').next().unwrap().parse().unwrap()
    };
    let sent = bytes_sent_for_probes(&mut ctx, 1000, &output_bytes);
    // `:1\r\n` per probe, and the INFO replies (a few KiB).
    assert!(sent < 1000 * 4 + 16384, "redis sent {sent} bytes for 1000 probes of 4 KiB values");
}

#[test]
fn the_embedded_engine_answers_probes() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::open(PoolConfig::from_urls(&[format!("embedded:{}?size=256M", dir.path().join("pool.kura").display())]).unwrap()).unwrap();
    present_missing_and_deleted(&pool, true);
    // After a sync the values are on the device: the probes read them back (io_uring).
    let mut ctx = pool.context().unwrap();
    ctx.flush().unwrap();
    let keys: Vec<_> = (0..BATCH_KEYS).map(|i| block_key(7, i)).collect();
    let found = ctx.exists_many(&keys).unwrap();
    assert!(found.iter().enumerate().all(|(i, r)| *r.as_ref().unwrap() == (i % 2 == 0 && i != 10)));
}

/// A node that answers part of a batch and closes: the answered probes complete, the others
/// fail with `ConnectionLost`, promptly.
#[test]
fn a_node_that_hangs_up_mid_batch_fails_the_rest() {
    let server = FakeServer::start(Misbehaviour::HangUpAfter(100));
    let mut config = PoolConfig::from_urls(&[server.url()]).unwrap();
    config.request_timeout = Duration::from_secs(5);
    let pool = Pool::open(config).unwrap();
    let mut ctx = pool.context().unwrap();
    let started = Instant::now();
    let results = ctx.exists_many(&(0..500).map(|i| block_key(1, i)).collect::<Vec<_>>()).unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "no waiting for the timeout: {:?}", started.elapsed());
    assert!(results[..100].iter().all(|r| matches!(r, Ok(true))), "{:?}", &results[..100]);
    for r in &results[100..] {
        match r {
            Err(e @ Error::ConnectionLost { .. }) => assert!(e.to_string().contains(&server.port.to_string()), "{e}"),
            other => panic!("expected ConnectionLost, got {other:?}"),
        }
    }
}

/// A real server killed with probes in flight (stopped first, so that none is answered): all
/// fail with `ConnectionLost`; the server started again answers the next ones.
#[test]
fn memcached_killed_with_probes_in_flight() {
    let mut server = try_or_skip!(Memcached::start());
    let mut config = PoolConfig::from_urls(&[server.url()]).unwrap();
    config.request_timeout = Duration::from_secs(5);
    let pool = Pool::open(config).unwrap();
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"v").unwrap();
    server.signal("STOP");
    for i in 0..2000 {
        ctx.submit_exists(&block_key(1, i), i).unwrap();
    }
    assert_eq!(ctx.poll(Some(Duration::from_millis(20)), &mut |c| panic!("answered while stopped: {c:?}")).unwrap(), 0);
    server.restart();
    let mut errors = Vec::new();
    while ctx.in_flight() > 0 {
        ctx.poll(None, &mut |c| errors.push(c.result.unwrap_err())).unwrap();
    }
    assert_eq!(errors.len(), 2000);
    assert!(errors.iter().all(|e| matches!(e, Error::ConnectionLost { .. })), "{:?}", &errors[..3]);
    assert!(!ctx.exists_many(&[b"k"]).unwrap()[0].as_ref().unwrap(), "a new memcached holds nothing");
}
