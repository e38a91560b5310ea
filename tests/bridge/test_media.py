"""Engine media → tiers: a block's copies per tier decide where routing finds its keys,
and the events the translator emits keep a real router index equal to that view."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.events import BlockRemoved, BlockStored
from bridge.media import MediumMap, parse_medium_flag
from bridge.translate import KeyTranslator, Update
from router.index import PrefixIndex
from router.protocol import KeySpace, Medium, short_key

RID = "engine-0"


def tokens(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(49152) for _ in range(n))


def expected(ids: tuple[int, ...]) -> list[bytes]:
    return [short_key(k) for k in KeySpace("m", 16).keys(list(ids))]


class Reader:
    """A gateway's view: the router's own index, fed the translator's updates as the
    router feeds it block events (router.Router.apply_event)."""

    def __init__(self) -> None:
        self.index = PrefixIndex()

    def apply(self, update: Update) -> Update:
        if update.removed:
            self.index.remove(RID, update.removed)
        for chain in update.stored:
            self.index.insert(RID, chain.keys, medium=chain.medium)
        self.index.check_invariants()
        return update

    def tier(self, key: bytes) -> Medium | None:
        if not self.index.holds(RID, key):
            return None
        return "host" if self.index.host_blocks(RID, [key]) else "device"

    def tiers(self, keys: list[bytes]) -> list[Medium | None]:
        return [self.tier(k) for k in keys]


def stored(
    hashes: tuple[int, ...],
    parent: int | None,
    ids: tuple[int, ...],
    medium: str | None,
    block_size: int = 128,
) -> BlockStored:
    return BlockStored(hashes, parent, ids, block_size if ids else 0, medium=medium)


def test_a_block_offloaded_then_evicted_from_the_gpu_ends_on_the_host() -> None:
    """vLLM's offloading connector: the CPU copy is stored while the GPU block lives, the
    GPU block is evicted later, a hit loads it back, the CPU copy is evicted last."""
    tr, reader = KeyTranslator("m"), Reader()
    ids = tokens(256)
    chain = expected(ids)
    reader.apply(tr.stored(stored((1, 2), None, ids, "GPU")))
    assert reader.tiers(chain) == ["device"] * 16
    offloaded = reader.apply(tr.stored(stored((1, 2), None, ids, "CPU")))
    assert offloaded == Update()  # a host copy of device blocks changes nothing routed
    demoted = reader.apply(tr.removed(BlockRemoved((2,), "GPU")))
    assert demoted.removed == () and demoted.stored_keys == tuple(chain[8:])
    assert demoted.stored[0].medium == "host" and demoted.stored[0].parent == chain[7]
    assert reader.tiers(chain) == ["device"] * 8 + ["host"] * 8
    promoted = reader.apply(tr.stored(stored((2,), 1, ids[128:], "GPU")))
    assert promoted.stored_keys == tuple(chain[8:]) and promoted.stored[0].medium == "device"
    assert reader.tiers(chain) == ["device"] * 16
    # Removal in one tier never drops the other: the CPU copies go, the GPU ones stay.
    assert reader.apply(tr.removed(BlockRemoved((1, 2), "CPU"))) == Update()
    assert reader.tiers(chain) == ["device"] * 16
    gone = reader.apply(tr.removed(BlockRemoved((1, 2), "GPU")))
    assert gone.removed == tuple(chain) and reader.tiers(chain) == [None] * 16
    assert not tr.blocks
    tr.check_invariants()


def test_bare_announcements_mark_known_blocks_and_skip_unknown_ones() -> None:
    """vLLM's offloading connectors without self-describing events send only the hash."""
    tr, reader = KeyTranslator("m"), Reader()
    ids = tokens(128, seed=1)
    chain = expected(ids)
    reader.apply(tr.stored(stored((5,), None, ids, "GPU")))
    assert reader.apply(tr.stored(stored((5, 99), None, (), "CPU"))) == Update()
    assert tr.stats.undescribed == 1  # 99 was never described
    reader.apply(tr.removed(BlockRemoved((5,), "GPU")))
    assert reader.tiers(chain) == ["host"] * 8
    reader.apply(tr.removed(BlockRemoved((5,), "CPU")))
    assert reader.tiers(chain) == [None] * 8
    assert tr.removed(BlockRemoved((99,), "CPU")) == Update() and tr.stats.unknown_removals == 1
    tr.check_invariants()


def test_a_block_first_seen_on_the_host_is_routed_as_host_and_children_chain_on() -> None:
    tr, reader = KeyTranslator("m"), Reader()
    ids = tokens(32, seed=2)
    chain = expected(ids)
    host = reader.apply(tr.stored(stored((1,), None, ids[:16], "cpu_tier1", 16)))  # SGLang
    assert host.stored[0].medium == "host" and reader.tiers(chain[:1]) == ["host"]
    reader.apply(tr.stored(stored((2,), 1, ids[16:], "GPU", 16)))
    assert reader.tiers(chain) == ["host", "device"]
    tr.check_invariants()


def test_duplicate_device_copies_leave_one_removal_at_a_time() -> None:
    """vLLM does not deduplicate device blocks: two blocks of one hash, two removals."""
    tr, reader = KeyTranslator("m"), Reader()
    ids = tokens(16, seed=3)
    reader.apply(tr.stored(stored((1,), None, ids, "GPU", 16)))
    reader.apply(tr.stored(stored((1,), None, ids, "GPU", 16)))
    assert reader.apply(tr.removed(BlockRemoved((1,), "GPU"))) == Update()
    assert reader.tiers(expected(ids)) == ["device"]
    assert reader.apply(tr.removed(BlockRemoved((1,), "GPU"))).removed == tuple(expected(ids))
    tr.check_invariants()


def test_unknown_media_are_ignored_with_one_warning_unless_mapped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = tokens(16, seed=4)
    tr = KeyTranslator("m")
    with caplog.at_level(logging.WARNING, "prefixgate.bridge"):
        for h in range(3):
            assert tr.stored(stored((h,), None, ids, "HBM", 16)) == Update()
    assert caplog.text.count("medium 'HBM'") == 1 and "--medium HBM=device" in caplog.text
    assert tr.media.unknown_events == 3 and tr.stats.ignored == 3 and not tr.blocks
    mapped = KeyTranslator("m", media=MediumMap({"HBM": "device", "CPU": None}))
    assert mapped.stored(stored((1,), None, ids, "hbm", 16)).stored[0].medium == "device"
    assert mapped.stored(stored((1,), None, ids, "CPU", 16)) == Update()  # overridden: ignored


def test_the_medium_flag() -> None:
    assert parse_medium_flag("hbm=device") == ("HBM", "device")
    assert parse_medium_flag(" STORAGE = host ") == ("STORAGE", "host")
    assert parse_medium_flag("CPU=ignore") == ("CPU", None)
    for bad in ("HBM", "HBM=fast", "=device"):
        with pytest.raises(ValueError, match="NAME=device"):
            parse_medium_flag(bad)


def test_snapshot_carries_each_keys_tier() -> None:
    tr = KeyTranslator("m")
    ids = tokens(256, seed=5)
    tr.stored(stored((1, 2), None, ids, "GPU"))
    tr.stored(stored((2,), None, (), "CPU"))
    tr.removed(BlockRemoved((2,), "GPU"))
    tiers = {b.key: b.medium for b in tr.snapshot()}
    chain = expected(ids)
    assert [tiers[k] for k in chain] == ["device"] * 8 + ["host"] * 8


# Operations on four root blocks of one 16-token block each, in either tier.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "bare", "remove"]),
        st.integers(0, 3),
        st.sampled_from(["GPU", "CPU", "cpu", "STORAGE", None]),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_the_index_fed_the_updates_always_equals_the_copies(
    ops: list[tuple[str, int, str | None]],
) -> None:
    tr, reader = KeyTranslator("m"), Reader()
    blocks = [tokens(16, seed=10 + i) for i in range(4)]
    blocks[3] = blocks[2]  # two engine hashes, one key: the key leaves with its last one
    copies: dict[int, dict[str, int]] = {i: {"device": 0, "host": 0} for i in range(4)}
    tier_of = {"GPU": "device", None: "device", "CPU": "host", "cpu": "host"}
    for op, i, medium in ops:
        tier = tier_of.get(medium)
        if op == "store":
            reader.apply(tr.stored(stored((i,), None, blocks[i], medium, 16)))
        elif op == "bare":
            reader.apply(tr.stored(stored((i,), None, (), medium)))
        else:
            reader.apply(tr.removed(BlockRemoved((i,), medium)))
        if tier is not None:
            held = copies[i]
            if op == "store" or (op == "bare" and (held["device"] or held["host"])):
                held[tier] += 1
            elif op == "remove" and held[tier]:
                held[tier] -= 1
        tr.check_invariants()
        for key_blocks in ([0], [1], [2, 3]):
            want: Medium | None = None
            if any(copies[b]["device"] for b in key_blocks):
                want = "device"
            elif any(copies[b]["host"] for b in key_blocks):
                want = "host"
            key = expected(blocks[key_blocks[0]])[0]
            assert reader.tier(key) == want == tr.published.tier(key)
