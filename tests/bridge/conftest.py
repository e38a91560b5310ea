"""Fixtures of the bridge's tests: the fake engine's HTTP side and a cluster factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from bridge.service import Bridge, BridgeConfig
from router.router import Router
from router.sync import RedisSync
from tests.bridge.cluster import Cluster, make_engine
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngineHTTP
from tests.conftest import RedisServer, wait_until_async


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def http() -> Iterator[FakeEngineHTTP]:
    server = FakeEngineHTTP(metrics=VLLM_METRICS)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def cluster_factory(redis_server: RedisServer, http: FakeEngineHTTP) -> AsyncIterator[Any]:
    made: list[Cluster] = []

    async def make(
        block_size: int = 16, connect: bool = False, snapshot_interval_s: float = 0.5, **kw: Any
    ) -> Cluster:
        engine, endpoint = make_engine(block_size, connect, **kw)
        config = BridgeConfig(
            engine_url=http.url,
            kv_events=endpoint,
            replay=engine.replay_endpoint.replace("*", "127.0.0.1"),  # type: ignore[union-attr]
            redis_url=redis_server.url,
            model="m",
            check_tokenizer=False,
            heartbeat_s=0.1,
            info_ttl_s=1.0,
            snapshot_interval_s=snapshot_interval_s,
            replay_timeout_s=1.0,
        )
        bridge = Bridge(config)
        engine.start()
        await bridge.start()
        router = Router()
        sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)
        await sync.start()
        cluster = Cluster(engine, bridge, router, sync)
        made.append(cluster)
        await cluster.connected()
        await wait_until_async(lambda: cluster.rid in router.replicas, 10, "replica registered")
        return cluster

    yield make
    for c in made:
        await c.sync.aclose()
        await c.bridge.stop()
        c.engine.close()
