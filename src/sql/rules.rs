//! The lineage, one statement per rule of the format's "Semantics"
//! section: holes, the slots each event sets, allocs, copies and shares
//! (probes), provenance through copy chains by pointer jumping, and the
//! classification of every read slot. The stages read more than once are
//! materialised (`Syntax::table`).
//!
//! Spark and Trino inline views and CTEs at every reference, so a stage
//! read twice (the content slots, each provenance level, the read owners)
//! would be recomputed, doubling per level; and Spark only reuses a cached
//! table whose plan holds no `WITH` (its CTE ids differ at every analysis),
//! hence views instead of CTEs.

use super::dialect::Syntax;
use super::script::Script;

/// Rule (holes): every event marked with the first seq after the latest
/// hole of its pool at or before it.
pub(super) fn holes(s: &mut Script, sx: &Syntax) {
    s.stmt(
        "Rule (holes): in a complete capture a pool's seqs have no holes. Every event
carries gap_mark: the first seq after the latest hole at or before it (NULL: none).
Slot content set before gap_mark may have been changed by the lost events.",
        format!(
            "{}
SELECT e.*,
       max(CASE WHEN (prev_seq IS NULL AND seq > 0) OR seq > prev_seq + 1 THEN seq END)
         OVER (PARTITION BY pool ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS gap_mark
FROM (SELECT ev.*, lag(seq) OVER (PARTITION BY pool ORDER BY seq) AS prev_seq FROM kvtrail_events ev) e{end}",
            sx.table("kvtrail_events_marked"),
            end = sx.table_end("kvtrail_events_marked"),
        ),
    );
}

/// Rules (write, scrub, copy, alloc, share): the slots each event sets or
/// allocates, the content each copy and share sees, and each copy hop's
/// uncertainty and staleness.
pub(super) fn content(s: &mut Script, sx: &Syntax) {
    s.stmt(
        "Rule (write, scrub, copy): one row per slot of every event that sets a slot's content.",
        format!(
            "{}
SELECT pool, slot_start + i AS slot, seq, op, request_id,
       src_pool, src_slot_start + i AS src_slot, src_seq
FROM ({}) x{end}",
            sx.table("kvtrail_content_slots"),
            sx.explode("kvtrail_events_marked", "e.op IN ('write', 'scrub')"),
            end = sx.table_end("kvtrail_content_slots"),
        ),
    );
    s.stmt(
        "Rule (alloc): one row per slot of every alloc. Content set before an alloc of
its slot is stale from then on (it predates the holding), until the slot's
content is set again.",
        format!(
            "{}
SELECT pool, slot_start + i AS slot, seq
FROM ({}) x",
            sx.view("kvtrail_alloc_slots"),
            sx.explode("kvtrail_events_marked", "e.op = 'alloc'")
        ),
    );
    s.stmt(
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
            sx.table("kvtrail_slot_probes"),
            sx.explode("kvtrail_events_marked", "e.op = 'share'"),
            end = sx.table_end("kvtrail_slot_probes"),
        ),
    );
    s.stmt(
        "Rule (copy): the content each copied slot takes.",
        format!(
            "{}
SELECT dst_pool, dst_slot, dst_seq, pool AS src_pool, seq AS src_seq, slot AS src_slot,
       tgt_seq, alloc_seq
FROM kvtrail_slot_probes WHERE share = 0",
            sx.view("kvtrail_copy_target")
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_copy_hop")
        ),
    );
}

/// Rule (provenance): level 0, then `lv` pointer-jumping levels.
pub(super) fn provenance(s: &mut Script, sx: &Syntax, lv: usize) {
    s.stmt(
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
            sx.table("kvtrail_lineage_0"),
            end = sx.table_end("kvtrail_lineage_0"),
        ),
    );
    for k in 1..=lv {
        s.stmt(
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
                sx.table(&format!("kvtrail_lineage_{k}")),
                p = k - 1,
                end = sx.table_end(&format!("kvtrail_lineage_{k}")),
            ),
        );
    }
}

/// Rules (read, holes, share, classification): the content each read slot
/// sees, its owner, the grants that cover it, and the table of every read
/// slot that is not a clean own or shared read.
pub(super) fn reads(s: &mut Script, sx: &Syntax, lv: usize, from_engine_start: bool) {
    s.stmt(
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
            sx.view("kvtrail_read_seen"),
            sx.explode("kvtrail_events_marked", "e.op = 'read'")
        ),
    );
    s.stmt(
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
            sx.table("kvtrail_read_owner"),
            end = sx.table_end("kvtrail_read_owner"),
        ),
    );
    s.stmt(
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
            sx.table("kvtrail_grants"),
            end = sx.table_end("kvtrail_grants"),
        ),
    );
    s.stmt(
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
            sx.view("kvtrail_granted")
        ),
    );
    let never = if from_engine_start {
        "CASE WHEN unc = 1 THEN 'uncertain' ELSE 'blank' END"
    } else {
        "'unknown'"
    };
    s.stmt(
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
            sx.table("kvtrail_read_findings"),
            end = sx.table_end("kvtrail_read_findings"),
        ),
    );
}
