"""vLLM's engine controls sent through the gateway to every replica (gateway/engine_control.py):
``/sleep``, ``/wake_up``, ``/pause``, ``/resume``, ``/is_sleeping``, ``/is_paused``. Before,
the gateway answered 404: each engine had to be called at its own URL, and the gateway
routed to a sleeping engine until its next probe."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

MODEL = "control-model"
KEYS = {"sk-ops": {"tenant": "ops", "admin": True}, "sk-user": {"tenant": "user"}}
OPS = {"authorization": "Bearer sk-ops"}


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"s{i}", "--model", MODEL, "--pausable") for i in range(2)]
        keys = root / "keys.json"
        keys.write_text(json.dumps(KEYS))
        urls = [s.url for s in self.stubs]
        # A long probe period: what the test sees is the control's own doing, not a probe's.
        self.gateway = start_gateway(
            root, "keyed", urls, "--api-keys", str(keys), "--probe-interval-s", "60"
        )

    def stop(self) -> None:
        self.gateway.stop()
        for stub in self.stubs:
            stub.stop()

    def post(self, path: str, headers: dict[str, str] = OPS) -> httpx.Response:
        return httpx.post(self.gateway.url + path, headers=headers, timeout=30)

    def paused(self) -> list[bool]:
        stats = httpx.get(self.gateway.url + "/router/stats", headers=OPS).json()
        return [
            bool(stats["replicas"][s.url.removeprefix("http://")]["paused"]) for s in self.stubs
        ]

    def blocks(self) -> list[int]:
        """The blocks the gateway believes each replica holds (its own record of where it
        sent prompts, here: the stubs publish no events)."""
        stats = httpx.get(self.gateway.url + "/router/stats", headers=OPS).json()
        return [stats["replicas"][s.url.removeprefix("http://")]["blocks"] for s in self.stubs]

    def chat(self, content: str = "hi") -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        return httpx.post(
            self.gateway.url + "/v1/chat/completions", json=body, headers=OPS, timeout=10
        )


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("engine-control"))
    yield s
    s.stop()


def _seen(stub: Server) -> list[dict[str, str]]:
    requests = httpx.get(stub.url + "/stub/requests", timeout=10).json()
    return [r for r in requests if "query" in r]


def test_sleep_reaches_every_replica_and_takes_them_out_of_routing_at_once(
    servers: Servers,
) -> None:
    assert servers.chat().status_code == 200
    slept = servers.post("/sleep?level=1&mode=wait")
    assert slept.status_code == 200, slept.text
    assert slept.json() == {"status": "sleeping", "level": 1}  # vLLM's answer
    for stub in servers.stubs:
        assert _seen(stub)[-1] == {"path": "/sleep", "query": "level=1&mode=wait"}
    # Out of routing before the answer came back, with no probe since (60 s period).
    assert servers.paused() == [True, True]
    refused = servers.chat()
    assert refused.status_code == 503 and refused.elapsed.total_seconds() < 5
    asleep = httpx.get(servers.gateway.url + "/is_sleeping", headers=OPS, timeout=10)
    assert asleep.json()["is_sleeping"] is True and len(asleep.json()["replicas"]) == 2
    woken = servers.post("/wake_up?tags=weights&tags=kv_cache")
    assert woken.status_code == 200
    for stub in servers.stubs:
        assert _seen(stub)[-1] == {"path": "/wake_up", "query": "tags=weights&tags=kv_cache"}
    assert servers.paused() == [False, False]
    assert servers.chat().status_code == 200
    awake = httpx.get(servers.gateway.url + "/is_sleeping", headers=OPS, timeout=10).json()
    assert awake["is_sleeping"] is False


def test_pause_and_resume_likewise(servers: Servers) -> None:
    assert servers.post("/pause?mode=keep").status_code == 200
    assert servers.paused() == [True, True]
    paused = httpx.get(servers.gateway.url + "/is_paused", headers=OPS, timeout=10).json()
    assert paused["is_paused"] is True
    assert servers.post("/resume").status_code == 200
    assert servers.paused() == [False, False]
    assert servers.chat().status_code == 200


def test_sleep_and_pause_forget_the_caches_the_engines_drop(servers: Servers) -> None:
    """vLLM drops its prefix cache at a sleep of level 1 or 2 and at a pause (unless
    ``mode=keep`` or ``clear_cache=false``), and says so only with its next step."""
    long = " ".join(f"word{i}" for i in range(300))
    cases = [
        ("/sleep?level=0", False),
        ("/pause?mode=keep", False),
        ("/pause?clear_cache=false", False),
        ("/sleep", True),
        ("/sleep?level=2", True),
        ("/pause?mode=wait", True),
    ]
    for control, drops in cases:
        assert servers.chat(long).status_code == 200
        held = servers.blocks()
        assert sum(held) > 0
        assert servers.post(control).status_code == 200
        assert servers.blocks() == ([0, 0] if drops else held), control
        resume = "/wake_up" if control.startswith("/sleep") else "/resume"
        assert servers.post(resume).status_code == 200


def test_only_admin_keys_and_the_right_methods(servers: Servers) -> None:
    refused = servers.post("/sleep", headers={"authorization": "Bearer sk-user"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert servers.post("/sleep", headers={}).status_code == 401
    wrong = httpx.get(servers.gateway.url + "/sleep", headers=OPS, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert servers.paused() == [False, False]  # none of these reached a replica


def test_a_replica_without_the_endpoint_is_named(tmp_path: Path) -> None:
    """An engine outside development mode answers 404: the gateway says which."""
    pausable = start_stub(tmp_path, "pausable", "--model", MODEL, "--pausable")
    plain = start_stub(tmp_path, "plain", "--model", MODEL)
    gateway = start_gateway(tmp_path, "open", [pausable.url, plain.url])
    try:
        answer = httpx.post(gateway.url + "/sleep", timeout=30)
        assert answer.status_code == 404
        body = answer.json()
        assert body["error"]["code"] == "engine_control_failed"
        assert {r["status"] for r in body["replicas"].values()} == {200, 404}
        assert httpx.post(gateway.url + "/wake_up", timeout=30).status_code == 404
    finally:
        gateway.stop()
        plain.stop()
        pausable.stop()
