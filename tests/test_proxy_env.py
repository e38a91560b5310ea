"""The environment's HTTP proxy is not used to reach this machine's own processes.

Corporate machines set HTTP_PROXY (and http_proxy) for every process. A proxy cannot
reach 127.0.0.1, so `prefixgate up` waited its whole ready timeout for servers that were
up, and `prefixgate chat` said no gateway answered. Each check runs in a process started
with the proxy set, as a user's would be (urllib reads the environment once per process);
every `prefixgate` command puts the loopback names in NO_PROXY (prefixgate/cli.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixgate.cli import bypass_proxy_for_loopback
from tests.gateway.conftest import Server, start_stub

pytestmark = pytest.mark.timeout(120)

DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens: every proxied request is refused


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_stub(tmp_path_factory.mktemp("proxy"), "stub")
    yield server
    server.stop()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HTTP_PROXY": DEAD_PROXY, "http_proxy": DEAD_PROXY}
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    cwd = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_health_polls_go_straight_to_the_server(stub: Server) -> None:
    code = f"from prefixgate.procs import wait_http_ok; wait_http_ok('{stub.url}/health', 10)"
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr[-2000:]


def test_prefixgate_chat_reaches_a_gateway_on_this_machine(stub: Server) -> None:
    done = _run("-m", "prefixgate", "chat", "hello", "--base-url", stub.url + "/v1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tok0" in done.stdout


def test_loopback_joins_no_proxy_only_when_a_proxy_is_set() -> None:
    quiet: dict[str, str] = {}
    bypass_proxy_for_loopback(quiet)
    assert quiet == {}  # no proxy: nothing to bypass, nothing written
    env = {"https_proxy": DEAD_PROXY, "NO_PROXY": "corp.example, localhost"}
    bypass_proxy_for_loopback(env)
    assert env["NO_PROXY"] == "corp.example,localhost,127.0.0.1"
    assert env["no_proxy"] == "127.0.0.1,localhost"
