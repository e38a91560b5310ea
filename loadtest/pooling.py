"""A live run's figures pooled over its repeats.

Each workload is replayed several times per policy; the pooled run takes the hit rate,
TTFT and ITL percentiles and per-replica counts over all the repeats' requests, and the
total time, throughput, load balance, busy replicas and CPU (replicas', the row's gateway's,
the idle gateways') as medians over the repeats, so that one slow minute on a shared
machine does not decide a figure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from loadtest.cluster import COUNTERS, cluster_hit_rate
from loadtest.replay import RequestRecord, summarize


def pool_repeats(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its repeats: hit rate, TTFT and ITL percentiles and the
    per-replica counts over all their requests; total time, throughput, max/mean load,
    busy replicas and CPU seconds as medians over the repeats (total time's range and
    the worst max/mean beside them)."""
    records = [RequestRecord(**r) for run in repeats for r in run["requests"]]
    summaries = [run["summary"] for run in repeats]
    totals = [s["total_time_s"] for s in summaries]
    summary = summarize(records, statistics.median(totals), sum(s["sessions"] for s in summaries))
    loads = [s["load_max_over_mean"] for s in summaries if s["load_max_over_mean"] is not None]
    summary.update(
        repeats=len(repeats),
        total_time_s_range=[min(totals), max(totals)],
        output_tokens_per_s=statistics.median(s["output_tokens_per_s"] or 0.0 for s in summaries),
        requests_per_s=statistics.median(s["requests_per_s"] or 0.0 for s in summaries),
        load_max_over_mean=statistics.median(loads) if loads else None,
        load_max_over_mean_worst=max(loads) if loads else None,
        busy_replicas_mean=_median_of(summaries, "busy_replicas_mean"),
        replica_cpu_s=_median_of(summaries, "replica_cpu_s"),
        gateway_cpu_s=_median_of(summaries, "gateway_cpu_s"),
        other_gateways_cpu_s=_median_of(summaries, "other_gateways_cpu_s"),
    )
    stats: dict[str, dict[str, Any]] = {}
    for run in repeats:
        for name, replica_stats in run["cache_stats"].items():
            into = stats.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for k in COUNTERS:
                into[k] += int(replica_stats.get(k, 0))
    requests = [
        {**r, "repeat": run["meta"].get("repeat", i)}
        for i, run in enumerate(repeats)
        for r in run["requests"]
    ]
    meta = {k: v for k, v in repeats[0]["meta"].items() if k != "repeat"}
    return {
        "kind": "replay",
        "meta": meta,
        "config": repeats[0]["config"],
        "summary": summary,
        "requests": requests,
        "cache_stats": stats,
        "cluster_hit_rate": cluster_hit_rate(stats),
    }


def _median_of(summaries: Sequence[dict[str, Any]], field: str) -> float | None:
    values = [s[field] for s in summaries if s.get(field) is not None]
    return statistics.median(values) if values else None


def pool_cells(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cells grouped by experiment and policy (first-seen order), each group pooled."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in cells:
        key = (cell["meta"]["experiment"], cell["meta"]["policy"])
        groups.setdefault(key, []).append(cell)
    return [pool_repeats(group) for group in groups.values()]
