"""Prefix index query cost at production scale: ``depths(lookup(keys))`` alone.

    .venv/bin/python benchmarks/index_lookup_bench.py [--replicas 16] [--blocks 1000000]

Fills a ``PrefixIndex`` like benchmarks/router_bench.py (chains of 128 blocks, 10% of
them held by two replicas), then times ``index.depths(index.lookup(short))`` for
128-key prompts whose first ``--cached`` keys are a cached chain's head and the rest
new (default 64: a conversation's next turn), as fresh 16-byte short keys. The same
prompts are timed with a few deferred optimistic inserts in the overlay too, as
``Router.route`` sees them while requests are in flight.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from router.index import PrefixIndex

CHAIN = 128


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--cached", type=int, nargs="+", default=[64, 0, 128])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    index = PrefixIndex()
    replica_ids = [f"replica-{i}" for i in range(args.replicas)]
    chains = [[rng.randbytes(16) for _ in range(CHAIN)] for _ in range(args.blocks // CHAIN)]
    for chain in chains:
        for rid in rng.sample(replica_ids, 2 if rng.random() < 0.1 else 1):
            index.insert(rid, chain)
    print(f"indexed blocks: {len(index):,} ({args.replicas} replicas)")
    gc.collect()

    for cached in args.cached:
        for overlay in (0, 8):
            # In flight: ``overlay`` deferred inserts of other prompts' new blocks.
            in_flight = [[rng.randbytes(16) for _ in range(CHAIN // 2)] for _ in range(overlay)]
            for keys in in_flight:
                index.insert_later(rng.choice(replica_ids), keys, 1e18)
            wall, cpu = [], []
            for _ in range(args.requests):
                base = rng.choice(chains)
                full = [k + bytes(16) for k in base[:cached]]
                full += [rng.randbytes(32) for _ in range(CHAIN - cached)]
                short = [k[:16] for k in full]  # fresh objects, as the router slices them
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                index.depths(index.lookup(short))
                wall.append((time.perf_counter_ns() - t0) / 1000)
                cpu.append((time.thread_time_ns() - c0) / 1000)
            index.fold()
            for rid in replica_ids:  # leave the index as it was
                index.remove(rid, [k for keys in in_flight for k in keys])
            for label, values in (("wall", wall), ("cpu ", cpu)):
                values.sort()
                print(
                    f"depths(lookup()) {label}, {cached:3d}/{CHAIN} keys cached,"
                    f" {overlay} deferred inserts: p50 {values[len(values) // 2]:.1f} µs,"
                    f" p99 {values[int(len(values) * 0.99)]:.1f} µs,"
                    f" mean {statistics.fmean(values):.1f} µs over {args.requests} prompts"
                )


if __name__ == "__main__":
    main()
