"""Simulated-engine replicas of several source trees, side by side: CPU per request and
garbage collections (prefixgate/gc_heap.py, replica/scheduler.py's closed requests).

    .venv/bin/python benchmarks/replica_gc.py --tree before=/tmp/before [--rounds 3]
        [--requests 1500] [--concurrency 32] [--model sim]

One ``prefixgate replica --model sim`` per tree (this tree first; ``git worktree add
/tmp/before REV`` for another), each probed as ``benchmarks/gateway_workers.py
--gc-probe`` probes gateways; each round sends agent turns (30 tool definitions,
``tool_choice`` "none", 8 tokens answered) straight to each replica in rotated order,
closed loop, from a load generator in its own process. A sim replica computes nothing
(its steps sleep a GPU's time), so its CPU is its server, scheduler and bookkeeping:
what 64 of them on one machine cost (docs/BENCHMARKS.md, simulated engine).
``--model tiny-random``: the built-in engine's forward pass on CPU, which the replicas
then share this machine's cores for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agents_bench import start  # noqa: E402
from gateway_workers import GC_PROBE, bodies, measured_load  # noqa: E402

from prefixgate.procs import free_port, stop_process  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model", default="sim", help="what the replicas serve (sim: no model)")
    args = parser.parse_args()
    trees = {"this": ROOT}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="replica-gc-") as tmp:
        tmpdir = Path(tmp)
        probe_dir = tmpdir / "gc-probe"
        probe_dir.mkdir()
        (probe_dir / "sitecustomize.py").write_text(GC_PROBE)
        try:
            replicas: dict[str, tuple[str, int, Path]] = {}
            for name, tree in trees.items():
                port = free_port()
                label = f"replica-{name}"
                env = {"PYTHONPATH": str(probe_dir), "PREFIXGATE_GC_PROBE": str(probe_dir / label)}
                url = start(
                    ["-m", "prefixgate", "replica", "--model", args.model, "--port", str(port)],
                    port, procs, tmpdir / f"{label}.log", cwd=tree, env=env,
                )  # fmt: skip
                replicas[name] = (url, procs[-1].pid, probe_dir / label)
            turns = bodies("agent", args.requests + args.concurrency)
            for body in turns:
                body["model"], body["tool_choice"] = args.model, "none"
            path = tmpdir / "agent.json"
            path.write_text(json.dumps(turns))
            print(
                f"{args.model} replicas of {', '.join(trees)}; agent turns, "
                f"{args.requests} per run after {args.concurrency} warm-up, "
                f"{args.concurrency} at once; "
                f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            order = list(replicas)
            for round_ in range(args.rounds):
                for k in range(len(order)):
                    name = order[(round_ + k) % len(order)]
                    url, pid, probe = replicas[name]
                    r, cpu, gc_line = measured_load(url, pid, path, args.concurrency, probe)
                    print(
                        f"round {round_ + 1} {name}: {r['rps']:6.1f} req/s  "
                        f"p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  "
                        f"errors {r['errors']}  replica CPU {cpu * 1e3:.2f} ms/request  "
                        f"load {os.getloadavg()[0]:.1f}{gc_line}",
                        flush=True,
                    )
        finally:
            for proc in reversed(procs):
                stop_process(proc, grace_s=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
