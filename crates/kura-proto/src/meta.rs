//! Meta-command flags: the closed set memcached knows, parsed into a typed set
//! that remembers request order (return flags are rendered in that order).
//!
//! As in memcached, every meta command accepts every known flag and ignores
//! the ones it has no use for. Which flags each command acts on:
//!
//! | command | flags it acts on |
//! |---|---|
//! | `mg` | `b c f h k l O q s t u v E N R T` |
//! | `ms` | `b c C E F I k O q s T M`(`E A P R S`) `N` (vivify on append/prepend) |
//! | `md` | `b C E I k O q T x` |
//! | `ma` | `b C E N J D T M`(`I + D -`) `O q t c v k` |
//!
//! `P` and `L` (proxy hints) are accepted and ignored by all. `E` and `x` are
//! from memcached after 1.6.18, which answers them with `CLIENT_ERROR invalid
//! flag`. `S` is not a flag: memcached rejects it as invalid, and so does kura.

use crate::base64::is_base64_key;
use crate::error::ErrorKind;
use crate::lex::{is_control, parse_i64, parse_u32, parse_u64};
use crate::limits::{META_FLAGS_MAX, OPAQUE_TOKEN_LENGTH_MAX};

/// One meta flag; its discriminant is the flag character.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MetaFlag {
    /// `b`: the key is base64.
    Base64Key = b'b',
    /// `c`: return the CAS value.
    ReturnCas = b'c',
    /// `f`: return the client flags.
    ReturnClientFlags = b'f',
    /// `h`: return whether the item was hit before.
    ReturnHit = b'h',
    /// `k`: return the key.
    ReturnKey = b'k',
    /// `l`: return seconds since last access.
    ReturnLastAccess = b'l',
    /// `O(token)`: opaque value echoed back.
    Opaque = b'O',
    /// `P(token)`: proxy path hint, ignored.
    ProxyPath = b'P',
    /// `L(token)`: proxy label hint, ignored.
    ProxyLabel = b'L',
    /// `q`: quiet; suppress the nominal reply (see [`crate::encode::quiet_suppresses`]).
    Quiet = b'q',
    /// `s`: return the item size.
    ReturnSize = b's',
    /// `t`: return the remaining TTL (`-1` for none).
    ReturnTtl = b't',
    /// `u`: do not bump the item in the LRU.
    NoLruBump = b'u',
    /// `v`: return the value.
    ReturnValue = b'v',
    /// `x`: `md` removes the value but keeps the item.
    RemoveValue = b'x',
    /// `N(token)`: vivify on miss with this TTL.
    Vivify = b'N',
    /// `R(token)`: win the recache if the TTL left is below this.
    Recache = b'R',
    /// `T(token)`: set the TTL.
    Ttl = b'T',
    /// `F(token)`: client flags to store.
    ClientFlags = b'F',
    /// `C(token)`: compare this CAS value.
    CompareCas = b'C',
    /// `E(token)`: use this as the new CAS value.
    NewCas = b'E',
    /// `M(token)`: mode switch, one character.
    Mode = b'M',
    /// `J(token)`: `ma` initial value on vivify.
    Initial = b'J',
    /// `D(token)`: `ma` delta.
    Delta = b'D',
    /// `I`: invalidate (mark stale) instead of failing or deleting.
    Invalidate = b'I',
}

impl MetaFlag {
    /// Every flag, in the order protocol.txt lists them.
    pub const ALL: [Self; 25] = [
        Self::Base64Key,
        Self::ReturnCas,
        Self::ReturnClientFlags,
        Self::ReturnHit,
        Self::ReturnKey,
        Self::ReturnLastAccess,
        Self::Opaque,
        Self::ProxyPath,
        Self::ProxyLabel,
        Self::Quiet,
        Self::ReturnSize,
        Self::ReturnTtl,
        Self::NoLruBump,
        Self::ReturnValue,
        Self::RemoveValue,
        Self::Vivify,
        Self::Recache,
        Self::Ttl,
        Self::ClientFlags,
        Self::CompareCas,
        Self::NewCas,
        Self::Mode,
        Self::Initial,
        Self::Delta,
        Self::Invalidate,
    ];

    /// The flag named by `byte`, if memcached knows it.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|flag| flag.as_byte() == byte)
    }

    /// The flag character.
    pub fn as_byte(self) -> u8 {
        self as u8
    }

    /// Bit of this flag in a 64-bit set: every flag is an ASCII letter, and
    /// `b'z' - b'A'` < 64.
    fn bit(self) -> u64 {
        1 << (self.as_byte() - b'A')
    }
}

/// The flags of one meta request, in request order, with their tokens parsed.
///
/// Invariant: a flag appears at most once, and a value getter returns `Some`
/// only if its flag is present.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaFlags<'a> {
    order: [Option<MetaFlag>; META_FLAGS_MAX],
    len: usize,
    present: u64,
    opaque: Option<&'a [u8]>,
    client_flags: Option<u32>,
    compare_cas: Option<u64>,
    new_cas: Option<u64>,
    ttl_s: Option<i64>,
    vivify_ttl_s: Option<i64>,
    recache_ttl_s: Option<i64>,
    delta: Option<u64>,
    initial: Option<u64>,
    mode: Option<u8>,
}

/// A flag token's value that failed to parse. `message` is `None` where
/// memcached fails without setting its error string (`F`), so an earlier
/// message, or `bad command line format`, is the one sent.
pub(crate) struct ValueError {
    message: Option<ErrorKind>,
}

impl<'a> MetaFlags<'a> {
    /// No flags.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `flag` with `token`, the bytes after the flag character, parsed as
    /// memcached does; on error the set is unchanged. Errors: [`ErrorKind::DuplicateFlag`], [`ErrorKind::FlagsTooLong`]
    /// past [`META_FLAGS_MAX`], or the value's own error.
    pub fn push(&mut self, flag: MetaFlag, token: &'a [u8]) -> Result<(), ErrorKind> {
        if self.contains(flag) {
            return Err(ErrorKind::DuplicateFlag);
        }
        if self.len >= META_FLAGS_MAX {
            return Err(ErrorKind::FlagsTooLong);
        }
        let mut next = *self;
        next.record(flag, token)
            .map_err(|e| e.message.unwrap_or(ErrorKind::BadCommandLineFormat))?;
        *self = next;
        Ok(())
    }

    /// Whether `flag` is present.
    pub fn contains(&self, flag: MetaFlag) -> bool {
        self.present & flag.bit() != 0
    }

    /// The flags in request order.
    pub fn iter(&self) -> impl Iterator<Item = MetaFlag> + '_ {
        self.order.iter().take(self.len).flatten().copied()
    }

    /// Number of flags.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no flags.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `b`: the key token is base64 (see [`crate::decode_base64_key`]).
    pub fn base64_key(&self) -> bool {
        self.contains(MetaFlag::Base64Key)
    }

    /// `q`: quiet mode.
    pub fn quiet(&self) -> bool {
        self.contains(MetaFlag::Quiet)
    }

    /// `v`: the value is wanted.
    pub fn return_value(&self) -> bool {
        self.contains(MetaFlag::ReturnValue)
    }

    /// `O`: the opaque value, without its `O`.
    pub fn opaque(&self) -> Option<&'a [u8]> {
        self.opaque
    }

    /// `F`: client flags.
    pub fn client_flags(&self) -> Option<u32> {
        self.client_flags
    }

    /// `C`: CAS value to compare.
    pub fn compare_cas(&self) -> Option<u64> {
        self.compare_cas
    }

    /// `E`: CAS value to assign.
    pub fn new_cas(&self) -> Option<u64> {
        self.new_cas
    }

    /// `T`: TTL, in memcached exptime form (seconds, or a Unix time past 30 days).
    pub fn ttl_s(&self) -> Option<i64> {
        self.ttl_s
    }

    /// `N`: TTL of an item vivified on miss.
    pub fn vivify_ttl_s(&self) -> Option<i64> {
        self.vivify_ttl_s
    }

    /// `R`: recache threshold.
    pub fn recache_ttl_s(&self) -> Option<i64> {
        self.recache_ttl_s
    }

    /// `D`: delta for `ma` (memcached's default is 1).
    pub fn delta(&self) -> Option<u64> {
        self.delta
    }

    /// `J`: initial value for `ma` vivify (memcached's default is 0).
    pub fn initial(&self) -> Option<u64> {
        self.initial
    }

    /// `M`: the raw mode character; `ms` and `ma` validate it.
    pub fn mode(&self) -> Option<u8> {
        self.mode
    }

    /// Marks `flag` present, then parses its token. The flag stays recorded
    /// when the value is bad, as in memcached (a later repeat is a duplicate).
    pub(crate) fn record(&mut self, flag: MetaFlag, token: &'a [u8]) -> Result<(), ValueError> {
        if let Some(slot) = self.order.get_mut(self.len) {
            *slot = Some(flag);
            self.len += 1;
        }
        self.present |= flag.bit();
        self.parse_value(flag, token)
    }

    fn parse_value(&mut self, flag: MetaFlag, token: &'a [u8]) -> Result<(), ValueError> {
        let bad_token = ValueError {
            message: Some(ErrorKind::BadToken),
        };
        match flag {
            MetaFlag::Opaque => self.opaque = Some(token),
            MetaFlag::Vivify => self.vivify_ttl_s = Some(parse_i64(token).ok_or(bad_token)?),
            MetaFlag::Recache => self.recache_ttl_s = Some(parse_i64(token).ok_or(bad_token)?),
            MetaFlag::Ttl => self.ttl_s = Some(parse_i64(token).ok_or(bad_token)?),
            MetaFlag::CompareCas => self.compare_cas = Some(parse_u64(token).ok_or(bad_token)?),
            MetaFlag::NewCas => self.new_cas = Some(parse_u64(token).ok_or(bad_token)?),
            MetaFlag::ClientFlags => {
                let silent = ValueError { message: None };
                self.client_flags = Some(parse_u32(token).ok_or(silent)?);
            }
            MetaFlag::Initial => {
                let error = ValueError {
                    message: Some(ErrorKind::InvalidInitial),
                };
                self.initial = Some(parse_u64(token).ok_or(error)?);
            }
            MetaFlag::Delta => {
                let error = ValueError {
                    message: Some(ErrorKind::InvalidDelta),
                };
                self.delta = Some(parse_u64(token).ok_or(error)?);
            }
            MetaFlag::Mode => match token {
                &[mode] => self.mode = Some(mode),
                _ => {
                    return Err(ValueError {
                        message: Some(ErrorKind::ModeTokenLength),
                    });
                }
            },
            _ => {}
        }
        Ok(())
    }
}

/// Parses flag tokens as memcached's `_meta_flag_preparse` does: an unknown or
/// repeated flag stops at once; bad values are all read, and the last error
/// message wins. `key` is checked for base64 when `b` is present.
pub(crate) fn parse_flags<'a>(tokens: &[&'a [u8]], key: &[u8]) -> Result<MetaFlags<'a>, ErrorKind> {
    let mut flags = MetaFlags::new();
    let mut failed = false;
    let mut message = ErrorKind::BadCommandLineFormat;
    for token in tokens {
        let Some((&first, value)) = token.split_first() else {
            continue;
        };
        let flag = match MetaFlag::from_byte(first) {
            Some(flag) if !flags.contains(flag) => flag,
            // memcached reports bytes >= 127 as duplicates.
            Some(_) => return Err(ErrorKind::DuplicateFlag),
            None if first >= 127 => return Err(ErrorKind::DuplicateFlag),
            None => return Err(ErrorKind::InvalidFlag),
        };
        let mut outcome = flags.record(flag, value);
        if flag == MetaFlag::Base64Key && !is_base64_key(key) {
            outcome = Err(ValueError {
                message: Some(ErrorKind::KeyDecode),
            });
        }
        if let Err(error) = outcome {
            failed = true;
            message = error.message.unwrap_or(message);
        }
    }
    if failed { Err(message) } else { Ok(flags) }
}

/// The opaque token's checks, which memcached makes after the flags parse.
/// Control characters are refused too: the token is echoed to the client.
pub(crate) fn check_opaque(flags: &MetaFlags<'_>) -> Result<(), ErrorKind> {
    let Some(opaque) = flags.opaque() else {
        return Ok(());
    };
    if opaque.len() + 1 > OPAQUE_TOKEN_LENGTH_MAX {
        return Err(ErrorKind::OpaqueTooLong);
    }
    if opaque.iter().any(|&b| is_control(b)) {
        return Err(ErrorKind::BadToken);
    }
    Ok(())
}

/// What `ms` stores (`M` flag); memcached upgrades `Set`/`Replace` with a `C`
/// flag to a compare-and-swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SetMode {
    /// `S`, the default.
    #[default]
    Set,
    /// `E`: store only if absent.
    Add,
    /// `R`: store only if present.
    Replace,
    /// `A`: append to the present value.
    Append,
    /// `P`: prepend to the present value.
    Prepend,
}

impl SetMode {
    /// The mode for an `M` character, if `ms` knows it.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            b'S' => Some(Self::Set),
            b'E' => Some(Self::Add),
            b'R' => Some(Self::Replace),
            b'A' => Some(Self::Append),
            b'P' => Some(Self::Prepend),
            _ => None,
        }
    }

    /// The `M` character.
    pub fn as_byte(self) -> u8 {
        match self {
            Self::Set => b'S',
            Self::Add => b'E',
            Self::Replace => b'R',
            Self::Append => b'A',
            Self::Prepend => b'P',
        }
    }

    pub(crate) fn from_flags(flags: &MetaFlags<'_>) -> Result<Self, ErrorKind> {
        flags.mode().map_or(Ok(Self::Set), |m| {
            Self::from_byte(m).ok_or(ErrorKind::InvalidSetMode)
        })
    }
}

/// Increment or decrement, for `incr`/`decr` and `ma`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ArithmeticOp {
    /// Add, wrapping at 2^64.
    #[default]
    Incr,
    /// Subtract, stopping at 0.
    Decr,
}

impl ArithmeticOp {
    /// The op for an `ma` `M` character (`I`/`+` or `D`/`-`).
    pub fn from_mode_byte(byte: u8) -> Option<Self> {
        match byte {
            b'I' | b'+' => Some(Self::Incr),
            b'D' | b'-' => Some(Self::Decr),
            _ => None,
        }
    }

    /// The canonical `ma` `M` character.
    pub fn as_mode_byte(self) -> u8 {
        match self {
            Self::Incr => b'I',
            Self::Decr => b'D',
        }
    }

    pub(crate) fn from_flags(flags: &MetaFlags<'_>) -> Result<Self, ErrorKind> {
        flags.mode().map_or(Ok(Self::Incr), |m| {
            Self::from_mode_byte(m).ok_or(ErrorKind::InvalidArithmeticMode)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(tokens: &[&'static str], key: &[u8]) -> Result<MetaFlags<'static>, ErrorKind> {
        let tokens: Vec<&[u8]> = tokens.iter().map(|t| t.as_bytes()).collect();
        parse_flags(&tokens, key)
    }

    #[test]
    fn every_flag_round_trips_its_byte() {
        for flag in MetaFlag::ALL {
            assert_eq!(MetaFlag::from_byte(flag.as_byte()), Some(flag));
        }
        assert_eq!(MetaFlag::from_byte(b'S'), None);
        assert_eq!(MetaFlag::from_byte(b'Y'), None);
    }

    #[test]
    fn values_are_typed_and_order_kept() {
        let f = flags(
            &[
                "v", "T30", "Oab", "k", "F7", "C9", "E10", "N-1", "R5", "D3", "J4", "MD",
            ],
            b"k",
        )
        .unwrap();
        assert!(f.return_value());
        assert_eq!(f.ttl_s(), Some(30));
        assert_eq!(f.opaque(), Some(&b"ab"[..]));
        assert_eq!(f.client_flags(), Some(7));
        assert_eq!(f.compare_cas(), Some(9));
        assert_eq!(f.new_cas(), Some(10));
        assert_eq!(f.vivify_ttl_s(), Some(-1));
        assert_eq!(f.recache_ttl_s(), Some(5));
        assert_eq!(f.delta(), Some(3));
        assert_eq!(f.initial(), Some(4));
        assert_eq!(f.mode(), Some(b'D'));
        let order: Vec<u8> = f.iter().map(MetaFlag::as_byte).collect();
        assert_eq!(order, b"vTOkFCENRDJM");
    }

    #[test]
    fn boolean_flags_ignore_trailing_bytes_like_memcached() {
        let f = flags(&["vx", "kfoo"], b"k").unwrap();
        assert!(f.return_value() && f.contains(MetaFlag::ReturnKey));
    }

    #[test]
    fn unknown_and_duplicate_flags_stop_at_once() {
        assert_eq!(flags(&["Y"], b"k"), Err(ErrorKind::InvalidFlag));
        assert_eq!(flags(&["S5"], b"k"), Err(ErrorKind::InvalidFlag));
        assert_eq!(flags(&["v", "v"], b"k"), Err(ErrorKind::DuplicateFlag));
        assert_eq!(flags(&["\u{80}"], b"k"), Err(ErrorKind::DuplicateFlag));
        // A bad value before an unknown flag: the unknown flag's message.
        assert_eq!(flags(&["Tx", "Y"], b"k"), Err(ErrorKind::InvalidFlag));
        // A flag with a bad value still counts as seen.
        assert_eq!(flags(&["Tx", "T1"], b"k"), Err(ErrorKind::DuplicateFlag));
    }

    #[test]
    fn last_value_error_wins_and_f_keeps_the_previous_message() {
        assert_eq!(flags(&["Tx", "Dx"], b"k"), Err(ErrorKind::InvalidDelta));
        assert_eq!(flags(&["Dx", "Tx"], b"k"), Err(ErrorKind::BadToken));
        assert_eq!(flags(&["Tx", "Fx"], b"k"), Err(ErrorKind::BadToken));
        assert_eq!(flags(&["Fx"], b"k"), Err(ErrorKind::BadCommandLineFormat));
        assert_eq!(
            flags(&["F4294967296"], b"k"),
            Err(ErrorKind::BadCommandLineFormat)
        );
        assert_eq!(flags(&["b", "Tx"], b"qe"), Err(ErrorKind::BadToken));
        assert_eq!(flags(&["Tx", "b"], b"qe"), Err(ErrorKind::KeyDecode));
    }

    #[test]
    fn mode_token_is_one_character() {
        assert_eq!(flags(&["M"], b"k"), Err(ErrorKind::ModeTokenLength));
        assert_eq!(flags(&["MEE"], b"k"), Err(ErrorKind::ModeTokenLength));
        let f = flags(&["Mz"], b"k").unwrap();
        assert_eq!(SetMode::from_flags(&f), Err(ErrorKind::InvalidSetMode));
        assert_eq!(
            ArithmeticOp::from_flags(&f),
            Err(ErrorKind::InvalidArithmeticMode)
        );
        for (byte, mode) in [
            (b'S', SetMode::Set),
            (b'E', SetMode::Add),
            (b'R', SetMode::Replace),
        ] {
            assert_eq!(SetMode::from_byte(byte), Some(mode));
            assert_eq!(mode.as_byte(), byte);
        }
        assert_eq!(ArithmeticOp::from_mode_byte(b'+'), Some(ArithmeticOp::Incr));
        assert_eq!(ArithmeticOp::from_mode_byte(b'-'), Some(ArithmeticOp::Decr));
    }

    #[test]
    fn opaque_limits() {
        let ok = "O".to_string() + &"o".repeat(OPAQUE_TOKEN_LENGTH_MAX - 1);
        let long = "O".to_string() + &"o".repeat(OPAQUE_TOKEN_LENGTH_MAX);
        let ok: &'static str = Box::leak(ok.into_boxed_str());
        let long: &'static str = Box::leak(long.into_boxed_str());
        assert_eq!(check_opaque(&flags(&[ok], b"k").unwrap()), Ok(()));
        assert_eq!(
            check_opaque(&flags(&[long], b"k").unwrap()),
            Err(ErrorKind::OpaqueTooLong)
        );
        assert_eq!(
            check_opaque(&flags(&["Oa\u{1}"], b"k").unwrap()),
            Err(ErrorKind::BadToken)
        );
        assert_eq!(check_opaque(&flags(&["O"], b"k").unwrap()), Ok(()));
    }

    #[test]
    fn push_builds_the_same_set_as_parsing() {
        let mut built = MetaFlags::new();
        built.push(MetaFlag::ReturnValue, b"").unwrap();
        built.push(MetaFlag::Ttl, b"30").unwrap();
        assert_eq!(
            built.push(MetaFlag::Ttl, b"31"),
            Err(ErrorKind::DuplicateFlag)
        );
        assert_eq!(built, flags(&["v", "T30"], b"k").unwrap());
        let mut full = MetaFlags::new();
        for flag in MetaFlag::ALL
            .into_iter()
            .filter(|f| *f != MetaFlag::Mode)
            .take(META_FLAGS_MAX)
        {
            full.push(flag, b"1").unwrap();
        }
        assert_eq!(
            full.push(MetaFlag::Mode, b"S"),
            Err(ErrorKind::FlagsTooLong)
        );
    }
}
