//! The what-if replay in-process: replay a trace under an engine and
//! `--set` overrides.

use std::path::Path;

use kvtrail::progress::NoReporter;
use kvtrail::trace::Trace;
use kvtrail::whatif::{self, ReplaySpec};

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
