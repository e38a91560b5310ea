"""Putting a cluster of vLLM engines to sleep and waking it, as a reinforcement-learning
loop does between rollouts, through a gateway from each given tree:

    .venv/bin/python benchmarks/engine_control_vllm.py --engine-url http://127.0.0.1:8100 \
        --engine-url http://127.0.0.1:8101 --tree before=DIR --tree after=.

Engines in development mode (``VLLM_SERVER_DEV_MODE=1``). Per tree, ``--rounds`` times:
``POST /sleep?level=1`` to the gateway (where it answers 404, to each engine, as the loop
must do then); at once ``--requests`` chats, one at a time, each given
``--client-timeout-s`` (a straggler of the rollout); then ``POST /wake_up`` likewise and at
once the same chats (the next rollout's first). Prints, for each phase, the chats answered,
refused (an error status) and given up on, and the longest a chat took.
"""

from __future__ import annotations

import argparse
import time

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process


def control(gateway: str, engines: list[str], path: str) -> str:
    """``path`` through the gateway; where it answers 404, at each engine."""
    r = httpx.post(gateway + path, timeout=120)
    if r.status_code != 404:
        return f"gateway {r.status_code}"
    for engine in engines:
        httpx.post(engine + path, timeout=120).raise_for_status()
    return "gateway 404, each engine 200"


def chats(gateway: str, n: int, timeout: float) -> dict[str, float]:
    seen = {"answered": 0, "refused": 0, "gave up": 0, "longest s": 0.0}
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Round chat {i}: say hi."}],
            "max_tokens": 4,
        }
        started = time.monotonic()
        try:
            r = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=timeout)
            seen["answered" if r.status_code == 200 else "refused"] += 1
        except httpx.TimeoutException:
            seen["gave up"] += 1
        seen["longest s"] = max(seen["longest s"], round(time.monotonic() - started, 2))
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", action="append", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--client-timeout-s", type=float, default=10.0)
    args = p.parse_args()
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(tree, args.engine_url, f"/tmp/control-{name}.log")
        try:
            for round_ in range(args.rounds):
                how = control(url, args.engine_url, "/sleep?level=1")
                asleep = chats(url, args.requests, args.client_timeout_s)
                woke = control(url, args.engine_url, "/wake_up")
                awake = chats(url, args.requests, args.client_timeout_s)
                print(
                    f"{name:7s} round {round_ + 1}: sleep ({how}): {asleep}; "
                    f"wake ({woke}): {awake}",
                    flush=True,
                )
        finally:
            for engine in args.engine_url:  # leave them awake whatever happened
                httpx.post(engine + "/wake_up", timeout=120)
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
