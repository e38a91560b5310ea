"""Time to first token, learned online from the replicas' first bytes.

Each request the gateway routed is one observation: it was sent behind ``queued``
prefill tokens with ``running`` other requests in flight there, had ``uncached`` tokens
of its own to compute, and its first byte came ``ttft_s`` later. Over every replica's
observations, the cluster's fit (``TtftFit``)::

    ttft_s ≈ fixed_s + s_per_token × (queued + uncached) + s_per_running × running

``fixed_s`` is what every request pays (a step, the network); ``s_per_token`` the
prefill time per token; ``s_per_running`` what each request already there adds (under
continuous batching a new prompt joins the running requests' steps: it waits for the
step under way and shares the next ones).

Each replica's own speed (``ReplicaSpeed``) scales all three: a running average of its
observed TTFT over the cluster's prediction, so a slower GPU gets less work. The cluster
fits samples divided by their replica's factor: the shape of a factor-1 replica,
whichever replica they came from. One shape for all (fitted on every sample, so three
terms stay well determined), one factor each (a handful of samples fix it): a replica
that drew a few unlucky samples is not starved by a wild fit of its own. The cost model
(router/policies.py) predicts with the three scaled terms.

The fit is a least-squares fit over exponentially decayed samples (``DECAY``: recent
ones count most, so a cluster whose speed changes is followed), pulled towards the
configured defaults (worth ``PRIOR`` samples at first, ageing as samples do) so that a
few samples cannot make it wild, with every term boxed:
``0 <= fixed_s, s_per_running <= BOUND × 1000 × default``, ``default / BOUND <=
s_per_token <= default × BOUND`` — never negative, always finite. One outlier (a
stalled connection) moves it little: a sample is clipped to within ``CLIP``× of the
current prediction (from the ``CLIP_AFTER``-th on; the first ones find the scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.98  # weight of the older samples at each new one: about 50 recent ones count
PRIOR = 0.3  # pseudo-samples of the prior in every direction of the fit, at first
PRIOR_FLOOR = 0.02  # it ages as samples do, down to this (a direction no sample varies)
RATE = 0.1  # a replica's speed: weight of each new sample in its running average
SPEED_AFTER = 10  # cluster samples before replicas' speeds are learned against its fit
CLIP = 4.0
CLIP_AFTER = 10  # samples before clipping starts (the first ones find the scale)
BOUND = 100.0
TOKEN_UNIT = 1000.0  # tokens are fitted in thousands: every feature is order 1


@dataclass(slots=True)
class TtftFit:
    default_s: float  # prefill seconds per token assumed before any sample
    default_running_s: float = 0.0  # seconds per request in flight assumed before any
    fixed_s: float = 0.0
    s_per_token: float = 0.0
    s_per_running: float = 0.0
    samples: int = 0
    # Decayed sums over samples x = (1, tokens / TOKEN_UNIT, running), y = ttft:
    # x xᵀ (upper triangle: 00 01 02 11 12 22), then x y (0 1 2).
    _sums: list[float] = field(default_factory=lambda: [0.0] * 9)

    def __post_init__(self) -> None:
        if not self.default_s > 0 or not self.default_running_s >= 0:
            raise ValueError(
                "the default prefill cost must be positive and the running cost >= 0, got "
                f"{self.default_s}, {self.default_running_s}"
            )
        if self.s_per_token <= 0:
            self.s_per_token = self.default_s
        if self.samples == 0:
            self.s_per_running = self.default_running_s

    @property
    def terms(self) -> tuple[float, float, float]:
        """``(fixed_s, seconds per TOKEN_UNIT tokens, s_per_running)``: the fit's unknowns."""
        return (self.fixed_s, self.s_per_token * TOKEN_UNIT, self.s_per_running)

    def predict(self, tokens: float, running: int) -> float:
        return self.fixed_s + self.s_per_token * tokens + self.s_per_running * running

    def observe(self, tokens: int, running: int, ttft_s: float) -> None:
        """One request's predicted tokens (queued ahead + its own uncached), the requests
        in flight there when it was sent, and its TTFT."""
        if not ttft_s > 0 or tokens < 0 or running < 0:
            return
        y = ttft_s
        if self.samples >= CLIP_AFTER:
            guess = self.predict(tokens, running)
            y = min(max(y, guess / CLIP), guess * CLIP)
        t = tokens / TOKEN_UNIT
        s = self._sums
        for i, value in enumerate((1.0, t, running, t * t, t * running, running * running)):
            s[i] = DECAY * s[i] + value
        for i, value in enumerate((y, t * y, running * y)):
            s[6 + i] = DECAY * s[6 + i] + value
        self.samples += 1
        self._solve((0.0, self.default_s * TOKEN_UNIT, self.default_running_s))

    def _solve(self, prior: tuple[float, float, float]) -> None:
        """Ridge least squares over the decayed sums, each unknown boxed: an active set
        (an unknown out of its box is fixed at the bound and the rest solved again; one
        whose gradient points back inside is freed), at most a few passes for three."""
        s = self._sums
        w = max(PRIOR * DECAY**self.samples, PRIOR_FLOOR)
        a = [[s[0] + w, s[1], s[2]], [s[1], s[3] + w, s[4]], [s[2], s[4], s[5] + w]]
        b = [s[6] + w * prior[0], s[7] + w * prior[1], s[8] + w * prior[2]]
        top = BOUND * TOKEN_UNIT * self.default_s
        low = (0.0, self.default_s * TOKEN_UNIT / BOUND, 0.0)
        high = (top, self.default_s * TOKEN_UNIT * BOUND, top)
        fixed: dict[int, float] = {}
        x = list(self.terms)
        for _ in range(6):
            x = _solve_free(a, b, fixed)
            out = [(max(low[i] - x[i], x[i] - high[i]), i) for i in range(3) if i not in fixed]
            worst, i = max(out, default=(0.0, -1))
            if worst > 0:
                fixed[i] = min(max(x[i], low[i]), high[i])
                continue
            # Free a bound unknown whose gradient points into its box.
            grad = [sum(a[i][j] * x[j] for j in range(3)) - b[i] for i in range(3)]
            back = [i for i, v in fixed.items() if (grad[i] < 0) == (v == low[i])]
            if not back:
                break
            del fixed[back[0]]
        x = [min(max(x[i], low[i]), high[i]) for i in range(3)]
        self.fixed_s, self.s_per_token, self.s_per_running = x[0], x[1] / TOKEN_UNIT, x[2]

    def check_invariants(self) -> None:
        top = BOUND * TOKEN_UNIT * self.default_s
        assert 0.0 <= self.fixed_s <= top and 0.0 <= self.s_per_running <= top
        assert self.default_s / BOUND <= self.s_per_token <= self.default_s * BOUND


@dataclass(slots=True)
class ReplicaSpeed:
    """One replica's TTFT over the cluster's prediction: a running average of the ratio,
    each sample clipped to within ``CLIP``× of the current value, bounded to
    ``1 / BOUND .. BOUND``; 1 before any sample."""

    factor: float = 1.0
    samples: int = 0

    def observe(self, ttft_s: float, predicted_s: float) -> None:
        if not ttft_s > 0 or not predicted_s > 0:
            return
        ratio = min(max(ttft_s / predicted_s, self.factor / CLIP), self.factor * CLIP)
        factor = self.factor + RATE * (ratio - self.factor)
        self.factor = min(max(factor, 1.0 / BOUND), BOUND)
        self.samples += 1

    def check_invariants(self) -> None:
        assert 1.0 / BOUND <= self.factor <= BOUND


def _solve_free(a: list[list[float]], b: list[float], fixed: dict[int, float]) -> list[float]:
    """``a x = b`` for the unknowns not in ``fixed`` (Gaussian elimination; ``a`` is
    symmetric positive definite: the prior's ridge is on its diagonal)."""
    free = [i for i in range(3) if i not in fixed]
    m = [
        [a[i][j] for j in free] + [b[i] - sum(a[i][k] * v for k, v in fixed.items())] for i in free
    ]
    n = len(free)
    for col in range(n):
        pivot = m[col][col]
        for row in range(col + 1, n):
            f = m[row][col] / pivot
            for k in range(col, n + 1):
                m[row][k] -= f * m[col][k]
    sol = [0.0] * n
    for row in range(n - 1, -1, -1):
        rest = sum(m[row][k] * sol[k] for k in range(row + 1, n))
        sol[row] = (m[row][n] - rest) / m[row][row]
    x = [0.0, 0.0, 0.0]
    for i, v in fixed.items():
        x[i] = v
    for i, v in zip(free, sol, strict=True):
        x[i] = v
    return x
