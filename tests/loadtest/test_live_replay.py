"""The live benchmark's workloads in the simulator (loadtest/live_replay.py)."""

from __future__ import annotations

import pytest

from loadtest.live_replay import main


def test_each_router_setting_replays_every_request_of_the_live_workload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = main(
        [
            "--workloads", "agents,skewed_docs",
            "--replicas", "4",
            "--policies", "cache_aware,round_robin",
            "--option", "balance_tokens=0",
        ]
    )  # fmt: skip
    # Per workload: cache_aware at its defaults and with the option, round_robin once.
    assert [(r.workload, r.policy, r.option) for r in rows] == [
        ("agents", "cache_aware", "default"),
        ("agents", "cache_aware", "balance_tokens=0"),
        ("agents", "round_robin", "default"),
        ("skewed_docs", "cache_aware", "default"),
        ("skewed_docs", "cache_aware", "balance_tokens=0"),
        ("skewed_docs", "round_robin", "default"),
    ]
    for workload in ("agents", "skewed_docs"):
        same = [r.result for r in rows if r.workload == workload]
        # Every request of the live workload was served, on the 4 replicas.
        assert len({r.requests for r in same}) == 1 and same[0].requests > 0
        assert all(sum(r.requests_per_replica) == r.requests for r in same)
        assert all(len(r.requests_per_replica) == 4 for r in same)
        # The prefix-aware rows reuse what round-robin recomputes.
        assert min(same[0].hit_rate, same[1].hit_rate) > same[2].hit_rate
    assert len(capsys.readouterr().out.splitlines()) == len(rows)
