//! `kvtrail scope --json` byte for byte across backends on simulated
//! traces (the incident and a steady workload): cpu, the hidden emu (the GPU
//! backend's launch sequence with the kernels compiled as C++), auto; and
//! `--backend cuda`, which must either match (GPU present) or exit 2 with a
//! message naming what is missing (no feature, no libcuda, no NVRTC, no
//! device) and print nothing on stdout.

use crate::support::cli::{kvtrail, s, simulate};

fn check(scenario: &str, requests: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let trace = simulate(
        &tmp.path().join(scenario),
        &["--scenario", scenario, "--requests", requests],
    );
    let scope = |backend: &str| {
        let r = kvtrail(["scope", s(&trace), "--json", "--backend", backend]).run();
        (r.code, r.stdout_bytes, r.stderr)
    };
    let (code, cpu, err) = scope("cpu");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("replay backend: cpu"), "{err}");
    assert!(cpu.len() > 100);
    for b in ["emu", "auto"] {
        let (code, out, err) = scope(b);
        assert_eq!(code, 0, "{b}: {err}");
        assert!(
            out == cpu,
            "{scenario}: --backend {b} output differs from cpu"
        );
        assert!(err.contains("replay backend: "), "{err}");
    }
    let (code, out, err) = scope("cuda");
    match kvtrail::lineage::gpu::unavailable() {
        Some(why) => {
            assert_eq!(code, 2, "{err}");
            assert!(out.is_empty());
            assert!(
                err.contains("--backend cuda") && err.contains(&why),
                "{err}"
            );
            let (_, _, auto_err) = scope("auto");
            assert!(
                auto_err.contains("replay backend: cpu (auto: "),
                "{auto_err}"
            );
        }
        None => {
            assert_eq!(code, 0, "{err}");
            assert!(
                out == cpu,
                "{scenario}: --backend cuda output differs from cpu"
            );
        }
    }
}

#[test]
fn scope_json_is_identical_on_every_backend_incident() {
    check("incident", "600");
}

#[test]
fn scope_json_is_identical_on_every_backend_steady() {
    check("steady", "400");
}
