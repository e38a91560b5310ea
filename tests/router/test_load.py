"""Load = this gateway's exact in-flight count + what other gateways had at the report."""

from __future__ import annotations

import random

import pytest

from router.load import BusyShare, LoadTracker
from router.protocol import ReplicaLoad


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stale_report_of_our_own_requests_adds_nothing() -> None:
    # The live failure: a heartbeat says 3 running, read again and again after they
    # finished; the replica must not look busy for it.
    clock = Clock()
    load = LoadTracker(report_ttl_s=3.0, clock=clock)
    for _ in range(3):
        load.started()
    clock.now += 0.1
    stamp = clock.now
    clock.now += 0.4
    for _ in range(3):
        load.finished()
    clock.now += 0.5
    load.report(ReplicaLoad(running=3), at=stamp)
    assert load.load == 0
    load.started()
    load.report(ReplicaLoad(running=3), at=stamp)  # the same record, read again
    assert load.load == 1


def test_other_gateways_requests_count_until_the_report_goes_stale() -> None:
    clock = Clock()
    load = LoadTracker(report_ttl_s=3.0, clock=clock)
    load.started()
    load.started()
    clock.now += 1.0
    load.report(ReplicaLoad(running=4, waiting=1), at=clock.now - 0.2)
    assert load.others == 3 and load.load == 5
    load.finished()
    assert load.load == 4
    clock.now += 2.9
    assert load.load == 1  # 3 s after the report's stamp: only our own count is sure
    load.report(ReplicaLoad(running=1), at=clock.now)
    assert load.others == 0 and load.load == 1


def test_report_without_stamp_or_from_a_clock_ahead_counts_as_now() -> None:
    clock = Clock()
    load = LoadTracker(clock=clock)
    load.started()
    load.report(ReplicaLoad(running=2, waiting=3))
    assert load.load == 5
    load.report(ReplicaLoad(running=1), at=clock.now + 60.0)  # skewed replica clock
    assert load.load == 1


@pytest.mark.parametrize("skew_s", [-30.0, -2.0, 0.0, 2.0, 30.0])
def test_a_replica_clock_off_by_seconds_reads_as_the_gateways(skew_s: float) -> None:
    """Hosts without NTP drift seconds apart. A replica clock behind made every report
    stale on arrival (the others' requests never counted) or, under the 3 s freshness,
    compared the report with this gateway's count seconds earlier: with requests added
    since, phantom load from other gateways that do not exist."""
    clock = Clock()
    load = LoadTracker(report_ttl_s=3.0, clock=clock)
    rng = random.Random(7)
    for second in range(20):  # heartbeats once a second, read 0-0.5 s after they are made
        made = clock.now
        clock.now += rng.uniform(0.0, 0.5)
        load.report(ReplicaLoad(running=second + 2), at=made + skew_s)
        load.started()  # this gateway: one more request there each second
        clock.now = made + 1.0
    # 20 of ours; the last report says 21 running when ours were 20: one other's.
    made = clock.now
    clock.now += 0.3
    load.report(ReplicaLoad(running=21), at=made + skew_s)
    assert load.others == 1 and load.load == 21


def test_in_flight_log_answers_for_past_times_and_stays_short() -> None:
    clock = Clock()
    load = LoadTracker(clock=clock)
    history = []
    for i in range(2000):
        clock.now += 0.01
        if i % 3 == 2:
            load.finished()
        else:
            load.started()
        history.append((clock.now, load.in_flight))
    for t, count in history[-500:]:
        assert load.in_flight_at(t) == count
        assert load.in_flight_at(t + 0.005) == count
    assert len(load._log) <= 1002  # ~10 s of changes at 100 per second
    # Before the oldest change kept: the count the last dropped change left.
    oldest = load._log[0][0]
    dropped = [count for t, count in history if t < oldest]
    assert load.in_flight_at(oldest - 0.001) == dropped[-1]


def test_busy_share_counts_recent_decisions_never_goes_negative_and_drains() -> None:
    rng = random.Random(7)
    share = BusyShare(window=4)
    ids = ["r0", "r1", "r2"]
    assert share.ratios(ids) == {"r0": 1.0, "r1": 1.0, "r2": 1.0}  # no history: even
    assert share.weight == 0.0  # ... and no weight: the price grows in over a window
    share.decided([], "r1", len(ids))  # the first decision moves the ratios but little
    assert abs(share.ratios(ids)["r1"] - 5 / (13 / 3)) < 1e-9
    for _ in range(500):
        busy = [r for r in ids if rng.random() < (0.9 if r == "r0" else 0.2)]
        share.decided(busy, rng.choice(ids), len(ids))
        share.check_invariants()
        ratios = share.ratios(ids)
        assert all(v >= 0 for v in ratios.values())
        assert abs(sum(ratios.values()) - len(ids)) < 1e-9  # ratios to the mean
    assert share.weight == 1.0
    # r0 was busy at ~90% of the decisions (plus its picks), the others at ~20%.
    ratios = share.ratios(ids)
    assert ratios["r0"] > 1.3 > max(ratios["r1"], ratios["r2"])
    # A count spans about window × candidates decisions: 12 here, the steady state of
    # one point each decision.
    assert 10 < share.count("r0") <= 12
    # A replica that is never busy nor chosen again decays away and leaves the table
    # (when the decay's scale is folded back in, every ~2,600 decisions here).
    for _ in range(3000):
        share.decided(["r0"], "r0", len(ids))
    assert set(share.counts) == {"r0"}
    # With the prior of ``window`` each: (12 + 4) / 8 for r0, 4 / 8 for the others.
    ratios = share.ratios(ids)
    assert abs(ratios["r0"] - 2.0) < 1e-6 and abs(ratios["r1"] - 0.5) < 1e-6


def test_busy_share_fades_over_a_pause_in_decisions_only_past_the_usual_gaps() -> None:
    share = BusyShare(window=4)
    ids = ["r0", "r1"]
    now = 0.0
    for _ in range(40):  # r0 busy at every decision, one every second
        now += 1.0
        share.elapse(now, len(ids))
        share.decided(["r0"], "r0", len(ids))
    assert share.gap_s == pytest.approx(1.0)
    before = share.count("r0")
    now += 8.0  # a gap of ``pause`` (8) usual gaps: no pause yet
    share.elapse(now, len(ids))
    assert share.count("r0") == pytest.approx(before)
    # ... though it stretches the usual gap: (8 − 1) / window.
    assert share.gap_s == pytest.approx(1.0 + 7.0 / 4)
    # 100 usual gaps: the 92 past ``pause`` decay the count as 92 decisions without r0,
    # and stretch the usual gap no more than a gap of ``pause`` does.
    usual = share.gap_s
    now += 100.0 * usual
    share.elapse(now, len(ids))
    keep = 1.0 - 1.0 / (share.window * len(ids))
    assert share.count("r0") == pytest.approx(before * keep**92)
    assert share.gap_s == pytest.approx(usual + 7.0 * usual / 4)
    share.check_invariants()
    # A pause of a day forgets the shares entirely: the ratios are even again.
    share.elapse(now + 86_400.0, len(ids))
    assert share.counts == {} and share.ratios(ids) == {"r0": 1.0, "r1": 1.0}
    share.check_invariants()
    # A clock that goes backwards (a replaced clock) is no pause.
    share.decided(["r0"], "r0", len(ids))
    count = share.count("r0")
    share.elapse(0.0, len(ids))
    assert share.count("r0") == pytest.approx(count)


def test_busy_share_takes_no_gap_under_a_second_for_a_pause() -> None:
    # A burst: decisions 1 ms apart; the next comes when a reply ends, 0.5 s later,
    # 500 usual gaps. That is the traffic's own rhythm, not a pause.
    share = BusyShare(window=4)
    now = 0.0
    for _ in range(8):
        now += 0.001
        share.elapse(now, 2)
        share.decided(["r0"], "r0", 2)
    count = share.count("r0")
    share.elapse(now + 0.5, 2)
    assert share.count("r0") == pytest.approx(count)
    # Past a second it is one.
    share.elapse(now + 2.0, 2)
    assert share.count("r0") < count / 2
