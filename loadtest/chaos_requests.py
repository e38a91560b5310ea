"""What chaos clients send: honest chat turns, hostile bodies, and abandoned requests.

Honest turns come from a few dozen conversations under a handful of shared system
prompts, so that the router has prefixes to keep warm (and more than one replica to keep
them on) and a restarted part has a cache to find again. A share of them go through the
Responses API (the system prompt as ``instructions``), streamed or not, stored or not: a
stored one's id is recorded for affinity before the client gets it.

Hostile bodies are one of each input class that reaches parsing, validation, the
tokenizer or the sampler in a way that could stop a server: numbers outside int64,
denormal sampling parameters, lone surrogates, token ids outside the vocabulary or
uint32, JSON nested deep or with a 5,000-digit integer, bodies that are not JSON or not
UTF-8, and an oversized request id. Each must get a 4xx (or, where the body is valid
after all, an answer), never a 5xx or a hang.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from loadtest.chaos_load import RequestSpec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
SHOPS = ("bookshop", "bakery", "bicycle shop", "garden centre", "music shop", "toy shop")
SYSTEM = (
    "You are the support assistant of a small {shop}. Answer briefly and politely, "
    "in plain words, and say so when you do not know. Opening hours are nine to six on "
    "weekdays and ten to four on Saturdays; orders ship within two working days. "
) * 3


def honest(
    model: str,
    conversations: int = 32,
    stream_share: float = 0.25,
    max_tokens: int = 8,
    stream_max_tokens: int = 64,
    responses_share: float = 0.25,
) -> Callable[[random.Random], RequestSpec]:
    """A turn of a random conversation: its shop's system prompt, the conversation's own
    opening, a short question; streaming (with usage) for ``stream_share`` of them, with
    longer answers, so that a fault finds streams midway; ``responses_share`` of them
    through the Responses API."""

    def make(rng: random.Random) -> RequestSpec:
        conversation = rng.randrange(conversations)
        stream = rng.random() < stream_share
        headers = (("x-conversation-id", f"chaos-{conversation}"),)
        if rng.random() < responses_share:
            return _response_turn(rng, model, conversation, stream, headers)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": SYSTEM.format(shop=SHOPS[conversation % 6])},
                {"role": "user", "content": f"I am customer {conversation}. " * 4},
                {"role": "assistant", "content": "How can I help?"},
                {"role": "user", "content": f"Question {rng.randrange(1000)}?"},
            ],
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            body["max_tokens"] = stream_max_tokens
        return RequestSpec(CHAT, json.dumps(body).encode(), stream, headers=headers)

    def _response_turn(
        rng: random.Random,
        model: str,
        conversation: int,
        stream: bool,
        headers: tuple[tuple[str, str], ...],
    ) -> RequestSpec:
        body: dict[str, Any] = {
            "model": model,
            "instructions": SYSTEM.format(shop=SHOPS[conversation % 6]),
            "input": [
                {"role": "user", "content": f"I am customer {conversation}. " * 4},
                {"role": "assistant", "content": "How can I help?"},
                {"role": "user", "content": f"Question {rng.randrange(1000)}?"},
            ],
            "max_output_tokens": stream_max_tokens if stream else max_tokens,
            "store": rng.random() < 0.5,
            "stream": stream,
        }
        return RequestSpec(RESPONSES, json.dumps(body).encode(), stream, headers=headers)

    return make


def hostile_catalogue(model: str) -> list[tuple[str, str, bytes]]:
    """(input class, path, body) for every hostile class."""
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    text = {"model": model, "max_tokens": 2, "prompt": "hi"}

    def dump(path: str, body: object) -> tuple[str, bytes]:
        return path, json.dumps(body).encode()

    deep = "[" * 1_000 + "]" * 1_000
    chat_text = json.dumps(chat)[:-1]  # without its closing brace: more fields follow
    surrogate_chat = chat | {"messages": [{"role": "user", "content": "\ud800"}]}
    return [
        ("seed 2**64", *dump(CHAT, chat | {"seed": 2**64})),
        ("temperature 1e-40", *dump(CHAT, chat | {"temperature": 1e-40})),
        ("top_p 5e-324", *dump(COMPLETIONS, text | {"top_p": 5e-324})),
        ("lone surrogate in content", *dump(CHAT, surrogate_chat)),
        ("lone surrogate in prompt", *dump(COMPLETIONS, text | {"prompt": "a\udfff"})),
        ("lone surrogate in cache_salt", *dump(CHAT, chat | {"cache_salt": "\ud800"})),
        ("lone surrogate in model", *dump(CHAT, chat | {"model": "\udc00"})),
        ("token id 2**32", *dump(COMPLETIONS, text | {"prompt": [1, 2**32]})),
        ("token id -1", *dump(COMPLETIONS, text | {"prompt": [-1, 5]})),
        ("stop_token_ids 2**64", *dump(COMPLETIONS, text | {"stop_token_ids": [2**64]})),
        ("logit_bias id 10**12", *dump(CHAT, chat | {"logit_bias": {str(10**12): 5}})),
        ("max_tokens 10**30", *dump(CHAT, chat | {"max_tokens": 10**30})),
        ("n 10**6", *dump(CHAT, chat | {"n": 10**6})),
        ("1,000 stop strings", *dump(CHAT, chat | {"stop": [f"s{i}" for i in range(1_000)]})),
        ("messages a string", *dump(CHAT, chat | {"messages": "hi"})),
        ("JSON 1,000 deep", CHAT, f'{chat_text}, "x": {deep}}}'.encode()),
        ("5,000-digit integer", CHAT, f'{chat_text}, "seed": {"9" * 5_000}}}'.encode()),
        ("not JSON", CHAT, f'{chat_text}, "x": [}}'.encode()),
        ("not UTF-8", COMPLETIONS, json.dumps(text).encode().replace(b'"hi"', b'"h\xff"')),
        ("body a list", CHAT, b"[]"),
    ]


def mixed(
    model: str, hostile_share: float, disconnect_share: float
) -> Callable[[random.Random], RequestSpec]:
    """Honest turns, with ``hostile_share`` hostile bodies (one class at random, now and
    then with a 10 KB request id) and ``disconnect_share`` honest turns that the client
    abandons after 0-300 ms, streaming or not."""
    turn = honest(model)
    catalogue = hostile_catalogue(model)

    def make(rng: random.Random) -> RequestSpec:
        draw = rng.random()
        if draw < hostile_share:
            name, path, body = rng.choice(catalogue)
            headers: tuple[tuple[str, str], ...] = ()
            if rng.random() < 0.1:
                headers = (("x-request-id", "r" * 10_000),)
                name += " + 10 KB x-request-id"
            return RequestSpec(path, body, False, hostile=name, headers=headers)
        spec = turn(rng)
        if draw < hostile_share + disconnect_share:
            return spec._replace(disconnect_after_s=rng.uniform(0.0, 0.3))
        return spec

    return make
