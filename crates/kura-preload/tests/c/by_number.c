/* File system calls made by number with syscall(3), as libuv (Node.js) makes statx: every
 * result printed, so that a run on a kura directory can be compared with one on a host
 * directory. Also calls kura leaves to the kernel (getpid, a pipe, a fork-like clone that
 * returns twice) and the errno convention. Usage: by_number DIR */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/stat.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "report.h"

struct linux_dirent64 {
    unsigned long long d_ino;
    long long d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: by_number DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    setvbuf(stdout, NULL, _IONBF, 0);

    long fd = syscall(SYS_openat, AT_FDCWD, at(dir, "f"), O_CREAT | O_RDWR | O_TRUNC | O_CLOEXEC, 0640);
    say("openat", fd < 0 ? -1 : 0);
    say("write", syscall(SYS_write, fd, "hello by number\n", 16));
    say("pwrite64", syscall(SYS_pwrite64, fd, "XY", 2, (long)10000));
    say("lseek", syscall(SYS_lseek, fd, 0L, SEEK_END));
    char buf[64] = {0};
    say("pread64", syscall(SYS_pread64, fd, buf, 5L, 6L));
    printf("  read back [%s]\n", buf);
    say("lseek-set", syscall(SYS_lseek, fd, 0L, SEEK_SET));
    memset(buf, 0, sizeof buf);
    say("read", syscall(SYS_read, fd, buf, 16L));
    printf("  read back [%s]", buf);
    struct stat st;
    say("fstat", syscall(SYS_fstat, fd, &st));
    printf("  size %lld mode %o nlink %ld\n", (long long)st.st_size, st.st_mode & 07777, (long)st.st_nlink);
    struct statx sx;
    say("statx-fd", syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx));
    printf("  size %llu regular %d\n", (unsigned long long)sx.stx_size, S_ISREG(sx.stx_mode));
    say("ftruncate", syscall(SYS_ftruncate, fd, 100L));
    say("fsync", syscall(SYS_fsync, fd));
    say("statx-path", syscall(SYS_statx, AT_FDCWD, at(dir, "f"), AT_SYMLINK_NOFOLLOW, STATX_ALL, &sx));
    printf("  size %llu mode %o\n", (unsigned long long)sx.stx_size, sx.stx_mode & 07777);
    say("newfstatat", syscall(SYS_newfstatat, AT_FDCWD, at(dir, "f"), &st, 0));
    printf("  size %lld\n", (long long)st.st_size);
    say("close", syscall(SYS_close, fd));
    say("close-again", syscall(SYS_close, fd));

    say("mkdirat", syscall(SYS_mkdirat, AT_FDCWD, at(dir, "d"), 0750));
    say("mkdirat-exists", syscall(SYS_mkdirat, AT_FDCWD, at(dir, "d"), 0750));
    say("symlinkat", syscall(SYS_symlinkat, "f", AT_FDCWD, at(dir, "l")));
    memset(buf, 0, sizeof buf);
    say("readlinkat", syscall(SYS_readlinkat, AT_FDCWD, at(dir, "l"), buf, sizeof buf));
    printf("  target [%s]\n", buf);
    say("faccessat2", syscall(SYS_faccessat2, AT_FDCWD, at(dir, "l"), R_OK | W_OK, AT_SYMLINK_NOFOLLOW));
    say("renameat2", syscall(SYS_renameat2, AT_FDCWD, at(dir, "f"), AT_FDCWD, at(dir, "d/g"), 0));
    say("renameat2-noreplace", syscall(SYS_renameat2, AT_FDCWD, at(dir, "l"), AT_FDCWD, at(dir, "d"), RENAME_NOREPLACE));
    say("renameat2-noreplace-self", syscall(SYS_renameat2, AT_FDCWD, at(dir, "l"), AT_FDCWD, at(dir, "l"), RENAME_NOREPLACE));
    say("stat-gone", syscall(SYS_newfstatat, AT_FDCWD, at(dir, "f"), &st, 0));
    say("stat-moved", syscall(SYS_newfstatat, AT_FDCWD, at(dir, "d/g"), &st, 0));
    printf("  size %lld\n", (long long)st.st_size);
    say("fchmodat", syscall(SYS_fchmodat, AT_FDCWD, at(dir, "d/g"), 0604));
    say("utimensat", syscall(SYS_utimensat, AT_FDCWD, at(dir, "d/g"), (struct timespec[]){{1000, 0}, {2000, 0}}, 0));
    say("statx-moved", syscall(SYS_statx, AT_FDCWD, at(dir, "d/g"), 0, STATX_ALL, &sx));
    printf("  mode %o mtime %lld\n", sx.stx_mode & 07777, (long long)sx.stx_mtime.tv_sec);

    long dfd = syscall(SYS_openat, AT_FDCWD, dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    char dents[4096];
    char *names[16];
    int n = 0;
    for (;;) {
        long got = syscall(SYS_getdents64, dfd, dents, sizeof dents);
        if (got <= 0) {
            say("getdents64-end", got);
            break;
        }
        for (long off = 0; off < got;) {
            struct linux_dirent64 *d = (struct linux_dirent64 *)(dents + off);
            if (n < 16)
                names[n++] = strdup(d->d_name);
            off += d->d_reclen;
        }
    }
    qsort(names, n, sizeof names[0], by_name);
    printf("  entries");
    for (int i = 0; i < n; i++)
        printf(" %s", names[i]);
    printf("\n");
    say("unlinkat-dir-nonempty", syscall(SYS_unlinkat, dfd, "d", AT_REMOVEDIR));
    say("unlinkat", syscall(SYS_unlinkat, dfd, "d/g", 0));
    say("unlinkat-dir", syscall(SYS_unlinkat, dfd, "d", AT_REMOVEDIR));
    say("unlinkat-link", syscall(SYS_unlinkat, dfd, "l", 0));
    say("close-dir", syscall(SYS_close, dfd));
    say("stat-missing", syscall(SYS_statx, AT_FDCWD, at(dir, "nothing"), 0, STATX_BASIC_STATS, &sx));

    /* Left to the kernel. */
    printf("getpid same: %d\n", syscall(SYS_getpid) == getpid());
    int p[2];
    say("pipe2", syscall(SYS_pipe2, p, O_CLOEXEC));
    say("write-pipe", syscall(SYS_write, p[1], "abc", 3L));
    memset(buf, 0, sizeof buf);
    say("read-pipe", syscall(SYS_read, p[0], buf, sizeof buf));
    say("kill-bad-signal", syscall(SYS_kill, getpid(), 1000));
    long child = syscall(SYS_clone, (long)SIGCHLD, 0L, 0L, 0L, 0L);
    if (child == 0)
        syscall(SYS_exit_group, 7L); /* raw: no libc or preload code in a raw clone's child */
    int status = 0;
    waitpid((pid_t)child, &status, 0);
    printf("clone child exited %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return 0;
}
