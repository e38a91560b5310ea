"""Request headers vLLM reads reach it through the gateway, on every path it forwards.

vLLM 0.32 reads W3C trace context (``traceparent``, ``tracestate``: with
``--otlp-traces-endpoint`` its spans join the caller's trace), ``X-Vllm-Priority`` (a
request's priority under ``--scheduling-policy priority``) and ``X-Session-ID`` (the
session its cache events name). The gateway sent only its own three headers, so through
it every engine trace began a trace of its own, every request ran at the default
priority, and no block event named a session. vLLM's ``session_id`` (body field or
``X-Session-ID``) is also a conversation key here, as ``prompt_cache_key`` is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import StubCluster, stub_cluster

pytestmark = pytest.mark.timeout(120)

MODEL = "passed-model"
SENT = {
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "vendor=abc",
    "x-vllm-priority": "-5",
    "x-session-id": "agent-run-7",
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
    ("/v1/messages", {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 2}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "store": False}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path_factory.mktemp("passed-headers"), MODEL, engines=1) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_the_headers_vllm_reads_reach_it(
    cluster: StubCluster, path: str, body: dict[str, Any]
) -> None:
    before = len(cluster.received(path))
    headers = {**SENT, "x-unrelated": "not passed", "cookie": "secret=1"}
    r = httpx.post(cluster.gateway.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    seen = cluster.received(path)[before:]
    assert seen, "the stub got nothing"
    got = seen[-1]["headers"]
    assert {name: got.get(name) for name in SENT} == SENT
    assert "x-unrelated" not in got and "cookie" not in got  # only what engines read


def test_without_them_none_is_made_up(cluster: StubCluster) -> None:
    before = len(cluster.received("/v1/chat/completions"))
    r = httpx.post(cluster.gateway.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200
    got = cluster.received("/v1/chat/completions")[before:][-1]["headers"]
    assert not set(SENT) & set(got)


def test_vllms_session_id_is_a_conversation_key() -> None:
    from router.conversation import conversation_key

    assert conversation_key({"session_id": "s1"}, {}) == "s1"
    assert conversation_key({}, {"X-Session-ID": "s2"}) == "s2"
    assert conversation_key({"session_id": "s1", "user": "u"}, {}) == "s1"
    assert conversation_key({"prompt_cache_key": "k", "session_id": "s1"}, {}) == "k"
    assert conversation_key({"session_id": 7, "user": "u"}, {}) == "u"  # not a string: no key
