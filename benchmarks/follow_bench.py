"""What following the replicas' block events costs one gateway process, against a real
redis-server.

    .venv/bin/python benchmarks/follow_bench.py [--replicas 16] [--events 20000]
        [--keys 4] [--repeats 3]

Every gateway (every one of ``--workers``) folds every replica's block events into its
own index (``RedisSync``: XREAD, decode, ``Router.apply_event``), so a cluster's cache
churn is paid once per gateway process. Each replica's stream holds ``--events`` events
of ``--keys`` blocks each, as a publisher writes them: chains stored, and once a replica
holds a quarter of the run, its oldest stored events removed in turn (an LRU's
evictions). The follower reads them from the start as its poll loop does, and the CPU
it takes per block event is reported (the median of ``--repeats``), with what that is
at a given cluster churn.
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
from router.protocol import BlockEvent, events_stream_key
from router.router import Router
from router.sync import RedisSync


async def fill(url: str, replicas: int, events: int, keys: int, seed: int) -> int:
    """The streams; returns the block events written (stored and removed keys)."""
    client = aioredis.from_url(url)
    rng = random.Random(seed)
    written = 0
    for r in range(replicas):
        stream = events_stream_key(f"r{r}")
        await client.delete(stream)
        stored: list[tuple[bytes, ...]] = []
        pipe = client.pipeline(transaction=False)
        evict_from = events // 4
        seq = 0
        while seq < events:
            seq += 1
            if seq > evict_from and seq % 2 == 0:  # steady state: one eviction per store
                chain = stored.pop(0)
                pipe.xadd(stream, BlockEvent(seq, "removed", chain).encode())  # type: ignore[arg-type]
            else:
                chain = tuple(rng.randbytes(16) for _ in range(keys))
                stored.append(chain)
                pipe.xadd(stream, BlockEvent(seq, "stored", chain).encode())  # type: ignore[arg-type]
            written += keys
            if seq % 5000 == 0:
                await pipe.execute()
                pipe = client.pipeline(transaction=False)
        await pipe.execute()
    await client.aclose()
    return written


async def follow_once(url: str, replicas: int, events: int) -> float:
    """CPU seconds to fold every stream in from the start, as the poll loop reads."""
    router = Router()
    for r in range(replicas):
        router.add_replica(f"r{r}", f"http://r{r}", "m", 16, static=True)
    sync = RedisSync(router, url)
    sync._client = aioredis.from_url(url)  # the follow loop is not started: reads by hand
    for r in range(replicas):
        sync._stream_ids[f"r{r}"] = "0-0"
    c0 = time.process_time()
    while any((router.replicas[f"r{r}"].last_seq or 0) < events for r in range(replicas)):
        await sync._read_events()
    cpu = time.process_time() - c0
    assert not sync._need_resync, "a gap: the benchmark's streams are wrong"
    await sync._client.aclose()
    return cpu


async def run(args: argparse.Namespace, url: str) -> None:
    blocks = await fill(url, args.replicas, args.events, args.keys, seed=0)
    cpus = [await follow_once(url, args.replicas, args.events) for _ in range(args.repeats)]
    cpu = statistics.median(cpus)
    per_block = cpu / blocks
    print(
        f"{args.replicas} replicas x {args.events:,} events of {args.keys} blocks "
        f"({blocks:,} block events): {cpu:.2f} s CPU to follow (median of {args.repeats}; "
        f"runs {', '.join(f'{c:.2f}' for c in cpus)}), {per_block * 1e6:.2f} us per block event"
    )
    for churn in (10_000, 100_000):
        print(
            f"  at {churn:,} block events a second across the cluster: "
            f"{churn * per_block:.2f} cores per gateway process"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=4, help="blocks per event")
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
