//! One test per rule of the "Semantics" section of the trace format (own,
//! shared, blank, foreign, grants, copies, scrub, gaps, unknown, unclean
//! capture), data-driven through `check`: each trace is built in code, run
//! through the Recorder and, shuffled across hand-written Parquet files
//! with dictionary strings, by hand; both must give the expected digest.

use crate::support::trace_builder::{TraceBuilder, digest, pool, scope};
use kvtrail::trace::Role;

/// Builds the trace both ways and compares the report digests to `expect`.
/// The by-hand trace has no `files` list, so its coverage is never complete;
/// that line is compared separately.
fn check(tb: &TraceBuilder, expect: &str) {
    let expect = expect
        .trim()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let got = digest(&scope(&tb.record(&dir.path().join("rec"))));
    assert_eq!(got, expect, "recorded trace");
    for (seed, files) in [(1, 1), (7, 3), (42, 5)] {
        let d = dir.path().join(format!("hand-{seed}"));
        let r = scope(&tb.by_hand(&d, files, seed, seed % 2 == 0));
        assert!(
            !r.coverage.complete,
            "a trace without `files` is never complete"
        );
        assert!(r.coverage.unverifiable);
        let got = digest(&r);
        let strip = |s: &str| {
            s.lines()
                .filter(|l| !l.starts_with("complete="))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            strip(&got),
            strip(&expect),
            "hand-written trace, seed {seed}"
        );
    }
}

fn pd() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.req(3, "umbrella");
    tb
}

#[test]
fn own_read_is_clean() {
    let mut tb = pd();
    tb.alloc(0, 1, 0, 4);
    tb.write(0, 1, 0, 4);
    tb.read(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    check(&tb, "blank=0\ncomplete=true gaps=[]");
}

#[test]
fn shared_read_with_grant_is_clean() {
    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    check(&tb, "blank=0\ncomplete=true gaps=[]");
}

#[test]
fn never_written_read_is_blank_when_capture_began_with_engine() {
    let mut tb = pd();
    tb.alloc(0, 1, 0, 4);
    tb.read(0, 1, 0, 4);
    check(&tb, "blank=4\ncomplete=true gaps=[]");
}

#[test]
fn foreign_read_of_freed_kv_names_the_source() {
    let mut tb = pd();
    tb.write(0, 1, 0, 6);
    tb.free(0, 1, 0, 6);
    tb.alloc(0, 2, 0, 6);
    tb.write(0, 2, 0, 1);
    tb.read(0, 2, 0, 6);
    tb.read(0, 2, 0, 6); // repeated reads count distinct slots once
    check(
        &tb,
        "r2 initech foreign=5 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:5]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn grant_is_broken_by_rewrite() {
    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.write(0, 3, 2, 2); // rewrites slots 2..4: r2's grant on them ends
    tb.read(0, 2, 0, 4);
    check(
        &tb,
        "r2 initech foreign=2 unknown=0 uncertain=0 cross=true confirmed src=[3:umbrella:2]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn grant_before_the_write_does_not_cover_new_content() {
    let mut tb = pd();
    tb.share(0, 2, 0, 4);
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 4);
    check(
        &tb,
        "r2 initech foreign=4 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:4]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn copy_carries_provenance_and_own_copy_is_clean() {
    let mut tb = pd();
    let s = tb.write(0, 1, 0, 4);
    tb.copy(1, 1, 10, 4, 0, 0, s);
    tb.read(1, 1, 10, 4);
    check(&tb, "blank=0\ncomplete=true gaps=[]");
}

#[test]
fn copy_of_a_copy_follows_the_chain() {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 32),
        pool(1, Role::Mixed, 32),
        pool(2, Role::Decode, 32),
    ]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    let s0 = tb.write(0, 1, 0, 4);
    let s1 = tb.copy(1, 1, 4, 4, 0, 0, s0);
    tb.write(1, 2, 4, 1); // after the copy we chain from: not seen by it
    tb.copy(2, 2, 8, 4, 1, 4, s1);
    tb.read(2, 2, 8, 4);
    check(
        &tb,
        "r2 initech foreign=4 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:4]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn copy_from_reused_source_reads_the_new_owner() {
    let mut tb = pd();
    let s1 = tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    let s2 = tb.write(0, 2, 0, 2); // r2 reuses half the source slots
    // r1's transfer lands after the reuse and reads the reused state;
    // r3's transfer names the state before it.
    tb.copy(1, 1, 8, 4, 0, 0, s2);
    tb.copy(1, 3, 16, 4, 0, 0, s1);
    tb.read(1, 1, 8, 4);
    tb.read(1, 3, 16, 4);
    check(
        &tb,
        "r1 acme foreign=2 unknown=0 uncertain=0 cross=true confirmed src=[2:initech:2]
         r3 umbrella foreign=4 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:4]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn copies_may_name_source_states_out_of_order() {
    let mut tb = pd();
    let a = tb.write(0, 1, 0, 4);
    let b = tb.write(0, 2, 0, 4); // same slots rewritten: state at `a` is gone
    tb.copy(1, 2, 8, 4, 0, 0, b);
    tb.copy(1, 1, 16, 4, 0, 0, a); // older state, applied later
    tb.read(1, 1, 16, 4);
    tb.read(1, 2, 8, 4);
    check(&tb, "blank=0\ncomplete=true gaps=[]");
}

#[test]
fn scrub_clears_content_reads_are_blank_not_foreign() {
    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    tb.scrub(0, 0, 4);
    tb.alloc(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    check(&tb, "blank=4\ncomplete=true gaps=[]");
}

#[test]
fn same_tenant_stale_read_is_foreign_but_not_cross_tenant() {
    let mut tb = pd();
    tb.req(4, "acme");
    tb.write(0, 1, 0, 3);
    tb.free(0, 1, 0, 3);
    tb.read(0, 4, 0, 3);
    check(
        &tb,
        "r4 acme foreign=3 unknown=0 uncertain=0 cross=false confirmed src=[1:acme:3]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn gap_makes_state_after_it_possible() {
    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.write(0, 3, 8, 2);
    tb.lose(0, 3); // seqs 2, 3, 4 lost
    tb.write(0, 1, 0, 2); // rewritten after the hole: certain again
    tb.read(0, 1, 0, 4); // slots 2..4 predate the hole
    tb.read(0, 2, 8, 2); // foreign, but the owner predates the hole
    check(
        &tb,
        "r1 acme foreign=0 unknown=0 uncertain=2 cross=false possible src=[]
         r2 initech foreign=2 unknown=0 uncertain=0 cross=true possible src=[3:umbrella:2]
         blank=0
         complete=false gaps=[0:1..5]",
    );
}

#[test]
fn copy_whose_source_seq_lies_in_a_gap_is_possible() {
    let mut tb = pd();
    let s = tb.write(0, 1, 0, 4);
    tb.lose(0, 2);
    tb.write(0, 1, 20, 1);
    tb.copy(1, 2, 8, 4, 0, 0, s + 1); // names a lost event
    tb.read(1, 2, 8, 4);
    check(
        &tb,
        "r2 initech foreign=4 unknown=0 uncertain=0 cross=true possible src=[1:acme:4]
         blank=0
         complete=false gaps=[0:0..3]",
    );
}

#[test]
fn never_written_read_is_unknown_when_capture_began_mid_run() {
    let mut tb = pd();
    tb.from_engine_start = false;
    tb.write(0, 1, 0, 2);
    tb.read(0, 1, 0, 4);
    check(
        &tb,
        "r1 acme foreign=0 unknown=2 uncertain=0 cross=false possible src=[]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn unclean_capture_makes_findings_possible() {
    let mut tb = pd();
    tb.complete = false;
    tb.write(0, 1, 0, 2);
    tb.read(0, 2, 0, 2);
    check(
        &tb,
        "r2 initech foreign=2 unknown=0 uncertain=0 cross=true possible src=[1:acme:2]
         blank=0
         complete=false gaps=[]",
    );
}

#[test]
fn placeholder_prefill_decode_reads_stale_preallocated_kv() {
    // The incident: prefill computes a 1-token placeholder, transfers one
    // slot; decode preallocated 6 slots that still hold r1's freed KV.
    let mut tb = pd();
    let r2 = tb.requests.iter_mut().find(|r| r.request_id == 2).unwrap();
    r2.prefilled_tokens = Some(1);
    let s = tb.write(0, 1, 0, 6);
    tb.copy(1, 1, 0, 6, 0, 0, s);
    tb.read(1, 1, 0, 6);
    tb.free(1, 1, 0, 6);
    let p = tb.write(0, 2, 10, 1);
    tb.alloc(1, 2, 0, 6);
    tb.copy(1, 2, 0, 1, 0, 10, p);
    tb.read(1, 2, 0, 6);
    check(
        &tb,
        "r2 initech foreign=5 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:5]
         blank=0
         complete=true gaps=[]",
    );
}

#[test]
fn reader_missing_from_requests_table_is_still_reported() {
    let mut tb = pd();
    tb.write(0, 1, 0, 2);
    tb.read(0, 9, 0, 2);
    check(
        &tb,
        "r9 (unknown) foreign=2 unknown=0 uncertain=0 cross=true confirmed src=[1:acme:2]
         blank=0
         complete=false gaps=[]",
    );
    let dir = tempfile::tempdir().unwrap();
    let r = scope(&tb.record(dir.path()));
    assert_eq!(r.coverage.requests_missing, vec![9]);
}

#[test]
fn request_anomalies_are_found_without_kv_events() {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 1000),
        pool(1, Role::Decode, 4000),
    ]);
    tb.deployment.context_window = 2000;
    // max_req_input_len of pool 0 = min(1999, 999) - 5 = 994
    let r = tb.req(1, "acme");
    r.prompt_tokens = 994;
    r.prefilled_tokens = Some(1);
    r.prefill_pool = Some(0);
    let r = tb.req(2, "acme");
    r.prompt_tokens = 993;
    r.prefill_pool = Some(0);
    r.prefilled_tokens = Some(993);
    let r = tb.req(3, "acme");
    r.prompt_tokens = 50;
    r.prefilled_tokens = Some(10);
    r.http_status = 400;
    let dir = tempfile::tempdir().unwrap();
    let rep = scope(&tb.record(dir.path()));
    let got: Vec<(u64, &str, Option<u64>)> = rep
        .anomalies
        .iter()
        .map(|a| (a.request_id, a.kind.as_str(), a.limit))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "error_looks_like_success", None),
            (1, "prompt_exceeds_prefill_pool", Some(994)),
        ]
    );
}
