"""The bridge end to end: a fake engine (real ZMQ + msgpack in vLLM's format) → the bridge
→ a real Redis → a real gateway index (Router + RedisSync)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from bridge.service import Bridge, BridgeConfig
from bridge.translate import KeyTranslator
from router.protocol import events_stream_key
from router.router import Router
from router.sync import RedisSync
from tests.bridge.cluster import Cluster, keys, make_engine, tokens
from tests.bridge.fake_engine import FakeEngineHTTP
from tests.conftest import RedisServer, wait_until, wait_until_async

pytestmark = pytest.mark.anyio


async def test_engine_blocks_become_the_protocols_keys_in_the_index(
    cluster_factory: Any, http: FakeEngineHTTP
) -> None:
    c = await cluster_factory(16, int_hashes=True, array_like_events=True)
    replica = c.router.replicas[c.rid]
    assert replica.url == http.url and replica.model == "m" and replica.block_size == 16
    await wait_until_async(lambda: c.router.replicas[c.rid].reported.running == 3, 5, "load")
    assert c.router.replicas[c.rid].reported.total_blocks == 40 * 128 // 16
    ids = tokens(200, 1)
    c.engine.store(ids)
    await c.wait_matched(keys(ids))  # 12 full blocks; the 8-token tail has no key
    longer = ids[:192] + tokens(64, 2)
    c.engine.store(longer)  # shares 12 blocks, adds 4
    await c.wait_matched(keys(longer))
    c.bridge.translator.check_invariants()  # type: ignore[union-attr]


async def test_connect_mode_128_token_blocks_and_salts(cluster_factory: Any) -> None:
    c = await cluster_factory(128, connect=True)
    ids = tokens(300, 3)
    c.engine.store(ids, salt="tenant-a")
    salted = keys(ids[:256], salt="tenant-a")
    await c.wait_matched(salted)
    assert len(salted) == 16
    assert c.matched(keys(ids)) == 0  # the shared namespace holds nothing
    c.engine.store(ids, lora_name="adapter-1")
    await c.wait_matched(keys(ids[:256], model="adapter-1"))


async def test_removals_and_clears_land(cluster_factory: Any) -> None:
    c = await cluster_factory(128)
    ids = tokens(512, 4)
    hashes = c.engine.store(ids)
    chain = keys(ids)
    await c.wait_matched(chain)
    c.engine.drop(hashes[2:])  # the last two 128-token blocks: 16 keys
    await wait_until_async(lambda: not c.holds_any(chain[16:]), 10, "removed keys gone")
    assert c.matched(chain) == 16
    c.engine.clear()
    await wait_until_async(lambda: not c.holds_any(chain), 10, "cleared")


async def test_a_gap_is_replayed(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 5), tokens(64, 6)
    c.engine.store(a, send=False)  # lost on the wire, still in the replay buffer
    c.engine.store(b)
    await c.wait_matched(keys(a))
    await c.wait_matched(keys(b))
    assert c.follow.replays_ok >= 1 and c.follow.resets == 0


async def test_a_gap_that_cannot_be_replayed_leaves_no_stale_key(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 7), tokens(64, 8)
    hashes = c.engine.store(a)
    await c.wait_matched(keys(a))
    c.engine.drop(hashes, send=False, replayable=False)  # the removal is lost for good
    c.engine.store(b)
    await c.wait_matched(keys(b))
    assert not c.holds_any(keys(a))
    assert c.follow.replays_failed == 1
    # A child of a block from before the gap is not guessed.
    c.engine.store(b + tokens(16, 9))
    c.engine.store(a + tokens(32, 10))
    await c.wait_matched(keys(a + tokens(32, 10)))  # a's blocks are new again: whole chain


async def test_a_restarted_engine_starts_a_new_sequence(cluster_factory: Any) -> None:
    c = await cluster_factory(16)
    a, b = tokens(64, 11), tokens(64, 12)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    c.engine.restart()  # new process: empty cache, seq from 0
    c.engine.store(b)  # may be sent before the bridge has reconnected: replayed then

    def nudged() -> bool:  # a live engine keeps sending batches; so does this one
        c.engine.publish([])
        return c.matched(keys(b)) == 4

    await wait_until_async(nudged, 10, "the new life's blocks indexed")
    assert not c.holds_any(keys(a))
    assert c.follow.engine_restarts == 1


async def test_a_bridge_that_starts_late_replays_the_engines_history(
    redis_server: RedisServer, http: FakeEngineHTTP, cluster_factory: Any
) -> None:
    engine, endpoint = make_engine(16)
    engine.start()
    try:
        a = tokens(64, 13)
        engine.store(a)  # nobody listens yet: only the replay buffer has it
        config = BridgeConfig(
            http.url,
            endpoint,
            redis_server.url,
            replay=engine.replay_endpoint.replace("*", "127.0.0.1"),  # type: ignore[union-attr]
            model="m",
            check_tokenizer=False,
            heartbeat_s=0.1,
            info_ttl_s=1.0,
        )
        bridge = Bridge(config)
        await bridge.start()
        router = Router()
        sync = RedisSync(router, redis_server.url, poll_interval_s=0.05)
        await sync.start()
        c = Cluster(engine, bridge, router, sync)
        try:
            await c.connected()
            await c.wait_matched(keys(a))
        finally:
            await sync.aclose()
            await bridge.stop()
    finally:
        engine.close()


async def test_survives_redis_and_engine_http_restarts(
    cluster_factory: Any, redis_server: RedisServer, http: FakeEngineHTTP
) -> None:
    c = await cluster_factory(16, snapshot_interval_s=3600.0)
    a = tokens(64, 14)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    redis_server.restart()  # an empty Redis: registry, stream and snapshot gone
    b = tokens(64, 15)
    c.engine.store(b)
    await wait_until_async(
        lambda: c.matched(keys(a)) == 4 and c.matched(keys(b)) == 4, 20, "resynced after restart"
    )
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:  # late gateways find a snapshot in the restarted Redis
        wait_until(lambda: client.exists(f"prefixgate:snapshot:{c.rid}"), 10, "snapshot")
    finally:
        client.close()
    # The engine's HTTP side goes away: no heartbeat, the record expires, gateways drop it.
    port = http.port
    http.stop()
    await wait_until_async(lambda: c.rid not in c.router.replicas, 15, "replica expired")
    http.port = port
    http.start()
    await wait_until_async(lambda: c.rid in c.router.replicas, 15, "replica back")
    await c.wait_matched(keys(a))


def test_the_bridge_process_serves_and_stops_cleanly(
    redis_server: RedisServer, http: FakeEngineHTTP, tmp_path: Any
) -> None:
    """``prefixgate bridge`` as a process, in connect mode, the model name from /v1/models."""
    import redis

    engine, endpoint = make_engine(16, connect=True)
    cmd = [
        sys.executable,
        "-m",
        "prefixgate",
        "bridge",
        "--engine-url",
        http.url,
        "--kv-events",
        endpoint,
        "--replay",
        engine.replay_endpoint.replace("*", "127.0.0.1"),  # type: ignore[union-attr]
        "--redis-url",
        redis_server.url,
        "--no-tokenizer-check",
        "--heartbeat-s",
        "0.1",
    ]
    log = tmp_path / "bridge.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    client = redis.Redis.from_url(redis_server.url)
    rid = f"127.0.0.1:{http.port}"
    try:
        engine.start()
        wait_until(lambda: client.get(f"prefixgate:replica:{rid}"), 20, "registry record")
        ids = tokens(64, 16)
        want = {k.hex() for k in keys(ids)}

        def published() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log.read_text())
            # ZMQ drops what a PUB sends before the subscription is up (the slow joiner):
            # the engine forgets the blocks so each poll sends them again; duplicates
            # change nothing in the bridge.
            engine.cached.clear()
            engine.store(ids)
            entries: Any = client.xrange(f"prefixgate:events:{rid}")
            got = {
                fields[b"keys"].decode()[i : i + 32]
                for _, fields in entries
                for i in range(0, len(fields[b"keys"]), 32)
            }
            return want <= got

        wait_until(published, 20, "keys in the event stream")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()
        assert client.get(f"prefixgate:replica:{rid}") is None  # deregistered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
        engine.close()


@pytest.mark.parametrize("bare", [False, True])
async def test_a_block_moved_to_cpu_is_a_host_tier_match_for_every_gateway(
    cluster_factory: Any, redis_server: RedisServer, bare: bool
) -> None:
    """vLLM with its offloading connector: GPU blocks copied to the CPU, then evicted from
    the GPU. The index prices what is left as a host-tier match (router.route's swap
    term), a gateway that joins late gets the tiers from the snapshot, and the CPU
    eviction removes the keys."""
    c = await cluster_factory(128)
    ids = tokens(512, 20)
    chain = keys(ids)
    hashes = c.engine.store(ids)
    await c.wait_matched(chain)
    c.engine.offload(ids, bare=bare)
    c.engine.drop(hashes[2:])  # GPU eviction of the last two blocks: 16 keys demoted
    await wait_until_async(
        lambda: c.router.index.host_blocks(c.rid, chain) == 16, 10, "16 keys on the host"
    )
    assert c.matched(chain) == 32  # still a full match, half of it a copy away
    assert c.router.index.host_blocks(c.rid, chain[:16]) == 0

    late = Router()  # a gateway that starts now reads the snapshot, tiers included
    sync = RedisSync(late, redis_server.url, poll_interval_s=0.05)
    await sync.start()
    try:
        await wait_until_async(
            lambda: (
                late.index.host_blocks(c.rid, chain) == 16
                and late.index.match(chain).get(c.rid) == 32
            ),
            10,
            "the late gateway's view",
        )
    finally:
        await sync.aclose()

    c.engine.drop(hashes, medium="CPU")  # CPU eviction: the GPU's two blocks stay
    await wait_until_async(lambda: c.matched(chain) == 16, 10, "host keys removed")
    assert c.router.index.host_blocks(c.rid, chain) == 0 and not c.holds_any(chain[16:])
    c.bridge.translator.check_invariants()  # type: ignore[union-attr]


async def test_hostile_batches_are_skipped_or_reset_with_one_line_each(
    cluster_factory: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await cluster_factory(16)
    a = tokens(64, 21)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    bad_events = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [-1] * 16, "block_size": 16},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
         "token_ids": [2**40] * 16, "block_size": 16},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None,
         "token_ids": [1] * 16, "block_size": 0},
        {"type": "BlockRemoved", "block_hashes": [4], "medium": ["GPU"]},
        {"type": "BlockRemoved", "block_hashes": [5], "group_idx": {}},
    ]  # fmt: skip
    before = c.follow.skipped_events
    c.engine.publish(bad_events)
    await wait_until_async(lambda: c.follow.skipped_events == before + 5, 10, "skipped")
    assert c.matched(keys(a)) == 4 and c.follow.resets == 0

    # A batch that raises while applied (here: a translator defect) costs one warning
    # line and a reset; the traceback only at debug level; the bridge goes on.
    def broken(self: KeyTranslator, event: Any) -> Any:
        raise RuntimeError("translator defect")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, "prefixgate.bridge"):
        patch.setattr(KeyTranslator, "stored", broken)
        c.engine.store(tokens(32, 22))
        await wait_until_async(lambda: c.follow.failed_batches == 1, 10, "the failed batch")
    lines = [r for r in caplog.records if "could not be applied" in r.getMessage()]
    assert len(lines) == 1 and "RuntimeError: translator defect" in lines[0].getMessage()
    assert lines[0].exc_info is None and "Traceback" not in caplog.text
    await wait_until_async(lambda: not c.holds_any(keys(a)), 10, "the reset published")
    b = tokens(64, 23)
    c.engine.store(b)
    await c.wait_matched(keys(b))


async def test_a_sequence_jump_beyond_any_replay_buffer_resets_at_once(
    cluster_factory: Any,
) -> None:
    """A hostile or corrupt seq: a negative one is malformed, one far ahead is not asked
    for (nor enumerated)."""
    c = await cluster_factory(16)
    a = tokens(64, 24)
    c.engine.store(a)
    await c.wait_matched(keys(a))
    c.engine.seq = 2**64 - 3  # a seq no engine sends (negative as vLLM's signed int64)
    c.engine.store(tokens(64, 26))
    await wait_until_async(lambda: c.bridge.source.malformed == 1, 10, "malformed counted")
    assert c.follow.resets == 0 and c.matched(keys(a)) == 4
    c.engine.seq = 2**62  # the next batch claims 2**62 batches were missed
    b = tokens(64, 25)
    c.engine.store(b)
    await c.wait_matched(keys(b))
    assert not c.holds_any(keys(a)) and c.follow.replays_failed == 1


async def test_a_burst_filling_half_the_stream_refreshes_the_snapshot(cluster_factory: Any) -> None:
    c = await cluster_factory(16, snapshot_interval_s=3600.0)
    writer = c.bridge.writer
    assert writer is not None
    await wait_until_async(lambda: not writer.has_work, 10, "the first snapshot written")
    writer.config.stream_maxlen = 8  # a capped stream of 8 events: refresh at 4 behind
    written = writer.stats.snapshots_written
    for seed in range(30, 35):
        c.engine.store(tokens(32, seed))
    await wait_until_async(
        lambda: writer.stats.snapshots_written > written, 10, "a snapshot before the period"
    )


async def test_a_batchs_one_block_removals_are_one_event_and_every_key_lands(
    cluster_factory: Any, redis_server: RedisServer
) -> None:
    """vLLM reports each evicted block as its own event, between the stores of the blocks
    that took their place. The bridge writes the batch's removals as one event (each
    entry costs every gateway about 5 µs to follow); a key removed and stored again in
    the batch, and one stored and then removed, end as the engine left them."""
    import redis

    c = await cluster_factory(16)
    old = tokens(128, 20)  # 8 blocks
    kept = tokens(64, 21)  # 4 blocks
    old_hashes = c.engine.store(old)
    kept_hashes = c.engine.store(kept)
    await c.wait_matched(keys(old))
    await c.wait_matched(keys(kept))
    stream = events_stream_key(c.rid)
    client = redis.Redis.from_url(redis_server.url)
    before: Any = client.xlen(stream)
    events: list[Any] = []
    new = [tokens(16, 30 + i) for i in range(4)]
    for i, ids in enumerate(new):  # an eviction, then the block filled in its place
        c.engine.drop([old_hashes[7 - i]], into=events)
        c.engine.store(ids, into=events)
    c.engine.drop([kept_hashes[3]], into=events)  # removed, then stored again
    c.engine.store(kept, into=events)
    brief = tokens(32, 40)
    brief_hashes = c.engine.store(brief, into=events)  # stored, then removed
    c.engine.drop(brief_hashes, into=events)
    c.engine.publish(events)
    await wait_until_async(lambda: not c.holds_any(keys(old)[4:]), 10, "evicted keys gone")
    for ids in new:
        await c.wait_matched(keys(ids))
    assert c.matched(keys(old)) == 4 and c.matched(keys(kept)) == 4
    assert not c.holds_any(keys(brief))
    entries: Any = client.xrange(stream)
    # The batch's entries (the stream is not trimmed here).
    kinds = [fields[b"type"].decode() for _, fields in entries[before:]]
    # 12 engine events, 8 entries: the 4 new blocks' stores; the 5 removals so far as one
    # event, before the store of a key among them (kept's last block); that store; the
    # brief chain's store; and its removal, as one event when the batch ends.
    assert kinds == ["stored"] * 4 + ["removed", "stored", "stored", "removed"], kinds
    c.bridge.translator.check_invariants()  # type: ignore[union-attr]
