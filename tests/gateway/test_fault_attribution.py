"""Fault attribution through a real gateway (router/health.py): a request that makes every
replica fail, repeated past the breaker threshold, opens no breaker, and the next
ordinary request is served; a replica that fails what another serves is still found out;
a replica that is full (503, 429) is busy, not broken."""

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


@pytest.mark.parametrize("status", [503, 429])
def test_a_full_replica_is_busy_not_broken(tmp_path: Path, status: int) -> None:
    """Its requests go to the other replica, and its breaker stays closed. A 503 opened
    it (a failure whenever another replica then served the request), taking a replica
    that was only full out of service; a 429 went back to the client untried elsewhere."""
    full = start_stub(tmp_path, "full", "--model", "m", "--fail-status", str(status))
    good = start_stub(tmp_path, "good", "--model", "m")
    gw = start_gateway(tmp_path, "gw", [full.url, good.url], *SLOW_PROBES)
    try:
        full_id = full.url.split("//")[1]
        routed_to_full = 0
        for i in range(REPEATS * 3):
            r = _complete(gw, f"prompt {i}")
            assert r.status_code == 200, r.text
            routed_to_full += r.headers["x-prefixgate-route"].endswith("retries=1")
        assert routed_to_full >= REPEATS  # the full one was tried, often
        assert _breakers(gw)[full_id] == "closed"
    finally:
        for server in (gw, full, good):
            server.stop()


@pytest.mark.parametrize("status", [503, 429])
def test_when_every_replica_is_full_the_client_gets_its_retry_after(
    tmp_path: Path, status: int
) -> None:
    full = start_stub(
        tmp_path, "full", "--model", "m", "--fail-status", str(status), "--retry-after", "7"
    )
    gw = start_gateway(tmp_path, "gw", [full.url], *SLOW_PROBES)
    try:
        r = _complete(gw, "any prompt")
        assert r.status_code == status and r.headers["retry-after"] == "7"
        assert r.json()["error"]["message"] == "stub failure"
    finally:
        for server in (gw, full):
            server.stop()
