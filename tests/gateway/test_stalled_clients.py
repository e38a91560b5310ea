"""A client that stops reading its answer (prefixgate/http_limits.py, ``send_timeout_s``).

Before, a stream nobody read held its connection through the gateway for as long as the
client lived: the gateway counted it in its replica's load for ever, and the replica
decoded to ``max_tokens`` for nobody. Now the connection is dropped once the client has
taken nothing for ``--send-timeout-s``, and the drop cancels the work upstream. A client
that reads slowly, but reads, keeps its stream.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import Server, start_gateway, start_replica

pytestmark = pytest.mark.timeout(180)

SEND_TIMEOUT_S = 1.0
MAX_TOKENS = 100_000
# A sim GPU that costs nothing: tokens as fast as the replica's CPU makes them, so the
# socket buffers in between (megabytes: a paused stream is one that overflowed them)
# fill in seconds, where a GPU's 100 tokens a second take minutes.
FREE_STEPS = [
    f"--sim-{name}=0"
    for name in ("step-overhead-s", "weights-s", "token-s", "attn-pair-s", "kv-read-s")
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    root = tmp_path_factory.mktemp("stalled")
    replica = start_replica(root, "replica", "--model", "sim", *FREE_STEPS)
    # The replica keeps its default (60 s): the gateway's own timeout must do the work.
    gateway = start_gateway(root, "gateway", [replica.url], "--send-timeout-s", str(SEND_TIMEOUT_S))
    yield gateway, replica
    gateway.stop()
    replica.stop()


def _open_stream(url: str, *, rcvbuf: int = 4096) -> socket.socket:
    """A streaming chat for ``MAX_TOKENS`` tokens on a raw socket with a small receive
    buffer, its status line read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    body = json.dumps(
        {
            "model": "sim",
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me a long story"}],
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    first = sock.recv(64)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock


def _in_flight(gateway: Server) -> int:
    stats = httpx.get(gateway.url + "/router/stats", timeout=10).json()
    return sum(int(r["in_flight"]) for r in stats["replicas"].values())


def _running(replica: Server) -> float:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("prefixgate:num_requests_running "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no running gauge in the replica's metrics")


def _until(check: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.1)


def _read_to_end(sock: socket.socket) -> bytes:
    """What arrives until the server's close or reset."""
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_a_stream_nobody_reads_is_dropped_and_its_work_cancelled(
    cluster: tuple[Server, Server],
) -> None:
    gateway, replica = cluster
    sock = _open_stream(gateway.url)
    try:
        _until(lambda: _in_flight(gateway) == 1, 30, "the stream counted in flight")
        # Nothing more is read: the buffers fill, and the gateway gives up on the client.
        _until(lambda: _in_flight(gateway) == 0, 60, "the unread stream leaves the load")
        _until(lambda: _running(replica) == 0, 30, "the replica stops decoding it")
        rest = _read_to_end(sock)  # what was buffered, then the reset
        assert b"data: [DONE]" not in rest  # cut off, not finished
    finally:
        sock.close()
    # Others are served meanwhile and after.
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert "connection(s) dropped: the client read none of its answer" in gateway.log_text()


def test_a_slow_reader_keeps_its_stream(cluster: tuple[Server, Server]) -> None:
    gateway, _replica = cluster
    sock = _open_stream(gateway.url)
    try:
        _until(lambda: _in_flight(gateway) == 1, 30, "the stream counted in flight")
        received = 0
        started = time.monotonic()
        # Well under the rate the stream is produced at, so the buffers stay full, but
        # something is taken within every timeout.
        while time.monotonic() - started < 6 * SEND_TIMEOUT_S:
            chunk = sock.recv(8192)
            assert chunk, f"the gateway closed a stream being read ({received} bytes in)"
            received += len(chunk)
            time.sleep(SEND_TIMEOUT_S / 4)
        assert _in_flight(gateway) == 1
    finally:
        sock.close()
    _until(lambda: _in_flight(gateway) == 0, 30, "the closed stream leaves the load")


def test_only_the_gateway_cuts_stalled_clients_by_default() -> None:
    """A replica's client is a gateway, which stops reading while its own client reads
    slowly: with the gateway's 256 KiB of upstream buffer, a client taking 1 KB a second
    left the replica nothing taken for minutes, and a replica with the gateway's timeout
    cut a stream the gateway was still relaying (measured at 2 s: cut 16 s into a client
    reading 7 KB/s)."""
    from gateway.cli import build_parser as gateway_parser
    from prefixgate.http_limits import http_limits_from_args
    from replica.cli import build_parser as replica_parser

    replica = http_limits_from_args(replica_parser().parse_args(["--model", "sim"]))
    gateway = http_limits_from_args(gateway_parser().parse_args([]))
    assert replica.send_timeout_s is None and gateway.send_timeout_s == 60.0
