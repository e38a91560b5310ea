"""The bridge: one engine's KV-cache events → a prefixgate replica in Redis.

Three tasks on one event loop:

* **events**: live batches from the engine's PUB socket, in ``seq`` order, through the
  key translator into the Redis writer's queue. Sequence rules (``seq`` grows by one
  per batch and restarts at 0 with the engine):

      seq == expected            apply
      seq >  expected            a gap: replay [expected, seq) from the engine; if the
                                 replay is incomplete, reset
      seq <  expected            the engine restarted: reset, then replay [0, seq)
      first batch, seq > 0       started late: replay [0, seq); incomplete → reset

  After the engine's connection dropped (ZMQ monitor) or its HTTP side stopped
  answering, the sequence alone cannot tell a restarted engine whose first batches were
  lost from the old one: the engine's replay of our last batch number must then return
  our last batch byte for byte, else it is a new engine life (reset, replay from 0).

  A reset forgets every key and publishes ``cleared`` (readers drop this replica's
  view), so a gap can never leave a stale key behind; the view is rebuilt from what
  arrives next (blocks whose parents were lost are not guessed).
* **writes**: the Redis writer's queue (snapshot first when one is due), with jittered
  backoff while Redis is down.
* **heartbeat**: the engine's ``/metrics`` → load → registry record. No heartbeat while
  the engine does not answer, so its record expires and gateways stop routing to it.

At start the bridge compares the gateway's tokenizer with the engine's ``/tokenize``
(bridge/tokenizer_check.py) and logs loudly on a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from bridge.engine_load import parse_load
from bridge.events import AllBlocksCleared, BadPayload, BlockRemoved, BlockStored, decode_batch
from bridge.redis_out import REDIS_ERRORS, RedisWriter, WriterConfig
from bridge.translate import KeyTranslator
from bridge.zmq_source import EngineEvents, Message
from router.backoff import Backoff
from router.protocol import DEFAULT_BLOCK_SIZE

log = logging.getLogger("prefixgate.bridge")


@dataclass(slots=True)
class BridgeConfig:
    engine_url: str
    kv_events: str
    redis_url: str
    replay: str | None = None
    topic: str = ""
    model: str | None = None  # the served model name; None: the engine's first /v1/models
    replica_id: str | None = None  # None: host:port of the advertised URL
    advertise_url: str | None = None  # None: the engine URL
    block_size: int = DEFAULT_BLOCK_SIZE
    tokenizer: str | None = None  # for the parity check; None: the model name
    check_tokenizer: bool = True
    heartbeat_s: float = 1.0
    info_ttl_s: float = 5.0
    snapshot_interval_s: float = 5.0
    replay_timeout_s: float = 2.0
    http_timeout_s: float = 2.0

    @property
    def url(self) -> str:
        return (self.advertise_url or self.engine_url).rstrip("/")

    @property
    def resolved_replica_id(self) -> str:
        return self.replica_id or urlsplit(self.url).netloc or self.url


@dataclass(slots=True)
class BridgeStats:
    batches: int = 0
    bad_batches: int = 0
    skipped_events: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    engine_restarts: int = 0
    resets: int = 0
    tokenizer_ok: bool | None = None  # None: not checked (yet)
    engine_up: bool = False
    last_seq: int | None = None
    lags_s: list[float] = field(default_factory=list)  # engine ts → queued, last 1000


class Bridge:
    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        # Subscribed at once, so batches sent while the model name is resolved queue up.
        self.source = EngineEvents(config.kv_events, config.replay, config.topic)
        self.translator: KeyTranslator | None = None
        self.writer: RedisWriter | None = None
        self.expected: int | None = None  # the next engine seq; None: no batch seen yet
        self._engine_was_down = False  # HTTP or ZMQ connection lost since the last batch
        self._last_digest = b""  # SHA-256 of the last batch applied
        self._wake = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._http = httpx.AsyncClient(timeout=config.http_timeout_s)
        self.stats = BridgeStats()

    # ----------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        model = self.config.model or await self._wait_for_model()
        self.config.model = model
        self.translator = KeyTranslator(model, self.config.block_size)
        c = self.config
        self.writer = RedisWriter(
            WriterConfig(
                c.redis_url, c.resolved_replica_id, c.url, model, c.block_size, c.info_ttl_s
            ),
            self.translator.snapshot,
        )
        log.info(
            "bridging engine %s (model %s, events %s) as replica %s into %s",
            c.engine_url,
            model,
            c.kv_events,
            c.resolved_replica_id,
            c.redis_url,
        )
        self._tasks = [
            asyncio.create_task(self._events_loop(), name="bridge-events"),
            asyncio.create_task(self._write_loop(), name="bridge-writes"),
            asyncio.create_task(self._heartbeat_loop(), name="bridge-heartbeat"),
        ]
        if c.check_tokenizer:
            self._tasks.append(asyncio.create_task(self._check_tokenizer(), name="bridge-tok"))

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        self._tasks = []
        if self.writer is not None:
            await self.writer.deregister()
            await self.writer.aclose()
        await self._http.aclose()
        self.source.close()

    async def _wait_for_model(self) -> str:
        """The engine's served model name, waiting for the engine to come up (minutes)."""
        backoff = Backoff(0.5, 5.0)
        started = time.monotonic()
        next_note = started
        while True:
            try:
                reply = await self._http.get(f"{self.config.engine_url.rstrip('/')}/v1/models")
                reply.raise_for_status()
                return str(reply.json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                if time.monotonic() >= next_note:
                    waited = time.monotonic() - started
                    log.info(
                        "waiting for engine %s (%.0f s): %s", self.config.engine_url, waited, exc
                    )
                    next_note += 30.0
                await backoff.wait()

    # ----------------------------------------------------------------------- events

    async def _events_loop(self) -> None:
        while not self._closing:
            message = await self.source.recv(timeout_s=0.5)
            if message is None:
                continue
            try:
                await self.handle(message)
            except Exception:  # one bad batch must not stop the bridge
                log.exception("engine batch %d could not be applied; resetting", message.seq)
                self._reset()
            self._wake.set()

    async def handle(self, message: Message) -> None:
        """Fold one live batch in, repairing the sequence before it when needed."""
        if await self.source.take_disconnected():
            self._engine_was_down = True
        seq, expected = message.seq, self.expected
        if expected is None:
            if seq > 0:
                await self._catch_up(0, seq)
        elif seq < expected or (self._engine_was_down and not await self._same_life(expected)):
            log.warning(
                "engine restarted (seq %d, expected %d): forgetting its cache", seq, expected
            )
            self.stats.engine_restarts += 1
            self._reset()
            if seq > 0:
                await self._catch_up(0, seq)
        elif seq > expected:
            self.stats.gaps += 1
            await self._catch_up(expected, seq)
        self._engine_was_down = False
        self._apply(message)

    async def _same_life(self, expected: int) -> bool:
        """After the engine was away: is it the process we followed? Its replay buffer
        holds our last batch, byte for byte, only if so (a new process restarts its
        sequence, and its batch under that number differs)."""
        replayed = await self.source.replay(expected - 1, self.config.replay_timeout_s)
        last = next((m for m in replayed or () if m.seq == expected - 1), None)
        return last is not None and hashlib.sha256(last.payload).digest() == self._last_digest

    async def _catch_up(self, start: int, live_seq: int) -> None:
        """Replay [start, live_seq) from the engine, or reset when it cannot be had whole."""
        replayed = await self.source.replay(start, self.config.replay_timeout_s)
        missing = [m for m in replayed or () if start <= m.seq < live_seq]
        if replayed is not None and [m.seq for m in missing] == list(range(start, live_seq)):
            self.stats.replays_ok += 1
            for m in missing:
                self._apply(m)
            return
        self.stats.replays_failed += 1
        log.warning(
            "events %d..%d missed and not replayable; republishing this replica from scratch",
            start,
            live_seq - 1,
        )
        self._reset()

    def _reset(self) -> None:
        assert self.translator is not None and self.writer is not None
        self.stats.resets += 1
        self.translator.cleared()
        self.writer.cleared()
        self.writer.need_snapshot = True

    def _apply(self, message: Message) -> None:
        assert self.translator is not None and self.writer is not None
        self.expected = message.seq + 1
        self._last_digest = hashlib.sha256(message.payload).digest()
        self.stats.last_seq = message.seq
        self.stats.batches += 1
        try:
            batch = decode_batch(message.payload)
        except BadPayload as exc:
            self.stats.bad_batches += 1
            log.warning("engine batch %d is not an EventBatch (%s); skipped", message.seq, exc)
            return
        self.stats.skipped_events += batch.skipped
        ts = batch.ts
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored = self.translator.stored(event)
                self.writer.stored(stored.parent, stored.keys, ts)
            elif isinstance(event, BlockRemoved):
                self.writer.removed(self.translator.removed(event), ts)
            elif isinstance(event, AllBlocksCleared):
                self.translator.cleared(event)
                self.writer.cleared(ts)
        lags = self.stats.lags_s
        lags.append(max(0.0, time.time() - ts))
        if len(lags) > 1000:
            del lags[:500]

    # ----------------------------------------------------------------------- Redis

    async def _write_loop(self) -> None:
        assert self.writer is not None
        backoff = Backoff(0.1, 2.0)
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            while self.writer.has_work and not self._closing:
                try:
                    await self.writer.flush()
                    backoff.reset()
                except REDIS_ERRORS:
                    await backoff.wait()

    async def _heartbeat_loop(self) -> None:
        assert self.writer is not None
        last_snapshot = time.monotonic()
        metrics_url = f"{self.config.engine_url.rstrip('/')}/metrics"
        while not self._closing:
            try:
                reply = await self._http.get(metrics_url)
                reply.raise_for_status()
                load = parse_load(reply.text, self.config.block_size)
            except (httpx.HTTPError, ValueError) as exc:
                if self.stats.engine_up:
                    log.warning("engine %s not answering (%s); not heartbeating", metrics_url, exc)
                self.stats.engine_up = False
                self._engine_was_down = True
            else:
                if not self.stats.engine_up:
                    log.info("engine %s answers; heartbeating", self.config.engine_url)
                self.stats.engine_up = True
                with contextlib.suppress(*REDIS_ERRORS):
                    await self.writer.heartbeat(load)
            now = time.monotonic()
            # Refresh the snapshot while the events since it are still in the capped stream.
            if self.writer.behind and now - last_snapshot >= self.config.snapshot_interval_s:
                self.writer.need_snapshot = True
                last_snapshot = now
            if self.writer.has_work:
                self._wake.set()
            await asyncio.sleep(self.config.heartbeat_s)  # the heartbeat period

    # ----------------------------------------------------------------------- tokenizer

    async def _check_tokenizer(self) -> None:
        from bridge.tokenizer_check import check, load_tokenizer, report

        source = self.config.tokenizer or self.config.model
        assert source is not None
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source)
            await self._wait_for_model()  # the engine may still be starting (minutes)
            results = await check(self.config.engine_url, tokenizer, self.config.model)
        except Exception as exc:  # a failed check must not stop the bridge
            log.warning("tokenizer parity with the engine not checked (%s)", exc)
            return
        self.stats.tokenizer_ok = all(r.ok for r in results)
        if self.stats.tokenizer_ok:
            log.info(
                "tokenizer parity with the engine: %d/%d chats identical",
                len(results),
                len(results),
            )
        else:
            log.error(
                "TOKENIZER MISMATCH between the gateway (%s) and engine %s: the gateway's keys "
                "will not match this engine's cache, and routing falls back to optimistic "
                "guesses.\n%s",
                source,
                self.config.engine_url,
                report(results),
            )
