//! A pool of three `kura serve` processes: placement, the flush barrier (the server's `sync`),
//! restarts, a node that is down, and growing the pool.

mod common;

use std::time::{Duration, Instant};

use common::{KuraNode, assert_writes_may_be_lost, impatient_pool, time_out_a_get, value_of};
use kura_pool::{Error, Pool, PoolConfig, block_key};

fn pool_of(nodes: &[&KuraNode], options: &str) -> Pool {
    let urls: Vec<String> = nodes.iter().map(|n| format!("{}{options}", n.url())).collect();
    let mut config = PoolConfig::from_urls(&urls).unwrap();
    config.request_timeout = Duration::from_secs(5);
    config.backoff_max = Duration::from_millis(400);
    Pool::open(config).unwrap()
}

#[test]
fn three_servers_share_the_keys_and_serve_the_common_scenario() {
    let nodes = [KuraNode::start(&[]), KuraNode::start(&[]), KuraNode::start(&[])];
    let pool = pool_of(&nodes.iter().collect::<Vec<_>>(), "");
    let stats = common::exercise(&pool, true);
    // 32 in flight over 3 nodes: requests leave together.
    assert!(stats.requests_per_send() > 2.0, "{stats:?}");
    assert!(stats.replies_per_recv() > 1.5, "{stats:?}");
    // Each node holds exactly the keys the ring gives it.
    let singles: Vec<Pool> = nodes.iter().map(|n| pool_of(&[n], "")).collect();
    let mut per_node = [0usize; 3];
    for i in (0..300).filter(|i| ![3, 4, 5].contains(i)) {
        let key = block_key(1, i);
        let owner = pool.node_of(&key).name();
        for (n, single) in singles.iter().enumerate() {
            let got = single.context().unwrap().get(&key).unwrap();
            if owner == nodes[n].addr() {
                assert_eq!(got, Some(value_of(i)), "key {i} on its node");
                per_node[n] += 1;
            } else {
                assert_eq!(got, None, "key {i} on another node");
            }
        }
    }
    assert!(per_node.iter().all(|&n| n > 50), "{per_node:?}");
}

/// With `--sync never` the server syncs only at a clean shutdown: what survives SIGKILL is
/// what the pool's flush (`sync`) made durable.
#[test]
fn a_flush_makes_writes_survive_sigkill() {
    let mut node = KuraNode::start(&["--sync", "never"]);
    let pool = pool_of(&[&node], "");
    let mut ctx = pool.context().unwrap();
    let items: Vec<_> = (0..200).map(|i| (block_key(4, i), value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    ctx.flush().expect("flush (needs the server's `sync` command)");
    node.kill();
    node.restart();
    // The old connection closed while idle: the context notices and reconnects, so not even
    // the first request after the restart fails.
    let keys: Vec<_> = (0..200).map(|i| block_key(4, i)).collect();
    for (i, value) in ctx.get_many(&keys).unwrap().into_iter().enumerate() {
        assert_eq!(value.unwrap(), Some(value_of(i as u64)), "key {i} lost");
    }
}

/// `flush=ack` for servers running `--sync always`: every acknowledged write is durable.
#[test]
fn flush_ack_with_sync_always_survives_sigkill() {
    let mut node = KuraNode::start(&["--sync", "always"]);
    let pool = pool_of(&[&node], "?flush=ack");
    let mut ctx = pool.context().unwrap();
    let items: Vec<_> = (0..100).map(|i| (block_key(5, i), value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    ctx.flush().unwrap();
    node.kill();
    node.restart();
    let keys: Vec<_> = (0..100).map(|i| block_key(5, i)).collect();
    assert!(ctx.get_many(&keys).unwrap().into_iter().enumerate().all(|(i, v)| v.unwrap() == Some(value_of(i as u64))));
}

/// Retries `f` (a node coming back) for up to 10 s.
fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "the node did not come back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_node_that_is_down_fails_fast_and_is_used_again_when_back() {
    let mut nodes = [KuraNode::start(&[]), KuraNode::start(&[])];
    let pool = pool_of(&nodes.iter().collect::<Vec<_>>(), "");
    let mut ctx = pool.context().unwrap();
    let items: Vec<_> = (0..100).map(|i| (block_key(6, i), value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    let down = nodes[1].addr();
    nodes[1].stop();
    let keys: Vec<_> = (0..100).map(|i| block_key(6, i)).collect();
    for _ in 0..3 {
        let started = Instant::now();
        let got = ctx.get_many(&keys).unwrap();
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        for (i, result) in got.into_iter().enumerate() {
            if pool.node_of(&keys[i]).name() == down {
                let e = result.unwrap_err();
                assert!(matches!(e, Error::NodeDown { .. } | Error::ConnectionLost { .. }), "{e}");
                assert!(e.to_string().contains(&down), "{e}");
                assert!(e.is_retryable());
            } else {
                assert_eq!(result.unwrap(), Some(value_of(i as u64)));
            }
        }
        // A flush cannot vouch for a node it cannot reach.
        assert!(ctx.flush().is_err());
    }
    nodes[1].restart();
    let got = wait_for(|| ctx.get_many(&keys).ok().filter(|v| v.iter().all(Result::is_ok)));
    assert!(got.into_iter().enumerate().all(|(i, v)| v.unwrap() == Some(value_of(i as u64))));
    // A new instance of the node answers: the first flush says writes may be lost, once.
    assert_writes_may_be_lost(ctx.flush(), &down);
    ctx.flush().unwrap();
    assert!(ctx.io_stats().connects >= 3, "{:?}", ctx.io_stats());
}

/// Adding a fourth node: about a quarter of the keys now belong to it (and read as missing
/// there); the rest stay where they were.
#[test]
fn adding_a_node_moves_about_a_quarter_of_the_keys() {
    let nodes = [KuraNode::start(&[]), KuraNode::start(&[]), KuraNode::start(&[]), KuraNode::start(&[])];
    let three = pool_of(&[&nodes[0], &nodes[1], &nodes[2]], "");
    let items: Vec<_> = (0..1200).map(|i| (block_key(7, i), value_of(i))).collect();
    three.context().unwrap().set_many(&items).unwrap();
    let four = pool_of(&nodes.iter().collect::<Vec<_>>(), "");
    let keys: Vec<_> = (0..1200).map(|i| block_key(7, i)).collect();
    let got = four.context().unwrap().get_many(&keys).unwrap();
    let mut moved = 0;
    for (i, value) in got.into_iter().enumerate() {
        match value.unwrap() {
            Some(v) => assert_eq!(v, value_of(i as u64)),
            None => {
                assert_eq!(four.node_of(&keys[i]).name(), nodes[3].addr(), "key {i} moved between old nodes");
                moved += 1;
            }
        }
    }
    let fraction = moved as f64 / 1200.0;
    assert!((0.18..0.32).contains(&fraction), "moved {fraction}");
}

#[test]
fn per_node_connection_limit() {
    let node = KuraNode::start(&[]);
    let pool = pool_of(&[&node], "?max_connections=2");
    let a = pool.context().unwrap();
    let _b = pool.context().unwrap();
    let e = pool.context().err().expect("a third connection is over the limit");
    assert!(matches!(e, Error::ConnectionLimit { max: 2, .. }), "{e}");
    drop(a);
    let mut c = pool.context().unwrap();
    c.set(b"k", b"v").unwrap();
}

/// A write acknowledged (not synced) by a context that then closed its connection, `kill -9`
/// and a restart while no connection was open: a context's first flush after the restart
/// fails, once, though none of its connections ever broke. (Counting broken connections, the
/// flush succeeded and the write was gone.)
#[test]
fn a_restart_while_no_connection_was_open_fails_the_next_flush_once() {
    let mut node = KuraNode::start(&["--sync", "never"]);
    let pool = pool_of(&[&node], "");
    let mut writer = pool.context().unwrap();
    writer.set(b"acknowledged", b"not synced").unwrap();
    drop(writer);
    node.kill();
    node.restart();
    let mut ctx = pool.context().unwrap();
    ctx.set(b"after", b"the restart").unwrap();
    assert_writes_may_be_lost(ctx.flush(), &node.addr());
    ctx.flush().expect("reported once");
    assert_eq!(ctx.get(b"after").unwrap().as_deref(), Some(&b"the restart"[..]));
}

/// A context whose connection the server's idle timeout closed, noticed (a flush after it
/// succeeds: the same server runs), then a write on a new connection that the idle timeout
/// closes too, `kill -9` and a restart: the first flush after it fails, once.
#[test]
fn a_restart_after_an_idle_close_fails_the_next_flush_once() {
    let mut node = KuraNode::start(&["--sync", "never", "--idle-timeout-s", "1"]);
    let pool = pool_of(&[&node], "");
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"1").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    ctx.set(b"k", b"2").expect("the idle close noticed, a new connection");
    ctx.flush().expect("the same server: nothing lost");
    ctx.set(b"k", b"3").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    node.kill();
    node.restart();
    assert_writes_may_be_lost(ctx.flush(), &node.addr());
    ctx.flush().expect("reported once");
    assert_eq!(ctx.io_stats().disconnects, 2, "{:?}", ctx.io_stats());
}

/// A write acknowledged, a flush that times out (the server stopped with `kill -STOP`), then
/// `kill -9` and a restart: the next flush fails, once. (Counting broken connections, the
/// timed-out flush took the count, and the next one succeeded with the write gone.)
#[test]
fn a_restart_after_a_timed_out_flush_fails_the_next_flush_once() {
    let mut node = KuraNode::start(&["--sync", "never"]);
    let pool = impatient_pool(&node.url());
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"acknowledged").unwrap();
    node.signal("STOP");
    let e = ctx.flush().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    node.kill();
    node.restart();
    assert_writes_may_be_lost(ctx.flush(), &node.addr());
    ctx.flush().expect("reported once");
}

/// Connections the server closed for idleness, with the same server running: nothing was
/// lost, and no flush says so (counting broken connections, both flushes failed).
#[test]
fn connections_closed_by_the_idle_timeout_do_not_fail_the_flush() {
    let node = KuraNode::start(&["--idle-timeout-s", "1"]);
    let pool = pool_of(&[&node], "");
    let (mut ctx, mut other) = (pool.context().unwrap(), pool.context().unwrap());
    ctx.set(b"k", b"1").unwrap();
    ctx.flush().unwrap();
    other.flush().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    ctx.set(b"k", b"2").unwrap();
    ctx.flush().unwrap();
    other.flush().unwrap();
    for stats in [ctx.io_stats(), other.io_stats()] {
        assert_eq!((stats.connects, stats.disconnects), (2, 1), "{stats:?}");
    }
    assert_eq!(other.get(b"k").unwrap().as_deref(), Some(&b"2"[..]));
}

/// A request that timed out (the server stopped with `kill -STOP`) closes its connection;
/// the server goes on (`kill -CONT`) as the same process, so the next flush succeeds.
#[test]
fn a_request_timeout_without_a_restart_does_not_fail_the_flush() {
    let node = KuraNode::start(&["--sync", "never"]);
    let pool = impatient_pool(&node.url());
    let mut ctx = pool.context().unwrap();
    ctx.set(b"k", b"1").unwrap();
    time_out_a_get(&mut ctx, |signal| node.signal(signal));
    ctx.flush().unwrap();
    assert_eq!(ctx.get(b"k").unwrap().as_deref(), Some(&b"1"[..]));
}

/// A `kura-server -s PATH` on a Unix socket in `dir`, once it accepts connections.
fn start_on_socket(dir: &std::path::Path, extra: &[&str]) -> kura_testkit::ChildGuard {
    let socket = dir.join("kura.sock");
    let mut cmd = std::process::Command::new(common::kura_server_bin());
    cmd.arg("-s").arg(&socket).args(["--size", "64M", "-I", "64k", "-t", "1", "-m", "8", "--path"]).arg(dir.join("store.kura")).args(extra).env("RUST_LOG", "warn");
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let child = kura_testkit::ChildGuard::spawn("kura-server -s", &mut cmd).unwrap();
    wait_for(|| std::os::unix::net::UnixStream::connect(&socket).ok());
    child
}

/// A node on a Unix socket (`kura:///PATH`): the common scenario, its flush surviving
/// SIGKILL, and the context noticing the restart on its idle connection.
#[test]
fn a_server_on_a_unix_socket_serves_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_on_socket(dir.path(), &["--sync", "never"]);
    let url = format!("kura://{}", dir.path().join("kura.sock").display());
    let mut config = PoolConfig::from_urls(&[url]).unwrap();
    config.request_timeout = Duration::from_secs(5);
    let pool = Pool::open(config).unwrap();
    common::exercise(&pool, true);
    let mut ctx = pool.context().unwrap();
    let items: Vec<_> = (0..200).map(|i| (block_key(9, i), value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    ctx.flush().unwrap();
    server.child_mut().kill().unwrap();
    server.child_mut().wait().unwrap();
    let _server = start_on_socket(dir.path(), &[]);
    let keys: Vec<_> = (0..200).map(|i| block_key(9, i)).collect();
    for (i, value) in ctx.get_many(&keys).unwrap().into_iter().enumerate() {
        assert_eq!(value.unwrap(), Some(value_of(i as u64)), "key {i} lost");
    }
}
