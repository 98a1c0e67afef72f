#!/usr/bin/env bash
# Set-up for tests/it/record_sglang.rs: the kvtrail SGLang hook's one runtime
# dependency (the `blake3` PyPI package) in the shared SGLang CPU venv that
# 30-sglang.sh builds (same path, never a second venv), and a check that the
# hook package and the wire client it depends on (hooks/client) pip-install
# (into target/, not into the venv, so branches with different hook versions
# never step on each other).
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
VENV="${KVTRAIL_SGLANG_VENV:-$CACHE/venv-sglang-0.5.19}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "31-kvtrail-sglang-hook: no venv at $VENV (30-sglang.sh builds it)" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import blake3" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet "blake3>=0.3"
fi
# pip-installability of hooks/client + hooks/sglang (no build isolation:
# offline-safe).
rm -rf target/kvtrail-sglang-hook
"$VENV/bin/pip" install --quiet --no-deps --no-build-isolation \
  --target target/kvtrail-sglang-hook hooks/client hooks/sglang
test -f target/kvtrail-sglang-hook/kvtrail_hook_client/__init__.py
test -f target/kvtrail-sglang-hook/kvtrail_sglang/__init__.py
test -f target/kvtrail-sglang-hook/kvtrail_sglang.pth
echo "31-kvtrail-sglang-hook: blake3 in $VENV; hook installs (target/kvtrail-sglang-hook)"
