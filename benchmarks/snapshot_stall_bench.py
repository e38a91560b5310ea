"""Token-stream stalls on a replica while its publisher rewrites a large snapshot.

    .venv/bin/python benchmarks/snapshot_stall_bench.py [--blocks 120000] [--streams 2]

Starts a redis-server and one sim replica (``--num-blocks`` = ``--blocks``) publishing to
it, fills the cache with distinct 8,000-token prompts (``/v1/completions`` with token
ids, 16 at a time) until it holds ``--blocks`` blocks, then streams ``--streams`` chat
answers of 1,500 tokens one after the other and reports the gaps between the chunks
that arrive: the median, p99, the largest, and how many exceed 50 ms. The publisher
rewrites the snapshot every 5 s while the cache changes (each stream commits blocks), so
a stream of ~11 s sees two rewrites. Run it from the tree to measure (its directory is
the one ``python -m prefixgate`` imports).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok

PROMPT = 8_000  # tokens a fill prompt has: 500 blocks of 16


async def fill(base: str, prompts: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        slots = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            ids = [(i * PROMPT + j) % 40_000 + 10 for j in range(PROMPT)]
            ids[0] = 1_000 + i  # a distinct first token: a chain of its own
            async with slots:
                body = {"model": "sim", "prompt": ids, "max_tokens": 1}
                (await client.post(f"{base}/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(i) for i in range(prompts)))


async def gaps(base: str, streams: int) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for r in range(streams):
            body = {
                "model": "sim",
                "messages": [{"role": "user", "content": f"go {r}"}],
                "max_tokens": 1_500,
                "ignore_eos": True,
                "stream": True,
            }
            last = None
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                async for _chunk in resp.aiter_bytes():
                    now = time.perf_counter()
                    if last is not None:
                        out.append(now - last)
                    last = now
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=120_000)
    parser.add_argument("--streams", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        redis_port, port = free_port(), free_port()
        redis = start_redis(redis_port, Path(workdir) / "redis")
        replica = subprocess.Popen(
            [
                *(sys.executable, "-m", "prefixgate", "replica", "--model", "sim"),
                *("--port", str(port), "--num-blocks", str(args.blocks)),
                *("--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--log-level", "warning"),
            ]
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(f"{base}/health", 60, [replica])
            t0 = time.perf_counter()
            asyncio.run(fill(base, args.blocks * 16 // PROMPT))
            stats = httpx.get(f"{base}/cache/stats").json()
            print(
                f"filled in {time.perf_counter() - t0:.0f} s: {stats['cached_blocks']:,} blocks"
                f" cached, {stats['publisher']['snapshots_written']} snapshots written"
            )
            g = asyncio.run(gaps(base, args.streams))
            after = httpx.get(f"{base}/cache/stats").json()["publisher"]["snapshots_written"]
            print(
                f"{len(g)} gaps between chunks: p50 {g[len(g) // 2] * 1000:.1f} ms,"
                f" p99 {g[int(len(g) * 0.99)] * 1000:.1f} ms, max {g[-1] * 1000:.1f} ms,"
                f" over 50 ms: {sum(x > 0.05 for x in g)};"
                f" snapshots written meanwhile: {after - stats['publisher']['snapshots_written']}"
            )
        finally:
            stop_process(replica)
            stop_process(redis)


if __name__ == "__main__":
    main()
