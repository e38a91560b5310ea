"""vLLM 0.32's other generating endpoints through the gateway (gateway/passthrough.py):
``/v1/chat/completions/batch`` (a batch of chats, one answer each), ``/generative_scoring``
and ``/v1/systemone`` (a structured decision). Each was a 404 at the gateway. Their
prompts fill the engine's prefix cache, so keyed mode salts them as it salts a chat: a
tenant's batch must not read, or time, another tenant's cached prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import OpenAndKeyed, Server

pytestmark = pytest.mark.timeout(120)

MODEL = "gen-model"
CHATS = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions/batch": {"model": MODEL, "messages": CHATS, "max_tokens": 2},
    "/generative_scoring": {"model": MODEL, "query": "Is it?", "items": ["yes"]},
    "/v1/systemone": {"model": MODEL, "prompt": "Pick one.", "options": ["a", "b"]},
}


class Servers(OpenAndKeyed):
    def seen(self, path: str) -> dict[str, Any]:
        return self.received(path)[-1]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("generating"), MODEL)
    yield s
    s.stop()


def _post(gateway: Server, path: str, body: dict[str, Any], key: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", list(BODIES))
def test_each_reaches_the_engine_as_sent(servers: Servers, path: str) -> None:
    body = {**BODIES[path], "cache_salt": "client-salt"}
    assert _post(servers.open, path, body) == {"path": path, "object": "stub"}
    assert servers.seen(path)["body"] == body  # open mode: the client's own salt


@pytest.mark.parametrize("path", list(BODIES))
def test_keyed_mode_puts_the_tenants_salt_in_place_of_the_clients(
    servers: Servers, path: str
) -> None:
    _post(servers.keyed, path, {**BODIES[path], "cache_salt": "beta-salt-guess"}, "sk-alpha")
    alpha = servers.seen(path)["body"]["cache_salt"]
    _post(servers.keyed, path, BODIES[path], "sk-beta")
    beta = servers.seen(path)["body"]["cache_salt"]
    assert alpha and beta and alpha != beta and "beta-salt-guess" not in (alpha, beta)
    _post(servers.keyed, path, {**BODIES[path], "cache_salt": "x"}, "sk-shared")
    assert "cache_salt" not in servers.seen(path)["body"]  # the shared namespace: none


def test_a_tenant_without_a_key_is_refused(servers: Servers) -> None:
    path = "/v1/chat/completions/batch"
    r = httpx.post(servers.keyed.url + path, json=BODIES[path], timeout=30)
    assert r.status_code == 401
