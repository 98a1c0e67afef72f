//! Live detection in `record` (docs/live.md): simulated
//! scenarios streamed through the real sidecar, one connection per pool
//! sending at once, with live detection on; the live findings written at
//! close (live-findings.json) must equal `scope` on the trace just
//! written: affected responses (tokens, sources, confidence) and
//! cross-tenant prefix hits. Then the bounds: a copy whose source moved
//! on before it arrived is counted and taken uncertain, never guessed;
//! alerts appear while the engine is still connected; the metrics answer
//! a plain TCP client; a taken metrics port is refused, naming it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrail::progress::NoReporter;
use kvtrail::record::live::{AlertTarget, Bounds, LIVE_FINDINGS, LiveFindings, LiveOptions};
use kvtrail::record::{Listen, NoLog, RecordConfig, Sidecar, WhenBehind};
use kvtrail::schema::KvEvent;
use kvtrail::scope::{Confidence, Response, ScopeReport, SharedHit};
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Deployment;

use crate::support::record::{connect_to, kv, kv_line, request_line};
use crate::support::sim;

fn live_cfg(sock: &std::path::Path, tune: impl FnOnce(&mut LiveOptions)) -> RecordConfig {
    let mut cfg = RecordConfig::new(Listen::Unix(sock.to_path_buf()));
    let mut o = LiveOptions::default();
    tune(&mut o);
    cfg.live = Some(o);
    cfg
}

/// What both sides must agree on, per affected response.
fn responses(rs: &[Response]) -> BTreeMap<u64, String> {
    rs.iter()
        .map(|a| {
            let srcs: Vec<String> = a
                .sources
                .iter()
                .map(|s| format!("{}:{}:{:?}", s.request_id, s.tokens, s.confidence))
                .collect();
            (
                a.request_id,
                format!(
                    "foreign {} unknown {} uncertain {} exposed {} {:?} cross {} reasons {:?} sources {srcs:?}",
                    a.foreign_tokens,
                    a.unknown_tokens,
                    a.uncertain_tokens,
                    a.exposed_tokens,
                    a.confidence,
                    a.cross_tenant,
                    a.reasons
                ),
            )
        })
        .collect()
}

fn hits(hs: &[SharedHit]) -> Vec<String> {
    hs.iter()
        .map(|h| {
            let s: Vec<String> = h
                .sources
                .iter()
                .map(|s| format!("{}:{}", s.request_id, s.tokens))
                .collect();
            format!("{} {} {s:?}", h.request_id, h.tokens)
        })
        .collect()
}

pub(crate) fn read_findings(out: &std::path::Path) -> LiveFindings {
    let bytes = std::fs::read(out.join(LIVE_FINDINGS)).expect("live-findings.json written");
    serde_json::from_slice(&bytes).unwrap()
}

pub(crate) fn fresh_scope(out: &std::path::Path) -> ScopeReport {
    let t = Trace::open(out).unwrap();
    kvtrail::scope::scope(&t, &Default::default(), &NoReporter).unwrap()
}

/// Streams a simulated trace through a sidecar with live detection, one
/// connection per pool, the events in time order across the connections
/// (as engines emit them), the request rows last; returns the recorded
/// trace's folder.
pub(crate) fn stream(run: &sim::Simulated, dir: &std::path::Path) -> std::path::PathBuf {
    let t = Trace::open(&run.trace).unwrap();
    let deployment: Deployment = t.deployment().clone();
    let events = sim::events(&run.trace);
    let requests = sim::requests(&run.trace);
    let sock = dir.join("s.sock");
    let out = dir.join("rec");
    // A holdback of a second: the streams of one scenario drift apart by
    // far less, also on a loaded machine.
    let mut cfg = live_cfg(&sock, |o| o.bounds.holdback = Duration::from_secs(1));
    // The stream is as fast as the test can write: the sidecar slows it
    // through the socket instead of dropping (a loaded machine's writer
    // falls behind), so the answers compared are over the whole stream.
    // Dropping has tests of its own (unpaced_senders_never_hide_a_finding).
    cfg.when_behind = WhenBehind::Wait;
    cfg.recorder.from_engine_start = t.manifest.from_engine_start();
    let sidecar = Sidecar::start(cfg, deployment.clone(), &out, Arc::new(NoLog)).unwrap();
    let pools: Vec<u16> = deployment.pools.iter().map(|p| p.id).collect();
    let mut conns: BTreeMap<u16, _> = pools
        .iter()
        .map(|&p| (p, std::io::BufWriter::new(connect_to(&sock, &[p]))))
        .collect();
    let mut all: Vec<&KvEvent> = events.values().flatten().collect();
    all.sort_by_key(|e| (e.ts_ns, e.pool, e.seq));
    for (i, e) in all.iter().enumerate() {
        writeln!(conns.get_mut(&e.pool).unwrap(), "{}", kv_line(e)).unwrap();
        if i % 512 == 511 {
            for c in conns.values_mut() {
                c.flush().unwrap();
            }
        }
    }
    let first = conns.get_mut(&pools[0]).unwrap();
    for r in &requests {
        writeln!(first, "{}", request_line(r)).unwrap();
    }
    for (_, c) in conns {
        drop(c.into_inner().ok());
    }
    let sum = sidecar.shutdown().unwrap();
    assert!(sum.live.is_some(), "live stats in the summary");
    out
}

/// Streams scenario `name` and compares; returns how many responses
/// were affected (so that each test can show it was not vacuous).
fn same_answer(name: &str, sets: &[&str]) -> usize {
    let run = sim::simulate(name, Some(150), 7, sets);
    let dir = tempfile::tempdir().unwrap();
    let out = stream(&run, dir.path());
    let live = read_findings(&out);
    let scope = fresh_scope(&out);
    assert!(
        live.exact,
        "{name} {sets:?}: the live view missed something: {:?}",
        live.live
    );
    assert_eq!(
        responses(&live.affected_responses),
        responses(&scope.affected_responses),
        "{name} {sets:?}: affected responses"
    );
    assert_eq!(
        hits(&live.cross_tenant_shared),
        hits(&scope.cross_tenant_shared),
        "{name} {sets:?}: cross-tenant prefix hits"
    );
    assert_eq!(
        live.live.seq_holes,
        scope.coverage.gaps.len() as u64,
        "{name} {sets:?}: seq holes"
    );
    eprintln!(
        "{name} {sets:?}: {} affected, {} prefix hits, {} holes, {} events",
        scope.affected_responses.len(),
        scope.cross_tenant_shared.len(),
        live.live.seq_holes,
        live.live.events_applied
    );
    scope.affected_responses.len()
}

#[test]
fn live_findings_equal_scope_sglang_incident() {
    assert!(same_answer("incident", &[]) > 0);
}

#[test]
fn live_findings_equal_scope_sglang_siblings() {
    let n = same_answer("sibling-inflight", &[]) + same_answer("sibling-stale-copy", &[]);
    assert!(n > 0);
}

#[test]
fn live_findings_equal_scope_sglang_decode_radix_and_hicache() {
    let n = same_answer("steady", &["decode_radix_cache=true"])
        + same_answer("incident", &["decode_radix_cache=true"])
        + same_answer("incident", &["decode_radix_cache=true", "hicache=true"]);
    assert!(n > 0);
}

#[test]
fn live_findings_equal_scope_vllm() {
    let n = same_answer("vllm-steady", &[])
        + same_answer("vllm-stale-reference", &[])
        + same_answer("vllm-lease-expiry", &[])
        + same_answer("vllm-steady", &["bug_out_of_range_ppm=50000"]);
    assert!(n > 0);
    // No salt: prefix hits across tenants, listed by both sides.
    same_answer("vllm-steady", &["cache_salt=none"]);
}

// ------------------------------------------------------------------ bounds

/// Real engines do not wait for each other: every pool's connection sends
/// its whole stream at once, on a thread of its own, with no holdback, so
/// copies reach the live view before or after their source as the threads
/// race. Whatever the interleaving, no response `scope` finds affected may
/// be missing from the live findings (a copy seen late makes its slots
/// uncertain, never clean), and when nothing came late they are equal.
#[test]
fn unpaced_senders_never_hide_a_finding() {
    for name in ["incident", "vllm-stale-reference"] {
        let run = sim::simulate(name, Some(150), 7, &[]);
        let dir = tempfile::tempdir().unwrap();
        let t = Trace::open(&run.trace).unwrap();
        let deployment: Deployment = t.deployment().clone();
        let events = sim::events(&run.trace);
        let requests = sim::requests(&run.trace);
        let sock = dir.path().join("s.sock");
        let out = dir.path().join("rec");
        let mut cfg = live_cfg(&sock, |o| o.bounds.holdback = Duration::ZERO);
        cfg.recorder.from_engine_start = t.manifest.from_engine_start();
        let sidecar = Sidecar::start(cfg, deployment.clone(), &out, Arc::new(NoLog)).unwrap();
        let senders: Vec<_> = deployment
            .pools
            .iter()
            .map(|p| {
                let pool = p.id;
                let mut c = std::io::BufWriter::new(connect_to(&sock, &[pool]));
                let lines: Vec<String> = events
                    .get(&pool)
                    .into_iter()
                    .flatten()
                    .map(kv_line)
                    .collect();
                std::thread::spawn(move || {
                    for l in lines {
                        writeln!(c, "{l}").unwrap();
                    }
                    c
                })
            })
            .collect();
        let mut conns: Vec<_> = senders.into_iter().map(|h| h.join().unwrap()).collect();
        for r in &requests {
            writeln!(conns[0], "{}", request_line(r)).unwrap();
        }
        for c in conns {
            drop(c.into_inner().ok());
        }
        sidecar.shutdown().unwrap();
        let live = read_findings(&out);
        let scope = fresh_scope(&out);
        assert!(!scope.affected_responses.is_empty(), "{name}: not vacuous");
        let live_ids: std::collections::BTreeSet<u64> = live
            .affected_responses
            .iter()
            .map(|r| r.request_id)
            .collect();
        for r in &scope.affected_responses {
            assert!(
                live_ids.contains(&r.request_id),
                "{name}: scope finds request {} affected, the live view does not ({:?})",
                r.request_id,
                live.live
            );
        }
        // What the race made uncertain is only ever "possible": never a
        // confirmed finding that scope does not make.
        let scope_ids: std::collections::BTreeSet<u64> = scope
            .affected_responses
            .iter()
            .map(|r| r.request_id)
            .collect();
        for r in &live.affected_responses {
            assert!(
                scope_ids.contains(&r.request_id) || r.confidence != Confidence::Confirmed,
                "{name}: request {} confirmed live, not by scope",
                r.request_id
            );
        }
        if live.exact {
            assert_eq!(
                responses(&live.affected_responses),
                responses(&scope.affected_responses),
                "{name}: exact, yet different"
            );
        }
        eprintln!(
            "{name}: unpaced: exact={} late={} timed out={}; {} live vs {} scope",
            live.exact,
            live.live.copies_late,
            live.live.copies_timed_out,
            live.affected_responses.len(),
            scope.affected_responses.len()
        );
    }
}

/// Pools 0 (prefill) and 1 (decode), page size 1, 64 slots.
fn pd() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": 64, "page_size": 1},
            {"id": 1, "role": "decode", "capacity_tokens": 64, "page_size": 1}
        ]
    }))
    .unwrap()
}

fn ev(pool: u16, seq: u64, rid: u64, op: &str, start: u32, count: u32) -> String {
    format!(
        r#"{{"type":"kv","pool":{pool},"seq":{seq},"ts_ns":{seq},"request_id":{rid},"op":"{op}","slot_start":{start},"slot_count":{count}}}"#
    )
}

fn copy(seq: u64, rid: u64, start: u32, count: u32, src_seq: u64) -> String {
    format!(
        r#"{{"type":"kv","pool":1,"seq":{seq},"ts_ns":{seq},"request_id":{rid},"op":"write","slot_start":{start},"slot_count":{count},"src_pool":0,"src_slot_start":{start},"src_seq":{src_seq}}}"#
    )
}

/// Request 1 prefills slots 0..4 on pool 0; request 2 later overwrites
/// them. The copy into pool 1 reads pool 0 as of seq 1 (request 1's KV):
/// decode's read is request 1's own. Sent with the copy after pool 0 has
/// moved on and no holdback, the live view rebuilds pool 0 as of seq 1
/// from its history (exact, nothing found); with no history kept it cannot
/// see pool 0 as of seq 1: the copy is counted late and its slots
/// uncertain, never a guess.
#[test]
fn a_copy_whose_source_moved_on_is_rebuilt_or_counted_uncertain() {
    let default = Bounds::default().history;
    for (holdback, history, rebuilt, exact) in [
        (Duration::from_secs(3), default, 0, true),
        (Duration::ZERO, default, 1, true),
        (Duration::ZERO, 0, 0, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let out = dir.path().join("rec");
        let cfg = live_cfg(&sock, |o| {
            o.bounds.holdback = holdback;
            o.bounds.history = history;
        });
        let sidecar = Sidecar::start(cfg, pd(), &out, Arc::new(NoLog)).unwrap();
        let mut p = connect_to(&sock, &[0]);
        for l in [
            ev(0, 0, 1, "alloc", 0, 4),
            ev(0, 1, 1, "write", 0, 4),
            ev(0, 2, 2, "alloc", 0, 4),
            ev(0, 3, 2, "write", 0, 4),
            ev(0, 4, 2, "free", 0, 4),
            ev(0, 5, 3, "alloc", 2, 6),
            ev(0, 6, 3, "write", 2, 6),
        ] {
            writeln!(p, "{l}").unwrap();
        }
        p.flush().unwrap();
        drop(p);
        // Pool 0's events reach the live replay before the copy is sent.
        std::thread::sleep(Duration::from_millis(400));
        let mut d = connect_to(&sock, &[1]);
        for l in [
            ev(1, 0, 1, "alloc", 0, 4),
            copy(1, 1, 0, 4, 1),
            ev(1, 2, 1, "read", 0, 4),
        ] {
            writeln!(d, "{l}").unwrap();
        }
        drop(d);
        let sum = sidecar.shutdown().unwrap();
        let live = read_findings(&out);
        let scope = fresh_scope(&out);
        assert!(scope.affected_responses.is_empty(), "scope: own read");
        let case = format!("holdback {holdback:?}, history {history}: {:?}", live.live);
        assert_eq!(live.exact, exact, "{case}");
        assert_eq!(live.live.copies_rebuilt, rebuilt, "{case}");
        assert_eq!(sum.live.unwrap(), live.live);
        if exact {
            assert!(live.affected_responses.is_empty(), "{case}");
            assert_eq!(live.live.reads_unverified, 0, "{case}");
        } else {
            assert_eq!(live.live.copies_late, 1);
            // The uncertainty is the live view's own (the trace has the
            // copy's source as of src_seq): the read is counted as
            // unverified, and no alert pages anyone over a clean request.
            assert_eq!(live.live.reads_unverified, 1, "{case}");
            assert_eq!(live.live.alerts, 0, "{case}");
            // Taken from pool 0's current content (requests 2 and 3)
            // marked uncertain: a possible finding, never a confirmed
            // one, and never silently clean.
            let a = &live.affected_responses;
            assert_eq!(a.len(), 1, "{a:?}");
            assert_eq!(a[0].request_id, 1);
            assert_eq!(a[0].confidence, kvtrail::scope::Confidence::Possible);
        }
    }
}

/// A foreign read's alert is in the alerts file within a second, while
/// the engine's connection is still open; one alert per response.
#[test]
fn an_alert_is_written_within_a_second_while_connected() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("rec");
    let alerts = dir.path().join("alerts.jsonl");
    let a = alerts.clone();
    let mut cfg = live_cfg(&sock, |o| o.alerts = Some(AlertTarget::File(a)));
    cfg.recorder.from_engine_start = true;
    let sidecar = Sidecar::start(
        cfg,
        crate::support::record::deployment(),
        &out,
        Arc::new(NoLog),
    )
    .unwrap();
    let mut c = connect_to(&sock, &[2]);
    writeln!(c, r#"{{"type":"request","request_id":7,"external_id":"chatcmpl-7","tenant":"acme","arrival_ns":1,"prompt_tokens":4,"output_tokens":1,"http_status":200}}"#).unwrap();
    writeln!(c, r#"{{"type":"request","request_id":8,"external_id":"chatcmpl-8","tenant":"globex","arrival_ns":2,"prompt_tokens":4,"output_tokens":1,"http_status":200}}"#).unwrap();
    for l in [
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 8, "alloc", 10, 4),
        kv(2, 8, "read", 0, 4),
        kv(2, 8, "read", 0, 4),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    let sent = Instant::now();
    let mut lines = Vec::new();
    while sent.elapsed() < Duration::from_secs(1) {
        lines = std::fs::read_to_string(&alerts)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect();
        if !lines.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(lines.len(), 1, "one alert within 1 s: {lines:?}");
    let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(v["class_uid"], 2006);
    assert_eq!(v["unmapped"]["request_id"], 8);
    assert_eq!(v["unmapped"]["external_id"], "chatcmpl-8");
    assert_eq!(v["resources"][0]["owner"]["name"], "globex");
    assert_eq!(v["unmapped"]["source_tenants"], serde_json::json!(["acme"]));
    assert_eq!(v["unmapped"]["trigger"], "first_foreign_read");
    // Still connected: a loss alert follows the hook's `lost` line.
    writeln!(c, r#"{{"type":"lost","pool":2,"n":3}}"#).unwrap();
    c.flush().unwrap();
    let sent = Instant::now();
    let mut found = false;
    while sent.elapsed() < Duration::from_secs(3) && !found {
        found = std::fs::read_to_string(&alerts)
            .unwrap()
            .contains("live detection degraded: 3 events lost on pool 2");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(found, "loss alert");
    drop(c);
    let sum = sidecar.shutdown().unwrap();
    let l = sum.live.unwrap();
    assert_eq!((l.alerts, l.alerts_written, l.alerts_dropped), (2, 2, 0));
}

fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

/// The metrics answer a plain TCP client, while a client that connects
/// and never sends nor reads holds nothing; a taken port is refused.
#[test]
fn metrics_are_served_and_a_stuck_client_blocks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("rec");
    let cfg = live_cfg(&sock, |o| o.metrics = Some("127.0.0.1:0".parse().unwrap()));
    let sidecar = Sidecar::start(
        cfg,
        crate::support::record::deployment(),
        &out,
        Arc::new(NoLog),
    )
    .unwrap();
    let addr = sidecar.metrics_addr().expect("bound");
    let stuck = TcpStream::connect(addr).unwrap();
    let mut c = connect_to(&sock, &[2]);
    for l in [
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 8, "read", 0, 4),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    let t0 = Instant::now();
    let mut body = String::new();
    while t0.elapsed() < Duration::from_secs(10) {
        body = scrape(addr);
        if body.contains("kvtrail_foreign_reads_total 1") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(stuck);
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("kvtrail_foreign_reads_total 1"), "{body}");
    assert!(
        body.contains(r#"kvtrail_events_total{pool="2",op="write"} 1"#),
        "{body}"
    );
    assert!(body.contains("kvtrail_live_lag_seconds_bucket"), "{body}");
    // A second sidecar on the same metrics port is refused, naming it.
    let mut cfg2 = live_cfg(&dir.path().join("t.sock"), |o| o.metrics = Some(addr));
    cfg2.recorder.from_engine_start = true;
    let err = Sidecar::start(
        cfg2,
        crate::support::record::deployment(),
        &dir.path().join("rec2"),
        Arc::new(NoLog),
    )
    .err()
    .expect("port taken");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    drop(c);
    sidecar.shutdown().unwrap();
}

/// `--metrics` refuses a non-loopback address unless --allow-remote.
#[test]
fn metrics_on_a_remote_address_need_allow_remote() {
    let a = "0.0.0.0:9464".parse().unwrap();
    let e = kvtrail::record::live::metrics::check_addr(a, false).unwrap_err();
    assert!(e.to_string().contains("loopback"), "{e}");
    kvtrail::record::live::metrics::check_addr(a, true).unwrap();
}

/// `kvtrail record --metrics` on a taken port: exit 2 naming the address,
/// before anything listens; a remote address without --allow-remote too.
#[test]
fn record_refuses_a_taken_metrics_port_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dep = crate::support::record::write_deployment(dir.path());
    let sock = dir.path().join("s.sock");
    let run = |metrics: &str, out: &str| {
        crate::support::cli::kvtrail([
            "record",
            "--listen",
            sock.to_str().unwrap(),
            "--deployment",
            dep.to_str().unwrap(),
            "--out",
            dir.path().join(out).to_str().unwrap(),
            "--metrics",
            metrics,
        ])
        .timeout(Duration::from_secs(60))
        .run()
    };
    run(&addr, "t1").refused(&addr);
    assert!(!sock.exists(), "nothing listens");
    run("0.0.0.0:9464", "t2").refused("loopback");
}
