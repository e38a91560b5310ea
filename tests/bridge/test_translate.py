"""Engine blocks → prefixgate keys: equal to router.protocol's keys for the same ids."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    salt_of,
)
from bridge.translate import KeyTranslator, Update
from router.protocol import KeySpace, short_key


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def expected(ids: list[int], model: str = "m", salt: str = "") -> list[bytes]:
    return [short_key(k) for k in KeySpace(model, 16, salt).keys(ids)]


def store_pages(
    tr: KeyTranslator, ids: list[int], page: int, *, per_event: int = 1, salt: str = ""
) -> list[bytes]:
    """Stores the full pages of ``ids`` as the engine would, ``per_event`` pages per event;
    returns every key produced, in order."""
    produced: list[bytes] = []
    n = len(ids) // page
    parent: int | None = None
    for first in range(0, n, per_event):
        count = min(per_event, n - first)
        hashes = tuple(1000 + i for i in range(first, first + count))
        extra = ((("cache_salt", salt),),) if salt and first == 0 else ()
        event = BlockStored(
            hashes,
            parent,
            tuple(ids[first * page : (first + count) * page]),
            page,
            extra_keys=extra,
        )
        out = tr.stored(event)
        assert not out.orphan and not out.removed
        assert all(chain.medium == "device" for chain in out.stored)
        produced.extend(out.stored_keys)
        parent = hashes[-1]
        tr.check_invariants()
    return produced


@pytest.mark.parametrize("page", [16, 128, 32])
def test_blocks_of_k_times_16_give_k_keys_equal_to_the_protocol(page: int) -> None:
    ids = tokens(1024)
    tr = KeyTranslator("m")
    assert store_pages(tr, ids, page) == expected(ids)
    assert len(tr.blocks) == 1024 // page


@pytest.mark.parametrize("page", [1, 5, 24])
def test_pages_that_are_no_multiple_of_16_are_regrouped(page: int) -> None:
    ids = tokens(240, seed=page)
    tr = KeyTranslator("m")
    produced = store_pages(tr, ids, page, per_event=3)
    n_tokens = (len(ids) // page) * page
    assert produced == expected(ids[:n_tokens])  # a partial group is held, never keyed


@settings(max_examples=60, deadline=None)
@given(
    page=st.integers(1, 70),
    n=st.integers(0, 400),
    per_event=st.integers(1, 5),
    salt=st.sampled_from(["", "tenant-a"]),
)
def test_any_page_size_gives_the_protocols_keys(
    page: int, n: int, per_event: int, salt: str
) -> None:
    ids = tokens(n, seed=n)
    tr = KeyTranslator("m")
    produced = store_pages(tr, ids, page, per_event=per_event, salt=salt)
    n_tokens = (len(ids) // page) * page
    assert produced == expected(ids[:n_tokens], salt=salt)
    assert set(tr.published.parents) == set(produced)


def test_salt_and_lora_change_the_root() -> None:
    ids = tokens(64)
    tr = KeyTranslator("served")
    salted = tr.stored(
        BlockStored((1,), None, tuple(ids), 64, extra_keys=((("cache_salt", "s1"),),))
    )
    assert list(salted.stored_keys) == expected(ids, "served", "s1")
    lora = tr.stored(
        BlockStored(
            (2,),
            None,
            tuple(ids),
            64,
            lora_name="my-adapter",
            extra_keys=((("lora", "my-adapter", "/p"),),),
        )
    )
    assert list(lora.stored_keys) == expected(ids, "my-adapter")
    # A child inherits its parent's model and salt.
    more = tokens(16, seed=9)
    child = tr.stored(BlockStored((3,), 1, tuple(more), 16))
    assert list(child.stored_keys) == expected(ids + more, "served", "s1")[-1:]
    assert child.stored[0].parent == salted.stored_keys[-1]


def test_removal_takes_back_exactly_the_blocks_keys() -> None:
    ids = tokens(256)
    tr = KeyTranslator("m")
    keys = store_pages(tr, ids, 128)
    gone = tr.removed(BlockRemoved((1001,), "GPU"))
    assert gone.removed == tuple(keys[8:]) and gone.stored == ()
    assert set(tr.published.parents) == set(keys[:8])
    assert tr.removed(BlockRemoved((4242,))).removed == ()  # never stored: nothing, counted
    assert tr.stats.unknown_removals == 1
    tr.check_invariants()


def test_a_key_from_two_engine_blocks_leaves_with_the_last() -> None:
    ids = tuple(tokens(16))
    tr = KeyTranslator("m")
    a = tr.stored(BlockStored((1,), None, ids, 16))
    b = tr.stored(BlockStored((2,), None, ids, 16))  # same tokens, another engine hash
    assert a.stored_keys == b.stored_keys
    assert tr.removed(BlockRemoved((1,))).removed == ()
    assert tr.removed(BlockRemoved((2,))).removed == a.stored_keys
    tr.check_invariants()


def test_unknown_parent_is_an_orphan_and_produces_nothing() -> None:
    tr = KeyTranslator("m")
    out = tr.stored(BlockStored((7,), 6, tuple(tokens(16)), 16))
    assert out.orphan and out.stored == () and not tr.published.parents


def test_storage_media_and_other_groups_are_ignored() -> None:
    tr = KeyTranslator("m")
    ids = tuple(tokens(16))
    assert tr.stored(BlockStored((7,), None, ids, 16, medium="STORAGE")) == Update()
    assert tr.stored(BlockStored((7,), None, ids, 16, medium="CPU_TIER2")) == Update()
    assert tr.stored(BlockStored((8,), None, ids, 16, group_idx=1)) == Update()
    assert tr.stats.ignored == 3 and not tr.blocks


def test_snapshot_lists_parents_before_children() -> None:
    ids = tokens(160)
    tr = KeyTranslator("m")
    keys = store_pages(tr, ids, 16)
    tr.removed(BlockRemoved((1000,)))  # the head goes; its children stay
    tr.stored(BlockStored((1000,), None, tuple(ids[:16]), 16))  # and comes back
    snapshot = tr.snapshot()
    order = [b.key for b in snapshot]
    assert set(order) == set(keys)
    for block in snapshot:
        if block.parent is not None:
            assert order.index(block.parent) < order.index(block.key)


def test_cleared_forgets_everything() -> None:
    tr = KeyTranslator("m")
    store_pages(tr, tokens(64), 16)
    tr.cleared(AllBlocksCleared())
    assert not tr.blocks and not tr.copies and not tr.published.producers


# --------------------------------------------------------------------------- decoding


def test_both_encodings_decode_to_the_same_events() -> None:
    stored = {
        "block_hashes": [b"\x01" * 32],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [[["cache_salt", "s"]]],
    }
    removed = {"block_hashes": [b"\x01" * 32], "medium": "GPU"}
    as_map = [
        1.5,
        [
            {"type": "BlockStored", **stored},
            {"type": "BlockRemoved", **removed},
            {"type": "AllBlocksCleared"},
        ],
    ]
    as_array = [
        1.5,
        [
            ["BlockStored", *stored.values()],
            ["BlockRemoved", *removed.values()],
            ["AllBlocksCleared"],
        ],
    ]
    as_map_batch = {"ts": 1.5, "events": as_map[1]}
    decoded = [decode_batch(msgpack.packb(b)) for b in (as_map, as_array, as_map_batch)]
    assert decoded[0] == decoded[1] == decoded[2]
    events = decoded[0].events
    assert isinstance(events[0], BlockStored) and salt_of(events[0]) == "s"
    assert isinstance(events[1], BlockRemoved) and isinstance(events[2], AllBlocksCleared)


def test_malformed_events_are_skipped_not_fatal() -> None:
    bad = [
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 16},
        {"type": "SomethingNew", "x": 1},
        ["BlockRemoved", "not-a-list"],
        42,
    ]
    good = {"type": "AllBlocksCleared"}
    batch = decode_batch(msgpack.packb([0.0, [*bad, good]]))
    assert batch.skipped == 4 and batch.events == [AllBlocksCleared()]


def test_salt_in_older_bare_extra_keys() -> None:
    event = BlockStored(
        (1,), None, tuple(range(16)), 16, lora_name="ad", extra_keys=(("ad", "salt-x", b"\x00"),)
    )
    assert salt_of(event) == "salt-x"
    assert salt_of(BlockStored((1,), None, tuple(range(16)), 16)) == ""
