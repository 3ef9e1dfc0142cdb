//! `lru_crawler metadump` against the real server: the same lines as memcached for the same
//! items (but for the fields kura does not keep), class selection and errors as memcached
//! answers them, requests pipelined behind a dump, a dump far larger than the connection's
//! output limit, a client that leaves in the middle, a second dump while one runs, a restart
//! (what memcached cannot keep), and `memcached-tool dump` as a real client.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use common::{Client, Kura, Memcached};

/// The dump's lines by key: (exp, cls, size); the other fields are checked for form.
fn dump(c: &mut Client, spec: &str) -> BTreeMap<String, (i64, u32, u64)> {
    let out = c.until_end(format!("lru_crawler metadump {spec}\r\n"));
    let mut items = BTreeMap::new();
    for line in out.lines().filter(|l| *l != "END") {
        let fields: BTreeMap<&str, &str> = line.split(' ').map(|f| f.split_once('=').unwrap_or_else(|| panic!("{line:?}"))).collect();
        assert_eq!(fields.keys().copied().collect::<Vec<_>>(), vec!["cas", "cls", "exp", "fetch", "key", "la", "size"], "{line:?}");
        let la: i64 = fields["la"].parse().unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        assert!((now - 600..=now + 1).contains(&la), "la is a recent Unix time: {line:?}");
        assert!(fields["cas"].parse::<u64>().unwrap() > 0, "{line:?}");
        assert!(["yes", "no"].contains(&fields["fetch"]), "{line:?}");
        let previous = items.insert(fields["key"].to_owned(), (fields["exp"].parse().unwrap(), fields["cls"].parse().unwrap(), fields["size"].parse().unwrap()));
        assert!(previous.is_none(), "key listed twice: {line:?}");
    }
    items
}

const SCRIPT: &[u8] = b"set a%b 5 0 3\r\nabc\r\nset k2 0 100 1\r\nx\r\nget a%b\r\nset gone 0 0 1\r\nz\r\ndelete gone\r\nset dead 0 -1 1\r\nq\r\nset \"sp 0 0 1\r\nw\r\nset tiny 0 0 0\r\n\r\nmn\r\n";

fn load(c: &mut Client, big: &[u8]) {
    c.send(SCRIPT);
    let mut script = format!("set big 7 0 {}\r\n", big.len()).into_bytes();
    script.extend_from_slice(big);
    script.extend_from_slice(b"\r\nmn\r\n");
    c.send(script);
    while c.line() != "MN\r\n" {}
    while c.line() != "MN\r\n" {}
}

/// `n` items `<prefix><i:06>` with flags `i % 3` and 20-byte values, pipelined.
fn load_many(c: &mut Client, prefix: &str, n: usize) {
    let mut batch = Vec::new();
    for i in 0..n {
        batch.extend_from_slice(format!("set {prefix}{i:06} {} 0 20 noreply\r\n{i:020}\r\n", i % 3).as_bytes());
        if batch.len() > 1 << 20 {
            c.send(std::mem::take(&mut batch));
        }
    }
    batch.extend_from_slice(b"mn\r\n");
    c.send(batch);
    assert_eq!(c.line(), "MN\r\n");
}

/// A client that asks for a dump, reads its first bytes and then nothing more.
fn unread_dump(kura: &Kura) -> Client {
    let mut slow = kura.client();
    slow.send("lru_crawler metadump all\r\n");
    let mut first = [0u8; 4];
    slow.reader.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"key=");
    slow
}

/// The same items in kura and memcached: the same keys (URI-encoded), expiry, class and size;
/// expired and deleted items are not listed. Class lists select as memcached's do, and the
/// errors are memcached's.
#[test]
fn metadump_lists_what_memcached_lists() {
    let kura = Kura::start(&[]);
    let mut k = kura.client();
    let big = vec![b'y'; 5000];
    load(&mut k, &big);
    let kura_all = dump(&mut k, "all");
    assert_eq!(kura_all.keys().collect::<Vec<_>>(), vec!["%22sp", "a%25b", "big", "k2", "tiny"]);
    assert_eq!(kura_all["big"].1, 19);
    assert_eq!(dump(&mut k, "hash"), kura_all);
    assert_eq!(dump(&mut k, "19").keys().collect::<Vec<_>>(), vec!["big"]);
    assert_eq!(dump(&mut k, "1,,63").len(), 4);
    assert!(dump(&mut k, "2").is_empty());
    for (request, reply) in [("0", "BADCLASS invalid class id\r\n"), ("64", "BADCLASS invalid class id\r\n"), ("x", "BADCLASS invalid class id\r\n")] {
        k.expect(format!("lru_crawler metadump {request}\r\n"), reply);
    }
    // Back to back on one connection: the second is not BUSY.
    k.expect("lru_crawler metadump 2\r\nlru_crawler metadump 2\r\nmn\r\n", "END\r\nEND\r\nMN\r\n");
    k.expect("lru_crawler metadump\r\n", "ERROR\r\n");
    // A client that sends its request and EOF gets the whole dump before the close.
    let whole = common::transcript(kura.port, b"lru_crawler metadump all\r\n");
    assert!(whole.ends_with(b"END\r\n") && whole.starts_with(b"key="), "{}", String::from_utf8_lossy(&whole));
    k.expect("lru_crawler metadump all more\r\n", "ERROR\r\n");
    k.expect("lru_crawler crawl all extra\r\n", "ERROR\r\n");

    let memcached = match Memcached::start(&[]) {
        Ok(m) => m,
        Err(reason) => {
            kura_testkit::skip(&format!("no memcached to compare with: {reason}"));
            return;
        }
    };
    let mut m = Client::connect(memcached.port);
    load(&mut m, &big);
    let memcached_all = dump(&mut m, "all");
    assert_same_items(&kura_all, &memcached_all, "kura's (exp, cls, size) by key against memcached's");
    for spec in ["1", "19,20", "2"] {
        assert_same_items(&dump(&mut k, spec), &dump(&mut m, spec), &format!("metadump {spec}"));
    }
}

/// The same keys, classes and sizes; the same expiry, or for an item with a TTL one a second
/// later or earlier (the two servers were loaded a moment apart: a second can start between).
fn assert_same_items(kura: &BTreeMap<String, (i64, u32, u64)>, memcached: &BTreeMap<String, (i64, u32, u64)>, what: &str) {
    let clock = |items: &BTreeMap<String, (i64, u32, u64)>| items.iter().map(|(key, &(exp, cls, size))| (key.clone(), exp > 0, cls, size)).collect::<Vec<_>>();
    assert_eq!(clock(kura), clock(memcached), "{what}: {kura:?} against {memcached:?}");
    for (key, &(exp, ..)) in kura {
        let theirs = memcached[key].0;
        assert!(exp == theirs || (exp > 0 && (exp - theirs).abs() <= 1), "{what}: exp of {key}: {kura:?} against {memcached:?}");
    }
}

/// Requests pipelined behind a dump are answered after its END, in order; a dump of 200,000
/// items (15 MB: more than the output limit and the socket buffers hold) arrives whole while another client is
/// served; a second dump while one runs is BUSY; a client that leaves mid-dump leaves the
/// server serving; after a restart the dump lists every item again.
#[test]
fn large_dumps_stream_and_survive_restarts() {
    const ITEMS: usize = 200_000;
    let mut kura = Kura::start(&["--size", "256M"]);
    let mut c = kura.client();
    load_many(&mut c, "key:", ITEMS);

    // A dump with requests pipelined behind it.
    c.send("lru_crawler metadump all\r\nget key:000007\r\nmn\r\n");
    let mut keys = 0;
    loop {
        let line = c.line();
        assert!(!line.is_empty(), "closed mid-dump");
        if line == "END\r\n" {
            break;
        }
        assert!(line.starts_with("key=key%3A"), "{line:?}");
        keys += 1;
    }
    assert_eq!(keys, ITEMS);
    assert_eq!(c.line(), "VALUE key:000007 1 20\r\n");
    assert_eq!(c.line(), format!("{:020}\r\n", 7));
    assert_eq!(c.line(), "END\r\n");
    assert_eq!(c.line(), "MN\r\n");

    // A client that does not read its dump holds the one crawler: others get BUSY, and are
    // served meanwhile; once it leaves, dumps run again.
    let slow = unread_dump(&kura);
    let mut other = kura.client();
    other.expect("lru_crawler metadump all\r\n", "BUSY currently processing crawler request\r\n");
    assert_eq!(other.get("key:000100").as_deref(), Some(&format!("{:020}", 100).into_bytes()[..]));
    drop(slow);
    assert!(
        common::eventually(Duration::from_secs(10), || {
            other.send("lru_crawler metadump 2\r\n");
            other.line() == "END\r\n"
        }),
        "a dump can run again once the client that held it left"
    );

    // A client that sends a dump request and leaves at once.
    let mut gone = std::net::TcpStream::connect(("127.0.0.1", kura.port)).unwrap();
    gone.write_all(b"lru_crawler metadump all\r\n").unwrap();
    drop(gone);

    assert!(common::eventually(Duration::from_secs(10), || other.stat("lru_crawler_running") == 0));
    assert!(other.stat("lru_crawler_starts") >= 3, "the dumps above were counted");

    // Persisted: after a restart (SIGTERM) the dump lists every item again.
    assert!(kura.stop().success());
    kura.restart();
    let mut c = kura.client();
    let items = dump(&mut c, "all");
    assert_eq!(items.len(), ITEMS, "every item listed after the restart");
}

/// Dumps while another client keeps writing into a full cache-mode store (blocks sealed and
/// evicted under the scan): every dump ends with END, its lines are well formed, and no key is
/// listed twice; the writer is never refused.
#[test]
fn dumps_while_the_store_evicts() {
    let kura = Kura::start(&["--size", "32M", "--block-size", "1M", "-I", "16k", "--mode", "cache"]);
    let port = kura.port;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer_stop = std::sync::Arc::clone(&stop);
    let writer = std::thread::spawn(move || {
        let mut w = Client::connect(port);
        let value = vec![b'v'; 4000];
        let mut i = 0u64;
        while !writer_stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut batch = Vec::new();
            for _ in 0..64 {
                batch.extend_from_slice(format!("set w{i} 0 0 {} noreply\r\n", value.len()).as_bytes());
                batch.extend_from_slice(&value);
                batch.extend_from_slice(b"\r\n");
                i += 1;
            }
            batch.extend_from_slice(b"mn\r\n");
            w.send(batch);
            assert_eq!(w.line(), "MN\r\n", "the writer is served while dumps run");
        }
        i
    });
    let mut c = kura.client();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        let items = dump(&mut c, "all");
        assert!(items.keys().all(|k| k.starts_with('w')), "only the writer's keys");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.join().expect("writer");
    assert!(written > 32 << 20 >> 12, "the writer wrote more than the store holds ({written} items), so blocks were evicted");
    assert!(c.stat("kura_evicted_blocks") > 0, "blocks were evicted meanwhile");
}

/// SIGTERM while a client holds a dump it does not read: the server stops the dump, says so
/// at the end of what it sent (`SERVER_ERROR`, never a silent cut), and exits cleanly within
/// its drain time, its store intact.
#[test]
fn shutdown_during_a_dump_ends_it_with_an_error_line() {
    let mut kura = Kura::start(&["--size", "256M"]);
    load_many(&mut kura.client(), "s", 200_000);
    let mut slow = unread_dump(&kura);
    let started = std::time::Instant::now();
    let status = kura.stop();
    assert!(status.success(), "clean exit: {status}");
    assert!(started.elapsed() < Duration::from_secs(15), "the dump did not hold the shutdown: {:?}", started.elapsed());
    // What the client got: whole lines, then the error line (or the whole dump, if the server
    // had already handed it all to the kernel).
    let mut rest = Vec::new();
    let _ = slow.reader.read_to_end(&mut rest);
    let text = String::from_utf8_lossy(&rest);
    let last = text.lines().last().unwrap_or_default();
    assert!(last == "SERVER_ERROR metadump stopped: server shutting down" || last == "END", "last line {last:?}");
    eprintln!("after SIGTERM the client got {} lines, the last {last:?}", text.lines().count());
    kura.restart();
    let mut c = kura.client();
    assert_eq!(c.get("s123456").as_deref(), Some(&format!("{:020}", 123456).into_bytes()[..]));
}

/// `memcached-tool HOST:PORT dump` (Debian's memcached package) reads the dump and the
/// values and prints `add` commands; replayed into an empty server they give back the items.
#[test]
fn memcached_tool_dumps_and_the_dump_reloads() {
    let tool = std::path::Path::new("/usr/share/memcached/scripts/memcached-tool");
    if !tool.exists() {
        kura_testkit::skip("no /usr/share/memcached/scripts/memcached-tool (package memcached)");
        return;
    }
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let mut expected = BTreeMap::new();
    for i in 0..300u32 {
        let key = format!("tool{i}");
        let value = format!("value-{i}-{}", "v".repeat(i as usize % 50));
        c.send(format!("set {key} {i} 0 {}\r\n{value}\r\n", value.len()));
        assert_eq!(c.line(), "STORED\r\n");
        expected.insert(key, (i, value));
    }
    let out = Command::new("perl").arg(tool).arg(format!("127.0.0.1:{}", kura.port)).arg("dump").output().expect("run memcached-tool");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let restored = Kura::start(&[]);
    let mut r = restored.client();
    r.send(&out.stdout);
    r.send("mn\r\n");
    let mut stored = 0;
    loop {
        match r.line().as_str() {
            "STORED\r\n" => stored += 1,
            "MN\r\n" => break,
            other => panic!("replaying the dump: {other:?}"),
        }
    }
    assert_eq!(stored, expected.len());
    for (key, (flags, value)) in &expected {
        r.send(format!("get {key}\r\n"));
        assert_eq!(r.line(), format!("VALUE {key} {flags} {}\r\n", value.len()));
        assert_eq!(r.line(), format!("{value}\r\n"));
        assert_eq!(r.line(), "END\r\n");
    }
}

/// Reads lines until `EN` (the end of an mgdump); returns the lines before it.
fn mg_lines(c: &mut Client, request: &str) -> Vec<String> {
    c.send(request);
    let mut lines = Vec::new();
    loop {
        let line = c.line();
        if line == "EN\r\n" {
            return lines;
        }
        assert!(line.starts_with("mg ") && line.ends_with("\r\n"), "{line:?}");
        lines.push(line);
    }
}

/// `lru_crawler mgdump` (memcached 1.6.19+): an `mg <key>` line per live item, a key that is
/// not text base64-encoded with ` b`, then `EN`. Every line, sent back, is a meta get that
/// hits; with flags appended it fetches the item (what `mcdumpload` does to copy a cache).
/// Classes select and errors answer as for `metadump`; requests pipelined behind wait for it.
#[test]
fn mgdump_lists_meta_gets_that_can_be_sent_back() {
    let kura = Kura::start(&[]);
    let mut k = kura.client();
    let big = vec![b'y'; 5000];
    load(&mut k, &big);
    // A binary key (a space and a control byte in it), stored base64-encoded.
    let binary_key: &[u8] = b"bin key\x01\xff";
    let mut encoded = Vec::new();
    kura_proto::encode_base64(binary_key, &mut encoded);
    let encoded = String::from_utf8(encoded).unwrap();
    k.expect(format!("ms {encoded} 3 b F9\r\nbin\r\n"), "HD\r\n");
    // A base64 key that decodes to text is the text key's item.
    k.expect("ms dGV4dA== 2 b\r\nab\r\n", "HD\r\n");

    let mut lines = mg_lines(&mut k, "lru_crawler mgdump all\r\n");
    lines.sort();
    let mut expected = ["mg \"sp\r\n", "mg a%b\r\n", "mg big\r\n", "mg k2\r\n", "mg text\r\n", "mg tiny\r\n"].map(str::to_owned).to_vec();
    expected.push(format!("mg {encoded} b\r\n"));
    expected.sort();
    assert_eq!(lines, expected, "expired (dead), deleted (gone) and never-stored items are not listed");

    // Sent back as they are: each is a hit. With flags: the item itself.
    let replay: String = lines.concat();
    let mut hits = String::new();
    k.send(&replay);
    for _ in &lines {
        hits.push_str(&k.line());
    }
    assert_eq!(hits, "HD\r\n".repeat(lines.len()));
    let line = format!("mg {encoded} b\r\n");
    k.send(line.replace("\r\n", " v f\r\n"));
    assert_eq!(k.line(), "VA 3 f9\r\n");
    assert_eq!(k.line(), "bin\r\n");

    // Classes as metadump's; errors as metadump's.
    assert_eq!(mg_lines(&mut k, "lru_crawler mgdump 19\r\n"), vec!["mg big\r\n"]);
    assert_eq!(mg_lines(&mut k, "lru_crawler mgdump hash\r\n").len(), expected.len());
    assert!(mg_lines(&mut k, "lru_crawler mgdump 2\r\n").is_empty());
    k.expect("lru_crawler mgdump 0\r\n", "BADCLASS invalid class id\r\n");
    k.expect("lru_crawler mgdump\r\n", "ERROR\r\n");
    // Pipelined behind: answered after EN, in order.
    k.expect("lru_crawler mgdump 2\r\nmn\r\nlru_crawler mgdump 2\r\nmg k2 v\r\n", "EN\r\nMN\r\nEN\r\nVA 1\r\nx\r\n");
    // Disabled crawler: refused as metadump is.
    k.expect("lru_crawler disable\r\n", "OK\r\n");
    k.expect("lru_crawler mgdump all\r\n", "CLIENT_ERROR lru crawler disabled\r\n");
    k.expect("lru_crawler enable\r\n", "OK\r\n");
}

/// A large mgdump streams whole (more than the connection's output limit) and lists every item
/// once; a client that leaves in the middle does not stop the server.
#[test]
fn large_mgdumps_stream_whole() {
    const ITEMS: usize = 100_000;
    let kura = Kura::start(&["--size", "256M"]);
    let mut c = kura.client();
    load_many(&mut c, "key:", ITEMS);
    let lines = mg_lines(&mut c, "lru_crawler mgdump all\r\n");
    assert_eq!(lines.len(), ITEMS);
    let unique: std::collections::BTreeSet<&String> = lines.iter().collect();
    assert_eq!(unique.len(), ITEMS, "each item once");
    assert!(unique.contains(&"mg key:000000\r\n".to_owned()) && unique.contains(&format!("mg key:{:06}\r\n", ITEMS - 1)));

    // Leaves after the first bytes; the next dump is not BUSY for long.
    let mut gone = kura.client();
    gone.send("lru_crawler mgdump all\r\n");
    let mut first = [0u8; 3];
    gone.reader.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"mg ");
    drop(gone);
    assert!(common::eventually(Duration::from_secs(20), || {
        c.send("lru_crawler mgdump 2\r\n");
        match c.line().as_str() {
            "EN\r\n" => true,
            line => {
                assert!(line.starts_with("BUSY"), "{line:?}");
                std::thread::sleep(Duration::from_millis(50));
                false
            }
        }
    }));
    c.expect("mg key:000007 v\r\n", "VA 20\r\n00000000000000000007\r\n");
}
