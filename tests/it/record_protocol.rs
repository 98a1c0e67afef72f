//! The `kvtrail record` sidecar on its own (no engine): the wire protocol,
//! its security checks and its loss accounting, through the library
//! (`Sidecar`) and through the binary (signals, address policy).
//!
//! Index:
//! - concurrent_connections_each_write_their_pool
//! - forged_events_and_pool_claims_are_rejected
//! - oversized_malformed_and_out_of_contract_lines
//! - how_the_stream_is_cut_into_writes_changes_nothing
//! - writer_behind_drops_become_counted_holes
//! - hook_reported_loss_is_a_hole
//! - transfer_halves_join_into_copies / commit_waits_for_its_send / unresolved_copy_is_a_hole
//! - prefill_and_decode_views_of_a_request_merge
//! - tcp_loopback_and_listen_policy / connections_beyond_the_limit_are_refused
//! - sigterm_closes_cleanly / sigkill_leaves_every_rotated_file_valid

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrail::record::{Listen, NoLog, RecordConfig, Sidecar};
use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::{Manifest, Trace};

use crate::support::cli::{kvtrail, s};
use crate::support::record::*;

#[test]
fn concurrent_connections_each_write_their_pool() {
    let rig = start(|_| {});
    let n = 3000u32;
    std::thread::scope(|sc| {
        for pool in 0..4u16 {
            let rig = &rig;
            sc.spawn(move || {
                let mut c = rig.connect(&[pool]);
                // Batched: many lines per write.
                let mut buf = String::new();
                for i in 0..n {
                    buf.push_str(&kv(pool, 1 + i as u64 % 7, "write", i % 4000, 1));
                    buf.push('\n');
                    if i % 500 == 499 {
                        c.write_all(buf.as_bytes()).unwrap();
                        buf.clear();
                    }
                }
                c.write_all(buf.as_bytes()).unwrap();
            });
        }
    });
    let (sum, t, _d, out) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    assert_eq!(sum.stats.kv_written, 4 * n as u64);
    assert_eq!(sum.stats.connections_total, 4);
    for pool in 0..4 {
        assert_eq!(
            seqs(&t, pool),
            (0..n as u64).collect::<Vec<_>>(),
            "pool {pool}"
        );
    }
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}", v.stdout);
}

#[test]
fn forged_events_and_pool_claims_are_rejected() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[0]);
    writeln!(a, "{}", kv(0, 1, "alloc", 0, 4)).unwrap();
    writeln!(a, "{}", kv(1, 1, "write", 0, 4)).unwrap(); // pool 1: not declared
    writeln!(a, r#"{{"type":"lost","pool":3,"n":9}}"#).unwrap(); // also a forgery
    writeln!(a, "{}", kv(0, 1, "write", 0, 4)).unwrap();
    a.flush().unwrap();
    // `a`'s claim on pool 0 holds (connect read its welcome). A second live
    // connection may not claim pool 0; unknown pools neither.
    for hello in [
        r#"{"type":"hello","pools":[0]}"#,
        r#"{"type":"hello","pools":[9]}"#,
    ] {
        let mut b = UnixStream::connect(&rig.sock).unwrap();
        // A missing reply fails the test instead of hanging it.
        b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        writeln!(b, "{hello}").unwrap();
        let mut reply = String::new();
        BufReader::new(&b).read_line(&mut reply).unwrap();
        assert!(reply.contains(r#""type":"error""#), "{reply}");
    }
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.rejected_forged, 2);
    assert_eq!(sum.stats.rejected_hello, 2);
    assert_eq!(sum.stats.refused_claims, 2);
    assert_eq!(seqs(&t, 0), vec![0, 1]);
    assert!(seqs(&t, 1).is_empty() && seqs(&t, 3).is_empty());
    // The refused hellos were processes meant to record pools 0 and 9:
    // whatever they saw is not in the trace, so it is not complete.
    assert!(!sum.complete);
}

#[test]
fn forged_lines_alone_leave_the_capture_complete() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[0]);
    writeln!(a, "{}", kv(0, 1, "alloc", 0, 4)).unwrap();
    writeln!(a, "{}", kv(1, 1, "write", 0, 4)).unwrap(); // pool 1: not declared
    writeln!(a, "{}", kv(0, 1, "write", 0, 4)).unwrap();
    // Not a hello at all (a port probe): refused, but no pool's evidence.
    let mut b = UnixStream::connect(&rig.sock).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    writeln!(b, "GET / HTTP/1.0").unwrap();
    let mut reply = String::new();
    BufReader::new(&b).read_line(&mut reply).unwrap();
    assert!(reply.contains(r#""type":"error""#), "{reply}");
    drop((a, b));
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.rejected_forged, 1);
    assert_eq!(sum.stats.rejected_hello, 1);
    assert_eq!(sum.stats.refused_claims, 0);
    assert_eq!(seqs(&t, 0), vec![0, 1]);
    // Forged lines are not lost evidence of any pool: the capture is complete.
    assert!(sum.complete);
}

#[test]
fn oversized_malformed_and_out_of_contract_lines() {
    let rig = start(|c| c.max_line_bytes = 512);
    let mut a = rig.connect(&[2]);
    let lines = [
        kv(2, 1, "alloc", 0, 8),                                // seq 0
        format!("{}\n", "x".repeat(100_000)),                 // oversized: skipped unread
        "{not json".to_string(),                              // unattributable
        kv(2, 1, "wrte", 0, 8),                               // bad op, pool known: hole (seq 1)
        kv(2, 1, "write", 4090, 100),                         // outside the pool: hole (seq 2)
        r#"{"type":"kv","pool":2,"seq":9,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1,"bogus":1}"#.into(),
        kv(2, 1, "write", 0, 8),                              // seq 3
    ];
    for l in &lines {
        writeln!(a, "{l}").unwrap();
    }
    drop(a);
    let (sum, t, _d, out) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.rejected_unattributed, 2, "{st:?}");
    assert_eq!(st.rejected_malformed, 2, "{st:?}");
    assert_eq!(st.rejected_contract, 1, "{st:?}");
    assert_eq!(seqs(&t, 2), vec![0, 3]);
    // Unattributable rejects: evidence may be missing, so not complete.
    assert!(!sum.complete);
    let m = Manifest::load(&out).unwrap();
    assert_eq!(m.capture.extra["record"]["rejected_unattributed"], 2);
}

/// The connection reads whole lines in place from its buffer and lines
/// that span reads through a slower path: how the stream is cut into
/// writes must not change a single recorded event or count.
#[test]
fn how_the_stream_is_cut_into_writes_changes_nothing() {
    const MAX: usize = 512;
    let mut lines: Vec<Vec<u8>> = vec![
        kv(2, 1, "alloc", 0, 64).into_bytes(),
        // The hook's canonical shape, token_pos given and null.
        br#"{"type":"kv","pool":2,"ts_ns":2,"request_id":1,"op":"write","slot_start":0,"slot_count":16,"token_pos":0}"#.to_vec(),
        br#"{"type":"kv","pool":2,"ts_ns":3,"request_id":1,"op":"share","slot_start":0,"slot_count":16,"token_pos":null}"#.to_vec(),
        Vec::new(),
        b"   \t ".to_vec(),
        b"\xff\xfe not UTF-8".to_vec(),
        // Another key order: the full parser.
        br#"{"op":"read","type":"kv","pool":2,"ts_ns":4,"request_id":1,"slot_start":0,"slot_count":16,"token_pos":0}"#.to_vec(),
        "x".repeat(3 * MAX).into_bytes(), // over the limit: skipped unread
        kv(2, 1, "write", 4090, 100).into_bytes(), // outside the pool: a hole
    ];
    // Exactly at the limit (padded with JSON whitespace) and one past it.
    for len in [MAX, MAX + 1] {
        let mut l = kv(2, 1, "read", 0, 16).into_bytes();
        let close = l.pop().unwrap();
        l.resize(len - 1, b' ');
        l.push(close);
        lines.push(l);
    }
    for i in 0..300u32 {
        lines.push(kv(2, 2 + u64::from(i % 5), "write", (i * 16) % 4000, 16).into_bytes());
    }
    lines.push(kv(2, 1, "free", 0, 64).into_bytes());
    let mut stream = Vec::new();
    for l in &lines {
        stream.extend_from_slice(l);
        stream.push(b'\n');
    }
    let run = |cut: &dyn Fn(usize) -> usize| {
        let rig = start(|c| c.max_line_bytes = MAX);
        let mut a = rig.connect(&[2]);
        let mut at = 0;
        let mut k = 0;
        while at < stream.len() {
            let n = cut(k).clamp(1, stream.len() - at);
            a.write_all(&stream[at..at + n]).unwrap();
            a.flush().unwrap();
            at += n;
            k += 1;
        }
        drop(a);
        let (sum, t, _d, _out) = rig.stop();
        let st = &sum.stats;
        (
            events(&t),
            (
                st.kv_written,
                st.rejected_unattributed,
                st.rejected_malformed,
                st.rejected_contract,
            ),
        )
    };
    let whole = run(&|_| usize::MAX);
    // 300 writes and 6 more events; a hole for the out-of-pool write.
    assert_eq!(whole.1.0, 306, "{:?}", whole.1);
    assert_eq!(
        whole.1.1, 3,
        "not UTF-8, over the limit, one past the limit"
    );
    assert_eq!(whole.1.3, 1, "the write outside the pool");
    let events_at_limit = whole.0[&2].iter().filter(|e| e.op == Op::Read).count();
    assert_eq!(
        events_at_limit, 2,
        "the reordered read and the one at the limit"
    );
    for (what, cut) in [
        (
            "one byte per write",
            &(|_| 1usize) as &dyn Fn(usize) -> usize,
        ),
        ("writes of 7 to 700 bytes", &|k| 7 + (k * 7919) % 694),
        ("a line and a half at a time", &|_| 170),
    ] {
        assert_eq!(run(cut), whole, "{what}");
    }
}

#[test]
fn writer_behind_drops_become_counted_holes() {
    // A slow writer (a part file, fsync and manifest per 64 rows) behind a
    // one-batch queue: the connection must drop, never block or lose silently.
    let rig = start(|c| {
        c.queue_batches = 1;
        c.recorder.row_group_rows = 64;
        c.recorder.part.rotate_bytes = 1;
    });
    let n = 60_000u64;
    let mut a = rig.connect(&[3]);
    let mut buf = String::new();
    for i in 0..n {
        buf.push_str(&kv(3, 1, "read", (i % 4000) as u32, 1));
        buf.push('\n');
    }
    a.write_all(buf.as_bytes()).unwrap();
    // One last event after a pause, so any loss before it is a visible hole.
    std::thread::sleep(Duration::from_millis(300));
    writeln!(a, "{}", kv(3, 1, "read", 0, 1)).unwrap();
    drop(a);
    let (sum, t, _d, out) = rig.stop();
    let st = &sum.stats;
    assert!(st.lost_queue > 0, "the writer kept up: {st:?}");
    assert_eq!(st.kv_written + st.lost_queue, n + 1, "{st:?}");
    let got = seqs(&t, 3);
    assert_eq!(got.len() as u64, st.kv_written);
    assert_eq!(*got.last().unwrap(), n, "holes take the lost seqs");
    let i = kvtrail(["inspect", s(&out), "--json"]).run();
    let j: serde_json::Value = serde_json::from_str(&i.stdout).unwrap();
    let p = j["kv"]["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == 3)
        .unwrap();
    assert_eq!(p["missing_events"], st.lost_queue, "{p}");
}

#[test]
fn when_behind_wait_slows_the_sender_and_loses_nothing() {
    // The same slow writer and one-batch queue, with `--when-behind wait`:
    // the connection stops reading until the writer catches up, so the
    // sender waits and every event lands, in order, with no hole.
    let rig = start(|c| {
        c.queue_batches = 1;
        c.when_behind = kvtrail::record::WhenBehind::Wait;
        c.recorder.row_group_rows = 64;
        c.recorder.part.rotate_bytes = 1;
    });
    let n = 60_000u64;
    let mut a = rig.connect(&[3]);
    let mut buf = String::new();
    for i in 0..n {
        buf.push_str(&kv(3, 1, "read", (i % 4000) as u32, 1));
        buf.push('\n');
    }
    a.write_all(buf.as_bytes()).unwrap();
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.lost_queue, 0, "{st:?}");
    assert_eq!(st.kv_written, n, "{st:?}");
    assert_eq!(seqs(&t, 3), (0..n).collect::<Vec<_>>());
    assert!(sum.complete);
}

#[test]
fn hook_reported_loss_is_a_hole() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    writeln!(a, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    writeln!(a, r#"{{"type":"lost","pool":2,"n":3}}"#).unwrap();
    writeln!(a, "{}", kv(2, 1, "write", 0, 1)).unwrap();
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(seqs(&t, 2), vec![0, 4]);
    assert_eq!(sum.stats.lost_hook, 3);
    assert!(sum.complete);
}

/// A KV line of several runs (docs/jsonl.md) is one event per run, in
/// order, with the seqs one line per run would take, on both the byte
/// scanner's path and the full parser's. A line the parser refuses is a
/// hole of as many events as it lists (the hook's positions counted
/// them); a run outside the pool is a hole of one, its other runs kept.
#[test]
fn kv_lines_of_several_runs_are_one_event_per_run() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    let lines = [
        kv(2, 1, "alloc", 0, 64), // seq 0
        // The hook's spelling (byte scanner): seqs 1, 2, 3.
        r#"{"type":"kv","pool":2,"ts_ns":5,"request_id":1,"op":"write","runs":[[0,16,0],[32,8,16],[48,1,null]]}"#.into(),
        // Keys in another order, a run of two values (full parser): 4, 5.
        r#"{"op":"read","type":"kv","pool":2,"ts_ns":6,"request_id":1,"runs":[[0,16],[32, 8, 16]]}"#.into(),
        // A run of count 0: the whole line refused, a hole of 3 (6, 7, 8).
        r#"{"type":"kv","pool":2,"ts_ns":7,"request_id":1,"op":"read","runs":[[0,1,0],[1,0,1],[2,1,2]]}"#.into(),
        // A run outside the pool (4096 slots): 9 kept, 10 a hole, 11 kept.
        r#"{"type":"kv","pool":2,"ts_ns":8,"request_id":1,"op":"read","runs":[[0,1,0],[4090,100,1],[2,1,2]]}"#.into(),
        kv(2, 1, "free", 0, 64), // 12
    ];
    for l in &lines {
        writeln!(a, "{l}").unwrap();
    }
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.rejected_malformed, 1, "{st:?}");
    assert_eq!(st.rejected_contract, 1, "{st:?}");
    assert_eq!(seqs(&t, 2), vec![0, 1, 2, 3, 4, 5, 9, 11, 12]);
    let evs = &events(&t)[&2];
    let got: Vec<_> = evs
        .iter()
        .map(|e| {
            (
                e.seq,
                e.op,
                e.slot_start,
                e.slot_count,
                e.token_pos,
                e.ts_ns,
            )
        })
        .collect();
    assert_eq!(
        got[1..8],
        [
            (1, Op::Write, 0, 16, Some(0), 5),
            (2, Op::Write, 32, 8, Some(16), 5),
            (3, Op::Write, 48, 1, None, 5),
            (4, Op::Read, 0, 16, None, 6),
            (5, Op::Read, 32, 8, Some(16), 6),
            (9, Op::Read, 0, 1, Some(0), 8),
            (11, Op::Read, 2, 1, Some(2), 8),
        ]
    );
}

/// A line of more runs than one batch holds is handed on in batches of
/// the usual size, every run kept, in order.
#[test]
fn a_line_of_more_runs_than_a_batch_keeps_every_run_in_order() {
    let rig = start(|_| {});
    let mut a = rig.connect(&[2]);
    let runs: Vec<String> = (0..3000).map(|i| format!("[{i},1,{i}]")).collect();
    writeln!(
        a,
        r#"{{"type":"kv","pool":2,"ts_ns":5,"request_id":1,"op":"write","runs":[{}]}}"#,
        runs.join(",")
    )
    .unwrap();
    writeln!(a, "{}", kv(2, 1, "read", 0, 3000)).unwrap();
    drop(a);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(seqs(&t, 2), (0..3001).collect::<Vec<u64>>());
    let evs = &events(&t)[&2];
    assert!(
        evs[..3000]
            .iter()
            .enumerate()
            .all(|(i, e)| e.slot_start == i as u32 && e.token_pos == Some(i as u32))
    );
    assert!(sum.complete);
}

fn send(pool: u16, room: u64, dst_index: u32, pages: &str, last: bool) -> String {
    format!(
        r#"{{"type":"xfer_send","room":{room},"pool":{pool},"ts_ns":5,"dst_index":{dst_index},"src_pages":{pages},"last":{last}}}"#
    )
}

fn commit(pool: u16, room: u64, rid: u64, pages: &str) -> String {
    format!(
        r#"{{"type":"xfer_commit","room":{room},"pool":{pool},"ts_ns":6,"request_id":{rid},"dst_pages":{pages}}}"#
    )
}

fn summary(evs: &[KvEvent]) -> Vec<String> {
    evs.iter()
        .map(|e| {
            format!(
                "{} {} r{} {}+{}{}",
                e.seq,
                e.op,
                e.request_id,
                e.slot_start,
                e.slot_count,
                e.src.map_or(String::new(), |c| format!(
                    " <- p{} {} @{}",
                    c.pool, c.slot_start, c.seq
                ))
            )
        })
        .collect()
}

#[test]
fn transfer_halves_join_into_copies() {
    let rig = start(|_| {});
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    writeln!(d, "{}", kv(1, 7, "alloc", 40, 24)).unwrap(); // prealloc pages 10..15
    d.flush().unwrap();
    writeln!(p, "{}", kv(0, 7, "alloc", 8, 8)).unwrap();
    writeln!(p, "{}", kv(0, 7, "write", 8, 8)).unwrap(); // pages 2,3
    // Two chunks: pages [2] into dst index 0, then [3] into dst index 1 (last).
    writeln!(p, "{}", send(0, 99, 0, "[[2,1]]", false)).unwrap();
    writeln!(p, "{}", kv(0, 7, "write", 12, 1)).unwrap(); // after the first send
    writeln!(p, "{}", send(0, 99, 1, "[[3,1]]", true)).unwrap();
    drop(p);
    std::thread::sleep(Duration::from_millis(300));
    writeln!(d, "{}", commit(1, 99, 7, "[[10,6]]")).unwrap();
    writeln!(d, "{}", kv(1, 7, "read", 40, 24)).unwrap();
    drop(d);
    let (sum, t, _d, _) = rig.stop();
    assert!(sum.complete);
    let e = events(&t);
    assert_eq!(
        summary(&e[&1]),
        vec![
            "0 alloc r7 40+24",
            "1 write r7 40+4 <- p0 8 @1",
            "2 write r7 44+4 <- p0 12 @2",
            "3 read r7 40+24",
        ]
    );
    assert_eq!(e[&1][1].token_pos, Some(0));
    assert_eq!(e[&1][2].token_pos, Some(4));
}

#[test]
fn commit_waits_for_its_send() {
    let rig = start(|_| {});
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    writeln!(p, "{}", kv(0, 7, "write", 4, 4)).unwrap();
    p.flush().unwrap();
    // Decode commits and reads before prefill's send reaches the sidecar.
    writeln!(d, "{}", kv(1, 7, "alloc", 0, 8)).unwrap();
    writeln!(d, "{}", commit(1, 5, 7, "[[0,2]]")).unwrap();
    writeln!(d, "{}", kv(1, 7, "read", 0, 8)).unwrap();
    d.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    writeln!(p, "{}", send(0, 5, 0, "[[1,1]]", true)).unwrap();
    drop(p);
    drop(d);
    let (sum, t, _d, _) = rig.stop();
    assert!(sum.complete, "{sum:?}");
    assert_eq!(
        summary(&events(&t)[&1]),
        vec![
            "0 alloc r7 0+8",
            "1 write r7 0+4 <- p0 4 @0",
            "2 read r7 0+8"
        ]
    );
}

#[test]
fn unresolved_copy_is_a_hole() {
    let rig = start(|c| c.copy_timeout = Duration::from_millis(300));
    let mut d = rig.connect(&[1]);
    writeln!(d, "{}", kv(1, 7, "alloc", 0, 8)).unwrap();
    writeln!(d, "{}", commit(1, 77, 7, "[[0,2]]")).unwrap();
    writeln!(d, "{}", kv(1, 7, "read", 0, 8)).unwrap();
    d.flush().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    drop(d);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.copies_unresolved, 1);
    assert_eq!(
        seqs(&t, 1),
        vec![0, 2],
        "the copy is a hole, the read stays after it"
    );
}

#[test]
fn prefill_and_decode_views_of_a_request_merge() {
    let rig = start(|_| {});
    let mut p = rig.connect(&[0]);
    let mut d = rig.connect(&[1]);
    let h = "ab".repeat(32);
    writeln!(p, r#"{{"type":"request","request_id":1003,"external_id":"C","tenant":"t-c","arrival_ns":10,"finish_ns":20,"prompt_tokens":120,"prefilled_tokens":1,"output_tokens":1,"http_status":200,"finish_reason":"length","prefill_pool":0,"prompt_hash":"{h}"}}"#).unwrap();
    drop(p);
    std::thread::sleep(Duration::from_millis(200));
    writeln!(d, r#"{{"type":"request","request_id":1003,"external_id":"C","tenant":"t-c","arrival_ns":11,"finish_ns":90,"prompt_tokens":120,"output_tokens":3,"http_status":200,"finish_reason":"length","decode_pool":1}}"#).unwrap();
    // A decode view whose prefill never reports: written alone at close.
    writeln!(d, r#"{{"type":"request","request_id":5,"tenant":"t-e","arrival_ns":1,"prompt_tokens":9,"output_tokens":0,"http_status":500,"decode_pool":1}}"#).unwrap();
    drop(d);
    let (sum, t, _d, _) = rig.stop();
    assert_eq!(sum.stats.requests_written, 2);
    let rows: Vec<_> = t.requests().flat_map(|b| b.unwrap()).collect();
    let c = rows.iter().find(|r| r.request_id == 1003).unwrap();
    assert_eq!(
        (
            c.prompt_tokens,
            c.prefilled_tokens,
            c.output_tokens,
            c.http_status,
            c.prefill_pool,
            c.decode_pool,
            c.arrival_ns,
            c.finish_ns
        ),
        (120, Some(1), 3, 200, Some(0), Some(1), 10, Some(90))
    );
    assert!(c.prompt_hash.is_some());
    let e = rows.iter().find(|r| r.request_id == 5).unwrap();
    assert_eq!((e.http_status, e.prefilled_tokens), (500, None));
}

#[test]
fn tcp_loopback_and_listen_policy() {
    let cases: [(&str, bool, &str); 7] = [
        ("/run/k.sock", false, "Ok(unix:/run/k.sock)"),
        ("unix:rel.sock", false, "Ok(unix:rel.sock)"),
        ("127.0.0.1:7071", false, "Ok(tcp:127.0.0.1:7071)"),
        ("tcp:[::1]:7071", false, "Ok(tcp:[::1]:7071)"),
        ("0.0.0.0:7071", false, "Err"),
        ("tcp:10.1.2.3:7071", false, "Err"),
        ("tcp:10.1.2.3:7071", true, "Ok(tcp:10.1.2.3:7071)"),
    ];
    for (addr, remote, expect) in cases {
        let got = match Listen::parse(addr, remote) {
            Ok(l) => format!("Ok({l})"),
            Err(e) => {
                assert!(e.to_string().contains("loopback"), "{e}");
                "Err".into()
            }
        };
        assert_eq!(got, expect, "{addr}");
    }
    // A real loopback TCP capture.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let cfg = RecordConfig::new(Listen::parse("127.0.0.1:0", false).unwrap());
    let sc = Sidecar::start(cfg, deployment(), &out, Arc::new(NoLog)).unwrap();
    let Listen::Tcp(addr) = sc.listen().clone() else {
        panic!("tcp")
    };
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    writeln!(c, r#"{{"type":"hello","pools":[2]}}"#).unwrap();
    writeln!(c, "{}", kv(2, 1, "alloc", 0, 1)).unwrap();
    drop(c);
    let sum = sc.shutdown().unwrap();
    assert_eq!(sum.stats.kv_written, 1);
}

#[test]
fn connections_beyond_the_limit_are_refused() {
    let rig = start(|c| c.max_connections = 2);
    let a = rig.connect(&[0]);
    let b = rig.connect(&[1]);
    let c = UnixStream::connect(&rig.sock).unwrap();
    let mut reply = String::new();
    BufReader::new(&c).read_line(&mut reply).unwrap();
    assert!(reply.contains("too many connections"), "{reply}");
    drop((a, b, c));
    let (sum, ..) = rig.stop();
    assert_eq!(sum.stats.rejected_hello, 1);
    assert_eq!(sum.stats.connections_live, 0);
}

#[test]
fn unix_socket_is_owner_only() {
    let rig = start(|_| {});
    let mode = std::fs::metadata(&rig.sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let (sum, ..) = rig.stop();
    // No KV event was recorded: no evidence, never a clean capture.
    assert!(!sum.complete);
}

// ---------------------------------------------------------------- the binary

#[test]
fn sigterm_closes_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let (child, sock, out) = spawn_record(d.path(), &[]);
    let mut c = hello(&sock, 2);
    for i in 0..100 {
        writeln!(c, "{}", kv(2, 1, "write", i, 1)).unwrap();
    }
    c.flush().unwrap();
    std::thread::sleep(Duration::from_millis(1500)); // a health line
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("health: "), "{err}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("100 kv events"),
        "{err}"
    );
    let m = Manifest::load(&out).unwrap();
    assert!(m.capture.complete);
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}", v.stdout);
    assert!(!sock.exists(), "the socket is removed on exit");
}

#[test]
fn sigkill_leaves_every_rotated_file_valid() {
    let d = tempfile::tempdir().unwrap();
    let (mut child, sock, out) =
        spawn_record(d.path(), &["--rotate", "1", "--row-group-rows", "50"]);
    let mut c = hello(&sock, 3);
    for i in 0..1000 {
        writeln!(c, "{}", kv(3, 1, "write", i, 1)).unwrap();
    }
    c.flush().unwrap();
    let t = Instant::now();
    loop {
        let files = Manifest::load(&out)
            .ok()
            .and_then(|m| m.files)
            .map_or(0, |f| f.len());
        if files >= 10 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no rotation");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let m = Manifest::load(&out).unwrap();
    assert!(!m.capture.complete);
    let rep = kvtrail::trace::verify::verify(&out).unwrap();
    let kinds: Vec<&str> = rep.problems.iter().map(|p| p.kind.as_str()).collect();
    // The kill may land between a part file's rename and the manifest
    // rewrite that lists it (docs/capture-sglang.md): at most that one file
    // is on disk unlisted ("extra"); it is complete and reads back below.
    assert!(
        kinds
            .iter()
            .all(|k| *k == "unclean" || *k == "inprogress" || *k == "extra")
            && kinds.iter().filter(|k| **k == "extra").count() <= 1,
        "{:?}",
        rep.problems
    );
    assert!(rep.files_checked >= 10);
    // Every completed file reads back.
    let t = Trace::open(&out).unwrap();
    let n: usize = t.kv_chunks().map(|c| c.unwrap().events.len()).sum();
    assert!(n >= 500, "{n}");
    assert!(events(&t)[&3].iter().all(|e| e.op == Op::Write));
}

#[test]
fn non_loopback_tcp_is_refused_by_the_binary() {
    let d = tempfile::tempdir().unwrap();
    let dep = write_deployment(d.path());
    let out = d.path().join("t");
    let r = kvtrail([
        "record",
        "--listen",
        "0.0.0.0:0",
        "--deployment",
        s(&dep),
        "--out",
        s(&out),
    ])
    .run();
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not a loopback address"), "{}", r.stderr);
    assert!(r.stderr.contains("--allow-remote"), "{}", r.stderr);
}
