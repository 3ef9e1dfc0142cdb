//! `kura bench fs`: fio under the preload library against ext4 on the same disk, and through
//! the FUSE mount, in one run (paper 004, Fig. 5-7).
//!
//! Every figure comes from fio (`ioengine=psync`, `--thread`, queue depth 1) on one file of
//! `--size` bytes:
//!
//! * kura: `kura fs run -- fio …` on `/kura/bench.fio` (the preload; by default the paper's
//!   setup, an engine embedded in fio's own process, its store in `--dir`);
//! * ext4: the same fio on a file in `--dir` when that directory is on ext4, else on an ext4
//!   made on a loop device over an image file in `--dir` (so: the same disk);
//! * FUSE: the same fio on a file under `kura fs mount` (its own embedded store in `--dir`).
//!
//! Latency jobs are random 4 KiB (or 64 B) I/O on a prepared (fully written) file; buffered
//! and cached jobs first read the whole file in the same fio process, so they measure cache
//! hits. Each job runs `--runtime-s`; with `--rounds N` every job runs N times (interleaving
//! kura, ext4 and FUSE) and the JSON has the medians. Latencies are fio's completion latency,
//! as `<field>_mean`, `_p99` and `_p50`; IOPS jobs run `--threads` fio threads on `O_DIRECT`.
//! The JSON also has each figure over ext4's (`ratios`) and the goals (`goals`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use kura_bench::host::median;
use serde_json::{Value, json};

use crate::engine_cmd::progress;
use crate::size::ByteSize;

/// `statfs` magic of ext2/3/4.
const EXT4_SUPER_MAGIC: i64 = 0xEF53;
/// `statfs` magic of a FUSE mount.
pub(crate) const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
/// How long `kura fs mount` has to show its mount.
const FUSE_MOUNT_TIMEOUT_S: u64 = 30;
/// How long the FUSE server has to exit after it is unmounted.
const FUSE_EXIT_TIMEOUT_S: u64 = 10;
/// The preload's mount prefix in the benchmark.
const KURA_MOUNT: &str = "/kura";
/// The benchmark file's name on every side.
const FILE_NAME: &str = "bench.fio";
/// Extra room of a loop-device ext4 beyond the benchmark file (journal, metadata).
const LOOP_EXTRA_BYTES: u64 = 256 << 20;
/// Block size of the jobs that prepare and warm the file.
const BULK_BS_BYTES: u64 = 1 << 20;
/// The default page cache of the preload holds the file under the dirty threshold with this
/// much to spare, percent.
const CACHE_HEADROOM_PERCENT: u64 = 125;
/// Free space left over beyond what the run preallocates.
const FREE_SPACE_MARGIN_BYTES: u64 = 256 << 20;
/// Smallest `--size` (a few pages per fio thread).
const SIZE_MIN_BYTES: u64 = 1 << 20;
const NS_PER_US: f64 = 1000.0;
/// Shortest measured job.
const RUNTIME_MIN_S: f64 = 0.1;
/// fio's percentile keys for p99 and p50.
const P99_KEY: &str = "99.000000";
const P50_KEY: &str = "50.000000";

#[derive(Args, Clone, Debug)]
pub struct FsBenchArgs {
    /// Directory of the run, on the disk to measure: kura's stores, the ext4 file (or the loop
    /// image), the FUSE mount point. Emptied of the benchmark's own files first.
    #[arg(long, default_value = "kura-data/bench-fs")]
    dir: PathBuf,
    /// Size of the file every job works on. Keep it well within RAM: cached jobs must hit the
    /// kernel's page cache and kura's (sized from this by default, see --cache-mb).
    #[arg(long, default_value = "128M")]
    size: ByteSize,
    /// Seconds of each measured fio job (fractions allowed, e.g. 0.5 for a quick check).
    #[arg(long, default_value_t = 8.0)]
    runtime_s: f64,
    /// Runs of every job; the JSON reports the median of each figure.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// fio threads of the IOPS jobs (`randread_4k_iops`, `randwrite_4k_iops`).
    #[arg(long, default_value_t = 2)]
    threads: u32,
    /// kura's pool for the preload side: `embedded` (an engine inside fio's process, the
    /// paper's setup) or node URLs as `kura fs run --pool` takes them.
    #[arg(long = "pool", value_name = "URL", default_value = "embedded")]
    pool: Vec<String>,
    /// Size of each embedded store (preload and FUSE); both are preallocated in --dir.
    #[arg(long, default_value = "1G")]
    store_size: ByteSize,
    /// Page cache of the preloaded fio, MiB. Default: large enough that the whole file stays
    /// under the write-back threshold (20 % of the cache), as it stays under the kernel's
    /// (10 % of free memory) on the ext4 side; at least the library's default.
    #[arg(long)]
    cache_mb: Option<u64>,
    /// Where the ext4 anchor lives: `auto` (--dir's own file system when it is ext4, else a
    /// loop device), `existing` (--dir must be on ext4) or `loop` (needs root).
    #[arg(long, value_enum, default_value_t = Ext4Mode::Auto)]
    ext4: Ext4Mode,
    /// Skip the FUSE side (its fields are then null).
    #[arg(long)]
    skip_fuse: bool,
    /// Files of the small-file phase (`tree_*` fields): a tree of this many 100-byte files in
    /// 20 directories is made by one process, then walked, stated, read twice and removed by
    /// another, on each side. 0 skips it.
    #[arg(long, default_value_t = 1000)]
    tree_files: u32,
    /// Also draw the results as PNG bar charts: this file (buffered and cached latencies)
    /// and siblings `-direct.png`, `-osync.png`, `-iops.png`, `-stat.png` and `-tree.png`.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the stores and files afterwards.
    #[arg(long)]
    keep: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Ext4Mode {
    Auto,
    Existing,
    Loop,
}

/// How a job's figure is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    /// Mean, p99 and p50 completion latency, nanoseconds.
    Ns,
    /// Mean, p99 and p50 completion latency, microseconds.
    Us,
    /// Operations per second over all threads.
    Iops,
}

/// One measured fio job.
struct Case {
    field: &'static str,
    /// Short name for plots.
    label: &'static str,
    rw: &'static str,
    bs_bytes: u64,
    direct: bool,
    /// `O_SYNC` writes.
    osync: bool,
    /// Read the whole file first (in the same process), so the job hits the cache.
    warm: bool,
    /// Run `--threads` fio threads instead of one.
    many_threads: bool,
    unit: Unit,
    /// fio's `filestat` engine: `stat(2)` of [`STAT_FILES`] small files in the bench file's
    /// directory, no I/O (metadata latency).
    stat: bool,
}

/// Files the `stat` case spreads its calls over (fio lays them out first).
const STAT_FILES: u32 = 256;
/// Size of each of them.
const STAT_FILE_BYTES: u64 = 4096;

const CASES: [Case; 9] = [
    Case { field: "write_64b_buffered_lat_ns", label: "w64B buf", rw: "randwrite", bs_bytes: 64, direct: false, osync: false, warm: true, many_threads: false, unit: Unit::Ns, stat: false },
    Case { field: "write_4k_buffered_lat_ns", label: "w4K buf", rw: "randwrite", bs_bytes: 4096, direct: false, osync: false, warm: true, many_threads: false, unit: Unit::Ns, stat: false },
    Case { field: "write_4k_osync_lat_us", label: "w4K osync", rw: "randwrite", bs_bytes: 4096, direct: false, osync: true, warm: true, many_threads: false, unit: Unit::Us, stat: false },
    Case { field: "read_4k_direct_lat_us", label: "r4K direct", rw: "randread", bs_bytes: 4096, direct: true, osync: false, warm: false, many_threads: false, unit: Unit::Us, stat: false },
    Case { field: "write_4k_direct_lat_us", label: "w4K direct", rw: "randwrite", bs_bytes: 4096, direct: true, osync: false, warm: false, many_threads: false, unit: Unit::Us, stat: false },
    Case { field: "read_4k_cached_lat_ns", label: "r4K cached", rw: "randread", bs_bytes: 4096, direct: false, osync: false, warm: true, many_threads: false, unit: Unit::Ns, stat: false },
    Case { field: "randread_4k_iops", label: "randread", rw: "randread", bs_bytes: 4096, direct: true, osync: false, warm: false, many_threads: true, unit: Unit::Iops, stat: false },
    Case { field: "randwrite_4k_iops", label: "randwrite", rw: "randwrite", bs_bytes: 4096, direct: true, osync: false, warm: false, many_threads: true, unit: Unit::Iops, stat: false },
    Case { field: "stat_lat_us", label: "stat", rw: "read", bs_bytes: STAT_FILE_BYTES, direct: false, osync: false, warm: false, many_threads: false, unit: Unit::Us, stat: true },
];

/// The small-file phase (see `--tree-files` and `bench_fs_tree.py`): its figures, as the
/// script prints them (`tree_` and the side's prefix go before them in the JSON).
const TREE_SCRIPT: &str = include_str!("bench_fs_tree.py");
const TREE_FIGURES: [&str; 6] = ["create_us", "walk_ms", "stat_us", "read_us", "reread_us", "unlink_us"];
/// The tree's directory on each side, beside the fio file.
const TREE_DIR_NAME: &str = "tree";

/// The JSON keys of one case on one side (`prefix` is "", "ext4_" or "fuse_").
fn keys_of(case: &Case, prefix: &str) -> Vec<String> {
    match case.unit {
        Unit::Iops => vec![format!("{prefix}{}", case.field)],
        Unit::Ns | Unit::Us => vec![format!("{prefix}{}_mean", case.field), format!("{prefix}{}_p99", case.field), format!("{prefix}{}_p50", case.field)],
    }
}

/// Every figure key the JSON carries (kura's, ext4's, FUSE's).
pub fn figure_keys() -> Vec<String> {
    let fio = Side::ALL.iter().flat_map(|side| CASES.iter().flat_map(move |c| keys_of(c, side.prefix())));
    let tree = Side::ALL.iter().flat_map(|side| TREE_FIGURES.iter().map(move |f| format!("{}tree_{f}", side.prefix())));
    fio.chain(tree).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Kura,
    Ext4,
    Fuse,
}

impl Side {
    const ALL: [Side; 3] = [Side::Kura, Side::Ext4, Side::Fuse];

    fn prefix(self) -> &'static str {
        match self {
            Side::Kura => "",
            Side::Ext4 => "ext4_",
            Side::Fuse => "fuse_",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Side::Kura => "kura",
            Side::Ext4 => "ext4",
            Side::Fuse => "fuse",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Side::Kura => "kura (preload)",
            Side::Ext4 => "ext4",
            Side::Fuse => "kura (FUSE)",
        }
    }
}

/// Where each side's file is and how fio reaches it.
struct Sides {
    dir: PathBuf,
    kura_data: PathBuf,
    ext4_file: PathBuf,
    ext4_anchor: String,
    fuse_file: Option<PathBuf>,
    /// Unmounts (and stops) on drop.
    _fuse: Option<FuseMount>,
    _loop: Option<LoopExt4>,
}

pub fn run(args: &FsBenchArgs) -> anyhow::Result<()> {
    if args.size.0 < SIZE_MIN_BYTES {
        bail!("--size must be at least {}", ByteSize(SIZE_MIN_BYTES));
    }
    if args.rounds == 0 || args.threads == 0 || args.runtime_s.is_nan() || args.runtime_s < RUNTIME_MIN_S {
        bail!("--rounds and --threads must be at least 1, --runtime-s at least {RUNTIME_MIN_S}");
    }
    let fio_version = fio_version()?;
    let load_start = load_average();
    let sides = set_up(args)?;
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let targets: Vec<Side> = Side::ALL.into_iter().filter(|s| *s != Side::Fuse || sides.fuse_file.is_some()).collect();
    for &side in &targets {
        eprintln!("preparing the {} file ({})", side.label(), args.size);
        run_fio(args, &sides, side, &prepare_args(args, &sides, side)).with_context(|| format!("preparing the {} file", side.label()))?;
    }
    let bar = progress((CASES.len() * targets.len()) as u64 * u64::from(args.rounds), "fio");
    let started = Instant::now();
    for round in 0..args.rounds {
        for case in &CASES {
            for &side in &targets {
                bar.set_message(format!("{} {} {}/{}", side.short(), case.field, round + 1, args.rounds));
                let report = run_fio(args, &sides, side, &case_args(args, &sides, side, case)).with_context(|| format!("{} on {}", case.field, side.label()))?;
                for (key, value) in figures(case, side, &report)? {
                    samples.entry(key).or_default().push(value);
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    eprintln!("{} fio jobs in {:.0} s", CASES.len() * targets.len() * args.rounds as usize, started.elapsed().as_secs_f64());
    if args.tree_files > 0 {
        let bar = progress(targets.len() as u64 * u64::from(args.rounds), "small files");
        for round in 0..args.rounds {
            for &side in &targets {
                bar.set_message(format!("{} {} files {}/{}", side.short(), args.tree_files, round + 1, args.rounds));
                for (key, value) in run_tree(args, &sides, side).with_context(|| format!("the small-file phase on {}", side.label()))? {
                    samples.entry(key).or_default().push(value);
                }
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
    }
    let mut out = json!({
        "fio_version": fio_version,
        "ioengine": "psync",
        "iodepth": 1,
        "dir": fs::canonicalize(&sides.dir).unwrap_or_else(|_| sides.dir.clone()).display().to_string(),
        "file_size_bytes": args.size.0,
        "runtime_s": args.runtime_s,
        "rounds": args.rounds,
        "statistic": if args.rounds > 1 { "median of rounds" } else { "one round" },
        "iops_threads": args.threads,
        "pool": args.pool.join(","),
        "tree_files": args.tree_files,
        "kura_cache_mb": cache_mb(args),
        "kura_dirty_percent": kura_fs::DIRTY_PERCENT_DEFAULT,
        "ext4_anchor": sides.ext4_anchor,
        "fuse": sides.fuse_file.is_some(),
        "load_average_1m_start": load_start,
        "load_average_1m_end": load_average(),
    });
    for key in figure_keys() {
        out[&key] = samples.get(&key).map_or(Value::Null, |v| json!(median(v)));
    }
    out["ratios"] = ratios(&out);
    out["goals"] = goals(&out);
    drop(sides);
    if !args.keep {
        clean_up(&args.dir);
    }
    if let Some(path) = &args.plot {
        draw(path, &out)?;
    }
    kura_bench::json::emit(&out, args.json.as_deref())?;
    Ok(())
}

fn fio_version() -> anyhow::Result<String> {
    let out = Command::new("fio").arg("--version").output().context("fio not found (apt-get install fio)")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn load_average() -> Option<f64> {
    fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// The run directory with kura's data directories, the ext4 anchor and the FUSE mount.
fn set_up(args: &FsBenchArgs) -> anyhow::Result<Sides> {
    fs::create_dir_all(&args.dir).with_context(|| format!("cannot create {}", args.dir.display()))?;
    clean_up(&args.dir);
    let dir = fs::canonicalize(&args.dir)?;
    check_free_space(&dir, args)?;
    let kura_data = dir.join("kura");
    let on_ext4 = statfs_type(&dir)? == EXT4_SUPER_MAGIC;
    let (ext4_dir, ext4_anchor, loop_ext4) = match (args.ext4, on_ext4) {
        (Ext4Mode::Existing, false) => bail!("--ext4 existing: {} is not on ext4", dir.display()),
        (Ext4Mode::Auto | Ext4Mode::Existing, true) => {
            let d = dir.join("ext4");
            fs::create_dir_all(&d)?;
            let anchor = format!("existing ext4 {}", mount_of(&dir).unwrap_or_else(|| "(mount unknown)".into()));
            (d, anchor, None)
        }
        (Ext4Mode::Auto | Ext4Mode::Loop, _) => {
            let l = LoopExt4::make(&dir, args.size.0 + LOOP_EXTRA_BYTES)?;
            let anchor = format!("new ext4 on a loop device over {}", l.image.display());
            (l.mount.clone(), anchor, Some(l))
        }
    };
    let (fuse_file, fuse) = if args.skip_fuse {
        (None, None)
    } else {
        let m = FuseMount::start(&dir, args.store_size)?;
        (Some(m.mount.join(FILE_NAME)), Some(m))
    };
    Ok(Sides { dir, kura_data, ext4_file: ext4_dir.join(FILE_NAME), ext4_anchor, fuse_file, _fuse: fuse, _loop: loop_ext4 })
}

/// Removes what a run leaves in `dir` (stores, files; not a mounted mount point's contents).
fn clean_up(dir: &Path) {
    for name in ["kura", "fuse-data", "ext4"] {
        let _ = fs::remove_dir_all(dir.join(name));
    }
    for name in ["ext4.img", "fuse.log"] {
        let _ = fs::remove_file(dir.join(name));
    }
    let _ = fs::remove_dir(dir.join("fuse-mnt"));
    let _ = fs::remove_dir(dir.join("ext4-mnt"));
}

/// Refuses to start when --dir cannot hold both stores and the anchor's file (a full disk
/// would fail the run half-way, and the disk may be shared).
fn check_free_space(dir: &Path, args: &FsBenchArgs) -> anyhow::Result<()> {
    let sides = if args.skip_fuse { 1 } else { 2 };
    let needed = sides * args.store_size.0 + args.size.0 + if args.ext4 == Ext4Mode::Loop { LOOP_EXTRA_BYTES } else { 0 } + FREE_SPACE_MARGIN_BYTES;
    let c = CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: an all-zero statvfs is a valid value of the plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated; st is a valid statvfs to write into.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        bail!("statvfs {}: {}", dir.display(), std::io::Error::last_os_error());
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    if free < needed {
        bail!("{} has {} MiB free, the run needs about {} MiB (lower --store-size or --size)", dir.display(), free >> 20, needed >> 20);
    }
    Ok(())
}

/// `statfs(2)`'s file system type of `path`, as the kernel sees it: by system call, not libc,
/// which a preload (a `kura fs run` inside another) would answer for its own mount.
pub(crate) fn statfs_type(path: &Path) -> anyhow::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: an all-zero statfs is a valid value of the plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated; st is a valid statfs to write into.
    if unsafe { libc::syscall(libc::SYS_statfs, c.as_ptr(), &mut st as *mut libc::statfs) } != 0 {
        bail!("statfs {}: {}", path.display(), std::io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// "at MOUNTPOINT (DEVICE)" of the mount holding `path` (the longest mount-point prefix).
fn mount_of(path: &Path) -> Option<String> {
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    let best = mounts
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (dev, at, kind) = (w.next()?, w.next()?, w.next()?);
            (kind == "ext4" && path.starts_with(at)).then(|| (at.len(), format!("at {at} ({dev})")))
        })
        .max_by_key(|(len, _)| *len)?;
    Some(best.1)
}

/// An ext4 made for the run on a loop device over an image file in the run directory.
struct LoopExt4 {
    image: PathBuf,
    mount: PathBuf,
}

impl LoopExt4 {
    fn make(dir: &Path, size: u64) -> anyhow::Result<Self> {
        let image = dir.join("ext4.img");
        let mount = dir.join("ext4-mnt");
        File::create(&image)?.set_len(size)?;
        fs::create_dir_all(&mount)?;
        let ok = |cmd: &mut Command, what: &str| -> anyhow::Result<()> {
            let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("cannot run {what}"))?;
            if !out.status.success() {
                bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            }
            Ok(())
        };
        ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image), "mkfs.ext4")?;
        ok(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mount), "mount -o loop (needs root)")?;
        Ok(Self { image, mount })
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// `kura fs mount` on an embedded store of its own, for the run.
struct FuseMount {
    child: Child,
    mount: PathBuf,
}

impl FuseMount {
    fn start(dir: &Path, store_size: ByteSize) -> anyhow::Result<Self> {
        let mount = dir.join("fuse-mnt");
        fs::create_dir_all(&mount)?;
        let data = dir.join("fuse-data");
        let options = ["--pool", "embedded", "--store-size", &store_size.0.to_string(), "--data-dir", &data.to_string_lossy()];
        let child = crate::fs_cmd::spawn_fuse_mount(&mount, &options, &dir.join("fuse.log"), Duration::from_secs(FUSE_MOUNT_TIMEOUT_S)).context("use --skip-fuse to run without it")?;
        Ok(Self { child, mount })
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.mount).stderr(Stdio::null()).status();
        crate::fs_cmd::wait_or_kill(&mut self.child, Duration::from_secs(FUSE_EXIT_TIMEOUT_S));
    }
}

/// fio's global options for `side`'s file.
fn global_args(args: &FsBenchArgs, sides: &Sides, side: Side) -> Vec<String> {
    let file = match side {
        Side::Kura => PathBuf::from(KURA_MOUNT).join(FILE_NAME),
        Side::Ext4 => sides.ext4_file.clone(),
        Side::Fuse => sides.fuse_file.clone().expect("FUSE side without a mount"),
    };
    vec![
        "--thread".into(),
        "--ioengine=psync".into(),
        "--iodepth=1".into(),
        format!("--filename={}", file.display()),
        format!("--size={}", args.size.0),
        // Keep the caches a job warmed: fio otherwise drops the file's pages first.
        "--invalidate=0".into(),
        "--group_reporting".into(),
        "--output-format=json".into(),
    ]
}

/// Writes the whole file once (so reads read data and writes overwrite), durably.
fn prepare_args(args: &FsBenchArgs, sides: &Sides, side: Side) -> Vec<String> {
    let mut a = global_args(args, sides, side);
    a.extend(["--name=prepare".into(), "--rw=write".into(), format!("--bs={BULK_BS_BYTES}"), "--end_fsync=1".into()]);
    a
}

/// A warm-up job when the case wants one, then the measured job (its own reporting group).
fn case_args(args: &FsBenchArgs, sides: &Sides, side: Side, case: &Case) -> Vec<String> {
    if case.stat {
        return stat_args(args, sides, side, case);
    }
    let mut a = global_args(args, sides, side);
    if case.warm {
        a.extend(["--name=warm".into(), "--rw=read".into(), format!("--bs={BULK_BS_BYTES}")]);
    }
    a.extend([
        format!("--name={}", case.field),
        "--stonewall".into(),
        format!("--rw={}", case.rw),
        format!("--bs={}", case.bs_bytes),
        format!("--direct={}", u8::from(case.direct)),
        format!("--sync={}", u8::from(case.osync)),
        format!("--numjobs={}", if case.many_threads { args.threads } else { 1 }),
        "--norandommap".into(),
        "--randrepeat=0".into(),
        "--time_based".into(),
        format!("--runtime={}ms", (args.runtime_s * 1000.0).round() as u64),
    ]);
    a
}

/// The `stat` case: fio's `filestat` engine over [`STAT_FILES`] files beside the bench file
/// (named after the job; fio makes them before it measures).
fn stat_args(args: &FsBenchArgs, sides: &Sides, side: Side, case: &Case) -> Vec<String> {
    let file = match side {
        Side::Kura => PathBuf::from(KURA_MOUNT).join(FILE_NAME),
        Side::Ext4 => sides.ext4_file.clone(),
        Side::Fuse => sides.fuse_file.clone().expect("FUSE side without a mount"),
    };
    let dir = file.parent().expect("the bench file is in a directory");
    vec![
        "--thread".into(),
        "--ioengine=filestat".into(),
        format!("--directory={}", dir.display()),
        format!("--name={}", case.field),
        format!("--nrfiles={STAT_FILES}"),
        format!("--filesize={STAT_FILE_BYTES}"),
        format!("--bs={STAT_FILE_BYTES}"),
        "--rw=read".into(),
        "--file_service_type=random".into(),
        "--time_based".into(),
        format!("--runtime={}ms", (args.runtime_s * 1000.0).round() as u64),
        "--group_reporting".into(),
        "--output-format=json".into(),
    ]
}

/// The preload's page cache for the run (see `--cache-mb`).
fn cache_mb(args: &FsBenchArgs) -> u64 {
    args.cache_mb.unwrap_or_else(|| {
        let file_mb = args.size.0.div_ceil(1 << 20);
        let dirty_percent = u64::from(kura_fs::DIRTY_PERCENT_DEFAULT);
        (file_mb * 100 / dirty_percent * CACHE_HEADROOM_PERCENT / 100).max(kura_fs::CACHE_BYTES_DEFAULT >> 20)
    })
}

/// `program` on `side`: under `kura fs run` on kura's data directory and pool for the
/// preload side, as it is for ext4 and FUSE.
fn command_on(args: &FsBenchArgs, sides: &Sides, side: Side, program: &str) -> anyhow::Result<Command> {
    Ok(match side {
        Side::Kura => {
            let mut c = Command::new(std::env::current_exe()?);
            c.args(["fs", "run", "--fuse", "off", "--mount", KURA_MOUNT, "--data-dir"]).arg(&sides.kura_data).args(["--store-size", &args.store_size.0.to_string()]);
            for url in &args.pool {
                c.args(["--pool", url]);
            }
            c.args(["--cache-mb", &cache_mb(args).to_string()]);
            c.args(["--", program]);
            c
        }
        Side::Ext4 | Side::Fuse => Command::new(program),
    })
}

/// Runs fio with `fio_args` on `side` and returns its JSON report.
fn run_fio(args: &FsBenchArgs, sides: &Sides, side: Side, fio_args: &[String]) -> anyhow::Result<Value> {
    let mut cmd = command_on(args, sides, side, "fio")?;
    let out = cmd.args(fio_args).stdin(Stdio::null()).output().context("cannot run fio")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("fio failed ({}): {}{}", out.status, String::from_utf8_lossy(&out.stderr).trim(), tail(&stdout));
    }
    let start = stdout.find("\n{").map(|i| i + 1).or_else(|| stdout.starts_with('{').then_some(0)).with_context(|| format!("no JSON in fio's output: {}", tail(&stdout)))?;
    let report: Value = serde_json::from_str(&stdout[start..]).with_context(|| format!("fio's JSON: {}", tail(&stdout)))?;
    for job in report["jobs"].as_array().context("no jobs in fio's report")? {
        if job["error"].as_i64().unwrap_or(0) != 0 {
            bail!("fio job {} reported error {}: {}", job["jobname"], job["error"], String::from_utf8_lossy(&out.stderr).trim());
        }
    }
    Ok(report)
}

/// The small-file phase on `side`: `bench_fs_tree.py make`, then `use`, each a process of
/// its own (under `kura fs run` for kura's side); the figures with their JSON keys.
fn run_tree(args: &FsBenchArgs, sides: &Sides, side: Side) -> anyhow::Result<Vec<(String, f64)>> {
    let root = match side {
        Side::Kura => PathBuf::from(KURA_MOUNT).join(TREE_DIR_NAME),
        Side::Ext4 => sides.ext4_file.with_file_name(TREE_DIR_NAME),
        Side::Fuse => sides.fuse_file.as_ref().expect("FUSE side without a mount").with_file_name(TREE_DIR_NAME),
    };
    let mut figures = Vec::new();
    for what in ["make", "use"] {
        let out = command_on(args, sides, side, "python3")?
            .args(["-c", TREE_SCRIPT, what]).arg(&root).arg(args.tree_files.to_string()).stdin(Stdio::null()).output().context("cannot run python3")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("bench_fs_tree.py {what} failed ({}): {}{}", out.status, String::from_utf8_lossy(&out.stderr).trim(), tail(&stdout));
        }
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).with_context(|| format!("no JSON from bench_fs_tree.py {what}: {}", tail(&stdout)))?;
        let report: Value = serde_json::from_str(line).with_context(|| format!("bench_fs_tree.py {what}'s JSON: {line}"))?;
        for (name, value) in report.as_object().context("not a JSON object")? {
            let value = value.as_f64().with_context(|| format!("{name} is not a number"))?;
            figures.push((format!("{}tree_{name}", side.prefix()), value));
        }
    }
    Ok(figures)
}

fn tail(text: &str) -> String {
    const QUOTE_CHARS_MAX: usize = 2000;
    let skip = text.chars().count().saturating_sub(QUOTE_CHARS_MAX);
    text.chars().skip(skip).collect()
}

/// The measured job's figures (the last reporting group of the report).
fn figures(case: &Case, side: Side, report: &Value) -> anyhow::Result<Vec<(String, f64)>> {
    let job = report["jobs"].as_array().and_then(|j| j.last()).context("no jobs in fio's report")?;
    let dir = if case.rw.contains("read") { &job["read"] } else { &job["write"] };
    if dir["total_ios"].as_u64().unwrap_or(0) == 0 {
        bail!("fio did no I/O in {}", case.field);
    }
    let keys = keys_of(case, side.prefix());
    let num = |v: &Value, what: &str| v.as_f64().with_context(|| format!("no {what} in fio's report"));
    Ok(match case.unit {
        Unit::Iops => vec![(keys[0].clone(), num(&dir["iops"], "iops")?)],
        Unit::Ns | Unit::Us => {
            let scale = if case.unit == Unit::Us { 1.0 / NS_PER_US } else { 1.0 };
            let clat = &dir["clat_ns"];
            let mean = num(&clat["mean"], "clat_ns.mean")? * scale;
            let p99 = num(&clat["percentile"][P99_KEY], "clat_ns p99")? * scale;
            let p50 = num(&clat["percentile"][P50_KEY], "clat_ns p50")? * scale;
            vec![(keys[0].clone(), mean), (keys[1].clone(), p99), (keys[2].clone(), p50)]
        }
    })
}

/// kura's and FUSE's figures over ext4's (latency: below 1 is better; IOPS: above 1).
fn ratios(out: &Value) -> Value {
    let mut r = serde_json::Map::new();
    let tree_keys = TREE_FIGURES.iter().map(|f| format!("tree_{f}"));
    for key in CASES.iter().flat_map(|case| keys_of(case, "")).chain(tree_keys) {
        for side in [Side::Kura, Side::Fuse] {
            let (a, b) = (out[format!("{}{key}", side.prefix())].as_f64(), out[format!("ext4_{key}")].as_f64());
            let name = format!("{}{key}_vs_ext4", side.prefix());
            r.insert(name, a.zip(b).map_or(Value::Null, |(a, b)| json!(a / b)));
        }
    }
    Value::Object(r)
}

/// The goals, each with the figure, the anchor and whether it is met.
fn goals(out: &Value) -> Value {
    let get = |k: &str| out[k].as_f64();
    let mut goals = Vec::new();
    if let (Some(v), Some(e)) = (get("write_64b_buffered_lat_ns_mean"), get("ext4_write_64b_buffered_lat_ns_mean")) {
        goals.push(json!({"goal": "write_64b_buffered_lat_ns_mean <= 700", "value": v, "met": v <= 700.0}));
        goals.push(json!({"goal": "write_64b_buffered_lat_ns_mean <= 0.2 x ext4", "value": v, "ext4": e, "ratio": v / e, "met": v <= 0.2 * e}));
    }
    for field in ["write_4k_osync_lat_us_mean", "read_4k_direct_lat_us_mean", "write_4k_direct_lat_us_mean"] {
        if let (Some(v), Some(e)) = (get(field), get(&format!("ext4_{field}"))) {
            let (goal, met) = if e < 40.0 { (format!("{field} <= 0.7 x ext4 (ext4 under 40 us)"), v <= 0.7 * e) } else { (format!("{field} <= ext4 - 20 us"), v <= e - 20.0) };
            goals.push(json!({"goal": goal, "value": v, "ext4": e, "ratio": v / e, "met": met}));
        }
    }
    if let (Some(v), Some(e)) = (get("read_4k_cached_lat_ns_mean"), get("ext4_read_4k_cached_lat_ns_mean")) {
        goals.push(json!({"goal": "read_4k_cached_lat_ns_mean <= ext4", "value": v, "ext4": e, "ratio": v / e, "met": v <= e}));
    }
    Value::Array(goals)
}

fn draw(path: &Path, out: &Value) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let sibling = |suffix: &str| {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("fs");
        path.with_file_name(format!("{stem}-{suffix}.png"))
    };
    let title = format!("kura fs vs ext4, fio psync, {} file", ByteSize(out["file_size_bytes"].as_u64().unwrap_or(0)));
    let charts = [
        (path.to_path_buf(), "mean latency, ns", &["write_64b_buffered_lat_ns", "write_4k_buffered_lat_ns", "read_4k_cached_lat_ns"][..]),
        (sibling("direct"), "mean latency, us", &["read_4k_direct_lat_us", "write_4k_direct_lat_us"][..]),
        (sibling("osync"), "mean latency, us", &["write_4k_osync_lat_us"][..]),
        (sibling("iops"), "operations per second", &["randread_4k_iops", "randwrite_4k_iops"][..]),
        (sibling("stat"), "mean latency, us", &["stat_lat_us"][..]),
    ];
    for (file, y_label, fields) in charts {
        let mut bars = Vec::new();
        for case in CASES.iter().filter(|c| fields.contains(&c.field)) {
            let key = keys_of(case, "")[0].clone();
            for side in Side::ALL {
                if let Some(v) = out[format!("{}{key}", side.prefix())].as_f64() {
                    bars.push((format!("{} {}", case.label, side.short()), v));
                }
            }
        }
        kura_bench::plot::bar_plot(&file, &title, y_label, &bars)?;
    }
    let mut bars = Vec::new();
    for figure in TREE_FIGURES.iter().filter(|f| f.ends_with("_us")) {
        for side in Side::ALL {
            if let Some(v) = out[format!("{}tree_{figure}", side.prefix())].as_f64() {
                bars.push((format!("{} {}", figure.trim_end_matches("_us"), side.short()), v));
            }
        }
    }
    if !bars.is_empty() {
        kura_bench::plot::bar_plot(&sibling("tree"), "kura fs vs ext4, small files (100 B), per file", "mean time per file, us", &bars)?;
    }
    Ok(())
}
