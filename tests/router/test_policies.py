"""Each routing rule, on hand-built candidates."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.config import RouterConfig
from router.policies import POLICIES, Candidate, Policy, RouteInput, make_policy
from router.ring import Ring

IDS = ["r0", "r1", "r2", "r3"]


def policy(name: str, seed: int = 0, **config: float) -> object:
    ring = Ring()
    for rid in IDS:
        ring.add(rid)
    return make_policy(name, RouterConfig(**config), ring, random.Random(seed))  # type: ignore[arg-type]


def request(
    loads: list[int],
    matched: list[int],
    conversation: str | None = None,
    recent: list[int] | None = None,
    continuing: bool = False,
) -> RouteInput:
    cands = [
        Candidate(rid, load, m, r)
        for rid, load, m, r in zip(IDS, loads, matched, recent or [0] * 4, strict=True)
    ]
    return RouteInput(cands, 8, conversation, b"k" * 16, continuing)


def test_unknown_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cache_aware"):
        policy("nope")


def test_cache_aware_longest_prefix_wins() -> None:
    choice = policy("cache_aware").choose(request([1, 1, 1, 1], [2, 8, 3, 0]))  # type: ignore[attr-defined]
    assert choice.replica_id == "r1"
    assert choice.reason == "prefix_match 8/8 blocks"


def test_cache_aware_overloaded_best_match_falls_back_to_next_best() -> None:
    # queue bound = ceil(1.5 * (12 + 1) / 4) + 1 = 6; r0 would hold 10 > 6.
    choice = policy("cache_aware").choose(request([9, 1, 1, 1], [8, 4, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r1", "overload_fallback")


def test_cache_aware_hot_prefix_spreads_to_an_open_replica() -> None:
    # Everyone's request shares the prefix that only r0 holds; r0 is over its share.
    choice = policy("cache_aware").choose(request([9, 1, 0, 2], [8, 0, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r2", "overload_fallback")  # the least loaded open replica


def share_policy() -> Policy:
    """cache_aware with the default bounds: share ε 0.1 (+0), queue ε 0.5 (+1)."""
    return policy("cache_aware")  # type: ignore[return-value]


def test_cache_aware_share_bound_spreads_what_sticks() -> None:
    # r0 holds the prefix and is not queued, but took 30 of the last 64 decisions:
    # share bound = ceil(1.1 * (64 + 1) / 4) = 18 < 31.
    recent = [30, 10, 12, 12]
    req = request([2, 2, 1, 2], [8, 0, 0, 0], None, recent)
    assert share_policy().choose(req) == ("r2", "overload_fallback")
    # Turned off, or for a conversation the router has routed before: the match wins.
    off = policy("cache_aware", share_slack=None)  # type: ignore[arg-type]
    assert off.choose(req) == ("r0", "prefix_match 8/8 blocks")  # type: ignore[attr-defined]
    continuing = request([2, 2, 1, 2], [8, 0, 0, 0], "chat-1", recent, continuing=True)
    assert share_policy().choose(continuing) == ("r0", "prefix_match 8/8 blocks")
    # Within its share (17 + 1 <= ceil(1.1 * 63 / 4) = 18) it keeps the match.
    recent = [17, 15, 15, 15]
    choice = share_policy().choose(request([2, 2, 1, 2], [8, 0, 0, 0], None, recent))
    assert choice == ("r0", "prefix_match 8/8 blocks")


def test_cache_aware_queue_bound_wins_when_no_replica_passes_both() -> None:
    # r3 has the fewest recent decisions but a queue (bound ceil(1.5*9/4)+1 = 5 < 9);
    # r0-r2 are over their share (bound ceil(1.1*41/4) = 12): the queue bound alone.
    recent = [13, 13, 14, 0]
    loads = [0, 0, 0, 8]
    choice = share_policy().choose(request(loads, [0, 3, 0, 8], None, recent))
    assert choice == ("r1", "overload_fallback")


def test_cache_aware_small_imbalance_keeps_the_match() -> None:
    # queue bound = ceil(1.5 * (15 + 1) / 4) + 1 = 7: r0 taking a 5th request is within
    # it, and 8 matched blocks outweigh one request more in flight at 4 blocks a request.
    pol = policy("cache_aware", load_cost_blocks=4)
    choice = pol.choose(request([4, 4, 3, 4], [8, 0, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r0", "prefix_match 8/8 blocks")


def test_cache_aware_prices_load_in_blocks() -> None:
    # Everyone is under the bound (ceil(1.5 * 8 / 4) + 1 = 4); r0's one-block match is
    # not worth a request more in flight than r1 at the default 2 blocks a request ...
    choice = policy("cache_aware").choose(request([2, 1, 2, 2], [1, 0, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r1", "load_tradeoff")
    # ... but 8 blocks are at 4 blocks a request; and with load priced at 0 any longer
    # match wins.
    choice = policy("cache_aware", load_cost_blocks=4).choose(request([2, 1, 2, 2], [8, 0, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r0", "prefix_match 8/8 blocks")
    choice = policy("cache_aware", load_cost_blocks=0).choose(request([2, 1, 2, 2], [1, 0, 0, 0]))  # type: ignore[attr-defined]
    assert choice == ("r0", "prefix_match 1/8 blocks")


def test_cache_aware_ties_go_to_the_conversation_ring() -> None:
    pol = policy("cache_aware")
    ring_first = pol.ring.rank("conv-7", set(IDS))  # type: ignore[attr-defined]
    choice = pol.choose(request([1, 1, 1, 1], [4, 4, 4, 4], "conv-7"))  # type: ignore[attr-defined]
    assert choice.replica_id == ring_first


def test_cache_aware_ties_without_conversation_go_to_the_least_loaded() -> None:
    choice = policy("cache_aware").choose(request([2, 1, 0, 2], [4, 4, 4, 0]))  # type: ignore[attr-defined]
    assert choice.replica_id == "r2"


def test_cache_aware_no_match_uses_ring_or_two_choices() -> None:
    pol = policy("cache_aware")
    with_conv = pol.choose(request([0, 0, 0, 0], [0, 0, 0, 0], "conv-1"))  # type: ignore[attr-defined]
    assert with_conv.reason == "ring"
    assert with_conv.replica_id == pol.ring.rank("conv-1", set(IDS))  # type: ignore[attr-defined]
    without = pol.choose(request([5, 0, 5, 5], [0, 0, 0, 0]))  # type: ignore[attr-defined]
    assert without.reason == "least_loaded"


@pytest.mark.parametrize("name", ["cache_aware", "least_loaded", "power_of_two", "random"])
def test_no_list_order_bias(name: str) -> None:
    """Equal matches and loads: every replica gets a fair share, first in list or not."""
    pol = policy(name, seed=1)
    counts = Counter(
        pol.choose(request([1, 1, 1, 1], [3, 3, 3, 3])).replica_id  # type: ignore[attr-defined]
        for _ in range(800)
    )
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 800 / 4 * 1.35


def test_cache_aware_ties_spread_over_conversations() -> None:
    pol = policy("cache_aware")
    counts = Counter(
        pol.choose(request([1, 1, 1, 1], [3, 3, 3, 3], f"c{i}")).replica_id  # type: ignore[attr-defined]
        for i in range(800)
    )
    assert set(counts) == set(IDS) and max(counts.values()) < 800 / 4 * 1.35


def test_round_robin_cycles_in_id_order_whatever_the_list_order() -> None:
    pol = policy("round_robin")
    req = request([0, 0, 0, 0], [0, 0, 0, 0])
    shuffled = RouteInput(list(reversed(req.candidates)), 8, None, None)
    picks = [pol.choose(req if i % 2 else shuffled).replica_id for i in range(8)]  # type: ignore[attr-defined]
    assert picks == IDS + IDS


def test_least_loaded_and_power_of_two() -> None:
    assert policy("least_loaded").choose(request([3, 2, 0, 1], [0] * 4)).replica_id == "r2"  # type: ignore[attr-defined]
    pol = policy("power_of_two", seed=3)
    picks = Counter(pol.choose(request([9, 0, 0, 0], [0] * 4)).replica_id for _ in range(200))  # type: ignore[attr-defined]
    assert picks["r0"] == 0  # the loaded one never wins a pair


def test_consistent_hash_is_sticky_and_skips_overloaded_nodes() -> None:
    pol = policy("consistent_hash")
    home = pol.ring.rank("conv-3", set(IDS))  # type: ignore[attr-defined]
    loads = [1, 1, 1, 1]
    assert pol.choose(request(loads, [0] * 4, "conv-3")) == (home, "ring")  # type: ignore[attr-defined]
    loads[IDS.index(home)] = 20  # over (1+ε)·mean: the next node on the ring takes it
    choice = pol.choose(request(loads, [0] * 4, "conv-3"))  # type: ignore[attr-defined]
    walk = [r for r in pol.ring.walk("conv-3")]  # type: ignore[attr-defined]
    assert choice == (walk[1], "ring_skip_overloaded")


def test_every_policy_is_registered() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "least_loaded",
        "power_of_two",
        "consistent_hash",
        "cache_aware",
    }
