"""A vLLM engine evicting blocks, followed by a bridge from each tree at once: how many
stream entries each writes for the same engine events, what following them costs a
gateway, and whether the views they give agree.

    # one engine with a small KV cache (it must evict), e.g. --num-gpu-blocks-override 40,
    # --kv-events-config endpoint tcp://*:5600, replay tcp://*:5610
    .venv/bin/python benchmarks/removals_vllm.py --model smollm2-135m \\
        --engine http://127.0.0.1:8100,5600,5610 --tree before=DIR --tree after=.

Per tree: Redis, a bridge and a gateway (benchmarks/hub_models_vllm.py's ``Stack``), all
following the one engine. Its cache is reset, then ``--prompts`` different documents of
``--words`` words are sent to it directly, one after the other, more than its cache
holds. Then, per tree: the stream's entries and keys by kind; the CPU a gateway's
follower (``RedisSync``, as benchmarks/follow_bench.py) takes to fold the stream, the
median of ``--repeats``; and the keys the folded view holds, compared across trees.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, documents, reset

from router.protocol import BlockEvent, events_stream_key
from router.router import Router
from router.sync import RedisSync


def stream_of(url: str) -> str:
    """The one replica's event stream in this Redis."""
    client = redis.Redis.from_url(url)
    names = [k.decode() for k in client.scan_iter(events_stream_key("*"))]
    assert len(names) == 1, names
    return names[0]


def settled(url: str, stream: str, quiet_s: float = 2.0, timeout_s: float = 60.0) -> int:
    """The stream's length once it has not grown for ``quiet_s`` (the bridge has written
    what the engine sent)."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = int(client.xlen(stream))  # type: ignore[arg-type]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return n
        time.sleep(0.2)
    raise TimeoutError(f"{stream} still growing after {timeout_s} s")


async def fold(url: str, replica_id: str, last_seq: int) -> tuple[float, int]:
    """CPU seconds a gateway's follower takes to fold the stream from its start, and the
    blocks its index holds after."""
    router = Router()
    router.add_replica(replica_id, "http://unused", "m", 16, static=True)
    sync = RedisSync(router, url)
    client = aioredis.from_url(url)
    sync._client = client  # the follow loop is not started: reads by hand
    sync._stream_ids[replica_id] = "0-0"
    c0 = time.process_time()
    while (router.replicas[replica_id].last_seq or 0) < last_seq:
        await sync._read_events()
    cpu = time.process_time() - c0
    await client.aclose()
    return cpu, router.index.blocks(replica_id)


def replayed(events: list[BlockEvent]) -> set[bytes]:
    """The keys a stream's events leave held, folded in order."""
    held: set[bytes] = set()
    for event in events:
        if event.type == "stored":
            held.update(event.keys)
        elif event.type == "removed":
            held.difference_update(event.keys)
        else:
            held.clear()
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", required=True, help="URL,EVENTS_PORT,REPLAY_PORT")
    p.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--words", type=int, default=700)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engine = args.engine.split(",")
    trees = [t.split("=", 1) for t in args.tree]
    with tempfile.TemporaryDirectory() as work:
        stacks = {label: Stack(tree, [engine], Path(work) / label) for label, tree in trees}
        try:
            reset([engine], args.model)
            texts = documents(args.prompts, args.words, args.seed)
            prompt_tokens = 0
            with httpx.Client(timeout=300) as client:
                for text in texts:
                    r = client.post(
                        engine[0] + "/v1/completions",
                        json={"model": args.model, "prompt": text, "max_tokens": 8},
                    )
                    r.raise_for_status()
                    prompt_tokens += r.json()["usage"]["prompt_tokens"]
            print(
                f"{args.prompts} documents, {prompt_tokens:,} prompt tokens, sent to "
                f"{engine[0]} one after the other"
            )
            views: dict[str, set[bytes]] = {}
            for label, stack in stacks.items():
                url = stack.redis_url
                stream = stream_of(url)
                total = settled(url, stream)
                entries: Any = redis.Redis.from_url(url).xrange(stream)
                events = [BlockEvent.decode(fields) for _, fields in entries]
                kinds: dict[str, list[int]] = {}
                for event in events:
                    n = kinds.setdefault(event.type, [0, 0])
                    n[0] += 1
                    n[1] += len(event.keys)
                replica_id = stream[len(events_stream_key("")) :]
                runs = [
                    asyncio.run(fold(url, replica_id, events[-1].seq)) for _ in range(args.repeats)
                ]
                cpu = statistics.median(r[0] for r in runs)
                views[label] = replayed(events)
                by_kind = ", ".join(f"{k} {e} entries / {n} keys" for k, (e, n) in kinds.items())
                print(
                    f"{label}: {total} entries ({by_kind}); a gateway folded them in "
                    f"{cpu * 1e3:.1f} ms of CPU (median of {args.repeats}: "
                    f"{', '.join(f'{r[0] * 1e3:.1f}' for r in runs)}), its index then "
                    f"holding {runs[0][1]} blocks; the events leave {len(views[label])} held"
                )
            labels = list(views)
            for other in labels[1:]:
                same = views[other] == views[labels[0]]
                print(f"views of {labels[0]} and {other} equal: {same}")
        finally:
            for stack in stacks.values():
                stack.stop()


if __name__ == "__main__":
    main()
