"""A fake vLLM engine for the bridge's tests: real ZMQ sockets, real msgpack, vLLM's format.

The event side works as vLLM's ``ZmqEventPublisher``: a PUB socket that binds on a
wildcard address and connects otherwise, sending ``[topic, seq (8-byte big-endian),
msgpack(EventBatch)]`` with ``seq`` counting batches from 0; a ROUTER socket that answers
``[b"", start_seq]`` with every buffered batch from ``start_seq`` on and then seq -1. Both
sockets live in one thread, as in vLLM, fed through a queue.

The engine's cache is modelled just enough to emit what vLLM would: a request's prompt is
cut into ``block_size`` blocks, each hashed from its parent's hash and its tokens, and
``store`` emits BlockStored for the blocks not cached yet (chained to the longest cached
prefix). ``drop`` emits BlockRemoved, ``clear`` AllBlocksCleared.

The HTTP side (``FakeEngineHTTP``) serves ``/health``, ``/v1/models``, ``/metrics`` and
``/tokenize`` from a real HTTP server in a thread.
"""

from __future__ import annotations

import hashlib
import json
import queue
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def engine_hash(parent: bytes | None, tokens: list[int], salt: str) -> bytes:
    h = hashlib.sha256(parent or salt.encode())
    h.update(json.dumps(tokens).encode())
    return h.digest()


class FakeEngine:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        block_size: int = 16,
        *,
        array_like_events: bool = False,
        int_hashes: bool = False,
        topic: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.array_like_events = array_like_events
        self.int_hashes = int_hashes
        self.topic = topic.encode()
        self.cached: dict[Any, list[int]] = {}  # engine hash -> the block's tokens
        self._ctx = zmq.Context()
        # (payload, send, keep for replay, seq): batches in order for the socket thread.
        self._queue: queue.Queue[tuple[bytes, bool, bool, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.seq = 0
        self.sent = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start a fresh engine life: sequence from 0, empty replay buffer."""
        self.seq = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError(f"the fake engine's sockets did not come up on {self.endpoint}")

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)
            self._thread = None

    def restart(self) -> None:
        """A new engine process: empty cache, sequence from 0."""
        self.stop()
        self.cached.clear()
        self.start()

    def close(self) -> None:
        self.stop()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        if "*" in self.endpoint:
            bind_again(pub, self.endpoint)
        else:
            pub.connect(self.endpoint)
        router = None
        if self.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            bind_again(router, self.replay_endpoint)
        buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self._ready.set()
        try:
            while True:
                if router is not None and router.poll(0):
                    client, _, start = router.recv_multipart()
                    first = int.from_bytes(start, "big")
                    for s, payload in buffer:
                        if s >= first:
                            router.send_multipart([client, b"", s.to_bytes(8, "big"), payload])
                    router.send_multipart([client, b"", END_SEQ, b""])
                try:
                    item = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if item is None:
                    return
                payload, send, keep, seq = item
                if send:
                    pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                    self.sent += 1
                if keep:
                    buffer.append((seq, payload))
        finally:
            pub.close(0)
            if router is not None:
                router.close(0)

    # ------------------------------------------------------------------ events

    def publish(self, events: list[Any], *, send: bool = True, replayable: bool = True) -> int:
        """One EventBatch; ``send=False`` loses it on the wire (a gap), ``replayable=False``
        drops it from the replay buffer too. Returns its seq (``self.seq``, which a test
        may move to fake a corrupt sequence)."""
        batch = [time.time(), events]  # EventBatch is array_like
        seq = self.seq
        self.seq += 1
        self._queue.put((msgpack.packb(batch), send, replayable, seq))
        return seq

    def publish_payload(self, payload: bytes) -> int:
        """One batch as encoded bytes (e.g. recorded from vLLM's own encoder)."""
        seq = self.seq
        self.seq += 1
        self._queue.put((payload, True, True, seq))
        return seq

    def _event(self, tag: str, fields: dict[str, Any]) -> Any:
        if self.array_like_events:
            return [tag, *fields.values()]
        return {"type": tag, **fields}

    def _hash(self, parent: Any, tokens: list[int], salt: str) -> Any:
        raw = engine_hash(parent if isinstance(parent, bytes) else None, tokens, salt)
        if isinstance(parent, int):
            raw = engine_hash(parent.to_bytes(8, "big"), tokens, salt)
        return int.from_bytes(raw[:8], "big") if self.int_hashes else raw

    def store(
        self,
        tokens: list[int],
        *,
        salt: str = "",
        lora_name: str | None = None,
        send: bool = True,
        replayable: bool = True,
        medium: str | None = "GPU",
        into: list[Any] | None = None,
    ) -> list[Any]:
        """Cache the full blocks of a prompt; emits one BlockStored for the new ones
        (appends it to ``into`` instead: a batch of several events, ``publish``).
        Returns every block's engine hash."""
        B = self.block_size
        hashes: list[Any] = []
        parent: Any = None
        new_from: int | None = None
        for i in range(len(tokens) // B):
            block = tokens[i * B : (i + 1) * B]
            h = self._hash(parent, block, f"{lora_name}/{salt}")
            hashes.append(h)
            if h not in self.cached and new_from is None:
                new_from = i
            parent = h
        if new_from is None:
            return hashes
        new = hashes[new_from:]
        for i, h in enumerate(new, start=new_from):
            self.cached[h] = tokens[i * B : (i + 1) * B]
        extra: list[Any] = [None] * len(new)
        if new_from == 0 and salt:
            extra[0] = [["cache_salt", salt]]
        fields = {
            "block_hashes": new,
            "parent_block_hash": hashes[new_from - 1] if new_from else None,
            "token_ids": tokens[new_from * B : (new_from + len(new)) * B],
            "block_size": B,
            "lora_id": None,
            "medium": medium,
            "lora_name": lora_name,
            "extra_keys": extra,
        }
        event = self._event("BlockStored", fields)
        if into is not None:
            into.append(event)
        else:
            self.publish([event], send=send, replayable=replayable)
        return hashes

    def offload(self, tokens: list[int], *, medium: str = "CPU", bare: bool = False) -> list[Any]:
        """Announce every full block of a prompt as copied to another medium, as vLLM's
        offloading connector does: with tokens and parents (``self_describing_kv_events``)
        or ``bare`` (hashes only, no tokens, block_size 0: its default). The engine's own
        (GPU) cache is unchanged. Returns every block's engine hash."""
        B = self.block_size
        hashes: list[Any] = []
        parent: Any = None
        for i in range(len(tokens) // B):
            parent = self._hash(parent, tokens[i * B : (i + 1) * B], "None/")
            hashes.append(parent)
        fields = {
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": [] if bare else tokens[: len(hashes) * B],
            "block_size": 0 if bare else B,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": None,
        }
        self.publish([self._event("BlockStored", fields)])
        return hashes

    def drop(
        self,
        hashes: list[Any],
        *,
        send: bool = True,
        replayable: bool = True,
        medium: str = "GPU",
        into: list[Any] | None = None,
    ) -> None:
        """Evict blocks: one BlockRemoved (appended to ``into`` instead, as ``store``)."""
        if medium == "GPU":
            for h in hashes:
                self.cached.pop(h, None)
        event = self._event("BlockRemoved", {"block_hashes": hashes, "medium": medium})
        if into is not None:
            into.append(event)
        else:
            self.publish([event], send=send, replayable=replayable)

    def clear(self) -> None:
        self.cached.clear()
        self.publish([self._event("AllBlocksCleared", {})])


def bind_again(socket: zmq.Socket[bytes], endpoint: str, timeout_s: float = 10.0) -> None:
    """Bind, retrying while the previous life's socket still holds the port (ZMQ closes
    listeners asynchronously, so a restart within milliseconds can find it taken)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # the old listener closes on ZMQ's I/O thread


class FakeEngineHTTP:
    """``/health``, ``/v1/models``, ``/metrics`` and ``/tokenize`` on a loopback port;
    with ``api_key``, ``/v1`` paths want it as vLLM's ``--api-key`` does (a 401 without);
    with ``tls`` (a server context), HTTPS as vLLM's ``--ssl-certfile``; with
    ``event_sources``, ``/kv_event_sources`` as vLLM 0.32 serves it (else a 404).
    ``authorizations``: the Authorization header of each request, in order."""

    def __init__(
        self,
        model: str = "m",
        tokenize: Callable[[list[dict[str, str]]], list[int]] | None = None,
        metrics: str = "",
        port: int = 0,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        event_sources: dict[str, Any] | None = None,
        root: str | None = None,
    ) -> None:
        self.model = model
        self.root = root  # the card's root (vLLM's --model); None: no root listed
        self.models_body: bytes | None = None  # /v1/models answered with this instead
        self.event_sources = event_sources
        self.api_key = api_key
        self.tls = tls
        self.authorizations: list[str | None] = []
        self.tokenize = tokenize
        self.metrics = metrics
        self.requests: list[str] = []
        self._server: ThreadingHTTPServer | None = None
        self.port = port

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def refused(self) -> bool:
                engine.authorizations.append(self.headers.get("authorization"))
                wanted = f"Bearer {engine.api_key}"
                if engine.api_key is None or not self.path.startswith("/v1"):
                    return False
                if self.headers.get("authorization") == wanted:
                    return False
                self._reply(401, b'{"error":"Unauthorized"}')
                return True

            def do_GET(self) -> None:
                engine.requests.append(self.path)
                if self.refused():
                    pass
                elif self.path == "/health":
                    self._reply(200, b"")
                elif self.path == "/v1/models":
                    if engine.models_body is not None:
                        self._reply(200, engine.models_body)
                        return
                    card = {"id": engine.model, "object": "model"}
                    if engine.root is not None:
                        card["root"] = engine.root
                    data = {"object": "list", "data": [card]}
                    self._reply(200, json.dumps(data).encode())
                elif self.path == "/metrics":
                    self._reply(200, engine.metrics.encode(), "text/plain; version=0.0.4")
                elif self.path == "/kv_event_sources" and engine.event_sources is not None:
                    self._reply(200, json.dumps(engine.event_sources).encode())
                else:
                    self._reply(404, b"{}")

            def do_POST(self) -> None:
                engine.requests.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/tokenize" and engine.tokenize is not None:
                    tokens = engine.tokenize(body["messages"])
                    data = {"tokens": tokens, "count": len(tokens), "max_model_len": 8192}
                    self._reply(200, json.dumps(data).encode())
                else:
                    self._reply(404, b"{}")

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="40"} 1.0
"""
