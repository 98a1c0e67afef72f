//! Where the script reads the trace, checked: `--trace-path` (a folder or
//! URL for DuckDB and Spark, named as that engine's connectors name it; a
//! `catalog.schema` for Trino) and `--spark-scratch`, the only user values
//! that reach the SQL text; and the FROM item of each raw table.

use std::path::Path;

use super::dialect::{Dialect, is_control_or_break, quote_ident};
use crate::error::{Error, Location, Result};

/// Longest `--trace-path` accepted, in bytes.
pub const MAX_TRACE_PATH: usize = 4096;
/// Longest part of a Trino `catalog.schema`, in bytes.
pub const MAX_IDENT: usize = 128;

/// Where the script reads the trace, checked: the only user value that
/// reaches the SQL text. A path (DuckDB, Spark) only ever appears inside a
/// string literal, a Trino schema only as double-quoted identifiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Source {
    /// Directory or URI, without trailing `/`.
    Path(String),
    /// `[catalog.]schema`, unquoted parts.
    Schema(Vec<String>),
}

impl Source {
    /// A FROM item for a raw table (`kv` or `requests`).
    pub fn table_ref(&self, dialect: Dialect, table: &str) -> String {
        match (dialect, self) {
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
}

fn bad_path(what: String, hint: &str) -> Error {
    Error::invalid(Location::file(Path::new("--trace-path")), what, hint)
}

/// Checks `--spark-scratch` as a Spark trace path is checked: not empty,
/// at most [`MAX_TRACE_PATH`] bytes, no control characters.
pub(super) fn check_scratch(path: &str) -> Result<String> {
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
pub(super) fn check_source(dialect: Dialect, path: &str) -> Result<Source> {
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
