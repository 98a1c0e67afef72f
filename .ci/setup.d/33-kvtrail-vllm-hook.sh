#!/usr/bin/env bash
# Set-up for tests/it/record_vllm.rs: the kvtrail vLLM hook's runtime
# dependencies (blake3, numpy) in the vLLM CPU venv that 32-vllm.sh builds
# (same path, never a second venv), and a check that the hook package and
# the wire client it depends on (hooks/client) pip-install (into target/,
# not into the venv, so branches with different hook versions never step on
# each other).
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_VLLM_VENV:-$CACHE/venv-vllm-0.33.0}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "33-kvtrail-vllm-hook: no venv at $VENV (32-vllm.sh builds it)" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import blake3, numpy" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --no-cache-dir "blake3>=0.3" numpy
fi
# pip-installability of hooks/client + hooks/vllm (no build isolation:
# offline-safe).
rm -rf target/kvtrail-vllm-hook
"$VENV/bin/pip" install --quiet --no-deps --no-build-isolation \
  --target target/kvtrail-vllm-hook hooks/client hooks/vllm
test -f target/kvtrail-vllm-hook/kvtrail_hook_client/__init__.py
test -f target/kvtrail-vllm-hook/kvtrail_vllm/__init__.py
test -f target/kvtrail-vllm-hook/kvtrail_vllm.pth
echo "33-kvtrail-vllm-hook: blake3 in $VENV; hook installs (target/kvtrail-vllm-hook)"
