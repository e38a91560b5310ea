"""Router decision latency and index memory at production scale.

    .venv/bin/python benchmarks/router_bench.py [--replicas 16] [--blocks 1000000]

Fills the index with ``--blocks`` distinct blocks held by ``--replicas`` replicas (each
publishing events, as live replicas do: its start-up snapshot applied first)
(chains of 128 blocks, i.e. 2,048-token prompts at block size 16, 10% of them held by
two replicas), measures index memory with tracemalloc, then times ``Router.route`` for
2,048-token prompts (128 short keys, precomputed: key hashing is excluded) that reuse a
random cached chain's first half and add new blocks, like a conversation's next turn.
Each request goes through the gateway's calls: ``route``, ``request_started`` with the
predicted tokens, ``first_byte``, ``request_finished`` (which folds the deferred
optimistic insert; reported too). Memory: per indexed block, with the allocation sites
that hold most of it. GC pauses: the longest full collection before and after the index
is built (``gc.callbacks`` timing each collection, in wall time and in this thread's
CPU time, which leaves out the time another process held the core; the difference is
the index's share), and every collection during the timed loop.

``--leave-one-behind ROUNDS``: instead, one replica at the default cap (10⁶ blocks,
so 125k-block LRU generations) uses its working set (``--working-set``, default one
generation) again every round, all but one block, which a new block replaces. The
block left behind stays held alone among its generation's log entries, and no cap
eviction ever reads them.
Reports the LRU's log bytes per held block and the longest ``insert`` call (wall and
thread CPU) per 5 rounds, i.e. the longest pause the index's bookkeeping adds (round 0
builds the index: the node map grows), and the collections in the same rounds (a
collection that runs inside an insert counts in both).
"""

from __future__ import annotations

import argparse
import gc
import linecache
import random
import statistics
import time
import tracemalloc
from typing import Any

from router.config import RouterConfig, with_options
from router.index import PrefixIndex
from router.protocol import Snapshot
from router.router import Router

CHAIN = 128


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-keys", action="store_true", help="pass 32-byte keys")
    parser.add_argument("--option", action="append", default=[], help="router NAME=VALUE")
    parser.add_argument("--leave-one-behind", type=int, metavar="ROUNDS", default=0)
    parser.add_argument(
        "--working-set", type=int, default=0, help="blocks (default: one LRU generation)"
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    if args.leave_one_behind:
        leave_one_behind(args.leave_one_behind, args.working_set, rng)
        return

    router = Router(with_options(RouterConfig(), args.option), seed=args.seed)
    replica_ids = [f"replica-{i}" for i in range(args.replicas)]
    for rid in replica_ids:
        router.add_replica(rid, f"http://{rid}", static=True)
        router.apply_snapshot(rid, Snapshot(0, []))  # they publish events, as live ones do

    pauses: list[tuple[int, float, float]] = []  # (generation, wall s, CPU s) per collection
    started: list[tuple[float, float]] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append((time.perf_counter(), time.thread_time()))
        elif started:
            t0, c0 = started.pop()
            pauses.append((info["generation"], time.perf_counter() - t0, time.thread_time() - c0))

    n_chains = args.blocks // CHAIN
    # Tuples of bytes: the collector stops tracking them, so a full collection measures
    # the index, not this script's copy of the keys.
    chains = [tuple(rng.randbytes(16) for _ in range(CHAIN)) for _ in range(n_chains)]
    gc.callbacks.append(on_gc)
    for _ in range(3):
        gc.collect()
    empty, empty_cpu = max(p for _g, p, _c in pauses), max(c for _g, _p, c in pauses)
    pauses.clear()
    gc.callbacks.remove(on_gc)
    tracemalloc.start()
    first = tracemalloc.take_snapshot()
    before = tracemalloc.get_traced_memory()[0]
    for chain in chains:
        holders = rng.sample(replica_ids, 2 if rng.random() < 0.1 else 1)
        for rid in holders:
            router.index.insert(rid, chain)
    after = tracemalloc.get_traced_memory()[0]
    sites = tracemalloc.take_snapshot().compare_to(first, "lineno")
    tracemalloc.stop()
    # The keys' own bytes objects count too (made before tracing; the index keeps them
    # alive): 49 bytes each, 56 with the allocator's 8-byte rounding.
    key_bytes = (chains[0][0].__sizeof__() + 7) // 8 * 8
    indexed = len(router.index)
    holdings = sum(router.index.blocks(rid) for rid in replica_ids)
    index_bytes = after - before + key_bytes * indexed
    print(f"indexed blocks: {indexed:,} ({holdings:,} replica holdings, {args.replicas} replicas)")
    print(
        f"index memory:   {index_bytes / 2**20:.1f} MiB = {index_bytes / indexed:.0f} bytes/block"
    )
    print(f"  keys (bytes objects, {key_bytes} B each): {key_bytes} bytes/block")
    for site in sorted(sites, key=lambda st: -st.size_diff)[:3]:
        frame = site.traceback[0]
        line = linecache.getline(frame.filename, frame.lineno).strip()
        print(
            f"  {site.size_diff / indexed:5.1f} bytes/block at"
            f" {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({line})"
        )

    gc.callbacks.append(on_gc)
    for _ in range(3):
        gc.collect()
    full, full_cpu = max(p for _g, p, _c in pauses), max(c for _g, _p, c in pauses)
    print(
        f"full collection: max {empty * 1000:.1f} ms over 3 before the index,"
        f" {full * 1000:.1f} ms with the index built"
        f" (CPU: {empty_cpu * 1000:.1f} ms, {full_cpu * 1000:.1f} ms)"
    )
    pauses.clear()

    # Wall time, and this thread's CPU time: on a shared machine the wall clock also
    # counts the time other processes held the core.
    # Request keys are fresh short-key objects, as the gateway computes them with the
    # prompt's hashing (KeySpace.short_keys; the index compares them by content with its
    # stored keys, as in production). ``--full-keys``: 32-byte keys that route() cuts
    # down itself (measured +30-40 µs at p50 and p99 for 128 keys: 128 more allocations).
    latencies, cpu, finish = [], [], []
    for _ in range(args.requests):
        base = rng.choice(chains)
        tail = 16 if args.full_keys else 0
        keys = [k + bytes(tail) for k in base[: CHAIN // 2]]  # fresh objects, same content
        keys += [rng.randbytes(16 + tail) for _ in range(CHAIN // 2)]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        decision = router.route(keys, conversation_key=None, prompt_tokens=CHAIN * 16)
        latencies.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
        request = router.request_started(
            decision.replica_id, decision.uncached_tokens, decision.queued_tokens
        )
        router.first_byte(request)
        c1 = time.thread_time_ns()
        router.request_finished(request, ok=True)  # folds the deferred insert
        finish.append((time.thread_time_ns() - c1) / 1000)
    for label, values in (("wall", latencies), ("cpu ", cpu)):
        values.sort()
        p50 = values[len(values) // 2]
        p99 = values[int(len(values) * 0.99)]
        print(
            f"route() {label} for {CHAIN}-key prompts: p50 {p50:.0f} µs, p99 {p99:.0f} µs, "
            f"mean {statistics.fmean(values):.0f} µs over {args.requests} requests"
        )
    finish.sort()
    print(
        f"request_finished() cpu (folds the deferred optimistic insert, after the response):"
        f" p50 {finish[len(finish) // 2]:.0f} µs, mean {statistics.fmean(finish):.0f} µs"
    )
    gc.callbacks.remove(on_gc)
    worst = max((p for _g, p, _c in pauses), default=0.0)
    worst_cpu = max((c for _g, _p, c in pauses), default=0.0)
    counts = [sum(1 for g, _p, _c in pauses if g == gen) for gen in range(3)]
    print(
        f"collections during the loop (gen 0/1/2): {counts[0]}/{counts[1]}/{counts[2]},"
        f" longest {worst * 1000:.2f} ms (CPU {worst_cpu * 1000:.2f} ms)"
    )
    print(f"decisions: {router.stats()['decisions']}")


def leave_one_behind(rounds: int, working_set: int, rng: random.Random) -> None:
    index = PrefixIndex()  # the default cap: 10⁶ blocks, generations of 125k
    gen_size = index.max_blocks_per_replica // 8
    n_chains = (working_set or gen_size) // CHAIN + 1
    # Tuples of bytes, as above: the collector stops tracking them.
    chains = [tuple(rng.randbytes(16) for _ in range(CHAIN)) for _ in range(n_chains)]
    calls: list[tuple[float, float]] = []  # (wall s, CPU s) per insert call
    collections: list[float] = []  # CPU s per collection (3-5 ms for a full one here)
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.thread_time())
        elif started:
            collections.append(time.thread_time() - started.pop())

    gc.callbacks.append(on_gc)
    print(f"working set {len(chains) * CHAIN:,} blocks, generations of {gen_size:,}")
    for r in range(rounds + 1):
        if r:  # the deepest block of one chain is left behind: a new one replaces it
            chains[r % len(chains)] = (*chains[r % len(chains)][:-1], rng.randbytes(16))
        for chain in chains:
            c0, t0 = time.thread_time(), time.perf_counter()
            index.insert("r0", chain)
            calls.append((time.perf_counter() - t0, time.thread_time() - c0))
        lru = index._replicas["r0"].lru
        if r % 5 == 0 or r == rounds:
            held = len(lru)
            wall, cpu = max(w for w, _c in calls), max(c for _w, c in calls)
            print(
                f"round {r:3}: {held:,} held, logs {lru.log_bytes / 2**20:6.1f} MiB"
                f" = {lru.log_bytes / held:5.1f} B per held block;"
                f" longest insert {wall * 1000:5.1f} ms (CPU {cpu * 1000:5.1f} ms),"
                f" {sum(c > 0.002 for _w, c in calls)} over 2 ms of CPU;"
                f" {len(collections)} collections, longest {max(collections) * 1000:.1f} ms CPU"
            )
            calls.clear()
            collections.clear()
    gc.callbacks.remove(on_gc)


if __name__ == "__main__":
    main()
