//! The fuzz targets' kept inputs, replayed without the fuzzer on stable:
//! every file under `fuzz/regressions/<target>/` (a crash the fuzzer found,
//! kept after its fix, named after the defect) and the seed corpus
//! `fuzz/corpus/<target>/` go through the same entry points as the libFuzzer
//! binaries (`fuzz/targets.rs`). Crashes found in code that is not fixed yet
//! wait in `fuzz/pending/`, which this test does not run (docs/fuzzing.md).

#[path = "../../fuzz/targets.rs"]
mod targets;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

/// Runs every file of `fuzz/<folder>/<target>/`; returns the failures and
/// the number of cases run.
fn replay(folder: &str) -> (Vec<String>, usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(folder);
    let mut failures = Vec::new();
    let mut n = 0;
    for t in targets::TARGETS {
        let dir = root.join(t);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files.into_iter().filter(|f| f.is_file()) {
            if f.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            {
                continue;
            }
            let data = std::fs::read(&f).unwrap();
            n += 1;
            if catch_unwind(AssertUnwindSafe(|| targets::run(t, &data))).is_err() {
                failures.push(format!("{t}: {}", f.display()));
            }
        }
    }
    (failures, n)
}

#[test]
fn fuzz_regression_cases_replay_without_a_panic() {
    let (failures, _) = replay("regressions");
    assert!(
        failures.is_empty(),
        "kept fuzz cases panic:\n{}",
        failures.join("\n")
    );
}

#[test]
fn fuzz_seed_corpus_replays_without_a_panic() {
    let (failures, n) = replay("corpus");
    assert!(
        n >= targets::TARGETS.len(),
        "seed corpus missing ({n} files)"
    );
    assert!(
        failures.is_empty(),
        "seed inputs panic:\n{}",
        failures.join("\n")
    );
}

/// The trace target's framing splits what `join_trace` joined, and refuses
/// names that would leave the trace directory.
#[test]
fn fuzz_trace_framing_round_trips_and_confines_names() {
    let files = vec![
        ("trace.json".to_string(), b"{}".to_vec()),
        ("kv/pool=0/part-00000.parquet".to_string(), vec![1, 2, 3]),
    ];
    assert_eq!(targets::split_trace(&targets::join_trace(&files)), files);
    for bad in [
        "../x",
        "kv/../../x",
        "/etc/passwd",
        "kv//a",
        "other/a",
        "kv/a b",
    ] {
        let f = vec![(bad.to_string(), vec![0])];
        assert!(
            targets::split_trace(&targets::join_trace(&f)).is_empty(),
            "{bad}"
        );
    }
}
