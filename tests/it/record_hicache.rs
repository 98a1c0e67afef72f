//! SGLang HiCache end to end: tests/sglang/hicache_driver.py drives SGLang
//! 0.5.19's real `HiRadixCache`, `HiCacheController` and
//! `MHATokenToKVPoolHost` on CPU with the kvtrail_sglang hook installed,
//! streaming to a real `kvtrail record`. Only the kernel boundary is
//! replaced: `sgl_kernel.kvcacheio.transfer_kv_direct` (imported by SGLang
//! only on CUDA or HIP) by a CPU copy of the same rows between the same
//! tensors, and the host pool is not pinned (pinning registers memory with
//! the CUDA driver). Checked on the trace: a clean offload, device
//! eviction, prefix hit and load back reports nothing; a host slot reused
//! without dropping its key is found, with the sources the KV tensors
//! really hold. The sidecar runs with `--live`: on every capture its live
//! findings equal a fresh scope.
//!
//! The decode radix cache under HiCache (`decode`, `decode-stale`): a
//! prefill pool and a decode pool whose HiRadixCache backs up to its host
//! pool, each on its own connection (the decode pool's connection holds its
//! host pool). Real besides the above: SGLang's decode HiCache steps,
//! DecodePreallocQueue._match_prefix_and_lock, the L1/L2/L3 split of
//! DecodeHiCachePreallocMixin, the load-back state machine
//! (DecodeHiCacheTransferMixin._process_hicache_local_restores,
//! _try_hicache_queue_load_back) and its commit into the request
//! (_commit_hicache_local_restore_to_req), CommonKVSender.init and
//! _prepare_send_indices (on a sender without its network __init__), the
//! prefill pool's allocator. Driven directly as record_driver.py does: the
//! hook's wrappers of _pre_alloc, _commit_transfer_to_req, alloc_for_extend
//! and release_kv_cache around small functions doing what SGLang's do,
//! on_send_metadata and on_prebuilt (their callers need ZMQ, RDMA'd
//! metadata buffers and a Scheduler), and the transfer engine's page copy
//! from the prefill tensors into the decode tensors (the same CPU copy as
//! the kernel boundary). A's KV arrives in the decode pool by transfer, is
//! inserted in the decode tree, written through to host and evicted; C hits
//! it on the host and SGLang loads it back into B's former device slots.
//!
//! The tree SGLang 0.5.19 builds by default with --enable-hierarchical-cache
//! (`unified`, `unified-stale`, and for the decode pool `decode-unified`,
//! `decode-unified-stale`): UnifiedRadixCache with init_hicache, its
//! HybridCacheController and HostPoolGroup, SGLang's own release_kv_cache.
//! L3 storage on it (`storage`): SGLang's HiCacheFile backend, its storage
//! threads and prefetch.
//!
//! Needs the venv of .ci/setup.d/30-sglang.sh (+ blake3 from 31-...): with
//! `CI` set a missing venv FAILS the test; otherwise it is skipped with a
//! message.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvtrail::scope::{Confidence, ScopeReport};

use crate::support::cli::{kvtrail, s};
use crate::support::record::assert_live_equals_scope;
use crate::support::venv;

/// Runs the driver in `mode` against a sidecar; returns its facts and the
/// trace directory. The `decode` modes record a prefill pool, a decode pool
/// and its host pool (deploy-hicache-decode-cpu.json).
fn drive(py: &Path, mode: &str, d: &tempfile::TempDir) -> (serde_json::Value, PathBuf) {
    let deploy = if mode.starts_with("decode") {
        "tests/data/record/deploy-hicache-decode-cpu.json"
    } else {
        "tests/data/record/deploy-hicache-cpu.json"
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.path().join("kvtrail.sock");
    let out = d.path().join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join(deploy)),
        "--out",
        s(&out),
        "--health-secs",
        "0",
        // Live detection on every capture: compared with a fresh scope
        // below.
        "--live",
    ])
    .spawn();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let driver = Command::new(py)
        .arg("-W")
        .arg("ignore")
        .arg(root.join("tests/sglang/hicache_driver.py"))
        .arg(&sock)
        .arg(mode)
        .env(
            "PYTHONPATH",
            std::env::join_paths([root.join("hooks/sglang/src"), root.join("hooks/client/src")])
                .unwrap(),
        )
        .current_dir(root.join("tests/sglang"))
        .output()
        .unwrap();
    unsafe { libc::kill(sidecar.id() as i32, libc::SIGTERM) };
    let status = sidecar.wait().unwrap();
    assert!(
        driver.status.success(),
        "hicache_driver.py {mode} failed:\n{}\n{}",
        String::from_utf8_lossy(&driver.stdout),
        String::from_utf8_lossy(&driver.stderr)
    );
    assert!(status.success(), "sidecar: {status:?}");
    let stdout = String::from_utf8_lossy(&driver.stdout);
    let facts = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    // What live detection found while recording (the tier copies applied
    // as they came) is what a fresh scope finds on the trace.
    assert_live_equals_scope(&out);
    (facts, out)
}

fn scope(out: &Path) -> ScopeReport {
    let trace = kvtrail::trace::Trace::open(out).unwrap();
    kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &kvtrail::progress::NoReporter,
    )
    .unwrap()
}

fn verified_complete(out: &Path) {
    let v = kvtrail(["verify", s(out)]).run();
    assert_eq!(v.code, 0, "{}\n{}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
}

/// The capture verifies complete and scopes clean.
fn assert_clean(out: &Path) {
    verified_complete(out);
    let r = scope(out);
    assert!(
        r.affected_responses.is_empty(),
        "{:?}",
        r.affected_responses
    );
}

/// No response of the report is confirmed affected.
fn nothing_confirmed(r: &ScopeReport) {
    assert!(
        r.affected_responses
            .iter()
            .all(|a| a.confidence != Confidence::Confirmed),
        "{:?}",
        r.affected_responses
    );
}

/// A load the capture could not vouch for: the capture is incomplete, C
/// is possibly affected, and nothing is confirmed.
fn c_possible_only(out: &Path) {
    let r = scope(out);
    assert!(!r.coverage.complete, "{:?}", r.coverage);
    let c: Vec<_> = r
        .affected_responses
        .iter()
        .filter(|a| a.external_id.as_deref() == Some("C"))
        .collect();
    assert_eq!(c.len(), 1, "{:?}", r.affected_responses);
    assert_eq!(c[0].confidence, Confidence::Possible, "{:?}", c[0]);
    nothing_confirmed(&r);
}

/// The capture verifies complete and the one affected response is C,
/// confirmed, with exactly the sources, by request, that the KV tensors
/// hold in the slots C read (the markers each request's forward wrote),
/// B among them.
fn c_confirmed_with_true_sources(facts: &serde_json::Value, out: &Path) {
    verified_complete(out);
    let r = scope(out);
    assert_eq!(r.affected_responses.len(), 1, "{:?}", r.affected_responses);
    let a = &r.affected_responses[0];
    assert_eq!(a.external_id.as_deref(), Some("C"));
    assert_eq!(a.confidence, Confidence::Confirmed);
    let truth = facts["C_prefix_true_owner"].as_object().unwrap();
    let mut got = serde_json::Map::new();
    for src in &a.sources {
        got.insert(src.external_id.clone().unwrap(), src.tokens.into());
    }
    assert_eq!(&got, truth, "{facts}");
    assert!(
        truth.get("B").and_then(|v| v.as_u64()).unwrap_or(0) > 0,
        "{facts}"
    );
    let total: u64 = truth.values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(a.foreign_tokens, total);
}

#[test]
fn hicache_clean_offload_and_load_back_report_nothing() {
    local_clean("clean");
}

/// The tree SGLang builds by default (UnifiedRadixCache + init_hicache, a
/// HybridCacheController over a HostPoolGroup): the same clean run.
#[test]
fn hicache_unified_tree_clean_offload_and_load_back_report_nothing() {
    local_clean("unified");
}

fn local_clean(mode: &str) {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, mode, &d);
    // The scenario is the one that would go wrong without the copies: C's
    // load lands in device slots B's KV had occupied, and the tensors hold
    // A's KV there (same tenant as C, the prefix C asked for).
    assert!(
        facts["C_loaded_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({"A": 12}));
    // A's and B's backups, and C's 2 new tokens; one load back.
    assert_eq!(facts["counts"]["hicache_offloads"], 3, "{facts}");
    assert_eq!(facts["counts"]["hicache_loads"], 1, "{facts}");
    assert_eq!(facts["counts"]["hicache_key_mismatch"], 0, "{facts}");
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    assert_clean(&out);
}

#[test]
fn hicache_stale_host_slot_is_found_with_its_true_sources() {
    local_stale("stale");
}

#[test]
fn hicache_unified_tree_stale_host_slot_is_found_with_its_true_sources() {
    local_stale("unified-stale");
}

fn local_stale(mode: &str) {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, mode, &d);
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    assert_eq!(facts["counts"]["hicache_key_mismatch"], 12, "{facts}");
    c_confirmed_with_true_sources(&facts, &out);
}

/// A failing hook never stops the engine: HiCache's offloads and the load
/// back still run (the KV is really there), the hook counts the failures,
/// and each missed copy is a hole, so the capture is incomplete and no
/// read over it is confirmed (never the false finding a silently missed
/// load back would make).
#[test]
fn hicache_hook_failure_is_counted_and_leaves_holes() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "fault", &d);
    assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({"A": 12}));
    assert!(
        facts["counts"]["hook_errors"].as_u64().unwrap() >= 2,
        "{facts}"
    );
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(v.stdout.contains("INCOMPLETE"), "{}", v.stdout);
    let r = scope(&out);
    nothing_confirmed(&r);
}

/// Decode radix cache under HiCache: KV that arrived by transfer is backed
/// up to host, evicted, hit by a later request and loaded back; nothing is
/// wrong, and the capture says so (the transfer's commit does not break
/// the decode connection's count of positions that the offloads name).
#[test]
fn hicache_decode_transfer_offload_and_load_back_report_nothing() {
    decode_clean("decode");
}

/// The same on the unified tree, SGLang's default decode tree cache.
#[test]
fn hicache_unified_decode_transfer_offload_and_load_back_report_nothing() {
    decode_clean("decode-unified");
}

fn decode_clean(mode: &str) {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, mode, &d);
    // C's prefix came from the host (SGLang's restore), into device slots
    // B's transferred KV had occupied; the tensors hold A's KV there.
    assert_eq!(
        facts["C_loaded_into"].as_array().unwrap().len(),
        12,
        "{facts}"
    );
    assert!(
        facts["C_loaded_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({"A": 12}));
    // A and B each: one offload; C: its 2 transferred tokens are a new node.
    assert_eq!(facts["counts"]["hicache_offloads"], 3, "{facts}");
    assert_eq!(facts["counts"]["hicache_loads"], 1, "{facts}");
    assert_eq!(facts["counts"]["hicache_key_mismatch"], 0, "{facts}");
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    assert_clean(&out);
}

/// The decode tree keeps A's node naming host slots that were freed and
/// taken by B's backup: C's restore loads B's KV, and the finding names the
/// sources the decode tensors really hold, confirmed.
#[test]
fn hicache_decode_stale_host_slot_is_found_with_its_true_sources() {
    decode_stale("decode-stale");
}

#[test]
fn hicache_unified_decode_stale_host_slot_is_found_with_its_true_sources() {
    decode_stale("decode-unified-stale");
}

fn decode_stale(mode: &str) {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, mode, &d);
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    assert_eq!(facts["counts"]["hicache_key_mismatch"], 12, "{facts}");
    c_confirmed_with_true_sources(&facts, &out);
}

/// L3 storage on the unified tree (HiCacheFile): C's prefix comes from
/// storage, prefetched into host slots and loaded back. What the backend
/// wrote there is out of the hook's sight, so the prefetch is a hole: C is
/// possibly affected, never confirmed, never clean, and the capture says
/// it is incomplete (rather than naming the host slots' earlier holder as
/// a source, as an unrecorded prefetch would).
#[test]
fn hicache_storage_prefetch_is_recorded_as_unverifiable() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "storage", &d);
    assert!(facts["storage_files"].as_u64().unwrap() >= 12, "{facts}");
    assert_eq!(facts["A_evicted_from_host"], 12, "{facts}");
    assert_eq!(facts["C_from_storage"], 12, "{facts}");
    assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({"A": 12}));
    let c = &facts["counts"];
    assert_eq!(c["hicache_storage_loads"], 1, "{facts}");
    assert_eq!(c["hicache_storage_tokens"], 12, "{facts}");
    assert_eq!(c["hicache_loads"], 1, "{facts}");
    assert_eq!(c["hicache_key_mismatch"], 0, "{facts}");
    assert_eq!(c["hook_errors"], 0, "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(v.stdout.contains("INCOMPLETE"), "{}", v.stdout);
    c_possible_only(&out);
}

/// HiCache on without a cache pool (no KVTRAIL_CACHE_POOL): the host tier
/// is out of the capture, so C's load back, into device slots B's KV had
/// occupied, is a hole in the device pool. C is possibly affected, never
/// confirmed with B (whose KV the trace last saw there) as the source,
/// and the capture says it is incomplete.
#[test]
fn hicache_without_a_cache_pool_records_loads_as_holes() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "uncached", &d);
    assert!(
        facts["C_loaded_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    let c = &facts["counts"];
    assert_eq!(c["hicache_loads_unverified"], 1, "{facts}");
    assert_eq!(c["hicache_offloads"], 0, "{facts}");
    assert_eq!(c["hook_errors"], 0, "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(v.stdout.contains("INCOMPLETE"), "{}", v.stdout);
    c_possible_only(&out);
}

/// Decode retraction to the host pool (the unified tree's
/// `retraction_backup` / `retraction_restore`, a PD decode worker's default
/// with an MHA model): SGLang copies the retracted request's KV to host
/// slots and back with the transfer engine itself, not through the
/// controller's write / load. A resumes into device slots B's KV had
/// occupied, restored from its own backup: its read is its own KV, so the
/// capture reports nothing (unrecorded, the read would be confirmed foreign
/// with B, an innocent customer, as the source).
#[test]
fn hicache_retraction_to_the_host_pool_is_recorded_as_copies() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "retract", &d);
    assert!(
        facts["A_resumed_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    assert_eq!(facts["A_reads_true_owner"], serde_json::json!({"A": 12}));
    assert_clean(&out);
    let c = &facts["counts"];
    assert_eq!(c["hicache_retraction_backups"], 1, "{facts}");
    assert_eq!(c["hicache_retraction_restores"], 1, "{facts}");
    assert_eq!(c["hook_errors"], 0, "{facts}");
}

/// The same retraction without a cache pool, and with the `cpu_tensor`
/// backend (a per-request CPU tensor, in no pool): the restore is a hole
/// in the device pool, so A's read is uncertain (possible), never
/// confirmed with B as the source, and the capture is incomplete.
#[test]
fn hicache_retraction_without_a_cache_pool_is_a_hole() {
    retraction_hole("retract-uncached");
}

#[test]
fn retraction_to_cpu_tensors_is_a_hole() {
    retraction_hole("retract-cpu");
}

fn retraction_hole(mode: &str) {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, mode, &d);
    assert!(
        facts["A_resumed_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    assert_eq!(facts["A_reads_true_owner"], serde_json::json!({"A": 12}));
    let c = &facts["counts"];
    assert_eq!(c["hicache_loads_unverified"], 1, "{facts}");
    assert_eq!(c["hook_errors"], 0, "{facts}");
    let r = scope(&out);
    assert!(!r.coverage.complete, "{:?}", r.coverage);
    nothing_confirmed(&r);
}

/// A load back on a tree core the hook does not patch (SGLang's Rust one;
/// here the Python core with its wrappers taken off): which node each
/// loaded host slot should hold is unseen, so the hook can neither grant
/// the loaded slots (a stale key's exposure would read as shared) nor
/// withhold the grant (the prefix's owner would be named): the load is a
/// hole after its copy, and C is possible, never confirmed, never clean.
#[test]
fn hicache_load_back_on_an_unhooked_tree_core_is_a_hole() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "unified-unhooked", &d);
    let c = &facts["counts"];
    assert_eq!(c["hicache_loads"], 1, "{facts}");
    assert_eq!(c["hicache_loads_unverified"], 1, "{facts}");
    assert_eq!(c["hook_errors"], 0, "{facts}");
    c_possible_only(&out);
}

/// SGLang's direct L3 path (the unified tree's external cache linker, no
/// host tier): C's prefix comes from an external store into device slots
/// B's KV had occupied. The store is out of the capture's sight, so the
/// load is a hole: C is possible, its sources (the slots' earlier writers,
/// B among them) only possible, never confirmed, C never listed as a
/// shared read of B's KV, and the capture is incomplete. The same whether C really read
/// A's KV (`linker`) or, with A's keys planted to name B's pages, B's
/// (`linker-stale`): never clean.
#[test]
fn linker_load_back_is_recorded_as_unverifiable() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    for (mode, truth) in [("linker", "A"), ("linker-stale", "B")] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out) = drive(&py, mode, &d);
        assert!(
            facts["C_loaded_into_B_slots"].as_u64().unwrap() >= 4,
            "{facts}"
        );
        assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({truth: 12}));
        let c = &facts["counts"];
        assert_eq!(c["linker_loads_unverified"], 1, "{facts}");
        assert_eq!(c["linker_tokens"], 12, "{facts}");
        assert_eq!(c["hook_errors"], 0, "{facts}");
        let v = kvtrail(["verify", s(&out)]).run();
        assert!(v.stdout.contains("INCOMPLETE"), "{}", v.stdout);
        c_possible_only(&out);
        let r = scope(&out);
        assert!(
            r.affected_responses
                .iter()
                .flat_map(|a| &a.sources)
                .all(|s| s.confidence == Confidence::Possible),
            "{mode}: a source named with certainty: {:?}",
            r.affected_responses
        );
        assert!(
            r.cross_tenant_shared
                .iter()
                .all(|x| x.external_id.as_deref() != Some("C")),
            "{mode}: {:?}",
            r.cross_tenant_shared
        );
    }
}
