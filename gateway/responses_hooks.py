"""What the proxy reads from Responses API answers (``AnswerHooks``, gateway/answer_hooks.py).

* Streams are named events (``event: response.output_text.delta``); the stream is over at
  ``response.completed``, ``response.incomplete``, ``response.failed`` or ``error`` (no
  ``[DONE]``), and one the replica broke off ends with an ``error`` event of the Responses
  API's own shape, which the OpenAI SDKs hand to the caller as an event.
* The first event after ``response.created`` / ``response.in_progress`` is the first
  output: the replica's prefill is over.
* Usage is ``usage.input_tokens_details.cached_tokens``.
* A new response's id (``response.created``'s, or a whole answer's ``id``) is recorded as
  id -> replica before the client can see it, so a follow-up sent the moment the client
  has the id finds its replica.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.answer_hooks import StreamScanner
from gateway.response_affinity import Owner, ResponseAffinity
from gateway.usage import EventScanner, usage_of

STARTING = frozenset({b"response.created", b"response.in_progress"})  # before any output
ENDING = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"error"})


class ResponsesScanner(EventScanner):
    """Watches a Responses event stream: its id, first output, end and (``count_cached``)
    cached tokens."""

    __slots__ = ("count_cached", "response_id")

    def __init__(self, count_cached: bool = True) -> None:
        super().__init__()
        self.count_cached = count_cached
        self.response_id: str | None = None

    def _event(self, event: bytes) -> None:
        kind, data = event_parts(event)
        if kind is None and data is None:
            return  # a comment or a blank keep-alive
        if kind is None or kind in STARTING or kind in ENDING:
            parsed = json_object(data)
            kind = kind or str(parsed.get("type", "")).encode()
            response = parsed.get("response")
            if isinstance(response, dict):
                if self.response_id is None and isinstance(response.get("id"), str):
                    self.response_id = response["id"]
                cached = cached_tokens_of(response) if self.count_cached else None
                if cached is not None:
                    self.cached_tokens = cached
                usage = usage_of(response.get("usage"))
                if usage is not None:
                    self.usage = usage
        if kind in ENDING:
            self.done = True
        if kind not in STARTING and kind != b"error":
            self.output = True
            if kind == b"response.output_text.delta":
                self.outputs += 1


def event_parts(event: bytes) -> tuple[bytes | None, bytes | None]:
    """An SSE event's name (``event:``) and data (``data:`` lines joined)."""
    kind: bytes | None = None
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            kind = line[6:].strip()
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    return kind, b"\n".join(data) if data else None


def json_object(data: bytes | None) -> dict[str, Any]:
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def cached_tokens_of(response: dict[str, Any]) -> int | None:
    usage = response.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


@dataclass(slots=True)
class ResponsesHooks:
    """One Responses request's hooks. ``record``: a create, whose new response id is
    recorded with ``conversation`` (None: the chain starts here and takes the response's
    own id, ``chain_key``); ``count_cached``: its cached tokens count in the metrics (not
    for a pinned follow-up, which has no prediction to compare them with); ``forget``: a
    DELETE of that id, forgotten once the replica answered 200 or 404."""

    affinity: ResponseAffinity
    tenant: str
    scope: Callable[[str], str]  # a conversation key -> the tenant's scoped one
    record: bool = False
    conversation: str | None = None
    count_cached: bool = False
    forget: str | None = None
    recorded: bool = False

    def scanner(self) -> StreamScanner:
        return ResponsesScanner(self.count_cached)

    def cached_tokens(self, body: bytes) -> int | None:
        return cached_tokens_of(json_object(body)) if self.count_cached else None

    def error_event(self, message: str) -> dict[str, Any]:
        payload = {
            "type": "error",
            "code": "upstream_error",
            "message": message + "; the response is incomplete.",
            "param": None,
        }
        data = json.dumps(payload, separators=(",", ":")).encode()
        body = b"event: error\ndata: " + data + b"\n\n"
        return {"type": "http.response.body", "body": body, "more_body": True}

    async def answered(self, replica_id: str, status: int, body: bytes) -> None:
        if self.forget is not None and status in (200, 404):
            await self.affinity.forget(self.forget)
        elif self.record and status < 300:
            response_id = json_object(body).get("id")
            if isinstance(response_id, str) and response_id:
                await self._remember(replica_id, response_id)

    async def streamed(self, replica_id: str, scanner: StreamScanner) -> None:
        response_id = getattr(scanner, "response_id", None)
        if self.record and not self.recorded and response_id:
            await self._remember(replica_id, response_id)

    async def _remember(self, replica_id: str, response_id: str) -> None:
        self.recorded = True
        conversation = self.conversation or self.scope(response_id)
        await self.affinity.record(response_id, Owner(replica_id, conversation, self.tenant))
