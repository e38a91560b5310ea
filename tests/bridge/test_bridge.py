"""The bridge end to end: a fake engine (real ZMQ + msgpack in vLLM's format) → the bridge
→ a real Redis → a real gateway index (Router + RedisSync)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from bridge.service import Bridge, BridgeConfig
from prefixgate.procs import free_port
from router.protocol import KeySpace, short_key
from router.router import Router
from router.sync import RedisSync
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngine, FakeEngineHTTP
from tests.conftest import RedisServer, wait_until, wait_until_async

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def keys(ids: list[int], salt: str = "", model: str = "m") -> list[bytes]:
    return [short_key(k) for k in KeySpace(model, 16, salt).keys(ids)]


@pytest.fixture
def http() -> Iterator[FakeEngineHTTP]:
    server = FakeEngineHTTP(metrics=VLLM_METRICS)
    server.start()
    yield server
    server.stop()


def make_engine(block_size: int = 16, connect: bool = False, **kw: Any) -> tuple[FakeEngine, str]:
    """A fake engine and the endpoint the bridge must use."""
    port, replay = free_port(), free_port()
    if connect:  # the engine connects to a bridge that binds
        engine = FakeEngine(f"tcp://127.0.0.1:{port}", f"tcp://*:{replay}", block_size, **kw)
        return engine, f"tcp://*:{port}"
    engine = FakeEngine(f"tcp://*:{port}", f"tcp://*:{replay}", block_size, **kw)
    return engine, f"tcp://127.0.0.1:{port}"


class Cluster:
    def __init__(self, engine: FakeEngine, bridge: Bridge, router: Router, sync: RedisSync):
        self.engine, self.bridge, self.router, self.sync = engine, bridge, router, sync

    @property
    def rid(self) -> str:
        return self.bridge.config.resolved_replica_id

    def matched(self, chain: list[bytes]) -> int:
        return self.router.index.match(chain).get(self.rid, 0)

    def holds_any(self, chain: list[bytes]) -> bool:
        return any(self.router.index.holds(self.rid, k) for k in chain)

    async def wait_matched(self, chain: list[bytes], n: int | None = None) -> None:
        want = len(chain) if n is None else n
        await wait_until_async(lambda: self.matched(chain) == want, 10, f"{want} keys indexed")

    async def connected(self) -> None:
        """Until the bridge receives live batches (ZMQ's subscription takes a moment; the
        batches sent before it are replayed)."""

        async def probe() -> bool:
            self.engine.publish([])
            return await _received(self.bridge)

        await wait_until_async(probe, 10, "the bridge receiving batches")  # type: ignore[arg-type]


async def _received(bridge: Bridge) -> bool:
    try:
        await wait_until_async(lambda: bridge.stats.batches > 0, 0.2, "a batch")
    except AssertionError:
        return False
    return True


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


async def test_engine_blocks_become_the_protocols_keys_in_the_index(
    cluster_factory: Any, http: FakeEngineHTTP
) -> None:
    c = await cluster_factory(16, int_hashes=True, array_like_events=True)
    replica = c.router.replicas[c.rid]
    assert replica.url == http.url and replica.model == "m" and replica.block_size == 16
    await wait_until_async(lambda: c.router.replicas[c.rid].reported.running == 3, 5, "load")
    assert c.router.replicas[c.rid].reported.total_blocks == 40 * 128 // 16
    ids = tokens(200, 1)
    c.engine.store(ids)
    await c.wait_matched(keys(ids))  # 12 full blocks; the 8-token tail has no key
    longer = ids[:192] + tokens(64, 2)
    c.engine.store(longer)  # shares 12 blocks, adds 4
    await c.wait_matched(keys(longer))
    c.bridge.translator.check_invariants()  # type: ignore[union-attr]


async def test_connect_mode_128_token_blocks_and_salts(cluster_factory: Any) -> None:
    c = await cluster_factory(128, connect=True)
    ids = tokens(300, 3)
    c.engine.store(ids, salt="tenant-a")
    salted = keys(ids[:256], salt="tenant-a")
    await c.wait_matched(salted)
    assert len(salted) == 16
    assert c.matched(keys(ids)) == 0  # the shared namespace holds nothing
    c.engine.store(ids, lora_name="adapter-1")
    await c.wait_matched(keys(ids[:256], model="adapter-1"))


async def test_removals_and_clears_land(cluster_factory: Any) -> None:
    c = await cluster_factory(128)
    ids = tokens(512, 4)
    hashes = c.engine.store(ids)
    chain = keys(ids)
    await c.wait_matched(chain)
    c.engine.drop(hashes[2:])  # the last two 128-token blocks: 16 keys
    await wait_until_async(lambda: not c.holds_any(chain[16:]), 10, "removed keys gone")
    assert c.matched(chain) == 16
    c.engine.clear()
    await wait_until_async(lambda: not c.holds_any(chain), 10, "cleared")


async def test_a_gap_is_replayed(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 5), tokens(64, 6)
    c.engine.store(a, send=False)  # lost on the wire, still in the replay buffer
    c.engine.store(b)
    await c.wait_matched(keys(a))
    await c.wait_matched(keys(b))
    assert c.bridge.stats.replays_ok >= 1 and c.bridge.stats.resets == 0


async def test_a_gap_that_cannot_be_replayed_leaves_no_stale_key(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 7), tokens(64, 8)
    hashes = c.engine.store(a)
    await c.wait_matched(keys(a))
    c.engine.drop(hashes, send=False, replayable=False)  # the removal is lost for good
    c.engine.store(b)
    await c.wait_matched(keys(b))
    assert not c.holds_any(keys(a))
    assert c.bridge.stats.replays_failed == 1
    # A child of a block from before the gap is not guessed.
    c.engine.store(b + tokens(16, 9))
    c.engine.store(a + tokens(32, 10))
    await c.wait_matched(keys(a + tokens(32, 10)))  # a's blocks are new again: whole chain


async def test_a_restarted_engine_starts_a_new_sequence(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 11), tokens(64, 12)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    c.engine.restart()  # new process: empty cache, seq from 0
    c.engine.store(b)  # may be sent before the bridge has reconnected: replayed then

    def nudged() -> bool:  # a live engine keeps sending batches; so does this one
        c.engine.publish([])
        return c.matched(keys(b)) == 4

    await wait_until_async(nudged, 10, "the new life's blocks indexed")
    assert not c.holds_any(keys(a))
    assert c.bridge.stats.engine_restarts == 1


async def test_a_bridge_that_starts_late_replays_the_engines_history(
    redis_server: RedisServer, http: FakeEngineHTTP, cluster_factory: Any
) -> None:
    engine, endpoint = make_engine(16)
    engine.start()
    try:
        a = tokens(64, 13)
        engine.store(a)  # nobody listens yet: only the replay buffer has it
        config = BridgeConfig(
            http.url,
            endpoint,
            redis_server.url,
            replay=engine.replay_endpoint.replace("*", "127.0.0.1"),  # type: ignore[union-attr]
            model="m",
            check_tokenizer=False,
            heartbeat_s=0.1,
            info_ttl_s=1.0,
        )
        bridge = Bridge(config)
        await bridge.start()
        router = Router()
        sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)
        await sync.start()
        c = Cluster(engine, bridge, router, sync)
        try:
            await c.connected()
            await c.wait_matched(keys(a))
        finally:
            await sync.aclose()
            await bridge.stop()
    finally:
        engine.close()


async def test_survives_redis_and_engine_http_restarts(
    cluster_factory: Any, redis_server: RedisServer, http: FakeEngineHTTP
) -> None:
    c = await cluster_factory(16, snapshot_interval_s=3600.0)
    a = tokens(64, 14)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    redis_server.restart()  # an empty Redis: registry, stream and snapshot gone
    b = tokens(64, 15)
    c.engine.store(b)
    await wait_until_async(
        lambda: c.matched(keys(a)) == 4 and c.matched(keys(b)) == 4, 20, "resynced after restart"
    )
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:  # late gateways find a snapshot in the restarted Redis
        wait_until(lambda: client.exists(f"prefixgate:snapshot:{c.rid}"), 10, "snapshot")
    finally:
        client.close()
    # The engine's HTTP side goes away: no heartbeat, the record expires, gateways drop it.
    port = http.port
    http.stop()
    await wait_until_async(lambda: c.rid not in c.router.replicas, 15, "replica expired")
    http.port = port
    http.start()
    await wait_until_async(lambda: c.rid in c.router.replicas, 15, "replica back")
    await c.wait_matched(keys(a))


def test_the_bridge_process_serves_and_stops_cleanly(
    redis_server: RedisServer, http: FakeEngineHTTP, tmp_path: Any
) -> None:
    """``prefixgate bridge`` as a process, in connect mode, the model name from /v1/models."""
    import redis

    engine, endpoint = make_engine(16, connect=True)
    cmd = [
        sys.executable,
        "-m",
        "prefixgate",
        "bridge",
        "--engine-url",
        http.url,
        "--kv-events",
        endpoint,
        "--replay",
        engine.replay_endpoint.replace("*", "127.0.0.1"),  # type: ignore[union-attr]
        "--redis-url",
        redis_server.url,
        "--no-tokenizer-check",
        "--heartbeat-s",
        "0.1",
    ]
    log = tmp_path / "bridge.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    client = redis.Redis.from_url(redis_server.url)
    rid = f"127.0.0.1:{http.port}"
    try:
        engine.start()
        wait_until(lambda: client.get(f"prefixgate:replica:{rid}"), 20, "registry record")
        ids = tokens(64, 16)
        want = {k.hex() for k in keys(ids)}

        def published() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log.read_text())
            # ZMQ drops what a PUB sends before the subscription is up (the slow joiner):
            # the engine forgets the blocks so each poll sends them again; duplicates
            # change nothing in the bridge.
            engine.cached.clear()
            engine.store(ids)
            entries: Any = client.xrange(f"prefixgate:events:{rid}")
            got = {
                fields[b"keys"].decode()[i : i + 32]
                for _, fields in entries
                for i in range(0, len(fields[b"keys"]), 32)
            }
            return want <= got

        wait_until(published, 20, "keys in the event stream")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()
        assert client.get(f"prefixgate:replica:{rid}") is None  # deregistered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
        engine.close()
