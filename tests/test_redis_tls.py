"""Redis over TLS, as cloud Redis services serve it (Azure Cache only on its TLS port;
ElastiCache and Memorystore with in-transit encryption): a ``rediss://`` URL, verified
against ``ssl_ca_certs`` and showing ``ssl_certfile``/``ssl_keyfile`` where the server
wants a client certificate, as redis-py reads them from the URL's query. A replica
publishes there and a gateway that knows no replica finds it there and routes by what it
published; a Redis whose certificate the URL does not trust is unreachable, and both keep
serving.

The tests' ``redis-server`` has no TLS: ``tests/support/tls_proxy.py`` terminates it in
front of a plain one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixgate.procs import free_port
from tests.conftest import RedisServer, wait_until
from tests.gateway.conftest import Server, start, start_gateway
from tests.support.certs import Certs, make_certs
from tests.support.tls_proxy import TLSProxy, tls_proxy

pytestmark = pytest.mark.timeout(180)

PROMPT = "a prompt the replica caches and publishes over TLS " * 8


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path / "certs")


@pytest.fixture
def tls_redis(redis_server: RedisServer, certs: Certs) -> Iterator[TLSProxy]:
    """A Redis served over TLS that wants a client certificate its CA signed."""
    with tls_proxy(redis_server.port, certs.server_cert, certs.server_key, certs.ca) as proxy:
        yield proxy


def cluster(tmp_path: Path, url: str) -> tuple[Server, Server]:
    port = free_port()
    args = ["-m", "prefixgate", "replica", "--model", "tiny-random", "--port", str(port)]
    replica = start([*args, "--redis-url", url], port, tmp_path, "replica")
    try:
        return replica, start_gateway(tmp_path, "gateway", [], "--redis-url", url)
    except Exception:
        replica.stop()
        raise


def test_a_replica_and_a_gateway_share_a_redis_over_tls(
    tmp_path: Path, tls_redis: TLSProxy, certs: Certs
) -> None:
    query = f"ssl_ca_certs={certs.ca}&ssl_certfile={certs.client_cert}"
    url = f"rediss://127.0.0.1:{tls_redis.port}/0?{query}&ssl_keyfile={certs.client_key}"
    replica, gateway = cluster(tmp_path, url)  # ready: it found the replica in Redis
    try:
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 1}
        first = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text

        def published() -> bool:
            stats = httpx.get(gateway.url + "/router/stats").json()
            return any(v["blocks"] > 0 for v in stats["replicas"].values())

        wait_until(published, timeout_s=20, what="the replica's blocks, read from Redis")
        again = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        route = again.headers["x-prefixgate-route"]
        assert route.startswith("prefix_match"), route
        assert httpx.get(gateway.url + "/router/stats").json()["sync"]["connected"] is True
        assert tls_redis.connections >= 2  # the replica's and the gateway's
    finally:
        gateway.stop()
        replica.stop()
    assert "rediss://127.0.0.1" in gateway.log_text()


def test_a_redis_whose_certificate_is_not_trusted_is_unreachable_and_said(
    tmp_path: Path, tls_redis: TLSProxy
) -> None:
    url = f"rediss://127.0.0.1:{tls_redis.port}/0"  # no ssl_ca_certs: the test CA is unknown
    replica, gateway = None, None
    port = free_port()
    args = ["-m", "prefixgate", "replica", "--model", "tiny-random", "--port", str(port)]
    replica = start([*args, "--redis-url", url], port, tmp_path, "replica")
    try:
        gateway = start_gateway(tmp_path, "gateway", [replica.url], "--redis-url", url)
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 1}
        answer = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text  # served on the gateway's own view
        assert httpx.get(gateway.url + "/router/stats").json()["sync"]["connected"] is False
        wait_until(
            lambda: "CERTIFICATE_VERIFY_FAILED" in replica.log_text(),
            timeout_s=20,
            what="the replica's log naming the failed verification",
        )
        assert "CERTIFICATE_VERIFY_FAILED" in gateway.log_text()
    finally:
        if gateway is not None:
            gateway.stop()
        replica.stop()
