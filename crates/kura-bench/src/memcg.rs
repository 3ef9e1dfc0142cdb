//! A memory cgroup that caps what an anchor's process may hold in RAM, its files' page cache
//! included.
//!
//! memcached with extstore reads its file through the kernel's page cache. On a machine with
//! more free RAM than the file (this one has 24 GiB for a file of ~0.4 GiB), every item it
//! "reads from flash" is a page-cache hit after the load: no device read at all (measured: 0
//! reads on the disk in 4 s of 6,000 GETs/s), while kura's `O_DIRECT` reads go to the device.
//! Given "the same RAM as kura's cache", extstore must not get the rest of the machine's RAM as
//! a cache besides. Its process is put in a cgroup whose limit counts its memory and the page
//! cache it brings in, so the kernel drops the file's pages beyond that limit.
//!
//! Both cgroup versions are handled: v2 (`memory.max`, in a child of this process's own cgroup
//! on the unified hierarchy, where the memory controller must be enabled for children) and v1
//! (`memory.limit_in_bytes` on the `memory` hierarchy).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why no cap could be set (the benchmark then runs uncapped and says so).
#[derive(Debug, thiserror::Error)]
pub enum MemoryCapError {
    #[error("no cgroup memory controller is mounted")]
    NoController,
    #[error("cannot {what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: io::Error },
}

/// One cgroup with a memory limit; removed on drop (once its processes have exited).
#[derive(Debug)]
pub struct MemoryCap {
    dir: PathBuf,
    v2: bool,
    limit_bytes: u64,
}

impl MemoryCap {
    /// Creates cgroup `name` below this process's own, limited to `limit_bytes`.
    pub fn create(name: &str, limit_bytes: u64) -> Result<Self, MemoryCapError> {
        let own = fs::read_to_string("/proc/self/cgroup").map_err(|source| MemoryCapError::Io { what: "read", path: "/proc/self/cgroup".into(), source })?;
        let mounts = fs::read_to_string("/proc/self/mountinfo").map_err(|source| MemoryCapError::Io { what: "read", path: "/proc/self/mountinfo".into(), source })?;
        let (parent, v2) = memory_cgroup_dir(&own, &mounts).ok_or(MemoryCapError::NoController)?;
        let dir = parent.join(name);
        let io = |what: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| MemoryCapError::Io { what, path, source }
        };
        if v2 {
            let controllers = fs::read_to_string(parent.join("cgroup.controllers")).map_err(io("read", &parent.join("cgroup.controllers")))?;
            if !controllers.split_whitespace().any(|c| c == "memory") {
                return Err(MemoryCapError::NoController);
            }
            let subtree = parent.join("cgroup.subtree_control");
            if !fs::read_to_string(&subtree).unwrap_or_default().split_whitespace().any(|c| c == "memory") {
                fs::write(&subtree, "+memory").map_err(io("enable the memory controller in", &subtree))?;
            }
        }
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(MemoryCapError::Io { what: "create", path: dir, source }),
        }
        let cap = Self { dir, v2, limit_bytes };
        let limit_file = cap.dir.join(if v2 { "memory.max" } else { "memory.limit_in_bytes" });
        fs::write(&limit_file, limit_bytes.to_string()).map_err(io("write", &limit_file))?;
        Ok(cap)
    }

    /// Has the process `cmd` spawns join the cgroup before it runs (between fork and exec),
    /// so that everything it ever brings into memory counts. Its spawn fails if it cannot.
    pub fn join_at_spawn(&self, cmd: &mut Command) {
        let procs = CString::new(self.dir.join("cgroup.procs").into_os_string().into_encoded_bytes()).expect("a cgroup path from /proc has no NUL");
        // SAFETY: the closure runs in the child between fork and exec and makes only
        // async-signal-safe system calls (open, write, close) on memory allocated before the
        // fork; "0" written to cgroup.procs moves the writing process itself.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let error = io::Error::last_os_error();
                libc::close(fd);
                if written != 1 {
                    return Err(error);
                }
                Ok(())
            });
        }
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }

    /// The most memory the cgroup held at once (its processes' and their page cache).
    pub fn peak_bytes(&self) -> Option<u64> {
        let file = if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" };
        fs::read_to_string(self.dir.join(file)).ok()?.trim().parse().ok()
    }

    /// The page cache the cgroup holds now (file-backed bytes).
    pub fn page_cache_bytes(&self) -> Option<u64> {
        let stat = fs::read_to_string(self.dir.join("memory.stat")).ok()?;
        let key = if self.v2 { "file" } else { "cache" };
        stat.lines().find_map(|line| line.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for MemoryCap {
    fn drop(&mut self) {
        // Fails while a process is still in it; the directory then stays (empty of anything
        // but the cgroup's own files) until the next run reuses it.
        let _ = fs::remove_dir(&self.dir);
    }
}

/// The directory of this process's memory cgroup, and whether it is cgroup v2, from the
/// contents of `/proc/self/cgroup` and `/proc/self/mountinfo`. v1's `memory` hierarchy wins
/// where both are mounted (the controller is then v1's; the unified hierarchy lacks it).
fn memory_cgroup_dir(own: &str, mountinfo: &str) -> Option<(PathBuf, bool)> {
    // mountinfo: "id parent major:minor root mount-point options - fstype source super-options"
    let mounts: Vec<(&str, &str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let dash = fields.iter().position(|&f| f == "-")?;
            Some((*fields.get(3)?, *fields.get(4)?, *fields.get(dash + 1)?, *fields.get(dash + 3)?))
        })
        .collect();
    let join = |mount: &str, root: &str, path: &str| {
        // The mount shows the hierarchy from `root` down: our path is relative to it.
        let relative = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
        Path::new(mount).join(relative)
    };
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory")
            && let Some((root, mount, _, _)) = mounts.iter().find(|(_, _, fstype, options)| *fstype == "cgroup" && options.split(',').any(|o| o == "memory"))
        {
            return Some((join(mount, root, path), false));
        }
    }
    let path = own.lines().find_map(|line| line.strip_prefix("0::"))?;
    let (root, mount, _, _) = mounts.iter().find(|(_, _, fstype, _)| *fstype == "cgroup2")?;
    Some((join(mount, root, path), true))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS_HYBRID: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
34 30 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 30 0:36 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn v1_memory_hierarchy_wins_in_a_hybrid_setup() {
        let own = "8:pids:/\n4:memory:/process_api/667b\n0::/\n";
        assert_eq!(memory_cgroup_dir(own, MOUNTS_HYBRID), Some((PathBuf::from("/sys/fs/cgroup/memory/process_api/667b"), false)));
    }

    #[test]
    fn v2_alone_and_a_namespaced_root() {
        let mounts = "29 23 0:26 /user.slice /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(memory_cgroup_dir("0::/user.slice/session-3.scope\n", mounts), Some((PathBuf::from("/sys/fs/cgroup/session-3.scope"), true)));
        assert_eq!(memory_cgroup_dir("0::/\n", "1 0 8:1 / / rw - ext4 /dev/vda rw\n"), None);
    }

    /// On this machine (root, a memory controller): a cap is set, a process spawned into it,
    /// and the page cache of a file it reads is held within the limit.
    #[test]
    fn a_capped_process_keeps_its_page_cache_within_the_limit() {
        let name = format!("kura-bench-memcg-test-{}", std::process::id());
        let cap = match MemoryCap::create(&name, 32 << 20) {
            Ok(cap) => cap,
            Err(e) => {
                eprintln!("SKIP: no memory cgroup here: {e}");
                return;
            }
        };
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let file = dir.path().join("data");
        fs::write(&file, vec![7u8; 96 << 20]).unwrap();
        // Drop the writer's (our) cached pages, so that the child's read brings them in.
        let f = fs::File::open(&file).unwrap();
        // SAFETY: posix_fadvise on an open descriptor; no memory is passed.
        unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut cat = Command::new("cat");
        cat.arg(&file).stdout(std::process::Stdio::null());
        cap.join_at_spawn(&mut cat);
        assert!(cat.status().unwrap().success());
        let peak = cap.peak_bytes().expect("peak usage");
        assert!(peak > 0, "the reader was not in the cgroup");
        assert!(peak <= 32 << 20, "peak {peak} over the 32 MiB limit");
        assert!(cap.page_cache_bytes().is_some_and(|b| b <= 32 << 20));
    }
}
