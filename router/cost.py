"""Prefill cost per token of one replica, learned online from its times to first byte.

Each request the gateway routed is one observation: it was predicted to wait behind
``queued`` tokens and then compute ``uncached`` tokens, and its first byte came
``ttft_s`` later. The sample ``ttft_s / (queued + uncached)`` is that replica's seconds
per prefill token, as the cost model (router/policies.py) uses it. The fit:

    first sample:  cost = sample                         (replaces the prior)
    then:          cost += RATE · (clip(sample, cost / CLIP, cost · CLIP) − cost)
    always:        default / BOUND <= cost <= default · BOUND

Clipping bounds what one outlier (a stalled connection, a tiny prompt whose time is
mostly fixed overhead) can do; the exponential average follows a replica whose speed
changes; the bounds keep it positive and finite whatever the replica reports. Samples
under ``MIN_TOKENS`` tokens are skipped: their time is mostly the fixed part (one decode
step, the network), not prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = 0.1
CLIP = 4.0
BOUND = 100.0
MIN_TOKENS = 64


@dataclass(slots=True)
class PrefillCost:
    default_s: float  # seconds per token assumed before the first sample
    s_per_token: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        if self.default_s <= 0:
            raise ValueError(f"the default prefill cost must be positive, got {self.default_s}")
        if self.s_per_token <= 0:
            self.s_per_token = self.default_s

    def observe(self, tokens: int, ttft_s: float) -> None:
        """One request's predicted tokens (queued ahead + its own uncached) and TTFT."""
        if tokens < MIN_TOKENS or not ttft_s > 0:
            return
        sample = ttft_s / tokens
        cost = self.s_per_token
        if self.samples:
            sample = min(max(sample, cost / CLIP), cost * CLIP)
            cost += RATE * (sample - cost)
        else:
            cost = sample
        self.s_per_token = min(max(cost, self.default_s / BOUND), self.default_s * BOUND)
        self.samples += 1

    def check_invariants(self) -> None:
        assert self.default_s / BOUND <= self.s_per_token <= self.default_s * BOUND
