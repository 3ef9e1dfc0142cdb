//! The NBD protocol (`doc/proto.md` of the NBD project), server side: bytes in, typed values
//! out, and replies encoded into caller buffers. Nothing here does I/O or allocates while
//! parsing. Integers are big-endian on the wire.
//!
//! Supported: fixed newstyle handshake (`NO_ZEROES`), options `EXPORT_NAME`, `ABORT`, `LIST`,
//! `INFO`, `GO` (with `NBD_INFO_EXPORT`, `NAME`, `DESCRIPTION`, `BLOCK_SIZE`); everything else
//! is answered `NBD_REP_ERR_UNSUP` (`STARTTLS`: this server has no TLS, `NBD_REP_ERR_POLICY`).
//! Transmission uses simple replies; commands `READ WRITE DISC FLUSH TRIM WRITE_ZEROES`, flags
//! `FUA` and `NO_HOLE`.

/// `NBDMAGIC`.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, also in front of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

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
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
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
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

// Error values of replies.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

/// Bytes the server sends first: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub const GREETING_BYTES: usize = 18;
pub const OPTION_HEADER_BYTES: usize = 16;
pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_BYTES: usize = 16;
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

/// A simple reply header (read data, if any, follows it).
pub fn simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_BYTES];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&handle.to_be_bytes());
    b
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
}

/// Checks a request against the protocol and the export; `Err` is the error value of the
/// reply (the request is not executed, a write's payload is still to be consumed).
pub fn validate(r: &Request, limits: &ExportLimits) -> Result<Command, u32> {
    let allowed_flags = match r.kind {
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_DISC => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
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
    let writes = r.kind != CMD_READ;
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
    let (offset, len) = (r.offset, r.len);
    Ok(match r.kind {
        CMD_READ => Command::Read { offset, len },
        CMD_WRITE => Command::Write { offset, len, fua },
        CMD_TRIM => Command::Trim { offset, len, fua },
        CMD_WRITE_ZEROES => Command::WriteZeroes { offset, len, fua, no_hole: r.flags & CMD_FLAG_NO_HOLE != 0 },
        _ => unreachable!("kinds checked above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: ExportLimits = ExportLimits { size_bytes: 1 << 20, min_block_bytes: 512, max_block_bytes: 64 << 10, read_only: false };

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
        assert_eq!(parse_option(OPT_STRUCTURED_REPLY, &[]), Ok(ClientOption::Unsupported(OPT_STRUCTURED_REPLY)));
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

    proptest! {
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
