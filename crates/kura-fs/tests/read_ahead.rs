//! Path walks read the records of a path this process walked before in one round trip (see
//! `kura_fs::memo`), and what they return never differs from a walk by a process that has
//! seen nothing: another instance of the file system (another process, for the pool) renames,
//! replaces and removes names under the walker, and every walk is compared with a fresh
//! instance's. Over the embedded engine and over two real memcached nodes (keys of one walk
//! on both), where the read-ahead really pipelines.

mod common;

use std::sync::Arc;

use common::{Counted, embedded, memcached_nodes, run_named_cases};
use kura_fs::ns::Cred;
use kura_fs::path::{Follow, Resolved};
use kura_fs::{Fs, FsConfig, FsError, Inode, Kv, Owner, ROOT_INO, RenameFlags};
use kura_testkit::try_or_skip;
use proptest::prelude::*;

const MOUNT: &[u8] = b"/kura";
const ROOT: Owner = Owner { uid: 0, gid: 0 };

fn config() -> FsConfig {
    FsConfig { name: "ahead".into(), ..FsConfig::default() }
}

fn open(kv: Arc<dyn Kv>) -> Arc<Fs> {
    Fs::open(kv, config(), ROOT).unwrap()
}

fn follow(last: bool, searcher: Option<&Cred>) -> Follow<'_> {
    Follow { last, searcher }
}

/// `mkdir -p` of `path`'s directories and a file at its end; the file's inode.
fn make_path(fs: &Fs, path: &str) -> Inode {
    let mut dir = ROOT_INO;
    let parts: Vec<&str> = path.split('/').collect();
    for part in &parts[..parts.len() - 1] {
        dir = match fs.lookup(dir, part.as_bytes()).unwrap() {
            Some(entry) => entry.ino,
            None => fs.mkdir(dir, part.as_bytes(), 0o755, ROOT).unwrap().ino,
        };
    }
    fs.create(dir, parts[parts.len() - 1].as_bytes(), libc::S_IFREG | 0o644, 0, b"", ROOT, true).unwrap().0
}

#[test]
fn a_path_walked_before_costs_one_round_trip() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(1).ok_or("no memcached"));
    let writer = open(kv.clone());
    let file = make_path(&writer, "a/b/c/d/f");
    let counted = Arc::new(Counted::new(kv.clone()));
    let walker = open(counted.clone());
    let user = Cred { uid: 1000, gid: 1000, groups: Vec::new() };

    let walk = |start: u64, path: &str, searcher: Option<&Cred>| {
        let before = counted.reads();
        let (resolved, inode) = walker.resolve_inode(start, path.as_bytes(), follow(true, searcher), MOUNT).unwrap();
        (resolved, inode.map(|i| i.ino), counted.reads() - before)
    };
    let (first, ino, cold) = walk(ROOT_INO, "a/b/c/d/f", None);
    assert_eq!(ino, Some(file.ino));
    assert_eq!(cold, 6, "a first walk reads one record per component, then the inode");
    let (again, ino, warm) = walk(ROOT_INO, "a/b/c/d/f", None);
    assert_eq!((again, ino), (first.clone(), Some(file.ino)));
    assert_eq!(warm, 1, "the same walk again: every record in one round trip");
    let (_, ino, warm) = walk(ROOT_INO, "a/b/c/d/f", Some(&user));
    assert_eq!((ino, warm), (Some(file.ino), 1), "with search permission checks too");
    let c = walker.resolve(ROOT_INO, b"a/b/c", follow(true, None), MOUNT).unwrap().ino().unwrap();
    let (_, ino, warm) = walk(c, "d/f", None);
    assert_eq!((ino, warm), (Some(file.ino), 1), "relative to a directory, its own check included");
    // A lookup with its inode (FUSE's lookup) of a name seen before.
    let before = counted.reads();
    let found = walker.lookup_inode(c, b"d").unwrap().map(|(entry, inode)| (entry.ino, inode.ino));
    assert!(matches!(found, Some((a, b)) if a == b));
    assert_eq!(counted.reads() - before, 1, "a known name and its inode in one round trip");
    // Names listed by readdir are known too.
    let d = walker.resolve(ROOT_INO, b"a/b/c/d", follow(true, None), MOUNT).unwrap().ino().unwrap();
    make_path(&writer, "a/b/c/d/g");
    walker.readdir(d).unwrap();
    let (_, ino, warm) = walk(d, "g", None);
    assert!(ino.is_some());
    assert_eq!(warm, 1, "a name just listed");

    // Another process moves the directory away and puts another in its place: the walker's
    // predictions are wrong now, and its walk sees the new tree, as a fresh process does.
    writer.rename(ROOT_INO, b"a", ROOT_INO, b"old", RenameFlags::default()).unwrap();
    let new_file = make_path(&writer, "a/b/c/d/f");
    let (moved, ino, _) = walk(ROOT_INO, "a/b/c/d/f", None);
    assert_eq!(ino, Some(new_file.ino));
    assert_ne!(moved, first);
    let fresh = open(kv.clone());
    assert_eq!(fresh.resolve_inode(ROOT_INO, b"a/b/c/d/f", follow(true, None), MOUNT).unwrap().1.map(|i| i.ino), Some(new_file.ino));
    let (_, _, warm) = walk(ROOT_INO, "a/b/c/d/f", None);
    assert_eq!(warm, 1, "the new tree's names are learnt");
    let new_d = writer.resolve(ROOT_INO, b"a/b/c/d", follow(true, None), MOUNT).unwrap().ino().unwrap();
    writer.unlink(new_d, b"f").unwrap();
    assert!(matches!(walk(ROOT_INO, "a/b/c/d/f", None).0, Resolved::Missing { .. }));
}

/// Processes of one host share the names they saw (a table the preload maps for each): a new
/// process's first walk of a path another walked is one round trip too.
#[test]
fn a_new_process_walks_a_path_others_walked_in_one_round_trip() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(1).ok_or("no memcached"));
    let dir = tempfile::tempdir().unwrap();
    let shared = FsConfig { name: "ahead".into(), shared_names_path: Some(dir.path().join("names")), ..FsConfig::default() };
    let first = Fs::open(kv.clone(), shared.clone(), ROOT).unwrap();
    let file = make_path(&first, "a/b/c/d/f");
    let walks = |config: &FsConfig| {
        let counted = Arc::new(Counted::new(kv.clone()));
        let fs = Fs::open(counted.clone(), config.clone(), ROOT).unwrap();
        let before = counted.reads();
        let (_, inode) = fs.resolve_inode(ROOT_INO, b"a/b/c/d/f", follow(true, None), MOUNT).unwrap();
        assert_eq!(inode.map(|i| i.ino), Some(file.ino));
        counted.reads() - before
    };
    assert_eq!(walks(&config()), 6, "a process on its own walks one component at a time");
    assert_eq!(walks(&shared), 1, "with the host's table, at once");
    // The table is only hints: after the tree moves, a new process still finds the new one.
    first.rename(ROOT_INO, b"a", ROOT_INO, b"old", RenameFlags::default()).unwrap();
    let moved = make_path(&first, "a/b/c/d/f");
    let fresh = Fs::open(kv.clone(), shared.clone(), ROOT).unwrap();
    assert_eq!(fresh.resolve_inode(ROOT_INO, b"a/b/c/d/f", follow(true, None), MOUNT).unwrap().1.map(|i| i.ino), Some(moved.ino));
}

/// On the embedded engine (one process, the only user of its store) inodes and directory
/// buckets stay in RAM once read or written: walks of a path whose records went to flash, under
/// 8 MiB of data written after them, read the device no more.
#[test]
fn the_embedded_engine_answers_walks_from_ram() {
    let dir = tempfile::tempdir().unwrap();
    let kv = embedded(dir.path());
    let fs = open(kv.clone());
    let file = make_path(&fs, "a/b/c/f");
    let data = make_path(&fs, "data");
    let node = fs.open_node(&data).unwrap();
    fs.write(&node, 0, &vec![0x5a; 8 << 20], kura_fs::WriteMode::Buffered).unwrap();
    fs.fsync(&node).unwrap();
    fs.release(&node).unwrap();
    let engine = kv.pool().engine().unwrap();
    assert!(engine.stats().seals >= 4, "the metadata records were sealed into blocks on flash");
    let reads_before = engine.stats().flash_reads;
    for _ in 0..100 {
        let (_, inode) = fs.resolve_inode(ROOT_INO, b"a/b/c/f", follow(true, None), MOUNT).unwrap();
        assert_eq!(inode.map(|i| i.ino), Some(file.ino));
        assert_eq!(fs.lookup_inode(ROOT_INO, b"a").unwrap().map(|(e, _)| e.dtype), Some(libc::DT_DIR));
    }
    assert_eq!(engine.stats().flash_reads - reads_before, 0, "walks read the device");
    // Changes still show: the copy is updated by the writes themselves.
    let c = fs.resolve(ROOT_INO, b"a/b/c", follow(true, None), MOUNT).unwrap().ino().unwrap();
    fs.rename(c, b"f", c, b"g", RenameFlags::default()).unwrap();
    assert!(matches!(fs.resolve(ROOT_INO, b"a/b/c/f", follow(true, None), MOUNT).unwrap(), Resolved::Missing { .. }));
    assert_eq!(fs.resolve_inode(ROOT_INO, b"a/b/c/g", follow(true, None), MOUNT).unwrap().1.map(|i| i.ino), Some(file.ino));
    let other = open(kv.clone());
    assert_eq!(other.resolve_inode(ROOT_INO, b"a/b/c/g", follow(true, None), MOUNT).unwrap().1.map(|i| i.ino), Some(file.ino));
}

/// Namespace changes by another instance, and walks to compare.
#[derive(Debug, Clone)]
enum Op {
    Mkdir(String),
    Create(String),
    Symlink(String, &'static str),
    Unlink(String),
    Rmdir(String),
    Rename(String, String),
    /// Permission bits: 0o700 takes the search permission from other users.
    Chmod(String, u32),
    Walk { path: String, last: bool, user: bool },
}

fn path_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 1..4).prop_map(|parts| parts.join("/"))
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let targets = vec!["a", "a/b", "..", "../c", "/kura/b", "/etc", "b/../c", "nope"];
    prop_oneof![
        2 => path_strategy().prop_map(Op::Mkdir),
        1 => path_strategy().prop_map(Op::Create),
        1 => (path_strategy(), prop::sample::select(targets)).prop_map(|(p, t)| Op::Symlink(p, t)),
        1 => path_strategy().prop_map(Op::Unlink),
        1 => path_strategy().prop_map(Op::Rmdir),
        2 => (path_strategy(), path_strategy()).prop_map(|(a, b)| Op::Rename(a, b)),
        1 => (path_strategy(), prop::sample::select(vec![0o700, 0o755])).prop_map(|(p, m)| Op::Chmod(p, m)),
        6 => (path_strategy().prop_flat_map(|p| prop_oneof![Just(p.clone()), Just(format!("{p}/")), Just(format!("{p}/../a"))]), any::<bool>(), any::<bool>())
            .prop_map(|(path, last, user)| Op::Walk { path, last, user }),
    ]
}

/// The parent directory and last name of `path` as `fs` resolves it now (`None`: no parent).
fn parent_of(fs: &Fs, path: &str) -> Option<(u64, Vec<u8>)> {
    let (dir, name) = match path.rsplit_once('/') {
        Some((dir, name)) => (fs.resolve(ROOT_INO, dir.as_bytes(), follow(true, None), MOUNT).ok()?.ino()?, name),
        None => (ROOT_INO, path),
    };
    Some((dir, name.as_bytes().to_vec()))
}

fn apply(fs: &Fs, op: &Op) {
    let _ = match op {
        Op::Mkdir(p) => parent_of(fs, p).map(|(d, n)| fs.mkdir(d, &n, 0o755, ROOT).map(|_| ())),
        Op::Create(p) => parent_of(fs, p).map(|(d, n)| fs.create(d, &n, libc::S_IFREG | 0o600, 0, b"", ROOT, true).map(|_| ())),
        Op::Symlink(p, t) => parent_of(fs, p).map(|(d, n)| fs.symlink(d, &n, t.as_bytes(), ROOT).map(|_| ())),
        Op::Unlink(p) => parent_of(fs, p).map(|(d, n)| fs.unlink(d, &n)),
        Op::Rmdir(p) => parent_of(fs, p).map(|(d, n)| fs.rmdir(d, &n)),
        Op::Rename(a, b) => match (parent_of(fs, a), parent_of(fs, b)) {
            (Some((sd, sn)), Some((dd, dn))) => Some(fs.rename(sd, &sn, dd, &dn, RenameFlags::default())),
            _ => None,
        },
        Op::Chmod(p, mode) => fs.resolve(ROOT_INO, p.as_bytes(), follow(false, None), MOUNT).ok().and_then(|r| r.ino()).map(|ino| {
            fs.setattr(ino, kura_fs::SetAttr { mode: Some(*mode), ..kura_fs::SetAttr::default() }).map(|_| ())
        }),
        Op::Walk { .. } => None,
    };
}

/// What a walk returns, comparable across instances (errors by errno; inodes whole).
fn outcome(fs: &Fs, path: &str, last: bool, user: bool) -> Result<(Resolved, Option<Inode>), i32> {
    let cred = Cred { uid: 1000, gid: 1000, groups: Vec::new() };
    fs.resolve_inode(ROOT_INO, path.as_bytes(), follow(last, user.then_some(&cred)), MOUNT).map_err(|e: FsError| e.errno())
}

fn check_walks_match_fresh_instances(kv: Arc<dyn Kv>, name: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let config = FsConfig { name: name.into(), ..FsConfig::default() };
    // The writer and the walker share a table of names, as two processes of a host do; the
    // fresh instances have none.
    let table = tempfile::tempdir().unwrap();
    let sharing = FsConfig { shared_names_path: Some(table.path().join("names")), ..config.clone() };
    let writer = Fs::open(kv.clone(), sharing.clone(), ROOT).unwrap();
    let walker = Fs::open(kv.clone(), sharing, ROOT).unwrap();
    for op in ops {
        apply(&writer, op);
        if let Op::Walk { path, last, user } = op {
            // The walker walks the path twice (the second time from what the first taught it)
            // and an instance that has seen nothing walks it once: all three agree.
            let first = outcome(&walker, path, *last, *user);
            let second = outcome(&walker, path, *last, *user);
            let fresh = Fs::open(kv.clone(), config.clone(), ROOT).unwrap();
            let expected = outcome(&fresh, path, *last, *user);
            prop_assert_eq!(&first, &expected, "first walk of {}", path);
            prop_assert_eq!(&second, &expected, "second walk of {}", path);
            // The last name looked up in its directory, with its inode, as FUSE looks it up.
            if let Some((dir, name)) = parent_of(&fresh, path.trim_end_matches('/')) {
                let walker_found = walker.lookup_inode(dir, &name).map_err(|e| e.errno());
                prop_assert_eq!(walker_found, fresh.lookup_inode(dir, &name).map_err(|e| e.errno()), "lookup of {}", path);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn walks_with_predictions_return_what_fresh_walks_return(ops in prop::collection::vec(op_strategy(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        check_walks_match_fresh_instances(embedded(dir.path()), "model", &ops)?;
    }
}

#[test]
fn walks_over_two_memcached_nodes_return_what_fresh_walks_return() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(2).ok_or("no memcached"));
    run_named_cases(24, &prop::collection::vec(op_strategy(), 1..40), |name, ops| check_walks_match_fresh_instances(kv.clone(), name, &ops));
}
