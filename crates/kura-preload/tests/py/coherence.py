"""A watcher process looks at a directory without pause while another process changes it;
after each change (the changer says when it is done), what the watcher sees must be the
change. Prints what the watcher saw after each step: the same on the kernel and under kura.

usage: coherence.py DIR ROUNDS        (the changer; starts the watcher)
       coherence.py DIR watch         (the watcher)
"""
import os
import select
import subprocess
import sys
import time

d = sys.argv[1]


def look():
    seen = []
    for name in sorted(os.listdir(d)):
        try:
            st = os.lstat(os.path.join(d, name))
        except FileNotFoundError:
            seen.append(name + ":gone")
            continue
        kind = "d" if (st.st_mode & 0o170000) == 0o040000 else "l" if (st.st_mode & 0o170000) == 0o120000 else "f"
        if kind == "f":
            seen.append(f"{name}:{kind}{st.st_mode & 0o7777:o}/{st.st_size}/{st.st_nlink}")
        else:
            seen.append(f"{name}:{kind}{st.st_mode & 0o7777:o}")
    for probe in ("a", "b", "s/x", "l", "s/y/z"):
        try:
            st = os.stat(os.path.join(d, probe))
            seen.append(f"{probe}={st.st_mode & 0o7777:o}/{st.st_size}")
        except OSError as e:
            seen.append(f"{probe}!{e.errno}")
    try:
        with open(os.path.join(d, "a"), "rb") as f:
            seen.append("a:" + repr(f.read()))
    except OSError as e:
        seen.append(f"a!{e.errno}")
    return " ".join(seen)


if sys.argv[2] == "watch":
    looks = 0
    while True:
        # Look while the changer changes (copies are made and dropped meanwhile) ...
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if not ready:
            look()
            looks += 1
            continue
        step = sys.stdin.readline().strip()
        if not step:
            print("looks", looks, file=sys.stderr)
            break
        # ... and, once it says a step is done, the step must show.
        first = look()
        again = look()  # from copies, where kura keeps them
        print(step, first if again == first else f"{first} BUT THEN {again}", flush=True)
    sys.exit(0)

rounds = int(sys.argv[2])
watcher = subprocess.Popen([sys.executable, __file__, d, "watch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def step(name):
    watcher.stdin.write(name + "\n")
    watcher.stdin.flush()
    print(watcher.stdout.readline(), end="")
    time.sleep(0.02)  # the watcher looks on, with copies of what it read


def write(path, data, mode="w"):
    with open(os.path.join(d, path), mode) as f:
        f.write(data)


for r in range(rounds):
    write("a", f"round {r}")
    step("create")
    os.chmod(os.path.join(d, "a"), 0o600)
    step("chmod")
    write("a", "+more", "a")
    step("append")
    os.link(os.path.join(d, "a"), os.path.join(d, "h"))
    step("link")
    os.rename(os.path.join(d, "a"), os.path.join(d, "b"))
    step("rename")
    os.mkdir(os.path.join(d, "s"))
    write("s/x", "x" * r)
    step("mkdir")
    os.symlink("b", os.path.join(d, "l"))
    step("symlink")
    os.unlink(os.path.join(d, "b"))
    step("unlink")
    os.rename(os.path.join(d, "s/x"), os.path.join(d, "a"))
    step("rename-over-dirs")
    os.truncate(os.path.join(d, "a"), 2)
    step("truncate")
    os.makedirs(os.path.join(d, "s/y"))
    write("s/y/z", "zz")
    os.chmod(os.path.join(d, "s"), 0o700)
    step("deep")
    for p in ("s/y/z", "h", "l", "a"):
        os.unlink(os.path.join(d, p))
    os.rmdir(os.path.join(d, "s/y"))
    os.rmdir(os.path.join(d, "s"))
    step("clean")
watcher.stdin.close()
watcher.wait()
print("watcher", watcher.returncode)
