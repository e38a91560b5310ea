"""Validate the simulated engine against the cluster simulator: the same workload, the same
GPU profile, once live on ``--model sim`` replicas behind the real gateway and once in
``loadtest.simulate``; hit rates must agree within 0.02 and TTFT p50 within 15%.

    python -m loadtest.sim_validate --workload multi_turn_chat --replicas 4 \\
        --profile llama3.1-8b-a100 --concurrency 8 --out docs/bench/sim-validate.json

Both sides replay the very prompts the live client sends (the chat template over each
session's history), closed loop with the same concurrency and no think time. The
simulator's compute model is ``ProfileCost``: the profile's step-time function in the
shape ``sim_cost.CostModel`` has (a prompt's prefill in chunks of the engine's step
budget; a decode step of ``batch`` sequences at the workload's mean context; a swap-in
from the host tier at the profile's host bandwidth). ``--host-ratio R`` gives every
replica, live and simulated, a host KV tier of R × its device pool. The live run goes
first, and the simulator names its replicas as the live ones are named (host:port):
the router's conversation ring hashes those names, and with tight pools where each
conversation lands moves the hit rate by as much as 0.15. ``skewed_docs`` is sent as plain
API clients send it, without conversation ids, on both sides.

``--against RECORD`` runs only the simulator, against a previous ``--out`` record's live
side (its settings, cache size and live figures): a simulator change checked on recorded
runs, without a cluster. ``--requests FILE`` writes every request side by side (by
session and turn), to find the first request where the two sides part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtest.sim_client import BLOCK_SIZE
from loadtest.sim_cost import CostModel
from prefixgate.envflags import env_var
from replica.sim.profile import COST_FIELDS, MIB, SimProfile
from replica.sim.profiles import builtin_profiles, load_profile

MODEL = "sim"
PREFILL_CHUNK = 512  # the replica's default --max-prefill-tokens


@dataclass(slots=True)
class ProfileCost(CostModel):
    """``sim_cost.CostModel`` with a sim profile's step times (``scale``: the oracle's
    N× compute divides every time)."""

    profile: SimProfile = field(default_factory=lambda: builtin_profiles()["llama3.1-8b-h100"])
    mean_context: int = 1024
    prefill_chunk: int = PREFILL_CHUNK

    def prefill_s(self, tokens: int, scale: float = 1.0) -> float:
        return self.profile.prefill_s(max(1, tokens), chunk=self.prefill_chunk) / scale

    def step_s(self, batch: int, scale: float = 1.0) -> float:
        return self.profile.decode_step_s(batch, batch * self.mean_context) / scale

    def swap_in_s(self, blocks: int, scale: float = 1.0) -> float:
        return self.profile.swap_in_s(blocks, BLOCK_SIZE) / scale


def validation_profile(args: argparse.Namespace) -> SimProfile:
    """The profile, every cost constant multiplied by ``--slowdown``."""
    profile = load_profile(args.profile)
    return profile.with_overrides(**{f: getattr(profile, f) * args.slowdown for f in COST_FIELDS})


def host_blocks(args: argparse.Namespace, blocks: int) -> int:
    """The host tier per replica: ``--host-ratio`` × the device pool (0: none)."""
    return round(blocks * args.host_ratio)


def simulated(
    sessions: list[Any],
    prompts: list[list[list[int]]],
    args: argparse.Namespace,
    blocks: int,
    replica_ids: list[str] | None = None,
    requests: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The simulator's figures; ``requests`` (if given) receives every request as it
    served it."""
    from loadtest.simulate import simulate

    lengths = [len(p) for session in prompts for p in session]
    mean = int(statistics.fmean(lengths))
    cost = ProfileCost(profile=validation_profile(args), mean_context=mean)
    result = simulate(
        sessions,
        args.policy,
        args.replicas,
        blocks,
        cost,
        think_s=0.0,
        seed=args.seed,
        concurrency=args.concurrency,
        prompts=prompts,
        conversation_keys=args.conversation_keys,
        host_blocks_per_replica=host_blocks(args, blocks),
        replica_ids=replica_ids,
    )
    if requests is not None:
        requests += [served._asdict() for served in result.served]
    return {
        "hit_rate": result.hit_rate,
        "host_hit_rate": result.host_hit_rate,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p99_s": result.ttft_p99_s,
        "ttft_mean_s": result.ttft_mean_s,
        "total_time_s": result.total_time_s,
        "requests": result.requests,
        "requests_per_replica": sorted(result.requests_per_replica),
        "busy_s_per_replica": sorted(round(b, 1) for b in result.busy_s_per_replica),
    }


def side_by_side(live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request with both sides' records (``live``, ``sim``; either may be
    missing), matched by session and turn, in the simulator's first-token order."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for side, records in (("sim", sim), ("live", live)):
        for record in records:
            key = (record["session_id"], record["turn"])
            row = rows.setdefault(key, {"session_id": key[0], "turn": key[1]})
            row[side] = {k: v for k, v in record.items() if k not in ("session_id", "turn")}
    return list(rows.values())


def tier_tokens(stats: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """Cached tokens matched, and of those found on the host tier, over every replica."""
    hit = sum(int(s.get("hit_tokens", 0)) for s in stats.values())
    return hit, sum(int(s.get("host_hit_tokens", 0)) for s in stats.values())


def live(
    sessions: list[Any],
    args: argparse.Namespace,
    blocks: int,
    run_dir: Path,
    requests: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The live side's figures; ``requests`` (if given) receives the client's record of
    every request."""
    from loadtest.cluster import launch_cluster, wait_ready
    from loadtest.replay import ReplayConfig, run_replay

    # `up` and its replicas read these; the cost flags override the profile's constants.
    os.environ[env_var("sim-profile")] = args.profile
    profile = validation_profile(args)
    for name in COST_FIELDS:
        os.environ[env_var("sim-" + name.replace("_", "-"))] = repr(getattr(profile, name))
    host_mb = -(-host_blocks(args, blocks) * profile.block_bytes(BLOCK_SIZE) // MIB)
    os.environ[env_var("host-cache-mb")] = str(host_mb)
    cluster = launch_cluster(args.replicas, MODEL, args.policy, blocks, run_dir)
    try:
        wait_ready(cluster, 300)
        cluster.warm_up(MODEL)
        cluster.reset_prefix_cache()
        # The ids the gateway's conversation ring hashes (host:port, in start order).
        replica_ids = [urlsplit(url).netloc for url in cluster.replica_urls().values()]
        cpu_before = cluster.replica_cpu_seconds()
        tiers_before = tier_tokens(cluster.cache_stats())
        config = ReplayConfig(
            base_url=cluster.base_url,
            model=MODEL,
            concurrency=args.concurrency,
            ignore_eos=True,
            seed=args.seed,
            progress=False,
            conversation_keys=args.conversation_keys,
        )
        result = run_replay(sessions, config)
        cpu_after = cluster.replica_cpu_seconds()
        tiers_after = tier_tokens(cluster.cache_stats())
    finally:
        cluster.stop()
    if requests is not None:
        requests += [
            {
                "session_id": r.session_id,
                "turn": r.turn,
                "start_s": r.start_s,
                "ttft_s": r.ttft_s,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "replica": r.replica,
            }
            for r in result.requests
        ]
    summary = result.to_json({})["summary"]
    keys = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "total_time_s")
    out = {k: summary[k] for k in keys}
    hit, host = (after - before for after, before in zip(tiers_after, tiers_before, strict=True))
    # The replicas' counters split the client's hit rate by tier (each request counted
    # once, when admitted; the ratio keeps the client's own rate as the total).
    out["host_hit_rate"] = summary["hit_rate"] * host / hit if hit else 0.0
    out["requests"] = len(result.requests)
    out["replica_ids"] = replica_ids
    out["requests_per_replica"] = sorted(summary["requests_per_replica"].values())
    out["errors"] = summary.get("errors")
    if cpu_before is not None and cpu_after is not None:
        out["replica_cpu_s"] = round(cpu_after - cpu_before, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from loadtest import skewed_docs
    from loadtest.cache_sizing import live_prompts, size_cache
    from loadtest.live import LIVE_PARAMS
    from loadtest.workloads import generate

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default="multi_turn_chat")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--profile", default="llama3.1-8b-a100")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="multiply every cost constant: a slower device, so that its time dominates "
        "the host's (HTTP, JSON, tokenizing on a shared CPU)",
    )
    parser.add_argument("--fraction", type=float, default=0.3, help="cache / working set")
    parser.add_argument(
        "--host-ratio",
        type=float,
        default=0.0,
        help="a host KV tier of this many times the device pool per replica (0: none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload NAME=INT")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--run-dir", type=Path, help="keep the cluster's logs here")
    parser.add_argument(
        "--requests",
        type=Path,
        help="write every request side by side here (JSON: session, turn, and each "
        "side's time to first token, prompt and cached tokens, replica; the live side "
        "only when it ran, not with --against)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="a previous --out record: run only the simulator, against its live side (a "
        "simulator change checked on recorded runs, no cluster); its settings replace "
        "these, except --out and --requests",
    )
    args = parser.parse_args(argv)

    recorded: dict[str, Any] | None = None
    if args.against is not None:
        recorded = json.loads(args.against.read_text())
        given = recorded["args"] | {
            "out": args.out,
            "requests": args.requests,
            "run_dir": None,
            "against": args.against,
        }
        args = argparse.Namespace(**given)
        params = dict(recorded["params"])
    else:
        params = dict(LIVE_PARAMS.get(args.workload, {}))
    for item in args.param:
        name, value = item.split("=", 1)
        params[name] = int(value)
    # Single-turn documents are sent as plain API clients send them: no conversation id.
    args.conversation_keys = args.workload != skewed_docs.KIND
    if args.conversation_keys:
        sessions = generate(args.workload, seed=args.seed, **params)
    else:
        sessions = skewed_docs.generate(seed=args.seed, **params)
    prompts = live_prompts(sessions, MODEL)
    live_requests: list[dict[str, Any]] = []
    sim_requests: list[dict[str, Any]] = []
    if recorded is not None:
        blocks, got = recorded["blocks"], recorded["live"]
    else:
        blocks = size_cache(sessions, prompts, MODEL, args.fraction).num_blocks
        started = time.monotonic()
        if args.run_dir is not None:
            got = live(sessions, args, blocks, args.run_dir, live_requests)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                got = live(sessions, args, blocks, Path(tmp) / "run", live_requests)
        got["wall_s"] = round(time.monotonic() - started, 1)
    print(f"[validate] live sim replicas: {got}", flush=True)
    # Under the live replicas' names: the conversation ring then places every session
    # where the live gateway did (with tight pools, placement alone moves the hit rate).
    sim = simulated(sessions, prompts, args, blocks, got["replica_ids"], sim_requests)
    print(f"[validate] simulator: {sim}", flush=True)
    hit_gap = abs(got["hit_rate"] - sim["hit_rate"])
    # With --slowdown 0 the simulated device takes no time: the live TTFT is the host's.
    ttft_ratio = got["ttft_p50_s"] / sim["ttft_p50_s"] if sim["ttft_p50_s"] else float("inf")
    # Where TTFTs are bimodal (warm turns ~a step, cold or evicted ones whole prefills)
    # and the slow share is near half, p50 sits on the edge between the modes and one or
    # two requests flip it: the mean is the steadier comparison there.
    mean_ratio = got["ttft_mean_s"] / sim["ttft_mean_s"] if sim["ttft_mean_s"] else float("inf")
    verdict = {
        "hit_rate_gap": round(hit_gap, 4),
        "ttft_p50_live_over_sim": round(ttft_ratio, 3),
        "ttft_mean_live_over_sim": round(mean_ratio, 3),
        "hit_ok": hit_gap <= 0.02,
        "ttft_ok": abs(ttft_ratio - 1) <= 0.15,
    }
    print(f"[validate] {verdict}", flush=True)
    if args.requests is not None:
        args.requests.parent.mkdir(parents=True, exist_ok=True)
        args.requests.write_text(json.dumps(side_by_side(live_requests, sim_requests)) + "\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        record = {"args": flags, "blocks": blocks, "params": params}
        record |= {"simulator": sim, "live": got, "verdict": verdict}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if verdict["hit_ok"] and verdict["ttft_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
