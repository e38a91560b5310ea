"""How big each replica's KV cache is in a live experiment.

Each replica's cache holds a fraction (about a third by default) of the workload's
distinct prefix blocks, counted with the real tokenizer and chat template over the very
prompts the replay sends (assistant turns filled with text of the requested length), so
that where a request lands decides whether its prefix is cached.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.protocol import DEFAULT_BLOCK_SIZE, KeySpace

if TYPE_CHECKING:
    from loadtest.workloads import Session


@dataclass(slots=True)
class Sizing:
    """How big each replica's KV cache is for one workload, and why."""

    distinct_blocks: int
    num_blocks: int
    fraction: float
    min_blocks: int  # what the in-flight requests alone need


def filler_reply(rng: random.Random, tokenizer: Any, n_tokens: int) -> str:
    """Text decoded from random token ids: what a random model's reply looks like."""
    ids = [rng.randrange(1000, tokenizer.vocab_size - 1000) for _ in range(n_tokens)]
    text: str = tokenizer.decode(ids)
    return text


def prompts_of(session: Session, tokenizer: Any, rng: random.Random) -> list[list[int]]:
    """The token ids of every turn's prompt, history included (replies are filler)."""
    messages: list[dict[str, str]] = []
    if session.system:
        messages.append({"role": "system", "content": session.system})
    out = []
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        out.append(tokenizer.encode_chat(messages))
        messages.append(
            {"role": "assistant", "content": filler_reply(rng, tokenizer, turn.max_tokens)}
        )
    return out


def live_prompts(sessions: Sequence[Session], model: str) -> list[list[list[int]]]:
    """Every session's prompts as the live replay sends them: the model's chat template
    over the history, replies filled with text (seeded, so the same every call)."""
    from prefixgate.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.for_model(model)
    rng = random.Random(0)
    return [prompts_of(session, tokenizer, rng) for session in sessions]


def size_cache(
    sessions: Sequence[Session],
    prompts: Sequence[Sequence[list[int]]],
    model: str,
    fraction: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Sizing:
    """``fraction`` of the distinct prefix blocks in ``prompts``, but never fewer blocks
    than two of the longest requests need at once."""
    space = KeySpace(model, block_size)
    distinct: set[bytes] = set()
    longest = 0
    for session, session_prompts in zip(sessions, prompts, strict=True):
        for ids in session_prompts:
            distinct.update(space.keys(ids))
            longest = max(longest, len(ids) + max(t.max_tokens for t in session.turns))
    # A request pins all its blocks while it runs; two of the longest must fit at once
    # (more just wait in the replica's queue for blocks).
    min_blocks = 2 * math.ceil(longest / block_size + 1)
    num_blocks = max(math.ceil(len(distinct) * fraction), min_blocks)
    return Sizing(len(distinct), num_blocks, num_blocks / max(1, len(distinct)), min_blocks)
