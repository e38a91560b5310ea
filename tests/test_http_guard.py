"""Hostile clients against both real servers (a gateway in front of a stub backend, and a
tiny-random replica): oversized and slow heads, stalled bodies, deep JSON, lone
surrogates, bad request ids, oversized bodies (prefixgate/http_limits.py,
prefixgate/guard.py, prefixgate/json_body.py). Raw sockets where a well-behaved client
library cannot misbehave on purpose."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from prefixgate.guard import Guard, GuardConfig
from prefixgate.procs import stop_process
from tests.conftest import wait_until
from tests.gateway.conftest import Server, start_gateway, start_stub
from tests.replica.conftest import MODEL, ReplicaProcess, start_replica

pytestmark = pytest.mark.timeout(180)

TIMEOUTS = ["--header-timeout-s", "1", "--body-timeout-s", "1"]
HUGE_HEADER_BYTES = 128 * 1024 * 1024


@dataclass(slots=True)
class Target:
    """One server under test: its base URL and a valid completion body for it."""

    name: str
    url: str
    model: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def completion(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": "hello", "max_tokens": 2, **fields}


@pytest.fixture(scope="module", params=["gateway", "replica"])
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    root = tmp_path_factory.mktemp(f"guard-{request.param}")
    if request.param == "gateway":
        stub = start_stub(root, "stub", "--model", "stub-model")
        gw = start_gateway(root, "gw", [stub.url], *TIMEOUTS, "--max-body-mb", "0.05")
        yield Target("gateway", gw.url, "stub-model")
        _stop(gw, stub)
    else:
        replica = start_replica(root, *TIMEOUTS, "--max-body-mb", "0.05")
        yield Target("replica", replica.url, MODEL)
        _stop_replica(replica)


def _stop(*servers: Server) -> None:
    for server in servers:
        server.stop()


def _stop_replica(replica: ReplicaProcess) -> None:
    stop_process(replica.proc)


def _connect(target: Target) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", target.port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket timeout: 10 s, a failure)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _served(target: Target) -> None:
    """Another client gets its answer meanwhile."""
    r = httpx.post(target.url + "/v1/completions", json=target.completion(), timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(target.url + "/health", timeout=5).status_code == 200


def test_a_huge_header_is_refused_while_others_are_served(target: Target) -> None:
    outcome: dict[str, Any] = {}

    def send_huge_header() -> None:
        sock = _connect(target)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, chunk = 0, b"a" * (1 << 20)
        try:
            while sent < HUGE_HEADER_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
            outcome["reply"] = sock.recv(4096)
        except OSError as exc:
            outcome["error"] = exc
        outcome["sent"] = sent
        sock.close()

    sender = threading.Thread(target=send_huge_header)
    sender.start()
    for _ in range(5):  # each with a 5 s budget: the stall this guards against was 18.8 s
        assert httpx.get(target.url + "/health", timeout=5).status_code == 200
    sender.join(timeout=60)
    assert not sender.is_alive()
    # Cut off after the first 64 KiB (plus what the socket buffers held), not read whole.
    assert outcome["sent"] < HUGE_HEADER_BYTES // 4, outcome
    assert "reply" not in outcome or outcome["reply"].startswith(b"HTTP/1.1 431"), outcome
    _served(target)


def _server_timer(server_port: int, client_port: int) -> int | None:
    """The kernel timer running on the server's end of one loopback connection
    (/proc/net/tcp's ``tr``: 0 none, 1 retransmit, 2 keepalive), None if not listed."""
    local = f"0100007F:{server_port:04X}"
    remote = f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[5].split(":")[0], 16)
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux's /proc/net/tcp")
def test_client_connections_are_probed_for_a_vanished_host(target: Target) -> None:
    """A client (or gateway) whose host vanished sends no FIN: its server decoded on for
    it, to max_tokens. Now an idle connection runs the kernel's keepalive timer
    (prefixgate/keepalive.py), which ends it once its peer stops answering."""
    with _connect(target) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        client_port = sock.getsockname()[1]
        # Keepalive once the answer is acknowledged (a retransmit timer until then);
        # before: no timer at all.
        wait_until(
            lambda: _server_timer(target.port, client_port) == 2,
            timeout_s=5,
            what="the server's keepalive timer on an idle connection",
        )


def test_too_many_headers_is_431(target: Target) -> None:
    sock = _connect(target)
    headers = b"".join(b"X-Filler-%d: v\r\n" % i for i in range(150))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]


@pytest.mark.parametrize(
    "partial",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # stops halfway through its head
        b"",  # connects and sends nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 500\r\n\r\n{"model": ',  # stops halfway through its body
    ],
    ids=["head", "nothing", "body"],
)
def test_a_stalled_client_is_cut_off_while_others_are_served(
    target: Target, partial: bytes
) -> None:
    stalled = _connect(target)
    stalled.sendall(partial)
    _served(target)
    reply = _read_until_closed(stalled)  # closed after the 1 s timeout (10 s: failure)
    if partial:
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout"
    else:
        assert reply == b""  # no request, no answer: just closed
    _served(target)


def _raw_body(target: Target, fields: str) -> bytes:
    """A completion body with ``fields`` written as raw JSON text (escapes kept as sent)."""
    return ('{"model": ' + json.dumps(target.model) + ', "max_tokens": 2, ' + fields + "}").encode()


def _post(target: Target, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(target.url + "/v1/completions", content=raw, headers=headers, timeout=30)


def test_deeply_nested_json_is_400(target: Target) -> None:
    for depth in (100, 5_000, 20_000):  # 20,000: past the recursion limit, under 50 KB
        nested = b"[" * depth + b"]" * depth
        raw = b'{"model": "%s", "prompt": "hi", "extra": %s}' % (target.model.encode(), nested)
        r = _post(target, raw)
        assert r.status_code == 400, (depth, r.text)
        assert r.json()["error"]["code"] == "invalid_json"
    _served(target)


@pytest.mark.parametrize(
    "fields",
    [
        '"prompt": "a \\ud800 b"',
        '"prompt": "\\udfff"',
        '"prompt": "hi", "cache_salt": "salt\\ud800"',
        '"prompt": "hi", "user": "\\ud83d"',
    ],
)
def test_lone_surrogates_are_400(target: Target, fields: str) -> None:
    raw = _raw_body(target, fields)
    r = _post(target, raw)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


def test_lone_surrogate_in_chat_content_is_400(target: Target) -> None:
    raw = _raw_body(target, '"messages": [{"role": "user", "content": "x\\ud800"}]')
    r = httpx.post(
        target.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] is None and "messages[0].content" in r.text


def test_a_valid_surrogate_pair_is_served(target: Target) -> None:
    r = _post(target, _raw_body(target, '"prompt": "\\ud83d\\ude00"'))
    assert r.status_code == 200, r.text


def test_request_id_is_capped_or_replaced(target: Target) -> None:
    body = target.completion()
    kept = httpx.post(target.url + "/v1/completions", json=body, headers={"x-request-id": "abc-1"})
    assert kept.headers["x-request-id"] == "abc-1"
    for bad in ("a" * 129, "has space", "caf\u00e9"):
        r = httpx.post(
            target.url + "/v1/completions",
            json=body,
            headers={b"x-request-id": bad.encode("utf-8")},
        )
        assert r.status_code == 200, r.text
        fresh = r.headers["x-request-id"]
        assert fresh != bad and 1 <= len(fresh) <= 128 and fresh.isascii() and fresh.isprintable()


def test_a_body_over_the_limit_is_413(target: Target) -> None:
    big = target.completion(prompt="x" * 60_000)
    r = httpx.post(target.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        raw = json.dumps(big).encode()
        for i in range(0, len(raw), 8192):
            yield raw[i : i + 8192]

    r = httpx.post(
        target.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    _served(target)


def test_malformed_http_is_an_openai_400(target: Target) -> None:
    sock = _connect(target)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_an_unexpected_exception_is_a_500_envelope_without_internals() -> None:
    """A server bug (here an app that raises) reaches the client as an OpenAI 500 that
    names nothing inside; the traceback stays in the log."""

    async def broken_app(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("secret internals: /etc/passwd")

    async def call() -> httpx.Response:
        app = Guard(broken_app, GuardConfig())
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "x"})

    r = asyncio.run(call())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert r.headers["x-request-id"]
