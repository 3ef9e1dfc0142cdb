//! The preload's own system calls, made with the `syscall` instruction.
//!
//! libc's `syscall(3)` is patched like the other functions (see [`crate::hooks`]'s
//! `h_syscall`): a program that asks for `statx` or `openat` by number (libuv, and with it
//! Node.js, stats files that way) reaches the same handlers as through the named functions.
//! So the handlers' own way to the kernel cannot be `syscall(3)` any more: [`raw_syscall!`]
//! is, with the same result convention (-1 and `errno` on failure).

use std::ffi::c_long;

/// Largest return value that is an error (`-errno`), as the kernel reports it.
const ERRNO_MAX: c_long = 4095;

/// A raw system call: `raw_syscall!(libc::SYS_read, fd, buf, len)`. Each argument is
/// converted with `as c_long` (integers and raw pointers), as passing it to `syscall(3)`
/// would. Returns the kernel's result, or -1 with `errno` set.
#[macro_export]
macro_rules! raw_syscall {
    ($nr:expr $(, $arg:expr)* $(,)?) => {
        $crate::sys::syscall($nr as ::std::ffi::c_long, &[$($arg as ::std::ffi::c_long),*])
    };
}

/// See [`raw_syscall!`].
///
/// # Safety
/// As the system call `nr` with these arguments: pointers must be valid for what the kernel
/// reads and writes through them.
#[inline]
pub unsafe fn syscall(nr: c_long, args: &[c_long]) -> c_long {
    let mut a = [0 as c_long; 6];
    a[..args.len()].copy_from_slice(args);
    // SAFETY: the caller's promise for this call.
    let r = unsafe { syscall6(nr, a) };
    if (-ERRNO_MAX..0).contains(&r) {
        crate::hooks::set_errno(-r as i32);
        -1
    } else {
        r
    }
}

/// The kernel's answer itself (`-errno` on failure).
///
/// # Safety
/// As [`syscall`].
#[inline]
pub unsafe fn syscall6(nr: c_long, a: [c_long; 6]) -> c_long {
    let ret: c_long;
    // SAFETY: the `syscall` instruction with the x86-64 Linux convention: number in rax,
    // arguments in rdi rsi rdx r10 r8 r9, result in rax; it clobbers rcx and r11 and nothing
    // else of ours, and does not touch the stack. What the call does is the caller's promise.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") nr => ret,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            in("r8") a[4],
            in("r9") a[5],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}
