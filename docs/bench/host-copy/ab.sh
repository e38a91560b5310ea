#!/bin/bash
# A/B: old (d49680b) and new (HEAD) engine, docs tight with host tier, cache_aware only.
set -x
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/oldwt; else dir=/work/main; fi
    cd $dir && cat /proc/loadavg > /tmp/ab/$side-$round.load && \
    $PY benchmarks/sim_host_tier_bench.py --workload docs --fraction 0.019 --policies cache_aware --repeats 1 \
      --tag ab-$side-$round --out-dir /tmp/ab --run-root /tmp/ab-run/$side-$round > /tmp/ab/$side-$round.log 2>&1
    cat /proc/loadavg >> /tmp/ab/$side-$round.load
  done
done
