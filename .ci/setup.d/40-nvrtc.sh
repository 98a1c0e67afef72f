#!/usr/bin/env bash
# Set-up for tests/it/cuda_nvrtc.rs: NVRTC of CUDA 13 (the PyPI wheel
# nvidia-cuda-nvrtc ships libnvrtc.so.13; no GPU, driver or toolkit needed)
# in a cached virtualenv, so the test suite compiles every kernel of
# kernels/*.cu with the real NVRTC through kvtrail's own loader.
#
# Idempotent: the venv lives under ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}
# and is reused when its marker exists. The test finds the library there
# (or at $KVTRAIL_NVRTC).
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="$CACHE/venv-nvrtc"
MARK="$VENV/.kvtrail-ready"
PY="${KVTRAIL_PYTHON:-python3}"

if [ -f "$MARK" ]; then
  echo "40-nvrtc: cached NVRTC ready at $VENV"
  exit 0
fi
mkdir -p "$CACHE"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "nvidia-cuda-nvrtc==13.*"
lib=$(find "$VENV" -name 'libnvrtc.so.13*' | head -n 1)
if [ -z "$lib" ]; then
  echo "40-nvrtc: the wheel has no libnvrtc.so.13" >&2
  exit 1
fi
echo "$lib" > "$MARK"
echo "40-nvrtc: NVRTC at $lib"
