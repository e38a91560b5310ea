"""Chat templates' ``tojson`` (prefixgate/tojson.py): ``json.dumps``'s string exactly,
whether serialized or remembered, for any JSON value and the options templates pass."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from markupsafe import Markup

from prefixgate import tojson as memo
from prefixgate.tojson import tojson

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
options = st.fixed_dictionaries(
    {
        "ensure_ascii": st.booleans(),
        "indent": st.sampled_from([None, 2, 4, "\t"]),
        "separators": st.sampled_from([None, (",", ":"), [", ", ": "]]),
        "sort_keys": st.booleans(),
    }
)


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    memo.clear()
    yield
    memo.clear()


@settings(max_examples=400, deadline=None)
@given(values, options)
def test_the_string_is_json_dumps_exactly_serialized_or_remembered(
    value: Any, opts: dict[str, Any]
) -> None:
    expected = json.dumps(value, **opts)
    assert tojson(value, **opts) == expected  # serialized (or kept by an earlier example)
    again = json.loads(json.dumps(value))  # a new object with the same content
    if not _has_nan(value):  # NaN reads back as NaN; it is not equal to itself, but fine
        assert again == value
    assert tojson(again, **opts) == expected  # remembered


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nan(v) for v in value.values())
    return False


def test_values_equal_to_python_but_not_to_json_keep_their_own_strings() -> None:
    pairs = [
        (True, 1),
        (1, 1.0),
        (0.0, -0.0),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ([{"x": True}], [{"x": 1}]),
    ]
    for first, second in pairs:
        assert first == second
        assert tojson(first) == json.dumps(first, ensure_ascii=False)
        assert tojson(second) == json.dumps(second, ensure_ascii=False)
        assert tojson(first) != tojson(second)


def test_what_marshal_cannot_write_is_serialized_each_time() -> None:
    assert tojson({"tool": Markup("<b>")}) == '{"tool": "<b>"}'
    with pytest.raises(TypeError):
        tojson({"x": object()})
    assert memo._held == 0


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memo, "MAX_ENTRIES", 10)
    monkeypatch.setattr(memo, "MAX_BYTES", 2_000)
    for i in range(100):
        assert tojson({"name": f"tool {i}", "pad": "x" * (i % 50)}) == json.dumps(
            {"name": f"tool {i}", "pad": "x" * (i % 50)}, ensure_ascii=False
        )
        assert len(memo._memo) <= 10 and memo._held <= 2_000
    held = sum(len(k[0]) + len(v) for k, v in memo._memo.items())
    assert held == memo._held
    monkeypatch.setattr(memo, "MAX_VALUE_BYTES", 10)
    memo.clear()
    assert tojson({"too": "large to keep"}) == '{"too": "large to keep"}'
    assert memo._held == 0


def test_a_tool_sent_again_is_remembered_not_serialized_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool = {"type": "function", "function": {"name": "search", "parameters": {"q": True}}}
    first = tojson(tool, indent=4)
    next_turn = json.loads(json.dumps(tool))  # the next turn's copy: new objects
    calls: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        return ""

    monkeypatch.setattr(memo.json, "dumps", counted)
    assert tojson(next_turn, indent=4) == first
    assert calls == [] and len(memo._memo) == 1
