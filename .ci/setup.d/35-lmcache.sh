#!/usr/bin/env bash
# Set-up for the LMCache tests of tests/it/record_vllm.rs: the real
# `lmcache` package (0.5.6: its lmcache.integration.vllm.vllm_v1_adapter is
# what vLLM 0.33.0's LMCacheConnectorV1 imports) for the vLLM CPU venv of
# 32-vllm.sh, installed NEXT to that venv, never into it.
#
# lmcache's own dependency list pins numpy<=2.2.6, prometheus_client<=0.24.1
# and opentelemetry-api<=1.40.0 (the venv pins 2.4.6, 0.26.0, 1.45.2) and
# pulls cupy-cuda13x, cuda-python and grpc: resolved into the venv it would
# replace vLLM's pinned modules. So
# it is installed with --no-deps into a target folder of its own, with only
# the modules its import path needs that the venv lacks (found by importing
# lmcache.integration.vllm.vllm_v1_adapter with the venv's python until no
# import failed). The driver appends the folder to sys.path, after the
# venv's site-packages: the venv's torch, numpy and vLLM pins always win.
# lmcache's native modules (lmcache_native, built against libtorch) load
# with the venv's torch 2.14; its CUDA kernels (lmcache.cuda_ops) are never
# imported on a CPU-only host (see tests/vllm/lmcache_driver.py).
#
# Idempotent: the folder lives under ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}
# (or KVTRAIL_LMCACHE_DIR) and is reused when its versioned marker exists.
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_VLLM_VENV:-$CACHE/venv-vllm-0.33.0}"
DIR="${KVTRAIL_LMCACHE_DIR:-$CACHE/lmcache-0.5.6}"

# The marker is versioned: bump it when the package list changes.
MARK="$DIR/.kvtrail-ready-v1"
if [ -f "$MARK" ]; then
  echo "35-lmcache: cached lmcache ready at $DIR"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "35-lmcache: no vLLM venv at $VENV (32-vllm.sh builds it)" >&2
  exit 1
fi

start=$(date +%s)
rm -rf "$DIR"
mkdir -p "$DIR"
"$VENV/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check --no-deps \
  --target "$DIR" \
  lmcache==0.5.6 \
  aiofile==3.12.3 caio==0.12.10 cffi==2.1.1 cryptography==51.0.1 llvmlite==0.50.0 \
  numba==0.68.1 pycparser==3.12 sortedcontainers==2.4.0 uvicorn==0.55.0
# The import path the driver takes, with the venv's own modules first.
(cd "$DIR/.." && PYTHONPATH="" "$VENV/bin/python" -W ignore -c "
import sys; sys.path.append('$DIR')
import torch, vllm, numpy
import lmcache.integration.vllm.vllm_v1_adapter, lmcache.lmcache_native
assert torch.__file__.startswith('$VENV'), torch.__file__
assert numpy.__file__.startswith('$VENV'), numpy.__file__
assert 'lmcache.cuda_ops' not in sys.modules
" >/dev/null 2>&1) || {
  echo "35-lmcache: lmcache does not import next to $VENV" >&2
  exit 1
}
touch "$MARK"
echo "35-lmcache: lmcache 0.5.6 in $(( $(date +%s) - start )) s at $DIR ($(du -sh "$DIR" | cut -f1))"
