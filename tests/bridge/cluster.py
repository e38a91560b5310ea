"""The bridge's test cluster: a fake engine, a real bridge, a real Redis and a real
gateway index (Router + RedisSync) reading what the bridge publishes."""

from __future__ import annotations

import random
from typing import Any

from bridge.follower import FollowStats
from bridge.service import Bridge
from prefixgate.procs import free_port
from router.protocol import KeySpace, short_key
from router.router import Router
from router.sync import RedisSync
from tests.bridge.fake_engine import FakeEngine
from tests.conftest import wait_until_async


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def keys(ids: list[int], salt: str = "", model: str = "m") -> list[bytes]:
    return [short_key(k) for k in KeySpace(model, 16, salt).keys(ids)]


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

    @property
    def follow(self) -> FollowStats:
        assert self.bridge.follower is not None
        return self.bridge.follower.stats

    def matched(self, chain: list[bytes]) -> int:
        return self.router.index.match(chain).get(self.rid, 0)

    def holds_any(self, chain: list[bytes]) -> bool:
        return any(self.router.index.holds(self.rid, k) for k in chain)

    async def wait_matched(self, chain: list[bytes], n: int | None = None) -> None:
        want = len(chain) if n is None else n
        await wait_until_async(lambda: self.matched(chain) == want, 10, f"{want} keys indexed")

    async def connected(self) -> None:
        await connected(self.engine, self.bridge)


async def connected(engine: FakeEngine, bridge: Bridge) -> None:
    """Until the bridge receives the engine's live batches (ZMQ's subscription takes a
    moment; the batches sent before it are replayed)."""

    async def probe() -> bool:
        engine.publish([])
        return await _received(bridge)

    await wait_until_async(probe, 10, "the bridge receiving batches")  # type: ignore[arg-type]


async def _received(bridge: Bridge) -> bool:
    try:
        await wait_until_async(
            lambda: bridge.follower is not None and bridge.follower.stats.batches > 0,
            0.2,
            "a batch",
        )
    except AssertionError:
        return False
    return True
