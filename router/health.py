"""Circuit breaker per replica, fed by request outcomes (passive) and probes (active).

closed ──(breaker_failures consecutive failures)──▶ open
open ──(cooldown elapsed: allow one trial)──▶ half_open
half_open ──success──▶ closed        half_open ──failure──▶ open (cooldown restarts)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int
    cooldown_s: float
    clock: Callable[[], float]
    state: BreakerState = "closed"
    consecutive_failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def allows(self) -> bool:
        """Whether a request may be sent now (an open breaker turns half-open here)."""
        if self.state == "open":
            assert self.opened_at is not None
            if self.clock() - self.opened_at < self.cooldown_s:
                return False
            self.state = "half_open"
            self.trial_in_flight = False
        if self.state == "half_open":
            return not self.trial_in_flight
        return True

    def on_dispatch(self) -> None:
        """A request (the half-open trial, when half-open) was sent."""
        if self.state == "half_open":
            self.trial_in_flight = True

    def record(self, ok: bool) -> None:
        if ok:
            self.state = "closed"
            self.consecutive_failures = 0
            self.opened_at = None
            self.trial_in_flight = False
            return
        self.consecutive_failures += 1
        if self.state == "half_open" or self.consecutive_failures >= self.failure_threshold:
            self.state = "open"
            self.opened_at = self.clock()
            self.trial_in_flight = False

    def check_invariants(self) -> None:
        assert (self.state == "open") == (self.opened_at is not None)
        assert not self.trial_in_flight or self.state == "half_open"
