"""vLLM's ``kv_cache_report_mode`` never reaches an engine through the gateway.

A request whose ``vllm_xargs`` (the token API's ``sampling_params.extra_args``) says
``"kv_cache_report_mode": "full"`` makes vLLM 0.32 announce again, as stores, the cached
blocks it reuses. No removal follows those, and the bridge cannot tell them from a second
copy of a block, so their keys stayed published after the engine evicted the blocks
(docs/BENCHMARKS.md, "vLLM's full event reports"). The gateway drops the field and
passes the rest of the engine's arguments as sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import StubCluster, stub_cluster

pytestmark = pytest.mark.timeout(120)

MODEL = "report-model"
XARGS = {"kv_cache_report_mode": "full", "kept": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {**CHAT, "vllm_xargs": XARGS}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "vllm_xargs": XARGS}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "vllm_xargs": XARGS}),
    ("/v1/chat/completions/batch", {**CHAT, "messages": [CHAT["messages"]], "vllm_xargs": XARGS}),
    ("/v1/messages", {**CHAT, "vllm_xargs": XARGS}),  # vLLM 0.32's Messages API takes them
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path_factory.mktemp("report-mode"), MODEL, engines=1) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_the_full_report_mode_is_dropped_and_the_other_arguments_pass(
    cluster: StubCluster, path: str, body: dict[str, Any]
) -> None:
    before = len(cluster.received(path))
    r = httpx.post(cluster.gateway.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    seen = cluster.received(path)[before:]
    assert seen, "the stub got nothing"
    assert seen[-1]["body"]["vllm_xargs"] == {"kept": 1}


def test_other_engine_arguments_pass_as_sent(cluster: StubCluster) -> None:
    raw = b'{"model": "report-model",  "max_tokens": 2, "prompt": "hi", "vllm_xargs": {"x": 2}}'
    before = len(cluster.received("/v1/completions"))
    r = httpx.post(
        cluster.gateway.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert cluster.received("/v1/completions")[before:][-1]["body"]["vllm_xargs"] == {"x": 2}


def test_the_token_apis_extra_args_lose_it_too() -> None:
    from gateway.handler import without_report_mode

    body = {"token_ids": [1], "sampling_params": {"extra_args": {"kv_cache_report_mode": "full"}}}
    assert without_report_mode(body) and body["sampling_params"] == {"extra_args": {}}
    assert not without_report_mode({"vllm_xargs": "full", "sampling_params": [1]})
