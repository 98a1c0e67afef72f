#!/usr/bin/env bash
# Set-up for tests/sim_sglang_fidelity.rs: a cached virtualenv with the real
# `sglang` package (0.5.19 installed, a current release beside it via
# --target) on CPU: pinned torch (the CUDA build; it imports on CPU) and
# the minimum sglang dependencies, sglang itself with --no-deps. About 5 GB;
# built in ~2 min here with a warm pip cache. See docs/simulator.md.
#
# Idempotent: the venv lives outside the repository, under
# ${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}, and is reused when its marker file
# exists. The test finds it through the same path (or KVTRAIL_SGLANG_VENV).
set -euo pipefail

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="$CACHE/venv-sglang-0.5.19"
CURRENT="0.5.23"
PY="${KVTRAIL_PYTHON:-python3.11}"

# The marker is versioned: bump it when the package list changes (v2 added
# einops, which sglang.srt.managers.utils imports).
# (sglang.srt.managers.utils imports it).
MARK="$VENV/.kvtrail-ready-v2"
if [ -f "$MARK" ]; then
  echo "30-sglang: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$CACHE"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet torch==2.13.0 torchvision==0.28.0 orjson psutil pybase64 requests \
  packaging pillow starlette tqdm IPython pydantic aiohttp msgspec pyzmq transformers==5.12.1 \
  tokenizers==0.22.2 dill compressed-tensors==0.18.0 gguf openai==2.6.1 \
  partial_json_parser xgrammar==0.2.1 sentencepiece numpy einops
"$VENV/bin/pip" install --quiet --no-deps sglang==0.5.19
"$VENV/bin/pip" install --quiet --no-deps --target "$VENV/sglang-$CURRENT" "sglang==$CURRENT"
echo "$CURRENT" > "$MARK"
echo "30-sglang: venv built in $(( $(date +%s) - start )) s at $VENV"
