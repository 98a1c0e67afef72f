//! One scope run as `kvtrail scope` (and `demo`) does it: a trace and a
//! backend choice in, the lineage replayed over every pool or over a shard
//! of them (`--pools`), and the report out, with the shard's `ShardInfo`
//! (shard.json) and the shard marking of its report (`ShardInfo::mark`).
//!
//! Two steps, `ScopeRun::open` then `ScopeRun::run`, so that the caller can
//! tell the user which backend was opened before the replay starts: the
//! library never prints. How shards are combined is `merge`'s.

use std::path::Path;

use super::model::ScopeReport;
use super::shard::ShardInfo;
use crate::error::Result;
use crate::lineage::{BackendChoice, BackendConfig, LineageOptions, OpenedBackend};
use crate::progress::Reporter;
use crate::trace::read::Trace;

/// A trace opened with its replay backend, ready to run.
pub struct ScopeRun {
    trace: Trace,
    /// The backend choice and the run's threads (resolved: at least 1).
    config: BackendConfig,
    opened: OpenedBackend,
}

/// What a scope run gives: the trace it read, its report and, for a shard,
/// its shard.json.
pub struct Scoped {
    pub trace: Trace,
    pub report: ScopeReport,
    pub shard: Option<ShardInfo>,
}

impl ScopeRun {
    /// Opens the trace and the backend `choice` asks for (`Cuda` fails
    /// with what is missing), the CPU one on every core.
    pub fn open(trace_dir: &Path, choice: BackendChoice) -> Result<Self> {
        Self::open_with(trace_dir, BackendConfig::new(choice, 0))
    }

    /// As `open`, with the backend and threads `config` resolved (the
    /// report does not depend on the threads).
    pub fn open_with(trace_dir: &Path, config: BackendConfig) -> Result<Self> {
        let trace = Trace::open(trace_dir)?;
        let opened = config.open(&trace)?;
        Ok(ScopeRun {
            trace,
            config,
            opened,
        })
    }

    /// Which backend runs, and why (e.g. CPU because no GPU was found).
    pub fn backend_note(&self) -> &str {
        &self.opened.note
    }

    /// Replays the trace and scopes it: every pool, or only `pools` (the
    /// pools their copies read from are replayed but not reported); a
    /// shard's report is marked as one. The parallel steps besides the
    /// replay (the index pass over the kv files, the file digests) run on
    /// the run's threads too; with more than one, the requests table is
    /// read beside the replay (`replay_and_scope`).
    pub fn run(mut self, pools: Option<Vec<u16>>, reporter: &dyn Reporter) -> Result<Scoped> {
        let opts = LineageOptions {
            backend: self.config.choice,
            spill_dir: None,
            chunk: None,
            pools: pools.clone(),
            tenants: Some(super::tenant_source(&self.trace)),
            threads: self.config.threads,
            pool_threads: None,
        };
        let (trace, backend) = (&self.trace, self.opened.backend.as_mut());
        let (outcome, mut report) =
            super::replay_and_scope(trace, self.config.threads, reporter, || {
                crate::lineage::run_with(trace, backend, &opts, reporter)
            })?;
        let shard = pools.map(|p| ShardInfo::from_outcome(&p, &outcome));
        if let Some(s) = &shard {
            s.mark(&mut report);
        }
        Ok(Scoped {
            trace: self.trace,
            report,
            shard,
        })
    }
}
