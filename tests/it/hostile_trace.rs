//! Hostile trace folders, through the real binary, each command under a
//! time limit (a regression that blocks fails the test instead of hanging
//! the suite): files that are not regular (FIFOs), links out of the trace,
//! an oversized trace.json, and traces on which `verify`, `inspect` and
//! `scope` must give one verdict (verify lists the problem and exits 1;
//! inspect and scope exit 2; all three name the file, row and column).
//!
//! `KVTRAIL_TEST_BIN=path` runs the cases against another kvtrail build
//! (an older release, to see a case fail there).
//!
//! Index:
//! - non-regular files and links: `fifo_*`, `*_linked_*`
//! - trace.json size: `huge_trace_json_*`, `deeply_nested_trace_json_*`
//! - one verdict: `*_gets_one_verdict`, through `Verdicts`

use std::path::{Path, PathBuf};
use std::time::Duration;

use arrow_array::{ArrayRef, Int64Array, StringArray, UInt16Array, UInt32Array, UInt64Array};
use kvtrail::schema::KvEvent;
use parquet::basic::Compression;

use crate::support::cli::{Ran, kvtrail, s};
use crate::support::reseal::{reseal_trace, reseal_trace_digests};
use crate::support::small_trace::{
    self, arr, deployment, events, kv_cols, write_batches, write_parquet, write_trace,
};

const POOL0: &str = "kv/pool=0/part-00000.parquet";
const POOL1: &str = "kv/pool=1/part-00000.parquet";
const REQS: &str = "requests/part-00000.parquet";

/// Longest a command may take on these tiny traces.
const LIMIT: Duration = Duration::from_secs(30);

/// Runs kvtrail with `args` (the build `KVTRAIL_TEST_BIN` names, when set),
/// killing it after [`LIMIT`] (then the test fails: a command must never
/// block).
fn run(args: &[&str]) -> Ran {
    let r = kvtrail(args)
        .bin_from_env("KVTRAIL_TEST_BIN")
        .timeout(LIMIT)
        .run();
    assert!(
        !r.timed_out,
        "kvtrail {args:?} did not finish within {LIMIT:?} (blocked?)\nstderr so far:\n{}",
        r.stderr
    );
    r
}

fn fresh() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    (d, t)
}

#[cfg(unix)]
fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

/// The three verdicts on one trace.
struct Verdicts {
    verify: Ran,
    inspect: Ran,
    scope: Ran,
}

impl Verdicts {
    fn of(t: &Path) -> Verdicts {
        Verdicts {
            verify: run(&["verify", s(t)]),
            inspect: run(&["inspect", s(t)]),
            scope: run(&["scope", "--backend", "cpu", s(t)]),
        }
    }

    fn show(&self) -> String {
        format!(
            "verify {}:\n{}{}\ninspect {}:\n{}\nscope {}:\n{}",
            self.verify.code,
            self.verify.stdout,
            self.verify.stderr,
            self.inspect.code,
            self.inspect.stderr,
            self.scope.code,
            self.scope.stderr
        )
    }

    /// The trace is bad input for all three: verify fails it (1) listing
    /// the problem, inspect and scope refuse it (2); each names every
    /// fragment, says what to do and never panics.
    fn refused(&self, fragments: &[&str]) {
        let all = self.show();
        assert_eq!(
            (self.verify.code, self.inspect.code, self.scope.code),
            (1, 2, 2),
            "verdicts (verify, inspect, scope):\n{all}"
        );
        for f in fragments {
            assert!(self.verify.stdout.contains(f), "verify lacks {f:?}:\n{all}");
            assert!(
                self.inspect.stderr.contains(f),
                "inspect lacks {f:?}:\n{all}"
            );
            assert!(self.scope.stderr.contains(f), "scope lacks {f:?}:\n{all}");
        }
        for o in [&self.inspect, &self.scope] {
            assert!(o.stderr.contains("hint:"), "no hint:\n{all}");
        }
        assert!(!all.contains("panicked"), "{all}");
    }

    /// The trace is fine for all three.
    fn accepted(&self) {
        assert_eq!(
            (self.verify.code, self.inspect.code, self.scope.code),
            (0, 0, 0),
            "verdicts (verify, inspect, scope):\n{}",
            self.show()
        );
    }
}

// ---------------------------------------------------------------------------
// Files that are not regular, links out of the trace

#[cfg(unix)]
#[test]
fn fifo_named_parquet_is_refused_not_read() {
    let (_d, t) = fresh();
    mkfifo(&t.join("kv/pool=0/x.parquet"));
    Verdicts::of(&t).refused(&["kv/pool=0/x.parquet", "FIFO"]);
}

#[cfg(unix)]
#[test]
fn fifo_in_place_of_a_listed_data_file_is_refused_not_read() {
    let (_d, t) = fresh();
    std::fs::remove_file(t.join(POOL0)).unwrap();
    mkfifo(&t.join(POOL0));
    Verdicts::of(&t).refused(&[POOL0, "FIFO"]);
}

#[cfg(unix)]
#[test]
fn fifo_trace_json_is_refused_not_read() {
    let (_d, t) = fresh();
    std::fs::remove_file(t.join("trace.json")).unwrap();
    mkfifo(&t.join("trace.json"));
    for cmd in ["verify", "inspect", "scope"] {
        let r = run(&[cmd, s(&t)]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(
            r.stderr.contains("trace.json") && r.stderr.contains("FIFO"),
            "{cmd}: {}",
            r.stderr
        );
    }
}

#[cfg(unix)]
#[test]
fn fifo_given_as_the_trace_folder_is_refused_not_read() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("trace");
    mkfifo(&f);
    for cmd in ["verify", "inspect", "scope"] {
        let r = run(&[cmd, s(&f)]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(
            r.stderr.contains("not a trace directory"),
            "{cmd}: {}",
            r.stderr
        );
    }
}

/// Moves `rel` of trace `t` to a folder outside it and links it back.
#[cfg(unix)]
fn link_out(t: &Path, rel: &str, outside: &Path) {
    let target = outside.join(rel.replace('/', "_"));
    std::fs::rename(t.join(rel), &target).unwrap();
    std::os::unix::fs::symlink(&target, t.join(rel)).unwrap();
}

#[cfg(unix)]
#[test]
fn kv_folder_linked_outside_the_trace_is_not_walked() {
    let (d, t) = fresh();
    let outside = d.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    link_out(&t, "kv", &outside);
    Verdicts::of(&t).refused(&["kv", "outside the trace folder"]);
}

#[cfg(unix)]
#[test]
fn listed_data_file_linked_outside_the_trace_is_not_read_or_hashed() {
    let (d, t) = fresh();
    let outside = d.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    // Same bytes: its digest matches trace.json, yet it is not the trace's.
    link_out(&t, POOL0, &outside);
    let v = Verdicts::of(&t);
    v.refused(&[POOL0, "outside the trace folder"]);
    assert!(!v.verify.stdout.contains("OK:"), "{}", v.verify.stdout);
}

#[cfg(unix)]
#[test]
fn trace_json_linked_outside_the_trace_is_refused() {
    let (d, t) = fresh();
    let outside = d.path().join("elsewhere");
    std::fs::create_dir(&outside).unwrap();
    link_out(&t, "trace.json", &outside);
    for cmd in ["verify", "inspect", "scope"] {
        let r = run(&[cmd, s(&t)]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(
            r.stderr.contains("trace.json") && r.stderr.contains("outside the trace folder"),
            "{cmd}: {}",
            r.stderr
        );
    }
}

/// Links that stay inside the trace are read like the files themselves.
#[cfg(unix)]
#[test]
fn data_file_linked_inside_the_trace_is_read() {
    let (_d, t) = fresh();
    std::fs::create_dir(t.join("blobs")).unwrap();
    std::fs::rename(t.join(POOL0), t.join("blobs/p0.parquet")).unwrap();
    std::os::unix::fs::symlink("../../blobs/p0.parquet", t.join(POOL0)).unwrap();
    Verdicts::of(&t).accepted();
}

#[cfg(unix)]
#[test]
fn folder_link_loop_inside_the_trace_is_refused() {
    let (_d, t) = fresh();
    std::os::unix::fs::symlink("..", t.join("kv/pool=0/up")).unwrap();
    Verdicts::of(&t).refused(&["kv/pool=0/up", "already read"]);
}

// ---------------------------------------------------------------------------
// trace.json size and shape

#[test]
fn huge_trace_json_is_refused_before_parsing() {
    let (_d, t) = fresh();
    let p = t.join("trace.json");
    let text = std::fs::read_to_string(&p).unwrap();
    // An unknown key (kept, not ignored) holding 17 MiB of empty objects.
    let junk = "{},".repeat((17 << 20) / 3);
    let body = text.trim_end().strip_suffix('}').unwrap();
    std::fs::write(&p, format!("{body}, \"x_junk\": [{junk}{{}}]}}\n")).unwrap();
    for cmd in ["verify", "inspect", "scope"] {
        let r = run(&[cmd, s(&t)]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        for f in ["trace.json", "16777216 bytes", "hint:"] {
            assert!(r.stderr.contains(f), "{cmd} lacks {f:?}: {}", r.stderr);
        }
    }
}

#[test]
fn deeply_nested_trace_json_is_an_error_not_a_crash() {
    let (_d, t) = fresh();
    let p = t.join("trace.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let body = text.trim_end().strip_suffix('}').unwrap();
    let deep = format!("{}{}", "[".repeat(1 << 20), "]".repeat(1 << 20));
    std::fs::write(&p, format!("{body}, \"x_deep\": {deep}}}\n")).unwrap();
    let r = run(&["inspect", s(&t)]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("recursion limit"), "{}", r.stderr);
}

// ---------------------------------------------------------------------------
// One verdict from verify, inspect and scope

/// Rewrites `rel` with pool `pool`'s events after `edit`, and reseals.
fn edit_pool(t: &Path, rel: &str, pool: u16, edit: impl FnOnce(&mut Vec<KvEvent>)) {
    let mut evs: Vec<KvEvent> = events().into_iter().filter(|e| e.pool == pool).collect();
    edit(&mut evs);
    write_parquet(&t.join(rel), kv_cols(&evs), Compression::SNAPPY);
    reseal_trace(t);
}

#[test]
fn valid_trace_gets_one_verdict() {
    let (_d, t) = fresh();
    edit_pool(&t, POOL1, 1, |_| {});
    Verdicts::of(&t).accepted();
}

#[test]
fn src_seq_u64_max_gets_one_verdict() {
    let (_d, t) = fresh();
    // Row 1 of pool 1 is request 1's transfer from pool 0.
    edit_pool(&t, POOL1, 1, |evs| {
        evs[1].src.as_mut().unwrap().seq = u64::MAX;
    });
    Verdicts::of(&t).refused(&[POOL1, "row 1", "column `src_seq`"]);
}

#[test]
fn duplicate_request_id_gets_one_verdict() {
    let (_d, t) = fresh();
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("request_id", arr(UInt64Array::from(vec![9u64, 3]))),
        ("tenant", arr(StringArray::from(vec!["a", "b"]))),
        ("arrival_ns", arr(Int64Array::from(vec![1i64, 2]))),
        ("prompt_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("output_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("http_status", arr(UInt16Array::from(vec![200u16, 200]))),
    ];
    let extra = "requests/part-00001.parquet";
    write_parquet(&t.join(extra), cols, Compression::UNCOMPRESSED);
    reseal_trace(&t);
    Verdicts::of(&t).refused(&[
        extra,
        "row 1",
        "column `request_id`",
        "duplicate request_id 3",
    ]);
}

#[test]
fn unknown_pool_in_requests_gets_one_verdict() {
    let (_d, t) = fresh();
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("request_id", arr(UInt64Array::from(vec![1u64, 2, 3, 4]))),
        (
            "tenant",
            arr(StringArray::from(vec!["acme", "globex", "acme", "initech"])),
        ),
        (
            "arrival_ns",
            arr(Int64Array::from(vec![1001i64, 1002, 1003, 1004])),
        ),
        ("prompt_tokens", arr(UInt32Array::from(vec![8u32, 8, 8, 8]))),
        ("output_tokens", arr(UInt32Array::from(vec![3u32, 3, 3, 3]))),
        (
            "http_status",
            arr(UInt16Array::from(vec![200u16, 200, 200, 200])),
        ),
        ("decode_pool", arr(UInt16Array::from(vec![1u16, 1, 9, 1]))),
    ];
    write_parquet(&t.join(REQS), cols, Compression::UNCOMPRESSED);
    reseal_trace(&t);
    Verdicts::of(&t).refused(&[REQS, "row 2", "column `decode_pool`", "unknown pool id 9"]);
}

#[test]
fn unsorted_seqs_with_u64_max_first_get_one_verdict() {
    let (_d, t) = fresh();
    // A read at seq 2^64-1 written first. Replay keeps seq + 1 per slot,
    // and no pool reaches its 2^64th event: the value is reserved, refused
    // by all three alike (seqs far apart are fine, see the next case).
    edit_pool(&t, POOL0, 0, |evs| {
        let mut late = evs[1];
        late.seq = u64::MAX;
        late.op = kvtrail::schema::Op::Read;
        evs.insert(0, late);
    });
    Verdicts::of(&t).refused(&[POOL0, "row 0", "column `seq`", "reserved"]);
}

#[test]
fn unsorted_seqs_over_a_huge_range_get_one_verdict() {
    let (_d, t) = fresh();
    edit_pool(&t, POOL0, 0, |evs| {
        let mut late = evs[1];
        late.seq = 1 << 40;
        late.op = kvtrail::schema::Op::Read;
        evs.insert(0, late);
    });
    Verdicts::of(&t).accepted();
    let r = run(&["inspect", "--json", s(&t)]);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let p0 = &v["kv"]["pools"][0];
    assert_eq!(p0["holes"], 1, "{p0}");
    assert_eq!(p0["missing_events"], (1u64 << 40) - 12, "{p0}");
}

#[test]
fn duplicate_seq_gets_one_verdict() {
    let (_d, t) = fresh();
    // Pool 0's row 4 again at the end (unsorted: found after a sort).
    edit_pool(&t, POOL0, 0, |evs| {
        let again = evs[4];
        evs.push(again);
    });
    Verdicts::of(&t).refused(&[POOL0, "row 12", "column `seq`", "two events with seq 4"]);
}

#[test]
fn duplicate_seq_in_order_gets_one_verdict() {
    let (_d, t) = fresh();
    edit_pool(&t, POOL0, 0, |evs| {
        let again = evs[4];
        evs.insert(5, again);
    });
    Verdicts::of(&t).refused(&[POOL0, "row 5", "column `seq`", "two events with seq 4"]);
}

/// Copies both ways between two pools are a tier offload and load under
/// revision 2 of the trace contract (they were refused as a cycle before):
/// accepted when causal. Pool 0 copies from pool 1 as of seq 0 while pool 1
/// copies from pool 0: each copy's source event precedes it.
#[test]
fn copies_both_ways_between_pools_are_accepted_when_causal() {
    let (_d, t) = fresh();
    edit_pool(&t, POOL0, 0, |evs| {
        evs[1].src = Some(kvtrail::schema::CopySrc {
            pool: 1,
            slot_start: 0,
            seq: 0,
        });
    });
    Verdicts::of(&t).accepted();
}

/// Two copies that wait on each other have no order: pool 0's seq 1 reads
/// pool 1 as of seq 1, and pool 1's seq 1 reads pool 0 as of seq 1. verify
/// and inspect check structure only; the replay refuses it, naming both
/// rows, and never blocks.
#[test]
fn copies_that_wait_on_each_other_are_refused_naming_both_rows() {
    let (_d, t) = fresh();
    edit_pool(&t, POOL0, 0, |evs| {
        evs[1].src = Some(kvtrail::schema::CopySrc {
            pool: 1,
            slot_start: 0,
            seq: 1,
        });
    });
    let v = Verdicts::of(&t);
    let all = v.show();
    assert_eq!(
        (v.verify.code, v.inspect.code, v.scope.code),
        (0, 0, 2),
        "{all}"
    );
    for f in [POOL0, POOL1, "row 1", "wait on each other", "hint:"] {
        assert!(v.scope.stderr.contains(f), "scope lacks {f:?}:\n{all}");
    }
    assert!(!all.contains("panicked"), "{all}");
}

// ---------------------------------------------------------------------------
// The seq sort spills: the same holes and the same duplicate, whatever the
// chunk size

/// Writes a trace whose pool-0 seqs are split into files as given.
fn trace_with_seqs(dir: &Path, files: &[&[u64]]) -> kvtrail::trace::Trace {
    for (i, seqs) in files.iter().enumerate() {
        let n = seqs.len();
        write_parquet(
            &dir.join(format!("kv/f{i}.parquet")),
            vec![
                ("pool", arr(UInt16Array::from(vec![0u16; n]))),
                ("seq", arr(UInt64Array::from(seqs.to_vec()))),
                ("ts_ns", arr(Int64Array::from(vec![5i64; n]))),
                ("request_id", arr(UInt64Array::from(vec![1u64; n]))),
                ("op", arr(StringArray::from(vec!["read"; n]))),
                ("slot_start", arr(UInt32Array::from(vec![0u32; n]))),
                ("slot_count", arr(UInt32Array::from(vec![1u32; n]))),
            ],
            Compression::UNCOMPRESSED,
        );
    }
    let m = serde_json::json!({"format": "kvtrail-trace", "version": 1,
        "deployment": serde_json::to_value(small_trace::deployment()).unwrap()});
    std::fs::write(dir.join("trace.json"), m.to_string()).unwrap();
    kvtrail::trace::Trace::open(dir).unwrap()
}

#[test]
fn seq_sort_in_spilled_chunks_matches_the_sort_in_memory() {
    use kvtrail::trace::check::check_kv;
    let d = tempfile::tempdir().unwrap();
    let t = trace_with_seqs(d.path(), &[&[9, 3, 0, 7, 1, 20], &[2, 8, 5, 12]]);
    let spill = tempfile::tempdir().unwrap();
    let mem = check_kv(&t, None, None).unwrap();
    for chunk in [1, 2, 3, 5] {
        let small = check_kv(&t, Some(spill.path()), Some(chunk)).unwrap();
        assert_eq!(small.pools, mem.pools, "chunk {chunk}");
    }
    let p = &mem.pools[0];
    assert_eq!(p.check.as_str(), "sort");
    let missing: Vec<(Option<u64>, u64)> = p
        .holes_listed
        .iter()
        .map(|h| (h.after_seq, h.before_seq))
        .collect();
    assert_eq!(
        missing,
        vec![(Some(3), 5), (Some(5), 7), (Some(9), 12), (Some(12), 20)]
    );
    assert_eq!(p.missing_events, 1 + 1 + 2 + 7);

    let d = tempfile::tempdir().unwrap();
    let t = trace_with_seqs(d.path(), &[&[9, 3, 0, 7, 1], &[2, 8, 7, 4]]);
    for chunk in [None, Some(1), Some(2), Some(4)] {
        let e = check_kv(&t, Some(spill.path()), chunk)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("two events with seq 7") && e.contains("f0.parquet row 3 and"),
            "chunk {chunk:?}: {e}"
        );
        assert!(
            e.contains("f1.parquet, row 2, column `seq`"),
            "chunk {chunk:?}: {e}"
        );
    }
    // Spill files are removed with the check.
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 0);
}

// ---------------------------------------------------------------------------
// Pool ids, Hive folders, deployment files

#[test]
fn pool_id_65535_is_read_like_any_other_pool() {
    let d = tempfile::tempdir().unwrap();
    let dep = d.path().join("dep.json");
    std::fs::write(
        &dep,
        r#"{"name":"x","engine":"e","context_window":4096,"pools":[{"id":65535,"name":"p","role":"mixed","capacity_tokens":64,"page_size":4}]}"#,
    )
    .unwrap();
    let input = d.path().join("in.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"type":"kv","pool":65535,"ts_ns":1,"request_id":1,"op":"write","slot_start":0,"slot_count":4,"token_pos":0}"#,
            "\n",
            r#"{"type":"kv","pool":65535,"ts_ns":2,"request_id":1,"op":"free","slot_start":0,"slot_count":4}"#,
            "\n",
            r#"{"type":"request","request_id":1,"tenant":"a","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200,"prefill_pool":65535}"#,
            "\n",
        ),
    )
    .unwrap();
    let t = d.path().join("t");
    let r = run(&["ingest", s(&input), "--deployment", s(&dep), "--out", s(&t)]);
    assert_eq!(r.code, 0, "ingest: {}", r.stderr);
    let v = Verdicts::of(&t);
    v.accepted();
    assert!(
        v.inspect.stdout.contains("65535"),
        "inspect does not show pool 65535:\n{}",
        v.inspect.stdout
    );
}

/// Pool 1's events without their `pool` column, at `rel` (a path under
/// Hive folders that say the pool), in place of pool 1's own file.
fn pool1_under_folders(t: &Path, rel: &str) {
    let evs: Vec<KvEvent> = events().into_iter().filter(|e| e.pool == 1).collect();
    let cols: Vec<(&str, ArrayRef)> = kv_cols(&evs)
        .into_iter()
        .filter(|(n, _)| *n != "pool")
        .collect();
    std::fs::remove_file(t.join(POOL1)).unwrap();
    let p = t.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    write_parquet(&p, cols, Compression::SNAPPY);
    reseal_trace(t);
}

#[test]
fn hive_folders_without_the_column_are_read() {
    let (_d, t) = fresh();
    // Two folders that agree (one percent-encoded) are one value.
    pool1_under_folders(&t, "kv/pool=1/pool=%31/part-00000.parquet");
    Verdicts::of(&t).accepted();
}

#[test]
fn contradictory_nested_hive_folders_are_refused() {
    let (_d, t) = fresh();
    let rel = "kv/pool=0/pool=1/part-00000.parquet";
    pool1_under_folders(&t, rel);
    Verdicts::of(&t).refused(&[rel, "column `pool`", "`pool=0`", "`pool=1`"]);
}

#[test]
fn bad_hive_folder_value_names_the_folder_and_the_value() {
    let (_d, t) = fresh();
    let rel = "kv/pool=%ZZ/part-00000.parquet";
    pool1_under_folders(&t, rel);
    Verdicts::of(&t).refused(&[rel, "column `pool`", "folder `pool=%ZZ`", "\"%ZZ\""]);

    let (_d, t) = fresh();
    let rel = "kv/pool=70000/part-00000.parquet";
    pool1_under_folders(&t, rel);
    Verdicts::of(&t).refused(&[rel, "column `pool`", "folder `pool=70000`", "70000"]);
}

#[test]
fn hive_folder_of_a_string_column_with_digits_is_read_as_text() {
    let (_d, t) = fresh();
    // requests/tenant=007/ without a tenant column: the tenant is "007",
    // not the integer 7 and not a type error.
    let reqs = small_trace::requests();
    std::fs::remove_file(t.join(REQS)).unwrap();
    for (tenant, ids) in [
        ("007", vec![1u64, 3]),
        ("globex", vec![2]),
        ("initech", vec![4]),
    ] {
        let rs: Vec<_> = reqs
            .iter()
            .filter(|r| ids.contains(&r.request_id))
            .collect();
        let cols: Vec<(&str, ArrayRef)> = vec![
            (
                "request_id",
                arr(UInt64Array::from_iter_values(
                    rs.iter().map(|r| r.request_id),
                )),
            ),
            (
                "arrival_ns",
                arr(Int64Array::from_iter_values(
                    rs.iter().map(|r| r.arrival_ns),
                )),
            ),
            (
                "prompt_tokens",
                arr(UInt32Array::from_iter_values(
                    rs.iter().map(|r| r.prompt_tokens),
                )),
            ),
            (
                "output_tokens",
                arr(UInt32Array::from_iter_values(
                    rs.iter().map(|r| r.output_tokens),
                )),
            ),
            (
                "http_status",
                arr(UInt16Array::from_iter_values(
                    rs.iter().map(|r| r.http_status),
                )),
            ),
        ];
        let p = t.join(format!("requests/tenant={tenant}/part-00000.parquet"));
        write_parquet(&p, cols, Compression::SNAPPY);
    }
    reseal_trace(&t);
    let v = Verdicts::of(&t);
    v.accepted();
    let r = run(&["scope", "--backend", "cpu", "--json", s(&t)]);
    assert!(r.stdout.contains("\"007\""), "{}", r.stdout);
}

#[test]
fn verify_shows_a_problems_hint_on_its_own_line_not_escaped() {
    let (_d, t) = fresh();
    pool1_under_folders(&t, "kv/pool=%ZZ/part-00000.parquet");
    let v = run(&["verify", s(&t)]);
    assert_eq!(v.code, 1, "{}{}", v.stdout, v.stderr);
    assert!(v.stdout.contains("\n  hint: "), "{}", v.stdout);
    assert!(!v.stdout.contains("\\u{a}"), "{}", v.stdout);
}

fn jsonl_data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/jsonl")
        .join(name)
}

fn ingest_with_deployment(dep_bytes: &[u8]) -> Ran {
    let d = tempfile::tempdir().unwrap();
    let dep = d.path().join("dep.json");
    std::fs::write(&dep, dep_bytes).unwrap();
    let out = d.path().join("t");
    run(&[
        "ingest",
        s(&jsonl_data("incident.jsonl")),
        "--deployment",
        s(&dep),
        "--out",
        s(&out),
    ])
}

#[test]
fn deployment_file_of_trace_format_version_2_is_refused() {
    let dep: serde_json::Value =
        serde_json::from_slice(&std::fs::read(jsonl_data("deploy.json")).unwrap()).unwrap();
    let v2 = serde_json::json!({"format": "kvtrail-trace", "version": 2, "deployment": dep});
    let r = ingest_with_deployment(v2.to_string().as_bytes());
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("unknown trace format version 2"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("hint:"), "{}", r.stderr);
    // A version-1 trace.json is still a deployment file.
    let v1 = serde_json::json!({"format": "kvtrail-trace", "version": 1, "deployment": dep});
    let r = ingest_with_deployment(v1.to_string().as_bytes());
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn deployment_file_with_a_utf8_bom_is_read_like_trace_json() {
    let mut bytes = b"\xef\xbb\xbf".to_vec();
    bytes.extend(std::fs::read(jsonl_data("deploy.json")).unwrap());
    let r = ingest_with_deployment(&bytes);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

// ---------------------------------------------------------------------------
// Row groups

/// `n` pool-0 events (seq 0..n, alloc and free of slot 0 by request 1).
fn many_events(n: u64) -> Vec<KvEvent> {
    (0..n)
        .map(|i| KvEvent {
            pool: 0,
            seq: i,
            ts_ns: 1_000 + i as i64,
            request_id: 1,
            op: if i % 2 == 0 {
                kvtrail::schema::Op::Alloc
            } else {
                kvtrail::schema::Op::Free
            },
            slot_start: 0,
            slot_count: 1,
            token_pos: None,
            src: None,
        })
        .collect()
}

#[test]
fn row_group_amplification_is_refused_at_the_row_group_limit() {
    let (_d, t) = fresh();
    // One row per row group: memory and time grow with row groups, not
    // rows; one more than the limit is refused before any row is read.
    let n = kvtrail::trace::read::MAX_ROW_GROUPS as u64 + 1;
    let batch = arrow_array::RecordBatch::try_from_iter(kv_cols(&many_events(n))).unwrap();
    write_batches(&t.join(POOL0), &[batch], Compression::UNCOMPRESSED, 1);
    reseal_trace(&t);
    Verdicts::of(&t).refused(&[POOL0, &format!("has {n} row groups"), "hint:"]);
}

#[test]
fn footer_over_the_limit_is_refused_before_it_is_read() {
    let (_d, t) = fresh();
    // A footer that claims more than the limit is refused from its length
    // alone, before it is read or decoded.
    let p = t.join(POOL0);
    let mut bytes = std::fs::read(&p).unwrap();
    let n = bytes.len();
    let claim = (kvtrail::trace::read::MAX_FOOTER_BYTES + 1) as u32;
    bytes[n - 8..n - 4].copy_from_slice(&claim.to_le_bytes());
    std::fs::write(&p, bytes).unwrap();
    reseal_trace_digests(&t);
    Verdicts::of(&t).refused(&[POOL0, "footer", &claim.to_string()]);
}

#[test]
fn recorder_starts_a_new_part_before_row_groups_amplify() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t");
    let opts = kvtrail::capture::RecorderOptions {
        started_ns: Some(1_000),
        row_group_rows: 1,
        ..Default::default()
    };
    let mut rec = kvtrail::capture::Recorder::create(&t, deployment(), opts).unwrap();
    let n = kvtrail::trace::write::MAX_PART_ROW_GROUPS as u64 + 10;
    for e in many_events(n) {
        rec.kv_with_seq(e).unwrap();
    }
    rec.close().unwrap();
    let trace = kvtrail::trace::Trace::open(&t).unwrap();
    assert_eq!(trace.kv_files.len(), 2, "{:?}", trace.kv_files);
    for f in &trace.kv_files {
        let r = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(f).unwrap())
            .unwrap();
        use parquet::file::reader::FileReader;
        assert!(r.metadata().num_row_groups() <= kvtrail::trace::write::MAX_PART_ROW_GROUPS);
    }
    let v = Verdicts::of(&t);
    assert_eq!(v.verify.code, 0, "{}", v.show());
}
