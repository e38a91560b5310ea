"""A replica whose host vanishes mid-stream: how long the streams on it take to end.

    sudo .venv/bin/python benchmarks/vanished_replica.py [--streams 4] [--window-s 120]
        [--out FILE]

Linux, as root (network namespaces). A sim replica runs in a network namespace of its
own, joined to this host by a veth pair, as a replica on another node; the gateway runs
here with that replica alone (static ``--replica``). Streams of 20,000 tokens go through
the gateway; once each has received 20 chunks, the replica's end of the link is set down,
so its packets are dropped with neither FIN nor RST: a node powered off, or a partition.
Reported per stream: seconds from the cut to the stream's end (an SSE error event or a
closed connection; null: not within ``--window-s``), and how it ended.

Run it from a ``git worktree`` to measure an older tree: the gateway and replica are
started from the current directory's ``prefixgate`` package.
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

from prefixgate.procs import free_port, stop_process, wait_http_ok

NS = f"pgvanish{os.getpid()}"
HOST_IF, NS_IF = f"pgv{os.getpid() % 100000}a", f"pgv{os.getpid() % 100000}b"
HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"
SIM = ["--model", "sim", "--host", NS_IP, "--port", "8101"]
UPSTREAM = ["--replica", f"http://{NS_IP}:8101"]


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def make_link() -> None:
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    sh("ip", "link", "set", NS_IF, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")


def remove_link() -> None:
    subprocess.run(["ip", "link", "del", HOST_IF], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], check=False, capture_output=True)


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def stream(
    gateway: str, i: int, started: list[asyncio.Event], cut: asyncio.Event
) -> dict[str, Any]:
    body = {
        "model": "sim",
        "stream": True,
        "max_tokens": 20_000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"a long story, number {i}"}],
    }
    chunks, ended, cut_at = 0, "finished", 0.0
    timeout = httpx.Timeout(10.0, read=900.0)
    async with (
        httpx.AsyncClient(timeout=timeout) as client,
        client.stream("POST", gateway + "/v1/chat/completions", json=body) as r,
    ):
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunks += 1
                if chunks == 20:
                    started[i].set()
                if cut.is_set() and not cut_at:
                    cut_at = time.monotonic()
                if '"error"' in line:
                    ended = "error event"
                    break
        except httpx.HTTPError as exc:
            ended = f"connection: {type(exc).__name__}"
    return {"chunks": chunks, "ended": ended, "at": time.monotonic()}


async def scenario(gateway: str, streams: int, window_s: float) -> dict[str, Any]:
    started = [asyncio.Event() for _ in range(streams)]
    cut = asyncio.Event()
    tasks = [asyncio.create_task(stream(gateway, i, started, cut)) for i in range(streams)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "down")
    cut.set()
    cut_at = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=window_s)
    for task in pending:
        task.cancel()
    ends = []
    for task in tasks:
        if task in done:
            out = task.result()
            ends.append(
                {
                    "seconds_after_cut": round(out["at"] - cut_at, 1),
                    "ended": out["ended"],
                    "chunks": out["chunks"],
                }
            )
        else:
            ends.append({"seconds_after_cut": None, "ended": f"not within {window_s:g} s"})
    return {"streams": ends}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        try:
            make_link()
            replica = spawn(
                ["ip", "netns", "exec", NS, sys.executable, "-m", "prefixgate", "replica", *SIM],
                logs / "replica.log",
            )
            procs.append(replica)
            wait_http_ok(f"http://{NS_IP}:8101/health", timeout=60, procs=[replica])
            port = free_port()
            gateway = spawn(
                [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port), *UPSTREAM],
                logs / "gateway.log",
            )
            procs.append(gateway)
            url = f"http://127.0.0.1:{port}"
            wait_http_ok(url + "/ready", timeout=60, procs=[gateway])
            record = asyncio.run(scenario(url, args.streams, args.window_s))
            record["window_s"] = args.window_s
        finally:
            for proc in procs:
                stop_process(proc, grace_s=5)
            remove_link()
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
