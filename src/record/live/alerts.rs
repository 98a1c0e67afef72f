//! Alerts: one JSON line each, an OCSF Data Security Finding (class 2006)
//! built by the export's mapping (`report::export::ocsf`), written to a
//! file or stdout by a thread of its own behind a bounded queue, so a slow
//! disk or a blocked pipe never holds the live replay (an alert that does
//! not fit is dropped and counted).
//!
//! [`Detector`] decides what is alerted, from the read runs the live
//! replay classifies: a response's first foreign read (one alert per
//! affected response, however many reads follow), a cross-tenant
//! prefix-cache hit where the deployment promised per-tenant prefix
//! caches (once per response; raised when both tenants are known),
//! capture loss (at most one alert per pool a second, the loss summed),
//! and a decision of the guard in the engine that found a foreign read or
//! aborted a request (once per request).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::alertmanager::{AmAlert, Delivery};
use super::metrics::Metrics;
use super::state::Suspect;
use crate::error::{Error, Result};
use crate::lineage::{ReadKind, ReadRun};
use crate::record::wire::{GuardAction, GuardDecision, GuardVerdict};
use crate::report::export::Audience;
use crate::report::export::ocsf::{self, Context, GuardCheck, PrefixTime};
use crate::schema::{ENGINE_REQUEST, RequestRecord};
use crate::scope::{Confidence, Crossing, Response, SharedHit, SharedSource, Source, Tenant};

/// A stream alerts are written to (the CLI's stdout).
pub type AlertStream = Arc<std::sync::Mutex<Box<dyn Write + Send>>>;

/// Where alerts go: a file (created owner-only, appended to), or a stream
/// the caller owns.
#[derive(Clone)]
pub enum AlertTarget {
    File(PathBuf),
    Stream(AlertStream),
}

impl std::fmt::Debug for AlertTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AlertTarget::File(p) => write!(f, "File({})", p.display()),
            AlertTarget::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// Writes through a shared stream.
struct Shared(AlertStream);

impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::ErrorKind::Other)?
            .write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0
            .lock()
            .map_err(|_| std::io::ErrorKind::Other)?
            .flush()
    }
}

/// The metrics' sink label for `--alerts`.
pub const FILE_SINK: &str = "file";

/// The queue to the alert writer thread.
pub struct Sink {
    tx: Option<SyncSender<String>>,
    thread: Option<JoinHandle<()>>,
    metrics: Arc<Metrics>,
}

impl Sink {
    /// Opens the target (a file is created owner-only, appended to) and
    /// starts the writer thread; `queue` alerts wait at most.
    pub fn start(target: &AlertTarget, queue: usize, metrics: Arc<Metrics>) -> Result<Sink> {
        let out: Box<dyn Write + Send> = match target {
            AlertTarget::Stream(s) => Box::new(Shared(s.clone())),
            AlertTarget::File(p) => Box::new(open_append(p)?),
        };
        let (tx, rx) = sync_channel::<String>(queue.max(1));
        let m = metrics.clone();
        let thread = std::thread::Builder::new()
            .name("kvtrail-alerts".into())
            .spawn(move || write_loop(out, rx, &m))
            .map_err(|e| Error::Other(format!("cannot start the alert thread: {e}")))?;
        Ok(Sink {
            tx: Some(tx),
            thread: Some(thread),
            metrics,
        })
    }

    /// Queues one alert; false (counted) when the queue is full.
    pub fn send(&self, line: String) -> bool {
        let q = self.metrics.queue(FILE_SINK);
        q.inc();
        match self.tx.as_ref().map(|t| t.try_send(line)) {
            Some(Ok(())) => true,
            Some(Err(TrySendError::Full(_) | TrySendError::Disconnected(_))) | None => {
                q.dec();
                self.metrics.dropped(FILE_SINK).inc();
                false
            }
        }
    }

    /// Writes what is queued and stops the thread.
    pub fn close(mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn open_append(p: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(p)
        .map_err(|e| Error::io(p, e))
}

fn write_loop(mut out: Box<dyn Write + Send>, rx: Receiver<String>, m: &Metrics) {
    let (queue, sent, dropped) = (m.queue(FILE_SINK), m.sent(FILE_SINK), m.dropped(FILE_SINK));
    let mut failed = false;
    while let Ok(line) = rx.recv() {
        queue.dec();
        // Each alert is flushed at once: it must be readable within a
        // second. After a failed write (a closed pipe) the rest is
        // dropped, counted.
        if failed || writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
            failed = true;
            dropped.inc();
            continue;
        }
        sent.inc();
    }
}

/// What the live side knows of a request (from its requests-table row).
#[derive(Debug, Clone)]
struct Req {
    external_id: Option<String>,
    tenant: String,
    arrival_ns: i64,
    finish_ns: Option<i64>,
}

/// Request rows the detector keeps (oldest dropped first).
const REQUESTS_KEPT: usize = 1 << 20;
/// Prefix-cache hits waiting for a tenant to be known (newest dropped).
const HITS_KEPT: usize = 1 << 16;

/// Decides the alerts from read runs, request rows and losses.
pub struct Detector {
    cx: Context,
    tenant_prefix: bool,
    deployment: String,
    sink: Option<Sink>,
    am: Option<Delivery>,
    storm: Storm,
    metrics: Arc<Metrics>,
    requests: HashMap<u64, Req>,
    order: VecDeque<u64>,
    /// Responses alerted for a foreign read.
    foreign: HashSet<u64>,
    /// Responses alerted for a cross-tenant prefix hit.
    prefix: HashSet<u64>,
    /// Prefix hits whose tenants are not yet both known: reader -> (the
    /// pool read, source -> slots).
    pending_hits: HashMap<u64, (u16, BTreeMap<u64, u64>)>,
    /// Loss per pool not yet alerted.
    lost: BTreeMap<u16, u64>,
    /// Requests alerted for a guard decision (the oldest forgotten first).
    guarded: HashSet<u64>,
    guarded_order: VecDeque<u64>,
}

/// Whether a guard decision is alerted: a foreign read (whatever the
/// guard did about it), or a request the guard aborted.
pub fn guard_alerted(g: &GuardDecision) -> bool {
    g.verdict == GuardVerdict::Foreign || g.action == GuardAction::Abort
}

/// The alert trigger of an alerted guard decision.
fn guard_trigger(g: &GuardDecision) -> &'static str {
    match g.verdict {
        GuardVerdict::Foreign => "guard_foreign_read",
        GuardVerdict::Unknown => "guard_abort",
    }
}

/// Where a [`Detector`] delivers and how it aggregates.
pub struct Outputs {
    /// The deployment's name (Alertmanager's `deployment` label).
    pub deployment: String,
    pub sink: Option<Sink>,
    pub alertmanager: Option<Delivery>,
    /// Alerts sent one by one per window at most; beyond, one storm
    /// summary at the window's end counts the rest.
    pub storm_limit: u32,
    pub storm_window: Duration,
}

/// One alert raised: the OCSF finding and what Alertmanager's labels say.
struct Raised {
    trigger: &'static str,
    pool: Option<u16>,
    request_id: Option<u64>,
    confidence: Option<Confidence>,
    finding: Value,
}

/// The alert-storm limiter: `limit` alerts per window, the rest counted by
/// trigger for one summary.
struct Storm {
    limit: u32,
    window: Duration,
    start: Instant,
    start_ns: i64,
    sent: u32,
    folded: BTreeMap<&'static str, u64>,
}

impl Detector {
    pub fn new(cx: Context, tenant_prefix: bool, out: Outputs, metrics: Arc<Metrics>) -> Self {
        Detector {
            cx,
            tenant_prefix,
            deployment: out.deployment,
            sink: out.sink,
            am: out.alertmanager,
            storm: Storm {
                limit: out.storm_limit.max(1),
                window: out.storm_window,
                start: Instant::now(),
                start_ns: now_ns(),
                sent: 0,
                folded: BTreeMap::new(),
            },
            metrics,
            requests: HashMap::new(),
            order: VecDeque::new(),
            foreign: HashSet::new(),
            prefix: HashSet::new(),
            pending_hits: HashMap::new(),
            lost: BTreeMap::new(),
            guarded: HashSet::new(),
            guarded_order: VecDeque::new(),
        }
    }

    /// Raises an alert: delivered, or folded into the window's storm
    /// summary once `storm_limit` went out in this window.
    fn emit(&mut self, a: Raised) {
        self.metrics.alerts.inc();
        self.tick();
        if self.storm.sent >= self.storm.limit {
            *self.storm.folded.entry(a.trigger).or_default() += 1;
            self.metrics.alerts_aggregated.inc();
            return;
        }
        self.storm.sent += 1;
        self.deliver(&a);
    }

    fn deliver(&mut self, a: &Raised) {
        if let Some(s) = &self.sink {
            s.send(a.finding.to_string());
        }
        if let Some(d) = &self.am {
            d.send(am_alert(&self.deployment, a));
        }
    }

    /// Ends the storm window once it is over: the summary of what it
    /// folded goes out (outside the limit). Called at least once a second.
    pub fn tick(&mut self) {
        if self.storm.start.elapsed() < self.storm.window {
            return;
        }
        self.end_window();
    }

    fn end_window(&mut self) {
        let folded = std::mem::take(&mut self.storm.folded);
        let now = now_ns();
        if !folded.is_empty() {
            let v = ocsf::storm_event(&self.cx, &folded, self.storm.start_ns, now);
            self.metrics.alerts.inc();
            let a = Raised {
                trigger: "alert_storm",
                pool: None,
                request_id: None,
                confidence: None,
                finding: v,
            };
            self.deliver(&a);
        }
        self.storm.start = Instant::now();
        self.storm.start_ns = now;
        self.storm.sent = 0;
    }

    fn tenant(&self, id: u64) -> Tenant {
        if id == ENGINE_REQUEST {
            return Tenant::Engine;
        }
        self.requests
            .get(&id)
            .map_or(Tenant::Unknown, |r| Tenant::Customer(r.tenant.clone()))
    }

    fn external(&self, id: u64) -> Option<String> {
        self.requests.get(&id).and_then(|r| r.external_id.clone())
    }

    /// A request row was written.
    pub fn request(&mut self, r: &RequestRecord) {
        if self.requests.len() >= REQUESTS_KEPT
            && let Some(old) = self.order.pop_front()
        {
            self.requests.remove(&old);
        }
        self.order.push_back(r.request_id);
        self.requests.insert(
            r.request_id,
            Req {
                external_id: r.external_id.clone(),
                tenant: r.tenant.clone(),
                arrival_ns: r.arrival_ns,
                finish_ns: r.finish_ns,
            },
        );
        // Prefix hits this row makes decidable.
        let ready: Vec<u64> = self
            .pending_hits
            .iter()
            .filter(|(reader, (_, srcs))| {
                **reader == r.request_id || srcs.contains_key(&r.request_id)
            })
            .map(|(reader, _)| *reader)
            .collect();
        for reader in ready {
            self.try_prefix(reader);
        }
    }

    /// A decision of the engine's guard: alerted once per request when
    /// [`guard_alerted`].
    pub fn guard(&mut self, g: &GuardDecision) {
        if !guard_alerted(g) || self.guarded.contains(&g.request_id) {
            return;
        }
        if self.guarded.len() >= REQUESTS_KEPT
            && let Some(old) = self.guarded_order.pop_front()
        {
            self.guarded.remove(&old);
        }
        self.guarded.insert(g.request_id);
        self.guarded_order.push_back(g.request_id);
        let check = GuardCheck {
            request_id: g.request_id,
            external_id: self.external(g.request_id),
            tenant: self.tenant(g.request_id),
            pool: g.pool,
            verdict: g.verdict.as_str(),
            action: g.action.as_str(),
            sources: g
                .sources
                .iter()
                .map(|&s| (s, self.external(s), self.tenant(s)))
                .collect(),
            slots_read: g.slots_read,
            slots_foreign: g.slots_foreign,
            slots_unknown: g.slots_unknown,
            time_ns: g.ts_ns,
        };
        let trigger = guard_trigger(g);
        let mut v = ocsf::guard_event(&self.cx, &check);
        mark_live(&mut v, trigger, g.pool, 0);
        self.emit(Raised {
            trigger,
            pool: Some(g.pool),
            request_id: Some(g.request_id),
            confidence: None,
            finding: v,
        });
    }

    /// Events lost on `pool` (a hole in its seq stream).
    pub fn lost(&mut self, pool: u16, n: u64) {
        *self.lost.entry(pool).or_default() += n;
    }

    /// Alerts the losses gathered since the last call (once a second).
    pub fn flush_losses(&mut self, now_ns: i64) {
        for (pool, n) in std::mem::take(&mut self.lost) {
            let mut v = ocsf::degraded_event(&self.cx, pool, n, now_ns);
            mark_live(&mut v, "capture_loss", pool, 0);
            self.emit(Raised {
                trigger: "capture_loss",
                pool: Some(pool),
                request_id: None,
                confidence: None,
                finding: v,
            });
        }
    }

    /// The unclean read runs of one batch of the live replay. `suspect`:
    /// the pieces of slots the batch's read events read (pool, seq,
    /// start, end; in seq order) whose content the live view may have
    /// wrong where the trace has it right (its queue dropped events, a
    /// copy was late or timed out: `state`'s taint). A foreign run on
    /// them that is only uncertain may be the view's own doing: its read
    /// is counted (`reads_unverified`), the run not alerted; certain runs
    /// still are. Every other uncertain run is alerted, as scope reports
    /// it.
    pub fn runs(&mut self, runs: &[ReadRun], suspect: &[Suspect]) {
        let mut i = 0;
        while i < runs.len() {
            // The runs of one read event lie together.
            let r0 = runs[i];
            let mut j = i;
            while j < runs.len() && (runs[j].seq, runs[j].pool) == (r0.seq, r0.pool) {
                j += 1;
            }
            let lo = suspect.partition_point(|s| (s.0, s.1) < (r0.pool, r0.seq));
            let hi = lo + suspect[lo..].partition_point(|s| (s.0, s.1) == (r0.pool, r0.seq));
            self.event_runs(&runs[i..j], &suspect[lo..hi]);
            i = j;
        }
    }

    fn event_runs(&mut self, runs: &[ReadRun], tainted: &[Suspect]) {
        let reader = runs[0].reader;
        // Per source: tokens, whether all are certain, the certain tokens.
        let mut foreign: BTreeMap<u64, (u64, bool, u64)> = BTreeMap::new();
        let mut unverified = false;
        for r in runs {
            match r.kind {
                ReadKind::Foreign
                    if r.uncertain
                        && reader != ENGINE_REQUEST
                        && tainted.iter().any(|t| {
                            u64::from(r.slot_start) < t.3
                                && t.2 < u64::from(r.slot_start) + u64::from(r.count)
                        }) =>
                {
                    // Uncertain on slots the view may have wrong: not
                    // this read's finding.
                    unverified = true;
                }
                ReadKind::Foreign => {
                    let f = foreign.entry(r.source).or_insert((0, true, 0));
                    f.0 += r.count as u64;
                    f.1 &= !r.uncertain;
                    if !r.uncertain {
                        f.2 += r.count as u64;
                    }
                }
                ReadKind::Shared if self.tenant_prefix => {
                    if reader == ENGINE_REQUEST || r.source == ENGINE_REQUEST {
                        continue;
                    }
                    if self.prefix.contains(&reader) {
                        continue;
                    }
                    if self.pending_hits.len() >= HITS_KEPT
                        && !self.pending_hits.contains_key(&reader)
                    {
                        continue;
                    }
                    *self
                        .pending_hits
                        .entry(reader)
                        .or_insert_with(|| (r.pool, BTreeMap::new()))
                        .1
                        .entry(r.source)
                        .or_default() += r.count as u64;
                }
                _ => {}
            }
        }
        if self.pending_hits.contains_key(&reader) {
            self.try_prefix(reader);
        }
        if unverified {
            self.metrics.reads_unverified.inc();
        }
        if foreign.is_empty() || reader == ENGINE_REQUEST {
            return;
        }
        self.metrics.foreign_reads.inc();
        if !self.foreign.insert(reader) {
            return;
        }
        let certain = foreign.values().all(|v| v.1);
        let confidence = if certain {
            Confidence::Confirmed
        } else {
            Confidence::Possible
        };
        self.metrics
            .affected
            .get_or_create(&vec![(
                "confidence".to_string(),
                confidence.as_str().to_string(),
            )])
            .inc();
        let tenant = self.tenant(reader);
        let (seq, ts) = (runs[0].seq, runs[0].ts_ns);
        let pool = runs[0].pool;
        let sources: Vec<Source> = foreign
            .iter()
            .map(|(&src, &(tokens, certain, _))| {
                let st = self.tenant(src);
                let crossing = Crossing::between(&tenant, src, &st);
                Source {
                    request_id: src,
                    external_id: self.external(src),
                    tenant: st,
                    tokens,
                    first_seq: seq,
                    last_seq: seq,
                    first_ts_ns: ts,
                    last_ts_ns: ts,
                    pools: vec![pool],
                    cross_tenant: crossing.counted(),
                    confidence: if certain {
                        Confidence::Confirmed
                    } else {
                        Confidence::Possible
                    },
                }
            })
            .collect();
        let tokens: u64 = foreign.values().map(|v| v.0).sum();
        let row = self.requests.get(&reader);
        let mut a = Response {
            request_id: reader,
            external_id: self.external(reader),
            tenant,
            in_requests_table: row.is_some(),
            arrival_ns: row.map(|r| r.arrival_ns),
            finish_ns: row.and_then(|r| r.finish_ns),
            http_status: None,
            finish_reason: None,
            prompt_tokens: None,
            prefilled_tokens: None,
            output_tokens: None,
            output_hash: None,
            foreign_tokens: tokens,
            unknown_tokens: 0,
            uncertain_tokens: 0,
            exposed_tokens: tokens,
            cross_tenant: false,
            confidence,
            reasons: vec!["foreign".into()],
            first_read_ns: ts,
            last_read_ns: ts,
            sources,
        };
        a.cross_tenant = a.crossing().counted();
        let mut v = ocsf::foreign_event(&self.cx, Audience::Internal, &a);
        mark_live(&mut v, "first_foreign_read", pool, seq);
        self.emit(Raised {
            trigger: "first_foreign_read",
            pool: Some(pool),
            request_id: Some(reader),
            confidence: Some(confidence),
            finding: v,
        });
    }

    /// Alerts `reader`'s pending prefix hits once its tenant and a
    /// source's are known and differ; forgets the ones of its own tenant.
    fn try_prefix(&mut self, reader: u64) {
        let Some((pool, srcs)) = self.pending_hits.get(&reader) else {
            return;
        };
        let pool = *pool;
        let tenant = self.tenant(reader);
        if tenant.customer().is_none() {
            return;
        }
        let mut crossing: Vec<SharedSource> = Vec::new();
        let mut undecided = false;
        for (&src, &tokens) in srcs {
            let st = self.tenant(src);
            match Crossing::between(&tenant, src, &st) {
                Crossing::Yes => crossing.push(SharedSource {
                    request_id: src,
                    tenant: st,
                    tokens,
                }),
                Crossing::Unknown => undecided = true,
                Crossing::No => {}
            }
        }
        if crossing.is_empty() {
            if !undecided {
                self.pending_hits.remove(&reader);
            }
            return;
        }
        self.pending_hits.remove(&reader);
        self.prefix.insert(reader);
        self.metrics.prefix_hits.inc();
        let row = self.requests.get(&reader);
        let t = PrefixTime {
            arrival_ns: row.map(|r| r.arrival_ns),
            finish_ns: row.and_then(|r| r.finish_ns),
            fallback_ns: 0,
        };
        let h = SharedHit {
            request_id: reader,
            external_id: self.external(reader),
            tenant,
            tokens: crossing.iter().map(|s| s.tokens).sum(),
            sources: crossing,
        };
        let mut v = ocsf::prefix_event(&self.cx, Audience::Internal, &h, &t);
        mark_live(&mut v, "cross_tenant_prefix_hit", pool, 0);
        self.emit(Raised {
            trigger: "cross_tenant_prefix_hit",
            pool: Some(pool),
            request_id: Some(reader),
            confidence: None,
            finding: v,
        });
    }

    /// Responses alerted for a foreign read.
    pub fn alerted(&self) -> BTreeSet<u64> {
        self.foreign.iter().copied().collect()
    }

    /// Sends the storm summary still open, then stops the delivery
    /// threads after they delivered what is queued (Alertmanager within
    /// its close grace).
    pub fn close(mut self) {
        self.end_window();
        if let Some(s) = self.sink.take() {
            s.close();
        }
        if let Some(d) = self.am.take() {
            d.close();
        }
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// Alertmanager's name and severity of each trigger, and what to do
/// first (docs/live.md).
fn am_kind(trigger: &str, folded_foreign: bool) -> (&'static str, &'static str, &'static str) {
    match trigger {
        "first_foreign_read" => (
            "KvtrailForeignRead",
            "critical",
            "A response read KV another request wrote. Take the response (finding: request_id, external_id) out of circulation, keep the sidecar running, then run kvtrail scope on the trace.",
        ),
        "cross_tenant_prefix_hit" => (
            "KvtrailCrossTenantPrefixHit",
            "warning",
            "A prefix-cache hit crossed tenants where prefix caches are per tenant. Check the engine's cache salt / namespace configuration.",
        ),
        "guard_foreign_read" => (
            "KvtrailGuardForeignRead",
            "critical",
            "The guard in the engine found KV of another request in what a request was about to read, before its first token; the finding says whether it was aborted (action). If it was not, take the response out of circulation; then run kvtrail scope on the trace.",
        ),
        "guard_abort" => (
            "KvtrailGuardAbort",
            "warning",
            "The guard in the engine aborted a request whose KV owner it could not see (KVTRAIL_GUARD_UNKNOWN=abort). Check the engine's connection to the sidecar and the hook's losses; the client got an error.",
        ),
        "capture_loss" => (
            "KvtrailCaptureLoss",
            "warning",
            "KV events were lost: live detection is degraded on this pool. Fix the cause (record's health lines); later reads are uncertain.",
        ),
        _ if folded_foreign => (
            "KvtrailAlertStorm",
            "critical",
            "Too many alerts to send one by one: this one counts the rest, foreign reads among them. Every finding is in live-findings.json at close and in kvtrail scope.",
        ),
        _ => (
            "KvtrailAlertStorm",
            "warning",
            "Too many alerts to send one by one: this one counts the rest. Every finding is in live-findings.json at close and in kvtrail scope.",
        ),
    }
}

/// The Alertmanager alert of a raised one: no tenant or customer data in
/// the labels; the finding in the annotations.
fn am_alert(deployment: &str, a: &Raised) -> AmAlert {
    let folded_foreign = ["first_foreign_read", "guard_foreign_read"]
        .iter()
        .any(|t| {
            a.finding
                .pointer(&format!("/unmapped/folded/{t}"))
                .is_some()
        });
    let (name, severity, first) = am_kind(a.trigger, folded_foreign);
    let mut labels = serde_json::Map::new();
    labels.insert("alertname".into(), name.into());
    labels.insert("severity".into(), severity.into());
    labels.insert("deployment".into(), deployment.into());
    if let Some(p) = a.pool {
        labels.insert("pool".into(), p.to_string().into());
    }
    if let Some(r) = a.request_id {
        labels.insert("request_id".into(), r.to_string().into());
    }
    if let Some(c) = a.confidence {
        labels.insert("confidence".into(), c.as_str().into());
    }
    let mut ann = serde_json::Map::new();
    let summary = a
        .finding
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or(name);
    ann.insert("summary".into(), summary.into());
    ann.insert("description".into(), first.into());
    ann.insert("trigger".into(), a.trigger.into());
    ann.insert("finding".into(), a.finding.to_string().into());
    AmAlert {
        labels,
        annotations: ann,
    }
}

/// Marks an alert as the live sidecar's: what raised it, and where.
fn mark_live(v: &mut Value, trigger: &str, pool: u16, seq: u64) {
    if let Some(u) = v.get_mut("unmapped").and_then(Value::as_object_mut) {
        u.insert("source".into(), "kvtrail record (live)".into());
        u.insert("trigger".into(), trigger.into());
        u.insert("pool".into(), pool.into());
        if trigger == "first_foreign_read" {
            u.insert("seq".into(), seq.into());
        }
    }
}
