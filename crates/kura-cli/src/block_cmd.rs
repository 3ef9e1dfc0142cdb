//! `kura volume …` (create, list, resize, delete volumes in a pool) and `kura block …` (serve
//! them as block devices: NBD, a FUSE file for loop devices, ublk). See `kura_block`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Arc;

use kura_block::fuse::{FuseConfig, FuseExport};
use kura_block::nbd::{NbdConfig, NbdServer, NbdTls};
use kura_block::ublk::{UblkConfig, UblkDevice};
use kura_block::{PoolHandle, Volume, Volumes, open_pool};
use kura_pool::PoolConfig;
use kura_server::signals::TerminationSignals;

use crate::size::ByteSize;

/// Which pool the volumes live in.
#[derive(Args, Clone, Debug, Default)]
pub struct PoolArgs {
    /// A pool node (repeat for more): kura://HOST:PORT, memcached://HOST:PORT, redis://HOST:PORT,
    /// redis+cluster://HOST:PORT,HOST:PORT, kura:///SOCKET or memcached:///SOCKET (a server on a
    /// Unix socket), or embedded:PATH[?size=1G]. Over TLS: kura+tls://, memcached+tls://,
    /// rediss://, rediss+cluster:// with ?ca=PEM (default: the system's CA bundle),
    /// &cert=PEM&key=PEM (a client certificate), &sni=NAME (the name the server's certificate
    /// must carry; default: HOST). Default: the embedded store kura-data/pool.kura (created in
    /// store mode, 1 GiB, when missing).
    #[arg(long = "pool", value_name = "URL")]
    pub pool: Vec<String>,
    /// A TOML file describing the pool (`nodes = [...]` and limits), instead of --pool.
    #[arg(long, value_name = "FILE", conflicts_with = "pool")]
    pub pool_config: Option<PathBuf>,
}

impl PoolArgs {
    pub fn config(&self) -> anyhow::Result<PoolConfig> {
        Ok(match &self.pool_config {
            Some(path) => PoolConfig::from_toml_file(path)?,
            None => PoolConfig::from_urls(&self.pool)?,
        })
    }

    pub fn open(&self) -> anyhow::Result<PoolHandle> {
        Ok(open_pool(self.config()?)?)
    }
}

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Create a volume: thin, all zeros; blocks take space in the pool only once written.
    Create {
        /// Volume name: 1-64 of A-Z a-z 0-9 . _ - (it becomes the NBD export and FUSE file name).
        name: String,
        /// Size (a multiple of 4096 bytes), e.g. 10G.
        #[arg(long)]
        size: ByteSize,
        #[command(flatten)]
        pool: PoolArgs,
    },
    /// List the pool's volumes.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        pool: PoolArgs,
    },
    /// Grow or shrink a volume (shrinking deletes the blocks past the new end).
    Resize {
        name: String,
        /// New size (a multiple of 4096 bytes).
        #[arg(long)]
        size: ByteSize,
        #[command(flatten)]
        pool: PoolArgs,
    },
    /// Delete a volume and all its blocks (finishes an interrupted delete too).
    Delete {
        name: String,
        #[command(flatten)]
        pool: PoolArgs,
    },
}

#[derive(Subcommand)]
pub enum BlockCommand {
    /// Serve volumes over NBD (one export per volume, named like it) until SIGTERM/Ctrl-C.
    Nbd(NbdArgs),
    /// Mount a FUSE file system where each volume is one file, for `losetup` (until
    /// SIGTERM/Ctrl-C; detach loop devices first).
    Fuse(FuseArgs),
    /// Expose one volume as /dev/ublkbN through the kernel's ublk driver (needs
    /// /dev/ublk-control, Linux 6.0+), one queue per thread, until SIGTERM/Ctrl-C.
    Ublk(UblkArgs),
    /// Delete ublk device N (/dev/ublkbN) that a killed `kura block ublk` left waiting for
    /// `--recover`, when it will not be recovered: the requests waiting in it fail with I/O
    /// errors. A live device is refused (SIGTERM its process instead).
    UblkDelete {
        /// The device number.
        id: i32,
    },
}

#[derive(Args, Debug)]
pub struct UblkArgs {
    /// The volume to expose.
    #[arg(long = "volume", value_name = "NAME")]
    volume: String,
    /// Hardware queues, each with its own thread and pool connections; default: one per CPU.
    #[arg(long)]
    queues: Option<u16>,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = kura_block::ublk::QUEUE_DEPTH_DEFAULT)]
    depth: u16,
    /// Largest request (and each request buffer), a multiple of 4096.
    #[arg(long, default_value = "512K")]
    max_request: ByteSize,
    /// Ask for this device number (/dev/ublkbN); default: the driver picks one.
    #[arg(long, conflicts_with = "recover")]
    id: Option<i32>,
    /// Take over device N (/dev/ublkbN), left waiting by a `kura block ublk` that was killed
    /// or crashed: the file systems on it never saw an error, requests it had been given are
    /// given again. Give the same --volume and --pool; the device keeps its own --queues,
    /// --depth and --max-request.
    #[arg(long, value_name = "N")]
    recover: Option<i32>,
    /// Delete the device when this process dies, as if stopped, instead of keeping it for
    /// `--recover`. (On the embedded engine it always is: a completed write may still be in
    /// this process's write buffer.)
    #[arg(long)]
    no_recovery: bool,
    #[command(flatten)]
    pool: PoolArgs,
}

#[derive(Args, Debug)]
pub struct FuseArgs {
    /// An empty directory to mount on.
    mountpoint: PathBuf,
    /// Export only these volumes (repeat); default: every volume of the pool.
    #[arg(long = "volume", value_name = "NAME")]
    volumes: Vec<String>,
    /// Read-only files.
    #[arg(long)]
    read_only: bool,
    /// FUSE threads. They share the --queues; with --queues 0 each serves one request at a
    /// time.
    #[arg(long, default_value_t = kura_block::fuse::THREADS_DEFAULT)]
    threads: usize,
    /// Pipelined pool queues the FUSE threads share: each sends the requests handed to it
    /// together (over one connection per node on kura servers, memcached or Redis; through
    /// one io_uring ring on the embedded engine) and answers each as it completes; 0: every
    /// FUSE thread uses its own pool context and waits for its own request.
    #[arg(long, default_value_t = kura_block::fuse::QUEUES_DEFAULT)]
    queues: usize,
    /// Let users other than the one mounting open the files (needs user_allow_other in
    /// /etc/fuse.conf when not root).
    #[arg(long)]
    allow_other: bool,
    #[command(flatten)]
    pool: PoolArgs,
}

#[derive(Args, Debug)]
pub struct NbdArgs {
    /// TCP address to listen on; "none" for Unix sockets only.
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: String,
    /// Also (or only) listen on this Unix socket.
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Export only these volumes (repeat); default: every volume of the pool.
    #[arg(long = "volume", value_name = "NAME")]
    volumes: Vec<String>,
    /// Refuse writes (NBD_FLAG_READ_ONLY).
    #[arg(long)]
    read_only: bool,
    /// Client connections at once, at most.
    #[arg(long, default_value_t = kura_block::nbd::server::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// After the last reply of a burst, watch the client's socket this many microseconds
    /// without sleeping before waiting for it (0: sleep at once). Halves queue-depth-1 write
    /// latency (no wake-up per request) for a core kept busy meanwhile; on a virtual machine
    /// whose host is shared it can slow disk reads (measured in the README)
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(kura_block::nbd::server::BUSY_POLL_US_MAX)))]
    busy_poll_us: u32,
    /// Largest read or write a client may send (advertised as the maximum block size).
    #[arg(long, default_value = "32M")]
    max_request: ByteSize,
    /// Memory for requests in flight and replies not yet sent, over all connections; past it
    /// connections take no new reads or writes until some finish (at least --max-request)
    #[arg(long, default_value = "1G")]
    memory_max: ByteSize,
    /// Print the TCP address actually bound (useful with port 0) on stdout once listening.
    #[arg(long)]
    print_address: bool,
    /// TLS (NBD_OPT_STARTTLS): "require" refuses every option but STARTTLS and ABORT until the
    /// client upgrades (qemu-nbd --tls-creds, nbdkit --tls=require); "on" offers TLS and serves
    /// plain-text clients too; "off" refuses STARTTLS. Default: require when --tls-cert is
    /// given, off otherwise
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsMode>,
    /// The server's certificate chain, PEM (server certificate first); its names (SAN) must
    /// match the host clients connect to. Needs --tls-key
    #[arg(long, value_name = "PEM_FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert, PEM (PKCS#8, PKCS#1 RSA or SEC1 EC)
    #[arg(long, value_name = "PEM_FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by one of the CA certificates in this PEM file
    /// (clients without one fail the TLS handshake). Needs --tls-cert
    #[arg(long, value_name = "PEM_FILE", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    #[command(flatten)]
    pool: PoolArgs,
}

/// `--tls`: whether clients may, must or cannot use TLS.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// STARTTLS is refused (NBD_REP_ERR_POLICY).
    Off,
    /// TLS is offered; clients that do not ask for it are served in plain text.
    On,
    /// Clients must STARTTLS before any other option (NBD_REP_ERR_TLS_REQD otherwise).
    Require,
}

impl NbdArgs {
    /// The TLS setup the flags ask for, certificate and key loaded and checked now (a bad
    /// file is an error at start, not at the first client).
    fn tls(&self) -> anyhow::Result<Option<NbdTls>> {
        let mode = self.tls.unwrap_or(if self.tls_cert.is_some() { TlsMode::Require } else { TlsMode::Off });
        match (mode, &self.tls_cert, &self.tls_key) {
            (TlsMode::Off, None, _) => Ok(None),
            (TlsMode::Off, Some(_), _) => bail!("--tls off contradicts --tls-cert: drop one of them"),
            (_, Some(cert), Some(key)) => Ok(Some(NbdTls::from_pem_files(cert, key, self.tls_ca.as_deref(), mode == TlsMode::Require)?)),
            (_, _, _) => bail!("--tls {} needs a certificate and its key: --tls-cert FILE --tls-key FILE", if mode == TlsMode::On { "on" } else { "require" }),
        }
    }
}

fn progress_bar(what: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} blocks ({eta})").expect("a valid template"));
    bar.set_message(what.to_owned());
    bar
}

pub fn run_volume(command: VolumeCommand) -> anyhow::Result<()> {
    match command {
        VolumeCommand::Create { name, size, pool } => {
            let handle = pool.open()?;
            let mut ctx = handle.pool.context()?;
            let meta = Volumes::new(&mut ctx).create(&name, size.0)?;
            println!("created volume {} ({} bytes, id {})", meta.name, meta.size_bytes, meta.id);
        }
        VolumeCommand::List { json, pool } => {
            let handle = pool.open()?;
            let mut ctx = handle.pool.context()?;
            let volumes = Volumes::new(&mut ctx).list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&volumes)?);
            } else {
                println!("{:<24} {:>16} {:>6} {:>10} {:>12}", "NAME", "SIZE_BYTES", "ID", "STATE", "CREATED_UNIX_S");
                for v in volumes {
                    println!("{:<24} {:>16} {:>6} {:>10} {:>12}", v.name, v.size_bytes, v.id, format!("{:?}", v.state).to_lowercase(), v.created_unix_s);
                }
            }
        }
        VolumeCommand::Resize { name, size, pool } => {
            let handle = pool.open()?;
            let mut ctx = handle.pool.context()?;
            let bar = progress_bar("deleting blocks past the end");
            let meta = Volumes::new(&mut ctx).resize(&name, size.0, &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            })?;
            bar.finish_and_clear();
            println!("volume {} is now {} bytes", meta.name, meta.size_bytes);
        }
        VolumeCommand::Delete { name, pool } => {
            let handle = pool.open()?;
            let mut ctx = handle.pool.context()?;
            let bar = progress_bar("deleting blocks");
            Volumes::new(&mut ctx).delete(&name, &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            })?;
            bar.finish_and_clear();
            println!("deleted volume {name}");
        }
    }
    Ok(())
}

pub fn run_block(command: BlockCommand) -> anyhow::Result<()> {
    match command {
        BlockCommand::Nbd(args) => run_nbd(args),
        BlockCommand::Fuse(args) => run_fuse(args),
        BlockCommand::Ublk(args) => run_ublk(args),
        BlockCommand::UblkDelete { id } => {
            if !kura_block::ublk::available() {
                bail!("/dev/ublk-control does not exist: this kernel has no ublk driver");
            }
            kura_block::ublk::delete_waiting_device(id)?;
            eprintln!("ublk device {id} deleted");
            Ok(())
        }
    }
}

/// Blocks SIGTERM/SIGINT (before any thread starts, so every thread inherits the mask) and
/// waits for one.
fn wait_for_termination(signals: &TerminationSignals) {
    loop {
        if let Some(signal) = signals.wait(Duration::from_secs(1)) {
            tracing::info!(signal, "stopping");
            return;
        }
    }
}

/// Makes every acknowledged write durable before the process exits.
fn final_flush(handle: &PoolHandle) {
    match handle.pool.context().and_then(|mut ctx| ctx.flush()) {
        Ok(()) => {}
        Err(e) => tracing::error!(error = %e, "final flush failed"),
    }
}

/// The named volumes (every active one when none is named), opened for serving.
fn open_volumes(handle: &PoolHandle, names: &[String]) -> anyhow::Result<Vec<Arc<Volume>>> {
    let mut ctx = handle.pool.context()?;
    let mut volumes = Volumes::new(&mut ctx);
    let names: Vec<String> = if names.is_empty() {
        volumes.list()?.into_iter().filter(|m| m.state == kura_block::volume::VolumeState::Active).map(|m| m.name).collect()
    } else {
        names.to_vec()
    };
    names.iter().map(|name| Ok(Volume::new(volumes.open(name).with_context(|| format!("volume {name}"))?))).collect()
}

fn run_fuse(args: FuseArgs) -> anyhow::Result<()> {
    let signals = TerminationSignals::block().context("blocking SIGTERM/SIGINT")?;
    let handle = args.pool.open()?;
    let volumes = open_volumes(&handle, &args.volumes)?;
    let names: Vec<String> = volumes.iter().map(|v| v.meta.name.clone()).collect();
    let config = FuseConfig { read_only: args.read_only, threads: args.threads, queues: args.queues, allow_other: args.allow_other, ..FuseConfig::default() };
    let export = FuseExport::mount(handle.pool.clone(), volumes, &args.mountpoint, config).with_context(|| format!("mounting on {}", args.mountpoint.display()))?;
    println!("mounted {} volume(s) at {}: {}", names.len(), args.mountpoint.display(), names.join(" "));
    wait_for_termination(&signals);
    if let Err(e) = export.unmount() {
        tracing::warn!(error = %e, "unmount failed (a loop device still attached?); unmounting lazily");
        let _ = std::process::Command::new("fusermount3").arg("-uz").arg(&args.mountpoint).status();
    }
    final_flush(&handle);
    Ok(())
}

fn run_ublk(args: UblkArgs) -> anyhow::Result<()> {
    if !kura_block::ublk::available() {
        bail!("/dev/ublk-control does not exist: this kernel has no ublk driver (modprobe ublk_drv; Linux 6.0+), use `kura block nbd` or `kura block fuse`");
    }
    let signals = TerminationSignals::block().context("blocking SIGTERM/SIGINT")?;
    let pool_config = args.pool.config()?;
    // A server keeps what a request completed when this process dies; the embedded engine's
    // write buffer dies with it.
    let embedded = pool_config.nodes.iter().any(|n| n.backend == kura_pool::Backend::Embedded);
    let handle = open_pool(pool_config)?;
    let volume = open_volumes(&handle, std::slice::from_ref(&args.volume))?.pop().expect("one volume");
    let mut config = UblkConfig {
        depth: args.depth,
        io_buf_bytes: u32::try_from(args.max_request.0).context("--max-request is too large")?,
        id: args.recover.or(args.id).unwrap_or(-1),
        recoverable: !embedded && !args.no_recovery,
        recover: args.recover.is_some(),
        ..UblkConfig::default()
    };
    if let Some(queues) = args.queues {
        config.queues = queues;
    }
    if let Some(id) = args.recover {
        if embedded {
            bail!("--recover: the embedded engine's devices are not kept when their process dies (a completed write may have been in its write buffer); use a pool of servers");
        }
        let device_bytes = kura_block::ublk::device_size_bytes(id).with_context(|| format!("--recover {id}: no such ublk device"))?;
        if device_bytes != volume.meta.size_bytes {
            bail!("--recover {id}: the device's size is {device_bytes} bytes, volume {} is {} bytes: give the --volume it served", volume.meta.name, volume.meta.size_bytes);
        }
    }
    let device = UblkDevice::add(config)?;
    let stopper = device.stopper();
    // Every SIGTERM/SIGINT asks the driver to stop the device: one that arrives while the
    // device is still starting finds nothing to stop yet, and the next one does.
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        loop {
            wait_for_termination(&signals);
            stopper.stop();
        }
    })?;
    let name = volume.meta.name.clone();
    device.run(handle.pool.clone(), volume, move |path| {
        tracing::info!(volume = name, path, "ublk: device started");
        println!("{path}");
    })?;
    final_flush(&handle);
    Ok(())
}

fn run_nbd(args: NbdArgs) -> anyhow::Result<()> {
    let signals = TerminationSignals::block().context("blocking SIGTERM/SIGINT")?;
    let tcp: Option<SocketAddr> = match args.listen.as_str() {
        "none" => None,
        addr => Some(addr.parse().with_context(|| format!("--listen {addr:?}: expected HOST:PORT or none"))?),
    };
    if tcp.is_none() && args.unix.is_none() {
        bail!("nothing to listen on: give --listen HOST:PORT or --unix PATH");
    }
    let max_block_bytes = u32::try_from(args.max_request.0).context("--max-request is too large")?;
    let tls = args.tls().context("setting up TLS")?;
    let handle = args.pool.open()?;
    {
        let mut ctx = handle.pool.context()?;
        let mut volumes = Volumes::new(&mut ctx);
        for name in &args.volumes {
            volumes.open(name).with_context(|| format!("--volume {name}"))?;
        }
    }
    let config = NbdConfig {
        tcp,
        unix: args.unix.clone(),
        volumes: (!args.volumes.is_empty()).then(|| args.volumes.clone()),
        read_only: args.read_only,
        connections_max: args.connections_max,
        max_block_bytes,
        busy_poll_us: args.busy_poll_us,
        memory_max_bytes: args.memory_max.0,
        tls,
        ..NbdConfig::default()
    };
    let server = NbdServer::start(handle.pool.clone(), config).context("starting the NBD server")?;
    if let Some(addr) = server.tcp_addr() {
        tracing::info!(%addr, "nbd: listening");
        if args.print_address {
            println!("{addr}");
        }
    }
    if let Some(path) = server.unix_path() {
        tracing::info!(path = %path.display(), "nbd: listening");
    }
    wait_for_termination(&signals);
    server.stop();
    final_flush(&handle);
    Ok(())
}
