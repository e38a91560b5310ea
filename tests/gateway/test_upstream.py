"""The pooled client (gateway/upstream.py) against scripted loopback replicas: a limit of
connections per replica with a bounded wait, a hung replica that starves only itself,
and a request written at most once."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import uvloop

from gateway.http1 import UpstreamError
from gateway.upstream import Upstream
from prefixgate.keepalive import TCP_KEEPALIVE
from tests.conftest import wait_until_async
from tests.gateway.loopback import Replica, Request, answer, answer_ok

pytestmark = pytest.mark.timeout(60)

PATH = "/v1/completions"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def hang(request: Request, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await r.read()  # holds the connection until the client drops it


def test_a_hung_replica_starves_only_itself() -> None:
    async def main() -> None:
        hung, healthy = await Replica(hang).start(), await Replica().start()
        up = Upstream(2, 2.0, 30.0, pool_timeout_s=0.3)
        held = [asyncio.create_task(up.post(hung.url + PATH, b"{}", {})) for _ in range(2)]
        await wait_until_async(lambda: len(hung.posts) == 2, what="both connections held")
        # Another replica is served at once, however many wait on the hung one.
        response = await asyncio.wait_for(up.post(healthy.url + PATH, b"{}", {}), 1)
        assert response.status == 200
        await response.close()
        started = time.monotonic()
        with pytest.raises(UpstreamError) as busy:
            await up.post(hung.url + PATH, b"{}", {})
        assert busy.value.kind == "PoolTimeout"
        assert time.monotonic() - started >= 0.3
        assert len(hung.posts) == 2 and hung.connections == 2  # the third was never sent
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_until_async(lambda: hung.open_connections == 0, what="held connections dropped")
        hung.on_post = answer_ok  # the slots are free again
        response = await asyncio.wait_for(up.post(hung.url + PATH, b"{}", {}), 1)
        assert response.status == 200
        await response.close()
        await up.aclose()
        hung.close()
        healthy.close()

    run(main())


def test_a_freed_connection_goes_to_the_request_waiting_for_one() -> None:
    release = asyncio.Event()

    async def slow(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        await release.wait()
        w.write(answer(200, request.body))

    async def main() -> None:
        replica = await Replica(slow).start()
        up = Upstream(1, 2.0, 30.0, pool_timeout_s=5.0)
        tasks = [asyncio.create_task(up.post(replica.url + PATH, b"%d" % i, {})) for i in (1, 2)]
        await wait_until_async(lambda: len(replica.posts) == 1, what="the first request sent")
        release.set()
        one = await tasks[0]
        assert await one.read() == b"1"
        await one.close()  # its connection goes to the waiting request
        two = await asyncio.wait_for(tasks[1], 5)
        assert await two.read() == b"2"
        await two.close()
        assert replica.connections == 1
        await up.aclose()
        replica.close()

    run(main())


def test_a_connection_the_replica_closed_while_idle_is_replaced_before_writing() -> None:
    async def answer_and_close(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(answer(200, b"{}"))
        await w.drain()
        w.close()  # keep-alive promised, then closed: the pooled connection is dead

    async def main() -> None:
        replica = await Replica(answer_and_close).start()
        up = Upstream(4, 2.0, 10.0, pool_timeout_s=1.0)
        for _ in range(3):
            response = await up.post(replica.url + PATH, b"{}", {})
            assert await response.read() == b"{}"
            await response.close()
        assert replica.connections == 3 and len(replica.posts) == 3
        await up.aclose()
        replica.close()

    run(main())


def test_a_written_request_that_got_no_answer_is_not_sent_again() -> None:
    async def answer_once(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        if len(replica.posts) == 1:
            w.write(answer(200, b"{}"))
        else:
            w.close()  # read the request, then went away without answering

    replica = Replica(answer_once)

    async def main() -> None:
        await replica.start()
        up = Upstream(4, 2.0, 10.0, pool_timeout_s=1.0)
        response = await up.post(replica.url + PATH, b"{}", {})
        assert await response.read() == b"{}"
        await response.close()
        with pytest.raises(UpstreamError) as lost:
            await up.post(replica.url + PATH, b"{}", {})  # on the pooled connection
        assert lost.value.kind in {"RemoteProtocolError", "ReadError"}
        assert len(replica.posts) == 2 and replica.connections == 1  # not re-sent
        await up.aclose()
        replica.close()

    run(main())


def test_the_limit_must_allow_a_connection() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Upstream(0, 2.0, 10.0, pool_timeout_s=1.0)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connections_to_replicas_probe_for_a_vanished_host(loop: str) -> None:
    """A replica whose host is gone sends no FIN: without keepalive probes, a request
    waiting on it waited out the read timeout (benchmarks/vanished_replica.py)."""
    seen: dict[str, int] = {}

    async def main() -> None:
        replica = await Replica().start()
        up = Upstream(2, 2.0, 30.0, pool_timeout_s=1.0)
        response = await up.post(replica.url + PATH, b"{}", {})
        transport = response._conn.transport  # the connection the answer came on
        assert transport is not None
        sock = transport.get_extra_info("socket")
        seen["keepalive"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        seen["idle"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        seen["interval"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        seen["count"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        await response.close()
        await up.aclose()
        replica.close()

    if loop == "uvloop":  # the gateway's loop
        uvloop.run(asyncio.wait_for(main(), 20))
    else:
        run(main())
    assert seen["keepalive"] == 1
    assert (seen["idle"], seen["interval"], seen["count"]) == TCP_KEEPALIVE
