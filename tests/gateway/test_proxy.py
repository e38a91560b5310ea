"""Forwarding (gateway/proxy.py) through the real app under uvicorn, in front of scripted
loopback replicas: every path (whole answer, stream, 5xx retried, every replica failing,
4xx, a stream broken off, the client leaving) answers the client as documented and
leaves nothing in flight in the router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from functools import partial
from typing import Any

import httpx
import pytest

from gateway.state import GatewayState
from tests.conftest import wait_until_async
from tests.gateway.loopback import (
    Replica,
    Request,
    answer,
    answer_ok,
    completion,
    running_gateway,
    sse,
)

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "m", "prompt": "forward me"}
ERROR = {"error": {"message": "replica broke", "type": "server_error", "param": None, "code": None}}


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def in_flight(state: GatewayState) -> int:
    return sum(v.in_flight for v in state.router.replicas.values())


def metric(state: GatewayState, prefix: str) -> float:
    """Sum of the samples whose line starts with ``prefix`` in the gateway's /metrics."""
    lines = state.metrics.render().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix))


async def answer_by_mode(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    if json.loads(request.body).get("stream"):
        usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 16}}, "choices": []}
        w.write(sse('{"choices":[{"text":"a"}]}', json.dumps(usage)))
    else:
        w.write(answer(200, completion("whole", cached=32)))


async def fail_500(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    w.write(answer(500, json.dumps(ERROR).encode()))


async def hang_up(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    w.close()  # the request arrived; no answer at all


async def refuse_400(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    body = {"error": {"message": "bad", "type": "invalid_request_error", "param": None}}
    w.write(answer(400, json.dumps(body).encode()))


def test_whole_and_streamed_answers_pass_through() -> None:
    async def main() -> None:
        replica = await Replica(answer_by_mode).start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "whole"
            assert r.headers["x-prefixgate-replica"] == replica.replica_id
            assert "x-accel-buffering" not in r.headers
            assert in_flight(state) == 0
            r = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            # No proxy in front may hold the tokens back (nginx buffers by default).
            assert r.headers["x-accel-buffering"] == "no"
            assert r.headers["cache-control"] == "no-cache"
            assert in_flight(state) == 0
            assert metric(state, "prefixgate_gateway_reported_cached_tokens_total") == 48
            assert replica.posts[1].headers["x-request-id"] == r.headers["x-request-id"]
        replica.close()

    run(main())


def test_a_5xx_before_the_first_byte_is_retried_on_the_other_replica() -> None:
    async def main() -> None:
        bad, good = await Replica(fail_500).start(), await Replica().start()
        async with (
            running_gateway([bad, good], policy="round_robin") as (url, state),
            httpx.AsyncClient() as client,
        ):
            retries = 0
            for _ in range(2):  # round robin: the bad one comes first at least once
                r = await client.post(url + "/v1/completions", json=BODY)
                assert r.status_code == 200, r.text
                assert r.headers["x-prefixgate-replica"] == good.replica_id
                retries += int(r.headers["x-prefixgate-route"].rsplit("retries=", 1)[1])
            assert retries == len(bad.posts) >= 1 and len(good.posts) == 2
            assert metric(state, "prefixgate_gateway_retries_total") == retries
            failed = "prefixgate_gateway_upstream_failures_total{"
            assert (
                metric(state, failed + f'kind="http_500",replica="{bad.replica_id}"}}') == retries
            )
            assert in_flight(state) == 0
        bad.close()
        good.close()

    run(main())


async def answer_late(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3)  # a long generation, answered whole at its end
    w.write(answer(200, completion("late")))


def test_no_answer_within_the_timeout_is_a_504_not_retried_nor_blamed() -> None:
    """A whole (unstreamed) answer comes at the end of its generation. One longer than
    the gateway's read timeout was retried on another replica (which took as long), then
    answered 502 blaming both, and counted as a failure in both breakers."""

    async def main() -> None:
        slow = [await Replica(answer_late).start() for _ in range(2)]
        async with (
            running_gateway(slow, upstream_timeout_s=0.5) as (url, state),
            httpx.AsyncClient() as client,
        ):
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 504, r.text
            error = r.json()["error"]
            assert error["code"] == "upstream_timeout" and "0.5 s" in error["message"]
            assert sorted(len(replica.posts) for replica in slow) == [0, 1]  # not retried
            assert in_flight(state) == 0
            breakers = [v.breaker for v in state.router.replicas.values()]
            assert all(b.consecutive_failures == 0 and b.state == "closed" for b in breakers)
            assert metric(state, "prefixgate_gateway_upstream_failures_total{") == 1
        for replica in slow:
            replica.close()

    run(main())


def _posts_reach(a: Replica, b: Replica, count: int) -> bool:
    return len(a.posts) + len(b.posts) == count


async def never_answer(request: Request, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await r.read()  # holds the request until the gateway drops the connection


def test_no_answer_in_time_from_a_replica_failing_its_probes_is_retried() -> None:
    """A hung replica (its probes fail too) is not a long answer: the request goes to
    another replica, as before the 504."""

    async def main() -> None:
        hung = await Replica(never_answer).start()
        good = await Replica().start()
        async with (
            running_gateway([hung, good], policy="round_robin", upstream_timeout_s=2.0) as (
                url,
                state,
            ),
            httpx.AsyncClient() as client,
        ):
            for sent in range(1, 3):  # round robin: the hung one comes first once
                request = asyncio.create_task(client.post(url + "/v1/completions", json=BODY))
                posts = partial(_posts_reach, hung, good, sent)
                await wait_until_async(posts, what=f"request {sent} at a replica")
                if hung.posts:
                    hung.healthy = False  # it hangs: its probes fail now too
                r = await request
                assert r.status_code == 200, r.text
                assert r.headers["x-prefixgate-replica"] == good.replica_id
                if hung.posts:
                    break
            assert len(hung.posts) == 1
            assert r.headers["x-prefixgate-route"].endswith("retries=1")
            assert in_flight(state) == 0
        hung.close()
        good.close()

    run(main())


def test_when_every_replica_fails_the_client_gets_the_last_error() -> None:
    async def main() -> None:
        a, b = await Replica(fail_500).start(), await Replica(fail_500).start()
        silent = await Replica(hang_up).start()
        async with running_gateway([a, b]) as (url, state), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 500 and r.json() == ERROR  # OpenAI-shaped: as it came
            assert len(a.posts) + len(b.posts) == 2 and in_flight(state) == 0
        async with running_gateway([silent]) as (url, state), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "upstream_unavailable"
            assert in_flight(state) == 0
        for replica in (a, b, silent):
            replica.close()

    run(main())


def test_a_4xx_is_the_clients_answer_and_is_not_retried() -> None:
    async def main() -> None:
        a, b = await Replica(refuse_400).start(), await Replica(refuse_400).start()
        async with running_gateway([a, b]) as (url, state), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            assert r.status_code == 400 and r.json()["error"]["message"] == "bad"
            assert len(a.posts) + len(b.posts) == 1
            assert metric(state, "prefixgate_gateway_retries_total") == 0
            assert in_flight(state) == 0
        a.close()
        b.close()

    run(main())


def test_a_stream_broken_off_ends_with_an_error_event() -> None:
    async def break_off(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(sse('{"choices":[{"text":"a"}]}', done=False))  # no last chunk
        await w.drain()
        w.close()

    async def main() -> None:
        replica = await Replica(break_off).start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            events = [e for e in r.text.split("\n\n") if e]
            assert r.status_code == 200 and len(events) == 3, events
            assert events[2] == "data: [DONE]"
            error = json.loads(events[1].removeprefix("data: "))["error"]
            assert error["code"] == "upstream_error" and "incomplete" in error["message"]
            assert metric(state, "prefixgate_gateway_requests_total{") == 1
            assert metric(state, 'prefixgate_gateway_requests_total{endpoint="completions"') == 1
            assert in_flight(state) == 0
        replica.close()

    run(main())


def test_a_stream_broken_inside_an_event_never_glues_it_to_the_error() -> None:
    half = b'data: {"choices":[{"te'

    async def break_mid_event(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(sse('{"choices":[{"text":"a"}]}', done=False))
        w.write(b"%x\r\n%s\r\n" % (len(half), half))  # half an event, then the line drops
        await w.drain()
        w.close()

    async def main() -> None:
        replica = await Replica(break_mid_event).start()
        async with running_gateway([replica]) as (url, _), httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) == 3, events
            first, error = (json.loads(e.removeprefix("data: ")) for e in events[:2])
            assert first["choices"][0]["text"] == "a"
            assert error["error"]["code"] == "upstream_error"
        replica.close()

    run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_closes_the_upstream_connection(stream: bool) -> None:
    gone = asyncio.Event()

    async def start_then_wait(request: Request, r: asyncio.StreamReader, w: Any) -> None:
        if gone.is_set():  # the request after: answered
            await answer_ok(request, r, w)
            return
        if stream:  # the head and a first event, then nothing more
            w.write(sse('{"choices":[{"text":"a"}]}', done=False))
            await w.drain()
        await r.read()  # returns at EOF: the gateway dropped the connection
        gone.set()
        w.close()

    async def main() -> None:
        replica = await Replica(start_then_wait).start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            if stream:  # leaves once the first event arrived
                body = {**BODY, "stream": True}
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    assert b"data:" in await anext(r.aiter_raw())
                    assert in_flight(state) == 1
            else:  # leaves while the replica computes
                request = asyncio.create_task(client.post(url + "/v1/completions", json=BODY))
                await wait_until_async(lambda: replica.posts, what="the request upstream")
                assert in_flight(state) == 1
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
            await asyncio.wait_for(gone.wait(), 10)
            await wait_until_async(lambda: in_flight(state) == 0, what="in flight drained")
            left = 'prefixgate_gateway_requests_total{endpoint="completions",replica='
            await wait_until_async(
                lambda: metric(state, left + f'"{replica.replica_id}",status="499"}}') == 1,
                what="the exchange recorded as 499",
            )
            r = await client.post(url + "/v1/completions", json=BODY)  # still serving
            assert r.status_code == 200
        replica.close()

    run(main())


def test_no_free_connection_is_503_with_retry_after_and_others_still_serve() -> None:
    async def hang(request: Request, r: asyncio.StreamReader, w: Any) -> None:
        await r.read()  # holds its connection until the gateway drops it

    async def main() -> None:
        hung, healthy = await Replica(hang).start(), await Replica().start()
        settings = {"max_connections_per_replica": 1, "pool_timeout_s": 0.3}
        async with (
            running_gateway([hung], **settings) as (url, state),
            running_gateway([hung, healthy], **settings) as (url2, state2),
            httpx.AsyncClient() as client,
        ):
            held = asyncio.create_task(client.post(url + "/v1/completions", json=BODY))
            await wait_until_async(lambda: hung.posts, what="the hung replica holds a request")
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "upstream_busy", r.text
            assert len(hung.posts) == 1  # the second request was never sent there
            # Behind another gateway with a second replica, once the hung one holds this
            # gateway's connection too, every request is answered by the other.
            held2: asyncio.Task[httpx.Response] | None = None
            while held2 is None:
                task = asyncio.create_task(client.post(url2 + "/v1/completions", json=BODY))

                def answered_or_held(task: asyncio.Task[httpx.Response] = task) -> bool:
                    return task.done() or len(hung.posts) == 2

                await wait_until_async(answered_or_held, what="answered or held")
                held2 = None if task.done() else task
            for _ in range(4):
                r = await client.post(url2 + "/v1/completions", json=BODY)
                assert r.status_code == 200 and r.headers["x-prefixgate-replica"] == (
                    healthy.replica_id
                )
            for task in (held, held2):
                task.cancel()
            await asyncio.gather(held, held2, return_exceptions=True)
            await wait_until_async(
                lambda: in_flight(state) == in_flight(state2) == 0, what="in flight drained"
            )
        hung.close()
        healthy.close()

    run(main())


def test_trailers_and_hop_by_hop_headers_never_reach_the_client() -> None:
    async def with_trailer(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        body = completion("t")
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-vendor: kept\r\n")
        w.write(b"connection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n%s\r\n0\r\nx-secret: 42\r\n\r\n" % (len(body), body))

    async def main() -> None:
        replica = await Replica(with_trailer).start()
        async with running_gateway([replica]) as (url, _), httpx.AsyncClient() as client:
            for stream in (False, True):
                r = await client.post(url + "/v1/completions", json={**BODY, "stream": stream})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t"
                assert r.headers["x-vendor"] == "kept" and "x-secret" not in r.headers
                assert "x-secret" not in r.text
        replica.close()

    run(main())


def test_a_streams_tokens_leave_the_queue_at_its_first_output() -> None:
    prefilled, finish = asyncio.Event(), asyncio.Event()

    def chunk(data: str) -> bytes:
        event = f"data: {data}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(event), event)

    async def role_then_tokens(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(sse('{"choices":[{"delta":{"role":"assistant","content":""}}]}', done=False))
        await w.drain()  # a chat stream's role chunk goes out before any token
        await prefilled.wait()
        w.write(chunk('{"choices":[{"delta":{"content":"tok"}}]}'))
        await w.drain()
        await finish.wait()
        w.write(chunk("[DONE]") + b"0\r\n\r\n")

    async def main() -> None:
        replica = await Replica(role_then_tokens).start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            load = state.router.replicas[replica.replica_id].load
            body = {"model": "m", "prompt": "p" * 400, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                chunks = r.aiter_raw()
                assert b"role" in await anext(chunks)
                assert load.queued_tokens == 100  # 400 bytes: 100 pseudo-tokens, none cached
                prefilled.set()
                assert b"tok" in await anext(chunks)
                assert load.queued_tokens == 0 and load.in_flight == 1  # decoding
                finish.set()
                rest = b"".join([c async for c in chunks])
            assert b"[DONE]" in rest and load.in_flight == 0
        replica.close()

    run(main())
