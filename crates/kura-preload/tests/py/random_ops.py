#!/usr/bin/env python3
"""Random file-system operations for a differential test (tests/random_ops.rs).

    random_ops.py ROOT FIRST_SEED SEEDS OPS [PROCESSES]

For each seed in FIRST_SEED .. FIRST_SEED+SEEDS-1, makes ROOT/s<seed> and performs OPS random
operations under it, printing one line per operation: "<seed> <index> <operation> = <result>",
the result being a value or an errno name. Nothing in a line depends on the root, on inode
numbers, descriptor numbers or the clock, so the same seed prints the same lines on any POSIX
file system that behaves like Linux's; the test compares kura's lines with the kernel's.

The namespace is small (three names, paths up to three deep) so that operations collide: opens
of directories, renames onto what exists, unlinks of open files, symlinks that dangle or loop.

With PROCESSES 2, each seed's operations are shared by this process and a second one (a worker,
run as `random_ops.py worker DIR SEED`), each with its own descriptors, taking turns in an
order drawn from the seed, one operation at a time; each line says which one made it ("A" or
"B"). What one process changed, read, holds open or closed shows in the other's next
operation, as on one kernel, given what POSIX promises between processes that share a file:
at a change of turns, the process whose turn ends takes and drops a POSIX lock on each file
it holds open, and so does the one whose turn begins (as NFS clients do, kura writes a file
back before a lock is dropped and looks at it again when one is taken).
"""

import ctypes
import errno
import fcntl
import hashlib
import os
import random
import stat
import subprocess
import sys

NAMES = ["a", "b", "c"]
# Path depths 1, 2 and 3, shallow ones more often (deep paths mostly miss).
DEPTH_WEIGHTS = [5, 3, 2]
# kura's default chunk (kura_fs::layout::CHUNK_SIZE_BYTES_DEFAULT): sizes and offsets cross it.
CHUNK_BYTES = 4096
IO_BYTES_MAX = 3 * CHUNK_BYTES + 17
OFFSET_MAX = 6 * CHUNK_BYTES
SLOTS_MAX = 6
# Symlink targets stay inside the seed's directory: no "..", no absolute path. A link that
# climbs out reaches different directories on the two sides (under the preload, past the
# mount, the host's own), and chains of links can climb any number of levels.
LINK_TARGETS = ["a", "b", "a/b", "c/a", "missing", "missing/a", "."]
SUFFIXES = ["", "/", "/.", "/.."]
SUFFIX_WEIGHTS = [20, 1, 1, 1]
MODES = [0o644, 0o600, 0o755, 0o444, 0o000, 0o1777]
# Explicit times for utime (ns): before 1970, sub-second, far future.
TIMES_NS = [0, 1_000_000_000, 1_234_567_891_234_567_891, -5_000_000_000, 4_000_000_000_123_456_789]

LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100

TYPE_NAMES = {stat.S_IFREG: "reg", stat.S_IFDIR: "dir", stat.S_IFLNK: "lnk"}


def describe_stat(st):
    kind = TYPE_NAMES.get(stat.S_IFMT(st.st_mode), "other")
    out = f"{kind} {stat.S_IMODE(st.st_mode):o} nlink={st.st_nlink}"
    # A directory's size is the file system's own business (ext4: blocks of entries).
    if kind != "dir":
        out += f" size={st.st_size}"
    return out


def digest(data):
    return f"{len(data)}:{hashlib.sha1(data).hexdigest()[:12]}"


class Run:
    def __init__(self, root, seed):
        self.root = root
        self.rng = random.Random(seed)
        self.slots = {}  # slot number -> descriptor

    def path(self):
        depth = self.rng.choices([1, 2, 3], DEPTH_WEIGHTS)[0]
        rel = "/".join(self.rng.choice(NAMES) for _ in range(depth))
        # Sometimes a tail that names the same thing as a directory: "a/" and "a/." must be
        # one, follow a symlink "a", and fail with ENOTDIR on a file.
        return rel + self.rng.choices(SUFFIXES, SUFFIX_WEIGHTS)[0]

    def full(self, rel):
        return os.path.join(self.root, rel)

    def data(self, size):
        return self.rng.randbytes(size)

    def size(self):
        # Mostly small, sometimes a few chunks, sometimes empty.
        return self.rng.choice([0, 1, 7, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, self.rng.randint(0, IO_BYTES_MAX)])

    def offset(self):
        return self.rng.choice([0, 1, CHUNK_BYTES - 3, CHUNK_BYTES, 2 * CHUNK_BYTES + 5, self.rng.randint(0, OFFSET_MAX)])

    def slot(self):
        """An open slot, or None."""
        if not self.slots:
            return None
        return self.rng.choice(sorted(self.slots))

    def free_slot(self):
        free = [s for s in range(SLOTS_MAX) if s not in self.slots]
        return free[0] if free else None

    # Each operation returns (description, callable giving the result text), or None when it
    # cannot be made now (no descriptor open, or no free slot): then another one is drawn.

    def op_open(self):
        rel = self.path()
        flags = self.rng.choice([os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDWR])
        names = [["RDONLY", "WRONLY", "RDWR"][flags]]
        for flag, name in [(os.O_CREAT, "CREAT"), (os.O_EXCL, "EXCL"), (os.O_TRUNC, "TRUNC"), (os.O_APPEND, "APPEND"), (os.O_DIRECTORY, "DIRECTORY"), (os.O_NOFOLLOW, "NOFOLLOW")]:
            if self.rng.random() < (0.5 if flag == os.O_CREAT else 0.2):
                flags |= flag
                names.append(name)
        mode = self.rng.choice(MODES[:4])
        slot = self.free_slot()
        if slot is None:
            return None

        def run():
            self.slots[slot] = os.open(self.full(rel), flags | os.O_CLOEXEC, mode)
            return f"slot {slot}"

        return f"open {rel} {'|'.join(names)} {mode:o}", run

    def with_slot(self, name, body, detail=""):
        slot = self.slot()
        if slot is None:
            return None
        fd = self.slots[slot]
        return f"{name} slot {slot}{detail}", lambda: body(slot, fd)

    def op_close(self):
        def body(slot, fd):
            del self.slots[slot]
            os.close(fd)
            return "ok"

        return self.with_slot("close", body)

    def op_write(self):
        data = self.data(self.size())
        return self.with_slot("write", lambda _s, fd: str(os.write(fd, data)), f" {digest(data)}")

    def op_pwrite(self):
        data, offset = self.data(self.size()), self.offset()
        return self.with_slot("pwrite", lambda _s, fd: str(os.pwrite(fd, data, offset)), f" {digest(data)} at {offset}")

    def op_read(self):
        size = self.size()
        return self.with_slot("read", lambda _s, fd: digest(os.read(fd, size)), f" {size}")

    def op_pread(self):
        size, offset = self.size(), self.offset()
        return self.with_slot("pread", lambda _s, fd: digest(os.pread(fd, size, offset)), f" {size} at {offset}")

    def op_lseek(self):
        whence = self.rng.choice([os.SEEK_SET, os.SEEK_CUR, os.SEEK_END, os.SEEK_DATA, os.SEEK_HOLE])
        offset = self.rng.choice([self.offset(), -1, -CHUNK_BYTES, -self.rng.randint(0, OFFSET_MAX)])
        if whence in (os.SEEK_DATA, os.SEEK_HOLE):
            offset = abs(offset) if self.rng.random() < 0.8 else offset
        name = {os.SEEK_SET: "SET", os.SEEK_CUR: "CUR", os.SEEK_END: "END", os.SEEK_DATA: "DATA", os.SEEK_HOLE: "HOLE"}[whence]

        def body(_slot, fd):
            # A directory's offsets are the file system's own cookies (ext4: name hashes).
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "not a regular file"
            if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
                return str(os.lseek(fd, offset, whence))
            return seek_data_hole(fd, offset, whence)

        return self.with_slot("lseek", body, f" {offset} {name}")

    def op_ftruncate(self):
        length = self.offset()
        return self.with_slot("ftruncate", lambda _s, fd: ok(os.ftruncate(fd, length)), f" {length}")

    def op_truncate(self):
        rel, length = self.path(), self.offset()
        return f"truncate {rel} {length}", lambda: ok(os.truncate(self.full(rel), length))

    def op_fsync(self):
        return self.with_slot("fsync", lambda _s, fd: ok(os.fsync(fd)))

    def op_dup(self):
        new = self.free_slot()
        if new is None:
            return None

        def body(_slot, fd):
            self.slots[new] = os.dup(fd)
            return f"slot {new}"

        return self.with_slot("dup", body)

    def op_dup2(self):
        target = self.rng.randrange(SLOTS_MAX)

        def body(slot, fd):
            if target in self.slots:
                if self.slots[target] == fd:
                    return "same"
                os.dup2(fd, self.slots[target])
            else:
                self.slots[target] = os.dup(fd)
            return f"slot {target}"

        return self.with_slot("dup2", body, f" to {target}")

    def op_fstat(self):
        return self.with_slot("fstat", lambda _s, fd: describe_stat(os.fstat(fd)))

    def op_stat(self):
        rel, follow = self.path(), self.rng.random() < 0.5
        return f"{'stat' if follow else 'lstat'} {rel}", lambda: describe_stat(os.stat(self.full(rel), follow_symlinks=follow))

    def op_unlink(self):
        rel = self.path()
        return f"unlink {rel}", lambda: ok(os.unlink(self.full(rel)))

    def op_rmdir(self):
        rel = self.path()
        return f"rmdir {rel}", lambda: ok(os.rmdir(self.full(rel)))

    def op_mkdir(self):
        rel, mode = self.path(), self.rng.choice([0o755, 0o700, 0o777])
        return f"mkdir {rel} {mode:o}", lambda: ok(os.mkdir(self.full(rel), mode))

    def op_rename(self):
        old = self.path()
        new = old if self.rng.random() < 0.1 else self.path()
        # Into its own subdirectory, now and then on purpose.
        if self.rng.random() < 0.1:
            new = f"{old}/{self.rng.choice(NAMES)}"
        return f"rename {old} {new}", lambda: ok(os.rename(self.full(old), self.full(new)))

    def op_symlink(self):
        rel, target = self.path(), self.rng.choice(LINK_TARGETS)
        return f"symlink {target} {rel}", lambda: ok(os.symlink(target, self.full(rel)))

    def op_readlink(self):
        rel = self.path()
        return f"readlink {rel}", lambda: os.readlink(self.full(rel))

    def op_chmod(self):
        rel, mode = self.path(), self.rng.choice(MODES)
        return f"chmod {rel} {mode:o}", lambda: ok(os.chmod(self.full(rel), mode))

    def op_link(self):
        old, new = self.path(), self.path()
        return f"link {old} {new}", lambda: ok(os.link(self.full(old), self.full(new), follow_symlinks=False))

    def op_listdir(self):
        rel = self.path() if self.rng.random() < 0.7 else "."
        return f"listdir {rel}", lambda: " ".join(sorted(os.listdir(self.full(rel))))

    def op_scandir(self):
        rel = self.path() if self.rng.random() < 0.7 else "."

        def run():
            with os.scandir(self.full(rel)) as entries:
                listed = [f"{e.name}:{'d' if e.is_dir(follow_symlinks=False) else 'l' if e.is_symlink() else 'f' if e.is_file() else '?'}" for e in entries]
            return " ".join(sorted(listed))

        return f"scandir {rel}", run

    def op_utime(self):
        rel = self.path()
        atime, mtime = self.rng.choice(TIMES_NS), self.rng.choice(TIMES_NS)

        def run():
            os.utime(self.full(rel), ns=(atime, mtime))
            st = os.stat(self.full(rel))
            return f"mtime={st.st_mtime_ns} atime={st.st_atime_ns}"

        return f"utime {rel} {atime} {mtime}", run

    def op_chdir(self):
        # The working directory after chdir (as getcwd says it, from the seed's directory) and
        # a relative lookup from it: `..` after a symlink is the target's parent.
        rel = self.path()
        then = self.rng.choice([".", "..", "a", "../b", "b/..", "a/.", "../a/."])

        def run():
            here = os.getcwd()
            try:
                os.chdir(self.full(rel))
                top = os.path.realpath(self.root)
                where = os.path.relpath(os.getcwd(), top)
                # A link to "." and a ".." can climb out of the seed's directory: what is there
                # differs between the two sides.
                if where.startswith(".."):
                    return "outside"
                if not (os.path.realpath(then) + "/").startswith(top + "/"):
                    return f"{where} then outside"
                try:
                    found = describe_stat(os.lstat(then))
                except OSError as e:
                    found = errno.errorcode[e.errno]
                return f"{where} {found}"
            finally:
                os.chdir(here)

        return f"chdir {rel} then lstat {then}", run

    def op_at(self):
        # A call relative to a directory descriptor (the *at family).
        drel = self.path() if self.rng.random() < 0.7 else "."
        name, other = self.path(), self.path()
        kind = self.rng.choice(["stat", "lstat", "open", "mkdir", "unlink", "rmdir", "rename", "symlink", "readlink", "access", "link"])

        def call(dfd):
            if kind == "stat":
                return describe_stat(os.stat(name, dir_fd=dfd))
            if kind == "lstat":
                return describe_stat(os.stat(name, dir_fd=dfd, follow_symlinks=False))
            if kind == "open":
                fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644, dir_fd=dfd)
                size = os.fstat(fd).st_size
                os.close(fd)
                return f"size={size}"
            if kind == "mkdir":
                return ok(os.mkdir(name, 0o755, dir_fd=dfd))
            if kind == "unlink":
                return ok(os.unlink(name, dir_fd=dfd))
            if kind == "rmdir":
                return ok(os.rmdir(name, dir_fd=dfd))
            if kind == "rename":
                return ok(os.rename(name, other, src_dir_fd=dfd, dst_dir_fd=dfd))
            if kind == "symlink":
                return ok(os.symlink(other, name, dir_fd=dfd))
            if kind == "readlink":
                return os.readlink(name, dir_fd=dfd)
            if kind == "link":
                return ok(os.link(name, other, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False))
            return str(os.access(name, os.R_OK | os.X_OK, dir_fd=dfd))

        def run():
            dfd = os.open(self.full(drel), os.O_RDONLY | os.O_DIRECTORY)
            try:
                return call(dfd)
            finally:
                os.close(dfd)

        return f"{kind}at {drel}: {name} {other}", run

    def op_access(self):
        rel, follow = self.path(), self.rng.random() < 0.7
        mode = self.rng.choice([os.F_OK, os.R_OK, os.W_OK, os.X_OK, os.R_OK | os.X_OK])
        return f"access {rel} {mode} follow={follow}", lambda: str(os.access(self.full(rel), mode, follow_symlinks=follow))

    def op_fallocate(self):
        offset, length = self.offset(), self.rng.choice([1, CHUNK_BYTES, 3 * CHUNK_BYTES + 5])

        def body(_slot, fd):
            os.posix_fallocate(fd, offset, length)
            return f"size={os.fstat(fd).st_size}"

        return self.with_slot("fallocate", body, f" {offset} {length}")

    def op_renameat2(self):
        # RENAME_NOREPLACE (1), through libc's renameat2. (RENAME_EXCHANGE is EINVAL in kura, as
        # in a Linux file system without it: the man page's "does not support one of the flags".)
        old, new, flags = self.path(), self.path(), 1

        def run():
            if LIBC.renameat2(AT_FDCWD, os.fsencode(self.full(old)), AT_FDCWD, os.fsencode(self.full(new)), flags) != 0:
                raise OSError(ctypes.get_errno(), "renameat2")
            return "ok"

        return f"renameat2 {old} {new} {['', 'NOREPLACE', 'EXCHANGE'][flags]}", run

    def op_fchmod(self):
        mode = self.rng.choice(MODES)

        def body(_slot, fd):
            os.chmod(fd, mode)
            return f"{stat.S_IMODE(os.fstat(fd).st_mode):o}"

        return self.with_slot("fchmod", body, f" {mode:o}")

    def op_futime(self):
        atime, mtime = self.rng.choice(TIMES_NS), self.rng.choice(TIMES_NS)

        def body(_slot, fd):
            os.utime(fd, ns=(atime, mtime))
            st = os.fstat(fd)
            return f"mtime={st.st_mtime_ns} atime={st.st_atime_ns}"

        return self.with_slot("futime", body, f" {atime} {mtime}")

    def op_chown(self):
        rel, follow = self.path(), self.rng.random() < 0.5
        uid, gid = self.rng.choice([(0, 0), (65534, 65534), (1000, -1), (-1, 100)])

        def run():
            os.chown(self.full(rel), uid, gid, follow_symlinks=follow)
            st = os.stat(self.full(rel), follow_symlinks=follow)
            return f"{st.st_uid}:{st.st_gid} {stat.S_IMODE(st.st_mode):o}"

        return f"chown {rel} {uid}:{gid} follow={follow}", run

    def op_copy(self):
        # copy_file_range or sendfile between two open descriptors (the same one, sometimes).
        src_slot, dst_slot = self.slot(), self.slot()
        if src_slot is None:
            return None
        how, count, src_off = self.rng.choice(["copy_file_range", "sendfile"]), self.size(), self.offset()

        def run():
            src, dst = self.slots[src_slot], self.slots[dst_slot]
            if how == "sendfile":
                # Onto an overlapping range of its own file, Linux's result depends on its page
                # cache (README, known gaps).
                if os.fstat(src).st_ino == os.fstat(dst).st_ino and stat.S_ISREG(os.fstat(src).st_mode):
                    return "same file"
                return str(os.sendfile(dst, src, src_off, count))
            return str(os.copy_file_range(src, dst, count, src_off))

        return f"{how} slot {src_slot} at {src_off} to slot {dst_slot} {count}", run

    def op_vector(self):
        sizes = [self.size() for _ in range(self.rng.randint(1, 3))]
        write = self.rng.random() < 0.5

        def body(_slot, fd):
            if write:
                return str(os.writev(fd, [self.data(n) for n in sizes]))
            bufs = [bytearray(n) for n in sizes]
            got = os.readv(fd, bufs)
            return f"{got} {digest(b''.join(bufs)[:got])}"

        return self.with_slot("writev" if write else "readv", body, f" {sizes}")

    def op_mkfifo(self):
        rel = self.path()

        def run():
            os.mkfifo(self.full(rel), 0o644)
            st = os.lstat(self.full(rel))
            # Gone at once: an open of a FIFO would wait for the other end.
            os.unlink(self.full(rel))
            return f"fifo={stat.S_ISFIFO(st.st_mode)} {stat.S_IMODE(st.st_mode):o}"

        return f"mkfifo {rel}", run

    OPS = [
        (op_fchmod, 1),
        (op_futime, 1),
        (op_chown, 1),
        (op_copy, 2),
        (op_vector, 2),
        (op_mkfifo, 1),
        (op_chdir, 2),
        (op_at, 4),
        (op_access, 1),
        (op_fallocate, 1),
        (op_renameat2, 2),
        (op_open, 8),
        (op_close, 3),
        (op_write, 6),
        (op_pwrite, 6),
        (op_read, 5),
        (op_pread, 5),
        (op_lseek, 3),
        (op_ftruncate, 2),
        (op_truncate, 2),
        (op_fsync, 1),
        (op_dup, 1),
        (op_dup2, 1),
        (op_fstat, 4),
        (op_stat, 4),
        (op_unlink, 3),
        (op_rmdir, 2),
        (op_mkdir, 4),
        (op_rename, 4),
        (op_symlink, 2),
        (op_readlink, 1),
        (op_chmod, 1),
        (op_link, 2),
        (op_listdir, 2),
        (op_scandir, 1),
        (op_utime, 1),
    ]

    def step(self):
        ops, weights = zip(*Run.OPS)
        op = self.rng.choices(ops, weights)[0]
        made = op(self)
        while made is None:
            made = self.rng.choices(ops, weights)[0](self)
        desc, run = made
        try:
            result = run()
        except OSError as e:
            result = errno.errorcode.get(e.errno, str(e.errno))
        return f"{desc} = {result}"

    def close_all(self):
        for fd in self.slots.values():
            try:
                os.close(fd)
            except OSError:
                pass  # a dup2 may have left two slots on one descriptor
        self.slots.clear()


def ok(_none):
    return "ok"


def seek_data_hole(fd, offset, whence):
    """SEEK_DATA/SEEK_HOLE, printed as whether the answer is one POSIX allows: a file system
    may report every byte before EOF as data (kura does; ext4 finds the holes, and says ENXIO
    when only a hole follows). The descriptor's
    offset is put back, since it would differ."""
    before = os.lseek(fd, 0, os.SEEK_CUR)
    size = os.fstat(fd).st_size
    try:
        got = os.lseek(fd, offset, whence)
    except OSError as e:
        # No data after offset: a hole up to EOF, for a file system that tracks holes.
        if e.errno == errno.ENXIO and whence == os.SEEK_DATA and 0 <= offset < size:
            return "data ok"
        raise
    os.lseek(fd, before, os.SEEK_SET)
    if whence == os.SEEK_DATA:
        return "data ok" if offset <= got < size else f"bad data offset {got} (size {size})"
    return "hole ok" if offset <= got <= size else f"bad hole offset {got} (size {size})"


def handoff(run):
    """Takes and drops a POSIX lock on every regular file `run` holds open (see above)."""
    for fd in sorted(set(run.slots.values())):
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            fcntl.lockf(fd, (fcntl.LOCK_EX if writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # an O_PATH descriptor, a slot dup2 closed


def worker(top, seed):
    """The second process of a two-process run: "step" makes one operation (printed), "in"
    and "out" hand the turn over (see `handoff`), anything else ends it."""
    os.umask(0o022)
    run = Run(top, seed)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            print(run.step(), flush=True)
        elif command in ("in", "out"):
            handoff(run)
            print("ok", flush=True)
        else:
            break
    run.close_all()


def main():
    if sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return
    root, first, seeds, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    processes = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    os.umask(0o022)
    out = sys.stdout
    for seed in range(first, first + seeds):
        top = os.path.join(root, f"s{seed}")
        os.mkdir(top)
        run = Run(top, seed)
        if processes == 1:
            for index in range(ops):
                out.write(f"{seed} {index} {run.step()}\n")
        else:
            other = subprocess.Popen([sys.executable, __file__, "worker", top, str(seed + 1_000_000)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

            def ask(command):
                other.stdin.write(command + "\n")
                other.stdin.flush()
                return other.stdout.readline().rstrip("\n")

            turns = random.Random(-1 - seed)
            last = "A"
            for index in range(ops):
                now = "A" if turns.random() < 0.5 else "B"
                if now != last:
                    if last == "A":
                        handoff(run)
                        ask("in")
                    else:
                        ask("out")
                        handoff(run)
                    last = now
                line = "A " + run.step() if now == "A" else "B " + ask("step")
                out.write(f"{seed} {index} {line}\n")
            other.stdin.close()
            if other.wait() != 0:
                raise SystemExit(f"the second process of seed {seed} failed")
        run.close_all()
    out.flush()


if __name__ == "__main__":
    main()
