//! Helpers shared by the integration tests.

pub mod cli;
pub mod files;
pub mod keys;
pub mod objstore;
pub mod record;
pub mod reference;
pub mod reseal;
pub mod sim;
pub mod small_trace;
pub mod trace_builder;
pub mod venv;
pub mod whatif;

use proptest::test_runner::{FailurePersistence, FileFailurePersistence};

/// Where a property test keeps the seeds of its past failures (replayed
/// first on every run): `<source file>.proptest-regressions` beside the
/// test's source. (proptest's default would look under a
/// `proptest-regressions` folder next to this binary's main.rs.)
pub fn regressions_beside_source() -> Option<Box<dyn FailurePersistence>> {
    Some(Box::new(FileFailurePersistence::WithSource(
        "proptest-regressions",
    )))
}

/// Whether the golden copies under tests/data are to be rewritten from
/// this run's outputs (`KVTRAIL_UPDATE_GOLDEN=1`, after a deliberate
/// change) instead of compared with them.
pub fn updating_goldens() -> bool {
    std::env::var_os("KVTRAIL_UPDATE_GOLDEN").is_some()
}

/// Runs test `path` of this binary (`module::name`) again, alone, in a
/// child process with `key=value` in its environment from the start, and
/// fails unless it ran and passed. For a test that needs an environment
/// variable that a process-wide loader reads once.
pub fn rerun_with_env(path: &str, key: &str, value: &str) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(&exe)
        .args([path, "--exact", "--test-threads=1", "--nocapture"])
        .env(key, value)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{path} with {key}={value} in a child process:\n{stdout}\n{stderr}"
    );
}
