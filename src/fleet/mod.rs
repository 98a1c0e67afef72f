//! `kvtrail fleet`: native scope fanned out by pool, as a library the CLI
//! only parses for and prints from.
//!
//! - `plan`: the shards of a trace (`lineage::shard::plan_shards`: pools a
//!   shard reports, pools it replays, events) and the plan file the Spark
//!   job reads.
//! - `submit`: spark-submit of the PySpark job fleet/spark_scope.py (built
//!   in), this binary shipped to the executors, stopped on SIGTERM/SIGINT.
//! - `task`: the executor's side (`fleet task`, hidden): one child `scope
//!   --pools` per shard line, its result as JSON lines.
//! - `collect`: the job's result file read back, failed or missing shards
//!   refused, a failed shard's error taken from its JSON error line
//!   (`error_line`), never from its human text.
//! - `view`: the merge-validity rule (`TraceView`): the shards must have
//!   read the trace the driver planned from.
//! - `spark`: `fleet spark` end to end: plan here, the job, then the merge
//!   (`scope::merge`) into one scope folder. The shard folders and the
//!   merged folder are each put in place whole (`report::writer::
//!   write_atomically`): on any failure neither is left (docs/fleet.md).
//! - `place`: the one place fleet asks whether a trace is local or remote.
//!
//! Nothing here prints: what a person should see comes back as values
//! (`FleetError::shown` for the lines to show before an error).

pub mod collect;
pub mod error_line;
pub mod place;
pub mod plan;
pub mod spark;
pub mod submit;
pub mod task;
pub mod view;

/// The line break before an error's hint, in every kvtrail message.
pub const HINT: &str = "\n  hint: ";

/// A failure of fleet's own, with what to do, and the lines a person
/// should see first (the end of Spark's log, a failed shard's stderr).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub what: String,
    pub hint: String,
    pub shown: Vec<String>,
}

/// What fleet's functions fail with.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Kvtrail(#[from] crate::error::Error),
    #[error("{}{HINT}{}", .0.what, .0.hint)]
    Failed(Failure),
}

impl FleetError {
    /// A failure with its hint and nothing to show first.
    pub fn failed(what: impl Into<String>, hint: impl Into<String>) -> Self {
        FleetError::Failed(Failure {
            what: what.into(),
            hint: hint.into(),
            shown: Vec::new(),
        })
    }

    /// The lines to show before the error (each without the `kvtrail: `
    /// prefix a printer puts before it).
    pub fn shown(&self) -> &[String] {
        match self {
            FleetError::Failed(f) => &f.shown,
            FleetError::Kvtrail(_) => &[],
        }
    }
}

impl From<std::io::Error> for FleetError {
    fn from(e: std::io::Error) -> Self {
        FleetError::Kvtrail(crate::error::Error::Other(e.to_string()))
    }
}

pub type Result<T, E = FleetError> = std::result::Result<T, E>;

/// Pool ids as `scope --pools` takes them: `0,1,4`.
pub fn pools_list(p: &[u16]) -> String {
    p.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}
