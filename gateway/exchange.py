"""One client request as the gateway saw it: the response headers it earns, one access
log line and its metrics, recorded once when the answer is complete."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.auth import OPEN_TENANT, Tenant
from gateway.metrics import GatewayMetrics

access_log = logging.getLogger("prefixgate.gateway.access")


@dataclass(slots=True)
class Exchange:
    request_id: str
    endpoint: str
    started: float  # time.perf_counter() at arrival
    id_given: bool = True  # the request id is the client's (its x-request-id header)
    tenant: str = ""
    model: str = ""
    stream: bool = False
    replica: str | None = None
    reason: str | None = None
    matched_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    status: int = 200
    ttfb: float | None = None  # perf_counter() at the first upstream byte
    cached_tokens: int | None = None  # as the replica reported it
    usage: tuple[int, int] | None = None  # input and output tokens the answer reported
    prompt_tokens: int = 0  # the prompt's tokens as the gateway counted them
    output_events: int = 0  # streamed events with generated output
    rate_headers: tuple[tuple[bytes, bytes], ...] = ()  # x-ratelimit-*: the tenant's limits
    retries: int = 0
    responded: bool = False  # the response head went out
    finished: bool = False
    route_detail: bool = False  # the route header states the decision's figures (admit)

    def admit(self, tenant: Tenant) -> None:
        """The request is ``tenant``'s. A tenant of a keyed gateway that is no admin sees
        how its request was routed (the replica, the kind of decision, its matched
        blocks), not the decision's figures: they state every replica's queue and
        requests in flight, which is the other tenants' traffic, as ``/router/stats``
        (admin keys only) would show it."""
        self.tenant = tenant.name
        self.route_detail = tenant is OPEN_TENANT or tenant.admin

    def set_decision(self, replica_id: str, decision: Any) -> None:
        self.replica = replica_id
        self.reason = str(decision.reason)
        self.matched_blocks = int(decision.matched_blocks)
        self.total_blocks = int(decision.total_blocks)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-request-id", self.request_id.encode("latin-1"))]
        if self.replica is not None:
            reason = str(self.reason)
            if not self.route_detail:  # "prefix_match cost: r2 predicted 41 ms (...), ..."
                reason = reason.split(":", 1)[0]
            route = (
                f"{reason}; matched={self.matched_blocks}/{self.total_blocks}"
                f"; retries={self.retries}"
            )
            headers.append((b"x-prefixgate-replica", self.replica.encode("latin-1")))
            headers.append((b"x-prefixgate-route", route.encode("latin-1")))
        headers.extend(self.rate_headers)
        return headers

    def tokens(self) -> tuple[int, int] | None:
        """The input and output tokens this request used, for its tenant's accounting:
        the answer's usage, or, for a stream without one, the prompt as the gateway
        counted it and one token per output event. None for a request refused or failed
        before its answer (nothing computed that the tenant is charged for); a client that
        left is charged what it used so far."""
        if not ((self.responded and self.status < 400) or self.status == 499):
            return None
        if self.usage is not None:
            return self.usage
        if self.prompt_tokens or self.output_events:
            return self.prompt_tokens, self.output_events
        return None

    def finish(self, metrics: GatewayMetrics) -> None:
        """Record the metrics and the access log line (once)."""
        if self.finished:
            return
        self.finished = True
        end = time.perf_counter()
        ttfb = None if self.ttfb is None else self.ttfb - self.started
        predicted = self.matched_blocks * self.block_size
        metrics.exchange(
            self.endpoint,
            self.status,
            self.replica,
            end - self.started,
            ttfb,
            predicted,
            self.cached_tokens,
        )
        if self.tenant:
            metrics.tenant(self.tenant, self.status, self.tokens())
        if access_log.isEnabledFor(logging.INFO):
            line = json.dumps(self._record(end), separators=(",", ":"))
            # Straight to handle(): Logger.info would also walk the stack for a caller
            # file and line that an access line never shows (a fifth of its cost).
            record = access_log.makeRecord(
                access_log.name, logging.INFO, __file__, 0, line, (), None
            )
            access_log.handle(record)

    def _record(self, end: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "tenant": self.tenant,
            "model": self.model,
            "stream": self.stream,
            "replica": self.replica,
            "reason": self.reason,
            "status": self.status,
            "matched_blocks": self.matched_blocks,
            "total_blocks": self.total_blocks,
            "cached_tokens": self.cached_tokens,
            "retries": self.retries,
            "ttfb_ms": None if self.ttfb is None else round((self.ttfb - self.started) * 1e3, 3),
            "total_ms": round((end - self.started) * 1e3, 3),
        }
