//! The library's process-wide state, in one place: configuration read from the environment at
//! load time, the file system (opened at the first kura access), the descriptor table and the
//! working directory when it is inside the mount.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use kura_fs::sync::{Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use kura_fs::{Fs, FsConfig, FsError, Owner, PoolKv, WritebackPause};

use crate::fds::{FdTable, FdTableForkLock};
use crate::sock::SocketNamesForkLock;

/// Mount prefix when `KURA_FS_MOUNT` is not set.
pub const MOUNT_DEFAULT: &str = "/kura";
/// How long after a failed attempt to reach the pool the next access tries again.
const REOPEN_BACKOFF_MS: u64 = 2000;

/// Everything the library keeps for the process.
pub struct State {
    /// The mount prefix, normalised (absolute, no trailing '/').
    pub mount: Vec<u8>,
    pool_urls: Vec<String>,
    fs_config: FsConfig,
    fs: Mutex<FsSlot>,
    /// `fs.fs` once opened (it never changes after): the data path reads it without the lock.
    fs_open: OnceLock<Arc<Fs>>,
    pub fds: FdTable,
    /// The working directory when it is inside the mount (absolute path), else `None` (the
    /// kernel's).
    pub cwd: RwLock<Option<Vec<u8>>>,
    /// The abstract-name prefix of this file system's Unix sockets (see [`crate::sock`]).
    pub sock_prefix: Vec<u8>,
    /// The paths of the kura sockets this process bound or connected to.
    pub sock_names: crate::sock::SocketNames,
    /// Writable shared mappings of kura files (see [`crate::maps`]).
    pub maps: crate::maps::SharedMaps,
    /// Host copies of kura libraries given to `dlopen` (see `dl.rs`).
    pub dl_copies: crate::dl::HostCopies,
    /// Whether libc was patched (otherwise every hook is inert).
    pub active: std::sync::atomic::AtomicBool,
    /// The pool is this process's embedded engine: a forked child cannot use it.
    embedded: bool,
    /// The process that opened the embedded engine.
    owner_pid: u32,
    /// Kura calls in progress, which `fork` waits for (see [`ForkGate`]).
    pub fork_gate: ForkGate,
    /// Held from a fork's prepare handler to the end of its parent's or child's handler: one
    /// fork at a time goes through them. glibc releases its own lock while each handler runs,
    /// so two threads forking at once interleaved them: the second's prepare closed the gate
    /// and forked while the first's parent handler held the file system's node table
    /// (`Fs::share_open_nodes`), and its child hung on that lock in its own handler (cargo's
    /// job threads spawn compilers at once).
    fork_serial: Mutex<()>,
}

/// Lets `fork` wait until no thread is inside a kura call, and keeps new calls out until it
/// returns, so a child never inherits a lock of the file system (a file's, the page cache's,
/// a pool context's) held by a thread it does not have. Calls count themselves in and out
/// with two atomic operations; `fork`'s prepare handler closes the gate and waits for the
/// count to reach zero (polling: no thread is ever parked on a lock the child would inherit).
/// Waits a kura call makes on other processes (record locks) happen outside the gate, and
/// waits on the pool are bounded, so a fork is delayed at most by one call's bounded wait.
pub struct ForkGate {
    calls: AtomicUsize,
    closed: AtomicBool,
}

/// Pause between looks while `fork` waits for calls to finish, or a call for `fork`.
const FORK_GATE_POLL: std::time::Duration = std::time::Duration::from_micros(20);

impl ForkGate {
    const fn new() -> Self {
        Self { calls: AtomicUsize::new(0), closed: AtomicBool::new(false) }
    }

    /// Counts this thread in until the guard drops; waits while a `fork` is in progress.
    /// Call it when entering kura code from outside (not [`busy`]): calls do not nest.
    pub fn enter(&self) -> GateGuard<'_> {
        loop {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if !self.closed.load(Ordering::SeqCst) {
                return GateGuard { gate: self };
            }
            self.calls.fetch_sub(1, Ordering::SeqCst);
            while self.closed.load(Ordering::SeqCst) {
                std::thread::sleep(FORK_GATE_POLL);
            }
        }
    }

    /// Closes the gate and waits until no other thread is inside. Leaves it open when this
    /// thread itself is inside kura code (a `fork` from a signal handler that interrupted a
    /// call): waiting would never end.
    fn close(&self) {
        if busy() {
            return;
        }
        self.closed.store(true, Ordering::SeqCst);
        while self.calls.load(Ordering::SeqCst) != 0 {
            std::thread::sleep(FORK_GATE_POLL);
        }
    }

    /// Closes the gate for good, for a process about to end: waits until no other thread is
    /// inside a kura call, at most `limit`; `false` when some call did not finish in time.
    /// Calls that come later wait at the gate until the process ends.
    pub fn close_for_exit(&self, limit: std::time::Duration) -> bool {
        self.closed.store(true, Ordering::SeqCst);
        let started = std::time::Instant::now();
        while self.calls.load(Ordering::SeqCst) != 0 {
            if started.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(FORK_GATE_POLL);
        }
        true
    }

    /// Opens the gate after `fork`, in the parent or in the child. The child has only the
    /// forking thread: its count is that thread's own (zero unless it forked inside a call).
    fn open(&self, in_child: bool) {
        if in_child {
            self.calls.store(usize::from(busy()), Ordering::SeqCst);
        }
        self.closed.store(false, Ordering::SeqCst);
    }
}

/// This thread running kura code: [`Busy`], and through the [`ForkGate`] unless it was
/// inside kura code already (an outer call holds the gate for it).
pub struct KuraCall<'a> {
    _gate: Option<GateGuard<'a>>,
    _busy: Busy,
}

impl State {
    /// Marks this thread as running kura code until the result drops (see [`KuraCall`]).
    pub fn enter_call(&self) -> KuraCall<'_> {
        let busy = Busy::enter();
        KuraCall { _gate: (!busy.was).then(|| self.fork_gate.enter()), _busy: busy }
    }
}

/// A thread's entry through the [`ForkGate`].
pub struct GateGuard<'a> {
    gate: &'a ForkGate,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        self.gate.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for KuraCall<'_> {
    /// The end of a thread's outermost kura call: when a signal's default action is ending
    /// the process (it came during a kura call, and the write-back service ends the process
    /// once the calls are done, see [`crate::signals`]), the thread goes no further, as no
    /// thread runs on in a process the kernel ends.
    fn drop(&mut self) {
        // The gate first: the service waits for the calls in progress to finish.
        if self._gate.take().is_some() {
            crate::signals::stop_if_ending();
        }
    }
}

#[derive(Default)]
struct FsSlot {
    fs: Option<Arc<Fs>>,
    failed_at: Option<std::time::Instant>,
    error: Option<FsError>,
}

static STATE: OnceLock<State> = OnceLock::new();

thread_local! {
    /// Set while this thread runs kura code: every hook then goes straight to the kernel.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// The state, once the constructor made it.
pub fn get() -> Option<&'static State> {
    STATE.get()
}

/// Whether this thread is inside kura code already.
pub fn busy() -> bool {
    BUSY.with(Cell::get)
}

/// Marks this thread as running kura code until dropped.
pub struct Busy {
    /// This thread was in kura code already (a nested entry).
    was: bool,
}

impl Busy {
    pub fn enter() -> Self {
        Self { was: BUSY.with(|b| b.replace(true)) }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.with(|b| b.set(self.was));
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn env_u64(name: &str) -> Option<u64> {
    env(name).and_then(|v| v.parse().ok())
}

fn normalise_mount(mount: &str) -> Vec<u8> {
    let mut m = mount.trim_end_matches('/').as_bytes().to_vec();
    if m.first() != Some(&b'/') {
        m.insert(0, b'/');
    }
    if m.len() <= 1 {
        // "/" as a mount would swallow the whole system: refuse it.
        return MOUNT_DEFAULT.as_bytes().to_vec();
    }
    m
}

/// Runs at load time.
pub fn init() {
    let _busy = Busy::enter();
    crate::text::hold_at_init();
    let mut fs_config = FsConfig::default();
    if let Some(name) = env("KURA_FS_NAME") {
        fs_config.name = name;
    }
    if let Some(mb) = env_u64("KURA_FS_CACHE_MB") {
        fs_config.cache_bytes_max = mb << 20;
    }
    if let Some(p) = env_u64("KURA_FS_DIRTY_PERCENT") {
        fs_config.dirty_percent = p as u32;
    }
    if let Some(c) = env_u64("KURA_FS_CHUNK_SIZE") {
        fs_config.chunk_size_bytes = c as u32;
    }
    if let Some(ms) = env_u64("KURA_FS_WRITEBACK_MS") {
        fs_config.writeback_interval_ms = ms;
    }
    // Next to the lock files of flock and fcntl (one per host, file system and pool).
    fs_config.shared_io_lock_path = Some(format!("{}/{:016x}.io", crate::fds::lock_dir(), crate::fds::fs_tag()).into());
    // One per user: names in directories another user may not read stay that user's.
    // SAFETY: geteuid cannot fail and touches no memory.
    let uid = unsafe { libc::geteuid() };
    fs_config.shared_names_path = Some(format!("{}/{:016x}.names.{uid}", crate::fds::lock_dir(), crate::fds::fs_tag()).into());
    // The lock files and those beside them (see `fds::host_file_name`), removed with their inode.
    fs_config.host_files_prefix = Some(format!("{}/{:016x}-", crate::fds::lock_dir(), crate::fds::fs_tag()).into());
    let pool_urls: Vec<String> = env("KURA_FS_POOL").map(|v| v.split(',').map(str::to_owned).collect()).unwrap_or_default();
    let embedded = pool_urls.is_empty() || pool_urls.iter().any(|u| u.starts_with("embedded:"));
    let sock_prefix = crate::sock::name_prefix(&fs_config.name, &pool_urls);
    let state = State {
        mount: normalise_mount(&env("KURA_FS_MOUNT").unwrap_or_else(|| MOUNT_DEFAULT.to_owned())),
        pool_urls,
        fs_config,
        fs: Mutex::new(FsSlot::default()),
        fs_open: OnceLock::new(),
        fds: FdTable::new(),
        cwd: RwLock::new(env(crate::exec::CWD_ENV).map(String::into_bytes)),
        sock_prefix,
        sock_names: crate::sock::SocketNames::default(),
        maps: crate::maps::SharedMaps::default(),
        dl_copies: crate::dl::HostCopies::default(),
        active: std::sync::atomic::AtomicBool::new(false),
        embedded,
        owner_pid: kura_fs::process_id(),
        fork_gate: ForkGate::new(),
        fork_serial: Mutex::new(()),
    };
    if STATE.set(state).is_err() {
        return;
    }
    let state = STATE.get().expect("just set");
    state.fds.recover_inherited();
    // SAFETY: pthread_atfork takes three plain function pointers; ours never unwind.
    unsafe { libc::pthread_atfork(Some(atfork_prepare), Some(atfork_parent), Some(atfork_child)) };
    match crate::patch::install() {
        Ok(()) => {
            state.active.store(true, std::sync::atomic::Ordering::Release);
            crate::signals::install();
            keep_libuv_off_io_uring();
        }
        Err(why) => crate::hooks::complain(&format!("libkura_fs: cannot patch libc ({why}); kura paths are unavailable")),
    }
}

/// libuv (Node.js) makes file system calls through an io_uring of its own when
/// `UV_USE_IO_URING` asks for it (the default in some releases): no hook sees those, and its
/// open of a kura path said ENOENT. Under the preload, libuv's thread pool calls libc instead
/// (the variable is set to 0 for the program and its children).
fn keep_libuv_off_io_uring() {
    if std::env::var_os("UV_USE_IO_URING").is_some_and(|v| v == "0") {
        return;
    }
    // SAFETY: NUL-terminated strings; the constructor runs before the program's main, so no
    // thread of the program reads the environment meanwhile.
    unsafe { libc::setenv(c"UV_USE_IO_URING".as_ptr(), c"0".as_ptr(), 1) };
}

impl State {
    /// The file system, opened on first use; `Err` (EIO) while the pool cannot be reached
    /// (tried again after a short back-off, so a pool that comes back is used again).
    #[inline]
    pub fn fs(&self) -> Result<&Arc<Fs>, FsError> {
        if self.engine_is_parents() {
            return Err(FsError::Io("the embedded engine belongs to the parent process (use a kura server pool to share the file system between processes)".into()));
        }
        match self.fs_open.get() {
            Some(fs) => Ok(fs),
            None => self.fs_slow(),
        }
    }

    #[cold]
    fn fs_slow(&self) -> Result<&Arc<Fs>, FsError> {
        let mut slot = self.fs.lock();
        if let Some(fs) = &slot.fs {
            return Ok(self.fs_open.get_or_init(|| Arc::clone(fs)));
        }
        if let (Some(at), Some(e)) = (slot.failed_at, &slot.error)
            && at.elapsed() < std::time::Duration::from_millis(REOPEN_BACKOFF_MS)
        {
            return Err(e.clone());
        }
        match self.open_fs() {
            Ok(fs) => {
                slot.fs = Some(Arc::clone(&fs));
                slot.error = None;
                Ok(self.fs_open.get_or_init(|| fs))
            }
            Err(e) => {
                // An embedded store is one process's: a program started by another preloaded
                // program of it finds the store in use.
                let hint = if self.embedded && e.to_string().contains("is in use") {
                    " (an embedded pool serves one process; to share the file system between processes, run without --pool embedded: kura fs run then starts a local server)"
                } else {
                    ""
                };
                crate::hooks::complain(&format!("libkura_fs: cannot open the file system: {e}{hint}"));
                slot.failed_at = Some(std::time::Instant::now());
                slot.error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// The file system if it is open (no attempt to open it) and this process may use it: not
    /// in a child of the process that embeds the engine (a child's `sync` wrote the parent's
    /// journal from the child, and the engine's locks are parking_lot's, see `kura_fs::sync`).
    pub fn fs_if_open(&self) -> Option<&Arc<Fs>> {
        if self.engine_is_parents() {
            return None;
        }
        self.fs_open.get()
    }

    /// This process is a child of the one that embeds the engine.
    fn engine_is_parents(&self) -> bool {
        self.embedded && kura_fs::process_id() != self.owner_pid
    }

    fn open_fs(&self) -> Result<Arc<Fs>, FsError> {
        let mut config = if self.pool_urls.is_empty() {
            kura_pool::PoolConfig::default()
        } else {
            kura_pool::PoolConfig::from_urls(&self.pool_urls).map_err(FsError::from)?
        };
        config.engine.mode = Some(kura_engine::format::Mode::Store);
        let pool = kura_pool::Pool::open(config).map_err(FsError::from)?;
        // SAFETY: geteuid/getegid cannot fail and touch no memory.
        let owner = unsafe { Owner { uid: libc::geteuid(), gid: libc::getegid() } };
        // Copies of records shared with this host's other processes of the user (one table
        // per user and pool).
        let kv = Arc::new(PoolKv::new(pool)?.with_shared_copies(kura_fs::copies::shared_copies_dir(std::env::var_os("KURA_FS_LOCK_DIR"))));
        Fs::open(kv, self.fs_config.clone(), owner)
    }
}

/// The locks `fork`'s prepare handler holds across `fork`, for the parent's and the child's
/// handler to drop (in field order). They are std's locks: a futex word each, with no owner
/// recorded and nothing outside the lock, so the child's copy of a guard unlocks the child's
/// copy of the word (see [`kura_fs::sync`]). `'static` as the state is.
struct ForkGuards {
    /// [`State::fork_serial`]'s guard: taken out first by the handlers after the fork and
    /// dropped last.
    serial: Option<MutexGuard<'static, ()>>,
    _fds: FdTableForkLock<'static>,
    _sock_names: SocketNamesForkLock<'static>,
    _cwd: RwLockWriteGuard<'static, Option<Vec<u8>>>,
    _writeback: Option<WritebackPause<'static>>,
}

thread_local! {
    /// What `fork`'s prepare handler holds, on the forking thread, until the parent's or the
    /// child's handler takes it (all three run on that thread; the child's copy of it).
    static FORK_GUARDS: RefCell<Option<ForkGuards>> = const { RefCell::new(None) };
}

/// Drops the locks the prepare handler of this fork holds but the fork serialisation, which
/// it returns for the end of the handler (`None` when the prepare handler held nothing).
fn release_fork_guards() -> Option<MutexGuard<'static, ()>> {
    let mut guards = FORK_GUARDS.try_with(|held| held.borrow_mut().take()).ok().flatten()?;
    guards.serial.take()
}

extern "C" fn atfork_prepare() {
    let _ = std::panic::catch_unwind(|| {
        let Some(state) = get() else { return };
        // Not from a signal handler that interrupted kura code (maybe a fork's handler).
        let serial = (!busy()).then(|| state.fork_serial.lock());
        // First: the calls in progress finish (taking whatever locks they need) and no new
        // one starts, so none of the locks below or inside the file system is held.
        state.fork_gate.close();
        let _busy = Busy::enter();
        let writeback = state.fs_if_open().map(|fs| {
            // The child starts with nothing dirty, so parent and child never write back the
            // same pages (shared descriptors share offsets, not caches).
            if let Err(e) = fs.writeback_all() {
                crate::hooks::complain(&format!("libkura_fs: write-back before fork failed: {e}"));
            }
            fs.pause_writeback()
        });
        // Parent and child share each description's lock file, made now if it has none.
        crate::hooks::lock_files_before_fork(state);
        let fds = state.fds.lock_for_fork();
        let sock_names = state.sock_names.lock_for_fork();
        let cwd = state.cwd.write();
        let guards = ForkGuards { serial, _fds: fds, _sock_names: sock_names, _cwd: cwd, _writeback: writeback };
        // A thread whose thread-locals are already destroyed (a fork from one's destructor)
        // cannot keep them: the guards drop here and that fork holds nothing.
        let _ = FORK_GUARDS.try_with(|held| *held.borrow_mut() = Some(guards));
    });
}

extern "C" fn atfork_parent() {
    let _ = std::panic::catch_unwind(|| {
        let Some(state) = get() else { return };
        let serial = release_fork_guards();
        if let Some(fs) = state.fs_if_open() {
            // The child shares this process's descriptors and may write through them.
            fs.invalidate_cached();
            // A child cannot use an embedded engine: nothing is shared with it then.
            if !state.embedded {
                fs.share_open_nodes();
            }
        }
        state.fork_gate.open(false);
        drop(serial);
    });
}

extern "C" fn atfork_child() {
    let _ = std::panic::catch_unwind(|| {
        let Some(state) = get() else { return };
        let serial = release_fork_guards();
        state.fork_gate.open(true);
        crate::signals::forget_service();
        state.maps.after_fork_in_child();
        // None with an embedded engine, which a child cannot use at all.
        if let Some(fs) = state.fs_if_open() {
            // Before fork returns: the parent may close its descriptors right away.
            let _busy = Busy::enter();
            fs.share_open_nodes();
            if let Err(e) = fs.register_inherited_opens() {
                crate::hooks::complain(&format!("libkura_fs: recording this child in its open files failed: {e}"));
            }
        }
        drop(serial);
    });
}
