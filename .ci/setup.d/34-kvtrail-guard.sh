#!/usr/bin/env bash
# Set-up for tests/it/guard.rs: the guard's native module (hooks/native,
# kvtrail_guard: PyO3 + maturin) built once as an abi3 wheel, installed
# into target/kvtrail-guard-native (not into the venvs, as the hooks: see
# 31-/33-), and imported by both engine venvs' pythons (30-sglang.sh,
# 32-vllm.sh). maturin comes from PyPI into the SGLang venv.
#
# The build is the workspace member kvtrail-guard in the dev profile, in
# the same target dir as the tests: kvtrail and its dependencies are the
# ones the test build compiled already; what it adds is pyo3 and the
# module itself (docs/guard.md, "Building"). Idempotent: cargo rebuilds
# nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE="${KVTRAIL_CACHE:-$HOME/.cache/kvtrail}"
SGL="${KVTRAIL_SGLANG_VENV:-$CACHE/venv-sglang-0.5.19}"
VLL="${KVTRAIL_VLLM_VENV:-$CACHE/venv-vllm-0.33.0}"
if [ ! -x "$SGL/bin/python" ]; then
  echo "34-kvtrail-guard: no venv at $SGL (30-sglang.sh builds it)" >&2
  exit 1
fi
if ! "$SGL/bin/python" -m maturin --version >/dev/null 2>&1; then
  "$SGL/bin/pip" install --quiet "maturin>=1.5,<2"
fi
start=$(date +%s)
OUT=target/kvtrail-guard-wheel
rm -rf "$OUT"
"$SGL/bin/python" -m maturin build --quiet --profile dev -m hooks/native/Cargo.toml \
  -i "$SGL/bin/python" --out "$OUT"
rm -rf target/kvtrail-guard-native
"$SGL/bin/pip" install --quiet --no-deps --target target/kvtrail-guard-native "$OUT"/kvtrail_guard-*.whl
for py in "$SGL/bin/python" "$VLL/bin/python"; do
  [ -x "$py" ] || continue
  PYTHONPATH=target/kvtrail-guard-native "$py" -c "import kvtrail_guard; kvtrail_guard.Guard()"
done
echo "34-kvtrail-guard: kvtrail_guard built and installed in $(( $(date +%s) - start )) s (target/kvtrail-guard-native)"
