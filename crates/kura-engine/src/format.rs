//! The on-disk format, in one place.
//!
//! A store is one file or raw block device:
//!
//! ```text
//! [superblock A][superblock B][checkpoint 0][checkpoint 1] ... | journal | block 0 | block 1 | ...
//! 0             4 KiB         8 KiB         12 KiB              64 KiB*   (aligned)  (aligned)
//! ```
//!
//! * The **superblock** (two identical copies) holds the geometry; it is written once, at format.
//! * A **checkpoint** (two slots, the higher valid `seq` wins) holds, per partition, the version
//!   up to which every record of that partition is in a durable sealed block (its *watermark*).
//! * The **journal** is a ring of pages that makes records still in RAM write buffers durable at
//!   `sync()`. Logical page `L` lives in slot `L mod n` of the primary half, and a rewrite of a
//!   partially filled page goes to the same slot of the alternate half, alternating, so a torn
//!   rewrite never destroys what an earlier sync made durable.
//! * A **block** holds records sorted by key hash: packed pages of small records, then
//!   sector-aligned large records, then a summary (Bloom filter and page index, so reopening
//!   never reads data), and in its last page a footer that points to the summary. The footer is
//!   written only after the data and summary are durable, so a valid footer implies a whole block.
//!
//! Every page and record carries the store's random `store_id` and a CRC-32C, checked on every
//! read. All integers are little-endian.

use thiserror::Error;

/// Smallest unit the engine ever reads or writes; real alignment comes from the device.
pub const SECTOR_SIZE_BYTES_MIN: u32 = 512;
/// Pages are a multiple of this.
pub const PAGE_SIZE_BYTES_UNIT: u32 = 4096;
/// Size of the fixed metadata pages (superblocks, checkpoints), independent of the page size.
pub const META_PAGE_SIZE_BYTES: u64 = 4096;
pub const SUPERBLOCK_OFFSETS_BYTES: [u64; 2] = [0, META_PAGE_SIZE_BYTES];
pub const CHECKPOINT_OFFSETS_BYTES: [u64; 2] = [2 * META_PAGE_SIZE_BYTES, 3 * META_PAGE_SIZE_BYTES];
/// The journal starts after the metadata region, aligned to the page size.
pub const META_REGION_BYTES: u64 = 64 * 1024;
/// Blocks start aligned to this, so blocks are aligned on the device.
pub const BLOCK_REGION_ALIGNMENT_BYTES: u64 = 1 << 20;

pub const KEY_SIZE_BYTES_MAX: usize = 250;
/// Most partitions a store can have; bounds the checkpoint page.
pub const PARTITIONS_MAX: u32 = 256;
pub const FORMAT_VERSION: u32 = 1;

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"KURAENG\0";
pub const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"KCKP");
pub const PAGE_MAGIC: u32 = u32::from_le_bytes(*b"KPG1");
pub const LARGE_MAGIC: u32 = u32::from_le_bytes(*b"KLR1");
pub const FOOTER_MAGIC: u32 = u32::from_le_bytes(*b"KFT1");
/// A footer overwritten with this marks a block slot as free (never resurrected).
pub const FOOTER_FREE_MAGIC: u32 = u32::from_le_bytes(*b"KFRE");
pub const SUMMARY_MAGIC: u32 = u32::from_le_bytes(*b"KSM1");
pub const JOURNAL_MAGIC: u32 = u32::from_le_bytes(*b"KJN1");
/// Key-digest sections with keyed digests. (`KDG1`, the first layout, held the unkeyed
/// `KeyHash` halves; such sections are refused, so their blocks are collected by reads.)
pub const DIGESTS_MAGIC: u32 = u32::from_le_bytes(*b"KDG2");

pub const PAGE_HEADER_BYTES: usize = 32;
pub const RECORD_HEADER_BYTES: usize = 16;
pub const LARGE_HEADER_BYTES: usize = 40;
pub const FOOTER_BYTES: usize = 64;
pub const SUMMARY_HEADER_BYTES: usize = 128;
pub const DIGESTS_HEADER_BYTES: usize = 24;
/// Bytes per record in a block's key-digest section.
pub const DIGEST_BYTES: usize = 16;
pub const JOURNAL_PAGE_HEADER_BYTES: usize = 40;
pub const JOURNAL_ENTRY_HEADER_BYTES: usize = 16;
pub const CHECKPOINT_HEADER_BYTES: usize = 40;
/// `first_entry_offset` when no journal entry starts in a page.
pub const JOURNAL_NO_ENTRY_START: u32 = u32::MAX;

const _: () = assert!(CHECKPOINT_HEADER_BYTES + 8 * PARTITIONS_MAX as usize <= META_PAGE_SIZE_BYTES as usize);
const _: () = assert!(META_REGION_BYTES >= 4 * META_PAGE_SIZE_BYTES);
const _: () = assert!(PAGE_SIZE_BYTES_UNIT.is_multiple_of(SECTOR_SIZE_BYTES_MIN));
const _: () = assert!(BLOCK_REGION_ALIGNMENT_BYTES.is_multiple_of(META_REGION_BYTES));
// A large record with the longest key still fits one sector beyond its 4 KiB value.
const _: () = assert!(LARGE_HEADER_BYTES + KEY_SIZE_BYTES_MAX <= SECTOR_SIZE_BYTES_MIN as usize);

/// What is wrong with bytes that should hold a format structure.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    #[error("bad magic number")]
    BadMagic,
    #[error("checksum mismatch")]
    BadChecksum,
    #[error("belongs to another store (store id {found:#x}, expected {expected:#x})")]
    ForeignStore { expected: u64, found: u64 },
    #[error("unsupported format version {0}")]
    UnsupportedVersion(u32),
    #[error("field {field} out of range: {value}")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("truncated structure")]
    Truncated,
}

/// Record kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    Put = 1,
    Tombstone = 2,
}

impl RecordKind {
    pub fn from_u8(value: u8) -> Result<Self, FormatError> {
        match value {
            1 => Ok(Self::Put),
            2 => Ok(Self::Tombstone),
            _ => Err(FormatError::OutOfRange { field: "record kind", value: u64::from(value) }),
        }
    }
}

/// Whether a block holds freshly written records or records moved forward by GC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Sealed from a partition's write buffer: versions in `(previous watermark, max_version]`.
    Normal = 1,
    /// Written by garbage collection: old versions, still the newest of their keys.
    Gc = 2,
}

impl BlockKind {
    pub fn from_u8(value: u8) -> Result<Self, FormatError> {
        match value {
            1 => Ok(Self::Normal),
            2 => Ok(Self::Gc),
            _ => Err(FormatError::OutOfRange { field: "block kind", value: u64::from(value) }),
        }
    }
}

/// Space policy, fixed when the store is formatted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// When full, the oldest block is dropped whole; writes never wait for space.
    Cache = 1,
    /// Nothing is dropped; dead space is reclaimed by moving live records forward.
    Store = 2,
}

impl Mode {
    pub fn from_u8(value: u8) -> Result<Self, FormatError> {
        match value {
            1 => Ok(Self::Cache),
            2 => Ok(Self::Store),
            _ => Err(FormatError::OutOfRange { field: "mode", value: u64::from(value) }),
        }
    }
}

pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Little-endian writer over a fixed buffer; panics on overflow (a bug: sizes are constants).
pub struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn at(buf: &'a mut [u8], pos: usize) -> Self {
        Self { buf, pos }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
        self
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes(&[v])
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
}

/// Little-endian reader with bounds checks.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn at(buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn bytes(&mut self, len: usize) -> Result<&'a [u8], FormatError> {
        let end = self.pos.checked_add(len).ok_or(FormatError::Truncated)?;
        let out = self.buf.get(self.pos..end).ok_or(FormatError::Truncated)?;
        self.pos = end;
        Ok(out)
    }
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
}

fn check_magic(found: u32, expected: u32) -> Result<(), FormatError> {
    if found == expected { Ok(()) } else { Err(FormatError::BadMagic) }
}

fn check_store(found: u64, expected: u64) -> Result<(), FormatError> {
    if found == expected { Ok(()) } else { Err(FormatError::ForeignStore { expected, found }) }
}

/// The store geometry; written once at format time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub store_id: u64,
    pub created_unix_s: u64,
    pub device_size_bytes: u64,
    pub page_size_bytes: u32,
    pub block_size_bytes: u32,
    pub block_count: u32,
    pub partitions: u32,
    pub journal_offset_bytes: u64,
    /// Logical journal pages; the region holds twice this many page slots.
    pub journal_logical_pages: u32,
    pub blocks_offset_bytes: u64,
    pub mode: Mode,
    pub index_bits_per_key: u32,
    pub fingerprint_bits: u32,
}

impl Superblock {
    pub const ENCODED_BYTES: usize = 96;

    pub fn encode(&self, out: &mut [u8]) {
        let mut w = Writer::new(out);
        w.bytes(&SUPERBLOCK_MAGIC).u32(FORMAT_VERSION).u32(0);
        w.u64(self.store_id).u64(self.created_unix_s).u64(self.device_size_bytes);
        w.u32(self.page_size_bytes).u32(self.block_size_bytes).u32(self.block_count).u32(self.partitions);
        w.u64(self.journal_offset_bytes).u32(self.journal_logical_pages).u32(0);
        w.u64(self.blocks_offset_bytes);
        w.u8(self.mode as u8).u8(0).u16(0).u32(self.index_bits_per_key).u32(self.fingerprint_bits);
        let crc_pos = w.pos();
        let sum = crc(&out[..crc_pos]);
        Writer::at(out, crc_pos).u32(sum);
        debug_assert!(crc_pos + 4 <= Self::ENCODED_BYTES);
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes);
        if r.bytes(8)? != SUPERBLOCK_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        r.u32()?;
        let store_id = r.u64()?;
        let created_unix_s = r.u64()?;
        let device_size_bytes = r.u64()?;
        let page_size_bytes = r.u32()?;
        let block_size_bytes = r.u32()?;
        let block_count = r.u32()?;
        let partitions = r.u32()?;
        let journal_offset_bytes = r.u64()?;
        let journal_logical_pages = r.u32()?;
        r.u32()?;
        let blocks_offset_bytes = r.u64()?;
        let mode = r.u8()?;
        r.u8()?;
        r.u16()?;
        let index_bits_per_key = r.u32()?;
        let fingerprint_bits = r.u32()?;
        let crc_pos = r.pos();
        if r.u32()? != crc(&bytes[..crc_pos]) {
            return Err(FormatError::BadChecksum);
        }
        let sb = Self {
            store_id,
            created_unix_s,
            device_size_bytes,
            page_size_bytes,
            block_size_bytes,
            block_count,
            partitions,
            journal_offset_bytes,
            journal_logical_pages,
            blocks_offset_bytes,
            mode: Mode::from_u8(mode)?,
            index_bits_per_key,
            fingerprint_bits,
        };
        sb.validate()?;
        Ok(sb)
    }

    /// Checks the geometry is self-consistent (a corrupt or hostile superblock must not make
    /// the engine compute absurd offsets).
    pub fn validate(&self) -> Result<(), FormatError> {
        let range = |field, value: u64, ok: bool| if ok { Ok(()) } else { Err(FormatError::OutOfRange { field, value }) };
        let page = u64::from(self.page_size_bytes);
        let block = u64::from(self.block_size_bytes);
        range("page_size_bytes", page, page >= 4096 && page % 4096 == 0 && page <= (1 << 20))?;
        range("block_size_bytes", block, block % page == 0 && block >= 8 * page && block <= (1 << 31))?;
        range("partitions", u64::from(self.partitions), (1..=PARTITIONS_MAX).contains(&self.partitions))?;
        range("block_count", u64::from(self.block_count), self.block_count >= 2)?;
        range("journal_logical_pages", u64::from(self.journal_logical_pages), self.journal_logical_pages >= 4)?;
        range("journal_offset_bytes", self.journal_offset_bytes, self.journal_offset_bytes.is_multiple_of(page) && self.journal_offset_bytes >= META_REGION_BYTES)?;
        let journal_end = self.journal_offset_bytes + 2 * u64::from(self.journal_logical_pages) * page;
        range("blocks_offset_bytes", self.blocks_offset_bytes, self.blocks_offset_bytes >= journal_end && self.blocks_offset_bytes.is_multiple_of(page))?;
        let end = self.blocks_offset_bytes + u64::from(self.block_count) * block;
        range("device_size_bytes", self.device_size_bytes, end <= self.device_size_bytes)?;
        range("index_bits_per_key", u64::from(self.index_bits_per_key), (4..=64).contains(&self.index_bits_per_key))?;
        range("fingerprint_bits", u64::from(self.fingerprint_bits), (1..=24).contains(&self.fingerprint_bits))?;
        Ok(())
    }

    pub fn block_offset_bytes(&self, slot: u32) -> u64 {
        debug_assert!(slot < self.block_count);
        self.blocks_offset_bytes + u64::from(slot) * u64::from(self.block_size_bytes)
    }

    pub fn journal_slot_offset_bytes(&self, slot: u32) -> u64 {
        debug_assert!(slot < 2 * self.journal_logical_pages);
        self.journal_offset_bytes + u64::from(slot) * u64::from(self.page_size_bytes)
    }
}

/// Per-partition watermarks: every record of partition `p` with version `<= watermarks[p]` is
/// in a durable sealed block (or was dropped with it), so journal entries at or below it are
/// obsolete. And every block with a sequence number `<= confirmed_block_seq` is durable; blocks
/// above it were sealed without a sync since and are verified at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub seq: u64,
    pub confirmed_block_seq: u64,
    pub watermarks: Vec<u64>,
}

impl Checkpoint {
    pub fn encode(&self, store_id: u64, out: &mut [u8]) {
        assert!(self.watermarks.len() <= PARTITIONS_MAX as usize);
        let mut w = Writer::at(out, 8);
        w.u64(store_id).u64(self.seq).u64(self.confirmed_block_seq).u32(self.watermarks.len() as u32).u32(0);
        for &mark in &self.watermarks {
            w.u64(mark);
        }
        let end = w.pos();
        let sum = crc(&out[8..end]);
        Writer::new(out).u32(CHECKPOINT_MAGIC).u32(sum);
    }

    pub fn decode(bytes: &[u8], store_id: u64) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes);
        check_magic(r.u32()?, CHECKPOINT_MAGIC)?;
        let sum = r.u32()?;
        let found_store = r.u64()?;
        let seq = r.u64()?;
        let confirmed_block_seq = r.u64()?;
        let count = r.u32()?;
        r.u32()?;
        if count > PARTITIONS_MAX {
            return Err(FormatError::OutOfRange { field: "checkpoint partitions", value: u64::from(count) });
        }
        let watermarks = (0..count).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        if sum != crc(&bytes[8..r.pos()]) {
            return Err(FormatError::BadChecksum);
        }
        check_store(found_store, store_id)?;
        Ok(Self { seq, confirmed_block_seq, watermarks })
    }
}

/// Header of a page of packed small records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    pub block_seq: u64,
    pub record_count: u32,
    pub used_bytes: u32,
}

impl PageHeader {
    /// Writes the header and the checksum over the whole page (call last).
    pub fn seal(&self, store_id: u64, page: &mut [u8]) {
        Writer::at(page, 8).u64(store_id).u64(self.block_seq).u32(self.record_count).u32(self.used_bytes);
        let sum = crc(&page[8..]);
        Writer::new(page).u32(PAGE_MAGIC).u32(sum);
    }

    /// Verifies the magic, checksum and store of a whole page.
    pub fn open(page: &[u8], store_id: u64) -> Result<Self, FormatError> {
        let mut r = Reader::new(page);
        check_magic(r.u32()?, PAGE_MAGIC)?;
        if r.u32()? != crc(&page[8..]) {
            return Err(FormatError::BadChecksum);
        }
        check_store(r.u64()?, store_id)?;
        let header = Self { block_seq: r.u64()?, record_count: r.u32()?, used_bytes: r.u32()? };
        let payload = page.len() - PAGE_HEADER_BYTES;
        if header.used_bytes as usize > payload {
            return Err(FormatError::OutOfRange { field: "page used_bytes", value: u64::from(header.used_bytes) });
        }
        Ok(header)
    }
}

/// Header of one record inside a packed page or a journal entry body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub version: u64,
    pub value_len: u32,
    pub key_len: u8,
    pub kind: RecordKind,
}

impl RecordHeader {
    pub fn encode(&self, out: &mut [u8]) {
        Writer::new(out).u64(self.version).u32(self.value_len).u8(self.key_len).u8(self.kind as u8).u16(0);
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes);
        let version = r.u64()?;
        let value_len = r.u32()?;
        let key_len = r.u8()?;
        let kind = RecordKind::from_u8(r.u8()?)?;
        Ok(Self { version, value_len, key_len, kind })
    }

    pub fn record_bytes(&self) -> usize {
        RECORD_HEADER_BYTES + usize::from(self.key_len) + self.value_len as usize
    }
}

/// Header of a large record stored in its own sector-aligned slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargeHeader {
    pub block_seq: u64,
    pub record: RecordHeader,
}

impl LargeHeader {
    pub fn record_bytes(key_len: usize, value_len: usize) -> usize {
        LARGE_HEADER_BYTES + key_len + value_len
    }

    /// Writes the header into `slot[..40]` and the checksum over header, key and value, which
    /// must already be in place after it.
    pub fn seal(&self, store_id: u64, slot: &mut [u8]) {
        let r = &self.record;
        Writer::at(slot, 8).u64(store_id).u64(self.block_seq).u64(r.version).u32(r.value_len).u8(r.key_len).u8(r.kind as u8).u16(0);
        let end = Self::record_bytes(usize::from(r.key_len), r.value_len as usize);
        let sum = crc(&slot[8..end]);
        Writer::new(slot).u32(LARGE_MAGIC).u32(sum);
    }

    pub fn open(slot: &[u8], store_id: u64) -> Result<Self, FormatError> {
        let mut r = Reader::new(slot);
        check_magic(r.u32()?, LARGE_MAGIC)?;
        let sum = r.u32()?;
        let found_store = r.u64()?;
        let block_seq = r.u64()?;
        let version = r.u64()?;
        let value_len = r.u32()?;
        let key_len = r.u8()?;
        let kind = RecordKind::from_u8(r.u8()?)?;
        let end = Self::record_bytes(usize::from(key_len), value_len as usize);
        let covered = slot.get(8..end).ok_or(FormatError::Truncated)?;
        if crc(covered) != sum {
            return Err(FormatError::BadChecksum);
        }
        check_store(found_store, store_id)?;
        Ok(Self { block_seq, record: RecordHeader { version, value_len, key_len, kind } })
    }
}

/// The last page of a block: where its summary is, and that the block is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub block_seq: u64,
    pub summary_offset_bytes: u64,
    pub summary_len_bytes: u64,
    pub summary_crc: u32,
    pub partition: u32,
    pub max_version: u64,
    pub kind: BlockKind,
}

impl Footer {
    pub fn encode(&self, store_id: u64, out: &mut [u8]) {
        Writer::at(out, 8)
            .u64(store_id)
            .u64(self.block_seq)
            .u64(self.summary_offset_bytes)
            .u64(self.summary_len_bytes)
            .u32(self.summary_crc)
            .u32(self.partition)
            .u64(self.max_version)
            .u8(self.kind as u8);
        let sum = crc(&out[8..FOOTER_BYTES]);
        Writer::new(out).u32(FOOTER_MAGIC).u32(sum);
    }

    /// A footer page that marks the slot free.
    pub fn encode_free(store_id: u64, out: &mut [u8]) {
        out[..FOOTER_BYTES].fill(0);
        Writer::at(out, 8).u64(store_id);
        let sum = crc(&out[8..FOOTER_BYTES]);
        Writer::new(out).u32(FOOTER_FREE_MAGIC).u32(sum);
    }

    /// `Ok(None)` for a slot that is free or was never written by this store.
    pub fn decode(bytes: &[u8], store_id: u64, block_size_bytes: u64) -> Result<Option<Self>, FormatError> {
        let mut r = Reader::new(bytes);
        let magic = r.u32()?;
        if magic != FOOTER_MAGIC {
            return Ok(None);
        }
        let sum = r.u32()?;
        if sum != crc(bytes.get(8..FOOTER_BYTES).ok_or(FormatError::Truncated)?) {
            return Err(FormatError::BadChecksum);
        }
        if r.u64()? != store_id {
            return Ok(None);
        }
        let footer = Self {
            block_seq: r.u64()?,
            summary_offset_bytes: r.u64()?,
            summary_len_bytes: r.u64()?,
            summary_crc: r.u32()?,
            partition: r.u32()?,
            max_version: r.u64()?,
            kind: BlockKind::from_u8(r.u8()?)?,
        };
        let end = footer.summary_offset_bytes.checked_add(footer.summary_len_bytes);
        if end.is_none_or(|end| end > block_size_bytes) || footer.summary_len_bytes < SUMMARY_HEADER_BYTES as u64 {
            return Err(FormatError::OutOfRange { field: "footer summary range", value: footer.summary_offset_bytes });
        }
        Ok(Some(footer))
    }
}

/// A block's key digests: for each large record, in record order (sorted), its `KeyHash`
/// `sort` half and its keyed digest ([`crate::hash::key_digest`]: SipHash of the key under a
/// key made from the store's random id), between the data and the summary, page-aligned.
/// Absent in blocks without large records and in blocks written before it existed: a block
/// has it exactly when its summary starts [`digests_len_bytes`] past the page after its data.
/// Only garbage collection reads it (never the reopen): a victim's record whose digest a
/// newer block lists is superseded without reading that block's record. The digest is keyed
/// so that a client cannot choose a key whose digests equal another key's (xxh3, which
/// places records, is fast but not collision-resistant) and so make the collector drop
/// that key's live record.
///
/// `magic u32 | crc u32 (of the rest of the section) | block_seq u64 | count u32 | 0 u32 |
/// count × (sort u64, digest u64)`, little-endian, zero-padded to the page.
///
/// Bytes of the section for `count` large records; 0 for none (no section).
pub fn digests_len_bytes(count: usize, page_size: usize) -> usize {
    if count == 0 {
        return 0;
    }
    (DIGESTS_HEADER_BYTES + DIGEST_BYTES * count).next_multiple_of(page_size)
}

/// Writes the digest section of `digests` into `out` (at least `DIGESTS_HEADER_BYTES + 16 × n`).
pub fn encode_digests(block_seq: u64, digests: &[(u64, u64)], out: &mut [u8]) {
    let end = DIGESTS_HEADER_BYTES + DIGEST_BYTES * digests.len();
    Writer::at(out, 8).u64(block_seq).u32(digests.len() as u32).u32(0);
    for (i, (sort, digest)) in digests.iter().enumerate() {
        Writer::at(out, DIGESTS_HEADER_BYTES + DIGEST_BYTES * i).u64(*sort).u64(*digest);
    }
    let sum = crc(&out[8..end]);
    Writer::new(out).u32(DIGESTS_MAGIC).u32(sum);
}

/// Reads a digest section, checking its magic, checksum, block and count.
pub fn decode_digests(bytes: &[u8], block_seq: u64, count: usize) -> Result<Vec<(u64, u64)>, FormatError> {
    let end = DIGESTS_HEADER_BYTES + DIGEST_BYTES * count;
    let body = bytes.get(8..end).ok_or(FormatError::Truncated)?;
    let mut r = Reader::new(bytes);
    if r.u32()? != DIGESTS_MAGIC {
        return Err(FormatError::BadMagic);
    }
    if r.u32()? != crc(body) {
        return Err(FormatError::BadChecksum);
    }
    let seq = r.u64()?;
    if seq != block_seq {
        return Err(FormatError::OutOfRange { field: "digests block", value: seq });
    }
    let n = r.u32()?;
    if n as usize != count {
        return Err(FormatError::OutOfRange { field: "digests count", value: u64::from(n) });
    }
    r.u32()?;
    let mut digests = Vec::with_capacity(count);
    for _ in 0..count {
        digests.push((r.u64()?, r.u64()?));
    }
    Ok(digests)
}

/// Fixed part of a block summary. The sections follow it in this order, each self-delimiting:
/// the Bloom filter words (`bloom_m_bits / 64` rounded up), the small records' fingerprint
/// Elias–Fano sequence, the packed pages' first-record ranks, the large records' fingerprints,
/// (unless every large slot has the same length) the large slots' sector offsets, and the
/// sampled key hashes (`dead_sample_count` pairs of u64: sort hash, Bloom hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryHeader {
    pub block_seq: u64,
    pub partition: u32,
    pub kind: BlockKind,
    pub record_count: u32,
    pub small_count: u32,
    pub large_count: u32,
    pub tombstone_count: u32,
    pub min_version: u64,
    pub max_version: u64,
    pub packed_pages: u32,
    pub sector_bytes: u32,
    pub large_offset_bytes: u64,
    pub data_end_bytes: u64,
    /// Sum of key and value bytes of the records.
    pub user_bytes: u64,
    pub bloom_m_bits: u32,
    pub bloom_k: u32,
    /// Length of every large slot when they are all equal, else 0.
    pub large_uniform_bytes: u32,
    /// Universe of the small / large records' fingerprints (`n << fingerprint_bits`).
    pub small_fingerprint_universe: u64,
    pub large_fingerprint_universe: u64,
    /// Sampled key hashes kept for estimating dead records at reopen: how many, and the
    /// sampling period (a power of two, as its log2).
    pub dead_sample_count: u16,
    pub dead_sample_every_log2: u8,
}

impl SummaryHeader {
    pub fn encode(&self, store_id: u64, out: &mut [u8]) {
        Writer::new(out)
            .u32(SUMMARY_MAGIC)
            .u32(0)
            .u64(store_id)
            .u64(self.block_seq)
            .u32(self.partition)
            .u8(self.kind as u8)
            .u8(0)
            .u16(0)
            .u32(self.record_count)
            .u32(self.small_count)
            .u32(self.large_count)
            .u32(self.tombstone_count)
            .u64(self.min_version)
            .u64(self.max_version)
            .u32(self.packed_pages)
            .u32(self.sector_bytes)
            .u64(self.large_offset_bytes)
            .u64(self.data_end_bytes)
            .u64(self.user_bytes)
            .u32(self.bloom_m_bits)
            .u32(self.bloom_k)
            .u32(self.large_uniform_bytes)
            .u64(self.small_fingerprint_universe)
            .u64(self.large_fingerprint_universe)
            .u16(self.dead_sample_count)
            .u8(self.dead_sample_every_log2)
            .u8(0);
    }

    pub fn decode(bytes: &[u8], store_id: u64) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes);
        check_magic(r.u32()?, SUMMARY_MAGIC)?;
        r.u32()?;
        check_store(r.u64()?, store_id)?;
        let block_seq = r.u64()?;
        let partition = r.u32()?;
        let kind = BlockKind::from_u8(r.u8()?)?;
        r.u8()?;
        r.u16()?;
        let header = Self {
            block_seq,
            partition,
            kind,
            record_count: r.u32()?,
            small_count: r.u32()?,
            large_count: r.u32()?,
            tombstone_count: r.u32()?,
            min_version: r.u64()?,
            max_version: r.u64()?,
            packed_pages: r.u32()?,
            sector_bytes: r.u32()?,
            large_offset_bytes: r.u64()?,
            data_end_bytes: r.u64()?,
            user_bytes: r.u64()?,
            bloom_m_bits: r.u32()?,
            bloom_k: r.u32()?,
            large_uniform_bytes: r.u32()?,
            small_fingerprint_universe: r.u64()?,
            large_fingerprint_universe: r.u64()?,
            dead_sample_count: r.u16()?,
            dead_sample_every_log2: r.u8()?,
        };
        r.u8()?;
        debug_assert!(r.pos() <= SUMMARY_HEADER_BYTES);
        if header.small_count.checked_add(header.large_count) != Some(header.record_count) {
            return Err(FormatError::OutOfRange { field: "summary record counts", value: u64::from(header.record_count) });
        }
        if header.small_fingerprint_universe == 0 || header.large_fingerprint_universe == 0 {
            return Err(FormatError::OutOfRange { field: "fingerprint universe", value: 0 });
        }
        Ok(header)
    }
}

/// Header of a journal page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalPageHeader {
    pub logical_page: u64,
    pub write_seq: u64,
    pub used_bytes: u32,
    pub first_entry_offset: u32,
}

impl JournalPageHeader {
    pub fn seal(&self, store_id: u64, page: &mut [u8]) {
        Writer::at(page, 8).u64(store_id).u64(self.logical_page).u64(self.write_seq).u32(self.used_bytes).u32(self.first_entry_offset);
        let end = JOURNAL_PAGE_HEADER_BYTES + self.used_bytes as usize;
        let sum = crc(&page[8..end]);
        Writer::new(page).u32(JOURNAL_MAGIC).u32(sum);
    }

    /// `Ok(None)` for a page never written by this store.
    pub fn open(page: &[u8], store_id: u64) -> Result<Option<Self>, FormatError> {
        let mut r = Reader::new(page);
        if r.u32()? != JOURNAL_MAGIC {
            return Ok(None);
        }
        let sum = r.u32()?;
        let found_store = r.u64()?;
        let header = Self { logical_page: r.u64()?, write_seq: r.u64()?, used_bytes: r.u32()?, first_entry_offset: r.u32()? };
        let end = JOURNAL_PAGE_HEADER_BYTES.checked_add(header.used_bytes as usize).filter(|&end| end <= page.len());
        let Some(end) = end else { return Err(FormatError::Truncated) };
        if crc(&page[8..end]) != sum {
            return Err(FormatError::BadChecksum);
        }
        if found_store != store_id {
            return Ok(None);
        }
        Ok(Some(header))
    }
}

/// Header of one journal entry: a record plus the partition it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntryHeader {
    pub partition: u16,
    pub record: RecordHeader,
}

impl JournalEntryHeader {
    pub fn encode(&self, out: &mut [u8]) {
        let r = &self.record;
        Writer::new(out).u8(r.kind as u8).u8(r.key_len).u16(self.partition).u32(r.value_len).u64(r.version);
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes);
        let kind = RecordKind::from_u8(r.u8()?)?;
        let key_len = r.u8()?;
        let partition = r.u16()?;
        let value_len = r.u32()?;
        let version = r.u64()?;
        Ok(Self { partition, record: RecordHeader { version, value_len, key_len, kind } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn superblock() -> Superblock {
        Superblock {
            store_id: 0xfeed,
            created_unix_s: 1,
            device_size_bytes: 64 << 20,
            page_size_bytes: 4096,
            block_size_bytes: 1 << 20,
            block_count: 40,
            partitions: 2,
            journal_offset_bytes: META_REGION_BYTES,
            journal_logical_pages: 256,
            blocks_offset_bytes: 4 << 20,
            mode: Mode::Store,
            index_bits_per_key: 16,
            fingerprint_bits: 8,
        }
    }

    #[test]
    fn superblock_round_trip_and_corruption() {
        let sb = superblock();
        let mut page = vec![0u8; 4096];
        sb.encode(&mut page);
        assert_eq!(Superblock::decode(&page).unwrap(), sb);
        for i in 0..Superblock::ENCODED_BYTES {
            let mut bad = page.clone();
            bad[i] ^= 0x40;
            assert!(Superblock::decode(&bad).is_err(), "flip at byte {i} undetected");
        }
    }

    #[test]
    fn superblock_rejects_inconsistent_geometry() {
        let mut sb = superblock();
        sb.block_count = 1000;
        let mut page = vec![0u8; 4096];
        sb.encode(&mut page);
        assert!(matches!(Superblock::decode(&page), Err(FormatError::OutOfRange { .. })));
    }

    #[test]
    fn page_checksum_covers_payload() {
        let mut page = vec![0u8; 4096];
        page[100] = 9;
        PageHeader { block_seq: 3, record_count: 1, used_bytes: 80 }.seal(7, &mut page);
        assert_eq!(PageHeader::open(&page, 7).unwrap().block_seq, 3);
        assert_eq!(PageHeader::open(&page, 8), Err(FormatError::ForeignStore { expected: 8, found: 7 }));
        page[4000] ^= 1;
        assert_eq!(PageHeader::open(&page, 7), Err(FormatError::BadChecksum));
    }

    #[test]
    fn large_record_checksum() {
        let mut slot = vec![0u8; 4608];
        let record = RecordHeader { version: 5, value_len: 4096, key_len: 3, kind: RecordKind::Put };
        slot[LARGE_HEADER_BYTES..LARGE_HEADER_BYTES + 3].copy_from_slice(b"abc");
        slot[LARGE_HEADER_BYTES + 3 + 4095] = 1;
        LargeHeader { block_seq: 9, record }.seal(1, &mut slot);
        assert_eq!(LargeHeader::open(&slot, 1).unwrap().record, record);
        slot[LARGE_HEADER_BYTES + 3 + 4095] = 2;
        assert_eq!(LargeHeader::open(&slot, 1), Err(FormatError::BadChecksum));
        assert_eq!(LargeHeader::open(&slot[..100], 1), Err(FormatError::Truncated));
    }

    #[test]
    fn footer_free_and_foreign() {
        let mut page = vec![0u8; 4096];
        let footer = Footer { block_seq: 1, summary_offset_bytes: 8192, summary_len_bytes: 4096, summary_crc: 5, partition: 1, max_version: 77, kind: BlockKind::Gc };
        footer.encode(11, &mut page);
        assert_eq!(Footer::decode(&page, 11, 1 << 20).unwrap(), Some(footer));
        assert_eq!(Footer::decode(&page, 12, 1 << 20).unwrap(), None);
        assert!(Footer::decode(&page, 11, 8192).is_err());
        Footer::encode_free(11, &mut page);
        assert_eq!(Footer::decode(&page, 11, 1 << 20).unwrap(), None);
    }

    #[test]
    fn checkpoint_and_journal_headers() {
        let cp = Checkpoint { seq: 4, confirmed_block_seq: 9, watermarks: vec![1, 2, 3] };
        let mut page = vec![0u8; 4096];
        cp.encode(5, &mut page);
        assert_eq!(Checkpoint::decode(&page, 5).unwrap(), cp);
        page[40] ^= 1;
        assert!(Checkpoint::decode(&page, 5).is_err());

        let mut jp = vec![0u8; 4096];
        jp[JOURNAL_PAGE_HEADER_BYTES] = 42;
        let header = JournalPageHeader { logical_page: 10, write_seq: 3, used_bytes: 1, first_entry_offset: 0 };
        header.seal(5, &mut jp);
        assert_eq!(JournalPageHeader::open(&jp, 5).unwrap(), Some(header));
        assert_eq!(JournalPageHeader::open(&jp, 6).unwrap(), None);
        jp[JOURNAL_PAGE_HEADER_BYTES] = 43;
        assert!(JournalPageHeader::open(&jp, 5).is_err());
        let entry = JournalEntryHeader { partition: 3, record: RecordHeader { version: 9, value_len: 100, key_len: 4, kind: RecordKind::Tombstone } };
        let mut buf = [0u8; JOURNAL_ENTRY_HEADER_BYTES];
        entry.encode(&mut buf);
        assert_eq!(JournalEntryHeader::decode(&buf).unwrap(), entry);
    }
}
