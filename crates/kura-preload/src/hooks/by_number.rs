//! `syscall(3)`: a program that makes a file system call by number instead of through its
//! libc function reaches the same handler. libuv (Node.js) calls `statx` this way, so without
//! this `fs.statSync` of a kura path said ENOENT and `stat` of a kura descriptor described its
//! placeholder.
//!
//! libc's `syscall` is patched with a jump to [`h_syscall`], which checks the number against
//! a bitmap: a number kura handles goes to [`dispatch`] with the arguments untouched; any
//! other (futex above all, from every thread library) runs exactly as in glibc's own
//! `syscall`, without a Rust frame, so that calls which return twice or on another stack
//! (`clone`) behave as they do there.

use std::ffi::{c_char, c_int, c_long, c_uint, c_void};

use super::*;
use crate::dir::h_getdents64;
use crate::exec::{h_execve, h_execveat};

/// System call numbers below this have a bit in [`DISPATCHED`].
const NR_LIMIT: usize = 512;

/// The numbers [`dispatch`] handles: those of the patched functions whose system call has
/// the function's arguments and result (or a simple translation of them).
const DISPATCHED_NRS: &[c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_sync,
    libc::SYS_syncfs,
    libc::SYS_truncate,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fadvise64,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_creat,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    SYS_FCHMODAT2,
    libc::SYS_chown,
    libc::SYS_lchown,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_utimensat,
    libc::SYS_utimes,
    libc::SYS_utime,
    libc::SYS_getxattr,
    libc::SYS_lgetxattr,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_fsetxattr,
    libc::SYS_fremovexattr,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_flock,
    libc::SYS_fcntl,
    libc::SYS_chdir,
    libc::SYS_fchdir,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_copy_file_range,
    libc::SYS_sendfile,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_msync,
];

/// Bit `n % 64` of word `n / 64` is set when [`dispatch`] handles number `n`.
static DISPATCHED: [u64; NR_LIMIT / 64] = bitmap(DISPATCHED_NRS);

const fn bitmap(nrs: &[c_long]) -> [u64; NR_LIMIT / 64] {
    let mut bits = [0u64; NR_LIMIT / 64];
    let mut i = 0;
    while i < nrs.len() {
        let nr = nrs[i] as usize;
        assert!(nr < NR_LIMIT, "a dispatched number beyond NR_LIMIT");
        bits[nr / 64] |= 1 << (nr % 64);
        i += 1;
    }
    bits
}

/// libc's `syscall(long number, ...)`, entered by the jump patched over its first bytes.
///
/// # Safety
/// As `syscall(3)`.
#[unsafe(naked)]
pub(crate) unsafe extern "C" fn h_syscall() {
    // Entry: the number in rdi, up to six arguments in rsi rdx rcx r8 r9 and at 8(%rsp).
    // Handled numbers: a jump (the stack as the caller left it) to `dispatch`, which takes the
    // same seven arguments. Others: glibc's sequence (shift the arguments into the kernel's
    // registers, `syscall`, -errno → errno and -1).
    core::arch::naked_asm!(
        "cmp rdi, {limit}",
        "jae 2f",
        "mov rax, rdi",
        "shr rax, 6",
        "lea r11, [rip + {bits}]",
        "mov r11, qword ptr [r11 + rax * 8]",
        "bt r11, rdi",
        "jnc 2f",
        "jmp {dispatch}",
        "2:",
        "mov rax, rdi",
        "mov rdi, rsi",
        "mov rsi, rdx",
        "mov rdx, rcx",
        "mov r10, r8",
        "mov r8, r9",
        "mov r9, qword ptr [rsp + 8]",
        "syscall",
        "cmp rax, -4095",
        "jae 3f",
        "ret",
        "3:",
        "mov rdi, rax",
        "jmp {failed}",
        limit = const NR_LIMIT,
        bits = sym DISPATCHED,
        dispatch = sym dispatch,
        failed = sym failed,
    )
}

/// The kernel refused a passed-through call: `-errno` in, -1 out with `errno` set.
extern "C" fn failed(negative_errno: c_long) -> c_long {
    set_errno(-negative_errno as c_int);
    -1
}

/// A call by number that kura handles: the handler of the libc function, with the system
/// call's arguments (cast as the kernel reads them) and `syscall(3)`'s result convention.
extern "C" fn dispatch(nr: c_long, a1: c_long, a2: c_long, a3: c_long, a4: c_long, a5: c_long, a6: c_long) -> c_long {
    let fd = |a: c_long| a as c_int;
    let int = |a: c_long| a as c_int;
    let uint = |a: c_long| a as c_uint;
    let path = |a: c_long| a as *const c_char;
    let stat = |a: c_long| a as *mut libc::stat;
    let iov = |a: c_long| a as *const libc::iovec;
    let ok = |r: c_int| c_long::from(r);
    match nr {
        libc::SYS_read => h_read(fd(a1), a2 as *mut c_void, a3 as usize) as c_long,
        libc::SYS_write => h_write(fd(a1), a2 as *const c_void, a3 as usize) as c_long,
        libc::SYS_pread64 => h_pread(fd(a1), a2 as *mut c_void, a3 as usize, a4) as c_long,
        libc::SYS_pwrite64 => h_pwrite(fd(a1), a2 as *const c_void, a3 as usize, a4) as c_long,
        libc::SYS_readv => h_readv(fd(a1), iov(a2), int(a3)) as c_long,
        libc::SYS_writev => h_writev(fd(a1), iov(a2), int(a3)) as c_long,
        // x86-64 passes the whole offset in pos_l (a4); pos_h (a5) repeats its high half.
        libc::SYS_preadv => h_preadv(fd(a1), iov(a2), int(a3), a4) as c_long,
        libc::SYS_pwritev => h_pwritev(fd(a1), iov(a2), int(a3), a4) as c_long,
        libc::SYS_preadv2 => h_preadv2(fd(a1), iov(a2), int(a3), a4, int(a6)) as c_long,
        libc::SYS_pwritev2 => h_pwritev2(fd(a1), iov(a2), int(a3), a4, int(a6)) as c_long,
        libc::SYS_lseek => h_lseek(fd(a1), a2, int(a3)),
        libc::SYS_fsync => ok(h_fsync(fd(a1))),
        libc::SYS_fdatasync => ok(h_fdatasync(fd(a1))),
        libc::SYS_sync => {
            h_sync();
            0
        }
        libc::SYS_syncfs => ok(h_syncfs(fd(a1))),
        libc::SYS_truncate => ok(h_truncate(path(a1), a2)),
        libc::SYS_ftruncate => ok(h_ftruncate(fd(a1), a2)),
        libc::SYS_fallocate => ok(h_fallocate(fd(a1), int(a2), a3, a4)),
        // posix_fadvise returns the error; the system call fails with it.
        libc::SYS_fadvise64 => match h_posix_fadvise(fd(a1), a2, a3, int(a4)) {
            0 => 0,
            e => failed(-c_long::from(e)),
        },
        libc::SYS_stat => ok(h_stat(path(a1), stat(a2))),
        libc::SYS_lstat => ok(h_lstat(path(a1), stat(a2))),
        libc::SYS_fstat => ok(h_fstat(fd(a1), stat(a2))),
        libc::SYS_newfstatat => ok(h_fstatat(fd(a1), path(a2), stat(a3), int(a4))),
        libc::SYS_statx => ok(h_statx(fd(a1), path(a2), int(a3), uint(a4), a5 as *mut libc::statx)),
        libc::SYS_access => ok(h_access(path(a1), int(a2))),
        libc::SYS_faccessat => ok(h_faccessat(fd(a1), path(a2), int(a3), 0)),
        libc::SYS_faccessat2 => ok(h_faccessat(fd(a1), path(a2), int(a3), int(a4))),
        libc::SYS_open => ok(h_open(path(a1), int(a2), uint(a3))),
        libc::SYS_openat => ok(h_openat(fd(a1), path(a2), int(a3), uint(a4))),
        libc::SYS_creat => ok(h_creat(path(a1), uint(a2))),
        libc::SYS_close => ok(h_close(fd(a1))),
        libc::SYS_close_range => ok(h_close_range(uint(a1), uint(a2), int(a3))),
        libc::SYS_dup => ok(h_dup(fd(a1))),
        libc::SYS_dup2 => ok(h_dup2(fd(a1), fd(a2))),
        libc::SYS_dup3 => ok(h_dup3(fd(a1), fd(a2), int(a3))),
        libc::SYS_unlink => ok(h_unlink(path(a1))),
        libc::SYS_unlinkat => ok(h_unlinkat(fd(a1), path(a2), int(a3))),
        libc::SYS_rmdir => ok(h_rmdir(path(a1))),
        libc::SYS_mkdir => ok(h_mkdir(path(a1), uint(a2))),
        libc::SYS_mkdirat => ok(h_mkdirat(fd(a1), path(a2), uint(a3))),
        libc::SYS_mknod => ok(h_mknod(path(a1), uint(a2), a3 as libc::dev_t)),
        libc::SYS_mknodat => ok(h_mknodat(fd(a1), path(a2), uint(a3), a4 as libc::dev_t)),
        libc::SYS_rename => ok(h_rename(path(a1), path(a2))),
        libc::SYS_renameat => ok(h_renameat(fd(a1), path(a2), fd(a3), path(a4))),
        libc::SYS_renameat2 => ok(h_renameat2(fd(a1), path(a2), fd(a3), path(a4), uint(a5))),
        libc::SYS_link => ok(h_link(path(a1), path(a2))),
        libc::SYS_linkat => ok(h_linkat(fd(a1), path(a2), fd(a3), path(a4), int(a5))),
        libc::SYS_symlink => ok(h_symlink(path(a1), path(a2))),
        libc::SYS_symlinkat => ok(h_symlinkat(path(a1), fd(a2), path(a3))),
        libc::SYS_readlink => h_readlink(path(a1), a2 as *mut c_char, a3 as usize) as c_long,
        libc::SYS_readlinkat => h_readlinkat(fd(a1), path(a2), a3 as *mut c_char, a4 as usize) as c_long,
        libc::SYS_chmod => ok(h_chmod(path(a1), uint(a2))),
        libc::SYS_fchmod => ok(h_fchmod(fd(a1), uint(a2))),
        libc::SYS_fchmodat => ok(h_fchmodat(fd(a1), path(a2), uint(a3), 0)),
        SYS_FCHMODAT2 => ok(h_fchmodat(fd(a1), path(a2), uint(a3), int(a4))),
        libc::SYS_chown => ok(h_chown(path(a1), uint(a2), uint(a3))),
        libc::SYS_lchown => ok(h_lchown(path(a1), uint(a2), uint(a3))),
        libc::SYS_fchown => ok(h_fchown(fd(a1), uint(a2), uint(a3))),
        libc::SYS_fchownat => ok(h_fchownat(fd(a1), path(a2), uint(a3), uint(a4), int(a5))),
        // The kernel takes a null path as "the descriptor itself" (futimens); libc does not.
        libc::SYS_utimensat if a2 == 0 && a4 == 0 => ok(h_futimens(fd(a1), a3 as *const libc::timespec)),
        libc::SYS_utimensat if a2 != 0 => ok(h_utimensat(fd(a1), path(a2), a3 as *const libc::timespec, int(a4))),
        libc::SYS_utimes => ok(h_utimes(path(a1), a2 as *const libc::timeval)),
        libc::SYS_utime => ok(h_utime(path(a1), a2 as *const libc::utimbuf)),
        libc::SYS_getxattr => h_getxattr(path(a1), path(a2), a3 as *mut c_void, a4 as usize) as c_long,
        libc::SYS_lgetxattr => h_lgetxattr(path(a1), path(a2), a3 as *mut c_void, a4 as usize) as c_long,
        libc::SYS_listxattr => h_listxattr(path(a1), a2 as *mut c_char, a3 as usize) as c_long,
        libc::SYS_llistxattr => h_llistxattr(path(a1), a2 as *mut c_char, a3 as usize) as c_long,
        libc::SYS_setxattr => ok(h_setxattr(path(a1), path(a2), a3 as *const c_void, a4 as usize, int(a5))),
        libc::SYS_lsetxattr => ok(h_lsetxattr(path(a1), path(a2), a3 as *const c_void, a4 as usize, int(a5))),
        libc::SYS_removexattr => ok(h_removexattr(path(a1), path(a2))),
        libc::SYS_lremovexattr => ok(h_lremovexattr(path(a1), path(a2))),
        libc::SYS_fgetxattr => h_fgetxattr(fd(a1), path(a2), a3 as *mut c_void, a4 as usize) as c_long,
        libc::SYS_flistxattr => h_flistxattr(fd(a1), a2 as *mut c_char, a3 as usize) as c_long,
        libc::SYS_fsetxattr => ok(h_fsetxattr(fd(a1), path(a2), a3 as *const c_void, a4 as usize, int(a5))),
        libc::SYS_fremovexattr => ok(h_fremovexattr(fd(a1), path(a2))),
        libc::SYS_statfs => ok(h_statfs(path(a1), a2 as *mut libc::statfs)),
        libc::SYS_fstatfs => ok(h_fstatfs(fd(a1), a2 as *mut libc::statfs)),
        libc::SYS_flock => ok(h_flock(fd(a1), int(a2))),
        libc::SYS_fcntl => ok(h_fcntl(fd(a1), int(a2), a3)),
        libc::SYS_chdir => ok(h_chdir(path(a1))),
        libc::SYS_fchdir => ok(h_fchdir(fd(a1))),
        // The system call returns the length with the NUL; a null buffer is EFAULT there
        // (libc's would allocate one).
        libc::SYS_getcwd if a1 != 0 => {
            let buf = a1 as *mut c_char;
            if h_getcwd(buf, a2 as usize).is_null() {
                -1
            } else {
                // SAFETY: getcwd succeeded: `buf` holds a NUL-terminated path.
                unsafe { std::ffi::CStr::from_ptr(buf) }.to_bytes_with_nul().len() as c_long
            }
        }
        libc::SYS_getdents64 => h_getdents64(fd(a1), a2 as *mut c_void, a3 as usize) as c_long,
        libc::SYS_copy_file_range => h_copy_file_range(fd(a1), a2 as *mut i64, fd(a3), a4 as *mut i64, a5 as usize, uint(a6)) as c_long,
        libc::SYS_sendfile => h_sendfile(fd(a1), fd(a2), a3 as *mut i64, a4 as usize) as c_long,
        libc::SYS_execve => ok(h_execve(path(a1), a2 as *const *const c_char, a3 as *const *const c_char)),
        libc::SYS_execveat => ok(h_execveat(fd(a1), path(a2), a3 as *const *const c_char, a4 as *const *const c_char, int(a5))),
        libc::SYS_mmap => h_mmap(a1 as *mut c_void, a2 as usize, int(a3), int(a4), fd(a5), a6) as c_long,
        libc::SYS_munmap => ok(h_munmap(a1 as *mut c_void, a2 as usize)),
        libc::SYS_msync => ok(h_msync(a1 as *mut c_void, a2 as usize, int(a3))),
        // The rest of what the bitmap lets through (a null getcwd buffer, utimensat's other
        // null-path forms): the kernel decides.
        // SAFETY: the caller's own system call, unchanged.
        _ => unsafe { crate::raw_syscall!(nr, a1, a2, a3, a4, a5, a6) },
    }
}
