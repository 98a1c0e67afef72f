//! A naive per-slot reference implementation of the trace semantics and a
//! generator of random valid traces, shared by the property test
//! (tests/it/scope_reference.rs) and the error-rate example
//! (examples/error_rate.rs): a chain of pools, or a decode pool with a
//! `cache` tier that copies go to and come back from; copies naming any
//! source state, holes, unclean or mid-run captures; written as random file
//! splits with shuffled rows and dictionary strings.
//!
//! The reference is deliberately simple: it snapshots a pool's whole state
//! after every event, and applies the events one at a time, taking any
//! pool whose next event is not a copy waiting for its source (the source
//! pool has applied every event up to `src_seq`, or has none left). It
//! shares no code with the engine's replay.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::Role;

use super::trace_builder::{self, Rng, TraceBuilder, pool};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Content {
    Never,
    Scrubbed,
    Owner(u64),
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    content: Content,
    /// seq of the event that set the content
    wseq: Option<u64>,
    copied_uncertain: bool,
    /// Revision 2: the content predates the slot's latest alloc.
    stale: bool,
}

/// A slot just after an event: content, uncertain, stale.
type SlotSnap = (Content, bool, bool);

/// Per reader: foreign slots per source (certain flag), blank, unknown, uncertain.
#[derive(Default, Debug)]
struct Reader {
    foreign: BTreeMap<u64, BTreeSet<(u16, u32)>>,
    certain: BTreeMap<u64, bool>,
    blank: BTreeSet<(u16, u32)>,
    unknown: BTreeSet<(u16, u32)>,
    uncertain: BTreeSet<(u16, u32)>,
}

pub struct Reference {
    readers: BTreeMap<u64, Reader>,
    gaps: Vec<(u16, Option<u64>, u64)>,
}

pub fn reference(tb: &TraceBuilder) -> Result<Reference, &'static str> {
    let from_start = tb.from_engine_start;
    let mut by_pool: BTreeMap<u16, Vec<KvEvent>> = BTreeMap::new();
    for e in &tb.events {
        by_pool.entry(e.pool).or_default().push(*e);
    }
    for v in by_pool.values_mut() {
        v.sort_by_key(|e| e.seq);
    }
    let pools: Vec<u16> = tb.deployment.pools.iter().map(|p| p.id).collect();
    // (pool, seq) -> state just after that event, plus uncertainty per slot
    let mut snaps: HashMap<(u16, u64), Vec<SlotSnap>> = HashMap::new();
    let mut readers: BTreeMap<u64, Reader> = BTreeMap::new();
    let mut gaps = Vec::new();
    let mut st: BTreeMap<u16, PoolState> = pools
        .iter()
        .map(|&p| {
            let cap = tb.deployment.pool(p).unwrap().capacity_tokens as usize;
            (p, PoolState::new(cap))
        })
        .collect();
    let empty = Vec::new();
    let evs_of = |p: u16| by_pool.get(&p).unwrap_or(&empty);
    loop {
        let mut progressed = false;
        for &p in &pools {
            loop {
                let next = st[&p].next;
                let Some(e) = evs_of(p).get(next).copied() else {
                    break;
                };
                if let Some(src) = e.src {
                    let q = &st[&src.pool];
                    let ready = evs_of(src.pool).get(q.next).is_none_or(|x| x.seq > src.seq);
                    if !ready {
                        break;
                    }
                }
                apply(
                    p,
                    &e,
                    &by_pool,
                    &mut st,
                    &mut snaps,
                    &mut readers,
                    &mut gaps,
                    from_start,
                );
                st.get_mut(&p).unwrap().next += 1;
                progressed = true;
            }
        }
        let done = pools.iter().all(|&p| st[&p].next == evs_of(p).len());
        if done {
            break;
        }
        if !progressed {
            return Err("copies wait on each other");
        }
    }
    gaps.sort();
    Ok(Reference { readers, gaps })
}

/// One pool's state in the reference: its slots, the latest hole, the
/// share grants, and the next event to apply.
struct PoolState {
    slots: Vec<Slot>,
    gap_before: Option<u64>,
    /// (reader, slot, seq)
    grants: Vec<(u64, u32, u64)>,
    prev: Option<u64>,
    next: usize,
}

impl PoolState {
    fn new(cap: usize) -> Self {
        PoolState {
            slots: vec![
                Slot {
                    content: Content::Never,
                    wseq: None,
                    copied_uncertain: false,
                    stale: false,
                };
                cap
            ],
            gap_before: None,
            grants: Vec::new(),
            prev: None,
            next: 0,
        }
    }
}

fn uncertain(s: &Slot, gap_before: Option<u64>) -> bool {
    s.copied_uncertain || gap_before.is_some_and(|g| s.wseq.is_none_or(|w| w < g))
}

/// Applies event `e` of pool `p` (its copy source, if any, has applied
/// every event up to `src_seq`).
#[allow(clippy::too_many_arguments)]
fn apply(
    p: u16,
    e: &KvEvent,
    by_pool: &BTreeMap<u16, Vec<KvEvent>>,
    st: &mut BTreeMap<u16, PoolState>,
    snaps: &mut HashMap<(u16, u64), Vec<SlotSnap>>,
    readers: &mut BTreeMap<u64, Reader>,
    gaps: &mut Vec<(u16, Option<u64>, u64)>,
    from_start: bool,
) {
    // The copy's source content, read before this pool's state is borrowed.
    let copied: Option<Vec<(SlotSnap, bool)>> = e.src.map(|src| {
        let sp = by_pool.get(&src.pool).map(Vec::as_slice).unwrap_or(&[]);
        let at = sp.iter().rev().find(|x| x.seq <= src.seq).map(|x| x.seq);
        let lost = at != Some(src.seq);
        (0..e.slot_count)
            .map(|i| {
                let snap = match at {
                    Some(a) => snaps[&(src.pool, a)][(src.slot_start + i) as usize],
                    None => (Content::Never, true, false),
                };
                (snap, lost)
            })
            .collect()
    });
    let ps = st.get_mut(&p).unwrap();
    match ps.prev {
        Some(prev) if e.seq > prev + 1 => {
            gaps.push((p, Some(prev), e.seq));
            ps.gap_before = Some(e.seq);
        }
        None if e.seq > 0 => {
            gaps.push((p, None, e.seq));
            ps.gap_before = Some(e.seq);
        }
        _ => {}
    }
    ps.prev = Some(e.seq);
    let range = e.slot_start..e.slot_start + e.slot_count;
    match e.op {
        // Revision 2: the content predates the new holding.
        Op::Alloc => {
            for s in range {
                ps.slots[s as usize].stale = true;
            }
        }
        Op::Free => {}
        Op::Write => {
            for (i, s) in range.enumerate() {
                ps.slots[s as usize] = match &copied {
                    None => Slot {
                        content: Content::Owner(e.request_id),
                        wseq: Some(e.seq),
                        copied_uncertain: false,
                        stale: false,
                    },
                    Some(c) => {
                        let ((content, u, stale), lost) = c[i];
                        Slot {
                            content,
                            wseq: Some(e.seq),
                            copied_uncertain: u || lost,
                            stale,
                        }
                    }
                };
            }
        }
        Op::Scrub => {
            for s in range {
                ps.slots[s as usize] = Slot {
                    content: Content::Scrubbed,
                    wseq: Some(e.seq),
                    copied_uncertain: false,
                    stale: false,
                };
            }
        }
        Op::Share => {
            // Revision 2: a grant covers only current content.
            for s in range {
                if !ps.slots[s as usize].stale {
                    ps.grants.push((e.request_id, s, e.seq));
                }
            }
        }
        Op::Read => {
            let r = e.request_id;
            for s in range {
                let slot = ps.slots[s as usize];
                let unc = uncertain(&slot, ps.gap_before);
                let granted = ps
                    .grants
                    .iter()
                    .any(|&(g, gs, gseq)| g == r && gs == s && slot.wseq.is_none_or(|w| w < gseq));
                let rd = readers.entry(r).or_default();
                let key = (p, s);
                match slot.content {
                    Content::Never if !from_start => {
                        rd.unknown.insert(key);
                    }
                    Content::Never | Content::Scrubbed => {
                        if unc {
                            rd.uncertain.insert(key);
                        } else {
                            rd.blank.insert(key);
                        }
                    }
                    Content::Owner(o) if o == r || granted => {
                        if unc {
                            rd.uncertain.insert(key);
                        }
                    }
                    Content::Owner(o) => {
                        rd.foreign.entry(o).or_default().insert(key);
                        *rd.certain.entry(o).or_default() |= !unc;
                    }
                }
            }
        }
    }
    let snap = ps
        .slots
        .iter()
        .map(|s| (s.content, uncertain(s, ps.gap_before), s.stale))
        .collect();
    snaps.insert((p, e.seq), snap);
}

/// The reference's findings in the engine digest's format.
pub fn reference_digest(tb: &TraceBuilder, r: &Reference) -> String {
    let tenant = |id: u64| -> String {
        if id == 0 {
            return "(engine)".into();
        }
        tb.requests
            .iter()
            .find(|x| x.request_id == id)
            .map(|x| x.tenant.clone())
            .unwrap_or("(unknown)".into())
    };
    let mut out = Vec::new();
    let mut blank = 0u64;
    let mut engine = 0;
    for (&id, rd) in &r.readers {
        let foreign: BTreeSet<(u16, u32)> = rd.foreign.values().flatten().copied().collect();
        if id == 0 {
            // The engine has no response: its reads of others' KV are only
            // counted (coverage.engine_reads), its blank reads not at all.
            let mut all = foreign.clone();
            all.extend(&rd.unknown);
            all.extend(&rd.uncertain);
            engine = all.len();
            continue;
        }
        blank += rd.blank.len() as u64;
        if foreign.is_empty() && rd.unknown.is_empty() && rd.uncertain.is_empty() {
            continue;
        }
        let t = tenant(id);
        let mut cross = false;
        let mut confirmed = false;
        let mut srcs = Vec::new();
        for (&s, set) in &rd.foreign {
            let st = tenant(s);
            cross |= s != 0 && (st != t || st == "(unknown)" || t == "(unknown)");
            confirmed |= rd.certain[&s] && tb.complete;
            srcs.push(format!("{s}:{st}:{}", set.len()));
        }
        out.push(format!(
            "r{id} {t} foreign={} unknown={} uncertain={} cross={cross} {} src=[{}]",
            foreign.len(),
            rd.unknown.len(),
            rd.uncertain.len(),
            if confirmed { "confirmed" } else { "possible" },
            srcs.join(",")
        ));
    }
    out.push(format!("blank={blank}"));
    let gaps: Vec<String> = r
        .gaps
        .iter()
        .map(|(p, a, b)| {
            format!(
                "{p}:{}..{b}",
                a.map(|x| x.to_string()).unwrap_or("-".into())
            )
        })
        .collect();
    out.push(format!("gaps=[{}]", gaps.join(",")));
    out.push(format!("engine={engine}"));
    out.join("\n")
}

pub fn engine_digest(r: &kvtrail::scope::ScopeReport) -> String {
    let mut d = trace_builder::digest(r)
        .lines()
        .map(|l| match l.find("gaps=") {
            Some(i) if l.starts_with("complete=") => l[i..].to_string(),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    d.push_str(&format!("\nengine={}", r.coverage.engine_reads));
    d
}

/// A random valid trace from a seed.
pub fn random_trace(seed: u64) -> TraceBuilder {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    // Two pools; a chain of three; or a decode pool with a `cache` tier
    // that copies go to and come back from.
    let shape = rng.below(3);
    let tier = shape == 2;
    let mut pools = vec![pool(0, Role::Prefill, 24), pool(1, Role::Decode, 32)];
    match shape {
        1 => pools.push(pool(2, Role::Decode, 16)),
        2 => pools.push(pool(2, Role::Cache, 16)),
        _ => {}
    }
    let mut tb = TraceBuilder::with_pools(pools.clone());
    tb.from_engine_start = rng.below(4) != 0;
    tb.complete = rng.below(5) != 0;
    let tenants = ["acme", "initech", "umbrella"];
    let nreq = 2 + rng.below(6);
    for id in 1..=nreq {
        if rng.below(8) != 0 {
            tb.req(id, tenants[rng.below(3) as usize]);
        }
    }
    let mut seqs: Vec<Vec<u64>> = vec![Vec::new(); pools.len()];
    let nev = 5 + rng.below(60);
    for _ in 0..nev {
        let p = rng.below(pools.len() as u64) as u16;
        let cap = pools[p as usize].capacity_tokens as u32;
        let rid = if rng.below(10) == 0 {
            0
        } else {
            1 + rng.below(nreq + 1)
        };
        let count = 1 + rng.below(6) as u32;
        let start = rng.below((cap - count + 1) as u64) as u32;
        if rng.below(25) == 0 {
            tb.lose(p, 1 + rng.below(3));
        }
        let src_pool = match p {
            1 if tier && rng.below(2) == 0 => Some(2u16),
            1 => Some(0u16),
            2 => Some(1u16),
            _ => None,
        };
        let roll = rng.below(100);
        let seq = if roll < 20 {
            tb.write(p, rid, start, count)
        } else if roll < 45 {
            tb.read(p, rid, start, count)
        } else if roll < 52 {
            tb.share(p, rid, start, count)
        } else if roll < 56 {
            tb.scrub(p, start, count)
        } else if roll < 64 {
            tb.alloc(p, rid, start, count)
        } else if roll < 70 {
            tb.free(p, rid, start, count)
        } else if let Some(sp) = src_pool {
            let scap = pools[sp as usize].capacity_tokens as u32;
            let c = count.min(scap);
            let ss = rng.below((scap - c + 1) as u64) as u32;
            let start = start.min(cap - c);
            // any source state: an existing seq, a lost one or the future
            // (with copies both ways, a future one may wait on a copy that
            // waits on this one)
            let next = tb.next_seq(sp);
            let future = if tier { 12 } else { 6 };
            let src_seq = if seqs[sp as usize].is_empty() || rng.below(future) == 0 {
                rng.below(next + 3)
            } else {
                let v = &seqs[sp as usize];
                v[rng.below(v.len() as u64) as usize]
            };
            tb.copy(p, rid, start, c, sp, ss, src_seq)
        } else {
            tb.read(p, rid, start, count)
        };
        seqs[p as usize].push(seq);
    }
    tb
}

/// What a seed's trace turned out to be.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Scoped; `true` when copies go both ways (a `cache` tier).
    Scoped(bool),
    /// Refused by both: copies that wait on each other.
    Refused,
}

/// Scopes seed `seed`'s trace recorded, written by hand in random file
/// splits, and with tiny memory chunks (everything spilled), and compares
/// each with the reference: `Err` names the first disagreement.
pub fn compare(seed: u64) -> Result<Outcome, String> {
    let tb = random_trace(seed);
    let tier = tb.deployment.pools.iter().any(|p| p.role == Role::Cache);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let want = match reference(&tb) {
        Ok(r) => reference_digest(&tb, &r),
        Err(why) => {
            for (how, t) in [
                ("recorded", tb.record(&dir.path().join("rec"))),
                (
                    "by hand",
                    tb.by_hand(&dir.path().join("hand"), 2, seed, false),
                ),
            ] {
                let trace = kvtrail::trace::Trace::open(&t).map_err(|e| e.to_string())?;
                let got = kvtrail::scope::scope(
                    &trace,
                    &Default::default(),
                    &kvtrail::progress::NoReporter,
                );
                match got {
                    Ok(_) => {
                        return Err(format!(
                            "seed {seed} ({how}): the engine scoped a trace whose {why}"
                        ));
                    }
                    Err(err) if !err.to_string().contains(why) => {
                        return Err(format!(
                            "seed {seed} ({how}): refused for another reason: {err}"
                        ));
                    }
                    Err(_) => {}
                }
            }
            return Ok(Outcome::Refused);
        }
    };
    let differ = |how: &str, got: String| {
        (got != want).then(|| format!("seed {seed} ({how}):\nengine:\n{got}\nreference:\n{want}"))
    };
    let rec = trace_builder::scope(&tb.record(&dir.path().join("rec")));
    if let Some(e) = differ("recorded", engine_digest(&rec)) {
        return Err(e);
    }
    let files = 1 + (seed % 5) as usize;
    let hand =
        trace_builder::scope(&tb.by_hand(&dir.path().join("hand"), files, seed, seed % 2 == 0));
    if let Some(e) = differ("by hand", engine_digest(&hand)) {
        return Err(e);
    }
    // Same findings both ways, field for field.
    if rec.affected_responses != hand.affected_responses {
        return Err(format!("seed {seed}: recorded and by-hand findings differ"));
    }
    // Tiny memory chunks: every unsorted file and the copy index spill to
    // disk in many sorted runs; the findings must not change.
    let tiny = kvtrail::lineage::LineageOptions {
        chunk: Some(2),
        ..Default::default()
    };
    let spilled = trace_builder::scope_with(&dir.path().join("hand"), &tiny);
    if spilled.affected_responses != hand.affected_responses
        || spilled.blank_reads != hand.blank_reads
        || spilled.coverage != hand.coverage
    {
        return Err(format!("seed {seed}: spilled findings differ"));
    }
    Ok(Outcome::Scoped(tier))
}
