//! What checking the evidence costs scope: `scope::trace_evidence` (blake3
//! of every listed data file, the footer of each for its row count, the
//! listing) against a whole `scope` run (replay, requests, coverage, which
//! includes that check), on the same trace in the same process, as a ratio
//! of process CPU time (all threads) and of wall time. Each is the median
//! of `REPS` runs (default 5), after one warm-up run that fills the page
//! cache.
//!
//! Run: `cargo run --release --example bench_evidence -- TRACE_DIR... [--reps N]`
//! (e.g. traces/incident-mini and a trace from `kvtrail simulate`).

use std::path::PathBuf;
use std::time::Instant;

use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::trace::Trace;

fn cpu_s() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Median (cpu, wall) seconds of `reps` runs of `f`.
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut cpu = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..reps {
        let (c0, w0) = (cpu_s(), Instant::now());
        f();
        cpu.push(cpu_s() - c0);
        wall.push(w0.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (med(&mut cpu), med(&mut wall))
}

fn main() {
    let mut dirs = Vec::new();
    let mut reps = 5;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--reps" {
            reps = args.next().and_then(|n| n.parse().ok()).expect("--reps N");
        } else {
            dirs.push(PathBuf::from(a));
        }
    }
    assert!(!dirs.is_empty(), "give one or more trace directories");
    println!(
        "trace\tbytes\tkv_events\tevidence_cpu_s\tscope_cpu_s\tcpu_ratio\tevidence_wall_s\tscope_wall_s\twall_ratio"
    );
    for d in dirs {
        let trace = Trace::open(&d).expect("trace");
        let bytes: u64 = trace
            .request_files
            .iter()
            .chain(&trace.kv_files)
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .sum();
        let mut events = 0;
        let ev = time(reps, || {
            let c = kvtrail::scope::trace_evidence(&trace, &NoReporter).expect("evidence");
            assert!(c.files_modified.is_empty() && c.files_rows_differ.is_empty());
        });
        let sc = time(reps, || {
            let r = kvtrail::scope::scope(&trace, &LineageOptions::default(), &NoReporter)
                .expect("scope");
            events = r.counts.kv_events;
        });
        println!(
            "{}\t{bytes}\t{events}\t{:.4}\t{:.4}\t{:.3}\t{:.4}\t{:.4}\t{:.3}",
            d.display(),
            ev.0,
            sc.0,
            ev.0 / sc.0,
            ev.1,
            sc.1,
            ev.1 / sc.1
        );
    }
}
