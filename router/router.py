"""The router facade the gateway and the simulator use: replicas in, one decision out.

State: replica views (address, load in requests and queued tokens, learned TTFT fit,
breaker, this gateway's unfinished requests), the prefix index, the conversation ring,
and per replica the sequence number of the last block event applied. Decisions are
synchronous and cheap (no I/O); router/sync.py feeds events, snapshots, loads and other
gateways' hints in from Redis.

A request's life as the gateway reports it (each call once; later calls do nothing):

    decision = route(keys, conversation, prompt_tokens=n)      # who, and the prediction
    request = request_started(decision.replica_id, decision.uncached_tokens,
                              decision.queued_tokens)          # its tokens join the queue
    first_byte(request)                                        # they leave it; TTFT learned
    request_finished(request, ok=...)                          # answered / failed / cancelled
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import Any, Literal, NamedTuple

from router.config import RouterConfig
from router.cost import SPEED_AFTER, ReplicaSpeed, TtftFit
from router.health import CircuitBreaker
from router.index import PrefixIndex
from router.load import InFlight, LoadTracker
from router.policies import Candidate, RouteInput, make_policy
from router.protocol import (
    SHORT_KEY_BYTES,
    BlockEvent,
    Medium,
    ReplicaLoad,
    RoutedHint,
    Snapshot,
)
from router.ring import Ring

# Called with each decision's replica and the prompt's keys past its matched depth: the
# blocks it was not known to hold (the rest, other gateways know from its events).
RoutedHook = Callable[[str, list[bytes]], None]
_SHORT = itemgetter(slice(0, SHORT_KEY_BYTES))  # full block key -> short key


class NoHealthyReplica(RuntimeError):
    """No replica is healthy, serves the model and is not excluded."""


class Decision(NamedTuple):
    replica_id: str
    reason: str  # its first word is the kind: "prefix_match", "spill", "no_match", "ring", ...
    matched_blocks: int
    total_blocks: int
    uncached_tokens: int = 0  # predicted: the prompt's tokens the replica must compute
    queued_tokens: int = 0  # predicted: prefill tokens queued there ahead of it


@dataclass(slots=True)
class ReplicaView:
    replica_id: str
    url: str
    model: str
    block_size: int
    static: bool
    breaker: CircuitBreaker
    speed: ReplicaSpeed
    load: LoadTracker = field(default_factory=LoadTracker)
    # This gateway's requests there that have not finished (insertion order: oldest first).
    requests: dict[InFlight, None] = field(default_factory=dict)
    # The oldest of those still waiting for their first byte with tokens to compute:
    # the prompt the replica is taken to be prefilling (it takes prompts in arrival
    # order), since ``head_since`` (router clock; ``Router.route`` drains it).
    head: InFlight | None = None
    head_since: float = 0.0
    last_seen: float = 0.0  # last registry record / heartbeat (discovered replicas)
    ttl_s: float = 15.0
    publishes_events: bool = False  # seen an event or snapshot: optimistic inserts expire
    last_seq: int | None = None  # last block event folded into the index
    cleared_seq: int | None = None  # the last ``cleared`` event folded in
    # Its other served names (its /v1/models) -> the model id of their block keys: an
    # alias (vLLM's several --served-model-name) shares ``model``'s cache and keys, a
    # LoRA adapter has keys of its own (a model of its own, as the bridge publishes it).
    names: dict[str, str] = field(default_factory=dict)
    # The engine's data-parallel rank this replica is (``ReplicaInfo.data_parallel_rank``):
    # several replicas share ``url`` then, and each request names its rank.
    data_parallel_rank: int | None = None
    # A vLLM paused or asleep (its /pause or /sleep): it answers /health and takes
    # requests, but runs none until it resumes, so it gets none (gateway/probes.py).
    paused: bool = False

    @property
    def expired(self) -> bool:
        return not self.static and self.breaker.clock() - self.last_seen > self.ttl_s

    @property
    def healthy(self) -> bool:
        return not self.expired and not self.paused and self.breaker.allows()

    @property
    def in_flight(self) -> int:
        return self.load.in_flight

    @property
    def reported(self) -> ReplicaLoad | None:
        return self.load.reported

    @property
    def breaker_state(self) -> str:
        return self.breaker.state

    def serves(self, model: str | None) -> bool:
        return model is None or not self.model or self.model == model or model in self.names

    def key_model(self, model: str) -> str:
        """The model id of the block keys of requests for ``model``, a name it serves."""
        return self.names.get(model, model)


class Router:
    def __init__(
        self,
        config: RouterConfig | None = None,
        policy: str = "cache_aware",
        *,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        probe_first: bool = False,
    ) -> None:
        """``probe_first``: replicas start ``unknown`` and take no traffic until a probe
        succeeds (``report_probe``); for a caller that probes, such as the gateway."""
        self.config = config or RouterConfig()
        self.clock = clock
        self.probe_first = probe_first
        self.ring = Ring(self.config.ring_vnodes)
        self.policy = make_policy(policy, self.config, self.ring, random.Random(seed), self.clock)
        self.index = PrefixIndex(self.config.max_blocks_per_replica)
        self._replicas: dict[str, ReplicaView] = {}
        self._hooks: list[RoutedHook] = []
        self._decisions: Counter[str] = Counter()
        # Learned from every replica's first bytes, scaled by each replica's speed.
        self.cluster_cost = TtftFit(self.config.prefill_s_per_token)
        self._expired_optimistic = 0
        self._resyncs = 0

    # ----------------------------------------------------------------------- replicas

    def add_replica(
        self,
        replica_id: str,
        url: str,
        model: str = "",
        block_size: int = 16,
        *,
        static: bool = False,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Add a replica, or refresh its address/model and heartbeat if already known.

        A replica given statically by URL (named after its address) that later registers
        in Redis under its own id is one replica, not two: the static entry gives way to
        the registered id, which stays static (it never expires). The data-parallel ranks
        of one engine share its URL and are replicas of their own: once they register, they
        stand for a static entry of that URL, which gives way to them."""
        ranks = self._ranks_at(url)
        if static and data_parallel_rank is None and ranks:
            for rank in ranks:  # the engine, given by URL, is these ranks
                rank.static = True
                rank.model = rank.model or model
            return
        alias = self._alias(replica_id, url, data_parallel_rank)
        known_health: CircuitBreaker | None = None  # the same replica's, under its other id
        if data_parallel_rank is not None and alias is None:
            alias = self._alias(replica_id, url, None)  # the whole engine, given by URL
            if alias is not None and not self._replicas[alias].static:
                alias = None  # a bridge for the whole engine: a replica of its own
        if alias is not None and static:
            # Already known under its registered id: that entry becomes static.
            replica_id, static = alias, True
            url = self._replicas[alias].url
            model = model or self._replicas[alias].model
        elif alias is not None and self._replicas[alias].static:
            known_health = self._replicas[alias].breaker
            self.remove_replica(alias)
            static = True
        # The other ranks of an engine given statically are static: so is this one.
        static = static or any(v.static for v in ranks)
        view = self._replicas.get(replica_id)
        if view is None:
            breaker = known_health or CircuitBreaker(
                self.config.breaker_failures,
                self.config.breaker_cooldown_s,
                self.clock,
                state="unknown" if self.probe_first else "closed",
            )
            view = ReplicaView(
                replica_id,
                url,
                model,
                block_size,
                static,
                breaker,
                ReplicaSpeed(),
                LoadTracker(self.config.report_ttl_s),
                ttl_s=self.config.replica_ttl_s,
            )
            self._replicas[replica_id] = view
            self.ring.add(replica_id)
        view.url, view.model, view.block_size = url, model, block_size
        view.data_parallel_rank = data_parallel_rank
        view.static = view.static or static
        view.last_seen = self.clock()

    def set_names(self, replica_id: str, names: dict[str, str]) -> None:
        """The replica's other served names (``ReplicaView.names``), as it lists them."""
        view = self._replicas.get(replica_id)
        if view is not None:
            view.names = {name: key for name, key in names.items() if name != view.model}

    def _ranks_at(self, url: str) -> list[ReplicaView]:
        """The data-parallel ranks registered at this address."""
        wanted = _normal_url(url)
        return [
            view
            for view in self._replicas.values()
            if view.data_parallel_rank is not None and _normal_url(view.url) == wanted
        ]

    def _alias(self, replica_id: str, url: str, data_parallel_rank: int | None) -> str | None:
        """The id of another replica at the same address and rank, if any."""
        wanted = _normal_url(url)
        for other_id, view in self._replicas.items():
            if (
                other_id != replica_id
                and _normal_url(view.url) == wanted
                and view.data_parallel_rank == data_parallel_rank
            ):
                return other_id
        return None

    def remove_replica(self, replica_id: str) -> None:
        """Forget the replica: it leaves the ring and the index."""
        self._replicas.pop(replica_id, None)
        self.ring.remove(replica_id)
        self.index.drop_replica(replica_id)

    @property
    def replicas(self) -> dict[str, ReplicaView]:
        return dict(self._replicas)

    # ----------------------------------------------------------------------- decisions

    def route(
        self,
        keys: Sequence[bytes],
        conversation_key: str | None = None,
        *,
        model: str | None = None,
        exclude: Collection[str] = (),
        prompt_tokens: int | None = None,
    ) -> Decision:
        """The replica for a prompt whose block keys are ``keys``: short ones, as the
        gateway computes them (``KeySpace.short_keys``), or full ones, cut down here.
        Copied either way: the optimistic insert keeps the list. ``prompt_tokens``: the
        prompt's length (None: its full blocks only), for the uncached-token prediction.
        """
        short = list(map(_SHORT, keys)) if keys and len(keys[0]) > SHORT_KEY_BYTES else list(keys)
        now = self.clock()
        views = [
            v
            for v in self._replicas.values()
            if (v.static or now - v.last_seen <= v.ttl_s)  # not expired, inlined (hot path)
            and (v.breaker.state == "closed" or v.breaker.allows())
            and not v.paused
            and (model is None or v.serves(model))
            and v.replica_id not in exclude
        ]
        if not views:
            raise NoHealthyReplica(
                f"no healthy replica for model {model!r}"
                + (f" (excluded: {sorted(exclude)})" if exclude else "")
            )
        index = self.index
        if index.pending >= self.config.max_deferred_inserts:
            index.fold()  # nobody folded lately (no request finished, no sweep): catch up
        matches = index.depths(index.lookup(short))
        cluster = self.cluster_cost
        per_token, per_running, fixed = cluster.s_per_token, cluster.s_per_running, cluster.fixed_s
        swap = self.config.swap_in_token_cost
        drain = self.config.prefill_drain
        decode = self.config.decode_tokens_per_request
        candidates = []
        for v in views:
            matched = matches.get(v.replica_id, 0)
            length = len(short) * v.block_size if prompt_tokens is None else prompt_tokens
            k = v.speed.factor
            load = v.load
            queued = load.queued
            head = v.head
            if head is not None:  # inlined ``_queued_now`` (hot path)
                done = int(((now - v.head_since) * drain - fixed * k) / (per_token * k))
                if done > 0:
                    queued -= min(head.uncached_tokens, done)
            candidates.append(
                Candidate(
                    v.replica_id,
                    load.load,
                    matched,
                    queued,
                    max(1, length - matched * v.block_size),  # at least one token computed
                    per_token * k,
                    per_running * k,
                    swap * index.host_blocks(v.replica_id, short[:matched]) * v.block_size
                    if matched
                    else 0.0,
                    fixed * k,
                    decode,
                )
            )
        request = RouteInput(
            candidates,
            len(short),
            conversation_key,
            short[0] if short else None,
            short[-1] if short else None,
            # Only a conversation's request reads it (CacheAware): skip the lookup for others.
            conversation_key is not None and bool(matches) and self._pending(short, matches),
        )
        choice = self.policy.choose(request)
        chosen = self._replicas[choice.replica_id]
        chosen.breaker.on_dispatch()
        matched = matches.get(chosen.replica_id, 0)
        if short:  # optimistic insert, visible at once, bookkeeping deferred (index.fold)
            index.insert_later(
                chosen.replica_id, short, now + self.config.optimistic_ttl_s, held=matched
            )
        self._decisions[choice.reason.split(" ", 1)[0]] += 1
        for hook in self._hooks:
            hook(chosen.replica_id, short[matched:])
        picked = next(c for c in candidates if c.replica_id == choice.replica_id)
        return Decision(
            choice.replica_id, choice.reason, matched, len(short), picked.uncached, picked.queued
        )

    def _pending(self, short: Sequence[bytes], matches: dict[str, int]) -> bool:
        """Whether the longest match is still being computed wherever it is held: each
        replica holding it that deep holds its last block only by an optimistic insert,
        and publishes events (without events no insert is ever confirmed)."""
        deepest = max(matches.values())
        key = short[deepest - 1]
        for replica_id, depth in matches.items():
            if depth == deepest:
                view = self._replicas.get(replica_id)
                if view is None or not view.publishes_events:
                    return False
                if not self.index.unconfirmed(replica_id, key):
                    return False
        return True

    def add_routed_hook(self, hook: RoutedHook) -> None:
        self._hooks.append(hook)

    # ----------------------------------------------------------------------- load, health

    def request_started(
        self, replica_id: str, uncached_tokens: int = 0, queued_tokens: int = 0
    ) -> InFlight:
        """A request was sent to the replica, predicted (``Decision.uncached_tokens``,
        ``Decision.queued_tokens``) to compute ``uncached_tokens`` behind
        ``queued_tokens``. Its tokens count in the replica's queue until ``first_byte``
        or ``request_finished``, whichever comes first; pass the handle to both."""
        request = InFlight(replica_id, max(0, uncached_tokens), max(0, queued_tokens), self.clock())
        view = self._replicas.get(replica_id)
        if view is not None:
            request.running = view.load.load
            view.requests[request] = None
            view.load.started(request.uncached_tokens)
            if view.head is None and request.uncached_tokens:
                view.head, view.head_since = request, request.started_at
        else:
            request.queued, request.done = False, True  # nothing to account for
        return request

    def first_byte(self, request: InFlight) -> None:
        """The replica sent the request's first byte: its prefill is done. Its tokens
        leave the queue and its time to first byte teaches the replica's TTFT fit.
        Only the first call counts."""
        if not request.queued:
            return
        request.queued = False
        view = self._replicas.get(request.replica_id)
        if view is None or request not in view.requests:
            return
        view.load.first_byte(request.uncached_tokens)
        if view.head is request:
            self._next_head(view)
        tokens = request.queued_tokens + request.uncached_tokens
        ttft_s = self.clock() - request.started_at
        # The cluster's fit is of a speed-1 replica: each sample divided by its replica's
        # factor; the factor is the replica's ratio to that fit, once it has a shape.
        cluster = self.cluster_cost
        cluster.observe(tokens, request.running, ttft_s / view.speed.factor)
        if cluster.samples > SPEED_AFTER:
            view.speed.observe(ttft_s, cluster.predict(tokens, request.running))

    def request_finished(self, request: InFlight | str, *, ok: bool | None) -> None:
        """The replica is done with a request (answered, failed, or cancelled); ``ok``
        is the breaker's verdict, None when the outcome alone proves nothing
        (router/health.py: fault attribution; a verdict found later goes to
        ``record_outcome``). Only the first call counts. A replica id in place of the
        handle ends that replica's oldest unfinished request."""
        if isinstance(request, str):
            view = self._replicas.get(request)
            oldest = next(iter(view.requests), None) if view is not None else None
            if view is not None:
                view.breaker.record(ok)
            if oldest is not None:
                self._finish(oldest)
        elif not request.done:
            view = self._replicas.get(request.replica_id)
            if view is not None and request in view.requests:
                view.breaker.record(ok)
            self._finish(request)
        # The deferred optimistic inserts are folded in here, after a response, rather
        # than on some later request's routing decision.
        self.index.fold()

    def _finish(self, request: InFlight) -> None:
        request.done = True
        view = self._replicas.get(request.replica_id)
        if view is not None and view.requests.pop(request, 0) is None:  # it was there
            view.load.finished(request.uncached_tokens if request.queued else 0)
            if view.head is request:
                self._next_head(view)
        request.queued = False

    def _queued_now(self, view: ReplicaView) -> int:
        """The prefill tokens queued at the replica now, as far as this gateway can tell:
        its load's count, less what the prompt it is prefilling has computed
        (``_drained``). Without it, a replica prefilling a long prompt looks that
        prompt's full length deep until its first byte, and the next request for a
        prefix it holds is copied elsewhere to dodge a queue that is nearly gone
        (docs/BENCHMARKS.md, "The prompt being prefilled drains")."""
        return view.load.queued - self._drained(view, self.clock())

    def _drained(self, view: ReplicaView, at: float) -> int:
        """How many of its tokens the prompt the replica is prefilling (``head``) had
        computed at router time ``at``, by the replica's fit: a prompt at the front
        takes ``fixed + cost × tokens``, so after ``t`` seconds there ``(t − fixed) /
        cost`` are done; at most its own tokens."""
        head = view.head
        if head is None or at <= view.head_since:
            return 0
        k, fit = view.speed.factor, self.cluster_cost
        elapsed = (at - view.head_since) * self.config.prefill_drain
        done = int((elapsed - fit.fixed_s * k) / (fit.s_per_token * k))
        return min(head.uncached_tokens, done) if done > 0 else 0

    def _next_head(self, view: ReplicaView) -> None:
        """The head left the queue (first byte, failure, cancellation): the next request
        in order with tokens to compute is taken to start its prefill now."""
        view.head = next((r for r in view.requests if r.queued and r.uncached_tokens), None)
        view.head_since = self.clock()

    def report_probe(self, replica_id: str, ok: bool) -> None:
        view = self._replicas.get(replica_id)
        if view is not None:
            view.breaker.record(ok)

    def report_paused(self, replica_id: str, paused: bool) -> bool:
        """Whether the replica is paused (its engine runs no request until it resumes);
        True when that changed."""
        view = self._replicas.get(replica_id)
        if view is None or view.paused == paused:
            return False
        view.paused = paused
        return True

    def record_outcome(self, replica_id: str, ok: bool) -> None:
        """A verdict on a finished request that was open when it finished (a 5xx that
        another replica's answer shows to be the replica's fault)."""
        view = self._replicas.get(replica_id)
        if view is not None:
            view.breaker.record(ok)

    def update_load(self, replica_id: str, load: ReplicaLoad, at: float | None = None) -> None:
        """A heartbeat: the replica's reported load, stamped ``at`` by its wall clock
        (None: as of now; router/load.py); also refreshes its registry age."""
        view = self._replicas.get(replica_id)
        if view is not None:
            # The report counts what the replica had left of this gateway's prompts, so
            # what this gateway's view had drained by the report's time is not the
            # others' (the report's time is on the load's wall clock, the drain's on the
            # router's).
            now, wall = self.clock(), view.load.clock()
            view.load.report(
                load, at, drained=lambda t: self._drained(view, now - max(0.0, wall - t))
            )
            view.last_seen = now

    # ----------------------------------------------------------------------- index feed

    def apply_event(self, replica_id: str, event: BlockEvent) -> bool:
        """Fold one block event in; False on a sequence gap (the caller resyncs)."""
        view = self._replicas.get(replica_id)
        if view is None:
            return True
        place = self._place(view, event.seq)
        if place != "next":
            return place == "seen"
        if event.type == "stored":
            self.index.insert(replica_id, event.keys, medium=event.medium)
        elif event.type == "removed":
            self.index.remove(replica_id, event.keys)
        else:
            self.index.clear(replica_id)
            view.cleared_seq = event.seq
        view.last_seq = event.seq
        view.publishes_events = True
        return True

    def skip_event(self, replica_id: str, seq: int) -> bool:
        """An event this gateway could not read (a newer replica's kind, say) takes its
        place in the sequence and changes nothing, so the view may lag the replica's
        cache until its next resync. Treated as a gap instead, it would bring a resync
        at every poll: the snapshot is older than the event, and the stream still holds
        it. False on a sequence gap."""
        view = self._replicas.get(replica_id)
        if view is None:
            return True
        place = self._place(view, seq)
        if place == "next":
            view.last_seq = seq
        return place != "gap"

    def _place(self, view: ReplicaView, seq: int) -> Literal["next", "seen", "gap"]:
        """Where event ``seq`` falls in the replica's sequence: the next one, one
        already folded in (e.g. via the snapshot), or past a gap (counted)."""
        if view.last_seq is None or seq == view.last_seq + 1:
            return "next"
        if seq <= view.last_seq:
            return "seen"
        self._resyncs += 1
        return "gap"

    def apply_snapshot(self, replica_id: str, snapshot: Snapshot) -> None:
        """Replace the replica's view with its snapshot (as of event ``snapshot.seq``)."""
        runs = [
            (medium, [block.key for block in run])
            for medium, run in groupby(snapshot.blocks, key=attrgetter("medium"))
        ]
        for _ in self.snapshot_steps(replica_id, snapshot.seq, reversed(runs)):
            pass

    def snapshot_steps(
        self, replica_id: str, seq: int, runs: Iterable[tuple[Medium, Sequence[bytes]]]
    ) -> Iterator[None]:
        """Replace the replica's view with a snapshot as of event ``seq``, given as runs of
        blocks in one tier, last run first (``router.protocol.snapshot_runs``), yielding
        after each run: a caller on an event loop lets it run between them (a million
        blocks take seconds). Meanwhile the view holds the runs inserted so far, and a
        replica removed meanwhile ends it.

        Last run first: an insert makes its first key the newest, so parents end up newer
        than their children across runs and tiers, as the index keeps them
        (router/index.py)."""
        view = self._replicas.get(replica_id)
        if view is None:
            return
        self.index.clear(replica_id)
        for medium, keys in runs:
            yield
            if self._replicas.get(replica_id) is not view:
                return
            self.index.insert(replica_id, keys, medium=medium)
        if view.cleared_seq is not None and seq < view.cleared_seq:
            view.cleared_seq = None  # an older replica, restarted, numbered its events from 1 again
        view.last_seq = seq
        view.publishes_events = True

    def reset_replica_view(self, replica_id: str) -> None:
        """Forget what the replica holds and accept its next event as a new start (a
        resync without a snapshot)."""
        view = self._replicas.get(replica_id)
        if view is not None:
            self.index.clear(replica_id)
            view.last_seq = None

    def forget_cached_state(self, replica_ids: Iterable[str] | None = None) -> None:
        """After a prefix cache reset: forget what the replicas (default: all) held; when
        that is every replica, the policy starts afresh too (``Policy.forget``)."""
        reset = set(self._replicas if replica_ids is None else replica_ids)
        for replica_id in reset & set(self._replicas):
            self.index.clear(replica_id)
        if reset >= set(self._replicas):
            self.policy.forget()

    def apply_hint(self, hint: RoutedHint) -> None:
        """Another gateway's optimistic insert, unless routed before the replica's last
        ``cleared`` event (a prefix cache reset): those blocks are gone."""
        view = self._replicas.get(hint.replica_id)
        if view is None or not hint.keys:
            return
        if view.cleared_seq is not None and hint.seq is not None and hint.seq < view.cleared_seq:
            return
        deadline = self.clock() + self.config.optimistic_ttl_s
        self.index.insert(hint.replica_id, hint.keys, tentative_until=deadline)

    def last_seq(self, replica_id: str) -> int | None:
        """The replica's last block event folded in (None: none, or unknown replica)."""
        view = self._replicas.get(replica_id)
        return None if view is None else view.last_seq

    def sweep(self) -> None:
        """Background maintenance: drop optimistic inserts no event confirmed in time, and
        clear some of the blocks of cleared views from the index (``PrefixIndex.scrub``)."""
        self.index.fold()
        self.index.scrub(steps=4)
        now = self.clock()
        for view in self._replicas.values():
            if view.publishes_events:
                self._expired_optimistic += self.index.expire(view.replica_id, now)

    # ----------------------------------------------------------------------- introspection

    def stats(self) -> dict[str, Any]:
        return {
            "decisions": dict(self._decisions),
            "index_blocks": len(self.index),
            "expired_optimistic": self._expired_optimistic,
            "cluster_s_per_token": self.cluster_cost.s_per_token,
            "cluster_fixed_s": self.cluster_cost.fixed_s,
            "cluster_s_per_running": self.cluster_cost.s_per_running,
            "sequence_gaps": self._resyncs,
            "replicas": {
                rid: {
                    "healthy": v.healthy,
                    "breaker": v.breaker_state,
                    "paused": v.paused,
                    "in_flight": v.in_flight,
                    "load": v.load.load,
                    "queued_tokens": self._queued_now(v),
                    "own_queued_tokens": v.load.queued_tokens,
                    "speed_factor": v.speed.factor,
                    "fixed_s": self.cluster_cost.fixed_s * v.speed.factor,
                    "s_per_token": self.cluster_cost.s_per_token * v.speed.factor,
                    "s_per_running": self.cluster_cost.s_per_running * v.speed.factor,
                    "cost_samples": v.speed.samples,
                    "blocks": self.index.blocks(rid),
                    "optimistic_blocks": self.index.tentative_blocks(rid),
                    "last_seq": v.last_seq,
                }
                for rid, v in self._replicas.items()
            },
        }

    def check_invariants(self) -> None:
        self.index.check_invariants()
        assert set(self.index.replica_ids) <= set(self._replicas)
        assert all(rid in self.ring for rid in self._replicas)
        for view in self._replicas.values():
            view.breaker.check_invariants()
            view.speed.check_invariants()
            view.load.check_invariants()
            assert view.load.in_flight == len(view.requests)
            assert view.load.queued_tokens == sum(
                r.uncached_tokens for r in view.requests if r.queued
            )
            assert all(not r.done and r.replica_id == view.replica_id for r in view.requests)
            queued = [r for r in view.requests if r.queued and r.uncached_tokens]
            assert view.head is (queued[0] if queued else None)
        self.cluster_cost.check_invariants()


def _normal_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1").rstrip("/")
