"""Idle client connections and load balancers (``--keep-alive-s``).

A load balancer keeps its connections to the gateway open between requests for its own
idle timeout (AWS ALB and ingress-nginx: 60 s) and sends the next request on one of
them. The gateway closed idle connections after uvicorn's 5 s, so the balancer's next
request could meet a connection being closed under it, and that request failed with a
502 from the balancer; AWS asks for a backend idle timeout above the balancer's.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n"


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_stub(tmp_path_factory.mktemp("keepalive"), "stub", "--model", "stub-model")
    yield server
    server.stop()


def _answer(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, read whole ("" if the server closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head


def _connect(gateway: Server) -> socket.socket:
    port = int(gateway.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def test_an_idle_connection_outlives_uvicorns_five_seconds(stub: Server, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, "gateway", [stub.url])
    try:
        with _connect(gateway) as sock:
            sock.sendall(REQUEST)
            assert _answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(6.0)  # idle, as between a balancer's requests: the thing tested
            sock.sendall(REQUEST)
            assert _answer(sock).startswith(b"HTTP/1.1 200")  # before: b"" (closed at 5 s)
    finally:
        gateway.stop()


def test_the_idle_timeout_is_the_flags(stub: Server, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, "gateway", [stub.url], "--keep-alive-s", "1")
    try:
        with _connect(gateway) as sock:
            sock.sendall(REQUEST)
            assert _answer(sock).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert sock.recv(1) == b""  # closed by the gateway (a 15 s timeout fails)
            assert time.monotonic() - started < 10
    finally:
        gateway.stop()
