"""What one very long prompt costs the other clients: the longest gap in a token stream
while it is read, and the memory it takes.

    .venv/bin/python benchmarks/large_prompt_bench.py [--mib 0.4 2 15] [--out FILE]

Starts ``prefixgate up --model sim --replicas 1`` from the current directory's tree (run
it from a ``git worktree`` to measure an older one). First, per size, one chat whose
prompt is that many MiB of lorem ipsum (max_tokens 1; from 0.4 MiB on, over the sim
profile's context of 131,072 tokens, so refused) through the gateway alone, with the
resident memory of the gateway and the replica before, at peak while it ran (sampled
every 50 ms) and after. Then, per size,
against the replica and through the gateway: a streamed chat of 3,000 tokens runs, and
1 s in, the same long chat is sent; reported are its status and time, and the stream's
longest gap between chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from loadtest.cluster import launch_up, wait_ready


def lorem(mib: float) -> str:
    chars = int(mib * 1024 * 1024)
    return ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]


async def stall(base_url: str, mib: float) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        return await _stall(client, base_url, mib)


async def _stall(client: openai.AsyncOpenAI, base_url: str, mib: float) -> dict[str, Any]:
    gaps: list[float] = []

    async def stream() -> None:
        chunks = await client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "count"}],
            max_tokens=3000,
            stream=True,
        )
        last = time.perf_counter()
        async for _ in chunks:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    streaming = asyncio.create_task(stream())
    await asyncio.sleep(1.0)
    body = {"model": "sim", "messages": [{"role": "user", "content": lorem(mib)}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        answer = await http.post(f"{base_url}/chat/completions", json=body)
        took = time.perf_counter() - started
    await streaming
    return {
        "status": answer.status_code,
        "request_s": round(took, 2),
        "stream_longest_gap_ms": round(max(gaps[5:]) * 1000),
    }


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def memory(base_url: str, mib: float, pids: dict[str, int]) -> dict[str, Any]:
    base = {name: rss_mib(pid) for name, pid in pids.items()}
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss_mib(pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    body = {"model": "sim", "messages": [{"role": "user", "content": lorem(mib)}], "max_tokens": 1}
    started = time.perf_counter()
    answer = httpx.post(f"{base_url}/chat/completions", json=body, timeout=600)
    took = time.perf_counter() - started
    done.set()
    sampler.join()
    return {
        "status": answer.status_code,
        "request_s": round(took, 2),
        "rss_before_mib": base,
        "rss_peak_mib": peak,
        "rss_after_mib": {name: rss_mib(pid) for name, pid in pids.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[0.4, 2.0, 15.0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = launch_up(Path(tmp), "--model", "sim", "--replicas", "1")
        try:
            wait_ready(cluster, 120)
            (replica_url,) = cluster.replica_urls().values()
            targets = {"replica": replica_url + "/v1", "gateway": cluster.base_url}
            pids = {name: pid for name, pid in cluster.pids().items() if name != "redis"}
            for mib in args.mib:  # first: memory a process keeps says nothing of the next
                row = {"mib": mib, "memory": memory(cluster.base_url, mib, pids)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            for mib in args.mib:
                for target, url in targets.items():
                    row = {"mib": mib, "through": target, **asyncio.run(stall(url, mib))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            cluster.stop()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
