//! Helpers for kura's integration tests.
//!
//! - [`run_in_vm`] runs a shell script as root inside a throw-away qemu VM with Debian's 6.12
//!   kernel (ublk_drv, nbd, loop, ext4, xfs as modules), through `scripts/kernel-vm.sh`; the
//!   host's root file system, the project's target directory included, is visible inside.
//! - [`skip`], [`require_cmd`], [`vm_available`]: tests that need a tool, a kernel feature or the
//!   VM skip with a printed `SKIP:` line instead of passing silently.
//! - [`free_tcp_port`], [`wait_for_tcp`], [`ChildGuard`]: start real servers and clean them up.
//!
//! ```no_run
//! use kura_testkit::{run_in_vm, try_or_skip, vm_available, VmOptions};
//!
//! #[test]
//! fn nbd_in_vm() {
//!     try_or_skip!(vm_available());
//!     let out = run_in_vm("modprobe nbd && ls /dev/nbd0", VmOptions::default()).unwrap();
//!     out.assert_success();
//! }
//! ```

mod certs;
mod process;
mod vm;

pub use certs::TestCerts;
pub use process::{ChildGuard, build_workspace_packages, free_tcp_port, memcache_stat, require_cmd, spawn_listening, wait_for_tcp};
pub use vm::{
    VmOptions, VmOutput, ensure_vm, kernel_cache_dir, run_in_vm, vm_available, vm_required,
    workspace_root,
};

/// Prints `SKIP: <test name>: <reason>` to stderr. Call it, then `return` from the test.
///
/// The line goes to stderr unbuffered so that it shows in `cargo test` output even for a
/// passing test (libtest captures only `print!`-style output of the test thread).
pub fn skip(reason: &str) {
    use std::io::Write as _;
    let thread = std::thread::current();
    let test_name = thread.name().unwrap_or("test");
    // A failed write to stderr has nowhere better to be reported.
    let _ = writeln!(std::io::stderr().lock(), "SKIP: {test_name}: {reason}");
}

/// Unwraps a `Result<T, String>`, or prints the reason with [`skip`] and returns from the
/// calling test.
#[macro_export]
macro_rules! try_or_skip {
    ($result:expr) => {
        match $result {
            Ok(value) => value,
            Err(reason) => {
                $crate::skip(&reason);
                return;
            }
        }
    };
}
