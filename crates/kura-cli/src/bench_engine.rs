//! `kura bench engine`: the engine against fio on the same file, in one run.
//!
//! Phases: load (puts from every thread, then sync), reopen, GET hits and GET misses with
//! `queue_depth` reads in flight through io_uring (the engine's split-phase lookup), the
//! in-memory index comparison of the thesis (bit-sliced map vs per-block filters), and fio's
//! random read and sequential write on the same disk as anchors.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use kura_bench::dist::{KeyDistribution, next_existing_key};
use kura_bench::fio::{self, FioJob, FioRw};
use kura_bench::hist::LatencyHist;
use kura_engine::bloom::{BloomFilterMap, SequentialFilters};
use kura_engine::hash::KeyHash;
use kura_engine::{AlignedBuf, Engine, EngineConfig, GetPlan, GetStep, Mode};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use serde_json::json;

use crate::engine_cmd::progress;
use crate::size::ByteSize;

#[derive(Args, Clone)]
pub struct EngineBenchArgs {
    /// Store file, created fresh for the run (on the disk to measure).
    #[arg(long, default_value = "kura-data/bench-engine.kura")]
    path: PathBuf,
    /// Keys loaded.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Value size in bytes.
    #[arg(long, default_value_t = 4096)]
    value_size: usize,
    /// Reads in flight across all threads (fio's iodepth in the anchor).
    #[arg(long, default_value_t = 32)]
    queue_depth: usize,
    /// Threads issuing requests; default: one per CPU.
    #[arg(long)]
    threads: Option<usize>,
    /// Which keys GETs ask for (YCSB's request distributions).
    #[arg(long, default_value = "uniform")]
    distribution: KeyDistribution,
    /// Seconds of each read phase and of each fio anchor.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// Block size of the store.
    #[arg(long, default_value = "8M")]
    block_size: ByteSize,
    /// Key-hash partitions; 0 lets the engine choose from the block count.
    #[arg(long, default_value_t = 0)]
    partitions: u32,
    /// RAM index budget per key.
    #[arg(long, default_value_t = 16)]
    index_bits_per_key: u32,
    /// Fingerprint bits per record in the page index.
    #[arg(long, default_value_t = 9)]
    fingerprint_bits: u32,
    /// Background threads writing sealed blocks.
    #[arg(long, default_value_t = kura_engine::config::SEAL_THREADS_DEFAULT)]
    seal_threads: usize,
    /// Store size; default: the data plus a quarter, plus the journal.
    #[arg(long)]
    size: Option<ByteSize>,
    /// Also draw the results as a PNG bar chart here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the store file afterwards.
    #[arg(long)]
    keep: bool,
    /// Skip the fio anchors (the JSON then lacks them).
    #[arg(long)]
    skip_fio: bool,
    /// Let a lookup with more than one candidate page read the next one beside the first
    /// (the engine's companion read, `GetPlan::companion_read`): one more read when the first
    /// page holds the key, one read time instead of two when it does not. Off by default, as
    /// in kura's server and pool, which read candidates one after another.
    #[arg(long)]
    companion_reads: bool,
}

/// Random bytes values are sliced from, so values are incompressible and checkable.
struct Values {
    pattern: Vec<u8>,
    size: usize,
}

impl Values {
    fn new(size: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(7);
        let mut pattern = vec![0u8; (4 << 20).max(2 * size)];
        rng.fill_bytes(&mut pattern);
        Self { pattern, size }
    }

    fn of(&self, key: u64) -> &[u8] {
        let start = (key.wrapping_mul(4099) % (self.pattern.len() - self.size) as u64) as usize;
        &self.pattern[start..start + self.size]
    }
}

fn key_bytes(key: u64) -> Vec<u8> {
    format!("user{key:012}").into_bytes()
}

fn miss_key_bytes(key: u64) -> Vec<u8> {
    format!("miss{key:012}").into_bytes()
}

pub fn run(args: &EngineBenchArgs) -> anyhow::Result<()> {
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
    if args.queue_depth < threads {
        bail!("--queue-depth must be at least the number of threads ({threads})");
    }
    if let Some(dir) = args.path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&args.path);
    let data_bytes = args.keys * (args.value_size as u64 + 64);
    let size = args.size.map_or(data_bytes + data_bytes / 4 + (512 << 20), |s| s.0);
    let config = EngineConfig {
        block_size_bytes: u32::try_from(args.block_size.0)?,
        partitions: args.partitions,
        index_bits_per_key: args.index_bits_per_key,
        fingerprint_bits: args.fingerprint_bits,
        mode: Some(Mode::Store),
        value_size_max_bytes: args.value_size.max(1024),
        size_bytes: Some(size),
        seal_threads: args.seal_threads,
        ..EngineConfig::default()
    };
    let values = Arc::new(Values::new(args.value_size));

    let engine = Engine::open(&args.path, &config).context("creating the store")?;
    let (put_s, puts) = load(&engine, args.keys, threads, &values)?;
    let loaded = engine.stats();
    drop(engine);
    let t = Instant::now();
    let engine = Engine::open(&args.path, &EngineConfig { size_bytes: None, ..config.clone() })?;
    let reopen_ms = t.elapsed().as_secs_f64() * 1e3;
    let stats = engine.stats();
    let duration = Duration::from_secs(args.duration_s);

    eprintln!("GET hits ({} distribution, queue depth {}, {threads} threads, {} s)", args.distribution, args.queue_depth, args.duration_s);
    let hits = read_phase(&engine, args, threads, duration, Lookup::Hit(Arc::clone(&values)))?;
    eprintln!("GET misses ({} s)", (args.duration_s / 2).max(1));
    let misses = read_phase(&engine, args, threads, (duration / 2).max(Duration::from_secs(1)), Lookup::Miss)?;
    eprintln!("index lookups in RAM");
    let index = index_comparison(&engine, args.keys)?;
    let read_bytes_per_hit = hits.read_bytes as f64 / hits.ops.max(1) as f64;

    let mut out = json!({
        "keys": args.keys,
        "value_size_bytes": args.value_size,
        "distribution": args.distribution.to_string(),
        "queue_depth": args.queue_depth,
        "companion_reads": args.companion_reads,
        "threads": threads,
        "blocks": stats.blocks_used,
        "partitions": stats.partitions,
        "block_size_bytes": args.block_size.0,
        "ram_index_bits_per_key": stats.ram.index_bytes() as f64 * 8.0 / args.keys as f64,
        "ram_index_bytes": stats.ram.index_bytes(),
        "ram_bloom_filter_map_bytes": stats.ram.bloom_filter_map_bytes,
        "ram_page_index_bytes": stats.ram.page_index_bytes,
        "ram_block_table_bytes": stats.ram.block_table_bytes,
        "ram_write_buffer_index_bytes": stats.ram.write_buffer_index_bytes,
        "ram_write_buffer_data_bytes_after_load": loaded.ram.write_buffer_data_bytes,
        "data_bytes": args.keys * args.value_size as u64,
        "flash_reads_per_get_hit": hits.flash_reads as f64 / hits.ops.max(1) as f64,
        "flash_read_bytes_per_get_hit": read_bytes_per_hit,
        "flash_reads_per_get_miss": misses.flash_reads as f64 / misses.ops.max(1) as f64,
        "get_ops_per_s": hits.ops as f64 / hits.elapsed_s,
        "get_p50_us": hits.hist.percentile(50.0),
        "get_p99_us": hits.hist.percentile(99.0),
        "get_miss_ops_per_s": misses.ops as f64 / misses.elapsed_s,
        "get_miss_p99_us": misses.hist.percentile(99.0),
        "put_ops_per_s": puts as f64 / put_s,
        "put_mib_per_s": (puts * args.value_size as u64) as f64 / put_s / f64::from(1 << 20),
        "reopen_ms": reopen_ms,
        "index_blocks": index.blocks,
        "index_lookup_ns_bfm": index.bfm_ns,
        "index_lookup_ns_sequential": index.sequential_ns,
        "index_lookup_ns_engine_partitioned": index.partitioned_ns,
        "index_bfm_speedup": index.sequential_ns / index.bfm_ns,
    });
    if !args.skip_fio {
        // fio reads the blocks the engine wrote: a fresh store fills slots from the first, and
        // the rest of the preallocated file is unwritten (read as zeros without touching the disk).
        let sb = engine.superblock();
        let region = (sb.blocks_offset_bytes, stats.blocks_used * u64::from(sb.block_size_bytes));
        let anchors = fio_anchors(args, region, read_bytes_per_hit, duration)?;
        merge(&mut out, anchors);
        let ratio = |a: &str, b: &str| out[a].as_f64().zip(out[b].as_f64()).map(|(a, b)| a / b);
        let ratios = json!({
            "get_vs_fio_randread": ratio("get_ops_per_s", "fio_randread_ops_per_s"),
            "get_p99_vs_fio_randread_p99": ratio("get_p99_us", "fio_randread_p99_us"),
            "get_vs_fio_randread_at_read_size": ratio("get_ops_per_s", "fio_randread_ops_per_s_at_read_size"),
            "put_vs_fio_seqwrite": ratio("put_mib_per_s", "fio_seqwrite_mib_per_s"),
        });
        out["ratios"] = ratios;
    }
    drop(engine);
    if !args.keep {
        std::fs::remove_file(&args.path).ok();
    }
    if let Some(path) = &args.plot {
        draw(path, &out)?;
    }
    kura_bench::json::emit(&out, args.json.as_deref())?;
    if hits.wrong_values > 0 || hits.missing > 0 {
        bail!("{} wrong values and {} missing keys during the read phase", hits.wrong_values, hits.missing);
    }
    Ok(())
}

fn merge(out: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(out), serde_json::Value::Object(more)) = (out.as_object_mut(), more) {
        out.extend(more);
    }
}

/// Puts every key from `threads` threads (interleaved key numbers), then syncs.
fn load(engine: &Engine, keys: u64, threads: usize, values: &Arc<Values>) -> anyhow::Result<(f64, u64)> {
    let bar = progress(keys, "loading");
    let done = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..threads as u64)
            .map(|id| {
                let (engine, values, done, bar) = (engine.clone(), Arc::clone(values), Arc::clone(&done), bar.clone());
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut key = id;
                    while key < keys {
                        engine.put(&key_bytes(key), values.of(key))?;
                        if done.fetch_add(1, Ordering::Relaxed) % 4096 == 0 {
                            bar.set_position(done.load(Ordering::Relaxed));
                        }
                        key += threads as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("load thread panicked")?;
        }
        Ok(())
    })?;
    engine.sync()?;
    bar.finish_and_clear();
    let elapsed = t.elapsed().as_secs_f64();
    eprintln!("loaded {keys} keys in {elapsed:.1} s");
    Ok((elapsed, keys))
}

#[derive(Clone)]
enum Lookup {
    Hit(Arc<Values>),
    Miss,
}

struct ReadResult {
    ops: u64,
    elapsed_s: f64,
    hist: LatencyHist,
    flash_reads: u64,
    read_bytes: u64,
    wrong_values: u64,
    missing: u64,
}

/// GETs for `duration` from `threads` threads, each keeping its share of `queue_depth`
/// lookups in flight on its own io_uring.
fn read_phase(engine: &Engine, args: &EngineBenchArgs, threads: usize, duration: Duration, lookup: Lookup) -> anyhow::Result<ReadResult> {
    let before = engine.stats();
    let started = Instant::now();
    let results: Vec<anyhow::Result<ThreadReads>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|id| {
                let depth = args.queue_depth / threads + usize::from(id < args.queue_depth % threads);
                let (engine, lookup) = (engine.clone(), lookup.clone());
                let chooser = args.distribution.chooser(args.keys, 0);
                scope.spawn(move || {
                    let chooser = chooser?;
                    reads_on_one_thread(&engine, args, depth, duration, lookup, chooser, id as u64)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("read thread panicked")).collect()
    });
    let elapsed_s = started.elapsed().as_secs_f64();
    let after = engine.stats();
    let mut total = ReadResult { ops: 0, elapsed_s, hist: LatencyHist::micros(), flash_reads: after.flash_reads - before.flash_reads, read_bytes: after.flash_read_bytes - before.flash_read_bytes, wrong_values: 0, missing: 0 };
    for r in results {
        let r = r?;
        total.ops += r.ops;
        total.wrong_values += r.wrong_values;
        total.missing += r.missing;
        total.hist.merge(&r.hist)?;
    }
    Ok(total)
}

struct ThreadReads {
    ops: u64,
    hist: LatencyHist,
    wrong_values: u64,
    missing: u64,
}

/// New reads issued together while a batch of completions is processed.
const SUBMIT_BATCH: usize = 4;

struct InFlight {
    plan: GetPlan,
    started: Instant,
    key: u64,
    /// The bytes of the read the lookup asked for, once read.
    primary: Option<AlignedBuf>,
    /// Its companion read ([`GetPlan::companion_read`]), issued beside it: `Some(None)` while
    /// it is in flight.
    companion: Option<Option<AlignedBuf>>,
}

/// Reads of one lookup: its own (token `2 × slot`) and its companion (`2 × slot + 1`).
fn issue(queue: &mut Box<dyn kura_engine::device::IoQueue>, slot: usize, inflight: &mut InFlight, offset_bytes: u64, len_bytes: usize, companions: bool) -> anyhow::Result<()> {
    queue.submit_read(offset_bytes, AlignedBuf::zeroed(len_bytes), 2 * slot as u64)?;
    inflight.primary = None;
    inflight.companion = None;
    if let Some((offset, len)) = inflight.plan.companion_read().filter(|_| companions) {
        queue.submit_read(offset, AlignedBuf::zeroed(len), 2 * slot as u64 + 1)?;
        inflight.companion = Some(None);
    }
    Ok(())
}

fn reads_on_one_thread(
    engine: &Engine,
    args: &EngineBenchArgs,
    depth: usize,
    duration: Duration,
    lookup: Lookup,
    mut chooser: Box<dyn kura_bench::dist::KeyChooser>,
    seed: u64,
) -> anyhow::Result<ThreadReads> {
    let (keys, companions) = (args.keys, args.companion_reads);
    // Room for every lookup's read and its companion.
    let mut queue = kura_engine::device::io_queue(engine.device(), 2 * depth);
    let mut rng = StdRng::seed_from_u64(0x5eed ^ seed);
    let mut slots: Vec<Option<InFlight>> = (0..depth).map(|_| None).collect();
    let mut out = ThreadReads { ops: 0, hist: LatencyHist::micros(), wrong_values: 0, missing: 0 };
    let deadline = Instant::now() + duration;
    let mut done = Vec::new();
    let finish = |key: u64, started: Instant, item: Option<kura_engine::Item>, out: &mut ThreadReads| {
        out.ops += 1;
        out.hist.record(started.elapsed());
        match (&lookup, item) {
            (Lookup::Hit(values), Some(item)) => out.wrong_values += u64::from(item.value() != values.of(key)),
            (Lookup::Hit(_), None) => out.missing += 1,
            (Lookup::Miss, Some(_)) => out.wrong_values += 1,
            (Lookup::Miss, None) => {}
        }
    };
    // Starts lookups in `slot` until one needs a read (or time is up).
    let mut start = |slot: usize, slots: &mut [Option<InFlight>], queue: &mut Box<dyn kura_engine::device::IoQueue>, out: &mut ThreadReads| -> anyhow::Result<()> {
        while Instant::now() < deadline {
            let key = next_existing_key(chooser.as_mut(), &mut rng, keys - 1);
            let bytes = match lookup {
                Lookup::Hit(_) => key_bytes(key),
                Lookup::Miss => miss_key_bytes(key),
            };
            let started = Instant::now();
            let (plan, step) = engine.get_start(&bytes)?;
            match step {
                GetStep::Done(item) => finish(key, started, item, out),
                GetStep::Read { offset_bytes, len_bytes } => {
                    let mut inflight = InFlight { plan, started, key, primary: None, companion: None };
                    issue(queue, slot, &mut inflight, offset_bytes, len_bytes, companions)?;
                    slots[slot] = Some(inflight);
                    return Ok(());
                }
            }
        }
        Ok(())
    };
    for slot in 0..depth {
        start(slot, &mut slots, &mut queue, &mut out)?;
    }
    while queue.in_flight() > 0 {
        queue.wait(1, &mut done)?;
        for completion in done.drain(..) {
            let slot = (completion.token / 2) as usize;
            let mut inflight = slots[slot].take().expect("completion for an idle slot");
            completion.result.context("read")?;
            if completion.token % 2 == 0 {
                inflight.primary = Some(completion.buf);
            } else {
                inflight.companion = Some(Some(completion.buf));
            }
            // A lookup goes on when its read and its companion (if any) are both back.
            let ready = inflight.primary.is_some() && !matches!(inflight.companion, Some(None));
            if !ready {
                slots[slot] = Some(inflight);
                continue;
            }
            let primary = inflight.primary.take().expect("checked");
            let step = match inflight.companion.take() {
                Some(Some(companion)) => engine.get_continue_with(&mut inflight.plan, primary, companion)?,
                _ => engine.get_continue(&mut inflight.plan, primary)?,
            };
            match step {
                GetStep::Done(item) => {
                    finish(inflight.key, inflight.started, item, &mut out);
                    start(slot, &mut slots, &mut queue, &mut out)?;
                }
                GetStep::Read { offset_bytes, len_bytes } => {
                    issue(&mut queue, slot, &mut inflight, offset_bytes, len_bytes, companions)?;
                    slots[slot] = Some(inflight);
                }
            }
            if queue.unsubmitted() >= SUBMIT_BATCH {
                queue.submit()?;
            }
        }
    }
    Ok(out)
}

struct IndexComparison {
    blocks: usize,
    bfm_ns: f64,
    sequential_ns: f64,
    partitioned_ns: f64,
}

/// The thesis' Fig. 41/44 comparison on this store's blocks: candidate search in one
/// bit-sliced map over every block, against probing every block's filter in turn. Also the
/// engine's own (partitioned) lookup.
fn index_comparison(engine: &Engine, keys: u64) -> anyhow::Result<IndexComparison> {
    const LOOKUPS: u64 = 200_000;
    let filters = engine.block_filters()?;
    let mut map = BloomFilterMap::new();
    let mut sequential = SequentialFilters::default();
    for (id, filter) in &filters {
        map.insert(*id, filter);
        sequential.push(*id, filter.clone());
    }
    let mut rng = StdRng::seed_from_u64(11);
    let keys: Vec<Vec<u8>> = (0..LOOKUPS).map(|_| key_bytes(rng.next_u64() % keys)).collect();
    let hashes: Vec<KeyHash> = keys.iter().map(|k| KeyHash::of(k)).collect();
    let mut found = Vec::new();
    let time = |f: &mut dyn FnMut(&KeyHash, &mut Vec<u32>), found: &mut Vec<u32>| {
        let t = Instant::now();
        let mut candidates = 0usize;
        for h in &hashes {
            found.clear();
            f(h, found);
            candidates += std::hint::black_box(found.len());
        }
        (t.elapsed().as_nanos() as f64 / LOOKUPS as f64, candidates)
    };
    let (bfm_ns, bfm_candidates) = time(&mut |h, out| map.candidates(h, out), &mut found);
    let (sequential_ns, seq_candidates) = time(&mut |h, out| sequential.candidates(h, out), &mut found);
    if bfm_candidates != seq_candidates {
        bail!("the bit-sliced map and the per-block filters disagree ({bfm_candidates} vs {seq_candidates} candidates)");
    }
    let t = Instant::now();
    for k in &keys {
        found.clear();
        engine.bfm_candidates(k, &mut found);
        std::hint::black_box(found.len());
    }
    let partitioned_ns = t.elapsed().as_nanos() as f64 / LOOKUPS as f64;
    Ok(IndexComparison { blocks: filters.len(), bfm_ns, sequential_ns, partitioned_ns })
}

/// fio on the same disk: 4 KiB random reads of the store file at the same queue depth, the
/// same at the engine's actual read size, and sequential writes of a scratch file.
fn fio_anchors(args: &EngineBenchArgs, (offset, size): (u64, u64), read_bytes_per_hit: f64, duration: Duration) -> anyhow::Result<serde_json::Value> {
    let file_size = std::fs::metadata(&args.path)?.len();
    let randread = |bs: u64| -> anyhow::Result<fio::FioSide> {
        eprintln!("fio: {bs}-byte random reads of the {} MiB the engine wrote, iodepth {}", size >> 20, args.queue_depth);
        let job = FioJob {
            name: "kura-anchor-randread".into(),
            filename: args.path.clone(),
            rw: FioRw::RandRead,
            bs_bytes: bs,
            size_bytes: size,
            iodepth: args.queue_depth as u32,
            runtime_s: Some(duration.as_secs()),
            time_based: true,
            extra_args: vec![format!("--offset={offset}"), "--blockalign=512".into(), "--norandommap".into()],
            ..FioJob::default()
        };
        fio::run(&job)?.read.context("fio reported no reads")
    };
    let four_k = randread(4096)?;
    let read_size = ((read_bytes_per_hit / 512.0).round() as u64 * 512).max(512);
    let at_size = if read_size == 4096 { four_k.clone() } else { randread(read_size)? };
    let scratch = scratch_path(&args.path);
    eprintln!("fio: sequential 1 MiB writes, iodepth 8");
    let job = FioJob {
        name: "kura-anchor-seqwrite".into(),
        filename: scratch.clone(),
        rw: FioRw::Write,
        bs_bytes: 1 << 20,
        size_bytes: file_size.min(4 << 30),
        iodepth: 8,
        runtime_s: Some(duration.as_secs()),
        time_based: true,
        ..FioJob::default()
    };
    let seq = fio::run(&job);
    std::fs::remove_file(&scratch).ok();
    let seq = seq?.write.context("fio reported no writes")?;
    Ok(json!({
        "fio_randread_ops_per_s": four_k.iops,
        "fio_randread_p50_us": four_k.lat_us_p50,
        "fio_randread_p99_us": four_k.lat_us_p99,
        "fio_randread_read_size_bytes": read_size,
        "fio_randread_ops_per_s_at_read_size": at_size.iops,
        "fio_randread_p99_us_at_read_size": at_size.lat_us_p99,
        "fio_seqwrite_mib_per_s": seq.bw_mib_s,
    }))
}

fn scratch_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".fio-seqwrite");
    path.with_file_name(name)
}

fn draw(path: &Path, out: &serde_json::Value) -> anyhow::Result<()> {
    let get = |k: &str| out[k].as_f64().unwrap_or(0.0);
    let mut bars = vec![("kura GET".to_string(), get("get_ops_per_s"))];
    if out.get("fio_randread_ops_per_s").is_some() {
        bars.push(("fio 4K randread".into(), get("fio_randread_ops_per_s")));
        bars.push((format!("fio {}B randread", get("fio_randread_read_size_bytes")), get("fio_randread_ops_per_s_at_read_size")));
    }
    let title = format!("kura engine: {} keys x {} B, queue depth {}", out["keys"], out["value_size_bytes"], out["queue_depth"]);
    kura_bench::plot::bar_plot(path, &title, "operations per second", &bars)?;
    let mut lat = vec![("kura GET p50".to_string(), get("get_p50_us")), ("kura GET p99".to_string(), get("get_p99_us"))];
    if out.get("fio_randread_p99_us").is_some() {
        lat.push(("fio 4K p50".into(), get("fio_randread_p50_us")));
        lat.push(("fio 4K p99".into(), get("fio_randread_p99_us")));
    }
    let lat_path = path.with_file_name(format!("{}-latency.png", path.file_stem().and_then(|s| s.to_str()).unwrap_or("engine")));
    kura_bench::plot::bar_plot(&lat_path, &format!("{title}: latency"), "microseconds", &lat)?;
    let mut index = vec![("bit-sliced map".to_string(), get("index_lookup_ns_bfm")), ("per-block filters".to_string(), get("index_lookup_ns_sequential"))];
    index.push(("engine (partitioned)".into(), get("index_lookup_ns_engine_partitioned")));
    let index_path = path.with_file_name(format!("{}-index.png", path.file_stem().and_then(|s| s.to_str()).unwrap_or("engine")));
    kura_bench::plot::bar_plot(&index_path, &format!("in-memory index lookup, {} blocks", out["index_blocks"]), "nanoseconds per lookup", &index)?;
    Ok(())
}
