//! `lru_crawler crawl`: reclaiming expired and flushed items, as memcached's LRU crawler does.
//!
//! kura answers reads of an expired item with a miss without touching the record, so an
//! expired item keeps its room on flash until something replaces it. In cache mode the oldest
//! blocks are dropped whole when room runs out, expired or not; in store mode nothing is ever
//! dropped, and a store full of items that have all expired refused every write (`SERVER_ERROR
//! out of memory`) although no live data filled it. A crawl walks the store with
//! [`kura_engine::Engine::scan`] on a thread of its own and writes a tombstone for every item
//! that is no longer live (expired, or older than a `flush_all`), conditional on the record's
//! version, so that an item stored again meanwhile is never touched; garbage collection then
//! frees the room. It runs when a client asks (`lru_crawler crawl <classes>`) and, in store
//! mode, by itself when a write finds the store full and a crawl may find something: none ran
//! yet, an item the last one saw live has expired since, a `flush_all` came after it started,
//! or [`AUTO_CRAWL_INTERVAL_S`] passed since it ended (items stored with a time to live while
//! it ran). That write still fails; the ones after the crawl succeed. A store that live data
//! fills is not read through again and again.
//!
//! One crawler job runs at a time in the server, a crawl or a metadump (`BUSY` otherwise, as
//! memcached). `lru_crawler enable|disable|sleep|tocrawl` work as memcached's: `disable`
//! refuses crawls and dumps (`CLIENT_ERROR lru crawler disabled`), `sleep` pauses a crawl that
//! many microseconds after every [`ITEMS_PER_SLEEP`] items it looks at, `tocrawl` caps the
//! items looked at per class and crawl. `stats` counts `crawler_items_checked` and
//! `crawler_reclaimed`; `stats settings` shows `lru_crawler`, `lru_crawler_sleep` and
//! `lru_crawler_tocrawl`.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kura_proto::{CrawlerCommand, MetadumpClasses};

use crate::metadump::{BADCLASS_REPLY, BUSY_REPLY, ClearOnDrop};
use crate::record::RecordView;
use crate::stats::ConnStats;
use crate::store::{Liveness, Store};

/// memcached's default pause between batches of a crawl (`lru_crawler_sleep`), microseconds.
pub const SLEEP_US_DEFAULT: u32 = 100;
/// Items a crawl looks at between two pauses (memcached's `crawls_persleep`).
pub const ITEMS_PER_SLEEP: u64 = 1000;
/// A store-mode write that finds the store full starts a crawl, when no item the last crawl
/// saw live has expired since and no `flush_all` came after it, only once that crawl ended
/// this long ago (a crawl reads the whole store).
pub const AUTO_CRAWL_INTERVAL_S: u64 = 600;

const OK_REPLY: &[u8] = b"OK\r\n";
/// The reply to a crawl or a metadump while the crawler is disabled.
pub const DISABLED_REPLY: &[u8] = b"CLIENT_ERROR lru crawler disabled\r\n";
const ENABLE_FAILED_REPLY: &[u8] = b"ERROR failed to start lru crawler thread\r\n";
/// memcached's answer to `crawl hash` (hash order exists for dumps only).
const UNKNOWN_ERROR_REPLY: &[u8] = b"ERROR an unknown error happened\r\n";

/// The server's crawler: its settings, counters and the thread of the crawl running.
pub struct Crawler {
    store: Arc<Store>,
    /// `lru_crawler_running` (shared with metadump: one job at a time) and `lru_crawler_starts`.
    conns: Arc<ConnStats>,
    enabled: AtomicBool,
    sleep_us: AtomicU32,
    tocrawl: AtomicU32,
    /// `crawler_items_checked` and `crawler_reclaimed`.
    items_checked: AtomicU64,
    reclaimed: AtomicU64,
    shutdown: AtomicBool,
    /// When the last crawl ended, and the soonest an item it saw live expires (Unix seconds;
    /// `i64::MAX` when none has a time to live).
    last_end: Mutex<Option<Instant>>,
    next_expiry_s: AtomicI64,
    /// The `flush_all` horizon when the last crawl started.
    flush_horizon_us: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Crawler {
    pub fn new(store: Arc<Store>, conns: Arc<ConnStats>) -> Self {
        Self {
            store,
            conns,
            enabled: AtomicBool::new(true),
            sleep_us: AtomicU32::new(SLEEP_US_DEFAULT),
            tocrawl: AtomicU32::new(0),
            items_checked: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            last_end: Mutex::new(None),
            next_expiry_s: AtomicI64::new(i64::MAX),
            flush_horizon_us: AtomicU64::new(0),
            thread: Mutex::new(None),
        }
    }

    /// Whether crawls and dumps may run (`lru_crawler disable` turns them off).
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Runs an `lru_crawler` command; returns its reply line.
    pub fn command(self: &Arc<Self>, command: CrawlerCommand) -> &'static [u8] {
        match command {
            CrawlerCommand::Crawl(classes) => self.crawl(classes),
            CrawlerCommand::Enable => {
                if self.enabled.swap(true, Ordering::AcqRel) {
                    ENABLE_FAILED_REPLY
                } else {
                    OK_REPLY
                }
            }
            CrawlerCommand::Disable => {
                self.enabled.store(false, Ordering::Release);
                OK_REPLY
            }
            CrawlerCommand::Sleep(us) => {
                self.sleep_us.store(us, Ordering::Relaxed);
                OK_REPLY
            }
            CrawlerCommand::ToCrawl(items) => {
                self.tocrawl.store(items, Ordering::Relaxed);
                OK_REPLY
            }
        }
    }

    /// Starts a crawl of `classes`; returns the reply (`OK` once started).
    pub fn crawl(self: &Arc<Self>, classes: MetadumpClasses) -> &'static [u8] {
        if !self.enabled() {
            return DISABLED_REPLY;
        }
        match classes {
            MetadumpClasses::Invalid => return BADCLASS_REPLY,
            MetadumpClasses::Hash => return UNKNOWN_ERROR_REPLY,
            MetadumpClasses::All | MetadumpClasses::Classes(_) => {}
        }
        if self.shutdown.load(Ordering::Acquire) {
            return BUSY_REPLY;
        }
        let running = &self.conns.lru_crawler_running;
        if running.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return BUSY_REPLY;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("kura-crawler".into()).spawn(move || {
            let _running = ClearOnDrop(Arc::clone(&me.conns.lru_crawler_running));
            me.run(classes);
        });
        match spawned {
            Ok(handle) => {
                self.conns.lru_crawler_starts.fetch_add(1, Ordering::Relaxed);
                let mut thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(done) = thread.replace(handle) {
                    // The previous crawl cleared the flag as it ended: it is gone or going.
                    let _ = done.join();
                }
                OK_REPLY
            }
            Err(error) => {
                running.store(false, Ordering::Release);
                tracing::error!(%error, "could not start the crawler thread");
                UNKNOWN_ERROR_REPLY
            }
        }
    }

    /// A write found the store full: in store mode, crawl for expired items if a crawl may
    /// find some (see the module documentation) and crawls are enabled.
    pub fn store_full(self: &Arc<Self>) {
        if self.store.mode() != kura_engine::Mode::Store || !self.enabled() || self.conns.lru_crawler_running.load(Ordering::Acquire) {
            return;
        }
        let due = match *self.last_end.lock().unwrap_or_else(|e| e.into_inner()) {
            None => true,
            Some(ended) => {
                ended.elapsed() >= Duration::from_secs(AUTO_CRAWL_INTERVAL_S)
                    || crate::clock::unix_now_s() >= self.next_expiry_s.load(Ordering::Acquire)
                    || self.store.flush_horizon_us() > self.flush_horizon_us.load(Ordering::Acquire)
            }
        };
        if due && self.crawl(MetadumpClasses::All) == OK_REPLY {
            tracing::info!("the store is full: crawling it for expired items to reclaim");
        }
    }

    /// `crawler_items_checked` and `crawler_reclaimed`.
    pub fn counters(&self) -> (u64, u64) {
        (self.items_checked.load(Ordering::Relaxed), self.reclaimed.load(Ordering::Relaxed))
    }

    /// `lru_crawler_sleep` and `lru_crawler_tocrawl`.
    pub fn settings(&self) -> (u32, u32) {
        (self.sleep_us.load(Ordering::Relaxed), self.tocrawl.load(Ordering::Relaxed))
    }

    /// Stops a running crawl and waits for its thread (server shutdown).
    pub fn stop(&self) {
        self.shutdown.store(true, Ordering::Release);
        if let Some(handle) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = handle.join();
        }
    }

    fn run(&self, classes: MetadumpClasses) {
        let started = Instant::now();
        self.flush_horizon_us.store(self.store.flush_horizon_us(), Ordering::Release);
        let (sleep_us, tocrawl) = self.settings();
        let mut per_class = [0u32; MetadumpClasses::CLASS_MAX as usize + 1];
        let (mut checked, mut reclaimed) = (0u64, 0u64);
        let mut next_expiry_s = i64::MAX;
        let mut failed = None;
        let scanned = self.store.engine().scan(&mut |r| {
            if self.shutdown.load(Ordering::Acquire) {
                return false;
            }
            let Ok(view) = RecordView::parse(r.value) else {
                return true; // not an item record (the engine's checksums passed: another writer's)
            };
            let key = view.key(r.value);
            let (_, class) = self.store.slab_classes().size_and_class(key, &view);
            if !classes.includes(class) {
                return true;
            }
            let seen = &mut per_class[class as usize];
            if tocrawl > 0 && *seen >= tocrawl {
                return true;
            }
            *seen += 1;
            checked += 1;
            self.items_checked.fetch_add(1, Ordering::Relaxed);
            if self.store.liveness(&view.meta) == Liveness::Live {
                if view.meta.expire_at_s != 0 {
                    next_expiry_s = next_expiry_s.min(view.meta.expire_at_s);
                }
            } else {
                match self.store.reclaim(key, r.version) {
                    Ok(true) => {
                        reclaimed += 1;
                        self.reclaimed.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(error) => {
                        failed = Some(error);
                        return false;
                    }
                }
            }
            if sleep_us > 0 && checked.is_multiple_of(ITEMS_PER_SLEEP) {
                std::thread::sleep(Duration::from_micros(u64::from(sleep_us)));
            }
            true
        });
        self.next_expiry_s.store(next_expiry_s, Ordering::Release);
        *self.last_end.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        let elapsed_ms = started.elapsed().as_millis();
        match (scanned, failed) {
            (Err(error), _) => tracing::error!(%error, checked, reclaimed, "crawl: reading the store failed"),
            (Ok(_), Some(error)) => tracing::warn!(%error, checked, reclaimed, "crawl stopped: reclaiming an item failed"),
            (Ok(_), None) => tracing::info!(checked, reclaimed, elapsed_ms, "crawl done"),
        }
    }
}
