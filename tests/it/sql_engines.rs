//! `kvtrail sql` checked on real engines: every rule trace of the scope
//! tests (plus SQL-specific ones: deep copy chains, late stream starts,
//! copies past the end, engine-owned KV; and the revision-2 ones: stale
//! content, grants, copies carrying staleness, tier round trips) is run
//! through the DuckDB dialect and, on a smaller set, through the Spark
//! dialect on local Spark, and the result views must equal `kvtrail scope`
//! (affected responses with per-source tokens, recipients, sources, blank
//! reads, gaps, coverage) and the native replay's cross-tenant shared reads.
//!
//! The engines come from the venv built by .ci/setup.d/50-sql.sh
//! (`${KVTRAIL_SQL_VENV:-${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-sql}`).
//! Without it the tests FAIL when `CI` is set, and say they skip otherwise.
//! incident-mini (161k events, 44M slot touches) runs through DuckDB; the
//! Trino dialect runs through sqlglot's Trino grammar transpiled to DuckDB
//! (no Trino server here), on every rule trace.
//!
//! Hostile `--trace-path` values are checked statically for every dialect
//! (the script's statements and keywords are those of a benign path) and
//! on the engines (a folder or schema name with quotes, `;` and `--` reads
//! as data); tenants named like the markers stay tenants.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvtrail::scope::{ScopeReport, Tenant};
use kvtrail::sql::{Dialect, SqlOptions, generate};
use kvtrail::trace::{Manifest, Role};
use serde_json::Value;

use crate::support::cli;
use crate::support::trace_builder::{TraceBuilder, pool, scope};
use crate::support::venv;

// ---------------------------------------------------------------- traces

fn pd() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.req(3, "umbrella");
    tb
}

/// The rule traces of scope_semantics.rs, and a few the SQL needs.
fn traces() -> Vec<(&'static str, TraceBuilder)> {
    let mut v = Vec::new();
    let mut tb = pd();
    tb.alloc(0, 1, 0, 4);
    tb.write(0, 1, 0, 4);
    tb.read(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    v.push(("own_read", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    v.push(("shared_read", tb));

    let mut tb = pd();
    tb.alloc(0, 1, 0, 4);
    tb.read(0, 1, 0, 4);
    v.push(("never_written_blank", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 6);
    tb.free(0, 1, 0, 6);
    tb.alloc(0, 2, 0, 6);
    tb.write(0, 2, 0, 1);
    tb.read(0, 2, 0, 6);
    tb.read(0, 2, 0, 6);
    v.push(("foreign_freed", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.share(0, 2, 0, 4);
    tb.write(0, 3, 2, 2);
    tb.read(0, 2, 0, 4);
    v.push(("grant_broken_by_rewrite", tb));

    let mut tb = pd();
    tb.share(0, 2, 0, 4);
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 4);
    v.push(("grant_before_write", tb));

    let mut tb = pd();
    let s = tb.write(0, 1, 0, 4);
    tb.copy(1, 1, 10, 4, 0, 0, s);
    tb.read(1, 1, 10, 4);
    v.push(("own_copy", tb));

    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 32),
        pool(1, Role::Mixed, 32),
        pool(2, Role::Decode, 32),
    ]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    let s0 = tb.write(0, 1, 0, 4);
    let s1 = tb.copy(1, 1, 4, 4, 0, 0, s0);
    tb.write(1, 2, 4, 1);
    tb.copy(2, 2, 8, 4, 1, 4, s1);
    tb.read(2, 2, 8, 4);
    v.push(("copy_of_a_copy", tb));

    let mut tb = pd();
    let s1 = tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    let s2 = tb.write(0, 2, 0, 2);
    tb.copy(1, 1, 8, 4, 0, 0, s2);
    tb.copy(1, 3, 16, 4, 0, 0, s1);
    tb.read(1, 1, 8, 4);
    tb.read(1, 3, 16, 4);
    v.push(("copy_from_reused_source", tb));

    let mut tb = pd();
    let a = tb.write(0, 1, 0, 4);
    let b = tb.write(0, 2, 0, 4);
    tb.copy(1, 2, 8, 4, 0, 0, b);
    tb.copy(1, 1, 16, 4, 0, 0, a);
    tb.read(1, 1, 16, 4);
    tb.read(1, 2, 8, 4);
    v.push(("copies_out_of_order", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    tb.scrub(0, 0, 4);
    tb.alloc(0, 2, 0, 4);
    tb.read(0, 2, 0, 4);
    v.push(("scrub_blank", tb));

    let mut tb = pd();
    tb.req(4, "acme");
    tb.write(0, 1, 0, 3);
    tb.free(0, 1, 0, 3);
    tb.read(0, 4, 0, 3);
    v.push(("same_tenant_stale", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.write(0, 3, 8, 2);
    tb.lose(0, 3);
    tb.write(0, 1, 0, 2);
    tb.read(0, 1, 0, 4);
    tb.read(0, 2, 8, 2);
    v.push(("gap_possible", tb));

    let mut tb = pd();
    let s = tb.write(0, 1, 0, 4);
    tb.lose(0, 2);
    tb.write(0, 1, 20, 1);
    tb.copy(1, 2, 8, 4, 0, 0, s + 1);
    tb.read(1, 2, 8, 4);
    v.push(("copy_source_in_gap", tb));

    let mut tb = pd();
    tb.from_engine_start = false;
    tb.write(0, 1, 0, 2);
    tb.read(0, 1, 0, 4);
    v.push(("unknown_mid_run", tb));

    let mut tb = pd();
    tb.complete = false;
    tb.write(0, 1, 0, 2);
    tb.read(0, 2, 0, 2);
    v.push(("unclean_capture", tb));

    let mut tb = pd();
    // (request ids are unique: mark the existing row as a placeholder)
    tb.requests[1].prefilled_tokens = Some(1);
    let s = tb.write(0, 1, 0, 6);
    tb.copy(1, 1, 0, 6, 0, 0, s);
    tb.read(1, 1, 0, 6);
    tb.free(1, 1, 0, 6);
    let p = tb.write(0, 2, 10, 1);
    tb.alloc(1, 2, 0, 6);
    tb.copy(1, 2, 0, 1, 0, 10, p);
    tb.read(1, 2, 0, 6);
    v.push(("placeholder_incident", tb));

    let mut tb = pd();
    tb.write(0, 1, 0, 2);
    tb.read(0, 9, 0, 2);
    v.push(("reader_missing_from_requests", tb));

    // SQL-specific: a chain of three copies over four pools (two levels of
    // pointer jumping), with a hole on the middle pool.
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 32),
        pool(1, Role::Mixed, 32),
        pool(2, Role::Mixed, 32),
        pool(3, Role::Decode, 32),
    ]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.req(3, "umbrella");
    let s0 = tb.write(0, 1, 0, 6);
    let s1 = tb.copy(1, 1, 0, 6, 0, 0, s0);
    tb.write(1, 3, 0, 1);
    tb.lose(1, 2);
    let s1b = tb.write(1, 3, 20, 1);
    let s2 = tb.copy(2, 2, 10, 6, 1, 0, s1);
    let s2b = tb.copy(2, 3, 0, 2, 1, 0, s1b);
    tb.copy(3, 2, 5, 6, 2, 10, s2);
    tb.copy(3, 3, 20, 2, 2, 0, s2b);
    tb.read(3, 2, 5, 6);
    tb.read(3, 3, 20, 2);
    tb.share(3, 1, 5, 2);
    tb.read(3, 1, 5, 3);
    v.push(("chain_of_three_copies", tb));

    // SQL-specific: stream starting late, a copy past the end of its source,
    // engine-written KV read by a request, a copy of a never-written slot.
    let mut tb = pd();
    tb.lose(1, 5);
    tb.write(0, 0, 0, 2);
    tb.read(0, 2, 0, 3);
    let end = tb.next_seq(0);
    tb.copy(1, 1, 0, 2, 0, 0, end + 7);
    tb.copy(1, 3, 8, 2, 0, 30, end - 1);
    tb.read(1, 1, 0, 2);
    tb.read(1, 3, 8, 2);
    tb.scrub(1, 8, 1);
    tb.read(1, 3, 8, 2);
    v.push(("late_start_past_end_engine", tb));

    // Reads by request 0 (the engine itself): no customer response, so
    // no affected response; counted as engine reads in the coverage.
    let mut tb = pd();
    tb.write(0, 1, 0, 4);
    tb.read(0, 0, 0, 3);
    tb.read(0, 0, 6, 2);
    tb.write(0, 2, 4, 2);
    tb.read(0, 2, 0, 6);
    v.push(("engine_reads", tb));
    v.extend(revision_2_traces());
    v
}

/// The rule traces of trace format revision 2: `alloc` makes content
/// stale, a share grant covers only current content, a copy carries the
/// bit, a scrub makes content current, copies go both ways between a device
/// pool and a `cache` pool, and shared reads of another tenant's KV are
/// listed apart.
fn revision_2_traces() -> Vec<(&'static str, TraceBuilder)> {
    let mut v = Vec::new();

    // A placeholder (2) is allocated 1's freed slots and never writes
    // them; the prefix cache hands them to 3: the grant is on stale
    // content, so 3's read is foreign with 1, the stale writer, as source.
    let mut tb = pd();
    tb.alloc(0, 1, 0, 4);
    tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    tb.alloc(0, 2, 0, 4);
    tb.share(0, 3, 0, 4);
    tb.read(0, 3, 0, 4);
    v.push(("r2_share_of_stale_content_is_foreign", tb));

    // Part of a grant on stale content: slots 0..2 current (shared,
    // cross-tenant: acme's KV hit by umbrella), 2..4 stale (foreign). A
    // grant given on current content survives a later alloc (it holds
    // until the slot is written again); 4 (acme) shares acme's KV: the
    // same tenant, not listed.
    let mut tb = pd();
    tb.req(4, "acme");
    tb.write(0, 1, 0, 8);
    tb.share(0, 4, 4, 4);
    tb.alloc(0, 2, 2, 6);
    tb.share(0, 3, 0, 4);
    tb.read(0, 3, 0, 4);
    tb.read(0, 4, 4, 4);
    tb.write(0, 2, 6, 1);
    tb.read(0, 4, 4, 4);
    v.push(("r2_grant_partly_stale_and_alloc_after_grant", tb));

    // A copy carries staleness: a transfer of pages the placeholder (2)
    // never wrote carries 1's stale KV to the decode pool, where a grant
    // to 3 covers nothing; a copy of the same slots taken before the
    // alloc (current) is shared. The own write of 2 after the alloc makes
    // the slot current again.
    let mut tb = pd();
    let w = tb.write(0, 1, 0, 4);
    tb.free(0, 1, 0, 4);
    let a = tb.alloc(0, 2, 0, 4);
    let w2 = tb.write(0, 2, 3, 1);
    tb.copy(1, 2, 8, 4, 0, 0, a);
    tb.copy(1, 1, 16, 4, 0, 0, w);
    tb.copy(1, 2, 24, 4, 0, 0, w2);
    tb.share(1, 3, 8, 4);
    tb.share(1, 3, 16, 4);
    tb.share(1, 3, 24, 4);
    tb.read(1, 3, 8, 4);
    tb.read(1, 3, 16, 4);
    tb.read(1, 3, 24, 4);
    v.push(("r2_copy_carries_staleness", tb));

    // A scrub makes content current (and blank); a scrub then an alloc
    // leaves it blank for whoever reads it, granted or not.
    let mut tb = pd();
    tb.write(0, 1, 0, 6);
    tb.alloc(0, 2, 0, 6);
    tb.scrub(0, 0, 2);
    tb.write(0, 2, 2, 1);
    tb.share(0, 3, 0, 6);
    tb.read(0, 3, 0, 6);
    tb.alloc(0, 3, 0, 2);
    tb.share(0, 2, 0, 2);
    tb.read(0, 2, 0, 2);
    v.push(("r2_scrub_makes_current", tb));

    // Tiers: prefill 0, decode 1, host cache 2 (role cache). The engine
    // (request 0) offloads decode pages to the cache and loads them back
    // into other decode slots: provenance and staleness travel both ways.
    // Current KV of 1 loaded back and shared to 3: cross-tenant shared.
    // Pages a placeholder (2) held but never wrote, offloaded and loaded
    // back, then shared to 3: foreign, source 1.
    let mut tb = tiered();
    let s0 = tb.write(0, 1, 0, 4);
    let s1 = tb.copy(1, 1, 0, 4, 0, 0, s0);
    let off = tb.copy(2, 0, 0, 4, 1, 0, s1);
    tb.free(1, 1, 0, 4);
    tb.alloc(1, 2, 0, 4);
    tb.write(1, 2, 0, 4);
    tb.alloc(1, 3, 8, 4);
    tb.copy(1, 0, 8, 4, 2, 0, off);
    tb.share(1, 3, 8, 4);
    tb.read(1, 3, 8, 4);
    tb.write(1, 1, 16, 4);
    tb.free(1, 1, 16, 4);
    let a = tb.alloc(1, 2, 16, 4);
    let off2 = tb.copy(2, 0, 8, 4, 1, 16, a);
    tb.alloc(1, 3, 24, 4);
    let back = tb.copy(1, 0, 24, 4, 2, 8, off2);
    tb.share(1, 3, 24, 4);
    tb.read(1, 3, 24, 4);
    // A second round trip of the loaded-back pages (a chain of four copies),
    // and the cache slot reused for 2's own KV after it.
    let off3 = tb.copy(2, 0, 16, 4, 1, 24, back);
    tb.write(2, 2, 8, 4);
    tb.alloc(1, 2, 32, 4);
    tb.copy(1, 0, 32, 4, 2, 16, off3);
    tb.share(1, 2, 32, 4);
    tb.read(1, 2, 32, 4);
    v.push(("r2_offload_and_load_back", tb));

    // Copies inside one pool (a copy-on-write block copy): 3's partial hit
    // on 1's block is copied into 3's private slots 8..12, which 2 wrote
    // before; the copy carries 1's current KV over 2's, and 3's grant on
    // the copied slots covers it (cross-tenant shared). A copy taken after
    // 2 allocated 1's slots carries stale content: 3's grant on it covers
    // nothing, foreign with source 1. A copy of the copy (2, slots 24..28,
    // no grant) still names 1. A copy of slots 2 rewrote after src_seq
    // reads them as of src_seq (1's KV), not as they are now. The tiered
    // deployment (a `cache` pool) gives the manifest-sized SQL script the
    // levels a chain of two copies needs: from the manifest alone nothing
    // bounds a chain inside one pool (`kvtrail sql` sizes it from the data).
    let mut tb = tiered();
    tb.alloc(0, 1, 0, 4);
    let w = tb.write(0, 1, 0, 4);
    tb.write(0, 2, 8, 4);
    tb.free(0, 2, 8, 4);
    tb.alloc(0, 3, 8, 4);
    let c = tb.copy(0, 3, 8, 4, 0, 0, w);
    tb.share(0, 3, 8, 4);
    tb.read(0, 3, 8, 4);
    let a = tb.alloc(0, 2, 0, 4);
    tb.alloc(0, 3, 16, 4);
    tb.copy(0, 3, 16, 4, 0, 0, a);
    tb.share(0, 3, 16, 4);
    tb.read(0, 3, 16, 4);
    tb.alloc(0, 2, 24, 4);
    tb.copy(0, 2, 24, 4, 0, 8, c);
    tb.read(0, 2, 24, 4);
    tb.write(0, 2, 0, 4);
    tb.alloc(0, 2, 32, 4);
    tb.copy(0, 2, 32, 4, 0, 0, w);
    tb.read(0, 2, 32, 4);
    v.push(("r2_copy_inside_one_pool", tb));
    v
}

/// Prefill 0, decode 1 and a host cache 2 (role `cache`), 64 slots each,
/// with the requests of [`pd`].
fn tiered() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 64),
        pool(1, Role::Decode, 64),
        pool(2, Role::Cache, 64),
    ]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.req(3, "umbrella");
    tb
}

// -------------------------------------------------------- canonical form

fn o<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or("-".into())
}

/// A tenant as both sides can express it: `tenant:NAME`, `unknown` (not in
/// the requests table) or `engine` (request 0). The native report writes the
/// last two as the sentinel strings; the SQL writes a NULL tenant and a kind.
fn native_who(t: &Tenant) -> String {
    match t {
        Tenant::Unknown => "unknown".into(),
        Tenant::Engine => "engine".into(),
        Tenant::Customer(t) => format!("tenant:{t}"),
    }
}

fn sql_who(row: &Value, col: &str) -> String {
    match row[format!("{col}_kind")].as_str() {
        Some("tenant") => format!("tenant:{}", j(&row[col])),
        Some(kind) => {
            assert!(
                row[col].is_null(),
                "{col} of kind {kind} must be NULL: {row}"
            );
            kind.into()
        }
        None => panic!("no {col}_kind: {row}"),
    }
}

fn native_lines(r: &ScopeReport) -> Vec<String> {
    let mut out = Vec::new();
    for a in &r.affected_responses {
        let ids: Vec<String> = a.sources.iter().map(|s| s.request_id.to_string()).collect();
        out.push(format!(
            "A {} ext={} tenant={} in={} status={} hash={} f={} u={} unc={} exp={} cross={} {} reasons={} t={}..{} srcs={}",
            a.request_id,
            o(&a.external_id),
            native_who(&a.tenant),
            a.in_requests_table,
            o(&a.http_status),
            o(&a.output_hash),
            a.foreign_tokens,
            a.unknown_tokens,
            a.uncertain_tokens,
            a.exposed_tokens,
            a.cross_tenant,
            a.confidence.as_str(),
            a.reasons.join(";"),
            a.first_read_ns,
            a.last_read_ns,
            ids.join(",")
        ));
        for s in &a.sources {
            let pools: Vec<String> = s.pools.iter().map(|p| p.to_string()).collect();
            out.push(format!(
                "S {} <- {} ext={} tenant={} tokens={} seq={}..{} ts={}..{} pools={} cross={} {}",
                a.request_id,
                s.request_id,
                o(&s.external_id),
                native_who(&s.tenant),
                s.tokens,
                s.first_seq,
                s.last_seq,
                s.first_ts_ns,
                s.last_ts_ns,
                pools.join(","),
                s.cross_tenant,
                s.confidence.as_str()
            ));
        }
    }
    for t in &r.recipients {
        let ids: Vec<String> = t.request_ids.iter().map(|x| x.to_string()).collect();
        out.push(format!(
            "R {} resp={} f={} u={} cross={} c={} p={} ids={}",
            native_who(&t.tenant),
            t.responses,
            t.foreign_tokens,
            t.unknown_tokens,
            t.cross_tenant_responses,
            t.confirmed,
            t.possible,
            ids.join(",")
        ));
    }
    for t in &r.sources {
        let ids: Vec<String> = t.request_ids.iter().map(|x| x.to_string()).collect();
        // The SQL lists only tenants from the requests table, and says
        // whether any recipient is unattributed.
        let named: Vec<&str> = t
            .recipient_tenants
            .iter()
            .filter_map(Tenant::customer)
            .collect();
        let unattributed = t.recipient_tenants.len() > named.len();
        out.push(format!(
            "T {} req={} tok={} cross={} resp={} rt={} unattributed={} ids={}",
            native_who(&t.tenant),
            t.requests,
            t.tokens,
            t.cross_tenant_tokens,
            t.recipient_responses,
            named.join(","),
            unattributed,
            ids.join(",")
        ));
    }
    for b in &r.blank_read_responses {
        out.push(format!(
            "B {} ext={} tenant={} tok={}",
            b.request_id,
            o(&b.external_id),
            native_who(&b.tenant),
            b.tokens
        ));
    }
    let c = &r.coverage;
    for g in &c.gaps {
        out.push(format!(
            "G {} {}..{}",
            g.pool,
            o(&g.after_seq),
            g.before_seq
        ));
    }
    for p in &c.copies_past_end {
        out.push(format!("P {} {}..{}", p.pool, p.min_src_seq, p.max_src_seq));
    }
    out.push(format!(
        "C complete={} capture_complete={} lost={} requests_missing={} engine_reads={}",
        c.complete,
        c.capture_complete,
        c.lost_events,
        c.requests_missing.len(),
        c.engine_reads
    ));
    out.sort();
    out
}

/// Cross-tenant shared reads as the native replay finds them (its clean
/// shared reads of another request's KV, with the requests table's
/// tenants; the engine's content is no tenant's, and a request missing
/// from the table counts as another tenant, as for foreign sources):
/// `X` per response, `XS` per (response, source request).
fn native_shared_lines(dir: &Path) -> Vec<String> {
    let lines = engine_shared_lines(dir);
    // What scope reports (`cross_tenant_shared`) is what the engine's
    // shared reads say, response by response.
    let report = scope(dir);
    let mut reported: Vec<String> = report
        .cross_tenant_shared
        .iter()
        .map(|h| {
            let mut ids: Vec<u64> = h.sources.iter().map(|s| s.request_id).collect();
            ids.sort_unstable();
            let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
            format!(
                "X {} tenant={} tokens={} srcs={}",
                h.request_id,
                native_who(&h.tenant),
                h.tokens,
                ids.join(",")
            )
        })
        .collect();
    reported.sort();
    let engine: Vec<&String> = lines.iter().filter(|l| l.starts_with("X ")).collect();
    assert_eq!(
        reported.iter().collect::<Vec<_>>(),
        engine,
        "{}: scope's cross_tenant_shared differs from the engine's shared reads",
        dir.display()
    );
    lines
}

/// [`native_shared_lines`] straight from the lineage engine's shared reads.
fn engine_shared_lines(dir: &Path) -> Vec<String> {
    use std::collections::BTreeSet;
    let trace = kvtrail::trace::Trace::open(dir).unwrap();
    let run =
        kvtrail::lineage::run(&trace, &Default::default(), &kvtrail::progress::NoReporter).unwrap();
    let idx = kvtrail::trace::scan_requests(&trace, |_| {}).unwrap();
    let tenant = |id: u64| idx.tenant(id).map(str::to_string);
    let who = |id: u64| match (id, tenant(id)) {
        (0, _) => "engine".to_string(),
        (_, Some(t)) => format!("tenant:{t}"),
        (_, None) => "unknown".to_string(),
    };
    let mut out = Vec::new();
    for (&reader, by_source) in &run.exposures.shared {
        if reader == 0 {
            continue;
        }
        let mut slots: BTreeSet<(u16, u64)> = BTreeSet::new();
        let mut sources = Vec::new();
        for (&src, sets) in by_source {
            let cross = src != 0
                && (tenant(src).is_none()
                    || tenant(reader).is_none()
                    || tenant(src) != tenant(reader));
            if !cross {
                continue;
            }
            sources.push(src);
            let mut n = 0;
            for (&p, set) in sets {
                for &(a, b) in set.ranges() {
                    slots.extend((a..b).map(|s| (p, s)));
                    n += b - a;
                }
            }
            let pools: Vec<String> = sets.keys().map(|p| p.to_string()).collect();
            out.push(format!(
                "XS {reader} <- {src} tenant={} tokens={n} pools={}",
                who(src),
                pools.join(",")
            ));
        }
        if sources.is_empty() {
            continue;
        }
        sources.sort_unstable();
        let ids: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
        out.push(format!(
            "X {reader} tenant={} tokens={} srcs={}",
            who(reader),
            slots.len(),
            ids.join(",")
        ));
    }
    out.sort();
    out
}

fn j(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn sql_lines(res: &Value) -> Vec<String> {
    let rows = |v: &str| res[v].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for a in rows("kvtrail_affected_responses") {
        out.push(format!(
            "A {} ext={} tenant={} in={} status={} hash={} f={} u={} unc={} exp={} cross={} {} reasons={} t={}..{} srcs={}",
            j(&a["request_id"]),
            j(&a["external_id"]),
            sql_who(&a, "tenant"),
            j(&a["in_requests_table"]),
            j(&a["http_status"]),
            j(&a["output_hash"]),
            j(&a["foreign_tokens"]),
            j(&a["unknown_tokens"]),
            j(&a["uncertain_tokens"]),
            j(&a["exposed_tokens"]),
            j(&a["cross_tenant"]),
            j(&a["confidence"]),
            j(&a["reasons"]),
            j(&a["first_read_ns"]),
            j(&a["last_read_ns"]),
            j(&a["source_request_ids"])
        ));
    }
    for s in rows("kvtrail_response_sources") {
        out.push(format!(
            "S {} <- {} ext={} tenant={} tokens={} seq={}..{} ts={}..{} pools={} cross={} {}",
            j(&s["request_id"]),
            j(&s["source_request_id"]),
            j(&s["source_external_id"]),
            sql_who(&s, "source_tenant"),
            j(&s["tokens"]),
            j(&s["first_seq"]),
            j(&s["last_seq"]),
            j(&s["first_ts_ns"]),
            j(&s["last_ts_ns"]),
            j(&s["pools"]),
            j(&s["cross_tenant"]),
            j(&s["confidence"])
        ));
    }
    for t in rows("kvtrail_recipients") {
        out.push(format!(
            "R {} resp={} f={} u={} cross={} c={} p={} ids={}",
            sql_who(&t, "tenant"),
            j(&t["responses"]),
            j(&t["foreign_tokens"]),
            j(&t["unknown_tokens"]),
            j(&t["cross_tenant_responses"]),
            j(&t["confirmed"]),
            j(&t["possible"]),
            j(&t["request_ids"])
        ));
    }
    for t in rows("kvtrail_sources") {
        out.push(format!(
            "T {} req={} tok={} cross={} resp={} rt={} unattributed={} ids={}",
            sql_who(&t, "tenant"),
            j(&t["requests"]),
            j(&t["tokens"]),
            j(&t["cross_tenant_tokens"]),
            j(&t["recipient_responses"]),
            j(&t["recipient_tenants"]),
            t["unattributed_recipient_responses"].as_u64().unwrap() > 0,
            j(&t["request_ids"])
        ));
    }
    for b in rows("kvtrail_blank_reads") {
        out.push(format!(
            "B {} ext={} tenant={} tok={}",
            j(&b["request_id"]),
            j(&b["external_id"]),
            sql_who(&b, "tenant"),
            j(&b["tokens"])
        ));
    }
    for x in rows("kvtrail_cross_tenant_shared") {
        out.push(format!(
            "X {} tenant={} tokens={} srcs={}",
            j(&x["request_id"]),
            sql_who(&x, "tenant"),
            j(&x["tokens"]),
            j(&x["source_request_ids"])
        ));
    }
    for x in rows("kvtrail_cross_tenant_shared_sources") {
        out.push(format!(
            "XS {} <- {} tenant={} tokens={} pools={}",
            j(&x["request_id"]),
            j(&x["source_request_id"]),
            sql_who(&x, "source_tenant"),
            j(&x["tokens"]),
            j(&x["pools"])
        ));
    }
    for g in rows("kvtrail_gaps") {
        out.push(format!(
            "G {} {}..{}",
            j(&g["pool"]),
            j(&g["after_seq"]),
            j(&g["before_seq"])
        ));
    }
    for p in rows("kvtrail_copies_past_end") {
        out.push(format!(
            "P {} {}..{}",
            j(&p["pool"]),
            j(&p["min_src_seq"]),
            j(&p["max_src_seq"])
        ));
    }
    for c in rows("kvtrail_coverage") {
        assert_eq!(c["unresolved_copy_slots"], 0, "copy chains resolved");
        assert_eq!(c["copies_unresolved"], 0, "copy chains resolved");
        out.push(format!(
            "C complete={} capture_complete={} lost={} requests_missing={} engine_reads={}",
            j(&c["complete"]),
            j(&c["capture_complete"]),
            j(&c["lost_events"]),
            j(&c["requests_missing"]),
            j(&c["engine_reads"])
        ));
    }
    out.sort();
    out
}

// ------------------------------------------------------------- harness

/// The Trino catalog and schema run_sql.py creates for the trace tables
/// (`--trace-path src.trace`).
const TRINO_SCHEMA: [&str; 2] = ["src", "trace"];

/// Runs every job (name, trace folder, `--trace-path`) through `engine` in
/// one engine process; the Trino tables live in `trino_schema` (raw names).
/// `None` (after a SKIP line) when the engines' venv is missing outside CI.
fn run_engine(
    engine: &str,
    dialect: Dialect,
    cases: &[(String, PathBuf, String)],
    trino_schema: [&str; 2],
) -> Option<Value> {
    let py = venv::SQL.python()?;
    let work = tempfile::tempdir().unwrap();
    let mut jobs = Vec::new();
    for (i, (name, dir, path)) in cases.iter().enumerate() {
        let m = Manifest::load(dir).unwrap();
        let sql = generate(&SqlOptions::from_manifest(&m, dialect, path)).unwrap();
        let f = work.path().join(format!("{i}.sql"));
        std::fs::write(&f, sql).unwrap();
        jobs.push(serde_json::json!({
            "name": name, "sql": f, "trace": dir,
            "catalog": trino_schema[0], "schema": trino_schema[1],
        }));
    }
    let jobs_path = work.path().join("jobs.json");
    std::fs::write(&jobs_path, serde_json::to_string(&jobs).unwrap()).unwrap();
    let out_path = work.path().join("out.json");
    let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sql/run_sql.py");
    let o = Command::new(py)
        .arg(runner)
        .arg(engine)
        .arg(&jobs_path)
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{engine} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(serde_json::from_slice(&std::fs::read(&out_path).unwrap()).unwrap())
}

/// Runs every trace through `engine` in one engine process and compares
/// each result with the native scope report of the same trace.
fn check(engine: &str, dialect: Dialect, cases: &[(String, PathBuf)]) {
    let jobs: Vec<(String, PathBuf, String)> = cases
        .iter()
        .map(|(name, dir)| {
            // Trino reads tables, not folders: run_sql.py maps `src.trace`
            // to the job's trace folder.
            let path = match dialect {
                Dialect::Trino => TRINO_SCHEMA.join("."),
                _ => dir.to_str().unwrap().to_string(),
            };
            (name.clone(), dir.clone(), path)
        })
        .collect();
    check_jobs(engine, dialect, &jobs, TRINO_SCHEMA);
}

fn check_jobs(
    engine: &str,
    dialect: Dialect,
    jobs: &[(String, PathBuf, String)],
    trino_schema: [&str; 2],
) {
    let Some(got) = run_engine(engine, dialect, jobs, trino_schema) else {
        return;
    };
    let mut failures = Vec::new();
    for (name, dir, _) in jobs {
        let mut w = native_lines(&scope(dir));
        w.extend(native_shared_lines(dir));
        w.sort();
        let g = sql_lines(&got[name]);
        if g != w {
            failures.push(format!(
                "{name} ({engine}):\n  native:\n    {}\n  sql:\n    {}",
                w.join("\n    "),
                g.join("\n    ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Records every rule trace, and a hand-written variant (shuffled rows over
/// several files, dictionary strings, no `files` list) of each.
fn build(dir: &Path, only: Option<&[&str]>) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for (name, tb) in traces() {
        if only.is_some_and(|o| !o.contains(&name)) {
            continue;
        }
        out.push((name.to_string(), tb.record(&dir.join(name))));
        let hand = format!("{name}_hand");
        out.push((hand.clone(), tb.by_hand(&dir.join(&hand), 3, 7, true)));
    }
    out
}

#[test]
fn duckdb_dialect_equals_scope_on_every_rule_trace() {
    let dir = tempfile::tempdir().unwrap();
    let cases = build(dir.path(), None);
    check("duckdb", Dialect::Duckdb, &cases);
}

/// Spark starts a JVM and plans every statement on two shared cores (tens
/// of seconds per trace here): a small set keeps CI within minutes. It
/// covers copies of copies, holes (in a folder whose name holds a quote,
/// `;` and `--`), a hand-written trace (shuffled rows over Hive folders,
/// dictionary strings), and files the reader skips; every rule runs on
/// DuckDB.
#[test]
fn spark_dialect_equals_scope_on_local_spark() {
    let dir = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    for (name, tb) in traces() {
        match name {
            "chain_of_three_copies" => {
                cases.push((name.to_string(), tb.record(&dir.path().join(name))))
            }
            // A folder name that would end the path literal and inject a
            // statement if it were spliced into the SQL unescaped.
            "gap_possible" => {
                let d = dir.path().join("gap it's'; DROP VIEW kvtrail_gaps; --");
                cases.push((name.to_string(), tb.record(&d)))
            }
            "placeholder_incident" => {
                let d = dir.path().join(name);
                cases.push((name.to_string(), tb.by_hand(&d, 3, 7, true)));
            }
            _ => {}
        }
    }
    assert_eq!(cases.len(), 3);
    // Spark's file listing skips names starting with `_` or `.` as the
    // native reader does: the lost event in `_temporary/` stays lost.
    let hidden = hidden_files_trace(&dir.path().join("hidden_files"));
    cases.push(("hidden_files".into(), hidden));
    cases.push(("incident_small".into(), simulated_incident(dir.path(), 150)));
    check("spark", Dialect::Spark, &cases);
}

/// The revision-2 rule traces classify as the contract says (natively;
/// the DuckDB, Spark and Trino tests check that the SQL agrees line by
/// line): the lines each must hold.
#[test]
fn revision_2_traces_classify_as_the_contract_says() {
    let dir = tempfile::tempdir().unwrap();
    let want: &[(&str, &[&str])] = &[
        (
            "r2_share_of_stale_content_is_foreign",
            &["S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=4 "],
        ),
        (
            "r2_grant_partly_stale_and_alloc_after_grant",
            &[
                "S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=2 ",
                "X 3 tenant=tenant:umbrella tokens=2 srcs=1",
                "S 4 <- 2 ext=ext-2 tenant=tenant:initech tokens=1 ",
            ],
        ),
        (
            "r2_copy_carries_staleness",
            &[
                "S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=7 ",
                "X 3 tenant=tenant:umbrella tokens=5 srcs=1,2",
            ],
        ),
        (
            "r2_scrub_makes_current",
            &[
                "B 2 ext=ext-2 tenant=tenant:initech tok=2",
                "B 3 ext=ext-3 tenant=tenant:umbrella tok=2",
                "S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=3 ",
                "X 3 tenant=tenant:umbrella tokens=1 srcs=2",
            ],
        ),
        (
            "r2_offload_and_load_back",
            &[
                "S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=4 ",
                "S 2 <- 1 ext=ext-1 tenant=tenant:acme tokens=4 ",
                "X 3 tenant=tenant:umbrella tokens=4 srcs=1",
                "XS 3 <- 1 tenant=tenant:acme tokens=4 pools=1",
            ],
        ),
        (
            "r2_copy_inside_one_pool",
            &[
                "S 3 <- 1 ext=ext-1 tenant=tenant:acme tokens=4 ",
                "S 2 <- 1 ext=ext-1 tenant=tenant:acme tokens=8 ",
                "XS 3 <- 1 tenant=tenant:acme tokens=4 pools=0",
            ],
        ),
    ];
    let traces = revision_2_traces();
    assert_eq!(traces.len(), want.len());
    for ((name, tb), (wname, lines)) in traces.into_iter().zip(want) {
        assert_eq!(name, *wname);
        let t = tb.record(&dir.path().join(name));
        let mut got = native_lines(&scope(&t));
        got.extend(native_shared_lines(&t));
        for l in *lines {
            assert!(
                got.iter().any(|g| g.starts_with(l)),
                "{name}: no line {l:?} in\n  {}",
                got.join("\n  ")
            );
        }
        // Only the sources named above: no other foreign source.
        let sources = got.iter().filter(|g| g.starts_with("S ")).count();
        let named = lines.iter().filter(|l| l.starts_with("S ")).count();
        assert_eq!(sources, named, "{name}:\n  {}", got.join("\n  "));
    }
}

/// Spark on the revision-2 rule traces (stale grants, staleness through
/// copies, tier round trips, cross-tenant shared reads).
#[test]
fn spark_dialect_equals_scope_on_revision_2_traces() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(String, PathBuf)> = revision_2_traces()
        .into_iter()
        .filter(|(name, _)| {
            matches!(
                *name,
                "r2_grant_partly_stale_and_alloc_after_grant" | "r2_offload_and_load_back"
            )
        })
        .map(|(name, tb)| (name.to_string(), tb.record(&dir.path().join(name))))
        .collect();
    assert_eq!(cases.len(), 2);
    check("spark", Dialect::Spark, &cases);
}

/// Copies both ways make chains longer than any pool count bounds: with
/// fewer pointer-jumping levels than the tier round trips need, the
/// script counts the unresolved copy slots, the coverage is not complete,
/// and the reads of such content are uncertain (never clean, never a
/// guessed source).
#[test]
fn copy_chains_past_the_levels_are_counted_never_guessed() {
    let dir = tempfile::tempdir().unwrap();
    let (_, tb) = revision_2_traces()
        .into_iter()
        .find(|(n, _)| *n == "r2_offload_and_load_back")
        .unwrap();
    let t = tb.record(&dir.path().join("t"));
    let m = Manifest::load(&t).unwrap();
    let mut o = SqlOptions::from_manifest(&m, Dialect::Duckdb, t.to_str().unwrap());
    assert_eq!(o.copy_levels, kvtrail::sql::CACHE_COPY_LEVELS);
    o.copy_levels = 1;
    let sql = generate(&o).unwrap();
    let Some(py) = venv::SQL.python() else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let f = work.path().join("0.sql");
    std::fs::write(&f, sql).unwrap();
    let jobs = work.path().join("jobs.json");
    let job = serde_json::json!([{"name": "t", "sql": f, "trace": t}]);
    std::fs::write(&jobs, job.to_string()).unwrap();
    let out = work.path().join("out.json");
    let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sql/run_sql.py");
    let r = Command::new(py)
        .arg(runner)
        .args(["duckdb".as_ref(), jobs.as_os_str(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let c = &got["t"]["kvtrail_coverage"][0];
    assert_eq!(c["copy_levels"], 1, "{c}");
    assert!(c["copies_unresolved"].as_u64().unwrap() > 0, "{c}");
    assert!(c["unresolved_copy_slots"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["complete"], false, "{c}");
    // The reads of content whose chain is unresolved are uncertain, and
    // no source is named for them.
    for a in got["t"]["kvtrail_affected_responses"].as_array().unwrap() {
        assert_eq!(a["confidence"], "possible", "{a}");
    }
    let uncertain: u64 = got["t"]["kvtrail_affected_responses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["uncertain_tokens"].as_u64().unwrap())
        .sum();
    assert!(uncertain > 0);
}

/// The simulated incident (3000 requests, 44M slot touches): about 20 s
/// and 3.5 GB in DuckDB on two cores.
#[test]
fn duckdb_dialect_equals_scope_on_incident_mini() {
    let t = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/incident-mini");
    check("duckdb", Dialect::Duckdb, &[("incident-mini".into(), t)]);
}

/// Partitioning writers (pyarrow write_dataset, DuckDB PARTITION_BY) keep
/// the partition column only in the folder name: the DuckDB dialect reads
/// `pool` from `kv/pool=N/` as the native reader does.
#[test]
fn duckdb_dialect_reads_pool_from_hive_folders() {
    let dir = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    for (name, tb) in traces() {
        if matches!(
            name,
            "chain_of_three_copies" | "gap_possible" | "engine_reads"
        ) {
            let t = tb.record(&dir.path().join(name));
            drop_pool_column(&t.join("kv"));
            cases.push((name.to_string(), t));
        }
    }
    assert_eq!(cases.len(), 3);
    check("duckdb", Dialect::Duckdb, &cases);
}

/// Rewrites every kv file under a `pool=N` folder without its `pool` column.
fn drop_pool_column(kv: &Path) {
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let mut rewritten = 0;
    for d in std::fs::read_dir(kv).unwrap() {
        let d = d.unwrap().path();
        if !d
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("pool=")
        {
            continue;
        }
        for f in std::fs::read_dir(&d).unwrap() {
            let f = f.unwrap().path();
            let r = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&f).unwrap())
                .unwrap()
                .build()
                .unwrap();
            let batches: Vec<_> = r
                .map(|b| {
                    let b = b.unwrap();
                    let i = b.schema().index_of("pool").unwrap();
                    let mut b = b;
                    b.remove_column(i);
                    b
                })
                .collect();
            let mut w = ArrowWriter::try_new(
                std::fs::File::create(&f).unwrap(),
                batches[0].schema(),
                None,
            )
            .unwrap();
            for b in &batches {
                w.write(b).unwrap();
            }
            w.close().unwrap();
            rewritten += 1;
        }
    }
    assert!(rewritten > 0);
    // The partitioning writer lists what it wrote: the manifest's digests
    // follow the rewritten files, so the evidence stays complete.
    let dir = kv.parent().unwrap();
    let mut m = Manifest::load(dir).unwrap();
    for f in m.files.iter_mut().flatten() {
        let bytes = std::fs::read(dir.join(&f.path)).unwrap();
        f.blake3 = blake3::hash(&bytes).to_hex().to_string();
    }
    m.store(dir).unwrap();
}

/// The Trino dialect has no Trino server here: sqlglot parses it with its
/// Trino grammar and transpiles each statement to DuckDB (tests/sql/run_sql.py,
/// `trino-on-duckdb`), on every rule trace and a small simulated incident.
#[test]
fn trino_dialect_equals_scope_through_sqlglot() {
    let dir = tempfile::tempdir().unwrap();
    let mut cases = build(dir.path(), None);
    cases.push(("incident_small".into(), simulated_incident(dir.path(), 150)));
    check("trino-on-duckdb", Dialect::Trino, &cases);
}

/// A simulated incident of `requests` requests (seed 1), made by the binary.
fn simulated_incident(dir: &Path, requests: u32) -> PathBuf {
    let n = requests.to_string();
    cli::simulate(
        &dir.join(format!("incident-{requests}")),
        &["--scenario", "incident", "--seed", "1", "--requests", &n],
    )
}

// ------------------------------------------------- hostile --trace-path

/// The script's tokens with every string literal, quoted identifier and
/// comment replaced by a placeholder: what an engine executes apart from
/// data. Spark's lexer also escapes with `\` inside literals.
fn skeleton(sql: &str, dialect: Dialect) -> Vec<String> {
    let c: Vec<char> = sql.chars().collect();
    let mut out = Vec::new();
    let mut word = String::new();
    let mut i = 0;
    let flush = |w: &mut String, out: &mut Vec<String>| {
        if !w.is_empty() {
            out.push(w.to_uppercase());
            w.clear();
        }
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '-' && c.get(i + 1) == Some(&'-') {
            flush(&mut word, &mut out);
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if ch == '/' && c.get(i + 1) == Some(&'*') {
            flush(&mut word, &mut out);
            out.push("<comment>".into());
            i += 2;
            while i < c.len() && !(c[i] == '*' && c.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
            continue;
        }
        if matches!(ch, '\'' | '"' | '`') {
            flush(&mut word, &mut out);
            i += 1;
            loop {
                match c.get(i) {
                    None => panic!("unterminated {ch} in the script"),
                    Some('\\') if ch == '\'' && dialect == Dialect::Spark => i += 2,
                    Some(&q) if q == ch && c.get(i + 1) == Some(&ch) => i += 2,
                    Some(&q) if q == ch => break,
                    Some(_) => i += 1,
                }
            }
            i += 1;
            out.push(if ch == '\'' { "<str>" } else { "<ident>" }.into());
            continue;
        }
        if ch.is_alphanumeric() || ch == '_' || ch == '$' {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            if !ch.is_whitespace() {
                out.push(ch.to_string());
            }
        }
        i += 1;
    }
    flush(&mut word, &mut out);
    out
}

/// The script for `o`, or the error's message.
fn script(o: &SqlOptions) -> Result<String, String> {
    generate(o).map_err(|e| e.to_string())
}

fn opts(dialect: Dialect, path: &str) -> SqlOptions {
    SqlOptions {
        dialect,
        trace_path: path.into(),
        pools: vec![0, 1],
        from_engine_start: true,
        complete: true,
        unverifiable: false,
        copy_levels: 1,
        spark_scratch: None,
    }
}

const HOSTILE: &[&str] = &[
    "cat.sch.kv x; DROP TABLE y; --",
    "/data/t\n; DROP TABLE y; --",
    "/data/t\r\nDROP TABLE y",
    "/data/t\u{2028}DROP TABLE y",
    "/data/it's'; DROP TABLE y; --",
    "/data/x\\'; DROP TABLE y; --",
    "/data/x\\",
    "/data/x */ DROP TABLE y; /* ",
    "/data/\"x\"; DROP TABLE y; --",
    "/data/`x`; DROP TABLE y; --",
    "cat.\"sch\"\"; DROP TABLE y; --\"",
    "\"cat\".\"sch\"; DROP TABLE y; --",
    "\"cat\"\".x\".\"s c h'; DROP TABLE y\"",
    "\"cat",
    "cat..sch",
    "",
];

/// A `--trace-path` reaches the SQL text only as data: for every dialect
/// and hostile value the script is refused (naming --trace-path, with a
/// hint), or has exactly the statements and keywords of a benign path, the
/// value confined to string literals, quoted identifiers and comments.
#[test]
fn trace_path_cannot_inject_sql_statements() {
    for dialect in [Dialect::Duckdb, Dialect::Spark, Dialect::Trino] {
        let benign = match dialect {
            Dialect::Trino => "cat.sch",
            _ => "/data/trace",
        };
        let want = skeleton(&script(&opts(dialect, benign)).unwrap(), dialect);
        let statements = want.iter().filter(|t| *t == ";").count();
        assert!(statements > 20, "{dialect:?}: {statements} statements");
        let mut accepted = 0;
        for path in HOSTILE {
            match script(&opts(dialect, path)) {
                Ok(sql) => {
                    accepted += 1;
                    let got = skeleton(&sql, dialect);
                    assert_eq!(got, want, "{dialect:?} {path:?}:\n{sql}");
                    // Every comment line stays one line.
                    let header = sql.lines().nth(1).unwrap();
                    assert!(header.starts_with("-- Trace: "), "{dialect:?} {path:?}");
                    assert!(!path.chars().any(char::is_control), "{dialect:?} {path:?}");
                }
                Err(msg) => {
                    assert!(msg.starts_with("--trace-path: "), "{msg}");
                    assert!(msg.contains("\n  hint: "), "{msg}");
                }
            }
        }
        // Paths are data for DuckDB and Spark: only the control characters
        // and the empty value are refused; Trino takes identifiers only.
        let expect = match dialect {
            Dialect::Trino => 2,
            _ => HOSTILE.len() - 4,
        };
        assert_eq!(accepted, expect, "{dialect:?}");
    }
    // Spark's scratch folder is data too: the same statements whatever it
    // holds, each stage written to and read back from it.
    let want = skeleton(
        &script(&opts(Dialect::Spark, "/data/trace")).unwrap(),
        Dialect::Spark,
    );
    for scratch in HOSTILE {
        let mut o = opts(Dialect::Spark, "/data/trace");
        o.spark_scratch = Some(scratch.to_string());
        match script(&o) {
            Ok(sql) => {
                assert_eq!(skeleton(&sql, Dialect::Spark), want, "{scratch:?}:\n{sql}");
                assert!(!sql.contains("CACHE TABLE"), "{scratch:?}");
            }
            Err(msg) => {
                assert!(msg.starts_with("--spark-scratch: "), "{msg}");
                assert!(msg.contains("\n  hint: "), "{msg}");
            }
        }
    }
    let o = cli::kvtrail(["sql", "--dialect", "duckdb", "--pools", "0,1"])
        .args(["--trace-path", "/data/trace", "--spark-scratch", "/tmp/x"])
        .run();
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("--spark-scratch"), "{}", o.stderr);
    // Through the binary: exit 2, the flag named, a hint.
    let o = cli::kvtrail(["sql", "--dialect", "trino", "--pools", "0,1"])
        .args(["--trace-path", "cat.sch.kv x; DROP TABLE y; --"])
        .run();
    let err = &o.stderr;
    assert_eq!(o.code, 2, "{err}");
    assert!(o.stdout_bytes.is_empty());
    assert!(
        err.contains("--trace-path") && err.contains("hint:"),
        "{err}"
    );
}

/// The hostile values the engines accept run as data: DuckDB reads a
/// trace folder whose name holds quotes, `;` and `--`, and Trino (through
/// sqlglot) a schema whose name holds them, with the results of `scope`.
#[test]
fn hostile_trace_paths_run_as_data_on_duckdb_and_trino() {
    let dir = tempfile::tempdir().unwrap();
    let name = "gap it's'; DROP VIEW kvtrail_gaps; -- \"x\"";
    let (_, tb) = traces()
        .into_iter()
        .find(|(n, _)| *n == "gap_possible")
        .unwrap();
    let t = tb.record(&dir.path().join(name));
    let path = t.to_str().unwrap().to_string();
    check_jobs(
        "duckdb",
        Dialect::Duckdb,
        &[("hostile".into(), t.clone(), path)],
        TRINO_SCHEMA,
    );
    let schema = "tr\"ace'; DROP TABLE kv; --";
    let trino_path = format!("src.\"{}\"", schema.replace('"', "\"\""));
    check_jobs(
        "trino-on-duckdb",
        Dialect::Trino,
        &[("hostile".into(), t, trino_path)],
        ["src", schema],
    );
}

/// A customer may call itself "(unknown)" or "(engine)": the SQL output
/// keeps such tenants apart from requests missing from the requests table
/// and from the engine (NULL tenant plus a kind column), and does not count
/// two requests of the same such tenant as cross-tenant.
#[test]
fn tenant_named_like_a_sentinel_is_not_confused_with_unattributed_requests() {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "(unknown)");
    tb.req(2, "(unknown)");
    tb.req(3, "(engine)");
    // 1 reads 2's KV: the same tenant.
    tb.write(0, 2, 0, 4);
    tb.read(0, 1, 0, 4);
    // 3 reads KV of request 9, which is not in the requests table.
    tb.write(0, 9, 8, 2);
    tb.read(0, 3, 8, 2);
    // 1 reads the engine's KV.
    tb.write(0, 0, 16, 2);
    tb.read(0, 1, 16, 2);
    // 8, not in the requests table, reads 2's KV.
    tb.write(0, 2, 20, 2);
    tb.read(0, 8, 20, 2);
    let dir = tempfile::tempdir().unwrap();
    let t = tb.record(&dir.path().join("t"));
    let path = t.to_str().unwrap().to_string();
    let Some(got) = run_engine(
        "duckdb",
        Dialect::Duckdb,
        &[("t".into(), t, path)],
        TRINO_SCHEMA,
    ) else {
        return;
    };
    let rows = |v: &str| -> Vec<String> {
        let mut r: Vec<String> = got["t"][v]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| match v {
                "kvtrail_response_sources" => format!(
                    "{} <- {} {} cross={}",
                    r["request_id"],
                    r["source_request_id"],
                    sql_who(r, "source_tenant"),
                    r["cross_tenant"]
                ),
                "kvtrail_affected_responses" => format!(
                    "{} {} cross={}",
                    r["request_id"],
                    sql_who(r, "tenant"),
                    r["cross_tenant"]
                ),
                _ => format!("{} {}", sql_who(r, "tenant"), r["request_ids"]),
            })
            .collect();
        r.sort();
        r
    };
    assert_eq!(
        rows("kvtrail_response_sources"),
        [
            "1 <- 0 engine cross=false",
            "1 <- 2 tenant:(unknown) cross=false",
            "3 <- 9 unknown cross=true",
            "8 <- 2 tenant:(unknown) cross=true",
        ]
    );
    assert_eq!(
        rows("kvtrail_affected_responses"),
        [
            "1 tenant:(unknown) cross=false",
            "3 tenant:(engine) cross=true",
            "8 unknown cross=true",
        ]
    );
    assert_eq!(
        rows("kvtrail_recipients"),
        [
            "tenant:(engine) \"3\"",
            "tenant:(unknown) \"1\"",
            "unknown \"8\"",
        ]
    );
    assert_eq!(
        rows("kvtrail_sources"),
        ["engine \"0\"", "tenant:(unknown) \"2\"", "unknown \"9\"",]
    );
}

/// The own-read trace with its write (pool 0, seq 1) lost: a hole natively.
fn own_read_with_a_hole(dir: &Path) -> (PathBuf, kvtrail::schema::KvEvent) {
    let (_, mut tb) = traces()
        .into_iter()
        .find(|(n, _)| *n == "own_read")
        .unwrap();
    let i = tb
        .events
        .iter()
        .position(|e| e.pool == 0 && e.seq == 1)
        .unwrap();
    let lost = tb.events.remove(i);
    (tb.by_hand(dir, 1, 7, false), lost)
}

/// Readers skip `*.parquet` under a name starting with `_` or `.` (a
/// writer's `_temporary/` attempt copies, staging folders) and part files
/// left open (`*.parquet.inprogress`), and scope lists them as files that
/// may hold rows. The DuckDB script read them through its `**` glob: a
/// stale `_temporary` copy of the one lost event filled the hole, and the
/// coverage said no gaps. It now reads exactly the native reader's files
/// and counts the others in `kvtrail_coverage.files_unread`.
#[test]
fn sql_reads_hidden_and_temporary_files_that_native_skips() {
    let dir = tempfile::tempdir().unwrap();
    let t = hidden_files_trace(&dir.path().join("t"));
    let native = scope(&t);
    assert_eq!(native.coverage.gaps.len(), 1, "the hole is seen natively");
    assert_eq!(native.coverage.files_unread.len(), 4);
    let path = t.to_str().unwrap().to_string();
    let jobs = [("hidden".to_string(), t.clone(), path)];
    check_jobs("duckdb", Dialect::Duckdb, &jobs, TRINO_SCHEMA);
    let Some(got) = run_engine("duckdb", Dialect::Duckdb, &jobs, TRINO_SCHEMA) else {
        return;
    };
    let c = &got["hidden"]["kvtrail_coverage"][0];
    assert_eq!(c["files_unread"], 4, "{c}");
    assert_eq!(c["complete"], false, "{c}");
}

/// [`own_read_with_a_hole`] with the lost event in three files the reader
/// skips (`_temporary/`, `.staging/`, `.part-*`) and a part file left open.
fn hidden_files_trace(dir: &Path) -> PathBuf {
    let (t, lost) = own_read_with_a_hole(dir);
    let kv = kvtrail::trace::write::kv_batch(&[lost]);
    for f in [
        "kv/batch=0/_temporary/part-00000.parquet",
        "kv/batch=0/.staging/part-00001.parquet",
        "kv/batch=0/.part-00002.parquet",
    ] {
        kvtrail::trace::write::write_single_file(&t.join(f), std::slice::from_ref(&kv)).unwrap();
    }
    std::fs::copy(
        t.join("kv/batch=0/_temporary/part-00000.parquet"),
        t.join("kv/batch=0/part-00003.parquet.inprogress"),
    )
    .unwrap();
    t
}

/// Native readers refuse two events with the same (pool, seq), and two
/// requests with the same id (exit 2). The SQL counted them silently; it
/// now counts them in `kvtrail_coverage` (`duplicate_events`,
/// `duplicate_requests`), and the coverage is not complete.
#[test]
fn sql_counts_duplicate_pool_seq_rows_silently() {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut tb) = traces()
        .into_iter()
        .find(|(n, _)| *n == "own_read")
        .unwrap();
    let dup = tb.events[2];
    tb.events.push(dup);
    let req = tb.requests[0].clone();
    tb.requests.push(req);
    let t = tb.by_hand(&dir.path().join("t"), 2, 7, false);
    for (engine, dialect, path) in [
        ("duckdb", Dialect::Duckdb, t.to_str().unwrap().to_string()),
        ("trino-on-duckdb", Dialect::Trino, TRINO_SCHEMA.join(".")),
    ] {
        let Some(got) = run_engine(
            engine,
            dialect,
            &[("dup".into(), t.clone(), path)],
            TRINO_SCHEMA,
        ) else {
            return;
        };
        let c = &got["dup"]["kvtrail_coverage"][0];
        assert_eq!(c["duplicate_events"], 1, "{engine}: {c}");
        assert_eq!(c["duplicate_requests"], 1, "{engine}: {c}");
        assert_eq!(c["complete"], false, "{engine}: {c}");
    }
}

/// Two `mixed` pools (no `cache` role) that copy both ways: acme's KV is
/// offloaded from pool 0 to pool 1, loaded back, offloaded and loaded back
/// again (a chain of four copies), then shared to globex, which reads it:
/// a prefix-cache hit, no exposure, and no event lost.
fn mixed_round_trips() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![pool(0, Role::Mixed, 64), pool(1, Role::Mixed, 64)]);
    tb.req(1, "acme");
    tb.req(2, "globex");
    let w = tb.write(0, 1, 0, 4);
    let c1 = tb.copy(1, 0, 0, 4, 0, 0, w);
    let c2 = tb.copy(0, 0, 8, 4, 1, 0, c1);
    let c3 = tb.copy(1, 0, 8, 4, 0, 8, c2);
    tb.copy(0, 0, 16, 4, 1, 8, c3);
    tb.read(0, 1, 16, 4);
    tb.share(0, 2, 16, 4);
    tb.read(0, 2, 16, 4);
    tb
}

/// Runs one script on DuckDB; None (after a SKIP line) without the venv.
fn run_duckdb_script(sql: &Path, trace: &Path) -> Option<Value> {
    let py = venv::SQL.python()?;
    let work = tempfile::tempdir().unwrap();
    let jobs = work.path().join("jobs.json");
    let job = serde_json::json!([{"name": "t", "sql": sql, "trace": trace}]);
    std::fs::write(&jobs, job.to_string()).unwrap();
    let out = work.path().join("out.json");
    let runner = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sql/run_sql.py");
    let r = Command::new(py)
        .arg(runner)
        .args(["duckdb".as_ref(), jobs.as_os_str(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    Some(got["t"].clone())
}

/// `kvtrail sql`'s default copy levels come from the data: pools that copy
/// both ways without a `cache` role get the levels their longest chain
/// needs, and the script agrees with native scope (no affected response,
/// the shared read listed, complete evidence).
#[test]
fn sql_default_copy_levels_follow_the_data_on_mixed_pools_copying_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let t = mixed_round_trips().record(&dir.path().join("t"));
    let native = scope(&t);
    assert!(
        native.affected_responses.is_empty(),
        "{:?}",
        native.affected_responses
    );
    assert!(native.coverage.complete);
    let f = dir.path().join("l.sql");
    let o = cli::kvtrail(["sql", "--dialect", "duckdb", "--trace-path"])
        .arg(&t)
        .arg("--out")
        .arg(&f)
        .run();
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stderr.contains("longest copy chain 4 copies"),
        "{}",
        o.stderr
    );
    let sql = std::fs::read_to_string(&f).unwrap();
    assert!(
        sql.contains("3 pointer-jumping level(s)"),
        "{}",
        &sql[..400]
    );
    let Some(got) = run_duckdb_script(&f, &t) else {
        return;
    };
    let c = &got["kvtrail_coverage"][0];
    assert_eq!(c["copies_unresolved"], 0, "{c}");
    assert_eq!(c["complete"], true, "{c}");
    let mut want = native_lines(&native);
    want.extend(native_shared_lines(&t));
    want.sort();
    assert_eq!(sql_lines(&got), want);
}

/// A chain longer than the script's levels is uncertain for its own
/// reason (`copy_chain_unresolved`), never `after_gap`: no event was lost.
#[test]
fn sql_unresolved_copy_chain_has_its_own_reason_not_after_gap() {
    let dir = tempfile::tempdir().unwrap();
    let t = mixed_round_trips().record(&dir.path().join("t"));
    let f = dir.path().join("l.sql");
    let o = cli::kvtrail([
        "sql",
        "--dialect",
        "duckdb",
        "--copy-levels",
        "1",
        "--trace-path",
    ])
    .arg(&t)
    .arg("--out")
    .arg(&f)
    .run();
    assert_eq!(o.code, 0, "{}", o.stderr);
    let Some(got) = run_duckdb_script(&f, &t) else {
        return;
    };
    let c = &got["kvtrail_coverage"][0];
    assert!(c["copies_unresolved"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["gaps"], 0, "{c}");
    let affected = got["kvtrail_affected_responses"].as_array().unwrap();
    assert!(!affected.is_empty());
    for a in affected {
        let reasons = a["reasons"].as_str().unwrap();
        assert_eq!(reasons, "copy_chain_unresolved", "{a}");
        assert_eq!(a["confidence"], "possible", "{a}");
    }
}
