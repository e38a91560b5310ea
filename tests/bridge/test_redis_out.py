"""The bridge's Redis writer while Redis is away (no server needed: nothing is sent)."""

from __future__ import annotations

from bridge.redis_out import RedisWriter, WriterConfig


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
