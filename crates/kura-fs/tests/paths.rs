//! Path walks end as the kernel's do on the same tree: `d/.` and `d/` name `d` and follow a
//! symbolic link there, `f/.` is ENOTDIR, `..` is taken after the link before it (the
//! physical parent), `..` out of the root and back into the mount stays in the file system,
//! and a create's trailing slash neither follows nor asks for a directory. The tree is built
//! on a host directory too, and every case's answer is compared with the kernel's.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use common::embedded;
use kura_fs::path::{Follow, Resolved};
use kura_fs::{Fs, FsConfig, FsError, Owner, ROOT_INO};

const MOUNT: &[u8] = b"/kura";
const ROOT: Owner = Owner { uid: 0, gid: 0 };

fn follow(last: bool) -> Follow<'static> {
    Follow { last, searcher: None }
}

/// `a/b/c/f`, `a/f2`, `lnk -> a/b/c`, `flnk -> a/b/c/f`, `loop -> loop`, `out -> /tmp`,
/// `abs -> /kura/a`: in kura, and (without `out` and `abs`, whose targets differ) on the host.
fn build(fs: &Fs, host: &Path) {
    let a = fs.mkdir(ROOT_INO, b"a", 0o755, ROOT).unwrap();
    let b = fs.mkdir(a.ino, b"b", 0o755, ROOT).unwrap();
    let c = fs.mkdir(b.ino, b"c", 0o755, ROOT).unwrap();
    fs.create(c.ino, b"f", libc::S_IFREG | 0o644, 0, b"", ROOT, true).unwrap();
    fs.create(a.ino, b"f2", libc::S_IFREG | 0o644, 0, b"", ROOT, true).unwrap();
    fs.symlink(ROOT_INO, b"lnk", b"a/b/c", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"flnk", b"a/b/c/f", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"loop", b"loop", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"out", b"/tmp", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"abs", b"/kura/a", ROOT).unwrap();
    std::fs::create_dir_all(host.join("a/b/c")).unwrap();
    std::fs::write(host.join("a/b/c/f"), b"").unwrap();
    std::fs::write(host.join("a/f2"), b"").unwrap();
    std::os::unix::fs::symlink("a/b/c", host.join("lnk")).unwrap();
    std::os::unix::fs::symlink("a/b/c/f", host.join("flnk")).unwrap();
    std::os::unix::fs::symlink("loop", host.join("loop")).unwrap();
}

/// A file system on a fresh embedded store with [`build`]'s tree, and the host's copy of it
/// in `host` of the directory returned (which must outlive both).
fn tree() -> (tempfile::TempDir, Arc<Fs>) {
    let dir = tempfile::tempdir().unwrap();
    let fs = Fs::open(embedded(dir.path()), FsConfig { name: "paths".into(), ..FsConfig::default() }, ROOT).unwrap();
    build(&fs, &dir.path().join("host"));
    (dir, fs)
}

/// What `lstat` says of a resolved path, as the host's answer is put: the name of the file
/// it found (the last name walked, "" for the root) or the errno.
fn kura_says(fs: &Fs, path: &str) -> String {
    match fs.resolve(ROOT_INO, path.as_bytes(), follow(false), MOUNT) {
        Ok(Resolved::Found { entry, .. }) => format!("ino of {}", name_of(fs, entry.ino)),
        Ok(Resolved::Missing { .. }) => "ENOENT".into(),
        Ok(Resolved::Outside(out)) => format!("outside {}", String::from_utf8_lossy(&out)),
        Err(e) => errno_name(e.errno()),
    }
}

fn host_says(host: &Path, path: &str, kura_names: &[(u64, &str)]) -> String {
    match std::fs::symlink_metadata(host.join(path)) {
        Ok(meta) => {
            let name = kura_names.iter().find(|(ino, _)| *ino == meta.ino()).map_or("?", |(_, n)| n);
            format!("ino of {name}")
        }
        Err(e) => errno_name(e.raw_os_error().unwrap()),
    }
}

fn errno_name(errno: i32) -> String {
    match errno {
        libc::ENOENT => "ENOENT".into(),
        libc::ENOTDIR => "ENOTDIR".into(),
        libc::ELOOP => "ELOOP".into(),
        e => format!("errno {e}"),
    }
}

/// The path of `ino` from the root, by the names this test made.
fn name_of(fs: &Fs, ino: u64) -> String {
    for name in ["", "a", "a/b", "a/b/c", "a/b/c/f", "a/f2", "lnk", "flnk", "loop"] {
        if fs.resolve(ROOT_INO, name.as_bytes(), follow(false), MOUNT).ok().and_then(|r| r.ino()) == Some(ino) {
            return name.to_owned();
        }
    }
    format!("inode {ino}")
}

#[test]
fn walks_end_where_the_kernels_do() {
    let (dir, fs) = tree();
    let host = dir.path().join("host");
    // The host's inode numbers of the names, to say which file the host found.
    let names = ["", "a", "a/b", "a/b/c", "a/b/c/f", "a/f2", "lnk", "flnk", "loop"];
    let host_inos: Vec<(u64, &str)> = names.iter().map(|n| (std::fs::symlink_metadata(host.join(n)).unwrap().ino(), *n)).collect();
    let cases = [
        "lnk", "lnk/", "lnk/.", "lnk/..", "lnk/../..", "lnk/../../f2", "lnk/./f", "lnk//.//", "a/b/c/f/", "a/b/c/f/.",
        "a/b/c/f/..", "flnk", "flnk/", "flnk/.", "missing/.", "missing/..", "a/./b/../b/c/f", "loop", "loop/", "loop/.",
        "a/b/../../lnk/../f", "a/..", "a/../.",
    ];
    for case in cases {
        let kernel = host_says(&host, case, &host_inos);
        assert_eq!(kura_says(&fs, case), kernel, "{case}");
    }
    // A missing last name with a slash is still a name to make (`mkdir("new/")`).
    assert!(matches!(fs.resolve(ROOT_INO, b"new/", follow(false), MOUNT), Ok(Resolved::Missing { .. })));
}

#[test]
fn out_of_the_root_and_back() {
    let (_dir, fs) = tree();
    let a = fs.resolve(ROOT_INO, b"a", follow(false), MOUNT).unwrap().ino();
    assert_eq!(fs.resolve(ROOT_INO, b"../kura/a", follow(false), MOUNT).unwrap().ino(), a);
    assert_eq!(fs.resolve(ROOT_INO, b"a/../../kura/./a/b/..", follow(false), MOUNT).unwrap().ino(), a);
    assert_eq!(fs.resolve(ROOT_INO, b"abs/b/../../../kura/a", follow(false), MOUNT).unwrap().ino(), a);
    let outside = |path: &[u8]| match fs.resolve(ROOT_INO, path, follow(false), MOUNT).unwrap() {
        Resolved::Outside(out) => String::from_utf8(out).unwrap(),
        other => panic!("{}: {other:?}", String::from_utf8_lossy(path)),
    };
    assert_eq!(outside(b"../etc/passwd"), "/etc/passwd");
    assert_eq!(outside(b".."), "/");
    assert_eq!(outside(b"../kura/.."), "/");
    assert_eq!(outside(b"../kurax/y/"), "/kurax/y/");
    // A link out of the mount keeps the caller's `.` and `/`: the kernel must see them.
    assert_eq!(outside(b"out/."), "/tmp/.");
    assert_eq!(outside(b"out/x/"), "/tmp/x/");
}

#[test]
fn physical_paths_take_links_before_dotdot() {
    let (_dir, fs) = tree();
    let physical = |path: &str| {
        let (resolved, names) = fs.resolve_physical(path.as_bytes(), follow(true), MOUNT).unwrap();
        assert!(matches!(resolved, Resolved::Found { .. }), "{path}: {resolved:?}");
        names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect::<Vec<_>>().join("/")
    };
    assert_eq!(physical("lnk"), "a/b/c");
    assert_eq!(physical("lnk/.."), "a/b");
    assert_eq!(physical("lnk/../../.."), "");
    assert_eq!(physical("abs/b/../../a/b"), "a/b");
    assert_eq!(physical("../kura/lnk/.."), "a/b");
    assert_eq!(physical("flnk"), "a/b/c/f");
}

#[test]
fn a_creates_trailing_slash_neither_follows_nor_asks_for_a_directory() {
    let (_dir, fs) = tree();
    let flnk = fs.resolve(ROOT_INO, b"flnk", follow(false), MOUNT).unwrap().ino();
    // `link(x, "flnk/")` and `mkdir("a/f2/")` are EEXIST in the kernel, not ENOTDIR.
    assert_eq!(fs.resolve_parent(ROOT_INO, b"flnk/", follow(false), MOUNT).unwrap().ino(), flnk);
    assert!(matches!(fs.resolve_parent(ROOT_INO, b"a/f2//", follow(false), MOUNT), Ok(Resolved::Found { .. })));
    assert!(matches!(fs.resolve_parent(ROOT_INO, b"loop/", follow(false), MOUNT), Ok(Resolved::Found { .. })));
    assert!(matches!(fs.resolve_parent(ROOT_INO, b"a/new/", follow(false), MOUNT), Ok(Resolved::Missing { .. })));
    assert_eq!(fs.resolve_parent(ROOT_INO, b"a/f2/new", follow(false), MOUNT).unwrap_err(), FsError::NotDir);
}

#[test]
fn a_links_trailing_slash_applies_to_the_last_name() {
    let (_dir, fs) = tree();
    fs.symlink(ROOT_INO, b"to_new", b"new/", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"to_f2", b"a/f2/", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"to_dot", b"a/b/.", ROOT).unwrap();
    fs.symlink(ROOT_INO, b"to_gone_dot", b"gone/.", ROOT).unwrap();
    // A missing name reached through `new/` says so (open(O_CREAT) through it is EISDIR).
    match fs.resolve(ROOT_INO, b"to_new", follow(true), MOUNT).unwrap() {
        Resolved::Missing { name, .. } => assert_eq!(name, b"new/"),
        other => panic!("{other:?}"),
    }
    assert_eq!(fs.resolve(ROOT_INO, b"to_f2", follow(true), MOUNT).unwrap_err(), FsError::NotDir);
    let b = fs.resolve(ROOT_INO, b"a/b", follow(false), MOUNT).unwrap().ino();
    assert_eq!(fs.resolve(ROOT_INO, b"to_dot", follow(true), MOUNT).unwrap().ino(), b);
    assert_eq!(fs.resolve(ROOT_INO, b"to_gone_dot", follow(true), MOUNT).unwrap_err(), FsError::NotFound);
    // Not followed, the link is just a link.
    assert!(matches!(fs.resolve(ROOT_INO, b"to_new", follow(false), MOUNT), Ok(Resolved::Found { .. })));
}
