//! kura's flash key-value engine.
//!
//! Keys and values live in fixed-size blocks of pages on a file or raw device. A tiny RAM
//! index finds them: a bit-sliced Bloom Filter Map names the candidate blocks of a key, and a
//! per-block page index (Elias–Fano coded hash fingerprints) names the one page or slot to
//! read. See `format` for the on-disk layout and `engine` for durability and recovery.

pub mod aligned;
pub mod block;
pub mod bloom;
pub mod buffer;
pub mod changes;
pub mod config;
pub mod device;
pub mod ef;
pub mod engine;
pub mod fd;
pub mod error;
pub mod format;
pub mod hash;
pub mod journal;
pub mod mapped;
pub mod spin;
pub mod stats;

pub use aligned::{AlignedBuf, ReadBuffers};
pub use config::EngineConfig;
pub use device::{Device, FaultMode, FileDevice, FileDeviceOptions, SimDevice};
pub use engine::{creating_path, Condition, Engine, GetPlan, GetStep, Item, ScanRecord, WriteOutcome};
pub use error::{Error, Result};
pub use format::{Mode, RecordKind};
pub use stats::{RamUsage, Stats};
