//! The result views, which mirror `scope --out`: per reader and per
//! (response, source request), the affected responses, recipient and
//! source tenants, blank reads, cross-tenant shared reads (the prefix-cache
//! side channel), holes, copies past the end, and coverage.

use super::dialect::{Dialect, Syntax, bool_literal, duckdb_hidden, literal};
use super::options::SqlOptions;
use super::script::Script;
use super::source::Source;

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

/// The tenant of request `id` (joined as `q`) as column `col`, and who
/// else it can be in `{col}_kind`.
///
/// A tenant column holds only a tenant from the requests table; who else
/// it can be is in the kind column next to it ('tenant' | 'unknown': not
/// in the requests table | 'engine': request 0), so no tenant name (not
/// even "(unknown)") can be mistaken for another.
fn tenant(id: &str, q: &str, col: &str) -> String {
    format!(
        "CASE WHEN {id} <> 0 THEN {q}.tenant END AS {col},
       CASE WHEN {id} = 0 THEN 'engine' WHEN {q}.tenant IS NULL THEN 'unknown' ELSE 'tenant' END AS {col}_kind"
    )
}

/// The findings per reader and per (response, source request), the
/// affected responses, recipient and source tenants, and blank reads.
/// Without a complete capture every finding is at most possible.
pub(super) fn responses(s: &mut Script, sx: &Syntax, complete: bool) {
    let certain = if complete {
        "s.certain_tokens > 0"
    } else {
        "1 = 0"
    };
    s.stmt(
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
            sx.view("kvtrail_reader_totals")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_response_sources"),
            tenant("s.source_request_id", "sq", "source_tenant"),
            sx.num_list("pool")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_affected_responses"),
            tenant("t.request_id", "q", "tenant"),
            sx.num_list("source_request_id")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_recipients"),
            sx.num_list("request_id")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_sources"),
            sx.str_list("a.tenant"),
            sx.num_list("s.source_request_id")
        ),
    );
    s.stmt(
        "Result: responses that read blank KV (scrubbed, or never written in a capture
that began with the engine): integrity defects, not leaks.",
        format!(
            "{}
SELECT t.request_id, q.external_id, {}, t.blank_tokens AS tokens
FROM kvtrail_reader_totals t
LEFT JOIN kvtrail_requests q ON q.request_id = t.request_id
WHERE t.blank_tokens > 0",
            sx.view("kvtrail_blank_reads"),
            tenant("t.request_id", "q", "tenant")
        ),
    );
}

/// Rule (shared, tenants) and its results: clean shared reads of another
/// tenant's content (prefix-cache hits), per source and per response.
pub(super) fn shared(s: &mut Script, sx: &Syntax) {
    s.stmt(
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
            sx.view("kvtrail_shared_reads")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_cross_tenant_shared_sources"),
            tenant("s.source_request_id", "sq", "source_tenant"),
            sx.num_list("pool")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_cross_tenant_shared"),
            tenant("t.request_id", "q", "tenant"),
            sx.num_list("source_request_id")
        ),
    );
}

/// Holes in each pool's seq stream, and copies from past a pool's end.
pub(super) fn holes_and_ends(s: &mut Script, sx: &Syntax) {
    s.stmt(
        "Result: holes in each pool's seq stream (after_seq NULL: the stream starts late).",
        format!(
            "{}
SELECT pool, prev_seq AS after_seq, seq AS before_seq,
       seq - coalesce(prev_seq + 1, 0) AS missing
FROM kvtrail_events_marked
WHERE (prev_seq IS NULL AND seq > 0) OR seq > prev_seq + 1",
            sx.view("kvtrail_gaps")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_copies_past_end")
        ),
    );
}

/// Coverage: whether nothing lowers confidence, and every count that does.
pub(super) fn coverage(s: &mut Script, opts: &SqlOptions, sx: &Syntax, src: &Source, lv: usize) {
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
    s.stmt(
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
            sx.view("kvtrail_coverage"),
            bool_literal(opts.complete),
            bool_literal(opts.from_engine_start),
            bool_literal(opts.unverifiable),
            files_unread,
            opts.dialect.as_str(),
            sx.string()
        ),
    );
}
