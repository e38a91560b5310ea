"""SageMaker's container contract at the gateway (gateway/sagemaker.py): ``/ping`` and
``/invocations`` as vLLM serves them, its stateful sessions kept by the gateway and
routed as conversations. Both paths were the gateway's 404s, so a SageMaker endpoint
built on it never passed its health check."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sagemaker_sessions import Sessions, session_seconds_from_env
from prefixgate.wire import OpenAIError
from router.conversation import conversation_key
from tests.gateway.conftest import Server, start_gateway, start_replica, start_stub

pytestmark = pytest.mark.timeout(180)

MODEL = "sm-model"
SESSIONS_ON = {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"}
SESSION = "X-Amzn-SageMaker-Session-Id"


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"stub-{i}", "--model", MODEL) for i in range(2)]
        urls = [s.url for s in self.stubs]
        self.sessions = start_gateway(root, "sessions", urls, env=SESSIONS_ON)
        self.plain = start_gateway(root, "plain", urls)

    def stop(self) -> None:
        for server in (self.sessions, self.plain, *self.stubs):
            server.stop()

    def received(self, path: str) -> list[dict[str, Any]]:
        seen = [httpx.get(s.url + "/stub/requests").json() for s in self.stubs]
        return [r for requests in seen for r in requests if r.get("path") == path]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("sagemaker"))
    yield s
    s.stop()


def _invoke(gateway: Server, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(gateway.url + "/invocations", json=body, headers=headers, timeout=30)


def _error(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]  # type: ignore[no-any-return]


def test_ping_is_ready_once_a_replica_is_healthy(servers: Servers, tmp_path: Path) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, servers.plain.url + "/ping")
        assert (r.status_code, r.content) == (200, b"")
    assert httpx.put(servers.plain.url + "/ping").status_code == 405
    # A gateway whose one replica never answers: SageMaker must not send it traffic.
    lonely = start_gateway(tmp_path, "lonely", ["http://127.0.0.1:9"], ready=False)
    try:
        assert httpx.get(lonely.url + "/ping").status_code == 503
    finally:
        lonely.stop()


def test_each_body_is_served_as_the_endpoint_vllm_would_pick(servers: Servers) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _invoke(servers.plain, chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    # vLLM's /invocations ignores the body's model: the one model the replicas serve
    assert servers.received("/v1/chat/completions")[-1]["body"] == {**chat, "model": MODEL}
    r = _invoke(servers.plain, {"model": "whatever", "prompt": "once", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert servers.received("/v1/completions")[-1]["body"]["model"] == MODEL
    # Anything else (a pooling model's body) is the replica's own /invocations to tell.
    r = _invoke(servers.plain, {"input": ["embed me"]})
    assert r.json() == {"path": "/invocations", "object": "stub"}
    assert servers.received("/invocations")[-1]["body"] == {"input": ["embed me"], "model": MODEL}
    streamed = httpx.post(
        servers.plain.url + "/invocations", json={**chat, "stream": True}, timeout=30
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_the_adapter_header_names_the_model(servers: Servers) -> None:
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": MODEL}
    r = _invoke(servers.plain, {"model": "ignored", "prompt": "x"}, headers)
    assert r.status_code == 200
    r = _invoke(servers.plain, {"prompt": "x"}, {"X-Amzn-SageMaker-Adapter-Identifier": "nope"})
    assert r.status_code == 404 and _error(r)["code"] == "model_not_found"


def test_bad_bodies_get_clear_4xx(servers: Servers) -> None:
    url = servers.sessions.url + "/invocations"
    assert httpx.get(url).status_code == 405
    r = httpx.post(url, content=b"{not json")
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"
    assert httpx.post(url, json=[1, 2]).status_code == 400
    r = httpx.post(url, content=b"x" * (17 << 20))
    assert r.status_code == 413
    for body in ({"requestType": "OTHER"}, {"requestType": "NEW_SESSION", "prompt": "x"}):
        r = _invoke(servers.sessions, body)
        assert r.status_code == 400 and _error(r)["param"] == "requestType"
    r = _invoke(servers.sessions, {"messages": "not a list"})
    assert r.status_code == 400
    assert httpx.get(servers.sessions.url + "/ping").status_code == 200  # still serving


def test_sessions_open_serve_and_close_as_vllms_do(servers: Servers) -> None:
    r = _invoke(servers.sessions, {"requestType": "NEW_SESSION"})
    assert r.status_code == 200
    session, expires = r.headers["x-amzn-sagemaker-new-session-id"].split("; Expires=")
    assert r.text == f"Session {session} created" and expires.endswith("Z")
    for _ in range(2):
        r = _invoke(servers.sessions, {"prompt": "again", "max_tokens": 2}, {SESSION: session})
        assert r.status_code == 200
    sent = servers.received("/v1/completions")[-1]["headers"]
    assert SESSION.lower() not in sent  # a replica's own session check would refuse it
    r = _invoke(servers.sessions, {"requestType": "CLOSE"}, {SESSION: session})
    assert r.status_code == 200 and r.headers["x-amzn-sagemaker-closed-session-id"] == session
    r = _invoke(servers.sessions, {"prompt": "late"}, {SESSION: session})
    assert r.status_code == 400
    assert _error(r)["message"] == f"Bad request: session not found: {session}"
    r = _invoke(servers.sessions, {"requestType": "CLOSE"})
    assert r.status_code == 424


def test_sessions_off_refuse_session_requests_and_headers(servers: Servers) -> None:
    r = _invoke(servers.plain, {"requestType": "NEW_SESSION"})
    assert r.status_code == 400 and "stateful sessions not enabled" in _error(r)["message"]
    r = _invoke(servers.plain, {"prompt": "x"}, {SESSION: "abc"})
    assert r.status_code == 400 and "header not supported" in _error(r)["message"]


def test_the_session_header_is_a_conversation_key() -> None:
    assert conversation_key({}, {SESSION.lower(): "s-1"}) == "s-1"
    assert conversation_key({"prompt_cache_key": "k"}, {SESSION.lower(): "s-1"}) == "k"


def test_sessions_expire_and_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    sessions = Sessions(60, clock=lambda: now[0])
    first, expires = sessions.open()
    assert expires == 1060.0
    sessions.check(first)
    now[0] = 1061.0
    sessions.check(first)  # served once past its time, as vLLM does, and dropped
    with pytest.raises(OpenAIError, match="session not found"):
        sessions.check(first)
    monkeypatch.setattr("gateway.sagemaker_sessions.MAX_SESSIONS", 3)
    made = [sessions.open()[0] for _ in range(3)]
    with pytest.raises(OpenAIError) as refused:
        sessions.open()
    assert refused.value.status == 429
    sessions.close(made[0])
    sessions.open()
    now[0] += 61  # all expired: the next one makes room
    sessions.open()
    assert len(sessions) == 1


def test_session_settings_come_from_vllms_variables() -> None:
    assert session_seconds_from_env({}) is None
    assert session_seconds_from_env({"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "false"}) is None
    assert session_seconds_from_env(SESSIONS_ON) == 1200
    on = {**SESSIONS_ON, "SAGEMAKER_SESSIONS_EXPIRATION": "30"}
    assert session_seconds_from_env(on) == 30
    for bad in (
        {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "maybe"},
        {**on, "SAGEMAKER_SESSIONS_EXPIRATION": "0"},
    ):
        with pytest.raises(ValueError, match="SAGEMAKER_"):
            session_seconds_from_env(bad)


def test_a_sessions_turns_read_their_cache_on_real_replicas(tmp_path: Path) -> None:
    replicas = [start_replica(tmp_path, f"replica-{i}") for i in range(2)]
    gateway = start_gateway(tmp_path, "gateway", [r.url for r in replicas], env=SESSIONS_ON)
    try:
        placed: dict[str, set[str]] = {}
        for n in range(3):
            r = _invoke(gateway, {"requestType": "NEW_SESSION"})
            session = r.headers["x-amzn-sagemaker-new-session-id"].split(";")[0]
            messages = [{"role": "system", "content": f"Session {n}. " + "Be brief. " * 40}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"question {turn}"})
                body = {"messages": messages, "max_tokens": 4, "temperature": 0}
                r = _invoke(gateway, body, {SESSION: session})
                assert r.status_code == 200, r.text
                placed.setdefault(session, set()).add(r.headers["x-prefixgate-replica"])
                if turn:
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                messages.append(r.json()["choices"][0]["message"])
        assert all(len(where) == 1 for where in placed.values()), placed
    finally:
        gateway.stop()
        for replica in replicas:
            replica.stop()


def test_the_gateway_refuses_to_start_on_a_bad_session_setting() -> None:
    env = {**os.environ, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "maybe"}
    done = subprocess.run(
        [sys.executable, "-m", "prefixgate", "gateway", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in done.stdout
