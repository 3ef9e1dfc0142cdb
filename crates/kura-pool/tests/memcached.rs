//! Stock memcached: meta commands (found at connect), the text protocol when asked, server
//! refusals that leave the connection usable.

mod common;

use common::Memcached;
use kura_pool::{Error, Pool, PoolConfig, block_key};
use kura_testkit::try_or_skip;

#[test]
fn meta_protocol_serves_the_common_scenario() {
    let server = try_or_skip!(Memcached::start());
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    let stats = common::exercise(&pool, true);
    assert!(stats.requests_per_send() > 4.0 && stats.replies_per_recv() > 2.0, "{stats:?}");
}

#[test]
fn text_protocol_serves_the_common_scenario_and_refuses_binary_keys() {
    let server = try_or_skip!(Memcached::start());
    let pool = Pool::open(PoolConfig::from_urls(&[format!("{}?protocol=text", server.url())]).unwrap()).unwrap();
    common::exercise(&pool, false);
    let mut ctx = pool.context().unwrap();
    let e = ctx.set(b"a key", b"v").unwrap_err();
    assert!(matches!(e, Error::KeyNotRepresentable { .. }), "{e}");
    ctx.set(b"ok", b"v").unwrap();
}

#[test]
fn values_over_the_server_limit_are_refused_and_the_connection_goes_on() {
    let server = try_or_skip!(Memcached::start());
    let mut config = PoolConfig::from_urls(&[server.url()]).unwrap();
    config.value_size_max_bytes = 4 << 20;
    let pool = Pool::open(config).unwrap();
    let mut ctx = pool.context().unwrap();
    // memcached's default item limit is 1 MiB.
    let big = vec![7u8; 2 << 20];
    ctx.submit_set(&block_key(0, 1), b"before", 1).unwrap();
    ctx.submit_set(&block_key(0, 2), &big, 2).unwrap();
    ctx.submit_set(&block_key(0, 3), b"after", 3).unwrap();
    let mut results = Vec::new();
    while ctx.in_flight() > 0 {
        ctx.poll(None, &mut |c| results.push((c.token, c.result.map(|_| ()).map_err(|e| e.to_string())))).unwrap();
    }
    results.sort_by_key(|r| r.0);
    assert!(results[0].1.is_ok() && results[2].1.is_ok(), "{results:?}");
    let e = results[1].1.as_ref().unwrap_err();
    assert!(e.contains("SERVER_ERROR") && e.contains("too large"), "{e}");
    assert_eq!(ctx.get(&block_key(0, 3)).unwrap().as_deref(), Some(&b"after"[..]));
    assert_eq!(ctx.get(&block_key(0, 2)).unwrap(), None);
    assert_eq!(ctx.io_stats().disconnects, 0);
}

#[test]
fn a_kura_url_on_memcached_cannot_flush() {
    let server = try_or_skip!(Memcached::start());
    let pool = Pool::open(PoolConfig::from_urls(&[format!("kura://127.0.0.1:{}", server.port)]).unwrap()).unwrap();
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"v").unwrap();
    let e = ctx.flush().unwrap_err();
    assert!(matches!(e, Error::FlushUnsupported { .. }), "{e}");
    // ... and the connection is still in step.
    assert_eq!(ctx.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
}

/// memcached names no instance, but its pid and start time (`stats`) do: a restart while no
/// connection was open fails the next flush once; a request timeout (the server stopped and
/// continued, the same process) fails none.
#[test]
fn a_restart_fails_the_next_flush_once_and_a_timeout_none() {
    let mut server = try_or_skip!(Memcached::start());
    let pool = common::impatient_pool(&server.url());
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"1").unwrap();
    common::time_out_a_get(&mut ctx, |signal| server.signal(signal));
    ctx.flush().expect("the same process: nothing lost");
    assert_eq!(ctx.get(b"k").unwrap().as_deref(), Some(&b"1"[..]));
    drop(ctx);
    server.restart();
    let mut ctx = pool.context().unwrap();
    common::assert_writes_may_be_lost(ctx.flush(), &format!("127.0.0.1:{}", server.port));
    ctx.flush().expect("reported once");
    assert_eq!(ctx.get(b"k").unwrap(), None, "a new memcached holds nothing");
}
