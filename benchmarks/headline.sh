#!/usr/bin/env bash
# The headline routing comparison (issue 8): simulated at 8, 16 and 64 replicas, then live
# on 4 local tiny-random replicas per policy (one cluster per policy, all started at once;
# every workload replayed 3 times per policy, interleaved, pooled), then the report
# (tables + plots) in docs/bench.
#
#   bash benchmarks/headline.sh            # everything (about 7 min on 2 cores)
#   SKIP_LIVE=1 bash benchmarks/headline.sh  # simulation and report only (about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=${OUT:-docs/bench}
mkdir -p "$OUT"

# Simulated comparison: the same workloads, 8/16/64 replicas, and a cache-capacity sweep.
$BIN/prefixgate bench simulate --kinds agents,multi_turn_chat --replicas 8,16,64 \
    --policies cache_aware,round_robin,consistent_hash,least_loaded \
    --out "$OUT/simulate.json"

if [ -z "${SKIP_LIVE:-}" ]; then
    # Live: a `prefixgate up` cluster per policy, its caches reset (POST /reset_prefix_cache)
    # before each replay; each replica's KV cache holds about a third of the workload's
    # distinct prefix blocks.
    $BIN/prefixgate bench live --replicas 4 --model tiny-random \
        --policies cache_aware,round_robin,consistent_hash,least_loaded \
        --workloads agents,multi_turn_chat --repeats 3 --out-dir "$OUT" --no-report
fi

inputs=("$OUT/simulate.json")
[ -f "$OUT/live.json" ] && inputs=("$OUT/live.json" "${inputs[@]}")
$BIN/prefixgate bench report "${inputs[@]}" --out-dir "$OUT"
