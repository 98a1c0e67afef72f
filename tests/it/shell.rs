//! Shell conventions through the binary: completion scripts that the
//! shells parse, manual pages that render, and `NO_COLOR`.

use std::path::Path;
use std::process::Command;

use crate::support::cli::kvtrail;

/// Every subcommand `kvtrail --help` lists.
fn subcommands() -> Vec<String> {
    let help = kvtrail(["--help"]).run().ok();
    let mut in_list = false;
    let mut v = Vec::new();
    for line in help.lines() {
        if line.starts_with("Commands:") {
            in_list = true;
            continue;
        }
        if in_list {
            match line.split_whitespace().next() {
                Some(w) if line.starts_with("  ") => {
                    if w != "help" {
                        v.push(w.to_string());
                    }
                }
                _ => break,
            }
        }
    }
    assert!(v.len() >= 15, "subcommands from --help: {v:?}");
    v
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `tool args.. file` and asserts success.
fn parses(tool: &str, args: &[&str], file: &Path) {
    let o = Command::new(tool).args(args).arg(file).output().unwrap();
    assert!(
        o.status.success(),
        "{tool} rejects {}: {}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn completion_scripts_parse_and_name_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let subs = subcommands();
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef kvtrail"),
        ("fish", "complete -c kvtrail"),
    ] {
        let script = kvtrail(["completions", shell]).run().ok();
        assert!(script.contains(marker), "{shell}: no {marker:?}");
        for s in &subs {
            assert!(script.contains(s.as_str()), "{shell}: no subcommand {s}");
        }
        assert!(script.contains("--external-id"), "{shell}: flags missing");
        let f = dir.path().join(format!("kvtrail.{shell}"));
        std::fs::write(&f, &script).unwrap();
        match shell {
            // bash is always there: the script must parse.
            "bash" => parses("bash", &["-n"], &f),
            "zsh" if have("zsh") => parses("zsh", &["-n"], &f),
            "fish" if have("fish") => parses("fish", &["--no-execute"], &f),
            _ => {}
        }
    }
    // bash: sourcing it registers the completion function for kvtrail.
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {} && complete -p kvtrail",
            dir.path().join("kvtrail.bash").display()
        ))
        .output()
        .unwrap();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("kvtrail"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let bad = kvtrail(["completions", "powershell"]).expect(&[2]).run();
    assert!(bad.stderr.contains("bash") && bad.stderr.contains("fish"));
}

/// The roff skeleton every page has.
fn check_roff(page: &str, name: &str) {
    assert!(
        page.starts_with(".ie") || page.contains(".TH"),
        "{name}: no .TH"
    );
    let th = page.lines().find(|l| l.starts_with(".TH")).unwrap();
    assert!(th.contains(name), "{name}: {th}");
    for sec in [".SH NAME", ".SH SYNOPSIS", ".SH DESCRIPTION"] {
        assert!(page.contains(sec), "{name}: no {sec}");
    }
}

/// Renders a page with groff (or man) when present, else checks its roff.
fn renders(path: &Path, name: &str, must_say: &str) {
    let page = std::fs::read_to_string(path).unwrap();
    check_roff(&page, name);
    if have("groff") {
        let o = Command::new("groff")
            .args(["-man", "-Tutf8", "-ww", "-z"])
            .arg(path)
            .output()
            .unwrap();
        assert!(o.status.success(), "groff: {name}");
        assert!(
            o.stderr.is_empty(),
            "groff warns on {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let o = Command::new("groff")
            .args(["-man", "-Tutf8"])
            .arg(path)
            .env("GROFF_NO_SGR", "1")
            .output()
            .unwrap();
        // groff overstrikes bold and underlined text (`X\bX`, `_\bX`):
        // keep what follows each backspace, then compare letters only.
        let chars: Vec<char> = String::from_utf8_lossy(&o.stdout).chars().collect();
        let mut plain = String::new();
        let mut i = 0;
        while i < chars.len() {
            if chars.get(i + 1) == Some(&'\x08') {
                i += 2;
                continue;
            }
            if chars[i].is_alphanumeric() || chars[i] == ' ' {
                plain.push(chars[i]);
            }
            i += 1;
        }
        let want: String = must_say
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ')
            .collect();
        assert!(plain.contains(&want), "{name} renders without {must_say:?}");
    }
}

#[test]
fn man_pages_render_for_kvtrail_and_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let top = kvtrail(["man"]).run().ok();
    let p = dir.path().join("stdout.1");
    std::fs::write(&p, &top).unwrap();
    renders(&p, "kvtrail", "Record and replay forensics");
    let out = dir.path().join("man1");
    kvtrail(["man", "--out"]).arg(&out).run().ok();
    assert_eq!(std::fs::read_to_string(out.join("kvtrail.1")).unwrap(), top);
    for s in subcommands() {
        let name = format!("kvtrail-{s}");
        renders(&out.join(format!("{name}.1")), &name, "SYNOPSIS");
    }
    renders(
        &out.join("kvtrail-lookup.1"),
        "kvtrail-lookup",
        "--external-id",
    );
}

#[test]
fn no_color_turns_off_clap_colours_even_when_forced() {
    // A parse error and the help, with colour forced on.
    for args in [&["lookup", "--bogus"][..], &["scope", "--help"][..]] {
        let forced = kvtrail(args.iter().copied())
            .env("CLICOLOR_FORCE", "1")
            .expect(&[0, 2])
            .run();
        let both = format!("{}{}", forced.stdout, forced.stderr);
        assert!(both.contains('\x1b'), "{args:?}: colour was not forced on");
        let plain = kvtrail(args.iter().copied())
            .env("CLICOLOR_FORCE", "1")
            .env("NO_COLOR", "1")
            .expect(&[0, 2])
            .run();
        let both = format!("{}{}", plain.stdout, plain.stderr);
        assert!(!both.contains('\x1b'), "{args:?} under NO_COLOR: {both:?}");
        assert!(both.contains("Usage"), "{args:?}: {both}");
    }
}
