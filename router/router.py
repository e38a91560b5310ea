"""The router facade the gateway and the simulator use: replicas in, one decision out.

State: replica views (address, load, breaker), the prefix index, the conversation ring,
and per replica the sequence number of the last block event applied. Decisions are
synchronous and cheap (no I/O); router/sync.py feeds events, snapshots, loads and other
gateways' hints in from Redis.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from router.config import RouterConfig
from router.health import CircuitBreaker
from router.index import PrefixIndex
from router.load import LoadTracker
from router.policies import Candidate, RouteInput, make_policy
from router.protocol import SHORT_KEY_BYTES, BlockEvent, ReplicaLoad, RoutedHint, Snapshot
from router.ring import Ring

RoutedHook = Callable[[str, list[bytes]], None]
_SHORT = itemgetter(slice(0, SHORT_KEY_BYTES))  # full block key -> short key


class NoHealthyReplica(RuntimeError):
    """No replica is healthy, serves the model and is not excluded."""


class Decision(NamedTuple):
    replica_id: str
    reason: str  # "prefix_match 112/128 blocks", "ring", "overload_fallback", "least_loaded", ...
    matched_blocks: int
    total_blocks: int


@dataclass(slots=True)
class ReplicaView:
    replica_id: str
    url: str
    model: str
    block_size: int
    static: bool
    breaker: CircuitBreaker
    load: LoadTracker = field(default_factory=LoadTracker)
    last_seen: float = 0.0  # last registry record / heartbeat (discovered replicas)
    ttl_s: float = 15.0
    publishes_events: bool = False  # seen an event or snapshot: optimistic inserts expire
    last_seq: int | None = None  # last block event folded into the index

    @property
    def expired(self) -> bool:
        return not self.static and self.breaker.clock() - self.last_seen > self.ttl_s

    @property
    def healthy(self) -> bool:
        return not self.expired and self.breaker.allows()

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
        return model is None or not self.model or self.model == model


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
        self.policy = make_policy(policy, self.config, self.ring, random.Random(seed))
        self.index = PrefixIndex(self.config.max_blocks_per_replica)
        self._replicas: dict[str, ReplicaView] = {}
        self._hooks: list[RoutedHook] = []
        self._decisions: Counter[str] = Counter()
        # The last decisions on new work (``recent_decisions_per_replica`` × replicas):
        # how many went to each, the share of new conversations and keyless requests
        # each replica has been taking lately (cache_aware's long-run balance; a
        # continuing conversation stays where its history is and is not counted).
        self._recent: deque[str] = deque()
        self._recent_counts: Counter[str] = Counter()
        self._conversations: OrderedDict[str, None] = OrderedDict()
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
    ) -> None:
        """Add a replica, or refresh its address/model and heartbeat if already known.

        A replica given statically by URL (named after its address) that later registers
        in Redis under its own id is one replica, not two: the static entry gives way to
        the registered id, which stays static (it never expires)."""
        alias = self._alias(replica_id, url)
        known_health: CircuitBreaker | None = None  # the same replica's, under its other id
        if alias is not None and static:
            # Already known under its registered id: that entry becomes static.
            replica_id, static = alias, True
            url = self._replicas[alias].url
            model = model or self._replicas[alias].model
        elif alias is not None and self._replicas[alias].static:
            known_health = self._replicas[alias].breaker
            self.remove_replica(alias)
            static = True
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
                LoadTracker(self.config.report_ttl_s),
                ttl_s=self.config.replica_ttl_s,
            )
            self._replicas[replica_id] = view
            self.ring.add(replica_id)
        view.url, view.model, view.block_size = url, model, block_size
        view.static = view.static or static
        view.last_seen = self.clock()

    def _alias(self, replica_id: str, url: str) -> str | None:
        """The id of another replica at the same address, if any."""
        wanted = _normal_url(url)
        for other_id, view in self._replicas.items():
            if other_id != replica_id and _normal_url(view.url) == wanted:
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
    ) -> Decision:
        """The replica for a prompt whose block keys are ``keys``: short ones, as the
        gateway computes them (``KeySpace.short_keys``), or full ones, cut down here.
        Copied either way: the optimistic insert keeps the list."""
        short = list(map(_SHORT, keys)) if keys and len(keys[0]) > SHORT_KEY_BYTES else list(keys)
        now = self.clock()
        views = [
            v
            for v in self._replicas.values()
            if (v.static or now - v.last_seen <= v.ttl_s)  # not expired, inlined (hot path)
            and (v.breaker.state == "closed" or v.breaker.allows())
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
        # tuple.__new__ directly: Candidate(...) and Candidate._make run Python code.
        ids = [v.replica_id for v in views]
        columns = [ids, [v.load.load for v in views], list(map(matches.get, ids, repeat(0)))]
        sharing = self.config.share_slack is not None  # the window only feeds the share bound
        # (tuple.__new__ skips the NamedTuple's default: every field is given.)
        columns.append(
            list(map(self._recent_counts.__getitem__, ids)) if sharing else [0] * len(ids)
        )
        candidates: list[Candidate] = list(
            map(tuple.__new__, repeat(Candidate), zip(*columns, strict=True))
        )
        continuing = sharing and conversation_key is not None and self._seen(conversation_key)
        request = RouteInput(
            candidates, len(short), conversation_key, short[0] if short else None, continuing
        )
        choice = self.policy.choose(request)
        chosen = self._replicas[choice.replica_id]
        chosen.breaker.on_dispatch()
        if short:  # optimistic insert, visible at once, bookkeeping deferred (index.fold)
            index.insert_later(
                chosen.replica_id,
                short,
                now + self.config.optimistic_ttl_s,
                held=matches.get(chosen.replica_id, 0),
            )
        self._decisions[choice.reason.split(" ", 1)[0]] += 1
        if sharing and not continuing:  # the share bound spreads new work only
            self._note_recent(chosen.replica_id)
        for hook in self._hooks:
            hook(chosen.replica_id, short)
        return Decision(
            choice.replica_id, choice.reason, matches.get(choice.replica_id, 0), len(short)
        )

    def _seen(self, conversation_key: str) -> bool:
        """Whether this router routed the conversation before (remembered up to a cap,
        least recently seen forgotten first); notes it either way."""
        seen = self._conversations
        if conversation_key in seen:
            seen.move_to_end(conversation_key)
            return True
        seen[conversation_key] = None
        if len(seen) > self.config.remembered_conversations:
            seen.popitem(last=False)
        return False

    def _note_recent(self, replica_id: str) -> None:
        recent = self._recent_counts
        self._recent.append(replica_id)
        recent[replica_id] += 1
        if len(self._recent) > self.config.recent_decisions_per_replica * len(self._replicas):
            recent[self._recent.popleft()] -= 1

    def add_routed_hook(self, hook: RoutedHook) -> None:
        self._hooks.append(hook)

    # ----------------------------------------------------------------------- load, health

    def request_started(self, replica_id: str) -> None:
        view = self._replicas.get(replica_id)
        if view is not None:
            view.load.started()

    def request_finished(self, replica_id: str, *, ok: bool | None) -> None:
        """The replica is done with a request; ``ok`` is the breaker's verdict, None
        when the outcome alone proves nothing (router/health.py: fault attribution; a
        verdict found later goes to ``record_outcome``)."""
        view = self._replicas.get(replica_id)
        if view is not None:
            view.load.finished()
            if ok is None:
                view.breaker.record_no_verdict()
            else:
                view.breaker.record(ok)
        # The deferred optimistic inserts are folded in here, after a response, rather
        # than on some later request's routing decision.
        self.index.fold()

    def report_probe(self, replica_id: str, ok: bool) -> None:
        view = self._replicas.get(replica_id)
        if view is not None:
            view.breaker.record(ok)

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
            view.load.report(load, at)
            view.last_seen = self.clock()

    # ----------------------------------------------------------------------- index feed

    def apply_event(self, replica_id: str, event: BlockEvent) -> bool:
        """Fold one block event in; False on a sequence gap (the caller resyncs)."""
        view = self._replicas.get(replica_id)
        if view is None:
            return True
        if view.last_seq is not None:
            if event.seq <= view.last_seq:
                return True  # already folded in (e.g. via the snapshot)
            if event.seq != view.last_seq + 1:
                self._resyncs += 1
                return False
        if event.type == "stored":
            self.index.insert(replica_id, event.keys)
        elif event.type == "removed":
            self.index.remove(replica_id, event.keys)
        else:
            self.index.clear(replica_id)
        view.last_seq = event.seq
        view.publishes_events = True
        return True

    def apply_snapshot(self, replica_id: str, snapshot: Snapshot) -> None:
        """Replace the replica's view with its snapshot (as of event ``snapshot.seq``)."""
        view = self._replicas.get(replica_id)
        if view is None:
            return
        self.index.clear(replica_id)
        for block in snapshot.blocks:
            self.index.insert(replica_id, (block.key,))
        view.last_seq = snapshot.seq
        view.publishes_events = True

    def reset_replica_view(self, replica_id: str) -> None:
        """Forget what the replica holds and accept its next event as a new start (a
        resync without a snapshot)."""
        view = self._replicas.get(replica_id)
        if view is not None:
            self.index.clear(replica_id)
            view.last_seq = None

    def forget_cached_state(self, replica_ids: Iterable[str] | None = None) -> None:
        """After a prefix cache reset: forget what the replicas (default: all) held, and
        start over on conversations and recent decisions (a conversation's history is
        gone with the cache, so it is new work again)."""
        for replica_id in self._replicas if replica_ids is None else replica_ids:
            if replica_id in self._replicas:
                self.index.clear(replica_id)
        self._conversations.clear()
        self._recent.clear()
        self._recent_counts.clear()

    def apply_hint(self, hint: RoutedHint) -> None:
        """Another gateway's optimistic insert."""
        if hint.replica_id in self._replicas and hint.keys:
            deadline = self.clock() + self.config.optimistic_ttl_s
            self.index.insert(hint.replica_id, hint.keys, tentative_until=deadline)

    def sweep(self) -> None:
        """Background maintenance: drop optimistic inserts no event confirmed in time."""
        self.index.fold()
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
            "remembered_conversations": len(self._conversations),
            "sequence_gaps": self._resyncs,
            "replicas": {
                rid: {
                    "healthy": v.healthy,
                    "breaker": v.breaker_state,
                    "in_flight": v.in_flight,
                    "load": v.load.load,
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
            assert view.load.in_flight >= 0


def _normal_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1").rstrip("/")
