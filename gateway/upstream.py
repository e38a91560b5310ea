"""The pooled client for forwarded requests (chat, completions and the Responses API's
POST, GET and DELETE): keep-alive HTTP/1.1 connections per replica
(gateway/http1.py), at most ``max_per_replica`` in use at once on each.

A replica whose connections are all busy (a hung one holds them until the read timeout)
makes only its own requests wait, and only up to ``pool_timeout_s``: then the request
fails with ``PoolTimeout`` without having been sent, and the proxy tries another replica
or answers 503 with Retry-After. Other replicas are served meanwhile.

A request is written once. It is sent again only on a connection that the replica closed
before the request was written (an idle connection found closed or readable is dropped
and another taken); a request that was written and then got no answer fails: the replica
may have received it, and whether to retry elsewhere is the proxy's decision.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from typing import cast

from gateway.http1 import Connection, Response, Target, UpstreamError
from prefixgate.keepalive import keep_probing
from prefixgate.open_files import out_of_files

# Uvicorn (vLLM, SGLang, our replicas) drops idle keep-alive connections after 5 s; we let
# go of them a little earlier, so a pooled connection is rarely dead when it is reused.
KEEPALIVE_S = 4.0
MAX_TARGETS = 4096  # replicas come and go: parsed URLs and idle pools stay bounded
METHODS = frozenset({"GET", "POST", "DELETE"})  # what the gateway forwards
# UpstreamError.kinds for a request that was not sent, for want of a free connection to
# the replica in time, or of a file descriptor here: neither is the replica's failure.
POOL_TIMEOUT = "PoolTimeout"
OUT_OF_FILES = "OutOfFiles"


@dataclass(slots=True)
class ReplicaPool:
    """One replica's connections: idle ones (most recent last) and the slots in use."""

    slots: asyncio.Semaphore
    in_use: int = 0
    idle: list[Connection] = field(default_factory=list)


class Upstream:
    __slots__ = (
        "_connect_timeout_s",
        "_max_per_replica",
        "_pool_timeout_s",
        "_pools",
        "_read_timeout_s",
        "_targets",
        "_tls_context",
    )

    def __init__(
        self,
        max_per_replica: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        pool_timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the context of HTTPS replicas' connections (None: the system's CAs)."""
        if max_per_replica < 1:
            raise ValueError("max_per_replica must be at least 1")
        self._max_per_replica = max_per_replica
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._pool_timeout_s = pool_timeout_s
        self._pools: dict[tuple[str, int, bool], ReplicaPool] = {}
        self._targets: dict[str, Target] = {}
        self._tls_context = tls  # None: built on the first https replica

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send a POST; returns once the final answer's head arrived. Raises UpstreamError."""
        return await self.request("POST", url, body, headers)

    async def request(
        self, method: str, url: str, body: bytes, headers: dict[str, str]
    ) -> Response:
        """Send ``method`` with ``body`` (empty for a GET or DELETE; a Content-Length is
        always sent); returns once the final answer's head arrived. Raises UpstreamError."""
        if method not in METHODS:
            raise ValueError(f"method {method!r} is not one the gateway forwards")
        target = self._target(url)
        lines = [f"{method} {target.path} HTTP/1.1\r\nhost: {target.netloc}\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} has a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"content-length: {len(body)}\r\n\r\n")
        request = "".join(lines).encode("latin-1") + body
        pool = await self._acquire(target.key)
        conn: Connection | None = None
        try:
            conn = self._idle(pool) or await self._connect(target)
            conn.send(request)
            while not conn.head_done and conn.error is None:
                await conn.wait()
            if conn.error is not None:
                raise conn.failure()
        except BaseException:  # failed or cancelled: the replica sees the connection go
            if conn is not None:
                conn.abort()
            self._free(pool)
            raise
        return Response(conn, self.release)

    def _target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = Target(url)
        return target

    async def _acquire(self, key: tuple[str, int, bool]) -> ReplicaPool:
        pool = self._pools.get(key)
        if pool is None:
            if len(self._pools) >= MAX_TARGETS:
                self._prune()
            pool = self._pools[key] = ReplicaPool(asyncio.Semaphore(self._max_per_replica))
        if pool.slots.locked():
            try:
                async with asyncio.timeout(self._pool_timeout_s):
                    await pool.slots.acquire()
            except TimeoutError:
                raise UpstreamError(POOL_TIMEOUT) from None
        else:
            await pool.slots.acquire()  # free: returns without waiting
        pool.in_use += 1
        return pool

    def _free(self, pool: ReplicaPool) -> None:
        pool.in_use -= 1
        pool.slots.release()

    def _idle(self, pool: ReplicaPool) -> Connection | None:
        """The most recently used idle connection that is provably open and quiet."""
        now = time.monotonic()
        while pool.idle:
            conn = pool.idle.pop()
            if now - conn.idle_since < KEEPALIVE_S and not conn.dropped():
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
            kind = OUT_OF_FILES if out_of_files(exc) else "ConnectError"
            raise UpstreamError(kind) from exc
        # uvloop may resolve create_connection before it calls connection_made.
        conn.transport = cast(asyncio.Transport, transport)
        keep_probing(conn.transport)  # a replica whose host vanished: prefixgate/keepalive.py
        return conn

    def release(self, conn: Connection) -> None:
        """The response is done with: keep the connection if it can carry another
        request (gateway/http1.py, ``Connection.reusable``); close it otherwise."""
        pool = self._pools.get(conn.key)
        if conn.reusable() and pool is not None:
            conn.idle_since = time.monotonic()
            pool.idle.append(conn)
        else:
            conn.abort()
        if pool is not None:
            self._free(pool)

    def _prune(self) -> None:
        """Forget the pools of replicas with nothing in use (their idle connections go)."""
        for key, pool in list(self._pools.items()):
            if pool.in_use == 0:
                for conn in pool.idle:
                    conn.abort()
                del self._pools[key]

    async def aclose(self) -> None:
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.abort()
            pool.idle.clear()
