"""The live benchmark's workloads, replayed in the deterministic cluster simulator.

    python -m loadtest.live_replay --replicas 16 --scale 2 \\
        --option balance_slack=0 --option balance_slack=0.25

What ``prefixgate bench live --model sim`` runs in 10 minutes (real replicas, gateway,
Redis and load client), in seconds: the same workloads (``live_params`` at ``--scale``,
workload seed ``--seeds``), the very prompts the live client sends, one cache size for
every workload (the largest that holds ``--fraction`` of one, as the live bench sizes
it), the same closed loop (``--concurrency`` sessions, no think time) and the device
model of ``benchmarks/sim_live.sh`` (``--profile`` with every cost constant ×
``--slowdown``; ``loadtest.sim_validate.ProfileCost``). For comparing router settings
before a live run, not in place of one: the live figures also hold this machine's
HTTP and tokenizing time (docs/BENCHMARKS.md, "Simulated engine"), and timing noise.

Each ``--option NAME=VALUE`` is one router setting to compare (``default``: none); each
row prints hit rate, TTFT p50 and mean, total time, max/mean busy time and requests.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from loadtest.live import Workload, live_workload
from loadtest.sim_validate import ProfileCost
from loadtest.simulate import SimResult, simulate
from replica.sim.profile import COST_FIELDS, SimProfile
from replica.sim.profiles import load_profile
from router.config import RouterConfig, with_options

MODEL = "sim"
WORKLOADS = ("agents", "multi_turn_chat", "skewed_docs")


class Row(NamedTuple):
    workload: str
    seed: int
    policy: str
    option: str  # the router setting compared ("default": none)
    result: SimResult

    def line(self) -> str:
        r = self.result
        requests = max(r.requests_per_replica) / statistics.fmean(r.requests_per_replica)
        return (
            f"{self.workload:16} seed {self.seed} {self.policy:15} {self.option:28}"
            f" hit {r.hit_rate:.3f}  TTFT p50 {r.ttft_p50_s * 1000:4.0f} ms"
            f" mean {r.ttft_mean_s * 1000:4.0f} ms  total {r.total_time_s:5.1f} s"
            f"  busy max/mean {r.busy_imbalance:.2f}  requests max/mean {requests:.2f}"
        )


def replay(
    workload: Workload,
    seed: int,
    policy: str,
    option: str,
    *,
    replicas: int,
    blocks: int,
    concurrency: int,
    profile: SimProfile,
    whole_answers: bool = False,
) -> Row:
    """One workload under one policy and router setting."""
    config = with_options(RouterConfig(), [] if option == "default" else [option])
    lengths = [len(p) for session in workload.prompts for p in session]
    device = ProfileCost(profile=profile, mean_context=int(statistics.fmean(lengths)))
    result = simulate(
        workload.sessions,
        policy,
        replicas,
        blocks,
        device,
        think_s=0.0,
        config=config,
        concurrency=concurrency,
        prompts=workload.prompts,
        conversation_keys=workload.conversation_keys,
        whole_answers=whole_answers,
    )
    return Row(workload.name, seed, policy, option, result)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--concurrency", type=int, help="default: one session per replica")
    parser.add_argument("--policies", default="cache_aware")
    parser.add_argument("--option", action="append", default=[], help="router NAME=VALUE")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="workload seeds")
    parser.add_argument("--fraction", type=float, default=1 / 3, help="cache / working set")
    parser.add_argument("--profile", default="llama3.1-8b-a100")
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument(
        "--whole-answers",
        action="store_true",
        help="clients that do not stream: the router sees each request's end, no first output",
    )
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    profile = profile.with_overrides(
        **{f: getattr(profile, f) * args.slowdown for f in COST_FIELDS}
    )
    options = ["default", *args.option]
    rows = []
    for seed in args.seeds:
        workloads = [
            live_workload(name, args.scale, seed, MODEL, args.fraction)
            for name in args.workloads.split(",")
        ]
        blocks = max(w.sizing.num_blocks for w in workloads)
        for workload in workloads:
            for policy in args.policies.split(","):
                for option in options if policy == "cache_aware" else ["default"]:
                    row = replay(
                        workload,
                        seed,
                        policy,
                        option,
                        replicas=args.replicas,
                        blocks=blocks,
                        concurrency=args.concurrency or max(8, args.replicas),
                        profile=profile,
                        whole_answers=args.whole_answers,
                    )
                    print(row.line(), flush=True)
                    rows.append(row)
    return rows


if __name__ == "__main__":
    main()
