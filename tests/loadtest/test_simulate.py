"""The cluster simulator on small workloads (a few seconds in all)."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest import skewed_docs
from loadtest.sim_client import WordTokenizer
from loadtest.sim_cluster import SimCluster
from loadtest.sim_cost import CostModel
from loadtest.sim_replica import SimReplica, SimRequest
from loadtest.simulate import run_comparison, simulate, working_set_blocks
from loadtest.workloads import generate
from replica.prefix_cache import PrefixCache
from router.config import RouterConfig


def small_chat() -> list:  # type: ignore[type-arg]
    return generate(
        "multi_turn_chat",
        sessions=16,
        turns=3,
        system_len=200,
        user_len=20,
        max_tokens=16,
        rate=0.5,
    )


def test_every_turn_is_served_and_runs_are_deterministic() -> None:
    sessions = small_chat()
    a = simulate(sessions, "cache_aware", 3, 200)
    assert a.requests == sum(len(s.turns) for s in sessions) == sum(a.requests_per_replica)
    assert a == simulate(sessions, "cache_aware", 3, 200)
    assert 0 < a.hit_rate < 1 and a.ttft_p50_s <= a.ttft_p99_s < a.total_time_s
    # Each request once, as served: its session's turns in order, on a named replica.
    assert sorted((r.session_id, r.turn) for r in a.served) == sorted(
        (s.session_id, t) for s in sessions for t in range(len(s.turns))
    )
    assert sum(r.cached_tokens for r in a.served) / sum(r.prompt_tokens for r in a.served) == (
        pytest.approx(a.hit_rate)
    )
    assert {r.replica for r in a.served} <= {"replica-0", "replica-1", "replica-2"}
    assert all(0 <= r.ttft_s <= a.total_time_s for r in a.served)


def test_cache_aware_beats_round_robin_and_stays_near_the_oracle() -> None:
    results = {r.policy: r for r in run_comparison(small_chat(), n_replicas=4)}
    oracle, aware, rr = results["oracle"], results["cache_aware"], results["round_robin"]
    assert aware.hit_rate > rr.hit_rate + 0.05
    # 48 requests on 64-block pools: one placement moves the hit rate by ~0.01.
    assert aware.hit_rate >= 0.88 * oracle.hit_rate
    assert set(results) == {"oracle", "cache_aware", "round_robin", "consistent_hash"}


def test_a_hot_system_prompt_is_replicated_not_hoarded() -> None:
    sessions = generate(
        "shared_system_prompt",
        requests=80,
        system_len=300,
        question_len=20,
        max_tokens=16,
        rate=4.0,
    )
    result = simulate(sessions, "cache_aware", 4, 400)
    assert min(result.requests_per_replica) > 0.6 * max(result.requests_per_replica)
    assert result.hit_rate > 0.8
    assert result.decisions.get("spill", 0) > 0


def test_at_low_load_the_balance_price_puts_idle_replicas_to_work() -> None:
    # One request every 2 s onto 8 replicas: the greedy rule alone keeps a hot system
    # prompt on the replicas holding it (the holder is always sooner for this request)
    # and leaves the rest idle. The balance price (the default) copies it to the idle
    # replicas, each once, and spreads the busy time at a small cost in hit rate. (The
    # greedy run also counts recomputes at the full weight while a prefix is pending:
    # that rule copies the prompt once or twice at the start.)
    sessions = generate(
        "shared_system_prompt",
        requests=120,
        system_len=300,
        question_len=20,
        max_tokens=16,
        rate=0.5,
    )
    greedy_config = RouterConfig(balance_tokens=0.0, pending_recompute_weight=1.5)
    (oracle, greedy), (_, balanced) = (
        run_comparison(sessions, ["cache_aware"], n_replicas=8, config=config)
        for config in (greedy_config, RouterConfig())
    )
    assert greedy.busy_imbalance > 3 and min(greedy.requests_per_replica) == 0
    # Busy time within 1 + balance_slack (1.25) of the mean is not priced.
    assert balanced.busy_imbalance < 1.6 and min(balanced.requests_per_replica) > 0
    assert balanced.hit_rate >= 0.9 * oracle.hit_rate
    assert balanced.decisions["spill"] <= 8 + 2  # about one copy per replica, no churn


def test_piling_onto_one_replica_shows_up_as_waiting() -> None:
    sessions = generate(
        "shared_system_prompt",
        requests=40,
        system_len=100,
        question_len=10,
        max_tokens=8,
        rate=20.0,
    )
    spread = simulate(sessions, "round_robin", 4, 200)
    piled = simulate(sessions, "round_robin", 1, 800)  # one replica, the same compute each
    assert piled.ttft_p50_s > 2 * spread.ttft_p50_s
    assert piled.total_time_s > spread.total_time_s


@pytest.mark.parametrize("head", [100, 600])
def test_prompts_queued_together_share_their_prefill_steps(head: int) -> None:
    # The engine's scheduler fills a step's token budget (512) with waiting prompts; the
    # simulated replica prefills the queue's head with the prompts behind it that fit in
    # its steps' leftover budget (FIFO: the first that does not fit waits, and all
    # behind it). A 100-token head has one step, 412 tokens to spare; a 600-token head
    # two steps, 424. The group's first tokens all come at its last step.
    cost = CostModel(prefill_chunk=512)
    replica = SimReplica("r0", PrefixCache(num_blocks=400, block_size=16), scale=1.0)
    sizes = [head, 300, 200, 40]
    requests = [
        SimRequest(None, list(range(k * 1000, k * 1000 + n)), [1] * 4, 0.0)  # type: ignore[arg-type]
        for k, n in enumerate(sizes)
    ]
    replica.queue.extend(requests)
    started = replica.start_prefill(0.0, cost)
    assert started is not None
    group, took = started
    assert group == requests[:2]  # head + 300 fit; + 200 would not
    assert took == pytest.approx(cost.prefill_s(head + 300))
    assert replica.start_prefill(0.0, cost) is None  # one group at a time
    done = replica.finish_prefill(took, cost)
    assert done == group and all(r.first_token_at == took for r in done)
    rest = replica.start_prefill(took, cost)
    assert rest is not None and rest[0] == requests[2:]  # 200 + 40 in one step


def test_a_prompt_the_prefilling_group_computes_waits_for_its_blocks() -> None:
    # The engine's scheduler defers a waiting prompt while a running prefill computes
    # one more full block of it than the cache holds, so that a burst on one new prefix
    # computes it once. Two 100-token prompts sharing their first 64 tokens: the second
    # would fit in the first's step, but waits first in the queue (with all behind it),
    # then finds the shared blocks cached. A prompt sharing less than a block joins.
    cost = CostModel(prefill_chunk=512)
    replica = SimReplica("r0", PrefixCache(num_blocks=400, block_size=16), scale=1.0)
    shared = list(range(64))
    first = SimRequest(None, shared + list(range(1000, 1036)), [1] * 4, 0.0)  # type: ignore[arg-type]
    twin = SimRequest(None, shared + list(range(2000, 2036)), [1] * 4, 0.0)  # type: ignore[arg-type]
    other = SimRequest(None, shared[:8] + list(range(3000, 3092)), [1] * 4, 0.0)  # type: ignore[arg-type]
    replica.queue.extend([first, twin, other])
    started = replica.start_prefill(0.0, cost)
    assert started is not None and started[0] == [first]
    replica.finish_prefill(started[1], cost)
    rest = replica.start_prefill(started[1], cost, boundary=True)
    assert rest is not None and rest[0] == [twin, other]
    assert twin.cached == 64 and other.cached == 0


def test_replies_that_end_in_one_step_leave_in_joining_order_not_by_address() -> None:
    # Two replies of one length, prefilled together, end at the same step. Ordered by
    # object address, which reply leaves first (and so the next decisions) would depend
    # on what the process allocated before: a grid's cell would differ from the same
    # cell run alone. They leave in the order they joined the batch.
    cost = CostModel(prefill_chunk=512)
    replica = SimReplica("r0", PrefixCache(num_blocks=400, block_size=16), scale=1.0)
    pair = [
        SimRequest(None, list(range(k * 1000, k * 1000 + 50)), [1] * 4, 0.0)  # type: ignore[arg-type]
        for k in range(2)
    ]
    pair.sort(key=id, reverse=True)  # the higher address joins first
    replica.queue.extend(pair)
    started = replica.start_prefill(0.0, cost)
    assert started is not None and started[0] == pair
    replica.finish_prefill(started[1], cost)
    done_at = started[1] + 10.0  # well past both replies' ends
    assert [replica.finish_decode(done_at, cost) for _ in pair] == pair


def test_cost_model_and_tokenizer() -> None:
    cost = CostModel()
    assert cost.prefill_s(2000) == pytest.approx(5.6)
    assert cost.step_s(1) == cost.decode_s_per_token < cost.step_s(8) < 8 * cost.step_s(1)
    assert cost.step_s(8, scale=8) == cost.step_s(1)
    tok = WordTokenizer()
    assert tok.encode("a b a") == [tok.encode("a")[0], tok.encode("b")[0], tok.encode("a")[0]]
    assert working_set_blocks(small_chat()) > 0


def test_closed_loop_runs_at_most_concurrency_sessions_at_once() -> None:
    sessions = small_chat()
    one = simulate(sessions, "cache_aware", 2, 400, think_s=0.0, concurrency=1)
    four = simulate(sessions, "cache_aware", 2, 400, think_s=0.0, concurrency=4)
    assert one.requests == four.requests == sum(len(s.turns) for s in sessions)
    # One session at a time never waits behind another: every TTFT is its own prefill.
    assert four.total_time_s < one.total_time_s
    assert one.ttft_p99_s <= four.ttft_p99_s


def test_given_prompts_are_sent_as_they_are() -> None:
    sessions = small_chat()[:4]
    words = WordTokenizer()
    # Each turn's prompt = a shared 64-token head + the session's own growing history.
    prompts = []
    for s in sessions:
        history = words.encode(s.session_id + " " + s.system)
        turns = []
        for turn in s.turns:
            history = history + words.encode(turn.user)
            turns.append(list(range(64)) + history)
            history = history + [7] * turn.max_tokens  # what the "client" appends
        prompts.append(turns)
    result = simulate(
        sessions, "round_robin", 1, 10_000, think_s=0.0, concurrency=1, prompts=prompts
    )
    assert result.requests == sum(len(t) for t in prompts)
    # Brute force: a prompt's cached tokens are its leading whole blocks already sent or
    # received (the cache may also share one partial tail block: up to 15 more).
    seen: set[tuple[int, ...]] = set()
    expected, total = 0, 0
    for turns in prompts:
        for i, prompt in enumerate(turns):
            blocks = [tuple(prompt[: j + 16]) for j in range(0, len(prompt) - 15, 16)]
            expected += 16 * next((j for j, b in enumerate(blocks) if b not in seen), len(blocks))
            total += len(prompt)
            sent = prompt + ([7] * 16 if i + 1 < len(turns) else [])
            seen.update(tuple(sent[: j + 16]) for j in range(0, len(sent) - 15, 16))
    cached = result.hit_rate * total
    assert expected - 1e-6 <= cached <= expected + 15 * result.requests
    assert expected > 0.5 * total  # the head and the histories really are reused
    with pytest.raises(ValueError, match="one prompt per turn"):
        simulate(sessions, "round_robin", 1, 100, prompts=[turns[:1] for turns in prompts])


def test_skewed_single_turn_documents_routed_without_conversation_keys() -> None:
    sessions = skewed_docs.generate(docs=12, lengths=(100, 300), requests=60, rate=2.0)
    assert all(len(s.turns) == 1 for s in sessions)
    docs = Counter(s.system for s in sessions)
    assert len(docs) > 3 and docs.most_common(1)[0][1] > 60 / 12 * 2  # skewed
    assert skewed_docs.variant("docs_mixed_hot", seed=1) == skewed_docs.variant(
        "docs_mixed_hot", seed=1
    )
    with pytest.raises(ValueError, match="docs_short_hot"):
        skewed_docs.variant("nope")
    results = {
        r.policy: r
        for r in run_comparison(sessions, ("cache_aware", "round_robin"), conversation_keys=False)
    }
    assert results["cache_aware"].hit_rate > results["round_robin"].hit_rate
    # Busy time is measured per replica: every replica that took a request was busy.
    rr = results["round_robin"]
    assert all(b > 0 for b in rr.busy_s_per_replica) and rr.busy_imbalance >= 1.0


def test_a_shared_cache_gives_every_replica_every_block() -> None:
    """The shared-cache reference: N replicas, one cache of N× the blocks. Round robin
    scatters every conversation, yet hits as the oracle does (a block any replica
    computed is a hit on all), where on partitioned caches it loses to cache_aware."""
    sessions = small_chat()
    results = {
        r.policy: r
        for r in run_comparison(
            sessions, ("round_robin", "cache_aware"), n_replicas=4, shared=("round_robin",)
        )
    }
    oracle, shared = results["oracle"], results["shared:round_robin"]
    assert shared.n_replicas == 4 and min(shared.requests_per_replica) > 0
    assert shared.hit_rate >= 0.98 * oracle.hit_rate
    assert shared.hit_rate > results["cache_aware"].hit_rate > results["round_robin"].hit_rate


@pytest.mark.parametrize("whole_answers", [False, True])
def test_whole_answers_teach_the_router_nothing_of_prefill_cost(whole_answers: bool) -> None:
    """Clients that do not stream: the router hears of each request's end only (its
    tokens leave the queue then), so its time-to-first-token fit learns nothing, and
    it predicts with the configured cost per token."""
    sim = SimCluster(
        small_chat(),
        "cache_aware",
        3,
        200,
        CostModel(),
        scale=1.0,
        think_s=1.0,
        seed=0,
        config=None,
        whole_answers=whole_answers,
    )
    sim.run()
    samples = sim.router.cluster_cost.samples
    assert (samples == 0) if whole_answers else (samples > 10)
    assert all(v.in_flight == 0 and v.load.queued_tokens == 0 for v in sim.router.replicas.values())
    sim.router.check_invariants()
