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
#   SIM_SCALED=1 bash benchmarks/headline.sh # also 16 and 64 sim replicas at 16 requests
#                                            # per replica (about 35 min)
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

if [ -n "${SIM_SCALED:-}" ]; then
    # 16 and 64 sim replicas at a user's load: the workloads scaled to 16 requests per
    # replica (2x and 8x the sessions), one concurrent session per replica, every policy
    # on one set of replicas (a gateway each), 2 repeats at 16 (18 min here), 1 at 64 (14 min).
    SIZES=16 SCALE=2 SHARED=1 CONCURRENCY=16 REPEATS=2 bash benchmarks/sim_live.sh "$OUT/sim-scaled"
    SIZES=64 SCALE=8 SHARED=1 CONCURRENCY=64 REPEATS=1 bash benchmarks/sim_live.sh "$OUT/sim-scaled"
    # 4 replicas: SIM_LIVE's run (SIM4 names another live.json, e.g. sglang-compare's)
    $BIN/python benchmarks/sim_scale_plot.py "${SIM4:-$OUT/sim-4/live.json}" \
        "$OUT/sim-scaled/sim-16/live.json" "$OUT/sim-scaled/sim-64/live.json" \
        --out "$OUT/sim-scale-64.png"
fi

inputs=("$OUT/simulate.json")
[ -f "$OUT/live.json" ] && inputs=("$OUT/live.json" "${inputs[@]}")
$BIN/prefixgate bench report "${inputs[@]}" --out-dir "$OUT"
