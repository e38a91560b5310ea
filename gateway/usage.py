"""What a passing answer says, read without parsing all of it: the prompt cache the
replica reported (``usage.prompt_tokens_details.cached_tokens``), the tokens it used (each
tenant's accounting, and its ``tpm_limit``) and, in a stream, the first event that
carries generated output (the end of the replica's prefill)."""

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
    its end, the events with output, and the cached, input and output tokens its usage
    reports."""

    __slots__ = ("cached_tokens", "done", "output", "outputs", "tail", "usage")

    def __init__(self) -> None:
        self.tail = b""
        self.done = False  # the stream's last event went by
        self.output = False  # an event with generated output went by
        self.outputs = 0  # events with generated output (about one token each)
        self.cached_tokens: int | None = None
        self.usage: Tokens | None = None  # input and output tokens, when the stream says

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
            usage = usage_in(event[5:])
            if usage is not None:
                self.usage = usage


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


# A usage's input and output tokens: (input, output), each counted 0 when absent.
Tokens = tuple[int, int]

_DECODER = json.JSONDecoder()


def usage_in(raw: bytes) -> Tokens | None:
    """The input and output tokens a whole JSON answer says it used (``usage_of``); None
    without a usage. Reads only the usage object: the last ``"usage"`` key (with its
    quotes it cannot occur inside a JSON string, whose quotes are escaped), decoded from
    the value after it. Every answer passes here (per-tenant accounting): a whole-body
    parse would cost an answer's size."""
    at = raw.rfind(b'"usage"')
    if at < 0:
        return None
    start = raw.find(b"{", at)
    if start < 0 or raw[at + 7 : start].strip() != b":":
        return None
    try:
        usage, _ = _DECODER.raw_decode(raw[start:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return usage_of(usage)


def usage_of(usage: object) -> Tokens | None:
    """A usage object's input and output tokens: ``prompt_tokens`` and
    ``completion_tokens`` (chat, completions; embeddings have no output), or
    ``input_tokens`` and ``output_tokens`` (Responses, Anthropic's Messages), or a lone
    ``total_tokens`` as input; None when it has none of them, or a value is not a count."""
    if not isinstance(usage, dict):
        return None
    for names in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
        if any(name in usage for name in names):
            counts = [usage.get(name, 0) for name in names]
            if all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
                return counts[0], counts[1]
            return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total, 0
    return None
