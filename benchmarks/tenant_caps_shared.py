"""A capped tenant's flood through two gateways sharing a Redis, in front of one vLLM:
how many of its requests does the engine hold at once?

    .venv/bin/python benchmarks/tenant_caps_shared.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=.

The keys file gives the tenant ``max_parallel_requests: --cap``. ``--flooders`` clients
(half at each gateway) send chats back to back for ``--seconds``, waiting
``Retry-After`` on a 429, while the engine's ``vllm:num_requests_running`` and
``_waiting`` are read every 0.1 s. Prints the largest and the mean of their sum, and the
requests answered, per tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from passed_headers_vllm import gateway_from_tree
from tenant_caps_vllm import body

from prefixgate.procs import free_port, start_redis, stop_process

IN_ENGINE = re.compile(rb"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.]+)$", re.M)


async def flood(url: str, tokens: int, until: float, answered: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        n = 0
        while time.monotonic() < until:
            n += 1
            r = await client.post(
                "/v1/chat/completions",
                json=body(f"Flood {n}: list numbers.", tokens),
                headers={"authorization": "Bearer sk-flood"},
            )
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            elif r.status_code == 200:
                answered.append(1)


async def watch(
    engine: str, gateways: list[str], until: float, seen: list[float], admitted: list[int]
) -> None:
    """Every 0.1 s: the engine's running and waiting requests (its gauges lag a step),
    and the gateways' own counts of the tenant's requests (their /router/stats; a tree
    without them counts none)."""
    admin = {"authorization": "Bearer sk-ops"}
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < until:
            metrics = (await client.get(engine + "/metrics")).content
            seen.append(sum(float(v) for v in IN_ENGINE.findall(metrics)))
            stats = await asyncio.gather(
                *(client.get(url + "/router/stats", headers=admin) for url in gateways)
            )
            admitted.append(
                sum(s.json().get("tenant_caps", {}).get("flood", {}).get("here", 0) for s in stats)
            )
            await asyncio.sleep(0.1)  # the sampling period


async def run(gateways: list[str], engine: str, args: argparse.Namespace) -> str:
    until = time.monotonic() + args.seconds
    answered: list[int] = []
    seen: list[float] = []
    admitted: list[int] = []
    clients = [
        flood(gateways[i % len(gateways)], args.tokens, until, answered)
        for i in range(args.flooders)
    ]
    await asyncio.gather(watch(engine, gateways, until, seen, admitted), *clients)
    settled = seen[len(seen) // 5 :]  # after the first fifth: the caps have synced
    counted = admitted[len(admitted) // 5 :]
    return (
        f"the tenant's requests in the engine: max {max(settled):.0f}, "
        f"mean {statistics.mean(settled):.2f} (cap {args.cap}); as the gateways count them: "
        f"max {max(counted)}; {len(answered)} answered"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--cap", type=int, default=4)
    p.add_argument("--flooders", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    keys = work / "keys.json"
    flood_key = {"tenant": "flood", "max_parallel_requests": args.cap}
    keys.write_text(json.dumps({"sk-flood": flood_key, "sk-ops": {"tenant": "ops", "admin": True}}))
    port = free_port()
    redis = start_redis(port, work)
    try:
        for spec in args.tree:
            name, _, tree = spec.partition("=")
            flags = ["--api-keys", str(keys), "--redis-url", f"redis://127.0.0.1:{port}/0"]
            started = [
                gateway_from_tree(tree, args.engine_url, f"/tmp/shared-{name}-{i}.log", flags=flags)
                for i in range(2)
            ]
            try:
                line = asyncio.run(run([url for url, _ in started], args.engine_url, args))
                print(f"{name:7s} {line}", flush=True)
            finally:
                for _, proc in started:
                    stop_process(proc, grace_s=5)
    finally:
        stop_process(redis)


if __name__ == "__main__":
    main()
