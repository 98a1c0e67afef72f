//! The SQL dialects and everything that writes a value into the script's
//! text in one place: string literals (Spark also escapes `\\`), quoted
//! identifiers, comment text (control characters and line breaks
//! escaped), and [`Syntax`], the statements and aggregates each engine
//! spells its own way (views, materialised stages, exploding extents,
//! sorted distinct lists).

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

/// Statement separator: every statement ends with `;` at the end of a line.
pub const SEPARATOR: &str = ";\n";

/// Control characters, and the Unicode line and paragraph separators
/// (line breaks to some editors and engines).
pub(super) fn is_control_or_break(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// A string literal of `dialect`. DuckDB and Trino double `'`; Spark's
/// lexer also treats `\` as an escape, so both are backslash-escaped there.
pub(super) fn literal(dialect: Dialect, s: &str) -> String {
    match dialect {
        Dialect::Spark => format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'")),
        _ => format!("'{}'", s.replace('\'', "''")),
    }
}

/// DuckDB: whether `file` (from `glob`) has a name starting with `_` or
/// `.` below `<p>/<table>/`, the files the native reader skips.
pub(super) fn duckdb_hidden(dialect: Dialect, p: &str, table: &str) -> String {
    let prefix = literal(dialect, &format!("{p}/{table}/"));
    format!("regexp_matches(substr(file, length({prefix}) + 1), '(^|/)[._]')")
}

/// A double-quoted identifier (Trino, standard SQL).
pub(super) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A value as it may appear in a `--` comment: line breaks and other
/// control characters escaped, so the comment cannot end early.
pub(super) fn comment_text(s: &str) -> String {
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

/// How the script is written for one engine: its dialect, and where Spark
/// writes the materialised stages.
pub(super) struct Syntax {
    pub dialect: Dialect,
    /// Spark: the folder (URI) the materialised stages are written to.
    pub scratch: String,
}

impl Syntax {
    pub fn view(&self, name: &str) -> String {
        match self.dialect {
            Dialect::Duckdb => format!("CREATE OR REPLACE TEMP VIEW {name} AS"),
            Dialect::Spark => format!("CREATE OR REPLACE TEMPORARY VIEW {name} AS"),
            Dialect::Trino => format!("CREATE OR REPLACE VIEW {name} AS"),
        }
    }

    /// Statements that materialise `name` from the query that follows
    /// (closed by [`Syntax::table_end`]).
    ///
    /// Spark: a cached view keeps its query, and Spark's analyser expands it
    /// at every reference before it substitutes the cached data, so each
    /// pointer-jumping level, which reads the one before twice, would cost
    /// twice its predecessor to plan. The stage is written out as Parquet
    /// instead and read back through a view over the files, whose plan is a
    /// scan: planning stays linear in the levels.
    pub fn table(&self, name: &str) -> String {
        match self.dialect {
            Dialect::Duckdb => format!("CREATE OR REPLACE TEMP TABLE {name} AS"),
            Dialect::Spark => format!(
                "INSERT OVERWRITE DIRECTORY {} USING parquet",
                literal(self.dialect, &format!("{}/{name}", self.scratch))
            ),
            Dialect::Trino => {
                format!("DROP TABLE IF EXISTS {name}{SEPARATOR}CREATE TABLE {name} AS")
            }
        }
    }

    /// What follows the query of a [`Syntax::table`] (Spark: the view over the
    /// written files).
    pub fn table_end(&self, name: &str) -> String {
        match self.dialect {
            Dialect::Spark => format!(
                "{SEPARATOR}CREATE OR REPLACE TEMPORARY VIEW {name} USING parquet OPTIONS (path {})",
                literal(self.dialect, &format!("{}/{name}", self.scratch))
            ),
            _ => String::new(),
        }
    }

    /// A CTE body exploding the extents of `src` (alias e) into one row per
    /// slot offset `i`.
    pub fn explode(&self, src: &str, filter: &str) -> String {
        match self.dialect {
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
    pub fn num_list(&self, x: &str) -> String {
        match self.dialect {
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
    pub fn str_list(&self, x: &str) -> String {
        match self.dialect {
            Dialect::Duckdb => format!("array_to_string(list_sort(list_distinct(list({x}))), ',')"),
            Dialect::Spark => format!("concat_ws(',', array_sort(collect_set({x})))"),
            Dialect::Trino => {
                format!("array_join(array_sort(array_distinct(array_agg({x}))), ',')")
            }
        }
    }

    pub fn hex(&self, x: &str) -> String {
        match self.dialect {
            Dialect::Duckdb | Dialect::Spark => format!("lower(hex({x}))"),
            Dialect::Trino => format!("lower(to_hex({x}))"),
        }
    }

    pub fn string(&self) -> &'static str {
        match self.dialect {
            Dialect::Spark => "STRING",
            _ => "VARCHAR",
        }
    }
}

/// A boolean literal.
pub(super) fn bool_literal(v: bool) -> &'static str {
    if v { "TRUE" } else { "FALSE" }
}
