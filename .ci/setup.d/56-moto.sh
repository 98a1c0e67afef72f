#!/usr/bin/env bash
# Set-up for tests/it/object_store.rs: a cached virtualenv with moto in
# server mode (an S3-compatible server the tests start on 127.0.0.1 at a
# free port) and boto3 (which moto brings) to upload the test traces.
# Pinned.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}/venv-moto, and is reused when its
# versioned marker exists. The tests find it at the same path (or
# KVTRAIL_MOTO_VENV).
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_MOTO_VENV:-$CACHE/venv-moto}"
PY="${KVTRAIL_PYTHON:-python3.11}"
MOTO="5.1.22"

MARK="$VENV/.kvtrail-ready-moto-$MOTO"
if [ -f "$MARK" ]; then
  echo "56-moto: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$CACHE"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "moto[server]==$MOTO"
"$VENV/bin/python" -c "import moto.server, boto3, werkzeug"
touch "$MARK"
echo "56-moto: venv built in $(( $(date +%s) - start )) s at $VENV"
