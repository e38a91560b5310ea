"""vLLM's ``truncate_prompt_tokens``: the engine keeps the last N ids of a prompt (its side
for generating models; the first N with ``truncation_side: "right"``), and caches blocks
from where it cut. The gateway keys the ids the engine keeps, on completions (text and
token ids) and chats alike; any other value keys the whole prompt."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.routing import prompt_keys
from prefixgate.chat_input import chat_input
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import ChatCompletionRequest, CompletionRequest, parse_request
from router.protocol import KeySpace

TEXT = "The quick brown fox jumps over the lazy dog. " * 30
SPACE = KeySpace("tiny-random", 16, "")


@pytest.fixture(scope="module")
def tokenizer() -> SegmentCache:
    return SegmentCache(ChatTokenizer.for_model("tiny-random"))


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "tiny-random", "prompt": TEXT, **fields})


def test_a_completion_is_keyed_by_the_ids_the_engine_keeps(tokenizer: SegmentCache) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 200
    for fields, kept in (
        ({"truncate_prompt_tokens": 100}, ids[-100:]),
        ({"truncate_prompt_tokens": 100, "truncation_side": "left"}, ids[-100:]),
        ({"truncate_prompt_tokens": 100, "truncation_side": "right"}, ids[:100]),
        ({"truncate_prompt_tokens": len(ids) + 5}, ids),
        ({"truncate_prompt_tokens": -1}, ids),
        ({"truncate_prompt_tokens": 0}, ids),
        ({"truncate_prompt_tokens": True}, ids),
        ({}, ids),
    ):
        keyed = prompt_keys(completion(**fields), tokenizer, "tiny-random", 16, "")
        assert keyed.keys == SPACE.short_keys(kept) and keyed.prompt_tokens == len(kept), fields
    tokens = completion(prompt=list(range(300)), truncate_prompt_tokens=64)
    assert prompt_keys(tokens, tokenizer, "tiny-random", 16, "").keys == SPACE.short_keys(
        list(range(236, 300))
    )


def test_a_chat_is_keyed_by_the_ids_the_engine_keeps(tokenizer: SegmentCache) -> None:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": TEXT}]}
    whole = tokenizer.encode_input(chat_input(parse_request(ChatCompletionRequest, body)))
    cut = parse_request(ChatCompletionRequest, {**body, "truncate_prompt_tokens": 128})
    keyed = prompt_keys(cut, tokenizer, "tiny-random", 16, "")
    assert keyed.keys == SPACE.short_keys(whole[-128:]) and keyed.prompt_tokens == 128
    assert keyed.keys[0] != SPACE.short_keys(whole)[0]  # the engine's blocks start at the cut


def test_a_long_chat_rendered_on_the_event_loop_is_cut_too(tokenizer: SegmentCache) -> None:
    """Chats a little over the inline size take the rendering path of ``KeyBuilder.keys``."""
    import asyncio

    from gateway.routing import KeyBuilder

    body = {"model": "tiny-random", "messages": [{"role": "user", "content": TEXT}]}
    whole = tokenizer.encode_input(chat_input(parse_request(ChatCompletionRequest, body)))
    cut = parse_request(ChatCompletionRequest, {**body, "truncate_prompt_tokens": 128})
    builder = KeyBuilder(loader=lambda name, template, mode: tokenizer, inline_chars=len(TEXT) // 2)
    keyed = asyncio.run(builder.keys(cut, "tiny-random", 16, "", body_bytes=len(TEXT) + 100))
    assert keyed.keys == SPACE.short_keys(whole[-128:])
