"""Runs `kvtrail sql` scripts on a real engine and prints their result views
as JSON, for tests/it/sql_engines.rs and bench/fleet.py.

Usage: run_sql.py duckdb|spark|trino-on-duckdb JOBS.json OUT.json
JOBS.json: [{"name": ..., "sql": <script path>, "trace": <dir>}, ...]. One
engine process serves every job (Spark starts once: local[2], 2 shuffle
partitions).

trino-on-duckdb: no Trino server runs here (it needs a newer Java and a
download outside the package registries), so the Trino script is parsed
with sqlglot's Trino grammar, every statement transpiled to DuckDB, and run
against DuckDB views standing in for the Trino tables: the script must be
written as `--trace-path src.trace`, and the job's "trace" folder provides
`src.trace.kv` and `src.trace.requests` (or the job's "catalog" and
"schema" names, any characters). This checks the Trino script's
syntax (as sqlglot reads Trino) and its semantics (as sqlglot maps each
function), not a Trino planner.
OUT.json: {name: {view: [row, ...], "_secs": float}}; rows are dicts of
JSON scalars, sorted, so the caller compares them as sets.
"""
import decimal
import json
import os
import sys
import time

VIEWS = [
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
]


def statements(script):
    out = []
    for st in script.split(";\n"):
        body = "\n".join(l for l in st.splitlines() if not l.lstrip().startswith("--"))
        if body.strip():
            out.append(body)
    return out


def ident(name):
    """A double-quoted identifier (the job's catalog and schema names may
    hold any character: the Trino script quotes them too)."""
    return '"' + name.replace('"', '""') + '"'


def scalar(v):
    if isinstance(v, decimal.Decimal):
        return int(v)
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    return v


def duckdb_views(con):
    """Every result view of a DuckDB connection, rows sorted."""
    res = {}
    for v in VIEWS:
        cur = con.execute(f"SELECT * FROM {v}")
        cols = [c[0] for c in cur.description]
        res[v] = sorted(
            (dict(zip(cols, map(scalar, r))) for r in cur.fetchall()),
            key=lambda d: json.dumps(d, sort_keys=True),
        )
    return res


def main():
    engine, jobs_path, out_path = sys.argv[1:4]
    jobs = json.load(open(jobs_path))
    results = {}
    if engine == "duckdb":
        import duckdb

        for job in jobs:
            con = duckdb.connect()
            con.execute("SET threads TO 2")
            t = time.time()
            for st in statements(open(job["sql"]).read()):
                con.execute(st)
            res = duckdb_views(con)
            res["_secs"] = time.time() - t
            results[job["name"]] = res
            con.close()
    elif engine == "trino-on-duckdb":
        import duckdb
        import sqlglot

        for job in jobs:
            con = duckdb.connect()
            con.execute("SET threads TO 2")
            cat = ident(job.get("catalog", "src"))
            sch = f'{cat}.{ident(job.get("schema", "trace"))}'
            con.execute(f"ATTACH ':memory:' AS {cat}")
            con.execute(f"CREATE SCHEMA {sch}")
            for table in ("kv", "requests"):
                path = job["trace"].replace("'", "''")
                con.execute(
                    f"CREATE VIEW {sch}.{table} AS SELECT * FROM read_parquet("
                    f"'{path}/{table}/**/*.parquet', union_by_name = true, hive_partitioning = false)"
                )
            con.execute("USE memory")
            t = time.time()
            for st in statements(open(job["sql"]).read()):
                for duck in sqlglot.transpile(st, read="trino", write="duckdb"):
                    try:
                        con.execute(duck)
                    except Exception as e:
                        sys.exit(f"{job['name']}: {e}\n-- Trino:\n{st}\n-- as DuckDB:\n{duck}")
            res = duckdb_views(con)
            res["_secs"] = time.time() - t
            results[job["name"]] = res
            con.close()
    elif engine == "spark":
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("kvtrail-sql-check")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.memory", "2g")
            # The script's scratch folder defaults to one under the
            # warehouse: keep it beside OUT.json, out of the caller's cwd.
            .config("spark.sql.warehouse.dir", os.path.join(os.path.dirname(os.path.abspath(out_path)), "spark-warehouse"))
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        for job in jobs:
            t = time.time()
            for st in statements(open(job["sql"]).read()):
                spark.sql(st)
            res = {}
            for v in VIEWS:
                rows = spark.sql(f"SELECT * FROM {v}").collect()
                res[v] = sorted(
                    ({k: scalar(x) for k, x in r.asDict().items()} for r in rows),
                    key=lambda d: json.dumps(d, sort_keys=True),
                )
            res["_secs"] = time.time() - t
            results[job["name"]] = res
        spark.stop()
    else:
        sys.exit(f"unknown engine {engine}")
    json.dump(results, open(out_path, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
