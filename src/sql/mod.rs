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

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{Error, Location, Result};
use crate::trace::manifest::Manifest;

/// The SQL engine the script is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// DuckDB: `read_parquet` over `<path>/kv/**/*.parquet`, temp tables.
    Duckdb,
    /// Spark SQL: temporary views `USING parquet` (recursive file lookup);
    /// the materialised stages are written as Parquet to a scratch folder
    /// (`INSERT OVERWRITE DIRECTORY`) and read back through views.
    Spark,
    /// Trino: `<path>` is `catalog.schema` holding tables `kv` and
    /// `requests`; the materialised stages are created with CTAS (needs a
    /// writable schema).
    Trino,
}

impl Dialect {
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Duckdb => "duckdb",
            Dialect::Spark => "spark",
            Dialect::Trino => "trino",
        }
    }
}

/// What the generator specialises the SQL on.
#[derive(Debug, Clone)]
pub struct SqlOptions {
    pub dialect: Dialect,
    /// Trace directory or URI (DuckDB, Spark); `catalog.schema` (Trino).
    pub trace_path: String,
    /// Pool ids of the deployment.
    pub pools: Vec<u16>,
    /// `capture.from_engine_start`: never-written reads are blank, else unknown.
    pub from_engine_start: bool,
    /// `capture.complete`: without it every finding is at most possible.
    pub complete: bool,
    /// The manifest has no `files` list (nothing can be verified).
    pub unverifiable: bool,
    /// Pointer-jumping levels for copy chains (chains of up to
    /// `2^copy_levels - 1` copies are resolved; at least 1).
    pub copy_levels: usize,
    /// Spark: the folder (URI) the materialised stages are written to;
    /// `None`: [`spark_scratch_default`] of the trace path.
    pub spark_scratch: Option<String>,
}

impl SqlOptions {
    /// Options read from a trace's manifest.
    pub fn from_manifest(m: &Manifest, dialect: Dialect, trace_path: &str) -> Self {
        let mut pools: Vec<u16> = m.deployment.pools.iter().map(|p| p.id).collect();
        pools.sort_unstable();
        SqlOptions {
            dialect,
            trace_path: trace_path.to_string(),
            pools,
            from_engine_start: m.from_engine_start(),
            complete: m.capture.complete,
            unverifiable: m.files.is_none(),
            copy_levels: copy_levels(&m.deployment.pools),
            spark_scratch: None,
        }
    }
}

/// Spark's default scratch folder for a trace path: under the session's
/// warehouse folder (`${spark.sql.warehouse.dir}`, which Spark substitutes
/// when it parses the statement), one sub-folder per trace path (the first
/// 16 hex digits of its blake3), so scripts over different traces never
/// share one.
pub fn spark_scratch_default(trace_path: &str) -> String {
    let h = blake3::hash(trace_path.as_bytes()).to_hex();
    format!("${{spark.sql.warehouse.dir}}/kvtrail-scratch/{}", &h[..16])
}

/// The result views, in the order the script creates them.
pub const RESULT_VIEWS: &[&str] = &[
    "kvtrail_affected_responses",
    "kvtrail_response_sources",
    "kvtrail_recipients",
    "kvtrail_sources",
    "kvtrail_blank_reads",
    "kvtrail_cross_tenant_shared",
    "kvtrail_cross_tenant_shared_sources",
    "kvtrail_gaps",
    "kvtrail_copies_past_end",
    "kvtrail_coverage",
];

/// Pointer-jumping levels needed for copy chains over `pools` pools when
/// copies form a DAG over the pools: a chain visits each pool at most once,
/// so it has at most `pools - 1` copies, and `k` levels resolve `2^k - 1`.
pub fn levels(pools: usize) -> usize {
    let mut k = 1;
    while (1usize << k) < pools.max(2) {
        k += 1;
    }
    k
}

/// Levels for chains of up to `copies` copies: the fewest `k` (at least 1)
/// with `2^k - 1 >= copies`, at most [`MAX_COPY_LEVELS`]. What `kvtrail sql`
/// takes when it can read the trace: the longest chain the data holds
/// (`lineage::chains::copy_chains`).
pub fn levels_for_chain(copies: u64) -> usize {
    let mut k = 1;
    while k < MAX_COPY_LEVELS && ((1u64 << k) - 1) < copies {
        k += 1;
    }
    k
}

/// Levels when the manifest alone is at hand and its pools may copy both
/// ways (a `cache` tier, or `mixed` pools that offload to each other and
/// load back): a chain may pass through the same pools many times; 6
/// levels resolve chains of 63 copies (31 round trips).
pub const CACHE_COPY_LEVELS: usize = 6;

/// Most levels accepted (`--copy-levels`): chains of 2^20 - 1 copies.
pub const MAX_COPY_LEVELS: usize = 20;

/// The generator's levels from the manifest alone (when the data cannot be
/// read): [`levels`] of the pool count when copies can only flow one way
/// (prefill and decode pools: a DAG), at least [`CACHE_COPY_LEVELS`] when
/// two pools may copy to each other (a `cache` or `mixed` pool beside
/// another pool). Chains longer than that are counted in
/// `kvtrail_coverage.copies_unresolved`.
pub fn copy_levels(pools: &[crate::trace::Pool]) -> usize {
    let k = levels(pools.len());
    let both_ways = pools.len() > 1
        && pools.iter().any(|p| {
            matches!(
                p.role,
                crate::trace::Role::Cache | crate::trace::Role::Mixed
            )
        });
    if both_ways {
        k.max(CACHE_COPY_LEVELS)
    } else {
        k
    }
}

/// Statement separator: every statement ends with `;` at the end of a line.
pub const SEPARATOR: &str = ";\n";

/// Longest `--trace-path` accepted, in bytes.
pub const MAX_TRACE_PATH: usize = 4096;
/// Longest part of a Trino `catalog.schema`, in bytes.
pub const MAX_IDENT: usize = 128;

/// Where the script reads the trace, checked: the only user value that
/// reaches the SQL text. A path (DuckDB, Spark) only ever appears inside a
/// string literal, a Trino schema only as double-quoted identifiers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// Directory or URI, without trailing `/`.
    Path(String),
    /// `[catalog.]schema`, unquoted parts.
    Schema(Vec<String>),
}

fn bad_path(what: String, hint: &str) -> Error {
    Error::invalid(Location::file(Path::new("--trace-path")), what, hint)
}

/// Control characters, and the Unicode line and paragraph separators
/// (line breaks to some editors and engines).
fn is_control_or_break(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Checks `--spark-scratch` as a Spark trace path is checked: not empty,
/// at most [`MAX_TRACE_PATH`] bytes, no control characters.
fn check_scratch(path: &str) -> Result<String> {
    let bad = |what: String| {
        Error::invalid(
            Location::file(Path::new("--spark-scratch")),
            what,
            "give a folder or URI every Spark executor can write (hdfs://..., s3a://bucket/tmp)",
        )
    };
    if path.len() > MAX_TRACE_PATH {
        return Err(bad(format!(
            "{} bytes, over the limit of {MAX_TRACE_PATH}",
            path.len()
        )));
    }
    if let Some(c) = path.chars().find(|&c| is_control_or_break(c)) {
        return Err(bad(format!("contains the control character {c:?}")));
    }
    let p = path.trim_end_matches('/');
    if p.is_empty() {
        return Err(bad("empty".into()));
    }
    Ok(p.to_string())
}

/// A trace URL as `dialect`'s engine names it: DuckDB's httpfs and azure
/// extensions read `s3://`, `gs://`, `az://`, `abfss://` and `http(s)://`
/// (an `s3a://` URL is its `s3://`); Spark's Hadoop connectors read `s3a://`
/// (for `s3://`), `gs://` and `abfs(s)://`. Refused: what the engine
/// cannot list as a folder (Spark over HTTP(S); `az://`, which names no
/// storage account). A local path is unchanged.
fn engine_url(dialect: Dialect, p: &str) -> Result<String> {
    let Some((scheme, rest)) = p.split_once("://") else {
        return Ok(p.to_string());
    };
    let scheme = scheme.to_ascii_lowercase();
    let hint = "give the trace's folder as s3://, gs://, az:// or https:// (DuckDB) or s3a://, gs://, abfss:// (Spark); docs/object-storage.md";
    match (dialect, scheme.as_str()) {
        (Dialect::Duckdb, "s3a") => Ok(format!("s3://{rest}")),
        (Dialect::Duckdb, "s3" | "gs" | "gcs" | "az" | "azure" | "abfss" | "http" | "https") => {
            Ok(format!("{scheme}://{rest}"))
        }
        (Dialect::Spark, "s3" | "s3a") => Ok(format!("s3a://{rest}")),
        (Dialect::Spark, "gs" | "abfs" | "abfss") => Ok(format!("{scheme}://{rest}")),
        (Dialect::Spark, "az" | "azure") => Err(bad_path(
            format!("{p:?}: Spark names an Azure folder with its storage account"),
            "give --trace-path abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH",
        )),
        (Dialect::Spark, "http" | "https") => Err(bad_path(
            format!("{p:?}: Spark cannot list a folder over HTTP(S)"),
            "copy the trace to object storage (s3a://, gs://, abfss://) or to the cluster's file system",
        )),
        _ => Err(bad_path(
            format!(
                "{p:?}: the {} engine does not read `{scheme}://` URLs",
                dialect.as_str()
            ),
            hint,
        )),
    }
}

/// Checks `--trace-path` for `dialect`. Refused: an empty value, more than
/// [`MAX_TRACE_PATH`] bytes, any control character (a line break would end
/// a `--` comment or split a statement); for Trino anything but
/// `catalog.schema` or `schema`, each part a plain identifier
/// (`[A-Za-z_][A-Za-z0-9_]*`) or a double-quoted one (`""` for `"`), at
/// most [`MAX_IDENT`] bytes.
fn check_source(dialect: Dialect, path: &str) -> Result<Source> {
    if path.len() > MAX_TRACE_PATH {
        return Err(bad_path(
            format!("{} bytes, over the limit of {MAX_TRACE_PATH}", path.len()),
            "give the trace's directory, URI or catalog.schema",
        ));
    }
    if let Some(c) = path.chars().find(|&c| is_control_or_break(c)) {
        return Err(bad_path(
            format!("contains the control character {:?}", c),
            "a trace path or schema name has no control characters or line breaks: check the value (quoting in the calling script)",
        ));
    }
    if dialect != Dialect::Trino {
        let p = path.trim_end_matches('/');
        if p.is_empty() {
            return Err(bad_path(
                "empty".into(),
                "give the trace's directory or URI (s3://bucket/trace)",
            ));
        }
        return engine_url(dialect, p).map(Source::Path);
    }
    if path.contains("://") {
        return Err(bad_path(
            format!("{path:?} is a URL; Trino reads tables, not folders"),
            "register the trace's kv/ and requests/ prefixes as external tables of a Trino catalog (e.g. Hive: external_location = 's3://bucket/trace/kv'), then give catalog.schema; docs/object-storage.md",
        ));
    }
    let hint = "Trino reads tables: give catalog.schema (or schema) holding the tables kv and requests; quote a part that is not a plain identifier with double quotes, e.g. hive.\"kv-trail\"";
    let mut parts = Vec::new();
    let mut rest = path;
    loop {
        let (part, after) = if let Some(q) = rest.strip_prefix('"') {
            // A quoted part: up to the first lone `"`.
            let mut name = String::new();
            let mut chars = q.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '"')) if q[i + 1..].starts_with('"') => {
                        name.push('"');
                        chars.next();
                    }
                    Some((i, '"')) => break Some(i + 1),
                    Some((_, c)) => name.push(c),
                    None => break None,
                }
            };
            let Some(end) = end else {
                return Err(bad_path(
                    format!("unterminated quoted identifier in {path:?}"),
                    hint,
                ));
            };
            (name, &q[end..])
        } else {
            let end = rest.find('.').unwrap_or(rest.len());
            let name = &rest[..end];
            let plain = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !plain {
                return Err(bad_path(
                    format!("{name:?} in {path:?} is not a plain identifier"),
                    hint,
                ));
            }
            (name.to_string(), &rest[end..])
        };
        if part.is_empty() || part.len() > MAX_IDENT {
            return Err(bad_path(
                format!("an identifier in {path:?} is empty or over {MAX_IDENT} bytes"),
                hint,
            ));
        }
        parts.push(part);
        if after.is_empty() {
            break;
        }
        let Some(next) = after.strip_prefix('.') else {
            return Err(bad_path(
                format!("unexpected {after:?} after a quoted identifier in {path:?}"),
                hint,
            ));
        };
        rest = next;
    }
    if parts.len() > 2 {
        return Err(bad_path(
            format!(
                "{path:?} has {} parts; the script appends the table names itself",
                parts.len()
            ),
            hint,
        ));
    }
    Ok(Source::Schema(parts))
}

/// A string literal of `dialect`. DuckDB and Trino double `'`; Spark's
/// lexer also treats `\` as an escape, so both are backslash-escaped there.
fn literal(dialect: Dialect, s: &str) -> String {
    match dialect {
        Dialect::Spark => format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'")),
        _ => format!("'{}'", s.replace('\'', "''")),
    }
}

/// DuckDB: whether `file` (from `glob`) has a name starting with `_` or
/// `.` below `<p>/<table>/`, the files the native reader skips.
fn duckdb_hidden(dialect: Dialect, p: &str, table: &str) -> String {
    let prefix = literal(dialect, &format!("{p}/{table}/"));
    format!("regexp_matches(substr(file, length({prefix}) + 1), '(^|/)[._]')")
}

/// A double-quoted identifier (Trino, standard SQL).
fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A value as it may appear in a `--` comment: line breaks and other
/// control characters escaped, so the comment cannot end early.
fn comment_text(s: &str) -> String {
    s.chars()
        .map(|c| {
            if is_control_or_break(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The dialect, and where Spark writes the materialised stages.
struct D(Dialect, String);

impl D {
    /// A FROM item for a raw table (`kv` or `requests`).
    fn raw(&self, src: &Source, table: &str) -> String {
        match (self.0, src) {
            (Dialect::Duckdb, Source::Path(_)) => format!(
                "read_parquet(getvariable('kvtrail_{table}_files'), union_by_name = true, hive_partitioning = true)"
            ),
            (Dialect::Trino, Source::Schema(parts)) => {
                let mut q: Vec<String> = parts.iter().map(|p| quote_ident(p)).collect();
                q.push(quote_ident(table));
                q.join(".")
            }
            _ => format!("kvtrail_{table}_raw"),
        }
    }

    fn view(&self, name: &str) -> String {
        match self.0 {
            Dialect::Duckdb => format!("CREATE OR REPLACE TEMP VIEW {name} AS"),
            Dialect::Spark => format!("CREATE OR REPLACE TEMPORARY VIEW {name} AS"),
            Dialect::Trino => format!("CREATE OR REPLACE VIEW {name} AS"),
        }
    }

    /// Statements that materialise `name` from the query that follows
    /// (closed by [`D::table_end`]).
    ///
    /// Spark: a cached view keeps its query, and Spark's analyser expands it
    /// at every reference before it substitutes the cached data, so each
    /// pointer-jumping level, which reads the one before twice, would cost
    /// twice its predecessor to plan. The stage is written out as Parquet
    /// instead and read back through a view over the files, whose plan is a
    /// scan: planning stays linear in the levels.
    fn table(&self, name: &str) -> String {
        match self.0 {
            Dialect::Duckdb => format!("CREATE OR REPLACE TEMP TABLE {name} AS"),
            Dialect::Spark => format!(
                "INSERT OVERWRITE DIRECTORY {} USING parquet",
                literal(self.0, &format!("{}/{name}", self.1))
            ),
            Dialect::Trino => {
                format!("DROP TABLE IF EXISTS {name}{SEPARATOR}CREATE TABLE {name} AS")
            }
        }
    }

    /// What follows the query of a [`D::table`] (Spark: the view over the
    /// written files).
    fn table_end(&self, name: &str) -> String {
        match self.0 {
            Dialect::Spark => format!(
                "{SEPARATOR}CREATE OR REPLACE TEMPORARY VIEW {name} USING parquet OPTIONS (path {})",
                literal(self.0, &format!("{}/{name}", self.1))
            ),
            _ => String::new(),
        }
    }

    /// A CTE body exploding the extents of `src` (alias e) into one row per
    /// slot offset `i`.
    fn explode(&self, src: &str, filter: &str) -> String {
        match self.0 {
            Dialect::Duckdb => {
                format!("SELECT e.*, unnest(range(e.slot_count)) AS i FROM {src} e WHERE {filter}")
            }
            Dialect::Spark => format!(
                "SELECT e.*, explode(sequence(CAST(0 AS BIGINT), e.slot_count - 1)) AS i FROM {src} e WHERE {filter}"
            ),
            Dialect::Trino => format!(
                "SELECT e.*, x.i FROM {src} e CROSS JOIN UNNEST(sequence(CAST(0 AS BIGINT), e.slot_count - 1)) AS x(i) WHERE {filter}"
            ),
        }
    }

    /// Aggregate: the distinct values of a numeric expression, ascending,
    /// joined by ','.
    fn num_list(&self, x: &str) -> String {
        match self.0 {
            Dialect::Duckdb => format!("array_to_string(list_sort(list_distinct(list({x}))), ',')"),
            Dialect::Spark => format!(
                "concat_ws(',', transform(array_sort(collect_set({x})), v -> CAST(v AS STRING)))"
            ),
            Dialect::Trino => {
                format!("array_join(array_sort(array_distinct(array_agg({x}))), ',')")
            }
        }
    }

    /// Aggregate: the distinct values of a string expression, sorted, joined by ','.
    fn str_list(&self, x: &str) -> String {
        match self.0 {
            Dialect::Duckdb => format!("array_to_string(list_sort(list_distinct(list({x}))), ',')"),
            Dialect::Spark => format!("concat_ws(',', array_sort(collect_set({x})))"),
            Dialect::Trino => {
                format!("array_join(array_sort(array_distinct(array_agg({x}))), ',')")
            }
        }
    }

    fn hex(&self, x: &str) -> String {
        match self.0 {
            Dialect::Duckdb | Dialect::Spark => format!("lower(hex({x}))"),
            Dialect::Trino => format!("lower(to_hex({x}))"),
        }
    }

    fn string(&self) -> &'static str {
        match self.0 {
            Dialect::Spark => "STRING",
            _ => "VARCHAR",
        }
    }
}

fn b(v: bool) -> &'static str {
    if v { "TRUE" } else { "FALSE" }
}

/// Generates the whole script. Errors when `opts.trace_path` is refused
/// for the dialect (see [`MAX_TRACE_PATH`]; docs/limits.md).
pub fn generate(opts: &SqlOptions) -> Result<String> {
    let src = check_source(opts.dialect, &opts.trace_path)?;
    let scratch = match &opts.spark_scratch {
        Some(s) => check_scratch(s)?,
        None => spark_scratch_default(&opts.trace_path),
    };
    let d = D(opts.dialect, scratch);
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
    let mut s = String::new();
    let _ = writeln!(
        s,
        "-- kvtrail lineage, trace format v1, dialect {}, generated by kvtrail {}.",
        opts.dialect.as_str(),
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        s,
        "-- Trace: {}; pools [{pools}]; from_engine_start {}; capture complete {}; files listed {}.",
        comment_text(&opts.trace_path),
        opts.from_engine_start,
        opts.complete,
        !opts.unverifiable
    );
    let _ = writeln!(
        s,
        "-- Copy chains resolved through {lv} pointer-jumping level(s) (up to {} copies deep).",
        (1usize << lv) - 1
    );
    if opts.dialect == Dialect::Spark {
        let _ = writeln!(
            s,
            "-- Scratch: the materialised stages are written as Parquet under {} (one folder per stage,\n\
             -- overwritten by the next run; the result views read them: delete the folder after reading the results).",
            comment_text(&d.1)
        );
    }
    s.push_str(
        "-- Results: SELECT * FROM kvtrail_affected_responses (and the other kvtrail_* views listed at the end).\n\n",
    );
    let stmt = |s: &mut String, comment: &str, body: String| {
        for l in comment.trim().lines() {
            let _ = writeln!(s, "-- {}", l.trim());
        }
        s.push_str(body.trim_end());
        s.push_str(SEPARATOR);
        s.push('\n');
    };

    if let (Dialect::Duckdb, Source::Path(p)) = (opts.dialect, &src) {
        for t in ["kv", "requests"] {
            stmt(
                &mut s,
                &format!(
                    "The {t} files the native reader reads: every *.parquet under {t}/ at any depth,
except under a name (file or folder below {t}/) starting with `_` or `.`
(a writer's _temporary/ attempt copies, staging folders): see files_unread."
                ),
                format!(
                    "SET VARIABLE kvtrail_{t}_files = (
  SELECT coalesce(list(file ORDER BY file), []) FROM glob({})
  WHERE NOT {})",
                    literal(opts.dialect, &format!("{p}/{t}/**/*.parquet")),
                    duckdb_hidden(opts.dialect, p, t)
                ),
            );
        }
    }
    if let (Dialect::Spark, Source::Path(p)) = (opts.dialect, &src) {
        for t in ["kv", "requests"] {
            stmt(
                &mut s,
                &format!(
                    "The raw {t} table: every Parquet file under {t}/ at any depth (Hive folders are plain folders here)."
                ),
                format!(
                    "CREATE OR REPLACE TEMPORARY VIEW kvtrail_{t}_raw USING parquet\n  OPTIONS (path {}, recursiveFileLookup 'true', mergeSchema 'true', pathGlobFilter '*.parquet')",
                    literal(opts.dialect, &format!("{p}/{t}"))
                ),
            );
        }
    }

    stmt(
        &mut s,
        "kv events, typed (ids and seqs as BIGINT), restricted to the manifest's pools.",
        format!(
            "{}
SELECT CAST(pool AS INT) AS pool, CAST(seq AS BIGINT) AS seq, CAST(ts_ns AS BIGINT) AS ts_ns,
       CAST(request_id AS BIGINT) AS request_id, op,
       CAST(slot_start AS BIGINT) AS slot_start, CAST(slot_count AS BIGINT) AS slot_count,
       CAST(src_pool AS INT) AS src_pool, CAST(src_slot_start AS BIGINT) AS src_slot_start,
       CAST(src_seq AS BIGINT) AS src_seq
FROM {}
WHERE CAST(pool AS INT) IN ({pools})",
            d.view("kvtrail_events"),
            d.raw(&src, "kv")
        ),
    );
    stmt(
        &mut s,
        "requests, typed.",
        format!(
            "{}
SELECT CAST(request_id AS BIGINT) AS request_id, external_id, tenant,
       CAST(arrival_ns AS BIGINT) AS arrival_ns, CAST(finish_ns AS BIGINT) AS finish_ns,
       CAST(prompt_tokens AS BIGINT) AS prompt_tokens, CAST(prefilled_tokens AS BIGINT) AS prefilled_tokens,
       CAST(output_tokens AS BIGINT) AS output_tokens, CAST(http_status AS INT) AS http_status,
       finish_reason, {} AS output_hash
FROM {}",
            d.view("kvtrail_requests"),
            d.hex("output_hash"),
            d.raw(&src, "requests")
        ),
    );
    stmt(
        &mut s,
        "Rule (holes): in a complete capture a pool's seqs have no holes. Every event
carries gap_mark: the first seq after the latest hole at or before it (NULL: none).
Slot content set before gap_mark may have been changed by the lost events.",
        format!(
            "{}
SELECT e.*,
       max(CASE WHEN (prev_seq IS NULL AND seq > 0) OR seq > prev_seq + 1 THEN seq END)
         OVER (PARTITION BY pool ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS gap_mark
FROM (SELECT ev.*, lag(seq) OVER (PARTITION BY pool ORDER BY seq) AS prev_seq FROM kvtrail_events ev) e{end}",
            d.table("kvtrail_events_marked"),
            end = d.table_end("kvtrail_events_marked"),
        ),
    );

    // The lineage: one view per rule, and the stages read more than once
    // materialised as tables. Spark and Trino inline views and CTEs at every
    // reference, so a stage read twice (the content slots, each provenance
    // level, the read owners) would be recomputed, doubling per level; and
    // Spark only reuses a cached table whose plan holds no `WITH` (its CTE
    // ids differ at every analysis), hence views instead of CTEs.
    stmt(
        &mut s,
        "Rule (write, scrub, copy): one row per slot of every event that sets a slot's content.",
        format!(
            "{}
SELECT pool, slot_start + i AS slot, seq, op, request_id,
       src_pool, src_slot_start + i AS src_slot, src_seq
FROM ({}) x{end}",
            d.table("kvtrail_content_slots"),
            d.explode("kvtrail_events_marked", "e.op IN ('write', 'scrub')"),
            end = d.table_end("kvtrail_content_slots"),
        ),
    );
    stmt(
        &mut s,
        "Rule (alloc): one row per slot of every alloc. Content set before an alloc of
its slot is stale from then on (it predates the holding), until the slot's
content is set again.",
        format!(
            "{}
SELECT pool, slot_start + i AS slot, seq
FROM ({}) x",
            d.view("kvtrail_alloc_slots"),
            d.explode("kvtrail_events_marked", "e.op = 'alloc'")
        ),
    );
    stmt(
        &mut s,
        "Rule (copy, share): a copy takes the content its source slot had just after
src_seq, a share grants the content its slot holds at the share: the latest
content event on the slot at or before that seq (tgt_seq), and the latest
alloc of the slot at or before it (alloc_seq: the content is stale when the
alloc came after it). Probes (probe = 2: one per copied slot, at its source,
and one per shared slot) sort after a content event (0) or alloc (1) of the
same seq; a running max of seq is the portable form of
last_value(seq IGNORE NULLS) (seq increases).",
        format!(
            "{}
SELECT pool, slot, seq, share, dst_pool, dst_slot, dst_seq, reader, tgt_seq, alloc_seq
FROM (
  SELECT p.*,
         max(CASE WHEN probe = 0 THEN seq END)
           OVER (PARTITION BY pool, slot ORDER BY seq, probe
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS tgt_seq,
         max(CASE WHEN probe = 1 THEN seq END)
           OVER (PARTITION BY pool, slot ORDER BY seq, probe
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS alloc_seq
  FROM (
    SELECT pool, slot, seq, 0 AS probe, 0 AS share,
           CAST(NULL AS INT) AS dst_pool, CAST(NULL AS BIGINT) AS dst_slot,
           CAST(NULL AS BIGINT) AS dst_seq, CAST(NULL AS BIGINT) AS reader
    FROM kvtrail_content_slots
    UNION ALL
    SELECT pool, slot, seq, 1, 0, CAST(NULL AS INT), CAST(NULL AS BIGINT),
           CAST(NULL AS BIGINT), CAST(NULL AS BIGINT)
    FROM kvtrail_alloc_slots
    UNION ALL
    SELECT src_pool, src_slot, src_seq, 2, 0, pool, slot, seq, CAST(NULL AS BIGINT)
    FROM kvtrail_content_slots WHERE src_pool IS NOT NULL
    UNION ALL
    SELECT pool, slot_start + i, seq, 2, 1, CAST(NULL AS INT), CAST(NULL AS BIGINT),
           CAST(NULL AS BIGINT), request_id
    FROM ({}) x
  ) p
) w
WHERE probe = 2{end}",
            d.table("kvtrail_slot_probes"),
            d.explode("kvtrail_events_marked", "e.op = 'share'"),
            end = d.table_end("kvtrail_slot_probes"),
        ),
    );
    stmt(
        &mut s,
        "Rule (copy): the content each copied slot takes.",
        format!(
            "{}
SELECT dst_pool, dst_slot, dst_seq, pool AS src_pool, seq AS src_seq, slot AS src_slot,
       tgt_seq, alloc_seq
FROM kvtrail_slot_probes WHERE share = 0",
            d.view("kvtrail_copy_target")
        ),
    );
    stmt(
        &mut s,
        "Rule (holes, copies): a copy naming a source seq that is not a recorded event
(lost in a hole, or past the end) has uncertain content; so has a source slot
whose content predates the latest hole at src_seq.
Rule (copy, staleness): the hop is stale when the source slot was allocated
after its content was set (and at or before src_seq).",
        format!(
            "{}
SELECT t.*,
       CASE WHEN s.seq IS NULL
              OR (s.gap_mark IS NOT NULL AND coalesce(t.tgt_seq, -1) < s.gap_mark)
            THEN 1 ELSE 0 END AS hop_unc,
       CASE WHEN t.alloc_seq > t.tgt_seq THEN 1 ELSE 0 END AS hop_stale
FROM kvtrail_copy_target t
LEFT JOIN kvtrail_events_marked s ON s.pool = t.src_pool AND s.seq = t.src_seq",
            d.view("kvtrail_copy_hop")
        ),
    );
    stmt(
        &mut s,
        "Rule (provenance), level 0: a write's owner is its request, a scrub leaves no
owner (-2), a copy of a never-written slot has none either (-1); any other
copy points (nxt_*) at the source content event it copied. A write or scrub
sets current content (stale = 0); a copy starts with its hop's staleness.",
        format!(
            "{}
SELECT c.pool, c.slot, c.seq,
       CASE WHEN c.op = 'scrub' THEN CAST(-2 AS BIGINT)
            WHEN c.src_pool IS NULL THEN c.request_id
            WHEN h.tgt_seq IS NULL THEN CAST(-1 AS BIGINT) END AS owner,
       coalesce(h.hop_unc, 0) AS unc,
       coalesce(h.hop_stale, 0) AS stale,
       CASE WHEN h.tgt_seq IS NOT NULL THEN h.src_pool END AS nxt_pool,
       CASE WHEN h.tgt_seq IS NOT NULL THEN h.src_slot END AS nxt_slot,
       h.tgt_seq AS nxt_seq
FROM kvtrail_content_slots c
LEFT JOIN kvtrail_copy_hop h ON h.dst_pool = c.pool AND h.dst_slot = c.slot AND h.dst_seq = c.seq{end}",
            d.table("kvtrail_lineage_0"),
            end = d.table_end("kvtrail_lineage_0"),
        ),
    );
    for k in 1..=lv {
        stmt(
            &mut s,
            &format!(
                "Rule (provenance through copies of copies), level {k}: a pending copy takes the
owner of the content it points at, or that content's own pointer (pointer jumping);
uncertainty and staleness accumulate along the chain."
            ),
            format!(
                "{}
SELECT r.pool, r.slot, r.seq,
       coalesce(r.owner, t.owner) AS owner,
       CASE WHEN r.unc = 1 OR t.unc = 1 THEN 1 ELSE 0 END AS unc,
       CASE WHEN r.stale = 1 OR t.stale = 1 THEN 1 ELSE 0 END AS stale,
       t.nxt_pool, t.nxt_slot, t.nxt_seq
FROM kvtrail_lineage_{p} r
LEFT JOIN kvtrail_lineage_{p} t ON t.pool = r.nxt_pool AND t.slot = r.nxt_slot AND t.seq = r.nxt_seq{end}",
                d.table(&format!("kvtrail_lineage_{k}")),
                p = k - 1,
                end = d.table_end(&format!("kvtrail_lineage_{k}")),
            ),
        );
    }
    stmt(
        &mut s,
        "Rule (read): one row per slot read, with the content it sees: the latest
content event on the slot before the read (same running max as for copies).",
        format!(
            "{}
SELECT * FROM (
  SELECT p.*, max(CASE WHEN probe = 0 THEN seq END)
           OVER (PARTITION BY pool, slot ORDER BY seq, probe
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cseq
  FROM (
    SELECT pool, slot, seq, 0 AS probe, CAST(NULL AS BIGINT) AS reader,
           CAST(NULL AS BIGINT) AS ts_ns, CAST(NULL AS BIGINT) AS gap_mark
    FROM kvtrail_lineage_{lv}
    UNION ALL
    SELECT pool, slot_start + i, seq, 1, request_id, ts_ns, gap_mark
    FROM ({}) x
  ) p
) w
WHERE probe = 1",
            d.view("kvtrail_read_seen"),
            d.explode("kvtrail_events_marked", "e.op = 'read'")
        ),
    );
    stmt(
        &mut s,
        "Rule (holes): content set before the latest hole at the read (or copied from
uncertain content) is uncertain. A copy still pending after the last level
(deeper than the generator planned for) is uncertain and counted in coverage
(unresolved; gap_unc: uncertain because of a hole, whatever the chain).
Clean reads of the reader's own content are dropped here (they are the bulk).",
        format!(
            "{}
SELECT * FROM (
  SELECT r.pool, r.slot, r.seq, r.ts_ns, r.reader, r.cseq,
         CASE WHEN c.seq IS NULL THEN CAST(-1 AS BIGINT) ELSE c.owner END AS owner,
         CASE WHEN c.nxt_pool IS NOT NULL THEN 1 ELSE 0 END AS unresolved,
         CASE WHEN coalesce(c.unc, 0) = 1 OR c.nxt_pool IS NOT NULL
                OR (r.gap_mark IS NOT NULL AND coalesce(r.cseq, -1) < r.gap_mark)
              THEN 1 ELSE 0 END AS unc,
         CASE WHEN coalesce(c.unc, 0) = 1
                OR (r.gap_mark IS NOT NULL AND coalesce(r.cseq, -1) < r.gap_mark)
              THEN 1 ELSE 0 END AS gap_unc
  FROM kvtrail_read_seen r
  LEFT JOIN kvtrail_lineage_{lv} c ON c.pool = r.pool AND c.slot = r.slot AND c.seq = r.cseq
) o
WHERE unc = 1 OR owner IS NULL OR owner <> reader{end}",
            d.table("kvtrail_read_owner"),
            end = d.table_end("kvtrail_read_owner"),
        ),
    );
    stmt(
        &mut s,
        "Rule (share, alloc): a share grants the content its slot holds (cseq) only when
that content is current: not copied from stale content (stale), and no alloc
of the slot after it (a grant on stale content covers nothing). Kept: the
grants of another request's content.",
        format!(
            "{}
SELECT g.pool, g.slot, g.seq, g.reader, g.tgt_seq AS cseq
FROM kvtrail_slot_probes g
JOIN kvtrail_lineage_{lv} c ON c.pool = g.pool AND c.slot = g.slot AND c.seq = g.tgt_seq
WHERE g.share = 1 AND c.owner >= 0 AND c.owner <> g.reader AND c.stale = 0
  AND (g.alloc_seq IS NULL OR g.alloc_seq < g.tgt_seq){end}",
            d.table("kvtrail_grants"),
            end = d.table_end("kvtrail_grants"),
        ),
    );
    stmt(
        &mut s,
        "Rule (share): a grant lets the reader read another request's content while the
slot is not written again: the content it granted (the same content event) is
still there at the read, the grant before the read.",
        format!(
            "{}
SELECT DISTINCT r.pool, r.slot, r.seq
FROM kvtrail_read_owner r
JOIN kvtrail_grants g ON g.pool = r.pool AND g.slot = r.slot
 AND g.reader = r.reader AND g.cseq = r.cseq AND g.seq < r.seq
WHERE r.owner >= 0 AND r.owner <> r.reader",
            d.view("kvtrail_granted")
        ),
    );
    let never = if opts.from_engine_start {
        "CASE WHEN unc = 1 THEN 'uncertain' ELSE 'blank' END"
    } else {
        "'unknown'"
    };
    stmt(
        &mut s,
        "Rule (classification): own | shared (clean, dropped) | blank | unknown | foreign.
own, shared and blank reads of uncertain content are 'uncertain'.
Never written: blank when the capture began with the engine, else unknown.
The result: every read slot that is not a clean own or shared read.",
        format!(
            "{}
SELECT reader, pool, slot, pool * CAST(4294967296 AS BIGINT) + slot AS pslot, seq, ts_ns, kind,
       CASE WHEN kind = 'foreign' THEN owner END AS source, unc, gap_unc, unresolved
FROM (
  SELECT r.*,
         CASE WHEN r.unresolved = 1 THEN 'uncertain'
              WHEN r.owner = -1 THEN {never}
              WHEN r.owner = -2 THEN CASE WHEN r.unc = 1 THEN 'uncertain' ELSE 'blank' END
              WHEN r.owner = r.reader OR g.seq IS NOT NULL
                THEN CASE WHEN r.unc = 1 THEN 'uncertain' END
              ELSE 'foreign' END AS kind
  FROM kvtrail_read_owner r
  LEFT JOIN kvtrail_granted g ON g.pool = r.pool AND g.slot = r.slot AND g.seq = r.seq
) classified
WHERE kind IS NOT NULL{end}",
            d.table("kvtrail_read_findings"),
            end = d.table_end("kvtrail_read_findings"),
        ),
    );

    // A tenant column holds only a tenant from the requests table; who else
    // it can be is in the kind column next to it ('tenant' | 'unknown': not
    // in the requests table | 'engine': request 0), so no tenant name (not
    // even "(unknown)") can be mistaken for another.
    let tenant = |id: &str, q: &str, col: &str| {
        format!(
            "CASE WHEN {id} <> 0 THEN {q}.tenant END AS {col},
       CASE WHEN {id} = 0 THEN 'engine' WHEN {q}.tenant IS NULL THEN 'unknown' ELSE 'tenant' END AS {col}_kind"
        )
    };
    let certain = if opts.complete {
        "s.certain_tokens > 0"
    } else {
        "1 = 0"
    };
    stmt(
        &mut s,
        "Per reader: distinct (pool, slot) per class, and the time of its unclean reads.
Uncertain reads say why: after a hole (after_gap_tokens), or content whose copy
chain is longer than the script's levels (unresolved_tokens; no event was lost).",
        format!(
            "{}
SELECT reader AS request_id,
       count(DISTINCT CASE WHEN kind = 'foreign' THEN pslot END) AS foreign_tokens,
       count(DISTINCT CASE WHEN kind = 'unknown' THEN pslot END) AS unknown_tokens,
       count(DISTINCT CASE WHEN kind = 'uncertain' THEN pslot END) AS uncertain_tokens,
       count(DISTINCT CASE WHEN kind = 'uncertain' AND gap_unc = 1 THEN pslot END) AS after_gap_tokens,
       count(DISTINCT CASE WHEN unresolved = 1 THEN pslot END) AS unresolved_tokens,
       count(DISTINCT CASE WHEN kind = 'blank' THEN pslot END) AS blank_tokens,
       count(DISTINCT CASE WHEN kind <> 'blank' THEN pslot END) AS exposed_tokens,
       min(ts_ns) AS first_read_ns, max(ts_ns) AS last_read_ns
FROM kvtrail_read_findings
WHERE reader <> 0
GROUP BY reader",
            d.view("kvtrail_reader_totals")
        ),
    );
    stmt(
        &mut s,
        "Result: one row per (affected response, source request): distinct slots read,
first/last read seq and time, pools, cross-tenant, confidence.",
        format!(
            "{}
SELECT s.request_id, s.source_request_id, sq.external_id AS source_external_id,
       {}, s.tokens, s.certain_tokens, s.first_seq, s.last_seq,
       s.first_ts_ns, s.last_ts_ns, s.pools,
       CASE WHEN s.source_request_id <> 0
             AND (sq.tenant IS NULL OR rq.tenant IS NULL OR sq.tenant <> rq.tenant)
            THEN TRUE ELSE FALSE END AS cross_tenant,
       CASE WHEN {certain} THEN 'confirmed' ELSE 'possible' END AS confidence
FROM (
  SELECT reader AS request_id, source AS source_request_id,
         count(DISTINCT pslot) AS tokens,
         count(DISTINCT CASE WHEN unc = 0 THEN pslot END) AS certain_tokens,
         min(seq) AS first_seq, max(seq) AS last_seq,
         min(ts_ns) AS first_ts_ns, max(ts_ns) AS last_ts_ns,
         {} AS pools
  FROM kvtrail_read_findings WHERE kind = 'foreign' AND reader <> 0
  GROUP BY reader, source
) s
LEFT JOIN kvtrail_requests sq ON sq.request_id = s.source_request_id
LEFT JOIN kvtrail_requests rq ON rq.request_id = s.request_id",
            d.view("kvtrail_response_sources"),
            tenant("s.source_request_id", "sq", "source_tenant"),
            d.num_list("pool")
        ),
    );
    stmt(
        &mut s,
        "Result: affected responses (at least one foreign, unknown or uncertain read).",
        format!(
            "{}
SELECT t.request_id, q.external_id, {},
       CASE WHEN q.request_id IS NULL THEN FALSE ELSE TRUE END AS in_requests_table,
       q.arrival_ns, q.finish_ns, q.http_status, q.finish_reason, q.prompt_tokens,
       q.prefilled_tokens, q.output_tokens, q.output_hash,
       t.foreign_tokens, t.unknown_tokens, t.uncertain_tokens, t.exposed_tokens,
       CASE WHEN coalesce(s.cross_sources, 0) > 0 THEN TRUE ELSE FALSE END AS cross_tenant,
       CASE WHEN coalesce(s.confirmed_sources, 0) > 0 THEN 'confirmed' ELSE 'possible' END AS confidence,
       concat_ws(';', CASE WHEN t.foreign_tokens > 0 THEN 'foreign' END,
                      CASE WHEN t.unknown_tokens > 0 THEN 'unknown_predates_capture' END,
                      CASE WHEN t.after_gap_tokens > 0 THEN 'after_gap' END,
                      CASE WHEN t.unresolved_tokens > 0 THEN 'copy_chain_unresolved' END) AS reasons,
       t.first_read_ns, t.last_read_ns,
       coalesce(s.source_request_ids, '') AS source_request_ids
FROM kvtrail_reader_totals t
LEFT JOIN kvtrail_requests q ON q.request_id = t.request_id
LEFT JOIN (
  SELECT request_id,
         sum(CASE WHEN cross_tenant THEN 1 ELSE 0 END) AS cross_sources,
         sum(CASE WHEN confidence = 'confirmed' THEN 1 ELSE 0 END) AS confirmed_sources,
         {} AS source_request_ids
  FROM kvtrail_response_sources GROUP BY request_id
) s ON s.request_id = t.request_id
WHERE t.foreign_tokens + t.unknown_tokens + t.uncertain_tokens > 0",
            d.view("kvtrail_affected_responses"),
            tenant("t.request_id", "q", "tenant"),
            d.num_list("source_request_id")
        ),
    );
    stmt(
        &mut s,
        "Result: recipient tenants (whose responses carried foreign or unknown KV).",
        format!(
            "{}
SELECT tenant, tenant_kind, count(*) AS responses, sum(foreign_tokens) AS foreign_tokens,
       sum(unknown_tokens) AS unknown_tokens,
       sum(CASE WHEN cross_tenant THEN 1 ELSE 0 END) AS cross_tenant_responses,
       sum(CASE WHEN confidence = 'confirmed' THEN 1 ELSE 0 END) AS confirmed,
       sum(CASE WHEN confidence = 'possible' THEN 1 ELSE 0 END) AS possible,
       {} AS request_ids
FROM kvtrail_affected_responses GROUP BY tenant, tenant_kind",
            d.view("kvtrail_recipients"),
            d.num_list("request_id")
        ),
    );
    stmt(
        &mut s,
        "Result: source tenants (whose KV leaked), over (response, source request) pairs.",
        format!(
            "{}
SELECT s.source_tenant AS tenant, s.source_tenant_kind AS tenant_kind,
       count(DISTINCT s.source_request_id) AS requests,
       sum(s.tokens) AS tokens,
       sum(CASE WHEN s.cross_tenant THEN s.tokens ELSE 0 END) AS cross_tenant_tokens,
       count(DISTINCT s.request_id) AS recipient_responses,
       {} AS recipient_tenants,
       count(DISTINCT CASE WHEN a.tenant_kind <> 'tenant' THEN a.request_id END)
         AS unattributed_recipient_responses,
       {} AS request_ids
FROM kvtrail_response_sources s
JOIN kvtrail_affected_responses a ON a.request_id = s.request_id
GROUP BY s.source_tenant, s.source_tenant_kind",
            d.view("kvtrail_sources"),
            d.str_list("a.tenant"),
            d.num_list("s.source_request_id")
        ),
    );
    stmt(
        &mut s,
        "Result: responses that read blank KV (scrubbed, or never written in a capture
that began with the engine): integrity defects, not leaks.",
        format!(
            "{}
SELECT t.request_id, q.external_id, {}, t.blank_tokens AS tokens
FROM kvtrail_reader_totals t
LEFT JOIN kvtrail_requests q ON q.request_id = t.request_id
WHERE t.blank_tokens > 0",
            d.view("kvtrail_blank_reads"),
            tenant("t.request_id", "q", "tenant")
        ),
    );
    stmt(
        &mut s,
        "Rule (shared, tenants): clean shared reads of another request's content (a
prefix-cache hit on current content), by customer requests; cross-tenant when
the content owner is a request of another tenant (or either is missing from
the requests table; the engine's own content is no tenant's).",
        format!(
            "{}
SELECT r.reader AS request_id, r.owner AS source_request_id, r.pool,
       r.pool * CAST(4294967296 AS BIGINT) + r.slot AS pslot, r.seq, r.ts_ns,
       CASE WHEN r.owner <> 0
             AND (sq.tenant IS NULL OR rq.tenant IS NULL OR sq.tenant <> rq.tenant)
            THEN TRUE ELSE FALSE END AS cross_tenant
FROM kvtrail_read_owner r
JOIN kvtrail_granted g ON g.pool = r.pool AND g.slot = r.slot AND g.seq = r.seq
LEFT JOIN kvtrail_requests sq ON sq.request_id = r.owner
LEFT JOIN kvtrail_requests rq ON rq.request_id = r.reader
WHERE r.unc = 0 AND r.reader <> 0",
            d.view("kvtrail_shared_reads")
        ),
    );
    stmt(
        &mut s,
        "Result: one row per (response, source request) of cross-tenant shared reads:
distinct slots, first/last read seq and time, pools (the prefix-cache side
channel: no foreign KV entered the response, but the hit tells its tenant
that another tenant sent that prefix).",
        format!(
            "{}
SELECT s.request_id, s.source_request_id, sq.external_id AS source_external_id,
       {}, s.tokens, s.first_seq, s.last_seq, s.first_ts_ns, s.last_ts_ns, s.pools
FROM (
  SELECT request_id, source_request_id, count(DISTINCT pslot) AS tokens,
         min(seq) AS first_seq, max(seq) AS last_seq,
         min(ts_ns) AS first_ts_ns, max(ts_ns) AS last_ts_ns, {} AS pools
  FROM kvtrail_shared_reads WHERE cross_tenant
  GROUP BY request_id, source_request_id
) s
LEFT JOIN kvtrail_requests sq ON sq.request_id = s.source_request_id",
            d.view("kvtrail_cross_tenant_shared_sources"),
            tenant("s.source_request_id", "sq", "source_tenant"),
            d.num_list("pool")
        ),
    );
    stmt(
        &mut s,
        "Result: responses with cross-tenant shared reads (scope's cross_tenant_shared):
distinct (pool, slot) read that way, over all their sources.",
        format!(
            "{}
SELECT t.request_id, q.external_id, {}, t.tokens, t.source_request_ids,
       t.first_read_ns, t.last_read_ns
FROM (
  SELECT request_id, count(DISTINCT pslot) AS tokens, {} AS source_request_ids,
         min(ts_ns) AS first_read_ns, max(ts_ns) AS last_read_ns
  FROM kvtrail_shared_reads WHERE cross_tenant
  GROUP BY request_id
) t
LEFT JOIN kvtrail_requests q ON q.request_id = t.request_id",
            d.view("kvtrail_cross_tenant_shared"),
            tenant("t.request_id", "q", "tenant"),
            d.num_list("source_request_id")
        ),
    );
    stmt(
        &mut s,
        "Result: holes in each pool's seq stream (after_seq NULL: the stream starts late).",
        format!(
            "{}
SELECT pool, prev_seq AS after_seq, seq AS before_seq,
       seq - coalesce(prev_seq + 1, 0) AS missing
FROM kvtrail_events_marked
WHERE (prev_seq IS NULL AND seq > 0) OR seq > prev_seq + 1",
            d.view("kvtrail_gaps")
        ),
    );
    stmt(
        &mut s,
        "Result: copies that read a source seq past the last recorded event of their source pool.",
        format!(
            "{}
SELECT c.src_pool AS pool, min(c.src_seq) AS min_src_seq, max(c.src_seq) AS max_src_seq
FROM kvtrail_events c
LEFT JOIN (SELECT pool, max(seq) AS last_seq FROM kvtrail_events GROUP BY pool) p
  ON p.pool = c.src_pool
WHERE c.op = 'write' AND c.src_pool IS NOT NULL
  AND (p.last_seq IS NULL OR c.src_seq > p.last_seq)
GROUP BY c.src_pool",
            d.view("kvtrail_copies_past_end")
        ),
    );
    // Files that may hold rows the script does not read: part files left
    // open, and the hidden ones. Only DuckDB can list files from SQL.
    let files_unread = match (opts.dialect, &src) {
        (Dialect::Duckdb, Source::Path(p)) => ["kv", "requests"]
            .iter()
            .map(|t| {
                format!(
                    "(SELECT count(*) FROM glob({}) WHERE ends_with(file, '.parquet.inprogress')
            OR (ends_with(file, '.parquet') AND {}))",
                    literal(opts.dialect, &format!("{p}/{t}/**")),
                    duckdb_hidden(opts.dialect, p, t)
                )
            })
            .collect::<Vec<_>>()
            .join("\n          + "),
        _ => "CAST(NULL AS BIGINT)".to_string(),
    };
    stmt(
        &mut s,
        "Result: coverage. complete is true only when nothing lowers confidence. File
digests and files missing on disk are not checked here: run `kvtrail verify`.
files_unread: part files left open and hidden *.parquet (DuckDB; NULL elsewhere).
duplicate_events, duplicate_requests: (pool, seq) and request ids held by more
than one row, which the native reader refuses; the results count them as read.
engine_reads: slots request 0 (the engine itself) read that held KV not its own;
it has no customer response, so they affect none (they are left out above).
copies_unresolved: copy slots whose chain was longer than the script's
pointer-jumping levels (copy_levels); unresolved_copy_slots: the read slots
that saw such content (counted as uncertain). Regenerate with a larger
--copy-levels.",
        format!(
            "{}
SELECT (capture_complete AND gaps = 0 AND copies_past_end = 0 AND NOT unverifiable
        AND requests_missing = 0 AND unresolved_copy_slots = 0 AND copies_unresolved = 0
        AND coalesce(files_unread, 0) = 0 AND duplicate_events = 0
        AND duplicate_requests = 0) AS complete,
       x.*
FROM (
  SELECT {} AS capture_complete, {} AS from_engine_start, {} AS unverifiable,
         (SELECT count(*) FROM kvtrail_gaps) AS gaps,
         (SELECT coalesce(sum(missing), 0) FROM kvtrail_gaps) AS lost_events,
         (SELECT count(*) FROM kvtrail_copies_past_end) AS copies_past_end,
         (SELECT count(*) FROM (
            SELECT reader AS id FROM kvtrail_read_findings WHERE reader <> 0
            UNION SELECT source FROM kvtrail_read_findings
              WHERE source IS NOT NULL AND reader <> 0) i
          LEFT JOIN kvtrail_requests q ON q.request_id = i.id
          WHERE i.id <> 0 AND q.request_id IS NULL) AS requests_missing,
         (SELECT count(*) FROM kvtrail_read_findings WHERE unresolved = 1) AS unresolved_copy_slots,
         (SELECT count(*) FROM kvtrail_lineage_{lv} WHERE nxt_pool IS NOT NULL) AS copies_unresolved,
         {lv} AS copy_levels,
         (SELECT count(DISTINCT pslot) FROM kvtrail_read_findings
            WHERE reader = 0 AND kind <> 'blank') AS engine_reads,
         {} AS files_unread,
         (SELECT count(*) FROM (SELECT pool, seq FROM kvtrail_events
            GROUP BY pool, seq HAVING count(*) > 1) d) AS duplicate_events,
         (SELECT count(*) FROM (SELECT request_id FROM kvtrail_requests
            GROUP BY request_id HAVING count(*) > 1) d) AS duplicate_requests,
         CAST('{}' AS {}) AS dialect
) x",
            d.view("kvtrail_coverage"),
            b(opts.complete),
            b(opts.from_engine_start),
            b(opts.unverifiable),
            files_unread,
            opts.dialect.as_str(),
            d.string()
        ),
    );
    Ok(s)
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
