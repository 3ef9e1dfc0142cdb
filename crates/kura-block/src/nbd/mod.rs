//! NBD: the protocol ([`proto`], pure) and the server ([`server`]).

pub mod proto;
pub mod server;
pub mod tls;

pub use server::{BLOCK_STATUS_BYTES_MAX, NbdConfig, NbdServer, NbdStats, PORT_DEFAULT};
pub use tls::{NbdTls, TlsError};
