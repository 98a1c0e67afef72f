//! The simulator in-process: run a scenario into a temporary trace, load a
//! trace back, and an independent, deliberately naive evaluation of the
//! trace-format semantics (revision 2) over a whole (small) trace, to check
//! the simulator's ground truth against the trace it wrote.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use kvtrail::progress::NoReporter;
use kvtrail::schema::{KvEvent, Op, RequestRecord};
use kvtrail::sim::{self, RunLabel, Truth, scenario};
use kvtrail::trace::Trace;

/// A simulated trace in a temporary folder, with its ground truth.
pub struct Simulated {
    pub dir: tempfile::TempDir,
    pub trace: std::path::PathBuf,
    pub truth: Truth,
    pub over_long: u64,
}

/// Runs scenario `name` (`requests` requests, the scenario's own count
/// when `None`) with `sets` applied (`key=value`).
pub fn simulate(name: &str, requests: Option<u64>, seed: u64, sets: &[&str]) -> Simulated {
    let mut sc = scenario::scenario(name, requests, seed).unwrap();
    for s in sets {
        sc.config.set(s).unwrap();
    }
    sc.fit_workload();
    let dir = tempfile::tempdir().unwrap();
    let out = sim::run(
        &sc.config,
        sim::workload::Generator::new(sc.workload.clone()),
        &dir.path().join("t"),
        &RunLabel {
            scenario: name.into(),
            seed,
        },
        &NoReporter,
    )
    .unwrap();
    Simulated {
        trace: dir.path().join("t"),
        dir,
        truth: out.truth,
        over_long: out.stats.over_long,
    }
}

/// All request rows, sorted by request_id.
pub fn requests(trace: &Path) -> Vec<RequestRecord> {
    let t = Trace::open(trace).unwrap();
    let mut v: Vec<RequestRecord> = t.requests().flat_map(|b| b.unwrap()).collect();
    v.sort_by_key(|r| r.request_id);
    v
}

/// All kv events per pool, sorted by seq.
pub fn events(trace: &Path) -> BTreeMap<u16, Vec<KvEvent>> {
    let t = Trace::open(trace).unwrap();
    let mut m: BTreeMap<u16, Vec<KvEvent>> = BTreeMap::new();
    for c in t.kv_chunks() {
        for e in c.unwrap().events {
            m.entry(e.pool).or_default().push(e);
        }
    }
    for v in m.values_mut() {
        v.sort_by_key(|e| e.seq);
    }
    m
}

/// Per request: distinct foreign (pool, slot), per source distinct slots;
/// distinct blank slots per request; shared reads of another tenant's
/// content in the same shape as the foreign ones.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Naive {
    pub foreign: BTreeMap<u64, (u64, BTreeMap<u64, u64>)>,
    pub blank: BTreeMap<u64, u64>,
    pub cross_shared: BTreeMap<u64, (u64, BTreeMap<u64, u64>)>,
}

/// Per-slot state of one pool: content owner, write generation, current.
struct PoolState {
    owner: Vec<u64>,
    wgen: Vec<u64>,
    current: Vec<bool>,
}

/// Evaluates the trace-format semantics (revision 2: `alloc` makes the
/// content stale for its new holder, a copy carries the source's bit, a
/// grant covers only current content) over a simulated trace, merging the
/// pools' streams causally: a copy is applied when its source pool has
/// applied exactly event `src_seq`, and a pool does not move past an event
/// another pool's pending copy still has to read.
pub fn naive(trace: &Path) -> Naive {
    let ev = events(trace);
    let t = Trace::open(trace).unwrap();
    let tenant: HashMap<u64, String> = requests(trace)
        .into_iter()
        .map(|r| (r.request_id, r.tenant))
        .collect();
    let mut st: BTreeMap<u16, PoolState> = BTreeMap::new();
    for p in &t.deployment().pools {
        let n = p.capacity_tokens as usize;
        st.insert(
            p.id,
            PoolState {
                owner: vec![0; n],
                wgen: vec![0; n],
                current: vec![true; n],
            },
        );
    }
    let mut grants: HashMap<(u64, u16, u32), (u64, bool)> = HashMap::new();
    let mut foreign: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
    let mut blank: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let mut cross: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
    let pools: Vec<u16> = ev.keys().copied().collect();
    // Next event index per pool; per (source, destination) the src_seq of
    // the destination's copies in order, and how many were applied.
    let mut next: BTreeMap<u16, usize> = pools.iter().map(|&p| (p, 0)).collect();
    let mut pending: BTreeMap<(u16, u16), (Vec<u64>, usize)> = BTreeMap::new();
    for (&p, v) in &ev {
        for e in v {
            if let Some(src) = e.src {
                pending.entry((src.pool, p)).or_default().0.push(src.seq);
            }
        }
    }
    let total: usize = ev.values().map(Vec::len).sum();
    let mut done = 0;
    while done < total {
        let mut moved = false;
        for &p in &pools {
            loop {
                let i = next[&p];
                let Some(e) = ev[&p].get(i) else { break };
                // Source state: exactly after src_seq.
                if let Some(src) = e.src {
                    let at = next.get(&src.pool).copied().unwrap_or(0);
                    let applied_last = at.checked_sub(1).map(|j| ev[&src.pool][j].seq);
                    if applied_last != Some(src.seq) {
                        break;
                    }
                }
                // No pending copy from p may need an earlier state.
                let blocked = pending.iter().any(|(&(s, d), (seqs, k))| {
                    s == p && d != p && seqs.get(*k).is_some_and(|&q| q < e.seq)
                });
                if blocked {
                    break;
                }
                apply(
                    e,
                    &mut st,
                    &mut grants,
                    &mut foreign,
                    &mut blank,
                    &mut cross,
                    &tenant,
                );
                if let Some(src) = e.src {
                    pending.get_mut(&(src.pool, p)).unwrap().1 += 1;
                }
                *next.get_mut(&p).unwrap() += 1;
                done += 1;
                moved = true;
            }
        }
        assert!(moved, "no causal order of the copies");
    }
    let fold = |m: BTreeMap<u64, BTreeSet<(u64, u64)>>| {
        let mut out = BTreeMap::new();
        for (rid, set) in m {
            let distinct: BTreeSet<u64> = set.iter().map(|x| x.1).collect();
            let mut per: BTreeMap<u64, u64> = BTreeMap::new();
            for (src, _) in &set {
                *per.entry(*src).or_default() += 1;
            }
            out.insert(rid, (distinct.len() as u64, per));
        }
        out
    };
    Naive {
        foreign: fold(foreign),
        blank: blank
            .into_iter()
            .map(|(rid, set)| (rid, set.len() as u64))
            .collect(),
        cross_shared: fold(cross),
    }
}

#[allow(clippy::too_many_arguments)]
fn apply(
    e: &KvEvent,
    st: &mut BTreeMap<u16, PoolState>,
    grants: &mut HashMap<(u64, u16, u32), (u64, bool)>,
    foreign: &mut BTreeMap<u64, BTreeSet<(u64, u64)>>,
    blank: &mut BTreeMap<u64, BTreeSet<u64>>,
    cross: &mut BTreeMap<u64, BTreeSet<(u64, u64)>>,
    tenant: &HashMap<u64, String>,
) {
    let (s0, n) = (e.slot_start as usize, e.slot_count as usize);
    match e.op {
        Op::Write => {
            let src: Option<(Vec<u64>, Vec<bool>)> = e.src.map(|src| {
                let (a, b) = (src.slot_start as usize, src.slot_start as usize + n);
                let from = &st[&src.pool];
                (from.owner[a..b].to_vec(), from.current[a..b].to_vec())
            });
            let ps = st.get_mut(&e.pool).unwrap();
            for i in 0..n {
                let (o, c) = match &src {
                    Some((o, c)) => (o[i], c[i]),
                    None => (e.request_id, true),
                };
                ps.owner[s0 + i] = o;
                ps.current[s0 + i] = c;
                ps.wgen[s0 + i] += 1;
            }
        }
        Op::Scrub => {
            let ps = st.get_mut(&e.pool).unwrap();
            for i in s0..s0 + n {
                ps.owner[i] = 0;
                ps.current[i] = true;
                ps.wgen[i] += 1;
            }
        }
        Op::Alloc => {
            let ps = st.get_mut(&e.pool).unwrap();
            for i in s0..s0 + n {
                ps.current[i] = false;
            }
        }
        Op::Share => {
            let ps = &st[&e.pool];
            for i in s0..s0 + n {
                grants.insert(
                    (e.request_id, e.pool, i as u32),
                    (ps.wgen[i], ps.current[i]),
                );
            }
        }
        Op::Read => {
            if e.request_id == 0 {
                return;
            }
            let ps = &st[&e.pool];
            for s in s0..s0 + n {
                let o = ps.owner[s];
                if o == e.request_id {
                    continue;
                }
                let key = (e.pool as u64) << 32 | s as u64;
                let shared = grants
                    .get(&(e.request_id, e.pool, s as u32))
                    .is_some_and(|&(g, cur)| cur && g == ps.wgen[s]);
                if shared {
                    if o != 0 && tenant.get(&o) != tenant.get(&e.request_id) {
                        cross.entry(e.request_id).or_default().insert((o, key));
                    }
                    continue;
                }
                if o == 0 {
                    blank.entry(e.request_id).or_default().insert(key);
                } else {
                    foreign.entry(e.request_id).or_default().insert((o, key));
                }
            }
        }
        Op::Free => {}
    }
}

/// The truth in the same shape as [`naive`].
pub fn truth_as_naive(t: &Truth) -> Naive {
    let mut out = Naive::default();
    for a in &t.affected {
        let per = a.sources.iter().map(|s| (s.request_id, s.tokens)).collect();
        out.foreign.insert(a.request_id, (a.foreign_tokens, per));
    }
    for b in &t.blank {
        out.blank.insert(b.request_id, b.blank_tokens);
    }
    for c in &t.cross_tenant_shared {
        let per = c.sources.iter().map(|s| (s.request_id, s.tokens)).collect();
        out.cross_shared.insert(c.request_id, (c.tokens, per));
    }
    out
}

/// Asserts the simulator's truth equals the naive evaluation of its trace.
pub fn assert_truth_matches_trace(run: &Simulated) {
    let n = naive(&run.trace);
    let t = truth_as_naive(&run.truth);
    assert_eq!(t.foreign, n.foreign, "foreign reads: truth vs trace");
    assert_eq!(t.blank, n.blank, "blank reads: truth vs trace");
    assert_eq!(
        t.cross_shared, n.cross_shared,
        "cross-tenant shared reads: truth vs trace"
    );
}
