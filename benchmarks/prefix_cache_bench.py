"""Prefix cache figures: key time, per-request bookkeeping cost, capacity sweep.

    .venv/bin/python benchmarks/prefix_cache_bench.py [--quick]

1. Block keys for a 2,048-token prompt (target <= 0.3 ms).
2. match + allocate + commit + release for a 2,048-token prompt, block size 16 (target
   <= 1 ms): *cold* = a prompt never seen, in a full cache (so allocation evicts);
   *warm* = the prompt fully cached (2,047 tokens hit, copy-on-write of the last block).
3. Capacity sweep: token hit rate against cache size for lru, sink_lru, and lru with the
   blocks released head-first instead of tail-first. Workload: 8 shared "documents" of
   768-1,536 tokens, picked with Zipf(1.1) popularity; each request is a document plus a
   unique 32-256-token question, served one after another.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

from replica.prefix_cache import PrefixCache
from router.protocol import KeySpace

B = 16


class Timing(NamedTuple):
    median_ms: float  # wall clock
    p90_ms: float
    cpu_median_ms: float  # this thread's CPU time: what the code costs on a busy machine

    def __str__(self) -> str:
        return (
            f"median {self.median_ms:.3f} ms  p90 {self.p90_ms:.3f} ms  "
            f"(CPU median {self.cpu_median_ms:.3f} ms)"
        )


def time_calls(fn: Callable[[], object], repeats: int) -> Timing:
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    wall.sort()
    return Timing(statistics.median(wall), wall[int(0.9 * (len(wall) - 1))], statistics.median(cpu))


def serve(cache: PrefixCache, tokens: list[int], *, head_first: bool = False) -> int:
    """One request's bookkeeping; returns the cached tokens."""
    hit = cache.match(tokens)
    blocks = list(hit.block_ids)
    if hit.cached_tokens % B:  # copy-on-write of the shared partial block
        (fresh,) = cache.allocate(1)
        cache.release([blocks[-1]])
        blocks[-1] = fresh
    blocks += cache.allocate(-(-len(tokens) // B) - len(blocks))
    cache.commit(tokens, blocks)
    cache.release(blocks[::-1] if head_first else blocks)
    return hit.cached_tokens


def bench_keys(repeats: int) -> Timing:
    space = KeySpace("smollm2-135m", B)
    tokens = list(range(1000, 3048))
    return time_calls(lambda: space.keys(tokens), repeats)


def bench_request(repeats: int) -> tuple[Timing, Timing]:
    rng = random.Random(0)
    cache = PrefixCache(4096, B, "smollm2-135m")
    prompts = [[rng.randrange(49152) for _ in range(2048)] for _ in range(64)]
    for prompt in prompts[:40]:  # fill the cache: cold requests below must evict
        serve(cache, prompt)
    cold_iter = iter(prompts * (repeats // len(prompts) + 2))
    cold = time_calls(lambda: serve(cache, next(cold_iter)), repeats)
    warm_prompt = prompts[0]
    serve(cache, warm_prompt)
    assert serve(cache, warm_prompt) == 2047
    warm = time_calls(lambda: serve(cache, warm_prompt), repeats)
    cache.check_invariants()
    return cold, warm


def workload(n_requests: int, seed: int = 1) -> tuple[list[list[int]], int]:
    """Requests and the number of distinct full blocks in the shared documents."""
    rng = random.Random(seed)
    docs = [[rng.randrange(49152) for _ in range(rng.randrange(768, 1537))] for _ in range(8)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(docs))]
    requests = []
    for _ in range(n_requests):
        doc = rng.choices(docs, weights)[0]
        question = [rng.randrange(49152) for _ in range(rng.randrange(32, 257))]
        requests.append(doc + question)
    return requests, sum(len(d) // B for d in docs)


def sweep(n_requests: int) -> None:
    requests, doc_blocks = workload(n_requests)
    total = sum(len(r) for r in requests)
    variants = [
        ("lru", "lru", False),
        ("sink_lru", "sink_lru", False),
        ("lru head-first", "lru", True),
    ]
    print(
        f"\ncapacity sweep: {n_requests} requests, {total} prompt tokens, "
        f"documents = {doc_blocks} blocks of {B}; token hit rate"
    )
    print(f"{'cache blocks':>12} {'x docs':>7}  " + "  ".join(f"{v[0]:>15}" for v in variants))
    for size in (128, 256, 384, 512, 640, 768, 1024, 1536):
        rates = []
        for _, policy, head_first in variants:
            cache = PrefixCache(size, B, "m", eviction_policy=policy)
            hit = sum(serve(cache, r, head_first=head_first) for r in requests)
            rates.append(hit / total)
        print(f"{size:>12} {size / doc_blocks:>7.2f}  " + "  ".join(f"{r:>15.3f}" for r in rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    args = parser.parse_args()
    repeats = 100 if args.quick else 500
    print(f"block keys, 2048 tokens:             {bench_keys(repeats)}  target <= 0.3")
    cold, warm = bench_request(repeats)
    print(f"match+allocate+commit+release, cold: {cold}  target <= 1")
    print(f"match+allocate+commit+release, warm: {warm}  target <= 1")
    sweep(300 if args.quick else 1500)


if __name__ == "__main__":
    main()
