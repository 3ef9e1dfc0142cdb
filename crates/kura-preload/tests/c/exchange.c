/* renameat2(2) with RENAME_EXCHANGE, as man 2 rename describes it: two names swap their files
 * (in one directory, across directories, a file with a directory, whose `..` and link counts
 * follow), and the errors (a missing name, the flag with RENAME_NOREPLACE, a directory into
 * itself). Every result printed (errno by name; inode numbers as "the one X had"), so that a
 * run on a kura directory can be compared with one on a host directory. Usage: exchange DIR */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "report.h"

static void put(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

static ino_t ino_of(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 ? st.st_ino : 0;
}

static void links_of(const char *what, const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0)
        say(what, -1);
    else
        printf("%s: nlink %lu %s\n", what, (unsigned long)st.st_nlink, S_ISDIR(st.st_mode) ? "dir" : "file");
}

/* The names in `path`, in order, with their types. */
static void list(const char *what, const char *path) {
    struct dirent **names;
    int n = scandir(path, &names, NULL, alphasort);
    if (n < 0) {
        say(what, -1);
        return;
    }
    printf("%s:", what);
    for (int i = 0; i < n; i++) {
        if (strcmp(names[i]->d_name, ".") && strcmp(names[i]->d_name, ".."))
            printf(" %s%s", names[i]->d_name, names[i]->d_type == DT_DIR ? "/" : "");
        free(names[i]);
    }
    free(names);
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: exchange DIR\n");
        return 2;
    }
    const char *d = argv[1];
    int x = RENAME_EXCHANGE;

    /* Two files in one directory. */
    put(at(d, "a"), "was a\n");
    put(at(d, "b"), "was b\n");
    ino_t a = ino_of(at(d, "a")), b = ino_of(at(d, "b"));
    say("exchange a b", renameat2(AT_FDCWD, at(d, "a"), AT_FDCWD, at(d, "b"), x));
    contents("a reads", at(d, "a"));
    contents("b reads", at(d, "b"));
    printf("a is b's file: %d, b is a's file: %d\n", ino_of(at(d, "a")) == b, ino_of(at(d, "b")) == a);
    list("top", d);

    /* Many names in one directory, so that some pairs live in different records. */
    char n1[32], n2[32];
    for (int i = 0; i < 40; i++) {
        snprintf(n1, sizeof n1, "many%d", i);
        snprintf(n2, sizeof n2, "content %d\n", i);
        put(at(d, n1), n2);
    }
    int swapped = 0;
    for (int i = 0; i < 40; i += 2) {
        snprintf(n1, sizeof n1, "many%d", i);
        snprintf(n2, sizeof n2, "many%d", i + 1);
        swapped += renameat2(AT_FDCWD, at(d, n1), AT_FDCWD, at(d, n2), x) == 0;
    }
    printf("swapped pairs: %d\n", swapped);
    contents("many0 reads", at(d, "many0"));
    contents("many39 reads", at(d, "many39"));

    /* A file and a directory in two directories: the directory's `..` and both parents'
     * link counts follow it. */
    mkdir(at(d, "one"), 0755);
    mkdir(at(d, "two"), 0755);
    put(at(d, "one/f"), "the file\n");
    mkdir(at(d, "two/sub"), 0755);
    put(at(d, "two/sub/inside"), "inside sub\n");
    ino_t one = ino_of(at(d, "one")), two = ino_of(at(d, "two"));
    links_of("one before", at(d, "one"));
    links_of("two before", at(d, "two"));
    say("exchange one/f two/sub", renameat2(AT_FDCWD, at(d, "one/f"), AT_FDCWD, at(d, "two/sub"), x));
    links_of("one after", at(d, "one"));
    links_of("two after", at(d, "two"));
    links_of("one/f", at(d, "one/f"));
    links_of("two/sub", at(d, "two/sub"));
    contents("one/f/inside reads", at(d, "one/f/inside"));
    contents("two/sub reads", at(d, "two/sub"));
    printf("one/f/.. is one: %d (two: %d)\n", ino_of(at(d, "one/f/..")) == one, ino_of(at(d, "one/f/..")) == two);
    list("one", at(d, "one"));
    list("two", at(d, "two"));

    /* Through directory descriptors. */
    int one_fd = open(at(d, "one"), O_RDONLY | O_DIRECTORY), two_fd = open(at(d, "two"), O_RDONLY | O_DIRECTORY);
    say("exchange back by descriptors", renameat2(one_fd, "f", two_fd, "sub", x));
    links_of("one/f back", at(d, "one/f"));
    links_of("two/sub back", at(d, "two/sub"));
    close(one_fd);
    close(two_fd);

    /* Hard links of one file: nothing to do. */
    link(at(d, "a"), at(d, "a-link"));
    say("exchange a a-link", renameat2(AT_FDCWD, at(d, "a"), AT_FDCWD, at(d, "a-link"), x));
    links_of("a", at(d, "a"));

    /* Errors. */
    say("exchange with a missing target", renameat2(AT_FDCWD, at(d, "a"), AT_FDCWD, at(d, "nothing"), x));
    say("exchange of a missing source", renameat2(AT_FDCWD, at(d, "nothing"), AT_FDCWD, at(d, "a"), x));
    say("exchange and noreplace", renameat2(AT_FDCWD, at(d, "a"), AT_FDCWD, at(d, "b"), x | RENAME_NOREPLACE));
    say("exchange a directory with its own child", renameat2(AT_FDCWD, at(d, "two"), AT_FDCWD, at(d, "two/sub"), x));
    say("exchange a child with its directory", renameat2(AT_FDCWD, at(d, "two/sub"), AT_FDCWD, at(d, "two"), x));
    contents("a still reads", at(d, "a"));
    contents("b still reads", at(d, "b"));
    list("top at the end", d);
    return 0;
}
