"""Compute cost of one simulated replica: prefill per uncached token, decode per batch step.

Defaults are smollm2-135m's costs on a CPU (a 2,000-token prefill ≈ 5.6 s, one decode
step ≈ 70 ms; see docs/BENCHMARKS.md, "Router: Simulation"):

* prefill costs ``prefill_s_per_token`` per uncached prompt token;
* decode runs as one continuous batch: a step advances every running request by one
  token and takes ``decode_s_per_token · (1 + batch_marginal · (b/scale − 1)⁺)`` for b
  running, so batching makes tokens cheaper but not free.
* a prefill runs in steps of at most ``prefill_chunk`` tokens, and each of those steps
  also advances the decode batch by one token (chunked prefill, as the engine's
  scheduler runs it): a prompt's prefill slows the replies running beside it.

* a prefix found on the replica's host KV tier is copied back before the prefill:
  ``swap_in_s_per_block`` per block (0 by default: a CPU replica's copy is a memcpy,
  negligible beside its prefill).

``scale`` is the replica's compute relative to one real replica: the oracle (one replica
standing in for N) has ``scale = N``, so its prefill is N× faster and its batches N×
larger for the same step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class CostModel:
    prefill_s_per_token: float = 0.0028
    decode_s_per_token: float = 0.070
    batch_marginal: float = 0.15
    swap_in_s_per_block: float = 0.0
    prefill_chunk: int = 512  # the engine's --max-prefill-tokens (tokens per step)

    def prefill_s(self, tokens: int, scale: float = 1.0) -> float:
        """Seconds to prefill ``tokens`` uncached prompt tokens."""
        return tokens * self.prefill_s_per_token / scale

    def step_s(self, batch: int, scale: float = 1.0) -> float:
        """Seconds of one decode step with ``batch`` requests running."""
        extra = max(0.0, batch / scale - 1.0)
        return self.decode_s_per_token * (1.0 + self.batch_marginal * extra)

    def swap_in_s(self, blocks: int, scale: float = 1.0) -> float:
        """Seconds to copy ``blocks`` blocks from the host tier to the device."""
        return blocks * self.swap_in_s_per_block / scale

    def prefill_steps(self, tokens: int, scale: float = 1.0) -> int:
        """Steps a prefill of ``tokens`` uncached tokens takes (at least one; ``scale``×
        the compute takes ``scale``× the tokens a step)."""
        return max(1, math.ceil(tokens / (self.prefill_chunk * scale)))
