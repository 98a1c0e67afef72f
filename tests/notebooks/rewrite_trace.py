"""Rewrites a kvtrail trace the way another program would write format v1,
for tests/it/notebooks.rs: the notebooks must read any v1 trace, not only the
Recorder's.

    python rewrite_trace.py SRC DST

What changes (all allowed by the contract): pyarrow as the writer; many
part files per table at arbitrary row splits, in nested Hive-style folders
(kv/pool=N/part=K/, requests/day=.../); gzip, snappy, zstd and uncompressed
files; tiny row groups; 64-bit integer columns; dictionary-encoded strings;
extra columns; nullable columns absent (external_id and finish_reason from
every requests file, the copy columns from the prefill pool's files, and
token_pos from some kv files of the first pool); the decode pool's `pool`
column only in its kv/pool=N/ folder name; a `_SUCCESS` marker file;
a manifest without a `files` list (so nothing can be verified), with an
unknown key and another writer name.
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

CODECS = ["gzip", "snappy", "none", "zstd"]


def read_all(d: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted(d.rglob("*.parquet"))])


def widen(t: pa.Table) -> pa.Table:
    cols = []
    for f, c in zip(t.schema, t.columns):
        if pa.types.is_integer(f.type):
            c = c.cast(pa.int64())
        elif pa.types.is_string(f.type) and f.name in ("tenant", "op"):
            c = pc.dictionary_encode(c)
        cols.append(c)
    return pa.table(cols, names=t.column_names)


def write_parts(t: pa.Table, folder: Path, parts: int, drop_in_first: list[str] = ()) -> None:
    n = t.num_rows
    cuts = [0] + [n * (k + 1) // parts + (7 * k) % 13 for k in range(parts - 1)] + [n]
    cuts = sorted(min(max(c, 0), n) for c in cuts)
    for k in range(parts):
        part = t.slice(cuts[k], cuts[k + 1] - cuts[k])
        if k == 0:
            part = part.drop_columns([c for c in drop_in_first if c in part.column_names])
        d = folder / f"part={k}"
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, d / f"chunk-{k:03d}.parquet", compression=CODECS[k % len(CODECS)],
                       row_group_size=3000, use_dictionary=True)


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    m = json.loads((src / "trace.json").read_text())
    m.pop("files", None)
    m["capture"]["writer"] = "pyarrow rewrite (tests/notebooks)"
    m["x_converter"] = {"note": "unknown keys are ignored by readers"}
    dst.mkdir(parents=True)
    (dst / "trace.json").write_text(json.dumps(m, indent=1))

    req = read_all(src / "requests").drop_columns(["external_id", "finish_reason"])
    req = widen(req).append_column("region", pa.array(["eu-west"] * req.num_rows))
    # Newest first: row order across and within files is not guaranteed.
    req = req.take(pa.array(range(req.num_rows - 1, -1, -1)))
    write_parts(req, dst / "requests" / "day=2026-09-01", 3)

    kv = read_all(src / "kv")
    for p in m["deployment"]["pools"]:
        t = kv.filter(pc.equal(kv["pool"], p["id"]))
        if p["role"] == "prefill":
            t = t.drop_columns(["src_pool", "src_slot_start", "src_seq"])
        t = widen(t).append_column("layer", pa.array([7] * t.num_rows, pa.int32()))
        if p["role"] == "decode":
            # The partition key only in the folder name (pyarrow write_dataset).
            t = t.drop_columns(["pool"])
        # The first pool's first part also lacks token_pos (nullable: it reads as NULL).
        write_parts(t, dst / "kv" / f"pool={p['id']}", 4, ["token_pos"] if p["id"] == 0 else [])
    (dst / "kv" / "_SUCCESS").write_text("")


if __name__ == "__main__":
    main()
