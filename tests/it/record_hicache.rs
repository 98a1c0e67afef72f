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
/// trace directory.
fn drive(py: &Path, mode: &str, d: &tempfile::TempDir) -> (serde_json::Value, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.path().join("kvtrail.sock");
    let out = d.path().join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join("tests/data/record/deploy-hicache-cpu.json")),
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

#[test]
fn hicache_clean_offload_and_load_back_report_nothing() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "clean", &d);
    // The scenario is the one that would go wrong without the copies: C's
    // load lands in device slots B's KV had occupied, and the tensors hold
    // A's KV there (same tenant as C, the prefix C asked for).
    assert!(
        facts["C_loaded_into_B_slots"].as_u64().unwrap() >= 4,
        "{facts}"
    );
    assert_eq!(facts["C_prefix_true_owner"], serde_json::json!({"A": 12}));
    assert_eq!(facts["counts"]["hicache_loads"], 1, "{facts}");
    assert_eq!(facts["counts"]["hicache_key_mismatch"], 0, "{facts}");
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    verified_complete(&out);
    let r = scope(&out);
    assert!(
        r.affected_responses.is_empty(),
        "{:?}",
        r.affected_responses
    );
}

#[test]
fn hicache_stale_host_slot_is_found_with_its_true_sources() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (facts, out) = drive(&py, "stale", &d);
    assert_eq!(facts["counts"]["hook_errors"], 0, "{facts}");
    verified_complete(&out);
    let r = scope(&out);
    assert_eq!(r.affected_responses.len(), 1, "{:?}", r.affected_responses);
    let a = &r.affected_responses[0];
    assert_eq!(a.external_id.as_deref(), Some("C"));
    assert_eq!(a.confidence, Confidence::Confirmed);
    // Scope's sources, by request, are what the KV tensors hold in the
    // slots C read (the markers each request's forward wrote).
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
    assert!(
        r.affected_responses
            .iter()
            .all(|a| a.confidence != Confidence::Confirmed),
        "{:?}",
        r.affected_responses
    );
}
