/* posix_spawn, posix_spawnp, system and popen with every file action and the attributes
 * programs use, on files in DIR. The test runs it on a host directory and under the preload
 * on a kura one and compares the outputs (DIR's name replaced).
 *
 * usage: spawn DIR */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static const char *dir;

static char *at(const char *name) {
    static char buf[8][1024];
    static int next;
    char *b = buf[next++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

static void put(const char *name, const char *text, mode_t mode) {
    int fd = open(at(name), O_CREAT | O_WRONLY | O_TRUNC, mode);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text) || close(fd) != 0) { perror(name); exit(1); }
    chmod(at(name), mode);
}

static void show(const char *label, const char *name) {
    char buf[4096];
    int fd = open(at(name), O_RDONLY);
    if (fd < 0) { printf("%s: open %s: %s\n", label, name, strerror(errno)); return; }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n < 0 ? 0 : n] = 0;
    printf("%s: [%s]\n", label, buf);
}

/* Spawns (p: with a PATH search), waits, prints the result. */
static void run(const char *label, int p, const char *path, posix_spawn_file_actions_t *fa, posix_spawnattr_t *attr, char *const argv[]) {
    fflush(stdout);
    pid_t pid;
    int e = p ? posix_spawnp(&pid, path, fa, attr, argv, environ) : posix_spawn(&pid, path, fa, attr, argv, environ);
    if (e != 0) { printf("%s: spawn failed: %s\n", label, strerror(e)); return; }
    int status;
    if (waitpid(pid, &status, 0) != pid) { printf("%s: waitpid: %s\n", label, strerror(errno)); return; }
    printf("%s: exit %d\n", label, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static posix_spawn_file_actions_t actions_to(const char *out) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, at(out), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    return fa;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s DIR\n", argv[0]); return 2; }
    dir = argv[1];
    if (mkdir(at("sub"), 0755) != 0) { perror("mkdir"); return 1; }
    put("sub/rel.txt", "relative\n", 0644);
    put("in", "dup2 input\n", 0644);
    put("script.sh", "#!/bin/sh\necho script \"$1\" in \"$(pwd)\"\n", 0755);

    /* open + chdir: the child's stdout is a file in DIR, its working directory DIR/sub. */
    posix_spawn_file_actions_t fa = actions_to("out1");
    posix_spawn_file_actions_addchdir_np(&fa, at("sub"));
    run("open+chdir", 1, "sh", &fa, NULL, (char *[]){"sh", "-c", "pwd; cat rel.txt; echo $0", NULL});
    posix_spawn_file_actions_destroy(&fa);
    show("open+chdir out1", "out1");

    /* dup2 onto stdin. */
    int in = open(at("in"), O_RDONLY | O_CLOEXEC);
    fa = actions_to("out2");
    posix_spawn_file_actions_adddup2(&fa, in, 0);
    run("dup2", 1, "cat", &fa, NULL, (char *[]){"cat", NULL});
    posix_spawn_file_actions_destroy(&fa);
    show("dup2 out2", "out2");

    /* An inherited descriptor 7; then closed by addclose, then by addclosefrom. */
    if (dup2(in, 7) != 7) { perror("dup2"); return 1; }
    char *check7[] = {"sh", "-c", "cat <&7 2>/dev/null && echo 7 open || echo 7 closed", NULL};
    fa = actions_to("out3");
    run("inherited", 1, "sh", &fa, NULL, check7);
    posix_spawn_file_actions_destroy(&fa);
    show("inherited out3", "out3");
    lseek(7, 0, SEEK_SET);
    fa = actions_to("out4");
    posix_spawn_file_actions_addclose(&fa, 7);
    run("addclose", 1, "sh", &fa, NULL, check7);
    posix_spawn_file_actions_destroy(&fa);
    show("addclose out4", "out4");
    fa = actions_to("out5");
    posix_spawn_file_actions_addclosefrom_np(&fa, 3);
    run("closefrom", 1, "sh", &fa, NULL, check7);
    posix_spawn_file_actions_destroy(&fa);
    show("closefrom out5", "out5");
    /* dup2 of a descriptor onto itself: it stays open across exec though close-on-exec. */
    lseek(in, 0, SEEK_SET);
    fa = actions_to("out6");
    posix_spawn_file_actions_adddup2(&fa, in, in);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "cat <&%d 2>/dev/null || echo %s", in, "closed");
    run("dup2 self", 1, "sh", &fa, NULL, (char *[]){"sh", "-c", cmd, NULL});
    posix_spawn_file_actions_destroy(&fa);
    show("dup2 self out6", "out6");
    close(in);
    close(7);

    /* fchdir. */
    int sub = open(at("sub"), O_RDONLY | O_DIRECTORY);
    fa = actions_to("out7");
    posix_spawn_file_actions_addfchdir_np(&fa, sub);
    run("fchdir", 1, "sh", &fa, NULL, (char *[]){"sh", "-c", "pwd; ls", NULL});
    posix_spawn_file_actions_destroy(&fa);
    close(sub);
    show("fchdir out7", "out7");

    /* Attributes: a signal mask, a process group of its own, a default disposition. */
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGUSR1);
    posix_spawnattr_setsigmask(&attr, &mask);
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGUSR2);
    sigaddset(&def, SIGRTMAX);
    posix_spawnattr_setsigdefault(&attr, &def);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
    signal(SIGUSR2, SIG_IGN);
    signal(SIGRTMAX, SIG_IGN);
    fa = actions_to("out8");
    run("attributes", 1, "sh", &fa, &attr,
        (char *[]){"sh", "-c", "ign=$(grep SigIgn /proc/$$/status | cut -f2); blk=$(grep SigBlk /proc/$$/status | cut -f2); "
                   /* 32-bit halves: the shell's arithmetic is signed 64-bit. */
                   "lo=${ign#????????}; hi=${ign%????????}; "
                   "echo SIGUSR2 ignored $(( (0x$lo >> 11) & 1 )), SIGRTMAX ignored $(( (0x$hi >> 31) & 1 )), SIGUSR1 blocked $(( (0x${blk#????????} >> 9) & 1 )); "
                   "[ \"$(cut -d' ' -f5 /proc/$$/stat)\" = $$ ] && echo own group || echo parent group", NULL});
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    signal(SIGUSR2, SIG_DFL);
    signal(SIGRTMAX, SIG_DFL);
    show("attributes out8", "out8");

    /* Programs and scripts in DIR, by path and through PATH. */
    fa = actions_to("out9");
    run("script", 0, at("script.sh"), &fa, NULL, (char *[]){"script.sh", "arg", NULL});
    posix_spawn_file_actions_destroy(&fa);
    show("script out9", "out9");
    char path[1200];
    snprintf(path, sizeof path, "%s:/usr/bin:/bin", dir);
    setenv("PATH", path, 1);
    fa = actions_to("out10");
    run("spawnp through PATH", 1, "script.sh", &fa, NULL, (char *[]){"script.sh", "found", NULL});
    posix_spawn_file_actions_destroy(&fa);
    show("spawnp out10", "out10");
    setenv("PATH", "/usr/bin:/bin", 1);

    /* Failures, reported by the spawn call. */
    run("missing program", 0, at("missing"), NULL, NULL, (char *[]){"missing", NULL});
    run("not executable", 0, at("sub/rel.txt"), NULL, NULL, (char *[]){"rel.txt", NULL});
    run("not in PATH", 1, "kura-no-such-program", NULL, NULL, (char *[]){"x", NULL});
    fa = actions_to("nodir/out");
    run("open action fails", 1, "true", &fa, NULL, (char *[]){"true", NULL});
    posix_spawn_file_actions_destroy(&fa);
    fa = actions_to("out11");
    posix_spawn_file_actions_addchdir_np(&fa, at("nodir"));
    run("chdir action fails", 1, "true", &fa, NULL, (char *[]){"true", NULL});
    posix_spawn_file_actions_destroy(&fa);

    /* system and popen (glibc spawns both). */
    char line[1200];
    snprintf(line, sizeof line, "cd %s && echo from system > sysout && cat sysout", dir);
    fflush(stdout);
    printf("system: %d\n", system(line));
    snprintf(line, sizeof line, "cat %s", at("sub/rel.txt"));
    FILE *p = popen(line, "r");
    char got[256] = "";
    if (!p || !fgets(got, sizeof got, p)) printf("popen failed\n");
    printf("popen: [%s] status %d\n", got, p ? pclose(p) : -1);
    snprintf(line, sizeof line, "cat > %s", at("popen-w"));
    p = popen(line, "w");
    fputs("written through popen\n", p);
    printf("popen w: status %d\n", pclose(p));
    show("popen-w", "popen-w");
    return 0;
}
