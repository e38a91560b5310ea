"""Continuous batching: which sequences compute which tokens in the next forward.

A sequence (one choice of a request) moves waiting → running → finished::

    waiting   holds no blocks. Admission: prefix match (pins the cached blocks), allocate
              blocks for every token it holds, copy the shared partial block if any.
              Deferred while a running sequence is still prefilling a longer piece of
              its prompt than the cache holds: it is admitted once those blocks are
              committed, and shares them instead of computing them again.
    running   each step computes tokens [num_computed, len(token_ids)):
              prefill chunks under ``max_prefill_tokens_per_step``, and every decoding
              sequence (one token left) in the same forward.
    finished  commit the computed tokens' blocks to the cache, release them.

Pool full while a decoder needs a block: preempt the most recently admitted other
sequence (commit + release its blocks, back to the front of the queue, recompute later).
Only pinned blocks are never evicted, and preemption only releases pins, so the pool
always drains: no deadlock. A sequence that alone fills the pool ends with ``length``.

Failures are contained: an exception while setting up, sampling or detokenizing for one
request fails that request (``fail``: blocks released, its handle closed with an error);
an exception in a step's forward fails the requests scheduled in it. Either way the
other requests and the scheduler go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from replica.detokenize import IncrementalDetokenizer, StopStringMatcher, TokenDecoder
from replica.grammar import new_matcher
from replica.prefix_cache import CacheFull, PrefixCache, PrefixMatch
from replica.request import Delta, RequestState, SequenceState
from replica.runner import BlockLayout, ForwardFn, SeqSlice, StepRunner

log = logging.getLogger("prefixgate.replica.engine")


@dataclass(slots=True)
class SchedulerConfig:
    max_prefill_tokens_per_step: int = 512
    max_running: int = 64
    # Prefill budget charged per token whose KV is copied in from the host tier: a copy
    # over PCIe costs about a tenth of computing the token (a memcpy on CPU, less).
    swap_in_token_cost: float = 0.1


class Scheduler:
    """Owned by the engine thread; nothing here is thread-safe."""

    def __init__(
        self,
        cache: PrefixCache,
        pool: BlockLayout,
        forward: ForwardFn | None,
        config: SchedulerConfig,
        max_context: int,
        clock: Callable[[], float] = time.monotonic,
        runner: StepRunner | None = None,
    ) -> None:
        """``runner`` runs each step (``replica.runner``); without one, ``forward`` (the
        built-in model's, ``(input_ids [T], batch, rows [K]) -> logits [K, V]``) runs
        inside the torch step, and ``pool`` must be the tensor ``BlockPool``."""
        self.cache = cache
        self.pool = pool
        self.forward = forward
        if runner is None:
            if forward is None:
                raise ValueError("a scheduler needs a forward function or a step runner")
            from replica.pool import BlockPool  # torch only on this path
            from replica.torch_backend import TorchStep

            # Calls go through self.forward, so that replacing it takes effect.
            runner = TorchStep(cast(BlockPool, pool), self._forward)
        self.runner = runner
        self.config = config
        self.max_context = max_context
        self.clock = clock
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # admission order: preempt from the end
        self.requests: dict[str, RequestState] = {}
        self.num_preemptions = 0
        self.swapped_in_tokens = 0  # tokens whose KV came back from the host tier
        # (request id, choice) of each waiting sequence -> its cached prefix in tokens
        # when first counted (``queued_prefill_tokens``).
        self._waiting_cached: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------------- intake

    def add(self, request: RequestState, decoder: TokenDecoder) -> None:
        """Queue a new request. Choice 0 prefills; the others fork from it afterwards."""
        self.requests[request.request_id] = request
        try:
            for i in range(request.params.n):
                request.sequences.append(
                    SequenceState(
                        request=request,
                        index=i,
                        token_ids=list(request.prompt_token_ids),
                        detokenizer=IncrementalDetokenizer(
                            decoder, request.params.skip_special_tokens
                        ),
                        stop_matcher=StopStringMatcher(
                            request.params.stop, request.params.include_stop_str_in_output
                        ),
                        generator=self.runner.make_generator(request.params, i),
                        grammar=(
                            None
                            if request.params.grammar is None
                            else new_matcher(request.params.grammar)
                        ),
                    )
                )
        except Exception as exc:
            self.fail(request, exc, "setting up")
            return
        self.waiting.append(request.sequences[0])

    def fail(
        self, request: RequestState, exc: BaseException, doing: str, *, traceback: bool = True
    ) -> None:
        """End ``request`` now because handling it raised ``exc`` while ``doing``: its
        blocks are released (uncommitted: nothing computed for it is trusted) and its
        handle closes with an error. Other requests are untouched. ``traceback=False``
        when the caller logged it once for several requests."""
        log.error(
            "request %s failed while %s: %r",
            request.request_id,
            doing,
            exc,
            exc_info=exc if traceback else None,
        )
        for seq in request.sequences:
            if seq in self.running:
                self._release(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        request.error = (
            f"the replica failed while {doing} for this request ({type(exc).__name__}); "
            f"it was dropped and the replica goes on (request id {request.request_id} in "
            "its log)"
        )
        self._close(request)

    def fail_all(self, exc: BaseException, doing: str, *, release: bool = True) -> None:
        """``fail`` every request. ``release=False`` when the block bookkeeping itself
        cannot be trusted any more (the engine is going down): handles are closed only."""
        if release:  # (the dying engine logs its own error)
            log.error("failing all %d requests while %s", len(self.requests), doing, exc_info=exc)
        for request in list(self.requests.values()):
            if release:
                self.fail(request, exc, doing, traceback=False)
                continue
            for seq in request.sequences:
                seq.finish_reason = seq.finish_reason or "abort"
            request.error = f"the replica stopped while {doing} ({type(exc).__name__})"
            self._close(request)
        if not release:
            self.running.clear()
            self.waiting.clear()

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.finish_reason is not None:
                continue
            if seq in self.running:
                self._free(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            request.sink.deliver(seq.finish("abort"))
        self._close(request)

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: each waiting sequence's beyond its cached
        prefix, and the rest of each running prefill. Routers add this to their own
        view of the queue, which counts requests' uncached tokens only (router/load.py).
        A waiting sequence's prefix is looked up once, when first counted here. The
        full blocks of it that a prompt ahead (prefilling, or waiting before it) will
        compute count as cached too: it shares them once they are committed (a burst on
        one new prefix computes it once), so it adds only its own tail to the queue. A
        prompt whose tokens are scored counts whole: it is computed past the cache."""
        cached = self._waiting_cached
        now: dict[tuple[str, int], int] = {}
        total = 0
        # The prompts ahead by salt and first block, built at the first sequence not
        # counted yet (this runs after every step: a queue already counted costs O(n)).
        ahead: dict[tuple[str, tuple[int, ...]], list[SequenceState]] | None = None
        for s in self.waiting:
            key = (s.request.request_id, s.index)
            hit = cached.get(key)
            if hit is None and s.request.wants_prompt_logprobs:
                hit = 0  # its prompt is scored: computed whole, whatever is cached
            elif hit is None:
                if ahead is None:
                    ahead = {}
                    for other in self.running:
                        if other.num_computed < other.num_prompt:
                            self._add_ahead(ahead, other)
                    for other in self.waiting:
                        if other is s:
                            break
                        self._add_ahead(ahead, other)
                hit = self.cache.cached_tokens(s.token_ids, s.request.salt)
                hit = max(hit, self._shared_with(s, ahead.get(self._head(s), ())))
            now[key] = hit
            total += max(1, s.num_to_compute - hit)
            if ahead is not None:
                self._add_ahead(ahead, s)
        self._waiting_cached = now  # sequences no longer waiting drop out
        return total + sum(s.num_to_compute for s in self.running if s.num_to_compute > 1)

    def _head(self, seq: SequenceState) -> tuple[str, tuple[int, ...]]:
        """``seq``'s salt and first block: only prompts alike in both share blocks."""
        return seq.request.salt, tuple(seq.token_ids[: self.pool.block_size])

    def _add_ahead(
        self, ahead: dict[tuple[str, tuple[int, ...]], list[SequenceState]], seq: SequenceState
    ) -> None:
        if seq.num_prompt >= self.pool.block_size:  # a shorter prompt shares no full block
            ahead.setdefault(self._head(seq), []).append(seq)

    def _shared_with(self, seq: SequenceState, ahead: Sequence[SequenceState]) -> int:
        """The most prompt tokens, in full blocks, that ``seq`` shares with the prompt of
        a sequence in ``ahead`` (its first block and salt already alike), less one: what
        it will find cached once that prompt is computed."""
        bs = self.pool.block_size
        prompt = seq.token_ids[: seq.num_prompt]
        best = 0
        for other in ahead:
            limit = min(seq.num_prompt, other.num_prompt) // bs * bs
            n = best
            # A longer share than the best so far must agree up to it: check that first.
            if limit <= best or other.token_ids[:best] != prompt[:best]:
                continue
            while n + bs <= limit and other.token_ids[n : n + bs] == prompt[n : n + bs]:
                n += bs
            best = n
        return min(best, seq.num_prompt - 1)

    # ------------------------------------------------------------------------- one step

    def step(self) -> None:
        """Schedule, run one forward, sample, finish. No-op when idle."""
        for seq in list(self.running):
            if seq in self.running and seq.num_to_compute == 1:
                self._reserve_slot(seq)
        plan: dict[int, int] = {id(s): 1 for s in self.running if s.num_to_compute == 1}
        budget = self.config.max_prefill_tokens_per_step
        for seq in self.running:
            if budget > 0 and seq.num_to_compute > 1:
                plan[id(seq)] = min(seq.num_to_compute, budget)
                budget -= plan[id(seq)]
        while budget > 0 and self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if math.ceil(len(seq.token_ids) / self.pool.block_size) > self.pool.num_blocks:
                # It grew past the whole pool before it was preempted: it can never fit.
                self.waiting.popleft()
                self._emit(seq, seq.finish("length"))
                continue
            swapped = self.swapped_in_tokens
            if not self._admit(seq):
                break
            self.waiting.popleft()
            budget -= math.ceil((self.swapped_in_tokens - swapped) * self.config.swap_in_token_cost)
            if budget > 0:  # else the copy took this step's budget: it prefills next step
                plan[id(seq)] = min(seq.num_to_compute, budget)
                budget -= plan[id(seq)]
        scheduled = [s for s in self.running if id(s) in plan]
        if scheduled:
            self._run(scheduled, plan)

    def _run(self, scheduled: list[SequenceState], plan: dict[int, int]) -> None:
        slices = [SeqSlice(s.block_ids, s.num_computed, plan[id(s)]) for s in scheduled]
        input_ids: list[int] = []
        rows: list[int] = []
        sampling: list[SequenceState] = []
        # Prompt positions whose logits give the next prompt token's log probability:
        # (sequence, first position, how many), their rows after the sampling rows.
        scoring: list[tuple[SequenceState, int, int]] = []
        scored_rows: list[int] = []
        for seq, sl in zip(scheduled, slices, strict=True):
            offset = len(input_ids)
            input_ids += seq.token_ids[sl.start : sl.start + sl.num_new]
            if sl.start + sl.num_new == len(seq.token_ids):
                rows.append(len(input_ids) - 1)
                sampling.append(seq)
            if seq.request.wants_prompt_logprobs:
                count = min(sl.start + sl.num_new, seq.num_prompt - 1) - sl.start
                if count > 0:
                    scoring.append((seq, sl.start, count))
                    scored_rows += range(offset, offset + count)
        try:
            logits = self.runner.run(slices, input_ids, rows + scored_rows)  # an item per row
        except Exception as exc:
            log.error("a step of %d sequences failed", len(scheduled), exc_info=exc)
            for request in {id(s.request): s.request for s in scheduled}.values():
                self.fail(request, exc, "running the model", traceback=False)
            return
        now = self.clock()
        for seq in scheduled:
            was_prefilling = seq.num_computed < seq.num_prompt
            seq.num_computed += plan[id(seq)]
            if was_prefilling and seq.num_computed >= seq.num_prompt:
                self._prompt_done(seq, now)
        at = len(rows)  # before sampling: a prompt's first token carries its scores
        for seq, start, count in scoring:
            try:
                self._score_prompt(seq, start, [logits[at + i] for i in range(count)])
            except Exception as exc:
                self.fail(seq.request, exc, "computing prompt log probabilities")
            at += count
        for row, seq in enumerate(sampling):
            request = seq.request
            if request.request_id not in self.requests:
                continue  # failed earlier in this step
            try:
                self._sample(seq, logits[row], now)
            except Exception as exc:
                self.fail(request, exc, "sampling")

    def _forward(self, input_ids: Any, batch: Any, rows: Any) -> Any:
        assert self.forward is not None
        return self.forward(input_ids, batch, rows)

    def _sample(self, seq: SequenceState, logits: Any, now: float) -> None:
        """Draw the next token of ``seq`` (and of its forks, on its first token)."""
        request = seq.request
        targets = [seq]
        if not request.forked:
            targets += self._fork(seq)
        if request.first_token_at is None:
            request.first_token_at = now
        k = request.params.logprobs
        params = request.params
        for target in targets:
            early = len(target.token_ids) - target.num_prompt < params.min_tokens
            token = self.runner.sample(
                logits,
                params,
                target.generator,
                target.token_ids,
                target.num_prompt,
                banned=request.stop_token_ids if early else (),  # min_tokens not reached
                grammar=target.grammar,
            )
            if target.grammar is not None:
                target.grammar.accept_token(token)
            logprob = None if k is None else self.runner.logprobs([logits], [token], k)[0]
            delta = target.append_token(token, self.max_context, logprob)
            if request.prompt_logprobs is not None and len(target.output_token_ids) == 1:
                delta.prompt_logprobs = list(request.prompt_logprobs)  # an echo streams them
            self._emit(target, delta)

    def _score_prompt(self, seq: SequenceState, start: int, rows: list[Any]) -> None:
        """Record the log probabilities of prompt tokens ``start+1 .. start+len(rows)``
        from the logits of the positions before them (a recomputed prompt overwrites)."""
        request = seq.request
        k = request.params.prompt_logprobs
        assert k is not None
        targets = seq.token_ids[start + 1 : start + 1 + len(rows)]
        scored = self.runner.logprobs(rows, targets, k)
        table = request.prompt_logprobs
        assert table is not None, "a request that asks for them starts with one"
        for position, logprob in enumerate(scored, start + 1):
            if position < len(table):
                table[position] = logprob
            else:
                table.append(logprob)

    # ------------------------------------------------------------------------- blocks

    def _admit(self, seq: SequenceState) -> bool:
        """Match the cache, take blocks for every token of ``seq``; False if the pool
        cannot hold it now or a running prefill is computing more of its prompt (it
        stays first in the queue)."""
        request = seq.request
        bs = self.pool.block_size
        need_total = math.ceil(len(seq.token_ids) / bs)
        # Counted in the cache's statistics only when admitted (below): a prompt that
        # waits is looked up again every step.
        if request.wants_prompt_logprobs:
            hit = looked = PrefixMatch([], 0)  # scored positions need their own logits
        else:
            hit = looked = self.cache.match(seq.token_ids, request.salt, record=False)
        if not request.wants_prompt_logprobs and self._prefilling_more_of(
            seq, hit.cached_tokens // bs
        ):
            self.cache.release(hit.block_ids)
            return False
        if hit.host_tokens:  # copy the host tier's blocks in before the prefill
            # Only if the whole prompt then fits: a copy made for a prompt that waits
            # anyway evicts idle device blocks for nothing, and its own blocks may go
            # back to the host before the prompt is admitted (copied twice).
            device = len(hit.block_ids) - math.ceil(hit.host_tokens / bs)
            partial = hit.cached_tokens % bs != 0  # its copy-on-write block
            if self.running and self.cache.room() < need_total - device + partial:
                self.cache.release(hit.block_ids)
                return False
            hit, blocks_in = self.cache.promote(hit)
            self.swapped_in_tokens += blocks_in * bs
            if hit.cached_tokens < looked.cached_tokens:  # cut: the copied blocks only
                looked = PrefixMatch([], hit.cached_tokens, blocks_in * bs)
        partial = hit.cached_tokens % bs != 0
        try:
            fresh = self.cache.allocate(need_total - len(hit.block_ids) + int(partial))
        except CacheFull:
            self.cache.release(hit.block_ids)
            if self.running:
                return False  # running sequences will free blocks; retry next step
            # Nothing else is pinned, so ``need_total <= num_blocks`` fresh blocks exist;
            # only the extra copy-on-write block did not fit. Recompute without the hit.
            hit = looked = PrefixMatch([], 0)
            partial = False
            fresh = self.cache.allocate(need_total)
        blocks = list(hit.block_ids)
        if partial:
            # The matched last block is shared and read-only: copy it before writing.
            own = fresh.pop()
            self.pool.copy_block(blocks[-1], own)
            self.cache.release([blocks[-1]])
            blocks[-1] = own
        seq.block_ids = blocks + fresh
        seq.num_computed = hit.cached_tokens
        seq.shared_tail = False
        if request.admitted_at is None:  # (a preempted request's return is not counted)
            request.admitted_at = self.clock()
            request.cached_tokens = hit.cached_tokens
            self.cache.record(len(seq.token_ids), looked)
        self.running.append(seq)
        return True

    def _prefilling_more_of(self, seq: SequenceState, cached_blocks: int) -> bool:
        """Whether a running sequence (same salt) is still prefilling a prompt that
        shares at least one more full block with ``seq``'s prompt than the cache holds.
        That sequence always gets prefill budget before admissions, so it commits those
        blocks within a few steps (``_prompt_done``) and ``seq`` then matches them."""
        n = (cached_blocks + 1) * self.pool.block_size  # tokens up to the next full block
        if n > seq.num_prompt:
            return False
        head = seq.token_ids[:n]
        return any(
            other.num_computed < other.num_prompt
            and other.num_prompt >= n
            and other.request.salt == seq.request.salt
            and other.token_ids[:n] == head
            for other in self.running
        )

    def _reserve_slot(self, seq: SequenceState) -> None:
        """Make sure position ``num_computed`` has a private block to be written into."""
        bs = self.pool.block_size
        index = seq.num_computed // bs
        copy = seq.shared_tail and index == len(seq.block_ids) - 1
        if index < len(seq.block_ids) and not copy:
            return
        while True:
            try:
                (block,) = self.cache.allocate(1)
                break
            except CacheFull:
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                if victim is None:  # it alone fills the pool
                    self._free(seq)
                    self._emit(seq, seq.finish("length"))
                    return
                self._preempt(victim)
        if copy:
            old = seq.block_ids[-1]
            self.pool.copy_block(old, block)
            self.cache.release([old])
            seq.block_ids[-1] = block
            seq.shared_tail = False
        else:
            seq.block_ids.append(block)

    def _fork(self, seq: SequenceState) -> list[SequenceState]:
        """Choices 1..n-1 start from choice 0's computed prompt, sharing its blocks."""
        request = seq.request
        request.forked = True
        children = request.sequences[1:]
        shared = seq.num_computed % self.pool.block_size != 0
        for child in children:
            self.cache.pin(seq.block_ids)
            child.block_ids = list(seq.block_ids)
            child.num_computed = seq.num_computed
            child.shared_tail = shared
            self.running.append(child)
        seq.shared_tail = shared and bool(children)
        return children

    def _prompt_done(self, seq: SequenceState, now: float) -> None:
        """Publish the prompt's full blocks now, so concurrent requests can share them."""
        if seq.request.prefilled_at is None:
            seq.request.prefilled_at = now
        full = seq.num_prompt // self.pool.block_size
        if full:
            self.cache.commit(
                seq.token_ids[: full * self.pool.block_size], seq.block_ids[:full], seq.request.salt
            )

    def _preempt(self, seq: SequenceState) -> None:
        self._free(seq)
        self._waiting_cached.pop((seq.request.request_id, seq.index), None)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free(self, seq: SequenceState) -> None:
        """Commit what ``seq`` computed, then give its blocks back (in order)."""
        n = seq.num_computed
        used = math.ceil(n / self.pool.block_size)
        if n:
            self.cache.commit(seq.token_ids[:n], seq.block_ids[:used], seq.request.salt)
        self._release(seq)

    def _release(self, seq: SequenceState) -> None:
        """Give ``seq``'s blocks back (in order) and take it off the running list."""
        self.cache.release(seq.block_ids)
        seq.block_ids = []
        seq.shared_tail = False
        self.running.remove(seq)

    # ------------------------------------------------------------------------- output

    def _emit(self, seq: SequenceState, delta: Delta) -> None:
        request = seq.request
        request.sink.deliver(delta)
        if delta.finish_reason is None:
            return
        if seq in self.running:
            self._free(seq)
        if request.done:
            self._close(request)

    def _close(self, request: RequestState) -> None:
        if self.requests.pop(request.request_id, None) is None:
            return
        request.finished_at = self.clock()
        request.sink.close(request.output())
        # Its sequences point back at it: dropped, so that the request, its handle and
        # what they hold are freed when the last reference goes, not at the next
        # garbage collection (prefixgate/gc_heap.py). Nothing reads them after this.
        request.sequences = []

    def check_invariants(self) -> None:
        held = {b for s in self.running for b in s.block_ids}
        assert all(not s.block_ids for s in self.waiting), "a waiting sequence holds blocks"
        # Every pin belongs to a running sequence: nothing leaks, nothing is shared by luck.
        assert self.cache.stats().pinned_blocks == len(held), "pinned blocks != held blocks"
        for seq in self.running:
            assert seq.finish_reason is None
            assert len(seq.block_ids) * self.pool.block_size >= seq.num_computed
        self.cache.check_invariants()
