"""Fault attribution through a real gateway (router/health.py): a request that makes every
replica fail, repeated past the breaker threshold, opens no breaker, and the next
ordinary request is served; a replica that fails what another serves is still found out."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

POISON = "poison-pill"
REPEATS = 10  # the breaker opens after 3 consecutive failures (router/config.py)
# Probes close an open breaker on their next success: far apart, they cannot hide one.
SLOW_PROBES = ("--probe-interval-s", "600")


def _complete(gw: Server, prompt: str) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    return httpx.post(gw.url + "/v1/completions", json=body, timeout=30)


def _breakers(gw: Server) -> dict[str, str]:
    stats = httpx.get(gw.url + "/router/stats").json()["replicas"]
    return {rid: view["breaker"] for rid, view in stats.items()}


@pytest.mark.parametrize("replicas", [2, 1])
def test_a_poison_request_opens_no_breaker(tmp_path: Path, replicas: int) -> None:
    stubs = [
        start_stub(tmp_path, f"stub-{i}", "--model", "m", "--fail-on", POISON)
        for i in range(replicas)
    ]
    gw = start_gateway(tmp_path, "gw", [s.url for s in stubs], *SLOW_PROBES)
    try:
        for _ in range(REPEATS):
            r = _complete(gw, f"please {POISON} me")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert set(_breakers(gw).values()) == {"closed"}
        assert _complete(gw, "an ordinary prompt").status_code == 200
    finally:
        for server in (gw, *stubs):
            server.stop()


def test_a_replica_failing_what_another_serves_is_opened(tmp_path: Path) -> None:
    bad = start_stub(tmp_path, "bad", "--model", "m", "--fail-status", "500")
    good = start_stub(tmp_path, "good", "--model", "m")
    gw = start_gateway(tmp_path, "gw", [bad.url, good.url], *SLOW_PROBES)
    try:
        bad_id, good_id = bad.url.split("//")[1], good.url.split("//")[1]
        for i in range(50):  # the bad one's 5xx are retried on the good one
            assert _complete(gw, f"prompt {i}").status_code == 200
            if _breakers(gw)[bad_id] == "open":
                break
        breakers = _breakers(gw)
        assert breakers[bad_id] == "open" and breakers[good_id] == "closed", breakers
    finally:
        for server in (gw, bad, good):
            server.stop()
