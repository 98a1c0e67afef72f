//! What reaches people, on hostile traces, through the binary: CSV cells
//! that a spreadsheet would run as formulas, tenant names and ids that
//! would rewrite a terminal, output folders that would mix with (or
//! destroy) other files, pack folder names Windows reserves, and the
//! permissions of everything written.

#[path = "scope_common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::TraceBuilder;

fn kvtrail(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtrail"))
        .args(args)
        .current_dir(cwd)
        .env("KVTRAIL_NO_PROGRESS", "1")
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn refused(o: &Output, want: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(want) && err.contains("hint:"), "{err}");
    err
}

/// Request 1 of tenant `t1` writes four slots; request 2 of `t2` reads two
/// of them: r2 is an affected recipient, r1 its source.
fn leak(t1: &str, t2: &str) -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, t1);
    tb.req(2, t2);
    tb.req(3, "bystander");
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 2);
    tb
}

const FORMULA: [char; 6] = ['=', '+', '-', '@', '\t', '\r'];

#[test]
fn csv_cells_starting_with_formula_characters_are_neutralised() {
    let mut tb = leak("=cmd|' /C calc'!A0", "@SUM(1+1)");
    tb.requests[0].external_id = Some("=HYPERLINK(\"http://x\",\"y\")".into());
    tb.requests[1].external_id = Some("-2+3".into());
    tb.requests[2].external_id = Some("\tnul\0here".into());
    tb.requests[2].tenant = "+bystander".into();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    ok(&kvtrail(root, &["scope", "trace", "--out", "scope"]));
    ok(&kvtrail(root, &["notify", "scope", "--out", "packs"]));
    // (file, numeric columns)
    let files: [(&str, &[&str]); 4] = [
        (
            "scope/responses.csv",
            &["request_id", "arrival_ns", "http_status", "foreign_tokens"],
        ),
        ("scope/tenants.csv", &["responses", "requests", "tokens"]),
        (
            "scope/requests.csv",
            &["request_id", "arrival_ns", "http_status", "prompt_tokens"],
        ),
        ("packs/register.csv", &["affected_responses"]),
    ];
    for (f, numeric) in files {
        let bytes = std::fs::read(root.join(f)).unwrap();
        assert!(!bytes.contains(&0), "{f} holds a NUL byte");
        let mut rd = csv::ReaderBuilder::new().from_reader(&bytes[..]);
        let head: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let mut rows = 0;
        for rec in rd.records() {
            let rec = rec.unwrap();
            rows += 1;
            for (h, cell) in head.iter().zip(rec.iter()) {
                if numeric.contains(&h.as_str()) {
                    assert!(
                        cell.parse::<i64>().is_ok(),
                        "{f} {h}: {cell:?} is no number"
                    );
                } else {
                    assert!(
                        !cell.starts_with(FORMULA),
                        "{f} {h}: {cell:?} starts like a formula"
                    );
                }
            }
        }
        assert!(rows > 0, "{f} is empty");
    }
    // The neutralised cells read back exactly: lookup finds the ids.
    for (id, want) in [("=HYPERLINK(\"http://x\",\"y\")", 1), ("-2+3", 2)] {
        // `--external-id=ID`: an id that starts with `-` is no flag.
        let v: serde_json::Value = serde_json::from_str(&ok(&kvtrail(
            root,
            &["lookup", "scope", "--json", &format!("--external-id={id}")],
        )))
        .unwrap();
        assert_eq!(v["status"], "affected", "{id}: {v}");
        assert_eq!(v["matches"][0]["request_id"], want);
        assert_eq!(v["matches"][0]["external_id"], id);
    }
    let v: serde_json::Value = serde_json::from_str(&ok(&kvtrail(
        root,
        &["lookup", "scope", "--json", "--tenant", "+bystander"],
    )))
    .unwrap();
    assert!(
        v["status"].as_str().unwrap().starts_with("not_affected"),
        "{v}"
    );
    assert_eq!(v["unaffected_matches"], 1, "{v}");
}

#[test]
fn terminal_control_characters_in_trace_strings_are_escaped() {
    let spoof = "evil\x1b[2J\x1b[H\rNOT AFFECTED\u{202e}";
    let mut tb = leak("victim", spoof);
    tb.requests[1].external_id = Some(format!("id-{spoof}"));
    tb.deployment.name = format!("dep\x1b]0;title\x07{spoof}");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    let scope = ok(&kvtrail(root, &["scope", "trace", "--out", "scope"]));
    let inspect = ok(&kvtrail(root, &["inspect", "trace"]));
    let lookup = ok(&kvtrail(
        root,
        &["lookup", "scope", "--external-id", &format!("id-{spoof}")],
    ));
    let by_tenant = ok(&kvtrail(root, &["lookup", "scope", "--tenant", spoof]));
    // A file planted in the folder under a spoofing name: verify names it.
    std::fs::write(root.join("scope").join(format!("x{spoof}.txt")), "x").unwrap();
    let o = kvtrail(root, &["verify", "scope"]);
    assert_eq!(o.status.code(), Some(1));
    let verify = String::from_utf8(o.stdout).unwrap();
    for (what, out) in [
        ("scope", &scope),
        ("inspect", &inspect),
        ("lookup", &lookup),
        ("lookup --tenant", &by_tenant),
        ("verify", &verify),
    ] {
        for bad in ['\x1b', '\r', '\x07', '\u{202e}'] {
            assert!(!out.contains(bad), "{what} prints {bad:?} raw:\n{out}");
        }
        assert!(out.contains("\\u{1b}[2J"), "{what}: {out}");
    }
    assert!(scope.contains("evil\\u{1b}[2J\\u{1b}[H\\u{d}NOT AFFECTED\\u{202e}"));
    // JSON stays exact JSON.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&kvtrail(root, &["scope", "trace", "--json"]))).unwrap();
    assert_eq!(v["affected_responses"][0]["tenant"], spoof);
}

#[test]
fn scope_out_refuses_a_non_empty_folder_or_one_inside_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    leak("acme", "globex").record(&root.join("trace"));
    // A folder holding someone else's file.
    std::fs::create_dir_all(root.join("busy")).unwrap();
    std::fs::write(root.join("busy/notes.txt"), "mine").unwrap();
    refused(
        &kvtrail(root, &["scope", "trace", "--out", "busy"]),
        "not empty",
    );
    refused(
        &kvtrail(root, &["scope", "trace", "--out", "busy", "--force"]),
        "no evidence.json",
    );
    assert_eq!(std::fs::read(root.join("busy/notes.txt")).unwrap(), b"mine");
    // Inside (or equal to) the trace.
    for out in [
        "trace/kv",
        "trace",
        "trace/new/deeper",
        "./trace/../trace/x",
    ] {
        refused(
            &kvtrail(root, &["scope", "trace", "--out", out]),
            "inside the input",
        );
    }
    assert!(!root.join("trace/kv/summary.json").exists());
    ok(&kvtrail(root, &["inspect", "trace"]));
    // An earlier output of the same trace: only with --force.
    ok(&kvtrail(root, &["scope", "trace", "--out", "scope"]));
    refused(
        &kvtrail(root, &["scope", "trace", "--out", "scope"]),
        "not empty",
    );
    ok(&kvtrail(
        root,
        &["scope", "trace", "--out", "scope", "--force"],
    ));
    let v = ok(&kvtrail(root, &["verify", "scope"]));
    assert!(v.contains("OK:"), "{v}");
    // ... but never when it holds a file its evidence.json does not list.
    std::fs::write(root.join("scope/planted.csv"), "x").unwrap();
    refused(
        &kvtrail(root, &["scope", "trace", "--out", "scope", "--force"]),
        "planted.csv",
    );
    std::fs::remove_file(root.join("scope/planted.csv")).unwrap();
    // ... nor for another trace.
    leak("acme", "globex").record(&root.join("other"));
    refused(
        &kvtrail(root, &["scope", "other", "--out", "scope", "--force"]),
        "another input",
    );
    // notify: not inside the scope folder, not over a non-empty folder,
    // --force only over its own earlier output.
    refused(
        &kvtrail(root, &["notify", "scope", "--out", "scope/packs"]),
        "inside the input",
    );
    ok(&kvtrail(root, &["verify", "scope"]));
    refused(
        &kvtrail(root, &["notify", "scope", "--out", "busy"]),
        "not empty",
    );
    ok(&kvtrail(root, &["notify", "scope", "--out", "packs"]));
    ok(&kvtrail(
        root,
        &["notify", "scope", "--out", "packs", "--force"],
    ));
    let v = ok(&kvtrail(root, &["verify", "packs"]));
    assert!(v.contains("OK:"), "{v}");
    // merge: not over a non-empty folder.
    ok(&kvtrail(
        root,
        &["scope", "trace", "--pools", "0", "--out", "s0"],
    ));
    ok(&kvtrail(
        root,
        &["scope", "trace", "--pools", "1", "--out", "s1"],
    ));
    refused(
        &kvtrail(root, &["merge", "s0", "s1", "--out", "busy"]),
        "not empty",
    );
    refused(
        &kvtrail(root, &["merge", "s0", "s1", "--out", "s0/m"]),
        "inside the input",
    );
    ok(&kvtrail(root, &["merge", "s0", "s1", "--out", "merged"]));
    // A shard folder verifies: shard.json is in its evidence.json.
    let v = ok(&kvtrail(root, &["verify", "s0"]));
    assert!(v.contains("OK:"), "{v}");
}

#[test]
fn pack_folder_names_reserved_on_windows_are_sanitised() {
    let tenants: std::collections::BTreeSet<String> = [
        "CON",
        "con",
        "aux.txt",
        "nul",
        "COM1",
        "lpt9.log",
        "trailing.",
        "trailing ",
        "prn.",
        "fine",
        "CONSOLE",
        "com10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let names = kvtrail::notify::folder_names(&tenants);
    let reserved = |n: &str| {
        let stem = n.split('.').next().unwrap().to_ascii_uppercase();
        ["CON", "PRN", "AUX", "NUL"].contains(&stem.as_str())
            || ((stem.starts_with("COM") || stem.starts_with("LPT"))
                && stem.len() == 4
                && stem.as_bytes()[3].is_ascii_digit())
            || n.ends_with(['.', ' '])
    };
    let mut lower: Vec<String> = names.values().map(|n| n.to_ascii_lowercase()).collect();
    lower.sort();
    lower.dedup();
    assert_eq!(lower.len(), tenants.len(), "{names:?}");
    for (t, n) in &names {
        assert!(!reserved(n), "{t:?} -> {n:?} is reserved on Windows");
        assert!(
            !n.is_empty() && !n.starts_with('.') && !n.contains('/'),
            "{n}"
        );
    }
    assert_eq!(names["fine"], "fine");
    assert_eq!(names["CONSOLE"], "CONSOLE");
    assert_eq!(names["com10"], "com10");
    // Through notify: a pack for a customer named `aux.txt`.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    leak("aux.txt", "CON").record(&root.join("trace"));
    ok(&kvtrail(root, &["scope", "trace", "--out", "scope"]));
    ok(&kvtrail(root, &["notify", "scope", "--out", "packs"]));
    for e in std::fs::read_dir(root.join("packs/customers")).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!reserved(&n), "pack folder {n:?}");
    }
}

#[cfg(unix)]
#[test]
fn outputs_are_owner_only_under_a_permissive_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    leak("acme", "globex").record(&root.join("trace"));
    let bin = env!("CARGO_BIN_EXE_kvtrail");
    for cmd in [
        "scope trace --out scope",
        "notify scope --out packs",
        "scope trace --pools 0 --out s0",
        "scope trace --pools 1 --out s1",
        "merge s0 s1 --out merged",
    ] {
        let o = Command::new("sh")
            .arg("-c")
            .arg(format!("umask 000 && exec \"{bin}\" {cmd}"))
            .current_dir(root)
            .env("KVTRAIL_NO_PROGRESS", "1")
            .output()
            .unwrap();
        ok(&o);
    }
    for top in ["scope", "packs", "s0", "merged"] {
        let mut stack = vec![root.join(top)];
        let mut n = 0;
        while let Some(p) = stack.pop() {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            if p.is_dir() {
                assert_eq!(mode, 0o700, "{} is {mode:o}", p.display());
                for e in std::fs::read_dir(&p).unwrap() {
                    stack.push(e.unwrap().path());
                }
            } else {
                assert_eq!(mode, 0o600, "{} is {mode:o}", p.display());
                n += 1;
            }
        }
        assert!(n >= 4, "{top}: {n} files");
    }
}
