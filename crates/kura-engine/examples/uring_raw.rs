//! Raw random-read rate of the engine's I/O queue with no engine logic: the ceiling the engine's
//! GETs are measured against when tuning the read path.
//!
//! `cargo run --release -p kura-engine --example uring_raw -- FILE [THREADS] [DEPTH] [READ_BYTES] [OFFSET_MIB] [SIZE_MIB]`
use std::sync::Arc;
use std::time::{Duration, Instant};

use kura_engine::AlignedBuf;
use kura_engine::device::{Device, FileDevice, FileDeviceOptions, io_queue};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: u64| args.get(i).map_or(default, |s| s.parse().expect("a number"));
    let path = args.get(1).expect("usage: uring_raw FILE [THREADS] [DEPTH] [READ_BYTES] [OFFSET_MIB] [SIZE_MIB]");
    let (threads, depth, read_bytes) = (arg(2, 2) as usize, arg(3, 16) as usize, arg(4, 4096) as usize);
    let dev: Arc<dyn Device> = Arc::new(FileDevice::open(path.as_ref(), &FileDeviceOptions { create: false, size_bytes: None, direct_io: true }).expect("open"));
    let offset = arg(5, 0) << 20;
    let size = if args.len() > 6 { arg(6, 0) << 20 } else { dev.len_bytes() - offset };
    let sectors = (size - read_bytes as u64) / 512;
    let started = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|id| {
                let dev = dev.clone();
                s.spawn(move || {
                    let mut queue = io_queue(&dev, depth);
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ id as u64;
                    let mut next = || {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        offset + (x % sectors) * 512
                    };
                    for i in 0..depth {
                        queue.submit_read(next(), AlignedBuf::zeroed(read_bytes), i as u64).expect("submit");
                    }
                    let (mut done, mut reads) = (Vec::new(), 0u64);
                    let end = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < end {
                        queue.wait(1, &mut done).expect("wait");
                        for c in done.drain(..) {
                            c.result.expect("read");
                            reads += 1;
                            queue.submit_read(next(), c.buf, c.token).expect("submit");
                        }
                    }
                    reads
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("reader")).sum()
    });
    println!("{:.0} reads/s of {read_bytes} bytes", total as f64 / started.elapsed().as_secs_f64());
}
