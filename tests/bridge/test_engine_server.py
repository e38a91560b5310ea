"""What the bridge must know of the engine's server.

An engine started with ``--api-key`` (vLLM guards every ``/v1`` path with it, SGLang
every path but health and metrics): the bridge sends the key with each of its requests
(``--engine-api-key``, else ``VLLM_API_KEY``). Without it the bridge never learned the
engine's model, so the engine never became a replica, with nothing in the log but a
note every 30 s that it was "waiting for engine".

Data-parallel ranks behind one URL: the bridge follows one rank's events, and says so."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bridge.cli import parse_args
from bridge.service import Bridge, BridgeConfig
from tests.bridge.cluster import make_engine
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngineHTTP
from tests.conftest import RedisServer, wait_until_async
from tests.support.certs import Certs, make_certs

pytestmark = pytest.mark.anyio

KEY = "sk-engine-0123"


@pytest.fixture
def keyed_http() -> Iterator[FakeEngineHTTP]:
    server = FakeEngineHTTP(model="keyed-model", metrics=VLLM_METRICS, api_key=KEY)
    server.start()
    yield server
    server.stop()


def _config(http: FakeEngineHTTP, endpoint: str, redis_url: str, key: str | None) -> BridgeConfig:
    return BridgeConfig(
        http.url,
        endpoint,
        redis_url,
        engine_api_key=key,
        check_tokenizer=False,
        heartbeat_s=0.1,
        info_ttl_s=1.0,
    )


async def test_a_keyed_engine_becomes_a_replica_with_its_key(
    keyed_http: FakeEngineHTTP, redis_server: RedisServer
) -> None:
    engine, endpoint = make_engine(16)
    bridge = Bridge(_config(keyed_http, endpoint, redis_server.url, KEY))
    engine.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        await asyncio.wait_for(bridge.start(), 10)
        assert bridge.config.model == "keyed-model"  # read from the guarded /v1/models
        rid = f"127.0.0.1:{keyed_http.port}"
        await wait_until_async(
            lambda: client.get(f"prefixgate:replica:{rid}"), 10, "registry record"
        )
        assert set(keyed_http.authorizations) == {f"Bearer {KEY}"}
        assert KEY not in repr(bridge.config)  # the config is logged in places; the key not
    finally:
        client.close()
        await bridge.stop()
        engine.close()


async def test_without_the_key_the_bridge_names_the_flag(
    keyed_http: FakeEngineHTTP, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    said = await warning_before_a_model(keyed_http, redis_server, caplog, "refused GET /v1/models")
    assert "--engine-api-key" in said


async def warning_before_a_model(
    http: FakeEngineHTTP, redis_server: RedisServer, caplog: pytest.LogCaptureFixture, what: str
) -> str:
    """The warning containing ``what`` that a bridge logs while it cannot learn the
    engine's model (so it never becomes a replica)."""
    engine, endpoint = make_engine(16)
    bridge = Bridge(_config(http, endpoint, redis_server.url, None))
    engine.start()
    try:
        with (
            caplog.at_level(logging.INFO, logger="prefixgate.bridge"),
            pytest.raises(TimeoutError),  # no model: it cannot become a replica
        ):
            await asyncio.wait_for(bridge.start(), 1.5)
    finally:
        await bridge.stop()
        engine.close()
    said = [r for r in caplog.records if what in r.message]
    assert said and said[0].levelno == logging.WARNING
    return said[0].message


def test_the_key_comes_from_the_flag_or_vllms_own_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["--engine-url", "http://127.0.0.1:1", "--kv-events", "tcp://127.0.0.1:2"]
    monkeypatch.delenv("PREFIXGATE_ENGINE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args(base).engine_api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parse_args(base).engine_api_key == "from-vllm"
    assert parse_args([*base, "--engine-api-key", "from-flag"]).engine_api_key == "from-flag"
    with pytest.raises(SystemExit):  # a newline pasted with it would split the header
        parse_args([*base, "--engine-api-key", "sk-1\nx-injected: 1"])


async def test_data_parallel_ranks_behind_one_url_are_named(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's internal load balancing: ranks publish their events on ports of their own,
    so a bridge on one port follows one rank while the engine spreads requests over all."""
    two_ranks = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
    )
    http = FakeEngineHTTP(model="m", metrics=two_ranks)
    http.start()
    engine, endpoint = make_engine(16)
    bridge = Bridge(_config(http, endpoint, redis_server.url, None))
    engine.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefixgate.bridge"):
            await asyncio.wait_for(bridge.start(), 10)
            await wait_until_async(
                lambda: any("data-parallel ranks" in r.message for r in caplog.records),
                10,
                "the warning",
            )
        warning = next(r.message for r in caplog.records if "data-parallel ranks" in r.message)
        assert "2 data-parallel ranks" in warning and "--data-parallel-rank" in warning
    finally:
        await bridge.stop()
        engine.close()
        http.stop()


async def test_the_engine_is_reached_directly_whatever_the_proxy(
    keyed_http: FakeEngineHTTP, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy set for the whole machine (HTTP_PROXY) cannot reach the engine beside the
    bridge: the bridge never learned its model."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    engine, endpoint = make_engine(16)
    bridge = Bridge(_config(keyed_http, endpoint, redis_server.url, KEY))
    engine.start()
    try:
        await asyncio.wait_for(bridge.start(), 10)
        assert bridge.config.model == "keyed-model"
    finally:
        await bridge.stop()
        engine.close()


@pytest.fixture
def tls_http(tmp_path: Path) -> Iterator[tuple[FakeEngineHTTP, Certs]]:
    """An engine serving HTTPS with a certificate from a private CA (vLLM's
    ``--ssl-certfile``): before the bridge's TLS flags, it never became a replica."""
    certs = make_certs(tmp_path / "certs")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    server = FakeEngineHTTP(model="tls-model", metrics=VLLM_METRICS, tls=context)
    server.start()
    yield server, certs
    server.stop()


async def test_an_https_engine_becomes_a_replica_at_its_https_url(
    tls_http: tuple[FakeEngineHTTP, Certs], redis_server: RedisServer
) -> None:
    http, certs = tls_http
    engine, endpoint = make_engine(16)
    config = _config(http, endpoint, redis_server.url, None)
    config.engine_ca_certs = certs.ca
    bridge = Bridge(config)
    engine.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        await asyncio.wait_for(bridge.start(), 10)
        assert bridge.config.model == "tls-model"
        record = await wait_until_async(
            lambda: client.get(f"prefixgate:replica:127.0.0.1:{http.port}"), 10, "the record"
        )
        assert record is not None and json.loads(record)["url"] == http.url
        assert http.url.startswith("https://")
        await wait_until_async(lambda: "/metrics" in http.requests, 10, "the engine's load read")
    finally:
        client.close()
        await bridge.stop()
        engine.close()


async def test_an_engine_whose_certificate_does_not_verify_is_named_with_the_flag(
    tls_http: tuple[FakeEngineHTTP, Certs],
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    http, _ = tls_http  # the bridge trusts the system's CAs
    said = await warning_before_a_model(http, redis_server, caplog, "does not verify")
    assert "--engine-ca-certs" in said


def test_tls_files_that_do_not_load_stop_the_bridge(tmp_path: Path) -> None:
    base = ["--engine-url", "https://127.0.0.1:1", "--kv-events", "tcp://127.0.0.1:2"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--engine-ca-certs", str(tmp_path / "missing.pem")])
    with pytest.raises(SystemExit):
        parse_args([*base, "--engine-keyfile", str(tmp_path / "k.pem")])
