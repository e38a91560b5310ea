"""The bridge's cost per engine block: translating vLLM events into prefixgate keys.

    .venv/bin/python benchmarks/bridge_translate_bench.py [--blocks 20000] [--repeats 3]

For engine pages of 16 and 128 tokens, one chain of ``--blocks`` blocks, one block per
``BlockStored`` (as vLLM's block pool sends them), through ``KeyTranslator``:

* ``store``: GPU stores (keys computed, published on the device tier);
* ``offload``: the same blocks announced on the CPU (bare, as vLLM's offloading connector
  sends by default), then removed from the GPU: every key demoted to the host tier;
* ``remove``: the CPU removals: every key gone.

Prints µs per engine block for each phase (best of ``--repeats``) and the translator's
memory per block held (tracemalloc, after the stores).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.events import BlockRemoved, BlockStored
from bridge.translate import KeyTranslator


def chain(n_blocks: int, page: int, seed: int = 0) -> list[BlockStored]:
    rng = random.Random(seed)
    events = []
    parent: int | None = None
    for h in range(1, n_blocks + 1):
        ids = tuple(rng.randrange(49152) for _ in range(page))
        events.append(BlockStored((h,), parent, ids, page, medium="GPU"))
        parent = h
    return events


def timed(run: Callable[[], None]) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def one_round(events: list[BlockStored]) -> tuple[float, float, float]:
    tr = KeyTranslator("m")
    hashes = [e.block_hashes for e in events]

    def store() -> None:
        for e in events:
            tr.stored(e)

    def offload() -> None:
        for h in hashes:
            tr.stored(BlockStored(h, None, (), 0, medium="CPU"))
        for h in hashes:
            tr.removed(BlockRemoved(h, "GPU"))

    def remove() -> None:
        for h in hashes:
            tr.removed(BlockRemoved(h, "CPU"))

    times = timed(store), timed(offload), timed(remove)
    assert not tr.blocks and not tr.published.producers
    return times


def memory_per_block(events: list[BlockStored]) -> float:
    gc.collect()
    tracemalloc.start()
    tr = KeyTranslator("m")
    for e in events:
        tr.stored(e)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / len(events)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("page  store µs/block  offload µs/block  remove µs/block  memory B/block")
    for page in (16, 128):
        events = chain(args.blocks, page)
        rounds = [one_round(events) for _ in range(args.repeats)]
        best = [min(r[i] for r in rounds) * 1e6 / args.blocks for i in range(3)]
        memory = memory_per_block(events)
        print(f"{page:4}  {best[0]:14.2f}  {best[1]:16.2f}  {best[2]:15.2f}  {memory:14.0f}")


if __name__ == "__main__":
    main()
