"""A key's own scheduling priority (gateway/auth.py, ``priority: N``).

vLLM under ``--scheduling-policy priority`` runs lower values first, read from the
``X-Vllm-Priority`` header or else the body's ``priority``; the gateway passes both as
sent. In keyed mode that let any tenant put its requests ahead of every other tenant's,
and an operator had no way to rank tenants (a batch key behind an interactive one). A
key with ``priority`` now has it in the header and in the body of every request that an
engine schedules by it, whatever the client sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import parse_api_keys
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

MODEL = "prio-model"
KEYS = {
    "sk-batch": {"tenant": "batch", "priority": 10, "shared_namespace": True},
    "sk-alpha": {"tenant": "alpha"},
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# path, body, whether the engine reads the body's priority there (else the header only)
REQUESTS: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/chat/completions", CHAT, True),
    ("/v1/chat/completions", {**CHAT, "stream": True}, True),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, True),
    ("/v1/responses", {"model": MODEL, "input": "hi", "store": False}, True),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}, True),
    ("/v1/chat/completions/batch", {"model": MODEL, "messages": [CHAT["messages"]]}, True),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, True),
    ("/invocations", {"input": "hi"}, True),  # a pooling model's, to the replica's own
    ("/v1/messages", {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 2}, False),
]


class Servers:
    def __init__(self, root: Path) -> None:
        self.stub = start_stub(root, "stub", "--model", MODEL)
        keys = root / "keys.json"
        keys.write_text(json.dumps(KEYS))
        self.gateway = start_gateway(root, "keyed", [self.stub.url], "--api-keys", str(keys))

    def stop(self) -> None:
        self.gateway.stop()
        self.stub.stop()

    def last(self, path: str) -> dict[str, Any]:
        seen = httpx.get(self.stub.url + "/stub/requests").json()
        return [r for r in seen if r.get("path") == path][-1]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("tenant-priority"))
    yield s
    s.stop()


def _post(gateway: Server, path: str, body: dict[str, Any], key: str) -> None:
    headers = {"authorization": f"Bearer {key}", "x-vllm-priority": "-100"}
    r = httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "in_body"), REQUESTS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(REQUESTS)]
)
def test_a_keys_priority_replaces_the_clients(
    servers: Servers, path: str, body: dict[str, Any], in_body: bool
) -> None:
    _post(servers.gateway, path, {**body, "priority": -100}, "sk-batch")
    seen = servers.last(path)
    assert seen["headers"]["x-vllm-priority"] == "10"
    assert seen["body"]["priority"] == (10 if in_body else -100)


def test_a_key_without_one_passes_the_clients_as_sent(servers: Servers) -> None:
    _post(servers.gateway, "/v1/chat/completions", {**CHAT, "priority": -100}, "sk-alpha")
    seen = servers.last("/v1/chat/completions")
    assert seen["headers"]["x-vllm-priority"] == "-100"
    assert seen["body"]["priority"] == -100


def test_the_keys_file_takes_an_integer_priority() -> None:
    assert parse_api_keys({"k": {"tenant": "t", "priority": -3}})["k"].priority == -3
    assert parse_api_keys({"k": {"tenant": "t"}})["k"].priority is None
    for bad in ("high", True, 1.5, 2**63):
        with pytest.raises(ValueError, match="priority"):
            parse_api_keys({"k": {"tenant": "t", "priority": bad}})
