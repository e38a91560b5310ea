"""Keeps a Router true to Redis: discovery, block events, snapshots, other gateways' hints.

One background task loops: refresh the registry (new replicas join, expired ones leave,
heartbeats update load), rebuild the view of any replica that needs it from its
snapshot, then block on XREAD over every replica's event stream for up to
``poll_interval_s``; a second task applies other gateways' RoutedHints and publishes
ours. Redis is an accelerator: while it is down the router keeps routing on what it
has, the outage is logged once, and the loop reconnects with jittered exponential backoff
(router/backoff.py) and then resyncs every replica (events may have been lost meanwhile).

Redis is shared by every replica and gateway, of whatever version: a registry record,
snapshot, event or hint this gateway cannot read is skipped (counted in ``malformed``,
logged once per replica and kind), never raised out of a loop, which would end it. An
unreadable record reads as no record; an unreadable snapshot as none (the view is
rebuilt from the stream); an unreadable event with a readable seq keeps its place in
the sequence (``Router.skip_event``). A replica whose stream or snapshot key holds
another type (WRONGTYPE, which fails the one XREAD over every stream) is not followed
until it holds the right one; its view keeps what it had. An unexpected error in a loop
is logged with its traceback and the loop goes on after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from router.backoff import Backoff
from router.protocol import (
    REPLICAS_SET,
    ROUTED_CHANNEL,
    BlockEvent,
    ReplicaInfo,
    RoutedHint,
    SnapshotRuns,
    as_text,
    event_seq,
    events_stream_key,
    replica_info_key,
    snapshot_key,
    snapshot_runs,
)
from router.router import Router

log = logging.getLogger(__name__)

_BACKOFF_MAX_S = 5.0  # reconnect delays double from poll_interval_s up to this
_READ_COUNT = 1000
_RESYNC_PAGE = 1000  # stream entries read back per round trip in a resync
_MAX_PENDING_HINTS = 10_000


class RedisSync:
    def __init__(
        self,
        router: Router,
        redis_url: str,
        *,
        gateway_id: str | None = None,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.router = router
        self.redis_url = redis_url
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.poll_interval_s = poll_interval_s
        self._client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._discovered: set[str] = set()  # replicas this sync added (not static ones)
        self._stream_ids: dict[str, str] = {}  # replica -> last stream entry id read
        self._need_resync: set[str] = set()
        # Resynced while the replica had no snapshot (e.g. just after a Redis restart,
        # before the replica rewrote it): resynced again once one appears.
        self._without_snapshot: set[str] = set()
        self._hints: deque[RoutedHint] = deque(maxlen=_MAX_PENDING_HINTS)
        self._hint_ready = asyncio.Event()
        self._down = False
        self._closing = False
        self._keep_missing_until = 0.0  # after an outage: registry records may be gone
        self.resyncs = 0  # snapshot rebuilds done (start, gaps, outages)
        self.reconnects = 0
        self.malformed = 0  # records, snapshots, events and hints skipped as unreadable
        self._reported: set[tuple[str, str]] = set()  # (replica or "", kind) logged
        self._wrong_type: set[str] = set()  # replicas whose keys hold another type
        self._check_types = False
        router.add_routed_hook(self._on_routed)

    # ----------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect and do a first sync if Redis answers; then follow in the background."""
        self._client = aioredis.from_url(self.redis_url, socket_timeout=5.0)
        try:
            await self._refresh()
        except (RedisError, OSError) as exc:
            self._failed(exc)
        self._tasks = [
            asyncio.create_task(self._follow_loop(), name="prefixgate-sync-events"),
            asyncio.create_task(self._hint_loop(), name="prefixgate-sync-hints"),
        ]

    async def aclose(self) -> None:
        # The loops also check ``_closing``: redis-py can turn a cancellation that races
        # its own timeout into a TimeoutError (an OSError), which the loops would retry.
        self._closing = True
        while self._tasks:
            for task in self._tasks:
                task.cancel()
            _done, pending = await asyncio.wait(self._tasks, timeout=1.0)
            self._tasks = list(pending)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._down

    # ----------------------------------------------------------------------- main loop

    async def _follow_loop(self) -> None:
        backoff = self._backoff()
        while not self._closing:
            try:
                if self._check_types:  # a WRONGTYPE reply: find whose key it was
                    self._check_types = False
                    await self._drop_wrong_types()
                if self._down:
                    # A restarted Redis has lost the registry; replicas re-register on
                    # their next heartbeat. Until then a missing record does not mean a
                    # dead replica (set before the first read that could see it missing).
                    self._keep_missing_until = (
                        self.router.clock() + self.router.config.replica_ttl_s
                    )
                    await self._refresh()
                    self._came_back()
                await self._read_events()
                await self._refresh()
                self.router.sweep()
                backoff.reset()
            except (RedisError, OSError) as exc:
                if self._closing:
                    return
                self._failed(exc)
                await backoff.wait()
            except Exception:
                # A bug here must not end the loop: the view would freeze for good.
                log.exception("the registry and event loop failed; resyncing after a backoff")
                self._need_resync.update(self._stream_ids)
                await backoff.wait()

    def _failed(self, exc: RedisError | OSError) -> None:
        if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
            self._check_types = True  # Redis answered: one replica's data, not an outage
        else:
            self._went_down(exc)

    def _went_down(self, exc: BaseException) -> None:
        if not self._down:
            log.warning("Redis unreachable (%s); routing on the local view until it returns", exc)
        self._down = True
        self._need_resync.update(self._stream_ids)

    def _came_back(self) -> None:
        self._down = False
        self.reconnects += 1
        log.info("Redis reachable again; resyncing %d replicas", len(self._stream_ids))

    async def _refresh(self) -> None:
        await self._discover()
        client = self._require_client()
        for replica_id in list(self._without_snapshot):
            if replica_id not in self._stream_ids:
                self._without_snapshot.discard(replica_id)
            elif await client.exists(snapshot_key(replica_id)):
                self._need_resync.add(replica_id)
        for replica_id in list(self._need_resync):
            await self._resync(replica_id)

    # ----------------------------------------------------------------------- registry

    async def _discover(self) -> None:
        client = self._require_client()
        ids = []
        for raw_id in await client.smembers(REPLICAS_SET):  # type: ignore[misc]
            try:
                ids.append(as_text(raw_id))
            except UnicodeDecodeError as exc:  # no replica writes it; nothing to follow
                self._skip("", "registry id", exc)
        ids.sort()
        records = await client.mget([replica_info_key(i) for i in ids]) if ids else []
        alive = set()
        missing = [i for i, raw in zip(ids, records, strict=True) if raw is None]
        if missing:
            await self._forget_gone(missing)
        if self._wrong_type:  # followed again once both keys hold what they should
            self._wrong_type = await self._with_wrong_types(sorted(self._wrong_type))
        for replica_id, raw in zip(ids, records, strict=True):
            if raw is None:
                continue
            try:
                info = ReplicaInfo.decode(raw)
            except ValueError as exc:
                self._skip(replica_id, "registry record", exc)  # read as absent
                continue
            self._reported.discard((replica_id, "registry record"))
            alive.add(replica_id)
            self.router.add_replica(
                replica_id,
                info.url,
                info.model,
                info.block_size,
                data_parallel_rank=info.data_parallel_rank,
            )
            self.router.update_load(replica_id, info.load, info.timestamp or None)
            if replica_id not in self._stream_ids and replica_id not in self._wrong_type:
                self._stream_ids[replica_id] = "0-0"
                self._need_resync.add(replica_id)
            if not self.router.replicas[replica_id].static:
                self._discovered.add(replica_id)
        if self.router.clock() < self._keep_missing_until:
            return
        for replica_id in [*self._stream_ids, *self._wrong_type]:
            if replica_id in alive:
                continue
            # Its heartbeat expired: stop following; a discovered replica leaves entirely.
            self._stream_ids.pop(replica_id, None)
            self._wrong_type.discard(replica_id)
            self._need_resync.discard(replica_id)
            if replica_id in self._discovered:
                self._discovered.discard(replica_id)
                self.router.remove_replica(replica_id)
                log.info("replica %s left (registry record expired)", replica_id)

    async def _forget_gone(self, replica_ids: list[str]) -> None:
        """Take out of the registry set the replicas with no record whose snapshot has
        expired too (``RETAIN_S`` after their last heartbeat): gone for good, they
        would otherwise be read at every poll forever. A live one adds itself again at
        its next heartbeat."""
        pipe = self._require_client().pipeline(transaction=False)
        for replica_id in replica_ids:
            pipe.exists(snapshot_key(replica_id))
        gone = [r for r, kept in zip(replica_ids, await pipe.execute(), strict=True) if not kept]
        if gone:
            await self._require_client().srem(REPLICAS_SET, *gone)  # type: ignore[misc]
            log.info("forgot %d replica ids that left nothing in Redis", len(gone))

    async def _with_wrong_types(self, replica_ids: list[str]) -> set[str]:
        """Those of ``replica_ids`` whose stream or snapshot key holds another type."""
        pipe = self._require_client().pipeline(transaction=False)
        for replica_id in replica_ids:
            pipe.type(events_stream_key(replica_id))
            pipe.type(snapshot_key(replica_id))
        types = [as_text(t) for t in await pipe.execute()]
        return {
            replica_id
            for replica_id, stream, snapshot in zip(
                replica_ids, types[::2], types[1::2], strict=True
            )
            if stream not in ("stream", "none") or snapshot not in ("string", "none")
        }

    async def _drop_wrong_types(self) -> None:
        """Stop following the replicas whose keys hold another type (a WRONGTYPE reply)."""
        wrong = await self._with_wrong_types(sorted(self._stream_ids))
        if not wrong:  # another key (the registry set?): retried after each backoff
            self._skip("", "key of another type", ValueError("not a replica's stream or snapshot"))
        for replica_id in wrong:
            self._skip(replica_id, "stream or snapshot key", ValueError("another type"))
            del self._stream_ids[replica_id]
            self._need_resync.discard(replica_id)
        self._wrong_type |= wrong

    # ----------------------------------------------------------------------- events

    async def _resync(self, replica_id: str) -> None:
        """Rebuild the replica's view from its snapshot and the stream's events after it.

        The snapshot and the stream's newest events are read in one transaction. The
        stream is read back from its end only as far as the snapshot's seq (older pages,
        which no writer changes, after the transaction): a capped stream holds 10,000
        events or more (100,000 before, whose parsing alone took seconds of the event
        loop), while a snapshot is at most a few seconds and a few hundred events old.

        The snapshot goes in a run of blocks at a time (``Router.snapshot_steps``), the
        loop serving others between runs: in one go, a 250,000-block snapshot (a host
        tier's) held every token stream of the gateway for 0.7 s. Meanwhile the view
        holds part of the snapshot, and routing may miss some of the replica's blocks.
        The events after it go in with the last run: nothing else folds events in (this
        task does), and no route sees the snapshot's older state whole in place of them
        (after a prefix cache reset: the cleared blocks back)."""
        client = self._require_client()
        stream = events_stream_key(replica_id)
        pipe = client.pipeline(transaction=True)
        pipe.get(snapshot_key(replica_id))
        pipe.xrevrange(stream, count=_RESYNC_PAGE)
        raw, page = await pipe.execute()
        snapshot = None
        if raw is not None:
            try:
                snapshot = snapshot_runs(raw)
            except ValueError as exc:
                self._skip(replica_id, "snapshot", exc)
        entries = list(page)  # newest first
        while len(page) == _RESYNC_PAGE and not _at_or_before(page[-1], snapshot):
            before = f"({as_text(page[-1][0])}"  # exclusive: the entries older than the page's
            page = await client.xrevrange(stream, max=before, count=_RESYNC_PAGE) or []
            entries += page
        entries.reverse()
        if snapshot is not None:
            for _ in self.router.snapshot_steps(replica_id, snapshot.seq, snapshot.runs):
                await asyncio.sleep(0)  # the loop serves others between runs
            self._without_snapshot.discard(replica_id)
        else:
            self.router.reset_replica_view(replica_id)
            # None yet: resynced again once one appears. An unreadable one is not
            # retried until the next gap or outage (every poll would read it again).
            if raw is None:
                self._without_snapshot.add(replica_id)
            else:
                self._without_snapshot.discard(replica_id)
        self._need_resync.discard(replica_id)
        self._stream_ids[replica_id] = "0-0"
        self._apply_entries(replica_id, entries)  # those the snapshot holds: skipped by seq
        self.resyncs += 1

    async def _read_events(self) -> None:
        if not self._stream_ids:
            await asyncio.sleep(self.poll_interval_s)  # nothing to follow: poll the registry
            return
        streams = {events_stream_key(rid): sid for rid, sid in self._stream_ids.items()}
        block_ms = max(1, int(self.poll_interval_s * 1000))
        client = self._require_client()
        reply: Any = await client.xread(streams, count=_READ_COUNT, block=block_ms)  # type: ignore[arg-type]
        by_stream = {events_stream_key(rid): rid for rid in self._stream_ids}
        for stream, entries in reply or []:
            replica_id = by_stream.get(as_text(stream))
            if replica_id is not None:
                self._apply_entries(replica_id, entries)

    def _apply_entries(self, replica_id: str, entries: Any) -> None:
        """Fold in stream entries in order until a sequence gap (then a resync is due)."""
        for entry_id, fields in entries:
            self._stream_ids[replica_id] = as_text(entry_id)
            if replica_id in self._need_resync:
                break
            try:
                event = BlockEvent.decode(fields)
            except ValueError as exc:
                self._skip(replica_id, "block event", exc)
                seq = event_seq(fields)
                if seq is not None and not self.router.skip_event(replica_id, seq):
                    self._need_resync.add(replica_id)
                continue  # without a seq: the next event shows the gap, if there is one
            if not self.router.apply_event(replica_id, event):
                self._need_resync.add(replica_id)

    def _skip(self, replica_id: str, kind: str, exc: ValueError) -> None:
        """Count an unreadable item; log the first of each kind per replica."""
        self.malformed += 1
        if (replica_id, kind) not in self._reported:
            self._reported.add((replica_id, kind))
            where = f" from replica {replica_id}" if replica_id else ""
            log.warning("skipping an unreadable %s%s (%s)", kind, where, exc)

    # ----------------------------------------------------------------------- hints

    def _on_routed(self, replica_id: str, keys: list[bytes]) -> None:
        if keys:
            seq = self.router.last_seq(replica_id)
            self._hints.append(RoutedHint(self.gateway_id, replica_id, tuple(keys), seq))
            self._hint_ready.set()

    async def _hint_loop(self) -> None:
        backoff = self._backoff()
        while not self._closing:
            pubsub = self._require_client().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(ROUTED_CHANNEL)
                while not self._closing:
                    await self._publish_hints()
                    message = await pubsub.get_message(timeout=self.poll_interval_s)
                    if message is not None and message.get("type") == "message":
                        self._apply_hint(message["data"])
                    backoff.reset()
            except (RedisError, OSError):
                await backoff.wait()
            except Exception:
                log.exception("the routed-hint loop failed; going on after a backoff")
                await backoff.wait()
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _publish_hints(self) -> None:
        client = self._require_client()
        while self._hints:
            hint = self._hints[0]
            await client.publish(ROUTED_CHANNEL, hint.encode())
            self._hints.popleft()

    def _apply_hint(self, raw: Any) -> None:
        try:
            hint = RoutedHint.decode(raw)
        except ValueError as exc:
            self._skip("", "routed hint", exc)
            return
        if hint.gateway_id != self.gateway_id:
            self.router.apply_hint(hint)

    def _backoff(self) -> Backoff:
        return Backoff(self.poll_interval_s, max(self.poll_interval_s, _BACKOFF_MAX_S))

    def _require_client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("RedisSync.start() was not called")
        return self._client


def _at_or_before(entry: tuple[Any, Any], snapshot: SnapshotRuns | None) -> bool:
    """Whether a stream entry is one the snapshot already holds (by its seq; never
    without a snapshot, or for an entry whose seq is unreadable)."""
    if snapshot is None:
        return False
    seq = event_seq(entry[1])
    return seq is not None and seq <= snapshot.seq
