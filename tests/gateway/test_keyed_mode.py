"""Keyed mode (--api-keys) through a real gateway process: operations that show or
affect every tenant need an admin key, conversation ids are per tenant, and POST bodies
must be application/json (a browser's cross-site simple request is refused)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub, write_api_keys

pytestmark = pytest.mark.timeout(120)

MODEL = "stub-model"
SESSIONS = 16


class Keyed:
    def __init__(self, root: Path) -> None:
        self.stubs = [start_stub(root, f"stub-{i}", "--model", MODEL) for i in range(4)]
        keys = write_api_keys(root / "keys.json")
        self.gw = start_gateway(
            root,
            "gw",
            [s.url for s in self.stubs],
            "--api-keys",
            str(keys),
            "--policy",
            "consistent_hash",
        )

    def stop(self) -> None:
        for server in [self.gw, *self.stubs]:
            server.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    k = Keyed(tmp_path_factory.mktemp("keyed"))
    yield k
    k.stop()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_router_stats_needs_an_admin_key(keyed: Keyed) -> None:
    url = keyed.gw.url + "/router/stats"
    missing = httpx.get(url)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    tenant = httpx.get(url, headers=_auth("sk-alpha"))
    assert tenant.status_code == 403 and tenant.json()["error"]["type"] == "permission_error"
    admin = httpx.get(url, headers=_auth("sk-ops"))
    assert admin.status_code == 200 and len(admin.json()["replicas"]) == 4


def test_reset_prefix_cache_needs_an_admin_key(keyed: Keyed) -> None:
    url = keyed.gw.url + "/reset_prefix_cache"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers=_auth("sk-beta")).status_code == 403


def _replica_for(gw: Server, key: str, session: str) -> str:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "prompt_cache_key": session}
    r = httpx.post(gw.url + "/v1/completions", json=body, headers=_auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-prefixgate-replica"]


def test_conversations_are_scoped_by_tenant(keyed: Keyed) -> None:
    """The same session ids from two tenants are two sets of conversations: the ring
    places them independently (with 4 replicas, 16 sessions all placed alike by chance
    has probability 4^-16), while each tenant's own session stays where it is."""
    sessions = [f"session-{i}" for i in range(SESSIONS)]
    alpha = [_replica_for(keyed.gw, "sk-alpha", s) for s in sessions]
    beta = [_replica_for(keyed.gw, "sk-beta", s) for s in sessions]
    assert alpha != beta
    assert [_replica_for(keyed.gw, "sk-alpha", s) for s in sessions] == alpha


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None],
)
def test_a_post_body_that_is_not_json_is_415(keyed: Keyed, content_type: str | None) -> None:
    """What a browser may send cross-site without a preflight: refused before anything
    reads it."""
    raw = b'{"model": "stub-model", "prompt": "hello", "max_tokens": 1}'
    headers = _auth("sk-alpha")
    if content_type is not None:
        headers["content-type"] = content_type
    r = httpx.post(keyed.gw.url + "/v1/completions", content=raw, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]


def test_json_with_parameters_is_served(keyed: Keyed) -> None:
    raw = b'{"model": "stub-model", "prompt": "hello", "max_tokens": 1}'
    headers = {**_auth("sk-alpha"), "content-type": "application/json; charset=utf-8"}
    assert httpx.post(keyed.gw.url + "/v1/completions", content=raw, headers=headers).is_success


def test_a_tenant_sees_how_it_was_routed_not_the_clusters_load(tmp_path: Path) -> None:
    """The route header's figures (every replica's predicted wait, queue and requests in
    flight) are the other tenants' traffic, as ``/router/stats`` shows it: a keyed
    gateway gives them to admin keys only. A tenant still sees its replica, the kind of
    decision and its matched blocks; an open gateway shows everything, as before."""
    stubs = [start_stub(tmp_path, f"stub-{i}", "--model", MODEL) for i in range(2)]
    keys = str(write_api_keys(tmp_path / "keys.json"))
    urls = [s.url for s in stubs]
    gateways = [start_gateway(tmp_path, "open", urls)]
    try:
        gateways.append(start_gateway(tmp_path, "keyed", urls, "--api-keys", keys))
        open_gw, keyed_gw = gateways
        seen = {}
        for name, url, key in (
            ("tenant", keyed_gw.url, "sk-alpha"),
            ("admin", keyed_gw.url, "sk-ops"),
            ("open", open_gw.url, "unused"),
        ):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=1
            )
            assert raw.headers["x-prefixgate-replica"] in {u.removeprefix("http://") for u in urls}
            seen[name] = raw.headers["x-prefixgate-route"]
        assert re.fullmatch(r"[a-z_]+ [a-z]+; matched=\d+/\d+; retries=0", seen["tenant"])
        for name in ("admin", "open"):  # both replicas' predictions
            assert seen[name].count("predicted") == 2, seen[name]
            assert seen[name].split(":", 1)[0] == seen["tenant"].split(";", 1)[0]
    finally:
        for server in [*gateways, *stubs]:
            server.stop()
