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


def _hybrid_request(
    ids: list[int], groups: dict[int, str], first_hash: int
) -> tuple[list[BlockStored], list[int]]:
    """A prompt's stores as vLLM 0.32 publishes them for a hybrid model: one event per
    group and chunk, every group under the same block hashes, kinds named."""
    hashes = [first_hash + i for i in range(len(ids) // 16)]
    events = []
    for start in range(0, len(hashes), 4):  # chunks of 4 blocks
        chunk = hashes[start : start + 4]
        parent = hashes[start - 1] if start else None
        for group, kind in groups.items():
            span = ids[start * 16 : (start + len(chunk)) * 16]
            events.append(
                BlockStored(tuple(chunk), parent, tuple(span), 16, None, "GPU", (), group, kind)
            )
    return events, hashes


def test_a_hybrid_model_is_followed_by_its_full_attention_group() -> None:
    # gpt-oss's layers start with a sliding-window one: vLLM's group 0 is that kind.
    ids = tokens(160)
    tr = KeyTranslator("m")
    events, hashes = _hybrid_request(ids, {0: "sliding_window", 1: "full_attention"}, 1000)
    published: set[bytes] = set()
    for event in events:
        out = tr.stored(event)
        published -= set(out.removed)
        published |= set(out.stored_keys)
    assert published == set(expected(ids)) and tr.group == 1
    # The sliding-window group evicts the blocks its window has passed: the prefix stays.
    out = tr.removed(BlockRemoved(tuple(hashes[:6]), "GPU", 0))
    assert out == Update() and set(tr.published.producers) == set(expected(ids))
    # The full-attention group's evictions are the prefix's.
    out = tr.removed(BlockRemoved(tuple(hashes[-2:]), "GPU", 1))
    assert set(out.removed) == set(expected(ids)[-2:])
    tr.check_invariants()


def test_mamba_groups_first_and_full_attention_last_keep_the_prefix() -> None:
    # Qwen3-Next: three linear-attention (Mamba-kind) groups, then the full one. A Mamba
    # group caches a state only here and there: its stores name parents never stored.
    ids = tokens(128)
    tr = KeyTranslator("m")
    tr.stored(BlockStored((5003,), 5002, tuple(ids[48:64]), 16, None, "GPU", (), 0, "mamba"))
    assert tr.stats.orphans == 1
    events, _ = _hybrid_request(ids, {3: "full_attention"}, 5000)
    for event in events:
        tr.stored(event)
    assert tr.group == 3 and set(tr.published.producers) == set(expected(ids))
    tr.stored(BlockStored((5007,), 5006, tuple(ids[112:128]), 16, None, "GPU", (), 1, "mamba"))
    assert tr.group == 3 and set(tr.published.producers) == set(expected(ids))


def test_the_switch_to_the_full_attention_group_takes_back_what_the_other_published() -> None:
    ids = tokens(64)
    tr = KeyTranslator("m")
    first = tr.stored(
        BlockStored((1, 2), None, tuple(ids[:32]), 16, None, "GPU", (), 0, "sliding_window")
    )
    assert first.stored_keys == tuple(expected(ids)[:2])  # no full group named yet
    switch = tr.stored(
        BlockStored((1, 2), None, tuple(ids[:32]), 16, None, "GPU", (), 1, "full_attention")
    )
    assert switch.removed == tuple(expected(ids)[:2]) and switch.stored_keys == tuple(
        expected(ids)[:2]
    )
    # Group 0's later stores and removals change nothing.
    assert (
        tr.stored(BlockStored((3,), 2, tuple(ids[32:48]), 16, None, "GPU", (), 0, "sliding_window"))
        == Update()
    )
    assert tr.removed(BlockRemoved((1, 2), "GPU", 0)) == Update()
    tr.check_invariants()


def test_an_engine_restarted_with_one_group_is_followed_by_group_0_again() -> None:
    # vLLM's --disable-hybrid-kv-cache-manager (or a CPU engine) puts every layer in one
    # full-attention group 0.
    ids = tokens(32)
    tr = KeyTranslator("m")
    tr.stored(BlockStored((1,), None, tuple(ids[:16]), 16, None, "GPU", (), 1, "full_attention"))
    tr.cleared()
    tr.stored(BlockStored((9,), None, tuple(ids[:16]), 16, None, "GPU", (), 0, "full_attention"))
    assert tr.group == 0 and set(tr.published.producers) == set(expected(ids)[:1])


def test_without_kinds_group_0_is_followed_and_group_numbers_are_bounded() -> None:
    ids = tokens(16)
    tr = KeyTranslator("m")
    for group in (-1, 2**40, 300):  # hostile numbers: not learned, not followed
        out = tr.stored(
            BlockStored((group,), None, tuple(ids), 16, None, None, (), group, "full_attention")
        )
        assert out == Update()
    assert tr.kinds == {} and tr.group == 0
    assert tr.stored(BlockStored((1,), None, tuple(ids), 16)).stored_keys == tuple(expected(ids))


def test_kinds_are_decoded_from_vllm_032_events() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 1,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
    }
    odd = {**stored, "kv_cache_spec_kind": 7}
    batch = decode_batch(msgpack.packb([1.0, [stored, odd], None]))
    assert [e.kind for e in batch.events] == ["full_attention", None]  # type: ignore[union-attr]
    positional = [
        "BlockStored",
        [1],
        None,
        list(range(16)),
        16,
        None,
        "GPU",
        None,
        None,
        2,
        "mamba",
    ]
    assert decode_batch(msgpack.packb([1.0, [positional]])).events[0].kind == "mamba"  # type: ignore[union-attr]


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
