//! `kura bench pool`: the pool client against each backend — embedded engine, a kura server,
//! stock memcached, redis-server — and, in the same run, the standard load tools against the
//! same servers at the same concurrency: memaslap (Debian ships it as `memcaslap`, in
//! libmemcached-tools) against memcached, `redis-benchmark` against redis. (memaslap cannot
//! run against kura: its keys begin with control bytes, which kura refuses.)
//!
//! Concurrency is requests in flight: the pool keeps `--depth` requests in flight per thread
//! on one connection per node (pipelined); redis-benchmark gets `-c <threads> -P <depth>`;
//! memaslap, which cannot pipeline, gets `<threads> × <depth>` connections (`-c`).
//!
//! Per backend: load every key (4 KiB values), random sets for the set phase, then rounds of
//! random gets (values checked) each followed by the standard tool; the median round of each
//! is reported (and every round), the ratio as the median of each round's pool/tool pair,
//! latency from submit to completion over all rounds, and the client's requests per
//! send/receive syscall during the gets.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use kura_bench::hist::LatencyHist;
use kura_bench::host::{free_tcp_port, median, which};
use kura_pool::{IoStats, Outcome, Pool, PoolConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

#[derive(Args, Clone, Debug)]
pub struct PoolBenchArgs {
    /// Backends to measure, of embedded, kura, memcached, redis.
    #[arg(long, value_delimiter = ',', default_value = "embedded,kura,memcached,redis")]
    backends: Vec<String>,
    /// Keys loaded (each with a value of --value-size bytes).
    #[arg(long, default_value_t = 32_768)]
    keys: u64,
    #[arg(long, default_value_t = 4096)]
    value_size: usize,
    /// Client threads, each with its own context (and the standard tools' clients/threads).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Requests in flight per thread.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Seconds of each set and get phase (and of each standard tool's run).
    #[arg(long, default_value_t = 3)]
    duration_s: u64,
    /// Get phases per backend, each followed by the standard tool's run; medians are reported,
    /// and the ratio is the median of each round's pool/tool pair (adjacent runs share the
    /// machine's luck).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Worker threads of the servers (kura -t, memcached -t).
    #[arg(long, default_value_t = 1)]
    server_threads: usize,
    /// Directory for the embedded store and kura's store.
    #[arg(long, default_value = "kura-data/bench-pool")]
    dir: PathBuf,
    /// Skip the standard tools.
    #[arg(long)]
    skip_tools: bool,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

const BACKENDS: [&str; 4] = ["embedded", "kura", "memcached", "redis"];
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// `key:%012d`: redis-benchmark's key names (`-r`), so its GETs find what the pool loaded.
fn key(i: u64) -> [u8; 16] {
    let mut k = *b"key:000000000000";
    let mut n = i;
    for d in k[4..].iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    k
}

/// A value whose first 8 bytes name its key (checked on every get).
fn value(i: u64, size: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..size).map(|j| (j as u64).wrapping_mul(31).wrapping_add(i) as u8).collect();
    let n = size.min(8);
    v[..n].copy_from_slice(&i.to_le_bytes()[..n]);
    v
}

pub fn run(args: &PoolBenchArgs) -> anyhow::Result<()> {
    if args.threads == 0 || args.depth == 0 || args.keys == 0 || args.value_size < 8 {
        bail!("--threads, --depth and --keys must be above 0 and --value-size at least 8");
    }
    for b in &args.backends {
        if !BACKENDS.contains(&b.as_str()) {
            bail!("unknown backend {b:?}; use {}", BACKENDS.join(", "));
        }
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let mut results = serde_json::Map::new();
    for name in BACKENDS.iter().filter(|b| args.backends.iter().any(|a| a == *b)) {
        eprintln!("bench pool: {name}");
        results.insert(name.to_string(), measure(name, args)?);
    }
    // The median over rounds of (pool rate / the tool's rate in the run right after it).
    let ratio = |backend: &str| -> Value { results.get(backend).map_or(Value::Null, |r| r["get_over_tool_paired_median"].clone()) };
    let in_flight = args.threads * args.depth;
    let report = json!({
        "bench": "pool",
        "config": {
            "keys": args.keys, "value_size_bytes": args.value_size, "threads": args.threads, "depth_per_thread": args.depth,
            "requests_in_flight": in_flight, "duration_s": args.duration_s, "rounds": args.rounds, "server_threads": args.server_threads,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "backends": Value::Object(results.clone()),
        "ratios": {
            "memcached_get_over_memaslap": ratio("memcached"),
            "redis_get_over_redis_benchmark": ratio("redis"),
        },
        "notes": "requests_per_syscall = (requests sent + replies read) / (send + receive syscalls) during the get phase; \
                  epoll_wait calls are counted apart (polls_per_request). Embedded: reads submitted and completed per \
                  io_uring submit/wait (gets answered from RAM need none). memaslap cannot pipeline: it gets \
                  threads x depth connections for the same number of requests in flight.",
    });
    kura_bench::json::emit(&report, args.json.as_deref())?;
    Ok(())
}

/// A server process, stopped (SIGTERM, then SIGKILL) on drop.
struct Server {
    port: u16,
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(name: &str, args: &PoolBenchArgs) -> anyhow::Result<Server> {
    let port = free_tcp_port()?;
    let data_mb = (args.keys * (args.value_size as u64 + 128)) >> 20;
    let threads = args.server_threads.to_string();
    let mut cmd = match name {
        "kura" => {
            let path = args.dir.join("kura.kura");
            let _ = std::fs::remove_file(&path);
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["serve", "-p", &port.to_string(), "-t", &threads, "-m", "64", "--mode", "store", "--size", &format!("{}M", data_mb * 3 + 1024), "--path"]).arg(path);
            cmd
        }
        "memcached" => {
            let mut cmd = Command::new("memcached");
            // Room for the pool's keys and for memaslap's own (it loads threads x depth x 1k).
            let tool_mb = ((args.threads * args.depth * 1024) as u64 * (args.value_size as u64 + 128)) >> 20;
            let mb = (data_mb + tool_mb) * 3 / 2 + 64;
            cmd.args(["-u", "root", "-U", "0", "-l", "127.0.0.1", "-p", &port.to_string(), "-t", &threads, "-c", "4096", "-m", &mb.to_string()]);
            cmd
        }
        "redis" => {
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"]);
            cmd.current_dir(&args.dir);
            cmd
        }
        _ => unreachable!("checked"),
    };
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    let mut server = Server { port, child: cmd.spawn().with_context(|| format!("starting {name} (./scripts/test.sh installs the servers)"))? };
    let deadline = Instant::now() + START_TIMEOUT;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = server.child.try_wait()? {
            bail!("{name} exited at start: {status}");
        }
        if Instant::now() > deadline {
            bail!("{name} did not accept connections within {START_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(server)
}

fn measure(name: &str, args: &PoolBenchArgs) -> anyhow::Result<Value> {
    let server = if name == "embedded" { None } else { Some(start(name, args)?) };
    let pool = match &server {
        None => {
            let path = args.dir.join("embedded.kura");
            let _ = std::fs::remove_file(&path);
            let size = args.keys * (args.value_size as u64 + 128) * 3 + (1 << 30);
            Pool::open(PoolConfig::embedded(&path, size))?
        }
        Some(s) => Pool::open(PoolConfig::from_urls(&[format!("{}://127.0.0.1:{}", if name == "kura" { "kura" } else { name }, s.port)])?)?,
    };
    let load_started = Instant::now();
    phase(&pool, args, Phase::Load, Duration::ZERO)?;
    let load_s = load_started.elapsed().as_secs_f64();
    let duration = Duration::from_secs(args.duration_s);
    let sets = phase(&pool, args, Phase::Set, duration)?;
    let mut gets: Option<PhaseResult> = None;
    let (mut get_rates, mut tool_rates) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        let round = phase(&pool, args, Phase::Get, duration)?;
        get_rates.push(round.ops_per_s().round());
        if !args.skip_tools
            && let Some(server) = &server
        {
            // Not against kura: memaslap's keys start with control bytes (0x10), which kura refuses.
            let tool = match name {
                "memcached" => Some(memaslap(server.port, args)),
                "redis" => Some(redis_benchmark(server.port, args, round.ops_per_s())),
                _ => None,
            };
            if let Some(tool) = tool {
                match tool {
                    Ok(rate) => tool_rates.push(rate.round()),
                    Err(e) => eprintln!("bench pool: standard tool failed: {e:#}"),
                }
            }
        }
        gets = Some(match gets {
            None => round,
            Some(mut all) => {
                all.ops += round.ops;
                all.elapsed_s += round.elapsed_s;
                all.wrong += round.wrong;
                all.missing += round.missing;
                all.io.add(&round.io);
                all.hist.merge(&round.hist)?;
                all
            }
        });
    }
    let gets = gets.expect("at least one round");
    if gets.wrong > 0 || gets.missing > 0 {
        bail!("{name}: {} wrong values and {} missing keys in the get phase", gets.wrong, gets.missing);
    }
    let mut out = json!({
        "get_4k_ops_per_s": median(&get_rates),
        "get_4k_ops_per_s_rounds": get_rates,
        "set_4k_ops_per_s": sets.ops_per_s().round(),
        "get_4k_p50_us": gets.hist.percentile(50.0),
        "get_4k_p99_us": gets.hist.percentile(99.0),
        "set_4k_p99_us": sets.hist.percentile(99.0),
        "requests_per_syscall": round2(gets.io.requests_per_syscall()),
        "requests_per_send_syscall": round2(gets.io.requests_per_send()),
        "replies_per_recv_syscall": round2(gets.io.replies_per_recv()),
        "polls_per_request": round3(gets.io.polls as f64 / gets.ops.max(1) as f64),
        "set_requests_per_syscall": round2(sets.io.requests_per_syscall()),
        "load_ops_per_s": (args.keys as f64 / load_s).round(),
    });
    let tool_field = match name {
        "memcached" => Some("memaslap_get_4k_ops_per_s"),
        "redis" => Some("redis_benchmark_get_4k_ops_per_s"),
        _ => None,
    };
    if let Some(field) = tool_field.filter(|_| !tool_rates.is_empty()) {
        out[field] = json!(median(&tool_rates));
        // Each round's pool rate over the tool's run right after it (the same luck on a shared
        // machine), then the median of those ratios.
        let paired: Vec<f64> = get_rates.iter().zip(&tool_rates).filter(|(_, t)| **t > 0.0).map(|(g, t)| g / t).collect();
        out["get_over_tool_paired_median"] = json!(round3(median(&paired)));
        out[format!("{field}_rounds")] = json!(tool_rates);
    }
    drop(pool);
    drop(server);
    let _ = std::fs::remove_file(args.dir.join("embedded.kura"));
    let _ = std::fs::remove_file(args.dir.join("kura.kura"));
    Ok(out)
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Every key once (thread t takes keys t, t + threads, ...), then a flush.
    Load,
    Set,
    Get,
}

struct PhaseResult {
    ops: u64,
    elapsed_s: f64,
    hist: LatencyHist,
    io: IoStats,
    wrong: u64,
    missing: u64,
}

impl PhaseResult {
    fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.elapsed_s
    }
}

fn phase(pool: &Pool, args: &PoolBenchArgs, phase: Phase, duration: Duration) -> anyhow::Result<PhaseResult> {
    let started = Instant::now();
    let results: Vec<anyhow::Result<PhaseResult>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.threads).map(|t| scope.spawn(move || one_thread(pool, args, phase, duration, t))).collect();
        workers.into_iter().map(|w| w.join().expect("bench thread panicked")).collect()
    });
    let mut total = PhaseResult { ops: 0, elapsed_s: started.elapsed().as_secs_f64(), hist: LatencyHist::micros(), io: IoStats::default(), wrong: 0, missing: 0 };
    for r in results {
        let r = r?;
        total.ops += r.ops;
        total.wrong += r.wrong;
        total.missing += r.missing;
        total.io.add(&r.io);
        total.hist.merge(&r.hist)?;
    }
    Ok(total)
}

/// One context keeping `depth` requests in flight until the deadline (or, loading, until
/// its share of the keys is written).
fn one_thread(pool: &Pool, args: &PoolBenchArgs, phase: Phase, duration: Duration, t: usize) -> anyhow::Result<PhaseResult> {
    let mut ctx = pool.context()?;
    let mut rng = StdRng::seed_from_u64(0x6b75_7261 ^ t as u64);
    let values: Vec<Vec<u8>> = (0..256).map(|i| value(i, args.value_size)).collect();
    let mut scratch = vec![0u8; args.value_size];
    let mut started = vec![Instant::now(); args.depth];
    let mut free: Vec<usize> = (0..args.depth).collect();
    let mut out = PhaseResult { ops: 0, elapsed_s: 0.0, hist: LatencyHist::micros(), io: IoStats::default(), wrong: 0, missing: 0 };
    let mut next_load = t as u64;
    let refill_min = std::env::var("KURA_BENCH_REFILL").ok().and_then(|v| v.parse().ok()).unwrap_or((args.depth / 4).max(1));
    let deadline = Instant::now() + duration;
    let before = ctx.io_stats();
    let begin = Instant::now();
    loop {
        let more = match phase {
            Phase::Load => next_load < args.keys,
            _ => Instant::now() < deadline,
        };
        // Refill once a quarter of the window is free, so requests leave in batches (as
        // redis-benchmark's -P sends them) rather than a few at a time.
        let refill = more && free.len() >= refill_min;
        while refill && let Some(slot) = free.pop() {
            let k = match phase {
                Phase::Load => {
                    let k = next_load;
                    next_load += args.threads as u64;
                    if k >= args.keys {
                        free.push(slot);
                        break;
                    }
                    k
                }
                _ => rng.random_range(0..args.keys),
            };
            let token = (k << 16) | slot as u64;
            started[slot] = Instant::now();
            // Values cycle through 256 patterns: key k's value is pattern k % 256 with k in front.
            let submitted = if phase == Phase::Get {
                ctx.submit_get(&key(k), token)
            } else {
                scratch.copy_from_slice(&values[(k % 256) as usize]);
                scratch[..8].copy_from_slice(&k.to_le_bytes());
                ctx.submit_set(&key(k), &scratch, token)
            };
            submitted?;
        }
        if ctx.in_flight() == 0 {
            break;
        }
        let mut failure = None;
        ctx.poll(None, &mut |c| {
            let slot = (c.token & 0xffff) as usize;
            let k = c.token >> 16;
            out.hist.record(started[slot].elapsed());
            out.ops += 1;
            free.push(slot);
            match c.result {
                Ok(Outcome::Value(v)) => {
                    let want = &values[(k % 256) as usize];
                    if v.len() != want.len() || v[..8] != k.to_le_bytes() || v[8..] != want[8..] {
                        out.wrong += 1;
                    }
                }
                Ok(Outcome::Missing) => out.missing += 1,
                Ok(Outcome::Done) => {}
                Err(e) => failure = Some(e),
            }
        })?;
        if let Some(e) = failure {
            return Err(e.into());
        }
    }
    if phase == Phase::Load {
        ctx.flush()?;
    }
    out.elapsed_s = begin.elapsed().as_secs_f64();
    out.io = ctx.io_stats().since(&before);
    Ok(out)
}

/// memaslap (`memcaslap` on Debian 12) with 100% gets of 4 KiB values over its own keys,
/// `threads x depth` connections; the GET rate is its "Get Statistics" global TPS.
fn memaslap(port: u16, args: &PoolBenchArgs) -> anyhow::Result<f64> {
    let bin = ["memcaslap", "memaslap"].into_iter().find(|b| which(b).is_some()).context("memaslap (memcaslap) is not installed: libmemcached-tools")?;
    let config = args.dir.join("memaslap.cfg");
    std::fs::write(&config, format!("key\n16 16 1\nvalue\n{0} {0} 1\ncmd\n0 0.0\n1 1.0\n", args.value_size))?;
    let concurrency = (args.threads * args.depth).to_string();
    let time = format!("{}s", args.duration_s);
    eprintln!("bench pool: {bin} -T {} -c {concurrency} -t {time}", args.threads);
    let out = Command::new(bin)
        .args(["-s", &format!("127.0.0.1:{port}"), "-T", &args.threads.to_string(), "-c", &concurrency, "-t", &time, "-w", "1k", "-S", "1s", "-F"])
        .arg(&config)
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_memaslap(&text).with_context(|| format!("no Get Statistics in memaslap's output: {}", text.chars().take(400).collect::<String>()))
}

/// The TPS of the last "Global" line under "Get Statistics".
fn parse_memaslap(text: &str) -> Option<f64> {
    let mut in_get = false;
    let mut last = None;
    for line in text.lines() {
        if line.contains("Get Statistics") {
            in_get = true;
        } else if line.contains("Statistics") {
            in_get = false;
        } else if in_get && line.trim_start().starts_with("Global") {
            last = line.split_whitespace().nth(3).and_then(|tps| tps.parse().ok());
        }
    }
    last
}

/// `redis-benchmark -t get -d <size> -P <depth> -c <threads> -r <keys>` over the keys the
/// pool loaded, for about the same duration as the pool's get phase.
fn redis_benchmark(port: u16, args: &PoolBenchArgs, pool_rate: f64) -> anyhow::Result<f64> {
    let requests = ((pool_rate * args.duration_s as f64) as u64).max(100_000);
    eprintln!("bench pool: redis-benchmark -t get -P {} -c {} -n {requests}", args.depth, args.threads);
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-t", "get", "-d", &args.value_size.to_string(), "-P", &args.depth.to_string(), "-c", &args.threads.to_string()])
        .args(["-r", &args.keys.to_string(), "-n", &requests.to_string(), "--csv"])
        .stdin(Stdio::null())
        .output()
        .context("redis-benchmark (redis-tools)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_redis_benchmark(&text).with_context(|| format!("no GET line in redis-benchmark's output: {text}"))
}

fn parse_redis_benchmark(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("\"GET\""))?;
    line.split(',').nth(1)?.trim_matches('"').parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_tools() {
        let memaslap = "Get Statistics\nType  Time(s)  Ops  TPS(ops/s)  Net(M/s)\nPeriod   1   57641   57641   226.0\nGlobal   4   211711   52927   207.6\n\
                        Total Statistics\nGlobal   4   211711   99999   207.6\nGet Statistics\nGlobal   5   258226   51645   202.5\n";
        assert_eq!(parse_memaslap(memaslap), Some(51645.0));
        assert_eq!(parse_memaslap("nothing"), None);
        let redis = "\"test\",\"rps\",\"avg_latency_ms\"\n\"GET\",\"268096.53\",\"0.088\"\n";
        assert_eq!(parse_redis_benchmark(redis), Some(268096.53));
    }

    #[test]
    fn values_name_their_keys() {
        let v = value(300, 4096);
        assert_eq!(v.len(), 4096);
        assert_eq!(&v[..8], &300u64.to_le_bytes());
        assert_eq!(&key(7), b"key:000000000007");
        assert_eq!(&key(123_456_789_012), b"key:123456789012");
    }
}
