#!/usr/bin/env bash
# Set-up for tests/it/sim_sglang_fidelity.rs: a cached virtualenv with the real
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
# sglang 0.5.19-0.5.23 ship cp311 wheels; python3.11 preferred, any
# python3 >= 3.10 accepted.
PY="${KVTRAIL_PYTHON:-$(command -v python3.11 || command -v python3)}"

# The marker is versioned: bump it when the package list changes (v2 added
# einops, which sglang.srt.managers.utils imports).
MARK="$VENV/.kvtrail-ready-v2"

# HiCache's L3 storage path hashes pages with SGLang's C++ extension, which
# torch's JIT loader builds with ninja on first use (about 1.5 min on the
# shared 2-core machine; cached under ~/.cache/torch_extensions). Built
# here, so no test waits on it. Idempotent; also run on a cached venv.
hash_extension() {
  "$VENV/bin/python" -c "import ninja" 2>/dev/null || "$VENV/bin/pip" install --quiet ninja==1.13.2
  PATH="$VENV/bin:$PATH" "$VENV/bin/python" -W ignore -c \
    "from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash as h; h([1, 2], None, 1)"
}

if [ -f "$MARK" ]; then
  hash_extension
  echo "30-sglang: cached venv ready at $VENV"
  exit 0
fi

start=$(date +%s)
mkdir -p "$CACHE"
rm -rf "$VENV"
if ! "$PY" -m venv "$VENV"; then
  # Debian/Ubuntu ship venv separately.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt-get install -y "python$ver-venv" || apt-get install -y python3-venv
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
  else
    echo "30-sglang: '$PY -m venv' failed; install the venv module (python3-venv)" >&2
    exit 1
  fi
fi
"$VENV/bin/pip" install --quiet torch==2.13.0 torchvision==0.28.0 orjson psutil pybase64 requests \
  packaging pillow starlette tqdm IPython pydantic aiohttp msgspec pyzmq transformers==5.12.1 \
  tokenizers==0.22.2 dill compressed-tensors==0.18.0 gguf openai==2.6.1 \
  partial_json_parser xgrammar==0.2.1 sentencepiece numpy einops
"$VENV/bin/pip" install --quiet --no-deps sglang==0.5.19
"$VENV/bin/pip" install --quiet --no-deps --target "$VENV/sglang-$CURRENT" "sglang==$CURRENT"
hash_extension
echo "$CURRENT" > "$MARK"
echo "30-sglang: venv built in $(( $(date +%s) - start )) s at $VENV"
