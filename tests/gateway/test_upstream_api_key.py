"""Replicas started with ``--api-key`` (vLLM guards every ``/v1`` path with it, SGLang
every path but health and metrics), behind a gateway given ``--upstream-api-key``.

Before the flag, such a replica's ``/v1/models`` refused the gateway: its model stayed
unknown, so the gateway listed no model and could not match prompts to its cache; a keyed
gateway could not reach it at all (its clients' keys are the gateway's), and every request
came back as a 401 to a client whose key was valid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.cli import main as gateway_main
from gateway.config import GatewayConfig
from tests.conftest import wait_until
from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)

ENGINE_KEY = "sk-vllm-0123"
MODEL = "keyed-model"
MESSAGES = [{"role": "user", "content": "hello"}]


class Servers:
    def __init__(self, root: Path) -> None:
        self.stub = start_stub(root, "stub", "--model", MODEL, "--api-key", ENGINE_KEY)
        keys = str(write_api_keys(root / "keys.json"))
        urls = [self.stub.url]
        self.keyed = start_gateway(
            root, "keyed", urls, "--api-keys", keys, "--upstream-api-key", ENGINE_KEY
        )
        self.keyed_without = start_gateway(root, "keyed-without", urls, "--api-keys", keys)
        self.open = start_gateway(root, "open", urls)

    def stop(self) -> None:
        for server in (self.keyed, self.keyed_without, self.open, self.stub):
            server.stop()

    def seen(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.stub.url + "/stub/requests").json())

    def last_authorization(self) -> str | None:
        served = [r for r in self.seen() if "body" in r]
        return served[-1]["headers"].get("authorization")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("upstream-key"))
    yield s
    s.stop()


def _client(gateway: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def test_the_gateways_key_reaches_the_replica_in_place_of_the_clients(servers: Servers) -> None:
    client = _client(servers.keyed, "sk-alpha")
    assert [m.id for m in client.models.list()] == [MODEL]  # the guarded list was read
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
    assert servers.last_authorization() == f"Bearer {ENGINE_KEY}"  # never the tenant's key


def test_without_it_a_keyed_gateway_names_the_flag(servers: Servers) -> None:
    gateway = servers.keyed_without
    client = _client(gateway, "sk-alpha")
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert caught.value.status_code == 502
    error = caught.value.response.json()["error"]
    assert error["code"] == "upstream_auth" and "--upstream-api-key" in error["message"]

    # Both gateways without the key ask for the model every probe interval (0.5 s).
    refused = [{"path": "/v1/models", "method": "GET", "status": 401}] * 10
    wait_until(lambda: servers.seen()[-10:] == refused, 20, "the model asked for again")
    log = gateway.log_text()
    assert log.count("refused GET /v1/models") == 1  # named once, not at every retry
    assert "start the gateway with --upstream-api-key" in log


def test_an_open_gateway_forwards_the_clients_own_key(servers: Servers) -> None:
    answer = _client(servers.open, ENGINE_KEY).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content
    assert servers.last_authorization() == f"Bearer {ENGINE_KEY}"
    with pytest.raises(openai.AuthenticationError):  # the replica judges it, as without us
        _client(servers.open, "sk-wrong").chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
        )


def test_the_key_stays_out_of_logs_and_header_injection() -> None:
    assert ENGINE_KEY not in repr(GatewayConfig(upstream_api_key=ENGINE_KEY))
    assert gateway_main(["--upstream-api-key", "sk-1\r\nx-injected: 1", "--port", "1"]) == 2
