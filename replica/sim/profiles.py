"""Named cost profiles for the simulated engine, each derived from published figures.

A profile is a roofline (``replica.sim.profile``) of one GPU serving one model, built
from three kinds of input, each cited:

* the GPU's datasheet: dense BF16 tensor throughput, HBM bandwidth, memory, host
  interconnect;
  NVIDIA H100 SXM5 80 GB: 989 TFLOPS BF16 (dense; 1,979 with sparsity), 3.35 TB/s,
  80 GB, PCIe Gen5 "128 GB/s" (both directions together: 64 GB/s each way)
  (https://www.nvidia.com/en-us/data-center/h100/);
  NVIDIA A100 SXM4 80 GB: 312 TFLOPS BF16 (dense), 2,039 GB/s, 80 GB, PCIe Gen4
  "64 GB/s" (32 GB/s each way) (https://www.nvidia.com/en-us/data-center/a100/);
* the model's configuration: Llama-3.1-8B (https://huggingface.co/meta-llama/Llama-3.1-8B,
  config.json): 8.03 B parameters, 32 layers, 32 query heads, 8 KV heads, head dim 128,
  131,072 positions, BF16 weights;
* achieved fractions of peak, stated here as assumptions: 75% of HBM bandwidth for
  weight and KV streaming, 55% of peak for the dense matmuls, 50% for attention; 80% of
  one direction of PCIe for copies between pinned host memory and the device (CUDA's
  ``bandwidthTest`` typically reports about 25 GB/s on Gen4 x16 and about 50 GB/s on
  Gen5 x16: 25.6 and 51.2 GB/s here), with the KV of many blocks sent as one batched
  transfer (a transfer per block per layer would pay a launch each); and the pool vLLM
  leaves by default: 0.9 of the card's memory (``gpu_memory_utilization``) minus the
  weights minus 4 GiB for activations and CUDA graphs. A demotion to host memory runs on
  a side stream beside compute: a step pays none of it (``DEMOTE_CHARGE``).

Derived figures, to compare with published serving benchmarks of this pair (vLLM's
performance update, https://blog.vllm.ai/2024/09/05/perf-update.html; Lambda's vLLM
benchmark, https://github.com/LambdaLabsML/vllm-benchmark; Ori's H100/A100 comparison,
https://blog.ori.co/benchmarking-llama-3.1-8b-instruct-on-nvidia-h100-and-a100-chips-with-the-vllm-inferencing-engine):
``prefixgate replica --model sim --sim-profile NAME --log-level info`` prints them. When a
GPU is available, ``benchmarks/measure_sim_profile.py`` measures the built-in engine and
writes a profile file that ``--sim-profile path.json`` takes instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from replica.sim.profile import GB, MIB, SimProfile

GIB = 1024 * MIB


@dataclass(slots=True, frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense tensor-core peak
    hbm_bytes_per_s: float
    memory_bytes: int  # what the driver reports as total
    pcie_bytes_per_s: float  # host link, one direction


@dataclass(slots=True, frozen=True)
class Model:
    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """QKᵀ and PV: 2 × 2 FLOPs per head dimension, every query head, every layer."""
        return 4 * self.layers * self.heads * self.head_dim


H100_SXM = Gpu("H100 SXM5 80GB", 989e12, 3.35e12, 81_559 * MIB, 64e9)
A100_SXM = Gpu("A100 SXM4 80GB", 312e12, 2.039e12, 81_920 * MIB, 32e9)
LLAMA_31_8B = Model("Llama-3.1-8B", 8.03e9, 32, 32, 8, 128, 131_072)

BANDWIDTH_EFFICIENCY = 0.75
MATMUL_EFFICIENCY = 0.55
ATTENTION_EFFICIENCY = 0.50
PCIE_EFFICIENCY = 0.80
DEMOTE_CHARGE = 0.0
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 4 * GIB
STEP_OVERHEAD_S = 0.3e-3


def derive(name: str, gpu: Gpu, model: Model) -> SimProfile:
    """The roofline profile of ``model`` on ``gpu`` under this module's assumptions."""
    bandwidth = gpu.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY
    kv_bytes = int(
        gpu.memory_bytes * GPU_MEMORY_UTILIZATION - model.weight_bytes - ACTIVATION_RESERVE_BYTES
    )
    return SimProfile(
        name=name,
        description=f"{model.name} BF16 on one {gpu.name} (roofline from datasheet and "
        "config; see replica/sim/profiles.py)",
        step_overhead_s=STEP_OVERHEAD_S,
        weights_s=model.weight_bytes / bandwidth,
        token_s=2 * model.params / (gpu.bf16_flops * MATMUL_EFFICIENCY),
        attn_pair_s=model.attention_flops_per_pair / (gpu.bf16_flops * ATTENTION_EFFICIENCY),
        kv_read_s=model.kv_bytes_per_token / bandwidth,
        host_copy_s_per_gb=GB / (gpu.pcie_bytes_per_s * PCIE_EFFICIENCY),
        demote_charge=DEMOTE_CHARGE,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_cache_bytes=kv_bytes,
        max_context=model.max_context,
    )


def builtin_profiles() -> dict[str, SimProfile]:
    return {
        "llama3.1-8b-h100": derive("llama3.1-8b-h100", H100_SXM, LLAMA_31_8B),
        "llama3.1-8b-a100": derive("llama3.1-8b-a100", A100_SXM, LLAMA_31_8B),
    }


DEFAULT_PROFILE = "llama3.1-8b-h100"
PROFILE_NAMES = tuple(builtin_profiles())


def load_profile(name_or_path: str) -> SimProfile:
    """A builtin profile by name, or a profile file (``measure_sim_profile.py`` output)."""
    profiles = builtin_profiles()
    if name_or_path in profiles:
        return profiles[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" and path.is_file():
        return SimProfile.from_json_file(path)
    raise ValueError(
        f"unknown sim profile {name_or_path!r}: choose {', '.join(profiles)} or give a "
        "profile .json file (benchmarks/measure_sim_profile.py writes one)"
    )


def summary(profile: SimProfile, block_size: int = 16) -> str:
    """The figures a reader compares with published benchmarks."""
    prefill_2k = profile.prefill_s(2048, chunk=512)
    rate = f"{2048 / prefill_2k:,.0f} tok/s" if prefill_2k > 0 else "free"  # all costs 0
    gbps = profile.host_gb_per_s
    host = (
        f"host copies {gbps:.1f} GB/s ({1e6 * profile.swap_in_s(1, block_size):.0f} µs "
        f"per block back, {profile.demote_charge:.0%} of a demotion charged)"
        if gbps is not None
        else "host copies free"
    )
    return (
        f"{profile.name}: decode step {1e3 * profile.decode_step_s(1, 1024):.2f} ms at batch 1 "
        f"(1k context), {1e3 * profile.decode_step_s(64, 64 * 2048):.2f} ms at batch 64 "
        f"(2k each); prefill of 2,048 tokens {1e3 * prefill_2k:.0f} ms "
        f"({rate}); KV pool "
        f"{profile.num_blocks(block_size):,} blocks of {block_size} "
        f"({profile.kv_cache_bytes / GIB:.1f} GiB, {profile.kv_bytes_per_token} B/token); "
        f"{host}"
    )
