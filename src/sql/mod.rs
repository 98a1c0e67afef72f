//! `kvtrail::sql`: the complete lineage of trace format v1 as portable SQL
//! over the trace's two tables, for responders whose traces live in a
//! warehouse or an object store (DuckDB, Spark, Trino).
//!
//! The generated script is a list of statements, each preceded by comments:
//! typed views over the raw Parquet, one statement per rule of the
//! "Semantics" section (revision 2: content owner and current/stale bit per
//! slot; views, and tables for the stages read more than once, ending in
//! the table of every non-clean read slot), and the result views, which
//! mirror `scope --out`:
//! `kvtrail_affected_responses`, `kvtrail_response_sources`,
//! `kvtrail_recipients`, `kvtrail_sources`, `kvtrail_blank_reads`,
//! `kvtrail_cross_tenant_shared`, `kvtrail_cross_tenant_shared_sources`,
//! `kvtrail_gaps`, `kvtrail_copies_past_end`, `kvtrail_coverage`.
//!
//! Portability: no ASOF JOIN, no recursion. "The latest content event (or
//! `alloc`) of a slot at or before seq X" is a running `max(seq)` window
//! over `(pool, slot)` (seq increases, so it equals
//! `last_value(.. ignore nulls)` and needs no dialect-specific null
//! handling). Content set by a content event is stale at X when an `alloc`
//! of the slot lies after the event and at or before X; a copy also takes
//! its source's bit. Copies are resolved by pointer jumping: every copy slot
//! points at the source slot's content event; each level joins the pointers
//! with themselves (owner, uncertainty and staleness alike), so after `k`
//! levels chains of up to `2^k - 1` copies are resolved. No level count is
//! sound for every trace: copies may go both ways between pools (a device
//! pool offloading to a `cache` tier and loading back), so a chain may visit
//! a pool many times. `kvtrail sql` takes the levels from the data when it
//! can read the trace ([`levels_for_chain`] of the longest copy chain the
//! replay finds), else [`copy_levels`] of the manifest (enough for any
//! chain when copies form a DAG over the pools; 6 levels, chains of 63
//! copies, when pools may copy both ways), or `--copy-levels`; every copy
//! slot still pending after the last level is counted in
//! `kvtrail_coverage.copies_unresolved` (then not complete), and reads of
//! it are uncertain (reason `copy_chain_unresolved`, not `after_gap`: no
//! event was lost), never clean.
//!
//! Request ids and seqs are read as signed 64-bit integers (ids below 2^63);
//! the owner sentinels are -1 (never written) and -2 (scrubbed). What the
//! native engine reports as an error is not refused here: duplicate
//! (pool, seq) and request ids are counted in `kvtrail_coverage` (which is
//! then not complete); unknown pools and copy cycles are not checked: run
//! `kvtrail verify` / `kvtrail inspect`.
//!
//! Files: DuckDB reads exactly the native reader's files (`*.parquet`, none
//! under a name starting with `_` or `.`) and counts the others that may
//! hold rows in `kvtrail_coverage.files_unread`; Spark's file listing skips
//! the same names but cannot count them from SQL; Trino reads its tables.
//!
//! A tenant column holds a name or NULL plus a kind column
//! (`tenant` | `unknown` | `engine`), never a marker string. The script is
//! checked against `scope` on DuckDB, local Spark and (Trino) through
//! sqlglot's Trino grammar transpiled to DuckDB (tests/it/sql_engines.rs);
//! bench/fleet.py measures all of them.
//!
//! Files: `options.rs` (what the script is specialised on; copy levels),
//! `source.rs` (the checked trace path or schema), `dialect.rs` (the
//! dialects' spelling and quoting), `script.rs` (statements and their
//! comments), and one file per part of the script, in order: `inputs.rs`
//! (header, raw and typed tables), `rules.rs` (the lineage rules),
//! `results.rs` (the result views and coverage).

mod dialect;
mod inputs;
mod options;
mod results;
mod rules;
mod script;
mod source;

pub use dialect::{Dialect, SEPARATOR};
pub use options::{
    CACHE_COPY_LEVELS, MAX_COPY_LEVELS, SqlOptions, copy_levels, levels, levels_for_chain,
    spark_scratch_default,
};
pub use results::RESULT_VIEWS;
pub use source::{MAX_IDENT, MAX_TRACE_PATH};

use crate::error::Result;
use dialect::Syntax;
use script::Script;
use source::{check_scratch, check_source};

/// Generates the whole script, one stage after the other. Errors when
/// `opts.trace_path` is refused for the dialect (see [`MAX_TRACE_PATH`];
/// docs/limits.md).
pub fn generate(opts: &SqlOptions) -> Result<String> {
    let src = check_source(opts.dialect, &opts.trace_path)?;
    let scratch = match &opts.spark_scratch {
        Some(s) => check_scratch(s)?,
        None => spark_scratch_default(&opts.trace_path),
    };
    let sx = Syntax {
        dialect: opts.dialect,
        scratch,
    };
    let pools = if opts.pools.is_empty() {
        "-1".to_string()
    } else {
        opts.pools
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let lv = opts.copy_levels.clamp(1, MAX_COPY_LEVELS);
    let mut s = Script::default();
    inputs::header(&mut s, opts, &sx, &pools, lv);
    inputs::raw_tables(&mut s, &sx, &src);
    inputs::typed(&mut s, &sx, &src, &pools);
    rules::holes(&mut s, &sx);
    rules::content(&mut s, &sx);
    rules::provenance(&mut s, &sx, lv);
    rules::reads(&mut s, &sx, lv, opts.from_engine_start);
    results::responses(&mut s, &sx, opts.complete);
    results::shared(&mut s, &sx);
    results::holes_and_ends(&mut s, &sx);
    results::coverage(&mut s, opts, &sx, &src, lv);
    Ok(s.into_string())
}

/// Splits a generated script into its statements (without the trailing `;`).
pub fn statements(script: &str) -> Vec<String> {
    script
        .split(SEPARATOR)
        .map(|st| {
            st.lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .filter(|st| !st.trim().is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_cover_the_longest_copy_chain() {
        // (pools, levels): a chain over n pools has n - 1 copies <= 2^k - 1.
        for (n, k) in [
            (0, 1),
            (1, 1),
            (2, 1),
            (3, 2),
            (4, 2),
            (5, 3),
            (8, 3),
            (9, 4),
        ] {
            assert_eq!(levels(n), k, "{n} pools");
            assert!(n.max(1) - 1 < 1 << k);
        }
    }

    #[test]
    fn levels_for_chain_resolve_exactly_that_deep() {
        for (copies, k) in [
            (0, 1),
            (1, 1),
            (2, 2),
            (3, 2),
            (4, 3),
            (7, 3),
            (8, 4),
            (63, 6),
        ] {
            assert_eq!(levels_for_chain(copies), k, "{copies} copies");
        }
        assert_eq!(levels_for_chain(u64::MAX), MAX_COPY_LEVELS);
    }

    #[test]
    fn a_cache_pool_deepens_the_copy_levels() {
        use crate::trace::{Pool, Role};
        let pool = |id, role| Pool {
            id,
            name: format!("p{id}"),
            role,
            capacity_tokens: 64,
            page_size: 1,
            extra: Default::default(),
        };
        let pd = [pool(0, Role::Prefill), pool(1, Role::Decode)];
        assert_eq!(copy_levels(&pd), 1);
        let tiered = [
            pool(0, Role::Prefill),
            pool(1, Role::Decode),
            pool(2, Role::Cache),
        ];
        assert_eq!(copy_levels(&tiered), CACHE_COPY_LEVELS);
        // Two mixed pools may offload to each other and load back.
        let mixed = [pool(0, Role::Mixed), pool(1, Role::Mixed)];
        assert_eq!(copy_levels(&mixed), CACHE_COPY_LEVELS);
        assert_eq!(copy_levels(&[pool(0, Role::Mixed)]), 1);
        let o = SqlOptions {
            dialect: Dialect::Duckdb,
            trace_path: "t".into(),
            pools: vec![0, 1, 2],
            from_engine_start: true,
            complete: true,
            unverifiable: false,
            copy_levels: copy_levels(&tiered),
            spark_scratch: None,
        };
        let sql = generate(&o).unwrap();
        assert!(sql.contains("kvtrail_lineage_6 AS") && !sql.contains("kvtrail_lineage_7 AS"));
        assert!(sql.contains("up to 63 copies deep"));
        assert!(sql.contains("AS copies_unresolved"));
    }

    #[test]
    fn every_dialect_creates_every_result_view() {
        for d in [Dialect::Duckdb, Dialect::Spark, Dialect::Trino] {
            let o = SqlOptions {
                dialect: d,
                trace_path: match d {
                    Dialect::Trino => "hive.kvtrail_incident".into(),
                    _ => "s3://bucket/trace".into(),
                },
                pools: vec![0, 1, 2],
                from_engine_start: true,
                complete: true,
                unverifiable: false,
                copy_levels: levels(3),
                spark_scratch: None,
            };
            let sql = generate(&o).unwrap();
            for v in RESULT_VIEWS {
                assert!(sql.contains(&format!("VIEW {v} AS")), "{d:?} {v}");
            }
            assert!(
                sql.contains("kvtrail_lineage_2"),
                "{d:?}: two levels for 3 pools"
            );
            assert!(!sql.contains("kvtrail_lineage_3"));
            // Spark writes each stage out and reads it back: no cached
            // views, whose plans would double per level.
            if d == Dialect::Spark {
                assert!(!sql.contains("CACHE TABLE"));
                assert_eq!(
                    sql.matches("INSERT OVERWRITE DIRECTORY").count(),
                    sql.matches(" USING parquet OPTIONS (path '$").count(),
                );
            }
            assert!(statements(&sql).iter().all(|s| !s.contains(SEPARATOR)));
        }
    }
}
