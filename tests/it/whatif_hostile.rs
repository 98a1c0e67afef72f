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

// ---- issue 32: diff and replay --------------------------------------

use crate::support::trace_builder::TraceBuilder;
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::whatif::diff::{DiffReport, diff};

/// acme (1) and initech (3) write and free their decode slots (0..8 and
/// 8..16); globex (2) then allocates `r2_slots` and reads them: stale KV
/// of whoever held them. With `r2 = false`, request 2 is not in the trace.
fn three_tenants(r2_slots: Option<u32>, hole_before_r2: bool) -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(3, "initech");
    tb.alloc(1, 1, 0, 8);
    tb.write(1, 1, 0, 8);
    tb.read(1, 1, 0, 8);
    tb.free(1, 1, 0, 8);
    tb.alloc(1, 3, 8, 8);
    tb.write(1, 3, 8, 8);
    tb.read(1, 3, 8, 8);
    tb.free(1, 3, 8, 8);
    if hole_before_r2 {
        tb.lose(1, 1);
    }
    if let Some(s) = r2_slots {
        tb.req(2, "globex");
        tb.alloc(1, 2, s, 8);
        tb.read(1, 2, s, 8);
        tb.free(1, 2, s, 8);
    }
    tb
}

fn diff_dirs(a: &Path, b: &Path) -> DiffReport {
    diff(
        &kvtrail::trace::Trace::open(a).unwrap(),
        &kvtrail::trace::Trace::open(b).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap()
}

#[test]
fn defect9_diff_sees_whose_kv_a_request_read_change() {
    let dir = tempfile::tempdir().unwrap();
    let a = three_tenants(Some(0), false).record(&dir.path().join("a"));
    // Variants: another source tenant on other slots (the same foreign
    // token count), and the same source read after a hole (another
    // confidence).
    for (name, tb) in [
        ("other-source", three_tenants(Some(8), false)),
        ("after-hole", three_tenants(Some(0), true)),
    ] {
        let b = tb.record(&dir.path().join(name));
        let d = diff_dirs(&a, &b);
        let c = d
            .changed
            .iter()
            .find(|c| c.request_id == 2)
            .unwrap_or_else(|| panic!("{name}: request 2 unchanged: {}", d.headline));
        assert!(
            c.what.iter().any(|w| w.starts_with("foreign_reads")),
            "{name}: {:?}",
            c.what
        );
        assert_eq!(d.unchanged, 2, "{name}: {}", d.headline);
        assert!(
            d.headline.contains("2 of 3 requests unchanged"),
            "{}",
            d.headline
        );
        let (code, out, err) = kvtrail(["diff", s(&a), s(&b), "--json"]).run().into_parts();
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["changed"][0]["request_id"], 2, "{name}");
    }
    // The same reads in both: unchanged.
    let same = three_tenants(Some(0), false).record(&dir.path().join("same"));
    let d = diff_dirs(&a, &same);
    assert!(d.changed.is_empty(), "{:?}", d.changed);
}

#[test]
fn defect10_diff_does_not_call_a_missing_request_an_exposure_gone() {
    let dir = tempfile::tempdir().unwrap();
    let a = three_tenants(Some(0), false).record(&dir.path().join("a"));
    let b = three_tenants(None, false).record(&dir.path().join("b"));
    for (first, second, side) in [(&a, &b, "after"), (&b, &a, "before")] {
        let (code, out, err) = kvtrail(["diff", s(first), s(second), "--json"])
            .run()
            .into_parts();
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let headline = v["headline"].as_str().unwrap();
        assert!(headline.contains("NOT COMPARED"), "{headline}");
        assert!(headline.contains("(1 affected there)"), "{headline}");
        let note = v["exposure"][side]["comparison_note"]
            .as_str()
            .unwrap_or("");
        assert!(note.contains("cannot speak"), "{side}: {}", v["exposure"]);
        // The human report says it in the exposure block, next to the
        // verdict that would otherwise read as a clean bill.
        let (_, human, _) = kvtrail(["diff", s(first), s(second)]).run().into_parts();
        let block: String = human
            .lines()
            .skip_while(|l| !l.starts_with("exposure (scope"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(block.contains("cannot speak"), "{human}");
    }
}

#[test]
fn defect10_replay_compare_names_a_finding_without_a_request_row() {
    // Request 2's events are recorded but its row is not: scope finds it
    // affected (tenant unknown); the replay cannot re-run it.
    let dir = tempfile::tempdir().unwrap();
    let mut tb = three_tenants(Some(0), false);
    tb.requests.retain(|r| r.request_id != 2);
    let a = tb.record(&dir.path().join("a"));
    let out = dir.path().join("replayed");
    let (code, json, err) = kvtrail([
        "replay",
        s(&a),
        "--engine",
        "sglang-0.5.22",
        "--out",
        s(&out),
        "--compare",
        "--json",
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let headline = v["headline"].as_str().unwrap();
    assert!(headline.contains("NOT COMPARED"), "{headline}");
    assert_eq!(v["only_before"], serde_json::json!([2]), "{v}");
    assert!(v["exposure"]["after"]["comparison_note"].is_string(), "{v}");
}

#[test]
fn small_replay_of_an_incomplete_trace_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let sim = crate::support::sim::simulate("steady", Some(60), 1, &[]);
    // Remove one prefill kv file that trace.json lists.
    let kv0 = sim.trace.join("kv").join("pool=0");
    let victim = std::fs::read_dir(&kv0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "parquet"))
        .expect("a prefill kv file");
    std::fs::remove_file(&victim).unwrap();
    let out = dir.path().join("r");
    let (code, _, err) = kvtrail(["replay", s(&sim.trace), "--out", s(&out)])
        .run()
        .into_parts();
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("INCOMPLETE"), "{err}");
    assert!(err.contains("prefix groups"), "{err}");
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn small_replay_does_not_report_inferred_outputs_it_did_not_infer() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace_with(dir.path(), "t", |reqs| {
        for r in reqs.iter_mut() {
            r.http_status = 200;
            r.output_tokens = u32::MAX;
        }
    });
    let out = dir.path().join("r");
    let (code, _, err) = kvtrail([
        "replay",
        s(&t),
        "--engine",
        "sglang-0.5.22",
        "--out",
        s(&out),
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("0 requests without"), "{err}");
    assert!(!err.contains("4294967295"), "{err}");
    // One request without an output length: singular, and said.
    let t = trace_with(dir.path(), "t1", |reqs| {
        for r in reqs.iter_mut() {
            r.http_status = 200;
        }
        reqs[0].http_status = 500;
    });
    let out = dir.path().join("r1");
    let (code, _, err) = kvtrail([
        "replay",
        s(&t),
        "--engine",
        "sglang-0.5.22",
        "--out",
        s(&out),
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("1 request without a recorded output length"),
        "{err}"
    );
}

#[test]
fn small_replay_blames_recorded_arrivals_not_the_timing_keys() {
    let dir = tempfile::tempdir().unwrap();
    for (name, first, last) in [
        ("max", -1_000_000_000_000_000_000, i64::MAX),
        ("far", 1_000, 8_000_000_000_000_000_000),
    ] {
        let t = trace_with(dir.path(), name, |reqs| {
            reqs[0].arrival_ns = first;
            reqs[3].arrival_ns = last;
            reqs[3].finish_ns = Some(last);
        });
        let out = dir.path().join(format!("{name}-r"));
        let (code, _, err) = kvtrail([
            "replay",
            s(&t),
            "--engine",
            "sglang-0.5.22",
            "--out",
            s(&out),
        ])
        .run()
        .into_parts();
        assert_eq!(code, 2, "{name}: {err}");
        assert!(err.contains("arrival_ns"), "{name}: {err}");
        assert!(err.contains("request_id 4"), "{name}: {err}");
        assert!(!err.contains("lower the timing keys"), "{name}: {err}");
    }
}

#[test]
fn small_diff_and_audit_agree_in_number() {
    let dir = tempfile::tempdir().unwrap();
    let a = three_tenants(Some(0), false).record(&dir.path().join("a"));
    let d = diff_dirs(&a, &a);
    assert!(
        d.headline.starts_with("exposure: 1 affected response ("),
        "{}",
        d.headline
    );
}
