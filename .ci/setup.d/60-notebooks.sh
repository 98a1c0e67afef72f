#!/usr/bin/env bash
# Set-up for tests/notebooks.rs and for opening notebooks/: a cached
# virtualenv with the packages of notebooks/requirements.txt (DuckDB,
# pyarrow, pandas, matplotlib, and ipykernel + nbclient to run the notebooks
# headless in the venv's own kernel). Nothing is registered globally: no
# kernelspec is installed outside the venv.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-notebooks (or
# KVTRAIL_NOTEBOOK_VENV), and is reused while its marker, keyed on the
# blake2 digest of requirements.txt and the Python version, exists. A changed
# requirements file rebuilds it. The tests find it at the same path.
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_NOTEBOOK_VENV:-$CACHE/venv-notebooks}"
PY="${KVTRAIL_PYTHON:-python3.11}"
REQ="notebooks/requirements.txt"

command -v "$PY" >/dev/null || { echo "60-notebooks: $PY not found (set KVTRAIL_PYTHON)" >&2; exit 1; }
key=$("$PY" - "$REQ" <<'PYEOF'
import hashlib, sys
data = open(sys.argv[1], "rb").read()
print(hashlib.blake2b(data, digest_size=8).hexdigest() + "-py" + "%d.%d" % sys.version_info[:2])
PYEOF
)
MARK="$VENV/.kvtrail-ready-$key"
if [ -f "$MARK" ]; then
  echo "60-notebooks: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet -r "$REQ"
# The kernel must be this venv's python: check that the imports work there.
"$VENV/bin/python" -c "import duckdb, pyarrow, pandas, matplotlib, nbclient, nbformat, ipykernel"
touch "$MARK"
echo "60-notebooks: venv built in $(( $(date +%s) - start )) s at $VENV"
