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
    fn start(pool_url: &str, mountpoint: &Path) -> Self {
        let mut cmd = Command::new(kura_bin());
        cmd.args(["block", "fuse"]).arg(mountpoint).args(["--pool", pool_url]).env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::piped());
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
        let dir = tempfile::tempdir_in(common::scratch_dir()).unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mut fuse = FuseProcess::start(&backend.url(), &mnt);
        for fs in fs_types {
            let file = mnt.join(format!("vol-{fs}"));
            assert_eq!(std::fs::metadata(&file).unwrap().len(), 512 << 20);
            let lo = Loop::attach(&file, dir.path());
            lo.fs_check("write", fs);
        }
        fuse.stop();
        let mut fuse = FuseProcess::start(&backend.url(), &mnt);
        for fs in fs_types {
            let lo = Loop::attach(&mnt.join(format!("vol-{fs}")), dir.path());
            lo.fs_check("verify", fs);
        }
        fuse.stop();
        eprintln!("fuse + loop on {}: {fs_types:?} clean after a restart", backend.name());
    }
}

/// fio writes and verifies through a loop device over the FUSE export, on every backend.
#[test]
fn fio_verify_through_loop_on_every_backend() {
    if let Err(reason) = host_ready() {
        return skip(&reason);
    }
    try_or_skip!(require_cmd("fio"));
    for backend in Backend::all() {
        backend.create_volume("f", "64M");
        let dir = tempfile::tempdir_in(common::scratch_dir()).unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mut fuse = FuseProcess::start(&backend.url(), &mnt);
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
        eprintln!("fio verify through fuse + loop on {}: ok", backend.name());
    }
}
