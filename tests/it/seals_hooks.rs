//! Sealed captures from the real packages, carried up the whole chain:
//! `kvtrail record --signing-key K --seal-every 1s` fed by the kvtrail_vllm
//! hook inside the real `vllm` package (0.33.0, CPU;
//! tests/vllm/record_driver.py, as tests/it/record_vllm.rs runs it) during
//! the vllm-project/vllm#52234 stale reference, and by the kvtrail_sglang
//! hook inside the real `sglang` package (0.5.19, CPU;
//! tests/sglang/record_driver.py, as tests/it/record_sglang.rs runs it)
//! during the seed's placeholder path. Stock `ssh-keygen -Y verify`
//! accepts every seal, `kvtrail verify --allowed-signers` accepts the
//! capture and names the signer, a signed scope folder finds the exposure,
//! its statement names the capture's last seal and holds, and `verify
//! --reproduce` re-runs the verdict byte for byte; a seal removed fails.
//!
//! Needs the venvs of .ci/setup.d/30-33; a missing venv FAILS these tests,
//! as in record_vllm.rs.
//!
//! Index:
//! - vllm_capture_is_sealed_signed_and_reproduced
//! - sglang_capture_is_sealed_signed_and_reproduced

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::cli::{kvtrail, s};
use crate::support::venv;

const ID: &str = "capture@example";

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

/// One engine's driver: the venv's python, the deployment, the script and
/// its arguments, the hook's source folder, and its environment.
struct Driver {
    py: PathBuf,
    deploy: &'static str,
    script: &'static str,
    args: &'static [&'static str],
    hook: &'static str,
    env: &'static [(&'static str, &'static str)],
    record: &'static [&'static str],
    /// Run in the test's temporary folder (else beside the script).
    in_temp: bool,
}

/// Runs the driver against a sealing `kvtrail record`; returns the trace.
fn sealed_capture(d: &Path, key: &Path, drv: &Driver) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.join("kvtrail.sock");
    let out = d.join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join("tests/data/record").join(drv.deploy)),
        "--out",
        s(&out),
        "--health-secs",
        "0",
        "--signing-key",
        s(key),
        "--seal-every",
        "1s",
        // Live detection: live-findings.json is sealed with the trace and
        // must equal a fresh scope.
        "--live",
    ])
    .args(drv.record)
    .spawn();
    wait_for(&sock);
    let script = root.join(drv.script);
    let mut cmd = Command::new(&drv.py);
    cmd.arg("-W")
        .arg("ignore")
        .arg(&script)
        .arg(&sock)
        .args(drv.args)
        .env(
            "PYTHONPATH",
            crate::support::venv::hook_pythonpath(drv.hook),
        )
        .current_dir(if drv.in_temp {
            d
        } else {
            script.parent().unwrap()
        });
    for (k, v) in drv.env {
        cmd.env(k, v);
    }
    let driver = cmd.output().unwrap();
    unsafe { libc::kill(sidecar.id() as i32, libc::SIGTERM) };
    let status = sidecar.wait().unwrap();
    let mut side_err = String::new();
    std::io::Read::read_to_string(sidecar.stderr.as_mut().unwrap(), &mut side_err).unwrap();
    assert!(
        driver.status.success(),
        "driver failed:\n{}\n{}",
        String::from_utf8_lossy(&driver.stdout),
        String::from_utf8_lossy(&driver.stderr)
    );
    assert!(status.success(), "sidecar: {status:?}\n{side_err}");
    out
}

/// Every link above a sealed real-package capture, then a seal removed.
fn check_chain(d: &Path, out: &Path, key: &Path, allowed: &Path) {
    // Every seal, checked by stock OpenSSH alone.
    let mut seals: Vec<PathBuf> = std::fs::read_dir(out.join("seals"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    seals.sort();
    assert!(seals.len() >= 2, "{seals:?}");
    for p in &seals {
        let (ok, msg) = crate::support::keys::openssh_verify(allowed, ID, p);
        assert!(ok, "ssh-keygen refused {}: {msg}", p.display());
        assert!(msg.contains(ID), "{msg}");
    }
    let last: serde_json::Value =
        serde_json::from_slice(&std::fs::read(seals.last().unwrap()).unwrap()).unwrap();
    // kvtrail's own check: signatures, chain, every data file covered.
    let o = kvtrail(["verify", s(out), "--allowed-signers", s(allowed), "--json"]).run();
    assert_eq!(o.code, 0, "{}{}\nlast seal: {last}", o.stdout, o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["all_ok"], true, "{v}");
    assert_eq!(v["seals"]["ok"], true, "{v}");
    assert_eq!(v["seals"]["final_seal"], true, "{v}");
    assert_eq!(v["live"]["equal"], true, "{v}");
    assert!(
        v["seals"]["signers"][0].as_str().unwrap().starts_with(ID),
        "{v}"
    );
    // Sealing leaves the analysis alone: the exposure is found, in a
    // signed folder whose statement names the capture's last seal.
    let scope = d.join("scope");
    let sc = kvtrail([
        "scope",
        s(out),
        "--out",
        s(&scope),
        "--signing-key",
        s(key),
        "--fail-on-exposure",
    ])
    .run();
    assert_eq!(sc.code, 1, "{}{}", sc.stdout, sc.stderr);
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(scope.join("summary.json")).unwrap()).unwrap();
    assert!(
        !summary["affected_responses"].as_array().unwrap().is_empty(),
        "{summary}"
    );
    let st = kvtrail(["verify", s(&scope), "--allowed-signers", s(allowed)]).run();
    assert!(st.ok().contains("SIGNED"), "{}", st.stdout);
    let envelope = std::fs::read_to_string(scope.join("statement.intoto.jsonl")).unwrap();
    let last_name = seals
        .last()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    {
        use base64::Engine as _;
        let env: serde_json::Value = serde_json::from_str(envelope.trim_end()).unwrap();
        let body = base64::engine::general_purpose::STANDARD
            .decode(env["payload"].as_str().unwrap())
            .unwrap();
        let stmt: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            stmt["predicate"]["inputs"][0]["last_seal"]["name"],
            format!("seals/{last_name}").as_str(),
            "{stmt}"
        );
    }
    // A stranger reproduces the verdict from the capture.
    let r = kvtrail(["verify", s(&scope), "--reproduce"]).run();
    assert!(r.ok().starts_with("OK: reproduced"), "{}", r.stdout);

    crate::support::record::assert_live_equals_scope(out);

    // A seal removed from the middle of the chain fails.
    let gone = &seals[seals.len() / 2];
    std::fs::remove_file(gone).unwrap();
    let o = kvtrail(["verify", s(out), "--allowed-signers", s(allowed)]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
}

#[test]
fn vllm_capture_is_sealed_signed_and_reproduced() {
    let py = venv::VLLM
        .python()
        .expect("the vLLM venv is missing: run .ci/setup.d/32-vllm.sh and .ci/setup.d/33-kvtrail-vllm-hook.sh");
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    let drv = Driver {
        py,
        deploy: "deploy-vllm-cpu.json",
        script: "tests/vllm/record_driver.py",
        args: &["stale"],
        hook: "hooks/vllm/src",
        env: &[
            ("HF_HUB_OFFLINE", "1"),
            ("KVTRAIL_DRIVER_EXIT", "uninstall"),
        ],
        record: &["--from-engine-start"],
        in_temp: true,
    };
    let out = sealed_capture(d.path(), &key, &drv);
    check_chain(d.path(), &out, &key, &allowed);
}

#[test]
fn sglang_capture_is_sealed_signed_and_reproduced() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    let drv = Driver {
        py,
        deploy: "deploy-sglang-cpu.json",
        script: "tests/sglang/record_driver.py",
        args: &[],
        hook: "hooks/sglang/src",
        env: &[],
        record: &[],
        in_temp: false,
    };
    let out = sealed_capture(d.path(), &key, &drv);
    check_chain(d.path(), &out, &key, &allowed);
}
