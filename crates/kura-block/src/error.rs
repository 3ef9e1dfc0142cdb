//! Errors of the block layer. Each frontend maps them at its edge: an errno for ublk and FUSE,
//! an NBD error value for NBD (the protocol's values are errno numbers too).

use std::io;

/// What went wrong with a volume operation or one block request.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("volume {0:?} does not exist")]
    VolumeNotFound(String),
    #[error("volume {0:?} already exists")]
    VolumeExists(String),
    #[error("volume {0:?} is being deleted (run `kura volume delete {0}` again to finish)")]
    VolumeDeleting(String),
    #[error("invalid volume name {name:?}: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("invalid volume size {size_bytes}: {reason}")]
    BadSize { size_bytes: u64, reason: String },
    /// A volume record in the pool that does not parse or breaks an invariant.
    #[error("corrupt volume record {key}: {reason}")]
    CorruptRecord { key: String, reason: String },
    /// A block value that is not one block long: the pool holds something else under a
    /// block's key.
    #[error("block {lba} of volume {volume_id} is {len_bytes} bytes, not {expected_bytes}")]
    CorruptBlock { volume_id: u64, lba: u64, len_bytes: usize, expected_bytes: usize },
    /// A request that reaches past the end of the volume.
    #[error("request [{offset_bytes}, +{len_bytes}) is past the end of the volume ({size_bytes} bytes)")]
    OutOfRange { offset_bytes: u64, len_bytes: u64, size_bytes: u64 },
    /// A request larger than the frontend's limit, empty, or otherwise malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The store behind the pool is full.
    #[error("no space left in the pool: {0}")]
    NoSpace(String),
    /// A durability barrier failed (shared by every request that waited for it).
    #[error("flush failed: {0}")]
    FlushFailed(String),
    #[error("pool: {0}")]
    Pool(#[from] kura_pool::Error),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
}

impl BlockError {
    /// The errno a block device or file system reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            BlockError::VolumeNotFound(_) => libc::ENOENT,
            BlockError::VolumeExists(_) => libc::EEXIST,
            BlockError::OutOfRange { .. } | BlockError::Invalid(_) | BlockError::BadName { .. } | BlockError::BadSize { .. } => libc::EINVAL,
            BlockError::NoSpace(_) => libc::ENOSPC,
            BlockError::Pool(e) if is_no_space(e) => libc::ENOSPC,
            _ => libc::EIO,
        }
    }

    /// Turns a pool error into a block error, recognising a full store.
    pub fn from_pool(error: kura_pool::Error) -> Self {
        if is_no_space(&error) { BlockError::NoSpace(error.to_string()) } else { BlockError::Pool(error) }
    }
}

/// Whether the pool refused a write because its store is full (the embedded engine's
/// `StoreFull`, a memcached-protocol `SERVER_ERROR out of memory`, Redis' `OOM`).
fn is_no_space(error: &kura_pool::Error) -> bool {
    match error {
        kura_pool::Error::Engine(kura_engine::Error::StoreFull { .. }) => true,
        kura_pool::Error::Server { message, .. } => message.contains("out of memory") || message.starts_with("OOM") || message.contains(" OOM "),
        _ => false,
    }
}

pub type Result<T, E = BlockError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos() {
        assert_eq!(BlockError::VolumeNotFound("a".into()).errno(), libc::ENOENT);
        assert_eq!(BlockError::OutOfRange { offset_bytes: 0, len_bytes: 1, size_bytes: 0 }.errno(), libc::EINVAL);
        assert_eq!(BlockError::CorruptBlock { volume_id: 1, lba: 2, len_bytes: 3, expected_bytes: 4096 }.errno(), libc::EIO);
        let full = kura_pool::Error::Server { node: "n".into(), message: "SERVER_ERROR out of memory storing object".into() };
        assert_eq!(BlockError::from_pool(full).errno(), libc::ENOSPC);
        let down = kura_pool::Error::NodeDown { node: "n".into(), reason: "refused".into() };
        assert_eq!(BlockError::from_pool(down).errno(), libc::EIO);
    }
}
