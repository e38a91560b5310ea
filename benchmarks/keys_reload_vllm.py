"""Revoking a leaked key while a team streams chats, through a keyed gateway from each
given tree in front of vLLM:

    .venv/bin/python benchmarks/keys_reload_vllm.py --engine-url http://127.0.0.1:8100 \
        --tree before=DIR --tree after=.

The keys file holds ``sk-leaked`` and ``sk-team``. ``--clients`` clients of the team
stream chats of ``--tokens`` tokens back to back. After ``--warmup-s`` the file is
replaced (a rename) by one without ``sk-leaked``, and ``sk-leaked`` is tried every 0.1 s:
the seconds until its first 401. A tree that does not read the file again is given
``--wait-s`` to do so; then it is restarted on the same port (SIGTERM, then a new
process), as revoking a key there needs. Prints, per tree, the seconds to the first 401
(and how: the file read, or the restart), and the team's chats: completed, failed (a
connection refused or cut, a non-200), and the longest gap between two chats finishing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import free_port, stop_process


def write_keys(path: Path, keys: dict[str, object]) -> None:
    scratch = path.with_suffix(".new")
    scratch.write_text(json.dumps(keys))
    os.replace(scratch, path)


async def team(
    url: str, tokens: int, stop: asyncio.Event, done: list[float], failed: list[str]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to fifty."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": "Bearer sk-team"}
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            try:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    text = (await r.aread()).decode(errors="replace")
                if r.status_code == 200 and text.rstrip().endswith("data: [DONE]"):
                    done.append(time.monotonic())
                else:
                    failed.append(f"{r.status_code}")
            except httpx.HTTPError as exc:
                failed.append(type(exc).__name__)
                await asyncio.sleep(0.1)  # the gateway is down: try again shortly


async def leaked_status(url: str) -> int | None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer sk-leaked"},
            )
        return r.status_code
    except httpx.HTTPError:
        return None  # down (restarting)


def run_tree(name: str, tree: str, args: argparse.Namespace, work: Path) -> str:
    keys = work / f"keys-{name}.json"
    write_keys(keys, {"sk-leaked": {"tenant": "intern"}, "sk-team": {"tenant": "team"}})
    port = free_port()
    flags = ["--api-keys", str(keys)]
    log = f"/tmp/keys-reload-{name}.log"
    url, proc = gateway_from_tree(tree, args.engine_url, log, flags=flags, port=port)
    procs = [proc]

    async def scenario() -> str:
        stop = asyncio.Event()
        done: list[float] = []
        failed: list[str] = []
        clients = [
            asyncio.create_task(team(url, args.tokens, stop, done, failed))
            for _ in range(args.clients)
        ]
        await asyncio.sleep(args.warmup_s)  # the team's chats under way
        assert await leaked_status(url) == 200
        write_keys(keys, {"sk-team": {"tenant": "team"}})
        revoked_at = time.monotonic()
        how = "the file read again"
        restarted = False
        while await leaked_status(url) != 401:
            waited = time.monotonic() - revoked_at
            if not restarted and waited > args.wait_s:
                how = f"not read in {args.wait_s:.0f} s: restarted"
                restarted = True
                await asyncio.to_thread(stop_process, procs[0], 10)
                _, new = await asyncio.to_thread(
                    gateway_from_tree, tree, args.engine_url, log, None, flags, port
                )
                procs[0] = new
            else:
                await asyncio.sleep(0.1)  # the next try of the leaked key
        revoked = time.monotonic() - revoked_at
        await asyncio.sleep(args.after_s)  # the team goes on
        stop.set()
        await asyncio.gather(*clients)
        ends = sorted(done)
        gap = max((b - a for a, b in itertools.pairwise(ends)), default=0.0)
        kinds = ", ".join(f"{k} {failed.count(k)}" for k in sorted(set(failed))) or "none"
        return (
            f"leaked key refused after {revoked:.1f} s ({how}); team: {len(done)} chats "
            f"completed, {len(failed)} failed ({kinds}), longest gap between two {gap:.1f} s"
        )

    try:
        return asyncio.run(scenario())
    finally:
        stop_process(procs[0], grace_s=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--wait-s", type=float, default=15.0)
    p.add_argument("--after-s", type=float, default=5.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        print(f"{name:7s} {run_tree(name, tree, args, work)}", flush=True)


if __name__ == "__main__":
    main()
