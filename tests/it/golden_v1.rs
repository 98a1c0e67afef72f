//! Golden trace files for format v1: every future kvtrail must keep reading
//! tests/data/golden-v1/ with exactly the contents below, and keep importing
//! tests/data/jsonl/incident.jsonl to the same contents.
//!
//! The files were written once by this test with `KVTRAIL_UPDATE_GOLDEN=1`
//! (never rewrite them to make a failure go away: a failure here means old
//! traces no longer read the same).
//!
//! The trace is incident-shaped: request 2 (globex) sent a prompt over the
//! prefill limit, got a 1-token placeholder, and its decode read slots that
//! still held request 1's (acme) KV; pool 1 has a lost event (seq 5).

use std::path::{Path, PathBuf};

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord, hash_tokens, hex32};
use kvtrail::trace::verify::verify;
use kvtrail::trace::{Deployment, Manifest, Pool, Role, Trace};

use crate::support::cli::{kvtrail, s};
use crate::support::updating_goldens;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn deployment() -> Deployment {
    let pool = |id, name: &str, role| Pool {
        id,
        name: name.into(),
        role,
        capacity_tokens: 64,
        page_size: 4,
        extra: Default::default(),
    };
    Deployment {
        name: "golden / v1".into(),
        engine: "sglang 0.5.19 (PD)".into(),
        context_window: 4096,
        pools: vec![
            pool(0, "prefill-0", Role::Prefill),
            pool(1, "decode-0", Role::Decode),
        ],
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

/// (pool, seq, ts_ns, request_id, op, slot_start, slot_count, token_pos, src)
type Row = (
    u16,
    u64,
    i64,
    u64,
    Op,
    u32,
    u32,
    Option<u32>,
    Option<(u16, u32, u64)>,
);

const T0: i64 = 1_764_460_800_000_000_000;

#[rustfmt::skip]
const EVENTS: &[Row] = &[
    (0, 0, T0 + 100, 1, Op::Alloc, 0, 16, None, None),
    (0, 1, T0 + 200, 1, Op::Write, 0, 16, Some(0), None),
    (1, 0, T0 + 300, 1, Op::Alloc, 0, 20, None, None),
    (1, 1, T0 + 400, 1, Op::Write, 0, 16, Some(0), Some((0, 0, 1))),
    (0, 2, T0 + 500, 1, Op::Free, 0, 16, None, None),
    (1, 2, T0 + 600, 1, Op::Write, 16, 4, Some(16), None),
    (1, 3, T0 + 700, 1, Op::Read, 0, 20, Some(0), None),
    (1, 4, T0 + 800, 1, Op::Free, 0, 20, None, None),
    (0, 3, T0 + 900, 2, Op::Alloc, 16, 1, None, None),
    (0, 4, T0 + 1000, 2, Op::Write, 16, 1, Some(0), None),
    (1, 6, T0 + 1100, 2, Op::Alloc, 0, 8, None, None),
    (1, 7, T0 + 1200, 2, Op::Write, 0, 1, Some(0), Some((0, 16, 4))),
    (0, 5, T0 + 1300, 2, Op::Free, 16, 1, None, None),
    (0, 6, T0 + 1400, 0, Op::Scrub, 16, 1, None, None),
    (1, 8, T0 + 1500, 2, Op::Read, 0, 8, Some(0), None),
    (1, 9, T0 + 1600, 2, Op::Share, 32, 4, Some(0), None),
    (1, 10, T0 + 1700, 2, Op::Free, 0, 8, None, None),
];

fn events() -> Vec<KvEvent> {
    EVENTS
        .iter()
        .map(
            |&(pool, seq, ts_ns, request_id, op, slot_start, slot_count, token_pos, src)| KvEvent {
                pool,
                seq,
                ts_ns,
                request_id,
                op,
                slot_start,
                slot_count,
                token_pos,
                src: src.map(|(pool, slot_start, seq)| CopySrc {
                    pool,
                    slot_start,
                    seq,
                }),
            },
        )
        .collect()
}

fn requests() -> Vec<RequestRecord> {
    vec![
        RequestRecord {
            request_id: 1,
            external_id: Some("chatcmpl-acme-1".into()),
            tenant: "acme".into(),
            arrival_ns: T0 + 50,
            finish_ns: Some(T0 + 850),
            prompt_tokens: 16,
            prefilled_tokens: Some(16),
            output_tokens: 4,
            http_status: 200,
            finish_reason: Some("stop".into()),
            prefill_pool: Some(0),
            decode_pool: Some(1),
            prompt_hash: Some(hash_tokens(&(0..16).collect::<Vec<u32>>())),
            output_hash: Some(hash_tokens(&[7, 8, 9, 2])),
        },
        RequestRecord {
            request_id: 2,
            external_id: Some("chatcmpl-globex-2".into()),
            tenant: "globex".into(),
            arrival_ns: T0 + 850,
            finish_ns: Some(T0 + 1750),
            prompt_tokens: 5000,
            prefilled_tokens: Some(1),
            output_tokens: 8,
            http_status: 200,
            finish_reason: Some("length".into()),
            prefill_pool: Some(0),
            decode_pool: Some(1),
            prompt_hash: Some(hash_tokens(&(100..5100).collect::<Vec<u32>>())),
            output_hash: None,
        },
        RequestRecord {
            request_id: 3,
            external_id: None,
            tenant: "initech".into(),
            arrival_ns: T0 + 900,
            finish_ns: None,
            prompt_tokens: 8,
            prefilled_tokens: None,
            output_tokens: 0,
            http_status: 429,
            finish_reason: Some("error".into()),
            prefill_pool: None,
            decode_pool: None,
            prompt_hash: None,
            output_hash: None,
        },
    ]
}

/// Writes the golden trace and the JSONL import (bless mode only).
fn bless(golden: &Path, jsonl_dir: &Path) {
    let _ = std::fs::remove_dir_all(golden);
    let opts = RecorderOptions {
        started_ns: Some(T0),
        row_group_rows: 4,
        ..Default::default()
    };
    let mut rec = Recorder::create(golden, deployment(), opts).unwrap();
    let mut lines = Vec::new();
    for r in requests() {
        lines.push(
            serde_json::json!({
                "type": "request", "request_id": r.request_id, "external_id": r.external_id,
                "tenant": r.tenant, "arrival_ns": r.arrival_ns, "finish_ns": r.finish_ns,
                "prompt_tokens": r.prompt_tokens, "prefilled_tokens": r.prefilled_tokens,
                "output_tokens": r.output_tokens, "http_status": r.http_status,
                "finish_reason": r.finish_reason, "prefill_pool": r.prefill_pool,
                "decode_pool": r.decode_pool,
                "prompt_hash": r.prompt_hash.as_ref().map(hex32),
                "output_hash": r.output_hash.as_ref().map(hex32),
            })
            .to_string(),
        );
        rec.request(r).unwrap();
    }
    for e in events() {
        rec.kv_with_seq(e).unwrap();
        let mut v = serde_json::json!({
            "type": "kv", "pool": e.pool, "ts_ns": e.ts_ns, "request_id": e.request_id,
            "op": e.op.as_str(), "slot_start": e.slot_start, "slot_count": e.slot_count,
            "token_pos": e.token_pos, "src_pool": e.src.map(|s| s.pool),
            "src_slot_start": e.src.map(|s| s.slot_start), "src_seq": e.src.map(|s| s.seq),
        });
        // Pool 1 lines carry their seq (and so the hole at 5); pool 0 lines
        // leave it to the recorder.
        if e.pool == 1 {
            v["seq"] = e.seq.into();
        }
        lines.push(v.to_string());
    }
    rec.close().unwrap();
    std::fs::create_dir_all(jsonl_dir).unwrap();
    std::fs::write(jsonl_dir.join("incident.jsonl"), lines.join("\n") + "\n").unwrap();
    let mut dep = serde_json::to_string_pretty(&deployment()).unwrap();
    dep.push('\n');
    std::fs::write(jsonl_dir.join("deploy.json"), dep).unwrap();
}

fn check_contents(t: &Trace) {
    let mut got: Vec<KvEvent> = t.kv_chunks().flat_map(|c| c.unwrap().events).collect();
    got.sort_by_key(|e| (e.pool, e.seq));
    let mut want = events();
    want.sort_by_key(|e| (e.pool, e.seq));
    assert_eq!(got, want);
    let mut reqs: Vec<RequestRecord> = t.requests().flat_map(|b| b.unwrap()).collect();
    reqs.sort_by_key(|r| r.request_id);
    assert_eq!(reqs, requests());
    assert_eq!(t.manifest.deployment, deployment());
}

#[test]
fn golden_v1_trace_reads_exactly() {
    let golden = data().join("golden-v1");
    let jsonl = data().join("jsonl");
    if updating_goldens() {
        bless(&golden, &jsonl);
    }
    let t = Trace::open(&golden).unwrap();
    check_contents(&t);
    let m: &Manifest = &t.manifest;
    assert_eq!((m.format.as_str(), m.version), ("kvtrail-trace", 1));
    assert!(m.capture.complete);
    assert_eq!(m.capture.from_engine_start, Some(true));
    assert_eq!((m.capture.started_ns, m.capture.ended_ns), (T0, T0 + 1750));
    let files: Vec<(&str, u64)> = m
        .files
        .as_ref()
        .unwrap()
        .iter()
        .map(|f| (f.path.as_str(), f.rows))
        .collect();
    assert_eq!(
        files,
        [
            ("kv/pool=0/part-00000.parquet", 7),
            ("kv/pool=1/part-00000.parquet", 10),
            ("requests/part-00000.parquet", 3),
        ]
    );
    let report = verify(&golden).unwrap();
    assert!(report.ok, "{:?}", report.problems);

    // The analysis a responder sees first.
    let r = kvtrail(["inspect", "--json", s(&golden)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        v["kv"]["pools"][1]["holes_listed"],
        serde_json::json!([{"after_seq": 4, "before_seq": 6, "missing": 1}])
    );
    assert_eq!(
        v["requests"]["short_prefill"]["examples"],
        serde_json::json!([2])
    );
    assert_eq!(
        v["requests"]["over_long_prompts"]["with_2xx"],
        serde_json::json!(1)
    );
}

#[test]
fn golden_v1_jsonl_imports_to_the_same_contents() {
    let jsonl = data().join("jsonl");
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("t");
    let r = kvtrail([
        "ingest",
        s(&jsonl.join("incident.jsonl")),
        "--deployment",
        s(&jsonl.join("deploy.json")),
        "--out",
        s(&out),
    ])
    .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    check_contents(&Trace::open(&out).unwrap());
}
