//! A small valid trace built with the Recorder (an incident shape: two
//! pools, four requests), and a hand-rolled Parquet writer for files no
//! kvtrail writer would produce.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch};
use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::write::PartOptions;
use kvtrail::trace::{Deployment, Pool, Role};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

pub fn deployment() -> Deployment {
    let pool = |id, name: &str, role, cap| Pool {
        id,
        name: name.into(),
        role,
        capacity_tokens: cap,
        page_size: 4,
        extra: Default::default(),
    };
    Deployment {
        name: "test".into(),
        engine: "sglang-test".into(),
        context_window: 4096,
        pools: vec![
            pool(0, "prefill-0", Role::Prefill, 64),
            pool(1, "decode-0", Role::Decode, 128),
        ],
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

/// Events of a small incident-shaped trace: pool 0 without token_pos or
/// copies, pool 1 with both. Seqs are set (0.. per pool).
pub fn events() -> Vec<KvEvent> {
    let mut out = Vec::new();
    let mut seqs = [0u64; 2];
    let mut push = |pool: u16, rid: u64, op: Op, start: u32, count: u32, src: Option<CopySrc>| {
        let seq = seqs[pool as usize];
        seqs[pool as usize] += 1;
        out.push(KvEvent {
            pool,
            seq,
            ts_ns: 1_000 + out.len() as i64 * 10,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: (pool == 1 && op != Op::Free && op != Op::Alloc).then_some(start % 7),
            src,
        });
    };
    for rid in 1..=4u64 {
        let s = (rid as u32 - 1) * 8;
        push(0, rid, Op::Alloc, s, 8, None);
        push(0, rid, Op::Write, s, 8, None);
        push(1, rid, Op::Alloc, s, 8, None);
        let src = CopySrc {
            pool: 0,
            slot_start: s,
            seq: 2 * (rid - 1) + 1,
        };
        push(1, rid, Op::Write, s, 8, Some(src));
        push(1, rid, Op::Read, s, 8, None);
        push(0, rid, Op::Free, s, 8, None);
        push(1, rid, Op::Free, s, 8, None);
    }
    out
}

pub fn requests() -> Vec<RequestRecord> {
    (1..=4u64)
        .map(|i| RequestRecord {
            request_id: i,
            external_id: (i % 2 == 0).then(|| format!("chatcmpl-{i}")),
            tenant: ["acme", "globex", "acme", "initech"][i as usize - 1].into(),
            arrival_ns: 1_000 + i as i64,
            finish_ns: Some(2_000 + i as i64),
            prompt_tokens: if i == 3 { 5000 } else { 8 },
            prefilled_tokens: Some(if i == 3 { 1 } else { 8 }),
            output_tokens: 3,
            http_status: if i == 4 { 429 } else { 200 },
            finish_reason: Some("stop".into()),
            prefill_pool: Some(0),
            decode_pool: Some(1),
            prompt_hash: None,
            output_hash: None,
        })
        .collect()
}

/// Writes the small trace with the Recorder (one part file per stream).
pub fn write_trace(dir: &Path) -> PathBuf {
    let t = dir.join("trace");
    let opts = RecorderOptions {
        started_ns: Some(1_000),
        row_group_rows: 1 << 16,
        part: PartOptions::default(),
        ..Default::default()
    };
    let mut rec = Recorder::create(&t, deployment(), opts).unwrap();
    for e in events() {
        rec.kv_with_seq(e).unwrap();
    }
    for r in requests() {
        rec.request(r).unwrap();
    }
    rec.close().unwrap();
    t
}

/// Writes `cols` as one Parquet file with the given compression.
pub fn write_parquet(path: &Path, cols: Vec<(&str, ArrayRef)>, compression: Compression) {
    let batch = RecordBatch::try_from_iter(cols).unwrap();
    write_batches(path, &[batch], compression, 1024);
}

pub fn write_batches(
    path: &Path,
    batches: &[RecordBatch],
    compression: Compression,
    row_group_rows: usize,
) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let props = WriterProperties::builder()
        .set_compression(compression)
        .set_max_row_group_row_count(Some(row_group_rows))
        .build();
    let f = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(f, batches[0].schema(), Some(props)).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
}

pub fn arr<A: arrow_array::Array + 'static>(a: A) -> ArrayRef {
    Arc::new(a)
}

/// Every kv column of `evs`, by name, for rewriting (or tampering with) a
/// pool's file.
pub fn kv_cols(evs: &[KvEvent]) -> Vec<(&'static str, ArrayRef)> {
    vec![
        (
            "pool",
            arr(arrow_array::UInt16Array::from_iter_values(
                evs.iter().map(|e| e.pool),
            )),
        ),
        (
            "seq",
            arr(arrow_array::UInt64Array::from_iter_values(
                evs.iter().map(|e| e.seq),
            )),
        ),
        (
            "ts_ns",
            arr(arrow_array::Int64Array::from_iter_values(
                evs.iter().map(|e| e.ts_ns),
            )),
        ),
        (
            "request_id",
            arr(arrow_array::UInt64Array::from_iter_values(
                evs.iter().map(|e| e.request_id),
            )),
        ),
        (
            "op",
            arr(arrow_array::StringArray::from_iter_values(
                evs.iter().map(|e| e.op.as_str()),
            )),
        ),
        (
            "slot_start",
            arr(arrow_array::UInt32Array::from_iter_values(
                evs.iter().map(|e| e.slot_start),
            )),
        ),
        (
            "slot_count",
            arr(arrow_array::UInt32Array::from_iter_values(
                evs.iter().map(|e| e.slot_count),
            )),
        ),
        (
            "token_pos",
            arr(arrow_array::UInt32Array::from_iter(
                evs.iter().map(|e| e.token_pos),
            )),
        ),
        (
            "src_pool",
            arr(arrow_array::UInt16Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.pool)),
            )),
        ),
        (
            "src_slot_start",
            arr(arrow_array::UInt32Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.slot_start)),
            )),
        ),
        (
            "src_seq",
            arr(arrow_array::UInt64Array::from_iter(
                evs.iter().map(|e| e.src.map(|s| s.seq)),
            )),
        ),
    ]
}
