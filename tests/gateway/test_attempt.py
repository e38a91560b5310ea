"""``Attempt``: a request's one owner in the router's accounting, against a real Router.

"Exactly once" is read from the router's own state: a second finish would take another
request's in-flight count, and a failure counted twice shows in the breaker."""

from __future__ import annotations

import asyncio

import pytest

from gateway.attempt import Attempt
from gateway.upstream import UpstreamError
from router.router import Decision, Router


def router_with(*replica_ids: str) -> Router:
    router = Router(seed=0)
    for rid in replica_ids:
        router.add_replica(rid, f"http://{rid}.invalid:1", model="m", static=True)
    return router


def decision(rid: str = "r0", uncached_tokens: int = 0) -> Decision:
    return Decision(rid, "test", 0, 0, uncached_tokens, 0)


def in_flight(router: Router, rid: str = "r0") -> int:
    return router.replicas[rid].in_flight


def failures(router: Router, rid: str = "r0") -> int:
    return router.replicas[rid].breaker.consecutive_failures


def test_success_starts_and_finishes_once() -> None:
    router = router_with("r0")
    other = Attempt(router, decision("r0")).__enter__()  # a second request in flight there
    with Attempt(router, decision("r0")) as attempt:
        assert in_flight(router) == 2
        attempt.first_byte()
        first = attempt.first_byte_at
        attempt.first_byte()
        assert first is not None and attempt.first_byte_at == first
        attempt.finish()  # the replica is done; the client may still be receiving
        assert in_flight(router) == 1
        attempt.finish()
        assert in_flight(router) == 1
    assert in_flight(router) == 1  # the block's end did not finish it again
    assert attempt.finished and not attempt.failed
    other.finish()
    assert in_flight(router) == 0
    router.check_invariants()


def test_failure_is_counted_once_against_the_replica() -> None:
    router = router_with("r0")
    with Attempt(router, decision("r0")) as attempt:
        attempt.fail()
        attempt.finish()
    assert failures(router) == 1 and in_flight(router) == 0
    with pytest.raises(UpstreamError), Attempt(router, decision("r0")):
        raise UpstreamError("ReadTimeout")
    assert failures(router) == 2 and in_flight(router) == 0


def test_a_fault_of_the_gateway_finishes_without_blaming_the_replica() -> None:
    router = router_with("r0")
    with Attempt(router, decision("r0")) as failing:
        failing.fail()
    assert failures(router) == 1
    with pytest.raises(KeyError), Attempt(router, decision("r0")):
        raise KeyError("a bug of ours")
    assert failures(router) == 1 and in_flight(router) == 0  # no verdict: the count stays
    with Attempt(router, decision("r0")):
        pass
    assert failures(router) == 0  # a success resets it


def test_cancellation_finishes_and_is_not_the_replicas_fault() -> None:
    router = router_with("r0")
    router.replicas["r0"].breaker.record(False)
    entered = asyncio.Event()

    async def forward() -> None:
        with Attempt(router, decision("r0")):
            entered.set()
            await asyncio.Event().wait()  # the replica never answers

    async def main() -> None:
        task = asyncio.create_task(forward())
        await entered.wait()
        assert in_flight(router) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    # Finished, and no verdict: the failure before it still counts (a client giving up
    # on a hung replica proves nothing about it).
    assert in_flight(router) == 0 and failures(router) == 1


def test_an_attempt_is_entered_once() -> None:
    router = router_with("r0")
    attempt = Attempt(router, decision("r0"))
    attempt.finish()  # never started: nothing to finish
    assert in_flight(router) == 0 and not attempt.finished
    with attempt, pytest.raises(RuntimeError, match="entered twice"), attempt:
        pass
    assert in_flight(router) == 0 and attempt.finished


def test_in_flight_drains_to_zero_over_many_concurrent_outcomes() -> None:
    router = router_with("r0", "r1")

    async def one(i: int) -> None:
        rid = f"r{i % 2}"
        with Attempt(router, decision(rid)) as attempt:
            await asyncio.sleep(0)  # interleave with the others
            if i % 5 == 0:
                attempt.fail()
            if i % 7 == 0:
                raise UpstreamError("ReadError")
            if i % 3 == 0:
                attempt.finish()
            await asyncio.sleep(0)

    async def main() -> None:
        tasks = [asyncio.create_task(one(i)) for i in range(200)]
        await asyncio.sleep(0)
        assert in_flight(router, "r0") + in_flight(router, "r1") == 200
        tasks[1].cancel()
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert in_flight(router, "r0") == 0 and in_flight(router, "r1") == 0
    router.check_invariants()


def test_the_prompts_tokens_are_queued_until_the_prefill_is_done() -> None:
    router = router_with("r0")
    load = router.replicas["r0"].load
    with Attempt(router, decision("r0", uncached_tokens=300)) as attempt:
        assert load.queued_tokens == 300 and load.in_flight == 1
        attempt.first_byte()  # a stream's head: no output yet
        assert load.queued_tokens == 300
        attempt.prefill_done()
        attempt.prefill_done()
        assert load.queued_tokens == 0 and load.in_flight == 1
    assert load.queued_tokens == 0 and load.in_flight == 0
    with pytest.raises(UpstreamError), Attempt(router, decision("r0", 200)):
        assert load.queued_tokens == 200
        raise UpstreamError("ReadTimeout")  # failed before any output
    assert load.queued_tokens == 0 and load.in_flight == 0
    router.check_invariants()
