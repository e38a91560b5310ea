"""Prometheus metrics, one CollectorRegistry per app (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.health import BreakerState

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BREAKER_STATES: tuple[str, ...] = get_args(BreakerState)


class ReplicaCollector(Collector):
    """Per-replica state read from the router at scrape time, never stale."""

    def __init__(self, replicas: Callable[[], Mapping[str, Any]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "prefixgate_gateway_replica_healthy", "1 if the router routes to it", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "prefixgate_gateway_replica_in_flight", "requests in flight", labels=["replica"]
        )
        breaker = GaugeMetricFamily(
            "prefixgate_gateway_breaker_state",
            "circuit breaker state (1 for the current state)",
            labels=["replica", "state"],
        )
        for rid, view in self._replicas().items():
            healthy.add_metric([rid], 1.0 if view.healthy else 0.0)
            in_flight.add_metric([rid], float(view.in_flight))
            state = str(getattr(view.breaker_state, "value", view.breaker_state)).lower()
            for name in {*BREAKER_STATES, state}:
                breaker.add_metric([rid, name], 1.0 if name == state else 0.0)
        yield healthy
        yield in_flight
        yield breaker


class GatewayMetrics:
    """The gateway's metrics. The per-request calls (``exchange``, ``decision``) keep the
    labelled children they touched, since ``labels()`` costs a lock and a validation.

    A replica's series go at the first scrape after it left the router (its record
    expired, say): replicas come and go under their addresses (pods rescheduled), and
    kept, their series would pile up for the gateway's life."""

    __slots__ = (
        "_by_replica",
        "_children",
        "_replicas",
        "cached_tokens",
        "decisions",
        "e2e",
        "predicted_tokens",
        "registry",
        "requests",
        "retries",
        "tenant_requests",
        "tenant_tokens",
        "ttft",
        "upstream_failures",
    )

    def __init__(self, replicas: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The process's garbage collections by generation (python_gc_*, as vLLM's
        # /metrics has them): rare once the heap is settled (prefixgate/gc_heap.py).
        GCCollector(registry=r)
        self.requests = Counter(
            "prefixgate_gateway_requests",
            "requests answered, by endpoint, status and replica",
            ["endpoint", "status", "replica"],
            registry=r,
        )
        self.ttft = Histogram(
            "prefixgate_gateway_ttft_seconds",
            "time from request arrival to the first upstream byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "prefixgate_gateway_request_seconds",
            "time from request arrival to the last byte sent",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "prefixgate_gateway_routing_decisions",
            "routing decisions by reason",
            ["reason"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            "prefixgate_gateway_predicted_cached_tokens",
            "prompt tokens the router expected cached (matched blocks × block size)",
            ["replica"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "prefixgate_gateway_reported_cached_tokens",
            "prompt tokens the replica reported cached (usage.prompt_tokens_details)",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "prefixgate_gateway_retries",
            "requests retried on another replica after a failure before the first byte",
            registry=r,
        )
        self.upstream_failures = Counter(
            "prefixgate_gateway_upstream_failures",
            "upstream attempts that failed, by replica and kind",
            ["replica", "kind"],
            registry=r,
        )
        # Each tenant's use, for chargeback and to see who is near a limit (LiteLLM shows
        # the same per key). Tenants come from the keys file: a bounded set of labels.
        self.tenant_requests = Counter(
            "prefixgate_gateway_tenant_requests",
            "requests answered, by tenant and status (429: a limit of the tenant's refused it)",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "prefixgate_gateway_tenant_tokens",
            "tokens used, by tenant and kind (input, output): the answers' usage, or for a "
            "stream without one the gateway's count of the prompt and one per output event",
            ["tenant", "kind"],
            registry=r,
        )
        if replicas is not None:
            r.register(ReplicaCollector(replicas))
        self._replicas = replicas
        self._children: dict[tuple[Any, ...], Any] = {}
        self._by_replica: dict[str, list[tuple[Any, ...]]] = {}  # its children's keys

    def _child(self, metric: Any, *labels: str, replica: str | None = None) -> Any:
        """The child for ``labels``; ``replica``: the replica among them, if any."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
            if replica is not None:
                self._by_replica.setdefault(replica, []).append(key)
        return child

    def _forget_gone(self) -> None:
        """Drop the series of replicas the router no longer knows."""
        if self._replicas is None:
            return
        known = self._replicas()
        for replica in [r for r in self._by_replica if r not in known]:
            for key in self._by_replica.pop(replica):
                metric, *labels = key
                del self._children[key]
                metric.remove(*labels)

    def exchange(
        self,
        endpoint: str,
        status: int,
        replica: str | None,
        seconds: float,
        ttfb_s: float | None,
        predicted_tokens: int,
        cached_tokens: int | None,
    ) -> None:
        """One finished request: its count, latencies and cache accounting."""
        self._child(self.requests, endpoint, str(status), replica or "none", replica=replica).inc()
        self._child(self.e2e, endpoint).observe(seconds)
        if ttfb_s is not None:
            self._child(self.ttft, endpoint).observe(ttfb_s)
        if replica is not None and status < 400:
            self._child(self.predicted_tokens, replica, replica=replica).inc(predicted_tokens)
            if cached_tokens is not None:
                self._child(self.cached_tokens, replica, replica=replica).inc(cached_tokens)

    def tenant(self, tenant: str, status: int, tokens: tuple[int, int] | None) -> None:
        """One finished request of ``tenant``: its count and the tokens it used."""
        self._child(self.tenant_requests, tenant, str(status)).inc()
        if tokens is not None:
            self._child(self.tenant_tokens, tenant, "input").inc(tokens[0])
            self._child(self.tenant_tokens, tenant, "output").inc(tokens[1])

    def decision(self, reason: str) -> None:
        """A routing decision; the reason's first word is the label ("prefix_match")."""
        self._child(self.decisions, reason.split(" ", 1)[0]).inc()

    def upstream_failure(self, replica: str, kind: str) -> None:
        self._child(self.upstream_failures, replica, kind, replica=replica).inc()

    def render(self) -> bytes:
        self._forget_gone()
        return generate_latest(self.registry)
