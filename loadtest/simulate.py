"""Deterministic cluster simulation: the real ``PrefixCache`` per replica, the real
``Router``, and a compute queue per replica, on a simulated clock. No model, no HTTP.

* ``sim_cost.CostModel``: what prefill and decode cost;
* ``sim_replica.SimReplica``: one replica's queue, prefill, decode batch and cache, whose
  block events reach the router as Redis would deliver them;
* ``sim_client``: the token space (word ids, seeded replies) and each conversation;
* ``sim_cluster.SimCluster``: the event loop that sends turns and routes them;
* here: ``simulate`` (one policy) and ``run_comparison`` (the oracle, then each policy),
  with their results; ``sim_grid`` is the command line over a grid of runs.

The oracle is one replica with N× the blocks and ``scale = N``: prefill N× faster,
batches N× larger for the same step time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loadtest.sim_client import BLOCK_SIZE, MODEL_ID, WordTokenizer, reply_tokens
from loadtest.sim_cluster import SimCluster
from loadtest.sim_cost import CostModel
from loadtest.workloads import Session
from router.config import RouterConfig
from router.protocol import block_keys, root_key


class SimServed(NamedTuple):
    """One request as the simulator served it (times in simulated seconds)."""

    session_id: str
    turn: int
    arrival_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    replica: str


@dataclass(slots=True)
class SimResult:
    """One simulated run of one policy (or the oracle)."""

    policy: str
    n_replicas: int
    blocks_per_replica: int
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens, whole cluster
    host_hit_rate: float  # of which found on the replicas' host tiers
    requests_per_replica: list[int]
    busy_s_per_replica: list[float]
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    total_time_s: float
    decisions: dict[str, int]
    served: list[SimServed] = field(default_factory=list)  # in first-token order

    @property
    def load_imbalance(self) -> float:
        """max/mean requests per replica (1.0 = perfectly even)."""
        mean = statistics.fmean(self.requests_per_replica)
        return max(self.requests_per_replica) / mean if mean else 1.0

    @property
    def busy_imbalance(self) -> float:
        """max/mean busy time per replica (1.0 = perfectly even)."""
        mean = statistics.fmean(self.busy_s_per_replica)
        return max(self.busy_s_per_replica) / mean if mean else 1.0

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "replicas": self.n_replicas,
            "hit_rate": round(self.hit_rate, 4),
            "host_hit_rate": round(self.host_hit_rate, 4),
            "max/mean": round(self.load_imbalance, 3),
            "busy max/mean": round(self.busy_imbalance, 3),
            "ttft_p50_s": round(self.ttft_p50_s, 3),
            "ttft_p99_s": round(self.ttft_p99_s, 3),
            "total_s": round(self.total_time_s, 1),
        }


def simulate(
    sessions: Sequence[Session],
    policy: str,
    n_replicas: int,
    blocks_per_replica: int,
    cost_model: CostModel | None = None,
    *,
    compute_scale: float = 1.0,
    think_s: float = 1.0,
    seed: int = 0,
    config: RouterConfig | None = None,
    concurrency: int | None = None,
    prompts: Sequence[Sequence[list[int]]] | None = None,
    conversation_keys: bool = True,
    host_blocks_per_replica: int = 0,
    replica_ids: Sequence[str] | None = None,
    shared_cache: bool = False,
    whole_answers: bool = False,
) -> SimResult:
    """Run ``sessions`` through ``n_replicas`` replicas routed by ``policy``; open loop
    (each session at its arrival time), or closed loop with ``concurrency`` sessions at a
    time. ``prompts``: each session's turns as whole prompts of token ids (else built
    from the sessions' words). ``conversation_keys``: route with each session's id as
    its conversation key (False: as clients that send none). ``host_blocks_per_replica``:
    a host KV tier of that many blocks per replica (0: none). ``replica_ids``: the
    replicas' names, which place conversations on the router's ring (default
    ``replica-<i>``). ``shared_cache``: the replicas share one cache of N× the blocks
    (``SimCluster``), a reference for what partitioning the cache costs.
    ``whole_answers``: clients that do not stream (the router sees no first output)."""
    sim = SimCluster(
        sessions,
        policy,
        n_replicas,
        blocks_per_replica,
        cost_model or CostModel(),
        scale=compute_scale,
        think_s=think_s,
        seed=seed,
        config=config,
        concurrency=concurrency,
        prompts=prompts,
        conversation_keys=conversation_keys,
        host_blocks_per_replica=host_blocks_per_replica,
        replica_ids=replica_ids,
        shared_cache=shared_cache,
        whole_answers=whole_answers,
    )
    sim.run()
    ttfts = sorted(sim.ttfts)
    for replica in sim.replicas:
        replica.cache.check_invariants()
        assert not replica.queue and not replica.prefilling and not replica.running
    sim.router.check_invariants()
    drained = [(v.in_flight, v.load.queued_tokens) for v in sim.router.replicas.values()]
    assert all(d == (0, 0) for d in drained), drained
    return SimResult(
        policy=f"shared:{policy}" if shared_cache else policy,
        n_replicas=n_replicas,
        blocks_per_replica=blocks_per_replica,
        requests=len(ttfts),
        hit_rate=sim.cached_tokens / sim.prompt_tokens if sim.prompt_tokens else 0.0,
        host_hit_rate=sim.host_cached_tokens / sim.prompt_tokens if sim.prompt_tokens else 0.0,
        requests_per_replica=[r.requests for r in sim.replicas],
        busy_s_per_replica=[r.busy_s for r in sim.replicas],
        ttft_p50_s=_percentile(ttfts, 0.5),
        ttft_p99_s=_percentile(ttfts, 0.99),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        total_time_s=sim.now,
        decisions=dict(sim.router.stats()["decisions"]),
        served=[
            SimServed(
                r.conv.session.session_id,
                r.turn,
                r.arrival,
                r.first_token_at - r.arrival,
                len(r.tokens),
                r.cached,
                r.host_cached,
                sim.replicas[r.replica].replica_id,
            )
            for r in sim.served
        ],
    )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def working_set_blocks(sessions: Sequence[Session], max_reply: bool = True) -> int:
    """Distinct full blocks over every prompt and reply of the workload."""
    tokenizer, root = WordTokenizer(), root_key(MODEL_ID, BLOCK_SIZE)
    seen: set[bytes] = set()
    for session in sessions:
        tokens = tokenizer.encode(session.system)
        for i, turn in enumerate(session.turns):
            tokens = tokens + tokenizer.encode(turn.user)
            if max_reply:
                tokens = tokens + reply_tokens(session.session_id, i, turn.max_tokens)
        seen.update(block_keys(tokens, BLOCK_SIZE, root))
    return len(seen)


def run_comparison(
    sessions: Sequence[Session],
    policies: Sequence[str] = ("cache_aware", "round_robin", "consistent_hash"),
    n_replicas: int = 4,
    cache_fraction: float = 0.3,
    cost_model: CostModel | None = None,
    *,
    blocks_per_replica: int | None = None,
    think_s: float = 1.0,
    seed: int = 0,
    config: RouterConfig | None = None,
    concurrency: int | None = None,
    prompts: Sequence[Sequence[list[int]]] | None = None,
    conversation_keys: bool = True,
    host_blocks_per_replica: int = 0,
    shared: Sequence[str] = (),
) -> list[SimResult]:
    """The oracle (one replica, N× blocks, host blocks and compute) first, then each
    policy, then each of ``shared`` on N replicas that share one cache (``simulate``'s
    ``shared_cache``: the oracle's cache, each replica its own compute).

    Each replica holds ``cache_fraction`` of the workload's working set unless
    ``blocks_per_replica`` is given."""
    if blocks_per_replica is None:
        blocks_per_replica = max(64, int(cache_fraction * working_set_blocks(sessions)))
    cost = cost_model or CostModel()
    oracle = simulate(
        sessions,
        "round_robin",
        1,
        blocks_per_replica * n_replicas,
        cost,
        compute_scale=n_replicas,
        think_s=think_s,
        seed=seed,
        concurrency=concurrency,
        prompts=prompts,
        host_blocks_per_replica=host_blocks_per_replica * n_replicas,
    )
    oracle.policy = "oracle"
    results = [oracle]
    for policy, shared_cache in [*((p, False) for p in policies), *((p, True) for p in shared)]:
        results.append(
            simulate(
                sessions,
                policy,
                n_replicas,
                blocks_per_replica,
                cost,
                think_s=think_s,
                seed=seed,
                config=config,
                concurrency=concurrency,
                prompts=prompts,
                conversation_keys=conversation_keys,
                host_blocks_per_replica=host_blocks_per_replica,
                shared_cache=shared_cache,
            )
        )
    return results
