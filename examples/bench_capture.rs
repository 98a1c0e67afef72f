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
//!
//! Every figure is given twice: wall-clock, and CPU time of the measuring
//! thread (CLOCK_THREAD_CPUTIME_ID), which is what "on one core" means and
//! stays meaningful on a shared, loaded machine. Ratios use CPU time.

use std::fs::File;
use std::hint::black_box;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op};
use kvtrail::trace::read::READ_BATCH_ROWS;
use kvtrail::trace::write::PartOptions;
use kvtrail::trace::{Deployment, Pool, Role, Trace};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// CPU time of the calling thread, in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// User and system CPU seconds of the calling thread.
fn thread_rusage() -> (f64, f64) {
    // SAFETY: getrusage fills the struct we own; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    assert_eq!(rc, 0, "getrusage(RUSAGE_THREAD)");
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (s(ru.ru_utime), s(ru.ru_stime))
}

/// Wall and thread-CPU seconds of `f`.
fn timed<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(T, f64, f64)> {
    let (w, c) = (Instant::now(), thread_cpu_s());
    let out = f()?;
    Ok((out, w.elapsed().as_secs_f64(), thread_cpu_s() - c))
}

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
        prefix_cache_scope: None,
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
        part: PartOptions {
            zstd_level: std::env::var("BENCH_ZSTD_LEVEL")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(PartOptions::default().zstd_level),
            ..PartOptions::default()
        },
        ..Default::default()
    };
    let ru0 = thread_rusage();
    let (manifest, rec_wall, rec_cpu) = timed(|| {
        let mut rec = Recorder::create(&dir, deployment(), opts)?;
        for ev in &evs {
            rec.kv(*ev)?;
        }
        Ok(rec.close()?)
    })?;
    let ru1 = thread_rusage();
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
    let per = |s: f64| s * 1e9 / n as f64;
    println!(
        "record      {n} events: {:.1} ns/event CPU ({:.1} user + {:.1} system), {:.2} M events/s; {:.1} ns/event wall; target < 200 ns; {:.1} bytes/event on disk",
        per(rec_cpu),
        per(ru1.0 - ru0.0),
        per(ru1.1 - ru0.1),
        n as f64 / rec_cpu / 1e6,
        per(rec_wall),
        bytes as f64 / n as f64
    );

    if std::env::args().nth(2).as_deref() == Some("record-only") {
        return Ok(()); // for profiling the capture path alone
    }

    // 2. Reading: best of 3 for each, interleaved, same files.
    let trace = Trace::open(&dir)?;
    let (mut scan, mut read) = ((f64::MAX, f64::MAX), (f64::MAX, f64::MAX));
    for _ in 0..3 {
        let ((), w, c) = timed(|| {
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
            anyhow::ensure!(rows == n as u64, "scan read {rows} rows");
            Ok(())
        })?;
        scan = (scan.0.min(w), scan.1.min(c));
        let ((), w, c) = timed(|| {
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
            anyhow::ensure!(rows == n as u64, "kv_chunks read {rows} rows");
            Ok(())
        })?;
        read = (read.0.min(w), read.1.min(c));
    }
    let rate = |s: f64| n as f64 / s / 1e6;
    println!(
        "plain scan  {:.1} M events/s CPU ({:.1} ns/event), {:.1} M events/s wall",
        rate(scan.1),
        per(scan.1),
        rate(scan.0)
    );
    println!(
        "kv_chunks   {:.1} M events/s CPU ({:.1} ns/event), {:.1} M events/s wall",
        rate(read.1),
        per(read.1),
        rate(read.0)
    );
    println!(
        "ratio       kv_chunks / plain scan = {:.2}x CPU, {:.2}x wall (target <= 1.5x)",
        read.1 / scan.1,
        read.0 / scan.0
    );
    Ok(())
}
