//! The directory stream API (`opendir`, `readdir`, ...) for every directory of the process,
//! kura's and the kernel's alike, on top of `getdents64`: one implementation, so a `DIR *`
//! is always ours. Its first field is the descriptor, where glibc keeps it, so glibc's
//! (unpatchable, three-byte) `dirfd` works unchanged.

use std::ffi::{c_char, c_int, c_long, c_void};

use crate::hooks::{self, errno, set_errno};

/// Bytes of directory entries read per `getdents64`.
const DIR_BUF_BYTES: usize = 32 << 10;

#[repr(C)]
pub struct KDir {
    /// Must stay first (glibc's `dirfd` reads it).
    fd: c_int,
    _pad: c_int,
    pos: usize,
    len: usize,
    /// `d_off` of the entry last returned (for `telldir`).
    last_off: i64,
    buf: [u8; DIR_BUF_BYTES],
}


/// `getdents64` for any descriptor.
fn getdents(fd: c_int, buf: *mut u8, count: usize) -> c_long {
    if let Some(state) = hooks::active_state()
        && let Some(of) = state.fds.get(fd)
    {
        return match hooks::kura_getdents(state, &of, buf, count) {
            Ok(n) => n,
            Err(e) => {
                set_errno(e);
                -1
            }
        };
    }
    // SAFETY: passing the caller's buffer to the kernel.
    unsafe { crate::raw_syscall!(libc::SYS_getdents64, fd, buf, count) }
}

pub extern "C" fn h_getdents64(fd: c_int, buf: *mut c_void, count: usize) -> isize {
    std::panic::catch_unwind(|| getdents(fd, buf.cast(), count) as isize).unwrap_or_else(|_| {
        set_errno(libc::EIO);
        -1
    })
}

fn new_dir(fd: c_int) -> *mut KDir {
    let layout = std::alloc::Layout::new::<KDir>();
    // SAFETY: a non-zero-sized layout; zeroed memory is a valid KDir.
    let d = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<KDir>();
    if d.is_null() {
        set_errno(libc::ENOMEM);
        return d;
    }
    // SAFETY: `d` is a fresh KDir.
    unsafe { (*d).fd = fd };
    d
}

fn is_directory(fd: c_int) -> Result<(), i32> {
    // SAFETY: all-zero is a valid struct stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if hooks::dispatch_fstat(fd, &mut st) != 0 {
        return Err(errno());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(libc::ENOTDIR);
    }
    Ok(())
}

pub extern "C" fn h_fdopendir(fd: c_int) -> *mut KDir {
    std::panic::catch_unwind(|| match is_directory(fd) {
        Ok(()) => new_dir(fd),
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    })
    .unwrap_or(std::ptr::null_mut())
}

fn opendir_at(dirfd: c_int, path: *const c_char) -> *mut KDir {
    let fd = hooks::dispatch_openat(dirfd, path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NONBLOCK);
    if fd < 0 {
        return std::ptr::null_mut();
    }
    let d = new_dir(fd);
    if d.is_null() {
        hooks::dispatch_close(fd);
    }
    d
}

pub extern "C" fn h_opendir(path: *const c_char) -> *mut KDir {
    std::panic::catch_unwind(|| opendir_at(libc::AT_FDCWD, path)).unwrap_or(std::ptr::null_mut())
}

pub extern "C" fn h_closedir(d: *mut KDir) -> c_int {
    if d.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: `d` came from our opendir/fdopendir.
    let fd = unsafe { (*d).fd };
    // SAFETY: freeing what new_dir allocated with the same layout.
    unsafe { std::alloc::dealloc(d.cast(), std::alloc::Layout::new::<KDir>()) };
    hooks::dispatch_close(fd)
}

/// The next entry, or NULL at the end (errno unchanged) or on error (errno set).
pub extern "C" fn h_readdir(d: *mut KDir) -> *mut libc::dirent64 {
    if d.is_null() {
        set_errno(libc::EBADF);
        return std::ptr::null_mut();
    }
    // SAFETY: `d` came from our opendir/fdopendir and is used by one thread at a time
    // (readdir's contract).
    let dir = unsafe { &mut *d };
    if dir.pos >= dir.len {
        let saved = errno();
        let n = getdents(dir.fd, dir.buf.as_mut_ptr(), DIR_BUF_BYTES);
        if n <= 0 {
            if n == 0 {
                set_errno(saved);
            }
            return std::ptr::null_mut();
        }
        dir.pos = 0;
        dir.len = n as usize;
    }
    let rec = dir.buf[dir.pos..].as_mut_ptr().cast::<libc::dirent64>();
    // SAFETY: the kernel (or kura_getdents) wrote whole, 8-aligned records into the buffer.
    let (reclen, off) = unsafe { ((*rec).d_reclen as usize, (*rec).d_off) };
    dir.pos += reclen.max(1);
    dir.last_off = off;
    rec
}

pub extern "C" fn h_readdir_r(d: *mut KDir, entry: *mut libc::dirent64, result: *mut *mut libc::dirent64) -> c_int {
    let saved = errno();
    set_errno(0);
    let e = h_readdir(d);
    let err = errno();
    set_errno(saved);
    // SAFETY: readdir_r's contract: `result` is writable; `entry` holds a struct dirent64.
    unsafe {
        if e.is_null() {
            *result = std::ptr::null_mut();
            return err;
        }
        let len = ((*e).d_reclen as usize).min(std::mem::size_of::<libc::dirent64>());
        std::ptr::copy_nonoverlapping(e.cast::<u8>(), entry.cast::<u8>(), len);
        *result = entry;
    }
    0
}

pub extern "C" fn h_seekdir(d: *mut KDir, pos: c_long) {
    if d.is_null() {
        return;
    }
    // SAFETY: our DIR.
    let dir = unsafe { &mut *d };
    hooks::dispatch_lseek(dir.fd, pos);
    dir.pos = 0;
    dir.len = 0;
    dir.last_off = pos;
}

pub extern "C" fn h_rewinddir(d: *mut KDir) {
    h_seekdir(d, 0);
}

pub extern "C" fn h_telldir(d: *mut KDir) -> c_long {
    if d.is_null() {
        set_errno(libc::EBADF);
        return -1;
    }
    // SAFETY: our DIR.
    unsafe { (*d).last_off }
}

type Filter = Option<unsafe extern "C" fn(*const libc::dirent64) -> c_int>;
type Compare = Option<unsafe extern "C" fn(*const *const libc::dirent64, *const *const libc::dirent64) -> c_int>;

fn scan(d: *mut KDir, namelist: *mut *mut *mut libc::dirent64, filter: Filter, compar: Compare) -> c_int {
    if d.is_null() {
        return -1;
    }
    let mut list: Vec<*mut libc::dirent64> = Vec::new();
    let free_all = |list: &Vec<*mut libc::dirent64>| {
        for &p in list {
            // SAFETY: each was malloc'ed below.
            unsafe { libc::free(p.cast()) };
        }
    };
    loop {
        set_errno(0);
        let e = h_readdir(d);
        if e.is_null() {
            if errno() != 0 {
                free_all(&list);
                h_closedir(d);
                return -1;
            }
            break;
        }
        if let Some(f) = filter
            // SAFETY: `filter` is the caller's function taking an entry.
            && unsafe { f(e) } == 0
        {
            continue;
        }
        // SAFETY: copying one record into memory the caller frees with free().
        unsafe {
            let len = (*e).d_reclen as usize;
            let copy = libc::malloc(len.max(std::mem::size_of::<libc::dirent64>())).cast::<libc::dirent64>();
            if copy.is_null() {
                free_all(&list);
                h_closedir(d);
                set_errno(libc::ENOMEM);
                return -1;
            }
            std::ptr::copy_nonoverlapping(e.cast::<u8>(), copy.cast::<u8>(), len);
            list.push(copy);
        }
    }
    h_closedir(d);
    // SAFETY: the caller frees the array with free(); qsort gets its comparator as given.
    unsafe {
        let bytes = list.len().max(1) * std::mem::size_of::<*mut libc::dirent64>();
        let array = libc::malloc(bytes).cast::<*mut libc::dirent64>();
        if array.is_null() {
            free_all(&list);
            set_errno(libc::ENOMEM);
            return -1;
        }
        std::ptr::copy_nonoverlapping(list.as_ptr(), array, list.len());
        if let Some(cmp) = compar {
            let cmp: unsafe extern "C" fn(*const c_void, *const c_void) -> c_int = std::mem::transmute(cmp);
            libc::qsort(array.cast(), list.len(), std::mem::size_of::<*mut libc::dirent64>(), Some(cmp));
        }
        *namelist = array;
    }
    list.len() as c_int
}

pub extern "C" fn h_scandir(path: *const c_char, namelist: *mut *mut *mut libc::dirent64, filter: Filter, compar: Compare) -> c_int {
    std::panic::catch_unwind(|| scan(opendir_at(libc::AT_FDCWD, path), namelist, filter, compar)).unwrap_or(-1)
}

pub extern "C" fn h_scandirat(dirfd: c_int, path: *const c_char, namelist: *mut *mut *mut libc::dirent64, filter: Filter, compar: Compare) -> c_int {
    std::panic::catch_unwind(|| scan(opendir_at(dirfd, path), namelist, filter, compar)).unwrap_or(-1)
}
