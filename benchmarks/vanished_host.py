"""A host that vanishes mid-request, a replica's or a gateway's: how long the other side
goes on with requests nobody will receive.

    sudo .venv/bin/python benchmarks/vanished_host.py --vanish replica|gateway
        [--streams 4] [--window-s 120] [--out FILE]

Linux, as root (network namespaces). The process that vanishes runs in a network
namespace of its own, joined to this host by a veth pair, as if on another node; once
the requests are under way, its end of the link is set down, so its packets are dropped
with neither FIN nor RST: a node powered off, or a partition.

* ``--vanish replica``: a sim replica in the namespace, the gateway here with that
  replica alone (static ``--replica``). ``--streams`` streams of 20,000 tokens go through
  the gateway; once each has received 20 chunks, the link goes down. Reported per
  stream: seconds from the cut to its end (an SSE error event or a closed connection;
  null: not within ``--window-s``), and how it ended.
* ``--vanish gateway``: the gateway in the namespace, the sim replica here. ``--streams``
  streamed and as many unstreamed chats of 20,000 tokens go through the gateway; once the
  replica runs them all and each stream has received 20 chunks, the link goes down.
  Reported: seconds from the cut until the replica runs none of them (its
  ``num_requests_running``), sampled every second; null: not within ``--window-s``.

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
PORT = 8101
BODY = {"model": "sim", "max_tokens": 20_000, "ignore_eos": True}


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
    body = {**BODY, "stream": True, "messages": [{"role": "user", "content": f"story {i}"}]}
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


def cut_link() -> None:
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "down")


async def replica_vanishes(gateway: str, streams: int, window_s: float) -> dict[str, Any]:
    started = [asyncio.Event() for _ in range(streams)]
    cut = asyncio.Event()
    tasks = [asyncio.create_task(stream(gateway, i, started, cut)) for i in range(streams)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    cut_link()
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
    return {"ends": ends}


def running(replica: str) -> int:
    for line in httpx.get(replica + "/metrics", timeout=10).text.splitlines():
        if line.startswith("prefixgate:num_requests_running "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError("no running gauge in the replica's metrics")


async def gateway_vanishes(
    gateway: str, replica: str, streams: int, window_s: float
) -> dict[str, Any]:
    started = [asyncio.Event() for _ in range(streams)]
    cut = asyncio.Event()
    readers = [asyncio.create_task(stream(gateway, i, started, cut)) for i in range(streams)]
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=900.0))
    whole = [
        asyncio.create_task(
            client.post(
                gateway + "/v1/chat/completions",
                json={**BODY, "messages": [{"role": "user", "content": f"whole {i}"}]},
            )
        )
        for i in range(streams)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    deadline = time.monotonic() + 60
    while running(replica) < 2 * streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica never ran every request")
        await asyncio.sleep(0.2)
    cut_link()
    cut.set()
    cut_at = time.monotonic()
    timeline = []
    idle_after = None
    while (elapsed := time.monotonic() - cut_at) < window_s:
        now = running(replica)
        timeline.append({"t_s": round(elapsed, 1), "running": now})
        if now == 0:
            idle_after = round(elapsed, 1)
            break
        await asyncio.sleep(1.0)
    for task in [*readers, *whole]:
        task.cancel()
    await asyncio.gather(*readers, *whole, return_exceptions=True)
    await client.aclose()
    return {"replica_idle_after_cut_s": idle_after, "timeline": timeline}


def run(vanish: str, streams: int, window_s: float, logs: Path) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    in_ns = ["ip", "netns", "exec", NS, sys.executable, "-m", "prefixgate"]
    here = [sys.executable, "-m", "prefixgate"]
    try:
        make_link()
        if vanish == "replica":
            replica = f"http://{NS_IP}:{PORT}"
            procs.append(
                spawn(
                    [*in_ns, "replica", "--model", "sim", "--host", NS_IP, "--port", str(PORT)],
                    logs / "replica.log",
                )
            )
            wait_http_ok(replica + "/health", timeout=60, procs=procs)
            port = free_port()
            procs.append(
                spawn(
                    [*here, "gateway", "--port", str(port), "--replica", replica],
                    logs / "gateway.log",
                )
            )
            gateway = f"http://127.0.0.1:{port}"
            wait_http_ok(gateway + "/ready", timeout=60, procs=procs)
            return asyncio.run(replica_vanishes(gateway, streams, window_s))
        port = free_port()
        procs.append(
            spawn(
                [*here, "replica", "--model", "sim", "--host", "0.0.0.0", "--port", str(port)],
                logs / "replica.log",
            )
        )
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=60, procs=procs)
        gateway, upstream = f"http://{NS_IP}:{PORT}", f"http://{HOST_IP}:{port}"
        procs.append(
            spawn(
                [*in_ns, "gateway", "--host", NS_IP, "--port", str(PORT), "--replica", upstream],
                logs / "gateway.log",
            )
        )
        wait_http_ok(gateway + "/ready", timeout=60, procs=procs)
        replica = f"http://127.0.0.1:{port}"
        return asyncio.run(gateway_vanishes(gateway, replica, streams, window_s))
    finally:
        for proc in procs:
            stop_process(proc, grace_s=5)
        remove_link()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vanish", choices=["replica", "gateway"], required=True)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    with tempfile.TemporaryDirectory() as tmp:
        record = run(args.vanish, args.streams, args.window_s, Path(tmp))
    record = {"vanish": args.vanish, "streams": args.streams, "window_s": args.window_s, **record}
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
