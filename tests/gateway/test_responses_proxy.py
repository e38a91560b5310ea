"""The Responses API on the gateway's own transport (gateway/proxy.py, the pooled
HTTP/1.1 client) through the real app under uvicorn, in front of scripted loopback
replicas, driven by the official openai client: a new response is retried elsewhere
before its first byte and a pinned turn is not, a stream's response id is recorded
before the client sees it, a broken stream ends with a Responses error event, GET /
DELETE / cancel reach the owner with their method and query, and nothing is left in
flight in the router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import httpx
import openai
import pytest

from gateway.auth import OPEN_TENANT
from gateway.response_affinity import Owner
from gateway.state import GatewayState
from tests.conftest import wait_until_async
from tests.gateway.loopback import Replica, Request, answer, running_gateway

pytestmark = pytest.mark.timeout(60)

ERROR = {"error": {"message": "replica broke", "type": "server_error", "param": None, "code": None}}


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def in_flight(state: GatewayState) -> int:
    return sum(v.in_flight for v in state.router.replicas.values())


def metric(state: GatewayState, prefix: str) -> float:
    lines = state.metrics.render().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def response(response_id: str, text: str = "hi", cached: int = 0) -> dict[str, Any]:
    message = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": "m",
        "status": "completed",
        "output": [message],
        "usage": {
            "input_tokens": 40,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 41,
        },
    }


def events_head() -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}).encode()
    chunk = b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(chunk), chunk)


def owner(state: GatewayState, response_id: str) -> str | None:
    found = state.affinity.local.get(response_id)
    return found[0].replica_id if found is not None else None


def test_a_new_response_is_retried_elsewhere_a_pinned_turn_is_not() -> None:
    async def flaky(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(answer(500, json.dumps(ERROR).encode()))

    made: list[str] = []

    async def answers(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        body = json.loads(request.body)
        if body.get("previous_response_id"):  # the follow-up fails here too
            w.write(answer(500, json.dumps(ERROR).encode()))
        else:
            made.append(f"resp_{len(made)}")
            w.write(answer(200, json.dumps(response(made[-1], cached=8)).encode()))

    async def main() -> None:
        bad, good = await Replica(flaky).start(), await Replica(answers).start()
        async with running_gateway([bad, good], policy="round_robin") as (url, state):
            c, retries = client(url), 0
            for i in range(2):  # round robin: the bad one comes first at least once
                raw = await c.responses.with_raw_response.create(model="m", input=f"hello {i}")
                created = raw.parse()
                assert raw.headers["x-prefixgate-replica"] == good.replica_id
                assert owner(state, created.id) == good.replica_id
                retries += int(raw.headers["x-prefixgate-route"].rsplit("retries=", 1)[1])
            assert retries == len(bad.posts) >= 1
            assert metric(state, "prefixgate_gateway_retries_total") == retries
            assert metric(state, "prefixgate_gateway_reported_cached_tokens_total") == 16
            before = len(bad.posts)
            with pytest.raises(openai.InternalServerError, match="replica broke"):
                await c.responses.create(model="m", previous_response_id=created.id, input="?")
            assert len(bad.posts) == before  # only the owner holds the conversation
            assert json.loads(good.posts[-1].body)["previous_response_id"] == created.id
            failed = "prefixgate_gateway_upstream_failures_total{"
            assert metric(state, failed + f'kind="http_500",replica="{good.replica_id}"}}') == 1
            decisions = 'prefixgate_gateway_routing_decisions_total{reason="response_affinity"}'
            assert metric(state, decisions) == 1
            assert in_flight(state) == 0
        bad.close()
        good.close()

    run(main())


def test_a_streamed_id_is_recorded_before_the_client_sees_it() -> None:
    seen = asyncio.Event()  # the test saw response.created: the replica may go on

    async def stream(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(events_head() + event("response.created", response=response("resp_s")))
        await w.drain()
        await seen.wait()
        w.write(event("response.output_text.delta", item_id="msg_1", delta="hi"))
        w.write(event("response.completed", response=response("resp_s", cached=24)))
        w.write(b"0\r\n\r\n")

    async def main() -> None:
        replica = await Replica(stream).start()
        async with running_gateway([replica]) as (url, state):
            kinds = []
            async with await client(url).responses.create(
                model="m", input="stream it", stream=True
            ) as events:
                async for item in events:
                    if item.type == "response.created":
                        assert owner(state, item.response.id) == replica.replica_id
                        seen.set()
                    kinds.append(item.type)
            assert kinds == [
                "response.created", "response.output_text.delta", "response.completed"
            ]  # fmt: skip
            assert metric(state, "prefixgate_gateway_reported_cached_tokens_total") == 24
            async with await client(url).responses.create(
                model="m", input="more", previous_response_id="resp_s", stream=True
            ) as events:
                assert [item.type async for item in events][-1] == "response.completed"
            assert json.loads(replica.posts[-1].body)["previous_response_id"] == "resp_s"
            # a pinned turn's cached tokens have no prediction to be compared with
            assert metric(state, "prefixgate_gateway_reported_cached_tokens_total") == 24
            assert in_flight(state) == 0
        replica.close()

    run(main())


def test_a_broken_stream_ends_with_a_responses_error_event() -> None:
    async def break_off(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(events_head() + event("response.created", response=response("resp_b")))
        w.write(event("response.output_text.delta", item_id="msg_1", delta="hal"))
        await w.drain()
        w.close()  # no response.completed, no last chunk

    async def main() -> None:
        replica = await Replica(break_off).start()
        async with running_gateway([replica]) as (url, state):
            kinds, errors = [], []
            events = await client(url).responses.create(model="m", input="x", stream=True)
            async for item in events:
                kinds.append(item.type)
                if item.type == "error":
                    errors.append(item)
            assert kinds == ["response.created", "response.output_text.delta", "error"]
            assert errors[0].code == "upstream_error" and "incomplete" in errors[0].message
            stats = state.router.replicas[replica.replica_id]
            assert stats.breaker.consecutive_failures == 1  # the replica's fault
            assert in_flight(state) == 0
        replica.close()

    run(main())


def test_by_id_requests_reach_the_owner_with_their_method_and_query() -> None:
    async def owner_replica(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        if request.method == "POST" and request.path == "/v1/responses":
            w.write(answer(200, json.dumps(response("resp_q")).encode()))
        elif request.path.endswith("/cancel"):
            body = {"error": {"message": "only background responses", "type": "x"}}
            w.write(answer(400, json.dumps(body).encode()))
        elif "stream=true" in request.path:  # a stored response replayed as events
            w.write(events_head() + event("response.created", response=response("resp_q")))
            w.write(event("response.completed", response=response("resp_q", text="again")))
            w.write(b"0\r\n\r\n")
        else:  # GET and DELETE
            w.write(answer(200, json.dumps(response("resp_q", text=request.method)).encode()))

    async def main() -> None:
        other, replica = await Replica().start(), await Replica(owner_replica).start()
        async with running_gateway([other, replica], policy="round_robin") as (url, state):
            c = client(url)
            while (await c.responses.create(model="m", input="make one")).id != "resp_q":
                pass  # round robin: the next one comes from the owner
            got = await c.responses.retrieve("resp_q", include=["message.output_text.logprobs"])
            assert got.output_text == "GET"
            replayed = [e async for e in await c.responses.retrieve("resp_q", stream=True)]
            assert [e.type for e in replayed] == ["response.created", "response.completed"]
            assert replica.posts[-1].path == "/v1/responses/resp_q?stream=true"
            with pytest.raises(openai.BadRequestError, match="only background"):
                await c.responses.cancel("resp_q")
            await c.responses.delete("resp_q")
            requests = [(r.method, r.path) for r in replica.posts[-4:]]
            assert requests == [
                ("GET", "/v1/responses/resp_q?include%5B%5D=message.output_text.logprobs"),
                ("GET", "/v1/responses/resp_q?stream=true"),
                ("POST", "/v1/responses/resp_q/cancel"),
                ("DELETE", "/v1/responses/resp_q"),
            ]
            assert owner(state, "resp_q") is None  # deleted: forgotten
            with pytest.raises(openai.NotFoundError, match="not found"):
                await c.responses.retrieve("resp_q")
            assert all(r.path == "/v1/responses" for r in other.posts)
            odd = "resp q\r\nx"  # decoded by the server: escaped again on the way up
            await state.affinity.record(odd, Owner(replica.replica_id, odd, OPEN_TENANT.name))
            await c.responses.retrieve(odd)
            assert replica.posts[-1].path == "/v1/responses/resp%20q%0D%0Ax"
            async with httpx.AsyncClient() as raw:
                r = await raw.put(url + "/v1/responses/resp_q")
                assert r.status_code == 405 and r.headers["allow"] == "GET, DELETE"
                r = await raw.get(url + "/v1/responses")
                assert r.status_code == 405 and r.json()["error"]["message"]
                r = await raw.get(url + "/v1/responses/a/b/c")
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            assert in_flight(state) == 0
        other.close()
        replica.close()

    run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_closes_the_upstream_connection(stream: bool) -> None:
    gone = asyncio.Event()

    async def start_then_wait(request: Request, r: asyncio.StreamReader, w: Any) -> None:
        if gone.is_set():  # the request after: answered
            w.write(answer(200, json.dumps(response("resp_after")).encode()))
            return
        if stream:  # the head and the first events, then nothing more
            w.write(events_head() + event("response.created", response=response("resp_h")))
            w.write(event("response.output_text.delta", item_id="msg_1", delta="a"))
            await w.drain()
        await r.read()  # returns at EOF: the gateway dropped the connection
        gone.set()
        w.close()

    async def main() -> None:
        replica = await Replica(start_then_wait).start()
        async with running_gateway([replica]) as (url, state):
            c = client(url)
            if stream:  # leaves once the first output arrived
                events = await c.responses.create(model="m", input="x", stream=True)
                async for item in events:
                    if item.type == "response.output_text.delta":
                        break
                assert in_flight(state) == 1
                await events.close()
            else:  # leaves while the replica computes
                request = asyncio.create_task(c.responses.create(model="m", input="x"))
                await wait_until_async(lambda: replica.posts, what="the request upstream")
                assert in_flight(state) == 1
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
            await asyncio.wait_for(gone.wait(), 10)
            await wait_until_async(lambda: in_flight(state) == 0, what="in flight drained")
            left = 'prefixgate_gateway_requests_total{endpoint="responses",replica='
            await wait_until_async(
                lambda: metric(state, left + f'"{replica.replica_id}",status="499"}}') == 1,
                what="the exchange recorded as 499",
            )
            view = state.router.replicas[replica.replica_id]
            assert view.breaker.consecutive_failures == 0  # the client left: no verdict
            assert (await c.responses.create(model="m", input="y")).id == "resp_after"
        replica.close()

    run(main())


def test_the_connection_limit_holds_for_responses_too() -> None:
    """A replica whose connections are all held: a new response waits up to the pool
    timeout, then gets 503 upstream_busy with Retry-After, unsent; so does a pinned turn
    and a GET by id (they may go nowhere else)."""

    async def hang_or_answer(request: Request, r: asyncio.StreamReader, w: Any) -> None:
        if b"hold me" in request.body:
            await r.read()  # holds its connection until the gateway drops it
        else:
            w.write(answer(200, json.dumps(response("resp_l")).encode()))

    async def main() -> None:
        replica = await Replica(hang_or_answer).start()
        settings = {"max_connections_per_replica": 1, "pool_timeout_s": 0.3}
        async with running_gateway([replica], **settings) as (url, state):
            c = client(url)
            assert (await c.responses.create(model="m", input="x")).id == "resp_l"
            held = asyncio.create_task(c.responses.create(model="m", input="hold me"))
            await wait_until_async(lambda: len(replica.posts) == 2, what="a request held")
            for attempt in (
                c.responses.create(model="m", input="y"),
                c.responses.create(model="m", input="z", previous_response_id="resp_l"),
                c.responses.retrieve("resp_l"),
            ):
                with pytest.raises(openai.InternalServerError) as caught:
                    await attempt
                assert caught.value.status_code == 503
                assert caught.value.response.headers["retry-after"] == "1"
                assert caught.value.code == "upstream_busy"
            assert len(replica.posts) == 2  # none of them was sent
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            await wait_until_async(lambda: in_flight(state) == 0, what="in flight drained")
            assert state.router.replicas[replica.replica_id].breaker.consecutive_failures == 0
        replica.close()

    run(main())
