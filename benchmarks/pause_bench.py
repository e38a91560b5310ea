"""The balance price's busy shares across a pause in the traffic (``balance_pause``).

    .venv/bin/python benchmarks/pause_bench.py [--replicas 16] [--pause-s 600] [--seeds 0 1 2]

In the cluster simulator (loadtest/sim_cluster.py, open loop): agent traffic first,
``--replicas``/2 agent types whose sessions keep each type's holder busier than the
rest; then nothing for ``--pause-s`` seconds (a night, a finished batch job); then a
burst of new chat conversations (one per replica, arriving within about a second). Each
router setting (``--option``; by default the fading on, and off with
``balance_pause=0``) serves the same arrivals. Printed per setting and seed, for the
chat after the pause: how many replicas its conversations were placed on, hit rate,
TTFT p50 and mean, and the time from its first arrival to its last reply.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import replace

from loadtest.sim_cluster import SimCluster
from loadtest.sim_cost import CostModel
from loadtest.simulate import working_set_blocks
from loadtest.workloads import Session, default_rate, generate
from router.config import RouterConfig, with_options


def traffic(seed: int, replicas: int, pause_s: float, rate_scale: float) -> list[Session]:
    """Agent sessions, then after ``pause_s`` of nothing a burst of chat sessions."""
    agents = generate(
        "agents",
        seed=seed,
        agents=max(1, replicas // 2),
        sessions_per_agent=8,
        rate=default_rate("agents") * rate_scale,
    )
    # The agents' last session starts here and takes well under 2 minutes.
    resume = agents[-1].arrival_s + 120.0 + pause_s
    chat = generate("multi_turn_chat", seed=seed, sessions=replicas, rate=float(replicas))
    return agents + [replace(s, arrival_s=s.arrival_s + resume) for s in chat]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--pause-s", type=float, default=600.0)
    parser.add_argument("--rate-scale", type=float, default=4.0, help="x the agents' default")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--option", action="append", default=[], help="NAME=VALUE, or 'default' (repeatable)"
    )
    args = parser.parse_args()
    options = args.option or ["default", "balance_pause=0"]
    for seed in args.seeds:
        sessions = traffic(seed, args.replicas, args.pause_s, args.rate_scale)
        chat = {s.session_id for s in sessions if s.kind == "multi_turn_chat"}
        start = min(s.arrival_s for s in sessions if s.session_id in chat)
        blocks = max(64, int(args.cache_fraction * working_set_blocks(sessions)))
        for option in options:
            config = with_options(RouterConfig(), [] if option == "default" else [option])
            sim = SimCluster(
                sessions,
                "cache_aware",
                args.replicas,
                blocks,
                CostModel(),
                scale=1.0,
                think_s=1.0,
                seed=seed,
                config=config,
            )
            sim.run()
            later = [r for r in sim.served if r.conv.session.session_id in chat]
            ttfts = sorted(r.first_token_at - r.arrival for r in later)
            hit = sum(r.cached for r in later) / sum(len(r.tokens) for r in later)
            first: dict[str, int] = {}
            for r in later:  # in first-token order: each conversation's first request first
                first.setdefault(r.conv.session.session_id, r.replica)
            placed = Counter(first.values())
            print(
                f"seed {seed} {option:18} chat after the pause: {len(chat)} conversations on"
                f" {len(placed)} of {args.replicas} replicas (at most {max(placed.values())}),"
                f" hit {hit:.3f},"
                f" TTFT p50 {statistics.median(ttfts) * 1000:.0f} ms"
                f" mean {statistics.fmean(ttfts) * 1000:.0f} ms,"
                f" done in {sim.now - start:.1f} s"
            )


if __name__ == "__main__":
    main()
