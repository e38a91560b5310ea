"""The KV block pool: every layer's keys and values for every block, allocated once.

Layout per layer (K and V alike)::

    kv[layer]: [num_blocks, 2, n_kv_heads, block_size, head_dim]   (K at 0, V at 1)
    k[layer], v[layer]: [num_blocks, n_kv_heads, block_size, head_dim] views of it

Token position ``p`` of a request lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``. Which block belongs to whom is the prefix cache's business;
the pool only holds tensors and never allocates after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BYTES_PER_MB = 1024 * 1024


@dataclass(slots=True, frozen=True)
class PoolShape:
    """Everything that sizes one block, taken from the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element

    def blocks_for_budget(self, budget_mb: float) -> int:
        blocks = int(budget_mb * BYTES_PER_MB) // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_mb} MB holds no block ({self.block_bytes} bytes each)"
            )
        return blocks


class BlockPool:
    """Per-layer K and V tensors shared by every request on this replica."""

    def __init__(self, shape: PoolShape, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        dims = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
        # Zeroed, not empty: a padded gather may read blocks nobody wrote (masked out, but
        # uninitialised memory can hold NaN, and NaN * 0 poisons the softmax output).
        # K and V of a block sit side by side (kv[layer][b] is [2, KVH, B, D]), so one
        # indexing op writes or gathers both; k/v are views into it.
        with torch.inference_mode():
            self.kv = [
                torch.zeros((num_blocks, 2, *dims[1:]), dtype=shape.dtype, device=self.device)
                for _ in range(shape.num_layers)
            ]  # [N, 2, KVH, B, D] each
            self.k = [kv[:, 0] for kv in self.kv]  # [N, KVH, B, D] views
            self.v = [kv[:, 1] for kv in self.kv]  # [N, KVH, B, D] views

    @classmethod
    def from_budget(
        cls, shape: PoolShape, budget_mb: float, device: torch.device | str
    ) -> BlockPool:
        return cls(shape, shape.blocks_for_budget(budget_mb), device)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.shape.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: give ``dst`` the contents of the shared block ``src``."""
        with torch.inference_mode():
            for kv in self.kv:
                kv[dst].copy_(kv[src])
