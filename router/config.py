"""Router settings, each with the default the simulation was tuned on (loadtest/simulate.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(slots=True)
class RouterConfig:
    """Thresholds and caps of the router. Every field has a documented default.

    Load is counted in requests in flight: this gateway's own count, plus what other
    gateways had on the replica at its last heartbeat (router/load.py). The defaults
    were tuned in loadtest/simulate.py on five workloads × 3 seeds × 2 arrival rates
    (N=4, each replica caching 30% of the working set); "worst" below is the worst of
    those 30 runs: cache_aware's hit rate over the oracle's, requests per replica
    max/mean, total time over the oracle's.
    """

    # --- cache_aware ---------------------------------------------------------------
    min_match_blocks: int = 1
    """A prefix match shorter than this many blocks is "no useful match"."""
    load_slack: float = 0.5
    """Queue bound ε: a replica is overloaded when taking one more request would put it
    above ``ceil((1 + ε) · (total_in_flight + 1) / n_replicas) + load_abs_slack`` in
    flight. The same bound drives consistent_hash's skip-to-next-node (Mirrokni et al.,
    consistent hashing with bounded loads). With the share bound below keeping the
    long-run balance, this one only stops queues: ε 0.1 with no absolute slack (the
    tuning before the share bound existed) spilled ~10% of doc Q&A requests away from
    their cached document whenever two overlapped (worst hit 0.926)."""
    load_abs_slack: int = 1
    """Extra requests always allowed above the queue bound: with a handful of requests
    in flight, ``ceil`` alone would let no replica take a second one while another
    idles, however long its cached prefix."""
    share_slack: float = 0.15
    """Share bound ε: cache_aware treats a replica as overloaded when it has taken more
    than ``ceil((1 + ε) · (recent + 1) / n_replicas)`` of the router's recent decisions
    (``recent_decisions_per_replica``). Conversations and hot prefixes stick to where
    they are cached; this is what spreads them. Worst (hit, max/mean, time): 0.1 →
    0.950, 1.09, 1.05; 0.15 → 0.963, 1.11, 1.04; 0.2 → 0.958, 1.17, 1.06; 0.3 (window
    16) → 0.967, 1.18, 1.05. Without it (queue bound only, ε 0.1): 0.904, 1.10, 1.08."""
    recent_decisions_per_replica: int = 32
    """The share bound's window: the last this-many × replicas routing decisions
    (at ε 0.15, worst: 32 → 0.954, 1.12, 1.05; 64 → 0.958, 1.14, 1.04)."""

    load_cost_blocks: float = 2.0
    """cache_aware's price of load, in blocks: among open replicas, score = matched
    blocks − this × (requests in flight above the least loaded open one), so a
    one-block edge is not worth a busier replica but a real prefix is. Worst hit rate:
    0 → 0.942, 2 → 0.963, 8 → 0.950."""

    report_ttl_s: float = 3.0
    """How long the requests other gateways had on a replica (its heartbeat's
    ``running + waiting`` less this gateway's own count at the heartbeat's time) still
    count as its load. Replicas report every second; this gateway's own requests always
    count exactly (router/load.py)."""

    # --- ring ----------------------------------------------------------------------
    ring_vnodes: int = 160
    """Virtual nodes per replica on the uhashring ring."""

    # --- index ---------------------------------------------------------------------
    max_blocks_per_replica: int = 1_000_000
    """Index cap per replica; beyond it the replica's least recently used blocks leave
    the index (a few per insert, never a whole-tree walk)."""
    optimistic_ttl_s: float = 30.0
    """An optimistic insert that no ``stored`` event confirms within this window is
    dropped — only for replicas that publish events; for the others (vLLM, SGLang
    without our publisher) the optimistic view is all we have and only the cap bounds
    it."""

    max_deferred_inserts: int = 64
    """Routing decisions record their optimistic insert in a small overlay that matches
    see at once; the index's own bookkeeping for it (nodes, LRU, deadlines: ~6 dict
    operations per block on million-entry tables) is deferred to ``request_finished`` or
    ``sweep``. When this many are waiting anyway, the next decision folds them in."""

    # --- health --------------------------------------------------------------------
    breaker_failures: int = 3
    """Consecutive failures (requests or probes) that open a replica's circuit."""
    breaker_cooldown_s: float = 5.0
    """How long an open circuit stays open before one half-open trial is allowed."""
    replica_ttl_s: float = 15.0
    """A discovered replica whose registry record was not refreshed within this long
    is unhealthy (Redis's key expiry removes it soon after)."""

    def __post_init__(self) -> None:
        if self.min_match_blocks < 1:
            raise ValueError("min_match_blocks must be at least 1")
        if min(self.load_slack, self.load_abs_slack, self.share_slack, self.load_cost_blocks) < 0:
            raise ValueError(
                "load_slack, load_abs_slack, share_slack and load_cost_blocks must be non-negative"
            )
        if self.recent_decisions_per_replica < 1:
            raise ValueError("recent_decisions_per_replica must be at least 1")
        if self.max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be positive")
        if self.recent_decisions_per_replica < 1:
            raise ValueError("recent_decisions_per_replica must be at least 1")
        if self.max_deferred_inserts < 1:
            raise ValueError("max_deferred_inserts must be at least 1")
        if self.breaker_failures < 1:
            raise ValueError("breaker_failures must be at least 1")


def with_options(config: RouterConfig, options: list[str]) -> RouterConfig:
    """``config`` with ``NAME=VALUE`` settings applied (``--router-option``), each value
    parsed as its field's type; a clear ValueError for an unknown name or a bad value."""
    types = {f.name: type(getattr(config, f.name)) for f in fields(config)}
    changes: dict[str, int | float] = {}
    for option in options:
        name, sep, raw = option.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(
                f"router option {option!r}: expected NAME=VALUE with NAME one of "
                + ", ".join(sorted(types))
            )
        try:
            changes[name] = types[name](raw.strip())
        except ValueError:
            raise ValueError(
                f"router option {option!r}: {raw.strip()!r} is not a valid {types[name].__name__}"
            ) from None
    return replace(config, **changes)  # type: ignore[arg-type]
