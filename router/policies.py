"""Routing policies: one small interface, chosen by name.

A policy sees the eligible replicas (healthy, serving the model, not excluded) with their
load and matched prefix depth, and returns one of them with a short reason. Policies
never depend on the order of the candidate list: ties go to the conversation ring, to
load, or to the seeded random generator.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import ClassVar, NamedTuple

from router.config import RouterConfig
from router.ring import Ring


class Candidate(NamedTuple):
    replica_id: str
    load: int
    matched: int  # leading blocks of the request this replica holds
    recent: int = 0  # how many of the router's recent decisions on new work it took


_LOAD, _MATCHED, _RECENT = (itemgetter(i) for i in (1, 2, 3))  # Candidate fields, C speed


class RouteInput(NamedTuple):
    candidates: Sequence[Candidate]  # non-empty
    total_blocks: int
    conversation_key: str | None
    first_key: bytes | None  # the request's first block key (short), when it has one
    continuing: bool = False  # a conversation this router has routed before


class Choice(NamedTuple):
    replica_id: str
    reason: str


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self, config: RouterConfig, ring: Ring, rng: random.Random) -> None:
        self.config = config
        self.ring = ring
        self.rng = rng

    @abstractmethod
    def choose(self, request: RouteInput) -> Choice: ...

    # shared helpers ------------------------------------------------------------------

    def load_bound(self, candidates: Sequence[Candidate]) -> int:
        """Most requests a replica may hold after taking this one (bounded load)."""
        total = sum(map(_LOAD, candidates))
        return _bound(total, len(candidates), self.config.load_slack) + self.config.load_abs_slack

    def share_bound(self, candidates: Sequence[Candidate], share_slack: float) -> int:
        """Most of the recent decisions on new work a replica may have taken, this one
        included (the caller checks that the share bound is on)."""
        total = sum(map(_RECENT, candidates))
        return _bound(total, len(candidates), share_slack) + self.config.share_abs_slack

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        low = min(map(_LOAD, candidates))
        return self.rng.choice([c for c in candidates if c.load == low])

    def two_choices(self, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) <= 2:
            return self.least_loaded(candidates)
        return self.least_loaded(self.rng.sample(list(candidates), 2))

    def ring_key(self, request: RouteInput) -> str | None:
        if request.conversation_key is not None:
            return request.conversation_key
        return request.first_key.hex() if request.first_key is not None else None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, config: RouterConfig, ring: Ring, rng: random.Random) -> None:
        super().__init__(config, ring, rng)
        self.turn = 0

    def choose(self, request: RouteInput) -> Choice:
        ordered = sorted(request.candidates, key=lambda c: c.replica_id)
        self.turn += 1
        return Choice(ordered[(self.turn - 1) % len(ordered)].replica_id, "round_robin")


class RandomPolicy(Policy):
    name = "random"

    def choose(self, request: RouteInput) -> Choice:
        return Choice(self.rng.choice(list(request.candidates)).replica_id, "random")


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, request: RouteInput) -> Choice:
        return Choice(self.least_loaded(request.candidates).replica_id, "least_loaded")


class PowerOfTwo(Policy):
    name = "power_of_two"

    def choose(self, request: RouteInput) -> Choice:
        return Choice(self.two_choices(request.candidates).replica_id, "least_loaded")


class ConsistentHash(Policy):
    """Ring keyed by the conversation (else the first block); skips overloaded nodes."""

    name = "consistent_hash"

    def choose(self, request: RouteInput) -> Choice:
        key = self.ring_key(request)
        if key is None:
            return Choice(self.two_choices(request.candidates).replica_id, "least_loaded")
        candidates = request.candidates
        bound = self.load_bound(candidates)
        return ring_choice(self, candidates, key, [c for c in candidates if c.load + 1 <= bound])


def _bound(total: int, n: int, slack: float) -> int:
    """Bounded loads: the most any of ``n`` may hold once one more joins ``total``.
    The least loaded always fits: its count + 1 ≤ ⌈(total + 1) / n⌉."""
    return math.ceil((1 + slack) * (total + 1) / n)


def ring_choice(
    policy: Policy, candidates: Sequence[Candidate], key: str, open_: Sequence[Candidate]
) -> Choice:
    """The first replica on the key's ring walk that is open (under the bounds)."""
    open_ids = {c.replica_id for c in open_}
    known = {c.replica_id for c in candidates}
    first: str | None = None
    for replica_id in policy.ring.walk(key):
        if replica_id in open_ids:
            return Choice(replica_id, "ring" if first is None else "ring_skip_overloaded")
        if replica_id in known:
            first = first or replica_id
    # Every candidate is over the bound (or not on the ring): the least loaded one.
    return Choice(policy.least_loaded(candidates).replica_id, "least_loaded")


class CacheAware(Policy):
    """Longest cached prefix wins unless its replica is overloaded, with load priced in
    blocks.

    1. "Open" replicas pass the bounds (consistent hashing with bounded loads,
       Mirrokni et al.):
       * queue: ``load + 1 <= ceil((1+load_slack)·(total+1)/n) + load_abs_slack``
         requests in flight — no replica piles up a queue while others idle;
       * share, for new work: ``recent + 1 <= ceil((1+share_slack)·(recent total+1)/n)
         + share_abs_slack`` of the router's last decisions on new work — no replica
         takes more than its share of new conversations and keyless requests, so the
         queue bound can be loose. A continuing conversation (``RouteInput.continuing``:
         the router has routed it before) is exempt and not counted: it stays with its
         history unless its replica is queued.
       When nobody passes both, the queue bound alone decides.
    2. Among open replicas the highest score wins, score = useful matched blocks −
       ``load_cost_blocks`` × (load − the least open load): a cost model in blocks
       (blocks to recompute vs. requests to wait behind), so a long match is worth a
       short queue but a one-block edge is not worth piling onto a busier replica.
       ``load_cost_blocks = 0``: plain longest match among the open replicas.
    3. A longer match only on overloaded replicas: reason ``overload_fallback``; the
       chosen replica computes the prefix and then holds it too (the router's
       optimistic insert makes it a match there at once), so a hot prefix spreads over
       replicas instead of piling onto one. A longer match on an open replica given up
       for load: ``load_tradeoff``.
    4. Ties: the conversation ring (affinity that every gateway agrees on), else the
       least loaded, else the seeded random generator — never list order.
    5. No useful match anywhere: the conversation ring with bounded load when there is
       a conversation key, else the least loaded of two random choices.
    """

    name = "cache_aware"

    def choose(self, request: RouteInput) -> Choice:
        # One pass per step over the candidates, no generator expressions: this runs on
        # every request (route() latency, docs/BENCHMARKS.md).
        candidates = request.candidates
        config = self.config
        bound = self.load_bound(candidates)
        open_ = [c for c in candidates if c.load < bound]  # load + 1 <= bound; never empty
        if config.share_slack is not None and not request.continuing:
            share = self.share_bound(candidates, config.share_slack)
            open_ = [c for c in open_ if c.recent < share] or open_
        floor = config.min_match_blocks
        best = max(map(_MATCHED, candidates))
        if best < floor:
            if request.conversation_key is not None:
                return ring_choice(self, candidates, request.conversation_key, open_)
            return Choice(self.two_choices(open_).replica_id, "least_loaded")
        w = config.load_cost_blocks
        low = min(map(_LOAD, open_))
        top = -math.inf
        tied: list[Candidate] = []
        for c in open_:
            score = (c.matched if c.matched >= floor else 0) - w * (c.load - low)
            if score > top:
                top, tied = score, [c]
            elif score == top:
                tied.append(c)
        chosen = self.tie_break(tied, request)
        if chosen.matched >= best:
            return Choice(
                chosen.replica_id, f"prefix_match {chosen.matched}/{request.total_blocks} blocks"
            )
        if max(map(_MATCHED, open_)) < best:
            return Choice(chosen.replica_id, "overload_fallback")
        return Choice(chosen.replica_id, "load_tradeoff")

    def tie_break(self, tied: Sequence[Candidate], request: RouteInput) -> Candidate:
        if len(tied) == 1:
            return tied[0]
        if request.conversation_key is not None:
            ranked = self.ring.rank(request.conversation_key, {c.replica_id for c in tied})
            if ranked is not None:
                return next(c for c in tied if c.replica_id == ranked)
        return self.least_loaded(tied)


# Every policy by name, the default first: the one list the gateway's flags offer.
POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (CacheAware, RoundRobin, RandomPolicy, LeastLoaded, PowerOfTwo, ConsistentHash)
    }
)


def make_policy(name: str, config: RouterConfig, ring: Ring, rng: random.Random) -> Policy:
    try:
        return POLICIES[name](config, ring, rng)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
