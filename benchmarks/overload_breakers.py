"""More requests than the replicas admit: do they stay in service, and does every admitted
request find room?

    .venv/bin/python benchmarks/overload_breakers.py [--clients 48] [--duration-s 30]
        [--out FILE]

Starts two sim replicas, each running at most 4 requests with 4 more waiting
(``--max-running 4 --max-waiting 4``; more get a 503 ``queue_full`` with Retry-After),
and one gateway in front of them (static ``--replica``; no Redis). ``--clients`` clients
send streamed chats of 128 tokens back to back for ``--duration-s``, each retrying
nothing: every answer counts as it came. Every 0.25 s the gateway's ``/router/stats`` is
sampled for each replica's breaker state and in-flight count.

Reported: the answers by status and error code, the share of samples in which each
replica's breaker was not ``closed``, the mean number of requests the gateway had on the
replicas (at most 16 can be admitted at once), and the chats served per second. Run it
from a ``git worktree`` to measure an older tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from prefixgate.procs import free_port, stop_process, wait_http_ok

BODY = {"model": "sim", "max_tokens": 128, "ignore_eos": True, "stream": True}


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


async def client(
    http: httpx.AsyncClient, gateway: str, i: int, stop: asyncio.Event, outcomes: Counter[str]
) -> None:
    turn = 0
    while not stop.is_set():
        turn += 1
        body = {**BODY, "messages": [{"role": "user", "content": f"client {i} turn {turn}"}]}
        async with http.stream("POST", gateway + "/v1/chat/completions", json=body) as resp:
            data = await resp.aread()
        code = ""
        if resp.status_code != 200:
            try:
                code = json.loads(data)["error"]["code"] or ""
            except (ValueError, KeyError, TypeError):
                code = "?"
        outcomes[f"{resp.status_code} {code}".strip()] += 1


async def drive(gateway: str, clients: int, duration_s: float) -> dict[str, Any]:
    stop = asyncio.Event()
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=clients + 4)
    ) as http:
        tasks = [
            asyncio.create_task(client(http, gateway, i, stop, outcomes)) for i in range(clients)
        ]
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            stats = (await http.get(gateway + "/router/stats")).json()
            samples.append(
                {rid: (r["breaker"], r["in_flight"]) for rid, r in stats["replicas"].items()}
            )
            await asyncio.sleep(0.25)  # the sampling period
        stop.set()
        await asyncio.gather(*tasks)
    n = len(samples)
    replicas = sorted(samples[0])
    return {
        "outcomes": dict(outcomes.most_common()),
        "served_per_s": round(outcomes["200"] / duration_s, 2),
        "breaker_not_closed_share": {
            rid: round(sum(s[rid][0] != "closed" for s in samples) / n, 3) for rid in replicas
        },
        "mean_in_flight": round(sum(s[rid][1] for s in samples for rid in replicas) / n, 2),
        "samples": n,
    }


def run(
    clients: int, duration_s: float, limits: list[tuple[int, int]], logs: Path
) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for i, (running, waiting) in enumerate(limits):
            port = free_port()
            cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", "sim"]
            cmd += ["--max-running", str(running), "--max-waiting", str(waiting)]
            procs.append(spawn([*cmd, "--port", str(port)], logs / f"replica-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http_ok(url + "/health", 60, procs=procs)
        port = free_port()
        cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port)]
        for url in urls:
            cmd += ["--replica", url]
        procs.append(spawn(cmd, logs / "gateway.log"))
        gateway = f"http://127.0.0.1:{port}"
        wait_http_ok(gateway + "/ready", 60, procs=procs)
        result = asyncio.run(drive(gateway, clients, duration_s))
        named = {
            url.removeprefix("http://"): f"{r}:{w}"
            for url, (r, w) in zip(urls, limits, strict=True)
        }
        return {"clients": clients, "duration_s": duration_s, "limits": named, **result}
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument(
        "--limits",
        nargs=2,
        default=["4:4", "4:4"],
        metavar="RUNNING:WAITING",
        help="each replica's --max-running and --max-waiting",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    limits = [(int(a), int(b)) for a, b in (x.split(":") for x in args.limits)]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.clients, args.duration_s, limits, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
