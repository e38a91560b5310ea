"""The discrete-event loop of a simulated cluster: sessions send turns, the real
``Router`` places them, ``SimReplica``s serve them on a simulated clock.

Events are ``(time, tie, kind, payload)`` on one heap; ``tie`` keeps equal times in push
order, so a run is deterministic. Kinds: ``turn`` (a conversation sends its next turn),
``prefill_done`` (a replica's prefill ends), ``first_token`` (the router hears the
first byte), ``decode_done`` (a replica's first running reply ends; dropped unseen when
the replica rescheduled since, so that it moves no clock: the run's total time is its
last real event's). The router's ``sweep`` runs at most once per simulated
second.

Open loop: each session starts at its arrival time. Closed loop (as the replay client):
``concurrency`` sessions at a time, the next starting when one ends. Either way a
session's next turn goes ``think_s`` after its previous reply ended.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Any

from loadtest.sim_client import BLOCK_SIZE, MODEL_ID, Conversation, WordTokenizer, reply_tokens
from loadtest.sim_cost import CostModel
from loadtest.sim_replica import BlockCounter, FanOut, RouterFeed, SimReplica, SimRequest
from loadtest.workloads import Session
from replica.prefix_cache import PrefixCache
from router.config import RouterConfig
from router.protocol import Snapshot, block_keys, root_key
from router.router import Router


class SimCluster:
    def __init__(
        self,
        sessions: Sequence[Session],
        policy: str,
        n_replicas: int,
        blocks_per_replica: int,
        cost: CostModel,
        *,
        scale: float,
        think_s: float,
        seed: int,
        config: RouterConfig | None,
        concurrency: int | None = None,
        prompts: Sequence[Sequence[list[int]]] | None = None,
        conversation_keys: bool = True,
        host_blocks_per_replica: int = 0,
        replica_ids: Sequence[str] | None = None,
        shared_cache: bool = False,
        whole_answers: bool = False,
    ) -> None:
        """``whole_answers``: clients that do not stream; the router hears of no first
        output, only of each request's end (as the gateway does for a whole answer).
        ``replica_ids``: the replicas' names (default ``replica-<i>``). The router's
        conversation ring hashes them, so a run that must place conversations as a live
        cluster does uses the live replicas' ids. ``shared_cache``: one cache of N×
        ``blocks_per_replica`` that every replica reads and fills, each its own compute
        (a reference no router can reach: what partitioning the cache costs, apart
        from pooling the compute, which the oracle also does)."""
        if replica_ids is not None and len(replica_ids) != n_replicas:
            raise ValueError(f"{len(replica_ids)} replica ids for {n_replicas} replicas")
        self.now = 0.0
        self.conversation_keys = conversation_keys
        self.whole_answers = whole_answers
        self.cost, self.think_s = cost, think_s
        self.router = Router(config, policy, clock=lambda: self.now, seed=seed)
        self.root = root_key(MODEL_ID, BLOCK_SIZE)
        self.replicas: list[SimReplica] = []
        ids = list(replica_ids) if replica_ids is not None else None
        self.index_of: dict[str, int] = {}
        rids = [ids[i] if ids is not None else f"replica-{i}" for i in range(n_replicas)]
        shared = None
        if shared_cache:
            feeds = FanOut([RouterFeed(self.router, rid) for rid in rids])
            shared = PrefixCache(
                blocks_per_replica * n_replicas,
                BLOCK_SIZE,
                MODEL_ID,
                listener=feeds,
                host_blocks=host_blocks_per_replica * n_replicas,
                mover=BlockCounter() if host_blocks_per_replica else None,
            )
        for i, rid in enumerate(rids):
            self.index_of[rid] = i
            self.router.add_replica(rid, f"sim://{rid}", MODEL_ID, BLOCK_SIZE, static=True)
            # Its start-up snapshot, as a live replica writes one: the router knows from
            # the first request on that the replica publishes events.
            self.router.apply_snapshot(rid, Snapshot(0, []))
            cache = shared or PrefixCache(
                blocks_per_replica,
                BLOCK_SIZE,
                MODEL_ID,
                listener=RouterFeed(self.router, rid),
                host_blocks=host_blocks_per_replica,
                mover=BlockCounter() if host_blocks_per_replica else None,
            )
            self.replicas.append(SimReplica(rid, cache, scale))
        self.events: list[tuple[float, int, str, Any]] = []
        self._tie = 0
        self.tokenizer = WordTokenizer()
        convs = [Conversation(s, self.tokenizer.encode(s.system)) for s in sessions]
        if prompts is not None:
            for conv, given in zip(convs, prompts, strict=True):
                if len(given) != len(conv.session.turns):
                    raise ValueError(f"{conv.session.session_id}: one prompt per turn expected")
                conv.prompts = given
        self.backlog: deque[Conversation] = deque()
        if concurrency is None:
            for conv in convs:
                self._push(conv.session.arrival_s, "turn", conv)
        else:
            self.backlog.extend(sorted(convs, key=lambda c: c.session.arrival_s))
            for _ in range(min(concurrency, len(convs))):
                self._push(0.0, "turn", self.backlog.popleft())
        self.served: list[SimRequest] = []  # every request, at its first token
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.host_cached_tokens = 0  # of the cached ones, found on a host tier
        self.last_sweep = 0.0

    @property
    def ttfts(self) -> list[float]:
        """Every request's time to first token, in first-token order."""
        return [r.first_token_at - r.arrival for r in self.served]

    def _push(self, at: float, kind: str, payload: Any) -> None:
        self._tie += 1
        heapq.heappush(self.events, (at, self._tie, kind, payload))

    def run(self) -> None:
        while self.events:
            at, _tie, kind, payload = heapq.heappop(self.events)
            if kind == "decode_done" and payload[0].version != payload[1]:
                continue  # rescheduled since: it happens at another time, or not at all
            for replica in self.replicas:
                if replica.busy:
                    replica.busy_s += at - self.now
            self.now = at
            if kind == "turn":
                self._send_turn(payload)
            elif kind == "prefill_done":
                self._prefill_done(payload)
            elif kind == "first_token":
                if not self.whole_answers:
                    self.router.first_byte(payload)
            elif kind == "decode_done":
                self._decode_done(payload[0])
            if self.now - self.last_sweep >= 1.0:
                self.router.sweep()
                self.last_sweep = self.now

    def _send_turn(self, conv: Conversation) -> None:
        turn = conv.session.turns[conv.turn]
        if conv.prompts is None:
            conv.tokens = conv.tokens + self.tokenizer.encode(turn.user)
            have = len(conv.keys)
            parent = conv.keys[-1] if conv.keys else None
            conv.keys += block_keys(
                conv.tokens, BLOCK_SIZE, self.root, parent=parent, start_block=have
            )
            reply = reply_tokens(conv.session.session_id, conv.turn, turn.max_tokens)
        else:
            conv.tokens = list(conv.prompts[conv.turn])
            conv.keys = block_keys(conv.tokens, BLOCK_SIZE, self.root)
            reply = conv.given_reply(turn.max_tokens)
        decision = self.router.route(
            conv.keys,
            conversation_key=conv.session.session_id if self.conversation_keys else None,
            prompt_tokens=len(conv.tokens),
        )
        index = self.index_of[decision.replica_id]
        request = SimRequest(conv, conv.tokens, reply, self.now, index, turn=conv.turn)
        request.handle = self.router.request_started(
            decision.replica_id, decision.uncached_tokens, decision.queued_tokens
        )
        replica = self.replicas[index]
        replica.requests += 1
        replica.queue.append(request)
        self._start_prefill(replica)

    def _start_prefill(self, replica: SimReplica, *, boundary: bool = False) -> None:
        started = replica.start_prefill(self.now, self.cost, boundary=boundary)
        if started is None:
            return
        group, took = started
        for request in group:
            self.prompt_tokens += len(request.tokens)
            self.cached_tokens += request.cached
            self.host_cached_tokens += request.host_cached
        self._push(self.now + took, "prefill_done", replica)
        self._reschedule(replica)  # the batch decodes at the prefill's step rate meanwhile

    def _prefill_done(self, replica: SimReplica) -> None:
        for request in replica.finish_prefill(self.now, self.cost):
            self.served.append(request)
            self._push(request.first_token_at, "first_token", request.handle)
        self._reschedule(replica)
        self._start_prefill(replica, boundary=True)

    def _reschedule(self, replica: SimReplica) -> None:
        at = replica.reschedule(self.now, self.cost)
        if at is not None:
            self._push(at, "decode_done", (replica, replica.version))

    def _decode_done(self, replica: SimReplica) -> None:
        request = replica.finish_decode(self.now, self.cost)
        assert request.handle is not None
        self.router.request_finished(request.handle, ok=True)
        conv = request.conv
        conv.tokens = request.tokens + request.reply
        conv.turn += 1
        if conv.turn < len(conv.session.turns):
            self._push(self.now + self.think_s, "turn", conv)
        elif self.backlog:
            self._push(self.now, "turn", self.backlog.popleft())
        self._reschedule(replica)
        self._start_prefill(replica, boundary=True)
