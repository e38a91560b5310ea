#!/usr/bin/env bash
# The live comparison on simulated-engine replicas (`--model sim`, one GPU each in
# effect): prefixgate's policies and, when installed, sglang-router's cache_aware and
# round_robin on the same replicas in the same interleaved rounds, at 4 and 16 replicas,
# on agents, multi-turn chat and skewed single-turn documents. Results in OUT/sim-<N>.
#
#   bash benchmarks/sim_live.sh [OUT]       # OUT defaults to docs/bench
#   SIZES="4" REPEATS=1 bash benchmarks/sim_live.sh /tmp/try
#
# sglang-router is no project dependency: install it in a venv of its own
# (python3 -m venv ~/sglr && ~/sglr/bin/pip install sglang-router) and point
# PREFIXGATE_SGLANG_PYTHON at its python; without it its rows are skipped. It tries to
# reach the internet, so the whole run (replicas, Redis, gateways, routers, load client)
# goes into one loopback-only network namespace (`unshare -rn`, no root needed where
# unprivileged user namespaces are allowed); where unshare is refused the run goes on
# outside it and the sglang rows are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/.venv/bin
OUT=${1:-docs/bench}
SIZES=${SIZES:-4 16}
REPEATS=${REPEATS:-2}
POLICIES=${POLICIES:-cache_aware,round_robin,least_loaded,consistent_hash}
WORKLOADS=${WORKLOADS:-agents,multi_turn_chat,skewed_docs}

# The A100 profile with every cost constant x10, so that device time outweighs this
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
export HF_HUB_OFFLINE=1

external=()
if [ -n "${PREFIXGATE_SGLANG_PYTHON:-}" ]; then
    external=(--external-router sglang:cache_aware --external-router sglang:round_robin)
fi

isolated() {  # run "$@" in a loopback-only network namespace when one can be made
    if unshare -rn true 2>/dev/null; then
        unshare -rn sh -c 'ip link set lo up && exec "$@"' sh "$@"
    else
        echo "sim_live: unshare -rn refused; running with the host network" >&2
        "$@"
    fi
}

for n in $SIZES; do
    isolated "$BIN/prefixgate" bench live --replicas "$n" --model sim \
        --concurrency $((n < 8 ? 8 : n)) --policies "$POLICIES" "${external[@]}" \
        --workloads "$WORKLOADS" --repeats "$REPEATS" --out-dir "$OUT/sim-$n" \
        --run-root "${RUN_ROOT:-runs/sim-live}/sim-$n"
done
