//! Volumes: their records in the pool, and create / list / resize / delete.
//!
//! A volume's metadata is one record in the pool, `kura.vol.<name>` (JSON, so a person can
//! read it with any memcached or Redis client); the directory `kura.volumes` lists the names
//! and hands out volume ids, never reusing one. Block `lba` of the volume with id `id` is the
//! value under [`kura_pool::block_key`]`(id, lba)`; a block that is not there reads as zeros
//! (thin provisioning).
//!
//! Crash safety without transactions: a shrink records the smaller size first and deletes the
//! blocks past it afterwards; `extent_bytes` remembers how far blocks may still exist, so a
//! later grow deletes what a crash left behind before exposing that range. A delete marks the
//! record `deleting` first, deletes every block, then the record; running it again finishes an
//! interrupted one.
//!
//! The pool has no compare-and-swap, so two processes creating or deleting volumes *at the
//! same moment* can lose one directory update; serving I/O needs no coordination.

use std::time::{SystemTime, UNIX_EPOCH};

use kura_pool::{Context, block_key};
use serde::{Deserialize, Serialize};

use crate::error::{BlockError, Result};
use crate::layout::{BLOCK_SHIFT, BLOCK_SIZE_BYTES};

/// Format of the records below; a record of another format is refused.
pub const RECORD_FORMAT: u32 = 1;
pub const DIRECTORY_KEY: &str = "kura.volumes";
pub const RECORD_KEY_PREFIX: &str = "kura.vol.";
pub const NAME_LEN_MAX: usize = 64;
/// Volumes in one pool, at most (bounds the directory record to well under 1 MiB).
pub const VOLUMES_MAX: usize = 4096;
/// Largest volume: 2^50 bytes (1 PiB), 2^38 blocks.
pub const VOLUME_SIZE_BYTES_MAX: u64 = 1 << 50;
/// Deletes in flight while removing a range of blocks.
const DELETE_WINDOW: usize = 512;
/// Progress is reported every this many blocks.
const PROGRESS_EVERY_BLOCKS: u64 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    Active,
    /// `kura volume delete` started and has not finished.
    Deleting,
}

/// A volume's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeMeta {
    pub format: u32,
    pub name: String,
    /// Part of every block key; never reused.
    pub id: u64,
    pub size_bytes: u64,
    pub block_size_bytes: u64,
    pub created_unix_s: u64,
    /// Blocks may exist below this offset (at least `size_bytes`; more after a shrink that
    /// has not finished deleting).
    pub extent_bytes: u64,
    pub state: VolumeState,
}

impl VolumeMeta {
    pub fn blocks(&self) -> u64 {
        self.size_bytes >> BLOCK_SHIFT
    }

    fn check(&self, key: &str) -> Result<()> {
        let bad = |reason: String| Err(BlockError::CorruptRecord { key: key.to_owned(), reason });
        if self.format != RECORD_FORMAT {
            return bad(format!("format {} (this kura reads {RECORD_FORMAT})", self.format));
        }
        if self.block_size_bytes != BLOCK_SIZE_BYTES {
            return bad(format!("block size {} (this kura uses {BLOCK_SIZE_BYTES})", self.block_size_bytes));
        }
        if check_size(self.size_bytes).is_err() || self.extent_bytes < self.size_bytes || self.extent_bytes > VOLUME_SIZE_BYTES_MAX {
            return bad(format!("size {} / extent {}", self.size_bytes, self.extent_bytes));
        }
        if self.id == 0 || record_key(&self.name) != key {
            return bad(format!("id {} name {:?}", self.id, self.name));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Directory {
    format: u32,
    /// The next volume's id (ids start at 1).
    next_id: u64,
    names: Vec<String>,
}

pub fn record_key(name: &str) -> String {
    format!("{RECORD_KEY_PREFIX}{name}")
}

/// Names are 1–64 characters of `A-Z a-z 0-9 . _ -`, not starting with `.` or `-`: safe as a
/// file name (FUSE export), an NBD export name and in every backend's keys.
pub fn check_name(name: &str) -> Result<()> {
    let bad = |reason| Err(BlockError::BadName { name: name.to_owned(), reason });
    if name.is_empty() || name.len() > NAME_LEN_MAX {
        return bad("must be 1 to 64 characters");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        return bad("only letters, digits, '.', '_' and '-' are allowed");
    }
    if name.starts_with(['.', '-']) {
        return bad("must not start with '.' or '-'");
    }
    Ok(())
}

/// Sizes are whole blocks, above zero, at most [`VOLUME_SIZE_BYTES_MAX`].
pub fn check_size(size_bytes: u64) -> Result<()> {
    let bad = |reason: String| Err(BlockError::BadSize { size_bytes, reason });
    if size_bytes == 0 {
        return bad("must be above 0".into());
    }
    if !size_bytes.is_multiple_of(BLOCK_SIZE_BYTES) {
        return bad(format!("must be a multiple of the block size ({BLOCK_SIZE_BYTES} bytes)"));
    }
    if size_bytes > VOLUME_SIZE_BYTES_MAX {
        return bad(format!("the largest volume is {VOLUME_SIZE_BYTES_MAX} bytes"));
    }
    Ok(())
}

fn now_unix_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Progress of a long operation: (blocks done, blocks in all).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// Volume management over one pool context (the blocking helpers: nothing else may be in
/// flight on it).
pub struct Volumes<'a> {
    ctx: &'a mut Context,
}

impl<'a> Volumes<'a> {
    pub fn new(ctx: &'a mut Context) -> Self {
        Self { ctx }
    }

    fn read_directory(&mut self) -> Result<Directory> {
        match self.ctx.get(DIRECTORY_KEY.as_bytes()).map_err(BlockError::from_pool)? {
            None => Ok(Directory { format: RECORD_FORMAT, next_id: 1, names: Vec::new() }),
            Some(bytes) => {
                let corrupt = |reason: String| BlockError::CorruptRecord { key: DIRECTORY_KEY.into(), reason };
                let dir: Directory = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
                if dir.format != RECORD_FORMAT || dir.next_id == 0 || dir.names.len() > VOLUMES_MAX {
                    return Err(corrupt(format!("format {} next_id {} {} names", dir.format, dir.next_id, dir.names.len())));
                }
                Ok(dir)
            }
        }
    }

    fn write_directory(&mut self, dir: &Directory) -> Result<()> {
        let bytes = serde_json::to_vec(dir).expect("a directory serialises");
        self.ctx.set(DIRECTORY_KEY.as_bytes(), &bytes).map_err(BlockError::from_pool)
    }

    fn write_record(&mut self, meta: &VolumeMeta) -> Result<()> {
        meta.check(&record_key(&meta.name))?;
        let bytes = serde_json::to_vec(meta).expect("a record serialises");
        self.ctx.set(record_key(&meta.name).as_bytes(), &bytes).map_err(BlockError::from_pool)
    }

    /// The record of `name`, whatever its state.
    pub fn lookup(&mut self, name: &str) -> Result<VolumeMeta> {
        check_name(name)?;
        let key = record_key(name);
        let bytes = self.ctx.get(key.as_bytes()).map_err(BlockError::from_pool)?.ok_or_else(|| BlockError::VolumeNotFound(name.to_owned()))?;
        let meta: VolumeMeta = serde_json::from_slice(&bytes).map_err(|e| BlockError::CorruptRecord { key: key.clone(), reason: e.to_string() })?;
        meta.check(&key)?;
        Ok(meta)
    }

    /// An active volume (one being deleted is refused).
    pub fn open(&mut self, name: &str) -> Result<VolumeMeta> {
        let meta = self.lookup(name)?;
        if meta.state == VolumeState::Deleting {
            return Err(BlockError::VolumeDeleting(name.to_owned()));
        }
        Ok(meta)
    }

    /// Every volume, in name order (records that are missing or unreadable are skipped with
    /// a warning).
    pub fn list(&mut self) -> Result<Vec<VolumeMeta>> {
        let mut names = self.read_directory()?.names;
        names.sort();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            match self.lookup(&name) {
                Ok(meta) => out.push(meta),
                Err(e) => tracing::warn!(volume = name, error = %e, "listed volume has no readable record"),
            }
        }
        Ok(out)
    }

    /// Creates an empty (all-zero) volume. Its blocks take space only once written.
    pub fn create(&mut self, name: &str, size_bytes: u64) -> Result<VolumeMeta> {
        check_name(name)?;
        check_size(size_bytes)?;
        match self.lookup(name) {
            Ok(_) => return Err(BlockError::VolumeExists(name.to_owned())),
            Err(BlockError::VolumeNotFound(_)) => {}
            Err(e) => return Err(e),
        }
        let mut dir = self.read_directory()?;
        if dir.names.len() >= VOLUMES_MAX && !dir.names.iter().any(|n| n == name) {
            return Err(BlockError::Invalid(format!("the pool already has {VOLUMES_MAX} volumes")));
        }
        let id = dir.next_id;
        dir.next_id += 1;
        if !dir.names.iter().any(|n| n == name) {
            dir.names.push(name.to_owned());
        }
        // The id is taken before the record exists: a crash in between wastes an id, never
        // hands one out twice.
        self.write_directory(&dir)?;
        let meta = VolumeMeta {
            format: RECORD_FORMAT,
            name: name.to_owned(),
            id,
            size_bytes,
            block_size_bytes: BLOCK_SIZE_BYTES,
            created_unix_s: now_unix_s(),
            extent_bytes: size_bytes,
            state: VolumeState::Active,
        };
        self.write_record(&meta)?;
        self.ctx.flush().map_err(BlockError::from_pool)?;
        Ok(meta)
    }

    /// Changes a volume's size. Shrinking deletes the blocks past the new end; growing
    /// exposes zeros (blocks a crashed shrink left behind are deleted first).
    pub fn resize(&mut self, name: &str, size_bytes: u64, progress: Progress<'_>) -> Result<VolumeMeta> {
        check_size(size_bytes)?;
        let mut meta = self.open(name)?;
        let block = |bytes: u64| bytes >> BLOCK_SHIFT;
        if size_bytes < meta.size_bytes {
            meta.size_bytes = size_bytes;
            self.write_record(&meta)?;
            self.ctx.flush().map_err(BlockError::from_pool)?;
        } else if size_bytes > meta.size_bytes && meta.extent_bytes > meta.size_bytes {
            let stale_end = meta.extent_bytes.min(size_bytes);
            delete_blocks(self.ctx, meta.id, block(meta.size_bytes)..block(stale_end), progress)?;
            self.ctx.flush().map_err(BlockError::from_pool)?;
        }
        if meta.extent_bytes > size_bytes {
            delete_blocks(self.ctx, meta.id, block(size_bytes)..block(meta.extent_bytes), progress)?;
            self.ctx.flush().map_err(BlockError::from_pool)?;
        }
        meta.size_bytes = size_bytes;
        meta.extent_bytes = size_bytes;
        self.write_record(&meta)?;
        self.ctx.flush().map_err(BlockError::from_pool)?;
        Ok(meta)
    }

    /// Deletes a volume and every block of it (space comes back); finishes an interrupted
    /// delete too.
    pub fn delete(&mut self, name: &str, progress: Progress<'_>) -> Result<()> {
        let mut meta = self.lookup(name)?;
        if meta.state != VolumeState::Deleting {
            meta.state = VolumeState::Deleting;
            self.write_record(&meta)?;
            self.ctx.flush().map_err(BlockError::from_pool)?;
        }
        delete_blocks(self.ctx, meta.id, 0..meta.extent_bytes >> BLOCK_SHIFT, progress)?;
        self.ctx.delete(record_key(name).as_bytes()).map_err(BlockError::from_pool)?;
        let mut dir = self.read_directory()?;
        dir.names.retain(|n| n != name);
        self.write_directory(&dir)?;
        self.ctx.flush().map_err(BlockError::from_pool)?;
        Ok(())
    }
}

/// Deletes blocks `lbas` of volume `volume_id`, `DELETE_WINDOW` in flight.
pub fn delete_blocks(ctx: &mut Context, volume_id: u64, lbas: std::ops::Range<u64>, progress: Progress<'_>) -> Result<()> {
    let total = lbas.end.saturating_sub(lbas.start);
    let mut next = lbas.start;
    let mut done = 0u64;
    let mut first_error: Option<kura_pool::Error> = None;
    while done < total {
        while next < lbas.end && ctx.in_flight() < DELETE_WINDOW && first_error.is_none() {
            ctx.submit_delete(&block_key(volume_id, next), next).map_err(BlockError::from_pool)?;
            next += 1;
        }
        if ctx.in_flight() == 0 {
            break;
        }
        let before = done;
        ctx.poll(None, &mut |c| {
            done += 1;
            if let Err(e) = c.result {
                first_error.get_or_insert(e);
            }
        })
        .map_err(BlockError::from_pool)?;
        if before / PROGRESS_EVERY_BLOCKS != done / PROGRESS_EVERY_BLOCKS || done == total {
            progress(done, total);
        }
    }
    match first_error {
        Some(e) => Err(BlockError::from_pool(e)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["a", "disk0", "vm-1.img", "A_b", &"x".repeat(64)] {
            check_name(good).unwrap();
        }
        for bad in ["", ".hidden", "-x", "a b", "a/b", "é", &"x".repeat(65), "a\0"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes() {
        check_size(4096).unwrap();
        check_size(VOLUME_SIZE_BYTES_MAX).unwrap();
        for bad in [0, 512, 4097, VOLUME_SIZE_BYTES_MAX + 4096] {
            assert!(check_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn records_round_trip_and_are_checked() {
        let meta = VolumeMeta {
            format: RECORD_FORMAT,
            name: "disk".into(),
            id: 3,
            size_bytes: 1 << 30,
            block_size_bytes: 4096,
            created_unix_s: 1,
            extent_bytes: 1 << 30,
            state: VolumeState::Active,
        };
        let json = serde_json::to_string(&meta).unwrap();
        assert!(json.contains("\"state\":\"active\""), "{json}");
        let back: VolumeMeta = serde_json::from_str(&json).unwrap();
        assert_eq!(back, meta);
        back.check("kura.vol.disk").unwrap();
        assert!(back.check("kura.vol.other").is_err());
        let mut bad = meta.clone();
        bad.block_size_bytes = 512;
        assert!(bad.check("kura.vol.disk").is_err());
        let mut bad = meta.clone();
        bad.extent_bytes = 0;
        assert!(bad.check("kura.vol.disk").is_err());
        assert!(serde_json::from_str::<VolumeMeta>(&json.replace("\"state\"", "\"bogus\":1,\"state\"")).is_err());
    }
}
