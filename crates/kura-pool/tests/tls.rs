//! Pools of TLS nodes: `kura+tls://` to `kura serve -Z`, `memcached+tls://` to a memcached
//! 1.6 started with `-Z` (Debian's is built with TLS), `rediss://` to a redis-server on its
//! `--tls-port`, `rediss+cluster://` to a Redis Cluster with `tls-cluster yes`; client
//! certificates, a CA that did not sign the server's certificate, a
//! node that does not speak TLS, and the URL's mistakes. Certificates come from the `openssl`
//! CLI.

mod common;

use std::time::Duration;

use common::{KuraNode, Memcached, START_TIMEOUT, value_of};
use kura_pool::{Outcome, Pool, PoolConfig, block_key};
use kura_testkit::{ChildGuard, TestCerts, require_cmd, spawn_listening, try_or_skip};

fn open(url: &str) -> Result<Pool, kura_pool::Error> {
    let mut config = PoolConfig::from_urls(&[url])?;
    config.request_timeout = Duration::from_secs(10);
    config.connect_timeout = Duration::from_secs(5);
    Pool::open(config)
}

fn server_options(certs: &TestCerts, extra: &str) -> String {
    format!("ssl_chain_cert={},ssl_key={}{extra}", certs.arg("server.pem"), certs.arg("server-key.pem"))
}

/// Values far larger than a TLS record, many in flight: replies fill the receive buffer and
/// requests fill the socket, so the session's buffered plaintext and its unsent ciphertext
/// are both in play.
fn large_values_round_trip(pool: &Pool, value_bytes: usize) {
    const KEYS: u64 = 64;
    const DEPTH: usize = 16;
    let value = |i: u64| -> Vec<u8> { value_of(i).into_iter().cycle().skip(i as usize).take(value_bytes).collect() };
    let mut ctx = pool.context().unwrap();
    let (mut next, mut done) = (0u64, 0u64);
    while done < KEYS {
        while next < KEYS && ctx.in_flight() < DEPTH {
            ctx.submit_set(&block_key(7, next), &value(next), next).unwrap();
            next += 1;
        }
        ctx.poll(None, &mut |c| {
            c.result.unwrap_or_else(|e| panic!("set {}: {e}", c.token));
            done += 1;
        })
        .unwrap();
    }
    ctx.flush().unwrap();
    let (mut next, mut done) = (0u64, 0u64);
    while done < KEYS {
        while next < KEYS && ctx.in_flight() < DEPTH {
            ctx.submit_get(&block_key(7, next), next).unwrap();
            next += 1;
        }
        ctx.poll(None, &mut |c| match c.result {
            Ok(Outcome::Value(v)) => {
                assert!(v == value(c.token).as_slice(), "value {} came back changed", c.token);
                done += 1;
            }
            other => panic!("get {}: {other:?}", c.token),
        })
        .unwrap();
    }
}

#[test]
fn kura_servers_over_tls_serve_the_pool() {
    let certs = try_or_skip!(TestCerts::make());
    let mut node = KuraNode::start(&["-Z", "-o", &server_options(&certs, "")]);
    let url = format!("kura+tls://localhost:{}?ca={}", node.port, certs.arg("ca.pem"));
    let pool = open(&url).unwrap();
    let stats = common::exercise(&pool, true);
    assert!(stats.connects >= 1, "{stats:?}");
    large_values_round_trip(&pool, 60_000);
    // The IP address in the certificate is checked as such.
    let by_ip = open(&format!("kura+tls://127.0.0.1:{}?ca={}", node.port, certs.arg("ca.pem"))).unwrap();
    assert_eq!(by_ip.context().unwrap().get(&block_key(1, 7)).unwrap(), Some(value_of(7)));
    // A restart while the connection is idle: the context sees the close (under TLS, past the
    // session tickets that came after the handshake) and the next request goes on a new one.
    let mut ctx = by_ip.context().unwrap();
    ctx.set(&block_key(2, 1), &value_of(1)).unwrap();
    ctx.flush().unwrap();
    node.stop();
    node.restart();
    assert_eq!(ctx.get(&block_key(2, 1)).unwrap(), Some(value_of(1)), "the first request after an idle restart");
}

#[test]
fn a_server_certificate_the_ca_did_not_sign_or_for_another_name_is_refused() {
    let certs = try_or_skip!(TestCerts::make());
    let node = KuraNode::start(&["-Z", "-o", &server_options(&certs, "")]);
    // A CA file that signed nothing of the server's.
    let pool = open(&format!("kura+tls://localhost:{}?ca={}", node.port, certs.arg("rogue.pem"))).unwrap();
    let e = pool.context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("TLS handshake") && e.contains("certificate"), "{e}");
    // The right CA, but a name the certificate does not carry.
    let pool = open(&format!("kura+tls://127.0.0.1:{}?ca={}&sni=kura.example", node.port, certs.arg("ca.pem"))).unwrap();
    let e = pool.context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("TLS handshake") && e.contains("not valid for name \"kura.example\""), "{e}");
    // A plain node: the handshake gets no TLS answer.
    let plain = KuraNode::start(&[]);
    let pool = open(&format!("kura+tls://localhost:{}?ca={}", plain.port, certs.arg("ca.pem"))).unwrap();
    let e = pool.context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("TLS handshake") && e.contains("does not speak TLS"), "{e}");
}

#[test]
fn memcached_over_tls_with_a_client_certificate() {
    let certs = try_or_skip!(TestCerts::make());
    let options = server_options(&certs, &format!(",ssl_ca_cert={},ssl_verify_mode=2", certs.arg("ca.pem")));
    let memcached = try_or_skip!(Memcached::start_with(&["-Z", "-o", &options]));
    let base = format!("memcached+tls://localhost:{}?ca={}", memcached.port, certs.arg("ca.pem"));
    let pool = open(&format!("{base}&cert={}&key={}", certs.arg("client.pem"), certs.arg("client-key.pem"))).unwrap();
    common::exercise(&pool, true);
    large_values_round_trip(&pool, 200_000);
    large_values_round_trip(&pool, 60_000);
    large_values_round_trip(&pool, 5_000);
    // Without a certificate memcached ends the handshake.
    let without = open(&base).unwrap();
    let e = without.context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("handshake") && e.contains("CertificateRequired"), "{e}");
    // A certificate the CA did not sign: refused too.
    let rogue = open(&format!("{base}&cert={}&key={}", certs.arg("rogue.pem"), certs.arg("rogue-key.pem"))).unwrap();
    let e = rogue.context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("handshake") && e.contains("UnknownCA"), "{e}");
}

/// A redis-server listening only on its TLS port, clients not asked for certificates.
fn redis_tls(certs: &TestCerts) -> Result<(ChildGuard, u16, tempfile::TempDir), String> {
    redis_tls_with(certs, &[])
}

/// [`redis_tls`] with more of redis-server's switches.
fn redis_tls_with(certs: &TestCerts, extra: &[&str]) -> Result<(ChildGuard, u16, tempfile::TempDir), String> {
    let bin = require_cmd("redis-server")?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (child, port) = spawn_listening("redis-server", START_TIMEOUT, |port| {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--tls-cert-file", &certs.arg("server.pem"), "--tls-key-file", &certs.arg("server-key.pem"), "--tls-ca-cert-file", &certs.arg("ca.pem"), "--tls-auth-clients", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd
    })
    .map_err(|e| e.to_string())?;
    Ok((child, port, dir))
}

#[test]
fn redis_over_tls() {
    let certs = try_or_skip!(TestCerts::make());
    let (_redis, port, _dir) = try_or_skip!(redis_tls(&certs));
    let pool = open(&format!("rediss://localhost:{port}?ca={}", certs.arg("ca.pem"))).unwrap();
    common::exercise(&pool, true);
    large_values_round_trip(&pool, 100_000);
}

/// Three redis-servers with `tls-cluster yes` made into a cluster of three masters, speaking
/// only TLS (clients not asked for certificates; the cluster bus, which always asks, gets the
/// client certificate).
struct TlsCluster {
    nodes: Vec<(ChildGuard, u16, tempfile::TempDir)>,
    ca: String,
}

impl TlsCluster {
    fn start(certs: &TestCerts) -> Result<Self, String> {
        require_cmd("redis-cli")?;
        let client = [certs.arg("client.pem"), certs.arg("client-key.pem")];
        let extra = ["--tls-client-cert-file", &client[0], "--tls-client-key-file", &client[1], "--tls-cluster", "yes", "--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--cluster-config-file", "nodes.conf"];
        let nodes = (0..3).map(|_| redis_tls_with(certs, &extra)).collect::<Result<Vec<_>, _>>()?;
        let cluster = Self { nodes, ca: certs.arg("ca.pem") };
        let addrs: Vec<String> = cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.1)).collect();
        let out = cluster.cli_command(cluster.nodes[0].1).args(["--cluster", "create"]).args(&addrs).args(["--cluster-replicas", "0", "--cluster-yes"]).output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("redis-cli --tls --cluster create failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !cluster.nodes.iter().all(|n| cluster.cli(n.1, &["cluster", "info"]).contains("cluster_state:ok")) {
            if std::time::Instant::now() > deadline {
                return Err("the TLS cluster did not become ok".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(cluster)
    }

    fn cli_command(&self, port: u16) -> std::process::Command {
        let mut cmd = std::process::Command::new("redis-cli");
        cmd.args(["--tls", "--cacert", &self.ca, "-h", "127.0.0.1", "-p", &port.to_string()]).stdin(std::process::Stdio::null());
        cmd
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        String::from_utf8_lossy(&self.cli_command(port).args(args).output().expect("redis-cli").stdout).into_owned()
    }
}

/// A pool on a Redis Cluster whose nodes speak only TLS: the slot map is read over TLS, and
/// keys reach every master at the address it announces, its certificate checked.
#[test]
fn redis_cluster_over_tls() {
    let certs = try_or_skip!(TestCerts::make());
    let cluster = try_or_skip!(TlsCluster::start(&certs));
    // No replicas: a flush waits for none.
    let pool = open(&format!("rediss+cluster://127.0.0.1:{}?ca={}&replicas=0", cluster.nodes[0].1, certs.arg("ca.pem"))).unwrap();
    common::exercise(&pool, true);
    large_values_round_trip(&pool, 100_000);
    let mut ctx = pool.context().unwrap();
    for i in 0..64u32 {
        ctx.set(format!("spread{i}").as_bytes(), b"v").unwrap();
    }
    for (_, port, _) in &cluster.nodes {
        let keys: u64 = cluster.cli(*port, &["dbsize"]).trim().parse().unwrap();
        assert!(keys > 0, "master {port} got none of the keys");
    }
    // A slot moved behind the pool's back: its old master answers MOVED with the new one's
    // address, which the pool reaches over TLS too.
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.1).collect();
    let key = (0u32..).map(|n| format!("moved{n}")).find(|k| ports.iter().all(|&p| cluster.cli(p, &["cluster", "countkeysinslot", &kura_pool::cluster_slot(k.as_bytes()).to_string()]).trim() == "0")).unwrap();
    let slot = kura_pool::cluster_slot(key.as_bytes()).to_string();
    let owner = *ports.iter().find(|&&p| !cluster.cli(p, &["get", &key]).contains("MOVED")).unwrap();
    let target = *ports.iter().find(|&&p| p != owner).unwrap();
    let target_id = cluster.cli(target, &["cluster", "myid"]).trim().to_owned();
    for &port in &ports {
        assert_eq!(cluster.cli(port, &["cluster", "setslot", &slot, "node", &target_id]).trim(), "OK");
    }
    let before = ctx.io_stats().redirects;
    ctx.set(key.as_bytes(), b"moved").unwrap();
    assert!(ctx.io_stats().redirects > before, "{:?}", ctx.io_stats());
    assert_eq!(cluster.cli(target, &["get", &key]).trim(), "moved");
    assert_eq!(ctx.get(key.as_bytes()).unwrap().as_deref(), Some(&b"moved"[..]));
    // A wrong name for every node: refused, and the requests that wait for a slot map say why.
    let mut config = PoolConfig::from_urls(&[format!("rediss+cluster://127.0.0.1:{}?ca={}&replicas=0&sni=other.example", cluster.nodes[0].1, certs.arg("ca.pem"))]).unwrap();
    config.request_timeout = Duration::from_secs(2);
    let e = Pool::open(config).unwrap().context().unwrap().get(b"k").unwrap_err().to_string();
    assert!(e.contains("slot map could not be read") && e.contains("not valid for name \"other.example\""), "{e}");
}

#[test]
fn tls_urls_are_checked_when_parsed() {
    let certs = try_or_skip!(TestCerts::make());
    let err = |url: &str| PoolConfig::from_urls(&[url]).unwrap_err().to_string();
    assert!(err(&format!("kura://localhost?ca={}", certs.arg("ca.pem"))).contains("for TLS nodes"));
    assert!(err(&format!("kura+tls:///run/kura.sock?ca={}", certs.arg("ca.pem"))).contains("TCP only"));
    assert!(err("kura+tls://localhost?ca=/nonexistent/ca.pem").contains("/nonexistent/ca.pem"));
    assert!(err(&format!("kura+tls://localhost?ca={}", certs.arg("server-key.pem"))).contains("no PEM certificate"));
    assert!(err(&format!("memcached+tls://localhost?ca={}&cert={}&key={}", certs.arg("ca.pem"), certs.arg("client.pem"), certs.arg("server-key.pem"))).contains("do not go together"));
    assert!(err(&format!("kura+tls://localhost?ca={}&key={}", certs.arg("ca.pem"), certs.arg("client-key.pem"))).contains("needs its key"));
    let cluster = PoolConfig::from_urls(&[format!("rediss+cluster://127.0.0.1:7000,127.0.0.1:7001?ca={}", certs.arg("ca.pem"))]).unwrap();
    assert!(cluster.nodes[0].tls.is_some() && cluster.nodes[0].addrs.len() == 2);
    // Defaults: the memcached port, the system's CA bundle when it is there.
    let config = PoolConfig::from_urls(&[format!("kura+tls://localhost?ca={}", certs.arg("ca.pem"))]).unwrap();
    assert_eq!(config.nodes[0].addrs, ["localhost:11211"]);
    if std::path::Path::new("/etc/ssl/certs/ca-certificates.crt").exists() {
        PoolConfig::from_urls(&["memcached+tls://localhost"]).unwrap();
    }
}
