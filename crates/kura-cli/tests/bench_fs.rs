//! `kura bench fs` end to end with tiny settings: it prints one JSON object with every figure
//! of the preload, ext4 and FUSE sides.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The whole run must stay quick with these settings.
const RUN_SECONDS_MAX: u64 = 60;

/// Figures every side reports (latencies as `_mean` and `_p99`).
const LATENCY_FIELDS: [&str; 7] = ["write_64b_buffered_lat_ns", "write_4k_buffered_lat_ns", "write_4k_osync_lat_us", "read_4k_direct_lat_us", "write_4k_direct_lat_us", "read_4k_cached_lat_ns", "stat_lat_us"];
const IOPS_FIELDS: [&str; 2] = ["randread_4k_iops", "randwrite_4k_iops"];
/// The small-file phase's figures (per file, the walk per tree).
const TREE_FIELDS: [&str; 6] = ["tree_create_us", "tree_walk_ms", "tree_stat_us", "tree_read_us", "tree_reread_us", "tree_unlink_us"];

fn have(program: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {program}")]).stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// `libkura_fs.so` next to the `kura` binary under test (built here when missing: it is a
/// separate package, which `cargo test -p kura` does not build).
fn ensure_preload(kura: &Path) {
    let dir = kura.parent().expect("kura's directory");
    if dir.join("libkura_fs.so").is_file() {
        return;
    }
    let target_dir = dir.parent().expect("target dir");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", "kura-preload"]).env("CARGO_TARGET_DIR", target_dir).current_dir(env!("CARGO_MANIFEST_DIR"));
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    assert!(cmd.status().expect("cargo build").success(), "cargo build -p kura-preload failed");
}

/// FUSE needs /dev/fuse and fusermount3; without them the test runs with --skip-fuse.
fn fuse_usable() -> bool {
    let ok = Path::new("/dev/fuse").exists() && have("fusermount3");
    if !ok {
        eprintln!("NOTE: no /dev/fuse or fusermount3: running without the FUSE side");
    }
    ok
}

#[test]
fn prints_json_with_every_field() {
    if !have("fio") {
        eprintln!("SKIP: fio is not installed (apt-get install fio)");
        return;
    }
    let kura = PathBuf::from(env!("CARGO_BIN_EXE_kura"));
    ensure_preload(&kura);
    // /var/tmp: on disk (O_DIRECT and the engine need a real file system, not tmpfs).
    let dir = tempfile::Builder::new().prefix("kura-bench-fs-").tempdir_in("/var/tmp").unwrap();
    let json_path = dir.path().join("out/fs.json");
    let fuse = fuse_usable();
    let mut cmd = Command::new(&kura);
    cmd.args(["bench", "fs", "--dir"]).arg(dir.path().join("run")).args(["--size", "2M", "--runtime-s", "0.3", "--store-size", "256M", "--tree-files", "40", "--json"]).arg(&json_path);
    if !fuse {
        cmd.arg("--skip-fuse");
    }
    let started = Instant::now();
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "kura bench fs failed: {}\n{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    assert!(started.elapsed().as_secs() < RUN_SECONDS_MAX, "took {:?}", started.elapsed());
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(printed, saved, "--json writes what is printed");
    let sides: &[&str] = if fuse { &["", "ext4_", "fuse_"] } else { &["", "ext4_"] };
    for side in sides {
        for field in LATENCY_FIELDS {
            for stat in ["mean", "p99"] {
                let key = format!("{side}{field}_{stat}");
                let v = printed[&key].as_f64().unwrap_or_else(|| panic!("{key} missing or not a number in {printed:#}"));
                assert!(v > 0.0, "{key} = {v}");
            }
        }
        for field in IOPS_FIELDS.iter().chain(&TREE_FIELDS) {
            let key = format!("{side}{field}");
            assert!(printed[&key].as_f64().is_some_and(|v| v > 0.0), "{key} missing or not positive in {printed:#}");
        }
    }
    assert!(printed["ext4_anchor"].as_str().is_some_and(|s| s.contains("ext4")), "{printed:#}");
    assert!(printed["goals"].as_array().is_some_and(|g| g.len() == 6), "{printed:#}");
    assert!(printed["ratios"]["write_64b_buffered_lat_ns_mean_vs_ext4"].as_f64().is_some());
    assert!(printed["ratios"]["stat_lat_us_mean_vs_ext4"].as_f64().is_some());
    assert!(printed["ratios"]["tree_read_us_vs_ext4"].as_f64().is_some());
    assert_eq!(printed["tree_files"], 40);
    // The run cleans up after itself.
    assert!(!dir.path().join("run/kura").exists() && !dir.path().join("run/fuse-data").exists());
}
