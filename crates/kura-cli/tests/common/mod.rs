//! Running `kura bench …` from the tests.

#![allow(dead_code)]

use std::process::{Command, Stdio};

use serde_json::Value;

/// `kura bench <kind> <args> --dir <a new directory>`: its JSON report (checked to name the
/// bench) and the directory, to look in. On disk, not tmpfs (O_DIRECT needs a disk file
/// system).
pub fn bench(kind: &str, args: &[&str]) -> (Value, tempfile::TempDir) {
    std::fs::create_dir_all("/var/tmp/kura-cli-tests").unwrap();
    let dir = tempfile::tempdir_in("/var/tmp/kura-cli-tests").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kura"))
        .args(["bench", kind])
        .args(args)
        .arg("--dir")
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "kura bench {kind} failed ({}):\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    assert_eq!(report["bench"], kind);
    (report, dir)
}
