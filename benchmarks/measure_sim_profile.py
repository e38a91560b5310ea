"""Measure a simulated-engine profile from the built-in engine on a GPU.

    python benchmarks/measure_sim_profile.py --model PATH_OR_NAME --device cuda:0 \\
        --name my-gpu-8b --out profiles/my-gpu-8b.json
    prefixgate replica --model sim --sim-profile profiles/my-gpu-8b.json

Times the built-in backend's step (paged batch, forward, logits of the sampled rows; CUDA
synchronised around each) on synthetic steps and fits the constants of
``replica.sim.profile``'s formula:

* ``weights_s``: a one-token decode step over a 16-token context (the weights' streaming
  floor; ``step_overhead_s`` is folded into it and set to 0);
* ``token_s`` and ``attn_pair_s``: a least-squares fit of ``a + token_s·n +
  attn_pair_s·n(n+1)/2`` to prefill steps of n = 1k…4k tokens (past the ridge point);
* ``kv_read_s``: the growth of a 32-sequence decode step from 256 to 4,096 tokens of
  context each, per context token;
* ``host_copy_s_per_gb``: the built-in host tier (``replica.host_pool.HostPool``, pinned
  memory on CUDA) copying 64 blocks back to the device, per GB moved (its per-block,
  per-layer copies, as the engine issues them); ``demote_charge`` 0 (demotions run on a
  side stream);
* the pool: ``gpu_memory_utilization`` (0.9) of the device's memory minus what the model
  and the measurement took, in the model's bytes per token.

``--device cpu --quick`` runs the same code on small sizes (a smoke test, not a profile).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from replica.engine import EngineConfig
from replica.host_pool import HostPool
from replica.models import load_model
from replica.runner import SeqSlice
from replica.sim.profile import GB, SimProfile
from replica.torch_backend import TorchBackend, TorchStep

BLOCK = 16
GPU_MEMORY_UTILIZATION = 0.9


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    def measure(fn: Callable[[], object]) -> float:
        fn()  # warm-up (kernels, allocator)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--name", default=None, help="profile name (default: model@device)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    scale = 16 if args.quick else 1
    prefill_sizes = [n // scale for n in (1024, 2048, 3072, 4096)]
    contexts = (256 // scale, 4096 // scale)
    batch = 32 // (4 if args.quick else 1)
    per_seq = (contexts[1] + BLOCK) // BLOCK + 1  # blocks of one decoding sequence
    need_blocks = max(batch * per_seq, prefill_sizes[-1] // BLOCK + 1) + 2
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    device = loaded.device
    backend = TorchBackend(loaded, EngineConfig(num_blocks=need_blocks))
    step = TorchStep(backend.pool, backend.forward)
    measure = timer(device, args.repeats)
    rng = torch.Generator().manual_seed(0)

    def run(slices: list[SeqSlice]) -> object:
        ids = torch.randint(100, 10_000, (sum(s.num_new for s in slices),), generator=rng)
        rows: list[int] = []
        total = 0
        for s in slices:
            total += s.num_new
            rows.append(total - 1)
        with torch.inference_mode():
            return step.run(slices, ids.tolist(), rows)

    def table(first: int, tokens: int) -> list[int]:
        return list(range(first, first + (tokens + BLOCK - 1) // BLOCK))

    weights_s = measure(lambda: run([SeqSlice(table(0, 17), 16, 1)]))

    def prefill_step(n: int) -> float:
        return measure(lambda: run([SeqSlice(table(0, n), 0, n)]))

    prefill = [(n, prefill_step(n)) for n in prefill_sizes]
    # t = a + token_s·n + attn_pair_s·n(n+1)/2, least squares over the prefill points.
    design = torch.tensor([[1.0, n, n * (n + 1) / 2] for n, _ in prefill], dtype=torch.float64)
    times = torch.tensor([t for _, t in prefill], dtype=torch.float64)
    _a, token_s, attn_pair_s = torch.linalg.lstsq(design, times[:, None]).solution[:, 0].tolist()

    def decode(context: int) -> float:
        slices = [SeqSlice(table(i * per_seq, context + 1), context, 1) for i in range(batch)]
        return measure(lambda: run(slices))

    short, long = decode(contexts[0]), decode(contexts[1])
    kv_read_s = max(0.0, (long - short) / (batch * (contexts[1] - contexts[0])))

    copied = min(64 // (8 if args.quick else 1), backend.pool.num_blocks)
    host = HostPool(backend.pool, copied)
    slots, blocks = list(range(copied)), list(range(copied))
    host_copy_s = measure(lambda: host.promote(slots, blocks))
    host_copy_s_per_gb = host_copy_s / (copied * host.block_bytes / GB)

    kv_bytes_per_token = backend.pool.shape.block_bytes // BLOCK
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - backend.pool.nbytes  # weights, activations, context
        kv_cache_bytes = int(total * GPU_MEMORY_UTILIZATION - used_by_others)
    else:
        kv_cache_bytes = backend.pool.nbytes
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = SimProfile(
        name=args.name or f"{args.model}@{args.device}",
        description=f"measured by benchmarks/measure_sim_profile.py: {args.model} "
        f"({loaded.dtype}) on {gpu}",
        step_overhead_s=0.0,
        weights_s=weights_s,
        token_s=max(token_s, 0.0),
        attn_pair_s=max(attn_pair_s, 0.0),
        kv_read_s=kv_read_s,
        host_copy_s_per_gb=host_copy_s_per_gb,
        demote_charge=0.0,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_bytes=max(kv_cache_bytes, kv_bytes_per_token * BLOCK),
        max_context=loaded.max_context,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.to_json())
    print(profile.to_json())
    for n, t in prefill:
        fitted = profile.step_s([(0, n)])
        print(f"prefill {n}: measured {1e3 * t:.2f} ms, profile {1e3 * fitted:.2f} ms")
    print(f"decode x{batch}: {1e3 * short:.2f} / {1e3 * long:.2f} ms at {contexts} context")
    print(
        f"host -> device: {copied} blocks in {1e3 * host_copy_s:.2f} ms "
        f"({1 / host_copy_s_per_gb:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
