//! Every classic text command and flag, against the real server binary.

mod common;

use std::time::Duration;

use common::{Client, Kura, eventually};

#[test]
fn storage_commands_and_their_replies() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("set a 5 0 3\r\nabc\r\n", "STORED\r\n");
    assert_eq!(c.until_end("get a\r\n"), "VALUE a 5 3\r\nabc\r\nEND\r\n");
    c.expect("add a 0 0 1\r\nx\r\n", "NOT_STORED\r\n");
    c.expect("add b 7 0 1\r\nx\r\n", "STORED\r\n");
    c.expect("replace nope 0 0 1\r\nx\r\n", "NOT_STORED\r\n");
    c.expect("replace b 8 0 2\r\nyy\r\n", "STORED\r\n");
    assert_eq!(c.until_end("get b\r\n"), "VALUE b 8 2\r\nyy\r\nEND\r\n");
    // append/prepend keep the old flags and ignore the new ones.
    c.expect("append a 99 0 3\r\ndef\r\n", "STORED\r\n");
    c.expect("prepend a 99 0 2\r\n<<\r\n", "STORED\r\n");
    assert_eq!(
        c.until_end("get a\r\n"),
        "VALUE a 5 8\r\n<<abcdef\r\nEND\r\n"
    );
    c.expect("append nope 0 0 1\r\nx\r\n", "NOT_STORED\r\n");
    c.expect("prepend nope 0 0 1\r\nx\r\n", "NOT_STORED\r\n");
    // Flags: the whole 32-bit range; values: empty, binary, with \r\n inside.
    c.expect("set f 4294967295 0 0\r\n\r\n", "STORED\r\n");
    assert_eq!(
        c.until_end("get f\r\n"),
        "VALUE f 4294967295 0\r\n\r\nEND\r\n"
    );
    let binary: Vec<u8> = (0..=255u8).chain(b"\r\nEND\r\n".iter().copied()).collect();
    c.set("bin", &binary);
    assert_eq!(c.get("bin"), Some(binary));
    // noreply is silent; the next reply is the probe's.
    c.expect("set q 0 0 1 noreply\r\n1\r\nadd q 0 0 1 noreply\r\n2\r\nreplace q 0 0 1 noreply\r\n3\r\nappend q 0 0 1 noreply\r\n4\r\nprepend q 0 0 1 noreply\r\n5\r\nget q\r\n", "VALUE q 0 3\r\n534\r\nEND\r\n");
}

#[test]
fn values_up_to_the_item_limit_and_past_it() {
    // As in memcached, -I bounds the whole item: kura's 40-byte header, the
    // `VALUE big 0 65475\r\n` line, the data and its \r\n: 65475 data bytes fit.
    let kura = Kura::start(&["-I", "64k"]);
    let mut c = kura.client();
    let big: Vec<u8> = (0..65475u32).map(|i| (i % 251) as u8).collect();
    c.set("big", &big);
    assert_eq!(c.get("big"), Some(big.clone()));
    for len in [65476usize, 65536, 200_000] {
        // Refused (the data block is read or swallowed), and the connection goes on.
        let mut request = format!("set toobig 0 0 {len}\r\n").into_bytes();
        request.extend(std::iter::repeat_n(b'z', len));
        request.extend_from_slice(b"\r\nget toobig\r\n");
        c.expect(
            request,
            "SERVER_ERROR object too large for cache\r\nEND\r\n",
        );
    }
    // append past the limit is not stored, as in memcached.
    c.expect("append big 0 0 1\r\nx\r\n", "NOT_STORED\r\n");
    assert_eq!(c.get("big"), Some(big));
    // memcached's counter of refused items: the three sets (not the append).
    assert_eq!(c.stat("store_too_large"), 3);
    assert_eq!(c.stat("store_no_memory"), 0);
    assert_eq!(c.stat("listen_disabled_num"), 0);
}

#[test]
fn retrieval_commands() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.set("k1", b"one");
    c.set("k2", b"two");
    assert_eq!(
        c.until_end("get k1 missing k2 k1\r\n"),
        "VALUE k1 0 3\r\none\r\nVALUE k2 0 3\r\ntwo\r\nVALUE k1 0 3\r\none\r\nEND\r\n"
    );
    assert_eq!(c.until_end("get missing\r\n"), "END\r\n");
    let (_, cas1) = c.gets("k1").unwrap();
    let (_, cas2) = c.gets("k2").unwrap();
    assert_ne!(cas1, cas2);
    assert_eq!(
        c.until_end("gets k1 k2\r\n"),
        format!("VALUE k1 0 3 {cas1}\r\none\r\nVALUE k2 0 3 {cas2}\r\ntwo\r\nEND\r\n")
    );
    // gat and gats touch: the CAS value stays, the TTL changes.
    assert_eq!(
        c.until_end("gat 100 k1 missing\r\n"),
        "VALUE k1 0 3\r\none\r\nEND\r\n"
    );
    assert_eq!(
        c.until_end("gats 100 k1\r\n"),
        format!("VALUE k1 0 3 {cas1}\r\none\r\nEND\r\n")
    );
    c.expect_ttl_line("mg k1 t c\r\n", &format!("HD t100 c{cas1}\r\n"));
    assert_eq!(
        c.until_end("gat -1 k2\r\n"),
        "VALUE k2 0 3\r\ntwo\r\nEND\r\n"
    );
    assert_eq!(
        c.get("k2"),
        None,
        "gat with a negative exptime expires the item"
    );
    c.expect(
        "gat abc k1\r\n",
        "CLIENT_ERROR invalid exptime argument\r\n",
    );
}

#[test]
fn delete_and_touch() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.set("d", b"x");
    c.expect("delete d\r\n", "DELETED\r\n");
    c.expect("delete d\r\n", "NOT_FOUND\r\n");
    c.set("d", b"x");
    c.expect("delete d 0\r\n", "DELETED\r\n");
    c.set("d", b"x");
    c.expect("delete d noreply\r\ndelete d\r\n", "NOT_FOUND\r\n");
    c.expect(
        "delete d 5\r\n",
        "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]\r\n",
    );
    c.expect("touch d 10\r\n", "NOT_FOUND\r\n");
    c.set("t", b"x");
    c.expect("touch t 100\r\n", "TOUCHED\r\n");
    c.expect_ttl_line("touch t 100 noreply\r\nmg t t\r\n", "HD t100\r\n");
    c.expect("touch t -1\r\n", "TOUCHED\r\n");
    assert_eq!(c.get("t"), None);
    c.expect(
        "touch t abc\r\n",
        "CLIENT_ERROR invalid exptime argument\r\n",
    );
}

#[test]
fn incr_decr_edges() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("incr n 1\r\n", "NOT_FOUND\r\n");
    c.expect("decr n 1\r\n", "NOT_FOUND\r\n");
    c.set("n", b"10");
    c.expect("incr n 5\r\n", "15\r\n");
    // decr stops at 0; the number is rewritten in place, padded with spaces.
    c.expect("decr n 6\r\n", "9\r\n");
    assert_eq!(c.get("n"), Some(b"9 ".to_vec()));
    c.expect("decr n 100\r\n", "0\r\n");
    c.expect("incr n 123\r\n", "123\r\n");
    assert_eq!(c.get("n"), Some(b"123".to_vec()));
    // 64-bit wrap.
    c.set("w", b"18446744073709551615");
    c.expect("incr w 1\r\n", "0\r\n");
    c.set("w", b"18446744073709551610");
    c.expect(
        "incr w 18446744073709551615\r\n",
        "18446744073709551609\r\n",
    );
    c.expect("decr w 18446744073709551615\r\n", "0\r\n");
    // Not numbers.
    for bad in [&b"abc"[..], b"", b"-1", b"12abc", b"18446744073709551616"] {
        c.set("bad", bad);
        c.expect(
            "incr bad 1\r\n",
            "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
        );
        c.expect(
            "decr bad 1\r\n",
            "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
        );
    }
    // memcached's strtoull takes leading and trailing white space.
    c.set("sp", b" 7 ");
    c.expect("incr sp 1\r\n", "8\r\n");
    c.expect(
        "incr n abc\r\n",
        "CLIENT_ERROR invalid numeric delta argument\r\n",
    );
    c.expect(
        "incr n -1\r\n",
        "CLIENT_ERROR invalid numeric delta argument\r\n",
    );
    c.expect(
        "incr n 18446744073709551616\r\n",
        "CLIENT_ERROR invalid numeric delta argument\r\n",
    );
    c.expect(
        "incr n 1 noreply\r\ndecr n 1 noreply\r\nget n\r\n",
        "VALUE n 0 3\r\n123\r\nEND\r\n",
    );
    // Flags and TTL survive arithmetic.
    c.expect("set fl 42 100 1\r\n5\r\n", "STORED\r\n");
    c.expect("incr fl 1\r\n", "6\r\n");
    c.expect_ttl_line("mg fl f t v\r\n", "VA 1 f42 t100\r\n");
    assert_eq!(c.line(), "6\r\n");
}

#[test]
fn cas_semantics_and_a_race_between_two_connections() {
    let kura = Kura::start(&[]);
    let mut a = kura.client();
    let mut b = kura.client();
    a.expect("cas nope 0 0 1 1\r\nx\r\n", "NOT_FOUND\r\n");
    a.set("k", b"v0");
    let (_, cas_a) = a.gets("k").unwrap();
    let (_, cas_b) = b.gets("k").unwrap();
    assert_eq!(cas_a, cas_b);
    a.expect(format!("cas k 0 0 2 {cas_a}\r\nva\r\n"), "STORED\r\n");
    b.expect(format!("cas k 0 0 2 {cas_b}\r\nvb\r\n"), "EXISTS\r\n");
    assert_eq!(b.get("k"), Some(b"va".to_vec()));
    let (_, cas_now) = b.gets("k").unwrap();
    assert_ne!(cas_now, cas_a, "a store gets a new CAS value");
    b.expect(
        format!("cas k 0 0 2 {cas_now} noreply\r\nvb\r\nget k\r\n"),
        "VALUE k 0 2\r\nvb\r\nEND\r\n",
    );
    // A CAS value of 0 never matches an existing item.
    b.expect("cas k 0 0 1 0\r\nz\r\n", "EXISTS\r\n");

    // Many clients increment one counter with gets/cas loops: no update is lost.
    a.set("counter", b"0");
    let port = kura.port;
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Client::connect(port);
                let mut conflicts = 0;
                for _ in 0..50 {
                    loop {
                        let (value, cas) = c.gets("counter").unwrap();
                        let n: u64 = String::from_utf8(value).unwrap().parse().unwrap();
                        let next = (n + 1).to_string();
                        c.send(format!(
                            "cas counter 0 0 {} {cas}\r\n{next}\r\n",
                            next.len()
                        ));
                        match c.line().as_str() {
                            "STORED\r\n" => break,
                            "EXISTS\r\n" => conflicts += 1,
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                }
                conflicts
            })
        })
        .collect();
    let conflicts: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(
        a.get("counter"),
        Some(b"200".to_vec()),
        "{conflicts} conflicts"
    );
    let stats = a.stats();
    assert!(stats["cas_hits"].parse::<u64>().unwrap() >= 202);
    assert!(stats["cas_badval"].parse::<u64>().unwrap() >= u64::from(conflicts));
    assert!(stats["cas_misses"].parse::<u64>().unwrap() >= 1);
}

#[test]
fn concurrent_incr_loses_nothing() {
    let kura = Kura::start(&[]);
    kura.client().set("hits", b"0");
    let port = kura.port;
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Client::connect(port);
                // Pipelined: 250 increments in one write, then the replies.
                let batch: String = (0..250).map(|_| "incr hits 1\r\n").collect();
                c.send(batch);
                for _ in 0..250 {
                    let line = c.line();
                    assert!(line.trim_end().parse::<u64>().is_ok(), "{line:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(kura.client().get("hits"), Some(b"1000".to_vec()));
}

#[test]
fn expiration_rules() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    c.expect("set rel 0 1 1\r\nx\r\n", "STORED\r\n");
    c.expect(format!("set abs 0 {} 1\r\nx\r\n", now + 2), "STORED\r\n");
    c.expect(format!("set past 0 {} 1\r\nx\r\n", now - 10), "STORED\r\n");
    c.expect("set neg 0 -1 1\r\nx\r\n", "STORED\r\n");
    // Just over 30 days is an absolute time (in 1970), so already expired.
    c.expect("set month 0 2592001 1\r\nx\r\n", "STORED\r\n");
    c.expect("set days 0 2592000 1\r\nx\r\n", "STORED\r\n");
    c.expect("set never 0 0 1\r\nx\r\n", "STORED\r\n");
    assert_eq!(c.get("past"), None);
    assert_eq!(c.get("neg"), None);
    assert_eq!(c.get("month"), None);
    assert_eq!(c.get("days"), Some(b"x".to_vec()));
    assert_eq!(c.get("abs"), Some(b"x".to_vec()));
    // An expired item is absent for add, replace, incr and cas too.
    c.expect("add neg 0 0 1\r\ny\r\n", "STORED\r\n");
    c.expect("replace past 0 0 1\r\ny\r\n", "NOT_STORED\r\n");
    c.expect("incr month 1\r\n", "NOT_FOUND\r\n");
    assert!(
        eventually(Duration::from_secs(5), || c.get("rel").is_none()),
        "relative TTL of 1 s"
    );
    assert!(
        eventually(Duration::from_secs(5), || c.get("abs").is_none()),
        "absolute expiry"
    );
    assert_eq!(c.get("never"), Some(b"x".to_vec()));
    let stats = c.stats();
    assert!(stats["get_expired"].parse::<u64>().unwrap() >= 3);
}

#[test]
fn flush_all_now_and_delayed() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.set("a", b"1");
    c.set("b", b"2");
    c.expect("flush_all\r\n", "OK\r\n");
    assert_eq!(c.get("a"), None);
    assert_eq!(c.get("b"), None);
    c.expect("add a 0 0 1\r\n3\r\n", "STORED\r\n");
    assert_eq!(
        c.get("a"),
        Some(b"3".to_vec()),
        "items set after a flush live"
    );
    c.expect("flush_all noreply\r\nget a\r\n", "END\r\n");
    // Delayed: items stay until the delay passes; later ones survive it.
    c.set("late", b"x");
    c.expect("flush_all 2\r\n", "OK\r\n");
    assert_eq!(c.get("late"), Some(b"x".to_vec()));
    assert!(eventually(Duration::from_secs(5), || c
        .get("late")
        .is_none()));
    c.set("after", b"y");
    assert_eq!(c.get("after"), Some(b"y".to_vec()));
    c.expect(
        "flush_all abc\r\n",
        "CLIENT_ERROR invalid exptime argument\r\n",
    );
    assert!(c.stat("cmd_flush") >= 3);
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let mut request = String::new();
    let mut expected = String::new();
    for i in 0..200 {
        request.push_str(&format!(
            "set p{i} {i} 0 {}\r\nv{i}\r\n",
            format!("v{i}").len()
        ));
        expected.push_str("STORED\r\n");
        request.push_str(&format!("get p{i} p{}\r\n", i + 1000));
        expected.push_str(&format!(
            "VALUE p{i} {i} {}\r\nv{i}\r\nEND\r\n",
            format!("v{i}").len()
        ));
        if i % 50 == 0 {
            request.push_str("version\r\nbogus\r\nmn\r\n");
            expected.push_str(&format!("VERSION {}\r\nERROR\r\nMN\r\n", version_of(&kura)));
        }
    }
    c.expect(request, expected);
}

fn version_of(kura: &Kura) -> String {
    let mut c = kura.client();
    c.send("version\r\n");
    c.line()
        .trim_end()
        .strip_prefix("VERSION ")
        .unwrap()
        .to_owned()
}

#[test]
fn gets_from_flash_pipelined_with_writes() {
    // No RAM cache and enough data to seal blocks, so gets go to flash.
    let kura = Kura::start(&[
        "-m",
        "0",
        "--block-size",
        "1M",
        "--size",
        "32M",
        "-I",
        "16k",
    ]);
    let mut c = kura.client();
    let value = |i: usize| format!("{i:08}").repeat(100).into_bytes();
    let mut load = Vec::new();
    for i in 0..3000 {
        load.extend_from_slice(format!("set f{i} 0 0 800 noreply\r\n").as_bytes());
        load.extend_from_slice(&value(i));
        load.extend_from_slice(b"\r\n");
    }
    load.extend_from_slice(b"mn\r\n");
    c.expect(load, "MN\r\n");
    // Interleave flash reads with writes to the keys being read: each reply
    // reflects exactly the writes before it on the connection.
    let mut request = Vec::new();
    let mut expected = Vec::new();
    for i in (0..3000).step_by(7) {
        request.extend_from_slice(format!("get f{i}\r\n").as_bytes());
        expected.extend_from_slice(format!("VALUE f{i} 0 800\r\n").as_bytes());
        expected.extend_from_slice(&value(i));
        expected.extend_from_slice(b"\r\nEND\r\n");
        if i % 3 == 0 {
            request.extend_from_slice(format!("set f{i} 1 0 3\r\nnew\r\nget f{i}\r\n").as_bytes());
            expected.extend_from_slice(
                format!("STORED\r\nVALUE f{i} 1 3\r\nnew\r\nEND\r\n").as_bytes(),
            );
        }
    }
    c.expect(request, expected);
    let stats = c.stats();
    assert!(
        stats["kura_flash_gets"].parse::<u64>().unwrap() > 100,
        "gets went to flash: {}",
        stats["kura_flash_gets"]
    );
}

#[test]
fn stats_fields_and_groups() {
    let kura = Kura::start(&["-c", "77", "-t", "3"]);
    let mut c = kura.client();
    // The start-up probe's connection may not be closed yet.
    assert!(eventually(Duration::from_secs(5), || c
        .stat("curr_connections")
        == 1));
    c.set("s1", b"abc");
    c.set("s2", b"abc");
    c.get("s1");
    c.get("nope");
    let stats = c.stats();
    for field in [
        "pid",
        "uptime",
        "time",
        "version",
        "curr_connections",
        "total_connections",
        "cmd_get",
        "cmd_set",
        "get_hits",
        "get_misses",
        "curr_items",
        "total_items",
        "bytes",
        "limit_maxbytes",
        "evictions",
        "threads",
    ] {
        assert!(stats.contains_key(field), "missing {field}");
    }
    assert_eq!(stats["pid"], kura.pid().to_string());
    assert_eq!(stats["threads"], "3");
    assert_eq!(stats["cmd_get"], "2");
    assert_eq!(stats["get_hits"], "1");
    assert_eq!(stats["get_misses"], "1");
    assert_eq!(stats["cmd_set"], "2");
    assert_eq!(stats["total_items"], "2");
    assert_eq!(stats["curr_items"], "2");
    assert_eq!(stats["curr_connections"], "1");
    assert!(stats["bytes"].parse::<u64>().unwrap() > 0);
    assert!(stats["limit_maxbytes"].parse::<u64>().unwrap() > 0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(stats["time"].parse::<u64>().unwrap().abs_diff(now) < 5);
    let settings = c.until_end("stats settings\r\n");
    assert!(settings.contains("STAT maxconns 77\r\n"), "{settings}");
    assert!(
        settings.contains("STAT item_size_max 65536\r\n"),
        "{settings}"
    );
    c.expect("stats reset\r\n", "RESET\r\n");
    c.expect("stats items\r\n", "END\r\n");
    c.expect("stats nonsense\r\n", "ERROR\r\n");
}

#[test]
fn small_commands() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.send("version\r\n");
    assert!(c.line().starts_with("VERSION 1.6.18-kura"));
    c.expect("verbosity 1\r\n", "OK\r\n");
    c.expect("verbosity 1 noreply\r\nmn\r\n", "MN\r\n");
    c.expect("shutdown\r\n", "ERROR: shutdown not enabled\r\n");
    c.expect(
        "cache_memlimit 4\r\n",
        "MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m\r\n",
    );
    c.expect("cache_memlimit 32\r\n", "OK\r\n");
    assert_eq!(
        c.stats()["kura_ram_cache_limit_bytes"],
        (32u64 << 20).to_string()
    );
    c.send("quit\r\n");
    assert_eq!(
        c.read_to_close(),
        Some(Vec::new()),
        "quit closes without a reply"
    );
    // Replies before quit still arrive.
    let mut c = kura.client();
    c.send("set x 0 0 1\r\ny\r\nget x\r\nquit\r\nget x\r\n");
    assert_eq!(
        c.read_to_close().unwrap(),
        b"STORED\r\nVALUE x 0 1\r\ny\r\nEND\r\n"
    );
}

#[test]
fn prometheus_metrics() {
    let metrics_port = kura_testkit::free_tcp_port().unwrap();
    let addr = format!("127.0.0.1:{metrics_port}");
    let kura = Kura::start(&["--metrics-addr", &addr]);
    let mut c = kura.client();
    assert!(eventually(Duration::from_secs(5), || c
        .stat("curr_connections")
        == 1));
    c.set("m", b"1");
    c.get("m");
    kura_testkit::wait_for_tcp(&addr, Duration::from_secs(5)).unwrap();
    let body = http_get(&addr, "/metrics");
    assert!(body.starts_with("HTTP/1.1 200 OK\r\n"), "{body}");
    assert!(
        body.contains("# TYPE memcached_cmd_get counter\nmemcached_cmd_get 1\n"),
        "{body}"
    );
    assert!(body.contains("memcached_curr_connections 1\n"), "{body}");
    assert!(body.contains("kura_flash_reads "), "{body}");
    assert!(http_get(&addr, "/other").starts_with("HTTP/1.1 404"));
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// `stats conns` as memcached's, per connection by its client's address: the listener
/// (`conn_listening`), a client that stored something (`conn_read`) and one that never sent a
/// command (`conn_new_cmd`), seconds since their last command counting, the asking one
/// (`conn_parse_cmd`, 0 s), a watcher (`conn_watch`); one that stopped reading its replies is `conn_mwrite` in kura
/// (memcached, which takes turns between connections, lists it as `conn_new_cmd` or
/// `conn_mwrite`); a closed connection leaves the list.
#[test]
fn stats_conns_as_memcached() {
    let kura = Kura::start(&[]);
    let theirs = match common::Memcached::start(&[]) {
        Ok(m) => Some(m),
        Err(reason) => {
            kura_testkit::skip(&format!("no memcached to compare stats conns with: {reason}"));
            None
        }
    };
    let ours = conns_view(kura.port);
    assert!(ours.contains(&("stuck".to_owned(), "state".to_owned(), "conn_mwrite".to_owned())), "{ours:?}");
    if let Some(m) = &theirs {
        let stuck_as_ours = |view: Vec<(String, String, String)>| -> Vec<(String, String, String)> {
            view.into_iter()
                .map(|(role, field, value)| match (role.as_str(), field.as_str(), value.as_str()) {
                    ("stuck", "state", "conn_new_cmd" | "conn_mwrite") => (role, field, "conn_mwrite".to_owned()),
                    _ => (role, field, value),
                })
                .collect()
        };
        assert_eq!(ours, stuck_as_ours(conns_view(m.port)), "kura's stats conns (left) against memcached's");
    }
}

/// `stats conns` on a server at `port` as (role, field, value) lines, roles for the
/// connections this opens, addresses and descriptors replaced by roles, seconds as 0 or ≥ 1.
fn conns_view(port: u16) -> Vec<(String, String, String)> {
    let mut stored = Client::connect(port);
    stored.set("k", b"v");
    let idle = Client::connect(port);
    // Stops reading: 2,000 replies of 60 KB fill its socket and the server's output.
    let mut stuck = Client::connect(port);
    stuck.set("big", &vec![b'b'; 60_000]);
    stuck.send("get big\r\n".repeat(2000));
    let mut watcher = Client::connect(port);
    watcher.send("watch connevents\r\n");
    assert_eq!(watcher.line(), "OK\r\n");
    let mut asking = Client::connect(port);
    asking.send("version\r\n");
    asking.line();
    std::thread::sleep(Duration::from_millis(1300));
    let local_port = |c: &Client| c.stream.local_addr().unwrap().port();
    let roles = [(local_port(&stored), "stored"), (local_port(&idle), "idle"), (local_port(&stuck), "stuck"), (local_port(&asking), "asking"), (local_port(&watcher), "watcher")];
    let listing = asking.until_end("stats conns\r\n");
    // Lines by descriptor, in the order listed.
    let mut by_fd: Vec<(u32, Vec<(String, String)>)> = Vec::new();
    for line in listing.lines().filter(|l| *l != "END") {
        let rest = line.strip_prefix("STAT ").unwrap_or_else(|| panic!("{line:?}"));
        let (name, value) = rest.split_once(' ').unwrap_or_else(|| panic!("{line:?}"));
        let (fd, field) = name.split_once(':').unwrap_or_else(|| panic!("{line:?}"));
        let fd: u32 = fd.parse().unwrap_or_else(|_| panic!("{line:?}"));
        match by_fd.last_mut() {
            Some((last, fields)) if *last == fd => fields.push((field.to_owned(), value.to_owned())),
            _ => {
                assert!(by_fd.iter().all(|(other, _)| *other < fd), "descriptors in order: {listing}");
                by_fd.push((fd, vec![(field.to_owned(), value.to_owned())]));
            }
        }
    }
    let listener = format!("tcp:127.0.0.1:{port}");
    let mut view = Vec::new();
    for (_, fields) in by_fd {
        let addr = &fields[0].1;
        let role = if *addr == listener {
            "listener"
        } else {
            let client_port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
            match roles.iter().find(|(p, _)| *p == client_port) {
                Some((_, role)) => role,
                None => continue, // another client of the server (a start-up probe)
            }
        };
        for (field, value) in fields {
            let value = match field.as_str() {
                "addr" if role != "listener" => "<client>".to_owned(),
                "addr" => "<listener>".to_owned(),
                "listen_addr" => {
                    assert_eq!(value, listener);
                    "<listener>".to_owned()
                }
                "secs_since_last_cmd" if role != "listener" => if value.parse::<u64>().unwrap() >= 1 { ">=1" } else { "0" }.to_owned(),
                "secs_since_last_cmd" => "<uptime>".to_owned(),
                _ => value,
            };
            view.push((role.to_owned(), field, value));
        }
    }
    view.sort();
    assert_eq!(view.iter().filter(|(_, f, _)| f == "addr").count(), 6, "{listing}");
    // A closed connection leaves the list.
    drop(stored);
    assert!(eventually(Duration::from_secs(5), || !asking.until_end("stats conns\r\n").contains(&format!(":{}\r\n", roles[0].0))));
    drop(stuck);
    view
}
