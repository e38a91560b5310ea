"""The engine on tiny-random (and, marked slow, smollm2-135m): prefix reuse must not change
greedy output, batching must not change it, and every path must give its blocks back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from replica.engine import Engine, EngineConfig
from replica.models import LoadedModel, load_model
from replica.request import PromptTooLong, QueueFull, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", dtype="float32")


@contextmanager
def running(model: LoadedModel, **config: Any) -> Iterator[Engine]:
    engine = Engine(model, EngineConfig(**{"num_blocks": 128, "check_invariants": True, **config}))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop(timeout=30)
    assert engine.error is None


def _assert_idle_and_unpinned(engine: Engine) -> None:
    engine.run_until_idle(timeout=60)
    stats = engine.cache.stats()
    assert stats.pinned_blocks == 0
    engine.cache.check_invariants()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.mark.parametrize(("cached_len", "aligned"), [(48, True), (37, False)])
def test_greedy_with_cached_prefix_equals_without(
    tiny: LoadedModel, cached_len: int, aligned: bool
) -> None:
    head = _prompt(1, cached_len)
    prompt = [*head, *_prompt(2, 21)]
    with running(tiny) as cold:
        expected = cold.generate(prompt, GREEDY)
    assert expected.cached_tokens == 0
    with running(tiny) as warm:
        # max_tokens=1: the committed blocks hold exactly ``head`` (a partial tail if
        # not aligned, served by the exact-match layer and copied on write)
        warm.generate(head, SamplingParams(max_tokens=1, temperature=0.0))
        got = warm.generate(prompt, GREEDY)
        again = warm.generate(prompt, GREEDY)
        _assert_idle_and_unpinned(warm)
    assert got.cached_tokens == cached_len
    assert (cached_len % 16 == 0) == aligned
    assert got.choices[0].token_ids == expected.choices[0].token_ids
    assert again.cached_tokens > cached_len
    assert again.choices[0].token_ids == expected.choices[0].token_ids


def test_request_alone_equals_request_in_a_batch_of_8(tiny: LoadedModel) -> None:
    prompts = [_prompt(10 + i, 20 + 7 * i) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        alone = [engine.generate(p, params).choices[0].token_ids for p in prompts]
    engine = Engine(tiny, EngineConfig(num_blocks=128, check_invariants=True))
    handles = [engine.submit(p, params) for p in prompts]  # queued before start: one batch
    engine.start()
    batched = [h.wait(60).choices[0].token_ids for h in handles]
    _assert_idle_and_unpinned(engine)
    engine.stop()
    assert batched == alone


def test_a_burst_on_one_new_prefix_computes_it_once(tiny: LoadedModel) -> None:
    # Four requests on one new 200-token prefix, queued together: the first prefills it
    # (in chunks of 64 tokens here); the others wait for its blocks instead of
    # computing the same prefix alongside it, and then share them.
    head = _prompt(50, 200)
    prompts = [[*head, *_prompt(60 + i, 9)] for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        alone = [engine.generate(p, params).choices[0].token_ids for p in prompts]
    engine = Engine(
        tiny, EngineConfig(num_blocks=128, max_prefill_tokens_per_step=64, check_invariants=True)
    )
    handles = [engine.submit(p, params) for p in prompts]  # queued before start
    engine.start()
    outs = [h.wait(60) for h in handles]
    _assert_idle_and_unpinned(engine)
    engine.stop()
    assert [o.cached_tokens for o in outs] == [0, 192, 192, 192]  # 12 full blocks of 16
    assert [o.choices[0].token_ids for o in outs] == alone


def test_preemption_under_pool_pressure_keeps_greedy_output(tiny: LoadedModel) -> None:
    prompts = [_prompt(30 + i, 40) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        alone = [engine.generate(p, params).choices[0].token_ids for p in prompts]
    # 6 x 80 tokens need 30 blocks; 16 force preemption and recompute
    engine = Engine(tiny, EngineConfig(num_blocks=16, check_invariants=True))
    handles = [engine.submit(p, params) for p in prompts]
    engine.start()
    outs = [h.wait(120).choices[0].token_ids for h in handles]
    _assert_idle_and_unpinned(engine)
    engine.stop()
    assert engine.scheduler.num_preemptions > 0
    assert outs == alone


def test_n_choices_share_the_prompt_and_are_reproducible(tiny: LoadedModel) -> None:
    prompt = _prompt(3, 37)  # partial last block: forks copy it on write
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, n=3, ignore_eos=True)
    with running(tiny) as engine:
        first = engine.generate(prompt, params)
        second = engine.generate(prompt, params)
        greedy = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, n=2))
        _assert_idle_and_unpinned(engine)
    tokens = [c.token_ids for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert tokens == [c.token_ids for c in second.choices]
    assert len({tuple(t) for t in tokens}) == 3
    assert greedy.choices[0].token_ids == greedy.choices[1].token_ids


def test_stop_string_and_stop_token(tiny: LoadedModel) -> None:
    prompt = _prompt(4, 30)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        full = engine.generate(prompt, params).choices[0]
        assert full.finish_reason == "length" and len(full.token_ids) == 20
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
        cut = engine.generate(prompt, SamplingParams(**{**_fields(params), "stop": [stop]}))
        token = full.token_ids[5]
        by_id = engine.generate(
            prompt, SamplingParams(**{**_fields(params), "stop_token_ids": [token]})
        )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[: full.text.index(stop)]
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].token_ids == full.token_ids[: full.token_ids.index(token) + 1]


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__slots__}  # type: ignore[attr-defined]


def test_streamed_deltas_add_up_to_the_output(tiny: LoadedModel) -> None:
    async def main(engine: Engine) -> tuple[list[Any], Any]:
        handle = engine.submit(_prompt(5, 25), SamplingParams(max_tokens=9, temperature=0.0))
        deltas = [d async for d in handle]
        return deltas, handle.output

    with running(tiny) as engine:
        deltas, output = asyncio.run(main(engine))
    assert output is not None and deltas[-1].finish_reason == output.choices[0].finish_reason
    assert "".join(d.text for d in deltas) == output.choices[0].text
    assert [t for d in deltas for t in d.token_ids] == output.choices[0].token_ids
    assert all(d.finish_reason is None for d in deltas[:-1])
    t = output.timings
    assert 0 <= t.queued_s <= t.first_token_s <= t.total_s and t.decode_s >= 0


def test_cancel_frees_blocks_and_ends_with_abort(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
    with running(tiny, num_blocks=512) as engine:
        handle = engine.submit(_prompt(6, 50), params)
        stream = iter(handle)
        next(stream)  # it is decoding
        engine.cancel(handle.request_id)
        engine.cancel(handle.request_id)  # idempotent
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert handle.output is not None and handle.output.choices[0].finish_reason == "abort"
        _assert_idle_and_unpinned(engine)
        assert engine.alive
        assert engine.load().running == 0


def test_reset_prefix_cache_mid_request_keeps_its_output_and_frees_everything(
    tiny: LoadedModel,
) -> None:
    prompt = _prompt(8, 70)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        expected = engine.generate(prompt, params)  # also leaves its blocks cached
        warm = engine.generate(prompt, params)
        assert warm.cached_tokens >= 64
        engine.generate(_prompt(9, 48), params)  # another prompt's 3+ blocks, left idle
        idle = engine.cache.stats().cached_blocks
        handle = engine.submit(prompt, params)
        stream = iter(handle)
        next(stream)  # it holds its (cached) blocks and is decoding
        freed = engine.reset_prefix_cache().result(timeout=30)
        rest = list(stream)
        assert rest[-1].finish_reason == "length"
        output = handle.wait(30)
        # The reset freed the idle blocks, not the running request's: it kept its KV.
        assert output.choices[0].token_ids == expected.choices[0].token_ids
        assert 3 <= freed < idle
        _assert_idle_and_unpinned(engine)
        # The request re-registered its blocks on finishing; a second reset drops them.
        engine.reset_prefix_cache().result(timeout=30)
        assert engine.cache.stats().cached_blocks == 0
        assert engine.cache.stats().free_blocks == engine.pool.num_blocks
        cold = engine.generate(prompt, params)
        assert cold.cached_tokens == 0
        assert cold.choices[0].token_ids == expected.choices[0].token_ids
    with pytest.raises(RuntimeError):
        engine.reset_prefix_cache()  # stopped


def test_stop_aborts_remaining_work(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    handle = engine.submit(_prompt(7, 20), SamplingParams(max_tokens=10_000, ignore_eos=True))
    engine.start()
    next(iter(handle))
    engine.stop(timeout=30)
    assert not engine.alive
    assert handle.wait(1).choices[0].finish_reason == "abort"


def test_too_long_prompts_are_refused_clearly(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=8))
    with pytest.raises(PromptTooLong, match=r"8192 tokens but this model's context is 8192"):
        engine.submit([1] * 8192, GREEDY)
    with pytest.raises(PromptTooLong, match=r"200 tokens but this replica's KV pool"):
        engine.submit([1] * 200, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([10**9], GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        engine.submit([5, -1, 7], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([5, 49152], GREEDY)


def test_waiting_queue_is_bounded(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=32, max_waiting=2))
    engine.submit([1, 2, 3], GREEDY)
    engine.submit([1, 2, 3], GREEDY)
    with pytest.raises(QueueFull, match="max_waiting=2"):
        engine.submit([1, 2, 3], GREEDY)
    assert engine.load().waiting == 2


def test_chunked_prefill_of_a_long_prompt_matches_one_chunk(tiny: LoadedModel) -> None:
    prompt = _prompt(8, 300)
    with running(tiny, max_prefill_tokens_per_step=4096) as whole:
        expected = whole.generate(prompt, GREEDY).choices[0].token_ids
    with running(tiny, max_prefill_tokens_per_step=64) as chunked:
        assert chunked.generate(prompt, GREEDY).choices[0].token_ids == expected


@pytest.mark.slow
def test_smollm2_greedy_with_cached_prefix_equals_without() -> None:
    model = load_model("smollm2-135m", dtype="float32")
    tok = model.tokenizer
    system = tok.encode("You are a careful assistant. " * 60)[:192]
    assert len(system) == 192
    for cached_len in (192, 181):  # block-aligned and not
        head = system[:cached_len]
        prompt = [*head, *tok.encode(" Question: what is the capital of France? Answer:")]
        with running(model, num_blocks=64) as cold:
            expected = cold.generate(prompt, GREEDY)
        with running(model, num_blocks=64) as warm:
            warm.generate(head, SamplingParams(max_tokens=1, temperature=0.0))
            got = warm.generate(prompt, GREEDY)
        assert got.cached_tokens == cached_len
        assert got.choices[0].token_ids == expected.choices[0].token_ids


def test_vllms_extras_min_tokens_include_stop_and_special_tokens(tiny: LoadedModel) -> None:
    """``min_tokens`` holds off stop tokens (not drawn) and stop strings (not looked for)
    until that many tokens; ``include_stop_str_in_output`` keeps the stop string;
    ``skip_special_tokens`` false keeps special tokens' text."""
    prompt = _prompt(5, 30)
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with running(tiny) as engine:
        full = engine.generate(prompt, base).choices[0]
        first = full.token_ids[0]
        stopped = engine.generate(
            prompt, SamplingParams(**{**_fields(base), "stop_token_ids": [first]})
        )
        held = engine.generate(
            prompt, SamplingParams(**{**_fields(base), "stop_token_ids": [first], "min_tokens": 4})
        )
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
        kept = engine.generate(
            prompt,
            SamplingParams(**{**_fields(base), "stop": [stop], "include_stop_str_in_output": True}),
        )
        special = tiny.tokenizer.eos_token_ids
        forced = {**_fields(base), "max_tokens": 2, "allowed_token_ids": sorted(special)[:1]}
        skipped = engine.generate(prompt, SamplingParams(**forced))
        shown = engine.generate(prompt, SamplingParams(**{**forced, "skip_special_tokens": False}))
        _assert_idle_and_unpinned(engine)
    assert stopped.choices[0].token_ids == [first]
    out = held.choices[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
    assert kept.choices[0].text == full.text[: full.text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"
    assert skipped.choices[0].text == ""
    assert shown.choices[0].text and shown.choices[0].token_ids == sorted(special)[:1] * 2
