"""Read any kvtrail trace (format v1) with DuckDB, straight from its Parquet
files, with no kvtrail code: the notebooks' shared loader.

It follows the trace contract in docs/trace-format.md:

- a trace is a folder with trace.json (the manifest), requests/ and kv/;
- requests/ and kv/ hold any number of *.parquet files at any depth
  (Hive-style key=value/ folders; a contract column missing from the files
  is taken from a folder of that name, as `kvtrail` does); files may be
  split at any row and come in any order;
- any compression, plain or dictionary strings, other integer widths, extra
  columns (ignored: only the contract's columns are selected, cast to the
  contract's types); nullable columns may be absent from some or all files
  (they read as NULL);
- an unknown `version` is an error; unknown manifest keys are ignored.

`open_trace(dir)` returns a `V1Trace` with a DuckDB connection holding two
views, `requests` and `kv`, with exactly the contract's columns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

# The contract's columns, in the spec's order, with their DuckDB types.
REQUESTS_COLUMNS = [
    ("request_id", "UBIGINT", False),
    ("external_id", "VARCHAR", True),
    ("tenant", "VARCHAR", False),
    ("arrival_ns", "BIGINT", False),
    ("finish_ns", "BIGINT", True),
    ("prompt_tokens", "UINTEGER", False),
    ("prefilled_tokens", "UINTEGER", True),
    ("output_tokens", "UINTEGER", False),
    ("http_status", "USMALLINT", False),
    ("finish_reason", "VARCHAR", True),
    ("prefill_pool", "USMALLINT", True),
    ("decode_pool", "USMALLINT", True),
    ("prompt_hash", "BLOB", True),
    ("output_hash", "BLOB", True),
]
KV_COLUMNS = [
    ("pool", "USMALLINT", False),
    ("seq", "UBIGINT", False),
    ("ts_ns", "BIGINT", False),
    ("request_id", "UBIGINT", False),
    ("op", "VARCHAR", False),
    ("slot_start", "UINTEGER", False),
    ("slot_count", "UINTEGER", False),
    ("token_pos", "UINTEGER", True),
    ("src_pool", "USMALLINT", True),
    ("src_slot_start", "UINTEGER", True),
    ("src_seq", "UBIGINT", True),
]
OPS = ("alloc", "write", "read", "free", "share", "scrub")


# Pool roles (revision 2 adds `cache`: a tier that only holds copies, which the
# engine, request 0, moves KV in and out of).
ROLES = ("prefill", "decode", "mixed", "cache")


class TraceError(Exception):
    """The folder is not a readable v1 trace; the message says what to do."""


@dataclass
class V1Trace:
    dir: Path
    manifest: dict
    con: duckdb.DuckDBPyConnection
    request_files: list[Path] = field(default_factory=list)
    kv_files: list[Path] = field(default_factory=list)

    @property
    def deployment(self) -> dict:
        return self.manifest["deployment"]

    @property
    def capture(self) -> dict:
        return self.manifest.get("capture", {})

    @property
    def pools(self) -> list[dict]:
        return sorted(self.deployment["pools"], key=lambda p: p["id"])

    @property
    def pools_by_id(self) -> dict[int, dict]:
        return {p["id"]: p for p in self.pools}

    def pool_ids(self, role: str) -> list[int]:
        """Ids of the pools of one role (one of ROLES)."""
        return [p["id"] for p in self.pools if p["role"] == role]

    @property
    def prefix_cache_scope(self) -> str:
        """`global` (the default) or `tenant` (revision 2)."""
        return self.deployment.get("prefix_cache_scope") or "global"

    def df(self, sql: str, params=None):
        """Runs a query on this trace's connection; returns a pandas frame."""
        return self.con.execute(sql, params or []).df()

    def rel(self, rel_path: Path | str) -> str:
        return Path(rel_path).resolve().relative_to(self.dir.resolve()).as_posix()


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _view(con, name: str, base: Path, files: list[Path], columns) -> None:
    """A view with exactly `columns` over `files` (union by column name).

    A contract column may live only in a Hive folder name (`kv/pool=3/...`,
    as pyarrow's write_dataset and DuckDB's PARTITION_BY write it): when a
    contract column is a folder key below `base`, DuckDB's Hive partitioning
    is on and supplies it (where a file also has the column, the values
    agree in a valid trace)."""
    if not files:
        cols = ", ".join(f"CAST(NULL AS {t}) AS {c}" for c, t, _ in columns)
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT {cols} WHERE false")
        return
    lst = "[" + ", ".join(_sql_str(str(f)) for f in files) + "]"
    keys = {
        part.split("=", 1)[0]
        for f in files
        for part in f.relative_to(base).parts[:-1]
        if "=" in part
    }
    hive = "true" if keys & {c for c, _, _ in columns} else "false"
    src = f"read_parquet({lst}, union_by_name = true, hive_partitioning = {hive})"
    present = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
    missing = [c for c, _, nullable in columns if c not in present and not nullable]
    if missing:
        raise TraceError(
            f"{name}/: required column(s) {', '.join(missing)} absent from every file "
            f"(trace format v1); the writer of this trace must add them"
        )
    sel = []
    for c, t, _ in columns:
        sel.append(f"CAST({c} AS {t}) AS {c}" if c in present else f"CAST(NULL AS {t}) AS {c}")
    con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT {', '.join(sel)} FROM {src}")


def open_trace(path: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> V1Trace:
    """Opens a v1 trace folder: parses trace.json, finds every data file and
    creates the `requests` and `kv` views on `con` (a new connection if
    None)."""
    d = Path(path).expanduser()
    mpath = d / "trace.json"
    if not mpath.is_file():
        raise TraceError(f"{mpath}: no trace.json; is {d} a kvtrail trace folder?")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{mpath}: not UTF-8 JSON ({e})") from e
    if manifest.get("format") != "kvtrail-trace":
        raise TraceError(f"{mpath}: format is {manifest.get('format')!r}, expected 'kvtrail-trace'")
    if manifest.get("version") != 1:
        raise TraceError(f"{mpath}: unknown version {manifest.get('version')!r}; this reader knows 1")
    dep = manifest.get("deployment") or {}
    for pool in dep.get("pools") or []:
        if pool.get("role") not in ROLES:
            raise TraceError(f"{mpath}: pool {pool.get('id')} has role {pool.get('role')!r}; roles are {', '.join(ROLES)}")
    if dep.get("prefix_cache_scope") not in (None, "global", "tenant"):
        raise TraceError(f"{mpath}: deployment.prefix_cache_scope is {dep['prefix_cache_scope']!r}; "
                         "it is global (the default) or tenant")
    con = con or duckdb.connect()
    req = sorted((d / "requests").rglob("*.parquet"))
    kv = sorted((d / "kv").rglob("*.parquet"))
    _view(con, "requests", d / "requests", req, REQUESTS_COLUMNS)
    _view(con, "kv", d / "kv", kv, KV_COLUMNS)
    return V1Trace(d, manifest, con, req, kv)


def prompt_limit(pool: dict, context_window: int) -> int:
    """SGLang's max_req_input_len for a pool: min(context_window - 1,
    capacity_tokens - 1) - 5, the limit `kvtrail scope` and `audit` use.
    Prompts at or above it do not fit the pool."""
    return max(min(context_window - 1, pool["capacity_tokens"] - 1) - 5, 0)
