//! The sidecar's answer must not depend on timing: pulls are stamped
//! against the source pool's whole history up to the load (every committed
//! copy, every hole) once the source's connection has marked past the
//! load's time; a connection that ends without `bye` leaves the capture
//! incomplete; two requests under one id leave it unattributed; a capture
//! with no KV event is no evidence. Issue 32's defects 1, 2 and 7 and the
//! P/D timing defect, each driven over the real wire.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvtrail::record::{Listen, NoLog, RecordConfig, RecordSummary, Sidecar};
use kvtrail::scope::{Confidence, ScopeReport, Tenant};
use kvtrail::trace::manifest::Deployment;
use proptest::prelude::*;

use crate::support::record::{Hook, connect_to};

/// Pools 0 (prefill), 1 (decode), 2 (cache): page size 4, 64 slots each.
fn deployment() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": 64, "page_size": 4},
            {"id": 1, "role": "decode", "capacity_tokens": 64, "page_size": 4},
            {"id": 2, "role": "cache", "capacity_tokens": 64, "page_size": 4}
        ]
    }))
    .unwrap()
}

struct Rig {
    dir: tempfile::TempDir,
    sidecar: Sidecar,
}

fn start(copy_timeout: Duration) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecordConfig::new(Listen::Unix(dir.path().join("s.sock")));
    cfg.copy_timeout = copy_timeout;
    let sidecar = Sidecar::start(
        cfg,
        deployment(),
        &dir.path().join("trace"),
        Arc::new(NoLog),
    )
    .unwrap();
    Rig { dir, sidecar }
}

impl Rig {
    fn connect(&self, pools: &[u16]) -> Hook {
        connect_to(&self.dir.path().join("s.sock"), pools)
    }
    fn stop(self) -> (RecordSummary, ScopeReport, tempfile::TempDir) {
        let sum = self.sidecar.shutdown().unwrap();
        let out = self.dir.path().join("trace");
        let r = scope(&out);
        (sum, r, self.dir)
    }
}

fn scope(out: &Path) -> ScopeReport {
    let trace = kvtrail::trace::Trace::open(out).unwrap();
    kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &kvtrail::progress::NoReporter,
    )
    .unwrap()
}

fn kv(pool: u16, ts: i64, rid: u64, op: &str, start: u32, count: u32, tpos: Option<u32>) -> String {
    serde_json::json!({"type": "kv", "pool": pool, "ts_ns": ts, "request_id": rid, "op": op,
        "slot_start": start, "slot_count": count, "token_pos": tpos})
    .to_string()
}

fn req(rid: u64, tenant: &str, pre: Option<u16>, dec: Option<u16>) -> String {
    serde_json::json!({"type": "request", "request_id": rid, "external_id": format!("x{rid}"),
        "tenant": tenant, "arrival_ns": 1, "finish_ns": 2, "prompt_tokens": 8,
        "prefilled_tokens": 8, "output_tokens": 1, "http_status": 200, "finish_reason": "stop",
        "prefill_pool": pre, "decode_pool": dec})
    .to_string()
}

fn pull(pool: u16, ts: i64, rid: u64, src: u16, runs: &[[u32; 4]]) -> String {
    serde_json::json!({"type": "xfer_pull", "pool": pool, "ts_ns": ts, "request_id": rid,
        "src_pool": src, "runs": runs, "outcome": "ok"})
    .to_string()
}

fn mark(ts: i64) -> String {
    format!(r#"{{"type":"mark","ts_ns":{ts}}}"#)
}

fn send_all(c: &mut Hook, lines: &[String]) {
    for l in lines {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
}

/// The trace reads back whole: verify finds nothing but the incomplete
/// capture, and scope runs (a duplicate request id would stop both).
fn assert_reads_back(out: &Path) {
    let v = kvtrail::trace::verify::verify(out).unwrap();
    assert!(
        v.problems
            .iter()
            .all(|p| !format!("{p:?}").contains("request_id")),
        "{:?}",
        v.problems
    );
    scope(out);
}

/// The one affected response, by request id.
fn affected(r: &ScopeReport, rid: u64) -> Option<&kvtrail::scope::Response> {
    r.affected_responses.iter().find(|x| x.request_id == rid)
}

fn source_tenants(resp: &kvtrail::scope::Response) -> Vec<String> {
    resp.sources
        .iter()
        .map(|s| match &s.tenant {
            Tenant::Customer(t) => t.clone(),
            other => format!("{other:?}"),
        })
        .collect()
}

/// Defect 1: a committed copy is part of the decode pool's history, so
/// an offload after it, and the load back, carry the copied content.
#[test]
fn defect1_pull_after_committed_copy_carries_the_copy() {
    let rig = start(Duration::from_secs(10));
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1, 2]);
    // Decode slots 0..8 hold request 3's (acme) own KV.
    send_all(
        &mut d,
        &[
            kv(1, 100, 3, "alloc", 0, 8, None),
            kv(1, 110, 3, "write", 0, 8, Some(0)),
        ],
    );
    // Request 2 (globex) prefills, and a send/commit transfer puts its KV
    // into decode slots 0..8 at ts 160.
    send_all(
        &mut p,
        &[
            kv(0, 120, 2, "alloc", 0, 8, None),
            kv(0, 130, 2, "write", 0, 8, Some(0)),
            r#"{"type":"xfer_send","room":9,"pool":0,"ts_ns":150,"dst_index":0,"src_pages":[[0,2]],"last":true}"#.into(),
            mark(10_000),
        ],
    );
    drop(p);
    send_all(
        &mut d,
        &[
            r#"{"type":"xfer_commit","room":9,"pool":1,"ts_ns":160,"request_id":2,"prefix_len":0,"dst_pages":[[0,2]]}"#.into(),
            // The engine offloads slots 0..8 to the cache pool, then loads
            // them back into slots 16..24 for request 3, which reads them.
            pull(2, 300, 3, 1, &[[0, 0, 8, 0]]),
            kv(1, 390, 3, "alloc", 16, 8, None),
            pull(1, 400, 3, 2, &[[16, 0, 8, 0]]),
            kv(1, 410, 3, "read", 16, 8, Some(0)),
            req(2, "globex", Some(0), Some(1)),
            req(3, "acme", Some(0), Some(1)),
        ],
    );
    drop(d);
    let (sum, r, _dir) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    let a = affected(&r, 3).expect("request 3 read globex's KV");
    assert_eq!(a.confidence, Confidence::Confirmed);
    assert_eq!(a.foreign_tokens, 8);
    assert_eq!(source_tenants(a), vec!["globex".to_string()]);
}

/// The history of defect 2: request 3 (initech) prefilled producer slots
/// 0..8, then events of the producer were lost (maybe the reuse of those
/// slots by another request), then the consumer loads the slots for
/// request 3, which reads them.
fn lost_history(rig: &Rig, via_pull: bool) {
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    let mut prod = vec![
        kv(0, 100, 3, "alloc", 0, 8, None),
        kv(0, 110, 3, "write", 0, 8, Some(0)),
        r#"{"type":"lost","pool":0,"n":3}"#.to_string(),
    ];
    if !via_pull {
        prod.push(r#"{"type":"xfer_send","room":5,"pool":0,"ts_ns":200,"dst_index":0,"src_pages":[[0,2]],"last":true}"#.into());
    }
    prod.push(mark(10_000));
    send_all(&mut p, &prod);
    let mut cons = vec![kv(1, 190, 3, "alloc", 0, 8, None)];
    if via_pull {
        cons.push(pull(1, 200, 3, 0, &[[0, 0, 8, 0]]));
    } else {
        cons.push(r#"{"type":"xfer_commit","room":5,"pool":1,"ts_ns":200,"request_id":3,"prefix_len":0,"dst_pages":[[0,2]]}"#.into());
    }
    cons.extend([
        kv(1, 210, 3, "read", 0, 8, Some(0)),
        req(1, "acme", Some(0), Some(1)),
        req(3, "initech", Some(0), Some(1)),
    ]);
    send_all(&mut d, &cons);
}

/// Defect 2: a pull after a known hole in its source is stamped inside the
/// hole (uncertain), exactly as the send/commit path is.
#[test]
fn defect2_pull_after_a_hole_is_uncertain_like_send_commit() {
    let mut answers = Vec::new();
    for via_pull in [true, false] {
        let rig = start(Duration::from_secs(10));
        lost_history(&rig, via_pull);
        let (_, r, _dir) = rig.stop();
        let a = affected(&r, 3).unwrap_or_else(|| {
            panic!(
                "via_pull={via_pull}: the read after the hole must be reported: {:?}",
                r.affected_responses
            )
        });
        assert_eq!(a.confidence, Confidence::Possible, "via_pull={via_pull}");
        answers.push((
            a.confidence,
            a.reasons.clone(),
            a.uncertain_tokens,
            a.foreign_tokens,
        ));
    }
    assert_eq!(answers[0], answers[1], "pull and send/commit must agree");
}

/// The P/D stale reference over the wire: request 1 (acme) wrote producer
/// slots 0..8, request 2 (globex) reused them, then the consumer's request
/// 3 (initech) pulled them. `order` decides which connection's lines reach
/// the sidecar first, and how they interleave.
fn stale_reference(order: u8, producer_marks: bool) -> (RecordSummary, ScopeReport) {
    let rig = start(Duration::from_secs(2));
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    if producer_marks {
        // A hook marks as soon as it is connected and idle.
        send_all(&mut p, &[mark(0)]);
    }
    let mut prod = vec![
        kv(0, 100, 1, "alloc", 0, 8, None),
        kv(0, 110, 1, "write", 0, 8, Some(0)),
        kv(0, 200, 1, "free", 0, 8, None),
        kv(0, 210, 2, "alloc", 0, 8, None),
        kv(0, 220, 2, "write", 0, 8, Some(0)),
    ];
    if producer_marks {
        prod.push(mark(1_000));
    }
    let cons = vec![
        kv(1, 290, 3, "alloc", 0, 8, None),
        pull(1, 300, 3, 0, &[[0, 0, 8, 0]]),
        kv(1, 310, 3, "read", 0, 8, Some(0)),
        req(1, "acme", Some(0), Some(1)),
        req(2, "globex", Some(0), Some(1)),
        req(3, "initech", Some(0), Some(1)),
    ];
    match order % 3 {
        // The consumer's whole stream first, the producer's afterwards.
        0 => {
            send_all(&mut d, &cons);
            std::thread::sleep(Duration::from_millis(50 + 10 * order as u64));
            send_all(&mut p, &prod);
        }
        // The producer's first event, then the consumer, then the rest.
        1 => {
            send_all(&mut p, &prod[..2]);
            std::thread::sleep(Duration::from_millis(20));
            send_all(&mut d, &cons);
            std::thread::sleep(Duration::from_millis(20));
            send_all(&mut p, &prod[2..]);
        }
        // Both at once from two threads.
        _ => {
            let h = std::thread::spawn(move || {
                send_all(&mut d, &cons);
                d
            });
            send_all(&mut p, &prod);
            drop(h.join().unwrap());
            d = rig.connect(&[1]);
        }
    }
    if producer_marks {
        drop(p);
    } else {
        // The producer dies with its events sent but no mark and no bye.
        p.crash();
    }
    drop(d);
    let (sum, r, _dir) = rig.stop();
    (sum, r)
}

/// Whatever the arrival order, the pull is stamped with globex's reuse:
/// the same confirmed answer every time, never acme.
#[test]
fn pd_pull_answer_does_not_depend_on_arrival_order() {
    for order in 0..9u8 {
        let (sum, r) = stale_reference(order, true);
        assert!(sum.complete, "order {order}: {sum:?}");
        let a = affected(&r, 3).unwrap_or_else(|| panic!("order {order}: not affected"));
        assert_eq!(a.confidence, Confidence::Confirmed, "order {order}");
        assert_eq!(a.foreign_tokens, 8, "order {order}");
        assert_eq!(
            source_tenants(a),
            vec!["globex".to_string()],
            "order {order}"
        );
    }
}

/// A producer that never marks and dies without `bye`: the sidecar cannot
/// know whether its later events were lost, so the pull is a hole (never
/// a guess that becomes "confirmed from acme") and the capture incomplete.
#[test]
fn pd_pull_from_a_producer_that_cannot_say_is_never_a_guess() {
    for order in [0u8, 1] {
        let (sum, r) = stale_reference(order, false);
        assert!(!sum.complete, "order {order}");
        assert_eq!(sum.stats.connections_unclosed, 1, "{sum:?}");
        if let Some(a) = affected(&r, 3) {
            assert!(
                !(a.confidence == Confidence::Confirmed
                    && source_tenants(a).contains(&"acme".to_string())),
                "order {order}: a guess: {a:?}"
            );
        }
        assert!(!r.coverage.complete, "order {order}");
    }
}

/// A connection that ends without `bye` (an engine that exited with its
/// queue unsent), or whose counts do not add up, leaves the capture
/// incomplete; a clean `bye` keeps it complete.
#[test]
fn hook_exit_without_bye_is_incomplete() {
    for case in ["bye", "none", "unaccounted"] {
        let rig = start(Duration::from_secs(10));
        let mut c = rig.connect(&[0]);
        send_all(&mut c, &[kv(0, 1, 1, "write", 0, 4, Some(0))]);
        match case {
            "bye" => drop(c),
            "none" => c.crash(),
            _ => {
                send_all(
                    &mut c,
                    &[r#"{"type":"bye","enqueued":9,"sent":1,"dropped":0}"#.into()],
                );
                c.crash();
            }
        }
        let sum = rig.sidecar.shutdown().unwrap();
        assert_eq!(sum.complete, case == "bye", "{case}: {sum:?}");
        match case {
            "none" => assert_eq!(sum.stats.connections_unclosed, 1),
            "unaccounted" => assert_eq!(sum.stats.events_unaccounted, 8),
            _ => {}
        }
    }
}

/// A line after `bye` is rejected and the capture incomplete.
#[test]
fn a_line_after_bye_is_rejected() {
    let rig = start(Duration::from_secs(10));
    let mut c = rig.connect(&[0]);
    send_all(
        &mut c,
        &[
            r#"{"type":"bye","enqueued":0,"sent":0,"dropped":0}"#.into(),
            kv(0, 1, 1, "write", 0, 4, Some(0)),
        ],
    );
    c.crash();
    let sum = rig.sidecar.shutdown().unwrap();
    assert!(!sum.complete);
    assert!(sum.stats.rejected_unattributed >= 1, "{sum:?}");
}

/// Defect 7: two requests under one id (two prefill and two decode views
/// that disagree): the trace stays valid, the id is unattributed, the
/// conflict named, the capture incomplete.
#[test]
fn defect7_conflicting_views_leave_the_request_unattributed() {
    let rig = start(Duration::from_secs(10));
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    send_all(
        &mut p,
        &[
            kv(0, 1, 7, "write", 0, 4, Some(0)),
            req(7, "acme", Some(0), None),
            req(7, "globex", Some(0), None),
            req(8, "initech", Some(0), None),
        ],
    );
    drop(p);
    send_all(
        &mut d,
        &[
            kv(1, 1, 8, "write", 0, 4, Some(0)),
            req(7, "acme", None, Some(1)),
            req(7, "globex", None, Some(1)),
            req(8, "initech", None, Some(1)),
        ],
    );
    drop(d);
    let sum = rig.sidecar.shutdown().unwrap();
    assert!(!sum.complete);
    assert_eq!(sum.stats.request_conflicts, 1, "{sum:?}");
    let out = rig.dir.path().join("trace");
    assert_reads_back(&out);
    let trace = kvtrail::trace::Trace::open(&out).unwrap();
    let m = &trace.manifest;
    assert_eq!(
        m.capture.extra["request_conflicts"]["request_ids"],
        serde_json::json!([7])
    );
    let r = scope(&out);
    // Request 8 is attributed, 7 is not.
    let keys = kvtrail::trace::request_keys::scan_requests(&trace, |_| {}).unwrap();
    assert!(keys.contains(8) && !keys.contains(7));
    assert!(!r.coverage.complete);
}

/// Two full rows (a mixed connection) under one id are the same conflict.
#[test]
fn defect7_second_full_row_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let dep: Deployment = serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 64,
        "pools": [{"id": 0, "role": "mixed", "capacity_tokens": 64, "page_size": 1}]
    }))
    .unwrap();
    let sc = Sidecar::start(
        RecordConfig::new(Listen::Unix(sock.clone())),
        dep,
        &dir.path().join("trace"),
        Arc::new(NoLog),
    )
    .unwrap();
    let mut c = connect_to(&sock, &[0]);
    send_all(
        &mut c,
        &[
            kv(0, 1, 7, "write", 0, 4, Some(0)),
            req(7, "acme", Some(0), Some(0)),
            req(7, "acme", Some(0), Some(0)),
        ],
    );
    drop(c);
    let sum = sc.shutdown().unwrap();
    assert_eq!(sum.stats.request_conflicts, 1);
    assert!(!sum.complete);
    assert_reads_back(&dir.path().join("trace"));
}

/// Defect 13's sidecar side: no connection, or connections that sent no
/// KV event, is no evidence, never a clean capture.
#[test]
fn defect13_record_with_no_events_is_not_complete() {
    for connect in [false, true] {
        let rig = start(Duration::from_secs(10));
        if connect {
            let c = rig.connect(&[0]);
            drop(c);
        }
        let sum = rig.sidecar.shutdown().unwrap();
        assert!(!sum.complete, "connect={connect}");
        let t = kvtrail::trace::Trace::open(&rig.dir.path().join("trace")).unwrap();
        assert_eq!(t.manifest.capture.extra["no_kv_events"], true);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 6,
        failure_persistence: crate::support::regressions_beside_source(),
        ..ProptestConfig::default()
    })]
    /// Random split points and delays for the stale reference: always the
    /// one true answer.
    #[test]
    fn pd_random_interleavings_agree(order in 0u8..30) {
        let (sum, r) = stale_reference(order, true);
        prop_assert!(sum.complete);
        let a = affected(&r, 3).expect("affected");
        prop_assert_eq!(source_tenants(a), vec!["globex".to_string()]);
        prop_assert_eq!(a.confidence, Confidence::Confirmed);
    }
}
