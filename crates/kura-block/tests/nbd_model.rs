//! A randomized model test of the NBD export: seeded random sequences of commands over several
//! connections at once, each READ checked against an in-memory copy of the volume, each
//! invalid request against the error the protocol (`doc/proto.md` of the NBD project) names.
//!
//! Every seed starts from a zeroed volume and runs rounds: in a round, two or three
//! connections each get several requests at once (pipelined; replies come in any order and
//! are matched by handle). Requests of one round never overlap a write of the same round, so
//! the model stays exact: overlapping requests are ordered only when the reply of the first
//! came before the second was sent. Ranges are random at the connection's minimum block size:
//! 512 on connections that asked for block sizes, single bytes on one that did not; within one
//! block or across many, up to the advertised maximum. WRITE_ZEROES reads back as zeros; TRIM
//! as kura promises (blocks wholly inside the range read as zeros, partial ones keep their
//! data).
//!
//! The same sequences run against `qemu-nbd` serving a raw file, as an anchor: its data is
//! checked the same way (a TRIM leaves its range unknown until written, all the protocol
//! promises), its error numbers are shown beside kura's and the protocol's but do not fail the
//! test (qemu-nbd's choices are not the protocol). Where the protocol leaves the answer open
//! (zero lengths, commands not advertised), any reply that keeps the connection is accepted.
//! kura takes a WRITE_ZEROES longer than its maximum block size, which the protocol asks
//! servers to refuse (Linux's client sends them up to 4 GiB whatever the server advertises),
//! so none is sent.
//!
//! After each seed, a connection that negotiated structured replies and `base:allocation`
//! walks the volume with `NBD_CMD_BLOCK_STATUS`: the extents tile it, and every one said to
//! read as zeros does so in the model.
//!
//! A failure names the server, the seed, the command's index, the command and what was
//! expected; `KURA_NBD_MODEL_SEED=<seed>` replays one seed.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use common::raw_client::{Export, RawClient};
use common::{Backend, NbdProcess, START_TIMEOUT, scratch_dir};
use kura_block::layout::BLOCK_SIZE_BYTES;
use kura_block::nbd::proto;
use kura_testkit::{ChildGuard, require_cmd};
use rand::rngs::StdRng;
use rand::{Rng as _, RngCore, SeedableRng};

const VOLUME_SIZE: &str = "4M";
const VOLUME_SIZE_BYTES: u64 = 4 << 20;
/// kura's `--max-request`: below the volume size, so that an oversized request is not also
/// one past the end (the protocol names a different error for each).
const MAX_REQUEST: &str = "1M";
const SEEDS: u64 = 32;
const ROUNDS_PER_SEED: usize = 60;
/// Connections 0 and 1 ask for block sizes; the last one does not (byte granularity).
const CONNECTIONS: usize = 3;
const REQUESTS_PER_ROUND_MAX: usize = 6;
/// Percent of requests that are invalid.
const INVALID_PERCENT: u64 = 8;

// Protocol values kura does not advertise (and so does not define in `proto`).
const CMD_CACHE: u16 = 5;
const CMD_FLAG_DF: u16 = 1 << 2;
const FLAG_SEND_CACHE: u16 = 1 << 10;

/// The seeded generator of one seed's commands (the same sequence for a seed in a build).
struct Rng(StdRng);

impl Rng {
    fn seeded(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    /// In `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n.max(1))
    }

    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.0.fill_bytes(&mut out);
        out
    }
}

/// What a server promises about a range after `NBD_CMD_TRIM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrimModel {
    /// kura (README, queue.rs): blocks wholly inside the range are deleted and read as zeros;
    /// the partial blocks at its ends keep their data.
    WholeBlocksZeroed,
    /// The protocol's promise: nothing, until the range is written again.
    Unknown,
}

/// The volume as it must read: `data` where `known`; `origin`: the command that last set
/// each byte (for failure messages; `u32::MAX`: the reset at the seed's start).
struct Model {
    data: Vec<u8>,
    known: Vec<bool>,
    origin: Vec<u32>,
    trim: TrimModel,
}

impl Model {
    fn zeroed(size_bytes: u64, trim: TrimModel) -> Self {
        Self { data: vec![0; size_bytes as usize], known: vec![true; size_bytes as usize], origin: vec![u32::MAX; size_bytes as usize], trim }
    }

    fn write(&mut self, index: u64, offset: u64, data: &[u8]) {
        let r = offset as usize..offset as usize + data.len();
        self.data[r.clone()].copy_from_slice(data);
        self.known[r.clone()].fill(true);
        self.origin[r].fill(index as u32);
    }

    fn zero(&mut self, index: u64, offset: u64, len: u32) {
        let r = offset as usize..(offset + u64::from(len)) as usize;
        self.data[r.clone()].fill(0);
        self.known[r.clone()].fill(true);
        self.origin[r].fill(index as u32);
    }

    fn trim(&mut self, index: u64, offset: u64, len: u32) {
        let end = offset + u64::from(len);
        match self.trim {
            TrimModel::WholeBlocksZeroed => {
                let first = offset.div_ceil(BLOCK_SIZE_BYTES) * BLOCK_SIZE_BYTES;
                let last = end / BLOCK_SIZE_BYTES * BLOCK_SIZE_BYTES;
                if first < last {
                    self.zero(index, first, (last - first) as u32);
                }
            }
            TrimModel::Unknown => self.known[offset as usize..end as usize].fill(false),
        }
    }

    fn forget(&mut self, offset: u64, len: u32) {
        let size = self.known.len() as u64;
        self.known[offset.min(size) as usize..(offset + u64::from(len)).min(size) as usize].fill(false);
    }

    /// `None` if `got` is what the range must read as; else what differs.
    fn check_read(&self, offset: u64, got: &[u8]) -> Option<String> {
        let base = offset as usize;
        let bad: Vec<usize> = (0..got.len()).filter(|&i| self.known[base + i] && self.data[base + i] != got[i]).collect();
        let &first = bad.first()?;
        let last = *bad.last().expect("not empty");
        let origin = match self.origin[base + first] {
            u32::MAX => "the seed's reset".to_owned(),
            index => format!("command #{index}"),
        };
        Some(format!(
            "{} bytes differ between volume offsets {} and {}; first at {}: expected {:#04x} (set by {origin}), got {:#04x} (expected {:02x?}, got {:02x?} from there)",
            bad.len(),
            base + first,
            base + last,
            base + first,
            self.data[base + first],
            got[first],
            &self.data[base + first..(base + first + 16).min(base + got.len())],
            &got[first..(first + 16).min(got.len())],
        ))
    }
}

/// The reply the protocol asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Error(u32),
    /// The protocol leaves the answer open: any error, or success.
    Any,
}

#[derive(Debug, Clone)]
enum Op {
    Read {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Zeroes {
        offset: u64,
        len: u32,
        fua: bool,
        no_hole: bool,
        /// `FAST_ZERO` (only where advertised, and without `no_hole`: that one may fail).
        fast: bool,
    },
    Flush,
    /// An invalid request (or one the protocol says nothing about); `what` names the case.
    Bad {
        what: &'static str,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        expect: Expect,
    },
}

impl Op {
    /// (kind, flags, offset, length) on the wire.
    fn wire(&self) -> (u16, u16, u64, u32) {
        let fua = |on: bool| if on { proto::CMD_FLAG_FUA } else { 0 };
        match *self {
            Op::Read { offset, len, fua: f } => (proto::CMD_READ, fua(f), offset, len),
            Op::Write { offset, len, fua: f } => (proto::CMD_WRITE, fua(f), offset, len),
            Op::Trim { offset, len, fua: f } => (proto::CMD_TRIM, fua(f), offset, len),
            Op::Zeroes { offset, len, fua: f, no_hole, fast } => {
                let flags = fua(f) | if no_hole { proto::CMD_FLAG_NO_HOLE } else { 0 } | if fast { proto::CMD_FLAG_FAST_ZERO } else { 0 };
                (proto::CMD_WRITE_ZEROES, flags, offset, len)
            }
            Op::Flush => (proto::CMD_FLUSH, 0, 0, 0),
            Op::Bad { kind, flags, offset, len, .. } => (kind, flags, offset, len),
        }
    }

    /// The byte range it reads or changes, and whether it changes it.
    fn range(&self) -> Option<(u64, u64, bool)> {
        match *self {
            Op::Read { offset, len, .. } => Some((offset, offset + u64::from(len), false)),
            Op::Write { offset, len, .. } | Op::Trim { offset, len, .. } | Op::Zeroes { offset, len, .. } => Some((offset, offset + u64::from(len), true)),
            Op::Flush | Op::Bad { .. } => None,
        }
    }
}

/// Where a failure happened, for its message.
struct At<'a> {
    server: &'a str,
    seed: u64,
    index: u64,
    conn: usize,
}

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: seed {}, command #{} on connection {} (replay: KURA_NBD_MODEL_SEED={})", self.server, self.seed, self.index, self.conn, self.seed)
    }
}

/// A request sent and not yet answered.
struct Pending {
    index: u64,
    op: Op,
    payload: Vec<u8>,
    /// The reply's error, once it came.
    error: u32,
}

/// One server under test, its connections, and the model of its volume.
struct Session<'a> {
    server: &'a str,
    conns: Vec<(RawClient, Export)>,
    /// A connection with structured replies and `base:allocation`, for block status.
    status: RawClient,
    model: Model,
    seed: u64,
    index: u64,
    handle: u64,
    /// The id the server gave `base:allocation`.
    context_id: u32,
    /// Error numbers of invalid requests: case → (expected, errors seen).
    errors: BTreeMap<&'static str, (Expect, BTreeSet<u32>)>,
    /// Whether an invalid request with another error than the protocol's fails the test
    /// (for kura) or is only reported (for the anchor, whose choices are not the protocol).
    strict_errors: bool,
}

impl<'a> Session<'a> {
    fn connect(server: &'a str, addr: &str, export_name: &str, trim: TrimModel, strict_errors: bool) -> Self {
        let conns: Vec<_> = (0..CONNECTIONS)
            .map(|i| {
                let mut c = RawClient::connect(addr);
                let export = c.go_export(export_name, i + 1 < CONNECTIONS);
                assert_eq!(export.size_bytes, VOLUME_SIZE_BYTES, "{server}: export size");
                (c, export)
            })
            .collect();
        let mut status = RawClient::connect(addr);
        status.structured_replies();
        status.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request(export_name, &[proto::CONTEXT_BASE_ALLOCATION]));
        let replies = status.option_replies(proto::OPT_SET_META_CONTEXT);
        assert!(replies.len() == 2 && replies[0].0 == proto::REP_META_CONTEXT, "{server}: base:allocation selected: {replies:?}");
        let context_id = u32::from_be_bytes(replies[0].1[..4].try_into().unwrap());
        status.go_export(export_name, true);
        Self { server, conns, status, context_id, model: Model::zeroed(VOLUME_SIZE_BYTES, trim), seed: 0, index: 0, handle: 0, errors: BTreeMap::new(), strict_errors }
    }

    fn at(&self, index: u64, conn: usize) -> At<'a> {
        At { server: self.server, seed: self.seed, index, conn }
    }

    fn run_seed(&mut self, seed: u64) {
        self.seed = seed;
        self.index = 0;
        let mut rng = Rng::seeded(seed);
        self.reset();
        for _ in 0..ROUNDS_PER_SEED {
            self.round(&mut rng);
        }
        self.verify_all(rng.below(CONNECTIONS as u64) as usize);
        self.verify_allocation();
    }

    /// Walks the volume with block status requests (each from where the last reply ended):
    /// the extents are consecutive and nonempty, and what they say reads as zeros does.
    fn verify_allocation(&mut self) {
        let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().unwrap());
        let mut offset = 0;
        let mut requests = 0;
        while offset < VOLUME_SIZE_BYTES {
            let len = (VOLUME_SIZE_BYTES - offset) as u32;
            self.status.request(proto::CMD_BLOCK_STATUS, 0, 1, offset, len, &[]);
            requests += 1;
            let mut extents = Vec::new();
            loop {
                let (flags, kind, handle, payload) = self.status.chunk();
                assert_eq!(handle, 1, "{}: seed {}: block status reply handle", self.server, self.seed);
                match kind {
                    proto::REPLY_TYPE_BLOCK_STATUS => {
                        assert_eq!(be32(&payload), self.context_id, "{}: seed {}: context id", self.server, self.seed);
                        extents.extend(payload[4..].chunks_exact(8).map(|d| (be32(d), be32(&d[4..]))));
                    }
                    proto::REPLY_TYPE_NONE => {}
                    other => panic!("{}: seed {}: block status at {offset}: chunk type {other:#x} ({payload:02x?})", self.server, self.seed),
                }
                if flags & proto::REPLY_FLAG_DONE != 0 {
                    break;
                }
            }
            assert!(!extents.is_empty(), "{}: seed {}: block status at {offset} described nothing", self.server, self.seed);
            let total: u64 = extents.iter().map(|&(l, _)| u64::from(l)).sum();
            assert!(total <= u64::from(len), "{}: seed {}: block status at {offset} described {total} bytes of {len}", self.server, self.seed);
            for (l, flags) in extents {
                assert!(l > 0, "{}: seed {}: an empty extent at {offset}", self.server, self.seed);
                if flags & proto::STATE_ZERO != 0 {
                    let zeros = vec![0u8; l as usize];
                    if let Some(diff) = self.model.check_read(offset, &zeros) {
                        panic!("{}: seed {}: block status says {l} bytes at {offset} read as zeros (flags {flags}), but {diff}", self.server, self.seed);
                    }
                }
                offset += u64::from(l);
            }
            assert!(requests < 1 << 16, "{}: seed {}: block status does not get through the volume", self.server, self.seed);
        }
        // Reads with structured replies: data and hole chunks that tile each range and read
        // as the model says.
        const READ_BYTES: u64 = 64 << 10;
        let mut offset = 0;
        while offset < VOLUME_SIZE_BYTES {
            self.status.request(proto::CMD_READ, 0, 2, offset, READ_BYTES as u32, &[]);
            let mut covered = 0;
            loop {
                let (flags, kind, handle, payload) = self.status.chunk();
                assert_eq!(handle, 2, "{}: seed {}: read reply handle", self.server, self.seed);
                if kind == proto::REPLY_TYPE_NONE {
                    assert_ne!(flags & proto::REPLY_FLAG_DONE, 0, "{}: seed {}: NONE is a last chunk", self.server, self.seed);
                    break;
                }
                let at = u64::from_be_bytes(payload[..8].try_into().unwrap());
                let bytes = match kind {
                    proto::REPLY_TYPE_OFFSET_DATA => payload[8..].to_vec(),
                    proto::REPLY_TYPE_OFFSET_HOLE => vec![0u8; be32(&payload[8..]) as usize],
                    other => panic!("{}: seed {}: read at {offset}: chunk type {other:#x}", self.server, self.seed),
                };
                assert!(at >= offset && at + bytes.len() as u64 <= offset + READ_BYTES, "{}: seed {}: chunk at {at} outside the read at {offset}", self.server, self.seed);
                if let Some(diff) = self.model.check_read(at, &bytes) {
                    panic!("{}: seed {}: structured read at {at} ({} chunk): {diff}", self.server, self.seed, if kind == proto::REPLY_TYPE_OFFSET_HOLE { "hole" } else { "data" });
                }
                covered += bytes.len() as u64;
                if flags & proto::REPLY_FLAG_DONE != 0 {
                    break;
                }
            }
            assert_eq!(covered, READ_BYTES, "{}: seed {}: the chunks of the read at {offset} cover it", self.server, self.seed);
            offset += READ_BYTES;
        }
    }

    /// Zeroes the whole volume (so every seed starts the same) and reads it back.
    fn reset(&mut self) {
        let export = self.conns[0].1;
        let chunk = effective_max(&export) / export.min_block_bytes * export.min_block_bytes;
        let mut batch = Vec::new();
        let mut offset = 0;
        while offset < VOLUME_SIZE_BYTES {
            let len = u64::from(chunk).min(VOLUME_SIZE_BYTES - offset) as u32;
            batch.push(Op::Zeroes { offset, len, fua: false, no_hole: false, fast: false });
            offset += u64::from(len);
        }
        batch.push(Op::Flush);
        let mut pending = HashMap::new();
        for op in batch {
            self.send(0, op, Vec::new(), &mut pending);
        }
        self.collect(0, pending, &mut Vec::new());
        self.model = Model::zeroed(VOLUME_SIZE_BYTES, self.model.trim);
        self.verify_all(0);
    }

    /// Reads the whole volume on `conn` (many reads in flight) and checks it.
    fn verify_all(&mut self, conn: usize) {
        let export = self.conns[conn].1;
        let chunk = u64::from(effective_max(&export) / export.min_block_bytes * export.min_block_bytes).min(256 << 10);
        let mut pending = HashMap::new();
        let mut offset = 0;
        while offset < VOLUME_SIZE_BYTES {
            let len = chunk.min(VOLUME_SIZE_BYTES - offset) as u32;
            self.send(conn, Op::Read { offset, len, fua: false }, Vec::new(), &mut pending);
            offset += u64::from(len);
        }
        self.collect(conn, pending, &mut Vec::new());
    }

    /// Several requests on two or three connections at once, then every reply.
    fn round(&mut self, rng: &mut Rng) {
        let mut busy: Vec<(u64, u64, bool)> = Vec::new();
        let mut pending: Vec<HashMap<u64, Pending>> = (0..CONNECTIONS).map(|_| HashMap::new()).collect();
        let first = rng.below(CONNECTIONS as u64) as usize;
        let conns: Vec<usize> = (0..CONNECTIONS).filter(|&c| c == first || rng.percent(60)).collect();
        for conn in conns {
            for _ in 0..1 + rng.below(REQUESTS_PER_ROUND_MAX as u64) {
                let export = self.conns[conn].1;
                let Some((op, payload)) = random_op(rng, &export, &busy) else { continue };
                if let Some(range) = op.range() {
                    busy.push(range);
                }
                self.send(conn, op, payload, &mut pending[conn]);
            }
        }
        let mut done = Vec::new();
        for (conn, p) in pending.into_iter().enumerate() {
            self.collect(conn, p, &mut done);
        }
        // Requests of a round touch disjoint ranges, so the order they change the model in
        // does not matter; reads were checked against the model before the round.
        for p in done {
            match p.op {
                Op::Write { offset, .. } => self.model.write(p.index, offset, &p.payload),
                Op::Zeroes { offset, len, .. } => self.model.zero(p.index, offset, len),
                Op::Trim { offset, len, .. } => self.model.trim(p.index, offset, len),
                // An invalid request the anchor carried out anyway: whatever it did.
                Op::Bad { kind: proto::CMD_WRITE | proto::CMD_TRIM | proto::CMD_WRITE_ZEROES, offset, len, .. } if p.error == 0 => self.model.forget(offset, len),
                _ => {}
            }
        }
    }

    fn send(&mut self, conn: usize, op: Op, payload: Vec<u8>, pending: &mut HashMap<u64, Pending>) {
        self.handle += 1;
        // The high half of the handle is not a counter: the server must echo all 64 bits.
        let handle = (self.handle << 32) | (self.handle.wrapping_mul(0x9e37_79b9) & 0xffff_ffff);
        let (kind, flags, offset, len) = op.wire();
        self.conns[conn].0.request(kind, flags, handle, offset, len, &payload);
        pending.insert(handle, Pending { index: self.index, op, payload, error: 0 });
        self.index += 1;
    }

    /// Reads the replies to everything pending on `conn` and checks each; successful
    /// changes go to `done` (the model is updated after the round).
    fn collect(&mut self, conn: usize, mut pending: HashMap<u64, Pending>, done: &mut Vec<Pending>) {
        while !pending.is_empty() {
            let (error, handle) = self.conns[conn].0.reply_header().unwrap_or_else(|e| {
                let waiting: Vec<String> = pending.values().map(|p| format!("#{} {:?}", p.index, p.op)).collect();
                panic!("{}: seed {}, connection {conn}: no reply ({e}; the server hung up or stalled) while waiting for {}", self.server, self.seed, waiting.join(", "))
            });
            let Some(p) = pending.remove(&handle) else {
                panic!("{}: seed {}, connection {conn}: a reply with handle {handle:#x}, which no request in flight has", self.server, self.seed)
            };
            let at = self.at(p.index, conn);
            let (kind, _, _, len) = p.op.wire();
            let data = if error == 0 && kind == proto::CMD_READ {
                self.conns[conn].0.read_data(len as usize).unwrap_or_else(|e| panic!("{at}: {:?}: reading the data: {e}", p.op))
            } else {
                Vec::new()
            };
            let expect = match p.op {
                Op::Bad { what, expect, .. } => {
                    self.errors.entry(what).or_insert_with(|| (expect, BTreeSet::new())).1.insert(error);
                    expect
                }
                _ => Expect::Error(0),
            };
            if let Expect::Error(want) = expect
                && error != want
                && (self.strict_errors || !matches!(p.op, Op::Bad { .. }))
            {
                panic!("{at}: {:?}: expected error {want}, got {error}", p.op);
            }
            if let (0, Op::Read { offset, .. }) = (error, &p.op)
                && let Some(diff) = self.model.check_read(*offset, &data)
            {
                panic!("{at}: {:?} read wrong data: {diff}", p.op);
            }
            done.push(Pending { error, ..p });
        }
    }
}

/// The largest length a request may have: the advertised maximum, or the export size if
/// that is smaller (the protocol's rule).
fn effective_max(export: &Export) -> u32 {
    u64::from(export.max_block_bytes).min(export.size_bytes) as u32
}

/// A random request whose range does not overlap what `busy` writes (nor, if it writes,
/// anything in `busy`); `None` if none was found quickly. Writes come with their payload.
fn random_op(rng: &mut Rng, export: &Export, busy: &[(u64, u64, bool)]) -> Option<(Op, Vec<u8>)> {
    if rng.percent(INVALID_PERCENT) {
        let (op, payload_bytes) = invalid_op(rng, export);
        return Some((op, rng.bytes(payload_bytes)));
    }
    if rng.percent(4) {
        return Some((Op::Flush, Vec::new()));
    }
    for _ in 0..8 {
        let (offset, len) = random_range(rng, export);
        let fua = rng.percent(15);
        let op = match rng.below(100) {
            0..40 => Op::Read { offset, len, fua: rng.percent(5) },
            40..80 => Op::Write { offset, len, fua },
            80..90 => Op::Trim { offset, len, fua },
            _ => {
                let no_hole = rng.percent(50);
                let fast = !no_hole && export.transmission_flags & proto::FLAG_SEND_FAST_ZERO != 0 && rng.percent(50);
                Op::Zeroes { offset, len, fua, no_hole, fast }
            }
        };
        let (start, end, writes) = op.range().expect("a ranged op");
        if busy.iter().any(|&(s, e, w)| (w || writes) && s < end && start < e) {
            continue;
        }
        let payload = if matches!(op, Op::Write { .. }) { rng.bytes(len as usize) } else { Vec::new() };
        return Some((op, payload));
    }
    None
}

/// A range at the export's minimum block size: mostly short ones (within a block or two),
/// some up to 64 KiB, some up to the maximum; sometimes block-aligned.
fn random_range(rng: &mut Rng, export: &Export) -> (u64, u32) {
    let align = u64::from(export.min_block_bytes);
    let max = u64::from(effective_max(export)) / align * align;
    let len_max = match rng.below(100) {
        0..50 => BLOCK_SIZE_BYTES + align,
        50..85 => 64 << 10,
        _ => max,
    }
    .min(max);
    let mut len = (1 + rng.below(len_max / align)) * align;
    if rng.percent(25) && len >= BLOCK_SIZE_BYTES {
        len = len / BLOCK_SIZE_BYTES * BLOCK_SIZE_BYTES;
    }
    let mut offset = rng.below((export.size_bytes - len) / align + 1) * align;
    if rng.percent(25) {
        offset = offset / BLOCK_SIZE_BYTES * BLOCK_SIZE_BYTES;
    }
    (offset, len as u32)
}

/// An invalid request with exactly one fault, and the error the protocol names for it; or a
/// request the protocol leaves open. Returns it with the bytes of payload a write carries.
fn invalid_op(rng: &mut Rng, export: &Export) -> (Op, usize) {
    let size = export.size_bytes;
    let align = u64::from(export.min_block_bytes);
    let max = effective_max(export);
    let bad =
        |what, kind, flags, offset, len: u64, expect| (Op::Bad { what, kind, flags, offset, len: len as u32, expect }, if kind == proto::CMD_WRITE { len as usize } else { 0 });
    let (einval, enospc) = (Expect::Error(proto::EINVAL), Expect::Error(proto::ENOSPC));
    // A short aligned length, and an aligned offset where it crosses the end (or starts at it).
    let len = align * (1 + rng.below(8));
    let across_end = size - align * rng.below(len / align);
    loop {
        return match rng.below(16) {
            0 => bad("read past the end", proto::CMD_READ, 0, across_end, len, einval),
            1 => bad("write past the end", proto::CMD_WRITE, 0, across_end, len, enospc),
            2 => bad("write zeroes past the end", proto::CMD_WRITE_ZEROES, 0, across_end, len, enospc),
            3 => bad("trim past the end", proto::CMD_TRIM, 0, across_end, len, einval),
            4 => {
                let (what, kind, expect) = rng.pick(&[
                    ("read far past the end", proto::CMD_READ, einval),
                    ("write far past the end", proto::CMD_WRITE, enospc),
                    ("trim far past the end", proto::CMD_TRIM, einval),
                    ("write zeroes far past the end", proto::CMD_WRITE_ZEROES, enospc),
                ]);
                bad(what, kind, 0, size + align * rng.below(1 << 40), len, expect)
            }
            5 if align > 1 => {
                let kind = rng.pick(&[proto::CMD_READ, proto::CMD_WRITE, proto::CMD_TRIM, proto::CMD_WRITE_ZEROES]);
                bad("offset not a multiple of the minimum block size", kind, 0, align * rng.below(64) + 1 + rng.below(align - 1), len, einval)
            }
            6 if align > 1 => {
                let kind = rng.pick(&[proto::CMD_READ, proto::CMD_WRITE, proto::CMD_TRIM, proto::CMD_WRITE_ZEROES]);
                bad("length not a multiple of the minimum block size", kind, 0, align * rng.below(64), len - 1 - rng.below(align - 1), einval)
            }
            7 if u64::from(max) < size => bad("read over the maximum block size", proto::CMD_READ, 0, 0, u64::from(max) + align, einval),
            8 if u64::from(max) < size => bad("write over the maximum block size", proto::CMD_WRITE, 0, 0, u64::from(max) + align, einval),
            9 => bad("unknown command", rng.pick(&[proto::CMD_BLOCK_STATUS, 8, 9, 42, 0x1234, 0xffff]), 0, 0, align, einval),
            10 => {
                let kind = rng.pick(&[proto::CMD_READ, proto::CMD_WRITE, proto::CMD_TRIM, proto::CMD_WRITE_ZEROES, proto::CMD_FLUSH]);
                let (offset, len) = if kind == proto::CMD_FLUSH { (0, 0) } else { (0, len) };
                bad("unknown command flag", kind, 1 << (5 + rng.below(11)), offset, len, einval)
            }
            11 => {
                let (what, kind, flag) = rng.pick(&[
                    ("NO_HOLE on a read", proto::CMD_READ, proto::CMD_FLAG_NO_HOLE),
                    ("NO_HOLE on a write", proto::CMD_WRITE, proto::CMD_FLAG_NO_HOLE),
                    ("NO_HOLE on a trim", proto::CMD_TRIM, proto::CMD_FLAG_NO_HOLE),
                ]);
                bad(what, kind, flag, 0, len, einval)
            }
            14 if export.transmission_flags & proto::FLAG_SEND_FAST_ZERO == 0 => bad("FAST_ZERO, not advertised", proto::CMD_WRITE_ZEROES, proto::CMD_FLAG_FAST_ZERO, 0, len, einval),
            15 if export.transmission_flags & FLAG_SEND_CACHE == 0 => bad("CACHE, not advertised (unspecified)", CMD_CACHE, 0, 0, len, Expect::Any),
            12 => {
                let kind = rng.pick(&[proto::CMD_READ, proto::CMD_WRITE, proto::CMD_TRIM, proto::CMD_WRITE_ZEROES]);
                bad("zero length (unspecified)", kind, 0, align * rng.below(size / align), 0, Expect::Any)
            }
            13 => {
                let (what, kind, flags, offset, len) = rng.pick(&[
                    ("DF without structured replies (unspecified)", proto::CMD_READ, CMD_FLAG_DF, 0, len),
                    ("FLUSH with an offset and length (unspecified)", proto::CMD_FLUSH, 0, align, len),
                ]);
                bad(what, kind, flags, offset, len, Expect::Any)
            }
            _ => continue,
        };
    }
}

/// Runs the seeds against one server; returns the error numbers its invalid requests got.
fn run_server(server: &str, addr: &str, export_name: &str, trim: TrimModel, strict_errors: bool) -> BTreeMap<&'static str, (Expect, BTreeSet<u32>)> {
    let started = Instant::now();
    let mut session = Session::connect(server, addr, export_name, trim, strict_errors);
    let seeds: Vec<u64> = match std::env::var("KURA_NBD_MODEL_SEED") {
        Ok(s) => vec![s.parse().expect("KURA_NBD_MODEL_SEED: a number")],
        Err(_) => (0..SEEDS).collect(),
    };
    for &seed in &seeds {
        session.run_seed(seed);
    }
    eprintln!("{server}: {} seeds, {} commands in {:?}", seeds.len(), session.handle, started.elapsed());
    session.errors
}

/// `qemu-nbd` serving a raw file of the volume's size, several clients at once.
fn start_qemu_nbd(dir: &Path) -> (ChildGuard, String) {
    let bin = require_cmd("qemu-nbd").expect("qemu-nbd");
    let file = dir.join("qemu.raw");
    std::fs::File::create(&file).and_then(|f| f.set_len(VOLUME_SIZE_BYTES)).expect("create the raw file");
    let (child, port) = kura_testkit::spawn_listening("qemu-nbd", START_TIMEOUT, |port| {
        let mut cmd = Command::new(&bin);
        cmd.args(["-f", "raw", "-x", "m", "-t", "-e", "8", "-b", "127.0.0.1", "-p", &port.to_string()]).arg(&file);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        cmd
    })
    .expect("start qemu-nbd");
    (child, format!("127.0.0.1:{port}"))
}

/// The model test on kura over the embedded engine and over a kura server, and the same
/// sequences on qemu-nbd: data as the model says, errors as the protocol says.
#[test]
fn random_commands_match_the_model_and_the_protocol() {
    let mut kura_errors = BTreeMap::new();
    for backend in [Backend::embedded(), Backend::kura()] {
        backend.create_volume("m", VOLUME_SIZE);
        let nbd = NbdProcess::start(&backend.url(), &["--max-request", MAX_REQUEST]);
        let name = format!("kura on {}", backend.name());
        for (what, (expect, seen)) in run_server(&name, &nbd.addr, "m", TrimModel::WholeBlocksZeroed, true) {
            kura_errors.entry(what).or_insert_with(|| (expect, BTreeSet::new())).1.extend(seen);
        }
    }
    if let Err(reason) = require_cmd("qemu-nbd") {
        kura_testkit::skip(&format!("no qemu-nbd anchor: {reason}"));
        return;
    }
    let dir = tempfile::tempdir_in(scratch_dir()).expect("tempdir");
    let (_qemu, addr) = start_qemu_nbd(dir.path());
    let qemu_errors = run_server("qemu-nbd", &addr, "m", TrimModel::Unknown, false);
    // Both servers were held to the protocol above; this shows the cases side by side.
    eprintln!("{:<50} {:<12} {:<12} qemu-nbd", "invalid request", "protocol", "kura");
    for (what, (expect, kura)) in &kura_errors {
        let qemu = qemu_errors.get(what).map_or("(not sent)".to_owned(), |(_, s)| format!("{s:?}"));
        eprintln!("{what:<50} {:<12} {:<12} {qemu}", format!("{expect:?}"), format!("{kura:?}"));
    }
}
