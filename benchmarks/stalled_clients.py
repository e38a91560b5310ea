"""Clients that stop reading their streams: how long the gateway counts them in its
replicas' load, and how long the replicas decode for them.

    .venv/bin/python benchmarks/stalled_clients.py [--clients 8] [--max-tokens 100000]
        [--window-s 300] [--out FILE]

Starts ``prefixgate up --model sim --replicas 2`` (default profile and flags) from the
current directory's tree (run it from a ``git worktree`` to measure an older one), then
opens ``--clients`` streamed chats of ``--max-tokens`` tokens on raw sockets with the
system's default buffers, reads their status lines and nothing more: a client process
that is alive and stuck, or an SDK stream left unread. Every 5 s for ``--window-s`` it
samples the gateway's in-flight count (``/router/stats``) and the replicas' running
requests (``/metrics``), and reports when each reached 0 (null: not within the window).
A sim replica decodes ~130 tokens a second per stream, about 30 KB of events, so the
socket buffers between the replica and the client (megabytes) take a few minutes to fill
before a stream is paused at all.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.cluster import Cluster, launch_up, wait_ready


def open_stream(gateway: str, max_tokens: int, i: int) -> socket.socket:
    host, port = gateway.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    body = json.dumps(
        {
            "model": "sim",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"tell me a long story, number {i}"}],
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    status = sock.recv(32)
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stream {i} was not served: {status!r}")
    return sock


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
        return body


def sample(cluster: Cluster, gateway: str) -> tuple[int, int]:
    stats = json.loads(_get(gateway + "/router/stats"))
    in_flight = sum(int(r["in_flight"]) for r in stats["replicas"].values())
    running = 0
    for url in cluster.replica_urls().values():
        for line in _get(url + "/metrics").decode().splitlines():
            if line.startswith("prefixgate:num_requests_running "):
                running += int(float(line.rsplit(" ", 1)[1]))
    return in_flight, running


def run(clients: int, max_tokens: int, window_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = launch_up(Path(tmp), "--model", "sim", "--replicas", "2")
        socks: list[socket.socket] = []
        try:
            wait_ready(cluster, 120)
            gateway = cluster.base_url.removesuffix("/v1")
            socks = [open_stream(gateway, max_tokens, i) for i in range(clients)]
            started = time.monotonic()
            timeline = []
            released_at = idle_at = None
            while (elapsed := time.monotonic() - started) < window_s:
                in_flight, running = sample(cluster, gateway)
                timeline.append(
                    {"t_s": round(elapsed, 1), "in_flight": in_flight, "running": running}
                )
                if released_at is None and in_flight == 0:
                    released_at = round(elapsed, 1)
                if idle_at is None and running == 0:
                    idle_at = round(elapsed, 1)
                if released_at is not None and idle_at is not None:
                    break
                time.sleep(5)
        finally:
            for sock in socks:
                sock.close()
            cluster.stop()
    return {
        "clients": clients,
        "max_tokens": max_tokens,
        "window_s": window_s,
        "gateway_released_s": released_at,
        "replicas_idle_s": idle_at,
        "timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--window-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    record = run(args.clients, args.max_tokens, args.window_s)
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    summary = {k: v for k, v in record.items() if k != "timeline"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
