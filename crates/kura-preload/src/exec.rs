//! `execve`, `execveat` and `fexecve` of kura files.
//!
//! The kernel cannot see kura paths, so an exec whose file is kura's is done here:
//! - a binary is copied into a close-on-exec `memfd` and run with `execveat(AT_EMPTY_PATH)`;
//! - a `#!` script is run the way the kernel runs one (`binfmt_script`): its interpreter,
//!   then the line's optional argument, then the script's path as the caller gave it, then the
//!   caller's `argv[1..]`. The interpreter (the preload is in it) opens the script by its kura
//!   path; a kura interpreter (`#!/kura/venv/bin/python3`) is exec'd the same way, up to
//!   [`EXEC_INTERPRETERS_MAX`] levels;
//! - a kura symlink that leads out of the mount (a virtualenv's `bin/python3 ->
//!   /usr/bin/python3`) runs the kernel's file it leads to.
//!
//! A script of the kernel's whose interpreter is a kura path is run the same way; every other
//! exec goes to the kernel untouched (with the virtual working directory in the environment).

use std::ffi::{c_char, c_int};
use std::sync::Arc;

use kura_fs::Fs;
use kura_fs::path::Resolved;

use kura_fs::shebang::{SHEBANG_LINE_BYTES_MAX, Shebang, parse_shebang};

use crate::hooks::{check_access, fs_errno, guard, raw, resolve, ret_int, with_fs, writeback_before_leaving};
use crate::paths::{Target, bytes, c_path, classify};
use crate::state::{self, State};

/// How many `#!` interpreters one exec follows before `ELOOP` (the kernel's binfmt
/// rewrites stop at 5 levels; four interpreters plus the binary).
pub const EXEC_INTERPRETERS_MAX: usize = 4;
/// Bytes copied per step from a kura binary into its memfd.
const IMAGE_COPY_STEP_BYTES: usize = 128 << 10;

/// What an exec of one path runs.
enum ExecTarget {
    /// The kernel's file at this path (NUL-terminated).
    Kernel(Vec<u8>),
    /// A kura binary copied into this memfd (close-on-exec), and its inode.
    Image(c_int, u64),
    /// A kura `#!` script.
    Script(Shebang),
}

/// The exec target of kura inode `ino`; a binary runs from `kernel_path` when the kernel
/// sees the file there.
fn kura_target(fs: &Arc<Fs>, ino: u64, kernel_path: Option<&[u8]>) -> Result<ExecTarget, i32> {
    let inode = fs.getattr(ino).map_err(fs_errno)?;
    if inode.mode & libc::S_IFMT != libc::S_IFREG {
        return Err(libc::EACCES);
    }
    check_access(&inode, libc::X_OK, true)?;
    let node = fs.open_node(&inode).map_err(fs_errno)?;
    let target = copy_image(fs, &node, kernel_path);
    let _ = fs.release(&node);
    target
}

fn copy_image(fs: &Arc<Fs>, node: &Arc<kura_fs::Node>, kernel_path: Option<&[u8]>) -> Result<ExecTarget, i32> {
    let mut buf = vec![0u8; IMAGE_COPY_STEP_BYTES];
    let mut n = fs.read(node, 0, &mut buf).map_err(fs_errno)?;
    // Scripts are run here either way: their interpreter gets the path as the caller gave it
    // (the kernel could not resolve one relative to the virtual working directory).
    if let Some(shebang) = parse_shebang(&buf[..n])? {
        return Ok(ExecTarget::Script(shebang));
    }
    if let Some(path) = kernel_path {
        return Ok(ExecTarget::Kernel(c_path(path)));
    }
    let fd = raw::memfd_create(b"kura-exec\0", libc::MFD_CLOEXEC)?;
    let mut at = 0u64;
    while n > 0 {
        // SAFETY: writing our buffer to our memfd.
        let w = unsafe { crate::raw_syscall!(libc::SYS_pwrite64, fd, buf.as_ptr(), n, at as i64) };
        if w != n as i64 {
            raw::close(fd);
            return Err(libc::EIO);
        }
        at += n as u64;
        n = fs.read(node, at, &mut buf).map_err(fs_errno)?;
    }
    Ok(ExecTarget::Image(fd, node.ino))
}

/// The exec target of `path` (not NUL-terminated) relative to `dirfd`.
fn target_of(state: &State, dirfd: c_int, path: &[u8]) -> Result<ExecTarget, i32> {
    match classify(state, dirfd, path)? {
        Target::Kernel if dirfd == libc::AT_FDCWD || path.first() == Some(&b'/') => Ok(ExecTarget::Kernel(c_path(path))),
        // A path relative to a kernel directory descriptor: the caller's execveat stands.
        Target::Kernel => Err(libc::ENOTSUP),
        Target::KernelAbs(abs) => Ok(ExecTarget::Kernel(abs)),
        Target::Kura { start, rel, abs } => with_fs(state, |fs| match resolve(state, fs, start, &rel, true)? {
            // `kura fs run --fuse`: the kernel sees the file system at the same path, so it
            // runs a binary itself ($ORIGIN and /proc/self/exe as for any file).
            Resolved::Found { entry, .. } => kura_target(fs, entry.ino, kernel_sees_mount(state).then_some(&abs[..])),
            Resolved::Outside(abs) => Ok(ExecTarget::Kernel(c_path(&abs))),
            Resolved::Missing { .. } => Err(libc::ENOENT),
        }),
    }
}

/// `statfs(2)`'s `f_type` of FUSE file systems.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether `kura fs run --fuse` mounted this file system where the kernel sees it too: it says
/// so in `KURA_FS_KERNEL_MOUNT`, and a FUSE file system is mounted at the prefix.
pub(crate) fn kernel_sees_mount(state: &State) -> bool {
    if std::env::var_os("KURA_FS_KERNEL_MOUNT").is_none_or(|v| v != "1") {
        return false;
    }
    let path = c_path(&state.mount);
    // SAFETY: a zeroed statfs is a valid value; statfs writes only into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a writable struct that lives across the call.
    let r = unsafe { crate::raw_syscall!(libc::SYS_statfs, path.as_ptr(), &mut st as *mut libc::statfs) };
    r == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
}

/// The `#!` line of the kernel's file at `path` (NUL-terminated) when its interpreter is a
/// kura path: the kernel could not find that interpreter.
fn kernel_script_with_kura_interpreter(state: &State, path: &[u8]) -> Option<Shebang> {
    // SAFETY: path is NUL-terminated; a read-only, non-blocking open of the caller's file.
    let fd = unsafe { crate::raw_syscall!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    let mut head = [0u8; SHEBANG_LINE_BYTES_MAX];
    // SAFETY: reading into our buffer.
    let n = unsafe { crate::raw_syscall!(libc::SYS_read, fd, head.as_mut_ptr(), head.len()) };
    raw::close(fd as c_int);
    let shebang = parse_shebang(&head[..usize::try_from(n).ok()?]).ok()??;
    matches!(classify(state, libc::AT_FDCWD, &shebang.interpreter), Ok(Target::Kura { .. })).then_some(shebang)
}

/// The caller's `argv` as owned strings.
fn collect_argv(argv: *const *const c_char) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if argv.is_null() {
        return out;
    }
    for i in 0.. {
        // SAFETY: execve's contract: a NULL-terminated array of C strings.
        let p = unsafe { *argv.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: as above.
        out.push(unsafe { bytes(p) }.unwrap_or_default().to_vec());
    }
    out
}

/// Runs the exec: `Err(errno)` when it failed (success does not return).
fn exec(state: &State, dirfd: c_int, path: &[u8], argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> Result<c_int, i32> {
    let mut dirfd = dirfd;
    let mut path = path.to_vec();
    // The argv after following scripts (owned), or the caller's.
    let mut args: Option<Vec<Vec<u8>>> = None;
    for _ in 0..=EXEC_INTERPRETERS_MAX {
        let target = target_of(state, dirfd, &path)?;
        let script = match &target {
            ExecTarget::Script(s) => Some(s.clone()),
            ExecTarget::Kernel(abs) => kernel_script_with_kura_interpreter(state, abs),
            ExecTarget::Image(..) => None,
        };
        if let Some(Shebang { interpreter, argument }) = script {
            let old = args.take().unwrap_or_else(|| collect_argv(argv));
            let mut new = vec![interpreter.clone()];
            new.extend(argument);
            new.push(path);
            new.extend(old.into_iter().skip(1));
            args = Some(new);
            path = interpreter;
            dirfd = libc::AT_FDCWD;
            continue;
        }
        let owned: Option<Vec<Vec<u8>>> = args.as_ref().map(|a| a.iter().map(|s| c_path(s)).collect());
        let mut ptrs: Vec<*const c_char> = Vec::new();
        let argv = match &owned {
            Some(owned) => {
                ptrs.extend(owned.iter().map(|s| s.as_ptr().cast::<c_char>()));
                ptrs.push(std::ptr::null());
                ptrs.as_ptr()
            }
            None => argv,
        };
        let r = match target {
            ExecTarget::Image(fd, ino) => {
                // The new image runs holding the file's text lock (text.rs).
                let text = crate::text::lock_for_exec(ino);
                let value = text.map(|t| format!("{ino}:{t}").into_bytes());
                let (_owned, env, _) = env_with(envp, crate::text::TEXT_ENV, value.as_deref());
                // SAFETY: executing our memfd with the argv and environment.
                let r = unsafe { crate::raw_syscall!(libc::SYS_execveat, fd, c"".as_ptr(), argv, env.as_ptr(), libc::AT_EMPTY_PATH) };
                if let Some(t) = text {
                    raw::close(t);
                }
                let e = crate::hooks::errno();
                raw::close(fd);
                crate::hooks::set_errno(e);
                r
            }
            // SAFETY: a NUL-terminated path, the argv and environment.
            ExecTarget::Kernel(abs) => unsafe { crate::raw_syscall!(libc::SYS_execveat, libc::AT_FDCWD, abs.as_ptr(), argv, envp, flags & !libc::AT_EMPTY_PATH) },
            ExecTarget::Script(_) => unreachable!("scripts are followed above"),
        };
        debug_assert!(r < 0);
        return Err(crate::hooks::errno());
    }
    Err(libc::ELOOP)
}

/// Name of the variable that tells a new image its virtual working directory.
pub(crate) const CWD_ENV: &str = "KURA_FS_CWD";

/// `envp` with variable `name` set to `value`, or removed: the new variable's bytes, the
/// pointer array (NULL-terminated), and whether `envp` carried the variable.
fn env_with(envp: *const *const c_char, name: &str, value: Option<&[u8]>) -> (Vec<u8>, Vec<*const c_char>, bool) {
    let mut prefix = name.as_bytes().to_vec();
    prefix.push(b'=');
    let mut ptrs: Vec<*const c_char> = Vec::new();
    let mut had = false;
    if !envp.is_null() {
        for i in 0.. {
            // SAFETY: execve's contract: a NULL-terminated array of C strings.
            let p = unsafe { *envp.add(i) };
            if p.is_null() {
                break;
            }
            // SAFETY: as above.
            if unsafe { bytes(p) }.unwrap_or_default().starts_with(&prefix) {
                had = true;
            } else {
                ptrs.push(p);
            }
        }
    }
    let var = match value {
        Some(value) => [&prefix[..], value, b"\0"].concat(),
        None => Vec::new(),
    };
    if !var.is_empty() {
        ptrs.push(var.as_ptr().cast());
    }
    ptrs.push(std::ptr::null());
    (var, ptrs, had)
}

/// The common body of the three exec calls: `path` relative to `dirfd`, or `dirfd` itself
/// (`AT_EMPTY_PATH` with an empty path).
fn exec_call(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int {
    let kernel = |envp: *const *const c_char| {
        // SAFETY: passing the caller's arguments (and our environment copy) to the kernel.
        unsafe { crate::raw_syscall!(libc::SYS_execveat, dirfd, path, argv, envp, flags) as c_int }
    };
    let Some(state) = state::get() else { return kernel(envp) };
    writeback_before_leaving();
    crate::hooks::lock_files_across_exec(state);
    let cwd = state.cwd.read().clone();
    let (_owned, env, had_cwd) = env_with(envp, CWD_ENV, cwd.as_deref());
    let envp2 = if cwd.is_some() || had_cwd { env.as_ptr() } else { envp };
    // SAFETY: libc's contract.
    let Some(p) = (unsafe { bytes(path) }) else { return kernel(envp2) };
    if state::busy() {
        return kernel(envp2);
    }
    // `fexecve` of a kura descriptor: its file, by the path it was opened at.
    let (dirfd, p) = if p.is_empty() && flags & libc::AT_EMPTY_PATH != 0 {
        match state.fds.get(dirfd) {
            Some(of) => (libc::AT_FDCWD, of.path.clone()),
            None => return kernel(envp2),
        }
    } else {
        (dirfd, p.to_vec())
    };
    match exec(state, dirfd, &p, argv, envp2, flags) {
        Err(libc::ENOTSUP) => kernel(envp2),
        r => ret_int(r),
    }
}

pub(crate) extern "C" fn h_execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    guard(-1, || exec_call(libc::AT_FDCWD, path, argv, envp, 0))
}

pub(crate) extern "C" fn h_execveat(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int {
    guard(-1, || exec_call(dirfd, path, argv, envp, flags))
}

pub(crate) extern "C" fn h_fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    guard(-1, || exec_call(fd, c"".as_ptr(), argv, envp, libc::AT_EMPTY_PATH))
}
