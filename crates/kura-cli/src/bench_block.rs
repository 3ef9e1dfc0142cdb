//! `kura bench block`: kura's block frontends (paper 000, Fig. 7–9) driven by fio, with the
//! anchors measured in the same run.
//!
//! Per backend (the embedded engine; a `kura serve` started here on a free port) and per
//! frontend, one volume of `--size`, written whole before anything is read (a block never
//! written reads as zeros without any I/O, which would flatter the reads):
//!
//! - `nbd`: `kura block nbd` on a Unix socket, fio's `nbd` engine (libnbd, one connection);
//! - `fuse_loop`: `kura block fuse` → `losetup --direct-io=on` → fio (io_uring, O_DIRECT) on
//!   /dev/loopN; then the same jobs on a file in xfs and in ext4 made on that loop device;
//! - `ublk`: `kura block ublk` → fio on /dev/ublkbN, only where /dev/ublk-control exists.
//!
//! Six jobs each, reads first: 4 KiB random reads at `--depth` (32), 128 KiB sequential reads
//! at `--depth`, 4 KiB random reads at queue depth 1 (mean completion latency), then the same
//! three as writes, each ending with an fsync. With `--rounds` above 1 every figure is the
//! median of its rounds.
//!
//! Anchors, per backend, measured just before each round of the nbd jobs so that each pair
//! shares this shared machine's luck: the pool client alone (one context, `--depth` and 1 in
//! flight, measured as `kura bench pool` measures gets) reading random blocks of the nbd
//! volume itself, on the same store or server; and qemu-nbd `--cache=none` serving a raw file
//! in `--dir` to the same fio `nbd` jobs. The goals' ratios are medians of the paired rounds.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kura_bench::fio::{self, FioJob, FioResult, FioRw};
use kura_bench::hist::LatencyHist;
use kura_bench::host::{free_tcp_port, median, which};
use kura_block::Volumes;
use kura_pool::{Outcome, Pool, block_key};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};

use crate::size::ByteSize;

#[derive(Args, Clone, Debug)]
pub struct BlockBenchArgs {
    /// Size of each benchmark volume and of qemu-nbd's raw file (a multiple of 128K; xfs
    /// needs at least 320M). Every block is written before the read jobs. --dir needs about
    /// 4 times this plus 512M free (stores are allocated whole).
    #[arg(long, default_value = "384M")]
    size: ByteSize,
    /// Seconds of each fio job and of each pool anchor phase (fractions allowed, e.g. 0.5).
    #[arg(long, default_value_t = 2.0)]
    runtime_s: f64,
    /// Pool backends, of embedded (the engine in the frontend's process, a store file in
    /// --dir), kura (`kura serve` started here on a free port, its store in --dir) and
    /// kura_unix (the same server on a Unix socket in --dir, `kura serve -s`, as `kura fs run`
    /// starts its local one).
    #[arg(long, value_delimiter = ',', default_value = "embedded,kura")]
    backends: Vec<String>,
    /// Frontends, of nbd, fuse_loop and ublk (ublk is reported absent, with the reason,
    /// where /dev/ublk-control does not exist).
    #[arg(long, value_delimiter = ',', default_value = "nbd,fuse_loop,ublk")]
    frontends: Vec<String>,
    /// File systems made on fuse_loop's loop device, of xfs and ext4, each measured with fio
    /// on a file of half the volume ("" for the raw device only).
    #[arg(long, value_delimiter = ',', default_value = "xfs,ext4")]
    filesystems: Vec<String>,
    /// Requests in flight of the random 4 KiB and sequential 128 KiB jobs and of the pool
    /// anchor (fio iodepth; the pool context's depth).
    #[arg(long, default_value_t = 32)]
    depth: u32,
    /// Rounds of every job (after one setup and prefill); each figure is the median.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Worker threads of the kura server (`kura serve -t`).
    #[arg(long, default_value_t = 1)]
    server_threads: usize,
    /// RAM cache of the kura server in MiB (`kura serve -m`).
    #[arg(long, default_value_t = 64)]
    server_memory_mb: u64,
    /// `kura block nbd --busy-poll-us` of the NBD frontend (0: connections sleep as soon as
    /// their replies are out).
    #[arg(long, default_value_t = 0)]
    nbd_busy_poll_us: u32,
    /// Skip the qemu-nbd anchor.
    #[arg(long)]
    skip_qemu: bool,
    /// Directory on the disk under test: stores, qemu-nbd's raw file, sockets, mount points
    /// (not tmpfs: O_DIRECT and --cache=none need a disk file system).
    #[arg(long, default_value = "kura-data/bench-block")]
    dir: PathBuf,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw random-read IOPS of every frontend and anchor as a bar chart (PNG) here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

const BACKENDS: [&str; 3] = ["embedded", "kura", "kura_unix"];
const FRONTENDS: [&str; 3] = ["nbd", "fuse_loop", "ublk"];
const FILESYSTEMS: [&str; 2] = ["xfs", "ext4"];
const BLOCK_SIZE_BYTES: u64 = 4096;
const SEQ_BLOCK_BYTES: u64 = 128 << 10;
const MIB: f64 = 1024.0 * 1024.0;
/// mkfs.xfs refuses smaller file systems (300 MiB, plus room for the log).
const XFS_SIZE_BYTES_MIN: u64 = 320 << 20;
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Store size in volumes (the engine allocates it all at once, so no more than needed): the
/// two volumes written (nbd, fuse_loop) and room for what overwrites leave behind.
const STORE_VOLUMES_FACTOR: u64 = 3;
const STORE_SLACK_BYTES: u64 = 512 << 20;
const VOLUME_NAME: &str = "bench";
/// Volumes: one per frontend.
fn volume_name(frontend: &str) -> String {
    format!("{VOLUME_NAME}-{}", frontend.replace('_', "-"))
}

/// NBD random 4 KiB reads over two connections, each half of `--depth` deep.
const NBD_TWO_CONNECTIONS_FIELD: &str = "randread_4k_iops_2conn";
/// The six figures of one target, in the order the jobs run: reads first, right after the
/// anchors, then writes (each ends with an fsync, so that the next round's reads do not
/// compete with the backend writing out the last round's data).
const FIELDS: [&str; 6] = ["randread_4k_iops", "seqread_128k_mib_s", "qd1_read_lat_us", "randwrite_4k_iops", "seqwrite_128k_mib_s", "qd1_write_lat_us"];

pub fn run(args: &BlockBenchArgs) -> anyhow::Result<()> {
    check_args(args)?;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = std::fs::canonicalize(&args.dir)?;
    let progress = Progress::new(count_steps(args));
    let mut backends = Map::new();
    for backend in BACKENDS.iter().filter(|b| args.backends.iter().any(|a| a == *b)) {
        progress.note(&format!("backend {backend}"));
        let mut report = measure_backend(backend, args, &dir, &progress)?;
        report["goals"] = goals(&report);
        backends.insert(backend.to_string(), report);
    }
    progress.finish();
    let mut report = json!({
        "bench": "block",
        "config": {
            "size_bytes": args.size.0, "runtime_s": args.runtime_s, "depth": args.depth, "rounds": args.rounds,
            "server_threads": args.server_threads, "server_memory_mb": args.server_memory_mb, "nbd_busy_poll_us": args.nbd_busy_poll_us,
            "dir": dir.display().to_string(), "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "load_average_1m_at_end": load_average(),
        },
        "backends": Value::Object(backends),
        "notes": "randread/randwrite: 4 KiB at --depth; seqread/seqwrite: 128 KiB at --depth; qd1_*_lat_us: mean fio completion \
                  latency of 4 KiB random I/O at queue depth 1. nbd: fio's nbd engine over a Unix socket, one connection. \
                  fuse_loop: io_uring O_DIRECT on /dev/loopN (losetup --direct-io=on) over `kura block fuse`; xfs/ext4: the \
                  same jobs on a file of half the volume. Anchors, per backend, measured round by round just before each \
                  round of the nbd jobs: pool_get_4k_* is the pool client alone (one context, --depth and 1 in flight, as \
                  kura bench pool measures gets) reading random blocks of the nbd volume on the same store or server (an \
                  embedded store serves one process: kura block nbd is stopped meanwhile and restarted); qemu_nbd_* is \
                  qemu-nbd --cache=none on a raw file in --dir with the same fio nbd jobs. Goals use the median of each \
                  round's paired ratio. Reads run before writes in each round; write jobs end with an fsync. Every volume and file is written whole first.",
    });
    if let Some(path) = &args.plot {
        report["plot"] = match plot(path, &report) {
            Ok(()) => json!(path.display().to_string()),
            Err(e) => {
                eprintln!("bench block: no plot: {e:#}");
                Value::Null
            }
        };
    }
    kura_bench::json::emit(&report, args.json.as_deref())?;
    Ok(())
}

fn check_args(args: &BlockBenchArgs) -> anyhow::Result<()> {
    if args.size.0 == 0 || !args.size.0.is_multiple_of(SEQ_BLOCK_BYTES) {
        bail!("--size must be a positive multiple of 128K");
    }
    if args.runtime_s.is_nan() || args.runtime_s <= 0.0 || args.depth == 0 || args.rounds == 0 {
        bail!("--runtime-s, --depth and --rounds must be above 0");
    }
    let check = |what: &str, given: &[String], known: &[&str]| -> anyhow::Result<()> {
        match given.iter().find(|g| !g.is_empty() && !known.contains(&g.as_str())) {
            Some(g) => bail!("unknown {what} {g:?}; use {}", known.join(", ")),
            None => Ok(()),
        }
    };
    check("backend", &args.backends, &BACKENDS)?;
    check("frontend", &args.frontends, &FRONTENDS)?;
    check("file system", &args.filesystems, &FILESYSTEMS)
}

fn wants(list: &[String], name: &str) -> bool {
    list.iter().any(|x| x == name)
}

/// fio jobs and anchor phases of the whole run, for the progress bar.
fn count_steps(args: &BlockBenchArgs) -> u64 {
    let rounds = u64::from(args.rounds);
    let per_target = 1 + FIELDS.len() as u64 * rounds;
    // The pool anchor's two phases a round; qemu-nbd's prefill and two jobs a round.
    let mut per_backend = 2 * rounds + if args.skip_qemu { 0 } else { 1 + 2 * rounds };
    for frontend in args.frontends.iter().filter(|f| FRONTENDS.contains(&f.as_str())) {
        per_backend += per_target;
        if frontend == "fuse_loop" {
            per_backend += per_target * args.filesystems.iter().filter(|f| !f.is_empty()).count() as u64;
        }
    }
    BACKENDS.iter().filter(|b| wants(&args.backends, b)).count() as u64 * per_backend
}

struct Progress(ProgressBar);

impl Progress {
    fn new(steps: u64) -> Self {
        let bar = ProgressBar::new(steps);
        bar.set_style(ProgressStyle::with_template("bench block {bar:30} {pos}/{len} ({elapsed}) {msg}").expect("a valid template"));
        Self(bar)
    }

    fn step(&self, what: &str) {
        self.0.set_message(what.to_owned());
        self.0.inc(1);
    }

    fn note(&self, what: &str) {
        self.0.set_message(what.to_owned());
    }

    fn warn(&self, what: &str) {
        self.0.suspend(|| eprintln!("bench block: {what}"));
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// A child process stopped with SIGTERM (then SIGKILL) on drop.
struct Proc {
    name: String,
    child: Child,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let child = cmd.stdin(Stdio::null()).spawn().with_context(|| format!("starting {name}"))?;
        Ok(Self { name: name.to_owned(), child })
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited: {status}", self.name);
        }
        Ok(())
    }

    /// SIGTERM and wait; an error unless it exits cleanly in time.
    fn stop(mut self) -> anyhow::Result<()> {
        let status = self.terminate();
        match status {
            Some(s) if s.success() => Ok(()),
            Some(s) => bail!("{} exited with {s}", self.name),
            None => bail!("{} did not stop within {STOP_TIMEOUT:?}", self.name),
        }
    }

    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate();
    }
}

fn kura_cmd() -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()));
    Ok(cmd)
}

fn wait_until(what: &str, proc: &mut Proc, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !ready() {
        proc.check_running()?;
        if Instant::now() > deadline {
            bail!("{what} not ready within {START_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The backend's store: the volumes that are written (nbd, fuse_loop), with room for the
/// garbage that overwrites leave, and the engine's slack.
fn store_size_bytes(args: &BlockBenchArgs) -> u64 {
    args.size.0 * STORE_VOLUMES_FACTOR + STORE_SLACK_BYTES
}

/// The pool URL of a backend, and the kura server behind it.
fn start_backend(name: &str, args: &BlockBenchArgs, dir: &Path) -> anyhow::Result<(String, Option<Proc>)> {
    let store = dir.join(format!("{name}.kura"));
    let _ = std::fs::remove_file(&store);
    let size_mb = store_size_bytes(args) >> 20;
    if name == "embedded" {
        return Ok((format!("embedded:{}?size={size_mb}M", store.display()), None));
    }
    let mut cmd = kura_cmd()?;
    cmd.args(["serve", "--mode", "store", "--size", &format!("{size_mb}M")])
        .args(["-t", &args.server_threads.to_string(), "-m", &args.server_memory_mb.to_string(), "--path"])
        .arg(&store)
        .stdout(Stdio::null());
    if name == "kura_unix" {
        let socket = std::path::absolute(dir.join(format!("{name}.sock")))?;
        let _ = std::fs::remove_file(&socket);
        cmd.arg("-s").arg(&socket);
        let mut server = Proc::spawn("kura serve", &mut cmd)?;
        wait_until("kura serve", &mut server, || UnixStream::connect(&socket).is_ok())?;
        return Ok((format!("kura://{}", socket.display()), Some(server)));
    }
    let port = free_tcp_port()?;
    cmd.args(["-l", "127.0.0.1", "-p", &port.to_string()]);
    let mut server = Proc::spawn("kura serve", &mut cmd)?;
    wait_until("kura serve", &mut server, || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())?;
    Ok((format!("kura://127.0.0.1:{port}"), Some(server)))
}

fn open_pool(url: &str) -> anyhow::Result<kura_block::PoolHandle> {
    Ok(kura_block::open_pool(kura_pool::PoolConfig::from_urls(&[url])?)?)
}

fn measure_backend(backend: &str, args: &BlockBenchArgs, dir: &Path, progress: &Progress) -> anyhow::Result<Value> {
    let (url, server) = start_backend(backend, args, dir)?;
    let result = measure_on(backend, &url, args, dir, progress);
    if let Some(server) = server {
        server.stop()?;
    }
    // Stores are allocated whole at creation: do not leave them behind.
    let _ = std::fs::remove_file(dir.join(format!("{backend}.kura")));
    result
}

fn measure_on(backend: &str, url: &str, args: &BlockBenchArgs, dir: &Path, progress: &Progress) -> anyhow::Result<Value> {
    {
        let handle = open_pool(url)?;
        let mut ctx = handle.pool.context()?;
        let mut volumes = Volumes::new(&mut ctx);
        for frontend in FRONTENDS.iter().filter(|f| wants(&args.frontends, f) && (**f != "ublk" || kura_block::ublk::available())) {
            volumes.create(&volume_name(frontend), args.size.0)?;
        }
    }
    let mut report = Map::new();
    let mut anchors = Anchors::start(url, args, dir, progress)?;
    for frontend in FRONTENDS.iter().filter(|f| wants(&args.frontends, f)) {
        progress.note(&format!("{backend}/{frontend}"));
        let result = match *frontend {
            "nbd" => measure_nbd(url, args, dir, progress, &mut anchors),
            "fuse_loop" => measure_fuse_loop(url, args, dir, progress),
            _ => measure_ublk(url, args, progress),
        };
        let value = result.unwrap_or_else(|e| {
            progress.warn(&format!("{backend}/{frontend} failed: {e:#}"));
            json!({"error": format!("{e:#}")})
        });
        report.insert(frontend.to_string(), value);
        if *frontend == "nbd" {
            // The anchors are done (their rounds ran beside nbd's): free the disk and CPU.
            anchors.stop();
        }
    }
    while anchors.rounds_done() < args.rounds {
        anchors.round(args, progress)?;
    }
    anchors.stop();
    let mut out = anchors.report();
    out.extend(report);
    Ok(Value::Object(out))
}

/// The anchors of one backend, measured a round at a time just before each round of the nbd
/// jobs, so that each pair shares the machine's luck: the pool client alone reading the very
/// blocks the nbd jobs read (the nbd volume's, on the same store or server), and qemu-nbd.
struct Anchors {
    url: String,
    /// The store is embedded: only one process can have it open, so the nbd server is stopped
    /// while the pool anchor runs.
    embedded: bool,
    /// The nbd volume's id, when there is one.
    volume_id: Option<u64>,
    blocks: u64,
    qemu: Option<QemuNbd>,
    qemu_absent: Option<String>,
    /// Per round: pool gets/s at --depth, pool mean latency at depth 1, qemu-nbd IOPS at
    /// --depth, qemu-nbd mean latency at depth 1.
    rounds: [Vec<f64>; 4],
    /// Rounds run, whether or not they measured anything (with neither an nbd volume nor
    /// qemu-nbd, a round measures nothing).
    rounds_run: u32,
}

const ANCHOR_FIELDS: [&str; 4] = ["pool_get_4k_ops_per_s", "pool_get_4k_lat_us", "qemu_nbd_randread_4k_iops", "qemu_nbd_qd1_read_lat_us"];

impl Anchors {
    /// Before any frontend runs (an embedded store must not be held by one).
    fn start(url: &str, args: &BlockBenchArgs, dir: &Path, progress: &Progress) -> anyhow::Result<Self> {
        let volume_id = if wants(&args.frontends, "nbd") {
            let handle = open_pool(url)?;
            let mut ctx = handle.pool.context()?;
            Some(Volumes::new(&mut ctx).open(&volume_name("nbd"))?.id)
        } else {
            None
        };
        let (qemu, qemu_absent) = if args.skip_qemu {
            (None, Some("--skip-qemu".to_owned()))
        } else if which("qemu-nbd").is_none() {
            progress.0.inc(1 + 2 * u64::from(args.rounds));
            (None, Some("qemu-nbd is not installed (qemu-utils)".to_owned()))
        } else {
            (Some(QemuNbd::start(args, dir, progress)?), None)
        };
        Ok(Self { url: url.to_owned(), embedded: url.starts_with("embedded:"), volume_id, blocks: args.size.0 / BLOCK_SIZE_BYTES, qemu, qemu_absent, rounds: Default::default(), rounds_run: 0 })
    }

    fn rounds_done(&self) -> u32 {
        self.rounds_run
    }

    fn round(&mut self, args: &BlockBenchArgs, progress: &Progress) -> anyhow::Result<()> {
        let duration = Duration::from_secs_f64(args.runtime_s);
        if let Some(volume_id) = self.volume_id {
            let handle = open_pool(&self.url)?;
            progress.step("pool anchor: gets");
            self.rounds[0].push(pool_gets(&handle.pool, volume_id, self.blocks, args.depth as usize, duration)?.0.round());
            progress.step("pool anchor: gets at depth 1");
            self.rounds[1].push(round1(pool_gets(&handle.pool, volume_id, self.blocks, 1, duration)?.1));
        } else {
            progress.0.inc(2);
        }
        if let Some(qemu) = &self.qemu {
            progress.step("qemu-nbd: randread_4k_iops");
            let r = run_fio(&fio_job(&qemu.target, FioRw::RandRead, BLOCK_SIZE_BYTES, args.depth, args.size.0, Some(args.runtime_s)))?;
            self.rounds[2].push(r.read.context("qemu-nbd: no reads")?.iops.round());
            progress.step("qemu-nbd: qd1_read_lat_us");
            let r = run_fio(&fio_job(&qemu.target, FioRw::RandRead, BLOCK_SIZE_BYTES, 1, args.size.0, Some(args.runtime_s)))?;
            self.rounds[3].push(round1(r.read.context("qemu-nbd: no reads")?.lat_us_mean));
        }
        self.rounds_run += 1;
        Ok(())
    }

    /// Stops qemu-nbd and removes its file (the rounds so far are kept).
    fn stop(&mut self) {
        self.qemu = None;
    }

    fn report(&self) -> Map<String, Value> {
        let mut out = Map::new();
        for (field, values) in ANCHOR_FIELDS.iter().zip(&self.rounds) {
            out.insert(field.to_string(), if values.is_empty() { Value::Null } else { json!(round1(median(values))) });
        }
        if !self.rounds[0].is_empty() {
            out.insert("pool_get_4k_mib_s".to_owned(), json!(round1(median(&self.rounds[0]) * BLOCK_SIZE_BYTES as f64 / MIB)));
        }
        if let Some(reason) = &self.qemu_absent {
            out.insert("qemu_nbd_absent".to_owned(), json!(reason));
        }
        out.insert("anchor_rounds".to_owned(), ANCHOR_FIELDS.iter().zip(&self.rounds).map(|(f, v)| (f.to_string(), json!(v))).collect::<Map<_, _>>().into());
        out
    }
}

/// The pool client alone: random GETs of the volume's blocks for `duration`, `depth` in
/// flight on one context, measured as `kura bench pool` measures its get phase (a quarter of
/// the window refilled at a time, latency from submit to completion). Returns (gets per
/// second, mean latency in microseconds).
fn pool_gets(pool: &Pool, volume_id: u64, blocks: u64, depth: usize, duration: Duration) -> anyhow::Result<(f64, f64)> {
    let mut ctx = pool.context()?;
    let mut rng = StdRng::seed_from_u64(0x6b75_7261);
    let mut started = vec![Instant::now(); depth];
    let mut free: Vec<usize> = (0..depth).collect();
    let refill_min = (depth / 4).max(1);
    let mut hist = LatencyHist::micros();
    let (mut ops, mut not_blocks) = (0_u64, 0_u64);
    let begin = Instant::now();
    let deadline = begin + duration;
    loop {
        if Instant::now() < deadline && free.len() >= refill_min {
            while let Some(slot) = free.pop() {
                started[slot] = Instant::now();
                ctx.submit_get(&block_key(volume_id, rng.random_range(0..blocks)), slot as u64)?;
            }
        }
        if ctx.in_flight() == 0 {
            break;
        }
        let mut failure = None;
        ctx.poll(None, &mut |c| {
            let slot = c.token as usize;
            hist.record(started[slot].elapsed());
            ops += 1;
            free.push(slot);
            match c.result {
                Ok(Outcome::Value(v)) if v.len() as u64 == BLOCK_SIZE_BYTES => {}
                Ok(_) => not_blocks += 1,
                Err(e) => failure = Some(e),
            }
        })?;
        if let Some(e) = failure {
            return Err(e.into());
        }
    }
    if not_blocks > 0 {
        bail!("pool anchor: {not_blocks} of {ops} gets found no 4 KiB block (was the volume written whole?)");
    }
    Ok((ops as f64 / begin.elapsed().as_secs_f64(), hist.mean()))
}

/// qemu-nbd `--cache=none` serving a prefilled raw file in --dir; stopped and the file
/// removed on drop.
struct QemuNbd {
    _proc: Proc,
    target: Target,
    file: PathBuf,
}

impl QemuNbd {
    fn start(args: &BlockBenchArgs, dir: &Path, progress: &Progress) -> anyhow::Result<Self> {
        let file = dir.join("qemu-nbd.raw");
        let socket = dir.join("qemu-nbd.sock");
        std::fs::File::create(&file)?.set_len(args.size.0)?;
        let _ = std::fs::remove_file(&socket);
        let mut cmd = Command::new("qemu-nbd");
        cmd.args(["--format=raw", "--cache=none", "--persistent", "--shared=8", "--export-name=bench", "--socket"]).arg(&socket).arg(&file).stdout(Stdio::null());
        let mut proc = Proc::spawn("qemu-nbd", &mut cmd)?;
        wait_until("qemu-nbd", &mut proc, || UnixStream::connect(&socket).is_ok())?;
        let qemu = Self { _proc: proc, target: Target::Nbd { uri: format!("nbd+unix:///bench?socket={}", socket.display()) }, file };
        prefill(&qemu.target, args.size.0, args, progress, "qemu-nbd")?;
        Ok(qemu)
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

/// Where fio sends its I/O.
#[derive(Clone)]
enum Target {
    /// fio's nbd engine.
    Nbd { uri: String },
    /// A block device or a file, with io_uring and O_DIRECT.
    Path(PathBuf),
}

fn fio_job(target: &Target, rw: FioRw, bs_bytes: u64, iodepth: u32, size_bytes: u64, runtime_s: Option<f64>) -> FioJob {
    let mut job = FioJob { name: "kura-bench-block".to_owned(), rw, bs_bytes, iodepth, size_bytes, ..FioJob::default() };
    match target {
        Target::Nbd { uri } => {
            job.ioengine = "nbd".to_owned();
            job.direct = false;
            job.extra_args.push(format!("--uri={uri}"));
        }
        Target::Path(path) => job.filename = path.clone(),
    }
    job.extra_args.push("--norandommap".to_owned());
    job.extra_args.push("--randrepeat=0".to_owned());
    if matches!(rw, FioRw::Write | FioRw::RandWrite) {
        // Written data is durable when the job ends (its time included).
        job.extra_args.push("--end_fsync=1".to_owned());
    }
    if let Some(s) = runtime_s {
        job.time_based = true;
        job.extra_args.push(format!("--runtime={}ms", (s * 1000.0).round() as u64));
    }
    job
}

fn run_fio(job: &FioJob) -> anyhow::Result<FioResult> {
    tracing::debug!(args = ?job.args(), "fio");
    Ok(fio::run(job)?)
}

/// Writes the whole target once with 128 KiB writes.
fn prefill(target: &Target, size_bytes: u64, args: &BlockBenchArgs, progress: &Progress, label: &str) -> anyhow::Result<()> {
    progress.step(&format!("{label}: prefill"));
    run_fio(&fio_job(target, FioRw::Write, SEQ_BLOCK_BYTES, args.depth, size_bytes, None))?;
    Ok(())
}

/// The six jobs, `--rounds` times; medians (and every round when there are several).
fn fio_suite(target: &Target, size_bytes: u64, args: &BlockBenchArgs, progress: &Progress, label: &str, before_round: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<Value> {
    let runtime = Some(args.runtime_s);
    // Over NBD also the random reads over two connections of half the depth each (NBD's
    // multi-conn, as the kernel client and qemu use it): one fio job is one client thread,
    // which with one connection is a large part of each request's round trip.
    let mut fields = FIELDS.to_vec();
    if matches!(target, Target::Nbd { .. }) && args.depth >= 2 {
        fields.insert(1, NBD_TWO_CONNECTIONS_FIELD);
    }
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); fields.len()];
    for _ in 0..args.rounds {
        before_round()?;
        for (i, field) in fields.iter().enumerate() {
            progress.step(&format!("{label}: {field}"));
            if *field == NBD_TWO_CONNECTIONS_FIELD {
                let mut job = fio_job(target, FioRw::RandRead, BLOCK_SIZE_BYTES, args.depth / 2, size_bytes, runtime);
                job.numjobs = 2;
                let side = run_fio(&job)?.read.with_context(|| format!("{label}: fio did no I/O for {field}"))?;
                rounds[i].push(side.iops.round());
                continue;
            }
            let (rw, bs, depth) = match *field {
                "seqwrite_128k_mib_s" => (FioRw::Write, SEQ_BLOCK_BYTES, args.depth),
                "randwrite_4k_iops" => (FioRw::RandWrite, BLOCK_SIZE_BYTES, args.depth),
                "qd1_write_lat_us" => (FioRw::RandWrite, BLOCK_SIZE_BYTES, 1),
                "randread_4k_iops" => (FioRw::RandRead, BLOCK_SIZE_BYTES, args.depth),
                "seqread_128k_mib_s" => (FioRw::Read, SEQ_BLOCK_BYTES, args.depth),
                _ => (FioRw::RandRead, BLOCK_SIZE_BYTES, 1),
            };
            let r = run_fio(&fio_job(target, rw, bs, depth, size_bytes, runtime))?;
            let side = match rw {
                FioRw::Read | FioRw::RandRead => r.read,
                _ => r.write,
            }
            .with_context(|| format!("{label}: fio did no I/O for {field}"))?;
            rounds[i].push(match *field {
                f if f.ends_with("_iops") => side.iops.round(),
                f if f.ends_with("_mib_s") => round1(side.bw_mib_s),
                _ => round1(side.lat_us_mean),
            });
        }
    }
    let mut out = Map::new();
    for (field, values) in fields.iter().zip(&rounds) {
        out.insert(field.to_string(), json!(round1(median(values))));
    }
    out.insert("rounds".to_owned(), fields.iter().zip(&rounds).map(|(f, v)| (f.to_string(), json!(v))).collect::<Map<_, _>>().into());
    Ok(Value::Object(out))
}

fn measure_nbd(url: &str, args: &BlockBenchArgs, dir: &Path, progress: &Progress, anchors: &mut Anchors) -> anyhow::Result<Value> {
    let socket = dir.join("kura-nbd.sock");
    let volume = volume_name("nbd");
    let start = || -> anyhow::Result<Proc> {
        let mut cmd = kura_cmd()?;
        cmd.args(["block", "nbd", "--listen", "none", "--unix"]).arg(&socket).args(["--volume", &volume, "--pool", url]);
        cmd.args(["--busy-poll-us", &args.nbd_busy_poll_us.to_string()]).stdout(Stdio::null());
        let _ = std::fs::remove_file(&socket);
        let mut nbd = Proc::spawn("kura block nbd", &mut cmd)?;
        wait_until("kura block nbd", &mut nbd, || UnixStream::connect(&socket).is_ok())?;
        Ok(nbd)
    };
    let mut nbd = Some(start()?);
    let target = Target::Nbd { uri: format!("nbd+unix:///{volume}?socket={}", socket.display()) };
    prefill(&target, args.size.0, args, progress, "nbd")?;
    let out = fio_suite(&target, args.size.0, args, progress, "nbd", &mut || {
        // An embedded store serves one process: the server steps aside for the anchor.
        if anchors.embedded {
            nbd.take().expect("running").stop()?;
        }
        anchors.round(args, progress)?;
        if nbd.is_none() {
            nbd = Some(start()?);
        }
        Ok(())
    })?;
    nbd.take().expect("running").stop()?;
    Ok(out)
}

/// Why the fuse_loop frontend cannot run here, if it cannot.
fn fuse_loop_unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("loop devices and mounts need root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    ["fusermount3", "losetup", "mount", "umount"].into_iter().find(|t| which(t).is_none()).map(|t| format!("{t} is not installed"))
}

fn run_cmd(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program).args(args).stdin(Stdio::null()).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!("{program} {args:?} failed ({}): {}{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kura block fuse`: unmounted (lazily if need be) on drop, after the process is stopped.
struct FuseMount {
    proc: Option<Proc>,
    mountpoint: PathBuf,
}

impl FuseMount {
    fn start(url: &str, volume: &str, mountpoint: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(mountpoint)?;
        let mut cmd = kura_cmd()?;
        cmd.args(["block", "fuse"]).arg(mountpoint).args(["--volume", volume, "--pool", url]).stdout(Stdio::piped());
        let mut proc = Proc::spawn("kura block fuse", &mut cmd)?;
        let mut line = String::new();
        BufReader::new(proc.child.stdout.take().expect("piped")).read_line(&mut line)?;
        if !line.starts_with("mounted") {
            proc.check_running()?;
            bail!("kura block fuse did not mount: {line:?}");
        }
        Ok(Self { proc: Some(proc), mountpoint: mountpoint.to_owned() })
    }

    fn stop(mut self) -> anyhow::Result<()> {
        self.proc.take().expect("running").stop()
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.terminate();
            let _ = Command::new("fusermount3").arg("-uz").arg(&self.mountpoint).stderr(Stdio::null()).status();
        }
    }
}

/// A loop device; whatever is mounted at `mounted` is unmounted and the device detached on drop.
struct LoopDev {
    dev: PathBuf,
    mounted: Option<PathBuf>,
}

impl LoopDev {
    fn attach(file: &Path) -> anyhow::Result<Self> {
        let out = run_cmd("losetup", &["--direct-io=on", "--find", "--show", &file.display().to_string()])?;
        let dev = out.trim();
        anyhow::ensure!(dev.starts_with("/dev/loop"), "losetup printed {out:?}");
        Ok(Self { dev: PathBuf::from(dev), mounted: None })
    }

    fn direct_io(&self) -> bool {
        let name = self.dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).is_ok_and(|s| s.trim() == "1")
    }

    fn mkfs_and_mount(&mut self, fs: &str, mountpoint: &Path) -> anyhow::Result<()> {
        self.unmount()?;
        let dev = self.dev.display().to_string();
        match fs {
            // No discard at mkfs: the volume was just written whole, and the jobs rewrite it.
            "xfs" => run_cmd("mkfs.xfs", &["-f", "-q", "-K", &dev])?,
            _ => run_cmd("mkfs.ext4", &["-F", "-q", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", &dev])?,
        };
        std::fs::create_dir_all(mountpoint)?;
        run_cmd("mount", &[&dev, &mountpoint.display().to_string()])?;
        self.mounted = Some(mountpoint.to_owned());
        Ok(())
    }

    fn unmount(&mut self) -> anyhow::Result<()> {
        if let Some(m) = self.mounted.take() {
            run_cmd("umount", &[&m.display().to_string()])?;
        }
        Ok(())
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = Command::new("umount").arg("-l").arg(&m).stderr(Stdio::null()).status();
        }
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

fn measure_fuse_loop(url: &str, args: &BlockBenchArgs, dir: &Path, progress: &Progress) -> anyhow::Result<Value> {
    if let Some(reason) = fuse_loop_unavailable() {
        let per_target = 1 + FIELDS.len() as u64 * u64::from(args.rounds);
        progress.0.inc(per_target * (1 + args.filesystems.iter().filter(|f| !f.is_empty()).count() as u64));
        return Ok(json!({"absent": reason}));
    }
    let volume = volume_name("fuse_loop");
    let mnt = dir.join("fuse-mnt");
    let fuse = FuseMount::start(url, &volume, &mnt)?;
    let mut out = {
        let mut lo = LoopDev::attach(&mnt.join(&volume))?;
        anyhow::ensure!(lo.direct_io(), "{} did not get direct I/O (losetup --direct-io=on)", lo.dev.display());
        let target = Target::Path(lo.dev.clone());
        prefill(&target, args.size.0, args, progress, "fuse_loop")?;
        let mut out = fio_suite(&target, args.size.0, args, progress, "fuse_loop", &mut || Ok(()))?;
        for fs in FILESYSTEMS.iter().filter(|f| wants(&args.filesystems, f)) {
            let label = format!("fuse_loop/{fs}");
            if *fs == "xfs" && args.size.0 < XFS_SIZE_BYTES_MIN {
                out[*fs] = json!({"absent": format!("mkfs.xfs needs a volume of at least {} MiB (--size)", XFS_SIZE_BYTES_MIN >> 20)});
                progress.0.inc(1 + FIELDS.len() as u64 * u64::from(args.rounds));
                continue;
            }
            let fs_mnt = dir.join(format!("fs-{fs}"));
            lo.mkfs_and_mount(fs, &fs_mnt)?;
            let file = Target::Path(fs_mnt.join("fio.dat"));
            let file_bytes = args.size.0 / 2;
            prefill(&file, file_bytes, args, progress, &label)?;
            out[*fs] = fio_suite(&file, file_bytes, args, progress, &label, &mut || Ok(()))?;
            lo.unmount()?;
        }
        out
    };
    fuse.stop()?;
    out["loop_direct_io"] = json!(true);
    Ok(out)
}

fn measure_ublk(url: &str, args: &BlockBenchArgs, progress: &Progress) -> anyhow::Result<Value> {
    if !kura_block::ublk::available() {
        progress.0.inc(1 + FIELDS.len() as u64 * u64::from(args.rounds));
        return Ok(json!({"absent": "/dev/ublk-control does not exist: this kernel has no ublk driver (modprobe ublk_drv, Linux 6.0+)"}));
    }
    let volume = volume_name("ublk");
    let mut cmd = kura_cmd()?;
    cmd.args(["block", "ublk", "--volume", &volume, "--pool", url]).stdout(Stdio::piped());
    let mut proc = Proc::spawn("kura block ublk", &mut cmd)?;
    let mut line = String::new();
    BufReader::new(proc.child.stdout.take().expect("piped")).read_line(&mut line)?;
    let dev = PathBuf::from(line.trim());
    if !line.trim().starts_with("/dev/ublkb") {
        proc.check_running()?;
        bail!("kura block ublk printed {line:?}, not a device");
    }
    let target = Target::Path(dev);
    prefill(&target, args.size.0, args, progress, "ublk")?;
    let out = fio_suite(&target, args.size.0, args, progress, "ublk", &mut || Ok(()))?;
    proc.stop()?;
    Ok(out)
}

/// The goals for one backend: each figure, the goal, and whether it is met. NBD's
/// ratios to the anchors are the median of each round's pair (measured back to back).
fn goals(report: &Value) -> Value {
    let rounds = |v: &Value| -> Vec<f64> { v.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default() };
    let nbd = &report["nbd"]["rounds"];
    let anchor = &report["anchor_rounds"];
    let paired = |a: &Value, b: &Value, f: &dyn Fn(f64, f64) -> Option<f64>| -> Option<f64> {
        let values: Vec<f64> = rounds(a).into_iter().zip(rounds(b)).filter_map(|(x, y)| f(x, y)).collect();
        (!values.is_empty()).then(|| (median(&values) * 1000.0).round() / 1000.0)
    };
    let ratio = |x: f64, y: f64| (y > 0.0).then(|| x / y);
    let to_mib = |ops: f64| ops * BLOCK_SIZE_BYTES as f64 / MIB;
    let goal = |value: Option<f64>, ok: fn(f64) -> bool, want: &str| match value {
        Some(v) => json!({"value": v, "goal": want, "met": ok(v)}),
        None => json!({"value": null, "goal": want, "met": null}),
    };
    let fuse_over_nbd = report["fuse_loop"]["randread_4k_iops"].as_f64().zip(report["nbd"]["randread_4k_iops"].as_f64()).and_then(|(a, b)| ratio(a, b)).map(|r| (r * 1000.0).round() / 1000.0);
    json!({
        "nbd_randread_over_pool_get": goal(paired(&nbd["randread_4k_iops"], &anchor["pool_get_4k_ops_per_s"], &ratio), |v| v >= 0.9, ">= 0.9"),
        // Not the goal (that is one connection at fio's iodepth); the same total depth over
        // two connections, which shows what the client thread costs.
        "nbd_randread_2conn_over_pool_get": paired(&nbd[NBD_TWO_CONNECTIONS_FIELD], &anchor["pool_get_4k_ops_per_s"], &ratio),
        "nbd_randread_over_qemu_nbd": goal(paired(&nbd["randread_4k_iops"], &anchor["qemu_nbd_randread_4k_iops"], &ratio), |v| v >= 1.0, ">= 1.0"),
        "nbd_qd1_read_lat_minus_pool_us": goal(paired(&nbd["qd1_read_lat_us"], &anchor["pool_get_4k_lat_us"], &|x, y| Some(x - y)), |v| v <= 15.0, "<= 15"),
        "nbd_seqread_over_pool_get_bandwidth": goal(paired(&nbd["seqread_128k_mib_s"], &anchor["pool_get_4k_ops_per_s"], &|x, y| ratio(x, to_mib(y))), |v| v >= 0.8, ">= 0.8"),
        "fuse_loop_randread_over_nbd": goal(fuse_over_nbd, |v| v >= 0.7, ">= 0.7"),
    })
}

fn plot(path: &Path, report: &Value) -> anyhow::Result<()> {
    // Short labels: twelve bars share the width.
    let mut bars = Vec::new();
    if let Some(backends) = report["backends"].as_object() {
        for (backend, r) in backends {
            let b = if backend == "embedded" { "emb" } else { backend.as_str() };
            let mut bar = |label: String, v: &Value| {
                if let Some(v) = v.as_f64() {
                    bars.push((label, v));
                }
            };
            bar(format!("{b} pool"), &r["pool_get_4k_ops_per_s"]);
            bar(format!("{b} qemu"), &r["qemu_nbd_randread_4k_iops"]);
            for frontend in FRONTENDS {
                let f = frontend.trim_end_matches("_loop");
                bar(format!("{b} {f}"), &r[frontend]["randread_4k_iops"]);
                for fs in FILESYSTEMS {
                    bar(format!("{b} {fs}"), &r[frontend][fs]["randread_4k_iops"]);
                }
            }
        }
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let title = "4 KiB random reads (pool: GETs alone; fuse/xfs/ext4: loop device)";
    kura_bench::plot::bar_plot(path, title, "IOPS", &bars)?;
    Ok(())
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn load_average() -> Value {
    std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<f64>().ok())).map_or(Value::Null, |v| json!(v))
}

#[cfg(test)]
mod tests {
    use super::*;


    #[test]
    fn goals_pair_each_round_with_its_anchor() {
        let report = json!({
            "anchor_rounds": {
                "pool_get_4k_ops_per_s": [100000.0, 50000.0, 100000.0], "pool_get_4k_lat_us": [20.0, 30.0, 20.0],
                "qemu_nbd_randread_4k_iops": [90000.0, 90000.0, 90000.0], "qemu_nbd_qd1_read_lat_us": [50.0, 50.0, 50.0],
            },
            "nbd": {
                "randread_4k_iops": 95000.0,
                "rounds": {"randread_4k_iops": [95000.0, 45000.0, 80000.0], "qd1_read_lat_us": [40.0, 40.0, 30.0], "seqread_128k_mib_s": [400.0, 400.0, 400.0]},
            },
            "fuse_loop": {"randread_4k_iops": 50000.0},
        });
        let g = goals(&report);
        // Paired ratios 0.95, 0.9, 0.8: the median is 0.9 (the medians' ratio would be 0.95).
        assert_eq!(g["nbd_randread_over_pool_get"]["value"], 0.9);
        assert_eq!(g["nbd_randread_over_pool_get"]["met"], true);
        assert_eq!(g["nbd_randread_over_qemu_nbd"]["met"], false);
        assert_eq!(g["nbd_qd1_read_lat_minus_pool_us"]["value"], 10.0);
        assert_eq!(g["nbd_qd1_read_lat_minus_pool_us"]["met"], true);
        assert_eq!(g["nbd_seqread_over_pool_get_bandwidth"]["met"], true);
        assert_eq!(g["fuse_loop_randread_over_nbd"]["value"], 0.526);
        assert_eq!(g["fuse_loop_randread_over_nbd"]["met"], false);
        let none = goals(&json!({}));
        assert_eq!(none["nbd_randread_over_qemu_nbd"]["met"], Value::Null);
    }

    /// With neither an nbd volume nor qemu-nbd (`--frontends fuse_loop --skip-qemu`) a round
    /// measures nothing, and the rounds still end (they used to be counted by their figures,
    /// and the bench looped for ever).
    #[test]
    fn anchor_rounds_that_measure_nothing_still_count() {
        let mut anchors = Anchors { url: "embedded:unused".into(), embedded: true, volume_id: None, blocks: 1, qemu: None, qemu_absent: Some("--skip-qemu".into()), rounds: Default::default(), rounds_run: 0 };
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: BlockBenchArgs,
        }
        let args = <Cli as clap::Parser>::try_parse_from(["bench", "--rounds", "3", "--skip-qemu"]).unwrap().args;
        let progress = Progress::new(0);
        for _ in 0..args.rounds {
            anchors.round(&args, &progress).unwrap();
        }
        assert_eq!(anchors.rounds_done(), args.rounds, "three rounds ran");
        assert_eq!(anchors.report()["pool_get_4k_ops_per_s"], Value::Null);
    }

    #[test]
    fn nbd_jobs_use_the_uri_and_runtime() {
        let job = fio_job(&Target::Nbd { uri: "nbd+unix:///v?socket=/s".into() }, FioRw::RandRead, 4096, 32, 1 << 20, Some(0.5));
        let args = job.args();
        for want in ["--ioengine=nbd", "--uri=nbd+unix:///v?socket=/s", "--runtime=500ms", "--time_based", "--iodepth=32"] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
    }
}
