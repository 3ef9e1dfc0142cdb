//! Whole exchanges recorded from memcached 1.6.18, hostile input included.
//!
//! Each transcript is fed, in one piece, to a small model server built on
//! `kura_proto` (parse, execute on a `HashMap`, encode), and its output must
//! match memcached's byte for byte: replies, silences under `noreply`,
//! swallowed data blocks, and data blocks that memcached runs as commands.
//! When a `memcached` binary is installed, the same transcripts are also
//! replayed against it, which proves the recordings.
//!
//! `@` in a transcript stands for a per-transcript key prefix (`t<n>_`), so
//! transcripts do not see each other's keys on a shared live server. The
//! prefix contains `_`, so no prefixed key is valid base64.
//!
//! Left out on purpose: inputs where kura is stricter than memcached (control
//! characters in keys, numbers too wide for their field), the binary
//! protocol, and the `E` and `x` meta flags, which kura accepts as memcached
//! releases after 1.6.18 do (1.6.18 answers them `CLIENT_ERROR invalid flag`
//! and `CLIENT_ERROR invalid or duplicate flag`). Unit tests cover those.

use std::collections::HashMap;
use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kura_proto::encode::{self, MetaCode, MetaCommand, MetaItem, Reply};
use kura_proto::{
    ArithmeticOp, ErrorKind, MetaFlags, Parsed, ParserLimits, Recovery, Request, SetMode, Storage,
    StorageCommand, parse,
};

const MEMCACHED: &str = "/usr/bin/memcached";
const RECORDED_VERSION: &[u8] = b"1.6.18";
/// Connections replaying transcripts against a live memcached at once.
const LIVE_CONNECTIONS: usize = 8;

struct Transcript {
    input: Vec<u8>,
    output: Vec<u8>,
    closes: bool,
}

fn t(input: &[u8], output: &[u8]) -> Transcript {
    Transcript {
        input: input.to_vec(),
        output: output.to_vec(),
        closes: false,
    }
}

fn closing(input: &[u8], output: &[u8]) -> Transcript {
    Transcript {
        closes: true,
        ..t(input, output)
    }
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The recorded exchanges. Outputs are memcached 1.6.18's.
fn transcripts() -> Vec<Transcript> {
    let k251 = vec![b'k'; 251];
    let big = vec![b'x'; 2_000_000];
    let o33 = cat(&[b"O", &[b'o'; 32]]);
    let mut all = vec![
        // Framing.
        t(b"\r\n", b"ERROR\r\n"),
        t(b"\n", b"ERROR\r\n"),
        t(b" \r\n", b"ERROR\r\n"),
        t(b"x\r\n", b"ERROR\r\n"),
        t(b"bogus\r\n", b"ERROR\r\n"),
        t(b"GET @a\r\n", b"ERROR\r\n"),
        t(b"get @a\n", b"END\r\n"),
        t(b"  get  @a   @b  \r\n", b"END\r\n"),
        t(b"version\rversion\r\n", b"ERROR\r\n"),
        t(&[b'x'; 2048], b""),
        closing(&[b'x'; 2049], b""),
        // Storage.
        t(b"set @a 0 0 1\r\nabc\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\n"),
        t(b"set @a 0 0 1\r\nab\r\nget @a\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\nEND\r\n"),
        t(b"set @a -1 0 1\r\nb\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"set @a 0 0 -1\r\nb\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"set @a 0x10 0 1\r\nb\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"set @a 0 0 2147483647\r\nbb\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"set @a +1 0 1\r\nb\r\nget @a\r\n", b"STORED\r\nVALUE @a 1 1\r\nb\r\nEND\r\n"),
        t(b"set @a 0 0 1 noreply\r\nb\r\nget @a\r\n", b"VALUE @a 0 1\r\nb\r\nEND\r\n"),
        t(b"set @a 0 0 1 norepl\r\nb\r\n", b"STORED\r\n"),
        t(b"set @a 0 0 1 2\r\nb\r\n", b"STORED\r\n"),
        t(b"set\r\n", b"ERROR\r\n"),
        t(b"set @a 0 0\r\n", b"ERROR\r\n"),
        t(b"cas @a 0 0 1\r\nb\r\n", b"ERROR\r\nERROR\r\n"),
        t(b"cas @a 0 0 1 5\r\nb\r\n", b"NOT_FOUND\r\n"),
        t(b"cas @a 0 0 1 -5\r\nb\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(&cat(&[b"set ", &k251, b" 0 0 1\r\nb\r\n"]), b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(&cat(&[b"set @a 0 0 2000000\r\n", &big, b"\r\nget @a\r\n"]), b"SERVER_ERROR object too large for cache\r\nEND\r\n"),
        t(
            &cat(&[b"set @a 0 0 2000000\r\n", &big, b"zz\r\nget @a\r\n"]),
            b"SERVER_ERROR object too large for cache\r\nERROR\r\nEND\r\n",
        ),
        t(
            b"add @a 0 0 1\r\nx\r\nadd @a 0 0 1\r\ny\r\nappend @a 0 0 1\r\nz\r\nprepend @a 0 0 1\r\nw\r\nreplace @b 0 0 1\r\nq\r\nget @a @b @a\r\n",
            b"STORED\r\nNOT_STORED\r\nSTORED\r\nSTORED\r\nNOT_STORED\r\nVALUE @a 0 3\r\nwxz\r\nVALUE @a 0 3\r\nwxz\r\nEND\r\n",
        ),
        t(b"set @a 5 0 4\r\n\r\n\r\n\r\nget @a\r\n", b"STORED\r\nVALUE @a 5 4\r\n\r\n\r\n\r\nEND\r\n"),
        // noreply silences errors found after the noreply token was seen.
        t(b"incr @a x noreply\r\nmn\r\n", b"MN\r\n"),
        t(b"set @a 0 0 1 noreply\r\nabc\r\nmn\r\n", b"ERROR\r\nMN\r\n"),
        t(&cat(&[b"set ", &k251, b" 0 0 1 noreply\r\nb\r\nmn\r\n"]), b"ERROR\r\nMN\r\n"),
        t(&cat(&[b"set @a 0 0 2000000 noreply\r\n", &big, b"\r\nmn\r\n"]), b"MN\r\n"),
        t(b"set @a x 0 1 noreply\r\nb\r\nmn\r\n", b"ERROR\r\nMN\r\n"),
        t(b"touch @a x noreply\r\nmn\r\n", b"MN\r\n"),
        t(&cat(&[b"delete ", &k251, b" noreply\r\nmn\r\n"]), b"MN\r\n"),
        t(b"cas @a 0 0 1 x noreply\r\nb\r\nmn\r\n", b"ERROR\r\nMN\r\n"),
        t(b"delete @a x noreply\r\nmn\r\n", b"MN\r\n"),
        // Retrieval.
        t(b"get\r\n", b"ERROR\r\n"),
        t(b"get \r\n", b"ERROR\r\n"),
        t(b"gets\r\n", b"ERROR\r\n"),
        t(&cat(&[b"get ", &k251, b"\r\n"]), b"CLIENT_ERROR bad command line format\r\n"),
        t(&cat(&[b"get @a ", &k251, b" @b\r\n"]), b"CLIENT_ERROR bad command line format\r\n"),
        t(b"gat 1 @a\r\n", b"END\r\n"),
        t(b"gat x @a\r\n", b"CLIENT_ERROR invalid exptime argument\r\n"),
        t(b"gat 99999999999999999999 @a\r\n", b"CLIENT_ERROR invalid exptime argument\r\n"),
        t(b"gat 1\r\n", b"END\r\n"),
        t(b"gats 1 @a @b\r\n", b"END\r\n"),
        t(b"get @a noreply\r\n", b"END\r\n"),
        // delete, incr/decr, touch.
        t(b"delete @a 0\r\n", b"NOT_FOUND\r\n"),
        t(b"delete @a 1\r\n", b"CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]\r\n"),
        t(b"delete @a noreply\r\nmn\r\n", b"MN\r\n"),
        t(b"delete @a 0 0\r\n", b"CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]\r\n"),
        t(b"delete\r\n", b"ERROR\r\n"),
        t(b"delete @a b c d\r\n", b"ERROR\r\n"),
        t(b"set @a 0 0 1\r\nx\r\ndelete @a\r\ndelete @a\r\n", b"STORED\r\nDELETED\r\nNOT_FOUND\r\n"),
        t(b"incr @a 1\r\n", b"NOT_FOUND\r\n"),
        t(b"incr @a -1\r\n", b"CLIENT_ERROR invalid numeric delta argument\r\n"),
        t(b"incr @a x\r\n", b"CLIENT_ERROR invalid numeric delta argument\r\n"),
        t(b"incr @a 18446744073709551616\r\n", b"CLIENT_ERROR invalid numeric delta argument\r\n"),
        t(b"incr @a 18446744073709551615\r\n", b"NOT_FOUND\r\n"),
        t(b"incr\r\n", b"ERROR\r\n"),
        t(b"incr @a\r\n", b"ERROR\r\n"),
        t(b"incr @a 1 2\r\n", b"NOT_FOUND\r\n"),
        t(b"incr @a 1 2 3\r\n", b"ERROR\r\n"),
        t(b"set @n 0 0 2\r\n10\r\nincr @n 5\r\ndecr @n 100\r\nincr @n 18446744073709551615\r\n", b"STORED\r\n15\r\n0\r\n18446744073709551615\r\n"),
        t(b"set @n 0 0 1\r\nx\r\nincr @n 1\r\n", b"STORED\r\nCLIENT_ERROR cannot increment or decrement non-numeric value\r\n"),
        t(b"touch @a 1\r\n", b"NOT_FOUND\r\n"),
        t(b"touch @a x\r\n", b"CLIENT_ERROR invalid exptime argument\r\n"),
        t(b"touch @a\r\n", b"ERROR\r\n"),
        t(b"set @a 0 0 1\r\nx\r\ntouch @a 100\r\n", b"STORED\r\nTOUCHED\r\n"),
        // Other classic commands.
        t(b"flush_all x\r\n", b"CLIENT_ERROR invalid exptime argument\r\n"),
        t(b"flush_all 1 2 3\r\n", b"ERROR\r\n"),
        t(b"flush_all noreply x\r\n", b"CLIENT_ERROR invalid exptime argument\r\n"),
        t(b"verbosity 1\r\n", b"OK\r\n"),
        t(b"verbosity\r\n", b"ERROR\r\n"),
        t(b"verbosity x\r\n", b"CLIENT_ERROR bad command line format\r\n"),
        t(b"verbosity 1 noreply\r\nmn\r\n", b"MN\r\n"),
        t(b"verbosity 1 2\r\n", b"OK\r\n"),
        t(b"verbosity 1 2 3\r\n", b"ERROR\r\n"),
        t(b"version x\r\n", b"VERSION 1.6.18\r\n"),
        t(b"cache_memlimit\r\n", b"ERROR\r\n"),
        t(b"cache_memlimit x\r\n", b"ERROR\r\n"),
        t(b"shutdown\r\n", b"ERROR: shutdown not enabled\r\n"),
        closing(b"quit\r\nversion\r\n", b""),
        closing(b"quit x\r\n", b""),
        // Meta: mn, me, mg.
        t(b"mn\r\n", b"MN\r\n"),
        t(b"mn x\r\n", b"MN\r\n"),
        t(b"mx\r\n", b"ERROR\r\n"),
        t(b"m\r\n", b"ERROR\r\n"),
        t(b"mgg @a\r\n", b"ERROR\r\n"),
        t(b"me @nope\r\n", b"EN\r\n"),
        t(b"me\r\n", b"CLIENT_ERROR bad command line format\r\n"),
        t(b"me !!! b\r\n", b"CLIENT_ERROR bad command line format\r\n"),
        t(&cat(&[b"me ", &k251, b"\r\n"]), b"CLIENT_ERROR bad command line format\r\n"),
        t(b"mg @missing k Oxx\r\n", b"EN k@missing Oxx\r\n"),
        t(b"mg @missing O\r\n", b"EN O\r\n"),
        t(b"mg @missing\r\n", b"EN\r\n"),
        t(b"mg @missing q\r\nmn\r\n", b"MN\r\n"),
        t(b"mg\r\n", b"ERROR\r\n"),
        t(b"mg \r\n", b"ERROR\r\n"),
        t(b"ms @m 2 T0 F5\r\nhi\r\nmg @m s v f t k Oabc q\r\n", b"HD\r\nVA 2 s2 f5 t-1 k@m Oabc\r\nhi\r\n"),
        t(b"ms @m 2\r\nhi\r\nmg @m q\r\nmg @m q k\r\nmg @m vx\r\nmn\r\n", b"HD\r\nHD\r\nHD k@m\r\nVA 2\r\nhi\r\nMN\r\n"),
        t(b"ms @m 2\r\nhi\r\nmg @m F5 C5 Mz\r\n", b"HD\r\nHD\r\n"),
        t(b"mg @a v v\r\n", b"CLIENT_ERROR duplicate flag\r\n"),
        t(b"mg @a Y\r\n", b"CLIENT_ERROR invalid flag\r\n"),
        t(b"mg @a Tx\r\n", b"CLIENT_ERROR bad token in command line format\r\n"),
        t(b"mg @a T\r\n", b"CLIENT_ERROR bad token in command line format\r\n"),
        t(b"mg @a N\r\n", b"CLIENT_ERROR bad token in command line format\r\n"),
        t(b"mg @a Fx\r\n", b"CLIENT_ERROR bad command line format\r\n"),
        t(b"mg @a Tx Fx\r\n", b"CLIENT_ERROR bad token in command line format\r\n"),
        t(b"mg @a Tx Y\r\n", b"CLIENT_ERROR invalid flag\r\n"),
        t(b"mg @a M\r\n", b"CLIENT_ERROR incorrect length for M token\r\n"),
        t(b"mg @a MXY\r\n", b"CLIENT_ERROR incorrect length for M token\r\n"),
        t(b"mg @a Dx\r\n", b"CLIENT_ERROR invalid numeric delta value\r\n"),
        t(b"mg @a Jx\r\n", b"CLIENT_ERROR invalid numeric initial value\r\n"),
        t(b"mg 1 b\r\n", b"CLIENT_ERROR error decoding key\r\n"),
        t(b"mg @a b Tx\r\n", b"CLIENT_ERROR bad token in command line format\r\n"),
        t(b"mg @a Tx b\r\n", b"CLIENT_ERROR error decoding key\r\n"),
        t(&cat(&[b"mg @a ", &o33, b"\r\n"]), b"CLIENT_ERROR opaque token too long\r\n"),
        t(&cat(&[b"mg ", &k251, b" v\r\n"]), b"CLIENT_ERROR bad command line format\r\n"),
        t(b"mg @zz c f h k l O s t u v P L q F1 C1 I MS\r\n", b""),
        t(b"mg @zz c f h k l O s t u v P L q F1 C1 I MS J1\r\n", b"CLIENT_ERROR options flags are too long\r\n"),
        // ms.
        t(b"ms @m 2 MX\r\nhi\r\nmn\r\n", b"CLIENT_ERROR invalid mode for ms M token\r\nMN\r\n"),
        t(b"ms @m 2 MEE\r\nhi\r\nmn\r\n", b"CLIENT_ERROR incorrect length for M token\r\nMN\r\n"),
        t(b"ms @m 2 S5\r\nhi\r\nmn\r\n", b"CLIENT_ERROR invalid flag\r\nMN\r\n"),
        t(b"ms @m 2 Fx\r\nhi\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nMN\r\n"),
        t(b"ms @m 2 Cx\r\nhi\r\nmn\r\n", b"CLIENT_ERROR bad token in command line format\r\nMN\r\n"),
        t(b"ms @m 2 T\r\nhi\r\nmn\r\n", b"CLIENT_ERROR bad token in command line format\r\nMN\r\n"),
        t(b"ms @m 2 b\r\nhi\r\nmn\r\n", b"CLIENT_ERROR error decoding key\r\nMN\r\n"),
        t(&cat(&[b"ms @m 1 ", &o33, b" MX\r\n1\r\nmn\r\n"]), b"CLIENT_ERROR invalid mode for ms M token\r\nMN\r\n"),
        t(&cat(&[b"ms @m 1 ", &o33, b"\r\n1\r\nmn\r\n"]), b"CLIENT_ERROR opaque token too long\r\nMN\r\n"),
        t(b"ms @m\r\nhi\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"ms @m x\r\nhi\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(b"ms @m -1\r\nhi\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\n"),
        t(&cat(&[b"ms ", &k251, b" 2\r\nhi\r\nmn\r\n"]), b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        t(&cat(&[b"ms @m 2000000 T0\r\n", &big, b"\r\nmn\r\n"]), b"SERVER_ERROR object too large for cache\r\nMN\r\n"),
        t(&cat(&[b"ms @m 2000000 q\r\n", &big, b"\r\nmn\r\n"]), b"SERVER_ERROR object too large for cache\r\nMN\r\n"),
        t(b"ms @m 2 q\r\nhix\r\nmn\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\nMN\r\n"),
        t(b"ms @m 2 q\r\nhi\r\nmn\r\n", b"MN\r\n"),
        t(b"ms @m 2 ME k O1 q\r\nhi\r\nms @m 2 ME k O1 q\r\nhi\r\nmn\r\n", b"NS k@m O1\r\nMN\r\n"),
        t(b"ms @m 1 MR\r\nx\r\nms @m 1\r\nx\r\nms @m 1 MA\r\ny\r\nms @m 1 MP\r\nw\r\nmg @m v\r\n", b"NS\r\nHD\r\nHD\r\nHD\r\nVA 3\r\nwxy\r\n"),
        t(b"ms @zz 2 c f h k l O s t u v P L q F1 C1 I MS\r\nhi\r\nmn\r\n", b"CLIENT_ERROR options flags too long\r\nERROR\r\nMN\r\n"),
        t(b"ms @zz 2 f h l u v P L F1\r\nhi\r\nmg @zz f v\r\n", b"HD\r\nVA 2 f1\r\nhi\r\n"),
        // md.
        t(b"md @nope q\r\nmn\r\n", b"NF\r\nMN\r\n"),
        t(b"md @nope k O1 C5\r\n", b"NF k@nope O1\r\n"),
        t(b"md @nope Y\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"md @nope Tx\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"md\r\n", b"ERROR\r\n"),
        t(b"ms @d 1\r\n5\r\nmd @d q\r\nmd @d q\r\nmn\r\n", b"HD\r\nNF\r\nMN\r\n"),
        t(b"ms @d 1\r\n5\r\nmd @d k O7\r\n", b"HD\r\nHD k@d O7\r\n"),
        t(b"md @zz c f h k l O s t u v P L q F1 C1 I MS J1\r\nmn\r\n", b"CLIENT_ERROR options flags too long\r\nMN\r\n"),
        // ma.
        t(b"ma @a\r\n", b"NF\r\n"),
        t(b"ma @a N0 J5 v\r\nma @a v\r\nma @a MD v k O9\r\nma @a M- v\r\n", b"VA 1\r\n5\r\nVA 1\r\n6\r\nVA 1 k@a O9\r\n5\r\nVA 1\r\n4\r\n"),
        // q hides ma successes, but not the reply for a counter N just created.
        t(b"ma @a N0 J5 q v\r\nma @a q\r\nma @a v D10\r\n", b"VA 1\r\n5\r\nVA 2\r\n16\r\n"),
        t(b"ma @a MX\r\n", b"CLIENT_ERROR invalid mode for ma M token\r\n"),
        t(&cat(&[b"ma @a ", &o33, b" MX\r\n"]), b"CLIENT_ERROR invalid mode for ma M token\r\n"),
        t(b"ma @a Dx\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"ma @a Jx\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"ma @a D-1\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"ma @a v v\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"ma @a Y\r\n", b"CLIENT_ERROR invalid or duplicate flag\r\n"),
        t(b"ma @nope q\r\nmn\r\n", b"NF\r\nMN\r\n"),
        t(b"ma @nope k O1\r\n", b"NF k@nope O1\r\n"),
        t(b"ma\r\n", b"ERROR\r\n"),
        t(b"ms @s 1\r\nx\r\nma @s\r\n", b"HD\r\nCLIENT_ERROR cannot increment or decrement non-numeric value\r\n"),
    ];
    // Classic and meta commands share a connection.
    all.push(t(
        b"set @mix 0 0 2\r\n41\r\nma @mix v\r\nget @mix\r\nmg @mix v\r\n",
        b"STORED\r\nVA 2\r\n42\r\nVALUE @mix 0 2\r\n42\r\nEND\r\nVA 2\r\n42\r\n",
    ));
    all
}

/// Replaces each `@` with the transcript's key prefix.
fn expand(bytes: &[u8], index: usize) -> Vec<u8> {
    let prefix = format!("t{index}_");
    let mut out = Vec::with_capacity(bytes.len());
    for &b in bytes {
        if b == b'@' {
            out.extend_from_slice(prefix.as_bytes());
        } else {
            out.push(b);
        }
    }
    out
}

#[test]
fn model_server_replies_like_memcached() {
    let mut failures = Vec::new();
    for (index, transcript) in transcripts().iter().enumerate() {
        let input = expand(&transcript.input, index);
        let expected = expand(&transcript.output, index);
        let (output, closed) = Model::default().serve(&input);
        if output != expected || closed != transcript.closes {
            failures.push(format!(
                "#{index} {:?}\n  memcached: {:?} closed={}\n  kura:      {:?} closed={closed}",
                shorten(&input),
                String::from_utf8_lossy(&expected),
                transcript.closes,
                String::from_utf8_lossy(&output),
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} transcripts differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn recordings_match_the_installed_memcached() {
    if !Path::new(MEMCACHED).exists() {
        println!("skipped: {MEMCACHED} is not installed; recordings not re-checked");
        return;
    }
    let server = match LiveServer::start() {
        Ok(server) => server,
        Err(reason) => {
            println!("skipped: could not start {MEMCACHED}: {reason}");
            return;
        }
    };
    let version = server
        .exchange(b"version\r\n", b"VERSION 1.6.18\r\n".len())
        .0;
    if !version
        .windows(RECORDED_VERSION.len())
        .any(|w| w == RECORDED_VERSION)
    {
        println!(
            "skipped: recordings are of memcached 1.6.18, installed: {:?}",
            String::from_utf8_lossy(&version)
        );
        return;
    }
    // Transcripts use disjoint keys and none flushes, so they can run at once.
    let transcripts = transcripts();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..LIVE_CONNECTIONS)
            .map(|worker| {
                let (server, transcripts) = (&server, &transcripts);
                scope.spawn(move || {
                    let mine = transcripts
                        .iter()
                        .enumerate()
                        .skip(worker)
                        .step_by(LIVE_CONNECTIONS);
                    mine.filter_map(|(index, transcript)| server.check(index, transcript))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} recordings differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn running_as_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .any(|line| line.starts_with("Uid:") && line.split_whitespace().nth(1) == Some("0"))
}

fn shorten(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() > 120 {
        format!("{}…({} bytes)", &text[..120], bytes.len())
    } else {
        text.into_owned()
    }
}

/// A memcached on a free loopback port, stopped on drop.
struct LiveServer {
    child: Child,
    port: u16,
}

impl LiveServer {
    fn start() -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let mut args = vec![
            "-l".to_string(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ];
        args.extend(["-U", "0", "-m", "64"].map(String::from));
        if running_as_root() {
            // memcached refuses to run as root without being told which user to be.
            args.extend(["-u", "root"].map(String::from));
        }
        let child = Command::new(MEMCACHED)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("no listener after 5 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// Replays one transcript; a description of the difference, if any.
    fn check(&self, index: usize, transcript: &Transcript) -> Option<String> {
        let input = expand(&transcript.input, index);
        let expected = expand(&transcript.output, index);
        let (output, closed) = self.exchange(&input, expected.len());
        (output != expected || closed != transcript.closes).then(|| {
            format!(
                "#{index} {:?}: recorded {:?}, live {:?} closed={closed}",
                shorten(&input),
                String::from_utf8_lossy(&expected),
                String::from_utf8_lossy(&output),
            )
        })
    }

    /// Sends `input` on a new connection and reads until `expected_len`
    /// bytes, a close, or a quiet spell.
    fn exchange(&self, input: &[u8], expected_len: usize) -> (Vec<u8>, bool) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        let mut writer = stream.try_clone().expect("clone");
        let input = input.to_vec();
        let sender = std::thread::spawn(move || {
            let _ = writer.write_all(&input);
        });
        let mut output = Vec::new();
        let mut closed = false;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            let quiet = if output.len() >= expected_len {
                50
            } else {
                300
            };
            stream
                .set_read_timeout(Some(Duration::from_millis(quiet)))
                .expect("timeout");
            match stream.read(&mut buf) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => output.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), IoErrorKind::WouldBlock | IoErrorKind::TimedOut) => {
                    if output.len() >= expected_len || sender.is_finished() {
                        break;
                    }
                }
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let _ = sender.join();
        (output, closed)
    }
}

impl Drop for LiveServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal memcached on a `HashMap`: enough semantics to replay the
/// transcripts (no expiry, no CAS values, no LRU).
#[derive(Default)]
struct Model {
    items: HashMap<Vec<u8>, Item>,
}

#[derive(Clone)]
struct Item {
    client_flags: u32,
    data: Vec<u8>,
}

impl Model {
    /// Serves one connection's input; returns the output and whether it closed.
    fn serve(&mut self, mut input: &[u8]) -> (Vec<u8>, bool) {
        let limits = ParserLimits::default();
        let mut out = Vec::new();
        loop {
            match parse(input, &limits) {
                Ok(Parsed::Incomplete { .. }) => return (out, false),
                Ok(Parsed::Complete {
                    request,
                    consumed_bytes,
                }) => {
                    if !self.execute(&request, &mut out) {
                        return (out, true);
                    }
                    input = &input[consumed_bytes..];
                }
                Err(error) => {
                    // memcached closes on an overlong line without a word.
                    if let (Some(reply), false) =
                        (error.reply(), error.kind == ErrorKind::LineTooLong)
                    {
                        out.extend_from_slice(reply.as_bytes());
                        out.extend_from_slice(b"\r\n");
                    }
                    let skip = match error.recovery {
                        Recovery::Continue => error.consumed_bytes,
                        Recovery::Swallow { data_bytes } => error.consumed_bytes + data_bytes,
                        Recovery::Close => return (out, true),
                    };
                    input = input.get(skip..).unwrap_or_default();
                }
            }
        }
    }

    /// Runs one request; `false` closes the connection.
    fn execute(&mut self, request: &Request<'_>, out: &mut Vec<u8>) -> bool {
        match request {
            Request::Storage(storage) => self.store(storage, out),
            Request::Retrieval(retrieval) => {
                for key in retrieval.keys.iter() {
                    if let Some(item) = self.items.get(key) {
                        encode::value(out, key, item.client_flags, &item.data, None);
                    }
                }
                encode::reply(out, Reply::End);
            }
            Request::Delete { key, noreply } => {
                let found = self.items.remove(*key).is_some();
                reply_unless(
                    out,
                    *noreply,
                    if found {
                        Reply::Deleted
                    } else {
                        Reply::NotFound
                    },
                );
            }
            Request::Arithmetic {
                op,
                key,
                delta,
                noreply,
            } => match self.add_delta(key, *op, *delta) {
                Some(Ok(value)) if !noreply => encode::number(out, value),
                Some(Err(())) if !noreply => non_numeric(out),
                None if !noreply => encode::reply(out, Reply::NotFound),
                _ => {}
            },
            Request::Touch { key, noreply, .. } => {
                let found = self.items.contains_key(*key);
                reply_unless(
                    out,
                    *noreply,
                    if found {
                        Reply::Touched
                    } else {
                        Reply::NotFound
                    },
                );
            }
            Request::FlushAll { noreply, .. } => {
                self.items.clear();
                reply_unless(out, *noreply, Reply::Ok);
            }
            Request::Verbosity { noreply, .. } | Request::CacheMemlimit { noreply, .. } => {
                reply_unless(out, *noreply, Reply::Ok);
            }
            Request::Version => encode::version(out, RECORDED_VERSION),
            // kura's extension; memcached does not know the command.
            Request::Sync { .. } => out.extend_from_slice(b"ERROR\r\n"),
            Request::Quit => return false,
            // memcached built with TLS, started without -Z.
            Request::RefreshCerts { .. } => out.extend_from_slice(b"Error TLS not enabled\r\n"),
            Request::Stats { .. } | Request::Metadump(_) => encode::reply(out, Reply::End),
            // memcached 1.6.19+ on an empty cache.
            Request::Mgdump(_) => out.extend_from_slice(b"EN\r\n"),
            Request::Watch(_) => out.extend_from_slice(b"OK\r\n"),
            Request::LruCrawler(_) => reply_unless(out, false, Reply::Ok),
            Request::Tuning(reply) => out.extend_from_slice(reply.line()),
            Request::Shutdown(_) => out.extend_from_slice(b"ERROR: shutdown not enabled\r\n"),
            Request::MetaNoop => encode::reply(out, Reply::MetaNoop),
            Request::MetaDebug { .. } => {
                encode::meta_header(out, MetaCode::En, &MetaFlags::new(), &MetaItem::default())
            }
            Request::MetaGet(get) => self.meta_get(get.key, &get.flags, out),
            Request::MetaSet(set) => self.meta_set(set, out),
            Request::MetaDelete(delete) => {
                let code = if self.items.remove(delete.key).is_some() {
                    MetaCode::Hd
                } else {
                    MetaCode::Nf
                };
                meta_reply(
                    out,
                    MetaCommand::Delete,
                    code,
                    &delete.flags,
                    &MetaItem::miss(delete.key),
                );
            }
            Request::MetaArithmetic(ma) => self.meta_arithmetic(ma, out),
        }
        true
    }

    fn store(&mut self, storage: &Storage<'_>, out: &mut Vec<u8>) {
        let present = self.items.contains_key(storage.key);
        let stored = match storage.command {
            StorageCommand::Set => true,
            StorageCommand::Add => !present,
            StorageCommand::Replace | StorageCommand::Append | StorageCommand::Prepend => present,
            StorageCommand::Cas => {
                reply_unless(
                    out,
                    storage.noreply,
                    if present {
                        Reply::Exists
                    } else {
                        Reply::NotFound
                    },
                );
                return;
            }
        };
        if stored {
            let mode = match storage.command {
                StorageCommand::Append => SetMode::Append,
                StorageCommand::Prepend => SetMode::Prepend,
                _ => SetMode::Set,
            };
            self.put(storage.key, storage.client_flags, storage.data, mode);
        }
        reply_unless(
            out,
            storage.noreply,
            if stored {
                Reply::Stored
            } else {
                Reply::NotStored
            },
        );
    }

    fn put(&mut self, key: &[u8], client_flags: u32, data: &[u8], mode: SetMode) {
        match (mode, self.items.get_mut(key)) {
            (SetMode::Append, Some(item)) => item.data.extend_from_slice(data),
            (SetMode::Prepend, Some(item)) => {
                item.data.splice(0..0, data.iter().copied()).for_each(drop)
            }
            _ => {
                self.items.insert(
                    key.to_vec(),
                    Item {
                        client_flags,
                        data: data.to_vec(),
                    },
                );
            }
        }
    }

    /// `None` if absent, `Err` if the value is not a number.
    fn add_delta(&mut self, key: &[u8], op: ArithmeticOp, delta: u64) -> Option<Result<u64, ()>> {
        let item = self.items.get_mut(key)?;
        let Some(current) = std::str::from_utf8(&item.data)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            return Some(Err(()));
        };
        let value = match op {
            ArithmeticOp::Incr => current.wrapping_add(delta),
            ArithmeticOp::Decr => current.saturating_sub(delta),
        };
        item.data = value.to_string().into_bytes();
        Some(Ok(value))
    }

    fn meta_get(&self, key: &[u8], flags: &MetaFlags<'_>, out: &mut Vec<u8>) {
        let Some(item) = self.items.get(key) else {
            return meta_reply(
                out,
                MetaCommand::Get,
                MetaCode::En,
                flags,
                &MetaItem::miss(key),
            );
        };
        let facts = MetaItem {
            key,
            client_flags: Some(item.client_flags),
            size_bytes: Some(item.data.len() as u64),
            ttl_s: Some(-1),
            ..MetaItem::default()
        };
        if flags.return_value() {
            encode::meta_value(out, flags, &facts, &item.data);
        } else {
            meta_reply(out, MetaCommand::Get, MetaCode::Hd, flags, &facts);
        }
    }

    fn meta_set(&mut self, set: &kura_proto::MetaSet<'_>, out: &mut Vec<u8>) {
        let present = self.items.contains_key(set.key);
        let stored = match set.mode {
            SetMode::Set => true,
            SetMode::Add => !present,
            SetMode::Replace | SetMode::Append | SetMode::Prepend => present,
        };
        if stored {
            self.put(
                set.key,
                set.flags.client_flags().unwrap_or(0),
                set.data,
                set.mode,
            );
        }
        let code = if stored { MetaCode::Hd } else { MetaCode::Ns };
        meta_reply(
            out,
            MetaCommand::Set,
            code,
            &set.flags,
            &MetaItem::miss(set.key),
        );
    }

    fn meta_arithmetic(&mut self, ma: &kura_proto::MetaArithmetic<'_>, out: &mut Vec<u8>) {
        let mut created = false;
        let value = match self.add_delta(ma.key, ma.op, ma.delta()) {
            Some(Ok(value)) => value,
            Some(Err(())) => return non_numeric(out),
            None if ma.flags.vivify_ttl_s().is_some() => {
                self.put(ma.key, 0, ma.initial().to_string().as_bytes(), SetMode::Set);
                created = true;
                ma.initial()
            }
            None => {
                return meta_reply(
                    out,
                    MetaCommand::Arithmetic,
                    MetaCode::Nf,
                    &ma.flags,
                    &MetaItem::miss(ma.key),
                );
            }
        };
        let text = value.to_string();
        let item = MetaItem {
            ttl_s: Some(-1),
            ..MetaItem::miss(ma.key)
        };
        let code = if ma.flags.return_value() {
            MetaCode::Va {
                data_len_bytes: text.len(),
            }
        } else {
            MetaCode::Hd
        };
        if ma.flags.quiet() && !created && encode::quiet_suppresses(MetaCommand::Arithmetic, code) {
            return;
        }
        if ma.flags.return_value() {
            encode::meta_value(out, &ma.flags, &item, text.as_bytes());
        } else {
            encode::meta_header(out, code, &ma.flags, &item);
        }
    }
}

fn reply_unless(out: &mut Vec<u8>, noreply: bool, reply: Reply) {
    if !noreply {
        encode::reply(out, reply);
    }
}

fn non_numeric(out: &mut Vec<u8>) {
    encode::client_error(out, b"cannot increment or decrement non-numeric value");
}

fn meta_reply(
    out: &mut Vec<u8>,
    command: MetaCommand,
    code: MetaCode,
    flags: &MetaFlags<'_>,
    item: &MetaItem<'_>,
) {
    if !(flags.quiet() && encode::quiet_suppresses(command, code)) {
        encode::meta_header(out, code, flags, item);
    }
}
