"""Writes an engine's cache, as prefixgate keys, into Redis in the built-in replica's layout.

The same three things ``replica/publisher.py`` writes (layout and codecs:
``router.protocol``), so gateways need no engine-specific code:

* the registry record, refreshed each heartbeat with an expiry, its URL the engine's;
* block events in the replica's capped stream, ``seq`` growing by one per event, each
  ``stored`` event in the tier its keys are in now;
* a snapshot whose ``seq`` is the last event folded into it, with each block's tier.

Everything runs on one event loop: the bridge calls ``stored`` / ``removed`` /
``cleared`` and the snapshot source from the same loop, so a snapshot and its ``seq``
always agree without a lock.

``seq`` starts at the current time in microseconds, not at 1: a restarted bridge's
events then come after its previous life's in every reader's eyes (a reader still at
the old ``seq`` sees a gap and resyncs from the fresh snapshot), instead of being taken
for events it already folded in. The first snapshot of a life also drops the previous
life's stream. Redis is an accelerator: while it is down events are dropped (readers see
the gap) and a fresh snapshot is written once it answers again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from router.protocol import BlockEvent, Medium, ReplicaInfo, ReplicaLoad, SnapshotBlock
from router.replica_redis import (
    REDIS_ERRORS,
    STREAM_MAXLEN,
    Outage,
    ReplicaRedis,
    new_life_seq,
)

log = logging.getLogger("prefixgate.bridge.redis")


class Pending(NamedTuple):
    event: BlockEvent
    engine_ts: float | None  # when the engine emitted the batch behind it (lag measurement)


@dataclass(slots=True)
class WriterConfig:
    redis_url: str
    replica_id: str
    url: str  # what gateways call: the engine's OpenAI server
    model: str
    block_size: int
    info_ttl_s: float = 5.0
    stream_maxlen: int = STREAM_MAXLEN
    batch_size: int = 512
    redis_timeout_s: float = 1.0
    data_parallel_rank: int | None = None  # ReplicaInfo.data_parallel_rank


@dataclass(slots=True)
class WriterStats:
    events_published: int = 0
    events_dropped: int = 0
    snapshots_written: int = 0
    heartbeats: int = 0
    outages: int = 0


class RedisWriter:
    def __init__(self, config: WriterConfig, snapshot: Callable[[], list[SnapshotBlock]]) -> None:
        self.config = config
        self._snapshot = snapshot  # the translator's mirror, parents before children
        self.seq = new_life_seq()  # above any earlier life's under this id
        self.seq_at_snapshot = self.seq
        self.pending: deque[Pending] = deque()
        self.need_snapshot = True
        self.stats = WriterStats()
        self._outage = Outage(log, config.redis_url)
        self._redis = ReplicaRedis(
            config.redis_url, config.replica_id, config.redis_timeout_s, config.stream_maxlen
        )

    # ------------------------------------------------------------------ events (same loop)

    def stored(
        self,
        parent: bytes | None,
        keys: tuple[bytes, ...],
        engine_ts: float | None = None,
        medium: Medium = "device",
    ) -> None:
        """``keys`` are now held in ``medium`` (stored there, or moved there)."""
        if keys:
            self._enqueue(BlockEvent(self.seq + 1, "stored", keys, parent, medium), engine_ts)

    def removed(self, keys: tuple[bytes, ...], engine_ts: float | None = None) -> None:
        """``keys`` are held in no tier any more."""
        if keys:
            self._enqueue(BlockEvent(self.seq + 1, "removed", keys), engine_ts)

    def cleared(self, engine_ts: float | None = None) -> None:
        self._enqueue(BlockEvent(self.seq + 1, "cleared"), engine_ts)

    def _enqueue(self, event: BlockEvent, engine_ts: float | None) -> None:
        self.seq = event.seq
        self.pending.append(Pending(event, engine_ts))
        if len(self.pending) > self.config.stream_maxlen:
            # Redis has been down a while (``flush`` owes a snapshot first and writes
            # nothing): keep no more than the capped stream could hold, or the queue grows
            # for as long as the outage lasts. Readers see the gap and resync.
            self.pending.popleft()
            self.stats.events_dropped += 1
            self.need_snapshot = True

    @property
    def has_work(self) -> bool:
        return self.need_snapshot or bool(self.pending)

    @property
    def behind(self) -> int:
        """Events since the last snapshot."""
        return self.seq - self.seq_at_snapshot

    # ------------------------------------------------------------------ writes

    async def flush(self) -> None:
        """Write the snapshot if one is due, then every pending event; raises what
        failed (a Redis error, or a bug) after marking a snapshot due.

        Events the snapshot already holds are still written: a reader that saw no gap
        applies them directly (it would not look at the snapshot), and one that resynced
        skips them by their ``seq``."""
        try:
            if self.need_snapshot:
                await self._write_snapshot()
            while self.pending:
                await self._write_events()
        except REDIS_ERRORS as exc:
            self._mark_down(exc)
            raise
        except Exception:
            self.need_snapshot = True  # whatever went wrong, the snapshot repairs it
            raise
        self._outage.mark_up()

    async def _write_snapshot(self) -> None:
        seq, blocks = self.seq, self._snapshot()  # taken together: no await in between
        await self._redis.write_snapshot(seq, blocks)
        self.need_snapshot = False
        self.seq_at_snapshot = seq
        self.stats.snapshots_written += 1

    async def _write_events(self) -> None:
        n = min(len(self.pending), self.config.batch_size)
        batch = [self.pending.popleft() for _ in range(n)]
        # Readers ignore engine_ts; benchmarks measure the bridge's lag with it.
        extra = [{} if ts is None else {"engine_ts": repr(ts)} for _event, ts in batch]
        try:
            await self._redis.write_events([event for event, _ts in batch], extra)
        except Exception:
            self.stats.events_dropped += len(batch)  # readers see the gap; the snapshot repairs
            raise
        self.stats.events_published += len(batch)

    async def heartbeat(self, load: ReplicaLoad) -> None:
        c = self.config
        info = ReplicaInfo(
            c.replica_id,
            c.url,
            c.model,
            c.block_size,
            load,
            time.time(),
            data_parallel_rank=c.data_parallel_rank,
        )
        try:
            snapshot_lost = await self._redis.heartbeat(info, c.info_ttl_s)
        except REDIS_ERRORS as exc:
            self._mark_down(exc)
            raise
        self._outage.mark_up()
        self.stats.heartbeats += 1
        if snapshot_lost:  # Redis restarted empty: late readers need a snapshot to start from
            self.need_snapshot = True

    async def deregister(self) -> None:
        """Best effort: the record's expiry covers a failure."""
        await self._redis.deregister()

    async def aclose(self) -> None:
        await self._redis.aclose()

    def _mark_down(self, exc: BaseException) -> None:
        self.need_snapshot = True  # whatever was lost, a fresh snapshot repairs
        if self._outage.mark_down(exc):
            self.stats.outages += 1
