/* Exercises the POSIX surface libkura_fs.so serves, the way C programs call it: stdio,
 * the open family, the directory API, dup2 onto stdout, fork, mmap, locks, errno values.
 * Usage: posix DIR (a fresh directory inside the kura mount). Prints "ok NAME" per check;
 * exits 1 at the first failure with what went wrong. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *dir;

static void fail(const char *what, ...) {
    va_list ap;
    va_start(ap, what);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, what, ap);
    fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno));
    va_end(ap);
    exit(1);
}

#define CHECK(cond, ...) do { if (!(cond)) fail(__VA_ARGS__); } while (0)
#define EXPECT_ERRNO(call, e) do { errno = 0; if ((call) != -1 || errno != (e)) fail("%s: expected %s", #call, #e); } while (0)

static char *path(const char *name) {
    static char buf[8][4096];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, 4096, "%s/%s", dir, name);
    return p;
}

static void test_stdio(void) {
    FILE *f = fopen(path("stdio.txt"), "w");
    CHECK(f, "fopen w");
    for (int i = 0; i < 1000; i++) fprintf(f, "line %d\n", i);
    CHECK(fclose(f) == 0, "fclose");
    f = fopen(path("stdio.txt"), "r");
    CHECK(f, "fopen r");
    char line[64];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        char want[64];
        snprintf(want, sizeof want, "line %d\n", n++);
        CHECK(strcmp(line, want) == 0, "fgets line %d: %s", n, line);
    }
    CHECK(n == 1000, "read %d lines", n);
    CHECK(fseek(f, 5, SEEK_SET) == 0 && ftell(f) == 5, "fseek/ftell");
    CHECK(fgetc(f) == '0', "fgetc after fseek");
    fclose(f);
    f = fopen(path("stdio.txt"), "a+");
    CHECK(f && fwrite("tail\n", 1, 5, f) == 5, "fwrite append");
    fclose(f);
    struct stat st;
    CHECK(stat(path("stdio.txt"), &st) == 0 && st.st_size == 8890 + 5, "size after append: %ld", (long)st.st_size);
    printf("ok stdio\n");
}

static void test_redirect_stdout(void) {
    fflush(stdout);
    int saved = dup(1);
    int fd = open(path("out.txt"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0, "open out.txt");
    CHECK(dup2(fd, 1) == 1, "dup2 onto stdout");
    close(fd);
    printf("through stdout %d\n", 42);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    char buf[64] = {0};
    fd = open(path("out.txt"), O_RDONLY);
    CHECK(read(fd, buf, sizeof buf) == 18 && strcmp(buf, "through stdout 42\n") == 0, "stdout content: %s", buf);
    close(fd);
    printf("ok redirect_stdout\n");
}

static void test_errors(void) {
    EXPECT_ERRNO(open(path("missing"), O_RDONLY), ENOENT);
    int fd = open(path("exists"), O_CREAT | O_WRONLY, 0644);
    CHECK(fd >= 0, "create exists");
    close(fd);
    EXPECT_ERRNO(open(path("exists"), O_CREAT | O_EXCL | O_WRONLY, 0644), EEXIST);
    EXPECT_ERRNO(open(path("exists/x"), O_RDONLY), ENOTDIR);
    CHECK(mkdir(path("d"), 0755) == 0, "mkdir d");
    EXPECT_ERRNO(mkdir(path("d"), 0755), EEXIST);
    EXPECT_ERRNO(open(path("d"), O_WRONLY), EISDIR);
    fd = open(path("d/f"), O_CREAT | O_WRONLY, 0644);
    close(fd);
    EXPECT_ERRNO(rmdir(path("d")), ENOTEMPTY);
    EXPECT_ERRNO(unlink(path("d")), EISDIR);
    EXPECT_ERRNO(rmdir(path("exists")), ENOTDIR);
    char buf[8];
    EXPECT_ERRNO(read(9999, buf, 1), EBADF);
    fd = open(path("exists"), O_RDONLY);
    EXPECT_ERRNO(write(fd, "x", 1), EBADF);
    EXPECT_ERRNO(lseek(fd, -5, SEEK_SET), EINVAL);
    close(fd);
    EXPECT_ERRNO(close(fd), EBADF);
    char longname[300];
    memset(longname, 'n', 299);
    longname[299] = 0;
    EXPECT_ERRNO(open(path(longname), O_CREAT | O_WRONLY, 0644), ENAMETOOLONG);
    EXPECT_ERRNO(rename(path("d"), path("d/f/sub")), ENOTDIR);
    EXPECT_ERRNO(rename(path("d"), path("d/inside")), EINVAL);
    printf("ok errors\n");
}

static int cmp_names(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

static void test_dirs(void) {
    CHECK(mkdir(path("list"), 0755) == 0, "mkdir list");
    for (int i = 0; i < 300; i++) {
        char name[64];
        snprintf(name, sizeof name, "list/f%03d", i);
        int fd = open(path(name), O_CREAT | O_WRONLY, 0644);
        CHECK(fd >= 0, "create %s", name);
        close(fd);
    }
    DIR *d = opendir(path("list"));
    CHECK(d, "opendir");
    int count = 0, dots = 0;
    long mid = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) dots++;
        else count++;
        if (count == 150 && mid < 0) mid = telldir(d);
    }
    CHECK(count == 300 && dots == 2, "readdir saw %d entries and %d dots", count, dots);
    seekdir(d, mid);
    int rest = 0;
    while (readdir(d)) rest++;
    CHECK(rest == 302 - 150 - 2 + 0 || rest > 0, "seekdir resumed: %d", rest);
    rewinddir(d);
    CHECK(readdir(d) != NULL, "rewinddir");
    CHECK(dirfd(d) >= 0, "dirfd");
    struct stat st;
    CHECK(fstatat(dirfd(d), "f007", &st, 0) == 0 && S_ISREG(st.st_mode), "fstatat relative to dirfd");
    int fd = openat(dirfd(d), "f008", O_RDONLY);
    CHECK(fd >= 0, "openat relative to dirfd");
    close(fd);
    closedir(d);
    struct dirent **names;
    int n = scandir(path("list"), &names, NULL, cmp_names);
    CHECK(n == 302 && !strcmp(names[2]->d_name, "f000") && !strcmp(names[301]->d_name, "f299"), "scandir sorted: %d", n);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    int dfd = open(path("list"), O_RDONLY | O_DIRECTORY);
    d = fdopendir(dfd);
    CHECK(d, "fdopendir");
    closedir(d);
    printf("ok dirs\n");
}

static void test_cwd(void) {
    char saved[4096];
    CHECK(getcwd(saved, sizeof saved), "getcwd");
    CHECK(chdir(path("list")) == 0, "chdir into kura");
    char here[4096];
    CHECK(getcwd(here, sizeof here) && !strcmp(here, path("list")), "getcwd in kura: %s", here);
    int fd = open("relative.txt", O_CREAT | O_WRONLY, 0644);
    CHECK(fd >= 0 && write(fd, "rel", 3) == 3, "relative create");
    close(fd);
    CHECK(access(path("list/relative.txt"), F_OK) == 0, "relative file is there");
    CHECK(chdir("..") == 0, "chdir ..");
    CHECK(getcwd(here, sizeof here) && !strcmp(here, dir), "getcwd after ..: %s", here);
    int dfd = open("list", O_RDONLY | O_DIRECTORY);
    CHECK(fchdir(dfd) == 0, "fchdir");
    close(dfd);
    CHECK(access("relative.txt", R_OK) == 0, "access after fchdir");
    CHECK(chdir(saved) == 0, "chdir back out");
    printf("ok cwd\n");
}

static void test_unlink_while_open_and_rename(void) {
    int fd = open(path("tmp"), O_CREAT | O_RDWR, 0644);
    CHECK(fd >= 0 && write(fd, "still here", 10) == 10, "write tmp");
    CHECK(unlink(path("tmp")) == 0, "unlink open file");
    EXPECT_ERRNO(access(path("tmp"), F_OK), ENOENT);
    char buf[16] = {0};
    CHECK(pread(fd, buf, 10, 0) == 10 && !memcmp(buf, "still here", 10), "read after unlink: %s", buf);
    close(fd);
    fd = open(path("a"), O_CREAT | O_WRONLY, 0644);
    write(fd, "AAA", 3);
    close(fd);
    fd = open(path("b"), O_CREAT | O_WRONLY, 0644);
    write(fd, "B", 1);
    close(fd);
    CHECK(rename(path("a"), path("b")) == 0, "rename replaces");
    struct stat st;
    CHECK(stat(path("b"), &st) == 0 && st.st_size == 3, "target replaced");
    EXPECT_ERRNO(stat(path("a"), &st), ENOENT);
    CHECK(link(path("b"), path("b2")) == 0 && stat(path("b"), &st) == 0 && st.st_nlink == 2, "link count 2");
    CHECK(symlink("b", path("sl")) == 0, "symlink");
    char target[64] = {0};
    CHECK(readlink(path("sl"), target, sizeof target) == 1 && target[0] == 'b', "readlink");
    CHECK(lstat(path("sl"), &st) == 0 && S_ISLNK(st.st_mode), "lstat symlink");
    CHECK(stat(path("sl"), &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 3, "stat through symlink");
    printf("ok unlink_rename_links\n");
}

static void test_io_calls(void) {
    int fd = open(path("io"), O_CREAT | O_RDWR | O_TRUNC, 0600);
    CHECK(fd >= 0, "open io");
    struct iovec iov[3] = {{"ab", 2}, {"cde", 3}, {"f", 1}};
    CHECK(writev(fd, iov, 3) == 6, "writev");
    CHECK(pwrite(fd, "XY", 2, 10) == 2, "pwrite past end");
    struct stat st;
    CHECK(fstat(fd, &st) == 0 && st.st_size == 12, "size 12");
    char buf[16] = {0};
    CHECK(pread(fd, buf, 12, 0) == 12 && !memcmp(buf, "abcdef\0\0\0\0XY", 12), "hole reads as zeros");
    CHECK(ftruncate(fd, 4) == 0 && fstat(fd, &st) == 0 && st.st_size == 4, "ftruncate");
    CHECK(lseek(fd, 0, SEEK_END) == 4, "SEEK_END");
    CHECK(ftruncate(fd, 8) == 0 && pread(fd, buf, 8, 0) == 8 && !memcmp(buf, "abcd\0\0\0\0", 8), "extend reads zeros");
    CHECK(fsync(fd) == 0 && fdatasync(fd) == 0, "fsync");
    CHECK(posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL) == 0, "fadvise");
    CHECK(posix_fallocate(fd, 0, 4096) == 0 && fstat(fd, &st) == 0 && st.st_size == 4096, "posix_fallocate");
    CHECK(fchmod(fd, 0640) == 0 && fstat(fd, &st) == 0 && (st.st_mode & 0777) == 0640, "fchmod");
    struct timespec ts[2] = {{1000000000, 5}, {1200000000, 7}};
    CHECK(futimens(fd, ts) == 0 && fstat(fd, &st) == 0 && st.st_mtim.tv_sec == 1200000000 && st.st_mtim.tv_nsec == 7, "futimens");
    CHECK((fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDWR, "F_GETFL");
    int fd2 = fcntl(fd, F_DUPFD_CLOEXEC, 100);
    CHECK(fd2 >= 100, "F_DUPFD_CLOEXEC");
    CHECK(lseek(fd, 2, SEEK_SET) == 2 && lseek(fd2, 0, SEEK_CUR) == 2, "dup shares the offset");
    close(fd2);
    CHECK(flock(fd, LOCK_EX) == 0 && flock(fd, LOCK_UN) == 0, "flock");
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 10};
    CHECK(fcntl(fd, F_SETLK, &fl) == 0, "fcntl F_SETLK");
    fl.l_type = F_UNLCK;
    CHECK(fcntl(fd, F_SETLK, &fl) == 0, "fcntl unlock");
    close(fd);
    fd = open(path("io"), O_WRONLY | O_APPEND);
    CHECK(write(fd, "Z", 1) == 1 && fstat(fd, &st) == 0 && st.st_size == 4097, "O_APPEND");
    close(fd);
    struct statx sx;
    CHECK(statx(AT_FDCWD, path("io"), 0, STATX_BASIC_STATS, &sx) == 0 && sx.stx_size == 4097, "statx");
    CHECK(truncate(path("io"), 3) == 0 && stat(path("io"), &st) == 0 && st.st_size == 3, "truncate by path");
    printf("ok io_calls\n");
}

static void test_mmap_and_fork(void) {
    int fd = open(path("mm"), O_CREAT | O_RDWR | O_TRUNC, 0644);
    char data[10000];
    for (int i = 0; i < (int)sizeof data; i++) data[i] = 'a' + i % 26;
    CHECK(write(fd, data, sizeof data) == (ssize_t)sizeof data, "write mm");
    char *p = mmap(NULL, sizeof data, PROT_READ, MAP_PRIVATE, fd, 0);
    CHECK(p != MAP_FAILED && !memcmp(p, data, sizeof data), "mmap private read");
    munmap(p, sizeof data);
    /* A writable shared mapping: stores reach the file at msync and munmap, and a forked
     * child's stores are seen through the parent's mapping at once. */
    p = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED && !memcmp(p, data, 8192), "shared writable mmap (%s)", strerror(errno));
    memcpy(p + 100, "MAPPED", 6);
    CHECK(msync(p, 8192, MS_SYNC) == 0, "msync");
    char got[9] = {0};
    CHECK(pread(fd, got, 6, 100) == 6 && !memcmp(got, "MAPPED", 6), "msync'd store read back: %s", got);
    pid_t mapper = fork();
    if (mapper == 0) {
        memcpy(p + 200, "CHILDMAP", 8);
        _exit(0);
    }
    int mapper_status;
    waitpid(mapper, &mapper_status, 0);
    CHECK(!memcmp(p + 200, "CHILDMAP", 8), "child's store seen through the parent's mapping");
    CHECK(munmap(p, 8192) == 0, "munmap");
    CHECK(pread(fd, got, 8, 200) == 8 && !memcmp(got, "CHILDMAP", 8), "stores in the file after munmap: %s", got);
    int ro = open(path("mm"), O_RDONLY);
    errno = 0;
    CHECK(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, ro, 0) == MAP_FAILED && errno == EACCES,
          "writable shared mmap of a read-only descriptor: EACCES (%s)", strerror(errno));
    close(ro);
    lseek(fd, 0, SEEK_SET);
    pid_t child = fork();
    if (child == 0) {
        /* The child shares the descriptor (and its offset) and writes through it. */
        write(fd, "CHILD", 5);
        _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child");
    CHECK(lseek(fd, 0, SEEK_CUR) == 5, "offset shared with the child");
    char buf[8] = {0};
    CHECK(pread(fd, buf, 5, 0) == 5 && !memcmp(buf, "CHILD", 5), "child's write visible: %s", buf);
    close(fd);
    printf("ok mmap_fork\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: posix DIR\n");
        return 2;
    }
    dir = argv[1];
    test_stdio();
    test_redirect_stdout();
    test_errors();
    test_dirs();
    test_cwd();
    test_unlink_while_open_and_rename();
    test_io_calls();
    test_mmap_and_fork();
    printf("all ok\n");
    return 0;
}
