"""Running one accepted request: submit it to the engine, answer with its completion.

Streamed as server-sent events or whole; either way a client that leaves frees the
request's blocks at once, and an engine failure becomes an OpenAI error (a 500, or in a
stream an error event before ``[DONE]``). Refusals from the engine (queue full, shutting
down, prompt too long) become the matching OpenAI errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from prefixgate.wire import OpenAIError
from replica import openai_format as fmt
from replica.handle import RequestHandle
from replica.jobs import Job, JobClock
from replica.request import EngineStopped, PromptTooLong, QueueFull, RequestOutput
from replica.state import Replica
from replica.tool_output import ToolCallChunks, parsed_message

log = logging.getLogger("prefixgate.replica.server")


def _submit(job: Job, replica: Replica) -> RequestHandle:
    try:
        handle: RequestHandle = replica.engine.submit(
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
    return handle


async def run_job(job: Job, request: Request, replica: Replica) -> Response:
    """Submit ``job``, answer with its completion (streamed or whole); the request's
    blocks are freed as soon as the client leaves."""
    clock = JobClock(start=time.perf_counter())
    handle = _submit(job, replica)
    if job.stream:
        return event_stream(_stream(job, handle, clock, replica), handle, job, replica)
    output = await collect_whole(job, handle, clock, request, replica)
    if output is None:
        return Response(status_code=499)
    return JSONResponse(_full_body(job, output))


async def run_batch(jobs: list[Job], request: Request, replica: Replica) -> Response:
    """A batch of completion prompts, each its own engine request, answered as one
    completion as vLLM answers it, whole or streamed: prompt i's ``n`` choices at indexes
    ``i*n`` on, usage summed. A client that leaves frees every prompt's blocks; a prompt
    the engine refuses cancels those already submitted, and one it fails makes the answer
    a 500 (streamed: an error event, then the end)."""
    start = time.perf_counter()
    submitted: list[Job] = []
    handles: list[RequestHandle] = []
    try:
        for job in jobs:
            handles.append(_submit(job, replica))
            submitted.append(job)
    except BaseException:
        for job in submitted:
            replica.engine.cancel(job.engine_request_id)
        raise
    clocks = [JobClock(start=start) for _ in jobs]
    if jobs[0].stream:
        return StreamingResponse(
            _batch_stream(jobs, handles, clocks, replica),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(_cancel_all_unfinished, handles, jobs, replica),
        )
    try:
        collects = [
            asyncio.create_task(_collect(h, c, replica))
            for h, c in zip(handles, clocks, strict=True)
        ]
        gone = asyncio.create_task(_client_gone(request))
        every: asyncio.Future[list[RequestOutput]] = asyncio.gather(*collects)
        try:
            waits: list[asyncio.Future[Any]] = [every, gone]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not every.done()  # the client left first (or the server stops)
            if left:
                every.cancel()
    finally:
        _cancel_all_unfinished(handles, jobs, replica)  # the client left, or we stop
    if left:
        return Response(status_code=499)
    outputs: list[RequestOutput] = every.result()
    failed = next((o.error for o in outputs if o.error is not None), None)
    if failed is not None:
        raise _engine_error(failed)
    choices = []
    for job, output, job_clock in zip(jobs, outputs, clocks, strict=True):
        _observe(job, output, job_clock, replica)
        base = (job.part or 0) * job.params.n
        choices += [
            fmt.Choice(base + c.index, job.echo_prefix + c.text, c.finish_reason, c.stop_reason)
            for c in output.choices
        ]
    use = fmt.Usage(
        sum(o.prompt_tokens for o in outputs),
        sum(o.completion_tokens for o in outputs),
        sum(o.cached_tokens for o in outputs),
    )
    first = jobs[0]
    return JSONResponse(
        fmt.text_completion(first.response_id, first.model, first.created, choices, use)
    )


async def _batch_stream(
    jobs: list[Job], handles: list[RequestHandle], clocks: list[JobClock], replica: Replica
) -> AsyncIterator[bytes]:
    """A batch's chunks as its prompts make them, each choice at its batch index; then one
    usage chunk for them all (when asked) and ``[DONE]``. An engine failure in any prompt
    is an error event, and the stream ends there."""
    queue: asyncio.Queue[bytes | int] = asyncio.Queue()  # chunks, and each prompt's end

    async def pump(i: int) -> None:
        job = jobs[i]
        try:
            base = (job.part or 0) * job.params.n
            chunks = _stream(job, handles[i], clocks[i], replica, index_base=base, tail=False)
            async for chunk in chunks:
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(i)

    pumps = [asyncio.create_task(pump(i)) for i in range(len(jobs))]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if isinstance(item, int):
                running -= 1
                if _failed(handles[item]):  # its error event is out: nothing more follows
                    yield fmt.SSE_DONE
                    return
                continue
            yield item
        first = jobs[0]
        if first.include_usage:
            outputs = [_output(h) for h in handles]
            use = fmt.Usage(
                sum(o.prompt_tokens for o in outputs),
                sum(o.completion_tokens for o in outputs),
                sum(o.cached_tokens for o in outputs),
            )
            usage = fmt.usage_chunk(
                first.response_id, first.model, first.created, "text_completion", use
            )
            yield fmt.sse(usage)
        yield fmt.SSE_DONE
    finally:
        for task in pumps:  # the client left, or a prompt failed: the rest stop now
            task.cancel()
        _cancel_all_unfinished(handles, jobs, replica)


def _failed(handle: RequestHandle) -> bool:
    output: RequestOutput | None = handle.output
    return output is not None and output.error is not None


def _cancel_all_unfinished(handles: list[RequestHandle], jobs: list[Job], replica: Replica) -> None:
    for handle, job in zip(handles, jobs, strict=False):
        _cancel_unfinished(handle, job, replica)


def event_stream(
    events: AsyncIterator[bytes], handle: RequestHandle, job: Job, replica: Replica
) -> StreamingResponse:
    """A streamed answer's server-sent ``events``; the request is cancelled (its blocks
    freed) when the stream ends or the client leaves."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        # Runs after the stream ends or the client leaves, even when the client left
        # before the generator started (its `finally` then never runs).
        background=BackgroundTask(_cancel_unfinished, handle, job, replica),
    )


async def collect_whole(
    job: Job, handle: RequestHandle, clock: JobClock, request: Request, replica: Replica
) -> RequestOutput | None:
    """A whole answer's finished output, observed; None when the client left first (its
    blocks are freed at once). An engine failure is a 500."""
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
        return None
    output = collect.result()
    if output.error is not None:
        raise _engine_error(output.error)
    _observe(job, output, clock, replica)
    return output


def _engine_error(message: str) -> OpenAIError:
    """A request the engine failed (never the client's input: that is checked first)."""
    return OpenAIError(message, status=500, type="server_error", code="engine_error")


def _cancel_unfinished(handle: RequestHandle, job: Job, replica: Replica) -> None:
    if not handle.finished:
        replica.engine.cancel(job.engine_request_id)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(handle: RequestHandle, clock: JobClock, replica: Replica) -> RequestOutput:
    async for delta in handle:
        clock.tick(len(delta.token_ids), replica.metrics)
    return _output(handle)


def _output(handle: RequestHandle) -> RequestOutput:
    """The finished request's output; the delta stream has been consumed to its end."""
    output: RequestOutput | None = handle.output
    assert output is not None, "the stream ended, so the engine closed the handle"
    return output


def _full_body(job: Job, output: RequestOutput) -> dict[str, Any]:
    choices = [
        fmt.Choice(c.index, job.echo_prefix + c.text, c.finish_reason, c.stop_reason)
        for c in output.choices
    ]
    use = fmt.Usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
    build = fmt.chat_completion if job.chat else fmt.text_completion
    body = build(job.response_id, job.model, job.created, choices, use)
    if job.parse_tools:
        for choice, out in zip(body["choices"], output.choices, strict=True):
            choice["message"], choice["finish_reason"] = parsed_message(
                out.text, out.finish_reason, job.single_tool_call
            )
    return body


async def _stream(
    job: Job,
    handle: RequestHandle,
    clock: JobClock,
    replica: Replica,
    *,
    index_base: int = 0,
    tail: bool = True,
) -> AsyncIterator[bytes]:
    """One engine request's chunks; ``index_base``: where its choices' indexes start (a
    batch's prompt), ``tail``: whether it ends the stream (usage chunk, ``[DONE]``)."""
    finished = False
    tools = (
        ToolCallChunks(job.response_id, job.model, job.created, job.single_tool_call)
        if job.parse_tools
        else None
    )
    try:
        for index in range(index_base, index_base + job.params.n):
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
            index = index_base + delta.index
            if tools is not None:
                for tool_chunk in tools.chunks(index, delta.text, delta.finish_reason):
                    yield fmt.sse(tool_chunk)
                continue
            if job.chat:
                chunk = fmt.chat_chunk(
                    job.response_id,
                    job.model,
                    job.created,
                    index,
                    content=delta.text or None,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
            else:
                chunk = fmt.text_chunk(
                    job.response_id,
                    job.model,
                    job.created,
                    index,
                    delta.text,
                    delta.finish_reason,
                    delta.stop_reason,
                )
            yield fmt.sse(chunk)
        output = _output(handle)
        finished = True
        if output.error is not None:
            # Headers are sent: the error goes in the stream, as OpenAI's does.
            error = _engine_error(output.error)
            replica.metrics.request_errors.labels(code=error.code).inc()
            yield fmt.sse(error.body())
            if tail:
                yield fmt.SSE_DONE
            return
        _observe(job, output, clock, replica)
        if not tail:
            return
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
