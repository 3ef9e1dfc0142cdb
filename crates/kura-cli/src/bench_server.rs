//! `kura bench server`: kura against stock memcached (all in DRAM) and memcached with extstore
//! (a file on the same disk, the same RAM as kura's cache), in one run, with kura's own
//! pipelined multi-connection load generator.
//!
//! Per system: start it, load the same items (pipelined sets, `--connections` × `--depth`),
//! measure RSS, find the peak GET rate (closed loop, uniform keys), then sweep offered loads
//! below and at that peak (open loop: requests leave on a schedule, latency counts from the
//! scheduled time, so a slow server cannot hide its queueing). The client runs on the same
//! cores as the server; both CPU times are reported.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use kura_bench::hist::LatencyHist;
use kura_bench::host::{free_tcp_port, which};
use kura_bench::proc::{self, ProcSample};
use kura_tls::rustls;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

#[derive(Args, Clone, Debug)]
pub struct ServerBenchArgs {
    /// Value size in bytes.
    #[arg(long, default_value_t = 4096)]
    value_size: usize,
    /// Items loaded; default: four times the RAM cache's worth (at least 100,000).
    #[arg(long)]
    items: Option<u64>,
    /// Client connections per system.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Requests each connection keeps in flight (pipelining) when loading and at peak.
    #[arg(long, default_value_t = 16)]
    depth: usize,
    /// RAM of kura's cache and of memcached-with-extstore, in MiB (`-m` of both).
    #[arg(long, default_value_t = 64)]
    memory_mb: u64,
    /// RAM, in MiB, that memcached-with-extstore may hold in all: its process and the page
    /// cache of its file, capped with a memory cgroup. Without a cap, extstore's reads are
    /// served from the kernel's page cache wherever the machine's free RAM holds its file,
    /// not from the disk as kura's `O_DIRECT` reads are. Default: 2 × --memory-mb + 32, about
    /// what kura's own process holds at the defaults (its cache, write buffers and index).
    /// 0: no cap. Needs root and a cgroup memory controller; without them the run goes on
    /// uncapped and says so.
    #[arg(long)]
    extstore_memory_cap_mb: Option<u64>,
    /// Seconds of the peak GET phase and of each sweep point.
    #[arg(long, default_value_t = 4)]
    duration_s: u64,
    /// Offered loads of the sweep, as fractions of each system's measured peak.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.1,0.25,0.5,0.75,0.9,1.0"
    )]
    sweep: Vec<f64>,
    /// Server worker threads (kura -t and memcached -t).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Directory for kura's store and extstore's file (the disk under test).
    #[arg(long, default_value = "kura-data/bench-server")]
    dir: PathBuf,
    /// Which systems to run, of kura, memcached, memcached_extstore.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kura,memcached,memcached_extstore"
    )]
    systems: Vec<String>,
    /// Draw the QPS-vs-latency curves here (default: server-latency.png in --dir).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep kura's store and extstore's file afterwards.
    #[arg(long)]
    keep: bool,
    /// Serve and measure over TLS: every system starts with `-Z` and a certificate made
    /// here (in --dir/tls, with the `openssl` command), and every client connection makes a
    /// TLS 1.3 handshake. Everything is measured as without it, the offered-load sweep too
    /// (its sending and receiving threads take turns at each connection's session).
    #[arg(long)]
    tls: bool,
    /// Extra arguments for `kura serve` (e.g. --kura-args="--sync=never").
    #[arg(long, allow_hyphen_values = true, value_delimiter = ' ')]
    kura_args: Vec<String>,
}

/// `ext_threads` of memcached with extstore: reads of its file in flight at once (each IO
/// thread makes one `pread` at a time; memcached's default is 1, which on this machine's disk
/// held it to ~7,000 GETs/s once its reads reached the disk).
const EXTSTORE_IO_THREADS: usize = 8;

impl ServerBenchArgs {
    /// `--extstore-memory-cap-mb` with its default; `None`: no cap.
    fn extstore_cap_mb(&self) -> Option<u64> {
        let cap_mb = self
            .extstore_memory_cap_mb
            .unwrap_or(2 * self.memory_mb + 32);
        (cap_mb > 0).then_some(cap_mb)
    }
}

const SYSTEMS: [&str; 3] = ["kura", "memcached", "memcached_extstore"];
/// Open-loop requests one connection may have outstanding before it stops sending.
const OUTSTANDING_MAX: usize = 4096;
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Time given to extstore and kura to settle after the load (flushes, seals).
const SETTLE: Duration = Duration::from_secs(2);
/// The pace of a reload for a server that lost items under the bulk load (extstore's
/// flusher keeps up with it on this machine).
const PACED_LOAD_ITEMS_PER_S: usize = 10_000;
const PACED_LOAD_BATCH: usize = 1000;
/// memcached's default `ext_item_size`: smaller items stay in RAM.
const EXTSTORE_ITEM_SIZE_MIN: usize = 512;

pub fn run(args: &ServerBenchArgs) -> anyhow::Result<()> {
    if args.connections == 0 || args.depth == 0 || args.value_size == 0 {
        bail!("--connections, --depth and --value-size must be above 0");
    }
    for s in &args.systems {
        if !SYSTEMS.contains(&s.as_str()) {
            bail!("unknown system {s:?}; use {}", SYSTEMS.join(", "));
        }
    }
    let items = args
        .items
        .unwrap_or_else(|| (((4 * args.memory_mb) << 20) / args.value_size as u64).max(100_000));
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let data_bytes = items * (args.value_size as u64 + 32);
    let tls = if args.tls {
        Some(TlsFiles::make(&args.dir.join("tls"))?)
    } else {
        None
    };
    eprintln!(
        "bench server: {items} items of {} bytes ({} MiB), {} connections × depth {}",
        args.value_size,
        data_bytes >> 20,
        args.connections,
        args.depth
    );
    let mut results = serde_json::Map::new();
    let mut curves = Vec::new();
    for name in SYSTEMS
        .iter()
        .filter(|s| args.systems.iter().any(|a| a == *s))
    {
        let result = measure(name, args, items, data_bytes, tls.as_ref())?;
        curves.push((
            name.to_string(),
            result
                .curve
                .iter()
                .map(|p| (p.achieved_ops_per_s, p.p99_us.max(1) as f64))
                .collect::<Vec<_>>(),
        ));
        results.insert(name.to_string(), result.to_json());
    }
    if !args.keep {
        let _ = std::fs::remove_file(args.dir.join("kura.kura"));
        let _ = std::fs::remove_file(args.dir.join("extstore.data"));
    }
    let plot_path = args
        .plot
        .clone()
        .unwrap_or_else(|| args.dir.join("server-latency.png"));
    let plotted = kura_bench::plot::line_plot(
        &plot_path,
        &format!(
            "GET p99 latency vs throughput{}, {} B values, {items} items",
            if tls.is_some() { " over TLS" } else { "" },
            args.value_size
        ),
        "GET/s achieved",
        "p99 latency (µs, log)",
        &curves,
        false,
        true,
    );
    if let Err(error) = &plotted {
        eprintln!("bench server: no plot: {error}");
    }
    let report = json!({
        "bench": "server",
        "config": {
            "value_size": args.value_size, "items": items, "connections": args.connections, "depth": args.depth,
            "memory_mb": args.memory_mb, "threads": args.threads, "duration_s": args.duration_s, "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "tls": args.tls,
            "extstore_memory_cap_mb": args.extstore_cap_mb(),
            "dir": args.dir.display().to_string(),
        },
        "systems": Value::Object(results.clone()),
        "ratios": ratios(&results),
        "plot": plotted.is_ok().then(|| plot_path.display().to_string()),
    });
    kura_bench::json::emit(&report, args.json.as_deref())?;
    Ok(())
}

fn ratios(results: &serde_json::Map<String, Value>) -> Value {
    let field = |system: &str, f: &str| {
        results
            .get(system)
            .and_then(|s| s.get(f))
            .and_then(Value::as_f64)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!((a / b * 1000.0).round() / 1000.0),
        _ => Value::Null,
    };
    json!({
        "kura_get_over_memcached_extstore": ratio(field("kura", "get_ops_per_s"), field("memcached_extstore", "get_ops_per_s")),
        "kura_get_over_memcached": ratio(field("kura", "get_ops_per_s"), field("memcached", "get_ops_per_s")),
        "kura_rss_per_item_over_memcached_extstore": ratio(field("kura", "rss_bytes_per_item"), field("memcached_extstore", "rss_bytes_per_item")),
        "kura_rss_per_item_over_memcached": ratio(field("kura", "rss_bytes_per_item"), field("memcached", "rss_bytes_per_item")),
        "kura_set_over_memcached_extstore": ratio(field("kura", "set_ops_per_s"), field("memcached_extstore", "set_ops_per_s")),
    })
}

/// A server process for one system, stopped (SIGTERM, then SIGKILL) on drop.
struct Running {
    target: Target,
    child: std::process::Child,
    /// The memory cgroup the server runs in (`--extstore-memory-cap-mb`); removed after the
    /// child has exited (fields drop after [`Running`]'s own `drop`).
    cap: Option<kura_bench::memcg::MemoryCap>,
}

impl Running {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM through kill(1): kura syncs and exits; the CLI itself needs no libc.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_system(
    name: &str,
    args: &ServerBenchArgs,
    items: u64,
    data_bytes: u64,
    tls: Option<&TlsFiles>,
) -> anyhow::Result<Running> {
    let port = free_tcp_port()?;
    let threads = args.threads.to_string();
    let mut cmd;
    match name {
        "kura" => {
            let path = args.dir.join("kura.kura");
            let _ = std::fs::remove_file(&path);
            let size_mb = ((data_bytes * 2) >> 20) + 1024;
            cmd = Command::new(std::env::current_exe()?);
            let extra: Vec<&String> = args.kura_args.iter().filter(|a| !a.is_empty()).collect();
            let given = |flags: &[&str]| {
                extra.iter().any(|a| {
                    flags
                        .iter()
                        .any(|f| a.as_str() == *f || a.starts_with(&format!("{f}=")))
                })
            };
            cmd.args([
                "serve",
                "-p",
                &port.to_string(),
                "--size",
                &format!("{size_mb}M"),
                "--mode",
                "cache",
                "--path",
            ])
            .arg(&path);
            if !given(&["-t", "--threads"]) {
                cmd.args(["-t", &threads]);
            }
            if !given(&["-m", "--memory-limit-mb", "--memory-limit"]) {
                cmd.args(["-m", &args.memory_mb.to_string()]);
            }
            cmd.args(extra);
        }
        "memcached" | "memcached_extstore" => {
            let bin = which("memcached")
                .context("memcached is not installed (./scripts/test.sh installs it)")?;
            cmd = Command::new(bin);
            cmd.args([
                "-u",
                "root",
                "-U",
                "0",
                "-l",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-t",
                &threads,
                "-c",
                "4096",
            ]);
            if name == "memcached" {
                // Everything in DRAM: room for every item with its header and slab slack.
                let per_item = args.value_size as u64 + 128;
                let mb = ((items * per_item * 14 / 10) >> 20).max(64);
                cmd.args(["-m", &mb.to_string()]);
            } else {
                let path = args.dir.join("extstore.data");
                let _ = std::fs::remove_file(&path);
                let size_mb = ((data_bytes * 2) >> 20).max(1024);
                // Tuned so extstore keeps every item under a bulk load: flush to disk at once
                // (ext_item_age=0) and keep a fifth of RAM free for item headers; with the
                // defaults it evicts about half of a fast load it cannot flush in time.
                // Its IO threads read with one pread each: EXTSTORE_IO_THREADS of them keep
                // that many disk reads in flight (memcached's default, 1, keeps one).
                let ext = format!(
                    "ext_path={}:{size_mb}m,ext_item_age=0,slab_automove_freeratio=0.2,ext_threads={EXTSTORE_IO_THREADS}",
                    path.display()
                );
                cmd.args(["-m", &args.memory_mb.to_string(), "-o", &ext]);
            }
        }
        _ => unreachable!("systems were checked"),
    }
    if let Some(tls) = tls {
        // The same option for kura and memcached (kura takes memcached's TLS options).
        cmd.args(["-Z", "-o", &tls.server_options()]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let cap = match args.extstore_cap_mb() {
        Some(cap_mb) if name == "memcached_extstore" => memory_cap(&mut cmd, cap_mb),
        _ => None,
    };
    eprintln!("bench server: starting {name} on port {port}");
    let running = Running {
        target: Target {
            port,
            tls: tls.map(|t| Arc::clone(&t.client)),
        },
        child: cmd.spawn().with_context(|| format!("starting {name}"))?,
        cap,
    };
    let mut running = running;
    let deadline = Instant::now() + START_TIMEOUT;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = running.child.try_wait()? {
            bail!("{name} exited at start: {status}");
        }
        if Instant::now() > deadline {
            bail!("{name} did not accept connections within {START_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(running)
}

struct CurvePoint {
    offered_ops_per_s: f64,
    achieved_ops_per_s: f64,
    p50_us: u64,
    p99_us: u64,
}

struct SystemResult {
    /// Selected fields of the server's own `stats`.
    server_stats: Value,
    /// Items the server did not have after the bulk load, and when the reads began.
    missing_after_load: usize,
    missing_at_start: usize,
    /// The bulk load lost items, so the data was loaded again at a slower pace.
    paced_load: bool,
    set_ops_per_s: f64,
    get_ops_per_s: f64,
    get_p50_us: u64,
    get_p99_us: u64,
    get_hit_ratio: f64,
    rss_after_load_bytes: u64,
    rss_after_gets_bytes: u64,
    items: u64,
    load_server_cpu_s: f64,
    load_client_cpu_s: f64,
    peak_server_cpu_s: f64,
    peak_client_cpu_s: f64,
    peak_wall_s: f64,
    curve: Vec<CurvePoint>,
    /// `--extstore-memory-cap-mb`'s cgroup: its limit, the most it held, and the page cache it
    /// held at the end.
    memory_cap: Option<Value>,
}

impl SystemResult {
    fn to_json(&self) -> Value {
        let rss = self.rss_after_load_bytes.max(self.rss_after_gets_bytes);
        json!({
            "get_ops_per_s": self.get_ops_per_s.round(),
            "get_p50_us": self.get_p50_us,
            "get_p99_us": self.get_p99_us,
            "set_ops_per_s": self.set_ops_per_s.round(),
            "rss_bytes_per_item": (rss as f64 / self.items as f64).round(),
            "rss_after_load_bytes": self.rss_after_load_bytes,
            "rss_after_gets_bytes": self.rss_after_gets_bytes,
            "get_hit_ratio": (self.get_hit_ratio * 10000.0).round() / 10000.0,
            "server_stats": self.server_stats,
            "items_missing_after_bulk_load": self.missing_after_load,
            "reloaded_paced": self.paced_load,
            "items_missing_when_measured": self.missing_at_start,
            "memory_cap": self.memory_cap,
            "cpu": {
                "load_server_s": round2(self.load_server_cpu_s), "load_client_s": round2(self.load_client_cpu_s),
                "peak_server_s": round2(self.peak_server_cpu_s), "peak_client_s": round2(self.peak_client_cpu_s),
                "peak_wall_s": round2(self.peak_wall_s),
            },
            "curve": self.curve.iter().map(|p| json!({
                "offered_ops_per_s": p.offered_ops_per_s.round(), "achieved_ops_per_s": p.achieved_ops_per_s.round(),
                "p50_us": p.p50_us, "p99_us": p.p99_us,
            })).collect::<Vec<_>>(),
        })
    }
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn self_sample() -> anyhow::Result<ProcSample> {
    Ok(proc::sample(std::process::id())?)
}

fn measure(
    name: &str,
    args: &ServerBenchArgs,
    items: u64,
    data_bytes: u64,
    tls: Option<&TlsFiles>,
) -> anyhow::Result<SystemResult> {
    let mut server = start_system(name, args, items, data_bytes, tls)?;
    let (server0, client0) = (proc::sample(server.pid())?, self_sample()?);
    let started = Instant::now();
    load(
        &server.target,
        items,
        args.value_size,
        args.connections,
        args.depth,
    )?;
    let load_s = started.elapsed().as_secs_f64();
    let (server1, client1) = (proc::sample(server.pid())?, self_sample()?);
    let set_ops_per_s = items as f64 / load_s;
    eprintln!(
        "bench server: {name}: loaded {items} items in {load_s:.1} s ({set_ops_per_s:.0} sets/s)"
    );
    std::thread::sleep(SETTLE);
    // A server that dropped items under the bulk load (memcached's extstore cannot move them
    // to disk as fast as they arrive, and once its RAM is all in large slabs it evicts the
    // headers of what it did write) starts over and is loaded at a pace it keeps up with, so
    // every system serves the same data.
    let mut missing = missing_keys(&server.target, items, args.value_size, args.depth)?;
    let missing_after_load = missing.len();
    let mut paced_load = false;
    // Values under extstore's ext_item_size (512 B) never go to disk: its RAM bounds it, and a
    // slower load would not change that.
    let reload_helps = !(name == "memcached_extstore" && args.value_size < EXTSTORE_ITEM_SIZE_MIN);
    if !missing.is_empty() && reload_helps {
        eprintln!(
            "bench server: {name}: {} items missing after the bulk load; restarting it and loading at {PACED_LOAD_ITEMS_PER_S} sets/s",
            missing.len()
        );
        drop(server);
        server = start_system(name, args, items, data_bytes, tls)?;
        let all: Vec<u64> = (0..items).collect();
        paced_sets(&server.target, &all, args.value_size)?;
        paced_load = true;
        std::thread::sleep(SETTLE);
        missing = missing_keys(&server.target, items, args.value_size, args.depth)?;
    }
    let rss_after_load_bytes = proc::rss_bytes(server.pid())?;

    let duration = Duration::from_secs(args.duration_s);
    let (server2, client2) = (proc::sample(server.pid())?, self_sample()?);
    let peak = closed_loop_gets(
        &server.target,
        items,
        args.value_size,
        args.connections,
        args.depth,
        duration,
    )?;
    let (server3, client3) = (proc::sample(server.pid())?, self_sample()?);
    eprintln!(
        "bench server: {name}: peak {:.0} GET/s, p50 {} µs, p99 {} µs, hits {:.1}%",
        peak.ops_per_s,
        peak.hist.p50(),
        peak.hist.p99(),
        100.0 * peak.hit_ratio()
    );
    let mut curve = Vec::new();
    for &fraction in &args.sweep {
        let offered = (peak.ops_per_s * fraction).max(100.0);
        let point = open_loop_gets(
            &server.target,
            items,
            args.value_size,
            args.connections,
            offered,
            duration,
        )?;
        eprintln!(
            "bench server: {name}: offered {offered:.0}/s → {:.0}/s, p50 {} µs, p99 {} µs",
            point.ops_per_s,
            point.hist.p50(),
            point.hist.p99()
        );
        curve.push(CurvePoint {
            offered_ops_per_s: offered,
            achieved_ops_per_s: point.ops_per_s,
            p50_us: point.hist.p50(),
            p99_us: point.hist.p99(),
        });
    }
    let rss_after_gets_bytes = proc::rss_bytes(server.pid())?;
    let server_stats = server_stats(&server.target)?;
    let memory_cap = server.cap.as_ref().map(|cap| {
        json!({
            "limit_bytes": cap.limit_bytes(),
            "peak_bytes": cap.peak_bytes(),
            "page_cache_bytes": cap.page_cache_bytes(),
        })
    });
    Ok(SystemResult {
        memory_cap,
        server_stats,
        paced_load,
        missing_after_load,
        missing_at_start: missing.len(),
        set_ops_per_s,
        get_ops_per_s: peak.ops_per_s,
        get_p50_us: peak.hist.p50(),
        get_p99_us: peak.hist.p99(),
        get_hit_ratio: peak.hit_ratio(),
        rss_after_load_bytes,
        rss_after_gets_bytes,
        items,
        load_server_cpu_s: (server1.cpu() - server0.cpu()).as_secs_f64(),
        load_client_cpu_s: (client1.cpu() - client0.cpu()).as_secs_f64(),
        peak_server_cpu_s: (server3.cpu() - server2.cpu()).as_secs_f64(),
        peak_client_cpu_s: (client3.cpu() - client2.cpu()).as_secs_f64(),
        peak_wall_s: server3
            .taken_at
            .duration_since(server2.taken_at)
            .as_secs_f64(),
        curve,
    })
}

/// The `stats` fields that explain a result: items kept, evictions, where RAM goes.
fn server_stats(target: &Target) -> anyhow::Result<Value> {
    let mut reader = BufReader::new(target.connect()?);
    reader.get_mut().write_all(b"stats\r\n")?;
    let mut out = serde_json::Map::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "END\r\n" {
            break;
        }
        let Some((name, value)) = line
            .trim_end()
            .strip_prefix("STAT ")
            .and_then(|l| l.split_once(' '))
        else {
            continue;
        };
        let wanted = matches!(
            name,
            "curr_items"
                | "total_items"
                | "evictions"
                | "bytes"
                | "get_hits"
                | "get_misses"
                | "limit_maxbytes"
        ) || name.starts_with("kura_ram_cache")
            || matches!(
                name,
                "kura_index_bytes"
                    | "kura_write_buffer_bytes"
                    | "kura_flash_reads"
                    | "kura_flash_gets"
            )
            || name.starts_with("extstore_objects")
            || matches!(
                name,
                "extstore_bytes_used" | "get_extstore" | "miss_from_extstore" | "evicted_unfetched"
            );
        if wanted {
            out.insert(
                name.to_owned(),
                value
                    .parse::<u64>()
                    .map_or_else(|_| json!(value), |v| json!(v)),
            );
        }
    }
    Ok(Value::Object(out))
}

fn key(i: u64) -> String {
    format!("bench:{i:012}")
}

fn value_for(i: u64, len: usize) -> Vec<u8> {
    let seed = format!("{i:016x}");
    seed.as_bytes().iter().copied().cycle().take(len).collect()
}

fn connect(port: u16) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    Ok(stream)
}

/// A system under test, as its clients reach it.
#[derive(Clone)]
struct Target {
    port: u16,
    /// Set with `--tls`: connections make a TLS handshake with this configuration.
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Target {
    /// A connected socket (blocking), and with `--tls` its session after a completed
    /// handshake.
    fn open(&self) -> anyhow::Result<(TcpStream, Option<kura_tls::TlsSession>)> {
        let mut sock = connect(self.port)?;
        let session = match &self.tls {
            None => None,
            Some(config) => {
                let mut session =
                    kura_tls::TlsSession::client(config, kura_tls::server_name("127.0.0.1")?)?;
                session
                    .handshake(&mut sock)
                    .context("TLS handshake with the server")?;
                Some(session)
            }
        };
        Ok((sock, session))
    }

    fn connect(&self) -> anyhow::Result<Conn> {
        let (sock, session) = self.open()?;
        Ok(Conn { sock, session })
    }
}

/// One blocking client connection, plain or TLS; requests are written and replies read on it
/// by one thread, in turn.
struct Conn {
    sock: TcpStream,
    session: Option<kura_tls::TlsSession>,
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.session {
            None => self.sock.read(buf),
            Some(session) => session.read(&mut self.sock, buf, true),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.session {
            None => self.sock.write(buf),
            Some(session) => {
                session.write_vectored(&mut self.sock, &[std::io::IoSlice::new(buf)])
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.session {
            None => self.sock.flush(),
            Some(session) => session.flush(&mut self.sock),
        }
    }
}

/// `--tls`'s files: a CA, and a certificate for 127.0.0.1 it signed with its key, made with
/// the `openssl` command (as users make theirs); and a client configuration trusting the CA.
struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    client: Arc<rustls::ClientConfig>,
}

impl TlsFiles {
    fn make(dir: &std::path::Path) -> anyhow::Result<Self> {
        let openssl = which("openssl").context("--tls makes its certificate with the openssl command, which is not installed (apt-get install openssl)")?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let ssl = |args: &[&str]| -> anyhow::Result<()> {
            let out = Command::new(&openssl)
                .args(args)
                .current_dir(dir)
                .stdin(Stdio::null())
                .output()
                .context("running openssl")?;
            if !out.status.success() {
                bail!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(())
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        ssl(&[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca-key.pem",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=kura bench ca",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
            ],
        ]
        .concat())?;
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )?;
        ssl(&[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "server-key.pem",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat())?;
        ssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ])?;
        let client = kura_tls::client_config(&kura_tls::ClientTlsOptions {
            ca: Some(dir.join("ca.pem")),
            cert: None,
            key: None,
        })?;
        Ok(Self {
            cert: dir.join("server.pem"),
            key: dir.join("server-key.pem"),
            client,
        })
    }

    /// The `-o` option that gives a server (kura or memcached) the certificate and its key.
    fn server_options(&self) -> String {
        format!(
            "ssl_chain_cert={},ssl_key={}",
            self.cert.display(),
            self.key.display()
        )
    }
}

/// Makes the memory cgroup of `--extstore-memory-cap-mb` and has `cmd`'s process join it
/// before it runs, so that all it ever brings into memory, its file's page cache included,
/// counts. `None`, said on stderr, where no cgroup can be made.
fn memory_cap(cmd: &mut Command, cap_mb: u64) -> Option<kura_bench::memcg::MemoryCap> {
    let cgroup = format!("kura-bench-extstore-{}", std::process::id());
    match kura_bench::memcg::MemoryCap::create(&cgroup, cap_mb << 20) {
        Ok(cap) => {
            cap.join_at_spawn(cmd);
            eprintln!(
                "bench server: memcached_extstore: its memory and page cache capped at {cap_mb} MiB ({})",
                cap.path().display()
            );
            Some(cap)
        }
        Err(error) => {
            eprintln!(
                "bench server: memcached_extstore: not capped ({error}): its reads may come from the page cache, not the disk"
            );
            None
        }
    }
}

/// Pipelined sets: each connection loads its share in batches of `depth`.
fn load(
    target: &Target,
    items: u64,
    value_size: usize,
    connections: usize,
    depth: usize,
) -> anyhow::Result<()> {
    let threads: Vec<_> = (0..connections as u64)
        .map(|c| {
            let target = target.clone();
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut reader = BufReader::new(target.connect()?);
                let mut line = Vec::new();
                let mine: Vec<u64> = (c..items).step_by(connections).collect();
                for batch in mine.chunks(depth) {
                    let mut request = Vec::with_capacity(batch.len() * (value_size + 64));
                    for &i in batch {
                        request.extend_from_slice(
                            format!("set {} 0 0 {value_size}\r\n", key(i)).as_bytes(),
                        );
                        request.extend_from_slice(&value_for(i, value_size));
                        request.extend_from_slice(b"\r\n");
                    }
                    reader.get_mut().write_all(&request)?;
                    for _ in batch {
                        line.clear();
                        reader.read_until(b'\n', &mut line)?;
                        if line != b"STORED\r\n" {
                            bail!("set failed: {:?}", String::from_utf8_lossy(&line));
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
    }
    Ok(())
}

/// Keys the server does not have: one pipelined pass of gets over all of them.
fn missing_keys(
    target: &Target,
    items: u64,
    value_size: usize,
    depth: usize,
) -> anyhow::Result<Vec<u64>> {
    let mut reader = BufReader::with_capacity(256 * 1024, target.connect()?);
    let (mut request, mut line, mut sink) = (Vec::new(), Vec::new(), Vec::new());
    let mut missing = Vec::new();
    let batch = depth.max(16) as u64;
    for start in (0..items).step_by(batch as usize) {
        let end = (start + batch).min(items);
        request.clear();
        for i in start..end {
            request.extend_from_slice(format!("get {}\r\n", key(i)).as_bytes());
        }
        reader.get_mut().write_all(&request)?;
        for i in start..end {
            if !read_get_reply(&mut reader, &mut line, value_size, &mut sink)? {
                missing.push(i);
            }
        }
    }
    Ok(missing)
}

fn paced_sets(target: &Target, keys: &[u64], value_size: usize) -> anyhow::Result<()> {
    let pause = Duration::from_secs_f64(PACED_LOAD_BATCH as f64 / PACED_LOAD_ITEMS_PER_S as f64);
    let mut reader = BufReader::new(target.connect()?);
    let mut line = Vec::new();
    for batch in keys.chunks(PACED_LOAD_BATCH) {
        let started = Instant::now();
        let mut request = Vec::new();
        for &i in batch {
            request.extend_from_slice(format!("set {} 0 0 {value_size}\r\n", key(i)).as_bytes());
            request.extend_from_slice(&value_for(i, value_size));
            request.extend_from_slice(b"\r\n");
        }
        reader.get_mut().write_all(&request)?;
        for _ in batch {
            line.clear();
            reader.read_until(b'\n', &mut line)?;
        }
        std::thread::sleep(pause.saturating_sub(started.elapsed()));
    }
    Ok(())
}

struct Measured {
    ops_per_s: f64,
    hist: LatencyHist,
    hits: u64,
    misses: u64,
}

impl Measured {
    fn hit_ratio(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// Reads one `get` reply; returns whether it was a hit.
fn read_get_reply(
    reader: &mut BufReader<Conn>,
    line: &mut Vec<u8>,
    value_size: usize,
    sink: &mut Vec<u8>,
) -> anyhow::Result<bool> {
    line.clear();
    reader.read_until(b'\n', line)?;
    if line == b"END\r\n" {
        return Ok(false);
    }
    if !line.starts_with(b"VALUE ") {
        bail!("unexpected reply {:?}", String::from_utf8_lossy(line));
    }
    sink.resize(value_size + 2, 0);
    reader.read_exact(sink)?;
    line.clear();
    reader.read_until(b'\n', line)?;
    if line != b"END\r\n" {
        bail!(
            "reply not closed by END: {:?}",
            String::from_utf8_lossy(line)
        );
    }
    Ok(true)
}

fn get_request(rng: &mut StdRng, items: u64, out: &mut Vec<u8>) {
    let i = rng.random_range(0..items);
    out.extend_from_slice(b"get ");
    out.extend_from_slice(key(i).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Peak: every connection keeps `depth` gets in flight (sent as one batch), for `duration`.
fn closed_loop_gets(
    target: &Target,
    items: u64,
    value_size: usize,
    connections: usize,
    depth: usize,
    duration: Duration,
) -> anyhow::Result<Measured> {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let threads: Vec<_> = (0..connections as u64)
        .map(|c| {
            let stop = Arc::clone(&stop);
            let target = target.clone();
            std::thread::spawn(move || -> anyhow::Result<(LatencyHist, u64, u64)> {
                let mut reader = BufReader::with_capacity(256 * 1024, target.connect()?);
                let mut rng = StdRng::seed_from_u64(0x5eed + c);
                let (mut hist, mut hits, mut misses) = (LatencyHist::micros(), 0, 0);
                let (mut request, mut line, mut sink) = (Vec::new(), Vec::new(), Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    request.clear();
                    for _ in 0..depth {
                        get_request(&mut rng, items, &mut request);
                    }
                    let sent = Instant::now();
                    reader.get_mut().write_all(&request)?;
                    for _ in 0..depth {
                        if read_get_reply(&mut reader, &mut line, value_size, &mut sink)? {
                            hits += 1;
                        } else {
                            misses += 1;
                        }
                        hist.record(sent.elapsed());
                    }
                }
                Ok((hist, hits, misses))
            })
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    collect(threads, started)
}

fn collect(
    threads: Vec<std::thread::JoinHandle<anyhow::Result<(LatencyHist, u64, u64)>>>,
    started: Instant,
) -> anyhow::Result<Measured> {
    let mut total = Measured {
        ops_per_s: 0.0,
        hist: LatencyHist::micros(),
        hits: 0,
        misses: 0,
    };
    for t in threads {
        let (hist, hits, misses) = t
            .join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
        total.hist.merge(&hist)?;
        total.hits += hits;
        total.misses += misses;
    }
    total.ops_per_s = (total.hits + total.misses) as f64 / started.elapsed().as_secs_f64();
    Ok(total)
}

/// Offered load: requests leave on a fixed schedule (`rate` per second, spread over the
/// connections in turn) whatever the replies do, and a request's latency runs from its
/// scheduled time to its reply, so queueing anywhere counts. One thread sends (sleeping to
/// each scheduled time) and one thread receives (epoll over every connection), so the client
/// adds two threads, not two per connection, to the cores it shares with the server.
fn open_loop_gets(
    target: &Target,
    items: u64,
    value_size: usize,
    connections: usize,
    rate: f64,
    duration: Duration,
) -> anyhow::Result<Measured> {
    let streams: Arc<Vec<OpenConn>> = Arc::new(
        (0..connections)
            .map(|_| OpenConn::connect(target))
            .collect::<anyhow::Result<Vec<_>>>()?,
    );
    let queues: Arc<Vec<Mutex<VecDeque<Instant>>>> = Arc::new(
        (0..connections)
            .map(|_| Mutex::new(VecDeque::new()))
            .collect(),
    );
    let receiver = {
        let (streams, queues) = (Arc::clone(&streams), Arc::clone(&queues));
        std::thread::spawn(move || receive_all(&streams, &queues, value_size))
    };
    let started = Instant::now();
    let dropped = send_on_schedule(&streams, &queues, items, rate, duration)?;
    let (hist, hits, misses) = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the receiver panicked"))??;
    if dropped > 0 {
        eprintln!(
            "bench server: {dropped} requests not sent: the server fell {OUTSTANDING_MAX} requests behind on a connection"
        );
    }
    // Replies that arrive after the schedule ended (a backlog) count, over the longer time.
    let ops_per_s =
        (hits + misses) as f64 / started.elapsed().as_secs_f64().max(duration.as_secs_f64());
    Ok(Measured {
        ops_per_s,
        hist,
        hits,
        misses,
    })
}

/// Sends gets at their scheduled times; returns how many it skipped because a connection
/// had [`OUTSTANDING_MAX`] unanswered.
fn send_on_schedule(
    streams: &[OpenConn],
    queues: &[Mutex<VecDeque<Instant>>],
    items: u64,
    rate: f64,
    duration: Duration,
) -> anyhow::Result<u64> {
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut rng = StdRng::seed_from_u64(0xabc);
    let mut pending: Vec<Vec<u8>> = vec![Vec::new(); streams.len()];
    let (start, mut sent, mut dropped) = (Instant::now(), 0u64, 0u64);
    let end = start + duration;
    let mut next = start;
    let mut conn = 0;
    while next < end {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let now = Instant::now();
        while next <= now && next < end {
            let mut queue = queues[conn].lock().expect("queue lock");
            if queue.len() >= OUTSTANDING_MAX {
                dropped += 1;
            } else {
                queue.push_back(next);
                get_request(&mut rng, items, &mut pending[conn]);
                sent += 1;
            }
            drop(queue);
            conn = (conn + 1) % streams.len();
            next = start + interval.mul_f64((sent + dropped) as f64);
        }
        for (conn, bytes) in streams.iter().zip(&mut pending) {
            conn.send(bytes)?;
        }
    }
    // What the sockets would not take yet; the sentinel `mn` tells the receiver it has all.
    for (conn, bytes) in streams.iter().zip(&mut pending) {
        bytes.extend_from_slice(b"mn\r\n");
        while !conn.send(bytes)? {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(dropped)
}

/// One open-loop connection, which one thread writes and another reads. With `--tls` both
/// take turns at its session (each holds the lock for one non-blocking read or write), as the
/// session's bytes go both ways (its reads take in the server's session tickets and key
/// updates).
struct OpenConn {
    /// Non-blocking.
    sock: TcpStream,
    tls: Option<Mutex<kura_tls::TlsSession>>,
}

impl OpenConn {
    fn connect(target: &Target) -> anyhow::Result<Self> {
        let (sock, session) = target.open()?;
        sock.set_nonblocking(true)?;
        Ok(Self {
            sock,
            tls: session.map(Mutex::new),
        })
    }

    /// Writes what the socket takes of `bytes` now and drains that much from it; true when
    /// all of it is on its way (with TLS: encrypted and written to the socket whole).
    fn send(&self, bytes: &mut Vec<u8>) -> anyhow::Result<bool> {
        let mut sock = &self.sock;
        let Some(tls) = &self.tls else {
            while !bytes.is_empty() {
                match sock.write(bytes) {
                    Ok(n) => {
                        bytes.drain(..n);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(true);
        };
        let mut session = tls.lock().expect("session lock");
        while !bytes.is_empty() {
            match session.write_vectored(&mut sock, &[std::io::IoSlice::new(bytes)]) {
                Ok(n) => {
                    bytes.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        match session.flush(&mut sock) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads what has arrived into `buf` (`WouldBlock` when nothing has; `Ok(0)`: closed).
    fn receive(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut sock = &self.sock;
        match &self.tls {
            None => sock.read(buf),
            Some(tls) => tls.lock().expect("session lock").read(&mut sock, buf, false),
        }
    }
}

/// One connection's replies being parsed.
struct Incoming {
    /// A descriptor of the connection's socket of its own, registered with epoll: kept open
    /// while it is polled (reads go through the connection's [`OpenConn`]).
    _registered: mio::net::TcpStream,
    buf: Vec<u8>,
    done: bool,
}

/// Receives every connection's replies with epoll until each has sent its closing `MN`.
fn receive_all(
    streams: &[OpenConn],
    queues: &[Mutex<VecDeque<Instant>>],
    value_size: usize,
) -> anyhow::Result<(LatencyHist, u64, u64)> {
    let mut poll = mio::Poll::new()?;
    let mut events = mio::Events::with_capacity(64);
    let mut conns = Vec::new();
    for (i, stream) in streams.iter().enumerate() {
        let mut registered = mio::net::TcpStream::from_std(stream.sock.try_clone()?);
        poll.registry()
            .register(&mut registered, mio::Token(i), mio::Interest::READABLE)?;
        conns.push(Incoming {
            _registered: registered,
            buf: Vec::with_capacity(256 * 1024),
            done: false,
        });
    }
    let (mut hist, mut hits, mut misses) = (LatencyHist::micros(), 0u64, 0u64);
    let mut chunk = vec![0u8; 256 * 1024];
    let deadline = Instant::now() + Duration::from_secs(600);
    while conns.iter().any(|c| !c.done) {
        if Instant::now() > deadline {
            bail!("replies stopped arriving");
        }
        poll.poll(&mut events, Some(Duration::from_millis(100)))?;
        for event in events.iter() {
            let i = event.token().0;
            let conn = &mut conns[i];
            loop {
                match streams[i].receive(&mut chunk) {
                    Ok(0) => bail!("the server closed a connection"),
                    Ok(n) => conn.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.into()),
                }
            }
            let mut at = 0;
            while let Some(reply) = next_reply(&conn.buf[at..], value_size)? {
                at += reply.len;
                match reply.kind {
                    ReplyKind::Noop => conn.done = true,
                    kind => {
                        let scheduled = queues[i].lock().expect("queue lock").pop_front();
                        let Some(scheduled) = scheduled else {
                            bail!("a reply to a request never sent")
                        };
                        hist.record(scheduled.elapsed());
                        if kind == ReplyKind::Hit {
                            hits += 1;
                        } else {
                            misses += 1;
                        }
                    }
                }
            }
            conn.buf.drain(..at);
        }
    }
    Ok((hist, hits, misses))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ReplyKind {
    Hit,
    Miss,
    Noop,
}

struct Reply {
    kind: ReplyKind,
    len: usize,
}

/// The complete reply at the start of `buf`, if all of it is there.
fn next_reply(buf: &[u8], value_size: usize) -> anyhow::Result<Option<Reply>> {
    let Some(eol) = buf.iter().position(|&b| b == b'\n') else {
        return Ok(None);
    };
    let line = &buf[..=eol];
    match line {
        b"END\r\n" => Ok(Some(Reply {
            kind: ReplyKind::Miss,
            len: line.len(),
        })),
        b"MN\r\n" => Ok(Some(Reply {
            kind: ReplyKind::Noop,
            len: line.len(),
        })),
        l if l.starts_with(b"VALUE ") => {
            let len = line.len() + value_size + 2 + b"END\r\n".len();
            if buf.len() < len {
                return Ok(None);
            }
            if &buf[len - 5..len] != b"END\r\n" {
                bail!("reply not closed by END");
            }
            Ok(Some(Reply {
                kind: ReplyKind::Hit,
                len,
            }))
        }
        other => bail!("unexpected reply {:?}", String::from_utf8_lossy(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_framed_whole() {
        let value = b"abcd";
        let mut buf = b"VALUE k 0 4\r\n".to_vec();
        buf.extend_from_slice(value);
        buf.extend_from_slice(b"\r\nEND\r\nEND\r\nMN\r\n");
        let hit = next_reply(&buf, 4).unwrap().unwrap();
        assert!(hit.kind == ReplyKind::Hit && hit.len == 24);
        let miss = next_reply(&buf[24..], 4).unwrap().unwrap();
        assert!(miss.kind == ReplyKind::Miss && miss.len == 5);
        assert!(next_reply(&buf[29..], 4).unwrap().unwrap().kind == ReplyKind::Noop);
        // Incomplete replies wait for more bytes; garbage is an error.
        assert!(next_reply(&buf[..20], 4).unwrap().is_none());
        assert!(next_reply(b"END", 4).unwrap().is_none());
        assert!(next_reply(b"SERVER_ERROR x\r\n", 4).is_err());
    }

    #[test]
    fn keys_and_values_are_stable() {
        assert_eq!(key(7), "bench:000000000007");
        assert_eq!(value_for(1, 20).len(), 20);
        assert_eq!(value_for(1, 20), value_for(1, 20));
        assert_ne!(value_for(1, 20), value_for(2, 20));
    }
}
