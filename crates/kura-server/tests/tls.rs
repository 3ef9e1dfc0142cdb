//! TLS (`-Z` and memcached's `-o ssl_*` options), compared with a real memcached 1.6.18 (built
//! with TLS, as Debian's is) started with the same switches and certificates: the same
//! replies through TLS, the same settings and counters, client certificates as
//! `ssl_verify_mode` says, `refresh_certs`, plain clients refused, and what is refused at
//! startup. The certificates are made with the `openssl` CLI; the client is rustls.

mod common;

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{Client, Kura, Memcached, SERVER_BIN, SMALL, eventually};
use kura_testkit::{require_cmd, try_or_skip};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A CA, a server certificate for `localhost`/127.0.0.1 and a client certificate it signed,
/// a second server certificate (for `refresh_certs`), and a client certificate no one signed.
struct Certs {
    files: kura_testkit::TestCerts,
}

impl Certs {
    fn make() -> Result<Self, String> {
        Ok(Self { files: kura_testkit::TestCerts::make()? })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.files.path(name)
    }

    fn arg(&self, name: &str) -> String {
        self.files.arg(name)
    }

    /// `-o` for the server certificate, with `extra` options.
    fn options(&self, extra: &str) -> String {
        let mut o = format!("ssl_chain_cert={},ssl_key={}", self.arg("server.pem"), self.arg("server-key.pem"));
        if !extra.is_empty() {
            o.push(',');
            o.push_str(extra);
        }
        o
    }

    /// A client that trusts the CA, with the client certificate `client` (`"client"`,
    /// `"rogue"`) or none, speaking `versions`.
    fn client(&self, client: Option<&str>, versions: &[&'static rustls::SupportedProtocolVersion]) -> Arc<rustls::ClientConfig> {
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(self.roots());
        let config = match client {
            None => builder.with_no_client_auth(),
            Some(name) => {
                let chain = vec![CertificateDer::from_pem_file(self.path(&format!("{name}.pem"))).unwrap()];
                let key = PrivateKeyDer::from_pem_file(self.path(&format!("{name}-key.pem"))).unwrap();
                builder.with_client_auth_cert(chain, key).unwrap()
            }
        };
        Arc::new(config)
    }

    /// The test CA, the one root clients trust.
    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(self.path("ca.pem")).unwrap()).unwrap();
        roots
    }

    /// A client without a certificate that offers only `suites` (and speaks only their
    /// protocol versions).
    fn client_offering(&self, suites: &[rustls::SupportedCipherSuite]) -> Arc<rustls::ClientConfig> {
        let provider = rustls::crypto::CryptoProvider { cipher_suites: suites.to_vec(), ..rustls::crypto::ring::default_provider() };
        let versions: Vec<&'static rustls::SupportedProtocolVersion> = suites.iter().map(|s| s.version()).collect();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider)).with_protocol_versions(&versions).unwrap().with_root_certificates(self.roots()).with_no_client_auth();
        Arc::new(config)
    }
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// Connects and completes the handshake (with TLS 1.3 a refused client certificate shows
/// only at the first read).
fn connect(port: u16, config: &Arc<rustls::ClientConfig>) -> io::Result<Tls> {
    connect_with(TcpStream::connect(("127.0.0.1", port))?, config)
}

fn connect_with(sock: TcpStream, config: &Arc<rustls::ClientConfig>) -> io::Result<Tls> {
    sock.set_read_timeout(Some(common::READ_TIMEOUT))?;
    sock.set_nodelay(true)?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = rustls::StreamOwned::new(rustls::ClientConnection::new(Arc::clone(config), name).unwrap(), sock);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// Sends `script` then `mn`, and returns what came before `MN`.
fn exchange(tls: &mut Tls, script: &[u8]) -> io::Result<Vec<u8>> {
    tls.write_all(script)?;
    tls.write_all(b"mn\r\n")?;
    tls.flush()?;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    while !got.ends_with(b"MN\r\n") {
        let n = tls.read(&mut buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("closed after {} bytes", got.len())));
        }
        got.extend_from_slice(&buf[..n]);
    }
    got.truncate(got.len() - 4);
    Ok(got)
}

/// One script on a new TLS connection.
fn transcript(port: u16, config: &Arc<rustls::ClientConfig>, script: &[u8]) -> String {
    let mut tls = connect(port, config).unwrap_or_else(|e| panic!("TLS connect to {port}: {e}"));
    String::from_utf8_lossy(&exchange(&mut tls, script).unwrap()).into_owned()
}

/// `stats` or `stats settings` through TLS, as a map.
fn stats(port: u16, config: &Arc<rustls::ClientConfig>, group: &str) -> std::collections::HashMap<String, String> {
    let text = transcript(port, config, format!("stats {group}\r\n").as_bytes());
    text.lines()
        .filter_map(|l| l.strip_prefix("STAT "))
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

const SSL_SETTINGS: &[&str] = &[
    "ssl_enabled", "ssl_chain_cert", "ssl_key", "ssl_verify_mode", "ssl_keyformat", "ssl_ciphers", "ssl_ca_cert", "ssl_wbuf_size",
    "ssl_session_cache", "ssl_kernel_tls", "ssl_min_version",
];

const TLS_BOTH: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13, &rustls::version::TLS12];

/// Requests through TLS get memcached's replies; `stats settings` shows the same ssl_*
/// settings; and without -Z the settings and `refresh_certs` are memcached's too.
#[test]
fn replies_through_tls_are_memcacheds() {
    let certs = try_or_skip!(Certs::make());
    let options = certs.options("ssl_wbuf_size=32,ssl_session_cache");
    let kura = Kura::start(&["-Z", "-o", &options]);
    let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
    let big = "v".repeat(50_000);
    let scripts: Vec<Vec<u8>> = vec![
        b"set a 5 0 3\r\nabc\r\nget a\r\nappend a 0 0 2\r\nde\r\nget a nx a\r\ndelete a\r\nget a\r\n".to_vec(),
        b"set n 0 0 2\r\n10\r\nincr n 5\r\ndecr n 100\r\nms m 2 T0 F3\r\nhi\r\nmg m v f k s\r\nmd m q\r\nmg m v\r\n".to_vec(),
        b"set q 0 0 1 noreply\r\nx\r\nget q\r\nbogus\r\nset x 0 0 z\r\nversion_\r\n".to_vec(),
        format!("set big 0 0 {}\r\n{big}\r\nget big\r\nmg big s v\r\n", big.len()).into_bytes(),
        // A deep pipeline in one write.
        (0..300).map(|i| format!("set p{i} 0 0 {}\r\n{i}\r\nget p{i}\r\n", i.to_string().len())).collect::<String>().into_bytes(),
    ];
    let client = certs.client(None, TLS_BOTH);
    for script in &scripts {
        let (ours, theirs) = (transcript(kura.port, &client, script), transcript(memcached.port, &client, script));
        assert!(ours == theirs, "{}:\nkura:\n{ours}\nmemcached:\n{theirs}", String::from_utf8_lossy(&script[..script.len().min(200)]));
    }
    let (ours, theirs) = (stats(kura.port, &client, "settings"), stats(memcached.port, &client, "settings"));
    for name in SSL_SETTINGS {
        assert_eq!(ours.get(*name), theirs.get(*name), "stats settings {name}");
    }
    assert_eq!(ours["ssl_enabled"], "yes");
    assert_eq!(ours["ssl_session_cache"], "yes");
    let (ours, theirs) = (stats(kura.port, &client, ""), stats(memcached.port, &client, ""));
    for name in ["ssl_handshake_errors", "time_since_server_cert_refresh"] {
        assert!(ours.contains_key(name) && theirs.contains_key(name), "stats {name}");
    }
    // TLS 1.2 too, with both.
    let tls12 = certs.client(None, &[&rustls::version::TLS12]);
    assert_eq!(transcript(kura.port, &tls12, b"version\r\nset t 0 0 1\r\n1\r\n"), format!("VERSION {}\r\nSTORED\r\n", ours["version"]));
    assert_eq!(transcript(memcached.port, &tls12, b"set t 0 0 1\r\n1\r\n"), "STORED\r\n");

    // Without -Z.
    let kura = Kura::start(&[]);
    let memcached = try_or_skip!(Memcached::start(&[]));
    let (mut ours, mut theirs) = (kura.client(), Client::connect(memcached.port));
    let (ours_settings, theirs_settings) = (ours.settings(), theirs.settings());
    for name in SSL_SETTINGS {
        assert_eq!(ours_settings.get(*name), theirs_settings.get(*name), "stats settings {name} without -Z");
    }
    assert!(!ours.stats().contains_key("ssl_handshake_errors"));
    for c in [&mut ours, &mut theirs] {
        c.expect("refresh_certs\r\n", "Error TLS not enabled\r\n");
        c.expect("refresh_certs noreply\r\nmn\r\n", "Error TLS not enabled\r\nMN\r\n");
    }
}

/// A client that does not speak TLS gets no reply, the failure is counted (and a client that
/// leaves before its handshake), and others are served; the same with memcached.
#[test]
fn plain_clients_fail_the_handshake() {
    let certs = try_or_skip!(Certs::make());
    let options = certs.options("");
    let kura = Kura::start(&["-Z", "-o", &options]);
    let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
    let client = certs.client(None, TLS_BOTH);
    for (name, port) in [("kura", kura.port), ("memcached", memcached.port)] {
        let errors = |c: &Arc<rustls::ClientConfig>| stats(port, c, "")["ssl_handshake_errors"].parse::<u64>().unwrap();
        let before = errors(&client);
        let mut plain = Client::connect(port);
        plain.send("version\r\n");
        let got = plain.read_to_close().unwrap_or_default();
        assert!(!String::from_utf8_lossy(&got).contains("VERSION"), "{name}: a plain client was answered");
        // memcached (the anchor) does not always count these: it missed the plain client once
        // in CI and the client gone before its handshake in 2 of 6 runs beside this file's
        // other tests, depending on when its worker first reads the socket. So only kura's
        // counts are held to it; memcached's are printed.
        let counts = |before: u64, what: &str| {
            let counted = eventually(Duration::from_secs(5), || errors(&client) > before);
            if name == "kura" {
                assert!(counted, "{name}: ssl_handshake_errors after {what}");
            } else if !counted {
                println!("{name} did not count {what} this time");
            }
        };
        counts(before, "a plain client");
        // A client that leaves before the handshake is counted too.
        let before = errors(&client);
        drop(TcpStream::connect(("127.0.0.1", port)).unwrap());
        counts(before, "a client gone before the handshake");
        assert_eq!(transcript(port, &client, b"set k 0 0 1\r\nv\r\n"), "STORED\r\n", "{name}");
    }
}

/// Replies far larger than what a socket and the session buffer hold, to a client that reads
/// late, arrive whole and in order; `quit` after them closes only once they are all sent.
#[test]
fn large_replies_to_a_slow_reader_arrive_whole() {
    let certs = try_or_skip!(Certs::make());
    let kura = Kura::start(&["-Z", "-o", &certs.options("")]);
    let client = certs.client(None, TLS_BOTH);
    // A small receive buffer, set before the connection opens, keeps the TCP window small:
    // the server's socket is full most of the time.
    let mut tls = connect_with(tcp_with_receive_buffer(kura.port, 16 << 10), &client).unwrap();
    let values: Vec<Vec<u8>> = (0..40u32).map(|i| (0..60_000u32).map(|j| b'a' + ((i * 7 + j * 13 + j / 251) % 26) as u8).collect()).collect();
    let mut script = Vec::new();
    for (i, v) in values.iter().enumerate() {
        script.extend_from_slice(format!("set k{i} 0 0 {} noreply\r\n", v.len()).as_bytes());
        script.extend_from_slice(v);
        script.extend_from_slice(b"\r\n");
    }
    assert_eq!(exchange(&mut tls, &script).unwrap(), b"");
    let keys = (0..values.len()).map(|i| format!("k{i}")).collect::<Vec<_>>().join(" ");
    const ROUNDS: usize = 6;
    for _ in 0..ROUNDS {
        tls.write_all(format!("get {keys}\r\n").as_bytes()).unwrap();
    }
    tls.write_all(b"quit\r\n").unwrap();
    tls.flush().unwrap();
    // ~14 MB of replies wait while the client sleeps, then go to a client that takes them
    // slowly: the socket stays full, and the session holds what it does not take.
    std::thread::sleep(Duration::from_millis(300));
    let mut got = Vec::new();
    let mut buf = vec![0u8; 32 << 10];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // kura and memcached close after quit without close_notify when the client sent none.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => panic!("after {} bytes: {e}", got.len()),
        }
        std::thread::sleep(Duration::from_micros(1500));
    }
    let mut expected = Vec::new();
    for _ in 0..ROUNDS {
        for (i, v) in values.iter().enumerate() {
            expected.extend_from_slice(format!("VALUE k{i} 0 {}\r\n", v.len()).as_bytes());
            expected.extend_from_slice(v);
            expected.extend_from_slice(b"\r\n");
        }
        expected.extend_from_slice(b"END\r\n");
    }
    assert!(got == expected, "{} bytes of {} arrived (first difference at {:?})", got.len(), expected.len(), got.iter().zip(&expected).position(|(a, b)| a != b));
}

/// ssl_verify_mode=2 with a CA: only clients with a certificate the CA signed are served;
/// =1: clients without one too, never one the CA did not sign. As memcached.
#[test]
fn client_certificates_as_verify_mode_says() {
    let certs = try_or_skip!(Certs::make());
    for (mode, anonymous_served) in [(2, false), (1, true)] {
        let options = certs.options(&format!("ssl_ca_cert={},ssl_verify_mode={mode}", certs.arg("ca.pem")));
        let kura = Kura::start(&["-Z", "-o", &options]);
        let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
        for (name, port) in [("kura", kura.port), ("memcached", memcached.port)] {
            for (client, served) in [(Some("client"), true), (None, anonymous_served), (Some("rogue"), false)] {
                let config = certs.client(client, TLS_BOTH);
                let result = connect(port, &config).and_then(|mut tls| exchange(&mut tls, b"set c 0 0 1\r\nv\r\n"));
                match result {
                    Ok(reply) => assert!(served && reply == b"STORED\r\n", "{name} mode {mode}: {client:?} was served: {reply:?}"),
                    Err(e) => assert!(!served, "{name} mode {mode}: {client:?} was refused: {e}"),
                }
            }
        }
    }
}

/// ssl_min_version=3: TLS 1.3 only; a TLS 1.2 client is refused.
#[test]
fn min_version_3_refuses_tls12() {
    let certs = try_or_skip!(Certs::make());
    let options = certs.options("ssl_min_version=3");
    let kura = Kura::start(&["-Z", "-o", &options]);
    let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
    for port in [kura.port, memcached.port] {
        assert!(connect(port, &certs.client(None, &[&rustls::version::TLS12])).is_err());
        assert_eq!(transcript(port, &certs.client(None, &[&rustls::version::TLS13]), b"set m 0 0 1\r\nv\r\n"), "STORED\r\n");
    }
    assert_eq!(stats(kura.port, &certs.client(None, TLS_BOTH), "settings")["ssl_min_version"], "tlsv1.3");
}

/// ssl_ciphers chooses TLS 1.2's ciphers as OpenSSL reads the list, and leaves TLS 1.3's; a
/// list that chooses none stops the start (in bad_tls_setups_are_refused_at_startup). As
/// memcached. (The lists hold no comma: -o splits on them.)
#[test]
fn ssl_ciphers_choose_the_tls12_ciphers() {
    use rustls::crypto::ring::cipher_suite::*;
    let certs = try_or_skip!(Certs::make());
    // The server's certificate is ECDSA: of each list, (a cipher served, one refused).
    let cases = [
        ("ECDHE-ECDSA-AES256-GCM-SHA384", TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256),
        ("HIGH:!AESGCM", TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384),
        ("ECDHE+AES128:CHACHA20:-CHACHA20", TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256),
    ];
    for (list, served, refused) in cases {
        let options = certs.options(&format!("ssl_ciphers={list}"));
        let kura = Kura::start(&["-Z", "-o", &options]);
        let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
        for (name, port) in [("kura", kura.port), ("memcached", memcached.port)] {
            let mut tls = connect(port, &certs.client_offering(&[served])).unwrap_or_else(|e| panic!("{name} {list}: {served:?}: {e}"));
            assert_eq!(tls.conn.negotiated_cipher_suite(), Some(served));
            assert_eq!(exchange(&mut tls, b"set c 0 0 1\r\nv\r\n").unwrap(), b"STORED\r\n");
            assert!(connect(port, &certs.client_offering(&[refused])).is_err(), "{name} {list}: {refused:?} was served");
            let tls13 = certs.client_offering(&[TLS13_AES_128_GCM_SHA256]);
            assert_eq!(transcript(port, &tls13, b"get c\r\n"), "VALUE c 0 1\r\nv\r\nEND\r\n", "{name} {list}: TLS 1.3");
            assert_eq!(stats(port, &tls13, "settings")["ssl_ciphers"], list, "{name}");
        }
    }
}

/// A client's second connection resumes its session, with or without ssl_session_cache
/// (the server keeps the sessions, or the client a ticket), as with memcached.
#[test]
fn clients_resume_sessions() {
    let certs = try_or_skip!(Certs::make());
    for extra in ["ssl_session_cache", ""] {
        let kura = Kura::start(&["-Z", "-o", &certs.options(extra)]);
        let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &certs.options(extra)]));
        for (name, port) in [("kura", kura.port), ("memcached", memcached.port)] {
            // One configuration: rustls keeps its sessions there.
            let client = certs.client(None, TLS_BOTH);
            let mut first = connect(port, &client).unwrap();
            // TLS 1.3 sends the session after the handshake: a reply makes sure it arrived.
            assert!(exchange(&mut first, b"version\r\n").unwrap().starts_with(b"VERSION"));
            let second = connect(port, &client).unwrap();
            assert_eq!(second.conn.handshake_kind(), Some(rustls::HandshakeKind::Resumed), "{name} -o {extra:?}");
        }
    }
}

/// refresh_certs reads the files again: new connections get the new certificate, old ones
/// keep working; files that cannot be loaded are refused with memcached's kind of line and
/// the certificate in use stays.
#[test]
fn refresh_certs_loads_the_files_again() {
    let certs = try_or_skip!(Certs::make());
    let live_cert = certs.path("live.pem");
    let live_key = certs.path("live-key.pem");
    let install = |name: &str| {
        std::fs::copy(certs.path(&format!("{name}.pem")), &live_cert).unwrap();
        std::fs::copy(certs.path(&format!("{name}-key.pem")), &live_key).unwrap();
    };
    install("server");
    let options = format!("ssl_chain_cert={},ssl_key={}", live_cert.display(), live_key.display());
    let kura = Kura::start(&["-Z", "-o", &options]);
    let memcached = try_or_skip!(Memcached::start(&["-Z", "-o", &options]));
    let client = certs.client(None, TLS_BOTH);
    // A new client configuration each time: a resumed session would show the certificate
    // of the session's first handshake.
    let server_cert = |port: u16| connect(port, &certs.client(None, TLS_BOTH)).unwrap().conn.peer_certificates().unwrap()[0].as_ref().to_vec();
    let pem_der = |name: &str| CertificateDer::from_pem_file(certs.path(&format!("{name}.pem"))).unwrap().as_ref().to_vec();
    let mut kept = connect(kura.port, &client).unwrap();
    assert!(server_cert(kura.port) == pem_der("server"));
    install("server2");
    assert_eq!(transcript(kura.port, &client, b"refresh_certs\r\n"), "OK\r\n");
    assert_eq!(transcript(memcached.port, &client, b"refresh_certs\r\n"), "OK\r\n");
    assert!(server_cert(kura.port) == pem_der("server2"), "kura serves the new certificate");
    assert!(server_cert(memcached.port) == pem_der("server2"), "memcached serves the new certificate");
    assert_eq!(exchange(&mut kept, b"set old 0 0 1\r\nv\r\n").unwrap(), b"STORED\r\n");
    assert_eq!(transcript(kura.port, &client, b"refresh_certs noreply\r\n"), "");
    // A broken certificate file: the same first words as memcached, the old certificate stays.
    std::fs::write(&live_cert, "not a certificate\n").unwrap();
    let ours = transcript(kura.port, &client, b"refresh_certs\r\n");
    let theirs = transcript(memcached.port, &client, b"refresh_certs\r\n");
    const PREFIX: &str = "Error loading the certificate chain: ";
    assert!(ours.starts_with(PREFIX) && theirs.starts_with(PREFIX), "kura: {ours:?}\nmemcached: {theirs:?}");
    assert!(ours.contains("live.pem") && ours.ends_with("\r\n") && ours.lines().count() == 1, "{ours:?}");
    assert!(server_cert(kura.port) == pem_der("server2"));
    assert!(stats(kura.port, &client, "")["time_since_server_cert_refresh"].parse::<u64>().is_ok());
    // A line break in the file's name does not break the reply in two lines.
    let odd_cert = certs.path("odd\r\nEND.pem");
    std::fs::copy(certs.path("server.pem"), &odd_cert).unwrap();
    let odd = Kura::start(&["-Z", "-o", &format!("ssl_chain_cert={},ssl_key={}", odd_cert.display(), certs.path("server-key.pem").display())]);
    std::fs::write(&odd_cert, "not a certificate\n").unwrap();
    let reply = transcript(odd.port, &client, b"refresh_certs\r\nversion\r\n");
    let lines: Vec<&str> = reply.split_terminator("\r\n").collect();
    assert!(lines.len() == 2 && lines[0].starts_with(PREFIX) && lines[0].contains("odd") && lines[1].starts_with("VERSION "), "{reply:?}");
}

/// `-l notls:ADDR:PORT` stays plain under -Z while the other listeners speak TLS.
#[test]
fn notls_listeners_stay_plain() {
    let certs = try_or_skip!(Certs::make());
    let plain_port = kura_testkit::free_tcp_port().unwrap();
    let listen = format!("notls:127.0.0.1:{plain_port},127.0.0.1");
    let kura = Kura::start(&["-Z", "-o", &certs.options(""), "-l", &listen]);
    let mut plain = Client::connect(plain_port);
    plain.expect("set p 0 0 1\r\nx\r\n", "STORED\r\n");
    assert_eq!(transcript(kura.port, &certs.client(None, TLS_BOTH), b"get p\r\n"), "VALUE p 0 1\r\nx\r\nEND\r\n");
}

/// What cannot work is refused at startup with the reason, as memcached refuses it.
#[test]
fn bad_tls_setups_are_refused_at_startup() {
    let certs = try_or_skip!(Certs::make());
    let tmp = tempfile::tempdir().unwrap();
    let cert = certs.arg("server.pem");
    let key = certs.arg("server-key.pem");
    let missing = tmp.path().join("missing.pem");
    let sock = tmp.path().join("k.sock");
    let cases: Vec<(Vec<String>, &str, bool)> = vec![
        (vec!["-Z".into()], "ssl_chain_cert", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={}", missing.display())], "missing.pem", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={cert}")], "no PEM private key", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_verify_mode=5")], "Invalid ssl_verify_mode", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_min_version=x")], "could not parse argument to ssl_min_version", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_ca_cert={}", missing.display())], "missing.pem", true),
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_ciphers=NOSUCHCIPHER:ALSONOTONE")], "Error setting the provided cipher(s)", true),
        // Ciphers memcached's OpenSSL has and kura does not: kura refuses rather than ignores.
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_ciphers=AES128-SHA:DHE-RSA-AES256-GCM-SHA384")], "ECDHE-ECDSA-AES256-GCM-SHA384", false),
        // memcached refuses -Z without a TCP port (-p 0), but with -s (which turns TCP off)
        // and a port it starts and serves the socket in plain text.
        (vec!["-Z".into(), "-s".into(), sock.to_str().unwrap().into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key}")], "TCP", false),
        // memcached starts, and refuses every client certificate.
        (vec!["-Z".into(), "-o".into(), format!("ssl_chain_cert={cert},ssl_key={key},ssl_verify_mode=2")], "ssl_ca_cert", false),
    ];
    let memcached = require_cmd("memcached").ok();
    for (args, reason, memcached_refuses) in cases {
        let mut kura = Command::new(SERVER_BIN);
        kura.args(SMALL).arg("--path").arg(tmp.path().join("store.kura")).args(["-p", "0"]).args(&args);
        let (status, stderr) = exit_of(&mut kura);
        assert!(status.is_some_and(|s| !s.success()) && stderr.contains(reason), "{args:?}: {status:?} {stderr}");
        if let (Some(bin), true) = (&memcached, memcached_refuses) {
            let port = kura_testkit::free_tcp_port().unwrap().to_string();
            let (status, stderr) = exit_of(Command::new(bin).args(["-u", "root", "-U", "0", "-p", &port, "-l", "127.0.0.1"]).args(&args));
            assert!(status.is_some_and(|s| !s.success()), "memcached {args:?}: {status:?} {stderr}");
        }
    }
}

/// How a server that should refuse to start ended, and its stderr; `None` when it was still
/// running after 10 s (then killed).
fn exit_of(command: &mut Command) -> (Option<std::process::ExitStatus>, String) {
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let exited = eventually(Duration::from_secs(10), || child.try_wait().unwrap().is_some());
    if !exited {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    (exited.then_some(out.status), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A TCP connection to 127.0.0.1:`port` whose receive buffer was set before it connected.
fn tcp_with_receive_buffer(port: u16, bytes: libc::c_int) -> TcpStream {
    use std::os::fd::FromRawFd as _;
    // SAFETY: socket(2) with constant arguments; the descriptor is owned by the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
    // SAFETY: `fd` is a socket we own; it is closed once, by the TcpStream.
    let sock = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: a valid socket and a c_int option value that lives across the call.
    let rc = unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, (&raw const bytes).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t) };
    assert_eq!(rc, 0, "SO_RCVBUF: {}", io::Error::last_os_error());
    let addr = libc::sockaddr_in { sin_family: libc::AF_INET as libc::sa_family_t, sin_port: port.to_be(), sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() }, sin_zero: [0; 8] };
    // SAFETY: a valid socket and a sockaddr_in that lives across the call, with its size.
    let rc = unsafe { libc::connect(fd, (&raw const addr).cast(), std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t) };
    assert_eq!(rc, 0, "connect: {}", io::Error::last_os_error());
    sock.set_read_timeout(Some(common::READ_TIMEOUT)).unwrap();
    sock
}
