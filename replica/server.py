"""The replica's HTTP face: an OpenAI-compatible API over one engine, plus operations.

``create_app(replica)`` wires a loaded model, its running engine, metrics and (optionally)
the Redis publisher into a FastAPI app. Request handling is async; the model runs in the
engine's own thread and never blocks the event loop. Everything a user sees when a request
is refused is an OpenAI error envelope (``prefixgate.wire``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixgate.json_body import load_json_body
from prefixgate.wire import OpenAIError, error_body
from replica import openai_format as fmt
from replica.jobs import Job, job_from_chat, jobs_from_completion, off_loop_if_large, work_size
from replica.messages import add_messages_routes
from replica.respond import named_request, run_batch, run_job
from replica.responses import add_response_routes
from replica.state import Replica
from replica.tokenize_api import add_tokenize_routes
from replica.tokens_api import add_tokens_routes

log = logging.getLogger("prefixgate.replica.server")

_REQUEST_ID_OK = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces


class RequestIdMiddleware:
    """Accept ``x-request-id`` (or make one), keep it in ``request.state``, echo it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID_OK.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(replica: Replica) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not replica.engine.alive:
            replica.engine.start()
        loop = asyncio.get_running_loop()

        def engine_died(exc: BaseException) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(_stop_serving, replica, exc)

        replica.engine.on_death(engine_died)
        if replica.publisher is not None:
            await replica.publisher.start(replica.engine.load)
        log.info("replica serving %s", ", ".join(replica.model_ids))
        try:
            yield
        finally:
            if replica.publisher is not None:
                await replica.publisher.stop()
            await asyncio.to_thread(replica.engine.stop, replica.engine_stop_timeout_s)
            log.info("replica stopped")

    app = FastAPI(title="prefixgate replica", lifespan=lifespan)
    app.state.replica = replica
    app.add_middleware(RequestIdMiddleware)
    metrics = replica.metrics

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        metrics.request_errors.labels(code=exc.code or exc.type).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        body = error_body(str(exc.detail), code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        metrics.request_errors.labels(code="internal_error").inc()
        message = "The replica failed on this request; retry it, or report the request id."
        body = error_body(message, type="server_error", code="internal_error")
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if replica.loaded is not None and replica.engine.alive:
            return JSONResponse({"status": "ok", "model": replica.served_model_name})
        return JSONResponse({"status": "unavailable", "engine_alive": False}, status_code=503)

    @app.get("/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        stats: dict[str, Any] = replica.engine.cache_stats().as_dict()
        if replica.publisher is not None:
            p = replica.publisher.stats
            stats["publisher"] = {
                "seq": p.seq,
                "connected": p.connected,
                "events_published": p.events_published,
                "events_dropped": p.events_dropped,
                "snapshots_written": p.snapshots_written,
                "outages": p.outages,
            }
        return stats

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Drop every cached prefix block (vLLM's endpoint of the same name; SGLang calls
        it /flush_cache). ``seq``: the block event sequence number as of the reset (its
        ``cleared`` event or later), so a gateway can wait until its index has it."""
        try:
            freed = await asyncio.wrap_future(replica.engine.reset_prefix_cache())
        except RuntimeError as exc:
            raise OpenAIError(
                f"cannot reset the prefix cache: {exc}",
                status=503,
                type="server_error",
                code="engine_unavailable",
            ) from exc
        seq = replica.publisher.stats.seq if replica.publisher is not None else None
        log.info("prefix cache reset: %d blocks freed", freed)
        return {"object": "prefix_cache.reset", "freed_blocks": freed, "seq": seq}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        loaded = replica.loaded
        return fmt.model_list(replica.model_ids, fmt.now(), loaded.max_context, replica.root)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await request.body()

        def read() -> tuple[Job, str | None]:
            body = load_json_body(raw)
            return job_from_chat(body, replica), named_request(request, _given_id(body))

        job, named = await off_loop_if_large(work_size(raw), read)
        if named is not None:  # vLLM's answer id: the request's name
            job.response_id = f"chatcmpl-{named}"
        return await run_job(job, request, replica)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()

        def read() -> tuple[list[Job], str | None]:
            body = load_json_body(raw)
            return jobs_from_completion(body, replica), named_request(request, _given_id(body))

        jobs, named = await off_loop_if_large(work_size(raw), read)
        if named is not None:  # a batch's prompts share it
            for job in jobs:
                job.response_id = f"cmpl-{named}"
        if len(jobs) > 1:
            return await run_batch(jobs, request, replica)
        return await run_job(jobs[0], request, replica)

    add_response_routes(app, replica)
    add_tokenize_routes(app, replica)
    add_messages_routes(app, replica)
    add_tokens_routes(app, replica)
    return app


def _given_id(body: object) -> object:
    """The body's ``request_id`` (vLLM's field), if it has one."""
    return body.get("request_id") if isinstance(body, dict) else None


def _stop_serving(replica: Replica, exc: BaseException) -> None:
    """The engine thread died: refuse work (``/health`` is already 503, ``submit``
    raises) and stop the server, so the process exits non-zero and is restarted."""
    log.critical("engine thread died (%s: %s); stopping the server", type(exc).__name__, exc)
    if replica.on_engine_death is not None:
        replica.on_engine_death()
