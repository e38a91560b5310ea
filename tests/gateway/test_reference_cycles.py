"""Requests leave no reference cycles in the gateway.

The gateway keeps the garbage collector's young generation large and its start-up heap
frozen (prefixgate/gc_heap.py), which makes collections rare: garbage that only a
collection can free (objects in a reference cycle) then waits longer, with whatever it
holds (a request's body, an answer). So every way a request goes, served, refused,
failed by its replica, broken off or left by its client, must free what it made by
reference counting alone. A request's DisconnectWatch once left about 30 objects in a cycle.

The gateway runs in this process under a real uvicorn (tests/gateway/loopback.py), with
the collector off while the requests run; a collection afterwards with ``DEBUG_SAVEALL``
lists what it found, and none of it may come from the gateway's code or its server's.
"""

from __future__ import annotations

import asyncio
import gc
import json
import types
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until_async
from tests.gateway.loopback import Replica, Request, answer, answer_ok, running_gateway, sse
from tests.gateway.test_proxy import ERROR, in_flight

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(ROOT / d) for d in ("gateway", "router", "prefixgate"))
SERVER_MODULES = ("gateway.", "router.", "prefixgate.", "uvicorn.", "starlette.")


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 40))


def from_the_gateway(obj: object) -> bool:
    """Whether a piece of garbage was made by the gateway or its server: an instance of
    their classes, or a frame or coroutine of their code."""
    if isinstance(obj, types.FrameType):
        return obj.f_code.co_filename.startswith(OURS)
    if isinstance(obj, types.CoroutineType):
        return obj.cr_code.co_filename.startswith(OURS)
    return type(obj).__module__.startswith(SERVER_MODULES)


async def scripted(request: Request, reader: asyncio.StreamReader, w: Any) -> None:
    """By the prompt: fail with a 500, refuse with a 400, break a stream off, start a
    stream or an answer and wait for the gateway to leave, or answer."""
    body = json.loads(request.body)
    prompt = body.get("prompt", "")
    if prompt == "fail":
        w.write(answer(500, json.dumps(ERROR).encode()))
    elif prompt == "refuse":
        w.write(answer(400, json.dumps({"error": {"message": "no", "type": "x"}}).encode()))
    elif prompt == "break":
        w.write(sse('{"choices":[{"text":"a"}]}', done=False))
        await w.drain()
        w.close()
    elif prompt == "leave":
        if body.get("stream"):
            w.write(sse('{"choices":[{"text":"a"}]}', done=False))
            await w.drain()
        await reader.read()  # until the gateway drops the connection
        w.close()
    elif body.get("stream"):
        w.write(sse('{"choices":[{"text":"a"}]}'))
    else:
        await answer_ok(request, reader, w)


async def every_way(client: httpx.AsyncClient, url: str, replica: Replica) -> None:
    """One request of each kind, each checked to have gone that way (the replica's
    answers are a completion's: the other APIs' paths read them all the same)."""
    completions = url + "/v1/completions"
    r = await client.post(completions, json={"model": "m", "prompt": "whole"})
    assert r.status_code == 200
    r = await client.post(completions, json={"model": "m", "prompt": "s", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    r = await client.post(completions, content=b"{not json")
    assert r.status_code == 400
    r = await client.post(completions, json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    r = await client.post(completions, json={"model": "m", "prompt": "refuse"})
    assert r.status_code == 400
    r = await client.post(completions, json={"model": "m", "prompt": "fail"})
    assert r.status_code == 500  # the replica's own error
    body = {"model": "m", "prompt": "break", "stream": True}
    r = await client.post(completions, json=body)
    assert '"upstream_error"' in r.text
    body = {"model": "m", "prompt": "leave", "stream": True}
    async with client.stream("POST", completions, json=body) as streamed:
        assert b"data:" in await anext(streamed.aiter_raw())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    apis: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", chat),
        ("/v1/responses", {"model": "m", "input": "hi"}),
        ("/v1/messages", chat),
    ]
    for path, request in apis:
        for stream in (False, True):
            r = await client.post(url + path, json={**request, "stream": stream})
            assert r.status_code == 200, (path, r.text)
    r = await client.post(url + "/tokenize", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200
    posts = len(replica.posts)
    leaving = asyncio.create_task(client.post(completions, json={"model": "m", "prompt": "leave"}))
    await wait_until_async(lambda: len(replica.posts) > posts, what="the request upstream")
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)


def test_no_way_a_request_goes_leaves_a_reference_cycle() -> None:
    async def main() -> None:
        replica = await Replica(scripted).start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            await every_way(client, url, replica)  # first requests fill caches and pools
            await wait_until_async(lambda: in_flight(state) == 0, what="in flight drained")
            gc.collect()
            gc.disable()
            try:
                for _ in range(3):
                    await every_way(client, url, replica)
                await wait_until_async(lambda: in_flight(state) == 0, what="in flight drained")
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                found = Counter(type(o).__name__ for o in gc.garbage if from_the_gateway(o))
                frames = Counter(
                    f"{o.f_code.co_filename.rsplit('/', 1)[1]}:{o.f_code.co_name}"
                    for o in gc.garbage
                    if isinstance(o, types.FrameType) and from_the_gateway(o)
                )
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert not found, (found.most_common(12), frames.most_common(12))
        replica.close()

    run(main())
