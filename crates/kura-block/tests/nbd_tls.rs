//! TLS on `kura block nbd` (`--tls-cert`, `--tls-key`, `--tls`, `--tls-ca`) through real
//! clients: nbdinfo and nbdcopy (libnbd, gnutls), qemu-io and qemu-img (qemu's
//! `tls-creds-x509`), and a raw protocol client over rustls for the corners of the
//! protocol's TLS section. Certificates are made for each test with the `openssl` CLI.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{Backend, NbdProcess, kura_bin, pattern, run};
use kura_block::nbd::proto;
use kura_testkit::{require_cmd, try_or_skip};

/// A reply that does not come within this long fails the test instead of hanging it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// A throw-away CA, a server certificate for `localhost` / 127.0.0.1 it signed, and a client
/// certificate it signed, laid out as libnbd (gnutls) and qemu expect a client's directory:
/// `ca-cert.pem`, and in the directory with a client certificate `client-cert.pem` and
/// `client-key.pem` too.
struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    fn make() -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let d = dir.path();
        for sub in ["server", "client", "client-with-cert"] {
            std::fs::create_dir(d.join(sub)).map_err(|e| e.to_string())?;
        }
        let ssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(d).stdin(Stdio::null()).output().map_err(|e| e.to_string())?;
            if out.status.success() { Ok(()) } else { Err(format!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr))) }
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        ssl(&[&["req", "-x509"][..], &ec, &["-keyout", "ca-key.pem", "-out", "ca-cert.pem", "-days", "2", "-subj", "/CN=kura test CA", "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]].concat())?;
        let sign = |name: &str, cn: &str, ext: &str| -> Result<(), String> {
            ssl(&[&["req"][..], &ec, &["-keyout", &format!("{name}-key.pem"), "-out", &format!("{name}.csr"), "-subj", &format!("/CN={cn}")]].concat())?;
            std::fs::write(d.join(format!("{name}.ext")), ext).map_err(|e| e.to_string())?;
            ssl(&["x509", "-req", "-in", &format!("{name}.csr"), "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-out", &format!("{name}-cert.pem"), "-days", "2", "-extfile", &format!("{name}.ext")])
        };
        sign("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")?;
        sign("client", "kura test client", "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n")?;
        let copy = |from: &str, to: &str| std::fs::copy(d.join(from), d.join(to)).map(drop).map_err(|e| e.to_string());
        copy("server-cert.pem", "server/cert.pem")?;
        copy("server-key.pem", "server/key.pem")?;
        copy("ca-cert.pem", "client/ca-cert.pem")?;
        copy("ca-cert.pem", "client-with-cert/ca-cert.pem")?;
        copy("client-cert.pem", "client-with-cert/client-cert.pem")?;
        copy("client-key.pem", "client-with-cert/client-key.pem")?;
        Ok(Self { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn path_str(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }

    /// The server flags for this certificate and key, then `extra`.
    fn server_args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["--tls-cert".to_owned(), self.path_str("server/cert.pem"), "--tls-key".to_owned(), self.path_str("server/key.pem")];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// An `nbds://` URI for libnbd, verifying the server with the client directory `dir`.
    fn nbds_uri(&self, nbd: &NbdProcess, volume: &str, dir: &str) -> String {
        format!("nbds://localhost:{}/{volume}?tls-certificates={}", nbd.port(), self.path_str(dir))
    }

    /// qemu's `--object` and `--image-opts` for the export over TLS.
    fn qemu_args(&self, nbd: &NbdProcess, volume: &str) -> [String; 2] {
        [format!("tls-creds-x509,id=tls0,dir={},endpoint=client", self.path_str("client")), format!("driver=nbd,host=localhost,port={},export={volume},tls-creds=tls0", nbd.port())]
    }
}

fn start(backend: &Backend, args: &[String]) -> NbdProcess {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    NbdProcess::start(&backend.url(), &args)
}

fn nbdinfo_json(uri: &str) -> serde_json::Value {
    let info = run("nbdinfo", &["--json", uri]).unwrap();
    serde_json::from_str(&info).unwrap_or_else(|e| panic!("{e}: {info}"))
}

/// FNV-1a over a file: a checksum to report when two copies differ.
fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// nbdinfo and nbdcopy (libnbd), qemu-io and qemu-img over TLS, in the default mode that
/// requires it: the size is reported, a pattern written reads back verified, and 64 MiB
/// written with qemu-img and read back with nbdcopy are the same bytes (large requests
/// through partial TLS reads and writes on non-blocking sockets). Over a Unix socket too.
#[test]
fn real_clients_read_and_write_through_tls() {
    for cmd in ["nbdinfo", "nbdcopy", "qemu-io", "qemu-img"] {
        try_or_skip!(require_cmd(cmd));
    }
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    backend.create_volume("secure", "96M");
    let sock = certs.path("nbd.sock");
    let nbd = start(&backend, &certs.server_args(&["--unix", sock.to_str().unwrap()]));

    let json = nbdinfo_json(&certs.nbds_uri(&nbd, "secure", "client"));
    assert_eq!(json["TLS"], true, "{json}");
    assert_eq!(json["exports"][0]["export-size"], 96 << 20, "{json}");

    let [object, image] = certs.qemu_args(&nbd, "secure");
    let out = run("qemu-io", &["--object", &object, "--image-opts", &image, "-c", "write -P 0xab 0 4M", "-c", "read -P 0xab 0 4M", "-c", "write -P 0xcd 5M 12345", "-c", "read -P 0xcd 5M 12345"]).unwrap();
    assert!(!out.contains("Pattern verification failed") && out.matches("read ").count() == 2, "{out}");

    // 64 MiB in with qemu-img (its requests go up to 32 MiB), out with nbdcopy.
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(7, 64 << 20);
    let src = dir.path().join("src.img");
    std::fs::write(&src, &data).unwrap();
    run("qemu-img", &["convert", "-n", "--object", &object, "-f", "raw", src.to_str().unwrap(), "--target-image-opts", &image]).unwrap();
    let back = dir.path().join("back.img");
    run("nbdcopy", &[&certs.nbds_uri(&nbd, "secure", "client"), back.to_str().unwrap()]).unwrap();
    let back = std::fs::read(&back).unwrap();
    assert_eq!(back.len(), 96 << 20);
    assert!(back[..data.len()] == data[..], "64 MiB through TLS differ: checksum {:#x} written, {:#x} read", checksum(&data), checksum(&back[..data.len()]));
    assert!(back[data.len()..].iter().all(|&b| b == 0), "past the 64 MiB: zeros");

    // The same through qemu-img convert out of the export.
    let back2 = dir.path().join("back2.img");
    run("qemu-img", &["convert", "--object", &object, "--image-opts", &image, "-O", "raw", back2.to_str().unwrap()]).unwrap();
    assert!(std::fs::read(&back2).unwrap() == back, "qemu-img and nbdcopy read the same export");

    // Over the Unix socket.
    let uri = format!("nbds+unix:///secure?socket={}&tls-certificates={}", sock.display(), certs.path_str("client"));
    assert_eq!(run("nbdinfo", &["--size", &uri]).unwrap().trim(), (96u64 << 20).to_string());
}

/// In `require` mode (the default with a certificate): plain-text clients are refused with
/// a clear error (`NBD_REP_ERR_TLS_REQD` for every option but STARTTLS and ABORT, a hang-up
/// for EXPORT_NAME), clients that leave or send garbage during the TLS handshake end only
/// their own connection, STARTTLS twice is invalid, and the server keeps serving.
#[test]
fn require_mode_refuses_plain_clients_and_keeps_serving() {
    try_or_skip!(require_cmd("nbdinfo"));
    try_or_skip!(require_cmd("qemu-img"));
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    backend.create_volume("v", "8M");
    let nbd = start(&backend, &certs.server_args(&[]));

    let plain = nbd.uri("v");
    assert!(run("nbdinfo", &[&plain]).is_err(), "nbdinfo without TLS must fail");
    let err = run("qemu-img", &["info", &plain]).unwrap_err();
    assert!(err.contains("TLS"), "qemu-img says why: {err}");
    assert!(err.contains("this server requires TLS"), "and shows the server's message: {err}");

    let mut c = PlainClient::connect(&nbd.addr);
    for option in [proto::OPT_LIST, proto::OPT_STRUCTURED_REPLY, proto::OPT_INFO, proto::OPT_GO, 0x4242] {
        let data = if matches!(option, proto::OPT_INFO | proto::OPT_GO) { go_data("v") } else { Vec::new() };
        send_option(&mut c.s, option, &data);
        let (kind, message) = option_reply(&mut c.s, option);
        assert_eq!(kind, proto::REP_ERR_TLS_REQD, "option {option} before TLS: {}", String::from_utf8_lossy(&message));
    }
    send_option(&mut c.s, proto::OPT_STARTTLS, b"data");
    assert_eq!(option_reply(&mut c.s, proto::OPT_STARTTLS).0, proto::REP_ERR_INVALID, "STARTTLS with data");
    send_option(&mut c.s, proto::OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut c.s, proto::OPT_ABORT).0, proto::REP_ACK);
    assert!(c.closed(), "ABORT ends the session");

    let mut c = PlainClient::connect(&nbd.addr);
    send_option(&mut c.s, proto::OPT_EXPORT_NAME, b"v");
    assert!(c.closed(), "EXPORT_NAME without TLS cannot be refused otherwise: the server hangs up");

    // A client that leaves right after the server's ACK, one that sends garbage instead of a
    // TLS ClientHello, one that leaves in the middle of its ClientHello.
    let mut c = PlainClient::connect(&nbd.addr);
    send_option(&mut c.s, proto::OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c.s, proto::OPT_STARTTLS).0, proto::REP_ACK);
    drop(c);
    let mut c = PlainClient::connect(&nbd.addr);
    send_option(&mut c.s, proto::OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c.s, proto::OPT_STARTTLS).0, proto::REP_ACK);
    c.s.write_all(&[0x55; 600]).unwrap();
    assert!(c.closed(), "garbage instead of a handshake ends the connection");
    let mut c = PlainClient::connect(&nbd.addr);
    send_option(&mut c.s, proto::OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut c.s, proto::OPT_STARTTLS).0, proto::REP_ACK);
    // A TLS record header announcing a 512-byte handshake message, and then only 10 bytes.
    c.s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03]).unwrap();
    drop(c);

    // Over TLS the options work, and STARTTLS again is invalid.
    let mut t = TlsClient::connect(&nbd.addr, &certs);
    send_option(&mut t.s, proto::OPT_LIST, &[]);
    let (kind, _) = option_reply(&mut t.s, proto::OPT_LIST);
    assert_eq!(kind, proto::REP_SERVER, "LIST over TLS lists the export");
    assert_eq!(option_reply(&mut t.s, proto::OPT_LIST).0, proto::REP_ACK);
    send_option(&mut t.s, proto::OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut t.s, proto::OPT_STARTTLS).0, proto::REP_ERR_INVALID, "STARTTLS once TLS is active");
    let size = t.go("v");
    assert_eq!(size, 8 << 20);
    let data = pattern(3, 256 << 10);
    t.request(proto::CMD_WRITE, 1, 4096, data.len() as u32, &data);
    assert_eq!(t.simple_reply(0), (0, 1, Vec::new()));
    t.request(proto::CMD_READ, 2, 4096, data.len() as u32, &[]);
    let (error, handle, back) = t.simple_reply(data.len());
    assert_eq!((error, handle), (0, 2));
    assert!(back == data, "read back over the raw TLS client");

    let json = nbdinfo_json(&certs.nbds_uri(&nbd, "v", "client"));
    assert_eq!(json["exports"][0]["export-size"], 8 << 20, "the server still serves TLS clients: {json}");
}

/// Large requests pipelined over TLS by a client that reads no reply until it sent every
/// request: a 32 MiB write (the receive buffer grows to hold it, fed by thousands of TLS
/// records), eight 4 MiB writes, then 64 reads of 1 MiB whose replies fill the socket and the
/// session's buffer before the client reads any (the server waits for POLLOUT with ciphertext
/// pending, and finishes writing it as the client drains). Every byte reads back.
#[test]
fn pipelined_large_requests_through_partial_tls_writes() {
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    backend.create_volume("v", "80M");
    let nbd = start(&backend, &certs.server_args(&[]));
    let mut t = TlsClient::connect(&nbd.addr, &certs);
    t.go("v");
    const MIB: usize = 1 << 20;
    let data = pattern(11, 64 * MIB);
    t.request(proto::CMD_WRITE, 100, 0, (32 * MIB) as u32, &data[..32 * MIB]);
    for i in 0..8 {
        let at = 32 * MIB + i * 4 * MIB;
        t.request(proto::CMD_WRITE, 200 + i as u64, at as u64, (4 * MIB) as u32, &data[at..at + 4 * MIB]);
    }
    let mut handles: Vec<u64> = (0..9).map(|_| t.simple_reply(0)).map(|(error, handle, _)| { assert_eq!(error, 0, "write {handle}"); handle }).collect();
    handles.sort_unstable();
    assert_eq!(handles, [100, 200, 201, 202, 203, 204, 205, 206, 207]);

    for i in 0..64u64 {
        t.request(proto::CMD_READ, 1000 + i, i << 20, MIB as u32, &[]);
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut seen = [false; 64];
    for _ in 0..64 {
        let (error, handle, back) = t.simple_reply(MIB);
        assert_eq!(error, 0, "read {handle}");
        let i = (handle - 1000) as usize;
        assert!(!seen[i], "one reply per read");
        seen[i] = true;
        assert!(back[..] == data[i * MIB..(i + 1) * MIB], "MiB {i} differs: checksum {:#x} written, {:#x} read", checksum(&data[i * MIB..(i + 1) * MIB]), checksum(&back));
    }
}

/// `--tls on`: plain-text and TLS clients are both served, and what a client negotiated in
/// plain text (structured replies) does not survive its STARTTLS.
#[test]
fn on_mode_serves_plain_and_tls_clients() {
    try_or_skip!(require_cmd("nbdinfo"));
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    backend.create_volume("v", "4M");
    let nbd = start(&backend, &certs.server_args(&["--tls", "on"]));
    let json = nbdinfo_json(&nbd.uri("v"));
    assert_eq!((json["TLS"].clone(), json["exports"][0]["export-size"].clone()), (serde_json::json!(false), serde_json::json!(4 << 20)), "{json}");
    let json = nbdinfo_json(&certs.nbds_uri(&nbd, "v", "client"));
    assert_eq!(json["TLS"], true, "{json}");

    let mut c = PlainClient::connect(&nbd.addr);
    send_option(&mut c.s, proto::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(option_reply(&mut c.s, proto::OPT_STRUCTURED_REPLY).0, proto::REP_ACK);
    let mut t = TlsClient::upgrade(c.s, &certs);
    t.go("v");
    t.request(proto::CMD_READ, 7, 0, 512, &[]);
    // A simple reply (its magic is checked): structured replies were forgotten.
    assert_eq!(t.simple_reply(512).0, 0);
}

/// `--tls-ca`: a client without a certificate the CA signed fails the TLS handshake; one with
/// it is served.
#[test]
fn client_certificates_are_required_with_tls_ca() {
    try_or_skip!(require_cmd("nbdinfo"));
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    backend.create_volume("v", "4M");
    let nbd = start(&backend, &certs.server_args(&["--tls-ca", &certs.path_str("ca-cert.pem")]));
    let json = nbdinfo_json(&certs.nbds_uri(&nbd, "v", "client-with-cert"));
    assert_eq!(json["exports"][0]["export-size"], 4 << 20, "{json}");
    assert!(run("nbdinfo", &[&certs.nbds_uri(&nbd, "v", "client")]).is_err(), "a client without a certificate is refused");
    let json = nbdinfo_json(&certs.nbds_uri(&nbd, "v", "client-with-cert"));
    assert_eq!(json["TLS"], true, "and the server still serves: {json}");
}

/// Bad TLS flags and files stop `kura block nbd` at start, with a message that names the
/// problem, instead of failing each client later.
#[test]
fn bad_tls_files_stop_the_server_at_start() {
    try_or_skip!(require_cmd("openssl"));
    let certs = Certs::make().unwrap();
    let backend = Backend::embedded();
    let garbage = certs.path("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let cert = certs.path_str("server/cert.pem");
    let key = certs.path_str("server/key.pem");
    let other_key = certs.path_str("client-key.pem");
    let missing = certs.path_str("missing.pem");
    let garbage = garbage.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tls-cert", &missing, "--tls-key", &key], "cannot read"),
        (vec!["--tls-cert", &cert, "--tls-key", &missing], "cannot read"),
        (vec!["--tls-cert", &garbage, "--tls-key", &key], "no PEM certificate"),
        (vec!["--tls-cert", &cert, "--tls-key", &garbage], "no PEM private key"),
        (vec!["--tls-cert", &key, "--tls-key", &key], "no PEM certificate"),
        (vec!["--tls-cert", &cert, "--tls-key", &other_key], "do not go together"),
        (vec!["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &garbage], "no PEM certificate"),
        (vec!["--tls", "require"], "needs a certificate"),
        (vec!["--tls", "on"], "needs a certificate"),
        (vec!["--tls", "off", "--tls-cert", &cert, "--tls-key", &key], "contradicts"),
        (vec!["--tls-cert", &cert], "--tls-key"),
    ];
    for (flags, expected) in cases {
        let out = Command::new(kura_bin())
            .args(["block", "nbd", "--listen", "127.0.0.1:0", "--pool", &backend.url()])
            .args(&flags)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(expected), "{flags:?}: expected {expected:?} in:\n{stderr}");
        assert!(out.stdout.is_empty(), "{flags:?}: nothing listened");
    }
}

// --- A raw NBD client, plain and over rustls. ---

fn send_option(s: &mut impl Write, option: u32, data: &[u8]) {
    let mut b = Vec::new();
    b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
    s.flush().unwrap();
}

/// One option reply: (type, data).
fn option_reply(s: &mut impl Read, option: u32) -> (u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), proto::OPTION_REPLY_MAGIC);
    assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
    let mut data = vec![0u8; u32::from_be_bytes(h[16..].try_into().unwrap()) as usize];
    s.read_exact(&mut data).unwrap();
    (u32::from_be_bytes(h[12..16].try_into().unwrap()), data)
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

struct PlainClient {
    s: TcpStream,
}

impl PlainClient {
    fn connect(addr: &str) -> Self {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
        let mut greeting = [0u8; proto::GREETING_BYTES];
        s.read_exact(&mut greeting).unwrap();
        assert_eq!(greeting, proto::greeting());
        s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        Self { s }
    }

    /// Whether the server closed the connection (reads EOF or a reset), after what it sent
    /// last (a TLS alert, say).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        for _ in 0..16 {
            if matches!(self.s.read(&mut b), Ok(0) | Err(_)) {
                return true;
            }
        }
        false
    }
}

struct TlsClient {
    s: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
}

impl TlsClient {
    fn connect(addr: &str, certs: &Certs) -> Self {
        Self::upgrade(PlainClient::connect(addr).s, certs)
    }

    /// STARTTLS on a connection in option haggling, and the TLS handshake (verifying the
    /// server as `localhost` against the test CA).
    fn upgrade(mut s: TcpStream, certs: &Certs) -> Self {
        use rustls_pki_types::pem::PemObject;
        send_option(&mut s, proto::OPT_STARTTLS, &[]);
        assert_eq!(option_reply(&mut s, proto::OPT_STARTTLS).0, proto::REP_ACK);
        let mut roots = rustls::RootCertStore::empty();
        roots.add(rustls_pki_types::CertificateDer::from_pem_file(certs.path("ca-cert.pem")).unwrap()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("localhost".to_owned()).unwrap();
        let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut s = rustls::StreamOwned::new(conn, s);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock).unwrap();
        }
        Self { s }
    }

    /// NBD_OPT_GO; returns the export size.
    fn go(&mut self, name: &str) -> u64 {
        send_option(&mut self.s, proto::OPT_GO, &go_data(name));
        let mut size = None;
        loop {
            let (kind, data) = option_reply(&mut self.s, proto::OPT_GO);
            match kind {
                proto::REP_INFO if data[..2] == proto::INFO_EXPORT.to_be_bytes() => size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap())),
                proto::REP_INFO => {}
                proto::REP_ACK => return size.expect("NBD_INFO_EXPORT"),
                other => panic!("GO: reply {other:#x}: {}", String::from_utf8_lossy(&data)),
            }
        }
    }

    fn request(&mut self, kind: u16, handle: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = proto::encode_request(&proto::Request { flags: 0, kind, handle, offset, len }).to_vec();
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
        self.s.flush().unwrap();
    }

    /// A simple reply: (error, handle, `data_len` bytes of data if it succeeded).
    fn simple_reply(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; proto::SIMPLE_REPLY_BYTES];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), proto::SIMPLE_REPLY_MAGIC, "simple reply magic");
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let mut data = vec![0u8; if error == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut data).unwrap();
        (error, u64::from_be_bytes(h[8..].try_into().unwrap()), data)
    }
}
