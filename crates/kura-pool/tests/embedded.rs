//! The embedded backend: the engine in this process, through the pool interface.

mod common;

use kura_pool::{Error, Outcome, Pool, PoolConfig, block_key};

fn config(dir: &std::path::Path) -> PoolConfig {
    let mut config = PoolConfig::embedded(&dir.join("pool.kura"), 256 << 20);
    config.engine.block_size_bytes = 1 << 20;
    config.engine.direct_io = false;
    config.value_size_max_bytes = 64 << 10;
    config
}

#[test]
fn the_common_scenario() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::open(config(dir.path())).unwrap();
    // Recent writes are answered from the engine's RAM buffers: no flash reads to count.
    common::exercise(&pool, true);
}

/// A context another thread keeps waking (as the FUSE export's threads wake the one driving
/// a shared queue) still returns every read right: a wake-up only ends a wait early.
#[test]
fn wake_ups_end_waits_without_losing_reads() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::open(config(dir.path())).unwrap();
    let mut ctx = pool.context().unwrap();
    let items: Vec<_> = (0..2000).map(|i| (block_key(4, i), common::value_of(i))).collect();
    ctx.set_many(&items).unwrap();
    ctx.flush().unwrap();
    drop(ctx);
    // Reopened, so the reads go to the file through io_uring.
    drop(pool);
    let pool = Pool::open(config(dir.path())).unwrap();
    let mut ctx = pool.context().unwrap();
    let waker = ctx.waker().unwrap().expect("an embedded context on a file can be woken");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let waking = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                waker.wake();
                sent += 1;
                std::thread::yield_now();
            }
            sent
        })
    };
    let keys: Vec<_> = (0..2000).map(|i| block_key(4, i)).collect();
    for _ in 0..5 {
        for (i, got) in ctx.get_many(&keys).unwrap().into_iter().enumerate() {
            assert_eq!(got.unwrap().as_deref(), Some(&common::value_of(i as u64)[..]), "key {i}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(waking.join().unwrap() > 0);
    assert!(ctx.io_stats().replies_received > 0, "the reads went to the file");
}

#[test]
fn flushed_writes_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    {
        let pool = Pool::open(config(dir.path())).unwrap();
        let mut ctx = pool.context().unwrap();
        let items: Vec<_> = (0..500).map(|i| (block_key(2, i), common::value_of(i))).collect();
        ctx.set_many(&items).unwrap();
        ctx.delete(&block_key(2, 7)).unwrap();
        ctx.flush().unwrap();
    }
    let pool = Pool::open(config(dir.path())).unwrap();
    let mut ctx = pool.context().unwrap();
    let keys: Vec<_> = (0..500).map(|i| block_key(2, i)).collect();
    for (i, got) in ctx.get_many(&keys).unwrap().into_iter().enumerate() {
        let want = (i != 7).then(|| common::value_of(i as u64));
        assert_eq!(got.unwrap(), want, "key {i}");
    }
}

#[test]
fn many_reads_in_flight_on_one_thread_and_contexts_on_many() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::open(config(dir.path())).unwrap();
    let items: Vec<_> = (0..2000).map(|i| (block_key(3, i), common::value_of(i))).collect();
    pool.context().unwrap().set_many(&items).unwrap();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let pool = pool.clone();
            s.spawn(move || {
                let mut ctx = pool.context().unwrap();
                for i in 0..64 {
                    ctx.submit_get(&block_key(3, t * 1000 + i), t * 1000 + i).unwrap();
                }
                assert_eq!(ctx.in_flight(), 64);
                let mut seen = 0;
                while ctx.in_flight() > 0 {
                    ctx.poll(None, &mut |c| {
                        assert_eq!(c.result.unwrap(), Outcome::Value(&common::value_of(c.token)));
                        seen += 1;
                    })
                    .unwrap();
                }
                assert_eq!(seen, 64);
            });
        }
    });
}

#[test]
fn limits_are_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.in_flight_max = 4;
    let pool = Pool::open(config).unwrap();
    let mut ctx = pool.context().unwrap();
    for i in 0..4 {
        ctx.submit_set(&block_key(0, i), b"x", i).unwrap();
    }
    assert!(matches!(ctx.submit_get(b"k", 9), Err(Error::QueueFull { max: 4 })));
    assert!(matches!(ctx.submit_flush(9), Err(Error::QueueFull { max: 4 })));
    let mut n = 0;
    while ctx.in_flight() > 0 {
        n += ctx.poll(None, &mut |c| assert!(c.result.is_ok())).unwrap();
    }
    assert_eq!(n, 4);
    assert!(matches!(ctx.set(b"k", &vec![0u8; (64 << 10) + 1]), Err(Error::ValueTooLarge { .. })));
    // Nothing in flight: a poll returns at once.
    assert_eq!(ctx.poll(None, &mut |_| panic!("nothing was in flight")).unwrap(), 0);
}
