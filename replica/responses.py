"""The Responses API on the built-in replica: ``POST /v1/responses`` (whole or streamed),
``GET`` / ``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A request runs as the chat it maps to (prefixgate/wire_responses.py), so its prompt is
rendered, checked and tool-parsed exactly as a chat completion. With ``store`` (the
default) the conversation it ended is kept (replica/response_store.py); a follow-up naming
it in ``previous_response_id`` renders that conversation first, so its prompt starts with
the previous prompt and reuses its cached blocks. Usage reports
``input_tokens_details.cached_tokens``.

Responses run in the foreground: there is nothing in flight to cancel by id, so
``cancel`` of a stored response is a 400 that says so, and of an unknown one a 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixgate.json_body import load_json_body
from prefixgate.wire import OpenAIError, parse_request
from prefixgate.wire_responses import ResponsesRequest, chat_body, input_messages
from replica import logprobs_format as lf
from replica.handle import RequestHandle
from replica.jobs import Job, JobClock, job_from_chat, off_loop_if_large, work_size
from replica.request import MAX_LOGPROBS, RequestOutput, TokenLogprob
from replica.respond import (
    _decoder,
    _engine_error,
    _observe,
    _submit,
    collect_whole,
    event_stream,
)
from replica.state import Replica
from replica.tool_output import forced_calls
from replica.tool_parser import HermesStream, ParsedCall, parse_hermes


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(
        f"Response with id '{response_id}' not found on this replica (never stored, "
        "deleted, or dropped from its bounded store).",
        status=404,
        param=param,
        code="response_not_found",
    )


class Turn:
    """One response being made: its request, ids and the conversation it extends."""

    def __init__(self, req: ResponsesRequest, job: Job, history: list[dict[str, Any]]) -> None:
        self.req = req
        self.job = job
        self.id = _id("resp")
        self.created = int(time.time())
        self.messages = [*history, *input_messages(req)]
        self.clock = JobClock(start=time.perf_counter())

    def body(
        self, status: str, output: list[dict[str, Any]], out: RequestOutput | None
    ) -> dict[str, Any]:
        req = self.req
        incomplete = out is not None and out.choices[0].finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self.job.model,
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "output": output,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "store": req.store,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "usage": _usage(out) if out is not None else None,
        }

    def logprobs(self, lps: list[TokenLogprob], replica: Replica) -> list[dict[str, Any]]:
        """The output text's log probabilities, as a chat's ``logprobs.content``."""
        k = self.job.params.logprobs or 0
        return list(lf.chat_logprobs(lps, k, _decoder(replica))["content"])

    def finish(self, out: RequestOutput, replica: Replica) -> dict[str, Any]:
        """The whole response; stored with its conversation when ``store``."""
        text = out.choices[0].text
        content: str | None
        if self.job.forced_tools:  # the text is the calls' JSON (a forced tool choice)
            content, calls = "", forced_calls(text, self.job.forced_tool_name)
        else:
            content, calls = parse_hermes(text) if self.job.parse_tools else (text, [])
        calls = calls[:1] if self.job.single_tool_call else calls
        message = message_item(_id("msg"), content) if content else None
        if message is not None and self.job.params.logprobs is not None:
            message["content"][0]["logprobs"] = self.logprobs(
                out.choices[0].logprobs or [], replica
            )
        items = ([message] if message is not None else []) + [function_item(call) for call in calls]
        body = self.body("completed", items, out)
        self.remember(content, calls, body, replica)
        return body

    def remember(
        self, content: str | None, calls: list[ParsedCall], body: dict[str, Any], replica: Replica
    ) -> None:
        if not self.req.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [call.as_dict() for call in calls]
        replica.responses.put(self.id, [*self.messages, reply], body)


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_item(call: ParsedCall, arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.rsplit("-", 1)[-1],
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": "completed",
    }


async def create(request: Request, replica: Replica) -> Response:
    raw = await request.body()
    req = await off_loop_if_large(
        len(raw), lambda: parse_request(ResponsesRequest, load_json_body(raw))
    )
    history: list[dict[str, Any]] = []
    # What building the job will cost: the request and its history (and a grammar, for
    # a forced tool or a ``text.format``).
    size = work_size(raw, (b'"tool_choice"', b'"format"'))
    if req.previous_response_id is not None:
        previous = replica.responses.get(req.previous_response_id)  # (the store is the loop's)
        if previous is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history, size = previous.messages, size + previous.size
    job = await off_loop_if_large(size, lambda: job_from_chat(chat_body(req, history), replica))
    job.params.logprobs = _logprobs_asked(req)
    turn = Turn(req, job, history)
    handle = _submit(job, replica)
    if req.stream:
        return event_stream(_events(turn, handle, replica), handle, job, replica)
    out = await collect_whole(job, handle, turn.clock, request, replica)
    if out is None:  # the client left: its blocks are already free
        return Response(status_code=499)
    return JSONResponse(turn.finish(out, replica))


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs_asked(req: ResponsesRequest) -> int | None:
    """vLLM's rule: the output text's log probabilities when ``include`` names them, with
    ``top_logprobs`` alternatives each (0 by default); None when not asked for."""
    extra = req.model_extra or {}
    include = extra.get("include")
    if not isinstance(include, list) or LOGPROBS_INCLUDE not in include:
        return None
    k = extra.get("top_logprobs")
    k = 0 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise OpenAIError(
            f"top_logprobs: an integer from 0 to {MAX_LOGPROBS}, got {k!r}",
            param="top_logprobs",
            code="invalid_value",
        )
    return k


class EventWriter:
    """Server-sent events of one streamed response, numbered."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _events(turn: Turn, handle: RequestHandle, replica: Replica) -> AsyncIterator[bytes]:
    event = EventWriter()
    yield event("response.created", response=turn.body("in_progress", [], None))
    parser = HermesStream() if turn.job.parse_tools else None
    message_id = _id("msg")
    text = ""  # the message's content so far
    calls: list[ParsedCall] = []
    items: list[dict[str, Any]] = []
    scored: list[TokenLogprob] = []  # tokens whose text has not gone out yet
    forced = ""  # a forced tool choice's text: its calls go out when it ends
    async for delta in handle:
        turn.clock.tick(len(delta.token_ids), replica.metrics)
        scored += delta.logprobs or []
        if turn.job.forced_tools:
            forced += delta.text
            if delta.finish_reason is None:
                continue
            content, done = "", forced_calls(forced, turn.job.forced_tool_name)
        else:
            content, done = parser.feed(delta.text) if parser is not None else (delta.text, [])
        if delta.finish_reason is not None and parser is not None and not turn.job.forced_tools:
            tail, more = parser.finish()
            content, done = content + tail, [*done, *more]
        if content:
            if not text:
                yield event(
                    "response.output_item.added",
                    output_index=0,
                    item=message_item(message_id, "", "in_progress"),
                )
            text += content
            scores: dict[str, Any] = {}
            if turn.job.params.logprobs is not None:
                scores["logprobs"], scored = turn.logprobs(scored, replica), []
            yield event(
                "response.output_text.delta",
                item_id=message_id,
                output_index=0,
                content_index=0,
                delta=content,
                **scores,
            )
        for call in done:
            if turn.job.single_tool_call and calls:
                break  # parallel_tool_calls false: the first call only, as vLLM does
            calls.append(call)
            item = function_item(call)
            index = len(calls) - (0 if text else 1)
            yield event(
                "response.output_item.added", output_index=index, item=function_item(call, "")
            )
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=call.arguments,
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=call.arguments,
            )
            yield event("response.output_item.done", output_index=index, item=item)
            items.append(item)
    out = handle.output
    assert out is not None, "the stream ended, so the engine closed the handle"
    if out.error is not None:
        error = _engine_error(out.error)
        yield event("error", message=error.message, code=error.code, param=None)
        return
    _observe(turn.job, out, turn.clock, replica)
    if text:
        yield event(
            "response.output_text.done", item_id=message_id, output_index=0, content_index=0,
            text=text,
        )  # fmt: skip
        message = message_item(message_id, text)
        yield event("response.output_item.done", output_index=0, item=message)
        items.insert(0, message)
    body = turn.body("completed", items, out)
    turn.remember(text or None, calls, body, replica)
    yield event("response.completed", response=body)


def add_response_routes(app: FastAPI, replica: Replica) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await create(request, replica)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        stored = replica.responses.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not replica.responses.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        if replica.responses.get(response_id) is None:
            raise not_found(response_id)
        raise OpenAIError(
            f"Response '{response_id}' has completed; only background responses can be "
            "cancelled, and this replica runs none.",
            param="response_id",
            code="not_cancellable",
        )
