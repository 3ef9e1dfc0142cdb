//! Heap buffers aligned for `O_DIRECT`.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every I/O buffer: a 4 KiB page satisfies every device's DMA alignment.
pub const IO_ALIGNMENT_BYTES: usize = 4096;
/// A transparent huge page (x86-64; arm64 with 4 KiB pages): the alignment of buffers from
/// [`AlignedBuf::zeroed_huge`] of at least this size.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A zero-initialised byte buffer whose start is aligned to [`IO_ALIGNMENT_BYTES`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    align: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes; the allocation is rounded up to the alignment.
    pub fn zeroed(len: usize) -> Self {
        let capacity = len.max(1).next_multiple_of(IO_ALIGNMENT_BYTES);
        let layout = Self::layout(capacity, IO_ALIGNMENT_BYTES);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len, capacity, align: IO_ALIGNMENT_BYTES }
    }

    /// A zeroed buffer of `len` bytes backed by transparent huge pages where the kernel allows
    /// (`MADV_HUGEPAGE`), for long-lived block-sized buffers that `O_DIRECT` writes or reads
    /// whole. Their physically contiguous memory reaches the block layer as a few large
    /// segments instead of one per 4 KiB page: on a virtio disk (254 segments per request),
    /// four threads writing 8 MiB blocks took 6 ms per block instead of 11-12, and pinning the
    /// pages for `O_DIRECT` costs less. Below [`HUGE_PAGE_BYTES`] this is
    /// [`AlignedBuf::zeroed`]. Faulting in fresh huge pages costs more than reusing small ones,
    /// so keep such buffers (in a pool) rather than reallocate.
    pub fn zeroed_huge(len: usize) -> Self {
        let capacity = len.max(1).next_multiple_of(IO_ALIGNMENT_BYTES);
        if capacity < HUGE_PAGE_BYTES {
            return Self::zeroed(len);
        }
        let layout = Self::layout(capacity, HUGE_PAGE_BYTES);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        // Advised before the first touch, so that the zeroing below faults in huge pages.
        // Advice is a hint: where it is refused (huge pages off) the buffer is as usual.
        // SAFETY: the range is exactly the allocation just made, which is page-aligned.
        unsafe { libc::madvise(raw.cast(), capacity, libc::MADV_HUGEPAGE) };
        // SAFETY: `raw` is valid for writes of `capacity` bytes.
        unsafe { std::ptr::write_bytes(raw, 0, capacity) };
        Self { ptr, len, capacity, align: HUGE_PAGE_BYTES }
    }

    fn layout(capacity: usize, align: usize) -> Layout {
        Layout::from_size_align(capacity, align).expect("I/O buffer layout")
    }

    /// Bytes the buffer can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Changes the visible length within the capacity; new bytes are whatever was there (zero
    /// when never written).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "AlignedBuf::set_len past capacity");
        self.len = len;
    }
}

/// The least capacity of a new buffer from [`ReadBuffers::take`]: two 4 KiB pages.
pub const READ_BUFFER_BYTES_MIN: usize = 2 * IO_ALIGNMENT_BYTES;

/// Read buffers one thread keeps for its next reads, at most `max` of them, so that a read
/// neither allocates nor zeroes one. A reused buffer keeps its old bytes: it is for reads,
/// where a read that does not fill its buffer whole is an error.
#[derive(Debug)]
pub struct ReadBuffers {
    spare: Vec<AlignedBuf>,
    max: usize,
}

impl ReadBuffers {
    pub fn new(max: usize) -> Self {
        Self { spare: Vec::new(), max }
    }

    /// A buffer of `len` bytes: a spare one when one is large enough (smaller ones met on
    /// the way are dropped), else a new zeroed one.
    pub fn take(&mut self, len: usize) -> AlignedBuf {
        while let Some(mut buf) = self.spare.pop() {
            if buf.capacity() >= len {
                buf.set_len(len);
                return buf;
            }
        }
        // Rounded up so that the buffer serves any later read up to that size: reads of one
        // record span one or two 4 KiB pages depending on where it lies, and a spare buffer of
        // one page met by a read of two would be dropped and another zeroed in its place.
        let mut buf = AlignedBuf::zeroed(len.max(READ_BUFFER_BYTES_MIN));
        buf.set_len(len);
        buf
    }

    /// Keeps `buf` for a later read, unless `max` are kept already.
    pub fn put(&mut self, buf: AlignedBuf) {
        if self.spare.len() < self.max {
            self.spare.push(buf);
        }
    }

    /// Buffers kept.
    pub fn len(&self) -> usize {
        self.spare.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spare.is_empty()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` or `zeroed_huge` with this exact layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.capacity, self.align)) }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for `capacity >= len` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % IO_ALIGNMENT_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
            if len > 0 {
                buf[len - 1] = 7;
                assert_eq!(buf[len - 1], 7);
            }
        }
    }

    #[test]
    fn read_buffers_reuse_large_enough_spares_and_stay_bounded() {
        let mut buffers = ReadBuffers::new(2);
        assert_eq!(buffers.take(4608).len(), 4608, "a new buffer when none is kept");
        let big = AlignedBuf::zeroed(8192);
        let big_ptr = big.as_ptr();
        buffers.put(big);
        buffers.put(AlignedBuf::zeroed(512));
        let buf = buffers.take(4608);
        assert_eq!(buf.as_ptr(), big_ptr, "the large-enough spare, past the small one");
        assert_eq!(buf.len(), 4608);
        assert!(buffers.is_empty(), "the small spare was dropped on the way");
        for _ in 0..5 {
            buffers.put(AlignedBuf::zeroed(4096));
        }
        assert_eq!(buffers.len(), 2, "at most `max` kept");
    }

    #[test]
    fn a_new_read_buffer_serves_reads_of_one_or_two_pages() {
        let mut buffers = ReadBuffers::new(4);
        let one_page = buffers.take(4096);
        assert_eq!(one_page.len(), 4096);
        assert!(one_page.capacity() >= READ_BUFFER_BYTES_MIN);
        let ptr = one_page.as_ptr();
        buffers.put(one_page);
        // A record over a page boundary needs two pages: the same buffer serves it.
        let two_pages = buffers.take(5120);
        assert_eq!((two_pages.as_ptr(), two_pages.len()), (ptr, 5120));
        // A read larger than the least capacity gets a buffer of its own size.
        assert_eq!(buffers.take(3 * 4096 + 512).capacity(), 4 * 4096);
    }

    #[test]
    fn huge_buffers_are_aligned_and_zeroed() {
        for len in [0, 4096, HUGE_PAGE_BYTES - 1, HUGE_PAGE_BYTES, 4 * HUGE_PAGE_BYTES + 512] {
            let mut buf = AlignedBuf::zeroed_huge(len);
            assert_eq!(buf.len(), len);
            let align = if len.next_multiple_of(IO_ALIGNMENT_BYTES) >= HUGE_PAGE_BYTES { HUGE_PAGE_BYTES } else { IO_ALIGNMENT_BYTES };
            assert_eq!(buf.as_ptr() as usize % align, 0, "{len} bytes");
            assert!(buf.iter().all(|&b| b == 0));
            buf.set_len(buf.capacity());
            buf.fill(3);
        }
    }
}
