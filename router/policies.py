"""Routing policies: one small interface, chosen by name.

A policy sees the eligible replicas (healthy, serving the model, not excluded) with their
load, queued prefill tokens, matched prefix depth, uncached tokens and learned cost per
token, and returns one of them with a short reason. Policies
never depend on the order of the candidate list: ties go to the conversation ring, to
load, or to the seeded random generator.
"""

from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar, NamedTuple

from router.config import RouterConfig
from router.load import BusyShare
from router.ring import Ring


class Candidate(NamedTuple):
    replica_id: str
    load: int  # requests in flight there (this gateway's, plus others' reported)
    matched: int = 0  # leading blocks of the request this replica holds
    queued: int = 0  # prefill tokens queued there before this request
    uncached: int = 0  # tokens of this request it would have to compute
    cost: float = 0.0  # its prefill seconds per token (learned, router/cost.py)
    running_s: float = 0.0  # seconds each request in flight there adds (learned)
    # Matched tokens on its host KV tier x their copy cost, in prefill tokens.
    swap_tokens: float = 0.0
    fixed_s: float = 0.0  # seconds every request there pays (learned)
    decode_tokens: int = 0  # decode pressure: prefill tokens each request there is priced

    @property
    def predicted_s(self) -> float:
        """Predicted time to first token there (the cost model, ``CacheAware``)."""
        work = self.queued + self.uncached + self.swap_tokens
        return self.fixed_s + work * self.cost + self.load * self.running_s


class RouteInput(NamedTuple):
    candidates: Sequence[Candidate]  # non-empty
    total_blocks: int
    conversation_key: str | None
    first_key: bytes | None  # the request's first block key (short), when it has one
    last_key: bytes | None = None  # its last full block's key (short)
    # The longest match is still being computed wherever it is held (Router.route).
    prefix_pending: bool = False


class Choice(NamedTuple):
    replica_id: str
    reason: str


class Policy(ABC):
    name: ClassVar[str]

    def __init__(
        self,
        config: RouterConfig,
        ring: Ring,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.ring = ring
        self.rng = rng
        self.clock = clock  # the router's (seconds; a simulated one in the simulator)
        self.setup()

    def setup(self) -> None:
        """Set up the policy's own state, once the shared fields are set (none here)."""
        return None

    @abstractmethod
    def choose(self, request: RouteInput) -> Choice: ...

    def forget(self) -> None:
        """Every replica's prefix cache was reset: drop what was learnt about serving
        the prefixes they held (nothing here; ``CacheAware``: the busy shares)."""
        return None

    # shared helpers ------------------------------------------------------------------

    def load_bound(self, candidates: Sequence[Candidate]) -> int:
        """Most requests a replica may hold after taking this one (bounded load)."""
        total = sum(c.load for c in candidates)
        return _bound(total, len(candidates), self.config.load_slack) + self.config.load_abs_slack

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        low = min(c.load for c in candidates)
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

    def setup(self) -> None:
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
    """Bounded loads (consistent_hash): the most any of ``n`` may hold once one more
    joins ``total``. The least loaded always fits: its count + 1 ≤ ⌈(total + 1) / n⌉."""
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
    """The replica where the request is predicted to start soonest.

    For each candidate replica r (healthy, serving the model, not excluded):

        predicted TTFT(r) = fixed(r) + (queued(r) + uncached(r) + swap(r)) × cost(r)
                            + load(r) × running(r)

    * ``queued(r)``: prefill tokens already waiting or running there (this gateway's
      routed requests until their first byte, less what the oldest of them has had
      time to compute by the fit, ``Router._queued_now``; plus what other gateways had
      there at the replica's last heartbeat, router/load.py);
    * ``uncached(r)``: this request's prompt tokens beyond its prefix cached there;
    * ``swap(r)``: the matched tokens on its host KV tier × ``swap_in_token_cost`` (they
      are copied back to the device, not computed);
    * ``load(r)``: requests in flight there; under continuous batching a new prompt
      joins their steps (it waits for the step under way and shares the next ones);
    * ``fixed(r)`` (s), ``cost(r)`` (s per token), ``running(r)`` (s per request in
      flight): fitted in seconds to the observed times to first byte of every replica,
      each scaled by the replica's own speed factor (router/cost.py: decayed least
      squares, bounded, never negative; before any sample 0, ``prefill_s_per_token``
      and 0, factor 1).

    The choice is the minimum of

        score(r) = predicted TTFT(r)
                   + ((recompute_weight − 1 + stall_weight × load(r)) × uncached(r)
                      + load(r) × decode_tokens_per_request) × cost(r)
                   + load(r) × decode_fixed_parts × fixed(r)

    prices beyond this request's own wait: recomputed tokens count
    ``recompute_weight`` times (default 1.5), because recomputing spends the cluster's
    compute and cache space (``pending_recompute_weight`` times, default 1, for a
    conversation's request on a replica with nothing in flight while the longest match
    is still being computed where it is held: waiting for it gains nothing, the idle
    compute is free, and the conversation would share that replica for all its turns;
    only while idle replicas × (1 − p_new) ≥ ``pending_spare_idle``, p_new the decayed
    share of recent decisions whose prompt no replica held, so that copies leave alone
    the idle replicas that new prompts are expected to need);
    recomputed tokens count ``stall_weight`` more per request in flight there (default
    0: off), because every reply decoding there waits for the prefill's chunks;
    and each request in flight there counts
    ``decode_tokens_per_request`` prefill tokens (default 128), because this request's
    decode steps and theirs share the replica: joining a busy replica slows every reply
    there, which its own first token does not show; ``decode_fixed_parts`` (default 0)
    adds that many fixed parts per request in flight (a step: on a GPU at least the
    weights pass). With weight 1, no decode price and no balance price the choice is the
    plain minimum predicted TTFT.

    Balance price: while some candidate is idle (no request in flight), each busy over
    the mean scores ``balance_tokens`` × (busy(r) − 1 − ``balance_slack``) more prefill
    tokens (none up to 1 + slack: a holder of its share of the prefixes keeps them),
    each idle one under the mean ``balance_tokens`` × (busy(r) − 1) (a credit), busy(r)
    being its recent busy time over the candidates' mean (router/load.py, ``BusyShare``:
    sampled at the last ~``balance_window`` decisions per replica, with a prior, and
    faded by pauses in the traffic; the price grows in over the first
    ``balance_window`` decisions). The greedy rule alone
    never sees the future queue that piling onto a prefix's holder builds: at low load
    the holder is always sooner for this request, and the other replicas stay idle. The
    price makes a busy holder's hit lose to an idle replica's one-time recompute of the
    prefix once the busy gap pays for it (at the defaults, a holder at 2× the mean
    against an idle replica at 0.5×: (0.75 + 0.5) × 2,048 = 2,560 tokens, a 1,707-token
    prefix at ``recompute_weight`` 1.5), after which that replica holds the prefix too
    and takes its share at no recompute: a prefix is copied in proportion to the load it
    brings. A replica under the mean (busy(r) < 1) is credited only while it is idle
    itself: busy, a credit would draw request after request until its queue outgrew the
    credit (a magnet). A continuing conversation moves only when the gap pays for
    recomputing its whole history.
    A long cached prefix wins until its replica's queue costs more than recomputing the
    prefix elsewhere; then the next request goes elsewhere, and
    that replica caches the prefix too (the router's optimistic insert makes it a match
    there at once): hot prefixes are replicated as load needs, not hoarded, and no count
    bound forces requests apart. A continuing conversation follows the same rule.

    Predictions within ``TIE_TOKENS`` tokens' prefill (one block, at the cheapest cost)
    of the best are ties: the conversation ring decides (the conversation key, so every
    gateway agrees; without one, the prompt's last block key, which spreads new
    keyless work), then the least loaded, then the seeded random generator — never list
    order.

    Safety cap: a replica whose queue is over ``queue_cap`` × (the other replicas' mean
    queue + this prompt's tokens) is not chosen while another is (a queue the predictions got wrong,
    e.g. an index that believes blocks the replica has evicted).

    The reason names the decision's kind (``prefix_match``: the chosen replica holds
    the longest match; ``spill``: a longer match elsewhere was predicted slower;
    ``no_match``: nobody holds a block) and states the predictions; ``<kind> balance:``
    when the balance price decided, then with each replica's busy ratio and the one the
    price without it would have chosen; ``spill pending:`` when an idle replica took a
    conversation whose longer match is still being computed elsewhere.
    """

    name = "cache_aware"
    TIE_TOKENS = 16  # one block at the default block size

    def setup(self) -> None:
        config = self.config
        self.busy = BusyShare(config.balance_window, config.balance_pause)
        # Decayed counts behind p_new (``pending_spare_idle``), from a prior of 1/2.
        self.keep = 1.0 - 1.0 / config.balance_window
        self.fresh, self.decisions = 0.5, 1.0

    def forget(self) -> None:
        """The busy shares start afresh: a replica that was busy serving the prefixes a
        reset dropped is no busier for the next ones (kept, the shares would price it
        out of a burst of new conversations, which then stay where the burst put them;
        live, 16 sim replicas: 2 to 4 of them got no chat request after an agents run)."""
        self.busy = BusyShare(self.config.balance_window, self.config.balance_pause)

    def choose(self, request: RouteInput) -> Choice:
        # One plain pass over the candidates, by position (no per-replica dicts): every
        # request runs this (route() latency, docs/BENCHMARKS.md).
        candidates = request.candidates
        config = self.config
        weight = config.recompute_weight - 1.0
        idle_weight = weight  # on a candidate with nothing in flight
        if request.prefix_pending and request.conversation_key is not None:
            idle = sum(1 for c in candidates if not c.load)
            if idle * (1.0 - self.fresh / self.decisions) >= config.pending_spare_idle:
                idle_weight = config.pending_recompute_weight - 1.0
        parts = config.decode_fixed_parts
        stall = config.stall_weight
        # Busy ratios (router/load.py, BusyShare), priced only while some candidate is
        # idle (with none idle, the queue terms balance); recorded at every decision.
        on = config.balance_tokens > 0
        share = self.busy
        busy = [c.replica_id for c in candidates if c.load] if on else []
        balance = prior = per_mean = over = 0.0
        counts = share.counts
        if on:
            share.elapse(self.clock(), len(candidates))  # a pause fades the shares
        if on and len(busy) < len(candidates):
            balance = config.balance_tokens * share.weight
            prior, per_mean = share.terms([c.replica_id for c in candidates])
            over = 1.0 + config.balance_slack  # priced above this ratio
        predicted: list[float] = []
        score: list[float] = []  # the prediction plus the prices (recompute, decode, balance)
        plain: list[float] = []  # the score without the balance price
        longest = candidates[0]
        most_queued = most_uncached = total_queued = 0
        for c in candidates:
            load, cost, uncached, queued = c.load, c.cost, c.uncached, c.queued
            p = c.fixed_s + (queued + uncached + c.swap_tokens) * cost + load * c.running_s
            predicted.append(p)
            recompute = (weight + stall * load) if load else idle_weight
            base = p + (recompute * uncached + load * c.decode_tokens) * cost
            base += load * parts * c.fixed_s
            if balance:
                plain.append(base)
                ratio = (counts.get(c.replica_id, 0.0) + prior) * per_mean
                if ratio > over:
                    base += balance * (ratio - over) * cost
                elif ratio < 1.0 and not load:  # credit only an idle replica (no magnet)
                    base += balance * (ratio - 1.0) * cost
            score.append(base)
            if c.matched > longest.matched:
                longest = c
            total_queued += queued
            if queued > most_queued:
                most_queued = queued
            if uncached > most_uncached:
                most_uncached = uncached
        # The share of recent decisions whose prompt no replica held (pending rule).
        keep = self.keep
        self.fresh = self.fresh * keep + (0.0 if longest.matched else 1.0)
        self.decisions = self.decisions * keep + 1.0
        open_ = self.under_cap(candidates, most_queued, most_uncached, total_queued)
        best = cheapest = plain_best = math.inf
        unbalanced = 0  # the choice without the balance price (when priced)
        for i in open_:
            if score[i] < best:
                best = score[i]
            if candidates[i].cost < cheapest:
                cheapest = candidates[i].cost
            if balance and plain[i] < plain_best:
                plain_best, unbalanced = plain[i], i
        limit = best + self.TIE_TOKENS * cheapest
        tied = [i for i in open_ if score[i] <= limit]
        at = tied[0] if len(tied) == 1 else self.tie_break(candidates, tied, request)
        chosen = candidates[at]
        kind = "spill" if longest.matched > chosen.matched else "prefix_match"
        if kind == "prefix_match" and not chosen.matched:
            kind = "no_match"
        if on:
            if balance and plain[at] > plain_best + self.TIE_TOKENS * cheapest:
                # Without the balance price another replica would have won: it decided.
                ratios = share.ratios([c.replica_id for c in candidates])
                reason = f"{kind} balance: {_said(chosen, predicted[at], request, ratios)}"
                other = candidates[unbalanced]
                reason += f", {_said(other, predicted[unbalanced], request, ratios)}"
                share.decided(busy, chosen.replica_id, len(candidates))
                return Choice(chosen.replica_id, reason)
            share.decided(busy, chosen.replica_id, len(candidates))
        second: int | None = None  # the runner-up the reason names
        if kind == "spill":
            second = candidates.index(longest)
        else:
            for i in range(len(candidates)):
                if i != at and (second is None or score[i] < score[second]):
                    second = i
        # "pending": a longer match is still being computed where it is held, and this
        # idle replica's recompute counted once (pending_recompute_weight).
        how = "pending" if kind == "spill" and idle_weight != weight and not chosen.load else "cost"
        reason = f"{kind} {how}: {_said(chosen, predicted[at], request)}"
        if second is not None:
            reason += f", {_said(candidates[second], predicted[second], request)}"
        return Choice(chosen.replica_id, reason)

    def under_cap(
        self, candidates: Sequence[Candidate], most_queued: int, prompt: int, total: int
    ) -> Sequence[int]:
        """The positions of the candidates whose queue is within ``queue_cap`` × (the
        others' mean queue + the prompt's tokens); all of them if none is. ``prompt``:
        the most uncached tokens among them; ``total``: their queues' sum."""
        n = len(candidates)
        cap = self.config.queue_cap
        everyone = range(n)
        if n == 1 or most_queued <= cap * prompt:
            return everyone  # nobody can be over the cap
        open_ = [
            i
            for i, c in enumerate(candidates)
            if c.queued <= cap * ((total - c.queued) / (n - 1) + prompt)
        ]
        return open_ or everyone

    def tie_break(
        self, candidates: Sequence[Candidate], tied: Sequence[int], request: RouteInput
    ) -> int:
        """The position of the tied candidate the ring (then load, then the seeded
        generator) prefers."""
        key = request.conversation_key
        if key is None and request.last_key is not None:
            key = request.last_key.hex()
        if key is not None:
            ranked = self.ring.rank(key, {candidates[i].replica_id for i in tied})
            if ranked is not None:
                return next(i for i in tied if candidates[i].replica_id == ranked)
        low = min(candidates[i].load for i in tied)
        return self.rng.choice([i for i in tied if candidates[i].load == low])


def _said(
    c: Candidate,
    predicted_s: float,
    request: RouteInput,
    ratio: Mapping[str, float] | None = None,
) -> str:
    """One candidate's prediction as the reason states it (``ratio``: with its recent
    busy time over the mean)."""
    text = f"{c.replica_id} predicted {predicted_s * 1000:,.0f} ms"
    parts = [f"matched {c.matched}/{request.total_blocks}"] if c.matched else []
    if c.queued:
        parts.append(f"queued {c.queued:,} tok")
    if c.load and c.running_s:
        parts.append(f"{c.load} in flight")
    if ratio is not None:
        parts.append(f"busy {ratio[c.replica_id]:.1f}x mean")
    return text + (f" ({', '.join(parts)})" if parts else "")


# Every policy by name, the default first: the one list the gateway's flags offer.
POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (CacheAware, RoundRobin, RandomPolicy, LeastLoaded, PowerOfTwo, ConsistentHash)
    }
)


def make_policy(
    name: str,
    config: RouterConfig,
    ring: Ring,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
) -> Policy:
    try:
        return POLICIES[name](config, ring, rng, clock)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
