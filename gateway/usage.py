"""What a passing answer says, read without parsing all of it: the prompt cache the
replica reported (``usage.prompt_tokens_details.cached_tokens``), the tokens it used (for
a tenant's ``tpm_limit``) and, in a stream, the first event that carries generated output
(the end of the replica's prefill)."""

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
    its end, the events with output, and the cached and used tokens its usage reports."""

    __slots__ = ("cached_tokens", "done", "output", "outputs", "tail", "used_tokens")

    def __init__(self) -> None:
        self.tail = b""
        self.done = False  # the stream's last event went by
        self.output = False  # an event with generated output went by
        self.outputs = 0  # events with generated output (about one token each)
        self.cached_tokens: int | None = None
        self.used_tokens: int | None = None  # the usage's total, when the stream has one

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
        if OUTPUT.search(event):
            self.output = True
            self.outputs += 1
        if not event.startswith(b"data:"):
            return
        if b'"cached_tokens"' in event:
            found = cached_tokens_in(event[5:])
            if found is not None:
                self.cached_tokens = found
        if b'"total_tokens"' in event:  # a usage (SGLang sends `"usage":null` in every chunk)
            used = used_tokens_in(event[5:])
            if used is not None:
                self.used_tokens = used


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


def used_tokens_in(raw: bytes) -> int | None:
    """The tokens a JSON answer (or a stream's event) says it used: its usage's
    ``total_tokens`` (chat, completions, embeddings, Responses), else ``input_tokens`` +
    ``output_tokens`` (Anthropic's Messages), else ``prompt_tokens`` + ``completion_tokens``;
    None without a usage."""
    if b'"usage"' not in raw:
        return None
    try:
        answer = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if usage is None and isinstance(answer.get("response"), dict):  # a Responses event
        usage = answer["response"].get("usage")
    if usage is None and isinstance(answer.get("message"), dict):  # Messages' first event
        usage = answer["message"].get("usage")
    return tokens_of_usage(usage)


def tokens_of_usage(usage: object) -> int | None:
    """``used_tokens_in`` for a usage object already parsed."""
    if not isinstance(usage, dict):
        return None
    for names in (("total_tokens",), ("input_tokens", "output_tokens"), PROMPT_AND_COMPLETION):
        values = [usage.get(name, 0) for name in names]
        if any(name in usage for name in names) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
        ):
            return sum(values)
    return None


PROMPT_AND_COMPLETION = ("prompt_tokens", "completion_tokens")
