//! The user-level page cache and the data path (paper 004, 3.1.3 and 3.2).
//!
//! Pages are chunk-sized and belong to a per-process [`Node`] (one per inode). A buffered
//! write is a copy into the page under the node's lock plus counters — no system call, no
//! pool request — and returns. A background write-back worker (its own pool context, every
//! chunk of a pass in flight at once) writes dirty pages back when the dirty share passes the
//! threshold, every `writeback_interval_ms`, and on demand. When the cache is at its memory
//! limit, writers evict clean pages (oldest first) and, when every page is dirty, wait for the
//! worker. `O_DIRECT` reads and writes go to the pool (after writing back dirty pages they
//! overlap, so the cache never hides data from them); `O_SYNC`/`O_DSYNC` writes go through the
//! cache and then write the file back and flush the pool before returning; `fsync` writes back
//! everything written to the file before it and flushes the pool (a barrier).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::error::{FsError, Result};
use crate::layout::{FILE_SIZE_BYTES_MAX, Inode, file_type};
use crate::ns::now_ns;
use crate::sync::{Condvar, Mutex, MutexGuard};
use crate::{Fs, FsConfig};

/// Dirty pages one write-back request carries, at most (bounds the copies held at once).
const WRITEBACK_BATCH_PAGES: usize = 1024;
/// Dirty pages copied per hold of a node's lock during write-back.
const WRITEBACK_COPY_PAGES: usize = 16;
/// How long a writer waits for room before looking again.
const ROOM_WAIT_MS: u64 = 10;
/// Evictions tried per page that must be freed before a writer waits.
const EVICT_SCAN_MAX: usize = 4096;
/// A read at the end of a file open here looks whether another process made it longer, at
/// most this often (`tail -f` of another process's log; NFS's attribute cache does the same).
const EOF_REVALIDATE_INTERVAL_MS: u64 = 100;
/// Files up to this size opened to be read have their first chunk read in the round trip of
/// the swap that records the opener ([`Fs::open_node_reading`]): a small file's open and first
/// read cost one round trip, not two.
pub const OPEN_READ_BYTES_MAX: u64 = 64 << 10;
/// Files this process closed but stays recorded in as an opener, at most (see
/// [`Fs::release`]): the close that would pass it leaves them all, in one batch.
pub const LINGERING_MAX: usize = 1024;

/// How a write reaches the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Into the cache; written back later.
    Buffered,
    /// Through the cache, then written back and flushed before returning (`O_SYNC`, `O_DSYNC`).
    Sync,
    /// Around the cache, straight to the pool (`O_DIRECT`).
    Direct,
    /// Around the cache, then flushed (`O_DIRECT | O_SYNC`).
    DirectSync,
}

/// Chunks one `SEEK_DATA`/`SEEK_HOLE` probes per pool round trip.
const SEEK_BATCH_CHUNKS: u64 = 64;

struct Page {
    data: Box<[u8]>,
    /// Mirrors membership in [`PageMap::dirty`], so that writing to a page already dirty
    /// (the common case) costs no set lookup.
    dirty: bool,
    /// Being written back: not evictable until the pool has it.
    in_flight: bool,
}

/// Pages of one file below this index live in a vector (a lookup is one load, which the
/// write path feels); pages past it (sparse files) in an ordered map.
const DENSE_PAGES_MAX: u64 = 1 << 16;

/// One file's cached pages by index, and which of them are dirty.
#[derive(Default)]
struct PageMap {
    /// Pages `0..DENSE_PAGES_MAX`, as far as any was cached.
    dense: Vec<Option<Page>>,
    /// Pages from `DENSE_PAGES_MAX` on.
    sparse: BTreeMap<u64, Page>,
    /// Indexes of the dirty pages (each one a page present above). Write-back finds them
    /// here instead of scanning every cached page: an `O_SYNC` write to a large cached file
    /// would otherwise pay for the whole file.
    dirty: BTreeSet<u64>,
}

impl PageMap {
    #[inline]
    fn get(&self, index: u64) -> Option<&Page> {
        if index < DENSE_PAGES_MAX { self.dense.get(index as usize)?.as_ref() } else { self.sparse.get(&index) }
    }

    #[inline]
    fn get_mut(&mut self, index: u64) -> Option<&mut Page> {
        if index < DENSE_PAGES_MAX { self.dense.get_mut(index as usize)?.as_mut() } else { self.sparse.get_mut(&index) }
    }

    #[inline]
    fn contains(&self, index: u64) -> bool {
        self.get(index).is_some()
    }

    fn insert(&mut self, index: u64, page: Page) {
        if page.dirty {
            self.dirty.insert(index);
        } else {
            self.dirty.remove(&index);
        }
        if index < DENSE_PAGES_MAX {
            let i = index as usize;
            if self.dense.len() <= i {
                self.dense.resize_with(i + 1, || None);
            }
            self.dense[i] = Some(page);
        } else {
            self.sparse.insert(index, page);
        }
    }

    fn remove(&mut self, index: u64) -> Option<Page> {
        let page = if index < DENSE_PAGES_MAX { self.dense.get_mut(index as usize)?.take() } else { self.sparse.remove(&index) }?;
        if page.dirty {
            self.dirty.remove(&index);
        }
        Some(page)
    }

    #[inline]
    fn is_dirty(&self, index: u64) -> bool {
        self.get(index).is_some_and(|page| page.dirty)
    }

    /// Marks the page at `index` (which must be cached) dirty; `true` when it was clean.
    #[inline]
    fn set_dirty(&mut self, index: u64) -> bool {
        let Some(page) = self.get_mut(index) else {
            debug_assert!(false, "dirty page {index} not cached");
            return false;
        };
        if page.dirty {
            return false;
        }
        page.dirty = true;
        self.dirty.insert(index)
    }

    /// Marks the page at `index` clean; `true` when it was dirty.
    #[inline]
    fn set_clean(&mut self, index: u64) -> bool {
        match self.get_mut(index) {
            Some(page) if page.dirty => {
                page.dirty = false;
                self.dirty.remove(&index)
            }
            _ => false,
        }
    }

    /// The dirty pages' indexes at or after `from`, in order.
    fn dirty_from(&self, from: u64) -> impl Iterator<Item = u64> + '_ {
        self.dirty.range(from..).copied()
    }

    /// Removes the pages at or after `from` and returns them, in index order, with how many
    /// of them were dirty.
    fn split_off(&mut self, from: u64) -> (Vec<Page>, usize) {
        let dirty = self.dirty.split_off(&from).len();
        let mut gone = Vec::new();
        if from < self.dense.len() as u64 {
            gone.extend(self.dense.drain(from as usize..).flatten());
            if self.dense.iter().all(Option::is_none) {
                self.dense = Vec::new();
            }
        }
        gone.extend(self.sparse.split_off(&from.max(DENSE_PAGES_MAX)).into_values());
        (gone, dirty)
    }

    /// Every page, in index order.
    fn iter(&self) -> impl Iterator<Item = (u64, &Page)> {
        let dense = self.dense.iter().enumerate().filter_map(|(i, p)| Some((i as u64, p.as_ref()?)));
        dense.chain(self.sparse.iter().map(|(&i, p)| (i, p)))
    }

}

/// One inode as this process caches it.
pub struct Node {
    pub ino: u64,
    inner: Mutex<NodeInner>,
    /// One write-back (or truncate) of this node at a time, so `fsync` waits for the
    /// background worker's pass that took pages before it. It counts this process's changes
    /// of the node's record: [`Fs::after_lock`] reads records before it takes this lock, and
    /// one read before a change of ours is older than what we cache.
    wb_lock: Mutex<u64>,
    /// Another process may have changed the file since this process last looked (set after
    /// `fork`: parent and child share descriptors, not caches): reload before the next use.
    stale: AtomicBool,
    /// Whether this process is recorded in the inode's openers; held while the count of opens
    /// crosses zero and the record changes, so a close and an open never reorder them.
    pub(crate) registered: Mutex<bool>,
    /// Open here when this process forked (or inherited open from its parent): another
    /// process may read and write it through the same descriptions (see [`Fs::shared_io`]).
    /// Until the last close here, its data is not cached.
    shared: AtomicBool,
    /// This process's threads take turns at a shared node's I/O (the host-wide lock is a
    /// POSIX record lock, which all threads of a process hold together).
    shared_turn: Mutex<()>,
}

/// Held across one read or write of a shared node (see [`Fs::shared_io`]).
pub struct SharedIoGuard<'a> {
    _turn: MutexGuard<'a, ()>,
    _host: HostLock,
}

/// This process's turn at one inode among the processes of the host: a POSIX record lock on
/// byte `ino` of the shared-file lock (none when there is no lock file).
struct HostLock {
    locked: Option<(i32, u64)>,
}

impl Drop for HostLock {
    fn drop(&mut self) {
        if let Some((fd, ino)) = self.locked {
            let _ = record_lock(fd, ino, libc::F_UNLCK);
        }
    }
}

/// Takes (`F_WRLCK`, `F_RDLCK`) or drops (`F_UNLCK`) this process's POSIX lock on byte `byte`
/// of `fd` (an inode number here; the preload's shared-mapping files use it too), waiting for
/// other processes' (signals interrupting the wait are waited through).
pub fn record_lock(fd: i32, byte: u64, kind: libc::c_int) -> std::io::Result<()> {
    let mut fl = libc::flock { l_type: kind as i16, l_whence: libc::SEEK_SET as i16, l_start: (byte & (i64::MAX as u64)) as i64, l_len: 1, l_pid: 0 };
    loop {
        // SAFETY: `fl` is a struct flock that lives across the call.
        if unsafe { libc::fcntl(fd, libc::F_SETLKW, &mut fl as *mut libc::flock) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

struct NodeInner {
    /// The size this process sees (its writes included).
    size: u64,
    /// The size the pool's record had when last read or written back.
    pool_size: u64,
    generation: u64,
    pages: PageMap,
    dirty: usize,
    /// Size or times to write back.
    meta_dirty: bool,
    /// The time of the last write not yet in the pool's record.
    mtime_ns: Option<i64>,
    opens: u32,
    /// Unlinked while open here: deleted at the last close.
    orphan: bool,
    /// End of the last read, for sequential read-ahead.
    last_read_end: u64,
    /// When this process last compared its view with the pool's record (see
    /// [`Fs::revalidate_clean`]).
    revalidated_at: Instant,
    /// Where this process's `O_APPEND` writes not yet written back start: they were placed at
    /// the end this process knew, and the write-back moves them to the record's end if
    /// another process appended meanwhile (see [`Fs::append`]).
    append_base: Option<u64>,
    /// A failed write-back, reported by the next `fsync`/`close`.
    error: Option<FsError>,
    /// Set by the last close around its write-back: the compare-and-swap that writes the
    /// size and times back also removes this process from the openers, one round trip for
    /// both (see [`Fs::release`]).
    leave_openers: bool,
    /// The record that swap left, when it did.
    left_openers: Option<Inode>,
    /// Chunks stored or deleted as zeros since the size was last written back, for the
    /// record's holes ([`crate::holes`]).
    changes: crate::holes::ChunkChanges,
}

/// The cache's shared counters and queues.
pub(crate) struct CacheState {
    pages: AtomicUsize,
    dirty: AtomicUsize,
    pages_max: usize,
    dirty_max: usize,
    /// Pages in insertion order, for eviction (stale entries are skipped).
    lru: Mutex<VecDeque<(Weak<Node>, u64)>>,
    room: Condvar,
    room_lock: Mutex<()>,
    wb_kick: Condvar,
    wb_state: Mutex<WritebackState>,
    /// `wb_state.worker_pid`, readable without the lock (writers check it on every write).
    worker_pid: AtomicU32,
    interval: Duration,
    readahead_pages: u64,
    /// A pass of the write-back worker holds this; `fork` takes it so no pass is half done.
    pass: Mutex<()>,
    /// Files closed here whose records still list this process among their openers (see
    /// [`Fs::release`]), left by [`Fs::leave_lingering`].
    lingering: Mutex<Vec<u64>>,
}

#[derive(Default)]
struct WritebackState {
    /// The process whose worker is running (after `fork` the child starts its own).
    worker_pid: u32,
    kicked: bool,
}

impl CacheState {
    pub(crate) fn new(config: &FsConfig, chunk: usize) -> Self {
        let pages_max = (config.cache_bytes_max as usize / chunk).max(16);
        Self {
            pages: AtomicUsize::new(0),
            dirty: AtomicUsize::new(0),
            pages_max,
            dirty_max: (pages_max * config.dirty_percent as usize / 100).max(1),
            lru: Mutex::new(VecDeque::new()),
            room: Condvar::new(),
            room_lock: Mutex::new(()),
            wb_kick: Condvar::new(),
            wb_state: Mutex::new(WritebackState::default()),
            worker_pid: AtomicU32::new(0),
            interval: Duration::from_millis(config.writeback_interval_ms.max(1)),
            readahead_pages: u64::from(config.readahead_pages.max(1)),
            pass: Mutex::new(()),
            lingering: Mutex::new(Vec::new()),
        }
    }
}

thread_local! {
    /// Scratch buffer for direct reads.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `TooBig` when `data` at `offset` would end past [`FILE_SIZE_BYTES_MAX`].
fn check_extent(offset: u64, data: &[u8]) -> Result<()> {
    match offset.checked_add(data.len() as u64) {
        Some(end) if end <= FILE_SIZE_BYTES_MAX => Ok(()),
        _ => Err(FsError::TooBig),
    }
}

/// A coarse wall clock for mtimes of buffered writes (a vDSO read, no system call).
fn coarse_now_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid one we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

impl Node {
    fn new(inode: &Inode) -> Self {
        Self {
            ino: inode.ino,
            inner: Mutex::new(NodeInner {
                size: inode.size,
                pool_size: inode.size,
                generation: inode.generation,
                pages: PageMap::default(),
                dirty: 0,
                meta_dirty: false,
                mtime_ns: None,
                opens: 0,
                orphan: false,
                last_read_end: u64::MAX,
                revalidated_at: Instant::now(),
                append_base: None,
                error: None,
                leave_openers: false,
                left_openers: None,
                changes: crate::holes::ChunkChanges::default(),
            }),
            wb_lock: Mutex::new(0),
            stale: AtomicBool::new(false),
            registered: Mutex::new(false),
            shared: AtomicBool::new(false),
            shared_turn: Mutex::new(()),
        }
    }

    /// Whether another process may use this file through descriptions it shares with this
    /// one (see [`Fs::shared_io`]).
    pub fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Acquire)
    }

    /// The size this process sees.
    pub fn size(&self) -> u64 {
        self.inner.lock().size
    }

    /// Whether this process has data of the file not yet in the pool.
    pub fn is_dirty(&self) -> bool {
        let inner = self.inner.lock();
        inner.dirty > 0 || inner.meta_dirty
    }
}

impl Fs {
    /// Opens `inode` in this process: its node, refreshed from the record when nothing of it
    /// is pending here (cached pages are dropped when another process changed the data). The
    /// first open records this process in the inode's openers (see [`crate::openers`]); a file
    /// unlinked before that is `NotFound`.
    ///
    /// A record older than the node (a lower generation) is not taken: another thread's last
    /// close wrote the node back after the caller read the record (`release` holds
    /// `registered` meanwhile, so this open waits for it), and the node's size is the newer.
    /// Taking it made a file closed by one thread while another opened it read as empty
    /// (Node.js's write stream closing while a read stream opened the file).
    pub fn open_node(&self, inode: &Inode) -> Result<Arc<Node>> {
        self.open_node_as(inode, false, false)
    }

    /// [`Fs::open_node`] of a file opened to be read: a file of up to [`OPEN_READ_BYTES_MAX`]
    /// has its first chunk read with the swap that records this process among its openers,
    /// in the same round trip, and cached (unless another process has the file open).
    pub fn open_node_reading(&self, inode: &Inode) -> Result<Arc<Node>> {
        self.open_node_as(inode, false, true)
    }

    /// [`Fs::open_node`] of a file [`Fs::create_open`] just made, whose record already lists
    /// this process among its openers: no compare-and-swap to record it again.
    pub fn open_node_created(&self, inode: &Inode) -> Result<Arc<Node>> {
        debug_assert!(inode.openers.contains(&self.opener()));
        self.open_node_as(inode, true, false)
    }

    fn open_node_as(&self, inode: &Inode, created: bool, reading: bool) -> Result<Arc<Node>> {
        let node = Arc::clone(self.nodes.lock().entry(inode.ino).or_insert_with(|| Arc::new(Node::new(inode))));
        let mut registered = node.registered.lock();
        let mut inner = node.inner.lock();
        if inner.dirty == 0 && !inner.meta_dirty && inner.opens == 0 && inode.generation >= inner.generation {
            if inner.generation != inode.generation {
                self.drop_pages(&mut inner, 0);
                inner.generation = inode.generation;
            }
            inner.size = inode.size;
            inner.pool_size = inode.size;
            inner.revalidated_at = Instant::now();
        }
        inner.opens += 1;
        let first = inner.opens == 1;
        drop(inner);
        if first && *registered {
            // Closed here and not left yet (see `release`): the record lists this process
            // still, so no swap; another process that opened it since makes it shared.
            self.cache.lingering.lock().retain(|&ino| ino != inode.ino);
            if self.open_in_another_process(inode) {
                node.shared.store(true, Ordering::Release);
                self.drop_clean_pages(&mut node.inner.lock());
            }
        } else if first {
            let first_chunk = (reading && !created && inode.size > 0 && inode.size <= OPEN_READ_BYTES_MAX && !node.inner.lock().pages.contains(0)).then(|| self.keys.chunk(inode.ino, 0));
            // A file this process just made lists it already, alone.
            let recorded = if created { Ok((true, false, None)) } else { self.register_opener(inode.ino, first_chunk.as_deref()).map(|(recorded, elsewhere, read)| (recorded, elsewhere, Some(read))) };
            match recorded {
                Ok((recorded, elsewhere, read)) => {
                    *registered = recorded;
                    if elsewhere {
                        // Another process has it open: this one reads and writes the pool.
                        node.shared.store(true, Ordering::Release);
                        self.drop_clean_pages(&mut node.inner.lock());
                    } else if let Some((now, Some(value))) = read {
                        self.keep_first_chunk(&node, &now, value.as_deref());
                    }
                }
                Err(e) => {
                    node.inner.lock().opens -= 1;
                    return Err(e);
                }
            }
        }
        drop(registered);
        Ok(node)
    }

    /// Caches the first chunk of `node` as read with the swap that recorded this process among
    /// its openers, leaving the record `now`: when the node stands at that record (no write of
    /// another process came between the open's look at the record and the swap) and has no
    /// page there yet.
    fn keep_first_chunk(&self, node: &Arc<Node>, now: &Inode, value: Option<&[u8]>) {
        let inserted = {
            let mut inner = node.inner.lock();
            let current = inner.generation == now.generation && inner.size == now.size && inner.dirty == 0 && !inner.pages.contains(0);
            if current {
                let page = self.page_from(value);
                self.insert_page(node, &mut inner, 0, page);
            }
            current
        };
        if inserted && self.cache.pages.load(Ordering::Relaxed) > self.cache.pages_max {
            self.make_room();
        }
    }

    /// One open of `node` ended. The last one writes its data back (close-to-open
    /// consistency), removes this process from the file's openers and deletes the file when
    /// it has no name and no other opener left.
    pub fn release(&self, node: &Arc<Node>) -> Result<()> {
        let mut registered = node.registered.lock();
        let last = {
            let mut inner = node.inner.lock();
            inner.opens = inner.opens.saturating_sub(1);
            inner.opens == 0
        };
        if !last {
            return Ok(());
        }
        node.shared.store(false, Ordering::Release);
        let orphan = node.inner.lock().orphan;
        let result = if orphan {
            // Unlinked here while open: nothing of it is worth writing back.
            self.discard(node);
            Ok(())
        } else {
            node.inner.lock().leave_openers = *registered;
            let result = self.writeback(node);
            let error = node.inner.lock().error.take();
            result.and(error.map_or(Ok(()), Err))
        };
        let left = {
            let mut inner = node.inner.lock();
            inner.leave_openers = false;
            inner.left_openers.take()
        };
        if *registered {
            if left.is_none() && result.is_ok() && self.may_linger(node.ino) {
                // Nothing was written back, so leaving the openers would be a swap of its own:
                // it waits, for a batch of them (the write-back worker's next pass, a `sync`,
                // `fork`, `exec` or exit; `leave_lingering`), and an open here before then
                // needs no swap either. Meanwhile the file counts as open here: another
                // process's unlink leaves it to this one to delete, and another process that
                // opens it reads and writes through the pool, as for a file open here.
                let full = {
                    let mut lingering = self.cache.lingering.lock();
                    lingering.push(node.ino);
                    lingering.len() >= LINGERING_MAX
                };
                drop(registered);
                self.ensure_writeback_worker();
                return if full { self.leave_lingering() } else { Ok(()) };
            }
            *registered = false;
            return match left {
                // The write-back's swap removed this process already.
                Some(inode) => result.and(self.after_leaving(&inode)),
                None => result.and(self.unregister_opener(node.ino)),
            };
        }
        if orphan {
            return match self.load_inode(node.ino) {
                Ok((inode, _)) if inode.nlink == 0 && !self.open_elsewhere(&inode) => self.delete_inode(&inode),
                _ => Ok(()),
            };
        }
        result
    }

    /// Whether the last close of `ino` may leave its record later (see [`Fs::release`]): the
    /// file has a name (the last close of one without deletes it now), as the record this
    /// process last read or wrote says (the open's swap wrote it), else as read now. A name
    /// removed elsewhere since only delays the delete to the batch.
    fn may_linger(&self, ino: u64) -> bool {
        let recent = self.recent_inodes.lock().get(&ino).map(|(inode, _, _)| inode.nlink);
        match recent {
            Some(nlink) => nlink > 0,
            None => matches!(self.load_inode(ino), Ok((inode, _)) if inode.nlink > 0),
        }
    }

    /// Leaves the openers of the files this process closed without leaving them (see
    /// [`Fs::release`]), in one batch of swaps: the records are read together (copies, mostly),
    /// and written together; a swap that lost a race is made again alone.
    pub fn leave_lingering(&self) -> Result<()> {
        let inos = std::mem::take(&mut *self.cache.lingering.lock());
        if inos.is_empty() {
            return Ok(());
        }
        let nodes: Vec<Arc<Node>> = {
            let nodes = self.nodes.lock();
            inos.iter().filter_map(|ino| nodes.get(ino).cloned()).collect()
        };
        // Each still closed and recorded; held so that an open waits for the swap.
        let mut held: Vec<(&Arc<Node>, MutexGuard<'_, bool>)> = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let registered = node.registered.lock();
            if *registered && node.inner.lock().opens == 0 {
                held.push((node, registered));
            }
        }
        if held.is_empty() {
            return Ok(());
        }
        let me = self.opener();
        let keys: Vec<Vec<u8>> = held.iter().map(|(node, _)| self.keys.inode(node.ino)).collect();
        let swapped = (|| {
            let mut left: Vec<Option<(Inode, Vec<u8>, u64)>> = Vec::with_capacity(keys.len());
            for (key, record) in keys.iter().zip(self.kv.get_versioned_many(&keys)?) {
                left.push(self.decode_inode(key, record)?.map(|(mut inode, version)| {
                    Self::leave_openers(&mut inode, &me);
                    let encoded = inode.encode();
                    (inode, encoded, version)
                }));
            }
            let writes: Vec<crate::kv::WriteOp> =
                keys.iter().zip(&left).filter_map(|(key, left)| left.as_ref().map(|(_, encoded, version)| crate::kv::WriteOp::Put(key, encoded, crate::kv::Cond::Version(*version)))).collect();
            let outcomes = self.kv.write_many(&writes)?;
            Ok((left, outcomes))
        })();
        let (left, outcomes) = match swapped {
            Ok(swapped) => swapped,
            Err(e) => {
                // Still recorded: left at the next batch.
                self.cache.lingering.lock().extend(held.iter().map(|(node, _)| node.ino));
                return Err(e);
            }
        };
        let mut outcomes = outcomes.into_iter();
        let mut first_error = Ok(());
        for ((node, registered), left) in held.iter_mut().zip(left) {
            let outcome = match left {
                // Deleted meanwhile: nothing to leave.
                None => Ok(()),
                Some((inode, _, _)) => match outcomes.next().flatten() {
                    Some(version) => {
                        self.remember_inode(&inode, version);
                        self.after_leaving(&inode)
                    }
                    // Changed since it was read: alone, from the record as it is.
                    None => self.unregister_opener(node.ino),
                },
            };
            **registered = false;
            first_error = first_error.and(outcome);
        }
        first_error
    }

    /// In the child of a `fork`: the parent's lingering records (see [`Fs::release`]) are the
    /// parent's to leave.
    pub(crate) fn forget_lingering(&self) {
        let inos = std::mem::take(&mut *self.cache.lingering.lock());
        for ino in inos {
            let node = self.nodes.lock().get(&ino).cloned();
            if let Some(node) = node {
                let mut registered = node.registered.lock();
                if node.inner.lock().opens == 0 {
                    *registered = false;
                }
            }
        }
    }

    /// Whether this process has `ino` open.
    pub(crate) fn open_here(&self, ino: u64) -> bool {
        let node = self.nodes.lock().get(&ino).cloned();
        node.is_some_and(|node| node.inner.lock().opens > 0)
    }

    /// Whether this process has `ino` open (then an unlink to zero links defers the delete).
    pub(crate) fn defer_delete_if_open(&self, ino: u64) -> bool {
        let Some(node) = self.nodes.lock().get(&ino).cloned() else {
            return false;
        };
        let mut inner = node.inner.lock();
        if inner.opens > 0 {
            inner.orphan = true;
            true
        } else {
            false
        }
    }

    /// Drops everything cached of `ino` (it was deleted).
    pub(crate) fn forget_node(&self, ino: u64) {
        self.recent_inodes.lock().remove(&ino);
        let node = self.nodes.lock().remove(&ino);
        if let Some(node) = node {
            self.discard(&node);
        }
    }

    fn discard(&self, node: &Node) {
        let mut inner = node.inner.lock();
        self.drop_pages(&mut inner, 0);
        inner.meta_dirty = false;
        inner.mtime_ns = None;
    }

    /// Chunks of `ino` this process may have that the record's size does not cover.
    pub(crate) fn local_chunk_count(&self, ino: u64) -> u64 {
        let node = self.nodes.lock().get(&ino).cloned();
        node.map_or(0, |n| n.inner.lock().size.div_ceil(self.chunk as u64))
    }

    /// Puts this process's size and mtime of cached, unwritten data into `inode`.
    pub(crate) fn overlay_local(&self, inode: &mut Inode) {
        if file_type(inode.mode) != libc::S_IFREG {
            return;
        }
        let Some(node) = self.nodes.lock().get(&inode.ino).cloned() else {
            return;
        };
        let mut inner = node.inner.lock();
        if node.stale.load(Ordering::Acquire) || node.is_shared() {
            return;
        }
        if inner.dirty > 0 || inner.meta_dirty {
            inode.size = inner.size;
            if let Some(t) = inner.mtime_ns {
                inode.mtime_ns = t;
                inode.ctime_ns = inode.ctime_ns.max(t);
            }
        } else if inner.opens > 0 {
            // Nothing unwritten here: the record is as new as this process's view, or newer
            // (another process wrote the file: `tail -f` sees it grow).
            self.revalidate_clean(&mut inner, inode);
            inode.size = inner.size;
        }
    }

    /// Brings a clean node's view up to the record `inode` just read: when another process
    /// wrote the file back since (its generation moved), the pages cached of it are dropped;
    /// the size becomes the record's (never smaller than this process's own, which a
    /// write-back in flight is about to put in the record).
    fn revalidate_clean(&self, inner: &mut NodeInner, inode: &Inode) {
        debug_assert!(inner.dirty == 0 && !inner.meta_dirty);
        if inode.generation != inner.generation {
            self.drop_clean_pages(inner);
            inner.generation = inode.generation;
        }
        inner.size = inner.size.max(inode.size);
        inner.pool_size = inode.size;
        inner.revalidated_at = Instant::now();
    }

    /// Drops the cached pages of a node that are neither dirty nor being written back.
    fn drop_clean_pages(&self, inner: &mut NodeInner) {
        let clean: Vec<u64> = inner.pages.iter().filter(|(_, p)| !p.dirty && !p.in_flight).map(|(i, _)| i).collect();
        for index in &clean {
            inner.pages.remove(*index);
        }
        self.cache.pages.fetch_sub(clean.len(), Ordering::Relaxed);
    }

    /// A read at or past the end of a clean file open here: whether the pool's record says
    /// another process made it longer since this process last looked (at most every
    /// [`EOF_REVALIDATE_INTERVAL_MS`]); the view is brought up to it then.
    fn grew_elsewhere(&self, node: &Arc<Node>) -> bool {
        {
            let inner = node.inner.lock();
            let due = inner.revalidated_at.elapsed() >= Duration::from_millis(EOF_REVALIDATE_INTERVAL_MS);
            if !due || inner.dirty > 0 || inner.meta_dirty || node.is_shared() || node.stale.load(Ordering::Acquire) {
                return false;
            }
        }
        let Ok((inode, _)) = self.load_inode(node.ino) else { return false };
        let mut inner = node.inner.lock();
        if inner.dirty > 0 || inner.meta_dirty {
            return false;
        }
        let before = inner.size;
        self.revalidate_clean(&mut inner, &inode);
        inner.size > before
    }

    /// An explicit mtime replaces the pending one of buffered writes.
    pub(crate) fn discard_local_mtime(&self, ino: u64) {
        if let Some(node) = self.nodes.lock().get(&ino).cloned() {
            node.inner.lock().mtime_ns = None;
        }
    }

    /// Drops pages at or after index `from` (dirty ones too: the caller truncates).
    fn drop_pages(&self, inner: &mut NodeInner, from: u64) {
        let (dropped, dirty) = inner.pages.split_off(from);
        inner.dirty -= dirty;
        self.cache.dirty.fetch_sub(dirty, Ordering::Relaxed);
        self.cache.pages.fetch_sub(dropped.len(), Ordering::Relaxed);
    }

    fn insert_page(&self, node: &Arc<Node>, inner: &mut NodeInner, index: u64, data: Box<[u8]>) {
        debug_assert_eq!(data.len(), self.chunk);
        inner.pages.insert(index, Page { data, dirty: false, in_flight: false });
        self.cache.pages.fetch_add(1, Ordering::Relaxed);
        self.cache.lru.lock().push_back((Arc::downgrade(node), index));
    }

    /// A page's bytes as stored: `value` padded with zeros to the chunk size.
    fn page_from(&self, value: Option<&[u8]>) -> Box<[u8]> {
        let mut data = vec![0u8; self.chunk].into_boxed_slice();
        if let Some(v) = value {
            let n = v.len().min(self.chunk);
            data[..n].copy_from_slice(&v[..n]);
        }
        data
    }

    /// Forgets what this process knows of every file's data (after `fork`, in the parent:
    /// the child shares its descriptors and may change the files). Dirty data was written
    /// back just before the fork.
    pub fn invalidate_cached(&self) {
        let nodes: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        for node in nodes {
            // Not in the middle of a write-back (pages sent, the record's size not yet).
            let _no_writeback = node.wb_lock.lock();
            let mut inner = node.inner.lock();
            if inner.dirty > 0 || inner.meta_dirty {
                continue;
            }
            self.drop_clean_pages(&mut inner);
            node.stale.store(true, Ordering::Release);
        }
    }

    /// After `fork`, in the parent and in the child: every file open here is shared with the
    /// other process until its last close here (see [`Fs::shared_io`]).
    pub fn share_open_nodes(&self) {
        let nodes: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        for node in nodes {
            if node.inner.lock().opens > 0 {
                node.shared.store(true, Ordering::Release);
            }
        }
    }

    /// One read or write of `node` at a time, across the threads of this process and, when it
    /// is shared, across the processes of this host: a shared open file description's offset
    /// (and an `O_APPEND` write's end of file) is read and moved under it, as Linux moves a
    /// description's offset under its own lock. `None` for a node this process alone uses.
    pub fn shared_io<'a>(&'a self, node: &'a Node) -> Result<Option<SharedIoGuard<'a>>> {
        if !node.is_shared() {
            return Ok(None);
        }
        let turn = node.shared_turn.lock();
        Ok(Some(SharedIoGuard { _turn: turn, _host: self.host_lock(node.ino)? }))
    }

    /// Waits for this process's turn at inode `ino` among the processes of the host.
    fn host_lock(&self, ino: u64) -> Result<HostLock> {
        let lock_fd = self.shared_io_lock.get_or_init(|| self.open_shared_io_lock()).as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let locked = match lock_fd {
            Some(fd) => {
                record_lock(fd, ino, libc::F_WRLCK).map_err(|e| FsError::Io(format!("locking a shared file: {e}")))?;
                Some((fd, ino))
            }
            None => None,
        };
        Ok(HostLock { locked })
    }

    fn open_shared_io_lock(&self) -> Option<std::os::fd::OwnedFd> {
        let path = self.config.shared_io_lock_path.as_ref()?;
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let opened = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path);
        match opened {
            Ok(file) => Some(kura_engine::fd::keep_high(std::os::fd::OwnedFd::from(file))),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot open the shared-file lock: processes sharing a file are not serialized");
                None
            }
        }
    }

    /// Before this process releases a lock (`F_UNLCK`, `LOCK_UN`, a close that drops its
    /// POSIX locks): its writes go to the pool, so the process that takes the lock next reads
    /// them, as an NFS client writes back before it unlocks. Every file's, not only the
    /// locked one's: programs guard files with locks on others (sqlite's WAL mode guards
    /// the `-wal` file with locks on the `-shm` file).
    pub fn before_unlock(&self) -> Result<()> {
        self.writeback_all()
    }

    /// After this process took a lock: what other processes wrote back since it last looked
    /// replaces its cached pages and sizes (clean pages of an inode whose generation moved
    /// are dropped), as an NFS client revalidates its cache when it takes a lock; every open
    /// file's, in one batch of record reads, since a lock may guard other files than its own
    /// (see [`Fs::before_unlock`]). A file that another process has opened since this one
    /// opened it becomes shared (reads and writes go to the pool, see [`Fs::shared_io`]).
    /// Programs that share files between unrelated processes under locks (sqlite in several
    /// processes) then read each other's committed writes. When a record cannot be read, the
    /// node's clean pages are dropped and its size reloaded at its next use.
    pub fn after_lock(&self, ino: u64) {
        let nodes: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        let nodes: Vec<Arc<Node>> = nodes.into_iter().filter(|n| n.ino == ino || n.inner.lock().opens > 0).collect();
        {
            // Under a lock no record this process read or wrote before it answers `fstat` (see
            // `ns::ATTR_FRESH_US`): another process may have changed it just before the lock.
            let mut recent = self.recent_inodes.lock();
            for node in &nodes {
                recent.remove(&node.ino);
            }
        }
        let nodes: Vec<Arc<Node>> = nodes.into_iter().filter(|n| !n.is_shared()).collect();
        if nodes.is_empty() {
            return;
        }
        let keys: Vec<Vec<u8>> = nodes.iter().map(|n| self.keys.inode(n.ino)).collect();
        let record_writes: Vec<u64> = nodes.iter().map(|n| *n.wb_lock.lock()).collect();
        let records = self.kv.get_meta_many(&keys).ok();
        for (i, node) in nodes.iter().enumerate() {
            let loaded = records.as_ref().and_then(|r| r.get(i)?.as_ref()).and_then(|bytes| Inode::decode(&keys[i], bytes).ok());
            if let Some(inode) = &loaded
                && self.open_in_another_process(inode)
            {
                if let Err(error) = self.share_node(node) {
                    tracing::warn!(ino = node.ino, %error, "writing back a file another process opened failed");
                }
                continue;
            }
            self.revalidate_after_lock(node, loaded, record_writes[i]);
        }
    }

    /// [`Fs::after_lock`] for one node not shared: brought up to `loaded`, its record.
    fn revalidate_after_lock(&self, node: &Arc<Node>, loaded: Option<Inode>, record_writes_before_read: u64) {
        // No write-back of this node half done (its pages in the pool, the size not yet):
        // clean then means all of it is in the record.
        let record_writes = node.wb_lock.lock();
        if *record_writes != record_writes_before_read {
            // This process wrote the record after `loaded` was read (a thread's write written
            // back meanwhile): what it caches is newer. A clean node took `loaded`'s size,
            // and lost the writes (fstat said 0 after four 4 KiB writes, tests/c/fork_threads.c).
            return;
        }
        let mut inner = node.inner.lock();
        match loaded {
            Some(inode) if inner.dirty == 0 && !inner.meta_dirty => {
                self.revalidate_clean(&mut inner, &inode);
                // Under a lock the record's size is the file's, shorter too.
                inner.size = inode.size;
                node.stale.store(false, Ordering::Release);
            }
            Some(inode) => {
                if inode.generation != inner.generation {
                    self.drop_clean_pages(&mut inner);
                    inner.generation = inode.generation;
                }
                inner.pool_size = inode.size;
            }
            None => {
                self.drop_clean_pages(&mut inner);
                node.stale.store(true, Ordering::Release);
            }
        }
    }

    /// Another process opened `node`, which this process caches: from now on it reads and
    /// writes the pool, as a file shared through `fork` does ([`Fs::shared_io`]), after what
    /// it has of the file here is written back.
    fn share_node(&self, node: &Arc<Node>) -> Result<()> {
        if node.shared.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let written = self.writeback(node);
        self.drop_clean_pages(&mut node.inner.lock());
        written
    }

    /// A shared node's size as the pool has it now.
    fn reload_shared_size(&self, node: &Arc<Node>) -> Result<()> {
        let (inode, _) = self.load_inode(node.ino).map_err(FsError::gone_is_stale)?;
        let mut inner = node.inner.lock();
        node.stale.store(false, Ordering::Release);
        inner.size = if inner.dirty == 0 && !inner.meta_dirty { inode.size } else { inner.size.max(inode.size) };
        inner.pool_size = inode.size;
        inner.generation = inode.generation;
        Ok(())
    }

    /// Reloads a stale node's size from the pool (see [`Fs::invalidate_cached`]).
    fn refresh_if_stale(&self, node: &Arc<Node>) -> Result<()> {
        if !node.stale.load(Ordering::Acquire) {
            return Ok(());
        }
        let (inode, _) = self.load_inode(node.ino).map_err(FsError::gone_is_stale)?;
        let mut inner = node.inner.lock();
        if node.stale.swap(false, Ordering::AcqRel) && inner.dirty == 0 && !inner.meta_dirty {
            inner.size = inode.size;
            inner.pool_size = inode.size;
            inner.generation = inode.generation;
        }
        Ok(())
    }

    /// The size of an open file as this process sees it.
    pub fn size_of(&self, node: &Arc<Node>) -> Result<u64> {
        if node.is_shared() {
            self.reload_shared_size(node)?;
        } else {
            self.refresh_if_stale(node)?;
        }
        Ok(node.size())
    }

    /// `SEEK_DATA` (`hole` false) or `SEEK_HOLE` (`hole` true) from `offset`: where the next
    /// data or hole starts, at chunk granularity. A chunk that is not in the pool (never
    /// written, punched, truncated away, or written as zeros, which write-back and direct
    /// writes delete) is a hole, and so is the end of the file. The pool is only asked which
    /// chunks exist ([`crate::kv::Kv::exists_many`]: no chunk's contents cross the network), so a chunk
    /// stored with only zeros in it (another writer's, or one from before zero chunks were
    /// deleted) counts as data, as a file system may always report a hole. `None` (`ENXIO`):
    /// `offset` is negative, at or past the end, or no data follows it. The process's own
    /// dirty pages are written back first, so that the pool holds what it sees.
    pub fn seek_data_or_hole(&self, node: &Arc<Node>, offset: i64, hole: bool) -> Result<Option<u64>> {
        let Ok(offset) = u64::try_from(offset) else { return Ok(None) };
        if node.inner.lock().dirty > 0 {
            self.writeback(node)?;
        }
        let size = self.size_of(node)?;
        if offset >= size {
            return Ok(None);
        }
        let chunk = self.chunk as u64;
        let end = size.div_ceil(chunk);
        let mut index = offset / chunk;
        while index < end {
            let until = (index + SEEK_BATCH_CHUNKS).min(end);
            let keys: Vec<Vec<u8>> = (index..until).map(|i| self.keys.chunk(node.ino, i)).collect();
            for (i, data) in (index..until).zip(self.kv.exists_many(&keys)?) {
                if data != hole {
                    return Ok(Some((i * chunk).max(offset)));
                }
            }
            index = until;
        }
        Ok(hole.then_some(size))
    }

    /// Writes `data` at `offset` (`O_APPEND` callers pass the size). Returns bytes written.
    pub fn write(&self, node: &Arc<Node>, offset: u64, data: &[u8], mode: WriteMode) -> Result<usize> {
        if node.is_shared() {
            // Another process may have changed the size since: reloaded first.
            self.reload_shared_size(node)?;
            return self.write_shared(node, offset, data, mode);
        }
        self.refresh_if_stale(node)?;
        check_extent(offset, data)?;
        if data.is_empty() {
            return Ok(0);
        }
        if node.inner.lock().append_base.is_some() {
            // Appends waiting to be placed, and now a write elsewhere: place them first.
            self.writeback(node)?;
        }
        match mode {
            WriteMode::Buffered | WriteMode::Sync => self.write_cached(node, offset, data)?,
            WriteMode::Direct | WriteMode::DirectSync => self.write_direct(node, offset, data)?,
        }
        if matches!(mode, WriteMode::Sync | WriteMode::DirectSync) {
            self.fsync(node)?;
        }
        Ok(data.len())
    }

    /// A write to a shared node (its size just reloaded): straight to the pool, size and
    /// mtime too, so the other processes see it now.
    fn write_shared(&self, node: &Arc<Node>, offset: u64, data: &[u8], mode: WriteMode) -> Result<usize> {
        check_extent(offset, data)?;
        if data.is_empty() {
            return Ok(0);
        }
        self.write_direct(node, offset, data)?;
        self.writeback(node)?;
        if matches!(mode, WriteMode::Sync | WriteMode::DirectSync) {
            self.fsync(node)?;
        }
        Ok(data.len())
    }

    /// An `O_APPEND` write: `data` at the end of the file, as Linux places it whichever
    /// process appends. Returns where it went and its length. Buffered appends go into the
    /// cache at the end this process knows (no round trip); its write-back then takes the
    /// host's turn at the file and, if another process appended meanwhile, moves them to the
    /// record's end ([`Fs::place_appends`]): concurrent `>> log` from many processes lose no
    /// line. A shared node's append (see [`Fs::shared_io`]) and a direct one find the end in
    /// the pool.
    pub fn append(&self, node: &Arc<Node>, data: &[u8], mode: WriteMode) -> Result<(u64, usize)> {
        if node.is_shared() {
            self.reload_shared_size(node)?;
            let offset = node.size();
            return Ok((offset, self.write_shared(node, offset, data, mode)?));
        }
        if matches!(mode, WriteMode::Direct | WriteMode::DirectSync) {
            let offset = self.size_of(node)?;
            return Ok((offset, self.write(node, offset, data, mode)?));
        }
        self.refresh_if_stale(node)?;
        if data.is_empty() {
            return Ok((node.size(), 0));
        }
        let other_writes_waiting = {
            let inner = node.inner.lock();
            inner.append_base.is_none() && inner.dirty > 0
        };
        if other_writes_waiting {
            // Out first, so that only appends lie past the base.
            self.writeback(node)?;
        }
        // One append at a time in this process (each finds the end the last one left), and
        // none while the write-back places them (it takes this turn after the node's
        // write-back lock; nothing here takes that lock while holding the turn).
        let (offset, room) = {
            let _turn = node.shared_turn.lock();
            let offset = {
                let mut inner = node.inner.lock();
                let end = inner.size;
                inner.append_base.get_or_insert(end);
                end
            };
            check_extent(offset, data)?;
            (offset, self.write_into_cache(node, offset, data)?)
        };
        if room {
            self.make_room();
        }
        if mode == WriteMode::Sync {
            self.fsync(node)?;
        }
        Ok((offset, data.len()))
    }

    fn write_cached(&self, node: &Arc<Node>, offset: u64, data: &[u8]) -> Result<()> {
        if self.write_into_cache(node, offset, data)? {
            self.make_room();
        }
        Ok(())
    }

    /// [`Fs::write_cached`] but for making room: `true` when the cache went over its limit
    /// and the caller must call [`Fs::make_room`] (which may wait for the write-back worker:
    /// not while holding a node's append turn, which the worker's write-back takes).
    fn write_into_cache(&self, node: &Arc<Node>, offset: u64, data: &[u8]) -> Result<bool> {
        let chunk = self.chunk as u64;
        let mut done = 0usize;
        let mut inserted = 0usize;
        let mut newly_dirty = 0usize;
        let now = coarse_now_ns();
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / chunk;
            let in_page = (at % chunk) as usize;
            let n = (self.chunk - in_page).min(data.len() - done);
            let mut inner = node.inner.lock();
            if !inner.pages.contains(index) {
                let needs_old = n < self.chunk && index * chunk < inner.pool_size;
                let page = if needs_old {
                    drop(inner);
                    let old = self.fetch_chunk(node.ino, index)?;
                    inner = node.inner.lock();
                    self.page_from(old.as_deref())
                } else {
                    self.page_from(None)
                };
                if !inner.pages.contains(index) {
                    self.insert_page(node, &mut inner, index, page);
                    inserted += 1;
                }
            }
            let page = inner.pages.get_mut(index).expect("inserted above");
            page.data[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            if inner.pages.set_dirty(index) {
                inner.dirty += 1;
                newly_dirty += 1;
            }
            inner.size = inner.size.max(at + n as u64);
            inner.meta_dirty = true;
            inner.mtime_ns = Some(now);
            done += n;
        }
        if newly_dirty > 0 {
            let dirty = self.cache.dirty.fetch_add(newly_dirty, Ordering::Relaxed) + newly_dirty;
            if dirty > self.cache.dirty_max {
                self.kick_writeback();
            }
        }
        self.ensure_writeback_worker();
        Ok(inserted > 0 && self.cache.pages.load(Ordering::Relaxed) > self.cache.pages_max)
    }

    fn fetch_chunk(&self, ino: u64, index: u64) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        Ok(self.kv.get_into(&self.keys.chunk(ino, index), &mut out)?.then_some(out))
    }

    fn write_direct(&self, node: &Arc<Node>, offset: u64, data: &[u8]) -> Result<()> {
        // Dirty cached pages would be written back over this write later: write them first.
        if node.inner.lock().dirty > 0 {
            self.writeback(node)?;
        }
        self.write_through(node, offset, data)
    }

    /// `data` at `offset` straight into the pool (partial chunks read, changed and written);
    /// cached pages it covers are updated, the size and mtime left to write back.
    fn write_through(&self, node: &Arc<Node>, offset: u64, data: &[u8]) -> Result<()> {
        let chunk = self.chunk as u64;
        let size = node.size();
        let end = offset + data.len() as u64;
        let mut items = Vec::new();
        let mut holes = Vec::new();
        // Each chunk's index, and whether it went as zeros.
        let mut noted = Vec::new();
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / chunk;
            let in_page = (at % chunk) as usize;
            let n = (self.chunk - in_page).min(data.len() - done);
            let chunk_end_in_file = (index * chunk + chunk).min(size.max(end));
            let value = if in_page == 0 && index * chunk + n as u64 >= chunk_end_in_file {
                data[done..done + n].to_vec()
            } else {
                let mut old = self.fetch_chunk(node.ino, index)?.unwrap_or_default();
                let want = (chunk_end_in_file - index * chunk) as usize;
                if old.len() < want {
                    old.resize(want, 0);
                }
                old[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
                old
            };
            // A chunk of zeros is deleted, as write-back does: it reads the same, takes no
            // room, and `SEEK_HOLE` finds it (which asks only whether chunks exist).
            let zeros = kura_pool::is_zeros(&value);
            if zeros {
                holes.push(self.keys.chunk(node.ino, index));
            } else {
                items.push((self.keys.chunk(node.ino, index), value));
            }
            noted.push((index, zeros));
            done += n;
        }
        self.kv.set_many(&items)?;
        self.kv.delete_many(&holes)?;
        let mut inner = node.inner.lock();
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / chunk;
            let in_page = (at % chunk) as usize;
            let n = (self.chunk - in_page).min(data.len() - done);
            if let Some(page) = inner.pages.get_mut(index) {
                page.data[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            }
            done += n;
        }
        // Noted once stored (see `crate::holes`: data leaves the holes after it is there).
        for &(index, zeros) in &noted {
            inner.changes.note(index, zeros);
        }
        if end > inner.size {
            inner.size = end;
        }
        inner.pool_size = inner.pool_size.max(end);
        inner.meta_dirty = true;
        inner.mtime_ns = Some(coarse_now_ns());
        drop(inner);
        self.ensure_writeback_worker();
        Ok(())
    }

    /// Reads at `offset` into `buf` through the cache (read-ahead on sequential misses).
    pub fn read(&self, node: &Arc<Node>, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if node.is_shared() {
            return self.read_direct(node, offset, buf);
        }
        self.refresh_if_stale(node)?;
        let chunk = self.chunk as u64;
        let (size, sequential) = {
            let mut inner = node.inner.lock();
            let sequential = inner.last_read_end == offset;
            inner.last_read_end = offset + buf.len() as u64;
            // The common case in one lock hold: the read lies in one cached page.
            if offset < inner.size {
                let len = (buf.len() as u64).min(inner.size - offset) as usize;
                let in_page = (offset % chunk) as usize;
                if in_page + len <= self.chunk
                    && let Some(page) = inner.pages.get(offset / chunk)
                {
                    buf[..len].copy_from_slice(&page.data[in_page..in_page + len]);
                    return Ok(len);
                }
            }
            (inner.size, sequential)
        };
        if offset >= size {
            // Once: the look just made is not due again for a while.
            return if self.grew_elsewhere(node) { self.read(node, offset, buf) } else { Ok(0) };
        }
        let len = (buf.len() as u64).min(size - offset) as usize;
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            let index = at / chunk;
            let in_page = (at % chunk) as usize;
            let n = (self.chunk - in_page).min(len - done);
            {
                let inner = node.inner.lock();
                if let Some(page) = inner.pages.get(index) {
                    buf[done..done + n].copy_from_slice(&page.data[in_page..in_page + n]);
                    done += n;
                    continue;
                }
            }
            let last = (offset + len as u64 - 1) / chunk;
            let ahead = if sequential { self.cache.readahead_pages } else { 1 };
            let until = (last + 1).max(index + ahead).min(size.div_ceil(chunk));
            self.fill(node, index, until)?;
            let inner = node.inner.lock();
            match inner.pages.get(index) {
                Some(page) => buf[done..done + n].copy_from_slice(&page.data[in_page..in_page + n]),
                None => continue, // evicted at once under memory pressure: look again
            }
            done += n;
        }
        Ok(len)
    }

    /// Loads pages `from..until` that are not cached, in one batch.
    fn fill(&self, node: &Arc<Node>, from: u64, until: u64) -> Result<()> {
        let missing: Vec<u64> = {
            let inner = node.inner.lock();
            (from..until.max(from + 1)).filter(|i| !inner.pages.contains(*i)).collect()
        };
        let keys: Vec<Vec<u8>> = missing.iter().map(|&i| self.keys.chunk(node.ino, i)).collect();
        let values = self.kv.get_many(&keys)?;
        let mut inserted = 0;
        {
            let mut inner = node.inner.lock();
            for (index, value) in missing.into_iter().zip(values) {
                if !inner.pages.contains(index) {
                    let page = self.page_from(value.as_deref());
                    self.insert_page(node, &mut inner, index, page);
                    inserted += 1;
                }
            }
        }
        if inserted > 0 && self.cache.pages.load(Ordering::Relaxed) > self.cache.pages_max {
            self.make_room();
        }
        Ok(())
    }

    /// Reads at `offset` straight from the pool (`O_DIRECT`).
    pub fn read_direct(&self, node: &Arc<Node>, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if node.is_shared() {
            self.reload_shared_size(node)?;
        } else {
            self.refresh_if_stale(node)?;
        }
        if node.inner.lock().dirty > 0 {
            self.writeback(node)?;
        }
        let chunk = self.chunk as u64;
        let size = node.size();
        if offset >= size {
            return Ok(0);
        }
        let len = (buf.len() as u64).min(size - offset) as usize;
        let mut fresh = Vec::new();
        let mut run = |scratch: &mut Vec<u8>| -> Result<usize> {
            let mut done = 0usize;
            while done < len {
                let at = offset + done as u64;
                let index = at / chunk;
                let in_page = (at % chunk) as usize;
                let n = (self.chunk - in_page).min(len - done);
                let found = self.kv.get_into(&self.keys.chunk(node.ino, index), scratch)?;
                let dst = &mut buf[done..done + n];
                // A chunk shorter than `in_page` (written when the file was shorter, then
                // extended by a truncate or a write further on) reads as zeros there.
                let have = if found { scratch.len().saturating_sub(in_page).min(n) } else { 0 };
                if have > 0 {
                    dst[..have].copy_from_slice(&scratch[in_page..in_page + have]);
                }
                dst[have..].fill(0);
                done += n;
            }
            Ok(len)
        };
        match SCRATCH.try_with(|s| run(&mut s.borrow_mut())) {
            Ok(result) => result,
            Err(_) => run(&mut fresh),
        }
    }

    /// Writes every dirty page of `node` and its size and mtime to the pool (not flushed).
    pub fn writeback(&self, node: &Arc<Node>) -> Result<()> {
        let mut record_writes = node.wb_lock.lock();
        if node.is_dirty() {
            *record_writes += 1;
        }
        self.writeback_held(node)
    }

    /// [`Fs::writeback`] with `node.wb_lock` held.
    fn writeback_held(&self, node: &Arc<Node>) -> Result<()> {
        let base = node.inner.lock().append_base;
        match base {
            // A shared node's appends find the end in the pool (and its turn is held by its
            // reader or writer, which may be the caller): none wait here to be placed.
            Some(_) if node.is_shared() => {
                node.inner.lock().append_base = None;
                self.writeback_locked(node)
            }
            Some(_) => {
                let _turn = node.shared_turn.lock();
                let base = node.inner.lock().append_base;
                match base {
                    Some(base) => self.place_appends(node, base),
                    None => self.writeback_locked(node),
                }
            }
            None => self.writeback_locked(node),
        }
    }

    /// Writes back a node with appends waiting at `base` (see [`Fs::append`]), with the host's
    /// turn at the file: where nobody else appended since, as any write-back; otherwise the
    /// appended bytes move to the record's end (the chunk there read, changed and written),
    /// the pages they sat in are dropped and this process's size becomes the new end.
    fn place_appends(&self, node: &Arc<Node>, base: u64) -> Result<()> {
        let _turn = self.host_lock(node.ino)?;
        let (inode, _) = self.load_inode(node.ino).map_err(FsError::gone_is_stale)?;
        let end = inode.size;
        if end == base {
            node.inner.lock().append_base = None;
            return self.writeback_locked(node).inspect_err(|_| {
                node.inner.lock().append_base.get_or_insert(base);
            });
        }
        let chunk = self.chunk as u64;
        let (bytes, mtime) = {
            let mut inner = node.inner.lock();
            let size = inner.size;
            let mut bytes = vec![0u8; size.saturating_sub(base) as usize];
            let mut at = base;
            while at < size {
                let (index, in_page) = (at / chunk, (at % chunk) as usize);
                let n = (self.chunk - in_page).min((size - at) as usize);
                if let Some(page) = inner.pages.get(index) {
                    let from = (at - base) as usize;
                    bytes[from..from + n].copy_from_slice(&page.data[in_page..in_page + n]);
                }
                at += n as u64;
            }
            self.drop_pages(&mut inner, base / chunk);
            inner.append_base = None;
            inner.size = end + bytes.len() as u64;
            inner.meta_dirty = false;
            (bytes, inner.mtime_ns.take())
        };
        tracing::debug!(ino = node.ino, from = base, to = end, bytes = bytes.len(), "appends moved to the end another process left");
        let placed = self.write_through(node, end, &bytes).and_then(|()| self.write_back_meta(node, end + bytes.len() as u64, mtime.or(Some(coarse_now_ns()))));
        if let Err(e) = &placed {
            node.inner.lock().error = Some(e.clone());
        }
        placed
    }

    fn writeback_locked(&self, node: &Arc<Node>) -> Result<()> {
        let chunk = self.chunk as u64;
        loop {
            let mut items = Vec::new();
            // Chunks of zeros: deleted rather than stored (a missing chunk reads as zeros), so
            // a file written full of zeros (a raw disk image, a preallocated log) takes no
            // room in the pool.
            let mut holes = Vec::new();
            // Each chunk's index, and whether it goes as zeros.
            let mut noted: Vec<(u64, bool)> = Vec::new();
            let mut indexes: Vec<u64> = Vec::new();
            // Pages are copied a few at a time, the node's lock dropped in between, so writers
            // to the file wait for one short copy, never for a whole batch. Each page's length
            // comes from the size at its copy; a page written again meanwhile is dirty again.
            let (size, mtime, meta) = loop {
                let mut inner = node.inner.lock();
                if indexes.is_empty() && inner.dirty == 0 && !inner.meta_dirty {
                    return Ok(());
                }
                let size = inner.size;
                let room = (WRITEBACK_BATCH_PAGES - indexes.len()).min(WRITEBACK_COPY_PAGES);
                let mut taken = 0;
                while taken < room {
                    let Some(index) = inner.pages.dirty_from(indexes.last().map_or(0, |i| i + 1)).next() else { break };
                    let len = (size.saturating_sub(index * chunk)).min(chunk) as usize;
                    inner.pages.set_clean(index);
                    let page = inner.pages.get_mut(index).expect("a dirty page is cached");
                    page.in_flight = true;
                    indexes.push(index);
                    taken += 1;
                    if len > 0 {
                        let data = &page.data[..len];
                        let zeros = kura_pool::is_zeros(data);
                        if zeros {
                            holes.push(self.keys.chunk(node.ino, index));
                        } else {
                            items.push((self.keys.chunk(node.ino, index), data.to_vec()));
                        }
                        noted.push((index, zeros));
                    }
                }
                inner.dirty -= taken;
                self.cache.dirty.fetch_sub(taken, Ordering::Relaxed);
                if taken == room && indexes.len() < WRITEBACK_BATCH_PAGES {
                    continue;
                }
                let meta = inner.dirty == 0 && inner.meta_dirty;
                let mtime = if meta { inner.mtime_ns.take() } else { None };
                if meta {
                    inner.meta_dirty = false;
                }
                break (size, mtime, meta);
            };
            let stored = if items.is_empty() { Ok(()) } else { self.kv.set_many(&items) };
            let written = stored.and_then(|()| if holes.is_empty() { Ok(()) } else { self.kv.delete_many(&holes) });
            {
                let mut inner = node.inner.lock();
                for &index in &indexes {
                    if let Some(page) = inner.pages.get_mut(index) {
                        page.in_flight = false;
                        if written.is_err() && inner.pages.set_dirty(index) {
                            inner.dirty += 1;
                            self.cache.dirty.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                match &written {
                    Err(e) => {
                        inner.meta_dirty |= meta;
                        inner.error = Some(e.clone());
                    }
                    // Noted once stored (see `crate::holes`).
                    Ok(()) => {
                        for &(index, zeros) in &noted {
                            inner.changes.note(index, zeros);
                        }
                    }
                }
            }
            self.cache.room.notify_all();
            written?;
            if meta {
                self.write_back_meta(node, size, mtime)?;
                return Ok(());
            }
        }
    }

    /// Puts the size and mtime of written-back data into the inode record (CAS) and bumps its
    /// generation so other processes drop their cached pages at their next open.
    /// The write-back of a last close also removes this process from the openers in that
    /// swap (`leave_openers`).
    fn write_back_meta(&self, node: &Arc<Node>, size: u64, mtime: Option<i64>) -> Result<()> {
        let (leaving, changes) = {
            let mut inner = node.inner.lock();
            (std::mem::take(&mut inner.leave_openers).then(|| self.opener()), std::mem::take(&mut inner.changes))
        };
        let chunk = self.chunk as u64;
        let updated = self.update_inode(node.ino, |i| {
            let old_size = i.size;
            i.size = i.size.max(size);
            if crate::layout::file_type(i.mode) == libc::S_IFREG {
                changes.apply(&mut i.holes, chunk, old_size, i.size);
            }
            if let Some(t) = mtime {
                i.mtime_ns = t;
                i.ctime_ns = i.ctime_ns.max(t);
            }
            i.generation += 1;
            if let Some(me) = &leaving {
                Self::leave_openers(i, me);
            }
            Ok(())
        });
        let mut inner = node.inner.lock();
        match updated {
            Ok(inode) => {
                inner.pool_size = inode.size;
                inner.generation = inode.generation;
                if leaving.is_some() {
                    inner.left_openers = Some(inode.clone());
                }
                if !node.is_shared() && inner.opens > 0 && self.open_in_another_process(&inode) {
                    // Another process opened the file since this one did: from now on this one
                    // reads and writes the pool too (see [`Fs::after_lock`]).
                    node.shared.store(true, Ordering::Release);
                    self.drop_clean_pages(&mut inner);
                }
                Ok(())
            }
            Err(FsError::NotFound) => {
                // Another process removed the file while this one wrote to it: the data is
                // gone with the file (as at the last close of an unlinked file), and the
                // chunks just written would otherwise stay in the pool for good. Inode numbers
                // are never reused, so no other file owns these keys.
                drop(inner);
                if let Err(error) = self.delete_chunks(node.ino, size) {
                    tracing::warn!(ino = node.ino, %error, "could not delete the chunks written to a removed file");
                }
                Ok(())
            }
            Err(e) => {
                inner.meta_dirty = true;
                inner.mtime_ns = inner.mtime_ns.or(mtime);
                inner.error = Some(e.clone());
                // The changes were not applied: the next write-back forgets the record's
                // holes rather than keep one where data now is.
                if !changes.is_empty() {
                    inner.changes.forget_holes();
                }
                Err(e)
            }
        }
    }

    /// Everything written to `node` before this call is durable when it returns.
    pub fn fsync(&self, node: &Arc<Node>) -> Result<()> {
        self.writeback(node)?;
        if let Some(e) = node.inner.lock().error.take() {
            return Err(e);
        }
        self.kv.flush()
    }

    /// Writes back every node with dirty data, and leaves the openers of the files closed
    /// since (before fork, exec and exit, at each pass of the write-back worker, and for
    /// `sync`).
    pub fn writeback_all(&self) -> Result<()> {
        let nodes: Vec<Arc<Node>> = self.nodes.lock().values().cloned().collect();
        let mut first_error = Ok(());
        for node in nodes.iter().filter(|n| n.is_dirty()) {
            if let Err(e) = self.writeback(node) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error.and(self.leave_lingering())
    }

    /// [`Fs::writeback_all`] before the process ends or `exec`s, and, when the pool's engine
    /// lives in this process (an embedded pool), a flush: the engine's writes not yet durable
    /// are in this process's memory only, and the next process to open the store would not
    /// find them (files a program wrote and closed under `kura fs run --pool embedded` were
    /// gone for the next run).
    pub fn writeback_before_leaving(&self) -> Result<()> {
        self.writeback_all()?;
        if self.kv.in_process() {
            self.kv.flush()?;
        }
        Ok(())
    }

    /// [`Fs::writeback_all`] and a pool flush.
    pub fn sync_all(&self) -> Result<()> {
        self.writeback_all()?;
        self.kv.flush()
    }

    /// Sets the size of `ino`: cached pages and pool chunks past it are dropped, the boundary
    /// chunk is cut, the record updated (and returned, with this process's view on it).
    pub(crate) fn truncate(&self, ino: u64, size: u64) -> Result<Inode> {
        if size > FILE_SIZE_BYTES_MAX {
            return Err(FsError::TooBig);
        }
        let (inode, _) = self.load_inode(ino)?;
        if crate::layout::is_dir(inode.mode) {
            return Err(FsError::IsDir);
        }
        if file_type(inode.mode) != libc::S_IFREG {
            return Err(FsError::Invalid);
        }
        let node = self.nodes.lock().get(&ino).cloned();
        let mut guard = node.as_ref().map(|n| n.wb_lock.lock());
        if let Some(record_writes) = guard.as_deref_mut() {
            *record_writes += 1;
        }
        if let Some(node) = &node {
            self.writeback_held(node)?;
        }
        let chunk = self.chunk as u64;
        let old_size = inode.size.max(node.as_ref().map_or(0, |n| n.size()));
        if size < old_size {
            let first_gone = size.div_ceil(chunk);
            let keys: Vec<Vec<u8>> = (first_gone..old_size.div_ceil(chunk)).map(|i| self.keys.chunk(ino, i)).collect();
            self.kv.delete_many(&keys)?;
            if !size.is_multiple_of(chunk) {
                let index = size / chunk;
                if let Some(mut value) = self.fetch_chunk(ino, index)? {
                    let keep = (size % chunk) as usize;
                    if value.len() > keep {
                        value.truncate(keep);
                        self.kv.set_many(&[(self.keys.chunk(ino, index), value)])?;
                    }
                }
            }
        }
        if let Some(node) = &node {
            let mut inner = node.inner.lock();
            self.drop_pages(&mut inner, size.div_ceil(chunk));
            if !size.is_multiple_of(chunk)
                && let Some(page) = inner.pages.get_mut(size / chunk)
            {
                page.data[(size % chunk) as usize..].fill(0);
            }
            inner.size = size;
            inner.mtime_ns = None;
            inner.append_base = None;
        }
        let now = now_ns();
        let updated = self.update_inode(ino, |i| {
            // Chunks past the old size are holes (none is stored there); those past the new
            // one are gone.
            if size > i.size {
                crate::holes::add(&mut i.holes, (i.size.div_ceil(chunk), size.div_ceil(chunk)));
            }
            crate::holes::clip(&mut i.holes, size.div_ceil(chunk));
            crate::holes::cap(&mut i.holes, crate::holes::HOLE_RANGES_MAX);
            i.size = size;
            i.mtime_ns = now;
            i.ctime_ns = now;
            i.generation += 1;
            Ok(())
        })?;
        if let Some(node) = &node {
            let mut inner = node.inner.lock();
            inner.pool_size = size;
            inner.generation = updated.generation;
        }
        self.cache.room.notify_all();
        let mut inode = updated;
        self.overlay_local(&mut inode);
        Ok(inode)
    }

    /// Frees pages until the cache is under its limit: evicts clean pages oldest first and,
    /// when all are dirty or in flight, kicks the write-back worker and waits (writers wait
    /// when memory is full).
    fn make_room(&self) {
        while self.cache.pages.load(Ordering::Relaxed) > self.cache.pages_max {
            if !self.evict_some() {
                self.kick_writeback();
                let guard = self.cache.room_lock.lock();
                let _guard = self.cache.room.wait_for(guard, Duration::from_millis(ROOM_WAIT_MS));
            }
        }
    }

    /// Evicts clean pages from the front of the queue; `false` when none could be.
    fn evict_some(&self) -> bool {
        let excess = self.cache.pages.load(Ordering::Relaxed).saturating_sub(self.cache.pages_max);
        let mut freed = 0;
        for _ in 0..EVICT_SCAN_MAX.max(excess) {
            if freed >= excess {
                break;
            }
            let Some((weak, index)) = self.cache.lru.lock().pop_front() else {
                break;
            };
            let Some(node) = weak.upgrade() else {
                continue;
            };
            let mut inner = node.inner.lock();
            match inner.pages.get(index) {
                Some(p) if !p.in_flight && !inner.pages.is_dirty(index) => {
                    inner.pages.remove(index);
                    self.cache.pages.fetch_sub(1, Ordering::Relaxed);
                    freed += 1;
                }
                Some(_) => {
                    drop(inner);
                    self.cache.lru.lock().push_back((weak, index));
                }
                None => {}
            }
        }
        freed > 0
    }

    fn kick_writeback(&self) {
        let mut state = self.cache.wb_state.lock();
        state.kicked = true;
        self.cache.wb_kick.notify_one();
    }

    /// Starts this process's write-back worker if it has none (first write, or after fork).
    fn ensure_writeback_worker(&self) {
        let pid = crate::process_id();
        if self.cache.worker_pid.load(Ordering::Relaxed) == pid {
            return;
        }
        let Some(fs) = self.self_arc() else {
            return;
        };
        let mut state = self.cache.wb_state.lock();
        if state.worker_pid == pid {
            return;
        }
        state.worker_pid = pid;
        self.cache.worker_pid.store(pid, Ordering::Relaxed);
        let weak = Arc::downgrade(&fs);
        let spawned = std::thread::Builder::new().name("kura-fs-writeback".into()).spawn(move || writeback_worker(weak, pid));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the write-back worker: {e}; writing back on demand only");
        }
    }

    fn self_arc(&self) -> Option<Arc<Fs>> {
        self.me.upgrade()
    }

    /// Stops the write-back worker between passes, for `fork` (its prepare handler): the
    /// child never inherits a half-done pass, nor the worker's state lock taken by a thread
    /// the child does not have (the worker takes it each time it wakes up, writers to kick
    /// it). Both stay held across `fork` in the result, which the parent's and the child's
    /// handlers drop (on the thread that called this) to resume write-back.
    pub fn pause_writeback(&self) -> WritebackPause<'_> {
        let pass = self.cache.pass.lock();
        // After the pass gate: the worker takes the state lock only before the gate, and
        // drops it before it waits there.
        let state = self.cache.wb_state.lock();
        WritebackPause { _state: state, _pass: pass }
    }
}

/// The write-back worker's locks, held by [`Fs::pause_writeback`] until this drops.
#[must_use = "write-back resumes when this drops"]
pub struct WritebackPause<'a> {
    // Fields drop in order: the state lock first, then the pass gate (the reverse of taking).
    _state: MutexGuard<'a, WritebackState>,
    _pass: MutexGuard<'a, ()>,
}

fn writeback_worker(fs: Weak<Fs>, pid: u32) {
    // The program's signals go to its own threads, not to this one in the middle of a pass
    // (a handler that writes back, as the preload's does, would wait for the pass forever).
    crate::block_signals_in_this_thread();
    loop {
        let Some(strong) = fs.upgrade() else {
            return;
        };
        if crate::process_id() != pid {
            return;
        }
        {
            let mut state = strong.cache.wb_state.lock();
            if !state.kicked {
                state = strong.cache.wb_kick.wait_for(state, strong.cache.interval);
            }
            state.kicked = false;
        }
        let _pass = strong.cache.pass.lock();
        if let Err(e) = strong.writeback_all() {
            tracing::warn!("write-back failed: {e}");
        }
        strong.cache.room.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(tag: u8) -> Page {
        Page { data: vec![tag; 4].into_boxed_slice(), dirty: false, in_flight: false }
    }

    /// `fork`'s prepare handler pauses write-back; until the parent's or child's handler drops
    /// the pause, every lock of the write-back machinery stays held by the forking thread, so
    /// the child never inherits one held by a thread it does not have (the worker takes its
    /// state lock each time it wakes; a child forked then hung in its fork handler).
    /// A file system on an embedded engine in `dir`.
    /// A file system on an embedded store in `dir`, and a new file `f` in it.
    fn fs_with_a_file(dir: &std::path::Path) -> (Arc<Fs>, Inode) {
        let fs = embedded_fs(dir);
        let owner = crate::ns::Owner { uid: 0, gid: 0 };
        let (inode, _) = fs.create(crate::ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, b"", owner, true).unwrap();
        (fs, inode)
    }

    fn embedded_fs(dir: &std::path::Path) -> Arc<Fs> {
        let mut config = kura_pool::PoolConfig::embedded(&dir.join("fs.kura"), 256 << 20);
        config.engine.block_size_bytes = 1 << 20;
        config.engine.direct_io = false;
        config.value_size_max_bytes = 64 << 10;
        let kv = Arc::new(crate::kv::PoolKv::new(kura_pool::Pool::open(config).unwrap()).unwrap());
        Fs::open(kv, FsConfig::default(), crate::ns::Owner { uid: 0, gid: 0 }).unwrap()
    }

    #[test]
    fn pausing_for_fork_holds_the_write_back_locks_until_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let fs = embedded_fs(dir.path());
        let held_elsewhere = |fs: &Fs| std::thread::scope(|s| s.spawn(|| (fs.cache.wb_state.try_lock().is_none(), fs.cache.pass.try_lock().is_none())).join().unwrap());
        assert_eq!(held_elsewhere(&fs), (false, false));
        let paused = fs.pause_writeback();
        assert_eq!(held_elsewhere(&fs), (true, true), "both locks held across fork");
        drop(paused);
        assert_eq!(held_elsewhere(&fs), (false, false));
    }

    /// A chunk shorter than the offset read in it (the file grew past it by a write to a later
    /// chunk) reads as zeros there, through the cache and around it (`O_DIRECT`, and every
    /// read of a file shared with another process). The direct read sliced past the chunk's
    /// end and panicked, in the program the preload runs in (found by tests/stdio_random.rs).
    #[test]
    fn reads_past_a_short_chunk_are_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let (fs, inode) = fs_with_a_file(dir.path());
        let node = fs.open_node(&inode).unwrap();
        fs.write(&node, 0, b"abcdefgh", WriteMode::Direct).unwrap();
        fs.write(&node, 5000, b"z", WriteMode::Direct).unwrap();
        for read in [Fs::read_direct, Fs::read] {
            let mut buf = [1u8; 10];
            assert_eq!(read(&fs, &node, 16, &mut buf).unwrap(), 10);
            assert_eq!(buf, [0; 10]);
            let mut buf = [1u8; 10];
            assert_eq!(read(&fs, &node, 4, &mut buf).unwrap(), 10);
            assert_eq!(&buf, b"efgh\0\0\0\0\0\0");
        }
        fs.release(&node).unwrap();
    }

    /// The record's holes (`st_blocks`) follow what is stored, through every path that stores
    /// or deletes chunks: buffered and direct writes of data and of zeros, punched ranges,
    /// a size grown by `truncate` or by a write past the end, and a size cut. At every step
    /// no chunk the record calls a hole is stored (the set under-states holes, never data),
    /// and here, one process writing, it is exact.
    #[test]
    fn the_records_holes_follow_what_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let (fs, inode) = fs_with_a_file(dir.path());
        let ino = inode.ino;
        let node = fs.open_node(&inode).unwrap();
        let chunk = fs.chunk as u64;
        let check = |step: &str| {
            fs.writeback(&node).unwrap();
            let record = fs.getattr(ino).unwrap();
            let chunks = record.size.div_ceil(chunk);
            let keys: Vec<_> = (0..chunks).map(|i| fs.keys.chunk(ino, i)).collect();
            let stored: Vec<bool> = fs.kv().get_many(&keys).unwrap().iter().map(Option::is_some).collect();
            let holes: Vec<bool> = (0..chunks).map(|i| record.holes.iter().any(|&(s, e)| s <= i && i < e)).collect();
            let expect: Vec<bool> = stored.iter().map(|&s| !s).collect();
            assert_eq!(holes, expect, "{step}: holes {:?}", record.holes);
            let data_bytes = record.size - crate::holes::hole_bytes(&record.holes, chunk, record.size);
            assert_eq!(record.blocks(chunk), if record.size == 0 { 0 } else { data_bytes.div_ceil(512).max(1) }, "{step}");
        };
        fs.truncate(ino, 64 * chunk).unwrap();
        check("truncate up");
        fs.write(&node, 10 * chunk + 5, b"data", WriteMode::Buffered).unwrap();
        check("a buffered write into a hole");
        fs.write(&node, 20 * chunk, &vec![3u8; 4 * chunk as usize], WriteMode::Direct).unwrap();
        check("a direct write");
        fs.write(&node, 21 * chunk, &vec![0u8; chunk as usize], WriteMode::Direct).unwrap();
        check("direct zeros");
        fs.write(&node, 22 * chunk, &vec![0u8; 2 * chunk as usize], WriteMode::Buffered).unwrap();
        check("buffered zeros");
        fs.fallocate(&node, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, (10 * chunk) as i64, chunk as i64).unwrap();
        check("a punched hole");
        fs.write(&node, 100 * chunk + 1, b"past the end", WriteMode::Buffered).unwrap();
        check("a write past the end");
        fs.truncate(ino, 21 * chunk + 7).unwrap();
        check("truncate down");
        fs.write(&node, 0, &vec![9u8; 30 * chunk as usize], WriteMode::Buffered).unwrap();
        check("rewritten whole");
        assert!(fs.getattr(ino).unwrap().holes.is_empty());
        fs.truncate(ino, 0).unwrap();
        check("emptied");
        fs.truncate(ino, 3 * chunk).unwrap();
        fs.release(&node).unwrap();
        let record = fs.getattr(ino).unwrap();
        assert_eq!((record.holes.as_slice(), record.blocks(chunk)), (&[(0, 3)][..], 1), "after the last close");
    }

    /// Chunks written back full of zeros are deleted, not stored (a missing chunk reads as
    /// zeros): zeros over data remove the data's chunk, a partly zero chunk is kept, and every
    /// byte reads back, through the cache and straight from the pool.
    #[test]
    fn chunks_of_zeros_take_no_room_in_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let (fs, inode) = fs_with_a_file(dir.path());
        let node = fs.open_node(&inode).unwrap();
        let chunk = fs.chunk;
        fs.write(&node, 0, &vec![7u8; 4 * chunk], WriteMode::Buffered).unwrap();
        fs.writeback(&node).unwrap();
        let stored = |i: u64| fs.kv().get_many(&[fs.keys.chunk(inode.ino, i)]).unwrap()[0].is_some();
        assert!((0..4).all(stored));
        fs.write(&node, 0, &vec![0u8; chunk], WriteMode::Buffered).unwrap();
        fs.write(&node, 2 * chunk as u64, &vec![0u8; chunk - 1], WriteMode::Buffered).unwrap();
        fs.write(&node, 4 * chunk as u64, &vec![0u8; 3 * chunk], WriteMode::Buffered).unwrap();
        fs.writeback(&node).unwrap();
        assert_eq!((0..7).map(stored).collect::<Vec<_>>(), [false, true, true, true, false, false, false]);
        let mut want = vec![7u8; 4 * chunk];
        want[..chunk].fill(0);
        want[2 * chunk..3 * chunk - 1].fill(0);
        want.extend(vec![0u8; 3 * chunk]);
        for read in [Fs::read_direct, Fs::read] {
            let mut buf = vec![1u8; want.len()];
            assert_eq!(read(&fs, &node, 0, &mut buf).unwrap(), want.len());
            assert!(buf == want, "a read after zeros were written back");
        }
        fs.release(&node).unwrap();
    }

    /// The page map against a `BTreeMap` model, across the dense/sparse boundary.
    #[test]
    fn page_map_matches_an_ordered_map() {
        let mut map = PageMap::default();
        let mut model: BTreeMap<u64, u8> = BTreeMap::new();
        let indexes = [0, 7, 3, DENSE_PAGES_MAX - 1, DENSE_PAGES_MAX, DENSE_PAGES_MAX + 5, 1 << 40, 12];
        for (tag, &i) in indexes.iter().enumerate() {
            map.insert(i, page(tag as u8));
            if tag % 2 == 1 {
                assert!(map.set_dirty(i) && !map.set_dirty(i));
            }
            model.insert(i, tag as u8);
        }
        let seen = |map: &PageMap| map.iter().map(|(i, p)| (i, p.data[0])).collect::<Vec<_>>();
        assert_eq!(seen(&map), model.iter().map(|(&i, &t)| (i, t)).collect::<Vec<_>>());
        assert!(map.contains(DENSE_PAGES_MAX) && !map.contains(1) && !map.contains(DENSE_PAGES_MAX + 1));
        assert_eq!(map.remove(3).map(|p| p.data[0]), model.remove(&3));
        assert!(map.remove(3).is_none() && map.remove(u64::MAX).is_none());
        let dirty_from_7: Vec<u64> = map.dirty_from(7).collect();
        let model_dirty: Vec<u64> = model.range(7..).filter(|(_, t)| *t % 2 == 1).map(|(&i, _)| i).collect();
        assert_eq!(dirty_from_7, model_dirty);
        let (gone, gone_dirty) = map.split_off(DENSE_PAGES_MAX - 1);
        let model_gone = model.split_off(&(DENSE_PAGES_MAX - 1));
        assert_eq!(gone_dirty, model_gone.values().filter(|t| *t % 2 == 1).count());
        assert!(map.dirty_from(DENSE_PAGES_MAX - 1).next().is_none());
        assert_eq!(gone.iter().map(|p| p.data[0]).collect::<Vec<_>>(), model_gone.values().copied().collect::<Vec<_>>());
        assert_eq!(seen(&map), model.iter().map(|(&i, &t)| (i, t)).collect::<Vec<_>>());
        assert!(map.set_clean(7) && !map.is_dirty(7) && !map.set_clean(7));
        assert_eq!(map.split_off(0).0.len(), model.len());
        assert!(map.iter().next().is_none() && map.dense.capacity() == 0);
    }
}
