//! notebooks/ executed headless, as a responder would run them, on traces
//! made here with the built binary:
//!
//! - a simulated incident (`simulate --scenario incident`, fewer requests),
//!   its `scope --out` folder; notebook 03 calls the binary itself for the
//!   what-if replay, diff and scopes;
//! - a trace of another shape and writer: the sibling-stale-copy scenario
//!   rewritten with pyarrow (tests/notebooks/rewrite_trace.py: many part
//!   files in nested Hive folders, four codecs, 64-bit and dictionary
//!   columns, absent nullable columns, extra columns, no `files` list),
//!   with a what-if folder made beforehand (`replay`, `scope`, `diff`), run
//!   from the repository root rather than the notebooks' folder;
//! - the README tour's trace (`ingest` of tests/data/jsonl: 3 requests, a
//!   lost decode event, so the finding is only possible);
//! - the built-in traces/incident-mini with the notebooks' defaults.
//!
//! Each notebook's cells assert their numbers against the kvtrail outputs
//! they read (summary.json, findings.parquet, diff.json), so a change in
//! those files fails here, not only an exception. Executed copies go to a
//! temporary folder, never back into notebooks/.
//!
//! The Python side comes from the venv built by .ci/setup.d/60-notebooks.sh
//! (`${KVTRAIL_NOTEBOOK_VENV:-${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-notebooks}`).
//! Without it the executing tests FAIL when `CI` is set, and say they skip
//! otherwise. The check that notebooks are committed without outputs needs
//! no venv.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::support::cli::{bin, kvtrail, s};
use crate::support::files;
use crate::support::venv;

const NOTEBOOKS: [&str; 3] = [
    "01-trace-tour.ipynb",
    "02-exposure.ipynb",
    "03-what-if.ipynb",
];

/// Seconds any one cell may run.
const CELL_TIMEOUT_S: &str = "180";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs a command; panics with its output unless its exit code is in `ok`.
fn run(cmd: &mut Command, ok: &[i32]) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let code = out.status.code().unwrap_or(-1);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        ok.contains(&code),
        "{cmd:?} exited {code}\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A what-if folder as notebook 03 reads it: after/, scope-before/,
/// scope-after/, diff.json.
fn whatif_folder(trace: &Path, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let after = dir.join("after");
    kvtrail([
        "replay",
        s(trace),
        "--engine",
        "sglang-0.5.22",
        "--out",
        s(&after),
    ])
    .expect(&[0])
    .run();
    kvtrail(["scope", s(trace), "--out", s(&dir.join("scope-before"))])
        .expect(&[0])
        .run();
    kvtrail(["scope", s(&after), "--out", s(&dir.join("scope-after"))])
        .expect(&[0])
        .run();
    let diff = kvtrail(["diff", s(trace), s(&after), "--json"])
        .expect(&[0])
        .run()
        .stdout;
    std::fs::write(dir.join("diff.json"), diff).unwrap();
}

/// Executes every notebook with `env` (KVTRAIL_* parameters) and checks
/// that each executed copy rendered its plots. Any failing cell (error or failed assert) fails the test
/// with the cell's source and traceback.
fn execute(py: &Path, out: &Path, label: &str, cwd: Option<&Path>, env: &[(&str, PathBuf)]) {
    let nb_dir = repo().join("notebooks");
    let mut cmd = Command::new(py);
    cmd.arg(repo().join("tests/notebooks/run.py")).args([
        "--out",
        s(out),
        "--label",
        label,
        "--timeout",
        CELL_TIMEOUT_S,
    ]);
    if let Some(c) = cwd {
        cmd.args(["--cwd", s(c)]);
    }
    cmd.args(NOTEBOOKS.iter().map(|n| nb_dir.join(n)));
    for k in [
        "KVTRAIL_TRACE",
        "KVTRAIL_SCOPE",
        "KVTRAIL_WHATIF",
        "KVTRAIL_RESPONSE",
        "KVTRAIL_ENGINE",
        "KVTRAIL_SET",
        "KVTRAIL_NOTEBOOK_DIR",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let report = run(&mut cmd, &[0]);
    eprint!("{report}");
    for n in NOTEBOOKS {
        let stem = n.trim_end_matches(".ipynb");
        let copy = out.join(format!("{label}-{stem}.ipynb"));
        let nb: Value = serde_json::from_str(&std::fs::read_to_string(&copy).unwrap()).unwrap();
        let images = code_cells(&nb)
            .flat_map(|c| c["outputs"].as_array().cloned().unwrap_or_default())
            .filter(|o| o["data"]["image/png"].is_string())
            .count();
        assert!(
            images >= 3,
            "{}: only {images} plots rendered",
            copy.display()
        );
    }
}

fn code_cells(nb: &Value) -> impl Iterator<Item = &Value> {
    nb["cells"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["cell_type"] == "code")
}

fn source(cell: &Value) -> String {
    match &cell["source"] {
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().filter_map(|l| l.as_str()).collect(),
        _ => String::new(),
    }
}

#[test]
fn notebooks_are_committed_without_outputs_and_with_parameters_first() {
    let dir = repo().join("notebooks");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ipynb"))
        .collect();
    found.sort();
    assert_eq!(
        found, NOTEBOOKS,
        "notebooks/ holds exactly the notebooks this test runs"
    );
    for n in NOTEBOOKS {
        let p = dir.join(n);
        let nb: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
            .unwrap_or_else(|e| panic!("{}: not JSON: {e}", p.display()));
        assert_eq!(nb["nbformat"], 4, "{n}: nbformat 4");
        assert_eq!(nb["metadata"]["kernelspec"]["name"], "python3", "{n}");
        for (i, c) in code_cells(&nb).enumerate() {
            assert_eq!(
                c["outputs"],
                Value::Array(vec![]),
                "{n}: code cell {i} has outputs: clear them before committing"
            );
            assert!(
                c["execution_count"].is_null(),
                "{n}: code cell {i} has an execution_count: clear outputs before committing"
            );
        }
        let first = &nb["cells"][0];
        assert_eq!(
            first["cell_type"], "code",
            "{n}: the first cell holds the parameters"
        );
        let src = source(first);
        assert!(
            src.contains("KVTRAIL_TRACE") && src.contains("os.environ.get("),
            "{n}: parameters in the first cell, overridable by environment variables"
        );
        assert!(
            nb["cells"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["cell_type"] == "markdown"),
            "{n}: explains its plots in markdown"
        );
    }
}

#[test]
fn notebooks_run_on_a_simulated_incident() {
    let Some(py) = venv::NOTEBOOKS.python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("incident");
    kvtrail([
        "simulate",
        "--scenario",
        "incident",
        "--requests",
        "600",
        "--out",
        s(&trace),
    ])
    .expect(&[0])
    .run();
    let scope = tmp.path().join("scope");
    let txt = kvtrail(["scope", s(&trace), "--out", s(&scope)])
        .expect(&[0])
        .run()
        .stdout;
    assert!(txt.contains("VERDICT: 6 responses affected"), "{txt}");
    let work = tmp.path().join("work");
    execute(
        &py,
        &tmp.path().join("executed"),
        "incident",
        None,
        &[
            ("KVTRAIL_TRACE", trace.clone()),
            ("KVTRAIL_SCOPE", scope.clone()),
            ("KVTRAIL_BIN", PathBuf::from(bin())),
            ("KVTRAIL_WORKDIR", work.clone()),
        ],
    );
    // Notebook 03 made its what-if folder with the binary, in WORKDIR.
    let diff: Value = serde_json::from_str(
        &std::fs::read_to_string(work.join("whatif-incident-sglang-0.5.22/diff.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(diff["exposure"]["before"]["affected_responses"], 6);
    assert_eq!(diff["exposure"]["after"]["affected_responses"], 0);
    // Nothing was written next to the notebooks.
    let stray: Vec<_> = std::fs::read_dir(repo().join("notebooks"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ipynb") && !NOTEBOOKS.contains(&n.as_str()))
        .collect();
    assert!(stray.is_empty(), "executed copies in notebooks/: {stray:?}");
}

#[test]
fn notebooks_run_on_a_trace_from_another_writer() {
    let Some(py) = venv::NOTEBOOKS.python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let sim = tmp.path().join("sim");
    kvtrail([
        "simulate",
        "--scenario",
        "sibling-stale-copy",
        "--requests",
        "400",
        "--out",
        s(&sim),
    ])
    .expect(&[0])
    .run();
    let trace = tmp.path().join("other-writer");
    run(
        Command::new(&py)
            .arg(repo().join("tests/notebooks/rewrite_trace.py"))
            .args([s(&sim), s(&trace)]),
        &[0],
    );
    let kv_parts = files::paths(&trace.join("kv"))
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .count();
    assert!(kv_parts >= 8, "{kv_parts} kv part files");
    let scope = tmp.path().join("scope");
    let txt = kvtrail(["scope", s(&trace), "--out", s(&scope)])
        .expect(&[0])
        .run()
        .stdout;
    assert!(
        txt.contains("evidence is INCOMPLETE"),
        "no files list: {txt}"
    );
    let whatif = tmp.path().join("whatif");
    whatif_folder(&trace, &whatif);
    execute(
        &py,
        &tmp.path().join("executed"),
        "other-writer",
        Some(&repo()),
        &[
            ("KVTRAIL_TRACE", trace.clone()),
            ("KVTRAIL_SCOPE", scope.clone()),
            ("KVTRAIL_WHATIF", whatif.clone()),
            // A pre-made what-if folder needs no binary.
            ("KVTRAIL_BIN", tmp.path().join("no-such-kvtrail")),
            ("KVTRAIL_WORKDIR", tmp.path().join("work")),
        ],
    );
}

#[test]
fn notebooks_run_on_the_ingested_tour_trace_with_lost_events() {
    let Some(py) = venv::NOTEBOOKS.python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("tour");
    let data = repo().join("tests/data/jsonl");
    kvtrail([
        "ingest",
        s(&data.join("incident.jsonl")),
        "--deployment",
        s(&data.join("deploy.json")),
        "--out",
        s(&trace),
    ])
    .expect(&[0])
    .run();
    execute(
        &py,
        &tmp.path().join("executed"),
        "tour",
        None,
        &[
            ("KVTRAIL_TRACE", trace.clone()),
            ("KVTRAIL_BIN", PathBuf::from(bin())),
            ("KVTRAIL_WORKDIR", tmp.path().join("work")),
        ],
    );
    // The seq hole made the finding possible, and notebook 02 saw the same scope.
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("work/scope-tour/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["counts"]["possible_responses"], 1);
    assert_eq!(summary["coverage"]["lost_events"], 1);
}

#[test]
fn notebooks_run_with_their_defaults_on_the_built_in_trace() {
    let Some(py) = venv::NOTEBOOKS.python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    execute(
        &py,
        &tmp.path().join("executed"),
        "defaults",
        None,
        &[
            ("KVTRAIL_BIN", PathBuf::from(bin())),
            ("KVTRAIL_WORKDIR", tmp.path().join("work")),
        ],
    );
    assert!(
        tmp.path()
            .join("work/scope-incident-mini/summary.json")
            .is_file()
    );
}
