//! A minimal NBD client that sends exactly the bytes a test wants: hostile input, pipelined
//! requests, replies matched by handle.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kura_block::nbd::proto;

/// The handle of the read [`RawClient::expect_error`] sends after the bad request.
pub const HANDLE_PROBE: u64 = 0xfeed;
/// A reply that does not come within this long fails the test instead of hanging it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// What `NBD_OPT_GO` told about the export. Block sizes the server did not send are the
/// protocol's defaults (minimum 1, preferred 4096, no maximum but the export size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_block_bytes: u32,
}

pub struct RawClient {
    pub s: TcpStream,
}

impl RawClient {
    pub fn connect(addr: &str) -> Self {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
        s.set_nodelay(true).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        assert_eq!(greeting, proto::greeting());
        s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        Self { s }
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// Replies to one option, up to the final one (an ACK or an error).
    pub fn option_replies(&mut self, option: u32) -> Vec<(u32, Vec<u8>)> {
        let mut replies = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.s.read_exact(&mut h).unwrap();
            assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), proto::OPTION_REPLY_MAGIC);
            assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let mut data = vec![0u8; u32::from_be_bytes(h[16..].try_into().unwrap()) as usize];
            self.s.read_exact(&mut data).unwrap();
            replies.push((kind, data));
            if ![proto::REP_SERVER, proto::REP_INFO, proto::REP_META_CONTEXT].contains(&kind) {
                return replies;
            }
        }
    }

    pub fn go_data(name: &str, items: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(items.len() as u16).to_be_bytes());
        for i in items {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    /// NBD_OPT_GO with block sizes requested; returns the export size.
    pub fn go(&mut self, name: &str) -> u64 {
        self.go_export(name, true).size_bytes
    }

    /// NBD_OPT_GO; `block_sizes`: ask for NBD_INFO_BLOCK_SIZE (and so promise to honour it).
    pub fn go_export(&mut self, name: &str, block_sizes: bool) -> Export {
        let items: &[u16] = if block_sizes { &[proto::INFO_BLOCK_SIZE] } else { &[] };
        self.send_option(proto::OPT_GO, &Self::go_data(name, items));
        let replies = self.option_replies(proto::OPT_GO);
        assert_eq!(replies.last().unwrap().0, proto::REP_ACK, "{replies:?}");
        let info = |item: u16| replies.iter().find(|(k, d)| *k == proto::REP_INFO && d[..2] == item.to_be_bytes()).map(|(_, d)| &d[2..]);
        let export = info(proto::INFO_EXPORT).expect("NBD_INFO_EXPORT");
        let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().unwrap());
        let size_bytes = u64::from_be_bytes(export[..8].try_into().unwrap());
        let (min, preferred, max) = match info(proto::INFO_BLOCK_SIZE) {
            Some(b) => (be32(b), be32(&b[4..]), be32(&b[8..])),
            None => (1, 4096, u32::MAX),
        };
        Export {
            size_bytes,
            transmission_flags: u16::from_be_bytes(export[8..10].try_into().unwrap()),
            min_block_bytes: min,
            preferred_block_bytes: preferred,
            max_block_bytes: max,
        }
    }

    pub fn request(&mut self, kind: u16, flags: u16, handle: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = proto::encode_request(&proto::Request { flags, kind, handle, offset, len }).to_vec();
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
    }

    /// The header of the next simple reply: (error, handle). Any data follows it.
    pub fn reply_header(&mut self) -> std::io::Result<(u32, u64)> {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), proto::SIMPLE_REPLY_MAGIC, "simple reply magic");
        Ok((u32::from_be_bytes(h[4..8].try_into().unwrap()), u64::from_be_bytes(h[8..].try_into().unwrap())))
    }

    pub fn read_data(&mut self, len: usize) -> std::io::Result<Vec<u8>> {
        let mut data = vec![0u8; len];
        self.s.read_exact(&mut data)?;
        Ok(data)
    }

    /// One simple reply: (error, handle); `data_len` bytes of data follow a successful read.
    pub fn reply(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let (error, handle) = self.reply_header().unwrap();
        let data = self.read_data(if error == 0 { data_len } else { 0 }).unwrap();
        (error, handle, data)
    }

    /// Sends a request and expects `error` in its reply, then checks the connection still
    /// serves a read.
    #[allow(clippy::too_many_arguments, reason = "the request header's fields, then what to expect")]
    pub fn expect_error(&mut self, kind: u16, flags: u16, offset: u64, len: u32, payload: &[u8], error: u32, what: &str) {
        self.request(kind, flags, 1, offset, len, payload);
        let (e, handle, _) = self.reply(0);
        assert_eq!((e, handle), (error, 1), "{what}");
        self.request(proto::CMD_READ, 0, HANDLE_PROBE, 0, 4096, &[]);
        let (e, handle, data) = self.reply(4096);
        assert_eq!((e, handle, data.len()), (0, HANDLE_PROBE, 4096), "a read after: {what}");
    }

    /// NBD_OPT_STRUCTURED_REPLY, acknowledged.
    pub fn structured_replies(&mut self) {
        self.send_option(proto::OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(self.option_replies(proto::OPT_STRUCTURED_REPLY), vec![(proto::REP_ACK, Vec::new())]);
    }

    /// The next structured reply chunk: (flags, type, handle, payload).
    pub fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let mut h = [0u8; proto::STRUCTURED_REPLY_BYTES];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), proto::STRUCTURED_REPLY_MAGIC, "structured reply magic");
        let payload = self.read_data(u32::from_be_bytes(h[16..].try_into().unwrap()) as usize).unwrap();
        (u16::from_be_bytes(h[4..6].try_into().unwrap()), u16::from_be_bytes(h[6..8].try_into().unwrap()), u64::from_be_bytes(h[8..16].try_into().unwrap()), payload)
    }

    /// Whether the server closed the connection (reads EOF or a reset).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}
