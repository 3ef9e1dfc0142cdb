//! Opening a pool to keep volumes in.
//!
//! Volumes must never lose a block, so a new embedded store is created in *store* mode (a
//! cache-mode store drops its oldest data when full), and an existing cache-mode store is
//! refused. The engine has no lock of its own, and
//! two processes writing one store file would corrupt it, so an embedded store is locked
//! (`flock`) for as long as the pool is open: a second `kura` on the same file is refused.
//! Kura servers should likewise run `kura serve --mode store`.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use kura_pool::{Backend, Pool, PoolConfig};

use crate::error::{BlockError, Result};

/// The embedded store used when no node is named (the pool's own default).
pub const EMBEDDED_PATH_DEFAULT: &str = "kura-data/pool.kura";

/// An open pool, and the lock of its embedded store.
pub struct PoolHandle {
    pub pool: Pool,
    _lock: Option<File>,
    /// The embedded store's file, if that is what the pool is.
    pub embedded_path: Option<PathBuf>,
}

/// Opens `config` for volumes (see the module documentation).
pub fn open_pool(mut config: PoolConfig) -> Result<PoolHandle> {
    if config.nodes.is_empty() {
        let default = PoolConfig::embedded(Path::new(EMBEDDED_PATH_DEFAULT), kura_pool::parse_size("1G").expect("a size"));
        config.nodes = default.nodes;
    }
    let embedded = config.nodes.iter().find(|n| n.backend == Backend::Embedded).map(|n| PathBuf::from(&n.addrs[0]));
    let lock = match &embedded {
        Some(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
            lock_exclusive(&file, path)?;
            // New stores are made in store mode; an existing cache-mode store is refused.
            config.engine.mode = Some(kura_engine::Mode::Store);
            Some(file)
        }
        None => None,
    };
    let pool = Pool::open(config).map_err(BlockError::from_pool)?;
    Ok(PoolHandle { pool, _lock: lock, embedded_path: embedded })
}

fn lock_exclusive(file: &File, path: &Path) -> Result<()> {
    // SAFETY: flock(2) on a descriptor we own; it touches no memory of ours.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(BlockError::Invalid(format!(
            "{} is in use by another kura process (an embedded store serves one process; stop the other one, or serve the store with `kura serve` and use kura:// URLs)",
            path.display()
        )));
    }
    Err(e.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_embedded_store_is_created_in_store_mode_and_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/pool.kura");
        let config = PoolConfig::embedded(&path, 256 << 20);
        let handle = open_pool(config.clone()).unwrap();
        assert_eq!(handle.pool.engine().unwrap().superblock().mode, kura_engine::Mode::Store);
        let second = open_pool(config.clone()).err().expect("a second open is refused");
        assert!(second.to_string().contains("in use by another kura process"), "{second}");
        drop(handle);
        open_pool(config).unwrap();
    }
}
