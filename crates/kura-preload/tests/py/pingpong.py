"""Two processes that open one file each for themselves (after a fork, by path: nothing is
shared through the fork) and write it in turns without locks, each reading right away what
the other just wrote. Each writes and fsyncs once first, once both have it open. Prints "coherent N" after N rounds,
or the first read that missed the other's write."""
import os, sys

path, rounds = sys.argv[1], int(sys.argv[2])
open(path, "wb").close()
to_child_r, to_child_w = os.pipe()
to_parent_r, to_parent_w = os.pipe()
pid = os.fork()
me, peer_at, my_at = ("child", 0, 8) if pid == 0 else ("parent", 8, 0)
inbox, outbox = (to_child_r, to_parent_w) if pid == 0 else (to_parent_r, to_child_w)
fd = os.open(path, os.O_RDWR)
# Both have the file open before either writes it back (the write-back that shows the other).
os.write(outbox, b"o")
os.read(inbox, 1)
os.pwrite(fd, b"%-7s\n" % me[:1].encode(), my_at)
os.fsync(fd)
os.write(outbox, b"s")
os.read(inbox, 1)
problem = None
for i in range(rounds):
    if pid != 0:
        os.pwrite(fd, b"p%06d\n" % i, 0)
        os.write(outbox, b"w")
        os.read(inbox, 1)
        got = os.pread(fd, 8, 8)
        if got != b"c%06d\n" % i and problem is None:
            problem = f"round {i}: the parent read {got!r}"
    else:
        os.read(inbox, 1)
        got = os.pread(fd, 8, 0)
        if got != b"p%06d\n" % i and problem is None:
            problem = f"round {i}: the child read {got!r}"
        os.pwrite(fd, b"c%06d\n" % i, 8)
        os.write(outbox, b"w")
os.close(fd)
if pid == 0:
    if problem:
        print(problem, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print(problem or f"coherent {rounds}")
