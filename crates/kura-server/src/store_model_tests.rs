//! The store against a `HashMap` model: random sequences of memcached
//! commands on a few hot and many cold keys, over the engine on a simulated
//! device with small blocks, so write buffers seal, reads go to sealed blocks
//! and the RAM cache evicts along the way. Each outcome and every value must match.

use std::collections::HashMap;
use std::sync::Arc;

use kura_engine::{Device, Engine, EngineConfig, Mode, SimDevice};
use kura_proto::ArithmeticOp;
use proptest::prelude::*;

use crate::store::{
    ArithOutcome, ArithRequest, DeleteMode, DeleteOutcome, MetaGetOptions, Store, StoreConfig,
    StoreMode, StoreOutcome, StoreRequest,
};

/// Keys: a few hot ones and many cold ones, so write buffers fill and seal
/// (a buffer keeps one record per key) and reads go to sealed blocks.
const KEY_COUNT: usize = 128;
const HOT_KEYS: usize = 4;
const ITEM_SIZE_MAX_BYTES: usize = 16 << 10;

#[derive(Debug, Clone)]
enum Op {
    Store {
        mode: StoreMode,
        key: usize,
        flags: u32,
        value: Vec<u8>,
    },
    /// `cas` with the item's current CAS value (`true`) or a stale one.
    Cas {
        key: usize,
        current: bool,
        value: Vec<u8>,
    },
    Delete {
        key: usize,
    },
    Arith {
        key: usize,
        incr: bool,
        delta: u64,
    },
    Touch {
        key: usize,
    },
    Get {
        key: usize,
    },
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..40),
        2 => (0u64..1000).prop_map(|n| n.to_string().into_bytes()),
        3 => prop::collection::vec(any::<u8>(), 6000..15_000),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = prop_oneof![0..HOT_KEYS, 0..KEY_COUNT];
    let mode = prop_oneof![
        Just(StoreMode::Set),
        Just(StoreMode::Add),
        Just(StoreMode::Replace),
        Just(StoreMode::Append),
        Just(StoreMode::Prepend)
    ];
    prop_oneof![
        4 => (mode, key.clone(), any::<u32>(), value()).prop_map(|(mode, key, flags, value)| Op::Store { mode, key, flags, value }),
        1 => (key.clone(), any::<bool>(), value()).prop_map(|(key, current, value)| Op::Cas { key, current, value }),
        1 => key.clone().prop_map(|key| Op::Delete { key }),
        2 => (key.clone(), any::<bool>(), prop_oneof![0u64..10, Just(u64::MAX), any::<u64>()]).prop_map(|(key, incr, delta)| Op::Arith { key, incr, delta }),
        1 => key.clone().prop_map(|key| Op::Touch { key }),
        3 => key.prop_map(|key| Op::Get { key }),
    ]
}

fn key_name(key: usize) -> Vec<u8> {
    if key == 3 {
        vec![b'L'; kura_proto::KEY_LENGTH_MAX]
    } else {
        format!("key-{key}").into_bytes()
    }
}

fn new_store() -> Store {
    let device: Arc<dyn Device> = SimDevice::new(8 << 20, 512);
    let config = EngineConfig {
        block_size_bytes: 64 << 10,
        mode: Some(Mode::Store),
        value_size_max_bytes: 16 << 10,
        seal_threads: 0,
        partitions_max: crate::config::PARTITIONS_MAX_DEFAULT,
        ..EngineConfig::default()
    };
    let engine = Engine::create(device, &config).expect("create engine");
    let store_config = StoreConfig {
        item_size_max_bytes: ITEM_SIZE_MAX_BYTES,
        cache_limit_bytes: 1 << 20,
        size_bytes: 0,
        mode: None,
        block_size_bytes: None,
        seal_threads: 0,
        partitions_max: crate::config::PARTITIONS_MAX_DEFAULT,
        cas_enabled: true,
        slab_classes: crate::metadump::SlabClasses::default(),
    };
    Store::with_engine(engine, &store_config).expect("store")
}

/// What the model holds for a key: value and client flags.
type Model = HashMap<usize, (Vec<u8>, u32)>;

fn check_get(store: &Store, model: &Model, key: usize) {
    let found = store.get_blocking(&key_name(key)).expect("get");
    match (found, model.get(&key)) {
        (None, None) => {}
        (Some(found), Some((value, flags))) => {
            assert_eq!(found.data(), &value[..], "value of {key}");
            assert_eq!(found.meta().client_flags, *flags, "flags of {key}");
        }
        (found, expected) => panic!(
            "key {key}: store has {:?}, model {:?}",
            found.map(|f| f.data().len()),
            expected.map(|e| e.0.len())
        ),
    }
}

fn apply(store: &Store, model: &mut Model, op: &Op) {
    match op {
        Op::Store {
            mode,
            key,
            flags,
            value,
        } => {
            let name = key_name(*key);
            let req = StoreRequest {
                client_flags: *flags,
                ..StoreRequest::new(*mode, &name, value)
            };
            let outcome = store.store(&req).expect("store");
            let present = model.contains_key(key);
            let combined = model.get(key).map_or(0, |(v, _)| v.len()) + value.len();
            // append and prepend keep the old flags, which count towards the record's size.
            let old_flags = model.get(key).map_or(*flags, |(_, f)| *f);
            let too_large = |len| {
                crate::record::record_len(key_name(*key).len(), old_flags, len)
                    > ITEM_SIZE_MAX_BYTES
            };
            let expect_stored = match mode {
                StoreMode::Set => true,
                StoreMode::Add => !present,
                StoreMode::Append | StoreMode::Prepend => present && !too_large(combined),
                _ => present,
            };
            assert_eq!(
                matches!(outcome, StoreOutcome::Stored { .. }),
                expect_stored,
                "{op:?} → {outcome:?}"
            );
            if expect_stored {
                let entry = model.entry(*key).or_insert_with(|| (Vec::new(), *flags));
                match mode {
                    StoreMode::Append => entry.0.extend_from_slice(value),
                    StoreMode::Prepend => {
                        entry.0.splice(0..0, value.iter().copied()).for_each(drop)
                    }
                    _ => *entry = (value.clone(), *flags),
                }
            }
        }
        Op::Cas {
            key,
            current,
            value,
        } => {
            let cas = store
                .get_blocking(&key_name(*key))
                .expect("get")
                .map(|f| f.cas());
            let compare = match (cas, current) {
                (Some(cas), true) => cas,
                (Some(cas), false) => cas.wrapping_add(1_000_000),
                (None, _) => 12345,
            };
            let name = key_name(*key);
            let req = StoreRequest {
                compare_cas: compare,
                ..StoreRequest::new(StoreMode::Cas, &name, value)
            };
            let outcome = store.store(&req).expect("cas");
            let expected = match (cas, current) {
                (None, _) => StoreOutcome::NotFound,
                (Some(_), false) => StoreOutcome::Exists,
                (Some(_), true) => {
                    model.insert(*key, (value.clone(), 0));
                    assert!(
                        matches!(outcome, StoreOutcome::Stored { .. }),
                        "{op:?} → {outcome:?}"
                    );
                    return;
                }
            };
            assert_eq!(outcome, expected, "{op:?}");
        }
        Op::Delete { key } => {
            let outcome = store
                .delete(&key_name(*key), None, None, DeleteMode::Remove)
                .expect("delete");
            let expected = if model.remove(key).is_some() {
                DeleteOutcome::Deleted
            } else {
                DeleteOutcome::NotFound
            };
            assert_eq!(outcome, expected, "{op:?}");
        }
        Op::Arith { key, incr, delta } => {
            let op_kind = if *incr {
                ArithmeticOp::Incr
            } else {
                ArithmeticOp::Decr
            };
            let req = ArithRequest {
                key: &key_name(*key),
                op: op_kind,
                delta: *delta,
                compare_cas: 0,
                new_cas: None,
                vivify: None,
                exptime_s: None,
            };
            let outcome = store.arith(&req).expect("arith");
            let Some((old, flags)) = model.get(key).cloned() else {
                assert_eq!(outcome, ArithOutcome::NotFound, "{op:?}");
                return;
            };
            let Some(n) = crate::store::parse_counter(&old) else {
                assert_eq!(outcome, ArithOutcome::NonNumeric, "{op:?}");
                return;
            };
            let new = if *incr {
                n.wrapping_add(*delta)
            } else {
                n.saturating_sub(*delta)
            };
            let ArithOutcome::Value { value, .. } = outcome else {
                panic!("{op:?} → {outcome:?}")
            };
            assert_eq!(value, new);
            let mut digits = new.to_string().into_bytes();
            if digits.len() < old.len() {
                digits.resize(old.len(), b' ');
            }
            model.insert(*key, (digits, flags));
        }
        Op::Touch { key } => {
            let touched = store.touch(&key_name(*key), 1000).expect("touch");
            assert_eq!(touched.is_some(), model.contains_key(key), "{op:?}");
        }
        Op::Get { key } => check_get(store, model, *key),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_store_behaves_like_memcached_on_a_map(ops in prop::collection::vec(op(), 1..300)) {
        let store = new_store();
        let mut model = Model::new();
        for op in &ops {
            apply(&store, &mut model, op);
        }
        for key in 0..KEY_COUNT {
            check_get(&store, &model, key);
        }
    }
}

/// memcached rewrites a number that still fits in place, so the item stays
/// stale (`md I`) and won (`mg` W); a longer number goes to a new item.
/// (Found by tests/differential_random.rs.)
#[test]
fn arithmetic_in_place_keeps_an_item_stale_and_won() {
    let store = new_store();
    let cases: [(&[u8], &[u8], ArithmeticOp, bool); 2] = [
        (b"fits", b"15", ArithmeticOp::Decr, true),
        (b"grows", b"9", ArithmeticOp::Incr, false),
    ];
    for (key, data, op, kept) in cases {
        let set = StoreRequest::new(StoreMode::Set, key, data);
        assert!(matches!(store.store(&set), Ok(StoreOutcome::Stored { .. })));
        let stale = DeleteMode::MarkStale { exptime_s: None };
        assert_eq!(
            store.delete(key, None, None, stale).unwrap(),
            DeleteOutcome::Deleted
        );
        let read = store
            .meta_get(key, &MetaGetOptions::default())
            .unwrap()
            .unwrap();
        assert!(read.won);
        let req = ArithRequest {
            key,
            op,
            delta: 1,
            compare_cas: 0,
            new_cas: None,
            vivify: None,
            exptime_s: None,
        };
        let Ok(ArithOutcome::Value { meta, .. }) = store.arith(&req) else {
            panic!("{op:?} of {data:?}");
        };
        assert_eq!(
            (meta.stale, meta.token_sent),
            (kept, kept),
            "{op:?} of {data:?}"
        );
    }
}
