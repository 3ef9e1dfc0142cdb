//! Small things every benchmark needs from the host: a free TCP port for a server it starts,
//! whether a tool is installed, and the median of its rounds.

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;

/// A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it for a listener that is
/// closed again); the benchmark starts its server on it and waits for it to listen.
pub fn free_tcp_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

/// Where `name` is installed: the first match on `PATH`, then in `/usr/bin` and `/usr/sbin`
/// (tools such as `memcached` or `losetup` live there and a sudo `PATH` may lack them).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The median of the finite values (the mean of the middle two for an even count); NaN when
/// there are none.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn finds_installed_tools_only() {
        assert!(which("sh").is_some());
        assert!(which("no-such-tool-kura").is_none());
    }

    #[test]
    fn free_port_can_be_bound() {
        let port = free_tcp_port().unwrap();
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    }
}
