//! Shared helpers of the what-if tests: simulate a scenario into a
//! temporary trace, replay it under a spec, run the CLI.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kvtrail::progress::NoReporter;
use kvtrail::sim::{self, RunLabel, Truth, scenario};
use kvtrail::trace::Trace;
use kvtrail::whatif::{self, ReplaySpec};

pub struct Sim {
    pub dir: tempfile::TempDir,
    pub trace: PathBuf,
    pub truth: Truth,
}

/// Runs scenario `name` (small: `requests`) with `sets` applied.
pub fn simulate(name: &str, requests: u64, sets: &[&str]) -> Sim {
    let mut sc = scenario::scenario(name, Some(requests), 1).unwrap();
    for s in sets {
        sc.config.set(s).unwrap();
    }
    sc.fit_workload();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("orig");
    let out = sim::run(
        &sc.config,
        sim::workload::Generator::new(sc.workload.clone()),
        &trace,
        &RunLabel {
            scenario: name.into(),
            seed: 1,
        },
        &NoReporter,
    )
    .unwrap();
    Sim {
        dir,
        trace,
        truth: out.truth,
    }
}

/// Replays `trace` under engine/sets into `out`.
pub fn replay(trace: &Path, engine: Option<&str>, sets: &[&str], out: &Path) -> whatif::ReplayRun {
    let t = Trace::open(trace).unwrap();
    let spec = ReplaySpec {
        config: None,
        engine: engine.map(String::from),
        sets: sets.iter().map(|s| s.to_string()).collect(),
    };
    whatif::replay_trace(&t, &spec, out, &NoReporter).unwrap()
}

/// Every file under a trace, with its bytes, sorted by path.
pub fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// Runs the kvtrail binary: (exit code, stdout, stderr).
pub fn cli(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kvtrail"))
        .args(args)
        .env("KVTRAIL_NO_PROGRESS", "1")
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}
