"""The replica's stored responses: bounded by count and by bytes (least recently used
dropped) and by idle time."""

from __future__ import annotations

import time

import pytest

from replica.response_store import ResponseStore, text_size
from tests.conftest import wait_until


def test_lru_bound_and_ttl() -> None:
    store = ResponseStore(max_entries=2, ttl_s=3600)
    store.put("a", [{"role": "user", "content": "1"}], {"id": "a"})
    store.put("b", [], {"id": "b"})
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", [], {"id": "c"})
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    store.check_invariants()
    assert store.delete("a") and not store.delete("a")
    idle = ResponseStore(ttl_s=0.05)
    idle.put("x", [], {})
    used = idle.entries["x"].used
    wait_until(lambda: time.monotonic() - used > 0.05, 5, "the TTL to pass")
    assert idle.get("x") is None  # dropped once idle past its TTL
    idle.check_invariants()


def test_a_byte_bound_drops_the_least_recently_used_and_keeps_the_newest() -> None:
    """The Responses API stores by default; 4,096 long-context prompts (~500 KB of text
    each) held ~2 GiB on one replica."""
    doc = "x" * 100_000
    store = ResponseStore(max_bytes=250_000)
    for name in "abc":
        store.put(name, [{"role": "user", "content": name + doc}], {"id": name})
        store.check_invariants()
    assert store.get("a") is None and store.get("c") is not None
    assert store.get("b") is not None  # used last: c is now the least recently used
    assert 200_000 < store.held_bytes <= 250_000
    store.put("d", [{"role": "user", "content": doc}], {"id": "d"})
    assert store.get("c") is None and store.get("b") is not None
    # A chain's turns share their history, counted in each: its oldest turns go first.
    chain = ResponseStore(max_bytes=500_000)
    history: list[dict[str, str]] = []
    for turn in range(5):
        history = [*history, {"role": "user", "content": f"{turn}" + "y" * 50_000}]
        chain.put(f"t{turn}", history, {"id": f"t{turn}"})
    assert list(chain.entries) == ["t3", "t4"]  # 200 KB + 250 KB charged, t2 would be 150
    # One entry larger than the bound stays until the next one comes.
    huge = ResponseStore(max_bytes=1_000)
    huge.put("h", [{"role": "user", "content": doc}], {})
    assert huge.get("h") is not None
    huge.put("i", [], {})
    assert huge.get("h") is None and huge.get("i") is not None
    huge.check_invariants()
    # Replacing an id charges its new size only.
    store.put("b", [], {"id": "b"})
    store.check_invariants()


def test_text_size_counts_strings_and_walks_deep_nesting() -> None:
    assert text_size({"role": "user", "content": "abc"}) == 8 * 2 + 4 + 4 + 7 + 3
    deep: list[object] = []
    for _ in range(10_000):  # no recursion limit
        deep = [deep]
    assert text_size(deep) == 8 * 10_000


def test_an_absurd_store_size_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    from replica.cli import main

    for size in ("0", "-1", "nan", "inf"):
        assert main(["--model", "sim", "--response-store-mb", size]) == 2
        assert "--response-store-mb must be a positive size" in capsys.readouterr().err
