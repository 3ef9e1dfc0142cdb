//! Restarts, crashes, a full store, and shutdown.

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Client, Kura, SERVER_BIN, SMALL};

/// Loads items of several sizes (so some are sealed on flash and some are
/// still in write buffers), with flags, TTLs, a delete and a flush.
fn load(c: &mut Client) -> Vec<(String, Vec<u8>, u32)> {
    let mut items = Vec::new();
    let mut batch = Vec::new();
    for i in 0..2000u32 {
        let key = format!("p{i}");
        let len = [10usize, 300, 3000, 9000][i as usize % 4];
        let value: Vec<u8> = (0..len).map(|j| (j as u32 * 7 + i) as u8).collect();
        batch.extend_from_slice(format!("set {key} {i} 0 {len} noreply\r\n").as_bytes());
        batch.extend_from_slice(&value);
        batch.extend_from_slice(b"\r\n");
        items.push((key, value, i));
    }
    batch.extend_from_slice(b"mn\r\n");
    c.expect(batch, "MN\r\n");
    c.expect(
        "set ttl 0 1000 3\r\nttl\r\ndelete p0\r\n",
        "STORED\r\nDELETED\r\n",
    );
    items.remove(0);
    items
}

fn check(c: &mut Client, items: &[(String, Vec<u8>, u32)]) {
    for (key, value, flags) in items.iter().step_by(3) {
        c.send(format!("get {key}\r\n"));
        assert_eq!(
            c.line(),
            format!("VALUE {key} {flags} {}\r\n", value.len()),
            "{key}"
        );
        assert_eq!(&c.bytes(value.len())[..], &value[..], "{key}");
        assert_eq!(c.bytes(2), b"\r\n");
        assert_eq!(c.line(), "END\r\n");
    }
    assert_eq!(c.get("p0"), None, "a delete survives the restart");
    c.send("mg ttl t\r\n");
    let line = c.line();
    assert!(
        line == "HD t1000\r\n" || line == "HD t999\r\n",
        "the TTL survives the restart: {line:?}"
    );
}

fn flush_survives_restart(mode: &str) {
    let mut kura = Kura::start(&["--mode", mode, "--sync", "never"]);
    let mut c = kura.client();
    load(&mut c);
    c.set("flushed", b"x");
    c.expect("flush_all\r\n", "OK\r\n");
    c.set("after", b"y");
    drop(c);
    let status = kura.stop();
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0 ({status:?})");
    kura.restart();
    let mut c = kura.client();
    // Everything but the items set before the flush_all.
    assert_eq!(c.get("flushed"), None, "flush_all survives the restart");
    assert_eq!(c.get("p5"), None);
    assert_eq!(c.get("after"), Some(b"y".to_vec()));
}

fn restart_keeps_data(mode: &str) {
    let mut kura = Kura::start(&["--mode", mode, "--sync", "never"]);
    let mut c = kura.client();
    let items = load(&mut c);
    let (_, cas) = c.gets("p5").unwrap();
    drop(c);
    assert_eq!(kura.stop().code(), Some(0));
    kura.restart();
    let mut c = kura.client();
    check(&mut c, &items);
    assert_eq!(
        c.gets("p5").unwrap().1,
        cas,
        "CAS values survive the restart"
    );
    assert_eq!(c.stats()["kura_mode"], mode);
}

#[test]
fn restart_keeps_data_in_cache_mode() {
    restart_keeps_data("cache");
}

#[test]
fn restart_keeps_data_in_store_mode() {
    restart_keeps_data("store");
}

#[test]
fn flush_all_survives_a_restart() {
    flush_survives_restart("cache");
}

fn sigkill_after_acknowledged_writes(mode: &str) {
    let mut kura = Kura::start(&["--mode", mode, "--sync", "always"]);
    let mut c = kura.client();
    for i in 0..50 {
        c.set(&format!("k{i}"), format!("v{i}").as_bytes());
    }
    c.expect(
        "incr n 1\r\nset n 0 0 1\r\n5\r\nincr n 2\r\ndelete k3\r\n",
        "NOT_FOUND\r\nSTORED\r\n7\r\nDELETED\r\n",
    );
    kura.kill();
    kura.restart();
    let mut c = kura.client();
    for i in 0..50 {
        let expected = (i != 3).then(|| format!("v{i}").into_bytes());
        assert_eq!(c.get(&format!("k{i}")), expected, "k{i} after SIGKILL");
    }
    assert_eq!(c.get("n"), Some(b"7".to_vec()));
}

#[test]
fn sigkill_loses_no_acknowledged_write_with_sync_always_cache_mode() {
    sigkill_after_acknowledged_writes("cache");
}

#[test]
fn sigkill_loses_no_acknowledged_write_with_sync_always_store_mode() {
    sigkill_after_acknowledged_writes("store");
}

/// `sync` (kura's extension) is a barrier over every write acknowledged before it, from any
/// connection, even with `--sync never`.
#[test]
fn sigkill_after_a_sync_command_loses_nothing_acknowledged_before_it() {
    let mut kura = Kura::start(&["--mode", "store", "--sync", "never"]);
    let mut other = kura.client();
    let mut c = kura.client();
    let mut batch = Vec::new();
    for i in 0..500u32 {
        let value = format!("v{i}-{}", "x".repeat(i as usize * 7 % 5000));
        batch.extend_from_slice(format!("set k{i} {i} 0 {} noreply\r\n", value.len()).as_bytes());
        batch.extend_from_slice(value.as_bytes());
        batch.extend_from_slice(b"\r\n");
    }
    batch.extend_from_slice(b"delete k7\r\n");
    other.expect(batch, "DELETED\r\n");
    c.expect("sync\r\n", "OK\r\n");
    c.expect(
        "sync noreply\r\nsync extra\r\nmn\r\n",
        "CLIENT_ERROR bad command line format\r\nMN\r\n",
    );
    kura.kill();
    kura.restart();
    let mut c = kura.client();
    for i in 0..500u32 {
        let expected =
            (i != 7).then(|| format!("v{i}-{}", "x".repeat(i as usize * 7 % 5000)).into_bytes());
        assert_eq!(c.get(&format!("k{i}")), expected, "k{i} after SIGKILL");
    }
}

#[test]
fn a_full_cache_evicts_the_oldest_and_never_refuses_a_set() {
    let kura = Kura::start(&[
        "--mode",
        "cache",
        "--size",
        "24M",
        "--block-size",
        "1M",
        "-I",
        "16k",
        "-m",
        "0",
    ]);
    let mut c = kura.client();
    let value = vec![b'e'; 4000];
    // About 3× what the store holds.
    for round in 0..12 {
        let mut batch = Vec::new();
        for i in 0..1000 {
            batch.extend_from_slice(format!("set e{} 0 0 4000\r\n", round * 1000 + i).as_bytes());
            batch.extend_from_slice(&value);
            batch.extend_from_slice(b"\r\n");
        }
        c.send(&batch);
        for _ in 0..1000 {
            assert_eq!(c.line(), "STORED\r\n");
        }
    }
    let stats = c.stats();
    assert!(
        stats["evictions"].parse::<u64>().unwrap() > 0,
        "evictions: {}",
        stats["evictions"]
    );
    assert!(stats["kura_evicted_blocks"].parse::<u64>().unwrap() > 0);
    assert_eq!(
        c.get("e11999"),
        Some(value.clone()),
        "the newest item is kept"
    );
    assert_eq!(c.get("e0"), None, "the oldest is evicted");
}

#[test]
fn a_full_store_refuses_sets_and_keeps_its_data() {
    let kura = Kura::start(&[
        "--mode",
        "store",
        "--size",
        "24M",
        "--block-size",
        "1M",
        "-I",
        "16k",
        "-m",
        "0",
    ]);
    let mut c = kura.client();
    let value = vec![b's'; 4000];
    let mut stored = 0;
    let mut refused = None;
    for i in 0..20_000 {
        c.send(format!("set s{i} 0 0 4000\r\n"));
        c.send(&value);
        c.send("\r\n");
        let line = c.line();
        if line == "STORED\r\n" {
            stored += 1;
        } else {
            refused = Some(line);
            break;
        }
    }
    assert_eq!(
        refused.as_deref(),
        Some("SERVER_ERROR out of memory storing object\r\n"),
        "after {stored} sets"
    );
    assert!(stored > 1000, "only {stored} sets fit");
    assert_eq!(c.stat("store_no_memory"), 1, "memcached's counter of stores refused for room");
    for i in (0..stored).step_by(97) {
        assert_eq!(c.get(&format!("s{i}")), Some(value.clone()), "s{i} is kept");
    }
    // Reads and deletes still work on a full store.
    c.expect("delete s1\r\n", "DELETED\r\n");
}

/// Items `f0`..`f1999` of 5,000 bytes each, on flash (`-m 0`: no RAM cache).
const SHUTDOWN_ITEMS: usize = 2000;
const SHUTDOWN_VALUE_BYTES: usize = 5000;

fn start_with_items_on_flash() -> (Kura, Client) {
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
    let value = vec![b'f'; SHUTDOWN_VALUE_BYTES];
    let mut load = Vec::new();
    for i in 0..SHUTDOWN_ITEMS {
        load.extend_from_slice(
            format!("set f{i} 0 0 {SHUTDOWN_VALUE_BYTES} noreply\r\n").as_bytes(),
        );
        load.extend_from_slice(&value);
        load.extend_from_slice(b"\r\n");
    }
    load.extend_from_slice(b"mn\r\n");
    c.expect(load, "MN\r\n");
    (kura, c)
}

/// Checks that `text` is whole replies to `get f<i mod SHUTDOWN_ITEMS>` for i = 0, 1, …
/// (none cut short); returns how many.
fn assert_whole_replies(text: &[u8]) -> usize {
    let mut at = 0;
    let mut replies = 0;
    while at < text.len() {
        let header = format!(
            "VALUE f{} 0 {SHUTDOWN_VALUE_BYTES}\r\n",
            replies % SHUTDOWN_ITEMS
        );
        let whole = header.len() + SHUTDOWN_VALUE_BYTES + 2 + b"END\r\n".len();
        assert!(
            text[at..].starts_with(header.as_bytes()),
            "reply {replies} malformed"
        );
        assert!(
            text.len() - at >= whole,
            "reply {replies} cut after {} of its {whole} bytes",
            text.len() - at
        );
        assert!(
            text[at..at + whole].ends_with(b"\r\nEND\r\n"),
            "reply {replies} malformed"
        );
        at += whole;
        replies += 1;
    }
    replies
}

#[test]
fn sigterm_finishes_in_flight_requests_and_exits_zero() {
    let (mut kura, mut c) = start_with_items_on_flash();
    // An idle client and a busy one are connected when SIGTERM arrives.
    let _idle = kura.client();
    let requests: String = (0..SHUTDOWN_ITEMS)
        .map(|i| format!("get f{i}\r\n"))
        .collect();
    c.send(requests);
    sigterm_then_read_whole_replies(&mut kura, &mut c, Duration::ZERO);
}

/// Sends SIGTERM once `c` has its first reply line, waits `pause` before reading on, then
/// checks that every reply that arrives is whole (the server finishes what it started) and
/// that the server exits 0 in time. Returns how many replies came.
fn sigterm_then_read_whole_replies(kura: &mut Kura, c: &mut Client, pause: Duration) -> usize {
    let first = c.line();
    assert_eq!(first, format!("VALUE f0 0 {SHUTDOWN_VALUE_BYTES}\r\n"));
    let started = Instant::now();
    let pid = kura.pid();
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    std::thread::sleep(pause);
    let rest = c.read_to_close().expect("server closes");
    let mut text = first.into_bytes();
    text.extend_from_slice(&rest);
    let replies = assert_whole_replies(&text);
    let status = kura
        .child
        .take()
        .unwrap()
        .terminate(Duration::from_secs(20))
        .unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "{status:?} signal {:?}",
        status.signal()
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    replies
}

/// At SIGTERM the server stops parsing, so a client that pipelined more than the server read
/// leaves requests unread in the server's socket. Closing a socket with unread input makes
/// the kernel reset the connection and throw away the replies it had not sent yet: a reply
/// cut in the middle (seen once under load by the test above). Here the client reads nothing
/// for a while after SIGTERM, so megabytes of replies wait in the socket when the server has
/// handed over the last of them.
#[test]
fn sigterm_sends_started_replies_whole_though_requests_are_left_unread() {
    let (mut kura, mut c) = start_with_items_on_flash();
    // Over 300 kB of gets: far more than the server reads before its output is full.
    let requests: Vec<u8> = (0..30_000)
        .flat_map(|i| format!("get f{}\r\n", i % SHUTDOWN_ITEMS).into_bytes())
        .collect();
    let mut sender = c.stream.try_clone().unwrap();
    // The requests may not all fit in the socket buffers: send them while this thread reads.
    let sending = std::thread::spawn(move || {
        let _ = sender.write_all(&requests);
    });
    // The client reads nothing for a while after SIGTERM: replies back up in the socket.
    sigterm_then_read_whole_replies(&mut kura, &mut c, Duration::from_millis(500));
    sending.join().unwrap();
}

/// A client that stops reading its replies holds shutdown up for the drain timeout (5 s) at
/// most; then the server closes it, syncs and exits 0.
#[test]
fn sigterm_with_a_client_that_stops_reading_exits_after_the_drain_timeout() {
    let (mut kura, mut c) = start_with_items_on_flash();
    let requests: String = (0..SHUTDOWN_ITEMS)
        .map(|i| format!("get f{i}\r\n"))
        .collect();
    c.send(requests);
    // The first line, then nothing more.
    assert_eq!(c.line(), format!("VALUE f0 0 {SHUTDOWN_VALUE_BYTES}\r\n"));
    let started = Instant::now();
    let status = kura.stop();
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    drop(c);
}

#[test]
fn refuses_a_store_of_another_mode_and_an_item_limit_its_blocks_cannot_hold() {
    let mut kura = Kura::start(&["--mode", "store"]);
    kura.client().set("x", b"1");
    assert_eq!(kura.stop().code(), Some(0));
    let store = kura.store_path();
    let run = |args: &[&str]| {
        let out = Command::new(SERVER_BIN)
            .args(["-p", "0", "--path"])
            .arg(&store)
            .args(args)
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (status, stderr) = run(&["--mode", "cache"]);
    assert!(!status.success());
    assert!(
        stderr.contains("store mode") || stderr.contains("Store"),
        "{stderr}"
    );
    let (status, stderr) = run(&["-I", "2m"]);
    assert!(!status.success());
    assert!(stderr.contains("lower -I"), "{stderr}");
    // Without --mode, the store's own mode is used.
    kura.restart_with(&[]);
    assert_eq!(kura.client().stats()["kura_mode"], "store");
    let (status, stderr) = run(&["-U", "11211"]);
    assert!(
        !status.success() && stderr.contains("UDP is not supported"),
        "{stderr}"
    );
}

/// One engine per store: a second server on a store another serves is refused with the
/// reason (two engines would each reclaim blocks the other thinks its own, and neither would
/// see the other's writes), the first goes on serving, and once it is killed a restart can
/// open the store at once (the lock goes with the process, not with its io_uring).
#[test]
fn a_second_server_on_a_served_store_is_refused() {
    let mut kura = Kura::start(&[]);
    kura.client().set("k", b"v1");
    let out = Command::new(SERVER_BIN)
        .args(["-p", "0", "--path"])
        .arg(kura.store_path())
        .args(SMALL)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second server on the store started: {stderr}");
    assert!(stderr.contains("is in use by another open of it"), "{stderr}");
    let mut c = kura.client();
    assert_eq!(c.get("k").as_deref(), Some(&b"v1"[..]), "the first server after the refusal");
    c.expect("set k 0 0 2\r\nv2\r\n", "STORED\r\n");
    c.expect("sync\r\n", "OK\r\n");
    drop(c);
    kura.kill();
    kura.restart();
    assert_eq!(kura.client().get("k").as_deref(), Some(&b"v2"[..]));
}

/// `stats` names the process start (`kura_instance_id`): the same on every connection of one
/// process, another after a restart, so a client tells a restart (unsynced writes may be
/// lost) from a connection that merely closed.
#[test]
fn the_instance_id_changes_with_a_restart_only() {
    let mut kura = Kura::start(&[]);
    let first = kura.client().stats()["kura_instance_id"].clone();
    assert_eq!(first.len(), 16, "{first:?}");
    assert!(u64::from_str_radix(&first, 16).is_ok(), "{first:?}");
    assert_eq!(kura.client().stats()["kura_instance_id"], first);
    kura.kill();
    kura.restart();
    let second = kura.client().stats()["kura_instance_id"].clone();
    assert_ne!(second, first);
    assert_eq!(second.len(), 16, "{second:?}");
}

/// The change log clients on this host map (`stats` names it, `kura_changes_file`; see
/// `kura_engine::changes`): every change counted with the key it was to, `flush_all` as a
/// change to everything, a read as nothing; a restart (after `kill -9` too) as a change to
/// everything in the same file, under a new instance.
#[test]
fn the_change_log_names_each_changed_key() {
    use kura_engine::changes::{ChangeView, change_tag};
    let mut kura = Kura::start(&[]);
    let view_of = |c: &mut Client| {
        let stats = c.stats();
        let instance = u64::from_str_radix(&stats["kura_instance_id"], 16).unwrap();
        let path = std::path::PathBuf::from(&stats["kura_changes_file"]);
        (ChangeView::open(&path, instance).unwrap(), path)
    };
    let mut c = kura.client();
    let (view, path) = view_of(&mut c);
    let tags = |from: u64, to: u64| {
        let mut seen = Vec::new();
        view.changes_between(from, to, |tag| seen.push(tag)).then_some(seen)
    };
    let start = view.counter().unwrap();
    c.set("a", b"1");
    c.set("b", b"2");
    assert_eq!(c.get("a").as_deref(), Some(&b"1"[..]));
    c.expect("delete a\r\n", "DELETED\r\n");
    c.expect("delete a\r\n", "NOT_FOUND\r\n");
    c.expect("incr n 1\r\n", "NOT_FOUND\r\n");
    c.expect("ms b 1 MA\r\n3\r\n", "HD\r\n");
    c.expect("touch b 100\r\n", "TOUCHED\r\n");
    let now = view.counter().unwrap();
    assert_eq!(tags(start, now), Some(vec![change_tag(b"a"), change_tag(b"b"), change_tag(b"a"), change_tag(b"b"), change_tag(b"b")]));
    c.expect("flush_all\r\n", "OK\r\n");
    let flushed = view.counter().unwrap();
    assert_eq!(flushed, now + 1);
    assert_eq!(tags(now, flushed), None, "a flush changes everything");
    c.set("c", b"3");
    assert_eq!(tags(flushed, flushed + 1), Some(vec![change_tag(b"c")]));
    drop(c);
    kura.kill();
    kura.restart();
    assert_eq!(view.counter(), None, "the killed server's view is done");
    let (next, next_path) = view_of(&mut kura.client());
    assert_eq!(next_path, path, "the same file");
    let restarted = next.counter().unwrap();
    assert!(restarted > flushed + 1);
    assert!(!next.changes_between(flushed + 1, restarted, |_| {}), "a restart changes everything");
}
