//! Per-context I/O counters: how many requests each send and each receive carried.

/// Counters of one context (no atomics: a context belongs to one thread).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoStats {
    /// Requests whose last byte left in a send syscall (flush parts and `ASKING` included).
    pub requests_sent: u64,
    /// `write(2)` calls on sockets (or, embedded: `io_uring_enter` submissions of reads).
    pub send_syscalls: u64,
    /// Replies parsed (embedded: reads completed).
    pub replies_received: u64,
    /// `read(2)` calls on sockets, including ones that found nothing (embedded: waits for
    /// completions).
    pub recv_syscalls: u64,
    /// `epoll_wait` calls.
    pub polls: u64,
    /// Connections opened (first connects and reconnects).
    pub connects: u64,
    /// Connections that broke, timed out or were closed for a protocol error.
    pub disconnects: u64,
    /// Redis Cluster: requests redirected (`MOVED`/`ASK`) or retried through a fail-over.
    pub redirects: u64,
    /// Redis Cluster: slot-map refreshes.
    pub topology_refreshes: u64,
}

impl IoStats {
    pub fn requests_per_send(&self) -> f64 {
        ratio(self.requests_sent, self.send_syscalls)
    }

    pub fn replies_per_recv(&self) -> f64 {
        ratio(self.replies_received, self.recv_syscalls)
    }

    /// Requests and replies per send or receive syscall: each request counts once on the way
    /// out and once on the way back.
    pub fn requests_per_syscall(&self) -> f64 {
        ratio(self.requests_sent + self.replies_received, self.send_syscalls + self.recv_syscalls)
    }

    /// The difference `self - earlier` (for a measurement window).
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            requests_sent: self.requests_sent - earlier.requests_sent,
            send_syscalls: self.send_syscalls - earlier.send_syscalls,
            replies_received: self.replies_received - earlier.replies_received,
            recv_syscalls: self.recv_syscalls - earlier.recv_syscalls,
            polls: self.polls - earlier.polls,
            connects: self.connects - earlier.connects,
            disconnects: self.disconnects - earlier.disconnects,
            redirects: self.redirects - earlier.redirects,
            topology_refreshes: self.topology_refreshes - earlier.topology_refreshes,
        }
    }

    /// Adds another context's counters.
    pub fn add(&mut self, other: &IoStats) {
        self.requests_sent += other.requests_sent;
        self.send_syscalls += other.send_syscalls;
        self.replies_received += other.replies_received;
        self.recv_syscalls += other.recv_syscalls;
        self.polls += other.polls;
        self.connects += other.connects;
        self.disconnects += other.disconnects;
        self.redirects += other.redirects;
        self.topology_refreshes += other.topology_refreshes;
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}
