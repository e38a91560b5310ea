"""The engine's event publisher as vLLM reports it (``GET /kv_event_sources``), met by
the bridge (bridge/event_sources.py).

Found as a user finds it: vLLM given ``"endpoint": "tcp://127.0.0.1:5557"`` connects its
publisher there (it binds only a wildcard), and a bridge given the same address connected
too. No socket listened, no block event ever reached Redis, and neither side said a word;
the engine served and registered as a replica whose cache routing could not see."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from bridge.service import Bridge, BridgeConfig
from router.router import Router
from router.sync import RedisSync
from tests.bridge.cluster import connected, keys, tokens
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngine, FakeEngineHTTP
from tests.conftest import RedisServer, free_port, wait_until_async

pytestmark = pytest.mark.anyio


def publishing(endpoint: str, topic: str = "", **extra: Any) -> dict[str, Any]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    return {"0": {**config, "replay_endpoint": None, "topic": topic, **extra}}


class Setup:
    def __init__(self, redis_url: str, sources: dict[str, Any], bridge_endpoint: str, **kw: Any):
        self.http = FakeEngineHTTP(model="m", metrics=VLLM_METRICS, event_sources=sources)
        self.http.start()
        self.engine_endpoint = kw.pop("engine_endpoint")
        self.engine = FakeEngine(self.engine_endpoint, None, 16, topic=kw.pop("engine_topic", ""))
        self.bridge = Bridge(
            BridgeConfig(
                self.http.url, bridge_endpoint, redis_url, model="m", check_tokenizer=False,
                heartbeat_s=0.1, info_ttl_s=1.0, **kw,
            )
        )  # fmt: skip
        self.router = Router()
        self.sync = RedisSync(self.router, redis_url, poll_interval_s=0.05)

    async def start(self) -> None:
        self.engine.start()
        await self.bridge.start()
        await self.sync.start()
        await wait_until_async(
            lambda: self.bridge.event_source_notes is not None, 10, "the publisher checked"
        )

    async def stop(self) -> None:
        await self.sync.aclose()
        await self.bridge.stop()
        self.engine.close()
        self.http.stop()

    async def events_reach_the_index(self) -> None:
        await connected(self.engine, self.bridge)
        ids = tokens(64, 9)
        self.engine.store(ids)
        rid = self.bridge.config.resolved_replica_id
        chain = keys(ids)
        await wait_until_async(
            lambda: self.router.index.match(chain).get(rid, 0) == len(chain), 10, "indexed"
        )


@pytest.fixture
async def setups(redis_server: RedisServer) -> AsyncIterator[Any]:
    made: list[Setup] = []

    async def make(sources: dict[str, Any], bridge_endpoint: str, **kw: Any) -> Setup:
        s = Setup(redis_server.url, sources, bridge_endpoint, **kw)
        made.append(s)
        await s.start()
        return s

    yield make
    for s in made:
        await s.stop()


async def test_an_engine_that_connects_to_the_bridges_address_is_met(setups: Any) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    s = await setups(publishing(address), address, engine_endpoint=address)
    assert s.bridge.event_source_notes and "now binds" in s.bridge.event_source_notes[0]
    await s.events_reach_the_index()


async def test_an_address_the_bridge_cannot_bind_is_named_with_the_flags(setups: Any) -> None:
    elsewhere = "tcp://192.0.2.1:5557"  # TEST-NET-1: never this host's
    s = await setups(publishing(elsewhere), elsewhere, engine_endpoint=elsewhere)
    notes = s.bridge.event_source_notes
    assert notes and "cannot bind" in notes[0] and "--kv-events tcp://*:PORT" in notes[0]


async def test_another_topic_is_subscribed_to(setups: Any) -> None:
    port = free_port()
    s = await setups(
        publishing(f"tcp://*:{port}", topic="kv@engine-1"),
        f"tcp://127.0.0.1:{port}",
        engine_endpoint=f"tcp://*:{port}",
        engine_topic="kv@engine-1",
        topic="kv@engine-2",
    )
    assert s.bridge.event_source_notes and "subscribed to it" in s.bridge.event_source_notes[0]
    await s.events_reach_the_index()


@pytest.mark.parametrize(
    "sources",
    [
        {},
        {"0": {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:1"}},
    ],
    ids=["no-publisher", "events-off"],
)
async def test_an_engine_without_events_is_named_with_the_flag(
    setups: Any, sources: dict[str, Any]
) -> None:
    port = free_port()
    s = await setups(sources, f"tcp://127.0.0.1:{port}", engine_endpoint=f"tcp://*:{port}")
    notes = s.bridge.event_source_notes
    assert notes and "publishes no KV events" in notes[0] and "--kv-events-config" in notes[0]


async def test_a_bridge_that_meets_its_engine_says_nothing(setups: Any) -> None:
    port = free_port()
    s = await setups(
        publishing(f"tcp://*:{port}"), f"tcp://127.0.0.1:{port}", engine_endpoint=f"tcp://*:{port}"
    )
    assert s.bridge.event_source_notes == []
    await s.events_reach_the_index()
