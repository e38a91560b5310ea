"""Whatever an engine sends, decoding skips what it does not understand and the translator
never raises on what decoding lets through: a broken engine costs events, not the bridge."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bridge.events import AllBlocksCleared, BadPayload, BlockRemoved, BlockStored, decode_batch
from bridge.translate import KeyTranslator

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(["GPU", "CPU", "cpu", "CPU_TIER1", "STORAGE", "HBM", "cache_salt"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=12,
)
HASHES = st.lists(st.integers(0, 5) | st.binary(min_size=1, max_size=2), max_size=4)
TOKENS = st.lists(st.integers(-2, 2**32 + 1), max_size=40)


@st.composite
def stored(draw: st.DrawFn) -> dict[str, Any]:
    """A BlockStored that is often almost right: small hash space (so parents, repeats
    and removals meet), block sizes around the token count, any medium and extras."""
    hashes = draw(HASHES)
    tokens = draw(TOKENS)
    size = draw(st.sampled_from([0, 1, 5, 16, -1]) | st.integers(-3, 40))
    fill: bool = draw(st.booleans())
    if hashes and fill:  # tokens that fill the blocks exactly
        size = max(1, len(tokens) // len(hashes))
        tokens = tokens[: size * len(hashes)]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": draw(st.none() | st.integers(0, 5) | VALUES),
        "token_ids": tokens if draw(st.booleans()) else draw(VALUES),
        "block_size": size,
    }
    for name in ("medium", "lora_name", "extra_keys", "group_idx", "lora_id"):
        if draw(st.booleans()):
            event[name] = draw(VALUES)
    if draw(st.booleans()):  # a hybrid model's groups, their kinds named (vLLM 0.32 on)
        event["group_idx"] = draw(st.integers(-1, 3) | VALUES)
        kinds = st.sampled_from(["full_attention", "sliding_window", "mamba", ""])
        event["kv_cache_spec_kind"] = draw(kinds | VALUES)
    return event


@st.composite
def removed(draw: st.DrawFn) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": draw(HASHES | VALUES)}
    if draw(st.booleans()):
        event["medium"] = draw(VALUES)
    if draw(st.booleans()):
        event["group_idx"] = draw(st.none() | st.integers(-1, 2) | VALUES)
    return event


EVENTS = st.one_of(
    stored(),
    removed(),
    st.just({"type": "AllBlocksCleared"}),
    VALUES,
)


INFINITE = [  # int(inf) raises OverflowError, not ValueError
    {"type": "BlockStored", "block_hashes": [1], "token_ids": [float("inf")], "block_size": 1},
    {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": float("-inf")},
]


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.lists(EVENTS, max_size=6), max_size=6), array_form=st.booleans())
@example(batches=[INFINITE], array_form=False)
@example(batches=[INFINITE], array_form=True)
def test_no_event_an_engine_can_send_raises_past_decoding(
    batches: list[list[Any]], array_form: bool
) -> None:
    tr = KeyTranslator("m")
    for events in batches:
        if array_form:  # older vLLM: [tag, field, ...] in declaration order
            events = [
                [e["type"], *(v for k, v in e.items() if k != "type")]
                if isinstance(e, dict) and "type" in e
                else e
                for e in events
            ]
        try:
            batch = decode_batch(msgpack.packb([1.0, events]))
        except BadPayload:
            continue
        for event in batch.events:
            if isinstance(event, BlockStored):
                tr.stored(event)
            elif isinstance(event, BlockRemoved):
                tr.removed(event)
            elif isinstance(event, AllBlocksCleared):
                tr.cleared(event)
            tr.check_invariants()
