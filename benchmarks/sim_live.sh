#!/usr/bin/env bash
# The live comparison on simulated-engine replicas (`--model sim`, one GPU each in
# effect): prefixgate's policies and, when installed, sglang-router's cache_aware and
# round_robin on the same replicas in the same interleaved rounds, at 4 and 16 replicas,
# on agents, multi-turn chat and skewed single-turn documents. Results in OUT/sim-<N>,
# with RUN.txt (times, commits, command) and loadavg.txt (load average and available
# memory every 10 s) beside them.
#
#   bash benchmarks/sim_live.sh [OUT]       # OUT defaults to docs/bench
#   SIZES="4" REPEATS=1 bash benchmarks/sim_live.sh /tmp/try
#   SIZES=64 SCALE=8 REPEATS=1 bash benchmarks/sim_live.sh docs/bench/sim-scaled
#
# SCALE=K multiplies every workload's sessions (`--scale`): at 64 replicas, K=8 gives
# each replica about 16 requests per workload. From 64 replicas up (or with SHARED=1)
# every policy runs on one set of replicas, a gateway per policy (`--shared-replicas`):
# one cluster per policy would not fit in memory (64 sim replicas: about 6.6 GB).
# CONCURRENCY overrides the concurrent sessions (default: one per replica, at least 8);
# EXTERNAL the sglang-router rows (default "sglang:cache_aware sglang:round_robin");
# ROUTER_OPTIONS router settings for every gateway ("NAME=VALUE ...", `--router-option`).
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
SCALE=${SCALE:-1}
SHARED=${SHARED:-0}

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

extra=()  # router options and external rows
for option in ${ROUTER_OPTIONS:-}; do
    extra+=(--router-option "$option")
done
if [ -n "${PREFIXGATE_SGLANG_PYTHON:-}" ]; then
    for row in ${EXTERNAL:-sglang:cache_aware sglang:round_robin}; do
        extra+=(--external-router "$row")
    done
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
    dir="$OUT/sim-$n"
    mkdir -p "$dir"
    concurrency=${CONCURRENCY:-$((n < 8 ? 8 : n))}
    shared=()
    if [ "$SHARED" = 1 ] || [ "$n" -ge 64 ]; then
        shared=(--shared-replicas)
    fi
    cmd=("$BIN/prefixgate" bench live --replicas "$n" --model sim \
        --concurrency "$concurrency" --policies "$POLICIES" "${extra[@]}" \
        --workloads "$WORKLOADS" --repeats "$REPEATS" --scale "$SCALE" "${shared[@]}" \
        --out-dir "$dir" --run-root "${RUN_ROOT:-runs/sim-live}/sim-$n")
    {
        echo "started $(date -u '+%F %T') UTC on $(nproc) cores"
        echo "commit $(git log --oneline -1)"
        echo "router/ last commits:"
        git log --oneline -3 -- router/ | sed 's/^/  /'
        echo "uncommitted in router/: $(git status --short -- router/ | tr '\n' ' ')(diff in router-uncommitted.diff)"
        echo "command: SIZES=$n SCALE=$SCALE SHARED=$SHARED REPEATS=$REPEATS bash benchmarks/sim_live.sh $OUT"
        echo "bench: ${cmd[*]}"
    } >"$dir/RUN.txt"
    git diff -- router/ >"$dir/router-uncommitted.diff"
    (   # load average and available memory every 10 s while the run lasts
        while :; do
            echo "$(date -u +%T) $(cat /proc/loadavg) $(awk '/MemAvailable/ {print int($2 / 1024) " MB available"}' /proc/meminfo)"
            sleep 10
        done
    ) >"$dir/loadavg.txt" &
    sampler=$!
    rc=0
    isolated "${cmd[@]}" || rc=$?
    kill "$sampler"
    echo "finished $(date -u '+%F %T') UTC, rc $rc" >>"$dir/RUN.txt"
    [ "$rc" = 0 ] || exit "$rc"
done
