"""Prometheus metrics of one replica, named like vLLM's with a ``prefixgate:`` prefix.

Meanings follow vLLM so existing dashboards translate: ``prefix_cache_queries_total`` and
``prefix_cache_hits_total`` count prompt tokens looked up and tokens found cached;
``kv_cache_usage_perc`` is a fraction in [0, 1]. Gauges (running, waiting, KV usage) are
read from the engine at scrape time, so they are never stale. Every app gets its own
``CollectorRegistry``: no module-level state, two apps in one process never collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from replica.cache_types import CacheStats
from router.protocol import ReplicaLoad

P = "prefixgate:"

# Buckets in seconds, spanning CPU tiny-model decode (ms) to long CPU prefills (tens of s).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0)  # fmt: skip


class _LoadCollector(Collector):
    """Gauges computed from the engine's load when Prometheus scrapes."""

    def __init__(self, load: Callable[[], ReplicaLoad]) -> None:
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._load()
        yield GaugeMetricFamily(
            P + "num_requests_running", "Requests in the running batch.", value=load.running
        )
        yield GaugeMetricFamily(
            P + "num_requests_waiting", "Requests waiting to be scheduled.", value=load.waiting
        )
        usage = load.used_blocks / load.total_blocks if load.total_blocks else 0.0
        yield GaugeMetricFamily(
            P + "kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", value=usage
        )
        yield GaugeMetricFamily(
            P + "num_queued_prefill_tokens",
            "Prompt tokens admitted or waiting but not yet prefilled.",
            value=load.queued_prefill_tokens,
        )


class _TierCollector(Collector):
    """Blocks, hit tokens and copies per KV tier (device, host), from the cache's stats
    as of the engine's last step, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        blocks = GaugeMetricFamily(
            P + "kv_tier_blocks", "KV blocks per tier: total and holding cached prefixes.",
            labels=["tier", "state"],
        )  # fmt: skip
        blocks.add_metric(["device", "total"], s.total_blocks)
        blocks.add_metric(["device", "cached"], s.cached_blocks)
        blocks.add_metric(["host", "total"], s.host_total_blocks)
        blocks.add_metric(["host", "cached"], s.host_cached_blocks)
        yield blocks
        hits = CounterMetricFamily(
            P + "prefix_cache_tier_hits",
            "Prompt tokens found cached, by the tier they were found in.",
            labels=["tier"],
        )
        hits.add_metric(["device"], s.device_hit_tokens)
        hits.add_metric(["host"], s.host_hit_tokens)
        yield hits
        moved = CounterMetricFamily(
            P + "kv_tier_moved_bytes",
            "KV bytes copied between tiers (to_host: demoted, to_device: promoted).",
            labels=["direction"],
        )
        moved.add_metric(["to_host"], s.bytes_to_host)
        moved.add_metric(["to_device"], s.bytes_to_device)
        yield moved
        moves = CounterMetricFamily(
            P + "kv_tier_moved_blocks", "KV blocks copied between tiers.", labels=["direction"]
        )
        moves.add_metric(["to_host"], s.demotions)
        moves.add_metric(["to_device"], s.promotions)
        yield moves


@dataclass(slots=True)
class ReplicaMetrics:
    """The replica's counters and histograms, registered in ``registry``."""

    load: Callable[[], ReplicaLoad]
    cache: Callable[[], CacheStats] | None = None  # per-tier gauges and counters when given
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    prefix_cache_queries: Counter = field(init=False)
    prefix_cache_hits: Counter = field(init=False)
    request_success: Counter = field(init=False)
    request_errors: Counter = field(init=False)
    time_to_first_token: Histogram = field(init=False)
    inter_token_latency: Histogram = field(init=False)
    e2e_request_latency: Histogram = field(init=False)
    queue_time: Histogram = field(init=False)
    prefill_time: Histogram = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        # The process's garbage collections by generation (python_gc_*, as vLLM's
        # /metrics has them): rare once the heap is settled (prefixgate/gc_heap.py).
        GCCollector(registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Generation tokens produced.", registry=r
        )
        self.prefix_cache_queries = Counter(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.request_success = Counter(
            P + "request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            P + "request_errors", "Requests refused or failed, by error code.", ["code"], registry=r
        )
        self.time_to_first_token = Histogram(
            P + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            P + "inter_token_latency_seconds",
            "Time between generated tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            P + "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time a request waited before its prefill.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            P + "request_prefill_time_seconds",
            "Time a request spent in prefill.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        r.register(_LoadCollector(self.load))
        if self.cache is not None:
            r.register(_TierCollector(self.cache))

    def observe_finished(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        generation_tokens: int,
        finish_reasons: list[str],
        e2e_s: float,
        queued_s: float,
        prefill_s: float,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)
        for reason in finish_reasons:
            self.request_success.labels(finished_reason=reason).inc()
        self.e2e_request_latency.observe(e2e_s)
        self.queue_time.observe(queued_s)
        self.prefill_time.observe(prefill_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
