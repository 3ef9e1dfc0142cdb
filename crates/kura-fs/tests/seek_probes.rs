//! `SEEK_DATA`/`SEEK_HOLE` over a real memcached: the file system asks the pool only which
//! chunks exist (`mg <key>`, answered `HD`/`EN`), so finding the holes of a file does not
//! move its data — memcached's own `bytes_written` shows it. Chunks written with zeros, by
//! write-back or directly, are holes (deleted, not stored). Without `memcached` the test skips.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kura_fs::{Fs, FsConfig, Owner, PoolKv, WriteMode};
use kura_pool::{Pool, PoolConfig};
use kura_testkit::{memcache_stat, require_cmd, spawn_listening, try_or_skip};

const CHUNK_BYTES: u64 = 4096;
const MIB: u64 = 1 << 20;

#[test]
fn seek_finds_holes_without_reading_the_data() {
    let bin = try_or_skip!(require_cmd("memcached"));
    let (_memcached, port) = spawn_listening("memcached", Duration::from_secs(20), |port| {
        let mut cmd = Command::new(&bin);
        cmd.args(["-p", &port.to_string(), "-l", "127.0.0.1", "-U", "0", "-m", "64", "-u", "root"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        cmd
    })
    .expect("start memcached");
    let pool = Pool::open(PoolConfig::from_urls(&[format!("memcached://127.0.0.1:{port}")]).unwrap()).unwrap();
    let fs = Fs::open(Arc::new(PoolKv::new(pool).unwrap()), FsConfig { name: "seek".into(), ..FsConfig::default() }, Owner { uid: 0, gid: 0 }).unwrap();
    let (inode, _) = fs.create(kura_fs::ROOT_INO, b"sparse", libc::S_IFREG | 0o644, 0, b"", Owner { uid: 0, gid: 0 }, true).unwrap();
    let node = fs.open_node(&inode).unwrap();
    // 8 MiB of data, a hole to 12 MiB, 1 MiB of data, 1 MiB written as zeros (buffered) and
    // 64 KiB written as zeros around the cache, then data to 16 MiB.
    fs.write(&node, 0, &vec![0xa5; 8 * MIB as usize], WriteMode::Buffered).unwrap();
    fs.write(&node, 12 * MIB, &vec![0x5a; MIB as usize], WriteMode::Buffered).unwrap();
    fs.write(&node, 13 * MIB, &vec![0; MIB as usize], WriteMode::Buffered).unwrap();
    fs.write(&node, 14 * MIB, &vec![0x33; 2 * MIB as usize], WriteMode::Buffered).unwrap();
    fs.fsync(&node).unwrap();
    fs.write(&node, 15 * MIB, &vec![0; 64 << 10], WriteMode::Direct).unwrap();

    let before = memcache_stat(port, "bytes_written");
    let seek = |offset: u64, hole: bool| fs.seek_data_or_hole(&node, offset as i64, hole).unwrap();
    let mut extents = Vec::new();
    let mut at = 0;
    while let Some(data) = seek(at, false) {
        let hole = seek(data, true).expect("the end of the file is a hole");
        extents.push((data, hole));
        at = hole;
    }
    let sent = memcache_stat(port, "bytes_written") - before;
    assert_eq!(extents, vec![(0, 8 * MIB), (12 * MIB, 13 * MIB), (14 * MIB, 15 * MIB), (15 * MIB + (64 << 10), 16 * MIB)]);
    assert_eq!(seek(5 * CHUNK_BYTES + 7, false), Some(5 * CHUNK_BYTES + 7), "inside data, SEEK_DATA stays");
    assert_eq!(seek(9 * MIB, true), Some(9 * MIB), "inside a hole, SEEK_HOLE stays");
    assert_eq!(seek(16 * MIB, false), None, "past the end");
    // The probes walk 16 MiB (4096 chunks): `HD`/`EN` each, the inode's record and the `stats`
    // reply. Reading the chunks would send 12 MiB.
    assert!(sent < 256 << 10, "memcached sent {sent} bytes to find the holes of 12 MiB of data");
    fs.release(&node).unwrap();
}
