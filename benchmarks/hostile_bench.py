"""Hostile clients against a real gateway: what a huge header costs everyone else, and
what the HTTP guard costs every request.

    .venv/bin/python benchmarks/hostile_bench.py [--header-mb 128] [--calls 20000]

1. A stub backend and a gateway (each its own uvicorn process, as deployed). One client
   sends a request whose header is ``--header-mb`` MiB while another polls ``/health``:
   how long the attacker got to send before it was cut off, ``/health`` latency
   meanwhile (p50 and max), and the gateway's RSS before and after.
2. In-process, no network: the ``Guard`` middleware's own CPU per request (a POST with a
   small JSON body through ``Guard(app)`` vs the bare ASGI app, median of 7 interleaved
   rounds of ``--calls`` calls), and ``load_json_body`` vs ``json.loads`` on a chat body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefixgate.guard import Guard, GuardConfig  # noqa: E402
from prefixgate.json_body import load_json_body  # noqa: E402
from prefixgate.procs import free_port  # noqa: E402
from tests.gateway.conftest import start_gateway, start_stub  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def huge_header(header_mb: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        root = Path(tmp)
        stub = start_stub(root, "stub", "--model", "m")
        gw = start_gateway(root, "gw", [stub.url])
        try:
            return _attack(gw.url, gw.proc.pid, header_mb)
        finally:
            gw.stop()
            stub.stop()


def _attack(url: str, pid: int, header_mb: int) -> dict[str, Any]:
    import httpx

    port = int(url.rsplit(":", 1)[1])
    with httpx.Client() as client:
        for _ in range(50):  # warm: the client and the gateway's first requests
            client.get(url + "/health")
        rss_before = rss_mb(pid)
        result: dict[str, Any] = {}
        started = threading.Event()

        def attacker() -> None:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
            started.set()
            chunk, sent, t0 = b"a" * (1 << 20), 0, time.perf_counter()
            try:
                while sent < header_mb << 20:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError as exc:
                result["cut_off"] = type(exc).__name__
            result["sent_mb"] = sent / (1 << 20)
            result["attack_s"] = time.perf_counter() - t0
            sock.close()

        thread = threading.Thread(target=attacker)
        thread.start()
        started.wait()
        latencies: list[float] = []
        failures: list[str] = []
        while thread.is_alive() or len(latencies) < 20:
            t0 = time.perf_counter()
            try:
                ok = client.get(url + "/health", timeout=60).status_code == 200
            except httpx.HTTPError as exc:
                ok, failures = False, [*failures, type(exc).__name__]
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                failures.append(f"/health failed after {time.perf_counter() - t0:.1f} s")
        thread.join()
        result["health_failures"] = failures
        result["health_p50_ms"] = statistics.median(latencies) * 1e3
        result["health_max_ms"] = max(latencies) * 1e3
        result["health_calls"] = len(latencies)
        result["rss_before_mb"] = rss_before
        result["rss_after_mb"] = rss_mb(pid)
    return result


async def _bare(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def guard_cost(calls: int) -> dict[str, float]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 200}]})
    raw = body.encode()
    headers = [
        (b"host", b"x"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"authorization", b"Bearer sk-x"),
        (b"x-request-id", b"req-123"),
    ]
    guarded = Guard(_bare, GuardConfig(require_json=True))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Any) -> None:
        pass

    async def rounds(app: Any) -> float:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
        t0 = time.perf_counter()
        for _ in range(calls):
            await app({**scope, "headers": headers}, receive, send)
        return (time.perf_counter() - t0) / calls

    bare_s: list[float] = []
    guard_s: list[float] = []
    for _ in range(7):  # interleaved, so that load from elsewhere hits both alike
        bare_s.append(asyncio.run(rounds(_bare)))
        guard_s.append(asyncio.run(rounds(guarded)))
    bare, with_guard = statistics.median(bare_s), statistics.median(guard_s)

    def per_call(fn: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(raw)
        return (time.perf_counter() - t0) / calls

    loads_s: list[float] = []
    checked_s: list[float] = []
    for _ in range(7):
        loads_s.append(per_call(json.loads))
        checked_s.append(per_call(load_json_body))
    loads, checked = statistics.median(loads_s), statistics.median(checked_s)
    return {
        "bare_us": bare * 1e6,
        "guard_us": with_guard * 1e6,
        "json_loads_us": loads * 1e6,
        "load_json_body_us": checked * 1e6,
        "body_bytes": len(raw),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--header-mb", type=int, default=128)
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    free_port()  # (fails early if no port can be bound)
    attack = huge_header(args.header_mb)
    print(f"{args.header_mb} MiB header:", json.dumps(attack, indent=1))
    cost = guard_cost(args.calls)
    print("per request, in process:", json.dumps(cost, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
