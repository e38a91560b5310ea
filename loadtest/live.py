"""The headline live experiment: one real local cluster per policy, every workload
replayed on each, several times, interleaved.

For each workload the KV cache of every replica holds about a third of the workload's
distinct prefix blocks (``loadtest.cache_sizing``), so that where a request lands decides
whether its prefix is cached.

One ``prefixgate up`` cluster per policy starts at once (they idle while another
replays); or, with ``shared_replicas``, one cluster for the first policy and one more
``prefixgate gateway`` per other policy joined to its Redis and replicas
(``loadtest.cluster.join_gateway``), so that N policies cost one set of replicas. Each
cell — a policy on a workload — begins with ``POST /reset_prefix_cache`` on its gateway,
which empties every replica's cache and that gateway's view of them, waits until that
gateway sees nothing in flight on any replica (the replicas' last heartbeats of the
previous cell no longer count: ``loadtest.cluster.wait_router_idle``), then replays the
workload; its per-replica ``/cache/stats`` are read around the replay. With shared
replicas the idle gateways route nothing during another's cell, and are stopped
(SIGSTOP) meanwhile so that they spend no CPU folding in its block events and hints
(``loadtest.cluster.IdleGateways``; what they still spend is recorded per cell,
``other_gateways_cpu_s``); resumed, a gateway catches up on the events, and its own
reset before its cell empties its view. Every
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
from loadtest.cluster import (
    Cluster,
    IdleGateways,
    JoinedGateway,
    cluster_hit_rate,
    cpu_seconds,
    launch_cluster,
    launch_gateway,
    rss_mb,
    stats_delta,
    wait_gateway,
    wait_ready,
)
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


# What ``scale`` multiplies in each workload, so that many replicas see a user's load
# and every working set grows about K-fold, keeping one cache size about a third of
# each (measured, distinct prefix blocks at K = 1 / 2 / 8: agents 1,413 / 2,803 /
# 11,205, chat 1,428 / 2,793 / 10,689, documents 1,422 / 3,527 / 11,744). Agents:
# the number of agent types (each with its own tool prompt and 8 sessions); more
# sessions per type would grow the working set only 1.6 / 5.4-fold (the tool prompts
# are shared). Chat: conversations. Documents: requests and documents alike; more
# requests over the same 16 documents would bring no new prefix, and a third of the
# working set would be the whole hot set on every replica.
SCALED: dict[str, tuple[str, ...]] = {
    "agents": ("agents",),
    "multi_turn_chat": ("sessions",),
    skewed_docs.KIND: ("requests", "docs"),
}


def live_params(name: str, scale: int = 1) -> dict[str, Any]:
    """``LIVE_PARAMS[name]`` with its ``SCALED`` counts multiplied by ``scale``."""
    params = dict(LIVE_PARAMS.get(name, {}))
    for key in SCALED.get(name, ()):
        if key in params:
            params[key] *= scale
    return params


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
    shared_replicas: bool = False  # one set of replicas, one gateway per policy
    scale: int = 1  # multiplies each workload's sessions (live_params)


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
    """Every row's target, by row name, and why external rows were skipped (if so); the
    gateway process of each prefixgate row, every prefixgate process started (for their
    memory), and how long starting them took."""

    targets: dict[str, CellTarget]
    external_skipped: str | None
    gateway_pids: dict[str, int]
    processes: list[int]
    startup_s: float


def start_clusters(cfg: LiveConfig, num_blocks: int) -> Started:
    """One cluster per policy, started together (their replicas load in parallel), or with
    ``shared_replicas`` one cluster and a joined gateway per other policy; then the
    external routers' rows in front of the first cluster's replicas."""
    t0 = time.monotonic()
    own = cfg.policies if not cfg.shared_replicas else cfg.policies[:1]
    clusters: dict[str, Cluster] = {}
    joined: dict[str, JoinedGateway] = {}
    targets: dict[str, CellTarget] = {}
    try:
        for policy in own:
            clusters[policy] = launch_cluster(
                cfg.replicas,
                cfg.model,
                policy,
                num_blocks,
                cfg.run_root / policy,
                cfg.router_options,
            )
        print(
            f"[live] starting {len(clusters)} cluster(s) of {cfg.replicas} replicas, "
            f"{num_blocks} blocks each…",
            flush=True,
        )
        for cluster in clusters.values():
            wait_ready(cluster, cfg.ready_timeout_s)
            cluster.warm_up(cfg.model)
        host = clusters[cfg.policies[0]]
        for policy in cfg.policies[len(own) :]:
            log = cfg.run_root / f"gateway-{policy}.log"
            joined[policy] = launch_gateway(host, cfg.model, policy, log, cfg.router_options)
        for gateway in joined.values():
            wait_gateway(gateway, cfg.ready_timeout_s)
        for policy in cfg.policies:
            targets[policy] = clusters.get(policy) or joined[policy]
        startup_s = time.monotonic() - t0
        routers, skipped = external_router.start_routers(
            cfg.external_routers,
            cfg.sglang_python,
            host,
            cfg.run_root / "external",
            cfg.ready_timeout_s,
        )
        targets.update(routers)
    except BaseException:
        # routers before the gateways and clusters they front; twice is harmless
        started: list[CellTarget] = [*clusters.values(), *joined.values(), *targets.values()]
        for target in reversed(started):
            target.stop()
        raise
    pids = {p: c.gateway_pid() for p, c in clusters.items()}
    pids.update((p, g.gateway_pid()) for p, g in joined.items())
    processes = [pid for c in clusters.values() for pid in (c.proc.pid, *c.pids().values())]
    processes += [g.proc.pid for g in joined.values()]
    print(
        f"[live] ready in {startup_s:.1f} s: {len(processes)} processes, "
        f"{rss_mb(processes):.0f} MB resident",
        flush=True,
    )
    return Started(targets, skipped, pids, processes, startup_s)


def run_cells(
    cfg: LiveConfig,
    clusters: dict[str, CellTarget],
    workloads: Sequence[Workload],
    gateway_pids: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Every (repeat, workload, row) cell; each row's position in the order moves by one
    every repeat. With ``gateway_pids`` (row → its gateway process) each cell also
    records the CPU seconds of its own gateway and of all the others meanwhile. With
    ``cfg.shared_replicas`` the gateways a cell does not use are stopped during it
    (``IdleGateways``); an external row's reset goes through the first policy's."""
    rows = list(clusters)
    pids = gateway_pids or {}
    idle: IdleGateways | None = None
    if cfg.shared_replicas:
        gateways = {p: (pid, clusters[p].base_url) for p, pid in pids.items()}
        idle = IdleGateways(gateways, cfg.replicas, cfg.ready_timeout_s)
    results = []
    try:
        for repeat in range(cfg.repeats):
            for w in workloads:
                shift = repeat % len(rows)
                for policy in rows[shift:] + rows[:shift]:
                    cluster = clusters[policy]
                    if idle is not None:
                        idle.only(policy if policy in pids else cfg.policies[0])
                    cluster.reset_prefix_cache()
                    if idle is not None and policy not in pids:
                        idle.only(None)
                    before = {p: cpu_seconds(pid) for p, pid in pids.items()}
                    cell = replay_on(cluster, cfg, policy, w, repeat)
                    after = {p: cpu_seconds(pid) for p, pid in pids.items()}
                    used = {}
                    for p in pids:
                        b, a = before[p], after[p]
                        if a is not None and b is not None:
                            used[p] = a - b
                    if policy in used:
                        cell["summary"]["gateway_cpu_s"] = used[policy]
                    if pids:
                        others = [u for p, u in used.items() if p != policy]
                        cell["summary"]["other_gateways_cpu_s"] = sum(others)
                    results.append(cell)
    finally:
        if idle is not None:
            idle.resume_all()
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


def _mode(cfg: LiveConfig) -> str:
    if cfg.shared_replicas:
        return f"one set of replicas behind {len(cfg.policies)} gateways (one per policy)"
    return "one cluster per policy"


def experiment_name(workload: str, cfg: LiveConfig) -> str:
    return f"live: {workload}, {cfg.replicas} × {cfg.model}"


def live_workload(name: str, scale: int, seed: int, model: str, fraction: float) -> Workload:
    """One live workload (``live_params(name, scale)``), its prompts as sent to
    ``model`` and the cache size that holds ``fraction`` of it."""
    from loadtest.workloads import generate

    params = live_params(name, scale)
    if name == skewed_docs.KIND:
        sessions = skewed_docs.generate(seed=seed, **params)
    else:
        sessions = generate(name, seed=seed, **params)
    prompts = live_prompts(sessions, model)
    sizing = size_cache(sessions, prompts, model, fraction)
    keys = name != skewed_docs.KIND  # plain API clients send no conversation id
    return Workload(name, sessions, prompts, sizing, keys)


def prepare(cfg: LiveConfig) -> list[Workload]:
    """Generate every workload (saved beside the results), its prompts and cache size."""
    from loadtest.workloads import save_jsonl

    out = []
    for name in cfg.workloads:
        workload = live_workload(name, cfg.scale, cfg.seed, cfg.model, cfg.fraction)
        save_jsonl(workload.sessions, cfg.out_dir / f"workload-{name}.jsonl")
        out.append(workload)
    return out


def run_live(cfg: LiveConfig) -> Path:
    """The whole experiment; returns the path of ``live.json``."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    workloads = prepare(cfg)
    num_blocks = max(w.sizing.num_blocks for w in workloads)
    oracle: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for w in workloads:
        exp = experiment_name(w.name, cfg)
        n_requests = sum(len(s.turns) for s in w.sessions)
        notes[exp] = (
            f"{len(w.sessions)} sessions, {n_requests} requests (scale {cfg.scale}), "
            f"{_mode(cfg)}, closed loop with "
            f"{cfg.concurrency} concurrent sessions, replayed {cfg.repeats}× per policy "
            f"(pooled); {num_blocks} KV blocks per replica = "
            f"{num_blocks / w.sizing.distinct_blocks:.2f} of the workload's "
            f"{w.sizing.distinct_blocks} distinct prefix blocks."
        )
        print(f"[live] {exp}: {notes[exp]}", flush=True)
        oracle[exp] = simulated_oracle(
            w.sessions, w.prompts, cfg.replicas, num_blocks, cfg.concurrency
        )
    started = start_clusters(cfg, num_blocks)
    cluster_info: dict[str, Any] = {
        "startup_s": started.startup_s,
        "processes": len(started.processes),
        "rss_mb_ready": rss_mb(started.processes),
    }
    try:
        cells = run_cells(cfg, started.targets, workloads, started.gateway_pids)
        cluster_info["rss_mb_end"] = rss_mb(started.processes)
    finally:
        for target in reversed(started.targets.values()):
            target.stop()  # external routers before the cluster they front
    skipped = started.external_skipped
    runs = pool_cells(cells)
    external_router.pool_counts(runs, cells)
    elapsed = time.monotonic() - t0
    data = {
        "kind": "live",
        "config": {**asdict(cfg), "out_dir": str(cfg.out_dir), "run_root": str(cfg.run_root)},
        "elapsed_s": elapsed,
        "cluster": cluster_info,
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
