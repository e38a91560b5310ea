"""Writes sglang_events.msgpack: what SGLang 0.5.23 sends for a salted prompt cached on
the GPU, backed up to HiCache's host memory and to disk, then evicted from the GPU,
encoded by SGLang's own classes.

Two 16-token pages stored on the GPU with the request's ``cache_salt`` (a field of its
own in SGLang's events), the same pages stored in host memory (``CPU_PINNED``) and on
disk (``DISK``), then the second page removed from the GPU. One event per page, as
SGLang's radix cache sends them; its block hashes namespaced by the salt as it does. The
file is a msgpack list of payloads, one per ZMQ message, in seq order.

Run with SGLang's source on the path (its kv_events module needs msgspec, zmq, pydantic,
orjson and IPython, not a GPU; written with the sglang 0.5.23 wheel unpacked):
    PYTHONPATH=/path/to/sglang /path/to/python tests/bridge/data/make_sglang_events.py
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from sglang.srt.disaggregation.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    StorageMedium,
    namespaced_block_hash,
)

TOKENS = [(i * 7919 + 3) % 49152 for i in range(32)]  # two 16-token pages
SALT = "tenant-a"
OUT = Path(__file__).with_name("sglang_events.msgpack")


def main() -> None:
    seed = SALT.encode()
    hashes = [namespaced_block_hash(h, namespace_seed=seed) for h in (1111, 2222)]

    def pages(medium: StorageMedium) -> list[BlockStored]:
        parents = [None, hashes[0]]
        return [
            BlockStored(
                block_hashes=[hashes[i]],
                parent_block_hash=parents[i],
                token_ids=TOKENS[i * 16 : (i + 1) * 16],
                block_size=16,
                lora_id=None,
                medium=medium,
                cache_salt=SALT,
            )
            for i in range(2)
        ]

    batches = [
        KVEventBatch(ts=1.0, events=pages(StorageMedium.GPU)),
        KVEventBatch(ts=2.0, events=pages(StorageMedium.CPU) + pages(StorageMedium.DISK)),
        KVEventBatch(ts=3.0, events=[BlockRemoved([hashes[1]], medium=StorageMedium.GPU)]),
    ]
    encoder = msgspec.msgpack.Encoder()  # as SGLang's ZmqEventPublisher encodes
    OUT.write_bytes(msgspec.msgpack.encode([encoder.encode(b) for b in batches]))


if __name__ == "__main__":
    main()
