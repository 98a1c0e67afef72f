//! Valid traces with absurd numbers, through the real binary.
//!
//! A property test writes traces that keep every rule of the v1 contract
//! (through the `Recorder`, as an engine hook would) but with numbers at the
//! edges of their types: capacities and page sizes near 2^31, 2^32 - 1 and
//! 2^32, slot extents at the top of a 2^32-slot pool, seqs and src_seqs
//! near 2^32, 2^63 and 2^64 - 1 (with holes as wide as the type allows),
//! timestamps at i64::MIN / i64::MAX, request ids and token counts at their
//! limits, and up to a few hundred pools with ids up to 65535. Each trace
//! goes through `kvtrail verify`, `inspect --json` and `scope --json`, each
//! a child process with a time limit and an address-space cap, and:
//!
//! - no command panics or dies of a signal (out of memory included): the
//!   exit code is 0, 1 or 2, within the time limit;
//! - the three agree on whether the trace is valid (verify exits 0, or 1
//!   with `empty` as its only problem, and inspect and scope exit 0; or all
//!   three refuse it);
//! - a refusal (exit 2) names trace.json or a data file, and has a hint.
//!
//! `PROPTEST_CASES` raises the case count (default 24, well under a minute).

use std::path::Path;
use std::time::Duration;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role};
use proptest::prelude::*;

use crate::support::cli::kvtrail;
use crate::support::regressions_beside_source;

/// Wall-clock limit per command.
const LIMIT: Duration = Duration::from_secs(20);
/// Address-space cap per command.
const MEMORY: u64 = 4 << 30;

const U32_EDGES: &[u64] = &[1, 2, (1 << 31) - 1, 1 << 31, (1 << 32) - 1];
const U64_EDGES: &[u64] = &[
    0,
    1,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX - 2,
    u64::MAX - 1,
    u64::MAX,
];

fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![3 => proptest::sample::select(U64_EDGES), 1 => any::<u64>()]
}

fn edge_u32() -> impl Strategy<Value = u64> {
    prop_oneof![3 => proptest::sample::select(U32_EDGES), 1 => 1u64..=u32::MAX as u64]
}

fn edge_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => proptest::sample::select(&[i64::MIN, -1, 0, 1, 1 << 62, i64::MAX][..]),
        1 => any::<i64>()
    ]
}

#[derive(Debug, Clone)]
struct PoolSpec {
    capacity: u64,
    page_size: u32,
}

#[derive(Debug, Clone)]
struct EvSpec {
    pool: usize,
    /// Added to the pool's previous seq (the first event: its seq).
    seq: u64,
    ts: i64,
    request: u64,
    op: usize,
    start: u64,
    count: u64,
    copy: Option<(usize, u64, u64)>,
}

#[derive(Debug, Clone)]
struct Spec {
    context_window: u64,
    first_id: u16,
    pools: Vec<PoolSpec>,
    events: Vec<EvSpec>,
    requests: Vec<(u64, i64, Option<i64>, u64, u64)>,
    from_engine_start: bool,
}

fn spec() -> impl Strategy<Value = Spec> {
    let pool = (
        prop_oneof![3 => edge_u32(), 1 => Just(1u64 << 32)],
        prop_oneof![
            proptest::sample::select(&[1u32, 2, 64, 1 << 31, u32::MAX][..]),
            any::<u32>().prop_map(|p| p.max(1))
        ],
    )
        .prop_map(|(capacity, page_size)| PoolSpec {
            capacity,
            page_size,
        });
    let pools = prop_oneof![
        4 => proptest::collection::vec(pool.clone(), 1..4),
        1 => (pool, 16usize..300).prop_map(|(p, n)| vec![p; n]),
    ];
    let ev = (
        any::<usize>(),
        prop_oneof![2 => Just(1u64), 1 => edge_u64()],
        edge_i64(),
        edge_u64(),
        0usize..6,
        edge_u64(),
        prop_oneof![2 => 1u64..16, 1 => edge_u32()],
        proptest::option::weighted(0.3, (any::<usize>(), edge_u64(), edge_u64())),
    )
        .prop_map(|(pool, seq, ts, request, op, start, count, copy)| EvSpec {
            pool,
            seq,
            ts,
            request,
            op,
            start,
            count,
            copy,
        });
    let req = (
        edge_u64(),
        edge_i64(),
        proptest::option::of(edge_i64()),
        edge_u32(),
        edge_u32(),
    );
    (
        edge_u64(),
        prop_oneof![Just(0u16), Just(u16::MAX), any::<u16>()],
        pools,
        proptest::collection::vec(ev, 1..24),
        proptest::collection::vec(req, 0..6),
        any::<bool>(),
    )
        .prop_map(
            |(context_window, first_id, pools, events, requests, from_engine_start)| Spec {
                context_window,
                first_id,
                pools,
                events,
                requests,
                from_engine_start,
            },
        )
}

const OPS: [Op; 6] = [
    Op::Alloc,
    Op::Write,
    Op::Read,
    Op::Free,
    Op::Share,
    Op::Scrub,
];

/// Pool ids: consecutive from `first_id`, wrapping below 65535 so every id
/// is unique.
fn pool_ids(spec: &Spec) -> Vec<u16> {
    let n = spec.pools.len() as u32;
    let first = (spec.first_id as u32).min(u16::MAX as u32 + 1 - n);
    (0..n).map(|i| (first + i) as u16).collect()
}

/// An extent inside a pool of `cap` slots: `count` clamped to the pool and
/// to u32, `start` clamped so the extent ends inside it.
fn extent(cap: u64, start: u64, count: u64) -> (u32, u32) {
    let count = count.clamp(1, cap.min(u32::MAX as u64));
    let start = start.min(cap - count);
    (start as u32, count as u32)
}

/// Writes the trace through the Recorder; events the Recorder refuses (seq
/// past u64::MAX - 1, a reserved request id) are left out, as a hook would
/// never send them. `None` when the deployment itself is refused; else
/// what was written, one line per pool, event and request (for messages).
fn write(spec: &Spec, dir: &Path) -> Option<Vec<String>> {
    let ids = pool_ids(spec);
    let deployment = Deployment {
        name: "absurd".into(),
        engine: "test".into(),
        context_window: spec.context_window,
        pools: spec
            .pools
            .iter()
            .zip(&ids)
            .enumerate()
            .map(|(i, (p, &id))| Pool {
                id,
                name: format!("pool-{id}"),
                role: [Role::Prefill, Role::Decode, Role::Mixed][i % 3],
                capacity_tokens: p.capacity,
                page_size: p.page_size,
                extra: Default::default(),
            })
            .collect(),
        prefix_cache_scope: None,
        extra: Default::default(),
    };
    let opts = RecorderOptions {
        from_engine_start: spec.from_engine_start,
        started_ns: Some(0),
        ..Default::default()
    };
    let mut written: Vec<String> = deployment
        .pools
        .iter()
        .map(|p| {
            format!(
                "pool {} capacity {} page_size {}",
                p.id, p.capacity_tokens, p.page_size
            )
        })
        .collect();
    written.push(format!("context_window {}", spec.context_window));
    let mut rec = Recorder::create(dir, deployment, opts).ok()?;
    let mut next: Vec<Option<u64>> = vec![None; ids.len()];
    // The Recorder sums the holes of all pools into a u64 (its stats): keep
    // the sum below 2^64 (src/capture/mod.rs overflows past it).
    let mut lost: u64 = 0;
    for e in &spec.events {
        let pi = e.pool % ids.len();
        let seq = match next[pi] {
            None => e.seq,
            Some(prev) => match prev.checked_add(e.seq.max(1)) {
                Some(s) => s,
                None => continue,
            },
        };
        let hole = seq - next[pi].map_or(0, |p| p + 1);
        let Some(total) = lost.checked_add(hole) else {
            continue;
        };
        let op = OPS[e.op];
        let (slot_start, slot_count) = extent(spec.pools[pi].capacity, e.start, e.count);
        let src = match (op, e.copy) {
            (Op::Write, Some((si, start, src_seq))) if ids.len() > 1 => {
                let si = if si % ids.len() == pi {
                    (si + 1) % ids.len()
                } else {
                    si % ids.len()
                };
                let cap = spec.pools[si].capacity;
                let count = slot_count as u64;
                (count <= cap).then(|| CopySrc {
                    pool: ids[si],
                    slot_start: start.min(cap - count) as u32,
                    seq: src_seq,
                })
            }
            _ => None,
        };
        let ev = KvEvent {
            pool: ids[pi],
            seq,
            ts_ns: e.ts,
            request_id: e.request,
            op,
            slot_start,
            slot_count,
            token_pos: matches!(op, Op::Write | Op::Read | Op::Share).then_some(slot_start),
            src,
        };
        if rec.kv_with_seq(ev).is_ok() {
            next[pi] = Some(seq);
            lost = total;
            written.push(format!("{ev:?}"));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for &(id, arrival, finish, prompt, output) in &spec.requests {
        if id == 0 || !seen.insert(id) {
            continue;
        }
        written.push(format!("request {id} arrival {arrival} finish {finish:?}"));
        let _ = rec.request(RequestRecord {
            request_id: id,
            external_id: Some(format!("ext-{id}")),
            tenant: format!("tenant-{}", id % 3),
            arrival_ns: arrival,
            finish_ns: finish,
            prompt_tokens: prompt as u32,
            prefilled_tokens: Some(prompt as u32),
            output_tokens: output as u32,
            http_status: 200,
            finish_reason: Some("stop".into()),
            prefill_pool: None,
            decode_pool: None,
            prompt_hash: None,
            output_hash: None,
        });
    }
    rec.close().ok()?;
    Some(written)
}

fn check(spec: &Spec) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("trace");
    let Some(written) = write(spec, &dir) else {
        return Ok(()); // the Recorder refused the deployment: not a trace
    };
    let trace = written.join("\n  ");
    let cmds: [&[&str]; 3] = [
        &["verify", "--json"],
        &["inspect", "--json"],
        &["scope", "--json"],
    ];
    let mut verdicts = Vec::new();
    for args in cmds {
        let o = kvtrail(args)
            .arg(&dir)
            .timeout(LIMIT)
            .memory_limit(MEMORY)
            .run();
        let name = args.join(" ");
        if o.timed_out || o.signal.is_some() {
            let why = match o.signal {
                Some(sig) if !o.timed_out => format!("killed by signal {sig}"),
                _ => format!("no exit within {LIMIT:?}"),
            };
            return Err(TestCaseError::fail(format!(
                "`{name}` crashed or hung ({:.1} s): {why}\n{}\ntrace:\n  {trace}",
                o.wall.as_secs_f64(),
                o.stderr
            )));
        }
        let code = o.code;
        prop_assert!(
            matches!(code, 0..=2),
            "`{}` exited {} (a panic is 101): {}\ntrace:\n  {}",
            name,
            code,
            o.stderr,
            trace
        );
        if code == 2 {
            prop_assert!(
                (o.stderr.contains("trace.json")
                    || o.stderr.contains(".parquet")
                    || o.stderr.contains("KVTRAIL_MAX_TOUCHED_SLOTS"))
                    && o.stderr.contains("hint:"),
                "`{}` refused without naming the file or a hint: {}\ntrace:\n  {}",
                name,
                o.stderr,
                trace
            );
        }
        // verify exits 1 on a readable trace whose evidence fails a check.
        // A trace with no KV events at all (the Recorder dropped every
        // event as out of range) is valid and proves nothing: verify says
        // `empty`, inspect and scope warn. Only that verdict counts as
        // valid here; any other problem is verify calling the trace bad.
        let code = if name.starts_with("verify") && code == 1 && only_empty(&o.stdout) {
            0
        } else {
            code
        };
        verdicts.push((name, code, o.stderr));
    }
    // A refusal at a documented resource limit (docs/limits.md: the
    // replay's touched-slot limit) is no verdict on validity: the trace is
    // valid, the run declined the work. It must say which limit and how to
    // raise it. Copies that wait on each other are refused by the commands
    // that replay (scope) and accepted by verify and inspect, which check
    // structure only (docs/trace-format.md, "Copies both ways"): the
    // generator can draw two copies that each read the other pool past the
    // other copy.
    let verdicts: Vec<_> = verdicts
        .into_iter()
        .filter(|(name, c, err)| {
            !(*c == 2
                && (err.contains("KVTRAIL_MAX_TOUCHED_SLOTS")
                    || (name.starts_with("scope") && err.contains("copies wait on each other"))))
        })
        .collect();
    let valid: Vec<bool> = verdicts.iter().map(|(_, c, _)| *c == 0).collect();
    prop_assert!(
        valid.iter().all(|&v| v == valid[0]),
        "the commands disagree on whether the trace is valid: {:?}\ntrace:\n  {}",
        verdicts,
        trace
    );
    Ok(())
}

/// Whether verify's `--json` report lists problems and every one is `empty`.
fn only_empty(stdout: &str) -> bool {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(stdout) else {
        return false;
    };
    let Some(problems) = v["problems"].as_array() else {
        return false;
    };
    !problems.is_empty() && problems.iter().all(|p| p["kind"] == "empty")
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(24)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 32,
        failure_persistence: regressions_beside_source(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn valid_traces_with_absurd_numbers_never_crash_and_agree(spec in spec()) {
        check(&spec)?;
    }
}
