//! The file system's errors, each with the errno POSIX gives it (the preload library and the
//! FUSE adapter both hand [`FsError::errno`] to their callers).

/// One operation's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("invalid argument")]
    Invalid,
    #[error("file name too long")]
    NameTooLong,
    #[error("too many levels of symbolic links")]
    Loop,
    #[error("file too large")]
    TooBig,
    #[error("too many links")]
    TooManyLinks,
    #[error("operation not permitted")]
    Perm,
    #[error("permission denied")]
    Access,
    #[error("device or resource busy")]
    Busy,
    #[error("operation not supported")]
    NotSupported,
    /// No such extended attribute (`ENODATA`).
    #[error("no such attribute")]
    NoAttr,
    /// A result does not fit the caller's buffer, or an attribute name is too long (`ERANGE`).
    #[error("result out of range")]
    Range,
    /// An extended attribute value over [`crate::layout::XATTR_VALUE_BYTES_MAX`] (`E2BIG`).
    #[error("argument list too long")]
    ArgTooBig,
    /// An open file's inode is gone: another process removed the file's last name (this
    /// process's own unlinked open files stay readable until their last close).
    #[error("stale file handle: another process removed the file")]
    Stale,
    /// The pool refused a write because live data fills it.
    #[error("no space left in the pool")]
    NoSpace,
    /// The pool failed, or did not answer within its bounded wait.
    #[error("pool I/O error: {0}")]
    Io(String),
    /// A record in the pool does not decode: the namespace is damaged (or not kura's).
    #[error("corrupt record {key}: {why}")]
    Corrupt { key: String, why: &'static str },
}

impl FsError {
    /// For a file this process has open: its inode being gone means another process removed
    /// the file (`Stale`, as NFS reports it), not that a name is missing.
    pub fn gone_is_stale(self) -> Self {
        if self == FsError::NotFound { FsError::Stale } else { self }
    }

    /// The errno POSIX specifies for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::Invalid => libc::EINVAL,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::Loop => libc::ELOOP,
            FsError::TooBig => libc::EFBIG,
            FsError::TooManyLinks => libc::EMLINK,
            FsError::Perm => libc::EPERM,
            FsError::Access => libc::EACCES,
            FsError::Busy => libc::EBUSY,
            FsError::NotSupported => libc::EOPNOTSUPP,
            FsError::NoAttr => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::ArgTooBig => libc::E2BIG,
            FsError::Stale => libc::ESTALE,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Io(_) | FsError::Corrupt { .. } => libc::EIO,
        }
    }
}

impl From<kura_pool::Error> for FsError {
    fn from(e: kura_pool::Error) -> Self {
        match e {
            kura_pool::Error::Engine(kura_engine::Error::StoreFull { .. }) => FsError::NoSpace,
            kura_pool::Error::Server { ref message, .. } if is_out_of_space(message) => FsError::NoSpace,
            other => FsError::Io(other.to_string()),
        }
    }
}

impl From<kura_engine::Error> for FsError {
    fn from(e: kura_engine::Error) -> Self {
        match e {
            kura_engine::Error::StoreFull { .. } => FsError::NoSpace,
            other => FsError::Io(other.to_string()),
        }
    }
}

/// memcached (and `kura serve --mode store`) answer a write that finds no room with
/// `SERVER_ERROR out of memory`.
pub(crate) fn is_out_of_space(message: &str) -> bool {
    message.contains("out of memory") || message.contains("full")
}

pub type Result<T, E = FsError> = std::result::Result<T, E>;
