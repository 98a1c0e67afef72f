//! What the generator specialises the SQL on ([`SqlOptions`], from a
//! manifest or from flags), and how many pointer-jumping levels resolve
//! the trace's copy chains.

use super::dialect::Dialect;
use crate::trace::manifest::Manifest;

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
