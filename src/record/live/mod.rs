//! Live detection in `record`: the lineage rule applied while the sidecar
//! records (docs/live.md).
//!
//! The writer hands every event it writes, every loss and every request
//! row to [`Live`] (`event`, `lost`, `request`), which passes them in
//! batches over a bounded queue to a thread of its own: capture never
//! waits on detection (a batch the queue cannot take is dropped from the
//! live view and counted; the trace has it). That thread runs the live
//! replay (`state`: the CPU backend scope uses, the scheduler's copy and
//! hole discipline made incremental), the [`alerts::Detector`] over its
//! read runs and the engine guard's decisions (`guard` lines), and the
//! metrics (`metrics`, served at `/metrics`).
//!
//! At close the outcome goes through `scope::scope_outcome` with the trace
//! just written (the requests table) and the findings are written to
//! `live-findings.json` in the trace folder: affected responses,
//! cross-tenant prefix hits, and what could make them differ from a fresh
//! scope (events the live queue dropped, copies taken uncertain).

pub mod alertmanager;
pub mod alerts;
pub mod compare;
pub mod metrics;
pub mod state;
pub mod taint;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::record::wire::GuardDecision;
use crate::report::export::ocsf::Context;
use crate::schema::{KvEvent, RequestRecord};
use crate::scope::{Response, SharedHit};
use crate::trace::manifest::Deployment;
pub use alertmanager::AlertmanagerOptions;
pub use alerts::AlertTarget;
use metrics::Metrics;
pub use state::Bounds;

/// The file live findings are written to, in the trace folder.
pub const LIVE_FINDINGS: &str = crate::custody::seal::verify::LIVE_FINDINGS;

/// How live detection runs (`record --live`, `--alerts`, `--metrics`).
#[derive(Debug, Clone)]
pub struct LiveOptions {
    pub alerts: Option<AlertTarget>,
    /// `--alertmanager URL`: each alert also POSTed to Alertmanager.
    pub alertmanager: Option<AlertmanagerOptions>,
    pub metrics: Option<SocketAddr>,
    pub bounds: Bounds,
    /// Batches (of up to `BATCH` events) between the writer and the live
    /// thread.
    pub queue_batches: usize,
    /// Alerts waiting to be written at most.
    pub alert_queue: usize,
    /// Alerts sent one by one per `storm_window` at most; the rest are
    /// counted in one storm summary alert at the window's end.
    pub storm_limit: u32,
    pub storm_window: Duration,
}

impl Default for LiveOptions {
    fn default() -> Self {
        LiveOptions {
            alerts: None,
            alertmanager: None,
            metrics: None,
            bounds: Bounds::default(),
            queue_batches: 1024,
            alert_queue: 4096,
            storm_limit: 100,
            storm_window: Duration::from_secs(10),
        }
    }
}

/// Events the writer gathers before handing them over.
const BATCH: usize = 4096;

enum Msg {
    /// Events, when they were handed over, and the seq ranges the queue
    /// dropped since the last batch it took.
    Events(Vec<KvEvent>, Instant, ViewHoles),
    Lost(u16, u64),
    Request(Box<RequestRecord>),
    Guard(Box<GuardDecision>),
}

/// What the live side did, for the summary and live-findings.json.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveStats {
    pub events_applied: u64,
    /// Events the live queue could not take: written, not classified live.
    pub events_dropped: u64,
    pub seq_holes: u64,
    /// Copies that arrived after their source moved on, rebuilt exactly
    /// from the source pool's history.
    #[serde(default)]
    pub copies_rebuilt: u64,
    pub copies_late: u64,
    pub copies_timed_out: u64,
    pub late_sources: u64,
    pub affected_responses: u64,
    /// Alerts raised (storm summaries and the alerts they fold included).
    pub alerts: u64,
    /// Alerts written to `--alerts` and not: a full queue, a failed write
    /// (or the live queue full when a loss was to be alerted).
    pub alerts_written: u64,
    pub alerts_dropped: u64,
    /// Alerts folded into storm summaries (not sent one by one).
    #[serde(default)]
    pub alerts_aggregated: u64,
    /// Read events of tainted slots (the live view may have them wrong
    /// where the trace has them right: its queue dropped events, a copy
    /// was late or timed out; `state`) whose foreign runs were only
    /// uncertain: not alerted, since the uncertainty may be the view's
    /// own; counted here and in `kvtrail_live_reads_unverified_total`.
    #[serde(default)]
    pub reads_unverified: u64,
    /// Alerts Alertmanager took, and not (queue full, given up).
    #[serde(default)]
    pub alertmanager_sent: u64,
    #[serde(default)]
    pub alertmanager_dropped: u64,
    /// Why the live replay stopped early, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    pub events_unapplied: u64,
}

impl LiveStats {
    /// Whether the live view saw exactly what the trace holds, so its
    /// findings must equal a fresh scope's.
    pub fn exact(&self) -> bool {
        self.events_dropped == 0
            && self.copies_late == 0
            && self.copies_timed_out == 0
            && self.stopped.is_none()
            && self.events_unapplied == 0
    }
}

/// live-findings.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LiveFindings {
    pub kind: String,
    pub version: u32,
    /// Whether these findings must equal `scope` on the trace
    /// (`LiveStats::exact`).
    pub exact: bool,
    pub live: LiveStats,
    pub affected_responses: Vec<Response>,
    pub cross_tenant_shared: Vec<SharedHit>,
}

/// The writer's handle on live detection.
pub struct Live {
    tx: Option<SyncSender<Msg>>,
    buf: Vec<KvEvent>,
    thread: Option<JoinHandle<Closed>>,
    metrics: Arc<Metrics>,
    dropped: u64,
    /// Seq ranges of the events the queue dropped,
    /// for the next batch it takes: the live view taints what they may
    /// have changed (`state::Engine::view_dropped`).
    view_holes: ViewHoles,
    /// `--when-behind wait`: a full queue waits instead of dropping.
    wait: bool,
    /// The alert sinks configured (metrics labels).
    sinks: Vec<&'static str>,
    _server: Option<metrics::Server>,
}

struct Closed {
    engine: state::Engine,
    detector: alerts::Detector,
}

impl Live {
    /// Starts the live thread (and the metrics server, the alert writer).
    pub fn start(
        opts: &LiveOptions,
        deployment: &Deployment,
        from_engine_start: bool,
        wait: bool,
        stats: Arc<crate::record::stats::Stats>,
    ) -> Result<Live> {
        Self::start_gated(opts, deployment, from_engine_start, wait, stats, None)
    }

    /// `start`, with the live thread waiting for `gate` (a message or its
    /// sender dropped) before it takes its first batch: tests fill the
    /// queue to see what a live thread that is behind does.
    fn start_gated(
        opts: &LiveOptions,
        deployment: &Deployment,
        from_engine_start: bool,
        wait: bool,
        stats: Arc<crate::record::stats::Stats>,
        gate: Option<Receiver<()>>,
    ) -> Result<Live> {
        let metrics = Arc::new(Metrics::default());
        let mut sinks = Vec::new();
        if opts.alerts.is_some() {
            sinks.push(alerts::FILE_SINK);
        }
        if opts.alertmanager.is_some() {
            sinks.push(alertmanager::SINK);
        }
        let pools: Vec<u16> = deployment.pools.iter().map(|p| p.id).collect();
        metrics.init(&pools, &sinks);
        let server = match opts.metrics {
            Some(a) => Some(metrics::Server::start(
                a,
                metrics.clone(),
                Arc::new(AtomicI64::new(0)),
            )?),
            None => None,
        };
        let sink = match &opts.alerts {
            Some(t) => Some(alerts::Sink::start(t, opts.alert_queue, metrics.clone())?),
            None => None,
        };
        let am = match &opts.alertmanager {
            Some(a) => Some(alertmanager::Delivery::start(a, metrics.clone())?),
            None => None,
        };
        let engine = state::Engine::new(deployment, from_engine_start, opts.bounds)?;
        let started = now_ns();
        let cx = Context {
            incident_uid: format!("kvtrail:live:{}:{started}", deployment.name),
            evidence_complete: false,
            trace_blake3: None,
        };
        let tenant_prefix =
            deployment.prefix_cache_scope == Some(crate::trace::manifest::PrefixCacheScope::Tenant);
        let out = alerts::Outputs {
            deployment: deployment.name.clone(),
            sink,
            alertmanager: am,
            storm_limit: opts.storm_limit,
            storm_window: opts.storm_window,
        };
        let detector = alerts::Detector::new(cx, tenant_prefix, out, metrics.clone());
        let (tx, rx) = sync_channel(opts.queue_batches.max(1));
        let m = metrics.clone();
        let thread = std::thread::Builder::new()
            .name("kvtrail-live".into())
            .spawn(move || {
                if let Some(g) = gate {
                    let _ = g.recv();
                }
                run(engine, detector, rx, &m, &stats)
            })
            .map_err(|e| Error::Other(format!("cannot start the live thread: {e}")))?;
        Ok(Live {
            tx: Some(tx),
            buf: Vec::with_capacity(BATCH),
            thread: Some(thread),
            metrics,
            dropped: 0,
            view_holes: ViewHoles::new(),
            wait,
            sinks,
            _server: server,
        })
    }

    /// The metrics server's address (the port, when 0 was asked for).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self._server.as_ref().map(|s| s.addr)
    }

    /// An event as written (seq assigned).
    #[inline]
    pub fn event(&mut self, e: KvEvent) {
        self.buf.push(e);
        if self.buf.len() >= BATCH {
            self.flush();
        }
    }

    /// Hands the gathered events over (waits only with `--when-behind
    /// wait`).
    pub fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let evs = std::mem::replace(&mut self.buf, Vec::with_capacity(BATCH));
        let n = evs.len() as u64;
        let dropped = std::mem::take(&mut self.view_holes);
        if let Err(Msg::Events(evs, _, dropped)) =
            self.send_back(Msg::Events(evs, Instant::now(), dropped))
        {
            self.dropped += n;
            self.metrics.live_dropped.inc_by(n);
            self.view_holes = dropped;
            note_dropped(&mut self.view_holes, &evs);
        }
    }

    fn send(&self, m: Msg) -> bool {
        self.send_back(m).is_ok()
    }

    /// Sends `m`, or hands it back when the queue cannot take it.
    fn send_back(&self, m: Msg) -> std::result::Result<(), Msg> {
        let Some(tx) = self.tx.as_ref() else {
            return Err(m);
        };
        if self.wait {
            return tx.send(m).map_err(|e| e.0);
        }
        tx.try_send(m).map_err(|e| match e {
            TrySendError::Full(m) | TrySendError::Disconnected(m) => m,
        })
    }

    /// `n` events of `pool` were lost (a hole in the trace).
    pub fn lost(&mut self, pool: u16, n: u64) {
        self.flush();
        self.metrics
            .lost
            .get_or_create(&vec![("pool".to_string(), pool.to_string())])
            .inc_by(n);
        // Dropped with a full queue: the hole is still in the metrics and
        // the trace; only its alert is missing (counted).
        if !self.send(Msg::Lost(pool, n)) {
            for s in &self.sinks {
                self.metrics.dropped(s).inc();
            }
        }
    }

    /// A decision of the engine's guard that was not `ok` (a `guard`
    /// line): counted at once; a foreign read or an abort goes to the live
    /// thread to be alerted (once per request).
    pub fn guard(&mut self, g: GuardDecision) {
        self.metrics
            .guard(g.verdict.as_str(), g.action.as_str())
            .inc();
        if !alerts::guard_alerted(&g) {
            return;
        }
        self.flush();
        if !self.send(Msg::Guard(Box::new(g))) {
            for s in &self.sinks {
                self.metrics.dropped(s).inc();
            }
        }
    }

    /// `n` more guard checks answered `ok` (a `guard_ok` line): counted
    /// as verdict `ok`, action `allow`.
    pub fn guard_ok(&mut self, n: u64) {
        self.metrics.guard("ok", "allow").inc_by(n);
    }

    /// A request row was written.
    pub fn request(&mut self, r: &RequestRecord) {
        self.flush();
        let _ = self.send(Msg::Request(Box::new(r.clone())));
    }

    /// Ends the live thread (everything held applied) and writes
    /// live-findings.json into the closed trace at `out`.
    pub fn close(mut self, out: &Path) -> Result<LiveStats> {
        let Closed { engine, detector } = self.finish()?;
        detector.close();
        let m = &self.metrics;
        let outcome = engine.outcome();
        let mut stats = LiveStats {
            events_applied: engine.counters.events,
            events_dropped: self.dropped,
            seq_holes: engine.gaps.len() as u64,
            copies_rebuilt: engine.copies_rebuilt,
            copies_late: engine.copies_late,
            copies_timed_out: engine.copies_timed_out,
            late_sources: engine.late_sources.len() as u64,
            affected_responses: 0,
            alerts: m.alerts.get(),
            alerts_written: m.sent(alerts::FILE_SINK).get(),
            alerts_dropped: m.dropped(alerts::FILE_SINK).get(),
            alerts_aggregated: m.alerts_aggregated.get(),
            reads_unverified: m.reads_unverified.get(),
            alertmanager_sent: m.sent(alertmanager::SINK).get(),
            alertmanager_dropped: m.dropped(alertmanager::SINK).get(),
            stopped: engine.stopped.clone(),
            events_unapplied: engine.events_unapplied,
        };
        let trace = crate::trace::Trace::open(out)?;
        let report = crate::scope::scope_outcome(&trace, &outcome, &crate::progress::NoReporter)?;
        stats.affected_responses = report.affected_responses.len() as u64;
        let f = LiveFindings {
            kind: "kvtrail live findings".into(),
            version: 1,
            exact: stats.exact(),
            live: stats.clone(),
            affected_responses: report.affected_responses,
            cross_tenant_shared: report.cross_tenant_shared,
        };
        let p = out.join(LIVE_FINDINGS);
        let bytes = serde_json::to_vec_pretty(&f)
            .map_err(|e| Error::Other(format!("live findings: {e}")))?;
        std::fs::write(&p, bytes).map_err(|e| Error::io(&p, e))?;
        Ok(stats)
    }
}

/// Seq ranges per pool a sender keeps for the live thread at most; past
/// it the last two merge (a wider range only taints more).
const VIEW_HOLES_SENT: usize = 1024;

/// Seq ranges (first, last) of dropped events per pool.
type ViewHoles = std::collections::BTreeMap<u16, Vec<(u64, u64)>>;

/// Adds the seqs of dropped events `evs` to `holes`, extending a pool's
/// last range where a seq continues it. Costs a map lookup per run of one
/// pool's events: the writer calls it when the live thread is behind.
fn note_dropped(holes: &mut ViewHoles, evs: &[KvEvent]) {
    let mut i = 0;
    while i < evs.len() {
        let pool = evs[i].pool;
        let ranges = holes.entry(pool).or_default();
        while i < evs.len() && evs[i].pool == pool {
            let seq = evs[i].seq;
            match ranges.last_mut() {
                Some(r) if seq >= r.0 && seq <= r.1.saturating_add(1) => r.1 = r.1.max(seq),
                _ => ranges.push((seq, seq)),
            }
            if ranges.len() > VIEW_HOLES_SENT {
                let (lo, hi) = ranges.pop().expect("over the bound");
                let r = ranges.last_mut().expect("over the bound");
                r.0 = r.0.min(lo);
                r.1 = r.1.max(hi);
            }
            i += 1;
        }
    }
}

impl Live {
    /// Hands over what is gathered and waits for the live thread to apply
    /// everything held.
    fn finish(&mut self) -> Result<Closed> {
        self.flush();
        if !self.view_holes.is_empty()
            && let Some(tx) = self.tx.as_ref()
        {
            // Dropped ranges no later batch carried: the view must still
            // know them (a copy whose source lies in them is taken at
            // close). The thread is joined next anyway: wait for room.
            let holes = std::mem::take(&mut self.view_holes);
            let _ = tx.send(Msg::Events(Vec::new(), Instant::now(), holes));
        }
        self.tx.take();
        self.thread
            .take()
            .expect("runs until closed")
            .join()
            .map_err(|_| Error::Other("the live thread panicked".into()))
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// The live thread: takes batches, applies what is ripe, alerts, counts;
/// at the end (the writer's handle closed) applies everything held.
fn run(
    mut engine: state::Engine,
    mut detector: alerts::Detector,
    rx: Receiver<Msg>,
    m: &Metrics,
    stats: &crate::record::stats::Stats,
) -> Closed {
    let mut last_tick = Instant::now();
    let mut holes = 0usize;
    let mut by_op: std::collections::BTreeMap<(u16, &'static str), u64> = Default::default();
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(Msg::Events(evs, at, dropped)) => {
                for (pool, ranges) in dropped {
                    for (lo, hi) in ranges {
                        engine.view_dropped(pool, lo, hi);
                    }
                }
                for e in &evs {
                    *by_op.entry((e.pool, e.op.as_str())).or_default() += 1;
                    engine.push(*e, at);
                }
                for ((pool, op), n) in std::mem::take(&mut by_op) {
                    m.events
                        .get_or_create(&vec![
                            ("pool".to_string(), pool.to_string()),
                            ("op".to_string(), op.to_string()),
                        ])
                        .inc_by(n);
                }
            }
            Ok(Msg::Lost(pool, n)) => detector.lost(pool, n),
            Ok(Msg::Request(r)) => detector.request(&r),
            Ok(Msg::Guard(g)) => detector.guard(&g),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        let oldest = engine.oldest();
        engine.pump(Instant::now(), false, &mut |runs, suspect| {
            detector.runs(runs, suspect)
        });
        if let Some(at) = oldest
            && engine.oldest() != Some(at)
        {
            m.lag.observe(at.elapsed().as_secs_f64());
        }
        holes = count_holes(&engine, holes, m);
        if last_tick.elapsed() >= Duration::from_secs(1) {
            last_tick = Instant::now();
            detector.flush_losses(now_ns());
            detector.tick();
            let (held, waiting) = engine.held();
            m.events_held.set(held as i64);
            m.copies_waiting.set(waiting as i64);
            m.sync(stats);
        }
    }
    engine.pump(Instant::now(), true, &mut |runs, suspect| {
        detector.runs(runs, suspect)
    });
    count_holes(&engine, holes, m);
    detector.flush_losses(now_ns());
    m.copies_rebuilt.inc_by(engine.copies_rebuilt);
    m.copies_late.inc_by(engine.copies_late);
    m.copies_timed_out.inc_by(engine.copies_timed_out);
    Closed { engine, detector }
}

/// Counts the holes found since `seen` into the metrics.
fn count_holes(engine: &state::Engine, seen: usize, m: &Metrics) -> usize {
    for g in engine.gaps.iter().skip(seen) {
        m.holes
            .get_or_create(&vec![("pool".to_string(), g.pool.to_string())])
            .inc();
    }
    engine.gaps.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{CopySrc, Op};

    fn ev(pool: u16, seq: u64, rid: u64, op: Op, start: u32, count: u32) -> KvEvent {
        KvEvent {
            pool,
            seq,
            ts_ns: seq as i64,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            src: None,
            token_pos: None,
        }
    }

    /// The live thread behind (held at a gate, its queue of one batch
    /// full) drops pool 0's second batch from its view. The hole that
    /// leaves is the view's own: reads of what it may have changed are
    /// counted unverified, not alerted, and so is a read of a copy taken
    /// from those slots. A real hole in pool 1 (a seq the trace lacks)
    /// and, once pool 0 is written over, a real hole in pool 0 are
    /// alerted as scope reports them: a dropped batch does not silence
    /// the rest of the recording.
    #[test]
    fn a_dropped_batch_taints_what_it_may_have_changed_and_no_more() {
        let dir = tempfile::tempdir().unwrap();
        let alerts = dir.path().join("alerts.jsonl");
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "name": "t", "engine": "test", "context_window": 4096,
            "pools": [
                {"id": 0, "role": "prefill", "capacity_tokens": 64, "page_size": 1},
                {"id": 1, "role": "decode", "capacity_tokens": 64, "page_size": 1}
            ]
        }))
        .unwrap();
        let opts = LiveOptions {
            alerts: Some(AlertTarget::File(alerts.clone())),
            queue_batches: 1,
            bounds: Bounds {
                holdback: Duration::ZERO,
                ..Bounds::default()
            },
            ..LiveOptions::default()
        };
        let (gate, gated) = sync_channel(1);
        let mut live = Live::start_gated(
            &opts,
            &deployment,
            true,
            false,
            Arc::new(Default::default()),
            Some(gated),
        )
        .unwrap();
        let send = |live: &mut Live, evs: &[KvEvent]| {
            for e in evs {
                live.event(*e);
            }
            live.flush();
        };
        // Taken (the queue's one place), then dropped (the queue full).
        send(
            &mut live,
            &[ev(0, 0, 1, Op::Alloc, 0, 8), ev(0, 1, 1, Op::Write, 0, 8)],
        );
        assert_eq!(live.dropped, 0);
        send(
            &mut live,
            &[
                ev(0, 2, 2, Op::Alloc, 0, 8),
                ev(0, 3, 2, Op::Write, 0, 8),
                ev(0, 4, 2, Op::Free, 0, 8),
            ],
        );
        assert_eq!(live.dropped, 3);
        assert_eq!(live.view_holes[&0], vec![(2, 4)]);
        // From here on nothing is dropped.
        live.wait = true;
        gate.send(()).unwrap();
        let copy = KvEvent {
            src: Some(CopySrc {
                pool: 0,
                slot_start: 0,
                seq: 6,
            }),
            ..ev(1, 6, 8, Op::Write, 8, 4)
        };
        send(
            &mut live,
            &[
                // Request 3 reads slots request 2 wrote (the view: 1's).
                ev(0, 5, 3, Op::Alloc, 0, 8),
                ev(0, 6, 3, Op::Read, 0, 8),
                // A real hole in pool 1 (seq 2 is not in the trace).
                ev(1, 0, 4, Op::Alloc, 0, 4),
                ev(1, 1, 4, Op::Write, 0, 4),
                ev(1, 3, 5, Op::Alloc, 0, 4),
                ev(1, 4, 5, Op::Read, 0, 4),
                // Request 8's copy of pool 0's slots 0..4 as of seq 6.
                ev(1, 5, 8, Op::Alloc, 8, 4),
                copy,
                ev(1, 7, 8, Op::Read, 8, 4),
                // Pool 0 written over, then a real hole (seq 9).
                ev(0, 7, 6, Op::Alloc, 0, 64),
                ev(0, 8, 6, Op::Write, 0, 64),
                ev(0, 10, 7, Op::Alloc, 0, 4),
                ev(0, 11, 7, Op::Read, 0, 4),
            ],
        );
        assert!(live.view_holes.is_empty(), "handed over with the batch");
        let Closed { engine, detector } = live.finish().unwrap();
        detector.close();
        let m = &live.metrics;
        assert_eq!(engine.gaps.len(), 3, "{:?}", engine.gaps);
        assert_eq!(m.reads_unverified.get(), 2, "requests 3 and 8");
        assert_eq!(engine.tainted_slots(0), 0, "written over");
        assert_eq!(engine.tainted_slots(1), 4, "the copy's slots");
        let mut alerted: Vec<u64> = std::fs::read_to_string(&alerts)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["unmapped"]["trigger"] == "first_foreign_read")
            .map(|v| v["unmapped"]["request_id"].as_u64().unwrap())
            .collect();
        alerted.sort();
        assert_eq!(alerted, vec![5, 7], "the real holes' reads");
        assert_eq!(m.alerts.get(), 2);
    }

    /// A dropped batch that no later batch follows (only close): its seq
    /// ranges still reach the live view, so a copy whose source seq lies
    /// in them, taken at close as a late source, is tainted and its read
    /// does not page.
    #[test]
    fn dropped_ranges_pending_at_close_still_taint() {
        let dir = tempfile::tempdir().unwrap();
        let alerts = dir.path().join("alerts.jsonl");
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "name": "t", "engine": "test", "context_window": 4096,
            "pools": [
                {"id": 0, "role": "prefill", "capacity_tokens": 64, "page_size": 1},
                {"id": 1, "role": "decode", "capacity_tokens": 64, "page_size": 1}
            ]
        }))
        .unwrap();
        let opts = LiveOptions {
            alerts: Some(AlertTarget::File(alerts.clone())),
            queue_batches: 1,
            bounds: Bounds {
                holdback: Duration::ZERO,
                ..Bounds::default()
            },
            ..LiveOptions::default()
        };
        let (gate, gated) = sync_channel(1);
        let mut live = Live::start_gated(
            &opts,
            &deployment,
            true,
            false,
            Arc::new(Default::default()),
            Some(gated),
        )
        .unwrap();
        let send = |live: &mut Live, evs: &[KvEvent]| {
            for e in evs {
                live.event(*e);
            }
            live.flush();
        };
        let copy = KvEvent {
            src: Some(CopySrc {
                pool: 0,
                slot_start: 0,
                seq: 3,
            }),
            ..ev(1, 1, 2, Op::Write, 0, 4)
        };
        // Taken: request 2's copy (its connection read first) and read,
        // request 1's first events in pool 0.
        send(
            &mut live,
            &[
                ev(1, 0, 2, Op::Alloc, 0, 4),
                copy,
                ev(1, 2, 2, Op::Read, 0, 4),
                ev(0, 0, 1, Op::Alloc, 0, 4),
                ev(0, 1, 1, Op::Write, 0, 4),
            ],
        );
        // Dropped: request 2's prefill in pool 0 (the copy's source).
        send(
            &mut live,
            &[ev(0, 2, 2, Op::Alloc, 0, 4), ev(0, 3, 2, Op::Write, 0, 4)],
        );
        assert_eq!(live.dropped, 2);
        gate.send(()).unwrap();
        let Closed { engine, detector } = live.finish().unwrap();
        detector.close();
        let m = &live.metrics;
        let alerted: Vec<u64> = std::fs::read_to_string(&alerts)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["unmapped"]["trigger"] == "first_foreign_read")
            .map(|v| v["unmapped"]["request_id"].as_u64().unwrap())
            .collect();
        assert_eq!(
            alerted,
            Vec::<u64>::new(),
            "clean trace paged; late_sources {:?} tainted(1) {} unverified {}",
            engine.late_sources,
            engine.tainted_slots(1),
            m.reads_unverified.get()
        );
    }

    /// One read over slots the view has tainted (a dropped batch) and
    /// slots a real hole made uncertain: the tainted run is counted, the
    /// other alerted, naming only its own source.
    #[test]
    fn a_read_alerts_its_real_uncertain_runs_beside_tainted_ones() {
        let dir = tempfile::tempdir().unwrap();
        let alerts = dir.path().join("alerts.jsonl");
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "name": "t", "engine": "test", "context_window": 4096,
            "pools": [{"id": 0, "role": "mixed", "capacity_tokens": 64, "page_size": 1}]
        }))
        .unwrap();
        let opts = LiveOptions {
            alerts: Some(AlertTarget::File(alerts.clone())),
            queue_batches: 1,
            bounds: Bounds {
                holdback: Duration::ZERO,
                ..Bounds::default()
            },
            ..LiveOptions::default()
        };
        let (gate, gated) = sync_channel(1);
        let mut live = Live::start_gated(
            &opts,
            &deployment,
            true,
            false,
            Arc::new(Default::default()),
            Some(gated),
        )
        .unwrap();
        let send = |live: &mut Live, evs: &[KvEvent]| {
            for e in evs {
                live.event(*e);
            }
            live.flush();
        };
        send(
            &mut live,
            &[
                ev(0, 0, 1, Op::Alloc, 0, 8),
                ev(0, 1, 1, Op::Write, 0, 8),
                ev(0, 2, 2, Op::Alloc, 8, 8),
                ev(0, 3, 2, Op::Write, 8, 8),
            ],
        );
        // Dropped: request 9 writes slots 0..8 (the view keeps request 1's).
        send(&mut live, &[ev(0, 4, 9, Op::Write, 0, 8)]);
        assert_eq!(live.dropped, 1);
        live.wait = true;
        gate.send(()).unwrap();
        send(
            &mut live,
            &[
                // Request 2 rewrites its slots (their taint goes).
                ev(0, 5, 2, Op::Write, 8, 8),
                // Seq 6 is not in the trace: a real hole. Request 5 reads
                // all 16 slots: 0..8 tainted, 8..16 uncertain by the hole.
                ev(0, 7, 5, Op::Alloc, 0, 16),
                ev(0, 8, 5, Op::Read, 0, 16),
            ],
        );
        let Closed { engine, detector } = live.finish().unwrap();
        detector.close();
        let m = &live.metrics;
        assert_eq!(engine.gaps.len(), 2, "{:?}", engine.gaps);
        assert_eq!(m.reads_unverified.get(), 1);
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&alerts)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|v: &serde_json::Value| v["unmapped"]["trigger"] == "first_foreign_read")
            .collect();
        assert_eq!(lines.len(), 1, "{lines:?}");
        let a = lines[0].to_string();
        assert_eq!(lines[0]["unmapped"]["request_id"], 5, "{a}");
        assert!(a.contains("possible"), "{a}");
        let u = &lines[0]["unmapped"];
        assert_eq!(u["sources"].as_array().map(Vec::len), Some(1), "{a}");
        assert_eq!(u["sources"][0]["request_id"], 2, "{a}");
        assert_eq!(u["foreign_tokens"], 8, "only the hole's slots: {a}");
    }

    #[test]
    fn dropped_seqs_merge_into_ranges_per_pool_and_stay_bounded() {
        let mut h = ViewHoles::new();
        let e = |pool, seq| KvEvent {
            seq,
            ..ev_plain(pool)
        };
        note_dropped(&mut h, &[e(0, 5), e(0, 6), e(1, 2), e(0, 7), e(0, 9)]);
        assert_eq!(h[&0], vec![(5, 7), (9, 9)]);
        assert_eq!(h[&1], vec![(2, 2)]);
        let spread: Vec<KvEvent> = (0..3 * VIEW_HOLES_SENT as u64)
            .map(|k| e(2, 10 + 2 * k))
            .collect();
        note_dropped(&mut h, &spread);
        assert_eq!(h[&2].len(), VIEW_HOLES_SENT);
        let last = *h[&2].last().unwrap();
        assert_eq!(
            last.1,
            10 + 2 * (3 * VIEW_HOLES_SENT as u64 - 1),
            "covers the end"
        );
        // Every dropped seq stays covered.
        for x in &spread {
            assert!(
                h[&2].iter().any(|r| r.0 <= x.seq && x.seq <= r.1),
                "{}",
                x.seq
            );
        }
    }

    fn ev_plain(pool: u16) -> KvEvent {
        ev(pool, 0, 1, Op::Write, 0, 1)
    }
}
