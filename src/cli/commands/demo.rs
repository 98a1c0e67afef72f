//! `kvtrail demo`: the README's "run the main job": scope on the built-in
//! `traces/incident-mini` trace, human summary on stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::scope::{BackendArg, compute};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Replay backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
}

/// Where the built-in trace lives: under the source tree the binary was
/// built from, else under the current directory.
fn builtin_trace() -> Option<PathBuf> {
    let rel = Path::new("traces").join("incident-mini");
    [Path::new(env!("CARGO_MANIFEST_DIR")).join(&rel), rel]
        .into_iter()
        .find(|p| p.join("trace.json").is_file())
}

/// Creates `traces/incident-mini` with the simulator when it is absent.
/// The simulator (`kvtrail::sim`) is not part of this build yet, so this
/// says so instead of guessing.
fn simulate_incident_mini() -> anyhow::Result<PathBuf> {
    anyhow::bail!(
        "the built-in trace traces/incident-mini is missing and this build has no simulator to create it; \
         run from the kvtrail source tree (or `kvtrail scope TRACE` on a trace of your own)"
    )
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let dir = match builtin_trace() {
        Some(d) => d,
        None => simulate_incident_mini()?,
    };
    eprintln!("kvtrail demo: scope {}", dir.display());
    let r = compute(&dir, args.backend)?;
    let mut out = std::io::stdout().lock();
    out.write_all(kvtrail::report::human(&r).as_bytes())?;
    out.flush()?;
    Ok(0)
}
