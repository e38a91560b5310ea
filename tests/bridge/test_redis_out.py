"""The bridge's Redis writer: while Redis is away (no server needed: nothing is sent),
and when a write fails with something else (a real redis-server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from bridge.redis_out import RedisWriter, WriterConfig
from router.protocol import (
    BlockEvent,
    SnapshotBlock,
    decode_snapshot,
    events_stream_key,
    snapshot_key,
)
from tests.conftest import RedisServer
from tests.support.faults import fail_writes_once


def test_a_long_outage_queues_no_more_events_than_the_stream_holds() -> None:
    """While Redis is down, ``flush`` owes a snapshot first and writes nothing, so every
    event stayed queued for as long as the outage lasted. The writer keeps what the
    capped stream could hold (the newest); the gap it leaves is the snapshot's to repair."""
    config = WriterConfig("redis://127.0.0.1:1/0", "r0", "http://r0", "m", 16, stream_maxlen=50)
    writer = RedisWriter(config, snapshot=list)
    first = writer.seq + 1
    for i in range(200):
        writer.stored(None, (bytes([i]) * 16,))
    assert len(writer.pending) == 50 and writer.stats.events_dropped == 150
    assert [p.event.seq for p in writer.pending] == list(range(first + 150, first + 200))
    assert writer.need_snapshot


def test_an_unexpected_write_error_owes_a_snapshot(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails with anything but a Redis error (a bug) still loses its batch:
    the writer owes a snapshot, and the next flush writes it, then what came after."""
    failures = fail_writes_once(monkeypatch, TypeError("an encoder bug"))
    config = WriterConfig(redis_server.url, "r0", "http://r0", "m", 16)
    held: list[SnapshotBlock] = []
    writer = RedisWriter(config, snapshot=lambda: list(held))
    client = redis.Redis.from_url(redis_server.url)

    async def scenario() -> None:
        await writer.flush()  # the first snapshot
        a = bytes(16)
        writer.stored(None, (a,))
        held.append(SnapshotBlock(None, a))
        with pytest.raises(TypeError):
            await writer.flush()
        assert not failures  # it fired
        assert writer.need_snapshot and writer.stats.events_dropped == 1
        writer.stored(a, (bytes([1]) * 16,))
        await writer.flush()
        snap = decode_snapshot(client.get(snapshot_key("r0")))  # type: ignore[arg-type]
        assert (snap.seq, [b.key for b in snap.blocks]) == (writer.seq, [a])
        entries: Any = client.xrange(events_stream_key("r0"))
        assert [BlockEvent.decode(f).seq for _id, f in entries] == [writer.seq]
        await writer.aclose()

    asyncio.run(scenario())
