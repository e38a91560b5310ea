"""Router settings, each with the default the simulation was tuned on (loadtest/simulate.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(slots=True)
class RouterConfig:
    """Thresholds and caps of the router. Every field has a documented default.

    Load is counted in requests in flight: this gateway's own count, plus what other
    gateways had on the replica at its last heartbeat (router/load.py). Figures below
    come from loadtest/simulate.py; "worst" is the worst of 30 runs (five workloads ×
    3 seeds × 2 arrival rates, N=4, each replica caching 30% of the working set):
    cache_aware's hit rate over the oracle's, requests per replica max/mean, total
    time over the oracle's.
    """

    # --- cache_aware ---------------------------------------------------------------
    min_match_blocks: int = 1
    """A prefix match shorter than this many blocks is "no useful match"."""
    load_slack: float = 0.5
    """Queue bound ε: a replica is overloaded when taking one more request would put it
    above ``ceil((1 + ε) · (total_in_flight + 1) / n_replicas) + load_abs_slack`` in
    flight. The same bound drives consistent_hash's skip-to-next-node (Mirrokni et al.,
    consistent hashing with bounded loads). Loose, because the share bound below keeps
    requests per replica even over time: a tight instantaneous cap (ε 0.1, +0, the
    old default) splits overlapping questions on one hot document (doc Q&A hit 0.942×
    the oracle at that setting without the share bound)."""
    load_abs_slack: int = 1
    """Extra requests always allowed above the queue bound."""
    share_slack: float | None = 0.1
    """Share bound ε (None: off): cache_aware also treats a replica as overloaded for
    *new* work (a new conversation, a request without one) once it has taken more than
    ``ceil((1 + ε) · (recent + 1) / n) + share_abs_slack`` of the router's recent
    decisions on new work (the last ``recent_decisions_per_replica`` × replicas). A
    continuing conversation (one this router has routed before) is neither bound nor
    counted: it stays with its history, and only the queue bound can move it. So new
    work is spread evenly, a hot prefix is replicated rather than hoarded, and no
    conversation is moved off its cache for balance.
    Measured (loadtest/simulate.py, worst of 5 workloads × 3 seeds × 2 rates at N=4,
    30% cache: hit ÷ oracle, max/mean requests, time ÷ oracle): these defaults 0.942
    (generated shared prefix; agents/chat/doc Q&A ≥ 0.974), 1.11, 1.05. Counting every
    decision instead of new work only: 0.942, 1.08, 1.08, but in a closed-loop
    simulation shaped like the live benchmark, agents hit 0.95-0.96× against 0.96-0.98×
    and time 1.9-2.0× against 1.6-1.8× the oracle's. Applying the bound to every request
    (ε 0.15 +1, the earlier opt-in form): 0.958, 1.13, 1.06 at N=4, but on small
    workloads spread over many replicas it moved conversations off their history (chat
    hit 0.65 at 64 replicas against 0.90 without a share bound). Off, with the old
    tight queue bound (ε 0.1 +0): 0.904, 1.10, 1.08."""
    share_abs_slack: int = 0
    """Extra decisions always allowed above the share bound. 0: while the window is
    cold, new work goes round the replicas (the first request's replica is over its
    share for the next new one). With every decision counted, a closed-loop simulation
    shaped like the live benchmark (8 sessions at a time, agents and chat, 3 seeds)
    finished in 1.3-2.0× the oracle's time at ε 0.1 +0 against 1.8-2.6× at ε 0.15 +1,
    and +1 put agents' max/mean at 1.20 in the open-loop simulation."""
    recent_decisions_per_replica: int = 32
    """The share bound's window: the last this-many × replicas decisions on new work
    (at ε 0.15 +1 with every request bound, worst: 32 → 0.954, 1.12, 1.05; 64 → 0.958,
    1.14, 1.04)."""

    remembered_conversations: int = 100_000
    """Conversation keys the router remembers having routed (least recently seen
    forgotten first): a conversation it remembers is continuing, exempt from the share
    bound. Each gateway remembers its own: behind several gateways, a conversation's
    first turn through this one counts as new here."""

    load_cost_blocks: float = 2.0
    """cache_aware's price of load, in blocks: among open replicas, score = matched
    blocks − this × (requests in flight above the least loaded open one), so a
    one-block edge is not worth a busier replica but a real prefix is. Worst hit rate
    with the earlier share bound (ε 0.15 +1, no exemption): 0 → 0.942, 2 → 0.963,
    8 → 0.950; without it, at the default seed: 0 → doc Q&A 0.941, 2 → 0.942, 64 →
    0.90-0.94 everywhere."""

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
        slacks = (
            self.load_slack,
            self.load_abs_slack,
            self.share_slack or 0,
            self.share_abs_slack,
            self.load_cost_blocks,
        )
        if min(slacks) < 0:
            raise ValueError(
                "load_slack, load_abs_slack, share_slack, share_abs_slack and"
                " load_cost_blocks must be non-negative"
            )
        if self.remembered_conversations < 0:
            raise ValueError("remembered_conversations must be non-negative")
        if self.recent_decisions_per_replica < 1:
            raise ValueError("recent_decisions_per_replica must be at least 1")
        if self.max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be positive")
        if self.max_deferred_inserts < 1:
            raise ValueError("max_deferred_inserts must be at least 1")
        if self.breaker_failures < 1:
            raise ValueError("breaker_failures must be at least 1")


_OPTIONAL = frozenset({"share_slack"})  # fields that take None ("none" or "off")


def _type_of(value: object) -> type:
    return float if value is None else type(value)


def with_options(config: RouterConfig, options: list[str]) -> RouterConfig:
    """``config`` with ``NAME=VALUE`` settings applied (``--router-option``), each value
    parsed as its field's type (``share_slack=off`` turns the share bound off); a clear
    ValueError for an unknown name or a bad value."""
    # Every field is an int or a float (share_slack: a float, None when off).
    types = {f.name: _type_of(getattr(config, f.name)) for f in fields(config)}
    changes: dict[str, int | float | None] = {}
    for option in options:
        name, sep, raw = option.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(
                f"router option {option!r}: expected NAME=VALUE with NAME one of "
                + ", ".join(sorted(types))
            )
        if name in _OPTIONAL and raw.strip().lower() in ("none", "off"):
            changes[name] = None
            continue
        try:
            changes[name] = types[name](raw.strip())
        except ValueError:
            raise ValueError(
                f"router option {option!r}: {raw.strip()!r} is not a valid {types[name].__name__}"
            ) from None
    return replace(config, **changes)  # type: ignore[arg-type]
