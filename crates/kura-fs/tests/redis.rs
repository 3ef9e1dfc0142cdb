//! The file system on real redis-servers (`redis://` pool nodes): the namespace operations,
//! the stored format (versioned metadata, raw chunks), compare-and-swap with stale versions
//! and after delete-and-recreate, threads and processes racing in one directory (through the
//! API and, mirroring the preload's test, Python processes under `kura fs run`), the flush
//! barrier waiting for a replica, malformed replies, and the refusal of a Redis Cluster.
//!
//! Every test starts its own servers (`--save '' --appendonly no`) on free ports; without
//! `redis-server` they skip.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use kura_fs::kv::redis::VERSION_BYTES;
use kura_fs::{Cond, Fs, FsConfig, FsError, Inode, Kv, Owner, PoolKv, ROOT_INO, RenameFlags, WriteMode};
use kura_pool::{Pool, PoolConfig};
use kura_testkit::{ChildGuard, free_tcp_port, require_cmd, wait_for_tcp};

const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Names the racing workers rename onto, and directories they make and remove.
const RACE_TARGETS: u64 = 40;
const RACE_DIRS: u64 = 5;
/// Iterations of each racing worker (process × thread).
const RACE_ITERATIONS: u64 = 150;
const RACE_THREADS_PER_PROCESS: usize = 2;
/// Environment of a racing worker process (this test binary, run again).
const WORKER_ENV: &str = "KURA_FS_REDIS_RACE_WORKER";
const WORKER_POOL_ENV: &str = "KURA_FS_REDIS_RACE_POOL";
const WORKER_FS_ENV: &str = "KURA_FS_REDIS_RACE_FS";

/// A redis-server on a free port, without persistence; killed when dropped.
struct Redis {
    port: u16,
    _child: ChildGuard,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// Starts one and checks that what answers on its port is this very process: tests of
    /// other processes pick free ports too, and a port that was free a moment ago may have
    /// gone to another server in between (then this one exits, and it is tried again).
    fn start(extra: &[&str]) -> Result<Self, String> {
        const ATTEMPTS: usize = 5;
        let bin = require_cmd("redis-server")?;
        let mut why = String::new();
        for _ in 0..ATTEMPTS {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let port = free_tcp_port().map_err(|e| e.to_string())?;
            let mut cmd = Command::new(&bin);
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .args(["--repl-diskless-sync-delay", "0", "--dir"])
                .arg(dir.path())
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = ChildGuard::spawn("redis-server", &mut cmd).map_err(|e| e.to_string())?;
            wait_for_tcp(("127.0.0.1", port), START_TIMEOUT).map_err(|e| e.to_string())?;
            let deadline = Instant::now() + START_TIMEOUT;
            let redis = loop {
                if child.try_wait().map_err(|e| e.to_string())?.is_some() {
                    why = format!("redis-server exited at start on port {port} (taken?)");
                    break None;
                }
                let info = cli(port, &["INFO", "server"]);
                match info.lines().find_map(|l| l.strip_prefix("process_id:")) {
                    Some(pid) if pid.trim() == child.id().to_string() => break Some(Self { port, _child: child, _dir: dir }),
                    Some(other) => {
                        why = format!("port {port} is another redis-server's (pid {})", other.trim());
                        break None;
                    }
                    None if Instant::now() > deadline => return Err(format!("redis-server on port {port} does not answer INFO")),
                    None => thread::sleep(Duration::from_millis(20)),
                }
            };
            if let Some(redis) = redis {
                return Ok(redis);
            }
        }
        Err(format!("no redis-server of ours after {ATTEMPTS} attempts: {why}"))
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// Keys matching `pattern` (a test-sized key space: `KEYS` is fine).
    fn keys(&self, pattern: &str) -> Vec<String> {
        self.cli(&["--raw", "KEYS", pattern]).lines().filter(|l| !l.is_empty()).map(str::to_owned).collect()
    }
}

/// `redis-cli -p <port> <args…>`, its output.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `n` redis-servers, or the reason to skip.
fn redis_nodes(n: usize) -> Option<Vec<Redis>> {
    if let Err(reason) = require_cmd("redis-cli") {
        kura_testkit::skip(&reason);
        return None;
    }
    let mut nodes = Vec::new();
    for _ in 0..n {
        match Redis::start(&[]) {
            Ok(node) => nodes.push(node),
            Err(reason) => {
                kura_testkit::skip(&reason);
                return None;
            }
        }
    }
    Some(nodes)
}

fn pool_of(urls: &[String]) -> Pool {
    Pool::open(PoolConfig::from_urls(urls).expect("pool urls")).expect("open pool")
}

fn urls(nodes: &[Redis]) -> Vec<String> {
    nodes.iter().map(Redis::url).collect()
}

fn owner() -> Owner {
    Owner { uid: 1000, gid: 1000 }
}

fn open_fs(urls: &[String], name: &str) -> Arc<Fs> {
    let kv = Arc::new(PoolKv::new(pool_of(urls)).expect("a redis:// pool is accepted"));
    Fs::open(kv, FsConfig { name: name.to_owned(), ..FsConfig::default() }, owner()).expect("open the file system")
}

fn write_file(fs: &Fs, dir: u64, name: &[u8], body: &[u8]) -> Inode {
    let (inode, _) = fs.create(dir, name, libc::S_IFREG | 0o644, 0, b"", owner(), true).expect("create");
    let node = fs.open_node(&inode).expect("open");
    assert_eq!(fs.write(&node, 0, body, WriteMode::Buffered).expect("write"), body.len());
    fs.release(&node).expect("close writes back");
    inode
}

fn read_file(fs: &Fs, ino: u64) -> Vec<u8> {
    let inode = fs.getattr(ino).expect("getattr");
    let node = fs.open_node(&inode).expect("open");
    let mut buf = vec![0u8; inode.size as usize + 1];
    let n = fs.read(&node, 0, &mut buf).expect("read");
    fs.release(&node).expect("close");
    buf.truncate(n);
    buf
}

fn names(fs: &Fs, dir: u64) -> Vec<String> {
    let mut names: Vec<String> = fs.readdir(dir).expect("readdir").into_iter().map(|e| String::from_utf8(e.name).unwrap()).collect();
    names.sort();
    names
}

fn ino_of(fs: &Fs, dir: u64, name: &str) -> u64 {
    fs.lookup(dir, name.as_bytes()).expect("lookup").unwrap_or_else(|| panic!("{name} not found")).ino
}

/// Create, write, read, rename (onto a new name and replacing a target), unlink, mkdir, rmdir,
/// readdir, hard and symbolic links, truncate; then a second handle (as another process would)
/// sees it all.
fn exercise_namespace(urls: &[String], name: &str) {
    let fs = open_fs(urls, name);
    let docs = fs.mkdir(ROOT_INO, b"docs", 0o755, owner()).expect("mkdir").ino;
    assert_eq!(fs.mkdir(ROOT_INO, b"docs", 0o755, owner()).unwrap_err(), FsError::Exists);
    let a = write_file(&fs, docs, b"a.txt", b"alpha\n");
    let b = write_file(&fs, docs, b"b.txt", b"bravo\n");
    let big: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    let big_ino = write_file(&fs, docs, b"big.bin", &big).ino;
    assert_eq!(read_file(&fs, a.ino), b"alpha\n");
    assert_eq!(read_file(&fs, big_ino), big);
    assert_eq!(names(&fs, docs), ["a.txt", "b.txt", "big.bin"]);

    // Rename to a new name, then over an existing target (which is replaced and deleted).
    fs.rename(docs, b"a.txt", docs, b"c.txt", RenameFlags::default()).expect("rename");
    assert_eq!(names(&fs, docs), ["b.txt", "big.bin", "c.txt"]);
    fs.rename(docs, b"c.txt", docs, b"b.txt", RenameFlags::default()).expect("rename replacing");
    assert_eq!(names(&fs, docs), ["b.txt", "big.bin"]);
    assert_eq!(ino_of(&fs, docs, "b.txt"), a.ino);
    assert_eq!(read_file(&fs, a.ino), b"alpha\n");
    assert_eq!(fs.getattr(b.ino).unwrap_err(), FsError::NotFound, "the replaced target is gone");
    let noreplace = RenameFlags { noreplace: true, ..RenameFlags::default() };
    assert_eq!(fs.rename(docs, b"big.bin", docs, b"b.txt", noreplace).unwrap_err(), FsError::Exists);

    // Across directories, and a directory into another.
    let sub = fs.mkdir(docs, b"sub", 0o700, owner()).expect("mkdir sub").ino;
    assert_eq!(fs.getattr(docs).unwrap().nlink, 3);
    fs.rename(docs, b"big.bin", sub, b"moved.bin", RenameFlags::default()).expect("rename across dirs");
    assert_eq!(names(&fs, sub), ["moved.bin"]);
    assert_eq!(read_file(&fs, big_ino), big);
    assert_eq!(fs.rmdir(docs, b"sub").unwrap_err(), FsError::NotEmpty);

    // Links and truncate.
    fs.link(a.ino, sub, b"hard").expect("link");
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 2);
    fs.symlink(sub, b"sym", b"../b.txt", owner()).expect("symlink");
    assert_eq!(fs.readlink(ino_of(&fs, sub, "sym")).unwrap(), b"../b.txt");
    fs.setattr(big_ino, kura_fs::SetAttr { size: Some(5000), ..Default::default() }).expect("truncate");
    assert_eq!(read_file(&fs, big_ino), big[..5000]);

    // A second handle sees the same namespace.
    let other = open_fs(urls, name);
    assert_eq!(names(&other, ROOT_INO), ["docs"]);
    assert_eq!(names(&other, sub), ["hard", "moved.bin", "sym"]);
    assert_eq!(read_file(&other, ino_of(&other, sub, "hard")), b"alpha\n");

    // Unlink and rmdir everything.
    for n in ["hard", "moved.bin", "sym"] {
        other.unlink(sub, n.as_bytes()).expect("unlink");
    }
    assert_eq!(other.unlink(sub, b"hard").unwrap_err(), FsError::NotFound);
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 1);
    fs.rmdir(docs, b"sub").expect("rmdir");
    fs.unlink(docs, b"b.txt").expect("unlink");
    assert!(names(&fs, docs).is_empty());
    assert_eq!(fs.getattr(docs).unwrap().nlink, 2);
    fs.rmdir(ROOT_INO, b"docs").expect("rmdir");
    assert!(names(&other, ROOT_INO).is_empty());
    // Each handle that read or wrote a file and closed it stays recorded among its openers
    // until its next write-back pass (Fs::release): the files unlinked by the other go then.
    fs.leave_lingering().unwrap();
    other.leave_lingering().unwrap();
    assert_eq!(fs.getattr(big_ino).unwrap_err(), FsError::NotFound);
    assert_eq!(fs.getattr(a.ino).unwrap_err(), FsError::NotFound);
}

#[test]
fn namespace_operations_on_one_redis_node() {
    let Some(nodes) = redis_nodes(1) else { return };
    exercise_namespace(&urls(&nodes), "one");
    // Only the superblock, inode counter and root remain (no chunk, bucket or inode leaked).
    let mut left = nodes[0].keys("kfs/one/*");
    left.sort();
    assert_eq!(left, ["kfs/one/i/1", "kfs/one/next", "kfs/one/sb"]);
}

/// `statfs` reports a redis-server's `maxmemory` as the capacity and its `used_memory` as used.
#[test]
fn statfs_reports_maxmemory_and_used_memory() {
    let node = match Redis::start(&["--maxmemory", "100mb"]) {
        Ok(node) => node,
        Err(reason) => return kura_testkit::skip(&reason),
    };
    let fs = open_fs(&[node.url()], "space");
    let s = fs.statfs().expect("statfs");
    let chunk = s.f_frsize as u64;
    assert_eq!(s.f_blocks * chunk, 100 << 20, "maxmemory");
    let used: u64 = cli(node.port, &["INFO", "memory"]).lines().find_map(|l| l.strip_prefix("used_memory:")?.trim().parse().ok()).expect("used_memory");
    let free = (100u64 << 20) - used;
    // used_memory moves a little between the two looks.
    assert!(s.f_bfree * chunk <= free + (1 << 20) && s.f_bfree * chunk + (1 << 20) >= free, "free {} chunks, used_memory {used}", s.f_bfree);
}

/// Two nodes: keys spread over both by consistent hashing; metadata values carry the version
/// prefix on whichever node holds them, chunks are stored as they are.
#[test]
fn namespace_operations_on_two_redis_nodes_and_the_stored_format() {
    let Some(nodes) = redis_nodes(2) else { return };
    let urls = urls(&nodes);
    exercise_namespace(&urls, "two");

    let fs = open_fs(&urls, "two");
    let dir = fs.mkdir(ROOT_INO, b"spread", 0o755, owner()).unwrap().ino;
    let mut files = Vec::new();
    for i in 0..64 {
        files.push(write_file(&fs, dir, format!("f{i}").as_bytes(), format!("body {i}\n").as_bytes()));
    }
    for node in &nodes {
        assert!(node.keys("kfs/two/i/*").len() >= 8, "inodes on both nodes (port {})", node.port);
        assert!(node.keys("kfs/two/c/*").len() >= 8, "chunks on both nodes (port {})", node.port);
    }
    let pool = pool_of(&urls);
    let mut ctx = pool.context().unwrap();
    let kv = PoolKv::new(pool_of(&urls)).unwrap();
    for (i, file) in files.iter().enumerate() {
        let chunk_key = format!("kfs/two/c/{:x}/0", file.ino);
        assert_eq!(ctx.get(chunk_key.as_bytes()).unwrap().unwrap(), format!("body {i}\n").as_bytes(), "a chunk is stored raw");
        let inode_key = format!("kfs/two/i/{:x}", file.ino);
        let raw = ctx.get(inode_key.as_bytes()).unwrap().unwrap();
        let (record, version) = kv.get_versioned(inode_key.as_bytes()).unwrap().unwrap();
        assert_eq!(raw[..VERSION_BYTES], version.to_le_bytes(), "an inode starts with its version");
        assert_eq!(raw[VERSION_BYTES..], record);
        assert_eq!(Inode::decode(inode_key.as_bytes(), &record).unwrap().ino, file.ino);
    }
    assert_eq!(names(&fs, dir).len(), 64, "readdir strips the prefix of every bucket");
    assert_eq!(kv.get_meta_many(&[b"kfs/two/d/1/0".to_vec(), b"kfs/two/nothing".to_vec()]).unwrap()[1], None);
}

/// Versions: fresh on every write, a stale one fails put and delete, a deleted and re-created
/// key does not accept the version it had before (no ABA); a value without the prefix is an
/// error, not a panic.
#[test]
fn compare_and_swap_with_a_stale_version_fails_on_redis() {
    let Some(nodes) = redis_nodes(1) else { return };
    let kv = PoolKv::new(pool_of(&urls(&nodes))).unwrap();
    let key = b"kfs/cas/x".as_slice();
    assert_eq!(kv.get_versioned(key).unwrap(), None);
    assert!(!kv.delete_cond(key, Cond::Version(1)).unwrap(), "no version matches an absent key");
    assert!(kv.delete_cond(key, Cond::Absent).unwrap(), "absent: nothing to delete");
    assert_eq!(kv.put_cond(key, b"v1", Cond::Version(1)).unwrap(), None, "absent key, version given");
    let v1 = kv.put_cond(key, b"v1", Cond::Absent).unwrap().expect("absent: written");
    assert_ne!(v1, 0);
    assert_eq!(kv.put_cond(key, b"again", Cond::Absent).unwrap(), None, "present: not written");
    assert!(!kv.delete_cond(key, Cond::Absent).unwrap());
    assert_eq!(kv.get_versioned(key).unwrap(), Some((b"v1".to_vec(), v1)));

    let v2 = kv.put_cond(key, b"v2", Cond::Version(v1)).unwrap().expect("current version: written");
    assert_ne!(v2, v1);
    assert_eq!(kv.put_cond(key, b"stale", Cond::Version(v1)).unwrap(), None, "stale version: refused");
    assert!(!kv.delete_cond(key, Cond::Version(v1)).unwrap(), "stale version: not deleted");
    assert_eq!(kv.get_versioned(key).unwrap(), Some((b"v2".to_vec(), v2)));
    let v3 = kv.put_cond(key, b"", Cond::Always).unwrap().expect("always");
    assert_eq!(kv.get_versioned(key).unwrap(), Some((Vec::new(), v3)), "an empty record keeps its version");
    assert!(!kv.delete_cond(key, Cond::Version(v2)).unwrap());
    assert!(kv.delete_cond(key, Cond::Version(v3)).unwrap(), "current version: deleted");
    assert_eq!(kv.get_versioned(key).unwrap(), None);

    // Delete and re-create: the old versions never match again.
    let v4 = kv.put_cond(key, b"v4", Cond::Absent).unwrap().unwrap();
    for old in [v1, v2, v3] {
        assert_ne!(v4, old);
        assert_eq!(kv.put_cond(key, b"aba", Cond::Version(old)).unwrap(), None);
    }
    assert!(kv.delete_cond(key, Cond::Always).unwrap());
    assert!(kv.delete_cond(key, Cond::Always).unwrap(), "always, even when absent");

    // The script is loaded again after SCRIPT FLUSH (NOSCRIPT → EVAL).
    let v5 = kv.put_cond(key, b"v5", Cond::Absent).unwrap().unwrap();
    assert_eq!(nodes[0].cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    let v6 = kv.put_cond(key, b"v6", Cond::Version(v5)).unwrap().expect("after SCRIPT FLUSH");
    assert_eq!(kv.put_cond(key, b"v7", Cond::Version(v5)).unwrap(), None);
    assert!(kv.delete_cond(key, Cond::Version(v6)).unwrap());

    // Foreign values: too short for a version, or not a string at all.
    assert_eq!(nodes[0].cli(&["SET", "kfs/cas/foreign", "abc"]).trim(), "OK");
    assert!(matches!(kv.get_versioned(b"kfs/cas/foreign"), Err(FsError::Corrupt { .. })));
    assert_eq!(kv.put_cond(b"kfs/cas/foreign", b"x", Cond::Version(7)).unwrap(), None);
    nodes[0].cli(&["RPUSH", "kfs/cas/list", "a"]);
    assert!(matches!(kv.get_versioned(b"kfs/cas/list"), Err(FsError::Io(m)) if m.contains("WRONGTYPE")));
    assert!(matches!(kv.put_cond(b"kfs/cas/list", b"x", Cond::Version(7)), Err(FsError::Io(_))));
    assert_eq!(kv.get_versioned(key).unwrap(), None, "the connection recovers after errors");
    // A value the pool's own connections could not read back (a directory listing) is refused.
    let limit = kv.pool().config().value_size_max_bytes;
    let too_big = vec![7u8; limit - VERSION_BYTES + 1];
    assert!(matches!(kv.put_cond(b"kfs/cas/big", &too_big, Cond::Absent), Err(FsError::Io(m)) if m.contains("value limit")));
    let v = kv.put_cond(b"kfs/cas/big", &too_big[1..], Cond::Absent).unwrap().expect("at the limit");
    assert_eq!(kv.get_meta_many(&[b"kfs/cas/big".to_vec()]).unwrap()[0].as_deref(), Some(&too_big[1..]));
    assert_eq!(kv.get_versioned(b"kfs/cas/big").unwrap().map(|(_, version)| version), Some(v));

    // A file system whose superblock is not ours is refused cleanly.
    assert_eq!(nodes[0].cli(&["SET", "kfs/alien/sb", "not a superblock"]).trim(), "OK");
    let alien = Fs::open(Arc::new(PoolKv::new(pool_of(&urls(&nodes))).unwrap()), FsConfig { name: "alien".into(), ..FsConfig::default() }, owner());
    assert!(matches!(alien.err(), Some(FsError::Corrupt { .. })));
}

/// Threads increment one counter by read-then-CAS; none of the increments is lost. Threads
/// racing to create one key: exactly one wins each round.
#[test]
fn threads_racing_compare_and_swap_lose_no_update_on_redis() {
    let Some(nodes) = redis_nodes(2) else { return };
    const THREADS: usize = 4;
    const INCREMENTS: u64 = 200;
    const ROUNDS: usize = 50;
    let kv = Arc::new(PoolKv::new(pool_of(&urls(&nodes))).unwrap());
    let counter = b"kfs/race/counter".as_slice();
    kv.put_cond(counter, &0u64.to_le_bytes(), Cond::Absent).unwrap().unwrap();
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (kv, barrier) = (Arc::clone(&kv), Arc::clone(&barrier));
            thread::spawn(move || {
                barrier.wait();
                let mut conflicts = 0u64;
                for _ in 0..INCREMENTS {
                    loop {
                        let (value, version) = kv.get_versioned(counter).unwrap().unwrap();
                        let n = u64::from_le_bytes(value.try_into().unwrap());
                        if kv.put_cond(counter, &(n + 1).to_le_bytes(), Cond::Version(version)).unwrap().is_some() {
                            break;
                        }
                        conflicts += 1;
                    }
                }
                let mut wins = Vec::new();
                for round in 0..ROUNDS {
                    barrier.wait();
                    let key = format!("kfs/race/once/{round}");
                    if kv.put_cond(key.as_bytes(), format!("{t}").as_bytes(), Cond::Absent).unwrap().is_some() {
                        wins.push(round);
                    }
                }
                (conflicts, wins)
            })
        })
        .collect();
    let mut conflicts = 0;
    let mut winners: HashMap<usize, usize> = HashMap::new();
    for h in handles {
        let (c, wins) = h.join().unwrap();
        conflicts += c;
        for round in wins {
            *winners.entry(round).or_default() += 1;
        }
    }
    let (value, _) = kv.get_versioned(counter).unwrap().unwrap();
    assert_eq!(u64::from_le_bytes(value.try_into().unwrap()), THREADS as u64 * INCREMENTS, "{conflicts} conflicts were retried");
    assert_eq!(winners.len(), ROUNDS);
    assert!(winners.values().all(|&w| w == 1), "{winners:?}");
    eprintln!("{} increments by {THREADS} threads, {conflicts} CAS conflicts retried", THREADS as u64 * INCREMENTS);
}

/// A small deterministic generator for the workers.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One racing worker: create a file of its own, write it, rename it over one of
/// [`RACE_TARGETS`] shared names, sometimes unlink a shared name, sometimes make or remove a
/// shared directory (the preload test's Python worker, through the API).
fn race(fs: &Fs, shared: u64, me: &str) {
    let mut rng = Rng(xxhash_rust::xxh3::xxh3_64(me.as_bytes()) | 1);
    for k in 0..RACE_ITERATIONS {
        let tmp = format!("tmp-{me}-{k}");
        write_file(fs, shared, tmp.as_bytes(), format!("writer-{me}-{k}\n").as_bytes());
        let target = format!("n{}", rng.below(RACE_TARGETS));
        fs.rename(shared, tmp.as_bytes(), shared, target.as_bytes(), RenameFlags::default()).unwrap_or_else(|e| panic!("{me}: rename {tmp} to {target}: {e}"));
        if rng.chance(30) {
            match fs.unlink(shared, format!("n{}", rng.below(RACE_TARGETS)).as_bytes()) {
                Ok(()) | Err(FsError::NotFound) => {}
                Err(e) => panic!("{me}: unlink: {e}"),
            }
        }
        if rng.chance(10) {
            let d = format!("d{}", rng.below(RACE_DIRS));
            match fs.mkdir(shared, d.as_bytes(), 0o755, owner()) {
                Ok(_) => {}
                Err(FsError::Exists) => match fs.rmdir(shared, d.as_bytes()) {
                    Ok(()) | Err(FsError::NotFound | FsError::NotEmpty) => {}
                    Err(e) => panic!("{me}: rmdir {d}: {e}"),
                },
                Err(e) => panic!("{me}: mkdir {d}: {e}"),
            }
        }
    }
}

/// Not a test by itself: the body of a racing worker process when [`WORKER_ENV`] names one
/// (run by `concurrent_processes_keep_the_namespace_consistent_on_redis`); passes at once
/// otherwise.
#[test]
fn race_worker_process() {
    let Ok(me) = std::env::var(WORKER_ENV) else { return };
    let urls: Vec<String> = std::env::var(WORKER_POOL_ENV).unwrap().split(',').map(str::to_owned).collect();
    let fs = open_fs(&urls, &std::env::var(WORKER_FS_ENV).unwrap());
    let shared = ino_of(&fs, ROOT_INO, "shared");
    thread::scope(|s| {
        for t in 0..RACE_THREADS_PER_PROCESS {
            let (fs, me) = (&fs, format!("{me}{t}"));
            s.spawn(move || race(fs, shared, &me));
        }
    });
    fs.sync_all().unwrap();
}

/// Afterwards: every entry resolves, names are unique, link counts add up, contents match,
/// no temporary name is left, and no inode or chunk record is leaked.
fn check_race_result(fs: &Fs, nodes: &[Redis], fs_name: &str, writers: &[String]) {
    let shared = ino_of(fs, ROOT_INO, "shared");
    let entries = fs.readdir(shared).unwrap();
    let unique: HashSet<&[u8]> = entries.iter().map(|e| e.name.as_slice()).collect();
    assert_eq!(unique.len(), entries.len(), "duplicate names");
    assert!(!entries.is_empty());
    let mut dirs = 0;
    let mut files = 0;
    for e in &entries {
        let name = String::from_utf8(e.name.clone()).unwrap();
        let inode = fs.getattr(e.ino).unwrap_or_else(|err| panic!("{name} -> inode {}: {err}", e.ino));
        if kura_fs::layout::is_dir(inode.mode) {
            assert!(name.starts_with('d'), "{name}");
            assert_eq!((e.dtype, inode.nlink, inode.parent), (libc::DT_DIR, 2, shared), "{name}");
            assert!(fs.readdir(e.ino).unwrap().is_empty());
            dirs += 1;
            continue;
        }
        files += 1;
        assert!(name.strip_prefix('n').is_some_and(|n| n.parse::<u64>().is_ok_and(|n| n < RACE_TARGETS)), "left behind: {name}");
        assert_eq!(inode.nlink, 1, "{name}");
        let body = String::from_utf8(read_file(fs, e.ino)).unwrap();
        let ok = body.strip_prefix("writer-").and_then(|rest| rest.strip_suffix('\n')).and_then(|rest| rest.rsplit_once('-')).is_some_and(|(who, k)| {
            writers.iter().any(|w| w == who) && k.parse::<u64>().is_ok_and(|k| k < RACE_ITERATIONS)
        });
        assert!(ok, "{name}: {body:?}");
    }
    assert_eq!(fs.getattr(shared).unwrap().nlink, 2 + dirs, "{dirs} directories");
    // root, shared, and what is in shared: nothing else has an inode; one chunk per file.
    let count = |kind: &str| nodes.iter().map(|n| n.keys(&format!("kfs/{fs_name}/{kind}/*")).len()).sum::<usize>();
    assert_eq!(count("i"), 2 + entries.len(), "inode records");
    assert_eq!(count("c"), files, "chunk records");
    eprintln!("{files} files and {dirs} directories left, consistent");
}

/// Two processes of two threads each create, rename over and delete names in one directory
/// at once (every change a CAS on one of two Redis nodes).
#[test]
fn concurrent_processes_keep_the_namespace_consistent_on_redis() {
    let Some(nodes) = redis_nodes(2) else { return };
    let urls = urls(&nodes);
    let fs = open_fs(&urls, "race");
    fs.mkdir(ROOT_INO, b"shared", 0o755, owner()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let spawn = |id: &str| {
        Command::new(&exe)
            .args(["--exact", "race_worker_process", "--nocapture", "--test-threads", "1"])
            .env(WORKER_ENV, id)
            .env(WORKER_POOL_ENV, urls.join(","))
            .env(WORKER_FS_ENV, "race")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let workers = [spawn("a"), spawn("b")];
    for child in workers {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "worker failed ({}):\n{}\n{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    eprintln!("2 processes × {RACE_THREADS_PER_PROCESS} threads × {RACE_ITERATIONS} iterations in {:.1} s", started.elapsed().as_secs_f64());
    let writers: Vec<String> = ["a", "b"].iter().flat_map(|p| (0..RACE_THREADS_PER_PROCESS).map(move |t| format!("{p}{t}"))).collect();
    check_race_result(&open_fs(&urls, "race"), &nodes, "race", &writers);
}

/// The `kura` binary and `libkura_fs.so`, built into this test's target directory.
fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| kura_testkit::build_workspace_packages(&["kura", "kura-preload"]))
}

/// `kura fs run --pool redis://… --pool redis://… -- <program>`.
fn preload(urls: &[String], program: &[&str]) -> Command {
    let mut cmd = Command::new(bin_dir().join("kura"));
    cmd.args(["fs", "run", "--fuse", "off", "--name", "preload"]);
    for url in urls {
        cmd.args(["--pool", url]);
    }
    cmd.arg("--").args(program).stdin(Stdio::null());
    cmd
}

fn check_output(out: &std::process::Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The preload's concurrency test (`crates/kura-preload/tests/programs.rs`) on two Redis nodes:
/// two Python processes under `kura fs run` race in one directory. Before it, a shell that
/// forks after using the file system (the child must not use its parent's connections).
#[test]
fn concurrent_processes_under_the_preload_on_redis() {
    if let Err(reason) = require_cmd("python3") {
        kura_testkit::skip(&reason);
        return;
    }
    let Some(nodes) = redis_nodes(2) else { return };
    let urls = urls(&nodes);
    let out = preload(&urls, &["sh", "-c", "mkdir /kura/shared && echo parent > /kura/p && (cat /kura/p; echo child > /kura/c) && cat /kura/c && ls /kura"]).output().unwrap();
    assert_eq!(check_output(&out, "sh"), "parent\nchild\nc\np\nshared\n");
    let worker = r#"
import os, random, sys, errno
me = sys.argv[1]
rng = random.Random(me)
for k in range(250):
    tmp = "/kura/shared/tmp-%s-%d" % (me, k)
    with open(tmp, "w") as f:
        f.write("writer-%s-%d\n" % (me, k))
    target = "/kura/shared/n%d" % rng.randrange(40)
    os.rename(tmp, target)
    if rng.random() < 0.3:
        try:
            os.unlink("/kura/shared/n%d" % rng.randrange(40))
        except FileNotFoundError:
            pass
    if rng.random() < 0.1:
        d = "/kura/shared/d%d" % rng.randrange(5)
        try:
            os.mkdir(d)
        except FileExistsError:
            try:
                os.rmdir(d)
            except OSError as e:
                assert e.errno in (errno.ENOENT, errno.ENOTEMPTY), e
print("done", me)
"#;
    let spawn = |id: &str| preload(&urls, &["python3", "-c", worker, id]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let workers = [spawn("a"), spawn("b")];
    for child in workers {
        check_output(&child.wait_with_output().unwrap(), "worker");
    }
    let checker = r#"
import os, re
names = os.listdir("/kura/shared")
assert len(names) == len(set(names)), "duplicate names"
dirs = 0
for n in names:
    p = "/kura/shared/" + n
    st = os.lstat(p)
    if os.path.isdir(p):
        dirs += 1
        continue
    assert re.fullmatch(r"n\d+", n), n
    assert st.st_nlink == 1, (n, st.st_nlink)
    body = open(p).read()
    assert re.fullmatch(r"writer-[ab]-\d+\n", body), (n, body)
assert os.stat("/kura/shared").st_nlink == 2 + dirs, (os.stat("/kura/shared").st_nlink, dirs)
print("consistent", len(names) > 0)
"#;
    let out = preload(&urls, &["python3", "-c", checker]).output().unwrap();
    assert_eq!(check_output(&out, "checker"), "consistent True\n");
}

/// With `replicas=1`, the pool's flush (the file system's barrier: `fsync`) returns once the
/// replica holds every metadata write made before it on the file system's own connections.
#[test]
fn flush_waits_until_a_replica_holds_the_metadata() {
    let Some(nodes) = redis_nodes(1) else { return };
    let master_port = nodes[0].port.to_string();
    let replica = match Redis::start(&["--replicaof", "127.0.0.1", &master_port]) {
        Ok(r) => r,
        Err(reason) => return kura_testkit::skip(&reason),
    };
    let deadline = Instant::now() + START_TIMEOUT;
    while !nodes[0].cli(&["INFO", "replication"]).contains("state=online") {
        assert!(Instant::now() < deadline, "the replica did not come online");
        thread::sleep(Duration::from_millis(50));
    }
    let url = format!("{}?replicas=1", nodes[0].url());
    let fs = open_fs(std::slice::from_ref(&url), "replicated");
    let replica_pool = pool_of(&[replica.url()]);
    let mut replica_ctx = replica_pool.context().unwrap();
    for round in 0..20 {
        let dir = fs.mkdir(ROOT_INO, format!("d{round}").as_bytes(), 0o755, owner()).unwrap().ino;
        let file = write_file(&fs, dir, b"f", b"replicated\n");
        fs.rename(dir, b"f", dir, b"g", RenameFlags::default()).unwrap();
        fs.kv().flush().expect("flush with a replica");
        let inode = fs.kv().get_versioned(format!("kfs/replicated/i/{:x}", file.ino).as_bytes()).unwrap().unwrap();
        let on_replica = replica_ctx.get(format!("kfs/replicated/i/{:x}", file.ino).as_bytes()).unwrap().expect("the inode is on the replica");
        assert_eq!(on_replica[..VERSION_BYTES], inode.1.to_le_bytes());
        let bucket = format!("kfs/replicated/d/{dir:x}/{:x}", kura_fs::layout::bucket_of(b"g"));
        let on_replica = replica_ctx.get(bucket.as_bytes()).unwrap().expect("the renamed entry is on the replica");
        assert_eq!(on_replica[VERSION_BYTES..], fs.kv().get_versioned(bucket.as_bytes()).unwrap().unwrap().0);
        assert_eq!(replica_ctx.get(format!("kfs/replicated/c/{:x}/0", file.ino).as_bytes()).unwrap().unwrap(), b"replicated\n");
    }
    // Without the replica the barrier fails instead of claiming durability.
    drop(replica);
    thread::sleep(Duration::from_millis(200));
    fs.mkdir(ROOT_INO, b"late", 0o755, owner()).unwrap();
    assert!(fs.kv().flush().is_err(), "a flush nobody acknowledged must fail");
}

/// A server that answers the first request of every connection with `reply` and closes the
/// connection 100 ms later (it lives as long as the test process).
fn fake_server(reply: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    thread::spawn(move || {
        while let Ok((mut stream, _)) = listener.accept() {
            let mut buf = [0u8; 4096];
            if stream.read(&mut buf).is_ok_and(|n| n > 0) {
                let _ = stream.write_all(reply);
            }
            thread::sleep(Duration::from_millis(100));
        }
    });
    format!("redis://{addr}")
}

/// Malformed or oversized replies are I/O errors naming the node, never a panic or a hang.
#[test]
fn malformed_redis_replies_are_errors() {
    for (reply, expect) in [
        (&b"garbage\r\n"[..], &["malformed reply"][..]),
        (b"$99999999999\r\n", &["malformed reply", "exceeds the limit"]),
        (b":1\r\n", &["unexpected reply to GET: Int(1)"]),
        (b"*1\r\n$1\r\nx\r\n", &["unexpected reply to GET: Array"]),
        (b"$3\r\nab", &["connection closed"]),
        (b"+OK\r\n+OK\r\n", &["more than one reply", "unexpected reply to GET"]),
        (b"-MOVED 3999 127.0.0.1:7000\r\n", &["cannot use a cluster"]),
        (b"-OOM command not allowed when used memory > 'maxmemory'.\r\n", &[]),
    ] {
        let url = fake_server(reply);
        let kv = PoolKv::new(pool_of(std::slice::from_ref(&url))).unwrap();
        let started = Instant::now();
        let result = kv.get_versioned(b"kfs/x/sb");
        if expect.is_empty() {
            assert_eq!(result, Err(FsError::NoSpace), "an OOM reply is a full pool");
            continue;
        }
        let message = match &result {
            Err(FsError::Io(m)) => m.clone(),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(reply)),
        };
        assert!(expect.iter().any(|e| message.contains(e)), "{:?}: {message}", String::from_utf8_lossy(reply));
        assert!(message.contains(url.trim_start_matches("redis://")), "{message}");
        assert!(started.elapsed() < Duration::from_secs(10));
        // A new connection after the error; its script load meets the same reply.
        assert!(kv.put_cond(b"kfs/x/sb", b"v", Cond::Version(1)).is_err());
    }
}

/// A Redis Cluster (one node owning every slot) is refused with the reason, before any use.
#[test]
fn a_redis_cluster_is_refused_with_a_clear_error() {
    if let Err(reason) = require_cmd("redis-cli") {
        return kura_testkit::skip(&reason);
    }
    let node = match Redis::start(&["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]) {
        Ok(n) => n,
        Err(reason) => return kura_testkit::skip(&reason),
    };
    assert_eq!(node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).trim(), "OK");
    let deadline = Instant::now() + START_TIMEOUT;
    while !node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
        assert!(Instant::now() < deadline, "the cluster did not become ok");
        thread::sleep(Duration::from_millis(50));
    }
    let url = format!("redis+cluster://127.0.0.1:{}", node.port);
    let pool = pool_of(std::slice::from_ref(&url));
    // The pool itself uses the cluster...
    let mut ctx = pool.context().unwrap();
    ctx.set(b"kfs/cluster/probe", b"1").unwrap();
    assert_eq!(ctx.get(b"kfs/cluster/probe").unwrap().as_deref(), Some(&b"1"[..]));
    // ...the file system refuses it, saying why and what to use.
    let message = match PoolKv::new(pool) {
        Err(FsError::Io(m)) => m,
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("a Redis Cluster pool was accepted"),
    };
    for part in ["Redis Cluster", "compare-and-swap", "slot routing", "redis://", &format!("127.0.0.1:{}", node.port)] {
        assert!(message.contains(part), "{part:?} not in {message:?}");
    }
    // Mixed with a plain node: still refused.
    let Some(plain) = redis_nodes(1) else { return };
    assert!(PoolKv::new(pool_of(&[plain[0].url(), url])).is_err());
}
