//! Debian's `memccapable -a` (libmemcached-tools): every ASCII protocol test
//! must pass against kura.

mod common;

use std::process::Command;

use common::Kura;

#[test]
fn memccapable_ascii_passes() {
    let bin = kura_testkit::try_or_skip!(kura_testkit::require_cmd("memccapable"));
    let kura = Kura::start(&[]);
    let out = Command::new(bin)
        .args([
            "-a",
            "-t",
            "10",
            "-h",
            "127.0.0.1",
            "-p",
            &kura.port.to_string(),
        ])
        .output()
        .expect("run memccapable");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "memccapable failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("All tests passed"), "{stdout}");
    assert!(!stdout.contains("[fail]"), "{stdout}");
    let passed = stdout
        .lines()
        .filter(|l| l.trim_end().ends_with("[pass]"))
        .count();
    assert!(passed >= 27, "only {passed} tests ran:\n{stdout}");
}
