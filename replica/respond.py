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

from prefixgate.guard import REQUEST_ID_MADE
from prefixgate.wire import OpenAIError
from replica import logprobs_format as lf
from replica import openai_format as fmt
from replica.handle import RequestHandle
from replica.jobs import Job, JobClock
from replica.request import (
    Delta,
    EngineStopped,
    PromptTooLong,
    QueueFull,
    RequestOutput,
    TokenLogprob,
)
from replica.state import Replica
from replica.tool_output import ToolCallChunks, forced_message, parsed_message

log = logging.getLogger("prefixgate.replica.server")


def named_request(request: Request, given: object) -> str | None:
    """The id the request is named by, as vLLM names it: the client's ``x-request-id``
    header (one the replica took: the guard and the middleware replace a bad one), else
    the body's ``request_id`` (``given``); None when it has neither. vLLM's answer ids
    are made of it (``chatcmpl-ID``, ``cmpl-ID``, ``generate-tokens-ID``); a gateway in
    front sends its request id as the header, so the answer's id is its log line's."""
    header = request.headers.get("x-request-id")
    made = request.scope.get(REQUEST_ID_MADE, False)  # the guard's, not the client's
    if header is not None and not made and header == request.state.request_id:
        return header
    return given if isinstance(given, str) and given else None


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
    return JSONResponse(_full_body(job, output, replica))


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
        choices += _choices(job, output, replica, (job.part or 0) * job.params.n)
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


def _decoder(replica: Replica, job: Job | None = None) -> lf.Decode:
    """One token id's text, as vLLM reports a log probability's token: special tokens
    included; ``token_id:N`` under vLLM's ``return_tokens_as_token_ids``."""
    if job is not None and job.token_id_strings:
        return lambda token_id: f"token_id:{token_id}"
    tokenizer = replica.loaded.tokenizer
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _choices(job: Job, output: RequestOutput, replica: Replica, base: int = 0) -> list[fmt.Choice]:
    """A finished request's choices (indexes from ``base``), with their log
    probabilities when asked for: a completion's echo scores its prompt first."""
    k = job.params.logprobs
    prompt = output.prompt_logprobs
    decode = _decoder(replica, job)
    choices = []
    for c in output.choices:
        logprobs = None
        if k is not None and job.chat:
            logprobs = lf.chat_logprobs(c.logprobs or [], k, decode)
        elif k is not None:
            ids = [] if job.echo_only else c.token_ids
            lps: list[TokenLogprob | None] = [] if job.echo_only else list(c.logprobs or [])
            if job.echo:
                ids = job.prompt_ids + ids
                lps = [*(prompt or [None] * len(job.prompt_ids)), *lps]
            logprobs = lf.completion_logprobs(ids, lps, k, decode)
        raw = None if job.chat or prompt is None else lf.raw_prompt_logprobs(prompt, decode)
        text = job.echo_prefix + ("" if job.echo_only else c.text)
        choice = fmt.Choice(base + c.index, text, c.finish_reason, c.stop_reason, logprobs, raw)
        if job.return_token_ids:
            choice.token_ids = [] if job.echo_only else c.token_ids
            choice.prompt_token_ids = None if job.chat else job.prompt_ids
        choices.append(choice)
    return choices


def _full_body(job: Job, output: RequestOutput, replica: Replica) -> dict[str, Any]:
    choices = _choices(job, output, replica)
    use = fmt.Usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
    if job.chat:
        prompt = output.prompt_logprobs
        raw = None if prompt is None else lf.raw_prompt_logprobs(prompt, _decoder(replica, job))
        prompt_ids = job.prompt_ids if job.return_token_ids else None
        body = fmt.chat_completion(
            job.response_id, job.model, job.created, choices, use, raw, prompt_ids
        )
    else:
        body = fmt.text_completion(job.response_id, job.model, job.created, choices, use)
    if job.parse_tools:
        for choice, out in zip(body["choices"], output.choices, strict=True):
            choice["message"], choice["finish_reason"] = parsed_message(
                out.text, out.finish_reason, job.single_tool_call
            )
    elif job.forced_tools:
        for choice, out in zip(body["choices"], output.choices, strict=True):
            choice["message"], choice["finish_reason"] = forced_message(
                out.text, out.finish_reason, job.forced_tool_name
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
        if job.parse_tools or job.forced_tools
        else None
    )
    forced: dict[int, str] = {}  # a forced tool choice's text so far, per choice
    scores = _StreamedLogprobs(job, replica) if job.params.logprobs is not None else None
    ids = _StreamedIds(job) if job.return_token_ids else None
    # An echo that reports log probabilities goes out with the first tokens, as vLLM's:
    # the prompt's are known only once it is computed.
    echo_later = job.echo and scores is not None
    try:
        for index in range(index_base, index_base + job.params.n):
            if job.chat:
                first = fmt.chat_chunk(
                    job.response_id, job.model, job.created, index, role="assistant", content=""
                )
            elif job.echo and not echo_later:
                first = fmt.text_chunk(
                    job.response_id, job.model, job.created, index, job.echo_prefix, None
                )
            else:
                continue
            yield fmt.sse(first if ids is None else ids.mark(first, index))
        async for delta in handle:
            clock.tick(len(delta.token_ids), replica.metrics)
            index = index_base + delta.index
            echo = echo_later and delta.prompt_logprobs is not None
            if job.echo_only:  # the prompt alone: its one generated token's text is not
                delta.text = ""
            if scores is not None:
                scores.add(index, delta)
            if ids is not None:
                ids.add(index, delta)
            if not delta.text and delta.finish_reason is None and not echo:
                continue  # held back (a stop string may be starting): its scores wait too
            if tools is not None:
                if job.forced_tools:
                    # The calls' JSON is held to the grammar: sent as calls when it ends.
                    forced[index] = forced.get(index, "") + delta.text
                    if delta.finish_reason is None:
                        continue
                    tool_chunks = tools.forced(
                        index, forced.pop(index), delta.finish_reason, job.forced_tool_name
                    )
                else:
                    tool_chunks = tools.chunks(index, delta.text, delta.finish_reason)
                for tool_chunk in tool_chunks:
                    if scores is not None:
                        tool_chunk["choices"][0]["logprobs"] = scores.take(index)
                    if ids is not None:
                        ids.mark(tool_chunk, index)
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
                    logprobs=None if scores is None else scores.take(index),
                )
            else:
                chunk = fmt.text_chunk(
                    job.response_id,
                    job.model,
                    job.created,
                    index,
                    job.echo_prefix + delta.text if echo else delta.text,
                    delta.finish_reason,
                    delta.stop_reason,
                    None if scores is None else scores.take(index),
                )
            yield fmt.sse(chunk if ids is None else ids.mark(chunk, index))
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


class _StreamedIds:
    """vLLM's ``return_token_ids`` in a stream: each chunk carries its tokens' ids (those
    held back go with the next chunk of their choice); the prompt's ids go with the
    stream's first chunk (a chat's) or each choice's first (a completion's)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.pending: dict[int, list[int]] = {}
        self.started: set[int] = set()

    def add(self, index: int, delta: Delta) -> None:
        if not self.job.echo_only:  # (its one generated token is not part of the answer)
            self.pending.setdefault(index, []).extend(delta.token_ids)

    def mark(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        choice = chunk["choices"][0]
        choice["token_ids"] = self.pending.pop(index, [])
        if self.job.chat and not self.started:
            chunk["prompt_token_ids"] = self.job.prompt_ids
        elif not self.job.chat and index not in self.started:
            choice["prompt_token_ids"] = self.job.prompt_ids
        self.started.add(index)
        return chunk


class _StreamedLogprobs:
    """A stream's log probabilities per choice: each chunk carries those of the tokens
    since the last chunk of its choice (tokens whose text is held back wait for it), a
    completion's with text offsets running on from its last chunk."""

    def __init__(self, job: Job, replica: Replica) -> None:
        self.job = job
        self.decode = _decoder(replica, job)
        self.k = job.params.logprobs or 0
        self.pending: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        self.offsets: dict[int, int] = {}

    def add(self, index: int, delta: Delta) -> None:
        ids, lps = self.pending.setdefault(index, ([], []))
        if self.job.echo and delta.prompt_logprobs is not None:
            ids += self.job.prompt_ids
            lps += delta.prompt_logprobs
        if not self.job.echo_only:  # (its one generated token is not part of the answer)
            ids += [lp.token_id for lp in delta.logprobs or ()]
            lps += delta.logprobs or []

    def take(self, index: int) -> dict[str, Any]:
        ids, lps = self.pending.pop(index, ([], []))
        if self.job.chat:
            return lf.chat_logprobs([lp for lp in lps if lp is not None], self.k, self.decode)
        offset = self.offsets.get(index, 0)
        logprobs = lf.completion_logprobs(ids, lps, self.k, self.decode, offset)
        self.offsets[index] = lf.next_offset(logprobs, offset)
        return logprobs


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
