//! A capture that dies mid-way: every completed part file stays readable,
//! the trace is still inspectable, and it says it is incomplete.

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::trace::write::PartOptions;
use kvtrail::trace::{Manifest, Trace};

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace::*;

#[test]
fn killed_recorder_leaves_an_inspectable_incomplete_trace() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t");
    let opts = RecorderOptions {
        started_ns: Some(1_000),
        row_group_rows: 2,
        part: PartOptions {
            rotate_bytes: 1, // every row group completes a part file
            zstd_level: 1,
        },
        ..Default::default()
    };
    let mut rec = Recorder::create(&t, deployment(), opts).unwrap();
    let evs = events();
    for e in &evs {
        rec.kv_with_seq(*e).unwrap();
    }
    for r in requests() {
        rec.request(r).unwrap();
    }
    // The process dies: no close, no destructors, buffered rows are lost.
    std::mem::forget(rec);

    let m = Manifest::load(&t).unwrap();
    assert!(!m.capture.complete);
    let listed = m.files.as_ref().unwrap();
    // Rows in completed parts: everything but what was still buffered
    // (at most row_group_rows per stream).
    let rows: u64 = listed.iter().map(|f| f.rows).sum();
    let total = (evs.len() + requests().len()) as u64;
    assert!(
        rows >= total - 3 * 2 && rows < total + 1,
        "{rows} of {total}"
    );
    let trace = Trace::open(&t).unwrap();
    let read: usize = trace.kv_chunks().map(|c| c.unwrap().events.len()).sum();
    assert_eq!(read as u64 + requests().len() as u64, rows);

    let r = kvtrail(["inspect", s(&t)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("capture     INCOMPLETE"), "{}", r.stdout);
    let v = kvtrail(["verify", s(&t)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
    assert!(v.stdout.contains("unclean"), "{}", v.stdout);
}
