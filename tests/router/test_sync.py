"""RedisSync against a real redis-server: events, gaps, expiry, restarts, hints."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from router.protocol import (
    REPLICAS_SET,
    ROUTED_CHANNEL,
    SNAPSHOT_STEP,
    BlockEvent,
    KeySpace,
    ReplicaInfo,
    ReplicaLoad,
    RoutedHint,
    SnapshotBlock,
    encode_snapshot,
    events_stream_key,
    replica_info_key,
    short_key,
    snapshot_key,
)
from router.router import Router
from router.sync import RedisSync
from tests.conftest import RedisServer, wait_until_async

CHAIN = [short_key(k) for k in KeySpace("m").keys(list(range(64)))]  # 4 blocks
POLL = 0.05
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def register(client: aioredis.Redis, replica_id: str, ttl_ms: int = 60_000) -> None:
    info = ReplicaInfo(replica_id, f"http://{replica_id}", "m", 16, ReplicaLoad(running=1))
    await client.sadd(REPLICAS_SET, replica_id)  # type: ignore[misc]
    await client.set(replica_info_key(replica_id), info.encode(), px=ttl_ms)


async def publish(client: aioredis.Redis, replica_id: str, event: BlockEvent) -> None:
    await client.xadd(events_stream_key(replica_id), event.encode())  # type: ignore[arg-type]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.from_url(redis_server.url)
    yield c
    await c.aclose()


def matched(router: Router, replica_id: str, keys: list[bytes] = CHAIN) -> int:
    return router.index.match(keys).get(replica_id, 0)


async def test_events_are_applied_and_a_gap_resyncs_from_the_snapshot(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    await register(client, "r0")
    await publish(client, "r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:
        assert "r0" in router.replicas and router.replicas["r0"].reported == ReplicaLoad(1)
        await wait_until_async(
            lambda: matched(router, "r0") == 2, what='matched(router, "r0") == 2'
        )
        await publish(client, "r0", BlockEvent(2, "stored", (CHAIN[2],), CHAIN[1]))
        await wait_until_async(
            lambda: matched(router, "r0") == 3, what='matched(router, "r0") == 3'
        )
        # Events 3..4 are lost; the snapshot (as of seq 4) holds the whole chain.
        blocks = [SnapshotBlock(p, k) for p, k in zip([None, *CHAIN[:-1]], CHAIN, strict=True)]
        await client.set(snapshot_key("r0"), encode_snapshot(4, blocks))
        resyncs = sync.resyncs
        await publish(client, "r0", BlockEvent(5, "removed", (CHAIN[0],)))  # gap: 3 missing
        await wait_until_async(lambda: sync.resyncs > resyncs, what="sync.resyncs > resyncs")
        # After the resync the stream is re-read: event 5 applies on top of the snapshot.
        await wait_until_async(
            lambda: router.replicas["r0"].last_seq == 5, what='router.replicas["r0"].last_seq == 5'
        )
        assert matched(router, "r0") == 0  # the head left, the rest came from the snapshot
        assert [router.index.holds("r0", k) for k in CHAIN] == [False, True, True, True]
        router.check_invariants()
    finally:
        await sync.aclose()


async def test_registry_expiry_removes_a_discovered_replica_not_a_static_one(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    router = Router()
    router.add_replica("static", "http://static", "m", static=True)
    await register(client, "static", ttl_ms=60_000)
    await register(client, "r1", ttl_ms=60_000)
    await publish(client, "r1", BlockEvent(1, "stored", tuple(CHAIN)))
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:
        await wait_until_async(
            lambda: matched(router, "r1") == 4, what='matched(router, "r1") == 4'
        )
        await client.pexpire(replica_info_key("r1"), 50)  # the heartbeat stops
        await client.pexpire(replica_info_key("static"), 50)
        await wait_until_async(
            lambda: "r1" not in router.replicas, what='"r1" not in router.replicas'
        )
        assert router.index.match(CHAIN) == {} and "r1" not in router.ring
        assert "static" in router.replicas
    finally:
        await sync.aclose()


async def test_a_resync_never_shows_an_older_snapshot_in_place_of_newer_events(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """The snapshot lags the stream: a resync (registry return, reconnect, gap) that
    applied it alone would, until the stream was read again, bring back the blocks a
    prefix cache reset cleared and put ``last_seq`` behind the reset's seq."""
    await register(client, "r0")
    await publish(client, "r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
    blocks = [SnapshotBlock(None, CHAIN[0]), SnapshotBlock(CHAIN[0], CHAIN[1])]
    await client.set(snapshot_key("r0"), encode_snapshot(1, blocks))
    await publish(client, "r0", BlockEvent(2, "cleared"))  # the reset
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:
        await wait_until_async(
            lambda: router.replicas["r0"].last_seq == 2, what="the cleared event folded in"
        )
        await sync._resync("r0")  # the follow loop's own rebuild, at a known moment
        view = router.stats()["replicas"]["r0"]
        assert (view["blocks"], view["last_seq"]) == (0, 2)
        await publish(client, "r0", BlockEvent(3, "stored", (CHAIN[0],)))
        await wait_until_async(lambda: matched(router, "r0") == 1, what="event 3 folded in")
        assert router.stats()["sequence_gaps"] == 0
        router.check_invariants()
    finally:
        await sync.aclose()


async def test_redis_restart_keeps_routing_then_reconnects_and_resyncs(
    redis_server: RedisServer,
) -> None:
    client = aioredis.from_url(redis_server.url)
    await register(client, "r0")
    await publish(client, "r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
    await client.aclose()
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:
        await wait_until_async(
            lambda: matched(router, "r0") == 2, what='matched(router, "r0") == 2'
        )
        redis_server.stop()
        await wait_until_async(lambda: not sync.connected, what="not sync.connected")
        assert router.route(CHAIN).replica_id == "r0"  # routing goes on without Redis
        redis_server.start()  # same port, empty: the replica re-registers and snapshots
        client = aioredis.from_url(redis_server.url)
        await register(client, "r0")
        blocks = [SnapshotBlock(p, k) for p, k in zip([None, *CHAIN[:-1]], CHAIN, strict=True)]
        await client.set(snapshot_key("r0"), encode_snapshot(7, blocks))
        await wait_until_async(
            lambda: sync.connected and sync.reconnects == 1,
            what="sync.connected and sync.reconnects == 1",
        )
        await wait_until_async(
            lambda: router.replicas["r0"].last_seq == 7, what='router.replicas["r0"].last_seq == 7'
        )
        await publish(client, "r0", BlockEvent(8, "cleared"))
        await wait_until_async(
            lambda: matched(router, "r0") == 0, what='matched(router, "r0") == 0'
        )
        await client.aclose()
    finally:
        await sync.aclose()


async def test_gateways_share_optimistic_inserts(redis_server: RedisServer) -> None:
    routers = [Router(seed=i) for i in range(2)]
    syncs = [RedisSync(r, redis_server.url, poll_interval_s=POLL) for r in routers]
    for router in routers:
        router.add_replica("a", "http://a", static=True)
        router.add_replica("b", "http://b", static=True)
    for sync in syncs:
        await sync.start()
    try:
        decision = routers[0].route(CHAIN)
        await wait_until_async(
            lambda: matched(routers[1], decision.replica_id) == 4,
            what="matched(routers[1], decision.replica_id) == 4",
        )
        assert routers[1].route(CHAIN).replica_id == decision.replica_id
    finally:
        for sync in syncs:
            await sync.aclose()


async def test_a_hint_routed_before_a_reset_is_dropped() -> None:
    """Another gateway's hint can arrive after this gateway folded in the replica's
    ``cleared`` event; routed against the view before it, its blocks are gone."""
    router = Router()
    router.add_replica("r0", "http://r0", "m", static=True)
    router.apply_event("r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
    router.apply_event("r0", BlockEvent(2, "cleared"))
    stale = RoutedHint.decode(RoutedHint("gw-b", "r0", tuple(CHAIN), 1).encode())
    assert stale.seq == 1
    router.apply_hint(stale)
    assert router.stats()["replicas"]["r0"]["blocks"] == 0
    router.apply_hint(RoutedHint("gw-b", "r0", tuple(CHAIN), 2))  # routed after it
    view = router.stats()["replicas"]["r0"]
    assert view["blocks"] == view["optimistic_blocks"] == 4
    # A hint without a seq (its sender had no events) is taken as before.
    assert RoutedHint.decode('{"g":"x","r":"r0","k":""}').seq is None
    router.check_invariants()


async def test_malformed_redis_data_is_skipped_and_the_sync_goes_on(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """Redis is shared by every replica and gateway, of any version: a record, event or
    hint this gateway cannot read costs that item only. Before, one raised out of the
    follow loop (or the hint loop) and ended it for good: no replica discovered or
    expired, no event folded in, from then on."""
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    # Registry records: not JSON, not an object, a wrong type, a field missing.
    bad: dict[str, str | bytes] = {
        "junk": b"\xff not json",
        "listed": b"[1, 2]",
        "typed": ReplicaInfo("typed", "http://typed", "m", 16).encode().replace("16", '"16"'),
        "partial": b'{"replica_id": "partial", "url": "http://partial"}',
        "unbracketed": ReplicaInfo("unbracketed", "http://[::1", "m", 16).encode(),
    }
    for replica_id, raw in bad.items():
        await client.sadd(REPLICAS_SET, replica_id)  # type: ignore[misc]
        await client.set(replica_info_key(replica_id), raw)
    await client.sadd(REPLICAS_SET, b"\xff\xfe")  # type: ignore[misc]  # an id that is not text
    # A newer replica's record: fields this gateway does not know are left out.
    newer = json.loads(ReplicaInfo("newer", "http://newer", "m", 16, ReplicaLoad(2)).encode())
    newer["zone"], newer["load"]["kv_offload_blocks"] = "eu-1", 7
    await client.sadd(REPLICAS_SET, "newer")  # type: ignore[misc]
    await client.set(replica_info_key("newer"), json.dumps(newer))
    await register(client, "r0")
    await client.set(snapshot_key("r0"), b"not a snapshot")  # the view comes from events
    await publish(client, "r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
    await client.xadd(events_stream_key("r0"), {"seq": "2", "type": "moved"})  # unknown
    await client.xadd(events_stream_key("r0"), {"seq": "x", "type": "removed"})  # no seq: no place
    await sync.start()
    try:
        assert set(router.replicas) == {"newer", "r0"}
        assert router.replicas["newer"].reported == ReplicaLoad(2)
        await wait_until_async(lambda: matched(router, "r0") == 2, what="event 1 folded in")
        # The unknown event kept its place in r0's sequence: the next one is no gap.
        await publish(client, "r0", BlockEvent(3, "stored", (CHAIN[2],), CHAIN[1]))
        await wait_until_async(lambda: matched(router, "r0") == 3, what="event 3 folded in")
        assert router.stats()["sequence_gaps"] == 0
        # The loop goes on: a replica registered now is found, its events folded in.
        await register(client, "r1")
        await publish(client, "r1", BlockEvent(1, "stored", tuple(CHAIN)))
        await wait_until_async(lambda: matched(router, "r1") == 4, what="r1 found, events read")
        assert sync.malformed >= len(bad) + 2
        # Hints: garbage on the channel is dropped, the next good one applies.
        await client.publish(ROUTED_CHANNEL, b'[{"g": 1}]')
        await client.publish(ROUTED_CHANNEL, b'{"g": "gw-b", "r": "r0", "k": 5}')
        await client.publish(ROUTED_CHANNEL, RoutedHint("gw-b", "newer", tuple(CHAIN)).encode())
        await wait_until_async(lambda: matched(router, "newer") == 4, what="the good hint applied")
        router.check_invariants()
    finally:
        await sync.aclose()


async def test_a_replica_id_that_left_nothing_behind_leaves_the_registry_set(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """Without this the set only grows (a pod replaced under a new name, a port that
    changed), and every gateway reads each id ever registered at every poll."""
    await register(client, "r0")
    await client.sadd(REPLICAS_SET, "gone", "resting")  # type: ignore[misc]
    await client.set(snapshot_key("resting"), encode_snapshot(3, []))  # restarting, say
    sync = RedisSync(Router(), redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:

        async def gone_from_the_set() -> bool:
            return b"gone" not in await client.smembers(REPLICAS_SET)  # type: ignore[misc]

        await wait_until_async(gone_from_the_set, what="'gone' out of the set")  # type: ignore[arg-type]
        assert await client.smembers(REPLICAS_SET) == {b"r0", b"resting"}  # type: ignore[misc]
        await register(client, "gone")  # back: it registers itself again
        await wait_until_async(lambda: "gone" in sync.router.replicas, what="'gone' found again")
    finally:
        await sync.aclose()


async def test_a_resync_reads_the_stream_back_only_to_the_snapshot(
    redis_server: RedisServer, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capped stream holds up to 100,000 events (4 s of parsing on the gateway's event
    loop, which then routes nothing); the events a resync needs are those after the
    snapshot. Pages of 100 here: the snapshot is 250 events behind a 1,000-event stream."""
    monkeypatch.setattr("router.sync._RESYNC_PAGE", 100)
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(1000)]
    for seq, key in enumerate(keys, 1):
        await publish(client, "r0", BlockEvent(seq, "stored", (key,)))
    await client.set(snapshot_key("r0"), encode_snapshot(750, [SnapshotBlock(None, keys[0])]))
    await register(client, "r0")
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    pages = 0
    await sync.start()
    try:
        await wait_until_async(lambda: router.replicas["r0"].last_seq == 1000, what="caught up")
        # The snapshot's block and the 250 events after it; none of the 749 before.
        assert [router.index.holds("r0", k) for k in keys[:3]] == [True, False, False]
        assert all(router.index.holds("r0", k) for k in keys[750:])
        assert not any(router.index.holds("r0", k) for k in keys[1:750])

        real = sync._require_client().xrevrange

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal pages
            pages += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(sync._require_client(), "xrevrange", counted)
        await sync._resync("r0")
        assert pages == 2  # pages 2 and 3 (the first is in the transaction): back to seq 701
        assert router.replicas["r0"].last_seq == 1000 and router.stats()["sequence_gaps"] == 0
        # Without a snapshot every event is needed: back to the stream's start.
        await client.delete(snapshot_key("r0"))
        pages = 0
        await sync._resync("r0")
        assert pages == 10 and all(router.index.holds("r0", k) for k in keys)  # 9, then none
        router.check_invariants()
    finally:
        await sync.aclose()


async def test_a_replica_key_of_another_type_stops_following_that_replica_only(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """One XREAD reads every replica's stream, and a key holding another type fails it
    whole (WRONGTYPE). Taken for an outage, the gateway would stop following every
    replica and rebuild all of them after each backoff."""
    await register(client, "r0")
    await register(client, "r1")
    await client.set(events_stream_key("r1"), b"not a stream")
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    await sync.start()
    try:
        await publish(client, "r0", BlockEvent(1, "stored", tuple(CHAIN[:2])))
        await wait_until_async(lambda: matched(router, "r0") == 2, what="r0 followed")
        assert sync.connected and sync.malformed >= 1 and sync.reconnects == 0
        # Fixed (the replica's next life writes a stream): followed again.
        await client.delete(events_stream_key("r1"))
        await publish(client, "r1", BlockEvent(1, "stored", tuple(CHAIN)))
        await wait_until_async(lambda: matched(router, "r1") == 4, what="r1 followed again")
        await publish(client, "r0", BlockEvent(2, "stored", (CHAIN[2],), CHAIN[1]))
        await wait_until_async(lambda: matched(router, "r0") == 3, what="r0 still followed")
        # One that is not followed still leaves when its heartbeat stops.
        await register(client, "r2")
        await client.set(snapshot_key("r2"), b"a string, as a snapshot is")
        await client.hset(events_stream_key("r2"), "not", "a stream")  # type: ignore[misc]
        await wait_until_async(lambda: "r2" in router.replicas, what="r2 found")
        await wait_until_async(lambda: "r2" in sync._wrong_type, what="r2 not followed")
        await client.pexpire(replica_info_key("r2"), 50)
        await wait_until_async(lambda: "r2" not in router.replicas, what="r2 gone")
        assert "r2" not in sync._wrong_type
        router.check_invariants()
    finally:
        await sync.aclose()


async def test_a_large_snapshot_goes_in_a_run_at_a_time_with_the_loop_serving_between(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """A 250,000-block snapshot (a host tier's) held the gateway's event loop for 0.7 s in
    one go: every token stream stalled. Runs of ``SNAPSHOT_STEP`` blocks go in with the
    loop free between them, so a task running meanwhile sees the view part-built; the
    events after the snapshot go in with the last run."""
    blocks = 5 * SNAPSHOT_STEP + 123
    keys = [i.to_bytes(16, "little") for i in range(blocks)]
    snapshot = [SnapshotBlock(None if i % 50 == 0 else keys[i - 1], k) for i, k in enumerate(keys)]
    await client.set(snapshot_key("r0"), encode_snapshot(10, snapshot))
    after = bytes(range(16))
    await publish(client, "r0", BlockEvent(11, "stored", (after,)))
    await register(client, "r0")
    router = Router()
    router.add_replica("r0", "http://r0", "m", 16, static=True)
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    sync._client = aioredis.from_url(redis_server.url)  # one rebuild, no follow loop
    seen: list[tuple[int, bool]] = []

    async def watch() -> None:
        while True:
            seen.append((router.index.blocks("r0"), router.index.holds("r0", after)))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await sync._resync("r0")
    finally:
        watcher.cancel()
        await sync._client.aclose()
    partial = [n for n, _ in seen if 0 < n < blocks]
    assert len(partial) >= 4, seen[-3:]  # the loop ran between the runs
    assert not any(held for _, held in seen)  # the later event came with the last run
    assert router.index.blocks("r0") == blocks + 1 and router.replicas["r0"].last_seq == 11
    assert router.index.match(keys[:50]) == {"r0": 50}
    router.check_invariants()


async def test_a_replica_removed_during_its_rebuild_is_not_brought_back(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    keys = [i.to_bytes(16, "little") for i in range(3 * SNAPSHOT_STEP)]
    await client.set(snapshot_key("r0"), encode_snapshot(5, [SnapshotBlock(None, k) for k in keys]))
    await register(client, "r0")
    router = Router()
    router.add_replica("r0", "http://r0", "m", 16, static=True)
    sync = RedisSync(router, redis_server.url, poll_interval_s=POLL)
    sync._client = aioredis.from_url(redis_server.url)

    removed_at: list[int] = []

    async def remove_once_begun() -> None:
        while router.index.blocks("r0") == 0:
            await asyncio.sleep(0)
        removed_at.append(router.index.blocks("r0"))
        router.remove_replica("r0")

    remover = asyncio.create_task(remove_once_begun())
    try:
        await sync._resync("r0")
        await remover
    finally:
        await sync._client.aclose()
    assert 0 < removed_at[0] < len(keys)  # removed part-way through
    assert "r0" not in router.replicas and "r0" not in router.index.replica_ids
    router.check_invariants()
