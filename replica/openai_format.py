"""OpenAI response bodies and stream chunks, built from plain values. Torch-free.

The shapes are the ones the official ``openai`` client parses: ``chat.completion``,
``chat.completion.chunk``, ``text_completion``; every ``usage`` carries
``prompt_tokens_details.cached_tokens`` (see ``prefixgate.wire.usage``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixgate.wire import usage


@dataclass(slots=True)
class Choice:
    """One finished choice: its index, text and why it stopped."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token id, as vLLM's
    logprobs: dict[str, Any] | None = None  # built by replica.logprobs_format
    prompt_logprobs: list[Any] | None = None  # a completion choice's, vLLM's raw shape
    # vLLM's ``return_token_ids``: the choice's ids, and a completion choice's prompt's.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…``: unique per response, like OpenAI's."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_completion(
    id_: str,
    model: str,
    created: int,
    choices: Sequence[Choice],
    use: Usage,
    prompt_logprobs: list[Any] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    body = {
        "id": id_,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({} if c.token_ids is None else {"token_ids": c.token_ids}),
            }
            for c in choices
        ],
        "usage": use.as_dict(),
    }
    if prompt_logprobs is not None:  # vLLM's, beside the choices
        body["prompt_logprobs"] = prompt_logprobs
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def chat_chunk(
    id_: str,
    model: str,
    created: int,
    index: int,
    *,
    content: str | None = None,
    role: str | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def text_completion(
    id_: str, model: str, created: int, choices: Sequence[Choice], use: Usage
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_text_choice(c) for c in choices],
        "usage": use.as_dict(),
    }


def _text_choice(c: Choice) -> dict[str, Any]:
    choice = {
        "index": c.index,
        "text": c.text,
        "logprobs": c.logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.prompt_logprobs is not None:
        choice["prompt_logprobs"] = c.prompt_logprobs
    if c.token_ids is not None:
        choice["token_ids"] = c.token_ids
    if c.prompt_token_ids is not None:
        choice["prompt_token_ids"] = c.prompt_token_ids
    return choice


def text_chunk(
    id_: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def usage_chunk(id_: str, model: str, created: int, object_: str, use: Usage) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, only usage."""
    return {
        "id": id_,
        "object": object_,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use.as_dict(),
    }


def model_list(
    model_ids: Sequence[str], created: int, max_model_len: int, root: str = ""
) -> dict[str, Any]:
    """vLLM's model list: each served name a card, with ``root`` (what the model was
    started from) and ``parent`` (none: no name here is an adapter)."""
    extra = {"root": root, "parent": None} if root else {}
    return {
        "object": "list",
        "data": [
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "prefixgate",
                "max_model_len": max_model_len,
                **extra,
            }
            for m in model_ids
        ],
    }


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
