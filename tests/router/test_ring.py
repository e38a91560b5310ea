from __future__ import annotations

from router.ring import Ring


def test_adding_a_fifth_replica_moves_about_a_fifth_of_conversations() -> None:
    ring = Ring()
    for i in range(4):
        ring.add(f"r{i}")
    keys = [f"conversation-{i}" for i in range(4000)]
    before = {k: next(ring.walk(k)) for k in keys}
    ring.add("r4")
    after = {k: next(ring.walk(k)) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert 0.14 < len(moved) / len(keys) < 0.26
    assert all(after[k] == "r4" for k in moved)  # only onto the new node


def test_walk_visits_each_replica_once_and_pick_respects_allowed() -> None:
    ring = Ring()
    for i in range(5):
        ring.add(f"r{i}")
    walk = list(ring.walk("abc"))
    assert sorted(walk) == [f"r{i}" for i in range(5)]
    assert ring.pick("abc", lambda r: r != walk[0]) == walk[1]
    ring.remove(walk[0])
    assert next(ring.walk("abc")) == walk[1] and len(ring) == 4
    assert list(Ring().walk("x")) == []
