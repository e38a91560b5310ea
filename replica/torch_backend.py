"""The built-in model behind the seam of ``replica.runner``: a tensor block pool, the
transformers model's forward through paged attention, sampling from logits.

``TorchStep`` is how the scheduler runs a step with a forward function: pack the step into
a ``PagedBatch``, call the forward, sample each row with ``replica.sampling``.
``TorchBackend`` is what the engine builds for a loaded model: the pool sized from the
model's shape and the KV budget, the model switched to paged attention, its forward.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from replica.attention import PagedBatch, build_paged_batch, use_paged_attention
from replica.host_pool import HostPool
from replica.pool import BlockPool, PoolShape
from replica.request import SamplingParams, TokenLogprob
from replica.runner import ForwardFn, SeqSlice
from replica.sampling import make_generator, sample_token, token_logprobs

if TYPE_CHECKING:
    from replica.config import EngineConfig

DEFAULT_KV_CACHE_MB = 256


class TorchStep:
    """A step of the built-in model: ``forward(input_ids [T], batch, rows [K]) -> [K, V]``."""

    def __init__(self, pool: BlockPool, forward: ForwardFn) -> None:
        self.pool = pool
        self.forward = forward

    def make_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        return make_generator(params, index)

    def run(
        self, slices: Sequence[SeqSlice], input_ids: list[int], rows: list[int]
    ) -> torch.Tensor:
        batch = build_paged_batch(self.pool, slices)
        device = self.pool.device
        logits: torch.Tensor = self.forward(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            batch,
            torch.tensor(rows, dtype=torch.long, device=device),
        )
        return logits  # [K, V]

    def sample(
        self,
        row: torch.Tensor,
        params: SamplingParams,
        generator: Any,
        token_ids: Sequence[int],
        num_prompt: int,
        banned: Collection[int] = (),
        grammar: Any = None,
    ) -> int:
        return sample_token(row, params, generator, token_ids, num_prompt, banned, grammar)

    def logprobs(
        self, rows: Sequence[torch.Tensor], token_ids: Sequence[int], k: int
    ) -> list[TokenLogprob]:
        return token_logprobs(rows, token_ids, k)


class TorchModel(Protocol):
    """What the backend needs of ``replica.models.LoadedModel``."""

    @property
    def model(self) -> Any: ...  # a transformers PreTrainedModel in eval mode
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class TorchBackend:
    """The engine's backend for a loaded transformers model."""

    runner = None  # the scheduler runs its TorchStep over ``forward``
    has_logits = True

    def __init__(self, model: TorchModel, config: EngineConfig) -> None:
        self.model = model
        shape = PoolShape(
            model.num_layers, model.num_kv_heads, model.head_dim, config.block_size, model.dtype
        )
        if config.num_blocks is not None:
            self.pool = BlockPool(shape, config.num_blocks, model.device)
        else:
            budget = config.kv_cache_mb if config.kv_cache_mb is not None else DEFAULT_KV_CACHE_MB
            self.pool = BlockPool.from_budget(shape, budget, model.device)
        # The host tier, the prefix cache's mover between it and the pool (or none).
        self.host_pool = (
            HostPool.from_budget(self.pool, config.host_cache_mb) if config.host_cache_mb else None
        )
        use_paged_attention(model.model)
        self.vocab_size = int(model.model.config.vocab_size)

    def thread_context(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def forward(
        self, input_ids: torch.Tensor, batch: PagedBatch, rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids: [T]; rows: [K] -> logits [K, V] (only the rows we sample from)."""
        out = self.model.model(
            input_ids=input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            logits_to_keep=rows,
            paged_batch=batch,
        )
        return out.logits[0]  # [K, V]
