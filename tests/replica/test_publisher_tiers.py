"""The publisher's mirror keeps each key's tier, so a snapshot tells a resyncing router
which blocks are on the host (no Redis needed: the mirror is filled by the listener calls
and read by ``encoded_snapshot``, decoded here)."""

from __future__ import annotations

from replica.publisher import Publisher, PublisherConfig
from router.protocol import KeySpace, SnapshotBlock, decode_snapshot, short_key


def blocks(publisher: Publisher) -> list[SnapshotBlock]:
    return decode_snapshot(publisher.encoded_snapshot()[1]).blocks


def test_snapshot_marks_blocks_on_the_host() -> None:
    publisher = Publisher(PublisherConfig("redis://127.0.0.1:1", "r", "http://r", "m", 16))
    a, b, c = KeySpace("m").keys([t for run in (1, 2, 3) for t in [run] * 16])
    sa, sb, sc = (short_key(k) for k in (a, b, c))
    publisher.on_stored(None, [a, b, c])
    publisher.on_stored(b, [c], medium="host")  # demoted
    publisher.on_stored(a, [b], medium="host")
    assert blocks(publisher) == [
        SnapshotBlock(None, sa),
        SnapshotBlock(sa, sb, "host"),
        SnapshotBlock(sb, sc, "host"),
    ]
    publisher.on_stored(a, [b])  # promoted back
    publisher.on_removed([c])  # dropped from the host
    assert blocks(publisher) == [SnapshotBlock(None, sa), SnapshotBlock(sa, sb)]
    publisher.on_stored(b, [c], medium="host")
    publisher.on_cleared()
    assert blocks(publisher) == []
    publisher.on_stored(None, [a])
    assert blocks(publisher) == [SnapshotBlock(None, sa)]
