"""The HTTP client for forwarded requests: one pooled keep-alive client per gateway.

The hot path needs four things from it: send a POST with the client's bytes, the answer's
status and raw headers, its body whole or chunk by chunk as it arrives, and a close that
drops the connection when the body was not read to the end (so that the replica sees the
client leave and frees the request's blocks). ``Upstream`` is that surface.

``http1`` (the default) is the gateway's own minimal HTTP/1.1 client (gateway/http1.py).
``aiohttp`` calls aiohttp directly. ``httpx`` and ``httpx-aiohttp`` go through httpx's
API, with its own transport or with aiohttp's under it. Per request they cost more CPU in
that order (benchmarks/gateway_bench.py compares them); the others stay as fallbacks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol

import aiohttp
import httpx

Transport = Literal["http1", "aiohttp", "httpx", "httpx-aiohttp"]
TRANSPORTS: tuple[Transport, ...] = ("http1", "aiohttp", "httpx", "httpx-aiohttp")


class UpstreamError(Exception):
    """The replica could not be reached, timed out, or broke its answer off; ``kind``
    names the failure for metrics, in httpx's terms whatever the transport."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def aiohttp_kind(exc: BaseException) -> str:
    """aiohttp's failure as httpx names it, so metric labels do not depend on the transport."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "ConnectTimeout"
    if isinstance(exc, TimeoutError):
        return "ReadTimeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "RemoteProtocolError"
    if isinstance(exc, aiohttp.ClientOSError):
        return "ReadError"
    return type(exc).__name__


class UpstreamResponse(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...

    def content_type(self) -> str: ...

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def close(self) -> None:
        """Done with the answer: the connection goes back to the pool when the body was
        read to the end, and is closed otherwise."""
        ...


class Upstream(Protocol):
    async def start(self) -> None: ...

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send; returns once the response head arrived. Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...


# Uvicorn (vLLM, SGLang, our replicas) drops idle keep-alive connections after 5 s; we let
# go of them a little earlier, so a pooled connection is rarely dead when it is reused.
KEEPALIVE_S = 4.0

# aiohttp adds these unless told not to. No Accept-Encoding: the body passes through
# undecoded, so the replica must answer uncompressed.
SKIPPED_AUTO_HEADERS = ("Accept-Encoding", "User-Agent", "Accept")


class AiohttpResponse:
    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._response.raw_headers

    def content_type(self) -> str:
        return self._response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(aiohttp_kind(exc)) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(aiohttp_kind(exc)) from exc

    async def close(self) -> None:
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpUpstream:
    __slots__ = ("_max_connections", "_session", "_timeout")

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float):
        self._max_connections = max_connections
        # sock_read bounds the wait for each next byte, the first one included.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp binds its session to the running loop: built here, not in __init__.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=KEEPALIVE_S
                ),
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=SKIPPED_AUTO_HEADERS,
                auto_decompress=False,
                trust_env=False,
            )

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        if self._session is None:
            await self.start()
        assert self._session is not None
        try:
            response = await self._session.request("POST", url, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(aiohttp_kind(exc)) from exc
        return AiohttpResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpxResponse:
    __slots__ = ("_response",)

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._response.headers.raw

    def content_type(self) -> str:
        return self._response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc

    async def close(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    __slots__ = ("_client",)

    def __init__(
        self,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        *,
        aiohttp_transport: bool,
    ) -> None:
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_S,
        )
        timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=read_timeout_s, pool=None
        )
        if aiohttp_transport:
            from httpx_aiohttp import AiohttpTransport

            transport = AiohttpTransport(limits=limits, trust_env=False)
            self._client = httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
        else:
            self._client = httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)

    async def start(self) -> None:
        return None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        request = self._client.build_request("POST", url, content=body, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from exc
        return HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()
