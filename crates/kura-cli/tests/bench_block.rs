//! `kura bench block` end to end with tiny settings: it runs every frontend this host has, and
//! prints one JSON object with every figure and anchor.

mod common;

use std::process::{Command, Stdio};

use serde_json::Value;

const FIELDS: [&str; 6] = ["randread_4k_iops", "randwrite_4k_iops", "seqread_128k_mib_s", "seqwrite_128k_mib_s", "qd1_read_lat_us", "qd1_write_lat_us"];

fn installed(program: &str) -> bool {
    Command::new(program).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Every figure is a positive number, or the target says why it is absent.
fn check_target(report: &Value, what: &str) {
    if report.get("absent").is_some() {
        eprintln!("{what}: absent: {}", report["absent"]);
        return;
    }
    for field in FIELDS {
        let v = report[field].as_f64().unwrap_or_else(|| panic!("{what}.{field} missing: {report}"));
        assert!(v > 0.0, "{what}.{field} = {v}");
    }
}

/// `kura bench block` with tiny settings and `args`; `None` (skipped) without fio.
fn bench(args: &[&str]) -> Option<(Value, tempfile::TempDir)> {
    if !installed("fio") {
        eprintln!("SKIP: fio is not installed (./scripts/test.sh installs it)");
        return None;
    }
    let mut all = vec!["--size", "16M", "--runtime-s", "0.3"];
    all.extend_from_slice(args);
    Some(common::bench("block", &all))
}

#[test]
fn bench_block_prints_every_field() {
    let Some((report, _dir)) = bench(&["--backends", "embedded", "--frontends", "nbd,fuse_loop,ublk", "--filesystems", "ext4"]) else { return };
    let embedded = &report["backends"]["embedded"];
    for anchor in ["pool_get_4k_ops_per_s", "pool_get_4k_lat_us"] {
        assert!(embedded[anchor].as_f64().is_some_and(|v| v > 0.0), "{anchor}: {embedded}");
    }
    check_target(&embedded["nbd"], "nbd");
    check_target(&embedded["fuse_loop"], "fuse_loop");
    if embedded["fuse_loop"].get("absent").is_none() {
        check_target(&embedded["fuse_loop"]["ext4"], "fuse_loop.ext4");
    }
    check_target(&embedded["ublk"], "ublk");
    if embedded.get("qemu_nbd_absent").is_none() {
        for anchor in ["qemu_nbd_randread_4k_iops", "qemu_nbd_qd1_read_lat_us"] {
            assert!(embedded[anchor].as_f64().is_some_and(|v| v > 0.0), "{anchor}: {embedded}");
        }
    }
    for goal in ["nbd_randread_over_pool_get", "nbd_randread_over_qemu_nbd", "nbd_qd1_read_lat_minus_pool_us", "nbd_seqread_over_pool_get_bandwidth", "fuse_loop_randread_over_nbd"] {
        assert!(embedded["goals"][goal].get("met").is_some(), "goal {goal}: {}", embedded["goals"]);
    }
}

/// The kura server backend on a Unix socket (`--backends kura_unix`): NBD over a pool of one
/// `kura serve -s`, with its pool anchor.
#[test]
fn bench_block_on_a_kura_server_on_a_unix_socket() {
    let Some((report, dir)) = bench(&["--backends", "kura_unix", "--frontends", "nbd", "--filesystems", "", "--skip-qemu"]) else { return };
    let backend = &report["backends"]["kura_unix"];
    assert!(backend["pool_get_4k_ops_per_s"].as_f64().is_some_and(|v| v > 0.0), "{backend}");
    check_target(&backend["nbd"], "nbd");
    assert!(!dir.path().join("kura_unix.sock").exists(), "the server removed its socket at its stop");
}
