//! Declared sizes an attacker controls: a pool's `capacity_tokens` (up to
//! 2^32, which the contract allows). Replay memory must follow the slots
//! the trace touches and time the events it holds, never the declared
//! capacity; every command that replays answers (or refuses with exit 2),
//! never aborts or panics. Each run of the real binary is bounded in address space (so an
//! allocation per declared slot fails instead of swapping) and measured
//! (peak RSS from wait4, wall time).

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::manifest::{Capture, Manifest};
use kvtrail::trace::write::{kv_batch, requests_batch, write_single_file};
use kvtrail::trace::{Deployment, Pool, Role};

use crate::support::cli::{Ran, kvtrail};

/// Address space each run may reserve: far below one allocation per
/// declared slot of a 2^31-slot pool (17 bytes a slot: 36 GB).
const MAX_AS: u64 = 4 << 30;

/// Runs the binary under the address-space limit (peak RSS and wall time
/// measured).
fn run_bounded(args: &[&str]) -> Ran {
    kvtrail(args).memory_limit(MAX_AS).run()
}

fn pool(id: u16, role: Role, cap: u64) -> Pool {
    Pool {
        id,
        name: format!("{}-{id}", role.as_str()),
        role,
        capacity_tokens: cap,
        page_size: 1,
        extra: Default::default(),
    }
}

fn request(id: u64, tenant: &str, prefill: u16, decode: u16) -> RequestRecord {
    RequestRecord {
        request_id: id,
        external_id: None,
        tenant: tenant.into(),
        arrival_ns: 1_000 + id as i64,
        finish_ns: Some(9_000 + id as i64),
        prompt_tokens: 8,
        prefilled_tokens: Some(8),
        output_tokens: 1,
        http_status: 200,
        finish_reason: Some("stop".into()),
        prefill_pool: Some(prefill),
        decode_pool: Some(decode),
        prompt_hash: None,
        output_hash: None,
    }
}

/// Writes a trace: one kv file, one requests file, a complete capture that
/// began with the engine.
fn write_trace(
    dir: &Path,
    pools: Vec<Pool>,
    events: &[KvEvent],
    reqs: &[RequestRecord],
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    write_single_file(&dir.join("kv/all.parquet"), &[kv_batch(events)]).unwrap();
    write_single_file(&dir.join("requests/r.parquet"), &[requests_batch(reqs)]).unwrap();
    let deployment = Deployment {
        name: "hostile".into(),
        engine: "sglang-0.5.19".into(),
        context_window: 4096,
        pools,
        prefix_cache_scope: None,
        extra: Default::default(),
    };
    let mut m = Manifest::new(
        deployment,
        Capture {
            writer: "test".into(),
            started_ns: 0,
            ended_ns: 0,
            complete: true,
            from_engine_start: Some(true),
            extra: Default::default(),
        },
    );
    m.files = None;
    m.store(dir).unwrap();
    dir.to_path_buf()
}

/// Ten events at the very top of a prefill and a decode pool of `cap`
/// slots: request 1 writes 8 slots and copies them to decode, reads its
/// own copy; request 2 reads them (foreign: it sees request 1's KV);
/// request 3 is granted a share of them first, then reads (shared, clean).
fn top_of_pool_trace(dir: &Path, cap: u64) -> PathBuf {
    top_of_pool_trace_at(dir, cap, None)
}

/// `top_of_pool_trace` with every event at token position `pos`.
fn top_of_pool_trace_at(dir: &Path, cap: u64, pos: Option<u32>) -> PathBuf {
    let top = (cap - 8) as u32;
    let mut seqs = [0u64; 2];
    let mut evs = Vec::new();
    let mut push = |pool: u16, rid: u64, op: Op, src: Option<CopySrc>| {
        let seq = seqs[pool as usize];
        seqs[pool as usize] += 1;
        evs.push(KvEvent {
            pool,
            seq,
            ts_ns: 2_000 + 10 * evs.len() as i64,
            request_id: rid,
            op,
            slot_start: top,
            slot_count: 8,
            token_pos: pos,
            src,
        });
    };
    push(0, 1, Op::Alloc, None);
    push(0, 1, Op::Write, None);
    push(1, 1, Op::Alloc, None);
    let src = CopySrc {
        pool: 0,
        slot_start: top,
        seq: 1,
    };
    push(1, 1, Op::Write, Some(src));
    push(1, 1, Op::Read, None);
    push(1, 2, Op::Read, None);
    push(1, 3, Op::Share, None);
    push(1, 3, Op::Read, None);
    push(0, 1, Op::Free, None);
    push(1, 1, Op::Free, None);
    assert_eq!(evs.len(), 10);
    let reqs = [
        request(1, "acme", 0, 1),
        request(2, "globex", 0, 1),
        request(3, "initech", 0, 1),
    ];
    write_trace(
        dir,
        vec![pool(0, Role::Prefill, cap), pool(1, Role::Decode, cap)],
        &evs,
        &reqs,
    )
}

/// Runs `scope --json` bounded and checks the findings of `top_of_pool_trace`.
fn scope_top_of_pool(cap: u64, backend: &str) -> Ran {
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), cap);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--json", "--backend", backend]);
    assert_eq!(
        r.code, 0,
        "capacity {cap}: scope --backend {backend} exited {}\n{}",
        r.code, r.stderr
    );
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let affected: Vec<u64> = j["affected_responses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["request_id"].as_u64().unwrap())
        .collect();
    // Request 2 read request 1's KV; request 3 read it under a share grant.
    assert_eq!(affected, [2], "capacity {cap}: {}", r.stdout);
    assert_eq!(
        j["affected_responses"][0]["foreign_tokens"], 8,
        "{}",
        r.stdout
    );
    r
}

#[test]
fn scope_of_a_two_to_the_31_slot_pool_runs_fast_in_small_memory() {
    let r = scope_top_of_pool(1 << 31, "cpu");
    // Before: one slot array entry per declared slot (36 GB, 41 s).
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
    assert!(r.cpu < Duration::from_secs(20), "took {:?} of CPU", r.cpu);
}

#[test]
fn capacity_two_to_the_32_minus_1_does_not_abort() {
    let r = scope_top_of_pool((1 << 32) - 1, "cpu");
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn capacity_two_to_the_32_does_not_panic_and_keeps_the_top_slot() {
    // The top slot is 2^32 - 1 and the extent ends at 2^32: neither the
    // share grant nor the exposure set may wrap to 0.
    let r = scope_top_of_pool(1 << 32, "cpu");
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn a_sharded_scope_of_a_two_to_the_31_slot_pool_runs_in_small_memory() {
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), 1 << 31);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--json", "--pools", "1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["affected_responses"][0]["request_id"], 2, "{}", r.stdout);
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn the_gpu_backend_refuses_a_pool_past_its_slot_limit_with_exit_2() {
    // The GPU backend (here on the emulated device) allocates every
    // declared slot: past its limit it refuses, naming the manifest key,
    // instead of aborting on the allocation.
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), 1 << 31);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--backend", "emu"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("trace.json"), "{}", r.stderr);
    assert!(
        r.stderr.contains("deployment.pools[0].capacity_tokens"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("hint: replay with --backend cpu"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty());
}

#[test]
fn audit_of_a_two_to_the_31_slot_pool_runs_in_small_memory() {
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), 1 << 31);
    let r = run_bounded(&["audit", t.to_str().unwrap(), "--json"]);
    assert!(r.code == 0 || r.code == 1, "exit {}: {}", r.code, r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert!(j.is_object(), "{}", r.stdout);
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn what_if_replay_of_a_two_to_the_31_slot_pool_is_refused_with_exit_2() {
    // The engine model keeps state for every slot it simulates.
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), 1 << 31);
    let out = dir.path().join("new");
    let r = run_bounded(&[
        "replay",
        t.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("trace.json")
            && r.stderr.contains("deployment.pools[0].capacity_tokens")
            && r.stderr
                .contains("hint: replay a smaller pool with --set prefill.capacity_tokens=N"),
        "{}",
        r.stderr
    );
    assert!(!out.exists());
}

/// `pools` small pools of one kv file: in each, one request writes 8 slots
/// and another reads them (every pool has one foreign read).
fn many_pool_trace(dir: &Path, pools: u16) -> PathBuf {
    let mut evs = Vec::new();
    for p in 0..pools {
        let (owner, reader) = (1 + 2 * (p as u64 % 8), 2 + 2 * (p as u64 % 8));
        for (seq, (rid, op)) in [
            (owner, Op::Alloc),
            (owner, Op::Write),
            (reader, Op::Read),
            (owner, Op::Free),
        ]
        .into_iter()
        .enumerate()
        {
            evs.push(KvEvent {
                pool: p,
                seq: seq as u64,
                ts_ns: 2_000 + seq as i64,
                request_id: rid,
                op,
                slot_start: 0,
                slot_count: 8,
                token_pos: None,
                src: None,
            });
        }
    }
    let reqs: Vec<RequestRecord> = (1..=16)
        .map(|id| request(id, &format!("t{id}"), 0, 0))
        .collect();
    let decl = (0..pools).map(|p| pool(p, Role::Prefill, 64)).collect();
    write_trace(dir, decl, &evs, &reqs)
}

#[test]
fn sixteen_thousand_pools_in_one_file_scope_in_near_linear_time() {
    // Before: every pool's stream copied the trace (its 16,000 pools) and
    // decoded the whole file again (16,000 times): minutes.
    let dir = tempfile::tempdir().unwrap();
    let t = many_pool_trace(&dir.path().join("t"), 16_000);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        j["affected_responses"].as_array().unwrap().len(),
        8,
        "{}",
        r.stdout
    );
    assert!(r.cpu < Duration::from_secs(60), "took {:?} of CPU", r.cpu);
    assert!(r.peak_mib < 1024, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn counterfactual_of_a_read_at_token_position_near_2_to_the_32_stays_small() {
    // The context of an affected response was a vector indexed by token
    // position: a read at position 2^32 - 9 allocated ~100 GB.
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace_at(&dir.path().join("t"), 64, Some(u32::MAX - 8));
    // Claim the reference model wrote it (counterfactual applies).
    let p = t.join("trace.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    m["capture"]["writer"] = "kvtrail-sim".into();
    m["deployment"]["simulator"] = serde_json::json!({});
    let digest = |f: &str| {
        blake3::hash(&std::fs::read(t.join(f)).unwrap())
            .to_hex()
            .to_string()
    };
    m["files"] = serde_json::json!([
        {"path": "kv/all.parquet", "rows": 10, "blake3": digest("kv/all.parquet")},
        {"path": "requests/r.parquet", "rows": 3, "blake3": digest("requests/r.parquet")},
    ]);
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let r = run_bounded(&["counterfactual", t.to_str().unwrap(), "--json"]);
    assert!(r.code == 0 || r.code == 1, "exit {}: {}", r.code, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["applicable"], true, "{}", r.stdout);
    assert_eq!(j["affected_responses"], 1, "{}", r.stdout);
    assert!(r.peak_mib < 256, "peak RSS {} MiB", r.peak_mib);
}

#[test]
fn requests_of_a_sixteen_thousand_pool_trace_are_checked_in_linear_time() {
    // Each request's pool ids were looked up by a scan of the deployment's
    // pools: requests x pools (200,000 requests: 74 s in a release build).
    let dir = tempfile::tempdir().unwrap();
    let pools: u16 = 16_000;
    let decl = (0..pools).map(|p| pool(p, Role::Prefill, 64)).collect();
    let reqs: Vec<RequestRecord> = (1..=200_000)
        .map(|id| request(id, "acme", pools - 1, pools - 1))
        .collect();
    let t = write_trace(&dir.path().join("t"), decl, &[], &reqs);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // CPU time, not wall time: a loaded machine stretches the wall clock,
    // never the work (linear: ~1 s; quadratic: over a minute).
    assert!(r.cpu < Duration::from_secs(10), "took {:?} of CPU", r.cpu);
}

/// One request writes (or scrubs, or copies) every slot of a 2^31-slot
/// pool: a valid trace whose state alone would take 36 GB. Before, scope
/// aborted on allocation under the 4 GiB limit (signal 6); the replay now
/// refuses it with exit 2, naming the kv file, the row and the limit.
fn whole_pool_store_trace(dir: &Path, op: Op) -> PathBuf {
    let cap: u64 = 1 << 31;
    let mk = |pool: u16, seq: u64, op: Op, src: Option<CopySrc>| KvEvent {
        pool,
        seq,
        ts_ns: 1_000 + seq as i64,
        request_id: 1,
        op,
        slot_start: 0,
        slot_count: (cap - 1) as u32,
        token_pos: None,
        src,
    };
    let mut evs = vec![mk(0, 0, Op::Alloc, None), mk(0, 1, op, None)];
    if op == Op::Write {
        let src = CopySrc {
            pool: 0,
            slot_start: 0,
            seq: 1,
        };
        evs.push(mk(1, 0, Op::Write, Some(src)));
    }
    write_trace(
        dir,
        vec![pool(0, Role::Prefill, cap), pool(1, Role::Decode, cap)],
        &evs,
        &[request(1, "acme", 0, 1)],
    )
}

#[test]
fn a_store_to_every_slot_of_a_two_to_the_31_slot_pool_is_refused_not_an_abort() {
    for op in [Op::Write, Op::Scrub] {
        let dir = tempfile::tempdir().unwrap();
        let t = whole_pool_store_trace(&dir.path().join("t"), op);
        let r = run_bounded(&["scope", t.to_str().unwrap(), "--json"]);
        assert_eq!(r.code, 2, "{op:?}: exit {}\n{}", r.code, r.stderr);
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
        for want in [
            "kv/all.parquet",
            "row 1",
            "slot_count",
            "KVTRAIL_MAX_TOUCHED_SLOTS",
        ] {
            assert!(
                r.stderr.contains(want),
                "{op:?}: no {want:?} in\n{}",
                r.stderr
            );
        }
        assert!(r.peak_mib < 512, "{op:?}: peak RSS {} MiB", r.peak_mib);
    }
}

#[test]
fn the_touched_slot_limit_can_be_raised_and_lowered_for_the_machine() {
    // The ten-event trace touches 16 slots in two pages: a limit of one
    // page refuses it, the default accepts it.
    let dir = tempfile::tempdir().unwrap();
    let t = top_of_pool_trace(&dir.path().join("t"), 1 << 20);
    let out = kvtrail(["scope", t.to_str().unwrap(), "--json"])
        .env("KVTRAIL_MAX_TOUCHED_SLOTS", "1024")
        .run();
    assert_eq!(out.code, 2, "{}", out.stderr);
    let r = run_bounded(&["scope", t.to_str().unwrap(), "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}
