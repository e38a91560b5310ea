"""Load of one replica: what this gateway has in flight there, plus what other gateways
had there when the replica last reported.

A replica reports ``running + waiting`` in every heartbeat (once a second); the gateway
reads the record up to a poll interval later and then keeps reading the same record
until the next one. Taken as the load itself, that number is up to ~1.5 s old: requests
that finished since still count, and with requests that take about a second a replica
looks busy long after it is not (the live benchmark spilled a quarter of its requests
away from their cached prefixes that way). So the report is split instead:

    others = reported − what this gateway had in flight there *at the report's time*
    load   = in flight now (exact, local) + others (while the report is fresh)

With one gateway ``others`` is about 0 and the load is the exact local count; with
several, each sees the others' requests as of the last heartbeat. The in-flight count at
a past time comes from a short log of this gateway's own changes (wall-clock stamped, as
the replica's report is).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.protocol import ReplicaLoad

HISTORY_S = 10.0  # how far back the in-flight log reaches (reports older are stale anyway)


@dataclass(slots=True)
class LoadTracker:
    report_ttl_s: float = 3.0
    clock: Callable[[], float] = time.time  # wall clock: reports carry the replica's
    in_flight: int = 0
    reported: ReplicaLoad | None = None
    reported_at: float | None = None  # the report's own timestamp (replica wall clock)
    others: int = 0  # requests other gateways had there at ``reported_at``
    others_until: float = 0.0
    # (time, in flight after the change), oldest first; ``_before`` = in flight before it.
    _log: deque[tuple[float, int]] = field(default_factory=deque)
    _before: int = 0

    def started(self) -> None:
        self.in_flight += 1
        self._note()

    def finished(self) -> None:
        if self.in_flight > 0:  # a finish after a remove/re-add must not go negative
            self.in_flight -= 1
            self._note()

    def _note(self) -> None:
        now = self.clock()
        log = self._log
        log.append((now, self.in_flight))
        while len(log) > 1 and log[0][0] < now - HISTORY_S:
            self._before = log.popleft()[1]

    def in_flight_at(self, at: float) -> int:
        """This gateway's in-flight count there at wall-clock time ``at`` (as logged)."""
        value = self._before
        for t, count in self._log:
            if t > at:
                break
            value = count
        return value

    def report(self, load: ReplicaLoad, at: float | None = None) -> None:
        """The replica's report, stamped ``at`` (its wall clock; None: as of now). The
        same record read again (same stamp) changes nothing."""
        if at is not None and at == self.reported_at:
            return
        now = self.clock()
        stamp = now if at is None or at > now else at
        self.reported, self.reported_at = load, at
        mine = self.in_flight_at(stamp) if stamp < now else self.in_flight
        self.others = max(0, load.running + load.waiting - mine)
        self.others_until = stamp + self.report_ttl_s

    @property
    def load(self) -> int:
        if self.others and self.clock() < self.others_until:
            return self.in_flight + self.others
        return self.in_flight
