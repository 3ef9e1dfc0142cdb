//! Errors the pool client reports. Bad input is refused at submit time; what a node did (or
//! failed to do) arrives with the request's completion. Broken invariants panic.

/// One request's failure, or a refusal at submit time.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("key is empty")]
    KeyEmpty,
    #[error("key is {len} bytes; the limit is {max}")]
    KeyTooLong { len: usize, max: usize },
    /// The node speaks only memcached's text protocol, whose keys cannot hold spaces or control
    /// characters (meta-protocol servers take any key, sent base64).
    #[error("key {key:?} cannot be sent to {node}: {reason}")]
    KeyNotRepresentable { node: String, key: String, reason: &'static str },
    #[error("value is {len} bytes; the limit is {max}")]
    ValueTooLarge { len: usize, max: usize },
    /// The context already has its limit of requests in flight: poll first.
    #[error("{max} requests already in flight on this context")]
    QueueFull { max: usize },
    /// The node refused the connection or is in back-off after a failure; nothing was sent.
    #[error("node {node} is down: {reason}")]
    NodeDown { node: String, reason: String },
    /// The connection broke with this request in flight: it may or may not have been applied.
    #[error("connection to {node} lost with the request in flight: {reason}")]
    ConnectionLost { node: String, reason: String },
    /// A flush that found `node` restarted since this context's last flush (a new instance of
    /// the server; or a broken connection to a server that does not tell its instance): it may
    /// have lost writes it had acknowledged, which no flush can bring back. Reported once per
    /// context (as `fsync` reports a lost write-back once).
    #[error("writes acknowledged before this flush may be lost: {node} restarted (or a connection to it broke) since the last flush")]
    WritesMayBeLost { node: String },
    #[error("no answer from {node} within {timeout_ms} ms")]
    Timeout { node: String, timeout_ms: u64 },
    /// The node answered something that is not the protocol (the connection is closed).
    #[error("protocol error from {node}: {detail}")]
    Protocol { node: String, detail: String },
    /// The node answered with an error (`SERVER_ERROR`, `CLIENT_ERROR`, `-ERR`, ...).
    #[error("{node} answered: {message}")]
    Server { node: String, message: String },
    /// The node cannot make writes durable on demand.
    #[error("{node} cannot make writes durable on demand: {reason}")]
    FlushUnsupported { node: String, reason: String },
    /// `WAIT` returned before enough replicas acknowledged.
    #[error("{node}: only {acked} of {wanted} replicas acknowledged the writes before the flush")]
    FlushIncomplete { node: String, acked: i64, wanted: u32 },
    /// Redis Cluster could not route the request (no master for the slot, cluster down,
    /// too many redirections).
    #[error("redis cluster: {detail}")]
    Cluster { detail: String },
    #[error("too many connections to {node}: at most {max}")]
    ConnectionLimit { node: String, max: usize },
    #[error("invalid pool configuration: {0}")]
    Config(String),
    #[error("engine: {0}")]
    Engine(#[from] kura_engine::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether the request may succeed if sent again later (the node was down, slow, or lost
    /// the connection); bad input and refusals by the server are not retryable.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::NodeDown { .. } | Error::ConnectionLost { .. } | Error::Timeout { .. } | Error::Cluster { .. })
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
