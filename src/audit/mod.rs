//! `kvtrail audit`: a deploy gate for the incident's root cause and its
//! siblings.
//!
//! (a) Deployment (a simulator config, or a trace's manifest): every pool
//! against the context window. SGLang's admission limit of a pool is
//! max_req_input_len = min(context_window - 1, capacity - 1) - 5; a prefill
//! pool whose limit is below a decode pool's lets prompts in between be
//! rejected by prefill and accepted by decode: the incident (0.5.19: stale
//! KV with HTTP 200; 0.5.20+: HTTP 500 after the waiting timeout while
//! decode capacity is held). Also page sizes, allow_auto_truncate (the
//! stale-tail residual risk, every version), the KV checksum and the scrub
//! policy, with a recommendation (pool >= 2x context window).
//!
//! (b) Trace: internally rejected yet 2xx, prefilled < prompt with 2xx,
//! decode reads beyond what was transferred (a decode slot read by R whose
//! last write was not on R's behalf, without a share grant), transfers
//! landing in slots another request holds (reuse while a transfer was in
//! flight) and transfers copying source slots the request no longer held.
//! The KV checks run through the replay scheduler with a small backend of
//! their own (slot holder and last writer per slot).
//!
//! Severity: `error` and `warning` are findings (exit 1); `note` is advice.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::lineage::backend::{Backend, Counters, ReadRun, SlotVal};
use crate::lineage::slots::SlotVec;
use crate::lineage::state::{Grants, StaleBits};
use crate::lineage::{LineageOptions, run_with};
use crate::progress::Reporter;
use crate::schema::{KvEvent, Op};
use crate::sim::config::{EngineVersion, SimConfig};
use crate::trace::manifest::{Manifest, Role, max_req_input_len};
use crate::trace::read::Trace;

use crate::whatif::workload::{parse_engine, pool_tokens};

/// How serious a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
    Note,
}

/// One audit finding.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    pub kind: String,
    /// Pool id, or request id for trace findings.
    pub subject: Option<String>,
    pub detail: String,
    pub recommendation: Option<String>,
    /// Trace findings: requests involved (sorted, at most 100 listed).
    pub request_ids: Vec<u64>,
    pub count: u64,
}

/// One pool as the audit sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    pub id: u16,
    pub name: String,
    pub role: String,
    /// SGLang max_total_num_tokens.
    pub capacity_tokens: u64,
    pub page_size: u32,
    pub max_req_input_len: u64,
}

/// The deployment as audited; knobs are None when the source does not say.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeploymentView {
    pub source: String,
    pub engine: String,
    pub context_window: u64,
    pub pools: Vec<PoolView>,
    pub allow_auto_truncate: Option<bool>,
    pub kv_checksum: Option<bool>,
    pub scrub_on_free: Option<bool>,
}

/// The audit report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditReport {
    pub format: String,
    pub version: u64,
    pub deployment: DeploymentView,
    /// Trace checks ran (a trace was given).
    pub trace_checked: bool,
    pub findings: Vec<Finding>,
    pub errors: u64,
    pub warnings: u64,
    pub notes: u64,
    pub verdict: String,
}

impl AuditReport {
    /// Exit code of a deploy gate: 1 on errors or warnings.
    pub fn exit_code(&self) -> i32 {
        if self.errors + self.warnings > 0 {
            1
        } else {
            0
        }
    }
}

impl DeploymentView {
    pub fn from_config(cfg: &SimConfig, source: &str) -> DeploymentView {
        let pool = |id: u16, name: &str, role: &str, p: &crate::sim::config::PoolConfig| PoolView {
            id,
            name: name.into(),
            role: role.into(),
            capacity_tokens: p.capacity_tokens,
            page_size: p.page_size,
            max_req_input_len: max_req_input_len(cfg.context_window, p.capacity_tokens),
        };
        DeploymentView {
            source: source.into(),
            engine: cfg.engine.name().into(),
            context_window: cfg.context_window,
            pools: vec![
                pool(0, "prefill-0", "prefill", &cfg.prefill),
                pool(1, "decode-0", "decode", &cfg.decode),
            ],
            allow_auto_truncate: Some(cfg.allow_auto_truncate),
            kv_checksum: Some(cfg.kv_checksum),
            scrub_on_free: Some(cfg.scrub_on_free),
        }
    }

    pub fn from_manifest(m: &Manifest, source: &str) -> DeploymentView {
        if let Some(v) = m.deployment.extra.get("simulator")
            && let Ok(cfg) = serde_json::from_value::<SimConfig>(v.clone())
        {
            return DeploymentView::from_config(&cfg, source);
        }
        let d = &m.deployment;
        DeploymentView {
            source: source.into(),
            engine: d.engine.clone(),
            context_window: d.context_window,
            pools: d
                .pools
                .iter()
                .map(|p| PoolView {
                    id: p.id,
                    name: p.name.clone(),
                    role: p.role.as_str().into(),
                    capacity_tokens: pool_tokens(p),
                    page_size: p.page_size,
                    max_req_input_len: max_req_input_len(d.context_window, pool_tokens(p)),
                })
                .collect(),
            allow_auto_truncate: None,
            kv_checksum: None,
            scrub_on_free: None,
        }
    }

    /// Reads a deployment file: a simulator config (TOML, or JSON), or a
    /// trace manifest (trace.json, or a trace directory).
    pub fn load(path: &Path) -> Result<DeploymentView> {
        let source = path.display().to_string();
        if path.is_dir() {
            return Ok(DeploymentView::from_manifest(
                &Manifest::load(path)?,
                &source,
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        if path.extension().is_some_and(|e| e == "json")
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && v.get("format").and_then(|f| f.as_str()) == Some("kvtrail-trace")
        {
            let m = Manifest::parse(&text, path)?;
            return Ok(DeploymentView::from_manifest(&m, &source));
        }
        let cfg = SimConfig::load(path).map_err(|e| match e {
            Error::Invalid { loc, what, .. } => Error::Invalid {
                loc,
                what,
                hint: "give a deployment config (TOML/JSON, keys of docs/simulator.md) or a trace.json".into(),
            },
            other => other,
        })?;
        Ok(DeploymentView::from_config(&cfg, &source))
    }
}

fn fmt_n(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn finding(
    sev: Severity,
    kind: &str,
    subject: Option<String>,
    detail: String,
    rec: Option<String>,
) -> Finding {
    Finding {
        severity: sev,
        kind: kind.into(),
        subject,
        detail,
        recommendation: rec,
        request_ids: Vec::new(),
        count: 1,
    }
}

/// Deployment checks.
pub fn audit_deployment(d: &DeploymentView) -> Vec<Finding> {
    let mut out = Vec::new();
    let ctx = d.context_window;
    let rec_cap = 2 * ctx;
    let recommend = format!(
        "give every prefill and decode pool capacity_tokens >= 2 x context_window ({}), as the operator chose after the incident; at the very least the context window ({}), so that the pool is not what limits max_req_input_len (then it is context_window - 6 on every pool alike)",
        fmt_n(rec_cap),
        fmt_n(ctx)
    );
    let front_limit = ctx.saturating_sub(1);
    let max_decode = d
        .pools
        .iter()
        .filter(|p| p.role == "decode" || p.role == "mixed")
        .map(|p| p.max_req_input_len)
        .max();
    let engine = parse_engine(&d.engine);
    for p in &d.pools {
        let subject = Some(format!("pool {} ({})", p.id, p.name));
        // The pool binds when capacity - 1 < context_window - 1; otherwise
        // the limit is context_window - 6 on every pool (SGLang's margin).
        let covers = p.capacity_tokens >= ctx;
        if p.role == "prefill"
            && let Some(dl) = max_decode
            && p.max_req_input_len < dl
        {
            let hi = dl.min(ctx) - 1;
            let mut consequence = match engine {
                Some(EngineVersion::V0519) => "under sglang-0.5.19 prefill forwards a 1-token placeholder and decode generates over its whole preallocation of stale KV from other requests, answered HTTP 200 (the incident)".to_string(),
                Some(_) => format!("under {} prefill answers 400 but decode, which preallocated the prompt, waits out its timeout (HTTP 500 after ~300 s with the decode-answer router) and holds that decode capacity until then", d.engine),
                None => format!("engine `{}`: depending on the version this is the incident (0.5.19: stale KV, HTTP 200) or a 500 after decode's timeout with decode capacity held (0.5.20+)", d.engine),
            };
            if d.allow_auto_truncate == Some(true) {
                consequence.push_str("; with allow_auto_truncate on, prefill truncates and sends a short transfer marked last, and decode reads the stale tail with HTTP 200 in every version");
                if d.kv_checksum == Some(true) {
                    consequence.push_str(" (the KV checksum turns that into a 500)");
                }
            }
            out.push(finding(
                Severity::Error,
                "prefill_pool_below_decode_limit",
                subject,
                format!(
                    "prefill pool of {} tokens: max_req_input_len = min({} - 1, {} - 1) - 5 = {}, below decode's {}; prompts of {}..={} tokens pass the front end and decode but are rejected by prefill: {consequence}",
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx),
                    fmt_n(p.capacity_tokens),
                    fmt_n(p.max_req_input_len),
                    fmt_n(dl),
                    fmt_n(p.max_req_input_len),
                    fmt_n(hi),
                ),
                Some(recommend.clone()),
            ));
        } else if !covers {
            out.push(finding(
                Severity::Warning,
                "pool_below_context_window",
                subject,
                format!(
                    "{} pool of {} tokens is smaller than the {}-token context window: max_req_input_len = {} (the pool binds, not the context window); prompts of {}..={} tokens pass the front end but are rejected here",
                    p.role,
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx),
                    fmt_n(p.max_req_input_len),
                    fmt_n(p.max_req_input_len),
                    fmt_n(front_limit)
                ),
                Some(recommend.clone()),
            ));
        } else if p.capacity_tokens < rec_cap && p.role != "mixed" {
            out.push(finding(
                Severity::Note,
                "pool_headroom",
                subject,
                format!(
                    "{} pool of {} tokens covers the context window but holds fewer than two maximal requests",
                    p.role,
                    fmt_n(p.capacity_tokens)
                ),
                Some(recommend.clone()),
            ));
        }
    }
    let sizes: std::collections::BTreeSet<u32> = d
        .pools
        .iter()
        .filter(|p| p.role != "mixed")
        .map(|p| p.page_size)
        .collect();
    if sizes.len() > 1 {
        out.push(finding(
            Severity::Warning,
            "page_size_mismatch",
            None,
            format!(
                "prefill and decode pools use different page sizes ({:?}); transfers map pages one to one and a partial last page can carry stale slots",
                sizes
            ),
            Some("use one page size across the PD pools".into()),
        ));
    }
    match d.scrub_on_free {
        Some(true) => {}
        Some(false) => out.push(finding(
            Severity::Note,
            "no_scrub_on_free",
            None,
            "freed KV is not zeroed (SGLang never zeroes it): any stale read exposes the previous occupant's KV".into(),
            Some("scrub-on-free (a mitigation, not an SGLang option) turns a stale read into a blank one".into()),
        )),
        None => out.push(finding(
            Severity::Note,
            "scrub_policy_unknown",
            None,
            "the manifest does not say whether freed KV is zeroed; SGLang does not zero it".into(),
            None,
        )),
    }
    if matches!(engine, Some(EngineVersion::V0519)) {
        out.push(finding(
            Severity::Note,
            "engine_has_placeholder_bug",
            None,
            "sglang-0.5.19 answers a prompt only prefill rejects with a placeholder and HTTP 200; harmless only while no pool is below the decode limit".into(),
            Some("upgrade to sglang-0.5.22 or later".into()),
        ));
    }
    out
}

// ---- trace checks --------------------------------------------------------

const FREE: u64 = u64::MAX;

/// Holder and last writer per slot, paged (memory follows the slots the
/// trace touches, not the declared capacity).
struct PoolSt {
    decode: bool,
    holder: SlotVec<u64>,
    writer: SlotVec<u64>,
    /// seq + 1 of the event that last set each slot's content.
    wseq1: SlotVec<u64>,
    stale: StaleBits,
    grants: Grants,
}

#[derive(Default)]
struct KvFindings {
    /// request -> slots read beyond what was written for it
    beyond: BTreeMap<u64, u64>,
    /// request -> slots of its transfer that landed in another's slots
    reused: BTreeMap<u64, u64>,
    /// request -> source slots it did not hold when copied
    stale_src: BTreeMap<u64, u64>,
}

struct AuditBackend {
    pools: HashMap<u16, PoolSt>,
    roles: HashMap<u16, Role>,
    f: KvFindings,
}

impl AuditBackend {
    fn pool(&mut self, id: u16) -> Result<&mut PoolSt> {
        self.pools
            .get_mut(&id)
            .ok_or_else(|| Error::Other(format!("audit: pool {id} was not declared")))
    }
}

/// Whether `r` held a share grant on slot `s` of `p` (whatever happened to
/// the slot since).
fn granted(p: &PoolSt, r: u64, s: u64) -> bool {
    p.grants.of(r).iter().any(|g| g.start <= s && s < g.end)
}

impl Backend for AuditBackend {
    fn name(&self) -> &'static str {
        "cpu-audit"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, _f: bool) -> Result<()> {
        self.pools.insert(
            pool,
            PoolSt {
                decode: self.roles.get(&pool) == Some(&Role::Decode),
                holder: SlotVec::new(capacity, FREE),
                writer: SlotVec::new(capacity, FREE),
                wseq1: SlotVec::new(capacity, 0),
                stale: StaleBits::new(capacity),
                grants: Grants::default(),
            },
        );
        Ok(())
    }

    fn mark_gap(&mut self, _pool: u16, _before_seq: u64) {}

    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        _out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let mut f = std::mem::take(&mut self.f);
        let p = self.pool(pool)?;
        for e in events {
            c.events += 1;
            let (a, b) = (e.slot_start as u64, e.slot_end());
            let r = e.request_id;
            match e.op {
                Op::Alloc => {
                    p.holder.fill(a, b, r);
                    p.stale.alloc(a, b);
                }
                Op::Free => {
                    p.holder.fill(a, b, FREE);
                    p.grants.release(r, a, b);
                }
                Op::Write | Op::Scrub => {
                    let w = if e.op == Op::Write { r } else { FREE };
                    p.writer.fill(a, b, w);
                    p.wseq1.fill(a, b, e.seq + 1);
                    p.stale.set_current(a, b);
                }
                Op::Share => {
                    p.grants.share(&p.stale, r, a, b, e.seq);
                }
                Op::Read => {
                    if !p.decode {
                        continue;
                    }
                    let n = (a..b)
                        .zip(p.writer.range(a, b))
                        .filter(|&(s, w)| w != r && !p.grants.covered(r, s, p.wseq1.get(s)))
                        .count() as u64;
                    if n > 0 {
                        *f.beyond.entry(r).or_default() += n;
                    }
                }
            }
        }
        self.f = f;
        Ok(())
    }

    fn apply_copy(
        &mut self,
        pool: u16,
        e: &KvEvent,
        payload: &[SlotVal],
        c: &mut Counters,
    ) -> Result<()> {
        c.events += 1;
        let r = e.request_id;
        let stale = match &e.src {
            Some(src) => {
                let sp = self.pools.get(&src.pool);
                payload
                    .iter()
                    .enumerate()
                    .filter(|(i, v)| {
                        v.owner != r
                            && !sp
                                .is_some_and(|sp| granted(sp, r, src.slot_start as u64 + *i as u64))
                    })
                    .count() as u64
            }
            None => 0,
        };
        let p = self.pool(pool)?;
        let (a, b) = (e.slot_start as u64, e.slot_end());
        let reused = p.holder.range(a, b).filter(|&h| h != r).count() as u64;
        p.writer.fill(a, b, r);
        p.wseq1.fill(a, b, e.seq + 1);
        p.stale.copy(a, b, |i| payload[i].stale);
        if stale > 0 {
            *self.f.stale_src.entry(r).or_default() += stale;
        }
        if reused > 0 {
            *self.f.reused.entry(r).or_default() += reused;
        }
        Ok(())
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Vec<SlotVal>,
    ) -> Result<()> {
        let p = self.pool(pool)?;
        let a = slot_start as u64;
        out.clear();
        out.extend(
            p.holder
                .range(a, a + count as u64)
                .zip(a..)
                .map(|(owner, s)| SlotVal {
                    owner,
                    uncertain,
                    stale: p.stale.is_stale(s),
                }),
        );
        Ok(())
    }
}

fn listed(ids: &[u64]) -> Vec<u64> {
    ids.iter().take(100).copied().collect()
}

/// Trace checks (requests table and KV events).
pub fn audit_trace_events(
    trace: &Trace,
    d: &DeploymentView,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<Vec<Finding>> {
    let mut out = Vec::new();
    let prefill_limits: HashMap<u16, u64> = d
        .pools
        .iter()
        .filter(|p| p.role == "prefill" || p.role == "mixed")
        .map(|p| (p.id, p.max_req_input_len))
        .collect();
    let only_prefill =
        (prefill_limits.len() == 1).then(|| *prefill_limits.keys().next().expect("one"));
    let (mut rejected_ok, mut short_ok) = (Vec::new(), Vec::new());
    for b in trace.requests() {
        for r in b? {
            if !(200..300).contains(&r.http_status) {
                continue;
            }
            if let Some(pool) = r.prefill_pool.or(only_prefill)
                && let Some(&lim) = prefill_limits.get(&pool)
                && r.prompt_tokens as u64 >= lim
                && r.prompt_tokens as u64 + 1 < d.context_window
            {
                rejected_ok.push(r.request_id);
            }
            if let Some(pf) = r.prefilled_tokens
                && pf < r.prompt_tokens
            {
                short_ok.push(r.request_id);
            }
        }
    }
    rejected_ok.sort_unstable();
    short_ok.sort_unstable();
    if !rejected_ok.is_empty() {
        let mut f = finding(
            Severity::Error,
            "rejected_yet_2xx",
            None,
            format!(
                "{} requests had prompts at or above their prefill pool's max_req_input_len (prefill must reject them) yet were answered 2xx",
                rejected_ok.len()
            ),
            Some("run `kvtrail scope` on this trace and fix the pool sizes (see the deployment findings)".into()),
        );
        f.count = rejected_ok.len() as u64;
        f.request_ids = listed(&rejected_ok);
        out.push(f);
    }
    if !short_ok.is_empty() {
        let mut f = finding(
            Severity::Error,
            "prefilled_less_than_prompt_2xx",
            None,
            format!("{} requests were answered 2xx although prefill computed fewer tokens than their prompt", short_ok.len()),
            Some("an error that looked like success: run `kvtrail scope` to see what decode read instead".into()),
        );
        f.count = short_ok.len() as u64;
        f.request_ids = listed(&short_ok);
        out.push(f);
    }
    let mut backend = AuditBackend {
        pools: HashMap::new(),
        roles: trace
            .deployment()
            .pools
            .iter()
            .map(|p| (p.id, p.role))
            .collect(),
        f: KvFindings::default(),
    };
    let outcome = run_with(trace, &mut backend, opts, rep)?;
    let kinds: [(&BTreeMap<u64, u64>, &str, &str, &str); 3] = [
        (
            &backend.f.beyond,
            "decode_read_beyond_transfer",
            "decode read slots that were neither written for the request nor transferred to it nor shared with it",
            "the transfer was shorter than what decode attends over: upgrade past 0.5.19, keep allow_auto_truncate off, or turn the KV checksum on",
        ),
        (
            &backend.f.reused,
            "transfer_into_reused_slots",
            "a transfer landed in decode slots that another request held at that moment (slots reused while the transfer was in flight, #24527 class)",
            "decode must not free slots while a transfer into them is in flight",
        ),
        (
            &backend.f.stale_src,
            "transfer_from_released_slots",
            "a transfer copied source slots the request no longer held (freed and possibly rewritten before the copy, vLLM #52234 class)",
            "prefill must keep its slots until the transfer has read them",
        ),
    ];
    for (m, kind, what, rec) in kinds {
        if m.is_empty() {
            continue;
        }
        let ids: Vec<u64> = m.keys().copied().collect();
        let slots: u64 = m.values().sum();
        let mut f = finding(
            Severity::Error,
            kind,
            None,
            format!("{}: {} requests, {} slots", what, ids.len(), slots),
            Some(rec.into()),
        );
        f.count = ids.len() as u64;
        f.request_ids = listed(&ids);
        out.push(f);
    }
    // The same rule as scope's coverage: files, capture, holes.
    let cov = crate::scope::replay_coverage(trace, &outcome, rep)?;
    if !cov.complete {
        // Worded without paths, like a notification pack: audit's output
        // is a gate's log; `kvtrail scope` and `verify` name the files.
        let notes = crate::scope::customer_notes(&cov);
        out.push(finding(
            Severity::Warning,
            "evidence_incomplete",
            None,
            format!(
                "the evidence is incomplete ({} coverage notes: {}): the checks above cover only the recorded events",
                notes.len(),
                notes.join("; ")
            ),
            Some("a clean audit needs complete evidence: run `kvtrail verify` and `kvtrail scope` on the trace for the files and holes".into()),
        ));
    }
    Ok(out)
}

/// Builds the report from findings.
pub fn report(d: DeploymentView, mut findings: Vec<Finding>, trace_checked: bool) -> AuditReport {
    findings
        .sort_by(|a, b| (a.severity, &a.kind, &a.subject).cmp(&(b.severity, &b.kind, &b.subject)));
    let n = |s: Severity| findings.iter().filter(|f| f.severity == s).count() as u64;
    let (errors, warnings, notes) = (n(Severity::Error), n(Severity::Warning), n(Severity::Note));
    let verdict = if errors + warnings == 0 {
        format!("pass: no errors or warnings ({notes} notes)")
    } else {
        format!("FAIL: {errors} errors, {warnings} warnings, {notes} notes")
    };
    AuditReport {
        format: "kvtrail-audit".into(),
        version: 1,
        deployment: d,
        trace_checked,
        findings,
        errors,
        warnings,
        notes,
        verdict,
    }
}

/// Audits a deployment file.
pub fn audit_file(path: &Path) -> Result<AuditReport> {
    let d = DeploymentView::load(path)?;
    let f = audit_deployment(&d);
    Ok(report(d, f, false))
}

/// Audits a trace: its manifest's deployment, its requests and its events.
pub fn audit_trace(
    trace: &Trace,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<AuditReport> {
    let d = DeploymentView::from_manifest(&trace.manifest, &trace.dir.display().to_string());
    let mut f = audit_deployment(&d);
    f.extend(audit_trace_events(trace, &d, opts, rep)?);
    Ok(report(d, f, true))
}
