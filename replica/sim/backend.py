"""The simulated engine's backend: every step sleeps what the GPU cost model says and
draws deterministic pseudo-random tokens. Torch-free.

Everything around it is the real replica: scheduler (continuous batching, chunked
prefill, preemption), prefix cache, block accounting, publisher, server. Only the pool
holds no tensors (``SimPool``: a size, and copy-on-write that copies nothing), and so
does the host tier when there is one (``replica.sim.host.SimHostPool``: its copies cost
the time the profile's host bandwidth says, slept by the step they are made for).

Tokens come from the real tokenizer's vocabulary minus its special tokens, so replies
detokenize to real text, stop strings work and usage counts are true, and a reply ends
by ``max_tokens`` or a stop string, never by an end-of-sequence token. The next token is
a hash of the choice's stream (its seed + index, or its index), the sequence length and
its last three tokens: the same prompt gives the same reply on every replica and every
run, whatever shares its batch. Temperature, top-p/top-k/min-p, penalties and logit bias
do not change what is drawn; ``allowed_token_ids`` and ``min_tokens`` do (the draw is
from the allowed ids, and a stop token banned before ``min_tokens`` is drawn again).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replica.request import SamplingParams
from replica.runner import SeqSlice
from replica.sim.host import SimHostPool
from replica.sim.profile import SimProfile

if TYPE_CHECKING:
    from prefixgate.tokenizer import ChatTokenizer

MASK64 = (1 << 64) - 1
NO_LOGITS = "the simulated engine computes no logits, so it has no log probabilities"


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class SimPool:
    """A block pool without tensors: the scheduler's and the cache's view is the same."""

    block_size: int
    num_blocks: int

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write has nothing to copy: blocks hold no data here."""


@dataclass(slots=True)
class SimModel:
    """What the server and the engine need of a model: its name, tokenizer and context."""

    name: str
    tokenizer: ChatTokenizer
    max_context: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def output_vocabulary(tokenizer: ChatTokenizer) -> list[int]:
    """Every token id but the special (added) ones, in id order."""
    special = set(tokenizer.tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.vocab_size) if i not in special]


@dataclass(slots=True)
class SimStats:
    steps: int = 0
    busy_s: float = 0.0  # simulated device time slept, host copies included
    copy_s: float = 0.0  # of which host tier copies (``SimHostPool``)


@dataclass(slots=True)
class SimBackend:
    """A ``replica.runner.EngineBackend`` and ``StepRunner`` that sleeps each step.

    ``sleep`` is injectable: a test passes one that advances a fake clock (the same one
    the scheduler reads), so step times are checked exactly, not against wall time."""

    profile: SimProfile
    pool: SimPool
    vocabulary: Sequence[int]  # ids a reply may contain
    vocab_size: int  # ids a prompt may contain
    sleep: Callable[[float], None] = time.sleep
    host_pool: SimHostPool | None = None  # the host tier's mover (the engine reads it)
    stats: SimStats = field(default_factory=SimStats)

    forward = None  # the whole step is ``run``
    has_logits = False  # requests for log probabilities are refused (``NO_LOGITS``)

    @property
    def runner(self) -> SimBackend:
        return self

    def thread_context(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def make_generator(self, params: SamplingParams, index: int) -> int:
        """The choice's stream id: seed + index when seeded, else the index."""
        return ((params.seed or 0) + index) & MASK64

    def run(self, slices: Sequence[SeqSlice], input_ids: list[int], rows: list[int]) -> list[int]:
        seconds = self.profile.step_s((s.start, s.num_new) for s in slices)
        if self.host_pool is not None:  # copies made while this step was scheduled
            copies = self.host_pool.take_pending_s()
            self.stats.copy_s += copies
            seconds += copies
        self.stats.steps += 1
        self.stats.busy_s += seconds
        self.sleep(seconds)
        return rows

    def sample(
        self,
        row: Any,
        params: SamplingParams,
        generator: Any,
        token_ids: Sequence[int],
        num_prompt: int,
        banned: Collection[int] = (),
        grammar: Any = None,  # never set: the engine refuses grammars for this backend
    ) -> int:
        h = _mix(int(generator) ^ len(token_ids))
        for token in token_ids[-3:]:
            h = _mix(h ^ token)
        allowed = params.allowed_token_ids or self.vocabulary
        token = allowed[h % len(allowed)]
        for _ in range(8):  # a banned stop token (min_tokens): the next draw of the hash
            if token not in banned:
                break
            h = _mix(h)
            token = allowed[h % len(allowed)]
        return token

    def logprobs(self, rows: Sequence[Any], token_ids: Sequence[int], k: int) -> list[Any]:
        raise NotImplementedError(NO_LOGITS)


def sim_backend(
    profile: SimProfile,
    tokenizer: ChatTokenizer,
    block_size: int,
    *,
    kv_cache_mb: float | None = None,
    num_blocks: int | None = None,
    host_cache_mb: float = 0,
    sleep: Callable[[float], None] = time.sleep,
) -> SimBackend:
    """The backend for ``profile``: its pool sized as ``SimProfile.num_blocks`` says, and
    a host tier of ``host_cache_mb`` MiB (0: none)."""
    blocks = profile.num_blocks(block_size, kv_cache_mb=kv_cache_mb, num_blocks=num_blocks)
    host = SimHostPool.from_budget(profile, block_size, host_cache_mb) if host_cache_mb else None
    return SimBackend(
        profile,
        SimPool(block_size, blocks),
        output_vocabulary(tokenizer),
        tokenizer.vocab_size,
        sleep,
        host,
    )
