//! Errors the engine reports. Bad input and bad media are `Err`; broken invariants panic.

use std::io;

use crate::format::FormatError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("key is empty")]
    KeyEmpty,
    #[error("key is {len} bytes; the limit is {max}")]
    KeyTooLong { len: usize, max: usize },
    #[error("value is {len} bytes; the limit is {max}")]
    ValueTooLarge { len: usize, max: usize },
    #[error("store is full: live data fills the device ({live_bytes} live bytes in {capacity_bytes} bytes of blocks)")]
    StoreFull { live_bytes: u64, capacity_bytes: u64 },
    #[error("{path} is not a kura store (no valid superblock)")]
    NotAKuraStore { path: String },
    #[error("corrupt store: {what} at byte {offset_bytes}: {source}")]
    Corrupt { what: &'static str, offset_bytes: u64, source: FormatError },
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("I/O error during {op} at byte {offset_bytes}: {source}")]
    Io { op: &'static str, offset_bytes: u64, source: io::Error },
    #[error("the engine refuses writes after an earlier failure: {0}")]
    Failed(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

