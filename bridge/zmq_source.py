"""The engine's ZMQ event sockets: the live PUB stream and the replay ROUTER.

Live: a SUB socket receiving ``[topic, seq (8-byte big-endian), payload]``. Who binds
follows vLLM's own rule for its PUB endpoint: an address with a wildcard (``tcp://*:5557``)
binds, a concrete one (``tcp://engine:5557``) connects. So the bridge's ``--kv-events``
mirrors the engine's: an engine that binds ``tcp://*:5557`` is reached with
``tcp://ENGINE_HOST:5557``, and an engine configured to connect to
``tcp://BRIDGE_HOST:5557`` needs the bridge to bind ``tcp://*:5557``. ZMQ reconnects on
its own either way, across engine restarts.

Replay: the engine's ROUTER keeps its last batches; a request is ``[b"", start_seq]``
(sent from a DEALER, so one request may take many replies), and the answer is every
buffered batch with ``seq >= start_seq`` as ``[b"", seq, payload]``, then ``[b"", -1, b""]``.
A fresh DEALER per request, closed after it, so a late answer to a request that timed out
can never be read as the answer to the next.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import zmq
import zmq.asyncio

from bridge.events import BadPayload, decode_seq, encode_seq

END_SEQ = -1


class Message(NamedTuple):
    seq: int
    payload: bytes


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, an IPv6 any-address, ipc:// or inproc:// binds."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def rank_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint data-parallel rank ``data_parallel_rank`` of an engine publishes on,
    given the one in the engine's ``--kv-events-config``, by vLLM's rule: each rank offsets
    a TCP port by its rank (a port of 0 stays 0) and suffixes any other address with
    ``_dp{rank}``; rank 0 uses the endpoint as given. The bridge takes the engine's
    endpoint and applies the same rule, so both sides agree on every rank."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"{endpoint!r}: a tcp:// endpoint needs a port")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _live_message(frames: list[bytes]) -> Message | None:
    """``[topic, seq, payload]`` with a seq an engine can send (from 0 up; the negative
    ones a signed decoding gives are never sent, -1 only ends a replay)."""
    if len(frames) != 3:
        return None
    try:
        seq = decode_seq(frames[1])
    except BadPayload:
        return None
    return Message(seq, frames[2]) if seq >= 0 else None


class EngineEvents:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.setsockopt(zmq.LINGER, 0)
        # Connection events tell a possible engine restart apart from a quiet engine.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if binds(endpoint):
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self.malformed = 0  # messages that were not [topic, seq, payload]
        self.disconnects = 0

    def bind_also(self, endpoint: str) -> None:
        """Listen on ``endpoint`` as well: for an engine that connects to an address the
        bridge was told to connect to too (bridge/event_sources.py). Raises ZMQError."""
        self._sub.bind(endpoint)

    def subscribe_also(self, topic: str) -> None:
        """Receive ``topic``'s messages as well (the engine's, when it differs)."""
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))

    async def take_disconnected(self) -> bool:
        """Whether the engine's connection dropped since the last call (it may have
        restarted; ZMQ reconnects on its own, silently)."""
        dropped = False
        while await self._monitor.poll(0):
            await self._monitor.recv_multipart()
            dropped = True
            self.disconnects += 1
        return dropped

    async def recv(self, timeout_s: float) -> Message | None:
        """The next live message, or None when none arrived within ``timeout_s``."""
        while True:
            if not await self._sub.poll(int(timeout_s * 1000)):
                return None
            message = _live_message(await self._sub.recv_multipart())
            if message is not None:
                return message
            self.malformed += 1

    async def replay(self, start_seq: int, timeout_s: float) -> list[Message] | None:
        """Every batch the engine still buffers from ``start_seq`` on, in order; None when
        there is no replay endpoint, or it did not answer completely within ``timeout_s``."""
        if self.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", encode_seq(start_seq)])
            out: list[Message] = []
            while True:
                if not await dealer.poll(int(timeout_s * 1000)):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    return None
                seq = decode_seq(frames[1])
                if seq == END_SEQ:
                    return out
                out.append(Message(seq, frames[2]))
        except (zmq.ZMQError, BadPayload):
            return None
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disable_monitor()
        self._ctx.destroy(linger=0)  # closes every socket, then terminates
