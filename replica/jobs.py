"""From an OpenAI request body to what the engine runs: prompt ids, sampling, salt.

Everything a user can get wrong is checked here, before the engine sees the request, and
raised as an ``OpenAIError`` that names the field and what to fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prefixgate.chat_input import chat_input
from prefixgate.tools import NamedToolChoice, effective_tool_choice
from prefixgate.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_request,
)
from replica import openai_format as fmt
from replica.grammar import GrammarSpec, spec_from_fields
from replica.metrics import ReplicaMetrics
from replica.request import MAX_LOGPROBS, SamplingParams
from replica.state import Replica

log = logging.getLogger("prefixgate.replica")


@dataclass(slots=True)
class Job:
    """One accepted request, ready to submit."""

    chat: bool
    response_id: str  # "chatcmpl-…" / "cmpl-…": the request's name (a client's may repeat)
    model: str
    created: int
    prompt_ids: list[int]
    params: SamplingParams
    salt: str
    stream: bool
    include_usage: bool
    echo: bool = False  # a completion that answers with its prompt first
    echo_prefix: str = ""  # its prompt's text
    echo_only: bool = False  # ``max_tokens`` 0: the prompt alone (one token is generated)
    return_token_ids: bool = False  # vLLM's: the answer carries prompt and output ids
    token_id_strings: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" tokens
    parse_tools: bool = False  # tool choice auto with a parser: tool calls from the text
    forced_tools: bool = False  # tool choice required or named: the text is calls' JSON
    forced_tool_name: str | None = None  # the named function (None: required)
    single_tool_call: bool = False  # parallel_tool_calls false: the first call only
    part: int | None = None  # a batch's prompt number: its own engine request, one answer
    # The engine's id for it: unique, whatever the answer's id (a client names requests,
    # and may name two alike; the engine keys its requests by this).
    engine_request_id: str = field(default_factory=lambda: os.urandom(16).hex())


@dataclass(slots=True)
class JobClock:
    """Arrival, first-token and last-token times of one request (perf_counter seconds)."""

    start: float
    first: float | None = None
    last: float | None = None

    def tick(self, n_tokens: int, metrics: ReplicaMetrics) -> None:
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            metrics.time_to_first_token.observe(now - self.start)
            n_tokens -= 1  # the first token has a TTFT, not an inter-token latency
        elif self.last is not None:
            gap = (now - self.last) / n_tokens
            for _ in range(n_tokens):
                metrics.inter_token_latency.observe(gap)
        self.last = now


T = TypeVar("T")
INLINE_BODY_BYTES = 32 * 1024  # a request up to this size becomes a job on the event loop


# Keys of a body that may ask for a grammar: compiling one (and, the first time, loading
# xgrammar: about 2 s) must not hold the event loop, so such a body is built off it.
_GRAMMAR_KEYS = (b'"response_format"', b'"structured_outputs"', b'"tool_choice"')


def work_size(raw: bytes, keys: tuple[bytes, ...] = _GRAMMAR_KEYS) -> int:
    """What building a job from ``raw`` weighs for ``off_loop_if_large``: its size, or
    more than inline when it may ask for a grammar (has one of ``keys``)."""
    if any(key in raw for key in keys):
        return max(len(raw), INLINE_BODY_BYTES + 1)
    return len(raw)


async def off_loop_if_large(size: int, work: Callable[[], T]) -> T:
    """``work()`` on the event loop for a request of up to ``INLINE_BODY_BYTES``, else in
    a worker thread: parsing, rendering and BPE cost in proportion to the text, and 2 MiB
    of text never seen held every token stream of the replica for 1.6 s (16 MiB: a
    minute)."""
    if size <= INLINE_BODY_BYTES:
        return work()
    return await asyncio.to_thread(work)


# A text longer than this many characters per token of the context is encoded first in
# part: its head alone may prove it too long (English runs 4-5 characters per token).
PROBE_CHARS_PER_TOKEN = 8
_CUT_MARGIN = 16  # tokens a cut mid-text may add to the head's count


def encode_within(
    encode: Callable[[str], list[int]], text: str, max_context: int, param: str
) -> list[int]:
    """``encode(text)``, unless the text's head alone holds more tokens than the context:
    then a 400 without encoding the rest. Encoding 16 MiB of text took a minute and
    2.5 GB; its first ``PROBE_CHARS_PER_TOKEN`` x context characters say as much."""
    head_chars = PROBE_CHARS_PER_TOKEN * max_context
    if len(text) > head_chars:
        head = len(encode(text[:head_chars]))
        if head > max_context + _CUT_MARGIN:
            raise OpenAIError(
                f"This model's maximum context length is {max_context} tokens. However, your "
                f"prompt has more than {head - _CUT_MARGIN} tokens in its first "
                f"{head_chars} characters alone; shorten it to leave room for the completion.",
                param=param,
                code="context_length_exceeded",
            )
    return list(encode(text))


def job_from_chat(body: object, replica: Replica) -> Job:
    req = parse_request(ChatCompletionRequest, body)
    _check_limits(req)  # before any encoding
    model = check_model(req.model, replica)
    parse_tools = _tool_choice(req, replica)
    forced_spec, forced_name = _forced_tools(req)
    # A forced tool choice's grammar overrides response_format and structured_outputs,
    # as vLLM's does (its answer must be the calls).
    grammar = (
        _grammar(req, replica)
        if forced_spec is None
        else _compile(forced_spec, replica, "tool_choice")
    )
    chat = chat_input(req)
    if req.tools and replica.loaded.tokenizer.template_ignores_tools:
        _warn_tools_ignored(model, replica)
    encoder = replica.chats or replica.loaded.tokenizer
    text = encoder.render(chat)
    max_context = int(replica.loaded.max_context)
    encode = encoder.encode if req.add_special_tokens else encoder.encode_rendered
    prompt_ids = encode_within(encode, text, max_context, "messages")
    params = _sampling(req, req.max_new_tokens, len(prompt_ids), replica, "messages")
    params.grammar = grammar
    return Job(
        chat=True,
        response_id=fmt.new_id("chatcmpl"),
        model=model,
        created=fmt.now(),
        prompt_ids=prompt_ids,
        params=params,
        salt=req.cache_salt or "",
        stream=req.stream,
        include_usage=req.include_usage,
        parse_tools=parse_tools,
        single_tool_call=req.parallel_tool_calls is False,
        forced_tools=forced_spec is not None,
        forced_tool_name=forced_name,
        return_token_ids=_flag(req, "return_token_ids"),
        token_id_strings=_flag(req, "return_tokens_as_token_ids"),
    )


def _tool_choice(req: ChatCompletionRequest, replica: Replica) -> bool:
    """Check ``tool_choice`` as vLLM does; True when the answer is parsed for tool calls."""
    if req.tool_choice not in (None, "none") and not req.tools:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    choice = effective_tool_choice(req.tools, req.tool_choice)
    if isinstance(choice, NamedToolChoice):
        names = {tool.function.name for tool in req.tools or ()}
        if choice.function.name not in names:
            raise OpenAIError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
    if choice == "none":
        return False
    described = (
        f'function "{choice.function.name}"'
        if isinstance(choice, NamedToolChoice)
        else f'"{choice}"'
    )
    if replica.tool_call_parser is None:
        raise OpenAIError(
            f"tool_choice={described} requires the replica to be started with "
            "--tool-call-parser hermes (tools are sent without tool_choice: it defaults to "
            '"auto"); or send tool_choice "none"',
            param="tool_choice",
        )
    return choice == "auto"  # a forced choice is decoded under a grammar (_forced_tools)


def _forced_tools(req: ChatCompletionRequest) -> tuple[GrammarSpec | None, str | None]:
    """A forced tool choice's grammar, as vLLM builds it: a named function's arguments
    (its parameters' schema), or for ``required`` a JSON list of ``{"name",
    "parameters"}`` calls to the given tools (one at most without parallel calls); and
    the named function's name. (None, None) when the choice is not forced."""
    choice = effective_tool_choice(req.tools, req.tool_choice)
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools or () if t.function.name == choice.function.name)
        params = tool.function.parameters or {"type": "object", "properties": {}}
        return GrammarSpec("json_schema", json.dumps(params)), choice.function.name
    if choice != "required":
        return None, None
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                }
                for t in req.tools or ()
            ],
        },
    }
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(calls)), None


def _grammar(req: ChatCompletionRequest | CompletionRequest, replica: Replica) -> Any:
    """The compiled grammar of the structured output a request asks for (vLLM's
    ``response_format`` and ``structured_outputs``), or None."""
    extra = req.model_extra or {}
    structured = extra.get("structured_outputs")
    param = "structured_outputs" if structured is not None else "response_format"
    response_format: Any
    if isinstance(req, ChatCompletionRequest):  # a chat's is a checked field
        fmt_field = req.response_format
        response_format = None if fmt_field is None else fmt_field.model_dump()
    else:  # a completion's comes as sent (vLLM takes it there too)
        response_format = extra.get("response_format")
    try:
        if response_format is not None and not isinstance(response_format, dict):
            raise ValueError("response_format must be an object with a type")
        spec = spec_from_fields(response_format, structured)
    except ValueError as exc:
        raise OpenAIError(str(exc), param=param, code="invalid_value") from exc
    if spec is None:
        return None
    return _compile(spec, replica, param)


def _compile(spec: GrammarSpec, replica: Replica, param: str) -> Any:
    if not replica.engine.backend.has_logits:
        raise OpenAIError(
            "structured output is not available: the simulated engine computes no logits "
            "to constrain; leave it out",
            param=param,
            code="unsupported_value",
        )
    try:
        return replica.grammars().compile(spec)
    except ValueError as exc:
        raise OpenAIError(str(exc), param=param, code="invalid_value") from exc


def _warn_tools_ignored(model: str, replica: Replica) -> None:
    if model in replica.tools_ignored_warned:
        return
    replica.tools_ignored_warned.add(model)
    log.warning(
        "model %s: its chat template never reads `tools`, so tool definitions do not reach "
        "the prompt (as with vLLM); start the replica and the gateway with "
        "--chat-template FILE to use a tool-aware template",
        model,
    )


def jobs_from_completion(body: object, replica: Replica) -> list[Job]:
    """A completion request's jobs: one, or one per prompt of a batch (vLLM's list
    ``prompt``), which share the answer's id (replica/respond.py, ``run_batch``)."""
    req = parse_request(CompletionRequest, body)
    if req.prompt_embeds:
        raise OpenAIError(
            "prompt_embeds is not supported by this replica; send the prompt as text or token ids",
            param="prompt_embeds",
            code="unsupported_value",
        )
    assert req.prompt is not None  # the wire wants a prompt or embeddings
    _check_limits(req)  # before any encoding
    model = check_model(req.model, replica)
    if req.batch_size == 1:
        return [_completion_job(req, model, req.single_prompt(), replica)]
    limit = replica.engine.config.max_waiting
    if req.batch_size > limit:  # it could never all queue: refused before any is encoded
        raise OpenAIError(
            f"a batch of {req.batch_size} prompts is more than this replica queues "
            f"(max_waiting={limit}); send at most {limit} per request",
            param="prompt",
            code="invalid_value",
        )
    first = _completion_job(req, model, req.prompt[0], replica)  # type: ignore[arg-type]
    first.part = 0
    jobs = [first]
    for i, prompt in enumerate(req.prompt[1:], start=1):
        job = _completion_job(req, model, prompt, replica)  # type: ignore[arg-type]
        job.response_id, job.created, job.part = first.response_id, first.created, i
        jobs.append(job)
    return jobs


def _completion_job(
    req: CompletionRequest, model: str, prompt: str | list[int], replica: Replica
) -> Job:
    tokenizer = replica.loaded.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt", code="invalid_value")
        max_context = int(replica.loaded.max_context)
        encode = tokenizer.encode if req.add_special_tokens else tokenizer.encode_rendered
        prompt_ids = encode_within(encode, prompt, max_context, "prompt")
        prompt_text = prompt
    else:
        check_in_vocab(prompt, _vocab_size(replica), "prompt")
        prompt_ids = list(prompt)
        prompt_text = tokenizer.decode(prompt_ids) if req.echo else ""
    params = _sampling(req, req.max_new_tokens, len(prompt_ids), replica, "prompt")
    params.grammar = _grammar(req, replica)
    return Job(
        chat=False,
        response_id=fmt.new_id("cmpl"),
        model=model,
        created=fmt.now(),
        prompt_ids=prompt_ids,
        params=params,
        salt=req.cache_salt or "",
        stream=req.stream,
        include_usage=req.include_usage,
        echo=req.echo,
        # vLLM leaves the echoed text out when the prompt's ids are returned instead.
        echo_prefix=prompt_text if req.echo and not _flag(req, "return_token_ids") else "",
        echo_only=req.echo_only,
        return_token_ids=_flag(req, "return_token_ids"),
        token_id_strings=_flag(req, "return_tokens_as_token_ids"),
    )


def check_model(name: str, replica: Replica) -> str:
    if name not in replica.model_ids:
        raise OpenAIError(
            f"The model `{name}` does not exist on this replica; it serves "
            f"{', '.join(replica.model_ids)} (see GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
    return name


def _vocab_size(replica: Replica) -> int:
    return int(replica.loaded.vocab_size)


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_new_tokens: int | None,
    n_prompt: int,
    replica: Replica,
    prompt_param: str,
) -> SamplingParams:
    _refuse_what_it_cannot_do(req)
    counts = [("prompt_logprobs", req.prompt_logprobs)]
    counts.append(
        ("top_logprobs", req.top_logprobs)
        if isinstance(req, ChatCompletionRequest)
        else ("logprobs", req.logprobs)
    )
    for param, k in counts:
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            asked = "every token's (-1)" if k < 0 else str(k)
            raise OpenAIError(
                f"Requested {asked} log probabilities, which is more than this replica "
                f"gives: at most {MAX_LOGPROBS}",
                param=param,
                code="invalid_value",
            )
    vocab = _vocab_size(replica)
    logit_bias = req.logit_bias_ids
    check_in_vocab(list(logit_bias), vocab, "logit_bias")
    check_in_vocab(req.stop_token_ids or [], vocab, "stop_token_ids")
    check_in_vocab(req.allowed_token_ids or [], vocab, "allowed_token_ids")
    max_context = int(replica.loaded.max_context)
    if n_prompt >= max_context:
        raise OpenAIError(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"prompt has {n_prompt} tokens; shorten it to leave room for the completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_context - n_prompt
    if max_new_tokens is not None and max_new_tokens > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {n_prompt + max_new_tokens} tokens ({n_prompt} in the prompt, "
            f"{max_new_tokens} for the completion). Lower max_tokens to at most {room}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_new_tokens if max_new_tokens is not None else room,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop_list,
        stop_token_ids=list(req.stop_token_ids or []),
        n=req.n,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens,
        allowed_token_ids=req.allowed_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=req.logprobs_count,
        prompt_logprobs=req.prompt_logprobs_count,
    )


# This replica's limits (the gateway's wire takes more: an engine sets its own).
MAX_N = 16  # choices: each holds blocks of its own once it writes
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024  # per stop string: the matcher holds back up to this much text
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_BIAS = 100.0  # OpenAI's range, -100 to 100
MAX_REPETITION_PENALTY = 2.0


def _check_limits(req: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the field for what is beyond this replica's limits."""

    def refuse(param: str, message: str) -> None:
        raise OpenAIError(f"{param}: {message}", param=param, code="invalid_value")

    if req.n > MAX_N:
        refuse("n", f"Input should be less than or equal to {MAX_N}")
    stops = req.stop_list
    if len(stops) > MAX_STOP_SEQUENCES:
        refuse("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        refuse("stop", f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
    if len(req.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        refuse("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    bias = req.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        refuse("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids may be biased")
    for token, value in bias.items():
        if not -MAX_BIAS <= value <= MAX_BIAS:
            refuse("logit_bias", f"biases must be between -100 and 100, got {value} for {token}")
    if (req.repetition_penalty or 1.0) > MAX_REPETITION_PENALTY:
        refuse(
            "repetition_penalty",
            f"Input should be less than or equal to {MAX_REPETITION_PENALTY:g}",
        )


# vLLM's request fields this replica cannot honour, each with the value that asks for
# nothing: any other value is a 400, never an answer that silently ignores it.
_NOT_DONE: dict[str, object] = {
    "use_beam_search": False,
    "bad_words": [],
    "logprob_token_ids": None,
    "thinking_token_budget": None,
    "truncate_prompt_tokens": None,
    "chat_template": None,  # vLLM too refuses it, unless started to trust it
    "echo": False,  # a chat's (a completion's echo is done)
}


def _flag(req: ChatCompletionRequest | CompletionRequest, name: str) -> bool:
    """One of vLLM's boolean extras (kept as extra fields: the gateway passes them on)."""
    value = (req.model_extra or {}).get(name)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"{name}: must be a boolean", param=name, code="invalid_value")
    return value is True


def _refuse_what_it_cannot_do(req: ChatCompletionRequest | CompletionRequest) -> None:
    extra = req.model_extra or {}  # (a completion's ``echo`` is a field: never here)
    for name, neutral in _NOT_DONE.items():
        value = extra.get(name)
        if value is None or value == neutral:
            continue
        if name == "chat_template":
            raise OpenAIError(
                "Chat template is passed with request, but this replica uses its own (or "
                "--chat-template); refused, as vLLM refuses it without "
                "--trust-request-chat-template.",
                param=name,
            )
        raise OpenAIError(
            f"{name} is not supported by this replica; leave it out (it would be ignored, "
            "and the answer would not be what was asked for)",
            param=name,
            code="unsupported_value",
        )


def check_in_vocab(token_ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(
            f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
            param=param,
            code="invalid_value",
        )
