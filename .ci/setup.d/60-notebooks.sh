#!/usr/bin/env bash
# Set-up for tests/it/notebooks.rs and for opening notebooks/: a cached
# virtualenv with the packages of notebooks/requirements.txt (DuckDB,
# pyarrow, pandas, matplotlib, and ipykernel + nbclient to run the notebooks
# headless in the venv's own kernel), every version pinned. Nothing is
# registered globally: no kernelspec is installed outside the venv.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-notebooks (or
# KVTRAIL_NOTEBOOK_VENV), and is reused while its marker, keyed on a digest
# of requirements.txt and the Python version, exists; a changed
# requirements file rebuilds it. The tests find it at the same path.
#
# KVTRAIL_NOTEBOOK_UI=1 also installs notebooks/requirements-ui.txt (the
# Jupyter Notebook UI, pinned) into the venv, with its own marker. CI does
# not need it.
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_NOTEBOOK_VENV:-$CACHE/venv-notebooks}"
PY="${KVTRAIL_PYTHON:-python3.11}"
REQ="notebooks/requirements.txt"
UI_REQ="notebooks/requirements-ui.txt"

command -v "$PY" >/dev/null || { echo "60-notebooks: $PY not found (set KVTRAIL_PYTHON)" >&2; exit 1; }
# Marker key: a digest of the file plus the interpreter's version.
key() {
  "$PY" - "$1" <<'PYEOF'
import hashlib, sys
data = open(sys.argv[1], "rb").read()
print(hashlib.blake2b(data, digest_size=8).hexdigest() + "-py%d.%d" % sys.version_info[:2])
PYEOF
}

MARK="$VENV/.kvtrail-ready-$(key "$REQ")"
if [ -f "$MARK" ]; then
  echo "60-notebooks: cached venv ready at $VENV"
else
  start=$(date +%s)
  mkdir -p "$(dirname "$VENV")"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet -r "$REQ"
  # The kernel is this venv's python: check that the imports work there.
  "$VENV/bin/python" -c "import duckdb, pyarrow, pandas, matplotlib, nbclient, nbformat, ipykernel"
  touch "$MARK"
  echo "60-notebooks: venv built in $(( $(date +%s) - start )) s at $VENV"
fi

if [ "${KVTRAIL_NOTEBOOK_UI:-0}" = 1 ]; then
  UI_MARK="$VENV/.kvtrail-ui-ready-$(key "$UI_REQ")"
  if [ ! -f "$UI_MARK" ]; then
    "$VENV/bin/pip" install --quiet -r "$UI_REQ" -c "$REQ"
    touch "$UI_MARK"
  fi
  echo "60-notebooks: UI ready: $VENV/bin/jupyter notebook notebooks/"
fi
