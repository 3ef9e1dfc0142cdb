//! `kura fs`: the POSIX file system on the pool (paper 004).
//!
//! * `kura fs run [--mount /kura] [--pool URL...] -- COMMAND` runs COMMAND with
//!   `libkura_fs.so` preloaded: paths under the mount go to the pool.
//! * `kura fs mount MOUNTPOINT` serves the same namespace through FUSE.
//! * `kura fs stop` stops the local server `run`/`mount` started.
//!
//! With no `--pool`, the namespace lives in a local `kura serve` (store mode) that the first
//! `kura fs run`/`mount` on a data directory starts on a Unix socket in it (`server.sock`; a
//! free port of 127.0.0.1 when the directory's path is too long for a socket's) and later ones
//! reuse (`server.json` in the data directory): every process of a pipeline, and every
//! command, sees one namespace. The last `run` to finish stops a server it or another `run`
//! started, unless `--keep-server`. `--pool embedded` puts the engine inside the one
//! preloaded process instead (fastest, but only that process — no children — can use it).

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};

/// How long a new local server has to start accepting connections.
const SERVER_START_TIMEOUT_S: u64 = 30;
/// How long a stopping server has to exit after SIGTERM before SIGKILL.
const SERVER_STOP_GRACE_S: u64 = 10;
const POLL_INTERVAL_MS: u64 = 20;
/// How long `run --fuse` waits for its FUSE mount to appear, and for the FUSE server to exit
/// once unmounted.
const FUSE_MOUNT_TIMEOUT_S: u64 = 15;
/// How often `kura fs mount` looks whether it was unmounted, between waits for a signal.
const FUSE_SIGNAL_POLL_MS: u64 = 200;
/// The preload library's file name, next to the `kura` binary.
pub const PRELOAD_LIB: &str = "libkura_fs.so";

#[derive(Subcommand, Debug)]
pub enum FsCommand {
    /// Run COMMAND with the file system mounted (for it and its children) at --mount.
    Run(RunArgs),
    /// Expose the file system through FUSE at MOUNTPOINT (for static binaries and the rest of
    /// the system); runs until unmounted (fusermount3 -u MOUNTPOINT), or until SIGTERM or
    /// Ctrl-C, which write every file back and unmount.
    Mount(MountArgs),
    /// Stop the local server that `kura fs run`/`mount` started for --data-dir.
    Stop(PoolArgs),
}

/// Where the file system lives.
#[derive(Args, Debug, Clone)]
pub struct PoolArgs {
    /// Pool nodes (kura://host:port, memcached://host:port, kura:///socket for a server on a
    /// Unix socket), or `embedded` for an engine
    /// inside the preloaded process itself. Default: a local kura server for --data-dir.
    #[arg(long = "pool", value_name = "URL")]
    pub pool: Vec<String>,
    /// Directory of the local server: its store, its Unix socket (server.sock) and its log.
    #[arg(long, default_value = "kura-data/fs")]
    pub data_dir: PathBuf,
    /// Size of a new store (local server or embedded).
    #[arg(long, default_value = "4G")]
    pub store_size: String,
    /// The file system's name in the pool (several can share one pool).
    #[arg(long, default_value = "default")]
    pub name: String,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The mount prefix: paths under it are kura's.
    #[arg(long, default_value = "/kura")]
    pub mount: String,
    #[command(flatten)]
    pub pool: PoolArgs,
    /// Page cache memory limit per process, MiB.
    #[arg(long)]
    pub cache_mb: Option<u64>,
    /// Dirty share of the cache that starts write-back, percent (the paper's 20).
    #[arg(long)]
    pub dirty_percent: Option<u32>,
    /// Chunk size of a new file system, bytes.
    #[arg(long)]
    pub chunk_size: Option<u32>,
    /// Leave the local server running after COMMAND ends.
    #[arg(long)]
    pub keep_server: bool,
    /// Also mount the file system with FUSE at --mount, in a mount namespace of COMMAND's own
    /// (other processes do not see it), so that what the preload cannot intercept reaches it
    /// through the kernel: the dynamic loader opening shared libraries (a virtualenv's C
    /// extensions, LD_LIBRARY_PATH and RPATH in the mount), static binaries, programs that
    /// drop LD_PRELOAD. `auto`: when running as root with /dev/fuse, a pool that is not
    /// embedded, and --mount an existing directory; `on` makes the directory if missing.
    #[arg(long, value_enum, default_value_t = FuseMode::Auto)]
    pub fuse: FuseMode,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// Whether `kura fs run` mounts the file system with FUSE too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FuseMode {
    Auto,
    On,
    Off,
}

#[derive(Args, Debug)]
pub struct MountArgs {
    /// Where to mount (an existing directory).
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub pool: PoolArgs,
    /// Let other users access the mount (needs user_allow_other in /etc/fuse.conf unless root).
    #[arg(long)]
    pub allow_other: bool,
    /// How long the kernel may answer lookups and stat from its own cache before asking kura
    /// again (FUSE's entry and attribute timeouts; NFS's attribute cache), milliseconds, up to
    /// an hour. 0: every lookup and stat reads the pool, so changes made by other processes
    /// (through the preload, another mount, another host) are seen at once. More makes
    /// metadata-heavy programs (ls -l, find, builds) faster and lets them see others' changes
    /// that much later; changes made through this mount are seen at once either way.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub cache_timeout_ms: u64,
}

pub fn run(command: FsCommand) -> anyhow::Result<()> {
    match command {
        FsCommand::Run(args) => run_command(&args),
        FsCommand::Mount(args) => mount(&args),
        FsCommand::Stop(args) => stop_server(&args.data_dir),
    }
}

/// The pool URL(s) for the preload library, starting the local server when needed. The
/// returned lock (shared) marks this process as a user of the local server.
pub fn pool_urls(args: &PoolArgs) -> anyhow::Result<(Vec<String>, Option<File>)> {
    match args.pool.as_slice() {
        [] => {
            let (listen, lock) = ensure_server(&args.data_dir, &args.store_size)?;
            Ok((vec![listen.url()], Some(lock)))
        }
        [one] if one == "embedded" => {
            fs::create_dir_all(&args.data_dir)?;
            let path = args.data_dir.join("embedded.kura");
            Ok((vec![format!("embedded:{}?size={}", path.display(), args.store_size)], None))
        }
        urls => Ok((urls.to_vec(), None)),
    }
}

fn preload_lib() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the kura binary")?;
    let lib = exe.parent().map(|d| d.join(PRELOAD_LIB)).context("the kura binary has no directory")?;
    if !lib.is_file() {
        bail!("{} not found next to {} (build it: cargo build --release -p kura-preload)", PRELOAD_LIB, exe.display());
    }
    Ok(lib)
}

fn run_command(args: &RunArgs) -> anyhow::Result<()> {
    let lib = preload_lib()?;
    let (urls, lock) = pool_urls(&args.pool)?;
    let mut preload = lib.display().to_string();
    if let Ok(existing) = std::env::var("LD_PRELOAD")
        && !existing.is_empty()
    {
        preload = format!("{preload}:{existing}");
    }
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]).env("LD_PRELOAD", preload).env("KURA_FS_MOUNT", &args.mount).env("KURA_FS_POOL", urls.join(",")).env("KURA_FS_NAME", &args.pool.name).env_remove("KURA_FS_CWD");
    for (var, value) in [("KURA_FS_CACHE_MB", args.cache_mb), ("KURA_FS_DIRTY_PERCENT", args.dirty_percent.map(u64::from)), ("KURA_FS_CHUNK_SIZE", args.chunk_size.map(u64::from))] {
        if let Some(v) = value {
            cmd.env(var, v.to_string());
        }
    }
    let wanted = use_fuse(args)?;
    // Inside a `kura fs run --fuse` (its mount namespace), the mount is there already.
    let inherited = wanted && is_fuse_mount(Path::new(&args.mount)) && std::env::var_os("KURA_FS_KERNEL_MOUNT").is_some();
    let fuse = match wanted && !inherited {
        true => Some(FuseMount::start(args, &urls)?),
        false => None,
    };
    if fuse.is_some() || inherited {
        cmd.env("KURA_FS_KERNEL_MOUNT", "1");
    } else {
        cmd.env_remove("KURA_FS_KERNEL_MOUNT");
    }
    let status = cmd.status().with_context(|| format!("cannot run {}", args.command[0]));
    if let Some(fuse) = fuse {
        fuse.stop();
    }
    let status = status?;
    if let Some(lock) = lock
        && !args.keep_server
    {
        release_server(&args.pool.data_dir, lock);
    }
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    std::process::exit(code);
}

/// Whether `run` mounts with FUSE too (see [`RunArgs::fuse`]).
fn use_fuse(args: &RunArgs) -> anyhow::Result<bool> {
    let embedded = args.pool.pool.iter().any(|u| u == "embedded");
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let fuse_dev = Path::new("/dev/fuse").exists();
    match args.fuse {
        FuseMode::Off => Ok(false),
        FuseMode::Auto => Ok(root && fuse_dev && !embedded && kernel_is_dir(Path::new(&args.mount))),
        FuseMode::On => {
            if embedded {
                bail!("--fuse on needs a pool other processes can reach: an embedded engine lives in one process");
            }
            if !root || !fuse_dev {
                bail!("--fuse on needs root (for a mount namespace of the command's own) and /dev/fuse");
            }
            Ok(true)
        }
    }
}

/// The FUSE mount of `run --fuse`: a `kura fs mount` process serving the file system at the
/// mount prefix, inside a mount namespace this process made for itself and the command.
struct FuseMount {
    server: std::process::Child,
    mountpoint: PathBuf,
}

impl FuseMount {
    fn start(args: &RunArgs, urls: &[String]) -> anyhow::Result<Self> {
        let mountpoint = PathBuf::from(&args.mount);
        // SAFETY: unshare and mount with constant arguments; they change only this process's
        // (and its future children's) view of the mounts.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                bail!("cannot make a mount namespace for the FUSE mount: {}", std::io::Error::last_os_error());
            }
            // Mounts made here stay here; mounts made on the host still show here.
            if libc::mount(c"none".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_SLAVE, std::ptr::null()) != 0 {
                bail!("cannot make the mount namespace private: {}", std::io::Error::last_os_error());
            }
        }
        fs::create_dir_all(&mountpoint).with_context(|| format!("cannot create the mount point {}", mountpoint.display()))?;
        fs::create_dir_all(&args.pool.data_dir).with_context(|| format!("cannot create {}", args.pool.data_dir.display()))?;
        let mut pool: Vec<&str> = vec!["--name", &args.pool.name];
        for url in urls {
            pool.extend(["--pool", url]);
        }
        let server = spawn_fuse_mount(&mountpoint, &pool, &args.pool.data_dir.join("fuse.log"), Duration::from_secs(FUSE_MOUNT_TIMEOUT_S))?;
        Ok(Self { server, mountpoint })
    }

    /// Unmounts (lazily: a process the command left behind may still use it) and waits for
    /// the FUSE server to finish.
    fn stop(mut self) {
        unmount_lazily(&self.mountpoint);
        wait_or_kill(&mut self.server, Duration::from_secs(FUSE_MOUNT_TIMEOUT_S));
    }
}

/// Starts `kura fs mount MOUNTPOINT` with `options` (its output in `log_path`) and waits until
/// the kernel shows a FUSE file system there; the server is killed if it does not mount
/// within `timeout`.
pub(crate) fn spawn_fuse_mount(mountpoint: &Path, options: &[&str], log_path: &Path, timeout: Duration) -> anyhow::Result<std::process::Child> {
    let log = File::create(log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let mut server = Command::new(std::env::current_exe()?)
        .args(["fs", "mount"])
        .arg(mountpoint)
        .args(options)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("cannot start kura fs mount")?;
    let deadline = Instant::now() + timeout;
    while !is_fuse_mount(mountpoint) {
        let log = || fs::read_to_string(log_path).unwrap_or_default();
        if let Some(status) = server.try_wait()? {
            bail!("kura fs mount at {} exited ({status}) before mounting: {}", mountpoint.display(), log().trim());
        }
        if Instant::now() > deadline {
            let _ = server.kill();
            let _ = server.wait();
            bail!("kura fs mount did not mount {} within {} s: {}", mountpoint.display(), timeout.as_secs(), log().trim());
        }
        std::thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
    }
    Ok(server)
}

/// Whether a FUSE file system is mounted at `mountpoint` (in this mount namespace).
fn is_fuse_mount(mountpoint: &Path) -> bool {
    crate::bench_fs::statfs_type(mountpoint).is_ok_and(|t| t == crate::bench_fs::FUSE_SUPER_MAGIC)
}

/// Whether `path` is a directory as the kernel sees it: by system call, not libc, which a
/// preload (a `kura fs run` inside another) would answer for its own mount.
fn kernel_is_dir(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: a zeroed stat is a valid value; fstatat writes only into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a writable struct that lives across the call.
    let r = unsafe { libc::syscall(libc::SYS_newfstatat, libc::AT_FDCWD, c.as_ptr(), &mut st as *mut libc::stat, 0) };
    r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// Waits up to `timeout` for `child` to exit, then kills it.
pub(crate) fn wait_or_kill(child: &mut std::process::Child, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ServerInfo {
    pid: u32,
    /// Its TCP port on 127.0.0.1 (0 when it listens on `socket`).
    port: u16,
    /// Its Unix socket.
    #[serde(default)]
    socket: Option<PathBuf>,
    /// When it started (`crate::process::start_ticks`): with `pid`, names the server even
    /// after its pid is reused. Absent from records of older versions.
    #[serde(default)]
    start_ticks: Option<u64>,
}

/// Where the local server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Listen {
    /// A Unix socket: a loopback round trip without TCP's work (on the 2-core VM kura is
    /// measured on, creates, renames and unlinks under `kura fs run` took 21-32 % less time
    /// than over TCP, medians of 6 rounds).
    Unix(PathBuf),
    Tcp(u16),
}

/// The local server's socket in its data directory.
const SOCKET_FILE: &str = "server.sock";
/// Bytes of a Unix socket's path, its terminating NUL included, at most (`sun_path`).
const SOCKET_PATH_BYTES_MAX: usize = 108;

impl Listen {
    /// The pool URL of a server listening here.
    fn url(&self) -> String {
        match self {
            Listen::Unix(path) => format!("kura://{}", path.display()),
            Listen::Tcp(port) => format!("kura://127.0.0.1:{port}"),
        }
    }

    /// Whether a client can connect.
    fn accepting(&self, timeout: Duration) -> bool {
        match self {
            Listen::Unix(path) => std::os::unix::net::UnixStream::connect(path).is_ok(),
            Listen::Tcp(port) => std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], *port).into(), timeout).is_ok(),
        }
    }
}

impl ServerInfo {
    fn listen(&self) -> Listen {
        match &self.socket {
            Some(path) => Listen::Unix(path.clone()),
            None => Listen::Tcp(self.port),
        }
    }
}

fn flock(file: &File, op: i32) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(file.as_raw_fd(), op) == 0 }
}

fn lock_file(dir: &Path, name: &str) -> anyhow::Result<File> {
    let path = dir.join(name);
    File::options().create(true).truncate(false).read(true).write(true).open(&path).with_context(|| format!("cannot open {}", path.display()))
}

fn server_alive(dir: &Path) -> Option<ServerInfo> {
    let info = server_info(dir)?;
    let alive = match info.start_ticks {
        Some(ticks) => crate::process::start_ticks(info.pid) == Some(ticks),
        None => Path::new(&format!("/proc/{}", info.pid)).exists(),
    };
    (alive && info.listen().accepting(Duration::from_millis(500))).then_some(info)
}

/// Where the local server listens (started when none runs), and a shared lock marking a user.
fn ensure_server(dir: &Path, size: &str) -> anyhow::Result<(Listen, File)> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let users = lock_file(dir, "users.lock")?;
    if !flock(&users, libc::LOCK_SH) {
        bail!("cannot lock {}", dir.join("users.lock").display());
    }
    let start = lock_file(dir, "start.lock")?;
    if !flock(&start, libc::LOCK_EX) {
        bail!("cannot lock {}", dir.join("start.lock").display());
    }
    if let Some(info) = server_alive(dir) {
        return Ok((info.listen(), users));
    }
    let socket = std::path::absolute(dir.join(SOCKET_FILE))?;
    if socket.as_os_str().len() < SOCKET_PATH_BYTES_MAX {
        let listen = Listen::Unix(socket);
        start_server(dir, size, &listen)?;
        return Ok((listen, users));
    }
    // The port the last server of this directory had, when it is free: the pool's address
    // then stays the same from run to run, and with it what this host keeps per file system
    // and pool (lock files, the table of names, see `kura_fs::FsConfig::host_files_prefix`).
    // Taken meanwhile by another program, the server is started again on a new port.
    let previous = fs::read_to_string(dir.join(LAST_PORT_FILE)).ok().and_then(|text| text.trim().parse::<u16>().ok()).filter(|&port| port != 0 && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
    if let Some(port) = previous {
        match start_server(dir, size, &Listen::Tcp(port)) {
            Ok(()) => return Ok((Listen::Tcp(port), users)),
            Err(error) => tracing::debug!(port, %error, "the previous port did not serve; starting on a new one"),
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    start_server(dir, size, &Listen::Tcp(port))?;
    Ok((Listen::Tcp(port), users))
}

/// The port the local server of a data directory last listened on (kept after it stops).
const LAST_PORT_FILE: &str = "last-port";

/// The local server's record (`server.json`, removed when it stops).
fn server_info(dir: &Path) -> Option<ServerInfo> {
    let mut text = String::new();
    File::open(dir.join("server.json")).ok()?.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// Starts the local server listening at `listen` and records it, once it accepts connections.
fn start_server(dir: &Path, size: &str, listen: &Listen) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let log = File::create(dir.join("server.log"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve");
    match listen {
        // Every local user may connect, as to 127.0.0.1 (each process checks permissions on
        // the file system's records itself).
        Listen::Unix(path) => cmd.arg("--unix-socket").arg(path).args(["--unix-mask", "666"]),
        Listen::Tcp(port) => cmd.args(["--listen", "127.0.0.1", "--port", &port.to_string()]),
    };
    cmd.args(["--mode", "store", "--size", size, "--threads", "2", "--path"])
        .arg(dir.join("fs.kura"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .env_remove("LD_PRELOAD")
        .process_group(0);
    let mut child = cmd.spawn().context("cannot start kura serve")?;
    // Read while the child is unreaped, so that its pid cannot be another process's yet.
    let start_ticks = crate::process::start_ticks(child.id());
    let info = match listen {
        Listen::Unix(path) => ServerInfo { pid: child.id(), port: 0, socket: Some(path.clone()), start_ticks },
        Listen::Tcp(port) => ServerInfo { pid: child.id(), port: *port, socket: None, start_ticks },
    };
    let deadline = Instant::now() + Duration::from_secs(SERVER_START_TIMEOUT_S);
    while !listen.accepting(Duration::from_millis(200)) {
        if Instant::now() > deadline || !matches!(child.try_wait(), Ok(None)) {
            bail!("the local kura server did not start; see {}", dir.join("server.log").display());
        }
        std::thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
    }
    let mut f = File::create(dir.join("server.json"))?;
    f.write_all(serde_json::to_string(&info)?.as_bytes())?;
    if let Listen::Tcp(port) = listen {
        fs::write(dir.join(LAST_PORT_FILE), format!("{port}\n"))?;
    }
    // The server outlives this process (it is reaped by init): forget the child handle.
    std::mem::forget(child);
    Ok(())
}

/// This user is done: stop the local server when no other user holds the lock.
fn release_server(dir: &Path, users: File) {
    if flock(&users, libc::LOCK_EX | libc::LOCK_NB)
        && let Err(e) = stop_server(dir)
    {
        eprintln!("kura fs: {e:#}");
    }
}

fn stop_server(dir: &Path) -> anyhow::Result<()> {
    let Some(info) = server_alive(dir) else {
        let _ = fs::remove_file(dir.join("server.json"));
        return Ok(());
    };
    // Through a pidfd of the process with the recorded pid and start time: once the server
    // has exited, its pid may be any other process's or thread's.
    if crate::process::stop(info.pid, info.start_ticks, Duration::from_secs(SERVER_STOP_GRACE_S)) == crate::process::Stopped::Killed {
        eprintln!("kura fs: the local server did not stop within {SERVER_STOP_GRACE_S} s of SIGTERM and was killed");
    }
    let _ = fs::remove_file(dir.join("server.json"));
    Ok(())
}

/// Opens the file system in this process (for FUSE and the benchmark).
pub fn open_fs(urls: &[String], name: &str) -> anyhow::Result<Arc<kura_fs::Fs>> {
    let mut config = if urls.is_empty() { kura_pool::PoolConfig::default() } else { kura_pool::PoolConfig::from_urls(urls)? };
    config.engine.mode = Some(kura_engine::format::Mode::Store);
    let pool = kura_pool::Pool::open(config)?;
    // Copies of records shared with the preloaded processes of this host (kura_fs::copies).
    let kv = Arc::new(kura_fs::PoolKv::new(pool)?.with_shared_copies(kura_fs::copies::shared_copies_dir(std::env::var_os("KURA_FS_LOCK_DIR"))));
    // SAFETY: geteuid/getegid cannot fail.
    let owner = unsafe { kura_fs::Owner { uid: libc::geteuid(), gid: libc::getegid() } };
    let fs_config = kura_fs::FsConfig { name: name.to_owned(), ..kura_fs::FsConfig::default() };
    Ok(kura_fs::Fs::open(kv, fs_config, owner)?)
}

/// Serves the file system at the mount point until it is unmounted, or until SIGTERM or
/// SIGINT (`systemctl stop`, Ctrl-C): then every file's data still in this process goes to
/// the pool, the mount is detached (lazily: files still open in it keep working until they
/// are closed) and the server exits when the kernel ends the session.
fn mount(args: &MountArgs) -> anyhow::Result<()> {
    if args.cache_timeout_ms > kura_fs::fuse::CACHE_TIMEOUT_MAX.as_millis() as u64 {
        anyhow::bail!("--cache-timeout-ms {} is over the limit of {} (an hour)", args.cache_timeout_ms, kura_fs::fuse::CACHE_TIMEOUT_MAX.as_millis());
    }
    // Before any thread starts, so that every thread inherits the mask.
    let signals = kura_server::signals::TerminationSignals::block().context("blocking SIGTERM/SIGINT")?;
    let (urls, lock) = pool_urls(&args.pool)?;
    let fs = open_fs(&urls, &args.pool.name)?;
    eprintln!("kura fs: serving {} at {} (unmount with: fusermount3 -u {})", urls.join(","), args.mountpoint.display(), args.mountpoint.display());
    let serving = {
        let (fs, mountpoint, allow_other) = (fs.clone(), args.mountpoint.clone(), args.allow_other);
        let cache_timeout = Duration::from_millis(args.cache_timeout_ms);
        std::thread::Builder::new().name("fuse".into()).spawn(move || kura_fs::fuse::mount(fs, &mountpoint, allow_other, cache_timeout))?
    };
    while !serving.is_finished() {
        if let Some(signal) = signals.wait(Duration::from_millis(FUSE_SIGNAL_POLL_MS)) {
            tracing::info!(signal, "writing back and unmounting");
            if let Err(e) = fs.writeback_all() {
                eprintln!("kura fs: write-back at signal {signal} failed: {e}");
            }
            unmount_lazily(&args.mountpoint);
            break;
        }
    }
    let result = serving.join().map_err(|_| anyhow::anyhow!("the FUSE server thread panicked"))?;
    // What arrived after the signal, until the kernel ended the session (and, on an embedded
    // store, made durable for the next process that opens it).
    let written = fs.writeback_before_leaving();
    drop(lock);
    result.with_context(|| format!("FUSE mount at {}", args.mountpoint.display()))?;
    written.context("final write-back")
}

/// Detaches the FUSE mount at `mountpoint`: umount2(MNT_DETACH) as root, else fusermount3.
fn unmount_lazily(mountpoint: &Path) {
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes()) else { return };
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } == 0 {
        return;
    }
    let _ = Command::new("fusermount3").arg("-u").arg("-z").arg(mountpoint).stdin(Stdio::null()).status();
}
