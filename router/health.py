"""Circuit breaker per replica, fed by request outcomes (passive) and probes (active),
and the rule that says which outcome is whose fault.

unknown ──(first success: a /health probe answered)──▶ closed
unknown ──failure──▶ unknown          (never routed to, not healthy, not counted by /ready)
closed ──(failure_threshold consecutive failures)──▶ open
open ──(cooldown elapsed: allow one trial)──▶ half_open
half_open ──success──▶ closed        half_open ──failure──▶ open (cooldown restarts)
half_open ──no verdict──▶ half_open  (the trial is over; the next request may try)

A breaker that starts ``unknown`` is honest about a replica nobody has heard from yet
(still loading its model, or a wrong address): it takes no traffic until a probe says
it answers. The gateway, which probes, starts every replica that way; the simulator and
the router's own tests, which do not probe, start them ``closed``.

Fault attribution (``attempt_verdicts``), for the attempts of one request in order:

* a connect error, a timeout, or a connection that broke mid-answer is the replica's
  fault: a failure for its breaker;
* any answer below 500 (a 4xx is the client's problem, not the replica's) is a success,
  but for a 429 which, like a 503, says the replica is full or going away: the gateway
  gives those no verdict at all (busy is not broken; gateway/attempt.py);
* a 5xx is a failure only when another replica answered the same request below 500. A
  5xx that the request also got on a second replica is the request's fault (a poison
  body), and one that could not be compared (no other replica answered) proves
  nothing: neither counts, so one client repeating a request that makes replicas fail
  cannot open breakers for everyone. A replica that fails every request is still found
  out: its requests succeed elsewhere, and its failing /health probe counts too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

BreakerState = Literal["unknown", "closed", "open", "half_open"]
AttemptOutcome = Literal["answered", "server_error", "connect_error", "timeout", "broken"]
"""How one attempt of a request ended: ``answered`` (any status below 500, whole or
streamed), ``server_error`` (a 5xx status), or no usable answer: ``connect_error``,
``timeout``, ``broken`` (the connection or stream broke after the first byte)."""


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
        if self.state == "unknown":
            return False
        if self.state == "open":
            assert self.opened_at is not None
            if self.clock() - self.opened_at < self.cooldown_s:
                return False
            self.state = "half_open"
            self.opened_at = None
            self.trial_in_flight = False
        if self.state == "half_open":
            return not self.trial_in_flight
        return True

    def on_dispatch(self) -> None:
        """A request (the half-open trial, when half-open) was sent."""
        if self.state == "half_open":
            self.trial_in_flight = True

    def record(self, ok: bool | None) -> None:
        """A request's or probe's outcome: a success, a failure, or (None) no verdict."""
        if ok is None:
            self.record_no_verdict()
            return
        if ok:
            self.state = "closed"
            self.consecutive_failures = 0
            self.opened_at = None
            self.trial_in_flight = False
            return
        if self.state == "unknown":
            return  # still nothing heard from it: it stays out until a probe succeeds
        self.consecutive_failures += 1
        if self.state == "half_open" or self.consecutive_failures >= self.failure_threshold:
            self.state = "open"
            self.opened_at = self.clock()
            self.trial_in_flight = False

    def record_no_verdict(self) -> None:
        """An outcome that says nothing about the replica (``attempt_verdicts`` gave
        None): the failure count stays; a half-open trial is over, so another may go."""
        self.trial_in_flight = False

    def check_invariants(self) -> None:
        assert (self.state == "open") == (self.opened_at is not None)
        assert not self.trial_in_flight or self.state == "half_open"
        assert self.state != "unknown" or self.consecutive_failures == 0


def attempt_verdicts(outcomes: Sequence[AttemptOutcome]) -> list[bool | None]:
    """For each attempt of one request: True (a success for that replica's breaker),
    False (a failure) or None (no verdict: the request's fault, or not provable)."""
    someone_answered = "answered" in outcomes
    verdicts: list[bool | None] = []
    for outcome in outcomes:
        if outcome == "answered":
            verdicts.append(True)
        elif outcome == "server_error":
            verdicts.append(False if someone_answered else None)
        else:
            verdicts.append(False)
    return verdicts
