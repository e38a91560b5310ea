"""A minimal HTTP/1.1 client for forwarded requests: asyncio protocols and httptools.

Why not aiohttp: on this hot path aiohttp's client spends ~300 µs of CPU per request
(request and response objects, header multidicts, URL handling, payload registry), this
one ~65 µs (same stub, concurrency 32; see the report of the gateway performance work).
It does only what the gateway needs: POST a body it already has, to replicas it knows,
over pooled keep-alive connections; hand back the status, the raw headers and the body
(whole or chunk by chunk); close the connection when the body was not read to the end,
so that the replica sees the client leave.

Errors are named as httpx names them (ConnectError, ConnectTimeout, ReadTimeout,
RemoteProtocolError), so metric labels do not depend on the transport.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.upstream import KEEPALIVE_S, UpstreamError, UpstreamResponse

# Unread body beyond this pauses reading from the replica (a slow client slows it down).
HIGH_WATER = 256 * 1024


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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(UpstreamError("RemoteProtocolError"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.delimited and self.error is None:
            self.complete = True  # a body that ends with the connection
            self._wake()
        elif not self.complete:
            self._fail(UpstreamError("RemoteProtocolError" if exc is None else "ReadError"))

    # --------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.delimited = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
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
        return self.complete and self.keep_alive and self.error is None and not self.closed

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _timed_out(self) -> None:
        self._fail(UpstreamError("ReadTimeout"))
        self.abort()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Http1Response:
    __slots__ = ("_conn", "_pool", "_released")

    def __init__(self, conn: Connection, pool: Http1Upstream) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False

    @property
    def status(self) -> int:
        return self._conn.status

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._conn.headers

    def content_type(self) -> str:
        for name, value in self._conn.headers:
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
                raise conn.error
            else:
                await conn.wait()

    async def close(self) -> None:
        if not self._released:
            self._released = True
            self._pool.release(self._conn)


class Http1Upstream:
    """Pooled keep-alive connections per (host, port, tls); at most ``max_connections``
    open at once (more requests wait for one)."""

    __slots__ = (
        "_connect_timeout_s",
        "_idle",
        "_read_timeout_s",
        "_slots",
        "_targets",
        "_tls_context",
    )

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float):
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._targets: dict[str, Target] = {}
        self._tls_context: ssl.SSLContext | None = None  # built on the first https replica

    async def start(self) -> None:
        return None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # replicas come and go; keep this bounded
                self._targets.clear()
            target = self._targets[url] = Target(url)
        lines = [f"POST {target.path} HTTP/1.1\r\nhost: {target.netloc}\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} has a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"content-length: {len(body)}\r\n\r\n")
        request = "".join(lines).encode("latin-1") + body
        await self._slots.acquire()
        conn: Connection | None = None
        try:
            conn = await self._send(target, request)
        except BaseException:
            if conn is not None:
                conn.abort()
            self._slots.release()
            raise
        return Http1Response(conn, self)

    async def _send(self, target: Target, request: bytes) -> Connection:
        """Send and wait for the response head. A reused connection that the replica had
        already closed (nothing came back) is replaced once by a fresh one: the replica
        never saw that request."""
        conn = self._pooled(target)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(target)
            try:
                conn.send(request)
                while not conn.head_done and conn.error is None:
                    await conn.wait()
            except BaseException:
                conn.abort()  # cancelled: the replica sees the connection go
                raise
            if conn.head_done:
                return conn
            assert conn.error is not None
            conn.abort()
            if not (reused and not conn.received and conn.error.kind != "ReadTimeout"):
                raise conn.error
            conn, reused = None, False

    def _pooled(self, target: Target) -> Connection | None:
        idle = self._idle.get(target.key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.abort()
        return None

    async def _connect(self, target: Target) -> Connection:
        loop = asyncio.get_running_loop()
        context = None
        if target.tls:
            context = self._tls_context = self._tls_context or ssl.create_default_context()
        try:
            transport, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(loop, self._read_timeout_s, target.key),
                    target.host,
                    target.port,
                    ssl=context,
                ),
                self._connect_timeout_s,
            )
        except TimeoutError:
            raise UpstreamError("ConnectTimeout") from None
        except OSError as exc:
            raise UpstreamError("ConnectError") from exc
        # uvloop may resolve create_connection before it calls connection_made.
        conn.transport = cast(asyncio.Transport, transport)
        return conn

    def release(self, conn: Connection) -> None:
        """The response is done with: keep the connection if its answer was read to the
        end and the replica keeps it alive; close it otherwise."""
        if conn.reusable():
            assert conn.transport is not None
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.abort()
        self._slots.release()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
