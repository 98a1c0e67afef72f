//! Tidy: the house rules of the source tree, checked by walking the
//! repository (as rust-analyzer's tidy test). One `#[test]` per rule on the
//! real tree, and one per rule on a small planted tree that breaks it, so a
//! check that stops finding anything fails too.
//!
//! Each rule is a `check_*(root) -> Vec<String>` of violations, each naming
//! the file, the line and what to do.

use std::fs;
use std::path::{Path, PathBuf};

pub(crate) fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Folders never walked: build outputs, VCS data and Python environments.
fn skipped_dir(name: &str) -> bool {
    matches!(
        name,
        "target" | ".git" | "node_modules" | "__pycache__" | "build" | "dist"
    ) || name.starts_with(".venv")
        || name.starts_with("venv")
        || name.ends_with(".egg-info")
        || name == ".pytest_cache"
}

/// Every file under `dir` (recursively, sorted), skipping `skipped_dir`s.
pub(crate) fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return out;
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            if !skipped_dir(&e.file_name().to_string_lossy()) {
                out.extend(walk(&path));
            }
        } else if ft.is_file() {
            out.push(path);
        }
    }
    out
}

/// `path` relative to `root`, with `/` separators.
pub(crate) fn rel(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

pub(crate) fn rust_files(root: &Path, under: &str) -> Vec<PathBuf> {
    walk(&root.join(under))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

pub(crate) fn read(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok()
}

pub(crate) fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Byte offsets of `needle` in `hay` that do not follow an identifier
/// character (so `print!` does not match inside `eprint!`).
pub(crate) fn word_starts(hay: &str, needle: &str) -> Vec<usize> {
    hay.match_indices(needle)
        .map(|(i, _)| i)
        .filter(|&i| !hay[..i].chars().next_back().is_some_and(is_ident))
        .collect()
}

/// The lines of a Rust file with comments removed and string and char
/// literals emptied (`"..."` becomes `""`), so checks see only code paths.
/// Line numbers are kept (one output line per input line).
pub(crate) fn code_lines(text: &str) -> Vec<String> {
    #[derive(Clone, Copy, PartialEq)]
    enum St {
        Code,
        Block(u32),
        Str,
        Raw(usize),
    }
    let mut st = St::Code;
    let mut out = Vec::new();
    for line in text.lines() {
        let chars: Vec<char> = line.chars().collect();
        let mut code = String::new();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            match st {
                St::Block(depth) => {
                    if c == '*' && next == Some('/') {
                        st = if depth == 1 {
                            St::Code
                        } else {
                            St::Block(depth - 1)
                        };
                        i += 2;
                    } else if c == '/' && next == Some('*') {
                        st = St::Block(depth + 1);
                        i += 2;
                    } else {
                        i += 1;
                    }
                }
                St::Str => {
                    if c == '\\' {
                        i += 2;
                    } else {
                        if c == '"' {
                            code.push('"');
                            st = St::Code;
                        }
                        i += 1;
                    }
                }
                St::Raw(hashes) => {
                    if c == '"'
                        && chars[i + 1..]
                            .iter()
                            .take(hashes)
                            .filter(|&&h| h == '#')
                            .count()
                            == hashes
                    {
                        code.push('"');
                        st = St::Code;
                        i += 1 + hashes;
                    } else {
                        i += 1;
                    }
                }
                St::Code => {
                    if c == '/' && next == Some('/') {
                        break;
                    } else if c == '/' && next == Some('*') {
                        st = St::Block(1);
                        i += 2;
                    } else if c == '"' {
                        code.push('"');
                        st = St::Str;
                        i += 1;
                    } else if c == 'r'
                        && !code.chars().next_back().is_some_and(is_ident)
                        && matches!(next, Some('"') | Some('#'))
                    {
                        let mut j = i + 1;
                        while chars.get(j) == Some(&'#') {
                            j += 1;
                        }
                        if chars.get(j) == Some(&'"') {
                            code.push('"');
                            st = St::Raw(j - i - 1);
                            i = j + 1;
                        } else {
                            code.push(c);
                            i += 1;
                        }
                    } else if c == '\'' {
                        // A char literal ('x', '\n', '\u{..}') or a lifetime.
                        if next == Some('\\') {
                            let mut j = i + 2;
                            while j < chars.len() && chars[j] != '\'' {
                                j += 1;
                            }
                            code.push_str("' '");
                            i = j + 1;
                        } else if chars.get(i + 2) == Some(&'\'') {
                            code.push_str("' '");
                            i += 3;
                        } else {
                            code.push(c);
                            i += 1;
                        }
                    } else {
                        code.push(c);
                        i += 1;
                    }
                }
            }
        }
        out.push(code);
    }
    out
}

/// The code lines of a Rust file up to its first `#[cfg(test)]` line.
pub(crate) fn code_lines_before_tests(text: &str) -> Vec<String> {
    let stop = text
        .lines()
        .position(|l| l.trim_start().starts_with("#[cfg(test)]"))
        .unwrap_or(usize::MAX);
    code_lines(text).into_iter().take(stop).collect()
}

// ---------------------------------------------------------------------------
// The rules.

/// a. Every `.rs` file under src/ starts with a `//!` module doc.
fn check_module_docs(root: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for path in rust_files(root, "src") {
        let Some(text) = read(&path) else { continue };
        if !text.starts_with("//!") {
            v.push(format!(
                "{}:1: does not start with a `//!` module doc; add one saying what the file holds",
                rel(root, &path)
            ));
        }
    }
    v
}

/// b. Only the CLI prints: no print macros, `dbg!` or stdout/stderr handles
/// in src/ outside src/cli/ and src/main.rs.
fn check_no_print(root: &Path) -> Vec<String> {
    const MACROS: [&str; 5] = ["println!", "eprintln!", "print!", "eprint!", "dbg!"];
    const HANDLES: [&str; 4] = ["io::stdout", "io::stderr", "stdout()", "stderr()"];
    let mut v = Vec::new();
    for path in rust_files(root, "src") {
        let r = rel(root, &path);
        if r.starts_with("src/cli/") || r == "src/main.rs" {
            continue;
        }
        let Some(text) = read(&path) else { continue };
        for (n, line) in code_lines_before_tests(&text).iter().enumerate() {
            for pat in MACROS.iter().chain(HANDLES.iter()) {
                if !word_starts(line, pat).is_empty() {
                    v.push(format!(
                        "{r}:{}: `{pat}` outside src/cli: only the CLI prints; return the data \
                         (or report through `progress::Reporter` / a log callback) and print it in src/cli",
                        n + 1
                    ));
                }
            }
        }
    }
    v
}

/// c. Only src/trace/ names the parquet crate in code.
fn check_parquet_in_trace(root: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for path in rust_files(root, "src") {
        let r = rel(root, &path);
        if r.starts_with("src/trace/") {
            continue;
        }
        let Some(text) = read(&path) else { continue };
        for (n, line) in code_lines(&text).iter().enumerate() {
            let named = !word_starts(line, "parquet::").is_empty()
                || line.trim_start().starts_with("use parquet")
                || line.contains("crate parquet");
            if named {
                v.push(format!(
                    "{r}:{}: names the parquet crate outside src/trace: only trace knows Parquet; \
                     add or use a helper in src/trace (e.g. trace::write) instead",
                    n + 1
                ));
            }
        }
    }
    v
}

/// True when `text` names `needle` as a whole path: not preceded by a path
/// character (unless by `src/`) and, when `folder`, not followed by one.
fn names_path(text: &str, needle: &str, folder: bool) -> bool {
    text.match_indices(needle).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let start_ok = !before.is_some_and(|c| is_ident(c) || matches!(c, '/' | '.' | '-'))
            || text[..i].ends_with("src/");
        let after = text[i + needle.len()..].chars().next();
        let end_ok = if folder {
            !after.is_some_and(|c| is_ident(c) || matches!(c, '.' | '-' | '*' | '{'))
        } else {
            !after.is_some_and(is_ident)
        };
        start_ok && end_ok
    })
}

/// d. ARCHITECTURE.md names every module: each file at the top of src/
/// (by its path from src/ or from the root) and each folder (`lineage/`,
/// `lineage/gpu/`; its `mod.rs` is reported). Files inside a folder are
/// described by their own `//!` docs (rule a), not in the map.
fn check_architecture_names_files(root: &Path) -> Vec<String> {
    let arch = read(&root.join("ARCHITECTURE.md")).unwrap_or_default();
    let mut v = Vec::new();
    let mut folders = std::collections::BTreeSet::new();
    for path in walk(&root.join("src")) {
        let from_src = rel(&root.join("src"), &path);
        match from_src.rsplit_once('/') {
            Some((folder, _)) => {
                folders.insert(folder.to_string());
            }
            None if from_src == "lib.rs" || from_src == "main.rs" => {}
            None => {
                if !names_path(&arch, &from_src, false) {
                    v.push(format!(
                        "{}:1: not named in ARCHITECTURE.md; add `{from_src}` to its map with \
                         one line on what it holds",
                        rel(root, &path)
                    ));
                }
            }
        }
    }
    for folder in folders {
        if !names_path(&arch, &format!("{folder}/"), true) {
            v.push(format!(
                "src/{folder}/mod.rs:1: folder not named in ARCHITECTURE.md; add `{folder}/` to \
                 its map with one line on what it holds"
            ));
        }
    }
    v.sort();
    v
}

/// Where docs, comments and code live (rule e): paths from the root.
fn shipped_text_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    files.extend(
        walk(&root.join("docs"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md")),
    );
    for dir in ["src", "kernels", "hooks", "scripts", "examples", "bench"] {
        files.extend(walk(&root.join(dir)));
    }
    files.retain(|p| p.is_file());
    files
}

/// The team-machine folders rule e looks for, written in pieces so that
/// this file does not name them itself.
const OUTSIDE: [&str; 5] = [
    concat!("/", "work/"),
    concat!("..", "/shared"),
    concat!("shared", "/design"),
    concat!("/", "home/"),
    concat!("/tmp/", "kvtrail-dev"),
];

/// e. No path outside the repository (the team machine's folders) in docs,
/// comments or code.
fn check_no_outside_paths(root: &Path) -> Vec<String> {
    const PATTERNS: [&str; 5] = OUTSIDE;
    let mut v = Vec::new();
    for path in shipped_text_files(root) {
        let Some(text) = read(&path) else { continue };
        let r = rel(root, &path);
        for (n, line) in text.lines().enumerate() {
            for pat in PATTERNS {
                if line.contains(pat) {
                    v.push(format!(
                        "{r}:{}: names `{pat}`, a path outside the repository; \
                         point at a path inside it (or a user-chosen one) instead",
                        n + 1
                    ));
                }
            }
        }
    }
    v
}

/// Whether `line` mentions "issue N" / "issue #N" (any case).
fn mentions_issue(line: &str) -> bool {
    let lower = line.to_lowercase();
    word_starts(&lower, "issue").into_iter().any(|i| {
        let rest = lower[i + "issue".len()..].trim_start_matches('s');
        let rest = rest.trim_start();
        let rest = rest.strip_prefix('#').unwrap_or(rest).trim_start();
        rest.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// f. No reference to a tracker issue ("issue 7", "(issue #12)") in src/,
/// kernels/, examples/ or build.rs: say what the code does instead.
fn check_no_issue_refs(root: &Path) -> Vec<String> {
    let mut files = vec![root.join("build.rs")];
    for dir in ["src", "kernels", "examples"] {
        files.extend(walk(&root.join(dir)));
    }
    let mut v = Vec::new();
    for path in files {
        let Some(text) = read(&path) else { continue };
        let r = rel(root, &path);
        for (n, line) in text.lines().enumerate() {
            if mentions_issue(line) {
                v.push(format!(
                    "{r}:{}: refers to an issue number; say what the code does or why, without the tracker",
                    n + 1
                ));
            }
        }
    }
    v
}

// ---------------------------------------------------------------------------
// The rules on the real tree.

pub(crate) fn assert_clean(rule: &str, violations: Vec<String>) {
    assert!(
        violations.is_empty(),
        "tidy: {rule}: {} violation(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

#[test]
fn every_source_file_starts_with_a_module_doc() {
    assert_clean("module docs", check_module_docs(&repo_root()));
}

#[test]
fn only_the_cli_prints() {
    assert_clean("only cli prints", check_no_print(&repo_root()));
}

#[test]
fn only_trace_names_parquet() {
    assert_clean(
        "only trace names parquet",
        check_parquet_in_trace(&repo_root()),
    );
}

#[test]
fn architecture_names_every_source_file() {
    assert_clean(
        "ARCHITECTURE.md codemap",
        check_architecture_names_files(&repo_root()),
    );
}

#[test]
fn no_paths_outside_the_repository() {
    assert_clean(
        "paths outside the repository",
        check_no_outside_paths(&repo_root()),
    );
}

#[test]
fn no_issue_references() {
    assert_clean("issue references", check_no_issue_refs(&repo_root()));
}

// ---------------------------------------------------------------------------
// Each rule on a planted tree: a clean file passes, a planted violation is
// reported with its file and line.

pub(crate) fn plant(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (path, text) in files {
        let p = dir.path().join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    dir
}

pub(crate) fn assert_reports(violations: &[String], expected: &[&str]) {
    assert_eq!(
        violations.len(),
        expected.len(),
        "expected {expected:?}, got {violations:#?}"
    );
    for (got, want) in violations.iter().zip(expected) {
        assert!(got.starts_with(want), "expected `{want}...`, got `{got}`");
    }
}

#[test]
fn planted_missing_module_doc_is_found() {
    let t = plant(&[
        ("src/good.rs", "//! Holds things.\nfn f() {}\n"),
        ("src/foo.rs", "fn f() {}\n"),
        ("src/deep/bar.rs", "// a plain comment\n//! too late\n"),
    ]);
    assert_reports(
        &check_module_docs(t.path()),
        &["src/deep/bar.rs:1:", "src/foo.rs:1:"],
    );
}

#[test]
fn planted_print_outside_cli_is_found() {
    let t = plant(&[
        (
            "src/lib_part.rs",
            "//! x\n// println!(\"in a comment\")\nfn f() {\n    let s = \"eprintln!(in a string)\";\n    println!(\"{s}\");\n    let _ = std::io::stderr();\n}\n#[cfg(test)]\nmod tests { fn g() { dbg!(1); } }\n",
        ),
        (
            "src/raw.rs",
            "//! x\nconst S: &str = r#\"print!(\"x\")\"#;\nfn f() { eprint!(\"x\"); }\n",
        ),
        ("src/cli/mod.rs", "//! x\nfn f() { println!(\"ok\"); }\n"),
        ("src/main.rs", "//! x\nfn main() { eprintln!(\"ok\"); }\n"),
    ]);
    assert_reports(
        &check_no_print(t.path()),
        &[
            "src/lib_part.rs:5: `println!`",
            "src/lib_part.rs:6: `io::stderr`",
            "src/lib_part.rs:6: `stderr()`",
            "src/raw.rs:3: `eprint!`",
        ],
    );
}

#[test]
fn planted_parquet_outside_trace_is_found() {
    let t = plant(&[
        (
            "src/trace/write.rs",
            "//! x\nuse parquet::arrow::ArrowWriter;\n",
        ),
        (
            "src/report/mod.rs",
            "//! Writes findings.parquet (through trace).\n// parquet::file is named here in a comment only\nconst F: &str = \"findings.parquet\";\nfn f() { let _ = parquet::file::properties::WriterProperties::builder(); }\n",
        ),
        (
            "src/scope/mod.rs",
            "//! x\nuse parquet::arrow::ProjectionMask;\n",
        ),
    ]);
    assert_reports(
        &check_parquet_in_trace(t.path()),
        &["src/report/mod.rs:4:", "src/scope/mod.rs:2:"],
    );
}

#[test]
fn planted_file_missing_from_architecture_is_found() {
    let t = plant(&[
        (
            "ARCHITECTURE.md",
            "- `src/lineage/state.rs`: slot state.\n- `lineage/`: the engine.\n- `lib.rs`: the crate root.\n- `lineage/gpu/backend.rs`: the GPU backend.\n",
        ),
        ("src/lib.rs", "//! x\n"),
        ("src/lineage/mod.rs", "//! x\n"),
        ("src/lineage/state.rs", "//! x\n"),
        ("src/lineage/gpu/backend.rs", "//! x\n"),
        // A file inside a named folder: its own doc describes it.
        ("src/lineage/backend.rs", "//! x\n"),
        // Its folder appears only inside file paths: not named.
        ("src/lineage/gpu/mod.rs", "//! x\n"),
        ("src/foo.rs", "//! x\n"),
    ]);
    assert_reports(
        &check_architecture_names_files(t.path()),
        &[
            "src/foo.rs:1:",
            "src/lineage/gpu/mod.rs:1: folder not named",
        ],
    );
}

#[test]
fn planted_outside_path_is_found() {
    let [work, up, design, home, dev] = OUTSIDE;
    let files = [
        (
            "README.md",
            "Run `kvtrail scope trace --out /tmp/incident`.\n".to_string(),
        ),
        (
            "ARCHITECTURE.md",
            format!("See {up}{}.md for why.\n", &design["shared".len()..]),
        ),
        (
            "docs/guide.md",
            format!("ok\nThe trace lives in {work}main/traces.\n"),
        ),
        (
            "src/x.rs",
            format!("//! x\n// built from {home}dev/kvtrail\n"),
        ),
        (
            "hooks/sglang/.venv/lib/site.py",
            format!("{work} in a venv is skipped\n"),
        ),
        ("scripts/run.sh", format!("cd {dev}/x\n")),
    ];
    let planted: Vec<(&str, &str)> = files.iter().map(|(p, t)| (*p, t.as_str())).collect();
    let t = plant(&planted);
    assert_reports(
        &check_no_outside_paths(t.path()),
        &[
            &format!("ARCHITECTURE.md:1: names `{up}`"),
            &format!("ARCHITECTURE.md:1: names `{design}`"),
            &format!("docs/guide.md:2: names `{work}`"),
            &format!("src/x.rs:2: names `{home}`"),
            &format!("scripts/run.sh:1: names `{dev}`"),
        ],
    );
}

#[test]
fn planted_issue_reference_is_found() {
    let t = plant(&[
        (
            "src/whatif/mod.rs",
            "//! What-if replay (issue 7): re-run.\n//! Tissue 4 and issues of format are fine.\n",
        ),
        ("kernels/scan.cu", "// fixed for (Issue #12)\n"),
        ("examples/bench.rs", "//! x\n// see issue#3\n"),
        ("build.rs", "//! x\n// issue 9\n"),
    ]);
    assert_reports(
        &check_no_issue_refs(t.path()),
        &[
            "build.rs:2:",
            "src/whatif/mod.rs:1:",
            "kernels/scan.cu:1:",
            "examples/bench.rs:2:",
        ],
    );
}

#[test]
fn code_lines_strip_comments_and_strings() {
    let lines = code_lines(
        "let a = \"x // y\"; // z\n/* a\nb */ let c = 'q'; let d: &'a str = r##\"p\"# \"##;\n",
    );
    assert_eq!(
        lines,
        vec!["let a = \"\"; ", "", " let c = ' '; let d: &'a str = \"\";"]
    );
}
