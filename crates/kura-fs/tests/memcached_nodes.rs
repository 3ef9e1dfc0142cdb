//! [`PoolKv`]'s metadata calls on real memcached servers (`memcached://` nodes): a batch of
//! versioned gets spread over two nodes goes out pipelined, one write per node, and answers
//! exactly as the same gets one by one — values, versions, missing keys — and the
//! connection stays usable after it; a batch of conditional writes decides each as the same
//! writes one by one; `statfs` reports the nodes' room (`limit_maxbytes`,
//! `bytes`). Without `memcached` the tests skip.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kura_fs::{Cond, Fs, FsConfig, Kv, Owner, PoolKv};
use kura_pool::{Pool, PoolConfig};
use kura_testkit::{ChildGuard, require_cmd, spawn_listening};

const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A memcached with 64 MiB on a free port; killed when dropped.
fn memcached() -> Option<(ChildGuard, u16)> {
    memcached_with_mb(64)
}

fn memcached_with_mb(memory_mb: u32) -> Option<(ChildGuard, u16)> {
    memcached_with(memory_mb, &[])
}

fn memcached_with(memory_mb: u32, extra: &[&str]) -> Option<(ChildGuard, u16)> {
    let bin = match require_cmd("memcached") {
        Ok(bin) => bin,
        Err(reason) => {
            kura_testkit::skip(&reason);
            return None;
        }
    };
    let started = spawn_listening("memcached", START_TIMEOUT, |port| {
        let mut cmd = Command::new(&bin);
        cmd.args(["-p", &port.to_string(), "-l", "127.0.0.1", "-U", "0", "-m", &memory_mb.to_string(), "-u", "root"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    });
    Some(started.expect("start memcached"))
}

/// A pool of the two memcached nodes `a` and `b`.
fn two_nodes(a: &(ChildGuard, u16), b: &(ChildGuard, u16)) -> PoolKv {
    let urls = [format!("memcached://127.0.0.1:{}", a.1), format!("memcached://127.0.0.1:{}", b.1)];
    let pool = Pool::open(PoolConfig::from_urls(&urls).expect("pool urls")).expect("open pool");
    PoolKv::new(pool).expect("memcached nodes are accepted")
}

#[test]
fn batched_versioned_gets_over_two_nodes_match_single_gets() {
    let (Some(a), Some(b)) = (memcached(), memcached()) else { return };
    let kv = two_nodes(&a, &b);
    // Every third key is never written; the others hold values of growing length (up to one
    // larger than the metadata connection's read buffer).
    let keys: Vec<Vec<u8>> = (0..300).map(|i| format!("batch/key/{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate().filter(|(i, _)| i % 3 != 0) {
        let value = vec![i as u8; i * 40];
        kv.put_cond(key, &value, Cond::Always).expect("put").expect("an unconditional put is written");
    }
    let nodes: std::collections::HashSet<_> = keys.iter().map(|k| kv.pool().node_of(k).addrs[0].clone()).collect();
    assert_eq!(nodes.len(), 2, "the keys are spread over both nodes");
    let batched = kv.get_versioned_many(&keys).expect("batched get");
    let single: Vec<_> = keys.iter().map(|k| kv.get_versioned(k).expect("get")).collect();
    assert_eq!(batched, single);
    for (i, got) in batched.iter().enumerate() {
        match got {
            None => assert_eq!(i % 3, 0, "key {i} is missing"),
            Some((value, version)) => {
                assert_ne!(i % 3, 0, "key {i} was never written");
                assert_eq!(value, &vec![i as u8; i * 40]);
                assert_ne!(*version, 0);
            }
        }
    }
    // The versions are the ones a compare-and-swap takes.
    let (key, (_, version)) = keys.iter().zip(&batched).find_map(|(k, v)| Some((k, v.clone()?))).expect("a stored key");
    assert!(kv.put_cond(key, b"new", Cond::Version(version)).expect("cas").is_some());
    assert!(kv.put_cond(key, b"newer", Cond::Version(version)).expect("cas").is_none(), "a stale version fails");
    assert!(kv.get_versioned_many(&[]).expect("an empty batch").is_empty());
}

/// A batch of conditional writes over two nodes (pipelined per run of one node) decides each
/// write as the same writes one by one decide them, on a twin set of keys.
#[test]
fn batched_writes_over_two_nodes_match_single_writes() {
    use kura_fs::kv::WriteOp;
    let (Some(a), Some(b)) = (memcached(), memcached()) else { return };
    let kv = two_nodes(&a, &b);
    let twins = ["batched", "single"];
    let key = |twin: &str, i: usize| format!("write/{twin}/{i}").into_bytes();
    // Keys 0..10 hold a value first; 10..20 do not.
    let mut versions = Vec::new();
    for twin in twins {
        versions.push((0..10).map(|i| kv.put_cond(&key(twin, i), b"first", Cond::Always).unwrap().unwrap()).collect::<Vec<_>>());
    }
    let outcomes = |twin: usize, batched: bool| {
        let keys: Vec<Vec<u8>> = (0..20).map(|i| key(twins[twin], i)).collect();
        let v = &versions[twin];
        let writes = [
            WriteOp::Put(&keys[0], b"cas right", Cond::Version(v[0])),
            WriteOp::Put(&keys[1], b"cas stale", Cond::Version(v[1] + 1000)),
            WriteOp::Put(&keys[2], b"add over a value", Cond::Absent),
            WriteOp::Put(&keys[10], b"add", Cond::Absent),
            WriteOp::Delete(&keys[3], Cond::Version(v[3])),
            WriteOp::Delete(&keys[4], Cond::Version(v[4] + 1000)),
            WriteOp::Delete(&keys[11], Cond::Always),
            WriteOp::Put(&keys[5], b"always", Cond::Always),
            WriteOp::Delete(&keys[6], Cond::Always),
        ];
        let results = if batched { kv.write_many(&writes).unwrap() } else { writes.iter().map(|w| w.apply(&kv).unwrap()).collect() };
        let decided: Vec<bool> = results.iter().map(Option::is_some).collect();
        let stored: Vec<Option<Vec<u8>>> = keys.iter().map(|k| kv.get_versioned(k).unwrap().map(|(value, _)| value)).collect();
        (decided, stored)
    };
    let nodes: std::collections::HashSet<_> = (0..20).map(|i| kv.pool().node_of(&key("batched", i)).addrs[0].clone()).collect();
    assert_eq!(nodes.len(), 2, "the keys are spread over both nodes");
    let (batched, single) = (outcomes(0, true), outcomes(1, false));
    assert_eq!(batched, single);
    assert_eq!(batched.0, [true, false, false, true, true, false, true, true, true]);
    // The connection serves the next request.
    assert!(kv.get_versioned(&key("batched", 0)).unwrap().is_some_and(|(value, _)| value == b"cas right"));
}

#[test]
fn a_file_system_opens_and_formats_through_batched_gets() {
    let (Some(a), Some(b)) = (memcached(), memcached()) else { return };
    let open = || {
        let kv = Arc::new(two_nodes(&a, &b));
        Fs::open(kv, FsConfig { name: "batched".into(), ..FsConfig::default() }, Owner { uid: 1000, gid: 1000 }).expect("open")
    };
    let fs = open();
    let root = fs.getattr(kura_fs::ROOT_INO).expect("the new file system has a root");
    assert_eq!(root.mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!((root.uid, root.gid), (1000, 1000));
    fs.create(kura_fs::ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, b"", Owner { uid: 1000, gid: 1000 }, true).expect("create");
    drop(fs);
    // A second process: the existing root is kept, not formatted again.
    let again = open();
    let names: Vec<_> = again.readdir(kura_fs::ROOT_INO).expect("readdir").into_iter().map(|e| e.name).filter(|n| n != b"." && n != b"..").collect();
    assert_eq!(names, vec![b"f".to_vec()]);
}

#[test]
fn statfs_reports_the_room_of_the_nodes() {
    let (Some(a), Some(b)) = (memcached_with_mb(64), memcached_with_mb(32)) else { return };
    let kv = Arc::new(two_nodes(&a, &b));
    let fs = Fs::open(kv, FsConfig { name: "space".into(), ..FsConfig::default() }, Owner { uid: 0, gid: 0 }).expect("open");
    let s = fs.statfs().expect("statfs");
    let chunk = s.f_frsize as u64;
    assert_eq!(s.f_blocks * chunk, 96 << 20, "both nodes' -m, summed");
    assert!(s.f_bfree <= s.f_blocks && s.f_bfree * chunk > 95 << 20, "almost all free: {} of {}", s.f_bfree, s.f_blocks);
    // Keys spread evenly: the 32 MiB node is full when 64 MiB are written.
    assert!(s.f_bavail * chunk <= 64 << 20 && s.f_bavail * chunk > 63 << 20, "available {} chunks", s.f_bavail);
    assert_eq!((s.f_files, s.f_ffree), (0, 0));
    // A memcached that is gone: statfs (looked up again after the cache's second) is an error.
    drop(b);
    std::thread::sleep(Duration::from_millis(kura_fs::ns::STATFS_CACHE_MS + 100));
    assert!(fs.statfs().is_err(), "a node that does not answer fails statfs");
}

/// A memcached that makes clients authenticate (`-Y`): the file system's own metadata
/// connections authenticate with the URL's credentials, as the pool's do, and a file system
/// formats, creates and lists on it; without them, opening it fails with the reason.
#[test]
fn a_node_that_asks_for_credentials_gets_the_urls() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    std::fs::write(&users, "fs:pw\n").unwrap();
    let Some(node) = memcached_with(64, &["-Y", users.to_str().unwrap()]) else { return };
    let open = |url: String| -> Result<Arc<Fs>, String> {
        let pool = Pool::open(PoolConfig::from_urls(&[url]).expect("pool url")).map_err(|e| e.to_string())?;
        let kv = Arc::new(PoolKv::new(pool).map_err(|e| e.to_string())?);
        Fs::open(kv, FsConfig { name: "auth".into(), ..FsConfig::default() }, Owner { uid: 0, gid: 0 }).map_err(|e| e.to_string())
    };
    let fs = open(format!("memcached://fs:pw@127.0.0.1:{}", node.1)).expect("open with credentials");
    fs.create(kura_fs::ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, b"", Owner { uid: 0, gid: 0 }, true).expect("create");
    let names: Vec<_> = fs.readdir(kura_fs::ROOT_INO).expect("readdir").into_iter().map(|e| e.name).filter(|n| n != b"." && n != b"..").collect();
    assert_eq!(names, vec![b"f".to_vec()]);
    // In another thread too: this one's metadata connections are per node and credentials.
    for url in [format!("memcached://127.0.0.1:{}", node.1), format!("memcached://fs:wrong@127.0.0.1:{}", node.1)] {
        let Err(e) = open(url.clone()) else { panic!("{url}: opened without the right credentials") };
        assert!(e.contains("authenticat"), "{e}");
        let Err(e) = std::thread::scope(|s| s.spawn(|| open(url.clone())).join().unwrap()) else { panic!("{url}: opened without the right credentials") };
        assert!(e.contains("authenticat"), "{e}");
    }
}

/// Two memcached nodes that speak only TLS and want client certificates (`-Z`,
/// `ssl_verify_mode=2`), reached as `memcached+tls://` with the CA and a client certificate:
/// the pool's connections and the file system's own metadata connections (compare-and-swap,
/// locks) all speak TLS; files written by one file system are read back by a second.
#[test]
fn a_file_system_on_tls_nodes() {
    let certs = match kura_testkit::TestCerts::make() {
        Ok(certs) => certs,
        Err(reason) => return kura_testkit::skip(&reason),
    };
    let options = format!("ssl_chain_cert={},ssl_key={},ssl_ca_cert={},ssl_verify_mode=2", certs.arg("server.pem"), certs.arg("server-key.pem"), certs.arg("ca.pem"));
    let tls = ["-Z", "-o", options.as_str()];
    let (Some(a), Some(b)) = (memcached_with(64, &tls), memcached_with(64, &tls)) else { return };
    let query = format!("ca={}&cert={}&key={}", certs.arg("ca.pem"), certs.arg("client.pem"), certs.arg("client-key.pem"));
    let open = || {
        let urls = [format!("memcached+tls://localhost:{}?{query}", a.1), format!("memcached+tls://localhost:{}?{query}", b.1)];
        let pool = Pool::open(PoolConfig::from_urls(&urls).expect("pool urls")).expect("open pool");
        let kv = Arc::new(PoolKv::new(pool).expect("memcached nodes are accepted"));
        Fs::open(kv, FsConfig { name: "tls".into(), ..FsConfig::default() }, Owner { uid: 0, gid: 0 }).expect("open over TLS")
    };
    // A pipelined batch of metadata gets and writes far larger than a TLS record.
    {
        let urls = [format!("memcached+tls://localhost:{}?{query}", a.1), format!("memcached+tls://localhost:{}?{query}", b.1)];
        let kv = PoolKv::new(Pool::open(PoolConfig::from_urls(&urls).expect("pool urls")).expect("open pool")).expect("memcached nodes");
        let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("batch/{}/{i}", "k".repeat(100)).into_bytes()).collect();
        for (i, key) in keys.iter().enumerate().filter(|(i, _)| i % 3 != 0) {
            kv.put_cond(key, &vec![i as u8; i % 300 * 40], Cond::Always).expect("put").expect("written");
        }
        let batched = kv.get_versioned_many(&keys).expect("batched get over TLS");
        for (i, got) in batched.iter().enumerate() {
            assert_eq!(got.as_ref().map(|(value, _)| value.clone()), (i % 3 != 0).then(|| vec![i as u8; i % 300 * 40]), "key {i}");
        }
    }
    let owner = Owner { uid: 0, gid: 0 };
    let fs = open();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    for name in [&b"a"[..], b"b", b"c"] {
        let (inode, _) = fs.create(kura_fs::ROOT_INO, name, libc::S_IFREG | 0o644, 0, b"", owner, true).expect("create");
        let node = fs.open_node_created(&inode).expect("open");
        fs.write(&node, 0, &data, kura_fs::WriteMode::Buffered).expect("write");
        fs.fsync(&node).expect("fsync");
        fs.release(&node).expect("close");
    }
    fs.rename(kura_fs::ROOT_INO, b"c", kura_fs::ROOT_INO, b"d", kura_fs::RenameFlags::default()).expect("rename");
    drop(fs);
    let again = open();
    let mut names: Vec<_> = again.readdir(kura_fs::ROOT_INO).expect("readdir").into_iter().map(|e| e.name).filter(|n| n != b"." && n != b"..").collect();
    names.sort();
    assert_eq!(names, [b"a".to_vec(), b"b".to_vec(), b"d".to_vec()]);
    let (_, inode) = again.lookup_inode(kura_fs::ROOT_INO, b"d").expect("lookup").expect("d exists");
    assert_eq!(inode.size, data.len() as u64);
    let node = again.open_node_reading(&inode).expect("open");
    let mut back = vec![0u8; data.len()];
    let mut at = 0;
    while at < back.len() {
        let n = again.read(&node, at as u64, &mut back[at..]).expect("read");
        assert!(n > 0, "short file");
        at += n;
    }
    assert!(back == data, "the file came back changed");
    again.release(&node).expect("close");
}
