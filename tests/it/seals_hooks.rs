//! A sealed capture from a real package: `kvtrail record --signing-key K
//! --seal-every 1s` fed by the kvtrail_vllm hook inside the real `vllm`
//! package (0.33.0, CPU; tests/vllm/record_driver.py, as
//! tests/it/record_vllm.rs runs it) during the vllm-project/vllm#52234 stale
//! reference. Stock `ssh-keygen -Y verify` accepts every seal, `kvtrail
//! verify --allowed-signers` accepts the capture and names the signer,
//! scope still finds the exposure; a seal removed fails.
//!
//! Needs the venv of .ci/setup.d/32-vllm.sh (+ 33-kvtrail-vllm-hook.sh); a
//! missing venv FAILS this test, as in record_vllm.rs.
//!
//! Index:
//! - vllm_capture_is_sealed_and_openssh_accepts_every_seal

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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

/// `ssh-keygen -Y verify` of one seal: success, and what it printed.
fn openssh_verify(allowed: &Path, seal: &Path) -> (bool, String) {
    let sig = PathBuf::from(format!("{}.sig", seal.display()));
    let mut child = Command::new("ssh-keygen")
        .args(["-Y", "verify", "-f"])
        .arg(allowed)
        .args(["-I", ID, "-n", "kvtrail-seal", "-s"])
        .arg(&sig)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(seal).unwrap())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

#[test]
fn vllm_capture_is_sealed_and_openssh_accepts_every_seal() {
    let py = venv::VLLM
        .python()
        .expect("the vLLM venv is missing: run .ci/setup.d/32-vllm.sh and .ci/setup.d/33-kvtrail-vllm-hook.sh");
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sock = d.path().join("kvtrail.sock");
    let out = d.path().join("trace");
    let mut sidecar = kvtrail([
        "record",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--deployment",
        s(&root.join("tests/data/record/deploy-vllm-cpu.json")),
        "--out",
        s(&out),
        "--health-secs",
        "0",
        "--from-engine-start",
        "--signing-key",
        s(&key),
        "--seal-every",
        "1s",
        // Live detection: live-findings.json is sealed with the trace and
        // must equal a fresh scope.
        "--live",
    ])
    .spawn();
    wait_for(&sock);
    let driver = Command::new(py)
        .arg("-W")
        .arg("ignore")
        .arg(root.join("tests/vllm/record_driver.py"))
        .arg(&sock)
        .arg("stale")
        .env(
            "PYTHONPATH",
            std::env::join_paths([root.join("hooks/vllm/src"), root.join("hooks/client/src")])
                .unwrap(),
        )
        .env("HF_HUB_OFFLINE", "1")
        .env("KVTRAIL_DRIVER_EXIT", "uninstall")
        .current_dir(d.path())
        .output()
        .unwrap();
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

    // Every seal, checked by stock OpenSSH alone.
    let mut seals: Vec<PathBuf> = std::fs::read_dir(out.join("seals"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    seals.sort();
    assert!(seals.len() >= 2, "{seals:?}");
    for p in &seals {
        let (ok, msg) = openssh_verify(&allowed, p);
        assert!(ok, "ssh-keygen refused {}: {msg}", p.display());
        assert!(msg.contains(ID), "{msg}");
    }
    let last: serde_json::Value =
        serde_json::from_slice(&std::fs::read(seals.last().unwrap()).unwrap()).unwrap();
    // kvtrail's own check: signatures, chain, every data file covered.
    let o = kvtrail([
        "verify",
        s(&out),
        "--allowed-signers",
        s(&allowed),
        "--json",
    ])
    .run();
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
    // Sealing leaves the analysis alone: the stale reference is found.
    let sc = kvtrail(["scope", s(&out), "--json", "--fail-on-exposure"]).run();
    assert_eq!(sc.code, 1, "{}{}", sc.stdout, sc.stderr);
    let v: serde_json::Value = serde_json::from_str(&sc.stdout).unwrap();
    assert!(
        !v["affected_responses"].as_array().unwrap().is_empty(),
        "{v}"
    );

    crate::support::record::assert_live_equals_scope(&out);

    // A seal removed from the middle of the chain fails.
    let gone = &seals[seals.len() / 2];
    std::fs::remove_file(gone).unwrap();
    let o = kvtrail(["verify", s(&out), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
}
