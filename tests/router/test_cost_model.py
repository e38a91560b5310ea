"""The cost model through the Router: queued tokens, first bytes, learned costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RouterConfig
from router.cost import BOUND, CLIP, TOKEN_UNIT, ReplicaSpeed, TtftFit
from router.load import InFlight
from router.protocol import BlockEvent, KeySpace, ReplicaLoad
from router.router import Router

SPACE = KeySpace("m")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(doc: int, blocks: int, question: int = 0) -> list[bytes]:
    """Short keys of ``blocks`` blocks of document ``doc``, then one question block."""
    tokens = [doc] * (16 * blocks) + ([question] * 16 if question else [])
    return SPACE.short_keys(tokens)


def make(n: int = 2, **config: float) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router(RouterConfig(**config), clock=clock, seed=0)  # type: ignore[arg-type]
    for i in range(n):
        router.add_replica(f"r{i}", f"http://r{i}", model="m", static=True)
    return router, clock


def hold(router: Router, replica_id: str, keys: list[bytes], seq: int = 1) -> None:
    assert router.apply_event(replica_id, BlockEvent(seq, "stored", tuple(keys)))


def test_routed_tokens_count_until_the_first_byte_which_teaches_the_cost() -> None:
    router, clock = make(decode_tokens_per_request=0)
    hold(router, "r0", prompt(1, 8))
    decision = router.route(prompt(1, 8, question=5), prompt_tokens=150)
    assert (decision.replica_id, decision.uncached_tokens, decision.queued_tokens) == (
        "r0",
        150 - 8 * 16,
        0,
    )
    request = router.request_started("r0", decision.uncached_tokens, decision.queued_tokens)
    stats = router.stats()["replicas"]["r0"]
    assert stats["queued_tokens"] == 22 and stats["in_flight"] == 1
    # The next request on the same document sees it queued behind the first.
    assert router.route(prompt(1, 8, question=6), prompt_tokens=150).queued_tokens == 22
    clock.now += 0.5
    router.first_byte(request)
    router.first_byte(request)  # only the first call counts
    assert router.stats()["replicas"]["r0"]["queued_tokens"] == 0
    assert router.stats()["replicas"]["r0"]["in_flight"] == 1  # still decoding
    router.request_finished(request, ok=True)
    router.request_finished(request, ok=True)  # ignored
    assert router.replicas["r0"].in_flight == 0
    router.check_invariants()


def test_the_prompt_being_prefilled_drains_from_the_queue_as_time_passes() -> None:
    # 8,192 tokens a second (times below are exact in binary).
    router, clock = make(decode_tokens_per_request=0, prefill_s_per_token=2**-13)
    first = router.request_started("r0", uncached_tokens=1_000)
    second = router.request_started("r0", uncached_tokens=400)
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 1_400
    clock.now += 1 / 16  # the first prompt, the oldest, is 512 tokens in
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 888
    assert router.stats()["replicas"]["r0"]["queued_tokens"] == 888
    clock.now += 1.0  # long overdue: it drains no further than its own tokens
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 400
    # It fails (a first byte would do the same, and teach the cost): the second prompt
    # starts now, not when it was sent.
    router.request_finished(first, ok=None)
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 400
    clock.now += 1 / 32
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 144
    router.first_byte(second)
    assert router.stats()["replicas"]["r0"]["queued_tokens"] == 0
    # With a fixed part in the fit, a prompt at the front computes nothing before it.
    fit = router.cluster_cost
    fit.fixed_s, fit.s_per_token = 1 / 8, 2**-13
    router.replicas["r0"].speed.factor = 1.0
    third = router.request_started("r0", uncached_tokens=1_000)
    clock.now += 1 / 8
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 1_000
    clock.now += 1 / 16
    assert router.route(prompt(1, 8), prompt_tokens=128, exclude={"r1"}).queued_tokens == 488
    router.request_finished(third, ok=True)
    router.check_invariants()


def test_a_slower_replica_learns_a_higher_cost_and_new_work_shifts_away() -> None:
    router, clock = make(decode_tokens_per_request=0)
    # r0 answers 4x slower per token than r1.
    for tokens in (160, 320, 640) * 20:
        for rid, s_per_token in (("r0", 0.00125), ("r1", 0.0003125)):
            request = router.request_started(rid, uncached_tokens=tokens)
            clock.now += tokens * s_per_token
            router.first_byte(request)
            router.request_finished(request, ok=True)
    stats = router.stats()["replicas"]
    cluster = router.cluster_cost
    predicted = {
        rid: cluster.predict(320, 0) * router.replicas[rid].speed.factor for rid in ("r0", "r1")
    }
    assert predicted["r0"] == pytest.approx(0.4, rel=0.1)
    assert predicted["r1"] == pytest.approx(0.1, rel=0.1)
    assert stats["r0"]["s_per_token"] == pytest.approx(4 * stats["r1"]["s_per_token"], rel=0.15)
    # New 320-token prompts now go to r1, until r1's queue costs more than r0's slower
    # compute: (queued + 320) x 0.31 ms against 320 x 1.25 ms, i.e. 3 queued there.
    placed = []
    for i in range(6):
        decision = router.route(prompt(100 + i, 20), prompt_tokens=320)
        router.request_started(decision.replica_id, decision.uncached_tokens)
        placed.append(decision.replica_id)
    assert placed[:3] == ["r1"] * 3 and "r0" in placed[3:]
    router.check_invariants()


def test_a_replica_running_requests_loses_to_an_idle_one_once_they_cost_more() -> None:
    # Both replicas hold the document; each request in flight delays a first token by
    # 40 ms there, measured. r0 runs some, r1 none: r1 wins as soon as r0 runs one.
    router, clock = make(2, decode_tokens_per_request=0)
    for rid in ("r0", "r1"):
        hold(router, rid, prompt(1, 8))
        for running in (0, 1, 2, 3) * 8:
            for _ in range(running):
                router.request_started(rid)
            request = router.request_started(rid, uncached_tokens=200)
            clock.now += 0.02 + 0.0005 * 200 + 0.04 * running
            router.first_byte(request)
            router.request_finished(request, ok=True)
            for _ in range(running):
                router.request_finished(rid, ok=True)
    for replica in router.stats()["replicas"].values():
        assert replica["s_per_running"] == pytest.approx(0.04, rel=0.05)
    busy = router.request_started("r0")
    decision = router.route(prompt(1, 8, question=7), prompt_tokens=150)
    assert decision.replica_id == "r1" and "r1 predicted" in decision.reason
    router.request_finished(busy, ok=True)
    router.check_invariants()


def test_a_hot_prefix_is_replicated_once_its_queue_costs_more_than_recomputing() -> None:
    router, _ = make(3, decode_tokens_per_request=0)
    hold(router, "r0", prompt(1, 40))  # a 640-token document, cached on r0 only
    placed = []
    for i in range(8):
        decision = router.route(prompt(1, 40, question=100 + i))
        router.request_started(decision.replica_id, decision.uncached_tokens)
        placed.append((decision.replica_id, decision.reason.split(" ", 1)[0]))
    # Each question adds 16 tokens to r0's queue; recomputing the 656 tokens elsewhere
    # never wins within 8 questions, so they all wait on r0.
    assert placed == [("r0", "prefix_match")] * 8
    # A long prefill lands on r0 (someone else's 1,000 tokens): now r1 is cheaper.
    router.request_started("r0", uncached_tokens=1_000)
    spilled = router.route(prompt(1, 40, question=200))
    assert spilled.replica_id != "r0" and spilled.reason.startswith("spill cost: ")
    assert "r0 predicted" in spilled.reason and "queued 1,128 tok" in spilled.reason
    # The optimistic insert makes the replica that computed it a holder at once: the
    # next question waits behind 656 tokens there or 1,128 on r0, and takes the former.
    router.request_started(spilled.replica_id, spilled.uncached_tokens)
    again = router.route(prompt(1, 40, question=201))
    assert again.replica_id == spilled.replica_id and again.reason.startswith("prefix_match")


def test_a_continuing_conversation_stays_with_its_history_unless_moving_is_cheaper() -> None:
    router, _ = make(2, decode_tokens_per_request=0)
    history = prompt(9, 30)
    hold(router, "r1", history)
    decision = router.route(history + prompt(9, 1, question=3)[-1:], "chat-1")
    assert decision.replica_id == "r1"
    # The same rule, no exemption: a queue that costs more than recomputing its history
    # (496 tokens at 1.5x: 744 against 900 + 16 + 8) moves it.
    router.request_started("r1", uncached_tokens=900)
    moved = router.route(history + prompt(9, 1, question=4)[-1:], "chat-1")
    assert moved.replica_id == "r0" and moved.reason.startswith("spill")


def test_other_gateways_queued_tokens_come_from_the_replicas_report() -> None:
    router, _ = make(2)
    mine = router.request_started("r0", uncached_tokens=100)
    router.update_load("r0", ReplicaLoad(running=3, queued_prefill_tokens=900))
    view = router.replicas["r0"]
    assert view.load.queued == 900 and view.load.others_tokens == 800
    router.first_byte(mine)
    assert view.load.queued == 800  # the others' until their next report or it goes stale
    assert router.stats()["replicas"]["r0"]["queued_tokens"] == 800


def test_what_this_gateways_view_drained_is_not_counted_as_other_gateways_load() -> None:
    router, clock = make(2, prefill_s_per_token=2**-13)
    router.request_started("r0", uncached_tokens=1_000)
    clock.now += 1 / 16  # 512 of its tokens computed
    # The replica has 488 of ours left and 300 of another gateway's.
    router.update_load("r0", ReplicaLoad(running=2, queued_prefill_tokens=788))
    assert router.replicas["r0"].load.others_tokens == 300
    assert router.stats()["replicas"]["r0"]["queued_tokens"] == 788
    router.check_invariants()


def test_a_request_ended_by_replica_id_ends_the_oldest_handle() -> None:
    router, _ = make(1)
    first = router.request_started("r0", 10)
    router.request_started("r0", 20)
    router.request_finished("r0", ok=True)
    assert first.done and router.replicas["r0"].load.queued_tokens == 20
    router.check_invariants()


def test_the_fit_recovers_fixed_per_token_and_per_running_terms() -> None:
    fit = TtftFit(0.00015, 0.02)
    for i in range(300):
        tokens, running = (i * 397) % 3000, (i * 7) % 9
        fit.observe(tokens, running, 0.05 + 0.001 * tokens + 0.03 * running)
        fit.check_invariants()
    assert fit.fixed_s == pytest.approx(0.05, rel=0.05)
    assert fit.s_per_token == pytest.approx(0.001, rel=0.02)
    assert fit.s_per_running == pytest.approx(0.03, rel=0.05)


def test_the_fit_is_robust_bounded_and_never_negative() -> None:
    default = 0.001
    fit = TtftFit(default, 0.01)
    assert (fit.fixed_s, fit.s_per_token, fit.s_per_running, fit.samples) == (0, 0.001, 0.01, 0)
    fit.observe(1000, 0, -1.0)  # a clock that went backwards: ignored
    fit.observe(1000, 0, 0.0)
    assert fit.samples == 0
    for i in range(50):
        fit.observe(500 + 100 * (i % 5), 0, (500 + 100 * (i % 5)) * 0.002)
    before = fit.predict(700, 0)
    fit.observe(700, 0, 1000.0)  # an outlier (a stalled connection) moves it a little
    assert fit.predict(700, 0) < before * 1.2
    # Requests in flight that seem to make the first token sooner: the term stays at 0,
    # never negative.
    for i in range(200):
        fit.observe(1000, i % 6, 2.0 - 0.3 * (i % 6))
        fit.check_invariants()
    assert fit.s_per_running == 0.0 and fit.fixed_s >= 0.0
    for _ in range(2000):
        fit.observe(100_000, 50, 1e9)
    assert fit.s_per_token == pytest.approx(default * BOUND)
    assert fit.fixed_s <= BOUND * TOKEN_UNIT * default
    for _ in range(2000):
        fit.observe(100_000, 0, 1e-9)
    assert fit.s_per_token == pytest.approx(default / BOUND) and fit.s_per_token > 0
    fit.check_invariants()


def test_a_replicas_speed_is_a_bounded_clipped_running_ratio() -> None:
    speed = ReplicaSpeed()
    speed.observe(-1.0, 0.1)  # nonsense samples: ignored
    speed.observe(0.1, 0.0)
    assert (speed.factor, speed.samples) == (1.0, 0)
    speed.observe(1000.0, 0.1)  # an outlier counts as CLIP x the current factor at most
    assert speed.factor == pytest.approx(1.0 + 0.1 * (CLIP - 1.0))
    for _ in range(500):
        speed.observe(0.2, 0.1)
    assert speed.factor == pytest.approx(2.0)
    for _ in range(5000):
        speed.observe(1e9, 1e-9)
        speed.check_invariants()
    assert speed.factor == BOUND
    for _ in range(5000):
        speed.observe(1e-9, 1e9)
    assert speed.factor == 1 / BOUND > 0


def test_a_replica_not_timed_yet_takes_the_clusters_fit() -> None:
    router, clock = make(3, decode_tokens_per_request=0)
    for tokens in (200, 800, 1600) * 20:
        request = router.request_started("r0", uncached_tokens=tokens)
        clock.now += 0.1 + 0.002 * tokens
        router.first_byte(request)
        router.request_finished(request, ok=True)
    stats = router.stats()
    assert stats["cluster_fixed_s"] == pytest.approx(0.1, rel=0.2)
    assert stats["replicas"]["r1"]["cost_samples"] == 0
    # r1 and r2 are predicted with the cluster's fit (the reason says so in ms).
    decision = router.route(prompt(5, 10), prompt_tokens=160)
    expected = router.cluster_cost.predict(160, 0) * 1000
    assert f"predicted {expected:,.0f} ms" in decision.reason


OPS = st.lists(
    st.tuples(
        st.sampled_from(["route", "first_byte", "finish_ok", "fail", "cancel", "by_id", "churn"]),
        st.integers(0, 2),
        st.integers(0, 2_000),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_load_accounting_never_goes_negative_and_drains_to_zero(
    ops: list[tuple[str, int, int]],
) -> None:
    router, clock = make(3)
    handles: list[InFlight] = []
    for op, pick, amount in ops:
        clock.now += amount / 10_000
        live = [h for h in handles if not h.done]
        if op == "route":
            decision = router.route(prompt(pick, 4, question=amount + 1), prompt_tokens=amount)
            handles.append(
                router.request_started(
                    decision.replica_id, decision.uncached_tokens, decision.queued_tokens
                )
            )
        elif op == "by_id":
            router.request_finished(f"r{pick}", ok=amount % 2 == 0)
        elif op == "churn":  # a replica leaves and comes back: its old handles are void
            router.remove_replica(f"r{pick}")
            router.add_replica(f"r{pick}", f"http://r{pick}", model="m", static=True)
        elif handles:
            handle = handles[pick % len(handles)] if not live else live[pick % len(live)]
            if op == "first_byte":
                router.first_byte(handle)
            else:  # answered, failed before the first byte, or cancelled mid-way
                router.request_finished(handle, ok=op == "finish_ok")
        for view in router.replicas.values():
            assert view.load.in_flight >= 0 and view.load.queued_tokens >= 0
        router.check_invariants()
    for handle in handles:
        router.request_finished(handle, ok=False)
    for view in router.replicas.values():
        assert (view.load.in_flight, view.load.queued_tokens, view.load.queued) == (0, 0, 0)
