//! Randomized crash consistency: rounds of a concurrent random workload on the real server,
//! each ended by SIGKILL at a random moment, on one store file per mode that lives through
//! every round. After each restart every key must hold a value it may legally have:
//!
//! * with `--sync always`, what the last acknowledged write left, or what a write in flight
//!   at the kill (sent, not acknowledged) would have left;
//! * with `--sync never` or an interval, what the last write acknowledged before the last
//!   acknowledged `sync` barrier left, or what any later write left;
//!
//! never a torn or mixed value, wrong flags, an expired item, or a deleted key back.
//!
//! Each client thread owns some keys and runs every write command on them (set add replace
//! append prepend cas delete incr decr touch, ms md ma), one request at a time or a pipelined
//! batch, so the model knows each owned key's value exactly and checks every reply against
//! it (in a batch cut by the kill, any of the unacknowledged writes may have applied). All threads also
//! race on a few shared keys with set/ms/delete/md: a value there is legal unless a durable
//! write started after its own write was acknowledged. Values run from empty to 300 KiB
//! (`-I 512k`), in 2 MiB blocks so that buffers fill and seal, and, in store mode, the
//! collector runs; the cache-mode store is large enough that nothing is evicted, which the
//! test checks in `stats` just before each kill (an eviction would make misses legal).
//!
//! A failure names the mode, seed and round. `KURA_CRASH_SEED=<n>` sets the first seed,
//! `KURA_CRASH_SEEDS=<n>` runs that many seeds (each on a fresh store), and
//! `KURA_CRASH_ROUNDS=<n>` sets the rounds per seed and mode.

mod common;

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Kura;
use kura_server::store::parse_counter;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROUNDS_DEFAULT: u64 = 30;
const SEED_DEFAULT: u64 = 0x6b75_7261;
const THREADS_MIN: usize = 2;
const THREADS_MAX: usize = 4;
const OWNED_KEYS: usize = 16;
const SHARED_KEYS: usize = 3;
/// The largest value a set writes; appends stop growing a value past `VALUE_GROWN_MAX_BYTES`,
/// under the item limit, so no write is refused for its size.
const VALUE_SIZE_MAX_BYTES: usize = 300 << 10;
const VALUE_GROWN_MAX_BYTES: usize = 400 << 10;
const ITEM_SIZE_MAX: &str = "512k";
/// Small blocks (the smallest that hold four of the largest item), so rounds seal many.
const BLOCK_SIZE: &str = "2M";
/// Store mode: a few times the live data, so the collector runs. Cache mode: more than the
/// rounds write, so nothing is evicted.
const STORE_SIZE_STORE_MODE: &str = "48M";
const STORE_SIZE_CACHE_MODE: &str = "1G";
/// Shared keys keep small values: every version stays in the model until the kill.
const SHARED_VALUE_SIZE_MAX_BYTES: usize = 4 << 10;
/// How long a round's workload runs before the kill (some rounds die early, during or just
/// after recovery).
const KILL_AFTER_MS_MAX: u64 = 700;
const EARLY_KILL_AFTER_MS_MAX: u64 = 30;
/// Some restarts are first killed while the server opens the store.
const RECOVERY_KILL_PROBABILITY: f64 = 0.15;
const RECOVERY_KILL_AFTER_MS_MAX: u64 = 40;
/// A thread that outlives this was not stopped by the kill: a bug in the test.
const THREAD_DEADLINE: Duration = Duration::from_secs(60);
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);
const NON_NUMERIC: &[u8] = b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n";

#[derive(Clone, Debug, PartialEq, Eq)]
struct Item {
    data: Vec<u8>,
    flags: u32,
}

/// A key's state: its item, or absent.
type State = Option<Arc<Item>>;

/// A write of one key: the state it left, when it was sent and when it was acknowledged
/// (`None`: in flight at the kill), and the request that did it (unique in its thread).
#[derive(Clone)]
struct Written {
    state: State,
    start: Instant,
    end: Option<Instant>,
    op: u64,
}

impl Written {
    /// The state a round starts from (read after the restart, so durable).
    fn initial(state: &State, round_start: Instant) -> Self {
        Self {
            state: state.clone(),
            start: round_start,
            end: Some(round_start),
            op: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sync {
    Always,
    Never,
    Interval,
}

impl Sync {
    fn arg(self) -> &'static str {
        match self {
            Self::Always => "always",
            Self::Never => "never",
            Self::Interval => "40ms",
        }
    }
}

fn owned_key(i: usize) -> String {
    format!("k{i}")
}

fn shared_key(i: usize) -> String {
    format!("s{i}")
}

fn all_keys() -> Vec<String> {
    (0..OWNED_KEYS)
        .map(owned_key)
        .chain((0..SHARED_KEYS).map(shared_key))
        .collect()
}

fn show(state: &State) -> String {
    match state {
        None => "<absent>".to_owned(),
        Some(item) => {
            let d = &item.data;
            let head = String::from_utf8_lossy(&d[..d.len().min(24)]);
            let tail =
                String::from_utf8_lossy(&d[d.len().saturating_sub(12).max(24.min(d.len()))..]);
            format!("[{} B, flags {}: {head:?}..{tail:?}]", d.len(), item.flags)
        }
    }
}

/// Appends a request: its line, and its data block if it has one.
fn frame(out: &mut Vec<u8>, line: &str, data: Option<&[u8]>) {
    out.extend_from_slice(line.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(data) = data {
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }
}

/// One connection; any I/O error or EOF ends the thread (the kill).
struct Conn {
    reader: BufReader<TcpStream>,
    stream: TcpStream,
    sent_bytes: u64,
}

impl Conn {
    fn connect(port: u16) -> io::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            reader: BufReader::new(stream.try_clone()?),
            stream,
            sent_bytes: 0,
        })
    }

    fn send(&mut self, line: &str, data: Option<&[u8]>) -> io::Result<()> {
        let mut request = Vec::new();
        frame(&mut request, line, data);
        self.send_bytes(&request)
    }

    fn send_bytes(&mut self, request: &[u8]) -> io::Result<()> {
        self.sent_bytes += request.len() as u64;
        self.stream.write_all(request)
    }

    /// One whole reply line, `\r\n` included.
    fn line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if !line.ends_with(b"\r\n") {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "cut reply"));
        }
        Ok(line)
    }

    /// The next reply to a request that is not a retrieval (both lines of an `ma … v` hit).
    fn reply(&mut self) -> io::Result<Vec<u8>> {
        let mut reply = self.line()?;
        if reply.starts_with(b"VA ") {
            reply.extend(self.line()?);
        }
        Ok(reply)
    }

    fn request(&mut self, line: &str, data: Option<&[u8]>) -> io::Result<Vec<u8>> {
        self.send(line, data)?;
        self.reply()
    }

    /// `gets` of one key: its state and CAS value.
    fn gets(&mut self, key: &str) -> io::Result<(State, u64)> {
        self.send(&format!("gets {key}"), None)?;
        let line = self.line()?;
        if line == b"END\r\n" {
            return Ok((None, 0));
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        let parts: Vec<&str> = text.trim_end().split(' ').collect();
        let bad = || io::Error::other(format!("bad gets reply {text:?}"));
        if parts.len() != 5 || parts[0] != "VALUE" || parts[1] != key {
            return Err(bad());
        }
        let flags: u32 = parts[2].parse().map_err(|_| bad())?;
        let len: usize = parts[3].parse().map_err(|_| bad())?;
        let cas: u64 = parts[4].parse().map_err(|_| bad())?;
        let mut data = vec![0; len + 2];
        self.reader.read_exact(&mut data)?;
        if !data.ends_with(b"\r\n") || self.line()? != b"END\r\n" {
            return Err(bad());
        }
        data.truncate(len);
        Ok((Some(Arc::new(Item { data, flags })), cas))
    }
}

/// What a client thread knows and what it did.
struct Client {
    id: usize,
    round: u64,
    rng: StdRng,
    conn: Conn,
    sync: Sync,
    /// Per key, the writes that may still decide its value (older ones are pruned).
    writes: HashMap<String, Vec<Written>>,
    owned: Vec<String>,
    /// Send times of acknowledged `sync` barriers.
    barriers: Vec<Instant>,
    failures: Vec<String>,
    ops: u64,
    acked: u64,
    deadline: Instant,
}

/// The outcome of a request on an owned key: the state it leaves when it applies, and the
/// reply that says it did (or the reply alone, for a request that changes nothing).
struct Expect {
    state: Option<State>,
    reply: Vec<u8>,
}

impl Expect {
    fn write(state: State, reply: &[u8]) -> Self {
        Self {
            state: Some(state),
            reply: reply.to_vec(),
        }
    }

    fn nothing(reply: &[u8]) -> Self {
        Self {
            state: None,
            reply: reply.to_vec(),
        }
    }
}

/// A request planned against the model, with the write it makes (`op`) if it makes one.
struct Planned {
    key: String,
    op: u64,
    line: String,
    data: Option<Vec<u8>>,
    expect: Expect,
}

fn item(data: Vec<u8>, flags: u32) -> State {
    Some(Arc::new(Item { data, flags }))
}

/// The counter an incr/decr leaves, as memcached's `do_add_delta` (rewritten in place with
/// space padding when the number fits), or `None` for a value that is not a number.
fn arith(old: &[u8], incr: bool, delta: u64) -> Option<(u64, Vec<u8>)> {
    if old.is_empty() {
        return None;
    }
    let current = parse_counter(old)?;
    let value = if incr {
        current.wrapping_add(delta)
    } else {
        current.saturating_sub(delta)
    };
    let mut digits = value.to_string().into_bytes();
    if digits.len() <= old.len() {
        digits.resize(old.len(), b' ');
    }
    Some((value, digits))
}

impl Client {
    fn current(&self, key: &str) -> State {
        self.writes[key]
            .last()
            .expect("an owned key starts with its initial state")
            .state
            .clone()
    }

    /// A fresh value: a tag naming the write, then filler; sometimes a number (for incr).
    fn value(&mut self, size_max: usize) -> Vec<u8> {
        let tag = format!("r{}t{}o{}:", self.round, self.id, self.ops);
        match self.rng.random_range(0..100) {
            0..10 => return self.rng.random_range(0..1000u64).to_string().into_bytes(),
            10..12 => {
                return (u64::MAX - self.rng.random_range(0..3))
                    .to_string()
                    .into_bytes();
            }
            12..14 => return Vec::new(),
            _ => {}
        }
        let len = match self.rng.random_range(0..100) {
            0..60 => self.rng.random_range(1..100),
            60..85 => self.rng.random_range(100..8 << 10),
            85..94 => self.rng.random_range(8 << 10..64 << 10),
            _ => self.rng.random_range(64 << 10..=VALUE_SIZE_MAX_BYTES),
        }
        .min(size_max);
        let fill = b'a' + (self.ops % 26) as u8;
        let mut data: Vec<u8> = tag.into_bytes();
        data.resize(len.max(data.len()), fill);
        data.truncate(len);
        data
    }

    /// Notes a write about to be sent (as request `self.ops`).
    fn record(&mut self, key: &str, state: State, start: Instant) {
        let op = self.ops;
        let history = self.writes.get_mut(key).expect("known key");
        history.push(Written {
            state,
            start,
            end: None,
            op,
        });
    }

    /// Notes the reply to write `op`.
    fn ack(&mut self, key: &str, op: u64, end: Instant) {
        let always = self.sync == Sync::Always;
        let owned = self.owned.iter().any(|k| k == key);
        let history = self.writes.get_mut(key).expect("known key");
        let at = history.iter().rposition(|w| w.op == op).expect("recorded");
        history[at].end = Some(end);
        if always && owned {
            // Every acknowledged write is durable: what came before cannot come back.
            history.drain(..at);
        }
    }

    /// Drops, for owned keys, the writes a barrier made durable a newer state for.
    fn prune_owned(&mut self, barrier: Instant) {
        for key in &self.owned {
            let history = self.writes.get_mut(key).expect("owned key");
            if let Some(last_durable) = history
                .iter()
                .rposition(|w| w.end.is_some_and(|end| end < barrier))
            {
                history.drain(..last_durable);
            }
        }
    }

    fn run(mut self, port: u16) -> Self {
        while Instant::now() < self.deadline {
            let step = match self.rng.random_range(0..100) {
                0..80 => self.owned_op(),
                80..97 => self.shared_op(),
                _ => self.barrier(),
            };
            // After a reply the model did not expect, the connection may be out of step.
            if step.is_err() || !self.failures.is_empty() {
                return self;
            }
        }
        self.failures.push(format!(
            "thread {} still ran at its deadline (port {port})",
            self.id
        ));
        self
    }

    fn barrier(&mut self) -> io::Result<()> {
        let start = Instant::now();
        let reply = self.conn.request("sync", None)?;
        if reply != b"OK\r\n" {
            self.fail("sync", &reply, b"OK\r\n");
            return Ok(());
        }
        self.barriers.push(start);
        if self.sync != Sync::Always {
            self.prune_owned(start);
        }
        Ok(())
    }

    fn fail(&mut self, what: &str, got: &[u8], expected: &[u8]) {
        self.failures.push(format!(
            "thread {}: {what}: reply {:?}, the model expects {:?}",
            self.id,
            String::from_utf8_lossy(got),
            String::from_utf8_lossy(expected)
        ));
    }

    /// set/ms/delete/md on a key every thread writes; the reply says what it left.
    fn shared_op(&mut self) -> io::Result<()> {
        self.ops += 1;
        let key = shared_key(self.rng.random_range(0..SHARED_KEYS));
        let start = Instant::now();
        let kind = self.rng.random_range(0..4);
        if kind < 2 {
            // Tagged whole, so no two writes leave the same value.
            let mut data = format!("r{}t{}o{}:", self.round, self.id, self.ops).into_bytes();
            data.extend(self.value(SHARED_VALUE_SIZE_MAX_BYTES));
            let flags = self.rng.random_range(0..4u32) * 1000;
            let line = if kind == 0 {
                format!("set {key} {flags} 0 {}", data.len())
            } else {
                format!("ms {key} {} F{flags}", data.len())
            };
            self.record(&key, item(data.clone(), flags), start);
            let reply = self.conn.request(&line, Some(&data))?;
            let ok: &[u8] = if kind == 0 { b"STORED\r\n" } else { b"HD\r\n" };
            if reply != ok {
                self.fail(&line, &reply, ok);
            }
        } else {
            let line = if kind == 2 {
                format!("delete {key}")
            } else {
                format!("md {key}")
            };
            self.record(&key, None, start);
            let reply = self.conn.request(&line, None)?;
            let known: &[&[u8]] = if kind == 2 {
                &[b"DELETED\r\n", b"NOT_FOUND\r\n"]
            } else {
                &[b"HD\r\n", b"NF\r\n"]
            };
            if !known.contains(&reply.as_slice()) {
                self.fail(&line, &reply, known[0]);
            }
        }
        self.ack(&key, self.ops, Instant::now());
        Ok(())
    }

    fn owned_key(&mut self) -> String {
        self.owned[self.rng.random_range(0..self.owned.len())].clone()
    }

    /// Random commands on this thread's keys, checked against the model: one at a time, or
    /// a pipelined batch (whose writes share the server's loop turn and its sync).
    fn owned_op(&mut self) -> io::Result<()> {
        let batch = match self.rng.random_range(0..15) {
            0 => return self.check_get(),
            1 => return self.cas(),
            2 => self.rng.random_range(2..=8),
            _ => 1,
        };
        let mut planned = Vec::with_capacity(batch);
        for _ in 0..batch {
            self.ops += 1;
            let key = self.owned_key();
            let old = self.current(&key);
            let op = self.rng.random_range(2..15);
            let (line, data, expect) = self.plan(op, &key, &old);
            // The model's current state includes this write for the next command planned.
            if let Some(state) = &expect.state {
                self.record(&key, state.clone(), Instant::now());
            }
            planned.push(Planned {
                key,
                op: self.ops,
                line,
                data,
                expect,
            });
        }
        self.send_planned(planned)
    }

    /// Sends planned requests (already recorded) in one write and checks their replies.
    fn send_planned(&mut self, planned: Vec<Planned>) -> io::Result<()> {
        let mut request = Vec::new();
        for p in &planned {
            frame(&mut request, &p.line, p.data.as_deref());
        }
        self.conn.send_bytes(&request)?;
        for p in planned {
            let reply = self.conn.reply()?;
            let end = Instant::now();
            self.acked += 1;
            if reply != p.expect.reply {
                self.fail(&p.line, &reply, &p.expect.reply);
                return Ok(());
            }
            if p.expect.state.is_some() {
                self.ack(&p.key, p.op, end);
            }
        }
        Ok(())
    }

    /// `gets` of an owned key, checked against the model: the state and CAS value, or `None`
    /// (a failure noted) if they differ.
    fn gets_checked(&mut self, key: &str) -> io::Result<Option<(State, u64)>> {
        let old = self.current(key);
        let (got, cas) = self.conn.gets(key)?;
        if got != old {
            self.failures.push(format!(
                "thread {}: gets {key} read {} where the model has {}",
                self.id,
                show(&got),
                show(&old)
            ));
            return Ok(None);
        }
        Ok(Some((got, cas)))
    }

    fn check_get(&mut self) -> io::Result<()> {
        let key = self.owned_key();
        self.gets_checked(&key).map(drop)
    }

    /// `gets`, then `cas` with its CAS value or a wrong one.
    fn cas(&mut self) -> io::Result<()> {
        let key = self.owned_key();
        let Some((old, cas)) = self.gets_checked(&key)? else {
            return Ok(());
        };
        self.ops += 1;
        let right = self.rng.random_bool(0.7);
        let compare = if right {
            cas
        } else {
            cas.wrapping_add(1_000_003)
        };
        let data = self.value(VALUE_SIZE_MAX_BYTES);
        let flags = self.rng.random_range(0..3u32);
        let line = format!("cas {key} {flags} 0 {} {compare}", data.len());
        let expect = match old {
            None => Expect::nothing(b"NOT_FOUND\r\n"),
            Some(_) if right => Expect::write(item(data.clone(), flags), b"STORED\r\n"),
            Some(_) => Expect::nothing(b"EXISTS\r\n"),
        };
        if let Some(state) = &expect.state {
            self.record(&key, state.clone(), Instant::now());
        }
        let op = self.ops;
        self.send_planned(vec![Planned {
            key,
            op,
            line,
            data: Some(data),
            expect,
        }])
    }

    /// The request line, data block and expected outcome of write command `op` on `key`.
    fn plan(&mut self, op: u32, key: &str, old: &State) -> (String, Option<Vec<u8>>, Expect) {
        let flags = self.rng.random_range(0..3u32) * 7;
        let old_len = old.as_ref().map_or(0, |i| i.data.len());
        let room = VALUE_GROWN_MAX_BYTES.saturating_sub(old_len).max(1);
        match op {
            2..=5 => {
                let data = self.value(VALUE_SIZE_MAX_BYTES);
                let (cmd, expect) = match (op, old) {
                    (2, _) => (
                        "set",
                        Expect::write(item(data.clone(), flags), b"STORED\r\n"),
                    ),
                    (3, None) => (
                        "add",
                        Expect::write(item(data.clone(), flags), b"STORED\r\n"),
                    ),
                    (3, Some(_)) => ("add", Expect::nothing(b"NOT_STORED\r\n")),
                    (4, Some(_)) => (
                        "replace",
                        Expect::write(item(data.clone(), flags), b"STORED\r\n"),
                    ),
                    (4, None) => ("replace", Expect::nothing(b"NOT_STORED\r\n")),
                    _ => ("set", Expect::write(None, b"STORED\r\n")),
                };
                let exptime = if op == 5 { -1 } else { 0 };
                (
                    format!("{cmd} {key} {flags} {exptime} {}", data.len()),
                    Some(data),
                    expect,
                )
            }
            6 | 7 => {
                let data = self.value(room);
                let append = op == 6;
                let cmd = if append { "append" } else { "prepend" };
                let expect = match old {
                    None => Expect::nothing(b"NOT_STORED\r\n"),
                    Some(old) => Expect::write(
                        item(joined(&old.data, &data, append), old.flags),
                        b"STORED\r\n",
                    ),
                };
                (
                    format!("{cmd} {key} 0 0 {}", data.len()),
                    Some(data),
                    expect,
                )
            }
            8 => {
                let expect = match old {
                    None => Expect::nothing(b"NOT_FOUND\r\n"),
                    Some(_) => Expect::write(None, b"DELETED\r\n"),
                };
                (format!("delete {key}"), None, expect)
            }
            9 => {
                let incr = self.rng.random_bool(0.5);
                let delta = self.delta();
                let cmd = if incr { "incr" } else { "decr" };
                let expect = match old {
                    None => Expect::nothing(b"NOT_FOUND\r\n"),
                    Some(old) => match arith(&old.data, incr, delta) {
                        None => Expect::nothing(NON_NUMERIC),
                        Some((value, digits)) => Expect::write(
                            item(digits, old.flags),
                            format!("{value}\r\n").as_bytes(),
                        ),
                    },
                };
                (format!("{cmd} {key} {delta}"), None, expect)
            }
            10 => {
                let expire = self.rng.random_bool(0.2);
                let (exptime, state) = if expire {
                    (-1, None)
                } else {
                    (100_000, old.clone())
                };
                let expect = match old {
                    None => Expect::nothing(b"NOT_FOUND\r\n"),
                    Some(_) => Expect::write(state, b"TOUCHED\r\n"),
                };
                (format!("touch {key} {exptime}"), None, expect)
            }
            11 => self.plan_ms(key, old, flags, room),
            12 => {
                let expect = match old {
                    None => Expect::nothing(b"NF\r\n"),
                    Some(_) => Expect::write(None, b"HD\r\n"),
                };
                (format!("md {key}"), None, expect)
            }
            _ => self.plan_ma(key, old),
        }
    }

    fn plan_ms(
        &mut self,
        key: &str,
        old: &State,
        flags: u32,
        room: usize,
    ) -> (String, Option<Vec<u8>>, Expect) {
        let mode = [b'S', b'E', b'R', b'A', b'P'][self.rng.random_range(0..5)];
        let joins = matches!(mode, b'A' | b'P');
        let data = self.value(if joins { room } else { VALUE_SIZE_MAX_BYTES });
        let vivify = joins && self.rng.random_bool(0.5);
        let fresh = || Expect::write(item(data.clone(), flags), b"HD\r\n");
        let expect = match (mode, old) {
            (b'S', _) | (b'E', None) | (b'R', Some(_)) => fresh(),
            (b'E', Some(_)) | (b'R', None) => Expect::nothing(b"NS\r\n"),
            (_, None) if vivify => fresh(),
            (_, None) => Expect::nothing(b"NS\r\n"),
            (_, Some(old)) => Expect::write(
                item(joined(&old.data, &data, mode == b'A'), old.flags),
                b"HD\r\n",
            ),
        };
        let n = if vivify { " N0" } else { "" };
        let line = format!("ms {key} {} F{flags} M{}{n}", data.len(), mode as char);
        (line, Some(data), expect)
    }

    fn plan_ma(&mut self, key: &str, old: &State) -> (String, Option<Vec<u8>>, Expect) {
        let incr = self.rng.random_bool(0.5);
        let delta = self.delta();
        let vivify = self
            .rng
            .random_bool(0.3)
            .then(|| self.rng.random_range(0..100u64));
        let show_value = self.rng.random_bool(0.5);
        let mut line = format!("ma {key} M{} D{delta}", if incr { 'I' } else { 'D' });
        if let Some(initial) = vivify {
            line.push_str(&format!(" N0 J{initial}"));
        }
        if show_value {
            line.push_str(" v");
        }
        let reply = |value: u64| {
            if show_value {
                let digits = value.to_string();
                format!("VA {}\r\n{digits}\r\n", digits.len()).into_bytes()
            } else {
                b"HD\r\n".to_vec()
            }
        };
        let expect = match (old, vivify) {
            (None, None) => Expect::nothing(b"NF\r\n"),
            (None, Some(initial)) => {
                Expect::write(item(initial.to_string().into_bytes(), 0), &reply(initial))
            }
            (Some(old), _) => match arith(&old.data, incr, delta) {
                None => Expect::nothing(NON_NUMERIC),
                Some((value, digits)) => Expect::write(item(digits, old.flags), &reply(value)),
            },
        };
        (line, None, expect)
    }

    fn delta(&mut self) -> u64 {
        match self.rng.random_range(0..10) {
            0 => u64::MAX - self.rng.random_range(0..5),
            1 => self.rng.random_range(0..u64::MAX),
            _ => self.rng.random_range(0..20),
        }
    }
}

fn joined(old: &[u8], new: &[u8], append: bool) -> Vec<u8> {
    if append {
        [old, new].concat()
    } else {
        [new, old].concat()
    }
}

/// The states a key may hold after the kill. `sequential`: one client made the writes in
/// this order, so the last durable one and every later one are legal. Otherwise (writes that
/// raced) every write is legal that no durable write started after it was acknowledged (a
/// write in flight counts as acknowledged at the end of time).
fn allowed_states(
    writes: &[Written],
    sequential: bool,
    durable: impl Fn(&Written) -> bool,
) -> Vec<State> {
    let legal: Vec<&Written> = if sequential {
        let from = writes.iter().rposition(&durable).unwrap_or(0);
        writes[from..].iter().collect()
    } else {
        let durable_starts: Vec<Instant> = writes
            .iter()
            .filter(|w| durable(w))
            .map(|w| w.start)
            .collect();
        let superseded = |w: &Written| {
            w.end
                .is_some_and(|end| durable_starts.iter().any(|&s| s > end))
        };
        writes.iter().filter(|w| !superseded(w)).collect()
    };
    let mut states: Vec<State> = Vec::new();
    for w in legal {
        if !states.contains(&w.state) {
            states.push(w.state.clone());
        }
    }
    states
}

/// One mode's store through many killed rounds.
struct Run {
    mode: &'static str,
    seed: u64,
    rng: StdRng,
    kura: Option<Kura>,
    /// Per key, the states it may hold now.
    allowed: HashMap<String, Vec<State>>,
    /// The last round and its sync policy.
    last: Option<(u64, Sync)>,
    kills: u64,
    recovery_kills: u64,
    acked: u64,
    in_flight: u64,
    /// Summed over the rounds, as each server counted them just before its kill.
    seals: u64,
    gc_runs: u64,
    written_bytes: u64,
    sent_bytes: u64,
}

impl Run {
    fn new(mode: &'static str, seed: u64) -> Self {
        Self {
            mode,
            seed,
            rng: StdRng::seed_from_u64(seed),
            kura: None,
            last: None,
            allowed: all_keys().into_iter().map(|k| (k, vec![None])).collect(),
            kills: 0,
            recovery_kills: 0,
            acked: 0,
            in_flight: 0,
            seals: 0,
            gc_runs: 0,
            written_bytes: 0,
            sent_bytes: 0,
        }
    }

    fn args(&self, sync: Sync) -> Vec<&'static str> {
        let size = if self.mode == "cache" {
            STORE_SIZE_CACHE_MODE
        } else {
            STORE_SIZE_STORE_MODE
        };
        vec![
            "-I",
            ITEM_SIZE_MAX,
            "--block-size",
            BLOCK_SIZE,
            "-m",
            "8",
            "-t",
            "2",
            "--size",
            size,
            "--mode",
            self.mode,
            // One write buffer (cache mode) fills and seals sooner than four.
            "--partitions-max",
            if self.mode == "cache" { "1" } else { "4" },
            "--sync",
            sync.arg(),
        ]
    }

    fn start(&mut self, sync: Sync) {
        let args = self.args(sync);
        match &mut self.kura {
            None => self.kura = Some(Kura::start(&args)),
            Some(kura) => {
                if self.rng.random_bool(RECOVERY_KILL_PROBABILITY) {
                    let after = Duration::from_millis(
                        self.rng.random_range(0..=RECOVERY_KILL_AFTER_MS_MAX),
                    );
                    kill_during_recovery(&kura.store_path(), &args, after);
                    self.recovery_kills += 1;
                }
                kura.restart_with(&args);
            }
        }
    }

    /// Reads every key and checks it against what it may hold; returns what it holds.
    fn check(&self) -> HashMap<String, State> {
        let port = self.kura.as_ref().expect("running").port;
        let mut conn = Conn::connect(port).expect("connect after restart");
        let mut now = HashMap::new();
        let mut failures = Vec::new();
        for key in all_keys() {
            let (got, _) = conn
                .gets(&key)
                .unwrap_or_else(|e| panic!("gets {key} after restart: {e}"));
            let allowed = &self.allowed[&key];
            if !allowed.contains(&got) {
                let list: Vec<String> = allowed.iter().map(show).collect();
                failures.push(format!(
                    "  key {key}: read {}, allowed {}",
                    show(&got),
                    list.join(" | ")
                ));
            }
            now.insert(key, got);
        }
        if !failures.is_empty() {
            let when = match self.last {
                Some((round, sync)) => {
                    format!("after the kill of round {round} (--sync {})", sync.arg())
                }
                None => "on a new store".to_owned(),
            };
            panic!(
                "{} mode, seed {}, {when}: keys hold values they may not:\n{}",
                self.mode,
                self.seed,
                failures.join("\n")
            );
        }
        now
    }

    fn round(&mut self, round: u64) {
        let sync = match self.rng.random_range(0..6) {
            0 | 1 => Sync::Never,
            2 => Sync::Interval,
            _ => Sync::Always,
        };
        self.start(sync);
        let initial = self.check();
        self.last = Some((round, sync));
        let port = self.kura.as_ref().expect("running").port;
        let threads = self.rng.random_range(THREADS_MIN..=THREADS_MAX);
        let round_start = Instant::now();
        let mut handles = Vec::new();
        for id in 0..threads {
            let owned: Vec<String> = (0..OWNED_KEYS)
                .filter(|i| i % threads == id)
                .map(owned_key)
                .collect();
            let mut writes: HashMap<String, Vec<Written>> = owned
                .iter()
                .map(|k| (k.clone(), vec![Written::initial(&initial[k], round_start)]))
                .collect();
            writes.extend((0..SHARED_KEYS).map(|i| (shared_key(i), Vec::new())));
            let client = Client {
                id,
                round,
                rng: StdRng::seed_from_u64(self.seed ^ (round << 8) ^ id as u64),
                conn: Conn::connect(port).expect("connect"),
                sync,
                writes,
                owned,
                barriers: Vec::new(),
                failures: Vec::new(),
                ops: 0,
                acked: 0,
                deadline: round_start + THREAD_DEADLINE,
            };
            handles.push(std::thread::spawn(move || client.run(port)));
        }
        let kill_after_ms = if self.rng.random_bool(0.15) {
            self.rng.random_range(0..=EARLY_KILL_AFTER_MS_MAX)
        } else {
            self.rng.random_range(50..=KILL_AFTER_MS_MAX)
        };
        std::thread::sleep(Duration::from_millis(kill_after_ms));
        let stats = stats(port);
        let stat = |name: &str| stats.get(name).copied().unwrap_or(0);
        let evicted = stat("evictions") + stat("kura_evicted_blocks") > 0;
        self.seals += stat("kura_seals");
        self.gc_runs += stat("kura_gc_runs");
        self.written_bytes += stat("kura_flash_write_bytes");
        self.kura.as_mut().expect("running").kill();
        self.kills += 1;
        let clients: Vec<Client> = handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect();
        let failures: Vec<String> = clients.iter().flat_map(|c| c.failures.clone()).collect();
        assert!(
            failures.is_empty(),
            "{} mode, seed {}, round {round} (--sync {}): replies differ from the model:\n{}",
            self.mode,
            self.seed,
            sync.arg(),
            failures.join("\n")
        );
        self.allowed = self.after_kill(&clients, &initial, sync, round_start, evicted);
    }

    fn after_kill(
        &mut self,
        clients: &[Client],
        initial: &HashMap<String, State>,
        sync: Sync,
        round_start: Instant,
        evicted: bool,
    ) -> HashMap<String, Vec<State>> {
        let barrier = clients
            .iter()
            .flat_map(|c| c.barriers.iter().copied())
            .max()
            .unwrap_or(round_start);
        let durable = |w: &Written| match sync {
            Sync::Always => w.end.is_some(),
            Sync::Never | Sync::Interval => w.end.is_some_and(|end| end < barrier),
        };
        let mut allowed = HashMap::new();
        for key in all_keys() {
            let mut writes: Vec<Written> = clients
                .iter()
                .flat_map(|c| c.writes.get(&key).into_iter().flatten().cloned())
                .collect();
            if key.starts_with('s') {
                writes.insert(0, Written::initial(&initial[&key], round_start));
            }
            self.in_flight += writes.iter().filter(|w| w.end.is_none()).count() as u64;
            let sequential = !key.starts_with('s');
            let mut states = allowed_states(&writes, sequential, durable);
            if evicted && !states.contains(&None) {
                states.push(None);
            }
            allowed.insert(key, states);
        }
        self.acked += clients.iter().map(|c| c.acked).sum::<u64>();
        self.sent_bytes += clients.iter().map(|c| c.conn.sent_bytes).sum::<u64>();
        if evicted {
            println!(
                "{} mode, seed {}: items were evicted; misses are legal this round",
                self.mode, self.seed
            );
        }
        allowed
    }

    /// A last restart after the last kill: check, then a clean stop.
    fn finish(&mut self) {
        self.start(Sync::Always);
        self.check();
        let status = self.kura.as_mut().expect("running").stop();
        assert_eq!(
            status.code(),
            Some(0),
            "SIGTERM after the last round: {status:?}"
        );
    }
}

/// Starts a server on `store` and kills it `after` this long, while it recovers (or, if it is
/// quick, just after).
fn kill_during_recovery(store: &Path, args: &[&str], after: Duration) {
    let mut child = Command::new(common::SERVER_BIN)
        .args(["-p", "0", "--path"])
        .arg(store)
        .args(common::SMALL)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kura-server");
    std::thread::sleep(after);
    child.kill().expect("kill");
    child.wait().expect("reap");
}

/// The server's `stats` as numbers (empty if the server is already gone).
fn stats(port: u16) -> HashMap<String, u64> {
    let mut stats = HashMap::new();
    let Ok(mut conn) = Conn::connect(port) else {
        return stats;
    };
    if conn.send("stats", None).is_err() {
        return stats;
    }
    while let Ok(line) = conn.line() {
        let text = String::from_utf8_lossy(&line);
        let Some(stat) = text.strip_prefix("STAT ") else {
            break;
        };
        let mut parts = stat.split_whitespace();
        if let (Some(name), Some(Ok(n))) = (parts.next(), parts.next().map(str::parse)) {
            stats.insert(name.to_owned(), n);
        }
    }
    stats
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn crash_rounds(mode: &'static str) {
    let rounds = env_u64("KURA_CRASH_ROUNDS", ROUNDS_DEFAULT);
    let first_seed = env_u64("KURA_CRASH_SEED", SEED_DEFAULT);
    let seeds = env_u64("KURA_CRASH_SEEDS", 1);
    for seed in first_seed..first_seed + seeds {
        let started = Instant::now();
        let mut run = Run::new(mode, seed);
        for round in 0..rounds {
            run.round(round);
        }
        run.finish();
        println!(
            "{mode} mode, seed {seed}: {rounds} rounds, {} kills (and {} while recovering), {} acknowledged requests, {} writes in flight at kills; {} MiB sent, {} MiB written in blocks, {} seals, {} GC runs; {:.1} s",
            run.kills,
            run.recovery_kills,
            run.acked,
            run.in_flight,
            run.sent_bytes >> 20,
            run.written_bytes >> 20,
            run.seals,
            run.gc_runs,
            started.elapsed().as_secs_f64()
        );
    }
}

#[test]
fn sigkill_at_random_moments_keeps_every_acknowledged_write_store_mode() {
    crash_rounds("store");
}

#[test]
fn sigkill_at_random_moments_keeps_every_acknowledged_write_cache_mode() {
    crash_rounds("cache");
}
