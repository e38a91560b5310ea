#!/usr/bin/env bash
# The headline routing comparison (issue 8): simulated at 8, 16 and 64 replicas, then live
# on 4 local tiny-random replicas per policy (one cluster per policy, all started at once;
# every workload replayed 3 times per policy, interleaved, pooled), then the report
# (tables + plots) in docs/bench.
#
#   bash benchmarks/headline.sh            # everything (about 7 min on 2 cores)
#   SKIP_LIVE=1 bash benchmarks/headline.sh  # simulation and report only (about a minute)
#   SIM_LIVE=1 bash benchmarks/headline.sh   # also live on 4 and 16 sim replicas per policy
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
    # Live on simulated-engine replicas (`--model sim`, issue 18), one GPU each in effect:
    # the A100 profile with every cost constant x10, so that device time outweighs this
    # machine's HTTP and tokenizing time (docs/BENCHMARKS.md, "Simulated engine").
    eval "$($BIN/python - <<'PY'
from prefixgate.envflags import env_var
from replica.sim.profile import COST_FIELDS
from replica.sim.profiles import load_profile

profile = load_profile("llama3.1-8b-a100")
print(f"export {env_var('sim-profile')}={profile.name}")
for name in COST_FIELDS:
    print(f"export {env_var('sim-' + name.replace('_', '-'))}={getattr(profile, name) * 10!r}")
PY
)"
    for n in 4 16; do
        $BIN/prefixgate bench live --replicas "$n" --model sim --concurrency $((n < 8 ? 8 : n)) \
            --policies cache_aware,round_robin,consistent_hash,least_loaded \
            --workloads agents,multi_turn_chat --repeats 2 --out-dir "$OUT/sim-$n"
    done
fi

inputs=("$OUT/simulate.json")
[ -f "$OUT/live.json" ] && inputs=("$OUT/live.json" "${inputs[@]}")
$BIN/prefixgate bench report "${inputs[@]}" --out-dir "$OUT"
