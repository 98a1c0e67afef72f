"""The lineage query a responder would write in DuckDB over a kvtrail
trace: explode every write, copy and read to one row per slot, resolve each
copy to the owner its source slot had at src_seq (ASOF JOIN), then find the
owner of every read slot (ASOF JOIN on the latest write before the read)
and keep the reads whose owner is another request.

Shares, scrubs and holes are ignored (the synthetic benchmark trace has
none), so on that trace it finds the same foreign reads as kvtrail scope.

Usage: python duckdb_lineage.py TRACE_DIR  ->  prints SECS and FOREIGN.
"""
import os
import resource
import sys
import time

import duckdb

trace = sys.argv[1]
con = duckdb.connect()
con.execute("SET threads TO 2")
con.execute("SET memory_limit = '12GB'")
con.execute("SET preserve_insertion_order = false")
t = time.time()
con.execute(f"""
CREATE TEMP TABLE kv AS SELECT * FROM read_parquet('{trace}/kv/**/*.parquet');
CREATE TEMP TABLE w AS
  SELECT pool, seq, request_id AS owner, unnest(range(slot_start, slot_start + slot_count)) AS slot
  FROM kv WHERE op = 'write' AND src_pool IS NULL;
CREATE TEMP TABLE c AS
  SELECT pool, seq, src_pool, src_seq,
         unnest(range(slot_start, slot_start + slot_count)) AS slot,
         unnest(range(src_slot_start, src_slot_start + slot_count)) AS src_slot
  FROM kv WHERE op = 'write' AND src_pool IS NOT NULL;
CREATE TEMP TABLE owners AS
  SELECT pool, seq, slot, owner FROM w
  UNION ALL
  SELECT c.pool, c.seq, c.slot, w.owner
  FROM c ASOF JOIN w ON c.src_pool = w.pool AND c.src_slot = w.slot AND c.src_seq >= w.seq;
CREATE TEMP TABLE r AS
  SELECT pool, seq, request_id AS reader, unnest(range(slot_start, slot_start + slot_count)) AS slot
  FROM kv WHERE op = 'read';
""")
foreign = con.execute("""
  SELECT count(*) FROM (
    SELECT DISTINCT r.reader, r.pool, r.slot
    FROM r ASOF JOIN owners o ON r.pool = o.pool AND r.slot = o.slot AND r.seq > o.seq
    WHERE o.owner <> r.reader)
""").fetchone()[0]
secs = time.time() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(f"SECS {secs:.3f} FOREIGN {foreign} MAXRSS_MB {rss}")
