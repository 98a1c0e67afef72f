//! Finding the cached Python virtualenvs the .ci/setup.d scripts build
//! (SGLang on CPU, the SQL engines, the notebooks), for the tests that
//! drive Python.
//!
//! A venv lives at `$<override var>`, else
//! `${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/<name>`. When it is missing (or
//! its python cannot import what the tests need), the tests FAIL when `CI`
//! is set and print a SKIP line otherwise: a set-up that did not run is
//! never a silent pass in CI.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// One cached venv.
pub struct Venv {
    /// Folder name under the cache.
    pub name: &'static str,
    /// Environment variable that overrides the whole path.
    pub env: &'static str,
    /// Set-up script(s) that build it, for the message.
    pub setup: &'static str,
    /// Modules its python must import (`None`: only the interpreter).
    pub imports: Option<&'static str>,
}

impl Venv {
    fn dir(&self) -> PathBuf {
        std::env::var_os(self.env)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let cache = std::env::var_os("KVTRAIL_CACHE")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| {
                        PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                            .join(".cache/kvtrail")
                    });
                cache.join(self.name)
            })
    }

    /// The venv's python, or `None` (after a SKIP line) outside CI.
    pub fn python(&self) -> Option<PathBuf> {
        let venv = self.dir();
        let py = venv.join("bin/python");
        // The import check starts a python (seconds with torch): once per
        // venv per run of the tests.
        static CHECKED: Mutex<Vec<(PathBuf, bool)>> = Mutex::new(Vec::new());
        let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
        let ok = match checked.iter().find(|(p, _)| *p == py) {
            Some((_, ok)) => *ok,
            None => {
                let ok = py.is_file()
                    && self.imports.is_none_or(|m| {
                        Command::new(&py)
                            .args(["-c", &format!("import {m}")])
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .status()
                            .is_ok_and(|s| s.success())
                    });
                checked.push((py.clone(), ok));
                ok
            }
        };
        drop(checked);
        if ok {
            return Some(py);
        }
        let msg = format!(
            "the {} venv is missing or incomplete at {}: run {}",
            self.name,
            venv.display(),
            self.setup
        );
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but {msg}");
        }
        eprintln!("SKIP: {msg}");
        None
    }
}

pub const SGLANG: Venv = Venv {
    name: "venv-sglang-0.5.19",
    env: "KVTRAIL_SGLANG_VENV",
    setup: ".ci/setup.d/30-sglang.sh and .ci/setup.d/31-kvtrail-sglang-hook.sh",
    imports: Some("blake3, sglang, torch"),
};

pub const VLLM: Venv = Venv {
    name: "venv-vllm-0.33.0",
    env: "KVTRAIL_VLLM_VENV",
    setup: ".ci/setup.d/32-vllm.sh and .ci/setup.d/33-kvtrail-vllm-hook.sh",
    imports: Some("blake3, vllm, torch"),
};

pub const SQL: Venv = Venv {
    name: "venv-sql",
    env: "KVTRAIL_SQL_VENV",
    setup: ".ci/setup.d/50-sql.sh",
    imports: None,
};

pub const NOTEBOOKS: Venv = Venv {
    name: "venv-notebooks",
    env: "KVTRAIL_NOTEBOOK_VENV",
    setup: ".ci/setup.d/60-notebooks.sh",
    imports: None,
};

pub const EXPORT: Venv = Venv {
    name: "venv-export",
    env: "KVTRAIL_EXPORT_VENV",
    setup: ".ci/setup.d/55-export-validators.sh",
    imports: Some("ocsf_json_schema, jsonschema, timesketch.lib.utils"),
};

impl Venv {
    /// The venv's python; a missing or incomplete venv FAILS the test
    /// (CI or not), naming the set-up script.
    pub fn required(&self) -> PathBuf {
        // `python` prints a SKIP line and returns None outside CI; here
        // that is a failure too.
        self.python().unwrap_or_else(|| {
            panic!(
                "the {} venv is missing or incomplete at {}: run {}",
                self.name,
                self.dir().display(),
                self.setup
            )
        })
    }
}

pub const MOTO: Venv = Venv {
    name: "venv-moto",
    env: "KVTRAIL_MOTO_VENV",
    setup: ".ci/setup.d/56-moto.sh",
    imports: Some("moto.server, boto3"),
};

/// Where .ci/setup.d/34-kvtrail-guard.sh installs the hooks' native module
/// `kvtrail_guard`.
fn native_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/kvtrail-guard-native")
}

/// The folder holding the native module, or None (after a SKIP line)
/// outside CI; with `CI` set a missing module FAILS the test.
pub fn native() -> Option<PathBuf> {
    let dir = native_dir();
    if dir.join("kvtrail_guard").is_dir() {
        return Some(dir);
    }
    let msg = format!(
        "the hooks' native module is missing at {}: run .ci/setup.d/34-kvtrail-guard.sh",
        dir.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("CI is set but {msg}");
    }
    eprintln!("SKIP: {msg}");
    None
}

/// The PYTHONPATH a hook under test runs with: its source folder, the
/// shared client, and the native module (the vLLM hook builds its per-step
/// events with it and will not install without it; a missing one fails
/// under `CI`, else the driver says so).
pub fn hook_pythonpath(hook: &str) -> std::ffi::OsString {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let native = native().unwrap_or_else(native_dir);
    std::env::join_paths([root.join(hook), root.join("hooks/client/src"), native]).unwrap()
}
