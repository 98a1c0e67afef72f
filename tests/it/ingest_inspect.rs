//! `kvtrail ingest` (JSONL import) and `kvtrail inspect`, end to end
//! through the binary, plus the seq-hole analysis over file layouts.
//!
//! Index:
//! - ingest_*: JSONL round trip, determinism, bad lines, --skip-bad-lines
//! - seq_holes: data-driven over how a pool's seqs are split into files
//! - inspect_*: text and JSON output

use std::path::Path;

use arrow_array::{Int64Array, StringArray, UInt16Array, UInt32Array, UInt64Array};
use kvtrail::inspect::{Hole, inspect};
use kvtrail::progress::NoReporter;
use kvtrail::schema::{KvEvent, Op, RequestRecord, hex32};
use kvtrail::trace::{Manifest, Trace};
use parquet::basic::Compression;
use serde_json::json;

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace::*;

fn kv_line(e: &KvEvent, with_seq: bool) -> String {
    let mut v = json!({
        "type": "kv", "pool": e.pool, "ts_ns": e.ts_ns, "request_id": e.request_id,
        "op": e.op.as_str(), "slot_start": e.slot_start, "slot_count": e.slot_count,
        "token_pos": e.token_pos,
        "src_pool": e.src.map(|s| s.pool), "src_slot_start": e.src.map(|s| s.slot_start),
        "src_seq": e.src.map(|s| s.seq),
    });
    if with_seq {
        v["seq"] = json!(e.seq);
    }
    v.to_string()
}

fn request_line(r: &RequestRecord) -> String {
    json!({
        "type": "request", "request_id": r.request_id, "external_id": r.external_id,
        "tenant": r.tenant, "arrival_ns": r.arrival_ns, "finish_ns": r.finish_ns,
        "prompt_tokens": r.prompt_tokens, "prefilled_tokens": r.prefilled_tokens,
        "output_tokens": r.output_tokens, "http_status": r.http_status,
        "finish_reason": r.finish_reason, "prefill_pool": r.prefill_pool,
        "decode_pool": r.decode_pool, "prompt_hash": r.prompt_hash.as_ref().map(hex32),
        "output_hash": r.output_hash.as_ref().map(hex32),
    })
    .to_string()
}

/// The common trace as JSONL: requests first, events in emission order;
/// pool 1 lines carry their seq, pool 0 lines let the recorder assign it.
fn jsonl() -> String {
    let mut out = String::new();
    for r in requests() {
        out += &request_line(&r);
        out.push('\n');
    }
    for e in events() {
        out += &kv_line(&e, e.pool == 1);
        out.push('\n');
    }
    out
}

fn write_deploy(dir: &Path) -> String {
    let p = dir.join("deploy.json");
    std::fs::write(&p, serde_json::to_string(&deployment()).unwrap()).unwrap();
    s(&p).to_string()
}

fn contents(t: &Trace) -> (Vec<KvEvent>, Vec<RequestRecord>) {
    let mut evs: Vec<KvEvent> = t.kv_chunks().flat_map(|c| c.unwrap().events).collect();
    evs.sort_by_key(|e| (e.pool, e.seq));
    let mut rs: Vec<RequestRecord> = t.requests().flat_map(|b| b.unwrap()).collect();
    rs.sort_by_key(|r| r.request_id);
    (evs, rs)
}

#[test]
fn ingest_round_trip_matches_the_recorder_and_is_deterministic() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("events.jsonl");
    std::fs::write(&input, jsonl()).unwrap();
    let dep = write_deploy(d.path());
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    for out in [&a, &b] {
        let r = kvtrail(["ingest", s(&input), "--deployment", &dep, "--out", s(out)]).run();
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert!(
            r.stdout.contains("28 kv events, 4 requests"),
            "{}",
            r.stdout
        );
    }
    let ours = Trace::open(&write_trace(d.path())).unwrap();
    assert_eq!(contents(&Trace::open(&a).unwrap()), contents(&ours));
    for f in [
        "trace.json",
        "kv/pool=0/part-00000.parquet",
        "requests/part-00000.parquet",
    ] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f} differs between two ingests of the same input"
        );
    }
    let m = Manifest::load(&a).unwrap();
    assert!(m.capture.complete);
    assert_eq!((m.capture.started_ns, m.capture.ended_ns), (1000, 2004));
    assert_eq!(kvtrail(["verify", s(&a)]).run().code, 0);
    // A whole trace.json is accepted as the deployment.
    let c = d.path().join("c");
    let r = kvtrail([
        "ingest",
        s(&input),
        "--deployment",
        s(&a.join("trace.json")),
        "--out",
        s(&c),
    ])
    .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn ingest_from_stdin_writes_the_same_trace_as_from_the_file() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("events.jsonl");
    std::fs::write(&input, jsonl()).unwrap();
    let dep = write_deploy(d.path());
    let (file, piped) = (d.path().join("file"), d.path().join("piped"));
    let r = kvtrail(["ingest", s(&input), "--deployment", &dep, "--out", s(&file)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = kvtrail(["ingest", "-", "--deployment", &dep, "--out", s(&piped)])
        .stdin(jsonl())
        .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("28 kv events, 4 requests"),
        "{}",
        r.stdout
    );
    assert_eq!(
        contents(&Trace::open(&piped).unwrap()),
        contents(&Trace::open(&file).unwrap())
    );
    for f in [
        "kv/pool=0/part-00000.parquet",
        "requests/part-00000.parquet",
    ] {
        assert_eq!(
            std::fs::read(piped.join(f)).unwrap(),
            std::fs::read(file.join(f)).unwrap(),
            "{f} differs between the ingest of the file and of stdin"
        );
    }
    assert_eq!(kvtrail(["verify", s(&piped)]).run().code, 0);
}

#[test]
fn ingest_bad_line_names_line_and_field_and_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("events.jsonl");
    let mut text = jsonl();
    text = text.replacen("\"op\":\"read\"", "\"op\":\"peek\"", 1);
    std::fs::write(&input, &text).unwrap();
    let line = text.lines().position(|l| l.contains("peek")).unwrap() + 1;
    let dep = write_deploy(d.path());
    let out = d.path().join("t");
    let r = kvtrail(["ingest", s(&input), "--deployment", &dep, "--out", s(&out)]).run();
    assert_eq!(r.code, 2);
    let want = format!("events.jsonl:{line}: field `op`: unknown op \"peek\"");
    assert!(r.stderr.contains(&want), "{}\nwants {want}", r.stderr);
    assert!(r.stderr.contains("--skip-bad-lines"), "{}", r.stderr);
    assert!(!out.exists(), "a failed ingest leaves no half trace");
    // Into a directory that exists already: it is left as it was.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let r = kvtrail(["ingest", s(&input), "--deployment", &dep, "--out", s(&out)]).run();
    assert_eq!(r.code, 2);
    let left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["notes.txt"]);
}

#[test]
fn ingest_unknown_pool_is_a_bad_line() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("e.jsonl");
    std::fs::write(
        &input,
        "{\"type\":\"kv\",\"pool\":5,\"ts_ns\":1,\"request_id\":1,\"op\":\"read\",\"slot_start\":0,\"slot_count\":1}\n",
    )
    .unwrap();
    let dep = write_deploy(d.path());
    let r = kvtrail([
        "ingest",
        s(&input),
        "--deployment",
        &dep,
        "--out",
        s(&d.path().join("t")),
    ])
    .run();
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .contains("e.jsonl:1: field `pool`: unknown pool id 5"),
        "{}",
        r.stderr
    );
}

#[test]
fn ingest_skip_bad_lines_marks_the_loss() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("events.jsonl");
    let mut lines: Vec<String> = jsonl().lines().map(str::to_string).collect();
    // Break a pool-0 event (recorder-assigned seq) and a pool-1 event
    // (seq on the line), and add a line that is not JSON.
    let p0 = lines
        .iter()
        .position(|l| l.contains("\"pool\":0") && l.contains("\"op\":\"write\""))
        .unwrap();
    lines[p0] = lines[p0].replace("\"slot_count\":8", "\"slot_count\":0");
    let p1 = lines
        .iter()
        .position(|l| l.contains("\"pool\":1") && l.contains("\"op\":\"read\""))
        .unwrap();
    lines[p1] = lines[p1].replace("\"op\":\"read\"", "\"op\":7");
    lines.push("{\"type\":\"kv\",".into());
    std::fs::write(&input, lines.join("\n")).unwrap();
    let dep = write_deploy(d.path());
    let out = d.path().join("t");
    let r = kvtrail([
        "ingest",
        s(&input),
        "--deployment",
        &dep,
        "--out",
        s(&out),
        "--skip-bad-lines",
    ])
    .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("3 bad lines SKIPPED"), "{}", r.stdout);
    assert!(
        r.stderr
            .contains(&format!("events.jsonl:{}: field `slot_count`", p0 + 1)),
        "{}",
        r.stderr
    );
    let m = Manifest::load(&out).unwrap();
    assert!(!m.capture.complete);
    assert_eq!(m.capture.extra["skipped_lines"], json!(3));
    // Both lost events are explicit seq holes.
    let rep = inspect(&Trace::open(&out).unwrap(), &NoReporter).unwrap();
    let holes: Vec<(u16, u64)> = rep
        .kv
        .pools
        .iter()
        .map(|p| (p.pool, p.missing_events))
        .collect();
    assert_eq!(holes, [(0, 1), (1, 1)]);
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 1);
    assert!(
        v.stdout.contains("3 malformed input lines were skipped"),
        "{}",
        v.stdout
    );
}

/// Lines of several runs (docs/jsonl.md): one event per run with the
/// recorder's next seqs; a run outside the pool stops the import naming
/// it, or with --skip-bad-lines keeps the runs before it and leaves a hole
/// as large as the rest; a line refused whole is a hole of all its runs.
#[test]
fn ingest_lines_of_several_runs() {
    let d = tempfile::tempdir().unwrap();
    let input = d.path().join("events.jsonl");
    let lines = [
        r#"{"type":"kv","pool":0,"ts_ns":1,"request_id":3,"op":"alloc","runs":[[0,8],[16,8]]}"#,
        r#"{"type":"kv","pool":0,"ts_ns":2,"request_id":3,"op":"write","runs":[[0,8,0],[16,4,8]]}"#,
        r#"{"type":"kv","pool":0,"ts_ns":3,"request_id":3,"op":"read","runs":[[0,8,0],[4000000000,4,8],[16,4,12]]}"#,
        // Refused whole (a run of count 0): a hole of its three runs.
        r#"{"type":"kv","pool":0,"ts_ns":4,"request_id":3,"op":"read","runs":[[0,1,0],[1,0,1],[2,1,2]]}"#,
        r#"{"type":"kv","pool":0,"ts_ns":5,"request_id":3,"op":"free","slot_start":0,"slot_count":24}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let dep = write_deploy(d.path());
    let out = d.path().join("t");
    let r = kvtrail(["ingest", s(&input), "--deployment", &dep, "--out", s(&out)]).run();
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("events.jsonl:3: field `runs[1]`"),
        "{}",
        r.stderr
    );
    assert!(!out.exists());
    let r = kvtrail([
        "ingest",
        s(&input),
        "--deployment",
        &dep,
        "--out",
        s(&out),
        "--skip-bad-lines",
    ])
    .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let t = Trace::open(&out).unwrap();
    let (evs, _) = contents(&t);
    let got: Vec<_> = evs
        .iter()
        .map(|e| (e.seq, e.op, e.slot_start, e.slot_count, e.token_pos))
        .collect();
    assert_eq!(
        got,
        [
            (0, Op::Alloc, 0, 8, None),
            (1, Op::Alloc, 16, 8, None),
            (2, Op::Write, 0, 8, Some(0)),
            (3, Op::Write, 16, 4, Some(8)),
            (4, Op::Read, 0, 8, Some(0)),
            // The run outside the pool is a hole of one (seq 5), its
            // line's other runs kept, as the sidecar keeps them.
            (6, Op::Read, 16, 4, Some(12)),
            (10, Op::Free, 0, 24, None),
        ]
    );
    let rep = inspect(&t, &NoReporter).unwrap();
    let holes: Vec<(u16, u64)> = rep
        .kv
        .pools
        .iter()
        .filter(|p| p.missing_events > 0)
        .map(|p| (p.pool, p.missing_events))
        .collect();
    assert_eq!(holes, [(0, 4)]);
}

/// Writes a trace whose pool 0 seqs are split into files as given.
fn trace_with_seq_files(dir: &Path, files: &[&[u64]]) {
    for (i, seqs) in files.iter().enumerate() {
        let n = seqs.len();
        write_parquet(
            &dir.join(format!("kv/f{i}.parquet")),
            vec![
                ("pool", arr(UInt16Array::from(vec![0u16; n]))),
                ("seq", arr(UInt64Array::from(seqs.to_vec()))),
                ("ts_ns", arr(Int64Array::from(vec![5i64; n]))),
                ("request_id", arr(UInt64Array::from(vec![1u64; n]))),
                ("op", arr(StringArray::from(vec!["read"; n]))),
                ("slot_start", arr(UInt32Array::from(vec![0u32; n]))),
                ("slot_count", arr(UInt32Array::from(vec![1u32; n]))),
            ],
            Compression::UNCOMPRESSED,
        );
    }
    let m = json!({"format": "kvtrail-trace", "version": 1,
                   "deployment": serde_json::to_value(deployment()).unwrap()});
    std::fs::write(dir.join("trace.json"), m.to_string()).unwrap();
}

fn hole(after: Option<u64>, before: u64) -> Hole {
    Hole {
        after_seq: after,
        before_seq: before,
        missing: before - after.map_or(0, |a| a + 1),
    }
}

#[test]
fn seq_holes() {
    // The highest seq a trace may hold (2^64-1 is reserved).
    const M: u64 = u64::MAX - 1;
    // (files of pool-0 seqs, holes, duplicates, method)
    type Case<'a> = (Vec<&'a [u64]>, Vec<Hole>, u64, &'a str);
    let cases: Vec<Case> = vec![
        (vec![&[0, 1, 2], &[3, 4]], vec![], 0, "runs"),
        (vec![&[0, 1, 5, 6]], vec![hole(Some(1), 5)], 0, "runs"),
        (vec![&[3, 4]], vec![hole(None, 3)], 0, "runs"),
        (vec![&[5, 6], &[0, 1]], vec![hole(Some(1), 5)], 0, "runs"),
        (vec![&[0, 2, 1]], vec![], 0, "sort"),
        (
            vec![&[0, 1, 4], &[2, 6]],
            vec![hole(Some(2), 4), hole(Some(4), 6)],
            0,
            "sort",
        ),
        (
            vec![&[9, 200, 0]],
            vec![hole(Some(0), 9), hole(Some(9), 200)],
            0,
            "sort",
        ),
        (vec![&[2, 1]], vec![hole(None, 1)], 0, "sort"),
        // seqs at the top of the u64 range must not overflow (found by
        // flipping one bit of a golden file's seq column).
        (vec![&[M - 1, M]], vec![hole(None, M - 1)], 0, "runs"),
        (
            vec![&[5, M]],
            vec![hole(None, 5), hole(Some(5), M)],
            0,
            "runs",
        ),
        (
            vec![&[M], &[M - 3]],
            vec![hole(None, M - 3), hole(Some(M - 3), M)],
            0,
            "runs",
        ),
        (
            vec![&[M, M - 2]],
            vec![hole(None, M - 2), hole(Some(M - 2), M)],
            0,
            "sort",
        ),
        (vec![&[M, 0]], vec![hole(Some(0), M)], 0, "sort"),
    ];
    for (files, holes, dups, method) in cases {
        let d = tempfile::tempdir().unwrap();
        trace_with_seq_files(d.path(), &files);
        let rep = inspect(&Trace::open(d.path()).unwrap(), &NoReporter).unwrap();
        let p = &rep.kv.pools[0];
        let got = (
            p.holes_listed.clone(),
            p.holes,
            p.missing_events,
            p.duplicate_seqs,
            p.seq_check.as_str(),
        );
        let want = (
            holes.clone(),
            holes.len() as u64,
            holes.iter().map(|h| h.missing).sum::<u64>(),
            dups,
            method,
        );
        assert_eq!(got, want, "files {files:?}");
        let warned = rep
            .evidence_warnings
            .iter()
            .any(|w| w.contains("seq holes"));
        assert_eq!(warned, !holes.is_empty(), "{:?}", rep.evidence_warnings);
    }
}

#[test]
fn inspect_text_and_json() {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    let r = kvtrail(["inspect", s(&t)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "pool 0   prefill-0        prefill capacity 64 tokens, page 4, prompts >= 58 tokens exceed it",
        "requests    4 from 3 tenants; top: acme 2, globex 1, initech 1",
        "status    200 3, 429 1",
        "prefilled < prompt: 1 (1 with 2xx), e.g. request 3",
        "prompt over prefill limit: 1 (1 with 2xx), e.g. request 3",
        "kv events   28: alloc 8, write 8, read 4, free 8",
        "seq holes 0 (0 events missing), duplicate seqs 0",
        "evidence    complete",
    ] {
        assert!(r.stdout.contains(want), "lacks {want:?}:\n{}", r.stdout);
    }
    let j1 = kvtrail(["inspect", "--json", s(&t)]).run();
    let j2 = kvtrail(["inspect", "--json", s(&t)]).run();
    assert_eq!(j1.stdout, j2.stdout, "inspect --json is deterministic");
    let v: serde_json::Value = serde_json::from_str(&j1.stdout).unwrap();
    assert_eq!(v["requests"]["over_long_prompts"]["examples"], json!([3]));
    assert_eq!(
        v["kv"]["pools"][1]["by_op"][1],
        json!({"key": "write", "count": 4})
    );
    assert_eq!(v["time_range"], json!({"first_ns": 1000, "last_ns": 2004}));
}

/// A duplicate seq is bad input, in one file or across files, in order or
/// not (docs/trace-format.md, "Duplicated events"): an error naming both rows.
#[test]
fn duplicate_seqs_are_refused() {
    const M: u64 = u64::MAX - 1;
    let cases: Vec<(Vec<&[u64]>, &str)> = vec![
        (vec![&[0, 1, 1, 2]], "f0.parquet row 1 and "),
        (vec![&[0, 1], &[1, 2]], "f0.parquet row 1 and "),
        (vec![&[M, M]], "f0.parquet row 0 and "),
        (vec![&[2, 0, 2]], "f0.parquet row 0 and "),
    ];
    for (files, first) in cases {
        let d = tempfile::tempdir().unwrap();
        trace_with_seq_files(d.path(), &files);
        let e = inspect(&Trace::open(d.path()).unwrap(), &NoReporter).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("two events with seq"), "{files:?}: {msg}");
        assert!(msg.contains(first), "{files:?}: {msg}");
        assert!(msg.contains("column `seq`"), "{files:?}: {msg}");
    }
}

/// Out of order over the whole u64 range: sorted (bounded memory), not
/// refused and not a bitmap of 2^64 bits.
#[test]
fn seqs_out_of_order_over_a_huge_range_are_sorted_not_allocated() {
    let d = tempfile::tempdir().unwrap();
    trace_with_seq_files(d.path(), &[&[u64::MAX - 1, 0]]);
    let r = kvtrail(["inspect", "--json", s(d.path())]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let p = &v["kv"]["pools"][0];
    assert_eq!(p["missing_events"], json!(u64::MAX - 2), "{p}");
    assert_eq!(p["seq_check"], "sort", "{p}");
}
