"""Two gateways sharing one Redis in front of the same sim replicas, clients split across
them, against one gateway taking every client: the cluster hit rates should agree (each
gateway sees the other's placements through the replicas' block events).

    python -m loadtest.two_gateways --replicas 16 --workload multi_turn_chat \\
        --concurrency 16 --out docs/bench/sim-two-gateways.json

One ``prefixgate up --model sim`` cluster (its gateway is the first); a second
``prefixgate gateway`` joins the same Redis and replicas. Each arrangement starts from
empty caches (``POST /reset_prefix_cache``); the sessions are dealt alternately to the
two gateways, each replayed with half the concurrency, at the same time. ``--option
NAME=VALUE`` (repeatable) is a router setting for both gateways.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from typing import Any

from loadtest.cluster import JoinedGateway, join_gateway, launch_cluster, wait_ready
from loadtest.replay import ReplayConfig, ReplayResult, run_replay

MODEL = "sim"


def hit_rate(results: list[ReplayResult]) -> float:
    prompt = sum(r.prompt_tokens or 0 for res in results for r in res.requests)
    cached = sum(r.cached_tokens or 0 for res in results for r in res.requests)
    return cached / prompt if prompt else 0.0


def replay(sessions: list[Any], base_url: str, concurrency: int, seed: int) -> ReplayResult:
    config = ReplayConfig(
        base_url=base_url,
        model=MODEL,
        concurrency=concurrency,
        ignore_eos=True,
        seed=seed,
        progress=False,
    )
    return run_replay(sessions, config)


def main(argv: list[str] | None = None) -> int:
    from loadtest.cache_sizing import live_prompts, size_cache
    from loadtest.live import LIVE_PARAMS
    from loadtest.workloads import generate

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--workload", default="multi_turn_chat")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/two-gateways"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--option", action="append", default=[], help="router NAME=VALUE")
    args = parser.parse_args(argv)

    sessions = generate(args.workload, seed=args.seed, **LIVE_PARAMS.get(args.workload, {}))
    blocks = size_cache(sessions, live_prompts(sessions, MODEL), MODEL, args.fraction).num_blocks
    cluster = launch_cluster(
        args.replicas, MODEL, args.policy, blocks, args.run_dir, router_options=args.option
    )
    extra: JoinedGateway | None = None
    try:
        wait_ready(cluster, 300)
        cluster.warm_up(MODEL)
        extra = join_gateway(
            cluster, MODEL, args.policy, args.run_dir / "gateway-2.log", router_options=args.option
        )
        other_url = extra.base_url
        cluster.reset_prefix_cache()
        one = replay(sessions, cluster.base_url, args.concurrency, args.seed)
        cluster.reset_prefix_cache()
        halves = [sessions[0::2], sessions[1::2]]
        urls = [cluster.base_url, other_url]
        results: list[ReplayResult | None] = [None, None]

        def run(i: int) -> None:
            results[i] = replay(halves[i], urls[i], max(1, args.concurrency // 2), args.seed)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        two = [r for r in results if r is not None]
        assert len(two) == 2, "a replay failed"
    finally:
        if extra is not None:
            extra.stop()
        cluster.stop()
    one_rate, two_rate = hit_rate([one]), hit_rate(two)
    record: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "blocks_per_replica": blocks,
        "one_gateway": {"hit_rate": one_rate, "requests": len(one.requests)},
        "two_gateways": {
            "hit_rate": two_rate,
            "requests": sum(len(r.requests) for r in two),
            "hit_rate_each": [hit_rate([r]) for r in two],
        },
        "gap": abs(one_rate - two_rate),
    }
    print(json.dumps(record, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
