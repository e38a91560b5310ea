"""KV tiers seen by the router: the events' ``medium``, the index's host set per
replica, and the cost model pricing a host-tier match as a copy."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.index import PrefixIndex
from router.protocol import (
    BlockEvent,
    KeySpace,
    Snapshot,
    SnapshotBlock,
    decode_snapshot,
    encode_snapshot,
)
from router.router import Router

SPACE = KeySpace("m")


def shorts(*runs: int) -> tuple[bytes, ...]:
    return tuple(k[:16] for k in SPACE.keys([t for run in runs for t in [run] * 16]))


def test_medium_round_trips_and_old_events_decode_as_device() -> None:
    keys = shorts(1, 2)
    for medium in ("device", "host"):
        event = BlockEvent(3, "stored", keys, None, medium)  # type: ignore[arg-type]
        assert BlockEvent.decode(event.encode()) == event
    fields = BlockEvent(4, "stored", keys).encode()
    assert "medium" not in fields  # device is the default and left off the wire
    assert BlockEvent.decode(fields).medium == "device"
    with pytest.raises(ValueError, match="medium"):
        BlockEvent.decode({**fields, "medium": "GPU"})


def test_index_keeps_the_tier_per_replica_and_block() -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    keys = shorts(1, 2, 3)
    index.insert("a", keys)
    index.insert("b", keys)
    index.insert("a", keys[1:], medium="host")  # a's blocks 1 and 2 demoted
    assert index.host_blocks("a", keys) == 2 and index.host_blocks("b", keys) == 0
    assert index.match(list(keys)) == {"a": 3, "b": 3}  # held either way
    index.insert("a", keys[1:2])  # block 1 promoted back
    assert index.host_blocks("a", keys) == 1
    index.remove("a", keys[2:])  # the host dropped block 2
    assert index.host_blocks("a", keys) == 0 and index.match(list(keys)) == {"a": 2, "b": 3}
    index.insert("a", shorts(7, 8, 9), medium="host")  # past the cap of 4: oldest go
    index.check_invariants()
    assert index.blocks("a") == 4 and index.host_blocks("a", shorts(7, 8, 9)) == 3
    index.clear("a")
    assert index.host_blocks("a", shorts(7, 8, 9)) == 0
    index.check_invariants()


@pytest.mark.parametrize("order", [("dev", "host", "none"), ("none", "host", "dev")])
def test_cost_model_prices_a_host_match_as_a_copy(order: tuple[str, ...]) -> None:
    router = Router(RouterConfig(swap_in_token_cost=0.1), seed=0)
    for name in order:
        router.add_replica(name, f"http://{name}", model="m", static=True)
    prompt = shorts(*range(48))
    cached = prompt[:40]
    router.apply_event("dev", BlockEvent(1, "stored", cached))
    router.apply_event("host", BlockEvent(1, "stored", cached))
    router.apply_event("host", BlockEvent(2, "stored", cached[8:], cached[7], "host"))
    assert router.index.host_blocks("host", prompt) == 32
    # Same match on both; on "host" 512 tokens are copied back (51 prefill tokens' time,
    # beyond the tie window of one block): the device copy wins.
    assert router.route(prompt, prompt_tokens=48 * 16).replica_id == "dev"
    router.apply_event("dev", BlockEvent(2, "removed", cached[8:]))
    # Now dev holds 8 blocks: the host's 40 (32 to copy back) beat computing 32 more.
    decision = router.route(prompt, prompt_tokens=48 * 16)
    assert decision.replica_id == "host" and decision.matched_blocks == 40
    router.index.check_invariants()


def test_snapshot_carries_the_tier_and_old_records_read_as_device() -> None:
    a, b, c = shorts(1, 2, 3)
    blocks = [SnapshotBlock(None, a), SnapshotBlock(a, b, "host"), SnapshotBlock(b, c, "host")]
    raw = encode_snapshot(9, blocks)
    assert decode_snapshot(raw) == Snapshot(9, blocks)
    assert decode_snapshot(encode_snapshot(9, blocks[:1])).blocks[0].medium == "device"
    with pytest.raises(ValueError, match="flag"):
        decode_snapshot(raw[:12] + b"\x07" + raw[13:])
    router = Router(RouterConfig(), seed=0)
    router.add_replica("r", "http://r", model="m", static=True)
    router.apply_snapshot("r", decode_snapshot(raw))
    assert router.index.match([a, b, c]) == {"r": 3}
    assert router.index.host_blocks("r", [a, b, c]) == 2
