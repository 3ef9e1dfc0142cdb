//! kura's memcached-compatible server: values on flash as ready responses,
//! hot items in RAM, memcached's text and meta protocol on the wire.
//!
//! # Architecture
//!
//! ```text
//!  acceptor ──► worker 0 … worker t-1   (each: epoll over its sockets + an io_uring read queue)
//!                 │   parse (kura_proto) → exec → Store ─┬─ RAM cache (-m, CLOCK, sharded)
//!                 │                                      └─ kura_engine (flash; split-phase reads)
//!                 └── replies in request order, head + zero-copy body, one writev
//! ```
//!
//! * [`record`]: the on-flash item: a 40-byte prefix (flags, expiry, set
//!   time, CAS override, meta bits) and then the ready `VALUE` response.
//! * [`store`]: memcached's semantics (`do_store_item`, `do_add_delta`,
//!   touch, meta flags, flush horizon) over the engine and the RAM cache;
//!   writes serialise per key on a stripe lock.
//! * [`worker`]: the event loop; GETs that miss RAM go to flash through the
//!   engine's `get_start`/`get_continue`, many in flight per worker, so one
//!   client's read never blocks another client.
//! * [`server`]: threads, connection limit, signals, graceful shutdown.
//!
//! # A 4 KiB GET hit, flash
//!
//! `read(2)` of the request (shared by every request that arrived together),
//! RAM cache probe (miss), engine lookup in RAM (Bloom Filter Map, page
//! index), one `O_DIRECT` read of the record's sectors queued on io_uring and
//! issued by one `io_uring_enter` for all of that loop turn's reads (the
//! device DMAs into the aligned buffer, no CPU copy), the eventfd wakes
//! `epoll_wait`, the completion is reaped from shared memory, the record's
//! checksum is verified, and the ready `VALUE …\r\n<data>\r\n` is handed to
//! `writev(2)` straight from the read buffer (shared by every reply ready in
//! that turn). One CPU copy: user buffer → socket buffer inside `writev`; the
//! RAM cache admission copies the record once more, off the reply path. A RAM
//! hit is the same without the flash read: `writev` straight from the
//! cached record. `gets` adds a generated `VALUE` line with the CAS value in
//! front of the record's data, in the same `writev`.

pub mod cache;
pub mod cli;
pub mod clock;
pub mod config;
pub mod crawler;
pub mod detail;
pub mod exec;
pub mod heap;
pub mod metadump;
pub mod metrics;
pub mod output;
pub mod process;
pub mod record;
pub mod server;
pub mod signals;
pub mod socket;
pub mod stats;
pub mod tls;
pub mod store;
#[cfg(test)]
mod store_model_tests;
pub mod uring;
pub mod watch;
pub mod worker;

pub use cli::ServeArgs;
pub use config::{ProcessConfig, ServerConfig, SyncPolicy};
pub use server::{Server, ServerError, run};
