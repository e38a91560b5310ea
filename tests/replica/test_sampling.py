from __future__ import annotations

import pytest
import torch

from replica.request import SamplingParams
from replica.sampling import make_generator, sample_token


def _logits() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(500) * 3


def test_greedy_is_argmax_and_draws_nothing() -> None:
    logits = _logits()
    params = SamplingParams(temperature=0.0)
    assert make_generator(params, 0) is None
    assert sample_token(logits, params, None) == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_choices_differ() -> None:
    logits = _logits()
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(index: int) -> list[int]:
        gen = make_generator(params, index)
        return [sample_token(logits, params, gen) for _ in range(20)]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits()
    best = int(logits.argmax())
    for params in (SamplingParams(top_k=1, seed=0), SamplingParams(top_p=1e-6, seed=0)):
        gen = make_generator(params, 0)
        assert {sample_token(logits, params, gen) for _ in range(30)} == {best}


def test_top_k_restricts_to_the_k_most_likely() -> None:
    logits = _logits()
    params = SamplingParams(temperature=2.0, top_k=5, seed=3)
    gen = make_generator(params, 0)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    seen = {sample_token(logits, params, gen) for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(top_p=0.7, seed=0)
    gen = make_generator(params, 0)
    assert {sample_token(logits, params, gen) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(top_k=-2),
        SamplingParams(n=0),
        SamplingParams(stop=[""]),
    ],
)
def test_bad_params_are_refused(bad: SamplingParams) -> None:
    with pytest.raises(ValueError):
        bad.validate()
