//! The sidecar's counters: live atomics ([`Stats`]) for the health line,
//! a plain copy ([`StatsSnapshot`]) for the summary, and the one rule that
//! says which counts leave evidence missing (the capture incomplete).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters, read live for the health line and returned at the end.
#[derive(Debug, Default)]
pub struct Stats {
    pub connections_total: AtomicU64,
    pub connections_live: AtomicU64,
    pub kv_written: AtomicU64,
    pub requests_written: AtomicU64,
    /// Messages in the queue to the writer.
    pub queue_depth: AtomicU64,
    /// Events dropped because the writer fell behind (holes).
    pub lost_queue: AtomicU64,
    /// Events the hooks reported lost (`lost` lines; holes).
    pub lost_hook: AtomicU64,
    /// Events not written because --max-bytes was reached.
    pub lost_max_bytes: AtomicU64,
    /// Transfer commits whose prefill side never arrived (holes).
    pub copies_unresolved: AtomicU64,
    pub rejected_hello: AtomicU64,
    /// Well-formed hellos refused (a pool held by another live connection,
    /// or not in the deployment): a process meant to record those pools and
    /// its events are not in the trace, so the capture is incomplete.
    pub refused_claims: AtomicU64,
    /// Malformed events of a known pool (each a hole in that pool).
    pub rejected_malformed: AtomicU64,
    /// Events for pools the connection did not declare.
    pub rejected_forged: AtomicU64,
    /// Events the recorder refused (extent outside the pool, seq order).
    pub rejected_contract: AtomicU64,
    /// Lines that could not be tied to a pool (bad JSON, oversized).
    pub rejected_unattributed: AtomicU64,
    pub bytes_on_disk: AtomicU64,
    /// Connections refused because --max-connections were live: any of them
    /// may have been an engine, so the capture is incomplete.
    pub refused_connections: AtomicU64,
    /// Connections closed because no hello came within the handshake
    /// deadline (or the shutdown cut them first); the capture is incomplete.
    pub dropped_before_hello: AtomicU64,
    /// Connections still sending when the shutdown grace ran out, cut with
    /// what they had not sent yet; the capture is incomplete.
    pub connections_cut: AtomicU64,
    /// Of the events counted lost or rejected above, those that could not
    /// be recorded as a seq hole (the pool's seq space is used up); the
    /// capture is incomplete.
    pub lost_unrecorded: AtomicU64,
    /// Request views not written because --max-pending-bytes was held by
    /// views waiting for their partner; the capture is incomplete.
    pub lost_requests: AtomicU64,
    /// Bytes (estimated) now held for views, transfer halves and parked
    /// streams waiting for their partner.
    pub pending_bytes: AtomicU64,
    /// Pull-based copies (`xfer_pull` runs) written as `write` with `src`.
    pub pulls_written: AtomicU64,
    /// Loads the consumer engine reported partial (some blocks failed).
    pub pulls_partial: AtomicU64,
    /// Loads the consumer engine reported failed (nothing copied).
    pub pulls_failed: AtomicU64,
    /// Connections that ended without a `bye` line (the engine exited or
    /// crashed with events still queued, or a client that does not say
    /// goodbye): what they had not sent is unknown, so the capture is
    /// incomplete.
    pub connections_unclosed: AtomicU64,
    /// Events a `bye` line left unaccounted for (queued, neither sent nor
    /// reported lost); the capture is incomplete.
    pub events_unaccounted: AtomicU64,
    /// Request ids reported by two requests that disagree (a reused client
    /// id): the request is left unattributed and the capture incomplete.
    pub request_conflicts: AtomicU64,
}

/// Adds to a counter, stopping at u64::MAX instead of wrapping (counts on
/// the wire come from untrusted clients).
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

/// A plain copy of [`Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub connections_total: u64,
    pub connections_live: u64,
    pub kv_written: u64,
    pub requests_written: u64,
    pub queue_depth: u64,
    pub lost_queue: u64,
    pub lost_hook: u64,
    pub lost_max_bytes: u64,
    pub copies_unresolved: u64,
    pub rejected_hello: u64,
    pub refused_claims: u64,
    pub rejected_malformed: u64,
    pub rejected_forged: u64,
    pub rejected_contract: u64,
    pub rejected_unattributed: u64,
    pub bytes_on_disk: u64,
    pub refused_connections: u64,
    pub dropped_before_hello: u64,
    pub connections_cut: u64,
    pub lost_unrecorded: u64,
    pub lost_requests: u64,
    pub pending_bytes: u64,
    pub pulls_written: u64,
    pub pulls_partial: u64,
    pub pulls_failed: u64,
    pub connections_unclosed: u64,
    pub events_unaccounted: u64,
    pub request_conflicts: u64,
}

impl StatsSnapshot {
    /// KV events lost, by every cause, each counted once (saturating).
    /// `lost_unrecorded` is not added: it says which of them (or of the
    /// rejected events) could not become holes.
    pub fn lost_events(&self) -> u64 {
        [
            self.lost_queue,
            self.lost_hook,
            self.lost_max_bytes,
            self.copies_unresolved,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Lines and hellos rejected, by every cause (saturating).
    pub fn rejected(&self) -> u64 {
        [
            self.rejected_malformed,
            self.rejected_forged,
            self.rejected_contract,
            self.rejected_unattributed,
            self.rejected_hello,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Whether these counters show evidence that is neither in the trace
    /// nor a seq hole in it: then the capture cannot be complete. The one
    /// place this rule lives (the writer closes the trace by it).
    pub fn evidence_missing(&self) -> bool {
        self.rejected_unattributed > 0
            || self.refused_claims > 0
            || self.refused_connections > 0
            || self.dropped_before_hello > 0
            || self.connections_cut > 0
            || self.lost_unrecorded > 0
            || self.lost_requests > 0
            || self.lost_max_bytes > 0
            || self.connections_unclosed > 0
            || self.events_unaccounted > 0
            || self.request_conflicts > 0
    }
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            connections_total: g(&self.connections_total),
            connections_live: g(&self.connections_live),
            kv_written: g(&self.kv_written),
            requests_written: g(&self.requests_written),
            queue_depth: g(&self.queue_depth),
            lost_queue: g(&self.lost_queue),
            lost_hook: g(&self.lost_hook),
            lost_max_bytes: g(&self.lost_max_bytes),
            copies_unresolved: g(&self.copies_unresolved),
            rejected_hello: g(&self.rejected_hello),
            refused_claims: g(&self.refused_claims),
            rejected_malformed: g(&self.rejected_malformed),
            rejected_forged: g(&self.rejected_forged),
            rejected_contract: g(&self.rejected_contract),
            rejected_unattributed: g(&self.rejected_unattributed),
            bytes_on_disk: g(&self.bytes_on_disk),
            refused_connections: g(&self.refused_connections),
            dropped_before_hello: g(&self.dropped_before_hello),
            connections_cut: g(&self.connections_cut),
            lost_unrecorded: g(&self.lost_unrecorded),
            lost_requests: g(&self.lost_requests),
            pending_bytes: g(&self.pending_bytes),
            pulls_written: g(&self.pulls_written),
            pulls_partial: g(&self.pulls_partial),
            pulls_failed: g(&self.pulls_failed),
            connections_unclosed: g(&self.connections_unclosed),
            events_unaccounted: g(&self.events_unaccounted),
            request_conflicts: g(&self.request_conflicts),
        }
    }
}
