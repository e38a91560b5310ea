"""Deterministic cluster simulation: real PrefixCache per replica, the real Router, queues.

No model and no HTTP: a discrete-event loop on a simulated clock. Each replica has the
real ``replica.prefix_cache.PrefixCache`` with a finite number of blocks, whose listener
feeds the router block events exactly as Redis would (short keys, per-replica seq).

Compute model of one replica (``CostModel``, defaults measured with smollm2-135m on
this CPU: a 2,000-token prefill ≈ 5.6 s, one decode step ≈ 70 ms):

* prefill is serial and FIFO: a request's uncached prompt tokens cost
  ``prefill_s_per_token`` each; its prefix match happens when its prefill starts (as in
  a real scheduler), blocks for prompt + reply are reserved then, and a request that does
  not fit waits for blocks to be released;
* decode runs as one continuous batch beside the prefill (chunked prefill overlaps it):
  a step advances every running request by one token and takes
  ``decode_s_per_token · (1 + batch_marginal · (b/scale − 1)⁺)`` for b running, so
  batching makes tokens cheaper but not free;
* TTFT = queueing + prefill + one decode step. When a reply ends its tokens are
  committed to the cache and the blocks released (tail first, as the engine does).

The oracle is one replica with N× the blocks and ``scale = N``: prefill N× faster,
batches N× larger for the same step time.

A session's next turn is sent ``think_s`` after the previous reply finished; its prompt
is system + every earlier user turn and reply + the new user text. Replies are
synthetic tokens, ``max_tokens`` long, seeded per session and turn.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.workloads import Session
from replica.prefix_cache import CacheFull, PrefixCache
from router.config import RouterConfig
from router.load import InFlight
from router.protocol import BlockEvent, Medium, block_keys, root_key, short_key
from router.router import Router

MODEL_ID = "sim"
BLOCK_SIZE = 16


@dataclass(slots=True)
class CostModel:
    prefill_s_per_token: float = 0.0028
    decode_s_per_token: float = 0.070
    batch_marginal: float = 0.15

    def prefill_s(self, tokens: int, scale: float = 1.0) -> float:
        return tokens * self.prefill_s_per_token / scale

    def step_s(self, batch: int, scale: float = 1.0) -> float:
        extra = max(0.0, batch / scale - 1.0)
        return self.decode_s_per_token * (1.0 + self.batch_marginal * extra)


class WordTokenizer:
    """Stand-in tokenizer: one id per word, stable across runs (crc32), memoized."""

    def __init__(self, vocab: int = 60_000) -> None:
        self.vocab = vocab
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        out = []
        for word in text.split():
            token = ids.get(word)
            if token is None:
                token = ids[word] = 1000 + zlib.crc32(word.encode()) % self.vocab
            out.append(token)
        return out


def reply_tokens(session_id: str, turn: int, n: int) -> list[int]:
    rng = random.Random(f"{session_id}/{turn}")
    return [rng.randrange(1000, 61_000) for _ in range(n)]


@dataclass(slots=True)
class _Conversation:
    session: Session
    tokens: list[int]  # everything sent and received so far
    keys: list[bytes] = field(default_factory=list)  # full-block keys of ``tokens``
    turn: int = 0
    # Each turn's whole prompt as token ids, when given (e.g. a real chat template's):
    # then the prompts are sent as they are instead of being built from the word ids.
    prompts: Sequence[list[int]] | None = None


@dataclass(slots=True)
class _Request:
    conv: _Conversation
    tokens: list[int]  # the prompt
    reply: list[int]
    arrival: float
    replica: int = 0
    cached: int = 0
    block_ids: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    handle: InFlight | None = None  # the router's in-flight record


class _Listener:
    """PrefixCache events → Router, as the Redis publisher/sync pair would deliver them."""

    def __init__(self, router: Router, replica_id: str) -> None:
        self.router, self.replica_id, self.seq = router, replica_id, 0

    def _send(
        self,
        event_type: str,
        keys: Sequence[bytes],
        parent: bytes | None = None,
        medium: Medium = "device",
    ) -> None:
        self.seq += 1
        event = BlockEvent(
            self.seq,
            event_type,  # type: ignore[arg-type]
            tuple(short_key(k) for k in keys),
            short_key(parent) if parent is not None else None,
            medium,
        )
        assert self.router.apply_event(self.replica_id, event)

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        self._send("stored", keys, parent, medium)

    def on_removed(self, keys: list[bytes]) -> None:
        self._send("removed", keys)

    def on_cleared(self) -> None:
        self._send("cleared", ())


@dataclass(slots=True)
class _Replica:
    replica_id: str
    cache: PrefixCache
    scale: float
    queue: deque[_Request] = field(default_factory=deque)
    prefilling: _Request | None = None
    running: list[tuple[float, int, _Request]] = field(default_factory=list)  # heap by V end
    progress: float = 0.0  # V: tokens each running request has advanced (fluid batch)
    progress_at: float = 0.0
    version: int = 0
    requests: int = 0
    busy_s: float = 0.0  # time with a prefill or a decode batch running

    @property
    def busy(self) -> bool:
        return self.prefilling is not None or bool(self.running)


@dataclass(slots=True)
class SimResult:
    policy: str
    n_replicas: int
    blocks_per_replica: int
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens, whole cluster
    requests_per_replica: list[int]
    busy_s_per_replica: list[float]
    ttft_p50_s: float
    ttft_p99_s: float
    total_time_s: float
    decisions: dict[str, int]

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
            "max/mean": round(self.load_imbalance, 3),
            "busy max/mean": round(self.busy_imbalance, 3),
            "ttft_p50_s": round(self.ttft_p50_s, 3),
            "ttft_p99_s": round(self.ttft_p99_s, 3),
            "total_s": round(self.total_time_s, 1),
        }


class _Simulation:
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
    ) -> None:
        self.now = 0.0
        self.conversation_keys = conversation_keys
        self.cost, self.think_s = cost, think_s
        self.router = Router(config, policy, clock=lambda: self.now, seed=seed)
        self.root = root_key(MODEL_ID, BLOCK_SIZE)
        self.replicas: list[_Replica] = []
        for i in range(n_replicas):
            rid = f"replica-{i}"
            self.router.add_replica(rid, f"sim://{rid}", MODEL_ID, BLOCK_SIZE, static=True)
            cache = PrefixCache(
                blocks_per_replica, BLOCK_SIZE, MODEL_ID, listener=_Listener(self.router, rid)
            )
            self.replicas.append(_Replica(rid, cache, scale))
        self.events: list[tuple[float, int, str, Any]] = []
        self._tie = 0
        self.tokenizer = WordTokenizer()
        convs = [_Conversation(s, self.tokenizer.encode(s.system)) for s in sessions]
        if prompts is not None:
            for conv, given in zip(convs, prompts, strict=True):
                if len(given) != len(conv.session.turns):
                    raise ValueError(f"{conv.session.session_id}: one prompt per turn expected")
                conv.prompts = given
        # Closed loop (as the replay client's): ``concurrency`` sessions at a time, the
        # next one starting when one ends, turns back to back; else each at its arrival.
        self.backlog: deque[_Conversation] = deque()
        if concurrency is None:
            for conv in convs:
                self._push(conv.session.arrival_s, "turn", conv)
        else:
            self.backlog.extend(sorted(convs, key=lambda c: c.session.arrival_s))
            for _ in range(min(concurrency, len(convs))):
                self._push(0.0, "turn", self.backlog.popleft())
        self.ttfts: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.last_sweep = 0.0

    def _push(self, at: float, kind: str, payload: Any) -> None:
        self._tie += 1
        heapq.heappush(self.events, (at, self._tie, kind, payload))

    def run(self) -> None:
        while self.events:
            at, _tie, kind, payload = heapq.heappop(self.events)
            for replica in self.replicas:
                if replica.busy:
                    replica.busy_s += at - self.now
            self.now = at
            if kind == "turn":
                self._send_turn(payload)
            elif kind == "prefill_done":
                self._prefill_done(payload)
            elif kind == "first_token":
                self.router.first_byte(payload)
            elif kind == "decode_done":
                replica, version = payload
                if replica.version == version:
                    self._decode_done(replica)
            if self.now - self.last_sweep >= 1.0:
                self.router.sweep()
                self.last_sweep = self.now

    # ------------------------------------------------------------------ requests

    def _send_turn(self, conv: _Conversation) -> None:
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
            reply = self._given_reply(conv, turn.max_tokens)
        decision = self.router.route(
            conv.keys,
            conversation_key=conv.session.session_id if self.conversation_keys else None,
            prompt_tokens=len(conv.tokens),
        )
        index = int(decision.replica_id.rsplit("-", 1)[1])
        request = _Request(conv, conv.tokens, reply, self.now, index)
        request.handle = self.router.request_started(
            decision.replica_id, decision.uncached_tokens, decision.queued_tokens
        )
        replica = self.replicas[index]
        replica.requests += 1
        replica.queue.append(request)
        self._start_prefill(replica)

    @staticmethod
    def _given_reply(conv: _Conversation, max_tokens: int) -> list[int]:
        """With given prompts the reply is what the next prompt resends after this one
        (the client appends the reply it got), else stand-in ids."""
        assert conv.prompts is not None
        prompt = conv.prompts[conv.turn]
        if conv.turn + 1 < len(conv.prompts):
            following = conv.prompts[conv.turn + 1]
            if following[: len(prompt)] == prompt:
                return list(following[len(prompt) : len(prompt) + max_tokens])
        return reply_tokens(conv.session.session_id, conv.turn, max_tokens)

    def _start_prefill(self, replica: _Replica) -> None:
        if replica.prefilling is not None or not replica.queue:
            return
        request = replica.queue[0]
        cache, n = replica.cache, len(request.tokens)
        match = cache.match(request.tokens)
        held = list(match.block_ids)
        if match.cached_tokens % BLOCK_SIZE:  # a shared partial block: copy-on-write
            cache.release(held[-1:])
            held = held[:-1]
        need = math.ceil((n + len(request.reply)) / BLOCK_SIZE) - len(held)
        try:
            fresh = cache.allocate(need)
        except CacheFull:
            cache.release(held)  # wait for a running request to free blocks
            return
        replica.queue.popleft()
        request.block_ids = held + fresh
        request.cached = match.cached_tokens
        self.prompt_tokens += n
        self.cached_tokens += match.cached_tokens
        replica.prefilling = request
        done = self.now + self.cost.prefill_s(n - match.cached_tokens, replica.scale)
        self._push(done, "prefill_done", replica)

    def _prefill_done(self, replica: _Replica) -> None:
        request = replica.prefilling
        assert request is not None
        replica.prefilling = None
        replica.cache.commit(request.tokens, request.block_ids)
        self._advance(replica)
        request.first_token_at = self.now + self.cost.step_s(
            len(replica.running) + 1, replica.scale
        )
        self.ttfts.append(request.first_token_at - request.arrival)
        self._push(request.first_token_at, "first_token", request.handle)
        end = replica.progress + len(request.reply)
        heapq.heappush(replica.running, (end, id(request), request))
        self._reschedule(replica)
        self._start_prefill(replica)

    def _advance(self, replica: _Replica) -> None:
        """Move the fluid batch's progress V up to now."""
        if replica.running:
            step = self.cost.step_s(len(replica.running), replica.scale)
            replica.progress += (self.now - replica.progress_at) / step
        replica.progress_at = self.now

    def _reschedule(self, replica: _Replica) -> None:
        replica.version += 1
        if replica.running:
            step = self.cost.step_s(len(replica.running), replica.scale)
            left = max(0.0, replica.running[0][0] - replica.progress)
            self._push(self.now + left * step, "decode_done", (replica, replica.version))

    def _decode_done(self, replica: _Replica) -> None:
        self._advance(replica)
        _end, _id, request = heapq.heappop(replica.running)
        replica.progress = max(replica.progress, _end)  # float drift
        full = request.tokens + request.reply
        replica.cache.commit(full, request.block_ids)
        replica.cache.release(request.block_ids)
        assert request.handle is not None
        self.router.request_finished(request.handle, ok=True)
        conv = request.conv
        conv.tokens = full
        conv.turn += 1
        if conv.turn < len(conv.session.turns):
            self._push(self.now + self.think_s, "turn", conv)
        elif self.backlog:
            self._push(self.now, "turn", self.backlog.popleft())
        self._reschedule(replica)
        self._start_prefill(replica)


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
) -> SimResult:
    """Run ``sessions`` through ``n_replicas`` replicas routed by ``policy``; open loop
    (each session at its arrival time), or closed loop with ``concurrency`` sessions at a
    time. ``prompts``: each session's turns as whole prompts of token ids (else built
    from the sessions' words). ``conversation_keys``: route with each session's id as
    its conversation key (False: as clients that send none)."""
    sim = _Simulation(
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
    )
    sim.run()
    ttfts = sorted(sim.ttfts)
    for replica in sim.replicas:
        replica.cache.check_invariants()
        assert not replica.queue and replica.prefilling is None and not replica.running
    sim.router.check_invariants()
    drained = [(v.in_flight, v.load.queued_tokens) for v in sim.router.replicas.values()]
    assert all(d == (0, 0) for d in drained), drained
    return SimResult(
        policy=policy,
        n_replicas=n_replicas,
        blocks_per_replica=blocks_per_replica,
        requests=len(ttfts),
        hit_rate=sim.cached_tokens / sim.prompt_tokens if sim.prompt_tokens else 0.0,
        requests_per_replica=[r.requests for r in sim.replicas],
        busy_s_per_replica=[r.busy_s for r in sim.replicas],
        ttft_p50_s=_percentile(ttfts, 0.5),
        ttft_p99_s=_percentile(ttfts, 0.99),
        total_time_s=sim.now,
        decisions=dict(sim.router.stats()["decisions"]),
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
) -> list[SimResult]:
    """The oracle (one replica, N× blocks and compute) first, then each policy.

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
    )
    oracle.policy = "oracle"
    results = [oracle]
    for policy in policies:
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
            )
        )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m loadtest.simulate [kind ...]``: the oracle and each policy per kind, over
    a grid of replica counts, arrival-rate scales and seeds; then, per kind and policy,
    the worst run against the oracle (lowest hit ratio, highest time ratio, highest
    max/mean busy time). Kinds: ``loadtest.workloads.KINDS`` and the skewed single-turn
    document variants (``loadtest.skewed_docs.VARIANTS``, routed without conversation
    keys)."""
    import argparse
    import time

    from loadtest import skewed_docs
    from loadtest.workloads import KINDS, default_rate, generate

    kinds = [*KINDS, *skewed_docs.VARIANTS]
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("kinds", nargs="*", default=["agents", "multi_turn_chat", "doc_qa"])
    parser.add_argument("--policies", default="cache_aware,round_robin,consistent_hash")
    parser.add_argument("--replicas", type=int, nargs="+", default=[4])
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--rate-scales",
        type=float,
        nargs="+",
        default=[1.0],
        help="multiply each kind's default arrival rate (e.g. 4: a cluster under load, "
        "where total time is more than the arrival span)",
    )
    parser.add_argument("--option", action="append", default=[], help="router NAME=VALUE")
    args = parser.parse_args(argv)
    from router.config import RouterConfig, with_options

    config = with_options(RouterConfig(), args.option)
    policies = args.policies.split(",")
    for kind in args.kinds:
        if kind not in kinds:
            parser.error(f"unknown kind {kind!r}; choose from {kinds}")
    for kind in args.kinds:
        worst: dict[str, list[tuple[float, str]]] = {}
        for n, scale, seed in (
            (n, scale, seed)
            for n in args.replicas
            for scale in args.rate_scales
            for seed in args.seeds
        ):
            documents = kind in skewed_docs.VARIANTS
            if documents:
                sessions = skewed_docs.variant(kind, seed=seed, rate_scale=scale)
            else:
                sessions = generate(kind, seed=seed, rate=default_rate(kind) * scale)
            started = time.perf_counter()
            results = run_comparison(
                sessions,
                policies,
                n_replicas=n,
                cache_fraction=args.cache_fraction,
                seed=seed,
                config=config,
                conversation_keys=not documents,
            )
            oracle = results[0]
            run = f"N={n} rate x{scale:g} seed {seed}"
            print(
                f"{kind} {run}: {oracle.requests} requests, {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            for r in results:
                hit, span = r.hit_rate / oracle.hit_rate, r.total_time_s / oracle.total_time_s
                print(
                    f"  {r.policy:16} hit {r.hit_rate:.3f} ({hit:.3f}x oracle)"
                    f"  time {r.total_time_s:7.1f} s ({span:.3f}x)"
                    f"  max/mean busy {r.busy_imbalance:.2f} requests {r.load_imbalance:.2f}"
                    f"  TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s"
                )
                if r is not oracle:
                    cell = worst.setdefault(r.policy, [(9.0, ""), (0.0, ""), (0.0, "")])
                    cell[0] = min(cell[0], (hit, run))
                    cell[1] = max(cell[1], (span, run))
                    cell[2] = max(cell[2], (r.busy_imbalance, run))
        for policy, ((hit, hit_run), (span, span_run), (busy, busy_run)) in worst.items():
            print(
                f"WORST {kind} {policy}: hit {hit:.3f}x oracle ({hit_run}),"
                f" time {span:.3f}x ({span_run}), max/mean busy {busy:.2f} ({busy_run})"
            )


if __name__ == "__main__":
    main()
