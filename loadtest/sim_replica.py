"""One simulated replica: a FIFO queue, one prefill group at a time, a fluid decode batch, and
the real ``PrefixCache`` whose events reach the router as Redis would deliver them.

* Prefill is FIFO, one group at a time: the queue's head, with the requests behind it
  that fit in the leftover token budget of its steps (``CostModel.prefill_chunk`` a
  step, as the engine's scheduler fills a step): short prompts share a step instead of
  paying one each, except a prompt the group computes a further full block of, which
  waits for those blocks (as the engine defers it: a burst on one new prefix computes
  it once). A request's prefix match happens when its prefill starts (as in a
  real scheduler); blocks for prompt + reply are reserved then, and the head of the
  queue waits while they do not fit (a running request will release some).
* Decode runs as one continuous batch, in the same steps as the prefill: a prefill
  starts when the step under way ends, runs ``CostModel.prefill_steps`` steps, and the
  batch advances one token per step meanwhile (chunked prefill: the steps take the
  prefill's time, so a prompt slows the replies beside it, as on the engine). The batch
  is fluid: ``progress`` (V) is how many tokens each running request has advanced; a
  request joining at V with an n-token reply ends at V + n − 1 (its first token comes
  from its prefill's last step), so ``running`` is a heap by end.
* When a reply ends, prompt + reply are committed to the cache and the blocks released
  (tail first, as the engine does).
* With a host tier (``host_blocks``), the cache demotes evicted blocks there and a match
  that reaches them is promoted when the prefill starts (as the engine's scheduler does);
  the prefill then also takes the copy time (``CostModel.swap_in_s``), and demotions
  cost nothing (a GPU copies them on a side stream). ``BlockCounter`` is the cache's
  mover: there are no bytes to copy, only blocks to count.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.sim_client import BLOCK_SIZE, Conversation
from loadtest.sim_cost import CostModel
from replica.prefix_cache import CacheFull, PrefixCache
from router.load import InFlight
from router.protocol import BlockEvent, Medium, short_key
from router.router import Router


@dataclass(slots=True)
class BlockCounter:
    """The prefix cache's ``BlockMover`` in the simulator: counts the blocks each way."""

    block_bytes: int = 0  # nothing is stored
    demoted: int = 0
    promoted: int = 0

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        self.demoted += len(device_blocks)

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        self.promoted += len(host_slots)


@dataclass(slots=True)
class SimRequest:
    conv: Conversation
    tokens: list[int]  # the prompt
    reply: list[int]
    arrival: float
    replica: int = 0
    cached: int = 0  # prompt tokens matched in the cache when its prefill started
    host_cached: int = 0  # of which found on the host tier
    swapped_blocks: int = 0  # blocks copied back from the host tier for it
    block_ids: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    handle: InFlight | None = None  # the router's in-flight record
    turn: int = 0  # which of its session's turns


def _computing_more_of(group: Sequence[SimRequest], tokens: list[int], cached: int) -> bool:
    """Whether a request prefilling in ``group`` computes at least one more full block of
    ``tokens`` than the cache holds (``cached`` tokens). The engine's scheduler then
    defers the prompt until those blocks are committed, so that a burst on one new prefix
    computes it once; it waits first in the queue."""
    n = (cached // BLOCK_SIZE + 1) * BLOCK_SIZE  # up to the next full block
    if n > len(tokens):
        return False
    head = tokens[:n]
    return any(len(other.tokens) >= n and other.tokens[:n] == head for other in group)


class RouterFeed:
    """PrefixCache events → Router, as the Redis publisher/sync pair would deliver them
    (short keys, one seq per replica)."""

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


class FanOut:
    """One shared cache's events to every replica's feed (``SimCluster``'s
    ``shared_cache``: each replica holds what the cache holds)."""

    def __init__(self, feeds: Sequence[RouterFeed]) -> None:
        self.feeds = list(feeds)

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        for feed in self.feeds:
            feed.on_stored(parent, keys, medium)

    def on_removed(self, keys: list[bytes]) -> None:
        for feed in self.feeds:
            feed.on_removed(keys)

    def on_cleared(self) -> None:
        for feed in self.feeds:
            feed.on_cleared()


@dataclass(slots=True)
class SimReplica:
    replica_id: str
    cache: PrefixCache
    scale: float  # compute relative to one real replica (see ``CostModel``)
    queue: deque[SimRequest] = field(default_factory=deque)
    prefilling: list[SimRequest] = field(default_factory=list)  # sharing their steps
    # A heap by V end; ties in joining order (never by object address: a run's result
    # must not depend on what the process allocated before it).
    running: list[tuple[float, int, SimRequest]] = field(default_factory=list)
    joined: int = 0  # requests moved into the decode batch so far (``running``'s tie order)
    progress: float = 0.0  # V: tokens each running request has advanced (fluid batch)
    progress_at: float = 0.0
    version: int = 0  # bumped on every reschedule; a stale decode-done event is ignored
    requests: int = 0
    busy_s: float = 0.0  # time with a prefill or a decode batch running
    unpaid_swap_blocks: int = 0  # promoted for a prefill that could not start yet
    prefill_step_s: float = 0.0  # while prefilling: seconds per decode token of the batch

    @property
    def busy(self) -> bool:
        return bool(self.prefilling) or bool(self.running)

    def start_prefill(
        self, now: float, cost: CostModel, *, boundary: bool = False
    ) -> tuple[list[SimRequest], float] | None:
        """Start prefilling the queue's head, with the requests behind it that fit in its
        steps' leftover token budget (the engine's scheduler admits waiting requests into
        a step while its ``prefill_chunk`` budget lasts: a few short prompts share one
        step), if none is prefilling and their blocks fit; returns them and how long
        until their first token (the rest of the step under way, then the prefill of
        their uncached tokens together and any copy from the host tier).

        ``boundary``: a step ends now (a prefill's last or a reply's). A head that was
        already waiting is scheduled into the step that begins now, as the engine's
        scheduler takes its waiting requests at every step; one that arrives now (a
        client's next request, sent when its reply ended) waits for that step."""
        if self.prefilling or not self.queue:
            return None
        waited = boundary and self.queue[0].arrival < now
        group: list[SimRequest] = []
        tokens = swapped_total = 0
        capacity = 0.0  # the head's steps' token budget
        while self.queue:
            request = self.queue[0]
            if group:  # a follower joins only within the head's steps' budget
                cached = self.cache.cached_tokens(request.tokens)
                if tokens + len(request.tokens) - cached > capacity:
                    break
                if _computing_more_of(group, request.tokens, cached):
                    break  # it waits for those blocks (the engine's scheduler defers it)
            if not self._admit(request):
                break  # the head waits for a running request to free blocks
            group.append(request)
            uncached = len(request.tokens) - request.cached
            tokens += uncached
            swapped_total += request.swapped_blocks
            if len(group) == 1:
                capacity = cost.prefill_steps(uncached, self.scale) * cost.prefill_chunk
                capacity *= self.scale
        if not group:
            return None
        self.advance(now, cost)  # the batch's progress so far, at its decode rate
        rest = 0.0  # of the step under way, in decode tokens
        if self.running and not waited:  # on a boundary the next step has begun
            rest = math.floor(self.progress + 1e-9) + 1.0 - self.progress
        took = rest * cost.step_s(len(self.running), self.scale) if self.running else 0.0
        took += cost.prefill_s(tokens, self.scale)
        took += cost.swap_in_s(swapped_total, self.scale)
        self.prefill_step_s = took / (rest + cost.prefill_steps(tokens, self.scale))
        self.prefilling = group
        return group, took

    def _admit(self, request: SimRequest) -> bool:
        """Match the queue's head in the cache (promoting host blocks), reserve blocks for
        prompt + reply and pop it; False (nothing held) when the blocks do not fit. A
        request's prefix match happens when its prefill starts, as in a real scheduler."""
        cache, n = self.cache, len(request.tokens)
        match = cache.match(request.tokens)
        host_tokens = match.host_tokens
        swapped = 0
        need = math.ceil((n + len(request.reply)) / BLOCK_SIZE)
        if host_tokens:  # copy the host tier's blocks in before the prefill
            # Only if the whole request then fits, as the engine's scheduler does.
            device = len(match.block_ids) - math.ceil(host_tokens / BLOCK_SIZE)
            # (A partial last block is released before the allocation: it is room.)
            if cache.room() < need - device:
                cache.release(match.block_ids)
                return False
            cached = match.cached_tokens
            match, swapped = cache.promote(match)
            if match.cached_tokens < cached:  # cut before the first block left on the host
                host_tokens = swapped * BLOCK_SIZE
        self.unpaid_swap_blocks += swapped  # copied now, paid by the next prefill to start
        held = list(match.block_ids)
        if match.cached_tokens % BLOCK_SIZE:  # a shared partial block: copy-on-write
            cache.release(held[-1:])
            held = held[:-1]
        try:
            fresh = cache.allocate(need - len(held))
        except CacheFull:
            cache.release(held)
            return False
        self.queue.popleft()
        request.block_ids = held + fresh
        request.cached = match.cached_tokens
        request.host_cached = host_tokens
        request.swapped_blocks, self.unpaid_swap_blocks = self.unpaid_swap_blocks, 0
        return True

    def finish_prefill(self, now: float, cost: CostModel) -> list[SimRequest]:
        """Commit the prompts and move the requests into the decode batch: their
        prefill's last step gave their first token."""
        group = self.prefilling
        assert group
        self.advance(now, cost)  # at the prefill's step rate
        self.prefilling = []
        for request in group:
            self.cache.commit(request.tokens, request.block_ids)
            request.first_token_at = now
            end = self.progress + max(0, len(request.reply) - 1)
            self.joined += 1
            heapq.heappush(self.running, (end, self.joined, request))
        return group

    def finish_decode(self, now: float, cost: CostModel) -> SimRequest:
        """The first reply to end: commit prompt + reply, release its blocks."""
        self.advance(now, cost)
        end, _joined, request = heapq.heappop(self.running)
        self.progress = max(self.progress, end)  # float drift
        full = request.tokens + request.reply
        self.cache.commit(full, request.block_ids)
        self.cache.release(request.block_ids)
        return request

    def token_s(self, cost: CostModel) -> float:
        """Seconds per token of the decode batch now: a decode step, or while a prompt
        prefills, one of its steps."""
        if self.prefilling:
            return self.prefill_step_s
        return cost.step_s(len(self.running), self.scale)

    def advance(self, now: float, cost: CostModel) -> None:
        """Move the fluid batch's progress V up to ``now``."""
        if self.running:
            self.progress += (now - self.progress_at) / self.token_s(cost)
        self.progress_at = now

    def reschedule(self, now: float, cost: CostModel) -> float | None:
        """Invalidate the pending decode-done event; when the next reply ends, if any."""
        self.version += 1
        if not self.running:
            return None
        left = max(0.0, self.running[0][0] - self.progress)
        return now + left * self.token_s(cost)
