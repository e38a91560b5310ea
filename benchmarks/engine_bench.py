"""Engine figures: TTFT cold vs warm vs the DynamicCache floor, decode throughput at
concurrency 1/4/8, a decode step over long contexts, peak RSS with a 1 GiB pool.

    .venv/bin/python benchmarks/engine_bench.py            # everything
    .venv/bin/python benchmarks/engine_bench.py --only ttft|decode|long-decode|per-token|rss

Uses torch's default thread count. Numbers on a shared CPU machine are noisy: each figure
is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

from replica.engine import Engine, EngineConfig
from replica.models import load_model
from replica.request import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def bench_ttft(model_name: str, prefix_len: int, suffix_len: int, repeats: int) -> None:
    model = load_model(model_name, dtype="float32")
    rng = random.Random(0)
    system = _tokens(rng, prefix_len)
    cold, warm = [], []
    for _ in range(repeats):
        engine = Engine(model, EngineConfig(kv_cache_mb=512))
        engine.start()
        out = engine.generate([*system, *_tokens(rng, suffix_len)], ONE_TOKEN)
        cold.append(out.timings.first_token_s)
        out = engine.generate([*system, *_tokens(rng, suffix_len)], ONE_TOKEN)
        assert out.cached_tokens == prefix_len, out.cached_tokens
        warm.append(out.timings.first_token_s)
        engine.stop()
    floor = _floor_ttft(model_name, system, suffix_len, repeats, rng)
    c, w, f = statistics.median(cold), statistics.median(warm), statistics.median(floor)
    print(f"TTFT {model_name}: {prefix_len}-token prefix + {suffix_len}-token question")
    print(f"  cold  {c * 1000:8.1f} ms")
    print(f"  warm  {w * 1000:8.1f} ms   cold/warm = {c / w:.1f}x (target >= 20x)")
    print(f"  floor {f * 1000:8.1f} ms   warm/floor = {w / f:.2f}x (target <= 1.25x)")


def _floor_ttft(
    model_name: str, system: list[int], suffix_len: int, repeats: int, rng: random.Random
) -> list[float]:
    """Plain transformers (sdpa): the prefix already in a DynamicCache, prefill the suffix
    and pick the first token."""
    model = load_model(model_name, dtype="float32", attn_implementation="sdpa").model
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([system]), cache=cache, use_cache=True)
            suffix = torch.tensor([_tokens(rng, suffix_len)])
            start = time.perf_counter()
            out = model(input_ids=suffix, cache=cache, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - start)
    return times


def bench_decode(model_name: str, max_tokens: int, repeats: int) -> None:
    model = load_model(model_name, dtype="float32")
    rng = random.Random(1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = Engine(model, EngineConfig(kv_cache_mb=256))
    engine.start()
    engine.generate(_tokens(rng, 32), params)  # warm-up
    base = 0.0
    print(f"decode throughput {model_name} ({max_tokens} tokens per request, 32-token prompts)")
    for concurrency in (1, 4, 8):
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            handles = [engine.submit(_tokens(rng, 32), params) for _ in range(concurrency)]
            outs = [h.wait() for h in handles]
            elapsed = time.perf_counter() - start
            rates.append(sum(o.completion_tokens for o in outs) / elapsed)
        rate = statistics.median(rates)
        base = base or rate
        print(f"  concurrency {concurrency}: {rate:8.1f} tok/s   ({rate / base:.2f}x of 1)")
    engine.stop()


def bench_long_decode(model_name: str, context: int, repeats: int) -> None:
    """Decode ms per step with 2 sequences over ``context``-token prompts: where the
    paged attention's gather of every block per layer shows."""
    model = load_model(model_name, dtype="float32")
    rng = random.Random(2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    engine = Engine(model, EngineConfig(kv_cache_mb=256))
    engine.start()
    engine.generate(_tokens(rng, 32), params)  # warm-up
    steps = []
    for _ in range(repeats):
        handles = [engine.submit(_tokens(rng, context), params) for _ in range(2)]
        outs = [h.wait() for h in handles]
        steps += [o.timings.decode_s / (o.completion_tokens - 1) for o in outs]
    engine.stop()
    print(
        f"decode step {model_name}, 2 sequences over {context}-token prompts: "
        f"{1000 * statistics.median(steps):.1f} ms"
    )


def bench_per_token(model_name: str, max_tokens: int, repeats: int) -> None:
    """Decode ms/token at concurrency 1: the engine vs plain transformers (sdpa +
    DynamicCache) on the same prompt, alternating in one process so both see the same load."""
    model = load_model(model_name, dtype="float32")
    ref = load_model(model_name, dtype="float32", attn_implementation="sdpa").model
    engine = Engine(model, EngineConfig(kv_cache_mb=256))
    engine.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    ours, plain = [], []
    for i in range(repeats + 1):  # the first round warms both up
        prompt = _tokens(rng, 32)
        out = engine.generate(prompt, params)
        per_token = _plain_decode_s(ref, prompt, max_tokens)
        if i:
            ours.append(out.timings.decode_s / (max_tokens - 1))
            plain.append(per_token)
    engine.stop()
    e, p = statistics.median(ours) * 1000, statistics.median(plain) * 1000
    print(f"decode per token {model_name}, concurrency 1 ({max_tokens} tokens, 32-token prompt)")
    print(f"  engine {e:7.1f} ms   plain transformers {p:7.1f} ms   engine/plain = {e / p:.2f}")


def _plain_decode_s(model: Any, prompt: list[int], max_tokens: int) -> float:
    """Seconds per token after the first, greedy, with a DynamicCache."""
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(max_tokens - 1):
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
        return (time.perf_counter() - start) / (max_tokens - 1)


def bench_rss(model_name: str) -> None:
    model = load_model(model_name, dtype="float32")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine = Engine(model, EngineConfig(kv_cache_mb=1024))
    engine.start()
    engine.generate(_tokens(random.Random(2), 500), SamplingParams(max_tokens=16))
    engine.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {model_name}, pool 1 GiB ({engine.pool.num_blocks} blocks):")
    print(f"  {peak:.0f} MiB peak (model loaded: {before:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["ttft", "decode", "long-decode", "per-token", "rss"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    if args.only in (None, "ttft"):
        bench_ttft(args.model, 2000, 30, args.repeats)
    if args.only in (None, "decode"):
        for name in ("tiny-random", args.model):
            bench_decode(name, args.decode_tokens, args.repeats)
    if args.only in (None, "long-decode"):
        bench_long_decode("tiny-random", 1500, args.repeats)
    if args.only in (None, "per-token"):
        bench_per_token(args.model, 24, args.repeats)
    if args.only in (None, "rss"):
        bench_rss(args.model)


if __name__ == "__main__":
    main()
