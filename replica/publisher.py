"""Tells the gateways, through Redis, what this replica's cache holds and how loaded it is.

Layout and codec: ``router.protocol``. Three things are written:

* the registry record (``replica_info_key``), refreshed every heartbeat with an expiry,
  so a replica that dies disappears on its own;
* block events (``events_stream_key``), a capped stream, ``seq`` growing by one per event;
* a snapshot (``snapshot_key``) whose ``seq`` is the last event folded into it.

The cache calls ``on_stored`` / ``on_removed`` / ``on_cleared`` from the engine thread.
Under one lock they assign the event's ``seq``, update a mirror of the cached keys
(short key → parent) and queue the event. Snapshots are taken from that mirror under the
same lock, so a snapshot and its ``seq`` always agree, without reading the cache from a
second thread. One asyncio task writes snapshots and events (in that order of need);
another heartbeats. Redis is an accelerator, never a dependency: when it is down, events
are dropped (readers see a seq gap and resync from the snapshot, which is the contract),
the replica keeps serving, the outage is logged once, and a fresh snapshot is written as
soon as Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from router.backoff import Backoff
from router.protocol import (
    BlockEvent,
    Medium,
    ReplicaInfo,
    ReplicaLoad,
    encode_snapshot,
    short_key,
)
from router.replica_redis import (
    REDIS_ERRORS,
    STREAM_MAXLEN,
    Outage,
    ReplicaRedis,
    new_life_seq,
)

log = logging.getLogger("prefixgate.replica.publisher")


@dataclass(slots=True)
class PublisherConfig:
    redis_url: str
    replica_id: str
    url: str  # what gateways call (the advertised URL)
    model: str
    block_size: int
    heartbeat_s: float = 1.0
    info_ttl_s: float = 5.0
    snapshot_interval_s: float = 5.0
    stream_maxlen: int = STREAM_MAXLEN
    batch_size: int = 512
    min_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    redis_timeout_s: float = 1.0


@dataclass(slots=True)
class PublisherStats:
    seq: int = 0
    events_published: int = 0
    events_dropped: int = 0
    snapshots_written: int = 0
    heartbeats: int = 0
    outages: int = 0
    connected: bool = False


class Publisher:
    """A ``CacheListener`` that mirrors the cache's keys and publishes them to Redis."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._load: Callable[[], ReplicaLoad] = ReplicaLoad  # until start() gets the engine's
        self._lock = threading.Lock()
        # Guarded by _lock: the event counter, the key mirror, the queue to Redis.
        self._seq = new_life_seq()  # above any earlier life's under this id
        self._mirror: dict[bytes, bytes | None] = {}  # short key → short parent
        self._on_host: set[bytes] = set()  # mirrored keys on the host tier
        self._pending: deque[BlockEvent] = deque()
        self._need_snapshot = True
        self._seq_at_snapshot = self._seq
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Set by stop(): the loops end on it even if a Redis call swallowed the
        # cancellation (redis-py can turn a cancelled connect into a ConnectionError).
        self._closing = False
        self._redis: ReplicaRedis | None = None
        self._outage = Outage(
            log,
            config.redis_url,
            down_note="serving goes on, retrying with backoff",
            up_note="; re-publishing a fresh snapshot",
        )
        self.stats = PublisherStats(seq=self._seq)

    # ------------------------------------------------------------- engine thread (listener)

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        """``medium``: the tier they are stored in (a demotion or promotion is a
        ``stored`` event in the tier the keys moved to)."""
        if not keys:
            return
        shorts = tuple(short_key(k) for k in keys)
        first_parent = short_key(parent) if parent is not None else None
        with self._lock:
            prev = first_parent
            for k in shorts:
                self._mirror[k] = prev
                prev = k
            if medium == "host":
                self._on_host.update(shorts)
            elif self._on_host:
                self._on_host.difference_update(shorts)
            event = BlockEvent(self._next_seq(), "stored", shorts, first_parent, medium)
            self._enqueue(event)

    def on_removed(self, keys: list[bytes]) -> None:
        if not keys:
            return
        shorts = tuple(short_key(k) for k in keys)
        with self._lock:
            for k in shorts:
                self._mirror.pop(k, None)
                self._on_host.discard(k)
            self._enqueue(BlockEvent(self._next_seq(), "removed", shorts))

    def on_cleared(self) -> None:
        with self._lock:
            self._mirror.clear()
            self._on_host.clear()
            self._enqueue(BlockEvent(self._next_seq(), "cleared"))

    def _next_seq(self) -> int:
        self._seq += 1
        self.stats.seq = self._seq
        return self._seq

    def _enqueue(self, event: BlockEvent) -> None:
        self._pending.append(event)
        if len(self._pending) > self.config.stream_maxlen:
            # Redis has been down a while (nothing is written before the snapshot it
            # owes): keep no more than the capped stream could hold, or the queue grows
            # for as long as the outage lasts. Readers see the gap and resync.
            self._pending.popleft()
            self.stats.events_dropped += 1
            self._need_snapshot = True
        if len(self._pending) == 1 and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------- snapshot (any thread)

    def encoded_snapshot(self) -> tuple[int, bytes]:
        """The mirror as (seq, ``encode_snapshot`` of its blocks, parents before
        children), with no block object made on the way (a cache of 10⁵ blocks: 10⁵
        tuples for the collector otherwise)."""
        with self._lock:
            seq = self._seq
            mirror = dict(self._mirror)
            on_host = set(self._on_host)
        return seq, encode_snapshot(seq, _parents_first(mirror, on_host))

    def cached_keys(self) -> set[bytes]:
        with self._lock:
            return set(self._mirror)

    # ------------------------------------------------------------- asyncio side

    async def start(self, load: Callable[[], ReplicaLoad]) -> None:
        """Begin publishing; ``load`` reports the engine's load for each heartbeat."""
        self._load = load
        self._loop = asyncio.get_running_loop()
        c = self.config
        self._redis = ReplicaRedis(c.redis_url, c.replica_id, c.redis_timeout_s, c.stream_maxlen)
        self._wake.set()
        self._tasks = [
            asyncio.create_task(self._write_loop(), name="publisher-writes"),
            asyncio.create_task(self._heartbeat_loop(), name="publisher-heartbeat"),
        ]

    async def stop(self) -> None:
        """Stop the tasks and deregister (best effort: the expiry covers a failure)."""
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5 * self.config.redis_timeout_s + 1)
        self._tasks = []
        if self._redis is not None:
            await self._redis.deregister()
            await self._redis.aclose()
            self._redis = None

    async def _write_loop(self) -> None:
        backoff = Backoff(self.config.min_backoff_s, self.config.max_backoff_s)
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            while self._has_work() and not self._closing:
                try:
                    await self._write_once()
                    self._mark_up()
                    backoff.reset()
                except REDIS_ERRORS as exc:
                    self._mark_down(exc)
                    await backoff.wait()
                except Exception:
                    # A bug here must not end the loop: the replica would serve on, its
                    # heartbeat alive, while every gateway kept a view it no longer updates.
                    log.exception("writing to Redis failed; a snapshot follows after a backoff")
                    with self._lock:
                        self._need_snapshot = True
                    await backoff.wait()

    def _has_work(self) -> bool:
        with self._lock:
            return self._need_snapshot or bool(self._pending)

    async def _write_once(self) -> None:
        """Write the snapshot if one is due, else the next batch of events."""
        assert self._redis is not None
        with self._lock:
            need_snapshot = self._need_snapshot
        if need_snapshot:
            await self._write_snapshot()
            return
        with self._lock:
            n = min(len(self._pending), self.config.batch_size)
            batch = [self._pending.popleft() for _ in range(n)]
        try:
            await self._redis.write_events(batch)
        except Exception:
            # Lost: readers will see the gap; the next snapshot covers these events.
            with self._lock:
                self.stats.events_dropped += len(batch)
                self._need_snapshot = True
            raise
        self.stats.events_published += len(batch)

    async def _write_snapshot(self) -> None:
        assert self._redis is not None
        # Off the event loop: a 120,000-block cache held the server's loop, and every
        # token stream on it, for about half a second every few seconds.
        seq, raw = await asyncio.to_thread(self.encoded_snapshot)
        await self._redis.write_encoded_snapshot(raw)
        with self._lock:
            self._need_snapshot = False
            self._seq_at_snapshot = seq
            # Queued events stay queued even if the snapshot holds them: a gateway that
            # follows the stream sees a missing event only when a later one arrives, so the
            # last events before a quiet spell (a reset's ``cleared``) would never reach it.
            # A gateway resyncing from this snapshot skips them by their seq.
        self.stats.snapshots_written += 1

    async def _heartbeat_loop(self) -> None:
        last_snapshot = time.monotonic()
        while not self._closing:
            try:
                await self._heartbeat()
                self._mark_up()
            except REDIS_ERRORS as exc:
                self._mark_down(exc)
            except Exception:  # the engine's load callback, say: the record just expires
                log.exception("heartbeat failed; trying again at the next one")
            now = time.monotonic()
            with self._lock:
                behind = self._seq - self._seq_at_snapshot
            # Refresh the snapshot while the events since it are still in the capped stream.
            if behind and (
                now - last_snapshot >= self.config.snapshot_interval_s
                or behind >= self.config.stream_maxlen // 2
            ):
                with self._lock:
                    self._need_snapshot = True
                self._wake.set()
                last_snapshot = now
            await asyncio.sleep(self.config.heartbeat_s)

    async def _heartbeat(self) -> None:
        assert self._redis is not None
        c = self.config
        info = ReplicaInfo(
            replica_id=c.replica_id,
            url=c.url,
            model=c.model,
            block_size=c.block_size,
            load=self._load(),
            timestamp=time.time(),
        )
        snapshot_lost = await self._redis.heartbeat(info, c.info_ttl_s)
        self.stats.heartbeats += 1
        if not snapshot_lost:
            return
        # Redis restarted empty and redis-py reconnected without an error to notice:
        # a gateway starting now needs a snapshot to start from.
        with self._lock:
            self._need_snapshot = True
        self._wake.set()

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self._need_snapshot = True  # whatever we missed, a fresh snapshot repairs
        self.stats.connected = False
        if self._outage.mark_down(exc):
            self.stats.outages += 1

    def _mark_up(self) -> None:
        if self._outage.mark_up():
            self._wake.set()
        self.stats.connected = True


def _parents_first(
    mirror: dict[bytes, bytes | None], on_host: set[bytes]
) -> Iterator[tuple[bytes | None, bytes, Medium]]:
    """Every mirrored block once, each after its parent when the parent is mirrored too."""
    emitted: set[bytes] = set()
    for key, parent in mirror.items():
        if key in emitted:
            continue
        if parent is None or parent in emitted or parent not in mirror:
            # The usual case (a block stored after its parent): no walk.
            emitted.add(key)
            yield parent, key, "host" if on_host and key in on_host else "device"
            continue
        path: list[bytes] = []
        k: bytes | None = key
        # Walk up to the first ancestor already emitted (or outside the cache).
        while k is not None and k in mirror and k not in emitted and k not in path:
            path.append(k)
            k = mirror[k]
        for node in reversed(path):
            emitted.add(node)
            yield mirror[node], node, "host" if node in on_host else "device"
