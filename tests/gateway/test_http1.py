"""The gateway's own HTTP/1.1 client against real loopback servers (asyncio, raw bytes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from gateway.http1 import Http1Upstream
from gateway.upstream import UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_content_length_answers_reuse_one_connection() -> None:
    connections = 0
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append(head + body)
            answer = b'{"ok":' + body + b"}"
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await serve(handler)
        up = Http1Upstream(8, 2.0, 10.0)
        for i in range(3):
            response = await up.post(url, b"%d" % i, {"x-request-id": f"r{i}"})
            assert response.status == 200
            assert response.content_type() == "application/json"
            assert await response.read() == b'{"ok":%d}' % i
            await response.close()
        await up.aclose()
        server.close()
        assert connections == 1
        assert seen[2].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"x-request-id: r2\r\n" in seen[2] and seen[2].endswith(b"\r\n\r\n2")

    run(main())


def test_chunked_stream_arrives_in_pieces_and_a_stale_connection_is_replaced() -> None:
    release = asyncio.Event()
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()  # after answering: the pooled connection is dead when reused

    async def main() -> None:
        server, url = await serve(handler)
        up = Http1Upstream(8, 2.0, 10.0)
        response = await up.post(url, b"{}", {})
        chunks = response.chunks()
        assert await anext(chunks) == b"first"  # before the rest exists
        release.set()
        assert [c async for c in chunks] == [b"second"]
        await response.close()
        # The server closed that connection: seen already (dropped from the pool) or not
        # yet (the write meets a closed socket, nothing came back: one fresh retry).
        again = await up.post(url, b"{}", {})
        assert await again.read() == b"firstsecond"
        await again.close()
        assert connections == 2
        await up.aclose()
        server.close()

    run(main())


def test_refused_timeout_and_broken_body_are_upstream_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def main() -> None:
        up = Http1Upstream(8, 2.0, 0.3)
        server, url = await serve(silent)
        with pytest.raises(UpstreamError) as timeout:
            await up.post(url, b"{}", {})
        assert timeout.value.kind == "ReadTimeout"
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError) as refused:
            await up.post(url, b"{}", {})
        assert refused.value.kind == "ConnectError"
        server, url = await serve(broken)
        response = await up.post(url, b"{}", {})
        with pytest.raises(UpstreamError) as cut:
            await response.read()
        assert cut.value.kind == "RemoteProtocolError"
        await response.close()
        await up.aclose()
        server.close()

    run(main())


def test_cancelling_a_request_drops_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client went away
        closed.set()

    async def main() -> None:
        server, url = await serve(handler)
        up = Http1Upstream(1, 2.0, 10.0)

        streaming = asyncio.Event()

        async def consume() -> None:
            response = await up.post(url, b"{}", {})
            try:
                async for _ in response.chunks():
                    streaming.set()
            finally:
                await response.close()

        task = asyncio.create_task(consume())
        await streaming.wait()
        task.cancel()
        await asyncio.wait_for(closed.wait(), 5)
        # The one connection slot is free again.
        response = await asyncio.wait_for(up.post(url, b"{}", {}), 5)
        await response.close()
        await up.aclose()
        server.close()

    run(main())
