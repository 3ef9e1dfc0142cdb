//! Black-box tests of the engine through its public API, on the fault-injecting simulator and
//! on real files.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use kura_engine::{Condition, Device, Engine, EngineConfig, Error, FaultMode, Mode, RecordKind, WriteOutcome};

#[test]
fn put_get_overwrite_delete_across_many_seals() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    let mut model = BTreeMap::new();
    for round in 0..3u32 {
        for i in 0..2000u32 {
            let len = [10, 200, 1500, 5000][(i % 4) as usize];
            let v = value_for(i, round, len);
            engine.put(&key(i), &v).unwrap();
            model.insert(i, v);
        }
        for i in (0..2000u32).step_by(7) {
            engine.delete(&key(i)).unwrap();
            model.remove(&i);
        }
    }
    let stats = engine.stats();
    assert!(stats.seals > 10, "expected many seals, got {}", stats.seals);
    for i in 0..2000u32 {
        let got = engine.get(&key(i)).unwrap().map(|item| item.into_vec());
        assert_eq!(got.as_ref(), model.get(&i), "key {i}");
    }
    assert!(engine.get(b"never-written").unwrap().is_none());
}

#[test]
fn clean_reopen_and_crash_after_sync() {
    let dev = sim(DEVICE_BYTES);
    let cfg = config(Mode::Store);
    let engine = create(&dev, &cfg);
    for i in 0..3000u32 {
        engine.put(&key(i), &value_for(i, 0, 300)).unwrap();
    }
    engine.sync().unwrap();
    for i in 0..100u32 {
        engine.put(&key(i), &value_for(i, 1, 300)).unwrap();
    }
    drop(engine);
    for seed in 0..8 {
        let crashed = dev.crash(seed);
        let engine = open(&crashed, &cfg);
        for i in 0..3000u32 {
            let got = engine.get(&key(i)).unwrap().expect("synced key lost").into_vec();
            let allowed = got == value_for(i, 0, 300) || (i < 100 && got == value_for(i, 1, 300));
            assert!(allowed, "seed {seed} key {i}: unexpected value");
        }
    }
    let engine = open(&dev.reboot_clean(), &cfg);
    assert_eq!(engine.get(&key(5)).unwrap().unwrap().into_vec(), value_for(5, 1, 300));
}

#[test]
fn conditional_writes() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    let k = b"cas-key";
    assert_eq!(engine.write(k, b"a", RecordKind::Put, Condition::IfPresent).unwrap(), WriteOutcome::ConditionFailed { current: None });
    let WriteOutcome::Written { version: v1 } = engine.write(k, b"a", RecordKind::Put, Condition::IfAbsent).unwrap() else { panic!() };
    assert_eq!(engine.write(k, b"b", RecordKind::Put, Condition::IfAbsent).unwrap(), WriteOutcome::ConditionFailed { current: Some(v1) });
    let WriteOutcome::Written { version: v2 } = engine.write(k, b"b", RecordKind::Put, Condition::IfVersion(v1)).unwrap() else { panic!() };
    assert!(v2 > v1);
    assert_eq!(engine.write(k, b"c", RecordKind::Put, Condition::IfVersion(v1)).unwrap(), WriteOutcome::ConditionFailed { current: Some(v2) });
    assert_eq!(engine.get(k).unwrap().unwrap().version, v2);
    // The version stays a valid CAS token after the record moves to flash.
    for i in 0..3000u32 {
        engine.put(&key(i), &[1u8; 200]).unwrap();
    }
    assert!(engine.stats().seals > 0);
    assert!(matches!(engine.write(k, b"d", RecordKind::Put, Condition::IfVersion(v2)).unwrap(), WriteOutcome::Written { .. }));
    assert!(matches!(engine.write(k, b"", RecordKind::Tombstone, Condition::IfPresent).unwrap(), WriteOutcome::Written { .. }));
    assert!(engine.get(k).unwrap().is_none());
}

#[test]
fn cas_races_between_threads_lose_no_increment() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    engine.put(b"counter", b"0").unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let mut done = 0;
                while done < 200 {
                    let item = engine.get(b"counter").unwrap().unwrap();
                    let n: u64 = std::str::from_utf8(item.value()).unwrap().parse().unwrap();
                    let next = (n + 1).to_string();
                    if let WriteOutcome::Written { .. } = engine.write(b"counter", next.as_bytes(), RecordKind::Put, Condition::IfVersion(item.version)).unwrap() {
                        done += 1;
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(engine.get(b"counter").unwrap().unwrap().value(), b"800");
}

#[test]
fn cache_mode_never_refuses_and_never_returns_stale_values() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Cache));
    let mut latest = BTreeMap::new();
    // Write ~5x the device's capacity.
    for round in 0..10u32 {
        for i in 0..4000u32 {
            let v = value_for(i, round, 1000);
            engine.put(&key(i), &v).unwrap();
            latest.insert(i, v);
        }
    }
    let stats = engine.stats();
    assert!(stats.evicted_blocks > 0);
    let mut present = 0;
    for (i, v) in &latest {
        if let Some(item) = engine.get(&key(*i)).unwrap() {
            assert_eq!(&item.into_vec(), v, "stale value for key {i}");
            present += 1;
        }
    }
    assert!(present > 1000, "only {present} keys survived");
}

#[test]
fn store_mode_reclaims_overwritten_space() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    // 1500 keys x 1000 bytes = 1.5 MB live on a ~6 MB device, overwritten 20 times.
    for round in 0..20u32 {
        for i in 0..1500u32 {
            engine.put(&key(i), &value_for(i, round, 1000)).unwrap();
        }
    }
    let stats = engine.stats();
    assert!(stats.gc_runs > 0 && stats.gc_blocks_freed > 0, "{stats:?}");
    for i in 0..1500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 19, 1000), "key {i}");
    }
    // And it all survives a reopen.
    engine.sync().unwrap();
    let engine = open(&dev.crash(1), &config(Mode::Store));
    for i in 0..1500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 19, 1000), "key {i} after reopen");
    }
}

/// Large records (4 KiB values) are found superseded from newer blocks' key digests, without
/// reading those blocks' records; values stay exact, also after a crash and reopen (digests
/// then come from the blocks written before it).
#[test]
fn store_mode_gc_decides_large_records_from_key_digests() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    // 300 keys x 4 KiB = 1.2 MB live on a ~6 MB device, overwritten 12 times.
    let rounds = 12u32;
    for round in 0..rounds / 2 {
        for i in 0..300u32 {
            engine.put(&key(i), &value_for(i, round, 4096)).unwrap();
        }
    }
    engine.sync().unwrap();
    drop(engine);
    let dev = dev.crash(5);
    let engine = open(&dev, &config(Mode::Store));
    for round in rounds / 2..rounds {
        for i in 0..300u32 {
            engine.put(&key(i), &value_for(i, round, 4096)).unwrap();
        }
    }
    let stats = engine.stats();
    assert!(stats.gc_blocks_freed > 0 && stats.gc_digest_hits > 0, "{stats:?}");
    // Nearly every superseded record is decided by digests; reads remain only for candidate
    // blocks whose fingerprints matched by chance.
    assert!(stats.gc_liveness_reads * 10 < stats.gc_digest_hits, "{stats:?}");
    for i in 0..300u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, rounds - 1, 4096), "key {i}");
    }
    engine.sync().unwrap();
    let engine = open(&dev.crash(6), &config(Mode::Store));
    for i in 0..300u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, rounds - 1, 4096), "key {i} after reopen");
    }
}

/// With background threads, the collector frees space ahead of the writers: a writer that
/// pauses now and then finds free blocks instead of collecting garbage itself.
#[test]
fn store_mode_collects_garbage_in_the_background() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    for round in 0..20u32 {
        for i in 0..1500u32 {
            engine.put(&key(i), &value_for(i, round, 1000)).unwrap();
            if i % 100 == 0 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }
    let stats = engine.stats();
    assert!(stats.gc_background_runs > 0 && stats.gc_blocks_freed > 0, "{stats:?}");
    assert!(stats.gc_background_runs * 2 > stats.gc_runs, "the writer collected most of the garbage itself: {stats:?}");
    for i in 0..1500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 19, 1000), "key {i}");
    }
    engine.sync().unwrap();
    let engine = open(&dev.crash(3), &config(Mode::Store));
    for i in 0..1500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 19, 1000), "key {i} after reopen");
    }
}

#[test]
fn store_mode_full_device_is_a_clear_error_and_deletes_make_room() {
    let dev = sim(DEVICE_BYTES);
    let cfg = config(Mode::Store);
    let engine = create(&dev, &cfg);
    let mut written = 0u32;
    let error = loop {
        match engine.put(&key(written), &value_for(written, 0, 2000)) {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 10_000, "device never filled");
    };
    assert!(matches!(error, Error::StoreFull { .. }), "{error}");
    assert!(written > 1500, "only {written} values fit");
    for i in 0..written {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 0, 2000), "key {i}");
    }
    for i in 0..written / 2 {
        engine.delete(&key(i)).unwrap();
    }
    for i in 0..written / 4 {
        engine.put(&key(100_000 + i), &value_for(i, 1, 2000)).unwrap();
    }
    for i in written / 2..written {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 0, 2000));
    }
}

#[test]
fn live_key_estimate_survives_reopen() {
    let dev = sim(32 << 20);
    let cfg = config(Mode::Store);
    let engine = create(&dev, &cfg);
    for round in 0..4u32 {
        for i in 0..5000u32 {
            engine.put(&key(i), &value_for(i, round, 300)).unwrap();
        }
    }
    let before = engine.stats().keys_estimate;
    drop(engine);
    let after = open(&dev, &cfg).stats().keys_estimate;
    for estimate in [before, after] {
        assert!((4000..6500).contains(&estimate), "estimated {estimate} live keys of 5000 (before reopen {before})");
    }
}

#[test]
fn bad_input_is_refused() {
    let dev = sim(DEVICE_BYTES);
    let engine = create(&dev, &config(Mode::Store));
    assert!(matches!(engine.put(&[b'k'; 251], b"v"), Err(Error::KeyTooLong { len: 251, max: 250 })));
    assert!(matches!(engine.put(b"", b"v"), Err(Error::KeyEmpty)));
    assert!(matches!(engine.get(&[b'k'; 300]), Err(Error::KeyTooLong { .. })));
    assert!(matches!(engine.put(b"k", &vec![0; 16 * 1024 + 1]), Err(Error::ValueTooLarge { .. })));
    engine.put(&[b'k'; 250], &vec![1; 16 * 1024]).unwrap();
    assert_eq!(engine.get(&[b'k'; 250]).unwrap().unwrap().value().len(), 16 * 1024);
}

#[test]
fn not_a_store_and_corrupt_superblock() {
    let dev = sim(DEVICE_BYTES);
    let cfg = config(Mode::Store);
    assert!(matches!(Engine::open_device(dev.clone() as Arc<dyn Device>, &cfg), Err(Error::NotAKuraStore { .. })));
    let engine = create(&dev, &cfg);
    engine.put(b"a", b"b").unwrap();
    engine.sync().unwrap();
    drop(engine);
    // One damaged superblock copy is survivable; both are reported as corruption.
    dev.corrupt(20, 0xff);
    assert_eq!(open(&dev, &cfg).get(b"a").unwrap().unwrap().value(), b"b");
    dev.corrupt(4096 + 20, 0xff);
    assert!(matches!(Engine::open_device(dev.clone() as Arc<dyn Device>, &cfg), Err(Error::Corrupt { .. })));
    let wrong_mode = config(Mode::Cache);
    let dev = sim(DEVICE_BYTES);
    create(&dev, &cfg);
    assert!(matches!(Engine::open_device(dev as Arc<dyn Device>, &wrong_mode), Err(Error::InvalidConfig(_))));
}

#[test]
fn corrupt_page_is_an_error_not_a_wrong_value() {
    let dev = sim(DEVICE_BYTES);
    let cfg = config(Mode::Store);
    let engine = create(&dev, &cfg);
    for i in 0..2000u32 {
        engine.put(&key(i), &value_for(i, 0, 100)).unwrap();
    }
    engine.sync().unwrap();
    let sb = engine.superblock().clone();
    drop(engine);
    // Flip a byte in the middle of the first data page of every block.
    for slot in 0..sb.block_count {
        dev.corrupt(sb.block_offset_bytes(slot) + 2000, 0x10);
    }
    let engine = open(&dev, &cfg);
    let mut corrupt = 0;
    for i in 0..2000u32 {
        match engine.get(&key(i)) {
            Ok(Some(item)) => assert_eq!(item.into_vec(), value_for(i, 0, 100)),
            Ok(None) => panic!("key {i} silently missing"),
            Err(Error::Corrupt { .. }) => corrupt += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert!(corrupt > 0);
}

#[test]
fn io_failure_stops_writes_but_keeps_reads() {
    let dev = sim(DEVICE_BYTES);
    let cfg = config(Mode::Store);
    let engine = create(&dev, &cfg);
    for i in 0..500u32 {
        engine.put(&key(i), &value_for(i, 0, 300)).unwrap();
    }
    engine.sync().unwrap();
    dev.fail_after(0, FaultMode::Sticky);
    let mut failed = false;
    for i in 500..5000u32 {
        if engine.put(&key(i), &value_for(i, 0, 300)).is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed || engine.sync().is_err());
    assert!(matches!(engine.put(b"x", b"y"), Err(Error::Failed(_))));
    dev.clear_faults();
    for i in 0..500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 0, 300));
    }
    drop(engine);
    let engine = open(&dev.crash(3), &cfg);
    for i in 0..500u32 {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 0, 300), "synced key {i}");
    }
}

#[test]
fn many_threads_read_and_write() {
    let dev = sim(32 << 20);
    let engine = create(&dev, &EngineConfig { partitions: 4, ..config(Mode::Store) });
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for round in 0..3u32 {
                    for i in 0..1500u32 {
                        let k = t * 100_000 + i;
                        engine.put(&key(k), &value_for(k, round, 400)).unwrap();
                        if i % 3 == 0 {
                            let back = engine.get(&key(k)).unwrap().unwrap().into_vec();
                            assert_eq!(back, value_for(k, round, 400));
                        }
                    }
                    if round == 1 {
                        engine.sync().unwrap();
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    for t in 0..4u32 {
        for i in 0..1500u32 {
            let k = t * 100_000 + i;
            assert_eq!(engine.get(&key(k)).unwrap().unwrap().into_vec(), value_for(k, 2, 400));
        }
    }
}

#[test]
fn real_file_round_trip_and_reopen() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("store.kura");
    let cfg = EngineConfig { size_bytes: Some(64 << 20), block_size_bytes: 1 << 20, partitions: 2, mode: Some(Mode::Store), value_size_max_bytes: 64 * 1024, ..EngineConfig::default() };
    let engine = Engine::open(&path, &cfg).unwrap();
    for i in 0..5000u32 {
        engine.put(&key(i), &value_for(i, 0, 4096)).unwrap();
    }
    engine.sync().unwrap();
    let stats = engine.stats();
    drop(engine);
    let engine = Engine::open(&path, &EngineConfig { size_bytes: None, ..cfg.clone() }).unwrap();
    for i in (0..5000u32).step_by(13) {
        assert_eq!(engine.get(&key(i)).unwrap().unwrap().into_vec(), value_for(i, 0, 4096));
    }
    let reads_before = engine.stats().flash_reads;
    for i in 0..1000u32 {
        engine.get(&key(i)).unwrap().unwrap();
    }
    let reads = engine.stats().flash_reads - reads_before;
    assert!(reads < 1100, "{reads} flash reads for 1000 hits");
    assert!(stats.ram.index_bytes() * 8 / 5000 < 64);
    // A file that is not a store.
    let other = dir.path().join("other");
    std::fs::write(&other, vec![7u8; 1 << 20]).unwrap();
    assert!(matches!(Engine::open(&other, &cfg), Err(Error::NotAKuraStore { .. })));
    // A truncated store.
    let truncated = dir.path().join("truncated");
    std::fs::copy(&path, &truncated).unwrap();
    std::fs::OpenOptions::new().write(true).open(&truncated).unwrap().set_len(1 << 20).unwrap();
    assert!(matches!(Engine::open(&truncated, &cfg), Err(Error::Corrupt { .. })));
}

/// A store is created whole or not at all: it is formatted as `NAME.creating` and renamed
/// into place. A creation's file left by a killed process (no one holds it) is started again
/// from; one another open holds is waited for, then refused with the reason, and the store
/// is not made meanwhile. (tests/kill.rs kills a writer while it creates.)
#[test]
fn a_store_is_created_whole_or_not_at_all() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("store.kura");
    let creating = kura_engine::creating_path(&path);
    assert_eq!(creating, dir.path().join("store.kura.creating"));
    let cfg = EngineConfig { size_bytes: Some(32 << 20), block_size_bytes: 1 << 20, partitions: 1, mode: Some(Mode::Store), value_size_max_bytes: 64 * 1024, ..EngineConfig::default() };
    // What a creator killed after the allocation and before the superblock leaves.
    std::fs::write(&creating, vec![0u8; 32 << 20]).unwrap();
    let engine = Engine::open(&path, &cfg).expect("a creation over an abandoned one");
    assert!(!creating.exists(), "the creation's file is renamed into place");
    engine.put(b"k", b"v").unwrap();
    engine.sync().unwrap();
    drop(engine);
    let engine = Engine::open(&path, &EngineConfig { size_bytes: None, ..cfg.clone() }).unwrap();
    assert_eq!(engine.get(b"k").unwrap().unwrap().value(), b"v");
    drop(engine);
    // A creation in progress elsewhere (its file locked) is not taken over.
    let other = dir.path().join("other.kura");
    let held = std::fs::File::create(kura_engine::creating_path(&other)).unwrap();
    // SAFETY: flock on a descriptor the test owns.
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) }, 0);
    let refused = Engine::open(&other, &cfg).err().expect("a creation while another one runs");
    assert!(refused.to_string().contains("in use"), "{refused}");
    assert!(!other.exists());
    drop(held);
    Engine::open(&other, &cfg).expect("once the other creation is gone");
    assert!(other.exists() && !kura_engine::creating_path(&other).exists());
}

/// Lookups that read their companion page beside the one they ask for
/// (`GetPlan::companion_read`, `Engine::get_continue_with`) answer exactly as the model says,
/// newest version first, tombstones included, and misses stay misses; with a small index
/// budget many lookups have a companion, and some use it.
#[test]
fn companion_reads_answer_as_plain_lookups() {
    let dev = sim(64 << 20);
    let mut cfg = config(Mode::Store);
    cfg.index_bits_per_key = 4;
    cfg.fingerprint_bits = 2;
    let engine = create(&dev, &cfg);
    let mut model = BTreeMap::new();
    for round in 0..3u32 {
        for i in 0..2000u32 {
            let v = value_for(i, round, [100, 1000, 5000][(i % 3) as usize]);
            engine.put(&key(i), &v).unwrap();
            model.insert(i, v);
        }
        for i in (round..2000u32).step_by(5) {
            engine.delete(&key(i)).unwrap();
            model.remove(&i);
        }
    }
    engine.sync().unwrap();
    let read = |offset: u64, len: usize| {
        let mut buf = kura_engine::AlignedBuf::zeroed(len);
        dev.read_at(offset, &mut buf).unwrap();
        buf
    };
    // The same lookups with and without companion reads: the same answers, and fewer reads
    // asked for with them (a companion that was needed is not asked for again).
    let mut asked = [0u32; 2];
    let mut offered = 0u32;
    for (with, asked) in [false, true].into_iter().zip(asked.iter_mut()) {
        for i in 0..2500u32 {
            let (mut plan, mut step) = engine.get_start(&key(i)).unwrap();
            let got = loop {
                match step {
                    kura_engine::GetStep::Done(item) => break item.map(|item| item.into_vec()),
                    kura_engine::GetStep::Read { offset_bytes, len_bytes } => {
                        *asked += 1;
                        let buf = read(offset_bytes, len_bytes);
                        step = match plan.companion_read().filter(|_| with) {
                            Some((offset, len)) => {
                                offered += 1;
                                engine.get_continue_with(&mut plan, buf, read(offset, len))
                            }
                            None => engine.get_continue(&mut plan, buf),
                        }
                        .unwrap();
                    }
                }
            };
            assert_eq!(got.as_ref(), model.get(&i), "key {i}, companion reads {with}");
        }
    }
    assert!(offered > 100, "only {offered} lookups had a companion read");
    assert!(asked[1] < asked[0], "reads asked for: {} with companions, {} without", asked[1], asked[0]);
}
