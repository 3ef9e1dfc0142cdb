//! The kernel VM from Rust: a thin wrapper over `scripts/kernel-vm.sh`, which is also what a
//! person runs by hand (`scripts/kernel-vm.sh 'COMMAND'`).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::process::require_cmd;

const KERNEL_CACHE_DEFAULT: &str = "/var/cache/kura-vm";
const VM_MEM_MB_DEFAULT: u64 = 2048;
const VM_CPUS_DEFAULT: u32 = 2;
const VM_TIMEOUT_S_DEFAULT: u64 = 600;
/// kernel-vm.sh's status when the VM ran out of time.
const STATUS_TIMED_OUT: i32 = 124;

/// One VM at a time per test process: the machines have two cores and an emulated (TCG) VM
/// keeps both busy, so parallel VMs only make each other time out. cargo runs test binaries
/// one after another, so this serialises all VM tests of a `cargo test` run.
static VM_SLOT: Mutex<()> = Mutex::new(());

/// How to run the VM. `Default` matches kernel-vm.sh's defaults.
#[derive(Clone, Debug)]
pub struct VmOptions {
    /// Size of an empty raw scratch disk, `/dev/vda` inside; none by default.
    pub disk_mb: Option<u64>,
    pub mem_mb: u64,
    pub cpus: u32,
    /// Wall-clock limit for boot plus script; past it the VM is killed and the status is 124.
    pub timeout: Duration,
    /// Variables exported inside the VM (the VM starts from a clean environment).
    pub env: Vec<(String, String)>,
    /// Working directory of the script inside the VM: a host path, read-only there. Default:
    /// the workspace root.
    pub cwd: Option<PathBuf>,
}

impl Default for VmOptions {
    fn default() -> Self {
        Self {
            disk_mb: None,
            mem_mb: VM_MEM_MB_DEFAULT,
            cpus: VM_CPUS_DEFAULT,
            timeout: Duration::from_secs(VM_TIMEOUT_S_DEFAULT),
            env: Vec::new(),
            cwd: None,
        }
    }
}

impl VmOptions {
    pub fn with_env(mut self, name: &str, value: impl Into<String>) -> Self {
        self.env.push((name.to_owned(), value.into()));
        self
    }
}

/// What the script printed (stdout and stderr inside the VM arrive merged, on the serial
/// console) and its exit status. `stderr` holds kernel-vm.sh's own messages.
#[derive(Debug)]
pub struct VmOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl VmOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    pub fn timed_out(&self) -> bool {
        self.code() == Some(STATUS_TIMED_OUT)
    }

    /// Panics with everything the VM printed unless the script exited with status 0.
    #[track_caller]
    pub fn assert_success(&self) {
        assert!(
            self.success(),
            "VM script failed ({}{})\n--- VM output ---\n{}\n--- kernel-vm.sh ---\n{}",
            self.status,
            if self.timed_out() { ", timed out" } else { "" },
            self.stdout,
            self.stderr
        );
    }
}

/// The workspace root: `$KURA_WORKSPACE_ROOT` if set, else two levels above this crate.
pub fn workspace_root() -> PathBuf {
    if let Some(root) = std::env::var_os("KURA_WORKSPACE_ROOT") {
        return PathBuf::from(root);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = here.join("../..");
    root.canonicalize().unwrap_or(root)
}

/// Where scripts/vm-kernel-fetch.sh keeps the VM kernel: `$KURA_VM_CACHE` or /var/cache/kura-vm.
pub fn kernel_cache_dir() -> PathBuf {
    std::env::var_os("KURA_VM_CACHE")
        .map_or_else(|| PathBuf::from(KERNEL_CACHE_DEFAULT), PathBuf::from)
}

fn kernel_vm_script() -> PathBuf {
    workspace_root().join("scripts/kernel-vm.sh")
}

/// `Ok` when a VM can be started right now: qemu, the initramfs tools and a cached kernel are
/// there. `/dev/kvm` is not needed (the VM runs under TCG). Does not download anything; see
/// [`ensure_vm`].
pub fn vm_available() -> Result<(), String> {
    let script = kernel_vm_script();
    if !script.is_file() {
        return Err(format!(
            "{} not found (set KURA_WORKSPACE_ROOT)",
            script.display()
        ));
    }
    for tool in ["qemu-system-x86_64", "cpio", "xz"] {
        require_cmd(tool)?;
    }
    if !Path::new("/bin/busybox").is_file() {
        return Err("/bin/busybox not found: apt-get install busybox-static".to_owned());
    }
    let kernel = kernel_cache_dir().join("current/vmlinuz");
    if !kernel.is_file() {
        return Err(format!(
            "no VM kernel at {}: run ./scripts/test.sh or scripts/vm-kernel-fetch.sh",
            kernel.display()
        ));
    }
    Ok(())
}

/// Like [`vm_available`], but first fetches the kernel with scripts/vm-kernel-fetch.sh when it
/// is missing (needs apt and root). `Err(reason)` when the VM still cannot be had.
pub fn ensure_vm() -> Result<(), String> {
    require_cmd("qemu-system-x86_64")?;
    if !kernel_cache_dir().join("current/vmlinuz").is_file() {
        let fetch = workspace_root().join("scripts/vm-kernel-fetch.sh");
        let out = Command::new(&fetch)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", fetch.display()))?;
        if !out.status.success() {
            return Err(format!(
                "cannot fetch the VM kernel ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    vm_available()
}

/// True when `KURA_REQUIRE_VM=1` (scripts/test.sh sets it after installing the VM's parts):
/// then a VM test must fail, not skip, when the VM is unavailable.
pub fn vm_required() -> bool {
    std::env::var("KURA_REQUIRE_VM").is_ok_and(|v| v == "1")
}

/// Runs `script` (bash) as root in the kernel VM and returns its output and exit status.
///
/// `Err` only when kernel-vm.sh cannot be started; a VM that fails to boot or times out gives
/// an `Ok` output with status 125 or 124. VMs of one test process run one at a time.
pub fn run_in_vm(script: &str, opts: VmOptions) -> io::Result<VmOutput> {
    let _slot = VM_SLOT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut command = Command::new(kernel_vm_script());
    command
        .arg(script)
        .current_dir(opts.cwd.unwrap_or_else(workspace_root))
        .env("VM_MEM_MB", opts.mem_mb.to_string())
        .env("VM_CPUS", opts.cpus.to_string())
        .env("VM_TIMEOUT_S", opts.timeout.as_secs().max(1).to_string())
        .stdin(Stdio::null());
    match opts.disk_mb {
        Some(mb) => command.env("VM_DISK_MB", mb.to_string()),
        None => command.env_remove("VM_DISK_MB"),
    };
    let mut names = Vec::with_capacity(opts.env.len());
    for (name, value) in &opts.env {
        command.env(name, value);
        names.push(name.as_str());
    }
    command.env("VM_ENV", names.join(" "));
    let out = command.output()?;
    Ok(VmOutput {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_root_holds_the_vm_scripts() {
        let root = workspace_root();
        assert!(root.join("Cargo.toml").is_file(), "{}", root.display());
        assert!(root.join("scripts/kernel-vm.sh").is_file());
        assert!(root.join("scripts/vm-selftest.sh").is_file());
    }

    #[test]
    fn default_options_match_the_script_defaults() {
        let opts = VmOptions::default().with_env("A", "b");
        assert_eq!(
            (opts.mem_mb, opts.cpus, opts.timeout.as_secs()),
            (2048, 2, 600)
        );
        assert_eq!(opts.env, vec![("A".to_owned(), "b".to_owned())]);
    }
}
