//! Which process start of a server a connection reached, learnt at its handshake. A node whose
//! instance changed restarted, and may have lost writes it acknowledged but had not synced;
//! a connection that broke while the instance stayed the same lost nothing (see
//! [`crate::net`]).

/// One process start of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Instance {
    /// kura serve's `kura_instance_id` (random per start).
    Kura(u64),
    /// Redis' `run_id` (random per start).
    RunId(String),
    /// memcached (or a kura server without `kura_instance_id`): its pid and start time,
    /// `time - uptime` from `stats` (known to ±[`START_TIME_SLACK_S`]).
    Process { pid: u64, started_unix_s: i64 },
}

/// How far apart two readings of one process's start time may be (`time` and `uptime` are
/// whole seconds, and kura takes them from two clocks).
const START_TIME_SLACK_S: i64 = 1;
/// Longest `run_id` accepted (Redis' are 40 hex digits).
const RUN_ID_LENGTH_MAX: usize = 64;

impl Instance {
    /// The instance a `stats` reply names, if it names one.
    pub fn from_stats(stats: &[(&[u8], &[u8])]) -> Option<Self> {
        let text = |name: &[u8]| stats.iter().find(|(n, _)| *n == name).and_then(|(_, v)| std::str::from_utf8(v).ok());
        if let Some(id) = text(b"kura_instance_id").and_then(|v| u64::from_str_radix(v, 16).ok()) {
            return Some(Self::Kura(id));
        }
        let number = |name: &[u8]| text(name).and_then(|v| v.parse::<i64>().ok());
        let pid = u64::try_from(number(b"pid")?).ok()?;
        Some(Self::Process { pid, started_unix_s: number(b"time")? - number(b"uptime")? })
    }

    /// The instance a Redis `INFO server` reply names, if it names one.
    pub fn from_redis_info(info: &[u8]) -> Option<Self> {
        let line = info.split(|&b| b == b'\n').find_map(|line| line.strip_prefix(b"run_id:"))?;
        let id = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
        let plausible = !id.is_empty() && id.len() <= RUN_ID_LENGTH_MAX && id.bytes().all(|b| b.is_ascii_alphanumeric());
        plausible.then(|| Self::RunId(id.to_owned()))
    }

    /// Whether both name the same process start.
    pub fn same_start(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Process { pid: a, started_unix_s: s }, Self::Process { pid: b, started_unix_s: t }) => a == b && (s - t).abs() <= START_TIME_SLACK_S,
            _ => self == other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_stats() {
        let kura: &[(&[u8], &[u8])] = &[(b"pid", b"9"), (b"uptime", b"5"), (b"time", b"1000"), (b"kura_instance_id", b"00000000000000ff")];
        assert_eq!(Instance::from_stats(kura), Some(Instance::Kura(255)));
        let memcached: &[(&[u8], &[u8])] = &[(b"pid", b"9"), (b"uptime", b"5"), (b"time", b"1000"), (b"version", b"1.6.18")];
        assert_eq!(Instance::from_stats(memcached), Some(Instance::Process { pid: 9, started_unix_s: 995 }));
        assert_eq!(Instance::from_stats(&[(b"pid", b"9"), (b"uptime", b"5")]), None);
        assert_eq!(Instance::from_stats(&[(b"pid", b"-9"), (b"uptime", b"5"), (b"time", b"1000")]), None);
        assert_eq!(Instance::from_stats(&[(b"pid", b"x"), (b"uptime", b"5"), (b"time", b"1000")]), None);
        assert_eq!(Instance::from_stats(&[]), None);
    }

    #[test]
    fn from_redis_info() {
        let info = b"# Server\r\nredis_version:7.0.15\r\nprocess_id:12\r\nrun_id:3c5e2f0a9b\r\ntcp_port:6379\r\n";
        assert_eq!(Instance::from_redis_info(info), Some(Instance::RunId("3c5e2f0a9b".into())));
        assert_eq!(Instance::from_redis_info(b"# Server\r\nrun_id:\r\n"), None);
        assert_eq!(Instance::from_redis_info(b"run_id:a b\r\n"), None);
        assert_eq!(Instance::from_redis_info(b"redis_version:7\r\n"), None);
    }

    #[test]
    fn same_start() {
        let at = |pid, started_unix_s| Instance::Process { pid, started_unix_s };
        assert!(at(9, 995).same_start(&at(9, 996)) && at(9, 995).same_start(&at(9, 994)));
        assert!(!at(9, 995).same_start(&at(9, 997)));
        assert!(!at(9, 995).same_start(&at(10, 995)));
        assert!(Instance::Kura(1).same_start(&Instance::Kura(1)));
        assert!(!Instance::Kura(1).same_start(&Instance::Kura(2)));
        assert!(!Instance::Kura(1).same_start(&at(1, 1)));
    }
}
