"""vLLM's own bytes (tests/bridge/data, written by vLLM 0.32's classes) through a real
bridge into a gateway index: a block offloaded to the CPU (make_vllm_offload_events.py),
and a hybrid model's prompt whose early blocks its sliding-window group let go
(make_vllm_hybrid_events.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from bridge.events import BlockRemoved, BlockStored, decode_batch
from tests.bridge.cluster import keys
from tests.conftest import wait_until_async

pytestmark = pytest.mark.anyio

DATA = Path(__file__).with_name("data") / "vllm_offload_events.msgpack"
HYBRID = Path(__file__).with_name("data") / "vllm_hybrid_events.msgpack"
TOKENS = [(i * 7919) % 49152 for i in range(32)]  # as the generator's


def payloads() -> list[bytes]:
    recorded: list[bytes] = msgpack.unpackb(DATA.read_bytes())
    return recorded


def test_vllms_offload_events_decode_with_their_media() -> None:
    batches = [decode_batch(p) for p in payloads()]
    assert all(b.skipped == 0 for b in batches)
    gpu, cpu, gpu_gone, cpu_gone = (b.events for b in batches)
    assert isinstance(gpu[0], BlockStored) and gpu[0].medium == "GPU"
    bare = [e for e in cpu if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(bare) == len(cpu) == 2 and not any(e.token_ids for e in bare)
    assert {e.block_hashes[0] for e in bare} == set(gpu[0].block_hashes)  # same hashes
    assert isinstance(gpu_gone[0], BlockRemoved) and gpu_gone[0].medium == "GPU"
    assert isinstance(cpu_gone[0], BlockRemoved) and cpu_gone[0].medium == "CPU"


async def test_vllms_offload_events_move_the_block_to_the_host_tier(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    chain = keys(TOKENS)
    gpu, cpu, gpu_gone, cpu_gone = payloads()
    c.engine.publish_payload(gpu)
    await c.wait_matched(chain)
    c.engine.publish_payload(cpu)
    c.engine.publish_payload(gpu_gone)  # the second block leaves the GPU, stays on the CPU
    await wait_until_async(
        lambda: c.router.index.host_blocks(c.rid, chain) == 1, 10, "one block on the host"
    )
    assert c.matched(chain) == 2 and c.router.index.host_blocks(c.rid, chain[:1]) == 0
    c.engine.publish_payload(cpu_gone)  # the CPU copies go: the first block stays on the GPU
    await wait_until_async(lambda: c.matched(chain) == 1, 10, "the host block removed")
    assert c.router.index.host_blocks(c.rid, chain) == 0
    assert c.follow.skipped_events == 0 and c.follow.resets == 0


async def test_a_hybrid_models_prefix_stays_while_its_full_attention_group_holds_it(
    cluster_factory: Any,
) -> None:
    # gpt-oss's groups: 0 sliding-window, 1 full attention. The second batch evicts A's
    # 2nd to 4th blocks from group 0 only; vLLM still finds 240 of A's 256 tokens cached.
    recorded = msgpack.unpackb(HYBRID.read_bytes())
    prompt, hit, (a, b) = recorded["prompt"], recorded["hit"], recorded["payloads"]
    assert hit == 240
    c = await cluster_factory(16)
    chain = keys(prompt)
    c.engine.publish_payload(a)
    await c.wait_matched(chain)
    c.engine.publish_payload(b)
    await c.wait_matched(keys(recorded["other"][:96]))  # B's batch is in the index
    assert c.matched(chain) == len(chain) == 16
    # What the gateway predicts (the engine computes the prompt's last token again):
    assert min(c.matched(chain) * 16, len(prompt) - 1) // 16 * 16 == hit
    assert c.follow.skipped_events == 0 and c.follow.resets == 0
