"""Router settings, each with its documented default (measured in docs/BENCHMARKS.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace


@dataclass(slots=True)
class RouterConfig:
    """Thresholds and caps of the router. Measurements behind each default:
    docs/BENCHMARKS.md, section "Router cost model (2026-12-01)" (decisions) and
    "Decision latency and index memory" (index)."""

    # --- cache_aware (router/policies.py, CacheAware) ------------------------------
    prefill_s_per_token: float = 0.00015
    """Prefill seconds per uncached token assumed before the router has timed any
    replica (then fitted per replica to its first bytes, router/cost.py). Only streamed
    answers are timed: behind clients that do not stream it is never fitted, so set it
    to the GPU's (docs/BENCHMARKS.md, "Whole answers")."""
    prefill_drain: float = 1.0
    """How fast the prompt a replica is prefilling is taken to progress, as a fraction
    of what the replica's fit predicts (``fixed + cost × tokens`` from when it reached
    the front of this gateway's queue there): its computed tokens leave the router's
    view of that queue before its first byte (``Router._queued_now``). 0 to 100. 0: a
    queued prompt counts whole until its first byte, so a replica looks a long prompt
    deep for all of its prefill (simulator grid, seeds 0-2: worst hit 0.927x the
    oracle's, 0.947x at 1; docs/BENCHMARKS.md, "The prompt being prefilled drains")."""
    recompute_weight: float = 1.5
    """Uncached tokens count this many times in the choice (the queue ahead once): a
    recomputed prefix costs the cluster compute and cache space, a wait does not."""
    pending_recompute_weight: float = 1.0
    """A conversation's request (one with a conversation key) counts its uncached
    tokens this many times instead of ``recompute_weight`` on a replica with nothing in
    flight while the longest match elsewhere is still being computed (there an
    optimistic insert that the replica's events have not confirmed): waiting there for
    the prefix gains no time over computing it here, where the compute would go
    unused, and a conversation placed behind it shares that replica for all its later
    turns. A burst of sessions sharing a system or tool prompt would otherwise pair up
    on the replica that computes it first and wait on each other's steps (live, 16 sim
    replicas: agents TTFT p50 235 -> 175 ms, total time 21.0 -> 19.7 s; the cost, at 64:
    every replica computes a shared system prompt once, chat hit rate 0.96 -> 0.94x the
    oracle's; docs/BENCHMARKS.md, "Pending prefixes"). ``recompute_weight``: off."""
    pending_spare_idle: float = 0.8
    """The pending-prefix rule holds only while the idle replicas are expected to
    outnumber the new prompts that will need them: idle × (1 − p_new) ≥ this, p_new
    being the share of recent decisions (about ``balance_window``, from a prior of one
    half) whose prompt no replica held. A copy of a prompt being computed takes an idle
    replica that a prompt nobody holds would otherwise find; while most arrivals bring
    new prompts (a burst of 4 agent types on 4 replicas), waiting on the holder leaves
    the idle replicas to them (replayed live agents at 4 replicas: total time 20.9 ->
    19.6 s, at 16 19.1 -> 19.4 s, chat unchanged at 4, 16 and 64; live at 4 agents went
    from 4% behind sglang-router to level or ahead; docs/BENCHMARKS.md, "Spare idle
    replicas"). 0: the rule holds on any idle replica."""
    decode_tokens_per_request: int = 128
    """Decode pressure: each request in flight on a replica is priced as this many
    prefill tokens in the choice (joining it slows every reply there), beyond what it
    adds to the predicted time to first token (fitted, router/cost.py)."""
    stall_weight: float = 0.0
    """Prefill stall: each request in flight on a replica waits for this request's
    prefill there (its chunks take the decode steps of every reply beside it), so its
    uncached tokens count this many times more per request in flight. An idle replica
    stalls nobody. Off by default: at 1 the replay gains 1.7-2.3% on documents and the
    simulator grid's worst time improves, but live at 4 replicas documents stay 2.3%
    behind sglang-router and chat's TTFT p50 rises 5% (docs/BENCHMARKS.md, "A prefill
    stall price")."""
    decode_fixed_parts: float = 0.0
    """Each request in flight on a replica is also priced this many fitted fixed parts
    (a step and its overhead, router/cost.py) in the choice: on a GPU a step costs at
    least the weights pass, which a price in prefill tokens does not scale with. 1
    spreads bursts of new conversations more (docs/BENCHMARKS.md: better live TTFT at 4
    replicas, one simulator cell under the hit-rate target); 0 by default."""
    balance_tokens: float = 2048.0
    """Balance price: while some candidate is idle, a replica is priced this many
    prefill tokens × (its recent busy time over the candidates' mean − 1 −
    ``balance_slack``) (router/load.py, ``BusyShare``): a busy holder's cache hit loses
    to an idle replica's one-time recompute of the prefix once the busy gap pays for it
    (a holder at 2× the mean against an idle replica at 0.5×: a prefix of up to ~1,700
    tokens at ``recompute_weight`` 1.5). A replica under the mean is credited
    only while it is idle itself (busy, a credit would draw requests until its queue
    outgrew it). 0 turns it off."""
    balance_slack: float = 0.25
    """Busy time up to (1 + this) × the mean is not priced: a replica that holds its
    share of the prefixes is not pushed to give it away. With fewer hot prefixes than
    replicas (8 agent types on 16 replicas) each holder runs ~1.7× the mean busy time
    while the others idle; priced from the mean, holders copied their tool prompts to
    idle replicas (2,000-token recomputes at a session's start): live, agents took 10%
    longer than with sglang-router (3% with this slack; docs/BENCHMARKS.md, "Balance
    slack")."""
    balance_window: float = 32.0
    """The balance price's memory: about this many recent routing decisions per
    replica (and each replica's prior, so the first decisions do not swing it)."""
    balance_pause: float = 8.0
    """A gap between routing decisions longer than this many usual gaps (a decayed
    mean) and than a second is a pause in the traffic: the busy shares fade as if the
    gap's decisions beyond this many had found every replica idle, so the replicas that
    served the traffic before a pause (and still hold its prefixes) are not priced out
    of the next burst (docs/BENCHMARKS.md, "Pauses in the traffic"). 0 turns the fading
    off."""
    queue_cap: float = 4.0
    """Safety cap: a replica whose queued prefill tokens exceed this × (the other
    replicas' mean queue + the prompt's tokens) is not chosen while another is."""
    swap_in_token_cost: float = 0.1
    """A matched token on a replica's host KV tier is copied back, not computed: it
    counts as this many prefill tokens (a PCIe copy of a token's KV against its
    prefill; the replica's scheduler charges its step budget the same)."""

    # --- consistent_hash -----------------------------------------------------------
    load_slack: float = 0.5
    """consistent_hash's bounded load ε (Mirrokni et al.): a replica holding more than
    ``ceil((1 + ε) · (in flight + 1) / n) + load_abs_slack`` requests is skipped."""
    load_abs_slack: int = 1
    """Extra requests always allowed above consistent_hash's bound."""

    # --- load ----------------------------------------------------------------------
    report_ttl_s: float = 3.0
    """How long what other gateways had on a replica (its heartbeat less this
    gateway's own share at the heartbeat's time, router/load.py) still counts."""

    # --- ring ----------------------------------------------------------------------
    ring_vnodes: int = 160
    """Virtual nodes per replica on the uhashring ring."""

    # --- index ---------------------------------------------------------------------
    max_blocks_per_replica: int = 1_000_000
    """Index cap per replica: beyond it the replica's least recently used blocks leave
    the index, a few per insert."""
    optimistic_ttl_s: float = 30.0
    """An optimistic insert no ``stored`` event confirms within this long is dropped
    (only for replicas that publish events; for others only the cap bounds them)."""
    max_deferred_inserts: int = 64
    """Routing decisions' optimistic inserts wait in a small overlay for the index's
    bookkeeping; when this many wait, the next decision folds them in."""

    # --- health --------------------------------------------------------------------
    breaker_failures: int = 3
    """Consecutive failures (requests or probes) that open a replica's circuit."""
    breaker_cooldown_s: float = 5.0
    """How long an open circuit stays open before one half-open trial is allowed."""
    replica_ttl_s: float = 15.0
    """A discovered replica whose registry record was not refreshed within this long
    is unhealthy (Redis's key expiry removes it soon after)."""

    def __post_init__(self) -> None:
        if not self.prefill_s_per_token > 0:
            raise ValueError("prefill_s_per_token must be positive")
        # Bounded: the elapsed time times a huge factor overflows to inf in route().
        if not 0 <= self.prefill_drain <= 100:
            raise ValueError("prefill_drain must be between 0 and 100")
        if self.recompute_weight < 1:
            raise ValueError("recompute_weight must be at least 1")
        if not self.pending_recompute_weight >= 1:
            raise ValueError("pending_recompute_weight must be at least 1")
        if not self.pending_spare_idle >= 0:
            raise ValueError("pending_spare_idle must be non-negative")
        if self.decode_tokens_per_request < 0:
            raise ValueError("decode_tokens_per_request must be non-negative")
        if not self.decode_fixed_parts >= 0:
            raise ValueError("decode_fixed_parts must be non-negative")
        if not self.balance_tokens >= 0:
            raise ValueError("balance_tokens must be non-negative")
        if not self.balance_slack >= 0:
            raise ValueError("balance_slack must be non-negative")
        if not self.stall_weight >= 0:
            raise ValueError("stall_weight must be non-negative")
        if not self.balance_window >= 1:
            raise ValueError("balance_window must be at least 1")
        if not (self.balance_pause == 0 or self.balance_pause >= 1):
            raise ValueError("balance_pause must be 0 (off) or at least 1")
        if self.queue_cap < 1:
            raise ValueError("queue_cap must be at least 1")
        if min(self.load_slack, self.load_abs_slack) < 0:
            raise ValueError("load_slack and load_abs_slack must be non-negative")
        if self.max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be positive")
        if self.max_deferred_inserts < 1:
            raise ValueError("max_deferred_inserts must be at least 1")
        if self.breaker_failures < 1:
            raise ValueError("breaker_failures must be at least 1")
        if not self.swap_in_token_cost >= 0:
            raise ValueError("swap_in_token_cost must be >= 0")


def with_options(config: RouterConfig, options: list[str]) -> RouterConfig:
    """``config`` with ``NAME=VALUE`` settings applied (``--router-option``), each value
    parsed as its field's type; a clear ValueError for an unknown name or a bad value."""
    types = {f.name: type(getattr(config, f.name)) for f in fields(config)}  # int or float
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
            value = types[name](raw.strip())
            if not math.isfinite(value):  # nan and inf pass every range check below
                raise ValueError
            changes[name] = value
        except ValueError:
            raise ValueError(
                f"router option {option!r}: {raw.strip()!r} is not a valid {types[name].__name__}"
            ) from None
    return replace(config, **changes)  # type: ignore[arg-type]
