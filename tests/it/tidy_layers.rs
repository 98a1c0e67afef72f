//! Tidy, the structure rules: the import layers, circles between files, the
//! size of files and functions, and which files may sit at the root. As in
//! tidy.rs, each rule is a `check_*(root) -> Vec<String>` run once on the
//! real tree and once on a planted tree that breaks it.
//!
//! Imports are read from the code as text (comments and strings removed):
//! every path that starts with `crate::`, `kvtrail::` (the binary naming the
//! library), `super::`, `self::` or the name of a child module the file
//! declares, with `use` groups (`{a::X, b::{Y, Z}}`) expanded. A path
//! resolves to the deepest source file it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::tidy::{
    assert_clean, assert_reports, code_lines_before_tests, is_ident, plant, read, rel, repo_root,
    rust_files, walk,
};

/// The most lines of code (comments and blank lines aside) a source file
/// may hold before its `#[cfg(test)]` tests.
const MAX_FILE_CODE_LINES: usize = 1000;
/// The most lines a function may span.
const MAX_FN_LINES: usize = 250;

/// The files that may sit at the repository's root; everything else lives
/// in a folder.
const ROOT_FILES: [&str; 7] = [
    ".gitattributes",
    ".gitignore",
    "ARCHITECTURE.md",
    "Cargo.lock",
    "Cargo.toml",
    "README.md",
    "build.rs",
];

/// A source file's module path: `lineage/cpu.rs` is `[lineage, cpu]`,
/// `lineage/mod.rs` is `[lineage]`, `lib.rs` and `main.rs` are `[]`.
fn module_path(from_src: &str) -> Vec<String> {
    let trimmed = from_src.trim_end_matches(".rs");
    let mut segs: Vec<String> = trimmed.split('/').map(str::to_string).collect();
    if matches!(segs.last().map(String::as_str), Some("mod")) {
        segs.pop();
    }
    if segs.len() == 1 && (segs[0] == "lib" || segs[0] == "main") {
        segs.clear();
    }
    segs
}

/// The source file (path from src/) a module path names: the deepest
/// prefix that is a file (`a/b.rs` or `a/b/mod.rs`).
fn resolve(files: &BTreeSet<String>, segs: &[String]) -> Option<String> {
    (1..=segs.len()).rev().find_map(|n| {
        let p = segs[..n].join("/");
        [format!("{p}.rs"), format!("{p}/mod.rs")]
            .into_iter()
            .find(|f| files.contains(f))
    })
}

/// Parses a path tree at `s[i..]` (after its first segment and `::`):
/// `a::b::C`, `a::{b::C, D}`, `*`. Pushes every leaf path, prefixed with
/// `prefix`, to `out`; returns the index after the tree.
fn parse_tree(s: &[char], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    loop {
        while i < s.len() && s[i].is_whitespace() {
            i += 1;
        }
        if i < s.len() && s[i] == '{' {
            i += 1;
            loop {
                while i < s.len() && (s[i].is_whitespace() || s[i] == ',') {
                    i += 1;
                }
                if i >= s.len() || s[i] == '}' {
                    break;
                }
                let before = i;
                i = parse_tree(s, i, path.clone(), out);
                if i == before {
                    i += 1;
                }
            }
            return (i + 1).min(s.len());
        }
        let start = i;
        while i < s.len() && (is_ident(s[i]) || s[i] == '*') {
            i += 1;
        }
        if i > start {
            path.push(s[start..i].iter().collect());
        }
        let mut j = i;
        while j < s.len() && s[j].is_whitespace() {
            j += 1;
        }
        if j + 1 < s.len() && s[j] == ':' && s[j + 1] == ':' && i > start {
            i = j + 2;
            continue;
        }
        out.push(path);
        return i;
    }
}

/// One import: the importing file's line and the file it names.
struct Import {
    line: usize,
    to: String,
}

/// The imports of one source file (code before its tests).
fn file_imports(files: &BTreeSet<String>, from_src: &str, text: &str) -> Vec<Import> {
    let here = module_path(from_src);
    let lines = code_lines_before_tests(text);
    let children: BTreeSet<String> = lines
        .iter()
        .filter_map(|l| {
            let t = l.trim_start();
            let t = t
                .strip_prefix("pub(crate) ")
                .or_else(|| t.strip_prefix("pub "))
                .unwrap_or(t);
            let name = t.strip_prefix("mod ")?.trim_end().strip_suffix(';')?;
            Some(name.trim().to_string())
        })
        .collect();
    let joined = lines.join("\n");
    let chars: Vec<char> = joined.chars().collect();
    let mut line_of = Vec::with_capacity(chars.len());
    let mut n = 1;
    for &c in &chars {
        line_of.push(n);
        if c == '\n' {
            n += 1;
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_word = i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == ':');
        if !starts_word || !is_ident(chars[i]) {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && is_ident(chars[j]) {
            j += 1;
        }
        let word: String = chars[i..j].iter().collect();
        // `name::` followed by a name or a group; `collect::<T>()` is a
        // turbofish, not a path.
        let has_path = j + 2 < chars.len()
            && chars[j] == ':'
            && chars[j + 1] == ':'
            && (is_ident(chars[j + 2]) || chars[j + 2] == '{' || chars[j + 2] == '*');
        let base: Option<Vec<String>> = match word.as_str() {
            _ if !has_path => None,
            "crate" | "kvtrail" => Some(Vec::new()),
            "self" => Some(here.clone()),
            "super" => Some(here[..here.len().saturating_sub(1)].to_vec()),
            w if children.contains(w) => {
                let mut b = here.clone();
                b.push(w.to_string());
                Some(b)
            }
            _ => None,
        };
        let Some(base) = base else {
            i = j;
            continue;
        };
        let mut leaves = Vec::new();
        let end = parse_tree(&chars, j + 2, Vec::new(), &mut leaves);
        for leaf in leaves {
            let mut full = base.clone();
            for seg in leaf {
                match seg.as_str() {
                    "super" => {
                        full.pop();
                    }
                    "self" | "*" => {}
                    _ => full.push(seg),
                }
            }
            if let Some(to) = resolve(files, &full) {
                if to != from_src {
                    out.push(Import {
                        line: line_of[i],
                        to,
                    });
                }
            }
        }
        i = end.max(j);
    }
    out
}

/// Every source file under src/ (paths from src/) and its imports.
fn import_graph(root: &Path) -> BTreeMap<String, Vec<Import>> {
    let src = root.join("src");
    let paths = rust_files(root, "src");
    let files: BTreeSet<String> = paths.iter().map(|p| rel(&src, p)).collect();
    let mut graph = BTreeMap::new();
    for p in &paths {
        let from = rel(&src, p);
        let text = read(p).unwrap_or_default();
        let imports = file_imports(&files, &from, &text);
        graph.insert(from, imports);
    }
    graph
}

/// The top-level module a source file belongs to (`lineage/cpu.rs` is
/// `lineage`, `error.rs` is `error`); `None` for lib.rs and main.rs.
fn top_module(from_src: &str) -> Option<String> {
    module_path(from_src).into_iter().next()
}

/// The module table derived from the code: module -> modules it imports,
/// with one place (file:line) each import is made.
fn derived_table(
    graph: &BTreeMap<String, Vec<Import>>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut table: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (from, imports) in graph {
        let Some(m) = top_module(from) else { continue };
        let row = table.entry(m.clone()).or_default();
        for imp in imports {
            let Some(n) = top_module(&imp.to) else {
                continue;
            };
            if n != m {
                row.entry(n)
                    .or_insert_with(|| format!("src/{from}:{}", imp.line));
            }
        }
    }
    table
}

/// The derived table in ARCHITECTURE.md's form, rows in `order` (modules
/// missing from it last).
fn render_table(table: &BTreeMap<String, BTreeMap<String, String>>, order: &[String]) -> String {
    let mut rows: Vec<&String> = order.iter().filter(|m| table.contains_key(*m)).collect();
    rows.extend(table.keys().filter(|m| !order.contains(m)));
    let mut s = String::from("| module | imports |\n|---|---|\n");
    for m in rows {
        let deps = &table[m];
        let list = if deps.is_empty() {
            "nothing".to_string()
        } else {
            deps.keys()
                .map(|d| format!("`{d}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s.push_str(&format!("| `{m}` | {list} |\n"));
    }
    s
}

/// The backticked names in a table cell.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// ARCHITECTURE.md's import table: (line, module, imports) in row order,
/// from the table whose header is `| module | imports |`.
fn documented_table(arch: &str) -> Vec<(usize, String, BTreeSet<String>)> {
    let mut rows = Vec::new();
    let mut inside = false;
    for (n, line) in arch.lines().enumerate() {
        let t = line.trim();
        if t.replace(' ', "") == "|module|imports|" {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        if !t.starts_with('|') {
            if !rows.is_empty() {
                break;
            }
            continue;
        }
        let cells: Vec<&str> = t.trim_matches('|').split('|').collect();
        if cells.len() < 2 || cells[0].trim().starts_with("---") {
            continue;
        }
        for m in ticked(cells[0]) {
            rows.push((n + 1, m, ticked(cells[1]).into_iter().collect()));
        }
    }
    rows
}

/// g. ARCHITECTURE.md's import table is the one the code has, and no
/// module imports one on its own row or a later one (rows go bottom up).
fn check_import_table(root: &Path) -> Vec<String> {
    let graph = import_graph(root);
    let table = derived_table(&graph);
    let arch = read(&root.join("ARCHITECTURE.md")).unwrap_or_default();
    let rows = documented_table(&arch);
    let order: Vec<String> = rows.iter().map(|r| r.1.clone()).collect();
    let mut v = Vec::new();
    if rows.is_empty() {
        v.push(format!(
            "ARCHITECTURE.md:1: no import table (a `| module | imports |` table, bottom layer first); add:\n{}",
            render_table(&table, &order)
        ));
        return v;
    }
    for (line, m, listed) in &rows {
        let Some(actual) = table.get(m) else {
            v.push(format!(
                "ARCHITECTURE.md:{line}: row `{m}` names no module of src/; remove it"
            ));
            continue;
        };
        let actual_set: BTreeSet<String> = actual.keys().cloned().collect();
        if &actual_set != listed {
            let extra: Vec<_> = actual_set.difference(listed).cloned().collect();
            let gone: Vec<_> = listed.difference(&actual_set).cloned().collect();
            v.push(format!(
                "ARCHITECTURE.md:{line}: row `{m}` disagrees with the code: imported but not \
                 listed {extra:?}, listed but not imported {gone:?}; the table from the code:\n{}",
                render_table(&table, &order)
            ));
        }
        let here = order.iter().position(|o| o == m).unwrap_or(0);
        for (dep, at) in actual {
            let there = order.iter().position(|o| o == dep);
            if there.is_none_or(|t| t >= here) {
                v.push(format!(
                    "{at}: `{m}` imports `{dep}`, which is not below it in ARCHITECTURE.md's \
                     layers; move the shared piece down to a lower module, or the code up"
                ));
            }
        }
    }
    for m in table.keys() {
        if !order.contains(m) {
            v.push(format!(
                "ARCHITECTURE.md:1: the import table has no row for `{m}`; add it at its layer"
            ));
        }
    }
    v
}

/// h. No circle between source files: following imports from a file never
/// leads back to it (a parent `mod.rs` and its children included).
fn check_no_circles(root: &Path) -> Vec<String> {
    let graph = import_graph(root);
    let names: Vec<&String> = graph.keys().collect();
    let idx: BTreeMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let adj: Vec<Vec<usize>> = names
        .iter()
        .map(|n| {
            let mut t: Vec<usize> = graph[*n]
                .iter()
                .filter_map(|i| idx.get(&i.to).copied())
                .collect();
            t.sort_unstable();
            t.dedup();
            t
        })
        .collect();
    let sccs = strongly_connected(&adj);
    let mut v = Vec::new();
    for comp in sccs.into_iter().filter(|c| c.len() > 1) {
        let inside: BTreeSet<usize> = comp.iter().copied().collect();
        let start = *inside.iter().next().unwrap_or(&0);
        let cycle = cycle_through(&adj, &inside, start);
        let mut steps = Vec::new();
        for w in cycle.windows(2) {
            let (a, b) = (names[w[0]], names[w[1]]);
            let line = graph[a].iter().find(|i| &i.to == b).map_or(0, |i| i.line);
            steps.push(format!("src/{a}:{line} imports src/{b}"));
        }
        let files: Vec<String> = comp.iter().map(|&i| format!("src/{}", names[i])).collect();
        v.push(format!(
            "src/{}:1: import circle of {} files ({}): {}; move what both sides need into a file \
             that imports neither",
            names[start],
            comp.len(),
            files.join(", "),
            steps.join(", then ")
        ));
    }
    v
}

/// Tarjan's strongly connected components, iterative.
fn strongly_connected(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = adj.len();
    let (mut index, mut low, mut on) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut out, mut next) = (Vec::new(), Vec::new(), 0);
    for s in 0..n {
        if index[s] != usize::MAX {
            continue;
        }
        let mut work = vec![(s, 0usize)];
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k == 0 && index[v] == usize::MAX {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on[v] = true;
            }
            if *k < adj[v].len() {
                let w = adj[v][*k];
                *k += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(u, _)) = work.last() {
                low[u] = low[u].min(low[v]);
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                comp.sort_unstable();
                out.push(comp);
            }
        }
    }
    out.sort();
    out
}

/// A shortest path from `start` back to itself inside one component.
fn cycle_through(adj: &[Vec<usize>], inside: &BTreeSet<usize>, start: usize) -> Vec<usize> {
    let mut prev: BTreeMap<usize, usize> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in &adj[v] {
            if w == start {
                let mut path = vec![start, v];
                let mut cur = v;
                while cur != start {
                    cur = prev[&cur];
                    path.push(cur);
                }
                // path is start, v, ..., start backwards; read it forwards.
                path.reverse();
                return path;
            }
            if inside.contains(&w) && !prev.contains_key(&w) && w != start {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    vec![start, start]
}

/// i. No source file holds more than `MAX_FILE_CODE_LINES` lines of code
/// before its tests, and no function spans more than `MAX_FN_LINES` lines.
fn check_sizes(root: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for path in rust_files(root, "src") {
        let r = rel(root, &path);
        let Some(text) = read(&path) else { continue };
        let lines = code_lines_before_tests(&text);
        let code = lines.iter().filter(|l| !l.trim().is_empty()).count();
        if code > MAX_FILE_CODE_LINES {
            v.push(format!(
                "{r}:1: {code} lines of code before its tests (at most {MAX_FILE_CODE_LINES}); \
                 split it into files that each do one thing"
            ));
        }
        for (start, name, len) in functions(&lines) {
            if len > MAX_FN_LINES {
                v.push(format!(
                    "{r}:{}: fn `{name}` spans {len} lines (at most {MAX_FN_LINES}); split it into \
                     steps",
                    start + 1
                ));
            }
        }
    }
    v
}

/// Every function with a body in `lines`: (first line, name, lines spanned).
fn functions(lines: &[String]) -> Vec<(usize, String, usize)> {
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        for at in super::tidy::word_starts(line, "fn ") {
            let name: String = line[at + 3..]
                .trim_start()
                .chars()
                .take_while(|&c| is_ident(c))
                .collect();
            if name.is_empty() {
                continue;
            }
            // The body starts at the first `{` before any `;`.
            let mut depth = 0i64;
            let mut opened = false;
            let mut end = None;
            'scan: for (m, l) in lines.iter().enumerate().skip(n) {
                let from = if m == n { at } else { 0 };
                for c in l[from..].chars() {
                    match c {
                        ';' if !opened => break 'scan,
                        '{' => {
                            opened = true;
                            depth += 1;
                        }
                        '}' if opened => {
                            depth -= 1;
                            if depth == 0 {
                                end = Some(m);
                                break 'scan;
                            }
                        }
                        _ => {}
                    }
                }
            }
            if let Some(e) = end {
                out.push((n, name, e - n + 1));
            }
        }
    }
    out
}

/// j. Only the files in `ROOT_FILES` sit at the repository's root.
fn check_root_files(root: &Path) -> Vec<String> {
    let mut v = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return v;
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        // A linked git worktree's `.git` is a file pointing at the
        // repository: git's, not the project's.
        if name == ".git" {
            continue;
        }
        if !ROOT_FILES.contains(&name.as_str()) {
            v.push(format!(
                "{name}:1: a file at the repository's root that is not in the fixed list \
                 (tests/it/tidy_layers.rs ROOT_FILES); move it into a folder, or delete it if a \
                 command left it behind"
            ));
        }
    }
    v
}

// ---------------------------------------------------------------------------
// The rules on the real tree.

#[test]
fn architecture_import_table_is_the_code_and_runs_down() {
    assert_clean("import table and layers", check_import_table(&repo_root()));
}

#[test]
fn no_import_circles() {
    assert_clean("import circles", check_no_circles(&repo_root()));
}

#[test]
fn files_and_functions_stay_small() {
    assert_clean("sizes", check_sizes(&repo_root()));
}

#[test]
fn only_listed_files_at_the_root() {
    assert_clean("root files", check_root_files(&repo_root()));
}

// ---------------------------------------------------------------------------
// Each rule on a planted tree.

const PLANTED_ARCH: &str = "# Architecture\n\n| module | imports |\n|---|---|\n\
| `text` | nothing |\n| `error` | `text` |\n| `trace` | `error`, `text` |\n\n";

#[test]
fn planted_upward_import_and_stale_table_are_found() {
    let dir = plant(&[
        ("ARCHITECTURE.md", PLANTED_ARCH),
        (
            "src/lib.rs",
            "//! x\npub mod error;\npub mod text;\npub mod trace;\n",
        ),
        ("src/text.rs", "//! x\npub fn term() {}\n"),
        (
            "src/error.rs",
            "//! x\nuse crate::{text::term, trace::read::Trace};\n\
             // use crate::trace::Other; (a comment)\nconst S: &str = \"crate::trace::X\";\n",
        ),
        (
            "src/trace/mod.rs",
            "//! x\npub mod read;\nuse crate::error::E;\n",
        ),
        (
            "src/trace/read.rs",
            "//! x\npub struct Trace;\nfn f() { crate::text::term(); }\n",
        ),
    ]);
    let v = check_import_table(dir.path());
    assert_reports(
        &v,
        &[
            "ARCHITECTURE.md:6: row `error` disagrees",
            "src/error.rs:2: `error` imports `trace`, which is not below it",
        ],
    );
    assert!(v[0].contains("listed but not imported []"), "{v:?}");
    assert!(v[0].contains("| `error` | `text`, `trace` |"), "{v:?}");
    let none: Vec<String> = check_import_table(
        plant(&[
            ("ARCHITECTURE.md", PLANTED_ARCH),
            ("src/text.rs", "//! x\n"),
            ("src/error.rs", "//! x\nuse crate::text::term;\n"),
            ("src/trace/mod.rs", "//! x\nuse crate::{error::E, text};\n"),
            ("src/extra.rs", "//! x\n"),
        ])
        .path(),
    );
    assert_reports(
        &none,
        &["ARCHITECTURE.md:1: the import table has no row for `extra`"],
    );
}

#[test]
fn planted_circles_are_found() {
    let dir = plant(&[
        ("src/lib.rs", "//! x\npub mod sim;\n"),
        (
            "src/sim/mod.rs",
            "//! x\nmod engine;\nmod vllm;\nmod base;\npub use engine::run;\n",
        ),
        (
            "src/sim/engine.rs",
            "//! x\nuse super::vllm::deployment;\nuse super::base::Slots;\n",
        ),
        (
            "src/sim/vllm.rs",
            "//! x\nuse super::{\n    base::Slots,\n    engine::{EPOCH, X},\n};\n",
        ),
        ("src/sim/base.rs", "//! x\npub struct Slots;\n"),
        ("src/a.rs", "//! x\nuse crate::b::B;\n"),
        (
            "src/b.rs",
            "//! x\nfn f() { crate::a::g(); }\n#[cfg(test)]\nmod t { use crate::a; }\n",
        ),
    ]);
    let v = check_no_circles(dir.path());
    assert_reports(
        &v,
        &[
            "src/a.rs:1: import circle of 2 files",
            "src/sim/engine.rs:1: import circle of 2 files",
        ],
    );
    assert!(
        v[0].contains("src/a.rs:2 imports src/b.rs, then src/b.rs:2 imports src/a.rs"),
        "{v:?}"
    );
    assert!(
        v[1].contains("src/sim/vllm.rs:2 imports src/sim/engine.rs"),
        "{v:?}"
    );
    // A parent that uses a child which uses the parent is a circle too.
    let v = check_no_circles(
        plant(&[
            (
                "src/report/mod.rs",
                "//! x\nmod ocsf;\npub struct Input;\nfn f() { ocsf::events(); }\n",
            ),
            ("src/report/ocsf.rs", "//! x\nuse super::Input;\n"),
        ])
        .path(),
    );
    assert_reports(&v, &["src/report/mod.rs:1: import circle of 2 files"]);
    // A turbofish on a method named like a child (`v.ocsf::<u8>()`) is no
    // import: a child that uses its parent makes no circle then.
    let v = check_no_circles(
        plant(&[
            (
                "src/report/mod.rs",
                "//! x\nmod ocsf;\npub struct Input;\nfn f(v: V) { v.ocsf::<u8>(); }\n",
            ),
            ("src/report/ocsf.rs", "//! x\nuse super::Input;\n"),
        ])
        .path(),
    );
    assert_reports(&v, &[]);
}

#[test]
fn planted_big_file_and_long_function_are_found() {
    let mut long_fn =
        String::from("//! x\n// a comment line does not count\nfn short() {\n}\n\nfn long() {\n");
    for _ in 0..MAX_FN_LINES {
        long_fn.push_str("    let _ = 1;\n");
    }
    long_fn.push_str("}\n\nfn decl();\n");
    let mut big = String::from("//! x\n");
    for i in 0..=MAX_FILE_CODE_LINES {
        big.push_str(&format!("const C{i}: u8 = 0;\n\n// comment\n"));
    }
    big.push_str("#[cfg(test)]\nmod tests {\n");
    let mut ok = String::from("//! x\n");
    for i in 0..MAX_FILE_CODE_LINES - 1 {
        ok.push_str(&format!("const C{i}: u8 = 0;\n"));
    }
    ok.push_str("#[cfg(test)]\nmod tests {\n");
    for _ in 0..2000 {
        ok.push_str("    fn t() {}\n");
    }
    ok.push_str("}\n");
    let dir = plant(&[
        ("src/long.rs", &long_fn),
        ("src/big.rs", &big),
        ("src/ok.rs", &ok),
    ]);
    assert_reports(
        &check_sizes(dir.path()),
        &[
            "src/big.rs:1: 1001 lines of code before its tests",
            "src/long.rs:6: fn `long` spans 252 lines",
        ],
    );
}

#[test]
fn planted_root_file_is_found() {
    let dir = plant(&[
        ("README.md", "x"),
        ("Cargo.toml", "x"),
        ("e.txt", "captured stderr"),
        ("docs/notes.txt", "fine in a folder"),
    ]);
    assert_reports(
        &check_root_files(dir.path()),
        &["e.txt:1: a file at the repository's root that is not in the fixed list"],
    );
    assert!(walk(dir.path()).len() == 4);
}
