//! Boots the kernel VM and runs scripts/vm-selftest.sh in it: nbd and ublk_drv load, and a
//! kernel NBD device served by qemu-nbd carries an ext4 file system that fsck finds clean.

use std::time::Instant;

use kura_testkit::{VmOptions, ensure_vm, run_in_vm, skip, vm_required, workspace_root};

#[test]
fn vm_selftest_passes() {
    if let Err(reason) = ensure_vm() {
        assert!(
            !vm_required(),
            "KURA_REQUIRE_VM=1 but the VM is unavailable: {reason}"
        );
        skip(&reason);
        return;
    }
    let script = workspace_root().join("scripts/vm-selftest.sh");
    let started = Instant::now();
    let out = run_in_vm(&format!("'{}'", script.display()), VmOptions::default())
        .expect("start scripts/kernel-vm.sh");
    eprintln!(
        "VM boot + selftest: {:.1} s\n{}",
        started.elapsed().as_secs_f64(),
        out.stdout
    );
    out.assert_success();
    assert!(out.stdout.contains("/dev/ublk-control"), "{}", out.stdout);
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("vm-selftest:") && l.ends_with("] OK")),
        "{}",
        out.stdout
    );
}

#[test]
fn vm_reports_the_script_status_and_environment() {
    if let Err(reason) = ensure_vm() {
        assert!(
            !vm_required(),
            "KURA_REQUIRE_VM=1 but the VM is unavailable: {reason}"
        );
        skip(&reason);
        return;
    }
    let opts = VmOptions {
        disk_mb: Some(16),
        ..VmOptions::default()
    }
    .with_env("KURA_PROBE", "a b'c");
    let out = run_in_vm(
        r#"printf 'probe=%s\n' "$KURA_PROBE"; printf 'in_vm=%s\n' "$KURA_IN_VM"; blockdev --getsize64 /dev/vda; exit 7"#,
        opts,
    )
    .expect("start scripts/kernel-vm.sh");
    assert_eq!(out.code(), Some(7), "{out:?}");
    assert!(out.stdout.contains("probe=a b'c"), "{}", out.stdout);
    assert!(out.stdout.contains("in_vm=1"), "{}", out.stdout);
    assert!(
        out.stdout.contains(&(16u64 << 20).to_string()),
        "{}",
        out.stdout
    );
}
