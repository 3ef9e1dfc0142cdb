//! The journal: makes records still in RAM write buffers durable at `sync()`.
//!
//! A ring of `logical_pages` pages holds a stream of entries (record + partition). Logical page
//! `L` is written to slot `L mod n` of the primary half; when a sync rewrites a page that an
//! earlier sync wrote partially, it alternates with the same slot of the alternate half, so a
//! torn rewrite leaves the previous, complete version intact. Recovery keeps, for every logical
//! page, the valid copy with the highest write sequence number.
//!
//! A page's first write may go to either half (nothing earlier of it needs protecting), so a
//! new page starts in the half its predecessor is written to: a sync that finishes a page and
//! starts the next writes both (and every page between) as one contiguous write.

use crate::aligned::AlignedBuf;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::format::{
    JOURNAL_ENTRY_HEADER_BYTES, JOURNAL_NO_ENTRY_START, JOURNAL_PAGE_HEADER_BYTES, JournalEntryHeader, JournalPageHeader,
    KEY_SIZE_BYTES_MAX, Superblock,
};

/// Bytes read at once when scanning the journal at recovery.
const RECOVERY_READ_BYTES: usize = 4 << 20;

pub struct JournalWriter {
    store_id: u64,
    page_size: usize,
    logical_pages: u64,
    offset_bytes: u64,
    /// Logical page being filled.
    head: u64,
    page: AlignedBuf,
    used: usize,
    first_entry: u32,
    /// Half the head page's next write goes to (true: alternate): the half its predecessor
    /// was written to at first, then flipped after every write of it.
    head_alternate: bool,
    write_seq: u64,
    /// Pages filled since the last flush: logical page, write parity, first entry offset.
    full_pages: Vec<(u64, bool, u32, AlignedBuf)>,
}

impl JournalWriter {
    pub fn new(sb: &Superblock, head: u64, write_seq: u64) -> Self {
        let page_size = sb.page_size_bytes as usize;
        Self {
            store_id: sb.store_id,
            page_size,
            logical_pages: u64::from(sb.journal_logical_pages),
            offset_bytes: sb.journal_offset_bytes,
            head,
            page: AlignedBuf::zeroed(page_size),
            used: 0,
            first_entry: JOURNAL_NO_ENTRY_START,
            head_alternate: false,
            write_seq,
            full_pages: Vec::new(),
        }
    }

    pub fn head(&self) -> u64 {
        self.head
    }

    pub fn logical_pages(&self) -> u64 {
        self.logical_pages
    }

    fn payload(&self) -> usize {
        self.page_size - JOURNAL_PAGE_HEADER_BYTES
    }

    /// The logical page the head will be on after appending `bytes` more.
    pub fn head_after(&self, bytes: usize) -> u64 {
        self.head + ((self.used + bytes) / self.payload()) as u64
    }

    /// Bytes an entry occupies in the stream.
    pub fn entry_bytes(key_len: usize, value_len: usize) -> usize {
        JOURNAL_ENTRY_HEADER_BYTES + key_len + value_len
    }

    /// Appends one entry to the stream (not yet written).
    pub fn append(&mut self, header: &JournalEntryHeader, key: &[u8], value: &[u8]) {
        let mut head = [0u8; JOURNAL_ENTRY_HEADER_BYTES];
        header.encode(&mut head);
        if self.first_entry == JOURNAL_NO_ENTRY_START {
            self.first_entry = self.used as u32;
        }
        for part in [&head[..], key, value] {
            self.append_bytes(part);
        }
    }

    fn append_bytes(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.used == self.payload() {
                self.finish_page();
            }
            let room = self.payload() - self.used;
            let n = room.min(bytes.len());
            let at = JOURNAL_PAGE_HEADER_BYTES + self.used;
            self.page[at..at + n].copy_from_slice(&bytes[..n]);
            self.used += n;
            bytes = &bytes[n..];
        }
    }

    fn finish_page(&mut self) {
        let page = std::mem::replace(&mut self.page, AlignedBuf::zeroed(self.page_size));
        self.full_pages.push((self.head, self.head_alternate, self.first_entry, page));
        // The next page continues in the same half, contiguous with this one.
        self.head += 1;
        self.used = 0;
        self.first_entry = JOURNAL_NO_ENTRY_START;
    }

    /// Writes every page filled since the last flush and the partial head page, as one write
    /// when they are contiguous (they are, unless the ring wraps). The caller syncs the device
    /// and guarantees the ring has room (see [`JournalWriter::head_after`]).
    pub fn flush(&mut self, device: &dyn Device) -> Result<()> {
        let full = std::mem::take(&mut self.full_pages);
        let mut run: Vec<(u64, AlignedBuf)> = Vec::new();
        for (logical, alternate, first_entry_offset, mut page) in full {
            let header = JournalPageHeader { logical_page: logical, write_seq: self.next_seq(), used_bytes: self.payload() as u32, first_entry_offset };
            header.seal(self.store_id, &mut page);
            self.push_to_run(device, &mut run, self.slot_offset(logical, alternate), page)?;
        }
        if self.used > 0 {
            let header = JournalPageHeader { logical_page: self.head, write_seq: self.next_seq(), used_bytes: self.used as u32, first_entry_offset: self.first_entry };
            header.seal(self.store_id, &mut self.page);
            let offset = self.slot_offset(self.head, self.head_alternate);
            let mut copy = AlignedBuf::zeroed(self.page_size);
            copy.copy_from_slice(&self.page);
            self.push_to_run(device, &mut run, offset, copy)?;
            // A rewrite of this page must never overwrite the copy just written.
            self.head_alternate = !self.head_alternate;
        }
        self.write_run(device, &mut run)
    }

    /// Adds a page to the run being collected, writing the run first if the page does not
    /// continue it.
    fn push_to_run(&self, device: &dyn Device, run: &mut Vec<(u64, AlignedBuf)>, offset: u64, page: AlignedBuf) -> Result<()> {
        if run.last().is_some_and(|(last, p)| *last + p.len() as u64 != offset) {
            self.write_run(device, run)?;
        }
        run.push((offset, page));
        Ok(())
    }

    fn next_seq(&mut self) -> u64 {
        self.write_seq += 1;
        self.write_seq
    }

    fn slot_offset(&self, logical: u64, alternate: bool) -> u64 {
        let slot = logical % self.logical_pages + if alternate { self.logical_pages } else { 0 };
        self.offset_bytes + slot * self.page_size as u64
    }

    fn write_run(&self, device: &dyn Device, run: &mut Vec<(u64, AlignedBuf)>) -> Result<()> {
        let Some(&(start, _)) = run.first() else { return Ok(()) };
        if run.len() == 1 {
            let (_, page) = run.pop().expect("one page");
            return device.write_at(start, &page).map_err(|source| Error::Io { op: "journal write", offset_bytes: start, source });
        }
        let mut joined = AlignedBuf::zeroed(run.len() * self.page_size);
        for (i, (_, page)) in run.iter().enumerate() {
            joined[i * self.page_size..(i + 1) * self.page_size].copy_from_slice(page);
        }
        run.clear();
        device.write_at(start, &joined).map_err(|source| Error::Io { op: "journal write", offset_bytes: start, source })
    }
}

/// One journaled record found at recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayEntry {
    pub logical_page: u64,
    pub header: JournalEntryHeader,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// What recovery found in the journal.
#[derive(Debug, Default)]
pub struct Recovered {
    pub entries: Vec<ReplayEntry>,
    /// First logical page a new writer should use: one past a gap after the last page found,
    /// so the new stream never continues one whose tail a crash may have left inconsistent.
    pub next_head: u64,
    pub next_write_seq: u64,
    pub pages_valid: u64,
    pub pages_damaged: u64,
}

/// Reads the whole journal region and decodes every entry still present, oldest first.
pub fn recover(device: &dyn Device, sb: &Superblock, value_size_max: usize) -> Result<Recovered> {
    let page_size = sb.page_size_bytes as usize;
    let slots = 2 * u64::from(sb.journal_logical_pages);
    let mut best: std::collections::BTreeMap<u64, (u64, Vec<u8>)> = std::collections::BTreeMap::new();
    let mut out = Recovered::default();
    let chunk_pages = (RECOVERY_READ_BYTES / page_size).max(1) as u64;
    let mut buf = AlignedBuf::zeroed(chunk_pages as usize * page_size);
    let mut slot = 0u64;
    while slot < slots {
        let pages = chunk_pages.min(slots - slot);
        let offset = sb.journal_offset_bytes + slot * page_size as u64;
        buf.set_len(pages as usize * page_size);
        device.read_at(offset, &mut buf).map_err(|source| Error::Io { op: "journal recovery read", offset_bytes: offset, source })?;
        for i in 0..pages as usize {
            let page = &buf[i * page_size..(i + 1) * page_size];
            match JournalPageHeader::open(page, sb.store_id) {
                Ok(Some(h)) => {
                    out.pages_valid += 1;
                    out.next_write_seq = out.next_write_seq.max(h.write_seq);
                    if best.get(&h.logical_page).is_none_or(|(seq, _)| *seq < h.write_seq) {
                        let payload = page[JOURNAL_PAGE_HEADER_BYTES..JOURNAL_PAGE_HEADER_BYTES + h.used_bytes as usize].to_vec();
                        best.insert(h.logical_page, (h.write_seq, [h.first_entry_offset.to_le_bytes().to_vec(), payload].concat()));
                    }
                }
                Ok(None) => {}
                Err(_) => out.pages_damaged += 1,
            }
        }
        slot += pages;
    }
    out.next_head = best.keys().next_back().map_or(0, |l| l + 2);

    let mut run: Vec<(u64, u32, Vec<u8>)> = Vec::new();
    for (logical, (_, bytes)) in best {
        if run.last().is_some_and(|(last, _, _)| *last + 1 != logical) {
            parse_run(&run, sb, value_size_max, &mut out.entries);
            run.clear();
        }
        let first = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        run.push((logical, first, bytes[4..].to_vec()));
    }
    parse_run(&run, sb, value_size_max, &mut out.entries);
    Ok(out)
}

/// Parses the entries of consecutive logical pages. Bytes before the first page's first entry
/// belong to an entry whose start is gone. A crash during a sync can leave a page at an older
/// copy while the next page continues a newer one; parsing then resumes at the next page's first
/// entry, so only the unacknowledged tail of that sync is lost.
fn parse_run(run: &[(u64, u32, Vec<u8>)], sb: &Superblock, value_size_max: usize, out: &mut Vec<ReplayEntry>) {
    let mut stream = Vec::new();
    let mut pages = Vec::new();
    for (logical, first, bytes) in run {
        pages.push((stream.len(), *logical, *first));
        stream.extend_from_slice(bytes);
    }
    let page_of = |pos: usize| pages.iter().rposition(|(at, _, _)| *at <= pos).unwrap_or(0);
    let resume_after = |page: usize| {
        pages[page + 1..].iter().find(|(_, _, first)| *first != JOURNAL_NO_ENTRY_START).map(|(at, _, first)| at + *first as usize)
    };
    let Some(mut pos) = pages.first().and_then(|_| if run[0].1 != JOURNAL_NO_ENTRY_START { Some(run[0].1 as usize) } else { resume_after(0) }) else {
        return;
    };
    while pos + JOURNAL_ENTRY_HEADER_BYTES <= stream.len() {
        match decode_entry(&stream, pos, sb, value_size_max) {
            Some((header, end)) => {
                let key_at = pos + JOURNAL_ENTRY_HEADER_BYTES;
                let key_len = usize::from(header.record.key_len);
                out.push(ReplayEntry {
                    logical_page: pages[page_of(pos)].1,
                    header,
                    key: stream[key_at..key_at + key_len].to_vec(),
                    value: stream[key_at + key_len..end].to_vec(),
                });
                pos = end;
            }
            None => match resume_after(page_of(pos)) {
                Some(next) => pos = next,
                None => return,
            },
        }
    }
}

/// The entry at `pos` and where it ends, if it is well formed and complete.
fn decode_entry(stream: &[u8], pos: usize, sb: &Superblock, value_size_max: usize) -> Option<(JournalEntryHeader, usize)> {
    let header = JournalEntryHeader::decode(&stream[pos..pos + JOURNAL_ENTRY_HEADER_BYTES]).ok()?;
    let (key_len, value_len) = (usize::from(header.record.key_len), header.record.value_len as usize);
    let valid = key_len > 0 && key_len <= KEY_SIZE_BYTES_MAX && value_len <= value_size_max.max(1 << 20) && u32::from(header.partition) < sb.partitions;
    let end = pos + JOURNAL_ENTRY_HEADER_BYTES + key_len + value_len;
    (valid && end <= stream.len()).then_some((header, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::format::{META_REGION_BYTES, Mode, RecordHeader, RecordKind};

    fn sb(logical_pages: u32) -> Superblock {
        Superblock {
            store_id: 77,
            created_unix_s: 0,
            device_size_bytes: 8 << 20,
            page_size_bytes: 4096,
            block_size_bytes: 1 << 20,
            block_count: 4,
            partitions: 4,
            journal_offset_bytes: META_REGION_BYTES,
            journal_logical_pages: logical_pages,
            blocks_offset_bytes: 2 << 20,
            mode: Mode::Store,
            index_bits_per_key: 16,
            fingerprint_bits: 8,
        }
    }

    fn entry(i: u64, value_len: usize) -> (JournalEntryHeader, Vec<u8>, Vec<u8>) {
        let key = format!("k{i}").into_bytes();
        let header = JournalEntryHeader { partition: (i % 4) as u16, record: RecordHeader { version: i, value_len: value_len as u32, key_len: key.len() as u8, kind: RecordKind::Put } };
        (header, key, vec![i as u8; value_len])
    }

    #[test]
    fn entries_survive_rewrites_spanning_pages_and_wrap() {
        let sb = sb(16);
        let dev = SimDevice::new(8 << 20, 512);
        let mut w = JournalWriter::new(&sb, 0, 0);
        let mut expected = Vec::new();
        for i in 1..=60u64 {
            let (h, k, v) = entry(i, [10, 3000, 9000][i as usize % 3]);
            w.append(&h, &k, &v);
            expected.push((i, v));
            if i % 3 == 0 {
                w.flush(dev.as_ref()).unwrap();
                dev.sync().unwrap();
            }
        }
        let rec = recover(dev.as_ref(), &sb, 1 << 20).unwrap();
        // The ring holds 16 pages: the newest run ends at entry 60 without gaps; older laps may
        // leave stale pages, which the engine filters by watermark.
        let newest = rec.entries.iter().map(|e| e.logical_page).max().unwrap();
        let got: Vec<u64> = rec.entries.iter().filter(|e| e.logical_page + 12 > newest).map(|e| e.header.record.version).collect();
        assert_eq!(*got.last().unwrap(), 60);
        assert!(got.len() > 5 && got.windows(2).all(|w| w[1] == w[0] + 1), "{got:?}");
        for e in &rec.entries {
            assert_eq!(e.value, expected[e.header.record.version as usize - 1].1);
        }
        assert_eq!(rec.next_head, w.head() + u64::from(w.used > 0) + 1);
    }

    #[test]
    fn torn_rewrite_keeps_earlier_sync() {
        let sb = sb(64);
        let dev = SimDevice::new(8 << 20, 512);
        let mut w = JournalWriter::new(&sb, 0, 0);
        let (h, k, v) = entry(1, 100);
        w.append(&h, &k, &v);
        w.flush(dev.as_ref()).unwrap();
        dev.sync().unwrap();
        let (h2, k2, v2) = entry(2, 100);
        w.append(&h2, &k2, &v2);
        w.flush(dev.as_ref()).unwrap();
        for seed in 0..32 {
            let rec = recover(dev.crash(seed).as_ref(), &sb, 1 << 20).unwrap();
            let versions: Vec<u64> = rec.entries.iter().map(|e| e.header.record.version).collect();
            assert!(versions == vec![1] || versions == vec![1, 2], "seed {seed}: {versions:?}");
        }
    }

    /// A sync that finishes the partial head page and starts the next costs one write, and a
    /// torn write of it keeps what the previous sync made durable.
    #[test]
    fn sync_spanning_pages_is_one_write() {
        let sb = sb(64);
        let dev = SimDevice::new(8 << 20, 512);
        let mut w = JournalWriter::new(&sb, 0, 0);
        let mut synced = Vec::new();
        for i in 1..=40u64 {
            let (h, k, v) = entry(i, 4096);
            w.append(&h, &k, &v);
            let before = dev.writes();
            w.flush(dev.as_ref()).unwrap();
            assert_eq!(dev.writes() - before, 1, "sync {i} took more than one write");
            for seed in 0..8 {
                let rec = recover(dev.crash(seed * 1000 + i).as_ref(), &sb, 1 << 20).unwrap();
                let versions: Vec<u64> = rec.entries.iter().map(|e| e.header.record.version).collect();
                assert!(versions == synced || versions == [&synced[..], &[i]].concat(), "sync {i}, seed {seed}: {versions:?}");
            }
            dev.sync().unwrap();
            synced.push(i);
        }
    }

    /// A crash that loses the rewrite of a partial page but keeps the page after it must not
    /// hide what is written after the restart.
    #[test]
    fn lost_rewrite_does_not_swallow_later_entries() {
        let sb = sb(64);
        let dev = SimDevice::new(8 << 20, 512);
        let mut w = JournalWriter::new(&sb, 0, 0);
        let (h, k, v) = entry(1, 100);
        w.append(&h, &k, &v);
        w.flush(dev.as_ref()).unwrap();
        dev.sync().unwrap();
        // Logical page 0 is rewritten (alternate half) and page 1 written; then the rewrite is lost.
        let (h2, k2, v2) = entry(2, 6000);
        w.append(&h2, &k2, &v2);
        w.flush(dev.as_ref()).unwrap();
        dev.sync().unwrap();
        let alternate_slot_0 = sb.journal_slot_offset_bytes(64);
        dev.corrupt(alternate_slot_0 + 100, 0xff);
        let rec = recover(dev.as_ref(), &sb, 1 << 20).unwrap();
        assert_eq!(rec.entries.iter().map(|e| e.header.record.version).collect::<Vec<_>>(), vec![1]);
        let mut w = JournalWriter::new(&sb, rec.next_head, rec.next_write_seq);
        let (h3, k3, v3) = entry(3, 50);
        w.append(&h3, &k3, &v3);
        w.flush(dev.as_ref()).unwrap();
        dev.sync().unwrap();
        let rec = recover(dev.as_ref(), &sb, 1 << 20).unwrap();
        let versions: Vec<u64> = rec.entries.iter().map(|e| e.header.record.version).collect();
        assert!(versions.contains(&3), "entry written after the restart lost: {versions:?}");
    }
}
