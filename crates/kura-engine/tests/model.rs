//! Model-based tests: random operation sequences, with crashes, against a `BTreeMap` model.
//! proptest prints the failing sequence (crash seeds included), which replays exactly.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use common::*;
use kura_engine::{Device, Engine, EngineConfig, FaultMode, Mode, SimDevice};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, len: usize, salt: u32 },
    Delete { key: u8 },
    Get { key: u8 },
    Sync,
    Crash { seed: u64 },
    CleanRestart,
    /// `Engine::scan`: every live key once, with its value.
    Scan,
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0usize..40, Just(300), Just(1100), Just(4096), Just(9000)];
    prop_oneof![
        30 => (0u8..48, len, any::<u32>()).prop_map(|(key, len, salt)| Op::Put { key, len, salt }),
        5 => (0u8..48).prop_map(|key| Op::Delete { key }),
        10 => (0u8..48).prop_map(|key| Op::Get { key }),
        3 => Just(Op::Sync),
        1 => any::<u64>().prop_map(|seed| Op::Crash { seed }),
        1 => Just(Op::CleanRestart),
        1 => Just(Op::Scan),
    ]
}

fn value(key: u8, len: usize, salt: u32) -> Vec<u8> {
    value_for(u32::from(key), salt, len)
}

struct Model {
    mode: Mode,
    /// What a reader must see now (store mode), or may see (cache mode, besides nothing).
    current: BTreeMap<u8, Option<Vec<u8>>>,
    /// The state at the last sync.
    synced: BTreeMap<u8, Option<Vec<u8>>>,
    /// Every value (or deletion) written since the last sync, per key.
    since_sync: BTreeMap<u8, Vec<Option<Vec<u8>>>>,
    /// Cache mode: keys that may have been evicted.
    maybe_evicted: BTreeSet<u8>,
}

impl Model {
    fn check_get(&self, key: u8, got: Option<Vec<u8>>) -> Result<(), TestCaseError> {
        let expected = self.current.get(&key).cloned().flatten();
        if self.mode == Mode::Cache && got.is_none() {
            return Ok(());
        }
        prop_assert_eq!(got, expected, "key {}", key);
        Ok(())
    }

    /// After a crash, every key holds its synced value or one written since.
    fn adopt_after_crash(&mut self, engine: &Engine) -> Result<(), TestCaseError> {
        let keys: BTreeSet<u8> = self.current.keys().chain(self.synced.keys()).copied().collect();
        for key in keys {
            let got = engine.get(&[b'k', key]).map_err(|e| TestCaseError::fail(e.to_string()))?.map(|i| i.into_vec());
            let floor = self.synced.get(&key).cloned().flatten();
            let allowed = got == floor || self.since_sync.get(&key).is_some_and(|vs| vs.contains(&got)) || (self.mode == Mode::Cache && got.is_none());
            prop_assert!(allowed, "key {} after crash: got {:?} bytes, synced {:?} bytes", key, got.as_ref().map(Vec::len), floor.as_ref().map(Vec::len));
            self.current.insert(key, got);
        }
        self.synced = self.current.clone();
        self.since_sync.clear();
        Ok(())
    }
}

fn run(mode: Mode, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let cfg = config(mode);
    let mut dev: Arc<SimDevice> = sim(4 << 20);
    let mut engine = create(&dev, &cfg);
    let mut model = Model { mode, current: BTreeMap::new(), synced: BTreeMap::new(), since_sync: BTreeMap::new(), maybe_evicted: BTreeSet::new() };
    let trace = std::env::var("KURA_TRACE_KEY").ok().and_then(|k| k.parse::<u8>().ok());
    for (step, op) in ops.into_iter().enumerate() {
        if let Some(t) = trace {
            let got = engine.get(&[b'k', t]).unwrap().map(|i| (i.version, i.value().len(), i.value().iter().take(4).copied().collect::<Vec<u8>>()));
            let stats = engine.stats();
            eprintln!("step {step}: {op:?} | key {t} = {got:?} | blocks {} free {} seals {} evicted {} gc {} freed {}", stats.blocks_used, stats.blocks_free, stats.seals, stats.evicted_blocks, stats.gc_runs, stats.gc_blocks_freed);
        }
        match op {
            Op::Put { key, len, salt } => {
                let v = value(key, len, salt);
                engine.put(&[b'k', key], &v).map_err(|e| TestCaseError::fail(format!("put: {e}")))?;
                model.current.insert(key, Some(v.clone()));
                model.since_sync.entry(key).or_default().push(Some(v));
            }
            Op::Delete { key } => {
                engine.delete(&[b'k', key]).map_err(|e| TestCaseError::fail(format!("delete: {e}")))?;
                model.current.insert(key, None);
                model.since_sync.entry(key).or_default().push(None);
            }
            Op::Get { key } => {
                let got = engine.get(&[b'k', key]).map_err(|e| TestCaseError::fail(format!("get: {e}")))?.map(|i| i.into_vec());
                model.check_get(key, got)?;
            }
            Op::Scan => {
                let mut seen: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
                let mut problem = None;
                engine
                    .scan(&mut |r| {
                        let key = r.key[1];
                        let current = engine.get(r.key).ok().flatten().map(|i| i.version);
                        if r.key.len() != 2 || seen.insert(key, r.value.to_vec()).is_some() || current != Some(r.version) {
                            problem = Some(format!("key {key}: visited twice, or version {} is not the current {current:?}", r.version));
                        }
                        true
                    })
                    .map_err(|e| TestCaseError::fail(format!("scan: {e}")))?;
                prop_assert!(problem.is_none(), "{}", problem.unwrap_or_default());
                let live: BTreeMap<u8, Vec<u8>> = model.current.iter().filter_map(|(k, v)| v.clone().map(|v| (*k, v))).collect();
                if mode == Mode::Cache {
                    for (key, value) in &seen {
                        prop_assert_eq!(Some(value), live.get(key), "scan visited key {} with another value, or a deleted one", key);
                    }
                } else {
                    let missing: Vec<(u8, usize)> = live.iter().filter(|(k, _)| !seen.contains_key(k)).map(|(k, v)| (*k, v.len())).collect();
                    prop_assert!(missing.is_empty(), "scan missed live keys (key, value bytes): {:?}; stats {:?}", missing, engine.stats());
                    prop_assert!(seen == live, "scan values differ from the model");
                }
            }
            Op::Sync => {
                engine.sync().map_err(|e| TestCaseError::fail(format!("sync: {e}")))?;
                model.synced = model.current.clone();
                model.since_sync.clear();
            }
            Op::Crash { seed } => {
                // Power loss now: take the crash image, then kill the old device so the
                // engine's closing sync cannot write anything.
                let crashed = dev.crash(seed);
                dev.fail_after(0, FaultMode::Sticky);
                drop(engine);
                dev = crashed;
                engine = open(&dev, &cfg);
                model.adopt_after_crash(&engine)?;
            }
            Op::CleanRestart => {
                drop(engine);
                dev = dev.reboot_clean();
                engine = open(&dev, &cfg);
                model.synced = model.current.clone();
                model.since_sync.clear();
                for key in model.current.keys().copied().collect::<Vec<_>>() {
                    let got = engine.get(&[b'k', key]).map_err(|e| TestCaseError::fail(e.to_string()))?.map(|i| i.into_vec());
                    model.check_get(key, got)?;
                }
            }
        }
    }
    for key in 0..48u8 {
        let got = engine.get(&[b'k', key]).map_err(|e| TestCaseError::fail(e.to_string()))?.map(|i| i.into_vec());
        model.check_get(key, got)?;
    }
    let _ = &model.maybe_evicted;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn store_mode_matches_model(ops in proptest::collection::vec(op(), 1..1500)) {
        run(Mode::Store, ops)?;
    }

    #[test]
    fn cache_mode_matches_model(ops in proptest::collection::vec(op(), 1..1500)) {
        run(Mode::Cache, ops)?;
    }

    /// An I/O error at any point never panics, never corrupts, and never loses synced data.
    #[test]
    fn faults_never_lose_synced_data(fail_at in 0u64..3000, sticky in any::<bool>(), seed in any::<u64>()) {
        faults_case(fail_at, sticky, seed)?;
    }
}

fn faults_case(fail_at: u64, sticky: bool, seed: u64) -> Result<(), TestCaseError> {
    let cfg = config(Mode::Store);
    let dev = sim(4 << 20);
    let engine = create(&dev, &cfg);
    let mut synced: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    let mut pending: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    dev.fail_after(fail_at, if sticky { FaultMode::Sticky } else { FaultMode::Once });
    for i in 0..1200u32 {
        let k = i % 300;
        let v = value_for(k, i, [20, 700, 5000][(i % 3) as usize]);
        if engine.put(&key(k), &v).is_err() {
            break;
        }
        pending.insert(k, v);
        if i % 50 == 49 {
            if engine.sync().is_err() {
                break;
            }
            synced.extend(std::mem::take(&mut pending));
        }
    }
    let crashed = dev.crash(seed);
    dev.fail_after(0, FaultMode::Sticky);
    drop(engine);
    let engine = Engine::open_device(crashed as Arc<dyn Device>, &cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (k, v) in &synced {
        let got = engine.get(&key(*k)).map_err(|e| TestCaseError::fail(e.to_string()))?.map(|i| i.into_vec());
        let ok = got.as_ref() == Some(v) || (pending.contains_key(k) && got.as_ref() == pending.get(k));
        if !ok && std::env::var("KURA_TRACE_FAULT").is_ok() {
            let round = |val: &Option<Vec<u8>>| (0..1200u32).find(|&i| val.as_deref() == Some(&value_for(*k, i, [20, 700, 5000][(i % 3) as usize])[..]));
            eprintln!("key {k}: synced op {:?}, pending op {:?}, got op {:?} (len {:?})", round(&Some(v.clone())), round(&pending.get(k).cloned()), round(&got), got.as_ref().map(Vec::len));
            eprintln!("stats {:?}", engine.stats());
        }
        prop_assert!(ok, "synced key {} lost or wrong", k);
    }
    Ok(())
}

#[test]
fn regression_replay() {
    run(Mode::Cache, regression_ops()).unwrap();
}
fn regression_ops() -> Vec<Op> { vec![ Op::Put { key: 5, len: 1100, salt: 0, }, Op::Put { key: 9, len: 1100, salt: 0, }, Op::Put { key: 30, len: 9000, salt: 0, }, Op::Put { key: 10, len: 4096, salt: 0, }, Op::Put { key: 11, len: 0, salt: 0, }, Op::Put { key: 0, len: 0, salt: 0, }, Op::Put { key: 12, len: 1100, salt: 0, }, Op::Put { key: 1, len: 9000, salt: 0, }, Op::CleanRestart, Op::Put { key: 13, len: 9000, salt: 244091870, }, Op::Put { key: 17, len: 9000, salt: 3653156808, }, Op::Put { key: 29, len: 4096, salt: 2673545546, }, Op::Put { key: 19, len: 9000, salt: 1261952263, }, Op::Put { key: 47, len: 4096, salt: 3963756759, }, Op::Put { key: 1, len: 9000, salt: 2261138872, }, Op::Put { key: 9, len: 1100, salt: 1135904352, }, Op::Put { key: 42, len: 1100, salt: 861467521, }, Op::Sync, Op::Put { key: 26, len: 1100, salt: 1106994155, }, Op::Put { key: 30, len: 27, salt: 4068194261, }, Op::Put { key: 13, len: 9000, salt: 1971751328, }, Op::Put { key: 17, len: 9000, salt: 2519012605, }, Op::Put { key: 32, len: 9000, salt: 1164202208, }, Op::Put { key: 7, len: 1100, salt: 2059270194, }, Op::Put { key: 3, len: 9000, salt: 1413749317, }, Op::Put { key: 12, len: 4096, salt: 1822060736, }, Op::Put { key: 47, len: 9000, salt: 3242796489, }, Op::Sync, Op::Put { key: 31, len: 19, salt: 3089398672, }, Op::Put { key: 21, len: 300, salt: 832550418, }, Op::Delete { key: 13, }, Op::Sync, Op::Put { key: 7, len: 1100, salt: 3698031385, }, Op::Put { key: 43, len: 1100, salt: 3632816351, }, Op::Put { key: 31, len: 300, salt: 3555026994, }, Op::Put { key: 15, len: 30, salt: 3115329922, }, Op::Put { key: 25, len: 1100, salt: 2093827770, }, Op::Put { key: 44, len: 1100, salt: 162384280, }, Op::CleanRestart, Op::Put { key: 43, len: 9000, salt: 3271614245, }, Op::Put { key: 34, len: 9000, salt: 694051852, }, Op::Put { key: 5, len: 1100, salt: 684218055, }, Op::Put { key: 18, len: 4096, salt: 1163158648, }, Op::Sync, Op::Put { key: 47, len: 4096, salt: 2819011574, }, Op::Put { key: 33, len: 4096, salt: 3127567496, }, Op::Put { key: 11, len: 300, salt: 1476011403, }, Op::Put { key: 30, len: 1100, salt: 225782578, }, Op::Put { key: 8, len: 1100, salt: 514504014, }, Op::Put { key: 45, len: 300, salt: 884743971, }, Op::Put { key: 35, len: 1100, salt: 936508789, }, Op::Put { key: 5, len: 1100, salt: 3159331819, }, Op::Put { key: 44, len: 4096, salt: 2274559094, }, Op::CleanRestart, Op::Put { key: 3, len: 1100, salt: 4170892724, }, Op::Put { key: 16, len: 1100, salt: 1996878861, }, Op::Put { key: 36, len: 1100, salt: 3586820986, }, Op::Put { key: 5, len: 9000, salt: 4050458184, }, Op::CleanRestart, Op::Put { key: 14, len: 9000, salt: 3753126953, }, Op::Put { key: 14, len: 34, salt: 343883058, }, Op::Put { key: 1, len: 1100, salt: 2705039604, }, Op::Put { key: 0, len: 4096, salt: 3915608501, }, Op::Put { key: 44, len: 9000, salt: 4267783235, }, Op::Delete { key: 47, }, Op::Put { key: 18, len: 4096, salt: 3877217439, }, Op::Put { key: 25, len: 300, salt: 2310931459, }, Op::Put { key: 45, len: 29, salt: 2363666155, }, Op::Put { key: 10, len: 28, salt: 547223886, }, Op::Put { key: 20, len: 25, salt: 1056851650, }, Op::Put { key: 3, len: 4096, salt: 2599263704, }, Op::Delete { key: 23, }, Op::Put { key: 19, len: 300, salt: 2906637438, }, Op::Put { key: 21, len: 25, salt: 3952166643, }, Op::Put { key: 29, len: 9000, salt: 2654792840, }, Op::Put { key: 28, len: 29, salt: 1190648423, }, Op::Put { key: 41, len: 0, salt: 1620086569, }, Op::CleanRestart, Op::Put { key: 9, len: 9000, salt: 1893652333, }, Op::Put { key: 31, len: 4096, salt: 3952469174, }, Op::CleanRestart, Op::Put { key: 16, len: 9000, salt: 2273445188, }, Op::Sync, Op::Crash { seed: 14364991368007118889, }, Op::Put { key: 30, len: 4096, salt: 722841358, }, Op::Sync, Op::Put { key: 20, len: 31, salt: 3353414337, }, Op::Sync, Op::Put { key: 21, len: 9000, salt: 1217106366, }, Op::Put { key: 27, len: 9000, salt: 2253817637, }, Op::Put { key: 10, len: 9000, salt: 2177438, }, Op::Put { key: 8, len: 4096, salt: 1884471141, }, Op::Put { key: 46, len: 1100, salt: 1538869823, }, Op::Put { key: 43, len: 9000, salt: 3144192783, }, Op::Put { key: 29, len: 4096, salt: 483522755, }, Op::Put { key: 19, len: 1100, salt: 2862459538, }, Op::Sync, Op::Put { key: 12, len: 1100, salt: 2150320447, }, Op::Put { key: 32, len: 1100, salt: 1572571579, }, Op::Put { key: 15, len: 1100, salt: 909729495, }, Op::Put { key: 40, len: 5, salt: 3503242406, }, Op::Put { key: 18, len: 300, salt: 2796012248, }, Op::Put { key: 10, len: 300, salt: 1989109383, }, Op::Put { key: 45, len: 4096, salt: 1536613005, }, Op::Put { key: 13, len: 9000, salt: 3541809394, }, Op::Sync, Op::Put { key: 26, len: 9000, salt: 3490350475, }, Op::Put { key: 6, len: 9000, salt: 3122966043, }, Op::Put { key: 12, len: 300, salt: 433107280, }, Op::Sync, Op::Sync, Op::Put { key: 24, len: 4096, salt: 2283202023, }, Op::Put { key: 17, len: 1100, salt: 3975030520, }, Op::Put { key: 0, len: 9000, salt: 1753079304, }, Op::CleanRestart, Op::Put { key: 24, len: 300, salt: 640247361, }, Op::Put { key: 35, len: 9000, salt: 545808571, }, Op::CleanRestart, Op::Put { key: 6, len: 300, salt: 652663283, }, Op::Put { key: 29, len: 1100, salt: 2292066208, }, Op::Put { key: 9, len: 9000, salt: 1057285188, }, Op::Put { key: 35, len: 29, salt: 759771473, }, Op::Put { key: 41, len: 9000, salt: 52052212, }, Op::Put { key: 5, len: 9000, salt: 3080584441, }, Op::Put { key: 8, len: 4096, salt: 1280451128, }, Op::Put { key: 10, len: 9000, salt: 1071188987, }, Op::Put { key: 20, len: 9000, salt: 4203657058, }, Op::Put { key: 4, len: 4096, salt: 3727721812, }, Op::Put { key: 34, len: 1100, salt: 2647905854, }, Op::Put { key: 39, len: 4096, salt: 96262285, }, Op::Put { key: 6, len: 9000, salt: 756005627, }, Op::Put { key: 12, len: 9000, salt: 1092469897, }, Op::Put { key: 29, len: 4096, salt: 2620270892, }, Op::Put { key: 14, len: 9000, salt: 2836831707, }, Op::Put { key: 33, len: 9000, salt: 1025846985, }, Op::Put { key: 38, len: 1100, salt: 3520221341, }, Op::Put { key: 46, len: 29, salt: 965558910, }, Op::Put { key: 35, len: 4096, salt: 2718895037, }, Op::Put { key: 28, len: 9000, salt: 352697987, }, Op::Put { key: 33, len: 300, salt: 1388195848, }, Op::Sync, Op::Put { key: 38, len: 1100, salt: 4107045767, }, Op::Put { key: 1, len: 4096, salt: 2921856043, }, Op::Put { key: 27, len: 1100, salt: 3703830556, }, Op::Sync, Op::Put { key: 21, len: 1100, salt: 1509241021, }, Op::Put { key: 17, len: 18, salt: 3176887669, }, Op::Put { key: 9, len: 1100, salt: 1514686179, }, Op::Put { key: 34, len: 9000, salt: 395564276, }, Op::Put { key: 12, len: 300, salt: 1990273812, }, Op::Put { key: 7, len: 4096, salt: 3106096769, }, Op::Put { key: 5, len: 4096, salt: 334896625, }, Op::CleanRestart, Op::Put { key: 32, len: 9000, salt: 3767146087, }, Op::Put { key: 2, len: 9000, salt: 1407199701, }, Op::Put { key: 41, len: 9000, salt: 1896967244, }, Op::Delete { key: 34, }, Op::Put { key: 5, len: 1100, salt: 727510995, }, Op::Put { key: 12, len: 9000, salt: 2634311855, }, Op::Put { key: 7, len: 1100, salt: 696122328, }, Op::Put { key: 47, len: 1100, salt: 1499937186, }, Op::Put { key: 36, len: 4096, salt: 737329768, }, Op::Put { key: 29, len: 9000, salt: 980036216, }, Op::Put { key: 0, len: 300, salt: 3172701027, }, Op::Put { key: 19, len: 1100, salt: 2310793176, }, Op::Sync, Op::Put { key: 32, len: 9000, salt: 687616653, }, Op::Put { key: 9, len: 9000, salt: 458212251, }, Op::Put { key: 2, len: 4096, salt: 2689376612, }, Op::Put { key: 35, len: 300, salt: 2923640180, }, Op::Put { key: 34, len: 300, salt: 451878656, }, Op::Put { key: 14, len: 4096, salt: 2120219187, }, Op::Put { key: 22, len: 300, salt: 1589147149, }, Op::Sync, Op::Crash { seed: 9205187130059380389, }, Op::Put { key: 2, len: 9000, salt: 3273247374, }, Op::Put { key: 28, len: 9000, salt: 2556211188, }, Op::Put { key: 13, len: 4096, salt: 1893124428, }, Op::Put { key: 35, len: 1100, salt: 4178743687, }, Op::Put { key: 16, len: 1100, salt: 1272528916, }, Op::Crash { seed: 15714123086598713120, }, Op::Put { key: 26, len: 9000, salt: 3706202484, }, Op::Put { key: 11, len: 9000, salt: 2703123962, }, Op::Put { key: 39, len: 9000, salt: 3948432207, }, Op::Sync, Op::Put { key: 44, len: 300, salt: 965926892, }, Op::Put { key: 4, len: 4096, salt: 2783339860, }, Op::Put { key: 32, len: 9000, salt: 4118079091, }, Op::Delete { key: 29, }, Op::Delete { key: 36, }, Op::Put { key: 22, len: 15, salt: 684740833, }, Op::Sync, Op::Crash { seed: 13457942360891566897, }, Op::Put { key: 9, len: 300, salt: 273831204, }, Op::Put { key: 18, len: 4096, salt: 1766656881, }, Op::Put { key: 4, len: 300, salt: 785705762, }, Op::Sync, Op::Put { key: 28, len: 1100, salt: 1083477600, }, Op::Put { key: 35, len: 9000, salt: 4257980290, }, Op::Put { key: 26, len: 1100, salt: 4290291001, }, Op::Put { key: 37, len: 1100, salt: 2414076990, }, Op::Put { key: 33, len: 4096, salt: 949803713, }, Op::CleanRestart, Op::Delete { key: 41, }, Op::Put { key: 5, len: 1100, salt: 1305467479, }, Op::Put { key: 36, len: 9000, salt: 3277432423, }, Op::Put { key: 25, len: 9000, salt: 3509235908, }, Op::Put { key: 34, len: 4096, salt: 1724209779, }, Op::Put { key: 10, len: 9000, salt: 3111475648, }, Op::Put { key: 16, len: 9000, salt: 2419131669, }, Op::Sync, Op::Put { key: 30, len: 4096, salt: 3994795445, }, Op::Put { key: 45, len: 1100, salt: 4124347853, }, Op::Put { key: 32, len: 300, salt: 3457348128, }, Op::Sync, Op::Crash { seed: 13702409197141364892, },] }

#[test]
fn regression_replay_gc() {
    run(Mode::Store, regression_ops_gc()).unwrap();
}
fn regression_ops_gc() -> Vec<Op> { vec![ Op::Put { key: 23, len: 9000, salt: 4124404620, }, Op::Put { key: 13, len: 9000, salt: 3022825889, }, Op::Put { key: 19, len: 9000, salt: 308744775, }, Op::Put { key: 5, len: 9000, salt: 2905503037, }, Op::Put { key: 12, len: 9000, salt: 359191142, }, Op::Put { key: 1, len: 9000, salt: 37306134, }, Op::Put { key: 7, len: 4096, salt: 1477587467, }, Op::Put { key: 17, len: 4096, salt: 1366268070, }, Op::Put { key: 43, len: 9000, salt: 2896770155, }, Op::Put { key: 45, len: 4096, salt: 2198468608, }, Op::Put { key: 16, len: 9000, salt: 2078143286, }, Op::Put { key: 29, len: 9000, salt: 4085604439, }, Op::Put { key: 46, len: 9000, salt: 1720685022, }, Op::Delete { key: 38, }, Op::Put { key: 39, len: 4096, salt: 1245156771, }, Op::Put { key: 47, len: 4096, salt: 1574519465, }, Op::Put { key: 14, len: 9000, salt: 3258303140, }, Op::Put { key: 32, len: 9000, salt: 4267451331, }, Op::Sync, Op::Put { key: 24, len: 9000, salt: 2784397113, }, Op::Put { key: 10, len: 9000, salt: 2597329767, }, Op::Put { key: 1, len: 4096, salt: 3072787362, }, Op::Put { key: 23, len: 9000, salt: 4099335635, }, Op::Sync, Op::Put { key: 30, len: 9000, salt: 4066762638, }, Op::Put { key: 18, len: 9000, salt: 842126804, }, Op::Put { key: 35, len: 9000, salt: 4080460062, }, Op::Put { key: 20, len: 36, salt: 1366472577, }, Op::Put { key: 36, len: 4096, salt: 846442546, }, Op::Put { key: 44, len: 4096, salt: 2969765465, }, Op::Put { key: 29, len: 9000, salt: 969354933, }, Op::Put { key: 15, len: 4096, salt: 3186378961, }, Op::Put { key: 6, len: 9000, salt: 2266514614, }, Op::Put { key: 24, len: 9000, salt: 1312990801, }, Op::Put { key: 21, len: 4096, salt: 3574847142, }, Op::Put { key: 19, len: 9000, salt: 3651325246, }, Op::Put { key: 37, len: 4096, salt: 3594708541, }, Op::Put { key: 0, len: 9000, salt: 2152548530, }, Op::Put { key: 7, len: 4096, salt: 1807008778, }, Op::Put { key: 28, len: 9000, salt: 2851930091, }, Op::Delete { key: 41, }, Op::Put { key: 8, len: 9000, salt: 2038348819, }, Op::Sync, Op::Put { key: 37, len: 4096, salt: 3787132610, }, Op::Put { key: 31, len: 9000, salt: 3990707992, }, Op::Put { key: 43, len: 4096, salt: 2885772132, }, Op::Put { key: 40, len: 9000, salt: 2933487588, }, Op::Put { key: 9, len: 4096, salt: 4195929619, }, Op::Put { key: 4, len: 9000, salt: 3523064116, }, Op::Delete { key: 38, }, Op::Put { key: 15, len: 4096, salt: 2757437163, }, Op::Put { key: 40, len: 9000, salt: 2863911909, }, Op::Put { key: 47, len: 9000, salt: 3812108312, }, Op::Put { key: 14, len: 9000, salt: 1292131716, }, Op::Put { key: 21, len: 9000, salt: 4071997844, }, Op::Delete { key: 31, }, Op::Put { key: 32, len: 4096, salt: 708204195, }, Op::Delete { key: 3, }, Op::Put { key: 1, len: 9000, salt: 1781579844, }, Op::Put { key: 19, len: 9000, salt: 2652201888, }, Op::Put { key: 7, len: 4096, salt: 1021592592, }, Op::Put { key: 2, len: 9000, salt: 4111488973, }, Op::Put { key: 27, len: 9000, salt: 3762211564, }, Op::Put { key: 40, len: 4096, salt: 2511788270, }, Op::Put { key: 21, len: 4096, salt: 1709388214, }, Op::Put { key: 16, len: 4096, salt: 4176482651, }, Op::Put { key: 4, len: 4096, salt: 4190641510, }, Op::Put { key: 0, len: 1100, salt: 1440265284, }, Op::Put { key: 15, len: 9000, salt: 3900664010, }, Op::Put { key: 33, len: 1100, salt: 3043523423, }, Op::Put { key: 41, len: 9000, salt: 3399397785, }, Op::Put { key: 31, len: 1100, salt: 2625438718, }, Op::Put { key: 8, len: 300, salt: 540441230, }, Op::Put { key: 2, len: 9000, salt: 3132384949, }, Op::Put { key: 31, len: 1100, salt: 1615198076, }, Op::Put { key: 8, len: 4096, salt: 2095133565, }, Op::Put { key: 5, len: 4096, salt: 2325468002, }, Op::Put { key: 23, len: 1100, salt: 2405538410, }, Op::Put { key: 33, len: 1100, salt: 1363070896, }, Op::Put { key: 42, len: 9000, salt: 2306251502, }, Op::Put { key: 46, len: 9000, salt: 3481879227, }, Op::Put { key: 6, len: 9000, salt: 1929188510, }, Op::Put { key: 10, len: 1100, salt: 3926893057, }, Op::Put { key: 20, len: 4096, salt: 903174625, }, Op::Put { key: 15, len: 300, salt: 1913948705, }, Op::Put { key: 0, len: 4096, salt: 3693826215, }, Op::Put { key: 38, len: 4096, salt: 2439251023, }, Op::Put { key: 32, len: 1100, salt: 1990648436, }, Op::Put { key: 47, len: 4096, salt: 19791563, }, Op::Put { key: 21, len: 4096, salt: 2397750508, }, Op::CleanRestart, Op::Put { key: 44, len: 9000, salt: 1055639890, }, Op::Put { key: 24, len: 4096, salt: 1912179504, }, Op::Put { key: 17, len: 1100, salt: 3619188802, }, Op::Put { key: 13, len: 300, salt: 3913093577, }, Op::Put { key: 37, len: 9000, salt: 3121050462, }, Op::Put { key: 36, len: 4096, salt: 3948589710, }, Op::Put { key: 41, len: 9000, salt: 2586399518, }, Op::Put { key: 12, len: 9000, salt: 988880885, }, Op::Put { key: 22, len: 4096, salt: 4156806340, }, Op::Put { key: 35, len: 9000, salt: 3397087401, }, Op::Put { key: 21, len: 9000, salt: 1634340729, }, Op::Sync, Op::Put { key: 15, len: 26, salt: 3232700041, }, Op::Put { key: 25, len: 4096, salt: 2854253994, }, Op::Put { key: 46, len: 4096, salt: 4098607477, }, Op::Put { key: 44, len: 4096, salt: 3530622408, }, Op::Put { key: 15, len: 9000, salt: 3235724000, }, Op::Put { key: 7, len: 9000, salt: 28230729, }, Op::Put { key: 22, len: 4096, salt: 1893227912, }, Op::Put { key: 4, len: 9000, salt: 3157722571, }, Op::Put { key: 16, len: 4096, salt: 2152136872, }, Op::Put { key: 27, len: 4096, salt: 4209836025, }, Op::Put { key: 37, len: 14, salt: 1022767579, }, Op::Put { key: 4, len: 9000, salt: 1006992828, }, Op::Put { key: 10, len: 4096, salt: 1809966463, }, Op::Put { key: 6, len: 9000, salt: 399779454, }, Op::Sync, Op::Put { key: 18, len: 4096, salt: 1876213515, }, Op::Put { key: 29, len: 9000, salt: 1281827391, }, Op::Put { key: 38, len: 9000, salt: 3346816998, }, Op::Put { key: 12, len: 9000, salt: 3283548684, }, Op::Sync, Op::Put { key: 28, len: 9000, salt: 955714913, }, Op::Put { key: 42, len: 4096, salt: 4064379924, }, Op::Put { key: 1, len: 9000, salt: 1152022129, }, Op::Delete { key: 35, }, Op::Put { key: 30, len: 9000, salt: 1729052744, }, Op::Put { key: 9, len: 4096, salt: 516885939, }, Op::Put { key: 34, len: 4096, salt: 4224200368, }, Op::Put { key: 31, len: 9000, salt: 2765641480, }, Op::Put { key: 42, len: 4096, salt: 376124315, }, Op::Put { key: 25, len: 4096, salt: 2964466975, }, Op::Put { key: 15, len: 4096, salt: 2562504279, }, Op::Put { key: 13, len: 4096, salt: 2407295534, }, Op::Sync, Op::Put { key: 29, len: 4096, salt: 520608739, }, Op::Put { key: 32, len: 9000, salt: 1561623236, }, Op::Put { key: 33, len: 4096, salt: 3886776197, }, Op::Put { key: 22, len: 1100, salt: 3023807567, }, Op::Put { key: 1, len: 4096, salt: 3379197003, }, Op::Put { key: 19, len: 9000, salt: 1424399825, }, Op::Put { key: 37, len: 1100, salt: 3483300144, }, Op::Put { key: 31, len: 1100, salt: 2463134841, }, Op::Put { key: 40, len: 4096, salt: 324990631, }, Op::Put { key: 38, len: 9000, salt: 1136062138, }, Op::Sync, Op::Put { key: 11, len: 9000, salt: 361801389, }, Op::Put { key: 7, len: 9000, salt: 2633827959, }, Op::Put { key: 30, len: 9000, salt: 134825224, }, Op::Put { key: 20, len: 9000, salt: 2614446918, }, Op::Delete { key: 46, }, Op::Put { key: 0, len: 9000, salt: 3931530608, }, Op::Put { key: 12, len: 4096, salt: 3129314361, }, Op::Put { key: 8, len: 9000, salt: 3548875498, }, Op::Put { key: 29, len: 4096, salt: 3490319455, }, Op::Put { key: 5, len: 4096, salt: 4280523621, }, Op::Put { key: 42, len: 300, salt: 3730616235, }, Op::Put { key: 9, len: 9000, salt: 891457709, }, Op::Put { key: 0, len: 9000, salt: 2827883019, }, Op::CleanRestart, Op::Put { key: 20, len: 9000, salt: 277239618, }, Op::Put { key: 29, len: 1100, salt: 4050602621, }, Op::Put { key: 24, len: 9000, salt: 2232041396, }, Op::Put { key: 19, len: 1100, salt: 1913106256, }, Op::Put { key: 17, len: 1100, salt: 2719787699, }, Op::Put { key: 30, len: 9000, salt: 3165045551, }, Op::Put { key: 42, len: 18, salt: 209500007, }, Op::Put { key: 11, len: 9000, salt: 1041071868, }, Op::Put { key: 27, len: 4096, salt: 4189713912, }, Op::Put { key: 10, len: 9000, salt: 299041697, }, Op::Put { key: 7, len: 4096, salt: 3007972521, }, Op::Put { key: 13, len: 9000, salt: 2072761959, }, Op::Put { key: 19, len: 1100, salt: 2171106274, }, Op::Put { key: 33, len: 9000, salt: 1112749447, }, Op::Put { key: 38, len: 300, salt: 1321793233, }, Op::Put { key: 16, len: 9000, salt: 2943737139, }, Op::Put { key: 21, len: 4096, salt: 1080503503, }, Op::Put { key: 40, len: 4096, salt: 2543554410, }, Op::Put { key: 47, len: 9000, salt: 3264975260, }, Op::Put { key: 7, len: 4096, salt: 2078088117, }, Op::Put { key: 4, len: 9000, salt: 2262242716, }, Op::Put { key: 3, len: 9000, salt: 75124743, }, Op::Put { key: 31, len: 4096, salt: 2628099997, }, Op::Put { key: 26, len: 36, salt: 3288677926, }, Op::Put { key: 28, len: 4096, salt: 695112666, }, Op::Put { key: 0, len: 4096, salt: 1879583278, }, Op::CleanRestart, Op::Put { key: 45, len: 9000, salt: 700930432, }, Op::Put { key: 46, len: 300, salt: 3632246759, }, Op::Put { key: 38, len: 9000, salt: 2973818695, }, Op::Put { key: 47, len: 4096, salt: 3932610181, }, Op::Put { key: 15, len: 9000, salt: 2644158585, }, Op::Put { key: 35, len: 9000, salt: 3216044330, }, Op::Put { key: 37, len: 4096, salt: 2982731854, }, Op::Put { key: 20, len: 4096, salt: 1641366347, }, Op::Put { key: 42, len: 1100, salt: 1999115349, }, Op::Put { key: 26, len: 9000, salt: 1931319601, }, Op::Put { key: 34, len: 9000, salt: 3899759175, }, Op::Put { key: 6, len: 1100, salt: 4067450896, }, Op::Sync, Op::Put { key: 24, len: 4096, salt: 3802917020, }, Op::Put { key: 19, len: 5, salt: 1471829323, }, Op::Put { key: 23, len: 1100, salt: 1915271907, }, Op::Put { key: 9, len: 4096, salt: 1705531664, }, Op::Put { key: 4, len: 4096, salt: 1736519243, }, Op::Put { key: 39, len: 4096, salt: 1419212158, }, Op::Put { key: 16, len: 9000, salt: 1124350709, }, Op::Put { key: 10, len: 9000, salt: 1502405925, }, Op::Put { key: 7, len: 300, salt: 2009797783, }, Op::Put { key: 25, len: 9000, salt: 2399569256, }, Op::Sync, Op::Put { key: 36, len: 9000, salt: 3779343120, }, Op::Put { key: 4, len: 9000, salt: 136936907, }, Op::Put { key: 5, len: 9000, salt: 795114085, }, Op::Put { key: 18, len: 1100, salt: 1643073845, }, Op::Put { key: 2, len: 4096, salt: 288320461, }, Op::Put { key: 44, len: 4, salt: 2640830616, }, Op::Put { key: 6, len: 26, salt: 2650943318, }, Op::Put { key: 12, len: 1100, salt: 3887355826, }, Op::Put { key: 34, len: 1100, salt: 1304131877, }, Op::Put { key: 23, len: 4096, salt: 844866261, }, Op::Put { key: 0, len: 9000, salt: 2578933810, }, Op::Put { key: 38, len: 9000, salt: 1721526360, }, Op::Sync, Op::Put { key: 1, len: 9000, salt: 416971564, }, Op::Put { key: 37, len: 9000, salt: 3122850186, }, Op::Put { key: 23, len: 9000, salt: 3923181166, }, Op::Put { key: 12, len: 9000, salt: 3929440116, }, Op::Put { key: 35, len: 9000, salt: 2048570331, }, Op::Put { key: 18, len: 300, salt: 3216781705, }, Op::Put { key: 10, len: 4096, salt: 4163108273, }, Op::Put { key: 31, len: 1100, salt: 2392599000, }, Op::Put { key: 36, len: 9000, salt: 3843057467, }, Op::Put { key: 2, len: 9000, salt: 4166459271, }, Op::Put { key: 32, len: 9000, salt: 928008178, }, Op::Put { key: 43, len: 9000, salt: 116599754, }, Op::Put { key: 33, len: 1100, salt: 2791363071, }, Op::Put { key: 7, len: 300, salt: 2627891818, }, Op::Put { key: 46, len: 9000, salt: 238535996, }, Op::Put { key: 0, len: 1100, salt: 3689951114, }, Op::Put { key: 18, len: 1100, salt: 3059155624, }, Op::Put { key: 1, len: 9000, salt: 1432417832, }, Op::Put { key: 29, len: 1100, salt: 2696741596, }, Op::Put { key: 41, len: 1100, salt: 2486392589, }, Op::Put { key: 17, len: 9000, salt: 787991071, }, Op::Put { key: 20, len: 1100, salt: 1270555744, }, Op::Put { key: 19, len: 1100, salt: 2307943780, }, Op::Put { key: 3, len: 4096, salt: 860545293, }, Op::Put { key: 24, len: 9000, salt: 3642780781, }, Op::Put { key: 14, len: 1100, salt: 2948850359, }, Op::Sync, Op::Delete { key: 5, }, Op::Put { key: 11, len: 1100, salt: 2993640779, }, Op::Put { key: 5, len: 1100, salt: 3074356748, }, Op::Put { key: 39, len: 4096, salt: 217620299, }, Op::Put { key: 17, len: 9000, salt: 1617267338, }, Op::Put { key: 44, len: 4096, salt: 2749873726, }, Op::Sync, Op::Put { key: 22, len: 1100, salt: 3988949703, }, Op::Delete { key: 6, }, Op::Put { key: 9, len: 300, salt: 1428754101, }, Op::Put { key: 45, len: 27, salt: 3840323570, }, Op::Put { key: 33, len: 300, salt: 1764728957, }, Op::Get { key: 46, }, Op::Put { key: 42, len: 1100, salt: 1325511423, }, Op::Put { key: 8, len: 1100, salt: 1209951402, }, Op::Get { key: 22, }, Op::Put { key: 26, len: 4096, salt: 316008506, }, Op::Put { key: 4, len: 300, salt: 648399418, }, Op::Put { key: 7, len: 4096, salt: 806266190, }, Op::Put { key: 34, len: 4096, salt: 1556236819, }, Op::Get { key: 4, }, Op::Put { key: 28, len: 300, salt: 3489288302, }, Op::Put { key: 32, len: 300, salt: 3036472495, }, Op::Put { key: 7, len: 11, salt: 3955340018, }, Op::Put { key: 42, len: 4096, salt: 1149541185, }, Op::Put { key: 38, len: 4096, salt: 1008850697, }, Op::Put { key: 16, len: 24, salt: 2169313983, }, Op::Sync, Op::Put { key: 46, len: 4096, salt: 2327465434, }, Op::Delete { key: 2, }, Op::Put { key: 23, len: 300, salt: 3590182687, }, Op::Put { key: 44, len: 1100, salt: 252985699, }, Op::Delete { key: 37, }, Op::Get { key: 31, }, Op::Get { key: 32, }, Op::Put { key: 31, len: 4096, salt: 2791651067, }, Op::Crash { seed: 13721496980783689775, }, Op::Get { key: 13, }, Op::Put { key: 7, len: 1100, salt: 1384109880, }, Op::Put { key: 14, len: 38, salt: 2120029883, }, Op::Put { key: 14, len: 38, salt: 3954562841, }, Op::Crash { seed: 4511285875072908181, }, Op::Delete { key: 26, }, Op::Put { key: 18, len: 9000, salt: 3331777828, }, Op::Delete { key: 12, }, Op::Put { key: 25, len: 300, salt: 162009269, }, Op::Get { key: 32, }, Op::Put { key: 19, len: 300, salt: 2442288222, }, Op::Put { key: 3, len: 4096, salt: 222960061, }, Op::Put { key: 2, len: 1100, salt: 3954656043, }, Op::Put { key: 9, len: 300, salt: 1091532339, }, Op::Put { key: 16, len: 9000, salt: 3140820480, }, Op::Put { key: 47, len: 9000, salt: 2473966474, }, Op::Put { key: 21, len: 9000, salt: 1030373957, }, Op::Put { key: 34, len: 4096, salt: 353068238, }, Op::Sync, Op::Put { key: 10, len: 1100, salt: 1223427898, }, Op::Get { key: 29, }, Op::Put { key: 21, len: 9000, salt: 3458719020, }, Op::Crash { seed: 5464433439076422742, }, Op::Get { key: 24, }, Op::Put { key: 23, len: 4096, salt: 1752777210, }, Op::Put { key: 3, len: 9000, salt: 2269197241, }, Op::Get { key: 18, }, Op::Put { key: 42, len: 4096, salt: 2716374494, }, Op::Delete { key: 26, }, Op::Sync, Op::Put { key: 7, len: 1100, salt: 1540582794, }, Op::Put { key: 19, len: 1100, salt: 1166526031, }, Op::Put { key: 27, len: 4096, salt: 1268438333, }, Op::Put { key: 24, len: 300, salt: 405415574, }, Op::Put { key: 37, len: 4096, salt: 1547341478, }, Op::Get { key: 32, }, Op::Get { key: 12, }, Op::Get { key: 26, }, Op::Get { key: 39, }, Op::Put { key: 19, len: 4096, salt: 3134775641, }, Op::Crash { seed: 1497027802402524907, }, Op::Put { key: 31, len: 4096, salt: 1010768793, }, Op::Put { key: 6, len: 1100, salt: 2296625360, }, Op::Put { key: 23, len: 1100, salt: 645398477, }, Op::Put { key: 23, len: 22, salt: 3901655488, }, Op::Delete { key: 23, }, Op::Put { key: 30, len: 300, salt: 3453109303, }, Op::Put { key: 0, len: 1100, salt: 2983643786, }, Op::Delete { key: 23, }, Op::Put { key: 33, len: 4096, salt: 1098949357, }, Op::Put { key: 45, len: 300, salt: 1813143886, }, Op::Get { key: 17, }, Op::Put { key: 22, len: 18, salt: 2395356290, }, Op::Put { key: 33, len: 5, salt: 2474550803, }, Op::Get { key: 0, }, Op::Put { key: 33, len: 9000, salt: 1607425548, }, Op::Delete { key: 0, }, Op::Put { key: 32, len: 30, salt: 2529297187, }, Op::Delete { key: 20, }, Op::Put { key: 43, len: 300, salt: 1760606606, }, Op::Put { key: 24, len: 1100, salt: 1510176425, }, Op::Sync, Op::Put { key: 33, len: 17, salt: 103631173, }, Op::Crash { seed: 10760073191660841852, }, Op::Put { key: 47, len: 4096, salt: 3470702535, }, Op::Put { key: 47, len: 9000, salt: 3773762846, }, Op::Put { key: 6, len: 9000, salt: 370786116, }, Op::Put { key: 3, len: 1100, salt: 4102997192, }, Op::Put { key: 33, len: 9000, salt: 906001765, }, Op::Put { key: 8, len: 4096, salt: 1743490775, }, Op::Put { key: 34, len: 9000, salt: 3450499216, }, Op::Put { key: 18, len: 4096, salt: 2972297143, }, Op::Put { key: 27, len: 4096, salt: 1103507617, }, Op::Get { key: 19, }, Op::Put { key: 12, len: 21, salt: 1321188559, }, Op::Put { key: 34, len: 9000, salt: 3381165926, }, Op::Get { key: 40, }, Op::Delete { key: 14, }, Op::Put { key: 46, len: 9000, salt: 1997867446, }, Op::Sync, Op::Sync, Op::CleanRestart, Op::Put { key: 7, len: 300, salt: 673244858, }, Op::Put { key: 26, len: 300, salt: 3606257311, }, Op::Delete { key: 0, }, Op::Put { key: 43, len: 9000, salt: 1201853413, }, Op::Put { key: 19, len: 1100, salt: 1225755984, }, Op::Get { key: 14, }, Op::Delete { key: 41, }, Op::Put { key: 39, len: 4096, salt: 929534007, }, Op::Put { key: 34, len: 31, salt: 1626485708, }, Op::Put { key: 25, len: 38, salt: 1229171777, }, Op::Put { key: 15, len: 300, salt: 515558601, }, Op::Put { key: 46, len: 9000, salt: 1263840315, }, Op::Put { key: 47, len: 1100, salt: 4190226632, }, Op::Put { key: 0, len: 1100, salt: 4120048852, }, Op::Get { key: 18, }, Op::Get { key: 21, }, Op::Get { key: 8, }, Op::Get { key: 26, }, Op::CleanRestart, Op::Put { key: 43, len: 9000, salt: 734036804, }, Op::Put { key: 22, len: 9000, salt: 3669736026, }, Op::Put { key: 26, len: 29, salt: 1109687309, }, Op::Put { key: 23, len: 4096, salt: 798692649, }, Op::Put { key: 21, len: 9000, salt: 3277313090, }, Op::Get { key: 7, }, Op::Put { key: 31, len: 4096, salt: 2477772614, }, Op::Put { key: 33, len: 1100, salt: 307406388, }, Op::Delete { key: 36, }, Op::Get { key: 36, }, Op::Put { key: 14, len: 9000, salt: 3458346970, }, Op::Get { key: 46, }, Op::Put { key: 45, len: 33, salt: 2815638692, }, Op::Put { key: 8, len: 38, salt: 2752480282, }, Op::Get { key: 12, }, Op::CleanRestart, Op::Put { key: 47, len: 4096, salt: 2057527900, }, Op::Get { key: 5, }, Op::Get { key: 34, }, Op::Put { key: 40, len: 1100, salt: 1135598370, }, Op::Put { key: 26, len: 4096, salt: 3895871863, }, Op::Put { key: 12, len: 9000, salt: 1325013938, }, Op::Get { key: 30, }, Op::Put { key: 30, len: 4096, salt: 387923106, }, Op::Get { key: 44, }, Op::Delete { key: 12, }, Op::Put { key: 43, len: 32, salt: 2969622318, }, Op::Put { key: 3, len: 1100, salt: 806491799, }, Op::Put { key: 21, len: 4096, salt: 221892446, }, Op::Put { key: 16, len: 300, salt: 3892601358, }, Op::Put { key: 36, len: 9000, salt: 1953220051, }, Op::Put { key: 15, len: 19, salt: 1593567067, }, Op::Sync, Op::Put { key: 44, len: 26, salt: 1291755021, }, Op::Get { key: 36, }, Op::Put { key: 26, len: 1100, salt: 137373080, }, Op::Get { key: 38, }, Op::Put { key: 34, len: 1100, salt: 3066390697, }, Op::Put { key: 40, len: 9000, salt: 1018065743, }, Op::Delete { key: 42, }, Op::Put { key: 10, len: 9000, salt: 1550489821, }, Op::Put { key: 44, len: 300, salt: 1979511783, }, Op::Put { key: 22, len: 1100, salt: 1279641677, }, Op::Sync, Op::Get { key: 20, }, Op::Sync, Op::Delete { key: 2, }, Op::Get { key: 13, }, Op::Get { key: 20, }, Op::Delete { key: 4, }, Op::Get { key: 42, }, Op::Put { key: 10, len: 35, salt: 3762215556, }, Op::Get { key: 32, }, Op::Put { key: 8, len: 300, salt: 1199575130, }, Op::Get { key: 17, }, Op::Put { key: 31, len: 1100, salt: 827979066, }, Op::Put { key: 25, len: 300, salt: 3450263195, }, Op::Put { key: 6, len: 4096, salt: 3301713977, }, Op::Delete { key: 3, }, Op::Get { key: 45, }, Op::Put { key: 11, len: 4096, salt: 1110659605, }, Op::Put { key: 7, len: 4096, salt: 1071004224, }, Op::Put { key: 21, len: 4096, salt: 167458922, }, Op::Put { key: 22, len: 4096, salt: 1201725782, }, Op::Put { key: 25, len: 300, salt: 3552958680, }, Op::Get { key: 29, }, Op::Put { key: 30, len: 9000, salt: 850685524, }, Op::Put { key: 6, len: 1100, salt: 1631836748, }, Op::Delete { key: 39, }, Op::Put { key: 4, len: 9000, salt: 2575892784, },] }

/// A fault and crash seed proptest found (a sync's failure once lost a synced key).
#[test]
fn regression_fault_then_crash() {
    faults_case(77, false, 7836788957695681907).unwrap();
}

/// A device that, before every write and sync it passes on, hands the image a crash at that
/// moment would leave (several ways: each unsynced write applied, dropped or torn) to `probe`.
struct CrashProbe {
    sim: Arc<SimDevice>,
    /// Called with the device and a crash seed: makes the crash image (`SimDevice::crash`)
    /// and checks it.
    probe: Probe,
    crash_seeds: u64,
}

impl CrashProbe {
    fn crash_here(&self) {
        for seed in 0..self.crash_seeds {
            (self.probe)(&self.sim, self.sim.ops() * 1_000 + seed);
        }
    }
}

impl Device for CrashProbe {
    fn len_bytes(&self) -> u64 {
        self.sim.len_bytes()
    }
    fn alignment_bytes(&self) -> u32 {
        self.sim.alignment_bytes()
    }
    fn read_at(&self, offset_bytes: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.sim.read_at(offset_bytes, buf)
    }
    fn write_at(&self, offset_bytes: u64, buf: &[u8]) -> std::io::Result<()> {
        self.crash_here();
        self.sim.write_at(offset_bytes, buf)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.crash_here();
        self.sim.sync()
    }
}

/// What a crash may leave of each key: the value at the last sync, or any written since.
#[derive(Default)]
struct SyncModel {
    /// Off while the store is being created (a crash then leaves no store).
    armed: bool,
    /// The first crash image that lost a synced key.
    failure: Option<String>,
    synced: BTreeMap<u32, Option<Vec<u8>>>,
    since_sync: BTreeMap<u32, Vec<Option<Vec<u8>>>>,
    checked_images: u64,
}

/// Store mode with garbage collection and seals inline, so it is deterministic: at every device
/// write and sync, a crash right then keeps every synced key (the value or deletion of its last
/// sync, or one written after it), in several ways of losing and tearing unsynced writes.
/// Overwrites only: every collection finds its victims all dead. This found a collection freeing
/// such victims before the newer blocks that made them dead were durable: a crash then lost
/// those blocks and brought back a key's first version.
#[test]
fn crash_at_any_point_of_collections_without_live_records_keeps_synced_data() {
    crash_points_case(Mode::Store, 0, |i| (i % 150, false), Some(false));
}

/// As above with cold keys written once among the overwritten ones (every block keeps live
/// records, which collections move) and deletions.
#[test]
fn crash_at_any_point_of_collections_moving_records_keeps_synced_data() {
    crash_points_case(Mode::Store, 0, hot_cold_and_deletions, Some(true));
}

/// As above with background sealers and collector (not deterministic: checks whatever
/// interleaving of seals, confirmation rounds, collections and syncs this run takes).
#[test]
fn crash_at_any_point_with_background_threads_keeps_synced_data() {
    crash_points_case(Mode::Store, 2, hot_cold_and_deletions, None);
}

/// As above with two writer threads, each syncing its own writes while the other fills and
/// seals buffers of the same partitions.
#[test]
fn crash_at_any_point_with_concurrent_writers_keeps_synced_data() {
    crash_points_case_with_writers(Mode::Store, 2, 2, hot_cold_and_deletions, None);
}

/// Cache mode, where the oldest blocks are dropped: a crash at any point may lose a synced key
/// to eviction, but never brings back an older value or a deleted key.
#[test]
fn crash_at_any_point_in_cache_mode_never_returns_an_older_value() {
    crash_points_case(Mode::Cache, 0, hot_cold_and_deletions, None);
}

/// Makes and checks a crash image of the device for a crash seed.
type Probe = Box<dyn Fn(&SimDevice, u64) + Send + Sync>;

/// Write `i` of the crash-point workloads with live records left to move: every tenth a cold
/// key written once, the others overwriting 150 hot keys, every seventh a deletion.
fn hot_cold_and_deletions(i: u32) -> (u32, bool) {
    if i.is_multiple_of(10) { (1_000 + i, false) } else { (i % 150, i.is_multiple_of(7)) }
}

/// Runs 1,000 writes (`write(i)`: which key, and whether to delete it) with a sync every 50,
/// checking crash images before every device write and sync; `moves_records`: whether the
/// collections must have moved live records.
fn crash_points_case(mode: Mode, seal_threads: usize, write: impl Fn(u32) -> (u32, bool) + Sync, moves_records: Option<bool>) {
    crash_points_case_with_writers(mode, seal_threads, 1, write, moves_records);
}

/// Each of `writers` threads runs the writes of `crash_points_case` on keys of its own (offset
/// by `WRITER_KEYS`) and syncs every 50 of them: a key's synced value is the one its writer
/// wrote before its last completed `sync()` (a sync by another writer may cover more).
fn crash_points_case_with_writers(mode: Mode, seal_threads: usize, writers: u32, write: impl Fn(u32) -> (u32, bool) + Sync, moves_records: Option<bool>) {
    const WRITER_KEYS: u32 = 100_000;
    let cfg = EngineConfig { seal_threads, ..config(mode) };
    let model = Arc::new(Mutex::new(SyncModel::default()));
    let (probe_model, probe_cfg) = (Arc::clone(&model), EngineConfig { seal_threads: 0, ..cfg.clone() });
    let sim = sim(4 << 20);
    let probe = move |sim: &SimDevice, seed: u64| {
        // The image is taken under the model's lock: a sync that completes while the image is
        // checked then counts only once the model says so (the test's writer updates the model
        // after `sync()` returns, under the same lock).
        let mut model = probe_model.lock().unwrap();
        if !model.armed || model.failure.is_some() {
            return;
        }
        let image = sim.crash(seed);
        model.checked_images += 1;
        let at = model.checked_images;
        let engine = match Engine::open_device(image as Arc<dyn Device>, &probe_cfg) {
            Ok(engine) => engine,
            Err(error) => return model.failure = Some(format!("crash image {at}: open failed: {error}")),
        };
        let mut lost = None;
        for (k, v) in &model.synced {
            let got = match engine.get(&key(*k)) {
                Ok(item) => item.map(|i| i.into_vec()),
                Err(error) => return model.failure = Some(format!("crash image {at}: key {k}: {error}")),
            };
            let later = model.since_sync.get(k).is_some_and(|vs| vs.contains(&got));
            let evicted = mode == Mode::Cache && got.is_none();
            if got != *v && !later && !evicted {
                lost = Some(format!("crash image {at}: key {k} lost its synced value (got {:?} bytes)", got.map(|g| g.len())));
                break;
            }
        }
        model.failure = lost;
    };
    let device = Arc::new(CrashProbe { sim: Arc::clone(&sim), probe: Box::new(probe), crash_seeds: 8 });
    let engine = Engine::create(device as Arc<dyn Device>, &cfg).expect("create");
    model.lock().unwrap().armed = true;
    std::thread::scope(|scope| {
        for w in 0..writers {
            let (engine, model, write) = (&engine, &model, &write);
            scope.spawn(move || {
                for i in 0..1000u32 {
                    let (k, delete) = write(i);
                    let k = k + w * WRITER_KEYS;
                    let v = (!delete).then(|| value_for(k, i, [20, 700, 5000][(i % 3) as usize]));
                    model.lock().unwrap().since_sync.entry(k).or_default().push(v.clone());
                    match &v {
                        Some(v) => engine.put(&key(k), v).map(|_| ()).unwrap(),
                        None => engine.delete(&key(k)).unwrap(),
                    }
                    if i % 50 == 49 {
                        engine.sync().unwrap();
                        let mut m = model.lock().unwrap();
                        let mine: Vec<u32> = m.since_sync.keys().copied().filter(|k| k / WRITER_KEYS == w).collect();
                        for k in mine {
                            let v = m.since_sync.remove(&k).and_then(|mut vs| vs.pop()).expect("one value");
                            m.synced.insert(k, v);
                        }
                    }
                }
            });
        }
    });
    let stats = engine.stats();
    if mode == Mode::Cache {
        assert!(stats.evicted_blocks > 0, "the workload must evict: {stats:?}");
    }
    // Closing syncs: a crash before that is checked too.
    drop(engine);
    if let Some(failure) = model.lock().unwrap().failure.clone() {
        panic!("{failure}");
    }
    if mode == Mode::Store {
        assert!(stats.gc_runs > 0 && stats.gc_blocks_freed > 0, "the workload must collect garbage: {stats:?}");
    }
    if let Some(moves) = moves_records {
        assert_eq!(stats.gc_records_moved > 0, moves, "{stats:?}");
    }
    let checked = model.lock().unwrap().checked_images;
    eprintln!("{checked} crash images checked; {stats:?}");
    assert!(checked > 1_000, "{checked} crash images checked");
}
