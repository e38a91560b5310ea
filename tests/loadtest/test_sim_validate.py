"""The simulator driven by a sim profile's step times (``loadtest.sim_validate.ProfileCost``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.sim_cluster import SimCluster
from loadtest.sim_validate import PREFILL_CHUNK, ProfileCost, main, side_by_side
from loadtest.simulate import simulate
from loadtest.workloads import Session, Turn
from replica.sim.profiles import builtin_profiles

A100 = builtin_profiles()["llama3.1-8b-a100"]


def test_profile_cost_is_the_profiles_step_function() -> None:
    cost = ProfileCost(profile=A100, mean_context=1000)
    assert cost.prefill_s(1200) == A100.prefill_s(1200, chunk=PREFILL_CHUNK)
    assert cost.prefill_s(1200, scale=4) == pytest.approx(cost.prefill_s(1200) / 4)
    assert cost.step_s(8) == A100.decode_step_s(8, 8000)
    assert cost.step_s(16) > cost.step_s(1) >= A100.weights_s


def test_one_request_alone_takes_its_prefill() -> None:
    # Its first token comes from its prefill's last step, as on the engine.
    words = " ".join(f"w{i}" for i in range(700))
    session = Session("s", "test", words, [Turn("a question", 4)])
    cost = ProfileCost(profile=A100, mean_context=700)
    result = simulate([session], "round_robin", 1, 4096, cost, think_s=0.0, concurrency=1)
    prompt = 700 + 2  # one id per word in the simulator's tokenizer
    expected = cost.prefill_s(prompt)
    assert result.requests == 1 and result.ttft_p50_s == pytest.approx(expected)


def test_a_request_waiting_behind_a_prefill_gets_the_next_step() -> None:
    # Two prompts arrive together at a replica that is decoding a reply: the first's
    # prefill waits for the step under way, the second (too long to share its steps)
    # waits behind it. The engine's scheduler takes waiting requests at every step, so
    # the second's prefill begins the step after the first's ends: its first token
    # comes one prefill after the first's, not a decode step later still.
    words = [" ".join(f"{tag}{i}" for i in range(n)) for tag, n in (("a", 400), ("b", 500))]
    sessions = [
        Session("busy", "test", "x", [Turn("y", 64)], 0.0),
        *(Session(f"s{k}", "test", w, [Turn("q", 4)], 0.5) for k, w in enumerate(words)),
    ]
    cost = ProfileCost(profile=A100, mean_context=500)
    sim = SimCluster(
        sessions, "round_robin", 1, 4096, cost, scale=1.0, think_s=0.0, seed=0, config=None
    )
    sim.run()
    served = {r.conv.session.session_id: r for r in sim.served}
    first, second = served["s0"], served["s1"]
    assert 400 < len(first.tokens) < 512 < len(first.tokens) + len(second.tokens)
    assert not second.cached
    gap = second.first_token_at - first.first_token_at
    assert gap == pytest.approx(cost.prefill_s(len(second.tokens)))  # not + a decode step


def test_against_a_record_simulates_again_against_its_live_side(tmp_path: Path) -> None:
    # A simulator change is checked on recorded live runs without a cluster: the record's
    # settings, cache size and live figures stand; only the simulator runs again.
    live = {
        "hit_rate": 0.5,
        "ttft_p50_s": 0.2,
        "ttft_mean_s": 0.3,
        "total_time_s": 5.0,
        "replica_ids": ["127.0.0.1:1", "127.0.0.1:2"],
    }
    args = {
        "workload": "multi_turn_chat",
        "replicas": 2,
        "policy": "cache_aware",
        "profile": "llama3.1-8b-a100",
        "concurrency": 2,
        "slowdown": 1.0,
        "fraction": 0.3,
        "host_ratio": 0.0,
        "seed": 0,
        "param": [],
        "out": "old.json",
        "run_dir": None,
    }
    params = {"sessions": 4, "turns": 2, "system_len": 50, "user_len": 10, "max_tokens": 4}
    record = {"args": args, "blocks": 200, "params": params, "live": live}
    (tmp_path / "old.json").write_text(json.dumps(record))
    out = tmp_path / "new.json"
    sides = tmp_path / "requests.json"
    old = str(tmp_path / "old.json")
    main(["--against", old, "--out", str(out), "--policy", "random", "--requests", str(sides)])
    again = json.loads(out.read_text())
    # Each request side by side: only the simulator's here (the live run is a record).
    rows = json.loads(sides.read_text())
    assert sorted((r["session_id"], r["turn"]) for r in rows) == sorted(
        (session, turn) for session in {r["session_id"] for r in rows} for turn in (0, 1)
    )
    assert len(rows) == 8 and all("live" not in r and r["sim"]["ttft_s"] > 0 for r in rows)
    assert {r["sim"]["replica"] for r in rows} <= {"127.0.0.1:1", "127.0.0.1:2"}  # its names
    assert again["live"] == live and again["blocks"] == 200
    assert again["args"]["policy"] == "cache_aware"  # the record's settings, not the flags
    sim = again["simulator"]
    assert sim["requests"] == 8
    verdict = again["verdict"]
    assert verdict["hit_rate_gap"] == pytest.approx(abs(0.5 - sim["hit_rate"]), abs=1e-4)
    assert verdict["ttft_p50_live_over_sim"] == pytest.approx(0.2 / sim["ttft_p50_s"], abs=1e-3)


def test_side_by_side_matches_the_requests_by_session_and_turn() -> None:
    sim = [
        {"session_id": "b", "turn": 0, "ttft_s": 0.1},
        {"session_id": "a", "turn": 0, "ttft_s": 0.2},
    ]
    live = [
        {"session_id": "a", "turn": 0, "ttft_s": 0.25, "replica": "r1"},
        {"session_id": "a", "turn": 1, "ttft_s": 0.3, "replica": "r1"},  # no sim record
    ]
    assert side_by_side(live, sim) == [
        {"session_id": "b", "turn": 0, "sim": {"ttft_s": 0.1}},
        {
            "session_id": "a",
            "turn": 0,
            "sim": {"ttft_s": 0.2},
            "live": {"ttft_s": 0.25, "replica": "r1"},
        },
        {"session_id": "a", "turn": 1, "live": {"ttft_s": 0.3, "replica": "r1"}},
    ]
