"""SEEK_DATA and SEEK_HOLE over a sparse file, printed one answer per line (errno names for
errors), so that a run on a kernel file system and one on kura can be compared line by line.

Usage: seek_holes.py DIR. Writes at 4 KiB boundaries only: file systems report holes at their
block size (ext4, xfs and kura's default chunk: 4 KiB)."""

import errno
import os
import sys

KIB = 1024
MIB = 1024 * KIB


def seek(fd, offset, whence):
    try:
        return str(os.lseek(fd, offset, whence))
    except OSError as e:
        return errno.errorcode[e.errno]


def report(name, fd, offsets):
    for offset in offsets:
        print(f"{name} data {offset} -> {seek(fd, offset, os.SEEK_DATA)}")
        print(f"{name} hole {offset} -> {seek(fd, offset, os.SEEK_HOLE)}")


def main():
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)

    # Data at 0, 1 MiB + 8 KiB (two blocks), 2 MiB (unaligned length); a hole to 3 MiB.
    path = os.path.join(d, "sparse")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(fd, b"a" * 4 * KIB, 0)
    os.pwrite(fd, b"b" * 8 * KIB, MIB + 8 * KIB)
    os.pwrite(fd, b"c" * 100, 2 * MIB)
    os.ftruncate(fd, 3 * MIB)
    offsets = [0, 100, 4 * KIB, 5 * KIB, MIB, MIB + 8 * KIB, MIB + 12 * KIB, MIB + 16 * KIB, 2 * MIB, 2 * MIB + 50, 2 * MIB + 4 * KIB, 3 * MIB - 1, 3 * MIB, 4 * MIB]
    report("buffered", fd, offsets)  # before anything is flushed
    os.fsync(fd)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    report("reopened", fd, offsets)
    # The offset moves to the answer; a failed seek leaves it.
    os.lseek(fd, 0, os.SEEK_SET)
    os.lseek(fd, 5 * KIB, os.SEEK_DATA)
    print("offset after SEEK_DATA", os.lseek(fd, 0, os.SEEK_CUR))
    seek(fd, 3 * MIB, os.SEEK_DATA)
    print("offset after ENXIO", os.lseek(fd, 0, os.SEEK_CUR))
    os.close(fd)

    # A file that is all data, and an empty one.
    full = os.path.join(d, "full")
    with open(full, "wb") as f:
        f.write(os.urandom(64 * KIB))
    fd = os.open(full, os.O_RDONLY)
    report("full", fd, [0, 60 * KIB, 64 * KIB])
    os.close(fd)
    empty = os.path.join(d, "empty")
    open(empty, "wb").close()
    fd = os.open(empty, os.O_RDONLY)
    report("empty", fd, [0])
    os.close(fd)

    # A hole punched in the middle of data.
    punched = os.path.join(d, "punched")
    with open(punched, "wb") as f:
        f.write(b"p" * 64 * KIB)
    fd = os.open(punched, os.O_RDWR)
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(16 * KIB), ctypes.c_long(16 * KIB))
    print("punch", rc, errno.errorcode.get(ctypes.get_errno(), 0) if rc else "")
    report("punched", fd, [0, 16 * KIB, 20 * KIB, 32 * KIB])
    os.close(fd)


main()
