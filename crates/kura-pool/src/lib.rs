//! kura's pool client: one interface — get, multi-get, an existence probe that sends no value,
//! set, delete and a durability barrier (`flush`) — over an embedded engine, kura servers,
//! stock memcached, redis-server/Valkey and Redis Cluster (paper 000's *KVClient*).
//!
//! ```no_run
//! use kura_pool::{Outcome, Pool, PoolConfig, block_key};
//!
//! let pool = Pool::open(PoolConfig::from_urls(&["kura://10.0.0.1:11211", "kura://10.0.0.2:11211"])?)?;
//! let mut ctx = pool.context()?; // one per thread: its own connection to every node
//! for lba in 0..32 {
//!     ctx.submit_get(&block_key(1, lba), lba)?; // 32 requests in flight, one send per node
//! }
//! while ctx.in_flight() > 0 {
//!     ctx.poll(None, &mut |c| match c.result {
//!         Ok(Outcome::Value(block)) => { /* copy `block` to where LBA `c.token` goes */ }
//!         Ok(_) => { /* never written: zeros */ }
//!         Err(e) => eprintln!("LBA {}: {e}", c.token),
//!     })?;
//! }
//! ctx.set(&block_key(1, 7), &[0u8; 4096])?;
//! ctx.flush()?; // every write acknowledged before it is now durable on its node
//! # Ok::<(), kura_pool::Error>(())
//! ```
//!
//! # Architecture
//!
//! * [`Pool`]: the immutable part, shared by threads: nodes, the consistent-hash [`ring`],
//!   limits, the embedded engine. Make one [`Context`] per thread (per block-device queue).
//! * [`Context`]: its own connection to each node, buffers and completion queue; no lock is
//!   shared with other contexts on the request path. Requests are encoded into their node's
//!   send buffer at submit and leave together in one `write` at the next [`Context::poll`];
//!   replies are parsed straight from one `read` and handed to the callback borrowed (values
//!   are copied once, by the caller, to where they belong). [`IoStats`] counts requests per
//!   syscall.
//! * Backends: [`Backend`]. memcached-protocol nodes use meta commands when the server has
//!   them (`mn` at connect), text otherwise; Redis speaks RESP2 with a lean pipeline of our
//!   own (a client crate's connection would hide the syscall batching this crate exists for).
//! * Placement: keys go to nodes by consistent hashing with weights; a Redis Cluster is one
//!   member of the ring and routes by slot inside (MOVED/ASK, refreshes, fail-over).

mod cluster;
mod config;
mod conn;
mod embedded;
mod error;
mod instance;
pub mod fd;
mod key;
mod net;
mod pool;
pub mod proto;
pub mod ring;
mod stats;
pub mod stream;

pub use cluster::slot as cluster_slot;
pub use config::{Backend, Credentials, FlushMode, NodeSpec, PoolConfig, parse_size, redact_url};
pub use conn::{NEEDS_CREDENTIALS, authenticate, tls_failure};
pub use error::{Error, Result};
pub use key::{BLOCK_KEY_BYTES, KEY_SIZE_BYTES_MAX, block_key, is_zeros};
pub use pool::{Completion, Context, Outcome, Pool, Waker};
pub use stats::IoStats;
