"""The gateway's HTTP/1.1 connection (gateway/http1.py) against scripted loopback
servers: what the wire may bring (interim answers, trailers, bytes after the answer,
a broken body) and how each ends up, through the pooled client that uses it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from gateway.http1 import UpstreamError
from gateway.upstream import Upstream
from tests.gateway.loopback import Replica, Request, answer

pytestmark = pytest.mark.timeout(60)

PATH = "/v1/chat/completions"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def client(read_timeout_s: float = 10.0, per_replica: int = 8) -> Upstream:
    return Upstream(per_replica, 2.0, read_timeout_s, pool_timeout_s=1.0)


async def echo(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    w.write(answer(200, b'{"ok":' + request.body + b"}"))


def test_content_length_answers_reuse_one_connection() -> None:
    async def main() -> None:
        replica = await Replica(echo).start()
        up = client()
        for i in range(3):
            response = await up.post(replica.url + PATH, b"%d" % i, {"x-request-id": f"r{i}"})
            assert response.status == 200
            assert response.content_type() == "application/json"
            assert await response.read() == b'{"ok":%d}' % i
            await response.close()
        await up.aclose()
        replica.close()
        assert replica.connections == 1
        last = replica.posts[2]
        assert (last.method, last.path, last.headers["x-request-id"]) == ("POST", PATH, "r2")
        assert last.headers["host"] == replica.replica_id and last.body == b"2"

    run(main())


def test_a_closed_response_keeps_its_head_while_its_connection_serves_another() -> None:
    """Read after close (the gateway awaits between, e.g. a Responses hook recording
    the id), a response's status and headers are its own, not those of the next answer
    its pooled connection carries (that read 0 before it arrived: a 500 in uvicorn)."""

    async def by_body(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(
            answer(200 if request.body == b"a" else 400, b"{}", f"text/{request.body.decode()}")
        )

    async def main() -> None:
        replica = await Replica(by_body).start()
        up = client(per_replica=1)
        first = await up.post(replica.url + PATH, b"a", {})
        assert await first.read() == b"{}"
        await first.close()
        second = await up.post(replica.url + PATH, b"b", {})  # the same connection
        assert replica.connections == 1
        assert (first.status, first.content_type()) == (200, "text/a")
        assert (second.status, second.content_type()) == (400, "text/b")
        await second.read()
        await second.close()
        await up.aclose()
        replica.close()

    run(main())


def test_a_chunked_stream_arrives_in_pieces() -> None:
    release = asyncio.Event()

    async def stream(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")

    async def main() -> None:
        replica = await Replica(stream).start()
        up = client()
        response = await up.post(replica.url + PATH, b"{}", {})
        chunks = response.chunks()
        assert await anext(chunks) == b"first"  # before the rest exists
        release.set()
        assert [c async for c in chunks] == [b"second"]
        await response.close()
        await up.aclose()
        replica.close()

    run(main())


def test_interim_answers_are_skipped() -> None:
    async def interim(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await w.drain()
        w.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
        await w.drain()
        w.write(answer(200, b'{"final":true}'))

    async def main() -> None:
        replica = await Replica(interim).start()
        up = client()
        for _ in range(2):
            response = await up.post(replica.url + PATH, b"{}", {})
            assert response.status == 200
            assert [name for name, _ in response.raw_headers] == [
                b"content-type",
                b"content-length",
            ]
            assert await response.read() == b'{"final":true}'
            await response.close()
        assert replica.connections == 1  # the interim answers left the connection clean
        await up.aclose()
        replica.close()

    run(main())


def test_chunked_trailers_are_dropped() -> None:
    async def trailers(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntrailer: x-secret\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-secret: 42\r\n\r\n")

    async def main() -> None:
        replica = await Replica(trailers).start()
        up = client()
        response = await up.post(replica.url + PATH, b"{}", {})
        assert await response.read() == b"{}"
        names = [name.lower() for name, _ in response.raw_headers]
        assert b"x-secret" not in names and b"trailer" in names
        await response.close()
        again = await up.post(replica.url + PATH, b"{}", {})  # the connection is reused
        assert await again.read() == b"{}"
        await again.close()
        assert replica.connections == 1
        await up.aclose()
        replica.close()

    run(main())


def test_bytes_after_the_answer_keep_the_connection_out_of_the_pool() -> None:
    async def junk_after(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(answer(200, b"{}") + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    async def junk_later(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(answer(200, b"{}"))
        await w.drain()
        await asyncio.sleep(0.05)  # the answer was read and the connection pooled
        w.write(b"surprise")

    async def main() -> None:
        for handler in (junk_after, junk_later):
            replica = await Replica(handler).start()
            up = client()
            for _ in range(2):
                response = await up.post(replica.url + PATH, b"{}", {})
                assert await response.read() == b"{}"
                await response.close()
                await asyncio.sleep(0.1)  # whatever follows the answer has arrived
            assert replica.connections == 2, handler.__name__
            assert len(replica.posts) == 2
            await up.aclose()
            replica.close()

    run(main())


def test_refused_timeout_broken_body_and_protocol_switch_are_upstream_errors() -> None:
    async def silent(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def broken(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()
        w.close()

    async def switch(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n")

    async def main() -> None:
        up = client(read_timeout_s=0.3)
        replica = await Replica(silent).start()
        url = replica.url + PATH
        with pytest.raises(UpstreamError) as timeout:
            await up.post(url, b"{}", {})
        assert timeout.value.kind == "ReadTimeout"
        replica.close()
        assert replica.server is not None
        await replica.server.wait_closed()
        with pytest.raises(UpstreamError) as refused:
            await up.post(url, b"{}", {})
        assert refused.value.kind == "ConnectError"
        replica = await Replica(broken).start()
        response = await up.post(replica.url + PATH, b"{}", {})
        with pytest.raises(UpstreamError) as cut:
            await response.read()
        assert cut.value.kind == "RemoteProtocolError"
        await response.close()
        replica.close()
        replica = await Replica(switch).start()
        with pytest.raises(UpstreamError) as switched:
            await up.post(replica.url + PATH, b"{}", {})
        assert switched.value.kind == "RemoteProtocolError"
        await up.aclose()
        replica.close()

    run(main())


def test_cancelling_a_request_drops_its_connection() -> None:
    closed = asyncio.Event()

    async def stream_until_gone(request: Request, r: asyncio.StreamReader, w: Any) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await w.drain()
        await r.read()  # returns at EOF: the client went away
        closed.set()
        w.close()

    async def main() -> None:
        replica = await Replica(stream_until_gone).start()
        up = Upstream(1, 2.0, 10.0, pool_timeout_s=5.0)
        streaming = asyncio.Event()

        async def consume() -> None:
            response = await up.post(replica.url + PATH, b"{}", {})
            try:
                async for _ in response.chunks():
                    streaming.set()
            finally:
                await response.close()

        task = asyncio.create_task(consume())
        await streaming.wait()
        task.cancel()
        await asyncio.wait_for(closed.wait(), 5)
        replica.on_post = echo
        # The one connection slot is free again.
        response = await asyncio.wait_for(up.post(replica.url + PATH, b"{}", {}), 5)
        await response.close()
        await up.aclose()
        replica.close()

    run(main())
