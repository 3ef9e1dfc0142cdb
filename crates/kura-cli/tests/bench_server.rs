//! `kura bench server` end to end with tiny settings: one JSON object with each system's
//! figures and their ratios, and the latency plot, by default in `--dir`.

mod common;

use std::process::{Command, Stdio};

#[test]
fn bench_server_prints_every_field_and_draws_its_plot() {
    let with_memcached = Command::new("memcached").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    let systems = if with_memcached { "kura,memcached" } else { "kura" };
    if !with_memcached {
        eprintln!("SKIP (in part): memcached is not installed; kura alone");
    }
    let (report, dir) = common::bench("server", &["--value-size", "512", "--items", "2000", "--duration-s", "1", "--sweep", "0.5", "--connections", "2", "--systems", systems]);
    for system in systems.split(',') {
        let s = &report["systems"][system];
        for field in ["get_ops_per_s", "get_p50_us", "get_p99_us", "set_ops_per_s", "rss_bytes_per_item"] {
            assert!(s[field].as_f64().is_some_and(|v| v > 0.0), "{system}.{field}: {s}");
        }
        assert!(s["curve"].as_array().is_some_and(|c| !c.is_empty()), "{system}: {s}");
    }
    if with_memcached {
        assert!(report["ratios"]["kura_get_over_memcached"].as_f64().is_some_and(|v| v > 0.0), "{}", report["ratios"]);
    }
    let plot = dir.path().join("server-latency.png");
    assert_eq!(report["plot"].as_str(), Some(plot.to_str().unwrap()), "{report}");
    assert!(std::fs::metadata(&plot).is_ok_and(|m| m.len() > 1000), "no plot at {}", plot.display());
}

/// `--tls`: every system serves over TLS with a certificate the bench makes; the load, the
/// peak (the replies are checked: every GET a hit with its whole value) and the open-loop
/// sweep (its sending and receiving threads sharing each connection's session) are measured
/// through it, and the curve is drawn.
#[test]
fn bench_server_over_tls_measures_the_peak_and_the_sweep() {
    let have = |cmd: &str, arg: &str| Command::new(cmd).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !have("openssl", "version") {
        eprintln!("SKIP: openssl is not installed (--tls makes its certificate with it)");
        return;
    }
    let with_memcached = have("memcached", "-V");
    let systems = if with_memcached { "kura,memcached" } else { "kura" };
    if !with_memcached {
        eprintln!("SKIP (in part): memcached is not installed; kura alone");
    }
    let (report, dir) = common::bench("server", &["--tls", "--value-size", "512", "--items", "2000", "--duration-s", "1", "--sweep", "0.5", "--connections", "2", "--systems", systems]);
    assert_eq!(report["config"]["tls"], true, "{report}");
    for system in systems.split(',') {
        let s = &report["systems"][system];
        for field in ["get_ops_per_s", "get_p50_us", "get_p99_us", "set_ops_per_s", "rss_bytes_per_item"] {
            assert!(s[field].as_f64().is_some_and(|v| v > 0.0), "{system}.{field}: {s}");
        }
        assert_eq!(s["get_hit_ratio"].as_f64(), Some(1.0), "{system}: {s}");
        assert_eq!(s["items_missing_when_measured"].as_u64(), Some(0), "{system}: {s}");
        let curve = s["curve"].as_array().unwrap_or_else(|| panic!("{system}: no curve: {s}"));
        assert_eq!(curve.len(), 1, "{system}: one sweep point: {s}");
        let (offered, achieved) = (curve[0]["offered_ops_per_s"].as_f64().unwrap(), curve[0]["achieved_ops_per_s"].as_f64().unwrap());
        // Half the peak offered: all of it is answered, give or take the noise of a second.
        assert!(achieved > 0.25 * offered, "{system}: {achieved} of {offered} GET/s answered over TLS: {s}");
        assert!(curve[0]["p99_us"].as_u64().is_some_and(|p99| p99 > 0), "{system}: {s}");
    }
    let plot = dir.path().join("server-latency.png");
    assert_eq!(report["plot"].as_str(), Some(plot.to_str().unwrap()), "{report}");
    assert!(std::fs::metadata(&plot).is_ok_and(|m| m.len() > 1000), "no plot at {}", plot.display());
    assert!(dir.path().join("tls/server.pem").exists());
}

/// memcached with extstore runs in a memory cgroup (`--extstore-memory-cap-mb`), so that its
/// file's page cache counts against the RAM it is given: the JSON shows the cap and what the
/// cgroup held, never more than the cap.
#[test]
fn bench_server_caps_extstore_memory_page_cache_included() {
    if !Command::new("memcached").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success()) {
        eprintln!("SKIP: memcached is not installed");
        return;
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: a memory cgroup needs root");
        return;
    }
    let (report, _dir) = common::bench("server", &["--value-size", "4096", "--items", "4000", "--memory-mb", "8", "--extstore-memory-cap-mb", "48", "--duration-s", "1", "--sweep", "0.5", "--connections", "2", "--systems", "memcached_extstore"]);
    assert_eq!(report["config"]["extstore_memory_cap_mb"], 48, "{report}");
    let s = &report["systems"]["memcached_extstore"];
    if s["memory_cap"].is_null() {
        eprintln!("SKIP (in part): no cgroup memory controller here; the run went on uncapped: {s}");
        return;
    }
    let cap = &s["memory_cap"];
    assert_eq!(cap["limit_bytes"].as_u64(), Some(48 << 20), "{cap}");
    let peak = cap["peak_bytes"].as_u64().expect("peak usage");
    assert!(peak > 0 && peak <= 48 << 20, "held {peak} bytes at most, cap 48 MiB: {cap}");
    assert!(s["get_ops_per_s"].as_f64().is_some_and(|v| v > 0.0), "{s}");
    assert_eq!(s["get_hit_ratio"].as_f64(), Some(1.0), "{s}");
}
