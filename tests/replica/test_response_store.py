"""The replica's stored responses: bounded by count (least recently used dropped) and by
idle time."""

from __future__ import annotations

import time

from replica.response_store import ResponseStore
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
