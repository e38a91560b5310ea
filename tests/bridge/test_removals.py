"""A batch's removals written as one event (bridge/follower.py ``Removals``): the view a
gateway folds from the events is the one it folds from the engine's own order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.follower import EventFollower, Removals
from bridge.translate import Chain, Update

KEYS = [bytes([i]) * 16 for i in range(8)]


class Recorder:
    """A RedisWriter's event methods, folded as a gateway's index folds them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[bytes, ...], str]] = []

    def removed(self, keys: tuple[bytes, ...], engine_ts: Any = None) -> None:
        self.events.append(("removed", keys, ""))

    def stored(self, parent: Any, keys: tuple[bytes, ...], ts: Any, medium: str) -> None:
        self.events.append(("stored", keys, medium))

    def view(self) -> dict[bytes, str]:
        held: dict[bytes, str] = {}
        for kind, keys, medium in self.events:
            for key in keys:
                if kind == "removed":
                    held.pop(key, None)
                else:
                    held[key] = medium
        return held


keys = st.lists(st.sampled_from(KEYS), max_size=3, unique=True).map(tuple)
chains = st.builds(
    lambda k, m: Chain(None, k, m), keys.filter(bool), st.sampled_from(["device", "host"])
)
updates = st.lists(
    st.builds(lambda r, s: Update(stored=tuple(s), removed=r), keys, st.lists(chains, max_size=2)),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(updates)
def test_held_removals_leave_the_view_the_engines_order_leaves(batch: list[Update]) -> None:
    plain, merged = Recorder(), Recorder()
    for update in batch:  # the engine's order, an event each (as before)
        if update.removed:
            plain.removed(update.removed)
        for chain in update.stored:
            plain.stored(chain.parent, chain.keys, 0.0, chain.medium)
    removals = Removals()
    follower: Any = SimpleNamespace(writer=merged)
    for update in batch:
        EventFollower._publish(follower, update, 0.0, removals)
    removals.write(merged, 0.0)  # type: ignore[arg-type]
    assert merged.view() == plain.view()
    assert len(merged.events) <= len(plain.events)
    assert sum(kind == "removed" for kind, _, _ in merged.events) <= 1 + sum(
        len(u.stored) for u in batch
    )


def test_a_long_batch_of_removals_is_cut_into_events_of_at_most_max_keys() -> None:
    recorder = Recorder()
    removals = Removals()
    many = [i.to_bytes(16, "big") for i in range(Removals.MAX_KEYS * 2 + 5)]
    for key in many:
        removals.add((key,), recorder, 0.0)  # type: ignore[arg-type]
    removals.write(recorder, 0.0)  # type: ignore[arg-type]
    sizes = [len(keys) for _, keys, _ in recorder.events]
    assert sizes == [Removals.MAX_KEYS, Removals.MAX_KEYS, 5]
    assert [k for _, keys, _ in recorder.events for k in keys] == many
