//! Bad input, through the real binary: every case exits 2 from `inspect`
//! with a message naming the file, the row (where there is one) and the
//! column, and never panics; `verify` fails the trace (1) or cannot read it
//! (2). Plus a fuzz-style property over corrupted bytes of a valid trace.
//!
//! Index:
//! - one `#[test]` per bad input, each through `check_bad`
//! - `corrupted_bytes_never_panic` (proptest)

use std::path::{Path, PathBuf};

use arrow_array::{ArrayRef, Int32Array, StringArray, UInt16Array, UInt32Array, UInt64Array};
use kvtrail::schema::KvEvent;
use parquet::basic::Compression;
use proptest::prelude::*;

use crate::support::cli::{kvtrail, s};
use crate::support::small_trace::*;

const POOL0: &str = "kv/pool=0/part-00000.parquet";
const REQS: &str = "requests/part-00000.parquet";

/// Runs inspect and verify on a broken trace: inspect exits 2 and its
/// message contains every fragment; verify exits 1 or 2 naming the file;
/// neither panics.
fn check_bad(trace: &Path, fragments: &[&str], verify_code: i32) {
    let r = kvtrail(["inspect", s(trace)]).run();
    assert_eq!(r.code, 2, "inspect exit code; stderr:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for f in fragments {
        assert!(
            r.stderr.contains(f),
            "inspect message lacks {f:?}:\n{}",
            r.stderr
        );
    }
    assert!(r.stderr.contains("hint:"), "no hint:\n{}", r.stderr);
    let v = kvtrail(["verify", s(trace)]).run();
    assert_eq!(
        v.code, verify_code,
        "verify exit; out:\n{}{}",
        v.stdout, v.stderr
    );
    assert!(!v.stderr.contains("panicked"), "{}", v.stderr);
    let file = fragments[0];
    assert!(
        v.stdout.contains(file) || v.stderr.contains(file),
        "verify does not name {file}:\n{}{}",
        v.stdout,
        v.stderr
    );
}

fn fresh() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    (d, t)
}

fn pool0_events() -> Vec<KvEvent> {
    events().into_iter().filter(|e| e.pool == 0).collect()
}

fn replace_pool0(t: &Path, cols: Vec<(&'static str, ArrayRef)>) {
    write_parquet(&t.join(POOL0), cols, Compression::SNAPPY);
}

fn set_col(cols: &mut [(&'static str, ArrayRef)], name: &str, a: ArrayRef) {
    cols.iter_mut().find(|c| c.0 == name).unwrap().1 = a;
}

#[test]
fn truncated_parquet() {
    let (_d, t) = fresh();
    let p = t.join(POOL0);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    check_bad(&t, &[POOL0, "cannot read Parquet"], 1);
}

#[test]
fn not_parquet() {
    let (_d, t) = fresh();
    std::fs::write(t.join(POOL0), b"request_id,tenant\n1,acme\n").unwrap();
    check_bad(&t, &[POOL0, "cannot read Parquet"], 1);
}

#[test]
fn missing_required_column() {
    let (_d, t) = fresh();
    let mut cols = kv_cols(&pool0_events());
    cols.retain(|c| c.0 != "slot_count");
    replace_pool0(&t, cols);
    check_bad(&t, &[POOL0, "column `slot_count`", "missing"], 1);
}

#[test]
fn wrong_column_type() {
    let (_d, t) = fresh();
    let evs = pool0_events();
    let mut cols = kv_cols(&evs);
    let seq_as_text = StringArray::from_iter_values(evs.iter().map(|e| e.seq.to_string()));
    set_col(&mut cols, "seq", arr(seq_as_text));
    replace_pool0(&t, cols);
    check_bad(
        &t,
        &[POOL0, "column `seq`", "has type Utf8, expected UInt64"],
        1,
    );
}

#[test]
fn null_in_non_null_column() {
    let (_d, t) = fresh();
    let evs = pool0_events();
    let mut cols = kv_cols(&evs);
    let rid = UInt64Array::from_iter(
        evs.iter()
            .enumerate()
            .map(|(i, e)| (i != 2).then_some(e.request_id)),
    );
    set_col(&mut cols, "request_id", arr(rid));
    replace_pool0(&t, cols);
    check_bad(&t, &[POOL0, "row 2", "column `request_id`", "null"], 1);
}

#[test]
fn unknown_op() {
    let (_d, t) = fresh();
    let evs = pool0_events();
    let mut cols = kv_cols(&evs);
    let ops = StringArray::from_iter_values(
        evs.iter()
            .enumerate()
            .map(|(i, e)| if i == 5 { "wipe" } else { e.op.as_str() }),
    );
    set_col(&mut cols, "op", arr(ops));
    replace_pool0(&t, cols);
    check_bad(
        &t,
        &[POOL0, "row 5", "column `op`", "unknown op \"wipe\""],
        1,
    );
}

#[test]
fn slot_count_zero() {
    let (_d, t) = fresh();
    let mut evs = pool0_events();
    evs[3].slot_count = 0;
    replace_pool0(&t, kv_cols(&evs));
    check_bad(
        &t,
        &[POOL0, "row 3", "column `slot_count`", "slot_count is 0"],
        1,
    );
}

#[test]
fn unknown_pool_id() {
    let (_d, t) = fresh();
    let mut evs = pool0_events();
    evs[1].pool = 7;
    replace_pool0(&t, kv_cols(&evs));
    check_bad(
        &t,
        &[POOL0, "row 1", "column `pool`", "unknown pool id 7"],
        1,
    );
}

/// A copy whose source extent runs past its source pool's capacity: the
/// replay captures a copy's source (when the source pool reaches src_seq)
/// before the copy's own row is decoded, so the planning scan must refuse
/// it; it once indexed past the source pool's last page (a panic found by
/// fuzzing).
#[test]
fn copy_source_extent_outside_its_pool() {
    const POOL1: &str = "kv/pool=1/part-00000.parquet";
    let (_d, t) = fresh();
    let mut evs: Vec<KvEvent> = events().into_iter().filter(|e| e.pool == 1).collect();
    let i = evs.iter().position(|e| e.src.is_some()).unwrap();
    evs[i].src.as_mut().unwrap().slot_start = 245;
    write_parquet(&t.join(POOL1), kv_cols(&evs), Compression::SNAPPY);
    let want = [
        POOL1,
        &format!("row {i}") as &str,
        "column `src_slot_start`",
        "source extent 245..253 lies outside pool 0 (capacity_tokens 64)",
    ];
    check_bad(&t, &want, 1);
    let out = t.with_file_name("scope-out");
    let r = kvtrail(["scope", s(&t), "--out", s(&out)]).run();
    assert_eq!(r.code, 2, "scope exit code; stderr:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for f in want {
        assert!(r.stderr.contains(f), "scope lacks {f:?}:\n{}", r.stderr);
    }
    assert!(!out.join("summary.json").exists(), "scope wrote a report");
}

/// The required columns of a two-row requests table with these ids.
fn two_requests(ids: [u64; 2]) -> Vec<(&'static str, ArrayRef)> {
    vec![
        ("request_id", arr(UInt64Array::from(ids.to_vec()))),
        ("tenant", arr(StringArray::from(vec!["a", "b"]))),
        (
            "arrival_ns",
            arr(arrow_array::Int64Array::from(vec![1i64, 2])),
        ),
        ("prompt_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("output_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("http_status", arr(UInt16Array::from(vec![200u16, 200]))),
    ]
}

#[test]
fn reserved_request_ids_are_refused_not_misread() {
    // u64::MAX and u64::MAX - 1 are the replay's never-written / scrubbed
    // markers; a trace using them must fail loudly, in kv and in requests.
    for id in [u64::MAX, u64::MAX - 1] {
        let (_d, t) = fresh();
        let mut evs = pool0_events();
        evs[2].request_id = id;
        replace_pool0(&t, kv_cols(&evs));
        check_bad(
            &t,
            &[
                POOL0,
                "row 2",
                "column `request_id`",
                &format!("request_id {id}"),
            ],
            1,
        );
    }
    let (_d, t) = fresh();
    let cols = two_requests([1, u64::MAX]);
    write_parquet(&t.join(REQS), cols, Compression::UNCOMPRESSED);
    check_bad(&t, &[REQS, "row 1", "column `request_id`", "reserves"], 1);
}

#[test]
fn unknown_pool_id_in_requests() {
    let (_d, t) = fresh();
    let mut cols = two_requests([1, 2]);
    cols.push(("decode_pool", arr(UInt16Array::from(vec![1u16, 9]))));
    write_parquet(&t.join(REQS), cols, Compression::UNCOMPRESSED);
    check_bad(
        &t,
        &[REQS, "row 1", "column `decode_pool`", "unknown pool id 9"],
        1,
    );
}

#[test]
fn unknown_format_version() {
    let (_d, t) = fresh();
    let p = t.join("trace.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replacen("\"version\": 1", "\"version\": 2", 1)).unwrap();
    check_bad(
        &t,
        &[
            "trace.json",
            "column `version`",
            "unknown trace format version 2",
        ],
        2,
    );
}

#[test]
fn missing_trace_json() {
    let (_d, t) = fresh();
    std::fs::remove_file(t.join("trace.json")).unwrap();
    check_bad(&t, &["trace.json", "trace.json is missing"], 2);
}

#[test]
fn duplicate_request_id() {
    let (_d, t) = fresh();
    let cols: Vec<(&str, ArrayRef)> = vec![
        ("request_id", arr(UInt64Array::from(vec![9u64, 3]))),
        ("tenant", arr(StringArray::from(vec!["a", "b"]))),
        (
            "arrival_ns",
            arr(arrow_array::Int64Array::from(vec![1i64, 2])),
        ),
        ("prompt_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("output_tokens", arr(UInt32Array::from(vec![1u32, 2]))),
        ("http_status", arr(Int32Array::from(vec![200, 200]))),
    ];
    let extra = "requests/part-00001.parquet";
    write_parquet(&t.join(extra), cols, Compression::UNCOMPRESSED);
    // request 3 is row 2 of the Recorder's file, and row 1 of the new one.
    let r = kvtrail(["inspect", s(&t)]).run();
    assert_eq!(r.code, 2, "{}", r.stderr);
    for f in [
        extra,
        "row 1",
        "column `request_id`",
        "duplicate request_id 3",
        REQS,
        "row 2",
    ] {
        assert!(r.stderr.contains(f), "lacks {f:?}:\n{}", r.stderr);
    }
    // verify reports the unlisted file (exit 1); inspect is the reader that
    // joins requests by id.
    let v = kvtrail(["verify", s(&t)]).run();
    assert_eq!(v.code, 1, "{}", v.stdout);
    assert!(v.stdout.contains(extra), "{}", v.stdout);
}

#[test]
fn valid_trace_inspects_and_verifies() {
    // The baseline the bad cases are made from is itself fine.
    let (_d, t) = fresh();
    let r = kvtrail(["inspect", s(&t)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("prefilled < prompt: 1 (1 with 2xx), e.g. request 3"),
        "{}",
        r.stdout
    );
    let v = kvtrail(["verify", s(&t)]).run();
    assert_eq!(v.code, 0, "{}", v.stdout);
}

/// The parquet crate asserts (panics) on a negative column offset in a
/// damaged footer; found by flipping bit 0 of byte 1551 of a golden file.
/// kvtrail must report it as a corrupt file instead.
#[test]
fn parquet_reader_assert_on_negative_offset_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t");
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
    for f in ["trace.json", POOL0, "kv/pool=1/part-00000.parquet", REQS] {
        std::fs::create_dir_all(t.join(f).parent().unwrap()).unwrap();
        std::fs::copy(golden.join(f), t.join(f)).unwrap();
    }
    let p = t.join(POOL0);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[1551] ^= 0x01;
    std::fs::write(&p, &bytes).unwrap();
    check_bad(
        &t,
        &[POOL0, "cannot read Parquet", "should not be negative"],
        1,
    );
}

/// How to damage one file of a valid trace.
#[derive(Debug, Clone)]
enum Damage {
    Flip { at: usize, mask: u8 },
    Truncate { at: usize },
    Overwrite { at: usize, bytes: Vec<u8> },
}

fn damage() -> impl Strategy<Value = (usize, Damage)> {
    let d = prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        any::<usize>().prop_map(|at| Damage::Truncate { at }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(at, bytes)| Damage::Overwrite { at, bytes }),
    ];
    (0usize..4, d)
}

proptest! {
    // PROPTEST_CASES raises the count for a longer local run.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn corrupted_bytes_never_panic((file, dmg) in damage()) {
        let (_d, t) = fresh();
        let files = ["trace.json", POOL0, "kv/pool=1/part-00000.parquet", REQS];
        let p = t.join(files[file]);
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        match &dmg {
            Damage::Flip { at, mask } => bytes[at % n] ^= mask,
            Damage::Truncate { at } => bytes.truncate(at % n),
            Damage::Overwrite { at, bytes: b } => {
                for (i, x) in b.iter().enumerate() {
                    let j = (at % n + i) % n;
                    bytes[j] = *x;
                }
            }
        }
        std::fs::write(&p, &bytes).unwrap();
        for cmd in ["inspect", "verify"] {
            let r = kvtrail([cmd, s(&t)]).run();
            prop_assert!(!r.stderr.contains("panicked"), "{cmd} {:?} on {}: {}", dmg, files[file], r.stderr);
            prop_assert!([0, 1, 2].contains(&r.code), "{cmd} exit {} {:?} on {}: {}", r.code, dmg, files[file], r.stderr);
            if r.code == 2 {
                prop_assert!(r.stderr.starts_with("error: "), "{}", r.stderr);
            }
        }
    }
}
