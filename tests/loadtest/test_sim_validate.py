"""The simulator driven by a sim profile's step times (``loadtest.sim_validate.ProfileCost``)."""

from __future__ import annotations

import pytest

from loadtest.sim_validate import PREFILL_CHUNK, ProfileCost
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
