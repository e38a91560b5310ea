"""Log probabilities in the shapes vLLM answers with. Torch-free.

Each position's entries are vLLM's: the position's own token first (the one sampled, or
the prompt's), then the likeliest tokens in order, the own token not repeated. A chat
token's ``top_logprobs`` are the first k of those, a completion's ``top_logprobs`` the
first k + 1 (keyed by text, as OpenAI's legacy API), and vLLM's ``prompt_logprobs`` all of
them, keyed by id with their ranks. A token's text is its id decoded alone, special
tokens included; a log probability of minus infinity is reported as -9999.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replica.request import TokenLogprob

Decode = Callable[[int], str]  # one token id -> its text
FLOOR = -9999.0  # what OpenAI and vLLM report for a log probability of minus infinity


def _entries(lp: TokenLogprob) -> list[tuple[int, float, int]]:
    """(token id, log probability, rank) at ``lp``'s position: its own token first."""
    out = [(lp.token_id, lp.logprob, lp.rank)]
    out += [(t, v, r) for r, (t, v) in enumerate(lp.top, 1) if t != lp.token_id]
    return out


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": max(logprob, FLOOR),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(lps: Sequence[TokenLogprob], k: int, decode: Decode) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: one ``content`` item per token."""
    content = []
    for lp in lps:
        item = _chat_token(decode(lp.token_id), lp.logprob)
        item["top_logprobs"] = [_chat_token(decode(t), v) for t, v, _ in _entries(lp)[:k]]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    lps: Sequence[TokenLogprob | None],
    k: int,
    decode: Decode,
    offset: int = 0,
) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs`` for ``token_ids``, their text
    offsets counted from ``offset`` (a stream's running offset). A position without a
    log probability (a prompt's first token) has None for it and for its alternatives."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in zip(token_ids, lps, strict=True):
        token = decode(token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(max(lp.logprob, FLOOR))
        tops.append({decode(t): max(v, FLOOR) for t, v, _ in _entries(lp)[: k + 1]})
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def next_offset(logprobs: dict[str, Any], offset: int) -> int:
    """Where the text offsets of the tokens after ``logprobs``' go on from."""
    tokens: list[str] = logprobs["tokens"]
    return logprobs["text_offset"][-1] + len(tokens[-1]) if tokens else offset


def raw_prompt_logprobs(
    lps: Sequence[TokenLogprob | None], decode: Decode
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else every entry
    by id with its log probability, rank and text."""
    return [
        None
        if lp is None
        else {
            str(t): {"logprob": max(v, FLOOR), "rank": r, "decoded_token": decode(t)}
            for t, v, r in _entries(lp)
        }
        for lp in lps
    ]
