"""Conformance traces written the way an independent implementer would.

Every case is a trace written straight from the contract
(docs/trace-format.md)
with pyarrow (and DuckDB for the cases where a converter would use it), NOT
through kvtrail's writer, plus an `expected.json` whose expectations come
from the contract's sentences (quoted in `why`), never from running kvtrail.

Usage: python make_traces.py OUT_DIR
Writes OUT_DIR/<case>/trace/ and OUT_DIR/<case>/expected.json, and
OUT_DIR/cases.json (the list of case names). tests/it/contract_conformance.rs
runs the binary on each case and checks the expectations.

expected.json keys (all optional except name/why):
  verify:  exit code of `kvtrail verify` (0 verified, 1 fails, 2 unreadable)
  inspect: exit code of `kvtrail inspect`
  scope:   {"exit": 0|2,
            "stderr": [fragments the error must contain],
            "affected": {request_id: {"confidence", "foreign", "unknown",
                          "sources": {source_id: tokens}, "cross_tenant",
                          "arrival_ns"}},
            "coverage_complete": bool,
            "notes": [fragments of coverage.notes],
            "blank_reads": true|false (some blank read reported or none),
            "requests_missing": [ids] (coverage.requests_missing),
            "anomalies": [kinds that must be reported],
            "cross_tenant_shared": {request_id: {"tokens", "sources": {source_id: tokens}}}
                (exactly the responses listed in scope's `cross_tenant_shared`),
            "prefix_cache_breach": bool (scope's verdict names a prefix-cache
                isolation breach or not)}
  refused_by: [[command, args...]]: other commands that replay the trace and
           must refuse it like scope (exit 2, the same stderr fragments);
           the trace is the last argument, or `{trace}` where given.

Cases that need revision 2's scope output (`cross_tenant_shared`,
`deployment.prefix_cache_scope`) are in a separate list at the end, written
only when REV2_SCOPE_OUTPUT is True (or KVTRAIL_CONFORMANCE_REV2_SCOPE=1).
  digests: the manifest's "__BLAKE3__" placeholders are to be replaced by
           the file's real blake3 (Python has no blake3 here; the Rust test
           fills them in with the blake3 crate before running anything).
"""

import json
import os
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq

OUT = sys.argv[1]
CASES = []

# ---------------------------------------------------------------- helpers

T0 = 1_764_460_800_000_000_000

KV_TYPES = {
    "pool": pa.uint16(),
    "seq": pa.uint64(),
    "ts_ns": pa.int64(),
    "request_id": pa.uint64(),
    "op": pa.string(),
    "slot_start": pa.uint32(),
    "slot_count": pa.uint32(),
    "token_pos": pa.uint32(),
    "src_pool": pa.uint16(),
    "src_slot_start": pa.uint32(),
    "src_seq": pa.uint64(),
}
KV_NULLABLE = {"token_pos", "src_pool", "src_slot_start", "src_seq"}

REQ_TYPES = {
    "request_id": pa.uint64(),
    "external_id": pa.string(),
    "tenant": pa.string(),
    "arrival_ns": pa.int64(),
    "finish_ns": pa.int64(),
    "prompt_tokens": pa.uint32(),
    "prefilled_tokens": pa.uint32(),
    "output_tokens": pa.uint32(),
    "http_status": pa.uint16(),
    "finish_reason": pa.string(),
    "prefill_pool": pa.uint16(),
    "decode_pool": pa.uint16(),
    "prompt_hash": pa.binary(32),
    "output_hash": pa.binary(32),
}


def pools(*specs):
    """specs: (id, role, capacity, page_size)."""
    return [
        {"id": i, "name": f"{r}-{i}", "role": r, "capacity_tokens": c, "page_size": p}
        for (i, r, c, p) in specs
    ]


PD = pools((0, "prefill", 64, 4), (1, "decode", 64, 4))


def manifest(pool_list=PD, complete=True, from_start=True, files=True, deployment_extra=None,
             **extra):
    cap = {"writer": "independent-pyarrow", "started_ns": T0, "ended_ns": T0 + 10**9,
           "complete": complete}
    if from_start is not None:
        cap["from_engine_start"] = from_start
    m = {
        "format": "kvtrail-trace",
        "version": 1,
        "deployment": {"name": "conformance", "engine": "hand-made",
                       "context_window": 4096, "pools": pool_list},
        "capture": cap,
    }
    m["deployment"].update(deployment_extra or {})
    if files:
        m["files"] = "AUTO"
    m.update(extra)
    return m


def ev(pool, seq, rid, op, start, count, token_pos=None, src=None, ts=None):
    e = {"pool": pool, "seq": seq, "ts_ns": T0 + (ts if ts is not None else seq * 1000 + pool),
         "request_id": rid, "op": op, "slot_start": start, "slot_count": count,
         "token_pos": token_pos, "src_pool": None, "src_slot_start": None, "src_seq": None}
    if src is not None:
        e["src_pool"], e["src_slot_start"], e["src_seq"] = src
    return e


class Stream:
    """Builds one pool's events with consecutive seqs (holes on request)."""

    def __init__(self, pool, start=0):
        self.pool, self.seq, self.events = pool, start, []

    def __call__(self, rid, op, start, count, token_pos=None, src=None):
        e = ev(self.pool, self.seq, rid, op, start, count, token_pos, src)
        self.events.append(e)
        self.seq += 1
        return e["seq"]

    def lose(self, n=1):
        self.seq += n


def req(rid, tenant, prompt=8, prefilled=None, out=2, status=200, pp=0, dp=1, ext=True):
    return {
        "request_id": rid,
        "external_id": f"ext-{rid}" if ext else None,
        "tenant": tenant,
        "arrival_ns": T0 + (rid % 1000) * 100,
        "finish_ns": T0 + (rid % 1000) * 100 + 50,
        "prompt_tokens": prompt,
        "prefilled_tokens": prompt if prefilled is None else prefilled,
        "output_tokens": out,
        "http_status": status,
        "finish_reason": "stop",
        "prefill_pool": pp,
        "decode_pool": dp,
        "prompt_hash": bytes([rid % 256]) * 32,
        "output_hash": None,
    }


def table(rows, types, nullable_absent=(), override=None, order=None, extra=None):
    """A pyarrow table of `rows` with contract types, optionally with some
    columns absent, retyped (override: name -> pa type or callable(values)
    -> pa.Array), reordered or with extra columns."""
    override = override or {}
    names = [n for n in types if n not in nullable_absent]
    if order:
        names = order(names)
    cols = {}
    for n in names:
        vals = [r.get(n) for r in rows]
        o = override.get(n)
        if callable(o):
            cols[n] = o(vals)
        else:
            cols[n] = pa.array(vals, type=o or types[n])
    for n, arr in (extra or {}).items():
        cols[n] = arr(len(rows))
    return pa.table(cols)


def write(path, tbl, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(tbl, path, **kw)


def kv_by_pool(events, trace, **kw):
    by = {}
    for e in events:
        by.setdefault(e["pool"], []).append(e)
    for p, evs in sorted(by.items()):
        write(f"{trace}/kv/pool={p}/part-00000.parquet", table(evs, KV_TYPES), **kw)


def requests_file(rows, trace, **kw):
    write(f"{trace}/requests/part-00000.parquet", table(rows, REQ_TYPES), **kw)


def case(name, why, man, kv=None, reqs=None, layout=None, **expect):
    """Registers a case. `layout(trace)` writes the data files itself when
    the default (one file per pool under kv/pool=N/, one requests file) is
    not what the case is about. A trace that scope reads is one that
    inspect reads too."""
    if "inspect" not in expect and expect.get("scope", {}).get("exit", 0) == 0:
        expect["inspect"] = 0
    CASES.append((name, why, man, kv, reqs, layout, expect))


def finish(name, why, man, kv, reqs, layout, expect):
    root = os.path.join(OUT, name)
    trace = os.path.join(root, "trace")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(trace)
    if layout:
        layout(trace)
    else:
        if kv is not None:
            kv_by_pool(kv, trace)
        if reqs is not None:
            requests_file(reqs, trace)
    if man is not None:
        m = dict(man)
        bom = m.pop("_bom", False)
        if m.get("files") == "AUTO":
            m["files"] = list_files(trace)
        with open(os.path.join(trace, "trace.json"), "w", encoding="utf-8-sig" if bom else "utf-8") as f:
            json.dump(m, f, indent=1)
    exp = {"name": name, "why": why, **expect}
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(exp, f, indent=1, sort_keys=True)


def list_files(trace):
    out = []
    for sub in ("kv", "requests"):
        for d, _, fs in os.walk(os.path.join(trace, sub)):
            for fn in fs:
                p = os.path.join(d, fn)
                rel = os.path.relpath(p, trace).replace(os.sep, "/")
                if not fn.endswith(".parquet") or any(c.startswith((".", "_")) for c in rel.split("/")):
                    continue
                rows = pq.ParquetFile(p).metadata.num_rows
                out.append({"path": rel, "rows": rows, "blake3": "__BLAKE3__"})
    return sorted(out, key=lambda e: e["path"])


def clean(**more):
    """Expectations of a trace with no finding at all."""
    s = {"exit": 0, "affected": {}, "coverage_complete": True}
    s.update(more)
    return s


def foreign(reader, sources, confidence="confirmed", cross=True, unknown=0):
    return {str(reader): {"confidence": confidence, "foreign": sum(sources.values()),
                          "unknown": unknown, "cross_tenant": cross,
                          "sources": {str(k): v for k, v in sources.items()}}}


REQS3 = [req(1, "acme"), req(2, "globex"), req(3, "initech")]


# ------------------------------------------------ a base incident-shaped trace
def base_events():
    """R1 (acme) prefills 8 tokens in pool 0, copies them to pool 1, decodes
    and frees; R2 (globex) is handed the same decode slots without a write
    to half of them and reads all 8: 4 foreign slots of R1."""
    p0, p1 = Stream(0), Stream(1)
    p0(1, "alloc", 4, 8)
    w = p0(1, "write", 4, 8, token_pos=0)
    p1(1, "alloc", 8, 8)
    p1(1, "write", 8, 8, token_pos=0, src=(0, 4, w))
    p1(1, "read", 8, 8, token_pos=0)
    p1(1, "free", 8, 8)
    p0(1, "free", 4, 8)
    p1(2, "alloc", 8, 8)
    p1(2, "write", 8, 4, token_pos=0)
    p1(2, "read", 8, 8, token_pos=0)
    p1(2, "free", 8, 8)
    return p0.events + p1.events


BASE_AFFECTED = foreign(2, {1: 4})
BASE = dict(exit=0, affected=BASE_AFFECTED, coverage_complete=True)


# ================================================================== layout
case("base", "Semantics: free does not clear; R2 reads 4 slots whose content owner is R1",
     manifest(), base_events(), REQS3, verify=0, inspect=0, scope=BASE)


def deep_layout(trace):
    evs = base_events()
    # one file per event, at random depths, names unrelated to pools
    for i, e in enumerate(reversed(evs)):
        d = "/".join(f"lvl{j}" for j in range(i % 4))
        write(f"{trace}/kv/{d}/f{i:03d}.parquet", table([e], KV_TYPES))
    write(f"{trace}/requests/a/b/r.parquet", table(REQS3[:2], REQ_TYPES))
    write(f"{trace}/requests/c.parquet", table(REQS3[2:], REQ_TYPES))


case("layout_any_depth_one_row_per_file",
     "Layout: any number of *.parquet files at any depth; split at any row; order across files not guaranteed",
     manifest(), layout=deep_layout, verify=0, scope=BASE)


def mixed_pools_layout(trace):
    evs = base_events()
    # pools mixed in one file, rows shuffled, three files
    evs = evs[::-1]
    write(f"{trace}/kv/all-2.parquet", table(evs[:5], KV_TYPES))
    write(f"{trace}/kv/all-1.parquet", table(evs[5:9], KV_TYPES))
    write(f"{trace}/kv/x/all-0.parquet", table(evs[9:], KV_TYPES))
    requests_file(REQS3, trace)


case("layout_pools_mixed_rows_unsorted",
     "Layout: rows of several pools in one file, row order not guaranteed (ordering uses seq)",
     manifest(), layout=mixed_pools_layout, verify=0, scope=BASE)


def hive_other_keys(trace):
    evs = base_events()
    for i, e in enumerate(evs):
        write(f"{trace}/kv/date=2026-09-01/pool={e['pool']}/hour={i % 3}/part-{i}.parquet",
              table([e], KV_TYPES))
    write(f"{trace}/requests/date=2026-09-01/part-0.parquet", table(REQS3, REQ_TYPES))


case("layout_hive_nested_keys",
     "Layout: Hive-style key=value/ folders allowed",
     manifest(), layout=hive_other_keys, verify=0, scope=BASE)


def empty_and_markers(trace):
    kv_by_pool(base_events(), trace)
    requests_file(REQS3, trace)
    write(f"{trace}/kv/pool=0/part-00001.parquet", table([], KV_TYPES))
    write(f"{trace}/requests/part-00001.parquet", table([], REQ_TYPES))
    for p in ("kv/_SUCCESS", "requests/_SUCCESS", "kv/pool=1/.part-00000.parquet.crc",
              "kv/README.txt"):
        with open(f"{trace}/{p}", "wb") as f:
            f.write(b"not parquet")


case("layout_empty_files_and_markers",
     "Layout: only *.parquet files are data (0-row files are valid Parquet); other names are not part of the trace",
     manifest(), layout=empty_and_markers, verify=0, scope=BASE)


def inprogress(trace):
    kv_by_pool(base_events(), trace)
    requests_file(REQS3, trace)
    write(f"{trace}/kv/pool=1/part-00001.parquet.inprogress", table(base_events()[:2], KV_TYPES))


case("layout_inprogress_file",
     "Layout: only *.parquet files are data, so readers skip NAME.parquet.inprogress; "
     "verify flags it (kvtrail's crash convention: rows of a part file that never closed), "
     "and scope's evidence is not complete while rows may be unread, even with complete: true",
     manifest(), layout=inprogress, verify=1,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False,
                notes=["kv/pool=1/part-00001.parquet.inprogress"]))


def requests_split(trace):
    kv_by_pool(base_events(), trace)
    for i, r in enumerate(REQS3):
        write(f"{trace}/requests/part-{2 - i}.parquet", table([r], REQ_TYPES))


case("layout_requests_split", "Layout: files split at any row (requests table too)",
     manifest(), layout=requests_split, verify=0, scope=BASE)


def no_requests_dir(trace):
    kv_by_pool(base_events(), trace)


case("layout_no_requests_files",
     "requests table empty: events name requests missing from it; findings still reported, evidence incomplete",
     manifest(), layout=no_requests_dir, verify=0,
     scope=dict(exit=0, affected=foreign(2, {1: 4}), coverage_complete=False))


def hive_partition_only(trace):
    # What `pyarrow.dataset.write_dataset(partitioning=["pool"], flavor="hive")`
    # and DuckDB `COPY ... PARTITION_BY (pool)` write: the pool column lives
    # in the folder name only.
    import pyarrow.dataset as ds
    t = table(base_events(), KV_TYPES)
    ds.write_dataset(t, f"{trace}/kv", format="parquet",
                     partitioning=ds.partitioning(pa.schema([("pool", pa.uint16())]), flavor="hive"))
    requests_file(REQS3, trace)


case("layout_hive_partition_column_in_path_only",
     "Layout: Hive-style key=value folders (pyarrow write_dataset / DuckDB PARTITION_BY keep the key in the path only)",
     manifest(), layout=hive_partition_only, verify=0, scope=BASE)


def duckdb_layout(trace):
    import duckdb
    src = f"{trace}/../src.parquet"
    pq.write_table(table(base_events(), KV_TYPES), src)
    con = duckdb.connect()
    os.makedirs(f"{trace}/kv")
    con.execute(f"COPY (SELECT * FROM '{src}') TO '{trace}/kv' (FORMAT parquet, PARTITION_BY (pool))")
    rq = f"{trace}/../rq.parquet"
    pq.write_table(table(REQS3, REQ_TYPES), rq)
    os.makedirs(f"{trace}/requests")
    con.execute(f"COPY (SELECT * FROM '{rq}') TO '{trace}/requests/r.parquet' (FORMAT parquet)")
    os.remove(src)
    os.remove(rq)


case("layout_duckdb_partition_by",
     "Layout: a converter written in DuckDB (COPY ... PARTITION_BY (pool): Hive folders, pool only in the path)",
     manifest(), layout=duckdb_layout, verify=0, scope=BASE)


def hive_disagrees(trace):
    evs = base_events()
    write(f"{trace}/kv/pool=1/part-0.parquet",
          table([e for e in evs if e["pool"] == 0], KV_TYPES))
    write(f"{trace}/kv/pool=0/part-0.parquet",
          table([e for e in evs if e["pool"] == 1], KV_TYPES))
    requests_file(REQS3, trace)


case("layout_hive_folder_contradicts_column",
     "Layout: kv/pool=1/ holding rows whose pool column says 0: the evidence contradicts itself; refuse, naming the file and column",
     manifest(), layout=hive_disagrees, inspect=2,
     scope=dict(exit=2, stderr=["kv/pool=", "part-0.parquet", "row 0", "`pool`"]))

# =================================================================== types


def typed_case(name, why, kv_override=None, req_override=None, kv_absent=(), req_absent=(),
               order=None, extra=None, wkw=None, scope=None, **more):
    wkw = wkw or {}

    def lay(trace):
        by = {}
        for e in base_events():
            by.setdefault(e["pool"], []).append(e)
        for p, evs in by.items():
            write(f"{trace}/kv/pool={p}/part-0.parquet",
                  table(evs, KV_TYPES, kv_absent, kv_override, order, extra), **wkw)
        write(f"{trace}/requests/part-0.parquet",
              table(REQS3, REQ_TYPES, req_absent, req_override, order, extra), **wkw)

    case(name, why, manifest(), layout=lay, scope=scope or BASE, **more)


I64 = pa.int64()
typed_case("types_all_int64", "Types: pyarrow's default int64 for every integer column (values fit)",
           kv_override={k: I64 for k in ("pool", "seq", "request_id", "slot_start", "slot_count",
                                         "token_pos", "src_pool", "src_slot_start", "src_seq")},
           req_override={k: I64 for k in ("request_id", "prompt_tokens", "prefilled_tokens",
                                          "output_tokens", "http_status", "prefill_pool", "decode_pool")},
           verify=0)
typed_case("types_int32_slots_uint64_everything",
           "Types: Int32 slots, UInt64 pool/status (other widths whose values fit)",
           kv_override={"slot_start": pa.int32(), "slot_count": pa.int32(), "token_pos": pa.int32(),
                        "pool": pa.uint64(), "src_pool": pa.uint64(), "ts_ns": pa.int64()},
           req_override={"http_status": pa.uint64(), "prompt_tokens": pa.int32()}, verify=0)
typed_case("types_dictionary_strings",
           "Types: dictionary-encoded string columns",
           kv_override={"op": lambda v: pa.array(v).dictionary_encode()},
           req_override={"tenant": lambda v: pa.array(v).dictionary_encode(),
                         "external_id": lambda v: pa.array(v).dictionary_encode(),
                         "finish_reason": lambda v: pa.array(v).dictionary_encode()},
           verify=0)
typed_case("types_large_string",
           "Types: large_string (pandas/polars default) for strings, large_binary hashes of 32 bytes",
           kv_override={"op": pa.large_string()},
           req_override={"tenant": pa.large_string(), "external_id": pa.large_string(),
                         "finish_reason": pa.large_string(), "prompt_hash": pa.large_binary()},
           verify=0)
typed_case("types_string_view",
           "Types: string_view strings, variable binary hashes of 32 bytes",
           kv_override={"op": pa.string_view()},
           req_override={"tenant": pa.string_view(), "prompt_hash": pa.binary()},
           verify=0)
typed_case("types_absent_nullable_columns",
           "Nullability: nullable columns may be absent (read as null)",
           kv_absent=("token_pos",),
           req_absent=("external_id", "finish_ns", "prefilled_tokens", "finish_reason",
                       "prefill_pool", "decode_pool", "prompt_hash", "output_hash"),
           verify=0)
typed_case("types_all_null_columns_of_null_type",
           "Nullability: a nullable column with no value at all (pyarrow writes an all-None column as type null)",
           kv_override={"token_pos": lambda v: pa.nulls(len(v))},
           req_override={"output_hash": lambda v: pa.nulls(len(v)),
                         "finish_reason": lambda v: pa.nulls(len(v))},
           verify=0)
typed_case("types_extra_columns_reordered",
           "Readers must accept extra columns they do not know, in any column order",
           order=lambda names: sorted(names, reverse=True),
           extra={"layer": lambda n: pa.array([7] * n, pa.int32()),
                  "note": lambda n: pa.array(["x"] * n),
                  "nested": lambda n: pa.array([{"a": 1}] * n)},
           verify=0)
typed_case("types_timestamp_ns",
           "Types: ts_ns/arrival_ns/finish_ns written as timestamp[ns, UTC] (Int64 epoch ns with a logical type)",
           kv_override={"ts_ns": pa.timestamp("ns", tz="UTC")},
           req_override={"arrival_ns": pa.timestamp("ns", tz="UTC"), "finish_ns": pa.timestamp("ns")},
           verify=0)
for codec in ("zstd", "snappy", "gzip", "lz4", "brotli", "none"):
    typed_case(f"compression_{codec}", "Readers must accept any compression",
               wkw={"compression": codec}, verify=0)
typed_case("parquet_v1_pages_no_stats_no_dict",
           "Any Parquet encoding: format 1.0, data page v1, no statistics, no dictionary, 1-row row groups",
           wkw={"version": "1.0", "data_page_version": "1.0", "write_statistics": False,
                "use_dictionary": False, "row_group_size": 1}, verify=0)
typed_case("parquet_v2_pages_no_arrow_schema",
           "Any Parquet encoding: data page v2, no embedded Arrow schema (types from Parquet logical types)",
           wkw={"data_page_version": "2.0", "store_schema": False}, verify=0)

# types the contract forbids: exit 2 naming file, column (and row for values)
typed_case("bad_negative_in_unsigned",
           "Types: slot_start is UInt32; -1 in an int64 column cannot be a slot",
           kv_override={"slot_start": lambda v: pa.array([-1 if i == 2 else x for i, x in enumerate(v)], I64)},
           inspect=2, scope=dict(exit=2, stderr=["kv/pool=", "part-0.parquet", "slot_start", "row 2"]))
typed_case("bad_float_seq", "Types: seq is UInt64; a float column is not an integer column",
           kv_override={"seq": lambda v: pa.array([float(x) for x in v])},
           inspect=2, scope=dict(exit=2, stderr=["part-0.parquet", "seq"]))
typed_case("bad_null_in_tenant", "Nullability: tenant is not nullable",
           req_override={"tenant": lambda v: pa.array([None if i == 1 else x for i, x in enumerate(v)])},
           inspect=2, scope=dict(exit=2, stderr=["requests/part-0.parquet", "tenant", "row 1"]))
typed_case("bad_missing_required_column", "Nullability: op is required",
           kv_absent=("op",), inspect=2, scope=dict(exit=2, stderr=["kv/pool=", "op"]))
typed_case("bad_hash_16_bytes", "Types: prompt_hash is FixedSizeBinary(32)",
           req_override={"prompt_hash": lambda v: pa.array([b"x" * 16] * len(v), pa.binary(16))},
           inspect=2, scope=dict(exit=2, stderr=["requests/part-0.parquet", "prompt_hash"]))
typed_case("bad_op_uppercase", "op is one of alloc, write, read, free, share, scrub",
           kv_override={"op": lambda v: pa.array([x.upper() if i == 1 else x for i, x in enumerate(v)])},
           inspect=2, scope=dict(exit=2, stderr=["kv/pool=", "part-0.parquet", "op", "row 1"]))

# ================================================================ manifest
case("manifest_unknown_keys", "Unknown keys are ignored (at every level)",
     {**manifest(), "x_top": {"a": 1},
      "deployment": {**manifest()["deployment"], "region": "eu",
                     "pools": [{**p, "gpu": "H200"} for p in PD]},
      "capture": {**manifest()["capture"], "host": "n1"}},
     base_events(), REQS3, verify=0, scope=BASE)
case("manifest_minimal_keys",
     "Only what the contract requires: no name/engine/writer/page_size/started/ended; files omitted (unverifiable, reports say so)",
     {"format": "kvtrail-trace", "version": 1,
      "deployment": {"context_window": 4096,
                     "pools": [{"id": 0, "role": "prefill", "capacity_tokens": 64},
                               {"id": 1, "role": "decode", "capacity_tokens": 64}]},
      "capture": {"complete": True, "from_engine_start": True}},
     base_events(), REQS3, verify=1,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False, notes=["files"]))
case("manifest_version_2", "An unknown version is an error",
     manifest(version=2), base_events(), REQS3, verify=2, inspect=2,
     scope=dict(exit=2, stderr=["trace.json", "version"]))
case("manifest_unknown_role", "role is one of prefill, decode, mixed, or cache",
     manifest(pools(( 0, "prefill", 64, 4), (1, "router", 64, 4))), base_events(), REQS3,
     inspect=2, scope=dict(exit=2, stderr=["trace.json"]))
case("manifest_incomplete_capture",
     "capture.complete false: not closed cleanly; findings are not confirmed, evidence incomplete",
     manifest(complete=False), base_events(), REQS3, verify=1,
     scope=dict(exit=0, affected=foreign(2, {1: 4}, "possible"), coverage_complete=False))


def partial_files(trace):
    kv_by_pool(base_events(), trace)
    requests_file(REQS3, trace)


def with_files(edit):
    def lay(trace):
        partial_files(trace)
        m = manifest()
        m["files"] = edit(list_files(trace))
        with open(os.path.join(trace, "trace.json"), "w") as f:
            json.dump(m, f)
    return lay


case("manifest_files_partial",
     "files lists every data file: one unlisted file fails verify and the evidence is incomplete",
     None, layout=with_files(lambda fs: [f for f in fs if "pool=1" not in f["path"]]),
     verify=1, scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False))
case("manifest_files_wrong_digest",
     "files: verify checks the blake3 digest; a file that fails it is not the recorded evidence, never complete",
     None, layout=with_files(lambda fs: [dict(f, blake3="0" * 64) if "requests" in f["path"] else f for f in fs]),
     verify=1, scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False, notes=["blake3"]))
case("manifest_files_wrong_rows",
     "files: verify checks the row count; rows the files do not hold are lost events, never complete evidence",
     None, layout=with_files(lambda fs: [dict(f, rows=f["rows"] + 1) if "pool=0" in f["path"] else f for f in fs]),
     verify=1, scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False, notes=["rows"]))
case("manifest_files_lists_missing_file",
     "files lists a file that is not on disk: events are lost; never report complete evidence",
     None, layout=with_files(lambda fs: fs + [{"path": "kv/pool=1/part-00009.parquet", "rows": 3,
                                              "blake3": "1" * 64}]),
     verify=1, scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False))

# =============================================================== semantics


def sem(name, why, build, from_start=True, complete=True, reqs=REQS3, pool_list=PD, **exp):
    # One verdict: a trace scope refuses is bad input for inspect (exit 2)
    # and fails verify (exit 1) too.
    bad = exp.get("exit", 0) != 0
    case(name, why, manifest(pool_list, complete=complete, from_start=from_start),
         build(), reqs, verify=1 if bad else 0, inspect=2 if bad else 0, scope=exp)


def s_own():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0); s(1, "read", 4, 4, 0); s(1, "free", 4, 4)
    return s.events


sem("sem_own", "read is own: content owner is R", s_own, **clean())


def s_share():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_shared", "shared: R holds a grant on s and s was not written since", s_share, **clean())


def s_share_partly_rewritten():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(2, "share", 4, 4, 0); s(3, "write", 4, 2, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_share_ended_by_rewrite", "The grant holds until the slot is written again",
    s_share_partly_rewritten, exit=0, affected=foreign(2, {3: 2}), coverage_complete=True)


def s_share_rewritten_same_owner():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(2, "share", 4, 4, 0); s(1, "write", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_share_ended_by_owner_rewrite",
    "The grant holds until the slot is written again (also by the same owner)",
    s_share_rewritten_same_owner, exit=0, affected=foreign(2, {1: 4}), coverage_complete=True)


def s_share_before_write():
    s = Stream(1)
    s(2, "share", 4, 4, 0); s(1, "write", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_share_before_write", "shared needs: s was not written since the grant",
    s_share_before_write, exit=0, affected=foreign(2, {1: 4}), coverage_complete=True)


def s_share_then_free():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(2, "share", 4, 4, 0); s(1, "free", 4, 4); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_share_survives_free", "free does not write: the grant still holds",
    s_share_then_free, **clean())


def s_scrub():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "free", 4, 4); s(0, "scrub", 4, 4); s(2, "alloc", 4, 4)
    s(2, "read", 4, 4, 0)
    return s.events


sem("sem_scrub_blank", "scrub clears: afterwards blank (an integrity defect, not a leak)",
    s_scrub, **clean(blank_reads=True))


def s_never_written():
    s = Stream(1)
    s(2, "alloc", 4, 4); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_never_written_from_start", "blank: never written and the capture began with the engine",
    s_never_written, **clean(blank_reads=True))
sem("sem_never_written_not_from_start",
    "unknown: never written in a capture that did not begin with the engine: reported, never clean",
    s_never_written, from_start=False, exit=0,
    affected={"2": {"unknown": 4, "foreign": 0, "confidence": "possible", "sources": {}}})
sem("sem_never_written_from_start_absent",
    "from_engine_start absent: as false (unknown)", s_never_written, from_start=None, exit=0,
    affected={"2": {"unknown": 4, "foreign": 0, "confidence": "possible", "sources": {}}})


def s_written_not_from_start():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "free", 4, 4); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_foreign_not_from_start",
    "foreign content written inside the capture is foreign whatever from_engine_start says",
    s_written_not_from_start, from_start=False, exit=0, affected=foreign(2, {1: 4}))


def s_free_reuse():
    s = Stream(1)
    s(1, "alloc", 4, 8); s(1, "write", 4, 8, 0); s(1, "free", 4, 8)
    s(2, "alloc", 4, 8); s(2, "write", 4, 2, 0); s(2, "read", 4, 8, 0)
    return s.events


sem("sem_free_then_reuse", "free: content is NOT cleared; it stays until the next write",
    s_free_reuse, exit=0, affected=foreign(2, {1: 6}), coverage_complete=True)


def s_same_tenant():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(4, "read", 4, 4, 0)
    return s.events


sem("sem_same_tenant_foreign",
    "foreign from the same tenant: affected, not cross-tenant",
    s_same_tenant, reqs=REQS3 + [req(4, "acme")], exit=0, affected=foreign(4, {1: 4}, cross=False))


def s_repeated_reads():
    s = Stream(1)
    s(1, "write", 4, 8, 0)
    for _ in range(3):
        s(2, "read", 4, 8, 0)
    s(2, "read", 6, 4, 2)
    return s.events


sem("sem_foreign_tokens_distinct_slots",
    "foreign_tokens counts distinct (pool, slot) pairs read as foreign", s_repeated_reads,
    exit=0, affected=foreign(2, {1: 8}))


def s_two_sources():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(3, "write", 8, 2, 0); s(2, "read", 4, 6, 0)
    return s.events


sem("sem_per_source_breakdown", "per-source breakdown counts per source request",
    s_two_sources, exit=0, affected=foreign(2, {1: 4, 3: 2}))


def s_engine_writes():
    s = Stream(1)
    s(0, "write", 4, 4); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_engine_content_read",
    "request 0 is the engine: its content read by R is foreign (source 0), not cross-tenant",
    s_engine_writes, exit=0,
    affected={"2": {"foreign": 4, "unknown": 0, "sources": {"0": 4}, "cross_tenant": False}})


def s_engine_reads():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "free", 4, 4); s(0, "read", 4, 4)
    return s.events


sem("sem_engine_reads",
    "reads by request 0 (the engine itself) are not a customer response: nobody affected",
    s_engine_reads, **clean(notes=["request 0"]))


def s_unknown_requests():
    s = Stream(1)
    s(9, "write", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_requests_missing_from_table",
    "events of requests missing from the requests table: findings reported (tenant unknown), evidence incomplete",
    s_unknown_requests, exit=0,
    affected={"2": {"foreign": 4, "sources": {"9": 4}, "cross_tenant": True}},
    coverage_complete=False, requests_missing=[9])


def s_unsorted():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "free", 4, 4); s(2, "alloc", 4, 4); s(2, "write", 4, 1, 0)
    s(2, "read", 4, 4, 0)
    evs = s.events
    evs = [evs[3], evs[0], evs[4], evs[2], evs[1]]
    for e in evs:  # timestamps decreasing with seq, and ties
        e["ts_ns"] = T0 + 10_000 - e["seq"] * 1000 if e["seq"] != 1 else T0 + 10_000
    return evs


sem("sem_unsorted_rows_ts_not_monotonic",
    "ordering uses seq, not row order nor ts_ns (ties, decreasing ts)", s_unsorted,
    exit=0, affected=foreign(2, {1: 3}))


def s_duplicate():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events + [dict(s.events[1])]


sem("sem_duplicated_event", "seq strictly increasing per pool: a duplicated event is bad input",
    s_duplicate, exit=2, stderr=["kv/pool=1/part-00000.parquet", "seq"])


def s_hole_middle():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s.lose(1); s(1, "free", 4, 4); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_hole_middle",
    "a hole means lost events: everything downstream reported with lowered confidence, never ignored",
    s_hole_middle, exit=0, affected={"2": {"confidence": "possible"}}, coverage_complete=False)


def s_hole_hides_own():
    s = Stream(1)
    s(2, "alloc", 4, 4); s.lose(2); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_hole_before_clean_read",
    "a read that looks blank after a hole may have read lost writes: never counted clean",
    s_hole_hides_own, exit=0, affected={"2": {"confidence": "possible"}}, coverage_complete=False)


def s_hole_start():
    s = Stream(1, start=3)
    s(1, "write", 4, 4, 0); s(2, "read", 4, 8, 0)
    return s.events


sem("sem_hole_at_start",
    "seq is the position in the pool's stream (from 0): a stream starting at 3 lost 3 events; "
    "slots 8..12 look never written but the lost events may have written them (possible); "
    "slots 4..8 were written after the hole, so that finding depends on no lost event (confirmed)",
    s_hole_start, exit=0,
    affected={"2": {"foreign": 4, "confidence": "confirmed", "sources": {"1": 4}}},
    coverage_complete=False)


def s_hole_then_rewrite():
    s = Stream(1)
    s(3, "write", 4, 4, 0); s.lose(2); s(1, "write", 4, 4, 0); s(1, "free", 4, 4)
    s(2, "read", 4, 4, 0)
    return s.events


sem("sem_hole_before_rewrite",
    "reading note: 'downstream' of a hole is what depends on state from before it; "
    "content rewritten after the hole is known, so that foreign read is confirmed "
    "(the evidence as a whole stays incomplete)",
    s_hole_then_rewrite, exit=0, affected=foreign(2, {1: 4}), coverage_complete=False)


def s_placeholder():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "alloc", 4, 8); w1 = p0(1, "write", 4, 8, 0)
    p1(1, "alloc", 4, 8); p1(1, "write", 4, 8, 0, src=(0, 4, w1)); p1(1, "read", 4, 8, 0)
    p1(1, "free", 4, 8); p0(1, "free", 4, 8)
    # R2: 5000-token prompt replaced by a 1-token placeholder
    p0(2, "alloc", 4, 1); w2 = p0(2, "write", 4, 1, 0)
    p1(2, "alloc", 4, 8); p1(2, "write", 4, 1, 0, src=(0, 4, w2)); p1(2, "read", 4, 8, 0)
    return p0.events + p1.events


case("sem_placeholder_incident",
     "the incident: prefilled_tokens=1 with HTTP 200 over preallocated stale decode slots",
     manifest(), s_placeholder(),
     [req(1, "acme"), req(2, "globex", prompt=5000, prefilled=1)], verify=0,
     scope=dict(exit=0, affected=foreign(2, {1: 7}), coverage_complete=True,
                anomalies=["error_looks_like_success"]))


def s_copy_src_seq():
    p0, p1 = Stream(0), Stream(1)
    a = p0(1, "write", 4, 4, 0)
    b = p0(3, "write", 4, 4, 0)
    p1(1, "write", 8, 4, 0, src=(0, 4, a)); p1(1, "read", 8, 4, 0)
    p1(2, "write", 12, 4, 0, src=(0, 4, b)); p1(2, "read", 12, 4, 0)
    p1(3, "write", 16, 4, 0, src=(0, 4, a)); p1(3, "read", 16, 4, 0)
    return p0.events + p1.events


case("sem_copy_reads_state_at_src_seq",
     "copy: each destination slot takes the owner the source slot had just after src_seq",
     manifest(), s_copy_src_seq(), REQS3, verify=0,
     scope=dict(exit=0, affected={**foreign(2, {3: 4}), **foreign(3, {1: 4})},
                coverage_complete=True))


def s_copy_inside_one_pool():
    # A copy-on-write block copy: R2 gets a private copy (slots 16..20) of
    # R1's block 4..8 as it was just after R1's write, although R3 rewrote
    # 4..8 before the copy; R2 is granted the copy and reads it (shared);
    # R3 reads a second copy of R1's block without a grant (foreign, R1).
    s = Stream(1)
    a = s(1, "write", 4, 4, 0)
    s(3, "write", 4, 4, 0)
    s(2, "alloc", 16, 4)
    s(2, "write", 16, 4, 0, src=(1, 4, a))
    s(2, "share", 16, 4, 0)
    s(2, "read", 16, 4, 0)
    s(3, "write", 24, 4, 0, src=(1, 4, a))
    s(3, "read", 24, 4, 0)
    return s.events


sem("sem_copy_inside_one_pool",
    "copy inside one pool: each destination slot takes the state its source slot had just "
    "after the earlier event src_seq of the same pool",
    s_copy_inside_one_pool, exit=0, affected=foreign(3, {1: 4}), coverage_complete=True)


def s_same_pool_not_earlier():
    s = Stream(1)
    s(1, "write", 4, 4, 0)
    s(2, "write", 16, 4, 0, src=(1, 4, 1))  # reads its own seq
    return s.events


def s_same_pool_overlap():
    s = Stream(1)
    a = s(1, "write", 4, 4, 0)
    s(2, "write", 6, 4, 0, src=(1, 4, a))  # 4..8 into 6..10
    return s.events


sem("bad_same_pool_copy_not_earlier",
    "copy inside one pool: src_seq must be below the copy's own seq",
    s_same_pool_not_earlier, exit=2, stderr=["kv/pool=1/part-00000.parquet", "row 1", "src_seq"])
sem("bad_same_pool_copy_overlap",
    "copy inside one pool: source and destination extents must not overlap",
    s_same_pool_overlap, exit=2,
    stderr=["kv/pool=1/part-00000.parquet", "row 1", "src_slot_start", "overlap"])


def s_copy_of_copy():
    p0, p1, p2 = Stream(0), Stream(1), Stream(2)
    a = p0(1, "write", 4, 4, 0)
    b = p1(1, "write", 8, 4, 0, src=(0, 4, a))
    p1(3, "write", 8, 4, 0)  # the later state of pool 1 must not leak into the copy
    p2(2, "write", 20, 4, 0, src=(1, 8, b)); p2(2, "read", 20, 4, 0)
    return p0.events + p1.events + p2.events


case("sem_copy_of_a_copy", "Provenance follows copies (a copy of a copy keeps the first owner)",
     manifest(pools((0, "prefill", 64, 4), (1, "mixed", 64, 4), (2, "decode", 64, 4))),
     s_copy_of_copy(), REQS3, verify=0,
     scope=dict(exit=0, affected=foreign(2, {1: 4}), coverage_complete=True))


def s_copy_in_hole():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 4, 0); p0.lose(1); p0(3, "write", 4, 4, 0)
    p1(2, "write", 8, 4, 0, src=(0, 4, 1)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_copy_src_seq_in_hole",
     "a copy whose source state was lost: its content is unknown; reported with lowered confidence",
     manifest(), s_copy_in_hole(), REQS3, verify=0,
     scope=dict(exit=0, affected={"2": {"confidence": "possible"}}, coverage_complete=False))


def s_copy_past_end():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 4, 0)
    p1(2, "write", 8, 4, 0, src=(0, 4, 5)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_copy_src_seq_past_end",
     "a copy of a source state after the last recorded source event: events lost at the end",
     manifest(), s_copy_past_end(), REQS3, verify=0,
     scope=dict(exit=0, affected={"2": {"confidence": "possible"}}, coverage_complete=False))


def s_copy_cycle():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 4, 0, src=(1, 4, 0))
    p1(1, "write", 4, 4, 0, src=(0, 4, 0))
    return p0.events + p1.events


case("sem_copy_cycle", "A set of copies that wait on each other with no possible order is an error",
     manifest(), s_copy_cycle(), REQS3, verify=0, inspect=0, scope=dict(exit=2, stderr=["src_seq", "wait on each other"]))


def s_token_pos_only():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "read", 4, 4, 0); s(1, "read", 4, 4, 100)
    return s.events


sem("sem_token_pos_is_informational",
    "token_pos is the sequence position (no effect on ownership)", s_token_pos_only, **clean())


def s_request_without_events():
    return s_own()


sem("sem_request_rows_without_events", "request rows without events are fine",
    s_request_without_events, reqs=REQS3 + [req(50, "umbrella")], **clean())



def s_share_on_unwritten():
    s = Stream(1)
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_share_of_never_written_not_from_start",
    "reading note: a grant on a slot never written in a capture that did not begin with the engine "
    "fits both 'shared' and 'unknown'; unknown 'must be reported, never counted as clean', so it is reported",
    s_share_on_unwritten, from_start=False, exit=0,
    affected={"2": {"unknown": 4, "foreign": 0, "confidence": "possible", "sources": {}}})


def s_share_ended_by_copy():
    p0, p1 = Stream(0), Stream(1)
    a = p0(3, "write", 4, 4, 0)
    p1(1, "write", 8, 4, 0); p1(2, "share", 8, 4, 0)
    p1(3, "write", 8, 4, 0, src=(0, 4, a)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_share_ended_by_copy", "a copy is a write: it ends the grant; the copied owner is the source",
     manifest(), s_share_ended_by_copy(), REQS3, verify=0,
     scope=dict(exit=0, affected=foreign(2, {3: 4}), coverage_complete=True))


def s_copy_of_scrubbed(scrub):
    def build():
        p0, p1 = Stream(0), Stream(1)
        if scrub:
            p0(1, "write", 4, 4, 0)
            a = p0(0, "scrub", 4, 4)
        else:
            a = p0(1, "alloc", 20, 1)
        p1(2, "write", 8, 4, 0, src=(0, 4, a)); p1(2, "read", 8, 4, 0)
        return p0.events + p1.events
    return build


case("sem_copy_of_scrubbed_slots", "scrub: no owner; a copy of it carries no owner (blank)",
     manifest(), s_copy_of_scrubbed(True)(), REQS3, verify=0,
     scope=clean(blank_reads=True))
case("sem_copy_of_never_written_not_from_start",
     "a copy of slots never written in a capture that did not begin with the engine: unknown, reported",
     manifest(from_start=False), s_copy_of_scrubbed(False)(), REQS3, verify=0,
     scope=dict(exit=0, affected={"2": {"unknown": 4, "foreign": 0, "confidence": "possible"}}))


def s_reader_missing():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(7, "read", 4, 4, 0)
    return s.events


sem("sem_reader_missing_from_table",
    "a reader missing from the requests table: still affected (tenant unknown, so cross-tenant), evidence incomplete",
    s_reader_missing, exit=0, affected={"7": {"foreign": 4, "sources": {"1": 4}, "cross_tenant": True}},
    coverage_complete=False, requests_missing=[7])

BIG = 2**63 + 5


def s_big_ids():
    s = Stream(1)
    s(BIG, "write", 4, 4, 0); s(BIG + 1, "read", 4, 4, 0)
    return s.events


sem("sem_request_ids_above_int64", "request_id is UInt64: ids above 2^63 are valid",
    s_big_ids, reqs=[req(BIG, "acme"), req(BIG + 1, "globex")], exit=0,
    affected=foreign(BIG + 1, {BIG: 4}))


def interleaved(trace):
    evs = [e for e in base_events() if e["pool"] == 1]
    write(f"{trace}/kv/pool=1/a.parquet", table(evs[0::2], KV_TYPES))
    write(f"{trace}/kv/pool=1/b.parquet", table(evs[1::2][::-1], KV_TYPES))
    write(f"{trace}/kv/pool=0/a.parquet", table([e for e in base_events() if e["pool"] == 0], KV_TYPES))
    requests_file(REQS3, trace)


case("layout_one_pool_interleaved_across_files",
     "row order across files is not guaranteed: one pool's seqs interleaved over two files",
     manifest(), layout=interleaved, verify=0, scope=BASE)


def dup_across_files(trace):
    evs = [e for e in base_events() if e["pool"] == 1]
    write(f"{trace}/kv/pool=1/a.parquet", table(evs, KV_TYPES))
    write(f"{trace}/kv/pool=1/b.parquet", table(evs[3:4], KV_TYPES))
    write(f"{trace}/kv/pool=0/a.parquet", table([e for e in base_events() if e["pool"] == 0], KV_TYPES))
    requests_file(REQS3, trace)


case("bad_duplicate_seq_across_files", "seq strictly increasing per pool: the same seq in two files",
     manifest(), layout=dup_across_files, verify=1, inspect=2,
     scope=dict(exit=2, stderr=["kv/pool=1/", "seq"]))


def remap(evs, m):
    out = []
    for e in evs:
        e = dict(e, pool=m[e["pool"]])
        if e["src_pool"] is not None:
            e["src_pool"] = m[e["src_pool"]]
        out.append(e)
    return out


case("manifest_sparse_pool_ids", "pool ids are ids (UInt16), not indexes: 7 and 300",
     manifest(pools((7, "prefill", 64, 4), (300, "decode", 64, 4))),
     remap(base_events(), {0: 7, 1: 300}),
     [dict(r, prefill_pool=7, decode_pool=300) for r in REQS3], verify=0, scope=BASE)
case("manifest_no_capture_object",
     "capture.complete is true only when the recorder closed cleanly: absent is not true",
     {k: v for k, v in manifest().items() if k != "capture"}, base_events(), REQS3, verify=1,
     scope=dict(exit=0, affected=foreign(2, {1: 4}, "possible"), coverage_complete=False))

for name, why, mut, frags in [
    ("bad_request_id_0_in_requests", "request_id 0 is reserved for the engine itself",
     lambda rs: [dict(rs[0], request_id=0)] + rs[1:], ["requests/part-00000.parquet", "request_id", "row 0"]),
    ("bad_duplicate_request_id", "request_id is unique within the trace",
     lambda rs: rs + [dict(rs[1])], ["request_id"]),
]:
    case(name, why, manifest(), base_events(), mut(list(REQS3)),
         verify=1, inspect=2, scope=dict(exit=2, stderr=frags))


def bad_kv(name, why, edit, frags):
    evs = base_events()
    edit(evs)
    case(name, why, manifest(), evs, REQS3, inspect=2, scope=dict(exit=2, stderr=frags))


def set_(i, **kw):
    return lambda evs: evs[i].update(kw)


bad_kv("bad_slot_count_0", "slot_count: number of slots, at least 1", set_(1, slot_count=0),
       ["kv/pool=0/part-00000.parquet", "row 1", "slot_count"])
bad_kv("bad_extent_outside_pool", "slot = page * page_size + offset within the pool's capacity",
       set_(1, slot_start=62), ["kv/pool=0/part-00000.parquet", "row 1", "slot_start"])
bad_kv("bad_unknown_pool", "pool: pool id from the manifest", set_(1, pool=5),
       ["kv/pool=5/part-00000.parquet", "row 0", "pool", "unknown pool id 5"])
bad_kv("bad_src_on_read", "src columns: write only", set_(6, src_pool=0, src_slot_start=4, src_seq=1),
       ["kv/pool=1/part-00000.parquet", "src_pool"])
bad_kv("bad_partial_src", "a copy names src_pool, src_slot_start and src_seq",
       set_(4, src_pool=0, src_slot_start=4, src_seq=None), ["kv/pool=1/part-00000.parquet", "src_seq"])
typed_case("types_dictionary_integers",
           "Types: integer columns dictionary-encoded (pandas Categorical): same values",
           kv_override={"pool": lambda v: pa.array(v, pa.uint16()).dictionary_encode(),
                        "request_id": lambda v: pa.array(v, pa.int64()).dictionary_encode()},
           req_override={"http_status": lambda v: pa.array(v, pa.int64()).dictionary_encode()},
           verify=0)



def hidden_parquet(trace):
    kv_by_pool(base_events(), trace)
    requests_file(REQS3, trace)
    # Spark/Hadoop temporary and hidden files: not part of the trace
    write(f"{trace}/kv/_temporary/0/part-00000.parquet", table(base_events(), KV_TYPES))
    write(f"{trace}/kv/pool=1/.part-00000.parquet", table(base_events(), KV_TYPES))


case("layout_hidden_parquet_files",
     "reading note: *.parquet under names starting with _ or . (Spark _temporary/, hidden copies) are "
     "skipped like _SUCCESS; verify names them, and scope's evidence is not complete, so rows "
     "cannot vanish unseen",
     manifest(), layout=hidden_parquet, verify=1,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False,
                notes=["kv/_temporary/0/part-00000.parquet"]))



_m = manifest(complete=False)
_m["deployment"] = {**_m["deployment"], "name": None, "engine": None,
                    "pools": [{**p, "name": None} for p in PD]}
_m["capture"] = {**_m["capture"], "writer": None, "ended_ns": None}
case("manifest_null_optional_values",
     "optional keys written as null (an unknown ended_ns of a capture that did not close): as if absent",
     _m, base_events(), REQS3, verify=1,
     scope=dict(exit=0, affected=foreign(2, {1: 4}, "possible"), coverage_complete=False))


def s_copy_mixed_owners():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 2, 0)
    a = p0(3, "write", 6, 2, 2)
    p1(2, "write", 8, 4, 0, src=(0, 4, a)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_copy_per_slot_owners",
     "copy: EACH destination slot takes the owner of the matching source slot",
     manifest(), s_copy_mixed_owners(), REQS3, verify=0,
     scope=dict(exit=0, affected=foreign(2, {1: 2, 3: 2}), coverage_complete=True))


def s_copy_from_before_hole():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 4, 0); p0.lose(1); a = p0(1, "free", 4, 4)
    p1(2, "write", 8, 4, 0, src=(0, 4, a)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_copy_of_content_older_than_a_source_hole",
     "a copy reads source state that a lost event may have changed: lowered confidence follows the copy",
     manifest(), s_copy_from_before_hole(), REQS3, verify=0,
     scope=dict(exit=0, affected={"2": {"confidence": "possible"}}, coverage_complete=False))



def big_file(bad_row):
    def lay(trace):
        # 80,000 events in one pool: R1 writes and reads its own slot, over
        # and over, in row groups of 10,000 (several reader batches).
        n = 80_000
        evs = []
        for i in range(n):
            op = "write" if i % 2 == 0 else "read"
            evs.append(ev(1, i, 1, op, 4, 4, 0))
        t = table(evs, KV_TYPES)
        if bad_row is not None:
            ops = t.column("op").to_pylist()
            ops[bad_row] = "evict"
            t = t.set_column(t.schema.get_field_index("op"), "op", pa.array(ops))
        write(f"{trace}/kv/pool=1/part-0.parquet", t, row_group_size=10_000)
        requests_file(REQS3, trace)
    return lay


case("layout_many_row_groups", "files of many row groups and batches read like small ones",
     manifest(), layout=big_file(None), verify=0, scope=clean())
case("bad_op_deep_in_a_file",
     "errors name the row within the file (0-based), across row groups and batches",
     manifest(), layout=big_file(70_001), inspect=2,
     scope=dict(exit=2, stderr=["kv/pool=1/part-0.parquet", "row 70001", "op", "evict"]))


def requests_by_tenant(trace):
    import pyarrow.dataset as ds
    kv_by_pool(base_events(), trace)
    ds.write_dataset(table(REQS3, REQ_TYPES), f"{trace}/requests", format="parquet",
                     partitioning=ds.partitioning(pa.schema([("tenant", pa.string())]), flavor="hive"))


case("layout_requests_partitioned_by_tenant",
     "Hive folders in requests/ too: tenant kept in the folder name only",
     manifest(), layout=requests_by_tenant, verify=0, scope=BASE)



def shifted(off):
    evs = []
    for e in base_events():
        e = dict(e, seq=e["seq"] + off)
        if e["src_seq"] is not None:
            e["src_seq"] += off
        evs.append(e)
    return evs


case("sem_seqs_from_an_engine_counter",
     "seq is UInt64: a capture that joined a running engine may number from its counter (2^63 + 10): "
     "leading holes in both pools, never an overflow",
     manifest(from_start=False), shifted(2**63 + 10), REQS3, verify=0,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False))
case("sem_seq_up_to_uint64_max_minus_1",
     "seq is UInt64: the last event of pool 1 at seq 2^64-2, the highest kvtrail reads "
     "(2^64-1 is reserved, see the reading notes) (no overflow anywhere)",
     manifest(from_start=False), shifted(2**64 - 9), REQS3, verify=0,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=False))
case("bad_seq_uint64_max",
     "seq 2^64-1 would be a pool's 2^64th event: reserved (reading notes), one verdict from all three",
     manifest(from_start=False), shifted(2**64 - 8), REQS3, verify=1, inspect=2,
     scope=dict(exit=2, stderr=["kv/pool=1/part-00000.parquet", "row 7", "`seq`", "reserved"]))
case("manifest_pool_listed_twice", "pool ids identify pools: the same id twice is an error",
     manifest(pools((0, "prefill", 64, 4), (1, "decode", 64, 4), (1, "decode", 64, 4))),
     base_events(), REQS3, verify=2, inspect=2, scope=dict(exit=2, stderr=["trace.json", "pool id 1"]))



case("types_uint64_ids_as_decimal",
     "Types: request_id above 2^63 written as decimal(20, 0) by a writer without unsigned 64-bit ints (Spark)",
     manifest(), layout=lambda trace: (
         write(f"{trace}/kv/pool=1/p.parquet",
               table(s_big_ids(), KV_TYPES, override={"request_id": pa.decimal128(20, 0)})),
         write(f"{trace}/requests/r.parquet",
               table([req(BIG, "acme"), req(BIG + 1, "globex")], REQ_TYPES,
                     override={"request_id": pa.decimal128(20, 0)}))),
     verify=0, scope=dict(exit=0, affected=foreign(BIG + 1, {BIG: 4})))
typed_case("bad_decimal_with_fraction", "Types: a decimal with a fraction is no integer column",
           kv_override={"slot_start": pa.decimal128(10, 2)}, inspect=2,
           scope=dict(exit=2, stderr=["part-0.parquet", "slot_start"]))


case("manifest_utf8_bom", "trace.json is UTF-8 JSON; a byte-order mark in front of it is tolerated",
     {**manifest(), "_bom": True}, base_events(), REQS3, verify=0, scope=BASE)



def empty_untyped(trace):
    kv_by_pool(base_events(), trace)
    requests_file(REQS3, trace)
    # pandas/pyarrow on an empty DataFrame: every column of type null
    write(f"{trace}/kv/pool=1/part-00001.parquet", pa.table({n: pa.nulls(0) for n in KV_TYPES}))
    write(f"{trace}/requests/part-00001.parquet", pa.table({n: pa.nulls(0) for n in REQ_TYPES}))


case("layout_empty_file_untyped_columns",
     "0-row files are valid whatever type an empty column got (pyarrow gives an empty untyped column type null)",
     manifest(), layout=empty_untyped, verify=0, scope=BASE)



def s_share_then_copy():
    p0, p1 = Stream(0), Stream(1)
    p0(1, "write", 4, 4, 0)
    g = p0(2, "share", 4, 4, 0)
    p1(2, "write", 8, 4, 0, src=(0, 4, g)); p1(2, "read", 8, 4, 0)
    return p0.events + p1.events


case("sem_grant_does_not_follow_copy",
     "a grant is on (pool, slot): R2's prefix hit on prefill slots does not cover the decode slots its "
     "transfer copied R1's KV into; the copied owner is R1 and R2 has no grant there: foreign "
     "(a hook records a share on the decode slots too)",
     manifest(), s_share_then_copy(), REQS3, verify=0,
     scope=dict(exit=0, affected=foreign(2, {1: 4}), coverage_complete=True))


import datetime
import decimal

typed_case("types_exotic_extra_columns",
           "extra columns of any type are ignored: duration, map, list of structs, decimal256, "
           "float16, date, time, fixed binary, boolean",
           extra={"x_dur": lambda n: pa.array([datetime.timedelta(seconds=1)] * n, pa.duration("us")),
                  "x_map": lambda n: pa.array([[("a", 1)]] * n, pa.map_(pa.string(), pa.int64())),
                  "x_los": lambda n: pa.array([[{"k": 1}]] * n),
                  "x_d256": lambda n: pa.array([decimal.Decimal("1.5")] * n, pa.decimal256(40, 2)),
                  "x_f16": lambda n: pa.array([1.0] * n, pa.float32()).cast(pa.float16()),
                  "x_date": lambda n: pa.array([datetime.date(2026, 9, 1)] * n),
                  "x_time": lambda n: pa.array([datetime.time(1, 2)] * n),
                  "x_fsb": lambda n: pa.array([b"ab"] * n, pa.binary(2)),
                  "x_bool": lambda n: pa.array([True] * n)},
           verify=0)



def s_dup_unsorted():
    s = Stream(1)
    s(1, "write", 4, 4, 0); s(1, "free", 4, 4); s(2, "alloc", 4, 4); s(2, "read", 4, 4, 0)
    e = s.events
    return [e[2], e[0], e[3], dict(e[2], op="free"), e[1]]


sem("sem_duplicate_seq_in_unsorted_file",
    "seq strictly increasing per pool: a duplicate far apart in an unsorted file is still bad input",
    s_dup_unsorted, exit=2, stderr=["kv/pool=1/part-00000.parquet", "seq"])



def ms_timestamps(trace):
    kv_by_pool(base_events(), trace)
    rows = [dict(r, arrival_ns=T0 + r["request_id"] * 10**6, finish_ns=None) for r in REQS3]
    write(f"{trace}/requests/r.parquet",
          table(rows, REQ_TYPES, override={
              "arrival_ns": lambda v: pa.array([x // 10**6 for x in v], pa.timestamp("ms", tz="UTC"))}))


case("types_timestamp_ms_scaled",
     "Types: arrival_ns as timestamp[ms] (pandas/Spark): the same instant in epoch ns",
     manifest(), layout=ms_timestamps, verify=0,
     scope=dict(exit=0, affected={"2": {**BASE_AFFECTED["2"], "arrival_ns": T0 + 2 * 10**6}},
                coverage_complete=True))



def respell(fs):
    out = []
    for i, f in enumerate(fs):
        out.append(dict(f, path=("./" + f["path"]) if i % 2 == 0 else f["path"].replace("/", "\\")))
    return out


case("manifest_files_paths_spelled_otherwise",
     "files paths relative to the trace root written as ./kv/... or with Windows separators",
     None, layout=with_files(respell), verify=0,
     scope=dict(exit=0, affected=BASE_AFFECTED, coverage_complete=True))

def outside(fs):
    return fs + [dict(fs[0], path="../elsewhere/secret.parquet", blake3="0" * 64)]


case("bad_files_path_outside_the_trace",
     "files: paths relative to the trace root; one that climbs out with .. names no file of the trace "
     "(a reader must not be led to hash files elsewhere)",
     None, layout=with_files(outside), verify=2, inspect=2,
     scope=dict(exit=2, stderr=["trace.json", "files[", "does not name a file inside the trace"]))


# ============================================================ revision 2
# One case per sentence of revision 2 (docs/trace-format.md, "Revision 2"):
# alloc makes content stale, a share grants only current content, copies
# carry the current/stale bit, copies both ways between pools when causal,
# the `cache` role, engine reads in a cache pool.

# Pools of a device with a host tier: decode pool 1 offloads to cache pool 2.
TIERED = pools((0, "prefill", 64, 4), (1, "decode", 64, 4), (2, "cache", 128, 4))


def s_alloc_makes_stale():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0); s(1, "free", 4, 4)
    s(3, "alloc", 4, 4)  # R3 holds the slots but never writes them
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_alloc_makes_stale",
    "alloc: content is unchanged and becomes stale; a grant on stale content covers nothing "
    "(cache poisoning): the read is foreign, its source the earlier writer R1",
    s_alloc_makes_stale, exit=0, affected=foreign(2, {1: 4}), coverage_complete=True)


def s_alloc_same_owner_stale():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0); s(1, "free", 4, 4)
    s(1, "alloc", 4, 4)  # held again by the same request, not rewritten
    s(1, "read", 4, 4, 0)
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_alloc_stale_for_the_same_owner",
    "alloc: content predates this holding, whoever wrote it: R1's own read stays own, but a "
    "grant on it covers nothing (foreign for R2, source R1)",
    s_alloc_same_owner_stale, exit=0, affected=foreign(2, {1: 4}), coverage_complete=True)


def s_write_after_alloc():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0); s(1, "free", 4, 4)
    s(3, "alloc", 4, 4); s(3, "write", 4, 4, 0)
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_write_after_alloc_current",
    "write: the content owner becomes the request and the slot is current; a grant on it covers "
    "the read (shared, clean)",
    s_write_after_alloc, **clean())


def s_grant_partly_stale():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0)
    s(3, "alloc", 6, 2)  # slots 6, 7 now stale
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    return s.events


sem("sem_grant_covers_only_current_slots",
    "the grant covers the content the slots hold at the grant, and only if that content is "
    "current: per slot, 4-5 shared, 6-7 foreign (source R1)",
    s_grant_partly_stale, exit=0, affected=foreign(2, {1: 2}), coverage_complete=True)


def s_scrub_current():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0); s(1, "free", 4, 4)
    s(3, "alloc", 4, 4)  # stale R1 content
    s(0, "scrub", 4, 4)  # cleared: no owner, current
    s(2, "share", 4, 4, 0); s(2, "read", 4, 4, 0)
    s(3, "read", 4, 4, 0)
    return s.events


sem("sem_scrub_current",
    "scrub: the slots are cleared; afterwards they have no owner and are current: the stale R1 "
    "content is gone, reads are blank (no foreign read, no source)",
    s_scrub_current, **clean(blank_reads=True))


def s_copy_carries(stale):
    def build():
        p0, p1 = Stream(0), Stream(1)
        p0(1, "alloc", 4, 4); w = p0(1, "write", 4, 4, 0)
        if stale:
            p0(1, "free", 4, 4)
            w = p0(2, "alloc", 4, 4)  # R2's placeholder holds the pages, never writes them
        p1(2, "alloc", 8, 4); p1(2, "write", 8, 4, 0, src=(0, 4, w))
        p1(3, "share", 8, 4, 0); p1(3, "read", 8, 4, 0)
        return p0.events + p1.events
    return build


sem("sem_copy_carries_stale",
    "write with src: each destination slot takes the content owner AND the current/stale state "
    "of the source slot; a transfer of pages a placeholder never wrote carries stale KV, so a "
    "grant downstream covers nothing: R3's read is foreign (source R1)",
    s_copy_carries(True), exit=0, affected=foreign(3, {1: 4}), coverage_complete=True)
sem("sem_copy_carries_current",
    "write with src: current source content stays current at the destination; a grant on it "
    "covers the read (shared, clean)",
    s_copy_carries(False), **clean())


def s_grant_keeps_what_it_saw():
    s = Stream(1)
    s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0)
    s(2, "share", 4, 4, 0)
    s(1, "free", 4, 4); s(3, "alloc", 4, 4)  # stale now, but not written
    s(2, "read", 4, 4, 0)
    return s.events


sem("sem_grant_keeps_what_it_saw",
    "a grant given on current content holds until the slot is written again; a later alloc "
    "without a write is no write: still shared (clean)",
    s_grant_keeps_what_it_saw, **clean())


def s_both_ways():
    p1, p2 = Stream(1), Stream(2)
    p1(1, "alloc", 4, 4); a = p1(1, "write", 4, 4, 0); p1(1, "read", 4, 4, 0)
    # the engine offloads R1's pages to the host tier ...
    p2(0, "alloc", 0, 4); b = p2(0, "write", 0, 4, src=(1, 4, a))
    p1(1, "free", 4, 4)
    p1(2, "alloc", 4, 4); p1(2, "write", 4, 4, 0); p1(2, "read", 4, 4, 0)
    # ... and loads them back into fresh device pages
    p1(0, "alloc", 12, 4); p1(0, "write", 12, 4, src=(2, 0, b))
    p1(3, "share", 12, 4, 0); p1(3, "read", 12, 4, 0)  # prefix hit on the loaded pages
    p1(1, "read", 12, 4, 0)                            # R1's own KV, back from the tier
    p1(2, "read", 12, 4, 0)                            # R2: no grant
    return p1.events + p2.events


case("sem_copies_both_ways_causal",
     "Pools may copy to each other in both directions (a device pool offloading to a `cache` "
     "pool and loading back) when causal: provenance and the current bit follow both copies; "
     "R3's grant covers R1's reloaded KV (shared), R1 reads its own, R2 without a grant reads "
     "R1's (foreign, source R1)",
     manifest(TIERED), s_both_ways(), REQS3, verify=0, inspect=0,
     scope=dict(exit=0, affected=foreign(2, {1: 4}), coverage_complete=True))


def s_wait_on_each_other():
    p1, p2 = Stream(1), Stream(2)
    p1(1, "write", 4, 4, 0)
    p1(0, "write", 12, 4, src=(2, 0, 1))  # reads pool 2 as of its seq 1 ...
    p2(0, "alloc", 0, 4)
    p2(0, "write", 0, 4, src=(1, 4, 1))   # ... which reads pool 1 as of this seq 1
    return p1.events + p2.events


case("sem_copies_wait_on_each_other",
     "a set of copies that wait on each other with no possible order is an error: the replay "
     "refuses it naming both rows (scope, audit, diff; counterfactual too, on traces of the "
     "reference model it can re-run); verify and inspect check structure only",
     manifest(TIERED), s_wait_on_each_other(), REQS3, verify=0, inspect=0,
     scope=dict(exit=2, stderr=["wait on each other", "kv/pool=1/part-00000.parquet",
                                "kv/pool=2/part-00000.parquet", "row 1", "src_seq"]),
     refused_by=[["audit"], ["diff", "{trace}", "{trace}"]])


def s_engine_reads_cache():
    p1, p2 = Stream(1), Stream(2)
    p1(1, "alloc", 4, 4); a = p1(1, "write", 4, 4, 0)
    p2(0, "alloc", 0, 4); p2(0, "write", 0, 4, src=(1, 4, a))
    p2(0, "read", 0, 4)   # the engine reads the tier (a load, an eviction to disk)
    p1(1, "free", 4, 4)
    p1(0, "read", 4, 4)   # and the device pages it offloaded from
    return p1.events + p2.events


case("sem_engine_reads_affect_no_response",
     "Reads by request 0 (the engine itself: tier offload and load, eviction) affect no "
     "response, also in a `cache` pool",
     manifest(TIERED), s_engine_reads_cache(), REQS3, verify=0, inspect=0,
     scope=clean(notes=["request 0"]))


def s_no_alloc():
    p0, p1 = Stream(0), Stream(1)
    w = p0(1, "write", 4, 8, 0)
    p1(1, "write", 4, 8, 0, src=(0, 4, w))
    p1(2, "share", 4, 4, 0)
    p1(1, "free", 4, 8)
    p1(3, "write", 8, 2, 0)
    p1(2, "read", 4, 8, 0)
    return p0.events + p1.events


sem("sem_no_alloc_same_as_rev1",
    "where a trace has no alloc events the results are the same as under revision 1: every "
    "written slot is current; 4-7 shared, 8-9 foreign R3, 10-11 foreign R1",
    s_no_alloc, exit=0, affected=foreign(2, {1: 2, 3: 2}), coverage_complete=True)

case("manifest_role_cache",
     "role is one of prefill, decode, mixed, or cache (a tier that only holds copies)",
     manifest(TIERED), base_events(), REQS3, verify=0, scope=BASE)


# ------------------------------------- waiting for scope's revision-2 output
# Cases of revision 2 that need `cross_tenant_shared` in `scope --json` and
# `deployment.prefix_cache_scope` handling. Flip to True once scope has
# them (or set KVTRAIL_CONFORMANCE_REV2_SCOPE=1 to try them before).
REV2_SCOPE_OUTPUT = True


def s_shared_hit(reader):
    def build():
        s = Stream(1)
        s(1, "alloc", 4, 4); s(1, "write", 4, 4, 0)
        s(reader, "share", 4, 4, 0); s(reader, "read", 4, 4, 0)
        return s.events
    return build


def rev2_scope_cases():
    cts = {"2": {"tokens": 4, "sources": {"1": 4}}}
    sem("sem_cross_tenant_shared_listed_apart",
        "a shared read whose content owner belongs to another tenant is cross-tenant shared: "
        "listed apart (cross_tenant_shared, tokens per source request), no affected response",
        s_shared_hit(2), exit=0, affected={}, coverage_complete=True, cross_tenant_shared=cts)
    sem("sem_same_tenant_shared_not_listed",
        "a shared read of the same tenant's KV is no cross-tenant shared read",
        s_shared_hit(4), reqs=REQS3 + [req(4, "acme")], exit=0, affected={},
        coverage_complete=True, cross_tenant_shared={})
    sem("sem_shared_of_reloaded_kv_cross_tenant",
        "content loaded by the engine keeps its owner: a grant on it is cross-tenant shared "
        "when that owner is another tenant", lambda: s_both_ways(), pool_list=TIERED, exit=0,
        affected=foreign(2, {1: 4}), coverage_complete=True,
        cross_tenant_shared={"3": {"tokens": 4, "sources": {"1": 4}}})
    for scope_value, exp in [
        ("global", dict(exit=0, affected={}, cross_tenant_shared=cts, prefix_cache_breach=False)),
        # Whether the breach is also in affected_responses (with its own
        # reason) is the scope report's choice: not checked here.
        ("tenant", dict(exit=0, cross_tenant_shared=cts, prefix_cache_breach=True)),
    ]:
        case(f"sem_prefix_cache_scope_{scope_value}",
             f"prefix_cache_scope {scope_value}: "
             + ("cross-tenant shared reads are listed apart, no exposure" if scope_value == "global"
                else "each cross-tenant shared read is an isolation finding, named a prefix-cache "
                     "isolation breach and kept apart from foreign reads"),
             manifest(deployment_extra={"prefix_cache_scope": scope_value}), s_shared_hit(2)(),
             REQS3, verify=0, scope=exp)
    case("manifest_prefix_cache_scope_absent_is_global",
         "prefix_cache_scope is optional; absent means global", manifest(), s_shared_hit(2)(),
         REQS3, verify=0,
         scope=dict(exit=0, affected={}, cross_tenant_shared=cts, prefix_cache_breach=False))
    case("manifest_prefix_cache_scope_unknown_value",
         "prefix_cache_scope is global or tenant: any other value is an error naming the key",
         manifest(deployment_extra={"prefix_cache_scope": "per-user"}), base_events(), REQS3,
         verify=2, inspect=2, scope=dict(exit=2, stderr=["trace.json", "prefix_cache_scope"]))


if REV2_SCOPE_OUTPUT or os.environ.get("KVTRAIL_CONFORMANCE_REV2_SCOPE") == "1":
    rev2_scope_cases()

for c in CASES:
    finish(*c)
with open(os.path.join(OUT, "cases.json"), "w") as f:
    json.dump([c[0] for c in CASES], f, indent=1)
print(f"{len(CASES)} cases written to {OUT}")
