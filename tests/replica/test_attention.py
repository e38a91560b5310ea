"""Attention over the pool against the model's own (sdpa) forward on the full sequence."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from replica.attention import SeqSlice, build_paged_batch, use_paged_attention
from replica.pool import BlockPool, PoolShape

BS = 4


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    ref = LlamaForCausalLM(cfg).eval()
    paged = copy.deepcopy(ref)
    use_paged_attention(paged)
    return ref, paged


def _pool() -> BlockPool:
    return BlockPool(PoolShape(2, 2, 8, BS, torch.float32), 32, "cpu")


def _step(
    model: LlamaForCausalLM, pool: BlockPool, ids: list[torch.Tensor], slices: list[SeqSlice]
):
    batch = build_paged_batch(pool, slices)
    packed = torch.cat(ids)[None]
    with torch.inference_mode():
        return model(
            input_ids=packed, position_ids=batch.positions[None], use_cache=False, paged_batch=batch
        ).logits[0]


def test_chunked_prefill_through_scattered_blocks_matches_full_forward(models) -> None:
    ref, paged = models
    pool = _pool()
    ids = torch.randint(0, 97, (23,))
    table = [17, 3, 29, 8, 0, 11]  # deliberately not in order
    first = _step(paged, pool, [ids[:10]], [SeqSlice(table, 0, 10)])
    second = _step(paged, pool, [ids[10:]], [SeqSlice(table, 10, 13)])
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-5, rtol=1e-5)


def test_packed_decode_and_prefill_in_one_forward(models) -> None:
    ref, paged = models
    pool = _pool()
    a, b = torch.randint(0, 97, (9,)), torch.randint(0, 97, (14,))
    ta, tb = [1, 2, 5], [6, 9, 4, 7]
    _step(paged, pool, [a[:8]], [SeqSlice(ta, 0, 8)])
    # one step: a decodes its 9th token while b prefills all 14
    out = _step(paged, pool, [a[8:], b], [SeqSlice(ta, 8, 1), SeqSlice(tb, 0, 14)])
    with torch.inference_mode():
        ra, rb = ref(a[None]).logits[0], ref(b[None]).logits[0]
    torch.testing.assert_close(out[0], ra[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], rb, atol=1e-5, rtol=1e-5)


def test_block_table_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="block table too short"):
        build_paged_batch(_pool(), [SeqSlice([0], 2, 3)])


def test_forward_without_paged_batch_says_what_to_do(models) -> None:
    _, paged = models
    with torch.inference_mode(), pytest.raises(RuntimeError, match="paged_batch"):
        paged(input_ids=torch.tensor([[1, 2]]), use_cache=False)
