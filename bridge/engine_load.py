"""An engine's load, for the heartbeat, from its Prometheus ``/metrics``.

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, KV usage as
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` in older releases, a fraction
despite the name), and the pool size in the labels of ``vllm:cache_config_info``
(``num_gpu_blocks``, ``block_size``). SGLang: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage`` and ``sglang:max_total_num_tokens``.
Values of several label sets (data-parallel ranks, models) are summed; usages averaged.
Given one data-parallel rank (``engine``: vLLM's ``engine`` label), samples labelled with
another rank are left out: each rank is a replica of its own, with its own load and pool.

Blocks are reported in prefixgate's blocks (``block_size`` tokens), as the built-in
replica does, so the router compares like with like. Neither engine exports the prompt
tokens queued for prefill; that stays 0 (the gateway counts its own in-flight tokens).
Samples that are not finite are skipped (``int(inf)`` raised OverflowError, which ended
the bridge's heartbeats), and counts below 0 read 0.
"""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from router.protocol import ReplicaLoad

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def engine_ranks(text: str) -> set[str]:
    """The ``engine`` labels of vLLM's request gauges: one per data-parallel rank behind
    the server (its internal load balancing)."""
    return {
        sample.labels["engine"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in RUNNING and "engine" in sample.labels
    }


def reports_load(text: str) -> bool:
    """Whether the page has an engine's request gauges. A vLLM started with
    ``--disable-log-stats`` exports none of its ``vllm:`` metrics (the page keeps only the
    HTTP server's and the process's), so its load reads 0 requests and 0 blocks. A page
    that is not Prometheus text says True: the heartbeat names that itself."""
    samples = _samples(text)
    return samples is None or any(sample.name in RUNNING for sample in samples)


def prefix_caching_off(text: str) -> bool:
    """Whether the page says the engine caches no prefixes: vLLM's
    ``vllm:cache_config_info`` labels carry its cache configuration, among them
    ``enable_prefix_caching`` (``"False"`` under ``--no-enable-prefix-caching``)."""
    return any(
        sample.name == "vllm:cache_config_info"
        and sample.labels.get("enable_prefix_caching") == "False"
        for sample in _samples(text) or ()
    )


def _samples(text: str) -> list[Sample] | None:
    """Every sample on the page; None when it is not Prometheus text."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        return None


def parse_load(text: str, block_size: int, engine: str | None = None) -> ReplicaLoad:
    """The load in a ``/metrics`` page (of data-parallel rank ``engine`` only, when given);
    ValueError when it is not Prometheus text."""
    sums: dict[str, float] = defaultdict(float)
    usages: list[float] = []
    capacity_tokens = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if not math.isfinite(sample.value):
                continue
            if engine is not None and sample.labels.get("engine", engine) != engine:
                continue
            if name in RUNNING:
                sums["running"] += sample.value
            elif name in WAITING:
                sums["waiting"] += sample.value
            elif name in USAGE:
                usages.append(sample.value)
            elif name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    capacity_tokens += int(blocks) * int(size)
            elif name == "sglang:max_total_num_tokens":
                capacity_tokens += int(sample.value)
    total = max(0, capacity_tokens) // block_size
    usage = min(1.0, max(0.0, sum(usages) / len(usages))) if usages else 0.0
    used = round(usage * total)
    return ReplicaLoad(
        running=max(0, int(sums["running"])),
        waiting=max(0, int(sums["waiting"])),
        free_blocks=total - used,
        used_blocks=used,
        total_blocks=total,
    )
