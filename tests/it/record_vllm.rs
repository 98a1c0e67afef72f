//! End to end against the real `vllm` package (0.33.0, CPU): `kvtrail
//! record` on a temp Unix socket, tests/vllm/record_driver.py driving
//! vLLM's real Scheduler, KV cache manager, block pool and NixlConnector
//! scheduler side with synthetic model-runner outputs (the driver's
//! docstring says which parts are real), with the kvtrail_vllm hook
//! installed. The captures: a clean P/D run scopes clean; the
//! vllm-project/vllm#52234 stale reference (decode loads blocks the
//! producer reused for another tenant's request, NIXL reports done) is found
//! by `kvtrail scope` with its true source, also on a hybrid model (full
//! attention + sliding window, whose groups alias one block pool);
//! out-of-range block ids, a failed and a partial load leave evidence
//! (holes, counters, the failure policy); a producer of another block
//! size gives copies (block-form pulls expanded by the sidecar). Every capture runs with
//! `--live`, and its live findings equal a fresh scope.
//!
//! Needs the venv of .ci/setup.d/32-vllm.sh (+ the hook's dependencies from
//! 33-kvtrail-vllm-hook.sh); a missing venv FAILS these tests. The wire
//! tests at the end (hostile `xfer_pull` lines) need no venv.

use crate::support::record::{self, Rig};
use crate::support::venv;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvtrail::schema::Op;
use kvtrail::trace::{Manifest, Trace};

use crate::support::cli::{kvtrail, s};

fn python() -> PathBuf {
    venv::VLLM
        .python()
        .expect("the vLLM venv is missing: run .ci/setup.d/32-vllm.sh and .ci/setup.d/33-kvtrail-vllm-hook.sh")
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the driver in `mode` against a sidecar, stops it with SIGTERM;
/// returns the driver's facts, the trace and the sidecar's stderr.
fn capture(mode: &str, d: &tempfile::TempDir) -> (serde_json::Value, PathBuf, String) {
    capture_with(mode, d, true)
}

fn capture_with(
    mode: &str,
    d: &tempfile::TempDir,
    hook_ok: bool,
) -> (serde_json::Value, PathBuf, String) {
    capture_in(mode, d, hook_ok, "deploy-vllm-cpu.json")
}

fn capture_in(
    mode: &str,
    d: &tempfile::TempDir,
    hook_ok: bool,
    deploy: &str,
) -> (serde_json::Value, PathBuf, String) {
    capture_exit(mode, d, hook_ok, deploy, "uninstall")
}

/// `exit`: "uninstall" (the driver uninstalls the hook) or "plain" (it
/// exits as an engine does; the hook's exit handler flushes).
fn capture_exit(
    mode: &str,
    d: &tempfile::TempDir,
    hook_ok: bool,
    deploy: &str,
    exit: &str,
) -> (serde_json::Value, PathBuf, String) {
    capture_script("record_driver.py", mode, d, hook_ok, deploy, exit)
}

/// As [`capture_exit`], with the driver `script` of tests/vllm.
fn capture_script(
    script: &str,
    mode: &str,
    d: &tempfile::TempDir,
    hook_ok: bool,
    deploy: &str,
    exit: &str,
) -> (serde_json::Value, PathBuf, String) {
    let py = python();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.path().join("kvtrail.sock");
    let out = d.path().join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join("tests/data/record").join(deploy)),
        "--out",
        s(&out),
        "--health-secs",
        "0",
        "--from-engine-start",
        // Live detection on every capture: compared with a fresh scope
        // below, whatever the test checks after.
        "--live",
    ])
    .spawn();
    wait_for(&sock);
    let driver = Command::new(py)
        .arg("-W")
        .arg("ignore")
        .arg(root.join("tests/vllm").join(script))
        .arg(&sock)
        .arg(mode)
        .env(
            "PYTHONPATH",
            crate::support::venv::hook_pythonpath("hooks/vllm/src"),
        )
        .env("HF_HUB_OFFLINE", "1")
        .env("KVTRAIL_DRIVER_EXIT", exit)
        .current_dir(d.path())
        .output()
        .unwrap();
    unsafe { libc::kill(sidecar.id() as i32, libc::SIGTERM) };
    let status = sidecar.wait().unwrap();
    let mut side_err = String::new();
    std::io::Read::read_to_string(sidecar.stderr.as_mut().unwrap(), &mut side_err).unwrap();
    assert!(
        driver.status.success(),
        "driver {mode} failed:\n{}\n{}",
        String::from_utf8_lossy(&driver.stdout),
        String::from_utf8_lossy(&driver.stderr)
    );
    assert!(status.success(), "sidecar: {status:?}\n{side_err}");
    let stdout = String::from_utf8_lossy(&driver.stdout);
    let facts: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(facts["vllm"], "0.33.0");
    for (w, st) in facts["hook_stats"].as_object().unwrap() {
        if w == "hook" {
            if hook_ok {
                assert_eq!(st["hook_errors"], 0, "{st}");
            }
            assert_eq!(st["pulls_unmapped"], 0, "{st}");
        } else {
            assert_eq!(st["dropped_queue"], 0, "{w}: {st}");
            assert_eq!(st["lost_sidecar_down"], 0, "{w}: {st}");
        }
    }
    // Every capture of the real package: what live detection found while
    // recording is what a fresh scope finds on the trace.
    record::assert_live_equals_scope(&out);
    (facts, out, side_err)
}

fn scope(out: &Path) -> serde_json::Value {
    let sc = kvtrail(["scope", s(out), "--json"]).run();
    assert!(sc.code == 0 || sc.code == 1, "{}", sc.stderr);
    serde_json::from_str(&sc.stdout).unwrap()
}

fn id_of(trace: &Trace, external: &str) -> u64 {
    for b in trace.requests() {
        for r in b.unwrap() {
            if r.external_id.as_deref() == Some(external) {
                return r.request_id;
            }
        }
    }
    panic!("no request {external}")
}

#[test]
fn vllm_clean_pd_run_scopes_clean() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture("clean", &d);
    // What the real classes did: two P/D loads and a local prefix hit.
    assert_eq!(facts["r1"]["finish"], "length", "{facts}");
    assert_eq!(facts["r2"]["finish"], "length", "{facts}");
    assert_eq!(facts["r4_finish"], "length", "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let m = Manifest::load(&out).unwrap();
    let rec = &m.capture.extra["record"];
    // r1's three blocks in one run; r2's seven in three (the producer's
    // blocks 3..7, 2, 1 into decode's 4..10).
    assert_eq!(rec["pulls_written"], 4, "{rec}");
    assert_eq!(rec["rejected_contract"], 0, "{rec}");
    let trace = Trace::open(&out).unwrap();
    // Decode's copies name the producer's pool and its blocks.
    let copies: Vec<_> = record::events(&trace)[&1]
        .iter()
        .filter(|e| e.op == Op::Write && e.src.is_some())
        .map(|e| (e.src.unwrap().pool, e.src.unwrap().slot_start, e.slot_count))
        .collect();
    let r1 = facts["r1_remote"][0].as_array().unwrap();
    assert_eq!(
        copies[0],
        (0, r1[0].as_u64().unwrap() as u32 * 16, 16 * r1.len() as u32),
        "{copies:?}"
    );
    // The decode prefix hit is a share, and the shared read is clean.
    assert!(
        record::events(&trace)[&1]
            .iter()
            .any(|e| e.op == Op::Share && e.request_id == id_of(&trace, "r4"))
    );
    let j = scope(&out);
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
}

#[test]
fn vllm_stale_reference_is_found_with_its_true_source() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture("stale", &d);
    check_stale(&facts, &out, &side_err, true);
}

/// The same script, run again without any pause between the engines and
/// exiting without uninstall(): the same answer every run (the pull waits
/// for the producer's mark; the exit handler sends the queue and `bye`).
#[test]
fn vllm_stale_reference_same_answer_every_run() {
    for (i, exit) in ["plain", "uninstall", "plain"].into_iter().enumerate() {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_exit("stale", &d, true, "deploy-vllm-cpu.json", exit);
        eprintln!("run {i} ({exit}): checked");
        check_stale(&facts, &out, &side_err, true);
    }
}

/// The stale reference's premise and verdict: r3 was handed r1's
/// reference after the producer reused (some of) those blocks for r2, NIXL
/// reported the read done, r3 answered; scope finds r3 alone, confirmed,
/// with its true sources: r2, whose KV the reused producer blocks held,
/// and r1 only where a block of its reference was not reused. With
/// `all_reused` the premise is that every block was reused (r2 alone).
fn check_stale(facts: &serde_json::Value, out: &Path, side_err: &str, all_reused: bool) {
    assert_eq!(facts["r3"]["finish"], "length", "{facts}");
    assert_eq!(facts["r3"]["remote"], facts["r1_remote"], "{facts}");
    let stale = facts["stale_blocks_now_r2"].as_array().unwrap().len();
    let r1_blocks = facts["r1_remote"][0].as_array().unwrap().len();
    if all_reused {
        assert_eq!(stale, r1_blocks, "{facts}");
    } else {
        assert!(stale > 0, "{facts}");
    }
    let v = kvtrail(["verify", s(out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    let trace = Trace::open(out).unwrap();
    let (r1, r2, r3) = (
        id_of(&trace, "r1"),
        id_of(&trace, "r2"),
        id_of(&trace, "r3"),
    );
    assert_ne!(r1, r2);
    let j = scope(out);
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(
        affected.len(),
        1,
        "{j:#}\nsidecar:\n{side_err}\nfacts: {facts}"
    );
    let a = &affected[0];
    assert_eq!(a["request_id"], r3, "{a}");
    assert_eq!(a["http_status"], 200, "{a}");
    assert_eq!(a["tenant"], "tenant-c", "{a}");
    assert_eq!(a["confidence"], "confirmed", "{a}");
    let mut sources: Vec<(u64, String)> = a["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["request_id"].as_u64().unwrap(),
                x["tenant"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    sources.sort_unstable();
    // The true source is r2 (whose KV the reused blocks held), not r1
    // (whose reference it was), except where a block was not reused.
    let mut want = vec![(r2, "tenant-b".to_string())];
    if stale < r1_blocks {
        want.push((r1, "tenant-a".to_string()));
    }
    want.sort_unstable();
    assert_eq!(sources, want, "{a}\nfacts: {facts}");
    // Positions 0..38 of r3's prompt came from the producer's blocks (r3
    // recomputed position 39 itself after the load).
    assert_eq!(a["foreign_tokens"], 39, "{a}");
}

/// A producer of 8-token blocks, decode of 16 (deploy-vllm-hetero.json):
/// the hook reports the producer's block ids, the sidecar expands them with
/// pool 0's page size, so the loads are copies (each decode block from two
/// producer blocks), not holes, and the run scopes clean.
#[test]
fn vllm_heterogeneous_block_sizes_give_copies() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_in("hetero", &d, true, "deploy-vllm-hetero.json");
    assert_eq!(facts["r1"]["finish"], "length", "{facts}");
    assert_eq!(facts["r2"]["finish"], "length", "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let m = Manifest::load(&out).unwrap();
    let rec = &m.capture.extra["record"];
    assert_eq!(rec["copies_unresolved"], 0, "{rec}\n{side_err}");
    assert_eq!(rec["rejected_contract"], 0, "{rec}");
    // Slot by slot, what NIXL's pairing reads: decode's blocks (16) end
    // to end read the producer's (8) end to end, the destination's tail
    // past the source not loaded (r1: 40 tokens, five producer blocks
    // into three decode blocks).
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v[0].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let mut want = std::collections::BTreeSet::new();
    for r in ["r1", "r2"] {
        let (l, rm) = (ids(&facts[r]["local"]), ids(&facts[r]["remote"]));
        let (d, src) = (l.len() as u64 * 16, rm.len() as u64 * 8);
        let base = src - d.min(src);
        for t in 0..d.min(src) {
            let k = base + t;
            want.insert((
                l[(t / 16) as usize] * 16 + t % 16,
                rm[(k / 8) as usize] * 8 + k % 8,
            ));
        }
    }
    assert_eq!(ids(&facts["r1"]["remote"]).len(), 5, "{facts}");
    let trace = Trace::open(&out).unwrap();
    let mut got = std::collections::BTreeSet::new();
    for e in record::events(&trace)[&1]
        .iter()
        .filter(|e| e.src.is_some())
    {
        let src = e.src.unwrap();
        assert_eq!(src.pool, 0, "{e:?}");
        for i in 0..e.slot_count as u64 {
            got.insert((e.slot_start as u64 + i, src.slot_start as u64 + i));
        }
    }
    assert_eq!(got, want, "{facts}");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
}

/// The stale reference with a producer of another block size: found, with
/// its true source, as with equal block sizes.
#[test]
fn vllm_heterogeneous_stale_reference_is_found_with_its_true_source() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_in("hetero-stale", &d, true, "deploy-vllm-hetero.json");
    // The producer's 16-block pool leaves r2 one of r1's five blocks: r1
    // is a true source of that block's tokens.
    check_stale(&facts, &out, &side_err, false);
}

/// The stale reference on a hybrid model: full attention + a sliding
/// window, two KV cache groups over one shared BlockPool on each engine
/// (vLLM's HybridKVCacheCoordinator). The groups alias the same blocks, so
/// the producer's reuse of r1's full-attention block by r2's sliding-window
/// layers is what r3 reads: the true source of each slot is whoever wrote
/// that block last, in either group.
/// A copy-on-write block copy on the real scheduler (tests/vllm/cow_driver.py):
/// b's partial prefix hit on a's tail block is redirected to a private
/// block, which held x's KV before. Returns the facts, the trace, b's and
/// x's trace ids and the blocks of the copy (source, destination).
fn capture_cow(mode: &str, d: &tempfile::TempDir) -> (serde_json::Value, PathBuf, u64, u64) {
    let (facts, out, side_err) = capture_script(
        "cow_driver.py",
        mode,
        d,
        true,
        "deploy-vllm-cow.json",
        "uninstall",
    );
    // What the real classes did: every request ran to its end, and b's
    // private block is one x wrote (the pool is small, x freed it).
    for r in ["x", "a", "b"] {
        assert_eq!(facts[r], "length", "{facts}");
    }
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let trace = Trace::open(&out).unwrap();
    (facts.clone(), out, id_of(&trace, "b"), id_of(&trace, "x"))
}

/// The full-attention copy of b's step: a's tail block (a's second block)
/// into b's second block, which x held before.
fn cow_blocks(facts: &serde_json::Value) -> (u32, u32) {
    let a_tail = facts["a_blocks"][1].as_u64().unwrap() as u32;
    let b_priv = facts["b_blocks"][1].as_u64().unwrap() as u32;
    assert_ne!(a_tail, b_priv, "{facts}");
    let x: Vec<u64> = facts["x_blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        x.contains(&(b_priv as u64)),
        "b's private block was not x's: {facts}"
    );
    (a_tail, b_priv)
}

#[test]
fn vllm_copy_on_write_is_recorded_and_scopes_clean() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, b, _) = capture_cow("cow", &d);
    let (src, dst) = cow_blocks(&facts);
    // The scheduler handed the worker the copy in b's step.
    assert!(
        facts["b_copies"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c[0] == src && c[1] == dst),
        "{facts}"
    );
    assert_eq!(facts["hook_stats"]["hook"]["cow_copies"], 1, "{facts}");
    assert_eq!(facts["hook_stats"]["hook"]["cow_unverified"], 0, "{facts}");
    // One same-pool copy of the whole 64-token block, for b, before b's
    // reads; then a share of the copied block to b.
    let trace = Trace::open(&out).unwrap();
    let evs = &record::events(&trace)[&0];
    let copies: Vec<_> = evs.iter().filter(|e| e.src.is_some()).collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let c = copies[0];
    let cs = c.src.unwrap();
    assert_eq!(
        (
            c.request_id,
            c.slot_start,
            c.slot_count,
            cs.pool,
            cs.slot_start
        ),
        (b, dst * 64, 64, 0, src * 64),
        "{c:?}"
    );
    assert!(cs.seq < c.seq, "{c:?}");
    let first_read = evs
        .iter()
        .find(|e| e.op == Op::Read && e.request_id == b)
        .unwrap();
    assert!(c.seq < first_read.seq, "{c:?} {first_read:?}");
    assert!(
        evs.iter().any(|e| e.op == Op::Share
            && e.request_id == b
            && e.slot_start == dst * 64
            && e.seq > c.seq),
        "no share of the copied block to b"
    );
    let j = scope(&out);
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
}

/// The copy dropped (the engine lost it, the worker never ran it): b's
/// private block keeps x's KV, and b's attention reads positions 64..80
/// (its hit's tail) from it: found, confirmed, with x as the true source.
#[test]
fn vllm_dropped_copy_on_write_is_found_with_its_true_source() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, b, x) = capture_cow("cow-dropped", &d);
    let (src, dst) = cow_blocks(&facts);
    assert!(
        !facts["b_copies"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c[0] == src && c[1] == dst),
        "{facts}"
    );
    assert_eq!(facts["hook_stats"]["hook"]["cow_copies"], 0, "{facts}");
    let j = scope(&out);
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(affected.len(), 1, "{j:#}");
    let a = &affected[0];
    assert_eq!(a["request_id"], b, "{a}");
    assert_eq!(a["tenant"], "tenant-a", "{a}");
    assert_eq!(a["confidence"], "confirmed", "{a}");
    assert_eq!(a["foreign_tokens"], 16, "{a}");
    let sources: Vec<u64> = a["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["request_id"].as_u64().unwrap())
        .collect();
    assert_eq!(sources, vec![x], "{a}");
}

#[test]
fn vllm_hybrid_stale_reference_is_found_with_its_true_sources() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture("hybrid", &d);
    assert_eq!(
        facts["groups"],
        serde_json::json!(["FullAttentionManager", "SlidingWindowManager"])
    );
    assert_eq!(facts["r3"]["finish"], "length", "{facts}");
    assert_eq!(facts["r3"]["remote"], facts["r1_remote"], "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    let trace = Trace::open(&out).unwrap();
    let (r1, r2, r3) = (
        id_of(&trace, "r1"),
        id_of(&trace, "r2"),
        id_of(&trace, "r3"),
    );
    // Independent expectation from the blocks vLLM handed out: r3 reads
    // positions 0..39 (it recomputes position 39) of each group through
    // r1's reference; a slot holds r2's KV when r2 (40 tokens) wrote that
    // offset of that block in either group, else r1's.
    let blocks = |k: &str| -> Vec<Vec<u64>> {
        facts[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                g.as_array()
                    .unwrap()
                    .iter()
                    .map(|b| b.as_u64().unwrap())
                    .collect()
            })
            .collect()
    };
    let (ref1, tab2) = (blocks("r1_remote"), blocks("r2_remote"));
    assert_eq!(ref1.len(), 2, "{facts}");
    let mut want: std::collections::BTreeMap<u64, u64> = Default::default();
    for group in &ref1 {
        for pos in 0..39u64 {
            let b = group[(pos / 16) as usize];
            let off = pos % 16;
            let by_r2 = tab2.iter().any(|t| {
                t.iter()
                    .position(|&x| x == b)
                    .is_some_and(|i| i as u64 * 16 + off < 40)
            });
            *want.entry(if by_r2 { r2 } else { r1 }).or_default() += 1;
        }
    }
    assert!(
        want.len() == 2,
        "the plant needs both sources: {want:?} {facts}"
    );
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(affected.len(), 1, "{j:#}");
    let a = &affected[0];
    assert_eq!(a["request_id"], r3, "{a}");
    assert_eq!(a["http_status"], 200, "{a}");
    assert_eq!(a["confidence"], "confirmed", "{a}");
    let got: std::collections::BTreeMap<u64, u64> = a["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["request_id"].as_u64().unwrap(),
                x["tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want, "{a}");
    assert_eq!(a["foreign_tokens"], 2 * 39, "{a}");
    // Decode's sliding window dropped r3's blocks mid-request: those frees
    // are r3's (before its last read), none is the engine's.
    let ev = &record::events(&trace)[&1];
    assert!(
        !ev.iter().any(|e| e.op == Op::Free && e.request_id == 0),
        "engine frees"
    );
    let last_read = ev
        .iter()
        .filter(|e| e.op == Op::Read && e.request_id == r3)
        .map(|e| e.seq)
        .max()
        .unwrap();
    assert!(
        ev.iter()
            .any(|e| e.op == Op::Free && e.request_id == r3 && e.seq < last_read),
        "no mid-request free"
    );
}

/// vLLM's own CPU offload (OffloadingConnector, CPUOffloadingSpec), scheduler
/// side for real with a synthetic CPU worker: a's blocks are stored to the
/// tier (pool 2, role cache), evicted from the GPU by b, loaded back for a2.
/// The copies carry their first owner; a load of chunks stored under the
/// key it asked for is a share (clean), a load of a chunk the tier's index
/// wrongly names (the plant: b's chunks under a's keys) is a foreign read
/// with the true source, b.
#[test]
fn vllm_cpu_offload_is_recorded_as_tier_copies() {
    for (mode, stale) in [("offload", false), ("offload-stale", true)] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_in(mode, &d, true, "deploy-vllm-offload.json");
        assert_eq!(
            facts["finish"],
            serde_json::json!({"a": "length", "b": "length", "a2": "length"}),
            "{facts}"
        );
        let jobs = &facts["offload_jobs"];
        assert_eq!(jobs["store"].as_array().unwrap().len(), 2, "{facts}");
        let load = &jobs["load"].as_array().unwrap();
        assert_eq!(load.len(), 1, "{facts}");
        assert_eq!(load[0]["req"], "a2");
        let v = kvtrail(["verify", s(&out)]).run();
        assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
        let trace = Trace::open(&out).unwrap();
        let ev = record::events(&trace);
        // Stores: copies into the cache pool from the GPU pool, one run per
        // contiguous pair; the load: a copy back from the cache pool.
        let cache: Vec<_> = ev[&2]
            .iter()
            .filter(|e| e.op == Op::Write)
            .map(|e| e.src.expect("a tier write is a copy").pool)
            .collect();
        assert!(
            !cache.is_empty() && cache.iter().all(|&p| p == 0),
            "{cache:?}"
        );
        let a2 = id_of(&trace, "a2");
        let loaded: u32 = ev[&0]
            .iter()
            .filter(|e| {
                e.op == Op::Write && e.request_id == a2 && e.src.is_some_and(|c| c.pool == 2)
            })
            .map(|e| e.slot_count)
            .sum();
        assert_eq!(loaded, 64, "a's four blocks come back");
        let mismatch = facts["hook_stats"]["hook"]["offload_key_mismatch"]
            .as_u64()
            .unwrap();
        let j = scope(&out);
        assert_eq!(j["coverage"]["complete"], true, "{j:#}");
        let affected = j["affected_responses"].as_array().unwrap();
        if !stale {
            assert_eq!(mismatch, 0);
            assert!(affected.is_empty(), "{j:#}");
            continue;
        }
        assert_eq!(facts["planted"], 4, "{facts}");
        assert_eq!(mismatch, 4);
        assert_only_a2_read_b(&trace, a2, affected, &j);
    }
}

/// CPU offload on a hybrid model (full attention + a sliding window, two
/// KV cache groups over one block pool): the hook places only group 0's
/// chunks and keys, so a2's load back, into both groups' blocks, is a hole
/// in the engine's pool, not copies under keys it cannot match. a2 is
/// possibly affected, nothing is confirmed, and the capture says it is
/// incomplete (before, the load's key check failed and the clean reload
/// read as foreign).
#[test]
fn vllm_cpu_offload_of_a_hybrid_model_loads_are_holes() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_in("offload-hybrid", &d, true, "deploy-vllm-offload.json");
    assert_eq!(
        facts["finish"],
        serde_json::json!({"a": "length", "b": "length", "a2": "length"}),
        "{facts}"
    );
    let load = &facts["offload_jobs"]["load"].as_array().unwrap();
    assert_eq!(load.len(), 1, "{facts}");
    assert_eq!(load[0]["req"], "a2");
    let n = load[0]["dst"].as_array().unwrap().len() as u64;
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["offload_unverified"], n, "{facts}");
    assert_eq!(hook["offload_key_mismatch"], 0, "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(
        v.stdout.contains("INCOMPLETE"),
        "{}\n{}\n{side_err}",
        v.stdout,
        v.stderr
    );
    let trace = Trace::open(&out).unwrap();
    let a2 = id_of(&trace, "a2");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], false, "{j:#}");
    let affected = j["affected_responses"].as_array().unwrap();
    let mine: Vec<_> = affected.iter().filter(|a| a["request_id"] == a2).collect();
    assert_eq!(mine.len(), 1, "{j:#}");
    assert_eq!(mine[0]["confidence"], "possible", "{j:#}");
    assert!(
        affected.iter().all(|a| a["confidence"] != "confirmed"),
        "{j:#}"
    );
}

/// The verdict of an offload capture (a stored, evicted, loaded back for
/// a2): clean, or, with a planted stale tier entry, a2 the one affected
/// response, confirmed, 64 foreign tokens, source b (tenant-b).
fn check_offload_verdict(facts: &serde_json::Value, out: &Path, side_err: &str, stale: bool) {
    let mode = &facts["mode"];
    assert_eq!(
        facts["finish"],
        serde_json::json!({"a": "length", "b": "length", "a2": "length"}),
        "{facts}"
    );
    let v = kvtrail(["verify", s(out)]).run();
    assert_eq!(v.code, 0, "{mode}: {}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let trace = Trace::open(out).unwrap();
    let ev = record::events(&trace);
    // a2's blocks come back from the offload pool (pool 2), all four.
    let a2 = id_of(&trace, "a2");
    let loaded: u32 = ev[&0]
        .iter()
        .filter(|e| e.op == Op::Write && e.request_id == a2 && e.src.is_some_and(|c| c.pool == 2))
        .map(|e| e.slot_count)
        .sum();
    assert_eq!(loaded, 64, "{mode}: a's four blocks come back");
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["offload_unverified"], 0, "{hook}");
    let j = scope(out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    let affected = j["affected_responses"].as_array().unwrap();
    if !stale {
        assert_eq!(hook["offload_key_mismatch"], 0, "{hook}");
        assert!(affected.is_empty(), "{mode}: {j:#}");
        return;
    }
    assert_eq!(facts["planted"], 4, "{facts}");
    assert_eq!(hook["offload_key_mismatch"], 4, "{hook}");
    assert_only_a2_read_b(&trace, a2, affected, &j);
}

/// A planted stale tier entry's verdict: a2 the one affected response,
/// confirmed, 64 foreign tokens, its one source b (tenant-b).
fn assert_only_a2_read_b(
    trace: &Trace,
    a2: u64,
    affected: &[serde_json::Value],
    j: &serde_json::Value,
) {
    assert_eq!(affected.len(), 1, "{j:#}");
    let a = &affected[0];
    assert_eq!(a["request_id"], a2, "{a}");
    assert_eq!(a["confidence"], "confirmed", "{a}");
    assert_eq!(a["foreign_tokens"], 64, "{a}");
    let src: Vec<(u64, String)> = a["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["request_id"].as_u64().unwrap(),
                x["tenant"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        src,
        vec![(id_of(trace, "b"), "tenant-b".to_string())],
        "{a}"
    );
}

/// vLLM's SimpleCPUOffloadConnector, scheduler side for real
/// (SimpleCPUOffloadScheduler: its offload BlockPool, lookups, eager store
/// events, load events) with a synthetic worker that reports every event
/// of a step done in that step (the worker's copy kernels need CUDA; it
/// copies nothing here), on the cpu backend and on the disk backend (the
/// scheduler side sized by disk_capacity_bytes). a's blocks are stored,
/// evicted from the GPU by b, loaded back for a2: clean. With the tier's
/// index planted to name b's blocks under a's hashes, a2 reads b's KV:
/// found, with b as the source.
#[test]
fn vllm_simple_cpu_offload_is_recorded_as_tier_copies() {
    for (mode, stale) in [
        ("simple", false),
        ("simple-disk", false),
        ("simple-stale", true),
    ] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_in(mode, &d, true, "deploy-vllm-tiers.json");
        let jobs = &facts["offload_jobs"];
        assert_eq!(jobs["store"].as_array().unwrap().len(), 2, "{facts}");
        assert_eq!(jobs["load"].as_array().unwrap().len(), 1, "{facts}");
        assert_eq!(jobs["load"][0]["req"], serde_json::json!(["a2"]), "{facts}");
        check_offload_verdict(&facts, &out, &side_err, stale);
    }
}

/// The offload tiering layer (OffloadingConnector + TieringOffloadingSpec)
/// with vLLM's file-system tier, for real, writing and reading files in a
/// temp directory; the GPU<->CPU worker is synthetic as above. The CPU tier
/// (10 chunks) loses a's chunks to b, so a2's blocks come back disk -> CPU
/// (a promotion: a copy from pool 3 into pool 2) -> GPU. With the tier's
/// file mapper planted to send four of b's keys to a's files, b's store
/// overwrites them: a2 reads b's KV, found with b as the source.
#[test]
fn vllm_disk_tier_is_recorded_as_tier_copies() {
    for (mode, stale) in [("tier", false), ("tier-stale", true)] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_in(mode, &d, true, "deploy-vllm-tiers.json");
        // The fs tier wrote one file per chunk of a and b (the plant: four
        // fewer, b's four colliding keys wrote a's files).
        let files = facts["offload_jobs"]["tier"].as_array().unwrap().len();
        assert_eq!(files, if stale { 10 } else { 14 }, "{facts}");
        let trace = Trace::open(&out).unwrap();
        let ev = record::events(&trace);
        let into = |pool: u16, from: u16| -> u32 {
            ev.get(&pool)
                .map(|v| {
                    v.iter()
                        .filter(|e| e.op == Op::Write && e.src.is_some_and(|c| c.pool == from))
                        .map(|e| e.slot_count)
                        .sum()
                })
                .unwrap_or(0)
        };
        // Stores to the disk tier (a's 4 chunks, b's 10) and a's promotion.
        assert_eq!(into(3, 2), 14 * 16, "{mode}");
        assert_eq!(into(2, 3), 4 * 16, "{mode}");
        check_offload_verdict(&facts, &out, &side_err, stale);
    }
}

/// LMCache: vLLM's LMCacheConnectorV1 over a stand-in for the lmcache
/// package's engine (this test runs without the package). Its load of 48
/// tokens into a2's blocks (which held b's KV) is out of the hook's sight:
/// without a cache pool (`lmcache`) a hole at the blocks' alloc; with one
/// (`lmcache-pool`) the hook waits for lmcache's engine to perform the
/// load, which is not in this process (as with vLLM's worker in another
/// one), and records a hole before a2's reads. Either way scope reports a2
/// as possibly affected, never confirmed, never clean, and says the
/// evidence is incomplete.
#[test]
fn vllm_lmcache_loads_are_recorded_as_holes() {
    for mode in ["lmcache", "lmcache-pool"] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_in(mode, &d, true, "deploy-vllm-tiers.json");
        assert_eq!(
            facts["lmcache_loads"],
            serde_json::json!([["a2", 48]]),
            "{mode}: {facts}"
        );
        let hook = &facts["hook_stats"]["hook"];
        assert_eq!(hook["lmcache_loads"], 1, "{mode}: {facts}");
        assert_eq!(hook["lmcache_holes"], 1, "{mode}: {facts}");
        assert_eq!(hook["lmcache_copies"], 0, "{mode}: {facts}");
        let v = kvtrail(["verify", s(&out)]).run();
        assert!(
            v.code == 0 || v.code == 1,
            "{mode}: {}\n{}\n{side_err}",
            v.stdout,
            v.stderr
        );
        let trace = Trace::open(&out).unwrap();
        let a2 = id_of(&trace, "a2");
        let j = scope(&out);
        assert_eq!(j["coverage"]["complete"], false, "{mode}: {j:#}");
        assert_eq!(j["coverage"]["lost_events"], 3, "{mode}: {j:#}");
        let affected = j["affected_responses"].as_array().unwrap();
        let mine: Vec<_> = affected.iter().filter(|a| a["request_id"] == a2).collect();
        assert_eq!(mine.len(), 1, "{mode}: {j:#}");
        assert_eq!(mine[0]["confidence"], "possible", "{mode}: {j:#}");
        assert!(
            affected.iter().all(|a| a["confidence"] != "confirmed"),
            "{mode}: {j:#}"
        );
    }
}

/// Whether the set-up of the real-lmcache tests is there: the vLLM venv and
/// the lmcache folder of .ci/setup.d/35-lmcache.sh (the driver finds it
/// through the same path). Missing: a SKIP line, or a failure when `CI` is
/// set.
pub(crate) fn lmcache_ready() -> bool {
    if venv::VLLM.python().is_none() {
        return false;
    }
    let dir = std::env::var_os("KVTRAIL_LMCACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("KVTRAIL_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/kvtrail")
                })
                .join("lmcache-0.5.6")
        });
    if dir.join(".kvtrail-ready-v1").is_file() {
        return true;
    }
    let msg = format!(
        "the lmcache package is missing at {}: run .ci/setup.d/35-lmcache.sh",
        dir.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("CI is set but {msg}");
    }
    eprintln!("SKIP: {msg}");
    false
}

/// tests/vllm/lmcache_driver.py in `mode`: vLLM's LMCacheConnectorV1 (both
/// roles) over the real lmcache 0.5.6 engine on CPU, with only lmcache's
/// vLLM GPU connector adapted to CPU tensors (its CUDA streams and device
/// check; the copies are lmcache's own). Checks what the package did.
fn capture_lmcache(mode: &str, d: &tempfile::TempDir) -> (serde_json::Value, PathBuf, String) {
    let (facts, out, side_err) = capture_script(
        "lmcache_driver.py",
        mode,
        d,
        true,
        "deploy-vllm-lmcache.json",
        "uninstall",
    );
    assert_eq!(facts["lmcache"], "0.5.6", "{facts}");
    // The real classes, both roles, and the real engine (not lmcache's
    // degraded mode, which would recompute everything).
    assert_eq!(
        facts["connectors"],
        serde_json::json!([
            "LMCacheConnectorV1",
            "LMCacheConnectorV1",
            "lmcache.integration.vllm.vllm_v1_adapter",
            "lmcache.integration.vllm.vllm_v1_adapter"
        ]),
        "{facts}"
    );
    assert_eq!(facts["gpu_connector"], "CpuPagedConnector", "{facts}");
    assert_eq!(facts["device_ops"], "CpuDeviceOps", "{facts}");
    assert_eq!(
        facts["transfer"], "DeviceOps.multi_layer_kv_transfer",
        "{facts}"
    );
    assert_eq!(facts["cuda_ops_loaded"], false, "{facts}");
    // a's 64 tokens and f's 160 were stored to LMCache (full chunks).
    assert_eq!(facts["lmcache_stats"]["a"]["stored"], 64, "{facts}");
    assert_eq!(facts["lmcache_stats"]["f"]["stored"], 160, "{facts}");
    let third = facts["third"].as_str().unwrap().to_string();
    let mut finish = serde_json::json!({"a": "length", "f": "length", third: "length"});
    if mode == "evict" {
        for i in 0..5 {
            finish[format!("s{i}")] = "length".into();
        }
    }
    assert_eq!(facts["finish"], finish, "{facts}");
    (facts, out, side_err)
}

/// What lmcache did for the third request of `mode`: a 64-token lookup
/// hit, 64 tokens retrieved, vLLM scheduling only the 2 tokens past it,
/// and the load changing the blocks (which held f's KV) to the bytes of
/// `source` (the truth, read from the bytes: the requests whose KV they
/// are).
fn check_lmcache_load(facts: &serde_json::Value, third: &str, source: &str) {
    let mode = &facts["mode"];
    assert_eq!(facts["third"], third, "{facts}");
    assert_eq!(
        facts["chunks"],
        serde_json::json!({"a": 4, "f": 10}),
        "{facts}"
    );
    let st = &facts["lmcache_stats"][third];
    assert_eq!(st["lookup_hits"], 64, "{mode}: {facts}");
    assert_eq!(st["retrieved"], 64, "{mode}: {facts}");
    assert_eq!(
        facts["first_step"][third],
        serde_json::json!({"scheduled": 2, "computed_before": 64}),
        "{mode}: {facts}"
    );
    assert_eq!(
        facts["bytes"][third],
        serde_json::json!({"equal_to_a": source == "a", "changed": true, "sources": [source]}),
        "{mode}: {facts}"
    );
    assert_eq!(
        facts["hook_stats"]["hook"]["lmcache_loads"], 1,
        "{mode}: {facts}"
    );
}

/// Tokens of request `rid` written into pool `pool` by copies out of pool
/// `from`.
fn copied(trace: &Trace, pool: u16, from: u16, rid: Option<u64>) -> u32 {
    record::events(trace)
        .get(&pool)
        .map(|v| {
            v.iter()
                .filter(|e| {
                    e.op == Op::Write
                        && e.src.is_some_and(|c| c.pool == from)
                        && rid.is_none_or(|r| e.request_id == r)
                })
                .map(|e| e.slot_count)
                .sum()
        })
        .unwrap_or(0)
}

/// The real lmcache package, its stores and loads recorded as copies
/// through the cache pool (pool 2, lmcache's local CPU memory, located by
/// the memory objects' allocator addresses): a's 4 chunks and f's 10 are
/// copied into it; f takes every block a freed; the third request gets a
/// 64-token LMCache hit that lmcache loads into its blocks: a copy out of
/// the cache pool and a share of the chunks stored under the keys loaded.
/// The truth: the blocks then hold a's bytes.
/// - hit (a2, tenant-a): clean, the capture complete;
/// - cross (x, tenant-x; lmcache 0.5.6's keys carry no cache salt): not a
///   stale read and not clean: scope's `cross_tenant_shared` names x with
///   a (tenant-a) as the source of its 64 tokens.
#[test]
fn vllm_lmcache_real_package_loads_are_cache_pool_copies() {
    if !lmcache_ready() {
        return;
    }
    for (mode, third) in [("hit", "a2"), ("cross", "x")] {
        let d = tempfile::tempdir().unwrap();
        let (facts, out, side_err) = capture_lmcache(mode, &d);
        check_lmcache_load(&facts, third, "a");
        let hook = &facts["hook_stats"]["hook"];
        // 14 stores and the load.
        assert_eq!(hook["lmcache_copies"], 15, "{mode}: {hook}");
        assert_eq!(hook["lmcache_holes"], 0, "{mode}: {hook}");
        let v = kvtrail(["verify", s(&out)]).run();
        assert_eq!(v.code, 0, "{mode}: {}\n{}\n{side_err}", v.stdout, v.stderr);
        assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
        let trace = Trace::open(&out).unwrap();
        let id = id_of(&trace, third);
        let a = id_of(&trace, "a");
        assert_eq!(copied(&trace, 2, 0, Some(a)), 64, "{mode}: a stored");
        assert_eq!(copied(&trace, 2, 0, None), 224, "{mode}: a and f stored");
        assert_eq!(copied(&trace, 0, 2, Some(id)), 64, "{mode}: loaded");
        let j = scope(&out);
        assert_eq!(j["coverage"]["complete"], true, "{mode}: {j:#}");
        assert_eq!(j["coverage"]["lost_events"], 0, "{mode}: {j:#}");
        assert_eq!(
            j["affected_responses"].as_array().unwrap().len(),
            0,
            "{mode}: {j:#}"
        );
        if mode == "hit" {
            assert!(j["cross_tenant_shared"].is_null(), "{mode}: {j:#}");
            continue;
        }
        assert_eq!(
            j["cross_tenant_shared"],
            serde_json::json!([{
                "request_id": id,
                "external_id": "x",
                "tenant": "tenant-x",
                "tokens": 64,
                "sources": [{"request_id": a, "tenant": "tenant-a", "tokens": 64}]
            }]),
            "{mode}: {j:#}"
        );
    }
}

/// lmcache's own eviction, and the memory it frees reused: its local CPU
/// backend holds 10 chunks, so storing f's 10 evicts a's 4 and puts f's
/// chunks 6 to 9 in a's former memory objects (the same allocator
/// addresses). Short requests (no full chunk, nothing stored) take f's
/// tail blocks from vLLM's prefix cache; f2 (tenant-f, f's 160 tokens and
/// 2 more) hits f's first 6 blocks in vLLM and lmcache loads chunks 6 to
/// 9 from the reused memory. The truth: the bytes loaded are f's. The
/// capture records the eviction as frees in the cache pool and the
/// reuse as f's stores, so the load is f's own KV: clean, complete, and
/// a (whose KV those cache slots held before) is named nowhere.
#[test]
fn vllm_lmcache_real_package_evicted_and_reused_memory_stays_clean() {
    if !lmcache_ready() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_lmcache("evict", &d);
    assert_eq!(
        facts["chunks"],
        serde_json::json!({"a": 4, "f": 10}),
        "{facts}"
    );
    assert_eq!(facts["evicted_a"], 4, "{facts}");
    for i in 0..4 {
        assert_eq!(
            facts["addr"]["f"][(6 + i).to_string()],
            facts["addr"]["a"][i],
            "f's chunk {} is not in a's memory: {facts}",
            6 + i
        );
    }
    assert_eq!(
        facts["f_kept"],
        serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        "{facts}"
    );
    let st = &facts["lmcache_stats"]["f2"];
    assert_eq!(st["lookup_hits"], 160, "{facts}");
    assert_eq!(st["retrieved"], 64, "{facts}");
    assert_eq!(
        facts["bytes"]["f2"],
        serde_json::json!({"equal_to_a": false, "changed": true, "sources": ["f"]}),
        "{facts}"
    );
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["lmcache_loads"], 1, "{hook}");
    assert_eq!(hook["lmcache_copies"], 15, "{hook}");
    assert_eq!(hook["lmcache_holes"], 0, "{hook}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let trace = Trace::open(&out).unwrap();
    let f2 = id_of(&trace, "f2");
    assert_eq!(copied(&trace, 2, 0, None), 224, "a and f stored");
    assert_eq!(copied(&trace, 0, 2, Some(f2)), 64, "loaded");
    let freed: u32 = record::events(&trace)
        .get(&2)
        .map(|v| {
            v.iter()
                .filter(|e| e.op == Op::Free)
                .map(|e| e.slot_count)
                .sum()
        })
        .unwrap_or(0);
    assert!(freed >= 64, "a's evicted chunks not freed: {freed}");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
    assert!(j["cross_tenant_shared"].is_null(), "{j:#}");
}

/// An LMCache load starts at a chunk boundary (32-token chunks here, two
/// blocks), so it rewrites vLLM prefix-cache blocks below vLLM's own hit
/// that other running requests share: a (64 tokens) is stored; c shares
/// a's first three blocks and keeps decoding; a filler takes every free
/// block but one, so vLLM evicts a's block 3; b (a's tokens and 2 more)
/// hits 48 tokens in vLLM and lmcache reloads positions 32 to 63, over
/// the block c shares. The truth: c's bytes there are unchanged, a's. The
/// chunk was loaded under the key last stored there, so it writes the
/// same prefix's KV: nothing is recorded below vLLM's hit (a copy there
/// would end c's grant and report c confirmed foreign with a as its
/// source), b's 16 tokens past it are a copy; the run scopes clean.
#[test]
fn vllm_lmcache_real_package_chunk_overlap_keeps_sharers_clean() {
    if !lmcache_ready() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_script(
        "lmcache_driver.py",
        "overlap",
        &d,
        true,
        "deploy-vllm-lmcache.json",
        "uninstall",
    );
    assert_eq!(facts["lmcache"], "0.5.6", "{facts}");
    assert_eq!(facts["c_shares_a_blocks"], 3, "{facts}");
    assert_eq!(facts["c_block2_unchanged"], true, "{facts}");
    assert_eq!(facts["c_block2_is_a"], true, "{facts}");
    assert_eq!(facts["lmcache_stats"]["b"]["retrieved"], 32, "{facts}");
    assert_eq!(
        facts["first_step"]["b"],
        serde_json::json!({"scheduled": 2, "computed_before": 64}),
        "{facts}"
    );
    assert_eq!(
        facts["bytes"]["b"],
        serde_json::json!({"equal_to_a": true, "changed": true, "sources": ["a"]}),
        "{facts}"
    );
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["lmcache_loads"], 1, "{hook}");
    assert_eq!(hook["lmcache_holes"], 0, "{hook}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let trace = Trace::open(&out).unwrap();
    let b = id_of(&trace, "b");
    assert_eq!(copied(&trace, 0, 2, Some(b)), 16, "only past vLLM's hit");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
    assert!(j["cross_tenant_shared"].is_null(), "{j:#}");
}

/// lmcache's local CPU backend planted stale: its index entry for each of
/// a's chunk keys made to name the memory object of one of f's chunks (a's
/// objects go back to lmcache's allocator). a2 (tenant-a) gets the same
/// 64-token hit; the truth: the bytes loaded are f's, not a's. The hook
/// locates chunks by memory object, not key: the load copies what f
/// stored, under keys it was not stored under (no share): scope confirms
/// a2, 64 foreign tokens, its one source f (tenant-f), the capture
/// complete.
#[test]
fn vllm_lmcache_real_package_stale_chunk_is_confirmed_with_its_true_source() {
    if !lmcache_ready() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_lmcache("stale", &d);
    assert_eq!(facts["planted"], 4, "{facts}");
    check_lmcache_load(&facts, "a2", "f");
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["lmcache_holes"], 0, "{hook}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    let trace = Trace::open(&out).unwrap();
    let a2 = id_of(&trace, "a2");
    assert_eq!(copied(&trace, 0, 2, Some(a2)), 64);
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(affected.len(), 1, "{j:#}");
    let x = &affected[0];
    assert_eq!(x["request_id"], a2, "{x}");
    assert_eq!(x["confidence"], "confirmed", "{x}");
    assert_eq!(x["foreign_tokens"], 64, "{x}");
    let src: Vec<_> = x["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|y| {
            (
                y["request_id"].clone(),
                y["tenant"].clone(),
                y["confidence"].clone(),
            )
        })
        .collect();
    assert_eq!(
        src,
        vec![(
            serde_json::json!(id_of(&trace, "f")),
            serde_json::json!("tenant-f"),
            serde_json::json!("confirmed")
        )],
        "{x}"
    );
}

/// Chunks put straight into lmcache's local CPU backend, not through the
/// store path the hook watches (as a chunk stored before the hook was
/// installed, or by another engine sharing the cache), holding the KV of a
/// request the trace never saw. u (tenant-u) gets a 64-token hit on them;
/// the truth: the bytes loaded are that request's. The hook cannot say
/// whose they are: four holes (`lmcache_holes`), no copy, so scope reports
/// u possibly affected, nothing confirmed, no source confirmed, the
/// evidence incomplete.
#[test]
fn vllm_lmcache_real_package_unseen_chunk_is_a_hole() {
    if !lmcache_ready() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_lmcache("unseen", &d);
    assert_eq!(facts["planted"], 4, "{facts}");
    check_lmcache_load(&facts, "u", "ext");
    let hook = &facts["hook_stats"]["hook"];
    assert_eq!(hook["lmcache_holes"], 4, "{hook}");
    assert_eq!(hook["lmcache_copies"], 14, "{hook}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(
        v.code == 0 || v.code == 1,
        "{}\n{}\n{side_err}",
        v.stdout,
        v.stderr
    );
    let trace = Trace::open(&out).unwrap();
    let u = id_of(&trace, "u");
    assert_eq!(copied(&trace, 0, 2, Some(u)), 0, "no copy names a source");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], false, "{j:#}");
    assert_eq!(j["coverage"]["lost_events"], 4, "{j:#}");
    let affected = j["affected_responses"].as_array().unwrap();
    let mine: Vec<_> = affected.iter().filter(|a| a["request_id"] == u).collect();
    assert_eq!(mine.len(), 1, "{j:#}");
    assert_eq!(mine[0]["confidence"], "possible", "{j:#}");
    assert!(
        affected.iter().all(|a| a["confidence"] != "confirmed"),
        "{j:#}"
    );
    assert!(
        affected
            .iter()
            .flat_map(|a| a["sources"].as_array().unwrap())
            .all(|x| x["confidence"] != "confirmed"),
        "{j:#}"
    );
}

/// The same engine and lmcache, the third request with other tokens: no
/// LMCache hit, nothing loaded (its slots unchanged by start_load_kv), no
/// hole; the capture verifies complete and scopes clean.
#[test]
fn vllm_lmcache_real_package_without_a_hit_scopes_clean() {
    if !lmcache_ready() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture_lmcache("miss", &d);
    assert_eq!(facts["third"], "m", "{facts}");
    let st = &facts["lmcache_stats"]["m"];
    assert_eq!(st["lookup_hits"], 0, "{facts}");
    assert_eq!(st["retrieved"], 0, "{facts}");
    assert_eq!(
        facts["first_step"]["m"],
        serde_json::json!({"scheduled": 66, "computed_before": 0}),
        "{facts}"
    );
    assert_eq!(facts["bytes"]["m"]["changed"], false, "{facts}");
    assert_eq!(facts["hook_stats"]["hook"]["lmcache_loads"], 0, "{facts}");
    assert_eq!(facts["hook_stats"]["hook"]["lmcache_holes"], 0, "{facts}");
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}\n{side_err}", v.stdout, v.stderr);
    assert!(v.stdout.contains("capture complete"), "{}", v.stdout);
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
}

#[test]
fn vllm_load_faults_leave_evidence() {
    let d = tempfile::tempdir().unwrap();
    let (facts, out, side_err) = capture("faults", &d);
    // Under kv_load_failure_policy "fail" the failed and the partial load
    // end the request with an error; the out-of-range read "succeeds".
    assert_eq!(facts["r5"]["finish"], "length", "{facts}");
    assert_eq!(facts["r6"]["finish"], "error", "{facts}");
    assert_eq!(facts["r7"]["finish"], "error", "{facts}");
    assert!(
        side_err.contains("out of range") && side_err.contains("failed (policy fail)"),
        "{side_err}"
    );
    let m = Manifest::load(&out).unwrap();
    let rec = &m.capture.extra["record"];
    assert_eq!(rec["pulls_failed"], 1, "{rec}");
    assert_eq!(rec["pulls_written"], 2, "{rec}");
    assert_eq!(rec["pulls_partial"], 1, "{rec}");
    assert_eq!(rec["rejected_contract"], 1, "{rec}");
    assert_eq!(
        m.capture.extra["kv_load_failure_policy"],
        serde_json::json!({"1": ["fail"]})
    );
    let trace = Trace::open(&out).unwrap();
    let mut rows = std::collections::BTreeMap::new();
    for b in trace.requests() {
        for r in b.unwrap() {
            rows.insert(r.external_id.clone().unwrap(), r);
        }
    }
    assert_eq!(rows["r6"].http_status, 500);
    assert_eq!(rows["r6"].finish_reason.as_deref(), Some("error"));
    assert_eq!(rows["r7"].http_status, 500);
    assert_eq!(rows["r5"].http_status, 200);
    // The out-of-range copy is a hole in decode's stream: scope says the
    // evidence has one, never "no exposure".
    let i = kvtrail(["inspect", s(&out), "--json"]).run();
    let ij: serde_json::Value = serde_json::from_str(&i.stdout).unwrap();
    let p1 = ij["kv"]["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == 1)
        .unwrap();
    assert_eq!(p1["holes"], 1, "{p1}");
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], false, "{j:#}");
    assert_eq!(j["coverage"]["lost_events"], 1, "{j:#}");
    assert!(
        j["verdict"].as_str().unwrap().contains("INCOMPLETE"),
        "{}",
        j["verdict"]
    );
    // r5 read decode slots the failed copy should have filled: possibly
    // affected, never reported clean.
    let r5 = id_of(&trace, "r5");
    assert!(
        j["affected_responses"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["request_id"] == r5 && a["confidence"] == "possible"),
        "{j:#}"
    );
}

#[test]
fn vllm_hook_failure_is_counted_not_raised() {
    let d = tempfile::tempdir().unwrap();
    let (facts, _out, _) = capture_with("broken", &d, false);
    // The engine ran the request to its end; the hook counted its failures
    // (the write and read of the step) instead of raising them.
    assert_eq!(facts["b1_finish"], "length", "{facts}");
    assert!(
        facts["hook_stats"]["hook"]["hook_errors"].as_u64().unwrap() >= 1,
        "{facts}"
    );
}

// ---------------------------------------------------------------- the wire

fn send(c: &mut impl Write, lines: &[String]) {
    for l in lines {
        writeln!(c, "{l}").unwrap();
    }
}

fn pull(body: &str) -> String {
    format!(r#"{{"type":"xfer_pull","pool":1,"ts_ns":5,"request_id":9,{body}}}"#)
}

/// The decode engine's hook may connect, and load, before the prefill
/// engine's hook has connected at all (nothing orders two engines' starts):
/// the load waits for the source pool's connection as for its mark, and is
/// stamped with the producer's write, not recorded as a hole. A pool no
/// connection claims within --copy-timeout gives holes, and the capture is
/// incomplete.
#[test]
fn a_load_before_its_producer_connects_waits_for_it() {
    let rig: Rig = record::start(|c| c.copy_timeout = Duration::from_secs(30));
    let mut c = rig.connect(&[1]);
    send(
        &mut c,
        &[
            pull(r#""src_pool":0,"runs":[[32,0,16,0]],"outcome":"ok""#),
            record::kv(1, 9, "read", 32, 16),
        ],
    );
    // No pause: the producer connects as soon as it can, after the load.
    let mut p = rig.connect(&[0]);
    send(&mut p, &[record::kv(0, 3, "write", 0, 16)]);
    drop(p); // a clean `bye`: pool 0 has sent everything
    drop(c);
    let (sum, trace, _d, _out) = rig.stop();
    let st = &sum.stats;
    assert_eq!((st.pulls_written, st.copies_unresolved), (1, 0), "{st:?}");
    let ev = record::events(&trace);
    let w: Vec<_> = ev[&1].iter().filter(|e| e.src.is_some()).collect();
    assert_eq!(w.len(), 1, "{ev:?}");
    let src = w[0].src.unwrap();
    assert_eq!((src.pool, src.slot_start, src.seq), (0, 0, 0));

    // A producer that never connects: one wait, then holes at once.
    let rig: Rig = record::start(|c| c.copy_timeout = Duration::from_secs(1));
    let mut c = rig.connect(&[1]);
    send(
        &mut c,
        &[pull(r#""src_pool":0,"runs":[[32,0,16,0]],"outcome":"ok""#)],
    );
    std::thread::sleep(Duration::from_millis(2500));
    send(
        &mut c,
        &[pull(r#""src_pool":0,"runs":[[48,0,16,0]],"outcome":"ok""#)],
    );
    drop(c);
    let (sum, _trace, _d, out) = rig.stop();
    let st = &sum.stats;
    assert_eq!((st.pulls_written, st.copies_unresolved), (0, 2), "{st:?}");
    assert!(!Manifest::load(&out).unwrap().capture.complete);
}

#[test]
fn hostile_pull_lines_are_counted_and_rejected() {
    let rig: Rig = record::start(|_| {});
    let mut p = rig.connect(&[0]);
    send(&mut p, &[record::kv(0, 3, "write", 0, 16)]);
    // Let the producer's write land first: the pull is stamped at arrival.
    std::thread::sleep(Duration::from_millis(200));
    let mut c = rig.connect(&[1]);
    let bad = [
        // unknown key, missing outcome, bad outcome, bad policy
        pull(r#""src_pool":0,"runs":[[0,0,4,0]],"outcome":"ok","x":1"#),
        pull(r#""src_pool":0,"runs":[[0,0,4,0]]"#),
        pull(r#""src_pool":0,"runs":[[0,0,4,0]],"outcome":"maybe""#),
        pull(r#""src_pool":0,"runs":[[0,0,4,0]],"outcome":"ok","policy":"ignore""#),
        // into itself, count 0, ok without runs, failed with runs
        pull(r#""src_pool":1,"runs":[[0,0,4,0]],"outcome":"ok""#),
        pull(r#""src_pool":0,"runs":[[0,0,0,0]],"outcome":"ok""#),
        pull(r#""src_pool":0,"runs":[],"outcome":"ok""#),
        pull(r#""src_pool":0,"runs":[[0,0,4,0]],"outcome":"failed""#),
        // values beyond the types, a run of the wrong arity, request id 0
        pull(r#""src_pool":0,"runs":[[4294967296,0,4,0]],"outcome":"ok""#),
        pull(r#""src_pool":70000,"runs":[[0,0,4,0]],"outcome":"ok""#),
        pull(r#""src_pool":0,"runs":[[0,0,4]],"outcome":"ok""#),
        r#"{"type":"xfer_pull","pool":1,"ts_ns":5,"request_id":0,"src_pool":0,"runs":[[0,0,4,0]],"outcome":"ok"}"#.into(),
        // the same key twice
        pull(r#""src_pool":0,"src_pool":0,"runs":[[0,0,4,0]],"outcome":"ok""#),
        // too many runs
        pull(&format!(
            r#""src_pool":0,"runs":[{}],"outcome":"ok""#,
            vec!["[0,0,1,0]"; 65537].join(",")
        )),
    ];
    send(&mut c, &bad);
    // Well-formed but impossible: outside the source pool, outside the
    // destination pool, a source pool not in the deployment, a pool this
    // connection did not claim.
    let impossible = [
        pull(r#""src_pool":0,"runs":[[0,4090,16,0]],"outcome":"ok""#),
        pull(r#""src_pool":0,"runs":[[4090,0,16,0]],"outcome":"ok""#),
        pull(r#""src_pool":9,"runs":[[0,0,4,0]],"outcome":"ok""#),
        r#"{"type":"xfer_pull","pool":3,"ts_ns":5,"request_id":9,"src_pool":0,"runs":[[0,0,4,0]],"outcome":"ok"}"#.into(),
    ];
    send(&mut c, &impossible);
    // And a good one still goes through afterwards.
    send(
        &mut c,
        &[
            pull(r#""src_pool":0,"runs":[[32,0,16,0]],"outcome":"ok","policy":"recompute""#),
            record::kv(1, 9, "read", 32, 16),
        ],
    );
    drop((p, c));
    let (sum, trace, _d, out) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.rejected_unattributed, bad.len() as u64, "{st:?}");
    assert_eq!(st.rejected_contract, 2, "{st:?}");
    assert_eq!(st.copies_unresolved, 1, "{st:?}");
    assert_eq!(st.rejected_forged, 1, "{st:?}");
    assert_eq!(st.pulls_written, 1, "{st:?}");
    let ev = record::events(&trace);
    let w: Vec<_> = ev[&1].iter().filter(|e| e.src.is_some()).collect();
    assert_eq!(w.len(), 1);
    let src = w[0].src.unwrap();
    assert_eq!((src.pool, src.slot_start, src.seq), (0, 0, 0));
    assert_eq!(
        (w[0].slot_start, w[0].slot_count, w[0].request_id),
        (32, 16, 9)
    );
    let m = Manifest::load(&out).unwrap();
    assert_eq!(
        m.capture.extra["kv_load_failure_policy"],
        serde_json::json!({"1": ["recompute"]})
    );
    // Rejected unattributed lines make the capture incomplete; the files verify.
    assert!(!m.capture.complete);
}

// ------------------------------------------- producers of another block size

/// A producer pool of 128-token blocks (0), consumers of 64 (1) and 16 (2).
fn mixed_block_sizes() -> kvtrail::trace::manifest::Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "bs", "engine": "vllm", "context_window": 1024,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": 1024, "page_size": 128},
            {"id": 1, "role": "decode", "capacity_tokens": 1024, "page_size": 64},
            {"id": 2, "role": "decode", "capacity_tokens": 1024, "page_size": 16}
        ]
    }))
    .unwrap()
}

fn kv_at(pool: u16, ts: i64, rid: u64, op: &str, start: u32, count: u32) -> String {
    format!(
        r#"{{"type":"kv","pool":{pool},"ts_ns":{ts},"request_id":{rid},"op":"{op}","slot_start":{start},"slot_count":{count},"token_pos":0}}"#
    )
}

fn request(rid: u64, tenant: &str) -> String {
    format!(
        r#"{{"type":"request","request_id":{rid},"tenant":"{tenant}","arrival_ns":1,"prompt_tokens":256,"output_tokens":1,"http_status":200}}"#
    )
}

fn block_pull(pool: u16, rid: u64, body: &str) -> String {
    format!(
        r#"{{"type":"xfer_pull","pool":{pool},"ts_ns":5,"request_id":{rid},"src_pool":0,{body}}}"#
    )
}

/// Records request 3's prefill on the producer (its blocks 2 and 4; with
/// `stale`, block 2 reused by request 4 before the load) and its loads in
/// the block form into a 64-token consumer (blocks 5, 1, 2, 7) and a
/// 16-token one (blocks 10, 11, 3..9), each consumer reading what it
/// loaded. Returns the trace's directory.
fn capture_block_sizes(
    stale: bool,
) -> (
    kvtrail::record::RecordSummary,
    Trace,
    PathBuf,
    tempfile::TempDir,
) {
    let rig: Rig = record::start_in(mixed_block_sizes(), |_| {});
    let mut p = rig.connect(&[0]);
    let mut lines = vec![
        request(3, "tenant-a"),
        kv_at(0, 1, 3, "alloc", 256, 128),
        kv_at(0, 1, 3, "write", 256, 128),
        kv_at(0, 1, 3, "alloc", 512, 128),
        kv_at(0, 1, 3, "write", 512, 128),
    ];
    if stale {
        // The producer frees block 2 and hands it to request 4 before the
        // consumer reads it (a stale reference).
        lines.extend([
            request(4, "tenant-b"),
            kv_at(0, 2, 3, "free", 256, 128),
            kv_at(0, 2, 4, "alloc", 256, 128),
            kv_at(0, 2, 4, "write", 256, 128),
        ]);
    }
    send(&mut p, &lines);
    drop(p); // a clean `bye`: the producer has sent everything
    let mut c = rig.connect(&[1, 2]);
    send(
        &mut c,
        &[
            // 64-token blocks 5, 1, 2, 7 read source tokens 0..256: the
            // middle run crosses from producer block 2 into block 4.
            kv_at(1, 4, 3, "alloc", 320, 64),
            kv_at(1, 4, 3, "alloc", 64, 128),
            kv_at(1, 4, 3, "alloc", 448, 64),
            block_pull(
                1,
                3,
                r#""src_blocks":[2,4],"tail":256,"runs":[[320,0,64,0],[64,64,128,64],[448,192,64,192]],"outcome":"ok""#,
            ),
            kv_at(1, 6, 3, "read", 320, 64),
            kv_at(1, 6, 3, "read", 64, 128),
            kv_at(1, 6, 3, "read", 448, 64),
            // 16-token blocks 10, 11, 3..8 read producer block 2 (the last
            // 128 tokens of the one-block source).
            kv_at(2, 4, 3, "alloc", 160, 32),
            kv_at(2, 4, 3, "alloc", 48, 96),
            block_pull(
                2,
                3,
                r#""src_blocks":[2],"tail":128,"runs":[[160,0,32,0],[48,32,96,32]],"outcome":"ok""#,
            ),
            kv_at(2, 6, 3, "read", 160, 32),
            kv_at(2, 6, 3, "read", 48, 96),
        ],
    );
    drop(c);
    let (sum, trace, d, out) = rig.stop();
    (sum, trace, out, d)
}

#[test]
fn block_form_pulls_copy_across_block_sizes() {
    let (sum, trace, out, _d) = capture_block_sizes(false);
    let st = &sum.stats;
    assert_eq!(
        (st.pulls_written, st.copies_unresolved, st.rejected_contract),
        (6, 0, 0),
        "{st:?}"
    );
    let ev = record::events(&trace);
    let copies = |pool: u16| -> Vec<(u32, u32, u32)> {
        ev[&pool]
            .iter()
            .filter_map(|e| e.src.map(|s| (e.slot_start, s.slot_start, e.slot_count)))
            .collect()
    };
    // Producer block b is slots b*128..b*128+128 of pool 0, whatever the
    // consumer's block size.
    assert_eq!(
        copies(1),
        vec![
            (320, 256, 64),
            (64, 320, 64),
            (128, 512, 64),
            (448, 576, 64)
        ]
    );
    assert_eq!(copies(2), vec![(160, 256, 32), (48, 288, 96)]);
    let v = kvtrail(["verify", s(&out)]).run();
    assert_eq!(v.code, 0, "{}\n{}", v.stdout, v.stderr);
    let j = scope(&out);
    assert_eq!(j["coverage"]["complete"], true, "{j:#}");
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        0,
        "{j:#}"
    );
}

#[test]
fn block_form_stale_producer_block_is_found_with_its_true_source() {
    let (sum, _trace, out, _d) = capture_block_sizes(true);
    assert_eq!(sum.stats.pulls_written, 6, "{:?}", sum.stats);
    let j = scope(&out);
    let affected = j["affected_responses"].as_array().unwrap();
    assert_eq!(affected.len(), 1, "{j:#}");
    let a = &affected[0];
    assert_eq!(a["request_id"], 3, "{a}");
    assert_eq!(a["confidence"], "confirmed", "{a}");
    let sources: Vec<u64> = a["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["request_id"].as_u64().unwrap())
        .collect();
    // Request 4 reused producer block 2: its KV, not request 3's, is what
    // both consumers loaded from it (block 4 is still request 3's own).
    assert_eq!(sources, vec![4], "{a}");
}

#[test]
fn hostile_block_form_pull_lines_are_counted_and_rejected() {
    let rig: Rig = record::start_in(mixed_block_sizes(), |_| {});
    let mut p = rig.connect(&[0]);
    send(&mut p, &[kv_at(0, 1, 3, "write", 0, 1024)]);
    drop(p);
    let mut c = rig.connect(&[1]);
    let b = |body: &str| block_pull(1, 9, body);
    let bad = [
        // tail without src_blocks, runs over no source block, tail 0
        b(r#""tail":64,"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[],"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[1],"tail":0,"runs":[[0,0,64,0]],"outcome":"ok""#),
        // a run past the load's tail; its count + offset overflowing u32
        b(r#""src_blocks":[1],"tail":64,"runs":[[0,32,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[1],"tail":64,"runs":[[0,4294967295,4294967295,0]],"outcome":"ok""#),
        // a block id beyond u32, a negative one, not a list
        b(r#""src_blocks":[4294967296],"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[-1],"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":7,"runs":[[0,0,64,0]],"outcome":"ok""#),
        // too many source blocks
        b(&format!(
            r#""src_blocks":[{}],"runs":[[0,0,64,0]],"outcome":"ok""#,
            vec!["1"; 65537].join(",")
        )),
    ];
    send(&mut c, &bad);
    // Well formed, impossible with the source's 128-token blocks: a block
    // past the pool, a block whose slots pass u32, tokens past the blocks
    // (no tail), runs that read one block many times, a destination past
    // the u32 slot space. Each is a hole with its reason.
    let impossible = [
        b(r#""src_blocks":[8],"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[4294967295],"runs":[[0,0,64,0]],"outcome":"ok""#),
        b(r#""src_blocks":[1],"runs":[[0,100,64,0]],"outcome":"ok""#),
        b(&format!(
            r#""src_blocks":[1,3],"runs":[{}],"outcome":"ok""#,
            ["[0,0,256,0]"; 3].join(",")
        )),
        b(r#""src_blocks":[1],"runs":[[4294967295,0,128,0]],"outcome":"ok""#),
    ];
    send(&mut c, &impossible);
    // A good one still goes through afterwards, and the slot form too.
    send(
        &mut c,
        &[
            b(r#""src_blocks":[1],"tail":64,"runs":[[64,0,64,0]],"outcome":"ok""#),
            pull(r#""src_pool":0,"runs":[[512,0,64,0]],"outcome":"ok""#),
        ],
    );
    drop(c);
    let (sum, trace, _d, _out) = rig.stop();
    let st = &sum.stats;
    assert_eq!(st.rejected_unattributed, bad.len() as u64, "{st:?}");
    // Past the pool, past u32, past the blocks, the sixth piece of three
    // runs over two blocks (which allow five: the rest of the line), past
    // the slot space.
    assert_eq!(st.rejected_contract, 5, "{st:?}");
    // The slot form between pools of different page sizes stays a hole.
    assert_eq!(st.copies_unresolved, 1, "{st:?}");
    // The five pieces before the bound, and the good line.
    assert_eq!(st.pulls_written, 6, "{st:?}");
    let ev = record::events(&trace);
    let w: Vec<_> = ev[&1]
        .iter()
        .filter_map(|e| e.src.map(|s| (e.slot_start, s.slot_start, e.slot_count)))
        .collect();
    // The tail: the last 64 tokens of block 1 (slots 192..256).
    assert_eq!(w.last(), Some(&(64, 192, 64)), "{w:?}");
}

#[test]
fn hello_page_sizes_must_match_the_deployment() {
    let rig: Rig = record::start_in(mixed_block_sizes(), |_| {});
    let hello = |body: &str| -> serde_json::Value {
        let mut c = std::os::unix::net::UnixStream::connect(&rig.sock).unwrap();
        writeln!(c, r#"{{"type":"hello","pools":[1,2],"worker":"t",{body}}}"#).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reply = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&c), &mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    };
    let r = hello(r#""page_sizes":{"1":16}"#);
    assert_eq!(r["type"], "error", "{r}");
    assert_eq!(
        r["error"],
        "hello gives pool 1 block size 16, the deployment's page_size is 64"
    );
    let r = hello(r#""page_sizes":{"0":128}"#);
    assert_eq!(
        r["error"], "hello gives a page size for pool 0, which it does not claim",
        "{r}"
    );
    let r = hello(r#""page_sizes":{"1":64,"2":16}"#);
    assert_eq!(r["type"], "welcome", "{r}");
    let (sum, _t, _d, _o) = rig.stop();
    assert_eq!(sum.stats.rejected_hello, 2, "{:?}", sum.stats);
}
