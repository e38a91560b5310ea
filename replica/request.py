"""What callers hand the engine and what they get back: sampling params, streamed deltas,
final outputs, and the errors ``Engine.submit`` raises.

Torch-free at import time on purpose: the replica server imports these names to build
its responses. The engine's per-request state (``RequestState``, ``SequenceState``) lives
here too, next to the results it produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from replica.detokenize import IncrementalDetokenizer, StopStringMatcher

FINISH_REASONS = ("stop", "length", "abort")


class PromptTooLong(ValueError):
    """The prompt does not fit the model's context or the whole block pool."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``max_waiting``; try again later or elsewhere."""


class EngineStopped(RuntimeError):
    """The engine takes no more requests: it is stopping, or its thread died."""


GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's rule): no 1/T overflow
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI and vLLM take seeds


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. A temperature under ``GREEDY_BELOW`` is greedy.

    ``top_k`` None (or the OpenAI-ish ``-1`` / ``0``) disables top-k. ``seed`` makes a
    request reproducible: choice ``i`` draws from its own generator seeded ``seed + i``.
    Penalties and ``logit_bias`` (token id -> added logit) follow OpenAI and vLLM: the
    repetition penalty divides (or, for negative logits, multiplies) the logits of every
    token seen in prompt or output; frequency and presence penalties subtract per output
    occurrence and once per token that occurred.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Log probabilities, as vLLM reports them (of the model's raw logits, before any of
    # the above): None for none; k for each token's own and its k likeliest alternatives.
    logprobs: int | None = None  # of each generated token
    prompt_logprobs: int | None = None  # of each prompt token (a prompt computed whole)
    # vLLM's extras. ``min_p``: drop tokens less likely than min_p x the likeliest's
    # probability (after temperature, before top-k/top-p). ``min_tokens``: no stop token
    # or stop string ends a choice before it has this many tokens. ``allowed_token_ids``:
    # the only tokens that may be drawn. ``include_stop_str_in_output``: the stop string
    # that ended a choice stays in its text. ``skip_special_tokens``: special tokens'
    # text is left out of the answer.
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output: a compiled grammar (replica.grammar) every choice must follow;
    # None for free text.
    grammar: Any = None
    # The sampler's ``allowed_token_ids`` as a logits mask, made at its first draw (not
    # at every token: the list may be the whole vocabulary).
    allowed_mask: Any = field(default=None, repr=False, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def masks_logits(self) -> bool:
        """Whether logits are changed before drawing (greedy then needs them too)."""
        return bool(
            self.logit_bias
            or self.has_penalties
            or self.allowed_token_ids is not None
            or self.grammar is not None
        )

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def effective_top_k(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what is allowed."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
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
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")


MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log probability, its rank at its position (1: the likeliest; ties share
    the lower rank, as vLLM counts), and the ``top`` likeliest tokens there ((id, log
    probability), likeliest first; as many as the request asked for)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Delta:
    """One streamed increment of choice ``index``; ``finish_reason`` is set on its last."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # On the last: the stop string or requested stop token id that ended the choice.
    stop_reason: str | int | None = None
    # One per token of ``token_ids`` when the request asked for log probabilities.
    logprobs: list[TokenLogprob] | None = None
    # On a choice's first delta, when asked for: the prompt's (see ``RequestOutput``).
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    stop_reason: str | int | None = None  # the stop string or stop token id, as vLLM's
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


@dataclass(slots=True)
class RequestOutput:
    """A finished request. ``error`` is set when the engine failed it: its choices ended
    early (finish_reason ``abort``) and the caller must report an error, not a result."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    choices: list[ChoiceOutput]
    timings: Timings
    error: str | None = None
    # One per prompt token when asked for: the first None (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


# --------------------------------------------------------------------------- engine state


class OutputSink(Protocol):
    """Where a request's deltas and final output go (``replica.handle.RequestHandle``)."""

    def deliver(self, delta: Delta) -> None: ...

    def close(self, output: RequestOutput) -> None: ...


@dataclass(slots=True)
class RequestState:
    """One submitted request and its ``n`` choices, owned by the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    salt: str
    stop_token_ids: frozenset[int]
    sink: OutputSink
    submitted_at: float
    sequences: list[SequenceState] = field(default_factory=list)
    forked: bool = False  # choices 1..n-1 exist (they fork off choice 0 after prefill)
    cached_tokens: int = 0
    admitted_at: float | None = None
    prefilled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None  # why the engine failed this request, if it did
    # Filled position by position as the prompt is computed, when asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token: nothing precedes it

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for and not all computed yet: the prompt must be computed, not matched
        in the cache (its logits exist only where it is computed; vLLM does the same)."""
        table = self.prompt_logprobs
        return table is not None and len(table) < len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self) -> RequestOutput:
        assert self.done and self.finished_at is not None
        t0 = self.submitted_at
        admitted = self.admitted_at if self.admitted_at is not None else self.finished_at
        prefilled = self.prefilled_at if self.prefilled_at is not None else admitted
        first = self.first_token_at if self.first_token_at is not None else self.finished_at
        timings = Timings(
            queued_s=admitted - t0,
            prefill_s=prefilled - admitted,
            first_token_s=first - t0,
            decode_s=self.finished_at - first,
            total_s=self.finished_at - t0,
        )
        choices = [
            ChoiceOutput(
                s.index,
                s.output_token_ids,
                s.text,
                s.finish_reason or "abort",
                s.stop_reason,
                s.logprobs,
            )
            for s in self.sequences
        ]
        return RequestOutput(
            self.request_id,
            len(self.prompt_token_ids),
            self.cached_tokens,
            choices,
            timings,
            self.error,
            self.prompt_logprobs,
        )


@dataclass(slots=True)
class SequenceState:
    """One choice: its tokens (prompt + generated), its blocks, and its text so far.

    ``num_computed`` tokens have K/V in ``block_ids``; the scheduler computes the rest.
    ``shared_tail``: the last block is also held by a sibling (n > 1 fork), so it must be
    copied before this sequence writes into it.
    """

    request: RequestState
    index: int
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    generator: Any  # the backend's per-choice random state (torch.Generator or None)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    shared_tail: bool = False
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # what stopped it: a stop string or stop token id
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for
    grammar: Any = None  # its state in the request's grammar (structured output), if any

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append_token(
        self, token_id: int, max_len: int, logprob: TokenLogprob | None = None
    ) -> Delta:
        """Record a sampled token (and its log probability, when asked for); decide
        whether the choice ends; return its delta."""
        self.token_ids.append(token_id)
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        params = self.request.params
        finish: str | None = None
        stop_id: int | None = None
        produced = len(self.output_token_ids)
        if token_id in self.request.stop_token_ids and produced >= params.min_tokens:
            text = ""
            if params.include_stop_str_in_output:  # the stop token's own text, as vLLM's
                text = self.stop_matcher.feed(self.detokenizer.push(token_id), unchecked=True).text
            finish, text = "stop", text + self._drain()
            # vLLM's stop_reason: the id when the request named it, None for end-of-text.
            stop_id = token_id if token_id in params.stop_token_ids else None
        else:
            # Stop strings are looked for in the text after the first min_tokens tokens.
            check = self.stop_matcher.feed(
                self.detokenizer.push(token_id), unchecked=produced <= params.min_tokens
            )
            text = check.text
            if check.stopped:
                finish = "stop"
            elif len(self.output_token_ids) >= params.max_tokens or len(self.token_ids) >= max_len:
                finish = "length"
                tail = self.stop_matcher.feed(self.detokenizer.flush())
                text += tail.text
                if tail.stopped:
                    finish = "stop"
                else:
                    text += self.stop_matcher.flush()
        self.text += text
        self.finish_reason = finish
        self.stop_reason = self.stop_matcher.matched if stop_id is None else stop_id
        return Delta(
            self.index,
            [token_id],
            text,
            finish,
            self.stop_reason,
            None if logprob is None else [logprob],
        )

    def _drain(self) -> str:
        tail = self.stop_matcher.feed(self.detokenizer.flush())
        return tail.text if tail.stopped else tail.text + self.stop_matcher.flush()

    def finish(self, reason: str) -> Delta:
        """End the choice without a new token (abort, pool exhausted)."""
        self.finish_reason = reason
        text = "" if reason == "abort" else self._drain()
        self.text += text
        return Delta(self.index, [], text, reason)
