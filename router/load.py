"""Load of one replica, in requests and in queued prefill tokens: what this gateway has
in flight there, plus what other gateways had there when the replica last reported.

A replica reports ``running + waiting`` in every heartbeat (once a second); the gateway
reads the record up to a poll interval later and then keeps reading the same record
until the next one. Taken as the load itself, that number is up to ~1.5 s old: requests
that finished since still count, and with requests that take about a second a replica
looks busy long after it is not, which sends requests away from their cached prefixes.
So the report is split instead:

    others = reported − what this gateway had in flight there *at the report's time*
    load   = in flight now (exact, local) + others (while the report is fresh)

With one gateway ``others`` is about 0 and the load is the exact local count; with
several, each sees the others' requests as of the last heartbeat. The in-flight count at
a past time comes from a short log of this gateway's own changes (wall-clock stamped, as
the replica's report is).

The replica's clock is not this gateway's: hosts without NTP drift seconds apart. A
report is read some time after it is made, from 0 to a poll interval, so ``read time −
stamp`` is that delay plus the clocks' offset. The smallest of the last ``SKEW_REPORTS``
is taken as the offset alone (as if the quickest read were instant) once it is beyond
``SKEW_TOLERANCE_S`` either way, and every stamp is moved by it onto this gateway's
clock; a smaller one cannot be told from a read that came late, so stamps are taken as
they are (never later than now). A replica clock stepped back takes that many reports to
be trusted again; one stepped forward, one.

Queued prefill tokens follow the same split: this gateway's own are the predicted
uncached tokens of its requests there that have not sent their first byte yet (less
what the prompt being prefilled has computed, router/router.py); the others' are the
replica's ``queued_prefill_tokens`` less this gateway's own at the report's time, that
part subtracted too.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from router.protocol import ReplicaLoad

HISTORY_S = 10.0  # how far back the in-flight log reaches (reports older are stale anyway)
SKEW_REPORTS = 16  # reports whose quickest read gives the replica's clock offset
SKEW_TOLERANCE_S = 1.0  # a smaller offset is not told apart from a late read


@dataclass(slots=True, eq=False)
class InFlight:
    """One request this gateway sent to a replica, from dispatch to its end
    (``Router.request_started`` / ``first_byte`` / ``request_finished``)."""

    replica_id: str
    uncached_tokens: int  # predicted: counted in the replica's queue until the first byte
    queued_tokens: int  # predicted queue ahead of it at dispatch (the cost fit's input)
    started_at: float  # router clock
    running: int = 0  # other requests in flight there at dispatch (the cost fit's input)
    queued: bool = True  # its uncached tokens still count in the queue
    done: bool = False


@dataclass(slots=True)
class LoadTracker:
    report_ttl_s: float = 3.0
    clock: Callable[[], float] = time.time  # wall clock: reports carry the replica's
    in_flight: int = 0  # this gateway's requests there, until finished
    queued_tokens: int = 0  # their predicted uncached tokens, until first byte or failure
    reported: ReplicaLoad | None = None
    reported_at: float | None = None  # the report's own timestamp (replica wall clock)
    others: int = 0  # requests other gateways had there at ``reported_at``
    others_tokens: int = 0  # prefill tokens queued there beyond ours at ``reported_at``
    others_until: float = 0.0
    # (time, in flight, queued tokens) after each change, oldest first; ``_before``:
    # the same pair before the oldest change kept.
    _log: deque[tuple[float, int, int]] = field(default_factory=deque)
    _before: tuple[int, int] = (0, 0)
    # read time − stamp of the last reports: the smallest is the replica clock's offset
    _lags: deque[float] = field(default_factory=lambda: deque(maxlen=SKEW_REPORTS))

    def started(self, tokens: int = 0) -> None:
        """A request sent there, predicted to compute ``tokens`` uncached tokens."""
        self.in_flight += 1
        self.queued_tokens += tokens
        self._note()

    def first_byte(self, tokens: int) -> None:
        """A request's prefill is done: its ``tokens`` leave the queue."""
        self.queued_tokens -= tokens
        self._note()

    def finished(self, tokens: int = 0) -> None:
        """A request ended; ``tokens``: its tokens still queued (it failed before its
        first byte)."""
        self.in_flight -= 1
        self.queued_tokens -= tokens
        self._note()

    def _note(self) -> None:
        now = self.clock()
        log = self._log
        log.append((now, self.in_flight, self.queued_tokens))
        while len(log) > 1 and log[0][0] < now - HISTORY_S:
            _t, count, tokens = log.popleft()
            self._before = (count, tokens)

    def in_flight_at(self, at: float) -> int:
        """This gateway's in-flight count there at wall-clock time ``at`` (as logged)."""
        return self._at(at)[0]

    def _at(self, at: float) -> tuple[int, int]:
        value = self._before
        for t, count, tokens in self._log:
            if t > at:
                break
            value = (count, tokens)
        return value

    def report(
        self,
        load: ReplicaLoad,
        at: float | None = None,
        drained: Callable[[float], int] | None = None,
    ) -> None:
        """The replica's report, stamped ``at`` (its wall clock; None: as of now). The
        same record read again (same stamp) changes nothing. ``drained(t)``: of this
        gateway's queued tokens at wall time ``t`` (the report's, on this clock), those
        the router takes as computed already (the prompt being prefilled,
        router/router.py): not the others'."""
        if at is not None and at == self.reported_at:
            return
        now = self.clock()
        stamp = now if at is None else self._local(at, now)
        self.reported, self.reported_at = load, at
        count, tokens = self._at(stamp) if stamp < now else (self.in_flight, self.queued_tokens)
        self.others = max(0, load.running + load.waiting - count)
        done = drained(stamp) if drained is not None else 0
        self.others_tokens = max(0, load.queued_prefill_tokens - (tokens - done))
        self.others_until = stamp + self.report_ttl_s

    def _local(self, at: float, now: float) -> float:
        """A report's stamp ``at`` (the replica's clock), read at ``now``, on this
        gateway's clock (the module's docstring)."""
        self._lags.append(now - at)
        offset = min(self._lags)
        return min(now, at + offset if abs(offset) > SKEW_TOLERANCE_S else at)

    @property
    def fresh(self) -> bool:
        return self.clock() < self.others_until

    @property
    def load(self) -> int:
        """Requests there: ours, plus the others' while the report is fresh."""
        if self.others and self.fresh:
            return self.in_flight + self.others
        return self.in_flight

    @property
    def queued(self) -> int:
        """Prefill tokens queued there: ours, plus the others' while the report is fresh."""
        if self.others_tokens and self.fresh:
            return self.queued_tokens + self.others_tokens
        return self.queued_tokens

    def check_invariants(self) -> None:
        assert self.in_flight >= 0 and self.queued_tokens >= 0
        assert self.others >= 0 and self.others_tokens >= 0


@dataclass(slots=True)
class BusyShare:
    """Each replica's recent busy time, sampled at this gateway's routing decisions
    (CacheAware's balance price).

    At every decision each candidate that has requests in flight (or is chosen) scores
    1, and every score first decays by ``1 − 1/(window × candidates)``: a count over
    about the last ``window`` decisions per replica. Requests arrive independently of
    any one replica's state, so the fraction of decisions that find a replica busy
    estimates the fraction of time it is busy, with no clock. A replica's ratio is its
    count over the candidates' mean, both plus a prior of ``window`` (1: its fair
    share; under 1: idle lately), so the first decisions do not swing it; ``weight``
    grows from 0 to 1 over the first ``window`` decisions (no history, no evidence).

    The decay is kept as one growing ``scale`` (counts are stored × scale; a new point
    adds ``scale``), so a decision touches only the replicas it scores: O(busy).

    A pause in the traffic is no pause in time: a gap between decisions of more than
    ``pause`` × the usual gap (a decayed mean) counts as the decisions it would have
    held beyond that, each of which would have found every replica idle (the requests
    in flight when the traffic stopped finish within seconds). So the shares of the
    replicas that served the traffic before a pause (a night, a finished job) fade with
    the pause's length, instead of pricing those replicas, which still hold that
    traffic's prefixes, out of the next burst. Steady traffic is left alone: its gaps
    rarely reach 8 × the mean (an exponential gap, 1 in 3,000). Nor is a gap under
    ``PAUSE_MIN_S`` a pause, whatever the mean: a burst's requests come milliseconds
    apart and the next ones when replies end, and from such a start the mean takes
    dozens of decisions to grow. ``pause`` 0: off."""

    PAUSE_MIN_S: ClassVar[float] = 1.0

    window: float
    pause: float = 8.0
    counts: dict[str, float] = field(default_factory=dict)  # stored × scale
    scale: float = 1.0
    decisions: int = 0  # seen, up to ``window``
    last_at: float | None = None  # the last decision's time (``elapse``)
    gap_s: float = 0.0  # the decayed mean gap between decisions (0: none seen yet)

    @property
    def weight(self) -> float:
        return min(1.0, self.decisions / self.window)

    def count(self, replica_id: str) -> float:
        return self.counts.get(replica_id, 0.0) / self.scale

    def terms(self, replica_ids: list[str]) -> tuple[float, float]:
        """``(prior, per_mean)``: replica r's ratio among ``replica_ids`` is
        ``(counts.get(r, 0) + prior) × per_mean`` (in stored units; the hot path's form)."""
        prior, counts = self.window * self.scale, self.counts
        total = sum([counts.get(r, 0.0) for r in replica_ids]) + prior * len(replica_ids)
        return prior, len(replica_ids) / total

    def ratios(self, replica_ids: list[str]) -> dict[str, float]:
        """Each replica's count over the mean of ``replica_ids``', with the prior."""
        prior, per_mean = self.terms(replica_ids)
        counts = self.counts
        return {r: (counts.get(r, 0.0) + prior) * per_mean for r in replica_ids}

    def elapse(self, now: float, candidates: int) -> None:
        """A decision among ``candidates`` replicas is about to be made at ``now``: the
        gap since the last one beyond ``pause`` × the usual gap decays every count as
        that many decisions among idle replicas would (all of them, past ~50 windows)."""
        last, self.last_at = self.last_at, now
        if last is None or not self.pause:
            return
        gap = max(0.0, now - last)
        mean = self.gap_s
        if not mean:
            self.gap_s = gap
            return
        # A pause's length does not stretch the usual gap.
        self.gap_s = mean + (min(gap, self.pause * mean) - mean) / self.window
        idle_decisions = gap / mean - self.pause
        if idle_decisions <= 0.0 or gap < self.PAUSE_MIN_S:
            return
        keep = (1.0 - 1.0 / (self.window * candidates)) ** min(idle_decisions, 1e9)
        if keep < 1e-20:
            self.counts.clear()  # all but forgotten
            self.scale = 1.0
        else:
            self.scale /= keep
            self._fold()

    def decided(self, busy: list[str], chosen: str, candidates: int) -> None:
        """One decision among ``candidates`` replicas: those in ``busy`` had requests in
        flight; ``chosen`` gets this one."""
        if self.decisions < self.window:
            self.decisions += 1
        self.scale /= 1.0 - 1.0 / (self.window * candidates)
        counts, point = self.counts, self.scale
        for r in busy:
            counts[r] = counts.get(r, 0.0) + point
        if chosen not in busy:
            counts[chosen] = counts.get(chosen, 0.0) + point
        self._fold()

    def _fold(self) -> None:
        """Fold the scale back into the counts once it is large (rarely: every ~230 ×
        window × candidates decisions, or after a pause)."""
        point = self.scale
        if point > 1e100:
            counts = self.counts
            for r in list(counts):
                counts[r] /= point
                if counts[r] < 1e-6:
                    del counts[r]  # decayed away (a replica gone: its entry goes with it)
            self.scale = 1.0

    def check_invariants(self) -> None:
        assert self.scale >= 1.0 and 0 <= self.decisions <= max(1, math.ceil(self.window))
        assert all(v > 0.0 for v in self.counts.values())
