//! The kernel block paths for real: `kura block ublk` → /dev/ublkbN and `kura block nbd` +
//! `nbd-client` → /dev/nbdN, with ext4 and xfs on them, kura restarted between writing and
//! checking, fsck clean and every checksum matching (tests/scripts/vm-block.sh, which uses
//! fs-check.sh like the FUSE + loop tests).
//!
//! This machine's kernel has neither ublk_drv nor nbd, so the checks run inside the kernel VM
//! (scripts/kernel-vm.sh: Debian's 6.12 kernel, this machine's root read-only, the stores on
//! the VM's scratch disk because the engine's O_DIRECT is refused by tmpfs). Booting and the
//! emulated CPU are the expensive part, so the VM boots once per test process and runs every
//! check; each test below reports its own check's part. Without the VM the tests skip with the
//! reason, unless `KURA_REQUIRE_VM=1` (scripts/test.sh), when they fail. Where
//! `/dev/ublk-control` exists on the host, the ublk checks also run on the host.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kura_testkit::{VmOptions, ensure_vm, free_tcp_port, require_cmd, run_in_vm, skip, vm_required};

/// The checks vm-block.sh runs in the VM, in order (one boot for all).
const VM_CHECKS: [&str; 7] = ["ublk-raw", "ublk-embedded", "nbd-embedded", "ublk-kura", "ublk-recover", "ublk-memcached", "ublk-redis"];
/// The checks that also run on a host with /dev/ublk-control.
const HOST_CHECKS: [&str; 6] = ["ublk-raw", "ublk-embedded", "ublk-kura", "ublk-recover", "ublk-memcached", "ublk-redis"];
/// Data each file system check writes: small, because the VM's CPU is emulated (a tree of
/// about 25 files; each file costs a process, and processes are slow there).
const FS_CHECK_MB: u32 = 4;
/// The VM's scratch disk (/dev/vda), where the stores live: three stores of 1 GiB at most, one
/// check at a time; the image is sparse.
const VM_DISK_MB: u64 = 2048;
/// Past this the VM is killed; a run takes about 4-5 minutes on a loaded two-core machine.
/// (vm-block.sh gives up on a step stuck for VM_BLOCK_STEP_TIMEOUT_S, printing what is stuck.)
const VM_TIMEOUT: Duration = Duration::from_secs(720);
/// How long one fs-check.sh step in the VM may take before vm-block.sh declares it stuck.
const VM_STEP_TIMEOUT_S: u32 = 150;
/// Tools the checks run (inside the VM they are the host's, over the shared root).
const TOOLS: [&str; 12] = ["mkfs.ext4", "mkfs.xfs", "e2fsck", "xfs_repair", "blkdiscard", "blockdev", "nbd-client", "sha256sum", "mount", "fio", "memcached", "redis-server"];

fn vm_block_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/vm-block.sh")
}

/// `'…'` for a shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// One run of vm-block.sh: its output and whether it finished.
struct Run {
    output: String,
    /// Why the run as a whole failed (the VM timed out or did not boot), if it did.
    broken: Option<String>,
    elapsed: Duration,
}

impl Run {
    /// The lines of one check, from its `=== CHECK` line to its `RESULT CHECK` line.
    fn section(&self, check: &str) -> Option<&str> {
        let start = self.output.find(&format!("] === {check}\n"))?;
        let line_start = self.output[..start].rfind('\n').map_or(0, |i| i + 1);
        let rest = &self.output[line_start..];
        let result = rest.find(&format!("] RESULT {check} "))?;
        let end = rest[result..].find('\n').map_or(rest.len(), |i| result + i + 1);
        Some(&rest[..end])
    }

    /// Panics unless CHECK ran and passed; prints its part of the output either way.
    #[track_caller]
    fn assert_passed(&self, check: &str, place: &str) {
        // A check that finished stands even if a later one broke the run.
        let Some(section) = self.section(check) else {
            let why = self.broken.as_deref().unwrap_or("vm-block.sh ended before it");
            panic!("{place}: check {check} did not finish: {why}\n--- output ---\n{}", self.output);
        };
        eprintln!("--- {check} ({place}; the whole run took {:.0} s) ---\n{section}", self.elapsed.as_secs_f64());
        assert!(section.contains(&format!("] RESULT {check} ok")), "{place}: check {check} failed:\n{section}");
    }
}

/// Why the VM checks cannot run here, if they cannot.
fn vm_unavailable() -> Option<String> {
    if let Err(reason) = ensure_vm() {
        return Some(reason);
    }
    TOOLS.iter().find_map(|tool| require_cmd(tool).err())
}

/// Boots the VM once and runs every check; `Err(reason)` when the VM cannot be had.
fn vm_run() -> &'static Result<Run, String> {
    static RUN: OnceLock<Result<Run, String>> = OnceLock::new();
    RUN.get_or_init(|| {
        if let Some(reason) = vm_unavailable() {
            return Err(reason);
        }
        let kura = common::kura_bin();
        let script = format!("VM_BLOCK_DISK=/dev/vda {} {}", shell_quote(&vm_block_script().display().to_string()), VM_CHECKS.join(" "));
        let opts = VmOptions { disk_mb: Some(VM_DISK_MB), timeout: VM_TIMEOUT, ..VmOptions::default() }
            .with_env("KURA_BIN", kura.display().to_string())
            .with_env("FS_CHECK_MB", FS_CHECK_MB.to_string())
            .with_env("VM_BLOCK_STEP_TIMEOUT_S", VM_STEP_TIMEOUT_S.to_string());
        let started = Instant::now();
        let out = run_in_vm(&script, opts).expect("start scripts/kernel-vm.sh");
        let elapsed = started.elapsed();
        eprintln!("kernel VM: boot + {} checks in {:.1} s (status {})", VM_CHECKS.len(), elapsed.as_secs_f64(), out.status);
        let broken = match out.code() {
            Some(0 | 1) => None,
            Some(124) => Some(format!("the VM timed out after {VM_TIMEOUT:?}")),
            _ => Some(format!("the VM or vm-block.sh failed ({}): {}", out.status, out.stderr.trim())),
        };
        Ok(Run { output: out.stdout, broken, elapsed })
    })
}

/// Runs CHECK's part of the VM run (booting it if no other test has yet).
fn vm_check(check: &str) {
    match vm_run() {
        Ok(run) => run.assert_passed(check, "kernel VM"),
        Err(reason) => {
            assert!(!vm_required(), "KURA_REQUIRE_VM=1 but the kernel VM checks cannot run: {reason}");
            skip(reason);
        }
    }
}

/// /dev/ublkbN on the embedded engine: the kernel sees a write-back cache, FUA, discard and
/// write-zeroes; FUA writes, discard, write-zeroes of whole and partial blocks, flushes and
/// fio's verified 512 B – 128 KiB writes all read back right; SIGTERM with a file system still
/// mounted stops kura and deletes the device; kura's counts show that flushes, FUA writes,
/// discards and write-zeroes arrived and none failed.
#[test]
fn vm_ublk_requests_fua_discard_write_zeroes() {
    vm_check("ublk-raw");
}

/// `kura block ublk` on the embedded engine → ext4 and xfs → restart → fsck clean, checksums
/// match.
#[test]
fn vm_ublk_ext4_and_xfs_survive_a_restart() {
    vm_check("ublk-embedded");
}

/// `kura block nbd` + the kernel's NBD client → ext4 and xfs → restart → fsck clean,
/// checksums match.
#[test]
fn vm_kernel_nbd_ext4_and_xfs_survive_a_restart() {
    vm_check("nbd-embedded");
}

/// `kura block ublk` on a `kura serve` store → xfs → ublk and the server restarted → fsck
/// clean, checksums match.
#[test]
fn vm_ublk_on_a_kura_server_xfs_survives_restarts() {
    vm_check("ublk-kura");
}

/// `kura block ublk` on a `kura serve` store, SIGKILLed twice while ext4 on it is being
/// written and fsynced: the device stays, the writer waits without an error, `kura block ublk
/// --recover N` takes it over each time; fsck clean, every file as written; recoveries of a
/// live device or with another volume refused; `kura block ublk-delete N` removes a device
/// left waiting (its waiting read fails), not a live one.
#[test]
fn vm_ublk_survives_its_server_killed_and_recovered() {
    vm_check("ublk-recover");
}

/// `kura block ublk` on a stock memcached → fio verify; ext4 → kura restarted → fsck clean,
/// checksums match.
#[test]
fn vm_ublk_on_memcached_fio_verify_and_ext4_survive_a_restart() {
    vm_check("ublk-memcached");
}

/// `kura block ublk` on a stock redis-server → fio verify; ext4 → kura restarted → fsck
/// clean, checksums match.
#[test]
fn vm_ublk_on_redis_fio_verify_and_ext4_survive_a_restart() {
    vm_check("ublk-redis");
}

/// Why the ublk checks cannot run on this host, if they cannot.
fn host_unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("ublk devices and mounts need root".into());
    }
    if !kura_block::ublk::available() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        return Some(format!(
            "no /dev/ublk-control on this host (kernel {} without ublk_drv loaded; `modprobe ublk_drv` where it exists): the kernel VM tests cover ublk",
            release.trim()
        ));
    }
    TOOLS.iter().filter(|t| **t != "nbd-client").find_map(|tool| require_cmd(tool).err())
}

/// Where the host has a ublk driver: the ublk checks on the host itself.
#[test]
fn host_ublk_requests_and_file_systems() {
    if let Some(reason) = host_unavailable() {
        return skip(&reason);
    }
    let started = Instant::now();
    // stderr into stdout, so that error lines stay inside their check's part.
    let out = Command::new("bash")
        .args(["-c", r#"exec "$0" "$@" 2>&1"#])
        .arg(vm_block_script())
        .args(HOST_CHECKS)
        .env("KURA_BIN", common::kura_bin())
        .env("FS_CHECK_MB", FS_CHECK_MB.to_string())
        .env("VM_BLOCK_SCRATCH", common::scratch_dir())
        .env("VM_BLOCK_SERVER_PORT", free_tcp_port().expect("a free port").to_string())
        .stdin(Stdio::null())
        .output()
        .expect("run vm-block.sh");
    let run = Run {
        output: String::from_utf8_lossy(&out.stdout).into_owned(),
        broken: None,
        elapsed: started.elapsed(),
    };
    for check in HOST_CHECKS {
        run.assert_passed(check, "host");
    }
    assert!(out.status.success(), "vm-block.sh on the host: {}\n{}", out.status, run.output);
}
