//! The replay's index pass reads one kv file in parts at once (a PD
//! trace's single file on every core) and joins the parts' runs in file
//! order. That must give the very runs, holes and errors of one pass over
//! the whole file: checked here on many small files of many row groups,
//! with holes, rows out of order and duplicated seqs inside parts and at
//! their seams, and end to end through `scope` on 1 and 3 threads.

use std::path::Path;

use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::Trace;
use kvtrail::trace::check::{scan_file, scan_file_split};
use kvtrail::trace::write::kv_batch;
use parquet::basic::Compression;

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace::write_batches;
use crate::support::trace_builder::{Rng, TraceBuilder};

/// Rows of two pools, each pool's seqs rising with holes; now and then a
/// seq repeated or lower than the last (`disorder` in 1000).
fn rows(rng: &mut Rng, n: usize, disorder: u64) -> Vec<KvEvent> {
    let mut next = [0u64; 2];
    (0..n)
        .map(|_| {
            let pool = rng.below(2) as usize;
            let seq = match rng.below(1000) {
                x if x < disorder / 2 => next[pool].saturating_sub(1),
                x if x < disorder => next[pool].saturating_sub(1 + rng.below(4)),
                x if x < 100 => next[pool] + 1 + rng.below(5),
                _ => next[pool],
            };
            next[pool] = next[pool].max(seq + 1);
            KvEvent {
                pool: pool as u16,
                seq,
                ts_ns: 1,
                request_id: 1,
                op: Op::Write,
                slot_start: 0,
                slot_count: 2,
                token_pos: None,
                src: None,
            }
        })
        .collect()
}

/// A trace whose one kv file holds `evs` in row groups of `group` rows.
fn trace_of(dir: &Path, evs: &[KvEvent], group: usize) -> Trace {
    let t = TraceBuilder::pd().by_hand(dir, 1, 1, false);
    let _ = std::fs::remove_dir_all(t.join("kv"));
    write_batches(
        &t.join("kv").join("a.parquet"),
        &[kv_batch(evs)],
        Compression::UNCOMPRESSED,
        group,
    );
    Trace::open(&t).unwrap()
}

#[test]
fn a_file_read_in_parts_gives_the_runs_and_errors_of_one_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x6b76_7472_6169_6c01);
    let (mut ok, mut failed, mut split_errors) = (0, 0, 0);
    for case in 0..300 {
        let n = 1 + rng.below(60) as usize;
        let disorder = [0, 0, 5, 20, 80][case % 5];
        let evs = rows(&mut rng, n, disorder);
        let group = 1 + rng.below(7) as usize;
        let trace = trace_of(&tmp.path().join(case.to_string()), &evs, group);
        let path = &trace.kv_files[0];
        let whole = scan_file(&trace, path, |_| Ok(())).map(|r| format!("{r:?}"));
        for parts in 2..=5 {
            let seen = std::sync::atomic::AtomicU64::new(0);
            let split = scan_file_split(&trace, path, parts, |b| {
                seen.fetch_add(b.seq.len() as u64, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            });
            match (&whole, split) {
                (Ok(w), Ok(Some(r))) => {
                    assert_eq!(w, &format!("{r:?}"), "case {case}, {parts} parts");
                    assert_eq!(seen.into_inner(), n as u64, "every batch seen once");
                    ok += 1;
                }
                // A part met an error (one the whole pass may not meet:
                // seqs out of order before it are sorted, not checked
                // row by row): the caller reads the whole file.
                (_, Ok(None)) => failed += 1,
                (Err(w), Err(e)) => {
                    assert_eq!(w.to_string(), e.to_string(), "case {case}, {parts} parts");
                    split_errors += 1;
                }
                (w, r) => panic!(
                    "case {case}, {parts} parts: one pass {w:?}, in parts {:?}",
                    r.map(|x| x.map(|x| format!("{x:?}")))
                ),
            }
        }
    }
    // The cases reach every branch: runs joined, errors left to one pass,
    // and errors found at a seam.
    assert!(
        ok > 300 && failed > 20 && split_errors > 5,
        "{ok} {failed} {split_errors}"
    );
}

#[test]
fn scope_on_a_file_of_many_row_groups_is_the_same_on_every_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tb = TraceBuilder::pd();
    for r in 1..=40u64 {
        tb.req(r, if r % 2 == 0 { "acme" } else { "globex" });
        let at = ((r * 7) % 56) as u32;
        tb.ev(0, r, Op::Alloc, at, 8);
        let w = tb.ev(0, r, Op::Write, at, 8);
        // Now and then a placeholder: one slot copied, eight read (the
        // stale KV of earlier requests).
        let n = if r % 9 == 0 { 1 } else { 8 };
        tb.ev(1, r, Op::Alloc, at, 8);
        tb.copy(1, r, at, n, 0, at, w);
        tb.ev(0, r, Op::Free, at, 8);
        tb.ev(1, r, Op::Read, at, 8);
        tb.ev(1, r, Op::Free, at, 8);
    }
    let t = tb.by_hand(&tmp.path().join("t"), 1, 7, false);
    // Rewritten in row groups of 5 rows: the index pass reads it in parts.
    let trace = Trace::open(&t).unwrap();
    let mut evs: Vec<KvEvent> = Vec::new();
    for c in trace.kv_chunks() {
        evs.extend(c.unwrap().events);
    }
    evs.sort_by_key(|e| (e.ts_ns, e.pool, e.seq));
    let _ = std::fs::remove_dir_all(t.join("kv"));
    write_batches(
        &t.join("kv").join("a.parquet"),
        &[kv_batch(&evs)],
        Compression::UNCOMPRESSED,
        5,
    );
    let run = |threads: &str| {
        kvtrail(["scope", s(&t), "--json", "--threads", threads])
            .run()
            .ok()
    };
    let one = run("1");
    assert!(one.contains("\"foreign_tokens\": 7"), "{one}");
    assert_eq!(one, run("3"));
    assert_eq!(one, run("2"));
}

#[test]
fn scope_on_seqs_out_of_order_says_the_same_on_every_thread_count() {
    // Parts that meet an error leave the file to one pass: scope's answer
    // (a report, or the error naming file, row and column) must not
    // depend on the threads.
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x6b76_7472_6169_6c02);
    let mut failed = 0;
    for case in 0..12 {
        let evs = rows(&mut rng, 40, [0, 20, 80][case % 3]);
        let trace = trace_of(&tmp.path().join(case.to_string()), &evs, 3);
        let run = |threads: &str| {
            let r = kvtrail(["scope", s(&trace.dir), "--json", "--threads", threads])
                .expect(&[0, 2])
                .run();
            // Less the line naming the backend and its threads.
            let err: Vec<&str> = r
                .stderr
                .lines()
                .filter(|l| !l.starts_with("kvtrail: replay backend"))
                .collect();
            (r.code, r.stdout.clone(), err.join("\n"))
        };
        let one = run("1");
        failed += (one.0 == 2) as usize;
        assert_eq!(one, run("3"), "case {case}");
        assert_eq!(one, run("2"), "case {case}");
    }
    assert!(failed > 0 && failed < 12, "{failed}");
}

#[test]
fn parts_of_a_file_past_one_batch_keep_many_holes_and_the_first_error() {
    // Over a reader's batch of 65,536 rows, small row groups, more holes
    // per pool than the 21 listed; then the same file with a seq repeated
    // at a seam and, later in the same batch of one pass, a seq past the
    // largest allowed: one pass stops at the later row's bad value (a
    // batch is checked before its rows are ordered), and so must the
    // parts (they leave the file to one pass).
    let tmp = tempfile::tempdir().unwrap();
    let n = 70_000u64;
    let evs: Vec<KvEvent> = (0..n)
        .map(|i| KvEvent {
            pool: (i % 2) as u16,
            // a hole every 500 rows of each pool
            seq: i / 2 + (i / 1000) * 3,
            ts_ns: 1,
            request_id: 1,
            op: Op::Write,
            slot_start: 0,
            slot_count: 2,
            token_pos: None,
            src: None,
        })
        .collect();
    let trace = trace_of(&tmp.path().join("clean"), &evs, 7_000);
    let path = &trace.kv_files[0];
    let whole = format!("{:?}", scan_file(&trace, path, |_| Ok(())).unwrap());
    assert!(whole.contains("holes_total: 69"), "{whole}");
    for parts in 2..=4 {
        let split = scan_file_split(&trace, path, parts, |_| Ok(())).unwrap();
        assert_eq!(whole, format!("{:?}", split.expect("no part error")));
    }
    let mut bad = evs.clone();
    // Row 35,000 starts the sixth row group (and the third of 4 parts):
    // repeat its pool's last seq there; row 49,010 (the fourth part) is
    // within one pass's first batch.
    bad[35_000].seq = bad[34_998].seq;
    bad[49_010].seq = u64::MAX;
    let trace = trace_of(&tmp.path().join("bad"), &bad, 7_000);
    let path = &trace.kv_files[0];
    let whole = scan_file(&trace, path, |_| Ok(())).unwrap_err().to_string();
    assert!(whole.contains("row 49010"), "{whole}");
    for parts in 2..=4 {
        match scan_file_split(&trace, path, parts, |_| Ok(())) {
            Ok(None) => {}
            Err(e) => assert_eq!(e.to_string(), whole),
            Ok(Some(r)) => panic!("{parts} parts read past a bad value: {r:?}"),
        }
    }
}
