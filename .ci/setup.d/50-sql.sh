#!/usr/bin/env bash
# Set-up for tests/it/sql_engines.rs and bench/fleet.py: a cached virtualenv with
# the SQL engines the `kvtrail sql` dialects are checked on: the duckdb
# Python package, pyspark (local mode on the machine's Java 17), and sqlglot
# (its Trino grammar reads the Trino dialect, transpiled to DuckDB), pinned.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-sql, and is reused when its
# versioned marker exists. The tests find it at the same path (or
# KVTRAIL_SQL_VENV).
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_SQL_VENV:-$CACHE/venv-sql}"
PY="${KVTRAIL_PYTHON:-python3.11}"
DUCKDB="1.5.6"
PYSPARK="4.0.1"
SQLGLOT="30.30.0"

MARK="$VENV/.kvtrail-ready-duckdb-$DUCKDB-pyspark-$PYSPARK-sqlglot-$SQLGLOT"
if [ -f "$MARK" ]; then
  echo "50-sql: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$CACHE"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "duckdb==$DUCKDB" "pyspark==$PYSPARK" "sqlglot==$SQLGLOT"
touch "$MARK"
echo "50-sql: venv built in $(( $(date +%s) - start )) s at $VENV"
