//! `lru_crawler crawl` and the crawler's settings against the real server: the replies of
//! every crawler command as memcached gives them (run side by side), a crawl that reclaims
//! expired and flushed items and leaves live ones and ones stored again alone, `tocrawl` and
//! class selection, and a store-mode store filled with items that then expire: it refused every
//! write until now; the crawl a full store starts frees it.

mod common;

use std::time::Duration;

use common::{Client, Kura, Memcached, eventually};

/// The crawler's counters and whether a crawl runs.
fn crawler_stats(c: &mut Client) -> (u64, u64, u64) {
    (c.stat("crawler_items_checked"), c.stat("crawler_reclaimed"), running(c))
}

/// `lru_crawler_running`, which memcached lists only while the crawler is enabled.
fn running(c: &mut Client) -> u64 {
    c.stats().get("lru_crawler_running").map_or(0, |v| v.parse().expect("a number"))
}

/// Asks for a crawl and waits until it has ended.
fn crawl(c: &mut Client, spec: &str) {
    c.expect(format!("lru_crawler crawl {spec}\r\n"), "OK\r\n");
    assert!(eventually(Duration::from_secs(30), || running(c) == 0), "the crawl ends");
}

/// Every crawler command, and malformed ones, answered as memcached 1.6 answers them.
#[test]
fn crawler_commands_answer_as_memcached() {
    let memcached = match Memcached::start(&["-m", "64"]) {
        Ok(m) => m,
        Err(reason) => return kura_testkit::skip(&reason),
    };
    let kura = Kura::start(&[]);
    // One at a time, so that a crawl just started has ended before the next line (memcached
    // answers BUSY otherwise, and so does kura).
    let lines = [
        "lru_crawler",
        "lru_crawler bogus",
        "lru_crawler enable",
        "lru_crawler disable",
        "lru_crawler disable",
        "lru_crawler crawl all",
        "lru_crawler metadump all",
        "lru_crawler enable",
        "lru_crawler enable x",
        "lru_crawler sleep 100",
        "lru_crawler sleep 1000000",
        "lru_crawler sleep 1000001",
        "lru_crawler sleep -1",
        "lru_crawler sleep x",
        "lru_crawler sleep",
        "lru_crawler tocrawl 10",
        "lru_crawler tocrawl x",
        "lru_crawler tocrawl -1",
        "lru_crawler tocrawl",
        "lru_crawler tocrawl 0",
        "lru_crawler crawl",
        "lru_crawler crawl all extra",
        "lru_crawler crawl 0",
        "lru_crawler crawl 64",
        "lru_crawler crawl x",
        "lru_crawler crawl 1,64",
        "lru_crawler crawl hash",
        "lru_crawler crawl 1,",
        "lru_crawler crawl all",
    ];
    let (mut theirs, mut ours) = (Client::connect(memcached.port), kura.client());
    for line in lines {
        let request = format!("{line}\r\n");
        for c in [&mut theirs, &mut ours] {
            c.send(&request);
        }
        let (want, got) = (theirs.line(), ours.line());
        assert_eq!(got, want, "{line}");
        for c in [&mut theirs, &mut ours] {
            eventually(Duration::from_secs(10), || running(c) == 0);
        }
    }
    let settings = |c: &mut Client| -> Vec<String> {
        c.until_end("stats settings\r\n").lines().filter(|l| l.starts_with("STAT lru_crawler")).map(str::to_owned).collect()
    };
    theirs.expect("lru_crawler sleep 250\r\nlru_crawler tocrawl 7\r\n", "OK\r\nOK\r\n");
    ours.expect("lru_crawler sleep 250\r\nlru_crawler tocrawl 7\r\n", "OK\r\nOK\r\n");
    assert_eq!(settings(&mut ours), settings(&mut theirs));
    assert_eq!(settings(&mut ours), ["STAT lru_crawler yes", "STAT lru_crawler_sleep 250", "STAT lru_crawler_tocrawl 7"]);
    // Disabled, both leave the crawler's running state out of `stats`.
    let listed = |c: &mut Client| c.stats().contains_key("lru_crawler_running");
    // memcached answers `disable` before its crawler thread has stopped and only then takes
    // the entry out (it kept it for one more `stats` in 1 of 12 runs), so it gets a moment;
    // kura's answer comes after its crawler stopped, so kura's `stats` must be right at once.
    for (name, c) in [("memcached", &mut theirs), ("kura", &mut ours)] {
        c.expect("lru_crawler disable\r\n", "OK\r\n");
        let gone = if name == "kura" { !listed(c) } else { eventually(Duration::from_secs(5), || !listed(c)) };
        assert!(gone, "{name}: lru_crawler_running listed while disabled");
        c.expect("lru_crawler enable\r\n", "OK\r\n");
        assert!(listed(c), "{name}: lru_crawler_running not listed while enabled");
    }
}

/// A crawl reclaims what is expired or flushed, and only that: live items, items without a
/// time to live and items stored again since they were seen stay.
#[test]
fn a_crawl_reclaims_expired_and_flushed_items_only() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let mut batch = String::new();
    for i in 0..300 {
        // 100 expire in a second, 100 live long, 100 never expire.
        let exptime = match i % 3 {
            0 => 1,
            1 => 3600,
            _ => 0,
        };
        batch.push_str(&format!("set k{i} 0 {exptime} 5 noreply\r\nv{i:04}\r\n"));
    }
    batch.push_str("mn\r\n");
    c.expect(batch, "MN\r\n");
    std::thread::sleep(Duration::from_millis(2100));
    // One of the expired ones is stored again before the crawl: it must survive it.
    c.expect("set k0 0 0 3\r\nnew\r\n", "STORED\r\n");
    let (checked_before, reclaimed_before, _) = crawler_stats(&mut c);
    crawl(&mut c, "all");
    let (checked, reclaimed, running) = crawler_stats(&mut c);
    assert_eq!(running, 0);
    assert_eq!(checked - checked_before, 300, "every item is looked at");
    assert_eq!(reclaimed - reclaimed_before, 99, "the expired ones, not the one stored again");
    assert_eq!(c.get("k0").as_deref(), Some(&b"new"[..]));
    for i in 1..300 {
        let want = (i % 3 != 0).then(|| format!("v{i:04}").into_bytes());
        assert_eq!(c.get(&format!("k{i}")), want, "k{i}");
    }
    // The crawled store lists only the live items.
    let dump = c.until_end("lru_crawler metadump all\r\n");
    assert_eq!(dump.lines().filter(|l| l.starts_with("key=")).count(), 201);
    // flush_all invalidates everything: a crawl reclaims it all.
    c.expect("flush_all\r\n", "OK\r\n");
    std::thread::sleep(Duration::from_millis(1100));
    crawl(&mut c, "all");
    let (_, reclaimed_after, _) = crawler_stats(&mut c);
    assert_eq!(reclaimed_after - reclaimed, 201);
    assert_eq!(c.until_end("lru_crawler metadump all\r\n"), "END\r\n");
}

/// `tocrawl` caps the items looked at per class; a crawl of some classes leaves the others.
#[test]
fn tocrawl_and_classes_limit_a_crawl() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let mut batch = String::new();
    let big = "x".repeat(2000);
    for i in 0..50 {
        // Class 1 (61-byte items) and class 15 or so (2 KB items), all expiring.
        batch.push_str(&format!("set s{i:02} 0 1 1 noreply\r\ns\r\nset b{i:02} 0 1 2000 noreply\r\n{big}\r\n"));
    }
    batch.push_str("mn\r\n");
    c.expect(batch, "MN\r\n");
    std::thread::sleep(Duration::from_millis(2100));
    c.expect("lru_crawler tocrawl 10\r\n", "OK\r\n");
    crawl(&mut c, "all");
    let (checked, reclaimed, _) = crawler_stats(&mut c);
    assert_eq!((checked, reclaimed), (20, 20), "10 of each class");
    c.expect("lru_crawler tocrawl 0\r\n", "OK\r\n");
    crawl(&mut c, "1");
    let (checked, reclaimed, _) = crawler_stats(&mut c);
    assert_eq!((checked, reclaimed), (60, 60), "the 40 small ones left");
    crawl(&mut c, "all");
    let (checked, reclaimed, _) = crawler_stats(&mut c);
    assert_eq!((checked, reclaimed), (100, 100), "then the 40 big ones");
}

/// Store mode: a store filled with items that then expire took no more writes, ever
/// (`SERVER_ERROR out of memory` although no live data filled it). The first write that
/// finds it full starts a crawl; once it has run, the store takes as much again.
#[test]
fn a_full_store_of_expired_items_takes_writes_again() {
    let kura = Kura::start(&["--mode", "store", "-m", "1"]);
    let mut c = kura.client();
    let value = vec![b'x'; 4000];
    let fill = |c: &mut Client, prefix: &str, exptime: u32| -> usize {
        let mut stored = 0;
        loop {
            let mut request = format!("set {prefix}{stored} 0 {exptime} {}\r\n", value.len()).into_bytes();
            request.extend_from_slice(&value);
            request.extend_from_slice(b"\r\n");
            c.send(request);
            match c.line().as_str() {
                "STORED\r\n" => stored += 1,
                "SERVER_ERROR out of memory storing object\r\n" => return stored,
                other => panic!("{other:?} after {stored} items"),
            }
        }
    };
    let expiring = fill(&mut c, "a", 2);
    assert!(expiring > 5000, "a 64 MiB store holds thousands of 4 KB items: {expiring}");
    std::thread::sleep(Duration::from_millis(3100));
    // The first write after the expiry starts a crawl (whether it fails or not).
    let mut request = format!("set trigger 0 0 {}\r\n", value.len()).into_bytes();
    request.extend_from_slice(&value);
    request.extend_from_slice(b"\r\n");
    c.send(request);
    let _ = c.line();
    assert!(eventually(Duration::from_secs(30), || c.stat("crawler_reclaimed") as usize >= expiring), "the crawl reclaims every expired item");
    assert!(eventually(Duration::from_secs(30), || running(&mut c) == 0));
    let again = fill(&mut c, "b", 0);
    assert!(again * 10 >= expiring * 9, "{again} items stored after the crawl, {expiring} before");
    for i in (0..again).step_by(997) {
        assert_eq!(c.get(&format!("b{i}")).as_deref(), Some(&value[..]), "b{i}");
    }
    // Now the store is full of live items without a time to live: writes fail, and they do
    // not make the server read the whole store again for nothing.
    let starts = c.stat("lru_crawler_starts");
    for _ in 0..20 {
        assert_eq!(fill(&mut c, "c", 0), 0);
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(c.stat("lru_crawler_starts"), starts, "no crawl while nothing can have expired");
    // A flush_all makes everything dead: the next full write crawls again and frees the room.
    c.expect("flush_all\r\n", "OK\r\n");
    std::thread::sleep(Duration::from_millis(1100));
    let _ = fill(&mut c, "d", 0);
    assert!(eventually(Duration::from_secs(30), || c.stat("lru_crawler_starts") == starts + 1 && running(&mut c) == 0));
    assert!(fill(&mut c, "e", 0) * 10 >= again * 9, "the flushed store takes as much again");
}
