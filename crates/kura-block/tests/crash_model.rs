//! A randomized crash-consistency test of the NBD export: random workloads over one or two
//! connections, `kill -9` of a kura process at a random moment (often with requests in
//! flight), a restart, and every byte of the volume checked against a model of what it may
//! legally hold.
//!
//! What kura promises, and the model checks: a 4 KiB block is one pool value, so each request
//! changes each block it touches atomically (a read-modify-write replaces the whole block
//! with the block it read, patched), and requests that touch one block take effect on it one
//! after another. So a block may hold exactly the contents reachable from its last known
//! content by applying, one at a time, requests the client issued: all the ones acknowledged,
//! in an order where a request acknowledged before another was issued comes first, and any
//! of the ones still in flight (or failed). Per block, the model keeps every content the block
//! may have held, each with the set of requests that made it. A crash may take a block back to
//! any of those, except ones missing a request that must be durable: one acknowledged before
//! a FLUSH that succeeded was issued (on either connection: the export has `CAN_MULTI_CONN`),
//! or an acknowledged FUA request. A FLUSH that fails tells the client that what was
//! acknowledged before may be lost (as `fsync` reports a write-back error once), so later
//! FLUSHes promise only what was acknowledged after it. A read must return, per block, a content that holds every
//! request acknowledged before the read was sent (since the last crash) and every durable one.
//! TRIM deletes the blocks wholly inside its range (they read as zeros) and leaves partial
//! ones alone; WRITE_ZEROES zeroes its whole range.
//!
//! Each round (on a volume of 32 blocks, continued from the round before): connect, run a
//! random workload — writes 512-byte aligned or not, within a block or across blocks, FUA
//! writes, TRIM, WRITE_ZEROES, FLUSH, reads, up to `IN_FLIGHT_MAX` requests in flight per
//! connection, in some rounds overlapping ones in flight — and kill:
//! - embedded engine: the `kura block nbd` process (the engine dies with it);
//! - kura server: `kura serve` alone (the export lives on: the workload goes on over the
//!   same connections while it restarts and after, with FLUSHes, whose success promises every
//!   write acknowledged before it, also the ones acknowledged before the crash), the export
//!   alone, or both.
//!
//! Then restart what was killed, read the whole volume over a new connection and check every
//! block. A failure names the backend, round, seed, block, the contents it may hold (hashes and
//! the requests that made them) and what was read (its hash and, per 512-byte sector, which
//! requests wrote those bytes). `KURA_CRASH_ROUNDS=<n>` sets the rounds per backend (default
//! `ROUNDS_DEFAULT`), `KURA_CRASH_SEED=<s>` the first round's seed.

mod common;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::ops::Range;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::raw_client::RawClient;
use common::{Backend, NbdProcess};
use kura_block::layout::{BLOCK_SIZE_BYTES, Split};
use kura_block::nbd::proto;
use rand::rngs::StdRng;
use rand::{Rng as _, RngCore, SeedableRng};

const VOLUME_SIZE: &str = "128K";
const VOLUME_SIZE_BYTES: u64 = 128 << 10;
const BLOCK_BYTES: usize = BLOCK_SIZE_BYTES as usize;
const BLOCKS: usize = (VOLUME_SIZE_BYTES / BLOCK_SIZE_BYTES) as usize;
const SECTOR_BYTES: u64 = 512;
const SECTORS_PER_BLOCK: u64 = BLOCK_SIZE_BYTES / SECTOR_BYTES;
/// Blocks most requests go to, so that requests meet on the same blocks.
const HOT_BLOCKS: u64 = 4;
const ROUNDS_DEFAULT: u64 = 100;
/// Requests and replies of a round's workload before the kill, at most.
const STEPS_MAX: u64 = 60;
/// Requests sent over the export while (and after) its kura server restarts.
const STEPS_AFTER_SERVER_CRASH: u64 = 30;
const IN_FLIGHT_MAX: usize = 8;
/// Contents the model keeps for one block, at most (a guard against a model that explodes).
const STATES_PER_BLOCK_MAX: usize = 200_000;
/// How long the final FLUSH of a round is retried while a restarted server is reconnected.
const FLUSH_RETRY_FOR: Duration = Duration::from_secs(10);
const VERIFY_READ_BYTES: u64 = 32 << 10;

type OpId = u32;

/// What a request does to one block.
#[derive(Clone)]
enum Effect {
    Set(Rc<[u8]>),
    Zero,
    /// `bytes`: `None` is zeros.
    Patch {
        at: Range<usize>,
        bytes: Option<Rc<[u8]>>,
    },
}

impl Effect {
    fn apply(&self, content: &[u8]) -> Rc<[u8]> {
        match self {
            Effect::Set(data) => Rc::clone(data),
            Effect::Zero => vec![0u8; BLOCK_BYTES].into(),
            Effect::Patch { at, bytes } => {
                let mut out = content.to_vec();
                match bytes {
                    Some(b) => out[at.clone()].copy_from_slice(b),
                    None => out[at.clone()].fill(0),
                }
                out.into()
            }
        }
    }
}

fn hash(content: &[u8]) -> u64 {
    // FNV-1a: enough to tell contents apart in messages and as a map key (with the content
    // compared too).
    content.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A content a block may hold and the requests that made it (sorted).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    hash: u64,
    applied: Vec<OpId>,
}

impl Key {
    fn has_all<'a>(&self, ids: impl IntoIterator<Item = &'a OpId>) -> bool {
        ids.into_iter().all(|id| self.applied.binary_search(id).is_ok())
    }
}

/// One block: every content it may have held since the round started, which of them it may
/// hold now, and the requests that may still change it.
struct BlockModel {
    base: Rc<[u8]>,
    states: HashMap<Key, Rc<[u8]>>,
    current: HashSet<Key>,
    pending: Vec<(OpId, Effect)>,
    /// Every request that touched it this round.
    touched: Vec<OpId>,
}

impl BlockModel {
    fn known(content: Rc<[u8]>) -> Self {
        let key = Key { hash: hash(&content), applied: Vec::new() };
        Self { base: Rc::clone(&content), states: HashMap::from([(key.clone(), content)]), current: HashSet::from([key]), pending: Vec::new(), touched: Vec::new() }
    }

    /// Adds the contents reachable from the current ones by pending requests.
    fn expand(&mut self) {
        let mut work: Vec<Key> = self.current.iter().cloned().collect();
        while let Some(key) = work.pop() {
            for (id, effect) in &self.pending {
                let Err(at) = key.applied.binary_search(id) else { continue };
                let content = effect.apply(&self.states[&key]);
                let mut applied = key.applied.clone();
                applied.insert(at, *id);
                let next = Key { hash: hash(&content), applied };
                if self.current.insert(next.clone()) {
                    self.states.entry(next.clone()).or_insert(content);
                    work.push(next);
                }
            }
            assert!(self.states.len() <= STATES_PER_BLOCK_MAX, "the model of a block grew past {STATES_PER_BLOCK_MAX} contents");
        }
    }

    fn matches(&self, key: &Key, range: Range<usize>, got: &[u8]) -> bool {
        self.states[key][range] == *got
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Read,
    Write { fua: bool },
    Trim { fua: bool },
    Zeroes { fua: bool, no_hole: bool },
    Flush,
}

/// A request of the round.
struct Request {
    conn: usize,
    cmd: Cmd,
    offset: u64,
    len: u32,
    payload: Option<Rc<[u8]>>,
    /// Requests the reply must show (reads) or make durable (FLUSH), chosen when sent.
    required: Vec<OpId>,
    /// Sent before a crash and not answered before it: its reply says nothing.
    crossed: bool,
    outcome: Option<u32>,
    /// When it was sent and answered, in the model's events.
    sent_at: u32,
    answered_at: Option<u32>,
}

impl Request {
    fn describe(&self, id: OpId) -> String {
        let outcome = match (self.outcome, self.crossed) {
            (Some(0), _) => "acknowledged",
            (Some(_), _) => "failed",
            (None, true) => "in flight at a crash",
            (None, false) => "in flight",
        };
        let answered = self.answered_at.map_or(String::new(), |at| format!(" at {at}"));
        format!("#{id} {:?} {}+{} on connection {}, sent at {} ({outcome}{answered})", self.cmd, self.offset, self.len, self.conn, self.sent_at)
    }

    fn wire(&self) -> (u16, u16) {
        let fua = |on: bool| if on { proto::CMD_FLAG_FUA } else { 0 };
        match self.cmd {
            Cmd::Read => (proto::CMD_READ, 0),
            Cmd::Write { fua: f } => (proto::CMD_WRITE, fua(f)),
            Cmd::Trim { fua: f } => (proto::CMD_TRIM, fua(f)),
            Cmd::Zeroes { fua: f, no_hole } => (proto::CMD_WRITE_ZEROES, fua(f) | if no_hole { proto::CMD_FLAG_NO_HOLE } else { 0 }),
            Cmd::Flush => (proto::CMD_FLUSH, 0),
        }
    }

    fn durable_on_ack(&self) -> bool {
        matches!(self.cmd, Cmd::Write { fua: true } | Cmd::Trim { fua: true } | Cmd::Zeroes { fua: true, .. })
    }

    /// Its effect on each block it changes.
    fn effects(&self) -> Vec<(usize, Effect)> {
        let split = Split::new(self.offset, u64::from(self.len));
        split
            .segments()
            .filter_map(|seg| {
                let block = seg.lba as usize;
                let effect = match (self.cmd, seg.is_full()) {
                    (Cmd::Read | Cmd::Flush, _) | (Cmd::Trim { .. }, false) => return None,
                    (Cmd::Write { .. }, true) => Effect::Set(self.payload.as_ref().expect("a write's data")[seg.in_buf()].into()),
                    (Cmd::Write { .. }, false) => Effect::Patch { at: seg.in_block(), bytes: Some(self.payload.as_ref().expect("a write's data")[seg.in_buf()].into()) },
                    (Cmd::Trim { .. } | Cmd::Zeroes { .. }, true) => Effect::Zero,
                    (Cmd::Zeroes { .. }, false) => Effect::Patch { at: seg.in_block(), bytes: None },
                };
                Some((block, effect))
            })
            .collect()
    }
}

/// The volume as the client may see it (see the module documentation).
struct Model {
    blocks: Vec<BlockModel>,
    requests: Vec<Request>,
    /// Changes acknowledged, in order; from `acked_since_crash` on: since the last crash.
    acked: Vec<OpId>,
    acked_since_crash: usize,
    /// Changes that must survive a crash.
    durable: Vec<OpId>,
    /// Changes acknowledged before a FLUSH failed: the client was told they may be lost, so a
    /// later FLUSH does not promise them.
    forgiven: HashSet<OpId>,
    /// Sends, replies and crashes so far; the crashes' events.
    events: u32,
    crashes: Vec<u32>,
}

impl Model {
    fn zeroed() -> Self {
        Self::from_read(&vec![0u8; VOLUME_SIZE_BYTES as usize])
    }

    /// Every block as read (after a FLUSH that made it durable).
    fn from_read(volume: &[u8]) -> Self {
        let blocks = volume.chunks(BLOCK_BYTES).map(|b| BlockModel::known(b.into())).collect();
        Self { blocks, requests: Vec::new(), acked: Vec::new(), acked_since_crash: 0, durable: Vec::new(), forgiven: HashSet::new(), events: 0, crashes: Vec::new() }
    }

    fn issue(&mut self, mut request: Request) -> OpId {
        let id = self.requests.len() as OpId;
        request.sent_at = self.events;
        self.events += 1;
        for (block, effect) in request.effects() {
            let b = &mut self.blocks[block];
            b.pending.push((id, effect));
            b.touched.push(id);
            b.expand();
        }
        self.requests.push(request);
        id
    }

    /// What a read or FLUSH sent now must show or make durable.
    fn required_now(&self, cmd: Cmd) -> Vec<OpId> {
        let mut required = self.durable.clone();
        match cmd {
            Cmd::Flush => required.extend(self.acked.iter().filter(|id| !self.forgiven.contains(id))),
            _ => required.extend_from_slice(&self.acked[self.acked_since_crash..]),
        }
        required
    }

    /// A reply came. `Err` describes a violation.
    fn answered(&mut self, id: OpId, error: u32, data: &[u8]) -> Result<(), String> {
        let request = &mut self.requests[id as usize];
        request.outcome = Some(error);
        request.answered_at = Some(self.events);
        self.events += 1;
        if request.cmd == Cmd::Flush && error != 0 {
            self.forgiven.extend(self.acked.iter().copied());
            return Ok(());
        }
        if request.crossed || error != 0 {
            return Ok(());
        }
        match request.cmd {
            Cmd::Read => return self.check_read(id, data),
            Cmd::Flush => {
                let mut required = std::mem::take(&mut request.required);
                // A FLUSH that failed meanwhile reported their loss.
                required.retain(|id| !self.forgiven.contains(id));
                return self.make_durable(id, required);
            }
            _ => {}
        }
        for (block, _) in self.requests[id as usize].effects() {
            let b = &mut self.blocks[block];
            b.current.retain(|k| k.applied.binary_search(&id).is_ok());
            b.pending.retain(|(p, _)| *p != id);
        }
        self.acked.push(id);
        if self.requests[id as usize].durable_on_ack() { self.make_durable(id, vec![id]) } else { Ok(()) }
    }

    /// After a FLUSH or FUA request `by` succeeded: `ids` must survive any crash, so the blocks
    /// may only hold contents that have them.
    fn make_durable(&mut self, by: OpId, ids: Vec<OpId>) -> Result<(), String> {
        self.durable.extend(ids);
        self.durable.sort_unstable();
        self.durable.dedup();
        for block in 0..BLOCKS {
            let b = &mut self.blocks[block];
            let needed: Vec<OpId> = b.touched.iter().copied().filter(|id| self.durable.binary_search(id).is_ok()).collect();
            b.current.retain(|k| k.has_all(&needed));
            if b.current.is_empty() {
                return Err(format!(
                    "{} succeeded, but block {block} cannot hold all of {} (acknowledged before it, so durable): one was lost\n{}",
                    self.requests[by as usize].describe(by),
                    list(&needed),
                    self.describe_block(block, None)
                ));
            }
        }
        Ok(())
    }

    fn check_read(&self, id: OpId, data: &[u8]) -> Result<(), String> {
        let request = &self.requests[id as usize];
        for seg in Split::new(request.offset, u64::from(request.len)).segments() {
            let b = &self.blocks[seg.lba as usize];
            let needed: Vec<OpId> = b.touched.iter().copied().filter(|id| request.required.contains(id)).collect();
            let got = &data[seg.in_buf()];
            if !b.states.keys().any(|k| k.has_all(&needed) && b.matches(k, seg.in_block(), got)) {
                return Err(format!(
                    "{} read bytes {:?} of block {} that the block never held with {} applied (acknowledged before the read was sent)\n{}",
                    request.describe(id),
                    seg.in_block(),
                    seg.lba,
                    list(&needed),
                    self.describe_block(seg.lba as usize, Some((seg.in_block(), got)))
                ));
            }
        }
        Ok(())
    }

    /// A crash: every block may go back to any content it held that has the durable requests,
    /// and requests in flight may or may not take effect.
    fn crash(&mut self) {
        self.crashes.push(self.events);
        self.events += 1;
        for request in self.requests.iter_mut().filter(|r| r.outcome.is_none()) {
            request.crossed = true;
        }
        for b in &mut self.blocks {
            let needed: Vec<OpId> = b.touched.iter().copied().filter(|id| self.durable.binary_search(id).is_ok()).collect();
            b.current = b.states.keys().filter(|k| k.has_all(&needed)).cloned().collect();
            b.expand();
        }
        self.acked_since_crash = self.acked.len();
    }

    /// The whole volume as read after the round; `Err` lists every block that is wrong.
    fn check_volume(&self, volume: &[u8]) -> Result<(), String> {
        let mut report = String::new();
        for (block, got) in volume.chunks(BLOCK_BYTES).enumerate() {
            let b = &self.blocks[block];
            if !b.current.iter().any(|k| b.matches(k, 0..BLOCK_BYTES, got)) {
                writeln!(report, "block {block} holds a content it may not have:\n{}", self.describe_block(block, Some((0..BLOCK_BYTES, got)))).unwrap();
            }
        }
        if report.is_empty() { Ok(()) } else { Err(report) }
    }

    /// The contents the block may hold now, and (if given) what was read at a range of it
    /// with, per sector, the requests whose data it is.
    fn describe_block(&self, block: usize, read: Option<(Range<usize>, &[u8])>) -> String {
        let b = &self.blocks[block];
        let mut out = format!("  base content {:016x}; may hold now ({}):\n", hash(&b.base), b.current.len());
        let mut current: Vec<&Key> = b.current.iter().collect();
        current.sort_by(|x, y| x.applied.cmp(&y.applied));
        for k in current.iter().take(16) {
            writeln!(out, "    {:016x} = base + {}", k.hash, list(&k.applied)).unwrap();
        }
        let flushes: Vec<String> =
            self.requests.iter().enumerate().filter(|(_, r)| r.cmd == Cmd::Flush || r.outcome.is_some_and(|e| e != 0)).map(|(id, r)| r.describe(id as OpId)).collect();
        writeln!(out, "  crashes at events {:?}; FLUSHes and failed requests: {}", self.crashes, flushes.join("; ")).unwrap();
        out += "  requests that touched it:\n";
        for &id in &b.touched {
            writeln!(out, "    {}", self.requests[id as usize].describe(id)).unwrap();
        }
        if let Some((range, got)) = read {
            writeln!(out, "  read {:?}: {:016x}; per sector:", range, hash(got)).unwrap();
            for (i, sector) in got.chunks(SECTOR_BYTES as usize).enumerate() {
                let at = range.start + i * SECTOR_BYTES as usize;
                writeln!(out, "    {at:5}: {}", self.origins(block, at, sector)).unwrap();
            }
        }
        out
    }

    /// Which requests (or the base content, or zeros) `sector` at `at` of `block` comes from.
    fn origins(&self, block: usize, at: usize, sector: &[u8]) -> String {
        let b = &self.blocks[block];
        let range = at..at + sector.len();
        let mut from = Vec::new();
        if b.base[range.clone()] == *sector {
            from.push("base".to_owned());
        }
        if sector.iter().all(|&x| x == 0) {
            from.push("zeros".to_owned());
        }
        for &id in &b.touched {
            let request = &self.requests[id as usize];
            let Some(payload) = &request.payload else { continue };
            let block_start = block as u64 * BLOCK_SIZE_BYTES;
            let abs = block_start + at as u64;
            if abs >= request.offset && abs + sector.len() as u64 <= request.offset + u64::from(request.len) {
                let start = (abs - request.offset) as usize;
                if payload[start..start + sector.len()] == *sector {
                    from.push(format!("#{id}"));
                }
            }
        }
        if from.is_empty() { format!("unknown ({:02x?}…)", &sector[..8]) } else { from.join(", ") }
    }
}

fn list(ids: &[OpId]) -> String {
    if ids.is_empty() { "nothing".to_owned() } else { ids.iter().map(|id| format!("#{id}")).collect::<Vec<_>>().join(" ") }
}

struct Rng(StdRng);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n.max(1))
    }

    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// A random range: within a block, across blocks at any sector, or whole blocks; mostly on
/// the first `HOT_BLOCKS` blocks.
fn random_range(rng: &mut Rng) -> (u64, u32) {
    let blocks = if rng.percent(50) { HOT_BLOCKS } else { BLOCKS as u64 };
    let block = rng.below(blocks);
    let (start_sector, sectors) = match rng.below(3) {
        0 => {
            let sectors = 1 + rng.below(SECTORS_PER_BLOCK);
            (block * SECTORS_PER_BLOCK + rng.below(SECTORS_PER_BLOCK - sectors + 1), sectors)
        }
        1 => (block * SECTORS_PER_BLOCK + rng.below(SECTORS_PER_BLOCK), 2 + rng.below(2 * SECTORS_PER_BLOCK)),
        _ => (block * SECTORS_PER_BLOCK, SECTORS_PER_BLOCK * (1 + rng.below(3))),
    };
    let volume_sectors = VOLUME_SIZE_BYTES / SECTOR_BYTES;
    let sectors = sectors.min(volume_sectors - start_sector);
    (start_sector * SECTOR_BYTES, (sectors * SECTOR_BYTES) as u32)
}

fn random_cmd(rng: &mut Rng) -> Cmd {
    let fua = rng.percent(20);
    match rng.below(100) {
        0..50 => Cmd::Write { fua },
        50..62 => Cmd::Read,
        62..72 => Cmd::Trim { fua },
        72..82 => Cmd::Zeroes { fua, no_hole: rng.percent(50) },
        _ => Cmd::Flush,
    }
}

/// What a round kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kill {
    Export,
    Server,
    Both,
}

/// One backend under test: its processes, connections and model.
struct Run {
    backend: Backend,
    nbd: NbdProcess,
    model: Model,
    conns: Vec<RawClient>,
    /// Per connection: handle → request.
    in_flight: Vec<HashMap<u64, OpId>>,
    handle: u64,
    /// Replies after a kill may be errors.
    killed: bool,
    round: u64,
    seed: u64,
    kill: Kill,
}

impl Run {
    fn fail(&self, what: &str) -> ! {
        panic!("{}: round {} (seed {}, kill {:?}; replay: KURA_CRASH_SEED={} KURA_CRASH_ROUNDS=1): {what}", self.backend.name(), self.round, self.seed, self.kill, self.seed)
    }

    fn connect(&mut self, conns: usize) {
        self.conns = (0..conns)
            .map(|_| {
                let mut c = RawClient::connect(&self.nbd.addr);
                assert_eq!(c.go("c"), VOLUME_SIZE_BYTES);
                c
            })
            .collect();
        self.in_flight = vec![HashMap::new(); conns];
    }

    fn send(&mut self, conn: usize, cmd: Cmd, offset: u64, len: u32, rng: &mut Rng) {
        let payload = matches!(cmd, Cmd::Write { .. }).then(|| {
            let mut data = vec![0u8; len as usize];
            rng.0.fill_bytes(&mut data);
            Rc::<[u8]>::from(data)
        });
        let (offset, len) = if cmd == Cmd::Flush { (0, 0) } else { (offset, len) };
        let required = if matches!(cmd, Cmd::Read | Cmd::Flush) { self.model.required_now(cmd) } else { Vec::new() };
        let request = Request { conn, cmd, offset, len, payload, required, crossed: false, outcome: None, sent_at: 0, answered_at: None };
        let (kind, flags) = request.wire();
        let bytes = request.payload.clone();
        let id = self.model.issue(request);
        self.handle += 1;
        self.conns[conn].request(kind, flags, self.handle, offset, len, bytes.as_deref().unwrap_or_default());
        self.in_flight[conn].insert(self.handle, id);
    }

    /// Reads one reply on `conn`; `false` if the connection is gone.
    fn receive(&mut self, conn: usize) -> bool {
        let Ok((error, handle)) = self.conns[conn].reply_header() else { return false };
        let Some(id) = self.in_flight[conn].remove(&handle) else { self.fail(&format!("a reply on connection {conn} to handle {handle}, which is not in flight")) };
        let request = &self.model.requests[id as usize];
        let data = if error == 0 && request.cmd == Cmd::Read {
            match self.conns[conn].read_data(request.len as usize) {
                Ok(data) => data,
                Err(_) => return false,
            }
        } else {
            Vec::new()
        };
        if error != 0 && !self.killed {
            self.fail(&format!("{} failed with error {error} before any kill", request.describe(id)));
        }
        if let Err(violation) = self.model.answered(id, error, &data) {
            self.fail(&violation);
        }
        true
    }

    /// A random step: a new request where there is room, else a reply.
    fn step(&mut self, rng: &mut Rng, overlap: bool) {
        let conn = rng.below(self.conns.len() as u64) as usize;
        let full = self.in_flight[conn].len() >= IN_FLIGHT_MAX;
        if !self.in_flight[conn].is_empty() && (full || rng.percent(40)) {
            self.receive(conn);
            return;
        }
        let cmd = random_cmd(rng);
        let (offset, len) = random_range(rng);
        if !overlap && cmd != Cmd::Flush && self.overlaps_a_change_in_flight(offset, len) {
            return;
        }
        self.send(conn, cmd, offset, len, rng);
    }

    fn overlaps_a_change_in_flight(&self, offset: u64, len: u32) -> bool {
        let end = offset + u64::from(len);
        self.in_flight.iter().flat_map(|m| m.values()).any(|&id| {
            let r = &self.model.requests[id as usize];
            !matches!(r.cmd, Cmd::Read | Cmd::Flush) && r.offset < end && offset < r.offset + u64::from(r.len)
        })
    }

    fn drain(&mut self) {
        for conn in 0..self.conns.len() {
            while !self.in_flight[conn].is_empty() {
                if !self.receive(conn) {
                    self.fail(&format!("connection {conn} closed with {} requests in flight", self.in_flight[conn].len()));
                }
            }
        }
    }

    /// Reads what the killed export had sent before it died, then forgets its connections.
    fn drain_dead(&mut self) {
        for conn in 0..self.conns.len() {
            while !self.in_flight[conn].is_empty() && self.receive(conn) {}
        }
        self.conns.clear();
        self.in_flight.clear();
    }

    fn server(&mut self) -> &mut common::KuraServer {
        match &mut self.backend {
            Backend::Kura(server) => server,
            _ => unreachable!("only a kura server backend has a server to kill"),
        }
    }

    fn kill_now(&mut self, rng: &mut Rng) {
        self.killed = true;
        match self.kill {
            Kill::Export | Kill::Both => {
                self.nbd.kill();
                if self.kill == Kill::Both {
                    self.server().kill();
                }
                self.drain_dead();
                self.model.crash();
                if self.kill == Kill::Both {
                    self.server().restart();
                }
                self.nbd.restart();
            }
            Kill::Server => {
                self.server().kill();
                self.model.crash();
                // The export lives on: requests meanwhile fail or wait, and go on after.
                for _ in 0..rng.below(STEPS_AFTER_SERVER_CRASH / 2) {
                    self.step(rng, false);
                }
                self.server().restart();
                for _ in 0..STEPS_AFTER_SERVER_CRASH {
                    self.step(rng, false);
                }
                self.drain();
                self.conns.clear();
                self.in_flight.clear();
            }
        }
    }

    fn round(&mut self, round: u64, seed: u64) {
        let mut rng = Rng(StdRng::seed_from_u64(seed));
        (self.round, self.seed, self.killed) = (round, seed, false);
        self.kill = match (&self.backend, rng.below(4)) {
            (Backend::Kura(_), 0 | 1) => Kill::Server,
            (Backend::Kura(_), 2) => Kill::Both,
            _ => Kill::Export,
        };
        let overlap = rng.percent(30);
        self.connect(1 + rng.below(2) as usize);
        for _ in 0..5 + rng.below(STEPS_MAX) {
            self.step(&mut rng, overlap);
        }
        if rng.percent(15) {
            self.drain();
        } else if rng.percent(50) {
            std::thread::sleep(Duration::from_micros(rng.below(2000)));
        }
        self.kill_now(&mut rng);
        self.verify();
    }

    /// Reads the whole volume over a new connection, checks it, makes it durable and takes it
    /// as the next round's start.
    fn verify(&mut self) {
        self.connect(1);
        let mut volume = Vec::with_capacity(VOLUME_SIZE_BYTES as usize);
        for offset in (0..VOLUME_SIZE_BYTES).step_by(VERIFY_READ_BYTES as usize) {
            self.conns[0].request(proto::CMD_READ, 0, 1, offset, VERIFY_READ_BYTES as u32, &[]);
            let (error, _, data) = self.conns[0].reply(VERIFY_READ_BYTES as usize);
            if error != 0 {
                self.fail(&format!("reading the volume back at {offset}: error {error}"));
            }
            volume.extend_from_slice(&data);
        }
        if let Err(report) = self.model.check_volume(&volume) {
            self.fail(&format!("the volume after the crash:\n{report}"));
        }
        let deadline = Instant::now() + FLUSH_RETRY_FOR;
        loop {
            self.conns[0].request(proto::CMD_FLUSH, 0, 2, 0, 0, &[]);
            match self.conns[0].reply(0).0 {
                0 => break,
                error if Instant::now() > deadline => self.fail(&format!("FLUSH after the round: error {error}")),
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        self.model = Model::from_read(&volume);
        self.conns.clear();
        self.in_flight.clear();
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
}

fn run_backend(backend: Backend) {
    backend.create_volume("c", VOLUME_SIZE);
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let mut run = Run { backend, nbd, model: Model::zeroed(), conns: Vec::new(), in_flight: Vec::new(), handle: 0, killed: false, round: 0, seed: 0, kill: Kill::Export };
    let (rounds, first_seed) = (env_u64("KURA_CRASH_ROUNDS", ROUNDS_DEFAULT), env_u64("KURA_CRASH_SEED", 0));
    let started = Instant::now();
    let mut kills: HashMap<Kill, u64> = HashMap::new();
    for round in 0..rounds {
        run.round(round, first_seed + round);
        *kills.entry(run.kill).or_default() += 1;
    }
    eprintln!("{}: {rounds} rounds, kills {kills:?}, {} requests, in {:?}", run.backend.name(), run.handle, started.elapsed());
}

/// `kill -9` of the export over the embedded engine at random moments; the volume holds what
/// the model allows after every restart.
#[test]
fn embedded_volume_survives_kill_9_of_the_export() {
    run_backend(Backend::embedded());
}

/// `kill -9` of `kura serve` (the export living on), of the export, or of both.
#[test]
fn kura_server_volume_survives_kill_9_of_the_server_or_the_export() {
    run_backend(Backend::kura());
}

/// A write acknowledged, `kill -9` of `kura serve` before it synced, a restart: a FLUSH over the
/// same connection must not succeed as if the write were durable. It fails once (EIO), or the
/// write is there; also when a FUA write (whose barrier fails first) comes before it. (The pool
/// reconnected and the server's `sync` answered OK: the FLUSH succeeded and the block read as
/// zeros.)
#[test]
fn flush_after_a_server_restart_does_not_promise_lost_writes() {
    let mut backend = Backend::kura();
    backend.create_volume("f", VOLUME_SIZE);
    let nbd = NbdProcess::start(&backend.url(), &[]);
    for (round, fua_first) in [(0u64, false), (1, true)] {
        let mut c = RawClient::connect(&nbd.addr);
        c.go("f");
        let data = common::pattern(round, BLOCK_BYTES);
        c.request(proto::CMD_WRITE, 0, 1, 0, BLOCK_SIZE_BYTES as u32, &data);
        assert_eq!(c.reply(0).0, 0, "the write");
        let Backend::Kura(server) = &mut backend else { unreachable!() };
        server.kill();
        server.restart();
        if fua_first {
            c.request(proto::CMD_WRITE, proto::CMD_FLAG_FUA, 2, BLOCK_SIZE_BYTES, BLOCK_SIZE_BYTES as u32, &data);
            c.reply(0);
        }
        c.request(proto::CMD_FLUSH, 0, 3, 0, 0, &[]);
        let (flush_error, _, _) = c.reply(0);
        c.request(proto::CMD_READ, 0, 4, 0, BLOCK_SIZE_BYTES as u32, &[]);
        let (read_error, _, read) = c.reply(BLOCK_BYTES);
        assert_eq!(read_error, 0, "the read");
        assert!(flush_error != 0 || read == data, "FUA write first: {fua_first}: the FLUSH after the restart succeeded, but the write acknowledged before it is gone");
        // Reported once: the next FLUSH succeeds.
        c.request(proto::CMD_FLUSH, 0, 5, 0, 0, &[]);
        assert_eq!(c.reply(0).0, 0, "the next FLUSH");
    }
}

/// A sector written on one connection (a read-modify-write of its block) while the whole block
/// is written on another: the block ends as one of the two orders, never as the old block with
/// the sector (the read-modify-write's set landing after the whole-block write and undoing it,
/// which the randomized test found on a kura server: an acknowledged, flushed write lost).
#[test]
fn read_modify_write_never_undoes_a_whole_block_write() {
    let backend = Backend::kura();
    backend.create_volume("r", VOLUME_SIZE);
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let (mut a, mut b) = (RawClient::connect(&nbd.addr), RawClient::connect(&nbd.addr));
    a.go("r");
    b.go("r");
    for i in 0..300u64 {
        let old = common::pattern(3 * i, BLOCK_BYTES);
        let sector = common::pattern(3 * i + 1, SECTOR_BYTES as usize);
        let whole = common::pattern(3 * i + 2, BLOCK_BYTES);
        a.request(proto::CMD_WRITE, 0, 1, 0, BLOCK_SIZE_BYTES as u32, &old);
        assert_eq!(a.reply(0).0, 0);
        a.request(proto::CMD_WRITE, 0, 2, SECTOR_BYTES, SECTOR_BYTES as u32, &sector);
        b.request(proto::CMD_WRITE, 0, 3, 0, BLOCK_SIZE_BYTES as u32, &whole);
        assert_eq!((a.reply(0).0, b.reply(0).0), (0, 0));
        a.request(proto::CMD_READ, 0, 4, 0, BLOCK_SIZE_BYTES as u32, &[]);
        let got = a.reply(BLOCK_BYTES).2;
        let mut whole_then_sector = whole.clone();
        whole_then_sector[SECTOR_BYTES as usize..2 * SECTOR_BYTES as usize].copy_from_slice(&sector);
        assert!(
            got == whole || got == whole_then_sector,
            "iteration {i}: the block is neither order of the two writes (old block with the sector: {})",
            got[..SECTOR_BYTES as usize] == old[..SECTOR_BYTES as usize]
        );
    }
}
