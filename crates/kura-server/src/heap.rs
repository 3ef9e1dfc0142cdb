//! Giving freed heap memory back to the kernel.
//!
//! glibc's allocator keeps the memory a program frees for its next
//! allocations; only free space at the very top of the heap goes back to the
//! kernel by itself. A server that loads millions of items frees many small,
//! short-lived buffers between long-lived ones (index parts, cached records),
//! so tens of MiB of free heap stayed resident after a bulk load — measured:
//! 37 MiB free of 46 MiB in the main arena after 2 million 100-byte SETs. The
//! housekeeping thread calls [`release_free_heap`] every
//! [`HEAP_TRIM_INTERVAL`], which returns whole free pages with `madvise`
//! (`malloc_trim`) once more than [`HEAP_FREE_TRIM_BYTES_MIN`] lie free.

use std::time::Duration;

/// How often the housekeeping thread looks at the heap's free memory.
pub const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(5);
/// Free heap bytes below which trimming is not worth the arena locks.
pub const HEAP_FREE_TRIM_BYTES_MIN: usize = 16 << 20;

/// What one look at the heap found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeapTrim {
    /// Bytes the allocator held free in its arenas before trimming.
    pub free_bytes: usize,
    /// Whether `malloc_trim` ran and gave memory back.
    pub released: bool,
}

/// Returns free heap pages to the kernel when more than
/// [`HEAP_FREE_TRIM_BYTES_MIN`] are free. A no-op where the C library is not
/// glibc.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_free_heap() -> HeapTrim {
    // SAFETY: mallinfo2 only reads the allocator's statistics under its own
    // locks; it has no preconditions.
    let info = unsafe { libc::mallinfo2() };
    let free_bytes = info.fordblks;
    if free_bytes < HEAP_FREE_TRIM_BYTES_MIN {
        return HeapTrim {
            free_bytes,
            released: false,
        };
    }
    // SAFETY: malloc_trim takes the arena locks itself and only returns
    // memory that no allocation uses; any thread may call it at any time.
    let released = unsafe { libc::malloc_trim(0) } == 1;
    HeapTrim {
        free_bytes,
        released,
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_heap() -> HeapTrim {
    HeapTrim::default()
}
