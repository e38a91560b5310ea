"""A submitted request as its caller sees it: a stream of deltas, then the output.

The engine thread writes (``deliver``, ``close``); any thread or event loop reads.
Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from replica.request import Delta, RequestOutput


class RequestHandle:
    """A submitted request's stream of deltas and, once finished, its output.

    Deltas go to a thread-safe queue (``__iter__``) and, when ``submit`` was called on a
    running asyncio loop, also to an asyncio queue on that loop (``__aiter__``)."""

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output: RequestOutput | None = None
        self._finished = threading.Event()
        # None marks the end of the stream.
        self._sync: queue.SimpleQueue[Delta | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[Delta | None] | None = None
        with contextlib.suppress(RuntimeError):  # no running loop: sync use only
            self._loop = asyncio.get_running_loop()
            self._async = asyncio.Queue()

    # Called on the engine thread.
    def deliver(self, delta: Delta) -> None:
        self._put(delta)

    def close(self, output: RequestOutput) -> None:
        self.output = output
        self._finished.set()
        self._put(None)

    def _put(self, item: Delta | None) -> None:
        self._sync.put(item)
        if self._loop is not None and self._async is not None:
            # A closed loop raises RuntimeError: nobody is listening there any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def __iter__(self) -> Iterator[Delta]:
        while (item := self._sync.get()) is not None:
            yield item

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self._async is None:  # submitted off-loop: wait in a worker thread
            while (item := await asyncio.to_thread(self._sync.get)) is not None:
                yield item
            return
        while (item := await self._async.get()) is not None:
            yield item

    async def result(self) -> RequestOutput:
        async for _ in self:
            pass
        assert self.output is not None
        return self.output

    def wait(self, timeout: float | None = None) -> RequestOutput:
        """Block until finished (does not consume the stream)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
        assert self.output is not None
        return self.output
