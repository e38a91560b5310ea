"""One HTTP/1.1 connection to a replica: asyncio protocol, httptools parser, raw bytes.

Why its own client: on this hot path a general-purpose client's request and response
objects, header multidicts and URL handling cost more CPU than everything else the
gateway does per request (docs/BENCHMARKS.md, "Gateway"). This one does only what the
gateway needs: send a request whose body it already has (POST, or a GET / DELETE of the
Responses API) and hand back the final status, the raw headers and the body, whole or
chunk by chunk.

What the wire may bring and how each is handled:

* interim ``1xx`` answers (100 Continue, 103 Early Hints) are skipped: the response is
  the first final (>= 200) one;
* chunked trailers are dropped: ``headers`` are the head's only, complete before the
  body, so a header can never arrive after the client got its head;
* any byte after the end of the answer (a second answer, junk) makes the connection
  unfit for reuse, as does an answer not read to its end or one the replica will close;
* ``101`` and malformed bytes are a ``RemoteProtocolError``.

Errors are named as httpx names them (ConnectError, ConnectTimeout, ReadTimeout,
ReadError, RemoteProtocolError), so metric labels read as they would with any client.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

# Unread body beyond this pauses reading from the replica (a slow client slows it down).
HIGH_WATER = 256 * 1024


# UpstreamError.kind when the replica sent nothing for the read timeout.
READ_TIMEOUT = "ReadTimeout"


class UpstreamError(Exception):
    """The replica could not be reached, timed out, or broke its answer off; ``kind``
    names the failure for metrics (httpx's names, and PoolTimeout: no free connection
    to that replica in time; the request was not sent)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Target:
    """Where a URL goes: the connection pool's key and the request line's parts."""

    __slots__ = ("host", "key", "netloc", "path", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.netloc = parts.netloc
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in self.path):
            raise ValueError(f"the path of {url!r} cannot go on a request line unescaped")
        self.key = (self.host, self.port, self.tls)


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, read_timeout_s: float, key: tuple[str, int, bool]
    ) -> None:
        self.loop = loop
        self.key = key  # the pool it goes back to
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False  # the replica keeps the connection open after this answer
        self.delimited = False  # Content-Length or chunked: the end is not the close
        self.received = False  # any byte of this response arrived
        self.extra = False  # bytes arrived after the answer's end
        self.error: UpstreamError | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # --------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is not an asyncio.Transport subclass, but has its API.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.complete:
            self.extra = True  # nothing may follow an answer on an idle connection
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self.complete:
                self._fail(UpstreamError("RemoteProtocolError"))
            self.extra = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.delimited and self.error is None:
            self.complete = True  # a body that ends with the connection
            self._wake()
        elif not self.complete:
            self._fail(UpstreamError("RemoteProtocolError" if exc is None else "ReadError"))
        # The parser holds this connection (its callbacks), which holds the parser: a
        # cycle only the garbage collector would free. Nothing arrives after the loss.
        del self.parser

    # --------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True  # a second answer to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a chunked trailer: never passed on
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.delimited = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self.headers.clear()
            self.delimited = False
            if status == 101:  # we never ask to switch protocols
                self._fail(UpstreamError("RemoteProtocolError"))
            return
        self.status = status
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:
            return  # the end of an interim (1xx) answer; the final one follows
        self.complete = True
        # Asked now: once the message is done the parser forgets its flags.
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # --------------------------------------------------------------- requests

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(data)

    async def wait(self) -> None:
        """Until the next event (head, body, end, error); ReadTimeout after the timeout."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(self.read_timeout_s, self._timed_out)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def next_chunk(self) -> bytes | None:
        if not self.chunks:
            return None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        """Whether the connection may carry another request: this answer read to its
        end, nothing after it, and the replica keeps the connection open."""
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.extra
            and not self.closed
            and not self.chunks
        )

    def dropped(self) -> bool:
        """Whether an idle connection has been closed by the replica or has bytes
        waiting (both show as a readable socket: a FIN or data nobody asked for).
        Checked before reuse, so that a request is only written to a connection that
        was provably open and quiet the moment before."""
        if self.closed or self.extra or self.transport is None or self.transport.is_closing():
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()  # poll, not select: descriptors may exceed FD_SETSIZE
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _timed_out(self) -> None:
        self._fail(UpstreamError(READ_TIMEOUT))
        self.abort()

    def failure(self) -> UpstreamError:
        """An exception to raise for the connection's failure (``error``): a new one,
        since raising the kept one would give it a traceback whose frames hold this
        connection, a reference cycle per failed answer."""
        assert self.error is not None
        return UpstreamError(self.error.kind)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Response:
    """A final answer whose head has arrived; the body is read through it. ``close``
    hands the connection back to ``release`` (its pool), once.

    The head (``status``, ``raw_headers``) is the response's own, copied when it is
    made: once closed, its connection may already carry another request's answer."""

    __slots__ = ("_conn", "_release", "_released", "raw_headers", "status")

    def __init__(self, conn: Connection, release: Callable[[Connection], None]) -> None:
        self._conn = conn
        self._release = release
        self._released = False
        self.status: int = conn.status
        self.raw_headers: Sequence[tuple[bytes, bytes]] = tuple(conn.headers)

    def content_type(self) -> str:
        for name, value in self.raw_headers:
            if name.lower() == b"content-type":
                return value.decode("latin-1")
        return ""

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            chunk = conn.next_chunk()
            if chunk is not None:
                yield chunk
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.failure()
            else:
                await conn.wait()

    async def close(self) -> None:
        """Done with the answer: the connection goes back to the pool when the body was
        read to the end, and is closed otherwise (the replica sees the client leave)."""
        if not self._released:
            self._released = True
            self._release(self._conn)
