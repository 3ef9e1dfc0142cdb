//! memcached's switches that change what clients see, each compared with a real memcached
//! started with the same switch: ASCII authentication (`-Y`), CAS off (`-C`), per-prefix
//! statistics (`-D`, `stats detail`), `stats reset`, the slab classes `-f` and `-n` name, and
//! the rest of memcached's command line (`-R -B -k -r -L`), with memcached's refusals.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{Client, Kura, Memcached, SERVER_BIN, SMALL, transcript};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}


fn auth_file(dir: &Path) -> String {
    let path = dir.join("users");
    std::fs::write(&path, "alice:secret\nbob:pw:with:colons\r\n").unwrap();
    path.to_str().unwrap().to_owned()
}

/// A fresh connection per script: what memcached -Y answered (1.6.18), kura answers.
#[test]
fn ascii_authentication_answers_as_memcached() {
    let tmp = tempfile::tempdir().unwrap();
    let users = auth_file(tmp.path());
    let kura = Kura::start(&["-Y", &users]);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&["-Y", &users]));
    // One request before authentication per script: memcached answers only the last of
    // several that arrive together (it reuses one reply), kura each.
    let scripts: &[&[u8]] = &[
        // Anything but a set: refused; the connection stays, unauthenticated.
        b"get a\r\n",
        b"mg a v\r\n",
        b"version\r\n",
        b"set x 0 0\r\n",
        b"set x 0 0 abc\r\n",
        // A failure, a bad format, bad termination: the same.
        b"set x 0 0 10\r\nalice nope\r\n",
        b"set x 0 0 5\r\nalice\r\n",
        b"set x 0 0 5\r\nalicexx",
        b"set x 0 0 10\r\nbob secret\r\n",
        // In: STORED (even with noreply), then the connection is a normal one.
        b"set k 7 0 12\r\nalice secret\r\nset k 0 0 1\r\nv\r\nget k\r\nmg k v\r\n",
        b"set x 0 0 13 noreply\r\nalice secret \r\nget k\r\n",
        b" set  x 0 0 26\nbob  pw:with:colons  extra\r\nget k\r\n",
    ];
    for script in scripts {
        let (ours, theirs) = (transcript(kura.port, script), transcript(memcached.port, script));
        assert_eq!(text(&ours), text(&theirs), "{}", text(script));
    }
    // Refusals and failures, then success, on one connection, each reply awaited.
    for port in [kura.port, memcached.port] {
        let mut c = Client::connect(port);
        c.expect("get k\r\n", "CLIENT_ERROR unauthenticated\r\n");
        c.expect("set x 0 0 10\r\nalice nope\r\n", "CLIENT_ERROR authentication failure\r\n");
        c.expect("ms k 1\r\n", "CLIENT_ERROR unauthenticated\r\n");
        c.expect("set x 0 0 12\r\nalice secret\r\n", "STORED\r\n");
        c.expect("get k\r\n", "VALUE k 0 1\r\nv\r\nEND\r\n");
    }
    // The counters and settings memcached keeps.
    let mut ours = kura.client();
    ours.expect("set x 0 0 12\r\nalice secret\r\n", "STORED\r\n");
    let mut theirs = Client::connect(memcached.port);
    theirs.expect("set x 0 0 12\r\nalice secret\r\n", "STORED\r\n");
    let (stats, their_stats) = (ours.stats(), theirs.stats());
    for name in ["auth_cmds", "auth_errors"] {
        assert_eq!(stats[name], their_stats[name], "stats {name}");
    }
    assert_eq!(stats["auth_errors"], "3", "{stats:?}");
    let (ours_settings, theirs_settings) = (ours.settings(), theirs.settings());
    for name in ["auth_enabled_ascii", "auth_enabled_sasl"] {
        assert_eq!(ours_settings.get(name), theirs_settings.get(name), "stats settings {name}");
    }
    assert_eq!(ours_settings["auth_enabled_ascii"], users);
    // Data too long to be credentials: a failure, the data discarded.
    let mut c = kura.client();
    c.expect(format!("set x 0 0 5000\r\n{}\r\n", "a ".repeat(2500)), "CLIENT_ERROR authentication failure\r\n");
    c.expect("set x 0 0 12\r\nalice secret\r\n", "STORED\r\n");
}

/// What memcached refuses at startup about -Y, kura refuses.
#[test]
fn bad_auth_files_are_refused_at_startup() {
    let tmp = tempfile::tempdir().unwrap();
    let malformed = tmp.path().join("malformed");
    std::fs::write(&malformed, "alice:secret\nnocolon\n").unwrap();
    for (file, reason) in [
        (tmp.path().join("missing"), "could not open the auth file"),
        (malformed, "line 2 is not user:password"),
    ] {
        let out = Command::new(SERVER_BIN)
            .args(SMALL)
            .arg("--path")
            .arg(tmp.path().join("store.kura"))
            .arg("-Y")
            .arg(&file)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{file:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(reason), "{file:?}: {stderr}");
        assert!(!stderr.contains("secret"), "never the passwords: {stderr}");
    }
}

/// -C: every CAS value 0, no `cas` stores, `E` refused, metadump's `cas=0` and a size without
/// the CAS field; as memcached -C.
#[test]
fn cas_off_answers_as_memcached() {
    let kura = Kura::start(&["-C"]);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&["-C"]));
    let script = b"set a 0 0 1\r\nx\r\ngets a\r\ncas a 0 0 1 1\r\ny\r\ncas a 0 0 1 0\r\ny\r\ncas nx 0 0 1 1\r\ny\r\n\
mg a c v\r\nms a 1 C1\r\nq\r\nms a 1 c\r\nq\r\nms a 1 E55 c\r\nz\r\nmg a c v\r\nmg a E5 c\r\nmd a E5\r\n\
set n 0 0 1\r\n5\r\nma n c v\r\nma n C1\r\nma n E5\r\nmd n C1\r\nmd n C0\r\nmg n v\r\nms a 1 I\r\nw\r\nmg a c v\r\n\
gets a\r\nappend a 0 0 1\r\nz\r\ngets a\r\nmn\r\n";
    let (ours, theirs) = (transcript(kura.port, script), transcript(memcached.port, script));
    assert_eq!(text(&ours), text(&theirs));
    assert!(text(&ours).contains("VALUE a 0 1 0\r\n"), "{}", text(&ours));
    let dump = |port| {
        let mut c = Client::connect(port);
        let out = c.until_end("lru_crawler metadump all\r\n");
        // Last access and whether fetched: kura's flash keeps neither (see the README).
        out.lines().map(|l| l.split(' ').filter(|f| !f.starts_with("la=") && !f.starts_with("fetch=")).collect::<Vec<_>>().join(" ")).collect::<Vec<_>>()
    };
    assert_eq!(dump(kura.port), dump(memcached.port), "metadump (la= and fetch= aside)");
    let (mut ours, mut theirs) = (kura.client(), Client::connect(memcached.port));
    assert_eq!(ours.settings()["cas_enabled"], "no");
    assert_eq!(theirs.settings()["cas_enabled"], "no");
    assert_eq!(ours.stats()["cas_badval"], theirs.stats()["cas_badval"]);
}

/// `stats detail` counts by key prefix as memcached's: classic gets, sets and deletes, not
/// meta commands, arithmetic or touch; `off` keeps the counts, `stats reset` forgets them
/// (with the other counters). -D picks the delimiter and turns it on.
#[test]
fn per_prefix_stats_and_reset_as_memcached() {
    let script = b"stats detail dump\r\nstats detail on\r\nset a:1 0 0 1\r\nx\r\nget a:1 a:2 b:1 nodelim\r\ngets a:1\r\n\
delete a:1\r\ndelete a:9\r\nset nodelim 0 0 1\r\nx\r\nmg b:1 v\r\nms b:2 1\r\nx\r\nmd b:2\r\nincr a:5 1\r\ntouch a:5 1\r\n\
gat 0 a:7\r\nappend a:8 0 0 1\r\nx\r\nset :x 0 0 1\r\ny\r\nget :x :\r\nset a::b 0 0 1\r\nx\r\nstats detail\r\n\
stats detail off\r\nset a:2 0 0 1\r\nx\r\nstats detail dump\r\nstats detail on extra\r\n";
    let kura = Kura::start(&[]);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&[]));
    // memcached lists prefixes in its hash table's order, kura sorted: compared as sets.
    let lines = |out: Vec<u8>| text(&out).lines().map(str::to_owned).collect::<BTreeSet<_>>();
    let ours = lines(transcript(kura.port, script));
    assert_eq!(ours, lines(transcript(memcached.port, script)));
    assert!(ours.contains("PREFIX a get 4 hit 2 set 3 del 2"), "{ours:?}");
    for port in [kura.port, memcached.port] {
        let mut c = Client::connect(port);
        assert!(c.stat("cmd_get") > 0 && c.stat("total_connections") > 0);
        c.expect("stats reset\r\n", "RESET\r\n");
        assert_eq!((c.stat("cmd_get"), c.stat("get_hits"), c.stat("cmd_set"), c.stat("total_connections")), (0, 0, 0, 0), "port {port}");
        assert_eq!(c.stat("curr_items"), 4, "what is stored stays");
        assert_eq!(c.until_end("stats detail dump\r\n"), "END\r\n", "port {port}");
    }

    let kura = Kura::start(&["-D", "/"]);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&["-D", "/"]));
    let script = b"set a/1 0 0 1\r\nx\r\nget a/1 a:1 b/\r\ndelete a/1\r\nstats detail dump\r\n";
    assert_eq!(lines(transcript(kura.port, script)), lines(transcript(memcached.port, script)));
    let (ours, theirs) = (kura.client().settings(), Client::connect(memcached.port).settings());
    for name in ["stat_key_prefix", "detail_enabled"] {
        assert_eq!(ours.get(name), theirs.get(name), "stats settings {name}");
    }
}

/// -f and -n number the classes of metadump and `me` as memcached's; -R -B -k -r -L are taken
/// (stats settings as memcached's); what memcached refuses, kura refuses.
#[test]
fn slab_options_and_the_rest_of_memcacheds_command_line() {
    let switches = ["-f", "2", "-n", "16", "-R", "7", "-B", "ascii", "-r", "-L"];
    let kura = Kura::start(&switches);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&switches));
    let big = "y".repeat(5000);
    let script = format!("set big 3 0 5000\r\n{big}\r\nset tiny 0 0 1\r\nx\r\nset mid 0 0 100\r\n{}\r\nme big\r\nme tiny\r\nme mid\r\nmn\r\n", "z".repeat(100));
    // The CAS values differ (memcached counts sets, kura numbers its engine's writes), and
    // the seconds since the last access may.
    let no_la = |out: Vec<u8>| text(&out).split(' ').filter(|f| !f.starts_with("la=") && !f.starts_with("cas=")).collect::<Vec<_>>().join(" ");
    let ours = no_la(transcript(kura.port, script.as_bytes()));
    assert_eq!(ours, no_la(transcript(memcached.port, script.as_bytes())));
    assert!(ours.contains("cls=8 size=5066"), "{ours}");
    let (ours, theirs) = (kura.client().settings(), Client::connect(memcached.port).settings());
    for name in ["growth_factor", "chunk_size", "reqs_per_event", "binding_protocol"] {
        assert_eq!(ours.get(name), theirs.get(name), "stats settings {name}");
    }

    let tmp = tempfile::tempdir().unwrap();
    for (args, reason) in [
        (&["-S"][..], "-S: SASL authentication needs memcached's binary protocol"),
        (&["-e", "/dev/shm/x"], "it has no memory file"),
        (&["-Z"], "TLS needs a certificate"),
        (&["-B", "binary"], "not the binary one"),
        (&["-B", "udp"], "invalid value for binding protocol"),
        (&["-R", "0"], "requests per event must be greater than 0"),
        (&["-f", "1"], "factor must be greater than 1"),
        (&["-f", "NaN"], "factor must be greater than 1"),
        (&["-n", "0"], "chunk size must be greater than 0"),
        (&["-D", ""], "no delimiter specified"),
        (&["-D", "::"], "one character"),
    ] {
        let out = Command::new(SERVER_BIN).args(SMALL).arg("--path").arg(tmp.path().join("store.kura")).args(args).stdin(Stdio::null()).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(text(&out.stderr).contains(reason), "{args:?}: {}", text(&out.stderr));
    }
    let out = Command::new(SERVER_BIN).arg("-V").output().unwrap();
    assert!(out.status.success() && text(&out.stdout).starts_with("kura-server "), "{out:?}");
    // -i: the licence, and nothing started (memcached prints its own and exits 0 too).
    let out = Command::new(SERVER_BIN).arg("-i").arg("--path").arg(tmp.path().join("never.kura")).output().unwrap();
    assert!(out.status.success() && text(&out.stdout).contains("MIT License") && text(&out.stdout).contains("Apache License"), "{out:?}");
    assert!(!tmp.path().join("never.kura").exists(), "-i opens no store");
    if let Ok(memcached) = kura_testkit::require_cmd("memcached") {
        assert!(Command::new(memcached).arg("-i").stdout(Stdio::null()).status().unwrap().success());
    }
}
