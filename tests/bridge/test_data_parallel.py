"""An engine with several data-parallel ranks behind one URL (vLLM's
``--data-parallel-size``): each rank caches on its own and publishes its events on the
engine's endpoints offset by its rank. A bridge per rank (``--data-parallel-rank R``),
each given the engine's own endpoints, makes each rank a replica of its own: its events,
its load, its replay, and a record that names the rank."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from bridge.cli import parse_args
from bridge.engine_load import parse_load
from bridge.service import Bridge, BridgeConfig
from bridge.zmq_source import rank_endpoint
from prefixgate.stack import pick_ports
from router.protocol import ReplicaInfo, ReplicaLoad, replica_info_key
from router.router import Router
from router.sync import RedisSync
from tests.bridge.cluster import connected, keys, tokens
from tests.bridge.fake_engine import FakeEngine, FakeEngineHTTP
from tests.conftest import RedisServer, wait_until_async

pytestmark = pytest.mark.anyio

TWO_RANKS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="40"} 1.0
vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="40"} 1.0
"""


def test_each_rank_publishes_on_the_engines_endpoint_offset_by_its_rank() -> None:
    assert rank_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert rank_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert rank_endpoint("tcp://*:5557", 1) == "tcp://*:5558"  # a bridge that binds
    assert rank_endpoint("tcp://[::1]:5557", 2) == "tcp://[::1]:5559"
    assert rank_endpoint("tcp://host:0", 2) == "tcp://host:0"  # the OS picks, as in vLLM
    assert rank_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    with pytest.raises(ValueError):
        rank_endpoint("tcp://host", 1)


def test_a_ranks_load_is_its_own() -> None:
    assert parse_load(TWO_RANKS, 16, "1") == ReplicaLoad(
        running=4, waiting=2, free_blocks=80, used_blocks=240, total_blocks=320
    )
    assert parse_load(TWO_RANKS, 16, "0").running == 1
    # The engine as a whole, as before: counts summed, pools added, usage averaged.
    whole = parse_load(TWO_RANKS, 16)
    assert (whole.running, whole.waiting, whole.total_blocks) == (5, 2, 640)


def test_the_flag() -> None:
    base = ["--engine-url", "http://e:8000", "--kv-events", "tcp://e:5557"]
    config = parse_args([*base, "--data-parallel-rank", "2"])
    assert config.data_parallel_rank == 2 and config.resolved_replica_id == "e:8000-dp2"
    assert config.events_endpoint == "tcp://e:5559"
    assert parse_args(base).data_parallel_rank is None
    with pytest.raises(SystemExit):
        parse_args([*base, "--data-parallel-rank", "-1"])
    with pytest.raises(SystemExit):  # no port to offset: refused, not a crash at start
        parse_args(
            ["--engine-url", "http://e:8000", "--kv-events", "tcp://e", "--data-parallel-rank", "1"]
        )


class Ranks:
    def __init__(self, http: FakeEngineHTTP, bridges: list[Bridge], engines: list[FakeEngine]):
        self.http, self.bridges, self.engines = http, bridges, engines

    @property
    def ids(self) -> list[str]:
        return [b.config.resolved_replica_id for b in self.bridges]


@pytest.fixture
async def ranks(redis_server: RedisServer) -> AsyncIterator[Ranks]:
    http = FakeEngineHTTP(model="m", metrics=TWO_RANKS)
    http.start()
    events, replay = pick_ports(2, set(), run=2)  # each rank: the port plus its rank
    engines = [FakeEngine(f"tcp://*:{events + r}", f"tcp://*:{replay + r}", 16) for r in (0, 1)]
    bridges = [
        Bridge(
            BridgeConfig(
                http.url,
                f"tcp://127.0.0.1:{events}",  # the engine's endpoints, as it was given them
                redis_server.url,
                replay=f"tcp://127.0.0.1:{replay}",
                model="m",
                data_parallel_rank=rank,
                check_tokenizer=False,
                heartbeat_s=0.1,
                info_ttl_s=1.0,
                replay_timeout_s=1.0,
            )
        )
        for rank in (0, 1)
    ]
    for engine in engines:
        engine.start()
    for bridge, engine in zip(bridges, engines, strict=True):
        await bridge.start()
        await connected(engine, bridge)  # each bridge hears its own rank
    yield Ranks(http, bridges, engines)
    for bridge in bridges:
        await bridge.stop()
    for engine in engines:
        engine.close()
    http.stop()


async def test_a_bridge_per_rank_makes_each_rank_a_replica(
    ranks: Ranks, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)
    await sync.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefixgate.bridge"):
            await wait_until_async(
                lambda: all(rid in router.replicas for rid in ranks.ids), 10, "both registered"
            )
        host = ranks.http.url.removeprefix("http://")
        assert ranks.ids == [f"{host}-dp0", f"{host}-dp1"]
        views = [router.replicas[rid] for rid in ranks.ids]
        assert [v.data_parallel_rank for v in views] == [0, 1]
        assert {v.url for v in views} == {ranks.http.url}
        # The whole-engine warning is for a bridge without a rank.
        assert not any("data-parallel ranks" in r.message for r in caplog.records)
        records = redis.Redis.from_url(redis_server.url)
        try:
            loads = [
                ReplicaInfo.decode(records.get(replica_info_key(rid))).load  # type: ignore[arg-type]
                for rid in ranks.ids
            ]
        finally:
            records.close()
        assert [(load.running, load.waiting) for load in loads] == [(1, 0), (4, 2)]
        # A prompt rank 1 caches is indexed on rank 1's replica alone, and one that
        # rank 0 caches, lost on the wire, is replayed from rank 0's own replay socket.
        a, b, c = tokens(64, 1), tokens(64, 2), tokens(64, 3)
        ranks.engines[1].store(a)
        ranks.engines[0].store(b, send=False)
        ranks.engines[0].store(c)
        for ids, rank in ((a, 1), (b, 0), (c, 0)):
            chain, alone = keys(ids), {ranks.ids[rank]: len(ids) // 16}

            def indexed(chain: list[bytes] = chain, alone: dict[str, int] = alone) -> bool:
                return router.index.match(chain) == alone

            await wait_until_async(indexed, 10, f"the prompt indexed on rank {rank} alone")
    finally:
        await sync.aclose()


async def test_a_rank_the_engine_does_not_have_is_named(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    http = FakeEngineHTTP(model="m", metrics=TWO_RANKS)
    http.start()
    config: dict[str, Any] = {"check_tokenizer": False, "heartbeat_s": 0.1, "model": "m"}
    bridge = Bridge(
        BridgeConfig(
            http.url, "tcp://127.0.0.1:1", redis_server.url, data_parallel_rank=2, **config
        )
    )
    try:
        with caplog.at_level(logging.WARNING, logger="prefixgate.bridge"):
            await bridge.start()
            await wait_until_async(
                lambda: any("no data-parallel rank 2" in r.message for r in caplog.records),
                10,
                "the warning",
            )
        warning = next(r.message for r in caplog.records if "rank 2" in r.message)
        assert "its ranks: 0, 1" in warning
    finally:
        await bridge.stop()
        http.stop()
