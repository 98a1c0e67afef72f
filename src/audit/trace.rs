//! `kvtrail audit`'s trace checks: internally rejected yet 2xx, prefilled
//! < prompt with 2xx, decode reads beyond what was transferred, transfers
//! landing in slots another request holds and transfers copying source
//! slots the request no longer held. The KV checks run through the lineage
//! scheduler with a backend of their own: slot holder and last writer per
//! slot, the events applied by the slot rule (`lineage::rule`, the same
//! transition scope replays, so a grant outlives a `free` here too).

use super::deployment::DeploymentView;
use super::finding::{Finding, Severity, finding};
use crate::error::{Error, Result};
use crate::lineage::backend::{Backend, Counters, Payload, ReadRun, SlotVal};
use crate::lineage::grants::{GRANTS_IN_MEMORY, Grants};
use crate::lineage::rule::{PoolState, SlotData};
use crate::lineage::slots::SlotVec;
use crate::lineage::state::{Grant, SCRUBBED};
use crate::lineage::{LineageOptions, run_with};
use crate::progress::Reporter;
use crate::schema::KvEvent;
use crate::trace::manifest::Role;
use crate::trace::read::Trace;
use std::collections::{BTreeMap, HashMap};

const FREE: u64 = u64::MAX;

/// Holder and last writer per slot, paged (memory follows the slots the
/// trace touches, not the declared capacity).
struct PoolSt {
    slots: AuditSlots,
    /// Stale bits and share grants. Every grant is kept (spilled to disk
    /// past `GRANTS_IN_MEMORY`): the transfer check asks whether the
    /// request was ever granted a source slot.
    rule: PoolState,
}

/// What the audit keeps per slot (`rule::SlotData`).
struct AuditSlots {
    decode: bool,
    holder: SlotVec<u64>,
    writer: SlotVec<u64>,
    /// seq + 1 of the event that last set each slot's content.
    wseq1: SlotVec<u64>,
    /// Reads beyond what was written for the reader, this batch.
    beyond: BTreeMap<u64, u64>,
}

impl SlotData for AuditSlots {
    fn alloc(&mut self, e: &KvEvent, a: u64, b: u64) {
        self.holder.fill(a, b, e.request_id);
    }

    fn free(&mut self, _e: &KvEvent, a: u64, b: u64) {
        self.holder.fill(a, b, FREE);
    }

    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()> {
        let w = if owner == SCRUBBED { FREE } else { owner };
        self.writer.fill(a, b, w);
        self.wseq1.fill(a, b, e.seq + 1);
        Ok(())
    }

    /// The copying request becomes the slots' writer.
    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, _v: SlotVal) -> Result<()> {
        self.writer.fill(a, b, e.request_id);
        self.wseq1.fill(a, b, e.seq + 1);
        Ok(())
    }

    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()> {
        if !self.decode {
            return Ok(());
        }
        let r = e.request_id;
        let g = grants.lookup(r)?;
        let wseq1 = &self.wseq1;
        let n = (a..b)
            .zip(self.writer.range(a, b))
            .filter(|&(s, w)| w != r && !g.iter().any(|x| x.covers(s, wseq1.get(s))))
            .count() as u64;
        if n > 0 {
            *self.beyond.entry(r).or_default() += n;
        }
        Ok(())
    }

    /// Every grant is kept (see `PoolSt::rule`).
    fn alive(&self, _g: &Grant) -> bool {
        true
    }
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

/// Whether `r` held a share grant on slot `s` of a pool whose grants are
/// `grants` (whatever happened to the slot since).
fn granted(grants: &[Grant], s: u64) -> bool {
    grants.iter().any(|g| g.start() <= s && s < g.end())
}

impl Backend for AuditBackend {
    fn name(&self) -> &'static str {
        "cpu-audit"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, _f: bool) -> Result<()> {
        self.pools.insert(
            pool,
            PoolSt {
                slots: AuditSlots {
                    decode: self.roles.get(&pool) == Some(&Role::Decode),
                    holder: SlotVec::new(capacity, FREE),
                    writer: SlotVec::new(capacity, FREE),
                    wseq1: SlotVec::new(capacity, 0),
                    beyond: BTreeMap::new(),
                },
                rule: PoolState::new(capacity, Grants::spilling(GRANTS_IN_MEMORY)),
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
        let p = self.pool(pool)?;
        for e in events {
            c.events += 1;
            p.rule
                .apply(&mut p.slots, e, e.slot_start as u64, e.slot_end())?;
        }
        for (r, n) in std::mem::take(&mut p.slots.beyond) {
            *self.f.beyond.entry(r).or_default() += n;
        }
        Ok(())
    }

    fn apply_copy(
        &mut self,
        pool: u16,
        e: &KvEvent,
        payload: &Payload,
        c: &mut Counters,
    ) -> Result<()> {
        c.events += 1;
        let r = e.request_id;
        let stale = match &e.src {
            Some(src) => match self.pools.get_mut(&src.pool) {
                Some(sp) => {
                    let held = sp.rule.grants.lookup(r)?;
                    payload
                        .iter()
                        .enumerate()
                        .filter(|(i, v)| {
                            v.owner != r && !granted(held, src.slot_start as u64 + *i as u64)
                        })
                        .count() as u64
                }
                None => payload.iter().filter(|v| v.owner != r).count() as u64,
            },
            None => 0,
        };
        let p = self.pool(pool)?;
        let (a, b) = (e.slot_start as u64, e.slot_end());
        let reused = p.slots.holder.range(a, b).filter(|&h| h != r).count() as u64;
        p.rule.copy_payload(&mut p.slots, e, a, payload)?;
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
        out: &mut Payload,
    ) -> Result<()> {
        let p = self.pool(pool)?;
        let a = slot_start as u64;
        out.clear();
        out.extend(
            p.slots
                .holder
                .range(a, a + count as u64)
                .zip(a..)
                .map(|(owner, s)| SlotVal {
                    owner,
                    uncertain,
                    stale: p.rule.stale.is_stale(s),
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
    // What the engine does with a prompt at or over its prefill pool's
    // limit (docs/what-if.md, "Trace checks"): SGLang rejects it, or
    // truncates it to the limit under --allow-auto-truncate (every
    // version); vLLM's limit is max_model_len, refused at its front end.
    let truncation = if d.vllm.is_some() {
        Some(false)
    } else {
        d.allow_auto_truncate
    };
    let (mut rejected_ok, mut short_ok, mut truncated, mut maybe_truncated) =
        (Vec::new(), Vec::new(), 0u64, Vec::new());
    for b in trace.requests() {
        for r in b? {
            if !(200..300).contains(&r.http_status) {
                continue;
            }
            let prompt = r.prompt_tokens as u64;
            let lim = r
                .prefill_pool
                .or(only_prefill)
                .and_then(|pool| prefill_limits.get(&pool).copied());
            let over = lim.is_some_and(|l| prompt >= l);
            // The length auto-truncation leaves: the tokenizer cuts to
            // context_window - 1, the scheduler to max_req_input_len.
            let cut = prompt
                .min(d.context_window.saturating_sub(1))
                .min(lim.unwrap_or(u64::MAX));
            let pf = r.prefilled_tokens.map(u64::from);
            // Without truncation the front end refuses prompt >=
            // context_window; a shorter one over the limit is the
            // scheduler's to reject.
            let rejected = over && prompt < d.context_window;
            match truncation {
                Some(true) => {
                    // Nothing is rejected; truncation to `cut` is what the
                    // engine documents, anything shorter is not.
                    if pf.is_some_and(|pf| pf < cut) {
                        short_ok.push(r.request_id);
                    } else if over || cut < prompt {
                        truncated += 1;
                    }
                }
                Some(false) => {
                    if rejected {
                        rejected_ok.push(r.request_id);
                    }
                    if pf.is_some_and(|pf| pf < prompt) {
                        short_ok.push(r.request_id);
                    }
                }
                None => {
                    // The deployment does not say whether it truncates: a
                    // prompt over the limit prefilled to exactly the
                    // truncated length is either; anything else is an
                    // error either way.
                    if over && pf == Some(cut) {
                        maybe_truncated.push(r.request_id);
                        continue;
                    }
                    if rejected {
                        rejected_ok.push(r.request_id);
                    }
                    if pf.is_some_and(|pf| pf < prompt) {
                        short_ok.push(r.request_id);
                    }
                }
            }
        }
    }
    rejected_ok.sort_unstable();
    short_ok.sort_unstable();
    maybe_truncated.sort_unstable();
    if !rejected_ok.is_empty() {
        let mut f = finding(
            Severity::Error,
            "rejected_yet_2xx",
            None,
            format!(
                "{} had prompts at or above their prefill pool's max_req_input_len (prefill must reject them) yet {} answered 2xx",
                crate::whatif::count(rejected_ok.len() as u64, "request", "requests"),
                if rejected_ok.len() == 1 { "was" } else { "were" }
            ),
            Some("run `kvtrail scope` on this trace and fix the pool sizes (see the deployment findings)".into()),
        );
        f.count = rejected_ok.len() as u64;
        f.request_ids = listed(&rejected_ok);
        out.push(f);
    }
    if !short_ok.is_empty() {
        let truncating = if truncation == Some(true) {
            ", and fewer than auto-truncation to max_req_input_len leaves"
        } else {
            ""
        };
        let mut f = finding(
            Severity::Error,
            "prefilled_less_than_prompt_2xx",
            None,
            format!(
                "{} answered 2xx although prefill computed fewer tokens than their prompt{truncating}",
                crate::whatif::count(short_ok.len() as u64, "request was", "requests were"),
            ),
            Some("an error that looked like success: run `kvtrail scope` to see what decode read instead".into()),
        );
        f.count = short_ok.len() as u64;
        f.request_ids = listed(&short_ok);
        out.push(f);
    }
    if !maybe_truncated.is_empty() {
        let mut f = finding(
            Severity::Warning,
            "truncated_or_rejected_2xx",
            None,
            format!(
                "{} at or above their prefill pool's max_req_input_len answered 2xx with exactly the tokens --allow-auto-truncate leaves prefilled; the deployment does not say whether it truncates (if it does not, prefill must have rejected them)",
                crate::whatif::count(maybe_truncated.len() as u64, "prompt", "prompts"),
            ),
            Some("record deployment.allow_auto_truncate in trace.json (true or false) so the audit can tell, and run `kvtrail scope` on the trace".into()),
        );
        f.count = maybe_truncated.len() as u64;
        f.request_ids = listed(&maybe_truncated);
        out.push(f);
    }
    if truncated > 0 {
        out.push(finding(
            Severity::Note,
            "auto_truncated_2xx",
            None,
            format!(
                "{} at or above max_req_input_len {} truncated as --allow-auto-truncate does and answered 2xx; a decode pool with a larger limit reads past the truncated transfer (see the KV checks)",
                crate::whatif::count(truncated, "prompt", "prompts"),
                if truncated == 1 { "was" } else { "were" }
            ),
            None,
        ));
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
            format!(
                "{}: {}, {}",
                what,
                crate::whatif::count(ids.len() as u64, "request", "requests"),
                crate::whatif::count(slots, "slot", "slots")
            ),
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
                "the evidence is incomplete ({}: {}): the checks above cover only the recorded events",
                crate::whatif::count(notes.len() as u64, "coverage note", "coverage notes"),
                notes.join("; ")
            ),
            Some("a clean audit needs complete evidence: run `kvtrail verify` and `kvtrail scope` on the trace for the files and holes".into()),
        ));
    }
    Ok(out)
}
