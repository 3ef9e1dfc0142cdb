//! Unit tests: every command, flag and error path. Expected replies are the
//! ones memcached 1.6.18 sent for the same input (see also
//! `tests/memcached_transcripts.rs`, which replays whole exchanges).

use super::*;
use crate::error::Recovery;
use crate::lex::Tokens;
use crate::limits::{KEY_LENGTH_MAX, LINE_LENGTH_MAX, RETRIEVAL_LINE_LENGTH_MAX};
use crate::meta::{ArithmeticOp, MetaFlag, SetMode};
use crate::request::{CrawlerCommand, TuningReply, MetadumpClasses, ShutdownMode, Storage, StorageCommand, WatchFlags};

fn limits() -> ParserLimits {
    ParserLimits::default()
}

#[track_caller]
fn ok(input: &[u8]) -> Request<'_> {
    match parse(input, &limits()) {
        Ok(Parsed::Complete {
            request,
            consumed_bytes,
        }) => {
            assert_eq!(consumed_bytes, input.len(), "whole input is one request");
            request
        }
        other => panic!(
            "{:?}: expected a request, got {other:?}",
            String::from_utf8_lossy(input)
        ),
    }
}

#[track_caller]
fn err(input: &[u8]) -> ParseError {
    match parse(input, &limits()) {
        Err(error) => error,
        other => panic!(
            "{:?}: expected an error, got {other:?}",
            String::from_utf8_lossy(input)
        ),
    }
}

/// The error's reply (`None` under noreply), checking it consumed the line only.
#[track_caller]
fn line_error(input: &[u8]) -> (Option<&'static str>, Recovery) {
    let error = err(input);
    let line_bytes = input.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
    assert_eq!(
        error.consumed_bytes,
        line_bytes,
        "{:?}",
        String::from_utf8_lossy(input)
    );
    (error.reply(), error.recovery)
}

#[track_caller]
fn reply(input: &[u8]) -> &'static str {
    let (reply, recovery) = line_error(input);
    assert_eq!(recovery, Recovery::Continue);
    reply.expect("a reply")
}

#[track_caller]
fn silent(input: &[u8]) {
    let (reply, recovery) = line_error(input);
    assert_eq!(reply, None, "{:?}", String::from_utf8_lossy(input));
    assert_eq!(recovery, Recovery::Continue);
}

#[track_caller]
fn incomplete(input: &[u8]) -> Option<usize> {
    match parse(input, &limits()) {
        Ok(Parsed::Incomplete { frame_bytes }) => frame_bytes,
        other => panic!(
            "{:?}: expected incomplete, got {other:?}",
            String::from_utf8_lossy(input)
        ),
    }
}

const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format";

fn key(len: usize) -> Vec<u8> {
    vec![b'k'; len]
}

fn encoded(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    crate::encode_base64(data, &mut out);
    out
}

fn line_with(parts: &[&[u8]]) -> Vec<u8> {
    let mut line = parts.join(&b' ');
    line.extend_from_slice(b"\r\n");
    line
}

mod framing {
    use super::*;

    #[test]
    fn empty_and_partial_lines_are_incomplete() {
        assert_eq!(incomplete(b""), None);
        assert_eq!(incomplete(b"get a"), None);
        assert_eq!(incomplete(b"get a\r"), None);
    }

    #[test]
    fn bare_newline_ends_a_line_like_memcached() {
        assert!(matches!(ok(b"get a\n"), Request::Retrieval(_)));
        assert_eq!(ok(b"version\n"), Request::Version);
    }

    #[test]
    fn empty_lines_and_short_names_are_errors() {
        for input in [&b"\r\n"[..], b"\n", b" \r\n", b"x\r\n", b"m\r\n", b"\r\r\n"] {
            assert_eq!(reply(input), "ERROR", "{input:?}");
        }
    }

    #[test]
    fn names_are_case_sensitive_and_space_separated_only() {
        for input in [
            &b"GET a\r\n"[..],
            b"get\ta\r\n",
            b"bogus\r\n",
            b"gett a\r\n",
            b"bget a\r\n",
        ] {
            assert_eq!(reply(input), "ERROR", "{input:?}");
        }
    }

    #[test]
    fn leading_and_repeated_spaces_are_skipped() {
        let Request::Retrieval(r) = ok(b"  get  a   b  \r\n") else {
            panic!()
        };
        assert_eq!(r.keys, Tokens::new(b"a b"));
    }

    #[test]
    fn line_at_the_limit_waits_and_past_it_closes() {
        // memcached waits while 2048 bytes lack a newline and closes at 2049.
        let waiting = vec![b'x'; LINE_LENGTH_MAX];
        assert_eq!(incomplete(&waiting), None);
        let too_long = vec![b'x'; LINE_LENGTH_MAX + 1];
        let error = err(&too_long);
        assert_eq!(error.kind, ErrorKind::LineTooLong);
        assert_eq!(error.recovery, Recovery::Close);
        assert_eq!(error.consumed_bytes, 0);
        // The same holds when the newline has arrived beyond the limit.
        let mut late = too_long.clone();
        late.extend_from_slice(b"\r\n");
        assert_eq!(err(&late).kind, ErrorKind::LineTooLong);
        // A line of exactly the limit, then its newline, is parsed.
        let mut fits = b"version ".to_vec();
        fits.resize(LINE_LENGTH_MAX, b'x');
        fits.push(b'\n');
        assert_eq!(ok(&fits), Request::Version);
    }

    #[test]
    fn retrieval_lines_have_their_own_limit() {
        let mut long_get = b"get".to_vec();
        while long_get.len() < 3 * LINE_LENGTH_MAX {
            long_get.extend_from_slice(b" k");
        }
        assert_eq!(incomplete(&long_get), None);
        long_get.extend_from_slice(b"\r\n");
        let Request::Retrieval(r) = ok(&long_get) else {
            panic!()
        };
        assert_eq!(r.keys.len(), 3 * LINE_LENGTH_MAX / 2 - 1);
        for prefix in [&b"gets "[..], b"gat 0 ", b"gats 0 ", b"   get "] {
            let mut line = prefix.to_vec();
            line.resize(LINE_LENGTH_MAX + 10, b'k');
            assert_eq!(incomplete(&line), None, "{prefix:?}");
        }
        let huge = [
            b"get ".as_slice(),
            &vec![b'k'; RETRIEVAL_LINE_LENGTH_MAX - 3],
        ]
        .concat();
        assert_eq!(err(&huge).kind, ErrorKind::LineTooLong);
    }

    #[test]
    fn binary_protocol_is_refused_and_closed() {
        assert!(is_binary_protocol(&[0x80, 0x00]));
        assert!(!is_binary_protocol(b"get a\r\n"));
        let error = err(&[0x80]);
        assert_eq!(error.kind, ErrorKind::BinaryProtocol);
        assert_eq!(error.recovery, Recovery::Close);
    }

    #[test]
    fn pipelined_requests_parse_one_after_another() {
        let input =
            b"set a 0 0 1\r\nx\r\nget a b\r\nmn\r\ndelete a\r\nms b 2 T0\r\nhi\r\nmg b v\r\nver";
        let mut rest = &input[..];
        let mut names = Vec::new();
        while let Ok(Parsed::Complete {
            request,
            consumed_bytes,
        }) = parse(rest, &limits())
        {
            names.push(std::mem::discriminant(&request));
            rest = &rest[consumed_bytes..];
        }
        assert_eq!(names.len(), 6);
        assert_eq!(rest, b"ver");
    }
}

mod storage {
    use super::*;

    #[test]
    fn every_storage_command() {
        for command in [
            StorageCommand::Set,
            StorageCommand::Add,
            StorageCommand::Replace,
            StorageCommand::Append,
            StorageCommand::Prepend,
        ] {
            let input = [command.name(), b" k 5 -1 3\r\nabc\r\n"].concat();
            let expected = Storage {
                command,
                key: b"k",
                client_flags: 5,
                exptime_s: -1,
                cas_unique: None,
                noreply: false,
                data: b"abc",
            };
            assert_eq!(ok(&input), Request::Storage(expected));
        }
        let Request::Storage(cas) = ok(b"cas k 0 0 1 77 noreply\r\nx\r\n") else {
            panic!()
        };
        assert_eq!((cas.cas_unique, cas.noreply), (Some(77), true));
    }

    #[test]
    fn data_may_hold_anything_and_be_empty() {
        let Request::Storage(s) = ok(b"set k 0 0 4\r\n\r\n\0\n\r\n") else {
            panic!()
        };
        assert_eq!(s.data, b"\r\n\0\n");
        let Request::Storage(s) = ok(b"set k 0 0 0\r\n\r\n") else {
            panic!()
        };
        assert_eq!(s.data, b"");
    }

    #[test]
    fn partial_data_is_incomplete_with_the_frame_length() {
        let full = b"set k 0 0 5\r\nhello\r\n";
        for end in 13..full.len() {
            assert_eq!(incomplete(&full[..end]), Some(full.len()), "prefix {end}");
        }
    }

    #[test]
    fn flags_and_numbers() {
        let Request::Storage(s) = ok(b"set k 4294967295 +7 1\r\nx\r\n") else {
            panic!()
        };
        assert_eq!((s.client_flags, s.exptime_s), (u32::MAX, 7));
        let Request::Storage(s) = ok(b"set k 0 4294967296 1\r\nx\r\n") else {
            panic!()
        };
        assert_eq!(s.exptime_s, 4_294_967_296);
    }

    #[test]
    fn extra_token_that_is_not_noreply_is_ignored() {
        // memcached 1.6.18: "set a 0 0 1 norepl" and "set a 0 0 1 2" store.
        for input in [
            &b"set a 0 0 1 norepl\r\nb\r\n"[..],
            b"set a 0 0 1 2\r\nb\r\n",
        ] {
            let Request::Storage(s) = ok(input) else {
                panic!()
            };
            assert!(!s.noreply);
        }
    }

    #[test]
    fn wrong_token_count_is_error_even_with_noreply() {
        for input in [
            &b"set\r\n"[..],
            b"set a 0 0\r\n",
            b"cas a 0 0 1\r\n",
            b"set a 0 0 1 noreply x\r\n",
        ] {
            assert_eq!(reply(input), "ERROR", "{input:?}");
        }
    }

    #[test]
    fn malformed_lines_are_bad_format_and_not_swallowed() {
        let long_key = line_with(&[b"set", &key(KEY_LENGTH_MAX + 1), b"0 0 1"]);
        for input in [
            &long_key[..],
            b"set a -1 0 1\r\n",
            b"set a 4294967296 0 1\r\n",
            b"set a 0x10 0 1\r\n",
            b"set a 1x 0 1\r\n",
            b"set a 1\t 0 1\r\n",
            b"set a 0 99999999999999999999 1\r\n",
            b"set a 0 0 -1\r\n",
            b"set a 0 0 2147483646\r\n",
            b"set a 0 0 99999999999999999999\r\n",
            b"set a\tb 0 0 1\r\n",
            b"cas a 0 0 1 -5\r\n",
            b"cas a 0 0 1 x\r\n",
        ] {
            assert_eq!(
                reply(input),
                BAD_FORMAT,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn noreply_silences_line_errors() {
        let long_key = line_with(&[b"set", &key(KEY_LENGTH_MAX + 1), b"0 0 1 noreply"]);
        silent(&long_key);
        silent(b"set a x 0 1 noreply\r\n");
        silent(b"cas a 0 0 1 x noreply\r\n");
        // memcached takes a trailing "noreply" as the flag even where a number belongs.
        silent(b"set a 0 0 noreply\r\n");
    }

    #[test]
    fn too_large_is_swallowed() {
        let error = err(b"set a 0 0 2000000\r\n");
        assert_eq!(
            error.reply(),
            Some("SERVER_ERROR object too large for cache")
        );
        assert_eq!(
            error.recovery,
            Recovery::Swallow {
                data_bytes: 2_000_002
            }
        );
        assert_eq!(error.consumed_bytes, 19);
        let error = err(b"set a 0 0 1048577 noreply\r\n");
        assert_eq!(
            (error.reply(), error.recovery),
            (
                None,
                Recovery::Swallow {
                    data_bytes: 1_048_579
                }
            )
        );
        let Err(error) = parse(
            b"set a 0 0 11\r\n",
            &ParserLimits {
                item_size_max_bytes: 10,
                ..limits()
            },
        ) else {
            panic!()
        };
        assert_eq!(error.kind, ErrorKind::ObjectTooLarge);
        assert!(
            matches!(ok(&[b"set a 0 0 1048576\r\n".as_slice(), &[b'x'; 1 << 20], b"\r\n"].concat()),
            Request::Storage(s) if s.data.len() == 1 << 20)
        );
    }

    #[test]
    fn bad_data_chunk_consumes_the_block() {
        // memcached reads <bytes>+2 and checks the last two; "abc" after a
        // 1-byte set is a bad chunk, and the following "\r\n" is an empty line.
        let error = err(b"set a 0 0 1\r\nabc\r\n");
        assert_eq!(error.kind, ErrorKind::BadDataChunk);
        assert_eq!(error.consumed_bytes, 16);
        assert_eq!(error.recovery, Recovery::Continue);
        assert_eq!(err(b"set a 0 0 1\r\nab\r\n").consumed_bytes, 16);
        assert_eq!(err(b"set a 0 0 1\r\nb\n\n").kind, ErrorKind::BadDataChunk);
        assert_eq!(err(b"set a 0 0 1 noreply\r\nabc").reply(), None);
    }
}

mod retrieval {
    use super::*;

    #[test]
    fn get_and_gets_take_keys() {
        let Request::Retrieval(r) = ok(b"get a b c\r\n") else {
            panic!()
        };
        assert_eq!(
            (r.command, r.exptime_s, r.keys.len()),
            (RetrievalCommand::Get, None, 3)
        );
        let keys: Vec<&[u8]> = r.keys.iter().collect();
        assert_eq!(keys, [b"a", b"b", b"c"]);
        let Request::Retrieval(r) = ok(b"gets a\r\n") else {
            panic!()
        };
        assert!(r.command.returns_cas() && !r.command.touches());
        // "noreply" is a key to get.
        let Request::Retrieval(r) = ok(b"get a noreply\r\n") else {
            panic!()
        };
        assert_eq!(r.keys.len(), 2);
    }

    #[test]
    fn gat_and_gats_take_an_exptime_first() {
        let Request::Retrieval(r) = ok(b"gat -5 a b\r\n") else {
            panic!()
        };
        assert_eq!(
            (r.command, r.exptime_s, r.keys.len()),
            (RetrievalCommand::Gat, Some(-5), 2)
        );
        let Request::Retrieval(r) = ok(b"gats 10 a\r\n") else {
            panic!()
        };
        assert!(r.command.returns_cas() && r.command.touches());
        // memcached 1.6.18 answers "gat 1" with END: no keys is allowed.
        let Request::Retrieval(r) = ok(b"gat 1\r\n") else {
            panic!()
        };
        assert!(r.keys.is_empty());
    }

    #[test]
    fn errors() {
        for input in [&b"get\r\n"[..], b"get \r\n", b"gets\r\n", b"gat\r\n"] {
            assert_eq!(reply(input), "ERROR", "{input:?}");
        }
        assert_eq!(
            reply(b"gat x a\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        assert_eq!(
            reply(b"gat 99999999999999999999 a\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        let long = line_with(&[b"get a", &key(KEY_LENGTH_MAX + 1), b"b"]);
        assert_eq!(reply(&long), BAD_FORMAT);
        assert_eq!(reply(b"get a\rb\r\n"), BAD_FORMAT);
        let max = line_with(&[b"get", &key(KEY_LENGTH_MAX)]);
        assert!(matches!(ok(&max), Request::Retrieval(_)));
    }

    #[test]
    fn key_count_is_bounded() {
        let few = ParserLimits {
            keys_per_get_max: 2,
            ..limits()
        };
        assert!(parse(b"get a b\r\n", &few).is_ok());
        let error = parse(b"get a b c\r\n", &few).unwrap_err();
        assert_eq!(error.reply(), Some("CLIENT_ERROR too many keys"));
    }
}

mod other_classic {
    use super::*;

    #[test]
    fn delete() {
        assert_eq!(
            ok(b"delete a\r\n"),
            Request::Delete {
                key: b"a",
                noreply: false
            }
        );
        assert_eq!(
            ok(b"delete a 0\r\n"),
            Request::Delete {
                key: b"a",
                noreply: false
            }
        );
        assert_eq!(
            ok(b"delete a noreply\r\n"),
            Request::Delete {
                key: b"a",
                noreply: true
            }
        );
        assert_eq!(
            ok(b"delete a 0 noreply\r\n"),
            Request::Delete {
                key: b"a",
                noreply: true
            }
        );
        assert_eq!(
            ok(b"delete noreply\r\n"),
            Request::Delete {
                key: b"noreply",
                noreply: false
            }
        );
        let usage = "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]";
        assert_eq!(reply(b"delete a 1\r\n"), usage);
        assert_eq!(reply(b"delete a 0 0\r\n"), usage);
        silent(b"delete a x noreply\r\n");
        assert_eq!(reply(b"delete\r\n"), "ERROR");
        assert_eq!(reply(b"delete a b c d\r\n"), "ERROR");
        assert_eq!(
            reply(&line_with(&[b"delete", &key(KEY_LENGTH_MAX + 1)])),
            BAD_FORMAT
        );
        silent(&line_with(&[
            b"delete",
            &key(KEY_LENGTH_MAX + 1),
            b"noreply",
        ]));
    }

    #[test]
    fn incr_decr() {
        let expected = Request::Arithmetic {
            op: ArithmeticOp::Incr,
            key: b"a",
            delta: 1,
            noreply: false,
        };
        assert_eq!(ok(b"incr a 1\r\n"), expected);
        let Request::Arithmetic {
            op, delta, noreply, ..
        } = ok(b"decr a 18446744073709551615 noreply\r\n")
        else {
            panic!()
        };
        assert_eq!((op, delta, noreply), (ArithmeticOp::Decr, u64::MAX, true));
        // A fourth token other than noreply is ignored.
        assert!(matches!(
            ok(b"incr a 1 2\r\n"),
            Request::Arithmetic { noreply: false, .. }
        ));
        let invalid = "CLIENT_ERROR invalid numeric delta argument";
        for input in [
            &b"incr a -1\r\n"[..],
            b"incr a x\r\n",
            b"incr a 18446744073709551616\r\n",
        ] {
            assert_eq!(reply(input), invalid);
        }
        silent(b"incr a x noreply\r\n");
        for input in [
            &b"incr\r\n"[..],
            b"incr a\r\n",
            b"incr a 1 2 3\r\n",
            b"decr a\r\n",
        ] {
            assert_eq!(reply(input), "ERROR");
        }
    }

    #[test]
    fn touch() {
        assert_eq!(
            ok(b"touch a 10\r\n"),
            Request::Touch {
                key: b"a",
                exptime_s: 10,
                noreply: false
            }
        );
        assert_eq!(
            ok(b"touch a -1 noreply\r\n"),
            Request::Touch {
                key: b"a",
                exptime_s: -1,
                noreply: true
            }
        );
        assert_eq!(
            reply(b"touch a x\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        assert_eq!(
            reply(b"touch a 9223372036854775808\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        silent(b"touch a x noreply\r\n");
        assert_eq!(reply(b"touch a\r\n"), "ERROR");
    }

    #[test]
    fn flush_all() {
        assert_eq!(
            ok(b"flush_all\r\n"),
            Request::FlushAll {
                delay_s: None,
                noreply: false
            }
        );
        assert_eq!(
            ok(b"flush_all 0\r\n"),
            Request::FlushAll {
                delay_s: Some(0),
                noreply: false
            }
        );
        assert_eq!(
            ok(b"flush_all -1\r\n"),
            Request::FlushAll {
                delay_s: Some(-1),
                noreply: false
            }
        );
        assert_eq!(
            ok(b"flush_all noreply\r\n"),
            Request::FlushAll {
                delay_s: None,
                noreply: true
            }
        );
        assert_eq!(
            ok(b"flush_all 5 noreply\r\n"),
            Request::FlushAll {
                delay_s: Some(5),
                noreply: true
            }
        );
        assert_eq!(
            ok(b"flush_all 1 2\r\n"),
            Request::FlushAll {
                delay_s: Some(1),
                noreply: false
            }
        );
        assert_eq!(
            reply(b"flush_all x\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        assert_eq!(
            reply(b"flush_all 99999999999999999999\r\n"),
            "CLIENT_ERROR invalid exptime argument"
        );
        silent(b"flush_all x noreply\r\n");
        assert_eq!(reply(b"flush_all 1 2 3\r\n"), "ERROR");
    }

    #[test]
    fn refresh_certs() {
        // memcached looks only at whether the last token is noreply.
        assert_eq!(ok(b"refresh_certs\r\n"), Request::RefreshCerts { noreply: false });
        assert_eq!(ok(b"refresh_certs noreply\r\n"), Request::RefreshCerts { noreply: true });
        assert_eq!(ok(b"refresh_certs a b noreply\r\n"), Request::RefreshCerts { noreply: true });
        assert_eq!(ok(b"refresh_certs noreply x\r\n"), Request::RefreshCerts { noreply: false });
    }

    #[test]
    fn verbosity() {
        assert_eq!(
            ok(b"verbosity 1\r\n"),
            Request::Verbosity {
                level: 1,
                noreply: false
            }
        );
        assert_eq!(
            ok(b"verbosity 1 noreply\r\n"),
            Request::Verbosity {
                level: 1,
                noreply: true
            }
        );
        assert_eq!(
            ok(b"verbosity 1 2\r\n"),
            Request::Verbosity {
                level: 1,
                noreply: false
            }
        );
        assert_eq!(reply(b"verbosity x\r\n"), BAD_FORMAT);
        assert_eq!(reply(b"verbosity -1\r\n"), BAD_FORMAT);
        silent(b"verbosity noreply\r\n");
        assert_eq!(reply(b"verbosity\r\n"), "ERROR");
        assert_eq!(reply(b"verbosity 1 2 3\r\n"), "ERROR");
    }

    #[test]
    fn version_quit_stats_shutdown_memlimit() {
        assert_eq!(ok(b"version\r\n"), Request::Version);
        assert_eq!(ok(b"version x\r\n"), Request::Version);
        assert_eq!(ok(b"sync\r\n"), Request::Sync { noreply: false });
        assert_eq!(ok(b"sync noreply\r\n"), Request::Sync { noreply: true });
        assert_eq!(ok(b"quit\r\n"), Request::Quit);
        assert_eq!(ok(b"quit x\r\n"), Request::Quit);
        assert_eq!(
            ok(b"stats\r\n"),
            Request::Stats {
                args: Tokens::new(b"")
            }
        );
        let Request::Stats { args } = ok(b"stats detail dump\r\n") else {
            panic!()
        };
        assert_eq!((args.first(), args.len()), (Some(&b"detail"[..]), 2));
        assert_eq!(
            ok(b"shutdown\r\n"),
            Request::Shutdown(ShutdownMode::Immediate)
        );
        // What memcached 1.6.18 answers (tests/differential.rs compares the replies).
        assert_eq!(ok(b"lru_crawler metadump all\r\n"), Request::Metadump(MetadumpClasses::All));
        assert_eq!(ok(b"lru_crawler metadump hash\r\n"), Request::Metadump(MetadumpClasses::Hash));
        assert_eq!(ok(b"lru_crawler metadump 1,,3\r\n"), Request::Metadump(MetadumpClasses::Classes(0b1010)));
        assert_eq!(ok(b"lru_crawler metadump 63\r\n"), Request::Metadump(MetadumpClasses::Classes(1 << 63)));
        for bad in [&b"0"[..], b"64", b"-1", b"ALL", b"1,x", b",", b"abc"] {
            let line = [&b"lru_crawler metadump "[..], bad, b"\r\n"].concat();
            assert_eq!(ok(&line), Request::Metadump(MetadumpClasses::Invalid), "{}", String::from_utf8_lossy(bad));
        }
        // watch: memcached 1.6.18's stream names; none is fetchers; anything else is ERROR.
        assert_eq!(ok(b"watch\r\n"), Request::Watch(WatchFlags::FETCHERS));
        assert_eq!(ok(b"watch mutations connevents\r\n"), Request::Watch(WatchFlags::MUTATIONS.with(WatchFlags::CONNEVENTS)));
        assert_eq!(ok(b"watch rawcmds evictions fetchers sysevents proxyreqs proxyevents proxyuser\r\n"), Request::Watch(WatchFlags(0b1_1111_0101)));
        for bad in [&b"watch bogus\r\n"[..], b"watch fetchers deletions\r\n", b"watch FETCHERS\r\n"] {
            assert_eq!(err(bad).kind, ErrorKind::UnknownCommand, "{}", String::from_utf8_lossy(bad));
        }
        // mgdump takes the same classes.
        assert_eq!(ok(b"lru_crawler mgdump all\r\n"), Request::Mgdump(MetadumpClasses::All));
        assert_eq!(ok(b"lru_crawler mgdump hash\r\n"), Request::Mgdump(MetadumpClasses::Hash));
        assert_eq!(ok(b"lru_crawler mgdump 2,5\r\n"), Request::Mgdump(MetadumpClasses::Classes(0b100100)));
        assert_eq!(ok(b"lru_crawler mgdump 99\r\n"), Request::Mgdump(MetadumpClasses::Invalid));
        assert!(MetadumpClasses::Classes(0b1010).includes(3) && !MetadumpClasses::Classes(0b1010).includes(2));
        assert!(MetadumpClasses::All.includes(40) && !MetadumpClasses::Invalid.includes(1));
        for error in [
            &b"lru_crawler metadump\r\n"[..],
            b"lru_crawler metadump all extra\r\n",
            b"lru_crawler mgdump\r\n",
            b"lru_crawler mgdump all extra\r\n",
            b"lru_crawler\r\n",
            b"lru_crawler crawl\r\n",
            b"lru_crawler crawl all extra\r\n",
            b"lru_crawler sleep\r\n",
            b"lru_crawler tocrawl\r\n",
            b"lru_crawler enable x\r\n",
            b"lru_crawler bogus\r\n",
        ] {
            assert_eq!(err(error).kind, ErrorKind::UnknownCommand, "{}", String::from_utf8_lossy(error));
        }
        // The other crawler commands, as memcached 1.6.18 answered them.
        let crawler = |line: &[u8]| match ok(line) {
            Request::LruCrawler(command) => command,
            other => panic!("{other:?}"),
        };
        assert_eq!(crawler(b"lru_crawler crawl all\r\n"), CrawlerCommand::Crawl(MetadumpClasses::All));
        assert_eq!(crawler(b"lru_crawler crawl 1,\r\n"), CrawlerCommand::Crawl(MetadumpClasses::Classes(0b10)));
        assert_eq!(crawler(b"lru_crawler crawl 64\r\n"), CrawlerCommand::Crawl(MetadumpClasses::Invalid));
        assert_eq!(crawler(b"lru_crawler crawl hash\r\n"), CrawlerCommand::Crawl(MetadumpClasses::Hash));
        assert_eq!(crawler(b"lru_crawler enable\r\n"), CrawlerCommand::Enable);
        assert_eq!(crawler(b"lru_crawler disable\r\n"), CrawlerCommand::Disable);
        assert_eq!(crawler(b"lru_crawler sleep 1000000\r\n"), CrawlerCommand::Sleep(1_000_000));
        assert_eq!(crawler(b"lru_crawler tocrawl 4294967295\r\n"), CrawlerCommand::ToCrawl(u32::MAX));
        assert_eq!(crawler(b"lru_crawler tocrawl 4294967296\r\n"), CrawlerCommand::ToCrawl(0));
        assert_eq!(err(b"lru_crawler sleep 1000001\r\n").kind, ErrorKind::CrawlerSleepTooLong);
        // Slab and LRU tuning, as memcached 1.6.18 answers it (tests/differential.rs in
        // kura-server runs the same lines against memcached).
        for (line, want) in [
            (&b"slabs automove 2\r\n"[..], TuningReply::Ok),
            (b"slabs automove 1 2\r\n", TuningReply::Ok),
            (b"slabs reassign 1 2\r\n", TuningReply::NoSpare),
            (b"slabs reassign 0 2\r\n", TuningReply::NoSpare),
            (b"slabs reassign 1 64\r\n", TuningReply::BadClass),
            (b"slabs reassign -1 2\r\n", TuningReply::BadClass),
            (b"lru mode segmented\r\n", TuningReply::Ok),
            (b"lru tune 10 25 0.1 2\r\n", TuningReply::Ok),
            (b"lru tune 90 25 0.1 2\r\n", TuningReply::HotWarmOver80),
            (b"lru temp_ttl -1\r\n", TuningReply::Ok),
        ] {
            assert_eq!(ok(line), Request::Tuning(want), "{}", String::from_utf8_lossy(line));
        }
        for line in [&b"slabs automove 3\r\n"[..], b"slabs\r\n", b"slabs reassign 1\r\n", b"lru mode x\r\n", b"lru tune 10 25 0.1\r\n", b"lru tune x 25 0.1 2\r\n", b"lru temp_ttl x\r\n"] {
            assert_eq!(err(line).kind, ErrorKind::UnknownCommand, "{}", String::from_utf8_lossy(line));
        }
        for line in [&b"slabs automove -1\r\n"[..], b"slabs automove x\r\n", b"slabs reassign x y\r\n"] {
            assert_eq!(err(line).kind, ErrorKind::BadCommandLineFormat, "{}", String::from_utf8_lossy(line));
        }
        for bad in [&b"lru_crawler sleep -1\r\n"[..], b"lru_crawler sleep x\r\n", b"lru_crawler tocrawl x\r\n", b"lru_crawler tocrawl -1\r\n"] {
            assert_eq!(err(bad).kind, ErrorKind::BadCommandLineFormat, "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            ok(b"shutdown graceful\r\n"),
            Request::Shutdown(ShutdownMode::Graceful)
        );
        assert_eq!(
            ok(b"shutdown now\r\n"),
            Request::Shutdown(ShutdownMode::Invalid)
        );
        assert_eq!(
            ok(b"cache_memlimit 100\r\n"),
            Request::CacheMemlimit {
                limit_mb: 100,
                noreply: false
            }
        );
        assert_eq!(
            ok(b"cache_memlimit 8 noreply\r\n"),
            Request::CacheMemlimit {
                limit_mb: 8,
                noreply: true
            }
        );
        assert_eq!(reply(b"cache_memlimit x\r\n"), "ERROR");
        silent(b"cache_memlimit x noreply\r\n");
        assert_eq!(reply(b"cache_memlimit\r\n"), "ERROR");
    }
}

mod meta {
    use super::*;

    fn flags_of(request: Request<'_>) -> Vec<u8> {
        let flags = match request {
            Request::MetaGet(r) | Request::MetaDelete(r) => r.flags,
            Request::MetaSet(s) => s.flags,
            Request::MetaArithmetic(a) => a.flags,
            other => panic!("not a meta request: {other:?}"),
        };
        flags.iter().map(MetaFlag::as_byte).collect()
    }

    #[test]
    fn mg_with_every_flag_it_uses() {
        let input = b"mg foo b c f h k l Oabc q s t u v E9 N30 R10 T60\r\n";
        // "foo" is not base64: the key check comes with the b flag.
        assert_eq!(reply(input), "CLIENT_ERROR error decoding key");
        let input = b"mg Zm9v b c f h k l Oabc q s t u v E9 N30 R10\r\n";
        let Request::MetaGet(r) = ok(input) else {
            panic!()
        };
        assert_eq!(r.key, b"Zm9v");
        assert!(r.flags.base64_key() && r.flags.quiet() && r.flags.return_value());
        assert_eq!(r.flags.opaque(), Some(&b"abc"[..]));
        assert_eq!(
            (
                r.flags.new_cas(),
                r.flags.vivify_ttl_s(),
                r.flags.recache_ttl_s()
            ),
            (Some(9), Some(30), Some(10))
        );
        assert_eq!(flags_of(ok(input)), b"bcfhklOqstuvENR");
    }

    #[test]
    fn mg_bare_and_errors() {
        assert_eq!(flags_of(ok(b"mg foo\r\n")), b"");
        assert_eq!(reply(b"mg\r\n"), "ERROR");
        assert_eq!(reply(b"mg \r\n"), "ERROR");
        assert_eq!(reply(b"mg m1 v v\r\n"), "CLIENT_ERROR duplicate flag");
        assert_eq!(reply(b"mg m1 Y\r\n"), "CLIENT_ERROR invalid flag");
        assert_eq!(
            reply(b"mg m1 Tx\r\n"),
            "CLIENT_ERROR bad token in command line format"
        );
        assert_eq!(
            reply(b"mg m1 T\r\n"),
            "CLIENT_ERROR bad token in command line format"
        );
        assert_eq!(
            reply(b"mg m1 N\r\n"),
            "CLIENT_ERROR bad token in command line format"
        );
        assert_eq!(reply(b"mg qe Fx\r\n"), BAD_FORMAT);
        assert_eq!(
            reply(b"mg qe M\r\n"),
            "CLIENT_ERROR incorrect length for M token"
        );
        assert_eq!(
            reply(b"mg qe Dx\r\n"),
            "CLIENT_ERROR invalid numeric delta value"
        );
        assert_eq!(
            reply(b"mg qe Jx\r\n"),
            "CLIENT_ERROR invalid numeric initial value"
        );
        assert_eq!(reply(b"mg !!! b\r\n"), "CLIENT_ERROR error decoding key");
        assert_eq!(
            reply(&line_with(&[b"mg", &key(KEY_LENGTH_MAX + 1), b"v"])),
            BAD_FORMAT
        );
        assert_eq!(reply(b"mg a\tb v\r\n"), BAD_FORMAT);
        // mg accepts flags it has no use for, and any mode character.
        assert_eq!(flags_of(ok(b"mg m1 F5 C5 Mz I x P L\r\n")), b"FCMIxPL");
    }

    #[test]
    fn meta_flag_count_limits() {
        let seventeen = b"mg zz c f h k l O s t u v P L q F1 C1 I MS\r\n";
        assert_eq!(flags_of(ok(seventeen)).len(), 17);
        let eighteen = b"mg zz c f h k l O s t u v P L q F1 C1 I MS J1\r\n";
        assert_eq!(reply(eighteen), "CLIENT_ERROR options flags are too long");
        assert_eq!(
            reply(&[b"md".as_slice(), &eighteen[2..]].concat()),
            "CLIENT_ERROR options flags too long"
        );
        let sixteen = b"ms zz 2 c f h k l O s t u v P L q F1 C1 I\r\nhi\r\n";
        assert_eq!(flags_of(ok(sixteen)).len(), 16);
        // Seventeen flags on ms: refused before <datalen>, so not swallowed.
        let error = err(b"ms zz 2 c f h k l O s t u v P L q F1 C1 I MS\r\nhi\r\n");
        assert_eq!(
            (error.reply(), error.recovery),
            (
                Some("CLIENT_ERROR options flags too long"),
                Recovery::Continue
            )
        );
    }

    #[test]
    fn opaque_token_length() {
        let fits = [b"mg k O".as_slice(), &[b'o'; 31], b"\r\n"].concat();
        assert!(
            matches!(ok(&fits), Request::MetaGet(r) if r.flags.opaque().map(<[u8]>::len) == Some(31))
        );
        let long = [b"mg k O".as_slice(), &[b'o'; 32], b"\r\n"].concat();
        assert_eq!(reply(&long), "CLIENT_ERROR opaque token too long");
        assert!(
            matches!(ok(b"mg k O\r\n"), Request::MetaGet(r) if r.flags.opaque() == Some(&b""[..]))
        );
    }

    #[test]
    fn ms_modes_flags_and_data() {
        let Request::MetaSet(s) = ok(b"ms k 2 T90 F1 c k Oo q I C5 E6 MA N10\r\nhi\r\n") else {
            panic!()
        };
        assert_eq!(
            (s.key, s.data, s.mode),
            (&b"k"[..], &b"hi"[..], SetMode::Append)
        );
        assert_eq!(
            (
                s.flags.ttl_s(),
                s.flags.client_flags(),
                s.flags.compare_cas()
            ),
            (Some(90), Some(1), Some(5))
        );
        for (byte, mode) in [
            (b'S', SetMode::Set),
            (b'E', SetMode::Add),
            (b'A', SetMode::Append),
            (b'P', SetMode::Prepend),
            (b'R', SetMode::Replace),
        ] {
            let input = [b"ms k 1 M".as_slice(), &[byte], b"\r\nx\r\n"].concat();
            assert!(matches!(ok(&input), Request::MetaSet(s) if s.mode == mode));
        }
        assert!(
            matches!(ok(b"ms k 0\r\n\r\n"), Request::MetaSet(s) if s.mode == SetMode::Set && s.data.is_empty())
        );
        assert_eq!(incomplete(b"ms k 5 T0\r\nhel"), Some(18));
    }

    #[test]
    fn ms_line_errors_are_not_swallowed() {
        assert_eq!(reply(b"ms\r\n"), "ERROR");
        for input in [
            &b"ms m2\r\n"[..],
            b"ms m2 x\r\n",
            b"ms m2 -1\r\n",
            b"ms m2 2147483647\r\n",
        ] {
            assert_eq!(reply(input), BAD_FORMAT, "{input:?}");
        }
        assert_eq!(
            reply(&line_with(&[b"ms", &key(KEY_LENGTH_MAX + 1), b"2"])),
            BAD_FORMAT
        );
    }

    #[test]
    fn ms_flag_errors_swallow_the_data() {
        let cases: [(&[u8], &str); 9] = [
            (
                b"ms m2 2 MX\r\n",
                "CLIENT_ERROR invalid mode for ms M token",
            ),
            (
                b"ms m2 2 MEE\r\n",
                "CLIENT_ERROR incorrect length for M token",
            ),
            (b"ms m2 2 S5\r\n", "CLIENT_ERROR invalid flag"),
            (b"ms m2 2 Q\r\n", "CLIENT_ERROR invalid flag"),
            (b"ms m2 2 Fx\r\n", BAD_FORMAT),
            (
                b"ms m2 2 Cx\r\n",
                "CLIENT_ERROR bad token in command line format",
            ),
            (
                b"ms m2 2 T\r\n",
                "CLIENT_ERROR bad token in command line format",
            ),
            (b"ms m3 2 c k b\r\n", "CLIENT_ERROR error decoding key"),
            (b"ms m2 2 v v\r\n", "CLIENT_ERROR duplicate flag"),
        ];
        for (input, expected) in cases {
            let (got, recovery) = line_error(input);
            assert_eq!(got, Some(expected), "{:?}", String::from_utf8_lossy(input));
            assert_eq!(recovery, Recovery::Swallow { data_bytes: 4 });
        }
        // The mode is checked before the opaque token (memcached 1.6.18).
        let both = [b"ms qe 1 MX O".as_slice(), &[b'o'; 32], b"\r\n"].concat();
        assert_eq!(
            line_error(&both).0,
            Some("CLIENT_ERROR invalid mode for ms M token")
        );
        let long = [b"ms qe 1 O".as_slice(), &[b'o'; 32], b"\r\n"].concat();
        assert_eq!(
            line_error(&long),
            (
                Some("CLIENT_ERROR opaque token too long"),
                Recovery::Swallow { data_bytes: 3 }
            )
        );
        // q does not silence errors.
        let error = err(b"ms m3 2000000 q\r\n");
        assert_eq!(
            (error.reply(), error.recovery),
            (
                Some("SERVER_ERROR object too large for cache"),
                Recovery::Swallow {
                    data_bytes: 2_000_002
                }
            )
        );
        let error = err(b"ms m2 2 q\r\nhix\r\n");
        assert_eq!(
            (error.reply(), error.consumed_bytes),
            (Some("CLIENT_ERROR bad data chunk"), 15)
        );
    }

    #[test]
    fn md_flags() {
        let Request::MetaDelete(r) = ok(b"md aw== b q I T30 C5 E6 x Oz k\r\n") else {
            panic!()
        };
        assert!(r.flags.contains(MetaFlag::RemoveValue) && r.flags.contains(MetaFlag::Invalidate));
        assert_eq!(
            (r.flags.ttl_s(), r.flags.compare_cas(), r.flags.new_cas()),
            (Some(30), Some(5), Some(6))
        );
        assert_eq!(flags_of(ok(b"md k\r\n")), b"");
    }

    #[test]
    fn md_and_ma_report_every_flag_error_alike() {
        for input in [
            &b"md nope Y\r\n"[..],
            b"md nope Tx\r\n",
            b"md qf b\r\n",
            b"md a v v\r\n",
        ] {
            assert_eq!(
                reply(input),
                "CLIENT_ERROR invalid or duplicate flag",
                "{input:?}"
            );
        }
        for input in [
            &b"ma a Dx\r\n"[..],
            b"ma a Jx\r\n",
            b"ma a D-1\r\n",
            b"ma a v v\r\n",
            b"ma a Y\r\n",
        ] {
            assert_eq!(
                reply(input),
                "CLIENT_ERROR invalid or duplicate flag",
                "{input:?}"
            );
        }
        assert_eq!(reply(b"md\r\n"), "ERROR");
        assert_eq!(reply(b"ma\r\n"), "ERROR");
    }

    #[test]
    fn ma_modes_and_defaults() {
        let Request::MetaArithmetic(a) = ok(b"ma a\r\n") else {
            panic!()
        };
        assert_eq!((a.op, a.delta(), a.initial()), (ArithmeticOp::Incr, 1, 0));
        let input = b"ma aw== N0 J5 D18446744073709551615 MD v t c k O9 q T1 C3 E4 b\r\n";
        let Request::MetaArithmetic(a) = ok(input) else {
            panic!()
        };
        assert_eq!(
            (a.op, a.delta(), a.initial()),
            (ArithmeticOp::Decr, u64::MAX, 5)
        );
        assert_eq!(flags_of(ok(input)), b"NJDMvtckOqTCEb");
    }

    #[test]
    fn ma_mode_errors() {
        for (mode, op) in [
            (b'I', ArithmeticOp::Incr),
            (b'+', ArithmeticOp::Incr),
            (b'D', ArithmeticOp::Decr),
            (b'-', ArithmeticOp::Decr),
        ] {
            let input = [b"ma a M".as_slice(), &[mode], b"\r\n"].concat();
            assert!(matches!(ok(&input), Request::MetaArithmetic(a) if a.op == op));
        }
        assert_eq!(
            reply(b"ma a MX\r\n"),
            "CLIENT_ERROR invalid mode for ma M token"
        );
        let both = [b"ma qe O".as_slice(), &[b'o'; 32], b" MX\r\n"].concat();
        assert_eq!(reply(&both), "CLIENT_ERROR invalid mode for ma M token");
    }

    #[test]
    fn mn_and_me() {
        assert_eq!(ok(b"mn\r\n"), Request::MetaNoop);
        assert_eq!(ok(b"mn x\r\n"), Request::MetaNoop);
        assert_eq!(
            ok(b"me foo\r\n"),
            Request::MetaDebug {
                key: b"foo",
                base64_key: false
            }
        );
        assert_eq!(
            ok(b"me Zm9v b\r\n"),
            Request::MetaDebug {
                key: b"Zm9v",
                base64_key: true
            }
        );
        assert_eq!(
            ok(b"me foo x y\r\n"),
            Request::MetaDebug {
                key: b"foo",
                base64_key: false
            }
        );
        for input in [&b"me\r\n"[..], b"me !!! b\r\n", b"me qf b\r\n"] {
            assert_eq!(reply(input), BAD_FORMAT, "{input:?}");
        }
        assert_eq!(
            reply(&line_with(&[b"me", &key(KEY_LENGTH_MAX + 1)])),
            BAD_FORMAT
        );
        for input in [&b"mx\r\n"[..], b"mgg a\r\n", b"m\r\n"] {
            assert_eq!(reply(input), "ERROR", "{input:?}");
        }
    }

    #[test]
    fn base64_keys_are_checked_on_the_raw_token() {
        let raw = encoded(&[0xff; 187]);
        assert_eq!(raw.len(), 252);
        assert_eq!(reply(&line_with(&[b"mg", &raw, b"b"])), BAD_FORMAT);
        let raw = encoded(&[0xff; 186]);
        assert!(matches!(
            ok(&line_with(&[b"mg", &raw, b"b v"])),
            Request::MetaGet(_)
        ));
    }
}
