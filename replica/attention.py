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
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from replica.pool import BlockPool
from replica.runner import SeqSlice

PAGED_ATTENTION = "prefixgate_paged"


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together (all with the same number of new tokens Q)."""

    rows: torch.Tensor  # [S, Q] long: indices into the packed T axis
    block_tables: torch.Tensor  # [S, NB] long: padded with block 0 (masked out)
    num_keys: int  # L <= NB * block_size: the gathered keys are cut to the longest context
    # [S, 1, Q, L] bool, True = may attend; None when every query sees all L keys (decode
    # rows of equal length), which spares SDPA the mask.
    mask: torch.Tensor | None
    whole_step: bool  # rows is arange(T) reshaped: q and the output are views, no copies


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
    t = len(positions)
    groups: list[AttentionGroup] = []
    if decode_ids:
        groups.append(
            _group([seqs[i] for i in decode_ids], [row_starts[i] for i in decode_ids], bs, t)
        )
    for i in prefill_ids:
        groups.append(_group([seqs[i]], [row_starts[i]], bs, t))
    device = pool.device
    on_device = [_to_device(g, device) for g in groups] if device.type != "cpu" else groups
    return PagedBatch(
        pool=pool,
        positions=pos.to(device),
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
        slot_offsets=(pos % bs).to(device),
        groups=on_device,
    )


def _to_device(g: AttentionGroup, device: torch.device) -> AttentionGroup:
    mask = g.mask.to(device) if g.mask is not None else None
    return AttentionGroup(
        g.rows.to(device), g.block_tables.to(device), g.num_keys, mask, g.whole_step
    )


def _group(
    seqs: Sequence[SeqSlice], row_starts: Sequence[int], bs: int, num_tokens: int
) -> AttentionGroup:
    q = seqs[0].num_new
    assert all(s.num_new == q for s in seqs)
    lengths = [s.start + q for s in seqs]  # keys each sequence's last query sees
    num_keys = max(lengths)
    num_blocks = math.ceil(num_keys / bs)
    tables = torch.zeros((len(seqs), num_blocks), dtype=torch.long)
    for j, s in enumerate(seqs):
        n = math.ceil(lengths[j] / bs)
        tables[j, :n] = torch.tensor(list(s.block_table[:n]), dtype=torch.long)
    rows = torch.tensor(row_starts, dtype=torch.long)[:, None] + torch.arange(q)[None, :]
    whole_step = len(seqs) * q == num_tokens and list(row_starts) == [
        j * q for j in range(len(seqs))
    ]
    mask: torch.Tensor | None = None
    if q > 1 or min(lengths) != num_keys:
        # query position of row (s, i): start_s + i; key position j is visible iff j <= it
        starts = torch.tensor([s.start for s in seqs], dtype=torch.long)
        q_pos = starts[:, None] + torch.arange(q)  # [S, Q]
        k_pos = torch.arange(num_keys)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [S, 1, Q, L]
    return AttentionGroup(rows, tables, num_keys, mask, whole_step)


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
    kv_pool = batch.pool.kv[layer]  # [N, 2, KVH, B, D]
    new_kv = torch.stack((key[0], value[0])).to(kv_pool.dtype)  # [2, KVH, T, D]
    # The [N, B, 2, KVH, D] view indexed by the [T] block/offset tensors is [T, 2, KVH, D]
    kv_pool.permute(0, 3, 1, 2, 4).index_put_(
        (batch.slot_blocks, batch.slot_offsets), new_kv.permute(2, 0, 1, 3)
    )
    if len(batch.groups) == 1 and batch.groups[0].whole_step:
        # The common case (only decoders, or one prefill chunk): no row shuffling at all.
        g = batch.groups[0]
        s, q_len = g.rows.shape
        q = query[0].unflatten(1, (s, q_len)).transpose(0, 1)  # [S, H, Q, D] view
        o = _attend(q, kv_pool, g, scaling)  # [S, H, Q, D]
        return o.transpose(1, 2).reshape(1, s * q_len, o.shape[1], o.shape[3]), None
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q_all)  # [T, H, D]
    for g in batch.groups:
        s, q_len = g.rows.shape
        q = q_all[g.rows].transpose(1, 2)  # [S, H, Q, D]
        o = _attend(q, kv_pool, g, scaling)  # [S, H, Q, D]
        out[g.rows.reshape(-1)] = o.transpose(1, 2).reshape(s * q_len, o.shape[1], o.shape[3])
    return out.unsqueeze(0), None


def _attend(
    q: torch.Tensor, kv_pool: torch.Tensor, g: AttentionGroup, scaling: float | None
) -> torch.Tensor:
    """q: [S, H, Q, D] -> [S, H, Q, D] over each sequence's context in the pool."""
    # The gather is a per-step temporary for this computation; the cached prefix
    # itself stays in its (possibly shared) blocks and is never copied per request.
    kv = _gather(kv_pool, g.block_tables, g.num_keys).to(q.dtype)  # [2, S, KVH, L, D]
    return F.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=g.mask, scale=scaling, enable_gqa=True
    )


def _gather(pool_layer: torch.Tensor, block_tables: torch.Tensor, num_keys: int) -> torch.Tensor:
    """pool_layer: [N, 2, KVH, B, D]; block_tables: [S, NB] -> [2, S, KVH, num_keys, D].

    ``index_select`` on the block axis copies whole blocks (contiguous rows); one more
    copy lays them out as contiguous [2, S, KVH, NB*B, D], the layout SDPA reads fastest:
    a permuted view of the pool would copy once, but SDPA is slower on what it gives
    (``engine_bench.py --only long-decode``; figures in docs/BENCHMARKS.md)."""
    s, nb = block_tables.shape
    g = torch.index_select(pool_layer, 0, block_tables.reshape(-1))  # [S*NB, 2, KVH, B, D]
    _, two, kvh, b, d = g.shape
    g = g.view(s, nb, two, kvh, b, d).permute(2, 0, 3, 1, 4, 5).reshape(two, s, kvh, nb * b, d)
    return g[:, :, :, :num_keys]


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
