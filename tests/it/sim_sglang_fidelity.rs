//! Fidelity against the real thing: the same alloc/free sequences go
//! through SGLang's own allocators (TokenToKVPoolAllocator,
//! PagedTokenToKVPoolAllocator; sglang 0.5.19 and 0.5.23, on CPU, via
//! tests/sglang/alloc_driver.py) and through `kvtrail::sim::alloc`; the slot
//! indices must be identical, op by op. The admission rule
//! (`validate_input_length`, `Req.set_finish_with_abort`) is checked the
//! same way.
//!
//! Needs the virtualenv of .ci/setup.d/30-sglang.sh (under
//! ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}, or KVTRAIL_SGLANG_VENV). With
//! `CI` set a missing venv fails the test; elsewhere it is skipped with a
//! message saying how to set it up.

use crate::support::venv;

use std::io::Write;
use std::process::{Command, Stdio};

use kvtrail::sim::alloc::{
    Allocator, FreeListPolicy, PLACEHOLDER_TOKENS, Verdict, validate_input_length,
};
use kvtrail::sim::workload::Rng;
use kvtrail::trace::manifest::max_req_input_len;
use serde_json::{Value, json};

/// Runs the driver under one sglang version; None when the venv is absent
/// outside CI.
fn driver(input: &Value, current: bool) -> Option<Value> {
    let python = venv::SGLANG.python()?;
    let v = python.parent()?.parent()?.to_path_buf();
    let mut cmd = Command::new(&python);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/sglang/alloc_driver.py"
    ));
    if current {
        let dir = v.join("sglang-0.5.23");
        assert!(
            dir.exists(),
            "{} missing: rerun .ci/setup.d/30-sglang.sh",
            dir.display()
        );
        cmd.env("PYTHONPATH", dir);
    } else {
        cmd.env_remove("PYTHONPATH");
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the sglang driver");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "driver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("driver JSON"))
}

struct Case {
    page_size: u32,
    size: u64,
    need_sort: bool,
    ops: Vec<Value>,
    expect: Vec<Value>,
}

/// Generates a random op sequence and runs it through our allocator
/// (which also decides which requests exist, so the ops stay valid).
fn case(page_size: u32, size: u64, need_sort: bool, seed: u64, n_ops: usize) -> Case {
    let policy = if need_sort {
        FreeListPolicy::SortedStaged
    } else {
        FreeListPolicy::MostRecentlyFreed
    };
    let mut a = Allocator::new(size, page_size, policy);
    let mut rng = Rng::new(seed);
    let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut next = 1u64;
    let (mut ops, mut expect) = (Vec::new(), Vec::new());
    let cap = size as u32;
    for _ in 0..n_ops {
        let r = rng.range(0, 100);
        if r < 30 || live.is_empty() {
            // New request: page-aligned alloc or an extend from 0.
            let k = next;
            next += 1;
            if rng.range(0, 2) == 0 {
                let n = rng.range(1, (cap / page_size / 4).max(2) as u64) as u32 * page_size;
                ops.push(json!({"op": "alloc", "req": k, "n": n}));
                let res = a.alloc_pages(n / page_size).map(|p| {
                    p.iter()
                        .flat_map(|&p| p * page_size..(p + 1) * page_size)
                        .collect::<Vec<u32>>()
                });
                expect.push(json!(res));
                if let Some(s) = res {
                    live.push((k, s));
                }
            } else {
                let to = rng.range(1, (cap / 3).max(2) as u64) as u32;
                ops.push(json!({"op": "extend", "req": k, "to": to}));
                let res = a.alloc_extend(0, to, 0).map(|x| x.0);
                expect.push(json!(res));
                if let Some(s) = res {
                    live.push((k, s));
                }
            }
        } else if r < 55 {
            let i = rng.range(0, live.len() as u64) as usize;
            let (k, s) = &mut live[i];
            let to = s.len() as u32 + rng.range(1, (cap / 8).max(2) as u64) as u32;
            ops.push(json!({"op": "extend", "req": *k, "to": to, "grow": true}));
            let res = a
                .alloc_extend(s.len() as u32, to, *s.last().unwrap())
                .map(|x| x.0);
            if let Some(new) = &res {
                s.extend_from_slice(new);
            }
            expect.push(json!(res));
        } else if r < 75 {
            let i = rng.range(0, live.len() as u64) as usize;
            let (k, s) = &mut live[i];
            ops.push(json!({"op": "decode", "req": *k}));
            let res = a
                .alloc_decode(s.len() as u32 + 1, *s.last().unwrap())
                .map(|x| vec![x.0]);
            if let Some(new) = &res {
                s.extend_from_slice(new);
            }
            expect.push(json!(res));
        } else {
            let i = rng.range(0, live.len() as u64) as usize;
            let (k, s) = live.swap_remove(i);
            ops.push(json!({"op": "free", "req": k}));
            a.free_slots(&s);
            expect.push(json!([]));
        }
    }
    expect.push(json!([
        "available",
        a.available_pages() as u64 * page_size as u64
    ]));
    Case {
        page_size,
        size,
        need_sort,
        ops,
        expect,
    }
}

fn cases() -> Vec<Case> {
    vec![
        case(1, 64, true, 1, 400),    // TokenToKVPoolAllocator, PD (need_sort)
        case(4, 256, true, 2, 400),   // paged, PD
        case(4, 256, false, 3, 400),  // paged, most recently freed first
        case(16, 1024, true, 4, 400), // paged, bigger pages
        case(64, 64 * 40, true, 5, 300),
    ]
}

/// (prompt, max_req_input_len, allow_auto_truncate)
fn admission_inputs() -> Vec<(u64, u64, bool)> {
    let lim = max_req_input_len(1_048_576, 681_280);
    assert_eq!(lim, 681_274);
    let small = max_req_input_len(16_384, 10_640);
    vec![
        (lim - 1, lim, false),
        (lim, lim, false),
        (lim + 1, lim, false),
        (lim + 500, lim, true),
        (lim - 1, lim, true),
        (small - 1, small, false),
        (small, small, false),
    ]
}

fn check_version(current: bool) {
    let cases = cases();
    let input = json!({
        "cases": cases.iter().map(|c| json!({"page_size": c.page_size, "size": c.size, "need_sort": c.need_sort, "ops": c.ops})).collect::<Vec<_>>(),
        "admission": admission_inputs().iter().map(|&(p, m, t)| json!({"prompt": p, "max_req_input_len": m, "truncate": t})).collect::<Vec<_>>(),
    });
    let Some(out) = driver(&input, current) else {
        return;
    };
    let version = out["sglang"].as_str().unwrap().to_string();
    assert_eq!(version, if current { "0.5.23" } else { "0.5.19" });
    for (i, c) in cases.iter().enumerate() {
        let got = out["cases"][i].as_array().unwrap();
        assert_eq!(got.len(), c.expect.len());
        let mut allocs = 0;
        for (j, (g, e)) in got.iter().zip(&c.expect).enumerate() {
            assert_eq!(
                g,
                e,
                "sglang {version}, case {i} (page {}, need_sort {}), op {j}: {}",
                c.page_size,
                c.need_sort,
                c.ops.get(j).map(|o| o.to_string()).unwrap_or_default()
            );
            allocs += g.is_array() as usize;
        }
        // The sequence must exercise exhaustion (null) and reuse.
        assert!(
            c.expect.iter().any(|e| e.is_null()),
            "case {i} never exhausts the pool"
        );
        assert!(allocs > 100);
    }
    for (k, &(prompt, lim, truncate)) in admission_inputs().iter().enumerate() {
        let g = &out["admission"][k];
        let ours = validate_input_length(prompt, lim, truncate);
        let (error, len_after) = match ours {
            Verdict::Accept => (false, prompt),
            Verdict::Truncate(n) => (false, n),
            Verdict::Reject => (true, PLACEHOLDER_TOKENS as u64),
        };
        assert_eq!(
            g["error"],
            json!(error),
            "sglang {version}: prompt {prompt} limit {lim}"
        );
        assert_eq!(
            g["len_after"],
            json!(len_after),
            "sglang {version}: prompt {prompt}"
        );
        if error {
            // The 1-token placeholder [0] with a pending 400 that finished()
            // does not see until update_finish_state.
            assert_eq!(g["first_id"], json!(0));
            assert_eq!(g["status"], json!(400));
            assert_eq!(g["finished"], json!(false));
            assert_eq!(g["finished_after_update"], json!(true));
        } else {
            assert_eq!(g["status"], Value::Null);
        }
    }
}

#[test]
fn allocator_and_admission_match_sglang_0_5_19() {
    check_version(false);
}

#[test]
fn allocator_and_admission_match_sglang_0_5_23() {
    check_version(true);
}
