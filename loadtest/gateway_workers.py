"""A gateway of N workers (``--workers``) against a gateway of one process, in front of
the same sim replicas: the cluster hit rates and first-token times should agree (the
workers share what they learn through Redis, as separate gateways do).

    python -m loadtest.gateway_workers --replicas 16 --workers 2 \\
        --workload multi_turn_chat --concurrency 16 --rounds 2

One ``prefixgate up --model sim --gateway-workers N`` cluster; a one-process
``prefixgate gateway`` joins the same Redis and replicas. Each replay starts from empty
caches (``POST /reset_prefix_cache``) and sends every session through one gateway; the
rounds alternate which goes first. The client's connections reach the workers as the
kernel deals them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from loadtest.cluster import JoinedGateway, join_gateway, launch_cluster, wait_ready
from loadtest.replay import ReplayResult
from loadtest.two_gateways import MODEL, hit_rate, replay


def ttft_p50(result: ReplayResult) -> float:
    values = [r.ttft_s for r in result.requests if r.ttft_s is not None]
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    from loadtest.cache_sizing import live_prompts, size_cache
    from loadtest.live import LIVE_PARAMS
    from loadtest.workloads import generate

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workload", default="multi_turn_chat")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/gateway-workers"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    sessions = generate(args.workload, seed=args.seed, **LIVE_PARAMS.get(args.workload, {}))
    blocks = size_cache(sessions, live_prompts(sessions, MODEL), MODEL, args.fraction).num_blocks
    cluster = launch_cluster(
        args.replicas, MODEL, args.policy, blocks, args.run_dir, gateway_workers=args.workers
    )
    single: JoinedGateway | None = None
    runs: list[dict[str, Any]] = []
    try:
        wait_ready(cluster, 300)
        cluster.warm_up(MODEL)
        single = join_gateway(cluster, MODEL, args.policy, args.run_dir / "gateway-one.log")
        urls = {f"{args.workers} workers": cluster.base_url, "1 process": single.base_url}
        for round_ in range(args.rounds):
            names = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for name in names:
                cluster.reset_prefix_cache()
                result = replay(sessions, urls[name], args.concurrency, args.seed)
                errors = sum(1 for r in result.requests if r.error)
                run = {
                    "round": round_ + 1,
                    "gateway": name,
                    "hit_rate": hit_rate([result]),
                    "ttft_p50_s": ttft_p50(result),
                    "requests": len(result.requests),
                    "errors": errors,
                }
                print(json.dumps(run), flush=True)
                runs.append(run)
    finally:
        if single is not None:
            single.stop()
        cluster.stop()
    record = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "blocks_per_replica": blocks,
        "runs": runs,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
