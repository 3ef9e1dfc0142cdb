//! `watch` against the real server: the lines a real memcached 1.6.18 writes for the same
//! client commands (kura's are memcached's but for the lookups memcached makes inside its
//! own stores), streams chosen as there, errors as there, a watcher's input ignored, the
//! watcher limit, and a watcher that stops reading: it loses lines (and is told how many),
//! the clients it watches do not wait for it.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::time::{Duration, Instant};

use common::{Client, Kura, Memcached};

/// The client's commands of the comparison (not `append`: memcached logs the combined
/// item's size and TTL there, kura the request's).
const SCRIPT: &[&str] = &[
    "set foo 0 0 3\r\nbar\r\n",
    "get foo\r\n",
    "get nope other\r\n",
    "gets foo\r\n",
    "delete foo\r\n",
    "mg foo v\r\n",
    "ms k 2 T10\r\nhi\r\n",
    "mg k v f\r\n",
    "gat 100 k\r\n",
    "set a%20b 5 0 1\r\nz\r\n",
    "cas k 0 0 1 1\r\nz\r\n",
    "add foo 0 0 1\r\nq\r\n",
    "add foo 0 0 1\r\nq\r\n",
    "replace zz 0 0 1\r\nq\r\n",
];

/// One reply per command of [`SCRIPT`], read before the next is sent.
fn run_script(port: u16) {
    let mut c = Client::connect(port);
    for command in SCRIPT {
        c.send(command);
        // Every reply here ends with one of these lines.
        loop {
            let line = c.line();
            if line.starts_with("VA ") {
                c.line();
                break;
            }
            if ["STORED", "NOT_STORED", "EXISTS", "NOT_FOUND", "END", "DELETED", "HD", "EN", "NS", "EX", "NF"].iter().any(|end| line == format!("{end}\r\n") || line.starts_with(&format!("{end} "))) {
                break;
            }
        }
    }
}

/// Reads log lines until `until` is true of the lines so far (or 10 s pass).
fn read_lines(w: &mut Client, until: impl Fn(&[String]) -> bool) -> Vec<String> {
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !until(&lines) {
        assert!(Instant::now() < deadline, "no more lines after {lines:#?}");
        let line = w.line();
        assert!(line.ends_with('\n') && !line.ends_with("\r\n"), "a log line ends with LF alone: {line:?}");
        lines.push(line.trim_end().to_owned());
    }
    lines
}

/// A line's fields but for those that differ from run to run (ts, gid, cfd, rport).
fn normalized(line: &str) -> String {
    let fields: BTreeMap<&str, &str> = line.split(' ').map(|f| f.split_once('=').unwrap_or_else(|| panic!("{line:?}"))).collect();
    let ts: f64 = fields["ts"].parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - ts).abs() < 60.0, "ts is the time: {line:?}");
    assert!(fields["gid"].parse::<u64>().unwrap() > 0, "{line:?}");
    line.split(' ').filter(|f| !["ts=", "gid=", "cfd=", "rport="].iter().any(|p| f.starts_with(p))).collect::<Vec<_>>().join(" ")
}

/// The script's lines on a server, normalized; `watch` first on a connection of its own.
fn watched(port: u16) -> Vec<String> {
    let mut w = Client::connect(port);
    w.send("watch fetchers mutations connevents\r\n");
    assert_eq!(w.line(), "OK\r\n");
    run_script(port);
    let lines = read_lines(&mut w, |lines| lines.last().is_some_and(|l| l.contains("type=conn_close")));
    lines.iter().map(|l| normalized(l)).collect()
}

#[test]
fn watch_lines_are_memcacheds() {
    let kura = Kura::start(&[]);
    let ours = watched(kura.port);
    let expected = [
        "type=conn_new rip=127.0.0.1 transport=tcp",
        "type=item_store key=foo status=stored cmd=set ttl=0 clsid=1 size=3",
        "type=item_get key=foo status=found clsid=1 size=3",
        "type=item_get key=nope status=not_found clsid=0 size=0",
        "type=item_get key=other status=not_found clsid=0 size=0",
        "type=item_get key=foo status=found clsid=1 size=3",
        "type=item_get key=foo status=not_found clsid=0 size=0",
        "type=item_store key=k status=stored cmd=set ttl=10 clsid=1 size=2",
        "type=item_get key=k status=found clsid=1 size=2",
        "type=item_get key=k status=found clsid=1 size=2",
        "type=item_store key=a%2520b status=stored cmd=set ttl=0 clsid=1 size=1",
        "type=item_store key=k status=exists cmd=cas ttl=0 clsid=1 size=1",
        "type=item_store key=foo status=stored cmd=add ttl=0 clsid=1 size=1",
        "type=item_store key=foo status=not_stored cmd=add ttl=0 clsid=1 size=1",
        "type=item_store key=zz status=not_stored cmd=replace ttl=0 clsid=1 size=1",
        "type=conn_close rip=127.0.0.1 transport=tcp reason=normal",
    ];
    assert_eq!(ours, expected);

    let memcached = match Memcached::start(&[]) {
        Ok(m) => m,
        Err(reason) => {
            kura_testkit::skip(&format!("no memcached to compare with: {reason}"));
            return;
        }
    };
    // memcached also logs the lookups it makes inside stores and deletes: kura's lines are
    // memcached's with those left out, in the same order.
    let theirs = watched(memcached.port);
    let mut rest = theirs.iter();
    for line in &ours {
        assert!(rest.any(|l| l == line), "{line:?} is not among memcached's lines (in order): {theirs:#?}");
    }
}

#[test]
fn streams_errors_and_input_as_memcached() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    // Unknown streams: ERROR, and the connection goes on.
    c.expect("watch bogus\r\n", "ERROR\r\n");
    c.expect("watch fetchers deletions\r\n", "ERROR\r\n");
    c.send("version\r\n");
    assert!(c.line().starts_with("VERSION "));

    // `watch` alone is fetchers: no store lines. A watcher's own commands are not run.
    let mut fetchers = kura.client();
    fetchers.send("watch\r\n");
    assert_eq!(fetchers.line(), "OK\r\n");
    fetchers.send("set ignored 0 0 1\r\nx\r\nget ignored\r\n");
    let mut mutations = kura.client();
    mutations.send("watch mutations\r\n");
    assert_eq!(mutations.line(), "OK\r\n");
    c.set("w1", b"abc");
    assert_eq!(c.get("w1").as_deref(), Some(&b"abc"[..]));
    assert_eq!(c.get("ignored"), None, "the watcher's set was not run");
    let fetched = read_lines(&mut fetchers, |l| l.len() == 2);
    assert!(fetched[0].contains("type=item_get key=w1 status=found"), "{fetched:?}");
    assert!(fetched[1].contains("type=item_get key=ignored status=not_found"), "{fetched:?}");
    let stored = read_lines(&mut mutations, |l| !l.is_empty());
    assert!(stored[0].contains("type=item_store key=w1 status=stored cmd=set"), "{stored:?}");

    // Twenty watchers at most (memcached's limit); one leaving makes room.
    let mut many: Vec<Client> = Vec::new();
    for _ in 2..20 {
        let mut w = kura.client();
        w.send("watch evictions\r\n");
        assert_eq!(w.line(), "OK\r\n");
        many.push(w);
    }
    let mut refused = kura.client();
    refused.expect("watch\r\n", "WATCHER_TOO_MANY log watcher limit reached\r\n");
    drop(many.pop());
    assert!(common::eventually(Duration::from_secs(5), || {
        let mut w = kura.client();
        w.send("watch\r\n");
        w.line() == "OK\r\n"
    }));
}

/// A watcher that stops reading under a load of 300,000 lookups: the load is not held back
/// (it finishes as fast as with nobody watching, give or take the machine's noise), the
/// server's memory stays bounded, and the watcher, reading again, is told how many lines it
/// lost before the lines that follow.
#[test]
fn a_watcher_that_does_not_read_loses_lines_not_clients() {
    const LOOKUPS: usize = 300_000;
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.set("hot", b"v");
    let load = |c: &mut Client| {
        let started = Instant::now();
        let batch = "get hot\r\n".repeat(1000);
        for _ in 0..LOOKUPS / 1000 {
            c.send(&batch);
            for _ in 0..1000 {
                assert_eq!(c.line(), "VALUE hot 0 1\r\n");
                c.line();
                c.line();
            }
        }
        started.elapsed()
    };
    let alone = load(&mut c);
    let mut stuck = kura.client();
    stuck.send("watch fetchers\r\n");
    assert_eq!(stuck.line(), "OK\r\n");
    let watched = load(&mut c);
    assert!(watched < alone * 4 + Duration::from_secs(2), "a stuck watcher held the load back: {watched:?} against {alone:?}");
    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", kura.pid())).unwrap().lines().find_map(|l| l.strip_prefix("VmRSS:").map(|v| v.trim().trim_end_matches(" kB").parse::<u64>().unwrap())).unwrap();
    assert!(rss_kib < 512 * 1024, "RSS {rss_kib} KiB");
    // Read what is there: whole lines, then a count of what was lost, then new lines.
    stuck.stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut buffered = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        match stuck.reader.read(&mut chunk) {
            Ok(0) => panic!("closed"),
            Ok(n) => buffered.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    let text = String::from_utf8(buffered).unwrap();
    assert!(text.len() < LOOKUPS * 80, "lines were dropped, not all kept: {} bytes", text.len());
    c.get("after");
    stuck.stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut tail = String::new();
    while !tail.contains("key=after") {
        tail.push_str(&stuck.line());
    }
    let all = text + &tail;
    let skipped: u64 = all.lines().filter_map(|l| l.strip_prefix("skipped=")).map(|n| n.parse::<u64>().unwrap()).sum();
    let logged = all.lines().filter(|l| l.contains("type=item_get key=hot")).count() as u64;
    assert!(skipped > 0, "lines were lost and counted");
    assert_eq!(logged + skipped, LOOKUPS as u64, "every lookup was logged or counted as skipped");
    // memcached's logger counters: the same lines, one watcher.
    assert_eq!(c.stat("log_watchers"), 1);
    assert_eq!(c.stat("log_watcher_skipped"), skipped);
    assert_eq!(c.stat("log_watcher_sent"), logged + 1, "the lookups' lines and the one of `after`");
}
