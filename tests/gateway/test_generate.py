"""SGLang's native ``POST /generate`` through the gateway (gateway/generate.py): samples of
one prompt, sent as token ids as reinforcement-learning rollouts send them, go where that
prompt went; text prompts are keyed too; streams pass through; ``/abort_request`` reaches
the replica running the ``rid``. The gateway answered 404."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.generate import first_prompt
from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)

PROMPT_IDS = list(range(1000, 1200))  # 200 token ids: 12 blocks of 16


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"stub-{i}") for i in range(2)]
        urls = [s.url for s in self.stubs]
        self.open = start_gateway(root, "open", urls)
        keys = str(write_api_keys(root / "keys.json"))
        self.keyed = start_gateway(root, "keyed", urls, "--api-keys", keys)

    def stop(self) -> None:
        for server in (self.open, self.keyed, *self.stubs):
            server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("generate"))
    yield s
    s.stop()


def _post(gateway: Server, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(gateway.url + "/generate", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "prompt",
    [
        {"input_ids": PROMPT_IDS},
        {"text": "Solve the following problem step by step and show your work. " * 8},
    ],
)
def test_samples_of_one_prompt_go_where_it_went(servers: Servers, prompt: dict[str, Any]) -> None:
    replicas, reasons = [], []
    for seed in range(6):  # a group of samples, as a GRPO rollout sends them
        body = {**prompt, "sampling_params": {"temperature": 1.0, "seed": seed}}
        answer = _post(servers.open, body)
        assert answer.status_code == 200 and answer.json()["text"] == "tok0 tok1"
        replicas.append(answer.headers["x-prefixgate-replica"])
        reasons.append(answer.headers["x-prefixgate-route"])
    assert len(set(replicas)) == 1, replicas
    assert all(r.startswith("prefix_match") for r in reasons[1:]), reasons


def test_a_stream_passes_through(servers: Servers) -> None:
    body = {"input_ids": PROMPT_IDS, "stream": True}
    with httpx.stream("POST", servers.open.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")


def test_only_shared_tenants_in_keyed_mode(servers: Servers) -> None:
    body = {"input_ids": PROMPT_IDS}
    shared = _post(servers.keyed, body, authorization="Bearer sk-shared")
    assert shared.status_code == 200, shared.text
    salted = _post(servers.keyed, body, authorization="Bearer sk-alpha")
    assert salted.status_code == 403 and salted.json()["error"]["code"] == "no_cache_salt"


def test_the_prompt_keyed_is_the_first() -> None:
    assert first_prompt({"input_ids": [[5, 6], [7]]}) == [5, 6]
    assert first_prompt({"input_ids": [5, 6], "text": "x"}) == [5, 6]
    assert first_prompt({"text": ["a", "b"]}) == "a"
    assert first_prompt({"input_ids": [5, True]}) is None  # not ids: the replica judges
    assert first_prompt({"input_ids": [-1]}) is None and first_prompt({}) is None
    # Media: its tokens are keyed by the media too, where the gateway cannot follow.
    assert first_prompt({"text": "<image> what is this?", "image_data": ["a.png"]}) is None
    assert first_prompt({"input_ids": [5, 6], "image_data": [], "audio_data": None}) == [5, 6]


def _aborts(servers: Servers) -> list[list[dict[str, Any]]]:
    """Each stub's aborts received so far."""
    seen = [httpx.get(s.url + "/stub/requests", timeout=10).json() for s in servers.stubs]
    return [[r["body"] for r in requests if r["path"] == "/abort_request"] for requests in seen]


class Held:
    """A ``/generate`` the stub holds until it is aborted, sent in a thread."""

    def __init__(self, gateway: Server, rid: str, **headers: str) -> None:
        self.answer: httpx.Response | None = None
        body = {"input_ids": PROMPT_IDS, "rid": rid}
        self.thread = threading.Thread(
            target=lambda: setattr(self, "answer", _post(gateway, body, **headers))
        )
        self.thread.start()

    def arrived(self, servers: Servers, rid: str) -> int:
        """The index of the stub running it, once it has arrived (polled)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for i, stub in enumerate(servers.stubs):
                requests = httpx.get(stub.url + "/stub/requests", timeout=10).json()
                if any(r["body"].get("rid") == rid for r in requests if r["path"] == "/generate"):
                    return i
            time.sleep(0.02)  # polling the stubs, not waiting for a server to start
        raise AssertionError(f"{rid} never reached a stub")

    def finish_reason(self) -> str:
        self.thread.join(timeout=40)
        assert self.answer is not None and self.answer.status_code == 200
        return str(self.answer.json()["meta_info"]["finish_reason"]["type"])


def test_an_abort_goes_to_the_replica_running_the_rid(servers: Servers) -> None:
    held = Held(servers.open, "hold-a")
    running = held.arrived(servers, "hold-a")
    before = _aborts(servers)
    abort = httpx.post(servers.open.url + "/abort_request", json={"rid": "hold-a"}, timeout=10)
    assert abort.status_code == 200
    assert held.finish_reason() == "abort"
    new = [after[len(b) :] for after, b in zip(_aborts(servers), before, strict=True)]
    assert new[running] == [{"rid": "hold-a"}] and new[1 - running] == []


def test_an_unknown_rid_goes_to_every_replica_in_open_mode_only(servers: Servers) -> None:
    before = [len(a) for a in _aborts(servers)]
    for gateway, headers in (
        (servers.open, {}),
        (servers.keyed, {"authorization": "Bearer sk-shared"}),
    ):
        r = httpx.post(
            gateway.url + "/abort_request", json={"rid": "elsewhere"}, headers=headers, timeout=10
        )
        assert r.status_code == 200
    # Open mode: another gateway may have routed it. Keyed mode: no tenant's to abort.
    assert [len(a) - b for a, b in zip(_aborts(servers), before, strict=True)] == [1, 1]


def test_a_tenant_aborts_only_its_own_and_abort_all_is_an_admins(servers: Servers) -> None:
    shared = {"authorization": "Bearer sk-shared"}
    held = Held(servers.keyed, "hold-b", **shared)
    held.arrived(servers, "hold-b")
    ops = {"authorization": "Bearer sk-ops"}  # an admin: another tenant, all the same
    other = httpx.post(
        servers.keyed.url + "/abort_request", json={"rid": "hold-b"}, headers=ops, timeout=10
    )
    assert other.status_code == 200
    refused = httpx.post(
        servers.keyed.url + "/abort_request", json={"abort_all": True}, headers=shared, timeout=10
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert held.thread.is_alive()  # neither reached it
    every = httpx.post(
        servers.keyed.url + "/abort_request", json={"abort_all": True}, headers=ops, timeout=10
    )
    assert every.status_code == 200
    assert held.finish_reason() == "abort"
