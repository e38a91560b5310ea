"""What a passing answer says, read without parsing all of it: the prompt cache the
replica reported (``usage.prompt_tokens_details.cached_tokens``) and, in a stream, the
first event that carries generated output (the end of the replica's prefill)."""

from __future__ import annotations

import json
import re

# Generated output in a chunk: non-empty content or text, tool calls, generated token
# ids (vLLM's token API streams only those), or a finish reason. A chat stream's first
# chunk (role only, ``"content":""``) is sent before any token.
OUTPUT = re.compile(
    rb'"(?:content|text)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[|"finish_reason"\s*:\s*"'
    rb'|"token_ids"\s*:\s*\[\s*\d'
)


def sse_events(tail: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """The whole SSE events in ``tail + chunk`` and the unfinished rest, kept for the
    next chunk (only the one event that straddles a chunk boundary is copied)."""
    data = tail + chunk if tail else chunk
    events = data.replace(b"\r\n", b"\n").split(b"\n\n")
    rest = events.pop()
    return events, rest


class EventScanner:
    """Watches a passing SSE stream, one whole event at a time (``_event``), without
    copying more than the one event that straddles a chunk boundary: its first output,
    its end, and the cached tokens its usage reports."""

    __slots__ = ("cached_tokens", "done", "output", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.done = False  # the stream's last event went by
        self.output = False  # an event with generated output went by
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        events, self.tail = sse_events(self.tail, chunk)
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        raise NotImplementedError


class SSEScanner(EventScanner):
    """A chat or completions stream: output, ``[DONE]``, ``prompt_tokens_details``."""

    __slots__ = ()

    def _event(self, event: bytes) -> None:
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return
        if not self.output and OUTPUT.search(event):
            self.output = True
        if b'"cached_tokens"' in event and event.startswith(b"data:"):
            found = cached_tokens_in(event[5:])
            if found is not None:
                self.cached_tokens = found


def cached_tokens_in(raw: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON body, when it has one.

    Parses only the flat ``prompt_tokens_details`` object, not the whole answer: the key
    with its quotes cannot occur inside a JSON string (quotes there are escaped), and
    only ``usage`` has it. Anything unexpected falls back to parsing the whole body.
    """
    if b'"cached_tokens"' not in raw:
        return None
    key = b'"prompt_tokens_details"'
    at = raw.rfind(key)
    start = raw.find(b"{", at) if at >= 0 else -1
    end = raw.find(b"}", start) if start >= 0 else -1
    if end > start >= 0 and raw[at + len(key) : start].strip() == b":":
        try:
            details = json.loads(raw[start : end + 1])
        except ValueError:
            details = None
        if isinstance(details, dict):
            value = details.get("cached_tokens")
            return value if isinstance(value, int) else None
    try:
        usage = json.loads(raw).get("usage") or {}
        value = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None
