"""Engine configurations that defeat routing, named in the bridge's log from ``/metrics``.

* vLLM started with ``--disable-log-stats`` exports none of its ``vllm:`` metrics (0.32:
  the page keeps only the HTTP server's and the process's). The bridge's heartbeats then
  say 0 requests and no cache size, so each gateway sees only its own requests on that
  engine and none of the other gateways'.
* vLLM started with ``--no-enable-prefix-caching`` computes every prompt whole and
  publishes no blocks; its ``vllm:cache_config_info`` says ``enable_prefix_caching``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bridge.engine_load import parse_load, prefix_caching_off, reports_load
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
# vLLM 0.32.0's cache configuration gauge under --no-enable-prefix-caching (labels abridged).
NO_PREFIX_CACHING = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",enable_prefix_caching="False",engine="0",'
    'num_gpu_blocks="40"} 1.0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
)
pytestmark = pytest.mark.anyio
SGLANG = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 4\n"


def test_the_engines_request_gauges_are_what_says_it_reports_load() -> None:
    assert reports_load(VLLM_METRICS) and reports_load(SGLANG)
    assert not reports_load(WITHOUT_STATS)
    assert parse_load(WITHOUT_STATS, 16) == ReplicaLoad(0, 0, 0, 0, 0)
    assert prefix_caching_off(NO_PREFIX_CACHING) and reports_load(NO_PREFIX_CACHING)
    assert not prefix_caching_off(VLLM_METRICS) and not prefix_caching_off(WITHOUT_STATS)


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        (WITHOUT_STATS, "--disable-log-stats"),
        (NO_PREFIX_CACHING, "--no-enable-prefix-caching"),
        (VLLM_METRICS, None),
    ],
)
async def test_the_bridge_names_what_defeats_routing(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, metrics: str, named: str | None
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
        flags = ("--disable-log-stats", "--no-enable-prefix-caching")
        warnings = [r.message for r in caplog.records if any(f in r.message for f in flags)]
        if named is None:
            assert warnings == []
        else:
            assert len(warnings) == 1 and named in warnings[0] and http.url in warnings[0]
    finally:
        await bridge.stop()
        http.stop()
