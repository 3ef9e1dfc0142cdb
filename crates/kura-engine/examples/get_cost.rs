//! Times the RAM side of lookups (get_start) on an existing store, without I/O.
//! `cargo run --release --example get_cost -- STORE KEYS`
use std::time::Instant;

use kura_engine::{Engine, EngineConfig, GetStep};

fn main() {
    let path = std::env::args().nth(1).expect("store");
    let keys: u64 = std::env::args().nth(2).map_or(100_000, |s| s.parse().unwrap());
    let engine = Engine::open(path.as_ref(), &EngineConfig::default()).unwrap();
    let n = 200_000u64;
    let mut reads = 0u64;
    let t = Instant::now();
    for i in 0..n {
        let key = format!("user{:012}", (i * 7919) % keys);
        let (_plan, step) = engine.get_start(key.as_bytes()).unwrap();
        if let GetStep::Read { .. } = step {
            reads += 1;
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("get_start: {ns:.0} ns per lookup, {reads} of {n} need a read");
    let stats = engine.stats();
    println!("blocks {} partitions {}", stats.blocks_used, stats.partitions);
}
