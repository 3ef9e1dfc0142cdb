/* Random C stdio, shared-descriptor, fork and lock operations for a differential test
 * (tests/stdio_random.rs): what tests/py/random_ops.py does not reach.
 *
 *     stdio_random ROOT FIRST_SEED SEEDS OPS
 *     stdio_random ROOT regressions
 *
 * For each seed makes ROOT/s<seed> and performs OPS random operations on three files in it,
 * printing one line per operation: "<seed> <index> <operation> = <result>", the result being
 * values, errno names and hashes of the bytes read. Nothing printed depends on the root, inode
 * or descriptor numbers, process ids or the clock, so the same seed prints the same lines on any
 * file system that behaves like Linux's. Names are "f0".."f2" in the seed's directory: no
 * "..", no absolute path, nothing outside ROOT is touched.
 *
 * Forked children never print: they send their answers to the parent through a pipe, and the
 * parent prints them, so lines stay in order. Pipes also sequence parent and child. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdio_ext.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* kura's default chunk (kura_fs::layout::CHUNK_SIZE_BYTES_DEFAULT): sizes and offsets cross it. */
#define CHUNK_BYTES 4096
#define IO_BYTES_MAX (3 * CHUNK_BYTES + 17)
#define OFFSET_MAX (6 * CHUNK_BYTES)
#define STREAMS_MAX 3
#define FDS_MAX 3
#define FILES 3
#define LINE_BYTES_MAX 512
#define STEPS_MAX 6
/* A child blocked in F_SETLKW gives up after this long (a lock never released must not hang). */
#define LOCK_WAIT_S 5

static uint64_t rng;
static FILE *streams[STREAMS_MAX];
static char *stream_bufs[STREAMS_MAX];
/* glibc frees a pointer into the FILE itself, or the caller's buffer, when a stream without a
 * buffer or with the caller's that had a character pushed back seeks or closes (it swaps the
 * buffer with its backup area), and on a stream it last wrote: ungetc only on a stream just read
 * that has a buffer of its own. Nor on a stream not open for reading (a failed fread counts as
 * a read): its fflush then seeks by the distance between two of glibc's heap blocks, which
 * depends on the heap's layout (seed 7507 of 7500+100: EINVAL or a seek far ahead, and a
 * "double free or corruption" abort later, on the host itself). */
static int unbuffered[STREAMS_MAX];
/* C promises one character of pushback; glibc takes more into a backup area, and a getline
 * over two of them then a close of the stream freed that area twice (seed 8627 of 8600+100,
 * "double free or corruption" on the host itself). A stream gets one ungetc until it is
 * positioned again, reopened or closed. */
static int pushed_back[STREAMS_MAX];
/* C wants a seek (or fflush after writing) between reading and writing an update stream;
 * glibc corrupts its buffers without one. The last direction of each stream's I/O: */
enum direction { IDLE, READING, WRITING };
static enum direction last_dir[STREAMS_MAX];
static int fds[FDS_MAX] = {-1, -1, -1};
static char line[8192];
static size_t line_len;

static uint64_t next_u64(void) {
    uint64_t z = (rng += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int rnd(int n) { return (int)(next_u64() % (uint64_t)n); }

static void out(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line + line_len, sizeof line - line_len, fmt, ap);
    va_end(ap);
    if (n > 0) line_len += (size_t)n < sizeof line - line_len ? (size_t)n : sizeof line - line_len - 1;
}

static const char *ename(int e) {
    const char *n = strerrorname_np(e);
    return n ? n : "E?";
}

/* "<r>" or "-1 ENAME" for a call returning -1 on failure. */
static void res_errno(const char *what, long r, int e) {
    if (r < 0) out(" %s=%ld %s", what, r, ename(e));
    else out(" %s=%ld", what, r);
}

/* The call's result and, if it failed, its errno (read after the call). */
#define RES(what, call) do { errno = 0; long r_ = (long)(call); res_errno(what, r_, errno); } while (0)

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static void digest(const void *p, size_t n) { out(" %zu:%012llx", n, (unsigned long long)(fnv(p, n) & 0xffffffffffffULL)); }

static const char *name(void) {
    static const char *names[FILES] = {"f0", "f1", "f2"};
    return names[rnd(FILES)];
}

static size_t size(void) {
    static const size_t fixed[] = {0, 1, 7, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1};
    int i = rnd(8);
    return i < 6 ? fixed[i] : (size_t)rnd(IO_BYTES_MAX + 1);
}

static long offset(void) {
    static const long fixed[] = {0, 1, CHUNK_BYTES - 3, CHUNK_BYTES, 2 * CHUNK_BYTES + 5};
    int i = rnd(6);
    return i < 5 ? fixed[i] : rnd(OFFSET_MAX + 1);
}

/* Text with short lines and numbers (for fgets, getline, fscanf), now and then a NUL. */
static void fill(char *buf, size_t n) {
    static const char alphabet[] = "0123456789 abcxyz-\n\n";
    for (size_t i = 0; i < n; i++) buf[i] = rnd(200) == 0 ? '\0' : alphabet[rnd(sizeof alphabet - 1)];
}

static char io_buf[IO_BYTES_MAX + 1];

/* ---------------------------------------------------------------- stdio on kept streams */

static int stream_slot(void) {
    int s = rnd(STREAMS_MAX);
    for (int i = 0; i < STREAMS_MAX; i++)
        if (streams[(s + i) % STREAMS_MAX]) return (s + i) % STREAMS_MAX;
    return -1;
}

static int free_stream_slot(void) {
    for (int i = 0; i < STREAMS_MAX; i++)
        if (!streams[i]) return i;
    return -1;
}

static void close_stream(int s) {
    errno = 0;
    int r = fclose(streams[s]);
    RES("fclose", r);
    streams[s] = NULL;
    free(stream_bufs[s]);
    stream_bufs[s] = NULL;
    unbuffered[s] = 0;
    pushed_back[s] = 0;
    last_dir[s] = IDLE;
}

/* Buffering chosen at random right after the open (setvbuf must come before any I/O). */
static void random_buffering(int s) {
    static const int modes[] = {_IOFBF, _IOLBF, _IONBF};
    int how = rnd(4);
    if (how == 3) return;
    size_t n = rnd(2) ? 16 : CHUNK_BYTES * 2 + 100;
    stream_bufs[s] = malloc(n);
    int own = rnd(4) != 0;
    int r = setvbuf(streams[s], own ? stream_bufs[s] : NULL, modes[how], n);
    out(" setvbuf(%d,%zu,%d)=%d", how, n, own, r);
    unbuffered[s] |= own || modes[how] == _IONBF;
}

static const char *random_mode(void) {
    static const char *modes[] = {"r", "r+", "w", "w+", "a", "a+", "wx", "w+x", "ax", "a+x", "re", "r+e", "we", "w+e", "ae", "a+e", "w+xe"};
    return modes[rnd(sizeof modes / sizeof *modes)];
}

static void op_fopen(void) {
    int s = free_stream_slot();
    if (s < 0) {
        out("fclose");
        close_stream(stream_slot());
        return;
    }
    const char *n = name(), *mode = random_mode();
    errno = 0;
    streams[s] = fopen(n, mode);
    out("fopen [%d] %s %s", s, n, mode);
    if (!streams[s]) {
        out(" %s", ename(errno));
        return;
    }
    out(" ok");
    random_buffering(s);
}

static void op_fdopen(void) {
    int s = free_stream_slot();
    if (s < 0) return op_fopen();
    static const int accs[] = {O_RDONLY, O_WRONLY, O_RDWR};
    int flags = accs[rnd(3)] | (rnd(3) ? O_CREAT : 0) | (rnd(4) ? 0 : O_APPEND);
    const char *n = name(), *mode = random_mode();
    if (mode[1] == 'x') mode = "r+";
    out("fdopen [%d] %s %o %s", s, n, flags, mode);
    errno = 0;
    int fd = open(n, flags, 0644);
    if (fd < 0) return out(" open %s", ename(errno));
    if (rnd(2)) lseek(fd, offset(), SEEK_SET);
    errno = 0;
    streams[s] = fdopen(fd, mode);
    if (!streams[s]) {
        out(" %s", ename(errno));
        close(fd);
        return;
    }
    out(" ok fl=%o", fcntl(fd, F_GETFL) & (O_ACCMODE | O_APPEND));
    random_buffering(s);
}

static void op_freopen(int s) {
    /* freopen(NULL, ...) reopens /proc/self/fd/N: a new description of the same file. */
    const char *n = rnd(3) ? name() : NULL, *mode = random_mode();
    if (strchr(mode, 'x')) mode = "w+";
    out("freopen %s %s", n ? n : "NULL", mode);
    errno = 0;
    FILE *f = freopen(n, mode, streams[s]);
    if (!f) {
        out(" %s", ename(errno));
        streams[s] = NULL;
        free(stream_bufs[s]);
        stream_bufs[s] = NULL;
        unbuffered[s] = 0;
    } else {
        last_dir[s] = IDLE;
        pushed_back[s] = 0;
        out(" ok");
    }
}

static void status(FILE *f) { out(" eof=%d err=%d", feof(f), ferror(f)); }

/* errno after a call that failed with the stream's error flag (not at the end of the file):
 * after a success, or at the end, errno is whatever the library left there. */
static void failure(FILE *f, int failed) {
    if (failed && ferror(f) && !feof(f)) out(" %s", ename(errno));
}

static void op_fread(FILE *f) {
    size_t want = size();
    errno = 0;
    size_t n = fread(io_buf, 1, want, f);
    int e = errno;
    out("fread %zu =", want);
    digest(io_buf, n);
    status(f);
    errno = e;
    failure(f, n < want);
}

static void op_fwrite(FILE *f) {
    size_t want = size();
    fill(io_buf, want);
    errno = 0;
    size_t n = fwrite(io_buf, 1, want, f);
    int e = errno;
    out("fwrite %zu = %zu", want, n);
    status(f);
    errno = e;
    failure(f, n < want);
}

/* kind 0, 1, 4 read; 2, 3 write. */
static void op_lines(FILE *f, int kind) {
    int failed;
    errno = 0;
    switch (kind) {
    case 0: {
        int n = 1 + rnd(200);
        char *r = fgets(io_buf, n, f);
        out("fgets %d =", n);
        if (r) digest(io_buf, strlen(io_buf));
        else out(" NULL");
        failed = !r;
        break;
    }
    case 1: {
        char *l = NULL;
        size_t cap = 0;
        ssize_t n = getline(&l, &cap, f);
        out("getline =");
        if (n >= 0) digest(l, (size_t)n);
        else out(" -1");
        free(l);
        failed = n < 0;
        break;
    }
    case 2: {
        size_t n = rnd(100);
        fill(io_buf, n);
        io_buf[n] = '\0';
        failed = fputs(io_buf, f) < 0;
        out("fputs %zu = %d", strlen(io_buf), !failed);
        break;
    }
    case 3: {
        int v = rnd(100000) - 500, r = fprintf(f, "%d %s\n", v, rnd(2) ? "word" : "x");
        out("fprintf = %d", r);
        failed = r < 0;
        break;
    }
    default: {
        int v = 0, r = fscanf(f, "%d", &v);
        out("fscanf = %d %d", r, r == 1 ? v : 0);
        failed = r == EOF;
        break;
    }
    }
    status(f);
    failure(f, failed);
}

/* kind 0, 2 read; 1 writes. Returns what the call returned. */
static int op_chars(FILE *f, int kind) {
    int r;
    errno = 0;
    switch (kind) {
    case 0: out("fgetc = %d", r = fgetc(f)); break;
    case 1: out("fputc = %d", r = fputc('a' + rnd(26), f)); break;
    default: {
        int c = rnd(5) ? 'A' + rnd(26) : EOF;
        out("ungetc %d = %d", c, r = ungetc(c, f));
        break;
    }
    }
    status(f);
    failure(f, r == EOF);
    return r;
}

/* Whether the stream was positioned (ftell does not count). */
static int op_seek(FILE *f) {
    static const int whences[] = {SEEK_SET, SEEK_CUR, SEEK_END};
    int w = whences[rnd(3)];
    long off = w == SEEK_SET ? offset() : rnd(2 * CHUNK_BYTES) - CHUNK_BYTES;
    int kind = rnd(5), r = 0;
    errno = 0;
    switch (kind) {
    case 0: RES("fseek", r = fseek(f, off, w)); break;
    case 1: RES("fseeko", r = fseeko(f, off, w)); break;
    case 2: rewind(f); out(" rewind"); break;
    case 3: RES("ftell", ftell(f)); break;
    default: RES("ftello", ftello(f)); break;
    }
    out(" (%ld,%d)", off, w);
    status(f);
    return kind < 3 && r == 0;
}

/* Whether it flushed the stream (so that it may read after writing). */
static int op_flush_state(FILE *f) {
    errno = 0;
    int flushed = 0;
    switch (rnd(3)) {
    case 0: {
        int r;
        RES("fflush", r = fflush(f));
        flushed = r == 0;
        break;
    }
    case 1: clearerr(f); out("clearerr"); break;
    default: out("state"); break;
    }
    status(f);
    return flushed;
}

/* The stream's descriptor used directly, between stdio calls on it. */
static void op_fileno_io(FILE *f) {
    int fd = fileno(f);
    errno = 0;
    switch (rnd(3)) {
    case 0: {
        size_t n = size();
        ssize_t r = read(fd, io_buf, n);
        out("fileno read %zu", n);
        if (r >= 0) digest(io_buf, (size_t)r);
        else out(" %s", ename(errno));
        break;
    }
    case 1: {
        size_t n = size();
        fill(io_buf, n);
        out("fileno write %zu", n);
        RES("", write(fd, io_buf, n));
        break;
    }
    default: out("fileno lseek"); RES("", lseek(fd, offset(), rnd(2) ? SEEK_SET : SEEK_END)); break;
    }
    RES("pos", lseek(fd, 0, SEEK_CUR));
}

/* Seeks to where the stream is when I/O changes direction. Whether the I/O may go on: a stream
 * whose seek failed (its position is below 0) has its buffers in no state to turn, and glibc
 * corrupts its heap if it does (seed 2649, a crash in fgets on the host itself). */
static int turn(int s, enum direction d) {
    if (last_dir[s] != IDLE && last_dir[s] != d) {
        errno = 0;
        int r = fseek(streams[s], 0, SEEK_CUR);
        out("~%d%s ", r, r ? ename(errno) : "");
        if (r) {
            out("not turned");
            return 0;
        }
    }
    last_dir[s] = d;
    return 1;
}

/* A read of a stream not open for reading fails (EBADF), which is worth comparing; but on a
 * stream without a buffer of its own glibc then corrupts its heap (seed 8987: an fgets of an
 * unbuffered write-only stream, then a rewind freed a pointer glibc never allocated, on the
 * host itself). Such a stream is not read. */
static int may_read(int s) {
    if (__freadable(streams[s]) || !unbuffered[s]) return 1;
    out("not read");
    return 0;
}

static void op_stream(void) {
    int s = stream_slot();
    if (s < 0) return op_fopen();
    FILE *f = streams[s];
    out("[%d] ", s);
    int kind;
    switch (rnd(12)) {
    case 0: case 1: if (may_read(s) && turn(s, READING)) op_fread(f); break;
    case 2: case 3: if (turn(s, WRITING)) op_fwrite(f); break;
    case 4: case 5: {
        kind = rnd(5);
        int writes = kind == 2 || kind == 3;
        if ((writes || may_read(s)) && turn(s, writes ? WRITING : READING)) op_lines(f, kind);
        break;
    }
    case 6: {
        kind = rnd(unbuffered[s] || pushed_back[s] || last_dir[s] != READING || !__freadable(f) ? 2 : 3);
        if ((kind != 1 && !may_read(s)) || !turn(s, kind == 1 ? WRITING : READING)) break;
        int r = op_chars(f, kind);
        if (kind == 2 && r != EOF) pushed_back[s] = 1;
        break;
    }
    case 7: case 8: if (op_seek(f)) { last_dir[s] = IDLE; pushed_back[s] = 0; } break;
    /* Only a flush lets a stream that wrote read next (C; a clearerr there left glibc's
     * buffers to corrupt its heap: seed 4207, a crash in fseek on the host itself). */
    case 9: if (op_flush_state(f) && last_dir[s] == WRITING) last_dir[s] = IDLE; break;
    case 10: op_fileno_io(f); break;
    default: rnd(3) ? (out("fclose"), close_stream(s)) : op_freopen(s); break;
    }
}

/* ---------------------------------------------------------------- descriptors */

static void offsets(void) {
    out(" |");
    for (int i = 0; i < FDS_MAX; i++)
        if (fds[i] >= 0) out(" %d@%ld", i, (long)lseek(fds[i], 0, SEEK_CUR));
}

static void op_fd(void) {
    int i = rnd(FDS_MAX), other = rnd(FDS_MAX);
    errno = 0;
    if (fds[i] < 0) {
        if (fds[other] >= 0 && rnd(2)) {
            fds[i] = dup(fds[other]);
            out("dup %d->%d", other, i);
        } else {
            static const int accs[] = {O_RDONLY, O_WRONLY, O_RDWR};
            int flags = accs[rnd(3)] | O_CREAT | (rnd(3) ? 0 : O_APPEND) | (rnd(8) ? 0 : O_TRUNC);
            const char *n = name();
            fds[i] = open(n, flags, 0644);
            out("open %s %o", n, flags);
        }
        if (fds[i] < 0) out(" %s", ename(errno));
        offsets();
        return;
    }
    int fd = fds[i];
    size_t n = size();
    long at = offset();
    struct stat st;
    switch (rnd(6)) {
    case 0: {
        ssize_t r = read(fd, io_buf, n);
        out("read %d %zu", i, n);
        if (r >= 0) digest(io_buf, (size_t)r);
        else out(" %s", ename(errno));
        break;
    }
    case 1: fill(io_buf, n); out("write %d %zu", i, n); RES("", write(fd, io_buf, n)); break;
    case 2: {
        ssize_t r = pread(fd, io_buf, n, at);
        out("pread %d %zu@%ld", i, n, at);
        if (r >= 0) digest(io_buf, (size_t)r);
        else out(" %s", ename(errno));
        break;
    }
    case 3:
        /* With O_APPEND, Linux's pwrite appends whatever the offset says. */
        fill(io_buf, n);
        out("pwrite %d %zu@%ld", i, n, at);
        RES("", pwrite(fd, io_buf, n, at));
        break;
    case 4: out("lseek %d %ld", i, at); RES("", lseek(fd, at, rnd(2) ? SEEK_SET : SEEK_CUR)); break;
    default: out("close %d", i); RES("", close(fd)); fds[i] = -1; break;
    }
    if (fds[i] >= 0 && fstat(fds[i], &st) == 0) out(" size=%lld", (long long)st.st_size);
    offsets();
}

/* ---------------------------------------------------------------- fork scenarios */

static void put_line(int fd, const char *fmt, ...) {
    char buf[LINE_BYTES_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    buf[n++] = '\n';
    if (write(fd, buf, n) != n) _exit(3);
}

/* Reads one line the other process sent (without its newline). */
static char *get_line(int fd) {
    static char buf[LINE_BYTES_MAX];
    size_t n = 0;
    while (n + 1 < sizeof buf && read(fd, buf + n, 1) == 1 && buf[n] != '\n') n++;
    buf[n] = '\0';
    return buf;
}

static void wait_child(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    out(" child=%d", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

/* Everything buffered is written before a fork: a child's exit() must not write it again. */
static pid_t fork_clean(void) {
    fflush(NULL);
    return fork();
}

/* The whole file through a fresh descriptor: its size and hash. */
static void file_digest(const char *n) {
    static char buf[8 * OFFSET_MAX];
    int fd = open(n, O_RDONLY);
    if (fd < 0) return out(" %s:%s", n, ename(errno));
    struct stat st;
    ssize_t r = read(fd, buf, sizeof buf);
    out(" %s size=%lld", n, fstat(fd, &st) ? -1LL : (long long)st.st_size);
    close(fd);
    digest(buf, r < 0 ? 0 : (size_t)r);
}

/* Parent and child take turns writing through an inherited O_APPEND and a plain descriptor of
 * one file (the plain one's offset is shared), the parent looking at the size and reading the
 * file between turns; the child leaves a line in a stdio buffer of its own and ends with exit
 * (flushed once) or _exit (lost). */
static void sc_fork_writes(void) {
    const char *n = name();
    int rounds = 1 + rnd(3), how = rnd(2);
    int via[2 * 3];
    char data[2 * 3][64];
    for (int i = 0; i < 2 * rounds; i++) {
        via[i] = rnd(2);
        size_t len = 1 + rnd(40);
        fill(data[i], len);
        data[i][len] = '\0';
    }
    int a = open(n, O_WRONLY | O_APPEND | O_CREAT, 0644), b = open(n, O_WRONLY | O_CREAT, 0644);
    out("fork-writes %s %d %s", n, rounds, how ? "exit" : "_exit");
    if (a < 0 || b < 0) return out(" %s", ename(errno));
    lseek(b, offset(), SEEK_SET);
    RES(via[0] ? "a" : "b", write(via[0] ? a : b, data[0], strlen(data[0])));
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) return out(" pipe");
    pid_t pid = fork_clean();
    if (pid == 0) {
        for (int i = 1; i < 2 * rounds; i += 2) {
            get_line(p2c[0]);
            ssize_t r = write(via[i] ? a : b, data[i], strlen(data[i]));
            put_line(c2p[1], "%zd", r);
        }
        get_line(p2c[0]); /* the parent has looked at the file: now leave */
        FILE *f = fdopen(dup(b), "w");
        fputs("child-buffered\n", f);
        if (how) exit(0);
        _exit(0);
    }
    for (int i = 1; i < 2 * rounds; i += 2) {
        put_line(p2c[1], "go");
        out(" child:%s", get_line(c2p[0]));
        struct stat st;
        out(" size=%lld", fstat(a, &st) ? -1LL : (long long)st.st_size);
        if (i == 1) file_digest(n);
        if (i + 1 < 2 * rounds) RES(via[i + 1] ? "a" : "b", write(via[i + 1] ? a : b, data[i + 1], strlen(data[i + 1])));
    }
    put_line(p2c[1], "go");
    wait_child(pid);
    out(" b@%ld a@%ld", (long)lseek(b, 0, SEEK_CUR), (long)lseek(a, 0, SEEK_CUR));
    file_digest(n);
    close(a), close(b);
    close(p2c[0]), close(p2c[1]), close(c2p[0]), close(c2p[1]);
}

struct lock_step {
    int who;   /* 0: child F_GETLK, 1: child F_SETLK, 2: parent F_SETLK, 3: parent closes its other descriptor */
    struct flock fl;
};

static struct flock random_flock(void) {
    static const short types[] = {F_RDLCK, F_WRLCK, F_UNLCK};
    static const short whences[] = {SEEK_SET, SEEK_CUR, SEEK_END};
    static const off_t lens[] = {0, 1, 10, 100, CHUNK_BYTES, -5};
    struct flock fl = {0};
    fl.l_type = types[rnd(3)];
    fl.l_whence = whences[rnd(3)];
    fl.l_start = fl.l_whence == SEEK_SET ? rnd(200) : rnd(200) - 50;
    fl.l_len = lens[rnd(6)];
    return fl;
}

static void describe_flock(const struct flock *fl) {
    static const char *types[] = {"rd", "wr", "un"};
    out(" %s/%d/%lld/%lld", fl->l_type <= F_UNLCK ? types[fl->l_type] : "?", fl->l_whence, (long long)fl->l_start, (long long)fl->l_len);
}

static void on_alarm(int sig) { (void)sig; }

/* A lock request; the answer (and F_GETLK's lock: type, start, len, never the pid). */
static void lock_call(int fd, int cmd, struct flock fl, char *answer, size_t cap) {
    errno = 0;
    int r = fcntl(fd, cmd, &fl);
    if (r < 0) snprintf(answer, cap, "%s", ename(errno));
    else if (cmd == F_GETLK) snprintf(answer, cap, "%d/%lld/%lld", fl.l_type, (long long)fl.l_start, (long long)fl.l_len);
    else snprintf(answer, cap, "ok");
}

/* fcntl record locks between the parent and a child, over random ranges (whence SEEK_CUR uses
 * each descriptor's own offset). The parent holds a second descriptor of the file: closing it
 * releases all the parent's locks (POSIX), though the lock was taken through the first. At the
 * end the child waits (F_SETLKW) for a write lock over everything while the parent closes. */
static void sc_fcntl_locks(void) {
    const char *n = name();
    int steps = 2 + rnd(STEPS_MAX - 1), second_is_dup = rnd(2);
    struct lock_step plan[STEPS_MAX];
    for (int i = 0; i < steps; i++) {
        plan[i].who = rnd(7) % 4;
        plan[i].fl = random_flock();
    }
    long parent_off = offset(), child_off = offset();
    out("fcntl-locks %s %s", n, second_is_dup ? "dup" : "open");
    int fd = open(n, O_RDWR | O_CREAT, 0644);
    int other = second_is_dup ? dup(fd) : open(n, O_RDONLY);
    if (fd < 0 || other < 0) return out(" %s", ename(errno));
    lseek(fd, parent_off, SEEK_SET);
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) return out(" pipe");
    pid_t pid = fork_clean();
    if (pid == 0) {
        int c = open(n, O_RDWR);
        lseek(c, child_off, SEEK_SET);
        char answer[64];
        for (int i = 0; i < steps; i++) {
            if (plan[i].who > 1) continue;
            get_line(p2c[0]);
            lock_call(c, plan[i].who ? F_SETLK : F_GETLK, plan[i].fl, answer, sizeof answer);
            put_line(c2p[1], "%s", answer);
        }
        struct sigaction sa = {0};
        sa.sa_handler = on_alarm;
        sigaction(SIGALRM, &sa, NULL);
        get_line(p2c[0]);
        put_line(c2p[1], "waiting");
        alarm(LOCK_WAIT_S);
        struct flock all = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        lock_call(c, F_SETLKW, all, answer, sizeof answer);
        put_line(c2p[1], "%s", answer);
        _exit(0);
    }
    char answer[64];
    for (int i = 0; i < steps; i++) {
        out(" %c", "gsSc"[plan[i].who]);
        if (plan[i].who < 3) describe_flock(&plan[i].fl);
        if (plan[i].who <= 1) {
            put_line(p2c[1], "go");
            out("=%s", get_line(c2p[0]));
        } else if (plan[i].who == 2) {
            lock_call(fd, F_SETLK, plan[i].fl, answer, sizeof answer);
            out("=%s", answer);
        } else if (other >= 0) {
            close(other);
            other = -1;
        }
    }
    put_line(p2c[1], "go");
    out(" w:%s", get_line(c2p[0]));
    close(fd);
    if (other >= 0) close(other);
    out(" W=%s", get_line(c2p[0]));
    wait_child(pid);
    close(p2c[0]), close(p2c[1]), close(c2p[0]), close(c2p[1]);
}

/* flock between a parent and a child: a lock belongs to the open file description, so it is
 * shared through dup and fork and conflicts only with other descriptions. */
static void sc_flock(void) {
    static const int ops[] = {LOCK_SH, LOCK_EX, LOCK_UN};
    const char *n = name();
    /* before == 3: no lock before the fork (the description is first locked after it). */
    int before = rnd(4), child_inherited = ops[rnd(3)], child_own = ops[rnd(2)], via_dup = rnd(2);
    out("flock %s %d %d %d %d", n, before, child_inherited, child_own, via_dup);
    int fd = open(n, O_RDWR | O_CREAT, 0644);
    if (fd < 0) return out(" %s", ename(errno));
    if (before < 3) RES("pre", flock(fd, ops[before] | LOCK_NB));
    if (via_dup) {
        int d = dup(fd);
        close(fd);
        fd = d;
    }
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) return out(" pipe");
    pid_t pid = fork_clean();
    if (pid == 0) {
        int c = open(n, O_RDONLY);
        errno = 0;
        int r1 = flock(c, child_own | LOCK_NB), e1 = errno;
        if (r1 == 0) flock(c, LOCK_UN);
        errno = 0;
        int r2 = flock(fd, child_inherited | LOCK_NB), e2 = errno;
        put_line(c2p[1], "%d%s %d%s", r1, r1 ? ename(e1) : "", r2, r2 ? ename(e2) : "");
        get_line(p2c[0]);
        _exit(0);
    }
    out(" child:%s", get_line(c2p[0]));
    int other = open(n, O_RDONLY);
    RES("other-sh", flock(other, LOCK_SH | LOCK_NB));
    RES("same-ex", flock(fd, LOCK_EX | LOCK_NB));
    RES("other-ex", flock(other, LOCK_EX | LOCK_NB));
    put_line(p2c[1], "go");
    wait_child(pid);
    close(fd);
    RES("after-close", flock(other, LOCK_EX | LOCK_NB));
    close(other);
    close(p2c[0]), close(p2c[1]), close(c2p[0]), close(c2p[1]);
}

/* ---------------------------------------------------------------- the rest */

static void sc_truncate_read(void) {
    const char *n = name();
    size_t first = size();
    long cut = offset(), seek_to = rnd(2) ? -1 : offset();
    out("truncate-read %s %zu %ld %ld", n, first, cut, seek_to);
    FILE *f = fopen(n, "r+");
    if (!f) return out(" %s", ename(errno));
    size_t r = fread(io_buf, 1, first, f);
    digest(io_buf, r);
    RES("ftruncate", ftruncate(fileno(f), cut));
    if (seek_to >= 0) RES("fseek", fseek(f, seek_to, SEEK_SET));
    r = fread(io_buf, 1, IO_BYTES_MAX, f);
    digest(io_buf, r);
    status(f);
    RES("ftell", ftell(f));
    fclose(f);
}

static void sc_mmap(void) {
    const char *n = name();
    out("mmap %s", n);
    int fd = open(n, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) return out(" %s", ename(errno));
    /* Only bytes inside the file: past its last page the kernel sends SIGBUS. */
    off_t at = st.st_size > CHUNK_BYTES && rnd(2) ? CHUNK_BYTES : 0;
    size_t len = (size_t)(st.st_size - at);
    if (len == 0) {
        void *p = mmap(NULL, 0, PROT_READ, MAP_PRIVATE, fd, 0);
        out(" empty %s", p == MAP_FAILED ? ename(errno) : "mapped");
    } else {
        char *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, at);
        if (p == MAP_FAILED) out(" %s", ename(errno));
        else {
            out(" @%lld", (long long)at);
            digest(p, len);
            munmap(p, len);
        }
    }
    close(fd);
}

/* sendfile and copy_file_range from one file to another (or the same one), by offset pointer
 * or by the descriptors' offsets; the destination sometimes O_APPEND. */
static void sc_copy(void) {
    /* Within one file only with copy_file_range (which refuses overlapping ranges): Linux's
     * sendfile onto an overlapping range copies through page-cache pages it is overwriting,
     * a result that depends on its page size and memcpy (kura's reads each step first). */
    const char *from = name(), *to = name();
    int append = rnd(3) == 0, use_cfr = rnd(2), in_ptr = rnd(2), out_ptr = rnd(2);
    if (from == to && (!use_cfr || rnd(2))) to = from[1] == '2' ? "f0" : from[1] == '1' ? "f2" : "f1";
    size_t len = size();
    loff_t in_off = offset(), out_off = offset();
    out("%s %s->%s %zu app=%d ptr=%d%d", use_cfr ? "copy_file_range" : "sendfile", from, to, len, append, in_ptr, out_ptr);
    int in = open(from, O_RDONLY), o = open(to, O_WRONLY | O_CREAT | (append ? O_APPEND : 0), 0644);
    if (in < 0 || o < 0) {
        out(" %s", ename(errno));
        if (in >= 0) close(in);
        if (o >= 0) close(o);
        return;
    }
    lseek(in, offset(), SEEK_SET);
    lseek(o, offset(), SEEK_SET);
    errno = 0;
    ssize_t r = use_cfr ? copy_file_range(in, in_ptr ? &in_off : NULL, o, out_ptr ? &out_off : NULL, len, 0)
                        : sendfile(o, in, in_ptr ? &in_off : NULL, len);
    RES("", r);
    out(" in@%ld out@%ld off=%lld,%lld", (long)lseek(in, 0, SEEK_CUR), (long)lseek(o, 0, SEEK_CUR), (long long)in_off, (long long)out_off);
    close(in), close(o);
    file_digest(to);
}

static void one_op(void) {
    int r = rnd(100);
    if (r < 12) op_fopen();
    else if (r < 16) op_fdopen();
    else if (r < 62) op_stream();
    else if (r < 80) op_fd();
    else if (r < 84) sc_fork_writes();
    else if (r < 89) sc_fcntl_locks();
    else if (r < 93) sc_flock();
    else if (r < 96) sc_truncate_read();
    else if (r < 98) sc_mmap();
    else sc_copy();
}

static void run_seed(const char *root, long seed, int ops) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/s%ld", root, seed);
    if (mkdir(dir, 0755) || chdir(dir)) {
        perror(dir);
        exit(2);
    }
    rng = (uint64_t)seed * 0x2545f4914f6cdd1dULL + 1;
    for (int i = 0; i < ops; i++) {
        line_len = 0;
        one_op();
        printf("%ld %d %s\n", seed, i, line);
    }
    line_len = 0;
    for (int s = 0; s < STREAMS_MAX; s++)
        if (streams[s]) close_stream(s);
    for (int i = 0; i < FDS_MAX; i++)
        if (fds[i] >= 0) close(fds[i]), fds[i] = -1;
    out("end");
    for (int i = 0; i < FILES; i++) {
        char n[8];
        snprintf(n, sizeof n, "f%d", i);
        file_digest(n);
    }
    printf("%ld %d %s\n", seed, ops, line);
}

#define case_line(what, call) do { line_len = 0; RES(what, call); printf("%s\n", line); } while (0)

/* One case for each divergence fixed so far (stdio_random ROOT regressions). */
static void regressions(const char *root) {
    if (chdir(root)) exit(2);
    int fd = open("r", O_RDWR | O_CREAT | O_TRUNC, 0644), app = open("r", O_WRONLY | O_APPEND);
    fill(io_buf, 100);
    if (write(fd, io_buf, 100) != 100) exit(2);
    /* sendfile onto O_APPEND: EINVAL (was: copied); copy_file_range: EBADF (was: copied). */
    off_t at = 0;
    case_line("sendfile-append", sendfile(app, fd, &at, 10));
    loff_t in_at = 0;
    case_line("copy_file_range-append", copy_file_range(fd, &in_at, app, NULL, 10, 0));
    /* copy_file_range within one file: EINVAL when the ranges overlap, the length first cut
     * to what the source holds (was: copied); a copy past the source's end is 0. */
    in_at = 0;
    loff_t out_at = 50;
    case_line("copy_file_range-overlap", copy_file_range(fd, &in_at, fd, &out_at, 60, 0));
    in_at = 90, out_at = 95;
    case_line("copy_file_range-overlap-cut", copy_file_range(fd, &in_at, fd, &out_at, 1000, 0));
    in_at = 0, out_at = 60;
    case_line("copy_file_range-adjacent", copy_file_range(fd, &in_at, fd, &out_at, 60, 0));
    in_at = 500, out_at = 10;
    case_line("copy_file_range-past-end", copy_file_range(fd, &in_at, fd, &out_at, 60, 0));
    /* The length is cut to the source's size first: a copy that extends the file does not
     * go on to read what it wrote (was: 100 bytes copied of the 20 there were). */
    in_at = 100, out_at = 120;
    case_line("copy_file_range-extending", copy_file_range(fd, &in_at, fd, &out_at, 100, 0));
    /* freopen(NULL, "w+") empties the file another descriptor sees, and the stream writes to
     * it (was: glibc's open of /proc/self/fd/N reached the placeholder memfd: fstat on the
     * other descriptor kept the old size, the stream wrote into the memfd). */
    FILE *st = fopen("r", "r+");
    st = freopen(NULL, "w+", st);
    case_line("freopen-null-size", lseek(fd, 0, SEEK_END));
    fputs("after freopen", st);
    fflush(st);
    case_line("freopen-null-written", lseek(fd, 0, SEEK_END));
    fclose(st);
    if (write(fd, io_buf, 100) != 100) exit(2);
    /* Closing any descriptor of the file drops the process's POSIX locks, a dup'd one too
     * (was: kept until the last descriptor of the locking description closed). */
    int second = open("r", O_RDONLY), third = dup(second);
    struct flock whole = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 200, .l_len = 10};
    case_line("setlk-second", fcntl(second, F_SETLK, &whole));
    close(third);
    fflush(NULL);
    pid_t locker = fork();
    if (locker == 0) {
        struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
        int c = open("r", O_RDWR);
        fcntl(c, F_GETLK, &q);
        printf("after-close-of-dup %d\n", q.l_type);
        exit(0);
    }
    wait_child(locker);
    close(second);
    /* A lock range from the current offset or the end is the file's, not the lock file's
     * (was: EINVAL for a start before the lock file's offset 0; wrong ranges). */
    lseek(fd, 50, SEEK_SET);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_CUR, .l_start = -10, .l_len = 5};
    case_line("setlk-cur", fcntl(fd, F_SETLK, &fl));
    fl = (struct flock){.l_type = F_RDLCK, .l_whence = SEEK_END, .l_start = -60, .l_len = 30};
    case_line("setlk-end", fcntl(fd, F_SETLK, &fl));
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int c = open("r", O_RDWR);
        struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
        fcntl(c, F_GETLK, &q);
        /* No conflict: only l_type changes (was: the absolute range written back). */
        struct flock free_range = {.l_type = F_WRLCK, .l_whence = SEEK_END, .l_start = -5, .l_len = 1};
        fcntl(c, F_GETLK, &free_range);
        printf("getlk %d/%lld/%lld free %d/%d/%lld/%lld\n", q.l_type, (long long)q.l_start, (long long)q.l_len, free_range.l_type,
               free_range.l_whence, (long long)free_range.l_start, (long long)free_range.l_len);
        exit(0);
    }
    line_len = 0;
    wait_child(pid);
    printf("%s\n", line);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[2], "regressions") == 0) {
        regressions(argv[1]);
        return 0;
    }
    if (argc != 5) {
        fprintf(stderr, "usage: %s ROOT FIRST_SEED SEEDS OPS\n", argv[0]);
        return 2;
    }
    long first = atol(argv[2]), seeds = atol(argv[3]);
    int ops = atoi(argv[4]);
    for (long seed = first; seed < first + seeds; seed++) run_seed(argv[1], seed, ops);
    return 0;
}
