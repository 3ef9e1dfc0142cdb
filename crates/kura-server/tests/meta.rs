//! The meta commands (`mg ms md ma mn me`) and their flags. Expected replies
//! are memcached 1.6.18's (recorded against it), CAS values aside.

mod common;

use common::{Client, Kura};

/// The CAS value `mg` reports for `key`.
fn cas_of(c: &mut Client, key: &str) -> u64 {
    c.send(format!("mg {key} c\r\n"));
    let line = c.line();
    line.trim_end()
        .strip_prefix("HD c")
        .unwrap_or_else(|| panic!("{line:?}"))
        .parse()
        .unwrap()
}

#[test]
fn mg_return_flags() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("ms m1 2 F5 T100\r\nhi\r\n", "HD\r\n");
    let cas = cas_of(&mut c, "m1");
    c.expect("mg m1 v\r\n", "VA 2\r\nhi\r\n");
    c.expect_ttl_line(
        "mg m1 s v f t c k Oabc\r\n",
        &format!("VA 2 s2 f5 t100 c{cas} km1 Oabc\r\n"),
    );
    assert_eq!(c.line(), "hi\r\n");
    c.expect("mg m1 k f\r\n", "HD km1 f5\r\n");
    c.expect("mg m1\r\n", "HD\r\n");
    // Misses: EN with only O and k; q hides EN.
    c.expect("mg nope v k Ox c\r\n", "EN knope Ox\r\n");
    c.expect("mg nope v q\r\nmg m1 q k\r\nmn\r\n", "HD km1\r\nMN\r\n");
    // Base64 keys come back encoded, followed by b.
    c.expect("ms bTE= 1 b\r\nz\r\n", "HD\r\n");
    c.expect("mg bTE= b k v\r\n", "VA 1 kbTE= b\r\nz\r\n");
    c.expect("mg m1 b\r\n", "CLIENT_ERROR error decoding key\r\n");
    c.expect("mg m1 v v\r\n", "CLIENT_ERROR duplicate flag\r\n");
    c.expect("mg m1 !\r\n", "CLIENT_ERROR invalid flag\r\n");
}

#[test]
fn mg_touch_vivify_recache() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("ms t1 1 T50\r\nx\r\n", "HD\r\n");
    let cas = cas_of(&mut c, "t1");
    // `t` before `T` reports the old TTL, after it the new one; the CAS value stays.
    c.expect_ttl_line("mg t1 t T90\r\n", "HD t50\r\n");
    c.expect_ttl_line("mg t1 T120 t c\r\n", &format!("HD t120 c{cas}\r\n"));
    c.expect("mg t1 T-1\r\nmg t1\r\n", "HD\r\nEN\r\n");
    // N: the first miss creates an empty item and wins (W); later readers see Z.
    c.send("mg viv N30 c t v\r\n");
    let first = c.line();
    assert!(
        first.starts_with("VA 0 c")
            && (first.ends_with(" t30 W\r\n") || first.ends_with(" t29 W\r\n")),
        "{first:?}"
    );
    assert_eq!(c.line(), "\r\n");
    c.expect_ttl_line("mg viv N30 t v\r\n", "VA 0 t30 Z\r\n");
    assert_eq!(c.line(), "\r\n");
    // R: win the recache when less TTL than asked is left, once.
    c.expect("ms r1 1 T10\r\ny\r\n", "HD\r\n");
    c.expect("mg r1 R5\r\n", "HD\r\n");
    c.expect("mg r1 R30\r\n", "HD W\r\n");
    c.expect("mg r1 R30\r\n", "HD Z\r\n");
}

#[test]
fn stale_items_and_invalidation() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("ms x 2\r\nhi\r\n", "HD\r\n");
    let cas0 = cas_of(&mut c, "x");
    c.expect(format!("md x I C{}\r\n", cas0 + 1000), "EX\r\n");
    c.expect("md x I T30\r\n", "HD\r\n");
    let stale_cas = {
        c.send("mg x c v\r\n");
        let line = c.line();
        assert!(
            line.ends_with(" X W\r\n"),
            "first reader of a stale item wins: {line:?}"
        );
        assert_eq!(c.line(), "hi\r\n");
        line.split(' ')
            .find_map(|t| t.strip_prefix('c'))
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert_ne!(stale_cas, cas0, "invalidation bumps the CAS value");
    c.expect_ttl_line("mg x t v\r\n", "VA 2 t30 Z X\r\n");
    assert_eq!(c.line(), "hi\r\n");
    // A set with an older CAS and I is stored, still stale, keeping the win.
    c.expect(format!("ms x 2 C{cas0} I\r\nyo\r\n"), "HD\r\n");
    c.expect("mg x v\r\n", "VA 2 Z X\r\nyo\r\n");
    // A plain set clears it.
    c.expect("ms x 2\r\nok\r\n", "HD\r\n");
    c.expect("mg x v\r\n", "VA 2\r\nok\r\n");
}

#[test]
fn ms_modes_and_flags() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("ms k 1 ME\r\na\r\n", "HD\r\n");
    c.expect("ms k 1 ME\r\nb\r\n", "NS\r\n");
    c.expect("ms k 1 MA\r\nc\r\n", "HD\r\n");
    c.expect("ms k 1 MP\r\nd\r\n", "HD\r\n");
    c.expect("mg k v\r\n", "VA 3\r\ndac\r\n");
    c.expect("ms nope 1 MR\r\nx\r\n", "NS\r\n");
    c.expect("ms nope 1 MA\r\nx\r\n", "NS\r\n");
    c.expect("ms k 1 MR F9\r\nr\r\n", "HD\r\n");
    c.expect("mg k v f\r\n", "VA 1 f9\r\nr\r\n");
    c.expect("ms k 1 MS\r\ns\r\n", "HD\r\n");
    c.expect(
        "ms k 1 MX\r\ns\r\n",
        "CLIENT_ERROR invalid mode for ms M token\r\n",
    );
    // C upgrades set to compare-and-swap; c returns the new CAS value; k and O echo.
    let cas = cas_of(&mut c, "k");
    c.expect(
        format!("ms k 1 C{} k Oq1\r\nz\r\n", cas + 1),
        "EX kk Oq1\r\n",
    );
    c.send(format!("ms k 1 C{cas} c k\r\nz\r\n"));
    let line = c.line();
    let new_cas: u64 = line
        .trim_end()
        .strip_prefix("HD c")
        .unwrap()
        .strip_suffix(" kk")
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(new_cas, cas);
    c.expect("ms gone 1 C5\r\nz\r\n", "NF\r\n");
    // E sets the CAS value explicitly.
    c.expect("ms e 1 E12345\r\nv\r\nmg e c\r\n", "HD\r\nHD c12345\r\n");
    // q hides HD but not failures.
    c.expect(
        "ms k 1 q\r\nq\r\nms k 1 ME q\r\nq\r\nmn\r\n",
        "NS\r\nMN\r\n",
    );
    // Invalid flags answer and swallow the data block.
    c.expect(
        "ms k 2 !\r\nzz\r\nmn\r\n",
        "CLIENT_ERROR invalid flag\r\nMN\r\n",
    );
    c.expect(
        "ms k 2 T\r\nzz\r\nmn\r\n",
        "CLIENT_ERROR bad token in command line format\r\nMN\r\n",
    );
    c.expect(
        "ms k 2\r\nzzz\r\n",
        "CLIENT_ERROR bad data chunk\r\nERROR\r\n",
    );
}

#[test]
fn md_flags() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("md d\r\n", "NF\r\n");
    c.expect("md d q k Oo\r\n", "NF kd Oo\r\n");
    c.expect("ms d 1\r\nx\r\n", "HD\r\n");
    let cas = cas_of(&mut c, "d");
    c.expect(format!("md d C{}\r\n", cas + 1), "EX\r\n");
    c.expect(format!("md d C{cas} q\r\nmn\r\n"), "MN\r\n");
    c.expect("mg d\r\n", "EN\r\n");
    // x keeps the key with an empty value.
    c.expect("ms d 3 F4\r\nabc\r\n", "HD\r\n");
    c.expect("md d x\r\nmg d v f\r\n", "HD\r\nVA 0 f0\r\n\r\n");
    c.expect("md d !\r\n", "CLIENT_ERROR invalid or duplicate flag\r\n");
}

#[test]
fn ma_modes_and_flags() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("ma cnt\r\n", "NF\r\n");
    c.expect("ma cnt q k\r\n", "NF kcnt\r\n");
    // N vivifies with J (not incremented); its reply shows even with q.
    c.expect("ma cnt N0 J10 v q\r\n", "VA 2\r\n10\r\n");
    c.expect("ma cnt v\r\n", "VA 2\r\n11\r\n");
    c.expect("ma cnt MD D5 v\r\n", "VA 1\r\n6\r\n");
    c.expect("ma cnt M- D100 v\r\n", "VA 1\r\n0\r\n");
    c.expect(
        "ma cnt M+ D18446744073709551615 v\r\nma cnt MI D2 v\r\n",
        "VA 20\r\n18446744073709551615\r\nVA 1\r\n1\r\n",
    );
    c.expect("ma cnt\r\nma cnt q\r\nmn\r\n", "HD\r\nMN\r\n");
    c.expect_ttl_line("ma cnt T60 t v\r\n", "VA 1 t60\r\n");
    assert_eq!(c.line(), "4\r\n");
    let cas = cas_of(&mut c, "cnt");
    c.expect(format!("ma cnt C{} v\r\n", cas + 1), "EX\r\n");
    c.send(format!("ma cnt C{cas} c v k\r\n"));
    let line = c.line();
    assert!(
        line.starts_with("VA 1 c") && line.ends_with(" kcnt\r\n"),
        "{line:?}"
    );
    assert_eq!(c.line(), "5\r\n");
    c.expect(
        "ms txt 3\r\nabc\r\nma txt\r\n",
        "HD\r\nCLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
    );
    c.expect(
        "ma cnt MZ\r\n",
        "CLIENT_ERROR invalid mode for ma M token\r\n",
    );
    c.expect(
        "ma cnt Dx\r\n",
        "CLIENT_ERROR invalid or duplicate flag\r\n",
    );
}

#[test]
fn mn_and_me() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    c.expect("mn\r\n", "MN\r\n");
    c.expect("me nope\r\n", "EN\r\n");
    c.expect("set dbg 0 100 1\r\nx\r\n", "STORED\r\n");
    c.send("me dbg\r\n");
    let line = c.line();
    // memcached prints `current_time - exptime`, negative while the item lives.
    assert!(
        line.starts_with("ME dbg exp=-10")
            && line.contains(" la=")
            && line.contains(" cas=")
            && line.ends_with(" fetch=no cls=1 size=63\r\n"),
        "memcached's size and class (1.6.18: size=63): {line:?}"
    );
    c.expect("set n 0 0 1\r\nx\r\n", "STORED\r\n");
    c.send("me n\r\n");
    assert!(c.line().starts_with("ME n exp=-1 la="));
    c.expect(format!("set big 3 0 5000\r\n{}\r\n", "y".repeat(5000)), "STORED\r\n");
    c.send("me big\r\n");
    let line = c.line();
    assert!(line.ends_with(" fetch=no cls=19 size=5066\r\n"), "memcached 1.6.18 said cls=19 size=5066: {line:?}");
}

#[test]
fn quiet_pipelines_end_with_mn() {
    let kura = Kura::start(&[]);
    let mut c = kura.client();
    let mut request = String::new();
    for i in 0..50 {
        request.push_str(&format!("ms q{i} 1 q\r\n{}\r\n", i % 10));
    }
    for i in 0..60 {
        request.push_str(&format!("mg q{i} v q k\r\n"));
    }
    request.push_str("mn\r\n");
    let mut expected = String::new();
    for i in 0..50 {
        expected.push_str(&format!("VA 1 kq{i}\r\n{}\r\n", i % 10));
    }
    expected.push_str("MN\r\n");
    c.expect(request, expected);
}
