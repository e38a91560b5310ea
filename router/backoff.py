"""Reconnect backoff with full jitter, shared by every loop that retries Redis.

Delays double from ``base_s`` up to ``cap_s``; each wait is drawn uniformly from
``[0, delay]`` ("full jitter"), so N gateways and replicas that lost Redis together do
not reconnect in lock step. ``reset()`` after a success starts over from ``base_s``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    base_s: float
    cap_s: float
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    @property
    def ceiling_s(self) -> float:
        """The largest delay the next wait may draw."""
        return min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 62))

    def next_delay(self) -> float:
        delay = self.rng.uniform(0.0, self.ceiling_s)
        self.attempts += 1
        return delay

    async def wait(self) -> None:
        await asyncio.sleep(self.next_delay())  # reconnect backoff, not a readiness wait

    def reset(self) -> None:
        self.attempts = 0
