//! A randomized differential test: `tests/py/random_ops.py` makes the same random file-system
//! operations (opens with random flags, writes past EOF, truncates, unlinks of open files,
//! renames onto whatever is there, symlinks, hard links, ...) on a host directory, under the
//! preload and through the FUSE mount, and prints one line per operation; kura's lines must
//! be the kernel's. A difference fails with the seed, the operation's index and both lines;
//! `python3 tests/py/random_ops.py DIR SEED 1 OPS` replays one seed.
//!
//! `tests/py/regressions.py` keeps one small case for each divergence found so far.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Env, check, workspace};
use kura_testkit::ChildGuard;

/// Seeds per run and operations per seed: 48,000 operations, ~10 s under the preload.
const SEEDS: u32 = 120;
const OPS_PER_SEED: u32 = 400;
/// Fewer through FUSE: every operation is a round trip through the kernel (~2x slower).
const FUSE_SEEDS: u32 = 60;
/// Seeds of the two-process runs (each starts a second Python process under the preload).
const TWO_PROCESS_SEEDS: u32 = 40;
const MOUNT_TIMEOUT_S: u64 = 30;
const POLL_INTERVAL_MS: u64 = 20;

fn script(name: &str) -> PathBuf {
    workspace().join("crates/kura-preload/tests/py").join(name)
}

fn python(name: &str, root: &Path, args: &[String]) -> Vec<String> {
    let mut cmd: Vec<String> = vec![
        "python3".into(),
        script(name).display().to_string(),
        root.display().to_string(),
    ];
    cmd.extend_from_slice(args);
    cmd
}

/// The standard output of `argv` run directly (no preload); panics unless it succeeds.
fn run_direct(argv: &[String]) -> String {
    let out = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    stdout_of(&out, argv)
}

fn stdout_of(out: &Output, what: &[String]) -> String {
    let what: Vec<&str> = what.iter().map(String::as_str).collect();
    check(out, &what);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd` on a fresh host directory (the reference).
fn on_host(env: &Env, cmd: impl Fn(&Path) -> Vec<String>) -> String {
    let root = env.dir.path().join("host");
    std::fs::create_dir(&root).unwrap();
    run_direct(&cmd(&root))
}

/// Runs `cmd` under `kura fs run` on the mount's root.
fn under_preload(env: &Env, cmd: impl Fn(&Path) -> Vec<String>) -> String {
    let argv = cmd(Path::new("/kura"));
    let program: Vec<&str> = argv.iter().map(String::as_str).collect();
    stdout_of(&env.output(&program), &argv)
}

/// Runs `cmd` on a `kura fs mount` of its own data directory, or `None` (with the reason
/// printed) where FUSE cannot be mounted here.
fn through_fuse(env: &Env, cmd: impl Fn(&Path) -> Vec<String>) -> Option<String> {
    let mount = Mount::new(env)?;
    Some(run_direct(&cmd(&mount.point)))
}

/// Fails at the first line where `got` differs from the kernel's `want`; `place` says where
/// that line is.
fn compare(what: &str, want: &str, got: &str, place: impl Fn(&str) -> String) {
    let (mut want_lines, mut got_lines) = (want.lines(), got.lines());
    loop {
        match (want_lines.next(), got_lines.next()) {
            (None, None) => return,
            (w, g) if w == g => continue,
            (w, g) => {
                let at = place(w.or(g).unwrap_or_default());
                panic!(
                    "{what} differs from the kernel at {at}:\n  kernel: {}\n  kura:   {}",
                    w.unwrap_or("(no line)"),
                    g.unwrap_or("(no line)")
                );
            }
        }
    }
}

/// `kura fs mount` at a fresh directory, unmounted when dropped.
struct Mount {
    point: PathBuf,
    server: Option<ChildGuard>,
}

impl Mount {
    fn new(env: &Env) -> Option<Self> {
        if let Err(reason) = fuse_usable() {
            kura_testkit::skip(&format!("FUSE: {reason}"));
            return None;
        }
        let point = env.dir.path().join("mnt");
        std::fs::create_dir(&point).unwrap();
        let mut cmd = Command::new(common::kura());
        cmd.args(["fs", "mount"])
            .arg(&point)
            .arg("--data-dir")
            .arg(env.data_dir())
            .args(["--store-size", "2G"])
            // The copies of records it shares, with the test's own lock files.
            .env("KURA_FS_LOCK_DIR", env.dir.path().join("locks"));
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut server = ChildGuard::spawn("kura fs mount", &mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(MOUNT_TIMEOUT_S);
        while !is_mounted(&point) {
            assert!(
                server.try_wait().unwrap().is_none(),
                "kura fs mount exited before mounting"
            );
            assert!(
                Instant::now() < deadline,
                "{} not mounted after {MOUNT_TIMEOUT_S} s",
                point.display()
            );
            std::thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
        }
        Some(Self {
            point,
            server: Some(server),
        })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg("-z")
            .arg(&self.point)
            .status();
        if let Some(server) = self.server.take() {
            let _ = server.terminate(Duration::from_secs(10));
        }
    }
}

/// Why FUSE cannot be mounted here, if it cannot (the mount needs root and /dev/fuse).
fn fuse_usable() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match (root, Path::new("/dev/fuse").exists()) {
        (false, _) => Err("not root".into()),
        (true, false) => Err("no /dev/fuse".into()),
        (true, true) => kura_testkit::require_cmd("fusermount3").map(|_| ()),
    }
}

fn is_mounted(point: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(&*point.to_string_lossy()))
}

/// "seed S, operation I" of a line of random_ops.py.
fn seed_and_op(line: &str) -> String {
    let mut fields = line.split(' ');
    format!(
        "seed {}, operation {}",
        fields.next().unwrap_or("?"),
        fields.next().unwrap_or("?")
    )
}

/// The case a line of regressions.py is from.
fn case(line: &str) -> String {
    format!("case {}", line.split(' ').next().unwrap_or("?"))
}

fn random_ops(seeds: u32) -> impl Fn(&Path) -> Vec<String> {
    move |root| {
        python(
            "random_ops.py",
            root,
            &["0".into(), seeds.to_string(), OPS_PER_SEED.to_string()],
        )
    }
}

#[test]
fn random_operations_match_the_kernel() {
    let started = Instant::now();
    let (host_env, preload_env, fuse_env) = (Env::new(), Env::new(), Env::new());
    // The preload and FUSE runs at once: each mostly waits on its server.
    let fuse = std::thread::spawn(move || {
        let out = through_fuse(&fuse_env, random_ops(FUSE_SEEDS));
        drop(fuse_env);
        out
    });
    let want = on_host(&host_env, random_ops(SEEDS));
    compare(
        "the preload",
        &want,
        &under_preload(&preload_env, random_ops(SEEDS)),
        seed_and_op,
    );
    if let Some(got) = fuse.join().unwrap() {
        let want_fuse: String = want
            .lines()
            .take((FUSE_SEEDS * OPS_PER_SEED) as usize)
            .flat_map(|l| [l, "\n"])
            .collect();
        compare("the FUSE mount", &want_fuse, &got, seed_and_op);
    }
    eprintln!(
        "{SEEDS} seeds x {OPS_PER_SEED} operations ({FUSE_SEEDS} seeds through FUSE) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Two processes take turns at one seed's operations (`random_ops.py ... 2`), each with its
/// own descriptors: what one changed, read, keeps open or closed must show in the other's
/// next operation as on one kernel. Under the preload on a local kura server this crosses
/// every cache between processes: the copies of records kept while the server's change log
/// names no change to them, files closed but still recorded among their openers, a small
/// file's first chunk read with the open's swap, files open in both (read and written through
/// the pool), unlinks of files the other holds.
#[test]
fn two_processes_taking_turns_match_the_kernel() {
    let (host_env, preload_env) = (Env::new(), Env::new());
    let ops = |root: &Path| python("random_ops.py", root, &["0".into(), TWO_PROCESS_SEEDS.to_string(), OPS_PER_SEED.to_string(), "2".into()]);
    let want = on_host(&host_env, ops);
    assert_eq!(want.lines().count(), (TWO_PROCESS_SEEDS * OPS_PER_SEED) as usize);
    assert!(want.lines().any(|l| l.split(' ').nth(2) == Some("B")) && want.lines().any(|l| l.split(' ').nth(2) == Some("A")));
    compare("two processes under the preload", &want, &under_preload(&preload_env, ops), seed_and_op);
}

#[test]
fn divergences_found_so_far_match_the_kernel() {
    let (host_env, preload_env, fuse_env) = (Env::new(), Env::new(), Env::new());
    let cases = |root: &Path| python("regressions.py", root, &[]);
    let want = on_host(&host_env, cases);
    assert_eq!(want.lines().count(), 19, "{want}");
    compare(
        "the preload",
        &want,
        &under_preload(&preload_env, cases),
        case,
    );
    if let Some(got) = through_fuse(&fuse_env, cases) {
        compare("the FUSE mount", &want, &got, case);
    }
}
