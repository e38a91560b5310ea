"""vLLM's token-in/token-out API on the built-in replica: ``POST /inference/v1/generate``
and ``POST /inference/v1/abort_requests``, as vLLM 0.32 serves them (``--enable-scale-out``,
``--tokens-only``).

RL rollouts, and vLLM's render → generate → derender split, send token ids and read
token ids back. A request runs as the completion its ``token_ids`` and ``sampling_params``
make (``jobs_from_completion``), so the replica's limits, vocabulary checks, sampling,
grammars and log probabilities are the completion path's; what differs is vLLM's:

* a missing ``max_tokens`` runs to the context, and one past it is cut to it (not refused);
* the answer is vLLM's: ``request_id`` ``generate-tokens-`` + the ``x-request-id`` header,
  else the body's ``request_id``, else a random one; choices with ``token_ids``,
  ``stop_reason``, the text in ``output_mode`` ``text``; log probabilities by token id in
  ``tokens`` mode, chat-shaped in ``text`` mode; the fields it has nothing for null;
* multimodal input, KV/EC transfer parameters and the engine extras of
  ``sampling_params`` it cannot honour are refused (400); ``priority`` is taken and
  ignored (as vLLM's CPU server does); unknown fields are ignored.

A generate request in flight can be aborted by its answer's ``request_id``: it then ends
with finish_reason ``abort`` (a whole answer is still a 200; a stream's last chunk says
``abort``), its blocks freed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.background import BackgroundTasks

from prefixgate.json_body import load_json_object
from prefixgate.wire import OpenAIError, StreamOptions, parse_request
from replica import logprobs_format as lf
from replica import openai_format as fmt
from replica.handle import RequestHandle
from replica.jobs import (
    Job,
    JobClock,
    check_in_vocab,
    jobs_from_completion,
    off_loop_if_large,
    work_size,
)
from replica.request import ChoiceOutput, Delta, RequestOutput, TokenLogprob
from replica.respond import (
    _decoder,
    _engine_error,
    _observe,
    _submit,
    collect_whole,
    event_stream,
    named_request,
)
from replica.state import Replica

ID_PREFIX = "generate-tokens-"

# vLLM's sampling parameters the completion path reads under the same names (and those
# it refuses: the same 400 here).
_SAMPLING_FIELDS = (
    *("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"),
    *("stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output"),
    *("skip_special_tokens", "logprobs", "prompt_logprobs", "allowed_token_ids"),
    *("structured_outputs", "bad_words", "logprob_token_ids", "thinking_token_budget"),
    "truncate_prompt_tokens",
)
# Sampling parameters that change the answer and that this replica cannot honour, with
# the values that ask for nothing. The others vLLM reads (output_kind, stream_interval,
# spaces_between_special_tokens, flat_logprobs, ...) leave the answer as it is: ignored.
_SAMPLING_NOT_DONE: dict[str, tuple[object, ...]] = {
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "logits_processors": (None, []),
    "extra_args": (None, {}),
    "repetition_detection": (None,),
    "skip_reading_prefix_cache": (None, False),
    "watermarking": (None, False),
    "trace_decode_token_ids": (None,),
}
# Request fields this replica cannot honour unless null: what each asks for.
_NOT_DONE = {
    "features": "multimodal input",
    "content_parts": "multimodal input",
    "kv_transfer_params": "KV cache transfer (disaggregated serving)",
    "ec_transfer_params": "encoder cache transfer (disaggregated serving)",
}


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM ignores fields it does not know

    token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: StrictStr | None = None
    request_id: StrictStr | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    priority: StrictInt = 0  # taken and ignored, as vLLM's CPU server does
    token_offsets: Any = None  # the render step's character offsets: nothing to do
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None


@dataclass(slots=True)
class Generation:
    """One accepted generate request: its completion job and how its answer is shaped."""

    job: Job
    request_id: str  # "generate-tokens-…": the answer's, and what abort_requests names
    text: bool  # output_mode "text": the answer carries the text too
    return_token_ids: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats, with include_usage


def read_generate(body: dict[str, Any], replica: Replica) -> tuple[GenerateRequest, Job]:
    """The request, checked as vLLM checks it, and the completion job it runs as."""
    req = parse_request(GenerateRequest, body)
    check_in_vocab(req.token_ids, int(replica.loaded.vocab_size), "token_ids")
    for name, what in _NOT_DONE.items():
        if getattr(req, name) is not None:
            raise _not_done(name, what)
    if req.cache_salt == "":
        raise _invalid(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    return req, jobs_from_completion(_completion_body(req, replica), replica)[0]


def _completion_body(req: GenerateRequest, replica: Replica) -> dict[str, Any]:
    """The /v1/completions body a generate request runs as."""
    sampling = req.sampling_params
    for name, neutral in _SAMPLING_NOT_DONE.items():
        if sampling.get(name) not in neutral:
            raise _not_done(f"sampling_params.{name}", "vLLM's engine extras")
    detokenize = sampling.get("detokenize", True)
    if not isinstance(detokenize, bool):
        raise _invalid("sampling_params.detokenize: must be a boolean", "detokenize")
    if not detokenize and req.output_mode == "text":
        raise _invalid("output_mode='text' requires sampling_params.detokenize to be true")
    if not detokenize and sampling.get("stop"):
        raise _invalid("stop strings are only supported when detokenize is true", "stop")
    body = {k: sampling[k] for k in _SAMPLING_FIELDS if sampling.get(k) is not None}
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        if max_tokens < 1:
            raise _invalid(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        room = int(replica.loaded.max_context) - len(req.token_ids)
        if room >= 1:  # (no room at all: the completion path says the prompt is too long)
            body["max_tokens"] = min(max_tokens, room)  # vLLM cuts it to the context
    body.update(
        model=replica.served_model_name if req.model is None else req.model,
        prompt=req.token_ids,
        stream=req.stream is True,
    )
    if req.stream_options is not None:
        body["stream_options"] = {"include_usage": req.stream_options.include_usage}
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    return body


def _not_done(name: str, what: str) -> OpenAIError:
    return OpenAIError(
        f"{name} ({what}) is not supported by this replica; leave it out or null",
        param=name,
        code="unsupported_value",
    )


def _invalid(message: str, param: str = "body") -> OpenAIError:
    return OpenAIError(message, param=param, code="invalid_value")


def request_id(request: Request, given: str | None) -> str:
    """The answer's ``request_id``: ``generate-tokens-`` and the request's name
    (``named_request``), or a random one."""
    return ID_PREFIX + (named_request(request, given) or uuid.uuid4().hex[:16])


# ---------------------------------------------------------------------------- answers


def token_logprobs(lps: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    """Tokens mode's ``logprobs``: per token its id, log probability and rank, and its
    ``max(k, 1)`` entries by id (its own first, then the likeliest), as vLLM's."""
    content = []
    for lp in lps:
        top = [
            {"token_id": t, "logprob": max(v, lf.FLOOR), "rank": r}
            for t, v, r in lf._entries(lp)[: max(k, 1)]
        ]
        content.append(
            {
                "token_id": lp.token_id,
                "logprob": max(lp.logprob, lf.FLOOR),
                "rank": lp.rank,
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _choice(gen: Generation, c: ChoiceOutput | Delta, replica: Replica) -> dict[str, Any]:
    """A finished choice (``ChoiceOutput``) or a stream's piece of one (``Delta``)."""
    k = gen.job.params.logprobs
    logprobs = None
    if k is not None and gen.text:
        logprobs = lf.chat_logprobs(c.logprobs or [], max(k, 1), _decoder(replica))
    elif k is not None:
        logprobs = token_logprobs(c.logprobs or [], k)
    choice: dict[str, Any] = {
        "index": c.index,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "token_ids": c.token_ids,
        # vLLM's, for MoE routing, sampling masks and weight updates: none here.
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
    }
    if gen.text:
        choice["text"] = c.text
    choice["logprobs"] = logprobs
    return choice


def _usage(out: RequestOutput, *, whole: bool) -> dict[str, Any]:
    """vLLM's usage: a whole answer's with its null details, a stream's without."""
    details: dict[str, Any] = {"cached_tokens": out.cached_tokens}
    use: dict[str, Any] = {
        "prompt_tokens": out.prompt_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "completion_tokens": out.completion_tokens,
        "prompt_tokens_details": details,
    }
    if whole:
        details.update(created_cache_tokens=None, multimodal_tokens=None)
        use["completion_tokens_details"] = None
    return use


def _usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def whole_body(gen: Generation, out: RequestOutput, replica: Replica) -> dict[str, Any]:
    job = gen.job
    prompt = out.prompt_logprobs
    return {
        "request_id": gen.request_id,
        "model": replica.served_model_name,
        "created": job.created,
        "usage": _usage(out, whole=True),
        "prompt_logprobs": None
        if prompt is None
        else lf.raw_prompt_logprobs(prompt, _decoder(replica)),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": job.prompt_ids if gen.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "text" if gen.text else "tokens",
        "choices": [_choice(gen, c, replica) for c in out.choices],
    }


async def chunks(
    gen: Generation, handle: RequestHandle, clock: JobClock, replica: Replica
) -> AsyncIterator[bytes]:
    """A stream's chunks, as vLLM's: one per delta with tokens, text or a finish (an
    abort's has none), the prompt's ids on the first; the usage chunk; ``[DONE]``."""
    job = gen.job
    mode = "text" if gen.text else "tokens"
    prompt_ids = job.prompt_ids if gen.return_token_ids else None
    produced = [0] * job.params.n
    try:
        async for delta in handle:
            clock.tick(len(delta.token_ids), replica.metrics)
            produced[delta.index] += len(delta.token_ids)
            if not (delta.token_ids or delta.finish_reason or (gen.text and delta.text)):
                continue
            chunk: dict[str, Any] = {"request_id": gen.request_id, "usage": None}
            if gen.continuous_usage:  # this choice's tokens so far, as vLLM counts
                chunk["usage"] = _usage_so_far(handle.prompt_tokens, produced[delta.index])
            if prompt_ids is not None:
                chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
            chunk["output_mode"] = mode
            chunk["choices"] = [_choice(gen, delta, replica)]
            yield fmt.sse(chunk)
        out = handle.output
        assert out is not None, "the stream ended, so the engine closed the handle"
        if out.error is not None:
            error = _engine_error(out.error)
            replica.metrics.request_errors.labels(code=error.code).inc()
            yield fmt.sse(error.body())
            yield fmt.SSE_DONE
            return
        _observe(job, out, clock, replica)
        if job.include_usage:
            use = _usage(out, whole=False)
            yield fmt.sse(
                {"request_id": gen.request_id, "usage": use, "output_mode": mode, "choices": []}
            )
        yield fmt.SSE_DONE
    finally:
        if not handle.finished:  # the client left: free the blocks now
            replica.engine.cancel(job.engine_request_id)


# ---------------------------------------------------------------------------- in flight


@dataclass(slots=True)
class InFlight:
    """Generate requests not yet finished, by their answer's request id, for
    ``abort_requests``. Clients choose ids, so one id may name several requests.

    Each is forgotten when its answer ends, however it ends (a stream's in the task that
    runs after it, which runs even when its client left before it began), so it holds at
    most the requests being answered."""

    handles: dict[str, dict[str, RequestHandle]] = field(default_factory=dict)

    def add(self, request_id: str, engine_request_id: str, handle: RequestHandle) -> None:
        self.handles.setdefault(request_id, {})[engine_request_id] = handle

    def forget(self, request_id: str, engine_request_id: str) -> None:
        by_engine_id = self.handles.get(request_id)
        if by_engine_id is None:
            return
        by_engine_id.pop(engine_request_id, None)
        if not by_engine_id:
            del self.handles[request_id]

    def abort(self, request_ids: Sequence[str], replica: Replica) -> None:
        for rid in request_ids:
            for eid in self.handles.get(rid, {}):
                replica.engine.cancel(eid)  # it ends with finish_reason "abort"


# ---------------------------------------------------------------------------- routes


async def generate(request: Request, replica: Replica, in_flight: InFlight) -> Response:
    raw = await request.body()
    req, job = await off_loop_if_large(
        work_size(raw), lambda: read_generate(load_json_object(raw), replica)
    )
    options = req.stream_options
    extra = (options.model_extra or {}) if options is not None else {}
    gen = Generation(
        job,
        request_id(request, req.request_id),
        text=req.output_mode == "text",
        return_token_ids=req.return_token_ids is True,
        continuous_usage=job.include_usage and extra.get("continuous_usage_stats") is True,
    )
    clock = JobClock(start=time.perf_counter())
    handle = _submit(job, replica)
    in_flight.add(gen.request_id, job.engine_request_id, handle)
    if job.stream:
        response = event_stream(chunks(gen, handle, clock, replica), handle, job, replica)
        after = BackgroundTasks([response.background] if response.background else [])
        after.add_task(in_flight.forget, gen.request_id, job.engine_request_id)
        response.background = after
        return response
    try:
        out = await collect_whole(job, handle, clock, request, replica)
    finally:
        in_flight.forget(gen.request_id, job.engine_request_id)
    if out is None:
        return Response(status_code=499)
    return JSONResponse(whole_body(gen, out, replica))


async def abort_requests(request: Request, replica: Replica, in_flight: InFlight) -> Response:
    """Abort the generate requests named (by their answers' ``request_id``); unknown or
    finished ones are ignored. 200 with an empty body, as vLLM's."""
    body = load_json_object(await request.body())
    ids = body.get("request_ids")
    if ids is None:
        raise OpenAIError("Missing 'request_ids' in request body", param="request_ids")
    if isinstance(ids, str):  # vLLM takes one id as well as a list
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise OpenAIError("request_ids: must be a list of request ids", param="request_ids")
    in_flight.abort(ids, replica)
    return Response(status_code=200)


def add_tokens_routes(app: FastAPI, replica: Replica) -> None:
    in_flight = InFlight()

    @app.post("/inference/v1/generate")
    async def generate_tokens(request: Request) -> Response:
        return await generate(request, replica, in_flight)

    @app.post("/inference/v1/abort_requests")
    async def abort(request: Request) -> Response:
        return await abort_requests(request, replica, in_flight)
