//! Nodes that make clients authenticate: a kura server and memcached started with `-Y` (ASCII
//! authentication), Redis with `requirepass`. The URL's `USER:PASSWORD@` lets the pool in; a
//! pool without it, or with a wrong password, gets an error that says so, never a hang.

mod common;

use common::{KuraNode, Memcached, Redis};
use kura_pool::{Pool, PoolConfig, block_key};
use kura_testkit::try_or_skip;

fn open(url: &str) -> Pool {
    let mut config = PoolConfig::from_urls(&[url]).unwrap();
    config.backoff_max = std::time::Duration::from_millis(200);
    Pool::open(config).unwrap()
}

/// A write's error through a pool at `url`.
fn refused(url: &str) -> String {
    let pool = open(url);
    let mut ctx = pool.context().unwrap();
    ctx.set(&block_key(9, 9), b"v").unwrap_err().to_string()
}

fn users_file(dir: &std::path::Path) -> String {
    let path = dir.join("users");
    std::fs::write(&path, "pool:s3cr%t\nother:x\n").unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn a_kura_server_with_auth_serves_a_pool_with_its_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let node = KuraNode::start(&["-Y", &users_file(dir.path())]);
    let good = format!("kura://pool:s3cr%25t@127.0.0.1:{}", node.port);
    let pool = open(&good);
    common::exercise(&pool, true);
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"v").unwrap();
    ctx.flush().unwrap();
    assert_eq!(ctx.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    let e = refused(&node.url());
    assert!(e.contains("asks clients to authenticate (-Y)"), "{e}");
    let e = refused(&format!("kura://pool:wrong@127.0.0.1:{}", node.port));
    assert!(e.contains("authentication refused: CLIENT_ERROR authentication failure") && !e.contains("wrong"), "{e}");
}

#[test]
fn memcached_with_auth_serves_a_pool_with_its_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let server = try_or_skip!(Memcached::start_with(&["-Y", &users_file(dir.path())]));
    let pool = open(&format!("memcached://pool:s3cr%25t@127.0.0.1:{}", server.port));
    common::exercise(&pool, true);
    let e = refused(&server.url());
    assert!(e.contains("asks clients to authenticate (-Y)"), "{e}");
    let e = refused(&format!("memcached://pool:wrong@127.0.0.1:{}", server.port));
    assert!(e.contains("authentication refused"), "{e}");
    // Credentials for a memcached that asks for none: no probe stores them.
    let open_server = try_or_skip!(Memcached::start());
    let pool = open(&format!("memcached://pool:s3cr%25t@127.0.0.1:{}", open_server.port));
    common::exercise(&pool, true);
    let mut ctx = pool.context().unwrap();
    assert_eq!(ctx.get(b"auth").unwrap(), None, "the password was not stored as an item");
}

#[test]
fn redis_with_a_password_serves_a_pool_with_it() {
    let server = try_or_skip!(Redis::start(&["--requirepass", "s3cr%t"]));
    for url in [format!("redis://:s3cr%25t@127.0.0.1:{}", server.port), format!("redis://default:s3cr%25t@127.0.0.1:{}", server.port)] {
        common::exercise(&open(&url), true);
    }
    let e = refused(&server.url());
    assert!(e.contains("NOAUTH"), "{e}");
    let e = refused(&format!("redis://:wrong@127.0.0.1:{}", server.port));
    assert!(e.contains("authentication refused") && e.contains("WRONGPASS"), "{e}");
}
