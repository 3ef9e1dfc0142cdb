//! The NBD server through real clients: fio's nbd engine, qemu-img, qemu-io, nbdinfo, and a
//! raw protocol client for hostile input. Every server is `kura block nbd` (a real process) on
//! a real pool backend: the embedded engine, `kura serve`, memcached, redis-server.

mod common;

use std::io::Write;
use std::time::Duration;

use common::raw_client::RawClient;
use common::{Backend, NbdProcess, kura, pattern, run};
use kura_block::nbd::proto;
use kura_testkit::{memcache_stat, require_cmd, try_or_skip};

fn fio(args: &[&str]) -> Result<String, String> {
    run("fio", args)
}

/// fio's nbd engine: random 4 KiB writes verified with crc32c, random 512 B – 128 KiB writes
/// (read-modify-write of partial blocks) verified too, then a separate read-only pass over a
/// new connection that verifies the first region again, on every backend.
#[test]
fn fio_verify_on_every_backend() {
    try_or_skip!(require_cmd("fio"));
    for backend in Backend::all() {
        backend.create_volume("disk", "64M");
        let nbd = NbdProcess::start(&backend.url(), &[]);
        let uri = nbd.uri("disk");
        let uri_arg = format!("--uri={uri}");
        let common = ["--ioengine=nbd", &uri_arg, "--verify=crc32c", "--verify_fatal=1", "--randrepeat=1", "--output-format=terse"];
        let mut job = vec!["--name=aligned", "--rw=randwrite", "--bs=4k", "--size=32M", "--iodepth=32", "--do_verify=1"];
        job.extend(common);
        fio(&job).unwrap_or_else(|e| panic!("{}: {e}", backend.name()));
        let mut job = vec!["--name=unaligned", "--rw=randwrite", "--bsrange=512-128k", "--offset=32M", "--size=32M", "--iodepth=16", "--do_verify=1"];
        job.extend(common);
        fio(&job).unwrap_or_else(|e| panic!("{} (512 B - 128 KiB writes): {e}", backend.name()));
        let mut job = vec!["--name=aligned", "--rw=randwrite", "--bs=4k", "--size=32M", "--iodepth=32", "--verify_only"];
        job.extend(common);
        let out = fio(&job).unwrap_or_else(|e| panic!("{} (verify pass): {e}", backend.name()));
        assert!(!out.contains("verify: bad"), "{}: {out}", backend.name());
        eprintln!("fio verify on {}: ok", backend.name());
    }
}

/// `qemu-img convert` a disk image onto an export and back: identical. `nbdinfo` shows the
/// size and block sizes.
#[test]
fn qemu_img_round_trip_and_nbdinfo() {
    try_or_skip!(require_cmd("qemu-img"));
    try_or_skip!(require_cmd("nbdinfo"));
    let backend = Backend::embedded();
    backend.create_volume("image", "24M");
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let dir = tempfile::tempdir().unwrap();
    // An image with data, a zero region, and unaligned-looking content boundaries.
    let mut image = pattern(1, 24 << 20);
    image[(4 << 20)..(9 << 20) + 512].fill(0);
    let src = dir.path().join("src.img");
    std::fs::write(&src, &image).unwrap();
    let uri = nbd.uri("image");
    run("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", src.to_str().unwrap(), &uri]).unwrap();
    let back = dir.path().join("back.img");
    run("qemu-img", &["convert", "-f", "raw", "-O", "raw", &uri, back.to_str().unwrap()]).unwrap();
    let out = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", src.to_str().unwrap(), back.to_str().unwrap()]).unwrap();
    assert!(out.contains("Images are identical"), "{out}");
    assert_eq!(std::fs::read(&back).unwrap(), image);

    let info = run("nbdinfo", &["--json", &uri]).unwrap();
    let json: serde_json::Value = serde_json::from_str(&info).unwrap_or_else(|e| panic!("{e}: {info}"));
    let export = &json["exports"][0];
    assert_eq!(export["export-size"], 24 << 20, "{info}");
    assert_eq!(export["block_size_minimum"], 512, "{info}");
    assert_eq!(export["block_size_preferred"], 4096, "{info}");
    assert_eq!(export["block_size_maximum"], 32 << 20, "{info}");
    assert_eq!(export["can_multi_conn"], true, "{info}");
    assert_eq!(export["can_flush"], true, "{info}");
    assert_eq!(export["can_fua"], true, "{info}");
    assert_eq!(export["can_trim"], true, "{info}");
    assert_eq!(export["can_zero"], true, "{info}");
    assert_eq!(export["can_fast_zero"], true, "{info}");
    assert_eq!(export["can_df"], true, "{info}");
    assert_eq!(json["structured"], true, "{info}");
    assert_eq!(export["contexts"], serde_json::json!(["base:allocation"]), "{info}");
    let list = run("nbdinfo", &["--list", "--json", &format!("nbd://{}", nbd.addr)]).unwrap();
    assert!(list.contains("\"export-name\": \"image\""), "{list}");
}

/// Writes, a FLUSH (and FUA writes), then `kill -9` of every kura process and a restart:
/// everything flushed reads back. On the embedded engine and on a kura server.
#[test]
fn flushed_writes_survive_kill_9() {
    try_or_skip!(require_cmd("qemu-io"));
    for mut backend in [Backend::embedded(), Backend::kura()] {
        backend.create_volume("d", "16M");
        let mut nbd = NbdProcess::start(&backend.url(), &[]);
        let uri = nbd.uri("d");
        // Flushed writes: patterns at aligned and unaligned places, then a flush.
        run("qemu-io", &["-f", "raw", &uri, "-c", "write -P 0xa1 0 1M", "-c", "write -P 0xa2 3M 4096", "-c", "write -P 0xa3 5120 1536", "-c", "flush"]).unwrap();
        // FUA writes need no flush.
        run("qemu-io", &["-f", "raw", &uri, "-c", "write -f -P 0xb1 8M 64k", "-c", "write -f -P 0xb2 9M 512"]).unwrap();
        nbd.kill();
        if let Backend::Kura(server) = &mut backend {
            server.kill();
            server.restart();
        }
        nbd.restart();
        let uri = nbd.uri("d");
        let out = run(
            "qemu-io",
            &[
                "-f",
                "raw",
                &uri,
                "-c",
                "read -P 0xa1 0 5120",
                "-c",
                "read -P 0xa3 5120 1536",
                "-c",
                "read -P 0xa1 6656 1041920",
                "-c",
                "read -P 0xa2 3M 4096",
                "-c",
                "read -P 0xb1 8M 64k",
                "-c",
                "read -P 0xb2 9M 512",
                "-c",
                "read -P 0 1M 2M",
            ],
        )
        .unwrap_or_else(|e| panic!("{}: {e}", backend.name()));
        assert!(!out.contains("Pattern verification failed"), "{}: {out}", backend.name());
        eprintln!("kill -9 on {}: flushed data intact", backend.name());
    }
}

/// TRIM and WRITE_ZEROES delete whole blocks from the pool (space comes back) and zero the
/// partial ones, and so does a plain write of whole blocks of zeros; what is left reads
/// correctly.
#[test]
fn trim_and_write_zeroes_delete_blocks() {
    try_or_skip!(require_cmd("qemu-io"));
    let backend = Backend::embedded();
    backend.create_volume("z", "4M");
    let mut nbd = NbdProcess::start(&backend.url(), &[]);
    let uri = nbd.uri("z");
    run("qemu-io", &["-f", "raw", &uri, "-c", "write -P 0x55 0 4M", "-c", "write -P 0 512K 64K", "-c", "discard 1M 1M", "-c", "write -z -u 2M 1M", "-c", "write -z -u 3M 1024", "-c", "flush"]).unwrap();
    let out = run("qemu-io", &["-f", "raw", &uri, "-c", "read -P 0x55 0 512K", "-c", "read -P 0 512K 64K", "-c", "read -P 0x55 576K 448K", "-c", "read -P 0 2M 1M", "-c", "read -P 0 3M 1024", "-c", "read -P 0x55 3146752 1047552"]).unwrap();
    assert!(!out.contains("Pattern verification failed"), "{out}");
    nbd.stop();
    // The pool itself: trimmed and zeroed blocks are gone, the others are there.
    let Backend::Embedded { dir } = &backend else { unreachable!() };
    let handle = kura_block::open_pool(kura_pool::PoolConfig::from_urls(&[format!("embedded:{}", dir.path().join("pool.kura").display())]).unwrap()).unwrap();
    let mut ctx = handle.pool.context().unwrap();
    let meta = kura_block::Volumes::new(&mut ctx).open("z").unwrap();
    let present = |ctx: &mut kura_pool::Context, lba: u64| ctx.get(&kura_pool::block_key(meta.id, lba)).unwrap().is_some();
    assert!(present(&mut ctx, 0) && present(&mut ctx, 127) && present(&mut ctx, 144) && present(&mut ctx, 255), "written blocks are in the pool");
    for lba in [128, 143, 256, 300, 511, 512, 767] {
        assert!(!present(&mut ctx, lba), "block {lba} was written with zeros, trimmed or zeroed, so deleted");
    }
    assert!(present(&mut ctx, 768), "block 768 was zeroed only partly (read-modify-write)");
}

/// Which extents hold data, as `nbdinfo --map` sees them (libnbd's block status over
/// `base:allocation`): (offset, length, flags).
fn allocation_map(uri: &str) -> Vec<(u64, u64, u64)> {
    let out = run("nbdinfo", &["--map", "--json", uri]).unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    json.as_array().unwrap_or_else(|| panic!("{out}")).iter().map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["type"].as_u64().unwrap())).collect()
}

/// Block status (`base:allocation`) through real clients, on every backend: `nbdinfo --map`
/// and `qemu-img map` report exactly the blocks written as data and the rest (never written,
/// trimmed, zeroed, written with zeros) as holes that read as zeros; `nbdcopy` with the
/// extents skips the holes and copies the same bytes as without them.
#[test]
fn block_status_reports_data_and_holes_to_real_clients() {
    try_or_skip!(require_cmd("qemu-io"));
    try_or_skip!(require_cmd("nbdinfo"));
    try_or_skip!(require_cmd("nbdcopy"));
    const HOLE: u64 = (proto::STATE_HOLE | proto::STATE_ZERO) as u64;
    for backend in Backend::all() {
        let name = backend.name();
        backend.create_volume("m", "64M");
        let nbd = NbdProcess::start(&backend.url(), &[]);
        let uri = nbd.uri("m");
        assert_eq!(allocation_map(&uri), vec![(0, 64 << 20, HOLE)], "{name}: a new volume is one hole");
        run(
            "qemu-io",
            &["-f", "raw", &uri, "-c", "write -P 0x11 0 1M", "-c", "write -P 0x22 8M 4096", "-c", "write -P 0 16M 64k", "-c", "write -P 0x44 17M 64k", "-c", "write -z -u 17M 32k", "-c", "write -P 0x33 20M 512", "-c", "discard 512k 256k"],
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = vec![
            (0, 512 << 10, 0),
            (512 << 10, 256 << 10, HOLE),
            (768 << 10, 256 << 10, 0),
            (1 << 20, 7 << 20, HOLE),
            (8 << 20, 4096, 0),
            ((8 << 20) + 4096, (9 << 20) - 4096 + (32 << 10), HOLE),
            ((17 << 20) + (32 << 10), 32 << 10, 0),
            ((17 << 20) + (64 << 10), (3 << 20) - (64 << 10), HOLE),
            (20 << 20, 4096, 0),
            ((20 << 20) + 4096, (44 << 20) - 4096, HOLE),
        ];
        assert_eq!(allocation_map(&uri), expected, "{name}");
        let map = run("qemu-img", &["map", "--output=json", "-f", "raw", &uri]).unwrap();
        let map: serde_json::Value = serde_json::from_str(&map).unwrap_or_else(|e| panic!("{e}: {map}"));
        let qemu: Vec<(u64, u64, u64)> = map.as_array().unwrap().iter().map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap(), if e["data"] == true { 0 } else { HOLE })).collect();
        assert_eq!(qemu, expected, "{name}: qemu-img map");
        let dir = tempfile::tempdir().unwrap();
        let (sparse, full) = (dir.path().join("sparse.img"), dir.path().join("full.img"));
        run("nbdcopy", &[&uri, sparse.to_str().unwrap()]).unwrap();
        run("nbdcopy", &["--no-extents", &uri, full.to_str().unwrap()]).unwrap();
        let (a, b) = (std::fs::read(&sparse).unwrap(), std::fs::read(&full).unwrap());
        assert!(a == b, "{name}: the copy that skipped holes differs from the full one");
        assert_eq!(&a[(8 << 20)..(8 << 20) + 4096], &[0x22; 4096][..], "{name}");
        use std::os::unix::fs::MetadataExt;
        let allocated = std::fs::metadata(&sparse).unwrap().blocks() * 512;
        assert!(allocated < 4 << 20, "{name}: the copy of 1.2 MiB of data over 64 MiB allocates {allocated} bytes");
        eprintln!("block status on {name}: {} extents as expected", expected.len());
    }
}

/// Block status asks the pool whether each block exists (`mg <key>`: `HD`/`EN`), so the
/// values stay on the server: `nbdinfo --map` of a volume with 16 MiB written makes the kura
/// server (and memcached) send a few bytes per block, where a get per block sent all 16 MiB.
/// A block stored as zeros (`WRITE_ZEROES` with `NO_HOLE`) is reported as data (flags 0, which
/// is always correct): telling its zeros apart would need the value.
#[test]
fn block_status_sends_no_values_from_the_pool() {
    try_or_skip!(require_cmd("qemu-io"));
    try_or_skip!(require_cmd("nbdinfo"));
    const HOLE: u64 = (proto::STATE_HOLE | proto::STATE_ZERO) as u64;
    let mut backends = vec![Backend::kura()];
    match Backend::memcached() {
        Ok(b) => backends.push(b),
        Err(reason) => kura_testkit::skip(&reason),
    }
    for backend in backends {
        let name = backend.name();
        let port = match &backend {
            Backend::Kura(server) => server.port,
            Backend::Memcached { port, .. } => *port,
            _ => unreachable!("memcached-protocol backends"),
        };
        backend.create_volume("s", "64M");
        let nbd = NbdProcess::start(&backend.url(), &[]);
        let uri = nbd.uri("s");
        run("qemu-io", &["-f", "raw", &uri, "-c", "write -P 0x5a 0 16M", "-c", "write -z 32M 64k", "-c", "flush"]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let before = memcache_stat(port, "bytes_written");
        let map = allocation_map(&uri);
        let sent = memcache_stat(port, "bytes_written") - before;
        // 16 K blocks probed, `HD`/`EN` each, plus the volume's record and a `stats` reply.
        assert!(sent < 256 << 10, "{name}: the server sent {sent} bytes for the block status of 16 MiB written");
        assert_eq!(map, vec![(0, 16 << 20, 0), (16 << 20, 16 << 20, HOLE), (32 << 20, 64 << 10, 0), ((32 << 20) + (64 << 10), (32 << 20) - (64 << 10), HOLE)], "{name}");
        eprintln!("block status on {name}: {sent} bytes from the server for 64 MiB mapped, 16 MiB written");
    }
}

/// The structured replies and block status at the byte level: what is negotiated when, the
/// chunks of reads, block statuses and errors, `REQ_ONE`, `DF`, and the cap on one reply.
#[test]
fn structured_replies_and_block_status_follow_the_protocol() {
    let backend = Backend::embedded();
    backend.create_volume("v", "64M");
    backend.create_volume("w", "1M");
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().unwrap());
    const HOLE: u32 = proto::STATE_HOLE | proto::STATE_ZERO;

    // Negotiation: metadata contexts need structured replies first; LIST and SET.
    let mut c = RawClient::connect(&nbd.addr);
    c.send_option(proto::OPT_LIST_META_CONTEXT, &proto::encode_meta_request("v", &[]));
    assert_eq!(c.option_replies(proto::OPT_LIST_META_CONTEXT)[0].0, proto::REP_ERR_INVALID);
    c.structured_replies();
    let context = |id: u32| {
        let mut d = id.to_be_bytes().to_vec();
        d.extend_from_slice(proto::CONTEXT_BASE_ALLOCATION.as_bytes());
        (proto::REP_META_CONTEXT, d)
    };
    for queries in [&[][..], &["base:"], &["base:allocation", "qemu:dirty-bitmap:b"]] {
        c.send_option(proto::OPT_LIST_META_CONTEXT, &proto::encode_meta_request("v", queries));
        assert_eq!(c.option_replies(proto::OPT_LIST_META_CONTEXT), vec![context(0), (proto::REP_ACK, vec![])], "list {queries:?}");
    }
    for queries in [&[][..], &["base:"], &["qemu:allocation"]] {
        c.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("v", queries));
        assert_eq!(c.option_replies(proto::OPT_SET_META_CONTEXT), vec![(proto::REP_ACK, vec![])], "set {queries:?} selects nothing");
    }
    c.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("nope", &["base:allocation"]));
    assert_eq!(c.option_replies(proto::OPT_SET_META_CONTEXT)[0].0, proto::REP_ERR_UNKNOWN, "unknown export");
    c.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("v", &["base:allocation"])[..9]);
    assert_eq!(c.option_replies(proto::OPT_SET_META_CONTEXT)[0].0, proto::REP_ERR_INVALID, "malformed");
    c.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("v", &["base:allocation"]));
    assert_eq!(c.option_replies(proto::OPT_SET_META_CONTEXT), vec![context(proto::CONTEXT_ID_BASE_ALLOCATION), (proto::REP_ACK, vec![])]);
    let export = c.go_export("v", true);
    assert_ne!(export.transmission_flags & proto::FLAG_SEND_DF, 0, "DF with structured replies");

    // Data at 4 KiB..12 KiB and at 1 MiB.
    c.request(proto::CMD_WRITE, 0, 1, 4096, 8192, &pattern(1, 8192));
    c.request(proto::CMD_WRITE, proto::CMD_FLAG_FUA, 2, 1 << 20, 4096, &pattern(2, 4096));
    let mut handles = [c.reply(0), c.reply(0)].map(|(e, h, _)| (e, h));
    handles.sort();
    assert_eq!(handles, [(0, 1), (0, 2)], "writes get simple replies");

    // A read: one OFFSET_DATA chunk, done, at the request's offset; with DF too.
    for flags in [0, proto::CMD_FLAG_DF] {
        c.request(proto::CMD_READ, flags, 3, 4096 + 512, 1024, &[]);
        let (f, t, h, p) = c.chunk();
        assert_eq!((f, t, h), (proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_OFFSET_DATA, 3));
        assert_eq!(u64::from_be_bytes(p[..8].try_into().unwrap()), 4096 + 512);
        assert_eq!(&p[8..], &pattern(1, 8192)[512..1536]);
    }
    // A read of a range with no stored block: one OFFSET_HOLE chunk (with DF too: one content
    // chunk); a range with some data is all data.
    for flags in [0, proto::CMD_FLAG_DF] {
        c.request(proto::CMD_READ, flags, 3, 512 << 10, 64 << 10, &[]);
        let (f, t, h, p) = c.chunk();
        assert_eq!((f, t, h), (proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_OFFSET_HOLE, 3));
        assert_eq!((u64::from_be_bytes(p[..8].try_into().unwrap()), be32(&p[8..])), (512 << 10, 64 << 10));
    }
    c.request(proto::CMD_READ, 0, 3, 0, 16384, &[]);
    let (_, t, _, p) = c.chunk();
    assert_eq!((t, p.len()), (proto::REPLY_TYPE_OFFSET_DATA, 8 + 16384));
    assert!(p[8..8 + 4096].iter().all(|&b| b == 0) && p[8 + 4096..8 + 12288] == pattern(1, 8192)[..]);
    // Errors are error chunks: a read past the end, an unaligned request.
    for (kind, offset, len, error) in [(proto::CMD_READ, 64 << 20, 512, proto::EINVAL), (proto::CMD_BLOCK_STATUS, 100, 512, proto::EINVAL), (proto::CMD_BLOCK_STATUS, 64 << 20, 512, proto::EINVAL)] {
        c.request(kind, 0, 4, offset, len, &[]);
        let (f, t, h, p) = c.chunk();
        assert_eq!((f, t, h), (proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_ERROR, 4), "{kind} at {offset}");
        assert_eq!((be32(&p), p.len()), (error, 6), "{kind} at {offset}");
    }

    // Block status: one chunk for the one context, extents of the range only.
    let status = |c: &mut RawClient, flags: u16, offset: u64, len: u32| {
        c.request(proto::CMD_BLOCK_STATUS, flags, 5, offset, len, &[]);
        let (f, t, h, p) = c.chunk();
        assert_eq!((f, t, h), (proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_BLOCK_STATUS, 5));
        assert_eq!(be32(&p), proto::CONTEXT_ID_BASE_ALLOCATION);
        p[4..].chunks_exact(8).map(|d| (be32(d), be32(&d[4..]))).collect::<Vec<_>>()
    };
    assert_eq!(status(&mut c, 0, 0, 2 << 20), vec![(4096, HOLE), (8192, 0), ((1 << 20) - 12288, HOLE), (4096, 0), ((1 << 20) - 4096, HOLE)]);
    assert_eq!(status(&mut c, 0, 6144, 4096), vec![(4096, 0)], "inside the data");
    assert_eq!(status(&mut c, 0, 3584, 1024), vec![(512, HOLE), (512, 0)], "sectors of two blocks");
    assert_eq!(status(&mut c, proto::CMD_FLAG_REQ_ONE, 0, 2 << 20), vec![(4096, HOLE)], "REQ_ONE");
    assert_eq!(status(&mut c, proto::CMD_FLAG_REQ_ONE, 4096, 2 << 20), vec![(8192, 0)], "REQ_ONE");
    let capped = status(&mut c, 0, 2 << 20, 62 << 20);
    assert_eq!(capped, vec![(kura_block::nbd::BLOCK_STATUS_BYTES_MAX, HOLE)], "one reply covers at most BLOCK_STATUS_BYTES_MAX");

    // A client that negotiated structured replies but no context may not ask for status.
    let mut d = RawClient::connect(&nbd.addr);
    d.structured_replies();
    d.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("v", &["base:allocation"]));
    assert_eq!(d.option_replies(proto::OPT_SET_META_CONTEXT).len(), 2);
    d.go_export("w", true); // the context was selected for another export
    d.request(proto::CMD_BLOCK_STATUS, 0, 6, 0, 4096, &[]);
    let (_, t, h, p) = d.chunk();
    assert_eq!((t, h, be32(&p)), (proto::REPLY_TYPE_ERROR, 6, proto::EINVAL));
    // Without structured replies: no DF, simple replies, status refused.
    let mut e = RawClient::connect(&nbd.addr);
    let export = e.go_export("v", true);
    assert_eq!(export.transmission_flags & proto::FLAG_SEND_DF, 0);
    e.request(proto::CMD_READ, 0, 7, 4096, 512, &[]);
    assert_eq!(e.reply(512), (0, 7, pattern(1, 512)));
    e.expect_error(proto::CMD_BLOCK_STATUS, 0, 0, 4096, &[], proto::EINVAL, "status without structured replies");
    e.expect_error(proto::CMD_READ, proto::CMD_FLAG_DF, 0, 4096, &[], proto::EINVAL, "DF without structured replies");

    // FAST_ZERO: zeroing by deleting is fast; zeroing by writing zero blocks (NO_HOLE) is
    // not, so it fails with ENOTSUP and changes nothing.
    assert_ne!(export.transmission_flags & proto::FLAG_SEND_FAST_ZERO, 0);
    e.request(proto::CMD_WRITE_ZEROES, proto::CMD_FLAG_FAST_ZERO, 8, 4096, 4096, &[]);
    assert_eq!(e.reply(0).0, 0);
    e.request(proto::CMD_READ, 0, 9, 4096, 8192, &[]);
    let mut want = vec![0u8; 4096];
    want.extend_from_slice(&pattern(1, 8192)[4096..]);
    assert_eq!(e.reply(8192).2, want, "fast zero zeroed the block");
    e.expect_error(proto::CMD_WRITE_ZEROES, proto::CMD_FLAG_FAST_ZERO | proto::CMD_FLAG_NO_HOLE, 8192, 4096, &[], proto::ENOTSUP, "fast zero that would write");
    e.request(proto::CMD_READ, 0, 10, 8192, 4096, &[]);
    assert_eq!(e.reply(4096).2, pattern(1, 8192)[4096..].to_vec(), "a refused fast zero changes nothing");
}

/// create, list, resize (shrink deletes, grow reads zeros), delete — through the CLI.
#[test]
fn volume_lifecycle() {
    try_or_skip!(require_cmd("qemu-io"));
    let backend = Backend::kura();
    let url = backend.url();
    backend.create_volume("a", "8M");
    backend.create_volume("b", "1G");
    let err = std::process::Command::new(common::kura_bin()).args(["volume", "create", "a", "--size", "4M", "--pool", &url]).output().unwrap();
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("already exists"));
    let list = kura(&["volume", "list", "--json", "--pool", &url]);
    let json: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 2, "{list}");
    assert_eq!(json[0]["name"], "a");
    assert_eq!(json[0]["size_bytes"], 8 << 20);
    assert_eq!(json[0]["block_size_bytes"], 4096);
    assert!(json[0]["created_unix_s"].as_u64().unwrap() > 1_600_000_000);
    {
        let nbd = NbdProcess::start(&url, &[]);
        run("qemu-io", &["-f", "raw", &nbd.uri("a"), "-c", "write -P 0x77 0 8M", "-c", "flush"]).unwrap();
    }
    kura(&["volume", "resize", "a", "--size", "4M", "--pool", &url]);
    kura(&["volume", "resize", "a", "--size", "12M", "--pool", &url]);
    {
        let nbd = NbdProcess::start(&url, &[]);
        let out = run("qemu-io", &["-f", "raw", &nbd.uri("a"), "-c", "read -P 0x77 0 4M", "-c", "read -P 0 4M 8M"]).unwrap();
        assert!(!out.contains("Pattern verification failed"), "{out}");
    }
    kura(&["volume", "delete", "a", "--pool", &url]);
    let list = kura(&["volume", "list", "--json", "--pool", &url]);
    assert!(!list.contains("\"a\""), "{list}");
    // The same name again is a new, empty volume (a new id: no old block shows through).
    backend.create_volume("a", "8M");
    let nbd = NbdProcess::start(&url, &[]);
    let out = run("qemu-io", &["-f", "raw", &nbd.uri("a"), "-c", "read -P 0 0 8M"]).unwrap();
    assert!(!out.contains("Pattern verification failed"), "{out}");
}

/// Requests past the end, unaligned, oversized, unknown commands, flags and options, broken
/// magic, clients that vanish mid-request: the errors the protocol specifies or a clean close,
/// and the server keeps serving everyone else.
#[test]
fn bad_input_gets_protocol_errors_and_others_keep_being_served() {
    let backend = Backend::embedded();
    backend.create_volume("v", "1M");
    backend.create_volume("w", "1M");
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let addr = nbd.addr.clone();
    // A bystander connection that must keep working throughout.
    let mut bystander = RawClient::connect(&addr);
    assert_eq!(bystander.go("w"), 1 << 20);
    let mut check_bystander = || {
        bystander.request(proto::CMD_WRITE, 0, 9, 4096, 512, &[7u8; 512]);
        assert_eq!(bystander.reply(0).0, 0);
        bystander.request(proto::CMD_READ, 0, 10, 4096, 512, &[]);
        assert_eq!(bystander.reply(512).2, vec![7u8; 512]);
    };

    // Options.
    let mut c = RawClient::connect(&addr);
    c.send_option(0x4242, b"whatever");
    assert_eq!(c.option_replies(0x4242)[0].0, proto::REP_ERR_UNSUP, "unknown option");
    c.send_option(proto::OPT_STRUCTURED_REPLY, &[1]);
    assert_eq!(c.option_replies(proto::OPT_STRUCTURED_REPLY)[0].0, proto::REP_ERR_INVALID, "STRUCTURED_REPLY with data");
    c.send_option(proto::OPT_SET_META_CONTEXT, &proto::encode_meta_request("v", &["base:allocation"]));
    assert_eq!(c.option_replies(proto::OPT_SET_META_CONTEXT)[0].0, proto::REP_ERR_INVALID, "metadata contexts before structured replies");
    c.send_option(proto::OPT_STARTTLS, &[]);
    assert_eq!(c.option_replies(proto::OPT_STARTTLS)[0].0, proto::REP_ERR_POLICY);
    c.send_option(proto::OPT_GO, &[0, 0, 0, 9, b'v']);
    assert_eq!(c.option_replies(proto::OPT_GO)[0].0, proto::REP_ERR_INVALID, "malformed GO");
    c.send_option(proto::OPT_LIST, b"x");
    assert_eq!(c.option_replies(proto::OPT_LIST)[0].0, proto::REP_ERR_INVALID, "LIST with data");
    c.send_option(proto::OPT_GO, &RawClient::go_data("nope", &[]));
    assert_eq!(c.option_replies(proto::OPT_GO)[0].0, proto::REP_ERR_UNKNOWN, "unknown export");
    c.send_option(proto::OPT_INFO, &RawClient::go_data("v", &[proto::INFO_NAME, proto::INFO_DESCRIPTION]));
    let info = c.option_replies(proto::OPT_INFO);
    assert_eq!(info.last().unwrap().0, proto::REP_ACK);
    assert!(info.iter().any(|(k, d)| *k == proto::REP_INFO && d[..2] == proto::INFO_NAME.to_be_bytes() && &d[2..] == b"v"), "{info:?}");
    c.send_option(proto::OPT_LIST, &[]);
    let list = c.option_replies(proto::OPT_LIST);
    assert_eq!(list.iter().filter(|(k, _)| *k == proto::REP_SERVER).count(), 2, "{list:?}");
    c.send_option(proto::OPT_ABORT, &[]);
    assert_eq!(c.option_replies(proto::OPT_ABORT)[0].0, proto::REP_ACK);
    assert!(c.closed(), "the server closes after ABORT");
    check_bystander();

    // EXPORT_NAME of an unknown export cannot be answered with an error: the server hangs up.
    let mut c = RawClient::connect(&addr);
    c.send_option(proto::OPT_EXPORT_NAME, b"nope");
    assert!(c.closed());
    // An oversized option: hang up.
    let mut c = RawClient::connect(&addr);
    let mut b = Vec::new();
    b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    b.extend_from_slice(&(1u32 << 30).to_be_bytes());
    c.s.write_all(&b).unwrap();
    assert!(c.closed());
    check_bystander();

    // Transmission: each bad request gets its error, and the connection goes on.
    let mut c = RawClient::connect(&addr);
    assert_eq!(c.go("v"), 1 << 20);
    c.expect_error(proto::CMD_READ, 0, 1 << 20, 4096, &[], proto::EINVAL, "read past the end");
    c.expect_error(proto::CMD_READ, 0, (1 << 20) - 512, 1024, &[], proto::EINVAL, "read across the end");
    c.expect_error(proto::CMD_WRITE, 0, 1 << 20, 4096, &[1u8; 4096], proto::ENOSPC, "write past the end");
    c.expect_error(proto::CMD_TRIM, 0, 1 << 20, 4096, &[], proto::EINVAL, "trim past the end");
    c.expect_error(proto::CMD_READ, 0, 100, 512, &[], proto::EINVAL, "unaligned offset");
    c.expect_error(proto::CMD_WRITE, 0, 0, 100, &[1u8; 100], proto::EINVAL, "unaligned write (payload skipped)");
    c.expect_error(proto::CMD_READ, 0, 0, 64 << 20, &[], proto::EINVAL, "oversized read");
    c.expect_error(proto::CMD_WRITE, 0, 0, 33 << 20, &vec![3u8; 33 << 20], proto::EINVAL, "oversized write (payload skipped)");
    c.expect_error(proto::CMD_READ, 0, 0, 0, &[], proto::EINVAL, "empty read");
    c.expect_error(42, 0, 0, 512, &[], proto::EINVAL, "unknown command");
    c.expect_error(5, 0, 0, 512, &[], proto::EINVAL, "NBD_CMD_CACHE, not advertised");
    c.expect_error(proto::CMD_READ, 1 << 7, 0, 512, &[], proto::EINVAL, "unknown flag");
    c.expect_error(proto::CMD_READ, proto::CMD_FLAG_NO_HOLE, 0, 512, &[], proto::EINVAL, "flag for another command");
    c.expect_error(proto::CMD_FLUSH, 0, 0, 512, &[], proto::EINVAL, "flush with a length");
    // Good requests still work: many in flight, replies matched by handle.
    for i in 0..64u64 {
        c.request(proto::CMD_WRITE, if i % 8 == 0 { proto::CMD_FLAG_FUA } else { 0 }, 100 + i, i * 4096, 4096, &pattern(i, 4096));
    }
    let mut seen: Vec<u64> = (0..64)
        .map(|_| c.reply(0))
        .map(|(e, h, _)| {
            assert_eq!(e, 0);
            h
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, (100..164).collect::<Vec<_>>());
    c.request(proto::CMD_FLUSH, 0, 7, 0, 0, &[]);
    assert_eq!(c.reply(0).0, 0);
    for i in 0..64u64 {
        c.request(proto::CMD_READ, 0, 200 + i, i * 4096, 4096, &[]);
    }
    let mut got = std::collections::HashMap::new();
    for _ in 0..64 {
        let (e, h, d) = c.reply(4096);
        assert_eq!(e, 0);
        got.insert(h, d);
    }
    for i in 0..64u64 {
        assert_eq!(got[&(200 + i)], pattern(i, 4096), "block {i}");
    }
    // Bad magic: the server hangs up (it cannot find the next request).
    c.s.write_all(&[0xde, 0xad, 0xbe, 0xef]).unwrap();
    c.s.write_all(&[0u8; 24]).unwrap();
    assert!(c.closed(), "bad request magic");
    check_bystander();

    // Clients that vanish: mid-handshake, mid-header, mid-payload, and with reads in flight.
    let c = RawClient::connect(&addr);
    drop(c);
    let mut c = RawClient::connect(&addr);
    c.go("v");
    c.s.write_all(&proto::encode_request(&proto::Request { flags: 0, kind: proto::CMD_WRITE, handle: 1, offset: 0, len: 1 << 20 })[..20]).unwrap();
    drop(c);
    let mut c = RawClient::connect(&addr);
    c.go("v");
    c.request(proto::CMD_WRITE, 0, 1, 0, 1 << 20, &vec![9u8; 300_000]);
    drop(c);
    let mut c = RawClient::connect(&addr);
    c.go("v");
    for i in 0..256u64 {
        c.request(proto::CMD_READ, 0, i, (i % 256) * 4096, 4096, &[]);
        c.request(proto::CMD_WRITE, 0, 1000 + i, 512 * (i % 8), 512, &[i as u8; 512]);
    }
    drop(c);
    // A soft disconnect: replies to everything in flight, then the close.
    let mut c = RawClient::connect(&addr);
    c.go("v");
    c.request(proto::CMD_READ, 0, 1, 0, 4096, &[]);
    c.request(proto::CMD_DISC, 0, 2, 0, 0, &[]);
    assert_eq!(c.reply(4096).1, 1);
    assert!(c.closed());
    check_bystander();

    // The server is still healthy for a real client.
    if require_cmd("qemu-io").is_ok() {
        run("qemu-io", &["-f", "raw", &nbd.uri("v"), "-c", "read 0 1M"]).unwrap();
    }
}

/// Two connections write different 512-byte sectors of the same 4 KiB blocks at the same
/// time, many in flight: read-modify-write under the shared block locks keeps every sector.
#[test]
fn concurrent_sector_writes_to_one_block_from_two_connections() {
    let backend = Backend::kura();
    backend.create_volume("s", "1M");
    let nbd = NbdProcess::start(&backend.url(), &[]);
    const BLOCKS: u64 = 16;
    let writers: Vec<_> = (0..2u64)
        .map(|conn| {
            let addr = nbd.addr.clone();
            std::thread::spawn(move || {
                let mut c = RawClient::connect(&addr);
                c.go("s");
                // Connection 0 writes the even sectors, connection 1 the odd ones.
                let mut sent = 0;
                for block in 0..BLOCKS {
                    for sector in (conn..8).step_by(2) {
                        let offset = block * 4096 + sector * 512;
                        c.request(proto::CMD_WRITE, 0, offset, offset, 512, &pattern(offset, 512));
                        sent += 1;
                    }
                }
                for _ in 0..sent {
                    assert_eq!(c.reply(0).0, 0);
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let mut c = RawClient::connect(&nbd.addr);
    c.go("s");
    c.request(proto::CMD_READ, 0, 1, 0, (BLOCKS * 4096) as u32, &[]);
    let (e, _, data) = c.reply((BLOCKS * 4096) as usize);
    assert_eq!(e, 0);
    for sector in 0..BLOCKS * 8 {
        let offset = sector * 512;
        assert_eq!(&data[offset as usize..offset as usize + 512], &pattern(offset, 512)[..], "sector {sector}");
    }
}

/// The kura server dies (`kill -9`) under a running NBD export. On a connection opened
/// before, a read gets the protocol's error reply (EIO) and the connection stays usable; a new
/// connection is refused at the handshake with the reason. Once the server is back on the same
/// store, the same connection serves again, with what was flushed before the crash.
#[test]
fn a_server_that_dies_under_the_export_fails_reads_then_serves_again() {
    try_or_skip!(require_cmd("qemu-io"));
    let mut backend = Backend::kura();
    backend.create_volume("s", "16M");
    let nbd = NbdProcess::start(&backend.url(), &[]);
    let uri = nbd.uri("s");
    run("qemu-io", &["-f", "raw", &uri, "-c", "write -P 0xc4 1M 1M", "-c", "flush"]).unwrap();
    let mut client = RawClient::connect(&nbd.addr);
    assert_eq!(client.go("s"), 16 << 20);
    client.request(proto::CMD_READ, 0, 1, 1 << 20, 4096, &[]);
    assert_eq!(client.reply(4096), (0, 1, vec![0xc4; 4096]));

    let Backend::Kura(server) = &mut backend else { unreachable!() };
    server.kill();
    let started = std::time::Instant::now();
    client.request(proto::CMD_READ, 0, 2, 1 << 20, 4096, &[]);
    let (error, handle, _) = client.reply(4096);
    assert_eq!((error, handle), (proto::EIO, 2), "a read with the server gone gets EIO");
    eprintln!("server down: the read failed after {:?}", started.elapsed());
    let refused = run("qemu-io", &["-f", "raw", &uri, "-c", "read 0 4k"]).expect_err("a new connection while the pool is down");
    assert!(refused.contains("is down"), "the handshake says why: {refused}");

    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut handle = 3;
    loop {
        client.request(proto::CMD_READ, 0, handle, 1 << 20, 4096, &[]);
        let (error, got, data) = client.reply(4096);
        assert_eq!(got, handle);
        if error == 0 {
            assert_eq!(data, vec![0xc4; 4096], "flushed data after the server's crash");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no read succeeded within 30 s of the restart (error {error})");
        std::thread::sleep(Duration::from_millis(500));
        handle += 1;
    }
    run("qemu-io", &["-f", "raw", &uri, "-c", "read -P 0xc4 1M 1M"]).unwrap();
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The fields after the command name (which may hold spaces) start after its ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("stat has a command name") + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// `--busy-poll-us`: connections that watch the socket without sleeping after a reply serve
/// queue-depth-1 clients exactly as sleeping ones do: fio's verified writes and reads, a
/// request whose payload comes during the poll, a client that hangs up during it. Once the
/// clients are gone the server goes back to sleep (its CPU time stops growing), and a poll
/// longer than the limit is refused at the command line.
#[test]
fn busy_polling_connections_serve_and_go_back_to_sleep() {
    let backend = Backend::embedded();
    backend.create_volume("p", "8M");
    let limit = kura_block::nbd::server::BUSY_POLL_US_MAX;
    let too_long = run(common::kura_bin().to_str().unwrap(), &["block", "nbd", "--busy-poll-us", &(limit + 1).to_string(), "--pool", &backend.url()])
        .expect_err("a busy poll past the limit");
    assert!(too_long.contains("--busy-poll-us") && too_long.contains(&limit.to_string()), "{too_long}");

    let nbd = NbdProcess::start(&backend.url(), &["--busy-poll-us", "10000"]);
    if require_cmd("fio").is_ok() {
        let uri_arg = format!("--uri={}", nbd.uri("p"));
        fio(&["--name=qd1", "--ioengine=nbd", &uri_arg, "--rw=randwrite", "--bs=4k", "--size=4M", "--iodepth=1", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1"]).unwrap();
    } else {
        eprintln!("skipping the fio part: fio is not installed");
    }
    let mut c = RawClient::connect(&nbd.addr);
    assert_eq!(c.go("p"), 8 << 20);
    for round in 0..20u8 {
        // The header now, the payload after a pause shorter than the poll.
        c.request(proto::CMD_WRITE, 0, u64::from(round), 4096 * u64::from(round), 4096, &[]);
        std::thread::sleep(Duration::from_micros(2_000));
        c.s.write_all(&[round ^ 0x5a; 4096]).unwrap();
        assert_eq!(c.reply(0), (0, u64::from(round), vec![]));
        c.request(proto::CMD_READ, 0, 100 + u64::from(round), 4096 * u64::from(round), 4096, &[]);
        assert_eq!(c.reply(4096), (0, 100 + u64::from(round), vec![round ^ 0x5a; 4096]));
    }
    // Gone in the middle of a poll: right after a reply.
    let mut gone = RawClient::connect(&nbd.addr);
    gone.go("p");
    gone.request(proto::CMD_READ, 0, 1, 0, 4096, &[]);
    assert_eq!(gone.reply(4096).0, 0);
    drop(gone);
    c.request(proto::CMD_READ, 0, 7, 0, 4096, &[]);
    assert_eq!(c.reply(4096), (0, 7, vec![0x5a; 4096]));
    drop(c);

    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_seconds(nbd.pid());
    std::thread::sleep(Duration::from_millis(1_000));
    let used = cpu_seconds(nbd.pid()) - before;
    assert!(used < 0.2, "the idle server used {used:.2} s of CPU in 1 s: a connection still polling");
}

/// The RSS of a process, in bytes.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).expect("VmRSS");
    kib * 1024
}

/// Clients that ask for far more than the server's memory limit and never read their replies
/// (8 × 64 reads of 8 MiB, 4 GiB in all) hold at most `--memory-max` plus one request each:
/// the server's RSS stays bounded (it grew by the whole 4 GiB's worth of replies before, up to
/// 512 MiB per connection). Another client is served meanwhile, and once the greedy ones leave
/// the budget is free again.
#[test]
fn memory_stays_bounded_when_clients_do_not_read_replies() {
    const REQUEST_BYTES: u32 = 8 << 20;
    let backend = Backend::embedded();
    backend.create_volume("v", "1G");
    let nbd = NbdProcess::start(&backend.url(), &["--memory-max", "64M"]);
    let mut bystander = RawClient::connect(&nbd.addr);
    bystander.go("v");
    let before = rss_bytes(nbd.pid());
    let mut greedy: Vec<RawClient> = (0..8).map(|_| RawClient::connect(&nbd.addr)).collect();
    for c in &mut greedy {
        c.go("v");
        for i in 0..64u64 {
            c.request(proto::CMD_READ, 0, i, (i % 100) * u64::from(REQUEST_BYTES), REQUEST_BYTES, &[]);
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let during = rss_bytes(nbd.pid());
    let grown_mib = during.saturating_sub(before) >> 20;
    // 64 MiB of budget, one 8 MiB request per connection past it, allocator slack.
    assert!(grown_mib < 64 + 8 * 8 + 64, "the server grew by {grown_mib} MiB");
    // Someone else is served all the while.
    for i in 0..20u64 {
        bystander.request(proto::CMD_WRITE, 0, i, i * 4096, 4096, &[i as u8; 4096]);
        assert_eq!(bystander.reply(0).0, 0);
        bystander.request(proto::CMD_READ, 0, 100 + i, i * 4096, 4096, &[]);
        assert_eq!(bystander.reply(4096).2, vec![i as u8; 4096]);
    }
    // The greedy clients get what they asked for once they read.
    let c = &mut greedy[0];
    for _ in 0..64 {
        let (error, _handle) = c.reply_header().expect("a reply");
        assert_eq!(error, 0);
        assert_eq!(c.read_data(REQUEST_BYTES as usize).expect("its data").len(), REQUEST_BYTES as usize);
    }
    drop(greedy);
    // Their budget came back: a large request of the bystander starts at once.
    bystander.request(proto::CMD_READ, 0, 500, 0, REQUEST_BYTES, &[]);
    let (error, handle, data) = bystander.reply(REQUEST_BYTES as usize);
    assert_eq!((error, handle, data.len()), (0, 500, REQUEST_BYTES as usize));
}
