//! kura's block volumes on the pool (paper 000): a volume is a run of 4 KiB blocks, block
//! `i` one value of the pool; three frontends turn block requests into pool requests.
//!
//! * [`volume`]: volume records in the pool; create, list, resize, delete.
//! * [`layout`]: byte ranges → blocks ([`layout::Split`]).
//! * [`queue`]: the per-thread request engine ([`queue::BlockQueue`]): splitting, pool
//!   requests submitted together, reassembly, read-modify-write of partial blocks under
//!   per-block locks, coalesced durability barriers for `FLUSH`/`FUA`, discard and
//!   write-zeroes as deletes.
//! * [`nbd`]: the NBD protocol (pure parser/encoder) and server (TCP and Unix sockets).
//! * [`fuse`]: each volume as one file in a FUSE mount, for `losetup`.
//! * [`ublk`]: `/dev/ublkbN` through the kernel's ublk driver, one queue per thread.
//! * [`pool_open`]: opening a pool for volumes (store mode, one process per embedded store).

pub mod error;
pub mod fuse;
pub mod layout;
pub mod nbd;
pub mod pool_open;
pub mod queue;
pub mod ublk;
pub mod volume;

pub use error::{BlockError, Result};
pub use pool_open::{PoolHandle, open_pool};
pub use queue::{BlockQueue, Done, Volume};
pub use volume::{VolumeMeta, Volumes};
