//! Throughput of the replay backends on one synthetic pool workload, every
//! backend over the same events in the same run: events/s, slot-touches/s,
//! the speed-up over the CPU backend, a modeled device memory traffic
//! against a peak bandwidth, and a digest of the read runs and counters
//! (which must be equal across backends).
//!
//! ```text
//! cargo run --release --features cuda --example bench_cuda -- \
//!     [--touches 1e9] [--capacity 4194304] [--batch 65536] [--backends cpu,cuda] [--peak-gbs 4300]
//!     [--scan-chunk 32] [--radix-chunk 512] [--max-touches 33554432]
//! ```
//!
//! The workload: requests write page-aligned extents (16..512 slots), read
//! them back (mostly their own, some of another request's: foreign runs),
//! share and scrub some; one batch = `--batch` events of one pool.

use std::hash::{Hash, Hasher};
use std::time::Instant;

use kvtrail::lineage::backend::{Backend, Counters, ReadRun};
use kvtrail::lineage::cpu::CpuBackend;
use kvtrail::lineage::gpu::{self, EmuDevice, GpuBackend, GpuConfig};
use kvtrail::schema::{KvEvent, Op};

/// Modeled device traffic of the GPU pipeline per slot touch, in bytes
/// (docs/cuda.md, "Throughput"): expand 24, radix sort 3 passes x 24,
/// last-writer marks and scan 40, classify 48, state update 28, run flags
/// and their scans 80, run scatter 24.
const BYTES_PER_TOUCH: f64 = 316.0;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn workload(touches: u64, capacity: u32, batch: usize) -> Vec<Vec<KvEvent>> {
    let mut rng = Rng(42);
    let mut seq = 0u64;
    let mut total = 0u64;
    let mut out = Vec::new();
    let mut live: Vec<(u64, u32, u32)> = Vec::new(); // (request, start, count)
    let mut next_req = 1u64;
    while total < touches {
        let mut b = Vec::with_capacity(batch);
        while b.len() < batch && total < touches {
            let roll = rng.below(100);
            let (op, rid, start, count) = if roll < 30 || live.is_empty() {
                let count = 16 * (1 + rng.below(32) as u32);
                let start = (rng.below((capacity - count) as u64 / 16) * 16) as u32;
                let rid = next_req;
                next_req += 1;
                if live.len() < 4096 {
                    live.push((rid, start, count));
                } else {
                    let i = rng.below(live.len() as u64) as usize;
                    live[i] = (rid, start, count);
                }
                (Op::Write, rid, start, count)
            } else {
                let (rid, start, count) = live[rng.below(live.len() as u64) as usize];
                if roll < 88 {
                    (Op::Read, rid, start, count)
                } else if roll < 93 {
                    // a read by another request: foreign unless shared
                    (Op::Read, next_req + rng.below(4), start, count)
                } else if roll < 97 {
                    (Op::Share, next_req + rng.below(4), start, count)
                } else {
                    (Op::Scrub, 0, start, count)
                }
            };
            b.push(KvEvent {
                pool: 0,
                seq,
                ts_ns: seq as i64 * 1000,
                op,
                request_id: rid,
                slot_start: start,
                slot_count: count,
                token_pos: None,
                src: None,
            });
            seq += 1;
            total += count as u64;
        }
        out.push(b);
    }
    out
}

struct Measured {
    name: &'static str,
    secs: f64,
    counters: Counters,
    runs: u64,
    digest: u64,
}

fn run(b: &mut dyn Backend, capacity: u32, batches: &[Vec<KvEvent>]) -> kvtrail::Result<Measured> {
    b.add_pool(0, capacity as u64, true)?;
    let mut c = Counters::default();
    let mut out: Vec<ReadRun> = Vec::new();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut runs = 0u64;
    let t = Instant::now();
    for batch in batches {
        b.apply(0, batch, &mut out, &mut c)?;
        runs += out.len() as u64;
        for r in &out {
            (
                r.reader,
                r.slot_start,
                r.count,
                r.kind,
                r.source,
                r.uncertain,
                r.seq,
            )
                .hash(&mut h);
        }
        out.clear();
    }
    let secs = t.elapsed().as_secs_f64();
    format!("{c:?}").hash(&mut h);
    Ok(Measured {
        name: b.name(),
        secs,
        counters: c,
        runs,
        digest: h.finish(),
    })
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let touches = arg(&args, "--touches", "1e9")
        .parse::<f64>()
        .expect("--touches N") as u64;
    let capacity: u32 = arg(&args, "--capacity", "4194304")
        .parse()
        .expect("--capacity N");
    let batch: usize = arg(&args, "--batch", "65536").parse().expect("--batch N");
    let peak: f64 = arg(&args, "--peak-gbs", "4300")
        .parse()
        .expect("--peak-gbs N");
    let backends = arg(&args, "--backends", "cpu,cuda");
    let d = GpuConfig::default();
    let cfg = GpuConfig {
        scan_chunk: arg(&args, "--scan-chunk", &d.scan_chunk.to_string())
            .parse()
            .expect("--scan-chunk N"),
        radix_chunk: arg(&args, "--radix-chunk", &d.radix_chunk.to_string())
            .parse()
            .expect("--radix-chunk N"),
        max_touches: arg(&args, "--max-touches", &d.max_touches.to_string())
            .parse()
            .expect("--max-touches N"),
    };
    let t = Instant::now();
    let batches = workload(touches, capacity, batch);
    let events: usize = batches.iter().map(|b| b.len()).sum();
    eprintln!(
        "workload: {events} events, {touches} slot touches wanted, capacity {capacity}, built in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let mut results = Vec::new();
    for name in backends.split(',') {
        let mut b: Box<dyn Backend> = match name {
            "cpu" => Box::new(CpuBackend::new()),
            "emu" => Box::new(GpuBackend::named(
                EmuDevice::new(),
                GpuConfig::default(),
                "emu",
            )),
            "cuda" => match gpu::unavailable() {
                Some(why) => {
                    eprintln!("cuda: {why}");
                    std::process::exit(2);
                }
                None => open_cuda(cfg),
            },
            other => {
                eprintln!("unknown backend {other} (cpu, cuda, emu)");
                std::process::exit(2);
            }
        };
        match run(b.as_mut(), capacity, &batches) {
            Ok(r) => results.push(r),
            Err(e) => {
                eprintln!("{name}: {e}");
                std::process::exit(2);
            }
        }
    }
    let base = results.first().map(|r| r.secs).unwrap_or(1.0);
    println!(
        "{:<6} {:>12} {:>14} {:>9} {:>12} {:>14} {:>9} {:>10} {:>9} {:>18}",
        "backend",
        "events",
        "slot_touches",
        "seconds",
        "events/s",
        "touches/s",
        "speedup",
        "model_GB/s",
        "of_peak",
        "runs_digest"
    );
    let mut same = true;
    for r in &results {
        let ts = r.counters.slot_touches as f64 / r.secs;
        let gbs = ts * BYTES_PER_TOUCH / 1e9;
        same &= r.digest == results[0].digest;
        let digest = format!("{:016x}/{}", r.digest, r.runs);
        println!(
            "{:<6} {:>12} {:>14} {:>9.3} {:>12.3e} {:>14.3e} {:>8.1}x {:>10.0} {:>8.1}% {:>18}",
            r.name,
            r.counters.events,
            r.counters.slot_touches,
            r.secs,
            r.counters.events as f64 / r.secs,
            ts,
            base / r.secs,
            gbs,
            100.0 * gbs / peak,
            digest,
        );
    }
    println!(
        "parity: {}",
        if same {
            "identical runs and counters"
        } else {
            "MISMATCH"
        }
    );
    if !same {
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(cfg: GpuConfig) -> Box<dyn Backend> {
    match gpu::open_cuda_with(cfg) {
        Ok(b) => {
            eprintln!("cuda: {}", b.device().description);
            Box::new(b)
        }
        Err(e) => {
            eprintln!("cuda: {e}");
            std::process::exit(2);
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_: GpuConfig) -> Box<dyn Backend> {
    eprintln!("cuda: this bench was built without the `cuda` feature");
    std::process::exit(2);
}
