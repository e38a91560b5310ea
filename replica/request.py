"""What callers hand the engine and what they get back: sampling params, streamed deltas,
final outputs, and the errors ``Engine.submit`` raises.

Torch-free on purpose: the replica server imports these names to build its responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort")


class PromptTooLong(ValueError):
    """The prompt does not fit the model's context or the whole block pool."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``max_waiting``; try again later or elsewhere."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy.

    ``top_k`` None (or the OpenAI-ish ``-1`` / ``0``) disables top-k. ``seed`` makes a
    request reproducible: choice ``i`` draws from its own generator seeded ``seed + i``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what is allowed."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive count, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")


@dataclass(slots=True)
class Delta:
    """One streamed increment of choice ``index``; ``finish_reason`` is set on its last."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass(slots=True)
class Timings:
    """Seconds. ``first_token_s`` runs from submit to the first sampled token."""

    queued_s: float
    prefill_s: float
    first_token_s: float
    decode_s: float
    total_s: float


@dataclass(slots=True)
class ChoiceOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    choices: list[ChoiceOutput]
    timings: Timings

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)
