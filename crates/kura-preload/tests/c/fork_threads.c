/* fork(2) in a multi-threaded program whose other threads are inside kura calls at that
 * instant (issue 6: "fork: the child keeps working"). Three threads create, write, fsync,
 * read, stat and unlink kura files without pause while the main thread forks; each child
 * uses the file system at once (open, write, fstat, close) and exits. A child that inherits a
 * lock some other thread held at the fork hangs (even inside fork's own handlers): after
 * CHILD_SECONDS_MAX the parent kills it and reports it. Meanwhile two threads take and drop
 * flock and fcntl locks on kura files (every lock and unlock revalidates or writes back the
 * process's open files) and, with PROGRAM, two threads posix_spawn it without pause, as
 * cargo's job threads start compilers: forks from several threads at once.
 *
 * usage: fork_threads DIR FORKS [PROGRAM]   (DIR under the kura mount) -> "forks ok FORKS" */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <sys/file.h>
#include <spawn.h>

extern char **environ;

#define THREADS 3
#define CHILD_SECONDS_MAX 20

static const char *dir;
static const char *program;
static volatile int stop;

static void *worker(void *arg) {
    long id = (long)arg;
    char path[512], buf[4096];
    memset(buf, 'a' + (int)id, sizeof buf);
    for (long n = 0; !stop; n++) {
        snprintf(path, sizeof path, "%s/t%ld-%ld", dir, id, n % 8);
        int fd = open(path, O_CREAT | O_RDWR | O_TRUNC, 0644);
        if (fd < 0) { perror("worker: open"); exit(2); }
        for (int i = 0; i < 4; i++)
            if (write(fd, buf, sizeof buf) != (ssize_t)sizeof buf) { perror("worker: write"); exit(2); }
        if (n % 8 == 7 && fsync(fd) != 0) { perror("worker: fsync"); exit(2); }
        struct stat st;
        if (fstat(fd, &st) != 0 || st.st_size != 4 * (off_t)sizeof buf) { fprintf(stderr, "worker: fstat\n"); exit(2); }
        if (pread(fd, buf, 100, 0) != 100) { perror("worker: pread"); exit(2); }
        if (close(fd) != 0) { perror("worker: close"); exit(2); }
        if (n % 16 == 15 && unlink(path) != 0) { perror("worker: unlink"); exit(2); }
    }
    return NULL;
}

static void *locker(void *arg) {
    long id = (long)arg;
    char path[512];
    snprintf(path, sizeof path, "%s/lock%ld", dir, id);
    int fd = open(path, O_CREAT | O_RDWR, 0644);
    if (fd < 0) { perror("locker: open"); exit(2); }
    for (long n = 0; !stop; n++) {
        if (id == 0) {
            if (flock(fd, LOCK_EX) != 0) { perror("locker: flock"); exit(2); }
            if (pwrite(fd, "x", 1, n % 100) != 1) { perror("locker: pwrite"); exit(2); }
            if (flock(fd, LOCK_UN) != 0) { perror("locker: flock LOCK_UN"); exit(2); }
        } else {
            struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };
            if (fcntl(fd, F_SETLKW, &fl) != 0) { perror("locker: F_SETLKW"); exit(2); }
            if (pwrite(fd, "y", 1, n % 100) != 1) { perror("locker: pwrite"); exit(2); }
            fl.l_type = F_UNLCK;
            if (fcntl(fd, F_SETLK, &fl) != 0) { perror("locker: F_UNLCK"); exit(2); }
        }
    }
    return NULL;
}

static void *spawner(void *arg) {
    (void)arg;
    char *args[] = { "true", NULL };
    while (!stop) {
        pid_t pid;
        int e = posix_spawn(&pid, program, NULL, NULL, args, environ);
        if (e != 0) { fprintf(stderr, "spawner: posix_spawn %s: %s\n", program, strerror(e)); exit(2); }
        int status;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) { fprintf(stderr, "spawner: %s ended with status %d\n", program, status); exit(2); }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) { fprintf(stderr, "usage: %s DIR FORKS [PROGRAM]\n", argv[0]); return 2; }
    program = argc == 4 ? argv[3] : NULL;
    dir = argv[1];
    int forks = atoi(argv[2]);
    pthread_t threads[THREADS];
    for (long i = 0; i < THREADS; i++)
        if (pthread_create(&threads[i], NULL, worker, (void *)i) != 0) { fprintf(stderr, "pthread_create\n"); return 2; }
    pthread_t more[4];
    int nmore = 0;
    for (long i = 0; i < 2; i++)
        if (pthread_create(&more[nmore++], NULL, locker, (void *)i) != 0) { fprintf(stderr, "pthread_create\n"); return 2; }
    for (long i = 0; program && i < 2; i++)
        if (pthread_create(&more[nmore++], NULL, spawner, NULL) != 0) { fprintf(stderr, "pthread_create\n"); return 2; }
    for (int i = 0; i < forks; i++) {
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 1; }
        if (pid == 0) {
            char path[512];
            snprintf(path, sizeof path, "%s/child-%d", dir, i % 4);
            int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
            if (fd < 0) _exit(3);
            if (write(fd, "child\n", 6) != 6) _exit(4);
            struct stat st;
            if (fstat(fd, &st) != 0 || st.st_size != 6) _exit(5);
            if (close(fd) != 0) _exit(6);
            _exit(0);
        }
        int status = 0;
        pid_t reaped = 0;
        for (int waited_ms = 0; reaped == 0 && waited_ms < CHILD_SECONDS_MAX * 1000; waited_ms += 5) {
            reaped = waitpid(pid, &status, WNOHANG);
            if (reaped == 0) usleep(5000);
        }
        if (reaped < 0) { perror("waitpid"); return 1; }
        if (reaped == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fprintf(stderr, "fork %d: the child hung for %d s (killed)\n", i, CHILD_SECONDS_MAX);
            return 1;
        }
        if (WIFSIGNALED(status)) { fprintf(stderr, "fork %d: the child was killed by signal %d\n", i, WTERMSIG(status)); return 1; }
        if (WEXITSTATUS(status) != 0) { fprintf(stderr, "fork %d: the child failed at step %d\n", i, WEXITSTATUS(status)); return 1; }
    }
    stop = 1;
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < nmore; i++) pthread_join(more[i], NULL);
    printf("forks ok %d\n", forks);
    return 0;
}
