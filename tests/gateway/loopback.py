"""In-process test servers on loopback: scripted HTTP/1.1 replicas (plain asyncio, raw
bytes, so a test can send what no framework would: 1xx, trailers, a broken body, nothing)
and the gateway itself under a real uvicorn, whose router the test can read."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.routing import KeyBuilder, Tokenizer
from gateway.state import GatewayState
from prefixgate.procs import free_port
from tests.conftest import wait_until_async


class Request(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]  # names lowercased
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> Request:
    """One request off the connection; IncompleteReadError when the client closed it."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    method, path, _ = line.split(" ", 2)
    headers = {}
    for raw in lines:
        if raw:
            name, value = raw.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


def answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}.get(status, "X")
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def completion(text: str = "hi", cached: int = 0) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
    usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": usage}
    return json.dumps(body).encode()


def sse(*events: str, done: bool = True) -> bytes:
    """A chunked SSE answer: the head, each event in its own chunk, then (``done``) the
    [DONE] event and the last chunk."""
    out = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for data in (*events, "[DONE]") if done else events:
        event = f"data: {data}\n\n".encode()
        out += b"%x\r\n%s\r\n" % (len(event), event)
    return out + b"0\r\n\r\n" if done else out


# A POST handler: gets the request and the connection, writes what it likes. Returning
# keeps the connection for the next request; closing the writer ends it.
PostHandler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def answer_ok(request: Request, _: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.write(answer(200, completion()))
    await w.drain()


@dataclass(slots=True)
class Replica:
    """A scripted replica: GET /health and /v1/models answered, /is_paused not served,
    other requests to ``on_post``."""

    on_post: PostHandler = answer_ok
    model: str = "m"
    more_models: list[dict[str, Any]] = field(default_factory=list)  # /v1/models cards
    healthy: bool = True  # False: GET /health answers 503
    posts: list[Request] = field(default_factory=list)
    connections: int = 0
    open_connections: int = 0
    server: asyncio.Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replica_id(self) -> str:
        return self.url.removeprefix("http://")

    async def start(self) -> Replica:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _connection(self, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_connections += 1
        try:
            while not w.is_closing():
                try:
                    request = await read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if request.method == "GET" and request.path == "/health":
                    ok = self.healthy
                    w.write(
                        answer(200 if ok else 503, b'{"status":"%s"}' % (b"ok" if ok else b"down"))
                    )
                elif request.method == "GET" and request.path == "/v1/models":
                    cards = [{"id": self.model}, *self.more_models]
                    w.write(answer(200, json.dumps({"data": cards}).encode()))
                elif request.method == "GET" and request.path == "/is_paused":
                    # as an engine without vLLM's development mode (gateway/probes.py)
                    w.write(answer(404, b'{"detail":"Not Found"}'))
                else:
                    self.posts.append(request)
                    await self.on_post(request, reader, w)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            self.open_connections -= 1
            w.close()


def no_tokenizer(name: str, chat_template: str | None = None, mode: str = "auto") -> Tokenizer:
    raise FileNotFoundError(f"{name}: the tests key prompts by their bytes")


@contextlib.asynccontextmanager
async def running_gateway(
    replicas: list[Replica], **settings: Any
) -> AsyncIterator[tuple[str, GatewayState]]:
    """The gateway app under uvicorn on a free port, in front of ``replicas``, ready
    (every replica probed healthy); yields its URL and its state."""
    settings.setdefault("probe_interval_s", 0.2)
    config = GatewayConfig(
        port=free_port(), replicas=[r.url for r in replicas], models=["m"], **settings
    )
    app = create_app(config, keys=KeyBuilder(loader=no_tokenizer))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{config.port}"
    try:
        await wait_until_async(lambda: server.started or task.done(), what="gateway started")
        if task.done():
            task.result()  # raises the startup failure
        state = app.state
        await wait_until_async(
            lambda: (
                all(v.healthy for v in state.router.replicas.values())
                and len(state.router.replicas) == len(replicas)
            ),
            what="replicas healthy",
        )
        yield url, state
    finally:
        server.should_exit = True
        await task
