"""Anthropic's Messages API on the built-in replica: ``POST /v1/messages`` (whole or
streamed) and ``POST /v1/messages/count_tokens``, as vLLM 0.32 serves them.

Claude Code and other Anthropic clients send ``ANTHROPIC_BASE_URL`` traffic to the
gateway, which routes it to a replica (gateway/messages.py); vLLM serves it, and so
does the built-in replica (``make demo``, sim clusters). A request runs as the chat
completion it reads as (prefixgate/wire_messages.py): rendered, checked and tool-parsed
exactly as a chat, so an agent's steps share their cached blocks with each other and with
the gateway's keys.

The answer is Anthropic's: content blocks (``text``, then ``tool_use`` with the parsed
arguments as ``input``), ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence`` with the string that matched, ``tool_use``) and usage split as vLLM
splits it: ``cache_read_input_tokens`` read from the cache,
``cache_creation_input_tokens`` written to it (the prompt's other full blocks),
``input_tokens`` the rest. A stream is ``message_start`` at the first token (the prefill
is over, as vLLM sends it), content blocks, ``message_delta`` with the stop reason and
usage, then ``message_stop``; an engine failure mid-stream is an ``error`` event. Errors
are Anthropic-shaped (``{"type": "error", "error": {"type", "message"}}``) with the
status and ``Retry-After`` of the OpenAI error they stand for.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixgate.json_body import load_json_object
from prefixgate.wire import OpenAIError
from prefixgate.wire_messages import chat_request, error_payload
from replica.handle import RequestHandle
from replica.jobs import Job, JobClock, job_from_chat, off_loop_if_large, work_size
from replica.request import RequestOutput
from replica.respond import _engine_error, _observe, _submit, collect_whole, event_stream
from replica.state import Replica
from replica.tool_output import forced_calls
from replica.tool_parser import HermesStream, ParsedCall, parse_hermes


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_payload(err.status, err.message), err.status, err.headers)


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def usage(out: RequestOutput, block_size: int) -> dict[str, int]:
    """Anthropic's split of the prompt, as vLLM makes it: tokens read from the cache,
    tokens written to it (the prompt's full blocks not read), and the rest."""
    written = max(0, out.prompt_tokens // block_size * block_size - out.cached_tokens)
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": out.cached_tokens,
        "output_tokens": out.completion_tokens,
    }


def stop_reason(out: RequestOutput, called: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` as vLLM maps a chat's finish: ``max_tokens``
    always wins, then a tool call, then the stop string that matched."""
    choice = out.choices[0]
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # a stop token id is no stop sequence
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def tool_use(call: ParsedCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


class Message:
    """One message being made: its job and the message object around its content."""

    def __init__(self, job: Job, block_size: int) -> None:
        self.job = job
        self.block_size = block_size
        self.id = f"msg_{uuid.uuid4().hex}"
        self.clock = JobClock(start=time.perf_counter())

    def body(
        self, content: list[dict[str, Any]], out: RequestOutput | None, called: bool
    ) -> dict[str, Any]:
        reason, sequence = stop_reason(out, called) if out is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.job.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(out, self.block_size) if out is not None else None,
        }

    def finish(self, out: RequestOutput) -> dict[str, Any]:
        text = out.choices[0].text
        content: str | None
        if self.job.forced_tools:  # tool_choice any or tool: the text is the calls' JSON
            content, calls = "", forced_calls(text, self.job.forced_tool_name)
        else:
            content, calls = parse_hermes(text) if self.job.parse_tools else (text, [])
        calls = calls[:1] if self.job.single_tool_call else calls
        blocks = [{"type": "text", "text": content}] if content else []
        blocks += [tool_use(call) for call in calls]
        # An empty answer is one empty text block, not none: clients read content[0].
        return self.body(blocks or [{"type": "text", "text": ""}], out, bool(calls))


async def _anthropic(work: Callable[[], Awaitable[Response]]) -> Response:
    try:
        return await work()
    except OpenAIError as err:
        return error_response(err)


async def create(request: Request, replica: Replica) -> Response:
    raw = await request.body()

    def read() -> tuple[Job, bool]:
        body = load_json_object(raw)
        return job_from_chat(chat_request(body), replica), body.get("stream") is True

    job, stream = await off_loop_if_large(work_size(raw), read)
    message = Message(job, int(replica.engine.pool.block_size))
    handle = _submit(job, replica)
    if stream:
        return event_stream(_events(message, handle, replica), handle, job, replica)
    out = await collect_whole(job, handle, message.clock, request, replica)
    if out is None:
        return Response(status_code=499)
    return JSONResponse(message.finish(out))


async def _events(
    message: Message, handle: RequestHandle, replica: Replica
) -> AsyncIterator[bytes]:
    job = message.job
    parser = HermesStream() if job.parse_tools else None
    index = -1  # the open content block's, or the last one's
    text_open = started = False
    calls: list[ParsedCall] = []
    forced = ""  # a forced tool choice's text: its calls go out when it ends
    async for delta in handle:
        message.clock.tick(len(delta.token_ids), replica.metrics)
        if not started:  # the first token: the prefill is over
            started = True
            start = message.body([], None, False)
            start["usage"] = {"input_tokens": handle.prompt_tokens, "output_tokens": 0}
            yield sse("message_start", {"message": start})
        if job.forced_tools:
            forced += delta.text
            text = ""
            done = [] if delta.finish_reason is None else forced_calls(forced, job.forced_tool_name)
        else:
            text, done = parser.feed(delta.text) if parser is not None else (delta.text, [])
        if delta.finish_reason is not None and parser is not None and not job.forced_tools:
            tail, more = parser.finish()
            text, done = text + tail, [*done, *more]
        if text:
            if not text_open:
                index, text_open = index + 1, True
                block = {"type": "text", "text": ""}
                yield sse("content_block_start", {"index": index, "content_block": block})
            delta_ = {"type": "text_delta", "text": text}
            yield sse("content_block_delta", {"index": index, "delta": delta_})
        for call in done:
            if job.single_tool_call and calls:
                break  # disable_parallel_tool_use: the first call only, as vLLM does
            calls.append(call)
            if text_open:
                text_open = False
                yield sse("content_block_stop", {"index": index})
            index += 1
            opened = {**tool_use(call), "input": {}}  # the arguments follow as a delta
            yield sse("content_block_start", {"index": index, "content_block": opened})
            delta_ = {"type": "input_json_delta", "partial_json": call.arguments}
            yield sse("content_block_delta", {"index": index, "delta": delta_})
            yield sse("content_block_stop", {"index": index})
    out = handle.output
    assert out is not None, "the stream ended, so the engine closed the handle"
    if out.error is not None:
        error = _engine_error(out.error)
        replica.metrics.request_errors.labels(code=error.code).inc()
        yield sse("error", {"error": error_payload(error.status, error.message)["error"]})
        return
    _observe(job, out, message.clock, replica)
    if text_open:
        yield sse("content_block_stop", {"index": index})
    reason, sequence = stop_reason(out, bool(calls))
    yield sse(
        "message_delta",
        {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(out, message.block_size),
        },
    )
    yield sse("message_stop", {})


async def count_tokens(request: Request, replica: Replica) -> dict[str, Any]:
    """The prompt's tokens as a message would render it (vLLM's count)."""
    raw = await request.body()

    def read() -> Job:
        # A count has no max_tokens, and parses no answer: its tools are rendered
        # whatever the tool choice, on a replica with or without a tool-call parser.
        body = {**load_json_object(raw), "max_tokens": 1, "tool_choice": {"type": "none"}}
        return job_from_chat(chat_request(body), replica)

    job = await off_loop_if_large(work_size(raw), read)
    count = len(job.prompt_ids)
    return {"input_tokens": count, "context_management": {"original_input_tokens": count}}


def add_messages_routes(app: FastAPI, replica: Replica) -> None:
    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        return await _anthropic(lambda: create(request, replica))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> Response:
        return await _anthropic(lambda: _json(count_tokens(request, replica)))


async def _json(work: Awaitable[dict[str, Any]]) -> Response:
    return JSONResponse(await work)
