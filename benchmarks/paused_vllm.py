"""A vLLM asleep behind a gateway: do requests wait for it? Two engines in development
mode (``VLLM_SERVER_DEV_MODE=1``, which serves ``/sleep``, ``/pause`` and
``/is_paused``), a gateway from each given tree in front of both:

    .venv/bin/python benchmarks/paused_vllm.py --engine-url http://127.0.0.1:8100 \
        --engine-url http://127.0.0.1:8101 --tree before=DIR --tree after=.

Per tree: the first engine is put to sleep (``/sleep?level=1``; ``--pause`` uses
``/pause`` instead); after ``--settle-s`` (the gateway's probe period is 2 s),
``--requests`` chats, one at a time, each its own conversation, each given
``--client-timeout-s``; then the engine wakes. Prints how many were answered, how many
the client gave up on, the slowest answer and the wall time.
"""

from __future__ import annotations

import argparse
import time

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process


def run(url: str, requests: int, timeout: float) -> str:
    answered = gave_up = 0
    slowest = 0.0
    started = time.monotonic()
    for n in range(requests):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Name a number bigger than {n}."}],
            "max_tokens": 8,
            "prompt_cache_key": f"conversation-{n}",
        }
        t0 = time.monotonic()
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        except httpx.TimeoutException:
            gave_up += 1
            continue
        if r.status_code == 200:
            answered += 1
            slowest = max(slowest, time.monotonic() - t0)
    wall = time.monotonic() - started
    return (
        f"{answered}/{requests} answered, {gave_up} given up after {timeout:.0f} s; "
        f"slowest answer {slowest:.2f} s; wall {wall:.1f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", action="append", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--client-timeout-s", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--pause", action="store_true", help="/pause and /resume, not /sleep")
    args = p.parse_args()
    asleep = args.engine_url[0]
    stop, wake = ("/pause", "/resume") if args.pause else ("/sleep?level=1", "/wake_up")
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(tree, args.engine_url, f"/tmp/paused-{name}.log")
        try:
            httpx.post(asleep + stop, timeout=60).raise_for_status()
            time.sleep(args.settle_s)  # the gateway's probes run on their own period
            print(f"{name:7s} {run(url, args.requests, args.client_timeout_s)}", flush=True)
        finally:
            httpx.post(asleep + wake, timeout=60).raise_for_status()
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
