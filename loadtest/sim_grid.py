"""Command line: the simulator over a grid of workloads, replica counts, arrival rates and
seeds, reporting each policy's worst run against the oracle (see ``main``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from loadtest import skewed_docs
from loadtest.simulate import run_comparison
from loadtest.workloads import KINDS, default_rate, generate
from router.config import RouterConfig, with_options


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m loadtest.sim_grid [kind ...]``: the oracle and each policy per kind, over
    a grid of replica counts, arrival-rate scales and seeds; then, per kind and policy,
    the worst run against the oracle (lowest hit ratio, highest time ratio, highest
    max/mean busy time). Kinds: ``loadtest.workloads.KINDS`` and the skewed single-turn
    document variants (``loadtest.skewed_docs.VARIANTS``, routed without conversation
    keys)."""
    kinds = [*KINDS, *skewed_docs.VARIANTS]
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("kinds", nargs="*", default=["agents", "multi_turn_chat", "doc_qa"])
    parser.add_argument("--policies", default="cache_aware,round_robin,consistent_hash")
    parser.add_argument("--replicas", type=int, nargs="+", default=[4])
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--rate-scales",
        type=float,
        nargs="+",
        default=[1.0],
        help="multiply each kind's default arrival rate (e.g. 4: a cluster under load, "
        "where total time is more than the arrival span)",
    )
    parser.add_argument("--option", action="append", default=[], help="router NAME=VALUE")
    parser.add_argument(
        "--shared-cache",
        default="",
        help="policies also run on N replicas that share one cache of N× the blocks "
        "(rows shared:<policy>): each replica's own compute, the oracle's cache. Each "
        "policy's worst time is then also given against the best of them in the same "
        "run (what routing leaves, apart from the oracle's pooled compute)",
    )
    args = parser.parse_args(argv)
    shared = [p for p in args.shared_cache.split(",") if p]
    config = with_options(RouterConfig(), args.option)
    policies = args.policies.split(",")
    for kind in args.kinds:
        if kind not in kinds:
            parser.error(f"unknown kind {kind!r}; choose from {kinds}")
    for kind in args.kinds:
        worst: dict[str, list[tuple[float, str]]] = {}
        for n, scale, seed in (
            (n, scale, seed)
            for n in args.replicas
            for scale in args.rate_scales
            for seed in args.seeds
        ):
            documents = kind in skewed_docs.VARIANTS
            if documents:
                sessions = skewed_docs.variant(kind, seed=seed, rate_scale=scale)
            else:
                sessions = generate(kind, seed=seed, rate=default_rate(kind) * scale)
            started = time.perf_counter()
            results = run_comparison(
                sessions,
                policies,
                n_replicas=n,
                cache_fraction=args.cache_fraction,
                seed=seed,
                config=config,
                conversation_keys=not documents,
                shared=shared,
            )
            oracle = results[0]
            run = f"N={n} rate x{scale:g} seed {seed}"
            print(
                f"{kind} {run}: {oracle.requests} requests, {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            references = [r.total_time_s for r in results if r.policy.startswith("shared:")]
            for r in results:
                hit, span = r.hit_rate / oracle.hit_rate, r.total_time_s / oracle.total_time_s
                print(
                    f"  {r.policy:16} hit {r.hit_rate:.3f} ({hit:.3f}x oracle)"
                    f"  time {r.total_time_s:7.1f} s ({span:.3f}x)"
                    f"  max/mean busy {r.busy_imbalance:.2f} requests {r.load_imbalance:.2f}"
                    f"  TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s"
                )
                if r is not oracle:
                    cell = worst.setdefault(r.policy, [(9.0, ""), (0.0, ""), (0.0, ""), (0.0, "")])
                    cell[0] = min(cell[0], (hit, run))
                    cell[1] = max(cell[1], (span, run))
                    cell[2] = max(cell[2], (r.busy_imbalance, run))
                    if references:
                        cell[3] = max(cell[3], (r.total_time_s / min(references), run))
        for policy, cells in worst.items():
            (hit, hit_run), (span, span_run), (busy, busy_run), (shared_span, shared_run) = cells
            line = (
                f"WORST {kind} {policy}: hit {hit:.3f}x oracle ({hit_run}),"
                f" time {span:.3f}x ({span_run}), max/mean busy {busy:.2f} ({busy_run})"
            )
            if references:
                line += f", time {shared_span:.3f}x the best shared cache ({shared_run})"
            print(line)


if __name__ == "__main__":
    main()
