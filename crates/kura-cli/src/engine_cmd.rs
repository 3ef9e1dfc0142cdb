//! `kura engine …`: create, inspect and exercise an embedded store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kura_engine::{Device, Engine, EngineConfig, FileDevice, FileDeviceOptions, Mode, Stats};

use crate::size::ByteSize;

#[derive(Subcommand)]
pub enum EngineCommand {
    /// Open (or create) a store and run a short demonstration load, then print a summary.
    Demo(DemoArgs),
    /// Print a store's statistics as JSON.
    Stats {
        /// The store file or device.
        #[arg(long, default_value = DEFAULT_PATH)]
        path: PathBuf,
    },
    /// Format a file or raw block device as a new, empty store (erases what it held).
    Format(FormatArgs),
}

pub const DEFAULT_PATH: &str = "kura-data/engine.kura";

/// Space policy when full.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ModeArg {
    /// Drop the oldest block whole; writes never wait for space.
    Cache,
    /// Never drop data; reclaim dead space by garbage collection; refuse writes when live
    /// data fills the device.
    Store,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Cache => Mode::Cache,
            ModeArg::Store => Mode::Store,
        }
    }
}

/// Store geometry, used when a store is created.
#[derive(Args, Clone)]
pub struct GeometryArgs {
    /// Size of a newly created store file.
    #[arg(long, default_value = "1G")]
    pub size: ByteSize,
    /// Space policy (fixed when the store is created).
    #[arg(long, value_enum, default_value = "cache")]
    pub mode: ModeArg,
    /// Block (segment) size: the unit written at once and dropped or collected whole.
    #[arg(long, default_value = "8M")]
    pub block_size: ByteSize,
    /// Page size (a multiple of 4 KiB).
    #[arg(long, default_value = "4K")]
    pub page_size: ByteSize,
    /// Key-hash partitions (independent write streams); 0 derives it from the block count.
    #[arg(long, default_value_t = 0)]
    pub partitions: u32,
    /// RAM index budget per key (Bloom filter and page index bits).
    #[arg(long, default_value_t = 16)]
    pub index_bits_per_key: u32,
    /// Largest value accepted.
    #[arg(long, default_value = "1M")]
    pub value_size_max: ByteSize,
    /// Use buffered I/O instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
}

impl GeometryArgs {
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        let to_u32 = |b: ByteSize, what: &str| u32::try_from(b.0).with_context(|| format!("{what} too large"));
        Ok(EngineConfig {
            page_size_bytes: to_u32(self.page_size, "page size")?,
            block_size_bytes: to_u32(self.block_size, "block size")?,
            partitions: self.partitions,
            index_bits_per_key: self.index_bits_per_key,
            mode: Some(self.mode.into()),
            value_size_max_bytes: usize::try_from(self.value_size_max.0)?,
            size_bytes: Some(self.size.0),
            direct_io: !self.buffered,
            ..EngineConfig::default()
        })
    }
}

#[derive(Args)]
pub struct DemoArgs {
    /// The store file (created with the geometry below if it does not exist).
    #[arg(long, default_value = DEFAULT_PATH)]
    path: PathBuf,
    /// Keys to write.
    #[arg(long, default_value_t = 200_000)]
    keys: u32,
    /// Value size in bytes.
    #[arg(long, default_value_t = 1000)]
    value_size: usize,
    #[command(flatten)]
    geometry: GeometryArgs,
}

#[derive(Args)]
pub struct FormatArgs {
    /// The file or raw block device to format.
    #[arg(long)]
    path: PathBuf,
    #[command(flatten)]
    geometry: GeometryArgs,
}

pub fn run(command: EngineCommand) -> anyhow::Result<()> {
    match command {
        EngineCommand::Demo(args) => demo(&args),
        EngineCommand::Stats { path } => {
            let engine = open_existing(&path)?;
            println!("{}", serde_json::to_string_pretty(&stats_json(&engine.stats()))?);
            Ok(())
        }
        EngineCommand::Format(args) => {
            let config = args.geometry.config()?;
            let options = FileDeviceOptions { create: true, size_bytes: Some(args.geometry.size.0), direct_io: config.direct_io };
            let device = FileDevice::open(&args.path, &options).with_context(|| format!("opening {}", args.path.display()))?;
            let engine = Engine::create(Arc::new(device) as Arc<dyn Device>, &config)?;
            let sb = engine.superblock();
            eprintln!("formatted {}: {} blocks of {}, {} partitions, {:?} mode", args.path.display(), sb.block_count, ByteSize(u64::from(sb.block_size_bytes)), sb.partitions, sb.mode);
            Ok(())
        }
    }
}

pub fn open_existing(path: &Path) -> anyhow::Result<Engine> {
    let config = EngineConfig { size_bytes: None, ..EngineConfig::default() };
    Engine::open(path, &config).with_context(|| format!("opening {}", path.display()))
}

fn demo(args: &DemoArgs) -> anyhow::Result<()> {
    if let Some(dir) = args.path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let config = args.geometry.config()?;
    let started = Instant::now();
    let engine = Engine::open(&args.path, &config).with_context(|| format!("opening {}", args.path.display()))?;
    eprintln!("opened {} in {} ms", args.path.display(), started.elapsed().as_millis());
    let value = |i: u32| -> Vec<u8> { (0..args.value_size).map(|j| (i as usize * 31 + j) as u8).collect() };
    let key = |i: u32| format!("demo:{i:010}");

    let bar = progress(u64::from(args.keys), "writing");
    let t = Instant::now();
    for i in 0..args.keys {
        engine.put(key(i).as_bytes(), &value(i))?;
        if i % 1024 == 0 {
            bar.set_position(u64::from(i));
        }
    }
    engine.sync()?;
    bar.finish_and_clear();
    let put_s = t.elapsed().as_secs_f64();

    let before = engine.stats();
    let t = Instant::now();
    let mut found = 0u32;
    for i in 0..args.keys {
        if let Some(item) = engine.get(key(i).as_bytes())? {
            if item.value() != value(i) {
                bail!("key {} read back a wrong value", key(i));
            }
            found += 1;
        }
    }
    let get_s = t.elapsed().as_secs_f64();
    let after = engine.stats();
    for i in (0..args.keys).step_by(10) {
        engine.delete(key(i).as_bytes())?;
    }
    drop(engine);
    let t = Instant::now();
    let engine = open_existing(&args.path)?;
    let reopen_ms = t.elapsed().as_secs_f64() * 1e3;
    let deleted_gone = (0..args.keys).step_by(10).take(1000).all(|i| engine.get(key(i).as_bytes()).map(|v| v.is_none()).unwrap_or(false));
    let kept = (1..args.keys).step_by(10).take(1000).all(|i| engine.get(key(i).as_bytes()).ok().flatten().is_some_and(|v| v.value() == value(i)));
    let stats = engine.stats();

    let reads = after.flash_reads - before.flash_reads;
    println!("kura engine demo: {}", args.path.display());
    println!("  wrote    {} keys of {} bytes in {:.2} s ({:.0} puts/s, {:.1} MiB/s)", args.keys, args.value_size, put_s, f64::from(args.keys) / put_s, f64::from(args.keys) * args.value_size as f64 / put_s / (1 << 20) as f64);
    println!("  read     {found} of them back in {get_s:.2} s ({:.0} gets/s, {:.2} flash reads per get)", f64::from(args.keys) / get_s, reads as f64 / f64::from(args.keys));
    println!("  deleted  every 10th key; reopened in {reopen_ms:.1} ms: deletions kept {deleted_gone}, other values intact {kept}");
    println!("  store    {} of {} blocks used, {} partitions, ~{} live keys", stats.blocks_used, stats.blocks_total, stats.partitions, stats.keys_estimate);
    println!("  RAM      {:.1} index bits per key (Bloom Filter Map {} KiB, page index {} KiB)", stats.ram.index_bytes() as f64 * 8.0 / stats.keys_estimate.max(1) as f64, stats.ram.bloom_filter_map_bytes >> 10, stats.ram.page_index_bytes >> 10);
    if found != args.keys && matches!(args.geometry.mode, ModeArg::Store) {
        bail!("{} keys missing in store mode", args.keys - found);
    }
    if !deleted_gone || !kept {
        bail!("data did not survive the reopen as written");
    }
    Ok(())
}

pub fn progress(len: u64, message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})").expect("template").progress_chars("=> "));
    bar.set_message(message);
    bar
}

pub fn stats_json(s: &Stats) -> serde_json::Value {
    serde_json::json!({
        "keys_estimate": s.keys_estimate,
        "records": s.records,
        "blocks_total": s.blocks_total,
        "blocks_used": s.blocks_used,
        "blocks_free": s.blocks_free,
        "partitions": s.partitions,
        "capacity_bytes": s.capacity_bytes,
        "bytes_live_estimate": s.bytes_live_estimate,
        "bytes_dead_estimate": s.bytes_dead_estimate,
        "flash_reads": s.flash_reads,
        "flash_read_bytes": s.flash_read_bytes,
        "flash_writes": s.flash_writes,
        "flash_write_bytes": s.flash_write_bytes,
        "seals": s.seals,
        "evicted_blocks": s.evicted_blocks,
        "gc_runs": s.gc_runs,
        "gc_records_moved": s.gc_records_moved,
        "gc_blocks_freed": s.gc_blocks_freed,
        "ram": {
            "bloom_filter_map_bytes": s.ram.bloom_filter_map_bytes,
            "page_index_bytes": s.ram.page_index_bytes,
            "block_table_bytes": s.ram.block_table_bytes,
            "write_buffer_index_bytes": s.ram.write_buffer_index_bytes,
            "write_buffer_data_bytes": s.ram.write_buffer_data_bytes,
            "index_bits_per_key": s.ram.index_bytes() as f64 * 8.0 / s.keys_estimate.max(1) as f64,
        },
    })
}
