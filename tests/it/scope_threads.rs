//! `scope --threads N`: the replay on every core gives the bytes of one
//! thread. Every output file of `scope --out` and the `--json` report are
//! compared between `--threads 1`, 2, 3 and the default (every core), on
//! the committed incident, the golden v1 trace, simulated multi-pool
//! traces (SGLang PD with HiCache tier copies out and back, vLLM), and
//! hand-made traces of pool groups no copy connects (each replayed on a
//! thread of its own) with copies both ways, tier copies, shares, scrubs,
//! stale content and holes, and one group of pools each on a thread of
//! its own, copies passing between the threads. A replay that fails names
//! the same row on every number of threads.

use std::path::{Path, PathBuf};

use kvtrail::trace::Role;

use crate::support::cli::{kvtrail, s};
use crate::support::sim::simulate;
use crate::support::trace_builder::{TraceBuilder, pool};

/// The files of a scope folder that carry findings (evidence.json names
/// the command line, which differs by `--threads`; report.html is
/// compared without it).
const FILES: &[&str] = &[
    "requests.csv",
    "timeline.json",
    "summary.json",
    "responses.csv",
    "tenants.csv",
    "findings.parquet",
    "findings.ocsf.jsonl",
    "timeline.jsonl",
    "report.html",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The bytes of an output file without the command line report.html
/// quotes (`with the command: <code>...</code>`).
fn without_command_line(bytes: Vec<u8>) -> Vec<u8> {
    let Ok(text) = String::from_utf8(bytes.clone()) else {
        return bytes;
    };
    let mark = "with the command:</p><p><code>";
    match text.find(mark) {
        Some(i) => {
            let rest = &text[i + mark.len()..];
            let end = rest.find("</code>").expect("the command's end");
            format!("{}{}", &text[..i], &rest[end..]).into_bytes()
        }
        None => bytes,
    }
}

/// Scope `trace` with each thread count (None: the default) and compares
/// every output with `--threads 1`.
fn same_bytes(trace: &Path) {
    let tmp = tempfile::tempdir().unwrap();
    let run = |threads: Option<&str>| {
        let out = tmp
            .path()
            .join(format!("out-{}", threads.unwrap_or("default")));
        let mut args = vec!["scope", s(trace), "--json", "--out", s(&out)];
        if let Some(n) = threads {
            args.extend(["--threads", n]);
        }
        let r = kvtrail(&args).run();
        let json = r.ok();
        let files: Vec<Vec<u8>> = FILES
            .iter()
            .map(|f| without_command_line(std::fs::read(out.join(f)).unwrap()))
            .collect();
        (json, files, r.stderr)
    };
    let (json1, files1, _) = run(Some("1"));
    for n in [Some("2"), Some("3"), None] {
        let (json, files, stderr) = run(n);
        assert!(
            json == json1,
            "--threads {n:?}: the JSON report differs on {}",
            trace.display()
        );
        for (i, f) in FILES.iter().enumerate() {
            assert!(
                files[i] == files1[i],
                "--threads {n:?}: {f} differs on {}",
                trace.display()
            );
        }
        if n == Some("3") {
            assert!(stderr.contains("on 3 threads"), "{stderr}");
        }
    }
}

/// Two pool groups no copy connects, and a third pool alone: a PD pair
/// with a hole, a device pool and its host tier copying both ways (stale
/// content offloaded and loaded back, a share of what came back, a scrub).
fn groups() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 3000),
        pool(1, Role::Decode, 3000),
        pool(2, Role::Decode, 4096),
        pool(3, Role::Cache, 4096),
        pool(4, Role::Mixed, 2048),
    ]);
    for (id, tenant) in [(1, "acme"), (2, "initech"), (3, "umbrella"), (4, "acme")] {
        tb.req(id, tenant);
    }
    // PD pair: prefill, copy across pages, a hole in decode, reads.
    tb.alloc(0, 1, 1000, 1500);
    let w = tb.write(0, 1, 1000, 1500);
    tb.alloc(1, 1, 0, 2000);
    tb.copy(1, 1, 100, 1500, 0, 1000, w);
    tb.read(1, 1, 100, 1600);
    tb.read(1, 2, 0, 1200); // foreign across pages, blank below
    tb.lose(1, 2);
    tb.read(1, 1, 900, 700); // uncertain after the hole
    // Device pool and its host tier: offload, rewrite, load back.
    tb.alloc(2, 3, 0, 1500);
    let d = tb.write(2, 3, 0, 1500);
    let off = tb.copy(3, 3, 2000, 1500, 2, 0, d);
    tb.alloc(2, 2, 0, 700); // 0..700 now stale for request 2
    tb.write(2, 2, 0, 300);
    let stale = tb.copy(3, 2, 0, 1000, 2, 0, tb.next_seq(2) - 1);
    tb.copy(2, 4, 1024, 1500, 3, 2000, off); // loaded back
    tb.share(2, 4, 1024, 600);
    tb.read(2, 4, 1024, 1500);
    tb.share(2, 1, 1024, 400); // another tenant's hit
    tb.read(2, 1, 1024, 400);
    tb.copy(2, 2, 3000, 1000, 3, 0, stale);
    tb.read(2, 2, 3000, 1000); // stale content of request 3 via the tier
    tb.scrub(3, 0, 1000);
    tb.read(3, 2, 0, 1100);
    // A pool alone: stale pages read after realloc.
    tb.write(4, 1, 0, 2048);
    tb.alloc(4, 2, 0, 1500);
    tb.read(4, 2, 0, 2048);
    tb.read(4, 4, 10, 5);
    tb
}

#[test]
fn threads_give_the_bytes_of_one_thread_on_hand_made_pool_groups() {
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    same_bytes(&t);
    let r = crate::support::trace_builder::scope(&t);
    assert!(!r.affected_responses.is_empty());
}

/// One group of three pools on threads of their own: a prefill pool
/// copying to a decode pool, which offloads to its host tier and loads
/// back, with copies whose source lies far ahead of or behind the
/// destination's position, a copy whose source seq fell in a hole, and a
/// late source (past the end of its stream).
fn one_group() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 8192),
        pool(1, Role::Decode, 8192),
        pool(2, Role::Cache, 8192),
    ]);
    for (id, tenant) in [(1, "acme"), (2, "initech"), (3, "umbrella"), (4, "acme")] {
        tb.req(id, tenant);
    }
    let mut prefilled = Vec::new();
    for r in 1..=4u64 {
        let start = (r as u32 - 1) * 1500;
        tb.alloc(0, r, start, 1500);
        prefilled.push((r, start, tb.write(0, r, start, 1500)));
    }
    // Prefill overwrites request 1's slots before decode copies them: the
    // copy must see the content as of its src_seq.
    tb.write(0, 2, 0, 700);
    tb.lose(0, 3);
    let lost_seq = tb.next_seq(0) - 2;
    for (r, start, seq) in prefilled {
        let d = (r as u32 - 1) * 2000;
        tb.alloc(1, r, d, 2000);
        tb.copy(1, r, d, 1500, 0, start, seq);
        tb.read(1, r, d, 1700); // own, then blank or stale above
    }
    tb.copy(1, 3, 7000, 100, 0, 0, lost_seq); // its source seq is in the hole
    tb.read(1, 3, 7000, 100);
    // Offload request 2's decode KV, reuse its slots, load it back for 4.
    let off = tb.copy(2, 2, 0, 1500, 1, 2000, tb.next_seq(1) - 1);
    tb.alloc(1, 4, 2000, 1500);
    tb.write(1, 4, 2000, 200);
    tb.copy(1, 4, 2000, 1500, 2, 0, off);
    tb.read(1, 4, 2000, 1500); // request 2's KV, tenant initech
    tb.share(1, 1, 2000, 300);
    tb.read(1, 1, 2000, 300);
    // A copy from past the prefill stream's end.
    let end = tb.next_seq(0) + 5;
    tb.copy(1, 2, 7500, 10, 0, 0, end);
    tb.read(1, 2, 7500, 10);
    tb
}

#[test]
fn threads_give_the_bytes_of_one_thread_on_one_group_of_pools_on_threads_of_their_own() {
    let tmp = tempfile::tempdir().unwrap();
    let t = one_group().record(&tmp.path().join("t"));
    same_bytes(&t);
    let r = crate::support::trace_builder::scope(&t);
    assert!(
        r.affected_responses
            .iter()
            .any(|a| a.request_id == 4 && a.sources.iter().any(|s| s.request_id == 2)),
        "{:?}",
        r.affected_responses
    );
}

#[test]
fn copies_that_wait_on_each_other_across_threads_fail_as_on_one_thread() {
    // Pool 0's next event copies pool 1 as of pool 1's next event, which
    // copies pool 0 as of this one: each pool's thread would wait for the
    // other's.
    let mut tb =
        TraceBuilder::with_pools(vec![pool(0, Role::Mixed, 4096), pool(1, Role::Cache, 4096)]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.write(0, 1, 0, 100);
    tb.write(1, 2, 0, 100);
    let (s0, s1) = (tb.next_seq(0), tb.next_seq(1));
    tb.copy(0, 1, 200, 50, 1, 0, s1);
    tb.copy(1, 2, 200, 50, 0, 0, s0);
    tb.read(0, 1, 0, 300);
    let tmp = tempfile::tempdir().unwrap();
    let t = tb.record(&tmp.path().join("t"));
    same_error(&t, &[], "wait on each other", &["2", "3", "4"]);
}

#[test]
fn threads_give_the_bytes_of_one_thread_on_many_small_groups() {
    // Twelve pools no copy connects, more than two threads take one group
    // each: they are packed into work units of several groups.
    let mut tb = TraceBuilder::with_pools((0..12).map(|p| pool(p, Role::Mixed, 4096)).collect());
    for (id, tenant) in [(1, "acme"), (2, "initech"), (3, "umbrella")] {
        tb.req(id, tenant);
    }
    for p in 0..12u16 {
        let (a, b) = (1 + u64::from(p) % 3, 1 + u64::from(p + 1) % 3);
        tb.write(p, a, 0, 100 + 200 * u32::from(p));
        tb.alloc(p, b, 50, 900);
        tb.read(p, b, 0, 1200 + 100 * u32::from(p));
        tb.write(p, b, 10, 20);
        tb.read(p, a, 0, 40);
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tb.record(&tmp.path().join("t"));
    same_bytes(&t);
    let r = crate::support::trace_builder::scope(&t);
    assert!(
        r.affected_responses.len() >= 3,
        "{:?}",
        r.affected_responses
    );
}

#[test]
fn threads_give_the_bytes_of_one_thread_on_committed_traces() {
    same_bytes(&repo().join("traces/incident-mini"));
    same_bytes(&repo().join("tests/data/golden-v1"));
}

#[test]
fn threads_give_the_bytes_of_one_thread_on_simulated_multi_pool_traces() {
    let hicache = simulate(
        "incident",
        Some(400),
        5,
        &[
            "decode_radix_cache=true",
            "hicache=true",
            "hicache_host_tokens=8192",
        ],
    );
    same_bytes(&hicache.trace);
    let vllm = simulate("vllm-stale-reference", Some(300), 3, &[]);
    same_bytes(&vllm.trace);
}

#[test]
fn a_failed_replay_names_the_same_row_on_every_number_of_threads() {
    // Both groups touch more pages than the limit allows: whichever group's
    // thread fails first, the error is the single scheduler's.
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    same_error(
        &t,
        &[("KVTRAIL_MAX_TOUCHED_SLOTS", "4096")],
        "KVTRAIL_MAX_TOUCHED_SLOTS",
        &["2", "3", "8"],
    );
}

/// `scope` fails (exit 2, `what` in the message) on `--threads 1` and on
/// each of `threads` with the same message (the backend line aside).
fn same_error(t: &Path, env: &[(&str, &str)], what: &str, threads: &[&str]) {
    let run = |n: &str| {
        let mut c = kvtrail(["scope", s(t), "--threads", n]);
        for (k, v) in env {
            c = c.env(k, v);
        }
        let r = c.run();
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stderr.contains(what), "{}", r.stderr);
        r.stderr
            .lines()
            .filter(|l| !l.contains("replay backend"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let one = run("1");
    for n in threads {
        assert_eq!(run(n), one, "--threads {n}");
    }
}

#[test]
fn threads_must_be_a_positive_number_up_to_1024() {
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    for bad in ["0", "many", "1025", "70000"] {
        let r = kvtrail(["scope", s(&t), "--threads", bad]).run();
        assert_eq!(r.code, 2, "--threads {bad}: {}", r.stderr);
        assert!(r.stderr.contains("--threads"), "{}", r.stderr);
    }
}

#[test]
fn a_huge_rayon_num_threads_is_capped_at_1024_threads() {
    // Without the cap, a million threads were asked of the system.
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    let one = kvtrail(["scope", s(&t), "--json", "--threads", "1"]).run();
    let many = kvtrail(["scope", s(&t), "--json"])
        .env("RAYON_NUM_THREADS", "1000000")
        .run();
    assert_eq!(many.code, one.code, "{}", many.stderr);
    assert!(many.stderr.contains("on 1024 threads"), "{}", many.stderr);
    assert_eq!(many.stdout, one.stdout);
}

/// Counts what the replay tells its reporter: the total it starts with
/// and the events it reports applied since (the last start).
#[derive(Default)]
struct Tally {
    phase: std::sync::Mutex<(String, u64, u64)>,
}

impl kvtrail::progress::Reporter for Tally {
    fn start(&self, what: &str, total: u64) {
        *self.phase.lock().unwrap() = (what.to_string(), total, 0);
    }
    fn advance(&self, n: u64) {
        self.phase.lock().unwrap().2 += n;
    }
}

/// Replays `t` with each thread count, pools on threads of their own or
/// not: the replay phase's reports add up to its total (the scheduler
/// reports in batches of events; the last batch of every scheduler, on
/// every thread, must be told too).
fn progress_totals(t: &Path) {
    let trace = kvtrail::trace::Trace::open(t).unwrap();
    for threads in [1, 2, 3] {
        for pool_threads in [Some(true), Some(false)] {
            let tally = Tally::default();
            let opts = kvtrail::lineage::LineageOptions {
                threads,
                pool_threads,
                ..Default::default()
            };
            kvtrail::lineage::run(&trace, &opts, &tally).unwrap();
            let (what, total, done) = tally.phase.lock().unwrap().clone();
            assert_eq!(what, "replay");
            assert!(total > 0);
            assert_eq!(done, total, "{threads} threads, {pool_threads:?}");
        }
    }
}

#[test]
fn the_replay_reports_every_event_on_every_number_of_threads() {
    let tmp = tempfile::tempdir().unwrap();
    progress_totals(&groups().record(&tmp.path().join("g")));
    progress_totals(&one_group().record(&tmp.path().join("o")));
    progress_totals(&repo().join("tests/data/golden-v1"));
}

#[test]
fn a_damaged_requests_table_fails_alike_on_every_number_of_threads() {
    // With threads to spare the requests table is read beside the replay:
    // its error is still the one a single thread meets, and a replay that
    // fails too reports the replay's error first, as on one thread.
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    let reqs: Vec<PathBuf> = std::fs::read_dir(t.join("requests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    assert!(!reqs.is_empty());
    for f in &reqs {
        let bytes = std::fs::read(f).unwrap();
        std::fs::write(f, &bytes[..bytes.len() - 40]).unwrap();
    }
    same_error(&t, &[], "requests", &["2", "3"]);
    same_error(
        &t,
        &[("KVTRAIL_MAX_TOUCHED_SLOTS", "4096")],
        "KVTRAIL_MAX_TOUCHED_SLOTS",
        &["2", "3"],
    );
}

#[test]
fn a_file_changed_during_the_replay_is_not_vouched_for() {
    // With threads to spare the file digests are checked beside the
    // replay: a kv file changed after its digest was taken (here, once
    // the replay is done with it) must show as modified, as when the
    // digests are taken after the replay.
    let tmp = tempfile::tempdir().unwrap();
    let t = groups().record(&tmp.path().join("t"));
    let trace = kvtrail::trace::Trace::open(&t).unwrap();
    let opts = kvtrail::lineage::LineageOptions {
        threads: 2,
        ..Default::default()
    };
    let kv = trace.kv_files[0].clone();
    let (_, report) =
        kvtrail::scope::replay_and_scope(&trace, 2, &kvtrail::progress::NoReporter, || {
            let outcome = kvtrail::lineage::run(&trace, &opts, &kvtrail::progress::NoReporter);
            // The requests pass and the digests of this small trace are
            // long done by now.
            std::thread::sleep(std::time::Duration::from_millis(800));
            let mut bytes = std::fs::read(&kv).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            std::fs::write(&kv, &bytes).unwrap();
            outcome
        })
        .unwrap();
    assert!(
        !report.coverage.files_modified.is_empty(),
        "{:?}",
        report.coverage
    );
    assert!(!report.coverage.complete);
}
