from __future__ import annotations

import pytest
import torch

from replica.pool import BYTES_PER_MB, BlockPool, PoolShape

SHAPE = PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def test_block_bytes_is_what_each_block_takes_in_the_tensors() -> None:
    pool = BlockPool(SHAPE, 5, "cpu")
    in_tensors = sum(kv.numel() * kv.element_size() for kv in pool.kv)
    assert in_tensors == 5 * SHAPE.block_bytes == pool.nbytes


def test_pool_from_budget_allocates_per_layer_tensors_once() -> None:
    pool = BlockPool.from_budget(SHAPE, 1, "cpu")
    assert pool.num_blocks == BYTES_PER_MB // SHAPE.block_bytes
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k[0].shape == (pool.num_blocks, 2, 4, 8)
    assert pool.nbytes <= BYTES_PER_MB
    assert pool.capacity_tokens == pool.num_blocks * 4


def test_budget_too_small_for_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        SHAPE.blocks_for_budget(0.0001)
    with pytest.raises(ValueError):
        BlockPool(SHAPE, 0, "cpu")


def test_copy_block_copies_every_layer_and_leaves_others() -> None:
    pool = BlockPool(SHAPE, 4, "cpu")
    with torch.inference_mode():
        for layer in range(3):
            pool.k[layer][1].fill_(layer + 1.0)
            pool.v[layer][1].fill_(-(layer + 1.0))
    pool.copy_block(1, 3)
    for layer in range(3):
        assert torch.equal(pool.k[layer][3], pool.k[layer][1])
        assert torch.equal(pool.v[layer][3], pool.v[layer][1])
        assert pool.k[layer][2].abs().sum() == 0
