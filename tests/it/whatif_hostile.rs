//! What-if replay, simulate and diff on hostile input: prompts far above
//! any context window, timing knobs that would overflow the simulated
//! clock, and diffs of traces that do not hold the same workload.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::RequestRecord;
use kvtrail::trace::write::PartOptions;

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace;

/// Writes the small test trace with `edit` applied to its requests.
fn trace_with(dir: &Path, name: &str, edit: impl Fn(&mut Vec<RequestRecord>)) -> PathBuf {
    let t = dir.join(name);
    let opts = RecorderOptions {
        started_ns: Some(1_000),
        row_group_rows: 1 << 16,
        part: PartOptions::default(),
        ..Default::default()
    };
    let mut rec = Recorder::create(&t, small_trace::deployment(), opts).unwrap();
    for e in small_trace::events() {
        rec.kv_with_seq(e).unwrap();
    }
    let mut reqs = small_trace::requests();
    edit(&mut reqs);
    for r in reqs {
        rec.request(r).unwrap();
    }
    rec.close().unwrap();
    t
}

#[test]
fn replay_of_prompts_far_above_the_context_window_is_not_linear_in_prompt_tokens() {
    let dir = tempfile::tempdir().unwrap();
    // Three rows of 2^32-1 tokens, no recorded prompt_hash: the old
    // replay hashed every synthetic prompt token (about 38 s a row in a
    // release build).
    let t = trace_with(dir.path(), "huge", |reqs| {
        for r in reqs.iter_mut().take(3) {
            r.prompt_tokens = u32::MAX;
            r.prompt_hash = None;
        }
    });
    let out = dir.path().join("replayed");
    let started = Instant::now();
    let (code, _, err) = kvtrail([
        "replay",
        s(&t),
        "--engine",
        "sglang-0.5.19",
        "--out",
        s(&out),
    ])
    .run()
    .into_parts();
    let took = started.elapsed();
    assert_eq!(code, 0, "{err}");
    assert!(
        took < Duration::from_secs(10),
        "replay of three over-long prompts took {took:?}"
    );
    // The over-long requests are rejected at the front end (400), with a
    // prompt_hash each, distinct per request.
    let new = kvtrail::trace::Trace::open(&out).unwrap();
    let mut hashes = Vec::new();
    for b in new.requests() {
        for r in b.unwrap() {
            if r.prompt_tokens == u32::MAX {
                assert_eq!(r.http_status, 400, "request {}", r.request_id);
                hashes.push(r.prompt_hash.expect("prompt_hash"));
            }
        }
    }
    assert_eq!(hashes.len(), 3);
    hashes.sort();
    hashes.dedup();
    assert_eq!(hashes.len(), 3, "each long prompt keeps its own hash");
}

#[test]
fn simulate_set_timing_values_that_overflow_the_clock_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (set, key, max) in [
        (
            "timing.straggler_delay_ms=9223372036854",
            "timing.straggler_delay_ms",
            "86400000",
        ),
        (
            "timing.prefill_base_us=18446744073709551615",
            "timing.prefill_base_us",
            "3600000000",
        ),
        (
            "waiting_timeout_ms=18446744073709551615",
            "waiting_timeout_ms",
            "86400000",
        ),
        (
            "timing.prefill_ns_per_token=18446744073709551615",
            "timing.prefill_ns_per_token",
            "1000000000",
        ),
        (
            "abort_ack_ms=18446744073709551615",
            "abort_ack_ms",
            "86400000",
        ),
    ] {
        let out = dir.path().join("o");
        let (code, _, err) = kvtrail([
            "simulate",
            "--scenario",
            "incident",
            "--requests",
            "5",
            "--out",
            s(&out),
            "--set",
            "timing.straggler_ppm=1000000",
            "--set",
            set,
        ])
        .run()
        .into_parts();
        assert_eq!(code, 2, "--set {set}: {err}");
        assert!(err.contains(key) && err.contains(max), "--set {set}: {err}");
        assert!(err.contains("hint:"), "{err}");
        assert!(!out.exists(), "--set {set} left a trace behind");
    }
}

#[test]
fn simulate_with_the_largest_timing_values_keeps_the_clock_moving_forward() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o");
    let (code, _, err) = kvtrail([
        "simulate",
        "--scenario",
        "incident",
        "--requests",
        "5",
        "--out",
        s(&out),
        "--set",
        "timing.straggler_ppm=1000000",
        "--set",
        "timing.straggler_delay_ms=86400000",
        "--set",
        "timing.prefill_base_us=3600000000",
        "--set",
        "timing.prefill_ns_per_token=1000000000",
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{err}");
    let t = kvtrail::trace::Trace::open(&out).unwrap();
    for b in t.requests() {
        for r in b.unwrap() {
            let f = r.finish_ns.unwrap();
            assert!(
                f >= r.arrival_ns,
                "request {} ends before it starts",
                r.request_id
            );
        }
    }
}

#[test]
fn diff_of_unrelated_traces_is_refused_naming_the_first_mismatching_request() {
    let dir = tempfile::tempdir().unwrap();
    let a = trace_with(dir.path(), "a", |_| {});
    for (name, column) in [
        ("tenant", "tenant"),
        ("prompt", "prompt_tokens"),
        ("hash", "prompt_hash"),
        ("arrival", "arrival_ns"),
    ] {
        let b = trace_with(dir.path(), name, |reqs| {
            for r in reqs.iter_mut() {
                r.prompt_hash = Some([1; 32]);
            }
            let r = &mut reqs[1];
            match name {
                "tenant" => r.tenant = "tenant-0009".into(),
                "prompt" => r.prompt_tokens += 1,
                "hash" => r.prompt_hash = Some([2; 32]),
                _ => r.arrival_ns += 5,
            }
        });
        // Before: `a` has no prompt_hash, so give it the same hashes.
        let base = trace_with(dir.path(), &format!("base-{name}"), |reqs| {
            for r in reqs.iter_mut() {
                r.prompt_hash = Some([1; 32]);
            }
        });
        let (code, out, err) = kvtrail(["diff", s(&base), s(&b)]).run().into_parts();
        assert_eq!(code, 2, "{name}: {out}{err}");
        assert!(
            err.contains("request_id 2") && err.contains(column) && err.contains("hint:"),
            "{name}: {err}"
        );
    }
    // The same workload still diffs (a trace against itself).
    let (code, _, err) = kvtrail(["diff", s(&a), s(&a)]).run().into_parts();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn diff_accepts_a_replay_of_a_trace_with_its_own_clock_origin() {
    let dir = tempfile::tempdir().unwrap();
    let a = trace_with(dir.path(), "a", |_| {});
    let out = dir.path().join("replayed");
    let (code, _, err) = kvtrail([
        "replay",
        s(&a),
        "--engine",
        "sglang-0.5.19",
        "--out",
        s(&out),
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = kvtrail(["diff", s(&a), s(&out)]).run().into_parts();
    assert_eq!(code, 0, "{err}");
}
