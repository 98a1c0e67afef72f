//! Simulator benchmark: simulated requests/s and captured kv events/s at
//! 100k+ requests, and peak RSS (VmHWM) at two sizes, to show memory stays
//! flat as the request count grows. Ratios are against a baseline run of
//! the same scenario, in the same process.
//!
//! cargo run --release --example bench_sim [-- REQUESTS]   (default 100000)

use std::time::Instant;

use kvtrail::progress::NoReporter;
use kvtrail::sim::{self, RunLabel, scenario};

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Process CPU seconds (user + system) from /proc/self/stat (USER_HZ 100):
/// the machine may be shared, so wall time alone misleads.
fn cpu_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

struct Sample {
    requests: u64,
    events: u64,
    secs: f64,
    cpu: f64,
    hwm_kib: u64,
    bytes: u64,
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        n += if m.is_dir() {
            dir_bytes(&e.path())
        } else {
            m.len()
        };
    }
    n
}

fn run(requests: u64) -> Sample {
    let sc = scenario::scenario("steady", Some(requests), 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("t");
    let t = Instant::now();
    let c0 = cpu_secs();
    let out = sim::run(
        &sc.config,
        sim::workload::Generator::new(sc.workload.clone()),
        &out_dir,
        &RunLabel {
            scenario: sc.name.clone(),
            seed: 1,
        },
        &NoReporter,
    )
    .unwrap();
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_secs() - c0;
    Sample {
        requests: out.stats.requests,
        events: out.stats.kv_events,
        secs,
        cpu,
        hwm_kib: vm_hwm_kib(),
        bytes: dir_bytes(&out_dir),
    }
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let sizes = [n / 4, n, 2 * n];
    println!("scenario steady, seed 1; baseline = {} requests", sizes[0]);
    println!(
        "{:>9} {:>11} {:>8} {:>8} {:>10} {:>12} {:>9} {:>9} {:>8}",
        "requests",
        "kv events",
        "wall s",
        "cpu s",
        "req/cpu-s",
        "events/cpu-s",
        "trace MB",
        "VmHWM MB",
        "vs base"
    );
    let mut base: Option<Sample> = None;
    for &size in &sizes {
        let s = run(size);
        let rps = s.requests as f64 / s.cpu;
        let eps = s.events as f64 / s.cpu;
        let ratio = base
            .as_ref()
            .map(|b| rps / (b.requests as f64 / b.cpu))
            .unwrap_or(1.0);
        println!(
            "{:>9} {:>11} {:>8.2} {:>8.2} {:>10.0} {:>12.0} {:>9.1} {:>9.1} {:>7.2}x",
            s.requests,
            s.events,
            s.secs,
            s.cpu,
            rps,
            eps,
            s.bytes as f64 / 1e6,
            s.hwm_kib as f64 / 1024.0,
            ratio
        );
        if base.is_none() {
            base = Some(s);
        }
    }
    println!(
        "(vs base: requests per CPU-second relative to the baseline run; VmHWM is the process peak so far: flat means memory does not grow with requests)"
    );
}
