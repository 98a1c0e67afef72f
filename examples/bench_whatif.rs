//! What-if replay benchmark: replay speed in requests/s against the plain
//! simulator on the same workload, in the same process. Steps timed:
//! simulate (baseline: generator -> engine model -> trace), replay under
//! the recorded config (workload extraction from the trace, engine model
//! and capture), replay under sglang-0.5.22, diff (scope on both traces),
//! counterfactual (scope + model lineage + reference model) and audit.
//! Process CPU time is printed next to wall time (shared machines).
//!
//! cargo run --release --example bench_whatif [-- REQUESTS]   (default 20000)

use std::time::Instant;

use kvtrail::audit;
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::sim::{self, RunLabel, scenario};
use kvtrail::trace::Trace;
use kvtrail::whatif::{self, ReplaySpec, counterfactual, diff};

fn cpu_secs() -> f64 {
    // utime + stime of this process, in clock ticks (100 Hz on Linux).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_string();
            let f: Vec<&str> = rest.split_whitespace().collect();
            let u: f64 = f.get(11)?.parse().ok()?;
            let st: f64 = f.get(12)?.parse().ok()?;
            Some((u + st) / 100.0)
        })
        .unwrap_or(0.0)
}

fn timed<T>(what: &str, n: u64, base: Option<f64>, f: impl FnOnce() -> T) -> (T, f64) {
    let (w0, c0) = (Instant::now(), cpu_secs());
    let out = f();
    let (w, c) = (w0.elapsed().as_secs_f64(), cpu_secs() - c0);
    let ratio = base
        .map(|b| format!("  {:.2}x the simulator's time", w / b))
        .unwrap_or_default();
    println!(
        "{what:<34} {w:>7.2} s wall {c:>7.2} s cpu {:>10.0} requests/s{ratio}",
        n as f64 / w
    );
    (out, w)
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let sc = scenario::scenario("incident", Some(n), 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let orig = dir.path().join("orig");
    println!("incident scenario, {n} requests");
    let (_, base) = timed("simulate (baseline)", n, None, || {
        sim::run(
            &sc.config,
            sim::workload::Generator::new(sc.workload.clone()),
            &orig,
            &RunLabel {
                scenario: "incident".into(),
                seed: 1,
            },
            &NoReporter,
        )
        .unwrap()
    });
    let trace = Trace::open(&orig).unwrap();
    let replay = |engine: Option<&str>, name: &str| {
        let spec = ReplaySpec {
            config: None,
            engine: engine.map(String::from),
            sets: vec![],
        };
        whatif::replay_trace(&trace, &spec, &dir.path().join(name), &NoReporter).unwrap()
    };
    timed("replay, recorded config", n, Some(base), || {
        replay(None, "same")
    });
    let (extract, _) = timed("  of which: workload extraction", n, Some(base), || {
        whatif::workload::extract(&trace).unwrap()
    });
    let _ = extract;
    timed("replay, sglang-0.5.22", n, Some(base), || {
        replay(Some("sglang-0.5.22"), "fix")
    });
    let fix = Trace::open(&dir.path().join("fix")).unwrap();
    let opts = LineageOptions::default();
    timed("diff (scope on both traces)", n, Some(base), || {
        diff::diff(&trace, &fix, &opts, &NoReporter).unwrap()
    });
    let (cf, _) = timed("counterfactual", n, Some(base), || {
        counterfactual::counterfactual(&trace, &counterfactual::CpuModel, &opts, &NoReporter)
            .unwrap()
    });
    println!(
        "  counterfactual: {} affected, fidelity ok {}, outputs changed {}",
        cf.affected_responses, cf.fidelity_ok, cf.outputs_changed
    );
    timed("audit (deployment + trace)", n, Some(base), || {
        audit::audit_trace(&trace, &opts, &NoReporter).unwrap()
    });
}
