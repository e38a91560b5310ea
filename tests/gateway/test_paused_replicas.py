"""A paused or sleeping vLLM gets no requests (gateway/probes.py, ``paused_once``).

vLLM's ``/pause`` and ``/sleep`` (its development mode: reinforcement learning between
weight updates, a GPU lent to another model) leave it answering ``/health`` and taking
requests, which then wait until ``/resume`` or ``/wake_up``: the gateway routed to it,
and those requests waited the upstream timeout while other replicas idled. The stub
behaves so with ``--pausable``; one without it has no ``/is_paused``, as an engine
without development mode, and is never taken for paused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

MODEL = "pause-model"


class Servers:
    def __init__(self, root: Path) -> None:
        self.pausable = start_stub(root, "pausable", "--model", MODEL, "--pausable")
        self.plain = start_stub(root, "plain", "--model", MODEL)
        urls = [self.pausable.url, self.plain.url]
        self.gateway = start_gateway(root, "gateway", urls, "--probe-interval-s", "0.2")

    def stop(self) -> None:
        for server in (self.gateway, self.pausable, self.plain):
            server.stop()

    def paused(self, stub: Server) -> bool:
        stats = httpx.get(self.gateway.url + "/router/stats").json()
        return bool(stats["replicas"][stub.url.removeprefix("http://")]["paused"])

    def wait_paused(self, stub: Server, paused: bool) -> None:
        deadline = time.monotonic() + 10
        while self.paused(stub) != paused:
            assert time.monotonic() < deadline, f"the gateway never saw paused={paused}"
            time.sleep(0.05)  # polling the gateway's view


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("paused"))
    yield s
    s.stop()


def _chat(gateway: Server, n: int) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"question {n}"}],
        "prompt_cache_key": f"conversation-{n}",  # spread over the ring
    }
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)


def test_a_paused_replica_gets_no_requests_until_it_resumes(servers: Servers) -> None:
    assert not servers.paused(servers.pausable) and not servers.paused(servers.plain)
    httpx.post(servers.pausable.url + "/pause").raise_for_status()
    servers.wait_paused(servers.pausable, True)
    plain = servers.plain.url.removeprefix("http://")
    for n in range(12):
        r = _chat(servers.gateway, n)  # one routed to the paused stub would time out
        assert r.status_code == 200 and r.headers["x-prefixgate-replica"] == plain
    assert httpx.get(servers.gateway.url + "/ready").status_code == 200
    httpx.post(servers.pausable.url + "/resume").raise_for_status()
    servers.wait_paused(servers.pausable, False)
    where = {_chat(servers.gateway, n).headers["x-prefixgate-replica"] for n in range(12)}
    assert servers.pausable.url.removeprefix("http://") in where


def test_with_every_replica_paused_a_request_is_refused_not_held(
    servers: Servers, tmp_path: Path
) -> None:
    lone = start_gateway(tmp_path, "lone", [servers.pausable.url], "--probe-interval-s", "0.2")
    try:
        httpx.post(servers.pausable.url + "/pause").raise_for_status()
        deadline = time.monotonic() + 10
        while httpx.get(lone.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "the gateway never saw its replica paused"
            time.sleep(0.05)  # polling the gateway's readiness
        r = _chat(lone, 0)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
    finally:
        httpx.post(servers.pausable.url + "/resume").raise_for_status()
        lone.stop()
