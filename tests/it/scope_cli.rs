//! `kvtrail scope` and `kvtrail demo` through the binary: the `--json`
//! shape of the issue, deterministic `--out` bytes, exit codes
//! (`--fail-on-exposure`, bad input = 2 with a clear message, no panic).

use std::path::Path;

use kvtrail::schema::{CopySrc, KvEvent, Op};
use kvtrail::trace::write::{kv_batch, write_single_file};

use crate::support::cli::{kvtrail, s};
use crate::support::trace_builder::TraceBuilder;

/// The issue's example: initech's request 4 reads 3 stale slots of acme's
/// request 1 in decode, and 2 blank slots.
fn example() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(4, "initech");
    let w = tb.write(0, 1, 0, 4);
    tb.copy(1, 1, 0, 4, 0, 0, w);
    tb.read(1, 1, 0, 4);
    tb.free(1, 1, 0, 4);
    let p = tb.write(0, 4, 8, 1);
    tb.alloc(1, 4, 0, 6);
    tb.copy(1, 4, 0, 1, 0, 8, p);
    tb.read(1, 4, 0, 6);
    tb
}

#[test]
fn json_has_the_issue_shape() {
    let dir = tempfile::tempdir().unwrap();
    let t = example().record(&dir.path().join("t"));
    let o = kvtrail(["scope", s(&t), "--json"]).run();
    assert_eq!(o.code, 0, "{}", o.stderr.as_str());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout_bytes).unwrap();
    let a = &v["affected_responses"][0];
    assert_eq!(a["request_id"], 4);
    assert_eq!(a["external_id"], "ext-4");
    assert_eq!(a["tenant"], "initech");
    assert_eq!(a["foreign_tokens"], 3);
    assert_eq!(a["cross_tenant"], true);
    assert_eq!(a["confidence"], "confirmed");
    assert_eq!(a["http_status"], 200);
    assert_eq!(a["output_hash"].as_str().unwrap().len(), 64);
    let src = &a["sources"][0];
    assert_eq!(
        (&src["request_id"], &src["tenant"], &src["tokens"]),
        (&1.into(), &"acme".into(), &3.into())
    );
    assert!(src["first_seq"].is_u64() && src["last_seq"].is_u64());
    let r = &v["recipients"][0];
    assert_eq!(
        (&r["tenant"], &r["responses"], &r["foreign_tokens"]),
        (&"initech".into(), &1.into(), &3.into())
    );
    let so = &v["sources"][0];
    assert_eq!(
        (&so["tenant"], &so["requests"], &so["tokens"]),
        (&"acme".into(), &1.into(), &3.into())
    );
    assert_eq!(v["blank_reads"], 2);
    assert_eq!(v["coverage"]["complete"], true);
    assert_eq!(v["coverage"]["gaps"], serde_json::json!([]));
}

#[test]
fn json_reports_gaps_with_seq_ranges() {
    let mut tb = example();
    tb.lose(1, 3);
    tb.read(1, 4, 0, 1);
    let dir = tempfile::tempdir().unwrap();
    let t = tb.record(&dir.path().join("t"));
    let o = kvtrail(["scope", s(&t), "--json"]).run();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout_bytes).unwrap();
    let last = tb
        .events
        .iter()
        .filter(|e| e.pool == 1)
        .map(|e| e.seq)
        .max()
        .unwrap();
    assert_eq!(v["coverage"]["complete"], false);
    assert_eq!(
        v["coverage"]["gaps"],
        serde_json::json!([{"pool": 1, "after_seq": last - 4, "before_seq": last}])
    );
}

#[test]
fn out_files_are_byte_identical_across_runs_and_locations() {
    let dir = tempfile::tempdir().unwrap();
    let t1 = example().record(&dir.path().join("a/t"));
    let t2 = example().record(&dir.path().join("b/other-name"));
    let (o1, o2) = (dir.path().join("o1"), dir.path().join("o2"));
    for (t, o) in [(&t1, &o1), (&t2, &o2)] {
        let r = kvtrail(["scope", s(t), "--out", s(o)]).run();
        assert_eq!(r.code, 0, "{}", r.stderr.as_str());
        assert!(r.stdout.as_str().contains("VERDICT"));
    }
    for f in [
        "responses.csv",
        "tenants.csv",
        "findings.parquet",
        "summary.json",
    ] {
        let (a, b) = (
            std::fs::read(o1.join(f)).unwrap(),
            std::fs::read(o2.join(f)).unwrap(),
        );
        assert!(!a.is_empty(), "{f}");
        assert_eq!(a, b, "{f} differs between runs");
    }
    let csv = std::fs::read_to_string(o1.join("responses.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    assert!(csv.lines().nth(1).unwrap().starts_with("4,ext-4,initech,"));
    let tenants = std::fs::read_to_string(o1.join("tenants.csv")).unwrap();
    assert!(
        tenants.contains("\nrecipient,initech,1,1,3,\n"),
        "{tenants}"
    );
    assert!(tenants.contains("\nsource,acme,1,1,3,3\n"), "{tenants}");
    let j1 = kvtrail(["scope", s(&t1), "--json"]).run().stdout_bytes;
    let j2 = kvtrail(["scope", s(&t2), "--json"]).run().stdout_bytes;
    assert_eq!(j1, j2);
    assert_eq!(j1, std::fs::read(o1.join("summary.json")).unwrap());
}

#[test]
fn fail_on_exposure_sets_the_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let exposed = example().record(&dir.path().join("x"));
    let mut clean = TraceBuilder::pd();
    clean.req(1, "acme");
    clean.write(0, 1, 0, 2);
    clean.read(0, 1, 0, 2);
    let clean = clean.record(&dir.path().join("c"));
    let cases = [(&exposed, true, 1), (&exposed, false, 0), (&clean, true, 0)];
    for (t, flag, want) in cases {
        let mut args = vec!["scope", s(t)];
        if flag {
            args.push("--fail-on-exposure");
        }
        let o = kvtrail(&args).run();
        assert_eq!(o.code, want, "{args:?}");
    }
    let o = kvtrail(["scope", s(&clean)]).run();
    let text = o.stdout.as_str();
    assert!(
        text.contains("no exposure found; the evidence is complete"),
        "{text}"
    );
}

fn ev(pool: u16, seq: u64, op: Op, rid: u64) -> KvEvent {
    KvEvent {
        pool,
        seq,
        ts_ns: 1,
        request_id: rid,
        op,
        slot_start: 0,
        slot_count: 2,
        token_pos: None,
        src: None,
    }
}

/// Writes a hand-made trace: manifest of `TraceBuilder::pd()`, kv files as given.
fn hand(dir: &Path, files: &[(&str, Vec<KvEvent>)]) -> std::path::PathBuf {
    let tb = TraceBuilder::pd();
    let t = tb.by_hand(dir, 1, 1, false);
    for (name, evs) in files {
        write_single_file(&t.join("kv").join(name), &[kv_batch(evs)]).unwrap();
    }
    t
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dup = hand(
        &d.join("dup"),
        &[
            (
                "a.parquet",
                vec![ev(0, 0, Op::Write, 1), ev(0, 1, Op::Read, 1)],
            ),
            ("b.parquet", vec![ev(0, 1, Op::Read, 2)]),
        ],
    );
    let mut c1 = ev(1, 0, Op::Write, 1);
    c1.src = Some(CopySrc {
        pool: 0,
        slot_start: 0,
        seq: 0,
    });
    let mut c0 = ev(0, 0, Op::Write, 1);
    c0.src = Some(CopySrc {
        pool: 1,
        slot_start: 0,
        seq: 0,
    });
    // Each copy reads the other pool as of the other copy itself: no order
    // applies both (copies both ways are fine only when causal).
    let cycle = hand(
        &d.join("cycle"),
        &[("a.parquet", vec![c1]), ("b.parquet", vec![c0])],
    );
    let corrupt = hand(
        &d.join("corrupt"),
        &[("a.parquet", vec![ev(0, 0, Op::Write, 1)])],
    );
    let f = corrupt.join("kv/a.parquet");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let mut far = ev(0, 0, Op::Write, 1);
    far.slot_start = 63;
    let outside = hand(&d.join("outside"), &[("a.parquet", vec![far])]);
    let nope = d.join("nope");
    let cases: Vec<(&Path, &[&str])> = vec![
        (
            &dup,
            &[
                "pool 0 has two events with seq 1",
                "a.parquet row 1",
                "b.parquet row 0",
            ],
        ),
        (
            &cycle,
            &["wait on each other", "a.parquet row 0", "b.parquet, row 0"],
        ),
        (&corrupt, &["a.parquet", "cannot read Parquet"]),
        (
            &outside,
            &["a.parquet, row 0, column `slot_start`", "outside pool 0"],
        ),
        (d, &["trace.json is missing"]),
        (&nope, &["not a trace directory"]),
    ];
    for (t, needles) in cases {
        let o = kvtrail(["scope", s(t), "--json"]).run();
        let err = o.stderr.as_str();
        assert_eq!(o.code, 2, "{}: {err}", t.display());
        assert!(!err.contains("panicked"), "{err}");
        for n in needles {
            assert!(err.contains(n), "{}: expected {n:?} in {err}", t.display());
        }
        assert!(o.stdout.is_empty());
    }
}

#[test]
fn unsorted_files_are_sorted_externally_with_the_same_result() {
    let tb = example();
    let dir = tempfile::tempdir().unwrap();
    let a = tb.record(&dir.path().join("rec"));
    // one file, rows reversed: forces the external sort
    let mut evs = tb.events.clone();
    evs.reverse();
    let b = hand(&dir.path().join("rev"), &[("all.parquet", evs)]);
    std::fs::remove_dir_all(b.join("requests")).ok();
    let reqs = kvtrail::trace::write::requests_batch(&tb.requests);
    write_single_file(&b.join("requests/r.parquet"), &[reqs]).unwrap();
    let ja: serde_json::Value =
        serde_json::from_slice(&kvtrail(["scope", s(&a), "--json"]).run().stdout_bytes).unwrap();
    let jb: serde_json::Value =
        serde_json::from_slice(&kvtrail(["scope", s(&b), "--json"]).run().stdout_bytes).unwrap();
    assert_eq!(ja["affected_responses"], jb["affected_responses"]);
    assert!(jb["counts"]["spilled_events"].as_u64().unwrap() > 0);
    assert_eq!(ja["counts"]["spilled_events"], 0);
}

#[test]
fn demo_runs_the_builtin_trace_and_simulates_it_when_absent() {
    let builtin = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/incident-mini");
    let cwd = tempfile::tempdir().unwrap();
    let o = kvtrail(["demo"]).cwd(cwd.path()).run();
    let err = o.stderr.as_str();
    assert_eq!(o.code, 0, "{err}");
    let shipped = o.stdout.as_str().to_string();
    assert!(shipped.contains("VERDICT"), "{shipped}");

    // Without the built-in trace, demo simulates the same trace (same
    // scenario, size and seed) into the cache and reports the same.
    let cache = tempfile::tempdir().unwrap();
    let o = kvtrail(["demo"])
        .env("KVTRAIL_DEMO_SIMULATE", "1")
        .env("KVTRAIL_CACHE", cache.path())
        .cwd(cwd.path())
        .run();
    let err = o.stderr.as_str();
    assert_eq!(o.code, 0, "{err}");
    assert!(err.contains("simulating it"), "{err}");
    assert_eq!(o.stdout.as_str(), shipped);
    let sim = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("trace.json").is_file())
        .expect("a simulated trace in the cache");
    for f in [
        "trace.json",
        "requests/part-00000.parquet",
        "kv/pool=0/part-00000.parquet",
    ] {
        assert_eq!(
            std::fs::read(sim.join(f)).unwrap(),
            std::fs::read(builtin.join(f)).unwrap(),
            "{f} differs from the shipped trace"
        );
    }
}

/// Every "1 <plural noun>" a scope run writes for people: the verdict
/// (summary.json, the human summary) and report.html, on a trace with one
/// pool-pair, one affected response, one source request, one lost event
/// and one coverage note.
fn singular_plural_slips(text: &str) -> Vec<String> {
    const NOUNS: &[&str] = &[
        "responses",
        "requests",
        "pools",
        "slots",
        "events",
        "tokens",
        "files",
        "customers",
        "gaps",
        "coverage notes",
        "lines",
        "breaches",
        "source requests",
        "other customers",
    ];
    let mut bad = Vec::new();
    for n in NOUNS {
        for pre in [" ", ">", "(", "\n", "\""] {
            let needle = format!("{pre}1 {n}");
            if text.contains(&needle) {
                bad.push(needle.trim().to_string());
            }
        }
        if text.starts_with(&format!("1 {n}")) {
            bad.push(format!("1 {n}"));
        }
    }
    bad
}

#[test]
fn plural_one_response_affected_is_singular_everywhere() {
    // One affected response (initech's request 2 reads 1 slot of acme's
    // request 1); one event lost in pool 1 after it, so the evidence has
    // one hole and one coverage note.
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.write(0, 1, 0, 1);
    tb.read(0, 2, 0, 1);
    tb.write(1, 2, 0, 1);
    tb.lose(1, 1);
    tb.write(1, 2, 1, 1);
    let dir = tempfile::tempdir().unwrap();
    let t = tb.record(&dir.path().join("t"));
    let out = dir.path().join("out");
    let o = kvtrail(["scope", s(&t), "--out", s(&out)]).run();
    assert_eq!(o.code, 0, "{}", o.stderr.as_str());
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let verdict = v["verdict"].as_str().unwrap();
    assert!(
        verdict.starts_with("1 response affected"),
        "verdict: {verdict}"
    );
    assert_eq!(
        singular_plural_slips(verdict),
        Vec::<String>::new(),
        "{verdict}"
    );
    for n in v["coverage"]["notes"].as_array().unwrap() {
        let n = n.as_str().unwrap();
        assert_eq!(singular_plural_slips(n), Vec::<String>::new(), "{n}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert_eq!(singular_plural_slips(&html), Vec::<String>::new());
    let human = kvtrail(["scope", s(&t)]).run();
    let text = human.stdout.as_str();
    assert!(text.contains("1 response affected"), "{text}");
    assert_eq!(singular_plural_slips(text), Vec::<String>::new(), "{text}");
}
