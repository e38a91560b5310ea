"""`CacheAware.choose` alone: CPU time per decision on recorded inputs, against another
revision's policy on the same inputs.

    .venv/bin/python benchmarks/choose_bench.py [--against REV] [--rounds 5]

Records ``--decisions`` routing inputs (16 replicas by default, 2,048-token prompts half
cached, mixed loads: a third of the requests never reach their first byte, half never
finish) from a real ``Router``, then times ``choose`` on each, in rounds that alternate
the working tree's policy with ``--against``'s (its ``router/policies.py`` from ``git
show REV``; the rest of ``router/`` is this tree's). Prints p50 / p99 per round, and how
many decisions (replica and reason) differ between the two.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from router.config import RouterConfig
from router.policies import CacheAware, Choice, Policy, RouteInput
from router.ring import Ring
from router.router import Router

CHAIN = 128


def record(replicas: int, blocks: int, decisions: int, seed: int) -> list[RouteInput]:
    rng = random.Random(seed)
    router = Router(RouterConfig(), seed=seed)
    ids = [f"replica-{i}" for i in range(replicas)]
    for rid in ids:
        router.add_replica(rid, f"http://{rid}", static=True)
    chains = [tuple(rng.randbytes(16) for _ in range(CHAIN)) for _ in range(blocks // CHAIN)]
    for chain in chains:
        for rid in rng.sample(ids, 2 if rng.random() < 0.1 else 1):
            router.index.insert(rid, chain)
    inputs: list[RouteInput] = []
    choose = router.policy.choose

    def recording(request: RouteInput) -> Choice:
        inputs.append(request)
        return choose(request)

    router.policy.choose = recording  # type: ignore[method-assign]
    for i in range(decisions):
        keys = list(rng.choice(chains)[: CHAIN // 2]) + [rng.randbytes(16) for _ in range(64)]
        decision = router.route(keys, prompt_tokens=CHAIN * 16)
        handle = router.request_started(
            decision.replica_id, decision.uncached_tokens, decision.queued_tokens
        )
        if i % 3:
            router.first_byte(handle)
        if i % 2:
            router.request_finished(handle, ok=True)
    return inputs


def load_policies(rev: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:router/policies.py"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "policies_at_rev.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("policies_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fresh(cls: type[Policy], replicas: int) -> Policy:
    ring = Ring(RouterConfig().ring_vnodes)
    for i in range(replicas):
        ring.add(f"replica-{i}")
    return cls(RouterConfig(), ring, random.Random(0))


def timed(policy: Policy, inputs: list[RouteInput]) -> tuple[float, float]:
    times = []
    for request in inputs:
        t0 = time.thread_time_ns()
        policy.choose(request)
        times.append(time.thread_time_ns() - t0)
    times.sort()
    return times[len(times) // 2] / 1000, times[int(len(times) * 0.99)] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--decisions", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="REV", help="a git revision to compare with")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    inputs = record(args.replicas, args.blocks, args.decisions, args.seed)
    rows: dict[str, type[Policy]] = {"this tree": CacheAware}
    if args.against:
        rows[args.against] = load_policies(args.against).CacheAware
    results: dict[str, list[str]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, cls in rows.items():
            p50, p99 = timed(fresh(cls, args.replicas), inputs)
            results[name].append(f"{p50:.1f}/{p99:.1f}")
    for name, figures in results.items():
        print(f"choose() CPU p50/p99 µs, {name}: {' '.join(figures)}")
    if args.against:
        mine, theirs = (fresh(cls, args.replicas) for cls in rows.values())
        differ = sum(mine.choose(r) != theirs.choose(r) for r in inputs)
        print(f"decisions that differ (replica or reason): {differ} of {len(inputs)}")


if __name__ == "__main__":
    main()
