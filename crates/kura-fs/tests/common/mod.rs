//! What the file system's tests over real pools share: memcached nodes, an embedded engine,
//! and a store that counts the calls that cost a round trip.
#![allow(dead_code)] // each test file uses its own part

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kura_fs::kv::{Versioned, WriteOp};
use kura_fs::{Cond, Kv, PoolKv, PoolSpace};
use kura_pool::{Pool, PoolConfig};
use kura_testkit::{require_cmd, spawn_listening};

/// The pool's store, passed through, with every call that costs a round trip counted: reads
/// and writes apart.
pub struct Counted {
    inner: Arc<dyn Kv>,
    reads: AtomicU64,
    writes: AtomicU64,
}

impl Counted {
    pub fn new(inner: Arc<dyn Kv>) -> Self {
        Self { inner, reads: AtomicU64::new(0), writes: AtomicU64::new(0) }
    }
    /// (reads, writes) so far.
    pub fn calls(&self) -> (u64, u64) {
        (self.reads.load(Ordering::SeqCst), self.writes.load(Ordering::SeqCst))
    }
    /// Reads so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }
    fn read(&self) {
        self.reads.fetch_add(1, Ordering::SeqCst);
    }
    fn write(&self) {
        self.writes.fetch_add(1, Ordering::SeqCst);
    }
}

impl Kv for Counted {
    fn get_versioned(&self, key: &[u8]) -> kura_fs::Result<Option<(Vec<u8>, u64)>> {
        self.read();
        self.inner.get_versioned(key)
    }
    fn put_cond(&self, key: &[u8], value: &[u8], cond: Cond) -> kura_fs::Result<Option<u64>> {
        self.write();
        self.inner.put_cond(key, value, cond)
    }
    fn put_cond_reading(&self, key: &[u8], value: &[u8], cond: Cond, also: &[u8]) -> kura_fs::Result<(Option<u64>, kura_fs::kv::AlsoRead)> {
        self.write();
        self.inner.put_cond_reading(key, value, cond, also)
    }
    fn write_many(&self, writes: &[WriteOp]) -> kura_fs::Result<Vec<Option<u64>>> {
        self.write();
        self.inner.write_many(writes)
    }
    fn delete_cond(&self, key: &[u8], cond: Cond) -> kura_fs::Result<bool> {
        self.write();
        self.inner.delete_cond(key, cond)
    }
    fn get_versioned_many(&self, keys: &[Vec<u8>]) -> kura_fs::Result<Vec<Versioned>> {
        self.read();
        self.inner.get_versioned_many(keys)
    }
    fn get_versioned_in_order(&self, keys: &[Vec<u8>]) -> kura_fs::Result<Vec<Versioned>> {
        self.read();
        self.inner.get_versioned_in_order(keys)
    }
    fn get_meta_many(&self, keys: &[Vec<u8>]) -> kura_fs::Result<Vec<Option<Vec<u8>>>> {
        self.read();
        self.inner.get_meta_many(keys)
    }
    fn get_many(&self, keys: &[Vec<u8>]) -> kura_fs::Result<Vec<Option<Vec<u8>>>> {
        self.read();
        self.inner.get_many(keys)
    }
    fn exists_many(&self, keys: &[Vec<u8>]) -> kura_fs::Result<Vec<bool>> {
        self.read();
        self.inner.exists_many(keys)
    }
    fn get_into(&self, key: &[u8], out: &mut Vec<u8>) -> kura_fs::Result<bool> {
        self.read();
        self.inner.get_into(key, out)
    }
    fn set_many(&self, items: &[(Vec<u8>, Vec<u8>)]) -> kura_fs::Result<()> {
        self.write();
        self.inner.set_many(items)
    }
    fn delete_many(&self, keys: &[Vec<u8>]) -> kura_fs::Result<()> {
        self.write();
        self.inner.delete_many(keys)
    }
    fn flush(&self) -> kura_fs::Result<()> {
        self.inner.flush()
    }
    fn space(&self) -> kura_fs::Result<Option<PoolSpace>> {
        self.inner.space()
    }
}

pub fn memcached_nodes(count: usize) -> Option<(Vec<kura_testkit::ChildGuard>, Arc<dyn Kv>)> {
    let bin = require_cmd("memcached").ok()?;
    let mut children = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..count {
        let (child, port) = spawn_listening("memcached", Duration::from_secs(20), |port| {
            let mut cmd = Command::new(&bin);
            cmd.args(["-p", &port.to_string(), "-l", "127.0.0.1", "-U", "0", "-m", "64", "-u", "root"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
            cmd
        })
        .expect("start memcached");
        children.push(child);
        urls.push(format!("memcached://127.0.0.1:{port}"));
    }
    let pool = Pool::open(PoolConfig::from_urls(&urls).unwrap()).unwrap();
    Some((children, Arc::new(PoolKv::new(pool).unwrap())))
}

pub fn embedded(dir: &std::path::Path) -> Arc<PoolKv> {
    let mut config = PoolConfig::embedded(&dir.join("fs.kura"), 256 << 20);
    config.engine.block_size_bytes = 1 << 20;
    config.engine.direct_io = false;
    config.value_size_max_bytes = 64 << 10;
    Arc::new(PoolKv::new(Pool::open(config).unwrap()).unwrap())
}

/// Runs `check` on `cases` values of `strategy`, each with a file system name of its own
/// (`case0`, `case1`, …), so that the cases can share one pool (a memcached pool is not made
/// again per case).
pub fn run_named_cases<S: proptest::strategy::Strategy>(cases: u32, strategy: &S, check: impl Fn(&str, S::Value) -> Result<(), proptest::test_runner::TestCaseError>) {
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases, ..proptest::test_runner::Config::default() });
    let case = AtomicU64::new(0);
    runner.run(strategy, |value| check(&format!("case{}", case.fetch_add(1, Ordering::SeqCst)), value)).unwrap();
}
