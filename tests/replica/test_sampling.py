from __future__ import annotations

import pytest
import torch

from replica.request import SamplingParams
from replica.sampling import adjust_logits, make_generator, sample_token


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
    # 5e-324 rounds to 0 in float32: the most likely token must still be kept.
    tiny = (SamplingParams(top_p=1e-6, seed=0), SamplingParams(top_p=5e-324, seed=0))
    for params in (SamplingParams(top_k=1, seed=0), *tiny):
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
        SamplingParams(temperature=float("nan")),
        SamplingParams(temperature=float("inf")),
        SamplingParams(seed=2**63),
        SamplingParams(seed=-(2**63) - 1),
        SamplingParams(presence_penalty=2.5),
        SamplingParams(frequency_penalty=float("nan")),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(logit_bias={-1: 1.0}),
        SamplingParams(logit_bias={3: 101.0}),
    ],
)
def test_bad_params_are_refused(bad: SamplingParams) -> None:
    with pytest.raises(ValueError):
        bad.validate()


def test_temperatures_under_1e_5_are_greedy_and_draw_nothing() -> None:
    logits = _logits()
    for temperature in (0.0, 1e-40, 5e-324, 9.9e-6):
        params = SamplingParams(temperature=temperature, seed=1)
        assert params.greedy and make_generator(params, 0) is None
        assert sample_token(logits, params, None) == int(logits.argmax())
    assert not SamplingParams(temperature=1e-5).greedy


def test_choice_seeds_wrap_to_64_bits() -> None:
    logits = _logits()
    params = SamplingParams(seed=2**63 - 1, n=3)
    draws = [sample_token(logits, params, make_generator(params, i)) for i in range(3)]
    assert len(draws) == 3  # seed + 1 and seed + 2 do not overflow the generator


def test_logit_bias_can_force_or_ban_a_token() -> None:
    logits = _logits()
    best = int(logits.argmax())
    forced = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert sample_token(logits, forced, None) == 7
    banned = SamplingParams(temperature=0.0, logit_bias={best: -100.0})
    assert sample_token(logits, banned, None) != best


def test_penalties_follow_openai_and_vllm() -> None:
    scores = torch.tensor([2.0, -2.0, 1.0, 0.5])
    prompt, output = [3], [0, 0, 1]
    tokens = [*prompt, *output]
    rep = adjust_logits(scores, SamplingParams(repetition_penalty=2.0), tokens, 1)
    # Seen tokens (0 and 1 in the output, 3 in the prompt) move towards "less likely".
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.25]
    freq = adjust_logits(scores, SamplingParams(frequency_penalty=0.5), tokens, 1)
    assert freq.tolist() == [1.0, -2.5, 1.0, 0.5]  # per output occurrence; the prompt is free
    pres = adjust_logits(scores, SamplingParams(presence_penalty=0.5), tokens, 1)
    assert pres.tolist() == [1.5, -2.5, 1.0, 0.5]  # once per token that occurred
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample_token(scores, greedy, None, [0, 0], 0) == 2  # token 0 penalised by 4


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-5])
def test_extreme_penalties_and_temperatures_still_draw_a_token(temperature: float) -> None:
    # repetition_penalty 1e-300 divides positive logits of seen tokens into +inf and a
    # temperature at the greedy bound overflows the rest: a token is still drawn.
    logits = _logits()
    seen = torch.topk(logits, 3).indices.tolist()
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-300, seed=0)
    gen = make_generator(params, 0)
    token = sample_token(logits, params, gen, seen, len(seen))
    assert 0 <= token < logits.shape[0]


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(min_p=0.5, seed=0)  # keeps p >= 0.25: tokens 0 and 1
    gen = make_generator(params, 0)
    assert {sample_token(logits, params, gen) for _ in range(300)} == {0, 1}
    loose = SamplingParams(min_p=0.05, seed=0)
    gen = make_generator(loose, 0)
    assert {sample_token(logits, loose, gen) for _ in range(600)} == {0, 1, 2, 3}


def test_allowed_ids_and_bans_mask_greedy_and_sampled_draws() -> None:
    logits = _logits()
    order = torch.argsort(logits, descending=True).tolist()
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[order[3], order[7]])
    assert sample_token(logits, allowed, None) == order[3]
    assert sample_token(logits, allowed, None, banned={order[3]}) == order[7]
    greedy = SamplingParams(temperature=0.0)
    assert sample_token(logits, greedy, None, banned={order[0], order[1]}) == order[2]
    sampled = SamplingParams(temperature=1.5, seed=4, allowed_token_ids=order[:6])
    gen = make_generator(sampled, 0)
    seen = {sample_token(logits, sampled, gen, banned={order[0]}) for _ in range(300)}
    assert seen <= set(order[1:6]) and len(seen) > 1


def test_the_allowed_ids_mask_is_made_once_per_request() -> None:
    """The list may be the whole vocabulary: it is turned into a mask at the first draw,
    not at every token."""
    logits = _logits()
    params = SamplingParams(temperature=0.0, allowed_token_ids=list(range(0, 500, 7)))
    first = sample_token(logits, params, None)
    mask = params.allowed_mask
    assert mask is not None and first % 7 == 0
    assert sample_token(logits, params, None) == first and params.allowed_mask is mask
