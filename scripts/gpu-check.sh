#!/usr/bin/env bash
# gpu-check.sh: the CUDA backend's check on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh                # builds with --features cuda (needs cargo)
#   scripts/gpu-check.sh --bin DIR      # uses DIR/kvtrail and DIR/bench_cuda built elsewhere
#
# 1. parity: simulated traces (every scenario, several seeds, one large
#    incident) and any trace under tests/data or traces/, replayed with
#    `kvtrail scope --backend cpu` and `--backend cuda`: --json output and
#    every --out file compared byte for byte;
# 2. throughput: examples/bench_cuda (cpu and cuda on the same events,
#    TOUCHES slot touches, default 1e9).
# Prints a short table; exit 0 when everything is identical, 1 on any
# difference, 2 when CUDA cannot run here.
#
# Environment: TOUCHES (bench size), LARGE_REQUESTS (large simulated trace,
# default 100000 requests, about 1.5e9 slot touches), KEEP=1 keeps the work
# directory, KVTRAIL_NVRTC=/path/to/libnvrtc.so.N when NVRTC is not on the
# loader's path, GPU_BACKEND=emu dry-runs the script without a GPU (the
# kernels emulated on the CPU; use small LARGE_REQUESTS and TOUCHES).
set -euo pipefail
gpu="${GPU_BACKEND:-cuda}"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ -z "$bin" ]; then
  echo "== build (release, --features cuda)"
  (cd "$here" && cargo build --release --features cuda --bin kvtrail --example bench_cuda)
  kv="$here/target/release/kvtrail"
  bench="$here/target/release/examples/bench_cuda"
else
  kv="$bin/kvtrail"
  bench="$bin/bench_cuda"
fi
for f in "$kv" "$bench"; do
  [ -x "$f" ] || { echo "gpu-check: $f is missing (build: cargo build --release --features cuda --bin kvtrail --example bench_cuda)" >&2; exit 2; }
done

echo "== device"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "(no nvidia-smi)"

work="$(mktemp -d "${TMPDIR:-/tmp}/kvtrail-gpu-check.XXXXXX")"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

# Does CUDA run at all? (exit 2 with the reason when it does not)
probe_trace="$work/probe"
"$kv" simulate --scenario steady --requests 20 --out "$probe_trace" >/dev/null 2>&1
if ! "$kv" scope "$probe_trace" --backend "$gpu" --json >/dev/null 2>"$work/probe.err"; then
  echo "gpu-check: the CUDA backend cannot run here:" >&2
  cat "$work/probe.err" >&2
  exit 2
fi
grep "replay backend" "$work/probe.err" || true

echo "== simulate"
traces=()
sim() { # name scenario requests seed
  local out="$work/traces/$1"
  "$kv" simulate --scenario "$2" --requests "$3" --seed "$4" --out "$out" >/dev/null
  traces+=("$out")
}
for s in incident steady sibling-inflight sibling-stale-copy; do
  for seed in 1 2 3; do sim "$s-$seed" "$s" 2000 "$seed"; done
done
sim "incident-large" incident "${LARGE_REQUESTS:-100000}" 7
for d in "$here"/tests/data/*/ "$here"/traces/*/; do
  [ -f "$d/trace.json" ] && traces+=("${d%/}")
done

echo "== parity (cpu vs $gpu)"
fail=0
printf '%-22s %10s %13s %9s %9s %9s  %s\n' trace kv_events slot_touches cpu_s "${gpu}_s" speedup result
for t in "${traces[@]}"; do
  name="$(basename "$t")"
  o="$work/out/$name"
  mkdir -p "$o"
  res=ok
  s0=$(date +%s.%N)
  "$kv" scope "$t" --backend cpu --json --out "$o/cpu" >"$o/cpu.json" 2>"$o/cpu.err" || res="cpu-exit-$?"
  s1=$(date +%s.%N)
  "$kv" scope "$t" --backend "$gpu" --json --out "$o/gpu" >"$o/gpu.json" 2>"$o/gpu.err" || res="$gpu-exit-$?"
  s2=$(date +%s.%N)
  if [ "$res" = ok ]; then
    cmp -s "$o/cpu.json" "$o/gpu.json" || res="JSON-DIFFERS"
    diff -r -q "$o/cpu" "$o/gpu" >/dev/null || res="${res/ok/}OUT-DIFFERS"
  fi
  [ "$res" = ok ] || fail=1
  count() { grep -o "\"$1\": *[0-9]*" "$o/cpu.json" | head -n 1 | grep -o '[0-9]*$' || echo "?"; }
  awk -v n="$name" -v e="$(count kv_events)" -v st="$(count slot_touches)" -v a="$s0" -v b="$s1" -v c="$s2" -v r="$res" \
    'BEGIN { printf "%-22s %10s %13s %9.2f %9.2f %8.1fx  %s\n", n, e, st, b-a, c-b, (b-a)/(c-b), r }'
done

echo "== throughput (${TOUCHES:-1e9} slot touches)"
"$bench" --touches "${TOUCHES:-1e9}" --backends "cpu,$gpu" || fail=1

if [ "$fail" = 0 ]; then
  echo "gpu-check: PASS ($gpu output identical to cpu on ${#traces[@]} traces)"
else
  echo "gpu-check: FAIL (see above; KEEP=1 keeps $work)"
  exit 1
fi
