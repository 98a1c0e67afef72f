//! Cross-tenant prefix-cache hits (`cross_tenant_shared`) in scope's
//! outputs and in lookup: with `prefix_cache_scope = "tenant"` they are
//! isolation findings (exit code, report.html section, lookup says
//! AFFECTED), without it information only; findings.parquet lists them
//! either way, as rows of kind `prefix_cache`.

use std::path::{Path, PathBuf};

use arrow_array::{Array, BooleanArray, StringArray, UInt64Array};
use kvtrail::trace::manifest::PrefixCacheScope;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::support::cli::{kvtrail, s};
use crate::support::trace_builder::TraceBuilder;

/// r1 acme caches a 4-token prefix; r2 globex (another customer) is served
/// from it. With `foreign`, r4 initech also reads r3 umbrella's KV without
/// a grant (a foreign read).
fn trace(scope: Option<PrefixCacheScope>, foreign: bool) -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.deployment.prefix_cache_scope = scope;
    tb.req(1, "acme");
    tb.req(2, "globex");
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    if foreign {
        tb.req(3, "umbrella");
        tb.req(4, "initech");
        tb.write(0, 3, 10, 4);
        tb.read(0, 4, 10, 4);
    }
    tb
}

fn scope_out(dir: &Path, tb: &TraceBuilder) -> PathBuf {
    let t = tb.record(&dir.join("trace"));
    let out = dir.join("scope");
    kvtrail(["scope", s(&t), "--out", s(&out)]).run().ok();
    out
}

#[test]
fn fail_on_exposure_counts_hits_only_under_tenant_scope() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("t", Some(PrefixCacheScope::Tenant), 1),
        ("g", Some(PrefixCacheScope::Global), 0),
        ("n", None, 0),
    ];
    for (name, scope, want) in cases {
        let t = trace(scope, false).record(&dir.path().join(name));
        let o = kvtrail(["scope", s(&t), "--fail-on-exposure"]).run();
        assert_eq!(o.code, want, "{scope:?}\n{}\n{}", o.stdout, o.stderr);
        let o = kvtrail(["scope", s(&t)]).run();
        assert_eq!(o.code, 0, "{scope:?}");
    }
}

fn strings(b: &arrow_array::RecordBatch, c: &str) -> Vec<Option<String>> {
    let a = b
        .column_by_name(c)
        .unwrap()
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap();
    (0..a.len())
        .map(|i| (!a.is_null(i)).then(|| a.value(i).to_string()))
        .collect()
}

fn u64s(b: &arrow_array::RecordBatch, c: &str) -> Vec<Option<u64>> {
    let a = b
        .column_by_name(c)
        .unwrap()
        .as_any()
        .downcast_ref::<UInt64Array>()
        .unwrap();
    (0..a.len())
        .map(|i| (!a.is_null(i)).then(|| a.value(i)))
        .collect()
}

#[test]
fn findings_parquet_has_a_kind_column_with_prefix_cache_rows() {
    for scope in [Some(PrefixCacheScope::Tenant), None] {
        let dir = tempfile::tempdir().unwrap();
        let out = scope_out(dir.path(), &trace(scope, true));
        let f = std::fs::File::open(out.join("findings.parquet")).unwrap();
        let r = ParquetRecordBatchReaderBuilder::try_new(f)
            .unwrap()
            .build()
            .unwrap();
        let batches: Vec<_> = r.map(|b| b.unwrap()).collect();
        let b = arrow_select::concat::concat_batches(&batches[0].schema(), &batches).unwrap();
        let names: Vec<String> = b
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            names,
            [
                "request_id",
                "external_id",
                "tenant",
                "http_status",
                "source_request_id",
                "source_tenant",
                "tokens",
                "first_seq",
                "last_seq",
                "cross_tenant",
                "confidence",
                "kind"
            ]
        );
        let kind = strings(&b, "kind");
        assert_eq!(
            kind,
            [Some("foreign".into()), Some("prefix_cache".into())],
            "{scope:?}"
        );
        assert_eq!(u64s(&b, "request_id"), [Some(4), Some(2)]);
        assert_eq!(u64s(&b, "source_request_id"), [Some(3), Some(1)]);
        assert_eq!(u64s(&b, "tokens"), [Some(4), Some(4)]);
        assert_eq!(u64s(&b, "first_seq")[1], None);
        assert_eq!(
            strings(&b, "tenant"),
            [Some("initech".into()), Some("globex".into())]
        );
        assert_eq!(strings(&b, "source_tenant")[1], Some("acme".into()));
        assert_eq!(strings(&b, "confidence")[1], Some("confirmed".into()));
        let cross = b
            .column_by_name("cross_tenant")
            .unwrap()
            .as_any()
            .downcast_ref::<BooleanArray>()
            .unwrap()
            .value(1);
        assert!(cross);
    }
}

#[test]
fn report_html_has_a_prefix_cache_section_only_when_there_are_hits() {
    let html = |scope, hits: bool| {
        let dir = tempfile::tempdir().unwrap();
        let tb = if hits {
            trace(scope, false)
        } else {
            let mut tb = TraceBuilder::pd();
            tb.deployment.prefix_cache_scope = scope;
            tb.req(1, "acme");
            tb.write(0, 1, 0, 4);
            tb.read(0, 1, 0, 4);
            tb
        };
        std::fs::read_to_string(scope_out(dir.path(), &tb).join("report.html")).unwrap()
    };
    let t = html(Some(PrefixCacheScope::Tenant), true);
    assert!(t.contains("<h2 id=\"prefix-cache\">Prefix-cache isolation breaches</h2>"));
    assert!(t.contains("id=\"prefix-cache-hits\""));
    assert!(t.contains("acme: 4 (request 1)"), "{t}");
    assert!(t.contains("<div class=\"verdict bad\""));
    let g = html(Some(PrefixCacheScope::Global), true);
    assert!(g.contains("Cross-tenant prefix-cache hits (information)"));
    assert!(!g.contains("Prefix-cache isolation breaches"));
    assert!(!g.contains("<div class=\"verdict bad\""));
    for scope in [Some(PrefixCacheScope::Tenant), None] {
        let n = html(scope, false);
        assert!(!n.contains("prefix-cache"), "{scope:?}");
    }
}

#[test]
fn report_html_escapes_names_in_the_prefix_cache_section() {
    let dir = tempfile::tempdir().unwrap();
    let mut tb = TraceBuilder::pd();
    tb.deployment.prefix_cache_scope = Some(PrefixCacheScope::Tenant);
    tb.req(1, "<script>alert(1)</script>").external_id = Some("<b>x</b>".into());
    tb.req(2, "a&b\"c").external_id = Some("<i>y</i>".into());
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    let html = std::fs::read_to_string(scope_out(dir.path(), &tb).join("report.html")).unwrap();
    assert!(html.contains("Prefix-cache isolation breaches"));
    for raw in ["<script>alert", "<b>x</b>", "<i>y</i>", "a&b\"c"] {
        assert!(!html.contains(raw), "{raw} unescaped");
    }
}

fn lookup(out: &Path, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["lookup", s(out), "--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&kvtrail(&a).run().ok()).unwrap()
}

#[test]
fn lookup_answers_prefix_cache_hits_by_scope_and_never_names_the_other_side() {
    let dir = tempfile::tempdir().unwrap();
    let out = scope_out(dir.path(), &trace(Some(PrefixCacheScope::Tenant), false));
    // The reader.
    let a = lookup(&out, &["--external-id", "ext-2"]);
    assert_eq!(a["status"], "affected", "{a}");
    assert!(
        a["message"]
            .as_str()
            .unwrap()
            .starts_with("AFFECTED (prefix-cache isolation breach)"),
        "{a}"
    );
    let m = &a["matches"][0];
    assert_eq!(m["affected"], true);
    assert_eq!(m["prefix_cache"]["kind"], "prefix_cache_isolation_breach");
    assert_eq!(m["prefix_cache"]["as_reader"]["tokens"], 4);
    assert_eq!(m["prefix_cache"]["as_reader"]["source_requests"], 1);
    assert!(!a.to_string().contains("acme"), "{a}");
    // The source.
    let a = lookup(&out, &["--external-id", "ext-1"]);
    assert_eq!(a["status"], "affected", "{a}");
    assert_eq!(a["matches"][0]["prefix_cache"]["as_source"]["responses"], 1);
    assert!(!a.to_string().contains("globex"), "{a}");
    // Per tenant.
    let a = lookup(&out, &["--tenant", "globex"]);
    assert_eq!(a["matches"].as_array().unwrap().len(), 1, "{a}");
    // The text answer.
    let text = kvtrail(["lookup", s(&out), "--external-id", "ext-2"])
        .run()
        .ok();
    assert!(text.contains("prefix-cache isolation breach"), "{text}");
    assert!(!text.contains("acme"), "{text}");

    // Global scope: information, not affected.
    let dir = tempfile::tempdir().unwrap();
    let out = scope_out(dir.path(), &trace(Some(PrefixCacheScope::Global), false));
    let a = lookup(&out, &["--external-id", "ext-2"]);
    assert_eq!(a["status"], "not_affected", "{a}");
    assert!(
        a["message"].as_str().unwrap().contains("Information: 1"),
        "{a}"
    );
    assert_eq!(a["matches"][0]["affected"], false);
    assert_eq!(a["matches"][0]["prefix_cache"]["kind"], "information");
    assert!(!a.to_string().contains("acme"), "{a}");
    let text = kvtrail(["lookup", s(&out), "--external-id", "ext-2"])
        .run()
        .ok();
    assert!(text.contains("(information)"), "{text}");
}

#[test]
fn lookup_without_hits_has_no_prefix_cache_field() {
    let dir = tempfile::tempdir().unwrap();
    let out = scope_out(dir.path(), &trace(Some(PrefixCacheScope::Tenant), true));
    let a = lookup(&out, &["--external-id", "ext-4"]);
    assert_eq!(a["status"], "affected");
    assert!(a["matches"][0].get("prefix_cache").is_none(), "{a}");
    assert!(
        a["message"].as_str().unwrap().starts_with("AFFECTED: "),
        "{a}"
    );
}
