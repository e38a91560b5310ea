"""vLLM's run-time LoRA adapters through the gateway (gateway/adapters.py): a load goes
to every replica and the adapter routes from the next request, not after the gateway's
next read of the model lists (30 s); an unload likewise; a replica that refuses makes
the answer its error with each replica's; keyed mode: admin keys only. The gateway
answered 404."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import (
    Server,
    StubCluster,
    start_gateway,
    start_stub,
    stub_cluster,
    write_api_keys,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "base"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path_factory.mktemp("adapters"), MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, cluster: StubCluster) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("adapters-keyed")
    keys = str(write_api_keys(root / "keys.json"))
    urls = [s.url for s in cluster.stubs]
    gateway = start_gateway(root, "keyed", urls, "--model", MODEL, "--api-keys", keys)
    yield gateway
    gateway.stop()


def _chat(gateway: Server, model: str, **headers: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _adapter(gateway: Server, action: str, name: str, **headers: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
    url = f"{gateway.url}/v1/{action}_lora_adapter"
    return httpx.post(url, json=body, headers=headers, timeout=30)


def test_a_loaded_adapter_routes_at_once_and_an_unloaded_one_not(cluster: StubCluster) -> None:
    assert _chat(cluster.gateway, "step-1").status_code == 404
    loaded = _adapter(cluster.gateway, "load", "step-1")
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'step-1' added successfully."
    sent = cluster.received("/v1/load_lora_adapter")
    assert [r["body"]["lora_name"] for r in sent] == ["step-1", "step-1"]  # each engine
    answer = _chat(cluster.gateway, "step-1")  # no wait: the lists were read again
    assert answer.status_code == 200, answer.text
    assert _adapter(cluster.gateway, "unload", "step-1").status_code == 200
    assert _chat(cluster.gateway, "step-1").status_code == 404


def test_a_replica_that_refuses_makes_the_answer_an_error(cluster: StubCluster) -> None:
    # Loaded behind the gateway's back on one engine: there the second load is a 400.
    direct = httpx.post(
        cluster.stubs[0].url + "/v1/load_lora_adapter", json={"lora_name": "half"}, timeout=10
    )
    assert direct.status_code == 200
    answer = _adapter(cluster.gateway, "load", "half")
    assert answer.status_code == 400
    body = answer.json()
    assert body["error"]["code"] == "adapter_failed"
    assert sorted(r["status"] for r in body["replicas"].values()) == [200, 400]
    assert _chat(cluster.gateway, "half").status_code == 200  # both hold it now
    assert _adapter(cluster.gateway, "unload", "half").status_code == 200


def test_only_admin_keys_load_adapters(keyed: Server) -> None:
    refused = _adapter(keyed, "load", "tenant-a", authorization="Bearer sk-alpha")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    loaded = _adapter(keyed, "load", "ops-1", authorization="Bearer sk-ops")
    assert loaded.status_code == 200, loaded.text
    assert _adapter(keyed, "unload", "ops-1", authorization="Bearer sk-ops").status_code == 200


def test_a_keyed_engine_gets_the_clients_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Open mode passes the client's Authorization on, as for its chats: an engine
    started with --api-key takes the load only with it."""
    root = tmp_path_factory.mktemp("adapters-engine-key")
    engine = start_stub(root, "engine", "--model", MODEL, "--api-key", "sk-engine")
    gateway = start_gateway(root, "open", [engine.url], "--model", MODEL)
    try:
        without = _adapter(gateway, "load", "k-1")
        assert without.status_code == 401, without.text
        loaded = _adapter(gateway, "load", "k-1", authorization="Bearer sk-engine")
        assert loaded.status_code == 200, loaded.text
    finally:
        gateway.stop()
        engine.stop()


def test_sagemakers_adapter_routes_load_and_unload_on_every_replica(cluster: StubCluster) -> None:
    """SageMaker's ``POST /adapters`` and ``DELETE /adapters/NAME`` (vLLM's image serves
    them with run-time loading on), then the adapter named in SageMaker's header."""
    url = cluster.gateway.url
    r = httpx.post(url + "/adapters", json={"name": "sm-1", "src": "/opt/ml/adapters/sm-1"})
    assert (r.status_code, r.text) == (200, "Adapter sm-1 registered")
    sent = [s["body"] for s in cluster.received("/v1/load_lora_adapter")]
    wanted = {"lora_name": "sm-1", "lora_path": "/opt/ml/adapters/sm-1"}
    assert sent.count(wanted) == 2  # one per replica
    header = {"X-Amzn-SageMaker-Adapter-Identifier": "sm-1"}
    r = httpx.post(url + "/invocations", json={"prompt": "hi"}, headers=header, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "sm-1"
    r = httpx.delete(url + "/adapters/sm-1")
    assert (r.status_code, r.text) == (200, "Adapter sm-1 unregistered")
    r = httpx.post(url + "/invocations", json={"prompt": "hi"}, headers=header, timeout=30)
    assert r.status_code == 404
    for bad in ({"name": "x"}, {"src": "/a"}, {"name": "", "src": "/a"}):
        assert httpx.post(url + "/adapters", json=bad).status_code == 400
    assert httpx.get(url + "/adapters/sm-1").status_code == 405
    assert httpx.delete(url + "/adapters/").status_code == 404
    r = httpx.delete(url + "/adapters/never-loaded")  # every replica's own 400
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_failed"


def test_sagemakers_adapter_routes_want_an_admin_key(keyed: Server) -> None:
    r = httpx.post(
        keyed.url + "/adapters",
        json={"name": "sm-2", "src": "/a"},
        headers={"authorization": "Bearer sk-alpha"},
    )
    assert r.status_code == 403
    r = httpx.delete(keyed.url + "/adapters/sm-2", headers={"authorization": "Bearer sk-alpha"})
    assert r.status_code == 403
