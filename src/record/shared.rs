//! What the sidecar's threads share: the configuration, the counters, the
//! pool claims and the queue to the writer ([`Shared`]), the batches on
//! that queue, and where log lines go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::config::RecordConfig;
use super::stats::{Stats, StatsSnapshot};
use super::wire;
use crate::trace::manifest::Deployment;

/// Where the sidecar's log lines go (the CLI prints them to stderr).
pub trait RecordLog: Send + Sync {
    fn log(&self, line: &str);
}

/// Discards log lines.
pub struct NoLog;
impl RecordLog for NoLog {
    fn log(&self, _: &str) {}
}

/// Which side of a PD request a connection reports (from its pools' roles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    Prefill,
    Decode,
    Full,
}

/// Messages from one connection, in order.
pub(crate) struct Batch {
    pub conn: u64,
    /// The connection's view, carried with each batch (so nothing per
    /// connection outlives it in a shared table).
    pub view: View,
    pub msgs: Vec<wire::Msg>,
}

pub(crate) struct Shared {
    pub cfg: RecordConfig,
    pub deployment: Deployment,
    pub stop: AtomicBool,
    /// When the stop came (set before `stop`).
    pub stop_at: OnceLock<Instant>,
    /// The writer ended with an error (logged when it happened).
    pub writer_failed: AtomicBool,
    pub stats: Arc<Stats>,
    /// pool -> the live connection holding it.
    pub claims: Mutex<HashMap<u16, String>>,
    pub tx: SyncSender<Batch>,
    pub log: Arc<dyn RecordLog>,
}

impl Shared {
    pub fn log(&self, line: &str) {
        self.log.log(line);
    }
    /// Whether the stop came more than `shutdown_grace` ago: connections
    /// still open are cut.
    pub fn past_grace(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
            && self
                .stop_at
                .get()
                .is_some_and(|t| t.elapsed() >= self.cfg.shutdown_grace)
    }
}

/// What a finished capture did.
#[derive(Debug, Clone)]
pub struct RecordSummary {
    pub stats: StatsSnapshot,
    pub complete: bool,
    pub files: usize,
    /// Seals written (`--signing-key`), the final one included.
    pub seals: u64,
    /// What sealing cost the capture (None: not sealed).
    pub seal_cost: Option<SealCost>,
    /// What live detection did (None: it was off, or failed: logged).
    pub live: Option<super::live::LiveStats>,
}

/// What sealing cost a capture. The writer is the capture's bottleneck,
/// so its time on sealing is what sealing takes from throughput; the
/// sealing thread's CPU is what it takes from a machine with no idle core.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SealCost {
    /// The sealing thread's CPU time (user and system): reading each new
    /// byte back, sha256 and blake3, signing.
    pub sealer_cpu_s: f64,
    /// The writer's time handing the sealer each interval's state (the
    /// open files flushed to disk, the list of files, the counts).
    pub writer_s: f64,
    /// The writer's time encoding the rows buffered when a seal was due:
    /// rows it encodes anyway, moved earlier (a row group ends there), so
    /// not a cost of its own; shown apart.
    pub flush_s: f64,
    /// The wait for the final seal at close (the bytes since the last seal
    /// read back): once per capture.
    pub final_wait_s: f64,
}
