"""The headline live experiment: one real local cluster per policy, every workload
replayed on each, several times, interleaved.

For each workload the KV cache of every replica holds about a third of the workload's
distinct prefix blocks (``loadtest.cache_sizing``), so that where a request lands decides
whether its prefix is cached.

One ``prefixgate up`` cluster per policy starts at once (they idle while another
replays). Each cell — a policy on a workload — begins with ``POST /reset_prefix_cache`` on
its gateway, which empties every replica's cache and the router's view of them, then
replays the workload; its per-replica ``/cache/stats`` are read around the replay. Every
workload is replayed ``repeats`` times per policy, the policies in a rotated order each
round, so that a slower minute on a shared machine falls on every policy alike; the
figures pool the repeats (``loadtest.pooling``: all requests for hit rate and TTFT
percentiles, medians over the repeats for total time and throughput). The hit rate is
compared with the simulated oracle's (one replica with N× capacity) at the same fraction
of the working set, and the targets are checked (``loadtest.targets``).

    prefixgate bench live --replicas 4 --model tiny-random \\
        --policies cache_aware,round_robin,consistent_hash,least_loaded \\
        --workloads agents,multi_turn_chat --repeats 3 --out-dir docs/bench

Rows of another project's router (``--external-router sglang:cache_aware``) run in front
of the first cluster's replicas, in the same rounds (``loadtest.external_router``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from loadtest import external_router, skewed_docs
from loadtest.cache_sizing import Sizing, live_prompts, size_cache
from loadtest.cluster import Cluster, cluster_hit_rate, launch_cluster, stats_delta, wait_ready
from loadtest.pooling import pool_cells
from loadtest.replay import ReplayConfig, run_replay
from loadtest.targets import check_targets

if TYPE_CHECKING:
    from loadtest.workloads import Session

DEFAULT_POLICIES = "cache_aware,round_robin,consistent_hash,least_loaded"
DEFAULT_WORKLOADS = "agents,multi_turn_chat"

# Passed to workloads.generate() (skewed_docs.generate() for that kind). Long prompts
# and short answers (about 2.5 SmolLM2 tokens per generated word): what a cache saves is
# prefill, so the workloads are prefill-bound, as agents and chat are on real models;
# with tiny prompts TTFT is set by HTTP and decode and no router shows. Small enough that
# one cluster per policy replays each workload three times on a few CPU cores (run
# times: docs/BENCHMARKS.md).
LIVE_PARAMS: dict[str, dict[str, Any]] = {
    "agents": {
        "agents": 4,
        "sessions_per_agent": 8,
        "steps": 4,
        "tool_prompt_len": 800,
        "tool_output_len": 30,
        "max_tokens": 8,
    },
    "multi_turn_chat": {
        "sessions": 32,
        "turns": 4,
        "system_len": 400,
        "user_len": 60,
        "max_tokens": 8,
    },
    # Single-turn document Q&A without conversation ids (loadtest.skewed_docs): a few
    # hot documents take most requests (doc 0 about 40%); its distinct prefix blocks
    # (about 1,420) match the two above, so one cache size is a third of each.
    skewed_docs.KIND: {
        "docs": 16,
        "lengths": (300, 600, 1000),
        "zipf_s": 1.3,
        "requests": 128,
        "question_len": 10,
        "max_tokens": 8,
    },
}


def simulated_oracle(
    sessions: Sequence[Session],
    prompts: Sequence[Sequence[list[int]]],
    n_replicas: int,
    num_blocks: int,
    concurrency: int,
) -> dict[str, Any]:
    """The simulated oracle — one replica with N× the blocks (and compute) — replaying
    the very prompts the live run sends (the real tokenizer and chat template) in the
    same closed loop. Only its hit rate is comparable: its times come from the
    simulator's cost model, not from this machine."""
    from loadtest.simulate import run_comparison

    (oracle,) = run_comparison(
        sessions,
        policies=(),
        n_replicas=n_replicas,
        blocks_per_replica=num_blocks,
        think_s=0.0,
        concurrency=concurrency,
        prompts=prompts,
    )
    return {"hit_rate": oracle.hit_rate, "requests": oracle.requests}


@dataclass(slots=True)
class LiveConfig:
    """One live experiment: the clusters, the workloads, and where results go."""

    replicas: int
    model: str
    policies: list[str]
    workloads: list[str]
    out_dir: Path
    concurrency: int
    fraction: float
    seed: int
    ready_timeout_s: float
    run_root: Path  # the clusters' logs; not results
    router_options: list[str]  # NAME=VALUE router thresholds for the gateways
    repeats: int = 3  # replays of every workload per policy, pooled
    external_routers: list[str] = field(default_factory=list)  # e.g. sglang:cache_aware
    sglang_python: str | None = None  # the Python with sglang-router installed


class Workload(NamedTuple):
    """A generated workload, its prompts as sent, and the cache size chosen for it."""

    name: str
    sessions: list[Session]
    prompts: list[list[list[int]]]
    sizing: Sizing
    conversation_keys: bool  # whether requests carry their session id as prompt_cache_key


class CellTarget(Protocol):
    """What a cell replays against: a prefixgate cluster or an external router."""

    @property
    def base_url(self) -> str: ...
    def reset_prefix_cache(self) -> None: ...
    def cache_stats(self) -> dict[str, dict[str, Any]]: ...
    def replica_cpu_seconds(self) -> float | None: ...
    def names_by_address(self) -> dict[str, str]: ...
    def stop(self) -> None: ...


class Started(NamedTuple):
    """Every row's target, by row name, and why external rows were skipped (if so)."""

    targets: dict[str, CellTarget]
    external_skipped: str | None


def start_clusters(cfg: LiveConfig, num_blocks: int) -> Started:
    """One cluster per policy, started together (their replicas load in parallel), then
    the external routers' rows in front of the first cluster's replicas."""
    clusters: dict[str, Cluster] = {}
    targets: dict[str, CellTarget] = {}
    try:
        for policy in cfg.policies:
            clusters[policy] = launch_cluster(
                cfg.replicas,
                cfg.model,
                policy,
                num_blocks,
                cfg.run_root / policy,
                cfg.router_options,
            )
        print(
            f"[live] starting {len(clusters)} clusters of {cfg.replicas} replicas, "
            f"{num_blocks} blocks each…",
            flush=True,
        )
        for cluster in clusters.values():
            wait_ready(cluster, cfg.ready_timeout_s)
            cluster.warm_up(cfg.model)
        targets.update(clusters)
        routers, skipped = external_router.start_routers(
            cfg.external_routers,
            cfg.sglang_python,
            clusters[cfg.policies[0]],
            cfg.run_root / "external",
            cfg.ready_timeout_s,
        )
        targets.update(routers)
    except BaseException:
        for target in reversed([*clusters.values(), *targets.values()]):
            target.stop()  # routers before the clusters they front; twice is harmless
        raise
    return Started(targets, skipped)


def run_cells(
    cfg: LiveConfig, clusters: dict[str, CellTarget], workloads: Sequence[Workload]
) -> list[dict[str, Any]]:
    """Every (repeat, workload, row) cell; each row's position in the order moves by one
    every repeat."""
    rows = list(clusters)
    results = []
    for repeat in range(cfg.repeats):
        for w in workloads:
            shift = repeat % len(rows)
            for policy in rows[shift:] + rows[:shift]:
                cluster = clusters[policy]
                cluster.reset_prefix_cache()
                results.append(replay_on(cluster, cfg, policy, w, repeat))
    return results


def replay_on(
    cluster: CellTarget, cfg: LiveConfig, policy: str, w: Workload, repeat: int = 0
) -> dict[str, Any]:
    """One cell: replay ``w`` on ``cluster`` and return the replay's results with the
    replicas' cache counters and CPU seconds accrued meanwhile."""
    before = cluster.cache_stats()
    cpu_before = cluster.replica_cpu_seconds()
    replay_config = ReplayConfig(
        base_url=cluster.base_url,
        model=cfg.model,
        concurrency=cfg.concurrency,
        ignore_eos=True,  # every policy generates the same number of tokens
        seed=cfg.seed,
        progress=False,
        conversation_keys=w.conversation_keys,
    )
    result = run_replay(w.sessions, replay_config)
    names = cluster.names_by_address()
    for record in result.requests:
        if record.replica is not None:
            record.replica = names.get(record.replica, record.replica)
    cpu_after = cluster.replica_cpu_seconds()
    stats = stats_delta(cluster.cache_stats(), before)
    meta = {"experiment": experiment_name(w.name, cfg), "policy": policy, "workload": w.name}
    data = result.to_json({**meta, "repeat": repeat})
    data["cache_stats"] = stats
    data["cluster_hit_rate"] = cluster_hit_rate(stats)
    external_router.counts_from_stats(data)
    s = data["summary"]
    if cpu_before is not None and cpu_after is not None:
        s["replica_cpu_s"] = cpu_after - cpu_before
    print(
        f"[live] #{repeat} {w.name} × {policy}: hit {s['hit_rate']:.3f}, TTFT p50 "
        f"{1000 * (s['ttft_p50_s'] or 0):.0f} ms, total {s['total_time_s']:.1f} s, "
        f"per replica {sorted(s['requests_per_replica'].values())}, errors {s['errors']}",
        flush=True,
    )
    return data


def experiment_name(workload: str, cfg: LiveConfig) -> str:
    return f"live: {workload}, {cfg.replicas} × {cfg.model}"


def prepare(cfg: LiveConfig) -> list[Workload]:
    """Generate every workload (saved beside the results), its prompts and cache size."""
    from loadtest.workloads import generate, save_jsonl

    out = []
    for name in cfg.workloads:
        params = LIVE_PARAMS.get(name, {})
        if name == skewed_docs.KIND:
            sessions = skewed_docs.generate(seed=cfg.seed, **params)
        else:
            sessions = generate(name, seed=cfg.seed, **params)
        save_jsonl(sessions, cfg.out_dir / f"workload-{name}.jsonl")
        prompts = live_prompts(sessions, cfg.model)
        sizing = size_cache(sessions, prompts, cfg.model, cfg.fraction)
        keys = name != skewed_docs.KIND  # plain API clients send no conversation id
        out.append(Workload(name, sessions, prompts, sizing, keys))
    return out


def run_live(cfg: LiveConfig) -> Path:
    """The whole experiment; returns the path of ``live.json``."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    workloads = prepare(cfg)
    num_blocks = max(w.sizing.num_blocks for w in workloads)
    oracle: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for w in workloads:
        exp = experiment_name(w.name, cfg)
        n_requests = sum(len(s.turns) for s in w.sessions)
        notes[exp] = (
            f"{len(w.sessions)} sessions, {n_requests} requests, closed loop with "
            f"{cfg.concurrency} concurrent sessions, replayed {cfg.repeats}× per policy "
            f"(pooled); {num_blocks} KV blocks per replica = "
            f"{num_blocks / w.sizing.distinct_blocks:.2f} of the workload's "
            f"{w.sizing.distinct_blocks} distinct prefix blocks."
        )
        print(f"[live] {exp}: {notes[exp]}", flush=True)
        oracle[exp] = simulated_oracle(
            w.sessions, w.prompts, cfg.replicas, num_blocks, cfg.concurrency
        )
    clusters, skipped = start_clusters(cfg, num_blocks)
    try:
        cells = run_cells(cfg, clusters, workloads)
    finally:
        for target in reversed(clusters.values()):
            target.stop()  # external routers before the cluster they front
    runs = pool_cells(cells)
    external_router.pool_counts(runs, cells)
    elapsed = time.monotonic() - started
    data = {
        "kind": "live",
        "config": {**asdict(cfg), "out_dir": str(cfg.out_dir), "run_root": str(cfg.run_root)},
        "elapsed_s": elapsed,
        "runs": runs,
        "repeats": [{k: c[k] for k in ("meta", "summary", "cluster_hit_rate")} for c in cells],
        "oracle": oracle,
        "notes": notes,
        "targets": check_targets(runs, oracle, cells),
    }
    if cfg.external_routers:
        data["versus_external"] = external_router.versus_external(runs, cells)
        data["external_skipped"] = skipped
    path = cfg.out_dir / "live.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"[live] done in {elapsed:.0f} s; results in {path}", flush=True)
    print(json.dumps(data["targets"], indent=1))
    return path
