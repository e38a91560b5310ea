"""What the proxy reads from Anthropic Messages answers (``AnswerHooks``,
gateway/answer_hooks.py).

* A stream is named events (``event: message_start``, ``content_block_delta``, ...). It is
  over at ``message_stop`` or ``error``, with no ``[DONE]``: without these hooks the proxy
  took every finished Messages stream for one the replica broke off, appended an error
  event to it, and counted the request as failed.
* The first event after ``message_start`` (and ``ping``) is the first output: the
  replica's prefill is over.
* A stream the replica broke off ends with an ``error`` event of Anthropic's shape, which
  Anthropic's SDKs raise.
* Cached tokens are ``usage.cache_read_input_tokens`` (vLLM fills it from the engine's
  cached tokens), in a whole answer or in a stream's ``message_start`` or
  ``message_delta``.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.answer_hooks import StreamScanner
from gateway.responses_hooks import event_parts, json_object
from gateway.usage import EventScanner

STARTING = frozenset({b"message_start", b"ping"})  # before any output
ENDING = frozenset({b"message_stop", b"error"})
WITH_USAGE = frozenset({b"message_start", b"message_delta"})


class MessagesScanner(EventScanner):
    """Watches a Messages event stream: first output, end, cached and used tokens
    (``message_start`` has the input's, ``message_delta`` the output's so far)."""

    __slots__ = ("input_tokens",)

    def __init__(self) -> None:
        super().__init__()
        self.input_tokens = 0

    def _event(self, event: bytes) -> None:
        kind, data = event_parts(event)
        if kind is None:
            return  # a comment, a keep-alive, or no name: nothing Anthropic sends
        if kind in WITH_USAGE:
            parsed = json_object(data)
            message = parsed.get("message")
            usage_of = message if isinstance(message, dict) else parsed
            cached = cached_tokens_of(usage_of)
            if cached is not None:
                self.cached_tokens = cached
            self._count(usage_of.get("usage"))
        if kind in ENDING:
            self.done = True
        elif kind not in STARTING:
            self.output = True
            if kind == b"content_block_delta":
                self.outputs += 1

    def _count(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        given = usage.get("input_tokens")
        if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
            self.input_tokens = given
        output = usage.get("output_tokens")
        if isinstance(output, int) and not isinstance(output, bool) and output >= 0:
            self.usage = (self.input_tokens, output)


def cached_tokens_of(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    cached = usage.get("cache_read_input_tokens") if isinstance(usage, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class MessagesHooks:
    """A Messages request's hooks: nothing to record, only how its answers read."""

    __slots__ = ()

    def scanner(self) -> StreamScanner:
        return MessagesScanner()

    def cached_tokens(self, body: bytes) -> int | None:
        return cached_tokens_of(json_object(body))

    def error_event(self, message: str) -> dict[str, Any]:
        payload = {
            "type": "error",
            "error": {"type": "api_error", "message": message + "; the answer is incomplete."},
        }
        data = json.dumps(payload, separators=(",", ":")).encode()
        body = b"event: error\ndata: " + data + b"\n\n"
        return {"type": "http.response.body", "body": body, "more_body": True}

    async def answered(self, replica_id: str, status: int, body: bytes) -> None:
        return None

    async def streamed(self, replica_id: str, scanner: StreamScanner) -> None:
        return None
