//! `kvtrail demo`: the README's "run the main job": scope on the built-in
//! `traces/incident-mini` trace, human summary on stdout.

use std::path::{Path, PathBuf};

use super::scope::compute;
use crate::cli::output;
use kvtrail::lineage::BackendChoice;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Replay backend.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
}

/// Where the built-in trace lives: under the source tree the binary was
/// built from, else under the current directory.
fn builtin_trace() -> Option<PathBuf> {
    let rel = Path::new("traces").join("incident-mini");
    [Path::new(env!("CARGO_MANIFEST_DIR")).join(&rel), rel]
        .into_iter()
        .find(|p| p.join("trace.json").is_file())
}

/// Creates the incident-mini trace with the simulator when the built-in
/// one is absent (a binary installed away from its source tree): the same
/// scenario, size and seed as traces/README.md, so the result is
/// byte-identical to the shipped trace. It goes under the user's cache
/// directory and is reused by later runs.
fn simulate_incident_mini() -> anyhow::Result<PathBuf> {
    use kvtrail::sim::{self, RunLabel, scenario};
    let base = std::env::var_os("KVTRAIL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("kvtrail")))
        .or_else(|| {
            std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache").join("kvtrail"))
        })
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("incident-mini-{}", env!("CARGO_PKG_VERSION")));
    if dir.join("trace.json").is_file() {
        return Ok(dir);
    }
    eprintln!(
        "kvtrail demo: traces/incident-mini not found; simulating it into {}",
        dir.display()
    );
    let mut sc = scenario::scenario("incident", Some(3000), 1)?;
    sc.fit_workload();
    let label = RunLabel {
        scenario: sc.name.clone(),
        seed: 1,
    };
    // Simulated into a temporary sibling, put in place when complete.
    let made = kvtrail::report::writer::write_atomically(&dir, |tmp| {
        sim::run(
            &sc.config,
            sim::workload::Generator::new(sc.workload.clone()),
            tmp,
            &label,
            &crate::cli::progress::BarReporter::default(),
        )
    });
    match made {
        Ok(_) => {}
        // Another demo finished first: use its trace.
        Err(_) if dir.join("trace.json").is_file() => {}
        Err(e) => return Err(e.into()),
    }
    Ok(dir)
}

/// Where the demo trace is: the built-in one, or a simulated copy.
fn demo_trace() -> anyhow::Result<PathBuf> {
    match std::env::var_os("KVTRAIL_DEMO_SIMULATE") {
        // Lets tests exercise the fallback from inside the source tree.
        Some(_) => simulate_incident_mini(),
        None => match builtin_trace() {
            Some(d) => Ok(d),
            None => simulate_incident_mini(),
        },
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let dir = demo_trace()?;
    eprintln!("kvtrail demo: scope {}", dir.display());
    let r = compute(&dir, args.backend)?;
    output::print_human(|out| out.write_all(kvtrail::report::human(&r).as_bytes()))?;
    Ok(0)
}
