"""How long a gateway's rebuild of one replica's view (``RedisSync._resync``) holds its
event loop, against a real redis-server.

    .venv/bin/python benchmarks/resync_bench.py [--events 100000] [--blocks 20000]

A replica's event stream was capped at 100,000 events (now ``STREAM_MAXLEN``, 10,000),
and a busy replica keeps it full; its snapshot (``--blocks`` blocks) is as of the
stream's last event but ``--behind``. A gateway rebuilds a replica's view when it starts,
after a sequence gap, after every Redis reconnect (every replica then), and when a
snapshot appears. The rebuild runs on the gateway's event loop between awaits, so for
as long as it takes, the gateway routes and streams nothing. Reported: the wall and CPU
time of one rebuild, and the longest the event loop went without running a 1 ms ticker
meanwhile (a token stream's gap), the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from prefixgate.procs import free_port, start_redis, stop_process
from router.protocol import (
    BlockEvent,
    SnapshotBlock,
    encode_snapshot,
    events_stream_key,
    snapshot_key,
)
from router.router import Router
from router.sync import RedisSync


async def longest_gap() -> float:
    """Tick every 1 ms until cancelled; the longest time between two ticks, in s."""
    longest, last = 0.0, time.perf_counter()
    try:
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
    except asyncio.CancelledError:
        return longest


async def run(args: argparse.Namespace, url: str) -> None:
    client = aioredis.from_url(url)
    rng = random.Random(0)
    stream = events_stream_key("r0")
    pipe = client.pipeline(transaction=False)
    for seq in range(1, args.events + 1):
        keys = tuple(rng.randbytes(16) for _ in range(4))  # a stored chain of 4 blocks
        pipe.xadd(stream, BlockEvent(seq, "stored", keys).encode())  # type: ignore[arg-type]
        if seq % 5000 == 0:
            await pipe.execute()
            pipe = client.pipeline(transaction=False)
    await pipe.execute()
    blocks = [SnapshotBlock(None, rng.randbytes(16)) for _ in range(args.blocks)]
    await client.set(snapshot_key("r0"), encode_snapshot(args.events - args.behind, blocks))

    router = Router()
    router.add_replica("r0", "http://r0", "m", 16, static=True)
    sync = RedisSync(router, url)
    sync._client = aioredis.from_url(url)  # the follow loop is not started: one rebuild
    walls, cpus, stalls = [], [], []
    for _ in range(args.repeats):
        ticking = asyncio.create_task(longest_gap())
        await asyncio.sleep(0.01)
        t0, c0 = time.perf_counter(), time.process_time()
        await sync._resync("r0")
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        await asyncio.sleep(0.01)  # the ticker wakes: the gap up to now is measured
        ticking.cancel()
        stalls.append(await ticking)
    assert router.replicas["r0"].last_seq == args.events
    assert router.index.blocks("r0") >= args.blocks
    print(
        f"stream {args.events:,} events, snapshot {args.blocks:,} blocks {args.behind} events"
        f" behind: one rebuild {statistics.median(walls) * 1000:,.0f} ms wall,"
        f" {statistics.median(cpus) * 1000:,.0f} ms CPU, longest loop stall"
        f" {statistics.median(stalls) * 1000:,.0f} ms (median of {args.repeats})"
    )
    await sync._client.aclose()
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--behind", type=int, default=300, help="events after the snapshot")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_redis(port, Path(tmp))
        try:
            asyncio.run(run(args, f"redis://127.0.0.1:{port}/0"))
        finally:
            stop_process(proc)


if __name__ == "__main__":
    main()
