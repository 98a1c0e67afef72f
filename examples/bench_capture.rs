//! Benchmark of the capture and read paths (not a timed test).
//!
//! `cargo run --release --example bench_capture [-- EVENTS [record-only]]`
//!
//! 1. Recorder throughput: events/s and ns/event on one core, including
//!    Arrow conversion, zstd Parquet encoding, hashing and close.
//! 2. Read throughput of `Trace::kv_chunks` (every row decoded into checked
//!    `KvEvent`s) against a plain Parquet scan of the same files in the same
//!    run (ParquetRecordBatchReader, all columns, summing `slot_count`).
//!
//! Targets: recording < 200 ns/event; reading within 1.5x of the scan.

use std::fs::File;
use std::hint::black_box;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op};
use kvtrail::trace::read::READ_BATCH_ROWS;
use kvtrail::trace::{Deployment, Pool, Role, Trace};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

fn deployment() -> Deployment {
    let pool = |id: u16, role| Pool {
        id,
        name: format!("pool-{id}"),
        role,
        capacity_tokens: 1 << 21,
        page_size: 64,
        extra: Default::default(),
    };
    Deployment {
        name: "bench".into(),
        engine: "bench".into(),
        context_window: 1 << 20,
        pools: vec![pool(0, Role::Prefill), pool(1, Role::Decode)],
        extra: Default::default(),
    }
}

/// A deterministic event mix shaped like a PD-disaggregated engine.
fn events(n: usize) -> Vec<KvEvent> {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(n);
    let mut seqs = [0u64; 2];
    for i in 0..n {
        let r = next();
        let pool = (r & 1) as u16;
        let op = match (r >> 1) % 10 {
            0 => Op::Alloc,
            1 | 2 => Op::Write,
            3..=7 => Op::Read,
            8 => Op::Free,
            _ => Op::Share,
        };
        let count = 1 + ((r >> 8) % 64) as u32;
        let start = ((r >> 16) % ((1 << 21) - 64)) as u32;
        let src = (pool == 1 && op == Op::Write && (r >> 40) & 1 == 1).then(|| CopySrc {
            pool: 0,
            slot_start: start,
            seq: seqs[0].saturating_sub(1),
        });
        seqs[pool as usize] += 1;
        out.push(KvEvent {
            pool,
            seq: 0,
            ts_ns: 1_700_000_000_000_000_000 + i as i64 * 1000,
            request_id: 1 + (r >> 24) % 100_000,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: matches!(op, Op::Write | Op::Read | Op::Share)
                .then_some((r >> 48) as u32 % 100_000),
            src,
        });
    }
    out
}

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(5_000_000);
    let evs = events(n);
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("trace");

    // 1. Recording.
    let opts = RecorderOptions {
        started_ns: Some(evs[0].ts_ns),
        row_group_rows: std::env::var("BENCH_ROW_GROUP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(RecorderOptions::default().row_group_rows),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut rec = Recorder::create(&dir, deployment(), opts)?;
    for ev in &evs {
        rec.kv(*ev)?;
    }
    let manifest = rec.close()?;
    let rec_s = t0.elapsed().as_secs_f64();
    let bytes: u64 = manifest
        .files
        .iter()
        .flatten()
        .map(|f| {
            std::fs::metadata(dir.join(&f.path))
                .map(|m| m.len())
                .unwrap_or(0)
        })
        .sum();
    println!(
        "record      {n} events in {rec_s:.3} s: {:.1} M events/s, {:.1} ns/event (target < 200), {:.1} bytes/event on disk",
        n as f64 / rec_s / 1e6,
        rec_s * 1e9 / n as f64,
        bytes as f64 / n as f64
    );

    if std::env::args().nth(2).as_deref() == Some("record-only") {
        return Ok(()); // for profiling the capture path alone
    }

    // 2. Reading: best of 3 for each, interleaved, same files.
    let trace = Trace::open(&dir)?;
    let mut best_scan = f64::MAX;
    let mut best_read = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let mut rows = 0u64;
        let mut sum = 0u64;
        for f in &trace.kv_files {
            let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(f)?)?
                .with_batch_size(READ_BATCH_ROWS)
                .build()?;
            for b in reader {
                let b = b?;
                rows += b.num_rows() as u64;
                let c = b.column_by_name("slot_count").expect("slot_count");
                sum += c
                    .as_primitive::<UInt32Type>()
                    .values()
                    .iter()
                    .map(|&v| v as u64)
                    .sum::<u64>();
            }
        }
        black_box(sum);
        assert_eq!(rows, n as u64);
        best_scan = best_scan.min(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut rows = 0u64;
        let mut sum = 0u64;
        for chunk in trace.kv_chunks() {
            let chunk = chunk?;
            rows += chunk.events.len() as u64;
            sum += chunk
                .events
                .iter()
                .map(|e| e.slot_count as u64)
                .sum::<u64>();
        }
        black_box(sum);
        assert_eq!(rows, n as u64);
        best_read = best_read.min(t.elapsed().as_secs_f64());
    }
    println!(
        "plain scan  {:.1} M events/s ({:.1} ns/event)",
        n as f64 / best_scan / 1e6,
        best_scan * 1e9 / n as f64
    );
    println!(
        "kv_chunks   {:.1} M events/s ({:.1} ns/event)",
        n as f64 / best_read / 1e6,
        best_read * 1e9 / n as f64
    );
    println!(
        "ratio       kv_chunks / plain scan = {:.2}x (target <= 1.5x)",
        best_read / best_scan
    );
    Ok(())
}
