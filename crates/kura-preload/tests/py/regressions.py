#!/usr/bin/env python3
"""The divergences tests/random_ops.rs found, one small case each (regressions.py ROOT).

Each case prints what it sees; tests/random_ops.rs runs this on a host directory, under the
preload and through the FUSE mount, and compares the lines.
"""

import errno
import os
import stat
import sys


def attempt(call):
    try:
        result = call()
        return "ok" if result is None else str(result)
    except OSError as e:
        return errno.errorcode[e.errno]


def write_to_a_directory(root):
    # Linux: a directory is open read-only, so EBADF (kura said EISDIR); ftruncate is EINVAL.
    fd = os.open(f"{root}/dir", os.O_RDONLY | os.O_DIRECTORY)
    out = [attempt(lambda: os.write(fd, b"x")), attempt(lambda: os.pwrite(fd, b"x", 3)), attempt(lambda: os.ftruncate(fd, 0))]
    os.close(fd)
    return out


def create_and_directory_together(root):
    # Linux (since 6.4): EINVAL before the path is looked at (kura said ENOTDIR).
    flags = os.O_RDWR | os.O_CREAT | os.O_DIRECTORY
    return [attempt(lambda: os.open(f"{root}/new", flags)), attempt(lambda: os.open(f"{root}/dir", os.O_RDONLY | os.O_CREAT | os.O_DIRECTORY))]


def directory_nofollow_on_a_symlink(root):
    # Linux checks O_DIRECTORY first: ENOTDIR (kura said ELOOP).
    return [attempt(lambda: os.open(f"{root}/link", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))]


def read_only_truncate(root):
    # Linux truncates with O_RDONLY|O_TRUNC too (kura kept the data).
    fd = os.open(f"{root}/file", os.O_RDONLY | os.O_TRUNC)
    size = os.fstat(fd).st_size
    os.close(fd)
    return [size, os.stat(f"{root}/file").st_size]


def rename_over_an_ancestor(root):
    # The target holds the source: ENOTEMPTY, whatever the source is (kura said EISDIR).
    return [attempt(lambda: os.rename(f"{root}/dir/inner", f"{root}/dir")), attempt(lambda: os.rename(f"{root}/dir/sub/deep", f"{root}/dir"))]


def rename_checks_both_parents_first(root):
    # A missing source loses to a bad directory on the new path (kura said ENOENT).
    return [attempt(lambda: os.rename(f"{root}/missing", f"{root}/file/x")), attempt(lambda: os.rename(f"{root}/missing", f"{root}/loop/x"))]


def stat_of_a_removed_open_directory(root):
    # Still a directory, with no links (kura said ESTALE, FUSE ENOENT).
    os.mkdir(f"{root}/gone", 0o750)
    fd = os.open(f"{root}/gone", os.O_RDONLY)
    os.rmdir(f"{root}/gone")
    st = os.fstat(fd)
    os.close(fd)
    return [f"{st.st_mode:o} nlink={st.st_nlink}"]


def dot_and_slash_after_a_link(root):
    # `link/.` names the directory the link leads to, `file/.` is ENOTDIR (kura lstat'ed the
    # link and the file: the preload dropped the `.`); the calls that take a last name
    # without following it see the link (kura followed it for a trailing slash).
    def kind(p):
        return oct(os.lstat(p).st_mode >> 12)
    return [
        attempt(lambda: kind(f"{root}/link/.")),
        attempt(lambda: kind(f"{root}/file/.")),
        attempt(lambda: os.mkdir(f"{root}/gone/.")),
        attempt(lambda: os.link(f"{root}/file", f"{root}/link/")),
        attempt(lambda: os.unlink(f"{root}/file/")),
        attempt(lambda: os.rename(f"{root}/file", f"{root}/dir/")),
        attempt(lambda: os.open(f"{root}/loop/", os.O_RDONLY | os.O_CREAT)),
    ]


def dotdot_after_a_link_is_the_targets_parent(root):
    # `deep/..` with `deep -> dir/sub/deep` is `dir/sub`, as chdir and getcwd say (kura took
    # the `..` lexically: `root`).
    os.symlink("dir/sub/deep", f"{root}/deep")
    listing = sorted(os.listdir(f"{root}/deep/.."))
    here = os.getcwd()
    os.chdir(f"{root}/deep/..")
    cwd = os.getcwd()[len(root):]
    os.chdir("..")
    up = os.getcwd()[len(root):]
    fd = os.open(f"{root}/deep/../..", os.O_RDONLY | os.O_DIRECTORY)
    os.chdir(here)
    os.fchdir(fd)
    fcwd = os.getcwd()[len(root):]
    os.close(fd)
    os.chdir(here)
    return [listing, cwd, up, fcwd]


def a_links_trailing_slash_asks_for_a_directory(root):
    # A link to "new/" or "file/": open(O_CREAT) through it is EISDIR (kura made "new"), stat
    # of a link to "file/" ENOTDIR. RENAME_NOREPLACE onto an existing name beats a slash after
    # a file (kura said ENOTDIR), and onto "d/.." is EEXIST (kura said EBUSY).
    os.symlink("new/", f"{root}/to_new")
    os.symlink("file/", f"{root}/to_file")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def noreplace(old, new):
        if libc.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), 1) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
    return [
        attempt(lambda: os.open(f"{root}/to_new", os.O_WRONLY | os.O_CREAT)),
        attempt(lambda: os.path.exists(f"{root}/new")),
        attempt(lambda: os.stat(f"{root}/to_file")),
        attempt(lambda: noreplace(f"{root}/file/", f"{root}/link")),
        attempt(lambda: noreplace(f"{root}/file", f"{root}/dir/sub/..")),
    ]


def fstat_of_a_directory_removed_after_a_chmod(root):
    # The directory's last attributes (kura showed them as at the open: 750).
    os.mkdir(f"{root}/gone", 0o750)
    fd = os.open(f"{root}/gone", os.O_RDONLY)
    os.chmod(f"{root}/gone", 0o705)
    os.rmdir(f"{root}/gone")
    st = os.fstat(fd)
    os.close(fd)
    return [f"{st.st_mode:o} nlink={st.st_nlink}"]


def descriptor_calls_checked_as_the_kernel_does(root):
    # fchmod and futimens of a directory removed while open work (kura said ENOENT);
    # copy_file_range from a write-only descriptor is EBADF (kura copied nothing: 0), sendfile
    # from a directory EINVAL (kura: EISDIR), readv of nothing from a directory 0 (kura:
    # EISDIR).
    os.mkdir(f"{root}/gone")
    d = os.open(f"{root}/gone", os.O_RDONLY)
    os.rmdir(f"{root}/gone")
    w = os.open(f"{root}/file", os.O_WRONLY)
    r = os.open(f"{root}/file", os.O_RDONLY)
    t = os.open(f"{root}/other", os.O_WRONLY | os.O_CREAT, 0o644)
    out = [
        attempt(lambda: os.chmod(d, 0o700)),
        attempt(lambda: os.utime(d, ns=(5, 7))),
        attempt(lambda: f"{os.fstat(d).st_mode:o} {os.fstat(d).st_mtime_ns}"),
        attempt(lambda: os.copy_file_range(w, t, 4)),
        attempt(lambda: os.copy_file_range(r, t, 4)),
        attempt(lambda: os.sendfile(t, d, 0, 4)),
        attempt(lambda: os.readv(d, [bytearray(0)])),
    ]
    for fd in (d, w, r, t):
        os.close(fd)
    return out


def o_path_descriptors(root):
    # O_PATH names a file without opening it for I/O (kura opened it for reading): a link with
    # O_NOFOLLOW is one (kura: ELOOP), readlinkat(fd, "") reads it, fstat and *at calls work,
    # reads, writes, lseek, fchmod, fsync and listings are EBADF.
    link = os.open(f"{root}/link", os.O_PATH | os.O_NOFOLLOW)
    d = os.open(f"{root}/dir", os.O_PATH)
    f = os.open(f"{root}/file", os.O_PATH)
    out = [
        attempt(lambda: stat.S_ISLNK(os.fstat(link).st_mode)),
        attempt(lambda: os.readlink("", dir_fd=link)),
        attempt(lambda: os.fstat(f).st_size),
        attempt(lambda: stat.S_ISDIR(os.stat("sub", dir_fd=d).st_mode)),
        attempt(lambda: os.read(f, 1)),
        attempt(lambda: os.write(f, b"x")),
        attempt(lambda: os.lseek(f, 0, 0)),
        attempt(lambda: os.chmod(f, 0o600)),
        attempt(lambda: os.fsync(d)),
        attempt(lambda: os.listdir(d)),
        attempt(lambda: os.open(f"{root}/file", os.O_PATH | os.O_DIRECTORY)),
    ]
    for fd in (link, d, f):
        os.close(fd)
    return out


def o_trunc_sets_the_times_of_an_empty_file(root):
    # Linux truncates at an O_TRUNC open whatever the size, so `: > stamp` sets the mtime and
    # ctime of an empty file too (kura left an empty file alone).
    path = f"{root}/stamp"
    open(path, "w").close()
    os.utime(path, (1_000_000_000, 1_000_000_000))
    before = os.stat(path)
    os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    after = os.stat(path)
    return [after.st_mtime > before.st_mtime, after.st_ctime >= before.st_ctime, after.st_size]


def two_opens_of_a_removed_directory_share_its_attributes(root):
    # One inode however many opens: a fchmod through one descriptor of a directory removed
    # while open shows through the other (kura changed only the first one's copy).
    os.mkdir(f"{root}/gone", 0o755)
    a = os.open(f"{root}/gone", os.O_RDONLY)
    b = os.open(f"{root}/gone/.", os.O_RDONLY)
    os.rmdir(f"{root}/gone")
    os.chmod(a, 0o444)
    os.utime(a, ns=(5, 7))
    st = os.fstat(b)
    os.close(a)
    os.close(b)
    return [f"{st.st_mode:o} nlink={st.st_nlink} mtime={st.st_mtime_ns}"]


def create_through_a_link_to_a_name_and_slash(root):
    # open(O_CREAT) through a link whose target ends in '/' is EISDIR before the last name
    # is looked up: a link there that loops (kura said ELOOP), a file (kura: ENOTDIR), a
    # directory; without O_CREAT the name is followed and must be a directory.
    os.symlink("self/", f"{root}/self")
    os.symlink("file/", f"{root}/to_file")
    os.symlink("dir/", f"{root}/to_dir")
    creat = os.O_RDWR | os.O_CREAT
    return [
        attempt(lambda: os.open(f"{root}/self", creat)),
        attempt(lambda: os.open(f"{root}/to_file", creat)),
        attempt(lambda: os.open(f"{root}/to_dir", creat)),
        attempt(lambda: os.open(f"{root}/link/../self", creat)),
        # After `/.` the dot is the last name: the link is followed whole (ELOOP; kura said
        # EISDIR), and a directory there is EISDIR as an O_CREAT open of one.
        attempt(lambda: os.open(f"{root}/self/.", creat)),
        attempt(lambda: os.open(f"{root}/to_dir/.", creat)),
        attempt(lambda: os.open(f"{root}/self", os.O_RDONLY)),
        attempt(lambda: os.open(f"{root}/to_file", os.O_RDONLY)),
    ]


def reopen_through_proc_self_fd(root):
    # /proc/self/fd/N leads to the open file wherever it is now: renamed since, or unlinked
    # (kura opened the path the descriptor was opened at: ENOENT, or another file there).
    # O_NOFOLLOW is ELOOP, O_CREAT|O_EXCL EEXIST: the link is a symbolic link.
    fd = os.open(f"{root}/file", os.O_RDWR)
    os.rename(f"{root}/file", f"{root}/moved")
    with open(f"{root}/file", "w") as f:
        f.write("another file")
    out = []
    def reread(flags=os.O_RDONLY):
        g = os.open(f"/proc/self/fd/{fd}", flags)
        try:
            return os.read(g, 100).decode()
        finally:
            os.close(g)
    out.append(attempt(reread))
    os.unlink(f"{root}/moved")
    out.append(attempt(reread))
    out.append(attempt(lambda: reread(os.O_RDONLY | os.O_NOFOLLOW)))
    out.append(attempt(lambda: reread(os.O_RDWR | os.O_CREAT | os.O_EXCL)))
    os.close(fd)
    return out


def fstat_of_a_directory_renamed_over_after_a_chmod(root):
    # Replaced by a rename, the directory is removed; its descriptor shows its last mode
    # (kura showed the mode at the open: 755).
    os.mkdir(f"{root}/gone", 0o755)
    fd = os.open(f"{root}/gone", os.O_RDONLY)
    os.chmod(f"{root}/gone", 0o1777)
    os.mkdir(f"{root}/new")
    os.rename(f"{root}/new", f"{root}/gone")
    st = os.fstat(fd)
    os.close(fd)
    return [f"{st.st_mode:o} nlink={st.st_nlink}"]


def create_over_a_link_in_a_sticky_directory(root):
    # Linux's may_create_in_sticky: open(O_CREAT) of an existing symbolic link (O_NOFOLLOW) in
    # a sticky, world-writable directory that neither the link's owner nor the caller owns is
    # EACCES before the link's ELOOP (seeds 15268 and 15383: kura said ELOOP). Owned by the
    # directory's owner, or the directory only group-writable: ELOOP. (Regular files and FIFOs
    # only with fs.protected_regular and fs.protected_fifos, off on the test host.)
    d = f"{root}/sticky"
    os.mkdir(d)
    os.chmod(d, 0o1777)
    os.symlink("missing", f"{d}/theirs")
    os.lchown(f"{d}/theirs", 1000, 1000)
    os.symlink("missing", f"{d}/mine")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
    out = [attempt(lambda: os.open(f"{d}/theirs", flags, 0o644)), attempt(lambda: os.open(f"{d}/mine", flags, 0o644))]
    os.chmod(d, 0o1775)
    out.append(attempt(lambda: os.open(f"{d}/theirs", flags, 0o644)))
    return out


CASES = [
    write_to_a_directory,
    create_and_directory_together,
    directory_nofollow_on_a_symlink,
    read_only_truncate,
    rename_over_an_ancestor,
    rename_checks_both_parents_first,
    stat_of_a_removed_open_directory,
    dot_and_slash_after_a_link,
    dotdot_after_a_link_is_the_targets_parent,
    a_links_trailing_slash_asks_for_a_directory,
    fstat_of_a_directory_removed_after_a_chmod,
    descriptor_calls_checked_as_the_kernel_does,
    o_path_descriptors,
    o_trunc_sets_the_times_of_an_empty_file,
    two_opens_of_a_removed_directory_share_its_attributes,
    create_through_a_link_to_a_name_and_slash,
    reopen_through_proc_self_fd,
    fstat_of_a_directory_renamed_over_after_a_chmod,
    create_over_a_link_in_a_sticky_directory,
]


def setup(root):
    os.makedirs(f"{root}/dir/sub/deep")
    with open(f"{root}/dir/inner", "w") as f:
        f.write("inner")
    with open(f"{root}/file", "w") as f:
        f.write("some data")
    os.symlink("dir", f"{root}/link")
    os.symlink("loop", f"{root}/loop")


def main():
    os.umask(0o022)
    for index, case in enumerate(CASES):
        root = os.path.join(sys.argv[1], f"case{index}")
        os.mkdir(root)
        setup(root)
        try:
            results = case(root)
        except OSError as e:
            results = [f"failed: {errno.errorcode[e.errno]}"]
        print(case.__name__, " ".join(str(r) for r in results))


if __name__ == "__main__":
    main()
