"""The gateway's Prometheus metrics (gateway/metrics.py): a replica's series leave with it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.metrics import GatewayMetrics


def test_a_gone_replicas_series_are_dropped_at_the_next_scrape() -> None:
    """Replicas come and go under their addresses (pods rescheduled): every series
    labelled with one that left the router goes at the next scrape, the others stay,
    and one that comes back starts its series again."""
    view = SimpleNamespace(healthy=True, in_flight=0, breaker_state="closed")
    known: dict[str, Any] = {"r1": view, "r2": view}
    metrics = GatewayMetrics(lambda: known)
    for replica in ("r1", "r2"):
        metrics.exchange("chat", 200, replica, 0.5, 0.1, 32, 16)
        metrics.exchange("chat", 500, replica, 0.5, None, 0, None)
        metrics.upstream_failure(replica, "ReadError")
    metrics.exchange("chat", 503, None, 0.1, None, 0, None)  # no replica: "none"
    text = metrics.render().decode()
    lines = text.count('replica="r1"')
    assert lines >= 8 and text.count('replica="r2"') == lines  # 5 series and 3 gauges
    del known["r1"]
    text = metrics.render().decode()
    assert 'replica="r1"' not in text
    assert text.count('replica="r2"') == lines and 'replica="none"' in text
    known["r1"] = view
    metrics.exchange("chat", 200, "r1", 0.5, 0.1, 32, 16)
    text = metrics.render().decode()
    assert 'requests_total{endpoint="chat",replica="r1",status="200"} 1.0' in text
    assert 'requests_total{endpoint="chat",replica="r1",status="500"}' not in text
