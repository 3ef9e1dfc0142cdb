//! Test helper for `tests/kill.rs`: writes a deterministic sequence of puts to a store, syncing
//! every few operations and printing `synced N` once operations `0..=N` are durable. The test
//! kills it with SIGKILL at random moments and checks the store afterwards.
//!
//! `kura-crash-writer PATH FIRST_OP` (runs until killed).

use std::io::Write;
use std::path::PathBuf;

use kura_engine::{Engine, EngineConfig, Mode};

/// Distinct keys the operations cycle over.
pub const KEYS: u64 = 3000;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().expect("usage: kura-crash-writer PATH FIRST_OP"));
    let first: u64 = args.next().and_then(|s| s.parse().ok()).expect("FIRST_OP");
    let config = EngineConfig {
        block_size_bytes: 256 * 1024,
        partitions: 2,
        mode: Some(Mode::Store),
        value_size_max_bytes: 64 * 1024,
        size_bytes: Some(64 << 20),
        ..EngineConfig::default()
    };
    let engine = Engine::open(&path, &config).expect("open store");
    let stdout = std::io::stdout();
    for op in first.. {
        engine.put(&key(op % KEYS), &value(op)).expect("put");
        if op % 97 == 96 {
            engine.sync().expect("sync");
            writeln!(stdout.lock(), "synced {op}").expect("stdout");
        }
    }
}

fn key(k: u64) -> Vec<u8> {
    format!("k{k:06}").into_bytes()
}

/// The value written by operation `op`: its number, then bytes derived from it.
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
