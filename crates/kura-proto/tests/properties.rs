//! Properties of the parser on hostile and on well-formed input.
//!
//! - Any bytes: no panic, and every answer keeps the framing invariants.
//! - A rendered request parses back to itself, alone or pipelined, and
//!   whatever parses renders to bytes that parse the same.
//! - Every strict prefix of a rendered request is incomplete.

use kura_proto::{
    ArithmeticOp, MetaArithmetic, MetaFlag, MetaFlags, MetaRequest, MetaSet, Parsed, ParserLimits,
    CrawlerCommand, MetadumpClasses, Recovery, Request, Retrieval, RetrievalCommand, SetMode, ShutdownMode, Storage, WatchFlags,
    StorageCommand, TuningReply,
    Tokens, encode_base64, parse, render_request,
};
use proptest::prelude::*;

/// Parses `buf` as a connection would, request after request, checking the
/// invariants of every answer. Returns how many requests parsed.
fn drive(mut buf: &[u8], limits: &ParserLimits) -> usize {
    let mut requests = 0;
    loop {
        match parse(buf, limits) {
            Ok(Parsed::Incomplete { frame_bytes }) => {
                if let Some(frame) = frame_bytes {
                    assert!(
                        frame > buf.len(),
                        "incomplete frame {frame} fits in {}",
                        buf.len()
                    );
                }
                return requests;
            }
            Ok(Parsed::Complete {
                request,
                consumed_bytes,
            }) => {
                assert!((1..=buf.len()).contains(&consumed_bytes));
                assert_reparses(&request, limits);
                requests += 1;
                buf = &buf[consumed_bytes..];
            }
            Err(error) => {
                let skip = match error.recovery {
                    Recovery::Close => return requests,
                    Recovery::Continue => error.consumed_bytes,
                    Recovery::Swallow { data_bytes } => {
                        assert!(data_bytes >= 2);
                        error.consumed_bytes.saturating_add(data_bytes)
                    }
                };
                assert!((1..=buf.len()).contains(&error.consumed_bytes), "{error:?}");
                assert!(!error.kind.reply().contains('\n'));
                buf = buf.get(skip..).unwrap_or_default();
            }
        }
    }
}

/// What parsed renders, canonically, to bytes that parse to the same request.
fn assert_reparses(request: &Request<'_>, limits: &ParserLimits) {
    let wire = rendered(request);
    // Rendering ends lines with \r\n: one byte more than a bare \n line.
    let limits = ParserLimits {
        line_length_max: limits.line_length_max + 1,
        retrieval_line_length_max: limits.retrieval_line_length_max + 1,
        ..*limits
    };
    match parse(&wire, &limits) {
        Ok(Parsed::Complete {
            request: again,
            consumed_bytes,
        }) => {
            assert_eq!(&again, request, "{:?}", String::from_utf8_lossy(&wire));
            assert_eq!(consumed_bytes, wire.len());
        }
        other => panic!(
            "{:?} re-parsed as {other:?}",
            String::from_utf8_lossy(&wire)
        ),
    }
}

fn tight_limits() -> ParserLimits {
    ParserLimits {
        key_length_max: 8,
        item_size_max_bytes: 16,
        line_length_max: 40,
        retrieval_line_length_max: 64,
        keys_per_get_max: 3,
    }
}

const COMMANDS: [&str; 27] = [
    "get",
    "gets",
    "gat",
    "gats",
    "set",
    "add",
    "replace",
    "append",
    "prepend",
    "cas",
    "incr",
    "decr",
    "delete",
    "touch",
    "flush_all",
    "version",
    "verbosity",
    "quit",
    "stats",
    "shutdown",
    "cache_memlimit",
    "mg",
    "ms",
    "md",
    "ma",
    "mn",
    "me",
];

/// Arguments that steer random lines into the parser's deeper paths.
fn argument() -> impl Strategy<Value = Vec<u8>> {
    let words = [
        "noreply",
        "0",
        "1",
        "2",
        "5",
        "-1",
        "+5",
        "4294967296",
        "18446744073709551616",
        "2147483647",
        "v",
        "k",
        "q",
        "b",
        "c",
        "f",
        "s",
        "t",
        "O",
        "Oabc",
        "T10",
        "Tx",
        "N5",
        "R3",
        "MS",
        "ME",
        "MI",
        "M-",
        "MX",
        "M",
        "D5",
        "J",
        "C1",
        "E2",
        "F7",
        "Fx",
        "x",
        "I",
        "P",
        "Lpath",
        "bTE=",
        "graceful",
    ];
    prop_oneof![
        6 => proptest::sample::select(words.to_vec()).prop_map(|w| w.as_bytes().to_vec()),
        3 => proptest::collection::vec(b'a'..=b'z', 1..8),
        1 => proptest::collection::vec(any::<u8>(), 1..6),
        1 => proptest::collection::vec(b'a'..=b'z', 245..255),
    ]
}

fn line_end() -> impl Strategy<Value = &'static [u8]> {
    proptest::sample::select(vec![
        &b"\r\n"[..],
        b"\r\n",
        b"\r\n",
        b"\n",
        b"\r",
        b"",
        b"\r\r\n",
        b" \r\n",
    ])
}

/// A command line: mostly a real command name and plausible arguments.
fn command_line() -> impl Strategy<Value = Vec<u8>> {
    let name = prop_oneof![
        8 => proptest::sample::select(COMMANDS.to_vec()).prop_map(|c| c.as_bytes().to_vec()),
        1 => argument(),
    ];
    (
        name,
        proptest::collection::vec(argument(), 0..7),
        line_end(),
    )
        .prop_map(|(name, args, end)| {
            let mut line = name;
            for arg in args {
                line.push(b' ');
                line.extend_from_slice(&arg);
            }
            line.extend_from_slice(end);
            line
        })
}

/// A stream of protocol-looking lines, data blocks and junk.
fn hostile_stream() -> impl Strategy<Value = Vec<u8>> {
    let data = proptest::sample::select(vec![
        &b"x\r\n"[..],
        b"hi\r\n",
        b"hello\r\n",
        b"\r\n",
        b"abc",
    ]);
    let chunk = prop_oneof![
        6 => command_line(),
        2 => data.prop_map(<[u8]>::to_vec),
        1 => proptest::collection::vec(any::<u8>(), 0..64),
    ];
    proptest::collection::vec(chunk, 0..16).prop_map(|chunks| chunks.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_keep_the_invariants(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        drive(&bytes, &ParserLimits::default());
        drive(&bytes, &tight_limits());
    }

    #[test]
    fn protocol_looking_streams_keep_the_invariants(stream in hostile_stream()) {
        drive(&stream, &ParserLimits::default());
        drive(&stream, &tight_limits());
    }
}

/// Owned inputs from which a [`Request`] is built by borrowing.
#[derive(Debug, Clone)]
enum Spec {
    Storage {
        command: StorageCommand,
        key: Vec<u8>,
        flags: u32,
        exptime: i64,
        cas: u64,
        noreply: bool,
        data: Vec<u8>,
    },
    Retrieval {
        command: RetrievalCommand,
        exptime: i64,
        keys: Vec<u8>,
    },
    Delete {
        key: Vec<u8>,
        noreply: bool,
    },
    Arithmetic {
        op: ArithmeticOp,
        key: Vec<u8>,
        delta: u64,
        noreply: bool,
    },
    Touch {
        key: Vec<u8>,
        exptime: i64,
        noreply: bool,
    },
    FlushAll {
        delay: Option<i64>,
        noreply: bool,
    },
    Verbosity {
        level: u32,
        noreply: bool,
    },
    CacheMemlimit {
        limit: u32,
        noreply: bool,
    },
    Stats {
        args: Vec<u8>,
    },
    Fixed(Request<'static>),
    Meta {
        code: u8,
        key: Vec<u8>,
        flags: Vec<(MetaFlag, Vec<u8>)>,
        data: Vec<u8>,
    },
    MetaDebug {
        key: Vec<u8>,
        base64: bool,
    },
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![0x21u8..=0x7e, 0x80u8..=0xff];
    prop_oneof![
        proptest::collection::vec(byte.clone(), 1..12),
        proptest::collection::vec(byte, 240..=250),
    ]
}

/// Space-separated printable tokens.
fn words(min: usize, max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(key(), min..max).prop_map(|keys| keys.join(&b' '))
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..300)
}

fn classic_spec() -> impl Strategy<Value = Spec> {
    let storage_command = proptest::sample::select(vec![
        StorageCommand::Set,
        StorageCommand::Add,
        StorageCommand::Replace,
        StorageCommand::Append,
        StorageCommand::Prepend,
        StorageCommand::Cas,
    ]);
    let retrieval_command = proptest::sample::select(vec![
        RetrievalCommand::Get,
        RetrievalCommand::Gets,
        RetrievalCommand::Gat,
        RetrievalCommand::Gats,
    ]);
    let op = prop_oneof![Just(ArithmeticOp::Incr), Just(ArithmeticOp::Decr)];
    prop_oneof![
        (
            storage_command,
            key(),
            any::<u32>(),
            any::<i64>(),
            any::<u64>(),
            any::<bool>(),
            data()
        )
            .prop_map(
                |(command, key, flags, exptime, cas, noreply, data)| Spec::Storage {
                    command,
                    key,
                    flags,
                    exptime,
                    cas,
                    noreply,
                    data
                }
            ),
        (retrieval_command, any::<i64>(), words(1, 20)).prop_map(|(command, exptime, keys)| {
            Spec::Retrieval {
                command,
                exptime,
                keys,
            }
        }),
        (key(), any::<bool>()).prop_map(|(key, noreply)| Spec::Delete { key, noreply }),
        (op, key(), any::<u64>(), any::<bool>()).prop_map(|(op, key, delta, noreply)| {
            Spec::Arithmetic {
                op,
                key,
                delta,
                noreply,
            }
        }),
        (key(), any::<i64>(), any::<bool>()).prop_map(|(key, exptime, noreply)| Spec::Touch {
            key,
            exptime,
            noreply
        }),
        (proptest::option::of(any::<i64>()), any::<bool>())
            .prop_map(|(delay, noreply)| Spec::FlushAll { delay, noreply }),
        (any::<u32>(), any::<bool>())
            .prop_map(|(level, noreply)| Spec::Verbosity { level, noreply }),
        (any::<u32>(), any::<bool>())
            .prop_map(|(limit, noreply)| Spec::CacheMemlimit { limit, noreply }),
        words(0, 4).prop_map(|args| Spec::Stats { args }),
        proptest::sample::select(vec![
            Request::Version,
            Request::Sync { noreply: false },
            Request::Sync { noreply: true },
            Request::Quit,
            Request::MetaNoop,
            Request::Shutdown(ShutdownMode::Immediate),
            Request::Shutdown(ShutdownMode::Graceful),
            Request::Shutdown(ShutdownMode::Invalid),
            Request::Metadump(MetadumpClasses::All),
            Request::Metadump(MetadumpClasses::Hash),
            Request::Metadump(MetadumpClasses::Invalid),
            Request::Mgdump(MetadumpClasses::Hash),
            Request::Watch(WatchFlags::FETCHERS),
            Request::Watch(WatchFlags::MUTATIONS.with(WatchFlags::CONNEVENTS).with(WatchFlags::EVICTIONS)),
            Request::Mgdump(MetadumpClasses::Classes(0b1010)),
            Request::LruCrawler(CrawlerCommand::Crawl(MetadumpClasses::All)),
            Request::LruCrawler(CrawlerCommand::Crawl(MetadumpClasses::Hash)),
            Request::LruCrawler(CrawlerCommand::Crawl(MetadumpClasses::Invalid)),
            Request::LruCrawler(CrawlerCommand::Crawl(MetadumpClasses::Classes(0b1010))),
            Request::LruCrawler(CrawlerCommand::Enable),
            Request::LruCrawler(CrawlerCommand::Disable),
            Request::LruCrawler(CrawlerCommand::Sleep(0)),
            Request::LruCrawler(CrawlerCommand::Sleep(1_000_000)),
            Request::LruCrawler(CrawlerCommand::ToCrawl(u32::MAX)),
            Request::Tuning(TuningReply::Ok),
            Request::Tuning(TuningReply::NoSpare),
            Request::Tuning(TuningReply::BadClass),
            Request::Tuning(TuningReply::HotWarmOver80),
        ])
        .prop_map(Spec::Fixed),
        (1u64..u64::MAX).prop_map(|bits| Spec::Fixed(Request::Metadump(MetadumpClasses::Classes((bits & !1).max(2))))),
    ]
}

/// A flag with a token its parser accepts; `code` picks valid modes.
fn flag_with_token(code: u8) -> impl Strategy<Value = (MetaFlag, Vec<u8>)> {
    let modes: Vec<u8> = match code {
        b's' => b"SERAP".to_vec(),
        b'a' => b"I+D-".to_vec(),
        _ => (0x21u8..=0x7e).collect(),
    };
    let flag = proptest::sample::select(
        MetaFlag::ALL
            .iter()
            .copied()
            .filter(|f| *f != MetaFlag::Base64Key)
            .collect::<Vec<_>>(),
    );
    (
        flag,
        any::<i64>(),
        any::<u64>(),
        proptest::sample::select(modes),
        proptest::collection::vec(0x21u8..=0x7e, 0..=31),
    )
        .prop_map(|(flag, signed, unsigned, mode, opaque)| {
            let token = match flag {
                MetaFlag::Ttl | MetaFlag::Vivify | MetaFlag::Recache => {
                    signed.to_string().into_bytes()
                }
                MetaFlag::ClientFlags => (unsigned as u32).to_string().into_bytes(),
                MetaFlag::CompareCas | MetaFlag::NewCas | MetaFlag::Delta | MetaFlag::Initial => {
                    unsigned.to_string().into_bytes()
                }
                MetaFlag::Mode => vec![mode],
                MetaFlag::Opaque => opaque,
                _ => Vec::new(),
            };
            (flag, token)
        })
}

fn meta_spec() -> impl Strategy<Value = Spec> {
    let code = proptest::sample::select(b"gsda".to_vec());
    let binary_key = proptest::collection::vec(any::<u8>(), 1..=186);
    (code, any::<bool>(), key(), binary_key, data()).prop_flat_map(
        |(code, base64, key, binary_key, data)| {
            let key = if base64 {
                let mut encoded = Vec::new();
                encode_base64(&binary_key, &mut encoded);
                encoded
            } else {
                key
            };
            let flags_max = if code == b's' { 15 } else { 16 };
            proptest::collection::vec(flag_with_token(code), 0..flags_max).prop_map(
                move |mut flags| {
                    // Keep the first of each flag: repeats are a different test.
                    let mut seen = Vec::new();
                    flags.retain(|(flag, _)| {
                        !seen.contains(flag) && {
                            seen.push(*flag);
                            true
                        }
                    });
                    if base64 {
                        flags.push((MetaFlag::Base64Key, Vec::new()));
                    }
                    Spec::Meta {
                        code,
                        key: key.clone(),
                        flags,
                        data: data.clone(),
                    }
                },
            )
        },
    )
}

fn spec() -> impl Strategy<Value = Spec> {
    prop_oneof![
        3 => classic_spec(),
        3 => meta_spec(),
        1 => (key(), any::<bool>()).prop_map(|(key, base64)| {
            if base64 {
                let mut encoded = Vec::new();
                encode_base64(&key[..key.len().min(186)], &mut encoded);
                Spec::MetaDebug { key: encoded, base64 }
            } else {
                Spec::MetaDebug { key, base64 }
            }
        }),
    ]
}

fn build(spec: &Spec) -> Request<'_> {
    match spec {
        Spec::Storage {
            command,
            key,
            flags,
            exptime,
            cas,
            noreply,
            data,
        } => Request::Storage(Storage {
            command: *command,
            key,
            client_flags: *flags,
            exptime_s: *exptime,
            cas_unique: (*command == StorageCommand::Cas).then_some(*cas),
            noreply: *noreply,
            data,
        }),
        Spec::Retrieval {
            command,
            exptime,
            keys,
        } => Request::Retrieval(Retrieval {
            command: *command,
            exptime_s: command.touches().then_some(*exptime),
            keys: Tokens::new(keys),
        }),
        Spec::Delete { key, noreply } => Request::Delete {
            key,
            noreply: *noreply,
        },
        Spec::Arithmetic {
            op,
            key,
            delta,
            noreply,
        } => Request::Arithmetic {
            op: *op,
            key,
            delta: *delta,
            noreply: *noreply,
        },
        Spec::Touch {
            key,
            exptime,
            noreply,
        } => Request::Touch {
            key,
            exptime_s: *exptime,
            noreply: *noreply,
        },
        Spec::FlushAll { delay, noreply } => Request::FlushAll {
            delay_s: *delay,
            noreply: *noreply,
        },
        Spec::Verbosity { level, noreply } => Request::Verbosity {
            level: *level,
            noreply: *noreply,
        },
        Spec::CacheMemlimit { limit, noreply } => Request::CacheMemlimit {
            limit_mb: *limit,
            noreply: *noreply,
        },
        Spec::Stats { args } => Request::Stats {
            args: Tokens::new(args),
        },
        Spec::Fixed(request) => *request,
        Spec::Meta {
            code,
            key,
            flags,
            data,
        } => build_meta(*code, key, flags, data),
        Spec::MetaDebug { key, base64 } => Request::MetaDebug {
            key,
            base64_key: *base64,
        },
    }
}

fn build_meta<'a>(
    code: u8,
    key: &'a [u8],
    tokens: &'a [(MetaFlag, Vec<u8>)],
    data: &'a [u8],
) -> Request<'a> {
    let mut flags = MetaFlags::new();
    for (flag, token) in tokens {
        flags.push(*flag, token).expect("generated flags are valid");
    }
    match code {
        b'g' => Request::MetaGet(MetaRequest { key, flags }),
        b'd' => Request::MetaDelete(MetaRequest { key, flags }),
        b's' => {
            let mode = flags
                .mode()
                .and_then(SetMode::from_byte)
                .unwrap_or_default();
            Request::MetaSet(MetaSet {
                key,
                flags,
                mode,
                data,
            })
        }
        _ => {
            let op = flags
                .mode()
                .and_then(ArithmeticOp::from_mode_byte)
                .unwrap_or_default();
            Request::MetaArithmetic(MetaArithmetic { key, flags, op })
        }
    }
}

fn rendered(request: &Request<'_>) -> Vec<u8> {
    let mut wire = Vec::new();
    render_request(&mut wire, request);
    wire
}

proptest! {
    #[test]
    fn rendered_requests_parse_back(spec in spec()) {
        let request = build(&spec);
        let wire = rendered(&request);
        match parse(&wire, &ParserLimits::default()) {
            Ok(Parsed::Complete { request: parsed, consumed_bytes }) => {
                prop_assert_eq!(parsed, request);
                prop_assert_eq!(consumed_bytes, wire.len());
            }
            other => prop_assert!(false, "{:?} from {:?}", other, String::from_utf8_lossy(&wire)),
        }
    }

    #[test]
    fn strict_prefixes_are_incomplete(spec in spec()) {
        let wire = rendered(&build(&spec));
        for end in 0..wire.len() {
            match parse(&wire[..end], &ParserLimits::default()) {
                Ok(Parsed::Incomplete { frame_bytes }) => {
                    prop_assert!(frame_bytes.is_none_or(|frame| frame == wire.len()));
                }
                other => prop_assert!(false, "prefix {} of {:?}: {:?}", end, String::from_utf8_lossy(&wire), other),
            }
        }
    }

    #[test]
    fn pipelined_requests_parse_in_order(specs in proptest::collection::vec(spec(), 1..8)) {
        let requests: Vec<Request<'_>> = specs.iter().map(build).collect();
        let wire: Vec<u8> = requests.iter().flat_map(rendered).collect();
        let mut rest = &wire[..];
        for expected in &requests {
            match parse(rest, &ParserLimits::default()) {
                Ok(Parsed::Complete { request, consumed_bytes }) => {
                    prop_assert_eq!(&request, expected);
                    rest = &rest[consumed_bytes..];
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }
        prop_assert!(rest.is_empty());
    }
}
