//! A trace written by hand with raw arrow/parquet, the way another program
//! (pyarrow, a converter) would write it, reads exactly like the Recorder's:
//! other column order, 64-bit integers, dictionary and large strings, extra
//! columns, absent nullable columns, files split at arbitrary rows, Hive
//! folders, snappy/gzip/uncompressed, tiny row groups, marker files, and a
//! manifest without `files`.

use std::path::Path;

use arrow_array::types::{Int8Type, Int32Type};
use arrow_array::{
    ArrayRef, DictionaryArray, Int32Array, Int64Array, LargeStringArray, RecordBatch, StringArray,
    UInt16Array, UInt32Array, UInt64Array,
};
use kvtrail::inspect::inspect;
use kvtrail::progress::NoReporter;
use kvtrail::schema::{KvEvent, RequestRecord};
use kvtrail::trace::{Trace, scan_requests};
use parquet::basic::{Compression, GzipLevel};

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace::*;

fn i64s(v: impl Iterator<Item = i64>) -> ArrayRef {
    arr(Int64Array::from_iter_values(v))
}

/// pool 0: pyarrow-like int64 columns, dictionary op, an extra column, no
/// token_pos/src columns at all (they are null for pool 0).
fn pool0_batch(evs: &[KvEvent]) -> RecordBatch {
    let ops: DictionaryArray<Int8Type> = evs.iter().map(|e| e.op.as_str()).collect();
    RecordBatch::try_from_iter(vec![
        ("ts_ns", i64s(evs.iter().map(|e| e.ts_ns))),
        ("op", arr(ops)),
        (
            "layer",
            arr(Int32Array::from_iter_values(evs.iter().map(|_| 7))),
        ),
        ("request_id", i64s(evs.iter().map(|e| e.request_id as i64))),
        ("slot_count", i64s(evs.iter().map(|e| e.slot_count as i64))),
        ("pool", i64s(evs.iter().map(|e| e.pool as i64))),
        ("seq", i64s(evs.iter().map(|e| e.seq as i64))),
        ("slot_start", i64s(evs.iter().map(|e| e.slot_start as i64))),
    ])
    .unwrap()
}

/// pool 1: every column, contract widths, op as LargeUtf8, nullable columns
/// with real nulls.
fn pool1_batch(evs: &[KvEvent]) -> RecordBatch {
    RecordBatch::try_from_iter(vec![
        (
            "src_seq",
            arr(UInt64Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.seq)),
            )),
        ),
        (
            "pool",
            arr(UInt16Array::from_iter_values(evs.iter().map(|e| e.pool))),
        ),
        (
            "seq",
            arr(UInt64Array::from_iter_values(evs.iter().map(|e| e.seq))),
        ),
        ("ts_ns", i64s(evs.iter().map(|e| e.ts_ns))),
        (
            "request_id",
            arr(UInt64Array::from_iter_values(
                evs.iter().map(|e| e.request_id),
            )),
        ),
        (
            "op",
            arr(LargeStringArray::from_iter_values(
                evs.iter().map(|e| e.op.as_str()),
            )),
        ),
        (
            "slot_start",
            arr(UInt32Array::from_iter_values(
                evs.iter().map(|e| e.slot_start),
            )),
        ),
        (
            "slot_count",
            arr(UInt32Array::from_iter_values(
                evs.iter().map(|e| e.slot_count),
            )),
        ),
        (
            "token_pos",
            arr(UInt32Array::from_iter(evs.iter().map(|e| e.token_pos))),
        ),
        (
            "src_pool",
            arr(UInt16Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.pool)),
            )),
        ),
        (
            "src_slot_start",
            arr(UInt32Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.slot_start)),
            )),
        ),
        (
            "engine_note",
            arr(StringArray::from_iter_values(evs.iter().map(|_| "x"))),
        ),
    ])
    .unwrap()
}

/// requests: alphabetical column order, int64 numbers, dictionary tenant,
/// large-string external_id, no hash columns, an extra column.
fn requests_batch(rs: &[RequestRecord]) -> RecordBatch {
    let tenant: DictionaryArray<Int32Type> = rs.iter().map(|r| r.tenant.as_str()).collect();
    RecordBatch::try_from_iter(vec![
        ("arrival_ns", i64s(rs.iter().map(|r| r.arrival_ns))),
        (
            "decode_pool",
            arr(Int64Array::from_iter(
                rs.iter().map(|r| r.decode_pool.map(i64::from)),
            )),
        ),
        (
            "external_id",
            arr(LargeStringArray::from_iter(
                rs.iter().map(|r| r.external_id.clone()),
            )),
        ),
        (
            "finish_ns",
            arr(Int64Array::from_iter(rs.iter().map(|r| r.finish_ns))),
        ),
        (
            "finish_reason",
            arr(StringArray::from_iter(
                rs.iter().map(|r| r.finish_reason.clone()),
            )),
        ),
        ("http_status", i64s(rs.iter().map(|r| r.http_status as i64))),
        (
            "model",
            arr(StringArray::from_iter_values(rs.iter().map(|_| "glm"))),
        ),
        (
            "output_tokens",
            i64s(rs.iter().map(|r| r.output_tokens as i64)),
        ),
        (
            "prefill_pool",
            arr(Int64Array::from_iter(
                rs.iter().map(|r| r.prefill_pool.map(i64::from)),
            )),
        ),
        (
            "prefilled_tokens",
            arr(Int64Array::from_iter(
                rs.iter().map(|r| r.prefilled_tokens.map(i64::from)),
            )),
        ),
        (
            "prompt_tokens",
            i64s(rs.iter().map(|r| r.prompt_tokens as i64)),
        ),
        ("request_id", i64s(rs.iter().map(|r| r.request_id as i64))),
        ("tenant", arr(tenant)),
    ])
    .unwrap()
}

fn write_by_hand(root: &Path) {
    let evs = events();
    let p0: Vec<KvEvent> = evs.iter().copied().filter(|e| e.pool == 0).collect();
    let p1: Vec<KvEvent> = evs.iter().copied().filter(|e| e.pool == 1).collect();
    // pool 0 split at row 5 into two Hive sub-folders, snappy.
    write_batches(
        &root.join("kv/pool=0/chunk=a/part-0.parquet"),
        &[pool0_batch(&p0[..5])],
        Compression::SNAPPY,
        1024,
    );
    write_batches(
        &root.join("kv/pool=0/chunk=b/part-0.parquet"),
        &[pool0_batch(&p0[5..])],
        Compression::SNAPPY,
        1024,
    );
    // pool 1 split at row 11, gzip, 3-row row groups; the later rows in the
    // file that sorts first.
    write_batches(
        &root.join("kv/pool=1/a.parquet"),
        &[pool1_batch(&p1[11..])],
        Compression::GZIP(GzipLevel::default()),
        3,
    );
    write_batches(
        &root.join("kv/pool=1/b.parquet"),
        &[pool1_batch(&p1[..11])],
        Compression::UNCOMPRESSED,
        3,
    );
    // requests split at row 1, under a date folder.
    let rs = requests();
    write_batches(
        &root.join("requests/date=2026-11-30/r1.parquet"),
        &[requests_batch(&rs[..1])],
        Compression::GZIP(GzipLevel::default()),
        1024,
    );
    write_batches(
        &root.join("requests/date=2026-11-30/r2.parquet"),
        &[requests_batch(&rs[1..])],
        Compression::SNAPPY,
        2,
    );
    // Marker and hidden files readers must skip.
    std::fs::write(root.join("kv/_SUCCESS"), b"").unwrap();
    std::fs::write(root.join("kv/pool=1/.a.parquet.crc"), b"crc").unwrap();
    let manifest = serde_json::json!({
        "format": "kvtrail-trace",
        "version": 1,
        "written_by": "a hand-rolled pyarrow script",
        "deployment": serde_json::to_value(deployment()).unwrap(),
        "capture": {"writer": "pyarrow", "started_ns": 1000, "ended_ns": 3000,
                     "complete": true, "from_engine_start": true, "host": "node-7"}
    });
    std::fs::write(
        root.join("trace.json"),
        serde_json::to_string_pretty(&manifest).unwrap(),
    )
    .unwrap();
}

fn contents(t: &Trace) -> (Vec<KvEvent>, Vec<RequestRecord>) {
    let mut evs: Vec<KvEvent> = t.kv_chunks().flat_map(|c| c.unwrap().events).collect();
    evs.sort_by_key(|e| (e.pool, e.seq));
    let mut rs: Vec<RequestRecord> = t.requests().flat_map(|b| b.unwrap()).collect();
    rs.sort_by_key(|r| r.request_id);
    (evs, rs)
}

#[test]
fn hand_written_trace_reads_like_the_recorders() {
    let d = tempfile::tempdir().unwrap();
    let ours = Trace::open(&write_trace(d.path())).unwrap();
    let theirs_dir = d.path().join("theirs");
    write_by_hand(&theirs_dir);
    let theirs = Trace::open(&theirs_dir).unwrap();
    assert_eq!(theirs.kv_files.len(), 4, "marker files are not data");

    let (ours_ev, ours_rq) = contents(&ours);
    let (theirs_ev, theirs_rq) = contents(&theirs);
    let mut expect = events();
    expect.sort_by_key(|e| (e.pool, e.seq));
    assert_eq!(ours_ev, expect);
    assert_eq!(theirs_ev, ours_ev);
    assert_eq!(theirs_rq, ours_rq);

    // The same analysis results, except what differs on purpose.
    let a = inspect(&ours, &NoReporter).unwrap();
    let b = inspect(&theirs, &NoReporter).unwrap();
    assert_eq!(a.kv, b.kv);
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.time_range, b.time_range);
    assert_eq!(b.files.listed, None);
    assert!(
        b.evidence_warnings
            .iter()
            .any(|w| w.contains("nothing can be verified")),
        "{:?}",
        b.evidence_warnings
    );
    let mut rows = Vec::new();
    let idx = scan_requests(&theirs, |r| rows.push(r)).unwrap();
    assert_eq!(idx.len(), 4);
    assert_eq!(idx.tenant(3), Some("acme"));
    assert_eq!(rows.iter().find(|r| r.request_id == 3), Some(&ours_rq[2]));

    // verify: no digests to check is a failure to verify, not an error.
    let v = kvtrail(["verify", s(&theirs_dir)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
    assert!(v.stdout.contains("unverifiable"), "{}", v.stdout);
}
