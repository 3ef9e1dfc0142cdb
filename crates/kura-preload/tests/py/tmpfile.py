# Python's temporary files in the directory given, which it makes with open(O_TMPFILE) where
# the file system has it (else a named file, unlinked at once): tempfile.TemporaryFile, text
# and binary, a SpooledTemporaryFile rolled over, and an O_TMPFILE file named through
# /proc/self/fd/N. Every answer printed, so that a run on a kura directory can be compared
# with one on a host directory.
import ctypes, os, sys, tempfile
D = sys.argv[1]
os.makedirs(D, exist_ok=True)

# Which opens asked for O_TMPFILE and got it (TemporaryFile falls back quietly).
real_open = os.open
tmpfile_opens = []
def spying_open(path, flags, mode=0o777, *, dir_fd=None):
    fd = real_open(path, flags, mode, dir_fd=dir_fd)
    if flags & os.O_TMPFILE == os.O_TMPFILE:
        tmpfile_opens.append(path)
    return fd
os.open = spying_open

with tempfile.TemporaryFile(dir=D) as f:
    f.write(b"x" * 100000)
    f.seek(0)
    print("read back", f.read() == b"x" * 100000)
    st = os.fstat(f.fileno())
    print("nlink", st.st_nlink, "size", st.st_size, "mode", oct(st.st_mode & 0o7777))
    print("listed", os.listdir(D))
with tempfile.TemporaryFile("w+", dir=D) as f:
    f.write("text mode\n")
    f.flush()
    f.seek(0)
    print("text", repr(f.read()))
with tempfile.SpooledTemporaryFile(max_size=10, dir=D) as f:
    f.write(b"more than ten bytes")
    f.seek(0)
    print("spooled", f.read(), f._rolled)
print("made with O_TMPFILE", tmpfile_opens == [D] * 3, len(tmpfile_opens))
os.open = real_open

# Named by linkat of /proc/self/fd/N, following it: the file keeps what was written.
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, AT_SYMLINK_FOLLOW = -100, 0x400
fd = os.open(D, os.O_TMPFILE | os.O_WRONLY, 0o640)
os.write(fd, b"named through /proc\n")
r = libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD, f"{D}/named".encode(), AT_SYMLINK_FOLLOW)
print("linkat", r, os.strerror(ctypes.get_errno()) if r else "")
os.close(fd)
print("named", repr(open(f"{D}/named").read()), oct(os.stat(f"{D}/named").st_mode & 0o7777))

# Reopened through /proc/self/fd/N (the kernel's magic link leads to the file itself, which
# has no name): its data, in a new description with an offset of its own; O_TRUNC truncates.
fd = os.open(D, os.O_TMPFILE | os.O_RDWR, 0o600)
os.write(fd, b"no name\n")
again = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
print("reopened", os.read(again, 100), os.fstat(again).st_nlink, os.fstat(again).st_ino == os.fstat(fd).st_ino)
os.close(again)
os.close(os.open(f"/dev/fd/{fd}", os.O_WRONLY | os.O_TRUNC))
print("truncated through the link", os.fstat(fd).st_size)
os.close(fd)
print("listed at the end", sorted(os.listdir(D)))
