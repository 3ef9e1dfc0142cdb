/* open(2) with O_TMPFILE and linkat(2) of its descriptor, as man 2 open describes them: every
 * result printed (errno by name), so that a run on a kura directory can be compared with one
 * on a host directory (ext4, tmpfs). Usage: tmpfile DIR */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "report.h"

/* An open's result: 0 for a descriptor (their numbers may differ), else the errno. */
static int opened(const char *what, int fd) {
    say(what, fd < 0 ? -1 : 0);
    return fd;
}

static void fstat_of(const char *what, int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        say(what, -1);
        return;
    }
    printf("%s: nlink %lu mode %o size %lld regular %d\n", what, (unsigned long)st.st_nlink, st.st_mode & 07777, (long long)st.st_size, S_ISREG(st.st_mode));
}

static void stat_of(const char *what, const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        say(what, -1);
        return;
    }
    printf("%s: nlink %lu mode %o size %lld\n", what, (unsigned long)st.st_nlink, st.st_mode & 07777, (long long)st.st_size);
}

/* The names in `dir` but . and .., sorted, on one line. */
static void list(const char *what, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        say(what, -1);
        return;
    }
    char names[64][256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    closedir(d);
    qsort(names, n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    printf("%s:", what);
    for (int i = 0; i < n; i++)
        printf(" %s", names[i]);
    printf("\n");
}

static const char *proc_fd(int fd) {
    static char b[64];
    snprintf(b, sizeof b, "/proc/self/fd/%d", fd);
    return b;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: tmpfile DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    setvbuf(stdout, NULL, _IONBF, 0);
    umask(022);
    mkdir(at(dir, "sub"), 0755);

    /* An unnamed file: I/O through the descriptor, no link, not listed. */
    int fd = opened("open tmpfile", open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0666));
    say("write", write(fd, "hello tmpfile\n", 14));
    say("pwrite", pwrite(fd, "HELLO", 5, 0));
    char buf[64] = {0};
    say("pread", pread(fd, buf, sizeof buf, 0));
    printf("  [%s]\n", buf);
    fstat_of("fstat", fd);
    list("listed", dir);
    char link[4096] = {0};
    ssize_t n = readlink(proc_fd(fd), link, sizeof link - 1);
    size_t dl = strlen(dir);
    int shaped = n > 0 && !strncmp(link, dir, dl) && link[dl] == '/' && link[dl + 1] == '#' && strstr(link, " (deleted)") == link + n - 10;
    printf("readlink DIR/#INO (deleted): %d\n", shaped);
    say("fchmod", fchmod(fd, 0604));
    say("ftruncate", ftruncate(fd, 20));
    fstat_of("fstat after fchmod, ftruncate", fd);

    /* linkat(AT_EMPTY_PATH) names it, with its data; a second link is a hard link. */
    say("link empty path", linkat(fd, "", AT_FDCWD, at(dir, "named"), AT_EMPTY_PATH));
    fstat_of("fstat linked", fd);
    stat_of("stat named", at(dir, "named"));
    contents("read named", at(dir, "named"));
    list("listed", dir);
    say("link again", linkat(fd, "", AT_FDCWD, at(dir, "sub/second"), AT_EMPTY_PATH));
    fstat_of("fstat twice linked", fd);
    say("link onto a name", linkat(fd, "", AT_FDCWD, at(dir, "named"), AT_EMPTY_PATH));
    say("link without AT_EMPTY_PATH", linkat(fd, "", AT_FDCWD, at(dir, "x"), 0));
    say("unlink named", unlink(at(dir, "named")));
    say("unlink second", unlink(at(dir, "sub/second")));
    fstat_of("fstat unlinked", fd);
    /* Linked once, it is no longer linkable once its names are gone (Linux's I_LINKABLE). */
    say("link after unlink", linkat(fd, "", AT_FDCWD, at(dir, "again"), AT_EMPTY_PATH));
    say("close", close(fd));

    /* linkat of /proc/self/fd/N: followed with AT_SYMLINK_FOLLOW, procfs's link without. */
    int w = opened("open tmpfile write-only", open(dir, O_TMPFILE | O_WRONLY, 0640));
    say("write", write(w, "via proc\n", 9));
    say("link proc fd not followed", linkat(AT_FDCWD, proc_fd(w), AT_FDCWD, at(dir, "viaproc"), 0));
    say("link proc fd followed", linkat(AT_FDCWD, proc_fd(w), AT_FDCWD, at(dir, "viaproc"), AT_SYMLINK_FOLLOW));
    fstat_of("fstat", w);
    contents("read viaproc", at(dir, "viaproc"));
    say("read write-only", read(w, buf, 1));
    close(w);

    /* O_EXCL: never linkable. */
    int x = opened("open tmpfile O_EXCL", open(dir, O_TMPFILE | O_RDWR | O_EXCL, 0600));
    say("write", write(x, "excl", 4));
    say("link O_EXCL empty path", linkat(x, "", AT_FDCWD, at(dir, "excl"), AT_EMPTY_PATH));
    say("link O_EXCL proc fd", linkat(AT_FDCWD, proc_fd(x), AT_FDCWD, at(dir, "excl"), AT_SYMLINK_FOLLOW));
    fstat_of("fstat O_EXCL", x);
    close(x);

    /* An ordinary file unlinked while open is not linkable; one with a name is. */
    int p = opened("open plain", open(at(dir, "plain"), O_CREAT | O_RDWR, 0644));
    say("link plain empty path", linkat(p, "", AT_FDCWD, at(dir, "plain2"), AT_EMPTY_PATH));
    stat_of("stat plain2", at(dir, "plain2"));
    say("unlink plain", unlink(at(dir, "plain")));
    say("unlink plain2", unlink(at(dir, "plain2")));
    say("link unlinked plain", linkat(p, "", AT_FDCWD, at(dir, "plain3"), AT_EMPTY_PATH));
    say("link unlinked plain proc fd", linkat(AT_FDCWD, proc_fd(p), AT_FDCWD, at(dir, "plain3"), AT_SYMLINK_FOLLOW));
    close(p);

    /* A directory descriptor cannot be linked. */
    int d = opened("open dir", open(at(dir, "sub"), O_RDONLY | O_DIRECTORY));
    say("link dir empty path", linkat(d, "", AT_FDCWD, at(dir, "subdir2"), AT_EMPTY_PATH));
    /* O_TMPFILE relative to a directory descriptor, named there. */
    int r = opened("openat tmpfile in dirfd", openat(d, ".", O_TMPFILE | O_RDWR, 0600));
    say("write", write(r, "in sub\n", 7));
    say("link into dirfd", linkat(r, "", d, "insub", AT_EMPTY_PATH));
    contents("read sub/insub", at(dir, "sub/insub"));
    close(r);
    close(d);

    /* A mode that allows nothing: the descriptor still reads and writes. */
    int z = opened("open tmpfile mode 0", open(dir, O_TMPFILE | O_RDWR, 0));
    say("write mode 0", write(z, "z", 1));
    say("pread mode 0", pread(z, buf, 1, 0));
    fstat_of("fstat mode 0", z);
    close(z);

    /* A child of fork names its parent's unnamed file. */
    int f = opened("open tmpfile before fork", open(dir, O_TMPFILE | O_RDWR, 0644));
    say("write", write(f, "from the parent\n", 16));
    pid_t child = fork();
    if (child == 0)
        _exit(linkat(f, "", AT_FDCWD, at(dir, "bychild"), AT_EMPTY_PATH) == 0 ? 0 : 1);
    int status = 0;
    waitpid(child, &status, 0);
    printf("child linked: %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    fstat_of("fstat after the child's link", f);
    contents("read bychild", at(dir, "bychild"));
    close(f);

    /* Errors, as the kernel gives them. */
    say("O_TMPFILE read-only", open(dir, O_TMPFILE | O_RDONLY, 0600));
    say("O_TMPFILE with O_CREAT", open(dir, O_TMPFILE | O_RDWR | O_CREAT, 0600));
    say("O_TMPFILE of a file", open(at(dir, "viaproc"), O_TMPFILE | O_RDWR, 0600));
    say("O_TMPFILE of a missing dir", open(at(dir, "missing"), O_TMPFILE | O_RDWR, 0600));
    say("O_TMPFILE under a missing dir", open(at(dir, "missing/sub"), O_TMPFILE | O_RDWR, 0600));
    say("symlink to sub", symlink("sub", at(dir, "tosub")));
    int s = opened("O_TMPFILE through a symlink", open(at(dir, "tosub"), O_TMPFILE | O_RDWR, 0600));
    close(s);
    say("O_TMPFILE of a symlink, O_NOFOLLOW", open(at(dir, "tosub"), O_TMPFILE | O_RDWR | O_NOFOLLOW, 0600));
    int o = opened("O_TMPFILE with O_PATH", open(dir, O_TMPFILE | O_PATH, 0));
    struct stat st;
    int got = fstat(o, &st);
    printf("fstat O_PATH: %d directory %d\n", got, S_ISDIR(st.st_mode));
    close(o);
    list("listed at the end", dir);
    list("listed in sub", at(dir, "sub"));
    return 0;
}
