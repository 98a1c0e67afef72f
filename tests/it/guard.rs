//! The guard (docs/guard.md) on the real engine packages, on CPU: the
//! native module `kvtrail_guard` (hooks/native, built and installed into
//! target/kvtrail-guard-native by .ci/setup.d/34-kvtrail-guard.sh) under
//! the SGLang and vLLM hooks, driven by tests/sglang/guard_driver.py
//! (SGLang 0.5.19: the seed's placeholder path) and
//! tests/vllm/record_driver.py (vLLM 0.33.0: the #52234 stale reference,
//! the stale CPU-offload load, and the clean runs).
//!
//! The guard's decisions also reach the sidecar (`guard` lines): counted
//! in `record --metrics` and alerted once per request.
//!
//! Needs the venvs (30-/32-) and the module (34-): with `CI` set a missing
//! one FAILS the test; otherwise it is skipped with a message.

use crate::support::venv;
use crate::support::venv::native;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

use kvtrail::trace::Trace;

use crate::support::cli::{kvtrail, s};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `tests/<engine>/<script> args` with the hook (and `native`, if
/// given) importable and the guard settings in `env`.
fn driver(
    py: &Path,
    engine: &str,
    script: &str,
    args: &[&str],
    native: Option<&Path>,
    env: &[(&str, &str)],
) -> Output {
    let mut path = Vec::new();
    if let Some(n) = native {
        path.push(n.to_path_buf());
    }
    path.push(root().join("hooks").join(engine).join("src"));
    path.push(root().join("hooks/client/src"));
    let mut c = Command::new(py);
    c.arg("-W")
        .arg("ignore")
        .arg(root().join("tests").join(engine).join(script))
        .args(args)
        .env("PYTHONPATH", std::env::join_paths(path).unwrap())
        .env_remove("KVTRAIL_GUARD")
        .env_remove("KVTRAIL_GUARD_UNKNOWN")
        .current_dir(root().join("tests").join(engine));
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn facts_of(o: &Output, what: &str) -> Value {
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// The driver against a `kvtrail record` sidecar: its facts, and the
/// trace's request rows by external id (status, finish reason).
fn with_sidecar(
    py: &Path,
    engine: &str,
    script: &str,
    mode: Option<&str>,
    deploy: &str,
    native: &Path,
    env: &[(&str, &str)],
) -> (Value, BTreeMap<String, (u16, Option<String>)>) {
    let d = tempfile::tempdir().unwrap();
    let run = Run {
        py,
        engine,
        script,
        mode,
        deploy,
        native,
        env,
    };
    // Live detection on: a request the guard aborted has no read in the
    // trace, and live findings still equal a fresh scope.
    let (facts, rows, out) = run.with_sidecar(d.path(), &["--live"], |_| {});
    crate::support::record::assert_live_equals_scope(&out);
    (facts, rows)
}

/// One driver run against a sidecar.
struct Run<'a> {
    py: &'a Path,
    engine: &'a str,
    script: &'a str,
    mode: Option<&'a str>,
    deploy: &'a str,
    native: &'a Path,
    env: &'a [(&'a str, &'a str)],
}

/// A request row's status and finish reason, by external id.
type Rows = BTreeMap<String, (u16, Option<String>)>;

impl Run<'_> {
    /// Records into `dir/trace` with `record` given `extra` options;
    /// `before_stop` runs once the driver has ended, while the sidecar
    /// still runs. Returns the facts, the rows and the trace folder.
    fn with_sidecar(
        &self,
        dir: &Path,
        extra: &[&str],
        before_stop: impl FnOnce(&Value),
    ) -> (Value, Rows, PathBuf) {
        let Run {
            py,
            engine,
            script,
            mode,
            deploy,
            native,
            env,
        } = *self;
        let sock = dir.join("kvtrail.sock");
        let out = dir.join("trace");
        let mut args = vec![
            "record".to_string(),
            "--listen".into(),
            format!("unix:{}", sock.display()),
            "--deployment".into(),
            s(&root().join("tests/data/record").join(deploy)).into(),
            "--out".into(),
            s(&out).into(),
            "--health-secs".into(),
            "0".into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let sidecar = kvtrail(&args).spawn();
        let t = Instant::now();
        while !sock.exists() {
            assert!(t.elapsed() < Duration::from_secs(30), "no sidecar socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut args = vec![s(&sock)];
        args.extend(mode);
        let o = driver(py, engine, script, &args, Some(native), env);
        let facts = facts_of(&o, script);
        before_stop(&facts);
        unsafe { libc::kill(sidecar.id() as i32, libc::SIGTERM) };
        let o = crate::support::record::wait_bounded(sidecar, Duration::from_secs(60));
        assert!(
            o.status.success(),
            "sidecar: {:?}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        let trace = Trace::open(&out).unwrap();
        let mut rows = BTreeMap::new();
        for b in trace.requests() {
            for r in b.unwrap() {
                rows.insert(
                    r.external_id.clone().unwrap(),
                    (r.http_status, r.finish_reason.clone()),
                );
            }
        }
        (facts, rows, out)
    }
}

fn sources(alert: &Value) -> Vec<u64> {
    let mut v: Vec<u64> = alert["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn guard_aborts_sglang_seed_placeholder_decode_with_an_error() {
    let (Some(py), Some(native)) = (venv::SGLANG.python(), native()) else {
        return;
    };
    let (f, rows) = with_sidecar(
        &py,
        "sglang",
        "guard_driver.py",
        None,
        "deploy-sglang-cpu.json",
        &native,
        &[("KVTRAIL_GUARD", "abort")],
    );
    // C (the placeholder) and D (the poisoned decode radix-tree hit) end
    // with SGLang's abort, an error status, before any decode forward.
    for r in ["C", "D"] {
        assert_eq!(f[r]["finished_reason"], "FINISH_ABORT", "{r}: {f}");
        assert_eq!(f[r]["status_code"], 500, "{r}");
        assert_eq!(f[r]["err_type"], "KVIsolationError", "{r}");
        assert_eq!(rows[r], (500, Some("abort".into())), "{r}");
    }
    for r in ["A", "B"] {
        assert_eq!(f[r]["finished_reason"], "FINISH_LENGTH", "{r}");
        assert_eq!(rows[r], (200, Some("length".into())), "{r}");
    }
    let g = &f["guard"];
    assert_eq!(
        (
            &g["checks"],
            &g["ok"],
            &g["foreign"],
            &g["aborts"],
            &g["alerts"]
        ),
        (&4.into(), &2.into(), &2.into(), &2.into(), &0.into()),
        "{g}"
    );
    assert_eq!(g["native_copies_remote"], 0, "{g}");
    let alerts = f["alerts"].as_array().unwrap();
    let a = f["A"]["request_id"].as_u64().unwrap();
    let b = f["B"]["request_id"].as_u64().unwrap();
    assert_eq!(alerts[0]["request"], "C");
    assert_eq!(alerts[0]["action"], "abort");
    assert_eq!(sources(&alerts[0]), [a.min(b), a.max(b)]);
    assert_eq!(alerts[1]["request"], "D");
    assert_eq!(sources(&alerts[1]), [a]);
}

/// `kvtrail_guard_decisions_total{verdict,action}` in a scrape (None:
/// no such series).
fn guard_series(body: &str, verdict: &str, action: &str) -> Option<u64> {
    let key = format!(r#"kvtrail_guard_decisions_total{{verdict="{verdict}",action="{action}"}} "#);
    body.lines()
        .find_map(|l| l.strip_prefix(key.as_str()))
        .and_then(|x| x.trim().parse().ok())
}

fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(c, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut body = String::new();
    let _ = c.read_to_string(&mut body);
    body
}

/// The guard's decisions reach the sidecar: SGLang's seed path under
/// `KVTRAIL_GUARD=abort` against `kvtrail record --metrics --alerts`.
/// While the sidecar runs, /metrics counts the two aborts
/// (`kvtrail_guard_decisions_total{verdict="foreign",action="abort"} 2`)
/// and the two checks answered ok (`verdict="ok",action="allow"`);
/// at close the alerts file holds one `guard_foreign_read` alert for each
/// aborted request (C and D), naming its sources; the live findings still
/// equal a fresh scope.
#[test]
fn guard_aborts_reach_the_sidecar_metrics_and_alerts() {
    let (Some(py), Some(native)) = (venv::SGLANG.python(), native()) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let alerts = d.path().join("alerts.jsonl");
    let run = Run {
        py: &py,
        engine: "sglang",
        script: "guard_driver.py",
        mode: None,
        deploy: "deploy-sglang-cpu.json",
        native: &native,
        env: &[("KVTRAIL_GUARD", "abort")],
    };
    let mut body = String::new();
    let (f, rows, out) = run.with_sidecar(
        d.path(),
        &["--metrics", &addr, "--alerts", s(&alerts)],
        |_| {
            let t = Instant::now();
            loop {
                body = scrape(&addr);
                if guard_series(&body, "foreign", "abort") == Some(2)
                    && guard_series(&body, "ok", "allow") == Some(2)
                {
                    break;
                }
                assert!(t.elapsed() < Duration::from_secs(30), "{body}");
                std::thread::sleep(Duration::from_millis(100));
            }
        },
    );
    assert_eq!(f["guard"]["aborts"], 2, "{f}");
    assert_eq!(guard_series(&body, "foreign", "alert"), Some(0), "{body}");
    assert_eq!(guard_series(&body, "unknown", "allow"), Some(0), "{body}");
    // A and B were checked and ok: counted through `guard_ok` lines.
    assert_eq!(guard_series(&body, "ok", "allow"), Some(2), "{body}");
    for r in ["C", "D"] {
        assert_eq!(rows[r], (500, Some("abort".into())), "{r}");
    }
    let lines: Vec<Value> = std::fs::read_to_string(&alerts)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut guard: Vec<(u64, Vec<u64>)> = lines
        .iter()
        .filter(|a| a["unmapped"]["trigger"] == "guard_foreign_read")
        .map(|a| {
            assert_eq!(a["unmapped"]["action"], "abort", "{a}");
            assert_eq!(a["class_uid"], 2006, "{a}");
            let srcs = a["unmapped"]["sources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x["request_id"].as_u64().unwrap())
                .collect();
            (a["unmapped"]["request_id"].as_u64().unwrap(), srcs)
        })
        .collect();
    guard.sort();
    let id = |r: &str| f[r]["request_id"].as_u64().unwrap();
    let (a, b) = (id("A"), id("B"));
    let mut want = vec![(id("C"), vec![a.min(b), a.max(b)]), (id("D"), vec![a])];
    want.sort();
    assert_eq!(guard, want, "{lines:?}");
    // The aborted requests read nothing the hook recorded past the check:
    // live detection still gives what a fresh scope gives.
    let v = kvtrail(["verify", s(&out)]).run();
    assert!(
        v.stdout.contains("live findings equal a fresh scope"),
        "{}\n{}",
        v.stdout,
        v.stderr
    );
}

#[test]
fn guard_alerts_on_sglang_seed_path_and_lets_it_run() {
    let (Some(py), Some(native)) = (venv::SGLANG.python(), native()) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("absent.sock");
    // Default mode: alert.
    let o = driver(
        &py,
        "sglang",
        "guard_driver.py",
        &[s(&sock)],
        Some(&native),
        &[],
    );
    let f = facts_of(&o, "guard_driver.py");
    for r in ["A", "B", "C", "D"] {
        assert_eq!(f[r]["finished_reason"], "FINISH_LENGTH", "{r}: {f}");
    }
    let g = &f["guard"];
    assert_eq!(g["mode"], "alert");
    assert_eq!((&g["alerts"], &g["aborts"]), (&2.into(), &0.into()), "{g}");
    let alerts = f["alerts"].as_array().unwrap();
    assert_eq!(alerts[0]["request"], "C");
    assert_eq!(alerts[0]["action"], "alert");
    assert_eq!(alerts[0]["verdict"], "foreign");
    // The read C's facts count as not written by it, less the slots never
    // written at all (blank: no one's content).
    let foreign = alerts[0]["slots_foreign"].as_u64().unwrap();
    let not_own = f["C"]["decode_slots_read_not_written_by_it"]
        .as_u64()
        .unwrap();
    assert!(foreign > 0 && foreign <= not_own, "{foreign} {not_own}");
}

#[test]
fn guard_abort_without_the_native_module_refuses_to_start() {
    let Some(py) = venv::SGLANG.python() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("absent.sock");
    let args = [s(&sock)];
    let o = driver(
        &py,
        "sglang",
        "guard_driver.py",
        &args,
        None,
        &[("KVTRAIL_GUARD", "abort")],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("GuardUnavailable"), "{err}");
    assert!(err.contains("refusing to run unguarded"), "{err}");
    // alert: one warning, and the engine runs.
    let o = driver(&py, "sglang", "guard_driver.py", &args, None, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("running unguarded").count(), 1, "{err}");
}

/// The stderr of `kvtrail_vllm.install(guard=mode)` after `prelude`, which
/// must fail, with `native` on the path or not.
fn vllm_install_refused(py: &Path, native: Option<&Path>, prelude: &str, mode: &str) -> String {
    let mut path = vec![
        root().join("hooks/vllm/src"),
        root().join("hooks/client/src"),
    ];
    path.extend(native.map(Path::to_path_buf));
    let o = Command::new(py)
        .arg("-c")
        .arg(format!(
            "{prelude}\nimport kvtrail_vllm; kvtrail_vllm.install(capture='unix:/nonexistent', guard='{mode}')"
        ))
        .env("PYTHONPATH", std::env::join_paths(path).unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{mode}: {err}");
    err
}

/// The vLLM hook builds its steps' events in the native module: without
/// it, `install()` raises (whatever the guard's mode), naming the module,
/// and warns nothing about running unguarded first.
#[test]
fn vllm_hook_without_the_native_module_refuses_to_install() {
    let Some(py) = venv::VLLM.python() else {
        return;
    };
    for mode in ["off", "alert", "abort"] {
        let err = vllm_install_refused(&py, None, "", mode);
        assert!(
            err.contains("ImportError") && err.contains("kvtrail_guard"),
            "{mode}: {err}"
        );
        assert!(!err.contains("running unguarded"), "{mode}: {err}");
    }
}

/// A native module that numbers the queue's items otherwise than the
/// hooks is refused as one that cannot be loaded: the vLLM hook's install
/// raises ImportError naming the difference, whatever the guard's mode.
#[test]
fn vllm_hook_refuses_a_native_module_that_misnumbers_the_items() {
    let (Some(py), Some(native)) = (venv::VLLM.python(), native()) else {
        return;
    };
    let prelude = "import kvtrail_guard as g; g.KINDS = dict(g.KINDS, KV=9)";
    for mode in ["off", "alert", "abort"] {
        let err = vllm_install_refused(&py, Some(&native), prelude, mode);
        assert!(
            err.contains("ImportError") && err.contains("KV is 9 there, 0 here"),
            "{mode}: {err}"
        );
    }
}

#[test]
fn guard_says_unknown_where_it_cannot_see() {
    let (Some(py), Some(native)) = (venv::SGLANG.python(), native()) else {
        return;
    };
    let o = driver(&py, "sglang", "guard_unknown.py", &[], Some(&native), &[]);
    let f = facts_of(&o, "guard_unknown.py");
    // Allowed by default; an abort only under abort + abort.
    assert_eq!(f["alert/allow"]["x"], Value::Null);
    assert_eq!(f["abort/allow"]["x"], Value::Null);
    let x = f["abort/abort"]["x"].as_str().unwrap();
    assert!(x.contains("owner this node cannot see"), "{x}");
    assert_eq!(f["alert/abort"]["x"], Value::Null);
    assert_eq!(f["alert/abort"]["alerts"][0]["verdict"], "unknown");
    for k in ["alert/allow", "abort/allow", "abort/abort", "alert/abort"] {
        let st = &f[k]["stats"];
        assert_eq!(
            (&st["unknown"], &st["foreign"]),
            (&1.into(), &1.into()),
            "{k}"
        );
        assert_eq!(st["native_copies_remote"], 1, "{k}");
    }
    // Content received for X, read by Y: foreign, with X as the source.
    let y = f["abort/allow"]["y"].as_str().unwrap();
    assert!(y.contains("request ids 11"), "{y}");
    // A hole: the own write before it is no longer vouched for.
    assert_eq!(f["hole"]["before"], Value::Null);
    assert_eq!(f["hole"]["after"][0], "unknown");
    // Slots 0 and 2^32 - 2: two pages of 4096 slots, a few MiB at most
    // (the page table up to the top page is 8 MiB of pointers, mostly
    // untouched), and the far read is still foreign with its source.
    assert_eq!(f["far"]["slots_allocated"], 2 * 4096, "{}", f["far"]);
    assert_eq!(f["far"]["check"][0], "foreign", "{}", f["far"]);
    assert_eq!(f["far"]["check"][1], serde_json::json!([31]));
    assert!(
        f["far"]["rss_growth_kib"].as_u64().unwrap() < 64 * 1024,
        "{}",
        f["far"]
    );
    // Pushed items: applied in order before the check; the bad ones
    // counted (2), the one of pool 5 a hole there.
    let p = &f["push"];
    assert_eq!(
        p["check"],
        serde_json::json!(["foreign", [42], 1, 1, 2]),
        "{p}"
    );
    assert_eq!(
        (&p["errors"], &p["holes"], &p["events"]),
        (&2.into(), &1.into(), &3.into()),
        "{p}"
    );
    let bad = f["bad_settings"].as_array().unwrap();
    assert!(bad[0].as_str().unwrap().contains("KVTRAIL_GUARD="));
    assert!(bad[1].as_str().unwrap().contains("KVTRAIL_GUARD_UNKNOWN="));
}

#[test]
fn guard_aborts_vllm_stale_reference_as_an_error() {
    let (Some(py), Some(native)) = (venv::VLLM.python(), native()) else {
        return;
    };
    let (f, rows) = with_sidecar(
        &py,
        "vllm",
        "record_driver.py",
        Some("stale"),
        "deploy-vllm-cpu.json",
        &native,
        &[("KVTRAIL_GUARD", "abort")],
    );
    assert_eq!(f["r3"]["finish"], "error", "{f}");
    assert_eq!(f["r1"]["finish"], "length");
    assert_eq!(rows["r3"], (500, Some("error".into())));
    let g = &f["guard"];
    assert_eq!((&g["foreign"], &g["aborts"]), (&1.into(), &1.into()), "{g}");
    let a = &f["alerts"][0];
    assert_eq!(a["request"], "r3");
    assert_eq!(sources(a).len(), 1, "{a}");
    assert_ne!(sources(a)[0], a["request_id"].as_u64().unwrap());

    // alert: the same finding, and r3 completes.
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("absent.sock");
    let o = driver(
        &py,
        "vllm",
        "record_driver.py",
        &[s(&sock), "stale"],
        Some(&native),
        &[("KVTRAIL_GUARD", "alert")],
    );
    let f2 = facts_of(&o, "record_driver.py stale");
    assert_eq!(f2["r3"]["finish"], "length");
    assert_eq!(f2["alerts"][0]["action"], "alert");
    assert_eq!(f2["alerts"][0]["sources"], a["sources"]);
}

/// The vLLM hook's native step (tests/vllm/native_step.py, no vLLM
/// needed): its lines byte-identical to the shared client's writer for the
/// same events, its runs, holes for unreadable requests, and the guard's
/// checks in the stream's order.
#[test]
fn native_step_lines_match_the_client_and_checks_follow_the_stream() {
    let (Some(py), Some(native)) = (venv::VLLM.python(), native()) else {
        return;
    };
    let o = Command::new(py)
        .arg(root().join("tests/vllm/native_step.py"))
        .env(
            "PYTHONPATH",
            std::env::join_paths([native, root().join("hooks/client/src")]).unwrap(),
        )
        .output()
        .unwrap();
    let f = facts_of(&o, "native_step.py");
    assert_eq!(f["failures"], serde_json::json!([]), "{f}");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The SGLang hook's decode step built natively
/// (tests/sglang/native_decode.py, no SGLang needed): its one queued item
/// of lines byte-identical to the per-event path's lines, the guard fed
/// the same, and holes for unreadable requests.
#[test]
fn sglang_native_decode_lines_match_the_per_event_path() {
    let (Some(py), Some(native)) = (venv::SGLANG.python(), native()) else {
        return;
    };
    let o = Command::new(py)
        .arg(root().join("tests/sglang/native_decode.py"))
        .env(
            "PYTHONPATH",
            std::env::join_paths([
                root().join("hooks/sglang/src"),
                root().join("hooks/client/src"),
                native,
            ])
            .unwrap(),
        )
        .output()
        .unwrap();
    let f = facts_of(&o, "native_decode.py");
    assert_eq!(f["failures"], serde_json::json!([]), "{f}");
    assert_eq!(f["lines"], 12, "{f}");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn guard_vllm_clean_runs_never_trip_and_stale_loads_do() {
    let (Some(py), Some(native)) = (venv::VLLM.python(), native()) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("absent.sock");
    let run = |mode: &str| {
        let o = driver(
            &py,
            "vllm",
            "record_driver.py",
            &[s(&sock), mode],
            Some(&native),
            &[
                ("KVTRAIL_GUARD", "abort"),
                ("KVTRAIL_GUARD_UNKNOWN", "abort"),
            ],
        );
        facts_of(&o, mode)
    };
    // P/D loads, a prefix-cache hit with the same salt, CPU offload and
    // its load back, and P/D loads from a producer of another block size
    // (8-token blocks into 16-token decode blocks: the guard places each
    // side's blocks with its own engine's size): checked, and never
    // foreign or unknown.
    for mode in ["clean", "offload", "hetero"] {
        let f = run(mode);
        let g = &f["guard"];
        assert!(g["checks"].as_u64().unwrap() >= 3, "{mode}: {g}");
        assert_eq!(g["checks"], g["ok"], "{mode}: {g}");
        assert_eq!(
            (&g["aborts"], &g["errors"]),
            (&0.into(), &0.into()),
            "{mode}"
        );
        assert!(!f.to_string().contains("\"error\""), "{mode}: {f}");
    }
    // The hybrid model's stale reference, the stale reference with
    // heterogeneous block sizes, and the stale offload load.
    for mode in ["hybrid", "hetero-stale"] {
        let f = run(mode);
        assert_eq!(f["r3"]["finish"], "error", "{mode}: {f}");
        assert_eq!(f["r1"]["finish"], "length", "{mode}");
        assert_eq!(f["guard"]["aborts"], 1, "{mode}: {f}");
    }
    let f = run("offload-stale");
    assert_eq!(f["finish"]["a2"], "error", "{f}");
    assert_eq!(f["finish"]["a"], "length");
    assert_eq!(f["guard"]["aborts"], 1);
}

/// tests/vllm/lmcache_driver.py in `mode` (the real lmcache 0.5.6 on CPU)
/// with the guard in abort mode, in a fresh working directory (lmcache's
/// lookup socket and the process-group file live there), no sidecar.
fn lmcache_run(py: &Path, native: &Path, mode: &str) -> Value {
    let d = tempfile::tempdir().unwrap();
    let path = [
        native.to_path_buf(),
        root().join("hooks/vllm/src"),
        root().join("hooks/client/src"),
    ];
    let o = Command::new(py)
        .arg("-W")
        .arg("ignore")
        .arg(root().join("tests/vllm/lmcache_driver.py"))
        .arg(d.path().join("absent.sock"))
        .arg(mode)
        .env("PYTHONPATH", std::env::join_paths(path).unwrap())
        .env("HF_HUB_OFFLINE", "1")
        .env("KVTRAIL_GUARD", "abort")
        .env("KVTRAIL_GUARD_UNKNOWN", "abort")
        .current_dir(d.path())
        .output()
        .unwrap();
    facts_of(&o, mode)
}

/// The guard over LMCache loads (real lmcache package, recorded as copies
/// through the cache pool): the request's check waits for lmcache's load
/// (run after schedule, in start_load_kv). A clean hit (a2, tenant-a,
/// loading a's chunks) is checked and passes; the planted stale chunk
/// (a's keys naming f's memory objects) is foreign and a2 ends with an
/// error, its output of that step dropped.
#[test]
fn guard_lmcache_clean_hit_runs_and_stale_chunk_aborts() {
    let (Some(py), Some(native)) = (venv::VLLM.python(), native()) else {
        return;
    };
    if !crate::record_vllm::lmcache_ready() {
        return;
    }
    let f = lmcache_run(&py, &native, "hit");
    let g = &f["guard"];
    assert!(g["checks"].as_u64().unwrap() >= 1, "{g}");
    assert_eq!(g["checks"], g["ok"], "{g}");
    assert_eq!((&g["aborts"], &g["errors"]), (&0.into(), &0.into()), "{g}");
    assert_eq!(f["finish"]["a2"], "length", "{f}");
    assert_eq!(f["bytes"]["a2"]["sources"], serde_json::json!(["a"]), "{f}");
    let f = lmcache_run(&py, &native, "stale");
    assert_eq!(f["bytes"]["a2"]["sources"], serde_json::json!(["f"]), "{f}");
    assert_eq!(f["finish"]["a2"], "error", "{f}");
    assert_eq!(f["finish"]["a"], "length", "{f}");
    assert_eq!(f["guard"]["aborts"], 1, "{f}");
}
