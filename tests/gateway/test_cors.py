"""Browsers calling the gateway (``--allowed-origins``, gateway/cli.py ``with_cors``).

A page that calls an OpenAI-compatible server from the browser sends a CORS preflight
first. vLLM, SGLang and LiteLLM answer it for any origin by default; the gateway
answered 405, so a browser client that worked against vLLM was blocked by its browser
once pointed at the gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

PAGE = "https://chat.example"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_stub(tmp_path_factory.mktemp("cors"), "stub", "--model", "stub-model")
    yield server
    server.stop()


def test_any_origin_by_default_as_vllm(stub: Server, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, "gateway", [stub.url])
    url = gateway.url + "/v1/chat/completions"
    try:
        preflight = httpx.options(url, headers=PREFLIGHT, timeout=10)
        assert preflight.status_code == 200, preflight.text  # before: 405
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        answer = httpx.post(url, json=BODY, headers={"Origin": PAGE}, timeout=10)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
        exposed = answer.headers["access-control-expose-headers"].lower()
        assert "x-prefixgate-replica" in exposed and "x-request-id" in exposed
        # An error must carry the headers too, or the page cannot read it.
        missing = httpx.post(url, json={**BODY, "model": "nope"}, headers={"Origin": PAGE})
        assert missing.status_code == 404
        assert missing.headers["access-control-allow-origin"] == "*"
        plain = httpx.post(url, json=BODY, timeout=10)  # not a browser: nothing added
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    finally:
        gateway.stop()


def test_origins_can_be_narrowed_or_turned_off(stub: Server, tmp_path: Path) -> None:
    narrow = start_gateway(tmp_path, "narrow", [stub.url], "--allowed-origins", f'["{PAGE}"]')
    closed = start_gateway(tmp_path, "closed", [stub.url], "--allowed-origins", "[]")
    try:
        url = narrow.url + "/v1/chat/completions"
        ok = httpx.options(url, headers=PREFLIGHT, timeout=10)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
        other = httpx.options(url, headers={**PREFLIGHT, "Origin": "https://else.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = httpx.options(closed.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert refused.status_code >= 400 and "access-control-allow-origin" not in refused.headers
    finally:
        narrow.stop()
        closed.stop()


def test_a_malformed_list_is_refused_at_start() -> None:
    from gateway.cli import allowed_origins, main

    assert allowed_origins('["https://a.example", " "]') == ["https://a.example"]
    assert allowed_origins("https://a.example, https://b.example") == [
        "https://a.example",
        "https://b.example",
    ]
    assert allowed_origins("[]") == [] and allowed_origins("") == []
    for bad in ('["a", 1]', "[not json", '[{"a": 1}]'):
        with pytest.raises(ValueError, match="--allowed-origins"):
            allowed_origins(bad)
    assert main(["--allowed-origins", "[oops"]) == 2
