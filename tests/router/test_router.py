"""The Router facade: decisions, the index feed, load, health, maintenance."""

from __future__ import annotations

import pytest

from router.config import RouterConfig, with_options
from router.policies import CacheAware
from router.protocol import (
    BlockEvent,
    KeySpace,
    Medium,
    ReplicaLoad,
    RoutedHint,
    Snapshot,
    SnapshotBlock,
)
from router.router import NoHealthyReplica, Router

SPACE = KeySpace("m")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(*token_runs: int) -> list[bytes]:
    """Full 32-byte keys of a prompt made of 16-token blocks with the given token values."""
    return SPACE.keys([t for run in token_runs for t in [run] * 16])


def make(n: int = 3, **config: float) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router(RouterConfig(**config), clock=clock, seed=0)  # type: ignore[arg-type]
    for i in range(n):
        router.add_replica(f"r{i}", f"http://r{i}", model="m", static=True)
    return router, clock


def test_route_prefers_the_replica_with_the_prefix_and_explains_why() -> None:
    router, _ = make()
    prompt = keys(1, 2, 3, 4)
    router.apply_event("r2", BlockEvent(1, "stored", tuple(k[:16] for k in prompt[:3])))
    decision = router.route(prompt)
    assert decision[:1] + decision[2:] == ("r2", 3, 4, 16, 0)  # 16 tokens left to compute
    # The default cost: 16 tokens x 0.15 ms on r2; 64 on the others.
    assert (
        decision.reason == "prefix_match cost: r2 predicted 2 ms (matched 3/4), r0 predicted 10 ms"
    )
    router.check_invariants()


def test_route_takes_short_keys_as_the_gateway_computes_them() -> None:
    router, _ = make()
    tokens = [t for run in (1, 2, 3, 4) for t in [run] * 16]
    short = SPACE.short_keys(tokens)
    assert short == [k[:16] for k in SPACE.keys(tokens)]
    router.apply_event("r1", BlockEvent(1, "stored", tuple(short[:2])))
    decision = router.route(short, "c")
    assert (decision.replica_id, decision.matched_blocks) == ("r1", 2)
    short.append(b"x" * 16)  # the caller's list may grow later: route() kept a copy
    router.request_finished("r1", ok=True)  # folds the deferred optimistic insert
    assert router.route(short, "c").matched_blocks == 4  # the insert's 4 keys, not the 5th
    router.check_invariants()


def test_optimistic_insert_makes_a_burst_stick_and_hooks_see_it() -> None:
    router, _ = make()
    seen: list[tuple[str, list[bytes]]] = []
    router.add_routed_hook(lambda rid, ks: seen.append((rid, ks)))
    first = router.route(keys(7, 8), conversation_key=None)
    second = router.route(keys(7, 8, 9))
    assert second.replica_id == first.replica_id and second.matched_blocks == 2
    assert second.reason.startswith("prefix_match cost: ")
    assert seen[0] == (first.replica_id, [k[:16] for k in keys(7, 8)])
    # Then only what the replica was not known to hold: other gateways get the rest
    # from its events (a 128k-token agent prompt would otherwise be 8,192 keys a hint).
    assert seen[1] == (first.replica_id, [k[:16] for k in keys(7, 8, 9)[2:]])


@pytest.mark.parametrize("publishing", [True, False])
def test_a_burst_of_conversations_splits_while_their_shared_prefix_is_computed(
    publishing: bool,
) -> None:
    # Two conversations with one 1,024-token system prompt arrive together. The first
    # goes to some replica, whose optimistic insert makes it the prompt's holder; the
    # second would wait there behind the prompt's prefill (as long as computing it
    # itself) and share that replica for all its turns: it goes to an idle one, where
    # the replicas publish events (else no insert is ever confirmed: it stays). Five
    # idle replicas: enough to spare one for the new prompts that half of the first
    # decisions are expected to bring (pending_spare_idle).
    router, _ = make(6)
    if publishing:
        for i in range(6):
            router.apply_snapshot(f"r{i}", Snapshot(0, []))
    system = keys(*range(64))
    first = router.route(system + keys(100), "conv-a")
    router.request_started(first.replica_id, first.uncached_tokens, first.queued_tokens)
    second = router.route(system + keys(101), "conv-b")
    assert second.matched_blocks == (0 if publishing else 64)
    assert (second.replica_id != first.replica_id) == publishing
    assert second.reason.startswith("spill pending: ") == publishing, second.reason
    # Without a conversation key, a third request waits for the prompt (the default
    # recompute weight): it is one request, not a conversation's home.
    third = router.route(system + keys(102))
    assert third.matched_blocks == 64
    # Once an event confirms the prompt on the first replica, a new conversation joins
    # a holder: the prefix is computed there, its hit is real.
    if publishing:
        stored = tuple(k[:16] for k in system)
        assert router.apply_event(first.replica_id, BlockEvent(1, "stored", stored))
        assert router.route(system + keys(103), "conv-c").matched_blocks == 64
    router.check_invariants()


def test_optimistic_inserts_expire_only_for_replicas_that_publish_events() -> None:
    router, clock = make(2, optimistic_ttl_s=5.0)
    router.apply_snapshot("r0", Snapshot(0, []))  # r0 publishes events, r1 never does
    prompt = keys(1, 2)
    for rid in ("r0", "r1"):
        router.index.insert(rid, [k[:16] for k in prompt], tentative_until=clock() + 5.0)
    clock.now += 6
    router.sweep()
    assert router.index.match([k[:16] for k in prompt]) == {"r1": 2}
    assert router.stats()["expired_optimistic"] == 2


def test_events_gap_and_snapshot() -> None:
    router, _ = make(1)
    a, b = keys(1, 2), keys(1, 3)
    short_a = tuple(k[:16] for k in a)
    assert router.apply_event("r0", BlockEvent(5, "stored", short_a))
    assert router.apply_event("r0", BlockEvent(6, "removed", short_a[1:]))
    assert router.index.match(list(short_a)) == {"r0": 1}
    assert router.apply_event("r0", BlockEvent(6, "cleared"))  # duplicate: ignored
    assert not router.apply_event("r0", BlockEvent(8, "cleared"))  # gap: caller resyncs
    assert router.index.match(list(short_a)) == {"r0": 1}
    blocks = [SnapshotBlock(None, b[0][:16]), SnapshotBlock(b[0][:16], b[1][:16])]
    router.apply_snapshot("r0", Snapshot(9, blocks))
    assert router.index.match([k[:16] for k in b]) == {"r0": 2}
    assert router.index.match(list(short_a)) == {"r0": 1}  # shares the first block
    assert router.apply_event("r0", BlockEvent(10, "cleared"))
    assert len(router.index) == 0
    router.check_invariants()


def test_model_filter_exclude_and_no_healthy_replica() -> None:
    router, _ = make(2)
    router.add_replica("other", "http://o", model="other-model", static=True)
    assert router.route(keys(1), model="other-model").replica_id == "other"
    assert router.route(keys(1), model="m", exclude={"r0"}).replica_id == "r1"
    with pytest.raises(NoHealthyReplica):
        router.route(keys(1), model="m", exclude={"r0", "r1"})
    with pytest.raises(NoHealthyReplica):
        router.route(keys(1), model="missing")


def test_a_paused_replica_is_out_of_routing_until_it_resumes() -> None:
    router, _ = make(2)
    assert router.report_paused("r0", True) and not router.report_paused("r0", True)
    assert not router.replicas["r0"].healthy and router.stats()["replicas"]["r0"]["paused"]
    assert all(router.route(keys(i)).replica_id == "r1" for i in range(5))
    router.report_paused("r1", True)
    with pytest.raises(NoHealthyReplica):
        router.route(keys(1))
    assert router.report_paused("r0", False) and router.replicas["r0"].healthy
    assert router.route(keys(1)).replica_id == "r0"
    assert not router.report_paused("gone", True)  # a replica removed meanwhile


def test_passive_failures_open_the_breaker_and_a_probe_closes_it() -> None:
    router, clock = make(2, breaker_failures=2, breaker_cooldown_s=3.0)
    for _ in range(2):
        router.request_started("r0")
        router.request_finished("r0", ok=False)
    assert not router.replicas["r0"].healthy and router.replicas["r0"].breaker_state == "open"
    assert all(router.route(keys(i)).replica_id == "r1" for i in range(5))
    clock.now += 3
    router.report_probe("r0", ok=True)
    assert router.replicas["r0"].healthy and router.replicas["r0"].in_flight == 0


def test_discovered_replica_expires_without_heartbeats() -> None:
    router, clock = make(0, replica_ttl_s=10.0)
    router.add_replica("d", "http://d", "m")
    router.add_replica("s", "http://s", "m", static=True)
    clock.now += 11
    assert not router.replicas["d"].healthy and router.replicas["s"].healthy
    router.update_load("d", ReplicaLoad(running=2, waiting=3))
    assert router.replicas["d"].healthy and router.replicas["d"].load.load == 5


def test_remove_replica_leaves_ring_and_index_and_hints_apply() -> None:
    router, _ = make(2)
    short = [k[:16] for k in keys(4, 5)]
    router.apply_hint(RoutedHint("other-gateway", "r1", tuple(short)))
    assert router.index.match(short) == {"r1": 2}
    router.remove_replica("r1")
    assert router.index.match(short) == {} and "r1" not in router.ring
    assert router.route(short).replica_id == "r0"
    router.check_invariants()


def test_local_in_flight_counts_and_stats() -> None:
    router, _ = make(2)
    d = router.route(keys(1))
    router.request_started(d.replica_id)
    assert router.replicas[d.replica_id].in_flight == 1
    router.request_finished(d.replica_id, ok=True)
    stats = router.stats()
    assert stats["decisions"] and stats["index_blocks"] == 1
    assert stats["replicas"][d.replica_id]["in_flight"] == 0


def test_static_replica_and_its_registration_are_one_replica() -> None:
    router = Router(seed=0)
    router.add_replica("127.0.0.1:8101", "http://127.0.0.1:8101", "m", static=True)
    # The same process registers in Redis under its own id: one replica, now static.
    router.add_replica("replica-a", "http://127.0.0.1:8101/", "m")
    assert list(router.replicas) == ["replica-a"]
    assert router.replicas["replica-a"].static
    # The gateway refreshing its static entry does not bring the address back twice.
    router.add_replica("127.0.0.1:8101", "http://127.0.0.1:8101", "m", static=True)
    assert list(router.replicas) == ["replica-a"]
    router.add_replica("replica-b", "http://127.0.0.1:8102", "m")
    assert sorted(router.replicas) == ["replica-a", "replica-b"]


def test_the_data_parallel_ranks_of_one_engine_are_replicas_of_their_own() -> None:
    router = Router(seed=0)
    url = "http://127.0.0.1:8000"
    for rank in (0, 1):
        router.add_replica(f"127.0.0.1:8000-dp{rank}", url, "m", data_parallel_rank=rank)
    assert {r: v.data_parallel_rank for r, v in router.replicas.items()} == {
        "127.0.0.1:8000-dp0": 0,
        "127.0.0.1:8000-dp1": 1,
    }
    assert not any(v.static for v in router.replicas.values())
    # Each holds its own cache: a prefix stored on rank 1 sends its requests there.
    prompt = keys(1, 2, 3)
    router.apply_event("127.0.0.1:8000-dp1", BlockEvent(1, "stored", tuple(k[:16] for k in prompt)))
    assert router.route(prompt).replica_id == "127.0.0.1:8000-dp1"


@pytest.mark.parametrize("static_first", [True, False])
def test_an_engine_given_by_url_gives_way_to_its_registered_ranks(static_first: bool) -> None:
    router = Router(seed=0)
    url = "http://127.0.0.1:8000"

    def static() -> None:
        router.add_replica("127.0.0.1:8000", url + "/v1", "m", static=True)

    def ranks() -> None:
        for rank in (0, 1):
            router.add_replica(f"e-dp{rank}", url, "m", data_parallel_rank=rank)

    for step in (static, ranks) if static_first else (ranks, static):
        step()
    # The ranks are the engine: two replicas, static as the URL given was.
    assert sorted(router.replicas) == ["e-dp0", "e-dp1"]
    assert all(v.static for v in router.replicas.values())
    static()  # the gateway refreshing its static entry does not bring the engine back
    ranks()  # nor does a heartbeat make them expire again
    assert sorted(router.replicas) == ["e-dp0", "e-dp1"]
    assert all(v.static for v in router.replicas.values())


def test_forget_cached_state_drops_the_replicas_blocks() -> None:
    router, _ = make(2)
    prompt = keys(1, 2, 3)
    router.apply_event("r0", BlockEvent(1, "stored", tuple(k[:16] for k in prompt)))
    router.apply_event("r1", BlockEvent(1, "stored", tuple(k[:16] for k in prompt[:1])))
    router.route(prompt, conversation_key="chat-1")
    router.forget_cached_state(["r0"])  # r1's reset failed: what it holds stays known
    assert router.stats()["replicas"]["r0"]["blocks"] == 0
    assert router.index.match([k[:16] for k in prompt]) == {"r1": 1}
    # Sequence numbers carry on: the replica's own cleared event folds in as usual.
    assert router.apply_event("r0", BlockEvent(2, "cleared"))
    router.check_invariants()


def test_a_reset_of_every_replica_starts_the_busy_shares_afresh() -> None:
    # The balance price's busy shares (CacheAware) describe serving the prefixes the
    # replicas held; after every replica's cache is reset they would steer a burst of
    # new conversations away from the replicas that were busy before.
    router, _ = make(3)
    policy = router.policy
    assert isinstance(policy, CacheAware)
    for n in range(6):
        decision = router.route(keys(n, 100 + n), conversation_key=f"c{n}")
        router.request_started(decision.replica_id, decision.uncached_tokens)
    assert policy.busy.counts and policy.busy.decisions == 6
    router.forget_cached_state(["r0", "r1"])  # r2's reset failed: the shares stand
    assert policy.busy.decisions == 6
    router.forget_cached_state()
    assert not policy.busy.counts and policy.busy.decisions == 0
    router.check_invariants()


@pytest.mark.parametrize(
    ("pause_s", "balance_pause", "replicas_used"), [(0.05, 8.0, 6), (60.0, 8.0, 8), (60.0, 0.0, 6)]
)
def test_a_pause_in_the_traffic_fades_the_busy_shares(
    pause_s: float, balance_pause: float, replicas_used: int
) -> None:
    # r0 and r1 served long requests through 200 decisions (one every 50 ms) while the
    # other six took short ones: their busy shares are about twice the mean. Right
    # after, a burst of new conversations is steered off them by the balance price. A
    # minute later, when nothing has been routed since, the shares describe traffic
    # that has stopped: the burst spreads over all eight replicas (unless the fading
    # is off: ``balance_pause`` 0).
    router, clock = make(8, balance_pause=balance_pause)
    held = [router.request_started(r, 0) for r in ("r0", "r1")]
    for n in range(200):
        clock.now += 0.05
        decision = router.route(keys(n, 1000 + n), conversation_key=f"old-{n}")
        assert decision.replica_id not in ("r0", "r1")  # a new prompt: an idle replica
        router.request_finished(router.request_started(decision.replica_id, 0), ok=True)
    for request in held:
        router.request_finished(request, ok=True)
    clock.now += pause_s
    used = set()
    for n in range(8):
        decision = router.route(keys(5000 + n, 6000 + n), conversation_key=f"new-{n}")
        router.request_started(decision.replica_id, decision.uncached_tokens)
        used.add(decision.replica_id)
    assert len(used) == replicas_used
    router.check_invariants()


def test_prefill_drain_is_a_bounded_fraction_so_route_never_overflows() -> None:
    assert with_options(RouterConfig(), ["prefill_drain=0"]).prefill_drain == 0.0
    for bad in (-0.5, 101.0, 1e308):
        with pytest.raises(ValueError, match="prefill_drain"):
            RouterConfig(prefill_drain=bad)
    with pytest.raises(ValueError, match="prefill_drain"):
        with_options(RouterConfig(), ["prefill_drain=nan"])


def test_balance_pause_is_off_or_at_least_one_usual_gap() -> None:
    assert with_options(RouterConfig(), ["balance_pause=0"]).balance_pause == 0.0
    assert with_options(RouterConfig(), ["balance-pause=2.5"]).balance_pause == 2.5
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="balance_pause"):
            RouterConfig(balance_pause=bad)
    with pytest.raises(ValueError, match="balance_pause"):
        with_options(RouterConfig(), ["balance_pause=inf"])


def test_a_snapshot_keeps_parents_newer_than_their_children() -> None:
    """Cap eviction takes a replica's oldest blocks: after a rebuild from a snapshot
    (parents first), those must be leaves, or the chain loses its head and every match
    of it ends at the root. Built one block at a time, the root was the oldest."""
    router = Router(RouterConfig(max_blocks_per_replica=4))
    router.add_replica("r", "http://r", static=True)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    blocks = [SnapshotBlock(None, a), SnapshotBlock(a, b), SnapshotBlock(b, c), SnapshotBlock(c, d)]
    router.apply_snapshot("r", Snapshot(7, blocks))
    assert router.index.match([a, b, c, d]) == {"r": 4}
    router.apply_event("r", BlockEvent(8, "stored", (bytes([9]) * 16,)))  # one over the cap
    assert router.index.match([a, b, c, d]) == {"r": 3}  # the leaf went, not the root
    # Across tiers too: a chain whose middle was demoted to the host comes in three runs.
    tiers: list[Medium] = ["device", "host", "host", "device"]
    tiered = [SnapshotBlock(blk.parent, blk.key, m) for blk, m in zip(blocks, tiers, strict=True)]
    router.apply_snapshot("r", Snapshot(9, tiered))
    assert router.index.host_blocks("r", [a, b, c, d]) == 2
    router.apply_event("r", BlockEvent(10, "stored", (bytes([9]) * 16,)))
    assert router.index.match([a, b, c, d]) == {"r": 3}
    router.check_invariants()
