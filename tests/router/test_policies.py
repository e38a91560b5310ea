"""Each routing rule, on hand-built candidates."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from router.config import RouterConfig
from router.policies import POLICIES, CacheAware, Candidate, Policy, RouteInput, make_policy
from router.ring import Ring

IDS = ["r0", "r1", "r2", "r3"]
COST = 0.001  # seconds per prefill token: predictions in ms = tokens
TIE = CacheAware.TIE_TOKENS


def policy(name: str, seed: int = 0, **config: float) -> Policy:
    ring = Ring()
    for rid in IDS:
        ring.add(rid)
    return make_policy(name, RouterConfig(**config), ring, random.Random(seed))  # type: ignore[arg-type]


def request(
    loads: Sequence[int],
    matched: Sequence[int] = (0, 0, 0, 0),
    conversation: str | None = None,
    *,
    queued: Sequence[int] = (0, 0, 0, 0),
    uncached: Sequence[int] | None = None,
    costs: Sequence[float] = (COST,) * 4,
    decode: int = 0,
    running_s: float = 0.0,
    fixed_s: float = 0.0,
) -> RouteInput:
    """Four candidates r0..r3 of an 8-block (128-token) prompt; uncached tokens default
    to the blocks each does not hold."""
    if uncached is None:
        uncached = [max(1, 128 - 16 * m) for m in matched]
    cands = [
        Candidate(rid, load, m, q, u, c, running_s, fixed_s=fixed_s, decode_tokens=decode)
        for rid, load, m, q, u, c in zip(IDS, loads, matched, queued, uncached, costs, strict=True)
    ]
    return RouteInput(cands, 8, conversation, b"f" * 16, b"l" * 16)


def test_unknown_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cache_aware"):
        policy("nope")


def test_cache_aware_predicts_and_the_longest_cached_prefix_wins_on_idle_replicas() -> None:
    choice = policy("cache_aware").choose(request([1, 1, 1, 1], [2, 8, 3, 0]))
    assert choice.replica_id == "r1"
    # r1 computes 1 token (at least one always is): 1 ms; the runner-up r2: 80 ms.
    assert choice.reason == (
        "prefix_match cost: r1 predicted 1 ms (matched 8/8), r2 predicted 80 ms (matched 3/8)"
    )


@pytest.mark.parametrize("weight", [1.0, 1.5])
@pytest.mark.parametrize("queue", [0, 400, 500, 700, 740, 760, 800, 2000])
def test_a_queued_replica_loses_to_an_idle_one_exactly_when_recomputing_is_cheaper(
    queue: int, weight: float
) -> None:
    # r0 holds the document (10 uncached tokens) behind ``queue`` tokens; r1..r3 are
    # idle and would compute all 510. Same cost per token everywhere. Recomputed tokens
    # are priced ``weight`` times (1: the plain minimum predicted time to first token).
    req = request([1, 0, 0, 0], [8, 0, 0, 0], queued=[queue, 0, 0, 0], uncached=[10, 510, 510, 510])
    pol = policy("cache_aware", recompute_weight=weight)
    choice = pol.choose(req)
    stay, move = queue + weight * 10, weight * 510
    if abs(stay - move) <= TIE:  # within a block's prefill: a tie, the ring decides
        assert choice.replica_id == pol.ring.rank(b"l".hex() * 16, set(IDS))
    if stay < move - TIE:
        assert choice.replica_id == "r0" and choice.reason.startswith("prefix_match")
    if stay > move + TIE:  # recomputing elsewhere is cheaper: the hot prefix spreads
        assert choice.replica_id != "r0"
        assert choice.reason.startswith("spill cost: ")
        # The reason states the plain predictions (queue + own tokens, in ms here).
        assert f"r0 predicted {queue + 10:,} ms (matched 8/8, queued {queue:,} tok)" in (
            choice.reason
        )
        assert f"{choice.replica_id} predicted 510 ms" in choice.reason


def test_a_slower_replica_gets_work_only_when_it_is_predicted_sooner() -> None:
    # r0 is 3x slower per token: with the prefix on both r0 and r1, r1 wins ...
    slow = [3 * COST, COST, COST, COST]
    req = request([0, 0, 0, 0], [8, 8, 0, 0], uncached=[100, 100, 128, 128], costs=slow)
    assert policy("cache_aware", recompute_weight=1.0).choose(req).replica_id == "r1"
    # ... until r1's queue costs more than r0's slower compute (300 ms < 100 + 250).
    req = request(
        [0, 1, 0, 0], [8, 8, 0, 0], queued=[0, 250, 0, 0], uncached=[100, 100, 400, 400], costs=slow
    )
    assert policy("cache_aware", recompute_weight=1.0).choose(req).replica_id == "r0"


def test_ties_follow_the_conversation_ring_then_the_prompts_last_block() -> None:
    pol = policy("cache_aware")
    for conv in ("conv-7", "conv-8", "conv-9"):
        choice = pol.choose(request([1, 1, 1, 1], [4, 4, 4, 4], conv))
        assert choice.replica_id == pol.ring.rank(conv, set(IDS))
    # Within a block's prefill of the best is a tie too; a worse one is not in it.
    choice = pol.choose(request([1, 1, 1, 1], [4, 4, 4, 0], "conv-7", queued=[0, TIE, 3, 0]))
    assert choice.replica_id == pol.ring.rank("conv-7", {"r0", "r1", "r2"})
    # Without a conversation, the prompt's last block key.
    keyless = pol.choose(request([1, 1, 1, 1], [4, 4, 4, 4]))
    assert keyless.replica_id == pol.ring.rank(b"l".hex() * 16, set(IDS))


def test_ties_without_any_key_go_to_the_least_loaded() -> None:
    req = request([2, 1, 0, 2], [0, 0, 0, 0])
    choice = policy("cache_aware").choose(RouteInput(req.candidates, 0, None, None, None))
    assert choice.replica_id == "r2" and choice.reason.startswith("no_match cost: ")


@pytest.mark.parametrize("pending", [False, True])
@pytest.mark.parametrize("conversation", [None, "c"])
@pytest.mark.parametrize("queue", [200, 240, 260, 400])
def test_waiting_for_a_pending_prefix_loses_to_computing_it_on_an_idle_replica(
    queue: int, conversation: str | None, pending: bool
) -> None:
    # r0 holds the 500-token prompt head behind ``queue`` tokens (its own computation of
    # it, or other work) with one request in flight (64 tokens of decode pressure); r1..r3
    # are idle and would compute all 510. A conversation's recomputed tokens count once
    # on them while the prefix is still being computed on r0, else 1.5 times.
    req = request(
        [1, 0, 0, 0],
        [8, 0, 0, 0],
        conversation,
        queued=[queue, 0, 0, 0],
        uncached=[10, 510, 510, 510],
        decode=64,
    )._replace(prefix_pending=pending)
    choice = policy("cache_aware").choose(req)
    stay = queue + 10 + 0.5 * 10 + 64
    move = 510 * (1.0 if pending and conversation else 1.5)
    assert abs(stay - move) > TIE  # (no tie in this range)
    assert (choice.replica_id == "r0") == (stay < move), choice.reason
    if choice.replica_id != "r0":  # it says why the longer match lost
        how = "pending" if pending and conversation else "cost"
        assert choice.reason.startswith(f"spill {how}: "), choice.reason
    # pending_recompute_weight = recompute_weight: the rule is off.
    off = policy("cache_aware", pending_recompute_weight=1.5).choose(req)
    assert (off.replica_id == "r0") == (stay < 1.5 * 510)


@pytest.mark.parametrize("idle", [1, 2, 3])
@pytest.mark.parametrize("new_prompts", [0, 1, 2, 3, 5, 8, 32])
def test_the_pending_rule_leaves_idle_replicas_to_prompts_nobody_holds(
    idle: int, new_prompts: int
) -> None:
    # After ``new_prompts`` decisions whose prompt no replica held, then 32 - that many
    # whose prompt was held, a conversation's prefix is pending on r0 (579 tokens to
    # wait there, 510 to compute on an idle replica: the rule decides alone, 765 > 579).
    # It copies the prefix onto one of the ``idle`` idle replicas only while they are
    # expected to outnumber the new prompts that will need them:
    # idle x (1 - p_new) >= pending_spare_idle (0.8), p_new decayed over balance_window.
    pol = policy("cache_aware")
    held = 32 - new_prompts
    for n in range(32):
        matched = (0, 0, 0, 0) if n >= held else (8, 0, 0, 0)
        pol.choose(request([1, 1, 1, 1], matched, f"other-{n}"))
    keep = 1 - 1 / RouterConfig().balance_window
    fresh, decisions = 0.5 * keep**32, keep**32  # the prior, decayed
    for n in range(32):
        fresh += (1.0 if n >= held else 0.0) * keep ** (31 - n)
        decisions += keep ** (31 - n)
    loads = [1] + [1] * (3 - idle) + [0] * idle
    req = request(
        loads,
        [8, 0, 0, 0],
        "c",
        queued=[500, 0, 0, 0],
        uncached=[10, 510, 510, 510],
        decode=64,
    )._replace(prefix_pending=True)
    choice = pol.choose(req)
    spare = idle * (1 - fresh / decisions)
    assert abs(spare - 0.8) > 1e-6
    assert (choice.replica_id != "r0") == (spare >= 0.8), (spare, choice.reason)
    if choice.replica_id != "r0":
        assert choice.reason.startswith("spill pending: ")
    # pending_spare_idle = 0: any idle replica takes the copy.
    anyway = policy("cache_aware", pending_spare_idle=0).choose(req)
    assert anyway.replica_id != "r0"


def test_decode_pressure_counts_each_request_in_flight() -> None:
    # Same prefix on r0 and r1; r0 runs 3 requests, r1 one: 3·64 + 10 > 1·64 + 10.
    req = request([3, 1, 0, 0], [8, 8, 0, 0], uncached=[10, 10, 500, 500], decode=64)
    assert policy("cache_aware").choose(req).replica_id == "r1"


@pytest.mark.parametrize("parts", [0.0, 1.0])
@pytest.mark.parametrize("running", range(9))
def test_a_replica_running_requests_loses_to_an_idle_one_exactly_when_the_model_says(
    running: int, parts: float
) -> None:
    # Every replica: 20 ms fixed, 1 ms per token. r0 holds the document (10 uncached
    # tokens) and runs ``running`` requests, each measured to delay a first token by
    # 50 ms and priced 64 tokens of decode pressure (+ ``parts`` fixed parts); r1..r3
    # are idle and would compute all 510 tokens (at 1.5x: recomputed).
    req = request(
        [running, 0, 0, 0],
        [8, 0, 0, 0],
        uncached=[10, 510, 510, 510],
        decode=64,
        running_s=0.05,
        fixed_s=0.02,
    )
    choice = policy("cache_aware", decode_fixed_parts=parts).choose(req)
    stay = 20 + 50 * running + 10 + (0.5 * 10 + 64 * running) + parts * 20 * running  # ms
    move = 20 + 510 + 0.5 * 510
    assert abs(stay - move) > TIE  # (no tie in this range)
    assert (choice.replica_id == "r0") == (stay < move)
    # The reason states the plain predicted TTFTs, running requests included.
    said = f"r0 predicted {20 + 50 * running + 10:,} ms (matched 8/8"
    assert said in choice.reason
    if running:
        assert f"{running} in flight)" in choice.reason


def test_the_safety_cap_refuses_a_queue_far_over_the_mean() -> None:
    # r0 would win on the prediction (its cost is tiny) but its queue is over 4x (the
    # others' mean queue + the prompt): the cap keeps it out while another is open.
    req = request(
        [0, 0, 0, 0],
        [8, 0, 0, 0],
        queued=[1_000, 0, 0, 0],
        uncached=[10, 128, 128, 128],
        costs=[COST / 1000, COST, COST, COST],
    )
    assert policy("cache_aware").choose(req).replica_id != "r0"
    assert policy("cache_aware", queue_cap=1000.0).choose(req).replica_id == "r0"


@pytest.mark.parametrize("name", ["cache_aware", "least_loaded", "power_of_two", "random"])
def test_no_list_order_bias(name: str) -> None:
    """Equal predictions and loads: every replica gets a fair share, first in list or
    not (cache_aware: per prompt's last block; here each request has its own)."""
    pol = policy(name, seed=1)
    counts: Counter[str] = Counter()
    for i in range(800):
        req = request([1, 1, 1, 1], [3, 3, 3, 3])
        last = i.to_bytes(16, "little")
        counts[pol.choose(req._replace(last_key=last)).replica_id] += 1
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 800 / 4 * 1.35


def test_cache_aware_ties_spread_over_conversations() -> None:
    pol = policy("cache_aware")
    counts = Counter(
        pol.choose(request([1, 1, 1, 1], [3, 3, 3, 3], f"c{i}")).replica_id for i in range(800)
    )
    assert set(counts) == set(IDS) and max(counts.values()) < 800 / 4 * 1.35


def test_round_robin_cycles_in_id_order_whatever_the_list_order() -> None:
    pol = policy("round_robin")
    req = request([0, 0, 0, 0])
    shuffled = req._replace(candidates=list(reversed(req.candidates)))
    picks = [pol.choose(req if i % 2 else shuffled).replica_id for i in range(8)]
    assert picks == IDS + IDS


def test_least_loaded_and_power_of_two() -> None:
    assert policy("least_loaded").choose(request([3, 2, 0, 1])).replica_id == "r2"
    pol = policy("power_of_two", seed=3)
    picks = Counter(pol.choose(request([9, 0, 0, 0])).replica_id for _ in range(200))
    assert picks["r0"] == 0  # the loaded one never wins a pair


def test_consistent_hash_is_sticky_and_skips_overloaded_nodes() -> None:
    pol = policy("consistent_hash")
    home = pol.ring.rank("conv-3", set(IDS))
    assert home is not None
    loads = [1, 1, 1, 1]
    assert pol.choose(request(loads, conversation="conv-3")) == (home, "ring")
    loads[IDS.index(home)] = 20  # over (1+ε)·mean: the next node on the ring takes it
    choice = pol.choose(request(loads, conversation="conv-3"))
    walk = list(pol.ring.walk("conv-3"))
    assert choice == (walk[1], "ring_skip_overloaded")


def test_every_policy_is_registered_default_first() -> None:
    assert list(POLICIES) == [
        "cache_aware",
        "round_robin",
        "random",
        "least_loaded",
        "power_of_two",
        "consistent_hash",
    ]


@pytest.mark.parametrize(
    ("balance", "slack"),
    [(b, 0.0) for b in (0.0, 80.0, 87.0, 88.0, 103.0, 104.0, 150.0)]
    + [(b, 0.5) for b in (100.0, 116.0, 117.0, 137.0, 138.0, 200.0)]
    + [(b, 1.6) for b in (300.0, 348.0, 350.0, 412.0, 414.0, 500.0)],
)
def test_the_balance_price_moves_a_request_off_a_busy_holder_exactly_when_the_rule_says(
    balance: float, slack: float
) -> None:
    # r0 holds the whole prompt (1 token to compute) and was busy at 4 recent decisions,
    # the others at none; with the prior of one decision each (balance_window=1) its
    # busy ratio is (4 + 1) / mean(5, 1, 1, 1) = 2.5, theirs 0.5. Scores in tokens:
    # r0 1.5 × 1 + max(0, 2.5 − 1 − slack) × balance; r1..r3 1.5 × 128 + (0.5 − 1) ×
    # balance (an idle replica's credit). The holder keeps the request until its balance
    # price makes an idle replica's recompute cheaper; at a slack over 1.5 it pays none,
    # and only the others' credit can move the request.
    pol = policy("cache_aware", balance_tokens=balance, balance_window=1, balance_slack=slack)
    assert isinstance(pol, CacheAware)
    pol.busy.counts["r0"] = 4.0
    pol.busy.decisions = 1  # a full window of history: the price at full weight
    choice = pol.choose(request([0, 0, 0, 0], [8, 0, 0, 0], uncached=[1, 128, 128, 128]))
    stay, move = 1.5 + max(0.0, 1.5 - slack) * balance, 192.0 - 0.5 * balance
    if stay < move - TIE:
        assert choice.replica_id == "r0"
        assert choice.reason.startswith("prefix_match cost: r0 predicted 1 ms (matched 8/8")
    if abs(stay - move) <= TIE:  # a tie: the ring decides (the prompt's last block)
        assert choice.replica_id == pol.ring.rank(b"l".hex() * 16, set(IDS))
    if stay > move + TIE:
        assert choice.replica_id != "r0"
        # The reason states the predictions and the busy ratios behind the move, and
        # names the replica the cost model without the balance price would have chosen.
        assert choice.reason == (
            f"spill balance: {choice.replica_id} predicted 128 ms (busy 0.5x mean), "
            "r0 predicted 1 ms (matched 8/8, busy 2.5x mean)"
        )
    if balance:  # the decision was recorded: every count decayed, the chosen one's grew
        assert pol.busy.count(choice.replica_id) >= 1.0
        pol.busy.check_invariants()
    else:
        assert pol.busy.counts == {"r0": 4.0}  # off: no bookkeeping at all


def test_the_balance_price_applies_only_while_a_replica_is_idle() -> None:
    # The same history as above, a price that moves the request while r3 is idle ...
    pol = policy("cache_aware", balance_tokens=150.0, balance_window=1)
    assert isinstance(pol, CacheAware)
    pol.busy.counts["r0"] = 4.0
    pol.busy.decisions = 1  # a full window of history: the price at full weight
    req = request([1, 1, 1, 0], [8, 0, 0, 0], uncached=[1, 128, 128, 128])
    assert pol.choose(req).reason.startswith("spill balance: ")
    # ... and none once every replica has a request in flight: the queue terms decide.
    pol = policy("cache_aware", balance_tokens=150.0, balance_window=1)
    assert isinstance(pol, CacheAware)
    pol.busy.counts["r0"] = 4.0
    pol.busy.decisions = 1
    assert pol.choose(request([1, 1, 1, 1], [8, 0, 0, 0], uncached=[1, 128, 128, 128])) == (
        "r0",
        "prefix_match cost: r0 predicted 1 ms (matched 8/8), r1 predicted 128 ms",
    )


def test_a_replica_under_its_share_is_credited_only_while_idle() -> None:
    # Busy history r0 4, r1 0, r2 1, r3 4 decisions, prior 1 each: ratios 1.54, 0.31,
    # 0.62, 1.54. Nobody holds the prompt (192 tokens with the recompute weight) and
    # each request in flight costs 128 more. A credit for r1 while it is busy would
    # make it a magnet: it would keep taking requests until its queue outgrew the
    # credit (at 64 live replicas this crowded chat onto 19 busy replicas). So r1 is
    # credited only while it has nothing in flight, as an idle replica is ...
    def choose(loads: list[int]) -> str:
        pol = policy("cache_aware", balance_tokens=1024.0, balance_window=1)
        assert isinstance(pol, CacheAware)
        pol.busy.counts.update({"r0": 4.0, "r2": 1.0, "r3": 4.0})
        pol.busy.decisions = 1  # a full window of history: the price at full weight
        return pol.choose(request(loads, decode=128)).replica_id

    assert choose([0, 0, 0, 0]) == "r1"  # 192 − 0.69 × 1024 against r2's 192 − 0.38 × 1024
    assert choose([1, 0, 0, 1]) == "r1"
    # ... and busy, it competes on its queue terms alone (320) against idle r2 (−202).
    assert choose([1, 1, 0, 1]) == "r2"


def test_the_balance_price_seeds_idle_replicas_with_a_hot_prefix() -> None:
    # One hot 512-token prompt, every request from a fresh client (no conversation key),
    # each request still running when the next arrives on the replica it was sent to
    # (load 1 there). Without the balance price the holder takes all of them; with it,
    # the prompt is copied to the idle replicas, once each, and then stays spread.
    def run(balance: float) -> Counter[str]:
        pol = policy(
            "cache_aware", balance_tokens=balance, balance_window=4, decode_tokens_per_request=0
        )
        holders: set[str] = set()
        recent: list[str] = []
        for _ in range(200):
            loads = [1 if rid in recent[-2:] else 0 for rid in IDS]
            uncached = [1 if rid in holders else 512 for rid in IDS]
            matched = [8 if rid in holders else 0 for rid in IDS]
            choice = pol.choose(request(loads, matched, uncached=uncached))
            holders.add(choice.replica_id)
            recent.append(choice.replica_id)
        return Counter(recent)

    assert len(run(0.0)) == 1
    # A copy costs 1.5 × 512 = 768 tokens: a busy ratio gap of at most ~2.3 (the holder
    # busy at every decision, the others at none, a prior of 4 each) priced 256 tokens a
    # unit never pays for one ...
    assert len(run(256.0)) == 1
    # ... priced 2,048 it does, until all four hold the prompt and take about a quarter
    # each (within the slack: busy up to 1.25× the mean is not priced).
    spread = run(2048.0)
    assert set(spread) == set(IDS)
    assert max(spread.values()) <= 55, spread


@pytest.mark.parametrize(
    ("stall", "queued", "stays"),
    [
        (0.0, 150, True),
        (0.0, 230, False),
        (0.5, 220, True),
        (0.5, 290, False),
        (1.0, 230, True),
        (1.0, 350, False),
        (2.0, 350, True),
        (2.0, 600, False),
    ],
)
def test_the_stall_price_keeps_a_prefill_off_replicas_with_replies_in_flight(
    stall: float, queued: int, stays: bool
) -> None:
    # Every replica is busy. r0 holds the whole prompt (1 token to compute) behind a
    # queue; r1 holds nothing and has 1 request in flight, r2 and r3 have 4 and long
    # queues. In tokens:
    # r0 queued + 1 + (0.5 + 3 × stall) × 1, r1 128 + (0.5 + stall) × 128: recomputing
    # the prompt on r1 stalls its reply for the prefill's length, which the price
    # counts (the tie band is one block, 16 tokens; no case is within it).
    pol = policy("cache_aware", stall_weight=stall)
    req = request(
        [3, 1, 4, 4], [8, 0, 0, 0], queued=[queued, 0, 500, 500], uncached=[1, 128, 128, 128]
    )
    stay, move = queued + 1.5 + 3 * stall, 192 + 128 * stall
    assert (stay < move - TIE) == stays and abs(stay - move) > TIE
    assert pol.choose(req).replica_id == ("r0" if stays else "r1")


def test_the_stall_price_leaves_idle_replicas_alone() -> None:
    # r1 idle: nobody's reply waits for its prefill, whatever the stall weight.
    for stall in (0.0, 1.0, 4.0):
        pol = policy("cache_aware", stall_weight=stall)
        req = request(
            [3, 0, 4, 4], [8, 0, 0, 0], queued=[230, 0, 500, 500], uncached=[1, 128, 128, 128]
        )
        assert pol.choose(req).replica_id == "r1"
