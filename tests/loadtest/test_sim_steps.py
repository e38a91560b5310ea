"""The simulated replica's steps: a prefill joins the decode batch's steps (chunked
prefill), as on the engine, so a prompt waits for the step under way and slows the
replies running beside it."""

from __future__ import annotations

import pytest

from loadtest.sim_cluster import SimCluster
from loadtest.sim_cost import CostModel
from loadtest.workloads import Session, Turn

# 1 ms a prefill token in steps of up to 500 tokens, 100 ms a decode step at any batch.
COST = CostModel(
    prefill_s_per_token=0.001, decode_s_per_token=0.1, batch_marginal=0.0, prefill_chunk=500
)


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def run(b_arrives: float) -> SimCluster:
    """a: a 10-token prompt and a 50-token reply, alone; b: a 1,002-token prompt and a
    one-token reply, arriving while a decodes. One replica, no cache hits."""
    sessions = [
        Session("a", "test", words("a", 8), [Turn("a question", 50)], 0.0),
        Session("b", "test", words("b", 1000), [Turn("b question", 1)], b_arrives),
    ]
    sim = SimCluster(
        sessions, "round_robin", 1, 1024, COST, scale=1.0, think_s=0.0, seed=0, config=None
    )
    sim.run()
    sim.replicas[0].cache.check_invariants()
    return sim


def test_a_prompt_waits_for_the_step_under_way_and_slows_the_reply_beside_it() -> None:
    # a's prefill: 10 ms, its first token then (its prefill's last step gives it); a's
    # batch then advances a token every 100 ms. b arrives 250 ms later, half-way
    # through a's third step: it waits 50 ms, then prefills 1,002 tokens in 3 steps
    # (500, 500 and 2 tokens: 1.002 s). Meanwhile a advances 0.5 + 3 tokens, to 6 of
    # the 49 after its first, where alone it would have advanced 10.5.
    sim = run(b_arrives=0.26)
    assert sim.ttfts == pytest.approx([0.010, 0.050 + 1.002])
    b_first = 0.26 + 0.050 + 1.002
    assert sim.now == pytest.approx(b_first + (49 - 6) * 0.1)  # a's last token
    a_alone = 0.010 + 49 * 0.1
    assert sim.now > a_alone + 0.6  # 7 tokens' decode steps lost to b's prefill


def test_a_prompt_arriving_on_a_step_boundary_waits_a_whole_step() -> None:
    # The client's next request takes time to arrive: by then the next step has begun.
    sim = run(b_arrives=0.31)  # a's progress: exactly 3 tokens
    assert sim.ttfts[1] == pytest.approx(0.1 + 1.002, rel=1e-6)
