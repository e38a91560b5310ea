from __future__ import annotations

from router.health import CircuitBreaker


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
