"""Log probabilities from the engine, against a plain forward pass of the same model: of
the tokens it samples and of a prompt's, whatever the cache holds, however the prompt
is chunked, for every choice."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from replica.engine import Engine, EngineConfig
from replica.models import LoadedModel, load_model
from replica.request import RequestOutput, SamplingParams, TokenLogprob
from tests.replica.test_engine import _assert_idle_and_unpinned, _prompt, running

TOL = 1e-4  # paged attention in a batch against one plain forward: float32 noise


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", dtype="float32")


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same weights without paged attention: log-softmax of every position's logits."""
    plain = load_model("tiny-random", dtype="float32").model

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = plain(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)  # [T, V]: row p scores token p + 1

    return logprobs


def _check(lp: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert lp.token_id == token
    assert math.isclose(lp.logprob, float(row[token]), abs_tol=TOL)
    # The rank counts every token at least as likely; tokens within float noise may
    # fall either side.
    surely_above = int((row > row[token] + TOL).sum())
    maybe_above = int((row >= row[token] - TOL).sum())
    assert surely_above + 1 <= lp.rank <= maybe_above
    # The k likeliest, likeliest first (near-ties may swap: compare values, not order).
    assert len(lp.top) == k
    for (t, value), expected in zip(lp.top, torch.topk(row, k).values.tolist(), strict=True):
        assert math.isclose(value, expected, abs_tol=TOL)
        assert math.isclose(value, float(row[t]), abs_tol=TOL)


def _check_output(out: RequestOutput, prompt: list[int], ref: Any, k: int, pk: int) -> None:
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for choice in out.choices:
        tokens = [*prompt, *choice.token_ids]
        rows = ref(tokens)
        for p in range(1, len(prompt)):
            scored = out.prompt_logprobs[p]
            assert scored is not None
            _check(scored, rows[p - 1], prompt[p], pk)
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
        for j, lp in enumerate(choice.logprobs):
            _check(lp, rows[len(prompt) - 1 + j], choice.token_ids[j], k)


def test_sampled_and_prompt_logprobs_equal_a_plain_forward(
    tiny: LoadedModel, reference: Any
) -> None:
    prompt = _prompt(7, 45)
    greedy = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    sampled = SamplingParams(
        max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    with running(tiny) as engine:
        out = engine.generate(prompt, greedy)
        many = engine.generate(prompt, sampled)
        _assert_idle_and_unpinned(engine)
    _check_output(out, prompt, reference, 3, 2)
    assert all(lp.rank == 1 for lp in out.choices[0].logprobs or [])  # greedy: the likeliest
    _check_output(many, prompt, reference, 0, 0)
    assert len(many.choices) == 2 and many.choices[0].token_ids != many.choices[1].token_ids


def test_prompt_logprobs_compute_a_cached_prompt_and_survive_chunking(
    tiny: LoadedModel, reference: Any
) -> None:
    """A prompt the cache holds is computed again for its scores (its logits exist only
    where it is computed, and vLLM does the same); in 16-token chunks they are the same."""
    prompt = _prompt(8, 70)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    with running(tiny, max_prefill_tokens_per_step=16) as engine:
        engine.generate(prompt, plain)
        warm = engine.generate(prompt, plain)
        scored = engine.generate(prompt, params)
        after = engine.generate(prompt, plain)
        _assert_idle_and_unpinned(engine)
    assert warm.cached_tokens == 64
    assert scored.cached_tokens == 0
    assert after.cached_tokens == 64  # what it computed is cached for the next
    _check_output(scored, prompt, reference, 1, 1)
    assert scored.choices[0].token_ids == warm.choices[0].token_ids


def test_prompt_logprobs_of_preempted_requests(tiny: LoadedModel, reference: Any) -> None:
    """Under pool pressure a request is preempted and computed again: its scores are
    still one per prompt token, and those of a plain forward."""
    prompts = [_prompt(40 + i, 40) for i in range(6)]
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    engine = Engine(tiny, EngineConfig(num_blocks=16, check_invariants=True))
    handles = [engine.submit(p, params) for p in prompts]
    engine.start()
    outs = [h.wait(120) for h in handles]
    _assert_idle_and_unpinned(engine)
    engine.stop()
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        _check_output(out, prompt, reference, 1, 1)


def test_deltas_carry_each_tokens_logprob_and_the_first_the_prompts(tiny: LoadedModel) -> None:
    prompt = _prompt(9, 20)
    params = SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2
    )
    with running(tiny) as engine:
        handle = engine.submit(prompt, params)
        deltas = list(handle)
        out = handle.wait(60)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert [lp for d in mine for lp in d.logprobs or []] == out.choices[index].logprobs
        assert mine[0].prompt_logprobs == out.prompt_logprobs
        assert all(d.prompt_logprobs is None for d in mine[1:])


def test_out_of_range_counts_are_refused(tiny: LoadedModel) -> None:
    with running(tiny) as engine:
        for params in (SamplingParams(logprobs=21), SamplingParams(prompt_logprobs=-1)):
            with pytest.raises(ValueError, match="logprobs must be in"):
                engine.submit([1, 2, 3], params)
