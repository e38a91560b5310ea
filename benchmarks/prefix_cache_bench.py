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
4. Host tier sweep (``--tiers``: only this): a device pool of 25% of the working set and
   a host tier of 0/50/100/200% of it; token hit rate split by the tier the hit came
   from, for the Zipf documents above and a multi-turn chat (conversations that grow by
   a question and an answer per turn, turns of different conversations interleaved).
   Working set = distinct full blocks found in more than one prompt. Only the bookkeeping runs (the
   mover copies nothing); the bytes a real pool would move are counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
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


class CountingMover:
    """The host tier's mover for bookkeeping runs: counts copies, moves no bytes."""

    block_bytes = 2 * 30 * 3 * B * 64 * 2  # SmolLM2-135M in bf16: 30 layers, 3 KV heads

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        pass

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        pass


class TierHit(NamedTuple):
    device_tokens: int
    host_tokens: int


def serve_tiered(cache: PrefixCache, tokens: list[int]) -> TierHit:
    """``serve`` with the scheduler's promotion of host blocks before the prefill."""
    hit = cache.match(tokens)
    host = hit.host_tokens
    if host:
        promoted, blocks_in = cache.promote(hit)
        if promoted.cached_tokens < hit.cached_tokens:  # cut: the pool could not take all
            host = blocks_in * B
        hit = promoted
    blocks = list(hit.block_ids)
    if hit.cached_tokens % B:
        (fresh,) = cache.allocate(1)
        cache.release([blocks[-1]])
        blocks[-1] = fresh
    blocks += cache.allocate(-(-len(tokens) // B) - len(blocks))
    cache.commit(tokens, blocks)
    cache.release(blocks)
    return TierHit(hit.cached_tokens - min(host, hit.cached_tokens), min(host, hit.cached_tokens))


def chat_workload(n_requests: int, seed: int = 2) -> list[list[int]]:
    """Multi-turn chat: 48 conversations (a 200-token system prompt shared by all, then
    per turn a 32-128-token question and a 64-256-token answer), a random active
    conversation per request; a conversation ends past 2,500 tokens and a new one
    starts."""
    rng = random.Random(seed)
    system = [rng.randrange(49152) for _ in range(200)]
    convs = [list(system) for _ in range(48)]
    requests = []
    for _ in range(n_requests):
        i = rng.randrange(len(convs))
        conv = convs[i]
        conv += [rng.randrange(49152) for _ in range(rng.randrange(32, 129))]
        requests.append(list(conv))
        conv += [rng.randrange(49152) for _ in range(rng.randrange(64, 257))]
        if len(conv) > 2500:
            convs[i] = list(system)
    return requests


def working_set(requests: list[list[int]]) -> int:
    """Distinct full blocks that more than one prompt contains (a block is its whole
    prefix): what an unbounded cache would ever hit. A question asked once is not in it."""
    seen: Counter[bytes] = Counter()
    space = KeySpace("m", B)
    for tokens in requests:
        seen.update(space.keys(tokens))
    return sum(1 for n in seen.values() if n > 1)


def tier_sweep(n_requests: int) -> None:
    doc_requests, _ = workload(n_requests)
    workloads = [("Zipf documents", doc_requests), ("multi-turn chat", chat_workload(n_requests))]
    for name, requests in workloads:
        total = sum(len(r) for r in requests)
        blocks = working_set(requests)
        # 25% of the working set, but at least one whole request (+ copy-on-write).
        device = max(blocks // 4, -(-max(len(r) for r in requests) // B) + 1)
        print(
            f"\nhost tier sweep, {name}: {len(requests)} requests, {total} prompt tokens, "
            f"working set {blocks} blocks; device pool {device} blocks (25%)"
        )
        print(
            f"{'host tier':>14} {'device hit':>11} {'host hit':>9} {'total hit':>10} "
            f"{'demoted':>8} {'promoted':>9} {'GiB to host':>12} {'GiB to device':>14}"
        )
        for share in (0.0, 0.5, 1.0, 2.0):
            host_blocks = int(share * blocks)
            cache = PrefixCache(
                device,
                B,
                "m",
                host_blocks=host_blocks,
                mover=CountingMover() if host_blocks else None,
            )
            hits = [serve_tiered(cache, r) for r in requests]
            dev = sum(h.device_tokens for h in hits) / total
            host = sum(h.host_tokens for h in hits) / total
            st = cache.stats()
            cache.check_invariants()
            gib = 1024**3
            label = f"{share:.0%} ({host_blocks})"
            print(
                f"{label:>14} {dev:>11.3f} {host:>9.3f} {dev + host:>10.3f} "
                f"{st.demotions:>8} {st.promotions:>9} {st.bytes_to_host / gib:>12.2f} "
                f"{st.bytes_to_device / gib:>14.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    parser.add_argument("--tiers", action="store_true", help="only the host tier sweep")
    args = parser.parse_args()
    if args.tiers:
        tier_sweep(300 if args.quick else 1500)
        return
    repeats = 100 if args.quick else 500
    print(f"block keys, 2048 tokens:             {bench_keys(repeats)}  target <= 0.3")
    cold, warm = bench_request(repeats)
    print(f"match+allocate+commit+release, cold: {cold}  target <= 1")
    print(f"match+allocate+commit+release, warm: {warm}  target <= 1")
    sweep(300 if args.quick else 1500)


if __name__ == "__main__":
    main()
