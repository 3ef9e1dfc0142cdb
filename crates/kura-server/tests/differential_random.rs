//! Random sequences of text and meta commands against kura and a stock
//! memcached 1.6, one command at a time: every reply must match, with CAS
//! values compared by their first-seen order on each server (so equal and
//! unequal stay visible) and TTLs rounded as in `differential.rs`.
//!
//! A failure names its seed; `KURA_DIFF_SEED=<n>` replays that one sequence,
//! `KURA_DIFF_SEQUENCES=<n>` runs more (from `KURA_DIFF_FIRST_SEED`, default 0), and `KURA_DIFF_ALL=1` goes on past
//! a divergence to the next sequence and reports every first divergence;
//! `KURA_DIFF_TRACE=1` prints every command with memcached's reply.
//! Skipped, with a reason, where memcached is not installed.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{Kura, Memcached};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

const SEQUENCES: u64 = 300;
const COMMANDS_PER_SEQUENCE: usize = 50;
/// A small key space, so commands collide on keys.
const KEYS: &[&str] = &["a", "b", "c", "d"];
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Sent after every command: its `MN` ends the command's reply, so quiet
/// (`noreply`, `q`) and chatty commands read alike. The generator never sends
/// `mn` itself, and no value or key holds an upper-case `MN` line.
const FENCE: &[u8] = b"mn\r\n";
/// Stands in a command for the CAS value each server fills in (see [`Cas`]).
const CAS_SLOT: &str = "<cas>";
/// A CAS value neither server reaches in a sequence of this length.
const CAS_WRONG: u64 = 987_654_321_987;

/// TTLs are 0, negative (expired at once) or multiples of 10 far from
/// expiring, so nothing expires while a sequence runs and a tick between a
/// store and its reply is absorbed by rounding.
const TTLS: &[&str] = &["0", "100", "1000", "-1"];
/// Client flags within 32 bits: memcached truncates wider ones, kura refuses them.
const CLIENT_FLAGS: &[&str] = &["0", "1", "42", "4294967295"];
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "9",
    "10",
    "99",
    "100",
    "18446744073709551613",
    "18446744073709551614",
    "18446744073709551615",
];
const ODD_VALUES: &[&str] = &["007", "1 ", "18446744073709551616", "-1", "12ab", "+5"];
const DELTAS: &[&str] = &[
    "0",
    "1",
    "2",
    "10",
    "18446744073709551614",
    "18446744073709551615",
    "18446744073709551616",
    "abc",
    "-1",
];
/// Malformed numbers for storage fields. No whitespace, and nothing above a
/// field's width: there kura is deliberately stricter (kura-proto's crate docs).
const BAD_NUMBERS: &[&str] = &["x", "1.5", "-1", "1x", "abc"];

/// The CAS value a command carries, filled in per server.
#[derive(Clone, Copy, Debug)]
enum Cas {
    /// The last CAS value this server reported for the key (or [`CAS_WRONG`]).
    Own,
    Wrong,
    Zero,
}

/// One generated command.
struct Command {
    text: String,
    /// The key whose CAS fills [`CAS_SLOT`], and how.
    cas: Option<(String, Cas)>,
    /// The single key a meta command names, to track the CAS values it reports.
    meta_key: Option<String>,
}

impl Command {
    fn plain(text: String) -> Self {
        Self {
            text,
            cas: None,
            meta_key: None,
        }
    }
}

struct Generator {
    rng: StdRng,
    prefix: String,
    /// Whether sequences send `flush_all` (see [`random_sequences_with_cas_off_answer_like_memcached`]).
    flush_all: bool,
}

impl Generator {
    fn key(&mut self) -> String {
        format!("{}{}", self.prefix, KEYS.choose(&mut self.rng).unwrap())
    }

    fn pick(&mut self, from: &[&str]) -> String {
        from.choose(&mut self.rng).unwrap().to_string()
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.random_bool(p)
    }

    fn word(&mut self, len_max: usize) -> String {
        let len = self.rng.random_range(0..=len_max);
        (0..len)
            .map(|_| char::from(b'a' + self.rng.random_range(0..26u8)))
            .collect()
    }

    fn value(&mut self) -> String {
        match self.rng.random_range(0..10) {
            0..=4 => self.word(6),
            5..=7 => self.pick(NUMBERS),
            _ => self.pick(ODD_VALUES),
        }
    }

    fn noreply(&mut self) -> &'static str {
        if self.chance(0.15) { " noreply" } else { "" }
    }

    fn cas(&mut self) -> Cas {
        match self.rng.random_range(0..10) {
            0..=6 => Cas::Own,
            7..=8 => Cas::Wrong,
            _ => Cas::Zero,
        }
    }

    fn command(&mut self) -> Command {
        match self.rng.random_range(0..100) {
            0..=14 => self.storage(),
            15..=20 => self.cas_command(),
            21..=32 => self.retrieval(),
            33..=37 => self.delete(),
            38..=45 => self.arithmetic(),
            46..=49 => self.touch(),
            50..=63 => self.meta_get(),
            64..=75 => self.meta_set(),
            76..=80 => self.meta_delete(),
            81..=88 => self.meta_arithmetic(),
            89 if self.flush_all => Command::plain(format!("flush_all{}\r\n", self.noreply())),
            _ => self.malformed(),
        }
    }

    fn storage(&mut self) -> Command {
        let command = self.pick(&["set", "add", "replace", "append", "prepend"]);
        let key = self.key();
        let (flags, ttl, value) = (self.pick(CLIENT_FLAGS), self.pick(TTLS), self.value());
        let noreply = self.noreply();
        Command::plain(format!(
            "{command} {key} {flags} {ttl} {}{noreply}\r\n{value}\r\n",
            value.len()
        ))
    }

    fn cas_command(&mut self) -> Command {
        let key = self.key();
        let (flags, ttl, value) = (self.pick(CLIENT_FLAGS), self.pick(TTLS), self.value());
        let noreply = self.noreply();
        let cas = self.cas();
        Command {
            text: format!(
                "cas {key} {flags} {ttl} {} {CAS_SLOT}{noreply}\r\n{value}\r\n",
                value.len()
            ),
            cas: Some((key, cas)),
            meta_key: None,
        }
    }

    fn keys(&mut self) -> String {
        let count = self.rng.random_range(1..=4);
        (0..count).map(|_| self.key()).collect::<Vec<_>>().join(" ")
    }

    fn retrieval(&mut self) -> Command {
        let keys = self.keys();
        Command::plain(match self.rng.random_range(0..4) {
            0 => format!("get {keys}\r\n"),
            1 => format!("gets {keys}\r\n"),
            2 => format!("gat {} {keys}\r\n", self.pick(TTLS)),
            _ => format!("gats {} {keys}\r\n", self.pick(TTLS)),
        })
    }

    fn delete(&mut self) -> Command {
        let key = self.key();
        let zero = if self.chance(0.2) { " 0" } else { "" };
        Command::plain(format!("delete {key}{zero}{}\r\n", self.noreply()))
    }

    fn arithmetic(&mut self) -> Command {
        let command = self.pick(&["incr", "decr"]);
        let key = self.key();
        let delta = self.pick(DELTAS);
        Command::plain(format!("{command} {key} {delta}{}\r\n", self.noreply()))
    }

    fn touch(&mut self) -> Command {
        let key = self.key();
        let ttl = self.pick(TTLS);
        Command::plain(format!("touch {key} {ttl}{}\r\n", self.noreply()))
    }

    /// A random subset of `flags`, in random order, each with its token.
    fn flags(&mut self, flags: &[&str], p: f64) -> Vec<String> {
        let mut chosen: Vec<String> = Vec::new();
        for flag in flags {
            if self.chance(p) {
                chosen.push(self.flag_token(flag));
            }
        }
        // memcached reports the TTL left after `T-1` as an unsigned
        // wrap-around (`t4294967240`): an upstream bug, so no `t` with it.
        if chosen.iter().any(|f| f == "T-1") {
            chosen.retain(|f| f != "t");
        }
        chosen.shuffle(&mut self.rng);
        chosen
    }

    fn flag_token(&mut self, flag: &str) -> String {
        match flag {
            "O" => format!("O{}", self.word(8)),
            "T" => format!("T{}", self.pick(TTLS)),
            "N" => format!("N{}", self.pick(&["30", "100"])),
            "R" => format!("R{}", self.pick(&["30", "500", "5000"])),
            "F" => format!("F{}", self.pick(CLIENT_FLAGS)),
            "C" => format!("C{CAS_SLOT}"),
            "J" => format!("J{}", self.pick(NUMBERS)),
            "D" => format!("D{}", self.pick(&DELTAS[..6])),
            "M" => format!("M{}", self.pick(&["E", "A", "P", "R", "S", "e", "a", "p"])),
            "MA" => format!("M{}", self.pick(&["I", "+", "D", "-", "i", "d"])),
            _ => flag.to_owned(),
        }
    }

    /// A meta command line on `key`: the key base64-encoded when `b` was chosen.
    fn meta(&mut self, command: &str, datalen: Option<usize>, flags: &[&str]) -> Command {
        let key = self.key();
        let mut chosen = self.flags(flags, 0.3);
        // memcached 1.6.18 applies an `ma` `T` to the old item when the
        // result is longer than the old number (and so goes to a new item):
        // the reply shows the new TTL, the item keeps the old one. An upstream
        // bug; a decrement never lengthens the number.
        if command == "ma" && chosen.iter().any(|f| f.starts_with('T')) {
            chosen.retain(|f| !f.starts_with('M'));
            chosen.push("MD".to_owned());
        }
        // memcached 1.6.18 returns an `mg` hit's key (`k`) base64-encoded, with
        // `b`, when the item was stored by an `ms` with `b`, whatever the `mg`
        // asked, and decoded otherwise, even to a `b` request; kura encodes it
        // when the request has `b` and keeps no such bit per item. So `b`
        // comes without `k`, and not on `ms`.
        let base64 = command != "ms" && self.chance(0.1);
        let key_token = if base64 {
            chosen.retain(|f| f != "k");
            chosen.push("b".to_owned());
            chosen.shuffle(&mut self.rng);
            let mut encoded = Vec::new();
            kura_proto::encode_base64(key.as_bytes(), &mut encoded);
            String::from_utf8(encoded).unwrap()
        } else {
            key.clone()
        };
        let datalen = datalen.map(|n| format!(" {n}")).unwrap_or_default();
        let flags: String = chosen.iter().map(|f| format!(" {f}")).collect();
        let cas = flags.contains(CAS_SLOT).then(|| (key.clone(), self.cas()));
        Command {
            text: format!("{command} {key_token}{datalen}{flags}\r\n"),
            cas,
            meta_key: Some(key),
        }
    }

    // Left out: `E` (a new CAS value) and `x` (md keeps the item), which
    // memcached 1.6.18 predates and answers with `CLIENT_ERROR invalid flag`,
    // and `N` on `ms` (vivify on append), which it ignores, while kura
    // implements all three as later memcached does; `l` (seconds since last
    // access), which depends on time; `h` (hit before), memcached's
    // LRU-internal fetched bit, set by paths such as a failed `add` and by
    // `incr`, which kura keeps only for items in its RAM cache.
    fn meta_get(&mut self) -> Command {
        self.meta(
            "mg",
            None,
            &["v", "k", "f", "t", "c", "s", "q", "O", "T", "N"],
        )
    }

    fn meta_set(&mut self) -> Command {
        let value = self.value();
        let flags = ["c", "k", "s", "q", "O", "T", "F", "I", "C", "M"];
        let mut command = self.meta("ms", Some(value.len()), &flags);
        command.text.push_str(&value);
        command.text.push_str("\r\n");
        command
    }

    fn meta_delete(&mut self) -> Command {
        self.meta("md", None, &["q", "k", "O", "T", "I", "C"])
    }

    fn meta_arithmetic(&mut self) -> Command {
        let flags = ["N", "J", "D", "T", "MA", "q", "O", "t", "c", "v", "k", "C"];
        self.meta("ma", None, &flags)
    }

    fn malformed(&mut self) -> Command {
        let key = self.key();
        let long_key = format!("{key}{}", "x".repeat(251));
        let bad = self.pick(BAD_NUMBERS);
        let value = self.word(4);
        Command::plain(match self.rng.random_range(0..16) {
            0 => format!("set {key} {bad} 0 1\r\nz\r\n"),
            1 => format!("set {key} 0 {bad} 1\r\nz\r\n"),
            2 => format!("add {key} 0 0 {bad}\r\nz\r\n"),
            3 => format!("set {long_key} 0 0 1\r\nz\r\n"),
            4 => format!(
                "{} {long_key}\r\n",
                self.pick(&["get", "gets", "delete", "mg", "md", "ma"])
            ),
            // Data longer than declared: the rest of the block is read as a
            // command. (Shorter data would swallow the fence.)
            5 => format!("set {key} 0 0 {}\r\n{value}zz\r\n", value.len()),
            6 => format!("ms {key} {} T0\r\n{value}zz\r\n", value.len()),
            7 => format!(
                "{} {key}\r\n",
                self.pick(&["bogus", "GET", "sets", "mz", "incr", "touch"])
            ),
            8 => format!("mg {key} v v\r\n"),
            9 => format!(
                "mg {key} {}\r\n",
                self.pick(&["!", "Z", "Txx", "Nabc", "Rx"])
            ),
            10 => format!("ms {key} {bad}\r\nz\r\n"),
            11 => format!("ma {key} D{bad}\r\n"),
            12 => format!("md {key} C{bad}\r\n"),
            13 => format!(
                "{}\r\n",
                self.pick(&["get", "mg", "ms", "md", "ma", "gat 10", "touch"])
            ),
            14 => format!("delete {key} {}\r\n", self.pick(&["5", "x", "0 0"])),
            _ => format!("touch {key} {bad}\r\n"),
        })
    }
}

/// One server's connection and what the sequence has seen from it.
struct Side {
    name: &'static str,
    port: u16,
    reader: BufReader<TcpStream>,
    /// The last CAS value this server reported per key.
    cas_of: HashMap<String, u64>,
    /// This server's CAS values, numbered in the order first seen.
    cas_ordinal: HashMap<u64, usize>,
}

impl Side {
    fn connect(name: &'static str, port: u16) -> Self {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
        stream.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            name,
            port,
            reader: BufReader::new(stream),
            cas_of: HashMap::new(),
            cas_ordinal: HashMap::new(),
        }
    }

    /// Sends `command` with this server's CAS filled in and returns its reply,
    /// read up to the fence; `<closed>` ends it if the server closed.
    fn exchange(&mut self, command: &Command) -> Result<String, String> {
        let cas = match &command.cas {
            Some((key, Cas::Own)) => self.cas_of.get(key).copied().unwrap_or(CAS_WRONG),
            Some((_, Cas::Wrong)) => CAS_WRONG,
            Some((_, Cas::Zero)) | None => 0,
        };
        let mut bytes = command
            .text
            .replace(CAS_SLOT, &cas.to_string())
            .into_bytes();
        bytes.extend_from_slice(FENCE);
        self.reader
            .get_mut()
            .write_all(&bytes)
            .map_err(|e| format!("{}: send: {e}", self.name))?;
        let mut reply = Vec::new();
        loop {
            let mut line = Vec::new();
            match self.reader.read_until(b'\n', &mut line) {
                Ok(0) => {
                    reply.extend_from_slice(b"<closed>");
                    *self = Self::connect(self.name, self.port);
                    break;
                }
                Ok(_) if line == b"MN\r\n" => break,
                Ok(_) => reply.extend_from_slice(&line),
                Err(e) => {
                    return Err(format!(
                        "{}: no complete reply in {REPLY_TIMEOUT:?} ({e}); so far {:?}",
                        self.name,
                        String::from_utf8_lossy(&reply)
                    ));
                }
            }
        }
        let reply = String::from_utf8_lossy(&reply).into_owned();
        self.track_cas(command, &reply);
        Ok(self.normalise(&reply))
    }

    fn track_cas(&mut self, command: &Command, reply: &str) {
        for line in reply.lines() {
            let tokens: Vec<&str> = line.split(' ').collect();
            match (tokens.as_slice(), &command.meta_key) {
                (["VALUE", key, _, _, cas], _) => {
                    if let Ok(cas) = cas.parse() {
                        self.cas_of.insert(key.to_string(), cas);
                    }
                }
                ([status, rest @ ..], Some(key)) if is_meta_status(status) => {
                    if let Some(cas) = rest.iter().find_map(|t| numeric_flag(t, 'c')) {
                        self.cas_of.insert(key.clone(), cas);
                    }
                }
                _ => {}
            }
        }
    }

    /// CAS values become `#<ordinal>`; TTLs (`t<N>`) round up to a multiple of 10.
    fn normalise(&mut self, reply: &str) -> String {
        let mut out = String::new();
        for line in reply.split_inclusive("\r\n") {
            let body = line.strip_suffix("\r\n").unwrap_or(line);
            let tokens: Vec<&str> = body.split(' ').collect();
            let masked: Vec<String> = match tokens.as_slice() {
                ["VALUE", key, flags, len, cas] => match cas.parse() {
                    Ok(cas) => vec![
                        format!("VALUE {key} {flags} {len}"),
                        format!("#{}", self.ordinal(cas)),
                    ],
                    Err(_) => vec![body.to_owned()],
                },
                [status, ..] if is_meta_status(status) => tokens
                    .iter()
                    .map(|t| {
                        if let Some(cas) = numeric_flag(t, 'c') {
                            format!("c#{}", self.ordinal(cas))
                        } else if let Some(ttl) = numeric_flag(t, 't').filter(|&n| n > 1) {
                            format!("t{}", ttl.div_ceil(10) * 10)
                        } else {
                            t.to_string()
                        }
                    })
                    .collect(),
                _ => vec![body.to_owned()],
            };
            out.push_str(&masked.join(" "));
            out.push_str(&line[body.len()..]);
        }
        out
    }

    fn ordinal(&mut self, cas: u64) -> usize {
        let next = self.cas_ordinal.len();
        *self.cas_ordinal.entry(cas).or_insert(next)
    }
}

fn is_meta_status(token: &str) -> bool {
    matches!(token, "VA" | "HD" | "EN" | "NF" | "NS" | "EX")
}

/// The number after `flag` in a return-flag token such as `c42`.
fn numeric_flag(token: &str, flag: char) -> Option<u64> {
    token
        .strip_prefix(flag)
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse().ok())
}

/// Runs sequence `seed` on both servers; the first difference is the error.
fn run_sequence(seed: u64, kura_port: u16, memcached_port: u16, flush_all: bool) -> Result<(), String> {
    let mut generator = Generator {
        rng: StdRng::seed_from_u64(seed),
        prefix: format!("s{seed}_"),
        flush_all,
    };
    let mut ours = Side::connect("kura", kura_port);
    let mut theirs = Side::connect("memcached", memcached_port);
    let mut history: Vec<String> = Vec::new();
    let trace = std::env::var_os("KURA_DIFF_TRACE").is_some();
    for index in 0..COMMANDS_PER_SEQUENCE {
        let command = generator.command();
        history.push(format!("{index}: {:?}", command.text));
        let context = || {
            let start = history.len().saturating_sub(12);
            format!(
                "seed {seed}, command {index}: {:?}\nlast commands:\n  {}",
                command.text,
                history[start..].join("\n  ")
            )
        };
        let theirs_reply = theirs
            .exchange(&command)
            .map_err(|e| format!("{}\n{e}", context()))?;
        let ours_reply = ours
            .exchange(&command)
            .map_err(|e| format!("{}\n{e}", context()))?;
        if trace {
            eprintln!("{index}: {:?}\n  -> {theirs_reply:?}", command.text);
        }
        if ours_reply != theirs_reply {
            return Err(format!(
                "{}\nkura:      {ours_reply:?}\nmemcached: {theirs_reply:?}",
                context()
            ));
        }
    }
    Ok(())
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn random_sequences_answer_like_memcached() {
    run_sequences(&[], SEQUENCES, true);
}

/// The same with CAS off on both (`-C`): every CAS value 0, `cas` never storing, `E` refused.
/// Without `flush_all`: memcached -C's flushes every item stored up to the end of the second
/// it ran in, so an item stored right after it is gone too (it tells items before the flush
/// from those after by their CAS values, which -C drops); kura's keeps what is stored after
/// it, as with CAS on.
#[test]
fn random_sequences_with_cas_off_answer_like_memcached() {
    run_sequences(&["-C"], SEQUENCES_CAS_OFF, false);
}

/// Sequences with CAS off (fewer: most commands run as with CAS on).
const SEQUENCES_CAS_OFF: u64 = 100;

/// Both servers started with `flags` too.
fn run_sequences(flags: &[&str], sequences: u64, flush_all: bool) {
    // Without the LRU crawler and maintainer nothing else holds a reference to
    // an item, so memcached's `incr`/`decr` always rewrites a number that still
    // fits in place (space-padded, as kura does) instead of sometimes making a
    // new item.
    let mut memcached_flags = vec!["-o", "no_lru_crawler,no_lru_maintainer"];
    memcached_flags.extend_from_slice(flags);
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&memcached_flags));
    let kura = Kura::start(flags);
    let seeds: Vec<u64> = match env_u64("KURA_DIFF_SEED") {
        Some(seed) => vec![seed],
        None => {
            let first = env_u64("KURA_DIFF_FIRST_SEED").unwrap_or(0);
            (first..first + env_u64("KURA_DIFF_SEQUENCES").unwrap_or(sequences)).collect()
        }
    };
    let report_all = std::env::var_os("KURA_DIFF_ALL").is_some();
    let mut failures = Vec::new();
    for seed in seeds {
        if let Err(failure) = run_sequence(seed, kura.port, memcached.port, flush_all) {
            if !report_all {
                panic!("kura differs from memcached:\n{failure}");
            }
            failures.push(failure);
        }
    }
    assert!(
        failures.is_empty(),
        "{} sequences differ from memcached:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
