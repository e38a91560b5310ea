"""A tiny, fast OpenAI-compatible stub server (raw ASGI, no framework): test and
benchmark equipment, not part of the product.

Stands in for a foreign backend (vLLM, SGLang: no events, a model we may not tokenize)
in tests, and for a backend that costs nothing in the latency benchmark, so that the
figures measure the gateway. Its answers are fixed text; flags make it fail on purpose:

    python -m tests.support.stub_backend --port P [--model NAME] [--fail-status 500]
        [--fail-body TEXT] [--fail-on TEXT] [--break-after N] [--chunks N]
        [--delay-ms MS] [--chunk-interval-ms MS] [--health-status 503]
        [--alias NAME ...] [--lora NAME ...]
        [--api-key KEY] [--retry-after SECONDS] [--reset none|vllm|vllm-busy|sglang]

``--fail-on TEXT`` fails only the requests whose body contains TEXT (a poison request;
with ``--fail-status`` or 500); ``--health-status`` is what ``GET /health`` answers.
``--alias`` and ``--lora`` add names to ``/v1/models`` as vLLM lists them: another
``--served-model-name``, and a LoRA adapter (a card whose ``parent`` is the model).

``--api-key`` guards every ``/v1`` path as vLLM's ``--api-key`` does: a request without
``Authorization: Bearer KEY`` gets vLLM's 401 ``{"error": "Unauthorized"}``, and is
remembered (path, method, status) among the requests below.

``POST /v1/embeddings`` answers a two-number vector per input (its length, then 0.5);
``POST /v1/messages`` (Anthropic's, streamed or not) a fixed message, and its
``count_tokens`` the number of messages; ``POST /generate`` (SGLang's) a fixed text, or,
for a ``rid`` that starts ``hold-``, nothing until ``POST /abort_request`` names it (or
``abort_all``): then its ``finish_reason`` is ``abort``. ``POST /v1/audio/transcriptions``
(and translations) a fixed text, streamed when the form says ``stream=true``;
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add a name to, and take it from,
the ``--lora`` names ``/v1/models`` lists.

It remembers the last requests (``GET /stub/requests``: body and headers) so that tests
can check what the gateway forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive, Scope, Send

JSON_HEADERS = [(b"content-type", b"application/json")]
# (path, --reset) -> the answer: vLLM's cache reset (its development mode), busy or not;
# SGLang's, under its own name.
# vLLM's other generating endpoints, and SageMaker's /invocations for a pooling model:
# remembered and answered with their path.
ECHOED = ("/v1/chat/completions/batch", "/generative_scoring", "/v1/systemone", "/invocations")
PAUSE_PATHS = {("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")}
# vLLM's sleep mode, as the stub plays it: asleep is paused (vLLM's /is_paused says so too)
SLEEP_PATHS = {("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")}
RESETS = {
    ("/reset_prefix_cache", "vllm"): (200, b'{"success":true}'),
    ("/reset_prefix_cache", "vllm-busy"): (200, b'{"success":false}'),
    ("/flush_cache", "sglang"): (
        200,
        b"Cache flushed.\nPlease check backend logs.",
    ),
}
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass(slots=True)
class StubConfig:
    model: str = "stub-model"
    fail_status: int | None = None
    fail_body: str | None = None  # default: an OpenAI error body
    break_after: int | None = None  # stream: drop the connection after this many chunks
    chunks: int = 4  # content chunks per streamed answer
    delay_s: float = 0.0  # before answering
    chunk_interval_s: float = 0.0  # stream: between chunks, as an engine's decode steps
    fail_on: str | None = None  # fail only bodies containing this text
    health_status: int = 200
    remembered: int = 64
    aliases: list[str] = field(default_factory=list)
    loras: list[str] = field(default_factory=list)
    api_key: str | None = None
    retry_after: str | None = None  # a Retry-After header on failures
    reset: str = "none"  # which engine's prefix-cache reset it serves (RESETS)
    # serves vLLM's /pause, /resume, /is_paused, /sleep, /wake_up, /is_sleeping (dev mode)
    pausable: bool = False


@dataclass(slots=True)
class StubBackend:
    config: StubConfig
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    held: dict[str, asyncio.Event] = field(default_factory=dict)  # /generate rids "hold-…"
    # Cleared while paused: completions wait for it, as a paused vLLM's do.
    running: asyncio.Event = field(default_factory=asyncio.Event)
    _responded: int = 0

    def __post_init__(self) -> None:
        self.running.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if (
            self.config.api_key is not None
            and path.startswith("/v1")
            and not self._authorized(scope)
        ):
            self._remember({"path": path, "method": method, "status": 401})
            await _send(send, 401, b'{"error":"Unauthorized"}')
        elif method == "GET" and path == "/health":
            ok = self.config.health_status == 200
            await _send(
                send,
                self.config.health_status,
                b'{"status":"%s"}' % (b"ok" if ok else b"unavailable"),
            )
        elif method == "GET" and path == "/v1/models":
            c = self.config
            card = {"object": "model", "created": 0, "owned_by": "stub", "max_model_len": 4096}
            cards: list[dict[str, Any]] = [
                {**card, "id": name, "parent": None} for name in (c.model, *c.aliases)
            ]
            cards += [{**card, "id": name, "parent": c.model} for name in c.loras]
            await _send(send, 200, json.dumps({"object": "list", "data": cards}).encode())
        elif method == "POST" and (path, self.config.reset) in RESETS:
            status, body = RESETS[path, self.config.reset]
            await _send(
                send, status, body, b"application/json" if body[:1] == b"{" else b"text/plain"
            )
        elif self.config.pausable and (method, path) in PAUSE_PATHS:
            if path == "/pause":
                self.running.clear()
            elif path == "/resume":
                self.running.set()
            paused = not self.running.is_set()
            await _send(send, 200, json.dumps({"is_paused": paused}).encode())
        elif self.config.pausable and (method, path) in SLEEP_PATHS:
            self._remember({"path": path, "query": scope.get("query_string", b"").decode()})
            if path == "/sleep":
                self.running.clear()
                await _send(send, 200, json.dumps({"status": "sleeping", "level": 1}).encode())
            elif path == "/wake_up":
                self.running.set()
                await _send(send, 200, json.dumps({"status": "awake", "tags": None}).encode())
            else:
                asleep = not self.running.is_set()
                await _send(send, 200, json.dumps({"is_sleeping": asleep}).encode())
        elif method == "GET" and path == "/stub/requests":
            await _send(send, 200, json.dumps(list(self.requests)).encode())
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(scope, receive, send, chat=path.endswith("chat/completions"))
        elif method == "POST" and path == "/v1/embeddings":
            await self._embed(scope, receive, send)
        elif method == "POST" and path == "/generate":
            await self._generate(scope, receive, send)
        elif method == "POST" and path == "/abort_request":
            await self._abort(receive, send)
        elif method == "POST" and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            await self._adapter(path, receive, send)
        elif method == "POST" and path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            await self._audio(scope, receive, send)
        elif method == "POST" and path in ("/v1/messages", "/v1/messages/count_tokens"):
            await self._messages(scope, receive, send)
        elif method == "POST" and path == "/v1/responses":
            await self._responses(scope, receive, send)
        elif method == "POST" and path in ECHOED:
            await self._echo(scope, receive, send)
        else:
            self._remember({"path": path, "method": method, "status": 404})
            await _send(
                send, 404, json.dumps(_error("not found", "invalid_request_error")).encode()
            )

    def _remember(self, request: dict[str, Any]) -> None:
        self.requests.append(request)
        while len(self.requests) > self.config.remembered:
            self.requests.popleft()

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        return headers.get(b"authorization") == f"Bearer {self.config.api_key}".encode()

    async def _complete(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        raw = await _read(receive)
        body = json.loads(raw)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        c = self.config
        await self.running.wait()
        if c.delay_s:
            await asyncio.sleep(c.delay_s)  # simulated backend work
        # --fail-on: only poisoned bodies fail; otherwise --fail-status fails them all.
        failing = c.fail_status is not None if c.fail_on is None else c.fail_on.encode() in raw
        if failing:
            status = c.fail_status or 500
            extra = [(b"retry-after", c.retry_after.encode())] if c.retry_after else []
            if c.fail_body is not None:
                await _send(send, status, c.fail_body.encode(), b"text/plain", extra)
            else:
                error = _error("stub failure", "server_error")
                await _send(send, status, json.dumps(error).encode(), extra=extra)
            return
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            await self._stream(send, body.get("model", c.model), chat, include_usage)
        else:
            await _send(send, 200, _completion(body.get("model", c.model), chat, c.chunks))

    async def _echo(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's other generating endpoints: the body is remembered and named back."""
        body = json.loads(await _read(receive))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        await _send(send, 200, json.dumps({"path": scope["path"], "object": "stub"}).encode())

    async def _embed(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.loads(await _read(receive))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(text)), 0.5]}
            for i, text in enumerate(texts)
        ]
        usage = {"prompt_tokens": len(texts), "total_tokens": len(texts)}
        answer = {"object": "list", "data": data, "model": body["model"], "usage": usage}
        await _send(send, 200, json.dumps(answer).encode())

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.loads(await _read(receive))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        meta: dict[str, Any] = {"prompt_tokens": 8, "completion_tokens": 2, "cached_tokens": 0}
        rid = body.get("rid")
        if isinstance(rid, str) and rid.startswith("hold-"):  # runs until aborted (30 s)
            held = self.held[rid] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.wait(), 30)
            del self.held[rid]
            meta["finish_reason"] = {"type": "abort" if held.is_set() else "length"}
        if not body.get("stream"):
            answer = {"text": "tok0 tok1", "meta_info": meta}
            await _send(send, 200, json.dumps(answer).encode())
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for text in ("tok0", "tok0 tok1"):
            event = _event({"text": text, "meta_info": meta})
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _adapter(self, path: str, receive: Receive, send: Send) -> None:
        """vLLM's run-time LoRA adapters: listed at /v1/models once loaded, until unloaded;
        vLLM's text answers and its 400s (a name loaded twice, or not loaded)."""
        body = json.loads(await _read(receive))
        self._remember({"path": path, "body": body})
        name, loras = body.get("lora_name"), self.config.loras
        if path.endswith("/load_lora_adapter") and name not in loras:
            loras.append(name)
            await _send(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode())
        elif path.endswith("/unload_lora_adapter") and name in loras:
            loras.remove(name)
            await _send(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode())
        else:
            error = _error(f"The lora adapter '{name}' cannot be (un)loaded.", "BadRequestError")
            await _send(send, 400, json.dumps(error).encode())

    async def _audio(self, scope: Scope, receive: Receive, send: Send) -> None:
        """OpenAI's audio API: a form upload, remembered by its size and digest."""
        raw = await _read(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        digest = hashlib.sha256(raw).hexdigest()
        self._remember({"path": scope["path"], "headers": headers, "sha256": digest})
        if b'name="stream"\r\n\r\ntrue' not in raw:
            await _send(send, 200, json.dumps({"text": "stub transcript"}).encode())
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for text in ("stub", " transcript"):
            event = _event(
                {"object": "transcription.chunk", "choices": [{"delta": {"content": text}}]}
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _abort(self, receive: Receive, send: Send) -> None:
        """SGLang's: a held ``/generate`` ends at its ``rid``'s abort, or at ``abort_all``."""
        body = json.loads(await _read(receive))
        self._remember({"path": "/abort_request", "body": body})
        for rid, held in self.held.items():
            if body.get("abort_all") or body.get("rid") == rid:
                held.set()
        await _send(send, 200, b"")

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.loads(await _read(receive))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        if scope["path"].endswith("count_tokens"):
            await _send(send, 200, json.dumps({"input_tokens": len(body["messages"])}).encode())
            return
        text = {"type": "text", "text": "tok0 tok1"}
        usage = {"input_tokens": 8, "output_tokens": 2, "cache_read_input_tokens": 5}
        message = {"id": "msg_stub", "type": "message", "role": "assistant", "model": body["model"]}
        if not body.get("stream"):
            answer = {**message, "content": [text], "stop_reason": "end_turn", "usage": usage}
            await _send(send, 200, json.dumps(answer).encode())
            return
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": "tok0 tok1"}
        events: list[dict[str, Any]] = [
            {"type": "message_start", "message": {**message, "content": []}},
            {"type": "content_block_start", "index": 0, "content_block": block},
            {"type": "content_block_delta", "index": 0, "delta": delta},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage},
            {"type": "message_stop"},
        ]
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for i, data in enumerate(events):
            if self.config.break_after is not None and i >= self.config.break_after:
                raise ConnectionAbortedError("stub: breaking the stream on purpose")
            chunk = f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A whole Responses answer (no stream, nothing stored): as vLLM shapes it."""
        body = json.loads(await _read(receive))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self._remember({"path": scope["path"], "body": body, "headers": headers})
        self._responded += 1
        text = {"type": "output_text", "text": "tok0 tok1", "annotations": []}
        item = {"type": "message", "id": "msg_stub", "role": "assistant", "status": "completed"}
        answer = {
            "id": f"resp_stub{self._responded}",
            "object": "response",
            "created_at": 0,
            "model": body["model"],
            "status": "completed",
            "output": [{**item, "content": [text]}],
            "usage": {
                "input_tokens": 8,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 2,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 10,
            },
        }
        await _send(send, 200, json.dumps(answer).encode())

    async def _stream(self, send: Send, model: str, chat: bool, include_usage: bool) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for i in range(self.config.chunks):
            if i and self.config.chunk_interval_s:
                await asyncio.sleep(self.config.chunk_interval_s)
            if self.config.break_after is not None and i >= self.config.break_after:
                raise ConnectionAbortedError("stub: breaking the stream on purpose")
            await send(
                {"type": "http.response.body", "body": _chunk(model, chat, i), "more_body": True}
            )
        tail = b""
        if include_usage:
            tail += _event(_envelope(model, chat, [], _usage(self.config.chunks)))
        tail += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _error(message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": None}}


def _usage(completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": 8,
        "completion_tokens": completion_tokens,
        "total_tokens": 8 + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _envelope(model: str, chat: bool, choices: list[Any], usage: Any = None) -> dict[str, Any]:
    return {
        "id": "stub-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def _chunk(model: str, chat: bool, i: int) -> bytes:
    text = f"tok{i} "
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
    return _event(_envelope(model, chat, [choice]))


def _completion(model: str, chat: bool, n: int) -> bytes:
    text = "".join(f"tok{i} " for i in range(n))
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        obj = "text_completion"
    body = {**_envelope(model, chat, [choice], _usage(n)), "object": obj}
    return json.dumps(body, separators=(",", ":")).encode()


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _read(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _send(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.stub_backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--fail-status", type=int)
    parser.add_argument("--fail-body")
    parser.add_argument("--break-after", type=int)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0)
    parser.add_argument("--fail-on")
    parser.add_argument("--health-status", type=int, default=200)
    parser.add_argument("--alias", action="append", default=[])
    parser.add_argument("--lora", action="append", default=[])
    parser.add_argument("--api-key")
    parser.add_argument("--retry-after")
    parser.add_argument("--reset", choices=("none", "vllm", "vllm-busy", "sglang"), default="none")
    parser.add_argument("--pausable", action="store_true")
    args = parser.parse_args(argv)
    config = StubConfig(
        model=args.model,
        fail_status=args.fail_status,
        fail_body=args.fail_body,
        break_after=args.break_after,
        chunks=args.chunks,
        delay_s=args.delay_ms / 1000,
        chunk_interval_s=args.chunk_interval_ms / 1000,
        fail_on=args.fail_on,
        health_status=args.health_status,
        aliases=args.alias,
        loras=args.lora,
        api_key=args.api_key,
        retry_after=args.retry_after,
        reset=args.reset,
        pausable=args.pausable,
    )
    import uvicorn

    from gateway.cli import fast_server_options

    uvicorn.run(
        StubBackend(config),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        **fast_server_options(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
