//! The NBD protocol (`doc/proto.md` of the NBD project), server side: bytes in, typed values
//! out, and replies encoded into caller buffers. Nothing here does I/O or allocates while
//! parsing. Integers are big-endian on the wire.
//!
//! Supported: fixed newstyle handshake (`NO_ZEROES`), options `EXPORT_NAME`, `ABORT`, `LIST`,
//! `INFO`, `GO` (with `NBD_INFO_EXPORT`, `NAME`, `DESCRIPTION`, `BLOCK_SIZE`),
//! `STRUCTURED_REPLY`, `LIST_META_CONTEXT` and `SET_META_CONTEXT` (one context,
//! `base:allocation`), and `STARTTLS` (the server decides whether TLS is offered or
//! required: see `server` and `tls`); everything else is answered `NBD_REP_ERR_UNSUP`. Transmission: commands `READ WRITE DISC FLUSH
//! TRIM WRITE_ZEROES BLOCK_STATUS`, flags `FUA`, `NO_HOLE`, `FAST_ZERO`, `DF` and `REQ_ONE`. Simple
//! replies, or, once structured replies are negotiated, structured ones for reads (one
//! `OFFSET_DATA` chunk, or one `OFFSET_HOLE` chunk when the range holds no stored block: so
//! `DF` always holds), block status and errors.

/// `NBDMAGIC`.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, also in front of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Reads honour `NBD_CMD_FLAG_DF`; only with structured replies.
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_CMD_FLAG_FAST_ZERO` is honoured.
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
/// The option needs TLS first (a server that requires TLS answers every option but
/// `STARTTLS` and `ABORT` with it until the client upgrades).
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

// Info types (NBD_OPT_INFO / NBD_OPT_GO).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands and command flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// "Don't fragment": a read's data in one chunk.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// A block status request wants one extent only.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// A write-zeroes that must fail with `ENOTSUP`, at once and changing nothing, unless it is
/// faster than writing the zeros.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured replies: the flag of a request's last chunk, and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// The one metadata context: which extents are allocated in the pool.
pub const CONTEXT_BASE_ALLOCATION: &str = "base:allocation";
/// The id this server gives `base:allocation` in `NBD_OPT_SET_META_CONTEXT`.
pub const CONTEXT_ID_BASE_ALLOCATION: u32 = 1;
/// `base:allocation` flags: not allocated; reads as zeros.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

// Error values of replies.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Bytes the server sends first: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub const GREETING_BYTES: usize = 18;
pub const OPTION_HEADER_BYTES: usize = 16;
pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_BYTES: usize = 16;
pub const STRUCTURED_REPLY_BYTES: usize = 20;
/// A structured read reply's bytes before the data: chunk header and offset.
pub const OFFSET_DATA_HEADER_BYTES: usize = STRUCTURED_REPLY_BYTES + 8;
/// A whole `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: header, offset, hole size.
pub const OFFSET_HOLE_REPLY_BYTES: usize = STRUCTURED_REPLY_BYTES + 12;
/// Bytes of one `NBD_REPLY_TYPE_BLOCK_STATUS` descriptor (length, flags).
pub const EXTENT_BYTES: usize = 8;
/// Queries one `NBD_OPT_{LIST,SET}_META_CONTEXT` may carry.
pub const META_QUERIES_MAX: usize = 128;
/// The reserved zeros after an `EXPORT_NAME` reply without `NO_ZEROES`.
pub const EXPORT_NAME_ZEROES: usize = 124;
/// Longest string (export name, description) the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// A violation that ends the connection (hard disconnect).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("bad magic {found:#x} (expected {expected:#x})")]
    BadMagic { expected: u64, found: u64 },
    #[error("unknown client flags {0:#x}")]
    BadClientFlags(u32),
}

/// Why an option's data is refused (answered with `NBD_REP_ERR_INVALID`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionInvalid(pub &'static str);

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().expect("2 bytes"))
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// The server's greeting: fixed newstyle, no zeroes.
pub fn greeting() -> [u8; GREETING_BYTES] {
    let mut out = [0u8; GREETING_BYTES];
    out[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    out
}

/// The client's flags after the greeting: `(fixed_newstyle, no_zeroes)`.
pub fn parse_client_flags(b: &[u8; 4]) -> Result<(bool, bool), ProtoError> {
    let flags = be32(b);
    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(ProtoError::BadClientFlags(flags));
    }
    Ok((flags & FLAG_C_FIXED_NEWSTYLE != 0, flags & FLAG_C_NO_ZEROES != 0))
}

/// An option's header: `(option, data length)`.
pub fn parse_option_header(b: &[u8; OPTION_HEADER_BYTES]) -> Result<(u32, u32), ProtoError> {
    let magic = be64(b);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic { expected: IHAVEOPT, found: magic });
    }
    Ok((be32(&b[8..]), be32(&b[12..])))
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: an export name and the information items asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    pub name: &'a [u8],
    /// `count` big-endian u16 info types.
    items: &'a [u8],
}

impl InfoRequest<'_> {
    pub fn items(&self) -> impl Iterator<Item = u16> + '_ {
        self.items.chunks_exact(2).map(be16)
    }

    pub fn wants(&self, info: u16) -> bool {
        self.items().any(|i| i == info)
    }
}

/// One option of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientOption<'a> {
    ExportName(&'a [u8]),
    Abort,
    List,
    StartTls,
    Info(InfoRequest<'a>),
    Go(InfoRequest<'a>),
    StructuredReply,
    ListMetaContext(MetaRequest<'a>),
    SetMetaContext(MetaRequest<'a>),
    /// Known or not, this server does not do it.
    Unsupported(u32),
}

/// Parses an option's data (`option` from its header).
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption<'_>, OptionInvalid> {
    let no_data = |o| if data.is_empty() { Ok(o) } else { Err(OptionInvalid("this option takes no data")) };
    match option {
        OPT_EXPORT_NAME => Ok(ClientOption::ExportName(data)),
        OPT_ABORT => no_data(ClientOption::Abort),
        OPT_LIST => no_data(ClientOption::List),
        OPT_STARTTLS => no_data(ClientOption::StartTls),
        OPT_STRUCTURED_REPLY => no_data(ClientOption::StructuredReply),
        OPT_LIST_META_CONTEXT => parse_meta_request(data).map(ClientOption::ListMetaContext),
        OPT_SET_META_CONTEXT => parse_meta_request(data).map(ClientOption::SetMetaContext),
        OPT_INFO | OPT_GO => {
            let request = parse_info_request(data)?;
            Ok(if option == OPT_GO { ClientOption::Go(request) } else { ClientOption::Info(request) })
        }
        other => Ok(ClientOption::Unsupported(other)),
    }
}

fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, OptionInvalid> {
    if data.len() < 6 {
        return Err(OptionInvalid("shorter than name length and item count"));
    }
    let name_len = be32(data) as usize;
    if name_len > data.len() - 6 {
        return Err(OptionInvalid("export name longer than the option"));
    }
    let name = &data[4..4 + name_len];
    let count = usize::from(be16(&data[4 + name_len..]));
    let items = &data[6 + name_len..];
    if items.len() != 2 * count {
        return Err(OptionInvalid("information item count does not match the option length"));
    }
    Ok(InfoRequest { name, items })
}

/// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data: an export name and queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    pub name: &'a [u8],
    /// `count` queries, each a big-endian u32 length and the string (checked at parse).
    queries: &'a [u8],
    count: usize,
}

impl<'a> MetaRequest<'a> {
    pub fn queries(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut rest = self.queries;
        (0..self.count).map(move |_| {
            let len = be32(rest) as usize;
            let query = &rest[4..4 + len];
            rest = &rest[4 + len..];
            query
        })
    }

    /// Whether the request selects (`listing`: lists) `base:allocation`. Listing with no
    /// query lists every context, and the query `base:` every context of that namespace;
    /// setting selects only by the context's whole name.
    pub fn selects_base_allocation(&self, listing: bool) -> bool {
        if listing && self.count == 0 {
            return true;
        }
        self.queries().any(|q| q == CONTEXT_BASE_ALLOCATION.as_bytes() || (listing && q == b"base:"))
    }
}

fn parse_meta_request(data: &[u8]) -> Result<MetaRequest<'_>, OptionInvalid> {
    if data.len() < 8 {
        return Err(OptionInvalid("shorter than name length and query count"));
    }
    let name_len = be32(data) as usize;
    if name_len > data.len() - 8 {
        return Err(OptionInvalid("export name longer than the option"));
    }
    let name = &data[4..4 + name_len];
    let count = be32(&data[4 + name_len..]) as usize;
    if count > META_QUERIES_MAX {
        return Err(OptionInvalid("too many metadata context queries"));
    }
    let queries = &data[8 + name_len..];
    let mut rest = queries;
    for _ in 0..count {
        if rest.len() < 4 {
            return Err(OptionInvalid("query count larger than the queries sent"));
        }
        let len = be32(rest) as usize;
        if len > rest.len() - 4 || len > STRING_BYTES_MAX {
            return Err(OptionInvalid("query longer than the option"));
        }
        if std::str::from_utf8(&rest[4..4 + len]).is_err() {
            return Err(OptionInvalid("query is not UTF-8"));
        }
        rest = &rest[4 + len..];
    }
    if !rest.is_empty() {
        return Err(OptionInvalid("bytes after the last query"));
    }
    Ok(MetaRequest { name, queries, count })
}

/// `NBD_REP_META_CONTEXT` payload: the context's id and name.
pub fn meta_context_entry(out: &mut Vec<u8>, option: u32, id: u32, name: &str) {
    let mut payload = Vec::with_capacity(4 + name.len());
    payload.extend_from_slice(&id.to_be_bytes());
    payload.extend_from_slice(name.as_bytes());
    option_reply(out, option, REP_META_CONTEXT, &payload);
}

/// Appends an option reply: header and `payload`.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, payload: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// `NBD_REP_SERVER` payload for `NBD_OPT_LIST`.
pub fn server_entry(out: &mut Vec<u8>, option: u32, name: &[u8], description: &[u8]) {
    let mut payload = Vec::with_capacity(4 + name.len() + description.len());
    payload.extend_from_slice(&(name.len() as u32).to_be_bytes());
    payload.extend_from_slice(name);
    payload.extend_from_slice(description);
    option_reply(out, option, REP_SERVER, &payload);
}

/// `NBD_INFO_EXPORT`: size and transmission flags.
pub fn info_export(size_bytes: u64, transmission_flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    b[10..].copy_from_slice(&transmission_flags.to_be_bytes());
    b
}

/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block sizes.
pub fn info_block_size(min_bytes: u32, preferred_bytes: u32, max_bytes: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min_bytes.to_be_bytes());
    b[6..10].copy_from_slice(&preferred_bytes.to_be_bytes());
    b[10..].copy_from_slice(&max_bytes.to_be_bytes());
    b
}

/// `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`.
pub fn info_string(info: u16, text: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + text.len());
    b.extend_from_slice(&info.to_be_bytes());
    b.extend_from_slice(text);
    b
}

/// The answer to `NBD_OPT_EXPORT_NAME`: size, flags, and 124 zeros unless `no_zeroes`.
pub fn export_name_reply(out: &mut Vec<u8>, size_bytes: u64, transmission_flags: u16, no_zeroes: bool) {
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_ZEROES]);
    }
}

/// A request header of the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    /// Bytes of data that follow the header on the wire.
    pub fn payload_bytes(&self) -> u64 {
        if self.kind == CMD_WRITE { u64::from(self.len) } else { 0 }
    }
}

/// Parses a request header; `Ok(None)` until 28 bytes are there.
pub fn parse_request(b: &[u8]) -> Result<Option<Request>, ProtoError> {
    if b.len() < REQUEST_HEADER_BYTES {
        return Ok(None);
    }
    let magic = be32(b);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic { expected: u64::from(REQUEST_MAGIC), found: u64::from(magic) });
    }
    Ok(Some(Request { flags: be16(&b[4..]), kind: be16(&b[6..]), handle: be64(&b[8..]), offset: be64(&b[16..]), len: be32(&b[24..]) }))
}

/// Encodes a request header (for tests and clients).
pub fn encode_request(r: &Request) -> [u8; REQUEST_HEADER_BYTES] {
    let mut b = [0u8; REQUEST_HEADER_BYTES];
    b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.kind.to_be_bytes());
    b[8..16].copy_from_slice(&r.handle.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..].copy_from_slice(&r.len.to_be_bytes());
    b
}

/// Encodes `NBD_OPT_{LIST,SET}_META_CONTEXT` data: export name and queries (for tests and
/// clients).
pub fn encode_meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// A simple reply header (read data, if any, follows it).
pub fn simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_BYTES];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A structured reply chunk's header; `payload_bytes` follow it.
pub fn structured_reply(flags: u16, reply_type: u16, handle: u64, payload_bytes: u32) -> [u8; STRUCTURED_REPLY_BYTES] {
    let mut b = [0u8; STRUCTURED_REPLY_BYTES];
    b[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&reply_type.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..].copy_from_slice(&payload_bytes.to_be_bytes());
    b
}

/// The header of a read's only chunk (`NBD_REPLY_TYPE_OFFSET_DATA`, done): `data_bytes` of
/// data read at `offset` follow it.
pub fn offset_data_reply(handle: u64, offset: u64, data_bytes: u32) -> [u8; OFFSET_DATA_HEADER_BYTES] {
    let mut b = [0u8; OFFSET_DATA_HEADER_BYTES];
    b[..STRUCTURED_REPLY_BYTES].copy_from_slice(&structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, handle, 8 + data_bytes));
    b[STRUCTURED_REPLY_BYTES..].copy_from_slice(&offset.to_be_bytes());
    b
}

/// A read's only chunk when all it covers reads as zeros (`NBD_REPLY_TYPE_OFFSET_HOLE`,
/// done): 12 bytes of payload instead of the zeros.
pub fn offset_hole_reply(handle: u64, offset: u64, hole_bytes: u32) -> [u8; OFFSET_HOLE_REPLY_BYTES] {
    let mut b = [0u8; OFFSET_HOLE_REPLY_BYTES];
    b[..STRUCTURED_REPLY_BYTES].copy_from_slice(&structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, handle, 12));
    b[STRUCTURED_REPLY_BYTES..STRUCTURED_REPLY_BYTES + 8].copy_from_slice(&offset.to_be_bytes());
    b[STRUCTURED_REPLY_BYTES + 8..].copy_from_slice(&hole_bytes.to_be_bytes());
    b
}

/// A request's final `NBD_REPLY_TYPE_ERROR` chunk, with no message.
pub fn error_reply(handle: u64, error: u32) -> [u8; STRUCTURED_REPLY_BYTES + 6] {
    let mut b = [0u8; STRUCTURED_REPLY_BYTES + 6];
    b[..STRUCTURED_REPLY_BYTES].copy_from_slice(&structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, handle, 6));
    b[STRUCTURED_REPLY_BYTES..STRUCTURED_REPLY_BYTES + 4].copy_from_slice(&error.to_be_bytes());
    b
}

/// The header of a block status request's only chunk (`NBD_REPLY_TYPE_BLOCK_STATUS`, done):
/// chunk header and context id; `extents` descriptors of [`EXTENT_BYTES`] follow it.
pub fn block_status_reply(handle: u64, context_id: u32, extents: usize) -> [u8; STRUCTURED_REPLY_BYTES + 4] {
    let mut b = [0u8; STRUCTURED_REPLY_BYTES + 4];
    let payload = 4 + EXTENT_BYTES * extents;
    b[..STRUCTURED_REPLY_BYTES].copy_from_slice(&structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, handle, payload as u32));
    b[STRUCTURED_REPLY_BYTES..].copy_from_slice(&context_id.to_be_bytes());
    b
}

/// `base:allocation` descriptors of `[offset, offset + len)` from one status per block of
/// `block_bytes` (the blocks the range touches, from the one holding `offset`): runs of equal
/// status become one extent, appended to `out` as (length, flags) big-endian pairs. With
/// `req_one`, only the first extent. Returns how many extents it appended.
pub fn allocation_extents(out: &mut Vec<u8>, offset: u64, len: u32, block_bytes: u64, block_flags: &[u32], req_one: bool) -> usize {
    let end = offset + u64::from(len);
    let first_block = offset / block_bytes;
    let mut extents = 0;
    let mut run: Option<(u64, u32)> = None; // (start, flags)
    let push = |start: u64, stop: u64, flags: u32, out: &mut Vec<u8>| {
        out.extend_from_slice(&((stop - start) as u32).to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    };
    for (i, &flags) in block_flags.iter().enumerate() {
        let block_start = ((first_block + i as u64) * block_bytes).max(offset);
        if block_start >= end {
            break;
        }
        match run {
            Some((_, f)) if f == flags => {}
            Some((start, f)) => {
                push(start, block_start, f, out);
                extents += 1;
                if req_one {
                    return extents;
                }
                run = Some((block_start, flags));
            }
            None => run = Some((block_start, flags)),
        }
    }
    if let Some((start, f)) = run {
        let stop = end.min((first_block + block_flags.len() as u64) * block_bytes);
        push(start, stop, f, out);
        extents += 1;
    }
    extents
}

/// What an export allows, as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    pub size_bytes: u64,
    /// Requests must be aligned to this (1 unless the client asked for block sizes).
    pub min_block_bytes: u32,
    /// Largest read or write.
    pub max_block_bytes: u32,
    pub read_only: bool,
    /// The client negotiated structured replies.
    pub structured: bool,
    /// The client selected `base:allocation` (so may send `NBD_CMD_BLOCK_STATUS`).
    pub base_allocation: bool,
}

/// A request that passed every check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read { offset: u64, len: u32 },
    Write { offset: u64, len: u32, fua: bool },
    Disconnect,
    Flush,
    Trim { offset: u64, len: u32, fua: bool },
    WriteZeroes { offset: u64, len: u32, fua: bool, no_hole: bool },
    BlockStatus { offset: u64, len: u32, req_one: bool },
}

/// Checks a request against the protocol and the export; `Err` is the error value of the
/// reply (the request is not executed, a write's payload is still to be consumed).
pub fn validate(r: &Request, limits: &ExportLimits) -> Result<Command, u32> {
    let allowed_flags = match r.kind {
        CMD_READ if limits.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_DISC => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS if limits.base_allocation => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => return Err(EINVAL),
    };
    if r.flags & !allowed_flags != 0 {
        return Err(EINVAL);
    }
    let fua = r.flags & CMD_FLAG_FUA != 0;
    match r.kind {
        CMD_DISC => return Ok(Command::Disconnect),
        CMD_FLUSH if r.offset != 0 || r.len != 0 => return Err(EINVAL),
        CMD_FLUSH => return Ok(Command::Flush),
        _ => {}
    }
    let writes = !matches!(r.kind, CMD_READ | CMD_BLOCK_STATUS);
    if writes && limits.read_only {
        return Err(EPERM);
    }
    if r.len == 0 {
        return Err(EINVAL);
    }
    let min = u64::from(limits.min_block_bytes.max(1));
    if !r.offset.is_multiple_of(min) || !u64::from(r.len).is_multiple_of(min) {
        return Err(EINVAL);
    }
    // The protocol: EINVAL for a read or write over the maximum block size (EOVERFLOW is
    // only for a read with NBD_CMD_FLAG_DF, which needs structured replies); ENOSPC for a
    // write or write-zeroes past the end, EINVAL for a read or trim past it. A write-zeroes
    // longer than the maximum is taken, though the protocol asks for EINVAL: it carries no
    // payload, and Linux's client sends them up to 4 GiB whatever the server advertises.
    if matches!(r.kind, CMD_READ | CMD_WRITE) && r.len > limits.max_block_bytes {
        return Err(EINVAL);
    }
    if r.offset.checked_add(u64::from(r.len)).is_none_or(|end| end > limits.size_bytes) {
        return Err(if matches!(r.kind, CMD_WRITE | CMD_WRITE_ZEROES) { ENOSPC } else { EINVAL });
    }
    // Whole blocks are zeroed by deleting them, faster than writing; with NO_HOLE they are
    // written, which is not.
    if r.kind == CMD_WRITE_ZEROES && r.flags & CMD_FLAG_FAST_ZERO != 0 && r.flags & CMD_FLAG_NO_HOLE != 0 {
        return Err(ENOTSUP);
    }
    let (offset, len) = (r.offset, r.len);
    Ok(match r.kind {
        CMD_READ => Command::Read { offset, len },
        CMD_WRITE => Command::Write { offset, len, fua },
        CMD_TRIM => Command::Trim { offset, len, fua },
        CMD_WRITE_ZEROES => Command::WriteZeroes { offset, len, fua, no_hole: r.flags & CMD_FLAG_NO_HOLE != 0 },
        CMD_BLOCK_STATUS => Command::BlockStatus { offset, len, req_one: r.flags & CMD_FLAG_REQ_ONE != 0 },
        _ => unreachable!("kinds checked above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: ExportLimits = ExportLimits { size_bytes: 1 << 20, min_block_bytes: 512, max_block_bytes: 64 << 10, read_only: false, structured: false, base_allocation: false };

    fn req(kind: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request { flags, kind, handle: 7, offset, len }
    }

    #[test]
    fn greeting_bytes() {
        let g = greeting();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
    }

    #[test]
    fn client_flags() {
        assert_eq!(parse_client_flags(&[0, 0, 0, 3]), Ok((true, true)));
        assert_eq!(parse_client_flags(&[0, 0, 0, 1]), Ok((true, false)));
        assert_eq!(parse_client_flags(&[0, 0, 0, 4]), Err(ProtoError::BadClientFlags(4)));
    }

    #[test]
    fn options() {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(b"IHAVEOPT");
        h[8..12].copy_from_slice(&7u32.to_be_bytes());
        h[12..].copy_from_slice(&9u32.to_be_bytes());
        assert_eq!(parse_option_header(&h), Ok((7, 9)));
        h[0] = b'X';
        assert!(matches!(parse_option_header(&h), Err(ProtoError::BadMagic { .. })));

        let mut go = Vec::new();
        go.extend_from_slice(&4u32.to_be_bytes());
        go.extend_from_slice(b"disk");
        go.extend_from_slice(&2u16.to_be_bytes());
        go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        go.extend_from_slice(&INFO_NAME.to_be_bytes());
        let ClientOption::Go(info) = parse_option(OPT_GO, &go).unwrap() else { panic!("go") };
        assert_eq!(info.name, b"disk");
        assert_eq!(info.items().collect::<Vec<_>>(), vec![INFO_BLOCK_SIZE, INFO_NAME]);
        assert!(info.wants(INFO_BLOCK_SIZE) && !info.wants(INFO_DESCRIPTION));
        assert!(matches!(parse_option(OPT_INFO, &go), Ok(ClientOption::Info(_))));
        assert!(parse_option(OPT_GO, &go[..go.len() - 1]).is_err(), "item count mismatch");
        assert!(parse_option(OPT_GO, &[0, 0, 1, 0, 0, 0]).is_err(), "name longer than data");
        assert!(parse_option(OPT_GO, &[0, 0]).is_err());
        assert_eq!(parse_option(OPT_LIST, &[]), Ok(ClientOption::List));
        assert!(parse_option(OPT_LIST, &[1]).is_err());
        assert_eq!(parse_option(OPT_ABORT, &[]), Ok(ClientOption::Abort));
        assert_eq!(parse_option(OPT_EXPORT_NAME, b"x"), Ok(ClientOption::ExportName(b"x")));
        assert_eq!(parse_option(OPT_STRUCTURED_REPLY, &[]), Ok(ClientOption::StructuredReply));
        assert!(parse_option(OPT_STRUCTURED_REPLY, &[0]).is_err(), "takes no data");
        assert_eq!(parse_option(11, &[]), Ok(ClientOption::Unsupported(11)), "extended headers");
        assert_eq!(parse_option(0xdead, &[1, 2]), Ok(ClientOption::Unsupported(0xdead)));
    }

    #[test]
    fn replies() {
        let mut out = Vec::new();
        option_reply(&mut out, OPT_GO, REP_ACK, &[]);
        assert_eq!(out.len(), 20);
        assert_eq!(&out[..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        out.clear();
        export_name_reply(&mut out, 4096, FLAG_HAS_FLAGS, false);
        assert_eq!(out.len(), 10 + 124);
        out.clear();
        export_name_reply(&mut out, 4096, FLAG_HAS_FLAGS, true);
        assert_eq!(out.len(), 10);
        assert_eq!(info_export(1, 2)[..2], [0, 0]);
        assert_eq!(info_block_size(512, 4096, 1 << 25)[2..6], 512u32.to_be_bytes());
        let r = simple_reply(EIO, 0x0102_0304_0506_0708);
        assert_eq!(&r[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[4..8], &5u32.to_be_bytes());
        assert_eq!(&r[8..], &[1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn requests() {
        let r = req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512);
        let b = encode_request(&r);
        assert_eq!(parse_request(&b[..27]), Ok(None));
        assert_eq!(parse_request(&b), Ok(Some(r)));
        assert_eq!(r.payload_bytes(), 512);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(parse_request(&bad).is_err());
    }

    #[test]
    fn validation() {
        let ok = |r: Request| validate(&r, &LIMITS);
        assert_eq!(ok(req(CMD_READ, 0, 0, 4096)), Ok(Command::Read { offset: 0, len: 4096 }));
        assert_eq!(ok(req(CMD_WRITE, CMD_FLAG_FUA, 512, 512)), Ok(Command::Write { offset: 512, len: 512, fua: true }));
        assert_eq!(ok(req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 8192)), Ok(Command::WriteZeroes { offset: 0, len: 8192, fua: false, no_hole: true }));
        assert_eq!(ok(req(CMD_FLUSH, 0, 0, 0)), Ok(Command::Flush));
        assert_eq!(ok(req(CMD_DISC, 0, 0, 0)), Ok(Command::Disconnect));
        assert_eq!(ok(req(CMD_TRIM, 0, 0, 1 << 20)), Ok(Command::Trim { offset: 0, len: 1 << 20, fua: false }), "trim may exceed the max block");
        // Errors the protocol specifies.
        assert_eq!(ok(req(99, 0, 0, 512)), Err(EINVAL), "unknown command");
        assert_eq!(ok(req(5, 0, 0, 512)), Err(EINVAL), "NBD_CMD_CACHE was not advertised");
        assert_eq!(ok(req(CMD_READ, CMD_FLAG_NO_HOLE, 0, 512)), Err(EINVAL), "flag not for this command");
        assert_eq!(ok(req(CMD_READ, 1 << 9, 0, 512)), Err(EINVAL), "unknown flag");
        assert_eq!(ok(req(CMD_FLUSH, 0, 1, 0)), Err(EINVAL));
        assert_eq!(ok(req(CMD_READ, 0, 0, 0)), Err(EINVAL), "empty");
        assert_eq!(ok(req(CMD_READ, 0, 100, 512)), Err(EINVAL), "unaligned offset");
        assert_eq!(ok(req(CMD_WRITE, 0, 0, 100)), Err(EINVAL), "unaligned length");
        assert_eq!(ok(req(CMD_WRITE, 0, 0, 128 << 10)), Err(EINVAL), "oversized write");
        assert_eq!(ok(req(CMD_READ, 0, (1 << 20) - 512, 1024)), Err(EINVAL), "read past the end");
        assert_eq!(ok(req(CMD_WRITE, 0, 1 << 20, 512)), Err(ENOSPC), "write past the end");
        assert_eq!(ok(req(CMD_WRITE_ZEROES, 0, u64::MAX - 511, 512)), Err(ENOSPC), "offset overflow");
        let ro = ExportLimits { read_only: true, ..LIMITS };
        assert_eq!(validate(&req(CMD_WRITE, 0, 0, 512), &ro), Err(EPERM));
        assert_eq!(validate(&req(CMD_READ, 0, 0, 512), &ro), Ok(Command::Read { offset: 0, len: 512 }));
        let bytes = ExportLimits { min_block_bytes: 1, ..LIMITS };
        assert_eq!(validate(&req(CMD_READ, 0, 3, 5), &bytes), Ok(Command::Read { offset: 3, len: 5 }));
    }

    #[test]
    fn block_status_and_df_only_as_negotiated() {
        let sr = ExportLimits { structured: true, ..LIMITS };
        let bs = ExportLimits { base_allocation: true, ..sr };
        assert_eq!(validate(&req(CMD_READ, CMD_FLAG_DF, 0, 512), &LIMITS), Err(EINVAL), "DF without structured replies");
        assert_eq!(validate(&req(CMD_READ, CMD_FLAG_DF, 0, 512), &sr), Ok(Command::Read { offset: 0, len: 512 }));
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 0, 4096), &sr), Err(EINVAL), "no context selected");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 0, 1 << 20), &bs), Ok(Command::BlockStatus { offset: 0, len: 1 << 20, req_one: false }), "status may exceed the max block");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 512, 512), &bs), Ok(Command::BlockStatus { offset: 512, len: 512, req_one: true }));
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, CMD_FLAG_DF, 0, 512), &bs), Err(EINVAL), "DF is for reads");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 0, 0), &bs), Err(EINVAL));
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 1 << 20, 512), &bs), Err(EINVAL), "past the end");
        assert_eq!(validate(&req(CMD_BLOCK_STATUS, 0, 0, 512), &ExportLimits { read_only: true, ..bs }), Ok(Command::BlockStatus { offset: 0, len: 512, req_one: false }));
        assert_eq!(validate(&req(CMD_READ, CMD_FLAG_REQ_ONE, 0, 512), &bs), Err(EINVAL), "REQ_ONE is for block status");
    }

    #[test]
    fn fast_zero_is_refused_only_where_zeroing_writes() {
        let ok = |r: Request| validate(&r, &LIMITS);
        assert_eq!(ok(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 8192)), Ok(Command::WriteZeroes { offset: 0, len: 8192, fua: false, no_hole: false }));
        assert_eq!(ok(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE, 0, 8192)), Err(ENOTSUP));
        assert_eq!(ok(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE, 1 << 20, 512)), Err(ENOSPC), "range errors first");
        assert_eq!(ok(req(CMD_WRITE, CMD_FLAG_FAST_ZERO, 0, 512)), Err(EINVAL), "FAST_ZERO is for write-zeroes");
    }

    /// The error numbers `doc/proto.md` names (found by tests/nbd_model.rs): a read over the
    /// maximum block size is EINVAL, not EOVERFLOW; a trim past the end is EINVAL, like a
    /// read, not ENOSPC, which is for writes and write-zeroes.
    #[test]
    fn oversized_reads_and_trims_past_the_end_get_einval() {
        let ok = |r: Request| validate(&r, &LIMITS);
        assert_eq!(ok(req(CMD_READ, 0, 0, 128 << 10)), Err(EINVAL), "oversized read");
        assert_eq!(ok(req(CMD_TRIM, 0, (1 << 20) - 512, 1024)), Err(EINVAL), "trim across the end");
        assert_eq!(ok(req(CMD_TRIM, 0, u64::MAX - 511, 512)), Err(EINVAL), "trim whose end overflows");
        assert_eq!(ok(req(CMD_WRITE_ZEROES, 0, 1 << 20, 512)), Err(ENOSPC), "write-zeroes past the end");
    }

    #[test]
    fn meta_context_requests() {
        let data = encode_meta_request("disk", &["base:allocation", "qemu:dirty-bitmap:x"]);
        let ClientOption::SetMetaContext(m) = parse_option(OPT_SET_META_CONTEXT, &data).unwrap() else { panic!("set") };
        assert_eq!(m.name, b"disk");
        assert_eq!(m.queries().collect::<Vec<_>>(), vec![&b"base:allocation"[..], b"qemu:dirty-bitmap:x"]);
        assert!(m.selects_base_allocation(false));
        let listing = |queries: &[&str], listing: bool| {
            let data = encode_meta_request("", queries);
            let (ClientOption::ListMetaContext(m) | ClientOption::SetMetaContext(m)) = parse_option(if listing { OPT_LIST_META_CONTEXT } else { OPT_SET_META_CONTEXT }, &data).unwrap() else { panic!("meta") };
            m.selects_base_allocation(listing)
        };
        assert!(listing(&[], true), "listing with no query lists everything");
        assert!(!listing(&[], false), "setting no query selects nothing");
        assert!(listing(&["base:"], true) && !listing(&["base:"], false), "a namespace lists, never sets");
        assert!(!listing(&["qemu:"], true) && !listing(&["base:allocatio"], false) && !listing(&["base:allocationx"], true));
        // Malformed requests.
        assert!(parse_option(OPT_SET_META_CONTEXT, &data[..data.len() - 1]).is_err(), "last query cut short");
        let mut extra = data.clone();
        extra.push(0);
        assert!(parse_option(OPT_SET_META_CONTEXT, &extra).is_err(), "bytes after the queries");
        let mut more = encode_meta_request("disk", &["base:allocation"]);
        more[11] = 2; // two queries announced, one sent
        assert!(parse_option(OPT_LIST_META_CONTEXT, &more).is_err());
        assert!(parse_option(OPT_SET_META_CONTEXT, &[0, 0, 0, 9, 0, 0, 0, 0]).is_err(), "name longer than data");
        assert!(parse_option(OPT_SET_META_CONTEXT, &[0; 7]).is_err());
        let mut too_many = encode_meta_request("", &[]);
        too_many[4..8].copy_from_slice(&(META_QUERIES_MAX as u32 + 1).to_be_bytes());
        assert!(parse_option(OPT_SET_META_CONTEXT, &too_many).is_err());
        let bad_utf8 = [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0xff];
        assert!(parse_option(OPT_SET_META_CONTEXT, &bad_utf8).is_err());
        let mut out = Vec::new();
        meta_context_entry(&mut out, OPT_SET_META_CONTEXT, CONTEXT_ID_BASE_ALLOCATION, CONTEXT_BASE_ALLOCATION);
        assert_eq!(&out[12..16], &REP_META_CONTEXT.to_be_bytes());
        assert_eq!(&out[16..20], &(4 + 15u32).to_be_bytes());
        assert_eq!(&out[20..24], &1u32.to_be_bytes());
        assert_eq!(&out[24..], b"base:allocation");
    }

    #[test]
    fn structured_replies() {
        let r = offset_data_reply(0x0102_0304_0506_0708, 4096, 512);
        assert_eq!(&r[..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&r[6..8], &REPLY_TYPE_OFFSET_DATA.to_be_bytes());
        assert_eq!(&r[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&r[16..20], &520u32.to_be_bytes(), "offset and data");
        assert_eq!(&r[20..], &4096u64.to_be_bytes());
        let h = offset_hole_reply(3, 8192, 1 << 20);
        assert_eq!(&h[6..8], &REPLY_TYPE_OFFSET_HOLE.to_be_bytes());
        assert_eq!(&h[16..20], &12u32.to_be_bytes());
        assert_eq!(&h[20..28], &8192u64.to_be_bytes());
        assert_eq!(&h[28..], &(1u32 << 20).to_be_bytes());
        let e = error_reply(9, EINVAL);
        assert_eq!(&e[6..8], &[0x80, 1]);
        assert_eq!(&e[16..20], &6u32.to_be_bytes());
        assert_eq!(&e[20..24], &EINVAL.to_be_bytes());
        assert_eq!(&e[24..], &[0, 0], "no message");
        let b = block_status_reply(9, CONTEXT_ID_BASE_ALLOCATION, 3);
        assert_eq!(&b[6..8], &REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
        assert_eq!(&b[16..20], &(4 + 24u32).to_be_bytes());
        assert_eq!(&b[20..], &1u32.to_be_bytes());
    }

    fn extents(offset: u64, len: u32, flags: &[u32], req_one: bool) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let n = allocation_extents(&mut out, offset, len, 4096, flags, req_one);
        assert_eq!(out.len(), n * EXTENT_BYTES);
        out.chunks_exact(8).map(|c| (be32(c), be32(&c[4..]))).collect()
    }

    #[test]
    fn extents_merge_runs_and_cover_the_range() {
        const H: u32 = STATE_HOLE | STATE_ZERO;
        assert_eq!(extents(0, 16384, &[0, 0, H, 0], false), vec![(8192, 0), (4096, H), (4096, 0)]);
        assert_eq!(extents(0, 16384, &[0, 0, H, 0], true), vec![(8192, 0)]);
        assert_eq!(extents(0, 16384, &[H; 4], true), vec![(16384, H)]);
        // An unaligned range: the first and last extents are partial blocks.
        assert_eq!(extents(1024, 8192, &[H, 0, 0], false), vec![(3072, H), (5120, 0)]);
        assert_eq!(extents(512, 512, &[STATE_ZERO], false), vec![(512, STATE_ZERO)]);
        // Statuses for fewer blocks than the range: the extents end with the last block.
        assert_eq!(extents(2048, 16384, &[0, H], false), vec![(2048, 0), (4096, H)]);
    }

    proptest! {
        /// Extents of any range and statuses: consecutive, nonzero, within the range, each
        /// block's status where it lies, and as long as the blocks given.
        #[test]
        fn extents_describe_every_block(offset in 0u64..20_000, len in 1u32..40_000, seed in any::<u64>(), req_one in any::<bool>()) {
            let blocks = ((offset + u64::from(len)).div_ceil(4096) - offset / 4096) as usize;
            let flags: Vec<u32> = (0..blocks).map(|i| ((seed >> (i % 64)) & 3) as u32).collect();
            let got = extents(offset, len, &flags, req_one);
            prop_assert!(!got.is_empty());
            if req_one { prop_assert_eq!(got.len(), 1); }
            let mut at = offset;
            for (i, &(l, f)) in got.iter().enumerate() {
                prop_assert!(l > 0);
                if i > 0 { prop_assert_ne!(f, got[i - 1].1, "runs are merged"); }
                for byte in [at, at + u64::from(l) - 1] {
                    prop_assert_eq!(flags[(byte / 4096 - offset / 4096) as usize], f);
                }
                at += u64::from(l);
            }
            prop_assert!(at <= offset + u64::from(len));
            if !req_one { prop_assert_eq!(at, offset + u64::from(len)); }
        }

        /// Any 28 bytes: a request that round-trips, or a clean magic error; never a panic.
        #[test]
        fn request_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            match parse_request(&bytes) {
                Ok(Some(r)) => {
                    prop_assert_eq!(&encode_request(&r)[..], &bytes[..REQUEST_HEADER_BYTES]);
                    let _ = validate(&r, &LIMITS);
                }
                Ok(None) => prop_assert!(bytes.len() < REQUEST_HEADER_BYTES),
                Err(ProtoError::BadMagic { .. }) => prop_assert!(bytes[..4] != REQUEST_MAGIC.to_be_bytes()),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }

        /// A valid command is always inside the export and aligned.
        #[test]
        fn valid_commands_are_in_range(kind in 0u16..8, flags in 0u16..4, offset in 0u64..(2 << 20), len in 0u32..(256 << 10)) {
            if let Ok(Command::Read { offset, len } | Command::Write { offset, len, .. } | Command::Trim { offset, len, .. } | Command::WriteZeroes { offset, len, .. }) = validate(&req(kind, flags, offset, len), &LIMITS) {
                prop_assert!(len > 0 && offset + u64::from(len) <= LIMITS.size_bytes);
                prop_assert!(offset.is_multiple_of(512) && len.is_multiple_of(512));
            }
        }

        /// Option data of any shape parses or is refused, never panics; GO/INFO names lie
        /// inside the data.
        #[test]
        fn options_never_panic(option in 0u32..12, data in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(ClientOption::Go(info) | ClientOption::Info(info)) = parse_option(option, &data) {
                prop_assert!(info.name.len() + 6 <= data.len());
                prop_assert_eq!(info.items().count() * 2 + info.name.len() + 6, data.len());
            }
        }
    }
}
