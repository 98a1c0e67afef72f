#!/usr/bin/env bash
# Set-up for tests/it/export.rs: a cached virtualenv with the independent
# checkers of kvtrail's exports (tests/export/validate.py):
# - ocsf-json-schema, which bundles the OCSF schema exports (1.8.0 among
#   them) and generates a JSON Schema per class and profile set offline,
#   checked with the jsonschema package;
# - timesketch's own JSONL reader (timesketch.lib.utils.read_and_validate_jsonl),
#   installed without its server dependencies plus the four packages that
#   module imports (Flask, pandas, PyYAML, python-dateutil).
# Every package is pinned, dependencies included, and installed with
# --no-deps, so the venv is the same on every machine.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-export (or
# KVTRAIL_EXPORT_VENV), and is reused while its versioned marker exists.
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_EXPORT_VENV:-$CACHE/venv-export}"
PY="${KVTRAIL_PYTHON:-python3.11}"
VERSION="1"
PKGS=(
  "ocsf-json-schema==1.2.0"
  "jsonschema==4.26.0"
  "jsonschema-specifications==2025.9.1"
  "referencing==0.37.0"
  "rpds-py==2026.9.1"
  "attrs==26.1.0"
  "typing_extensions==4.16.0"
  "timesketch==20261014"
  "Flask==3.1.3"
  "Werkzeug==3.1.9"
  "Jinja2==3.1.6"
  "MarkupSafe==3.0.4"
  "itsdangerous==2.2.0"
  "click==8.5.1"
  "blinker==1.9.0"
  "pandas==3.1.1"
  "numpy==2.4.6"
  "tzdata==2026.6"
  "PyYAML==6.0.4"
  "python-dateutil==4.0.0"
)

MARK="$VENV/.kvtrail-ready-v$VERSION-ocsf-json-schema-1.2.0-timesketch-20261014"
if [ -f "$MARK" ]; then
  echo "55-export-validators: cached venv ready at $VENV"
  exit 0
fi

command -v "$PY" >/dev/null || { echo "55-export-validators: $PY not found (set KVTRAIL_PYTHON)" >&2; exit 1; }
start=$(date +%s)
mkdir -p "$CACHE"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "${PKGS[@]}"
# The checkers must import, offline.
"$VENV/bin/python" - <<'PYEOF'
from ocsf_json_schema import OcsfJsonSchemaEmbedded, get_ocsf_schema
import jsonschema
from timesketch.lib.utils import read_and_validate_jsonl
OcsfJsonSchemaEmbedded(get_ocsf_schema(version="1.8.0")).get_class_schema(
    class_name="incident_finding", profiles=["incident"])
PYEOF
touch "$MARK"
echo "55-export-validators: venv built in $(( $(date +%s) - start )) s at $VENV ($(du -sh "$VENV" | cut -f1))"
