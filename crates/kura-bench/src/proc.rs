//! A process's memory and CPU use, read from /proc: `VmRSS`/`VmHWM` of /proc/PID/status and
//! utime/stime of /proc/PID/stat. For reporting a server's footprint next to its throughput.

use std::fs;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// One reading of a process.
#[derive(Clone, Copy, Debug)]
pub struct ProcSample {
    pub taken_at: Instant,
    pub rss_bytes: u64,
    /// Peak RSS so far (`VmHWM`).
    pub rss_peak_bytes: u64,
    pub user: Duration,
    pub system: Duration,
}

impl ProcSample {
    /// User plus system CPU time.
    pub fn cpu(&self) -> Duration {
        self.user + self.system
    }
}

/// CPU cores kept busy between two samples of one process (1.0 = one core all the time).
pub fn cpu_utilization(earlier: &ProcSample, later: &ProcSample) -> f64 {
    let wall = later
        .taken_at
        .saturating_duration_since(earlier.taken_at)
        .as_secs_f64();
    if wall == 0.0 {
        return 0.0;
    }
    later.cpu().saturating_sub(earlier.cpu()).as_secs_f64() / wall
}

pub fn sample(pid: u32) -> io::Result<ProcSample> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let (user, system) = parse_stat_cpu(&stat, clock_ticks_per_second())
        .ok_or_else(|| bad_data(format!("/proc/{pid}/stat: no utime/stime")))?;
    Ok(ProcSample {
        taken_at: Instant::now(),
        rss_bytes: status_kib(&status, "VmRSS").unwrap_or(0) * 1024,
        rss_peak_bytes: status_kib(&status, "VmHWM").unwrap_or(0) * 1024,
        user,
        system,
    })
}

/// Resident set size in bytes (`VmRSS`; 0 for a kernel thread or a zombie, which have none).
pub fn rss_bytes(pid: u32) -> io::Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(status_kib(&status, "VmRSS").unwrap_or(0) * 1024)
}

/// (user, system) CPU time used so far.
pub fn cpu_time(pid: u32) -> io::Result<(Duration, Duration)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_cpu(&stat, clock_ticks_per_second())
        .ok_or_else(|| bad_data(format!("/proc/{pid}/stat: no utime/stime")))
}

fn bad_data(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The value of a `Name:   123 kB` line of /proc/PID/status.
fn status_kib(status: &str, name: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// utime and stime (fields 14 and 15) of /proc/PID/stat. Field 2, the command name, is in
/// parentheses and may itself hold spaces and parentheses, so fields are counted after the
/// last ')'.
fn parse_stat_cpu(stat: &str, ticks_per_second: u64) -> Option<(Duration, Duration)> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(11); // fields 3..=13
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let ticks = |t: u64| Duration::from_secs_f64(t as f64 / ticks_per_second as f64);
    Some((ticks(utime), ticks(stime)))
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value; it takes no pointers.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100)
}

/// Samples a process every `interval` on a background thread until stopped.
pub struct ProcSampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<ProcSample>>,
}

impl ProcSampler {
    pub fn start(pid: u32, interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop_flag.load(Ordering::Relaxed) {
                // A process that has exited ends the series.
                let Ok(s) = sample(pid) else { break };
                samples.push(s);
                thread::sleep(interval);
            }
            if let Ok(last) = sample(pid) {
                samples.push(last);
            }
            samples
        });
        Self { stop, thread }
    }

    /// Stops sampling, takes one last sample if the process is still there, and returns all.
    pub fn stop(self) -> Vec<ProcSample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("the sampler thread does not panic")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_lines() {
        let status = "Name:\tkura\nVmHWM:\t  20480 kB\nVmRSS:\t   10240 kB\nThreads:\t3\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(10240));
        assert_eq!(status_kib(status, "VmHWM"), Some(20480));
        assert_eq!(status_kib(status, "VmSwap"), None);
    }

    #[test]
    fn parses_stat_with_a_hostile_command_name() {
        let stat = "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 1 0 1 0 0";
        let (user, system) = parse_stat_cpu(stat, 100).unwrap();
        assert_eq!(user, Duration::from_millis(2500));
        assert_eq!(system, Duration::from_millis(750));
        assert_eq!(parse_stat_cpu("garbage", 100), None);
    }

    #[test]
    fn samples_this_process() {
        let pid = std::process::id();
        let before = sample(pid).unwrap();
        // Touch 32 MiB and burn some CPU so both readings must move.
        let mut buf = vec![0_u8; 32 << 20];
        for (i, b) in buf.iter_mut().enumerate().step_by(4096) {
            *b = i as u8;
        }
        let deadline = Instant::now() + Duration::from_millis(300);
        let mut x = 0_u64;
        while Instant::now() < deadline {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box((x, &buf));
        let after = sample(pid).unwrap();
        assert!(after.rss_bytes >= 32 << 20, "rss {}", after.rss_bytes);
        assert!(after.rss_peak_bytes >= after.rss_bytes);
        assert!(
            after.cpu() > before.cpu(),
            "{:?} -> {:?}",
            before.cpu(),
            after.cpu()
        );
        let busy = cpu_utilization(&before, &after);
        assert!(busy > 0.3 && busy < 64.0, "utilization {busy}");
        assert!(rss_bytes(pid).unwrap() > 0);
        assert!(cpu_time(pid).unwrap().0 > Duration::ZERO);
    }

    #[test]
    fn sampler_collects_until_stopped() {
        let sampler = ProcSampler::start(std::process::id(), Duration::from_millis(10));
        thread::sleep(Duration::from_millis(100));
        let samples = sampler.stop();
        assert!(samples.len() >= 3, "{} samples", samples.len());
        assert!(samples.windows(2).all(|w| w[0].taken_at <= w[1].taken_at));
    }

    #[test]
    fn missing_process_is_an_error() {
        // Pid numbers are below 2^22 on Linux.
        assert_eq!(
            sample(u32::MAX).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }
}
