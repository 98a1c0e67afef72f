//! A property test over the wire (issue 32): random sessions of two or
//! three pools, one connection each, sent through the real `record`
//! sidecar in a random interleaving, then read back with `scope`. An
//! independent model in this file applies docs/trace-format.md
//! ("Semantics", "Everything downstream of a hole", "Current/stale is one
//! bit per slot") and the pull stamping of docs/capture-vllm.md (a pull
//! carries its source pool's state at the last change, event or hole, with
//! `ts_ns` at or before the pull's; a hole counts from the event before it)
//! and must agree with `scope` on every affected response: its foreign,
//! unknown and uncertain tokens, its confidence and its source requests.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use kvtrail::record::{Listen, NoLog, RecordConfig, Sidecar};
use kvtrail::scope::{Confidence, ScopeReport};
use kvtrail::trace::manifest::Deployment;
use proptest::prelude::*;

use crate::support::record::{Hook, connect_to};

/// Slots per pool.
const SLOTS: u32 = 32;
/// Requests 1..=REQUESTS.
const REQUESTS: u64 = 4;

/// Pools 0 (producer), 1 (consumer), 2 (cache): page size 1, 32 slots.
fn deployment() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": SLOTS, "page_size": 1},
            {"id": 1, "role": "decode", "capacity_tokens": SLOTS, "page_size": 1},
            {"id": 2, "role": "cache", "capacity_tokens": SLOTS, "page_size": 1}
        ]
    }))
    .unwrap()
}

// ------------------------------------------------------------- the session

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Alloc,
    Write,
    Read,
    Free,
    Share,
    /// A pull from `src` (outcome ok, or failed with no runs).
    Pull {
        src: u16,
        src_start: u32,
        failed: bool,
    },
}

#[derive(Debug, Clone)]
struct Event {
    pool: u16,
    ts: i64,
    rid: u64,
    op: Op,
    start: u32,
    count: u32,
    /// Events of this pool lost right after this one (a `lost` line).
    lost_after: Option<u64>,
    /// The connection marks this event's time right after it.
    mark_after: bool,
}

#[derive(Debug, Clone)]
struct Session {
    pools: u16,
    events: Vec<Event>,
    /// Tenant per request 1..=4.
    tenants: Vec<&'static str>,
    /// 0: one thread per connection, in chunks; otherwise the connections
    /// one after another, in an order drawn from `seed`.
    send_mode: u8,
    seed: u64,
}

/// A raw op as drawn: (pool, kind, request, start, count, src_start,
/// lost, mark).
type RawOp = (u16, u8, u64, u32, u32, u32, u8, bool);

fn session(pools: u16, raw: Vec<RawOp>, tenants: Vec<bool>, send_mode: u8, seed: u64) -> Session {
    let mut events: Vec<Event> = Vec::new();
    for (i, (p, kind, rid, start, count, src_start, lost, mark)) in raw.into_iter().enumerate() {
        let pool = p % pools;
        let start = start % SLOTS;
        let count = count.clamp(1, SLOTS - start);
        let ts = 1_000 + 10 * i as i64;
        // Sources a pool may pull from: the producer into the consumer,
        // the consumer into the cache and back.
        let srcs: &[u16] = match pool {
            0 => &[],
            1 if pools == 3 => &[0, 2],
            1 => &[0],
            _ => &[1],
        };
        let mut op = match kind % 9 {
            0 => Op::Alloc,
            1 | 2 => Op::Write,
            3 | 4 => Op::Read,
            5 => Op::Free,
            6 => Op::Share,
            k => {
                if srcs.is_empty() {
                    Op::Write
                } else {
                    let src = srcs[(src_start as usize + k as usize) % srcs.len()];
                    Op::Pull {
                        src,
                        src_start: src_start % (SLOTS - count + 1),
                        failed: lost == 7,
                    }
                }
            }
        };
        // A pull needs an event of its source before it (else the sidecar
        // records it as unresolved: a hole, not what this test is about).
        if let Op::Pull { src, .. } = op
            && !events.iter().any(|e| e.pool == src)
        {
            op = Op::Write;
        }
        events.push(Event {
            pool,
            ts,
            rid,
            op,
            start,
            count,
            lost_after: (lost % 8 == 1).then_some(1 + lost as u64 % 3),
            mark_after: mark,
        });
    }
    Session {
        pools,
        events,
        tenants: tenants
            .into_iter()
            .map(|b| if b { "acme" } else { "globex" })
            .collect(),
        send_mode,
        seed,
    }
}

fn session_strategy() -> impl Strategy<Value = Session> {
    (
        2u16..=3,
        proptest::collection::vec(
            (
                0u16..3,
                0u8..9,
                1..=REQUESTS,
                0..SLOTS,
                1u32..9,
                0..SLOTS,
                0u8..24,
                any::<bool>(),
            ),
            1..40,
        ),
        proptest::collection::vec(any::<bool>(), REQUESTS as usize),
        0u8..3,
        any::<u64>(),
    )
        .prop_map(|(p, raw, t, m, s)| session(p, raw, t, m, s))
}

// ----------------------------------------------------------------- the wire

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Alloc => "alloc",
        Op::Write | Op::Pull { .. } => "write",
        Op::Read => "read",
        Op::Free => "free",
        Op::Share => "share",
    }
}

fn mark(ts: i64) -> String {
    format!(r#"{{"type":"mark","ts_ns":{ts}}}"#)
}

/// Each connection's lines (the `bye` is sent when its Hook is dropped).
fn lines(s: &Session) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = vec![Vec::new(); s.pools as usize];
    // The producer's hook marks as soon as it is connected.
    out[0].push(mark(0));
    for e in &s.events {
        let l = &mut out[e.pool as usize];
        match e.op {
            Op::Pull {
                src,
                src_start,
                failed,
            } => {
                // A hook marks whenever its queue is empty: here, just
                // before the load it then reports.
                l.push(mark(e.ts - 1));
                let (runs, outcome) = if failed {
                    (serde_json::json!([]), "failed")
                } else {
                    (serde_json::json!([[e.start, src_start, e.count, 0]]), "ok")
                };
                l.push(
                    serde_json::json!({"type": "xfer_pull", "pool": e.pool, "ts_ns": e.ts,
                        "request_id": e.rid, "src_pool": src, "runs": runs, "outcome": outcome})
                    .to_string(),
                );
            }
            op => {
                let tpos = matches!(op, Op::Write | Op::Read).then_some(0);
                l.push(
                    serde_json::json!({"type": "kv", "pool": e.pool, "ts_ns": e.ts,
                        "request_id": e.rid, "op": op_name(op), "slot_start": e.start,
                        "slot_count": e.count, "token_pos": tpos})
                    .to_string(),
                );
            }
        }
        if let Some(n) = e.lost_after {
            l.push(format!(r#"{{"type":"lost","pool":{},"n":{n}}}"#, e.pool));
        }
        if e.mark_after {
            l.push(mark(e.ts));
        }
    }
    for (i, t) in s.tenants.iter().enumerate() {
        out[1].push(
            serde_json::json!({"type": "request", "request_id": i as u64 + 1,
                "external_id": format!("x{}", i + 1), "tenant": t, "arrival_ns": 1,
                "finish_ns": 2, "prompt_tokens": 8, "prefilled_tokens": 8, "output_tokens": 1,
                "http_status": 200, "finish_reason": "stop", "prefill_pool": 0,
                "decode_pool": 1})
            .to_string(),
        );
    }
    out
}

/// A small deterministic generator for chunk sizes, pauses and orders.
fn next(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

fn send(mut c: Hook, lines: Vec<String>, mut seed: u64) {
    let mut i = 0;
    while i < lines.len() {
        let n = 1 + next(&mut seed) as usize % 4;
        for l in &lines[i..(i + n).min(lines.len())] {
            writeln!(c, "{l}").unwrap();
        }
        c.flush().unwrap();
        i += n;
        std::thread::sleep(Duration::from_micros(next(&mut seed) % 1_500));
    }
    // Dropping the Hook sends `bye`.
}

/// Records the session through a real sidecar; returns the scope report
/// and whether the manifest says the capture began with the engine.
fn record(s: &Session) -> (ScopeReport, bool, bool) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("trace");
    let mut cfg = RecordConfig::new(Listen::Unix(sock.clone()));
    cfg.copy_timeout = Duration::from_secs(10);
    let sidecar = Sidecar::start(cfg, deployment(), &out, Arc::new(NoLog)).unwrap();
    let hooks: Vec<Hook> = (0..s.pools).map(|p| connect_to(&sock, &[p])).collect();
    let per_conn = lines(s);
    let mut seed = s.seed;
    if s.send_mode == 0 {
        let handles: Vec<_> = hooks
            .into_iter()
            .zip(per_conn)
            .enumerate()
            .map(|(i, (h, l))| {
                let sd = seed.wrapping_add(i as u64 * 7919);
                std::thread::spawn(move || send(h, l, sd))
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    } else {
        let mut conns: Vec<(Hook, Vec<String>)> = hooks.into_iter().zip(per_conn).collect();
        while !conns.is_empty() {
            let k = next(&mut seed) as usize % conns.len();
            let (h, l) = conns.remove(k);
            let sd = next(&mut seed);
            send(h, l, sd);
        }
    }
    let sum = sidecar.shutdown().unwrap();
    let trace = kvtrail::trace::Trace::open(&out).unwrap();
    let from_start = trace.manifest.from_engine_start();
    let r = kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &kvtrail::progress::NoReporter,
    )
    .unwrap();
    (r, from_start, sum.complete)
}

// ---------------------------------------------------------------- the model

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The content owner; None: never written.
    owner: Option<u64>,
    /// Content put there after the slot's latest alloc.
    current: bool,
    /// Content set before a hole of its pool (or copied from such).
    uncertain: bool,
    /// Which write put the content there (grants are on a write).
    generation: u64,
}

/// What the model expects of one affected response.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expect {
    foreign_tokens: u64,
    unknown_tokens: u64,
    uncertain_tokens: u64,
    confidence: Confidence,
    /// Source request -> distinct (pool, slot) read as foreign.
    sources: BTreeMap<u64, u64>,
}

#[derive(Default)]
struct Reads {
    foreign: BTreeSet<(u16, u32)>,
    unknown: BTreeSet<(u16, u32)>,
    uncertain: BTreeSet<(u16, u32)>,
    by_source: BTreeMap<u64, (BTreeSet<(u16, u32)>, bool)>,
}

/// Whether the model expects complete evidence: `coverage.complete` is
/// false while any hole exists.
fn model_no_holes(s: &Session) -> bool {
    s.events.iter().all(|e| e.lost_after.is_none())
}

/// Whether the model expects a clean capture: every connection ends with
/// `bye`, so only events lost after a pool's last written event (no later
/// event can show the hole: docs/capture-sglang.md) make it unclean. A
/// failed pull writes no event.
fn model_clean(s: &Session) -> bool {
    (0..s.pools).all(|p| {
        s.events
            .iter()
            .rev()
            .filter(|e| e.pool == p)
            .take_while(|e| matches!(e.op, Op::Pull { failed: true, .. }))
            .all(|e| e.lost_after.is_none())
            && s.events
                .iter()
                .rev()
                .filter(|e| e.pool == p)
                .find(|e| !matches!(e.op, Op::Pull { failed: true, .. }))
                .is_none_or(|e| e.lost_after.is_none())
    })
}

fn model(s: &Session, from_engine_start: bool) -> BTreeMap<u64, Expect> {
    let mut pools = vec![vec![Slot::default(); SLOTS as usize]; s.pools as usize];
    // Whether a pool's last change is a hole (a pull stamped now lands in it).
    let mut in_hole = vec![false; s.pools as usize];
    // (reader, pool, slot) -> the generations granted while current.
    let mut grants: HashMap<(u64, u16, u32), BTreeSet<u64>> = HashMap::new();
    let mut generation = 0u64;
    let mut reads: BTreeMap<u64, Reads> = BTreeMap::new();
    // Events are in time order; a hole sits right after the event before
    // it, so its time is that event's: processing in this order stamps
    // every pull with its source's last change at or before its time.
    for e in &s.events {
        let p = e.pool as usize;
        let slots = e.start..e.start + e.count;
        match e.op {
            Op::Alloc => slots.for_each(|i| pools[p][i as usize].current = false),
            Op::Write => {
                for i in slots {
                    generation += 1;
                    pools[p][i as usize] = Slot {
                        owner: Some(e.rid),
                        current: true,
                        uncertain: false,
                        generation,
                    };
                }
            }
            Op::Free => {}
            Op::Share => {
                for i in slots {
                    let sl = pools[p][i as usize];
                    if sl.owner.is_some() && sl.current {
                        grants
                            .entry((e.rid, e.pool, i))
                            .or_default()
                            .insert(sl.generation);
                    }
                }
            }
            Op::Pull { failed: true, .. } => {}
            Op::Pull { src, src_start, .. } => {
                let hole = in_hole[src as usize];
                for k in 0..e.count {
                    let from = pools[src as usize][(src_start + k) as usize];
                    generation += 1;
                    pools[p][(e.start + k) as usize] = Slot {
                        owner: from.owner,
                        current: from.current,
                        uncertain: from.uncertain || hole,
                        generation,
                    };
                }
            }
            Op::Read => {
                let r = reads.entry(e.rid).or_default();
                for i in slots {
                    let sl = pools[p][i as usize];
                    let key = (e.pool, i);
                    match sl.owner {
                        None if !from_engine_start => {
                            r.unknown.insert(key);
                        }
                        None => {
                            if sl.uncertain {
                                r.uncertain.insert(key);
                            }
                        }
                        Some(o) if o == e.rid => {
                            if sl.uncertain {
                                r.uncertain.insert(key);
                            }
                        }
                        Some(o) => {
                            let shared = grants
                                .get(&(e.rid, e.pool, i))
                                .is_some_and(|g| g.contains(&sl.generation));
                            if shared {
                                if sl.uncertain {
                                    r.uncertain.insert(key);
                                }
                            } else {
                                r.foreign.insert(key);
                                let src = r.by_source.entry(o).or_default();
                                src.0.insert(key);
                                src.1 |= !sl.uncertain;
                            }
                        }
                    }
                }
            }
        }
        in_hole[p] = e.lost_after.is_some();
        if e.lost_after.is_some() {
            pools[p].iter_mut().for_each(|sl| sl.uncertain = true);
        }
    }
    let clean = model_clean(s);
    reads
        .into_iter()
        .filter(|(_, r)| !(r.foreign.is_empty() && r.unknown.is_empty() && r.uncertain.is_empty()))
        .map(|(rid, r)| {
            // In a clean capture a response is confirmed when one of its
            // foreign reads does not depend on a hole.
            let certain = clean && r.by_source.values().any(|(_, c)| *c);
            (
                rid,
                Expect {
                    foreign_tokens: r.foreign.len() as u64,
                    unknown_tokens: r.unknown.len() as u64,
                    uncertain_tokens: r.uncertain.len() as u64,
                    confidence: if certain {
                        Confidence::Confirmed
                    } else {
                        Confidence::Possible
                    },
                    sources: r
                        .by_source
                        .iter()
                        .map(|(s, (slots, _))| (*s, slots.len() as u64))
                        .collect(),
                },
            )
        })
        .collect()
}

fn observed(r: &ScopeReport) -> BTreeMap<u64, Expect> {
    r.affected_responses
        .iter()
        .map(|a| {
            (
                a.request_id,
                Expect {
                    foreign_tokens: a.foreign_tokens,
                    unknown_tokens: a.unknown_tokens,
                    uncertain_tokens: a.uncertain_tokens,
                    confidence: a.confidence,
                    sources: a.sources.iter().map(|s| (s.request_id, s.tokens)).collect(),
                },
            )
        })
        .collect()
}

/// Records the session and compares scope with the model.
fn check(s: &Session) -> Result<(), TestCaseError> {
    let (r, from_start, complete) = record(s);
    prop_assert_eq!(complete, model_clean(s), "capture complete");
    prop_assert_eq!(r.coverage.complete, model_no_holes(s), "coverage complete");
    let want = model(s, from_start);
    let got = observed(&r);
    prop_assert_eq!(got, want, "session: {:#?}", s);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 12,
        failure_persistence: crate::support::regressions_beside_source(),
        ..ProptestConfig::default()
    })]
    /// Random sessions over the wire: scope agrees with the model.
    #[test]
    fn record_wire_model_agrees_with_scope(s in session_strategy()) {
        check(&s)?;
    }
}
