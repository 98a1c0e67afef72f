//! The sidecar against hostile or broken clients: one line must never stop
//! the writer, connection slots and shutdown cannot be held hostage, and
//! memory stays bounded; whatever is dropped is counted and makes the
//! capture incomplete.
//!
//! Index:
//! - lost_line_with_u64_max_does_not_stop_the_writer
//! - seq_near_u64_max_then_seqless_lines_do_not_stop_the_writer
//! - lost_counts_saturate_instead_of_wrapping
//! - lost_lines_on_two_pools_do_not_overflow_the_recorder
//! - queue_drops_are_counted_once_in_lost
//! - silent_connections_cannot_hold_every_slot
//! - refused_connection_makes_the_capture_incomplete
//! - trickling_client_cannot_hold_shutdown_open (library and binary)
//! - overlong_tenant_is_rejected_by_the_field_limit
//! - unpaired_views_are_bounded_and_overflow_is_counted
//! - transfer_into_the_last_page_of_a_2_32_page_pool_does_not_stop_the_writer
//! - writer_failure_is_not_silent
//! - reconnect_loop_leaves_no_per_connection_state
//! - guard_lines_are_checked_counted_and_alerted_once_per_request

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::support::cli::{kvtrail, s};
use crate::support::record::*;

/// Waits until `f` holds (or fails after 10 s).
fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn lost_line_with_u64_max_does_not_stop_the_writer() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    let mut b = rig.connect(&[3]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    writeln!(a, "{}", kv(2, 1, "write", 0, 1)).unwrap();
    writeln!(a, r#"{{"type":"lost","pool":2,"n":18446744073709551615}}"#).unwrap();
    a.flush().unwrap();
    let st = rig.sidecar.stats();
    until("the lost line is handled", || {
        st.rejected_unattributed.load(Ordering::Relaxed) + st.lost_hook.load(Ordering::Relaxed) > 0
    });
    std::thread::sleep(Duration::from_millis(300));
    // Recording goes on, for this pool and every other.
    writeln!(a, "{}", kv(2, 1, "read", 0, 1)).unwrap();
    writeln!(b, "{}", kv(3, 2, "alloc", 0, 1)).unwrap();
    writeln!(b, "{}", kv(3, 2, "write", 0, 1)).unwrap();
    drop((a, b));
    let (sum, t, _d, out) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.lost_queue, 0, "{st:?}");
    assert_eq!(st.kv_written, 5, "{st:?}");
    assert_eq!(seqs(&t, 2), vec![0, 1, 2]);
    assert_eq!(seqs(&t, 3), vec![0, 1]);
    // The loss it announced could not be recorded: not complete.
    assert!(!sum.complete, "{st:?}");
    assert_eq!(kvtrail(["verify", s(&out)]).run().code, 1);
}

#[test]
fn seq_near_u64_max_then_seqless_lines_do_not_stop_the_writer() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    let mut b = rig.connect(&[3]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    writeln!(a, "{}", kv(2, 1, "write", 0, 1)).unwrap();
    writeln!(
        a,
        r#"{{"type":"kv","pool":2,"seq":18446744073709551614,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1}}"#
    )
    .unwrap();
    for _ in 0..3 {
        writeln!(a, "{}", kv(2, 1, "read", 0, 1)).unwrap();
    }
    a.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    writeln!(b, "{}", kv(3, 2, "alloc", 0, 1)).unwrap();
    drop((a, b));
    let (sum, t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.lost_queue, 0, "{st:?}");
    assert_eq!(st.rejected_malformed, 1, "{st:?}");
    // The out-of-range line is a hole where it came; the pool goes on.
    assert_eq!(seqs(&t, 2), vec![0, 1, 3, 4, 5]);
    assert_eq!(seqs(&t, 3), vec![0]);
}

#[test]
fn lost_counts_saturate_instead_of_wrapping() {
    // 2^48 is the largest `n` a lost line may carry; 2^16 + 1 of them
    // overflow u64 twice over: the pool's seq space and the counters.
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    let mut b = rig.connect(&[3]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    let line = format!("{}\n", r#"{"type":"lost","pool":2,"n":281474976710656}"#);
    a.write_all(line.repeat((1 << 16) + 1).as_bytes()).unwrap();
    writeln!(a, "{}", kv(2, 1, "free", 0, 1)).unwrap();
    a.flush().unwrap();
    let st = rig.sidecar.stats();
    until("the lost lines are handled", || {
        st.lost_hook.load(Ordering::Relaxed) == u64::MAX
    });
    writeln!(b, "{}", kv(3, 2, "alloc", 0, 1)).unwrap();
    drop((a, b));
    let (sum, t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.lost_hook, u64::MAX, "saturated, not wrapped: {st:?}");
    assert_eq!(sum.stats.lost_events(), u64::MAX);
    assert!(st.lost_unrecorded > 0, "{st:?}");
    assert_eq!(seqs(&t, 3), vec![0]);
    assert_eq!(seqs(&t, 2)[0], 0);
    assert!(!sum.complete);
}

#[test]
fn lost_lines_on_two_pools_do_not_overflow_the_recorder() {
    // 2^15 lines of 2^48 on each of two pools: 2^63 per pool, 2^64 summed
    // over the recorder's pools.
    let rig = start(|_| {});
    let line = format!("{}\n", r#"{"type":"lost","pool":P,"n":281474976710656}"#);
    for pool in [2u16, 3] {
        let mut c = rig.connect(&[pool]);
        c.write_all(
            line.replace('P', &pool.to_string())
                .repeat(1 << 15)
                .as_bytes(),
        )
        .unwrap();
        writeln!(c, "{}", kv(pool, 1, "alloc", 0, 1)).unwrap();
    }
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.lost_hook, u64::MAX, "{:?}", sum.stats);
    assert_eq!(sum.stats.lost_unrecorded, 0, "{:?}", sum.stats);
    assert_eq!(seqs(&t, 2), vec![1 << 63]);
    assert_eq!(seqs(&t, 3), vec![1 << 63]);
    assert!(sum.complete, "every loss is a hole: {:?}", sum.stats);
}

#[test]
fn queue_drops_are_counted_once_in_lost() {
    // The writer_behind_drops_become_counted_holes set-up: a slow writer
    // behind a one-batch queue.
    let rig = start(|c| {
        c.queue_batches = 1;
        c.recorder.row_group_rows = 64;
        c.recorder.part.rotate_bytes = 1;
    });
    let n = 40_000u64;
    let mut a = rig.connect(&[3]);
    let mut buf = String::new();
    for i in 0..n {
        buf.push_str(&kv(3, 1, "read", (i % 4000) as u32, 1));
        buf.push('\n');
    }
    a.write_all(buf.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    writeln!(a, "{}", kv(3, 1, "read", 0, 1)).unwrap();
    drop(a);
    let (sum, _t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert!(st.lost_queue > 0, "the writer kept up: {st:?}");
    assert_eq!(st.lost_hook, 0, "no hook reported anything: {st:?}");
    assert_eq!(st.lost_events(), st.lost_queue, "{st:?}");
    assert_eq!(st.kv_written + st.lost_events(), n + 1, "{st:?}");
}

#[test]
fn silent_connections_cannot_hold_every_slot() {
    let rig = start(|c| {
        c.max_connections = 4;
        c.hello_timeout = Duration::from_millis(300);
    });
    let silent: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(&rig.sock).unwrap())
        .collect();
    let st = rig.sidecar.stats();
    until("the silent connections are dropped", || {
        st.dropped_before_hello.load(Ordering::Relaxed) == 4
            && st.connections_live.load(Ordering::Relaxed) == 0
    });
    // The engine's hello is taken.
    let mut a = rig.connect(&[2]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    drop((a, silent));
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.dropped_before_hello, 4, "{:?}", sum.stats);
    assert_eq!(seqs(&t, 2), vec![0]);
    // They might have been engines that were too slow: not complete.
    assert!(!sum.complete);
}

#[test]
fn refused_connection_makes_the_capture_incomplete() {
    let rig = start(|c| c.max_connections = 1);
    let mut a = rig.connect(&[2]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    let b = UnixStream::connect(&rig.sock).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reply = String::new();
    BufReader::new(&b).read_line(&mut reply).unwrap();
    assert!(reply.contains("too many connections"), "{reply}");
    drop((a, b));
    let (sum, _t, _d, out) = rig.stop();
    assert_eq!(sum.stats.refused_connections, 1, "{:?}", sum.stats);
    assert!(!sum.complete, "{:?}", sum.stats);
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
}

/// Sends one byte of a never-ending line every 100 ms until the peer
/// closes (or 60 s pass).
fn trickle(mut c: impl Write + Send + 'static) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            if c.write_all(b" ").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

#[test]
fn trickling_client_cannot_hold_shutdown_open() {
    let rig = start(|c| c.shutdown_grace = Duration::from_millis(500));
    let mut a = rig.connect(&[2]);
    for i in 0..3 {
        writeln!(a, "{}", kv(2, 1, "write", i, 1)).unwrap();
    }
    a.write_all(br#"{"type":"kv","pool":2,"#).unwrap();
    let h = trickle(a);
    std::thread::sleep(Duration::from_millis(300));
    let (tx, rx) = std::sync::mpsc::channel();
    let t0 = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(rig.stop());
    });
    let (sum, t, _d, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("shutdown is bounded");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(sum.stats.connections_cut, 1, "{:?}", sum.stats);
    assert_eq!(seqs(&t, 2), vec![0, 1, 2]);
    assert!(!sum.complete);
    h.join().unwrap();
}

#[test]
fn trickling_client_cannot_hold_sigterm_open() {
    let d = tempfile::tempdir().unwrap();
    let (child, sock, out) = spawn_record(d.path(), &["--shutdown-grace", "1"]);
    let mut c = hello(&sock, 2);
    writeln!(c, "{}", kv(2, 1, "write", 0, 1)).unwrap();
    let h = trickle(c);
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = wait_bounded(child, Duration::from_secs(10));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("cut at shutdown 1"), "{stdout}");
    assert!(stdout.contains("INCOMPLETE"), "{stdout}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
    h.join().unwrap();
}

fn request(rid: u64, tenant: &str, pool_key: &str, pool: u16) -> String {
    format!(
        r#"{{"type":"request","request_id":{rid},"external_id":"{tenant}","tenant":"{tenant}","arrival_ns":1,"prompt_tokens":9,"output_tokens":0,"http_status":200,"{pool_key}":{pool}}}"#
    )
}

#[test]
fn overlong_tenant_is_rejected_by_the_field_limit() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    // 2 x 256 KiB (tenant and external_id): well inside the 1 MiB line.
    let big = "t".repeat(1 << 18);
    writeln!(a, "{}", request(1, &big, "decode_pool", 2)).unwrap();
    writeln!(a, "{}", request(2, &"t".repeat(256), "decode_pool", 2)).unwrap();
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.rejected_unattributed, 1, "{:?}", sum.stats);
    assert_eq!(sum.stats.requests_written, 1);
    let rows: Vec<_> = t.requests().flat_map(|b| b.unwrap()).collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].request_id, 2);
    assert!(!sum.complete);
}

#[test]
fn unpaired_views_are_bounded_and_overflow_is_counted() {
    let budget = 256 << 10;
    let rig = start(|c| c.max_pending_bytes = budget);
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    let n = 5000u64;
    let tenant = "x".repeat(200);
    // The decode views of the first 10 requests pair at once.
    for rid in 1..=10 {
        writeln!(d, "{}", request(rid, "t", "decode_pool", 1)).unwrap();
    }
    d.flush().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let st = rig.sidecar.stats();
    let mut peak = 0;
    for rid in 1..=n {
        writeln!(p, "{}", request(rid, &tenant, "prefill_pool", 0)).unwrap();
        if rid % 100 == 0 {
            peak = peak.max(st.pending_bytes.load(Ordering::Relaxed));
        }
    }
    p.flush().unwrap();
    until("the views are taken", || {
        st.requests_written.load(Ordering::Relaxed) + st.lost_requests.load(Ordering::Relaxed) >= 10
            && st.queue_depth.load(Ordering::Relaxed) == 0
    });
    std::thread::sleep(Duration::from_millis(300));
    peak = peak.max(st.pending_bytes.load(Ordering::Relaxed));
    assert!(peak > 0 && peak <= budget, "peak {peak}");
    drop((p, d));
    let (sum, _t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert!(st.lost_requests > 0, "{st:?}");
    // Every view is written (alone or merged) or counted.
    assert_eq!(st.requests_written + st.lost_requests, n, "{st:?}");
    assert!(!sum.complete);
}

#[test]
fn transfer_into_the_last_page_of_a_2_32_page_pool_does_not_stop_the_writer() {
    // Page ids run to 2^32 - 1: the end of that page's run is 2^32.
    let dep: kvtrail::trace::manifest::Deployment = serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": 4294967296u64, "page_size": 1},
            {"id": 1, "role": "decode", "capacity_tokens": 4294967296u64, "page_size": 1}
        ]
    }))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("trace");
    let cfg = kvtrail::record::RecordConfig::new(kvtrail::record::Listen::Unix(sock.clone()));
    let sc = kvtrail::record::Sidecar::start(
        cfg,
        dep,
        &out,
        std::sync::Arc::new(kvtrail::record::NoLog),
    )
    .unwrap();
    let rig_connect = |pool: u16| {
        let mut c = UnixStream::connect(&sock).unwrap();
        writeln!(c, r#"{{"type":"hello","pools":[{pool}]}}"#).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reply = String::new();
        BufReader::new(&c).read_line(&mut reply).unwrap();
        assert!(reply.contains("welcome"), "{reply}");
        c
    };
    let mut p = rig_connect(0);
    let mut d = rig_connect(1);
    writeln!(p, "{}", kv(0, 7, "write", 4294967295, 1)).unwrap();
    writeln!(
        p,
        r#"{{"type":"xfer_send","room":5,"pool":0,"ts_ns":5,"dst_index":0,"src_pages":[[4294967295,1]],"last":true}}"#
    )
    .unwrap();
    drop(p);
    std::thread::sleep(Duration::from_millis(300));
    writeln!(
        d,
        r#"{{"type":"xfer_commit","room":5,"pool":1,"ts_ns":6,"request_id":7,"dst_pages":[[4294967295,1]]}}"#
    )
    .unwrap();
    writeln!(d, "{}", kv(1, 7, "read", 4294967295, 1)).unwrap();
    drop(d);
    let sum = sc.shutdown().expect("the writer survives");
    assert_eq!(sum.stats.kv_written, 3, "{:?}", sum.stats);
    let t = kvtrail::trace::Trace::open(&out).unwrap();
    let e = events(&t);
    let copy = e[&1][0];
    assert_eq!(
        (copy.slot_start, copy.src.map(|s| s.slot_start)),
        (4294967295, Some(4294967295))
    );
}

#[test]
fn writer_failure_is_not_silent() {
    let d = tempfile::tempdir().unwrap();
    let (child, sock, out) = spawn_record(d.path(), &["--row-group-rows", "10", "--rotate", "1"]);
    let mut c = hello(&sock, 2);
    writeln!(c, "{}", kv(2, 1, "write", 0, 1)).unwrap();
    c.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The trace directory is gone (a full or unmounted disk would do the
    // same): the writer cannot complete its next part file.
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::write(&out, b"not a directory").unwrap();
    for i in 0..100 {
        if writeln!(c, "{}", kv(2, 1, "write", i, 1)).is_err() {
            break;
        }
    }
    // The sidecar says so and ends by itself, with exit code 2.
    let o = wait_bounded(child, Duration::from_secs(10));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("record: writer stopped: "), "{err}");
    assert!(err.contains("error: "), "{err}");
}

#[test]
fn reconnect_loop_leaves_no_per_connection_state() {
    // A client that reconnects over and over (each time saying hello and
    // sending one event) must not grow the sidecar: what a connection holds
    // is freed when it closes and the writer has its last batch.
    let rig = start(|_| {});
    const N: u64 = 1000;
    for i in 0..N {
        let mut c = rig.connect(&[(2 + i % 2) as u16]);
        writeln!(c, "{}", kv((2 + i % 2) as u16, i + 1, "alloc", 0, 1)).unwrap();
        drop(c);
    }
    let stats = rig.sidecar.stats();
    until("every connection closed and every batch written", || {
        stats.connections_live.load(Ordering::Relaxed) == 0
            && stats.queue_depth.load(Ordering::Relaxed) == 0
            && stats.kv_written.load(Ordering::Relaxed) == N
    });
    assert_eq!(rig.sidecar.connection_entries(), 0);
    let (sum, t, _d, _o) = rig.stop();
    assert!(sum.complete);
    assert_eq!(seqs(&t, 2).len() + seqs(&t, 3).len(), N as usize);
}

/// A `guard` line (a decision of the engine's guard): the good ones
/// counted by verdict and action in /metrics and, where foreign or an
/// abort, alerted once per request; `guard_ok` lines summed as verdict
/// ok; every bad one rejected and counted, never a panic, never a hole
/// in the pool.
#[test]
fn guard_lines_are_checked_counted_and_alerted_once_per_request() {
    use kvtrail::record::live::{AlertTarget, LiveOptions};
    let alerts = tempfile::tempdir().unwrap();
    let alerts_file = alerts.path().join("alerts.jsonl");
    let af = alerts_file.clone();
    let rig = start(move |cfg| {
        cfg.live = Some(LiveOptions {
            metrics: Some("127.0.0.1:0".parse().unwrap()),
            alerts: Some(AlertTarget::File(af)),
            ..LiveOptions::default()
        });
    });
    let addr = rig.sidecar.metrics_addr().expect("metrics served");
    let g = |rid: &str, verdict: &str, action: &str, sources: &str, tail: &str| {
        format!(
            r#"{{"type":"guard","pool":2,"ts_ns":5,"request_id":{rid},"verdict":"{verdict}","action":"{action}","sources":{sources},"slots_read":8,"slots_foreign":4,"slots_unknown":0{tail}}}"#
        )
    };
    let too_many: Vec<u64> = (1..=257).collect();
    let bad = [
        g("11", "ok", "allow", "[]", ""),
        g("11", "foreign", "allow", "[7]", ""),
        g("11", "foreign", "abort", "[]", ""),
        g("11", "maybe", "abort", "[7]", ""),
        g("11", "unknown", "stop", "[]", ""),
        g("0", "foreign", "abort", "[7]", ""),
        g("18446744073709551615", "foreign", "abort", "[7]", ""),
        g("11", "foreign", "abort", "[18446744073709551615]", ""),
        g("11", "foreign", "abort", &format!("{too_many:?}"), ""),
        g("11", "foreign", "abort", "\"7\"", ""),
        g("11", "foreign", "abort", "[7]", r#","x_extra":1"#),
        g("11", "foreign", "abort", "[7]", r#","pool":2"#),
        g("11", "foreign", "abort", "[-7]", ""),
        r#"{"type":"guard","pool":2,"ts_ns":5,"request_id":11,"verdict":"unknown","action":"allow","sources":[],"slots_read":1,"slots_foreign":1,"slots_unknown":1}"#.to_string(),
        r#"{"type":"guard","pool":2,"ts_ns":5,"request_id":11,"verdict":"unknown","action":"allow","sources":[],"slots_read":18446744073709551616,"slots_foreign":0,"slots_unknown":0}"#.to_string(),
        r#"{"type":"guard","pool":2,"ts_ns":5,"request_id":11,"verdict":"unknown","action":"allow"}"#.to_string(),
        r#"{"type":"guard"}"#.to_string(),
        r#"{"type":"guard","pool":2,"#.to_string(),
        r#"{"type":"guard_ok","n":0}"#.to_string(),
        r#"{"type":"guard_ok","n":281474976710657}"#.to_string(),
        r#"{"type":"guard_ok","n":-1}"#.to_string(),
        r#"{"type":"guard_ok","n":"3"}"#.to_string(),
        r#"{"type":"guard_ok","n":3,"pool":2}"#.to_string(),
        r#"{"type":"guard_ok"}"#.to_string(),
    ];
    let mut c = rig.connect(&[2]);
    writeln!(c, "{}", kv(2, 7, "alloc", 0, 4)).unwrap();
    writeln!(c, "{}", kv(2, 7, "write", 0, 4)).unwrap();
    // Request 8: foreign, aborted; then again, alerted (one alert).
    writeln!(c, "{}", g("8", "foreign", "abort", "[7,7]", "")).unwrap();
    writeln!(c, "{}", g("8", "foreign", "alert", "[7]", "")).unwrap();
    // 9: unknown, let run (counted, no alert); 10: unknown, aborted.
    writeln!(c, "{}", g("9", "unknown", "allow", "[]", "")).unwrap();
    writeln!(c, "{}", g("10", "unknown", "abort", "[]", "")).unwrap();
    // Checks answered ok: counted, summed.
    writeln!(c, r#"{{"type":"guard_ok","n":3}}"#).unwrap();
    writeln!(c, r#"{{"type":"guard_ok","n":2}}"#).unwrap();
    for l in &bad {
        writeln!(c, "{l}").unwrap();
    }
    // A pool this connection did not declare: forged.
    writeln!(
        c,
        "{}",
        g("12", "foreign", "abort", "[7]", "").replace(r#""pool":2"#, r#""pool":3"#)
    )
    .unwrap();
    writeln!(c, "{}", kv(2, 7, "free", 0, 4)).unwrap();
    c.flush().unwrap();
    let st = rig.sidecar.stats();
    let n_bad = bad.len() as u64;
    until("every line handled", || {
        st.rejected_unattributed.load(Ordering::Relaxed) == n_bad
            && st.rejected_forged.load(Ordering::Relaxed) == 1
            && st.kv_written.load(Ordering::Relaxed) == 3
    });
    let series = |body: &str, v: &str, a: &str| -> Option<u64> {
        let key = format!(r#"kvtrail_guard_decisions_total{{verdict="{v}",action="{a}"}} "#);
        body.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|x| x.trim().parse().ok())
    };
    let t = Instant::now();
    let body = loop {
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        write!(sock, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut b = String::new();
        std::io::Read::read_to_string(&mut sock, &mut b).unwrap();
        if series(&b, "unknown", "abort") == Some(1) {
            break b;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{b}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(series(&body, "foreign", "abort"), Some(1), "{body}");
    assert_eq!(series(&body, "foreign", "alert"), Some(1), "{body}");
    assert_eq!(series(&body, "unknown", "allow"), Some(1), "{body}");
    assert_eq!(series(&body, "unknown", "alert"), Some(0), "{body}");
    assert_eq!(series(&body, "ok", "allow"), Some(5), "{body}");
    // No series for an action the guard never takes on a verdict.
    assert_eq!(series(&body, "foreign", "allow"), None, "{body}");
    drop(c);
    let (sum, t, _d, _out) = rig.stop();
    // Guard lines are no KV events: the pool has no hole.
    assert_eq!(seqs(&t, 2), vec![0, 1, 2]);
    assert_eq!(sum.stats.rejected_unattributed, n_bad);
    assert_eq!(sum.stats.rejected_forged, 1);
    let live = sum.live.expect("live stats");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&alerts_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let guard: Vec<(u64, String, String)> = lines
        .iter()
        .filter(|a| a["unmapped"]["kind"] == "guard")
        .map(|a| {
            (
                a["unmapped"]["request_id"].as_u64().unwrap(),
                a["unmapped"]["trigger"].as_str().unwrap().to_string(),
                a["unmapped"]["action"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        guard,
        vec![
            (8, "guard_foreign_read".into(), "abort".into()),
            (10, "guard_abort".into(), "abort".into()),
        ],
        "{lines:?}"
    );
    let first = lines
        .iter()
        .find(|a| a["unmapped"]["request_id"] == 8)
        .unwrap();
    assert_eq!(first["class_uid"], 2006);
    assert_eq!(first["severity_id"], 4);
    assert_eq!(first["unmapped"]["sources"][0]["request_id"], 7);
    assert_eq!(first["unmapped"]["sources"].as_array().unwrap().len(), 1);
    assert_eq!(live.alerts, lines.len() as u64);
}

/// Without live detection a good `guard` line is taken and not kept: the
/// trace has no trace of it, and nothing is rejected.
#[test]
fn guard_lines_without_live_detection_are_accepted_and_not_written() {
    let rig = start(|_| {});
    let mut c = rig.connect(&[2]);
    writeln!(c, "{}", kv(2, 7, "alloc", 0, 4)).unwrap();
    writeln!(
        c,
        r#"{{"type":"guard","pool":2,"ts_ns":5,"request_id":8,"verdict":"foreign","action":"abort","sources":[7],"slots_read":4,"slots_foreign":4,"slots_unknown":0}}"#
    )
    .unwrap();
    writeln!(c, "{}", kv(2, 7, "free", 0, 4)).unwrap();
    drop(c);
    let (sum, t, _d, _out) = rig.stop();
    assert_eq!(sum.stats.rejected_unattributed, 0, "{:?}", sum.stats);
    assert_eq!(sum.stats.rejected_forged, 0, "{:?}", sum.stats);
    assert!(sum.complete, "{:?}", sum.stats);
    assert_eq!(seqs(&t, 2), vec![0, 1]);
}
