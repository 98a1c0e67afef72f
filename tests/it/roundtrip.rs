//! Recorder → reader round trip on a small trace built in code.

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role, Trace};

fn deployment() -> Deployment {
    let pool = |id, role, cap| Pool {
        id,
        name: format!("p{id}"),
        role,
        capacity_tokens: cap,
        page_size: 4,
        extra: Default::default(),
    };
    Deployment {
        name: "test".into(),
        engine: "test".into(),
        context_window: 1024,
        pools: vec![pool(0, Role::Prefill, 64), pool(1, Role::Decode, 128)],
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

fn ev(pool: u16, rid: u64, op: Op, start: u32, count: u32) -> KvEvent {
    KvEvent {
        pool,
        seq: 0,
        ts_ns: 1000 + rid as i64,
        request_id: rid,
        op,
        slot_start: start,
        slot_count: count,
        token_pos: Some(0),
        src: None,
    }
}

#[test]
fn recorder_round_trip_is_identical() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t");
    let opts = RecorderOptions {
        row_group_rows: 3,
        started_ns: Some(0),
        part: kvtrail::trace::write::PartOptions {
            rotate_bytes: 1,
            zstd_level: 1,
        },
        ..Default::default()
    };
    let mut rec = Recorder::create(&t, deployment(), opts).unwrap();
    let mut written = Vec::new();
    for i in 0..10u64 {
        let mut e = ev((i % 2) as u16, i + 1, Op::Write, 4, 4);
        if e.pool == 1 {
            e.src = Some(CopySrc {
                pool: 0,
                slot_start: 4,
                seq: 0,
            });
        }
        e.seq = rec.kv(e).unwrap();
        written.push(e);
    }
    let reqs: Vec<RequestRecord> = (1..=4)
        .map(|i| RequestRecord {
            request_id: i,
            tenant: format!("t{i}"),
            external_id: Some(format!("ext-{i}")),
            http_status: 200,
            prompt_hash: Some([i as u8; 32]),
            ..Default::default()
        })
        .collect();
    for r in &reqs {
        rec.request(r.clone()).unwrap();
    }
    let m = rec.close().unwrap();
    assert!(m.capture.complete);
    assert!(
        m.files.as_ref().unwrap().len() >= 4,
        "rotation produced several parts"
    );

    let trace = Trace::open(&t).unwrap();
    let mut got: Vec<KvEvent> = trace.kv_chunks().flat_map(|c| c.unwrap().events).collect();
    got.sort_by_key(|e| (e.pool, e.seq));
    written.sort_by_key(|e| (e.pool, e.seq));
    assert_eq!(got, written);
    let got_reqs: Vec<RequestRecord> = trace.requests().flat_map(|b| b.unwrap()).collect();
    assert_eq!(got_reqs, reqs);
    let report = kvtrail::trace::verify::verify(&t).unwrap();
    assert!(report.ok, "{:?}", report.problems);
}
