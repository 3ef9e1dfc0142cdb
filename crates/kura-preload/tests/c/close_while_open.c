/* One thread closes a file it has just written while another opens and reads it (Node.js's
 * write stream closing in libuv's thread pool as a read stream of the file opens): the reader
 * must get every byte. Usage: close_while_open DIR ROUNDS; prints "bad N of ROUNDS". */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PIECES 10
#define PIECE_BYTES 889
#define FILE_BYTES (PIECES * PIECE_BYTES)

static int writer_fd;
static atomic_int go;

static void *closer(void *arg) {
    (void)arg;
    while (!atomic_load(&go))
        ;
    close(writer_fd);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: close_while_open DIR ROUNDS\n");
        return 2;
    }
    int rounds = atoi(argv[2]), bad = 0;
    char piece[PIECE_BYTES], in[FILE_BYTES + 100], path[4096];
    memset(piece, 'x', sizeof piece);
    for (int r = 0; r < rounds; r++) {
        snprintf(path, sizeof path, "%s/f%d", argv[1], r);
        writer_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (writer_fd < 0) {
            perror("open for writing");
            return 1;
        }
        for (int i = 0; i < PIECES; i++)
            if (write(writer_fd, piece, sizeof piece) != sizeof piece) {
                perror("write");
                return 1;
            }
        atomic_store(&go, 0);
        pthread_t t;
        pthread_create(&t, NULL, closer, NULL);
        atomic_store(&go, 1);
        int fd = open(path, O_RDONLY);
        ssize_t n = 0, got;
        while (fd >= 0 && (got = read(fd, in + n, sizeof in - n)) > 0)
            n += got;
        close(fd);
        pthread_join(t, NULL);
        if (n != FILE_BYTES) {
            if (bad < 5)
                printf("round %d: read %zd of %d bytes\n", r, n, FILE_BYTES);
            bad++;
        }
    }
    printf("bad %d of %d\n", bad, rounds);
    return 0;
}
