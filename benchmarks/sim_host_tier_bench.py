"""Issue 20's cluster figure: 16 simulated-engine replicas with a GPU profile, with and
without a host KV tier, cache_aware against round_robin, in one run.

    .venv/bin/python benchmarks/sim_host_tier_bench.py --workload agents
    .venv/bin/python benchmarks/sim_host_tier_bench.py --workload docs

One ``prefixgate up --model sim`` cluster per (policy, host tier) cell starts at once;
every cluster has the same device pool per replica (``--fraction`` of the workload's
distinct prefix blocks, as the live comparison sizes it: ``loadtest.cache_sizing``), and
the host-tier clusters add ``--host-ratio`` × that pool in host memory
(``--host-cache-mb``). The profile's cost constants (host copies included) are multiplied
by ``--slowdown`` through the ``PREFIXGATE_SIM_*`` variables, so that device time
outweighs this machine's HTTP and tokenizing time (docs/BENCHMARKS.md, "Simulated
engine"). Each repeat replays the workload once on every cluster, the clusters in a
rotated order, each after ``POST /reset_prefix_cache``; a cell's figures pool its repeats.

Per cell: the client's hit rate (cached / prompt tokens from ``usage``), split into
device and host by the replicas' own counters (``hit_tokens``, ``host_hit_tokens``), TTFT
p50/p99, total time, blocks moved each way, and the replicas' CPU seconds.

The cluster simulator (``loadtest.simulate``, same prompts, pools, slowed profile and
closed loop, each cell's replicas named as its cluster's) runs every cell after the live
run: ``simulated`` in the results, what the live figures should come near;
``--simulated-only`` runs only the simulator (replicas named ``replica-<i>``).

Workloads: ``agents`` (the live comparison's agent sessions, conversation keys sent) and
``docs`` (``loadtest.skewed_docs``: single-turn document questions, Zipf popularity, no
conversation key: the router sees only the prompt). ``--fraction`` is per replica: at
0.25 sixteen replicas hold four times the working set between them; a fraction near
1/16 of the cluster's wanted share (e.g. 0.019 for 0.3) makes the tier matter to a
router that partitions the documents too (the pool never goes below two of the longest
requests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtest.cache_sizing import live_prompts, size_cache
from loadtest.cluster import Cluster, wait_ready
from loadtest.replay import ReplayConfig, run_replay
from loadtest.workloads import Session
from prefixgate.envflags import env_var
from prefixgate.procs import free_port
from replica.sim.profile import COST_FIELDS, MIB
from replica.sim.profiles import load_profile

# /cache/stats counters summed over a cluster's replicas. Each request counts once, when
# it is admitted, however many steps it waited for free blocks (``matches_per_request``:
# about 1, the warm-up's requests included).
TIER_COUNTERS = (
    "queries",
    "query_tokens",
    "hit_tokens",
    "host_hit_tokens",
    "demotions",
    "promotions",
)


def workload(name: str, seed: int) -> tuple[list[Session], bool]:
    """The sessions, and whether the replay sends conversation keys."""
    if name == "agents":
        from loadtest.live import LIVE_PARAMS
        from loadtest.workloads import generate

        return generate("agents", seed=seed, **LIVE_PARAMS["agents"]), True
    if name == "docs":
        from loadtest import skewed_docs

        # 200 documents of 200-600 words, Zipf(1.1): 400 requests ask 104 of them.
        docs = skewed_docs.generate(
            seed=seed, docs=200, lengths=(200, 400, 600), zipf_s=1.1, requests=400, max_tokens=8
        )
        return docs, False
    raise SystemExit(f"unknown workload {name!r}: agents or docs")


def sim_env(profile_name: str, slowdown: float) -> dict[str, str]:
    profile = load_profile(profile_name)
    env = dict(os.environ, **{env_var("sim-profile"): profile.name})
    for name in COST_FIELDS:
        env[env_var("sim-" + name.replace("_", "-"))] = repr(getattr(profile, name) * slowdown)
    env.pop(env_var("host-cache-mb"), None)  # the flag alone decides the tier
    return env


def launch(
    args: argparse.Namespace, policy: str, blocks: int, host_mb: int, run_dir: Path
) -> Cluster:
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "prefixgate", "up", "--replicas", str(args.replicas)]
    cmd += ["--model", "sim", "--port", str(port), "--policy", policy]
    cmd += ["--num-blocks", str(blocks), "--host-cache-mb", str(host_mb)]
    cmd += ["--run-dir", str(run_dir)]
    with open(run_dir / "up.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=sim_env(args.profile, args.slowdown),
        )
    return Cluster(proc, run_dir, f"http://127.0.0.1:{port}/v1")


def tier_counters(cluster: Cluster) -> dict[str, int]:
    totals = dict.fromkeys(TIER_COUNTERS, 0)
    for stats in cluster.cache_stats().values():
        for key in TIER_COUNTERS:
            totals[key] += int(stats.get(key, 0))
    return totals


def replay_cell(
    cluster: Cluster, args: argparse.Namespace, sessions: list[Session], keys: bool
) -> dict[str, Any]:
    cluster.reset_prefix_cache()
    before, cpu_before = tier_counters(cluster), cluster.replica_cpu_seconds()
    config = ReplayConfig(
        base_url=cluster.base_url,
        model="sim",
        concurrency=args.concurrency,
        ignore_eos=True,
        seed=args.seed,
        progress=False,
        conversation_keys=keys,
    )
    summary = run_replay(sessions, config).summary()
    after, cpu_after = tier_counters(cluster), cluster.replica_cpu_seconds()
    moved = {k: after[k] - before[k] for k in TIER_COUNTERS}
    cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return {"summary": summary, "counters": moved, "replica_cpu_s": cpu}


def pooled(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell over its repeats: token-weighted hit rates, median of per-repeat times."""
    s = [r["summary"] for r in repeats]
    c = {k: sum(r["counters"][k] for r in repeats) for k in TIER_COUNTERS}
    prompt = sum(x["prompt_tokens"] for x in s)
    cached = sum(x["cached_tokens"] for x in s)
    hit = cached / prompt if prompt else 0.0
    host_share = c["host_hit_tokens"] / c["hit_tokens"] if c["hit_tokens"] else 0.0
    return {
        "hit_rate": hit,
        "device_hit_rate": hit * (1 - host_share),
        "host_hit_rate": hit * host_share,
        "ttft_p50_ms": 1e3 * statistics.median(x["ttft_p50_s"] for x in s),
        "ttft_p99_ms": 1e3 * statistics.median(x["ttft_p99_s"] for x in s),
        "total_time_s": statistics.median(x["total_time_s"] for x in s),
        "errors": sum(x["errors"] for x in s),
        "requests": sum(x["requests"] for x in s),
        "matches_per_request": c["queries"] / max(1, sum(x["requests"] for x in s)),
        "demoted_blocks": c["demotions"],
        "promoted_blocks": c["promotions"],
        "busy_replicas": statistics.median(x["busy_replicas_mean"] or 0 for x in s),
        "replica_cpu_s": sum(r["replica_cpu_s"] or 0 for r in repeats),
    }


Cell = tuple[str, int]  # (policy, host tier MiB)


def simulated(
    args: argparse.Namespace,
    sessions: list[Session],
    prompts: list[list[list[int]]],
    keys: bool,
    blocks: int,
    cells: list[Cell],
    host_blocks: int,
    names: dict[Cell, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The cluster simulator (``loadtest.simulate``) on the same prompts, pools, profile
    and closed loop: what the live cells should come near (issue 18's validation).
    ``names``: each cell's live replica ids, which the router's conversation ring hashes
    (default ``replica-<i>``)."""
    from loadtest.sim_validate import ProfileCost
    from loadtest.simulate import simulate

    profile = load_profile(args.profile)
    slowed = profile.with_overrides(**{f: getattr(profile, f) * args.slowdown for f in COST_FIELDS})
    mean = int(statistics.fmean(len(x) for session in prompts for x in session))
    cost = ProfileCost(profile=slowed, mean_context=mean)
    out = {}
    for policy, mb in cells:
        r = simulate(
            sessions,
            policy,
            args.replicas,
            blocks,
            cost,
            think_s=0.0,
            seed=args.seed,
            concurrency=args.concurrency,
            prompts=prompts,
            conversation_keys=keys,
            host_blocks_per_replica=host_blocks if mb else 0,
            replica_ids=names[(policy, mb)] if names is not None else None,
        )
        out[f"{policy}-host{mb}"] = {
            "hit_rate": r.hit_rate,
            "host_hit_rate": r.host_hit_rate,
            "ttft_p50_ms": 1e3 * r.ttft_p50_s,
            "total_time_s": r.total_time_s,
        }
    return out


def run_live(
    args: argparse.Namespace, sessions: list[Session], keys: bool, blocks: int, cells: list[Cell]
) -> tuple[dict[Cell, list[dict[str, Any]]], dict[Cell, list[str]]]:
    """Every cell's repeats, on one cluster per cell, all started at once; and each
    cluster's replica ids (host:port, in start order)."""
    clusters: dict[Cell, Cluster] = {}
    names: dict[Cell, list[str]] = {}
    results: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in cells}
    started = time.monotonic()
    try:
        for policy, mb in cells:
            run_dir = args.run_root / (args.tag or args.workload) / f"{policy}-host{mb}"
            clusters[(policy, mb)] = launch(args, policy, blocks, mb, run_dir)
        for cluster in clusters.values():
            wait_ready(cluster, 300)
            cluster.warm_up("sim")
        print(f"[tier] {len(clusters)} clusters ready after {time.monotonic() - started:.0f} s")
        for cell, cluster in clusters.items():
            names[cell] = [urlsplit(url).netloc for url in cluster.replica_urls().values()]
        for repeat in range(args.repeats):
            order = cells[repeat % len(cells) :] + cells[: repeat % len(cells)]
            for cell in order:
                r = replay_cell(clusters[cell], args, sessions, keys)
                results[cell].append(r)
                s = r["summary"]
                print(
                    f"[tier] #{repeat} {cell[0]} host {cell[1]} MiB: hit {s['hit_rate']:.3f} "
                    f"(host hits {r['counters']['host_hit_tokens']} tok), TTFT p50 "
                    f"{1e3 * s['ttft_p50_s']:.0f} ms, total {s['total_time_s']:.1f} s, "
                    f"errors {s['errors']}",
                    flush=True,
                )
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return results, names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="agents", choices=["agents", "docs"])
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--fraction", type=float, default=0.25, help="device pool / working set")
    p.add_argument("--host-ratio", type=float, default=2.0, help="host tier / device pool")
    p.add_argument("--profile", default="llama3.1-8b-a100")
    p.add_argument("--slowdown", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="results file name (default: the workload's)")
    p.add_argument("--simulated-only", action="store_true", help="no clusters: the simulator")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench/sim-host-tier"))
    p.add_argument("--run-root", type=Path, default=Path("runs/sim-host-tier"))
    args = p.parse_args()

    started = time.monotonic()
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = os.getloadavg()
    sessions, keys = workload(args.workload, args.seed)
    prompts = live_prompts(sessions, "sim")
    sizing = size_cache(sessions, prompts, "sim", args.fraction)
    blocks = sizing.num_blocks
    block_bytes = load_profile(args.profile).block_bytes(16)
    host_mb = -(-round(blocks * args.host_ratio) * block_bytes // MIB)
    host_blocks = host_mb * MIB // block_bytes
    print(f"[tier] {args.workload}: {len(sessions)} sessions; {sizing}; host {host_mb} MiB")
    cells = [(pol, mb) for pol in args.policies.split(",") for mb in (0, host_mb)]
    data: dict[str, Any] = {
        "workload": args.workload,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sizing": {
            "distinct_blocks": sizing.distinct_blocks,
            "device_blocks": blocks,
            "host_blocks": host_blocks,
            "host_mb": host_mb,
        },
        "started_at": started_at,
        "load_average_start": load_start,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.simulated_only:
        data["simulated"] = simulated(args, sessions, prompts, keys, blocks, cells, host_blocks)
        path = args.out_dir / f"{args.tag or args.workload}-simulated.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"[tier] {path}")
        return 0
    results, names = run_live(args, sessions, keys, blocks, cells)
    data["load_average_end"] = os.getloadavg()
    data["simulated"] = simulated(args, sessions, prompts, keys, blocks, cells, host_blocks, names)
    data["elapsed_s"] = time.monotonic() - started
    data["cells"] = [
        {"policy": pol, "host_mb": mb, **pooled(results[(pol, mb)]), "repeats": results[(pol, mb)]}
        for pol, mb in cells
    ]
    path = args.out_dir / f"{args.tag or args.workload}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"[tier] done in {data['elapsed_s']:.0f} s: {path}")
    for cell in data["cells"]:
        print(
            f"  {cell['policy']:<12} host {cell['host_mb']:>5} MiB  hit {cell['hit_rate']:.3f} "
            f"(device {cell['device_hit_rate']:.3f} + host {cell['host_hit_rate']:.3f})  "
            f"TTFT p50 {cell['ttft_p50_ms']:.0f} ms  total {cell['total_time_s']:.1f} s"
        )
    for name, row in data["simulated"].items():
        print(f"  simulated {name}: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
