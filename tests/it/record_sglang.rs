//! End to end against the real `sglang` package: `kvtrail record` on a temp
//! Unix socket, tests/sglang/record_driver.py driving SGLang 0.5.19's real
//! request, admission, allocator and sender classes on CPU with the
//! kvtrail_sglang hook installed (the driver's docstring says which parts are
//! real and which hook functions it calls directly), then checks on the
//! trace: it verifies, `inspect` shows the over-long prompt with
//! prompt_tokens 120 vs prefilled_tokens 1 and a 200, and both an
//! independent replay over the library reader and `kvtrail scope` find the
//! planted foreign read (request C reading A's and B's stale decode KV).
//! The sidecar runs with `--live`: its live findings equal a fresh scope
//! (`kvtrail verify`).
//!
//! Needs the venv of .ci/setup.d/30-sglang.sh (+ blake3 from 31-...): with
//! `CI` set a missing venv FAILS the test; otherwise it is skipped with a
//! message.

use crate::support::venv;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::{Manifest, Trace};

use crate::support::cli::{kvtrail, s};
use crate::support::record::assert_live_equals_scope;

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// external_id, tenant, prompt, prefilled, status, output, prefill pool, decode pool.
type Row = (
    String,
    String,
    u32,
    Option<u32>,
    u16,
    u32,
    Option<u16>,
    Option<u16>,
);

/// Per-slot owner state of one pool.
struct Pool {
    owner: Vec<Option<u64>>,
    /// Revision 2: the slot's content predates its latest alloc.
    stale: Vec<bool>,
    grants: HashSet<(u64, u32)>,
}

/// Classification of every slot a request read: own / shared / unknown
/// (never written in the trace) / foreign by source request.
#[derive(Debug, Default, PartialEq, Eq)]
struct Reads {
    own: u64,
    shared: u64,
    unknown: u64,
    foreign: BTreeMap<u64, u64>,
}

/// An independent replay of the contract semantics (docs/trace-format.md,
/// revision 2: alloc makes content stale, a share grants only current
/// content, copies carry owner and staleness) over the events read back
/// through the library reader. Small traces only: a copy's source state is
/// rebuilt by replaying its pool up to src_seq.
fn replay(trace: &Trace) -> BTreeMap<u64, Reads> {
    let mut by_pool: BTreeMap<u16, Vec<KvEvent>> = BTreeMap::new();
    for c in trace.kv_chunks() {
        for e in c.unwrap().events {
            by_pool.entry(e.pool).or_default().push(e);
        }
    }
    for v in by_pool.values_mut() {
        v.sort_by_key(|e| e.seq);
    }
    let cap = |p: u16| trace.deployment().pool(p).unwrap().capacity_tokens as usize;
    let state_after = |p: u16, seq: u64, by_pool: &BTreeMap<u16, Vec<KvEvent>>| {
        let mut owner = vec![None; cap(p)];
        let mut stale = vec![false; cap(p)];
        for e in by_pool[&p].iter().take_while(|e| e.seq <= seq) {
            assert!(e.src.is_none(), "the test expects copies only into decode");
            for s in e.slot_start..e.slot_start + e.slot_count {
                let s = s as usize;
                match e.op {
                    Op::Write => (owner[s], stale[s]) = (Some(e.request_id), false),
                    Op::Scrub => (owner[s], stale[s]) = (None, false),
                    Op::Alloc => stale[s] = true,
                    _ => {}
                }
            }
        }
        (owner, stale)
    };
    let mut out: BTreeMap<u64, Reads> = BTreeMap::new();
    for (&p, evs) in &by_pool {
        let mut st = Pool {
            owner: vec![None; cap(p)],
            stale: vec![false; cap(p)],
            grants: HashSet::new(),
        };
        for e in evs {
            let slots = e.slot_start..e.slot_start + e.slot_count;
            match e.op {
                Op::Write => {
                    let src = e.src.map(|c| (c, state_after(c.pool, c.seq, &by_pool)));
                    for (k, s) in slots.enumerate() {
                        (st.owner[s as usize], st.stale[s as usize]) = match &src {
                            Some((c, (o, stale))) => {
                                let i = c.slot_start as usize + k;
                                (o[i], stale[i])
                            }
                            None => (Some(e.request_id), false),
                        };
                        st.grants.retain(|&(_, g)| g != s);
                    }
                }
                Op::Scrub => {
                    for s in slots {
                        (st.owner[s as usize], st.stale[s as usize]) = (None, false);
                    }
                }
                Op::Alloc => {
                    for s in slots {
                        st.stale[s as usize] = true;
                    }
                }
                Op::Share => {
                    // A grant covers only current content.
                    for s in slots.filter(|&s| !st.stale[s as usize]) {
                        st.grants.insert((e.request_id, s));
                    }
                }
                Op::Read => {
                    let r = out.entry(e.request_id).or_default();
                    for s in slots {
                        match st.owner[s as usize] {
                            None => r.unknown += 1,
                            Some(o) if o == e.request_id => r.own += 1,
                            _ if st.grants.contains(&(e.request_id, s)) => r.shared += 1,
                            Some(o) => *r.foreign.entry(o).or_default() += 1,
                        }
                    }
                }
                Op::Free => {}
            }
        }
    }
    out
}

/// Runs `script SOCKET` in the venv against a `kvtrail record` sidecar,
/// stops the sidecar with SIGTERM; returns the script's JSON facts, the
/// trace directory and the sidecar's stderr.
fn with_sidecar(
    py: &Path,
    deploy: &str,
    script: &str,
    d: &tempfile::TempDir,
) -> (serde_json::Value, PathBuf, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.path().join("kvtrail.sock");
    let out = d.path().join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join("tests/data/record").join(deploy)),
        "--out",
        s(&out),
        "--health-secs",
        "0",
        // Live detection on every capture: its findings must equal a
        // fresh scope's (each test asserts it).
        "--live",
    ])
    .spawn();
    wait_for(&sock);
    let driver = Command::new(py)
        .arg("-W")
        .arg("ignore")
        .arg(root.join("tests/sglang").join(script))
        .arg(&sock)
        // With the native module, as the hook is installed (its decode
        // step is built natively); record_hicache runs the hook without it.
        .env("PYTHONPATH", venv::hook_pythonpath("hooks/sglang/src"))
        .current_dir(root.join("tests/sglang"))
        .output()
        .unwrap();
    // SIGTERM: the sidecar closes the trace cleanly.
    unsafe { libc::kill(sidecar.id() as i32, libc::SIGTERM) };
    let status = sidecar.wait().unwrap();
    let mut side_err = String::new();
    std::io::Read::read_to_string(sidecar.stderr.as_mut().unwrap(), &mut side_err).unwrap();
    assert!(
        driver.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&driver.stdout),
        String::from_utf8_lossy(&driver.stderr)
    );
    assert!(status.success(), "sidecar: {status:?}\n{side_err}");
    let stdout = String::from_utf8_lossy(&driver.stdout);
    let facts = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    (facts, out, side_err)
}

#[test]
fn sglang_cpu_capture_finds_the_planted_foreign_read() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) =
        with_sidecar(&py, "deploy-sglang-cpu.json", "record_driver.py", &d);
    // What the real classes did (the premise of the scenario).
    assert_eq!(facts["sglang"], "0.5.19");
    assert_eq!(facts["C"]["prefill_input_after_admission"], 1);
    assert_eq!(facts["C"]["prefill_to_finish"], "FINISH_ABORT");
    assert_eq!(facts["C"]["pages_sent"], 1);
    assert_eq!(facts["C"]["pages_preallocated"], 30);
    assert_eq!(facts["C"]["decode_slots_read_not_written_by_it"], 119);
    for w in facts["hook_stats"].as_object().unwrap().values() {
        assert_eq!(w["dropped_queue"], 0, "{w}");
        assert_eq!(w["lost_sidecar_down"], 0, "{w}");
    }

    // The trace verifies and is complete.
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    // Live detection saw what scope sees: C and D, the same tokens,
    // sources and confidence.
    assert!(
        v.stdout
            .contains("live findings equal a fresh scope: 2 affected responses"),
        "{}",
        v.stdout
    );
    assert_live_equals_scope(&out);

    // inspect: the over-long prompt, placeholder prefill, 200 to the client.
    let i = kvtrail(["inspect", s(&out), "--json"]).run();
    assert_eq!(i.code, 0, "{}", i.stderr);
    let j: serde_json::Value = serde_json::from_str(&i.stdout).unwrap();
    let c = facts["C"]["request_id"].as_u64().unwrap();
    assert_eq!(
        j["requests"]["short_prefill"],
        serde_json::json!({"count": 1, "with_2xx": 1, "examples": [c]})
    );
    for p in j["kv"]["pools"].as_array().unwrap() {
        assert_eq!(p["holes"], 0, "{p}");
    }
    let trace = Trace::open(&out).unwrap();
    let mut rows = BTreeMap::new();
    for b in trace.requests() {
        for r in b.unwrap() {
            rows.insert(r.external_id.clone().unwrap(), r);
        }
    }
    let got: Vec<Row> = rows
        .values()
        .map(|r| {
            (
                r.external_id.clone().unwrap(),
                r.tenant.clone(),
                r.prompt_tokens,
                r.prefilled_tokens,
                r.http_status,
                r.output_tokens,
                r.prefill_pool,
                r.decode_pool,
            )
        })
        .collect();
    let expect: Vec<Row> = vec![
        (
            "A".into(),
            "tenant-a".into(),
            40,
            Some(40),
            200,
            3,
            Some(0),
            Some(1),
        ),
        (
            "B".into(),
            "tenant-b".into(),
            56,
            Some(56),
            200,
            3,
            Some(0),
            Some(1),
        ),
        (
            "C".into(),
            "tenant-c".into(),
            120,
            Some(1),
            200,
            3,
            Some(0),
            Some(1),
        ),
        (
            "D".into(),
            "tenant-d".into(),
            40,
            Some(40),
            200,
            3,
            Some(0),
            Some(1),
        ),
    ];
    assert_eq!(got, expect);
    assert!(
        rows.values()
            .all(|r| r.prompt_hash.is_some() && r.output_hash.is_some())
    );

    // The planted foreign read, found by replaying the trace's own events.
    let reads = replay(&trace);
    let (a, b) = (
        facts["A"]["request_id"].as_u64().unwrap(),
        facts["B"]["request_id"].as_u64().unwrap(),
    );
    assert!(
        reads[&a].foreign.is_empty() && reads[&b].foreign.is_empty(),
        "{reads:?}"
    );
    // C's decode pages 1..30 (page size 4, ascending after the PD merge):
    // page 1 holds the prefill's one page (slot 0 C's own KV, the rest of
    // that prefill page never written), pages 2..10 A's copied prompt,
    // page 11 A's two decode tokens, 12..25 B's prompt, 26 B's two decode
    // tokens, 27..30 never written. Own reads: the prefill's read of its
    // 1-token extend, decode slot 0, and the two decode tokens.
    assert_eq!(
        reads[&c],
        Reads {
            own: 1 + 1 + 2,
            shared: 0,
            unknown: 3 + 2 + 2 + 16,
            foreign: BTreeMap::from([(a, 9 * 4 + 2), (b, 14 * 4 + 2)]),
        }
    );
    // D hit C's first two decode pages in the decode radix tree (a share at
    // preallocation). Page 1: slot 0 holds C's own KV, copied after C's
    // preallocation: current, so shared; its other 3 slots never written.
    // Page 2: A's KV, stale since C preallocated it: the grant covers
    // nothing (revision 2), so D's read of it is foreign, source A. Own:
    // the prefill's 40, the 32 transferred slots, the two decode tokens.
    let d_id = facts["D"]["request_id"].as_u64().unwrap();
    assert_eq!(
        reads[&d_id],
        Reads {
            own: 40 + 32 + 2,
            shared: 1,
            unknown: 3,
            foreign: BTreeMap::from([(a, 4)]),
        }
    );

    // And `kvtrail scope` finds the same: one affected response, C, with
    // A's and B's tokens, confirmed, cross-tenant, answered with a 200.
    let sc = kvtrail(["scope", s(&out), "--json"]).run();
    assert_eq!(sc.code, 0, "{}", sc.stderr);
    let j: serde_json::Value = serde_json::from_str(&sc.stdout).unwrap();
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(affected.len(), 2, "{}", sc.stdout);
    let r = affected.iter().find(|r| r["request_id"] == c).unwrap();
    assert_eq!(r["request_id"], c);
    assert_eq!(r["http_status"], 200);
    assert_eq!(r["confidence"], "confirmed");
    assert_eq!(r["foreign_tokens"], 38 + 58);
    let sources: Vec<(u64, String, u64)> = r["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["request_id"].as_u64().unwrap(),
                x["tenant"].as_str().unwrap().to_string(),
                x["tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        sources,
        vec![(a, "tenant-a".into(), 38), (b, "tenant-b".into(), 58)]
    );
    // D: the poisoned decode-tree hit, A's 4 stale tokens.
    let r = affected.iter().find(|r| r["request_id"] == d_id).unwrap();
    assert_eq!(r["confidence"], "confirmed");
    assert_eq!(r["foreign_tokens"], 4);
    assert_eq!(r["sources"][0]["request_id"], a);
    assert_eq!(r["sources"][0]["tokens"], 4);
}

#[test]
fn hook_counts_loss_instead_of_stalling() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = with_sidecar(&py, "deploy-hook-loss.json", "hook_loss.py", &d);
    // Sidecar unreachable: every event counted as lost, the engine not held up.
    let down = &facts["down"];
    assert_eq!(down["lost_sidecar_down"], 10_000, "{down}");
    assert_eq!(down["sent_lines"], 0, "{down}");
    assert!(down["us_per_call"].as_f64().unwrap() < 1000.0, "{down}");
    // Guard decisions that could not be sent: counted apart, no pool's
    // loss (which would become a hole), and the closing counts add up.
    let g = &facts["guard_loss"];
    assert_eq!(g["full"]["guard_lost"], 3, "{g}");
    assert_eq!(g["full"]["dropped_queue"], 0, "{g}");
    assert_eq!(g["full_pool"], serde_json::json!({}), "{g}");
    assert_eq!(g["down"]["guard_lost"], 3, "{g}");
    assert_eq!(g["down"]["lost_sidecar_down"], 0, "{g}");
    assert_eq!(g["down_pool"], serde_json::json!({}), "{g}");
    assert_eq!(g["down_counts"], serde_json::json!([3, 0, 3]), "{g}");
    // Sender starved with a 64-event queue: drops, counted, and in the trace
    // as a hole of exactly that size inside pool 0's stream.
    let st = &facts["starved"];
    let dropped = st["dropped_queue"].as_u64().unwrap();
    assert!(dropped > 0, "{st}");
    let i = kvtrail(["inspect", s(&out), "--json"]).run();
    let j: serde_json::Value = serde_json::from_str(&i.stdout).unwrap();
    let p = &j["kv"]["pools"][0];
    assert_eq!(p["missing_events"], dropped, "{p}\n{side_err}");
    assert_eq!(
        p["events"].as_u64().unwrap() + dropped,
        st["calls"].as_u64().unwrap(),
        "{p}"
    );
    // The refused claim (step 4 below) leaves the capture incomplete: the
    // files verify, the capture does not.
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
    assert!(
        v.stdout.contains("capture.complete is false") && !v.stdout.contains("digest"),
        "{}",
        v.stdout
    );
    let m = Manifest::load(&out).unwrap();
    assert!(!m.capture.complete);
    // The trace fails verify (incomplete), so verify does not compare;
    // the same comparison through the library: the holes make the same
    // reads uncertain live as in scope.
    assert_live_equals_scope(&out);
    // TP rank 1's allocator is marked not captured (-1); rank 0's is left alone.
    assert_eq!(facts["tp_rank_pools"], serde_json::json!([-1, null]));
    // Pool 0 held by another connection: the hook's hello is refused, it
    // sends nothing, and counts all 200 events (100 alloc + 100 free) lost.
    let c = &facts["claimed"];
    assert_eq!(c["holder_welcome"]["type"], "welcome", "{c}");
    assert_eq!(c["sent_lines"], 0, "{c}");
    assert_eq!(c["lost_sidecar_down"], 200, "{c}");
    assert!(c["connect_failures"].as_u64().unwrap() >= 1, "{c}");
    assert!(
        side_err.contains("already claimed by live connection"),
        "{side_err}"
    );
}

/// The hook claims each pool's page size in its hello, as the pool's
/// allocator reports it (the client connects when its first event is
/// queued, after the allocator noted its size). Against a deployment that
/// says 8 where the engine pages by 4, the sidecar refuses both claims
/// and says why, rather than expanding pages with the wrong size; the
/// engine runs to the end, the hook counts what it could not send, and
/// the capture is incomplete.
#[test]
fn sglang_hello_claims_the_allocator_page_size() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) =
        with_sidecar(&py, "deploy-sglang-cpu-page8.json", "record_driver.py", &d);
    assert_eq!(facts["C"]["prefill_to_finish"], "FINISH_ABORT", "{facts}");
    for p in [0, 1] {
        let want = format!("hello gives pool {p} block size 4, the deployment's page_size is 8");
        assert!(side_err.contains(&want), "{want}\n{side_err}");
    }
    for w in facts["hook_stats"].as_object().unwrap().values() {
        assert!(w["connect_failures"].as_u64().unwrap() >= 1, "{w}");
        assert!(w["lost_sidecar_down"].as_u64().unwrap() >= 1, "{w}");
        assert_eq!(w["sent_lines"], 0, "{w}");
    }
    let m = Manifest::load(&out).unwrap();
    assert!(!m.capture.complete);
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
}

/// SGLang's SWA allocator (sliding-window models) allocates and frees
/// through two inner allocators of the classes the hook records: the
/// full-attention one's slots are the recorded pool's, the sliding-window
/// one's are another pool's (not recorded). Only the full-attention
/// allocator's events reach the trace: before, each alloc and free was
/// recorded twice into the full pool, the second time under the
/// sliding-window allocator's slot ids, which name other slots there
/// (content marked stale or freed under a reader: false foreign reads).
#[test]
fn sglang_swa_allocator_records_the_full_pool_only() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = with_sidecar(&py, "deploy-hicache-cpu.json", "swa_driver.py", &d);
    assert_eq!(facts["swa_tag"], -1, "{facts}");
    assert!(facts["full_tag"].is_null(), "{facts}");
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    let trace = Trace::open(&out).unwrap();
    let evs = crate::support::record::events(&trace);
    let got: Vec<(Op, u32, u32)> = evs
        .get(&0)
        .map(|v| {
            v.iter()
                .map(|e| (e.op, e.slot_start, e.slot_count))
                .collect()
        })
        .unwrap_or_default();
    let slots = |k: &str| -> Vec<u32> {
        facts[k]["full"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (a, b) = (slots("A"), slots("B"));
    assert_eq!(
        got,
        vec![
            (Op::Alloc, a[0], a.len() as u32),
            (Op::Free, a[0], a.len() as u32),
            (Op::Alloc, b[0], b.len() as u32),
        ],
        "{facts}\n{side_err}"
    );
    assert!(evs.keys().all(|&p| p == 0), "{:?}", evs.keys());
    assert_live_equals_scope(&out);
}
