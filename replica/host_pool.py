"""The host tier's tensors: KV blocks in host memory, laid out like the device pool.

    kv[layer]: [num_host_blocks, 2, n_kv_heads, block_size, head_dim]   (K at 0, V at 1)

``HostPool`` is the prefix cache's ``BlockMover`` (``replica.host_tier``): it copies one
block, every layer, between a device block of the ``BlockPool`` and a host slot.

* CPU device: the host tier is a second tensor in the same memory and each copy is a
  ``memcpy`` done inline by the engine thread (the same code path as on a GPU).
* CUDA device: the host tensors are pinned (page-locked), so copies are DMA transfers
  over PCIe issued ``non_blocking`` on a side stream. The engine thread only enqueues
  them and never waits. The side stream first waits for the compute stream (the KV being
  demoted was written by earlier steps), and the compute stream then waits for the side
  stream, so the next step neither overwrites a device block still being demoted nor
  reads a promoted block before it has arrived. The GPU orders this; the host never
  blocks on it.
"""

from __future__ import annotations

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

    def demote(self, device_block: int, host_slot: int) -> None:
        """Device block -> host slot, ordered before the next step may overwrite it."""
        self._copy(self.device_pool.kv, device_block, self.kv, host_slot)

    def promote(self, host_slot: int, device_block: int) -> None:
        """Host slot -> device block, ordered before the next step reads it."""
        self._copy(self.kv, host_slot, self.device_pool.kv, device_block)

    def _copy(
        self, src: list[torch.Tensor], src_block: int, dst: list[torch.Tensor], dst_block: int
    ) -> None:
        with torch.inference_mode():
            if self.stream is None:
                for s, d in zip(src, dst, strict=True):
                    d[dst_block].copy_(s[src_block])
                return
            compute = torch.cuda.current_stream(self.device_pool.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                for s, d in zip(src, dst, strict=True):
                    d[dst_block].copy_(s[src_block], non_blocking=True)
            compute.wait_stream(self.stream)
