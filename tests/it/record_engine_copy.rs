//! Engine copies inside one process (`copy` lines): an offload from a
//! device pool into the engine's `cache` pool and a load back, stamped by
//! the hook with the source pool's position on its connection. Driven over
//! the real wire: a clean offload, eviction and load back reports nothing;
//! a host slot reused under a stale key is found with its true source; a
//! position inside a hole carries the hole's uncertainty; and every copy
//! whose source cannot be known is a hole (`copies_unresolved`), never a
//! guess.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use kvtrail::record::{Listen, NoLog, RecordConfig, RecordSummary, Sidecar};
use kvtrail::scope::{Confidence, ScopeReport, Tenant};
use kvtrail::trace::manifest::Deployment;

use crate::support::record::{Hook, connect_to, events};

/// Pool 0 (device, mixed) and 1 (its host `cache`), page size 4, 64 slots;
/// pool 2 (mixed, page size 2); pool 3 (mixed, page size 4).
fn deployment() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "mixed", "capacity_tokens": 64, "page_size": 4},
            {"id": 1, "role": "cache", "capacity_tokens": 64, "page_size": 4},
            {"id": 2, "role": "mixed", "capacity_tokens": 64, "page_size": 2},
            {"id": 3, "role": "mixed", "capacity_tokens": 64, "page_size": 4}
        ]
    }))
    .unwrap()
}

struct Rig {
    dir: tempfile::TempDir,
    sidecar: Sidecar,
}

fn start() -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let cfg = RecordConfig::new(Listen::Unix(dir.path().join("s.sock")));
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
    fn stop(
        self,
    ) -> (
        RecordSummary,
        ScopeReport,
        kvtrail::trace::Trace,
        tempfile::TempDir,
    ) {
        let sum = self.sidecar.shutdown().unwrap();
        let out = self.dir.path().join("trace");
        let r = scope(&out);
        let t = kvtrail::trace::Trace::open(&out).unwrap();
        (sum, r, t, self.dir)
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

fn copy(pool: u16, ts: i64, src: u16, src_pos: u64, runs: &[[u32; 3]]) -> String {
    serde_json::json!({"type": "copy", "pool": pool, "ts_ns": ts, "request_id": 0,
        "src_pool": src, "src_pos": src_pos, "runs": runs})
    .to_string()
}

fn req(rid: u64, tenant: &str) -> String {
    serde_json::json!({"type": "request", "request_id": rid, "external_id": format!("x{rid}"),
        "tenant": tenant, "arrival_ns": 1, "finish_ns": 2, "prompt_tokens": 8,
        "prefilled_tokens": 8, "output_tokens": 1, "http_status": 200, "finish_reason": "stop",
        "prefill_pool": 0, "decode_pool": 0})
    .to_string()
}

fn send_all(c: &mut Hook, lines: &[String]) {
    for l in lines {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
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

/// HiCache's life of a prefix, as the hook reports it on one connection
/// (device pool 0, cache pool 1). Positions (the hook's count of a pool's
/// events on the connection) are in the comments. Request 1 (acme) writes
/// device slots 0..8, which are offloaded into host slots 0..8 and evicted
/// from the device; request 2 (globex) reuses device slots 0..8. With
/// `stale`, request 2's KV is offloaded into the same host slots while the
/// tree still names them as request 1's prefix (the host slot reused
/// without dropping its key), so the hook grants no share on the load.
/// Request 3 (acme) then hits the prefix: the host slots are loaded back
/// into device slots 16..24 and read.
fn hicache_history(stale: bool) -> Vec<String> {
    let mut v = vec![
        kv(0, 100, 1, "alloc", 0, 8, None),    // p0 = 1
        kv(0, 110, 1, "write", 0, 8, Some(0)), // p0 = 2
        kv(0, 120, 1, "read", 0, 8, Some(0)),  // p0 = 3
        kv(1, 130, 0, "alloc", 0, 8, None),    // p1 = 1
        copy(1, 131, 0, 3, &[[0, 0, 8]]),      // p1 = 2: offload of request 1's KV
        kv(0, 140, 0, "free", 0, 8, None),     // p0 = 4: device eviction
        kv(0, 150, 2, "alloc", 0, 8, None),    // p0 = 5
        kv(0, 160, 2, "write", 0, 8, Some(0)), // p0 = 6
        kv(0, 170, 2, "read", 0, 8, Some(0)),  // p0 = 7
    ];
    let mut p1 = 2;
    if stale {
        // Request 2's KV offloaded into host slots 0..8 (no host free).
        v.push(kv(1, 175, 0, "alloc", 0, 8, None)); // p1 = 3
        v.push(copy(1, 176, 0, 7, &[[0, 0, 8]])); // p1 = 4
        p1 = 4;
    }
    v.extend([
        kv(0, 180, 2, "free", 0, 8, None),   // p0 = 8
        kv(0, 190, 0, "alloc", 16, 8, None), // p0 = 9: the load's device slots
        copy(0, 191, 1, p1, &[[16, 0, 8]]),  // p0 = 10: the load back
    ]);
    if !stale {
        v.push(kv(0, 200, 3, "share", 16, 8, Some(0)));
    }
    v.extend([
        kv(0, 210, 3, "read", 16, 8, Some(0)),
        req(1, "acme"),
        req(2, "globex"),
        req(3, "acme"),
    ]);
    v
}

#[test]
fn clean_offload_eviction_and_load_back_report_nothing() {
    let rig = start();
    let mut c = rig.connect(&[0, 1]);
    send_all(&mut c, &hicache_history(false));
    drop(c);
    let (sum, r, t, _dir) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    assert_eq!(sum.stats.copies_unresolved, 0);
    assert!(
        r.affected_responses.is_empty(),
        "{:?}",
        r.affected_responses
    );
    // The copies carry the positions' seqs: the offload reads device seq 2
    // (request 1's read, after its write), the load host seq 1 (the
    // offload's write).
    let ev = events(&t);
    let host_write = ev[&1].iter().find(|e| e.src.is_some()).unwrap();
    assert_eq!(host_write.src.unwrap().pool, 0);
    assert_eq!(host_write.src.unwrap().seq, 2);
    let load = ev[&0].iter().find(|e| e.src.is_some()).unwrap();
    assert_eq!((load.src.unwrap().pool, load.src.unwrap().seq), (1, 1));
    assert_eq!((load.slot_start, load.slot_count), (16, 8));
}

#[test]
fn stale_host_slot_is_found_with_its_true_source() {
    let rig = start();
    let mut c = rig.connect(&[0, 1]);
    send_all(&mut c, &hicache_history(true));
    drop(c);
    let (sum, r, _t, _dir) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    assert_eq!(r.affected_responses.len(), 1, "{:?}", r.affected_responses);
    let a = &r.affected_responses[0];
    assert_eq!(a.request_id, 3);
    assert_eq!(a.confidence, Confidence::Confirmed);
    assert_eq!(a.foreign_tokens, 8);
    assert_eq!(source_tenants(a), vec!["globex".to_string()]);
}

/// A copy inside one pool (a copy-on-write block copy, `src_pool` equal
/// to `pool`), stamped by the pool's own position: slots 0..8 of 1's KV
/// copied into 8..16 (where 2's KV was) for 3, as they were before 1
/// rewrote them, and granted to 3: a shared read, nothing affected. A
/// second copy, of 2's slots 16..24 into 24..32, read by 3 without a
/// grant: found, confirmed, with 2 as the source.
#[test]
fn copy_inside_one_pool_is_stamped_by_its_own_position() {
    let rig = start();
    let mut c = rig.connect(&[0]);
    send_all(
        &mut c,
        &[
            kv(0, 100, 1, "alloc", 0, 8, None),     // p0 = 1
            kv(0, 110, 1, "write", 0, 8, Some(0)),  // p0 = 2
            kv(0, 111, 2, "alloc", 8, 16, None),    // p0 = 3
            kv(0, 112, 2, "write", 8, 16, Some(0)), // p0 = 4
            kv(0, 113, 2, "free", 8, 8, None),      // p0 = 5
            kv(0, 120, 3, "alloc", 8, 8, None),     // p0 = 6
            copy(0, 121, 0, 2, &[[8, 0, 8]]),       // p0 = 7 (reads seq 1)
            kv(0, 122, 3, "share", 8, 8, Some(0)),  // p0 = 8
            kv(0, 123, 1, "write", 0, 8, Some(8)),  // p0 = 9
            kv(0, 130, 3, "read", 8, 8, Some(0)),   // p0 = 10
            kv(0, 131, 3, "alloc", 24, 8, None),    // p0 = 11
            copy(0, 132, 0, 11, &[[24, 16, 8]]),    // p0 = 12 (reads seq 10)
            kv(0, 133, 3, "read", 24, 8, Some(8)),
            req(1, "acme"),
            req(2, "initech"),
            req(3, "globex"),
        ],
    );
    drop(c);
    let (sum, r, t, _dir) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    assert_eq!(sum.stats.copies_unresolved, 0, "{sum:?}");
    let ev = events(&t);
    let copies: Vec<_> = ev[&0].iter().filter(|e| e.src.is_some()).collect();
    let got: Vec<_> = copies
        .iter()
        .map(|e| {
            (
                e.seq,
                e.slot_start,
                e.src.unwrap().pool,
                e.src.unwrap().slot_start,
                e.src.unwrap().seq,
            )
        })
        .collect();
    assert_eq!(got, vec![(6, 8, 0, 0, 1), (11, 24, 0, 16, 10)]);
    assert_eq!(r.affected_responses.len(), 1, "{:?}", r.affected_responses);
    let a = &r.affected_responses[0];
    assert_eq!(a.request_id, 3);
    assert_eq!(a.confidence, Confidence::Confirmed);
    assert_eq!(a.foreign_tokens, 8);
    assert_eq!(source_tenants(a), vec!["initech".to_string()]);
}

/// A position inside a reported loss is stamped inside the hole: the load
/// carries the hole's uncertainty, exactly as a pull after a hole does.
#[test]
fn position_inside_a_hole_is_uncertain() {
    let rig = start();
    let mut c = rig.connect(&[0, 1]);
    send_all(
        &mut c,
        &[
            kv(0, 100, 1, "alloc", 0, 8, None),         // p0 = 1
            kv(0, 110, 1, "write", 0, 8, Some(0)),      // p0 = 2
            r#"{"type":"lost","pool":0,"n":2}"#.into(), // p0 = 4
            kv(1, 130, 0, "alloc", 0, 8, None),         // p1 = 1
            copy(1, 131, 0, 4, &[[0, 0, 8]]),           // p1 = 2
            kv(0, 140, 0, "alloc", 16, 8, None),        // p0 = 5
            copy(0, 141, 1, 2, &[[16, 0, 8]]),          // p0 = 6
            kv(0, 150, 3, "read", 16, 8, Some(0)),
            req(1, "acme"),
            req(3, "globex"),
        ],
    );
    drop(c);
    let (_sum, r, t, _dir) = rig.stop();
    let ev = events(&t);
    let host_write = ev[&1].iter().find(|e| e.src.is_some()).unwrap();
    // Position 4 is the hole's last seq (seq 3), never the write before it.
    assert_eq!(host_write.src.unwrap().seq, 3);
    let a = r
        .affected_responses
        .iter()
        .find(|x| x.request_id == 3)
        .expect("the read after the hole is reported");
    assert_eq!(a.confidence, Confidence::Possible);
}

/// Every copy whose source state cannot be known becomes holes in its
/// destination pool (one per run, `copies_unresolved`); malformed `copy`
/// lines are rejected and counted.
#[test]
fn unknowable_copies_are_holes_never_guesses() {
    let rig = start();
    let mut other = rig.connect(&[3]);
    send_all(&mut other, &[kv(3, 1, 9, "alloc", 0, 4, None)]);
    let mut c = rig.connect(&[0, 1, 2]);
    let before = [
        kv(0, 100, 1, "alloc", 0, 8, None), // p0 = 1
        kv(1, 101, 0, "alloc", 0, 8, None), // p1 = 1
        kv(2, 102, 1, "alloc", 0, 8, None), // p2 = 1
        // A position never reported (p0 is 1): 2 holes.
        copy(1, 110, 0, 5, &[[0, 0, 4], [4, 4, 4]]),
        // No event of the source before the copy (position 0): 1 hole.
        copy(0, 111, 1, 0, &[[8, 0, 4]]),
        // The source pool is held by another connection: 1 hole.
        copy(0, 112, 3, 1, &[[8, 0, 4]]),
        // Page sizes differ (4 vs 2): 1 hole.
        copy(0, 113, 2, 1, &[[8, 0, 4]]),
        // No such pool: 1 hole.
        copy(0, 114, 99, 1, &[[8, 0, 4]]),
        // A good copy whose second run names host slots past the pool:
        // one event and one hole (rejected_contract).
        copy(1, 115, 0, 1, &[[0, 0, 4], [4, 62, 4]]),
    ];
    send_all(&mut c, &before);
    let malformed = [
        // A copy inside one pool whose source and destination overlap.
        r#"{"type":"copy","pool":0,"ts_ns":1,"src_pool":0,"src_pos":1,"runs":[[0,2,4]]}"#,
        r#"{"type":"copy","pool":0,"ts_ns":1,"src_pool":1,"src_pos":1,"runs":[]}"#,
        r#"{"type":"copy","pool":0,"ts_ns":1,"src_pool":1,"src_pos":1,"runs":[[0,0,0]]}"#,
        r#"{"type":"copy","pool":0,"ts_ns":1,"src_pool":1,"src_pos":1,"runs":[[0,0,4]],"x":1}"#,
        r#"{"type":"copy","pool":0,"ts_ns":1,"src_pool":1,"src_pos":1,"runs":[[0,0,4,0]]}"#,
    ];
    for l in malformed {
        writeln!(c, "{l}").unwrap();
    }
    // After a line the sidecar could not read, positions cannot be
    // counted: a copy that would otherwise resolve is a hole.
    send_all(&mut c, &[copy(1, 120, 0, 1, &[[8, 0, 4]])]);
    drop(c);
    drop(other);
    let (sum, _r, t, _dir) = rig.stop();
    assert!(!sum.complete, "{sum:?}");
    assert_eq!(
        sum.stats.copies_unresolved,
        2 + 1 + 1 + 1 + 1 + 1,
        "{sum:?}"
    );
    assert_eq!(sum.stats.rejected_unattributed, 5, "{sum:?}");
    assert_eq!(sum.stats.rejected_contract, 1, "{sum:?}");
    // Only the good run was written as a copy; every other run is a hole.
    let copies: Vec<_> = t
        .kv_chunks()
        .flat_map(|c| c.unwrap().events)
        .filter(|e| e.src.is_some())
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(
        (
            copies[0].pool,
            copies[0].slot_start,
            copies[0].src.unwrap().seq
        ),
        (1, 0, 0)
    );
}

/// A copy from a pool the connection also pulled into cannot be counted
/// (the hook does not know how many events a pull becomes): a hole; the
/// other pool's positions still resolve.
#[test]
fn copies_from_a_pool_pulled_into_are_holes() {
    let rig = start();
    let mut c = rig.connect(&[0, 1]);
    send_all(
        &mut c,
        &[
            kv(0, 100, 1, "alloc", 0, 8, None),    // p0 = 1
            kv(0, 110, 1, "write", 0, 8, Some(0)), // p0 = 2
            r#"{"type":"xfer_pull","pool":1,"ts_ns":120,"request_id":1,"src_pool":0,"runs":[[0,0,8,0]],"outcome":"ok"}"#.into(),
            // Pool 1 got a pull the hook's positions do not count.
            copy(0, 130, 1, 1, &[[16, 0, 8]]),
            // Pool 0's positions are still countable.
            kv(1, 131, 0, "alloc", 8, 8, None),
            copy(1, 140, 0, 2, &[[8, 0, 8]]),
        ],
    );
    drop(c);
    let (sum, _r, t, _dir) = rig.stop();
    assert_eq!(sum.stats.copies_unresolved, 1, "{sum:?}");
    let ev = events(&t);
    let offload = ev[&1]
        .iter()
        .find(|e| e.slot_start == 8 && e.src.is_some())
        .unwrap();
    assert_eq!(offload.src.unwrap().seq, 1);
}
