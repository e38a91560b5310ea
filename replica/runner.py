"""The model seam: what the scheduler and the engine need from whatever computes a step.

The scheduler decides which tokens of which sequences a step computes; a *backend* runs
that step and draws the next tokens. Two backends exist:

* the built-in model (``replica.torch_backend``): K/V in a tensor pool, the forward pass of
  a transformers model through paged attention, sampling from logits with torch;
* the simulated engine (``replica.sim``): no tensors; a step sleeps what a GPU cost model
  says and draws deterministic pseudo-random tokens. It must not import torch.

So this module, the scheduler and the engine import no torch; only the built-in backend
does, and only when it is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from replica.request import SamplingParams, TokenLogprob

# The built-in backend's forward: (input_ids [T], PagedBatch, rows [K]) -> logits [K, V].
# Typed loosely here so that naming it costs no torch import.
ForwardFn = Callable[[Any, Any, Any], Any]


class SeqSlice(NamedTuple):
    """One sequence's share of a step: compute positions ``start .. start+num_new-1``."""

    block_table: Sequence[int]
    start: int
    num_new: int


class BlockLayout(Protocol):
    """The block pool as the scheduler sees it: how many blocks of how many tokens, and
    copy-on-write of one block into another."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    def copy_block(self, src: int, dst: int) -> None: ...


class StepRunner(Protocol):
    """Runs one scheduled step and draws tokens from its output rows."""

    def make_generator(self, params: SamplingParams, index: int) -> Any:
        """Per-choice random state (choice ``index`` of a request), or None (greedy)."""
        ...

    def run(self, slices: Sequence[SeqSlice], input_ids: list[int], rows: list[int]) -> Any:
        """Compute every slice (``input_ids``: their new tokens, packed in order); return
        something indexable by position in ``rows`` (the packed positions whose next
        token is wanted), each item handed to ``sample``. May raise: the scheduler fails
        this step's requests and goes on."""
        ...

    def sample(
        self,
        row: Any,
        params: SamplingParams,
        generator: Any,
        token_ids: Sequence[int],
        num_prompt: int,
        banned: Collection[int] = (),
        grammar: Any = None,
    ) -> int:
        """The next token of a sequence whose tokens so far are ``token_ids`` (the first
        ``num_prompt`` the prompt), from its output ``row``; never one of ``banned``
        (stop tokens, before ``min_tokens``), unless nothing else may be drawn, and one
        that ``grammar`` (the sequence's matcher, replica.grammar) allows next."""
        ...

    def logprobs(self, rows: Sequence[Any], token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
        """The log probability of ``token_ids[i]`` at output ``rows[i]`` (of the raw
        logits, as vLLM reports them) and the ``k`` likeliest tokens there. Raises
        ``NotImplementedError`` when the backend has no logits (the simulated engine)."""
        ...


class EngineBackend(Protocol):
    """What the engine builds its scheduler from and runs its thread inside."""

    @property
    def pool(self) -> BlockLayout: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def forward(self) -> ForwardFn | None:
        """The built-in model's forward, handed to the scheduler's torch step; None when
        ``runner`` does the whole step."""
        ...

    @property
    def runner(self) -> StepRunner | None: ...
    @property
    def has_logits(self) -> bool:
        """Whether its steps make logits, so that it can report log probabilities."""
        ...

    def thread_context(self) -> AbstractContextManager[Any]:
        """Entered once by the engine thread around its loop (torch: inference mode)."""
        ...
