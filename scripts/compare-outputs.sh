#!/usr/bin/env bash
# Run every kvtrail command on the standard inputs with two binaries and
# compare their outputs byte for byte: the check for a change meant to keep
# behaviour identical (a restructuring). Prints one DIFF line per output that
# differs and exits 1 if any does.
#
#   scripts/compare-outputs.sh BEFORE_BINARY AFTER_BINARY [WORK_DIR]
#
# Inputs: traces/incident-mini, the JSON-lines incident
# (tests/data/jsonl), and simulated incidents of both engine models (sglang
# incident, decode radix cache, HiCache, sibling bugs, vLLM stale reference,
# lease expiry, out-of-range blocks). Outputs compared: stdout, stderr, the
# exit code, and every file each command writes.
set -u
work=${3:-$(mktemp -d)}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work/bin-before" "$work/bin-after"
# Both under one name: outputs quote the program's name (evidence.json).
cp "$1" "$work/bin-before/kvtrail"; cp "$2" "$work/bin-after/kvtrail"
before=$work/bin-before/kvtrail; after=$work/bin-after/kvtrail
fail=0

# run NAME ARGS...: runs both binaries in their own folder (b/ and a/) with
# the same relative arguments; @IN@ is the shared input folder.
run() {
    local name=$1; shift
    for side in b a; do
        local bin=$before; [ $side = a ] && bin=$after
        local d="$work/$side"; mkdir -p "$d"
        local args=()
        for x in "$@"; do args+=("${x//@IN@/$work/in}"); done
        (cd "$d" && "$bin" "${args[@]}" >"$d/$name.stdout" 2>"$d/$name.stderr"; echo $? >"$d/$name.rc")
        # Paths of the side's own folder print the same on both sides.
        # Paths of the side's own folder print the same on both sides, and
        # wall-clock figures (seconds, rates) are not outputs.
        sed -i -E -e "s#$d#@OUT@#g" -e 's#[^ ]*/traces/incident-mini#@REPO@/traces/incident-mini#g' -e 's/[0-9]+\.[0-9]+ ?s\b/T s/g' \
            -e 's/[0-9]+ requests\/s/R requests\/s/g' "$d/$name.stdout" "$d/$name.stderr"
    done
}

in="$work/in"; rm -rf "$in" "$work/a" "$work/b"; mkdir -p "$in"
cp -r "$repo/traces/incident-mini" "$in/mini"
"$before" ingest "$repo/tests/data/jsonl/incident.jsonl" \
    --deployment "$repo/tests/data/jsonl/deploy.json" --out "$in/jsonl" >/dev/null
sims=(
  "incident --requests 400"
  "incident --requests 300 --set decode_radix_cache=true"
  "incident --requests 300 --set decode_radix_cache=true --set hicache=true --set hicache_host_tokens=4096"
  "sibling-inflight --requests 200"
  "sibling-stale-copy --requests 200"
  "steady --requests 200"
  "vllm-stale-reference --requests 200"
  "vllm-lease-expiry --requests 200"
  "vllm-steady --requests 200 --set bug_out_of_range_ppm=20000"
)
traces=(mini jsonl)
i=0
for s in "${sims[@]}"; do
    i=$((i+1))
    # shellcheck disable=SC2086
    run "sim$i" simulate --scenario $s --out sim$i --truth sim$i.truth.json
    "$before" simulate --scenario $s --out "$in/sim$i" >/dev/null 2>&1 || true
    traces+=("sim$i")
done

for t in "${traces[@]}"; do
    run "$t.verify" verify @IN@/$t --json
    run "$t.inspect" inspect @IN@/$t --json
    run "$t.inspect-text" inspect @IN@/$t
    run "$t.audit" audit @IN@/$t --json
    run "$t.scope" scope @IN@/$t --out scope-$t
    run "$t.scope-json" scope @IN@/$t --json --threads 1
    run "$t.scope-pools0" scope @IN@/$t --pools 0 --out shard0-$t
    run "$t.scope-pools1" scope @IN@/$t --pools 1 --out shard1-$t
    run "$t.scope-pools2" scope @IN@/$t --pools 2 --out shard2-$t
    run "$t.merge" merge --out merged-$t shard0-$t shard1-$t
    run "$t.merge3" merge --out merged3-$t shard0-$t shard1-$t shard2-$t
    run "$t.verify-scope" verify scope-$t --json
    run "$t.export-ocsf" export --format ocsf scope-$t --out ocsf-$t.jsonl
    run "$t.export-ts" export --format timesketch scope-$t --out ts-$t.jsonl
    run "$t.notify" notify scope-$t --out notify-$t
    run "$t.notify-de" notify scope-$t --out notify-de-$t --lang de
    run "$t.lookup-t" lookup scope-$t --tenant globex --json
    run "$t.lookup-x" lookup scope-$t --external-id r2 --json
    run "$t.counterfactual" counterfactual @IN@/$t --json
    run "$t.replay" replay @IN@/$t --out replay-$t --set allow_auto_truncate=false --compare --json
    for d in duckdb spark; do
        run "$t.sql-$d" sql --dialect $d --trace-path @IN@/$t --manifest @IN@/$t/trace.json
    done
    run "$t.sql-trino" sql --dialect trino --trace-path hive.kvtrail --manifest @IN@/$t/trace.json
done
run demo demo

for f in $(cd "$work/b" && find . -type f | sort); do
    if [ ! -f "$work/a/$f" ]; then echo "DIFF missing in after: $f"; fail=1; continue; fi
    if ! cmp -s "$work/b/$f" "$work/a/$f"; then echo "DIFF $f"; fail=1; fi
done
for f in $(cd "$work/a" && find . -type f | sort); do
    [ -f "$work/b/$f" ] || { echo "DIFF only in after: $f"; fail=1; }
done
n=$(cd "$work/b" && find . -type f | wc -l)
echo "compared $n files in $work: $([ $fail = 0 ] && echo identical || echo DIFFERENT)"
exit $fail
