//! What reaches people, on hostile traces, through the binary: CSV cells
//! that a spreadsheet would run as formulas, tenant names and ids that
//! would rewrite a terminal, output folders that would mix with (or
//! destroy) other files, pack folder names Windows reserves, and the
//! permissions of everything written.

use std::path::Path;

use crate::support::cli::{Ran, kvtrail};
use crate::support::files::copy_dir;
use crate::support::trace_builder::TraceBuilder;

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
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["notify", "scope", "--out", "packs"])
        .cwd(root)
        .run()
        .ok();
    // Every CSV of both folders, the customers' packs included; a cell may
    // start like a formula only where it is a number (a negative count).
    let mut files = Vec::new();
    let mut stack = vec![root.join("scope"), root.join("packs")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "csv") {
                files.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    files.sort();
    for f in [
        "scope/responses.csv",
        "scope/tenants.csv",
        "scope/requests.csv",
        "packs/register.csv",
    ] {
        assert!(files.iter().any(|x| x == f), "{f} not written: {files:?}");
    }
    for f in &files {
        let bytes = std::fs::read(root.join(f)).unwrap();
        assert!(!bytes.contains(&0), "{f} holds a NUL byte");
        let mut rd = csv::ReaderBuilder::new().from_reader(&bytes[..]);
        let head: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let mut rows = 0;
        for rec in rd.records() {
            let rec = rec.unwrap();
            rows += 1;
            for (h, cell) in head.iter().zip(rec.iter()) {
                assert!(
                    !cell.starts_with(FORMULA) || cell.parse::<i64>().is_ok(),
                    "{f} {h}: {cell:?} starts like a formula"
                );
            }
        }
        assert!(rows > 0, "{f} is empty");
    }
    // The hostile names reached the files (neutralised, not dropped).
    let requests = std::fs::read_to_string(root.join("scope/requests.csv")).unwrap();
    assert!(requests.contains("'=HYPERLINK") && requests.contains("'+bystander"));
    // The neutralised cells read back exactly: lookup finds the ids.
    for (id, want) in [("=HYPERLINK(\"http://x\",\"y\")", 1), ("-2+3", 2)] {
        // `--external-id=ID`: an id that starts with `-` is no flag.
        let v: serde_json::Value = serde_json::from_str(
            &kvtrail(["lookup", "scope", "--json", &format!("--external-id={id}")])
                .cwd(root)
                .run()
                .ok(),
        )
        .unwrap();
        assert_eq!(v["status"], "affected", "{id}: {v}");
        assert_eq!(v["matches"][0]["request_id"], want);
        assert_eq!(v["matches"][0]["external_id"], id);
    }
    let v: serde_json::Value = serde_json::from_str(
        &kvtrail(["lookup", "scope", "--json", "--tenant", "+bystander"])
            .cwd(root)
            .run()
            .ok(),
    )
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
    let scope = kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    let inspect = kvtrail(["inspect", "trace"]).cwd(root).run().ok();
    let lookup = kvtrail(["lookup", "scope", "--external-id", &format!("id-{spoof}")])
        .cwd(root)
        .run()
        .ok();
    let by_tenant = kvtrail(["lookup", "scope", "--tenant", spoof])
        .cwd(root)
        .run()
        .ok();
    // A file planted in the folder under a spoofing name: verify names it.
    std::fs::write(root.join("scope").join(format!("x{spoof}.txt")), "x").unwrap();
    let o = kvtrail(["verify", "scope"]).cwd(root).run();
    assert_eq!(o.code, 1);
    let verify = String::from_utf8(o.stdout_bytes).unwrap();
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
        serde_json::from_str(&kvtrail(["scope", "trace", "--json"]).cwd(root).run().ok()).unwrap();
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
    kvtrail(["scope", "trace", "--out", "busy"])
        .cwd(root)
        .run()
        .refused("not empty");
    kvtrail(["scope", "trace", "--out", "busy", "--force"])
        .cwd(root)
        .run()
        .refused("no evidence.json");
    assert_eq!(std::fs::read(root.join("busy/notes.txt")).unwrap(), b"mine");
    // Inside (or equal to) the trace.
    for out in [
        "trace/kv",
        "trace",
        "trace/new/deeper",
        "./trace/../trace/x",
    ] {
        kvtrail(["scope", "trace", "--out", out])
            .cwd(root)
            .run()
            .refused("inside the input");
    }
    assert!(!root.join("trace/kv/summary.json").exists());
    kvtrail(["inspect", "trace"]).cwd(root).run().ok();
    // An earlier output of the same trace: only with --force.
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .refused("not empty");
    kvtrail(["scope", "trace", "--out", "scope", "--force"])
        .cwd(root)
        .run()
        .ok();
    let v = kvtrail(["verify", "scope"]).cwd(root).run().ok();
    assert!(v.contains("OK:"), "{v}");
    // ... but never when it holds a file its evidence.json does not list.
    std::fs::write(root.join("scope/planted.csv"), "x").unwrap();
    kvtrail(["scope", "trace", "--out", "scope", "--force"])
        .cwd(root)
        .run()
        .refused("planted.csv");
    std::fs::remove_file(root.join("scope/planted.csv")).unwrap();
    // ... nor for another trace.
    leak("acme", "globex").record(&root.join("other"));
    kvtrail(["scope", "other", "--out", "scope", "--force"])
        .cwd(root)
        .run()
        .refused("another input");
    // notify: not inside the scope folder, not over a non-empty folder,
    // --force only over its own earlier output.
    kvtrail(["notify", "scope", "--out", "scope/packs"])
        .cwd(root)
        .run()
        .refused("inside the input");
    kvtrail(["verify", "scope"]).cwd(root).run().ok();
    kvtrail(["notify", "scope", "--out", "busy"])
        .cwd(root)
        .run()
        .refused("not empty");
    kvtrail(["notify", "scope", "--out", "packs"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["notify", "scope", "--out", "packs", "--force"])
        .cwd(root)
        .run()
        .ok();
    let v = kvtrail(["verify", "packs"]).cwd(root).run().ok();
    assert!(v.contains("OK:"), "{v}");
    // merge: not over a non-empty folder.
    kvtrail(["scope", "trace", "--pools", "0", "--out", "s0"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["scope", "trace", "--pools", "1", "--out", "s1"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["merge", "s0", "s1", "--out", "busy"])
        .cwd(root)
        .run()
        .refused("not empty");
    kvtrail(["merge", "s0", "s1", "--out", "s0/m"])
        .cwd(root)
        .run()
        .refused("inside the input");
    kvtrail(["merge", "s0", "s1", "--out", "merged"])
        .cwd(root)
        .run()
        .ok();
    // A shard folder verifies: shard.json is in its evidence.json.
    let v = kvtrail(["verify", "s0"]).cwd(root).run().ok();
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
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    kvtrail(["notify", "scope", "--out", "packs"])
        .cwd(root)
        .run()
        .ok();
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
    for cmd in [
        "scope trace --out scope",
        "notify scope --out packs",
        "scope trace --pools 0 --out s0",
        "scope trace --pools 1 --out s1",
        "merge s0 s1 --out merged",
    ] {
        kvtrail(cmd.split(' ')).cwd(root).umask(0).run().ok();
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

fn edit_evidence(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("evidence.json");
    let mut ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut ev);
    std::fs::write(&p, serde_json::to_string(&ev).unwrap()).unwrap();
}

/// A scope folder of `leak("acme", "globex")` under `root/scope`.
fn scope_folder(root: &Path) {
    leak("acme", "globex").record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
}

#[test]
fn evidence_json_with_a_non_hex_blake3_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope_folder(root);
    edit_evidence(&root.join("scope"), |ev| {
        ev["outputs"][0]["blake3"] = format!("a{}", "é".repeat(20)).into();
    });
    for args in [
        &["verify", "scope"][..],
        &["notify", "scope", "--out", "packs"],
        &["lookup", "scope", "--tenant", "acme"],
    ] {
        kvtrail(args).cwd(root).run().refused("outputs[0].blake3");
    }
}

#[test]
fn evidence_json_input_root_naming_its_own_folder_is_refused_not_a_stack_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope_folder(root);
    for (i, bad) in ["", ".", "./", "../scope-3"].iter().enumerate() {
        let d = root.join(format!("scope-{i}"));
        copy_dir(&root.join("scope"), &d);
        edit_evidence(&d, |ev| {
            ev["inputs"].as_array_mut().unwrap().push(
                serde_json::json!({"kind": "scope", "root": bad, "files": [], "problems": []}),
            );
        });
        let name = format!("scope-{i}");
        let err = kvtrail(["verify", &name])
            .cwd(root)
            .run()
            .refused("inputs[1].root");
        assert!(err.len() < 4096, "{} bytes of error", err.len());
        kvtrail(["notify", &name, "--out", &format!("packs-{i}")])
            .cwd(root)
            .run()
            .refused("inputs[1].root");
    }
    // Two folders citing each other: a cycle, found and refused.
    copy_dir(&root.join("scope"), &root.join("a"));
    copy_dir(&root.join("scope"), &root.join("b"));
    for (me, other) in [("a", "../b"), ("b", "../a")] {
        edit_evidence(&root.join(me), |ev| {
            ev["inputs"].as_array_mut().unwrap().push(
                serde_json::json!({"kind": "scope", "root": other, "files": [], "problems": []}),
            );
        });
    }
    kvtrail(["verify", "a"])
        .cwd(root)
        .run()
        .refused("cites itself");
}

#[test]
fn evidence_json_paths_outside_the_folder_are_never_opened() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope_folder(root);
    std::fs::write(root.join("secret"), "not evidence").unwrap();
    let push = |path: &str| {
        let path = path.to_string();
        move |ev: &mut serde_json::Value| {
            let o = ev["outputs"].as_array_mut().unwrap();
            o.push(serde_json::json!({"path": path, "bytes": 1, "blake3": "0".repeat(64)}));
            o.len() - 1
        }
    };
    type Case = Box<dyn Fn(&mut serde_json::Value) -> String>;
    let cases: Vec<Case> = vec![
        Box::new(move |ev| format!("outputs[{}].path", push("/etc/hostname")(ev))),
        Box::new(move |ev| format!("outputs[{}].path", push("../secret")(ev))),
        Box::new(move |ev| format!("outputs[{}].path", push("evidence.json")(ev))),
        Box::new(|ev| {
            ev["inputs"][0]["files"][0]["path"] = "../secret".into();
            "inputs[0].files[0].path".into()
        }),
        Box::new(|ev| {
            ev["inputs"][0]["root"] = "/etc".into();
            "inputs[0].root".into()
        }),
    ];
    for (i, f) in cases.into_iter().enumerate() {
        let name = format!("scope-{i}");
        let d = root.join(&name);
        copy_dir(&root.join("scope"), &d);
        let mut key = String::new();
        edit_evidence(&d, |ev| key = f(ev));
        let err = kvtrail(["verify", &name]).cwd(root).run().refused(&key);
        assert!(!err.contains("blake3 "), "{err}");
    }
}

#[test]
fn lookup_never_names_another_customer_sharing_an_external_id_or_output_hash() {
    let mut tb = leak("acme", "globex");
    for r in &mut tb.requests[..2] {
        r.external_id = Some("chatcmpl-1".into());
        r.output_hash = Some([7; 32]);
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    let hash = "07".repeat(32);
    for q in [
        ["--external-id", "chatcmpl-1"],
        ["--output-hash", hash.as_str()],
    ] {
        for json in [false, true] {
            let mut args = vec!["lookup", "scope", q[0], q[1]];
            if json {
                args.push("--json");
            }
            let out = kvtrail(&args).cwd(root).run().ok();
            for name in ["acme", "globex", "\"request_id\"", "request 1", "request 2"] {
                assert!(!out.contains(name), "lookup {args:?} names {name}: {out}");
            }
            assert!(out.contains("--tenant"), "{out}");
            if json {
                let a: serde_json::Value = serde_json::from_str(&out).unwrap();
                assert_eq!(a["status"], "ambiguous", "{a}");
                assert_eq!(a["matches"], serde_json::json!([]));
            }
        }
        // Restricted to one customer: only that customer's request.
        for (t, id, other) in [("acme", 1, "globex"), ("globex", 2, "acme")] {
            let out = kvtrail(["lookup", "scope", "--json", q[0], q[1], "--tenant", t])
                .cwd(root)
                .run()
                .ok();
            let a: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(a["status"], "affected", "{a}");
            assert_eq!(a["matches"].as_array().unwrap().len(), 1, "{a}");
            assert_eq!(a["matches"][0]["request_id"], id, "{a}");
            assert!(!out.contains(other), "{out}");
        }
        // Another customer's id asked for under a tenant is not found.
        let out = kvtrail([
            "lookup",
            "scope",
            "--json",
            q[0],
            q[1],
            "--tenant",
            "bystander",
        ])
        .cwd(root)
        .run()
        .ok();
        assert!(
            out.contains("\"not_found\"") && !out.contains("acme"),
            "{out}"
        );
    }
}

#[test]
fn a_tenant_named_like_another_tenants_hashed_folder_gets_its_own_pack() {
    let hashed = |t: &str| {
        let set = [t.to_string()].into_iter().collect();
        kvtrail::notify::folder_names(&set)[t].clone()
    };
    let victim = "victim~corp";
    let alias = hashed(victim);
    for other in [alias.clone(), alias.to_ascii_uppercase()] {
        let set: std::collections::BTreeSet<String> =
            [victim.to_string(), other.clone()].into_iter().collect();
        let names = kvtrail::notify::folder_names(&set);
        assert_ne!(
            names[victim].to_ascii_lowercase(),
            names[&other].to_ascii_lowercase(),
            "{names:?}"
        );
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        leak(victim, &other).record(&root.join("trace"));
        kvtrail(["scope", "trace", "--out", "scope"])
            .cwd(root)
            .run()
            .ok();
        let out = kvtrail(["notify", "scope", "--out", "packs"])
            .cwd(root)
            .run()
            .ok();
        assert!(out.contains("2 notification packs"), "{out}");
        for (t, folder) in &names {
            let notice: serde_json::Value = serde_json::from_slice(
                &std::fs::read(
                    root.join("packs/customers")
                        .join(folder)
                        .join("notice.json"),
                )
                .unwrap(),
            )
            .unwrap();
            assert_eq!(notice["customer"], t.as_str());
        }
    }
}

#[cfg(unix)]
#[test]
fn an_output_replaced_by_a_symbolic_link_is_reported_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope_folder(root);
    std::fs::write(root.join("secret"), "not evidence").unwrap();
    let secret = blake3::hash(b"not evidence").to_hex().to_string();
    std::fs::remove_file(root.join("scope/timeline.json")).unwrap();
    std::os::unix::fs::symlink("../secret", root.join("scope/timeline.json")).unwrap();
    let o = kvtrail(["verify", "scope"]).cwd(root).run();
    let out = o.stdout.as_str();
    assert_eq!(o.code, 1, "{out}");
    assert!(
        out.contains("timeline.json") && out.contains("symbolic link"),
        "{out}"
    );
    assert!(!out.contains(&secret[..16]), "the link was followed: {out}");
}

/// `error: ...` then at most one `  hint: ...` line, nothing raw that a
/// terminal would act on.
fn one_error_line(o: &Ran, what: &str) {
    let err = o.stderr.as_str();
    assert_eq!(o.code, 2, "{what}: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        !lines.is_empty()
            && lines.len() <= 2
            && lines[0].starts_with("error: ")
            && lines[1..].iter().all(|l| l.starts_with("  hint: ")),
        "{what}: a quoted path or value forged lines:\n{err}"
    );
    for bad in ['\x1b', '\r', '\u{202e}'] {
        assert!(!err.contains(bad), "{what}: {bad:?} raw in\n{err}");
    }
    assert!(err.contains("\\u{a}"), "{what}: {err}");
}

#[test]
fn a_line_break_in_a_path_or_value_quoted_in_an_error_cannot_forge_error_lines() {
    let forged = "a\n  hint: forged\rerror: forged\x1b[2J\u{202e}";
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join(forged)).unwrap();
    std::fs::write(root.join(forged).join("trace.json"), "{").unwrap();
    leak("acme", "globex").record(&root.join("trace"));
    let missing = format!("missing{forged}");
    for args in [
        vec!["inspect", forged],
        vec!["scope", &missing],
        vec!["verify", &missing],
        vec![
            "replay",
            "trace",
            "--engine",
            "sglang-0.5.22",
            "--out",
            &missing,
            "--set",
            forged,
        ],
        vec![
            "simulate",
            "--scenario",
            "steady",
            "--engine",
            forged,
            "--out",
            "x",
        ],
        vec!["audit", "--deployment", &missing],
        vec![
            "ingest",
            &missing,
            "--deployment",
            "trace/trace.json",
            "--out",
            "t",
        ],
    ] {
        one_error_line(&kvtrail(&args).cwd(root).run(), &args.join(" "));
    }
}

#[test]
fn audit_counterfactual_and_trace_writer_summaries_escape_trace_strings() {
    let spoof = "evil\x1b[2J\x1b[H\rNOT AFFECTED\u{202e}";
    let mut tb = leak("victim", spoof);
    tb.deployment.engine = format!("eng{spoof}");
    tb.deployment.name = format!("dep{spoof}");
    tb.deployment.pools[0].name = format!("pool{spoof}");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    let run = |args: &[&str]| {
        let o = kvtrail(args).cwd(root).run();
        assert_ne!(o.code, 2, "{args:?}: {}", o.stderr.as_str());
        format!("{}{}", o.stdout.as_str(), o.stderr.as_str())
    };
    let sim = format!("sim{spoof}");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/jsonl");
    let outs = [
        ("counterfactual", run(&["counterfactual", "trace"])),
        ("audit", run(&["audit", "trace"])),
        (
            "audit --deployment",
            run(&["audit", "--deployment", "trace/trace.json"]),
        ),
        (
            "simulate",
            run(&[
                "simulate",
                "--scenario",
                "steady",
                "--requests",
                "20",
                "--out",
                &sim,
            ]),
        ),
        (
            "replay",
            run(&["replay", &sim, "--out", &format!("re{spoof}")]),
        ),
        (
            "ingest",
            run(&[
                "ingest",
                data.join("incident.jsonl").to_str().unwrap(),
                "--deployment",
                data.join("deploy.json").to_str().unwrap(),
                "--out",
                &format!("in{spoof}"),
            ]),
        ),
    ];
    for (what, out) in &outs {
        for bad in ['\x1b', '\r', '\u{202e}'] {
            assert!(!out.contains(bad), "{what} prints {bad:?} raw:\n{out}");
        }
        assert!(out.contains("\\u{1b}[2J"), "{what}: {out}");
    }
}

#[test]
fn trace_writers_refuse_a_non_empty_out_folder_or_one_inside_the_input_trace() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/jsonl");
    let jsonl = data.join("incident.jsonl");
    let jsonl = jsonl.to_str().unwrap();
    let sim = |out: &str| {
        kvtrail([
            "simulate",
            "--scenario",
            "steady",
            "--requests",
            "20",
            "--out",
            out,
        ])
        .cwd(root)
        .run()
    };
    sim("t").ok();
    std::fs::create_dir_all(root.join("busy")).unwrap();
    std::fs::write(root.join("busy/notes.txt"), "mine").unwrap();
    // Over someone else's files: refused by every command writing a trace.
    sim("busy").refused("not empty");
    kvtrail(["replay", "t", "--out", "busy"])
        .cwd(root)
        .run()
        .refused("not empty");
    kvtrail([
        "ingest",
        jsonl,
        "--deployment",
        "t/trace.json",
        "--out",
        "busy",
    ])
    .cwd(root)
    .run()
    .refused("not empty");
    assert_eq!(
        std::fs::read_dir(root.join("busy")).unwrap().count(),
        1,
        "nothing was added to the folder"
    );
    // Inside (or equal to) the trace it reads.
    for out in ["t/kv", "t", "t/new/deeper", "./t/../t/x"] {
        kvtrail(["replay", "t", "--out", out])
            .cwd(root)
            .run()
            .refused("inside the input");
        kvtrail([
            "ingest",
            jsonl,
            "--deployment",
            "t/trace.json",
            "--out",
            out,
        ])
        .cwd(root)
        .run()
        .refused("inside the input");
    }
    assert!(!root.join("t/kv/trace.json").exists());
    assert!(!root.join("t/new").exists());
    kvtrail(["verify", "t"]).cwd(root).run().ok();
    // A new or empty folder is fine.
    std::fs::create_dir_all(root.join("empty")).unwrap();
    sim("empty").ok();
    kvtrail(["replay", "t", "--out", "r"]).cwd(root).run().ok();
    kvtrail([
        "ingest",
        jsonl,
        "--deployment",
        "t/trace.json",
        "--out",
        "i",
    ])
    .cwd(root)
    .run()
    .ok();
    kvtrail(["verify", "t"]).cwd(root).run().ok();
}

fn lookup_json(root: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["lookup", "scope", "--json"];
    a.extend_from_slice(args);
    let out = kvtrail(&a).cwd(root).expect(&[0, 1]).run();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{a:?}: {e}: {}", out.stderr))
}

/// The folder's requests.csv rows as `lookup` and `notify` read them.
fn index_rows(dir: &Path) -> Vec<kvtrail::report::lookup_files::IndexRow> {
    let mut rows = Vec::new();
    kvtrail::report::lookup_files::read_index(dir, |r| {
        rows.push(r);
        true
    })
    .unwrap();
    rows
}

#[test]
fn defect4_tenants_that_differ_only_in_a_nul_stay_two_customers() {
    // acme\0's response (request 1) read globex's KV; acme\u{fffd}'s
    // request (2) is a bystander with the same external id.
    let (nul, repl) = ("acme\0", "acme\u{fffd}");
    let mut tb = TraceBuilder::pd();
    tb.req(1, "globex");
    tb.req(2, nul);
    tb.req(3, repl);
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 2);
    for r in &mut tb.requests[1..] {
        r.external_id = Some("chatcmpl-shared".into());
    }
    // The same pair as external ids of one tenant's two requests.
    tb.req(4, "initech").external_id = Some("id\0".into());
    tb.req(5, "initech").external_id = Some("id\u{fffd}".into());
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .expect(&[0, 1])
        .run();
    // Every CSV cell reads back as the trace holds it.
    let rows = index_rows(&root.join("scope"));
    let tenants: Vec<&str> = rows.iter().map(|r| r.tenant.as_str()).collect();
    assert_eq!(tenants, ["globex", nul, repl, "initech", "initech"]);
    let id = |n: usize| rows[n].external_id.as_deref();
    assert_eq!((id(3), id(4)), (Some("id\0"), Some("id\u{fffd}")));
    for f in ["requests.csv", "responses.csv", "tenants.csv"] {
        let bytes = std::fs::read(root.join("scope").join(f)).unwrap();
        assert!(!bytes.contains(&0), "{f} holds a NUL byte");
    }
    // Without --tenant: two customers share the id, counts only.
    let a = lookup_json(root, &["--external-id", "chatcmpl-shared"]);
    assert_eq!(a["status"], "ambiguous", "{a}");
    assert_eq!(a["ambiguous_customers"], 2, "{a}");
    assert_eq!(a["matches"], serde_json::json!([]), "{a}");
    // As acme\u{fffd}: only its own request, which is not affected.
    for q in [
        vec!["--external-id", "chatcmpl-shared", "--tenant", repl],
        vec!["--tenant", repl],
    ] {
        let a = lookup_json(root, &q);
        assert!(
            a["status"].as_str().unwrap().starts_with("not_affected"),
            "{q:?}: {a}"
        );
        for m in a["matches"].as_array().unwrap() {
            assert_eq!(m["request_id"], 3, "{q:?}: {a}");
        }
        assert!(!a.to_string().contains("\\u0000"), "{q:?}: {a}");
    }
    // The ids of one tenant are two ids.
    let a = lookup_json(root, &["--external-id", "id\u{fffd}"]);
    assert_eq!(a["matches"].as_array().unwrap().len(), 1, "{a}");
    assert_eq!(a["matches"][0]["request_id"], 5, "{a}");
    // The notification packs still work and name acme\0 only to itself.
    kvtrail(["notify", "scope", "--out", "packs"])
        .cwd(root)
        .expect(&[0, 1])
        .run();
}

#[test]
fn defect6_an_empty_external_id_is_not_an_absent_one() {
    // Request 2 (external id "") read request 1's KV; request 3 has none.
    let mut tb = leak("acme", "globex");
    tb.requests[0].external_id = Some("chatcmpl-1".into());
    tb.requests[1].external_id = Some(String::new());
    tb.requests[2].external_id = None;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .expect(&[0, 1])
        .run();
    let ids: Vec<Option<String>> = index_rows(&root.join("scope"))
        .into_iter()
        .map(|r| r.external_id)
        .collect();
    assert_eq!(ids, [Some("chatcmpl-1".into()), Some(String::new()), None]);
    // responses.csv keeps the difference too.
    let resp = std::fs::read_to_string(root.join("scope/responses.csv")).unwrap();
    assert!(resp.lines().nth(1).unwrap().starts_with("2,',"), "{resp}");
    let check = |a: &serde_json::Value| {
        assert_eq!(a["status"], "affected", "{a}");
        assert_eq!(a["matches"].as_array().unwrap().len(), 1, "{a}");
        assert_eq!(a["matches"][0]["request_id"], 2, "{a}");
        assert_eq!(a["matches"][0]["external_id"], "", "{a}");
    };
    // Through the look-up index, and by a scan of requests.csv.
    let a = lookup_json(root, &["--external-id="]);
    assert!(a.get("notes").is_none(), "{a}");
    check(&a);
    check(&lookup_json(
        root,
        &["--external-id=", "--tenant", "globex"],
    ));
    let b = lookup_json(root, &["--external-id=", "--tenant", "bystander"]);
    assert_eq!(b["status"], "not_found", "{b}");
    std::fs::remove_file(root.join("scope/requests.index.parquet")).unwrap();
    let a = lookup_json(root, &["--external-id="]);
    assert!(
        a["notes"][0].as_str().unwrap().contains("look-up index"),
        "{a}"
    );
    check(&a);
}
