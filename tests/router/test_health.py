from __future__ import annotations

import pytest

from router.health import AttemptOutcome, CircuitBreaker, attempt_verdicts
from router.router import NoHealthyReplica, Router


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_transitions() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(2):
        breaker.record(False)
        assert breaker.state == "closed" and breaker.allows()
    breaker.record(True)  # success resets the count
    for _ in range(3):
        breaker.record(False)
    assert breaker.state == "open" and not breaker.allows()
    clock.now = 4.9
    assert not breaker.allows()
    clock.now = 5.0
    assert breaker.allows() and breaker.state == "half_open"
    breaker.on_dispatch()  # the one trial is out: nobody else goes
    assert not breaker.allows()
    breaker.record(False)  # trial failed: open again, cooldown restarts
    assert breaker.state == "open" and not breaker.allows()
    clock.now = 10.0
    assert breaker.allows()
    breaker.on_dispatch()
    breaker.record(True)
    assert breaker.state == "closed" and breaker.allows()
    breaker.check_invariants()


def test_unknown_until_first_success() -> None:
    """A replica nobody has heard from takes no traffic; failed probes keep it out
    without opening anything; the first success closes it at once."""
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock, state="unknown")
    assert not breaker.allows()
    for _ in range(5):
        breaker.record(False)
        breaker.check_invariants()
        assert breaker.state == "unknown" and not breaker.allows()
    clock.now = 100.0  # no cooldown lets an unknown replica in
    assert not breaker.allows()
    breaker.record(True)
    breaker.check_invariants()
    assert breaker.state == "closed" and breaker.allows()
    breaker.record(False)  # from here on it is an ordinary breaker
    breaker.record(False)
    assert breaker.state == "open"
    breaker.check_invariants()


def test_no_verdict_ends_a_half_open_trial_without_closing() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    breaker.record(False)
    clock.now = 1.0
    assert breaker.allows()
    breaker.on_dispatch()
    assert not breaker.allows()
    breaker.record(None)  # the trial's request was at fault, not the replica
    breaker.check_invariants()
    assert breaker.state == "half_open" and breaker.allows()
    breaker.on_dispatch()
    breaker.record(True)
    assert breaker.state == "closed"


def test_no_verdict_keeps_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=1.0, clock=Clock())
    breaker.record(False)
    breaker.record(False)
    breaker.record_no_verdict()
    assert breaker.consecutive_failures == 2 and breaker.state == "closed"
    breaker.record(False)
    assert breaker.state == "open"


@pytest.mark.parametrize(
    ("outcomes", "verdicts"),
    [
        (["answered"], [True]),
        (["connect_error"], [False]),
        (["timeout"], [False]),
        (["broken"], [False]),
        # A 5xx the request also got on a second replica: the request's fault.
        (["server_error", "server_error"], [None, None]),
        # A 5xx another replica did not reproduce: the replica's fault.
        (["server_error", "answered"], [False, True]),
        # A 5xx nobody could compare against proves nothing.
        (["server_error"], [None]),
        (["server_error", "connect_error"], [None, False]),
        (["server_error", "timeout"], [None, False]),
        (["connect_error", "server_error"], [False, None]),
        (["timeout", "answered"], [False, True]),
    ],
)
def test_attempt_verdicts(outcomes: list[AttemptOutcome], verdicts: list[bool | None]) -> None:
    assert attempt_verdicts(outcomes) == verdicts


def test_a_poison_request_never_opens_a_breaker() -> None:
    """The attributed verdicts of a request that makes every replica fail, repeated far
    past the threshold, leave both breakers closed; a replica that fails what another
    answers is opened."""
    clock = Clock()
    a = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(10):
        for breaker, verdict in zip(
            (a, b), attempt_verdicts(["server_error", "server_error"]), strict=True
        ):
            if verdict is None:
                breaker.record_no_verdict()
            else:
                breaker.record(verdict)
    assert a.state == b.state == "closed" and a.consecutive_failures == 0
    for _ in range(3):
        first, second = attempt_verdicts(["server_error", "answered"])
        assert first is not None and second is not None
        a.record(first)
        b.record(second)
    assert a.state == "open" and b.state == "closed"


def test_a_probing_router_routes_only_to_probed_replicas() -> None:
    clock = Clock()
    router = Router(clock=clock, probe_first=True)
    router.add_replica("a", "http://a", model="m")
    router.add_replica("b", "http://b", model="m")
    assert not any(v.healthy for v in router.replicas.values())
    with pytest.raises(NoHealthyReplica):
        router.route([], model="m")
    router.report_probe("a", False)  # still loading
    router.report_probe("b", True)
    assert [rid for rid, v in router.replicas.items() if v.healthy] == ["b"]
    assert {router.route([], model="m").replica_id for _ in range(10)} == {"b"}
    router.check_invariants()
    plain = Router(clock=clock)
    plain.add_replica("a", "http://a", model="m")
    assert plain.replicas["a"].healthy  # the simulator's routers do not probe


def test_a_static_replica_that_registers_keeps_its_probed_health() -> None:
    """The static entry (named by address) gives way to the id the replica registers
    under: the same replica, so what the probes found stays."""
    router = Router(clock=Clock(), probe_first=True)
    router.add_replica("127.0.0.1:9001", "http://127.0.0.1:9001", model="m", static=True)
    router.report_probe("127.0.0.1:9001", True)
    router.add_replica("replica-0", "http://127.0.0.1:9001", model="m")
    assert list(router.replicas) == ["replica-0"]
    assert router.replicas["replica-0"].healthy
    router.check_invariants()
