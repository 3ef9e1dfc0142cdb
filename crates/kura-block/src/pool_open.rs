//! Opening a pool to keep volumes in.
//!
//! Volumes must never lose a block, so a new embedded store is created in *store* mode (a
//! cache-mode store drops its oldest data when full), and an existing cache-mode store is
//! refused. Two processes writing one store file would corrupt it: the engine locks its store
//! (`flock`) for as long as it is open, so a second `kura` on the same file is refused.
//! Kura servers should likewise run `kura serve --mode store`.

use std::path::{Path, PathBuf};

use kura_pool::{Backend, Pool, PoolConfig};

use crate::error::{BlockError, Result};

/// The embedded store used when no node is named (the pool's own default).
pub const EMBEDDED_PATH_DEFAULT: &str = "kura-data/pool.kura";

/// An open pool.
pub struct PoolHandle {
    pub pool: Pool,
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
    if let Some(path) = &embedded {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        // New stores are made in store mode; an existing cache-mode store is refused.
        config.engine.mode = Some(kura_engine::Mode::Store);
    }
    let pool = Pool::open(config).map_err(BlockError::from_pool)?;
    Ok(PoolHandle { pool, embedded_path: embedded })
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
        assert!(second.to_string().contains("is in use by another open of it"), "{second}");
        drop(handle);
        open_pool(config).unwrap();
    }
}
