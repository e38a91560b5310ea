"""The hot-path handler (gateway/handler.py) through the real app under uvicorn: what it
refuses before any replica is asked, the request id, the bytes it forwards, and a client
that leaves before its body arrived."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until_async
from tests.gateway.loopback import Replica, running_gateway

pytestmark = pytest.mark.timeout(60)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    return dict(body["error"])


def test_refusals_are_openai_errors_and_reach_no_replica() -> None:
    async def main() -> None:
        replica = await Replica().start()
        limit = {"max_body_bytes": 1000}
        async with (
            running_gateway([replica], **limit) as (url, _),
            httpx.AsyncClient(base_url=url) as client,
        ):
            r = await client.get("/v1/chat/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            assert "Method Not Allowed" in error_of(r)["message"]
            r = await client.post("/v1/completions", content=b"{not json")
            assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
            r = await client.post("/v1/completions", json={"prompt": "no model"})
            assert r.status_code == 400 and error_of(r)["param"] == "model"
            r = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
            assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
            big = {"model": "m", "prompt": "x" * 2000}
            r = await client.post("/v1/completions", json=big)
            assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

            async def chunks() -> Any:  # no Content-Length: counted as it arrives
                for _ in range(3):
                    yield b" " * 600

            r = await client.post("/v1/completions", content=chunks())
            assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
            assert replica.posts == []
        replica.close()

    run(main())


def test_the_request_id_is_echoed_and_forwarded_and_the_body_passes_as_sent() -> None:
    async def main() -> None:
        replica = await Replica().start()
        async with running_gateway([replica]) as (url, _), httpx.AsyncClient() as client:
            sent = b'{"model": "m",  "prompt": "as typed", "cache_salt": "mine", "x": [1]}'
            r = await client.post(
                url + "/v1/completions",
                content=sent,
                headers={"x-request-id": "req-7", "content-type": "application/json"},
            )
            assert r.status_code == 200 and r.headers["x-request-id"] == "req-7"
            seen = replica.posts[-1]
            assert seen.body == sent  # open mode, the client's salt: not re-serialized
            assert seen.headers["x-request-id"] == "req-7"
            r = await client.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
            generated = r.headers["x-request-id"]
            assert len(generated) == 32 and int(generated, 16) >= 0
            assert replica.posts[-1].headers["x-request-id"] == generated
        replica.close()

    run(main())


def test_a_client_leaving_before_its_body_arrived_is_recorded_and_serving_goes_on() -> None:
    async def main() -> None:
        replica = await Replica().start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            host, port = url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"model": "m", '
            )
            await writer.drain()
            writer.close()  # 15 of the 100 bytes sent
            await writer.wait_closed()

            def left() -> bool:
                text = state.metrics.render().decode()
                return 'endpoint="completions",replica="none",status="499"} 1.0' in text

            await wait_until_async(left, what="the request recorded as 499")
            assert replica.posts == []
            r = await client.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200 and json.loads(r.content)["choices"]
        replica.close()

    run(main())
