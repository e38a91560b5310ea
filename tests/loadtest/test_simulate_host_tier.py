"""The cluster simulator's host KV tier: evicted prefixes are demoted, a later match is
promoted when its prefill starts, and the prefill takes the profile's copy time."""

from __future__ import annotations

import pytest

from loadtest.sim_cluster import SimCluster
from loadtest.sim_validate import ProfileCost
from loadtest.simulate import simulate
from loadtest.workloads import Session, Turn
from replica.sim.profiles import builtin_profiles

A100 = builtin_profiles()["llama3.1-8b-a100"]
B = 16


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def sessions() -> list[Session]:
    """a, then b (pushes most of a out of a 64-block pool), then a's document again."""
    doc = words("a", 800)
    return [
        Session("a", "test", doc, [Turn("first question", 4)], 0.0),
        Session("b", "test", words("b", 800), [Turn("other question", 4)], 1.0),
        Session("c", "test", doc, [Turn("second question", 4)], 2.0),
    ]


def run(host_blocks: int) -> SimCluster:
    cost = ProfileCost(profile=A100, mean_context=800)
    sim = SimCluster(
        sessions(),
        "round_robin",
        1,
        64,
        cost,
        scale=1.0,
        think_s=0.0,
        seed=0,
        config=None,
        concurrency=1,
        host_blocks_per_replica=host_blocks,
    )
    sim.run()
    sim.replicas[0].cache.check_invariants()
    return sim


def test_a_host_hit_is_promoted_and_its_copy_time_charged() -> None:
    sim = run(host_blocks=64)
    cost = sim.cost
    stats = sim.replicas[0].cache.stats()
    assert stats.demotions > 0 and stats.promotions > 0
    promoted = stats.promotions
    # c's prompt: a's 800 document words (50 full blocks) + 2 question words.
    prompt = 802
    cached = 800
    host = sim.host_cached_tokens
    assert host == promoted * B and 0 < host < cached
    # Alone on the replica (concurrency 1): its first token ends its prefill's last step.
    expected = cost.prefill_s(prompt - cached) + cost.swap_in_s(promoted)
    assert sim.ttfts[2] == pytest.approx(expected, rel=1e-12)
    assert cost.swap_in_s(promoted) == A100.swap_in_s(promoted, B)
    assert sim.cached_tokens == cached  # a and b found nothing


def test_without_a_host_tier_the_evicted_part_is_computed_again() -> None:
    sim = run(host_blocks=0)
    cost = sim.cost
    stats = sim.replicas[0].cache.stats()
    assert stats.host_total_blocks == 0 and sim.host_cached_tokens == 0
    head = sim.cached_tokens  # only the head blocks a left on the device
    assert 0 < head < 800 and head % B == 0
    assert sim.ttfts[2] == pytest.approx(cost.prefill_s(802 - head), rel=1e-12)
    with_tier = run(host_blocks=64)
    assert with_tier.ttfts[2] < sim.ttfts[2]  # copying back beats recomputing


def test_simulate_reports_the_host_share_of_the_hit_rate() -> None:
    cost = ProfileCost(profile=A100, mean_context=800)
    off = simulate(sessions(), "round_robin", 1, 64, cost, think_s=0.0, concurrency=1)
    on = simulate(
        sessions(), "round_robin", 1, 64, cost, think_s=0.0, concurrency=1,
        host_blocks_per_replica=64,
    )  # fmt: skip
    assert off.host_hit_rate == 0.0 and 0 < on.host_hit_rate < on.hit_rate
    assert on.hit_rate > off.hit_rate
    assert on.hit_rate == pytest.approx(800 / (3 * 802))  # c's 800 document tokens
