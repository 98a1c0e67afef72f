//! The simulator in-process: run a scenario into a temporary trace, load a
//! trace back, and an independent, deliberately naive evaluation of
//! trace-format-v1 semantics over a whole (small) trace, to check the
//! simulator's ground truth against the trace it wrote.

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
/// plus distinct blank slots per request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Naive {
    pub foreign: BTreeMap<u64, (u64, BTreeMap<u64, u64>)>,
    pub blank: BTreeMap<u64, u64>,
}

/// Evaluates the v1 semantics over a simulated trace (prefill pool 0,
/// decode pool 1; copies go 0 -> 1).
pub fn naive(trace: &Path) -> Naive {
    let ev = events(trace);
    let t = Trace::open(trace).unwrap();
    let cap = |id: u16| t.deployment().pool(id).unwrap().capacity_tokens as usize;
    let mut owner: HashMap<u16, Vec<u64>> = HashMap::new();
    let mut wgen: HashMap<u16, Vec<u64>> = HashMap::new();
    for p in ev.keys() {
        owner.insert(*p, vec![0; cap(*p)]);
        wgen.insert(*p, vec![0; cap(*p)]);
    }
    let mut grants: HashMap<(u64, u16, u32), u64> = HashMap::new();
    let mut foreign: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
    let mut blank: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let empty = Vec::new();
    let pre = ev.get(&0).unwrap_or(&empty);
    let dec = ev.get(&1).unwrap_or(&empty);
    let mut pi = 0;
    let mut apply = |e: &KvEvent,
                     owner: &mut HashMap<u16, Vec<u64>>,
                     wgen: &mut HashMap<u16, Vec<u64>>| {
        let (s0, n) = (e.slot_start as usize, e.slot_count as usize);
        match e.op {
            Op::Write => {
                let src_owner: Option<Vec<u64>> = e.src.map(|src| {
                    owner[&src.pool][src.slot_start as usize..src.slot_start as usize + n].to_vec()
                });
                let o = owner.get_mut(&e.pool).unwrap();
                let g = wgen.get_mut(&e.pool).unwrap();
                for i in 0..n {
                    o[s0 + i] = match &src_owner {
                        Some(v) => v[i],
                        None => e.request_id,
                    };
                    g[s0 + i] += 1;
                }
            }
            Op::Scrub => {
                let o = owner.get_mut(&e.pool).unwrap();
                let g = wgen.get_mut(&e.pool).unwrap();
                for i in 0..n {
                    o[s0 + i] = 0;
                    g[s0 + i] += 1;
                }
            }
            Op::Share => {
                for i in 0..n {
                    grants.insert(
                        (e.request_id, e.pool, (s0 + i) as u32),
                        wgen[&e.pool][s0 + i],
                    );
                }
            }
            Op::Read => {
                for i in 0..n {
                    let s = s0 + i;
                    let o = owner[&e.pool][s];
                    if o == e.request_id {
                        continue;
                    }
                    if grants.get(&(e.request_id, e.pool, s as u32)) == Some(&wgen[&e.pool][s]) {
                        continue;
                    }
                    let key = (e.pool as u64) << 32 | s as u64;
                    if o == 0 {
                        blank.entry(e.request_id).or_default().insert(key);
                    } else {
                        foreign.entry(e.request_id).or_default().insert((o, key));
                    }
                }
            }
            Op::Alloc | Op::Free => {}
        }
    };
    for e in dec {
        if let Some(src) = e.src {
            while pi < pre.len() && pre[pi].seq <= src.seq {
                apply(&pre[pi], &mut owner, &mut wgen);
                pi += 1;
            }
        }
        apply(e, &mut owner, &mut wgen);
    }
    while pi < pre.len() {
        apply(&pre[pi], &mut owner, &mut wgen);
        pi += 1;
    }
    let mut out = Naive::default();
    for (rid, set) in foreign {
        let distinct: BTreeSet<u64> = set.iter().map(|x| x.1).collect();
        let mut per: BTreeMap<u64, u64> = BTreeMap::new();
        for (src, _) in &set {
            *per.entry(*src).or_default() += 1;
        }
        out.foreign.insert(rid, (distinct.len() as u64, per));
    }
    for (rid, set) in blank {
        out.blank.insert(rid, set.len() as u64);
    }
    out
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
    out
}

/// Asserts the simulator's truth equals the naive evaluation of its trace.
pub fn assert_truth_matches_trace(run: &Simulated) {
    let n = naive(&run.trace);
    let t = truth_as_naive(&run.truth);
    assert_eq!(t.foreign, n.foreign, "foreign reads: truth vs trace");
    assert_eq!(t.blank, n.blank, "blank reads: truth vs trace");
}
