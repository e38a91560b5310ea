"""A GPU cost model for the simulated engine: how long one engine step takes.

One step computes, for each scheduled sequence, ``num_new`` tokens at positions
``start .. start+num_new-1`` (a prefill chunk, or one token for a decoding sequence).
Its time is::

    step_s = step_overhead_s
           + max(weights_s, token_s × Σ num_new)                          dense layers
           + Σ_slices max(kv_read_s × (start + num_new),                  attention
                          attn_pair_s × num_new × (start + (num_new + 1) / 2))

* The dense layers (QKV/O projections, MLP, LM head) are a roofline: streaming every
  weight from HBM once (``weights_s``) bounds a step from below, and past the ridge point
  (``weights_s / token_s`` tokens, a few hundred on current GPUs) compute dominates,
  ``token_s`` = 2 × parameters FLOPs per token at the achieved matmul rate.
* Attention is a roofline per sequence: reading the K/V of its whole context
  (``kv_read_s`` per token: what bounds decode), or the QKᵀ and PV products
  (``attn_pair_s`` per query-key pair, causal: a chunk's query ``i`` sees
  ``start + i + 1`` keys), which bound a long prefill chunk.
* ``step_overhead_s``: what a step costs the device beyond that (sampling, launches).

With a host KV tier (``--host-cache-mb``) a step also pays for the blocks copied back
from host memory before its prefill (``replica.sim.host``)::

    swap_in_s = host_copy_s_per_gb × promoted blocks × block bytes / 1e9

``host_copy_s_per_gb`` is 1 / the host↔device bandwidth in GB/s (a copy over PCIe from
pinned memory). A swap-in is on the step's critical path (the prefill reads those
blocks), so it is charged whole. A demotion is issued on a side stream and overlaps
compute, so a step pays only ``demote_charge`` (0..1; 0 by default) of its copy time.

The scheduler's own CPU time is not in the formula: the simulated engine spends it for
real, as the real engine does between its forward passes.

Pool size: ``kv_cache_bytes`` is the KV memory an engine leaves on that GPU for that
model; ``kv_bytes_per_token`` (2 × layers × KV heads × head dim × dtype bytes) turns it,
or a ``--kv-cache-mb`` budget, into blocks.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1024 * 1024

GB = 1e9  # bandwidths are quoted in decimal GB/s

# The cost constants (seconds, or seconds per GB) a command line may override, one flag
# each; a slowed-down device multiplies them all.
COST_FIELDS = (
    "step_overhead_s",
    "weights_s",
    "token_s",
    "attn_pair_s",
    "kv_read_s",
    "host_copy_s_per_gb",
)
# Every constant a command line may override: the costs and the demotion charge.
OVERRIDE_FIELDS = (*COST_FIELDS, "demote_charge")


@dataclass(slots=True, frozen=True)
class SimProfile:
    """One GPU serving one model: the step-time constants and the KV pool it has."""

    name: str
    description: str  # what it models and where its figures come from
    step_overhead_s: float
    weights_s: float
    token_s: float
    attn_pair_s: float
    kv_read_s: float
    host_copy_s_per_gb: float  # 1 / host<->device bandwidth (GB/s)
    demote_charge: float  # fraction of a demotion's copy time a step pays (0..1)
    kv_bytes_per_token: int
    kv_cache_bytes: int
    max_context: int

    def __post_init__(self) -> None:
        for name in COST_FIELDS:
            if not 0.0 <= getattr(self, name) < math.inf:  # inf would sleep a step forever
                raise ValueError(f"sim profile {self.name}: {name} must be >= 0 and finite")
        if not 0.0 <= self.demote_charge <= 1.0:
            raise ValueError(f"sim profile {self.name}: demote_charge must be in [0, 1]")
        if self.kv_bytes_per_token < 1 or self.kv_cache_bytes < 1 or self.max_context < 2:
            raise ValueError(f"sim profile {self.name}: pool and context sizes must be positive")

    # ------------------------------------------------------------------ step time

    def step_s(self, slices: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing ``(start, num_new)`` of each sequence."""
        tokens = 0
        attention = 0.0
        for start, num_new in slices:
            tokens += num_new
            read = self.kv_read_s * (start + num_new)
            pairs = self.attn_pair_s * num_new * (start + (num_new + 1) / 2)
            attention += read if read > pairs else pairs
        if tokens == 0:
            return 0.0
        dense = max(self.weights_s, self.token_s * tokens)
        return self.step_overhead_s + dense + attention

    def prefill_s(self, tokens: int, context: int = 0, chunk: int | None = None) -> float:
        """A prompt's ``tokens`` uncached tokens after ``context`` cached ones, alone on
        the device, in chunks of ``chunk`` tokens (one step when None)."""
        total, done = 0.0, 0
        while done < tokens:
            n = tokens - done if chunk is None else min(chunk, tokens - done)
            total += self.step_s([(context + done, n)])
            done += n
        return total

    def decode_step_s(self, batch: int, total_context: int) -> float:
        """One decode step of ``batch`` sequences holding ``total_context`` tokens."""
        if batch < 1:
            return 0.0
        mean = total_context / batch
        return self.step_s([(int(mean), 1)] * batch)

    # ------------------------------------------------------------------ host tier

    @property
    def host_gb_per_s(self) -> float | None:
        """The host<->device bandwidth; None when copies are free (a zero cost)."""
        return 1.0 / self.host_copy_s_per_gb if self.host_copy_s_per_gb > 0 else None

    def swap_in_s(self, blocks: int, block_size: int) -> float:
        """Copying ``blocks`` blocks from host memory to the device."""
        return self.host_copy_s_per_gb * blocks * self.block_bytes(block_size) / GB

    def demote_s(self, blocks: int, block_size: int) -> float:
        """What a step pays for demoting ``blocks`` blocks (the copy overlaps compute)."""
        return self.demote_charge * self.swap_in_s(blocks, block_size)

    # ------------------------------------------------------------------ pool

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def num_blocks(
        self, block_size: int, *, kv_cache_mb: float | None = None, num_blocks: int | None = None
    ) -> int:
        """``num_blocks`` if given; else a ``kv_cache_mb`` budget in this model's blocks;
        else the whole KV memory of this GPU and model."""
        if num_blocks is not None:
            blocks = num_blocks
        elif kv_cache_mb is not None:
            blocks = int(kv_cache_mb * MIB) // self.block_bytes(block_size)
        else:
            blocks = self.kv_cache_bytes // self.block_bytes(block_size)
        if blocks < 1:
            raise ValueError(
                f"the KV budget holds no block of {block_size} tokens "
                f"({self.block_bytes(block_size)} bytes each for {self.name})"
            )
        return blocks

    # ------------------------------------------------------------------ files, overrides

    def with_overrides(self, **costs: float | None) -> SimProfile:
        """This profile with the given constants (``OVERRIDE_FIELDS``) replaced (None:
        kept)."""
        changes = {k: v for k, v in costs.items() if v is not None}
        unknown = set(changes) - set(OVERRIDE_FIELDS)
        if unknown:
            raise ValueError(f"unknown sim cost constants {sorted(unknown)}; use {OVERRIDE_FIELDS}")
        if not changes:
            return self
        changed: dict[str, Any] = {"name": f"{self.name} (overridden)", **changes}
        return dataclasses.replace(self, **changed)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json_file(cls, path: Path) -> SimProfile:
        data = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - set(data)
        if missing:
            raise ValueError(f"{path}: sim profile lacks {sorted(missing)}")
        return cls(**{k: data[k] for k in fields})
