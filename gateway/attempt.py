"""``Attempt``: one try of a request on one replica, from the router's point of view.

The router counts a replica's requests in flight and feeds each outcome to its circuit
breaker. Every call into that accounting is made here, so that every proxy path (stream,
whole answer, error pass-through, failure, retry, cancellation) starts and finishes a
request the same way, and a new path cannot forget to finish or finish twice::

    decision = router.route(keys, conversation, prompt_tokens=n)
    with Attempt(router, decision) as attempt:      # started: its tokens join the queue
        response = await upstream.post(...)
        attempt.first_byte()                        # the answer's head arrived
        ...
        attempt.prefill_done()                      # the first streamed output arrived
        ...                                         # attempt.fail() if it failed
    # finished, exactly once, however the block was left

The router learns each replica's prefill cost from the time to ``prefill_done``, so it is
called only where that time is the prefill's: at a successful stream's first body bytes
(a stream's head may come before any token). A whole answer's head comes after the whole
generation and an error's proves nothing: their tokens leave the queue at the finish.

The outcome given to the breaker is a success unless ``fail()`` was called or an
``UpstreamError`` left the block. A cancellation (the client left) or a fault of the
gateway's own gives no verdict: it is not the replica's fault, and it proves nothing
about its health either (clients giving up on a hung replica must not keep resetting its
failure count, nor close its half-open breaker). A request that never reached the replica
(``not_sent()``: no free connection in time) gives the breaker no verdict at all, and
neither does one that outlasted the gateway's wait for its answer (``timed_out()``): a
long answer that is not streamed comes whole at its end, so the time says more about the
request than the replica, whose health the probes judge. Nor does a 401 to the gateway's
own API key (``refused()``): a configuration to fix, not a failing replica; nor a 503 or
429 (``busy()``): a replica whose queue is full is busy, not broken. Any other 5xx
answer (``server_error()``) gives none at the finish either: whose fault it was depends
on the request's other attempts, and ``settle_server_errors`` decides once they are over
(router/health.py, ``attempt_verdicts``: a 5xx that another replica also gave is the
request's fault).
"""

from __future__ import annotations

import time
from types import TracebackType

from gateway.http1 import UpstreamError
from router.health import AttemptOutcome, attempt_verdicts
from router.load import InFlight
from router.router import Decision, Router


class Attempt:
    __slots__ = (
        "_request",
        "_router",
        "abandoned",
        "decision",
        "failed",
        "finished",
        "first_byte_at",
        "no_verdict",
        "replica_id",
        "sent",
        "server_errored",
        "started",
    )

    def __init__(self, router: Router, decision: Decision) -> None:
        self._router = router
        self.decision = decision
        self.replica_id = decision.replica_id
        self._request: InFlight | None = None  # the router's handle, from the start
        self.started = False
        self.finished = False
        self.failed = False
        self.sent = True
        self.server_errored = False
        self.abandoned = False  # left by an exception that is not the replica's doing
        self.no_verdict = False  # timed out, busy, or refused the gateway's credentials
        self.first_byte_at: float | None = None  # perf_counter() at the answer's head

    def __enter__(self) -> Attempt:
        if self.started:
            raise RuntimeError(f"attempt on {self.replica_id} entered twice")
        self.started = True
        d = self.decision
        self._request = self._router.request_started(
            d.replica_id, d.uncached_tokens, d.queued_tokens
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, UpstreamError):
            self.failed = True
        elif exc is not None:  # cancelled (the client left) or a fault of the gateway's
            self.abandoned = True
        self.finish()

    def first_byte(self) -> None:
        """The replica's answer began (its response head arrived); noted once."""
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()

    def prefill_done(self) -> None:
        """The replica's first output arrived: its prefill is over (the router takes the
        request's tokens off the replica's queue and learns its cost; once)."""
        if self._request is not None and not self.finished:
            self._router.first_byte(self._request)

    def fail(self) -> None:
        """The replica failed this request: the breaker hears of it at the finish."""
        self.failed = True

    def server_error(self) -> None:
        """The replica answered with a 5xx: judged with the request's other attempts."""
        self.server_errored = True

    @property
    def outcome(self) -> AttemptOutcome:
        if self.server_errored:
            return "server_error"
        return "broken" if self.failed else "answered"

    def timed_out(self) -> None:
        """No answer came within the gateway's read timeout: no verdict (see above)."""
        self.no_verdict = True

    def busy(self) -> None:
        """The replica turned the request away for now (a 503 or 429: its queue full, or
        shutting down): busy is not broken, and its health is the probes' to judge."""
        self.no_verdict = True

    def refused(self) -> None:
        """The replica refused the gateway's own credentials (a 401 to its API key): a
        fault of the gateway's configuration, which says nothing of the replica's health."""
        self.no_verdict = True

    def not_sent(self) -> None:
        """The request never reached the replica: nothing to judge it by."""
        self.sent = False

    def finish(self) -> None:
        """The replica is done with the request (the client may still be receiving it):
        the router stops counting it. Later calls, and the block's end, do nothing."""
        if self.finished or not self.started:
            return
        self.finished = True
        unjudged = (
            self.server_errored
            or not self.sent
            or self.no_verdict
            or (self.abandoned and not self.failed)
        )
        verdict = None if unjudged else not self.failed
        assert self._request is not None
        self._router.request_finished(self._request, ok=verdict)


def settle_server_errors(router: Router, attempts: list[Attempt]) -> None:
    """Once a request's attempts are over: charge each 5xx that another replica's answer
    shows to be the replica's fault (the others were judged at their finish)."""
    # Attempts that ended without an outcome (never sent, cancelled before the first byte
    # when the client left, busy, or refusing the gateway's key) prove nothing either way.
    judged = [
        a
        for a in attempts
        if a.sent and not a.no_verdict and (a.failed or a.first_byte_at is not None)
    ]
    verdicts = attempt_verdicts([a.outcome for a in judged])
    for attempt, verdict in zip(judged, verdicts, strict=True):
        if attempt.server_errored and verdict is not None:
            router.record_outcome(attempt.replica_id, verdict)
