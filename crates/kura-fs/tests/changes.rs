//! Namespace changes right after the path walk that found their directory: the walk reads the
//! directory's inode with its bucket (`Fs::resolve_for_change`, `Fs::resolve_parent`), and the
//! change checks and swaps from those copies instead of reading them again; a file made to be
//! opened lists its opener from the start; the last name of a file nobody has open goes with
//! its record in one conditional delete. Counted over a real memcached, and checked against a
//! model: two instances (two processes, for the pool) change one tree from their copies, which
//! the other's changes keep making stale, and every result and the tree after each change
//! must be what instances that remember nothing get.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{Counted, embedded, memcached_nodes, run_named_cases};
use kura_fs::ns::Cred;
use kura_fs::path::{Follow, Resolved};
use kura_fs::{Fs, FsConfig, FsError, Kv, Owner, ROOT_INO, RenameFlags};
use kura_testkit::try_or_skip;
use proptest::prelude::*;

const MOUNT: &[u8] = b"/kura";
const ROOT: Owner = Owner { uid: 0, gid: 0 };

fn named(name: &str) -> FsConfig {
    FsConfig { name: name.into(), ..FsConfig::default() }
}

fn follow(searcher: Option<&Cred>) -> Follow<'_> {
    Follow { last: false, searcher }
}

/// `parent` and name of a path whose last name is missing, as the preload's `mkdir`, `creat`
/// and `symlink` resolve it.
fn missing(fs: &Fs, path: &str, searcher: Option<&Cred>) -> (u64, Vec<u8>) {
    match fs.resolve_parent(ROOT_INO, path.as_bytes(), follow(searcher), MOUNT).unwrap() {
        Resolved::Missing { parent, name } => (parent, name),
        other => panic!("{path}: {other:?}"),
    }
}

#[test]
fn changes_after_a_walk_cost_few_round_trips() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(1).ok_or("no memcached"));
    let counted = Arc::new(Counted::new(kv.clone()));
    let fs = Fs::open(counted.clone(), named("counted"), ROOT).unwrap();
    let user = Cred { uid: 1000, gid: 1000, groups: Vec::new() };
    let mut dir = ROOT_INO;
    for name in ["a", "b", "c"] {
        dir = fs.mkdir(dir, name.as_bytes(), 0o777, ROOT).unwrap().ino;
    }
    // The first file takes this process's range of inode numbers (two round trips, once).
    fs.create(dir, b"first", libc::S_IFREG | 0o644, 0, b"", ROOT, true).unwrap();
    let cost = |f: &mut dyn FnMut()| {
        let (r0, w0) = counted.calls();
        f();
        let (r1, w1) = counted.calls();
        (r1 - r0, w1 - w0)
    };

    for searcher in [None, Some(&user)] {
        let tag = if searcher.is_some() { "u" } else { "r" };
        let file = format!("a/b/c/new-{tag}");
        // Walked once, so the walk below is one round trip (see read_ahead.rs).
        fs.resolve_parent(ROOT_INO, file.as_bytes(), follow(searcher), MOUNT).unwrap();
        let (walk_reads, walk_writes) = cost(&mut || {
            missing(&fs, &file, searcher);
        });
        assert_eq!((walk_reads, walk_writes), (1, 0), "{file}: the walk with the directory's inode");
        let (parent, name) = missing(&fs, &file, searcher);
        let mut made = None;
        let (reads, writes) = cost(&mut || {
            let check = fs.getattr_fresh(parent).unwrap();
            if let Some(cred) = searcher {
                cred.check_create(&check).unwrap();
            }
            made = Some(fs.create_open(parent, &name, 0o644, ROOT, true).unwrap());
        });
        let (inode, created) = made.unwrap();
        assert!(created);
        assert_eq!(reads, 0, "{file}: the permission check and the create read nothing the walk read");
        assert_eq!(writes, 1, "{file}: the new inode, the directory's bucket and its times, together");
        let (reads, writes) = cost(&mut || {
            let node = fs.open_node_created(&inode).unwrap();
            fs.release(&node).unwrap();
        });
        assert_eq!((reads, writes), (0, 0), "{file}: an open that made the file records nothing more; its close leaves the opener for later");
        let (reads, writes) = cost(&mut || fs.leave_lingering().unwrap());
        assert_eq!((reads, writes), (1, 1), "{file}: the opener left in a batch: the records read together, swapped together");
        let opener_free = fs.getattr(inode.ino).unwrap();
        assert!(opener_free.openers.is_empty(), "the close removed this process from the openers");
        // Written and closed: the data, then one swap for the size and the opener together.
        let (reads, writes) = cost(&mut || {
            let node = fs.open_node(&opener_free).unwrap();
            fs.write(&node, 0, b"data", kura_fs::WriteMode::Buffered).unwrap();
            fs.release(&node).unwrap();
        });
        assert_eq!((reads, writes), (0, 3), "{file}: the opener recorded; the chunk; the size and the opener's removal in one swap");
        let written = fs.getattr(inode.ino).unwrap();
        assert_eq!((written.size, written.openers.len()), (4, 0), "{file}: size written back, opener removed");

        // Removal: the walk (with the victim's inode), then the name, the directory's times,
        // the record, the data.
        let mut victim = None;
        let (reads, _) = cost(&mut || {
            victim = Some(fs.resolve_for_change(ROOT_INO, file.as_bytes(), follow(searcher), MOUNT).unwrap());
        });
        assert_eq!(reads, 1, "{file}: the walk, the directory's inode and the victim's");
        let (Resolved::Found { parent, name, .. }, Some(walked)) = victim.unwrap() else { panic!("{file} not found") };
        assert_eq!(walked.ino, inode.ino);
        let (reads, writes) = cost(&mut || {
            let dir = fs.getattr_fresh(parent).unwrap();
            if let Some(cred) = searcher {
                cred.check_delete(&dir, &walked).unwrap();
            }
            fs.unlink(parent, &name).unwrap();
        });
        assert_eq!(reads, 0, "{file}: the unlink read nothing the walk read");
        assert_eq!(writes, 3, "{file}: the bucket and the directory's times together, the record, the data");
        assert!(matches!(fs.getattr(inode.ino), Err(FsError::NotFound)));
        assert!(matches!(fs.resolve(ROOT_INO, file.as_bytes(), follow(None), MOUNT).unwrap(), Resolved::Missing { .. }));
    }

    // A directory made and removed the same way.
    fs.resolve_parent(ROOT_INO, b"a/b/c/sub", follow(None), MOUNT).unwrap();
    let (parent, name) = missing(&fs, "a/b/c/sub", None);
    let (reads, writes) = cost(&mut || {
        fs.mkdir(parent, &name, 0o755, ROOT).unwrap();
    });
    assert_eq!((reads, writes), (0, 2), "mkdir after its walk: the inode and the entry together, then the parent's link");
    let c = fs.getattr(parent).unwrap();
    assert_eq!(c.nlink, 3, "the new directory's `..` counts in its parent");

    // Another process changes the directory between the walk and the change: the copies are
    // stale, and the change reads again rather than lose the other's work.
    let other = Fs::open(kv.clone(), named("counted"), ROOT).unwrap();
    let (parent, name) = missing(&fs, "a/b/c/late", None);
    other.create(parent, b"elsewhere", libc::S_IFREG | 0o644, 0, b"", ROOT, true).unwrap();
    other.create(parent, b"late", libc::S_IFREG | 0o600, 0, b"", ROOT, true).unwrap();
    assert!(matches!(fs.create(parent, &name, libc::S_IFREG | 0o644, 0, b"", ROOT, true), Err(FsError::Exists) | Ok(_)));
    let names: Vec<Vec<u8>> = fs.readdir(parent).unwrap().into_iter().map(|e| e.name).collect();
    for expected in [&b"first"[..], b"sub", b"elsewhere", b"late"] {
        assert!(names.iter().any(|n| n == expected), "{} lost: {names:?}", String::from_utf8_lossy(expected));
    }
    // The late name is the other's file (mode 0600), whatever this one's create returned.
    let (_, late) = fs.lookup_inode(parent, b"late").unwrap().unwrap();
    assert_eq!(late.mode & 0o777, 0o600);
    // Opened elsewhere: the unlink leaves the data to the other's last close.
    let (_, elsewhere) = other.lookup_inode(parent, b"elsewhere").unwrap().unwrap();
    let node = other.open_node(&elsewhere).unwrap();
    let _ = fs.resolve_for_change(ROOT_INO, b"a/b/c/elsewhere", follow(None), MOUNT).unwrap();
    fs.unlink(parent, b"elsewhere").unwrap();
    assert_eq!(other.getattr(elsewhere.ino).unwrap().nlink, 0, "kept while open elsewhere");
    // The other writes and closes: its write-back's swap leaves the openers, and the file
    // without names or openers goes.
    other.write(&node, 0, b"late data", kura_fs::WriteMode::Buffered).unwrap();
    other.release(&node).unwrap();
    assert!(matches!(fs.getattr(elsewhere.ino), Err(FsError::NotFound)), "deleted at the other's close");
}

/// Changes to one tree, made by path as the preload makes them.
#[derive(Debug, Clone)]
enum Op {
    Mkdir(String),
    Create(String),
    /// Create and open (a file made by the open lists its opener from the start), unlink
    /// while open, write, close.
    CreateOpen(String),
    Symlink(String),
    Unlink(String),
    Rmdir(String),
    Rename(String, String),
    Link(String, String),
}

/// A small file opened to be read (`Fs::open_node_reading`): the swap that records the opener
/// and the read of the first chunk go out together, so the open and the first read cost one
/// round trip; the close leaves the opener for a later batch. A plain open reads the chunk
/// at the read, a second round trip.
#[test]
fn an_open_to_read_a_small_file_is_one_round_trip() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(1).ok_or("no memcached"));
    let writer = Fs::open(kv.clone(), named("counted"), ROOT).unwrap();
    let (inode, created) = writer.create_open(ROOT_INO, b"small", 0o644, ROOT, true).unwrap();
    assert!(created);
    let node = writer.open_node_created(&inode).unwrap();
    writer.write(&node, 0, b"some bytes", kura_fs::WriteMode::Buffered).unwrap();
    writer.release(&node).unwrap();
    for (reading, expected) in [(true, (0, 1)), (false, (1, 1))] {
        let counted = Arc::new(Counted::new(kv.clone()));
        let reader = Fs::open(counted.clone(), named("counted"), ROOT).unwrap();
        let inode = reader.getattr(inode.ino).unwrap();
        let (r0, w0) = counted.calls();
        let node = if reading { reader.open_node_reading(&inode) } else { reader.open_node(&inode) }.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(reader.read(&node, 0, &mut buf).unwrap(), 10);
        assert_eq!(&buf[..10], b"some bytes");
        reader.release(&node).unwrap();
        let (r1, w1) = counted.calls();
        assert_eq!((r1 - r0, w1 - w0), expected, "open (reading: {reading}), read and close: (reads, writes)");
        reader.leave_lingering().unwrap();
    }
}

fn path_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 1..4).prop_map(|parts| parts.join("/"))
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => path_strategy().prop_map(Op::Mkdir),
        2 => path_strategy().prop_map(Op::Create),
        1 => path_strategy().prop_map(Op::CreateOpen),
        1 => path_strategy().prop_map(Op::Symlink),
        2 => path_strategy().prop_map(Op::Unlink),
        2 => path_strategy().prop_map(Op::Rmdir),
        2 => (path_strategy(), path_strategy()).prop_map(|(a, b)| Op::Rename(a, b)),
        1 => (path_strategy(), path_strategy()).prop_map(|(a, b)| Op::Link(a, b)),
    ]
}

/// Applies `op` through `fs` as the preload does (a walk that reads the directory's inode, the
/// checks from it, the change) when `walker` is `fs`; with another `walker`, `fs` changes
/// directories by number as FUSE does, from whatever copies it has; the outcome as an errno.
fn apply(fs: &Fs, walker: &Fs, op: &Op) -> Result<(), i32> {
    let errno = |e: FsError| e.errno();
    let for_new = |path: &str| match walker.resolve_parent(ROOT_INO, path.as_bytes(), follow(None), MOUNT).map_err(errno)? {
        Resolved::Missing { parent, name } => {
            fs.getattr_fresh(parent).map_err(errno)?;
            Ok((parent, name))
        }
        Resolved::Found { .. } => Err(libc::EEXIST),
        Resolved::Outside(_) => Err(libc::EXDEV),
    };
    let for_old = |path: &str| match walker.resolve_for_change(ROOT_INO, path.as_bytes(), follow(None), MOUNT).map_err(errno)? {
        (Resolved::Found { parent, name, entry }, _) if !name.is_empty() => {
            fs.getattr_fresh(parent).map_err(errno)?;
            Ok((parent, name, entry))
        }
        (Resolved::Found { .. }, _) => Err(libc::EBUSY),
        (Resolved::Missing { .. }, _) => Err(libc::ENOENT),
        (Resolved::Outside(_), _) => Err(libc::EXDEV),
    };
    match op {
        Op::Mkdir(p) => for_new(p).and_then(|(d, n)| fs.mkdir(d, &n, 0o755, ROOT).map(drop).map_err(errno)),
        Op::Create(p) => for_new(p).and_then(|(d, n)| fs.create(d, &n, libc::S_IFREG | 0o644, 0, b"", ROOT, true).map(drop).map_err(errno)),
        Op::CreateOpen(p) => {
            let (d, n) = for_new(p)?;
            let (inode, made) = fs.create_open(d, &n, 0o644, ROOT, true).map_err(errno)?;
            let node = if made { fs.open_node_created(&inode) } else { fs.open_node(&inode) }.map_err(errno)?;
            // Unlinked while open: its record stays (no name, no link) and its data can be
            // written to the pool and read back until the close; then it is gone.
            fs.unlink(d, &n).map_err(errno)?;
            assert_eq!(walker.getattr(inode.ino).map(|i| i.nlink).map_err(errno), Ok(0), "{p}: unlinked while open");
            fs.write(&node, 0, b"still here", kura_fs::WriteMode::Buffered).unwrap();
            fs.fsync(&node).unwrap();
            let mut back = vec![0; 10];
            let read = fs.read(&node, 0, &mut back).unwrap();
            assert_eq!(&back[..read], b"still here");
            // Dirty again at the close: its write-back is the swap that leaves the openers.
            fs.write(&node, 10, b"!", kura_fs::WriteMode::Buffered).unwrap();
            fs.release(&node).unwrap();
            match fs.getattr(inode.ino) {
                Err(FsError::NotFound) => Ok(()),
                other => panic!("{p}: an unlinked file outlived its only open: {other:?}"),
            }
        }
        Op::Symlink(p) => for_new(p).and_then(|(d, n)| fs.symlink(d, &n, b"a/b", ROOT).map(drop).map_err(errno)),
        Op::Unlink(p) => for_old(p).and_then(|(d, n, e)| if e.dtype == libc::DT_DIR { Err(libc::EISDIR) } else { fs.unlink(d, &n).map_err(errno) }),
        Op::Rmdir(p) => for_old(p).and_then(|(d, n, _)| fs.rmdir(d, &n).map_err(errno)),
        Op::Rename(a, b) => {
            let (sd, sn, _) = for_old(a)?;
            let (dd, dn) = match walker.resolve_for_change(ROOT_INO, b.as_bytes(), follow(None), MOUNT).map_err(errno)? {
                (Resolved::Found { parent, name, .. } | Resolved::Missing { parent, name }, _) if !name.is_empty() => (parent, name),
                (Resolved::Found { .. }, _) => return Err(libc::EBUSY),
                (Resolved::Outside(_), _) => return Err(libc::EXDEV),
                _ => return Err(libc::ENOENT),
            };
            fs.rename(sd, &sn, dd, &dn, RenameFlags::default()).map_err(errno)
        }
        Op::Link(a, b) => {
            let (_, _, e) = for_old(a)?;
            let (d, n) = for_new(b)?;
            fs.link(e.ino, d, &n).map(drop).map_err(errno)
        }
    }
}

/// The tree under the root as names, types, link counts, modes, sizes and symlink targets
/// (not inode numbers, nor times): comparable between two file systems.
fn tree(fs: &Fs) -> BTreeMap<String, (u8, u32, u32, u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(ROOT_INO, String::new())];
    while let Some((dir, prefix)) = todo.pop() {
        for entry in fs.readdir(dir).unwrap() {
            let path = format!("{prefix}/{}", String::from_utf8_lossy(&entry.name));
            let inode = fs.getattr(entry.ino).unwrap();
            if entry.dtype == libc::DT_DIR {
                todo.push((entry.ino, path.clone()));
            }
            out.insert(path, (entry.dtype, inode.nlink, inode.mode, inode.size, inode.target));
        }
    }
    out
}

/// Two instances alternate (each change by one makes the other's copies stale), walking to
/// each change or (`by_number`) changing directories a third instance found, against a file
/// system of the same pool where every change is made by a new instance that remembers
/// nothing.
fn check_changes_match_fresh_instances(kv: Arc<dyn Kv>, case: &str, ops: &[(bool, bool, Op)]) -> Result<(), TestCaseError> {
    let (copies, fresh) = (named(&format!("{case}-copies")), named(&format!("{case}-fresh")));
    let a = Fs::open(kv.clone(), copies.clone(), ROOT).unwrap();
    let b = Fs::open(kv.clone(), copies.clone(), ROOT).unwrap();
    let reference = || Fs::open(kv.clone(), fresh.clone(), ROOT).unwrap();
    reference();
    for (by_a, by_number, op) in ops {
        let (fs, other) = if *by_a { (&a, &b) } else { (&b, &a) };
        let got = if *by_number { apply(fs, &Fs::open(kv.clone(), copies.clone(), ROOT).unwrap(), op) } else { apply(fs, fs, op) };
        let expected = {
            let fs = reference();
            apply(&fs, &fs, op)
        };
        prop_assert_eq!(got, expected, "{:?}", op);
        prop_assert_eq!(tree(other), tree(&reference()), "after {:?}", op);
    }
    Ok(())
}

fn ops_strategy() -> impl Strategy<Value = Vec<(bool, bool, Op)>> {
    prop::collection::vec((any::<bool>(), any::<bool>(), op_strategy()), 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn changes_from_copies_match_changes_by_fresh_instances(ops in ops_strategy()) {
        let dir = tempfile::tempdir().unwrap();
        check_changes_match_fresh_instances(embedded(dir.path()), "model", &ops)?;
    }
}

#[test]
fn changes_over_two_memcached_nodes_match_changes_by_fresh_instances() {
    let (_memcached, kv) = try_or_skip!(memcached_nodes(2).ok_or("no memcached"));
    run_named_cases(16, &ops_strategy(), |name, ops| check_changes_match_fresh_instances(kv.clone(), name, &ops));
}
