"""One tenant's flood and another tenant's chats, through a keyed gateway from each given
tree in front of vLLM:

    .venv/bin/python benchmarks/tenant_caps_vllm.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=.

The keys file gives the flood tenant ``max_parallel_requests: --cap`` (a tree that does
not know the field ignores it). ``--flooders`` clients of the flood tenant send chats of
``--flood-tokens`` tokens back to back (waiting ``Retry-After`` on a 429); after
``--warmup-s`` the chat tenant sends ``--chats`` streamed chats one at a time. Prints the
chat tenant's time to first token and to the last, and the flood's completed requests
per second over the chats' window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process


def body(text: str, tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def flooder(
    client: httpx.AsyncClient, tokens: int, done: list[float], stop: asyncio.Event
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        r = await client.post(
            "/v1/chat/completions",
            json=body(f"Flood {n}: list numbers.", tokens),
            headers={"authorization": "Bearer sk-flood"},
        )
        if r.status_code == 429:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        elif r.status_code == 200:
            done.append(time.monotonic())


async def chat(client: httpx.AsyncClient, n: int) -> tuple[float, float]:
    started = time.monotonic()
    first = None
    headers = {"authorization": "Bearer sk-chat"}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body(f"Chat {n}: say hi.", 16, True), headers=headers
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
    return first or 0.0, time.monotonic() - started


async def run(url: str, args: argparse.Namespace) -> str:
    done: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.flooders + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        floods = [
            asyncio.create_task(flooder(client, args.flood_tokens, done, stop))
            for _ in range(args.flooders)
        ]
        await asyncio.sleep(args.warmup_s)
        start = time.monotonic()
        times = [await chat(client, n) for n in range(args.chats)]
        end = time.monotonic()
        stop.set()
        await asyncio.gather(*floods)
    ttft = [t for t, _ in times]
    total = [t for _, t in times]
    flood_rate = sum(1 for t in done if start <= t <= end) / (end - start)
    return (
        f"chat TTFT p50 {statistics.median(ttft):.2f} s, max {max(ttft):.2f} s; "
        f"whole chat p50 {statistics.median(total):.2f} s; "
        f"flood {flood_rate:.2f} requests/s over the window"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--cap", type=int, default=4)
    p.add_argument("--flooders", type=int, default=32)
    p.add_argument("--flood-tokens", type=int, default=64)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--warmup-s", type=float, default=5.0)
    args = p.parse_args()
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "sk-flood": {"tenant": "flood", "max_parallel_requests": args.cap},
                "sk-chat": {"tenant": "chat"},
            }
        )
    )
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(
            tree, args.engine_url, f"/tmp/caps-{name}.log", flags=["--api-keys", str(keys)]
        )
        try:
            print(f"{name:7s} {asyncio.run(run(url, args))}", flush=True)
        finally:
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
