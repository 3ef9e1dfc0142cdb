//! The FUSE single-file export on this machine's kernel: `kura block fuse` → `losetup` (a real
//! /dev/loopN) → mkfs.ext4 / mkfs.xfs → mount → a tree of files → unmount → restart kura →
//! fsck clean and every checksum matches. And fio verify through the loop device on every
//! backend.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Backend, kura_bin, run};
use kura_testkit::{ChildGuard, require_cmd, skip, try_or_skip};

fn fs_check() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/fs-check.sh")
}

/// What the host needs for these tests, or why it cannot run them.
fn host_ready() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("loop devices and mounts need root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse".into());
    }
    for tool in ["fusermount3", "losetup", "mkfs.ext4", "mkfs.xfs", "e2fsck", "xfs_repair", "sha256sum", "mount", "umount"] {
        require_cmd(tool)?;
    }
    Ok(())
}

/// `kura block fuse MOUNTPOINT`, stopped with SIGTERM.
struct FuseProcess {
    child: Option<ChildGuard>,
    mountpoint: PathBuf,
}

impl FuseProcess {
    fn start(pool_url: &str, mountpoint: &Path, options: &[&str]) -> Self {
        let mut cmd = Command::new(kura_bin());
        cmd.args(["block", "fuse"]).arg(mountpoint).args(["--pool", pool_url]).args(options).env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::piped());
        let mut child = ChildGuard::spawn("kura block fuse", &mut cmd).expect("start kura block fuse");
        let mut line = String::new();
        BufReader::new(child.child_mut().stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("mounted"), "kura block fuse did not mount: {line:?}");
        Self { child: Some(child), mountpoint: mountpoint.to_owned() }
    }

    fn stop(&mut self) {
        let status = self.child.take().expect("running").terminate(Duration::from_secs(30)).unwrap();
        assert!(status.success(), "kura block fuse exited with {status}");
    }
}

impl Drop for FuseProcess {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = Command::new("fusermount3").arg("-uz").arg(&self.mountpoint).status();
        }
    }
}

/// A new scratch directory with `kura block fuse` mounted on its `mnt` (unmounted before the
/// directory goes: the process is dropped first).
fn mount_fresh(pool_url: &str, options: &[&str]) -> (tempfile::TempDir, PathBuf, FuseProcess) {
    let dir = tempfile::tempdir_in(common::scratch_dir()).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let fuse = FuseProcess::start(pool_url, &mnt, options);
    (dir, mnt, fuse)
}

/// A loop device on a file; detached (and anything mounted from `state` unmounted) on drop.
struct Loop {
    dev: String,
    state: PathBuf,
}

impl Loop {
    fn attach(file: &Path, state: &Path) -> Self {
        let out = run("losetup", &["--direct-io=on", "--find", "--show", file.to_str().unwrap()]).expect("losetup");
        let dev = out.lines().last().unwrap().trim().to_owned();
        assert!(dev.starts_with("/dev/loop"), "{out}");
        let dio = std::fs::read_to_string(format!("/sys/block/{}/loop/dio", dev.trim_start_matches("/dev/"))).unwrap_or_default();
        eprintln!("{dev} on {} (direct I/O: {})", file.display(), dio.trim());
        Self { dev, state: state.to_owned() }
    }

    fn fs_check(&self, mode: &str, fs: &str) {
        let out = Command::new(fs_check()).args([mode, &self.dev, fs]).arg(&self.state).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "fs-check.sh {mode} {} {fs} failed:\n{text}", self.dev);
        eprint!("{}", text.lines().filter(|l| l.starts_with("fs-check:")).map(|l| format!("{l}\n")).collect::<String>());
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        for fs in ["ext4", "xfs"] {
            let mnt = self.state.join(format!("mnt-{fs}"));
            let _ = Command::new("umount").arg("-l").arg(&mnt).stderr(Stdio::null()).status();
        }
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

/// ext4 and xfs on loop devices over the FUSE export, on the embedded engine and on a kura
/// server; kura is restarted between writing and checking.
#[test]
fn ext4_and_xfs_on_loop_over_fuse_survive_a_restart() {
    if let Err(reason) = host_ready() {
        return skip(&reason);
    }
    for (backend, fs_types) in [(Backend::embedded(), &["ext4", "xfs"][..]), (Backend::kura(), &["xfs"][..])] {
        for fs in fs_types {
            backend.create_volume(&format!("vol-{fs}"), "512M");
        }
        let (dir, mnt, mut fuse) = mount_fresh(&backend.url(), &[]);
        for fs in fs_types {
            let file = mnt.join(format!("vol-{fs}"));
            assert_eq!(std::fs::metadata(&file).unwrap().len(), 512 << 20);
            let lo = Loop::attach(&file, dir.path());
            lo.fs_check("write", fs);
        }
        fuse.stop();
        let mut fuse = FuseProcess::start(&backend.url(), &mnt, &[]);
        for fs in fs_types {
            let lo = Loop::attach(&mnt.join(format!("vol-{fs}")), dir.path());
            lo.fs_check("verify", fs);
        }
        fuse.stop();
        eprintln!("fuse + loop on {}: {fs_types:?} clean after a restart", backend.name());
    }
}

/// fio writes and verifies through a loop device over the FUSE export, on every backend
/// (through the shared pool queues), and on the embedded engine also with a pool context per
/// FUSE thread (`--queues 0`).
#[test]
fn fio_verify_through_loop_on_every_backend() {
    if let Err(reason) = host_ready() {
        return skip(&reason);
    }
    try_or_skip!(require_cmd("fio"));
    let mut runs: Vec<(Backend, &[&str])> = Backend::all().into_iter().map(|b| (b, &[][..])).collect();
    runs.push((Backend::embedded(), &["--queues", "0"]));
    for (backend, options) in runs {
        backend.create_volume("f", "64M");
        let (dir, mnt, mut fuse) = mount_fresh(&backend.url(), options);
        {
            let lo = Loop::attach(&mnt.join("f"), dir.path());
            let filename = format!("--filename={}", lo.dev);
            for job in [
                vec!["--name=a", "--rw=randwrite", "--bs=4k", "--size=32M", "--iodepth=32"],
                vec!["--name=b", "--rw=randwrite", "--bsrange=512-256k", "--offset=32M", "--size=32M", "--iodepth=8"],
            ] {
                let mut args = job;
                args.extend(["--ioengine=io_uring", "--direct=1", &filename, "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--output-format=terse"]);
                run("fio", &args).unwrap_or_else(|e| panic!("{}: {e}", backend.name()));
            }
            // Discard (a hole punched in the FUSE file) reads back as zeros.
            run("blkdiscard", &["-o", "0", "-l", "1048576", &lo.dev]).unwrap();
            let zeros = Command::new("cmp").args(["-n", "1048576", &lo.dev, "/dev/zero"]).status().unwrap();
            assert!(zeros.success(), "{}: discarded range is not zero", backend.name());
        }
        fuse.stop();
        eprintln!("fio verify through fuse + loop on {} {options:?}: ok", backend.name());
    }
}

/// Reads one 4 KiB block of `dev` at `block` with O_DIRECT (dd, under a time limit so that a
/// hang fails the test instead of stalling it).
fn read_block(dev: &str, block: u64) -> Result<Vec<u8>, String> {
    let out = Command::new("timeout")
        .args(["60", "dd", &format!("if={dev}"), "of=/dev/stdout", "bs=4096", "count=1", "iflag=direct", "status=none", &format!("skip={block}")])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.code() == Some(124) {
        return Err("dd hung for 60 s".into());
    }
    if out.status.success() { Ok(out.stdout) } else { Err(format!("dd failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim())) }
}

/// The kura server dies (`kill -9`) under a running export: reads through the loop device
/// fail with an I/O error instead of hanging, and once the server is back (same store) the
/// export serves again, with what was synced before the crash — without restarting the
/// export or re-attaching the loop device.
#[test]
fn a_server_that_dies_under_the_export_fails_reads_then_serves_again() {
    if let Err(reason) = host_ready() {
        return skip(&reason);
    }
    let mut backend = Backend::kura();
    backend.create_volume("g", "16M");
    let (dir, mnt, mut fuse) = mount_fresh(&backend.url(), &[]);
    {
        let lo = Loop::attach(&mnt.join("g"), dir.path());
        let data = common::pattern(7, 1 << 20);
        let src = dir.path().join("pattern");
        std::fs::write(&src, &data).unwrap();
        // Written with O_DIRECT and synced (an fsync through the loop device is the pool's
        // flush barrier), so it survives the server's crash.
        run("dd", &[&format!("if={}", src.display()), &format!("of={}", lo.dev), "bs=64k", "oflag=direct", "conv=fsync", "status=none"]).unwrap();
        assert_eq!(read_block(&lo.dev, 100).unwrap(), data[100 * 4096..101 * 4096]);

        let Backend::Kura(server) = &mut backend else { unreachable!() };
        server.kill();
        let started = std::time::Instant::now();
        let error = read_block(&lo.dev, 200).expect_err("a read with the server gone must fail");
        assert!(!error.contains("hung"), "{error}");
        eprintln!("server down: the read failed after {:?}: {error}", started.elapsed());

        server.restart();
        // The pool reconnects on its next request (with back-off after a failure).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let block = loop {
            match read_block(&lo.dev, 200) {
                Ok(block) => break block,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("server back, not yet reconnected: {e}");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => panic!("no read succeeded within 30 s of the restart: {e}"),
            }
        };
        assert_eq!(block, data[200 * 4096..201 * 4096], "synced data after the server's crash");
    }
    fuse.stop();
}
