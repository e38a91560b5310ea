"""The simulator can name its replicas as a live cluster names them (host:port), so the
router's conversation ring places every session where the live gateway did."""

from __future__ import annotations

import pytest

from loadtest.simulate import simulate
from loadtest.workloads import generate
from router.router import Router


def test_sessions_land_where_the_ring_over_those_names_puts_them() -> None:
    sessions = generate("multi_turn_chat", seed=1, sessions=24, turns=1, system_len=50)
    ids = ["127.0.0.1:41001", "127.0.0.1:52002", "127.0.0.1:36003"]
    result = simulate(
        sessions, "consistent_hash", 3, 512, think_s=0.0, concurrency=4, replica_ids=ids
    )
    ring = Router(None, "consistent_hash")
    for rid in ids:
        ring.add_replica(rid, f"sim://{rid}", "m", 16, static=True)
    expected = [0, 0, 0]
    for s in sessions:
        expected[ids.index(ring.route([], conversation_key=s.session_id).replica_id)] += 1
    assert result.requests_per_replica == expected
    default = simulate(sessions, "consistent_hash", 3, 512, think_s=0.0, concurrency=4)
    assert sum(default.requests_per_replica) == 24
    with pytest.raises(ValueError, match="replica ids"):
        simulate(sessions, "round_robin", 2, 512, replica_ids=ids)
