"""Load of one replica: what this gateway has in flight there, and what it last reported.

Combined load = max(local in-flight, reported running + waiting). With one gateway the
report only lags the local count; with several, the report also covers the requests
the other gateways sent, which the local count cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.protocol import ReplicaLoad


@dataclass(slots=True)
class LoadTracker:
    in_flight: int = 0
    reported: ReplicaLoad | None = None
    reported_at: float | None = None

    def started(self) -> None:
        self.in_flight += 1

    def finished(self) -> None:
        if self.in_flight > 0:  # a finish after a remove/re-add must not go negative
            self.in_flight -= 1

    def report(self, load: ReplicaLoad, now: float) -> None:
        self.reported = load
        self.reported_at = now

    @property
    def load(self) -> int:
        if self.reported is None:
            return self.in_flight
        return max(self.in_flight, self.reported.running + self.reported.waiting)
