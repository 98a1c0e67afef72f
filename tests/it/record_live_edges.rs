//! Live detection at the edges of a capture (docs/live.md, "The same
//! answer as scope"): streamed through the sidecar with live detection on,
//! each case's live findings (live-findings.json) are compared with a
//! fresh scope of the trace just written, the comparison `kvtrail verify`
//! makes. The cases: a `lost` line in the middle of a pool's stream (reads
//! after it uncertain, live as in scope); an engine that disconnects in
//! the middle of a request without its `bye`, and a later connection on
//! the same pool reading what it left; a read by a request the sidecar
//! never saw a request row for. Each has at least one affected response.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtrail::record::live::{LIVE_FINDINGS, LiveFindings, LiveOptions};
use kvtrail::record::{RecordSummary, WhenBehind};
use kvtrail::scope::{Confidence, Response, Tenant};

use crate::support::record::{Rig, assert_live_equals_scope, kv, live_vs_scope, start};

fn rig() -> Rig {
    start(|cfg| {
        cfg.recorder.from_engine_start = true;
        // Nothing dropped between the writer and the live thread on a
        // loaded machine: the comparison is over the whole stream.
        cfg.when_behind = WhenBehind::Wait;
        let mut o = LiveOptions::default();
        o.bounds.holdback = Duration::from_millis(300);
        cfg.live = Some(o);
    })
}

fn request(rid: u64, tenant: &str) -> String {
    format!(
        r#"{{"type":"request","request_id":{rid},"external_id":"x-{rid}","tenant":"{tenant}","arrival_ns":{rid},"prompt_tokens":4,"output_tokens":1,"http_status":200}}"#
    )
}

fn findings(out: &Path) -> LiveFindings {
    serde_json::from_slice(&std::fs::read(out.join(LIVE_FINDINGS)).unwrap()).unwrap()
}

/// Stops the rig; compares live with scope; returns the live findings'
/// affected responses and the summary.
fn stop_and_compare(rig: Rig) -> (Vec<Response>, RecordSummary, PathBuf, tempfile::TempDir) {
    let (sum, _t, d, out) = rig.stop();
    assert_live_equals_scope(&out);
    let f = findings(&out);
    assert!(f.exact, "{:?}", f.live);
    (f.affected_responses, sum, out, d)
}

fn find(rs: &[Response], rid: u64) -> &Response {
    rs.iter()
        .find(|r| r.request_id == rid)
        .unwrap_or_else(|| panic!("request {rid} not affected: {rs:?}"))
}

/// A `lost` line mid-stream: request 8's read of what 7 wrote before the
/// hole is foreign but uncertain (the lost events may have changed the
/// slots); live says what scope says, a possible finding, not a confirmed
/// one and not none. A read entirely before the hole stays confirmed.
#[test]
fn a_lost_line_mid_stream_makes_later_reads_uncertain_as_in_scope() {
    let rig = rig();
    let mut c = rig.connect(&[2]);
    for l in [
        request(7, "acme"),
        request(8, "globex"),
        request(9, "initech"),
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        // 9 reads 7's KV before the hole: confirmed.
        kv(2, 9, "read", 0, 2),
        r#"{"type":"lost","pool":2,"n":3}"#.to_string(),
        kv(2, 8, "read", 0, 4),
        kv(2, 7, "free", 0, 4),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    drop(c);
    let (rs, sum, _out, _d) = stop_and_compare(rig);
    assert_eq!(sum.stats.lost_hook, 3, "{:?}", sum.stats);
    assert_eq!(sum.live.as_ref().unwrap().seq_holes, 1);
    let r8 = find(&rs, 8);
    assert_eq!(r8.confidence, Confidence::Possible, "{r8:?}");
    let r9 = find(&rs, 9);
    assert_eq!(r9.confidence, Confidence::Confirmed, "{r9:?}");
    assert_eq!(r9.foreign_tokens, 2, "{r9:?}");
}

/// The engine holding pool 2 disconnects in the middle of request 8 (its
/// read done, its free never sent) without a `bye`: the capture is
/// incomplete, and the next engine to claim the pool goes on from there.
/// Request 10 on the new connection reads slots 8 left: foreign, source 8.
/// Live and scope agree on 8 and 10.
#[test]
fn an_engine_gone_without_bye_mid_request_gives_scope_s_answer() {
    let rig = rig();
    let mut c = rig.connect(&[2]);
    for l in [
        request(7, "acme"),
        request(8, "globex"),
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 7, "free", 0, 4),
        kv(2, 8, "alloc", 0, 8),
        kv(2, 8, "read", 0, 4),
        kv(2, 8, "write", 4, 4),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    c.crash();
    // The claim is released once the writer has the end: retry until the
    // pool can be claimed again.
    let t = std::time::Instant::now();
    let mut c2 = loop {
        let s = std::os::unix::net::UnixStream::connect(&rig.sock).unwrap();
        let mut w = std::io::BufWriter::new(&s);
        writeln!(w, r#"{{"type":"hello","pools":[2],"worker":"again"}}"#).unwrap();
        drop(w);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&s), &mut line).unwrap();
        if line.contains("welcome") {
            break crate::support::record::Hook::new(s);
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{line}");
        std::thread::sleep(Duration::from_millis(50));
    };
    for l in [
        request(10, "initech"),
        kv(2, 10, "alloc", 4, 4),
        kv(2, 10, "read", 4, 4),
        kv(2, 10, "free", 4, 4),
    ] {
        writeln!(c2, "{l}").unwrap();
    }
    drop(c2);
    let (rs, sum, _out, _d) = stop_and_compare(rig);
    assert_eq!(sum.stats.connections_unclosed, 1, "{:?}", sum.stats);
    assert!(!sum.complete);
    let r8 = find(&rs, 8);
    assert_eq!(r8.sources[0].request_id, 7, "{r8:?}");
    assert!(r8.cross_tenant, "{r8:?}");
    let r10 = find(&rs, 10);
    assert_eq!(r10.sources[0].request_id, 8, "{r10:?}");
    assert_eq!(r10.foreign_tokens, 4, "{r10:?}");
}

/// Request 99 reads request 7's KV, and no request row of 99 ever comes:
/// both sides report it, unattributed (not in the requests table, its
/// tenant unknown, so the crossing cannot be ruled out).
#[test]
fn a_read_by_a_request_never_seen_gives_scope_s_answer() {
    let rig = rig();
    let mut c = rig.connect(&[2]);
    for l in [
        request(7, "acme"),
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 7, "free", 0, 4),
        kv(2, 99, "alloc", 0, 4),
        kv(2, 99, "read", 0, 4),
        kv(2, 99, "free", 0, 4),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    drop(c);
    let (rs, sum, out, _d) = stop_and_compare(rig);
    // A complete capture: `kvtrail verify` itself compares and says so.
    assert!(sum.complete, "{:?}", sum.stats);
    let (_, said) = live_vs_scope(&out);
    assert!(
        said.contains("live findings equal a fresh scope: 1 affected responses"),
        "{said}"
    );
    let r = find(&rs, 99);
    assert!(!r.in_requests_table, "{r:?}");
    assert_eq!(r.tenant, Tenant::Unknown, "{r:?}");
    assert_eq!(r.sources[0].request_id, 7, "{r:?}");
    assert_eq!(r.foreign_tokens, 4, "{r:?}");
}
