"""Where an abort goes (gateway/abortable.py): to the replica running each id its tenant
sent; an id not held to every replica, once per URL, only when asked; nothing held once
its request ends."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from gateway.abortable import Abortable
from gateway.exchange import Exchange


def _exchange(replica: str | None) -> Exchange:
    return Exchange("rid", "generate_tokens", time.perf_counter(), replica=replica)


# Two data-parallel ranks behind one URL, and a replica of its own.
REPLICAS: Any = {
    "engine-dp0": SimpleNamespace(url="http://engine"),
    "engine-dp1": SimpleNamespace(url="http://engine"),
    "other": SimpleNamespace(url="http://other"),
}


def test_an_abort_goes_where_its_request_runs_and_only_for_its_tenant() -> None:
    held = Abortable()
    with (
        held.hold(["a"], "alpha", _exchange("other")),
        held.hold(["b"], "alpha", _exchange("engine-dp1")),
    ):
        assert held.targets(["a", "b", "a"], "alpha", REPLICAS, False) == {
            "http://other": ["a"],
            "http://engine": ["b"],
        }
        assert held.targets(["a", "b"], "beta", REPLICAS, True) == {}  # held, not beta's
    assert len(held) == 0


def test_an_id_not_held_goes_to_every_url_once_when_asked() -> None:
    held = Abortable()
    assert held.targets(["x"], "alpha", REPLICAS, False) == {}
    assert held.targets(["x", "x"], "alpha", REPLICAS, True) == {
        "http://engine": ["x"],
        "http://other": ["x"],
    }


def test_a_second_request_under_a_held_id_does_not_take_or_free_it() -> None:
    held = Abortable()
    first = _exchange("other")
    with held.hold(["a"], "alpha", first):
        with held.hold(["a"], "beta", _exchange("engine-dp0")):
            assert held.targets(["a"], "alpha", REPLICAS, False) == {"http://other": ["a"]}
        assert len(held) == 1  # still the first's
    assert len(held) == 0


def test_an_id_is_let_go_when_its_request_fails() -> None:
    held = Abortable()
    try:
        with held.hold(["a"], "alpha", _exchange(None)):
            assert held.targets(["a"], "alpha", REPLICAS, False) == {}  # not sent yet
            raise RuntimeError("the replica failed")
    except RuntimeError:
        pass
    assert len(held) == 0
