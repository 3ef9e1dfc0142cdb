//! Redis: one redis-server, a master with a replica (the flush's `WAIT`), and a Redis
//! Cluster of three masters with a replica each, losing a master after a flush.

mod common;

use std::time::{Duration, Instant};

use common::{Redis, RedisCluster, redis_cli, value_of};
use kura_pool::{Error, Pool, PoolConfig, block_key, cluster_slot};
use kura_testkit::try_or_skip;

#[test]
fn one_redis_serves_the_common_scenario() {
    let server = try_or_skip!(Redis::start(&[]));
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    let stats = common::exercise(&pool, true);
    assert!(stats.requests_per_send() > 4.0 && stats.replies_per_recv() > 2.0, "{stats:?}");
}

#[test]
fn a_flush_waits_for_the_replica() {
    let master = try_or_skip!(Redis::start(&[]));
    let replica = try_or_skip!(Redis::start(&["--replicaof", "127.0.0.1", &master.port.to_string()]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !redis_cli(master.port, &["info", "replication"]).contains("state=online") {
        assert!(Instant::now() < deadline, "the replica did not connect");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pool = Pool::open(PoolConfig::from_urls(&[format!("{}?replicas=1", master.url())]).unwrap()).unwrap();
    let mut ctx = pool.context().unwrap();
    // Writes from another context: the flush covers every write the master acknowledged.
    let items: Vec<_> = (0..200).map(|i| (block_key(1, i), value_of(i))).collect();
    pool.context().unwrap().set_many(&items).unwrap();
    ctx.flush().unwrap();
    let replica_pool = Pool::open(PoolConfig::from_urls(&[replica.url()]).unwrap()).unwrap();
    let keys: Vec<_> = (0..200).map(|i| block_key(1, i)).collect();
    for (i, v) in replica_pool.context().unwrap().get_many(&keys).unwrap().into_iter().enumerate() {
        assert_eq!(v.unwrap(), Some(value_of(i as u64)), "key {i} not on the replica after the flush");
    }
    // Asking for more replicas than there are: the flush says so (after the WAIT timeout).
    let mut config = PoolConfig::from_urls(&[format!("{}?replicas=2", master.url())]).unwrap();
    config.wait_timeout = Duration::from_millis(200);
    let e = Pool::open(config).unwrap().context().unwrap().flush().unwrap_err();
    assert!(matches!(e, Error::FlushIncomplete { acked: 1, wanted: 2, .. }), "{e}");
}

#[test]
fn cluster_routes_by_slot_and_survives_losing_a_master_after_a_flush() {
    let mut cluster = try_or_skip!(RedisCluster::start());
    let mut config = PoolConfig::from_urls(&[cluster.seed_url()]).unwrap();
    config.request_timeout = Duration::from_secs(20);
    config.connect_timeout = Duration::from_millis(500);
    let pool = Pool::open(config).unwrap();
    let stats = common::exercise(&pool, true);
    assert!(stats.requests_per_send() > 2.0, "{stats:?}");

    let mut ctx = pool.context().unwrap();
    const KEYS: u64 = 600;
    let items: Vec<_> = (0..KEYS).map(|i| (block_key(2, i), value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    ctx.flush().expect("every master's writes on a replica");

    // Kill the master of the first key's slot: a third of the keys lose their master.
    let masters = cluster.master_ports();
    assert_eq!(masters.len(), 3, "{masters:?}");
    let slot = cluster_slot(&block_key(2, 0));
    let victim = masters
        .iter()
        .copied()
        .find(|&port| redis_cli(port, &["cluster", "countkeysinslot", &slot.to_string()]).trim() != "0")
        .expect("the master of the slot");
    cluster.node_mut(victim).kill();

    // Everything reads back once a replica has taken over (the reads wait for it).
    let keys: Vec<_> = (0..KEYS).map(|i| block_key(2, i)).collect();
    let started = Instant::now();
    for (i, v) in ctx.get_many(&keys).unwrap().into_iter().enumerate() {
        assert_eq!(v.unwrap(), Some(value_of(i as u64)), "key {i} after the fail-over");
    }
    eprintln!("read back after the fail-over in {:?}: {:?}", started.elapsed(), ctx.io_stats());
    // Existence probes are routed by slot as gets are: every key written, none other.
    let probed: Vec<_> = (0..2 * KEYS).map(|i| block_key(2, i)).collect();
    let found: Vec<bool> = ctx.exists_many(&probed).unwrap().into_iter().map(Result::unwrap).collect();
    assert_eq!(found, (0..2 * KEYS).map(|i| i < KEYS).collect::<Vec<_>>(), "EXISTS through the cluster");
    assert!(ctx.io_stats().redirects > 0 || ctx.io_stats().topology_refreshes > 1, "{:?}", ctx.io_stats());
    // Writes go to the new master; a new context finds it from the seeds.
    ctx.set(&block_key(2, 0), b"after").unwrap();
    let mut fresh = pool.context().unwrap();
    assert_eq!(fresh.get(&block_key(2, 0)).unwrap().as_deref(), Some(&b"after"[..]));
    // The promoted master has no replica now: a flush that wants one says so. (Once every
    // live node agrees the cluster is up again: for a moment after the fail-over, a node can
    // still answer the flush's scratch write with CLUSTERDOWN, which fails the flush too, but
    // with that error instead.)
    cluster.wait_ok(Duration::from_secs(30)).unwrap();
    let e = fresh.flush().unwrap_err();
    assert!(matches!(e, Error::FlushIncomplete { acked: 0, .. }), "{e}");
}

#[test]
fn cluster_moved_and_ask_redirections() {
    let cluster = try_or_skip!(RedisCluster::start());
    let pool = Pool::open(PoolConfig::from_urls(&[cluster.seed_url()]).unwrap()).unwrap();
    let mut ctx = pool.context().unwrap();
    let key = block_key(3, 1);
    ctx.set(&key, b"v1").unwrap();
    // Move the key's slot to another master behind the context's back.
    let slot = cluster_slot(&key).to_string();
    let masters = cluster.master_ports();
    let owner = *masters.iter().find(|&&p| redis_cli(p, &["cluster", "countkeysinslot", &slot]).trim() == "1").unwrap();
    let target = *masters.iter().find(|&&p| p != owner).unwrap();
    let id = |port: u16| redis_cli(port, &["cluster", "myid"]).trim().to_owned();
    let (owner_id, target_id) = (id(owner), id(target));
    // Migrating: the context still asks the owner, which answers ASK for a key not there.
    assert_eq!(redis_cli(target, &["cluster", "setslot", &slot, "importing", &owner_id]).trim(), "OK");
    assert_eq!(redis_cli(owner, &["cluster", "setslot", &slot, "migrating", &target_id]).trim(), "OK");
    let other = {
        let mut n = 0u64;
        loop {
            let k = block_key(3, 1000 + n);
            if cluster_slot(&k) == cluster_slot(&key) {
                break k;
            }
            n += 1;
        }
    };
    ctx.set(&other, b"asked").unwrap();
    assert!(ctx.io_stats().redirects >= 1, "{:?}", ctx.io_stats());
    assert_eq!(ctx.get(&other).unwrap().as_deref(), Some(&b"asked"[..]));
    // Finish the move: MIGRATE the old key, assign the slot everywhere; the context follows MOVED.
    let out = redis_cli(owner, &["migrate", "127.0.0.1", &target.to_string(), "", "0", "5000", "keys", std::str::from_utf8(&key).unwrap()]);
    assert!(out.contains("OK"), "{out}");
    for node in &cluster.nodes {
        redis_cli(node.port, &["cluster", "setslot", &slot, "node", &target_id]);
    }
    let before = ctx.io_stats().redirects;
    assert_eq!(ctx.get(&key).unwrap().as_deref(), Some(&b"v1"[..]));
    assert!(ctx.io_stats().redirects > before, "{:?}", ctx.io_stats());
    assert_eq!(ctx.get(&key).unwrap().as_deref(), Some(&b"v1"[..]));
}

/// Redis' `run_id` names its instance: a restart while no connection was open fails the next
/// flush once.
#[test]
fn a_restart_fails_the_next_flush_once() {
    let mut server = try_or_skip!(Redis::start(&[]));
    let pool = Pool::open(PoolConfig::from_urls(&[server.url()]).unwrap()).unwrap();
    let mut writer = pool.context().unwrap();
    writer.set(b"k", b"1").unwrap();
    writer.flush().unwrap();
    drop(writer);
    server.restart();
    let mut ctx = pool.context().unwrap();
    common::assert_writes_may_be_lost(ctx.flush(), &format!("127.0.0.1:{}", server.port));
    ctx.flush().expect("reported once");
}
