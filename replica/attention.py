"""Attention over the block pool, plugged into transformers as an attention function.

transformers' Llama-style attention projects and rotates q/k/v for the *new* tokens of
the forward and hands them, with the module (which knows its ``layer_idx``) and every
extra forward kwarg, to the function registered under ``config._attn_implementation``.
We register ``PAGED_ATTENTION`` and pass the step's metadata as the ``paged_batch``
forward kwarg. Because the name is not in transformers' mask registry, the model builds
no causal mask at all (masking_utils exits early); ``paged_batch`` carries our own.

One forward packs every scheduled sequence into a single row (batch dim 1)::

    input_ids:    [1, T]   seq0's new tokens | seq1's new tokens | ...
    position_ids: [1, T]   each token's absolute position in its own sequence

Per layer the function (1) writes the new tokens' K/V into their slots in the pool and
(2) attends, per group of sequences, over each sequence's whole context read through its
block table. Decoding sequences (one new token each) form one padded group; each
prefill chunk is its own group, so a long chunk never pads the decoders.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from replica.pool import BlockPool

PAGED_ATTENTION = "prefixgate_paged"


class SeqSlice(NamedTuple):
    """One sequence's share of a step: compute positions ``start .. start+num_new-1``."""

    block_table: Sequence[int]
    start: int
    num_new: int


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together (all with the same number of new tokens Q)."""

    rows: torch.Tensor  # [S, Q] long: indices into the packed T axis
    block_tables: torch.Tensor  # [S, NB] long: padded with block 0 (masked out)
    mask: torch.Tensor  # [S, 1, Q, NB * block_size] bool: True = may attend


@dataclass(slots=True)
class PagedBatch:
    """Per-step metadata shared by all layers; built once per forward."""

    pool: BlockPool
    positions: torch.Tensor  # [T] long
    slot_blocks: torch.Tensor  # [T] long: block id receiving each new token's K/V
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    groups: list[AttentionGroup]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_paged_batch(pool: BlockPool, seqs: Sequence[SeqSlice]) -> PagedBatch:
    """Pack ``seqs`` (in order) into one step. Every block a slice writes or reads must
    already be in its block table."""
    bs = pool.block_size
    device = pool.device
    positions: list[int] = []
    slot_blocks: list[int] = []
    decode_ids: list[int] = []
    prefill_ids: list[int] = []
    row_starts: list[int] = []
    for i, s in enumerate(seqs):
        if s.num_new < 1:
            raise ValueError("every scheduled sequence computes at least one token")
        if math.ceil((s.start + s.num_new) / bs) > len(s.block_table):
            raise ValueError("block table too short for the positions it must hold")
        row_starts.append(len(positions))
        for p in range(s.start, s.start + s.num_new):
            positions.append(p)
            slot_blocks.append(s.block_table[p // bs])
        (decode_ids if s.num_new == 1 else prefill_ids).append(i)

    pos = torch.tensor(positions, dtype=torch.long)
    groups: list[AttentionGroup] = []
    if decode_ids:
        groups.append(
            _group([seqs[i] for i in decode_ids], [row_starts[i] for i in decode_ids], bs)
        )
    for i in prefill_ids:
        groups.append(_group([seqs[i]], [row_starts[i]], bs))
    return PagedBatch(
        pool=pool,
        positions=pos.to(device),
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=(pos % bs).to(device),
        groups=[
            AttentionGroup(g.rows.to(device), g.block_tables.to(device), g.mask.to(device))
            for g in groups
        ],
    )


def _group(seqs: Sequence[SeqSlice], row_starts: Sequence[int], bs: int) -> AttentionGroup:
    q = seqs[0].num_new
    assert all(s.num_new == q for s in seqs)
    num_blocks = max(math.ceil((s.start + q) / bs) for s in seqs)
    tables = torch.zeros((len(seqs), num_blocks), dtype=torch.long)
    for j, s in enumerate(seqs):
        n = math.ceil((s.start + q) / bs)
        tables[j, :n] = torch.tensor(list(s.block_table[:n]), dtype=torch.long)
    rows = torch.tensor(row_starts, dtype=torch.long)[:, None] + torch.arange(q)[None, :]
    # query position of row (s, i): start_s + i; a key at position j is visible iff j <= it
    q_pos = torch.tensor([s.start for s in seqs], dtype=torch.long)[:, None] + torch.arange(q)
    k_pos = torch.arange(num_blocks * bs)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [S, 1, Q, L]
    return AttentionGroup(rows=rows, block_tables=tables, mask=mask)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, KVH, T, D] (new tokens only, rotated).
    Returns ([1, T, H, D], None): transformers reshapes it to [1, T, H*D]."""
    batch: PagedBatch | None = kwargs.get("paged_batch")
    if batch is None:
        raise RuntimeError(
            f"attention '{PAGED_ATTENTION}' needs the paged_batch forward kwarg; "
            "run this model through replica.engine.Engine"
        )
    layer: int = module.layer_idx  # type: ignore[assignment]
    k_pool, v_pool = batch.pool.k[layer], batch.pool.v[layer]
    # k_pool[b, :, o] indexed by [T] block/offset tensors selects [T, KVH, D]
    k_pool[batch.slot_blocks, :, batch.slot_offsets] = key[0].transpose(0, 1).to(k_pool.dtype)
    v_pool[batch.slot_blocks, :, batch.slot_offsets] = value[0].transpose(0, 1).to(v_pool.dtype)

    q_all = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q_all)  # [T, H, D]
    for g in batch.groups:
        s, q_len = g.rows.shape
        # The gather is a per-step temporary for this computation; the cached prefix
        # itself stays in its (possibly shared) blocks and is never copied per request.
        k = _gather(k_pool, g.block_tables)  # [S, KVH, L, D]
        v = _gather(v_pool, g.block_tables)  # [S, KVH, L, D]
        q = q_all[g.rows].transpose(1, 2)  # [S, H, Q, D]
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask, scale=scaling, enable_gqa=True
        )  # [S, H, Q, D]
        out[g.rows.reshape(-1)] = o.transpose(1, 2).reshape(s * q_len, o.shape[1], o.shape[3])
    return out.unsqueeze(0), None


def _gather(pool_layer: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """pool_layer: [N, KVH, B, D]; block_tables: [S, NB] -> [S, KVH, NB * B, D]."""
    g = pool_layer[block_tables]  # [S, NB, KVH, B, D]
    s, nb, kvh, b, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(s, kvh, nb * b, d)


def register_paged_attention() -> str:
    """Make ``PAGED_ATTENTION`` known to transformers (idempotent); returns its name."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    return PAGED_ATTENTION


def use_paged_attention(model: Any) -> None:
    """Switch ``model`` (a transformers PreTrainedModel) to attention over the pool."""
    register_paged_attention()
    model.set_attn_implementation(PAGED_ATTENTION)
    if model.config._attn_implementation != PAGED_ATTENTION:
        raise RuntimeError(f"{type(model).__name__} cannot use a custom attention function")
