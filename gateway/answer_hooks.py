"""``AnswerHooks``: what an endpoint other than chat and completions reads from the
answers the proxy (gateway/proxy.py) passes on, and when.

Chat and completions need none (``Forward.hooks`` is None: the proxy's own SSE scanner,
``[DONE]`` ends a stream, cached tokens as ``prompt_tokens_details``). The Responses API
(gateway/responses_hooks.py) has its own stream events, its own usage fields, and must
record a new response's id before the client can use it: the hooks run before the bytes
that carry the id go to the client.
"""

from __future__ import annotations

from typing import Any, Protocol


class StreamScanner(Protocol):
    """Watches a passing SSE stream (fed every chunk, in order)."""

    output: bool  # an event with generated output went by: the prefill is over
    done: bool  # the stream's last event went by: it ended as the replica meant
    cached_tokens: int | None  # the prompt tokens the replica reported cached
    usage: tuple[int, int] | None  # input and output tokens its usage reports (None: none)
    outputs: int  # events with generated output (about one token each)

    def feed(self, chunk: bytes) -> None: ...


class AnswerHooks(Protocol):
    def scanner(self) -> StreamScanner:
        """A scanner for one streamed answer."""
        ...

    def cached_tokens(self, body: bytes) -> int | None:
        """The cached prompt tokens a whole answer reports (None: none to count)."""
        ...

    def error_event(self, message: str) -> dict[str, Any]:
        """The ASGI body message that ends a stream the replica broke off."""
        ...

    async def answered(self, replica_id: str, status: int, body: bytes) -> None:
        """A whole answer (any status) arrived from ``replica_id``; the client gets it
        once this returns."""
        ...

    async def streamed(self, replica_id: str, scanner: StreamScanner) -> None:
        """``scanner`` was fed a chunk of ``replica_id``'s stream; the chunk's complete
        events go to the client once this returns."""
        ...
