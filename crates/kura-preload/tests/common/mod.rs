//! Test harness: builds `kura` and `libkura_fs.so` into this test's target directory, and
//! runs real programs under `kura fs run` with a private data directory (its own local server).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// The target profile directory of this test binary (`target/release`), after building the
/// `kura` binary and the preload library into it.
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile_dir = kura_testkit::build_workspace_packages(&["kura", "kura-preload"]);
        assert!(profile_dir.join("libkura_fs.so").is_file(), "no libkura_fs.so in {}", profile_dir.display());
        profile_dir
    })
}

pub fn kura() -> PathBuf {
    bin_dir().join("kura")
}

pub fn preload_lib() -> PathBuf {
    bin_dir().join("libkura_fs.so")
}

/// A private file system: a data directory for `kura fs run`.
pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Self {
        // Build first, so that tests timing a command do not time the build.
        bin_dir();
        // /var/tmp: on disk (the engine uses O_DIRECT, which tmpfs refuses).
        let dir = tempfile::Builder::new().prefix("kura-fs-test-").tempdir_in("/var/tmp").expect("temp dir");
        Self { dir }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `kura fs run` with these extra options.
    pub fn command(&self, options: &[&str], program: &[&str]) -> Command {
        let mut cmd = Command::new(kura());
        cmd.args(["fs", "run", "--data-dir"]).arg(self.data_dir()).args(options);
        if !options.contains(&"--store-size") {
            cmd.args(["--store-size", "2G"]);
        }
        // The preload alone unless a test asks for FUSE: `--fuse auto` would mount where the
        // host happens to have a /kura directory.
        if !options.contains(&"--fuse") {
            cmd.args(["--fuse", "off"]);
        }
        cmd.arg("--").args(program);
        // Lock files of this test's own (not the host's /tmp/kura-fs-locks).
        cmd.env("KURA_FS_LOCK_DIR", self.dir.path().join("locks"));
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Runs `program` under the preload; panics with its output unless it succeeds.
    pub fn run(&self, program: &[&str]) -> String {
        let out = self.command(&[], program).output().expect("run kura fs run");
        check(&out, program);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn sh(&self, script: &str) -> String {
        self.run(&["sh", "-c", script])
    }

    pub fn output(&self, program: &[&str]) -> Output {
        self.command(&[], program).output().expect("run kura fs run")
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = Command::new(kura()).args(["fs", "stop", "--data-dir"]).arg(self.data_dir()).status();
    }
}

pub fn check(out: &Output, what: &[&str]) {
    assert!(
        out.status.success(),
        "{what:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The workspace root (for source trees to copy).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("workspace root").to_path_buf()
}

/// Whether `name` is on PATH; prints SKIP otherwise.
pub fn have(name: &str) -> bool {
    match kura_testkit::require_cmd(name) {
        Ok(_) => true,
        Err(reason) => {
            kura_testkit::skip(&reason);
            false
        }
    }
}
