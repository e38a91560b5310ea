"""A tenant's ``models`` (gateway/auth.py): the models its keys may call. Without it any
key could call any model the replicas serve, another tenant's LoRA adapter included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.auth import parse_api_keys
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(180)

KEYS = {
    "sk-a": {"tenant": "a", "models": ["model-a"]},
    # Anthropic's API has no cache salt: keyed mode serves it to shared tenants only
    "sk-shared-a": {"tenant": "shared-a", "shared_namespace": True, "models": ["model-a"]},
    "sk-all": {"tenant": "b"},
    "sk-ops": {"tenant": "ops", "admin": True, "models": ["model-b"]},
}


class Servers:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, m, "--model", m) for m in ("model-a", "model-b")]
        keys = root / "keys.json"
        keys.write_text(json.dumps(KEYS))
        self.gateway = start_gateway(
            root, "keyed", [s.url for s in self.stubs], "--api-keys", str(keys)
        )

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=0)

    def stop(self) -> None:
        self.gateway.stop()
        for stub in self.stubs:
            stub.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("tenant-models"))
    yield s
    s.stop()


def _post(gateway: Server, path: str, key: str, body: dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)


def test_a_model_outside_the_list_is_one_that_does_not_exist(servers: Servers) -> None:
    a = servers.client("sk-a")
    chat = a.chat.completions.create(model="model-a", messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "model-a"
    with pytest.raises(openai.NotFoundError) as refused:
        a.chat.completions.create(model="model-b", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as missing:
        a.chat.completions.create(model="model-c", messages=[{"role": "user", "content": "hi"}])
    # Nothing tells a served model from one that is not: the same code, the same words.
    assert refused.value.code == missing.value.code == "model_not_found"
    assert refused.value.body == json.loads(
        json.dumps(missing.value.body).replace("model-c", "model-b")
    )
    # A key without a list calls both; an admin key is held to its list too.
    b = servers.client("sk-all")
    for model in ("model-a", "model-b"):
        assert b.completions.create(model=model, prompt="hi").model == model
    with pytest.raises(openai.NotFoundError):
        servers.client("sk-ops").completions.create(model="model-a", prompt="hi")


def test_every_endpoint_keeps_to_the_list(servers: Servers) -> None:
    gateway = servers.gateway
    embed = _post(gateway, "/v1/embeddings", "sk-a", {"model": "model-b", "input": "x"})
    assert embed.status_code == 404, embed.text
    assert _post(gateway, "/v1/embeddings", "sk-a", {"model": "model-a", "input": "x"}).is_success
    messages = {
        "model": "model-b",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    anthropic = _post(gateway, "/v1/messages", "sk-shared-a", messages)
    assert anthropic.status_code == 404
    assert anthropic.json()["type"] == "error"  # in Anthropic's shape
    messages["model"] = "model-a"
    assert _post(gateway, "/v1/messages", "sk-shared-a", messages).is_success
    responses = _post(gateway, "/v1/responses", "sk-a", {"model": "model-b", "input": "hi"})
    assert responses.status_code == 404
    sagemaker = httpx.post(
        gateway.url + "/invocations",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": "Bearer sk-a", "x-amzn-sagemaker-adapter-identifier": "model-b"},
        timeout=30,
    )
    assert sagemaker.status_code == 404


def test_the_model_list_shows_only_the_keys_models(servers: Servers) -> None:
    assert [m.id for m in servers.client("sk-a").models.list()] == ["model-a"]
    assert sorted(m.id for m in servers.client("sk-all").models.list()) == ["model-a", "model-b"]
    assert servers.client("sk-a").models.retrieve("model-a").id == "model-a"
    with pytest.raises(openai.NotFoundError):
        servers.client("sk-a").models.retrieve("model-b")


def test_the_keys_file_takes_one_list_of_names_per_tenant() -> None:
    tenant = parse_api_keys({"k": {"tenant": "t", "models": ["x", "y"]}})["k"]
    assert tenant.models == frozenset({"x", "y"})
    assert parse_api_keys({"k": {"tenant": "t", "models": []}})["k"].models is None  # LiteLLM's
    for bad in ("x", [1], [""], {"x": 1}):
        with pytest.raises(ValueError, match="models"):
            parse_api_keys({"k": {"tenant": "t", "models": bad}})
    two = {"a": {"tenant": "t", "models": ["x"]}, "b": {"tenant": "t"}}
    with pytest.raises(ValueError, match="one limit per tenant"):
        parse_api_keys(two)
