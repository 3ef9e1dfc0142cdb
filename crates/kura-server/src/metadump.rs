//! `lru_crawler metadump`: one line per live item, as memcached 1.6 prints them.
//!
//! memcached walks its LRUs in its crawler thread and streams the lines to the client; kura
//! walks the store with [`kura_engine::Engine::scan`] (every block read once) on a thread of
//! its own, which hands the lines to the connection's worker in chunks through a bounded
//! channel and wakes it: the worker sends them as the socket drains, so a dump of any size
//! holds at most [`CHANNEL_CHUNKS`] × [`CHUNK_BYTES`] plus the connection's output limit, and
//! the worker keeps serving its other connections meanwhile. One dump runs at a time in the
//! server (memcached's crawler is one too: a second gets `BUSY`).
//!
//! A line: `key=<key, URI-encoded> exp=<-1 or Unix time> la=<Unix time> cas=<cas> fetch=no
//! cls=<class> size=<bytes>\n`, then `END\r\n`. kura records no access times and no fetched
//! bit: `la` is when the item was stored, `fetch` is `no`. `cls` and `size` are what
//! memcached with its default slab classes (`-n 48 -f 1.25`) would report for the item,
//! so that tools which read them see familiar numbers; kura has no slabs.
//!
//! `lru_crawler mgdump` (memcached 1.6.19+) walks the same items and prints each as a meta
//! get, `mg <key>\r\n`, then `EN\r\n`: a list that can be sent back to a server as it is
//! (memcached's `mcdumpload` copies a cache that way, appending its flags to each line). A key
//! that is not a text key (it was stored base64-encoded, with `b`, and holds a space or a
//! control byte) is printed base64-encoded with ` b`, as memcached prints keys it stored
//! binary; kura does not record how a key was sent, so a binary key that happens to be text
//! is printed as text, which names the same item.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use kura_proto::MetadumpClasses;

use crate::record::RecordView;
use crate::store::{Liveness, Store};

/// Bytes of lines handed to the worker at a time.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// Chunks waiting for the worker, at most.
pub const CHANNEL_CHUNKS: usize = 4;
/// How long a dump whose channel is full waits before it tries again (and looks whether it
/// should stop).
const CHANNEL_FULL_PAUSE: Duration = Duration::from_millis(2);
/// memcached's item header (`sizeof(item)` on 64-bit) and CAS field, for `size=`.
const MEMCACHED_ITEM_HEADER_BYTES: usize = 48;
const MEMCACHED_CAS_BYTES: usize = 8;
const MEMCACHED_CLIENT_FLAGS_BYTES: usize = 4;
/// memcached's chunk alignment and largest chunk (half its default 1 MiB item size).
const SLAB_ALIGN_BYTES: usize = 8;
const SLAB_CHUNK_MAX_BYTES: usize = 512 * 1024;

/// The reply when a dump is already running.
pub const BUSY_REPLY: &[u8] = b"BUSY currently processing crawler request\r\n";
pub const BADCLASS_REPLY: &[u8] = b"BADCLASS invalid class id\r\n";
const END_REPLY: &[u8] = b"END\r\n";
const MG_END_REPLY: &[u8] = b"EN\r\n";

/// What a dump prints of each item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DumpFormat {
    /// `lru_crawler metadump`: `key=… exp=… la=… cas=… fetch=… cls=… size=…`, then `END`.
    Metadump,
    /// `lru_crawler mgdump`: `mg <key>`, then `EN`.
    Mg,
}

impl DumpFormat {
    fn end(self) -> &'static [u8] {
        match self {
            Self::Metadump => END_REPLY,
            Self::Mg => MG_END_REPLY,
        }
    }
}
const SHUTDOWN_REPLY: &[u8] = b"SERVER_ERROR metadump stopped: server shutting down\r\n";

/// A running dump, as its connection holds it.
pub struct Dump {
    pub chunks: Receiver<Vec<u8>>,
    /// Set when its connection closed: the dump stops at its next item.
    pub stop: Arc<AtomicBool>,
    /// Set when the server shuts down: the dump stops and says so.
    pub shutdown: Arc<AtomicBool>,
    /// The dump's thread; its last chunk ends with `END` or an error line.
    pub thread: JoinHandle<()>,
    /// The worker stopped taking chunks because the connection's output was full (it takes
    /// more once that drains below its limit; nothing else would wake it for them).
    pub room_limited: bool,
}

/// Starts a dump of the items of `classes` on a thread of its own; `wake` is called
/// whenever a chunk is ready and when the dump ends (the worker then drains the channel).
/// `running` is the server's one-dump flag, set by the caller and cleared when the thread ends.
pub fn start(store: Arc<Store>, classes: MetadumpClasses, format: DumpFormat, wake: Arc<dyn Fn() + Send + Sync>, running: Arc<AtomicBool>) -> std::io::Result<Dump> {
    let (tx, chunks) = sync_channel(CHANNEL_CHUNKS);
    let stop = Arc::new(AtomicBool::new(false));
    let shutdown = Arc::new(AtomicBool::new(false));
    let (thread_stop, thread_shutdown) = (Arc::clone(&stop), Arc::clone(&shutdown));
    let thread = std::thread::Builder::new().name("kura-metadump".into()).spawn(move || {
        // Clears the server's flag however the dump ends (a panic included).
        let running = ClearOnDrop(running);
        let sender = ChunkSender { tx, stop: thread_stop, shutdown: thread_shutdown, wake: Arc::clone(&wake) };
        run(&store, classes, format, &sender);
        // The flag is clear before the channel closes, so that the connection's next dump,
        // parsed as soon as the worker sees the close, is not refused; then the worker is
        // woken to see it.
        drop(running);
        drop(sender);
        wake();
    })?;
    Ok(Dump { chunks, stop, shutdown, thread, room_limited: false })
}

/// Clears the server's one-crawler-job flag (`lru_crawler_running`) when dropped: at the end
/// of a dump's or a crawl's thread, however it ends (a panic included).
pub struct ClearOnDrop(pub Arc<AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

struct ChunkSender {
    tx: SyncSender<Vec<u8>>,
    stop: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
    wake: Arc<dyn Fn() + Send + Sync>,
}

impl ChunkSender {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.shutdown.load(Ordering::Acquire)
    }

    /// Hands a chunk to the worker, waiting while the channel is full. False when the dump
    /// must end (its connection is gone, or it was told to stop).
    fn send(&self, mut chunk: Vec<u8>) -> bool {
        loop {
            match self.tx.try_send(chunk) {
                Ok(()) => {
                    (self.wake)();
                    return true;
                }
                Err(TrySendError::Disconnected(_)) => return false,
                Err(TrySendError::Full(back)) => {
                    // Only a connection that is gone ends the wait: at shutdown the worker
                    // still sends what is queued (until its drain time), the error line last.
                    if self.stop.load(Ordering::Acquire) {
                        return false;
                    }
                    chunk = back;
                    std::thread::sleep(CHANNEL_FULL_PAUSE);
                }
            }
        }
    }
}

fn run(store: &Store, classes: MetadumpClasses, format: DumpFormat, sender: &ChunkSender) {
    let mut chunk = Vec::with_capacity(CHUNK_BYTES + 512);
    let mut gone = false;
    let scanned = store.engine().scan(&mut |r| {
        if sender.stopping() {
            return false;
        }
        let Ok(view) = RecordView::parse(r.value) else {
            return true; // not an item record (the engine's checksums passed: another writer's)
        };
        if store.liveness(&view.meta) != Liveness::Live {
            return true;
        }
        match format {
            DumpFormat::Metadump => item_line(&mut chunk, store, view.key(r.value), &view, r.version, &classes),
            DumpFormat::Mg => mg_line(&mut chunk, store.slab_classes(), view.key(r.value), &view, &classes),
        }
        if chunk.len() >= CHUNK_BYTES && !sender.send(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_BYTES + 512))) {
            gone = true;
            return false;
        }
        true
    });
    if gone || sender.stop.load(Ordering::Acquire) {
        return;
    }
    match scanned {
        _ if sender.shutdown.load(Ordering::Acquire) => chunk.extend_from_slice(SHUTDOWN_REPLY),
        Ok(_) => chunk.extend_from_slice(format.end()),
        Err(error) => {
            tracing::error!(%error, "metadump: reading the store failed");
            chunk.extend_from_slice(format!("SERVER_ERROR metadump failed: {error}\r\n").as_bytes());
        }
    }
    sender.send(chunk);
}

/// Appends the item's line if its class is among `classes`.
pub fn item_line(out: &mut Vec<u8>, store: &Store, key: &[u8], view: &RecordView, version: u64, classes: &MetadumpClasses) {
    let meta = &view.meta;
    let (size, class) = store.slab_classes().size_and_class(key, view);
    if !classes.includes(class) {
        return;
    }
    out.extend_from_slice(b"key=");
    uri_encode(out, key);
    let exp = if meta.expire_at_s == 0 { -1 } else { meta.expire_at_s };
    let la = meta.set_time_us / 1_000_000;
    out.extend_from_slice(format!(" exp={exp} la={la} cas={} fetch=no cls={class} size={size}\n", store.item_cas(meta, version)).as_bytes());
}

/// Appends the item's `mg <key>` line if its class is among `classes` (memcached's
/// `crawler_mgdump_eval`): the key as it is, or base64-encoded with ` b` if it is not a text
/// key.
pub fn mg_line(out: &mut Vec<u8>, slabs: &SlabClasses, key: &[u8], view: &RecordView, classes: &MetadumpClasses) {
    let (_, class) = slabs.size_and_class(key, view);
    if !classes.includes(class) {
        return;
    }
    out.extend_from_slice(b"mg ");
    if kura_proto::is_text_key(key) {
        out.extend_from_slice(key);
        out.extend_from_slice(b"\r\n");
    } else {
        kura_proto::encode_base64(key, out);
        out.extend_from_slice(b" b\r\n");
    }
}

/// memcached's slab classes as `-f`, `-n` and `-C` make them. kura has no slab allocator,
/// but names an item's class and size (`cls=`, `size=`, `clsid=`, the crawler's class lists)
/// as memcached with the same options would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlabClasses {
    /// Each class's largest item, ascending (class 1 first); the last class takes every
    /// bigger item too (memcached stores those chunked in it).
    chunk_bytes: Vec<usize>,
    /// The CAS field in each item, 0 with `-C`.
    cas_bytes: usize,
}

impl Default for SlabClasses {
    fn default() -> Self {
        Self::new(crate::config::SLAB_GROWTH_FACTOR_DEFAULT, crate::config::SLAB_CHUNK_SIZE_DEFAULT, true)
    }
}

impl SlabClasses {
    /// As memcached's `slabs_init`: the smallest chunk is the item header plus `chunk_size`
    /// (`-n`), each next one the previous × `growth_factor` (`-f`, above 1), aligned to 8;
    /// the class reached once the product passes the largest chunk / factor is the last, with
    /// the largest chunk.
    pub fn new(growth_factor: f64, chunk_size: u32, cas_enabled: bool) -> Self {
        let mut chunk_bytes = Vec::new();
        let mut chunk = MEMCACHED_ITEM_HEADER_BYTES + chunk_size as usize;
        loop {
            let class = chunk_bytes.len() as u32 + 1;
            if chunk as f64 >= SLAB_CHUNK_MAX_BYTES as f64 / growth_factor || class == MetadumpClasses::CLASS_MAX {
                chunk_bytes.push(usize::MAX);
                break;
            }
            let aligned = chunk.next_multiple_of(SLAB_ALIGN_BYTES);
            chunk_bytes.push(aligned);
            chunk = (aligned as f64 * growth_factor) as usize;
        }
        Self { chunk_bytes, cas_bytes: if cas_enabled { MEMCACHED_CAS_BYTES } else { 0 } }
    }

    /// memcached's `ITEM_ntotal`: header, key and its NUL, data and its `\r\n`, CAS (unless
    /// `-C`), and client flags when they are not zero.
    pub fn item_bytes(&self, key_len: usize, client_flags: u32, data_len: usize) -> usize {
        let flags = if client_flags != 0 { MEMCACHED_CLIENT_FLAGS_BYTES } else { 0 };
        MEMCACHED_ITEM_HEADER_BYTES + key_len + 1 + data_len + 2 + self.cas_bytes + flags
    }

    /// The class (1-based) of an item of `size` bytes.
    pub fn class(&self, size: usize) -> u32 {
        let index = self.chunk_bytes.partition_point(|&chunk| chunk < size);
        index.min(self.chunk_bytes.len() - 1) as u32 + 1
    }

    /// The class of an item of this key, client flags and data length.
    pub fn class_of(&self, key_len: usize, client_flags: u32, data_len: usize) -> u32 {
        self.class(self.item_bytes(key_len, client_flags, data_len))
    }

    /// The item's `size=` and class.
    pub fn size_and_class(&self, key: &[u8], view: &RecordView) -> (usize, u32) {
        let size = self.item_bytes(key.len(), view.meta.client_flags, view.data_len());
        (size, self.class(size))
    }
}

/// memcached's `uriencode`: letters, digits and `-._~` as they are, every other byte `%XX`.
pub fn uri_encode(out: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

/// The worker's side: moves ready chunks into `out` while it holds less than `room` bytes
/// (and notes in [`Dump::room_limited`] when that stopped it). Returns whether the dump has
/// ended (its channel closed after the last chunk).
pub fn drain(dump: &mut Dump, mut room: usize, out: &mut crate::output::Output) -> bool {
    dump.room_limited = false;
    loop {
        if room == 0 {
            dump.room_limited = true;
            return false;
        }
        match dump.chunks.try_recv() {
            Ok(chunk) => {
                room = room.saturating_sub(chunk.len());
                out.push_bytes(&chunk);
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => return false,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What memcached 1.6.18 printed for the same items (`set a%b 5 0 3`, `set k2 0 100 1`,
    /// `set big 0 0 5000`, `set k 0 0 1`).
    #[test]
    fn sizes_and_classes_as_memcached() {
        let slabs = SlabClasses::default();
        assert_eq!(slabs.item_bytes(3, 5, 3), 69);
        assert_eq!(slabs.item_bytes(2, 0, 1), 62);
        assert_eq!(slabs.item_bytes(1, 0, 1), 61);
        assert_eq!(slabs.item_bytes(3, 0, 5000), 5062);
        assert_eq!(slabs.class(61), 1);
        assert_eq!(slabs.class(96), 1);
        assert_eq!(slabs.class(97), 2);
        assert_eq!(slabs.class(5062), 19);
        // Classes never pass the largest memcached takes.
        assert_eq!(slabs.class(1 << 30), 39, "memcached's default classes: 39");
        let mut last = 0;
        for size in (1..(1 << 20)).step_by(997) {
            let class = slabs.class(size);
            assert!(class >= last, "classes grow with size");
            last = class;
        }
        // -C: no CAS field; memcached 1.6.18 -C said size=53 for `set a 0 0 1`.
        assert_eq!(SlabClasses::new(1.25, 48, false).item_bytes(1, 0, 1), 53);
        // -f 2 -n 16: chunks 64, 128, 256, ... (memcached 1.6.18 -f 2 -n 16: the 5,062-byte
        // item in class 8, 8,192 bytes).
        let doubling = SlabClasses::new(2.0, 16, true);
        assert_eq!((doubling.class(64), doubling.class(65), doubling.class(5062)), (1, 2, 8));
        // A factor so small that the classes run out: 63 at most.
        assert_eq!(SlabClasses::new(1.01, 1, true).class(1 << 30), MetadumpClasses::CLASS_MAX);
    }

    #[test]
    fn keys_are_uri_encoded() {
        let mut out = Vec::new();
        uri_encode(&mut out, b"a%b c/\xff-._~Z9");
        assert_eq!(out, b"a%25b%20c%2F%FF-._~Z9");
    }
}
