/* What the tests' C programs share: paths under the directory they are given, and results
 * printed with errno by name, so that a run on a kura directory can be compared line by line
 * with one on a host directory. */
#ifndef KURA_TEST_REPORT_H
#define KURA_TEST_REPORT_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* DIR/name, in one of four buffers used in turn (a call may take two paths). */
__attribute__((unused)) static const char *at(const char *dir, const char *name) {
    static char bufs[4][4096];
    static int next;
    char *b = bufs[next++ % 4];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

/* A call's result: its value, or -1 and the errno's name. */
__attribute__((unused)) static void say(const char *what, long r) {
    if (r < 0)
        printf("%s: -1 %s\n", what, strerrorname_np(errno));
    else
        printf("%s: %ld\n", what, r);
}

/* The first 255 bytes of the file at `path`, and how many were read (or the open's errno). */
__attribute__((unused)) static void contents(const char *what, const char *path) {
    char buf[256] = {0};
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        say(what, -1);
        return;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    printf("%s: %zd [%s]\n", what, n, n > 0 ? buf : "");
}

#endif
