#![allow(dead_code)]

use std::sync::Arc;

use kura_engine::{Device, Engine, EngineConfig, Mode, SimDevice};

pub const DEVICE_BYTES: u64 = 8 << 20;

pub fn config(mode: Mode) -> EngineConfig {
    EngineConfig {
        page_size_bytes: 4096,
        block_size_bytes: 64 * 1024,
        partitions: 2,
        mode: Some(mode),
        value_size_max_bytes: 16 * 1024,
        ..EngineConfig::default()
    }
}

pub fn sim(bytes: u64) -> Arc<SimDevice> {
    SimDevice::new(bytes, 512)
}

pub fn create(dev: &Arc<SimDevice>, config: &EngineConfig) -> Engine {
    Engine::create(dev.clone() as Arc<dyn Device>, config).expect("create")
}

pub fn open(dev: &Arc<SimDevice>, config: &EngineConfig) -> Engine {
    Engine::open_device(dev.clone() as Arc<dyn Device>, config).expect("open")
}

pub fn value_for(key: u32, round: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = (u64::from(key) << 32 | u64::from(round)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    while v.len() < len {
        x ^= x >> 29;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        v.push(x as u8);
    }
    v
}

pub fn key(i: u32) -> Vec<u8> {
    format!("key-{i:08}").into_bytes()
}
