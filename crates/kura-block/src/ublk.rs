//! The ublk frontend: a volume as `/dev/ublkbN` through the kernel's ublk driver (Linux ≥ 6.0,
//! `/dev/ublk-control`), with `libublk`.
//!
//! This is paper 000's design as it exists upstream today: the kernel's multi-queue block
//! layer hands requests to user space through one io_uring per hardware queue; each queue has
//! its own thread (pinned near the CPUs the kernel maps to it), and each thread its own pool
//! context and [`BlockQueue`] — nothing is shared between queues on the request path but the
//! per-volume block locks. A queue thread takes every request the ring has delivered, turns
//! them into pool requests submitted together, and commits the finished ones (their
//! commit-and-fetch commands leave together at the next ring submission). While pool requests
//! are in flight it waits on the pool and looks at the ring again after each batch of
//! completions; when none are, it sleeps in the ring.
//!
//! The device has a volatile write cache and FUA (`FLUSH` → the pool's barrier, `FUA` → the
//! write is durable before it completes), discard and write-zeroes (blocks deleted).
//!
//! **Surviving the death of this process** ([`UblkConfig::recoverable`]): on a pool of servers
//! (whatever a request completed is on a server, which outlives this process) the device is
//! added with the driver's user recovery and reissue (`UBLK_F_USER_RECOVERY |
//! UBLK_F_USER_RECOVERY_REISSUE`): when this process dies — killed, crashed, or stopped for an
//! upgrade — `/dev/ublkbN` stays, its requests wait in the kernel (file systems on it see no
//! error), and a new `kura block ublk --recover N` takes it over ([`UblkConfig::recover`]):
//! requests this process had been given and not completed are given again (block writes are
//! idempotent), then the rest. On the embedded engine a completed write may still be in the
//! dying process's write buffer, waiting for the next flush; the file system above would
//! carry on as if the device had kept it, so there the device is not recoverable and goes
//! away with the process, as before.

use std::sync::Arc;

use libublk::ctrl::UblkCtrl;
use libublk::io::{UblkDev, UblkIOCtx, UblkQueue};
use libublk::{BufDesc, BufDescList, UblkError, UblkFlags, UblkIORes, UblkUringData, sys};
use kura_pool::Pool;

use crate::error::{BlockError, Result};
use crate::layout::{BLOCK_SIZE_BYTES, SECTOR_SHIFT};
use crate::queue::{BlockQueue, ReadBuf, Volume};

pub const QUEUE_DEPTH_DEFAULT: u16 = 128;
pub const QUEUE_DEPTH_MAX: u16 = 4096;
pub const QUEUES_MAX: u16 = 64;
/// Largest request, and the size of each tag's buffer.
pub const IO_BUF_BYTES_DEFAULT: u32 = 512 << 10;
pub const IO_BUF_BYTES_MAX: u32 = 4 << 20;
/// Largest discard / write-zeroes request the kernel sends (in sectors).
const DISCARD_SECTORS_MAX: u32 = (1 << 30) >> SECTOR_SHIFT;

/// How to set up the device.
#[derive(Debug, Clone)]
pub struct UblkConfig {
    /// Hardware queues, each served by its own thread; default: one per CPU.
    pub queues: u16,
    pub depth: u16,
    pub io_buf_bytes: u32,
    /// Pool operations each queue keeps in flight, at most.
    pub window: usize,
    /// Device id to ask for (`/dev/ublkbN`); `-1`: the driver picks.
    pub id: i32,
    /// Add the device so that it outlives this process (see the module documentation); for
    /// pools whose servers keep what a request completed.
    pub recoverable: bool,
    /// Take over device [`UblkConfig::id`], left waiting by a kura process that died: its
    /// queues, depth and buffer size are the device's own (the fields here are ignored).
    pub recover: bool,
}

impl Default for UblkConfig {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u16;
        Self { queues: cpus.clamp(1, QUEUES_MAX), depth: QUEUE_DEPTH_DEFAULT, io_buf_bytes: IO_BUF_BYTES_DEFAULT, window: crate::queue::WINDOW_MAX, id: -1, recoverable: false, recover: false }
    }
}

/// The driver's user recovery, with the requests the dead process had been given reissued to
/// the next one (not failed): writes of whole blocks to the pool are idempotent.
const RECOVERY_FLAGS: u64 = (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;

fn ublk_error(what: &str, e: UblkError) -> BlockError {
    BlockError::Io(std::io::Error::other(format!("ublk: {what}: {e}")))
}

/// The size of existing device `id` (to check that a recovery serves the volume it served).
pub fn device_size_bytes(id: i32) -> Result<u64> {
    let ctrl = UblkCtrl::new_simple(id).map_err(|e| ublk_error(&format!("opening device {id}"), e))?;
    let mut params = sys::ublk_params::default();
    ctrl.get_params(&mut params).map_err(|e| ublk_error(&format!("reading device {id}'s parameters"), e))?;
    Ok(params.basic.dev_sectors << SECTOR_SHIFT)
}

/// Deletes device `id`, left waiting by a `kura block ublk` that died and will not be
/// recovered: the requests waiting in it fail (`EIO`) and `/dev/ublkbN` goes away. A live
/// device is refused: its process stops and deletes it on SIGTERM.
pub fn delete_waiting_device(id: i32) -> Result<()> {
    let ctrl = UblkCtrl::new_simple(id).map_err(|e| ublk_error(&format!("opening device {id}"), e))?;
    if ctrl.dev_info().state == sys::UBLK_S_DEV_LIVE as u16 {
        return Err(BlockError::Invalid(format!("ublk device {id} is live: stop its kura block ublk (SIGTERM), which deletes it")));
    }
    ctrl.kill_dev().map_err(|e| ublk_error(&format!("stopping device {id}"), e))?;
    delete_device(&ctrl);
    Ok(())
}

/// Whether this machine's kernel can host ublk devices.
pub fn available() -> bool {
    std::path::Path::new("/dev/ublk-control").exists()
}

/// An added ublk device; [`UblkDevice::run`] serves it until [`UblkStopper::stop`].
pub struct UblkDevice {
    ctrl: UblkCtrl,
    config: UblkConfig,
}

/// Stops a running device from another thread (a signal handler's thread, or a queue thread
/// that failed).
///
/// libublk keeps its control ring per thread and panics on a thread that has none, so the
/// device's own `UblkCtrl` cannot be used here: a fresh control handle for the same device id
/// (which opens `/dev/ublk-control` and sets up this thread's ring) sends `STOP_DEV`. The
/// driver then aborts the queues' fetch commands, every queue thread returns, and
/// [`UblkDevice::run`] deletes the device.
#[derive(Clone, Debug)]
pub struct UblkStopper {
    dev_id: u32,
}

impl UblkStopper {
    pub fn stop(&self) {
        let stopped = UblkCtrl::new_simple(self.dev_id as i32).and_then(|ctrl| ctrl.kill_dev());
        match stopped {
            Ok(_) => tracing::debug!(dev_id = self.dev_id, "ublk: device stopping"),
            Err(e) => tracing::warn!(dev_id = self.dev_id, error = %e, "ublk: stopping the device failed"),
        }
    }
}

impl UblkDevice {
    /// Adds a device (not yet started: no `/dev/ublkbN` until [`UblkDevice::run`]), or, with
    /// [`UblkConfig::recover`], begins taking over a device left waiting.
    pub fn add(config: UblkConfig) -> Result<Self> {
        if config.recover {
            return Self::begin_recovery(config);
        }
        if !(1..=QUEUES_MAX).contains(&config.queues) || !(1..=QUEUE_DEPTH_MAX).contains(&config.depth) {
            return Err(BlockError::Invalid(format!("queues must be 1..={QUEUES_MAX} and depth 1..={QUEUE_DEPTH_MAX}")));
        }
        if !(BLOCK_SIZE_BYTES as u32..=IO_BUF_BYTES_MAX).contains(&config.io_buf_bytes) || !config.io_buf_bytes.is_multiple_of(BLOCK_SIZE_BYTES as u32) {
            return Err(BlockError::Invalid(format!("the I/O buffer must be a multiple of 4096 bytes up to {IO_BUF_BYTES_MAX}")));
        }
        Self::open(config, UblkFlags::UBLK_DEV_F_ADD_DEV, "adding the device")
    }

    /// The device's control handle, as `config` describes it (user recovery if
    /// [`UblkConfig::recoverable`]): added, or opened for recovery, per `dev_flags`.
    fn open(config: UblkConfig, dev_flags: UblkFlags, what: &str) -> Result<Self> {
        let ctrl = libublk::ctrl::UblkCtrlBuilder::default()
            .name("kura")
            .id(config.id)
            .nr_queues(config.queues)
            .depth(config.depth)
            .io_buf_bytes(config.io_buf_bytes)
            .ctrl_flags(if config.recoverable { RECOVERY_FLAGS } else { 0 })
            .dev_flags(dev_flags)
            .build()
            .map_err(|e| ublk_error(what, e))?;
        Ok(Self { ctrl, config })
    }

    /// [`UblkDevice::add`] for [`UblkConfig::recover`]: checks that device `id` is one of
    /// kura's recoverable devices waiting for a server (`QUIESCED`), starts the driver's user
    /// recovery (it waits until the dead process has let go of `/dev/ublkcN`), and opens the
    /// device with its own queues, depth and buffer size.
    fn begin_recovery(mut config: UblkConfig) -> Result<Self> {
        let id = config.id;
        if id < 0 {
            return Err(BlockError::Invalid("recovering a ublk device needs its id".into()));
        }
        let old = UblkCtrl::new_simple(id).map_err(|e| ublk_error(&format!("opening device {id}"), e))?;
        let info = old.dev_info();
        if info.flags & RECOVERY_FLAGS != RECOVERY_FLAGS {
            return Err(BlockError::Invalid(format!("ublk device {id} was not added recoverable (its flags: {:#x})", info.flags)));
        }
        if info.state == sys::UBLK_S_DEV_LIVE as u16 {
            return Err(BlockError::Invalid(format!("ublk device {id} is live: another process serves it")));
        }
        tracing::info!(dev_id = id, state = info.state, "ublk: recovering the device");
        old.start_user_recover().map_err(|e| ublk_error(&format!("starting the recovery of device {id}"), e))?;
        config.queues = info.nr_hw_queues;
        config.depth = info.queue_depth;
        config.io_buf_bytes = info.max_io_buf_bytes;
        config.recoverable = true;
        Self::open(config, UblkFlags::UBLK_DEV_F_RECOVER_DEV, &format!("recovering device {id}"))
    }

    pub fn stopper(&self) -> UblkStopper {
        UblkStopper { dev_id: self.ctrl.dev_info().dev_id }
    }

    /// The block device's path (`/dev/ublkbN`).
    pub fn bdev_path(&self) -> String {
        self.ctrl.get_bdev_path()
    }

    /// Starts the device on `volume` and serves it until it is stopped; `on_started` is
    /// called with the block device's path once it exists. Deletes the device at the end.
    pub fn run(self, pool: Pool, volume: Arc<Volume>, on_started: impl FnOnce(&str) + Send + Sync + 'static) -> Result<()> {
        let size_bytes = volume.meta.size_bytes;
        let window = self.config.window;
        let init = move |dev: &mut UblkDev| {
            dev.set_default_params(size_bytes);
            let params = &mut dev.tgt.params;
            params.types |= sys::UBLK_PARAM_TYPE_DISCARD;
            params.basic.attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
            params.basic.physical_bs_shift = BLOCK_SIZE_BYTES.trailing_zeros() as u8;
            params.basic.io_min_shift = BLOCK_SIZE_BYTES.trailing_zeros() as u8;
            params.basic.io_opt_shift = BLOCK_SIZE_BYTES.trailing_zeros() as u8;
            params.discard = sys::ublk_param_discard {
                discard_alignment: 0,
                discard_granularity: BLOCK_SIZE_BYTES as u32,
                max_discard_sectors: DISCARD_SECTORS_MAX,
                max_write_zeroes_sectors: DISCARD_SECTORS_MAX,
                max_discard_segments: 1,
                reserved0: 0,
            };
            Ok(())
        };
        let stopper = self.stopper();
        let queue_fn = move |qid: u16, dev: &UblkDev| {
            if let Err(e) = serve_queue(qid, dev, &pool, &volume, window) {
                // The other queues and the kernel would wait for this one forever.
                tracing::error!(qid, error = %e, "ublk: queue stopped with an error; stopping the device");
                stopper.stop();
            }
        };
        let started = move |ctrl: &UblkCtrl| on_started(&ctrl.get_bdev_path());
        let result = self.ctrl.run_target(init, queue_fn, started).map_err(|e| ublk_error("serving", e));
        delete_device(&self.ctrl);
        result.map(|_| ())
    }
}

/// Deletes a stopped device without waiting for its last user: a plain `DEL_DEV` waits until
/// nothing holds `/dev/ublkbN` open, so a file system still mounted on it (already failing its
/// I/O once the device stopped) would keep kura from exiting until it is unmounted.
/// `DEL_DEV_ASYNC` (Linux 6.10) returns at once and the kernel frees the device when the last
/// user lets go; older kernels get the waiting `DEL_DEV`.
fn delete_device(ctrl: &UblkCtrl) {
    let dev_id = ctrl.dev_info().dev_id;
    match ctrl.del_dev_async() {
        Ok(_) => tracing::debug!(dev_id, "ublk: device deleted"),
        Err(e) => {
            tracing::debug!(dev_id, error = %e, "ublk: DEL_DEV_ASYNC refused; deleting and waiting for the device's users");
            if let Err(e) = ctrl.del_dev() {
                tracing::warn!(dev_id, error = %e, "ublk: deleting the device failed");
            }
        }
    }
}

/// A tag's I/O buffer, as the read target of a request.
struct TagBuf {
    ptr: *mut u8,
    len: usize,
}

impl ReadBuf for TagBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr+len` lies inside the tag's `IoBuf`, which outlives the queue's
        // `BlockQueue` (declared after it in `serve_queue`, so dropped first). While the
        // request is in flight the tag belongs to us: the kernel neither reads nor writes
        // the buffer until we commit the tag, and no other request uses it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One queue's thread: see the module documentation.
fn serve_queue(qid: u16, dev: &UblkDev, pool: &Pool, volume: &Arc<Volume>, window: usize) -> Result<()> {
    let bufs = dev.alloc_queue_io_bufs();
    let mut engine: BlockQueue<TagBuf> = BlockQueue::new(pool.context().map_err(BlockError::from_pool)?, window);
    let queue = UblkQueue::new(qid, dev)
        .map_err(|e| ublk_error("queue", e))?
        .submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs)))
        .map_err(|e| ublk_error("fetching commands", e))?;
    let mut incoming: Vec<u16> = Vec::with_capacity(usize::from(dev.dev_info.queue_depth));
    let mut finished: Vec<(u16, i32)> = Vec::new();
    let mut counts = OpCounts::default();
    let result = serve_loop(&queue, &bufs, &mut engine, volume, &mut incoming, &mut finished, &mut counts);
    tracing::info!(
        qid,
        reads = counts.reads,
        writes = counts.writes,
        fua_writes = counts.fua_writes,
        flushes = counts.flushes,
        discards = counts.discards,
        write_zeroes = counts.write_zeroes,
        failed = counts.failed,
        "ublk: queue done"
    );
    result
}

/// Requests one queue received, by kind (logged when the queue ends: the tests read them to
/// see that the kernel sends flushes, FUA writes, discards and write-zeroes).
#[derive(Debug, Default)]
struct OpCounts {
    reads: u64,
    writes: u64,
    fua_writes: u64,
    flushes: u64,
    discards: u64,
    write_zeroes: u64,
    failed: u64,
}

impl OpCounts {
    fn count(&mut self, op: u32, fua: bool) {
        match op {
            sys::UBLK_IO_OP_READ => self.reads += 1,
            sys::UBLK_IO_OP_WRITE if fua => self.fua_writes += 1,
            sys::UBLK_IO_OP_WRITE => self.writes += 1,
            sys::UBLK_IO_OP_FLUSH => self.flushes += 1,
            sys::UBLK_IO_OP_DISCARD => self.discards += 1,
            sys::UBLK_IO_OP_WRITE_ZEROES => self.write_zeroes += 1,
            _ => {}
        }
    }
}

/// The queue's event loop, until the driver aborts the queue's commands (device stopped).
fn serve_loop(
    queue: &UblkQueue<'_>,
    bufs: &[libublk::helpers::IoBuf<u8>],
    engine: &mut BlockQueue<TagBuf>,
    volume: &Arc<Volume>,
    incoming: &mut Vec<u16>,
    finished: &mut Vec<(u16, i32)>,
    counts: &mut OpCounts,
) -> Result<()> {
    loop {
        // Sleep in the ring only when nothing is in flight in the pool.
        let to_wait = usize::from(engine.is_idle());
        let reaped = queue.flush_and_wake_io_tasks(
            |user_data, cqe, _last| {
                let is_command = user_data & UblkUringData::Target as u64 == 0;
                if is_command && cqe.result() == sys::UBLK_IO_RES_OK as i32 {
                    incoming.push(UblkIOCtx::user_data_to_tag(user_data) as u16);
                }
            },
            to_wait,
        );
        match reaped {
            Ok(_) => {}
            Err(UblkError::QueueIsDown) => return Ok(()),
            Err(e) => return Err(ublk_error("waiting for requests", e)),
        }
        for tag in incoming.drain(..) {
            start(queue, &bufs[usize::from(tag)], engine, volume, tag, finished, counts);
        }
        if !engine.is_idle() {
            engine.poll(None, &mut |done| {
                let tag = done.tag as u16;
                let result = match done.result {
                    Ok(()) => committed_bytes(queue, tag),
                    Err(e) => {
                        tracing::debug!(tag, error = %e, "ublk: request failed");
                        -e.errno()
                    }
                };
                finished.push((tag, result));
            })?;
        }
        for (tag, result) in finished.drain(..) {
            if result < 0 {
                counts.failed += 1;
            }
            queue
                .complete_io_cmd_unified(tag, BufDesc::Slice(bufs[usize::from(tag)].as_slice()), Ok(UblkIORes::Result(result)))
                .map_err(|e| ublk_error("completing a request", e))?;
        }
    }
}

/// What a successful request reports: its bytes for reads and writes, 0 otherwise.
fn committed_bytes(queue: &UblkQueue<'_>, tag: u16) -> i32 {
    let iod = queue.get_iod(tag);
    match iod.op_flags & 0xff {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => (iod.nr_sectors << SECTOR_SHIFT) as i32,
        _ => 0,
    }
}

/// Turns one ublk request into pool requests; a request that cannot start is finished at
/// once with its error.
fn start(
    queue: &UblkQueue<'_>,
    buf: &libublk::helpers::IoBuf<u8>,
    engine: &mut BlockQueue<TagBuf>,
    volume: &Arc<Volume>,
    tag: u16,
    finished: &mut Vec<(u16, i32)>,
    counts: &mut OpCounts,
) {
    let iod = queue.get_iod(tag);
    let op = iod.op_flags & 0xff;
    let fua = iod.op_flags & sys::UBLK_IO_F_FUA != 0;
    counts.count(op, fua);
    let offset = iod.start_sector << SECTOR_SHIFT;
    let len = u64::from(iod.nr_sectors) << SECTOR_SHIFT;
    let t = u64::from(tag);
    let submitted = match op {
        sys::UBLK_IO_OP_READ if len as usize <= buf.len() => engine.submit_read(t, volume, offset, len, TagBuf { ptr: buf.as_mut_ptr(), len: len as usize }),
        sys::UBLK_IO_OP_WRITE if len as usize <= buf.len() => engine.submit_write(t, volume, offset, &buf.as_slice()[..len as usize], fua),
        sys::UBLK_IO_OP_FLUSH => engine.submit_flush(t, volume),
        sys::UBLK_IO_OP_DISCARD => engine.submit_discard(t, volume, offset, len, fua),
        sys::UBLK_IO_OP_WRITE_ZEROES => engine.submit_write_zeroes(t, volume, offset, len, fua, iod.op_flags & sys::UBLK_IO_F_NOUNMAP != 0),
        _ => {
            finished.push((tag, -libc::EOPNOTSUPP));
            return;
        }
    };
    if let Err(e) = submitted {
        finished.push((tag, -e.errno()));
    }
}
