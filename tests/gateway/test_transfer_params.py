"""vLLM's disaggregation fields, ``kv_transfer_params`` and ``ec_transfer_params``, reach an
engine only from a trusted client.

vLLM 0.32 trusts them on any engine: ``{"do_remote_prefill": true,
"remote_prefill_cached_tokens": N}`` makes it report N cached prompt tokens, connector or
not (docs/BENCHMARKS.md, "A tenant's transfer parameters"); with a NIXL connector they
read another engine's blocks by number, or keep a request's blocks after it ends. Keyed
mode drops a tenant's, keeps an admin key's (a disaggregating proxy's) and open mode's.
And in every mode, a ``kv_transfer_params`` among the engine arguments that is not an
object is a 400 at the gateway, where vLLM took it and failed with a 500."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import OpenAndKeyed, Server

pytestmark = pytest.mark.timeout(120)

MODEL = "transfer-model"
PARAMS = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 99},
    "ec_transfer_params": {"do_remote": True},
}
MESSAGES = [{"role": "user", "content": "hi"}]
XARGS = {"kv_transfer_params": {"do_remote_decode": True}, "kept": 1}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "vllm_xargs": XARGS}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True, "vllm_xargs": XARGS}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 2}),
    ("/v1/chat/completions/batch", {"messages": [MESSAGES], "max_tokens": 2}),
]
TENANT = {"/v1/messages": "sk-shared"}  # the Messages API is a shared-namespace tenant's


class Servers(OpenAndKeyed):
    def forward(self, gateway: Server, path: str, body: dict[str, Any], key: str | None) -> Any:
        """The body the engine got for ``body`` sent through ``gateway`` with ``key``."""
        before = len(self.received(path))
        headers = {"authorization": f"Bearer {key}"} if key else {}
        sent = {"model": MODEL, **body, **PARAMS}
        r = httpx.post(gateway.url + path, json=sent, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        seen = self.received(path)[before:]
        assert len(seen) == 1, seen
        return seen[0]["body"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("transfer"), MODEL)
    yield s
    s.stop()


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_a_tenants_transfer_params_are_dropped(
    servers: Servers, path: str, body: dict[str, Any]
) -> None:
    got = servers.forward(servers.keyed, path, body, TENANT.get(path, "sk-alpha"))
    assert not set(PARAMS) & set(got), got
    if "vllm_xargs" in body:
        assert got["vllm_xargs"] == {"kept": 1}


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_an_admin_keys_and_open_modes_pass_as_sent(
    servers: Servers, path: str, body: dict[str, Any]
) -> None:
    senders: list[tuple[Server, str | None]] = [(servers.open, None)]
    if path not in TENANT:  # an admin key has a salt of its own
        senders.append((servers.keyed, "sk-ops"))
    for gateway, key in senders:
        got = servers.forward(gateway, path, body, key)
        assert {name: got.get(name) for name in PARAMS} == PARAMS
        if "vllm_xargs" in body:
            assert got["vllm_xargs"] == XARGS


@pytest.mark.parametrize("value", ["x", ["do_remote_prefill"], 1])
def test_engine_arguments_transfer_params_not_an_object_are_a_400(
    servers: Servers, value: Any
) -> None:
    path = "/v1/chat/completions"
    before = len(servers.received(path))
    body = {"model": MODEL, "messages": MESSAGES, "vllm_xargs": {"kv_transfer_params": value}}
    for gateway, key in ((servers.open, None), (servers.keyed, "sk-ops")):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "vllm_xargs.kv_transfer_params"
    assert len(servers.received(path)) == before  # no engine was asked


def test_the_token_apis_extra_args_are_checked_and_dropped_too() -> None:
    from gateway.auth import Tenant
    from gateway.handler import without_transfer_params
    from prefixgate.wire import OpenAIError

    keyed: Any = SimpleNamespace(auth=SimpleNamespace(open=False))  # a keyed gateway's state
    tenant, admin = Tenant("alpha", "salt"), Tenant("ops", "salt2", admin=True)
    body = {
        "token_ids": [1],
        "kv_transfer_params": {"do_remote_decode": True},
        "sampling_params": {"extra_args": {"kv_transfer_params": {}, "ec_transfer_params": {}}},
    }
    assert not without_transfer_params(keyed, admin, body)
    assert without_transfer_params(keyed, tenant, body)
    assert body == {"token_ids": [1], "sampling_params": {"extra_args": {}}}
    assert not without_transfer_params(keyed, tenant, {"sampling_params": [1], "vllm_xargs": 2})
    with pytest.raises(OpenAIError) as err:
        bad = {"sampling_params": {"extra_args": {"kv_transfer_params": "x"}}}
        without_transfer_params(keyed, admin, bad)
    assert err.value.param == "extra_args.kv_transfer_params"
