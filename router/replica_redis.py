"""A replica's writes to Redis in ``router.protocol``'s layout, for the built-in replica's
publisher (``replica/publisher.py``) and the bridge in front of vLLM or SGLang
(``bridge/redis_out.py``): one connection and the four writes, so that both write the
same bytes and gateways need no engine-specific code.

* ``write_snapshot``: the snapshot key; the first write of a life also drops the
  previous life's event stream.
* ``write_events``: a batch of block events appended to the capped stream.
* ``heartbeat``: the registry set and the expiring record, the stream's and snapshot's
  expiry pushed back to ``RETAIN_S`` from now, and whether a snapshot must be written
  again (Redis restarted empty and redis-py reconnected without an error).
* ``deregister``: deletes the record, best effort (its expiry covers a failure).

``new_life_seq`` is where both number a life's events from.

Each write raises one of ``REDIS_ERRORS`` when Redis fails; what to do then (drop the
events, mark a snapshot due, back off) is the caller's: the two callers keep their
events differently. ``Outage`` logs an outage once at its start and once at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.backoff import Backoff
from router.protocol import (
    REPLICAS_SET,
    RETAIN_S,
    BlockEvent,
    ReplicaInfo,
    SnapshotBlock,
    encode_snapshot,
    events_stream_key,
    redacted_url,
    replica_info_key,
    snapshot_key,
)

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# A replica's event stream keeps about this many events (XADD MAXLEN ~, so at least
# this many). Readers need only the events after the snapshot, which the writers
# rewrite every few seconds and whenever half the cap has gone by since the last one,
# so the stream always reaches back to it; a reader that falls further behind sees a
# gap and rebuilds from the snapshot. Each event is ~340 bytes in Redis: at 100,000 a
# busy replica's stream held 32 MiB, 2 GiB for 64 replicas (docs/BENCHMARKS.md).
STREAM_MAXLEN = 10_000


def new_life_seq() -> int:
    """The seq a replica's first event of this life follows: microseconds since the
    epoch. An earlier life under the same id (a crashed replica back before its record
    expired) ended below it unless it wrote more than one event per microsecond, so a
    gateway that followed that life sees a gap and resyncs from this life's snapshot;
    numbered from 1 again, the new events read as old ones and were skipped, and the
    dead life's blocks stayed in the gateway's view."""
    return time.time_ns() // 1000


class ReplicaRedis:
    """One replica's connection to Redis and the writes its layout needs."""

    def __init__(
        self, redis_url: str, replica_id: str, timeout_s: float, stream_maxlen: int
    ) -> None:
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        self.stream_maxlen = stream_maxlen
        self.first_write = True  # no snapshot written yet in this life
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # One immediate retry reconnects a pooled connection gone stale across a Redis
            # restart; beyond that the caller backs off.
            retry=Retry(NoBackoff(), 1),
        )

    async def write_snapshot(self, seq: int, blocks: Sequence[SnapshotBlock]) -> None:
        """``blocks`` (parents before children) as of event ``seq``. Encoded off the
        event loop (~0.3 µs a block: the writer's loop also serves the replica's or the
        bridge's HTTP)."""
        await self.write_encoded_snapshot(
            await asyncio.to_thread(encode_snapshot, seq, list(blocks))
        )

    async def write_encoded_snapshot(self, raw: bytes) -> None:
        """A snapshot as ``encode_snapshot`` makes it."""
        pipe = self._redis.pipeline(transaction=True)
        if self.first_write:
            pipe.delete(events_stream_key(self.replica_id))
        pipe.set(snapshot_key(self.replica_id), raw)
        await pipe.execute()
        self.first_write = False

    async def write_events(
        self, events: Sequence[BlockEvent], extra: Sequence[Mapping[str, str]] = ()
    ) -> None:
        """Append ``events`` to the stream in one round trip; ``extra[i]``, when given,
        adds fields to event i that readers ignore (the bridge's engine timestamp)."""
        stream = events_stream_key(self.replica_id)
        pipe = self._redis.pipeline(transaction=False)
        for i, event in enumerate(events):
            fields = event.encode()
            if i < len(extra):
                fields = {**fields, **extra[i]}
            pipe.xadd(
                stream,
                fields,  # type: ignore[arg-type]
                maxlen=self.stream_maxlen,
                approximate=True,
            )
        await pipe.execute()

    async def heartbeat(self, info: ReplicaInfo, ttl_s: float) -> bool:
        """Register and refresh the record; True when a snapshot must be written again
        (none in Redis although this life wrote one: Redis restarted empty)."""
        # Only a snapshot whose write had returned before this transaction was sent is
        # one Redis must hold: a write racing it may land after its EXISTS, and taking
        # that for a loss wrote every new replica's first snapshot twice.
        wrote_one = not self.first_write
        # One transaction: a gateway never sees the id in the set without its record.
        pipe = self._redis.pipeline(transaction=True)
        pipe.sadd(REPLICAS_SET, self.replica_id)
        pipe.set(replica_info_key(self.replica_id), info.encode(), px=int(ttl_s * 1000))
        # A new snapshot (SET) clears its expiry, which the next heartbeat sets again.
        for key in (snapshot_key(self.replica_id), events_stream_key(self.replica_id)):
            pipe.pexpire(key, int(RETAIN_S * 1000))
        pipe.exists(snapshot_key(self.replica_id))
        *_, has_snapshot = await pipe.execute()
        return wrote_one and not has_snapshot

    async def deregister(self) -> None:
        """Best effort: the record's expiry covers a failure."""
        with contextlib.suppress(*REDIS_ERRORS):
            await asyncio.wait_for(
                self._redis.delete(replica_info_key(self.replica_id)), self.timeout_s
            )

    async def aclose(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            await asyncio.wait_for(self._redis.aclose(), self.timeout_s)


@dataclass(slots=True)
class Outage:
    """Whether Redis is unreachable, logged once when an outage starts and once when it
    ends."""

    log: logging.Logger
    redis_url: str
    down_note: str = "retrying"
    up_note: str = ""
    down: bool = False

    def mark_down(self, exc: BaseException) -> bool:
        """Note a failed write; True when this starts an outage."""
        if self.down:
            return False
        self.down = True
        self.log.warning(
            "redis at %s unreachable (%s); %s", redacted_url(self.redis_url), exc, self.down_note
        )
        return True

    def mark_up(self) -> bool:
        """Note a successful write; True when this ends an outage."""
        if not self.down:
            return False
        self.down = False
        self.log.info("redis at %s is back%s", redacted_url(self.redis_url), self.up_note)
        return True


MIN_BACKOFF_S = 1.0  # BackedOffRedis: the first wait after a failure
MAX_BACKOFF_S = 30.0


@dataclass(slots=True)
class BackedOffRedis:
    """An asyncio Redis client made on first use (``_redis``) and left alone after a
    failure (``_failed``): for a backoff (``Backoff``, from 1 s doubling to 30 s with
    jitter; reset by a success, ``_answered``), its outage logged once (``outage``, which
    a subclass makes with its own notes). A hung Redis (a failover, a partition) would
    otherwise make every caller wait out the 2 s socket timeout and log a warning each.
    The gateway's response affinity and tenant caps are built on it."""

    redis_url: str | None = None
    client: Any = None  # redis.asyncio.Redis, made on first use
    clock: Callable[[], float] = time.monotonic
    down_until: float = 0.0  # Redis is left alone until then (after a failure)
    backoff: Backoff = field(default_factory=lambda: Backoff(MIN_BACKOFF_S, MAX_BACKOFF_S))
    outage: Outage = field(init=False)

    def _redis(self) -> Any:
        """The client; None without Redis, or while it is left alone after a failure."""
        if self.redis_url is None or self.clock() < self.down_until:
            return None
        if self.client is None:
            self.client = aioredis.from_url(self.redis_url, socket_timeout=2.0)
            self._made(self.client)
        return self.client

    def _made(self, client: Any) -> None:
        """A new client (a subclass registers its scripts here)."""

    def _failed(self, exc: Exception) -> None:
        self.outage.mark_down(exc)
        self.down_until = self.clock() + self.backoff.next_delay()

    def _answered(self) -> None:
        self.outage.mark_up()
        self.backoff.reset()

    async def _close_client(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
