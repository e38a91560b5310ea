"""The host tier's tensors: KV blocks in host memory, laid out like the device pool.

    kv[layer]: [num_host_blocks, 2, n_kv_heads, block_size, head_dim]   (K at 0, V at 1)

``HostPool`` is the prefix cache's ``BlockMover`` (``replica.host_tier``): it copies one
block, every layer, between a device block of the ``BlockPool`` and a host slot.

The cache hands over a batch of (source, target) blocks per call; each block of each
layer is one ``copy_`` (on CPU a gather + scatter per layer measured slower: it moves
every byte twice and allocates the gathered copy).

* CPU device: the host tier is a second tensor in the same memory; the copies are
  memcpys done inline by the engine thread.
* CUDA device: the host tensors are pinned (page-locked), so copies are DMA transfers
  over PCIe issued ``non_blocking`` on a side stream. The engine thread only enqueues
  them and never waits. The side stream first waits for the compute stream (the KV being
  demoted was written by earlier steps), and the compute stream then waits for the side
  stream, so the next step neither overwrites a device block still being demoted nor
  reads a promoted block before it has arrived. The GPU orders this; the host never
  blocks on it. One copy per (layer, block) is many small DMA launches; a batched
  transfer needs a pinned staging buffer and a gather/scatter kernel (not done).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica.pool import BYTES_PER_MB, BlockPool


class HostPool:
    """Host-memory KV blocks for one device pool, and the copies between them."""

    def __init__(self, device_pool: BlockPool, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host pool needs at least one block, got {num_blocks}")
        self.device_pool = device_pool
        self.num_blocks = num_blocks
        device = device_pool.device
        pin = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if pin else None
        with torch.inference_mode():
            self.kv = [
                torch.zeros(
                    (num_blocks, *kv.shape[1:]), dtype=kv.dtype, device="cpu", pin_memory=pin
                )
                for kv in device_pool.kv
            ]  # [H, 2, KVH, B, D] each

    @classmethod
    def from_budget(cls, device_pool: BlockPool, budget_mb: float) -> HostPool:
        blocks = int(budget_mb * BYTES_PER_MB) // device_pool.shape.block_bytes
        if blocks < 1:
            raise ValueError(
                f"a host cache of {budget_mb} MB holds no block "
                f"({device_pool.shape.block_bytes} bytes each); give --host-cache-mb more"
            )
        return cls(device_pool, blocks)

    @property
    def block_bytes(self) -> int:
        return self.device_pool.shape.block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        """Device blocks -> host slots, ordered before the next step may overwrite them."""
        self._copy(self.device_pool.kv, device_blocks, self.kv, host_slots)

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Host slots -> device blocks, ordered before the next step reads them."""
        self._copy(self.kv, host_slots, self.device_pool.kv, device_blocks)

    def _copy(
        self,
        src: list[torch.Tensor],
        src_blocks: Sequence[int],
        dst: list[torch.Tensor],
        dst_blocks: Sequence[int],
    ) -> None:
        if len(src_blocks) != len(dst_blocks) or len(set(dst_blocks)) != len(dst_blocks):
            raise ValueError("copies need one distinct target per source block")
        if not src_blocks:
            return
        pairs = list(zip(src_blocks, dst_blocks, strict=True))
        with torch.inference_mode():
            if self.stream is None:
                for s, d in zip(src, dst, strict=True):  # [N|H, 2, KVH, B, D] each
                    for a, b in pairs:
                        d[b].copy_(s[a])
                return
            compute = torch.cuda.current_stream(self.device_pool.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                for s, d in zip(src, dst, strict=True):
                    for a, b in pairs:
                        d[b].copy_(s[a], non_blocking=True)
            compute.wait_stream(self.stream)
