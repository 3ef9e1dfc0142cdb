"""Per-call times of stat, open+read+close and stat of a missing name, 1,000 of each, in the
tree made by scripts/fs-read-ab.sh and scripts/fs-meta-ab.sh (both copy this file into their
work directory).

    python3 fs-stat-loop.py TREE
"""
import os
import sys
import time

b = sys.argv[1]
for p, what in [(b + "/d1/sub/f1.txt", "stat"), (b + "/d1/sub/f1.txt", "open+read+close"), (b + "/d1/sub/nope", "stat-missing")]:
    n = 1000
    t0 = time.perf_counter()
    for i in range(n):
        if what == "open+read+close":
            fd = os.open(p, os.O_RDONLY)
            os.read(fd, 4096)
            os.close(fd)
        else:
            try:
                os.stat(p)
            except FileNotFoundError:
                pass
    print(f"{what:28} {(time.perf_counter() - t0) / n * 1e6:8.1f} us")
