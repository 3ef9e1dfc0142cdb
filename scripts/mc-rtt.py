#!/usr/bin/env python3
"""Round trips to a memcached-protocol server (kura serve, memcached), one request at a time,
from a client that sleeps for each reply or one that keeps looking for it: the figures of the
README's note on `kura serve --poll-spin-us`.

    scripts/mc-rtt.py PORT                 get, set, version, gets+cas: median and p90, µs
    scripts/mc-rtt.py PORT --spin          version, the client looking for replies in a loop
    scripts/mc-rtt.py PORT --load N        stores N items of 4 KiB (k0 … kN-1), noreply
    scripts/mc-rtt.py PORT --flash N       3,000 gets of random keys among N loaded items
                                           (more than the server's RAM cache holds: most
                                           are read from flash): median, p90, p99, µs
"""
import random
import socket
import sys
import time

REQUESTS = 3000
VALUE_BYTES = 4096


def connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def summary(name, times, percentiles=(50, 90)):
    times.sort()
    parts = [f"p{p} {times[min(len(times) - 1, len(times) * p // 100)] * 1e6:.1f}" for p in percentiles]
    print(f"{name}: " + ", ".join(parts) + " us")


def timed(fn):
    times = []
    for i in range(REQUESTS):
        started = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started)
    return times


def sleeping(port):
    s = connect(port)
    f = s.makefile("rb")

    def ask(request, lines=1):
        s.sendall(request)
        return [f.readline() for _ in range(lines)]

    ask(b"set k 0 0 3\r\nabc\r\n")
    summary("get", timed(lambda i: ask(b"get k\r\n", 3)))
    summary("set", timed(lambda i: ask(b"set k%d 0 0 3\r\nabc\r\n" % (i % 50))))
    summary("version", timed(lambda i: ask(b"version\r\n")))

    def gets_cas(i):
        token = ask(b"gets k\r\n", 3)[0].split()[4]
        ask(b"cas k 0 0 3 " + token + b"\r\nxyz\r\n")

    summary("gets+cas", timed(gets_cas))


def spinning(port):
    s = connect(port)
    s.setblocking(False)

    def ask(request):
        s.sendall(request)
        while True:
            try:
                reply = s.recv(4096)
                if reply:
                    return reply
                raise SystemExit("the server closed the connection")
            except BlockingIOError:
                pass

    summary("version, spinning client", timed(lambda i: ask(b"version\r\n")))


def load(port, items):
    s = connect(port)
    value = b"x" * VALUE_BYTES
    batch = []
    for i in range(items):
        batch.append(b"set k%d 0 0 %d noreply\r\n%s\r\n" % (i, VALUE_BYTES, value))
        if len(batch) == 256:
            s.sendall(b"".join(batch))
            batch = []
    s.sendall(b"".join(batch) + b"version\r\n")
    s.makefile("rb").readline()
    print(f"loaded {items} items of {VALUE_BYTES} bytes")


def flash(port, items):
    s = connect(port)
    f = s.makefile("rb")

    def get(i):
        s.sendall(b"get k%d\r\n" % random.randrange(items))
        if not f.readline().startswith(b"VALUE"):
            raise SystemExit("a key is missing: load the items first (--load)")
        f.read(VALUE_BYTES + 2)
        f.readline()

    summary("get 4 KiB, random key", timed(get), (50, 90, 99))


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__)
    port = int(args[0])
    if args[1:2] == ["--spin"]:
        spinning(port)
    elif args[1:2] == ["--load"] and len(args) == 3:
        load(port, int(args[2]))
    elif args[1:2] == ["--flash"] and len(args) == 3:
        flash(port, int(args[2]))
    elif len(args) == 1:
        sleeping(port)
    else:
        raise SystemExit(__doc__)


main()
