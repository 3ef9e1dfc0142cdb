"""The small-file phase of `kura bench fs`, run on each side (under the preload, on ext4,
through FUSE) by two processes one after the other, as a shell's commands are:

    bench_fs_tree.py make DIR FILES   makes DIR/d*/f* (FILES files of 100 bytes in 20
                                      directories): create, write, close per file
    bench_fs_tree.py use DIR FILES    walks the tree (os.walk), stats every file, opens,
                                      reads and closes every file twice, unlinks every file

Prints one JSON object: microseconds per file (per walk for walk_ms).
"""
import json
import os
import sys
import time

DIRS = 20
DATA = b"kura bench fs: a small file of one hundred bytes, as a source tree has many of them....\n"[:100]


def names(root, files):
    per_dir = max(1, -(-files // DIRS))
    return [os.path.join(root, f"d{i // per_dir}", f"f{i}") for i in range(files)]


def per_file_us(started, files):
    return (time.perf_counter() - started) / files * 1e6


def main():
    what, root, files = sys.argv[1], sys.argv[2], int(sys.argv[3])
    paths = names(root, files)
    out = {}
    if what == "make":
        os.makedirs(root, exist_ok=True)
        for d in sorted({os.path.dirname(p) for p in paths}):
            os.makedirs(d, exist_ok=True)
        started = time.perf_counter()
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, DATA)
            os.close(fd)
        out["create_us"] = per_file_us(started, files)
    else:
        # The file system's first use in a process (an embedded engine opens then) is not
        # timed.
        os.stat(root)
        started = time.perf_counter()
        seen = sum(len(f) for _, _, f in os.walk(root))
        out["walk_ms"] = (time.perf_counter() - started) * 1e3
        if seen != files:
            raise SystemExit(f"the walk found {seen} files of {files}")
        started = time.perf_counter()
        for p in paths:
            os.stat(p)
        out["stat_us"] = per_file_us(started, files)
        for key in ("read_us", "reread_us"):
            started = time.perf_counter()
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                data = os.read(fd, 4096)
                os.close(fd)
                if data != DATA:
                    raise SystemExit(f"{p}: read {data!r}")
            out[key] = per_file_us(started, files)
        started = time.perf_counter()
        for p in paths:
            os.unlink(p)
        out["unlink_us"] = per_file_us(started, files)
    print(json.dumps(out))


main()
