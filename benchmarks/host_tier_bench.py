"""Host KV tier on the built-in engine: TTFT for a long cached prefix served cold, from
the device pool, or from the host tier, and the raw cost of the copies.

    .venv/bin/python benchmarks/host_tier_bench.py [--model smollm2-135m] [--device cpu]
        [--prefix 2000] [--suffix 16] [--repeats 3]

Per repeat (a fresh prefix each time), on one engine with a device pool of 200 blocks
and a 512 MiB host tier:

* cold:  prefix + question, nothing cached;
* device: prefix + another question, the prefix's blocks still in the device pool;
* host:  two unrelated prompts as long as the prefix push every one of its blocks out of
  the device pool (demoted, not dropped); then prefix + a third question: its blocks
  are copied back (promoted) before the question's prefill.

Also times ``HostPool.demote``/``promote`` of the prefix's blocks alone.
``--copy-styles`` only compares, on tensors shaped like SmolLM2's pool (float32), one
``copy_`` per (layer, block) against a per-layer gather + scatter (``index_select`` /
``index_copy_``) for 125 blocks, 15 alternating runs. Medians of
``--repeats``. On the CPU device the host tier is a second tensor in the same RAM and
each copy a memcpy; on CUDA the same code copies over PCIe from pinned memory on a side
stream (replica/host_pool.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from replica.engine import Engine, EngineConfig
from replica.host_pool import HostPool
from replica.models import load_model
from replica.request import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_copy_styles(runs: int = 15, blocks: int = 125) -> None:
    layers = 30
    src = [torch.randn(200, 2, 3, 16, 64) for _ in range(layers)]
    dst = [torch.zeros(300, 2, 3, 16, 64) for _ in range(layers)]
    pairs = [(i, 100 + i) for i in range(blocks)]

    def per_block() -> None:
        for s, d in zip(src, dst, strict=True):
            for a, b in pairs:
                d[b].copy_(s[a])

    def gather_scatter() -> None:
        si = torch.tensor([a for a, _ in pairs])
        di = torch.tensor([b for _, b in pairs])
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(0, di, s.index_select(0, si))

    times: dict[str, list[float]] = {"per (layer, block) copy_": [], "gather + scatter": []}
    for _ in range(runs):
        for out, fn in zip(times.values(), (per_block, gather_scatter), strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    print(f"copy styles, {blocks} blocks x {layers} layers, {runs} runs:")
    for name, out in times.items():
        median, least = statistics.median(out) * 1e3, min(out) * 1e3
        print(f"  {name:>26}: median {median:.1f} ms, min {least:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-styles", action="store_true", help="only compare copy styles")
    args = parser.parse_args()
    if args.copy_styles:
        compare_copy_styles()
        return
    model = load_model(args.model, device=args.device, dtype="float32")
    rng = random.Random(0)
    config = EngineConfig(num_blocks=200, host_cache_mb=512, max_prefill_tokens_per_step=4096)
    engine = Engine(model, config)
    engine.start()
    cold, device, host = [], [], []
    bs = config.block_size
    try:
        for _ in range(args.repeats):
            prefix = _tokens(rng, args.prefix)
            out = engine.generate([*prefix, *_tokens(rng, args.suffix)], ONE_TOKEN)
            assert out.cached_tokens == 0
            cold.append(out.timings.first_token_s)
            out = engine.generate([*prefix, *_tokens(rng, args.suffix)], ONE_TOKEN)
            assert out.cached_tokens >= args.prefix // bs * bs, out.cached_tokens
            device.append(out.timings.first_token_s)
            for _ in range(2):
                engine.generate(_tokens(rng, args.prefix), ONE_TOKEN)
            engine.run_until_idle(timeout=600)
            before = engine.cache.stats()
            out = engine.generate([*prefix, *_tokens(rng, args.suffix)], ONE_TOKEN)
            after = engine.cache.stats()
            host_tokens = after.host_hit_tokens - before.host_hit_tokens
            assert host_tokens == out.cached_tokens >= args.prefix // bs * bs, host_tokens
            host.append(out.timings.first_token_s)
        stats = engine.cache.stats()
    finally:
        engine.stop()
    mover = getattr(engine.backend, "host_pool", None)
    assert isinstance(mover, HostPool)
    device_of_pool = mover.device_pool.device
    n = args.prefix // bs
    copies: dict[str, list[float]] = {"demote": [], "promote": []}
    for _ in range(max(3, args.repeats)):
        for name, fn in (("demote", mover.demote), ("promote", mover.promote)):
            _sync(device_of_pool)
            start = time.perf_counter()
            fn(list(range(n)), list(range(n)))
            _sync(device_of_pool)
            copies[name].append(time.perf_counter() - start)
    ms = {
        k: statistics.median(v) * 1000
        for k, v in {"cold": cold, "device": device, "host": host}.items()
    }
    mib = n * mover.block_bytes / 2**20
    print(
        f"TTFT {args.model} on {args.device}: {args.prefix}-token prefix + {args.suffix}-token "
        f"question, medians of {args.repeats}; threads {torch.get_num_threads()}"
    )
    print(f"  cold           {ms['cold']:8.1f} ms")
    print(
        f"  warm, device   {ms['device']:8.1f} ms   cold/device = {ms['cold'] / ms['device']:.1f}x"
    )
    print(f"  warm, host     {ms['host']:8.1f} ms   cold/host = {ms['cold'] / ms['host']:.1f}x")
    for name, times in copies.items():
        t = statistics.median(times) * 1000
        print(
            f"  {name} {n} blocks ({mib:.0f} MiB): {t:.1f} ms = {mib / 1024 / (t / 1000):.1f} GiB/s"
        )
    print(
        f"  engine totals: {stats.demotions} demoted, {stats.promotions} promoted, "
        f"{stats.bytes_to_host / 2**20:.0f} MiB to host, "
        f"{stats.bytes_to_device / 2**20:.0f} MiB back"
    )


if __name__ == "__main__":
    main()
