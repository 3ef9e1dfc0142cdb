//! The same scripts against kura and a stock memcached 1.6: the replies must
//! match byte for byte, CAS values aside (each server numbers its own).
//! Skipped, with a reason, where memcached is not installed.

mod common;

use common::{Kura, Memcached, transcript};

/// Scripts, each run on its own connection with its own keys (`@` → a prefix).
const SCRIPTS: &[&str] = &[
    // Storage and retrieval.
    "set @a 1 0 3\r\nabc\r\nget @a\r\ngets @a\r\nadd @a 0 0 1\r\nx\r\nadd @b 2 0 1\r\ny\r\nget @a @b @c\r\n",
    "replace @a 0 0 1\r\nx\r\nset @a 0 0 1\r\nx\r\nreplace @a 5 0 2\r\nzz\r\nappend @a 9 0 2\r\n++\r\nprepend @a 9 0 2\r\n--\r\nget @a\r\n",
    "append @n 0 0 1\r\nx\r\nprepend @n 0 0 1\r\nx\r\ncas @n 0 0 1 99\r\nx\r\nset @c 0 0 1\r\nx\r\ncas @c 0 0 1 0\r\ny\r\n",
    "set @a 0 0 1 noreply\r\nx\r\nadd @a 0 0 1 noreply\r\ny\r\nget @a\r\ndelete @a noreply\r\nget @a\r\n",
    "set @e 0 0 0\r\n\r\nget @e\r\nset @bin 7 0 4\r\n\x01\x02\r\n\r\nget @bin\r\n",
    // Delete, touch, arithmetic.
    "delete @x\r\nset @x 0 0 1\r\nx\r\ndelete @x 0\r\ndelete @x\r\ndelete @x 1\r\ndelete @x 0 noreply\r\ndelete @x noreply 0\r\n",
    "touch @t 10\r\nset @t 0 0 1\r\nx\r\ntouch @t 10\r\ntouch @t abc\r\ntouch @t -1\r\nget @t\r\n",
    "incr @n 1\r\nset @n 0 0 2\r\n10\r\nincr @n 5\r\ndecr @n 6\r\nget @n\r\ndecr @n 100\r\nincr @n 18446744073709551615\r\nincr @n 2\r\nget @n\r\n",
    "set @s 0 0 3\r\nabc\r\nincr @s 1\r\ndecr @s 1\r\nset @s 0 0 2\r\n-1\r\nincr @s 1\r\nincr @s x\r\nincr @s -1\r\nincr @s 1 noreply\r\n",
    "set @w 3 100 20\r\n18446744073709551615\r\nincr @w 1\r\nget @w\r\nmg @w f t v\r\n",
    // gat/gats keep the CAS value.
    "set @g 0 0 2\r\nhi\r\ngats 100 @g\r\ngets @g\r\nmg @g t\r\ngat 0 @g @none\r\nmg @g t\r\ngat x @g\r\n",
    // Meta.
    "ms @m 2 F5 T100\r\nhi\r\nmg @m s v f t k Oabc\r\nmg @m k f\r\nmg @none v k Ox\r\nmg @none v q\r\nmn\r\n",
    "ms @k 1 ME\r\na\r\nms @k 1 ME\r\nb\r\nms @k 1 MA\r\nc\r\nms @k 1 MP\r\nd\r\nmg @k v\r\nms @none 1 MR\r\nx\r\nms @k 1 MX\r\ns\r\nms @k 1 q\r\nq\r\nmn\r\n",
    "ms @t 1 T50\r\nx\r\nmg @t t T90\r\nmg @t T120 t\r\nmg @t T-1\r\nmg @t\r\n",
    "mg @v N30 t v\r\nmg @v N30 t v\r\nms @r 1 T10\r\ny\r\nmg @r R5\r\nmg @r R30\r\nmg @r R30\r\n",
    "ms @x 2\r\nhi\r\nmd @x I T30\r\nmg @x t v\r\nmg @x t v\r\nms @x 2\r\nok\r\nmg @x v\r\n",
    // A created item's TTL is set by `T` and `N` in request order; `t` sees
    // the TTL so far. (Found by differential_random.rs, as are those below.)
    "mg @a T100 N30 t\r\nmg @a t\r\nmg @b N30 t T0\r\nmg @b t\r\nmg @c T-1 N30\r\nmg @c v\r\nmg @d N30 T-1\r\nmg @d v\r\nma @e T100 N30 t\r\nma @e t\r\nma @f N30 T100 t\r\nma @f t\r\n",
    // `ma` on a hit: `t` before `T` sees the old TTL; an empty value is
    // non-numeric before any CAS comparison.
    "set @n 0 100 1\r\n5\r\nma @n t T1000\r\nma @n t\r\nms @z 0\r\n\r\nma @z C999999999\r\nma @z C0 N30\r\n",
    // `md C0` compares, as any `C`.
    "set @m 0 0 1\r\nx\r\nmd @m C0\r\nmd @m C0 q\r\nmd @m C0 I\r\nmg @m v\r\nmd @none C0\r\n",
    "md @d\r\nmd @d q k Oo\r\nms @d 1\r\nx\r\nmd @d q\r\nmn\r\nmg @d\r\nmd @d !\r\n",
    "ma @c\r\nma @c q k\r\nma @c N0 J10 v q\r\nma @c v\r\nma @c MD D5 v\r\nma @c M- D100 v\r\nma @c T60 t v\r\nma @c\r\nma @c q\r\nmn\r\nma @c MZ\r\nma @c Dx\r\n",
    "ms @b 2 !\r\nzz\r\nms @b 2 T\r\nzz\r\nms @b 2\r\nzzz\r\nms @b 2 Oaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\nzz\r\nmn\r\n",
    // Framing and errors.
    "\r\n\nbogus\r\nGET @a\r\nget @a\nset @a\r\nget\r\nversion\rversion\r\nset @a x 0 1\r\nz\r\nset @a 0 0 -1\r\n",
    "set @a 0 0 1\r\nzz\r\nset @a 0 0 1 noreply\r\nzz\r\nverbosity x\r\nverbosity 1\r\nverbosity 1 noreply\r\nmn\r\nmz @a\r\nmg\r\n",
    "flush_all x\r\nshutdown\r\ncache_memlimit 4\r\nstats bogus\r\nstats reset\r\nquit\r\nget @after_quit\r\n",
    // Tuning of memcached's slab allocator and LRUs (kura has neither) and its per-prefix
    // and size statistics, answered as memcached answers them.
    "stats detail\r\nstats detail x\r\nstats detail on x\r\nstats detail dump\r\nstats detail off\r\nstats sizes\r\nmn\r\n",
    "slabs\r\nslabs automove\r\nslabs automove 2\r\nslabs automove 3\r\nslabs automove -1\r\nslabs automove x\r\nslabs automove 1 2\r\nslabs automove 0\r\nslabs bogus\r\nmn\r\n",
    "slabs reassign\r\nslabs reassign 1\r\nslabs reassign 1 2\r\nslabs reassign 0 2\r\nslabs reassign 1 64\r\nslabs reassign -1 2\r\nslabs reassign x y\r\nmn\r\n",
    "lru\r\nlru mode\r\nlru mode flat\r\nlru mode segmented\r\nlru mode x\r\nlru tune 10 25 0.1 2\r\nlru tune 10 25 0.1\r\nlru tune x 25 0.1 2\r\nlru tune 90 25 0.1 2\r\nlru temp_ttl 0\r\nlru temp_ttl -1\r\nlru temp_ttl x\r\nlru bogus\r\nmn\r\n",
];

fn run_all(port: u16, tag: &str) -> Vec<String> {
    SCRIPTS
        .iter()
        .enumerate()
        .map(|(i, script)| {
            let script = script.replace('@', &format!("{tag}{i}_"));
            normalise(&transcript(port, script.as_bytes()), &format!("{tag}{i}_"))
        })
        .collect()
}

/// Masks CAS values in `VALUE` lines and meta headers, and the key prefix;
/// rounds TTLs (`t<N>`) up to a multiple of 10, as a second may tick between
/// a store and its reply (the scripts' TTLs are all multiples of 10).
fn normalise(reply: &[u8], prefix: &str) -> String {
    let text = String::from_utf8_lossy(reply).replace(prefix, "@");
    let mut out = String::new();
    for line in text.split_inclusive("\r\n") {
        let tokens: Vec<&str> = line.trim_end_matches("\r\n").split(' ').collect();
        let masked: Vec<String> = match tokens.first().copied() {
            Some("VALUE") if tokens.len() == 5 => tokens[..4]
                .iter()
                .map(|t| t.to_string())
                .chain(["#".to_owned()])
                .collect(),
            Some("VA" | "HD" | "EN" | "NF" | "NS" | "EX") => tokens
                .iter()
                .map(|t| {
                    let number = t
                        .get(1..)
                        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                        .and_then(|n| n.parse::<u64>().ok());
                    match (t.as_bytes()[0], number) {
                        (b'c', Some(_)) => "c#".to_owned(),
                        (b't', Some(n)) if n > 1 => format!("t{}", n.div_ceil(10) * 10),
                        _ => t.to_string(),
                    }
                })
                .collect(),
            _ => {
                out.push_str(line);
                continue;
            }
        };
        out.push_str(&masked.join(" "));
        out.push_str(if line.ends_with("\r\n") { "\r\n" } else { "" });
    }
    out
}

#[test]
fn kura_answers_like_memcached() {
    let memcached = kura_testkit::try_or_skip!(Memcached::start(&[]));
    let kura = Kura::start(&[]);
    let theirs = run_all(memcached.port, "t");
    let ours = run_all(kura.port, "t");
    assert_eq!(theirs.len(), SCRIPTS.len());
    assert!(
        theirs.iter().all(|t| !t.is_empty()),
        "memcached answered every script"
    );
    for (i, (a, b)) in theirs.iter().zip(&ours).enumerate() {
        assert_eq!(b, a, "script {i} differs from memcached:\n{}", SCRIPTS[i]);
    }
}
