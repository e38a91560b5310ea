"""SGLang 0.5.23's own bytes (tests/bridge/data, written by its classes:
make_sglang_events.py) through a real bridge into a gateway index: a salted prompt on the
GPU, backed up to HiCache's host memory and to disk, then evicted from the GPU.

SGLang 0.5.23 names its host memory ``CPU_PINNED`` (``CPU_TIER1`` before) and puts the
request's ``cache_salt`` in a field of its own. The bridge read neither: the prompt was
published under the unsalted keys, which no salted request's keys match, and its host
copies were ignored (with a warning)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bridge.events import BlockRemoved, BlockStored, decode_batch, salt_of
from tests.bridge.cluster import keys
from tests.conftest import wait_until_async

pytestmark = pytest.mark.anyio

DATA = Path(__file__).with_name("data") / "sglang_events.msgpack"
TOKENS = [(i * 7919 + 3) % 49152 for i in range(32)]  # as the generator's
SALT = "tenant-a"


def payloads() -> list[bytes]:
    recorded: list[bytes] = msgpack.unpackb(DATA.read_bytes())
    return recorded


def test_sglangs_events_decode_with_their_salt_and_media() -> None:
    batches = [decode_batch(p) for p in payloads()]
    assert all(b.skipped == 0 for b in batches)
    gpu, backups, evicted = (b.events for b in batches)
    assert all(isinstance(e, BlockStored) and salt_of(e) == SALT for e in gpu + backups)
    media = [e.medium for e in backups if isinstance(e, BlockStored)]
    assert media == ["CPU_PINNED", "CPU_PINNED", "DISK", "DISK"]
    assert isinstance(evicted[0], BlockRemoved) and evicted[0].medium == "GPU"


async def test_a_salted_prompt_moves_to_the_host_tier(
    cluster_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    c = await cluster_factory(16)
    chain = keys(TOKENS, salt=SALT)
    gpu, backups, evicted = payloads()
    with caplog.at_level(logging.WARNING, logger="prefixgate.bridge"):
        c.engine.publish_payload(gpu)
        await c.wait_matched(chain)
        assert not c.holds_any(keys(TOKENS))  # not under the unsalted keys
        c.engine.publish_payload(backups)
        c.engine.publish_payload(evicted)  # the second page leaves the GPU, stays in host memory
        await wait_until_async(
            lambda: c.router.index.host_blocks(c.rid, chain) == 1, 10, "one page on the host"
        )
    assert c.matched(chain) == 2 and c.router.index.host_blocks(c.rid, chain[:1]) == 0
    assert c.follow.skipped_events == 0 and c.follow.resets == 0
    assert not [r for r in caplog.records if "medium" in r.getMessage()]  # all three known
