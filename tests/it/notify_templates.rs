//! Letter templates of `kvtrail notify`, through the binary, on the small
//! incident of tests/it/notify.rs (and its variant with cross-tenant
//! prefix-cache hits under a per-tenant cache):
//!
//! - isolation: the English defaults, the German defaults and a hostile
//!   template that dumps everything it can reach (debug(), every key of
//!   the notice, includes) never name another customer or hold another
//!   customer's ids or hashes; a template that asks for anything beyond
//!   the notice is an error;
//! - the German defaults: German letter, notice.json sentences, marker;
//! - Markdown escaping in one place: a template printing a hostile
//!   external id without any filter gets it escaped;
//! - overrides by file name fall back to the defaults; the defaults
//!   written out by `--write-default-templates` render the same bytes;
//! - bad templates, folders and languages: exit 2, the file, line and
//!   column named, nothing written, an earlier output left intact.

use std::path::Path;

use crate::notify::{CONFIG, assert_packs_are_isolated, files, incident, incident_with_hits};
use crate::support::cli::kvtrail;
use crate::support::trace_builder::TraceBuilder;

/// Records `tb` and runs scope in `root` (relative paths).
fn scope(root: &Path, tb: &TraceBuilder) {
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    std::fs::write(root.join("notify.toml"), CONFIG).unwrap();
}

/// `kvtrail notify scope --out OUT --config notify.toml` plus `extra`.
fn notify(root: &Path, out: &str, extra: &[&str]) -> crate::support::cli::Ran {
    let mut a = vec!["notify", "scope", "--out", out, "--config", "notify.toml"];
    a.extend_from_slice(extra);
    kvtrail(&a).cwd(root).run()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

/// A template that tries to reach everything: the whole context through
/// debug(), every key and value of the notice, the other templates, and
/// loops over whatever is iterable.
const HOSTILE: &str = r#"{{ debug() }}
{% for k, v in notice|items %}{{ k }}={{ v }}
{% endfor %}
{% for k in notice.incident %}{{ k }}={{ notice.incident[k] }}
{% endfor %}
{% for k in notice.evidence %}{{ k }}={{ notice.evidence[k] }}
{% endfor %}
{{ notice.customer }} {{ lang }} {{ range(3)|list }} {{ namespace() }}
{% include "processor-notice.md.j2" %}
"#;

#[test]
fn no_template_names_another_customer_english_german_or_hostile() {
    let hostile = tempfile::tempdir().unwrap();
    std::fs::write(hostile.path().join("letter.md.j2"), HOSTILE).unwrap();
    let hostile_dir = hostile.path().to_str().unwrap();
    for (name, tb) in [
        ("incident", incident()),
        (
            "incident with prefix-cache breaches",
            incident_with_hits(Some(kvtrail::trace::manifest::PrefixCacheScope::Tenant)),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        scope(root, &tb);
        for (out, extra) in [
            ("en", vec![]),
            ("de", vec!["--lang", "de"]),
            ("hostile", vec!["--templates", hostile_dir]),
            (
                "hostile-de",
                vec!["--lang", "de", "--templates", hostile_dir],
            ),
        ] {
            notify(root, out, &extra).ok();
            assert_packs_are_isolated(&root.join(out).join("customers"), &tb);
        }
        // The hostile template did dump what it could reach: its own
        // customer's notice, ids included (so the check above can fail).
        let umbrella = read(&root.join("hostile/customers/umbrella/letter.md"));
        assert!(umbrella.contains("customer"), "{name}: {umbrella}");
        assert!(
            umbrella.contains("received\\_responses"),
            "{name}: {umbrella}"
        );
        let r5 = tb.requests.iter().find(|r| r.request_id == 5).unwrap();
        let own = kvtrail::schema::hex32(r5.output_hash.as_ref().unwrap());
        assert!(umbrella.contains(&own), "{name}: {umbrella}");
        assert!(umbrella.contains("chatcmpl-"), "{name}: {umbrella}");
    }
}

#[test]
fn a_template_asking_for_more_than_the_notice_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    for probe in [
        "{{ customers }}",
        "{{ packs }}",
        "{{ summary }}",
        "{{ register }}",
        "{{ notice.other_customers }}",
        "{{ self }}",
    ] {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("letter.md.j2"), format!("ok\n{probe}\n")).unwrap();
        let o = notify(root, "out", &["--templates", t.path().to_str().unwrap()]);
        assert_eq!(o.code, 2, "{probe}: {}", o.stderr);
        let err = o.stderr.as_str();
        assert!(
            err.contains("letter.md.j2") && err.contains("line 2") && err.contains("undefined"),
            "{probe}: {err}"
        );
        assert!(!root.join("out").exists(), "{probe}: output written");
    }
}

#[test]
fn german_defaults_are_german_with_the_same_facts() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    notify(root, "en", &[]).ok();
    notify(root, "de", &["--lang", "de"]).ok();
    let c = "customers/acme-corp";
    let letter = read(&root.join("de").join(c).join("letter.md"));
    for want in [
        "# Benachrichtigung über eine Verletzung des Schutzes personenbezogener Daten",
        "Art. 33 Abs. 3 DSGVO",
        "Aufsichtsbehörde",
        "- An: acme-corp",
        "Example Inference GmbH",
        "INC-2026-0042",
        "Zwischen 2026-09-01 05:00:04.000 UTC und 2026-09-01 07:00:04.000 UTC wurden 3 Antworten",
        // The service name, escaped by the one Markdown formatter.
        "glm-mini / \\<b\\>workers\\</b\\>",
        "| `chatcmpl-b7890e7019b8` | 6 | 2026-09-01 06:00:00.000 UTC | 200 |",
        "| ja | bestätigt |",
        "die Ihr Konto betrifft. Sie betrifft beide Seiten: Antworten, die Sie erhalten haben,",
        "Mit freundlichen Grüßen",
    ] {
        assert!(letter.contains(want), "{want}\n{letter}");
    }
    let processor = read(&root.join("de").join(c).join("processor-notice.md"));
    for want in [
        "Auftragsverarbeiter",
        "Verantwortlicher",
        "Art. 33 Abs. 2 DSGVO",
        "72 Stunden",
    ] {
        assert!(processor.contains(want), "{want}\n{processor}");
    }
    // Same facts: notice.json differs only in its sentences.
    let en: serde_json::Value =
        serde_json::from_str(&read(&root.join("en").join(c).join("notice.json"))).unwrap();
    let de: serde_json::Value =
        serde_json::from_str(&read(&root.join("de").join(c).join("notice.json"))).unwrap();
    for k in [
        "roles",
        "records",
        "received_responses",
        "exposed_requests",
        "incident",
        "evidence",
        "contact",
        "confirmed",
        "possible",
        "time_window",
    ] {
        assert_eq!(en[k], de[k], "{k}");
    }
    assert!(
        de["nature"].as_str().unwrap().starts_with("Zwischen"),
        "{}",
        de["nature"]
    );
    let reg = read(&root.join("de/register.json"));
    assert!(reg.contains("personenbezogener Daten"), "{reg}");
    // The same customers and files.
    assert_eq!(files(&root.join("en")), files(&root.join("de")));
}

#[test]
fn the_register_entry_is_rendered_from_its_template_in_each_language() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(
        root,
        &incident_with_hits(Some(kvtrail::trace::manifest::PrefixCacheScope::Tenant)),
    );
    notify(root, "en", &[]).ok();
    notify(root, "de", &["--lang", "de"]).ok();
    let json: serde_json::Value =
        serde_json::from_str(&read(&root.join("en/register.json"))).unwrap();
    let en = read(&root.join("en/register.md"));
    let de = read(&root.join("de/register.md"));
    let n = |k: &str| json[k].as_u64().unwrap().to_string();
    for want in [
        "# Breach register entry (Article 33(5) GDPR)".to_string(),
        "- Incident: INC-2026-0042".into(),
        "- Data protection contact: Dr. Erika Muster, dpo@example-inference.eu".into(),
        format!(
            "- Affected responses: {} ({} confirmed, {} possible); {} of them carried another customer's data.",
            n("affected_responses"),
            n("confirmed_responses"),
            n("possible_responses"),
            n("cross_customer_responses")
        ),
        format!(
            "- Customers concerned: {} on the receiving side",
            n("recipient_customers")
        ),
        "each hit is a prefix-cache isolation breach".into(),
        format!(
            "- Scope folder evidence digest (blake3 of its evidence.json): `{}`",
            json["evidence"]["scope_evidence_blake3"].as_str().unwrap()
        ),
        // Escaped by the one Markdown formatter.
        "glm-mini / \\<b\\>workers\\</b\\>".into(),
    ] {
        assert!(en.contains(&want), "{want}\n{en}");
    }
    for p in json["notification_packs"].as_array().unwrap() {
        assert!(
            en.contains(&format!("- `{}`", p.as_str().unwrap())),
            "{p}\n{en}"
        );
    }
    for want in [
        "# Eintrag im Verzeichnis der Datenschutzverletzungen (Art. 33 Abs. 5 DSGVO)",
        "## Ergriffene Maßnahmen",
        "Verletzung der Trennung des Präfix-Caches",
        "die Nachweise sind vollständig",
    ] {
        assert!(de.contains(want), "{want}\n{de}");
    }
    // An operator's own register template replaces the default; the
    // letters stay the built-in ones.
    let own = root.join("own");
    std::fs::create_dir(&own).unwrap();
    std::fs::write(
        own.join("register.md.j2"),
        "{{ register.incident_id }}: {{ register.affected_responses }} responses, packs {{ register.notification_packs|length }}, prefix cache {{ register.prefix_cache is not none }}\n",
    )
    .unwrap();
    notify(root, "mine", &["--templates", "own"]).ok();
    assert_eq!(
        read(&root.join("mine/register.md")),
        format!(
            "INC-2026-0042: {} responses, packs {}, prefix cache True\n",
            n("affected_responses"),
            json["notification_packs"].as_array().unwrap().len()
        )
    );
    assert_eq!(
        read(&root.join("mine/customers/acme-corp/letter.md")),
        read(&root.join("en/customers/acme-corp/letter.md"))
    );
    // Without prefix-cache hits the entry has none, and says nothing of them.
    let plain = tempfile::tempdir().unwrap();
    scope(plain.path(), &incident());
    notify(plain.path(), "en", &[]).ok();
    let reg = read(&plain.path().join("en/register.md"));
    assert!(!reg.contains("prefix-cache"), "{reg}");
    // A register template asking for a customer's notice: exit 2, nothing written.
    std::fs::write(own.join("register.md.j2"), "{{ notice.customer }}\n").unwrap();
    let r = kvtrail([
        "notify",
        "scope",
        "--out",
        "bad",
        "--config",
        "notify.toml",
        "--templates",
        "own",
    ])
    .cwd(root)
    .expect(&[2])
    .run();
    assert!(r.stderr.contains("register.md.j2"), "{}", r.stderr);
    assert!(!root.join("bad").exists());
}

#[test]
fn missing_config_fields_show_a_marker_in_each_language() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    for (lang, marker) in [("en", "[to fill in: "), ("de", "[bitte ergänzen: ")] {
        let o = kvtrail(["notify", "scope", "--out", lang, "--lang", lang])
            .cwd(root)
            .run();
        o.ok();
        assert!(o.stderr.as_str().contains(marker), "{}", o.stderr);
        let letter = read(&root.join(lang).join("customers/globex/letter.md"));
        // The marker's brackets are escaped like any other value.
        let m = marker.replace('[', "\\[");
        for f in [
            "operator_name",
            "dpo_contact",
            "incident_id",
            "became_aware",
            "measures",
        ] {
            assert!(
                letter.contains(&format!("{m}{} in notify.toml\\]", f.replace('_', "\\_"))),
                "{lang} {f}\n{letter}"
            );
        }
    }
}

#[test]
fn markdown_escaping_cannot_be_forgotten_and_overrides_fall_back_to_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    notify(root, "default", &[]).ok();
    let t = tempfile::tempdir().unwrap();
    std::fs::write(
        t.path().join("letter.md.j2"),
        "To {{ notice.customer }}:\n{% for r in notice.received_responses %}- {{ r.external_id }} / {{ r.external_id|code }}\n{% endfor %}",
    )
    .unwrap();
    std::fs::write(t.path().join("README.txt"), "not a template").unwrap();
    notify(root, "custom", &["--templates", t.path().to_str().unwrap()]).ok();
    let letter = read(&root.join("custom/customers/umbrella/letter.md"));
    // Request 5's external id: `chatcmpl-<i>5</i>|`x`,"q"`, printed bare.
    assert_eq!(
        letter,
        "To umbrella:\n- chatcmpl-\\<i\\>5\\</i\\>\\|\\`x\\`,\"q\" / ``chatcmpl-<i>5</i>\\|`x`,\"q\"``\n",
    );
    // The templates not given are the defaults: same bytes.
    for f in files(&root.join("default")) {
        if f.ends_with("letter.md") || f == "evidence.json" {
            continue;
        }
        assert_eq!(
            read(&root.join("default").join(&f)),
            read(&root.join("custom").join(&f)),
            "{f}"
        );
    }
}

#[test]
fn written_defaults_render_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    for lang in ["en", "de"] {
        let tdir = root.join(format!("templates-{lang}"));
        kvtrail([
            "notify",
            "--write-default-templates",
            tdir.to_str().unwrap(),
            "--lang",
            lang,
        ])
        .run()
        .ok();
        for name in kvtrail::notify::templates::NAMES {
            let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("templates/notify")
                .join(lang)
                .join(name);
            assert_eq!(read(&tdir.join(name)), read(&repo), "{lang}/{name}");
        }
        // Never over existing templates.
        let o = kvtrail([
            "notify",
            "--write-default-templates",
            tdir.to_str().unwrap(),
        ])
        .run();
        assert_eq!(o.code, 2, "{}", o.stderr);
        let a = format!("builtin-{lang}");
        let b = format!("written-{lang}");
        notify(root, &a, &["--lang", lang]).ok();
        notify(
            root,
            &b,
            &["--lang", lang, "--templates", tdir.to_str().unwrap()],
        )
        .ok();
        for f in files(&root.join(&a)) {
            if f == "evidence.json" {
                continue;
            }
            assert_eq!(
                read(&root.join(&a).join(&f)),
                read(&root.join(&b).join(&f)),
                "{lang}: {f}"
            );
        }
    }
}

#[test]
fn bad_templates_folders_and_languages_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope(root, &incident());
    let t = tempfile::tempdir().unwrap();
    let tp = t.path().to_str().unwrap();
    // A syntax error: file, line and column named.
    std::fs::write(
        t.path().join("processor-notice.md.j2"),
        "# Notice\n\nTo {{ notice.customer }}\n{% if notice.roles %}\nunclosed\n",
    )
    .unwrap();
    let o = notify(root, "out", &["--templates", tp]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let err = o.stderr.as_str();
    assert!(
        err.contains("processor-notice.md.j2")
            && err.contains("line ")
            && err.contains("column ")
            && err.contains("syntax error"),
        "{err}"
    );
    assert!(!root.join("out").exists());
    std::fs::remove_file(t.path().join("processor-notice.md.j2")).unwrap();
    // A syntax error in the middle of a line: its column.
    std::fs::write(
        t.path().join("letter.md.j2"),
        "a\nb {{ notice.customer + }} c\n",
    )
    .unwrap();
    let o = notify(root, "out", &["--templates", tp]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.as_str().contains("line 2, column"), "{}", o.stderr);
    // A misspelt template name would leave the default in use silently.
    std::fs::remove_file(t.path().join("letter.md.j2")).unwrap();
    std::fs::write(t.path().join("leter.md.j2"), "x").unwrap();
    let o = notify(root, "out", &["--templates", tp]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.as_str().contains("leter.md.j2"), "{}", o.stderr);
    std::fs::remove_file(t.path().join("leter.md.j2")).unwrap();
    // An unreadable folder and an unknown language.
    let o = notify(root, "out", &["--templates", "no-such-folder"]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.as_str().contains("no-such-folder"), "{}", o.stderr);
    let o = notify(root, "out", &["--lang", "fr"]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.as_str().contains("fr"), "{}", o.stderr);
    // A template that would run for ever runs out of fuel; one that writes
    // without end is stopped at the output cap. Both within seconds.
    for (t_src, why) in [
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% set x = a %}{% endfor %}{% endfor %}",
            "out of fuel",
        ),
        (
            "{% for a in range(100000) %}{% for b in range(100) %}{{ 'x' * 100000 }}{% endfor %}{% endfor %}",
            "MiB",
        ),
    ] {
        std::fs::write(t.path().join("letter.md.j2"), t_src).unwrap();
        let start = std::time::Instant::now();
        let o = notify(root, "out", &["--templates", tp]);
        assert_eq!(o.code, 2, "{}", o.stderr);
        assert!(o.stderr.as_str().contains(why), "{}", o.stderr);
        assert!(start.elapsed().as_secs() < 60, "{:?}", start.elapsed());
        assert!(!root.join("out").exists());
    }
    // With --force, a failing template leaves the earlier output intact.
    notify(root, "packs", &[]).ok();
    std::fs::write(t.path().join("letter.md.j2"), "{{ nope }}\n").unwrap();
    let o = notify(root, "packs", &["--force", "--templates", tp]);
    assert_eq!(o.code, 2);
    let v = kvtrail(["verify", "packs"]).cwd(root).run();
    assert_eq!(v.code, 0, "{}", v.stdout);
}
