//! Unmodified programs under `kura fs run`: shells, coreutils, tar, Python, sqlite3, fio, a C
//! program through stdio; Unix sockets bound and connected at kura paths; a writer killed with
//! SIGKILL; processes racing in one directory; a full pool; an unreachable pool. Every test has
//! its own data directory and local server.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Env, check, have, workspace};

#[test]
fn shell_fork_exec_and_redirection() {
    let env = Env::new();
    assert_eq!(env.sh("echo x > /kura/f; cat /kura/f"), "x\n");
    let out = env.sh(
        "set -e
         { echo 1; cat /kura/f; echo 3; } > /kura/g       # builtins and a child share one descriptor
         cat /kura/g | tr 0-9 a-j | tee /kura/h > /dev/null
         printf 'appended\\n' >> /kura/h
         exec 3> /kura/kept; echo via-fd-3 >&3; exec 3>&-
         (cd /kura && ls && pwd)
         cat /kura/h /kura/kept
         python3 -c 'print(\"from python\")' > /kura/py; cat /kura/py",
    );
    assert_eq!(out, "f\ng\nh\nkept\n/kura\nb\nx\nd\nappended\nvia-fd-3\nfrom python\n");
}

/// Shells forking 6,000 times while they append to kura files and the write-back worker
/// wakes every millisecond. The worker takes its state lock each time it wakes; a child forked
/// while it held it inherited the lock held by a thread it does not have, and hung in the
/// preload's fork handler (found by CI: ~1 in several hundred runs of the test above). Each
/// fork here is a chance of that; the run must end, with every line written.
#[test]
fn forks_while_write_back_wakes_never_hang() {
    let env = Env::new();
    // Four such loops at once keep both cores busy, so that the worker is often preempted
    // while it holds its lock (what made the window wide enough under CI's load).
    let script = "for j in 1 2 3 4; do (i=0; while [ $i -lt 1500 ]; do echo $i >> /kura/log$j; /bin/true; i=$((i+1)); done) & done; wait; cat /kura/log1 /kura/log2 /kura/log3 /kura/log4 | wc -l";
    let mut cmd = env.command(&[], &["sh", "-c", script]);
    cmd.env("KURA_FS_WRITEBACK_MS", "1");
    let out = output_within(cmd, Duration::from_secs(180), "the shell's forks");
    check(&out, &["sh", "-c", script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "6000");
}

/// A multi-threaded program forks while its other threads are inside kura calls: the child
/// uses the file system at once and never inherits a lock one of them held (before the fork
/// gate, the first or second child hung in its fork handler on a file's opener lock). With
/// parking_lot's locks, whose wait queues live in one process-wide table, a child's write-back
/// worker also crashed (SIGSEGV) on a queue that a parent thread was changing at the fork, in
/// about one of 600–1,800 forks; the locks are std's futex words now (`kura_fs::sync`). The
/// worker wakes every millisecond here, so that some thread is often parking at a fork: with
/// parking_lot, every one of eight runs by hand failed by the 51st fork (SIGSEGV or a hang).
/// Two more threads lock and unlock kura files, and two `posix_spawn` a kura copy of true(1)
/// without pause, as cargo's job threads start compilers. Before spawn.rs, glibc's spawned
/// child ran the hooks in the parent's memory and left it a pool connection it did not have
/// (EINVAL from the pool, then EIO); forks from two threads at once interleaved the fork
/// handlers and a child hung on the node table (a first `cargo build` in a kura directory
/// hung that way); a lock's revalidation took a file's size from a record read before the
/// file's own write-back, and fstat said 0 after four writes.
#[test]
fn forks_while_other_threads_are_inside_kura_calls_never_hang() {
    if !have("gcc") {
        return kura_testkit::skip("no gcc to build tests/c/fork_threads.c");
    }
    let env = Env::new();
    let exe = build_c(&env, &workspace().join("crates/kura-preload/tests/c/fork_threads.c"), &["-pthread"]);
    let script = format!("mkdir /kura/ft && cp /bin/true /kura/ft/true && {} /kura/ft 300 /kura/ft/true", exe.display());
    let mut cmd = env.command(&[], &["sh", "-c", &script]);
    cmd.env("KURA_FS_WRITEBACK_MS", "1");
    let out = output_within(cmd, Duration::from_secs(180), "fork_threads");
    check(&out, &["sh", "-c", &script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "forks ok 300");
}

/// Compiles the C program `src` with gcc (`-O1 -Wall`, then `extra`) into the test's directory,
/// named after the source; the executable's path.
fn build_c(env: &Env, src: &std::path::Path, extra: &[&str]) -> std::path::PathBuf {
    let exe = env.dir.path().join(src.file_stem().expect("a source file name"));
    let out = std::process::Command::new("gcc").args(["-O1", "-Wall"]).args(extra).arg("-o").arg(&exe).arg(src).output().unwrap();
    check(&out, &["gcc", &src.display().to_string()]);
    exe
}

/// Runs `cmd` in its own process group and returns its output; kills the group and fails
/// the test if it takes longer than `limit` (a hang fails instead of stalling the suite).
fn output_within(mut cmd: std::process::Command, limit: Duration, what: &str) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let child = cmd.spawn().unwrap();
    let pgid = child.id() as i32;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait_with_output());
    });
    let Ok(out) = done_rx.recv_timeout(limit) else {
        // SAFETY: kill has no memory arguments; the group is the test's own command.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        panic!("{what} did not finish in {limit:?}");
    };
    out.unwrap()
}

#[test]
fn paths_outside_the_prefix_go_to_the_kernel() {
    let env = Env::new();
    let local = env.dir.path().join("local.txt");
    let script = format!("echo kernel > {0}; echo kura > /kura/k; cat {0} /kura/k; test ! -e /kura/local.txt", local.display());
    assert_eq!(env.sh(&script), "kernel\nkura\n");
    assert_eq!(std::fs::read_to_string(&local).unwrap(), "kernel\n");
    assert!(!std::path::Path::new("/kura/k").exists(), "kura files must not appear in the kernel's namespace");
}

/// A shell's redirections onto low descriptors (`exec 3>>log`) leave the pool's own
/// descriptors alone. The first kura call made the pool's connection at the lowest free
/// number, 3, and `exec 3>>` dup2'd the log over it: the pool spoke to the log, then closed
/// the shell's descriptor 3 on the error (`write-back before fork failed: … Socket operation
/// on non-socket`, `3: Bad file descriptor`; only "a" was written). The pool's descriptors now
/// live at 768 and up (kura_pool::fd).
#[test]
fn redirections_onto_low_descriptors_leave_the_pool_alone() {
    let env = Env::new();
    let out = env.sh(
        "exec 3>>/kura/log; echo a >&3; /bin/sh -c 'echo b >&3'; echo c >&3
         exec 4>/kura/log2; echo a >&4; /bin/sh -c 'echo b >&4'; echo c >&4
         for fd in 5 6 7 8 9; do eval \"exec $fd</kura/log\"; done
         cat /kura/log /kura/log2 <&5",
    );
    assert_eq!(out, "a\nb\nc\na\nb\nc\n");
}

/// The files this host keeps for an inode — its lock file (flock), the kernel FIFO standing
/// for a kura FIFO, a program's text lock — are removed when the inode is deleted, by `rm` and
/// by the last close of a file unlinked while open; before, every file ever locked left one
/// in the lock directory for good.
#[test]
fn host_files_go_with_their_inode() {
    if !have("flock") {
        return kura_testkit::skip("no flock(1) (util-linux)");
    }
    let env = Env::new();
    let inos = env.sh(
        "cp /bin/true /kura/prog && chmod +x /kura/prog && /kura/prog
         echo x > /kura/f && flock /kura/f true
         mkfifo /kura/p && (echo through > /kura/p &) && cat /kura/p > /dev/null
         echo y > /kura/g && flock /kura/g true
         stat -c %i /kura/prog /kura/f /kura/p /kura/g",
    );
    let inos: Vec<u64> = inos.lines().map(|l| l.trim().parse().expect("an inode number")).collect();
    let locks = env.dir.path().join("locks");
    let host_files = |ino: u64| -> Vec<String> {
        std::fs::read_dir(&locks)
            .expect("the lock directory")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.split_once('-').is_some_and(|(_, rest)| rest.split('.').next() == Some(&format!("{ino:x}"))))
            .collect()
    };
    for &ino in &inos {
        assert!(!host_files(ino).is_empty(), "inode {ino} has a host file while it exists");
    }
    // g: unlinked while a shell holds it open, gone at that shell's close.
    env.sh("rm /kura/prog /kura/f /kura/p; exec 3</kura/g; rm /kura/g; cat <&3 >/dev/null; exec 3<&-");
    let left: Vec<String> = inos.iter().flat_map(|&ino| host_files(ino)).collect();
    assert_eq!(left, Vec::<String>::new(), "host files outlived their inodes {inos:?}");
}

/// `flock` belongs to the open file description, as Linux's: a lock flock(1) takes through a
/// descriptor the shell keeps (`exec 9>f; flock 9`: a new image) stays held until the shell
/// closes it; a subshell's lock on an inherited descriptor is its parent's too; dup'd
/// descriptors share it until the last one closes. Each answer is compared with the kernel's
/// on a host directory. (The preload made a description's lock file at its first lock, in
/// the process that took it: flock(1)'s exit dropped the lock, and parent and child of a fork
/// locked separately.)
#[test]
fn flock_belongs_to_the_description_across_fork_and_exec() {
    if !have("flock") {
        return kura_testkit::skip("no flock(1) (util-linux)");
    }
    let script = r#"cd "$1"
        exec 9>lk; flock 9
        flock -n lk true && echo 1 free || echo 1 held
        sh -c 'flock -n lk true && echo 2 free || echo 2 held'
        exec 9>&-
        flock -n lk true && echo 3 free || echo 3 held
        exec 8>lk2
        ( flock -n 8 && echo 4 child locked; sleep 0.3 ) &
        sleep 0.1
        flock -n 8 && echo 5 parent shares it || echo 5 parent blocked
        flock -n lk2 true && echo 6 free || echo 6 held
        wait
        exec 8>&-
        exec 7>lk3; exec 6>&7
        flock -n 6 && echo 7 dup locked
        flock -n lk3 true && echo 8 free || echo 8 held
        exec 6>&-
        flock -n lk3 true && echo 9 free || echo 9 held
        exec 7>&-
        flock -n lk3 true && echo 10 free || echo 10 held"#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want.lines().count(), 10, "{want}");
    assert_eq!(got, want, "kura's flock answers differ from the kernel's");
}

/// A program running from a kura file is busy, as a kernel one: writing it (a shell
/// redirection, `truncate(1)`, an `O_RDWR` open) fails with `ETXTBSY` while it runs, reading it
/// works, and once it has ended it can be written again. Compared with the kernel on a host
/// directory. (Every write succeeded: the preload runs a copy of the program.)
#[test]
fn a_running_kura_program_is_text_busy_as_the_kernels() {
    let script = r#"cd "$1"; cp /bin/sleep sl; chmod 755 sl
        ./sl 5 & pid=$!
        sleep 0.3
        ( echo x > sl ) 2>/dev/null && echo "1 written" || echo "1 busy"
        truncate -s 0 sl 2>/dev/null && echo "2 truncated" || echo "2 busy"
        cat sl > /dev/null && echo "3 read"
        python3 -c 'import os, errno
try: os.open("sl", os.O_RDWR); print("4 opened")
except OSError as e: print("4", errno.errorcode[e.errno])'
        kill $pid; wait $pid 2>/dev/null
        echo x > sl && echo "5 written after it ended""#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want, "1 busy\n2 busy\n3 read\n4 ETXTBSY\n5 written after it ended\n", "the kernel's answers");
    assert_eq!(got, want, "under the preload");
}

/// `script`'s output with its first argument a fresh host directory (the kernel's answers),
/// then under the preload with `/kura/t`.
fn kernel_and_kura(script: &str) -> (String, String) {
    let env = Env::new();
    let host = env.dir.path().join("host");
    std::fs::create_dir(&host).unwrap();
    let out = std::process::Command::new("sh").args(["-c", script, "sh"]).arg(&host).output().unwrap();
    check(&out, &["sh", script]);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    let got = env.run(&["sh", "-c", &format!("mkdir /kura/t && sh -c '{}' sh /kura/t", script.replace('\'', r"'\''"))]);
    (want, got)
}

/// Background jobs writing at once to the file their shell redirected (`make -j > log`) and
/// appending through a descriptor the shell keeps while it appends too: every line arrives
/// once, as on Linux. Compared with the kernel on a host directory. (Each process wrote into
/// its own cached pages at the shared offset and wrote whole pages back over the others':
/// 300 of the 600 lines and 101 of the 400 appended ones survived.)
#[test]
fn parallel_jobs_writing_one_redirected_file_lose_no_line() {
    let script = r#"cd "$1"
        { for i in 1 2 3 4; do ( for j in $(seq 1 150); do echo "$i-$j"; done ) & done; wait; } > log
        wc -l < log; sort -u log | wc -l; sort -t- -k1,1n -k2,2n log | md5sum
        exec 3>>alog
        for i in 1 2 3; do ( for j in $(seq 1 100); do echo "a$i-$j" >&3; done ) & done
        for j in $(seq 1 100); do echo "p-$j" >&3; done
        wait; exec 3>&-
        wc -l < alog; sort -u alog | wc -l; sort alog | md5sum"#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want.lines().take(2).collect::<Vec<_>>(), ["600", "600"], "{want}");
    assert_eq!(got, want, "lines lost or doubled under kura");
}

/// Two processes that open one file each for themselves (not through `fork`) and take turns
/// writing it without locks, each reading at once what the other wrote into the same 4 KiB
/// chunk: after each has written the file back once (here an `fsync`; by default the
/// background write-back), both read and write it through the pool, so every read sees the
/// other's last write, as on the kernel. (Each read its own cached chunk: the other's writes
/// were never seen.)
#[test]
fn unrelated_processes_sharing_a_file_see_each_others_writes() {
    let py = workspace().join("crates/kura-preload/tests/py/pingpong.py");
    let script = format!(r#"python3 {} "$1/f" 60"#, py.display());
    let (want, got) = kernel_and_kura(&script);
    assert_eq!(want, "coherent 60\n");
    assert_eq!(got, want);
}

/// A process that looks at a directory without pause sees every change another process
/// makes as soon as that process is done with it (a file made, `chmod`, appended to, linked,
/// renamed, made in a new directory, symlinked, unlinked, renamed across directories,
/// truncated, a deep tree made and removed), as on the kernel. On a pool of kura servers on
/// this host the watcher answers `stat` and lookups from copies of the records it read while
/// the servers' change counter stands still (kura_engine::changes); this checks that every
/// change moves it. (With the server's count of changes turned off, the watcher saw a `chmod`
/// late and the changer's own copies failed its next `rename` with EIO.)
#[test]
fn a_watching_process_sees_each_change_another_makes_at_once() {
    let py = workspace().join("crates/kura-preload/tests/py/coherence.py");
    let script = format!(r#"python3 {} "$1" 3"#, py.display());
    let (want, got) = kernel_and_kura(&script);
    assert_eq!(want.lines().count(), 37, "{want}");
    assert!(!want.contains("BUT THEN"), "{want}");
    assert_eq!(got, want);
}

/// A reader that keeps a log open sees what another process appends to it (`tail -f`): its
/// `fstat` shows the record's size when it has nothing unwritten of its own, and a read at
/// the end looks at the record again (at most every 100 ms) and drops cached pages another
/// process wrote since. (The reader saw the size and the end of file it opened the log with:
/// 0 lines of 6, and `tail -f` printed nothing.)
#[test]
fn a_reader_keeping_a_log_open_sees_another_process_append() {
    let env = Env::new();
    let script = r#"cd /kura && : > log
        ( for i in 1 2 3 4 5 6; do echo "line $i" >> log; sleep 0.2; done ) &
        python3 -c '
import os, time
f = open("log", "rb")
got = b""
for _ in range(40):
    got += f.read()
    if got.count(b"\n") == 6:
        break
    time.sleep(0.1)
print(os.fstat(f.fileno()).st_size, got.decode().split())'
        wait"#;
    assert_eq!(
        env.sh(script),
        "42 ['line', '1', 'line', '2', 'line', '3', 'line', '4', 'line', '5', 'line', '6']\n"
    );
}

/// What a process wrote survives its end by SIGTERM or SIGHUP (and SIGINT: see the next
/// test), as the kernel's page cache survives a killed process (`timeout`, `kill`, a closed
/// terminal): a reader that wrote a
/// line and sleeps, and a writer killed in the middle of a loop of writes (whose file must
/// hold whole records, at least those written before it was told to stop). The exit status
/// stays the signal's. (Both lost everything written since the last write-back; the exit
/// hook never runs.) KURA_FS_SIGNAL_WRITEBACK=0 shows the old behaviour.
#[test]
fn writes_survive_sigterm_and_sighup() {
    let env = Env::new();
    let script = r#"cd /kura
        for sig in TERM HUP; do
            python3 -c 'import sys, time
f = open("out-" + sys.argv[1], "w"); f.write("important line\n"); f.flush(); time.sleep(30)' $sig &
            p=$!; sleep 1; kill -$sig $p; wait $p; echo "$sig status $? $(cat out-$sig)"
        done
        python3 -c 'import os
fd = os.open("busy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
n = 0
while True:
    os.write(fd, b"r" * 99 + b"\n"); n += 1
    if n == 2000: open("started", "w").close()' &
        p=$!; while [ ! -e started ]; do sleep 0.05; done
        kill -TERM $p; wait $p; echo "busy status $?"
        python3 -c 'd = open("busy", "rb").read()
print(len(d) >= 200000, len(d) % 100, set(d.split(b"\n")[:-1]) == {b"r" * 99})'"#;
    assert_eq!(
        env.sh(&format!("{{ {script}; }} 2>/dev/null")),
        "TERM status 143 important line\nHUP status 129 important line\nbusy status 143\nTrue 0 True\n"
    );
}

/// Kura's handlers for SIGTERM, SIGHUP and SIGINT are invisible: programs read the default
/// action where kura's stands in (Python still installs KeyboardInterrupt), their own
/// handlers and traps run (sh, bash, perl), and a program that asks for SIGINT's default
/// action and is interrupted keeps what it wrote. Compared with the kernel's answers.
#[test]
fn signal_dispositions_look_like_the_kernels() {
    let script = r#"cd "$1"
        python3 -c 'import signal; print("py", signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))'
        python3 -c 'import signal, os, time
try:
    os.kill(os.getpid(), signal.SIGINT); time.sleep(1); print("no interrupt")
except KeyboardInterrupt:
    print("KeyboardInterrupt")'
        python3 -c 'import signal, os, time
signal.signal(signal.SIGINT, signal.SIG_DFL)
f = open("int-out", "w"); f.write("kept\n"); f.flush()
os.kill(os.getpid(), signal.SIGINT); time.sleep(5)'
        echo "status $? $(cat int-out)"
        sh -c 'trap "echo trapped" TERM; kill -TERM $$; echo after'
        bash -c 'trap "echo trapped-bash" HUP; kill -HUP $$; echo after-bash'
        perl -e '$SIG{TERM} = sub { print "perl handler\n"; exit 3 }; kill "TERM", $$; sleep 2'; echo "perl status $?""#;
    let (want, got) = kernel_and_kura(script);
    assert!(want.starts_with("py True 0 0\nKeyboardInterrupt\nstatus 130 kept\n"), "{want}");
    assert_eq!(got, want, "kura's signal answers differ from the kernel's");
}

/// Everyday tools on a small tree print what they print on the kernel: `cp -p`, `touch -r`,
/// `install -D`, `mktemp`, `ln -sf`/`ln -f`, `chmod -R`, `mv`, `find -printf`, `truncate`,
/// `sed -i`, `cp -r`, `rsync -a`, `tar`, Python's `shutil.copytree`, a shell's `exec 3>`, and
/// `ls -la` (its `total` counts a directory one 4 KiB block, as ext4, and a symbolic link
/// none). Found by it: a directory showed size 0 and no blocks, and a symbolic link a block.
#[test]
fn everyday_tools_print_what_they_print_on_the_kernel() {
    let script = r#"set -u
cd "$1"
umask 022
mkdir -p a/b/c; echo hi > a/b/c/f; ln -s c/f a/b/l; ln a/b/c/f a/hard
touch -d '2020-02-02 02:02:02' a/b/c/f
cp -p a/b/c/f a/pres; stat -c '%n %s %a %Y %h' a/pres a/b/c/f a/hard
touch -r a/b/c/f a/ref; stat -c '%n %Y' a/ref
install -D -m 640 a/b/c/f a/x/y/z; stat -c '%n %a %s' a/x/y/z
d=$(mktemp -d -p .); [ -d "$d" ] && echo mktemp-dir-ok; rmdir "$d"
f=$(mktemp -p .); [ -f "$f" ] && stat -c '%a %s' "$f"; rm "$f"
ln -sf newtarget a/b/l; readlink a/b/l
ln -f a/pres a/hard2; stat -c '%h' a/pres
chmod -R g+w a/x; stat -c '%n %a' a/x a/x/y a/x/y/z
mv a/x a/b/c/; ls -R a
find a -printf '%p %y %m %n\n' | sort
find a -type f -printf '%p %s\n' | sort
echo data > a/t; truncate -s 2 a/t; cat a/t; echo
printf 'abc' > a/u; printf 'de' >> a/u; sed -i 's/b/B/' a/u; cat a/u; echo; stat -c '%a %s' a/u
cp -r a a2; diff -r --no-dereference a a2 && echo cp-r-same
rsync -a a/ a3/; diff -r --no-dereference a a3 && echo rsync-same; stat -c '%Y' a3/b/c/f
tar -cf - a | tar -tf - | sort
python3 -c "import shutil, os; shutil.copytree('a', 'a4', symlinks=True); print(sorted(os.listdir('a4')))"
exec 3>a/fd3; echo via3 >&3; exec 3>&-; cat a/fd3
ls -la a/b | awk '{print $1, $NF}' | sort
stat -c '%n %s %b' a/b a/b/l
"#;
    let (want, got) = kernel_and_kura(script);
    assert!(want.contains("rsync-same\n") && want.contains("a/b 4096 8\n"), "on the kernel (an ext4 directory is one block): {want}");
    assert_eq!(got, want, "under the preload (left) and on the kernel (right)");
}

/// A signal whose default action ends the program, arriving in the middle of a kura call (a
/// long write): the program runs no further, as on the kernel, and dies by the signal. The
/// write-back service ends the process once the call is done and its data written back; the
/// thread that made the call used to return into the program meanwhile, which printed after
/// its death warrant and, when it finished first, exited 0 (seen once in this suite, from
/// `signal_dispositions_look_like_the_kernels`).
#[test]
fn a_fatal_signal_during_a_kura_call_ends_the_program_there() {
    let script = r#"cd "$1"
python3 -c '
import os
fd = os.open("big", os.O_WRONLY | os.O_CREAT, 0o644)
data = b"y" * (256 << 20)
os.write(fd, b"x")
open("started", "w").close()
os.write(fd, data)
print("after the write", flush=True)
' &
pid=$!
while [ ! -e started ]; do sleep 0.01; done
sleep 0.05
kill -TERM $pid
wait $pid
echo "status $?"
"#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want, "status 143\n", "on the kernel");
    assert_eq!(got, want, "under the preload (left) and on the kernel (right)");
}

/// Processes that each open a log for themselves and append to it at once (`echo >> log` in
/// parallel jobs, two Python loggers in mode "a" whose write-backs run every 20 ms): every
/// line arrives once and whole, as Linux places every O_APPEND write at the end. Appends
/// wait in each process's cache at the end it knew; its write-back takes the host's turn at
/// the file and moves them to the record's end when another process appended meanwhile.
/// (Each process wrote back whole chunks at the end it had seen: 171 of 400 shell lines
/// survived.)
#[test]
fn processes_appending_to_one_log_at_once_lose_no_line() {
    let env = Env::new();
    let script = r#"cd /kura
        for i in 1 2 3 4; do ( for j in $(seq 1 150); do echo "$i-$j" >> log; done ) & done
        for i in 1 2; do python3 -c 'import sys, time
f = open("log", "a")
for j in range(1500):
    f.write("py%s-%d\n" % (sys.argv[1], j)); f.flush()
    if j % 500 == 0: time.sleep(0.05)' $i & done
        wait
        wc -l < log; sort -u log | wc -l; grep -c -v -E "^([0-9]-[0-9]+|py[0-9]-[0-9]+)$" log || true"#;
    let out = env.command(&[], &["sh", "-c", script]).env("KURA_FS_WRITEBACK_MS", "20").output().unwrap();
    check(&out, &["sh", "appending processes"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "3600\n3600\n0\n");
}

/// `/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N` of a kura descriptor lead to the kura file,
/// as on Linux: `echo two > /dev/stdout` under `> f` truncates and writes f, `>> /dev/stdout`
/// appends, `cat /dev/fd/5` reads it. Compared with the kernel on a host directory. (They
/// led the kernel to the descriptor's placeholder memfd: the writes went into it, `cat`
/// printed the description's binary state.)
#[test]
fn descriptor_paths_lead_to_the_kura_file() {
    let script = r#"cd "$1"
        { echo one; echo two > /dev/stdout; echo three; } > f; cat f
        { echo a; echo b >> /dev/stdout; echo c; } > g; cat g
        exec 5<f; cat /dev/fd/5; cat /proc/self/fd/5; stat -L -c %s /dev/fd/5
        basename "$(readlink /dev/fd/5)"; readlink /dev/stdin
        sh -c 'echo via-proc > /proc/$$/fd/1' > h; cat h"#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want, "two\nthree\na\nc\ntwo\nthree\ntwo\nthree\n10\nf\n/proc/self/fd/0\nvia-proc\n");
    assert_eq!(got, want, "kura's answers differ from the kernel's");
}

/// The same with the engine embedded in the program: a program that dup2s its kura file onto
/// every low descriptor after its first kura call leaves the engine's store file and io_uring
/// ring alone (they live at 768 and up, kura_engine::fd), and reads back what it wrote.
#[test]
fn dup2_onto_low_descriptors_leaves_an_embedded_engine_alone() {
    let env = Env::new();
    let script = "import os
fd = os.open('/kura/f', os.O_CREAT | os.O_RDWR)
os.write(fd, b'first ')
os.fsync(fd)
for n in range(3, 40):
    if n != fd:
        os.dup2(fd, n)
os.write(fd, b'second')
os.fsync(fd)
g = os.open('/kura/g', os.O_CREAT | os.O_RDWR)
os.write(g, b'third')
os.fsync(g)
print(os.pread(fd, 100, 0).decode(), os.pread(g, 100, 0).decode())";
    let out = env.command(&["--pool", "embedded", "--store-size", "256M"], &["python3", "-c", script]).output().unwrap();
    check(&out, &["python3", "-c", script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "first second third\n");
    let again = env.command(&["--pool", "embedded", "--store-size", "256M"], &["cat", "/kura/f", "/kura/g"]).output().unwrap();
    check(&again, &["cat"]);
    assert_eq!(String::from_utf8_lossy(&again.stdout), "first secondthird");
}

/// What another user may do with root's files and directories: the same script on a kernel
/// directory and under the preload, as uid/gid 65534 (`setpriv`), must give the same answers.
/// The preload checked no permission on open, on creating a file, link or node, or on the
/// directories a path walks through, so any user read and wrote a 0600 file of root's.
/// Extended attributes too: `user.` ones by the file's read and write permission, `trusted.`
/// ones hidden, `security.` ones read-only for the other user.
#[test]
fn other_users_get_the_kernels_permission_answers() {
    if !have("setpriv") {
        return;
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: other_users_get_the_kernels_permission_answers needs root (to become another user)");
        return;
    }
    let setup = r#"set -e; cd "$R"
        echo secret > s; chmod 600 s; echo public > p; chmod 644 p; echo shared > w; chmod 666 w
        mkdir closed ro open noexec; echo x > closed/f; chmod 700 closed; chmod 755 ro; chmod 777 open
        echo y > noexec/f; chmod 766 noexec
        /usr/bin/python3 -c "import os; [os.setxattr(f, n, b'v') for f in ('s', 'p', 'w') for n in ('user.k', 'trusted.t', 'security.s')]""#;
    let probe = r#"cd /; R="$1"; t() { if "$@" >/dev/null 2>&1; then echo "$* ok"; else echo "$* denied"; fi; }
        t cat "$R/s"; t cat "$R/p"; t sh -c "echo hi >> $R/s"; t sh -c "echo hi >> $R/w"; t sh -c "echo > $R/p"
        t cat "$R/closed/f"; t ls "$R/closed"; t stat "$R/closed/f"; t cd "$R/closed"
        t ls "$R/noexec"; t cat "$R/noexec/f"; t touch "$R/ro/new"; t mkdir "$R/ro/d"; t ln -s x "$R/ro/l"
        t mkfifo "$R/ro/fifo"; t ln "$R/w" "$R/ro/hard"; t touch "$R/open/mine"; t mkdir "$R/open/d"
        t sh -c "echo a > $R/open/mine && cat $R/open/mine"; t /usr/bin/python3 -c "import os; os.open('$R/s', os.O_RDONLY | os.O_TRUNC)"
        x() { t /usr/bin/python3 -c "import os; $1"; }
        x "os.getxattr('$R/s', 'user.k')"; x "os.getxattr('$R/p', 'user.k')"; x "os.setxattr('$R/p', 'user.k', b'x')"
        x "os.setxattr('$R/w', 'user.k', b'x')"; x "os.getxattr('$R/p', 'trusted.t')"; x "os.setxattr('$R/w', 'security.s', b'x')"
        x "os.getxattr('$R/w', 'security.s')"; x "os.removexattr('$R/p', 'user.k')"; x "os.setxattr('$R/open', 'user.d', b'x')"
        /usr/bin/python3 -c "import os; print('listed', sorted(os.listxattr('$R/p')), os.getxattr('$R/w', 'user.k'))"
        t truncate -s 0 "$R/p"; t rm -f "$R/p"; t mv "$R/open/mine" "$R/ro/mine"; t cat "$R/s""#;
    let as_nobody = |root: &str| format!("setpriv --reuid=65534 --regid=65534 --clear-groups sh -c '{}' probe {root}", probe.replace('\'', r"'\''"));
    // The kernel's answers, in a directory every user can reach.
    let host = tempfile::Builder::new().prefix("kura-perm-").tempdir_in("/tmp").expect("temp dir");
    std::fs::set_permissions(host.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let root = host.path().display().to_string();
    let run_host = |script: &str| {
        let out = std::process::Command::new("sh").args(["-c", script]).env("R", &root).output().expect("sh");
        check(&out, &["sh", "-c", script]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run_host(setup);
    let kernel = run_host(&as_nobody(&root));
    assert!(kernel.contains("cat /") && kernel.contains(" denied") && kernel.contains(" ok"), "the probe ran:\n{kernel}");
    assert!(kernel.contains("listed ['security.s', 'user.k'] b'x'\n"), "the extended attribute probes ran:\n{kernel}");
    let env = Env::new();
    let kura = env.sh(&format!("R=/kura/t; mkdir -m 755 $R; {setup}\n{}", as_nobody("/kura/t"))).replace("/kura/t", &root);
    assert_eq!(kura, kernel, "as uid 65534: under the preload (left) and on the kernel's file system (right)");
}

/// `posix_spawn` and `posix_spawnp` with every file action (open, dup2, close, closefrom,
/// chdir, fchdir) and the attributes (signal mask, default dispositions, process group), kura
/// programs and `#!` scripts by path and through PATH, the failures the spawn call reports,
/// `system` and `popen` both ways: tests/c/spawn.c's output on a host directory and under the
/// preload on a kura one, the same.
#[test]
fn posix_spawn_system_and_popen_as_on_the_kernel() {
    c_program_matches_the_kernel("spawn.c", &["popen-w: [written through popen"], "posix_spawn");
}

/// The output of tests/c/`source` (built without extra flags) run with a fresh host directory
/// as its argument (the kernel's answers), where each of `marks` must show (the program ran
/// as far as they say), is what it prints under the preload with a fresh kura one (`what`
/// names the calls in the failure); each directory's path reads `DIR`. Returns that output,
/// or `None` when there is no gcc to build it (the test is skipped, with the reason).
fn c_program_matches_the_kernel(source: &str, marks: &[&str], what: &str) -> Option<String> {
    if !have("gcc") {
        kura_testkit::skip(&format!("no gcc to build tests/c/{source}"));
        return None;
    }
    let env = Env::new();
    let exe = build_c(&env, &workspace().join("crates/kura-preload/tests/c").join(source), &[]);
    let host = env.dir.path().join("host");
    std::fs::create_dir(&host).unwrap();
    let out = std::process::Command::new(&exe).arg(&host).output().unwrap();
    check(&out, &[source, "HOST_DIR"]);
    let want = String::from_utf8_lossy(&out.stdout).replace(host.to_str().unwrap(), "DIR");
    for mark in marks {
        assert!(want.contains(mark), "{mark:?} is not in the kernel's output:\n{want}");
    }
    let got = env.sh(&format!("mkdir /kura/t && {} /kura/t", exe.display())).replace("/kura/t", "DIR");
    assert_eq!(got, want, "{what} under the preload (left) and on the kernel (right)");
    Some(want)
}

/// File system calls made by number with `syscall(3)` (libuv makes `statx` so, for Node.js):
/// open, read, write, stat, statx, getdents64, rename, unlink, ... of kura paths and
/// descriptors give the kernel's answers, errno included, and calls kura leaves alone
/// (getpid, a pipe, a fork-like clone returning twice) still work: tests/c/by_number.c on a
/// host directory and under the preload on a kura one, the same. (Before, `syscall(3)` went
/// to the kernel: ENOENT for every kura path, the placeholder's size for a descriptor.) The
/// run also found RENAME_NOREPLACE of a name onto itself succeeding, where Linux says EEXIST.
#[test]
fn calls_by_number_reach_kura_files_as_the_kernels() {
    let Some(want) = c_program_matches_the_kernel("by_number.c", &["statx-moved: 0\n  mode 604 mtime 2000\n"], "calls by number") else { return };
    assert!(want.ends_with("clone child exited 7\n"), "{want}");
}

/// `open` with `O_TMPFILE` and `linkat` of its descriptor (tests/c/tmpfile.c): an unnamed file
/// read and written through its descriptor, `st_nlink` 0, never listed, `/proc/self/fd/N`
/// reading `DIR/#INO (deleted)`; named with its data by `linkat(AT_EMPTY_PATH)` and by
/// `/proc/self/fd/N` with `AT_SYMLINK_FOLLOW` (EXDEV without), also from a forked child and
/// through a directory descriptor; with `O_EXCL`, or once linked and unlinked again, ENOENT,
/// as for a file unlinked while open; EINVAL, ENOTDIR and ENOENT for the wrong flags and
/// paths. On a host directory and under the preload on a kura one, the same. (Before, every
/// such open was EOPNOTSUPP, and `linkat(AT_EMPTY_PATH)` of a kura descriptor EXDEV.)
#[test]
fn o_tmpfile_files_and_their_links_as_on_the_kernel() {
    c_program_matches_the_kernel(
        "tmpfile.c",
        &["fstat: nlink 0 mode 644 size 14 regular 1\nlisted: sub\n", "link O_EXCL empty path: -1 ENOENT\n", "link after unlink: -1 ENOENT\n"],
        "O_TMPFILE",
    );
}

/// `renameat2` with `RENAME_EXCHANGE` (tests/c/exchange.c): two files in one directory, 20
/// pairs among 40 names (some pairs in two directory records), a file and a directory in two
/// directories (the directory's `..` and both parents' link counts follow), through
/// directory descriptors, hard links of one file, and the errors (a missing name, with
/// `RENAME_NOREPLACE`, a directory with its own child either way). On a host directory and
/// under the preload on a kura one, the same; and through FUSE (the program built static, run
/// under `kura fs run --fuse on`, reaches the mount through the kernel), the same. (Before,
/// every exchange was EINVAL.)
#[test]
fn rename_exchange_swaps_two_names_as_on_the_kernel() {
    let marks = [
        "exchange a b: 0\na reads: 6 [was b\n]\nb reads: 6 [was a\n]\na is b's file: 1, b is a's file: 1\n",
        "swapped pairs: 20\n",
        "one/f/.. is one: 1 (two: 0)\n",
        "exchange and noreplace: -1 EINVAL\n",
        "exchange a directory with its own child: -1 EINVAL\n",
    ];
    let Some(want) = c_program_matches_the_kernel("exchange.c", &marks, "RENAME_EXCHANGE") else { return };
    // SAFETY: geteuid cannot fail.
    if !std::path::Path::new("/dev/fuse").exists() || unsafe { libc::geteuid() } != 0 {
        return kura_testkit::skip("needs root and /dev/fuse: RENAME_EXCHANGE through FUSE not run");
    }
    let env = Env::new();
    let exe = env.dir.path().join("exchange-static");
    let src = workspace().join("crates/kura-preload/tests/c/exchange.c");
    if !std::process::Command::new("gcc").args(["-O1", "-static", "-o"]).arg(&exe).arg(&src).status().is_ok_and(|s| s.success()) {
        return kura_testkit::skip("gcc -static failed (no static libc): RENAME_EXCHANGE through FUSE not run");
    }
    let mnt = env.dir.path().join("mnt");
    let script = format!("set -e; mkdir $KURA_FS_MOUNT/t; {} $KURA_FS_MOUNT/t", exe.display());
    let out = env.command(&["--fuse", "on", "--mount", mnt.to_str().unwrap()], &["sh", "-c", &script]).output().unwrap();
    check(&out, &["sh", "-c", &script]);
    let through_fuse = String::from_utf8_lossy(&out.stdout).replace(&format!("{}/t", mnt.display()), "DIR");
    assert_eq!(through_fuse, want, "RENAME_EXCHANGE through FUSE (left) and on the kernel (right)");
}

/// Python's `tempfile.TemporaryFile` (and a rolled-over `SpooledTemporaryFile`) in a kura
/// directory is made with `O_TMPFILE`, as on a host directory (tests/py/tmpfile.py; Python
/// falls back to a named file, unlinked at once, without it), and an `O_TMPFILE` file named
/// through `/proc/self/fd/N` keeps its data: the same output on a host directory and under
/// the preload.
#[test]
fn python_temporary_files_are_o_tmpfile_files_as_on_the_kernel() {
    let env = Env::new();
    let path = workspace().join("crates/kura-preload/tests/py/tmpfile.py");
    let path = path.to_str().unwrap();
    let out = std::process::Command::new("python3").arg(path).arg(env.dir.path().join("host")).output().unwrap();
    check(&out, &["python3", "tmpfile.py", "HOST_DIR"]);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(want.contains("made with O_TMPFILE True 3\n") && want.contains("nlink 0 size 100000"), "{want}");
    assert_eq!(env.run(&["python3", path, "/kura/tmp"]), want, "under the preload (left) and on the kernel (right)");
}

/// Node.js's fs module, sync, promise and stream APIs (tests/js/fs_apis.js: stat, lstat,
/// readdir with types, symlinks and realpath, copy, rename, truncate, chmod, utimes,
/// descriptors, mkdtemp, opendir, recursive cp and rm, streams, statfs, links), on a host
/// directory and under the preload on a kura one: the same results, also when libuv is asked
/// to use io_uring. (Before, libuv's statx by number made `fs.statSync` of a kura path ENOENT
/// and `rmSync` of a tree fail.)
#[test]
fn node_fs_apis_as_on_the_kernel() {
    if !have("node") {
        return kura_testkit::skip("no node (Debian package nodejs)");
    }
    let script = workspace().join("crates/kura-preload/tests/js/fs_apis.js");
    let env = Env::new();
    let host = env.dir.path().join("host");
    let out = std::process::Command::new("node").arg(&script).arg(&host).output().unwrap();
    check(&out, &["node", "fs_apis.js", "HOST_DIR"]);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(want.contains("stat 17 true false 1 644\n") && want.contains("\nrm false "), "{want}");
    let got = env.run(&["node", script.to_str().unwrap(), "/kura/node"]);
    assert_eq!(got, want, "Node.js under the preload (left) and on the kernel (right)");
    // libuv asked to make its file system calls through io_uring, which no hook sees: the
    // preload turns that off (before, the first open of a kura path said ENOENT).
    let program = ["node", script.to_str().unwrap(), "/kura/node-uring"];
    let mut cmd = env.command(&[], &program);
    cmd.env("UV_USE_IO_URING", "1");
    let out = cmd.output().unwrap();
    check(&out, &program);
    assert_eq!(String::from_utf8_lossy(&out.stdout), want, "Node.js with UV_USE_IO_URING=1 under the preload");
}

/// A thread closes a file it has just written while another thread opens and reads it:
/// every byte is there (tests/c/close_while_open.c, 300 rounds). The open read the inode
/// record before the close's write-back updated it and took that record's size over the
/// node's: 1,999 of 2,000 rounds read nothing (found by Node.js's fs test, whose read stream
/// opened the file while the write stream's close ran in libuv's thread pool).
#[test]
fn a_file_closed_by_one_thread_while_another_opens_it_reads_whole() {
    if !have("gcc") {
        return kura_testkit::skip("no gcc to build tests/c/close_while_open.c");
    }
    let env = Env::new();
    let exe = build_c(&env, &workspace().join("crates/kura-preload/tests/c/close_while_open.c"), &["-pthread"]);
    let out = env.sh(&format!("mkdir /kura/cw && {} /kura/cw 300", exe.display()));
    assert_eq!(out, "bad 0 of 300\n");
}

/// Extended attributes (tests/py/xattrs.py: get, set with XATTR_CREATE and XATTR_REPLACE,
/// list, remove, empty and binary values, through symlinks and on them, on directories and
/// descriptors, `trusted.` as root, names without a namespace or too long, values too big,
/// kept across rename and shared by hard links, ctime moving) under the preload and through
/// the FUSE mount: the kernel's answers on a host directory, errno included. (Before, every
/// set was EOPNOTSUPP and lists were empty; the descriptor calls reached the placeholder.)
#[test]
fn extended_attributes_as_on_the_kernel() {
    let env = Env::new();
    python_as_on_the_kernel(&env, "xattrs.py", &|want| assert!(want.contains("get binary ok -> True\n") && want.contains("on symlink itself -> EPERM\n"), "{want}"), &|| {});
}

/// POSIX ACLs are not supported, and kura says so as ext4 mounted `noacl` does: EOPNOTSUPP to
/// get or set one (not ENODATA, which `ls -l` asks again for every file: with EOPNOTSUPP it
/// stops asking for the rest of the file system after the first). `ls -l` and `cp -a` work.
#[test]
fn posix_acls_are_not_supported() {
    let env = Env::new();
    let script = r#"
import errno, os, subprocess
os.makedirs("/kura/acl/d")
for i in range(5):
    open(f"/kura/acl/d/f{i}", "w").write("x")
def errname(call):
    try:
        call()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
f = "/kura/acl/d/f0"
print(errname(lambda: os.getxattr(f, "system.posix_acl_access")), errname(lambda: os.getxattr("/kura/acl/d", "system.posix_acl_default")), errname(lambda: os.setxattr(f, "system.posix_acl_access", b"\x02\0\0\0")))
ls = subprocess.run(["ls", "-l", "/kura/acl/d"], capture_output=True, text=True, check=True).stdout
print(sum(1 for line in ls.splitlines() if line.startswith("-rw-r--r-- ")))
subprocess.run(["cp", "-a", "/kura/acl/d", "/kura/acl/e"], check=True)
print(sorted(os.listdir("/kura/acl/e")) == sorted(os.listdir("/kura/acl/d")))
"#;
    assert_eq!(env.run(&["python3", "-c", script]), "ENOTSUP ENOTSUP ENOTSUP\n5\nTrue\n");
}

/// Runs `tests/py/<script> DIR` on a host directory, under the preload on a directory in the
/// mount, and through the FUSE mount (as root with `/dev/fuse`): the same output each time.
/// `check_host` looks at the host's output first (that it shows what the test is about);
/// `between` runs after the preload run, before the FUSE one.
fn python_as_on_the_kernel(env: &Env, script: &str, check_host: &dyn Fn(&str), between: &dyn Fn()) {
    let path = workspace().join("crates/kura-preload/tests/py").join(script);
    let path = path.to_str().unwrap();
    let out = std::process::Command::new("python3").arg(path).arg(env.dir.path().join("host")).output().unwrap();
    check(&out, &["python3", script, "HOST_DIR"]);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    check_host(&want);
    assert_eq!(env.run(&["python3", path, "/kura/x"]), want, "under the preload (left) and on the kernel (right)");
    between();
    // SAFETY: geteuid cannot fail.
    if !std::path::Path::new("/dev/fuse").exists() || unsafe { libc::geteuid() } != 0 {
        return kura_testkit::skip("needs root and /dev/fuse for the FUSE half");
    }
    let mnt = env.dir.path().join("mnt");
    let through_fuse = format!("env -u LD_PRELOAD python3 {path} $KURA_FS_MOUNT/f");
    let out = env.command(&["--fuse", "on", "--mount", mnt.to_str().unwrap()], &["sh", "-c", &through_fuse]).output().unwrap();
    check(&out, &["sh", "-c", &through_fuse]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), want, "through FUSE (left) and on the kernel (right)");
}

/// `SEEK_DATA` and `SEEK_HOLE` (`tests/py/seek_holes.py`: a sparse file before and after it
/// is flushed, a full one, an empty one, a punched hole, where the offset goes) under the
/// preload and through the FUSE mount, as ext4 answers on a host directory; and `qemu-img map`
/// of a raw image in the mount sees the same extents as on the host. (Before, every file was
/// all data: `SEEK_HOLE` said the end of the file.)
#[test]
fn seek_data_and_hole_as_on_the_kernel() {
    let env = Env::new();
    let qemu_img_map = || {
        if kura_testkit::require_cmd("qemu-img").is_err() {
            return;
        }
        let map = |path: &str| format!("qemu-img map --output=json -f raw {path}");
        let out = std::process::Command::new("sh").arg("-c").arg(map(env.dir.path().join("host/sparse").to_str().unwrap())).output().unwrap();
        check(&out, &["qemu-img", "map"]);
        let want = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(want.contains("\"data\": false"), "{want}");
        // KURA_FS_DEBUG: an lseek that fails says why on stderr (qemu-img then takes the whole
        // file as data; seen once under CI load, not reproduced).
        let out = env.command(&[], &["sh", "-c", &map("/kura/x/sparse")]).env("KURA_FS_DEBUG", "1").output().unwrap();
        check(&out, &["qemu-img", "map"]);
        let got = String::from_utf8_lossy(&out.stdout);
        if got != want {
            let again = env.sh(&map("/kura/x/sparse"));
            panic!(
                "qemu-img map under the preload:\n{got}\nand on the kernel:\n{want}\nits stderr: {}\na second run under the preload: {}",
                String::from_utf8_lossy(&out.stderr),
                if again == want { "as on the kernel".to_owned() } else { again }
            );
        }
    };
    let holes_kept = |want: &str| assert!(want.contains("reopened hole 0 -> 4096\n") && want.contains("punched data 16384 -> 32768\n"), "the host file system keeps holes: {want}");
    python_as_on_the_kernel(&env, "seek_holes.py", &holes_kept, &qemu_img_map);
}

/// `df` and `statvfs` of the mount report the pool's room: the store's capacity (`--store-size`
/// 2G), and less available after 64 MiB are written (a new process looks it up again);
/// `df -i` shows no inode counts, as on btrfs. They were constants (1 TiB, half free).
/// `st_blocks` tells a sparse file from a dense one, as on the kernel: `du` of a file made
/// by `truncate` and of one with a punched range, `cp` (which looks for holes only when
/// `st_blocks` is short) keeps a copy sparse, and `tar --sparse` stores only the data and
/// extracts the same bytes. Compared with the kernel on a host directory, with the
/// differences that are kura's own: an empty-looking file still has one block (GNU tar takes
/// a file with no blocks as all holes without reading it), and a chunk written as zeros
/// takes no room.
#[test]
fn sparse_files_are_sparse_to_du_cp_and_tar() {
    let script = r#"cd "$1"
truncate -s 64M sparse
printf data | dd of=sparse bs=4096 seek=1000 conv=notrunc status=none
head -c 1048576 /dev/urandom | dd of=sparse bs=4096 seek=5000 conv=notrunc status=none
fallocate -p -o $((5000*4096)) -l 524288 sparse
cp sparse copy
cmp sparse copy && echo same
for f in sparse copy; do echo "$f $(stat -c %s $f) $(( $(stat -c %b $f) / 8 ))"; done
head -c 3145728 /dev/urandom > dense
echo "dense $(du -k dense | cut -f1)"
tar --sparse -cf ../t.tar sparse
echo "tar at most 1 MiB: $(( $(stat -c %s ../t.tar) <= 1048576 ))"
mkdir x && tar -C x -xf ../t.tar && cmp sparse x/sparse && echo "extracted $(( $(stat -c %b x/sparse) / 8 ))"
rm ../t.tar
"#;
    let (want, got) = kernel_and_kura(script);
    // In 4 KiB units: the 64 MiB file holds one chunk of `data` and 128 of random bytes.
    assert_eq!(want, "same\nsparse 67108864 129\ncopy 67108864 129\ndense 3072\ntar at most 1 MiB: 1\nextracted 129\n", "on the kernel");
    assert_eq!(got, want, "under the preload (left) and on the kernel (right)");
}

#[test]
fn df_reports_the_pools_room() {
    let env = Env::new();
    let statvfs = "python3 -c 'import os; s = os.statvfs(\"/kura\"); print(s.f_blocks * s.f_frsize, s.f_bfree * s.f_frsize, s.f_bavail * s.f_frsize, s.f_files, s.f_ffree)'";
    let numbers = |out: &str| -> Vec<u64> { out.split_whitespace().map(|w| w.parse().expect("a number")).collect() };
    let before = numbers(&env.sh(statvfs));
    let (total, free, available) = (before[0], before[1], before[2]);
    assert!((1_900_000_000..=2_147_483_648).contains(&total), "the 2G store's capacity: {before:?}");
    assert!(free <= total && available <= free && available > total / 2, "{before:?}");
    assert_eq!(&before[3..], &[0, 0], "no inode counts: {before:?}");
    env.sh("head -c 67108864 /dev/zero | tr '\\0' x > /kura/big && sync /kura/big");
    let after = numbers(&env.sh(statvfs));
    assert_eq!(after[0], total, "the capacity stays: {after:?}");
    assert!(available - after[2] >= 60 << 20, "64 MiB written take room: {before:?} then {after:?}");
    let df = env.sh("df -B1 --output=size,avail /kura | tail -1");
    assert_eq!(numbers(&df)[0], total, "df shows the capacity: {df}");
    let df_i = env.sh("df --output=itotal,iused,iavail /kura | tail -1");
    assert_eq!(numbers(&df_i), vec![0, 0, 0], "df's inode columns: {df_i}");
}

/// Relative paths from a host directory into the mount: from the working directory (`cd /;
/// cat kura/f`, `../kura/f` from `/tmp`) and from a kernel directory descriptor (`openat` of
/// `kura/f` from `/`, as rsync walks its destination). They went to the kernel: ENOENT.
#[test]
fn relative_paths_from_host_directories_into_the_mount() {
    let env = Env::new();
    let out = env.sh(
        r#"echo hi > /kura/rel; cd /; cat kura/rel; ls -d kura/../kura; cd /tmp; cat ../kura/rel; cd ../kura && pwd
        python3 -c "import os; d = os.open('/', os.O_RDONLY | os.O_DIRECTORY | os.O_PATH); print(os.stat('kura/rel', dir_fd=d).st_size, os.path.exists('/tmp/../kura/rel'))""#,
    );
    assert_eq!(out, "hi
kura/../kura
hi
/kura
3 True
");
}

/// rsync copies a tree into the mount and back (`-aHX`: hard links, modes, times, symlinks,
/// extended attributes), an incremental run with `--delete` changes only what changed, and a
/// checksum run afterwards finds nothing to do; the tree that comes back is the one that went
/// in. (rsync's receiver opens its destination from `/` with `openat`: "change_dir#1
/// failed: No such file or directory" before.)
#[test]
fn rsync_copies_a_tree_in_and_out() {
    if !have("rsync") {
        return;
    }
    let env = Env::new();
    let src = env.dir.path().join("src");
    make_tree(&src);
    std::fs::write(src.join("x1"), b"an attribute holder").unwrap();
    let script = format!(
        r#"set -e; S={src}; B={back}
        python3 -c "import os; os.setxattr('$S/x1', 'user.k', b'v')"; ln "$S/x1" "$S/x1.hard"; touch -d 2021-01-01 "$S/x1"
        rsync -aHX "$S/" /kura/rs/
        echo changed >> "$S/x1"; rm "$S/x1.hard"
        rsync -aHX --delete --itemize-changes "$S/" /kura/rs/ | sort
        rsync -aHX /kura/rs/ "$B/"
        rsync -aHXn --checksum --itemize-changes "$S/" /kura/rs/ | wc -l
        diff -r "$S" "$B" && echo same
        python3 -c "import os; print(os.getxattr('$B/x1', 'user.k'), os.stat('$B/x1').st_nlink)""#,
        src = src.display(),
        back = env.dir.path().join("back").display()
    );
    let out = env.sh(&script);
    assert!(out.starts_with("*deleting   x1.hard\n"), "{out}");
    assert!(out.ends_with("\n0\nsame\nb'v' 1\n"), "{out}");
}

/// `dlopen` of a library in the mount, without FUSE (the loader's own system calls never reach
/// the hooks): built there by gcc with a dependency beside it (`$ORIGIN` in its run path, as
/// numpy's extensions and their `numpy.libs`), loaded by an absolute and a relative path,
/// again after the dependency is rebuilt (the new code), by Python's ctypes; a missing one
/// fails with the caller's path in the message, and a bare name is still the loader's search. (Before: "cannot open shared
/// object file" for every kura path, and rustc could not load a procedural macro from a
/// target directory in the mount.)
#[test]
fn libraries_in_the_mount_load_with_dlopen_without_fuse() {
    if !have("gcc") {
        return kura_testkit::skip("no gcc");
    }
    let env = Env::new();
    let src = env.dir.path().join("dlopen.c");
    std::fs::write(
        &src,
        r#"#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        void *h = dlopen(argv[i], RTLD_NOW);
        if (!h) { printf("%s: %s\n", argv[i], dlerror()); continue; }
        int (*f)(void) = (int (*)(void))dlsym(h, "answer");
        printf("%s: %d\n", argv[i], f ? f() : -1);
        dlclose(h);
    }
    printf("libm.so.6: %s\n", dlopen("libm.so.6", RTLD_NOW) ? "loaded" : dlerror());
    return 0;
}
"#,
    )
    .unwrap();
    let exe = build_c(&env, &src, &[]);
    // liba.so needs libb.so from beside it ($ORIGIN/sub in its run path).
    let script = format!(
        "mkdir -p /kura/dl/sub && cd /kura/dl && echo 'int b(void) {{ return 2; }}' > sub/b.c && gcc -shared -fPIC -o sub/libb.so -Wl,-soname,libb.so sub/b.c \\
         && echo 'int b(void); int answer(void) {{ return 40 + b(); }}' > a.c && gcc -shared -fPIC -o liba.so a.c -Lsub -lb -Wl,-rpath,'$ORIGIN/sub' \\
         && {exe} /kura/dl/liba.so ./liba.so /kura/dl/missing.so \\
         && echo 'int b(void) {{ return 3; }}' > sub/b.c && gcc -shared -fPIC -o sub/libb.so -Wl,-soname,libb.so sub/b.c && {exe} /kura/dl/liba.so \\
         && python3 -c 'import ctypes; print(\"ctypes:\", ctypes.CDLL(\"/kura/dl/liba.so\").answer())'",
        exe = exe.display()
    );
    let got = env.sh(&script);
    assert_eq!(
        got,
        "/kura/dl/liba.so: 42\n./liba.so: 42\n/kura/dl/missing.so: /kura/dl/missing.so: cannot open shared object file: No such file or directory\nlibm.so.6: loaded\n\
         /kura/dl/liba.so: 43\nlibm.so.6: loaded\nctypes: 43\n"
    );
}

#[test]
fn c_program_through_stdio_and_the_posix_calls() {
    if !have("gcc") {
        return;
    }
    let env = Env::new();
    let exe = build_c(&env, &workspace().join("crates/kura-preload/tests/c/posix.c"), &[]);
    let out = env.sh(&format!("mkdir /kura/c && {} /kura/c", exe.display()));
    assert!(out.ends_with("all ok\n"), "{out}");
}

/// A tree with the awkward parts: symlinks, a hard link, an empty directory, binary data,
/// names with spaces, a 1 MiB file; plus a real source tree.
fn make_tree(root: &std::path::Path) {
    let src = root.join("tree");
    std::fs::create_dir_all(src.join("empty")).unwrap();
    std::fs::create_dir_all(src.join("deep/a/b/c")).unwrap();
    std::fs::write(src.join("deep/a/b/c/leaf.txt"), "leaf\n").unwrap();
    std::fs::write(src.join("with space.txt"), "spaced\n").unwrap();
    let big: Vec<u8> = (0..(1 << 20) + 123).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(src.join("big.bin"), &big).unwrap();
    std::os::unix::fs::symlink("big.bin", src.join("link-to-big")).unwrap();
    std::os::unix::fs::symlink("deep/a", src.join("dir-link")).unwrap();
    std::fs::hard_link(src.join("with space.txt"), src.join("hard")).unwrap();
    let status = std::process::Command::new("cp").arg("-a").arg(workspace().join("crates/kura-engine/src")).arg(src.join("engine-src")).status().unwrap();
    assert!(status.success());
}

#[test]
fn coreutils_copy_a_tree_in_and_out() {
    let env = Env::new();
    make_tree(env.dir.path());
    let src = env.dir.path().join("tree");
    let back = env.dir.path().join("back");
    let out = env.sh(&format!(
        "set -e
         cp -a {src} /kura/tree
         diff -r {src} /kura/tree
         cp -a /kura/tree {back}
         diff -r {src} {back}
         test \"$(stat -c %i /kura/tree/hard)\" = \"$(stat -c %i '/kura/tree/with space.txt')\"
         test \"$(stat -c %h /kura/tree/hard)\" = 2
         test \"$(readlink /kura/tree/link-to-big)\" = big.bin
         ls -l /kura/tree > /dev/null
         du -s /kura/tree | awk '{{ if ($1 < 1000) exit 1 }}'
         find /kura/tree -type f | wc -l
         find /kura/tree -type l | wc -l
         mv /kura/tree /kura/moved
         test ! -e /kura/tree
         mv /kura/moved/deep /kura/deep-moved
         cat /kura/deep-moved/a/b/c/leaf.txt
         stat -c '%s %F' /kura/moved/big.bin
         rm -r /kura/moved /kura/deep-moved
         ls -A /kura | wc -l",
        src = src.display(),
        back = back.display()
    ));
    let files = walk_count(&src, false);
    let links = walk_count(&src, true);
    assert_eq!(out, format!("{files}\n{links}\nleaf\n{} regular file\n0\n", (1 << 20) + 123));
}

fn walk_count(dir: &std::path::Path, links: bool) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            n += walk_count(&e.path(), links);
        } else if t.is_symlink() == links && (links || t.is_file()) {
            n += 1;
        }
    }
    n
}

#[test]
fn tar_create_and_extract() {
    let env = Env::new();
    make_tree(env.dir.path());
    let src = env.dir.path().join("tree");
    let out_dir = env.dir.path().join("untarred");
    std::fs::create_dir_all(&out_dir).unwrap();
    env.sh(&format!(
        "set -e
         tar cf /kura/t.tar -C {root} tree
         mkdir /kura/x && tar xf /kura/t.tar -C /kura/x
         diff -r {src} /kura/x/tree
         tar cf - -C /kura/x tree | tar xf - -C {out}
         diff -r {src} {out}/tree
         tar tf /kura/t.tar | wc -l > /dev/null",
        root = env.dir.path().display(),
        src = src.display(),
        out = out_dir.display()
    ));
}

/// Executing kura files runs them as the kernel runs its own: `#!` scripts (with an argument,
/// whose interpreter is a kura symlink to the host's python3, or itself a script), a kura
/// symlink to a host binary, a file without `#!` (the shell runs it), a missing interpreter, a
/// file without execute permission, and `fexecve` of a kura binary. Compared with the kernel
/// on a host directory. (A kura symlink leading out of the mount and a script whose
/// interpreter is a kura path failed with "required file not found": a virtualenv in /kura
/// could not run its python.)
#[test]
fn scripts_and_symlinks_run_from_kura_paths_as_the_kernel_runs_them() {
    let script = r#"cd "$1"
        printf '#!/bin/sh\necho "sh:$0:$#:$*"\n' > s.sh; chmod +x s.sh; ./s.sh a 'b c'; "$PWD/s.sh" | sed "s|$PWD|.|"
        ln -s /bin/echo ech; ./ech via-symlink
        mkdir bin; ln -s "$(python3 -c 'import sys; print(sys.executable)')" bin/py
        printf '#!%s/bin/py\nimport sys; print("py", [a.rsplit("/", 1)[-1] for a in sys.argv])\n' "$PWD" > p.py
        chmod +x p.py; ./p.py x
        printf '#!%s/p.py -o\n' "$PWD" > nested; chmod +x nested; ./nested q
        printf '#!/bin/sh -eu\necho "flags $-"\n' > f.sh; chmod +x f.sh; ./f.sh
        printf 'echo no-shebang\n' > plain; chmod +x plain; ./plain
        printf '#!/nonexistent/interp\n' > bad; chmod +x bad; ./bad 2>/dev/null; echo "bad $?"
        printf '#!/bin/sh\necho never\n' > noexec; ./noexec 2>/dev/null; echo "noexec $?"
        cp /bin/echo e2
        python3 -c 'import os; fd = os.open("e2", os.O_RDONLY); os.execve(fd, ["e2", "fexecve"], {})'
        ls /proc/self/fd | wc -l"#;
    let (want, got) = kernel_and_kura(script);
    assert!(want.contains("py ['p.py', '-o', 'nested', 'q']"), "{want}");
    assert_eq!(got, want);
}

/// A FIFO made in the mount connects the processes of the host that open it, as a kernel
/// FIFO does (a kernel FIFO beside the lock files stands for it): an open waits for the other
/// end, `<>` does not, a writer with no reader blocks, lines pass in order. Compared with the
/// kernel on a host directory. (Opening a kura FIFO failed with ENXIO.)
#[test]
fn fifos_in_the_mount_connect_processes_as_the_kernels_do() {
    let script = r#"cd "$1"
        mkfifo p; ls -l p | cut -c1-10
        (echo via-fifo > p &); timeout 5 cat p; echo "rc=$?"
        ( for i in 1 2 3; do echo "line $i"; done > p & ); timeout 5 wc -l < p
        exec 3<>p; echo rw >&3; read -r x <&3; echo "got $x"; exec 3>&-
        timeout 1 sh -c 'echo x > p'; echo "blocked writer rc=$?"
        rm p; ls"#;
    let (want, got) = kernel_and_kura(script);
    assert!(want.contains("got rw") && want.contains("blocked writer rc=124"), "{want}");
    assert_eq!(got, want);
}

/// `kura fs run --fuse on` also mounts the file system with FUSE at the prefix, in a mount
/// namespace of the command's own, for what the preload cannot intercept: the dynamic loader
/// opens a shared library built in the mount (ctypes, `LD_LIBRARY_PATH`, an `$ORIGIN` RPATH,
/// so kura binaries run from their kernel path there), and a static binary reads a kura
/// file. Nobody outside the command sees the mount. (Without it the loader answers "cannot
/// open shared object file": a virtualenv's C extensions could not be imported.)
#[test]
fn the_loader_and_static_binaries_reach_kura_files_through_fuse() {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !std::path::Path::new("/dev/fuse").exists() || !root {
        return kura_testkit::skip("needs root and /dev/fuse for a FUSE mount in a mount namespace");
    }
    if !have("cc") {
        return;
    }
    let env = Env::new();
    let mnt = env.dir.path().join("mnt");
    let st_cat = env.dir.path().join("st_cat");
    let st_src = env.dir.path().join("st_cat.c");
    std::fs::write(&st_src, "#include <stdio.h>\nint main(int c, char **v) { FILE *f = fopen(v[1], \"r\"); char b[64] = {0}; if (!f) return 1; fread(b, 1, 63, f); printf(\"static read: %s\", b); return 0; }\n").unwrap();
    let static_ok = std::process::Command::new("cc").args(["-static", "-o"]).arg(&st_cat).arg(&st_src).status().is_ok_and(|s| s.success());
    let script = format!(
        r#"set -e; M=$KURA_FS_MOUNT; cd $M
        printf 'int answer(void) {{ return 42; }}\n' > a.c; cc -shared -fPIC -o liba.so a.c
        python3 -c "import ctypes; print('ctypes', ctypes.CDLL('$M/liba.so').answer())"
        printf '#include <stdio.h>\nint answer(void);\nint main(void) {{ printf("%%d\\n", answer()); return 0; }}\n' > m.c
        cc -o m m.c -L$M -la; LD_LIBRARY_PATH=$M ./m
        mkdir bin; cc -o bin/m2 m.c -L$M -la -Wl,-rpath,'$ORIGIN/..'; ./bin/m2
        echo hello-static > f; if [ -x {st} ]; then {st} $M/f; else echo 'static read: hello-static'; fi
        grep " $M " /proc/self/mountinfo | grep -c " - fuse""#,
        st = st_cat.display()
    );
    let mnt_arg = mnt.to_str().unwrap();
    let out = env.command(&["--fuse", "on", "--mount", mnt_arg], &["sh", "-c", &script]).output().unwrap();
    check(&out, &["sh", "-c", &script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ctypes 42\n42\n42\nstatic read: hello-static\n1\n");
    if !static_ok {
        kura_testkit::skip("cc -static failed (no static libc): the static binary part did not run");
    }
    let ours = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!ours.contains(mnt_arg), "the FUSE mount leaked out of the command's mount namespace");
}

/// cargo builds and runs a workspace in the mount, without FUSE: a procedural macro crate
/// (rustc `dlopen`s it from the target directory), a build script (a kura program cargo
/// runs), two job threads spawning compilers at once, cargo's locks on its target directory;
/// then `cargo test`, and a second build that finds everything fresh. (Before: the first
/// build hung in a fork handler, or failed to load the macro.) Offline: no dependency
/// outside the workspace.
#[test]
fn cargo_builds_a_workspace_with_a_proc_macro_and_a_build_script() {
    if !have("cargo") {
        return kura_testkit::skip("no cargo");
    }
    let env = Env::new();
    let src = env.dir.path().join("ws");
    let files: [(&str, &str); 6] = [
        ("Cargo.toml", "[workspace]\nmembers = [\"mac\", \"app\"]\nresolver = \"2\"\n"),
        ("mac/Cargo.toml", "[package]\nname = \"mac\"\nversion = \"0.1.0\"\nedition = \"2021\"\n[lib]\nproc-macro = true\n"),
        (
            "mac/src/lib.rs",
            "use proc_macro::TokenStream;\n#[proc_macro]\npub fn forty_two(_: TokenStream) -> TokenStream { \"42u32\".parse().unwrap() }\n",
        ),
        ("app/Cargo.toml", "[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n[dependencies]\nmac = { path = \"../mac\" }\n"),
        ("app/build.rs", "fn main() { println!(\"cargo:rustc-env=BUILT_BY=build.rs\"); }\n"),
        (
            "app/src/main.rs",
            "fn answer() -> u32 { mac::forty_two!() }\nfn main() { println!(\"{} {}\", answer(), env!(\"BUILT_BY\")); }\n#[test]\nfn it_is_42() { assert_eq!(answer(), 42); }\n",
        ),
    ];
    for (path, text) in files {
        let path = src.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let script = format!(
        "cp -r {} /kura/ws && cd /kura/ws && cargo run -q --offline -j 2 && cargo test -q --offline 2>&1 | grep -c '1 passed' && {{ cargo build --offline 2>&1 | grep -c Compiling; true; }}",
        src.display()
    );
    let mut cmd = env.command(&[], &["sh", "-c", &script]);
    // The build's own state, not the host's.
    cmd.env("CARGO_HOME", env.dir.path().join("cargo-home")).env("CARGO_TARGET_DIR", "/kura/ws/target").env_remove("RUSTFLAGS").env_remove("CARGO_BUILD_RUSTFLAGS");
    let out = output_within(cmd, Duration::from_secs(300), "cargo in the mount");
    check(&out, &["sh", "-c", &script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42 build.rs\n1\n0\n", "run, the test passed, nothing recompiled");
}

/// Python's `subprocess` closes every descriptor above the ones it passes (`close_range`)
/// before it executes the child: kura's own (the pool's connections) stay until the exec,
/// which reads a kura program through them, and a kura descriptor passed on (`pass_fds`)
/// reaches the child. A virtualenv made in /kura (whose `ensurepip` runs
/// `/kura/venv/bin/python3` that way) works: pip runs from it. (The exec failed with EIO.)
#[test]
fn python_subprocess_and_a_virtualenv_run_kura_programs() {
    let env = Env::new();
    let out = env.sh(
        r#"set -e; cd /kura
        printf '#!/bin/sh\necho "child $1"; cat /kura/in\n' > run.sh; chmod +x run.sh; echo data > in
        python3 -c '
import os, subprocess
r = subprocess.run(["/kura/run.sh", "1"], capture_output=True, text=True, check=True)
print(r.stdout, end="")
with open("/kura/kept", "w") as f:
    f.write("before\n"); f.flush()
    subprocess.run(["sh", "-c", "echo from-child >&%d" % f.fileno()], pass_fds=[f.fileno()], check=True)
print(open("/kura/kept").read(), end="")
'
        python3 -m venv /kura/venv
        /kura/venv/bin/python -c 'import sys; print(sys.prefix)'
        /kura/venv/bin/pip --version | cut -d' ' -f1,4"#,
    );
    assert_eq!(out, "child 1\ndata\nbefore\nfrom-child\n/kura/venv\npip /kura/venv/lib/python3.11/site-packages/pip\n".replace("python3.11", &python_lib_dir()));
}

/// `python3.X`, the directory name of this python's library.
fn python_lib_dir() -> String {
    let out = std::process::Command::new("python3").args(["-c", "import sys; print('python%d.%d' % sys.version_info[:2])"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn python_os_shutil_pathlib_round_trip() {
    let env = Env::new();
    let script = r#"
import os, shutil, pathlib, hashlib, errno
root = pathlib.Path("/kura/py")
root.mkdir()
(root / "sub").mkdir()
data = os.urandom(300_000)
(root / "sub" / "blob").write_bytes(data)
(root / "note.txt").write_text("héllo\n" * 100)
assert (root / "sub" / "blob").read_bytes() == data
assert sorted(p.name for p in root.iterdir()) == ["note.txt", "sub"]
shutil.copytree(root, "/kura/py2")
assert (pathlib.Path("/kura/py2/sub/blob")).read_bytes() == data
shutil.move("/kura/py2", "/kura/py3")
assert not os.path.exists("/kura/py2")
with os.scandir("/kura/py3") as it:
    names = sorted(e.name for e in it if e.is_file())
assert names == ["note.txt"], names
st = os.stat("/kura/py3/sub/blob")
assert st.st_size == len(data)
with open("/kura/py3/sub/blob", "r+b") as f:
    f.seek(1000); f.write(b"XYZ"); f.flush(); os.fsync(f.fileno())
    f.seek(998); assert f.read(5) == data[998:1000] + b"XYZ"
try:
    os.rmdir("/kura/py3")
except OSError as e:
    assert e.errno == errno.ENOTEMPTY
else:
    raise AssertionError("rmdir of a non-empty directory succeeded")
shutil.copy2("/kura/py3/note.txt", "/tmp/kura-py-note-%d" % os.getpid())
os.unlink("/tmp/kura-py-note-%d" % os.getpid())
shutil.rmtree("/kura/py3")
os.chdir("/kura/py")
assert os.getcwd() == "/kura/py"
assert os.path.realpath("sub/blob") == "/kura/py/sub/blob", os.path.realpath("sub/blob")
for dirpath, dirs, files in os.walk("/kura"):
    pass
print(hashlib.sha256((root / "sub" / "blob").read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest())
"#;
    assert_eq!(env.run(&["python3", "-c", script]), "True\n");
}

/// A Unix socket bound at a kura path is a socket node there (and nothing on the host); another
/// process connects to it by that path; the kernel's errors for taken, missing and non-socket
/// paths; unlink and bind again; a relative path and datagrams; host and abstract addresses
/// still the kernel's.
#[test]
fn unix_sockets_bind_and_connect_at_kura_paths() {
    let env = Env::new();
    let host_sock = env.dir.path().join("host.sock");
    let script = r#"
import errno, os, socket, stat, subprocess, sys

def err(f):
    try:
        f()
    except OSError as e:
        return errno.errorcode[e.errno]
    return "ok"

os.umask(0o022)
os.mkdir("/kura/dir")
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("/kura/dir/s")
assert srv.getsockname() == "/kura/dir/s", srv.getsockname()
st = os.lstat("/kura/dir/s")
assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755, oct(st.st_mode)
assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
assert os.listdir("/kura/dir") == ["s"]
kind = subprocess.run(["stat", "-c", "%F", "/kura/dir/s"], capture_output=True, text=True, check=True).stdout
assert kind == "socket\n", kind
srv.listen(1)

# Another process (under the preload too) connects by the path.
client = subprocess.Popen([sys.executable, "-c", """
import socket
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect("/kura/dir/s")
assert c.getpeername() == "/kura/dir/s", c.getpeername()
c.sendall(b"ping from %d" % c.fileno())
print(c.recv(100).decode(), flush=True)
"""], stdout=subprocess.PIPE, text=True)
conn, _ = srv.accept()
got = conn.recv(100)
assert got.startswith(b"ping from "), got
conn.sendall(b"pong")
out, _ = client.communicate()
assert client.returncode == 0 and out == "pong\n", (client.returncode, out)
conn.close()

assert err(lambda: socket.socket(socket.AF_UNIX).bind("/kura/dir/s")) == "EADDRINUSE"
open("/kura/dir/file", "w").close()
assert err(lambda: socket.socket(socket.AF_UNIX).bind("/kura/dir/file")) == "EADDRINUSE"
assert err(lambda: socket.socket(socket.AF_UNIX).bind("/kura/nodir/s")) == "ENOENT"
assert err(lambda: socket.socket(socket.AF_UNIX).connect("/kura/dir/file")) == "ECONNREFUSED"
assert err(lambda: socket.socket(socket.AF_UNIX).connect("/kura/dir/missing")) == "ENOENT"
assert err(lambda: os.open("/kura/dir/s", os.O_RDONLY)) == "ENXIO"
bound = socket.socket(socket.AF_UNIX)
bound.bind("/kura/dir/t")
assert err(lambda: bound.bind("/kura/dir/u")) == "EINVAL"
assert not os.path.lexists("/kura/dir/u")
os.symlink("s", "/kura/dir/link")
c = socket.socket(socket.AF_UNIX)
c.connect("/kura/dir/link")
srv.accept()[0].close()

# unlink removes the name; the listener lives on, unreachable by it; the path binds again.
os.unlink("/kura/dir/s")
assert not os.path.lexists("/kura/dir/s")
assert err(lambda: socket.socket(socket.AF_UNIX).connect("/kura/dir/s")) == "ENOENT"
again = socket.socket(socket.AF_UNIX)
again.bind("/kura/dir/s")
again.listen(1)
assert os.stat("/kura/dir/s").st_ino != st.st_ino
socket.socket(socket.AF_UNIX).connect("/kura/dir/s")
# A socket nobody listens on any more: refused, as the kernel does.
again.close()
assert err(lambda: socket.socket(socket.AF_UNIX).connect("/kura/dir/s")) == "ECONNREFUSED"

# Relative to a working directory in the mount; datagrams sent to a path.
os.chdir("/kura/dir")
d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
d.bind("dgram")
assert d.getsockname() == "dgram"
assert stat.S_ISSOCK(os.stat("/kura/dir/dgram").st_mode)
sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sender.sendto(b"one", "/kura/dir/dgram")
sender.sendmsg([b"two"], [], 0, "dgram")
assert (d.recv(10), d.recv(10)) == (b"one", b"two")
os.chdir("/")

# Not kura's: a host path and an abstract name are the kernel's.
host = socket.socket(socket.AF_UNIX)
host.bind(sys.argv[1])
assert stat.S_ISSOCK(os.stat(sys.argv[1]).st_mode)
abstract = socket.socket(socket.AF_UNIX)
name = b"\0kura-preload-test-%d" % os.getpid()
abstract.bind(name)
abstract.listen(1)
socket.socket(socket.AF_UNIX).connect(name)
assert abstract.getsockname() == name
print("ok")
"#;
    assert_eq!(env.run(&["python3", "-c", script, &host_sock.display().to_string()]), "ok\n");
    assert!(std::fs::symlink_metadata(&host_sock).is_ok(), "the host path is the kernel's");
    assert!(std::fs::symlink_metadata("/kura/dir/s").is_err(), "a kura socket must not appear in the kernel's namespace");
}

/// The same in sqlite's WAL mode, which most applications use, with a fourth process reading
/// all along: each process maps the `-shm` index (a writable shared mapping: one host file
/// that every process of the host maps, see the preload's `maps`), guards the `-wal` file with
/// locks on the `-shm` file, and reads frames that other processes appended. A lock taken
/// revalidates every open file, and a file that another process has open is read and written
/// through the pool. (The `-shm` mapping failed, `ENODEV`: "disk I/O error" at the first
/// statement; with the mapping but caches revalidated only for the locked file, concurrent
/// writers failed with "disk I/O error".)
#[test]
fn sqlite_wal_mode_in_four_processes_keeps_every_transaction() {
    let Some(out) = sqlite_counter_processes("export SQLITE_JOURNAL_MODE=WAL;", "& python3 {py} db watch 300 ", "&& ls /kura") else { return };
    assert_eq!(out, "consistent\n450 450 ok\ndb\n", "as on the kernel: the last connection checkpoints and removes -wal and -shm");
}

/// The same with `PRAGMA mmap_size` in both journal modes: sqlite writes pages with `pwrite`
/// and reads them through a shared read-only mapping of the database, which must show every
/// write made on the host, its own and other processes'. (When read-only mappings were
/// copies, sqlite's own checks kept this working; the first version of mappings that see
/// writes wrote the backing file back over the database at every `munmap` and lost an update:
/// "449 450 ok".)
#[test]
fn sqlite_reading_through_mmap_in_four_processes_keeps_every_transaction() {
    for mode in ["DELETE", "WAL"] {
        let setup = format!("export SQLITE_MMAP_SIZE=67108864 SQLITE_JOURNAL_MODE={mode};");
        let Some(out) = sqlite_counter_processes(&setup, "& python3 {py} db watch 200 ", "") else { return };
        assert_eq!(out, "consistent\n450 450 ok\n", "journal mode {mode}");
    }
}

/// Shared mappings of a kura file see what is written to it, as through the kernel's page
/// cache: a read-only mapping shows this process's `pwrite` and another process's write (a
/// `dd` run meanwhile) at once, and `pread` shows a writable mapping's store before any
/// `msync`. Compared with the kernel on a host directory. (A shared read-only mapping was a
/// copy of the file at `mmap` time, and reads did not see stores until `msync`.)
#[test]
fn shared_mappings_see_writes_as_the_kernels_do() {
    let script = r#"python3 - "$1/lm" <<'PY'
import mmap, os, subprocess, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 8192)
m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ)
os.pwrite(fd, b"OWN", 100)
print("own write seen", m[100:103] == b"OWN")
subprocess.run(["sh", "-c", f"printf OTHER | dd of={path} bs=1 seek=200 conv=notrunc status=none"], check=True)
print("other process's write seen", m[200:205] == b"OTHER")
w = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
w[300:305] = b"STORE"
print("store seen by pread", os.pread(fd, 5, 300) == b"STORE", "and by the other mapping", m[300:305] == b"STORE")
w.close(); m.close(); os.close(fd)
print(open(path, "rb").read()[100:305].replace(b"\0", b"").decode())
PY"#;
    let (want, got) = kernel_and_kura(script);
    assert_eq!(want, "own write seen True\nother process's write seen True\nstore seen by pread True and by the other mapping True\nOWNOTHERSTORE\n");
    assert_eq!(got, want);
}

/// Three processes updating one sqlite database at once (rollback journal, fcntl locks), each
/// 150 transactions adding one to a counter: every transaction is kept and the database is
/// sound. Locks make the processes' caches coherent, as NFS's do: a process writes a file
/// back before it releases a lock and revalidates its cached pages after it takes one. (Each
/// process read the pages it had cached before another one committed: "database disk image
/// is malformed", and a counter of 150 where there were 450 transactions.)
#[test]
fn sqlite_in_three_processes_keeps_every_transaction() {
    let Some(out) = sqlite_counter_processes("", "", "") else { return };
    assert_eq!(out, "450 450 ok\n");
}

/// Three processes of `tests/py/sqlite_counter.py` running 150 transactions each on one
/// database under the preload, with `setup` before, `more` processes beside them (`{py}` is
/// the script) and `after` the check: the output, or `None` without python3.
fn sqlite_counter_processes(setup: &str, more: &str, after: &str) -> Option<String> {
    if !have("python3") {
        kura_testkit::skip("no python3");
        return None;
    }
    let env = Env::new();
    let py = workspace().join("crates/kura-preload/tests/py/sqlite_counter.py");
    let script = format!(
        "{setup} cd /kura && python3 {py} db init 0 &&
         {{ python3 {py} db a 150 & python3 {py} db b 150 & python3 {py} db c 150 {more}& wait; }} &&
         python3 {py} db check 0 {after}",
        py = py.display(),
        more = more.replace("{py}", &py.display().to_string()),
    );
    Some(env.sh(&script))
}

#[test]
fn sqlite_ten_thousand_inserts_integrity_and_reopen() {
    if !have("sqlite3") {
        return;
    }
    let env = Env::new();
    let sql = "CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT);
               BEGIN;
               WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<10000)
                 INSERT INTO t SELECT x, 'value-' || x FROM c;
               COMMIT;
               PRAGMA integrity_check;";
    assert_eq!(env.run(&["sqlite3", "/kura/db.sqlite", sql]), "ok\n");
    // A new process (and a new server: the last run stopped it) opens it again.
    let out = env.run(&["sqlite3", "/kura/db.sqlite", "PRAGMA integrity_check; SELECT count(*), sum(id) FROM t; INSERT INTO t(v) VALUES ('more'); SELECT max(id) FROM t;"]);
    assert_eq!(out, "ok\n10000|50005000\n10001\n");
    // 10,000 single-row transactions from Python's sqlite3 (journal create/delete each time).
    let py = "import sqlite3\nc = sqlite3.connect('/kura/db.sqlite')\nfor i in range(300):\n    c.execute('INSERT INTO t(v) VALUES (?)', ('r%d' % i,)); c.commit()\nprint(c.execute('PRAGMA integrity_check').fetchone()[0], c.execute('SELECT count(*) FROM t').fetchone()[0])";
    assert_eq!(env.run(&["python3", "-c", py]), "ok 10301\n");
}

#[test]
fn fio_verify_buffered_direct_and_sync() {
    if !have("fio") {
        return;
    }
    let env = Env::new();
    for mode in ["--direct=0", "--direct=1", "--sync=1"] {
        let out = env.run(&[
            "fio", "--name=verify", "--filename=/kura/fio.dat", "--size=16m", "--bs=4k", "--rw=randwrite", "--ioengine=psync", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", mode,
            "--output-format=json",
        ]);
        let start = out.find('{').expect("fio JSON");
        let report: serde_json::Value = serde_json::from_str(&out[start..]).expect("fio JSON");
        let job = &report["jobs"][0];
        assert_eq!(job["error"], 0, "{mode}: {out}");
        assert_eq!(job["write"]["io_bytes"], 16 << 20, "{mode}");
        assert_eq!(job["read"]["io_bytes"], 16 << 20, "{mode}: verification read everything back");
    }
}

/// A writer fsyncs every tenth record and reports it; the writer and the server holding the
/// store are both killed with SIGKILL; the next run finds every fsynced record intact.
#[test]
fn fsynced_data_survives_kill_9_of_writer_and_server() {
    let env = Env::new();
    let writer = r#"
import os, sys
fd = os.open("/kura/log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
print(os.getpid(), flush=True)
i = 0
while True:
    os.write(fd, b"record %08d %s\n" % (i, b"x" * 80))
    i += 1
    if i % 10 == 0:
        os.fsync(fd)
        print(i, flush=True)
"#;
    let mut child = env.command(&[], &["python3", "-c", writer]).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let writer_pid: i32 = lines.next().unwrap().unwrap().trim().parse().unwrap();
    let mut synced = 0u64;
    for line in lines.by_ref() {
        synced = line.unwrap().trim().parse().unwrap();
        if synced >= 2000 {
            break;
        }
    }
    let info: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(env.data_dir().join("server.json")).unwrap()).unwrap();
    let server_pid = info["pid"].as_i64().unwrap() as i32;
    // SAFETY: kill(2) of processes this test started (the local server and the writer).
    unsafe {
        libc::kill(server_pid, libc::SIGKILL);
        libc::kill(writer_pid, libc::SIGKILL);
    }
    let _ = child.wait();
    let check_script = format!(
        "data = open('/kura/log', 'rb').read()\nn = {synced}\nfor i in range(n):\n    rec = data[i*97:(i+1)*97]\n    assert rec == b'record %08d %s\\n' % (i, b'x' * 80), (i, rec)\nprint('ok', len(data) // 97 >= n)"
    );
    assert_eq!(env.run(&["python3", "-c", &check_script]), "ok True\n");
}

/// Runs the Python `script` under the preload once per id (its `sys.argv[1]`), all at once;
/// each must succeed.
/// A worker that fails is reported with its output at once, and the others are killed (a
/// reader waiting for a writer that died would wait for ever); all must end within
/// `WORKERS_TIMEOUT_S`.
fn run_at_once(env: &Env, script: &str, ids: &[&str]) {
    const WORKERS_TIMEOUT_S: u64 = 600;
    // Output goes to files, so that a worker never blocks on a full pipe while another is
    // waited for.
    let mut workers: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (out, err) = (env.dir.path().join(format!("worker-{i}.out")), env.dir.path().join(format!("worker-{i}.err")));
            // A process group of its own, so that `kura fs run` and its program go together.
            let child = std::os::unix::process::CommandExt::process_group(&mut env.command(&[], &["python3", "-c", script, id]), 0)
                .stdout(std::fs::File::create(&out).unwrap())
                .stderr(std::fs::File::create(&err).unwrap())
                .spawn()
                .unwrap();
            (id.to_string(), Some(child), out, err)
        })
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(WORKERS_TIMEOUT_S);
    let mut failure = None;
    while failure.is_none() && workers.iter().any(|w| w.1.is_some()) {
        for (id, child, out, err) in &mut workers {
            let Some(status) = child.as_mut().and_then(|c| c.try_wait().unwrap()) else { continue };
            *child = None;
            if !status.success() {
                let read = |p: &std::path::PathBuf| std::fs::read_to_string(p).unwrap_or_default();
                failure = Some(format!("worker {id} failed ({status}):\nstdout:\n{}\nstderr:\n{}", read(out), read(err)));
                break;
            }
        }
        if std::time::Instant::now() > deadline {
            let running: Vec<_> = workers.iter().filter(|w| w.1.is_some()).map(|w| w.0.clone()).collect();
            failure = Some(format!("workers {running:?} still running after {WORKERS_TIMEOUT_S} s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for (_, child, _, _) in &mut workers {
        if let Some(child) = child {
            // SAFETY: kill(2) of the process group of a child this test started and has not
            // reaped (`kura fs run` and its program; its local server has a group of its own).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
        }
    }
    if let Some(failure) = failure {
        panic!("{failure}");
    }
}

/// Two processes create, rename over and delete names in one directory at once; afterwards
/// every entry resolves, names are unique, link counts add up, contents match.
#[test]
fn concurrent_processes_keep_the_namespace_consistent() {
    let env = Env::new();
    env.sh("mkdir /kura/shared");
    let worker = r#"
import os, random, sys, errno
me = sys.argv[1]
rng = random.Random(me)
for k in range(250):
    tmp = "/kura/shared/tmp-%s-%d" % (me, k)
    with open(tmp, "w") as f:
        f.write("writer-%s-%d\n" % (me, k))
    target = "/kura/shared/n%d" % rng.randrange(40)
    os.rename(tmp, target)
    if rng.random() < 0.3:
        try:
            os.unlink("/kura/shared/n%d" % rng.randrange(40))
        except FileNotFoundError:
            pass
    if rng.random() < 0.1:
        d = "/kura/shared/d%d" % rng.randrange(5)
        try:
            os.mkdir(d)
        except FileExistsError:
            try:
                os.rmdir(d)
            except OSError as e:
                assert e.errno in (errno.ENOENT, errno.ENOTEMPTY), e
print("done", me)
"#;
    run_at_once(&env, worker, &["a", "b"]);
    let checker = r#"
import os, re
names = os.listdir("/kura/shared")
assert len(names) == len(set(names)), "duplicate names"
dirs = 0
for n in names:
    p = "/kura/shared/" + n
    st = os.lstat(p)
    if os.path.isdir(p):
        dirs += 1
        continue
    assert re.fullmatch(r"n\d+", n), n
    assert st.st_nlink == 1, (n, st.st_nlink)
    body = open(p).read()
    assert re.fullmatch(r"writer-[ab]-\d+\n", body), (n, body)
assert os.stat("/kura/shared").st_nlink == 2 + dirs, (os.stat("/kura/shared").st_nlink, dirs)
print("consistent", len(names) > 0)
"#;
    assert_eq!(env.run(&["python3", "-c", checker]), "consistent True\n");
}

/// Two processes rename files over one name as fast as they can while a third unlinks it:
/// every rename succeeds. (The preload reads the old target's inode for its permission
/// check; another process may have just replaced or removed that name and dropped the
/// inode, which means "the target changed", never `ENOENT`.)
#[test]
fn renaming_over_a_name_others_replace_and_unlink_succeeds() {
    let env = Env::new();
    env.sh("mkdir /kura/hot");
    let worker = r#"
import os, sys, time
me = sys.argv[1]
if me == "unlinker":
    while not os.path.exists("/kura/hot/go"):
        time.sleep(0.001)
    while len([n for n in os.listdir("/kura/hot") if n.startswith("done")]) < 2:
        try:
            os.unlink("/kura/hot/x")
        except FileNotFoundError:
            pass
else:
    tmps = []
    for k in range(RENAMES):
        tmps.append("/kura/hot/tmp-%s-%d" % (me, k))
        with open(tmps[-1], "w") as f:
            f.write(me)
    open("/kura/hot/ready-" + me, "w").close()
    while len([n for n in os.listdir("/kura/hot") if n.startswith("ready")]) < 2:
        time.sleep(0.001)
    open("/kura/hot/go", "a").close()
    for tmp in tmps:
        os.rename(tmp, "/kura/hot/x")
    open("/kura/hot/done-" + me, "w").close()
print("done", me)
"#
    .replace("RENAMES", "1000");
    run_at_once(&env, &worker, &["a", "b", "unlinker"]);
    let left = env.run(&["python3", "-c", "import os; print(sorted(n for n in os.listdir('/kura/hot') if n.startswith(('x', 'tmp'))))"]);
    assert!(left == "[]\n" || left == "['x']\n", "only the one name may be left: {left}");
}

/// The atomic-replace pattern (write a temporary file, rename it over the live name) as
/// other processes see it: `stat`, `access` and `open` of the live name never fail while it
/// is replaced again and again.
#[test]
fn readers_never_miss_a_name_another_process_renames_over() {
    let env = Env::new();
    env.sh("mkdir /kura/live && echo first > /kura/live/config");
    let worker = r#"
import os, sys
me = sys.argv[1]
if me == "writer":
    tmps = []
    for k in range(1000):
        tmps.append("/kura/live/tmp-%d" % k)
        with open(tmps[-1], "w") as f:
            f.write("version %d\n" % k)
    for tmp in tmps:
        os.rename(tmp, "/kura/live/config")
    open("/kura/live/done", "w").close()
else:
    reads = 0
    while not os.path.exists("/kura/live/done"):
        os.stat("/kura/live/config")
        assert os.access("/kura/live/config", os.R_OK)
        fd = os.open("/kura/live/config", os.O_RDONLY)
        os.close(fd)
        reads += 1
    assert reads > 0
print("done", me)
"#;
    run_at_once(&env, worker, &["reader", "reader", "writer"]);
    assert_eq!(env.run(&["cat", "/kura/live/config"]), "version 999\n");
}

/// Python helpers for scripts run under the preload with `kura` and `data` (the `kura` binary
/// and the data directory) set: `other(cmd)` runs a shell command in another `kura fs run` of
/// the same file system (its output returned), `items()` counts the local server's items.
const LOCAL_SERVER_PY: &str = r#"
def other(cmd):
    r = subprocess.run([kura, "fs", "run", "--data-dir", data, "--fuse", "off", "--", "sh", "-c", cmd], capture_output=True)
    assert r.returncode == 0, r.stderr
    return r.stdout
def items():
    info = json.load(open(os.path.join(data, "server.json")))
    if info.get("socket"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(info["socket"])
    else:
        s = socket.create_connection(("127.0.0.1", info["port"]))
    s.sendall(b"stats\r\n")
    text = b""
    while not text.endswith(b"END\r\n"):
        text += s.recv(65536)
    return int([l for l in text.split(b"\r\n") if l.startswith(b"STAT curr_items ")][0].split()[2])
"#;

/// Another process removes (or renames over) a file this one has open: as POSIX says, the open
/// descriptor keeps the file, whole and writable, until it is closed; then the file's data goes
/// from the pool. A process killed while it holds such a file leaves it to the next process
/// that opens the file system, which deletes it.
#[test]
fn a_file_another_process_removes_stays_open_until_closed() {
    let env = Env::new();
    let script = [r#"
import json, os, signal, socket, subprocess, sys, time
kura, data = sys.argv[1], sys.argv[2]
"#, LOCAL_SERVER_PY, r#"
other("touch /kura/warm")
baseline = items()

# Renamed over by another process: the old file stays readable, also the parts this process
# never read (they come from the pool).
other("head -c 300000 /dev/zero | tr '\\0' A > /kura/f")
fd = os.open("/kura/f", os.O_RDONLY)
assert os.pread(fd, 10, 0) == b"A" * 10
other("echo new > /kura/g && mv /kura/g /kura/f")
for off in (0, 4096, 150000, 290000):
    assert os.pread(fd, 10, off) == b"A" * 10, off
st = os.fstat(fd)
assert (st.st_size, st.st_nlink) == (300000, 0), st
assert open("/kura/f").read() == "new\n"
os.close(fd)
other("rm /kura/f")
assert items() == baseline, ("the replaced file was left behind", baseline, items())

# Removed while this process writes it: writes, fsync and reads go on; the close deletes it.
fd = os.open("/kura/w", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"x" * (1 << 20))
other("rm /kura/w")
assert not os.path.exists("/kura/w")
os.fsync(fd)
os.pwrite(fd, b"y" * 4096, 1 << 20)
os.fsync(fd)
assert os.pread(fd, 4, (1 << 20) - 2) == b"xxyy"
assert os.fstat(fd).st_size == (1 << 20) + 4096
os.close(fd)
assert items() == baseline, ("the removed file was left behind", baseline, items())

# A holder killed while the file has no name: the next process to start deletes it.
other("head -c 100000 /dev/zero > /kura/k")
holder = subprocess.Popen([kura, "fs", "run", "--data-dir", data, "--fuse", "off", "--", "python3", "-c",
    "import os, time; fd = os.open('/kura/k', os.O_RDONLY); print(os.getpid(), flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE)
pid = int(holder.stdout.readline())
os.unlink("/kura/k")
assert items() > baseline, "deleted while another process had it open"
os.kill(pid, signal.SIGKILL)
holder.wait()
other("ls /kura > /dev/null")
assert items() == baseline, ("the dead holder's file was not swept", baseline, items())

# A forked child keeps a file open after its parent closed it and another process removed it:
# reads of parts the parent never cached, and the child's close deletes it.
other("head -c 200000 /dev/zero | tr '\\0' B > /kura/c")
fd = os.open("/kura/c", os.O_RDONLY)
assert os.pread(fd, 10, 0) == b"B" * 10
go_r, go_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(go_w)
    os.read(go_r, 1)
    ok = os.pread(fd, 10, 150000) == b"B" * 10 and os.fstat(fd).st_nlink == 0
    os.close(fd)
    os._exit(0 if ok else 1)
os.close(go_r)
os.close(fd)
other("rm /kura/c")
assert items() > baseline, "deleted while a forked child had it open"
os.write(go_w, b"x")
_, status = os.waitpid(child, 0)
assert status == 0, ("the forked child lost the removed file", status)
assert items() == baseline, ("the child's close left the removed file behind", baseline, items())
print("ok")
"#].concat();
    let kura = common::kura();
    let data = env.data_dir();
    assert_eq!(env.run(&["python3", "-c", &script, kura.to_str().unwrap(), data.to_str().unwrap()]), "ok\n");
}

/// An `O_TMPFILE` file is a file unlinked while open from its start: its chunks and record
/// leave the pool at its last close, and when the process holding it is killed, the next
/// process that opens the file system deletes it; one named by `linkat` stays until its name
/// is removed. Counted by the local server's items.
#[test]
fn an_o_tmpfile_files_data_goes_at_its_last_close_or_with_its_holder() {
    let env = Env::new();
    let script = [r#"
import ctypes, json, os, signal, socket, subprocess, sys
kura, data = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
AT_EMPTY_PATH = 0x1000
"#, LOCAL_SERVER_PY, r#"
other("mkdir /kura/t")
baseline = items()

# Written back (fsync), then closed without a name: every chunk goes, and the record.
fd = os.open("/kura/t", os.O_TMPFILE | os.O_RDWR, 0o600)
os.write(fd, os.urandom(300000))
os.fsync(fd)
assert items() > baseline + 70, ("the data is in the pool", baseline, items())
assert os.listdir("/kura/t") == []
os.close(fd)
assert items() == baseline, ("the closed O_TMPFILE file was left behind", baseline, items())

# Named: it stays, and another process reads it; its name removed, it goes.
fd = os.open("/kura/t", os.O_TMPFILE | os.O_RDWR, 0o644)
os.write(fd, b"kept\n" * 1000)
assert libc.linkat(fd, b"", -100, b"/kura/t/kept", AT_EMPTY_PATH) == 0, os.strerror(ctypes.get_errno())
os.close(fd)
assert other("wc -c < /kura/t/kept").strip() == b"5000"
assert items() > baseline
os.unlink("/kura/t/kept")
assert items() == baseline, ("the named O_TMPFILE file was left behind", baseline, items())

# Its holder killed: the next process to start deletes it.
holder = subprocess.Popen([kura, "fs", "run", "--data-dir", data, "--fuse", "off", "--", "python3", "-c",
    "import os, time; fd = os.open('/kura/t', os.O_TMPFILE | os.O_RDWR, 0o600); os.write(fd, b'y' * 100000); os.fsync(fd); print(os.getpid(), flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE)
pid = int(holder.stdout.readline())
assert items() > baseline + 20, "the holder's data is in the pool"
os.kill(pid, signal.SIGKILL)
holder.wait()
other("ls /kura > /dev/null")
assert items() == baseline, ("the dead holder's O_TMPFILE file was not swept", baseline, items())
print("ok")
"#].concat();
    let kura = common::kura();
    let data = env.data_dir();
    assert_eq!(env.run(&["python3", "-c", &script, kura.to_str().unwrap(), data.to_str().unwrap()]), "ok\n");
}

/// A forked child of a process that embeds the engine leaves the engine alone: its `sync`
/// wrote a journal block into its parent's store (and took the engine's locks, which are
/// parking_lot's and not safe to take in a child). The child's write system calls around its
/// `sync` are counted in `/proc/self/io`.
#[test]
fn a_forked_child_leaves_its_parents_embedded_engine_alone() {
    if !std::path::Path::new("/proc/self/io").exists() {
        return kura_testkit::skip("no /proc/self/io (task I/O accounting) to count a child's writes");
    }
    let env = Env::new();
    let script = r#"
import os
def writes():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("syscw:")).split()[1])
fd = os.open("/kura/f", os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd, b"parent")
os.fsync(fd)
os.close(fd)
child = os.fork()
if child == 0:
    before = writes()
    os.sync()
    os._exit(min(writes() - before, 100))
_, status = os.waitpid(child, 0)
print("child wrote", os.waitstatus_to_exitcode(status))
"#;
    let out = env.command(&["--pool", "embedded", "--store-size", "256M"], &["python3", "-c", script]).output().unwrap();
    check(&out, &["python3", "fork and sync"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "child wrote 0\n");
}

/// A program started by a preloaded program on an embedded store runs no engine of its own on
/// the store: the store is in use by its parent's, so its kura calls fail (EIO) with the reason
/// and the way out, and the parent's files are whole. Before the store was locked, the child
/// ran a second engine on the file: it did not see the parent's unsynced writes, and each
/// reclaimed blocks the other thought its own.
#[test]
fn a_program_started_on_an_embedded_store_in_use_is_refused_with_the_reason() {
    let env = Env::new();
    let script = r#"
import os, subprocess
with open("/kura/f", "w") as f:
    f.write("parent")
child = subprocess.run(["cat", "/kura/f"], capture_output=True, text=True)
print("child", child.returncode, child.stdout == "")
print(child.stderr.strip().splitlines()[0] if child.stderr else "no message")
print(open("/kura/f").read())
"#;
    let out = env.command(&["--pool", "embedded", "--store-size", "256M"], &["python3", "-c", script]).output().unwrap();
    check(&out, &["python3", "an exec'd child on an embedded store"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"child 1 True"), "{stdout}");
    assert!(lines[1].contains("is in use by another open of it") && lines[1].contains("run without --pool embedded"), "{stdout}");
    assert_eq!(lines.get(2), Some(&"parent"), "{stdout}");
}

#[test]
fn a_full_pool_is_enospc_not_a_crash() {
    let env = Env::new();
    let script = r#"
import os, errno
fd = os.open("/kura/fill", os.O_WRONLY | os.O_CREAT, 0o644)
chunk = os.urandom(1 << 20)
try:
    for i in range(2048):
        os.write(fd, chunk)
        if i % 16 == 15:
            os.fsync(fd)
    os.fsync(fd)
    print("never full")
except OSError as e:
    print(errno.errorcode[e.errno])
"#;
    let out = env.command(&["--store-size", "256M"], &["python3", "-c", script]).output().unwrap();
    check(&out, &["fill"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ENOSPC\n", "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn an_unreachable_pool_is_eio_after_a_bounded_wait() {
    let env = Env::new();
    // Nothing listens: refused at once.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("kura://127.0.0.1:{closed}");
    let started = Instant::now();
    let out = env.command(&["--pool", &url], &["sh", "-c", "cat /kura/x; echo status=$?"]).env("KURA_FS_QUIET", "1").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error") && text.contains("status=1"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(20));
    // A server that accepts and never answers: EIO once the request times out.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("kura://{}", silent.local_addr().unwrap());
    let started = Instant::now();
    let out = env.command(&["--pool", &url], &["sh", "-c", "ls /kura/; echo status=$?"]).env("KURA_FS_QUIET", "1").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error") && text.contains("status=2"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    drop(silent);
}

/// A 256 MiB kura server of the test's own, on a free port, and its port.
fn small_kura_server(env: &Env) -> (kura_testkit::ChildGuard, u16) {
    kura_testkit::spawn_listening("kura serve", Duration::from_secs(60), |port| small_kura_server_command(env, port)).expect("start kura serve")
}

/// Runs the Python `script` under the preload on the kura server at `port`; it must succeed.
fn python_on(env: &Env, port: u16, script: &str) {
    let out = python_command_on(env, port, script).output().expect("run kura fs run");
    check(&out, &[script]);
}

fn python_command_on(env: &Env, port: u16, script: &str) -> std::process::Command {
    env.command(&["--pool", &format!("kura://127.0.0.1:{port}")], &["python3", "-c", script])
}

/// [`python_on`], and the requests the kura server at `port` counted meanwhile.
fn requests_of(env: &Env, port: u16, script: &str) -> u64 {
    let before = server_requests(port);
    python_on(env, port, script);
    server_requests(port) - before
}

/// The Python `script` started under the preload on the kura server at `port`, its standard
/// input and output piped (a process kept running between the test's steps), and the lines
/// it prints.
fn python_child_on(env: &Env, port: u16, script: &str) -> (std::process::Child, std::io::Lines<BufReader<std::process::ChildStdout>>) {
    let mut child = python_command_on(env, port, script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("start kura fs run");
    let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    (child, lines)
}

/// The command of [`small_kura_server`] on `port`.
fn small_kura_server_command(env: &Env, port: u16) -> std::process::Command {
    let server_dir = env.dir.path().join("server");
    std::fs::create_dir_all(&server_dir).unwrap();
    let mut cmd = std::process::Command::new(common::kura());
    cmd.args(["serve", "-l", "127.0.0.1", "-p", &port.to_string(), "--size", "256M", "-t", "1", "-m", "16", "--path"]).arg(server_dir.join("srv.kura"));
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    cmd
}

/// The requests a kura server received, by its own counters: lookups, stores, deletes and
/// meta commands, whatever they are.
fn server_requests(port: u16) -> u64 {
    ["cmd_get", "cmd_set", "cmd_touch", "cmd_meta", "delete_hits", "delete_misses", "incr_hits", "incr_misses"].iter().map(|name| kura_testkit::memcache_stat(port, name)).sum()
}

/// `fstat` right after `open` (524c45b) answers from the inode record the open just wrote,
/// when the file is shared with no other process it knows of: a process that opens, `fstat`s
/// and closes a file sends the pool exactly the requests one that opens and closes it sends.
/// Counted by the kura server's own statistics (`cat` of a small file went from 9 to 6 pool
/// round trips with it).
#[test]
fn fstat_after_open_sends_the_pool_nothing() {
    let env = Env::new();
    let (_server, port) = small_kura_server(&env);
    let run = |script: &str| python_on(&env, port, script);
    run("open('/kura/f', 'w').write('hello')");
    let plain = "import os; fd = os.open('/kura/f', os.O_RDONLY); os.close(fd)";
    let with_fstat = "import os; fd = os.open('/kura/f', os.O_RDONLY); s = os.fstat(fd); assert s.st_size == 5, s; os.close(fd)";
    let requests_of = |script: &str| requests_of(&env, port, script);
    // Each once to settle, then alternated: the fewest of each (a slow machine may pass the
    // millisecond between open and fstat now and then).
    requests_of(plain);
    let (mut plain_min, mut fstat_min) = (u64::MAX, u64::MAX);
    for _ in 0..3 {
        plain_min = plain_min.min(requests_of(plain));
        fstat_min = fstat_min.min(requests_of(with_fstat));
    }
    assert!(plain_min > 0, "opening a kura file asks the pool something");
    assert_eq!(fstat_min, plain_min, "fstat after open sent the pool {} more requests", fstat_min.saturating_sub(plain_min));
}

/// While nothing in the pool changes, a process answers `stat` and path lookups from copies
/// of the records it read (a local kura server's change counter, kura_engine::changes): 1,000
/// more `stat`s of a 3-deep path send the server nothing, and a new process finds the copies
/// the others shared. Counted by the server's own statistics. (Each sent one round trip before: ~80 µs here, against ~8 µs now and ~2 µs on
/// ext4.)
#[test]
fn repeated_stats_send_the_pool_nothing_while_nothing_changes() {
    let env = Env::new();
    let (_server, port) = small_kura_server(&env);
    let run = |script: &str| python_on(&env, port, script);
    run("import os; os.makedirs('/kura/d/e'); open('/kura/d/e/f', 'w').write('hello')");
    let stats = |n: usize| format!("import os\nfor _ in range({n}): assert os.stat('/kura/d/e/f').st_size == 5\nassert not os.path.exists('/kura/d/e/g')");
    let requests_of = |script: &str| requests_of(&env, port, script);
    let (few, many) = (stats(40), stats(1040));
    let (mut few_min, mut many_min) = (u64::MAX, u64::MAX);
    for _ in 0..3 {
        few_min = few_min.min(requests_of(&few));
        many_min = many_min.min(requests_of(&many));
    }
    assert!(few_min > 0, "the first stats ask the pool");
    println!("40 stats: {few_min} requests, 1,040: {many_min}");
    assert_eq!(many_min, few_min, "1,000 more stats sent the pool {} more requests", many_min.saturating_sub(few_min));
    // A new process finds the copies those kept in the host's shared table (kura_fs::copies):
    // it asks the pool only what opening the file system asks, the superblock, the root and
    // the orphan list, in one batch.
    let once = stats(1);
    let alone = (0..3).map(|_| requests_of(&once)).min().unwrap();
    assert!(alone <= 3, "a process walking a path others walked sent {alone} requests");
}

/// Copies are dropped key by key: another process appending to a log and making and removing
/// files in another directory leaves a watcher's copies of the files it stats in place (the
/// server's change log names the keys each change was to, `kura_engine::changes`), and the
/// watcher sees the log's new size at once. A new process stating those files afterwards
/// finds them in the host's shared table, brought forward by the same log. Counted by the
/// kura server's statistics: before the log, the watcher asked the pool again for all 20
/// files and every directory on their paths.
#[test]
fn copies_stay_while_another_process_changes_other_files() {
    let env = Env::new();
    let (_server, port) = small_kura_server(&env);
    let run = |script: &str| python_on(&env, port, script);
    run("import os; os.makedirs('/kura/d'); os.makedirs('/kura/other'); open('/kura/log', 'w')\nfor i in range(20): open(f'/kura/d/f{i}', 'w').write('x')");
    let stat_all = "names = [f'/kura/d/f{i}' for i in range(20)]\nfor _ in range(50):\n    for n in names: assert os.stat(n).st_size == 1\n";
    let watcher = format!("import os, sys\n{stat_all}print('ready', flush=True)\nsys.stdin.readline()\n{stat_all}print(os.stat('/kura/log').st_size, flush=True)\nsys.stdin.readline()");
    let (mut child, mut lines) = python_child_on(&env, port, &watcher);
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    run("import os\nf = open('/kura/log', 'a')\nfor i in range(100):\n    f.write('x'); f.flush()\n    open(f'/kura/other/t{i}', 'w').close(); os.unlink(f'/kura/other/t{i}')");
    let before = server_requests(port);
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "100", "the watcher sees the log's new size");
    let watcher_requests = server_requests(port) - before;
    writeln!(child.stdin.as_mut().unwrap(), "done").unwrap();
    check(&child.wait_with_output().unwrap(), &["watcher"]);
    println!("the watcher's 1,000 stats and the log's stat after the writer: {watcher_requests} requests");
    assert!(watcher_requests <= 3, "the watcher asked the pool {watcher_requests} times after others changed other files");
    let fresh_requests = requests_of(&env, port, &format!("import os\n{stat_all}"));
    println!("a new process stating the 20 files: {fresh_requests} requests");
    assert!(fresh_requests <= 3, "a new process asked the pool {fresh_requests} times for files others had read");
}

/// A file closed in a process stays recorded among its openers until the process's next
/// write-back pass, `sync`, `fork`, `exec` or exit, which leave all such files in one batch
/// (`Fs::release`, `Fs::leave_lingering`): 100 opens, reads and closes of one file send the
/// pool what one does (they sent 2 swaps each before), and the file of another process's
/// unlink in between goes when the holder exits.
#[test]
fn closed_files_are_left_in_one_batch_and_their_unlinks_wait_for_it() {
    let env = Env::new();
    let (_server, port) = small_kura_server(&env);
    let run = |script: &str| python_on(&env, port, script);
    run("open('/kura/f', 'w').write('hello')");
    let reads = |n: usize| format!("import os\nfor _ in range({n}):\n    fd = os.open('/kura/f', os.O_RDONLY); assert os.read(fd, 10) == b'hello'; os.close(fd)");
    let requests_of = |script: &str| requests_of(&env, port, script);
    let one = (0..3).map(|_| requests_of(&reads(1))).min().unwrap();
    let hundred = (0..3).map(|_| requests_of(&reads(100))).min().unwrap();
    println!("1 open, read and close: {one} requests; 100: {hundred}");
    assert!(hundred <= one + 2, "100 opens and closes of one file sent {hundred} requests, one sent {one}");
    let items = || kura_testkit::memcache_stat(port, "curr_items");
    let baseline = items();
    run("open('/kura/g', 'w').write('y' * 300000)");
    let with_g = items();
    assert!(with_g > baseline + 2, "the file's chunks are in the pool ({baseline} -> {with_g})");
    let holder = "import os, sys\nfd = os.open('/kura/g', os.O_RDONLY); assert len(os.read(fd, 300000)) == 300000; os.close(fd)\nprint('closed', flush=True)\nsys.stdin.readline()";
    let (mut child, mut lines) = python_child_on(&env, port, holder);
    assert_eq!(lines.next().unwrap().unwrap(), "closed");
    run("import os; os.unlink('/kura/g'); assert not os.path.exists('/kura/g')");
    writeln!(child.stdin.as_mut().unwrap(), "exit").unwrap();
    check(&child.wait_with_output().unwrap(), &["holder"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while items() != baseline && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(items(), baseline, "the unlinked file's record and chunks are gone once its last holder exited");
}

/// With the embedded pool (`--pool embedded`) the engine lives in the program's process (one
/// at a time): what a program wrote and closed must be there for the next process that opens
/// the store. The exit (and `exec`) makes the engine's writes durable; before, they were in
/// the ended process's memory only, and the next process found no directory or file.
#[test]
fn an_embedded_pool_keeps_what_a_program_wrote_for_the_next_process() {
    let env = Env::new();
    let run = |script: &str| {
        let out = env.command(&["--pool", "embedded"], &["sh", "-c", script]).output().expect("run kura fs run");
        check(&out, &[script]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run("mkdir /kura/d");
    run("echo hello > /kura/d/f");
    run("python3 -c \"open('/kura/d/g', 'w').write('x' * 10000)\"");
    assert_eq!(run("cat /kura/d/f"), "hello\n");
    assert_eq!(run("cat /kura/d/g | wc -c"), "10000\n");
}

/// A process keeping copies of records (see the test above) whose server is killed with
/// `kill -9` and started again on the same store reads afresh: the new server bumps the change
/// count in the same file before it serves, so the copies go, and the change another process
/// makes through the new server shows at once.
#[test]
fn copies_go_when_their_server_is_killed_and_started_again() {
    let env = Env::new();
    let (server, port) = small_kura_server(&env);
    let run = |script: &str| python_on(&env, port, script);
    run("open('/kura/f', 'w').write('first')");
    let watcher = "import os, sys\nfor _ in range(200): os.stat('/kura/f')\nprint('ready', flush=True)\nsys.stdin.readline()\nprint(os.stat('/kura/f').st_size, open('/kura/f').read(), flush=True)";
    let (mut child, mut lines) = python_child_on(&env, port, watcher);
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    drop(server);
    let _server = kura_testkit::ChildGuard::spawn("kura serve again", &mut small_kura_server_command(&env, port)).unwrap();
    kura_testkit::wait_for_tcp(("127.0.0.1", port), Duration::from_secs(60)).unwrap();
    run("open('/kura/f', 'w').write('second!')");
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "7 second!");
    check(&child.wait_with_output().unwrap(), &["watcher"]);
}
