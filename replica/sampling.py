"""Turning one sequence's next-token logits into a token id.

Each sequence draws from its own ``torch.Generator``, so a seeded request gives the same
tokens whatever else shares its batch, and a preempted sequence resumes the same stream.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence
from typing import Any

import torch

from replica.grammar import mask_logits
from replica.request import SamplingParams, TokenLogprob

SEED_MASK = 2**64 - 1  # torch generators take 64-bit seeds; choice seeds wrap around


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """Choice ``index``'s generator: ``seed + index`` when seeded, else a random seed.
    Greedy sequences draw nothing, so they get None."""
    if params.greedy:
        return None
    seed = params.seed + index if params.seed is not None else secrets.randbits(63)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & SEED_MASK)
    return gen


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    token_ids: Sequence[int] = (),
    num_prompt: int = 0,
    banned: Collection[int] = (),
    grammar: Any = None,
) -> int:
    """logits: [V] (any float dtype, any device); ``token_ids``: the sequence so far, its
    first ``num_prompt`` the prompt (for penalties); ``banned``: ids that may not be
    drawn now; ``grammar``: the sequence's matcher (structured output). Greedy under
    ``GREEDY_BELOW``. The order is vLLM's: the grammar's mask, allowed ids, bans, logit
    bias and penalties, then temperature, min-p, top-k, top-p."""
    if params.greedy and not (params.masks_logits or banned):
        return int(torch.argmax(logits).item())
    # Sampling runs on CPU in float32: the generator is a CPU one, and reproducibility
    # must not depend on the device's reduction order.
    scores = logits.detach().to(device="cpu", dtype=torch.float32)
    if grammar is not None:
        scores = scores.clone()  # (the copy may be the logits themselves)
        mask_logits(scores, grammar)
    scores = _finite(adjust_logits(scores, params, token_ids, num_prompt, banned))
    if params.greedy:
        return int(torch.argmax(scores).item())
    scores = scores / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(_finite(scores), dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    top_k = params.effective_top_k
    if top_k is not None and top_k < scores.shape[0]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    probs = torch.softmax(_finite(scores), dim=-1)
    if not bool(torch.isfinite(probs).all()):  # every score -inf: nothing left to draw from
        return int(torch.argmax(logits).item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """Extreme but valid parameters (``repetition_penalty`` 1e-300, a temperature just
    over the greedy bound) can push scores to inf or NaN: NaN is no candidate, +inf the
    largest float, so softmax and argmax stay defined."""
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(scores.dtype).max)


def adjust_logits(
    scores: torch.Tensor,
    params: SamplingParams,
    token_ids: Sequence[int],
    num_prompt: int,
    banned: Collection[int] = (),
) -> torch.Tensor:
    """scores: [V] float32 on CPU -> [V] with every id but ``allowed_token_ids`` and the
    ``banned`` ones masked, ``logit_bias`` and the penalties applied."""
    vocab = scores.shape[0]
    if params.allowed_token_ids is not None:
        mask = params.allowed_mask
        if mask is None or mask.shape[0] != vocab:
            kept = [t for t in params.allowed_token_ids if t < vocab]
            allowed = torch.tensor(kept, dtype=torch.long)
            mask = torch.full_like(scores, float("-inf")).index_fill(0, allowed, 0.0)
            params.allowed_mask = mask
        scores = scores + mask
    if banned:
        ids = torch.tensor([t for t in banned if t < vocab], dtype=torch.long)
        scores = scores.index_fill(0, ids, float("-inf"))
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=scores.dtype)
        scores = scores.index_add(0, ids, bias)
    if not params.has_penalties:
        return scores
    output = torch.tensor(token_ids[num_prompt:], dtype=torch.long)
    counts = torch.bincount(output, minlength=vocab).to(scores.dtype)  # [V]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(token_ids[:num_prompt], dtype=torch.long)] = True
        penalised = torch.where(
            scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
        )
        scores = torch.where(seen, penalised, scores)
    scores = scores - params.frequency_penalty * counts
    return scores - params.presence_penalty * (counts > 0).to(scores.dtype)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    # The most likely token always stays, even when top_p rounds to 0 in float32
    # (e.g. 5e-324), where ``0 >= 0`` would otherwise drop every token.
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def token_logprobs(
    rows: Sequence[torch.Tensor], token_ids: Sequence[int], k: int
) -> list[TokenLogprob]:
    """``token_ids[i]``'s log probability under ``rows[i]`` ([V] logits each) and the
    ``k`` likeliest tokens there. Of the raw logits, in float32: what vLLM reports by
    default (``--logprobs-mode raw_logprobs``), whatever the sampling parameters."""
    if not token_ids:
        return []
    logits = torch.stack([r.detach().to(device="cpu", dtype=torch.float32) for r in rows])
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]
    chosen_t = logp.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])  # [N, 1]
    ranks = (logp >= chosen_t).sum(dim=-1).tolist()  # vLLM's: itself and every tie above
    chosen = chosen_t[:, 0].tolist()
    if k > 0:
        top_values, top_ids = torch.topk(logp, min(k, logp.shape[1]), dim=-1)
        tops = [
            tuple(zip(ids, values, strict=True))
            for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    else:
        tops = [() for _ in token_ids]
    return [
        TokenLogprob(token, value, rank, top)
        for token, value, rank, top in zip(token_ids, chosen, ranks, tops, strict=True)
    ]
