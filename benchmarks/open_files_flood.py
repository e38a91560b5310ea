"""A burst of streams larger than the cluster's open-file limit allows, through the
official openai client.

    .venv/bin/python benchmarks/open_files_flood.py --soft 1024 --hard 20000 \\
        --clients 1200 --retries 0 2 [--out FILE]

Starts ``prefixgate up --model sim --replicas 2`` with the given soft and hard
RLIMIT_NOFILE (its Redis, replicas and gateway inherit them), then, for each
``--retries`` value, sends ``--clients`` streamed chat requests at once (max_tokens 100)
and counts how each ended: served, or the error the client got. Reported per burst:
the outcomes, the wall time, and the replicas the gateway still calls healthy.
Run it from a ``git worktree`` of an older revision to compare (it runs the cluster
from the current directory's tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

from loadtest.cluster import launch_up, wait_ready


async def stream_once(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        stream = await client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": f"hello {i} " * 50}],
            max_tokens=100,
            stream=True,
        )
        async for _ in stream:
            pass
    except openai.APIStatusError as exc:
        return f"{exc.status_code} {exc.code}"
    except openai.APIConnectionError as exc:
        return f"connection error ({type(exc.__cause__).__name__})"
    return "served"


async def burst(base_url: str, clients: int, retries: int) -> Counter[str]:
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="-", max_retries=retries, timeout=120
    ) as client:
        return Counter(await asyncio.gather(*(stream_once(client, i) for i in range(clients))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soft", type=int, required=True)
    parser.add_argument("--hard", type=int, required=True)
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--retries", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.soft, args.hard))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        cluster = launch_up(run_dir, "--model", "sim", "--replicas", "2", preexec_fn=limit)
        gateway = cluster.base_url.removesuffix("/v1")
        try:
            wait_ready(cluster, 120)
            for retries in args.retries:
                started = time.perf_counter()
                outcomes = asyncio.run(burst(cluster.base_url, args.clients, retries))
                wall = time.perf_counter() - started
                ready = httpx.get(f"{gateway}/ready", timeout=10).json()
                row = {
                    "soft": args.soft,
                    "hard": args.hard,
                    "clients": args.clients,
                    "retries": retries,
                    "wall_s": round(wall, 1),
                    "outcomes": dict(outcomes),
                    "healthy_replicas_after": len(ready.get("healthy_replicas", [])),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            gateway_log = (run_dir / "gateway.log").read_text(errors="replace")
            limit_line = [line for line in gateway_log.splitlines() if "open files:" in line]
            print(limit_line[0] if limit_line else "gateway: no open-files line (older tree)")
        finally:
            cluster.stop()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
