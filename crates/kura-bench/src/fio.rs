//! fio as a library call: describe a job with [`FioJob`], run it with `--output-format=json`,
//! get IOPS, bandwidth and completion-latency percentiles back in a [`FioResult`].
//!
//! fio is the anchor for every block benchmark: the same job runs against a plain file (the
//! machine's limit) and against kura's devices in one run.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde::Serialize;
use serde_json::Value;
use thiserror::Error;

const MIB: f64 = 1024.0 * 1024.0;
const NS_PER_US: f64 = 1000.0;
/// How much of fio's output an error message quotes.
const OUTPUT_QUOTE_MAX_BYTES: usize = 4096;

/// fio's `rw=` I/O pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FioRw {
    Read,
    Write,
    RandRead,
    RandWrite,
    /// Sequential mixed; `read_percent` is fio's `rwmixread`.
    ReadWrite {
        read_percent: u8,
    },
    RandReadWrite {
        read_percent: u8,
    },
}

impl fmt::Display for FioRw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::RandRead => "randread",
            Self::RandWrite => "randwrite",
            Self::ReadWrite { .. } => "rw",
            Self::RandReadWrite { .. } => "randrw",
        })
    }
}

/// One fio job. `Default` is a 4 KiB random read, queue depth 1, io_uring, O_DIRECT, over
/// 64 MiB; set at least `filename`.
#[derive(Clone, Debug)]
pub struct FioJob {
    pub name: String,
    /// A file or block device; for `ioengine=nbd` leave it empty and pass `--uri=` in
    /// `extra_args`.
    pub filename: PathBuf,
    pub rw: FioRw,
    pub bs_bytes: u64,
    pub size_bytes: u64,
    pub iodepth: u32,
    pub numjobs: u32,
    pub ioengine: String,
    pub direct: bool,
    /// Stop after this many seconds (fio `runtime=`).
    pub runtime_s: Option<u64>,
    /// Keep going over the file until `runtime_s` is up (fio `time_based`).
    pub time_based: bool,
    /// More `--option=value` arguments, passed as they are after the ones above.
    pub extra_args: Vec<String>,
    /// The fio executable.
    pub fio_binary: PathBuf,
}

impl Default for FioJob {
    fn default() -> Self {
        Self {
            name: "kura".to_owned(),
            filename: PathBuf::new(),
            rw: FioRw::RandRead,
            bs_bytes: 4096,
            size_bytes: 64 << 20,
            iodepth: 1,
            numjobs: 1,
            ioengine: "io_uring".to_owned(),
            direct: true,
            runtime_s: None,
            time_based: false,
            extra_args: Vec::new(),
            fio_binary: PathBuf::from("fio"),
        }
    }
}

impl FioJob {
    /// fio's command line for this job (without the program name).
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--name={}", self.name),
            format!("--rw={}", self.rw),
            format!("--bs={}", self.bs_bytes),
            format!("--size={}", self.size_bytes),
            format!("--iodepth={}", self.iodepth),
            format!("--numjobs={}", self.numjobs),
            format!("--ioengine={}", self.ioengine),
            format!("--direct={}", u8::from(self.direct)),
            "--group_reporting".to_owned(),
            "--output-format=json".to_owned(),
        ];
        if !self.filename.as_os_str().is_empty() {
            args.push(format!("--filename={}", self.filename.display()));
        }
        if let FioRw::ReadWrite { read_percent } | FioRw::RandReadWrite { read_percent } = self.rw {
            args.push(format!("--rwmixread={read_percent}"));
        }
        if let Some(s) = self.runtime_s {
            args.push(format!("--runtime={s}s"));
        }
        if self.time_based {
            args.push("--time_based".to_owned());
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// Throughput and completion latency of one direction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FioSide {
    pub ios: u64,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub lat_us_mean: f64,
    pub lat_us_p50: f64,
    pub lat_us_p99: f64,
    pub lat_us_p999: f64,
}

/// What fio measured; a direction that did no I/O is `None`. Latencies are fio's completion
/// latency (clat: submission to completion), converted from fio's nanoseconds.
#[derive(Clone, Debug, Serialize)]
pub struct FioResult {
    pub read: Option<FioSide>,
    pub write: Option<FioSide>,
    /// fio's whole JSON report.
    #[serde(skip)]
    pub raw: Value,
}

#[derive(Debug, Error)]
pub enum FioError {
    #[error("fio not found ({binary}): install it (apt-get install fio; ./scripts/test.sh does)")]
    NotFound { binary: String },
    #[error("cannot run fio: {0}")]
    Spawn(#[source] io::Error),
    #[error("fio failed ({status}): {stderr}")]
    Failed { status: String, stderr: String },
    #[error("fio's job reported error {code}: {stderr}")]
    JobError { code: i64, stderr: String },
    #[error("cannot read fio's JSON output: {reason}; output began: {output}")]
    Parse { reason: String, output: String },
}

/// Runs `job` and parses its JSON report.
pub fn run(job: &FioJob) -> Result<FioResult, FioError> {
    let output = Command::new(&job.fio_binary)
        .args(job.args())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => FioError::NotFound {
                binary: job.fio_binary.display().to_string(),
            },
            _ => FioError::Spawn(e),
        })?;
    let stderr = quote(&output.stderr);
    if !output.status.success() {
        let stdout = quote(&output.stdout);
        let detail = if stderr.is_empty() { stdout } else { stderr };
        return Err(FioError::Failed {
            status: output.status.to_string(),
            stderr: detail,
        });
    }
    let result = parse_json(&String::from_utf8_lossy(&output.stdout))?;
    match result.raw["jobs"][0]["error"].as_i64() {
        Some(code) if code != 0 => Err(FioError::JobError { code, stderr }),
        _ => Ok(result),
    }
}

fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(OUTPUT_QUOTE_MAX_BYTES) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// Parses fio's `--output-format=json` report (with `--group_reporting`, one aggregated job).
/// fio may print warnings before the JSON; they are skipped.
pub fn parse_json(text: &str) -> Result<FioResult, FioError> {
    let parse_err = |reason: String| FioError::Parse {
        reason,
        output: quote(text.as_bytes()),
    };
    let start = text
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| text.starts_with('{').then_some(0))
        .ok_or_else(|| parse_err("no JSON object".to_owned()))?;
    let raw: Value = serde_json::from_str(&text[start..]).map_err(|e| parse_err(e.to_string()))?;
    let job = raw["jobs"]
        .get(0)
        .ok_or_else(|| parse_err("no jobs in the report".to_owned()))?;
    let read = side(&job["read"]).map_err(|r| parse_err(format!("read: {r}")))?;
    let write = side(&job["write"]).map_err(|r| parse_err(format!("write: {r}")))?;
    Ok(FioResult { read, write, raw })
}

fn side(v: &Value) -> Result<Option<FioSide>, String> {
    let ios = v["total_ios"].as_u64().ok_or("no total_ios")?;
    if ios == 0 {
        return Ok(None);
    }
    let num = |key: &str, v: &Value| v.as_f64().ok_or(format!("no {key}"));
    let clat = &v["clat_ns"];
    let pct = |p: &str| {
        num(&format!("clat_ns.percentile.{p}"), &clat["percentile"][p]).map(|ns| ns / NS_PER_US)
    };
    Ok(Some(FioSide {
        ios,
        iops: num("iops", &v["iops"])?,
        bw_mib_s: num("bw_bytes", &v["bw_bytes"])? / MIB,
        lat_us_mean: num("clat_ns.mean", &clat["mean"])? / NS_PER_US,
        lat_us_p50: pct("50.000000")?,
        lat_us_p99: pct("99.000000")?,
        lat_us_p999: pct("99.900000")?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of fio 3.33's report, trimmed to what is read.
    const SAMPLE: &str = r#"fio: some warning before the JSON
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "kura", "error" : 0,
      "read" : {
        "io_bytes" : 116256768, "bw_bytes" : 116140627, "iops" : 28354.645355, "total_ios" : 28383,
        "clat_ns" : { "mean" : 34567.8, "percentile" : { "50.000000" : 31000, "99.000000" : 90000, "99.900000" : 250000 } }
      },
      "write" : { "io_bytes" : 0, "bw_bytes" : 0, "iops" : 0.0, "total_ios" : 0,
        "clat_ns" : { "mean" : 0.0 } }
    }
  ]
}
"#;

    #[test]
    fn parses_a_report() {
        let r = parse_json(SAMPLE).unwrap();
        let read = r.read.unwrap();
        assert_eq!(read.ios, 28383);
        assert!((read.iops - 28354.645355).abs() < 1e-6);
        assert!((read.bw_mib_s - 116140627.0 / MIB).abs() < 1e-9);
        assert!((read.lat_us_mean - 34.5678).abs() < 1e-9);
        assert_eq!(
            (read.lat_us_p50, read.lat_us_p99, read.lat_us_p999),
            (31.0, 90.0, 250.0)
        );
        assert!(r.write.is_none());
        assert_eq!(r.raw["fio version"], "fio-3.33");
    }

    #[test]
    fn rejects_broken_reports() {
        assert!(matches!(
            parse_json("fio: file not found"),
            Err(FioError::Parse { .. })
        ));
        assert!(matches!(
            parse_json("{\"jobs\": []}"),
            Err(FioError::Parse { .. })
        ));
        let no_percentiles = SAMPLE.replace("\"50.000000\" : 31000, ", "");
        let err = parse_json(&no_percentiles).unwrap_err().to_string();
        assert!(err.contains("50.000000"), "{err}");
    }

    #[test]
    fn command_line_has_every_field() {
        let job = FioJob {
            filename: PathBuf::from("/dev/nbd0"),
            rw: FioRw::RandReadWrite { read_percent: 70 },
            runtime_s: Some(5),
            time_based: true,
            iodepth: 32,
            extra_args: vec!["--random_generator=lfsr".to_owned()],
            ..FioJob::default()
        };
        let args = job.args();
        for want in [
            "--rw=randrw",
            "--rwmixread=70",
            "--bs=4096",
            "--iodepth=32",
            "--ioengine=io_uring",
            "--direct=1",
            "--runtime=5s",
            "--time_based",
            "--output-format=json",
            "--filename=/dev/nbd0",
            "--random_generator=lfsr",
        ] {
            assert!(
                args.iter().any(|a| a == want),
                "{want} missing from {args:?}"
            );
        }
    }

    #[test]
    fn missing_fio_is_a_clear_error() {
        let job = FioJob {
            fio_binary: PathBuf::from("/nonexistent/fio"),
            ..FioJob::default()
        };
        let err = run(&job).unwrap_err();
        assert!(matches!(err, FioError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("apt-get install fio"));
    }

    fn fio_missing() -> bool {
        let found = Command::new("fio")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            eprintln!("SKIP: fio is not installed (./scripts/test.sh installs it)");
        }
        !found
    }

    #[test]
    fn failing_fio_reports_its_stderr() {
        if fio_missing() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let job = FioJob {
            filename: dir.path().join("data"),
            ioengine: "kura-no-such-engine".to_owned(),
            runtime_s: Some(1),
            ..FioJob::default()
        };
        let err = run(&job).unwrap_err();
        assert!(matches!(err, FioError::Failed { .. }), "{err}");
        assert!(err.to_string().contains("kura-no-such-engine"), "{err}");
    }

    #[test]
    fn runs_a_two_second_job_on_a_temp_file() {
        if fio_missing() {
            return;
        }
        // /var/tmp: a disk-backed file system, where O_DIRECT works (tmpfs refuses it).
        let dir = tempfile::Builder::new()
            .prefix("kura-fio-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let job = FioJob {
            filename: dir.path().join("data"),
            rw: FioRw::RandReadWrite { read_percent: 50 },
            size_bytes: 16 << 20,
            iodepth: 4,
            runtime_s: Some(2),
            time_based: true,
            ..FioJob::default()
        };
        let r = run(&job).unwrap();
        for side in [r.read.as_ref().unwrap(), r.write.as_ref().unwrap()] {
            assert!(
                side.ios > 0 && side.iops > 0.0 && side.bw_mib_s > 0.0,
                "{side:?}"
            );
            assert!(
                side.lat_us_p50 > 0.0 && side.lat_us_p50 <= side.lat_us_p99,
                "{side:?}"
            );
            assert!(
                side.lat_us_p99 <= side.lat_us_p999 && side.lat_us_mean > 0.0,
                "{side:?}"
            );
            // 4 KiB per I/O: bandwidth and IOPS agree.
            assert!(
                (side.bw_mib_s / (side.iops * 4096.0 / MIB) - 1.0).abs() < 0.05,
                "{side:?}"
            );
        }
    }
}
