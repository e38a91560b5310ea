"""Follows one engine's event sequence into the key translator and the Redis writer.

Live batches arrive in ``seq`` order, which grows by one per batch and restarts at 0
with each engine process:

    seq == expected            apply
    seq >  expected            a gap: replay [expected, seq) from the engine; if the
                               replay is incomplete (or the gap larger than any engine's
                               replay buffer), reset
    seq <  expected            the engine restarted: reset, then replay [0, seq)
    first batch, seq > 0       started late: replay [0, seq); incomplete → reset

After the engine's connection dropped (ZMQ monitor) or its HTTP side stopped answering,
the sequence alone cannot tell a restarted engine whose first batches were lost from
the old one: the engine's replay of our last batch number must then return our last
batch byte for byte, else it is a new engine life (reset, replay from 0).

A reset forgets every key and publishes ``cleared`` (readers drop this replica's view),
so a gap can never leave a stale key behind; the view is rebuilt from what arrives next
(blocks whose parents were lost are not guessed). A batch that cannot be applied at all
(a defect, or engine input no check foresaw) is one warning line and a reset, never the
end of the bridge.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from bridge.events import AllBlocksCleared, BadPayload, BlockRemoved, BlockStored, decode_batch
from bridge.redis_out import RedisWriter
from bridge.translate import KeyTranslator, Update
from bridge.zmq_source import EngineEvents, Message

log = logging.getLogger("prefixgate.bridge")

# vLLM and SGLang keep 10,000 batches for replay by default (buffer_steps): a gap 100
# times larger is not asked for (nor enumerated, when a hostile seq jumps by 2**62).
MAX_REPLAY_BATCHES = 1_000_000


@dataclass(slots=True)
class FollowStats:
    batches: int = 0
    bad_batches: int = 0  # not an EventBatch at all: skipped
    failed_batches: int = 0  # decoded but could not be applied: reset
    skipped_events: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    engine_restarts: int = 0
    resets: int = 0
    last_seq: int | None = None
    lags_s: list[float] = field(default_factory=list)  # engine ts → queued, last 1000


class EventFollower:
    def __init__(
        self,
        source: EngineEvents,
        translator: KeyTranslator,
        writer: RedisWriter,
        replay_timeout_s: float,
    ) -> None:
        self.source = source
        self.translator = translator
        self.writer = writer
        self.replay_timeout_s = replay_timeout_s
        self.expected: int | None = None  # the next engine seq; None: no batch seen yet
        self.engine_was_down = False  # HTTP or ZMQ connection lost since the last batch
        self._last_digest = b""  # SHA-256 of the last batch applied
        self.stats = FollowStats()

    async def follow(self, message: Message) -> None:
        """``handle``, where a failure costs a reset of this replica's view, not the
        bridge: one warning line says what went wrong, the traceback is at debug level."""
        try:
            await self.handle(message)
        except Exception as exc:
            self.stats.failed_batches += 1
            log.warning(
                "engine batch %d could not be applied (%s: %.200s); republishing this "
                "replica from scratch",
                message.seq,
                type(exc).__name__,
                exc,
            )
            log.debug("engine batch %d: traceback", message.seq, exc_info=True)
            self.reset()

    async def handle(self, message: Message) -> None:
        """Fold one live batch in, repairing the sequence before it when needed."""
        if await self.source.take_disconnected():
            self.engine_was_down = True
        seq, expected = message.seq, self.expected
        if expected is None:
            if seq > 0:
                await self._catch_up(0, seq)
        elif seq < expected or (self.engine_was_down and not await self._same_life(expected)):
            log.warning(
                "engine restarted (seq %d, expected %d): forgetting its cache", seq, expected
            )
            self.stats.engine_restarts += 1
            self.reset()
            if seq > 0:
                await self._catch_up(0, seq)
        elif seq > expected:
            self.stats.gaps += 1
            await self._catch_up(expected, seq)
        self.engine_was_down = False
        self._apply(message)

    async def _same_life(self, expected: int) -> bool:
        """After the engine was away: is it the process we followed? Its replay buffer
        holds our last batch, byte for byte, only if so (a new process restarts its
        sequence, and its batch under that number differs)."""
        replayed = await self.source.replay(expected - 1, self.replay_timeout_s)
        last = next((m for m in replayed or () if m.seq == expected - 1), None)
        return last is not None and hashlib.sha256(last.payload).digest() == self._last_digest

    async def _catch_up(self, start: int, live_seq: int) -> None:
        """Replay [start, live_seq) from the engine, or reset when it cannot be had whole."""
        replayed = None
        if live_seq - start <= MAX_REPLAY_BATCHES:
            replayed = await self.source.replay(start, self.replay_timeout_s)
        missing = [m for m in replayed or () if start <= m.seq < live_seq]
        # Whole: one batch per seq, in order (the engine answers in seq order).
        whole = len(missing) == live_seq - start and all(
            m.seq == start + i for i, m in enumerate(missing)
        )
        if replayed is not None and whole:
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
        self.reset()

    def reset(self) -> None:
        self.stats.resets += 1
        self.translator.cleared()
        self.writer.cleared()
        self.writer.need_snapshot = True

    def _apply(self, message: Message) -> None:
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
        removals = Removals()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._publish(self.translator.stored(event), ts, removals)
            elif isinstance(event, BlockRemoved):
                self._publish(self.translator.removed(event), ts, removals)
            elif isinstance(event, AllBlocksCleared):
                self.translator.cleared(event)
                removals.write(self.writer, ts)
                self.writer.cleared(ts)
        removals.write(self.writer, ts)
        lags = self.stats.lags_s
        lags.append(max(0.0, time.time() - ts))
        if len(lags) > 1000:
            del lags[:500]

    def _publish(self, update: Update, ts: float, removals: Removals) -> None:
        removals.add(update.removed, self.writer, ts)
        for chain in update.stored:
            if removals.holds_any(chain.keys):  # removed, then stored again: in that order
                removals.write(self.writer, ts)
            self.writer.stored(chain.parent, chain.keys, ts, chain.medium)


class Removals:
    """One engine batch's removals, published as one event where vLLM sends one per block.

    vLLM evicts a block for each one it fills, and reports each as its own event: a
    decoding engine's stream was half one-key removals, and every gateway paid for each
    entry (about 5 µs to read and fold an event of one block, against 1.5 µs per block in
    a larger one; ``benchmarks/follow_bench.py``). Removals of different keys commute
    with stores, so a batch's removals are held and written as one event when the batch
    ends, before a store of a key among them (removed, then stored again: the order
    matters) and before a clear; at most ``MAX_KEYS`` keys an event."""

    __slots__ = ("held", "keys")
    MAX_KEYS = 1024

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.held: set[bytes] = set()

    def add(self, keys: tuple[bytes, ...], writer: RedisWriter, ts: float) -> None:
        for key in keys:
            if key not in self.held:
                self.held.add(key)
                self.keys.append(key)
                if len(self.keys) >= self.MAX_KEYS:
                    self.write(writer, ts)

    def holds_any(self, keys: tuple[bytes, ...]) -> bool:
        held = self.held
        return bool(held) and any(key in held for key in keys)

    def write(self, writer: RedisWriter, ts: float) -> None:
        if self.keys:
            writer.removed(tuple(self.keys), ts)
            self.keys.clear()
            self.held.clear()
