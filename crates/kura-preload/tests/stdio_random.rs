//! A randomized differential test of what `tests/py/random_ops.py` does not reach:
//! `tests/c/stdio_random.c` makes random C stdio calls (every fopen mode, fdopen, freopen,
//! setvbuf, reads and writes of every kind, seeks, the stream's descriptor used directly),
//! dup'd descriptors sharing an offset, pread/pwrite (O_APPEND included), parent and child
//! writing through inherited descriptors and leaving with exit or _exit, fcntl record locks and
//! flock between a parent and a child, ftruncate under a stream, mmap, sendfile and
//! copy_file_range, on a host directory and under the preload, and prints one line per
//! operation; kura's lines must be the kernel's. A difference fails with the seed, the
//! operation's index and both lines; `stdio_random DIR SEED 1 OPS` replays one seed.
//! `stdio_random DIR regressions` keeps one case for each divergence fixed so far.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use common::{Env, check, have, workspace};

/// Seeds per run and operations per seed: 18,000 operations, ~10 s under the preload.
const SEEDS: u32 = 60;
const OPS_PER_SEED: u32 = 300;

/// Builds tests/c/stdio_random.c into `env`'s directory.
fn build(env: &Env) -> PathBuf {
    let exe = env.dir.path().join("stdio_random");
    let src = workspace().join("crates/kura-preload/tests/c/stdio_random.c");
    let out = Command::new("gcc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    check(&out, &["gcc", "stdio_random.c"]);
    exe
}

/// The program's output on a fresh host directory (the reference) and under the preload.
fn both(env: &Env, exe: &Path, args: &[&str]) -> (String, String) {
    let root = env.dir.path().join("host");
    std::fs::create_dir(&root).unwrap();
    let out = Command::new(exe)
        .arg(&root)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    check(&out, args);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    let script = format!(
        "mkdir /kura/t && {} /kura/t {}",
        exe.display(),
        args.join(" ")
    );
    (want, env.sh(&script))
}

/// Fails at the first line where `got` differs from the kernel's `want`.
fn compare(want: &str, got: &str) {
    let (want, got): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let Some(at) = (0..want.len().max(got.len())).find(|&i| want.get(i) != got.get(i)) else {
        return;
    };
    let (w, g) = (want.get(at).copied(), got.get(at).copied());
    let mut fields = w.or(g).unwrap_or_default().split(' ');
    let (seed, op) = (fields.next().unwrap_or("?"), fields.next().unwrap_or("?"));
    panic!(
        "the preload differs from the kernel at seed {seed}, operation {op}:\n  kernel: {}\n  kura:   {}",
        w.unwrap_or("(no line)"),
        g.unwrap_or("(no line)")
    );
}

/// 60 seeds × 300 operations (kura and the kernel from the same seed; 200 more seeds by hand
/// pass too). Found, besides the regressions below: `freopen(NULL, …)` (glibc opens
/// `/proc/self/fd/N`, which led to the placeholder memfd instead of the kura file), `flock`
/// of a description first locked after a `fork`, POSIX locks kept after a `close` of another
/// descriptor of the file. Not generated (see the C source): a parent writing between its
/// child's writes, `sendfile` within one file.
#[test]
fn random_stdio_locks_and_forks_match_the_kernel() {
    if !have("gcc") {
        return kura_testkit::skip("no gcc to build tests/c/stdio_random.c");
    }
    let started = Instant::now();
    let env = Env::new();
    let exe = build(&env);
    let (want, got) = both(
        &env,
        &exe,
        &["0", &SEEDS.to_string(), &OPS_PER_SEED.to_string()],
    );
    assert_eq!(want.lines().count() as u32, SEEDS * (OPS_PER_SEED + 1));
    compare(&want, &got);
    eprintln!(
        "{SEEDS} seeds x {OPS_PER_SEED} operations in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// sendfile and copy_file_range onto an O_APPEND file (EINVAL, EBADF); copy_file_range
/// between overlapping ranges of one file (EINVAL) and its length cut to the source's size;
/// `freopen(NULL, …)`; POSIX locks dropped at the close of a dup'd descriptor; fcntl lock ranges from
/// the current offset or the end; F_GETLK's answer without a conflict.
#[test]
fn divergences_found_so_far_match_the_kernel() {
    if !have("gcc") {
        return kura_testkit::skip("no gcc to build tests/c/stdio_random.c");
    }
    let env = Env::new();
    let exe = build(&env);
    let (want, got) = both(&env, &exe, &["regressions"]);
    assert_eq!(want.lines().count(), 15, "{want}");
    assert_eq!(got, want, "the preload differs from the kernel");
}
