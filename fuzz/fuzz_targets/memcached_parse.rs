//! Feeds arbitrary bytes to the memcached parser as a connection would,
//! request after request, and checks the framing invariants:
//! every answer consumes at most what is buffered, every step that goes on
//! makes progress, and whatever parses renders to bytes that parse the same.
//!
//! Run: `cargo +nightly fuzz run memcached_parse` from the workspace root.

#![no_main]

use kura_proto::{Parsed, ParserLimits, Recovery, Request, parse, render_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the limits, so tight limits get fuzzed too.
    let Some((&selector, input)) = data.split_first() else {
        return;
    };
    let limits = if selector & 1 == 0 {
        ParserLimits::default()
    } else {
        ParserLimits {
            key_length_max: 8,
            item_size_max_bytes: 16,
            line_length_max: 40,
            retrieval_line_length_max: 64,
            keys_per_get_max: 3,
        }
    };
    drive(input, &limits);
});

fn drive(mut buf: &[u8], limits: &ParserLimits) {
    loop {
        match parse(buf, limits) {
            Ok(Parsed::Incomplete { frame_bytes }) => {
                if let Some(frame) = frame_bytes {
                    assert!(frame > buf.len(), "incomplete frame fits the buffer");
                }
                return;
            }
            Ok(Parsed::Complete {
                request,
                consumed_bytes,
            }) => {
                assert!(consumed_bytes >= 1, "no progress");
                assert!(consumed_bytes <= buf.len(), "consumed past the buffer");
                assert_reparses(&request, limits);
                buf = &buf[consumed_bytes..];
            }
            Err(error) => {
                let skip = match error.recovery {
                    Recovery::Close => return,
                    Recovery::Continue => error.consumed_bytes,
                    Recovery::Swallow { data_bytes } => {
                        assert!(data_bytes >= 2, "a swallow covers at least the \\r\\n");
                        error.consumed_bytes.saturating_add(data_bytes)
                    }
                };
                assert!(error.consumed_bytes >= 1, "no progress");
                assert!(
                    error.consumed_bytes <= buf.len(),
                    "consumed past the buffer"
                );
                buf = buf.get(skip..).unwrap_or_default();
            }
        }
    }
}

fn assert_reparses(request: &Request<'_>, limits: &ParserLimits) {
    let mut wire = Vec::new();
    render_request(&mut wire, request);
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
            assert_eq!(&again, request);
            assert_eq!(consumed_bytes, wire.len());
        }
        other => panic!("rendered request re-parsed as {other:?}"),
    }
}
