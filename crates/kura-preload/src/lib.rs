//! `libkura_fs.so`: kura's file system for unmodified programs (paper 004's EvFS).
//!
//! Loaded with `LD_PRELOAD` (`kura fs run -- COMMAND` sets it up), it serves every path under
//! the mount prefix (`KURA_FS_MOUNT`, default `/kura`) from the pool and passes everything
//! else to the kernel untouched.
//!
//! # Interception
//!
//! Symbol overrides alone miss glibc's internal calls (stdio's `_IO_file_write` calls
//! `__write`, `opendir` calls `__open_nocancel`, ...). In the spirit of DAOS's libpil4dfs, the
//! constructor patches the entry of each relevant libc function in libc's own text with an
//! absolute jump to its handler here ([`patch`]): `write`, `__write` and `__libc_write` are one
//! code address, so internal callers are caught too. Handlers pass non-kura descriptors and
//! paths to the kernel with the `syscall` instruction ([`sys`]) — the patched original is
//! never called, so there are no trampolines and no relocated instructions — and a
//! thread-local guard sends the library's own I/O (pool sockets, the engine's file) straight
//! through. libc's `syscall(3)` is patched too: a call by number reaches the same handlers.
//!
//! # Descriptors
//!
//! A kura descriptor is a real kernel descriptor: a small `memfd` named `kura-fd` whose shared
//! mapping holds the open file description's state (inode, flags, the offset as an atomic).
//! `dup`, `dup2` onto 0/1/2, `fork` and `SCM_RIGHTS` share it as the kernel shares any
//! description, `poll` works on it, close-on-exec is the kernel's, and after `exec` the new
//! image's constructor finds its kura descriptors again in `/proc/self/fd` ([`fds`]).
//!
//! # Sockets
//!
//! A Unix-domain socket bound at a kura path is an `S_IFSOCK` node in the file system and,
//! for the kernel, a socket bound to an abstract name derived from the node ([`sock`]).
//!
//! # Global state
//!
//! An `LD_PRELOAD` library inherently has process-wide state: this crate keeps all of it in
//! one [`State`], created by the constructor (see [`state`]).

#![allow(clippy::missing_safety_doc)]

mod dir;
mod dl;
mod exec;
mod fds;
mod hooks;
mod maps;
mod patch;
mod paths;
mod signals;
mod sock;
mod spawn;
mod state;
mod sys;
mod text;

pub use state::State;

/// The constructor: runs when the library is loaded, before `main`.
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    // Never unwind into the loader.
    let _ = std::panic::catch_unwind(state::init);
}
