"""Bad input, overload and shutdown against a real replica: OpenAI envelopes and codes.

The module's replica runs with one running slot and one waiting slot, so the overload test
can fill the queue deterministically. The SIGTERM test ends the process, so it stays last.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from prefixgate.procs import stop_process
from prefixgate.wire import is_error_body
from replica.metrics import ReplicaMetrics
from replica.server import create_app
from replica.state import Replica
from router.protocol import ReplicaLoad
from tests.conftest import wait_until
from tests.replica.conftest import MODEL, ReplicaProcess, start_replica


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    rep = start_replica(
        tmp_path_factory.mktemp("replica-errors"),
        "--max-running",
        "1",
        "--max-waiting",
        "1",
        "--grace-s",
        "20",
    )
    yield rep
    stop_process(rep.proc)


def _post(replica: ReplicaProcess, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(replica.url + path, timeout=30, **kwargs)


def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert is_error_body(body), body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code, body
    assert resp.headers.get("x-request-id")
    error: dict[str, Any] = body["error"]
    return error


def _chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    body.update(overrides)
    return body


def test_malformed_json(replica: ReplicaProcess) -> None:
    resp = _post(
        replica,
        "/v1/chat/completions",
        content=b'{"model": "tiny-random", "messages": [',
        headers={"content-type": "application/json"},
    )
    _error(resp, 400, "invalid_json")
    _error(_post(replica, "/v1/completions", json=[1, 2, 3]), 400, "invalid_json")


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"messages": "hello"}, "messages"),
        ({"max_tokens": "four"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
    ],
)
def test_invalid_fields(replica: ReplicaProcess, overrides: dict[str, Any], param: str) -> None:
    error = _error(_post(replica, "/v1/chat/completions", json=_chat_body(**overrides)), 400)
    assert error["param"] is not None and error["param"].startswith(param)
    assert error["type"] == "invalid_request_error"


def test_unknown_model_is_404_model_not_found(replica: ReplicaProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        replica.client().chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.code == "model_not_found"
    assert "tiny-random" in info.value.message


def test_prompt_over_context_length(replica: ReplicaProcess) -> None:
    max_len = replica.client().models.list().data[0].model_extra["max_model_len"]  # type: ignore[index]
    too_long = [100] * max_len
    with pytest.raises(openai.BadRequestError) as info:
        replica.client().completions.create(model=MODEL, prompt=too_long, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert str(max_len) in info.value.message
    # The prompt fits but prompt + max_tokens does not.
    with pytest.raises(openai.BadRequestError) as info:
        replica.client().completions.create(model=MODEL, prompt=[100] * 10, max_tokens=max_len)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "max_tokens"


def test_token_ids_outside_vocabulary(replica: ReplicaProcess) -> None:
    resp = _post(replica, "/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]})
    assert "vocabulary" in _error(resp, 400, "invalid_value")["message"]


def test_unknown_route_is_an_openai_envelope(replica: ReplicaProcess) -> None:
    _error(_post(replica, "/v1/embeddings", json={}), 404)


def _long_stream(replica: ReplicaProcess, started: threading.Event, stop: threading.Event) -> None:
    body = {
        "model": MODEL,
        "prompt": list(range(500, 540)),
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", replica.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_lines():
            started.set()
            if stop.is_set():
                return  # closing the connection cancels the request


def test_full_waiting_queue_is_503_with_retry_after(replica: ReplicaProcess) -> None:
    stop = threading.Event()
    first_started, second_started = threading.Event(), threading.Event()
    running = threading.Thread(target=_long_stream, args=(replica, first_started, stop))
    running.start()
    try:
        assert first_started.wait(30)
        # The only running slot is taken; the next request waits in the only waiting slot.
        waiting = threading.Thread(target=_long_stream, args=(replica, second_started, stop))
        waiting.start()
        wait_until(
            lambda: replica.metric("prefixgate:num_requests_waiting") == 1,
            timeout_s=15,
            what="one waiting",
        )
        resp = _post(replica, "/v1/chat/completions", json=_chat_body())
        _error(resp, 503, "queue_full")
        assert resp.headers["retry-after"] == "1"
        with pytest.raises(openai.APIStatusError) as info:
            replica.client().chat.completions.create(**_chat_body())
        assert info.value.status_code == 503
    finally:
        stop.set()
        running.join(30)
        # The waiting request starts once the first leaves, then sees `stop` and leaves.
        waiting.join(60)
    wait_until(
        lambda: replica.cache_stats()["pinned_blocks"] == 0, timeout_s=15, what="no pinned blocks"
    )


def test_sigterm_finishes_in_flight_request_and_exits_zero(replica: ReplicaProcess) -> None:
    body = {"model": MODEL, "prompt": list(range(700, 740)), "max_tokens": 100, "stream": True}
    body["ignore_eos"] = True
    events: list[str] = []
    with httpx.stream("POST", replica.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        replica.proc.send_signal(signal.SIGTERM)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", "the in-flight stream finished during the grace period"
    assert replica.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(replica.url + "/health", timeout=2)


def test_health_is_503_when_the_engine_loop_is_not_alive() -> None:
    """A dead engine thread cannot be produced from outside a real process, so this one
    check uses a stand-in engine; everything else in this file runs a real replica."""

    class DeadEngine:
        alive = False

        def load(self) -> ReplicaLoad:
            return ReplicaLoad()

    loaded = SimpleNamespace(name=MODEL, max_context=2048)
    metrics = ReplicaMetrics(load=ReplicaLoad)
    app = create_app(Replica(loaded, DeadEngine(), MODEL, metrics))

    async def probe() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.get("/health")

    resp = asyncio.run(probe())
    assert resp.status_code == 503
    assert resp.headers["x-request-id"]
