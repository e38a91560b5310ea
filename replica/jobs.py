"""From an OpenAI request body to what the engine runs: prompt ids, sampling, salt.

Everything a user can get wrong is checked here, before the engine sees the request, and
raised as an ``OpenAIError`` that names the field and what to fix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefixgate.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_request,
)
from replica import openai_format as fmt
from replica.metrics import ReplicaMetrics
from replica.request import SamplingParams
from replica.state import Replica


@dataclass(slots=True)
class Job:
    """One accepted request, ready to submit."""

    chat: bool
    response_id: str  # "chatcmpl-…" / "cmpl-…"; also the engine's request id
    model: str
    created: int
    prompt_ids: list[int]
    params: SamplingParams
    salt: str
    stream: bool
    include_usage: bool
    echo_prefix: str = ""  # completions with echo=true: the prompt text goes first

    @property
    def engine_request_id(self) -> str:
        return self.response_id


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


def job_from_chat(body: object, replica: Replica) -> Job:
    req = parse_request(ChatCompletionRequest, body)
    model = _check_model(req.model, replica)
    messages = req.template_messages()
    encoder = replica.chats or replica.loaded.tokenizer
    prompt_ids = list(encoder.encode_chat(messages, add_generation_prompt=True))
    params = _sampling(req, req.max_new_tokens, len(prompt_ids), replica, "messages")
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
    )


def job_from_completion(body: object, replica: Replica) -> Job:
    req = parse_request(CompletionRequest, body)
    model = _check_model(req.model, replica)
    prompt = req.single_prompt()
    tokenizer = replica.loaded.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt", code="invalid_value")
        prompt_ids = list(tokenizer.encode(prompt))
        prompt_text = prompt
    else:
        _check_in_vocab(prompt, _vocab_size(replica), "prompt")
        prompt_ids = list(prompt)
        prompt_text = tokenizer.decode(prompt_ids) if req.echo else ""
    params = _sampling(req, req.max_new_tokens, len(prompt_ids), replica, "prompt")
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
        echo_prefix=prompt_text if req.echo else "",
    )


def _check_model(name: str, replica: Replica) -> str:
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
    refused = req.wants_logprobs
    if refused is not None:
        raise OpenAIError(
            f"{refused} is not supported by this replica; leave it out (or false/null)",
            param=refused,
            code="unsupported_value",
        )
    vocab = _vocab_size(replica)
    logit_bias = req.logit_bias_ids
    _check_in_vocab(list(logit_bias), vocab, "logit_bias")
    _check_in_vocab(req.stop_token_ids or [], vocab, "stop_token_ids")
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
    )


def _check_in_vocab(token_ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(
            f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
            param=param,
            code="invalid_value",
        )
