"""Honest readiness: a replica is unknown until its first /health probe succeeds, and an
unknown replica is neither routed to, nor listed, nor counted by /ready."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from prefixgate.procs import free_port
from tests.conftest import wait_until
from tests.gateway.conftest import start, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)
STUB = ["-m", "tests.support.stub_backend"]


def test_ready_only_after_the_first_successful_probe(tmp_path: Path) -> None:
    """A replica still loading (nothing listens on its port yet) makes /ready 503 from
    the gateway's first moment; once it answers /health, /ready turns 200."""
    up = start_stub(tmp_path, "up", "--model", "m")
    port = free_port()
    loading = f"http://127.0.0.1:{port}"
    gw = start_gateway(tmp_path, "gw", [up.url, loading], "--model", "m", ready=False)
    late = None
    try:
        ready = httpx.get(gw.url + "/ready?min_replicas=2")
        assert ready.status_code == 503, ready.text
        assert ready.json() == {"ready": False, "healthy_replicas": [up.url.split("//")[1]]}
        stats = httpx.get(gw.url + "/router/stats").json()["replicas"]
        assert stats[f"127.0.0.1:{port}"]["breaker"] == "unknown"
        assert not stats[f"127.0.0.1:{port}"]["healthy"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):  # never sent to the replica that has not answered
            client.completions.create(model="m", prompt=f"p{i}", max_tokens=2)
        assert "ConnectError" not in httpx.get(gw.url + "/metrics").text

        late = start([*STUB, "--port", str(port), "--model", "m"], port, tmp_path, "late")
        wait_until(
            lambda: httpx.get(gw.url + "/ready?min_replicas=2").status_code == 200,
            timeout_s=20,
            what="/ready?min_replicas=2 after the second replica answered",
        )
    finally:
        for server in (gw, up, late):
            if server is not None:
                server.stop()


def test_a_replica_answering_503_is_not_ready(tmp_path: Path) -> None:
    """Listening is not enough: a /health that answers 503 (engine not alive) keeps the
    replica unknown, and a model served only there is not listed."""
    port = free_port()
    flags = ["--port", str(port), "--model", "sick-llm", "--health-status", "503"]
    sick = start([*STUB, *flags], port, tmp_path, "sick", health="/v1/models")
    gw = start_gateway(tmp_path, "gw", [sick.url], ready=False)
    try:
        assert httpx.get(gw.url + "/ready").status_code == 503
        assert httpx.get(gw.url + "/v1/models").json()["data"] == []
    finally:
        gw.stop()
        sick.stop()
