//! A real process writing a real file is killed with SIGKILL at random moments, round after
//! round; after each kill the store reopens with every synced key at its exact value (or a
//! later one) and nothing corrupt.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kura_engine::{Engine, EngineConfig};

const KEYS: u64 = 3000;
const ROUNDS: u32 = 25;
/// How long the first rounds run, ms: short enough to kill the writer while it creates the
/// store (before, a kill after the file was allocated and before its superblock was written
/// left a file the next open refused as not a store).
const CREATION_ROUNDS_MS: [u64; 5] = [2, 6, 12, 25, 45];

fn value(op: u64) -> Vec<u8> {
    let len = [40usize, 700, 3000, 5000][(op % 4) as usize];
    let mut v = op.to_le_bytes().to_vec();
    let mut x = op.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    v
}

/// Runs the writer from `first` until killed after `run_for`; returns the last synced op.
fn run_writer(path: &Path, first: u64, run_for: Duration) -> Option<u64> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kura-crash-writer"))
        .arg(path)
        .arg(first.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn writer");
    let stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut last = None;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(n) = line.strip_prefix("synced ") {
                last = Some(n.parse::<u64>().expect("op number"));
            }
        }
        last
    });
    let started = Instant::now();
    while started.elapsed() < run_for {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("writer exited early: {status}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    reader.join().expect("reader thread")
}

#[test]
fn sigkill_never_loses_synced_writes() {
    let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
    let path = dir.path().join("killed.kura");
    let mut synced: Option<u64> = None;
    let mut rng = 0x1234_5678_9abc_def0u64;
    for round in 0..ROUNDS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // The first rounds end while the writer starts and creates the store.
        let run_for = Duration::from_millis(CREATION_ROUNDS_MS.get(round as usize).copied().unwrap_or(60 + rng % 700));
        let first = synced.map_or(0, |s| s + 1);
        if let Some(s) = run_writer(&path, first, run_for) {
            synced = Some(s);
        }
        // Killed before the store was whole: it is not there (a creation is renamed into
        // place once formatted), and nothing was acknowledged.
        if !path.exists() {
            assert_eq!(synced, None, "round {round}: the store is gone after a synced write");
            continue;
        }
        let engine = Engine::open(&path, &EngineConfig { size_bytes: None, ..EngineConfig::default() }).expect("reopen after SIGKILL");
        let Some(last) = synced else { continue };
        for k in 0..KEYS {
            let key = format!("k{k:06}").into_bytes();
            let got = engine.get(&key).unwrap_or_else(|e| panic!("round {round}: key {k}: {e}"));
            // The newest synced op for this key, if any.
            let newest_synced = (last >= k).then(|| last - (last - k) % KEYS);
            match (got, newest_synced) {
                (None, None) => {}
                (None, Some(op)) => panic!("round {round}: key {k} lost (synced op {op})"),
                (Some(item), expected) => {
                    let v = item.value();
                    let op = u64::from_le_bytes(v[..8].try_into().expect("op header"));
                    assert_eq!(op % KEYS, k, "round {round}: key {k} holds another key's value");
                    assert_eq!(v, value(op), "round {round}: key {k}: value of op {op} corrupt");
                    if let Some(expected) = expected {
                        assert!(op >= expected, "round {round}: key {k} went back to op {op} (synced {expected})");
                    }
                }
            }
        }
        drop(engine);
    }
    assert!(synced.is_some_and(|s| s > 2 * KEYS), "the writer made too little progress: {synced:?}");
}
