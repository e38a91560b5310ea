"""The Redis publisher against a real redis-server: registry, events, snapshots, outages.

The cache side is driven directly through the listener methods, from a separate thread as
the engine does; the HTTP-level tests in test_server.py cover the whole replica.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from replica.publisher import Publisher, PublisherConfig
from router.protocol import (
    REPLICAS_SET,
    RETAIN_S,
    BlockEvent,
    ReplicaInfo,
    ReplicaLoad,
    decode_snapshot,
    encode_snapshot,
    events_stream_key,
    replica_info_key,
    short_key,
    snapshot_key,
)
from router.replica_redis import STREAM_MAXLEN, ReplicaRedis
from router.router import Router
from router.sync import RedisSync
from tests.conftest import RedisServer, wait_until_async
from tests.support.faults import fail_writes_once

RID = "r-test"


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def _config(url: str, **overrides: float) -> PublisherConfig:
    cfg = PublisherConfig(
        redis_url=url,
        replica_id=RID,
        url="http://127.0.0.1:9999",
        model="tiny-random",
        block_size=16,
        heartbeat_s=0.05,
        info_ttl_s=1.0,
        snapshot_interval_s=0.2,
        min_backoff_s=0.02,
        max_backoff_s=0.1,
        redis_timeout_s=0.3,
    )
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def _events(client: redis.Redis) -> list[BlockEvent]:
    entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(events_stream_key(RID))  # type: ignore[assignment]
    return [BlockEvent.decode(fields) for _, fields in entries]


def _in_thread(fn: Callable[[], None]) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


def test_registry_events_and_snapshot(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    load = ReplicaLoad(running=2, waiting=1, free_blocks=10, used_blocks=6, total_blocks=16)
    pub = Publisher(_config(redis_server.url))
    s = pub.stats.seq  # this life's events are numbered from s + 1
    a, b, c, d = (_key(i) for i in range(4))

    async def scenario() -> None:
        await pub.start(lambda: load)
        await wait_until_async(lambda: client.exists(replica_info_key(RID)) == 1)
        info = ReplicaInfo.decode(client.get(replica_info_key(RID)))  # type: ignore[arg-type]
        assert (info.replica_id, info.url, info.model, info.block_size) == (
            RID,
            "http://127.0.0.1:9999",
            "tiny-random",
            16,
        )
        assert info.load == load
        assert client.sismember(REPLICAS_SET, RID)
        assert 0 < client.pttl(replica_info_key(RID)) <= 1000

        def engine_thread() -> None:
            pub.on_stored(None, [a, b])
            pub.on_stored(b, [c])
            pub.on_removed([c])
            pub.on_stored(a, [d])

        _in_thread(engine_thread)
        await wait_until_async(lambda: len(_events(client)) == 4)
        events = _events(client)
        assert [e.seq for e in events] == [s + 1, s + 2, s + 3, s + 4]
        assert events[0] == BlockEvent(s + 1, "stored", (short_key(a), short_key(b)), None)
        assert events[1] == BlockEvent(s + 2, "stored", (short_key(c),), short_key(b))
        assert events[2] == BlockEvent(s + 3, "removed", (short_key(c),))
        assert events[3] == BlockEvent(s + 4, "stored", (short_key(d),), short_key(a))

        # The periodic snapshot catches up with seq 4 and holds exactly a, b, d.
        def snapshot_seq() -> int:
            raw = client.get(snapshot_key(RID))
            return decode_snapshot(raw).seq if raw else -1  # type: ignore[arg-type]

        await wait_until_async(lambda: snapshot_seq() == s + 4)
        # A replica gone for good leaves nothing: stream and snapshot expire an hour
        # after its last heartbeat (a new snapshot drops the expiry; the next beat sets it).
        retain_ms = int(RETAIN_S * 1000)
        for key in (snapshot_key(RID), events_stream_key(RID)):
            await wait_until_async(
                lambda key=key: retain_ms - 5_000 < client.pttl(key) <= retain_ms,  # type: ignore[misc]
                what=f"{key} expiring {RETAIN_S} s after the last heartbeat",
            )
        snap = decode_snapshot(client.get(snapshot_key(RID)))  # type: ignore[arg-type]
        assert [(blk.parent, blk.key) for blk in snap.blocks] == [
            (None, short_key(a)),
            (short_key(a), short_key(b)),
            (short_key(a), short_key(d)),
        ]
        _in_thread(pub.on_cleared)
        await wait_until_async(lambda: len(_events(client)) == 5)
        assert _events(client)[-1] == BlockEvent(s + 5, "cleared")
        await pub.stop()
        # Deregistered at once on a clean stop; the set keeps the id.
        assert client.exists(replica_info_key(RID)) == 0

    _run(scenario)


def test_events_a_snapshot_holds_still_reach_the_stream(redis_server: RedisServer) -> None:
    """A gateway following the stream notices a missing event only when a later one
    arrives: events queued while a snapshot is due must still be written, or the last ones
    before a quiet spell (here a reset's ``cleared``) never reach it."""
    client = redis.Redis.from_url(redis_server.url)
    pub = Publisher(_config(redis_server.url, snapshot_interval_s=60.0))
    s = pub.stats.seq
    a, b = _key(0), _key(1)
    # Queued before the first write, which is a snapshot (seq s + 3, nothing cached).
    _in_thread(lambda: pub.on_stored(None, [a, b]))
    _in_thread(lambda: pub.on_removed([b]))
    _in_thread(pub.on_cleared)

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        await wait_until_async(lambda: len(_events(client)) == 3, what="the queued events")
        snap = decode_snapshot(client.get(snapshot_key(RID)))  # type: ignore[arg-type]
        assert (snap.seq, snap.blocks) == (s + 3, [])
        assert [(e.seq - s, e.type) for e in _events(client)] == [
            (1, "stored"),
            (2, "removed"),
            (3, "cleared"),
        ]
        await pub.stop()

    _run(scenario)


def test_snapshot_orders_parents_first_after_a_parent_is_restored() -> None:
    pub = Publisher(_config("redis://127.0.0.1:1/0"))
    s = pub.stats.seq
    a, b, c = _key(1), _key(2), _key(3)
    pub.on_stored(None, [a, b, c])
    pub.on_removed([a])
    pub.on_stored(None, [a])  # a re-enters after its children in insertion order
    seq, raw = pub.encoded_snapshot()
    blocks = decode_snapshot(raw).blocks
    assert seq == decode_snapshot(raw).seq == s + 3
    order = [blk.key for blk in blocks]
    assert order.index(short_key(a)) < order.index(short_key(b)) < order.index(short_key(c))
    assert {blk.key: blk.parent for blk in blocks} == {
        short_key(a): None,
        short_key(b): short_key(a),
        short_key(c): short_key(b),
    }
    assert raw == encode_snapshot(seq, blocks)  # what encode_snapshot makes of them
    pub.on_stored(a, [b], medium="host")  # b demoted to the host tier
    assert [blk.medium for blk in decode_snapshot(pub.encoded_snapshot()[1]).blocks] == [
        "device",
        "host",
        "device",
    ]


def test_a_snapshot_is_made_off_the_event_loop(redis_server: RedisServer) -> None:
    """Walking and encoding the mirror take ~0.7 µs a block: on the server's event loop,
    a 120,000-block cache stalled every token stream there (about half a second,
    measured), every few seconds."""
    pub = Publisher(_config(redis_server.url))
    threads: list[threading.Thread] = []
    encoded = pub.encoded_snapshot

    def watched() -> tuple[int, bytes]:
        threads.append(threading.current_thread())
        return encoded()

    pub.encoded_snapshot = watched  # type: ignore[method-assign]

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        await wait_until_async(lambda: pub.stats.snapshots_written >= 1)
        await pub.stop()

    _run(scenario)
    assert threads and threading.main_thread() not in threads


def test_record_expires_when_heartbeats_stop(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    pub = Publisher(_config(redis_server.url, info_ttl_s=0.3))

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        await wait_until_async(lambda: client.exists(replica_info_key(RID)) == 1)
        # A crash: the loops end without deregistering, only the expiry removes the
        # record. (_closing as well as cancel(): redis-py can swallow a cancellation.)
        pub._closing = True
        for task in pub._tasks:
            task.cancel()
        await asyncio.wait(pub._tasks, timeout=5)
        assert all(task.done() for task in pub._tasks)
        await wait_until_async(lambda: client.exists(replica_info_key(RID)) == 0, timeout_s=5)
        await pub.stop()

    _run(scenario)


def test_redis_outage_keeps_accepting_events_and_resyncs(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    pub = Publisher(_config(redis_server.url))
    keys = [_key(i) for i in range(40)]

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        await wait_until_async(lambda: pub.stats.connected)
        _in_thread(lambda: pub.on_stored(None, keys[:2]))
        await wait_until_async(lambda: pub.stats.events_published == 1)

        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="prefixgate.replica.publisher"):
            # Events keep coming while Redis is gone; nothing blocks or raises.
            for i in range(2, 40, 2):
                pub.on_stored(keys[i - 1], keys[i : i + 2])
                await asyncio.sleep(0.02)
            await wait_until_async(lambda: not pub.stats.connected)
        outage_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(outage_logs) == 1, "an outage is logged once, not per retry"

        redis_server.start()  # same port, empty data
        client = redis.Redis.from_url(redis_server.url)

        def snapshot_complete() -> bool:
            raw = client.get(snapshot_key(RID))
            if raw is None:
                return False
            snap = decode_snapshot(raw)  # type: ignore[arg-type]
            return snap.seq == pub.stats.seq and len(snap.blocks) == 40

        await wait_until_async(snapshot_complete)
        await wait_until_async(lambda: client.exists(replica_info_key(RID)) == 1)
        assert pub.stats.outages == 1
        # New events after the resync continue the same sequence.
        _in_thread(lambda: pub.on_removed([keys[39]]))
        await wait_until_async(lambda: any(e.type == "removed" for e in _events(client)))
        assert _events(client)[-1].seq == pub.stats.seq
        await pub.stop()

    _run(scenario)


def test_snapshot_rewritten_when_redis_comes_back_empty_without_an_error(
    redis_server: RedisServer,
) -> None:
    """A Redis emptied under a live connection (FLUSHALL stands for a restart that
    redis-py reconnects to silently): an idle replica re-publishes its snapshot, so a
    gateway starting afterwards still sees its blocks."""
    client = redis.Redis.from_url(redis_server.url)
    pub = Publisher(_config(redis_server.url, snapshot_interval_s=3600.0))
    keys = [_key(i) for i in range(4)]

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        _in_thread(lambda: pub.on_stored(None, keys))

        def snapshot_blocks() -> int:
            raw = client.get(snapshot_key(RID))
            return -1 if raw is None else len(decode_snapshot(raw).blocks)  # type: ignore[arg-type]

        await wait_until_async(lambda: snapshot_blocks() == 4)
        written = pub.stats.snapshots_written
        client.flushall()
        await wait_until_async(lambda: snapshot_blocks() == 4, timeout_s=5)
        assert pub.stats.snapshots_written == written + 1
        assert pub.stats.outages == 0
        await pub.stop()

    _run(scenario)


def test_start_without_redis_does_not_fail(caplog: pytest.LogCaptureFixture) -> None:
    """And the outage's log line names Redis without its password (a managed Redis's URL
    carries one)."""
    pub = Publisher(_config("redis://prefixgate:s3cret@127.0.0.1:1/0"))

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        pub.on_stored(None, [_key(1)])
        await wait_until_async(lambda: pub.stats.outages == 1)
        assert not pub.stats.connected
        await pub.stop()

    with caplog.at_level(logging.WARNING, logger="prefixgate.replica.publisher"):
        _run(scenario)
    assert "redis at redis://prefixgate:***@127.0.0.1:1/0 unreachable" in caplog.text
    assert "s3cret" not in caplog.text


def test_a_failing_load_callback_does_not_end_heartbeats(redis_server: RedisServer) -> None:
    """Only Redis errors were caught: an exception from the engine's load callback ended
    the heartbeat loop for the replica's life, and the replica, serving on, was dropped
    by every gateway when its record expired."""
    client = redis.Redis.from_url(redis_server.url)
    failures = [RuntimeError("the engine's counters moved under us")] * 3

    def load() -> ReplicaLoad:
        if failures:
            raise failures.pop()
        return ReplicaLoad(running=1)

    pub = Publisher(_config(redis_server.url))

    async def scenario() -> None:
        await pub.start(load)
        await wait_until_async(lambda: client.exists(replica_info_key(RID)) == 1)
        assert not failures  # three heartbeats failed, and the loop went on
        info = ReplicaInfo.decode(client.get(replica_info_key(RID)))  # type: ignore[arg-type]
        assert info.load == ReplicaLoad(running=1)
        await pub.stop()

    _run(scenario)


def test_a_long_outage_queues_no_more_events_than_the_stream_holds() -> None:
    """With Redis down the write loop owes a snapshot first and writes nothing, so every
    event stayed queued for as long as the outage lasted (~485 B an event of 4 blocks:
    at 100 events a second, 175 MB an hour). It keeps what the capped stream could
    hold; the gap it leaves is what the snapshot written on Redis's return repairs."""
    pub = Publisher(_config("redis://127.0.0.1:1/0", stream_maxlen=50))
    s = pub.stats.seq

    async def scenario() -> None:
        await pub.start(ReplicaLoad)

        def engine_thread() -> None:
            for i in range(200):
                pub.on_stored(None, [_key(i)])

        _in_thread(engine_thread)
        assert len(pub._pending) == 50 and pub.stats.events_dropped >= 150
        assert [e.seq - s for e in pub._pending] == list(range(151, 201))  # the newest
        await pub.stop()

    _run(scenario)


def test_an_unexpected_write_error_does_not_end_publishing(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only Redis errors were caught: any other exception from a write ended the write
    loop, and the replica served on, its heartbeat alive, while gateways kept a view it
    no longer updated. Now the batch counts as lost, a snapshot follows, and later
    events reach the stream."""
    client = redis.Redis.from_url(redis_server.url)
    pub = Publisher(_config(redis_server.url, snapshot_interval_s=60.0))
    s = pub.stats.seq
    failures = fail_writes_once(monkeypatch, TypeError("an encoder bug"))
    a, b = _key(0), _key(1)

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        await wait_until_async(lambda: client.exists(snapshot_key(RID)) == 1)
        _in_thread(lambda: pub.on_stored(None, [a]))  # its write fails
        await wait_until_async(lambda: not failures and pub.stats.snapshots_written == 2)
        _in_thread(lambda: pub.on_stored(a, [b]))
        await wait_until_async(lambda: [e.seq for e in _events(client)] == [s + 2])
        snap = decode_snapshot(client.get(snapshot_key(RID)))  # type: ignore[arg-type]
        assert (snap.seq, [blk.key for blk in snap.blocks]) == (s + 1, [short_key(a)])
        assert pub.stats.events_dropped == 1
        await pub.stop()

    _run(scenario)


def test_a_heartbeat_racing_the_first_snapshot_does_not_call_it_lost(
    redis_server: RedisServer,
) -> None:
    """A heartbeat whose EXISTS ran before the first snapshot's SET, and whose answer was
    read after that write returned, reported the snapshot lost, so every new replica
    wrote its first snapshot twice (about one start in ten here), and a test that counted
    snapshots failed now and then. A snapshot really gone is still reported."""
    info = ReplicaInfo(RID, "http://127.0.0.1:9999", "tiny-random", 16, ReplicaLoad(), 0.0)
    raw = encode_snapshot(0, [])

    async def scenario() -> None:
        spurious = 0
        for i in range(100):
            writer = ReplicaRedis(redis_server.url, f"{RID}-{i}", 2.0, STREAM_MAXLEN)
            # Three pooled connections, so that both commands below go out at once.
            await asyncio.gather(*(writer.heartbeat(info, 5.0) for _ in range(3)))
            heartbeat = asyncio.create_task(writer.heartbeat(info, 5.0))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            await writer.write_encoded_snapshot(raw)
            spurious += await heartbeat
            await writer.aclose()
        assert spurious == 0
        writer = ReplicaRedis(redis_server.url, RID, 2.0, STREAM_MAXLEN)
        await writer.write_encoded_snapshot(raw)
        assert not await writer.heartbeat(info, 5.0)
        redis.Redis.from_url(redis_server.url).delete(snapshot_key(RID))  # Redis lost it
        assert await writer.heartbeat(info, 5.0)
        await writer.aclose()

    _run(scenario)


def test_gateways_follow_a_replica_that_restarts_under_the_same_id(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that crashes and is back before its record expires (5 s; a pod's
    container restarted in place keeps its address, the id) numbered its new life's
    events from 1 again: a gateway that had folded in the last life's took them for old
    ones and skipped them all, keeping the dead life's blocks for good. A new life's
    numbers are above the last one's, so gateways see a gap and resync from its
    snapshot."""
    monkeypatch.setattr(ReplicaRedis, "deregister", _no_deregister)  # a crash: no goodbye
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)
    old, new = [_key(i) for i in range(3)], [_key(10)]

    def held(keys: list[bytes]) -> int:
        return router.index.match([short_key(k) for k in keys]).get(RID, 0)

    async def scenario() -> None:
        await sync.start()
        first = Publisher(_config(redis_server.url))
        await first.start(ReplicaLoad)
        _in_thread(lambda: first.on_stored(None, old))
        _in_thread(lambda: first.on_stored(old[-1], [_key(3)]))
        await wait_until_async(lambda: held(old) == 3, what="the first life's blocks")
        await first.stop()
        second = Publisher(_config(redis_server.url))  # the same id, an empty cache
        await second.start(ReplicaLoad)
        _in_thread(lambda: second.on_stored(None, new))
        await wait_until_async(
            lambda: held(new) == 1 and held(old) == 0, what="the new life's blocks only"
        )
        await second.stop()
        await sync.aclose()

    _run(scenario)


async def _no_deregister(self: ReplicaRedis) -> None:
    return None


@pytest.mark.timeout(90)
def test_a_busy_replicas_stream_stays_near_its_cap_and_late_gateways_still_see_all(
    redis_server: RedisServer,
) -> None:
    """25,000 events: the stream keeps about ``STREAM_MAXLEN`` of them (each ~340 bytes
    in Redis: 100,000 was 32 MiB a replica), and a snapshot is rewritten often enough
    that the stream always reaches back to it, so a gateway that starts afterwards
    rebuilds the replica's whole cache."""
    client = redis.Redis.from_url(redis_server.url)
    pub = Publisher(_config(redis_server.url, snapshot_interval_s=60.0))  # only the cap's
    keys = [_key(i) for i in range(25_000)]
    router = Router()
    sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)

    def engine_thread(start: int) -> None:  # 1,000 events, as a busy engine's second
        for i in range(start, start + 1_000):
            pub.on_stored(keys[i - 1] if i else None, [keys[i]])

    def snapshot_seq() -> int:
        raw = client.get(snapshot_key(RID))
        return decode_snapshot(raw).seq if raw else -1  # type: ignore[arg-type]

    async def scenario() -> None:
        await pub.start(ReplicaLoad)
        for start in range(0, len(keys), 1_000):
            await asyncio.to_thread(engine_thread, start)  # the loop writes meanwhile
            await wait_until_async(functools.partial(_published, pub, start + 1_000))
        assert pub.stats.events_dropped == 0
        # Rewritten each time half the cap had gone by (snapshot_interval_s is a minute).
        await wait_until_async(lambda: snapshot_seq() >= pub.stats.seq - STREAM_MAXLEN // 2)
        assert pub.stats.snapshots_written >= len(keys) // (STREAM_MAXLEN // 2)
        length = client.xlen(events_stream_key(RID))
        assert STREAM_MAXLEN <= length <= 1.2 * STREAM_MAXLEN
        first: Any = client.xrange(events_stream_key(RID), count=1)
        assert snapshot_seq() >= BlockEvent.decode(first[0][1]).seq - 1  # reaches back
        await sync.start()
        held = [short_key(k) for k in keys]
        await wait_until_async(lambda: router.index.match(held).get(RID, 0) == len(keys))
        await sync.aclose()
        await pub.stop()

    _run(scenario)


def _published(pub: Publisher, events: int) -> bool:
    return pub.stats.events_published == events
