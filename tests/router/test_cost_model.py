"""The cost model through the Router: queued tokens, first bytes, learned costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RouterConfig
from router.cost import BOUND, MIN_TOKENS, PrefillCost
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


def test_a_slower_replica_learns_a_higher_cost_and_new_work_shifts_away() -> None:
    router, clock = make(decode_tokens_per_request=0)
    # r0 answers 4x slower per token than r1.
    for rid, ttft in (("r0", 0.4), ("r1", 0.1)):
        for _ in range(5):
            request = router.request_started(rid, uncached_tokens=320)
            clock.now += ttft
            router.first_byte(request)
            router.request_finished(request, ok=True)
    costs = {rid: v.cost.s_per_token for rid, v in router.replicas.items()}
    assert costs["r0"] == pytest.approx(0.4 / 320) and costs["r1"] == pytest.approx(0.1 / 320)
    # New 320-token prompts now go to r1, until r1's queue costs more than r0's slower
    # compute: (queued + 320) x 0.31 ms against 320 x 1.25 ms, i.e. 3 queued there.
    placed = []
    for i in range(6):
        decision = router.route(prompt(100 + i, 20), prompt_tokens=320)
        router.request_started(decision.replica_id, decision.uncached_tokens)
        placed.append(decision.replica_id)
    assert placed[:3] == ["r1"] * 3 and "r0" in placed[3:]
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


def test_a_request_ended_by_replica_id_ends_the_oldest_handle() -> None:
    router, _ = make(1)
    first = router.request_started("r0", 10)
    router.request_started("r0", 20)
    router.request_finished("r0", ok=True)
    assert first.done and router.replicas["r0"].load.queued_tokens == 20
    router.check_invariants()


def test_prefill_cost_fit_is_robust_bounded_and_positive() -> None:
    cost = PrefillCost(0.001)
    cost.observe(MIN_TOKENS - 1, 10.0)  # too few tokens to say anything
    assert cost.samples == 0 and cost.s_per_token == 0.001
    cost.observe(1000, 2.0)  # the first sample replaces the default
    assert cost.s_per_token == pytest.approx(0.002)
    cost.observe(1000, 1000.0)  # an outlier (a stalled connection) moves it a little
    assert cost.s_per_token < 0.002 * 1.4
    for _ in range(1000):
        cost.observe(100_000, 1e9)
    assert cost.s_per_token == pytest.approx(0.001 * BOUND)
    for _ in range(1000):
        cost.observe(100_000, 1e-9)
    assert cost.s_per_token == pytest.approx(0.001 / BOUND) and cost.s_per_token > 0
    cost.observe(1000, -1.0)  # a clock that went backwards: ignored
    cost.check_invariants()


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
