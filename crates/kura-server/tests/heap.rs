//! The housekeeping thread's heap trim really returns freed memory: this
//! runs alone in its own process so that RSS is only this test's.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use kura_server::heap::release_free_heap;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn freed_small_buffers_go_back_to_the_kernel() {
    // 64 MiB in 1 KiB buffers with a long-lived one after every 16, so
    // the heap's top stays pinned: freeing the rest leaves holes that
    // only trimming returns.
    let mut kept = Vec::new();
    let mut freed = Vec::new();
    for i in 0..65_536 {
        let buffer = vec![i as u8; 1024];
        if i % 16 == 15 {
            kept.push(buffer);
        } else {
            freed.push(buffer);
        }
    }
    let rss_full = rss_bytes();
    drop(freed);
    let trim = release_free_heap();
    let rss_after = rss_bytes();
    assert!(trim.free_bytes >= 48 << 20, "{trim:?}");
    assert!(trim.released, "{trim:?}");
    assert!(
        rss_after + (32 << 20) < rss_full,
        "RSS {rss_full} → {rss_after} after trimming"
    );
    assert_eq!(kept.len(), 4096);
    assert!(
        kept.iter()
            .enumerate()
            .all(|(i, b)| b[0] == (i * 16 + 15) as u8)
    );
}
