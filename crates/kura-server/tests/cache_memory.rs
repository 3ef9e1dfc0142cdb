//! `-m` bounds what the RAM cache really allocates, not only what it counts:
//! a counting allocator measures the heap the cache holds once full, and it
//! must stay within the limit (its charges include the allocator's own
//! rounding, which the counter does not see, so the bound is strict).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

use kura_server::cache::{CachedRecord, Probe, RamCache};
use kura_server::record::{ItemMeta, encode};

struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn record(key: &str, data_len: usize) -> Arc<CachedRecord> {
    let bytes = encode(key.as_bytes(), &ItemMeta::default(), &[&vec![b'x'; data_len]]);
    Arc::new(CachedRecord::parse(bytes.into_boxed_slice(), 1, 0).unwrap())
}

fn fill(cache: &RamCache, keys: usize, data_len: usize) {
    for i in 0..keys {
        let key = format!("key:{i:010}");
        let Probe::Miss { epoch } = cache.probe(key.as_bytes()) else {
            panic!("{key} cached before it was filled");
        };
        assert!(cache.fill(record(&key, data_len), epoch));
    }
}

#[test]
fn a_full_cache_allocates_no_more_than_its_limit() {
    for (data_len, limit_bytes) in [(10, 8 << 20), (100, 16 << 20), (4096, 32 << 20)] {
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        let cache = RamCache::new(limit_bytes);
        let doorkeeper = LIVE_BYTES.load(Ordering::Relaxed) - before;
        // Three times what fits, so the cache is full and has evicted.
        let fits = limit_bytes as usize / (data_len + 64);
        fill(&cache, 3 * fits, data_len);
        let held = (LIVE_BYTES.load(Ordering::Relaxed) - before - doorkeeper) as u64;
        let stats = cache.stats();
        assert!(
            stats.evictions > 0,
            "{data_len}-byte values: nothing evicted"
        );
        assert!(
            held <= limit_bytes,
            "{data_len}-byte values: the cache holds {held} heap bytes over a {limit_bytes}-byte limit ({} entries charged {} bytes)",
            stats.entries,
            stats.bytes
        );
        assert!(
            held >= limit_bytes / 2,
            "{data_len}-byte values: only {held} of {limit_bytes} bytes used; the charge per entry is far above its cost"
        );
        assert!(stats.bytes <= limit_bytes);
        drop(cache);
        assert!(
            LIVE_BYTES.load(Ordering::Relaxed) - before < 1 << 20,
            "{data_len}-byte values: dropping the cache freed its memory"
        );
    }
}
