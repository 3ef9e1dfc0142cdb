# Extended attributes of files in the directory given: every answer printed (errno names for
# failures), so that a run on a kura directory can be compared with one on a host directory.
# Run as root (trusted. attributes).
import os, sys, errno
D = sys.argv[1]
os.makedirs(D, exist_ok=True)
def t(label, f):
    try:
        r = f()
        print(label, "->", r if not isinstance(r, list) else sorted(r))
    except OSError as e:
        print(label, "->", errno.errorcode[e.errno])
f = D + "/f"; open(f, "w").write("data")
os.mkdir(D + "/d"); os.symlink("f", D + "/l")
t("list empty", lambda: os.listxattr(f))
t("get missing", lambda: os.getxattr(f, "user.a"))
t("set", lambda: os.setxattr(f, "user.a", b"one"))
t("get", lambda: os.getxattr(f, "user.a"))
t("set create existing", lambda: os.setxattr(f, "user.a", b"x", os.XATTR_CREATE))
t("set replace missing", lambda: os.setxattr(f, "user.b", b"x", os.XATTR_REPLACE))
t("set replace", lambda: os.setxattr(f, "user.a", b"two", os.XATTR_REPLACE))
t("get replaced", lambda: os.getxattr(f, "user.a"))
t("set empty value", lambda: os.setxattr(f, "user.empty", b""))
t("get empty value", lambda: os.getxattr(f, "user.empty"))
t("set binary", lambda: os.setxattr(f, "user.bin", bytes(range(256))))
t("get binary ok", lambda: os.getxattr(f, "user.bin") == bytes(range(256)))
t("list", lambda: os.listxattr(f))
t("via symlink follow", lambda: os.getxattr(D + "/l", "user.a"))
t("on symlink itself", lambda: os.setxattr(D + "/l", "user.a", b"x", follow_symlinks=False))
t("list symlink itself", lambda: os.listxattr(D + "/l", follow_symlinks=False))
t("on dir", lambda: os.setxattr(D + "/d", "user.dir", b"v"))
t("get dir", lambda: os.getxattr(D + "/d", "user.dir"))
t("no namespace", lambda: os.setxattr(f, "plain", b"x"))
# POSIX ACLs: a host file system with ACL support has none here (ENODATA); kura has no ACL
# support (EOPNOTSUPP, as ext4 mounted noacl): both mean "no ACL" to ls, cp -a and tar
# (programs.rs checks kura's own answer).
def no_acl(name):
    try:
        os.getxattr(f, name)
        return "has one"
    except OSError as e:
        return "no ACL" if e.errno in (errno.ENODATA, errno.EOPNOTSUPP) else errno.errorcode[e.errno]
t("system ns", lambda: no_acl("system.posix_acl_access"))
t("bare prefix", lambda: os.setxattr(f, "user.", b"x"))
t("name too long", lambda: os.setxattr(f, "user." + "x" * 251, b"x"))
t("name at max", lambda: os.setxattr(f, "user." + "x" * 250, b"x"))
t("value too big", lambda: os.setxattr(f, "user.big", b"x" * 65537))
t("trusted (root)", lambda: os.setxattr(f, "trusted.t", b"x"))
t("get trusted", lambda: os.getxattr(f, "trusted.t"))
fd = os.open(f, os.O_RDONLY)
t("fd get", lambda: os.getxattr(fd, "user.a"))
t("fd set", lambda: os.setxattr(fd, "user.viafd", b"fd"))
t("fd list", lambda: os.listxattr(fd))
t("fd remove", lambda: os.removexattr(fd, "user.viafd"))
os.close(fd)
t("remove", lambda: os.removexattr(f, "user.a"))
t("remove missing", lambda: os.removexattr(f, "user.a"))
t("list after", lambda: os.listxattr(f))
t("missing file", lambda: os.getxattr(D + "/nope", "user.a"))
os.rename(f, D + "/g")
t("after rename", lambda: os.getxattr(D + "/g", "user.bin") == bytes(range(256)))
os.link(D + "/g", D + "/h")
t("hard link shares", lambda: os.getxattr(D + "/h", "user.empty"))
# ctime moves
st1 = os.stat(D + "/g").st_ctime_ns
import time; time.sleep(0.02)
os.setxattr(D + "/g", "user.c", b"1")
t("ctime moved", lambda: os.stat(D + "/g").st_ctime_ns > st1)
