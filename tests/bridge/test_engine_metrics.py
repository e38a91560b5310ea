"""An engine whose ``/metrics`` carries no request counts is named in the bridge's log.

vLLM started with ``--disable-log-stats`` exports none of its ``vllm:`` metrics (0.32:
the page keeps only the HTTP server's and the process's). The bridge's heartbeats then
say 0 requests and no cache size, so each gateway sees only its own requests on that
engine and none of the other gateways'."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bridge.engine_load import parse_load, reports_load
from bridge.service import Bridge, BridgeConfig
from router.protocol import ReplicaLoad
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngineHTTP
from tests.conftest import RedisServer, wait_until_async

# The start of what vLLM 0.32.0 serves on /metrics under --disable-log-stats.
WITHOUT_STATS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 8125.0
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 63.0
# HELP http_request_duration_highr_seconds Latency with many buckets but no API specific labels.
# TYPE http_request_duration_highr_seconds histogram
http_request_duration_highr_seconds_bucket{le="0.01"} 3.0
http_request_duration_highr_seconds_count 3.0
"""
pytestmark = pytest.mark.anyio
SGLANG = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 4\n"


def test_the_engines_request_gauges_are_what_says_it_reports_load() -> None:
    assert reports_load(VLLM_METRICS) and reports_load(SGLANG)
    assert not reports_load(WITHOUT_STATS)
    assert parse_load(WITHOUT_STATS, 16) == ReplicaLoad(0, 0, 0, 0, 0)


@pytest.mark.parametrize(("metrics", "warned"), [(WITHOUT_STATS, True), (VLLM_METRICS, False)])
async def test_the_bridge_names_an_engine_without_request_counts(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, metrics: str, warned: bool
) -> None:
    http = FakeEngineHTTP(model="m", metrics=metrics)
    http.start()
    config: dict[str, Any] = {"check_tokenizer": False, "heartbeat_s": 0.1, "model": "m"}
    bridge = Bridge(BridgeConfig(http.url, "tcp://127.0.0.1:1", redis_server.url, **config))
    try:
        with caplog.at_level(logging.INFO, logger="prefixgate.bridge"):
            await bridge.start()
            await wait_until_async(
                lambda: any("heartbeating" in r.message for r in caplog.records), 10, "a heartbeat"
            )
        named = [r.message for r in caplog.records if "--disable-log-stats" in r.message]
        assert bool(named) == warned
        if warned:
            assert http.url in named[0] and "none of the other gateways'" in named[0]
    finally:
        await bridge.stop()
        http.stop()
