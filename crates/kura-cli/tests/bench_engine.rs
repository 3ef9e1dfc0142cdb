//! `kura bench engine` end to end on a small store: one JSON object with the fields the
//! README quotes, and every value read back checked (the command fails on a wrong or missing
//! value), with and without companion reads.

use std::process::{Command, Stdio};

fn run(dir: &std::path::Path, companions: bool) -> serde_json::Value {
    let kura = env!("CARGO_BIN_EXE_kura");
    let path = dir.join(format!("engine-{companions}.kura"));
    let mut cmd = Command::new(kura);
    // A tiny index budget: many lookups have more than one candidate page.
    cmd.args(["bench", "engine", "--keys", "20000", "--skip-fio", "--duration-s", "1", "--block-size", "256K", "--index-bits-per-key", "4", "--fingerprint-bits", "2", "--path"]).arg(&path);
    if companions {
        cmd.arg("--companion-reads");
    }
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "kura bench engine failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn prints_every_field_and_companion_reads_read_ahead() {
    let dir = tempfile::Builder::new().prefix("kura-bench-engine-").tempdir_in("/var/tmp").unwrap();
    let plain = run(dir.path(), false);
    let with = run(dir.path(), true);
    for out in [&plain, &with] {
        for field in ["get_ops_per_s", "get_p50_us", "get_p99_us", "flash_reads_per_get_hit", "flash_reads_per_get_miss", "flash_read_bytes_per_get_hit", "put_mib_per_s", "ram_index_bits_per_key", "reopen_ms", "index_lookup_ns_bfm", "index_lookup_ns_sequential"] {
            assert!(out[field].as_f64().is_some_and(|v| v >= 0.0), "{field} missing in {out:#}");
        }
    }
    assert_eq!(plain["companion_reads"], false);
    assert_eq!(with["companion_reads"], true);
    // Companion reads read the next candidate page even when the first holds the key.
    let (p, w) = (plain["flash_reads_per_get_hit"].as_f64().unwrap(), with["flash_reads_per_get_hit"].as_f64().unwrap());
    assert!(w > p, "reads per hit: {w} with companion reads, {p} without");
}
