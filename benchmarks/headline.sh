#!/usr/bin/env bash
# The headline routing comparison (issue 8): simulated at 8, 16 and 64 replicas, then live
# on 4 local tiny-random replicas per policy (one cluster per policy, all started at once;
# every workload replayed 3 times per policy, interleaved, pooled), then the report
# (tables + plots) in docs/bench.
#
#   bash benchmarks/headline.sh            # everything (about 7 min on 2 cores)
#   SKIP_LIVE=1 bash benchmarks/headline.sh  # simulation and report only (about a minute)
#   SIM_LIVE=1 bash benchmarks/headline.sh   # also live on 4 and 16 sim replicas per policy
#                                            # (benchmarks/sim_live.sh; sglang-router rows
#                                            # with PREFIXGATE_SGLANG_PYTHON set)
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

if [ -n "${SIM_LIVE:-}" ]; then
    # Live on simulated-engine replicas (`--model sim`, issue 18) at 4 and 16 replicas, with
    # sglang-router's cache_aware and round_robin as rows where PREFIXGATE_SGLANG_PYTHON
    # names a Python that has it (the whole run in a loopback-only network namespace).
    bash benchmarks/sim_live.sh "$OUT"
fi

inputs=("$OUT/simulate.json")
[ -f "$OUT/live.json" ] && inputs=("$OUT/live.json" "${inputs[@]}")
$BIN/prefixgate bench report "${inputs[@]}" --out-dir "$OUT"
