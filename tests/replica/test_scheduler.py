"""The scheduler alone: what each forward computes, admission, preemption, forks, prefix
sharing, and failure containment, with invariants checked after every step.

The model is replaced by its seam, the forward function: a "count up" model whose next
token is always the last input token + 1, so every output is known in advance and every
forward's size is recorded. Cache, pool, attention metadata and sampling are the real
ones; the real model is tested through the engine (test_engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from replica.attention import PagedBatch
from replica.pool import BlockPool, PoolShape
from replica.prefix_cache import PrefixCache
from replica.request import Delta, RequestOutput, RequestState, SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig

VOCAB = 512
B = 4


class CountUp:
    """Forward: logits [K, V] one-hot at (the row's input token + 1); records sizes."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.sizes: list[int] = []
        self.fail_on_call = fail_on_call

    def __call__(
        self, input_ids: torch.Tensor, batch: PagedBatch, rows: torch.Tensor
    ) -> torch.Tensor:
        self.sizes.append(int(input_ids.numel()))
        if len(self.sizes) == self.fail_on_call:
            raise RuntimeError("device error (injected)")
        nxt = (input_ids[rows] + 1) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float()  # [K, V]


class Decoder:
    """Token i reads "<i>"; raises on ``poison`` (a detokenizer failure)."""

    def __init__(self, poison: int | None = None) -> None:
        self.poison = poison

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.poison is not None and self.poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return "".join(f"<{i}>" for i in ids)


class Sink:
    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.output: RequestOutput | None = None

    def deliver(self, delta: Delta) -> None:
        assert self.output is None, "delta after close"
        self.deltas.append(delta)

    def close(self, output: RequestOutput) -> None:
        assert self.output is None, "closed twice"
        self.output = output


def make(
    num_blocks: int = 32, budget: int = 64, max_running: int = 8, forward: CountUp | None = None
) -> Scheduler:
    cache = PrefixCache(num_blocks, B, "m")
    pool = BlockPool(PoolShape(1, 1, 2, B, torch.float32), num_blocks, "cpu")
    config = SchedulerConfig(max_prefill_tokens_per_step=budget, max_running=max_running)
    return Scheduler(cache, pool, forward or CountUp(), config, max_context=256)


def add(
    sched: Scheduler, rid: str, prompt: list[int], decoder: Decoder | None = None, **params: Any
) -> Sink:
    sink = Sink()
    request = RequestState(
        request_id=rid,
        prompt_token_ids=prompt,
        params=SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **params}),
        salt="",
        stop_token_ids=frozenset(),
        sink=sink,
        submitted_at=0.0,
    )
    sched.add(request, decoder or Decoder())
    return sink


def step(sched: Scheduler) -> None:
    sched.step()
    sched.check_invariants()


def drain(sched: Scheduler) -> None:
    for _ in range(500):
        if not sched.has_work:
            break
        step(sched)
    assert not sched.has_work
    assert sched.cache.stats().pinned_blocks == 0


def tokens(sink: Sink) -> list[list[int]]:
    assert sink.output is not None and sink.output.error is None, sink.output
    return [c.token_ids for c in sink.output.choices]


def test_chunked_prefill_keeps_to_the_budget_then_decodes_one_token_a_step() -> None:
    forward = CountUp()
    sched = make(budget=8, forward=forward)
    sink = add(sched, "a", list(range(10, 30)))  # 20 prompt tokens
    drain(sched)
    assert forward.sizes == [8, 8, 4, 1, 1, 1]
    assert tokens(sink) == [[30, 31, 32, 33]]
    assert "".join(d.text for d in sink.deltas) == "<30><31><32><33>"
    assert [d.finish_reason for d in sink.deltas][-1] == "length"


def test_decoders_and_a_new_prefill_share_one_forward() -> None:
    forward = CountUp()
    sched = make(forward=forward)
    first = add(sched, "a", [1, 2, 3])
    step(sched)  # a: prompt
    second = add(sched, "b", [100, 101, 102, 103, 104])
    step(sched)  # a decodes one token while b prefills five
    assert forward.sizes == [3, 6]
    drain(sched)
    assert tokens(first) == [[4, 5, 6, 7]] and tokens(second) == [[105, 106, 107, 108]]


def test_max_running_holds_the_rest_in_the_queue() -> None:
    forward = CountUp()
    sched = make(max_running=1, forward=forward)
    first, second = add(sched, "a", [1, 2]), add(sched, "b", [50, 51])
    step(sched)
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    drain(sched)
    assert forward.sizes == [2, 1, 1, 1, 2, 1, 1, 1]  # b starts when a is done
    assert tokens(first) == [[3, 4, 5, 6]] and tokens(second) == [[52, 53, 54, 55]]


def test_a_full_pool_preempts_the_newest_and_outputs_stay_right() -> None:
    sched = make(num_blocks=5)  # 20 token slots; each request grows to 14 tokens
    sinks = [
        add(sched, rid, [base + i for i in range(6)], max_tokens=8)
        for rid, base in (("a", 10), ("b", 200))
    ]
    drain(sched)
    assert sched.num_preemptions >= 1
    assert tokens(sinks[0]) == [list(range(16, 24))]
    assert tokens(sinks[1]) == [list(range(206, 214))]


def test_n_choices_fork_from_one_prefill() -> None:
    forward = CountUp()
    sched = make(forward=forward)
    sink = add(sched, "a", list(range(10, 19)), n=3)  # 9 tokens: a shared partial block
    step(sched)
    assert forward.sizes == [9]
    assert len(sched.running) == 3
    step(sched)
    assert forward.sizes == [9, 3]  # three decoders, one token each
    drain(sched)
    assert tokens(sink) == [[19, 20, 21, 22]] * 3


def test_a_request_waits_for_a_running_prefill_of_its_prompt_and_shares_it() -> None:
    forward = CountUp()
    sched = make(budget=4, forward=forward)
    prompt = list(range(40, 52))  # 3 full blocks
    first = add(sched, "a", prompt)
    step(sched)  # a computes 4 of 12
    second = add(sched, "b", prompt)
    drain(sched)
    assert tokens(first) == tokens(second) == [[52, 53, 54, 55]]
    assert second.output is not None and second.output.cached_tokens == 11
    assert sum(forward.sizes) == 12 + 3 + 1 + 3  # b computed one prompt token


def test_a_request_failing_in_sampling_fails_alone() -> None:
    sched = make()
    good = add(sched, "good", [1, 2, 3], max_tokens=6)
    bad = add(sched, "bad", [7, 8, 9], logit_bias={10**6: 1.0})  # past the vocabulary
    drain(sched)
    assert bad.output is not None and bad.output.error is not None
    assert "sampling" in bad.output.error and "bad" in bad.output.error
    assert [c.finish_reason for c in bad.output.choices] == ["abort"]
    assert tokens(good) == [[4, 5, 6, 7, 8, 9]]


def test_a_request_failing_to_detokenize_fails_alone_mid_output() -> None:
    sched = make()
    good = add(sched, "good", [1, 2, 3])
    bad = add(sched, "bad", [20, 21], decoder=Decoder(poison=24), max_tokens=8, n=2)
    drain(sched)
    assert bad.output is not None and bad.output.error is not None
    assert [d.token_ids for d in bad.deltas if d.token_ids][:2] == [[22], [22]]  # two choices
    assert tokens(good) == [[4, 5, 6, 7]]


def test_a_failing_forward_fails_its_step_and_the_queue_goes_on() -> None:
    sched = make(max_running=2, forward=CountUp(fail_on_call=2))
    a, b = add(sched, "a", [1, 2]), add(sched, "b", [30, 31])
    later = add(sched, "c", [60, 61])  # queued behind max_running: not in the failed step
    step(sched)  # a and b prefill together
    step(sched)  # their first decode: the forward raises
    for sink in (a, b):
        assert sink.output is not None and sink.output.error is not None
        assert "running the model" in sink.output.error
    assert sched.cache.stats().pinned_blocks == 0
    drain(sched)
    assert tokens(later) == [[62, 63, 64, 65]]


def test_abort_frees_every_block_at_once() -> None:
    sched = make()
    sink = add(sched, "a", list(range(10, 30)), max_tokens=50, n=2)
    step(sched)
    step(sched)
    assert sched.cache.stats().pinned_blocks > 0
    sched.abort("a")
    assert sched.cache.stats().pinned_blocks == 0 and not sched.has_work
    assert sink.output is not None and sink.output.error is None
    assert {c.finish_reason for c in sink.output.choices} == {"abort"}


@pytest.mark.parametrize("n", [1, 3])
def test_fail_all_closes_every_handle_once(n: int) -> None:
    sched = make(max_running=1)
    sinks = [add(sched, rid, [5, 6, 7], n=n) for rid in "abc"]
    step(sched)
    sched.fail_all(RuntimeError("injected"), "testing")
    assert not sched.has_work and sched.cache.stats().pinned_blocks == 0
    assert all(s.output is not None and s.output.error is not None for s in sinks)
    sched.check_invariants()


def test_queued_prefill_tokens_count_a_waiting_prompt_beyond_its_cached_prefix() -> None:
    sched = make(max_running=1)
    add(sched, "a", list(range(1, 13)))  # 12 tokens: 3 full blocks once done
    drain(sched)
    add(sched, "b", list(range(100, 106)))  # runs, holding the only slot
    add(sched, "c", [*range(1, 13), 50, 51, 52, 53, 54])  # 12 cached + 5 new
    add(sched, "d", list(range(200, 210)))  # nothing cached
    step(sched)
    assert [s.request.request_id for s in sched.waiting] == ["c", "d"]
    # b decodes (1 token left: not prefill); c computes 17 - 12, d all 10.
    queries = sched.cache.stats().queries
    assert sched.queued_prefill_tokens == 5 + 10
    assert sched.cache.stats().queries == queries  # a look, not a query
    assert sched.cache.stats().pinned_blocks == len(sched.running[0].block_ids)  # no pins
    drain(sched)
    assert sched.queued_prefill_tokens == 0


def test_a_prompt_whose_tokens_are_scored_is_queued_and_computed_whole() -> None:
    """Prompt log probabilities need every prompt position's logits: the prompt is
    computed past its cached prefix (as vLLM does), so its queue report counts it whole,
    and its answer reports nothing cached; the next prompt finds it all cached."""
    sched = make(max_running=1)
    add(sched, "a", list(range(1, 13)))  # 3 full blocks once done
    drain(sched)
    add(sched, "b", list(range(100, 106)))  # runs, holding the only slot
    scored = add(sched, "c", [*range(1, 13), 50, 51, 52, 53, 54], prompt_logprobs=0)
    step(sched)
    assert [s.request.request_id for s in sched.waiting] == ["c"]
    assert sched.queued_prefill_tokens == 17  # not 17 - 12
    drain(sched)
    assert scored.output is not None and scored.output.cached_tokens == 0
    table = scored.output.prompt_logprobs
    assert table is not None and len(table) == 17 and table[0] is None
    assert [lp.token_id for lp in table[1:] if lp is not None] == [
        *range(2, 13),
        50,
        51,
        52,
        53,
        54,
    ]
    again = add(sched, "d", [*range(1, 13), 50, 51, 52, 53, 54, 60])
    drain(sched)
    assert again.output is not None and again.output.cached_tokens == 16


def test_a_prompt_that_waits_for_blocks_is_counted_once_when_admitted() -> None:
    # A waiting prompt is looked up in the cache at every step until it fits. Counted
    # at each lookup, it would weigh in the hit statistics once per step it waited (as
    # vLLM's counters did, vllm-project/vllm#43736); it counts once, at admission, with
    # the cached tokens its response reports.
    sched = make(num_blocks=10)
    add(sched, "a", list(range(1, 13)))  # 3 blocks, cached once done
    drain(sched)
    before = sched.cache.stats()
    hog = add(sched, "hog", list(range(100, 124)), max_tokens=8)  # 6 blocks, then 8
    step(sched)
    late = add(sched, "late", [*range(1, 13), 50, 51, 52, 53, 54], max_tokens=2)  # 5 blocks
    waited = 0
    while not any(s.request.request_id == "late" for s in sched.running):
        step(sched)
        waited += 1
    assert waited >= 2  # it was looked up at least twice before it fit
    drain(sched)
    stats = sched.cache.stats()
    assert late.output is not None and hog.output is not None
    assert stats.queries - before.queries == 2  # hog and late, once each
    # (hog's growth evicted one of a's blocks while late waited: 8 of its 12 are left)
    assert stats.hit_tokens - before.hit_tokens == late.output.cached_tokens == 8
    assert stats.query_tokens - before.query_tokens == 24 + 17


def test_queued_prefill_tokens_count_a_prefix_shared_with_a_prompt_ahead_once() -> None:
    # Two waiting prompts share 16 tokens (4 full blocks) that nobody holds yet: the
    # first computes them and the second finds them cached (it is even deferred until
    # they are), so the second adds only its own tail to the reported queue. Reported
    # whole, a burst on one new document looked like a long queue to the router, which
    # then copied the document elsewhere. A prompt sharing less than a block adds all.
    sched = make(max_running=1)
    add(sched, "b", list(range(100, 106)))  # runs, holding the only slot
    step(sched)
    shared = list(range(1, 17))
    add(sched, "p1", [*shared, 50, 51, 52])  # 19 tokens, nothing cached
    add(sched, "p2", [*shared, 60, 61, 62])  # the same 16, then its own 3
    add(sched, "p3", [*shared[:3], 70, 71, 72, 73])  # shares less than a block
    assert [s.request.request_id for s in sched.waiting] == ["p1", "p2", "p3"]
    assert sched.queued_prefill_tokens == 19 + 3 + 7
    drain(sched)
    assert sched.queued_prefill_tokens == 0
