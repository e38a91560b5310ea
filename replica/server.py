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
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixgate.json_body import load_json_body
from prefixgate.wire import OpenAIError, error_body
from replica import openai_format as fmt
from replica.jobs import Job, JobClock, job_from_chat, job_from_completion
from replica.request import EngineStopped, PromptTooLong, QueueFull, RequestOutput
from replica.state import Replica

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
        return fmt.model_list(replica.model_ids, fmt.now(), replica.loaded.max_context)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        job = job_from_chat(body, replica)
        return await _run(job, request, replica)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        job = job_from_completion(body, replica)
        return await _run(job, request, replica)

    return app


def _stop_serving(replica: Replica, exc: BaseException) -> None:
    """The engine thread died: refuse work (``/health`` is already 503, ``submit``
    raises) and stop the server, so the process exits non-zero and is restarted."""
    log.critical("engine thread died (%s: %s); stopping the server", type(exc).__name__, exc)
    if replica.on_engine_death is not None:
        replica.on_engine_death()


async def _json_body(request: Request) -> object:
    return load_json_body(await request.body())


def _submit(job: Job, replica: Replica) -> Any:
    try:
        return replica.engine.submit(
            job.prompt_ids, job.params, salt=job.salt, request_id=job.engine_request_id
        )
    except QueueFull as exc:
        raise OpenAIError(
            f"the replica's waiting queue is full ({exc}); retry shortly",
            status=503,
            type="server_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from exc
    except EngineStopped as exc:  # stopping (SIGTERM) or its engine died: go elsewhere
        raise OpenAIError(
            f"the replica is shutting down ({exc}); retry on another replica",
            status=503,
            type="server_error",
            code="shutting_down",
            headers={"Retry-After": "1"},
        ) from exc
    except PromptTooLong as exc:
        raise OpenAIError(
            str(exc), param="messages" if job.chat else "prompt", code="context_length_exceeded"
        ) from exc
    except ValueError as exc:
        raise OpenAIError(str(exc), code="invalid_value") from exc


async def _run(job: Job, request: Request, replica: Replica) -> Response:
    clock = JobClock(start=time.perf_counter())
    handle = _submit(job, replica)
    if job.stream:
        return StreamingResponse(
            _stream(job, handle, clock, replica),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            # Runs after the stream ends or the client leaves, even when the client left
            # before the generator started (its `finally` then never runs).
            background=BackgroundTask(_cancel_unfinished, handle, job, replica),
        )
    collect = asyncio.create_task(_collect(handle, clock, replica))
    gone = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not collect.done():
            # The client left (or we are cancelled by shutdown): free the blocks now.
            replica.engine.cancel(job.engine_request_id)
            collect.cancel()
        gone.cancel()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    output = collect.result()
    if output.error is not None:
        raise _engine_error(output.error)
    _observe(job, output, clock, replica)
    return JSONResponse(_full_body(job, output))


def _engine_error(message: str) -> OpenAIError:
    """A request the engine failed (never the client's input: that is checked first)."""
    return OpenAIError(message, status=500, type="server_error", code="engine_error")


def _cancel_unfinished(handle: Any, job: Job, replica: Replica) -> None:
    if not handle.finished:
        replica.engine.cancel(job.engine_request_id)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(handle: Any, clock: JobClock, replica: Replica) -> RequestOutput:
    async for delta in handle:
        clock.tick(len(delta.token_ids), replica.metrics)
    return _output(handle)


def _output(handle: Any) -> RequestOutput:
    """The finished request's output; the delta stream has been consumed to its end."""
    output: RequestOutput | None = handle.output
    assert output is not None, "the stream ended, so the engine closed the handle"
    return output


def _full_body(job: Job, output: RequestOutput) -> dict[str, Any]:
    choices = [
        fmt.Choice(c.index, job.echo_prefix + c.text, c.finish_reason) for c in output.choices
    ]
    use = fmt.Usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
    build = fmt.chat_completion if job.chat else fmt.text_completion
    return build(job.response_id, job.model, job.created, choices, use)


async def _stream(job: Job, handle: Any, clock: JobClock, replica: Replica) -> AsyncIterator[bytes]:
    finished = False
    try:
        for index in range(job.params.n):
            if job.chat:
                yield fmt.sse(
                    fmt.chat_chunk(
                        job.response_id, job.model, job.created, index, role="assistant", content=""
                    )
                )
            elif job.echo_prefix:
                yield fmt.sse(
                    fmt.text_chunk(
                        job.response_id, job.model, job.created, index, job.echo_prefix, None
                    )
                )
        async for delta in handle:
            clock.tick(len(delta.token_ids), replica.metrics)
            if not delta.text and delta.finish_reason is None:
                continue
            if job.chat:
                chunk = fmt.chat_chunk(
                    job.response_id,
                    job.model,
                    job.created,
                    delta.index,
                    content=delta.text or None,
                    finish_reason=delta.finish_reason,
                )
            else:
                chunk = fmt.text_chunk(
                    job.response_id,
                    job.model,
                    job.created,
                    delta.index,
                    delta.text,
                    delta.finish_reason,
                )
            yield fmt.sse(chunk)
        output = _output(handle)
        finished = True
        if output.error is not None:
            # Headers are sent: the error goes in the stream, as OpenAI's does.
            error = _engine_error(output.error)
            replica.metrics.request_errors.labels(code=error.code).inc()
            yield fmt.sse(error.body())
            yield fmt.SSE_DONE
            return
        _observe(job, output, clock, replica)
        if job.include_usage:
            use = fmt.Usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
            obj = "chat.completion.chunk" if job.chat else "text_completion"
            yield fmt.sse(fmt.usage_chunk(job.response_id, job.model, job.created, obj, use))
        yield fmt.SSE_DONE
    finally:
        if not finished:
            # Client gone (the generator is cancelled or closed): free the blocks at once.
            replica.engine.cancel(job.engine_request_id)


def _observe(job: Job, output: RequestOutput, clock: JobClock, replica: Replica) -> None:
    t = output.timings
    log.debug(
        "%s done: prompt %d (cached %d), completion %d, ttft %.1f ms, total %.1f ms, %s",
        job.response_id,
        output.prompt_tokens,
        output.cached_tokens,
        output.completion_tokens,
        1000 * ((clock.first or clock.start) - clock.start),
        1000 * (time.perf_counter() - clock.start),
        ",".join(c.finish_reason for c in output.choices),
    )
    replica.metrics.observe_finished(
        prompt_tokens=output.prompt_tokens,
        cached_tokens=output.cached_tokens,
        generation_tokens=output.completion_tokens,
        finish_reasons=[c.finish_reason for c in output.choices],
        e2e_s=time.perf_counter() - clock.start,
        queued_s=t.queued_s,
        prefill_s=t.prefill_s,
    )
