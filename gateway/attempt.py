"""``Attempt``: one try of a request on one replica, from the router's point of view.

The router counts a replica's requests in flight and feeds each outcome to its circuit
breaker. Every call into that accounting is made here, so that every proxy path (stream,
whole answer, error pass-through, failure, retry, cancellation) starts and finishes a
request the same way, and a new path cannot forget to finish or finish twice::

    with Attempt(router, replica_id) as attempt:   # started
        response = await upstream.post(...)
        attempt.first_byte()                        # the replica began to answer
        ...                                         # attempt.fail() if it failed
    # finished, exactly once, however the block was left

The outcome given to the breaker is a success unless ``fail()`` was called or an
``UpstreamError`` left the block: a cancellation (the client left) or a fault of the
gateway's own is not the replica's. A request that never reached the replica
(``not_sent()``: no free connection in time) gives the breaker no verdict at all.
"""

from __future__ import annotations

import time
from types import TracebackType

from gateway.http1 import UpstreamError
from router.router import Router


class Attempt:
    __slots__ = (
        "_router",
        "failed",
        "finished",
        "first_byte_at",
        "replica_id",
        "sent",
        "started",
    )

    def __init__(self, router: Router, replica_id: str) -> None:
        self._router = router
        self.replica_id = replica_id
        self.started = False
        self.finished = False
        self.failed = False
        self.sent = True
        self.first_byte_at: float | None = None  # perf_counter() at the answer's head

    def __enter__(self) -> Attempt:
        if self.started:
            raise RuntimeError(f"attempt on {self.replica_id} entered twice")
        self.started = True
        self._router.request_started(self.replica_id)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, UpstreamError):
            self.failed = True
        self.finish()

    def first_byte(self) -> None:
        """The replica's answer began (its response head arrived); noted once."""
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()

    def fail(self) -> None:
        """The replica failed this request: the breaker hears of it at the finish."""
        self.failed = True

    def not_sent(self) -> None:
        """The request never reached the replica: nothing to judge it by."""
        self.sent = False

    def finish(self) -> None:
        """The replica is done with the request (the client may still be receiving it):
        the router stops counting it. Later calls, and the block's end, do nothing."""
        if self.finished or not self.started:
            return
        self.finished = True
        self._router.request_finished(self.replica_id, ok=not self.failed if self.sent else None)
